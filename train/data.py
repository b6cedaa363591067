"""Synthetic long-context retrieval tasks (RULER-style), generated on the fly over the word-level
vocabulary of `sparsejax.train.tokenizer`.

Every prompt is exactly `context` tokens: <s>, a haystack of filler sentences (random filler
words) with the task's needles inserted at sentence starts, then the question. The answer
follows the prompt and ends with </s>. Values are three number tokens drawn uniformly from 0–99
(10⁶ values); keys and variable names come from their own word lists, disjoint from the filler,
so an answer can only be read from the context.

  niah        needle    the special magic number for <key> <v1> <v2> <v3> .
              question  what is the special magic number for <key> ? answer :
                        the special magic number for <key>
              answer    <v1> <v2> <v3> </s>
  multikey    4 such needles with distinct keys in random order; the question asks for one.
  multivalue  4 needles of one key with different values;
              question  what are all the special magic numbers for <key> ? answer :
                        the special magic number for <key>
              answer    <a1> <a2> <a3> , <b1> <b2> <b3> , … </s>   (in order of appearance)
  vt          a chain  var X1 = <v1> <v2> <v3> .  var X2 = X1 .  …  var X5 = X4 .  in order,
              interleaved with a distractor chain of another value and other names;
              question  which variables have the value <v1> <v2> <v3> ? answer :
              answer    X1 X2 X3 X4 X5 </s>
The questions end, as RULER's do, by restating the needle up to the answer, and the value
follows its key directly: the first answer token is what followed the current token (the key)
in the context, the plain induction match, and each further token what followed the previous
one. Training also reads "copy" (TRAIN_TASKS), which needs that match and nothing else
(`sparsejax.train.pretrain` says why it comes first).

Sample `index` of (seed, task, context) is always the same: its random stream is seeded from
exactly those four numbers.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import threading
from typing import Mapping, NamedTuple, Sequence

import numpy as np

from .tokenizer import BOS_ID, EOS_ID, PAD_ID, Vocab, as_vocab

TASKS = ("niah", "multikey", "multivalue", "vt")
# Training also reads "copy": a random sequence of number and key tokens in the haystack; the
# question gives its first COPY_PROMPT_TOKENS and the answer is the rest. Only an induction head
# (attend to the token after the last occurrence of the current one, copy it) solves it, so the
# content match that multikey and vt need forms early instead of position-based copying.
TRAIN_TASKS = TASKS + ("copy",)
COPY_TOKENS = 12
COPY_PROMPT_TOKENS = 2
VALUE_TOKENS = 3          # number tokens per value
MULTIKEY_NEEDLES = 4      # one asked for, three distractors
MULTIVALUE_NEEDLES = 4
VT_VARIABLES = 5          # one assignment of the value, then four hops
MAX_ANSWER_TOKENS = MULTIVALUE_NEEDLES * (VALUE_TOKENS + 1)   # the longest answer, with </s>
MEAN_SENTENCE_TOKENS = 10


@dataclasses.dataclass(frozen=True, eq=False)
class Sample:
    task: str
    input_ids: np.ndarray          # [context] int32: <s>, haystack, question (up to the answer)
    answer_ids: np.ndarray         # [n] int32: the answer tokens, then </s>
    needle_positions: tuple[int, ...]      # start of each needle the answer is read from
    distractor_positions: tuple[int, ...]  # start of every other needle
    seed: int
    index: int

    @property
    def context(self) -> int:
        return int(self.input_ids.shape[0])


# ---- the tasks: needles (in order of appearance), question, answer --------------------------
class _Task(NamedTuple):
    needles: list[list[int]]
    is_target: list[bool]
    question: list[int]
    answer: list[int]              # without </s>


_PHRASES = {
    "needle": "the special magic number for", ".": ".", ",": ",", "var": "var",
    "=": "=", "ask_one": "what is the special magic number for",
    "ask_all": "what are all the special magic numbers for",
    "ask_vars": "which variables have the value", "end": "? answer :",
}


class _Ids(NamedTuple):
    """A vocabulary's ids as Python lists, for the generators' small draws."""
    phrase: dict[str, list[int]]
    numbers: list[int]
    keys: list[int]
    variables: list[int]


@functools.lru_cache(maxsize=8)
def _ids(vocab: Vocab) -> _Ids:
    return _Ids({name: vocab.encode(text).tolist() for name, text in _PHRASES.items()},
                vocab.numbers.tolist(), vocab.keys.tolist(), vocab.variables.tolist())


class _Draws:
    """Uniform draws taken from a sample's Generator in blocks and spent in Python: a sample
    needs a few dozen small draws, and each numpy call costs microseconds."""

    def __init__(self, rng: np.random.Generator):
        self._rng, self._u = rng, []

    def below(self, n: int) -> int:
        """An int in [0, n)."""
        if not self._u:
            self._u = self._rng.random(64).tolist()[::-1]
        return int(self._u.pop() * n)

    def distinct(self, items: list[int], k: int) -> list[int]:
        picked: list[int] = []
        while len(picked) < k:
            item = items[self.below(len(items))]
            if item not in picked:
                picked.append(item)
        return picked

    def values(self, numbers: list[int], n: int) -> list[list[int]]:
        """n distinct values of VALUE_TOKENS number tokens."""
        values: list[list[int]] = []
        while len(values) < n:
            value = [numbers[self.below(len(numbers))] for _ in range(VALUE_TOKENS)]
            if value not in values:
                values.append(value)
        return values


def _magic_needle(p: dict, key: int, value: list[int]) -> list[int]:
    return p["needle"] + [key] + value + p["."]


def _niah(draw: _Draws, ids: _Ids) -> _Task:
    return _keys_task(draw, ids, 1)


def _multikey(draw: _Draws, ids: _Ids) -> _Task:
    return _keys_task(draw, ids, MULTIKEY_NEEDLES)


def _keys_task(draw: _Draws, ids: _Ids, num_keys: int) -> _Task:
    p = ids.phrase
    keys = draw.distinct(ids.keys, num_keys)
    values = draw.values(ids.numbers, num_keys)
    target = draw.below(num_keys)
    key = keys[target]
    question = p["ask_one"] + [key] + p["end"] + p["needle"] + [key]
    return _Task([_magic_needle(p, k, v) for k, v in zip(keys, values)],
                 [i == target for i in range(num_keys)], question, values[target])


def _multivalue(draw: _Draws, ids: _Ids) -> _Task:
    p = ids.phrase
    (key,) = draw.distinct(ids.keys, 1)
    values = draw.values(ids.numbers, MULTIVALUE_NEEDLES)
    question = p["ask_all"] + [key] + p["end"] + p["needle"] + [key]
    answer = values[0] + [t for v in values[1:] for t in p[","] + v]
    return _Task([_magic_needle(p, key, v) for v in values], [True] * MULTIVALUE_NEEDLES,
                 question, answer)


def _vt(draw: _Draws, ids: _Ids) -> _Task:
    p = ids.phrase
    names = draw.distinct(ids.variables, 2 * VT_VARIABLES)
    chains_names = [names[:VT_VARIABLES], names[VT_VARIABLES:]]
    values = draw.values(ids.numbers, 2)
    (var,), (eq,), (dot,) = p["var"], p["="], p["."]
    chains = [[[var, chain[0], eq, *value, dot]]
              + [[var, chain[i], eq, chain[i - 1], dot] for i in range(1, VT_VARIABLES)]
              for chain, value in zip(chains_names, values)]
    # interleave the chains at random (a Fisher-Yates shuffle of their labels), each in its
    # own order; chain 0 is asked for
    order = [0] * VT_VARIABLES + [1] * VT_VARIABLES
    for i in range(len(order) - 1, 0, -1):
        j = draw.below(i + 1)
        order[i], order[j] = order[j], order[i]
    position = [0, 0]
    needles, is_target = [], []
    for c in order:
        needles.append(chains[c][position[c]])
        is_target.append(c == 0)
        position[c] += 1
    question = p["ask_vars"] + values[0] + p["end"]
    return _Task(needles, is_target, question, chains_names[0])


def _copy(draw: _Draws, ids: _Ids) -> _Task:
    pool = ids.numbers + ids.keys
    sequence = [pool[draw.below(len(pool))] for _ in range(COPY_TOKENS)]
    return _Task([sequence + ids.phrase["."]], [True],
                 ids.phrase["end"] + sequence[:COPY_PROMPT_TOKENS], sequence[COPY_PROMPT_TOKENS:])


_BUILDERS = {"niah": _niah, "multikey": _multikey, "multivalue": _multivalue, "vt": _vt,
             "copy": _copy}


# ---- one sample -----------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def min_context(task: str) -> int:
    """The shortest prompt `make_sample` builds for `task` (no filler at all)."""
    t = _BUILDERS[_check_task(task)](_Draws(_generator(0)), _ids(as_vocab(None)))
    return 1 + sum(len(n) for n in t.needles) + len(t.question)


def make_sample(task: str, context: int, seed: int, index: int,
                tokenizer_vocab: Vocab | Mapping[str, int] | None = None) -> Sample:
    """Sample `index` of `task` with a prompt of exactly `context` tokens.

    `tokenizer_vocab`: a `Vocab`, a word -> id mapping such as a loaded tokenizer's
    `get_vocab()`, or None for the default vocabulary.
    """
    _check_task(task)
    vocab = as_vocab(tokenizer_vocab)
    for name, value in (("context", context), ("seed", seed), ("index", index)):
        if not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"{name}={value!r}: expected an int >= 0")
    rng = _generator(int(seed), TRAIN_TASKS.index(task), int(context), int(index))
    draw = _Draws(rng)
    t = _BUILDERS[task](draw, _ids(vocab))
    needle_tokens = sum(len(n) for n in t.needles)
    num_filler = context - 1 - needle_tokens - len(t.question)
    if num_filler < 1:
        raise ValueError(f"context={context} is too short for task {task!r}: expected at least "
                         f"{context - num_filler + 1} tokens")

    # one draw per filler token: the word, and a period with probability 1/MEAN_SENTENCE_TOKENS
    period, num_words = vocab["."], vocab.filler.shape[0]
    draws = (rng.random(num_filler) * (num_words * MEAN_SENTENCE_TOKENS)).astype(np.int64)
    filler = np.where(draws % MEAN_SENTENCE_TOKENS == 0, period,
                      vocab.filler[draws // MEAN_SENTENCE_TOKENS])
    filler[-1] = period   # the haystack ends a sentence before the question
    # needles go in at sentence starts, at uniformly drawn depths, keeping their order
    starts = [0] + (np.flatnonzero(filler == period) + 1).tolist()
    offsets = sorted(starts[draw.below(len(starts))] for _ in t.needles)

    pieces, positions = [[BOS_ID]], []
    cursor, length = 0, 1
    for offset, needle in zip(offsets, t.needles):
        pieces.append(filler[cursor:offset])
        length += offset - cursor
        positions.append(length)
        pieces.append(needle)
        length += len(needle)
        cursor = offset
    pieces += [filler[cursor:], t.question]
    input_ids = np.concatenate(pieces).astype(np.int32)
    assert input_ids.shape[0] == context
    return Sample(
        task=task, input_ids=input_ids,
        answer_ids=np.asarray(t.answer + [EOS_ID], np.int32),
        needle_positions=tuple(p for p, hit in zip(positions, t.is_target) if hit),
        distractor_positions=tuple(p for p, hit in zip(positions, t.is_target) if not hit),
        seed=int(seed), index=int(index))


_LOCAL = threading.local()


def _generator(*key: int) -> np.random.Generator:
    """The random stream of one sample: a per-thread PCG64 whose state is set from a hash of
    `key`. (A fresh Generator seeded through SeedSequence costs more than a short sample.)
    Valid until the thread's next call."""
    rng = getattr(_LOCAL, "rng", None)
    if rng is None:
        rng = _LOCAL.rng = np.random.Generator(np.random.PCG64())
    digest = hashlib.blake2b(repr(key).encode(), digest_size=32).digest()
    rng.bit_generator.state = {
        "bit_generator": "PCG64", "has_uint32": 0, "uinteger": 0,
        "state": {"state": int.from_bytes(digest[:16], "little"),
                  "inc": int.from_bytes(digest[16:], "little") | 1}}
    return rng


def _check_task(task: str) -> str:
    if task not in TRAIN_TASKS:
        raise ValueError(f"task={task!r}: expected one of {TRAIN_TASKS}")
    return task


def check_answer(generated_ids, sample: Sample) -> bool:
    """Exact match: the generated tokens start with the answer tokens followed by </s>."""
    generated = np.asarray(generated_ids).reshape(-1)
    n = sample.answer_ids.shape[0]
    return generated.shape[0] >= n and bool(np.array_equal(generated[:n], sample.answer_ids))


# ---- batches --------------------------------------------------------------------------------
def prompt_batch(samples: Sequence[Sample], length: int | None = None):
    """Right-padded prompts for `sparsejax.generate`: ids [B, T] int32, lengths [B] int32."""
    from sparsejax.tasks import right_pad

    return right_pad([s.input_ids[:s.context] for s in samples], PAD_ID, length)


class TrainBatch(NamedTuple):
    """Teacher-forced prompt + answer, with the positions whose next token is an answer token."""
    tokens: np.ndarray            # [B, T] int32, right-padded prompt + answer
    lengths: np.ndarray           # [B] int32 tokens the model reads (prompt + answer - 1)
    target_positions: np.ndarray  # [B, MAX_ANSWER_TOKENS] int32 positions predicting an answer
    targets: np.ndarray           # [B, MAX_ANSWER_TOKENS] int32 the answer tokens (0 where masked)
    target_mask: np.ndarray       # [B, MAX_ANSWER_TOKENS] float32 1 on real answer tokens
    task_ids: np.ndarray          # [B] int32 index into TRAIN_TASKS


def train_batch(samples: Sequence[Sample], seq_len: int) -> TrainBatch:
    """Samples -> a `TrainBatch` of width `seq_len` (>= longest prompt + MAX_ANSWER_TOKENS - 1)."""
    B, A = len(samples), MAX_ANSWER_TOKENS
    tokens = np.full((B, seq_len), PAD_ID, np.int32)
    lengths = np.zeros(B, np.int32)
    positions = np.zeros((B, A), np.int32)
    targets = np.zeros((B, A), np.int32)
    mask = np.zeros((B, A), np.float32)
    for row, s in enumerate(samples):
        P, n = s.context, s.answer_ids.shape[0]
        if P + n - 1 > seq_len:
            raise ValueError(f"seq_len={seq_len} cannot hold a {P}-token prompt and its "
                             f"{n}-token answer: expected >= {P + n - 1}")
        tokens[row, :P] = s.input_ids
        tokens[row, P:P + n - 1] = s.answer_ids[:-1]
        lengths[row] = P + n - 1
        positions[row, :n] = np.arange(P - 1, P + n - 1)
        targets[row, :n] = s.answer_ids
        mask[row, :n] = 1.0
    task_ids = np.asarray([TRAIN_TASKS.index(s.task) for s in samples], np.int32)
    return TrainBatch(tokens, lengths, positions, targets, mask, task_ids)
