"""A batch-1 projection as split-K partial sums: x [R <= 16, K] @ w [K, N] streamed by many
programs.

At batch 1 XLA's gemm of a small model's fused q/k/v weight (DS-R1-Distill-Qwen-1.5B's
[1536, 2048], 6.3 MB) runs ~8 us in the decode step, 6x its HBM floor: too few programs
stream the weight. Here one program per (block of N, slice of K) runs a short loop of
[16, block_k] x [block_k, block_n] tensor-core dots (the rows past R masked to zero) and
stores its f32 partial; the caller sums the slices (one small XLA fusion, with the cast and
a bias). Which projections take it is the caller's rule (`layers.PARTIAL_QKV_MAX_BYTES`,
docs/tuning.md).

Reference: `projection_partials_reference`, the same slices of K as jnp einsums.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from sparsejax.pallas_kernels import common
from sparsejax.pallas_kernels.common import pl, plgpu

MAX_ROWS = 16   # the rows one Triton dot takes; more rows are not a GEMV
WAVES = 2       # the default split count aims at ~2 waves of programs (one per SM each)


def default_tuning(rows: int, k: int, n: int) -> dict:
    """64 x 64 blocks, 4 warps, 4 stages, and as many K splits (a power of 2 dividing K's
    blocks) as give ~WAVES programs per SM (an H200 sweep of 12 tilings, docs/tuning.md)."""
    block_k = block_n = 64
    blocks_k, blocks_n = k // block_k, max(1, n // block_n)
    splits = min(blocks_k, common.next_power_of_2(common.cdiv(WAVES * common.num_sms(),
                                                              blocks_n)))
    while splits > 1 and blocks_k % splits:
        splits //= 2
    return dict(block_k=block_k, block_n=block_n, splits=max(1, splits), num_warps=4,
                num_stages=4)


def unsupported(x, w, block_k: int = 64, block_n: int = 64) -> str | None:
    """Why the kernel cannot take these operands, or None."""
    if x.shape[0] > MAX_ROWS:
        return f"x.shape={x.shape}: expected at most {MAX_ROWS} rows"
    if w.shape[0] % block_k or w.shape[1] % block_n:
        return f"w.shape={w.shape}: expected multiples of ({block_k}, {block_n})"
    if x.dtype not in (jnp.bfloat16, jnp.float16):
        return f"x.dtype={x.dtype}: expected bfloat16 or float16"
    return None


def _kernel(x_ref, w_ref, out_ref, *, rows: int, block_k: int, block_n: int, steps: int):
    n, s = pl.program_id(0), pl.program_id(1)
    cols = n * block_n + jnp.arange(block_n)
    row = jnp.arange(MAX_ROWS)
    live = row < rows

    def step(i, acc):
        ks = (s * steps + i) * block_k + jnp.arange(block_k)
        x = plgpu.load(x_ref.at[row[:, None], ks[None, :]], mask=live[:, None], other=0.0)
        w = plgpu.load(w_ref.at[ks[:, None], cols[None, :]])
        return acc + jnp.dot(x, w, preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, steps, step, jnp.zeros((MAX_ROWS, block_n), jnp.float32))
    plgpu.store(out_ref.at[s, row[:, None], cols[None, :]], acc, mask=live[:, None])


@functools.partial(jax.jit, static_argnames=("block_k", "block_n", "splits", "num_warps",
                                             "num_stages", "interpret"))
def _partials_pallas(x, w, *, block_k, block_n, splits, num_warps, num_stages, interpret):
    (rows, k), n = x.shape, w.shape[1]
    return common.pallas_call(
        functools.partial(_kernel, rows=rows, block_k=block_k, block_n=block_n,
                          steps=k // block_k // splits),
        grid=(n // block_n, splits),
        out_shape=jax.ShapeDtypeStruct((splits, rows, n), jnp.float32),
        compiler_params=common.triton_params(num_warps, num_stages),
        interpret=interpret, name="projection_partials")(x, w)


@functools.partial(jax.jit, static_argnames="splits")
def projection_partials_reference(x, w, *, splits: int):
    """The kernel's partials in jnp: slice s of K's `splits` equal slices, x @ w in f32."""
    (rows, k), n = x.shape, w.shape[1]
    xs = x.reshape(rows, splits, k // splits)
    ws = w.reshape(splits, k // splits, n)
    return jnp.einsum("rsk,skn->srn", xs, ws, preferred_element_type=jnp.float32)


def projection_partials(x, w, *, splits: int | None = None, block_k: int | None = None,
                        block_n: int | None = None, num_warps: int | None = None,
                        num_stages: int | None = None, backend: str = "auto",
                        interpret: bool | None = None) -> jax.Array:
    """x [R, K] (R <= 16; bf16 or f16) @ w [K, N] (x's dtype) as f32 partial sums over
    `splits` equal slices of K -> [splits, R, N]; their sum over axis 0 is the product.
    Knobs None take `default_tuning`; a shape the kernel cannot take (`unsupported`) runs the
    reference under backend="auto" and raises under "pallas"."""
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"x.shape={x.shape}, w.shape={w.shape}: expected x [rows, K] and "
                         "w [K, N]")
    if w.dtype != x.dtype:
        raise ValueError(f"w.dtype={w.dtype}: expected x's dtype {x.dtype}")
    knobs = dict(default_tuning(*x.shape, w.shape[1]))
    knobs.update({k: v for k, v in dict(splits=splits, block_k=block_k, block_n=block_n,
                                        num_warps=num_warps, num_stages=num_stages).items()
                  if v is not None})
    blocks_k = w.shape[0] // knobs["block_k"]
    if knobs["splits"] < 1 or (blocks_k and blocks_k % knobs["splits"]):
        raise ValueError(f"splits={knobs['splits']}: expected a divisor of K's "
                         f"{blocks_k} blocks of {knobs['block_k']}")
    why = unsupported(x, w, knobs["block_k"], knobs["block_n"])
    if common.choose_backend(backend, why) == "reference":
        if w.shape[0] % knobs["splits"]:
            raise ValueError(f"splits={knobs['splits']}: expected a divisor of K={w.shape[0]}")
        return projection_partials_reference(x, w, splits=knobs["splits"])
    return _partials_pallas(x, w, interpret=common.resolve_interpret(interpret), **knobs)
