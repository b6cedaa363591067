"""The word-level vocabulary of the synthetic retrieval tasks and its Hugging Face tokenizer.

Token ids, in this order (1024 in all):
  0-3      <pad> <s> </s> <unk>
  4-24     punctuation and the task templates' words      ([template] in words.txt)
  25-124   the numbers 0 … 99 (answer values)
  125-378  key words (animals, fruit, objects)            ([keys])
  379-506  variable names, three capital letters           ([variables])
  507-1023 filler words                                    ([filler])
The word groups are disjoint, so filler text never contains a needle's words.

The saved tokenizer is a `tokenizers` WordLevel model behind the Whitespace pre-tokenizer (splits
on `\\w+|[^\\w\\s]+`) with a post-processor that prepends <s>, so that
`AutoTokenizer.from_pretrained(dir)(text)["input_ids"]` of a sample's text equals the
generator's `input_ids`. `tokenizer_class` is `PreTrainedTokenizerFast`, which transformers 4.x
and 5.x both load as a fast tokenizer.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Mapping

import numpy as np

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)
NUM_NUMBERS = 100
WORDS_FILE = Path(__file__).resolve().parent / "words.txt"
GROUPS = ("template", "keys", "variables", "filler")


@functools.lru_cache(maxsize=None)
def word_lists() -> dict[str, tuple[str, ...]]:
    """The `[section]` word lists of words.txt."""
    sections: dict[str, list[str]] = {}
    current = None
    for line in WORDS_FILE.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
        elif current is None:
            raise ValueError(f"{WORDS_FILE}: words before the first [section]: {line!r}")
        else:
            current.extend(line.split())
    if tuple(sections) != GROUPS:
        raise ValueError(f"{WORDS_FILE} has sections {tuple(sections)}: expected {GROUPS}")
    return {name: tuple(words) for name, words in sections.items()}


def vocabulary() -> tuple[str, ...]:
    """All tokens in id order."""
    w = word_lists()
    numbers = tuple(str(n) for n in range(NUM_NUMBERS))
    words = SPECIAL_TOKENS + w["template"] + numbers + w["keys"] + w["variables"] + w["filler"]
    if len(set(words)) != len(words):
        raise ValueError(f"{WORDS_FILE}: a word appears twice across sections")
    return words


@dataclasses.dataclass(frozen=True, eq=False)
class Vocab:
    """Token ids by word, plus the id arrays of each word group the generators draw from."""
    ids: Mapping[str, int]
    words: tuple[str, ...]    # id -> word; "" for ids the mapping does not use
    numbers: np.ndarray       # [100] ids of "0" … "99"
    keys: np.ndarray
    variables: np.ndarray
    filler: np.ndarray

    @classmethod
    def from_mapping(cls, ids: Mapping[str, int]) -> "Vocab":
        """From any word -> id mapping holding every word of words.txt, e.g. `tok.get_vocab()`."""
        missing = [w for w in vocabulary() if w not in ids]
        if missing:
            raise ValueError(f"tokenizer vocabulary lacks {len(missing)} task words, e.g. "
                             f"{missing[:5]}: expected a vocabulary built by "
                             "sparsejax.train.tokenizer")
        words = [""] * (max(ids.values()) + 1)
        for w, i in ids.items():
            words[i] = w
        lists = word_lists()
        arr = lambda ws: np.asarray([ids[w] for w in ws], np.int32)  # noqa: E731
        return cls(ids=dict(ids), words=tuple(words),
                   numbers=arr(str(n) for n in range(NUM_NUMBERS)), keys=arr(lists["keys"]),
                   variables=arr(lists["variables"]), filler=arr(lists["filler"]))

    def __getitem__(self, word: str) -> int:
        return self.ids[word]

    def __len__(self) -> int:
        return len(self.words)

    def encode(self, text: str) -> np.ndarray:
        """Space-separated words -> ids [n] int32 (no <s>)."""
        try:
            return np.asarray([self.ids[w] for w in text.split()], np.int32)
        except KeyError as e:
            raise ValueError(f"word {e.args[0]!r} of {text!r} is not in the vocabulary") from None

    def decode(self, ids) -> str:
        """ids -> space-separated words (the text the tokenizer maps back to these ids)."""
        return " ".join(self.words[int(i)] for i in np.asarray(ids).reshape(-1))


@functools.lru_cache(maxsize=None)
def default_vocab() -> Vocab:
    return Vocab.from_mapping({w: i for i, w in enumerate(vocabulary())})


def as_vocab(tokenizer_vocab: Vocab | Mapping[str, int] | None) -> Vocab:
    """`None` -> the default vocabulary; a mapping (e.g. a loaded tokenizer's `get_vocab()`)
    -> a `Vocab` over its ids."""
    if tokenizer_vocab is None:
        return default_vocab()
    if isinstance(tokenizer_vocab, Vocab):
        return tokenizer_vocab
    return Vocab.from_mapping(tokenizer_vocab)


def build_tokenizer():
    """The `tokenizers.Tokenizer` of `vocabulary()`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {w: i for i, w in enumerate(vocabulary())}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL_TOKENS[UNK_ID]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    bos = SPECIAL_TOKENS[BOS_ID]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, BOS_ID)])
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def save_tokenizer(path: str | Path, model_max_length: int) -> Path:
    """Write tokenizer.json + tokenizer_config.json into `path` (two files, nothing else)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[BOS_ID], "eos_token": SPECIAL_TOKENS[EOS_ID],
        "pad_token": SPECIAL_TOKENS[PAD_ID], "unk_token": SPECIAL_TOKENS[UNK_ID],
        "model_max_length": int(model_max_length),
        "padding_side": "right",
        "clean_up_tokenization_spaces": False,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path
