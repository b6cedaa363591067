"""Top-k's sampled-threshold path (wide rows, `sample_stride` > 0): programs (row, chunk) as
on the split path.

The per-row search over every sample_stride-th column (about SAMPLE_WIDTH of them) finds T^,
the sample key of rank j = b/s + 4 sqrt(b/s) + 4 for budget b and stride s, so that, with
SAMPLE_SIGMAS binomial deviations to spare, at least b and at most the capacity C
(`candidate_capacity`) of the row's keys are >= T^; forced keys always are. One kernel counts
the keys >= T^ per chunk, a second compacts their columns and keys into [R, C] in column
order (each chunk from the offset of the chunks before it), and the per-row search selects
among these candidates, ties to the lower slot being ties to the lower column. The scores
are read about twice instead of nine times, in five launches.

A row with fewer candidates than its budget or more than C (heavy ties at T^, or data that
the strided sample misjudges) is searched over its own scores by the last launch (slower:
the row is re-read once per key bit; that kernel's other programs return at once), so the
output is exact either way with no branch between the launches.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from sparsejax.pallas_kernels import common
from sparsejax.pallas_kernels.common import pl, plgpu
from .keys import (INT32_MAX, MISSING_KEY, NAN_KEY, _budget, _chunk_tiles, _keep_tile,
                   _load_chunks, _row_budget, _row_valid, _tile_keys)
from .per_row import (RESIDENT_WIDTH, _per_row_warps, _search_rows, _select_over_scores,
                      _select_rows)

SAMPLE_WIDTH = 8192            # sample columns per row: stride = the row's width / this
SAMPLE_SIGMAS = 4              # binomial deviations of margin on either side of the budget
SAMPLE_SLACK = 4               # sample ranks of margin for small budgets


def _sample_rank(budget, stride: int, xp=jnp):
    """The sample rank j whose key is T^: the budget's expected share of a 1-in-`stride` sample
    plus SAMPLE_SIGMAS binomial deviations and SAMPLE_SLACK. xp: jnp in kernels, np static."""
    share = budget / stride
    return (xp.ceil(share + SAMPLE_SIGMAS * xp.sqrt(share)) + SAMPLE_SLACK).astype(jnp.int32)


def candidate_capacity(k: int, stride: int) -> int:
    """Candidates per row the sampled path has room for: the keys expected at or above T^ for
    a budget of k, plus SAMPLE_SIGMAS deviations, to a power of 2."""
    rank = float(_sample_rank(np.float64(k), stride, xp=np))
    return common.next_power_of_2(math.ceil(stride * (rank + SAMPLE_SIGMAS * math.sqrt(rank))))


def _sample_threshold_kernel(scores_ref,     # [R, N] float32
                             valid_ref,      # [R] int32
                             k_row_ref,      # [R] int32
                             threshold_ref,  # [R] int32 (out): T^, a signed key
                             *, k: int, force_first: int, force_last: int, stride: int,
                             block_n: int):
    n = scores_ref.shape[1]
    rows = pl.program_id(0) + lax.iota(jnp.int32, 1)                                # [1]
    row_ok, valid, budget = _row_budget(valid_ref, k_row_ref, rows, n=n, k=k,
                                        force_first=force_first, force_last=force_last)
    sampled = pl.cdiv(valid, stride)  # columns 0, stride, 2 stride, ... below valid
    rank = _sample_rank(budget, stride)
    wanted = jnp.minimum(rank, sampled)

    def tile_keys(start, width):
        return _tile_keys(scores_ref, rows, row_ok, valid, start, width, force_first,
                          force_last, stride)

    thr, above = _search_rows(tile_keys, wanted, sampled, n=common.cdiv(n, stride),
                              block_n=block_n)
    # The lowest key with `wanted` sample keys at or above it; a sample too small to rank
    # (a short row) makes every valid column a candidate (NAN_KEY is the lowest valid key).
    threshold = jnp.where(rank > sampled, NAN_KEY, thr + (above == wanted).astype(jnp.int32))
    plgpu.store(threshold_ref.at[rows], threshold, mask=row_ok)


def _count_candidates_kernel(scores_ref,     # [R, N] float32
                             valid_ref,      # [R] int32
                             threshold_ref,  # [R] int32: T^
                             counts_ref,     # [R, C] int32 (out): keys >= T^ per chunk
                             *, force_first: int, force_last: int, block_n: int,
                             block_sel: int):
    rows, chunk = pl.program_id(0) + lax.iota(jnp.int32, 1), pl.program_id(1)       # [1], ()
    row_ok, valid = _row_valid(valid_ref, rows, scores_ref.shape[1])
    threshold = plgpu.load(threshold_ref.at[rows], mask=row_ok, other=INT32_MAX)
    start = chunk * block_n

    def count_tile(i, count):
        _, key = _tile_keys(scores_ref, rows, row_ok, valid, start + i * block_sel, block_sel,
                            force_first, force_last)
        return count + jnp.sum((key >= threshold[:, None]).astype(jnp.int32), axis=1)

    count = lax.fori_loop(0, _chunk_tiles(valid, start, block_n, block_sel), count_tile,
                          jnp.zeros((1,), jnp.int32))
    plgpu.store(counts_ref.at[rows, chunk], count, mask=row_ok)


def _gather_candidates_kernel(scores_ref,     # [R, N] float32
                              valid_ref,      # [R] int32
                              threshold_ref,  # [R] int32: T^
                              counts_ref,     # [R, C] int32: keys >= T^ per chunk
                              columns_ref,    # [R, capacity] int32 (out): candidates, ascending
                              keys_ref,       # [R, capacity] int32 (out): their keys
                              *, force_first: int, force_last: int, block_n: int,
                              block_sel: int):
    rows, chunk = pl.program_id(0) + lax.iota(jnp.int32, 1), pl.program_id(1)       # [1], ()
    row_ok, valid = _row_valid(valid_ref, rows, scores_ref.shape[1])
    threshold = plgpu.load(threshold_ref.at[rows], mask=row_ok, other=INT32_MAX)
    counts = _load_chunks(counts_ref, rows, row_ok)                                 # [1, CP]
    before = lax.iota(jnp.int32, counts.shape[1])[None, :] < chunk
    seen = (jnp.sum(jnp.where(before, counts, 0), axis=1), jnp.zeros((1,), jnp.int32))
    start = chunk * block_n

    def keep_tile(i, seen):  # keep key > T^ - 1, no ties: every key >= T^
        cols, key = _tile_keys(scores_ref, rows, row_ok, valid, start + i * block_sel,
                               block_sel, force_first, force_last)
        return _keep_tile(columns_ref, rows[:, None], row_ok, cols, key, threshold - 1,
                          jnp.zeros((1,), jnp.int32), seen, columns_ref.shape[1],
                          keys_ref=keys_ref)

    lax.fori_loop(0, _chunk_tiles(valid, start, block_n, block_sel), keep_tile, seen)


def _topk_candidates_kernel(keys_ref,     # [R, capacity] int32: candidate keys by column
                            columns_ref,  # [R, capacity] int32: their columns, ascending
                            num_ref,      # [R] int32: candidates per row
                            budget_ref,   # [R] int32: the row's count (<= num)
                            indices_ref,  # [R, k] int32 (out)
                            count_ref,    # [R] int32 (out)
                            *, k: int, block_n: int, block_sel: int, block_k: int):
    capacity = keys_ref.shape[1]
    rows = pl.program_id(0) + lax.iota(jnp.int32, 1)                                # [1]
    row_ok, num, budget = _row_budget(num_ref, budget_ref, rows, n=capacity, k=k,
                                      force_first=0, force_last=0)

    def tile_keys(start, width):  # ties to the lower slot are ties to the lower column
        slots = start + lax.iota(jnp.int32, width)[None, :]
        present = row_ok[:, None] & (slots < num[:, None])
        where = (rows[:, None], slots)
        return (plgpu.load(columns_ref.at[where], mask=present, other=-1),
                plgpu.load(keys_ref.at[where], mask=present, other=MISSING_KEY))

    _select_rows(tile_keys, indices_ref, count_ref, rows, row_ok, num, budget, n=capacity,
                 k=k, block_n=block_n, block_sel=block_sel, block_k=block_k)


def _misjudged_rows_kernel(indices_in_ref,  # [R, k] int32: the candidates' selection
                           count_in_ref,    # [R] int32 (both aliased to the outputs)
                           num_ref,         # [R] int32: keys >= T^ per row
                           budget_ref,      # [R] int32: the row's count
                           scores_ref,      # [R, N] float32 (or LogitRows)
                           valid_ref,       # [R] int32
                           k_row_ref,       # [R] int32
                           indices_ref,     # [R, k] int32 (out)
                           count_ref,       # [R] int32 (out)
                           *, capacity: int, **static):
    """Rows the sample misjudged (fewer candidates than the budget, or more than the
    capacity) searched over their own scores, re-read once per key bit; the other rows'
    programs mask everything off and leave the candidates' selection as it is."""
    del indices_in_ref, count_in_ref
    rows = pl.program_id(0) + lax.iota(jnp.int32, 1)                                # [1]
    found = plgpu.load(num_ref.at[rows])
    misjudged = (found < plgpu.load(budget_ref.at[rows])) | (found > capacity)
    _select_over_scores(scores_ref, valid_ref, k_row_ref, indices_ref, count_ref, rows,
                        only=misjudged, **static)


class Candidates(NamedTuple):
    threshold: jax.Array  # [R] int32: T^
    counts: jax.Array     # [R, C] int32: keys >= T^ per chunk
    num: jax.Array        # [R] int32: keys >= T^
    budget: jax.Array     # [R] int32: the row's count
    fits: jax.Array       # () bool: budget <= num <= capacity in every row


def _sample_candidates(scores, valid, k_row, *, k, force_first, force_last, sample_stride,
                       block_n, block_sel, num_warps, num_stages, interpret) -> Candidates:
    num_rows, n = scores.shape
    sample_n = min(common.next_power_of_2(common.cdiv(n, sample_stride)), RESIDENT_WIDTH)
    static = dict(force_first=force_first, force_last=force_last)
    threshold = common.pallas_call(
        functools.partial(_sample_threshold_kernel, k=k, stride=sample_stride,
                          block_n=sample_n, **static),
        out_shape=jax.ShapeDtypeStruct((num_rows,), jnp.int32), grid=(num_rows,),
        compiler_params=common.triton_params(_per_row_warps(1, sample_n), 1),
        interpret=interpret, name="topk_select_sample_threshold",
    )(scores, valid, k_row)
    grid = (num_rows, common.cdiv(n, block_n))
    counts = common.pallas_call(
        functools.partial(_count_candidates_kernel, block_n=block_n, block_sel=block_sel,
                          **static),
        out_shape=jax.ShapeDtypeStruct(grid, jnp.int32), grid=grid,
        compiler_params=common.triton_params(num_warps, num_stages), interpret=interpret,
        name="topk_select_count_candidates",
    )(scores, valid, threshold)
    budget = _budget(jnp.clip(valid, 0, n), jnp.clip(k_row, 0, k), force_first, force_last)
    num = jnp.sum(counts, axis=1)
    fits = jnp.all((num >= budget) & (num <= candidate_capacity(k, sample_stride)))
    return Candidates(threshold, counts, num, budget, fits)


def _select_candidates(scores, valid, k_row, candidates: Candidates, *, k, force_first,
                       force_last, sample_stride, block_n, block_sel, block_k, num_warps,
                       num_stages, interpret):
    """Compact the keys >= T^ and select each row's budget among them -> (indices, count).
    Rows the sample misjudged (`candidates.fits` false for them) are then searched over their
    own scores by one more kernel, whose other programs return at once: exact either way,
    with no branch between the launches (XLA reads a `lax.cond`'s predicate back to the host:
    a round trip per call in every decode step)."""
    num_rows, n = scores.shape
    capacity = candidate_capacity(k, sample_stride)
    buffer = jax.ShapeDtypeStruct((num_rows, capacity), jnp.int32)
    columns, keys = common.pallas_call(
        functools.partial(_gather_candidates_kernel, force_first=force_first,
                          force_last=force_last, block_n=block_n, block_sel=block_sel),
        out_shape=(buffer, buffer), grid=candidates.counts.shape,
        compiler_params=common.triton_params(num_warps, num_stages), interpret=interpret,
        name="topk_select_gather_candidates",
    )(scores, valid, candidates.threshold, candidates.counts)
    resident = min(capacity, RESIDENT_WIDTH)
    out_shape = (jax.ShapeDtypeStruct((num_rows, k), jnp.int32),
                 jax.ShapeDtypeStruct((num_rows,), jnp.int32))
    selected = common.pallas_call(
        functools.partial(_topk_candidates_kernel, k=k, block_n=resident,
                          block_sel=min(resident, 4096),
                          block_k=min(common.next_power_of_2(k), 1024)),
        out_shape=out_shape, grid=(num_rows,),
        compiler_params=common.triton_params(_per_row_warps(1, resident), 1),
        interpret=interpret, name="topk_select_candidates",
    )(keys, columns, candidates.num, candidates.budget)
    row_tile = min(4096, common.next_power_of_2(n))
    return common.pallas_call(
        functools.partial(_misjudged_rows_kernel, k=k, force_first=force_first,
                          force_last=force_last, capacity=capacity, block_n=row_tile,
                          block_sel=row_tile, block_k=block_k),
        out_shape=out_shape, grid=(num_rows,), input_output_aliases={0: 0, 1: 1},
        compiler_params=common.triton_params(_per_row_warps(1, row_tile), 1),
        interpret=interpret, name="topk_select_misjudged_rows",
    )(*selected, candidates.num, candidates.budget, scores, valid, k_row)


def _topk_sampled_pallas(scores, valid, k_row, *, k, force_first, force_last, sample_stride,
                         block_n, block_sel, block_k, num_warps, num_stages, interpret):
    """-> (indices, count, fits): fits says the candidates served every row (else some rows
    were searched over their own scores)."""
    kw = dict(k=k, force_first=force_first, force_last=force_last, block_n=block_n,
              block_sel=block_sel, num_warps=num_warps, num_stages=num_stages,
              interpret=interpret)
    candidates = _sample_candidates(scores, valid, k_row, sample_stride=sample_stride, **kw)
    indices, count = _select_candidates(scores, valid, k_row, candidates,
                                        sample_stride=sample_stride, block_k=block_k, **kw)
    return indices, count, candidates.fits

