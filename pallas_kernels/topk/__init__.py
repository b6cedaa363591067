"""Top-k selection over score rows: the last step of every select layer.

`topk_select(scores, k, valid=..., k_row=..., force_first=..., force_last=...)` returns, per
row, the column indices of the `count` best valid columns, sorted ascending and padded with -1
to the static width k.

Order. Columns compare by score, ties go to the lower index. -inf ranks below every finite
score and NaN ranks below -inf (still valid, still selectable); -0.0 ties with +0.0. Columns
>= valid do not exist. Forced columns ([0, force_first) and [valid - force_last, valid), clipped
to the row) rank above everything and count toward the row's budget.

Count. count = min(valid, max(k_row, forced)) with forced = min(valid, force_first +
force_last): the forced columns are kept even where they outnumber k_row; when valid <= k_row
every valid column is kept. force_first + force_last > k is a ValueError (the forced columns
alone could overflow the buffer). k may exceed N (a budget larger than the context); the extra
slots stay -1.

The package, by concern:
  keys      the int32 order key every Pallas path selects on, and the kernel pieces they
            share (the keep that scatters kept columns to ascending slots, the -1 padding)
  per_row   many rows: one program per row, a bitwise search for the threshold
  split     few long rows: (row, chunk) programs, eight radix passes, no atomics
  sampled   wide rows: a threshold from a strided sample, then a select among candidates
  budgets   k_row per row for LycheeDecode's four budget modes and Kascade's ratio
`default_tuning` picks the path; `topk_select_reference` is the plain-jnp twin.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from sparsejax.pallas_kernels import common
from sparsejax.pallas_kernels.decode_attention import LogitRows
from .budgets import fixed_budget, ratio_budget, threshold_budget, top_p_budget
from .keys import FORCED_KEY, INT32_MAX, MISSING_KEY, _budget, _forced_mask, _order_key
from .per_row import RESIDENT_WIDTH, _per_row_knobs, _topk_pallas
from .sampled import SAMPLE_WIDTH, _topk_sampled_pallas, candidate_capacity
from .split import _topk_split_pallas

__all__ = ["LogitRows", "Selected", "candidate_capacity", "default_tuning", "fixed_budget",
           "ratio_budget", "threshold_budget", "top_p_budget", "topk_select",
           "topk_select_reference"]

# The path and chunk rule (`default_tuning`); docs/tuning.md has the sweeps behind it.
SPLIT_PROGRAMS_PER_SM = 4      # the split path aims for this many programs per SM
MAX_CHUNKS = 256               # every program folds the row's [chunks, 16] histograms per pass
# Few rows: a pass costs a program ~0.8 us per 1024 columns it scans, so rows that leave
# SMs idle take the narrowest chunk (from MIN_CHUNK columns) whose grid stays within
# FEW_ROWS_PROGRAMS_PER_SM programs per SM (1 x 32832: 19 us at 256 columns, 24 at 1024).
MIN_CHUNK = 256
FEW_ROWS_PROGRAMS_PER_SM = 2
# Fewer rows keep the split path: the sample's search and the candidates' select run one
# program per row, which on a few long rows costs more than the split path's passes.
MIN_SAMPLED_ROWS = 8
# Candidates beyond RESIDENT_WIDTH (budgets above ~30k) are streamed by their per-row select,
# up to this many; wider ones keep the split path.
MAX_CANDIDATES = 4 * RESIDENT_WIDTH

TUNING = ("split", "sample_stride", "block_rows", "block_n", "block_sel", "block_k",
          "num_warps", "num_stages")


class Selected(NamedTuple):
    indices: jax.Array  # [R, k] int32, ascending, -1 after count
    count: jax.Array    # [R] int32


def _check_logit_rows(rows: LogitRows):
    relative, block_max, lse = rows.relative, rows.block_max, rows.lse
    if relative.ndim != 3 or relative.dtype not in (jnp.float16, jnp.float32):
        raise ValueError(f"LogitRows.relative: shape={relative.shape} dtype={relative.dtype}: "
                         "expected [R, G, N] float16 or float32")
    num_rows, heads, n = relative.shape
    if not isinstance(rows.block_n, int) or rows.block_n < 1:
        raise ValueError(f"LogitRows.block_n={rows.block_n!r}: expected an int >= 1")
    want = (num_rows, heads, common.cdiv(n, rows.block_n))
    if block_max.shape != want or block_max.dtype != jnp.float32:
        raise ValueError(f"LogitRows.block_max: shape={block_max.shape} dtype="
                         f"{block_max.dtype}: expected {list(want)} float32")
    if lse is None and heads != 1:
        raise ValueError(f"LogitRows with lse=None and G={heads} heads: logits come one head "
                         "per row (G = 1)")
    if lse is not None and (lse.shape != (num_rows, heads) or lse.dtype != jnp.float32):
        raise ValueError(f"LogitRows.lse: shape={lse.shape} dtype={lse.dtype}: expected "
                         f"[{num_rows}, {heads}] float32")


def _check_inputs(scores, k, valid, k_row, force_first, force_last):
    if isinstance(scores, LogitRows):
        _check_logit_rows(scores)
    elif scores.ndim != 2 or scores.dtype != jnp.float32:
        raise ValueError(f"scores: shape={scores.shape} dtype={scores.dtype}: "
                         "expected a [R, N] float32 array or LogitRows")
    num_rows, _ = scores.shape
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"k={k!r}: expected a static int >= 1 (the output width)")
    for name, value in (("force_first", force_first), ("force_last", force_last)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name}={value!r}: expected a static int >= 0")
    if force_first + force_last > k:
        raise ValueError(f"force_first + force_last = {force_first} + {force_last} > k={k}: "
                         "the forced columns alone could overflow the output")
    for name, value in (("valid", valid), ("k_row", k_row)):
        if value is None:
            continue
        shape, dtype = jnp.shape(value), jnp.result_type(value)
        if shape != (num_rows,) or not jnp.issubdtype(dtype, jnp.integer):
            raise ValueError(f"{name}: shape={shape} dtype={dtype}: expected [{num_rows}] int "
                             f"(one per row of scores {scores.shape})")


def default_tuning(num_rows: int, n: int, k: int, *, split: bool | None = None,
                   sample_stride: int | None = None, block_rows: int | None = None,
                   block_n: int | None = None) -> dict:
    """Static knobs for [num_rows, n] scores and width k; `split`, `sample_stride`,
    `block_rows` and `block_n` when given are kept (for sweeps) and the knobs that depend on
    them follow.

    split: rows wider than RESIDENT_WIDTH (the per-row path would re-read them once per key
      bit); never when block_rows > 1 is asked for. A sample_stride > 0 asks for it. Few
      resident rows stay per-row too: one launch against nine wins even where the rows leave
      most SMs idle.
    sample_stride (split rows only): the sampled-threshold path, with a sample of about
      SAMPLE_WIDTH columns, for at least MIN_SAMPLED_ROWS rows wider than RESIDENT_WIDTH whose
      candidate capacity is at most MAX_CANDIDATES; else 0, the split path alone.
    Per-row path: block_rows=1, block_n = the row up to RESIDENT_WIDTH, num_warps and
      block_sel from `per_row._per_row_knobs` (1 warp per 1024 columns, 4 to 32, the keep
      from the resident row; 16 warps and 4096-column tiles at 16384), block_k <= 1024,
      num_stages=1.
    Split path: block_n = columns per program, for about SPLIT_PROGRAMS_PER_SM programs per
      SM (`common.num_sms()`; 1024 to 16384 columns, the whole row if shorter) and at most
      MAX_CHUNKS chunks per row, or narrower for few rows: the narrowest power of 2 from
      MIN_CHUNK whose grid is at most FEW_ROWS_PROGRAMS_PER_SM programs per SM;
      block_sel = 512 (a [512, 8] one-hot of bin pairs per histogram step), block_k = the
      padding slots per program up to 1024, num_warps=4, num_stages=1.
    Sampled path: the split path's knobs, for its count and compaction over the same chunks
      and for its fallback; the sample's search and the candidates' select take the per-row
      rule for rows of the sample's width and of the capacity.
    The measurements behind these rules are in docs/tuning.md.
    """
    if split is None:
        split = bool(sample_stride) or (block_rows in (None, 1) and n > RESIDENT_WIDTH)
    n_pow2 = common.next_power_of_2(n)
    if split and sample_stride is None:
        stride = max(1, n_pow2 // SAMPLE_WIDTH)
        wide = (n > RESIDENT_WIDTH and num_rows >= MIN_SAMPLED_ROWS
                and candidate_capacity(k, stride) <= MAX_CANDIDATES)
        sample_stride = stride if wide else 0
    if split:
        block_n = block_n or min(n_pow2, _split_chunk(num_rows, n))
        slots = common.cdiv(k, common.cdiv(n, block_n))
        return dict(split=True, sample_stride=sample_stride, block_rows=block_rows or 1,
                    block_n=block_n,
                    block_sel=min(block_n, 512),
                    block_k=min(common.next_power_of_2(slots), 1024), num_warps=4,
                    num_stages=1)
    block_rows = block_rows or 1
    block_n = block_n or min(n_pow2, RESIDENT_WIDTH)
    num_warps, block_sel = _per_row_knobs(block_rows, block_n)
    return dict(split=False, sample_stride=sample_stride or 0, block_rows=block_rows,
                block_n=block_n, block_sel=min(block_sel, n_pow2),
                block_k=min(common.next_power_of_2(k), 1024), num_warps=num_warps,
                num_stages=1)


def _split_chunk(num_rows: int, n: int) -> int:
    """The split path's columns per program (`default_tuning`)."""
    sms = common.num_sms()
    per_program = common.cdiv(num_rows * n, SPLIT_PROGRAMS_PER_SM * sms)
    wide = max(1024, common.next_power_of_2(common.cdiv(n, MAX_CHUNKS)),
               min(16384, common.next_power_of_2(per_program)))
    narrow = MIN_CHUNK
    while narrow < wide and num_rows * common.cdiv(n, narrow) > FEW_ROWS_PROGRAMS_PER_SM * sms:
        narrow *= 2
    return min(narrow, wide)


def _check_tuning(split, sample_stride, block_rows, block_n, block_sel, block_k, num_warps,
                  num_stages):
    if not isinstance(split, bool):
        raise ValueError(f"split={split!r}: expected None or a bool")
    if (not isinstance(sample_stride, int) or isinstance(sample_stride, bool)
            or sample_stride < 0 or sample_stride & (sample_stride - 1)):
        raise ValueError(f"sample_stride={sample_stride!r}: expected 0 (no sample) or a power "
                         "of 2")
    if sample_stride and not split:
        raise ValueError(f"{sample_stride=} with split=False: the sampled path counts and "
                         "compacts over the split path's chunks and falls back to it")
    for name, value in (("block_rows", block_rows), ("block_n", block_n),
                        ("block_sel", block_sel), ("block_k", block_k)):
        if not isinstance(value, int) or value < 1 or value & (value - 1):
            raise ValueError(f"{name}={value!r}: expected a power of 2 (Triton block sizes)")
    if block_sel > 1 << 15:
        raise ValueError(f"{block_sel=}: expected <= 32768 (16-bit scan fields)")
    for name, value in (("num_warps", num_warps), ("num_stages", num_stages)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: expected an int >= 1")
    if split and block_rows != 1:
        raise ValueError(f"{block_rows=} with split=True: the split path takes one row per "
                         "program (block_rows=1)")
    if split and block_sel > block_n:
        raise ValueError(f"{block_sel=} > {block_n=} with split=True: a program's scan steps "
                         "must tile its chunk")


@functools.partial(jax.jit, static_argnames=("k", "force_first", "force_last"))
def _topk_reference_jit(scores, valid, k_row, *, k, force_first, force_last):
    return topk_select_reference(scores, k, valid=valid, k_row=k_row, force_first=force_first,
                                 force_last=force_last)


@functools.partial(jax.jit, static_argnames=("k", "force_first", "force_last", "interpret",
                                             *TUNING))
def _topk_pallas_jit(scores, valid, k_row, *, k, force_first, force_last, interpret, split,
                     sample_stride, block_rows, block_n, block_sel, block_k, num_warps,
                     num_stages):
    kw = dict(k=k, force_first=force_first, force_last=force_last, block_n=block_n,
              block_sel=block_sel, block_k=block_k, num_warps=num_warps,
              num_stages=num_stages, interpret=interpret)
    if sample_stride:
        return Selected(*_topk_sampled_pallas(scores, valid, k_row, sample_stride=sample_stride,
                                              **kw)[:2])
    if split:
        return Selected(*_topk_split_pallas(scores, valid, k_row, **kw))
    return Selected(*_topk_pallas(scores, valid, k_row, block_rows=block_rows, **kw))


def topk_select(scores, k: int, *, valid, k_row=None, force_first: int = 0, force_last: int = 0,
                backend: str = "auto", interpret: bool | None = None,
                split: bool | None = None, sample_stride: int | None = None,
                block_rows: int | None = None,
                block_n: int | None = None, block_sel: int | None = None,
                block_k: int | None = None, num_warps: int | None = None,
                num_stages: int | None = None) -> Selected:
    """Per row, the `count` best valid columns, ascending, padded with -1 to width k.

    scores  [R, N] float32; -inf ranks below every finite score, NaN below -inf. Or
            `LogitRows` [R, G, N], the dense decode kernel's unpooled output: each path
            pools it as it loads it, so the pooled scores never round-trip through memory
    k       static int >= 1: output width (may exceed N)
    valid   [R] int: columns that exist per row (clipped to [0, N])
    k_row   [R] int: the row's budget (clipped to [0, k]); None means k
    force_first, force_last: static ints; columns [0, force_first) and
            [valid - force_last, valid) are always kept and count toward the budget
    split, sample_stride, block_rows, block_n, block_sel, block_k, num_warps, num_stages:
            static Pallas knobs (the path: split rows across programs or not, and sample
            every sample_stride-th column first or not (0); rows per program; the resident
            row width or the columns per program; the scan step; the padding step; Triton's);
            None takes `default_tuning`'s. Validated on every backend.
    Returns Selected(indices [R, k] int32, count [R] int32) with
    count = min(valid, max(k_row, min(valid, force_first + force_last))).
    """
    _check_inputs(scores, k, valid, k_row, force_first, force_last)
    backend = common.resolve_backend(backend)
    num_rows, n = scores.shape
    tuning = common.resolve_tuning(
        default_tuning(num_rows, n, k, split=split, sample_stride=sample_stride,
                       block_rows=block_rows, block_n=block_n),
        split=split, sample_stride=sample_stride, block_rows=block_rows, block_n=block_n,
        block_sel=block_sel, block_k=block_k, num_warps=num_warps, num_stages=num_stages)
    _check_tuning(**tuning)
    valid = jnp.asarray(valid, jnp.int32)
    k_row = jnp.full((num_rows,), k, jnp.int32) if k_row is None else jnp.asarray(k_row, jnp.int32)
    options = dict(k=k, force_first=force_first, force_last=force_last)
    if backend == "reference":
        return _topk_reference_jit(scores, valid, k_row, **options)
    return _topk_pallas_jit(scores, valid, k_row, **options,
                            interpret=common.resolve_interpret(interpret), **tuning)


def topk_select_reference(scores, k: int, *, valid, k_row=None, force_first: int = 0,
                          force_last: int = 0) -> Selected:
    """Plain jnp twin of `topk_select` built on `lax.top_k` (ties: lower index first)."""
    _check_inputs(scores, k, valid, k_row, force_first, force_last)
    if isinstance(scores, LogitRows):
        scores = scores.scores()
    num_rows, n = scores.shape
    valid = jnp.clip(jnp.asarray(valid, jnp.int32), 0, n)[:, None]                   # [R, 1]
    k_row = jnp.full((num_rows,), k, jnp.int32) if k_row is None else jnp.asarray(k_row, jnp.int32)
    count = _budget(valid[:, 0], jnp.clip(k_row, 0, k), force_first, force_last)     # [R]
    cols = jnp.arange(n, dtype=jnp.int32)[None, :]
    key = jnp.where(_forced_mask(cols, valid, force_first, force_last), FORCED_KEY,
                    _order_key(scores))
    key = jnp.where(cols < valid, key, MISSING_KEY)
    key = jnp.pad(key, ((0, 0), (0, max(0, k - n))), constant_values=MISSING_KEY)
    _, top = lax.top_k(key, k)                                                        # [R, k]
    slot = jnp.arange(k, dtype=jnp.int32)[None, :]
    top = jnp.sort(jnp.where(slot < count[:, None], top, INT32_MAX), axis=1)
    return Selected(jnp.where(slot < count[:, None], top, -1).astype(jnp.int32), count)


