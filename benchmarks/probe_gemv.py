"""What a batch-1 projection costs: XLA's gemm of two rows against a Pallas split-K GEMV (GPU
only): timing bounds for a kernel the step does not use.

    python benchmarks/probe_gemv.py            # XLA and the Pallas sweep
    XLA_ONLY=1 python benchmarks/probe_gemv.py # XLA alone (e.g. under other XLA_FLAGS)

DS-Qwen-1.5B's and Llama-8B's q|k|v, o, gate|up and down weights [K, N] in bf16, as many
copies of each as make ~400 MB (past the 50 MB L2, so every weight streams from HBM), one
jitted call running the projection on every copy; GPU time per projection
(`harness.device_time_ms` / copies) against the weight's bytes at 4.8 TB/s.
  xla:    einsum of x [2, K] (a batch of one as `decoder._dot` sends it), f32 accumulation,
          cast to bf16;
  pallas: one program per (block of N, split of K), a fori_loop of [16, block_k] x
          [block_k, block_n] tensor-core dots (x padded to 16 rows), f32 partials
          [splits, 16, N]; `us_kernel` the kernel alone, `us_with_sum` with XLA's sum of the
          splits and cast. Splits: enough programs for ~2 waves, dividing K's blocks.
Results: results/gemv_probe.json (TAG in the name when set) and a copy in $OUT.
"""
from __future__ import annotations

import functools
import itertools
import os

import jax
import jax.numpy as jnp
from jax import lax

import harness

from sparsejax.pallas_kernels import common
from sparsejax.pallas_kernels.common import pl, plgpu

SHAPES = {"qwen/qkv": (1536, 2048), "qwen/o": (1536, 1536), "qwen/gate_up": (1536, 17920),
          "qwen/down": (8960, 1536), "llama/qkv": (4096, 6144), "llama/o": (4096, 4096),
          "llama/gate_up": (4096, 28672), "llama/down": (14336, 4096)}


def _kernel(x_ref, w_ref, o_ref, *, block_k, block_n, steps):
    n, s = pl.program_id(0), pl.program_id(1)
    cols = n * block_n + jnp.arange(block_n)
    rows = jnp.arange(16)

    def body(i, acc):
        ks = (s * steps + i) * block_k + jnp.arange(block_k)
        x = plgpu.load(x_ref.at[rows[:, None], ks[None, :]])
        w = plgpu.load(w_ref.at[ks[:, None], cols[None, :]])
        return acc + jnp.dot(x, w, preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, steps, body, jnp.zeros((16, block_n), jnp.float32))
    plgpu.store(o_ref.at[s, rows[:, None], cols[None, :]], acc)


def gemv(x16, w, *, block_k, block_n, splits, warps, stages):
    """x16 [16, K] @ w [K, N] -> f32 partials [splits, 16, N]."""
    K, N = w.shape
    steps = K // block_k // splits
    return common.pallas_call(
        functools.partial(_kernel, block_k=block_k, block_n=block_n, steps=steps),
        grid=(N // block_n, splits),
        out_shape=jax.ShapeDtypeStruct((splits, 16, N), jnp.float32),
        compiler_params=common.triton_params(warps, stages),
        interpret=not common.on_gpu(), name="gemv")(x16, w)


def main():
    rows = []
    for name, (K, N) in SHAPES.items():
        copies = max(2, -(-400_000_000 // (K * N * 2)))
        ws = [jax.random.normal(jax.random.key(i), (K, N), jnp.bfloat16) for i in range(copies)]
        x = jax.random.normal(jax.random.key(99), (2, K), jnp.bfloat16)
        x16 = jnp.pad(x, ((0, 14), (0, 0)))
        floor_us = K * N * 2 / 4.8e12 * 1e6
        xla = jax.jit(lambda x, ws: [jnp.einsum("mk,kn->mn", x, w, preferred_element_type=jnp.float32
                                                ).astype(x.dtype) for w in ws])
        t = harness.device_time_ms(xla, x, ws) * 1e3 / copies
        want = xla(x, ws[:1])[0]
        rows.append(dict(shape=name, impl="xla", us=round(t, 2), floor_us=round(floor_us, 2)))
        print(name, "xla", round(t, 2), "floor", round(floor_us, 2), flush=True)
        sweep = [] if os.environ.get("XLA_ONLY") else itertools.product(
            (64, 128), (64, 128, 256), (4,), (3, 4))
        for block_n, block_k, warps, stages in sweep:
            if N % block_n or K % block_k:
                continue
            splits = max(1, min(K // block_k, common.next_power_of_2(-(-264 // (N // block_n)))))
            while (K // block_k) % splits:
                splits //= 2
            cfg = dict(block_k=block_k, block_n=block_n, splits=splits, warps=warps,
                       stages=stages)
            summed = jax.jit(lambda x16, ws, cfg=cfg: [
                jnp.sum(gemv(x16, w, **cfg), 0)[:2].astype(jnp.bfloat16) for w in ws])
            alone = jax.jit(lambda x16, ws, cfg=cfg: [gemv(x16, w, **cfg) for w in ws])
            got = summed(x16, ws[:1])[0]
            err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
            r = dict(shape=name, impl="pallas", **cfg,
                     us_kernel=round(harness.device_time_ms(alone, x16, ws) * 1e3 / copies, 2),
                     us_with_sum=round(harness.device_time_ms(summed, x16, ws) * 1e3 / copies, 2),
                     floor_us=round(floor_us, 2), max_abs_diff_vs_xla=err)
            rows.append(r)
            print(r, flush=True)
        del ws
    harness.write_results("gemv_probe" + os.environ.get("TAG", ""), rows,
                          xla_flags=os.environ.get("XLA_FLAGS", ""))


if __name__ == "__main__":
    main()
