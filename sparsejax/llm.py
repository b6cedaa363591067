"""Text in, text out, with vLLM's names: `LLM(path_or_id, method=...).generate(prompts,
SamplingParams(...)) -> [RequestOutput]`, and `LLM.chat(messages)` through the tokenizer's
chat template."""
from __future__ import annotations

import dataclasses
import math
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from sparsejax import methods as M
from sparsejax.cache import resolve_kv_dtype
from sparsejax.generate import generate
from sparsejax.models import from_pretrained, load_tokenizer
from sparsejax.models.loading import checkpoint_dir, generation_config

DEFAULT_MAX_TOKENS = 16     # vLLM's, where generation_config.json sets no max_new_tokens


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to generate, under vLLM's names. A field left None takes the checkpoint's default
    (`LLM.get_default_sampling_params`: generation_config.json as transformers reads it; greedy
    where it does not set do_sample).

    temperature: 0 is greedy. top_p: 1 keeps every token. top_k: -1 or 0 keeps every token.
    max_tokens: tokens generated at most. stop: strings that end the text, which keeps them
    (and the rest of the token that completes one), as transformers' `stop_strings` do.
    stop_token_ids: tokens that end it besides the checkpoint's EOS (kept in `token_ids`).
    seed: an int makes sampling reproducible (None: a fresh seed per call).
    logprobs: True (or 0) returns each chosen token's log-probability; an int n >= 1 also the
    n most likely tokens' at each step.
    """
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    seed: int | None = None
    logprobs: bool | int | None = None

    def __post_init__(self):
        t, p, k = self.temperature, self.top_p, self.top_k
        if t is not None and not (isinstance(t, (int, float)) and math.isfinite(t) and t >= 0):
            raise ValueError(f"temperature={t!r}: expected a finite number >= 0")
        if p is not None and not (isinstance(p, (int, float)) and 0 < p <= 1):
            raise ValueError(f"top_p={p!r}: expected 0 < top_p <= 1")
        if k is not None and not (_is_int(k) and k >= -1):
            raise ValueError(f"top_k={k!r}: expected an int >= 1 (-1 or 0: every token)")
        if self.max_tokens is not None and not (_is_int(self.max_tokens) and self.max_tokens >= 1):
            raise ValueError(f"max_tokens={self.max_tokens!r}: expected an int >= 1")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop={self.stop!r}: expected a non-empty string or a list of them")
        ids = tuple(self.stop_token_ids or ())
        if not all(_is_int(i) and i >= 0 for i in ids):
            raise ValueError(f"stop_token_ids={self.stop_token_ids!r}: expected token ids >= 0")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed={self.seed!r}: expected an int")
        lp = self.logprobs
        if lp is not None and not isinstance(lp, bool) and not (_is_int(lp) and lp >= 0):
            raise ValueError(f"logprobs={lp!r}: expected a bool or an int >= 0")
        object.__setattr__(self, "stop", stop if self.stop is not None else None)
        object.__setattr__(self, "stop_token_ids", ids if self.stop_token_ids is not None else None)

    def over(self, defaults: "SamplingParams") -> "SamplingParams":
        """These params, each field left None taken from `defaults`."""
        return dataclasses.replace(defaults, **{f.name: getattr(self, f.name)
                                                for f in dataclasses.fields(self)
                                                if getattr(self, f.name) is not None})


def _or(value, default):
    return default if value is None else value


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


class Logprob(NamedTuple):
    logprob: float
    rank: int | None = None          # 1 = the most likely token; None where not computed
    decoded_token: str | None = None


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None   # per token: the chosen one (+ the top n)
    finish_reason: str                           # "stop" or "length"
    stop_reason: int | str | None = None         # the stop token id or string; None for EOS


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True


class LLM:
    """A checkpoint (directory or Hub id), its tokenizer and a decoding method.

    method: None (dense), a method of `sparsejax.methods`, or a `methods.REGISTRY` name, run
    at `budget_ratio` of each row's own length (so a prompt's completion does not depend on
    the prompts batched with it) with what ships beside the checkpoint
    (`methods.fitted_beside`; `calibrated=False` keeps the defaults scaled to the depth).
    Prompts pad to a length bucket (`sparsejax.generate.bucket_length`): one compile serves
    every length in a bucket. dtype: "auto" is the checkpoint's (`from_pretrained`).
    kv_cache_dtype: what the KV cache stores (vLLM's name): "auto" the model's dtype, "bf16",
    "f32" or "fp8" (float8_e4m3fn with per-token scales; see `generate`'s kv_dtype).
    """

    def __init__(self, path_or_id: str | Path, *, method=None, dtype="auto",
                 budget_ratio: float = 0.1, calibrated: bool = True, kv_cache_dtype="auto"):
        if isinstance(method, str) and method not in M.REGISTRY:
            raise ValueError(f"method={method!r}: expected a method or one of {tuple(M.REGISTRY)}")
        if not 0 < budget_ratio <= 1:
            raise ValueError(f"budget_ratio={budget_ratio}: expected 0 < budget_ratio <= 1")
        self.path = checkpoint_dir(path_or_id)
        self.model = from_pretrained(self.path, dtype=dtype)
        resolve_kv_dtype(kv_cache_dtype, self.model.dtype)      # refused before any prompt
        self.kv_cache_dtype = kv_cache_dtype
        self.tokenizer = load_tokenizer(self.path)
        self.method, self.budget_ratio = method, budget_ratio
        self.fitted = (M.fitted_beside(self.path, self.model, calibrated)
                       if isinstance(method, str) else None)
        self.generation_config = generation_config(self.path)

    def method_for(self, context: int | None = None):
        """The method run on every prompt. A registry name's budget is a ratio of each row's
        own length, so the method is the same for any `context` (kept for older callers)."""
        if not isinstance(self.method, str):
            return self.method
        return M.REGISTRY[self.method].at_budget(self.model.config, M.Ratio(self.budget_ratio),
                                                 self.fitted)

    def get_default_sampling_params(self) -> SamplingParams:
        """The checkpoint's generation_config.json read as transformers does: sampled at its
        temperature / top_p / top_k (transformers' defaults 1.0 / 1.0 / 50) when do_sample is
        true, else greedy; max_new_tokens as max_tokens (else 16, vLLM's)."""
        g = self.generation_config
        sampled = bool(g.get("do_sample", False))
        top_k = g.get("top_k", 50)              # null in the file: no top-k
        return SamplingParams(
            temperature=float(_or(g.get("temperature"), 1.0)) if sampled else 0.0,
            top_p=float(_or(g.get("top_p"), 1.0)), top_k=0 if top_k is None else int(top_k),
            max_tokens=int(g.get("max_new_tokens") or DEFAULT_MAX_TOKENS), stop=(),
            stop_token_ids=(), logprobs=False)

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams]
                 | None = None) -> list[RequestOutput]:
        """Complete one prompt or a list: strings (tokenized with the tokenizer's special
        tokens, as vLLM does) or {"prompt_token_ids": [...]}. One RequestOutput per prompt,
        in order. `sampling_params`: one for all, or one per prompt (None: the checkpoint's,
        `get_default_sampling_params`). Prompts sharing params run as one batch."""
        single = isinstance(prompts, (str, Mapping))
        prompts = [prompts] if single else list(prompts)
        if not prompts:
            raise ValueError("prompts=[]: expected a prompt or a non-empty list of them")
        rows = [self._prompt_ids(p) for p in prompts]
        texts = [p if isinstance(p, str) else p.get("prompt") for p in prompts]
        return self._complete(rows, texts, sampling_params)

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams]
             | None = None, *, chat_template: str | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Complete one conversation ([{"role": ..., "content": ...}, ...]) or a list of them
        through the tokenizer's chat template, applied once to ids (its BOS is the only one)."""
        single = bool(messages) and isinstance(messages[0], Mapping)
        conversations = [messages] if single else list(messages)
        if not conversations or not all(
                isinstance(c, Sequence) and c and all(isinstance(m, Mapping) for m in c)
                for c in conversations):
            raise ValueError(f"messages={messages!r:.80}: expected a conversation (a list of "
                             "{'role': ..., 'content': ...}) or a list of conversations")
        kw = dict(chat_template=chat_template, add_generation_prompt=add_generation_prompt)
        try:
            rows = [_ids(self.tokenizer.apply_chat_template(c, tokenize=True, **kw))
                    for c in conversations]
            texts = [self.tokenizer.apply_chat_template(c, tokenize=False, **kw)
                     for c in conversations]
        except ValueError as e:   # no chat template, or a template that refuses the messages
            raise ValueError(f"the tokenizer of {self.path} cannot apply a chat template: {e} "
                             "(pass chat_template=)") from None
        return self._complete(rows, texts, sampling_params)

    # ---- the batches -----------------------------------------------------------------------
    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            ids = _ids(self.tokenizer(prompt)["input_ids"])
        elif isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
            ids = [int(i) for i in prompt["prompt_token_ids"]]
        else:
            raise ValueError(f"prompt {prompt!r:.80}: expected a string or "
                             "{'prompt_token_ids': [...]}")
        if not ids:
            raise ValueError(f"prompt {prompt!r:.80} has no tokens")
        return ids

    def _complete(self, rows, texts, sampling_params) -> list[RequestOutput]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(rows)
        sampling_params = list(sampling_params)
        if len(sampling_params) != len(rows) or not all(
                p is None or isinstance(p, SamplingParams) for p in sampling_params):
            raise ValueError(f"sampling_params: expected one SamplingParams or one per prompt "
                             f"({len(rows)}), got {len(sampling_params)} items")
        defaults = self.get_default_sampling_params()
        params = [defaults if p is None else p.over(defaults) for p in sampling_params]
        out: list[RequestOutput | None] = [None] * len(rows)
        for p in dict.fromkeys(params):                 # one batch per distinct params
            batch = [i for i, q in enumerate(params) if q == p]
            for i, completion in zip(batch, self._run([rows[i] for i in batch], p)):
                out[i] = RequestOutput(str(i), texts[i], rows[i], [completion])
        return out

    def _run(self, rows: list[list[int]], p: SamplingParams) -> list[CompletionOutput]:
        """One batch: the rows right-padded, generated together, cut at their stops."""
        lengths = np.asarray([len(r) for r in rows], np.int32)
        ids = np.zeros((len(rows), lengths.max()), np.int32)
        for i, row in enumerate(rows):
            ids[i, :len(row)] = row
        eos = self.model.config.eos_token_id
        eos = tuple(np.atleast_1d(eos).tolist()) if eos is not None else ()
        greedy = p.temperature == 0
        seed = p.seed if p.seed is not None or greedy else secrets.randbits(32)
        vocab = self.model.config.vocab_size
        out = generate(self.model, ids, lengths=lengths, max_new_tokens=p.max_tokens,
                       method=self.method_for(),
                       temperature=float(p.temperature),
                       top_k=None if greedy or p.top_k < 1 else min(p.top_k, vocab),
                       top_p=None if greedy or p.top_p >= 1 else float(p.top_p),
                       eos_token_id=eos + tuple(p.stop_token_ids), seed=seed,
                       logprobs=p.logprobs, kv_dtype=self.kv_cache_dtype)
        tokens, num = np.asarray(out.tokens), np.asarray(out.num_generated)
        chosen = None if out.logprobs is None else np.asarray(out.logprobs)
        top = None if out.top_logprobs is None else tuple(map(np.asarray, out.top_logprobs))
        return [self._completion(tokens[i, :num[i]].tolist(), i, p, eos, chosen, top)
                for i in range(len(rows))]

    def _completion(self, token_ids, row, p, eos, chosen, top) -> CompletionOutput:
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        finish, reason = "length", None
        if token_ids[-1] in eos or token_ids[-1] in p.stop_token_ids:
            finish = "stop"
            reason = token_ids[-1] if token_ids[-1] not in eos else None
        hit = stop_string_end(decode, token_ids, p.stop)
        if hit is not None:
            token_ids, finish, reason = token_ids[:hit[0]], "stop", hit[1]
        logprobs = cumulative = None
        if chosen is not None:
            logprobs = []
            for step, token in enumerate(token_ids):
                entry = {} if top is None else {
                    int(t): Logprob(float(v), rank + 1, decode([int(t)]))
                    for rank, (t, v) in enumerate(zip(top[0][row, step], top[1][row, step]))}
                if token not in entry:
                    entry = {token: Logprob(float(chosen[row, step]), None, decode([token])),
                             **entry}
                logprobs.append(entry)
            cumulative = float(np.sum(chosen[row, :len(token_ids)], dtype=np.float64))
        return CompletionOutput(0, decode(token_ids), token_ids, cumulative, logprobs, finish,
                                reason)


def stop_string_end(decode, token_ids: list[int], stop) -> tuple[int, str] | None:
    """(k, s): the first k tokens are the shortest prefix whose text (`decode`) holds a stop
    string s, where transformers' StopStringCriteria ends generation (at the token completing
    s, s kept); None where no stop string occurs."""
    if not stop:
        return None
    found = lambda k: next((s for s in stop if s in decode(token_ids[:k])), None)  # noqa: E731
    if found(len(token_ids)) is None:
        return None
    lo, hi = 1, len(token_ids)      # a prefix's text is a prefix of a longer one's: bisect
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if found(mid) is not None else (mid + 1, hi)
    return lo, found(lo)


def _ids(encoded) -> list[int]:
    """Token ids from a tokenizer's result: a list, or a BatchEncoding / dict of input_ids."""
    if isinstance(encoded, Mapping):
        encoded = encoded["input_ids"]
    return [int(i) for i in encoded]
