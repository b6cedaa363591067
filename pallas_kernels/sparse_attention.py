"""Sparse gather decode attention over a paged KV cache.

One decode query per row attends to a selected subset of its cached positions: the reuse
layers of DELTA / Kascade / TidalDecode, LycheeDecode's hybrid layers (sparse heads read a
selection, retrieval heads read everything) and RESA's prior partials, in one kernel.

Selection. `indices [B, G, K]` (sorted ascending, unique, valid up to `count [B, G]`) names
logical units of `unit` tokens: index i covers positions [i*unit, (i+1)*unit). G = 1: one set
for every head; G = HK: a set per KV head, read through `head_map`; G = HQ: a set per query
head. Positions >= length, negative indices and entries past count are skipped.

Work decomposition (the GPU kernel). A *row group* is the set of query rows that share both
a KV head and a selection: the GQA group of a KV head (G in {1, HK}) or a single query head
(G = HQ). Each row group's work is a token stream: the `count*unit` selected positions of a
sparse head, or [0, length) of a dense head. Every stream is cut into splits of the same
static size `split_tokens`, and the grid is (row groups, max splits per row group): program
(r, j) processes split j of row group r and writes one (out, lse) partial, or an empty one
(lse = -inf, out not written) when its stream is shorter. Because every non-empty program
does the same amount of work whatever head it belongs to, the hardware block scheduler
balances the pool of splits across SMs: a dense head becomes many splits instead of one long
program (LycheeDecode's pooled equal splits). `dense_heads` is traced, so the grid is sized
for the worst case (max_pages*P tokens) only when it is given; an empty program runs no step.
`common.merge_splits` combines the partials.

One split per row group (split_tokens >= the longest stream, a static fact of the shapes):
the kernel writes the normalised output in q's dtype and the final LSE itself, and there is
no partial buffer and no merge. At small work per row group (DELTA's 64 pages, Kascade at 8k)
the merge's two XLA fusions, their launches and the f32 partial round trip are a
double-digit share of the call; the default tuning picks this path whenever the row groups
alone fill the GPU (`default_tuning`).

Each program walks its split in steps of `block_n` tokens: token -> selected index ->
logical position -> (page_table[b, pos // P], pos % P) -> one D-row of K and of V in the
cache viewed as [num_pages * HK * P, D] rows, gathered with masked vector loads (each row is
D contiguous elements, so every gather is whole 128-byte lines). The two lookups run ahead of
the gathers and are carried (`lookahead`): with lookahead 2, step i issues its own K/V loads
(addresses known when it starts), the page-table loads of step i+1 (indices read in step
i-1) and the index loads of step i+2, none of which waits for another, so the dependent
chain index -> page -> K/V is paid once per program, not once per step. Lookahead 1 reads
both lookups of step i+1 in step i (the page load waits for the index load); 0 none. The row
group's queries are padded to 16 rows (M >= 16 for the dot); with RESA the prior queries mu_Q
are stacked under them, so one gather feeds both softmaxes. The prior's bound (positions <
prior_length) is a per-row position limit set before the loop, one compare per logit; the
default bound (lengths) is implied by the attended positions, so then the kernel takes no
bound and its loop is the loop without the prior (the same registers and instructions: the
row-dependent mask costs registers per thread; docs/tuning.md).

Given logits. A layer that attends to the top-k of its own scores (Kascade's sparse anchors,
oracle top-k) has already computed every q.k in its scores pass (`paged_decode_attention`
with pool_scores=False leaves them as `LogitRows`). With `logits=` the kernel gathers
those at the selected positions (float16 and a float32 max per key block) instead of K:
about a third of the bytes of a K row per token, so the step reads V and little else.

One file, as every kernel family: the kernel, its wrapper, the public function and its
reference twin side by side.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from . import common
from .common import pl, plgpu
from .decode_attention import LogitRows

# Default split rule (`default_tuning`): a block_n=64, 2-stage program's K/V buffers
# (64 KiB) allow ~3 resident programs per SM.
_PROGRAMS_PER_SM = 3
_MAX_SPLIT_TOKENS = 2048  # longest split below a wave of row groups: bounds the tail (~1 MiB)
_MIN_SPLIT_TOKENS = 256  # shortest split: the prologue and the partial write stay amortised
_TARGET_WAVES = 4  # when splitting anyway: ~4 waves of resident programs, a short tail
_MAX_DENSE_SPLITS = 128  # dense heads: mostly-empty grids cost scheduling and partial bytes


class SparseAttention(NamedTuple):
    out: jax.Array  # [B, HQ, D] q.dtype
    lse: jax.Array  # [B, HQ] f32, natural log over the attended positions
    prior: tuple[jax.Array, jax.Array] | None  # (prior_lse [B, HQ] f32, prior_out [B, HQ, D] f32)


def _load(ref, mask, other):
    """plgpu.load, unmasked when mask is None."""
    return plgpu.load(ref) if mask is None else plgpu.load(ref, mask=mask, other=other)


def _row_group(row_group, head_map_ref, *, mode, has_head_map, num_heads, kv_heads):
    """Program axis 0 -> (b, h, g, head0): the batch row, the KV head, the selection group the
    row group reads and its first query head. A row group is one query head (mode "q") or the
    GQA group of a KV head."""
    group_size = num_heads // kv_heads
    if mode == "q":
        b, head0 = lax.div(row_group, num_heads), lax.rem(row_group, num_heads)
        return b, lax.div(head0, group_size), head0, head0
    b, h = lax.div(row_group, kv_heads), lax.rem(row_group, kv_heads)
    head0 = h * group_size
    # A head map entry out of range is clamped rather than read out of bounds.
    g = jnp.clip(head_map_ref[h], 0, kv_heads - 1) if has_head_map else (
        h if mode == "kv" else 0)
    return b, h, g, head0


@dataclasses.dataclass(frozen=True)
class _Stream:
    """Split `split` of a row group's token stream: the `count * unit` selected positions of a
    sparse head, or [0, length) of a dense head, walked in steps of `block_n` tokens. Each
    step's two dependent lookups are `entries` (token -> selected index) and `coords` (index
    -> logical position -> K/V row through the page table)."""
    indices_ref: Any        # [B, G, K] int32
    page_table_ref: Any     # [B, max_pages] int32
    b: Any                  # the row group's batch row, KV head and selection group
    h: Any
    g: Any
    length: Any             # the row's length, at most the positions the page table addresses
    n_tokens: Any           # the stream's length
    dense: Any              # the KV head attends densely (False without dense heads)
    start: Any              # the split's first offset into the stream
    n_steps: Any            # steps of this split that hold stream tokens
    has_dense: bool
    unit: int
    kv_heads: int
    page_size: int
    block_n: int

    @classmethod
    def locate(cls, indices_ref, page_table_ref, lengths_ref, count_ref, dense_ref, b, h, g,
               split, *, has_dense, unit, kv_heads, page_size, block_n, split_tokens):
        length = jnp.minimum(lengths_ref[b], page_table_ref.shape[1] * page_size)
        n_tokens = jnp.clip(count_ref[b, g], 0, indices_ref.shape[2]) * unit
        dense = dense_ref[h] if has_dense else False
        if has_dense:
            n_tokens = jnp.where(dense, length, n_tokens)
        start = split * split_tokens
        n_steps = lax.div(n_tokens - start + block_n - 1, block_n)
        n_steps = jnp.clip(n_steps, 0, split_tokens // block_n)
        return cls(indices_ref, page_table_ref, b, h, g, length, n_tokens, dense, start,
                   n_steps, has_dense, unit, kv_heads, page_size, block_n)

    @property
    def span(self) -> int:
        """Positions the page table can address."""
        return self.page_table_ref.shape[1] * self.page_size

    def offsets(self, i):
        """Step i's offsets into the stream ([block_n] int32)."""
        return self.start + i * self.block_n + jnp.arange(self.block_n)

    def entries(self, i):
        """Step i's selected indices ([block_n] int32): the first of its two dependent
        lookups. Index entries are clamped in bounds, so the load needs no mask and waits
        for neither `count` nor `length`; what it reads for dead tokens is discarded. With
        dense heads the grid is mostly empty programs: there the lookup is masked off."""
        t = self.offsets(i)
        max_entries = self.indices_ref.shape[2]
        entry = jnp.minimum(t if self.unit == 1 else lax.div(t, self.unit), max_entries - 1)
        lookup = None
        if self.has_dense:
            lookup = jnp.broadcast_to((i < self.n_steps) & jnp.logical_not(self.dense),
                                      (self.block_n,))
        return _load(self.indices_ref.at[self.b, self.g, entry], lookup, -1)

    def coords(self, i, idx):
        """Step i's K/V rows and logical positions from its indices ([block_n] int32 each;
        row 0 and position -1 where nothing is attended): the page-table lookup."""
        t = self.offsets(i)
        unit, span, page_size = self.unit, self.span, self.page_size
        live = t < self.n_tokens
        in_cache = (idx >= 0) & (idx < common.cdiv(span, unit))  # and idx * unit cannot overflow
        pos = idx if unit == 1 else idx * unit + lax.rem(t, unit)
        if self.has_dense:
            pos = jnp.where(self.dense, t, pos)
            in_cache = in_cache | self.dense
        valid = live & in_cache & (pos < self.length)
        slot = jnp.clip(pos, 0, span - 1)
        page = _load(self.page_table_ref.at[self.b, lax.div(slot, page_size)],
                     jnp.broadcast_to(i < self.n_steps, (self.block_n,)) if self.has_dense
                     else None, 0)
        row = common.cache_row(page, self.h, slot, kv_heads=self.kv_heads, page_size=page_size)
        return jnp.where(valid, row, 0), jnp.where(valid, pos, -1)


class _QueryRows(NamedTuple):
    """The program's block_h query rows: [0, rows) the queries, [rows, 2*rows) the RESA prior
    queries, the rest padding (M >= 16 for the dots)."""
    r: jax.Array            # [block_h] row index
    is_q: jax.Array         # [block_h] bool
    is_prior: jax.Array     # [block_h] bool
    head: jax.Array         # [block_h] query head of each row (head0 for padding)
    cols: jax.Array         # [1, D] column index
    qs: jax.Array           # [block_h, D]
    row_limit: jax.Array | None   # [block_h] positions each row attends below (prior bound)


def _row_mask(m, head_dim):
    """[block_h] -> [block_h, D]: a row mask for whole-row loads and stores."""
    return jnp.broadcast_to(m[:, None], (m.shape[0], head_dim))


def _load_queries(q_ref, prior_query_ref, prior_length_ref, b, head0, span, *, rows, block_h,
                  has_prior, has_prior_bound) -> _QueryRows:
    head_dim = q_ref.shape[2]
    r = jnp.arange(block_h)
    is_q = r < rows
    is_prior = (r >= rows) & (r < 2 * rows) if has_prior else jnp.zeros_like(is_q)
    head = head0 + jnp.where(is_q, r, jnp.where(is_prior, r - rows, 0))
    # Gathers and scatters index every axis with arrays (interpret mode has no mixed form).
    cols = jnp.arange(head_dim)[None, :]
    qs = plgpu.load(q_ref.at[b, head[:, None], cols], mask=_row_mask(is_q, head_dim), other=0)
    if has_prior:
        mu = plgpu.load(prior_query_ref.at[b, head[:, None], cols],
                        mask=_row_mask(is_prior, head_dim), other=0)
        qs = jnp.where(_row_mask(is_prior, head_dim), mu.astype(qs.dtype), qs)
    row_limit = None
    if has_prior_bound:
        # The prior rows' bound as a per-row position limit, fixed before the loop: one
        # compare per logit in the loop instead of a row mask and a column mask combined.
        row_limit = jnp.where(is_q, span, prior_length_ref[b])
    return _QueryRows(r, is_q, is_prior, head, cols, qs, row_limit)


def _gather(rows_ref, scale_ref, row, pos, cols, dtype, values=False):
    """One step's K or V tile ([block_n, D]; zero where nothing is attended) and its rows'
    scales: as stored and None, or with `scale_ref` (an fp8 cache) the fp8 tile in `dtype`,
    q's (V's as its column pair, `common.load_fp8_pairs`), and [block_n] f32 scales that
    `common.fold_scales` applies past the dots."""
    if scale_ref is not None and values:
        return common.load_fp8_pairs(rows_ref, scale_ref, row, pos >= 0, dtype)
    if scale_ref is not None:
        return common.load_fp8(rows_ref, scale_ref, row, cols, pos >= 0, dtype)
    tile_mask = jnp.broadcast_to((pos >= 0)[:, None], (pos.shape[0], cols.shape[1]))
    return plgpu.load(rows_ref.at[row[:, None], cols], mask=tile_mask, other=0), None


@dataclasses.dataclass(frozen=True)
class _GivenLogits:
    """The layer's own logits (`LogitRows`, one row per query head), read at the step's
    positions instead of recomputing q.k from K."""
    relative_ref: Any       # [B, HQ, T] float16 / float32: logits minus their block's max
    block_max_ref: Any      # [B, HQ, ceil(T / block_n)] float32
    block_n: int

    def load(self, b, queries: _QueryRows, pos):
        """[block_h, block_n] logits in base 2 (0 where nothing is attended)."""
        ok = queries.is_q[:, None] & (pos >= 0)[None, :]
        col = jnp.maximum(pos, 0)[None, :]
        head = queries.head[:, None]
        rel = plgpu.load(self.relative_ref.at[b, head, col], mask=ok, other=0)
        peak = plgpu.load(self.block_max_ref.at[b, head, lax.div(col, self.block_n)], mask=ok,
                          other=0)
        return (rel.astype(jnp.float32) + peak) * common.LOG2E


def _online_softmax(queries: _QueryRows, s, v, v_scale, pos, acc, m, l):
    """Fold one step's base-2 logits s [block_h, block_n] and V tile (with an fp8 cache its
    rows' scales v_scale [block_n], else None) into the running (acc [block_h, D], max m,
    sum l)."""
    keep = (pos >= 0)[None, :]
    if queries.row_limit is not None:
        keep = keep & (pos[None, :] < queries.row_limit[:, None])
    return common.online_softmax_step(
        jnp.where(keep, s, -jnp.inf), v, v_scale, acc, m, l,
        functools.partial(plgpu.dot, precision=lax.Precision.HIGHEST), base2=True,
        empty_rows=True)


def _attend_stream(stream: _Stream, queries: _QueryRows, k_rows_ref, v_rows_ref,
                   k_scale_ref, v_scale_ref, given: _GivenLogits | None, *, scale, lookahead):
    """Online softmax over the split's steps -> (acc, m, l). The lookups run `lookahead` steps
    ahead of the K/V gathers (see the module docstring): step i issues its K (or given
    logits) and V loads first, then the page lookup of step i+1 and, with lookahead 2, the
    index lookup of step i+2, none waiting for another."""
    def step(i, carry):
        acc, m, l, *ahead = carry
        if lookahead == 0:
            row, pos = stream.coords(i, stream.entries(i))
        else:
            row, pos = ahead[:2]
        dtype = queries.qs.dtype
        if given is None:
            k, k_scale = _gather(k_rows_ref, k_scale_ref, row, pos, queries.cols, dtype)
        else:
            s = given.load(stream.b, queries, pos)
        v, v_scale = _gather(v_rows_ref, v_scale_ref, row, pos, queries.cols, dtype,
                             values=True)
        if lookahead == 1:
            ahead = list(stream.coords(i + 1, stream.entries(i + 1)))
        elif lookahead == 2:
            ahead = [*stream.coords(i + 1, ahead[2]), stream.entries(i + 2)]
        if given is None:
            # f32 inputs: IEEE dots (Triton's default is TF32); bf16/f16 are unaffected.
            s = plgpu.dot(queries.qs, k, trans_b=True, precision=lax.Precision.HIGHEST) * scale
            s = common.fold_scales(s, k_scale, axis=1)
        return (*_online_softmax(queries, s, v, v_scale, pos, acc, m, l), *ahead)

    block_h, head_dim = queries.qs.shape
    acc = common.zero_values(block_h, head_dim, pairs=v_scale_ref is not None)
    m = jnp.full((block_h,), -jnp.inf, jnp.float32)
    l = jnp.zeros((block_h,), jnp.float32)
    ahead = ()
    if lookahead >= 1:
        ahead = stream.coords(0, stream.entries(0))
    if lookahead == 2:
        ahead = (*ahead, stream.entries(1))
    return lax.fori_loop(0, stream.n_steps, step, (acc, m, l, *ahead))[:3]


def _write(queries: _QueryRows, acc, m, l, b, split, out_ref, lse_ref, prior_out_ref,
           prior_lse_ref, *, num_heads, direct):
    """Normalise and store the query rows' (out, lse), and the prior rows' when given: the
    final result with one split (`direct`), else this split's partial."""
    nonempty = l > 0
    out, lse = common.softmax_result(acc, m, l, nonempty)
    for rows_here, o_ref, l_ref in ((queries.is_q, out_ref, lse_ref),
                                    (queries.is_prior, prior_out_ref, prior_lse_ref)):
        if o_ref is None:
            continue
        # Masked rows get distinct out-of-range heads: never written, never aliasing a real row.
        dst = jnp.where(rows_here, queries.head, num_heads + queries.r)
        # A partial with nothing attended writes only its lse (-inf): the merge zeroes its
        # out, so empty programs (most of a dense-head grid) cost no partial bytes.
        written = rows_here if direct else rows_here & nonempty
        for part, cols in common.column_parts(out):
            plgpu.store(o_ref.at[split, b, dst[:, None], cols], part.astype(o_ref.dtype),
                        mask=_row_mask(written, part.shape[1]))
        plgpu.store(l_ref.at[split, b, dst], lse, mask=rows_here)


def _sparse_decode_kernel(
    page_table_ref,  # [B, max_pages] int32
    lengths_ref,  # [B] int32
    indices_ref,  # [B, G, K] int32
    count_ref,  # [B, G] int32
    q_ref,  # [B, HQ, D]
    k_rows_ref,  # [num_pages * HK * P, D]: row (page * HK + h) * P + slot
    v_rows_ref,  # [num_pages * HK * P, D]; fp8: [.., D / 2] uint16 (`common.value_pairs`)
    *refs,  # optional inputs, then outputs; see the unpacking below
    mode: str,
    has_head_map: bool,
    has_dense: bool,
    has_prior: bool,
    has_prior_bound: bool,
    quantized: bool,
    logits_block_n: int | None,
    unit: int,
    kv_heads: int,
    page_size: int,
    sm_scale: float,
    block_h: int,
    block_n: int,
    split_tokens: int,
    lookahead: int,
):
    """Program (row group, split): attend the row group's query rows to the split's part of
    its token stream and write the result (one split) or a partial."""
    refs = list(refs)
    head_map_ref = refs.pop(0) if has_head_map else None  # [HK] int32
    dense_ref = refs.pop(0) if has_dense else None  # [HK] bool
    prior_query_ref = refs.pop(0) if has_prior else None  # [B, HQ, D]
    prior_length_ref = refs.pop(0) if has_prior_bound else None  # [B] int32
    # fp8 cache: a float32 scale per cache row [num_pages * HK * P]; no K scale with given
    # logits (no K is read)
    k_scale_ref = refs.pop(0) if quantized and logits_block_n is None else None
    v_scale_ref = refs.pop(0) if quantized else None
    given = None
    if logits_block_n is not None:  # [B, HQ, T] relative logits, [B, HQ, NB] block maxes
        given = _GivenLogits(refs.pop(0), refs.pop(0), logits_block_n)
    # [S, B, HQ, D] f32 partials and [S, B, HQ] f32, or with one split (S = 1) the final
    # out in q's dtype and lse; then the same for the prior.
    out_ref, lse_ref = refs[:2]
    prior_out_ref, prior_lse_ref = refs[2:] if has_prior else (None, None)
    num_heads = q_ref.shape[1]

    row_group, split = pl.program_id(0), pl.program_id(1)
    b, h, g, head0 = _row_group(row_group, head_map_ref, mode=mode, has_head_map=has_head_map,
                                num_heads=num_heads, kv_heads=kv_heads)
    stream = _Stream.locate(indices_ref, page_table_ref, lengths_ref, count_ref, dense_ref, b,
                            h, g, split, has_dense=has_dense, unit=unit, kv_heads=kv_heads,
                            page_size=page_size, block_n=block_n, split_tokens=split_tokens)
    queries = _load_queries(q_ref, prior_query_ref, prior_length_ref, b, head0, stream.span,
                            rows=1 if mode == "q" else num_heads // kv_heads, block_h=block_h,
                            has_prior=has_prior, has_prior_bound=has_prior_bound)
    acc, m, l = _attend_stream(stream, queries, k_rows_ref, v_rows_ref, k_scale_ref,
                               v_scale_ref, given,
                               scale=sm_scale * common.LOG2E,  # online softmax in base 2
                               lookahead=lookahead)
    _write(queries, acc, m, l, b, split, out_ref, lse_ref, prior_out_ref, prior_lse_ref,
           num_heads=num_heads, direct=out_ref.shape[0] == 1)


def _split_tokens(stream: int, splits: int, block_n: int) -> int:
    """Tokens per split that cut a `stream`-token stream into `splits` even pieces, rounded up
    to whole steps (no short last split)."""
    return max(block_n, common.cdiv(common.cdiv(stream, max(1, splits)), block_n) * block_n)


def default_splits(row_groups: int, sparse_tokens: int, block_n: int = 64) -> int:
    """Splits per sparse row group.

    One (the direct-write path, no merge) when the row groups alone make a wave of resident
    programs (_PROGRAMS_PER_SM on each of `common.num_sms()`), however long their streams:
    equal streams leave no tail to balance, and splitting them measured no faster
    (docs/tuning.md). Otherwise enough even splits for both ~_TARGET_WAVES waves of programs
    and no split longer than _MAX_SPLIT_TOKENS, none shorter than _MIN_SPLIT_TOKENS. Where even
    that leaves less than a wave (a batch of 1-8), a program's time is its chain of dependent
    block gathers, not bandwidth: the stream is cut down to one `block_n` step per program, up
    to a wave.
    """
    wave = _PROGRAMS_PER_SM * common.num_sms()
    if row_groups >= wave:
        return 1
    needed = common.cdiv(sparse_tokens, _MAX_SPLIT_TOKENS)
    fill = min(common.cdiv(_TARGET_WAVES * wave, row_groups),
               sparse_tokens // _MIN_SPLIT_TOKENS)
    if row_groups * fill < wave:
        fill = min(common.cdiv(wave, row_groups), common.cdiv(sparse_tokens, block_n))
    return max(needed, fill, 1)


def default_tuning(head_dim: int, row_groups: int, sparse_tokens: int, dense_tokens: int = 0,
                   *, splits: int | None = None, block_n: int | None = None,
                   given_logits: bool = False, itemsize: int = 2,
                   fp8_cache: bool = False) -> dict:
    """Static knobs from the shapes (`splits`/`block_n` override the rule, for sweeps).

    row_groups: B * HQ (one selection per query head) or B * HK; sparse_tokens: K * unit, the
    longest sparse stream; dense_tokens: max_pages * P with dense heads, else 0.
    block_n: 64 rows (16 KiB of bf16 K at D=128; 32 at D=256); four times that with given
      logits, whose 2-byte gathers keep too few bytes in flight at 64, up to a 64 KiB V tile
      (itemsize: bytes per cache element), so that two stages fit in shared memory.
    split_tokens: the sparse stream in `default_splits` even pieces, but no more than
      _MAX_DENSE_SPLITS splits of a dense head's max_pages*P tokens.
    num_warps: 2 for purely sparse work at D <= 128 (the M=16 dots need no more, and 2 beat
      4 in every Kascade and DELTA case measured), 4 with dense heads, given logits or
      D = 256.
    num_stages: 2; 3 on an fp8 cache (`fp8_cache`) without given logits, whose half-size
      tiles leave fewer bytes in flight per stage.
    lookahead: 2 (the lookups never wait for each other; see the module docstring).
    The measurements are in docs/tuning.md.
    """
    if block_n is None:
        block_n = 64 if head_dim <= 128 else 32
        if given_logits:
            block_n = min(4 * block_n, 65536 // (head_dim * itemsize))
    if splits is None:
        splits = default_splits(row_groups, sparse_tokens, block_n)
    split = _split_tokens(sparse_tokens, splits, block_n)
    split = max(split, _split_tokens(dense_tokens, _MAX_DENSE_SPLITS, block_n))
    num_warps = 2 if dense_tokens == 0 and head_dim <= 128 and not given_logits else 4
    num_stages = 3 if fp8_cache and not given_logits else 2
    return {"block_n": block_n, "split_tokens": split, "num_warps": num_warps,
            "num_stages": num_stages, "lookahead": 2}


@functools.partial(
    jax.jit,
    static_argnames=("mode", "unit", "sm_scale", "logits_block_n", "block_n", "split_tokens",
                     "num_warps", "num_stages", "lookahead", "interpret"))
def _sparse_decode_pallas(q, k_pages, v_pages, page_table, lengths, indices, count, head_map,
                          dense_heads, prior_query, prior_length, k_scale, v_scale,
                          logits_relative, logits_block_max, *, mode, unit, sm_scale,
                          logits_block_n, block_n, split_tokens, num_warps, num_stages,
                          lookahead, interpret):
    batch, num_heads, head_dim = q.shape
    num_pages, kv_heads, page_size = k_pages.shape[:3]
    max_pages, max_entries = page_table.shape[1], indices.shape[2]
    has_prior = prior_query is not None
    rows = 1 if mode == "q" else num_heads // kv_heads
    block_h = max(16, common.next_power_of_2(rows * (2 if has_prior else 1)))
    row_groups = batch * (num_heads if mode == "q" else kv_heads)
    stream = max_entries * unit
    if dense_heads is not None:
        stream = max(stream, max_pages * page_size)
    num_splits = common.cdiv(stream, split_tokens)
    direct = num_splits == 1
    # Free reshape of the contiguous cache: one row per (page, head, slot), as the dense kernel.
    k_rows = k_pages.reshape(num_pages * kv_heads * page_size, head_dim)
    v_rows = v_pages.reshape(num_pages * kv_heads * page_size, head_dim)
    if v_scale is not None:
        v_rows = common.value_pairs(v_rows)

    if logits_relative is not None:
        k_scale = None  # given logits: no K is read
    optional = [x for x in (head_map, dense_heads, prior_query, prior_length,
                            common.scale_rows(k_scale), common.scale_rows(v_scale),
                            logits_relative, logits_block_max) if x is not None]
    out_dtype = q.dtype if direct else jnp.float32
    out_shape = [jax.ShapeDtypeStruct((num_splits, batch, num_heads, head_dim), out_dtype),
                 jax.ShapeDtypeStruct((num_splits, batch, num_heads), jnp.float32)]
    if has_prior:
        out_shape += [jax.ShapeDtypeStruct((num_splits, batch, num_heads, head_dim), jnp.float32),
                      out_shape[1]]
    kernel = functools.partial(
        _sparse_decode_kernel, mode=mode, has_head_map=head_map is not None,
        has_dense=dense_heads is not None, has_prior=has_prior,
        has_prior_bound=prior_length is not None, quantized=v_scale is not None,
        logits_block_n=logits_block_n, unit=unit,
        kv_heads=kv_heads,
        page_size=page_size, sm_scale=sm_scale, block_h=block_h, block_n=block_n,
        split_tokens=split_tokens, lookahead=lookahead)
    partials = common.pallas_call(
        kernel,
        grid=(row_groups, num_splits),
        out_shape=out_shape,
        compiler_params=common.triton_params(num_warps, num_stages),
        interpret=interpret,
        name=f"sparse_decode_{mode}_unit{unit}_{'direct' if direct else 'split'}"
             f"{'' if logits_block_n is None else '_given_logits'}",
    )(page_table, lengths, indices, count, q, k_rows, v_rows, *optional)

    def combine(out, lse, dtype):
        if direct:
            return out[0], lse[0]
        # [S, B, HQ, ...] -> [1, S, B * HQ, ...]: free reshapes. Empty partials left their out
        # unwritten; their lse is -inf and the merge never reads them.
        out, lse = common.merge_splits(out.reshape(1, num_splits, -1, head_dim),
                                       lse.reshape(1, num_splits, -1), out_dtype=dtype,
                                       interpret=interpret)
        return out.reshape(batch, num_heads, head_dim), lse.reshape(batch, num_heads)

    out, lse = combine(partials[0], partials[1], q.dtype)
    prior = None
    if has_prior:
        prior_out, prior_lse = combine(partials[2], partials[3], jnp.float32)
        prior = (prior_lse, prior_out)
    return SparseAttention(out, lse, prior)


def _check_inputs(q, k_pages, v_pages, page_table, lengths, indices, count, unit, head_map,
                  dense_heads, prior_query, prior_length, logits=None, k_scale=None,
                  v_scale=None) -> str:
    """Validates shapes and dtypes; returns the selection mode: 'kv', 'shared' or 'q'."""
    def expect(ok, name, value, expected):
        if not ok:
            raise ValueError(f"{name}={value}: expected {expected}")

    expect(q.ndim == 3, "q.shape", q.shape, "[batch, q_heads, head_dim]")
    expect(k_pages.ndim == 4, "k_pages.shape", k_pages.shape,
           "[num_pages, kv_heads, page_size, head_dim]")
    batch, num_heads, head_dim = q.shape
    _, kv_heads, page_size, _ = k_pages.shape
    expect(jnp.issubdtype(q.dtype, jnp.floating), "q.dtype", q.dtype, "a floating dtype")
    quantized = common.check_kv_scales(k_pages, v_pages, k_scale, v_scale)
    expect(quantized or k_pages.dtype == q.dtype, "k_pages.dtype", k_pages.dtype,
           f"q's dtype {q.dtype} (or {common.FP8} with k_scale and v_scale)")
    expect(v_pages.shape == k_pages.shape and v_pages.dtype == k_pages.dtype,
           "v_pages", (v_pages.shape, v_pages.dtype), f"k_pages' {k_pages.shape} {k_pages.dtype}")
    expect(k_pages.shape[3] == head_dim, "k_pages.shape[3]", k_pages.shape[3],
           f"q's head_dim {head_dim}")
    expect(num_heads % kv_heads == 0, "q_heads", num_heads, f"a multiple of kv_heads={kv_heads}")
    expect(page_table.ndim == 2 and page_table.shape[0] == batch
           and page_table.dtype == jnp.int32, "page_table",
           (page_table.shape, page_table.dtype), f"[{batch}, max_pages] int32")
    expect(lengths.shape == (batch,) and lengths.dtype == jnp.int32, "lengths",
           (lengths.shape, lengths.dtype), f"[{batch}] int32")
    expect(indices.ndim == 3 and indices.shape[0] == batch and indices.shape[2] >= 1
           and indices.dtype == jnp.int32, "indices", (indices.shape, indices.dtype),
           f"[{batch}, groups, k >= 1] int32")
    groups = indices.shape[1]
    expect(groups in (1, kv_heads, num_heads), "indices.shape[1]", groups,
           f"1, kv_heads={kv_heads} or q_heads={num_heads}")
    expect(count.shape == (batch, groups) and count.dtype == jnp.int32, "count",
           (count.shape, count.dtype), f"[{batch}, {groups}] int32")
    expect(isinstance(unit, int) and unit >= 1 and (unit == 1 or unit % page_size == 0),
           "unit", unit, f"1 or a positive multiple of page_size={page_size}")
    mode = "kv" if groups == kv_heads else ("shared" if groups == 1 else "q")
    if head_map is not None:
        expect(mode == "kv", "head_map", "given",
               f"None unless indices has one group per KV head (G={kv_heads}, got {groups})")
        expect(head_map.shape == (kv_heads,) and jnp.issubdtype(head_map.dtype, jnp.integer),
               "head_map", (head_map.shape, head_map.dtype), f"[{kv_heads}] integer")
    if dense_heads is not None:
        expect(dense_heads.shape == (kv_heads,) and dense_heads.dtype == jnp.bool_,
               "dense_heads", (dense_heads.shape, dense_heads.dtype), f"[{kv_heads}] bool")
    if prior_query is not None:
        expect(prior_query.shape == q.shape and jnp.issubdtype(prior_query.dtype, jnp.floating),
               "prior_query", (prior_query.shape, prior_query.dtype), f"{q.shape} floating")
    if prior_length is not None:
        expect(prior_query is not None, "prior_length", "given", "None without prior_query")
        expect(prior_length.shape == (batch,) and prior_length.dtype == jnp.int32,
               "prior_length", (prior_length.shape, prior_length.dtype), f"[{batch}] int32")
    if logits is not None:
        _check_logits(logits, batch, num_heads, page_table.shape[1] * page_size, prior_query,
                      dense_heads, expect)
    return mode


def _check_logits(logits, batch, num_heads, span, prior_query, dense_heads, expect):
    expect(isinstance(logits, LogitRows), "logits", type(logits).__name__,
           "a LogitRows or None")
    expect(prior_query is None, "prior_query", "given",
           "None with logits (the prior's queries have no logits)")
    expect(dense_heads is None, "dense_heads", "given",
           "None with logits (the scores pass's logits serve selected positions)")
    rel, peak = logits.relative, logits.block_max
    expect(rel.ndim == 4 and rel.shape[0] == batch and rel.shape[1] * rel.shape[2] == num_heads
           and rel.shape[3] == span and rel.dtype in (jnp.float16, jnp.float32),
           "logits.relative", (rel.shape, rel.dtype),
           f"[{batch}, groups, G, {span}] float16/float32 with groups * G = q_heads "
           f"{num_heads}: one row per query head over the page table's positions")
    blocks = common.cdiv(span, logits.block_n)
    expect(peak.shape == (*rel.shape[:3], blocks) and peak.dtype == jnp.float32,
           "logits.block_max", (peak.shape, peak.dtype),
           f"{(*rel.shape[:3], blocks)} float32 (block_n={logits.block_n})")


def _check_tuning(block_n, split_tokens, num_warps, num_stages, lookahead) -> None:
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n={block_n}: expected a power of 2 >= 16")
    if split_tokens < block_n or split_tokens % block_n:
        raise ValueError(f"split_tokens={split_tokens}: expected a positive multiple of "
                         f"{block_n=}")
    for name, value in (("num_warps", num_warps), ("num_stages", num_stages)):
        if value < 1:
            raise ValueError(f"{name}={value}: expected a positive int")
    if lookahead not in (0, 1, 2) or isinstance(lookahead, bool):
        raise ValueError(f"lookahead={lookahead!r}: expected 0, 1 or 2")


def sparse_decode_attention(q, k_pages, v_pages, page_table, lengths, indices, count, *, unit,
                            head_map=None, dense_heads=None, prior_query=None,
                            prior_length=None, logits=None, k_scale=None, v_scale=None,
                            sm_scale=None, backend="auto",
                            interpret=None, block_n=None, split_tokens=None, num_warps=None,
                            num_stages=None, lookahead=None) -> SparseAttention:
    """Decode attention of each query head over its selected positions of a paged cache.

    q            [B, HQ, D]                  bf16 / f16 / f32; HQ = HK * group (group 1..16)
    k_pages      [num_pages, HK, P, D]       token t of row b at [page_table[b, t // P], :, t % P]
    v_pages      [num_pages, HK, P, D]
    page_table   [B, max_pages] int32
    lengths      [B] int32                   >= 1, the current token already written
    indices      [B, G, K] int32             G in {1, HK, HQ}; sorted, unique up to count
    count        [B, G] int32                valid entries per group
    unit         static int                  tokens per index: 1, P or a multiple of P
    head_map     [HK] int32 | None           G = HK only: KV head h reads group head_map[h]
    dense_heads  [HK] bool | None            KV heads that attend to all of [0, length)
    prior_query  [B, HQ, D] | None           RESA mu_Q, used at q's dtype
    prior_length [B] int32 | None            prior positions j < prior_length (default lengths;
                                             None or the lengths array itself: no prior mask)
    logits       LogitRows | None            the layer's own scaled logits q.k * sm_scale,
                                             one row per query head ([B, groups, G,
                                             max_pages * P] with groups * G = HQ, as
                                             `paged_decode_attention(pool_scores=False)`
                                             returns for group_sum and head_probs): read at
                                             the selected positions instead of K (the kernel
                                             then reads no K and sm_scale is unused); not
                                             with prior_query or dense_heads
    k_scale      [num_pages, HK, P] f32 | None   an fp8 cache (k/v_pages float8_e4m3fn): one
    v_scale      [num_pages, HK, P] f32 | None   scale per (page, KV head, slot); the dots
                                             take the gathered fp8 rows in q's dtype (exact)
                                             and each row's K scale multiplies its logits
                                             in f32, its V scale biases them for the values
                                             (`common.online_softmax_step`); the reference
                                             dequantizes the pages it gathers

    Returns SparseAttention(out [B, HQ, D] q.dtype, lse [B, HQ] f32, prior) where prior =
    (prior_lse [B, HQ], prior_out [B, HQ, D]) f32: the softmax of mu_Q . k_j * sm_scale over
    the attended positions j < prior_length and its weighted sum of v_j (for dense heads
    that is every j < min(length, prior_length)). An empty set gives out 0 and lse -inf.
    block_n, split_tokens (>= the longest stream: one split, written directly with no merge),
    num_warps, num_stages, lookahead (0, 1 or 2: how many steps ahead of the K/V gathers the
    index and page-table lookups run): static knobs of the Pallas path; None picks
    `default_tuning`.
    """
    mode = _check_inputs(q, k_pages, v_pages, page_table, lengths, indices, count, unit,
                         head_map, dense_heads, prior_query, prior_length, logits, k_scale,
                         v_scale)
    sm_scale = float(1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale)
    if prior_length is lengths:
        # The default bound: every attended position is already < length, so the kernel
        # needs no prior mask (its loop is then the loop without the prior).
        prior_length = None
    unsupported = common.pallas_support(q, k_pages)
    if common.choose_backend(backend, unsupported) == "reference":
        return sparse_decode_attention_reference(
            q, k_pages, v_pages, page_table, lengths, indices, count, unit=unit,
            head_map=head_map, dense_heads=dense_heads, prior_query=prior_query,
            prior_length=prior_length, logits=logits, k_scale=k_scale, v_scale=v_scale,
            sm_scale=sm_scale)

    row_groups = q.shape[0] * (q.shape[1] if mode == "q" else k_pages.shape[1])
    dense_tokens = 0 if dense_heads is None else page_table.shape[1] * k_pages.shape[2]
    tuning = default_tuning(q.shape[-1], row_groups, indices.shape[2] * unit, dense_tokens,
                            block_n=block_n, given_logits=logits is not None,
                            itemsize=jnp.dtype(q.dtype).itemsize,
                            fp8_cache=k_scale is not None)
    tuning = common.resolve_tuning(tuning, block_n=block_n, split_tokens=split_tokens,
                                   num_warps=num_warps, num_stages=num_stages,
                                   lookahead=lookahead)
    _check_tuning(**tuning)
    if head_map is not None:
        head_map = head_map.astype(jnp.int32)
    relative = block_max = logits_block_n = None
    if logits is not None:  # one row per query head: [B, HQ, T], [B, HQ, blocks]
        relative, block_max = (x.reshape(x.shape[0], -1, x.shape[-1])
                               for x in (logits.relative, logits.block_max))
        logits_block_n = logits.block_n
    return _sparse_decode_pallas(
        q, k_pages, v_pages, page_table, lengths, indices, count, head_map, dense_heads,
        prior_query, prior_length, k_scale, v_scale, relative, block_max, mode=mode, unit=unit,
        sm_scale=sm_scale, logits_block_n=logits_block_n,
        interpret=common.resolve_interpret(interpret), **tuning)


@functools.partial(jax.jit, static_argnames=("unit", "sm_scale"))
def sparse_decode_attention_reference(q, k_pages, v_pages, page_table, lengths, indices, count,
                                      *, unit, head_map=None, dense_heads=None,
                                      prior_query=None, prior_length=None, logits=None,
                                      k_scale=None, v_scale=None,
                                      sm_scale=None) -> SparseAttention:
    """Plain-jnp twin of `sparse_decode_attention` (fp32): attended-position mask, masked softmax.
    Given `logits` replace q.k * sm_scale. An fp8 cache is dequantized as gathered.

    Pages are visited in chunks sized so that no intermediate exceeds [B, HQ, max_pages*P]
    floats (per stacked query set: q, and mu_Q when prior_query is given).
    """
    common.check_kv_scales(k_pages, v_pages, k_scale, v_scale)
    batch, num_heads, head_dim = q.shape
    _, kv_heads, page_size, _ = k_pages.shape
    max_pages = page_table.shape[1]
    group_size = num_heads // kv_heads
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    pages_per_chunk = max(1, min(max_pages, max_pages * num_heads // (kv_heads * head_dim)))
    num_chunks = common.cdiv(max_pages, pages_per_chunk)
    span = num_chunks * pages_per_chunk * page_size  # padded sequence length
    pos = jnp.arange(span)

    mask = attended_mask(indices, count, jnp.minimum(lengths, max_pages * page_size),
                         num_positions=span, num_heads=num_heads, num_kv_heads=kv_heads,
                         unit=unit, head_map=head_map, dense_heads=dense_heads)  # [B, HQ, span]

    queries = [q]
    masks = [mask]
    if prior_query is not None:
        prior_length = lengths if prior_length is None else prior_length
        queries.append(prior_query.astype(q.dtype))
        masks.append(mask & (pos < prior_length[:, None, None]))
    qs = jnp.stack(queries, 1).astype(jnp.float32).reshape(batch, len(queries), kv_heads,
                                                            group_size, head_dim)
    mask = jnp.stack(masks, 1)  # [B, S, HQ, span]

    table = jnp.pad(page_table, ((0, 0), (0, span // page_size - max_pages)))
    table = table.reshape(batch, num_chunks, pages_per_chunk).transpose(1, 0, 2)
    hi = lax.Precision.HIGHEST

    def chunk_logits(pages):  # [B, c] page ids -> [B, S, HK, group, c, P] logits
        k = common.gather_pages(k_pages, k_scale, pages).astype(jnp.float32)  # [B, c, HK, P, D]
        return jnp.einsum("bshgd,bchpd->bshgcp", qs, k, precision=hi)

    if logits is None:
        logits = lax.map(chunk_logits, table)  # [chunks, B, S, HK, group, c, P]
        logits = logits.transpose(1, 2, 3, 4, 0, 5, 6).reshape(mask.shape) * sm_scale
    else:  # [B, groups, G, T] -> [B, 1, HQ, span]
        logits = logits.logits().reshape(batch, 1, num_heads, -1)
        logits = jnp.pad(logits, ((0, 0), (0, 0), (0, 0), (0, span - logits.shape[-1])))
    logits = jnp.where(mask, logits, -jnp.inf)
    peak = jnp.max(logits, axis=-1, keepdims=True)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    weights = jnp.exp(logits - peak)
    total = jnp.sum(weights, axis=-1)
    lse = jnp.where(total > 0, peak[..., 0] + jnp.log(jnp.where(total > 0, total, 1.0)),
                    -jnp.inf)
    weights = weights / jnp.where(total > 0, total, 1.0)[..., None]
    weights = weights.reshape(batch, len(queries), kv_heads, group_size, num_chunks,
                              pages_per_chunk, page_size).transpose(4, 0, 1, 2, 3, 5, 6)

    def chunk_values(acc, xs):
        pages, w = xs
        v = common.gather_pages(v_pages, v_scale, pages).astype(jnp.float32)  # [B, c, HK, P, D]
        return acc + jnp.einsum("bshgcp,bchpd->bshgd", w, v, precision=hi), None

    out = jnp.zeros((batch, len(queries), kv_heads, group_size, head_dim), jnp.float32)
    out, _ = lax.scan(chunk_values, out, (table, weights))
    out = out.reshape(batch, len(queries), num_heads, head_dim)
    prior = (lse[:, 1], out[:, 1]) if prior_query is not None else None
    return SparseAttention(out[:, 0].astype(q.dtype), lse[:, 0], prior)


def attended_mask(indices, count, lengths, *, num_positions: int, num_heads: int,
                  num_kv_heads: int, unit: int, head_map=None, dense_heads=None) -> jax.Array:
    """Which logical positions each query head attends to -> [B, HQ, num_positions] bool.

    The selection semantics of `sparse_decode_attention` as a mask: units of `unit` tokens,
    G = 1 / HK / HQ groups, the head map, dense heads, entries past `count` and positions
    >= length skipped. Shared by the reference and the recall diagnostics.
    """
    batch, groups = indices.shape[:2]
    group_size = num_heads // num_kv_heads
    num_units = common.cdiv(num_positions, unit)
    entry_live = jnp.arange(indices.shape[2]) < count[..., None]
    slot = jnp.where(entry_live & (indices >= 0) & (indices < num_units), indices, num_units)
    cover = jnp.zeros((batch, groups, num_units + 1), jnp.bool_)
    cover = cover.at[jnp.arange(batch)[:, None, None], jnp.arange(groups)[None, :, None],
                     slot].set(True)
    cover = jnp.repeat(cover[..., :num_units], unit, axis=-1)[..., :num_positions]
    mask = cover[:, common.group_of_head(groups, num_heads, num_kv_heads, head_map), :]
    if dense_heads is not None:
        mask = mask | jnp.asarray(dense_heads)[jnp.arange(num_heads) // group_size][None, :, None]
    return mask & (jnp.arange(num_positions) < lengths[:, None, None])
