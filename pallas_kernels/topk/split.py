"""Top-k's split path (few long rows): programs (row, chunk of `block_n` columns).

Eight radix passes of RADIX_BITS = 4 bits each. A pass with prefix p and shift s counts, per
chunk, the keys whose unsigned key u lies in [p, p + 16 << s), by digit (u - p) >> s, and the
keys above that range: every program writes the 16-bin histogram of its chunk. Summed over
chunks these give count(u >= p + j << s) for every digit j; the next pass appends the
largest j whose count still reaches the budget. After the pass at shift 0, p + j is T.

The last kernel (`_compact_kernel`) folds the final histograms into T and the ties to keep,
takes each chunk's output offset and share of the ties from the chunks before it (ties go to
the lower index, so to the earlier chunks), and writes its kept indices and its share of
the -1 padding. Nine launches, no atomics.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from sparsejax.pallas_kernels import common
from sparsejax.pallas_kernels.common import pl, plgpu
from .keys import (INT32_MIN, MISSING_KEY, _chunk_tiles, _keep_tile, _load_chunks, _pad_slots,
                   _row_budget, _tile_keys)

RADIX_BITS = 4                 # key bits per pass: 8 passes of 16 bins
RADIX_BINS = 1 << RADIX_BITS


def _load_pass(hist_ref, above_ref, rows, row_ok):
    """The row's histograms of one pass -> (hist [1, CP, B], above [1, CP]), 0 past C."""
    num_chunks = hist_ref.shape[1]
    chunks = lax.iota(jnp.int32, common.next_power_of_2(num_chunks))[None, :]       # [1, CP]
    ok = row_ok[:, None] & (chunks < num_chunks)
    bins = lax.iota(jnp.int32, RADIX_BINS)[None, None, :]
    hist = plgpu.load(hist_ref.at[rows[:, None, None], chunks[:, :, None], bins],
                      mask=ok[:, :, None], other=0)
    return hist, _load_chunks(above_ref, rows, row_ok)


def _next_digit(hist, above, budget):
    """The largest digit j >= 1 whose count(u >= p + j << s) reaches the budget, else 0 -> [1]."""
    totals = jnp.sum(hist, axis=1)                                                   # [1, B]
    at_least = (jnp.sum(above, axis=1, keepdims=True) + jnp.sum(totals, axis=1, keepdims=True)
                - jnp.cumsum(totals, axis=1) + totals)           # non-increasing in the digit
    bins = lax.iota(jnp.int32, RADIX_BINS)[None, :]
    return jnp.sum(((at_least >= budget[:, None]) & (bins >= 1)).astype(jnp.int32), axis=1)


def _radix_pass_kernel(shift_ref,       # [1] int32: this pass reads key bits [shift, shift + 4)
                       scores_ref,      # [R, N] float32
                       valid_ref,       # [R] int32
                       k_row_ref,       # [R] int32
                       prefix_ref,      # [R] int32: unsigned bits of T above the last pass
                       hist_ref,        # [R, C, B] int32: the last pass's histograms
                       above_ref,       # [R, C] int32: the last pass's counts above its range
                       prefix_out_ref,  # [R] int32 (out): ... above this pass's digit
                       hist_out_ref,    # [R, C, B] int32 (out)
                       above_out_ref,   # [R, C] int32 (out)
                       *, k: int, force_first: int, force_last: int, block_n: int,
                       block_sel: int):
    n = scores_ref.shape[1]
    rows, chunk = pl.program_id(0) + lax.iota(jnp.int32, 1), pl.program_id(1)       # [1], ()
    row_ok, valid, budget = _row_budget(valid_ref, k_row_ref, rows, n=n, k=k,
                                        force_first=force_first, force_last=force_last)
    shift = shift_ref[0]
    start = chunk * block_n
    # The first tile's keys do not depend on the last pass: loaded before its histograms, the
    # two reads overlap (a chunk past `valid` reads nothing: its keys are all missing).
    _, first_keys = _tile_keys(scores_ref, rows, row_ok, valid, start, block_sel, force_first,
                               force_last)
    prefix = plgpu.load(prefix_ref.at[rows], mask=row_ok, other=0)
    digit = _next_digit(*_load_pass(hist_ref, above_ref, rows, row_ok), budget)
    # The first pass has no last pass (its inputs are zeros): it starts from prefix 0.
    last_shift = jnp.minimum(shift + RADIX_BITS, 32 - RADIX_BITS)
    prefix = jnp.where(shift + RADIX_BITS < 32, prefix | lax.shift_left(digit, last_shift),
                       prefix)
    low = prefix ^ INT32_MIN  # the range's lower end as a signed key
    half = RADIX_BINS // 2
    pairs = lax.iota(jnp.int32, half)[None, :]                                      # [1, B/2]

    # Two bins per int32: digit d adds 1 << 16 * (d // 8) at pair d % 8, so eight compares
    # count sixteen bins (a tile's counts fit 16 bits: block_sel <= 2**15; the sum of both
    # fields stays below 2**32, read back with logical shifts).
    def count(key, counts):
        low_bins, high_bins, above = counts
        reached = (key != MISSING_KEY) & (key >= low[:, None])                     # u >= p
        digit = lax.shift_right_logical(key - low[:, None], shift)  # (u - p) >> s, unsigned
        in_range = reached & (digit >= 0) & (digit < RADIX_BINS)
        digit = jnp.where(in_range, digit, 0)
        pair = jnp.where(in_range, digit & (half - 1), half)          # half: in no pair
        unit = lax.shift_left(1, lax.shift_right_logical(digit, RADIX_BITS - 1) * 16)
        packed = jnp.sum(jnp.where(pair[:, :, None] == pairs[:, None, :], unit[:, :, None], 0),
                         axis=1)                                                    # [1, B/2]
        return (low_bins + (packed & 0xFFFF), high_bins + lax.shift_right_logical(packed, 16),
                above + jnp.sum((reached & ~in_range).astype(jnp.int32), axis=1))

    def count_tile(i, counts):
        _, key = _tile_keys(scores_ref, rows, row_ok, valid, start + i * block_sel, block_sel,
                            force_first, force_last)
        return count(key, counts)

    zeros = jnp.zeros((1, half), jnp.int32)
    counts = count(first_keys, (zeros, zeros, jnp.zeros((1,), jnp.int32)))
    low_bins, high_bins, above = lax.fori_loop(
        1, _chunk_tiles(valid, start, block_n, block_sel), count_tile, counts)
    for first_bin, bins in ((0, low_bins), (half, high_bins)):
        plgpu.store(hist_out_ref.at[rows[:, None], chunk, first_bin + pairs], bins,
                    mask=row_ok[:, None])
    plgpu.store(above_out_ref.at[rows, chunk], above, mask=row_ok)
    plgpu.store(prefix_out_ref.at[rows], prefix, mask=row_ok & (chunk == 0))


def _compact_kernel(scores_ref,   # [R, N] float32
                    valid_ref,    # [R] int32
                    k_row_ref,    # [R] int32
                    prefix_ref,   # [R] int32: unsigned bits 4.. of T
                    hist_ref,     # [R, C, B] int32: the shift-0 pass's histograms
                    above_ref,    # [R, C] int32
                    indices_ref,  # [R, k] int32 (out)
                    count_ref,    # [R] int32 (out)
                    *, k: int, force_first: int, force_last: int, block_n: int, block_sel: int,
                    block_k: int):
    n = scores_ref.shape[1]
    num_chunks = hist_ref.shape[1]
    rows, chunk = pl.program_id(0) + lax.iota(jnp.int32, 1), pl.program_id(1)       # [1], ()
    row_ok, valid, budget = _row_budget(valid_ref, k_row_ref, rows, n=n, k=k,
                                        force_first=force_first, force_last=force_last)
    start = chunk * block_n
    first = _tile_keys(scores_ref, rows, row_ok, valid, start, block_sel, force_first,
                       force_last)   # read beside the histograms, as in the passes
    prefix = plgpu.load(prefix_ref.at[rows], mask=row_ok, other=0)
    hist, above = _load_pass(hist_ref, above_ref, rows, row_ok)
    digit = _next_digit(hist, above, budget)[:, None, None]                         # [1, 1, 1]
    thr = (prefix | digit[:, 0, 0]) ^ INT32_MIN                                   # T, signed
    bins = lax.iota(jnp.int32, RADIX_BINS)[None, None, :]
    above_chunk = above + jnp.sum(jnp.where(bins > digit, hist, 0), axis=2)  # [1, CP]: > T
    ties_chunk = jnp.sum(jnp.where(bins == digit, hist, 0), axis=2)          # [1, CP]: == T
    ties_wanted = budget - jnp.sum(above_chunk, axis=1)
    # Ties go to the lower index: the chunks before this one take theirs first.
    before = lax.iota(jnp.int32, above_chunk.shape[1])[None, :] < chunk
    seen = (jnp.sum(jnp.where(before, above_chunk, 0), axis=1),
            jnp.sum(jnp.where(before, ties_chunk, 0), axis=1))

    def keep(tile, seen):
        return _keep_tile(indices_ref, rows[:, None], row_ok, *tile, thr, ties_wanted, seen, k)

    def keep_tile(i, seen):
        return keep(_tile_keys(scores_ref, rows, row_ok, valid, start + i * block_sel,
                               block_sel, force_first, force_last), seen)

    lax.fori_loop(1, _chunk_tiles(valid, start, block_n, block_sel), keep_tile,
                  keep(first, seen))
    share = common.cdiv(k, num_chunks)  # padding slots per program
    _pad_slots(indices_ref, rows[:, None], row_ok, budget, chunk * share, share, k=k,
               block_k=block_k)
    plgpu.store(count_ref.at[rows], budget, mask=row_ok & (chunk == 0))


def _topk_split_pallas(scores, valid, k_row, *, k, force_first, force_last, block_n, block_sel,
                       block_k, num_warps, num_stages, interpret):
    num_rows, n = scores.shape
    grid = (num_rows, common.cdiv(n, block_n))
    common_kw = dict(grid=grid, compiler_params=common.triton_params(num_warps, num_stages),
                     interpret=interpret)
    static = dict(k=k, force_first=force_first, force_last=force_last, block_n=block_n,
                  block_sel=block_sel)
    state = (jnp.zeros((num_rows,), jnp.int32),                    # prefix
             jnp.zeros((*grid, RADIX_BINS), jnp.int32),            # hist
             jnp.zeros(grid, jnp.int32))                           # above
    radix_pass = common.pallas_call(
        functools.partial(_radix_pass_kernel, **static),
        out_shape=tuple(jax.ShapeDtypeStruct(x.shape, jnp.int32) for x in state),
        name="topk_select_radix_pass", **common_kw)
    shifts = np.arange(32 - RADIX_BITS, -1, -RADIX_BITS, dtype=np.int32)[:, None]  # [8, 1]

    def run_pass(shift, state):
        return radix_pass(shift, scores, valid, k_row, *state)

    if interpret:  # one copy of the interpreted kernel to compile for the CPU, not eight
        state = lax.fori_loop(0, len(shifts),
                              lambda i, state: run_pass(jnp.asarray(shifts)[i], state), state)
    else:  # unrolled: no loop predicate read back between the launches; each shift a constant
        for shift in shifts:   # operand (a row sliced from a traced table is a kernel on a GPU)
            state = run_pass(shift, state)
    return common.pallas_call(
        functools.partial(_compact_kernel, **static, block_k=block_k),
        out_shape=(jax.ShapeDtypeStruct((num_rows, k), jnp.int32),
                   jax.ShapeDtypeStruct((num_rows,), jnp.int32)),
        name="topk_select_compact", **common_kw,
    )(scores, valid, k_row, *state)

