"""Writing tokens' K/V into the paged cache in place.

The cache is [num_pages, HK, P, D] per K and V (a decode step passes every layer's pages
flattened into one such array). `write_kv` stores N tokens' [HK, D] rows at physical
(page, slot) addresses. The Pallas kernel aliases both caches to its outputs
(`input_output_aliases`): XLA then updates the buffers it was given, so a step that writes a
token never holds a second cache-sized buffer, whatever it fuses around the write (a
scatter's in-place update is XLA's choice, and the multi-row one it may make out of place).
The reference is the same update as a scatter.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import common
from .common import pl, plgpu


def _write_kernel(pages_ref, slots_ref, k_new_ref, v_new_ref, k_in_ref, v_in_ref,
                  k_ref, v_ref, *, kv_heads: int, block_h: int, page_size: int, num_pages: int):
    """One token: its HK rows of K and V to rows (page * HK + h) * P + slot of the
    [num_pages * HK * P, D] views. A page outside [0, num_pages) drops the token."""
    del k_in_ref, v_in_ref   # aliased to k_ref / v_ref
    n = pl.program_id(0)
    page, slot = pages_ref[n], slots_ref[n]
    heads = jnp.arange(block_h)
    keep = (heads < kv_heads) & (page >= 0) & (page < num_pages)
    cols = jnp.arange(k_new_ref.shape[-1])
    rows = common.cache_row(jnp.where(keep, page, 0), heads, slot, kv_heads=kv_heads,
                            page_size=page_size)
    index = (rows[:, None], cols[None, :])
    src = (n, pl.ds(0, block_h), slice(None))
    mask = keep[:, None]
    plgpu.store(k_ref.at[index], plgpu.load(k_new_ref.at[src], mask=mask, other=0), mask=mask)
    plgpu.store(v_ref.at[index], plgpu.load(v_new_ref.at[src], mask=mask, other=0), mask=mask)


def _write_pallas(k_pages, v_pages, pages, slots, k, v, *, interpret: bool):
    num_pages, kv_heads, page_size, head_dim = k_pages.shape
    n = pages.shape[0]
    block_h = common.next_power_of_2(kv_heads)
    rows = (num_pages * kv_heads * page_size, head_dim)
    kernel = functools.partial(_write_kernel, kv_heads=kv_heads, block_h=block_h,
                               page_size=page_size, num_pages=num_pages)
    out = jax.ShapeDtypeStruct(rows, k_pages.dtype)
    k_rows, v_rows = common.pallas_call(
        kernel, grid=(n,), out_shape=[out, out],
        input_output_aliases={4: 0, 5: 1},
        compiler_params=common.triton_params(num_warps=1, num_stages=1),
        interpret=interpret, name="paged_cache_write",
    )(pages, slots, k, v, k_pages.reshape(rows), v_pages.reshape(rows))
    return k_rows.reshape(k_pages.shape), v_rows.reshape(v_pages.shape)


def write_kv_reference(k_pages, v_pages, pages, slots, k, v):
    """The same update as one scatter per cache (pages out of range dropped)."""
    k_pages = k_pages.at[pages, :, slots].set(k, mode="drop")
    v_pages = v_pages.at[pages, :, slots].set(v, mode="drop")
    return k_pages, v_pages


def write_kv(k_pages: jax.Array, v_pages: jax.Array, pages: jax.Array, slots: jax.Array,
             k: jax.Array, v: jax.Array, *, backend: str = "auto", interpret: bool | None = None):
    """Store tokens k, v [N, HK, D] at physical pages [N] and slots [N] of k_pages, v_pages
    [num_pages, HK, P, D] (a page >= num_pages drops its token). Returns the updated caches:
    with the Pallas kernel, the input buffers updated in place where the caller donates them
    (or inside one jit, where nothing reads the old cache after the write)."""
    num_pages, kv_heads, page_size, head_dim = k_pages.shape
    n = pages.shape[0]
    if v_pages.shape != k_pages.shape or v_pages.dtype != k_pages.dtype:
        raise ValueError(f"v_pages {v_pages.shape} {v_pages.dtype}: expected k_pages' "
                         f"{k_pages.shape} {k_pages.dtype}")
    if pages.shape != (n,) or slots.shape != (n,):
        raise ValueError(f"pages {pages.shape}, slots {slots.shape}: expected ({n},) each")
    for name, x in (("k", k), ("v", v)):
        if x.shape != (n, kv_heads, head_dim):
            raise ValueError(f"{name}.shape={x.shape}: expected ({n}, {kv_heads}, {head_dim})")
    k, v = k.astype(k_pages.dtype), v.astype(v_pages.dtype)
    pages, slots = pages.astype(jnp.int32), slots.astype(jnp.int32)
    unsupported = None
    if head_dim & (head_dim - 1) or page_size & (page_size - 1):
        unsupported = f"head_dim={head_dim}, page_size={page_size}: expected powers of 2"
    elif n == 0:
        unsupported = "no tokens to write"
    if common.choose_backend(backend, unsupported) == "reference":
        return write_kv_reference(k_pages, v_pages, pages, slots, k, v)
    return _write_pallas(k_pages, v_pages, pages, slots, k, v,
                         interpret=common.resolve_interpret(interpret))
