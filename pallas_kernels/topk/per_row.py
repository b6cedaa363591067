"""Top-k's per-row path (many rows): one program per `block_rows` rows.

Each program runs a bitwise binary search for the row's threshold T, one row-wide count per
bit, and stops early once a candidate leaves exactly `count` keys above it. A row of up to
`block_n` columns stays in registers; a longer one is re-read once per bit. The keep then
scans the row in tiles of `block_sel` columns, or, with block_sel >= block_n >= the row,
straight from the registers the search used; its running count goes by groups of
SCAN_GROUP columns (`keys._running_sum`). The sampled path reuses the search and the select
for its sample and its candidates.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from sparsejax.pallas_kernels import common
from sparsejax.pallas_kernels.common import pl, plgpu
from .keys import INT32_MIN, _keep_tile, _pad_slots, _row_budget, _tile_keys

RESIDENT_WIDTH = 32768  # widest row the per-row path holds in registers


def _per_row_knobs(block_rows: int, block_n: int) -> tuple[int, int]:
    """(num_warps, block_sel) of the per-row path for full rows of block_rows x block_n keys:
    the keep runs on the resident keys (block_sel = block_n) at up to 32 keys per thread,
    except at 16384 keys, where 16 warps re-reading 4096-key tiles ran faster; the rule
    holds on both GPUs measured (docs/tuning.md)."""
    keys = block_rows * block_n
    if keys > RESIDENT_WIDTH or keys == 16384:
        return 16, 4096
    return max(4, keys // 1024), block_n


def _per_row_warps(block_rows: int, block_n: int) -> int:
    """Warps of the sampled path's per-row kernels (their rows are partly filled: the keep
    re-reads only the filled tiles)."""
    return max(4, min(16, block_rows * block_n // 2048))


def _search_rows(tile_keys, budget, present, *, n: int, block_n: int):
    """The keep rule for the `budget` largest keys of rows of n slots, `present` of which
    exist per row -> (thr, above), each [BR]: keep keys > thr (`above` of them, <= budget),
    then the first budget - above ties at thr. tile_keys(start, width) -> (cols, key [BR, W])."""
    resident_keys = tile_keys(0, block_n)[1] if block_n >= n else None              # [BR, BN]

    def count_at_least(thr):  # [BR] -> [BR]: keys >= thr per row
        if resident_keys is not None:
            return jnp.sum((resident_keys >= thr[:, None]).astype(jnp.int32), axis=1)
        num_tiles = pl.cdiv(jnp.max(present), block_n)

        def body(t, acc):
            _, key = tile_keys(t * block_n, block_n)
            return acc + jnp.sum((key >= thr[:, None]).astype(jnp.int32), axis=1)
        return lax.fori_loop(0, num_tiles, body, jnp.zeros_like(thr))

    # Bitwise search in the unsigned domain (u = key ^ INT32_MIN) for the largest t with
    # count(u >= t) >= budget. `above` tracks count(u > t): it is the count at the latest
    # failed candidate (t + 1 is exactly that candidate). A candidate that leaves exactly
    # `budget` keys at or above it ends the row's search: those are kept, no tie is broken.
    def search_cond(carry):
        bit, _, _, _, done = carry
        return (bit != 0) & (jnp.min(done) == 0)  # min, not all: no reduce_and in Triton

    def search_step(carry):
        bit, t, thr, above, done = carry
        cand = t | bit
        count = count_at_least(cand ^ INT32_MIN)
        live = done == 0
        exact = live & (count == budget)
        thr = jnp.where(exact, (cand ^ INT32_MIN) - 1, thr)
        above = jnp.where(live & (count <= budget), count, above)
        t = jnp.where(count >= budget, cand, t)
        return lax.shift_right_logical(bit, 1), t, thr, above, done | exact.astype(jnp.int32)

    zeros = jnp.zeros_like(budget)
    init = (jnp.full((), INT32_MIN, jnp.int32), zeros, zeros, zeros, zeros)
    _, t, thr, above, done = lax.while_loop(search_cond, search_step, init)
    return jnp.where(done == 1, thr, t ^ INT32_MIN), above


def _select_rows(tile_keys, indices_ref, count_ref, rows, row_ok, present, budget, *, n: int,
                 k: int, block_n: int, block_sel: int, block_k: int):
    """Write the rows' selections: the kept columns ascending, -1 padding, the counts.

    The keep scans in groups (`_running_sum`) except in tiles re-read beside a row that the
    search holds in registers: there the grouped scan measured slower (docs/tuning.md)."""
    # Masked lanes point out of bounds so that interpret mode's scatter drops them.
    store_rows = jnp.where(row_ok, rows, indices_ref.shape[0])[:, None]               # [BR, 1]
    zeros = jnp.zeros_like(budget)
    if block_sel >= block_n >= n:
        # One load: the row stays in registers from the search through the keep.
        resident = tile_keys(0, block_n)
        thr, above = _search_rows(lambda start, width: resident, budget, present, n=n,
                                  block_n=block_n)
        _keep_tile(indices_ref, store_rows, row_ok, *resident, thr, budget - above,
                   (zeros, zeros), k)
    else:
        thr, above = _search_rows(tile_keys, budget, present, n=n, block_n=block_n)

        def keep_tile(i, seen):
            cols, key = tile_keys(i * block_sel, block_sel)
            return _keep_tile(indices_ref, store_rows, row_ok, cols, key, thr, budget - above,
                              seen, k, grouped_scan=block_n < n)

        lax.fori_loop(0, pl.cdiv(jnp.max(present), block_sel), keep_tile, (zeros, zeros))
    _pad_slots(indices_ref, store_rows, row_ok, budget, 0, k, k=k, block_k=block_k)
    plgpu.store(count_ref.at[store_rows[:, 0]], budget, mask=row_ok)


def _select_over_scores(scores_ref, valid_ref, k_row_ref, indices_ref, count_ref, rows,
                        *, only=None, k: int, force_first: int, force_last: int,
                        block_n: int, block_sel: int, block_k: int):
    """The selections of `rows` [BR] searched over their scores; with `only` [BR], the other
    rows are masked off (nothing read or written)."""
    n = scores_ref.shape[-1]
    row_ok, valid, budget = _row_budget(valid_ref, k_row_ref, rows, n=n, k=k,
                                        force_first=force_first, force_last=force_last)
    if only is not None:
        row_ok &= only
        valid, budget = jnp.where(row_ok, valid, 0), jnp.where(row_ok, budget, 0)

    def tile_keys(start, width):
        return _tile_keys(scores_ref, rows, row_ok, valid, start, width, force_first,
                          force_last)

    _select_rows(tile_keys, indices_ref, count_ref, rows, row_ok, valid, budget, n=n, k=k,
                 block_n=block_n, block_sel=block_sel, block_k=block_k)


def _topk_kernel(scores_ref,   # [R, N] float32
                 valid_ref,    # [R] int32
                 k_row_ref,    # [R] int32
                 indices_ref,  # [R, k] int32 (out)
                 count_ref,    # [R] int32 (out)
                 *, block_rows: int, **static):
    rows = pl.program_id(0) * block_rows + lax.iota(jnp.int32, block_rows)          # [BR]
    _select_over_scores(scores_ref, valid_ref, k_row_ref, indices_ref, count_ref, rows,
                        **static)


def _topk_pallas(scores, valid, k_row, *, k, force_first, force_last, block_rows, block_n,
                 block_sel, block_k, num_warps, num_stages, interpret):
    num_rows, _ = scores.shape
    kernel = functools.partial(
        _topk_kernel, k=k, force_first=force_first, force_last=force_last,
        block_rows=block_rows, block_n=block_n, block_sel=block_sel, block_k=block_k)
    return common.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((num_rows, k), jnp.int32),
                   jax.ShapeDtypeStruct((num_rows,), jnp.int32)),
        grid=(common.cdiv(num_rows, block_rows),),
        compiler_params=common.triton_params(num_warps, num_stages),
        interpret=interpret,
        name="topk_select",
    )(scores, valid, k_row)

