"""Writing new tokens' K and V into the paged cache: one kernel for every array it touches.

    k_pages[pages[t], h, slots[t]] = k[t, h]      (and v; an fp8 cache also k_scale, v_scale)

for tokens t whose page is in range (a page >= num_pages, or negative, drops the token: how
callers mark invalid ones). An fp8 cache stores each (token, KV head) vector quantized with
its absmax scale (`common.quantize`). As four XLA scatters plus the quantize's own fusions,
a decode step paid up to five launches a layer for a few KiB of writes; the kernel updates
the pools in place (`input_output_aliases`) in one.

`rope_and_write` is the decode step's form: from the q/k/v projection's output it applies the
optional q/k RMSNorm and RoPE to the query and key heads, writes K and V, and returns the
queries in the attention's dtype, so that the split, the two RoPE fusions and the write of a
layer are one launch instead of four to six (its reference: the model's own
`decoder.split_qkv`, `position_heads` and `write_tokens_reference`).

Kernel: grid (tokens,). Each program loads its token's heads (padded to a power of 2 and
masked: a GQA model may have 3 KV heads), positions them, quantizes K and V for an fp8 cache
and stores every row into its page slot, through the cache viewed as rows
(`common.cache_row`), as the attention kernels read it. RoPE's rotate-half is a second load of
the same rows with the halves of head_dim swapped.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from sparsejax.models.decoder import position_heads, split_qkv
from sparsejax.pallas_kernels import common
from sparsejax.pallas_kernels.common import pl, plgpu


class _Fused(NamedTuple):
    """The static shape of `rope_and_write`'s prologue (None: `write_tokens`' plain write)."""
    num_heads: int
    qk_norm: bool
    eps: float
    return_kv: bool


def _write_kernel(pages_ref,   # [T] int32: each token's page (outside [0, num_pages): dropped)
                  slots_ref,   # [T] int32: its slot in the page
                  *refs,       # the tokens (below), the pools (and scales) as inputs, then the
                               # outputs: the pools aliased, then (fused) q and k, v
                  kv_heads: int, page_size: int, num_pages: int, quantized: bool,
                  fused: _Fused | None):
    # plain: k, v [T * HK, D]; fused: qkv [T * (HQ + 2 HK), D], cos, sin [T, D] f32, then
    # with q/k norm their weights [D]
    num_in = 2 if fused is None else 3 + 2 * fused.qk_norm
    num_pools = 4 if quantized else 2
    ins, outs = refs[:num_in], refs[num_in + num_pools:]
    pool_outs, extra_outs = outs[:num_pools], outs[num_pools:]
    t = pl.program_id(0)
    page, slot = pages_ref[t], slots_ref[t]
    in_range = (page >= 0) & (page < num_pages)
    heads = jnp.arange(common.next_power_of_2(kv_heads))
    keep = (heads < kv_heads) & in_range
    cols = jnp.arange(ins[0].shape[-1])[None, :]
    rows = common.cache_row(jnp.where(in_range, page, 0), heads, slot, kv_heads=kv_heads,
                            page_size=page_size)
    if fused is None:
        k, v = (plgpu.load(ref.at[t * kv_heads + heads[:, None], cols], mask=keep[:, None],
                           other=0.0) for ref in ins)
    else:
        k, v = _positioned(ins, extra_outs, t, kv_heads, fused)
    scale_outs = pool_outs[2:] if quantized else (None, None)
    for x, out_ref, scale_ref in zip((k, v), pool_outs[:2], scale_outs):
        if quantized:
            x, scale = common.quantize(x)
            plgpu.store(scale_ref.at[rows], scale, mask=keep)
        plgpu.store(out_ref.at[rows[:, None], cols], x.astype(out_ref.dtype),
                    mask=keep[:, None])


def _positioned(ins, outs, t, kv_heads: int, fused: _Fused):
    """Inside the kernel: token t's query, key and value heads from the q/k/v rows, q and k
    normed (q/k norm) and rotated as `decoder.position_heads` does; q stored to its output
    (and k, v to theirs with return_kv). -> (k, v) [HKp, D]."""
    qkv_ref, cos_ref, sin_ref = ins[:3]
    head_dim = qkv_ref.shape[-1]
    cols = jnp.arange(head_dim)
    half = head_dim // 2
    swapped = jnp.where(cols < half, cols + half, cols - half)  # rotate_half's source columns
    sign = jnp.where(cols < half, -1.0, 1.0)[None, :]
    cos, sin = (plgpu.load(ref.at[t, cols])[None, :] for ref in (cos_ref, sin_ref))
    stride = fused.num_heads + 2 * kv_heads
    dtype = qkv_ref.dtype

    def load(first, count, at_cols):
        heads = jnp.arange(common.next_power_of_2(count))
        live = (heads < count)[:, None]
        return plgpu.load(qkv_ref.at[t * stride + first + heads[:, None], at_cols], mask=live,
                          other=0.0)

    def rope(first, count, norm_ref):
        x, x_swapped = load(first, count, cols[None, :]), load(first, count, swapped[None, :])
        if norm_ref is not None:   # rms_norm: f32, cast back before the weight
            xf = x.astype(jnp.float32)
            r = jax.lax.rsqrt(jnp.mean(xf * xf, axis=1, keepdims=True) + fused.eps)
            x = plgpu.load(norm_ref.at[cols])[None, :] * (xf * r).astype(dtype)
            x_swapped = (plgpu.load(norm_ref.at[swapped])[None, :]
                         * (x_swapped.astype(jnp.float32) * r).astype(dtype))
        rotated = (sign * x_swapped.astype(jnp.float32)).astype(x.dtype)
        return (x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin).astype(x.dtype)

    norms = ins[3:] if fused.qk_norm else (None, None)
    q = rope(0, fused.num_heads, norms[0])
    k = rope(fused.num_heads, kv_heads, norms[1])
    v = load(fused.num_heads + kv_heads, kv_heads, cols[None, :])
    q_heads = jnp.arange(q.shape[0])[:, None]
    q_out = outs[0]
    plgpu.store(q_out.at[t * fused.num_heads + q_heads, cols[None, :]], q.astype(q_out.dtype),
                mask=q_heads < fused.num_heads)
    if fused.return_kv:
        kv_rows = jnp.arange(k.shape[0])[:, None]
        for x, ref in zip((k, v), outs[1:]):
            plgpu.store(ref.at[t * kv_heads + kv_rows, cols[None, :]], x,
                        mask=kv_rows < kv_heads)
    return k, v


def _check_inputs(k_pages, v_pages, k_scale, v_scale, pages, slots, k, v):
    common.check_kv_scales(k_pages, v_pages, k_scale, v_scale)
    if k_pages.ndim != 4 or v_pages.shape != k_pages.shape:
        raise ValueError(f"k_pages {list(k_pages.shape)}, v_pages {list(v_pages.shape)}: "
                         "expected both [num_pages, kv_heads, page_size, head_dim]")
    _, kv_heads, _, head_dim = k_pages.shape
    if pages.shape != slots.shape:
        raise ValueError(f"pages.shape={pages.shape}, slots.shape={slots.shape}: expected "
                         "the same shape")
    want = (*pages.shape, kv_heads, head_dim)
    for name, x in (("k", k), ("v", v)):
        if x.shape != want:
            raise ValueError(f"{name}.shape={x.shape}: expected {want} (pages' shape, then "
                             "the cache's kv_heads and head_dim)")


def _unsupported(k_pages) -> str | None:
    head_dim, itemsize = k_pages.shape[-1], jnp.dtype(k_pages.dtype).itemsize
    nbytes = k_pages.size * itemsize
    if common.wraps_offsets(nbytes, itemsize):
        return (f"k_pages {k_pages.dtype}{list(k_pages.shape)}: {nbytes} bytes, where "
                "Pallas-Triton's 32-bit offsets into a 1-byte array wrap")
    if head_dim not in common.HEAD_DIMS:
        return f"head_dim={head_dim}: expected one of {common.HEAD_DIMS}"
    page_size = k_pages.shape[2]
    if page_size & (page_size - 1):
        return f"page_size={page_size}: expected a power of 2"
    return None


def write_tokens(k_pages, v_pages, pages, slots, k, v, *, k_scale=None, v_scale=None,
                 backend="auto", interpret=None):
    """Tokens' keys and values written into the cache -> (k_pages, v_pages, k_scale, v_scale).

    k_pages, v_pages [num_pages, HK, P, D] (for an fp8 cache with k_scale, v_scale
    [num_pages, HK, P] f32, else None); pages, slots [...] int: each token's physical page and
    slot (a page outside [0, num_pages) drops the token); k, v [..., HK, D] in any float
    dtype, cast to the cache's or quantized (`common.quantize`). Where the caller donates or
    carries the pools (a jitted step) the Pallas path writes them in place; so do XLA's
    scatters."""
    _check_inputs(k_pages, v_pages, k_scale, v_scale, pages, slots, k, v)
    pages, slots = (x.reshape(-1).astype(jnp.int32) for x in (pages, slots))
    k, v = (x.reshape(-1, *x.shape[-2:]) for x in (k, v))
    if common.choose_backend(backend, _unsupported(k_pages)) == "reference":
        return write_tokens_reference(k_pages, v_pages, pages, slots, k, v, k_scale, v_scale)
    return _write_pallas(k_pages, v_pages, k_scale, v_scale, pages, slots, (k, v), fused=None,
                         q_dtype=None, interpret=common.resolve_interpret(interpret))[:4]


def rope_and_write(qkv, cos, sin, k_pages, v_pages, pages, slots, *, num_heads: int,
                   k_scale=None, v_scale=None, q_norm=None, k_norm=None, eps: float = 1e-6,
                   q_dtype=None, return_kv: bool = False, backend="auto", interpret=None):
    """One decode token per row from its q/k/v projection to the cache: split the heads, the
    optional q/k RMSNorm (`q_norm`, `k_norm` [D] weights, `eps`), RoPE, K and V written ->
    (q [B, HQ, D] in `q_dtype` (default qkv's), k_pages, v_pages, k_scale, v_scale, k, v):
    k, v [B, HK, D] the positioned keys and values as the model computed them (None unless
    `return_kv`).

    qkv [R, HQ + 2 HK, D] (HQ = `num_heads`, then the key heads, then the value heads; rows
    past the first B, such as a batch-1 step's padding row, are not read); cos, sin [B, D]
    f32 (`decoder.rope_angles` of the positions); pages, slots [B]; the cache as
    `write_tokens` takes it. The reference is the model's own code: `decoder.split_qkv`,
    `decoder.position_heads`, `write_tokens_reference`."""
    if qkv.ndim != 3 or (qkv.shape[1] - num_heads) % 2 or qkv.shape[1] <= num_heads:
        raise ValueError(f"qkv.shape={qkv.shape}: expected [batch, num_heads={num_heads} + "
                         "2 * kv_heads, head_dim]")
    if pages.ndim != 1 or qkv.shape[0] < pages.shape[0]:
        raise ValueError(f"qkv.shape={qkv.shape}, pages.shape={pages.shape}: expected pages "
                         "[batch] and qkv's first axis at least batch")
    batch = pages.shape[0]
    _, heads, head_dim = qkv.shape
    kv_heads = (heads - num_heads) // 2
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm: expected both (a model with q/k norm) or neither")
    for name, x in (("cos", cos), ("sin", sin)):
        if x.shape != (batch, head_dim):
            raise ValueError(f"{name}.shape={x.shape}: expected {(batch, head_dim)}")
    stored = jax.ShapeDtypeStruct((batch, k_pages.shape[1], head_dim), qkv.dtype)
    _check_inputs(k_pages, v_pages, k_scale, v_scale, pages, slots, stored, stored)
    q_dtype = qkv.dtype if q_dtype is None else jnp.dtype(q_dtype)
    unsupported = _unsupported(k_pages)
    if unsupported is None and k_pages.shape[1] != kv_heads:
        unsupported = (f"k_pages' {k_pages.shape[1]} KV heads: expected qkv's {kv_heads} "
                       "(a cache with replicated heads takes the reference)")
    pages, slots = (x.astype(jnp.int32) for x in (pages, slots))
    if common.choose_backend(backend, unsupported) == "reference":
        return rope_and_write_reference(qkv[:batch], cos, sin, k_pages, v_pages, pages, slots,
                                        num_heads, k_scale, v_scale, q_norm, k_norm, eps,
                                        q_dtype, return_kv)
    fused = _Fused(num_heads, q_norm is not None, float(eps), return_kv)
    norms = () if q_norm is None else (q_norm, k_norm)
    out = _write_pallas(k_pages, v_pages, k_scale, v_scale, pages, slots,
                        (qkv, cos.astype(jnp.float32), sin.astype(jnp.float32), *norms),
                        fused=fused, q_dtype=q_dtype,
                        interpret=common.resolve_interpret(interpret))
    q = out[4].reshape(batch, num_heads, head_dim)
    kv = [x.reshape(batch, kv_heads, head_dim) for x in out[5:]] if return_kv else [None] * 2
    return (q, *out[:4], *kv)


@functools.partial(jax.jit, static_argnames=("fused", "q_dtype", "interpret"))
def _write_pallas(k_pages, v_pages, k_scale, v_scale, pages, slots, tokens, *, fused, q_dtype,
                  interpret):
    """-> (k_pages, v_pages, k_scale, v_scale, then (fused) q rows [B * HQ, D] and with
    return_kv k, v rows [B * HK, D])."""
    num_pages, kv_heads, page_size, head_dim = k_pages.shape
    quantized = k_scale is not None
    pools = (k_pages, v_pages) + ((k_scale, v_scale) if quantized else ())
    flat = [x.reshape(-1, head_dim) for x in pools[:2]] + [x.reshape(-1) for x in pools[2:]]
    tokens = [x.reshape(-1, head_dim) if x.ndim == 3 else x for x in tokens]
    extra = []
    if fused is not None:
        rows = pages.shape[0]
        extra.append(jax.ShapeDtypeStruct((rows * fused.num_heads, head_dim), q_dtype))
        if fused.return_kv:
            extra += [jax.ShapeDtypeStruct((rows * kv_heads, head_dim), tokens[0].dtype)] * 2
    kernel = functools.partial(_write_kernel, kv_heads=kv_heads, page_size=page_size,
                               num_pages=num_pages, quantized=quantized, fused=fused)
    first_pool = 2 + len(tokens)
    written = common.pallas_call(
        kernel,
        grid=(pages.shape[0],),
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in flat] + extra,
        input_output_aliases={first_pool + i: i for i in range(len(flat))},
        compiler_params=common.triton_params(1 if fused is None else 2, 1),
        interpret=interpret,
        name="write_tokens" if fused is None else "rope_and_write",
    )(pages, slots, *tokens, *flat)
    pools = [x.reshape(pool.shape) for x, pool in zip(written, pools)]
    pools += [None, None] if not quantized else []
    return (*pools, *written[len(flat):])


def rope_and_write_reference(qkv, cos, sin, k_pages, v_pages, pages, slots, num_heads,
                             k_scale=None, v_scale=None, q_norm=None, k_norm=None,
                             eps: float = 1e-6, q_dtype=None, return_kv: bool = False):
    """Plain-jnp twin of `rope_and_write`: the model's own functions, then
    `write_tokens_reference` (a cache with more KV heads than qkv, replicated over
    tensor-parallel ranks, gets each head repeated in place)."""
    kv_heads = (qkv.shape[1] - num_heads) // 2
    config = _HeadsConfig(num_heads, kv_heads, q_norm is not None, eps)
    q, k, v = split_qkv(config, qkv)
    q, k = position_heads(config, {"q_norm": q_norm, "k_norm": k_norm}, q, k, cos, sin)
    stored_k, stored_v = (common.replicate_kv_heads(x, k_pages.shape[1], axis=1)
                          for x in (k, v))
    pools = write_tokens_reference(k_pages, v_pages, pages, slots, stored_k, stored_v,
                                   k_scale, v_scale)
    q = q.astype(qkv.dtype if q_dtype is None else q_dtype)
    return (q, *pools, *((k, v) if return_kv else (None, None)))


class _HeadsConfig(NamedTuple):
    """The fields of a ModelConfig that `split_qkv` and `position_heads` read."""
    num_heads: int
    num_kv_heads: int
    qk_norm: bool
    rms_norm_eps: float


@jax.jit
def write_tokens_reference(k_pages, v_pages, pages, slots, k, v, k_scale=None, v_scale=None):
    """Plain-jnp twin of `write_tokens` (flattened tokens: pages, slots [T], k, v [T, HK, D]):
    XLA scatters, in place where the pools are donated or carried."""
    at = (jnp.where(pages < 0, k_pages.shape[0], pages), slice(None), slots)
    if k_scale is None:
        return (k_pages.at[at].set(k.astype(k_pages.dtype), mode="drop"),
                v_pages.at[at].set(v.astype(v_pages.dtype), mode="drop"), None, None)
    (k8, ks), (v8, vs) = common.quantize(k), common.quantize(v)
    return (k_pages.at[at].set(k8, mode="drop"), v_pages.at[at].set(v8, mode="drop"),
            k_scale.at[at].set(ks, mode="drop"), v_scale.at[at].set(vs, mode="drop"))
