"""Paged prefill attention: C query tokens per row attend causally over a paged KV cache.

Query token i of row b sits at position start[b] + i and attends to every cached position
<= its own (its K/V, and those of the chunk's earlier tokens, are already in the cache). The
one multi-token building block: chunked prefill, cache correction (re-running generated
tokens densely) and the verify step of speculative decoding are all calls of it.

Sparse variant (Kascade's rolling top-k prefill): the chunk's queries form tiles of `tile`
tokens; tile t of row b attends to the keys `indices[b, t, h]` (positions before the tile,
per KV head h) plus its own causal block, positions start + t * tile up to the query's own.

`paged_tile_scores` gives the selection's scores: per tile and KV head, the dense
post-softmax probabilities of the keys before the tile, summed over the tile's queries and
the GQA group (Kascade's pooling), from each query's LSE of a dense pass.

Dense calls of at least CUDNN_MIN_CHUNK bf16/f16 queries on a GPU run on cuDNN's flash
attention instead (`backend="auto"`, or `"cudnn"`): the chunk's own keys and the cache before
it are gathered into contiguous [B, T, HK, D] arrays and attended separately (causal over
the chunk, and over the positions before it: cuDNN's causal mask is top-left aligned),
merged by their LSEs (`_prefill_split`; chunked prefill's calls avoid cuDNN's slower
length-masked kernel). cuDNN's warp-specialised kernel outruns this Pallas-Triton one by far
more than the gathers and the merge cost on long chunks; shorter chunks (verification,
correction) stay on Pallas, where the gathers would outweigh the attention (docs/tuning.md).

Kernel: flash attention on Pallas-Triton. Grid (batch, kv_head, query block x split); each
program stacks `block_q` query tokens x the GQA group (padded to a power of 2) as the rows of
one dot, walks its share of the query block's key stream with masked gathers straight from
the cache viewed as [num_pages * HK * P, D] rows (as the decode kernel), keeps an fp32 online
softmax and writes one (out, lse) partial; `common.merge_partials` combines the splits. The
key stream is the selected positions (sparse) followed by the key blocks from the tile's
first position (sparse) or 0 (dense) up to the block's last query.

One file, as every kernel family: the kernel, its wrapper, the public function and its
reference twin side by side.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from sparsejax.pallas_kernels import common
from sparsejax.pallas_kernels.common import pl, plgpu

MIN_ROWS = 16  # the smallest Triton dot M: block_q x padded group is at least this
CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
# Dense chunks of at least this many queries take cuDNN under backend="auto" on a GPU: from
# here cuDNN's attention outweighs its gathers and merge (docs/tuning.md).
CUDNN_MIN_CHUNK = 512


class PrefillAttention(NamedTuple):
    out: jax.Array  # [B, C, HQ, D] in q's dtype; 0 for queries past the row's length
    lse: jax.Array  # [B, C, HQ] float32, natural log; -inf for queries past the length


class _Static(NamedTuple):
    """Static shapes and knobs both kernels are specialised on."""
    sm_scale: float
    chunk: int
    group: int
    group_pad: int  # the GQA group padded to a power of 2
    kv_heads: int
    page_size: int
    block_q: int
    block_n: int
    tile: int
    num_splits: int
    lookahead: int  # 1: a block's page (and index) lookups run one loop step before its loads
    precision: object  # of the dots: `common.dot_precision`


def _static(q, k_pages, tile, sm_scale, block_q, block_n, num_splits, lookahead,
            interpret) -> _Static:
    _, chunk, q_heads, _ = q.shape
    _, kv_heads, page_size, _ = k_pages.shape
    group = q_heads // kv_heads
    return _Static(sm_scale, chunk, group, common.next_power_of_2(group), kv_heads, page_size,
                   block_q, block_n, tile, num_splits, lookahead,
                   common.dot_precision(q.dtype, interpret))


class _Program(NamedTuple):
    """What a program of either kernel knows about its rows (traced values)."""
    b: jax.Array  # batch row
    h: jax.Array  # KV head
    split: jax.Array  # key split
    first: jax.Array  # the block's first query token
    token: jax.Array  # [rows] query token of each dot row
    member: jax.Array  # [rows] head within the GQA group
    length: jax.Array  # valid queries of the row
    row_valid: jax.Array  # [rows]
    q_row: jax.Array  # [rows] row of the flattened q / out / lse
    q: jax.Array  # [rows, D]


def _program(q_ref, lengths_ref, st: _Static) -> _Program:
    """Grid (batch, kv_head, query block x split). Row r of the dot is query token
    first + r // group_pad of head h * group + r % group_pad (padded members are masked)."""
    chunk, group, group_pad, block_q, num_splits = (st.chunk, st.group, st.group_pad,
                                                    st.block_q, st.num_splits)
    b, h = pl.program_id(0), pl.program_id(1)
    # Later query blocks see more keys: they run first, so the last wave is the lightest.
    qblock = common.cdiv(chunk, block_q) - 1 - lax.div(pl.program_id(2), num_splits)
    split = lax.rem(pl.program_id(2), num_splits)
    rows = block_q * group_pad
    first = qblock * block_q
    token = first + jnp.arange(rows) // group_pad
    member = jnp.arange(rows) % group_pad
    length = jnp.minimum(lengths_ref[b], chunk)
    row_valid = (token < length) & (member < group)
    q_row = (b * chunk + token) * (group * st.kv_heads) + h * group + member
    cols = jnp.arange(q_ref.shape[-1])
    q = plgpu.load(q_ref.at[q_row[:, None], cols[None, :]], mask=row_valid[:, None], other=0)
    return _Program(b, h, split, first, token, member, length, row_valid, q_row, q)


def _page_ids(page_table_ref, b, pos, valid, page_size):
    """Page ids [len(pos)] of row b's logical positions `pos`; nothing is read where not
    `valid` (entries past the length may be garbage)."""
    return plgpu.load(page_table_ref.at[b, pos >> (page_size.bit_length() - 1)], mask=valid,
                      other=0)


def _cache_rows(ref, pages, h, pos, valid, *, kv_heads, page_size, scale_ref=None,
                dtype=None, values=False):
    """Rows [len(pos), D] of the cache `ref` [num_pages * HK * P, D] at positions `pos` (on
    `pages`) of KV head h, and their scales: as stored and None, or with `scale_ref` (an fp8
    cache's scales) the fp8 rows in `dtype`, q's (V's, `values`, as their column pair,
    `common.load_fp8_pairs`), and [len(pos)] f32 scales that `common.fold_scales` applies
    past the dots. Masked gathers read nothing where not `valid`; valid=None reads every
    row without a mask."""
    slot = common.cache_row(pages, h, pos, kv_heads=kv_heads, page_size=page_size)
    if scale_ref is not None and values:
        return common.load_fp8_pairs(ref, scale_ref, slot, valid, dtype)
    if scale_ref is not None:
        return common.load_fp8(ref, scale_ref, slot, jnp.arange(ref.shape[-1])[None, :],
                               valid, dtype)
    at = ref.at[slot[:, None], jnp.arange(ref.shape[-1])[None, :]]
    return (plgpu.load(at) if valid is None else plgpu.load(at, mask=valid[:, None], other=0),
            None)


def _looked_up(lookup, j, ahead, lookahead: int):
    """-> (block j's lookups, the carry for step j + 1): with lookahead they were made a step
    earlier and block j + 1's are made now, off the path of block j's K/V loads."""
    return (ahead, lookup(j + 1)) if lookahead else (lookup(j), ())


def _softmax_step(q, k, v, keep, acc, m, l, *, scale, dot, k_scale=None, v_scale=None):
    """One key block of the base-2 online softmax: scores q.k (masked to -inf where not
    `keep`, a mask broadcastable to [rows, block_n]; None: every key) -> (acc, m, l). An
    fp8 cache's K and V rows come with their scales [block_n] (`common.fold_scales`)."""
    s = dot(q, k, (((1,), (1,)), ((), ()))) * scale  # [rows, block_n], base 2
    s = common.fold_scales(s, k_scale, axis=1)
    if keep is not None:  # a row may see no key in a block (causal diagonal, padded rows)
        s = jnp.where(keep, s, -jnp.inf)
    return common.online_softmax_step(
        s, v, v_scale, acc, m, l, lambda a, b: dot(a, b, (((1,), (0,)), ((), ()))),
        base2=True, empty_rows=keep is not None)


def _prefill_kernel(
    q_ref,  # [B * C * HQ, D]: one row per (row, query token, head)
    k_ref,  # [num_pages * HK * P, D]: the cache viewed as one row per (page, head, slot)
    v_ref,  # [num_pages * HK * P, D]; fp8: [.., D / 2] uint16 (`common.value_pairs`)
    page_table_ref,  # [B, max_pages] int32
    start_ref,  # [B] int32 position of each row's first query
    lengths_ref,  # [B] int32 valid queries per row
    *refs,  # sparse: cache rows [B, T, HK, K] int32 (`_selected_rows`), count [B, T, HK]
    #          int32; fp8 cache: k and v scales [num_pages * HK * P] f32; then the outputs
    sparse: bool,
    quantized: bool,
    st: _Static,
):
    refs = list(refs)
    cache_rows_ref, count_ref = (refs.pop(0), refs.pop(0)) if sparse else (None, None)
    k_scale_ref, v_scale_ref = (refs.pop(0), refs.pop(0)) if quantized else (None, None)
    out_ref, lse_ref = refs  # [S, B * C * HQ, D] f32, [S, B * C * HQ] f32
    chunk, group, kv_heads, page_size, block_q, block_n, tile, num_splits = (
        st.chunk, st.group, st.kv_heads, st.page_size, st.block_q, st.block_n, st.tile,
        st.num_splits)
    b, h, split, first, token, member, length, row_valid, q_row, q = _program(
        q_ref, lengths_ref, st)
    head_dim = q_ref.shape[-1]
    rows = block_q * st.group_pad
    cols = jnp.arange(head_dim)
    dot = functools.partial(lax.dot_general, preferred_element_type=jnp.float32,
                            precision=st.precision)

    start = start_ref[b]
    q_pos = start + token  # [rows]
    # The block's last valid query; positions past the page table's span are never read.
    last_pos = jnp.minimum(start + jnp.minimum(first + block_q, length),
                           page_table_ref.shape[1] * page_size) - 1

    # The key stream: selected blocks (sparse), then the dense key blocks [lo, last_pos].
    if sparse:
        t = lax.div(first, tile)
        lo = start + t * tile
        count = count_ref[b, t, h]
        sel_blocks = pl.cdiv(count, block_n)
    else:
        lo = 0
        sel_blocks = 0
    lo_block = lax.div(lo, block_n)
    dense_blocks = jnp.where(last_pos >= lo, lax.div(last_pos, block_n) + 1 - lo_block, 0)
    total = jnp.where(first < length, sel_blocks + dense_blocks, 0)  # no valid query: no work
    per_split = pl.cdiv(total, num_splits)
    begin = split * per_split
    end = jnp.minimum(begin + per_split, total)
    # Dense blocks wholly inside [lo, last_pos] and before the block's first query need no
    # mask: every row attends to every key (padded rows too; they are dropped at the end).
    # Selected keys all lie before every query of the tile: they need only a mask over the
    # keys (the slots past the count, entries outside [0, lo)), not the causal one. The
    # stream is [begin, sel_end) selected, [sel_end, full_lo) masked, [full_lo, full_hi)
    # unmasked, [full_hi, end) masked: the masks and their selects cost as much ALU as the
    # softmax itself.
    to_stream = sel_blocks - lo_block
    sel_end = jnp.clip(sel_blocks, begin, end)
    full_lo = jnp.clip(pl.cdiv(lo, block_n) + to_stream, sel_end, end)
    full_hi = jnp.clip(lax.div(jnp.minimum(start + first, last_pos + 1), block_n) + to_stream,
                       full_lo, end)

    def lookup(j):  # (positions, attended, page ids) of dense stream block j
        pos = (j - to_stream) * block_n + jnp.arange(block_n)
        valid = (pos >= lo) & (pos <= last_pos)
        return pos, valid, _page_ids(page_table_ref, b, pos, valid, page_size)

    def attend_selected(j, carry):
        """Selected block j: its cache rows were looked up before the kernel (one load in
        the chain to K/V instead of index -> page id -> K/V), -1 where not attended."""
        acc, m, l = carry
        slot = j * block_n + jnp.arange(block_n)
        at = plgpu.load(cache_rows_ref.at[b, t, h, slot], mask=slot < count, other=-1)
        valid = at >= 0
        k_scale = v_scale = None
        if quantized:
            k, k_scale = common.load_fp8(k_ref, k_scale_ref, at, cols[None, :], valid,
                                         q.dtype)
            v, v_scale = common.load_fp8_pairs(v_ref, v_scale_ref, at, valid, q.dtype)
        else:
            kv_at = (at[:, None], cols[None, :])
            k = plgpu.load(k_ref.at[kv_at], mask=valid[:, None], other=0)
            v = plgpu.load(v_ref.at[kv_at], mask=valid[:, None], other=0)
        return _softmax_step(q, k, v, valid[None, :], acc, m, l, scale=scale, dot=dot,
                             k_scale=k_scale, v_scale=v_scale)

    def attend(j, carry, masked: bool):
        acc, m, l, ahead = carry
        (pos, valid, pages), ahead = _looked_up(lookup, j, ahead, st.lookahead)
        # Masked: nothing outside the stream is read (unwritten slots stay unread).
        rows_at = functools.partial(_cache_rows, pages=pages, h=h, pos=pos,
                                    valid=valid if masked else None, kv_heads=kv_heads,
                                    page_size=page_size, dtype=q.dtype)
        k, k_scale = rows_at(k_ref, scale_ref=k_scale_ref)  # [block_n, D], [block_n] or None
        v, v_scale = rows_at(v_ref, scale_ref=v_scale_ref, values=True)
        keep = None
        if masked:
            keep = valid[None, :] & (pos[None, :] <= q_pos[:, None]) & row_valid[:, None]
        return (*_softmax_step(q, k, v, keep, acc, m, l, scale=scale, dot=dot,
                               k_scale=k_scale, v_scale=v_scale), ahead)

    scale = st.sm_scale * common.LOG2E
    acc = common.zero_values(rows, head_dim, pairs=quantized)
    m = jnp.full((rows,), -jnp.inf, jnp.float32)
    l = jnp.zeros((rows,), jnp.float32)
    if sparse:
        acc, m, l = lax.fori_loop(begin, sel_end, attend_selected, (acc, m, l))
    carry = (acc, m, l, lookup(sel_end) if st.lookahead else ())
    carry = lax.fori_loop(sel_end, full_lo, functools.partial(attend, masked=True), carry)
    carry = lax.fori_loop(full_lo, full_hi, functools.partial(attend, masked=False), carry)
    acc, m, l, _ = lax.fori_loop(full_hi, end, functools.partial(attend, masked=True), carry)

    # Every existing row is written: queries past the length (and empty splits) get out 0
    # and lse -inf, the convention of `common.merge_partials`.
    nonempty = (l > 0) & row_valid
    out, lse = common.softmax_result(acc, m, l, nonempty)
    stored = (token < chunk) & (member < group)
    for part, part_cols in common.column_parts(out):
        plgpu.store(out_ref.at[split, q_row[:, None], part_cols],
                    jnp.where(nonempty[:, None], part, 0.0),
                    mask=jnp.broadcast_to(stored[:, None], part.shape))
    plgpu.store(lse_ref.at[split, q_row], lse, mask=stored)


def _selected_rows(indices, count, page_table, start, *, tile, kv_heads, page_size):
    """Rows [B, T, HK, K] of the cache viewed as [num_pages * HK * P, D] that the selected
    positions of each (row, tile, KV head) occupy; -1 for slots past the count and for
    positions outside [0, the tile's first position) or past the page table's span."""
    batch, tiles, _, _ = indices.shape
    tile_lo = start[:, None] + jnp.arange(tiles)[None, :] * tile  # [B, T]
    end = jnp.minimum(tile_lo, page_table.shape[1] * page_size)[:, :, None, None]
    live = ((jnp.arange(indices.shape[-1]) < count[..., None]) & (indices >= 0)
            & (indices < end))
    pos = jnp.where(live, indices, 0)
    pages = page_table[jnp.arange(batch)[:, None, None, None], pos // page_size]
    head = jnp.arange(kv_heads)[None, None, :, None]
    return jnp.where(live, common.cache_row(pages, head, pos, kv_heads=kv_heads,
                                            page_size=page_size), -1)


def _prefill_pallas(q, k_pages, v_pages, page_table, start, lengths, indices, count, k_scale,
                    v_scale, *, tile, sm_scale, interpret, block_q, block_n, num_splits,
                    num_warps, num_stages, lookahead):
    batch, chunk, q_heads, head_dim = q.shape
    st = _static(q, k_pages, tile, sm_scale, block_q, block_n, num_splits, lookahead,
                 interpret)
    sparse = indices is not None
    # Free reshapes of contiguous arrays: no copy.
    q_rows = q.reshape(-1, head_dim)
    k_rows = k_pages.reshape(-1, head_dim)
    v_rows = v_pages.reshape(-1, head_dim)
    quantized = k_scale is not None
    if quantized:
        v_rows = common.value_pairs(v_rows)
    kernel = functools.partial(_prefill_kernel, sparse=sparse, quantized=quantized, st=st)
    extra = ((_selected_rows(indices, count, page_table, start, tile=tile,
                             kv_heads=st.kv_heads, page_size=st.page_size), count)
             if sparse else ())
    if quantized:
        extra = (*extra, common.scale_rows(k_scale), common.scale_rows(v_scale))
    out_part, lse_part = common.pallas_call(
        kernel,
        grid=(batch, st.kv_heads, common.cdiv(chunk, block_q) * num_splits),
        out_shape=[jax.ShapeDtypeStruct((num_splits, batch * chunk * q_heads, head_dim),
                                        jnp.float32),
                   jax.ShapeDtypeStruct((num_splits, batch * chunk * q_heads), jnp.float32)],
        compiler_params=common.triton_params(num_warps, num_stages),
        interpret=interpret,
        name=f"paged_prefill_attention_{sparse=}_{block_q=}_{block_n=}_{num_splits=}",
    )(q_rows, k_rows, v_rows, page_table, start, lengths, *extra)
    out, lse = common.merge_partials(out_part, lse_part, axis=0)
    return PrefillAttention(out.reshape(q.shape).astype(q.dtype),
                            lse.reshape(batch, chunk, q_heads))


def _tile_scores_kernel(
    q_ref,  # [B * C * HQ, D]
    k_ref,  # [num_pages * HK * P, D]
    page_table_ref,  # [B, max_pages] int32
    start_ref,  # [B] int32
    lengths_ref,  # [B] int32
    lse_ref,  # [B * C * HQ] f32: each query's log-sum-exp over everything it attends to
    *refs,  # fp8 cache: k_scale_ref [num_pages * HK * P] f32; then the zeros that
            # scores_ref aliases, scores_ref [B, tiles, HK, max_pages * P rounded up to
            # block_n] f32 (atomic adds)
    quantized: bool,
    st: _Static,
):
    k_scale_ref, _, scores_ref = refs if quantized else (None, *refs)
    b, h, split, first, _, _, length, row_valid, q_row, q = _program(q_ref, lengths_ref, st)
    kv_heads, page_size, block_n, num_splits = st.kv_heads, st.page_size, st.block_n, st.num_splits
    # Base 2; padded rows get lse +inf, so their probabilities are 0 without a row mask.
    lse = plgpu.load(lse_ref.at[q_row], mask=row_valid, other=0.0)
    lse = jnp.where(row_valid, lse * common.LOG2E, jnp.inf)
    t = lax.div(first, st.tile)
    # the keys before the tile, within the page table's span
    lo = jnp.minimum(start_ref[b] + t * st.tile, page_table_ref.shape[1] * page_size)
    total = jnp.where(first < length, pl.cdiv(lo, block_n), 0)
    per_split = pl.cdiv(total, num_splits)
    begin = split * per_split
    end = jnp.minimum(begin + per_split, total)
    full = jnp.clip(lax.div(lo, block_n), begin, end)  # blocks wholly before lo: no mask

    def lookup(j):  # (positions, before the tile, page ids) of block j
        pos = j * block_n + jnp.arange(block_n)
        return pos, pos < lo, _page_ids(page_table_ref, b, pos, pos < lo, page_size)

    def body(j, ahead, masked: bool):
        (pos, valid, pages), ahead = _looked_up(lookup, j, ahead, st.lookahead)
        k, k_scale = _cache_rows(k_ref, pages, h, pos, valid if masked else None,
                                 kv_heads=kv_heads, page_size=page_size, scale_ref=k_scale_ref,
                                 dtype=q.dtype)
        # Keys as the dot's rows: the sum over queries is then along the accumulator's rows
        # (within a warp), not across the warps that split the query rows.
        s = lax.dot_general(k, q, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                            precision=st.precision) * (st.sm_scale * common.LOG2E)
        s = common.fold_scales(s, k_scale, axis=0)
        p = jnp.exp2(s - lse[None, :])  # [block_n, rows]
        if masked:  # a whole block (the output is padded to whole blocks): past lo adds 0
            p = jnp.where(valid[:, None], p, 0.0)
        plgpu.atomic_add(scores_ref, (b, t, h, pl.ds(j * block_n, block_n)), jnp.sum(p, axis=1))
        return ahead

    carry = lax.fori_loop(begin, full, functools.partial(body, masked=False),
                          lookup(begin) if st.lookahead else ())
    lax.fori_loop(full, end, functools.partial(body, masked=True), carry)


def _tile_scores_pallas(q, k_pages, page_table, start, lengths, lse, k_scale, *, tile,
                        sm_scale, interpret, block_q, block_n, num_splits, num_warps,
                        num_stages, lookahead):
    batch, chunk, _, head_dim = q.shape
    st = _static(q, k_pages, tile, sm_scale, block_q, block_n, num_splits, lookahead,
                 interpret)
    span = page_table.shape[1] * st.page_size
    shape = (batch, common.cdiv(chunk, tile), st.kv_heads, common.cdiv(span, block_n) * block_n)
    scales = () if k_scale is None else (common.scale_rows(k_scale),)
    return common.pallas_call(
        functools.partial(_tile_scores_kernel, quantized=k_scale is not None, st=st),
        grid=(batch, st.kv_heads, common.cdiv(chunk, block_q) * num_splits),
        out_shape=jax.ShapeDtypeStruct(shape, jnp.float32),
        input_output_aliases={6 + len(scales): 0},
        compiler_params=common.triton_params(num_warps, num_stages),
        interpret=interpret,
        name=f"paged_tile_scores_{block_q=}_{block_n=}_{num_splits=}",
    )(q.reshape(-1, head_dim), k_pages.reshape(-1, head_dim), page_table, start, lengths,
      lse.reshape(-1).astype(jnp.float32), *scales, jnp.zeros(shape, jnp.float32))[..., :span]


def default_tuning(batch: int, chunk: int, q_heads: int, kv_heads: int, head_dim: int,
                   page_size: int, max_pages: int, dtype, sparse: bool = False) -> dict:
    """Static knobs chosen from the shapes (the sweeps behind them, of
    benchmarks/bench_prefill.py, are in docs/tuning.md).

    block_q: query tokens per program, so that block_q x the padded GQA group is 256 rows
      (dense) or 128 (sparse: a gathered key block serves fewer rows, but twice the programs
      hide its gather) where a row's K/V tile is at most 256 bytes (bf16/f16 at head_dim <=
      128), else a quarter of that: a flash-attention M tile; at least 16 rows, at most the
      chunk's next power of 2.
    block_n: keys per loop step, 64 (32 at head_dim 256 or f32, to keep K/V tiles ~16 KiB).
    num_splits: split the key stream only when the (batch, kv_head, query block) programs
      alone leave the GPU idle (short chunks over a long cache: correction, verification):
      ~4 waves of `common.num_sms()` programs, no fewer than 4 key blocks per split.
    num_warps: 8 from 256 rows (dense: from 128), else 4; num_stages=3.
    lookahead: 1 (each block's page ids a loop step ahead) for the dense stream, 0 for the
      sparse one (its selected blocks look nothing up: `_selected_rows` did, before the
      kernel).
    """
    group_pad = common.next_power_of_2(q_heads // kv_heads)
    narrow = head_dim * jnp.dtype(dtype).itemsize <= 256
    rows = (256 if narrow else 64) // (2 if sparse else 1)
    block_q = max(1, rows // group_pad, common.cdiv(MIN_ROWS, group_pad))
    block_q = min(block_q, max(common.next_power_of_2(chunk), common.cdiv(MIN_ROWS, group_pad)))
    block_n = 64 if narrow else 32
    programs = batch * kv_heads * common.cdiv(chunk, block_q)
    max_blocks = common.cdiv(max_pages * page_size, block_n)
    num_splits = max(1, min(common.cdiv(4 * common.num_sms(), programs), max_blocks // 4))
    return dict(block_q=block_q, block_n=block_n, num_splits=num_splits,
                num_warps=8 if block_q * group_pad >= (256 if sparse else 128) else 4,
                num_stages=3, lookahead=0 if sparse else 1)


def _check_tuning(group_pad, tile, block_q, block_n, num_splits, num_warps, num_stages,
                  lookahead):
    common.check_power_of_2("block_q", block_q, 1, 512)
    common.check_power_of_2("block_n", block_n, 16, 512)
    common.check_power_of_2("num_warps", num_warps, 1, 16)
    if block_q * group_pad < MIN_ROWS:
        raise ValueError(f"block_q={block_q}: block_q x padded group ({group_pad}) must be at "
                         f"least {MIN_ROWS} rows")
    if tile % block_q:
        raise ValueError(f"block_q={block_q} must divide tile={tile}")
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits={num_splits!r}: expected an int >= 1")
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages={num_stages!r}: expected an int >= 1")
    if lookahead not in (0, 1):
        raise ValueError(f"lookahead={lookahead!r}: expected 0 or 1")


def _tuning(q, k_pages, page_table, tile, given, sparse: bool = False) -> dict:
    """`default_tuning` overridden by the knobs given; block_q divides the tile."""
    batch, chunk, q_heads, head_dim = q.shape
    _, kv_heads, page_size, _ = k_pages.shape
    tuning = common.resolve_tuning(
        default_tuning(batch, chunk, q_heads, kv_heads, head_dim, page_size,
                       page_table.shape[1], q.dtype, sparse), **given)
    if given["block_q"] is None:
        tuning["block_q"] = math.gcd(tuning["block_q"], tile)
    _check_tuning(common.next_power_of_2(q_heads // kv_heads), tile, **tuning)
    return tuning


def _check_inputs(q, k_pages, v_pages, page_table, start, lengths, indices, count, tile,
                  k_scale=None, v_scale=None):
    """Structure every path needs; the kernel's own limits are `common.pallas_support`'s."""
    if q.ndim != 4:
        raise ValueError(f"q.shape={q.shape}: expected [batch, chunk, q_heads, head_dim]")
    common.check_paged_cache(q, k_pages, v_pages, page_table, k_scale, v_scale)
    batch, chunk = q.shape[:2]
    num_kv_heads = k_pages.shape[1]
    for name, x in (("start", start), ("lengths", lengths)):
        if x.shape != (batch,) or x.dtype != jnp.int32:
            raise ValueError(f"{name} {x.dtype}{list(x.shape)}: expected int32[{batch}]")
    if not isinstance(tile, int) or tile < 1:
        raise ValueError(f"tile={tile!r}: expected an int >= 1")
    if (indices is None) != (count is None):
        raise ValueError("indices and count: give both (sparse) or neither (dense)")
    if indices is not None:
        tiles = common.cdiv(chunk, tile)
        if (indices.ndim != 4 or indices.shape[:3] != (batch, tiles, num_kv_heads)
                or indices.dtype != jnp.int32):
            raise ValueError(f"indices {indices.dtype}{list(indices.shape)}: expected "
                             f"int32[{batch}, {tiles}, {num_kv_heads}, k] ({tiles} tiles of "
                             f"{tile} queries)")
        if count.shape != (batch, tiles, num_kv_heads) or count.dtype != jnp.int32:
            raise ValueError(f"count {count.dtype}{list(count.shape)}: expected "
                             f"int32[{batch}, {tiles}, {num_kv_heads}]")


def paged_prefill_attention(
    q: jax.Array,  # [B, C, HQ, D]
    k_pages: jax.Array,  # [num_pages, HK, P, D]
    v_pages: jax.Array,  # [num_pages, HK, P, D]
    page_table: jax.Array,  # [B, max_pages] int32
    start: jax.Array,  # [B] int32
    lengths: jax.Array,  # [B] int32
    *,
    indices: jax.Array | None = None,  # [B, ceil(C / tile), HK, K] int32
    count: jax.Array | None = None,  # [B, ceil(C / tile), HK] int32
    tile: int = 128,
    k_scale: jax.Array | None = None,  # [num_pages, HK, P] f32 with an fp8 cache
    v_scale: jax.Array | None = None,
    sm_scale: float | None = None,
    backend: str = "auto",
    interpret: bool | None = None,
    block_q: int | None = None,
    block_n: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    lookahead: int | None = None,
) -> PrefillAttention:
    """Causal attention of C query tokens per row over a paged KV cache.

    Query token i of row b sits at position start[b] + i and attends to the cached positions
    0 .. start[b] + i (token t of row b is `k_pages[page_table[b, t // P], h, t % P]`; query
    head j reads KV head j // (HQ // HK)). The queries' own K/V must already be written.
    lengths[b] <= C is the number of valid queries of row b (ragged chunks): query tokens
    i >= lengths[b] get out 0 and lse -inf, and nothing at or past position
    start[b] + lengths[b] is read; positions past the page table's span are never read.

    Sparse (indices and count given): the queries form tiles of `tile` tokens; tile t of
    row b attends, per KV head h, to positions indices[b, t, h, :count[b, t, h]] that lie
    before the tile (< start[b] + t * tile; others are skipped, as are negative entries),
    plus its own causal block (start[b] + t * tile up to the query's position). Entries
    need not be sorted but must be unique.

    k_scale, v_scale: an fp8 cache (k/v_pages float8_e4m3fn) gives one float32 scale per
      (page, KV head, slot), shaped k_pages.shape[:-1]. The Pallas kernel's dots take the
      fp8 tiles in q's dtype (exact), each token's K scale multiplies its logits in f32 and
      its V scale biases them for the values (`common.online_softmax_step`); cuDNN gets the
      gathered rows dequantized to q's dtype; the reference dequantizes the pages it
      gathers (f32).
    backend: "auto" (on a GPU cuDNN for dense bf16/f16 chunks of at least CUDNN_MIN_CHUNK
      queries, else Pallas; the reference elsewhere) | "pallas" | "cudnn" (dense bf16/f16 on
      a GPU) | "reference". The Pallas kernel takes what `common.pallas_support` allows
      (head_dim in HEAD_DIMS, page size in PAGE_SIZES, bf16/f16/f32, groups up to
      MAX_GROUP); other shapes run the reference under "auto" and raise under "pallas".
      f32 dots run as three-pass TF32 on the GPU (`common.dot_precision`).
    interpret: Pallas interpret mode; None -> on unless a GPU is present.
    block_q, block_n, num_splits, num_warps, num_stages, lookahead: static knobs of the
      Pallas path; None picks `default_tuning`. block_q must divide `tile`.
    """
    _check_inputs(q, k_pages, v_pages, page_table, start, lengths, indices, count, tile,
                  k_scale, v_scale)
    return _paged_prefill_attention(
        q, k_pages, v_pages, page_table, start, lengths, indices, count, k_scale, v_scale,
        tile=tile,
        sm_scale=sm_scale, backend=_choose_backend(backend, q, k_pages, indices),
        interpret=interpret, block_q=block_q, block_n=block_n, num_splits=num_splits,
        num_warps=num_warps, num_stages=num_stages, lookahead=lookahead)


def _cudnn_support(q, indices) -> str | None:
    """Why cuDNN cannot run this call, or None."""
    if indices is not None:
        return "the sparse variant (indices) runs on Pallas or the reference only"
    if q.dtype not in CUDNN_DTYPES:
        return f"q.dtype={q.dtype}: cuDNN takes bfloat16 or float16"
    if q.shape[-1] % 8 or q.shape[-1] > 256:
        return f"head_dim={q.shape[-1]}: cuDNN takes multiples of 8 up to 256"
    if not common.on_gpu():
        return "cuDNN needs a GPU"
    return None


def _choose_backend(backend, q, k_pages, indices) -> str:
    """Resolved outside jit, so that the jit cache is keyed on the backend used: "cudnn" when
    asked for, or under "auto" (not overridden by `common.use_backend`) for dense chunks of at
    least CUDNN_MIN_CHUNK queries that cuDNN takes; else `common.choose_backend`'s."""
    if backend == "cudnn":
        why = _cudnn_support(q, indices)
        if why is not None:
            raise ValueError(f"backend='cudnn': {why}")
        return backend
    if backend not in common.BACKENDS:
        raise ValueError(f"backend={backend!r}: expected one of {(*common.BACKENDS, 'cudnn')}")
    if (backend == "auto" and not common.backend_overridden() and q.shape[1] >= CUDNN_MIN_CHUNK
            and _cudnn_support(q, indices) is None):
        return "cudnn"
    return common.choose_backend(backend, common.pallas_support(q[:, 0], k_pages))


@functools.partial(jax.jit, static_argnames=(
    "tile", "sm_scale", "backend", "interpret", "block_q", "block_n", "num_splits",
    "num_warps", "num_stages", "lookahead"))
def _paged_prefill_attention(q, k_pages, v_pages, page_table, start, lengths, indices, count,
                             k_scale, v_scale, *, tile, sm_scale, backend, interpret, block_q,
                             block_n, num_splits, num_warps, num_stages, lookahead):
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else float(sm_scale)
    if backend == "reference":
        return paged_prefill_attention_reference(
            q, k_pages, v_pages, page_table, start, lengths, indices=indices, count=count,
            tile=tile, k_scale=k_scale, v_scale=v_scale, sm_scale=sm_scale)
    if backend == "cudnn":
        return _prefill_split(q, k_pages, v_pages, page_table, start, lengths,
                              sm_scale=sm_scale, attend=_cudnn_attention, k_scale=k_scale,
                              v_scale=v_scale)
    if indices is None:  # dense: one tile holds every query block
        tile = common.next_power_of_2(max(q.shape[1], block_q or 1, 512))
    tuning = _tuning(q, k_pages, page_table, tile, dict(
        block_q=block_q, block_n=block_n, num_splits=num_splits, num_warps=num_warps,
        num_stages=num_stages, lookahead=lookahead), sparse=indices is not None)
    return _prefill_pallas(q, k_pages, v_pages, page_table, start, lengths, indices, count,
                           k_scale, v_scale, tile=tile, sm_scale=sm_scale,
                           interpret=common.resolve_interpret(interpret), **tuning)


def _cudnn_attention(q, k, v, q_len, kv_len, *, causal: bool, sm_scale: float):
    """cuDNN flash attention of q [B, T, HQ, D] over contiguous k, v [B, S, HK, D] (queries
    top-left aligned with the keys when causal) -> (out [B, T, HQ, D], lse [B, T, HQ] f32).
    q_len and kv_len [B] (both or neither) attend only each row's first q_len queries and
    kv_len keys; without them every query and key takes part, on cuDNN's faster unmasked
    kernel. jax.nn.dot_product_attention casts the LSE to the input dtype, too coarse to
    merge with; this call keeps cuDNN's f32."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn
    masks = {(True, True): cudnn.MaskType.PADDING_CAUSAL, (True, False): cudnn.MaskType.PADDING,
             (False, True): cudnn.MaskType.CAUSAL, (False, False): cudnn.MaskType.NO_MASK}
    out, lse = cudnn.dot_product_attention(q, k, v, None, None, q_len, kv_len, scale=sm_scale,
                                           mask_type=masks[kv_len is not None, causal],
                                           qkv_layout="BTNH", return_residual=True)
    return out, lse.transpose(0, 2, 1)


def _gather_positions(pages, page_table, pos, limit, scale=None, dtype=None):
    """pages [num_pages, HK, P, D] at logical positions pos [B, T] -> [B, T, HK, D]; 0 at
    positions >= limit [B] (never-written slots may hold anything, NaN included). With
    `scale` (an fp8 cache's [num_pages, HK, P]) the gathered rows are dequantized to
    `dtype`."""
    page_size = pages.shape[2]
    at = jnp.clip(pos, 0, page_table.shape[1] * page_size - 1)
    at_page = jnp.take_along_axis(page_table, at // page_size, axis=1)
    rows = pages[at_page, :, at % page_size]
    if scale is not None:
        rows = common.dequantize(rows, scale[at_page, :, at % page_size], dtype)
    return jnp.where((pos < limit[:, None])[..., None, None], rows, 0)


def _prefill_split(q, k_pages, v_pages, page_table, start, lengths, *, sm_scale, attend,
                   k_scale=None, v_scale=None):
    """Dense paged prefill as contiguous attentions merged by LSE: the chunk's queries over
    the chunk's own keys (causal) and over the cache before it (every position < start
    visible; an fp8 cache's rows dequantized to q's dtype as gathered). attend(q, k, v, q_len,
    kv_len, causal=, sm_scale=) -> (out, lse [B, T, HQ]) is the contiguous attention
    (`_cudnn_attention` on the GPU), q_len = kv_len = None attending every query and key.

    Length masks slow cuDNN down (docs/tuning.md), so full chunks at one shared start that is
    a multiple of the chunk (chunked prefill's) take unmasked calls: causal over the chunk,
    and over the positions before it as power-of-2 runs of chunks (start = 5C: [0, 4C) and
    [4C, 5C)), one static shape per run length. Other calls (ragged starts, a partial last
    chunk) take the length-masked ones."""
    batch, chunk = q.shape[:2]
    span = page_table.shape[1] * k_pages.shape[2]
    q_len = jnp.clip(lengths, 0, chunk)
    own_len = jnp.clip(span - start, 0, q_len)   # the chunk's keys inside the page table
    prior_len = jnp.clip(start, 0, span)

    def attend_positions(pos, kv_len, causal, masked):
        """(out, lse) of the queries over positions pos [B, S]: the first kv_len of them,
        by cuDNN's length mask when masked; a row without keys gives out 0 and lse -inf."""
        limit = pos[:, 0] + kv_len
        k, v = (_gather_positions(p, page_table, pos, limit, scale, q.dtype)
                for p, scale in ((k_pages, k_scale), (v_pages, v_scale)))
        lens = (q_len, kv_len) if masked else (None, None)
        out, lse = attend(q, k, v, *lens, causal=causal, sm_scale=sm_scale)
        empty = (kv_len == 0)[:, None, None]
        return (jnp.where(empty[..., None], 0, out).astype(q.dtype),
                jnp.where(empty, -jnp.inf, lse.astype(jnp.float32)))

    def unmasked_run(pos):
        return attend_positions(pos, jnp.full((batch,), pos.shape[1]), False, False)

    own_pos = start[:, None] + jnp.arange(chunk)[None, :]
    full = jnp.all((q_len == chunk) & (own_len == chunk))
    parts = [lax.cond(full, lambda: attend_positions(own_pos, own_len, True, False),
                      lambda: attend_positions(own_pos, own_len, True, True))]
    # the positions before the chunk: power-of-2 runs of chunks, else one masked call
    index = start[0] // chunk
    in_runs = jnp.all(start == start[0]) & (start[0] % chunk == 0) & (start[0] <= span)
    no_part = (jnp.zeros(q.shape, q.dtype), jnp.full(q.shape[:3], -jnp.inf, jnp.float32))
    for bit in range((span // chunk).bit_length()):
        first = (index >> (bit + 1)) << (bit + 1)   # the run covers chunks [first, first + 2^bit)
        pos = jnp.broadcast_to(first * chunk + jnp.arange(chunk << bit), (batch, chunk << bit))
        parts.append(lax.cond(in_runs & ((index >> bit) & 1 == 1),
                              functools.partial(unmasked_run, pos), lambda: no_part))
    everything = jnp.broadcast_to(jnp.arange(span)[None, :], (batch, span))
    parts.append(lax.cond(in_runs, lambda: no_part,
                          lambda: attend_positions(everything, prior_len, False, True)))
    out, lse = common.merge_partials(jnp.stack([o for o, _ in parts], axis=2),
                                     jnp.stack([s for _, s in parts], axis=2), axis=2)
    valid = jnp.arange(chunk)[None, :] < q_len[:, None]
    return PrefillAttention(jnp.where(valid[..., None, None], out, 0.0).astype(q.dtype),
                            jnp.where(valid[..., None], lse, -jnp.inf))


def paged_tile_scores(
    q: jax.Array,  # [B, C, HQ, D]
    k_pages: jax.Array,  # [num_pages, HK, P, D]
    page_table: jax.Array,  # [B, max_pages] int32
    start: jax.Array,  # [B] int32
    lengths: jax.Array,  # [B] int32
    lse: jax.Array,  # [B, C, HQ] f32, from `paged_prefill_attention`
    *,
    tile: int = 128,
    k_scale: jax.Array | None = None,  # [num_pages, HK, P] f32 with an fp8 cache
    sm_scale: float | None = None,
    backend: str = "auto",
    interpret: bool | None = None,
    block_q: int | None = None,
    block_n: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    lookahead: int | None = None,
) -> jax.Array:
    """Kascade's prefill scores: per tile of `tile` queries and KV head, the post-softmax
    probabilities of the keys before the tile, summed over the tile's valid queries and the
    KV head's query group -> [B, ceil(C / tile), HK, max_pages * P] f32 (0 at positions at
    or past the tile's first position start[b] + t * tile).

    The probabilities are exp(q.k * sm_scale - lse) with `lse` each query's log-sum-exp over
    everything it attends to (the dense prefill's), so they are the dense attention's. The
    kernel is the prefill kernel's loop without the PV dot, adding each key block's column
    sums into the output with atomics. Backends, knobs and `k_scale` (an fp8 cache's K scales;
    no V is read) as `paged_prefill_attention`.
    """
    _check_inputs(q, k_pages, k_pages, page_table, start, lengths, None, None, tile, k_scale,
                  k_scale)
    if lse.shape != q.shape[:3]:
        raise ValueError(f"lse.shape={lse.shape}: expected q.shape[:3]={q.shape[:3]}")
    unsupported = common.pallas_support(q[:, 0], k_pages)
    return _paged_tile_scores(
        q, k_pages, page_table, start, lengths, lse, k_scale, tile=tile, sm_scale=sm_scale,
        backend=common.choose_backend(backend, unsupported), interpret=interpret,
        block_q=block_q, block_n=block_n, num_splits=num_splits, num_warps=num_warps,
        num_stages=num_stages, lookahead=lookahead)


@functools.partial(jax.jit, static_argnames=(
    "tile", "sm_scale", "backend", "interpret", "block_q", "block_n", "num_splits",
    "num_warps", "num_stages", "lookahead"))
def _paged_tile_scores(q, k_pages, page_table, start, lengths, lse, k_scale, *, tile,
                       sm_scale, backend, interpret, block_q, block_n, num_splits, num_warps,
                       num_stages, lookahead):
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else float(sm_scale)
    if backend == "reference":
        return paged_tile_scores_reference(q, k_pages, page_table, start, lengths, lse,
                                           tile=tile, k_scale=k_scale, sm_scale=sm_scale)
    tuning = _tuning(q, k_pages, page_table, tile, dict(
        block_q=block_q, block_n=block_n, num_splits=num_splits, num_warps=num_warps,
        num_stages=num_stages, lookahead=lookahead))
    return _tile_scores_pallas(q, k_pages, page_table, start, lengths, lse, k_scale, tile=tile,
                               sm_scale=sm_scale, interpret=common.resolve_interpret(interpret),
                               **tuning)


@functools.partial(jax.jit, static_argnames=("tile", "sm_scale"))
def paged_prefill_attention_reference(q, k_pages, v_pages, page_table, start, lengths, *,
                                      indices: jax.Array | None = None,
                                      count: jax.Array | None = None, tile: int = 128,
                                      k_scale: jax.Array | None = None,
                                      v_scale: jax.Array | None = None,
                                      sm_scale: float | None = None) -> PrefillAttention:
    """Plain-jnp twin of `paged_prefill_attention`: gathers the pages, fp32 math throughout
    (an fp8 cache dequantized as gathered)."""
    _check_inputs(q, k_pages, v_pages, page_table, start, lengths, indices, count, tile,
                  k_scale, v_scale)
    batch, chunk, q_heads, head_dim = q.shape
    _, kv_heads, page_size, _ = k_pages.shape
    span = page_table.shape[1] * page_size
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale

    def gather(pages, scale):  # -> [B, HK, T, D] f32 (an fp8 cache dequantized)
        x = common.gather_pages(pages, scale, page_table)  # [B, max_pages, HK, P, D]
        return x.transpose(0, 2, 1, 3, 4).reshape(batch, kv_heads, span, head_dim).astype(
            jnp.float32)

    i = jnp.arange(chunk)
    q_pos = start[:, None] + i[None, :]  # [B, C]
    key = jnp.arange(span)
    row_valid = i[None, :] < jnp.minimum(lengths, chunk)[:, None]  # [B, C]
    causal = key[None, None, :] <= q_pos[:, :, None]  # [B, C, T]
    attend = jnp.broadcast_to((causal & row_valid[:, :, None])[:, None],
                              (batch, kv_heads, chunk, span))  # [B, HK, C, T]
    if indices is not None:
        tiles = indices.shape[1]
        tile_lo = start[:, None] + jnp.arange(tiles)[None, :] * tile  # [B, tiles]
        live = (jnp.arange(indices.shape[-1]) < count[..., None]) & (indices >= 0)
        chosen = jnp.zeros((batch, tiles, kv_heads, span + 1), bool)
        b_, t_, h_ = jnp.meshgrid(jnp.arange(batch), jnp.arange(tiles), jnp.arange(kv_heads),
                                  indexing="ij")
        chosen = chosen.at[b_[..., None], t_[..., None], h_[..., None],
                           jnp.where(live, jnp.clip(indices, 0, span - 1), span)].set(True)
        chosen = chosen[..., :span] & (key < tile_lo[:, :, None, None])
        own = key[None, None, :] >= tile_lo[:, :, None]  # [B, tiles, T]
        tile_of = i // tile
        allowed = (chosen[:, tile_of].transpose(0, 2, 1, 3)
                   | own[:, tile_of][:, None])  # [B, HK, C, T]
        attend = attend & allowed

    qg = q.astype(jnp.float32).reshape(batch, chunk, kv_heads, -1, head_dim)
    hp = lax.Precision.HIGHEST
    logits = jnp.einsum("bchgd,bhtd->bhcgt", qg, gather(k_pages, k_scale),
                        precision=hp) * sm_scale
    logits = jnp.where(attend[:, :, :, None], logits, -jnp.inf)
    lse = jax.nn.logsumexp(logits, axis=-1)  # [B, HK, C, G]; -inf for an empty row
    prob = jnp.where(attend[:, :, :, None], jnp.exp(logits - lse[..., None]), 0.0)
    # only attended slots are read: unwritten ones may hold anything (NaN included)
    v = jnp.where(jnp.any(attend, axis=2)[..., None], gather(v_pages, v_scale), 0.0)
    out = jnp.einsum("bhcgt,bhtd->bchgd", prob, v, precision=hp)
    return PrefillAttention(out.reshape(q.shape).astype(q.dtype),
                            lse.transpose(0, 2, 1, 3).reshape(batch, chunk, q_heads))


@functools.partial(jax.jit, static_argnames=("tile", "sm_scale"))
def paged_tile_scores_reference(q, k_pages, page_table, start, lengths, lse, *,
                                tile: int = 128, k_scale: jax.Array | None = None,
                                sm_scale: float | None = None) -> jax.Array:
    """Plain-jnp twin of `paged_tile_scores`, fp32 throughout (an fp8 cache dequantized
    first)."""
    _check_inputs(q, k_pages, k_pages, page_table, start, lengths, None, None, tile, k_scale,
                  k_scale)
    batch, chunk, q_heads, head_dim = q.shape
    _, kv_heads, page_size, _ = k_pages.shape
    span = page_table.shape[1] * page_size
    tiles = common.cdiv(chunk, tile)
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    k = common.gather_pages(k_pages, k_scale, page_table).transpose(0, 2, 1, 3, 4).reshape(
        batch, kv_heads, span, head_dim)
    qg = q.astype(jnp.float32).reshape(batch, chunk, kv_heads, -1, head_dim)
    logits = jnp.einsum("bchgd,bhtd->bhcgt", qg, k.astype(jnp.float32),
                        precision=lax.Precision.HIGHEST) * sm_scale
    lse = lse.astype(jnp.float32).reshape(batch, chunk, kv_heads, -1).transpose(0, 2, 1, 3)
    i = jnp.arange(chunk)
    tile_lo = start[:, None] + (i // tile)[None, :] * tile  # [B, C]
    keep = ((jnp.arange(span)[None, None, :] < tile_lo[:, :, None])
            & (i < jnp.minimum(lengths, chunk)[:, None])[:, :, None])  # [B, C, T]
    prob = jnp.where(keep[:, None, :, None], jnp.exp(logits - lse[..., None]), 0.0)
    per_query = prob.sum(axis=3)  # [B, HK, C, T]
    per_query = jnp.pad(per_query, ((0, 0), (0, 0), (0, tiles * tile - chunk), (0, 0)))
    return per_query.reshape(batch, kv_heads, tiles, tile, span).sum(axis=3).transpose(
        0, 2, 1, 3)
