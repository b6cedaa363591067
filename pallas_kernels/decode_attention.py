"""Paged dense decode attention: one query token per row over a paged KV cache.

Returns the attention output, its natural-log LSE and, on request, the per-token scores that
the selection methods pool (DELTA `max_heads`, Kascade `group_sum`, LycheeDecode `mean_query`,
per-query-head `head_probs` for oracle top-k and TidalDecode).

Kernel: flash-decoding split-K on Pallas-Triton. Grid (batch, kv_head, split); each program
loads its GQA query group padded to 16 rows (the smallest M of a Triton dot), walks its share
of the row's key blocks through the page table with masked gathers straight from the cache
(no K/V copy or transpose), keeps an fp32 online softmax in base 2 and writes one (out, lse)
partial; `common.merge_splits` combines the splits. For scores the kernel also writes the scaled
logits (per query head, or already averaged over the group for `mean_query`) and a small jnp
epilogue turns logits + final LSE into the requested pooling, so K is read once. The logits
are written relative to a running max (s - m, with m per key block: each query head's own, or
for mean_query the mean of its group's), in `logits_dtype`: float16 for 16-bit inputs halves
the bytes of that round trip, and its rounding (at most 2^-11 |s - m| <= 2^-11 |ln p| in the
log of a probability p) stays below what the 16-bit K and q already carry. With
`values=False` the kernel is the scores pass alone (Kascade's anchor layers, as in its §3.6):
no V is read and no output computed, about half the bytes of the dense pass.

One file, as every kernel family: the kernel, its wrapper, the public function and its
reference twin side by side.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from sparsejax.pallas_kernels import common
from sparsejax.pallas_kernels.common import Score, pl, plgpu

SCORES = (Score.MAX_HEADS, Score.GROUP_SUM, Score.MEAN_QUERY, Score.HEAD_PROBS)  # the kernel's
UNPOOLED_SCORES = (Score.GROUP_SUM, Score.MEAN_QUERY, Score.HEAD_PROBS)  # as LogitRows too
BLOCK_G = 16  # query rows per program: the GQA group padded to the smallest Triton dot M
# Splits for a concrete kv_heads mask, sized for the heads it keeps, stop here: the skipped
# heads' partials are written and merged too, and past this the merge costs short contexts
# more than the extra splits save (docs/tuning.md).
MAX_MASKED_SPLITS = 128


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
    The pooling lives here once: `scores()` on arrays, `load_tile` on a top-k kernel's tiles.
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

    def load_tile(self, rows, row_ok, start, width: int, stride: int, present):
        """Inside a kernel (the fields are refs; the top-k's): the scores of rows [BR] x
        columns (start + [0, width)) * stride, masked by `present` [BR, W]; start is a
        multiple of width."""
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


class DecodeAttention(NamedTuple):
    out: jax.Array | None  # [B, HQ, D] in q's dtype; None for the scores pass alone
    lse: jax.Array  # [B, HQ] float32, natural log
    scores: jax.Array | LogitRows | None  # see `paged_decode_attention`


def _decode_kernel(
    q_ref,  # [B, HQ, D]
    k_ref,  # [num_pages * HK * P, D]: the cache viewed as one row per (page, head, slot)
    v_ref,  # [num_pages * HK * P, D]; an fp8 cache's as [.., D / 2] uint16 (`value_pairs`)
    page_table_ref,  # [B, max_pages] int32
    lengths_ref,  # [B] int32
    active_ref,  # [HK] int32: 0 for a KV head whose group is skipped
    *refs,  # fp8 cache: k_scale_ref, v_scale_ref [num_pages * HK * P] f32 (a scale per row);
            # then out_ref [B, num_splits, HQ, D] float32 (normalised partial output per split;
            #   absent without values), lse_ref [B, num_splits, HQ] float32 (partial LSE, -inf
            #   for an empty split), then with a score the logits s - m [B, R, T] in
            #   logits_dtype and m [B, R, num_blocks] float32 per key block: R = HQ, m each
            #   head's running max after the block; R = HK for mean_query, m the mean of its
            #   group's running maxes (>= the mean logit)
    sm_scale: float,
    group: int,
    kv_heads: int,
    page_size: int,
    block_n: int,
    num_splits: int,
    max_tokens: int,
    score: Score | None,
    values: bool,
    quantized: bool,
):
    k_scale_ref, v_scale_ref, *refs = refs if quantized else (None, None, *refs)
    out_ref, lse_ref, *logits_refs = refs if values else (None, *refs)
    b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    head_dim = q_ref.shape[-1]
    row_valid = jnp.arange(BLOCK_G) < group
    q = plgpu.load(q_ref.at[b, pl.ds(h * group, BLOCK_G), :], mask=row_valid[:, None], other=0)
    # Higher-precision f32 dots (IEEE instead of TF32); bf16/f16 dots are unaffected.
    dot = functools.partial(lax.dot_general, preferred_element_type=jnp.float32,
                            precision=lax.Precision.HIGHEST)

    # Splits share the row's actual key blocks, so short rows keep every split busy. A
    # skipped KV head visits no block: its partials stay empty (out 0, lse -inf).
    length = jnp.minimum(lengths_ref[b], max_tokens)
    num_blocks = pl.cdiv(length, block_n)
    per_split = pl.cdiv(num_blocks, num_splits)
    first = split * per_split
    last = jnp.where(active_ref[h] != 0, jnp.minimum(first + per_split, num_blocks), first)
    cols = jnp.arange(head_dim)
    log2_scale = sm_scale * common.LOG2E
    page_shift = page_size.bit_length() - 1  # page_size is a power of 2

    def block_tokens(j):
        tok = j * block_n + jnp.arange(block_n)
        return tok, tok < length

    def block_page_ids(j):
        # Masked: page-table entries past the length may be garbage and are never read.
        tok, valid = block_tokens(j)
        return plgpu.load(page_table_ref.at[b, tok >> page_shift], mask=valid, other=0)

    def store_logits(j, valid, s, score_max):  # block j's logits relative to score_max
        # s and score_max are base 2 (the online softmax's); the rows store natural logits.
        tokens = pl.ds(j * block_n, block_n)
        logits_ref, block_max_ref = logits_refs
        if score == Score.MEAN_QUERY:  # relative to the mean of the rows' running maxes
            mean = jnp.sum(jnp.where(row_valid[:, None], s, 0.0), axis=0) / group
            mean_max = jnp.sum(jnp.where(row_valid, score_max, 0.0)) / group
            plgpu.store(logits_ref.at[b, h, tokens],
                        ((mean - mean_max) * common.LN2).astype(logits_ref.dtype), mask=valid)
            plgpu.store(block_max_ref.at[b, h, j], mean_max * common.LN2)
        else:
            rows = pl.ds(h * group, BLOCK_G)
            plgpu.store(logits_ref.at[b, rows, tokens],
                        ((s - score_max[:, None]) * common.LN2).astype(logits_ref.dtype),
                        mask=row_valid[:, None] & valid[None, :])
            plgpu.store(block_max_ref.at[b, rows, j], score_max * common.LN2, mask=row_valid)

    def body(j, carry):
        acc, m, l, score_max, page_ids = carry
        # Fetch the next block's page ids now, so the page-table read is off the K/V path.
        next_page_ids = block_page_ids(j + 1)
        tok, valid = block_tokens(j)
        slot = common.cache_row(page_ids, h, tok, kv_heads=kv_heads, page_size=page_size)
        # Masked gathers: nothing past the length is read (unwritten slots of the last page).
        k_scale = v_scale = None
        if quantized:  # fp8 rows as q's dtype for the dots; their scales fold in after
            k, k_scale = common.load_fp8(k_ref, k_scale_ref, slot, cols[None, :], valid,
                                         q.dtype)
            if values:
                v, v_scale = common.load_fp8_pairs(v_ref, v_scale_ref, slot, valid, q.dtype)
        else:
            kv_index = (slot[:, None], cols[None, :])
            k = plgpu.load(k_ref.at[kv_index], mask=valid[:, None], other=0)  # [block_n, D]
            if values:
                v = plgpu.load(v_ref.at[kv_index], mask=valid[:, None], other=0)
        # Base-2 logits [BLOCK_G, block_n]: the softmax's exps are then one MUFU op each
        # (a natural exp is a ~7-instruction sequence); an fp8 row's scale joins the factor.
        s = dot(q, k, (((1,), (1,)), ((), ())))
        s = (s * log2_scale if k_scale is None
             else common.fold_scales(s, k_scale * log2_scale, axis=1))
        s = jnp.where(valid[None, :], s, -jnp.inf)
        # Every visited block holds a valid token, so the maxes are finite.
        acc, m_new, l = common.online_softmax_step(
            s, v if values else None, v_scale, acc, m, l,
            lambda a, b: dot(a, b, (((1,), (0,)), ((), ()))), base2=True, empty_rows=False)
        if score is not None:
            # With fp8 values the softmax's max is of logits biased by V's scales; the scores
            # keep their own.
            if score_max is not None:
                score_max = jnp.maximum(score_max, jnp.max(s, axis=1))
            store_logits(j, valid, s, m_new if score_max is None else score_max)
        return acc, m_new, l, score_max, next_page_ids

    acc = common.zero_values(BLOCK_G, head_dim, pairs=quantized) if values else None
    m = jnp.full((BLOCK_G,), -jnp.inf, jnp.float32)
    l = jnp.zeros((BLOCK_G,), jnp.float32)
    score_max = m if score is not None and quantized and values else None
    acc, m, l, _, _ = lax.fori_loop(first, last, body,
                                    (acc, m, l, score_max, block_page_ids(first)))

    out, lse = common.softmax_result(acc, m, l)
    if values and quantized:
        # Masked rows get distinct out-of-range rows: never written, never aliasing a real one.
        row_ids = jnp.where(row_valid, h * group, out_ref.shape[2]) + jnp.arange(BLOCK_G)
        for part, part_cols in common.column_parts(out):
            plgpu.store(out_ref.at[b, split, row_ids[:, None], part_cols], part,
                        mask=jnp.broadcast_to(row_valid[:, None], part.shape))
    elif values:
        plgpu.store(out_ref.at[b, split, pl.ds(h * group, BLOCK_G), :], out,
                    mask=row_valid[:, None])
    plgpu.store(lse_ref.at[b, split, pl.ds(h * group, BLOCK_G)], lse, mask=row_valid)


def _decode_pallas(q, k_pages, v_pages, page_table, lengths, active, k_scale, v_scale, *,
                   score, values, pool_scores, logits_dtype, out_dtype, sm_scale, interpret,
                   block_n, num_splits, num_warps, num_stages):
    batch, q_heads, head_dim = q.shape
    num_pages, kv_heads, page_size, _ = k_pages.shape
    max_pages = page_table.shape[1]
    max_tokens = max_pages * page_size
    group = q_heads // kv_heads
    # Free reshape of the contiguous cache: no copy, page ids stay as the caller wrote them.
    k_rows = k_pages.reshape(num_pages * kv_heads * page_size, head_dim)
    v_rows = v_pages.reshape(num_pages * kv_heads * page_size, head_dim)
    if k_scale is not None:
        v_rows = common.value_pairs(v_rows)

    out_shape = [jax.ShapeDtypeStruct((batch, num_splits, q_heads), jnp.float32)]
    if values:
        out_shape.insert(0, jax.ShapeDtypeStruct((batch, num_splits, q_heads, head_dim),
                                                 jnp.float32))
    if score is not None:
        rows = kv_heads if score == Score.MEAN_QUERY else q_heads
        out_shape += [jax.ShapeDtypeStruct((batch, rows, max_tokens), logits_dtype),
                      jax.ShapeDtypeStruct((batch, rows, common.cdiv(max_tokens, block_n)),
                                           jnp.float32)]
    kernel = functools.partial(
        _decode_kernel, sm_scale=sm_scale, group=group, kv_heads=kv_heads,
        page_size=page_size, block_n=block_n, num_splits=num_splits, max_tokens=max_tokens,
        score=score, values=values, quantized=k_scale is not None)
    scales = () if k_scale is None else (common.scale_rows(k_scale), common.scale_rows(v_scale))
    parts = common.pallas_call(
        kernel,
        grid=(batch, kv_heads, num_splits),
        out_shape=out_shape,
        compiler_params=common.triton_params(num_warps, num_stages),
        interpret=interpret,
        name=f"paged_decode_{'attention' if values else 'scores'}_{block_n=}_{num_splits=}",
    )(q, k_rows, v_rows, page_table, lengths,
      jnp.ones((kv_heads,), jnp.int32) if active is None else active.astype(jnp.int32),
      *scales)

    if values:
        out_part, lse_part, *logits = parts
        out, lse = common.merge_splits(out_part, lse_part, out_dtype=out_dtype,
                                       interpret=interpret)
    else:
        (lse_part, *logits), out = parts, None
        lse = common.merge_lse(lse_part, axis=1)
    scores = None
    if score is not None:
        relative, block_max = logits  # s = (s - m) + m
        scores = _logit_rows(score, relative, block_max, lse, kv_heads=kv_heads,
                             block_n=block_n)
        if pool_scores:
            scores = pool_logit_rows(score, scores, lengths, page_size=page_size,
                                     kv_heads=active)
    return DecodeAttention(out, lse, scores)


def _logit_rows(score, relative, block_max, lse, *, kv_heads: int, block_n: int) -> LogitRows:
    """The kernel's logits [B, R, T] (R = HQ, or HK for mean_query) and their block maxes as
    score rows [B, groups, G, T]: each KV head's query group (group_sum), each query head
    (head_probs; max_heads pools these), each KV head's mean-query logits (mean_query)."""
    if score == Score.GROUP_SUM:
        batch, q_heads = lse.shape
        def grouped(x):
            return x.reshape(batch, kv_heads, q_heads // kv_heads, *x.shape[2:])
        return LogitRows(grouped(relative), grouped(block_max), grouped(lse), block_n)
    return LogitRows(relative[:, :, None], block_max[:, :, None],
                     None if score == Score.MEAN_QUERY else lse[:, :, None], block_n)


def pool_logit_rows(score: Score, rows: LogitRows, lengths, *, page_size: int,
                    kv_heads=None):
    """The kernel's epilogue: unpooled rows (`pool_scores=False`) -> the pooled `score`, as
    `paged_decode_attention` returns it with pool_scores=True. `kv_heads` is the mask the
    rows were computed under. Positions at or past the length and the heads of skipped KV
    heads hold garbage in the rows: -inf here (for max_heads, pages past the length)."""
    scores = rows.scores()  # [B, groups, T]
    batch, groups, max_tokens = scores.shape
    lengths = jnp.minimum(lengths, max_tokens)
    valid = jnp.arange(max_tokens)[None, None, :] < lengths[:, None, None]  # [B, 1, T]
    if kv_heads is not None:  # per KV head; each query head of a group shares its head's
        valid = valid & jnp.repeat(kv_heads, groups // kv_heads.shape[0])[None, :, None]
    if score != Score.MAX_HEADS:
        return jnp.where(valid, scores, -jnp.inf)
    per_page = jnp.where(valid, scores, 0.0).max(axis=1).reshape(batch, -1, page_size).sum(-1)
    page_valid = jnp.arange(per_page.shape[1])[None, :] * page_size < lengths[:, None]
    return jnp.where(page_valid, per_page, -jnp.inf)


def default_tuning(batch: int, kv_heads: int, head_dim: int, page_size: int, max_pages: int,
                   dtype, scores: bool = False, values: bool = True, kv_dtype=None,
                   wide_offsets: bool = False, masked: bool = False) -> dict:
    """Static knobs chosen from the shapes; `common.num_sms()` SMs make a wave. The sweeps
    behind each rule are in docs/tuning.md.

    block_n: tokens per loop step, sized so a K tile is ~16 KiB (64 tokens at D=128 bf16):
      small enough that 2-stage K/V buffers leave room for several programs per SM, at least
      16 (the Triton dot N) and at most the next power of 2 of max_pages * P.
    num_splits: enough (batch, kv_head, split) programs for ~4 waves, at most one per key
      block of the cache (no floor of blocks per split: short caches want the splits too).
      Where the row groups alone fill the SMs (batch x kv_heads >= a wave), a power of 2:
      three splits ran slower than two or four. The scores pass alone keeps its doubled count.
    num_warps=4, num_stages=2; without scores and with 16-bit inputs, 2 warps once the row
      groups fill two waves (a little faster there; the scores kernel is slower at 2 warps,
      and float32's heavier dots keep 4).
    With scores and at least one program per SM before splitting, or with scores and values
      on a 16-bit pool past 4 GiB (`wide_offsets`, below) from a quarter of a wave of row
      groups: K tiles of 32 KiB (block_n 128 at D=128 bf16) and num_stages 3, half the loop
      steps that also store logits (H200, DELTA's max_heads pass in a 28- and 32-layer pool:
      DS-Qwen-1.5B heads B=64 x 16k 0.321 -> 0.293 ms, Llama-8B heads B=8 x 32k 0.339 ->
      0.301). Fewer row groups split into many short programs, one of which these tiles
      leave per SM: Llama-8B B=1 x 128k 0.153 -> 0.154, and Lychee's pass for one KV head of
      eight at B=8 x 32k about twice as slow (its step 8.88 -> 9.85 ms busy); they keep the
      knobs below, as does the scores pass alone (2% slower so).
    values=False (the scores pass alone, half the bytes per key block): twice the splits, so
      each program still streams about as many bytes; below a wave of row groups, with a
      16-bit cache, 2 warps (H200: Llama-8B heads B=8 x 32k 0.178 -> 0.144 ms, DS-Qwen-1.5B
      heads B=16 x 32k 0.096 -> 0.077 and B=64 x 16k 0.168 -> 0.144; from a wave the 4 warps
      of the 32 KiB-tile rule stay fastest).
    An fp8 cache (`kv_dtype`, the pages' dtype; None: q's), without scores: num_warps=2 and
      num_stages=3, the fastest or within 10% of it at every swept cell (H100, Llama-8B heads,
      B=1 and 64, 32k and 128k: 1.1-1.2x faster than the 16-bit rule;
      results/decode_knobs_h100.json). Once the row groups fill two waves, one warp and
      32-token blocks: a row's softmax max and sum then stay inside a warp, where with two
      warps each block synchronised them through shared memory, a cost the half-size fp8
      tiles no longer hid (H200, B=64, 8k-128k: 4-10% faster; fewer row groups were slower
      at one warp). Below a wave of row groups, at most 4 waves of programs: four of these
      programs are resident on an SM, and one split more started a second, partial round
      (H200, B=8 and 16, 32k and 128k: 1.3-1.5x faster).
    A 16-bit pool past 4 GiB (`wide_offsets`, `common.wide_offsets`: every layer of a long
      cache, which the decode step passes whole), below two waves of row groups: 32-token
      blocks, 2 warps and 3 stages. Pallas-Triton computes 64-bit offsets for each gathered
      element there, and at the rule above the kernel ran 1.25x slower than on a pool under
      4 GiB; these knobs give that time back (H200, DS-Qwen-1.5B heads, B=64 x 16k: 0.309 ->
      0.248 ms, the small pool's 0.249; Llama-8B heads, B=1 x 128k: 0.130 -> 0.129).
    masked (a concrete kv_heads mask; `kv_heads` counts the heads it keeps): at most
      MAX_MASKED_SPLITS splits. With scores and values on a 16-bit cache and at most a
      sixteenth of a wave of row groups (LycheeDecode's retrieval heads at a small batch),
      2 warps and 3 stages (H200, one KV head computed, mean_query scores, kernel and merge:
      DS-Qwen-1.5B heads B=1 x 32k 12.5 -> 10.5 us, x 128k 42.4 -> 27.8; Llama-8B heads B=1 x
      128k 48.1 -> 42.3, B=8 x 32k 56.1 -> 53.8; at 16 row groups, DS-Qwen-1.5B B=16 x 32k,
      75.1 -> 86.7, so not there).
    """
    max_tokens = max_pages * page_size
    block_n = min(128, 16384 // (head_dim * jnp.dtype(dtype).itemsize))
    block_n = max(16, min(block_n, common.next_power_of_2(max_tokens)))
    max_blocks = common.cdiv(max_tokens, block_n)
    num_stages = 2
    row_groups = batch * kv_heads
    wave = common.num_sms()
    sixteen_bit = jnp.dtype(dtype).itemsize == 2
    one_byte = kv_dtype is not None and jnp.dtype(kv_dtype).itemsize == 1
    cache_16_bit = sixteen_bit and not one_byte
    wide_16_bit = wide_offsets and cache_16_bit
    if scores and (row_groups >= wave or (wide_16_bit and values and 4 * row_groups >= wave)):
        block_n, num_stages = min(2 * block_n, common.next_power_of_2(max_tokens)), 3
        max_blocks = common.cdiv(max_tokens, block_n)
    num_splits = common.cdiv(4 * wave, row_groups)
    if row_groups >= wave and values:
        num_splits = 1 << (num_splits.bit_length() - 1)
    num_splits *= 1 if values else 2
    num_splits = max(1, min(num_splits, max_blocks))
    num_warps = 2 if not scores and sixteen_bit and row_groups >= 2 * wave else 4
    if not values and cache_16_bit and row_groups < wave:
        num_warps = 2
    if wide_16_bit and not scores and row_groups < 2 * wave:
        block_n, num_warps, num_stages = min(32, block_n), 2, 3
    if not scores and one_byte:
        num_warps, num_stages = 2, 3
        if row_groups >= 2 * wave:
            num_warps, block_n = 1, min(32, block_n)
        elif row_groups < wave:
            num_splits = max(1, min(4 * wave // row_groups, max_blocks))
    if masked:
        num_splits = min(num_splits, MAX_MASKED_SPLITS)
        if scores and values and cache_16_bit and 16 * row_groups <= wave:
            num_warps, num_stages = 2, 3
    return dict(block_n=block_n, num_splits=num_splits, num_warps=num_warps,
                num_stages=num_stages)


def _check_tuning(block_n, num_splits, num_warps, num_stages):
    common.check_power_of_2("block_n", block_n, 16, 512)
    common.check_power_of_2("num_warps", num_warps, 1, 16)
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits={num_splits!r}: expected an int >= 1")
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages={num_stages!r}: expected an int >= 1")


def as_score(score) -> Score | None:
    """`score` (a `Score` or its string, or None) as a Score; a ValueError unless the kernel
    computes it (SCORES)."""
    if score is None:
        return None
    if score not in SCORES:
        raise ValueError(f"score={score!r}: expected None or one of "
                         f"{tuple(str(s) for s in SCORES)}")
    return Score(score)


def _check_inputs(q, k_pages, v_pages, page_table, lengths, score, kv_heads, values=True,
                  pool_scores=True, k_scale=None, v_scale=None):
    """Structure every path needs; the kernel's own limits are `common.pallas_support`'s."""
    score = as_score(score)
    if not pool_scores and score not in UNPOOLED_SCORES:
        raise ValueError(f"pool_scores=False with score='{score}': only "
                         f"{tuple(str(s) for s in UNPOOLED_SCORES)} come back unpooled "
                         "(max_heads pools across every head's LSE)")
    if not values and score is None:
        raise ValueError("values=False computes only the scores: it needs a score, got "
                         "score=None")
    if q.ndim != 3:
        raise ValueError(f"q.shape={q.shape}: expected [batch, q_heads, head_dim]")
    common.check_paged_cache(q, k_pages, v_pages, page_table, k_scale, v_scale)
    batch = q.shape[0]
    num_kv_heads = k_pages.shape[1]
    if lengths.shape != (batch,) or lengths.dtype != jnp.int32:
        raise ValueError(f"lengths {lengths.dtype}{list(lengths.shape)}: expected int32[{batch}]")
    if kv_heads is not None and (kv_heads.shape != (num_kv_heads,) or not (
            kv_heads.dtype == jnp.bool_ or jnp.issubdtype(kv_heads.dtype, jnp.integer))):
        raise ValueError(f"kv_heads {kv_heads.dtype}{list(kv_heads.shape)}: expected a bool "
                         f"mask [{num_kv_heads}]")


def logits_dtype_for(q_dtype, logits_dtype=None) -> jnp.dtype:
    """The dtype the scores' logits are stored in: `logits_dtype` (float16 or float32), or by
    default float16 for 16-bit q and float32 for float32 q."""
    if logits_dtype is None:
        return jnp.dtype(jnp.float32 if q_dtype == jnp.float32 else jnp.float16)
    try:
        dtype = jnp.dtype(logits_dtype)
    except TypeError:  # not a dtype at all
        dtype = None
    if dtype not in (jnp.float16, jnp.float32):
        raise ValueError(f"logits_dtype={logits_dtype!r}: expected None, float16 or float32")
    return dtype


def paged_decode_attention(
    q: jax.Array,  # [B, HQ, D]
    k_pages: jax.Array,  # [num_pages, HK, P, D]
    v_pages: jax.Array,  # [num_pages, HK, P, D]
    page_table: jax.Array,  # [B, max_pages] int32
    lengths: jax.Array,  # [B] int32
    *,
    score: Score | str | None = None,
    values: bool = True,
    pool_scores: bool = True,
    kv_heads: jax.Array | None = None,  # [HK] bool
    k_scale: jax.Array | None = None,  # [num_pages, HK, P] f32 with an fp8 cache
    v_scale: jax.Array | None = None,
    sm_scale: float | None = None,
    logits_dtype=None,
    out_dtype=None,
    backend: str = "auto",
    interpret: bool | None = None,
    block_n: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> DecodeAttention:
    """Decode attention of one query token per row over a paged KV cache.

    Token t of row b is `k_pages[page_table[b, t // P], h, t % P]`; query head i reads KV
    head i // (HQ // HK). Page-table entries past a row's length are never read. Lengths
    are clipped to the page table's capacity max_pages * P; a row of length 0 gets out 0 and
    lse -inf (the convention of `common.merge_partials`).

    score (a `Score` or its string):
      None         -> scores is None.
      "max_heads"  -> [B, max_pages] f32: per token the max over all query heads of the
                      softmax probability, summed inside each page; -inf for pages past the
                      length (DELTA).
      "group_sum"  -> [B, HK, max_pages * P] f32: probabilities summed over each KV head's
                      query group; -inf at positions >= length (Kascade).
      "mean_query" -> [B, HK, max_pages * P] f32: logits of the group-mean query,
                      q̄·k·sm_scale; -inf at positions >= length (LycheeDecode).
      "head_probs" -> [B, HQ, max_pages * P] f32: each query head's softmax probabilities;
                      -inf at positions >= length (oracle top-k, TidalDecode).
    values: False runs the scores pass alone (needs a score): V is never read and out is
      None; lse and scores are those of the full pass.
    pool_scores: False (for group_sum, mean_query and head_probs) returns the scores unpooled,
      as `LogitRows` [B, groups, G, T] (groups = HK, HK, HQ): what the kernel wrote,
      which `topk_select` pools while it reads it, so the pooled [B, groups, T] float32
      never round-trips through memory. `LogitRows.scores()` is the pooled array. Positions
      >= length and skipped KV heads hold garbage there, not -inf: the consumer masks them
      (`topk_select` by its `valid`).
    k_scale, v_scale: an fp8 cache (k/v_pages float8_e4m3fn) gives one float32 scale per
      (page, KV head, slot), shaped k_pages.shape[:-1]: the kernel's dots take the fp8 tiles
      converted to q's dtype (exact); each token's K scale multiplies its logits in f32
      (`common.fold_scales`) and its V scale enters the softmax as a logit bias
      (`common.online_softmax_step`); otherwise the same. The reference dequantizes the
      pages it gathers (f32). None: k/v_pages in q's dtype.
    kv_heads: optional bool mask [HK]: only these KV heads (and their query groups) are
      computed; the others are skipped and get out 0, lse -inf and -inf scores ("max_heads"
      takes the max over the computed heads). None computes every head. A concrete mask
      (numpy, not traced) also sizes the default splits for the heads it keeps.
    logits_dtype: float16 | float32 | None: how the Pallas path stores the logits the scores
      are made of, relative to a running max m (each query head's; for mean_query the mean of
      the group's, which bounds the mean logit from above). float16 halves the bytes; a logit
      s then moves by up to 2^-11 |s - m|: a probability p by a relative 2^-11 |ln p| (below
      1% for p > e^-20 of its head's max), a mean_query logit by 2^-11 of its distance below
      the mean of the group's LSEs (`float16_logits_bound` gives it per score). None:
      float16 for 16-bit q, float32 (the logits as computed) for float32 q. The reference is
      exact either way.
    out_dtype: the dtype of out; None: q's. float32 keeps the merged output unrounded (RESA's
      prior attended over the cache, `resa.prior_from_cache`).
    backend: "auto" (Pallas on GPU, reference elsewhere) | "pallas" | "reference". The
      kernel takes what `common.pallas_support` allows (head_dim in HEAD_DIMS, page size in
      PAGE_SIZES, bf16/f16/f32, groups up to MAX_GROUP); other shapes run the reference
      under "auto" and raise under "pallas".
    interpret: Pallas interpret mode; None -> on unless a GPU is present.
    block_n, num_splits, num_warps, num_stages: static knobs of the Pallas path; None picks
      `default_tuning`.
    """
    _check_inputs(q, k_pages, v_pages, page_table, lengths, score, kv_heads, values,
                  pool_scores, k_scale, v_scale)
    score = as_score(score)
    logits_dtype = logits_dtype_for(q.dtype, logits_dtype)
    # Resolve "auto" here, outside jit, so that the jit cache is keyed on the backend used.
    unsupported = common.pallas_support(q, k_pages)
    # A mask known here (not traced) sizes the splits for the heads it keeps: one retrieval
    # head of eight at B=1 would otherwise run on an eighth of the programs.
    active = None
    if kv_heads is not None and not isinstance(kv_heads, jax.core.Tracer):
        active = max(1, int(np.count_nonzero(np.asarray(kv_heads))))
        kv_heads = jnp.asarray(kv_heads)
    return _paged_decode_attention(
        q, k_pages, v_pages, page_table, lengths, kv_heads, k_scale, v_scale, score=score,
        values=bool(values), pool_scores=bool(pool_scores), logits_dtype=logits_dtype,
        out_dtype=jnp.dtype(q.dtype if out_dtype is None else out_dtype),
        sm_scale=sm_scale, backend=common.choose_backend(backend, unsupported),
        interpret=interpret, active_kv_heads=active, block_n=block_n, num_splits=num_splits,
        num_warps=num_warps, num_stages=num_stages)


@functools.partial(jax.jit, static_argnames=(
    "score", "values", "pool_scores", "logits_dtype", "out_dtype", "sm_scale", "backend",
    "interpret", "active_kv_heads", "block_n", "num_splits", "num_warps", "num_stages"))
def _paged_decode_attention(q, k_pages, v_pages, page_table, lengths, kv_heads, k_scale,
                            v_scale, *, score, values, pool_scores, logits_dtype, out_dtype,
                            sm_scale, backend, interpret, active_kv_heads, block_n, num_splits,
                            num_warps, num_stages):
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else float(sm_scale)
    if kv_heads is not None:
        kv_heads = kv_heads.astype(bool)
    if backend == "reference":
        return paged_decode_attention_reference(q, k_pages, v_pages, page_table, lengths,
                                                score=score, values=values,
                                                pool_scores=pool_scores, kv_heads=kv_heads,
                                                k_scale=k_scale, v_scale=v_scale,
                                                sm_scale=sm_scale, out_dtype=out_dtype)
    tuning = default_tuning(q.shape[0], active_kv_heads or k_pages.shape[1], q.shape[2],
                            k_pages.shape[2], page_table.shape[1], q.dtype,
                            scores=score is not None, values=values, kv_dtype=k_pages.dtype,
                            wide_offsets=common.wide_offsets(k_pages),
                            masked=bool(active_kv_heads))
    tuning = common.resolve_tuning(tuning, block_n=block_n, num_splits=num_splits,
                                   num_warps=num_warps, num_stages=num_stages)
    _check_tuning(**tuning)
    return _decode_pallas(q, k_pages, v_pages, page_table, lengths, kv_heads, k_scale,
                          v_scale, score=score,
                          values=values, pool_scores=pool_scores, logits_dtype=logits_dtype,
                          out_dtype=out_dtype, sm_scale=sm_scale,
                          interpret=common.resolve_interpret(interpret), **tuning)


@functools.partial(jax.jit, static_argnames=("score", "values", "pool_scores", "sm_scale",
                                             "out_dtype"))
def paged_decode_attention_reference(q, k_pages, v_pages, page_table, lengths, *,
                                     score: Score | None = None, values: bool = True,
                                     pool_scores: bool = True,
                                     kv_heads: jax.Array | None = None,
                                     k_scale: jax.Array | None = None,
                                     v_scale: jax.Array | None = None,
                                     sm_scale: float | None = None,
                                     out_dtype=None) -> DecodeAttention:
    """Plain-jnp twin of `paged_decode_attention`: gathers the pages, fp32 math throughout
    (an fp8 cache dequantized as gathered). Unpooled scores are the exact logits as one key block
    (block_n = T)."""
    _check_inputs(q, k_pages, v_pages, page_table, lengths, score, kv_heads, values,
                  pool_scores, k_scale, v_scale)
    batch, q_heads, head_dim = q.shape
    _, num_kv_heads, page_size, _ = k_pages.shape
    max_tokens = page_table.shape[1] * page_size
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale

    def gather(pages, scale):  # -> [B, HK, T, D] f32 (an fp8 cache dequantized)
        x = common.gather_pages(pages, scale, page_table)  # [B, max_pages, HK, P, D]
        x = x.transpose(0, 2, 1, 3, 4).reshape(batch, num_kv_heads, max_tokens, head_dim)
        return x.astype(jnp.float32)

    valid = jnp.arange(max_tokens)[None, :] < lengths[:, None]  # [B, T]
    active = jnp.ones((num_kv_heads,), bool) if kv_heads is None else kv_heads.astype(bool)
    qg = q.astype(jnp.float32).reshape(batch, num_kv_heads, -1, head_dim)
    k = gather(k_pages, k_scale)
    v = jnp.where(valid[:, None, :, None], gather(v_pages, v_scale), 0.0)
    hp = lax.Precision.HIGHEST
    logits = jnp.einsum("bhgd,bhtd->bhgt", qg, k, precision=hp) * sm_scale
    logits = jnp.where(valid[:, None, None, :], logits, -jnp.inf)
    lse = jax.nn.logsumexp(logits, axis=-1)  # [B, HK, G]; -inf for an empty row
    prob = jnp.where(valid[:, None, None, :], jnp.exp(logits - lse[..., None]), 0.0)
    out = jnp.einsum("bhgt,bhtd->bhgd", prob, v, precision=hp)
    out = jnp.where(active[None, :, None, None], out, 0.0)
    out = out.reshape(batch, q_heads, head_dim).astype(q.dtype if out_dtype is None
                                                       else out_dtype)
    lse = jnp.where(active[None, :, None], lse, -jnp.inf).reshape(batch, q_heads)
    prob = jnp.where(active[None, :, None, None], prob, 0.0)
    kv_valid = valid[:, None, :] & active[None, :, None]  # [B, HK, T]

    scores = None
    if score == Score.MEAN_QUERY:  # [B, HK, T]: logits of the group-mean query
        scores = jnp.einsum("bhd,bhtd->bht", qg.mean(axis=2), k, precision=hp) * sm_scale
    if not pool_scores:  # one key block: the row's max, the logits relative to it
        logits = (logits if score == Score.GROUP_SUM else scores[:, :, None]
                  if score == Score.MEAN_QUERY
                  else logits.reshape(batch, q_heads, 1, max_tokens))
        row_max = jnp.max(logits, axis=-1, keepdims=True)
        row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
        row_lse = None if score == Score.MEAN_QUERY else lse.reshape(logits.shape[:-1])
        scores = LogitRows(logits - row_max, row_max, row_lse, max_tokens)
    elif score == Score.MAX_HEADS:
        per_token = prob.max(axis=(1, 2)).reshape(batch, -1, page_size).sum(axis=-1)
        page_valid = valid.reshape(batch, -1, page_size)[..., 0]
        scores = jnp.where(page_valid, per_token, -jnp.inf)
    elif score == Score.GROUP_SUM:
        scores = jnp.where(kv_valid, prob.sum(axis=2), -jnp.inf)
    elif score == Score.MEAN_QUERY:
        scores = jnp.where(kv_valid, scores, -jnp.inf)
    elif score == Score.HEAD_PROBS:
        scores = jnp.where(kv_valid[:, :, None, :], prob, -jnp.inf)
        scores = scores.reshape(batch, q_heads, max_tokens)
    return DecodeAttention(out if values else None, lse, scores)


@functools.partial(jax.jit, static_argnames=("score", "sm_scale"))
def float16_logits_bound(q, k_pages, v_pages, page_table, lengths, *, score: Score,
                         kv_heads: jax.Array | None = None,
                         k_scale: jax.Array | None = None, v_scale: jax.Array | None = None,
                         sm_scale: float | None = None) -> jax.Array:
    """Per element of `score`'s scores, the most float16 logits (`logits_dtype`) may move it
    from the reference, on top of float32 rounding. A head's s - m rounds to within 2^-11
    |s - m| <= 2^-11 |ln p| (the running max m lies between s and the LSE), so a probability p
    moves by at most p * expm1(2^-11 |ln p|): group_sum adds its group's, max_heads takes the
    largest per token and adds a page's. A mean_query logit is stored relative to the mean of
    its group's running maxes, which is at most the mean of their LSEs."""
    args = (q, k_pages, v_pages, page_table, lengths)
    batch, q_heads, _ = q.shape
    _, num_kv_heads, page_size, _ = k_pages.shape
    if score == Score.MEAN_QUERY:
        ref = paged_decode_attention_reference(*args, score=score, kv_heads=kv_heads,
                                               k_scale=k_scale, v_scale=v_scale,
                                               sm_scale=sm_scale)
        lse = ref.lse.reshape(batch, num_kv_heads, -1).mean(axis=-1)
        return jnp.where(jnp.isfinite(ref.scores), 2.0**-11 * (lse[..., None] - ref.scores), 0.0)
    probs = paged_decode_attention_reference(*args, score=Score.HEAD_PROBS, kv_heads=kv_heads,
                                             k_scale=k_scale, v_scale=v_scale,
                                             sm_scale=sm_scale).scores
    positive = probs > 0
    probs = jnp.where(positive, probs, 1.0)
    err = jnp.where(positive, probs * jnp.expm1(-2.0**-11 * jnp.log(probs)), 0.0)  # [B, HQ, T]
    if score == Score.GROUP_SUM:
        return err.reshape(batch, num_kv_heads, q_heads // num_kv_heads, -1).sum(axis=2)
    if score == Score.MAX_HEADS:
        return err.max(axis=1).reshape(batch, -1, page_size).sum(axis=-1)
    return err
