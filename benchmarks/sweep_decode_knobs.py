"""The dense paged decode kernel's static knobs swept at one model's attention shapes, per
(batch, context, cache dtype): what `default_tuning` picks against the best config found.

    python benchmarks/sweep_decode_knobs.py --model qwen-1.5b --batch 1 --contexts 4096 32768
    python benchmarks/sweep_decode_knobs.py --model llama-8b --batch 64 --contexts 32768 --kv-dtype fp8
    python benchmarks/sweep_decode_knobs.py --smoke      # tiny shapes, CPU interpret mode

--score sweeps a selecting layer's pass (DELTA's max_heads, Kascade's group_sum, ...;
--scores-only: the scores pass alone), and --pool-layers N puts the rows' pages at the end of
a pool of N layers' pages, as the decode step hands each layer the whole every-layer pool
(past 4 GiB Pallas-Triton indexes it with 64-bit offsets: `common.wide_offsets`).

Per cell: block_n x num_warps x num_stages at the default splits, then the split count (x1/4
.. x4) at the best of those. Every config is checked against the reference on the first rows
before it is timed (`harness.device_time_ms`: the kernel and merge_splits' GPU time, what the
step pays). `floor_ms` is the K/V bytes (fp8: with their f32 scales) over the device-to-device
copy bandwidth. Results: results/<--name>.json (rows per config, `default` marking
default_tuning's pick, `best` the fastest) and a copy in $OUT.
"""
from __future__ import annotations

import argparse
import gc
import itertools

import jax
import jax.numpy as jnp

import harness
import shapes
from bench_decode_attention import make_paged
from bench_decode_matrix import copy_bandwidth
from bench_fp8 import OUT_TOL, LSE_TOL, cache_bytes, errors, first_rows, to_fp8

from sparsejax.pallas_kernels import common
from sparsejax.pallas_kernels.common import Score
from sparsejax.pallas_kernels.decode_attention import (
    default_tuning, paged_decode_attention, paged_decode_attention_reference)

BLOCK_N = (32, 64, 128, 256)
WARPS = (2, 4, 8)
STAGES = (2, 3)
SPLIT_FACTORS = (0.25, 0.5, 2, 4)
KNOBS = ("block_n", "num_splits", "num_warps", "num_stages")
SCORE_TOL = 5e-3   # probabilities through float16 logits (`float16_logits_bound`)


def in_pool(k, v, page_table, layers: int):
    """The layer's pages as the last of `layers` layers of one pool (the others zeros), the
    page table offset to them, as `cache.layer_page_ids` offsets a layer's."""
    if layers == 1:
        return k, v, page_table
    offset = k.shape[0] * (layers - 1)
    pad = ((offset, 0),) + ((0, 0),) * (k.ndim - 1)
    pooled = [jnp.pad(x, pad) for x in (k, v)]
    k.delete()
    v.delete()
    return (*pooled, page_table + offset)


def score_error(got, want, score) -> float:
    """Max |difference| of the first rows' scores where the reference's are finite."""
    if score is None:
        return 0.0
    rows = want.scores.shape[0]
    g, w = got.scores[:rows], want.scores
    finite = jnp.isfinite(w)
    return round(float(jnp.max(jnp.where(finite, jnp.abs(g - w), 0.0))), 6)


def cell(model: str, batch: int, context: int, kv_dtype: str, q_dtype, smoke: bool,
         bandwidth: float, stages=STAGES, warps=WARPS, block_n=BLOCK_N,
         split_factors=SPLIT_FACTORS, score=None, values=True,
         pool_layers: int = 1) -> list[dict]:
    heads = shapes.MODELS[model]
    cfg = dict(batch=batch, q_heads=heads["num_heads"], kv_heads=heads["num_kv_heads"],
               head_dim=heads["head_dim"], page_size=16)
    q, k, v, page_table, lengths = make_paged(jax.random.key(context + batch),
                                              tuple(sorted(cfg.items())), context)
    q = q.astype(q_dtype)
    k, v, page_table = in_pool(k, v, page_table, pool_layers)
    cache = dict(k_pages=k, v_pages=v) if kv_dtype == "bf16" else to_fp8(k, v)
    rows = min(batch, 4)
    table, lens, small = first_rows(page_table, lengths, cache, rows)
    pass_ = dict(score=None if score is None else Score(score), values=values)
    want = jax.jit(lambda q, pt, ln, c: paged_decode_attention_reference(
        q, page_table=pt, lengths=ln, **c, **pass_))(q[:rows], table, lens, small)
    wide = common.wide_offsets(cache["k_pages"])
    base = default_tuning(batch, cfg["kv_heads"], cfg["head_dim"], cfg["page_size"],
                          context // cfg["page_size"], q.dtype, kv_dtype=cache["k_pages"].dtype,
                          wide_offsets=wide,
                          scores=score is not None, values=values)
    floor_ms = (cache_bytes(batch * context, cfg, kv_dtype) / (1 if values else 2)
                / bandwidth * 1e3)
    tried: dict[tuple, dict] = {}

    def measure(tuning):
        key = tuple(tuning[n] for n in KNOBS)
        if key in tried:
            return tried[key]
        entry = dict(tuning)
        try:
            fn = harness.compiled(lambda q, pt, ln, c: paged_decode_attention(
                q, page_table=pt, lengths=ln, **c, **pass_, backend="pallas",
                interpret=smoke, **tuning), q, page_table, lengths, cache)
            got = fn(q, page_table, lengths, cache)
            err = errors(got, want)
            err["score_err"] = score_error(got, want, score)
            entry.update(err)
            if (err["out_err"] <= OUT_TOL and err["lse_err"] <= LSE_TOL
                    and err["score_err"] <= SCORE_TOL):
                ms = (harness.time_ms(fn, q, page_table, lengths, cache, calls=1, repeats=1)
                      if smoke else harness.device_time_ms(fn, q, page_table, lengths, cache))
                entry.update(ms=round(ms, 4), ratio_to_floor=round(ms / floor_ms, 3))
        except Exception as e:  # a config that does not build must not end the sweep
            entry["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        tried[key] = entry
        print(f"  {model} B={batch} {context} {kv_dtype}: {entry}", flush=True)
        return entry

    default = measure(base)
    grid = [(BLOCK_N[:2], WARPS[1:2], STAGES[:1])] if smoke else [(block_n, warps, stages)]
    for bn, nw, ns in itertools.product(*grid[0]):
        measure({**base, "block_n": bn, "num_warps": nw, "num_stages": ns})
    timed = [e for e in tried.values() if "ms" in e]
    best = min(timed, key=lambda e: e["ms"]) if timed else base
    max_blocks = -(-context // best["block_n"])
    for f in split_factors[:1] if smoke else split_factors:
        splits = max(1, min(max_blocks, int(best["num_splits"] * f)))
        measure({**{n: best[n] for n in KNOBS}, "num_splits": splits})
    timed = [e for e in tried.values() if "ms" in e]
    best = min(timed, key=lambda e: e["ms"]) if timed else None
    for x in (*cache.values(), q):
        x.delete()
    gc.collect()
    out = []
    case = f"{model}/{kv_dtype}/q={jnp.dtype(q_dtype).name}"
    if score is not None:
        case += f"/{score}" + ("" if values else "/scores_only")
    for e in tried.values():
        out.append(harness.row(
            case, context=context, batch=batch, pool_layers=pool_layers,
            wide_offsets=wide,
            ms=e.get("ms"), floor=floor_ms, default=e is default, best=e is best,
            **{n: e[n] for n in KNOBS},
            **{n: e[n] for n in ("out_err", "lse_err", "score_err", "error") if n in e}))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama-8b", choices=sorted(shapes.MODELS))
    p.add_argument("--batch", type=int, nargs="+", default=[1])
    p.add_argument("--contexts", type=int, nargs="+", default=[32768])
    p.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="bf16")
    p.add_argument("--q-dtype", choices=("bfloat16", "float16"), default="bfloat16")
    p.add_argument("--stages", type=int, nargs="+", default=list(STAGES),
                   help=f"num_stages values swept (default {' '.join(map(str, STAGES))})")
    p.add_argument("--warps", type=int, nargs="+", default=list(WARPS),
                   help=f"num_warps values swept (default {' '.join(map(str, WARPS))})")
    p.add_argument("--block-n", type=int, nargs="+", default=list(BLOCK_N),
                   help=f"block_n values swept (default {' '.join(map(str, BLOCK_N))})")
    p.add_argument("--split-factors", type=float, nargs="+", default=list(SPLIT_FACTORS),
                   help="split counts tried at the best config, as multiples of its count "
                        f"(default {' '.join(map(str, SPLIT_FACTORS))})")
    p.add_argument("--score", choices=[s.value for s in list(Score)[:4]], default=None,
                   help="a selecting layer's pass: the kernel also writes these scores")
    p.add_argument("--scores-only", action="store_true",
                   help="with --score: the scores pass alone (V never read)")
    p.add_argument("--pool-layers", type=int, default=1,
                   help="the rows' pages sit at the end of a pool of this many layers")
    p.add_argument("--name", default="decode_knobs", help="results/<name>.json")
    p.add_argument("--smoke", action="store_true")
    a = p.parse_args()
    if a.smoke:
        a.model, a.batch, a.contexts = "tiny", [2], [256]
    bandwidth = 1e11 if a.smoke else copy_bandwidth()
    rows = []
    for batch, context in itertools.product(a.batch, a.contexts):
        rows += cell(a.model, batch, context, a.kv_dtype, jnp.dtype(a.q_dtype), a.smoke,
                     bandwidth, tuple(a.stages), tuple(a.warps), tuple(a.block_n),
                     tuple(a.split_factors), a.score, not a.scores_only, a.pool_layers)
    picked = [r for r in rows if r["default"] or r["best"]]
    harness.print_table(picked, cols=("case", "context", "batch", "pool_layers", *KNOBS, "ms",
                                      "floor_ms",
                                      "ratio_to_floor", "default", "best"))
    if not a.smoke:
        harness.write_results(harness.per_gpu_name(a.name), rows,
                              bandwidth_tb_s=round(bandwidth / 1e12, 3))


if __name__ == "__main__":
    main()
