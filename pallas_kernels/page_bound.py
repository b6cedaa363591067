"""Quest's page bound at decode: per query head, an upper bound of q.k over each page's keys.

    bound[b, h, p] = sum_d max(q[b, h, d] * kmax[page, kv(h), d], q[b, h, d] * kmin[page, kv(h), d])

for logical page p of row b (physical page = page_table[b, p]), -inf for pages at or past
ceil(length / page_size). kmin / kmax hold each physical page's element-wise key bounds (f32,
bf16 or f16, read into f32); the decode step hands every layer's bounds as one array with
the layer's offset table, as it does the cache (a per-layer slice would be copied for the
kernel). With an fp8 cache the
bounds are those of the dequantized keys, in bf16 rounded outward (the runtime computes them
as it writes the keys), so the kernel never sees the fp8 pages or their scales.

Kernel: grid (batch, kv_head, split). Each program walks its share of the row's *valid* page
blocks through the page table (gathering the bounds' rows straight from [num_pages, HK, D]),
computes every query head of its GQA group against them and writes -inf over its share of
the rest. Only the pages a row holds are read: a cache sized for 128k tokens holding 4k
reads 1/32 of its bounds, where a gather over the whole page table reads them all.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from sparsejax.pallas_kernels import common
from sparsejax.pallas_kernels.common import pl, plgpu

TUNING = ("block_p", "num_splits", "num_warps")
BOUND_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)   # the bounds are read into f32


def _bound_kernel(q_ref,           # [B, HQ, D]
                  kmin_ref,        # [num_pages * HK, D] float: one row per (page, KV head)
                  kmax_ref,        # [num_pages * HK, D] float
                  page_table_ref,  # [B, max_pages] int32
                  lengths_ref,     # [B] int32
                  out_ref,         # [B, HQ, max_pages] f32
                  *, group: int, kv_heads: int, page_size: int, block_p: int, num_splits: int):
    b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    max_pages = page_table_ref.shape[1]
    cols = jnp.arange(q_ref.shape[-1])
    valid_pages = pl.cdiv(jnp.minimum(lengths_ref[b], max_pages * page_size), page_size)
    queries = [plgpu.load(q_ref.at[b, h * group + g, :]).astype(jnp.float32)
               for g in range(group)]

    def share(start, stop):  # this split's part of blocks [start, stop)
        per_split = pl.cdiv(stop - start, num_splits)
        first = start + split * per_split
        return first, jnp.minimum(first + per_split, stop)

    def bound_block(j, carry):
        pages = j * block_p + jnp.arange(block_p)
        live = pages < valid_pages
        # Masked: page-table entries past the length may be garbage and are never read.
        ids = plgpu.load(page_table_ref.at[b, pages], mask=live, other=0)
        # the bounds as [num_pages * HK, D]: a cache of one slot per page
        rows = common.cache_row(ids, h, 0, kv_heads=kv_heads, page_size=1)[:, None], cols[None, :]
        lo, hi = (plgpu.load(ref.at[rows], mask=live[:, None], other=0.0).astype(jnp.float32)
                  for ref in (kmin_ref, kmax_ref))                         # [block_p, D]
        for g, q in enumerate(queries):
            bound = jnp.sum(jnp.maximum(q[None, :] * hi, q[None, :] * lo), axis=1)
            plgpu.store(out_ref.at[b, h * group + g, pages], jnp.where(live, bound, -jnp.inf),
                        mask=pages < max_pages)
        return carry

    def empty_block(j, carry):
        pages = j * block_p + jnp.arange(block_p)
        for g in range(group):
            plgpu.store(out_ref.at[b, h * group + g, pages],
                        jnp.full((block_p,), -jnp.inf, jnp.float32), mask=pages < max_pages)
        return carry

    valid_blocks = pl.cdiv(valid_pages, block_p)
    lax.fori_loop(*share(0, valid_blocks), bound_block, 0)
    lax.fori_loop(*share(valid_blocks, pl.cdiv(max_pages, block_p)), empty_block, 0)


def default_tuning(batch: int, kv_heads: int, max_pages: int) -> dict:
    """32 pages a step at 8 warps; splits for about four programs per SM
    (`common.num_sms()`), never more than the page blocks: near the best of a sweep of page
    blocks, warps and splits at every batch and context measured (docs/tuning.md)."""
    block_p = min(32, common.next_power_of_2(max_pages))
    blocks = common.cdiv(max_pages, block_p)
    num_splits = max(1, min(blocks, common.cdiv(4 * common.num_sms(), batch * kv_heads)))
    return dict(block_p=block_p, num_splits=num_splits, num_warps=8)


def _check_tuning(block_p, num_splits, num_warps):
    common.check_power_of_2("block_p", block_p, 1, 1024)
    common.check_power_of_2("num_warps", num_warps, 1, 32)
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits={num_splits!r}: expected an int >= 1")


def _check_inputs(q, kmin, kmax, page_table, lengths, page_size):
    if q.ndim != 3:
        raise ValueError(f"q.shape={q.shape}: expected [batch, q_heads, head_dim]")
    if kmin.ndim != 3:
        raise ValueError(f"kmin.shape={kmin.shape}: expected [num_pages, kv_heads, head_dim]")
    if kmax.shape != kmin.shape:
        raise ValueError(f"kmax.shape={kmax.shape}: expected kmin.shape={kmin.shape}")
    for name, x in (("kmin", kmin), ("kmax", kmax)):
        if x.dtype not in BOUND_DTYPES:
            raise ValueError(f"{name}.dtype={x.dtype}: expected one of "
                             f"{[jnp.dtype(d).name for d in BOUND_DTYPES]}")
    batch, q_heads, head_dim = q.shape
    if kmin.shape[2] != head_dim:
        raise ValueError(f"kmin head_dim={kmin.shape[2]}: expected q's head_dim={head_dim}")
    if q_heads % kmin.shape[1]:
        raise ValueError(f"q_heads={q_heads}: expected a multiple of kv_heads={kmin.shape[1]}")
    if page_table.ndim != 2 or page_table.shape[0] != batch or page_table.dtype != jnp.int32:
        raise ValueError(f"page_table {page_table.dtype}{list(page_table.shape)}: expected "
                         f"int32[{batch}, max_pages]")
    if lengths.shape != (batch,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(f"lengths {lengths.dtype}{list(lengths.shape)}: expected int[{batch}]")
    if not isinstance(page_size, int) or page_size < 1 or page_size & (page_size - 1):
        raise ValueError(f"page_size={page_size!r}: expected a power of 2")


def _unsupported(q, kmin) -> str | None:
    head_dim, group = q.shape[-1], q.shape[1] // kmin.shape[1]
    if head_dim not in common.HEAD_DIMS:
        return f"head_dim={head_dim}: expected one of {common.HEAD_DIMS}"
    if group > common.MAX_GROUP:
        return f"group size {group}: expected at most {common.MAX_GROUP}"
    return None


def quest_page_bound(q, kmin, kmax, page_table, lengths, *, page_size: int, backend="auto",
                     interpret=None, block_p=None, num_splits=None, num_warps=None):
    """Quest's per-query-head page bound -> [B, HQ, max_pages] f32 (see the module doc).

    q [B, HQ, D] (any float dtype, computed in f32); kmin / kmax [num_pages, HK, D] (BOUND_DTYPES);
    page_table [B, max_pages] int32; lengths [B]. block_p, num_splits, num_warps: static
    knobs of the Pallas path; None picks `default_tuning`."""
    _check_inputs(q, kmin, kmax, page_table, lengths, page_size)
    if common.choose_backend(backend, _unsupported(q, kmin)) == "reference":
        return quest_page_bound_reference(q, kmin, kmax, page_table, lengths,
                                          page_size=page_size)
    tuning = common.resolve_tuning(default_tuning(q.shape[0], kmin.shape[1], page_table.shape[1]),
                                   block_p=block_p, num_splits=num_splits, num_warps=num_warps)
    _check_tuning(**tuning)
    return _quest_page_bound_pallas(q, kmin, kmax, page_table, lengths.astype(jnp.int32),
                                    page_size=page_size,
                                    interpret=common.resolve_interpret(interpret), **tuning)


@functools.partial(jax.jit, static_argnames=("page_size", "interpret", *TUNING))
def _quest_page_bound_pallas(q, kmin, kmax, page_table, lengths, *, page_size, interpret,
                             block_p, num_splits, num_warps):
    batch, q_heads, head_dim = q.shape
    num_pages, kv_heads, _ = kmin.shape
    kernel = functools.partial(_bound_kernel, group=q_heads // kv_heads, kv_heads=kv_heads,
                               page_size=page_size, block_p=block_p, num_splits=num_splits)
    return common.pallas_call(
        kernel,
        grid=(batch, kv_heads, num_splits),
        out_shape=jax.ShapeDtypeStruct((batch, q_heads, page_table.shape[1]), jnp.float32),
        compiler_params=common.triton_params(num_warps, 1),
        interpret=interpret,
        name=f"quest_page_bound_{block_p=}_{num_splits=}",
    )(q, kmin.reshape(num_pages * kv_heads, head_dim),
      kmax.reshape(num_pages * kv_heads, head_dim), page_table, lengths)


@functools.partial(jax.jit, static_argnames=("page_size",))
def quest_page_bound_reference(q, kmin, kmax, page_table, lengths, *, page_size: int):
    """Plain-jnp twin of `quest_page_bound`: gathers every page of the table."""
    lo, hi = (x[page_table].astype(jnp.float32) for x in (kmin, kmax))  # [B, MP, HK, D]
    group = q.shape[1] // kmin.shape[1]
    lo, hi = jnp.repeat(lo, group, axis=2), jnp.repeat(hi, group, axis=2)
    qf = q.astype(jnp.float32)[:, None]                              # [B, 1, HQ, D]
    bound = jnp.sum(jnp.maximum(qf * hi, qf * lo), axis=-1)          # [B, MP, HQ]
    max_pages = page_table.shape[1]
    pages_valid = -(-jnp.minimum(lengths, max_pages * page_size) // page_size)
    bound = jnp.where(jnp.arange(max_pages)[None, :, None] < pages_valid[:, None, None],
                      bound, -jnp.inf)
    return jnp.transpose(bound, (0, 2, 1))
