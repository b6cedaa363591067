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

The Pallas paths select on an int32 order key: each float maps to an int32 that orders like
the floats (sign-magnitude -> two's complement, -0.0 -> +0.0, NaN -> INT32_MIN + 1); forced ->
INT32_MAX; columns >= valid are never read and count as INT32_MIN. Each finds the row's
count-th largest key T, then keep keys > T and the first ties at T in index order, scattering
the kept column indices to ascending slots. NaN is not rejected (that would need a
device-to-host check); it ranks lowest, as above.

Per-row path (many rows): one program per row (or per `block_rows` rows) runs a bitwise
binary search for T, one row-wide count per bit, and stops early once a candidate leaves
exactly `count` keys above it. A row of up to `block_n` columns stays in registers; a longer
one is re-read once per bit. The keep then scans the row in tiles of `block_sel` columns, or,
with block_sel >= block_n >= the row, straight from the registers the search used; its
running count goes by groups of SCAN_GROUP columns (`_running_sum`).

Split path (few long rows): programs (row, chunk of `block_n` columns). Eight radix passes of
4 bits each: every program writes the 16-bin histogram of its chunk's keys inside the range
found so far (and the number above it); the next pass folds the row's histograms into the
next 4 bits of T. The last kernel folds the final histograms into T and the ties to keep,
takes each chunk's output offset and share of the ties from the chunks before it (ties go to
the lower index, so to the earlier chunks), and writes its kept indices and its share of the
-1 padding. Nine launches, no atomics.

Sampled path (wide rows, `sample_stride` > 0): the same (row, chunk) programs. The per-row
search over every sample_stride-th column (about SAMPLE_WIDTH of them) finds T^, the sample
key of rank j = b/s + 4 sqrt(b/s) + 4 for budget b and stride s, so that, with four binomial
deviations to spare, at least b and at most the capacity C (`candidate_capacity`) of the
row's keys are >= T^; forced keys always are. One kernel counts the keys >= T^ per chunk, a
second compacts their columns and keys into [R, C] in column order (each chunk from the
offset of the chunks before it), and the per-row search selects among these candidates, ties
to the lower slot being ties to the lower column. The scores are read about twice instead of
nine times, in five launches. A row with fewer candidates than its budget or more than C
(heavy ties at T^, or data that the strided sample misjudges) is searched over its own scores
by the last launch (slower: the row is re-read once per key bit; that kernel's other programs
return at once), so the output is exact either way with no branch between the launches.
`default_tuning` picks the path.

Budget helpers give k_row per row for LycheeDecode's four budget modes and Kascade's ratio:
  TopK       fixed_budget(k, valid)
  Ratio      ratio_budget(ratio, valid, minimum, maximum): Lychee's sparsity theta is
             ratio = 1 - theta; Kascade is ratio_budget(0.1, valid, minimum=128)
  TopP       top_p_budget(scores, p, valid, logits=...)
  Threshold  threshold_budget(scores, threshold, valid, logits=...)
"""
from __future__ import annotations

import dataclasses
import fractions
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from sparsejax.pallas_kernels import common
from sparsejax.pallas_kernels.common import pl, plgpu

INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1
MISSING_KEY = INT32_MIN        # columns >= valid: never counted as candidates
NAN_KEY = INT32_MIN + 1        # NaN: below -inf (whose key is -2139095041)
FORCED_KEY = INT32_MAX         # forced columns: above +inf (whose key is 2139095040)
RADIX_BITS = 4                 # key bits per pass of the split path: 8 passes of 16 bins
RADIX_BINS = 1 << RADIX_BITS
# Path and chunk rule (`default_tuning`), for a 132-SM H100/H200:
RESIDENT_WIDTH = 32768         # widest row the per-row path holds in registers (H200 sweep)
SPLIT_PROGRAMS = 4 * common.NUM_SMS  # programs the split path aims for
MAX_CHUNKS = 256               # every program folds the row's [chunks, 16] histograms per pass
# Sampled-threshold path (rows wider than RESIDENT_WIDTH whose candidates fit it):
SAMPLE_WIDTH = 8192            # sample columns per row: stride = the row's width / this
SAMPLE_SIGMAS = 4              # binomial deviations of margin on either side of the budget
SAMPLE_SLACK = 4               # sample ranks of margin for small budgets
# Fewer rows keep the split path: the sample's search and the candidates' select run one
# program per row, which on a single 128k row costs more than the split path's passes
# (H200: 0.052 vs 0.036 ms at 1 row, 0.057 vs 0.072 ms at 8; benchmarks/results/topk.json).
# With Lychee's 4096-token budget (8192 candidates) the sampled path alone is faster (H200,
# 1 row of 32832 columns: 27.6 against 32.4 us), but not inside a B=1 decode step (H100,
# Llama-8B shapes, 31 such selections: 0.99 ms of kernels against the split path's 0.89).
MIN_SAMPLED_ROWS = 8
# Candidates beyond RESIDENT_WIDTH (budgets above ~30k) are streamed by their per-row select,
# up to this many; wider ones keep the split path.
MAX_CANDIDATES = 4 * RESIDENT_WIDTH
SCAN_GROUP = 32                # columns per group of the keep's two-level scan (H100 sweep)

TUNING = ("split", "sample_stride", "block_rows", "block_n", "block_sel", "block_k",
          "num_warps", "num_stages")


class Selected(NamedTuple):
    indices: jax.Array  # [R, k] int32, ascending, -1 after count
    count: jax.Array    # [R] int32


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["relative", "block_max", "lse"], meta_fields=["block_n"])
@dataclasses.dataclass(frozen=True)
class LogitRows:
    """Score rows as the dense decode kernel leaves them, pooled where they are read: the
    top-k loads these instead of a materialised [R, N] float32 copy.

    With m = block_max[..., g, t // block_n], the score at column t is
      lse given:  sum over g of exp(relative[..., g, t]) * exp(m - lse[..., g])
                  (probabilities of the heads g, summed in order g = 0, 1, ...; the second
                  factor is one per key block, so a column costs one exp per head)
      lse None:   relative[..., 0, t] + m  (a logit; one head)
    relative <= 0 (logits minus a running max m >= them) keeps the first factor in (0, 1].
    `topk_select` takes [R, G, N] rows; the kernel returns a leading [B, groups] instead.
    """
    relative: jax.Array     # [..., G, N] float16 or float32: logits minus a running max
    block_max: jax.Array    # [..., G, ceil(N / block_n)] float32: that max per key block
    lse: jax.Array | None   # [..., G] float32: each head's log-sum-exp; None: logits
    block_n: int

    @property
    def shape(self) -> tuple[int, ...]:
        """The score array's shape: the leading dims and N."""
        return (*self.relative.shape[:-2], self.relative.shape[-1])

    def take(self, groups) -> "LogitRows":
        """The rows of `groups` along the groups axis (as `scores[:, groups]`)."""
        def pick(x):
            return None if x is None else jnp.take(x, jnp.asarray(groups), axis=1)
        return LogitRows(pick(self.relative), pick(self.block_max), pick(self.lse),
                         self.block_n)

    def rows(self) -> "LogitRows":
        """Leading dims flattened: [R, G, N] rows for `topk_select`."""
        def flat(x, trailing):
            return None if x is None else x.reshape(-1, *x.shape[x.ndim - trailing:])
        return LogitRows(flat(self.relative, 2), flat(self.block_max, 2), flat(self.lse, 1),
                         self.block_n)

    def _per_column(self, per_block: jax.Array) -> jax.Array:
        """[..., G, num_blocks] -> [..., G, N]: each key block's value at its columns."""
        return jnp.repeat(per_block, self.block_n, axis=-1)[..., :self.relative.shape[-1]]

    def logits(self) -> jax.Array:
        """Each head's logits [..., G, N] float32: relative plus its key block's max."""
        return self.relative.astype(jnp.float32) + self._per_column(self.block_max)

    def scores(self) -> jax.Array:
        """The materialised scores [..., N] float32."""
        per_column = self._per_column(
            _block_term(self.block_max, None if self.lse is None else self.lse[..., None]))
        return _pool_heads(lambda g: self.relative[..., g, :], lambda g: per_column[..., g, :],
                           self.relative.shape[-2], probs=self.lse is not None)

    def _load(self, rows, row_ok, start, width: int, stride: int, present):
        """Inside a kernel (fields are refs): the scores of rows [BR] x columns
        (start + [0, width)) * stride; start is a multiple of width."""
        cols = (start + lax.iota(jnp.int32, width)[None, :]) * stride
        num_blocks, block_n = self.block_max.shape[-1], self.block_n
        lse = None if self.lse is None else (
            lambda g: plgpu.load(self.lse.at[rows, g], mask=row_ok, other=0)[:, None])
        if stride == 1 and width % block_n == 0:
            # whole key blocks: one block term per block, broadcast over its columns
            blocks = start // block_n + lax.iota(jnp.int32, width // block_n)[None, :]
            ok = row_ok[:, None] & (blocks < num_blocks)

            def per_column(g):
                m = plgpu.load(self.block_max.at[rows[:, None], g, blocks], mask=ok, other=0)
                term = _block_term(m, None if lse is None else lse(g))
                return jnp.broadcast_to(term[:, :, None], (*term.shape, block_n)).reshape(
                    term.shape[0], width)
        else:  # strided or part of a block: gather each column's block max
            def per_column(g):
                m = plgpu.load(self.block_max.at[rows[:, None], g, cols // block_n],
                               mask=present, other=0)
                return _block_term(m, None if lse is None else lse(g))
        return _pool_heads(
            lambda g: plgpu.load(self.relative.at[rows[:, None], g, cols], mask=present,
                                 other=0),
            per_column, self.relative.shape[-2], probs=lse is not None)


def _block_term(block_max, lse):
    """What a key block contributes to each of its columns: exp(m - lse) (probabilities),
    or m (logits, lse None)."""
    return block_max if lse is None else jnp.exp(block_max - lse)


def _pool_heads(relative, per_column, heads: int, probs: bool):
    """The one formula of `LogitRows`, on jnp arrays or kernel tiles: relative(g) and
    per_column(g) (`_block_term` at each column) -> the pooled scores."""
    total = None
    for g in range(heads):
        x = relative(g).astype(jnp.float32)
        term = jnp.exp(x) * per_column(g) if probs else x + per_column(g)
        total = term if total is None else total + term
    return total


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


# --------------------------------------------------------------------------------------------
# Pieces shared by the kernels. rows [BR] are the program's rows (BR = 1 on the split path).


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
        x = scores_ref._load(rows, row_ok, start, width, stride, present)
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
    one scan over a row of hundreds or thousands of columns (`_keep_tile`; H100, k = 10%:
    the per-row path 5-20% faster at 512-2048 rows of 8192-32768, the sampled path 10-12%
    at 512-2048 rows of 65536-131072; groups of 16 to 256 within 2.5% of each other).
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


# --------------------------------------------------------------------------------------------
# Per-row path: one program per `block_rows` rows


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
    search holds in registers: there the grouped scan measured slower (H100: the sampled
    path's select among 32768 candidates 13%, rows of 16384 with k = 20% or pooled logit
    rows 25-39%)."""
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


# --------------------------------------------------------------------------------------------
# Split path: programs (row, chunk of block_n columns). A pass with prefix p and shift s
# counts, per chunk, the keys whose unsigned key u lies in [p, p + 16 << s), by digit
# (u - p) >> s, and the keys above that range. Summed over chunks these give
# count(u >= p + j << s) for every digit j; the next pass appends the largest j whose count
# still reaches the budget. After the pass at shift 0, p + j is T.


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
    prefix = plgpu.load(prefix_ref.at[rows], mask=row_ok, other=0)
    digit = _next_digit(*_load_pass(hist_ref, above_ref, rows, row_ok), budget)
    # The first pass has no last pass (its inputs are zeros): it starts from prefix 0.
    last_shift = jnp.minimum(shift + RADIX_BITS, 32 - RADIX_BITS)
    prefix = jnp.where(shift + RADIX_BITS < 32, prefix | lax.shift_left(digit, last_shift),
                       prefix)
    low = prefix ^ INT32_MIN  # the range's lower end as a signed key
    start = chunk * block_n
    half = RADIX_BINS // 2
    pairs = lax.iota(jnp.int32, half)[None, :]                                      # [1, B/2]

    # Two bins per int32: digit d adds 1 << 16 * (d // 8) at pair d % 8, so eight compares
    # count sixteen bins (a tile's counts fit 16 bits: block_sel <= 2**15; the sum of both
    # fields stays below 2**32, read back with logical shifts).
    def count_tile(i, counts):
        low_bins, high_bins, above = counts
        _, key = _tile_keys(scores_ref, rows, row_ok, valid, start + i * block_sel, block_sel,
                            force_first, force_last)
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

    zeros = jnp.zeros((1, half), jnp.int32)
    low_bins, high_bins, above = lax.fori_loop(0, _chunk_tiles(valid, start, block_n, block_sel),
                                               count_tile,
                                               (zeros, zeros, jnp.zeros((1,), jnp.int32)))
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
    start = chunk * block_n

    def keep_tile(i, seen):
        cols, key = _tile_keys(scores_ref, rows, row_ok, valid, start + i * block_sel,
                               block_sel, force_first, force_last)
        return _keep_tile(indices_ref, rows[:, None], row_ok, cols, key, thr, ties_wanted,
                          seen, k)

    lax.fori_loop(0, _chunk_tiles(valid, start, block_n, block_sel), keep_tile, seen)
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
    shifts = jnp.arange(32 - RADIX_BITS, -1, -RADIX_BITS, dtype=jnp.int32)[:, None]  # [8, 1]

    def run_pass(i, state):
        return radix_pass(shifts[i], scores, valid, k_row, *state)

    if interpret:  # one copy of the interpreted kernel to compile for the CPU, not eight
        state = lax.fori_loop(0, shifts.shape[0], run_pass, state)
    else:  # unrolled: no loop predicate read back between the launches
        for i in range(shifts.shape[0]):
            state = run_pass(i, state)
    return common.pallas_call(
        functools.partial(_compact_kernel, **static, block_k=block_k),
        out_shape=(jax.ShapeDtypeStruct((num_rows, k), jnp.int32),
                   jax.ShapeDtypeStruct((num_rows,), jnp.int32)),
        name="topk_select_compact", **common_kw,
    )(scores, valid, k_row, *state)


# --------------------------------------------------------------------------------------------
# Sampled-threshold path: programs (row, chunk) as on the split path. A per-row search over a
# strided sample of the keys gives a threshold T^ that leaves, with a wide margin, more than
# the budget and fewer than `capacity` keys at or above it; the scores are then read twice
# (count per chunk, compact the candidates) and the per-row search selects among the
# candidates. A row the sample misled (too few or too many candidates) is then searched over
# its own scores by one more kernel.


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


def _per_row_warps(block_rows: int, block_n: int) -> int:
    """Warps of the sampled path's per-row kernels (their rows are partly filled: the keep
    re-reads only the filled tiles)."""
    return max(4, min(16, block_rows * block_n // 2048))


def _per_row_knobs(block_rows: int, block_n: int) -> tuple[int, int]:
    """(num_warps, block_sel) of the per-row path for full rows of block_rows x block_n keys,
    from an H100 sweep of [512 | 2048, 2048..32768] rows: the keep runs on the resident keys
    (block_sel = block_n) at up to 32 keys per thread, except at 16384 keys, where 16 warps
    re-reading 4096-key tiles measured 3-13% faster (512 x 32768: 0.155 ms at 32 warps
    resident, 0.174 at 16 warps in tiles). An H200 agrees at 512 x 32768 (Kascade's group
    sums, k = 10%): 0.161 ms resident at 32 warps, 0.173-0.222 in 4096-16384-key tiles at 8-32
    warps, 0.164-0.189 on the sampled path. Rechecked on an H100 with the grouped scan in
    every keep: 512 x 32768 0.124 ms (tiles: 0.150-0.188), 2048 x 32768 0.456 (0.555-0.717),
    512 x 16384 0.064 (the resident keep at 32 warps 0.063), 2048 x 16384 0.229
    (0.234-0.323). With the tiled keep back on one scan (`_select_rows`), 16384 takes 0.067
    and 0.242 ms; the resident keep at 16384 is not yet measured on logit rows or k = 20%."""
    keys = block_rows * block_n
    if keys > RESIDENT_WIDTH or keys == 16384:
        return 16, 4096
    return max(4, keys // 1024), block_n


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


# --------------------------------------------------------------------------------------------
# Public function


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
      resident rows stay per-row too: one launch against nine, even where the rows leave most
      SMs idle (H100, k = 10%, 8-256 rows of 4096-32768: the per-row path 1.3-5.4x faster,
      e.g. [8, 4096] 0.009 against 0.036 ms, [64, 32768] 0.033 against 0.114, [256, 16384]
      0.037 against 0.201).
    sample_stride (split rows only): the sampled-threshold path, with a sample of about
      SAMPLE_WIDTH columns, for at least MIN_SAMPLED_ROWS rows wider than RESIDENT_WIDTH whose
      candidate capacity is at most MAX_CANDIDATES; else 0, the split path alone.
    Per-row path: block_rows=1, block_n = the row up to RESIDENT_WIDTH, num_warps and
      block_sel from `_per_row_knobs` (1 warp per 1024 columns, 4 to 32, the keep from the
      resident row; 16 warps and 4096-column tiles at 16384; H100 sweep), block_k <= 1024,
      num_stages=1.
    Split path: block_n = columns per program, for about SPLIT_PROGRAMS programs (1024 to
      16384 columns, the whole row if shorter) and at most MAX_CHUNKS chunks per row;
      block_sel = 512 (a [512, 8] one-hot of bin pairs per histogram step), block_k = the
      padding slots per program up to 1024, num_warps=4, num_stages=1.
    Sampled path: the split path's knobs, for its count and compaction over the same chunks
      and for its fallback; the sample's search and the candidates' select take the per-row
      rule for rows of the sample's width and of the capacity.
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
        per_program = common.cdiv(num_rows * n, SPLIT_PROGRAMS)
        block_n = block_n or min(n_pow2, max(1024, common.next_power_of_2(
            common.cdiv(n, MAX_CHUNKS)), min(16384, common.next_power_of_2(per_program))))
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
    tuning = default_tuning(num_rows, n, k, split=split, sample_stride=sample_stride,
                            block_rows=block_rows, block_n=block_n)
    given = dict(split=split, sample_stride=sample_stride, block_rows=block_rows,
                 block_n=block_n, block_sel=block_sel, block_k=block_k, num_warps=num_warps,
                 num_stages=num_stages)
    tuning.update({name: value for name, value in given.items() if value is not None})
    _check_tuning(**tuning)
    valid = jnp.asarray(valid, jnp.int32)
    k_row = jnp.full((num_rows,), k, jnp.int32) if k_row is None else jnp.asarray(k_row, jnp.int32)
    options = dict(k=k, force_first=force_first, force_last=force_last)
    if backend == "reference":
        return _topk_reference_jit(scores, valid, k_row, **options)
    return _topk_pallas_jit(scores, valid, k_row, **options,
                            interpret=common.resolve_interpret(interpret), **tuning)


# --------------------------------------------------------------------------------------------
# Reference


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


# --------------------------------------------------------------------------------------------
# Budgets: k_row [R] int32 for topk_select


def _check_valid(valid):
    valid = jnp.asarray(valid)
    if valid.ndim != 1 or not jnp.issubdtype(valid.dtype, jnp.integer):
        raise ValueError(f"valid: shape={valid.shape} dtype={valid.dtype}: expected [R] int")
    return jnp.maximum(valid.astype(jnp.int32), 0)


def _check_fraction(name, value, *, allow_zero):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (
        0 <= value <= 1 if allow_zero else 0 < value <= 1)
    if not ok:
        raise ValueError(f"{name}={value!r}: expected a static number in "
                         f"{'[0, 1]' if allow_zero else '(0, 1]'}")


def fixed_budget(k, valid):
    """TopK: min(k, valid) per row. k: int >= 0 or [R] int."""
    if isinstance(k, int) and k < 0:
        raise ValueError(f"k={k}: expected >= 0")
    return jnp.minimum(jnp.asarray(k, jnp.int32), _check_valid(valid))


def ratio_budget(ratio: float, valid, minimum: int = 0, maximum: int | None = None):
    """Ratio: min(max(floor(ratio * valid), minimum), valid[, maximum]) per row.

    Kascade's k = min(max(0.1 * len, 128), len) is ratio_budget(0.1, valid, minimum=128);
    LycheeDecode's Ratio with sparsity theta keeps int((1 - theta) * len): ratio = 1 - theta.
    `ratio` is taken as the nearest fraction num/den with den <= 2**15 (exact for decimals such
    as 0.1 or 0.05) and the floor is computed exactly in int32, so 0.1 * 30 gives 3 and never
    2 through float rounding. `maximum` (e.g. the static k of the buffer) caps the result.
    """
    _check_fraction("ratio", ratio, allow_zero=True)
    if not isinstance(minimum, int) or minimum < 0:
        raise ValueError(f"minimum={minimum!r}: expected a static int >= 0")
    if maximum is not None and (not isinstance(maximum, int) or maximum < minimum):
        raise ValueError(f"maximum={maximum!r}: expected None or a static int >= {minimum=}")
    valid = _check_valid(valid)
    frac = fractions.Fraction(ratio).limit_denominator(1 << 15)
    num, den = frac.numerator, frac.denominator
    # num * valid overflows int32; split valid = q * den + r (num <= den, r < den <= 2**15).
    k = num * (valid // den) + (num * (valid % den)) // den
    k = jnp.minimum(jnp.maximum(k, minimum), valid)
    return k if maximum is None else jnp.minimum(k, maximum)


def _row_probabilities(scores, valid, logits: bool):
    """(probabilities [R, N] over each row's valid columns, 0 elsewhere; that mask; valid)."""
    if scores.ndim != 2 or not jnp.issubdtype(scores.dtype, jnp.floating):
        raise ValueError(f"scores: shape={scores.shape} dtype={scores.dtype}: "
                         "expected a [R, N] float array")
    valid = _check_valid(valid)
    if valid.shape[0] != scores.shape[0]:
        raise ValueError(f"valid: shape={valid.shape}: expected [{scores.shape[0]}] "
                         f"(one per row of scores {scores.shape})")
    scores = scores.astype(jnp.float32)
    present = jnp.arange(scores.shape[1])[None, :] < valid[:, None]
    if logits:
        top = jnp.max(jnp.where(present, scores, -jnp.inf), axis=1, keepdims=True)
        mass = jnp.where(present, jnp.exp(scores - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)
    else:
        mass = jnp.where(present, scores, 0.0)
    total = jnp.sum(mass, axis=1, keepdims=True)
    return mass / jnp.where(total > 0, total, 1.0), present, valid


def top_p_budget(scores, p: float, valid, *, logits: bool = True):
    """TopP: the fewest columns whose probability mass reaches p (0 < p <= 1), per row.

    scores [R, N]: logits (probabilities = softmax over the valid columns) when logits=True,
    else non-negative weights (probabilities = weights / their sum over the valid columns,
    e.g. post-softmax attention pooled over heads). Forced columns get no special treatment:
    the budget counts the columns the scores themselves need. A row whose float mass falls
    short of p (or that has no mass at all) keeps all valid columns; an empty row gets 0.
    NaN scores give an unspecified budget.

    No sort: a 31-step bitwise search over the bits of the (non-negative) probabilities finds
    the largest probability t with mass(prob >= t) >= p, each step one masked row sum; ties
    at t are then counted as ceil((p - mass(prob > t)) / t).
    """
    _check_fraction("p", p, allow_zero=False)
    prob, present, valid = _row_probabilities(scores, valid, logits)

    def step(i, t):  # t [R]: int32 bits of a non-negative float; such bits order like the floats
        cand = t | lax.shift_left(jnp.int32(1), 30 - i)
        mass = jnp.sum(jnp.where(prob >= lax.bitcast_convert_type(cand, jnp.float32)[:, None],
                                 prob, 0.0), axis=1)
        return jnp.where(mass >= p, cand, t)

    t_bits = lax.fori_loop(0, 31, step, jnp.zeros(prob.shape[:1], jnp.int32))
    t = lax.bitcast_convert_type(t_bits, jnp.float32)[:, None]
    above = prob > t
    mass_above = jnp.sum(jnp.where(above, prob, 0.0), axis=1)
    ties = jnp.sum(present & (prob == t), axis=1)
    need = jnp.ceil((p - mass_above) / jnp.where(t[:, 0] > 0, t[:, 0], 1.0)).astype(jnp.int32)
    count = jnp.sum(above, axis=1) + jnp.clip(need, 1, ties)
    return jnp.where(t_bits > 0, count, valid).astype(jnp.int32)


def threshold_budget(scores, threshold: float, valid, *, logits: bool = True):
    """Threshold: valid columns with probability >= threshold, at least 1 (0 for an empty row).

    Probabilities as in `top_p_budget`. LycheeDecode's reference code keeps prob > threshold;
    the two differ only on exact equality.
    """
    _check_fraction("threshold", threshold, allow_zero=False)
    prob, present, valid = _row_probabilities(scores, valid, logits)
    count = jnp.sum(present & (prob >= threshold), axis=1)
    return jnp.minimum(jnp.maximum(count, 1), valid).astype(jnp.int32)
