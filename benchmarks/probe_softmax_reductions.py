"""What the online softmax's per-block row reductions cost the dense decode kernel on an fp8
cache (GPU only): timing bounds, not usable kernels.

    python benchmarks/probe_softmax_reductions.py

Llama-8B heads (32 q / 8 KV, head_dim 128, pages of 16), float16 queries, B=64 x 32k and
B=1 x 128k: the shipped kernel, then the same kernel with `common.online_softmax_step`
swapped at trace time for one that skips a row reduction:
  nosum: the running sum without the row sum of the block's weights;
  nomax: a fixed shift instead of the row max;
  nored: neither.
At the default knobs of the time (2 warps, 64-token blocks) and at 1 warp with 16-64-token
blocks: with 2 warps a row of the [16, block_n] logits spans both warps, and its max and
sum meet in shared memory every block. GPU time per call (`harness.device_time_ms`).
Results: results/softmax_reductions.json (`_h100` etc. on other GPUs) and a copy in $OUT.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

import harness
from bench_decode_attention import make_paged
from bench_fp8 import to_fp8

from sparsejax.pallas_kernels import common
from sparsejax.pallas_kernels.decode_attention import default_tuning, paged_decode_attention

SHIPPED = common.online_softmax_step
HEADS = dict(q_heads=32, kv_heads=8, head_dim=128, page_size=16)
CELLS = ((64, 32768), (1, 131072))
CONFIGS = ((2, 64), (1, 16), (1, 32), (1, 64))   # (num_warps, block_n)


def variant(kind: str):
    """The shipped step on an fp8 V tile without the row sum, the row max or both."""
    def step(s, v, v_scale, acc, m, l, dot, *, base2, empty_rows):
        exp = jnp.exp2 if base2 else jnp.exp
        e, inv_pow2 = common._power_of_2_below(v_scale)
        s = s + (e if base2 else e * common.LN2)[None, :]
        m_new = (jnp.zeros_like(m) + 4.0 if kind in ("nomax", "nored")
                 else jnp.maximum(m, jnp.max(s, axis=1)))
        alpha = exp(m - m_new)
        w = exp(s - m_new[:, None])
        l = alpha * l + (1.0 if kind in ("nosum", "nored")
                         else jnp.sum(w * inv_pow2[None, :], axis=1))
        w = w * (v_scale * inv_pow2)[None, :]
        return common.accumulate_values(acc, alpha, w, v, dot), m_new, l
    return step


def main():
    rows = []
    for batch, context in CELLS:
        cfg = dict(batch=batch, **HEADS)
        q, k, v, page_table, lengths = make_paged(jax.random.key(1), tuple(sorted(cfg.items())),
                                                  context)
        cache = to_fp8(k, v)
        del k, v
        q = q.astype(jnp.float16)
        base = default_tuning(batch, HEADS["kv_heads"], HEADS["head_dim"], HEADS["page_size"],
                              context // HEADS["page_size"], q.dtype,
                              kv_dtype=cache["k_pages"].dtype)
        for num_warps, block_n in CONFIGS:
            tuning = {**base, "num_warps": num_warps, "block_n": block_n}
            for kind in ("shipped", "nosum", "nomax", "nored"):
                jax.clear_caches()  # the kernel is traced anew with this step
                common.online_softmax_step = SHIPPED if kind == "shipped" else variant(kind)
                try:
                    fn = jax.jit(lambda q, pt, ln, c: paged_decode_attention(
                        q, page_table=pt, lengths=ln, **c, backend="pallas", **tuning).out)
                    ms = harness.device_time_ms(fn, q, page_table, lengths, cache)
                finally:
                    common.online_softmax_step = SHIPPED
                rows.append(harness.row(kind, context=context, batch=batch, ms=ms, **tuning))
                print(rows[-1], flush=True)
        for x in (*cache.values(), q):
            x.delete()
    harness.print_table(rows, cols=("case", "context", "batch", "num_warps", "block_n", "ms"))
    harness.write_results(harness.per_gpu_name("softmax_reductions"), rows, q_dtype="float16")


if __name__ == "__main__":
    main()
