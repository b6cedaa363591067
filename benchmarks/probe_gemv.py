"""What a batch-1 projection costs: XLA's gemm of two rows against the Pallas split-K GEMV
(`pallas_kernels.gemv.projection_partials`; GPU only), per projection shape and tiling. The
step uses the kernel for DS-Qwen-sized weights (`layers.PARTIAL_QKV_MAX_BYTES`,
`layers.PARTIAL_MLP_MAX_BYTES`).

    python benchmarks/probe_gemv.py            # XLA and the Pallas sweep
    XLA_ONLY=1 python benchmarks/probe_gemv.py # XLA alone (e.g. under other XLA_FLAGS)

DS-Qwen-1.5B's and Llama-8B's q|k|v, o, gate|up and down weights [K, N] in bf16, as many
copies of each as make ~400 MB (past the 50 MB L2, so every weight streams from HBM), one
jitted call running the projection on every copy; GPU time per projection
(`harness.device_time_ms` / copies) against the weight's bytes at 4.8 TB/s.
  xla:    einsum of x [2, K] (a batch of one as `decoder._dot` sends it), f32 accumulation,
          cast to bf16;
  pallas: one program per (block of N, split of K), a fori_loop of [16, block_k] x
          [block_k, block_n] tensor-core dots (x's 2 rows masked to 16), f32 partials
          [splits, 2, N]; `us_kernel` the kernel alone over `tilings` (every split of K's
          blocks giving 1-12 waves), `us_with_sum` with XLA's sum of the splits and cast for
          the BEST fastest.
    SHAPES=qwen/o,qwen/down limits the shapes; ROWS=64 gives x 64 rows (a batch of 64; the
    kernel's tile then has 64 rows); WARPS_STAGES=4x4,8x3 sets the warps x stages tried.
          (Results before 2026-11-29 came from a copy of the kernel that padded x to 16
          rows in XLA instead of masking them.)
Results: results/gemv_probe.json (TAG in the name when set) and a copy in $OUT.
"""
from __future__ import annotations

import itertools
import os

import jax
import jax.numpy as jnp

import harness

from sparsejax.pallas_kernels import common
from sparsejax.pallas_kernels.gemv import projection_partials

SHAPES = {"qwen/qkv": (1536, 2048), "qwen/o": (1536, 1536), "qwen/gate_up": (1536, 17920),
          "qwen/down": (8960, 1536), "llama/qkv": (4096, 6144), "llama/o": (4096, 4096),
          "llama/gate_up": (4096, 28672), "llama/down": (14336, 4096)}


BEST = 3   # tilings per shape also timed with XLA's sum of the partials
ROWS = int(os.environ.get("ROWS", 2))   # x's rows: 2 (a batch of one as the step runs it)
WARPS_STAGES = tuple(tuple(map(int, ws.split("x"))) for ws in
                     os.environ.get("WARPS_STAGES", "4x3,4x4").split(","))


def gemv(x, w, *, block_k, block_n, splits, warps, stages):
    """x [2, K] @ w [K, N] -> f32 partials [splits, 2, N] (`gemv.projection_partials`)."""
    return projection_partials(x, w, block_k=block_k, block_n=block_n, splits=splits,
                               num_warps=warps, num_stages=stages, backend="pallas")


def tilings(K: int, N: int, sms: int):
    """(block_n, block_k, splits, warps, stages) to try: 64- and 128-wide blocks, and every
    split of K's blocks (not only powers of 2) that gives one to twelve waves of programs,
    since a grid a fraction of a wave past a multiple of the SMs leaves most of them idle for
    its last programs."""
    for block_n, block_k in itertools.product((64, 128), (64, 128)):
        if N % block_n or K % block_k:
            continue
        blocks_k = K // block_k
        for splits in (d for d in range(1, blocks_k + 1) if blocks_k % d == 0):
            waves = N // block_n * splits / sms
            if splits > 1 and not 0.9 <= waves <= 12:
                continue
            for warps, stages in WARPS_STAGES:
                yield block_n, block_k, splits, warps, stages


def main():
    rows = []
    only = os.environ.get("SHAPES")
    for name, (K, N) in SHAPES.items():
        if only and name not in only.split(","):
            continue
        copies = max(2, -(-400_000_000 // (K * N * 2)))
        ws = [jax.random.normal(jax.random.key(i), (K, N), jnp.bfloat16) for i in range(copies)]
        x = jax.random.normal(jax.random.key(99), (ROWS, K), jnp.bfloat16)
        floor_us = K * N * 2 / 4.8e12 * 1e6
        xla = jax.jit(lambda x, ws: [jnp.einsum("mk,kn->mn", x, w, preferred_element_type=jnp.float32
                                                ).astype(x.dtype) for w in ws])
        t = harness.device_time_ms(xla, x, ws) * 1e3 / copies
        want = xla(x, ws[:1])[0]
        rows.append(dict(shape=name, impl="xla", us=round(t, 2), floor_us=round(floor_us, 2)))
        print(name, "xla", round(t, 2), "floor", round(floor_us, 2), flush=True)
        sweep = [] if os.environ.get("XLA_ONLY") else tilings(K, N, common.num_sms())
        tried = []
        for block_n, block_k, splits, warps, stages in sweep:
            cfg = dict(block_k=block_k, block_n=block_n, splits=splits, warps=warps,
                       stages=stages)
            alone = jax.jit(lambda x, ws, cfg=cfg: [gemv(x, w, **cfg) for w in ws])
            tried.append((harness.device_time_ms(alone, x, ws) * 1e3 / copies, cfg))
            print(name, cfg, round(tried[-1][0], 2), flush=True)
        for us_kernel, cfg in sorted(tried, key=lambda t: t[0])[:BEST]:
            summed = jax.jit(lambda x, ws, cfg=cfg: [
                jnp.sum(gemv(x, w, **cfg), 0).astype(jnp.bfloat16) for w in ws])
            got = summed(x, ws[:1])[0]
            err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
            r = dict(shape=name, impl="pallas", **cfg, us_kernel=round(us_kernel, 2),
                     us_with_sum=round(harness.device_time_ms(summed, x, ws) * 1e3 / copies, 2),
                     floor_us=round(floor_us, 2), max_abs_diff_vs_xla=err)
            rows.append(r)
            print(r, flush=True)
        rows.append(dict(shape=name, impl="pallas_sweep", tried=[
            dict(cfg, us_kernel=round(t, 2)) for t, cfg in tried]))
        del ws
    harness.write_results("gemv_probe" + os.environ.get("TAG", ""), rows, x_rows=ROWS,
                          xla_flags=os.environ.get("XLA_FLAGS", ""))


if __name__ == "__main__":
    main()
