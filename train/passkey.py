"""Multi-passkey retrieval data for head-gate training (DuoAttention's setup, as LycheeDecode
trains on it): ten 32-word passkeys inserted at random depths into filler text; the targets are
a question and its answer per passkey, read back in order.

    prompt    [<s>] filler … needle_1 … needle_2 … needle_n … filler
    needle_i  the special magic number for <key_i> <w_1> … <w_32> .
    targets   for each i:  what is the special magic number for <key_i> ? answer :
                           the special magic number for <key_i> <w_1> … <w_32> .
Keys are distinct words of words.txt's [keys] list; passkey words are the numbers 0–99, drawn
uniformly. The phrases use only the word-level vocabulary of the shipped model
(`sparsejax.train.tokenizer`), so they tokenize without <unk> there, and they are plain
English words for any other tokenizer. Each phrase is tokenized once through the tokenizer's
API (`tokenizer(texts, add_special_tokens=False)`) and samples are assembled from token ids.

Filler: a text file (tokenized once; each prompt reads a window at a random offset, wrapping
around), or by default random sentences of words.txt's [filler] words. Needles go in at
uniformly drawn token offsets of the filler, in order.

Prompt lengths (in tokens, needles included) are uniform in [min_length, max_length]. Batch
`step` is a pure function of (seed, step): a resumed run reads the same batches.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from .tokenizer import word_lists

NUMBERS = tuple(str(n) for n in range(100))
SENTENCE_WORDS = 10          # mean filler words per sentence
_PHRASES = {
    "needle": "the special magic number for", "end": ".",
    "ask": "what is the special magic number for", "restate": "? answer : the special magic "
    "number for",
}


class GateBatch(NamedTuple):
    """Prompt + targets, teacher-forced, with the target positions the loss reads."""
    tokens: np.ndarray            # [B, W] int32: prompt, then the targets, right-padded
    prompt_lengths: np.ndarray    # [B] int32
    target_positions: np.ndarray  # [B, A] int32: prompt_length + j (j < A, padding included)
    target_mask: np.ndarray       # [B, A] float32: 1 on real target tokens


@dataclasses.dataclass(frozen=True, eq=False)
class PasskeyData:
    """Batches `batch(step)` of multi-passkey prompts tokenized by `tokenizer` (a Hugging Face
    tokenizer, e.g. `sparsejax.load_tokenizer(model_dir)`)."""
    tokenizer: Any
    min_length: int = 1024
    max_length: int = 4096
    batch_size: int = 1
    num_passkeys: int = 10
    passkey_words: int = 32
    filler: str | Path | tuple | None = None   # a text file, or files read as documents
    seed: int = 0
    _ids: dict = dataclasses.field(init=False, repr=False)

    def __post_init__(self):
        for name in ("min_length", "max_length", "batch_size", "num_passkeys", "passkey_words"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name}={value!r}: expected an int >= 1")
        keys = word_lists()["keys"]
        if self.num_passkeys > len(keys):
            raise ValueError(f"num_passkeys={self.num_passkeys}: expected at most {len(keys)} "
                             "(one distinct key word each)")
        if self.min_length > self.max_length:
            raise ValueError(f"min_length={self.min_length} > max_length={self.max_length}")
        ids = {name: _encode(self.tokenizer, [text])[0] for name, text in _PHRASES.items()}
        ids["keys"] = _encode(self.tokenizer, keys)
        ids["numbers"] = _encode(self.tokenizer, NUMBERS)
        bos = getattr(self.tokenizer, "bos_token_id", None)
        ids["prefix"] = np.asarray([] if bos is None else [bos], np.int32)
        if self.filler is None:
            words = word_lists()["filler"]
            ids["filler_words"] = _encode(self.tokenizer, words)
            ids["period"] = ids["end"]
        else:
            ids["haystack"] = np.concatenate(_encode(self.tokenizer, self._filler_texts()))
            if ids["haystack"].size == 0:
                raise ValueError(f"filler={str(self.filler)!r} holds no tokens")
        object.__setattr__(self, "_ids", ids)
        longest_prompt_part = ids["prefix"].size + self.num_passkeys * self._bound(
            "needle", "key", "answer")
        if self.min_length <= longest_prompt_part:
            raise ValueError(
                f"min_length={self.min_length} cannot hold {self.num_passkeys} passkeys of "
                f"{self.passkey_words} words: expected more than {longest_prompt_part} tokens")

    def _filler_paths(self) -> list:
        return [self.filler] if isinstance(self.filler, (str, Path)) else list(self.filler)

    def _filler_texts(self) -> list[str]:
        """The filler's documents (`train.documents.read_documents`; a single path keeps its
        whole text as one document), in order: the haystack is their tokens end to end."""
        from .documents import read_documents

        return read_documents(self._filler_paths())

    # ---- static shapes ------------------------------------------------------------------------
    def _bound(self, *parts) -> int:
        """Most tokens of a sequence of phrases; "key" and "answer" at their longest."""
        i = self._ids
        key = max(k.size for k in i["keys"])
        answer = (self.passkey_words * max(n.size for n in i["numbers"])
                  + i["end"].size)
        longest = {"key": key, "answer": answer}
        return sum(longest[p] if p in longest else i[p].size for p in parts)

    @property
    def target_width(self) -> int:
        """Target tokens per row (A): the longest question + answer, per passkey."""
        return self.num_passkeys * self._bound("ask", "key", "restate", "key", "answer")

    @property
    def width(self) -> int:
        """Tokens per row (W): the longest prompt and the target width."""
        return self.max_length + self.target_width

    def describe(self) -> dict:
        """What determines the batches (stored with checkpoints, compared on resume)."""
        vocab = sorted(self.tokenizer.get_vocab().items())
        filler = "builtin"
        if self.filler is not None:
            digest = hashlib.sha256("\0".join(self._filler_texts()).encode()).hexdigest()[:16]
            filler = f"{','.join(Path(f).name for f in self._filler_paths())}:{digest}"
        return {"kind": "passkey", "min_length": int(self.min_length),
                "max_length": int(self.max_length), "batch_size": int(self.batch_size),
                "num_passkeys": int(self.num_passkeys), "passkey_words": int(self.passkey_words),
                "filler": filler, "seed": int(self.seed),
                "tokenizer": hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]}

    # ---- samples ------------------------------------------------------------------------------
    def sample(self, step: int, row: int) -> tuple[np.ndarray, np.ndarray]:
        """(prompt ids, target ids) of row `row` of batch `step`."""
        i = self._ids
        rng = np.random.default_rng((int(self.seed), int(step), int(row)))
        length = int(rng.integers(self.min_length, self.max_length + 1))
        keys = rng.choice(len(i["keys"]), self.num_passkeys, replace=False)
        words = rng.integers(0, len(NUMBERS), (self.num_passkeys, self.passkey_words))
        needles, targets = [], []
        for key, passkey in zip(keys, words):
            key_ids = i["keys"][key]
            answer = [*(i["numbers"][w] for w in passkey), i["end"]]
            needles.append(np.concatenate([i["needle"], key_ids, *answer]))
            targets += [i["ask"], key_ids, i["restate"], key_ids, *answer]
        num_filler = length - i["prefix"].size - sum(n.size for n in needles)
        haystack = self._haystack(rng, num_filler)
        cuts = np.sort(rng.integers(0, num_filler + 1, self.num_passkeys))
        pieces = [i["prefix"]]
        for start, stop, needle in zip(np.r_[0, cuts[:-1]], cuts, needles):
            pieces += [haystack[start:stop], needle]
        pieces.append(haystack[cuts[-1]:])
        return (np.concatenate(pieces).astype(np.int32),
                np.concatenate(targets).astype(np.int32))

    def _haystack(self, rng: np.random.Generator, n: int) -> np.ndarray:
        i = self._ids
        if self.filler is not None:
            text = i["haystack"]
            start = int(rng.integers(text.size))
            return np.resize(np.roll(text, -start), n)
        # one sentence end per SENTENCE_WORDS words on average; every word is >= 1 token
        chosen = [i["filler_words"][w] for w in rng.integers(0, len(i["filler_words"]), n)]
        for w in np.flatnonzero(rng.random(n) < 1.0 / SENTENCE_WORDS):
            chosen[w] = i["period"]
        return np.concatenate(chosen)[:n]

    def batch(self, step: int) -> GateBatch:
        B, W, A = self.batch_size, self.width, self.target_width
        pad = getattr(self.tokenizer, "pad_token_id", None) or 0
        tokens = np.full((B, W), pad, np.int32)
        prompt_lengths = np.zeros(B, np.int32)
        mask = np.zeros((B, A), np.float32)
        for row in range(B):
            prompt, targets = self.sample(step, row)
            P, n = prompt.size, targets.size
            tokens[row, :P] = prompt
            tokens[row, P:P + n] = targets
            prompt_lengths[row] = P
            mask[row, :n] = 1.0
        positions = (prompt_lengths[:, None] + np.arange(A, dtype=np.int32)).astype(np.int32)
        return GateBatch(tokens, prompt_lengths, positions, mask)


def _encode(tokenizer, texts) -> list[np.ndarray]:
    """Token ids of each text (no special tokens); a leading space keeps BPE tokenizers from
    gluing a piece onto the one before it."""
    encoded = tokenizer([" " + t for t in texts], add_special_tokens=False)["input_ids"]
    return [np.asarray(ids, np.int32) for ids in encoded]
