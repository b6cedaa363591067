"""topk_select (Pallas radix select) vs lax.top_k on one GPU.

    python benchmarks/bench_topk.py          # GPU: exactness, timings, sweep -> results/topk.json
    python benchmarks/bench_topk.py --smoke  # CPU: tiny shapes in interpret mode, nothing written

Every configuration is first checked for exact equality with `topk_select_reference` (indices
and counts); any difference aborts the run. `ms` is the default configuration, `best_ms` the
fastest one the sweep found; every configuration tried is listed under "sweep".
"""
from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import harness
from sparsejax.pallas_kernels import topk

# (case, rows, N, k, target_ms, forced, sweep): forced = force_first=4, force_last=64 (k/2 at
# most) and a per-row k_row in [k/2, k]; sweep = tuning tried besides the default.
CASES = [
    ("512x32768 k=3276", 512, 32768, 3276, 0.30, False,
     [dict(num_warps=8), dict(block_n=16384, num_warps=8), dict(block_n=8192, num_warps=8),
      dict(block_sel=8192)]),
    ("512x32768 k=3276 forced+k_row", 512, 32768, 3276, None, True, []),
    ("512x131072 k=13107", 512, 131072, 13107, None, False,
     [dict(block_n=16384, num_warps=8), dict(block_n=32768, num_stages=2)]),
    ("512x2048 k=64", 512, 2048, 64, 0.05, False,
     [dict(num_warps=8), dict(block_rows=2), dict(block_rows=4, num_warps=8)]),
    ("64x8192 k=64", 64, 8192, 64, 0.05, False,
     [dict(num_warps=4), dict(num_warps=16), dict(block_sel=8192)]),
]
SMOKE_CASES = [
    ("8x256 k=26", 8, 256, 26, None, False, [dict(block_n=64, block_sel=32)]),
    ("8x256 k=26 forced+k_row", 8, 256, 26, None, True, []),
    ("4x1000 k=64", 4, 1000, 64, None, False, [dict(block_n=128, block_rows=2)]),
]
SWEEP_BUDGET_S = 120  # later sweep configurations are skipped (and listed as such) after this


def make_inputs(num_rows, n, k, forced):
    key_scores, key_budget = jax.random.split(jax.random.key(0))
    scores = jax.random.normal(key_scores, (num_rows, n), jnp.float32)
    valid = jnp.full((num_rows,), n, jnp.int32)
    k_row = (jax.random.randint(key_budget, (num_rows,), k // 2, k + 1, jnp.int32) if forced
             else jnp.full((num_rows,), k, jnp.int32))
    options = dict(force_first=4, force_last=min(64, k // 2)) if forced else {}
    return scores, valid, k_row, options


def check_exact(case, tuning, out, ref):
    for name, got, want in (("indices", out.indices, ref.indices), ("count", out.count, ref.count)):
        got, want = np.asarray(got), np.asarray(want)
        if not np.array_equal(got, want):
            bad = tuple(int(i) for i in np.argwhere(got != want)[0])
            sys.exit(f"\n*** NOT EXACT: {case} {tuning or 'default'}: {name} differs from the "
                     f"reference first at {bad}: {got[bad]} != {want[bad]}")


def timed(fn, *args, smoke):
    if smoke:
        return harness.time_ms(fn, *args, calls=1, repeats=1, warmup=1)
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    once = (time.perf_counter() - t0) * 1e3
    return harness.time_ms(fn, *args, calls=int(np.clip(20 / max(once, 1e-3), 10, 500)))


def run_case(case, num_rows, n, k, target, forced, sweep, *, smoke, started):
    scores, valid, k_row, options = make_inputs(num_rows, n, k, forced)
    ref = jax.jit(lambda s, v, kr: topk.topk_select_reference(s, k, valid=v, k_row=kr, **options))(
        scores, valid, k_row)

    def pallas(tuning):
        fn = harness.compiled(lambda s, v, kr: topk.topk_select(
            s, k, valid=v, k_row=kr, backend="pallas", **options, **tuning), scores, valid, k_row)
        check_exact(case, tuning, fn(scores, valid, k_row), ref)
        return timed(fn, scores, valid, k_row, smoke=smoke)

    tried = []
    for tuning in [{}, *sweep]:
        entry = {"case": case, "tuning": tuning or "default"}
        if tuning and time.perf_counter() - started > SWEEP_BUDGET_S:
            tried.append({**entry, "skipped": "time budget"})
            continue
        try:
            tried.append({**entry, "ms": round(pallas(tuning), 4)})
        except Exception as err:  # a configuration Triton rejects (e.g. out of registers)
            tried.append({**entry, "error": f"{type(err).__name__}: {err}"[:500]})
            print(f"*** {case} {entry['tuning']} failed: {tried[-1]['error']}", flush=True)
    ran = [t for t in tried if "ms" in t]
    if not ran:
        sys.exit(f"\n*** no configuration ran for {case}")
    best = min(ran, key=lambda t: t["ms"])
    default_ms = tried[0].get("ms", best["ms"])  # the default's error stays in the row

    peer = harness.compiled(lambda s: jax.lax.top_k(s, k), scores)
    peer_ms = timed(peer, scores, smoke=smoke)
    floor = harness.floor_ms(num_rows * n * 4 + num_rows * k * 4)
    row = harness.row(case, context=n, batch=num_rows, ms=default_ms, floor=floor,
                      peer="lax.top_k", peer_ms=peer_ms, k=k, target_ms=target,
                      meets_target=None if target is None else default_ms <= target,
                      best_ms=best["ms"], best_tuning=best["tuning"],
                      default_error=tried[0].get("error"), **options)
    return row, tried


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, CPU interpret mode")
    args = parser.parse_args()
    if not args.smoke and jax.default_backend() != "gpu":
        sys.exit("bench_topk needs a GPU (or --smoke for a CPU logic check)")
    started = time.perf_counter()
    rows, tried = [], []
    for spec in SMOKE_CASES if args.smoke else CASES:
        row, case_tried = run_case(*spec, smoke=args.smoke, started=started)
        rows.append(row)
        tried += case_tried
        print(f"{row['case']}: {row['ms']} ms (best {row['best_ms']}), "
              f"lax.top_k {row['peer_ms']} ms", flush=True)
    harness.print_table(rows, cols=("case", "batch", "context", "k", "ms", "best_ms", "peer_ms",
                                    "ratio_to_peer", "floor_ms", "target_ms", "meets_target"))
    for t in tried:
        print(t)
    if args.smoke:
        print("smoke run: results not written")
        return
    path = harness.write_results(
        "topk", rows, kernel="pallas_kernels/topk.py radix select (32-step bitwise search)",
        sweep=tried, seconds=round(time.perf_counter() - started, 1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
