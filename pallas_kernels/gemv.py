"""A batch-1 projection as split-K partial sums: x [R <= 64, K] @ w [K, N] streamed by many
programs, optionally with the RMSNorm that feeds it done on the way in.

At batch 1 XLA's gemm of a small model's fused q/k/v weight (DS-R1-Distill-Qwen-1.5B's
[1536, 2048], 6.3 MB) runs ~8 us in the decode step, 6x its HBM floor: too few programs
stream the weight. Here one program per (block of N, slice of K) runs a short loop of
[M, block_k] x [block_k, block_n] tensor-core dots (R padded to M = 16, 32 or 64, the rows
past R masked to zero) and stores its f32 partial; the caller sums the slices (one small XLA
fusion, with the cast and a bias or the residual). Which projections take it is the caller's
rule (`layers.PARTIAL_QKV_MAX_BYTES`, `layers.PARTIAL_MLP_MAX_BYTES`, docs/tuning.md); at 64
rows it is no faster than XLA's gemm once the partials are summed (docs/tuning.md), so the
step runs it at batch 1 only.

norm=weight: the product is rms_norm(x, weight, eps) @ w. Every program finds its rows' RMS
over all of K once, then normalizes each slice it loads: the pre-norm q/k/v projection
without XLA's norm kernel before it. (A SwiGLU made the same way from gate|up partials in
the down projection's loop ran 2.7x slower than the plain kernel: docs/tuning.md.)

Reference: `projection_partials_reference`: the input from `decoder.rms_norm`, then the same
slices of K as jnp einsums.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from sparsejax.models.decoder import rms_norm
from sparsejax.pallas_kernels import common
from sparsejax.pallas_kernels.common import pl, plgpu

MAX_ROWS = 64   # rows of x: one [block_rows(R), block_k] tile of x per loop step
WAVES = 2       # the default split count aims at ~2 waves of programs (one per SM each)
MAX_NORM_ELEMENTS = 16384   # rows x K (padded to powers of 2) one program loads for the RMS


def default_tuning(rows: int, k: int, n: int) -> dict:
    """64 x 64 blocks, 4 warps, 4 stages, and the fewest K splits (a divisor of K's blocks)
    that give WAVES programs per SM; a power-of-2 split count would leave e.g. DS-Qwen's down
    projection (140 K blocks, 24 N blocks) at 4 splits, under one wave. From an H200 sweep of
    every tiling with 1-12 waves (docs/tuning.md)."""
    block_k = block_n = 64
    blocks_k, blocks_n = max(1, k // block_k), max(1, n // block_n)
    want = common.cdiv(WAVES * common.num_sms(), blocks_n)
    splits = next((d for d in range(1, blocks_k + 1) if blocks_k % d == 0 and d >= want),
                  blocks_k)
    return dict(block_k=block_k, block_n=block_n, splits=splits, num_warps=4, num_stages=4)


def block_rows(rows: int) -> int:
    """The dot's M: rows padded to a power of 2, at least the 16 a Triton dot takes."""
    return max(16, common.next_power_of_2(rows))


def unsupported(x, w, block_k: int = 64, block_n: int = 64, *, norm=None) -> str | None:
    """Why the kernel cannot take these operands, or None."""
    rows = x.shape[0]
    if rows > MAX_ROWS:
        return f"x.shape={x.shape}: expected at most {MAX_ROWS} rows"
    if w.shape[0] % block_k or w.shape[1] % block_n:
        return f"w.shape={w.shape}: expected multiples of ({block_k}, {block_n})"
    if w.dtype not in (jnp.bfloat16, jnp.float16):
        return f"w.dtype={w.dtype}: expected bfloat16 or float16"
    if norm is not None and (common.next_power_of_2(rows) * common.next_power_of_2(w.shape[0])
                             > MAX_NORM_ELEMENTS):
        return (f"x.shape={x.shape} with norm: a program loads {rows} rows of K={w.shape[0]} "
                f"for their RMS; expected at most {MAX_NORM_ELEMENTS} elements (padded)")
    return None


def _row_rms(x_ref, rows: int, k: int, eps: float):
    """1 / RMS of each of the dot's rows of x [rows, K] (rows past `rows`: any value): the
    [rows, K] block loaded once, padded to powers of 2, as `decoder.rms_norm` does in f32."""
    r, kp = common.next_power_of_2(rows), common.next_power_of_2(k)
    row, col = jnp.arange(r), jnp.arange(kp)
    x = plgpu.load(x_ref.at[row[:, None], col[None, :]],
                   mask=(row[:, None] < rows) & (col[None, :] < k), other=0.0)
    x = x.astype(jnp.float32)
    inv = lax.rsqrt(jnp.sum(x * x, axis=1) / k + eps)                                   # [r]
    dot_row = jnp.arange(block_rows(rows))
    return sum(jnp.where(dot_row == i, jnp.sum(jnp.where(row == i, inv, 0.0)), 0.0)
               for i in range(r))                                                      # [M]


def _kernel(x_ref, w_ref, *refs, rows: int, block_k: int, block_n: int, steps: int,
            eps: float, normed: bool):
    norm_ref, out_ref = refs if normed else (None, refs[0])
    n, s = pl.program_id(0), pl.program_id(1)
    cols = n * block_n + jnp.arange(block_n)
    row = jnp.arange(block_rows(rows))
    live = row < rows
    k = w_ref.shape[0]
    dtype = w_ref.dtype
    inv_rms = _row_rms(x_ref, rows, k, eps) if normed else None

    def inputs(ks):
        """The product's input rows at K columns ks: [M, block_k] in w's dtype."""
        x = plgpu.load(x_ref.at[row[:, None], ks[None, :]], mask=live[:, None], other=0.0)
        if normed:    # rms_norm: f32, cast back before the weight
            x = (x.astype(jnp.float32) * inv_rms[:, None]).astype(dtype)
            weight = plgpu.load(norm_ref.at[ks]).astype(jnp.float32)
            return (weight[None, :] * x.astype(jnp.float32)).astype(dtype)
        return x

    def step(i, acc):
        ks = (s * steps + i) * block_k + jnp.arange(block_k)
        w = plgpu.load(w_ref.at[ks[:, None], cols[None, :]])
        return acc + jnp.dot(inputs(ks), w, preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, steps, step, jnp.zeros((block_rows(rows), block_n), jnp.float32))
    plgpu.store(out_ref.at[s, row[:, None], cols[None, :]], acc, mask=live[:, None])


@functools.partial(jax.jit, static_argnames=("eps", "block_k", "block_n", "splits",
                                             "num_warps", "num_stages", "interpret"))
def _partials_pallas(x, w, norm, *, eps, block_k, block_n, splits, num_warps, num_stages,
                     interpret):
    rows, (k, n) = x.shape[0], w.shape
    return common.pallas_call(
        functools.partial(_kernel, rows=rows, block_k=block_k, block_n=block_n,
                          steps=k // block_k // splits, eps=eps, normed=norm is not None),
        grid=(n // block_n, splits),
        out_shape=jax.ShapeDtypeStruct((splits, rows, n), jnp.float32),
        compiler_params=common.triton_params(num_warps, num_stages),
        interpret=interpret, name="projection_partials")(
            x, w, *(() if norm is None else (norm,)))


@functools.partial(jax.jit, static_argnames=("splits", "eps"))
def projection_partials_reference(x, w, norm=None, *, splits: int, eps: float = 1e-6):
    """The kernel's partials in jnp: slice s of K's `splits` equal slices of x @ w (or
    `decoder.rms_norm(x, norm, eps)` @ w) in f32."""
    x = x if norm is None else rms_norm(x, norm, eps)
    (rows, k), n = x.shape, w.shape[1]
    xs = x.reshape(rows, splits, k // splits)
    ws = w.reshape(splits, k // splits, n)
    return jnp.einsum("rsk,skn->srn", xs, ws, preferred_element_type=jnp.float32)


def _check_operands(x, w, norm):
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"x.shape={x.shape}, w.shape={w.shape}: expected x [rows, K] and "
                         "w [K, N]")
    if w.dtype != x.dtype:
        raise ValueError(f"w.dtype={w.dtype}: expected x's dtype {x.dtype}")
    if norm is not None and (norm.shape != (w.shape[0],) or norm.dtype != x.dtype):
        raise ValueError(f"norm: shape={norm.shape} dtype={norm.dtype}: expected "
                         f"[{w.shape[0]}] {x.dtype} (an RMSNorm weight over K)")


def projection_partials(x, w, *, norm=None, eps: float = 1e-6, splits: int | None = None,
                        block_k: int | None = None, block_n: int | None = None,
                        num_warps: int | None = None, num_stages: int | None = None,
                        backend: str = "auto", interpret: bool | None = None) -> jax.Array:
    """x [R, K] (R <= 64; bf16 or f16) @ w [K, N] (x's dtype) as f32 partial sums over
    `splits` equal slices of K -> [splits, R, N]; their sum over axis 0 is the product.
    norm: [K] RMSNorm weight in x's dtype; the product is then rms_norm(x, norm, eps) @ w.
    Knobs None take `default_tuning`; a shape the kernel cannot take (`unsupported`) runs the
    reference under backend="auto" and raises under "pallas"."""
    _check_operands(x, w, norm)
    knobs = dict(default_tuning(x.shape[0], *w.shape))
    knobs.update({k: v for k, v in dict(splits=splits, block_k=block_k, block_n=block_n,
                                        num_warps=num_warps, num_stages=num_stages).items()
                  if v is not None})
    blocks_k = w.shape[0] // knobs["block_k"]
    if knobs["splits"] < 1 or (blocks_k and blocks_k % knobs["splits"]):
        raise ValueError(f"splits={knobs['splits']}: expected a divisor of K's "
                         f"{blocks_k} blocks of {knobs['block_k']}")
    why = unsupported(x, w, knobs["block_k"], knobs["block_n"], norm=norm)
    if common.choose_backend(backend, why) == "reference":
        if w.shape[0] % knobs["splits"]:
            raise ValueError(f"splits={knobs['splits']}: expected a divisor of K={w.shape[0]}")
        return projection_partials_reference(x, w, norm, splits=knobs["splits"], eps=float(eps))
    return _partials_pallas(x, w, norm, eps=float(eps),
                            interpret=common.resolve_interpret(interpret), **knobs)
