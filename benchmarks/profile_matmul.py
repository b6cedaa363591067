"""The decode step's matmuls alone, at batch 1..64: GPU time and achieved bandwidth per form.

    python benchmarks/profile_matmul.py          # GPU

Compares, for Llama-3.1-8B and DS-Qwen-1.5B layer shapes: separate q/k/v projections against
one fused [H, (HQ + 2 HK) D] projection, separate gate/up against one fused [H, 2 I], the
output projection contracting (heads, head_dim) against a flat [HQ D, H] weight, and the LM
head with f32 accumulation output against bf16 output cast to f32.
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp

import harness
import shapes as S


def bench(name, fn, args, weight_bytes, rows):
    ms = harness.device_time_ms(jax.jit(fn), *args, calls=20)
    gbs = weight_bytes / ms / 1e6
    rows.append(dict(case=name, ms=round(ms, 4), weight_gb=round(weight_bytes / 1e9, 4),
                     tb_per_s=round(gbs / 1e3, 3)))
    print(f"{name:48s} {ms:8.4f} ms  {gbs / 1e3:6.3f} TB/s", flush=True)


def main():
    rows = []
    key = jax.random.key(0)
    bf = jnp.bfloat16
    for model_name in ("llama-8b", "qwen-1.5b"):
        c = S.config(model_name)
        H, HQ, HK, D, I, V = (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                              c.intermediate_size, c.vocab_size)
        ks = jax.random.split(key, 8)
        wq = jax.random.normal(ks[0], (H, HQ, D), bf)
        wk = jax.random.normal(ks[1], (H, HK, D), bf)
        wv = jax.random.normal(ks[2], (H, HK, D), bf)
        wqkv = jnp.concatenate([wq, wk, wv], axis=1)
        wo = jax.random.normal(ks[3], (HQ, D, H), bf)
        wg = jax.random.normal(ks[4], (H, I), bf)
        wu = jax.random.normal(ks[5], (H, I), bf)
        wgu = jnp.stack([wg, wu], axis=1)
        lm = jax.random.normal(ks[6], (H, V), bf)
        dot = lambda s, x, w: jnp.einsum(s, x, w, preferred_element_type=jnp.float32).astype(bf)  # noqa: E731
        for B in (1, 4, 16, 64):
            x = jax.random.normal(ks[7], (B, H), bf)
            a = jax.random.normal(ks[7], (B, HQ, D), bf)
            tag = f"{model_name} B={B}"
            bench(f"{tag} qkv separate", lambda x, a, b, c: (dot("bh,hnd->bnd", x, a),
                  dot("bh,hnd->bnd", x, b), dot("bh,hnd->bnd", x, c)), (x, wq, wk, wv),
                  wqkv.nbytes, rows)
            bench(f"{tag} qkv fused", lambda x, w: dot("bh,hnd->bnd", x, w), (x, wqkv),
                  wqkv.nbytes, rows)
            bench(f"{tag} o (n,d)", lambda a, w: dot("bnd,ndh->bh", a, w), (a, wo), wo.nbytes,
                  rows)
            bench(f"{tag} o flat", lambda a, w: dot("bk,kh->bh", a.reshape(B, -1),
                  w.reshape(-1, H)), (a, wo), wo.nbytes, rows)
            bench(f"{tag} gate/up separate", lambda x, g, u: jax.nn.silu(dot("bh,hi->bi", x, g))
                  * dot("bh,hi->bi", x, u), (x, wg, wu), wgu.nbytes, rows)
            bench(f"{tag} gate/up fused", lambda x, w: (lambda gu: jax.nn.silu(gu[:, 0]) * gu[:, 1])(
                dot("bh,hti->bti", x, w)), (x, wgu), wgu.nbytes, rows)
            bench(f"{tag} lm_head f32 out", lambda x, w: jnp.einsum(
                "bh,hv->bv", x, w, preferred_element_type=jnp.float32), (x, lm), lm.nbytes, rows)
            bench(f"{tag} lm_head bf16 out", lambda x, w: jnp.einsum(
                "bh,hv->bv", x, w).astype(jnp.float32), (x, lm), lm.nbytes, rows)
        del wq, wk, wv, wqkv, wo, wg, wu, wgu, lm
    harness.write_results("profile_matmul", [dict(r, context=None, batch=None) for r in rows])


if __name__ == "__main__":
    sys.exit(main())
