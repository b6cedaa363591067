"""Order keys and the kernel pieces every top-k path shares.

The Pallas paths select on an int32 order key: each float maps to an int32 that orders like
the floats (sign-magnitude -> two's complement, -0.0 -> +0.0, NaN -> INT32_MIN + 1); forced ->
INT32_MAX; columns >= valid are never read and count as INT32_MIN. Each path finds the row's
count-th largest key T, then keeps keys > T and the first ties at T in index order,
scattering the kept column indices to ascending slots (`_keep_tile`). NaN is not rejected
(that would need a device-to-host check); it ranks lowest.

In the kernel pieces, rows [BR] are the program's rows (BR = 1 on the split and sampled
paths).
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from sparsejax.pallas_kernels import common
from sparsejax.pallas_kernels.common import pl, plgpu
from sparsejax.pallas_kernels.decode_attention import LogitRows

INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1
MISSING_KEY = INT32_MIN        # columns >= valid: never counted as candidates
NAN_KEY = INT32_MIN + 1        # NaN: below -inf (whose key is -2139095041)
FORCED_KEY = INT32_MAX         # forced columns: above +inf (whose key is 2139095040)
# Columns per group of the keep's two-level scan (`_running_sum`): group sizes from 16 to
# 256 ran alike, one flat scan far slower (docs/tuning.md).
SCAN_GROUP = 32


def _order_key(x):
    """float32 -> int32 whose signed order is the score order (NaN lowest, -0.0 == +0.0)."""
    bits = lax.bitcast_convert_type(x, jnp.int32)
    key = bits ^ (lax.shift_right_arithmetic(bits, 31) & INT32_MAX)
    key = jnp.where(key == -1, 0, key)  # -0.0 -> +0.0
    return jnp.where(x != x, NAN_KEY, key)


def _forced_mask(cols, valid, force_first: int, force_last: int):
    return (cols < force_first) | (cols >= valid - force_last)


def _budget(valid, k_row, force_first: int, force_last: int):
    return jnp.minimum(valid, jnp.maximum(k_row, jnp.minimum(valid, force_first + force_last)))



def _row_valid(valid_ref, rows, n: int):
    """-> (row_ok, valid), each [BR]."""
    row_ok = rows < valid_ref.shape[0]
    return row_ok, jnp.clip(plgpu.load(valid_ref.at[rows], mask=row_ok, other=0), 0, n)


def _row_budget(valid_ref, k_row_ref, rows, *, n: int, k: int, force_first: int,
                force_last: int):
    """-> (row_ok, valid, budget), each [BR]."""
    row_ok, valid = _row_valid(valid_ref, rows, n)
    k_row = jnp.clip(plgpu.load(k_row_ref.at[rows], mask=row_ok, other=0), 0, k)
    return row_ok, valid, _budget(valid, k_row, force_first, force_last)


def _tile_keys(scores_ref, rows, row_ok, valid, start, width: int, force_first: int,
               force_last: int, stride: int = 1):
    """Order keys of columns (start + [0, width)) * stride -> (cols [1, W], key [BR, W])."""
    cols = (start + lax.iota(jnp.int32, width)[None, :]) * stride
    present = row_ok[:, None] & (cols < valid[:, None])
    if isinstance(scores_ref, LogitRows):  # every caller's start is a multiple of width
        x = scores_ref.load_tile(rows, row_ok, start, width, stride, present)
    else:
        x = plgpu.load(scores_ref.at[rows[:, None], cols], mask=present, other=0.0)
    forced = _forced_mask(cols, valid[:, None], force_first, force_last)
    key = jnp.where(forced, FORCED_KEY, _order_key(x))
    return cols, jnp.where(present, key, MISSING_KEY)


def _chunk_tiles(valid, start, block_n: int, block_sel: int):
    """Scan steps of block_sel that cover the chunk [start, start + block_n) up to valid."""
    return pl.cdiv(jnp.clip(jnp.max(valid) - start, 0, block_n), block_sel)


def _load_chunks(ref, rows, row_ok):
    """A [R, C] per-chunk array's row -> [1, CP], 0 past C."""
    num_chunks = ref.shape[1]
    chunks = lax.iota(jnp.int32, common.next_power_of_2(num_chunks))[None, :]       # [1, CP]
    return plgpu.load(ref.at[rows[:, None], chunks],
                      mask=row_ok[:, None] & (chunks < num_chunks), other=0)


def _running_sum(x, grouped: bool):
    """-> (inclusive cumsum of x [BR, W] along W, row totals [BR]). `grouped` scans groups
    of SCAN_GROUP adjacent columns, then the group totals: Triton runs that far faster than
    one scan over a row of hundreds or thousands of columns (`_keep_tile`; docs/tuning.md).
    Tile widths are powers of 2 (`_check_tuning`), so min(SCAN_GROUP, W) divides W."""
    if not grouped:
        return jnp.cumsum(x, axis=1), jnp.sum(x, axis=1)
    rows, width = x.shape
    group = min(SCAN_GROUP, width)
    grouped_x = x.reshape(rows, width // group, group)
    totals = jnp.sum(grouped_x, axis=2)                                            # [BR, W/g]
    before = jnp.cumsum(totals, axis=1) - totals
    running = (before[:, :, None] + jnp.cumsum(grouped_x, axis=2)).reshape(rows, width)
    return running, jnp.sum(totals, axis=1)


def _keep_tile(indices_ref, store_rows, row_ok, cols, key, thr, ties_wanted, seen, k: int,
               keys_ref=None, grouped_scan: bool = True):
    """Keep key > thr, and ties at thr while their running count E <= ties_wanted; scatter the
    kept columns (and their keys, into keys_ref when given) to their slots, those < k. seen =
    (keys > thr, ties) in the row before this tile, [BR].

    With G the running count of key > thr, a kept column lands at G + min(E, ties_wanted) - 1.
    One scan carries both counts: G in the low 16 bits, E in the high 16 (W <= 2**15)."""
    above_seen, ties_seen = seen
    gt, tie = key > thr[:, None], key == thr[:, None]
    packed = gt.astype(jnp.int32) | (tie.astype(jnp.int32) << 16)
    both, total = _running_sum(packed, grouped_scan)
    above_run = above_seen[:, None] + (both & 0xFFFF)
    ties_run = ties_seen[:, None] + lax.shift_right_logical(both, 16)
    keep = gt | (tie & (ties_run <= ties_wanted[:, None]))
    pos = jnp.where(keep, above_run + jnp.minimum(ties_run, ties_wanted[:, None]) - 1, k)
    keep &= row_ok[:, None] & (pos < k)
    plgpu.store(indices_ref.at[store_rows, pos], jnp.broadcast_to(cols, keep.shape), mask=keep)
    if keys_ref is not None:
        plgpu.store(keys_ref.at[store_rows, pos], key, mask=keep)
    return above_seen + (total & 0xFFFF), ties_seen + lax.shift_right_logical(total, 16)


def _pad_slots(indices_ref, store_rows, row_ok, budget, first, num_slots: int, *, k: int,
               block_k: int):
    """-1 into slots [first, first + num_slots) that are >= the row's budget and < k. Only
    slots >= count are padded, so no slot is written twice."""
    @pl.loop(0, common.cdiv(num_slots, block_k))
    def _(i):
        slots = first + i * block_k + lax.iota(jnp.int32, block_k)[None, :]         # [1, BK]
        pad = (row_ok[:, None] & (slots >= budget[:, None])
               & (slots < jnp.minimum(first + num_slots, k)))
        plgpu.store(indices_ref.at[store_rows, jnp.where(pad, slots, k)],
                    jnp.full(pad.shape, -1, jnp.int32), mask=pad)

