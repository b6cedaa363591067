"""What handling each V row's fp8 scale costs the dense decode kernel (GPU only).

    python benchmarks/probe_fp8_value_scales.py

Llama-8B heads (32 q / 8 KV, head_dim 128, pages of 16), B=64 x 32k, float16 queries, the
default knobs: the shipped kernel, then the same kernel with `common.online_softmax_step`
swapped at trace time for other ways to fold V's scales into the float16 V dot:
  logexp: the scale itself as a logit bias (log per key, exp per key for the mass);
  peak:   p * scale / the block's largest scale, the dot's result times it (a cross-thread
          max and a division per key each block);
  none:   p * scale cast straight to float16 (subnormal weights for small V rows, overflow
          for large ones: a timing bound, not a usable kernel).
GPU time per call (`harness.device_time_ms`: the kernel and merge_splits). Results:
results/fp8_value_scales.json (`_h100` etc. on other GPUs) and a copy in $OUT.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

import harness
from bench_decode_attention import make_paged
from bench_fp8 import to_fp8

from sparsejax.pallas_kernels import common
from sparsejax.pallas_kernels.decode_attention import paged_decode_attention

CFG = dict(batch=64, q_heads=32, kv_heads=8, head_dim=128, page_size=16)
CONTEXT = 32768
SHIPPED = common.online_softmax_step


def variant(kind: str):
    """An online softmax step folding V's scales the `kind` way (see the module docstring)."""
    def step(s, v, v_scale, acc, m, l, dot, *, base2, empty_rows):
        if v_scale is None:
            return SHIPPED(s, v, v_scale, acc, m, l, dot, base2=base2, empty_rows=empty_rows)
        exp, log = (jnp.exp2, jnp.log2) if base2 else (jnp.exp, jnp.log)
        if kind == "logexp":
            bias = jnp.maximum(log(v_scale), -27.0)
            s = s + bias[None, :]
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = exp(m - m_new)
        w = exp(s - m_new[:, None])
        peak = None
        if kind == "logexp":
            l = alpha * l + jnp.sum(w * exp(-bias)[None, :], axis=1)
        elif kind == "peak":
            l = alpha * l + jnp.sum(w, axis=1)
            peak = jnp.maximum(jnp.max(v_scale), 1e-30)
            w = w * (v_scale / peak)[None, :]
        else:
            l = alpha * l + jnp.sum(w, axis=1)
            w = w * v_scale[None, :]
        pv_dot = dot if peak is None else (lambda a, b: dot(a, b) * peak)
        return common.accumulate_values(acc, alpha, w, v, pv_dot), m_new, l
    return step


def main():
    q, k, v, page_table, lengths = make_paged(jax.random.key(1), tuple(sorted(CFG.items())),
                                              CONTEXT)
    cache = to_fp8(k, v)
    q = q.astype(jnp.float16)
    rows = []
    for kind in ("shipped", "logexp", "peak", "none"):
        jax.clear_caches()  # the kernel is traced anew with this step
        common.online_softmax_step = SHIPPED if kind == "shipped" else variant(kind)
        try:
            fn = jax.jit(lambda q, pt, ln, c: paged_decode_attention(
                q, page_table=pt, lengths=ln, **c).out)
            ms = harness.device_time_ms(fn, q, page_table, lengths, cache)
        finally:
            common.online_softmax_step = SHIPPED
        rows.append(harness.row(kind, context=CONTEXT, batch=CFG["batch"], ms=ms))
    harness.print_table(rows)
    harness.write_results(harness.per_gpu_name("fp8_value_scales"), rows, shape=CFG,
                          q_dtype="float16")


if __name__ == "__main__":
    main()
