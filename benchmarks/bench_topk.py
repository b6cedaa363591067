"""topk_select (Pallas: per-row radix select, rows split across programs, or a sampled
threshold's candidates) vs lax.top_k.

    python benchmarks/bench_topk.py          # GPU: exactness, timings, sweep -> results/topk.json
    python benchmarks/bench_topk.py --matrix # GPU: every selection shape of the decode matrix,
                                             # default tuning only -> results/topk_matrix.json
    (on an H200; results/topk_h100.json and topk_matrix_h100.json on an H100)
    python benchmarks/bench_topk.py --few-rows # GPU: few long rows (B=1 to 8 over 1 to 8 KV
                                             # heads) at every chunk width of the split
                                             # path -> results/topk_few_rows.json
    python benchmarks/bench_topk.py --smoke  # CPU: tiny shapes in interpret mode, nothing written

Every configuration is first checked for exact equality with `topk_select_reference` (indices
and counts); any difference aborts the run. Times are GPU time per call from the profiler
(`harness.device_time_ms`), lax.top_k's likewise. `ms` is the default configuration (its path
in `path`: per_row, split or sampled), `best_ms` the fastest one the sweep found, `split_ms`
and `sampled_ms` the fastest of each of those paths; every configuration tried is listed
under "sweep" with its path. Configurations that only choose the path are timed whatever the
sweep's time budget. Targets: <= 0.08 ms at [8, 131072], k=13107, and <= 0.5x lax.top_k
everywhere.
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

PER_ROW, SPLIT = dict(split=False), dict(split=True)
SPLIT_ONLY = dict(split=True, sample_stride=0)  # the split path without the sampled front
PATH_KNOBS = {"split", "sample_stride"}
# (case, rows, N, k, target_ms, forced, sweep): forced = force_first=4, force_last=64 (k/2 at
# most) and a per-row k_row in [k/2, k]; sweep = tuning tried besides the default. Rows are
# batch x selection groups; N is tokens, or pages of 16 for DELTA and Quest.
CASES = [
    ("1x131072 k=13107 (B=1, 1 group, 128k)", 1, 131072, 13107, None, False,
     [SPLIT_ONLY, PER_ROW, dict(block_n=2048), dict(block_n=4096, block_sel=1024)]),
    ("2x131072 k=13107 (B=2, 1 group, 128k)", 2, 131072, 13107, None, False,
     [SPLIT_ONLY, dict(sample_stride=16)]),
    ("4x131072 k=13107 (B=4, 1 group, 128k)", 4, 131072, 13107, None, False,
     [SPLIT_ONLY, dict(sample_stride=16)]),
    ("8x131072 k=4096 (B=1, 8 KV heads, 128k, TopK 4096)", 8, 131072, 4096, None, False,
     [SPLIT_ONLY, PER_ROW, dict(block_n=1024), dict(block_n=4096)]),
    ("8x131072 k=13107 (B=1, 8 KV heads, 128k, 10%)", 8, 131072, 13107, 0.08, False,
     [SPLIT_ONLY, PER_ROW, dict(block_n=1024), dict(block_n=4096), dict(block_sel=256),
      dict(block_sel=1024, num_warps=8), dict(num_stages=2), dict(num_warps=2),
      dict(SPLIT_ONLY, block_n=1024), dict(SPLIT_ONLY, block_n=4096)]),
    ("8x131072 k=13107 forced+k_row", 8, 131072, 13107, None, True, [SPLIT_ONLY]),
    ("8x32768 k=3276 (B=1, 8 KV heads, 32k)", 8, 32768, 3276, None, False,
     [PER_ROW, dict(block_n=1024)]),
    ("2x8192 k=64 (DELTA pages, B=2, 128k)", 2, 8192, 64, None, False, [PER_ROW]),
    ("64x8192 k=64 (DELTA pages, B=64, 128k)", 64, 8192, 64, 0.05, False,
     [PER_ROW, dict(PER_ROW, num_warps=8), dict(block_n=2048)]),
    ("512x32768 k=3276", 512, 32768, 3276, 0.30, False,
     [SPLIT, dict(num_warps=8), dict(block_sel=8192)]),
    ("512x32768 k=3276 forced+k_row", 512, 32768, 3276, None, True, []),
    ("512x131072 k=13107 (B=64, 8 KV heads, 128k, 10%)", 512, 131072, 13107, None, False,
     [SPLIT_ONLY, PER_ROW, dict(block_n=8192), dict(block_n=16384, block_sel=1024, num_warps=8),
      dict(SPLIT_ONLY, block_n=8192)]),
    ("512x65536 k=6553 (B=64, 8 KV heads, 64k, 10%)", 512, 65536, 6553, None, False,
     [SPLIT_ONLY, PER_ROW, dict(block_n=8192)]),
    ("2048x131072 k=13107 (B=64, 32 query heads, 128k, TidalDecode)", 2048, 131072, 13107,
     None, False, [SPLIT_ONLY]),
    ("256x524288 k=13107 (B=32, 8 KV heads, 512k, TopK)", 256, 524288, 13107, None, False,
     [SPLIT_ONLY]),
    ("256x524288 k=52428 (B=32, 8 KV heads, 512k, 10%)", 256, 524288, 52428, None, False,
     [SPLIT_ONLY]),
    ("1024x524288 k=52428 (B=32, 32 query heads, 512k, TidalDecode)", 1024, 524288, 52428,
     None, False, [SPLIT_ONLY]),
    ("512x2048 k=64", 512, 2048, 64, 0.05, False,
     [SPLIT, dict(num_warps=8), dict(block_rows=4, num_warps=8)]),
]
SMOKE_CASES = [
    ("8x256 k=26", 8, 256, 26, None, False,
     [dict(block_n=64, block_sel=32), dict(split=True, block_n=64, block_sel=32)]),
    ("8x256 k=26 forced+k_row", 8, 256, 26, None, True, [dict(split=True, block_n=64)]),
    ("4x1000 k=64", 4, 1000, 64, None, False, [dict(block_n=128, block_rows=2)]),
    ("4x2048 k=64 forced+k_row, sampled vs split", 4, 2048, 64, None, True,
     [dict(sample_stride=4, block_n=256, block_sel=64),
      dict(SPLIT_ONLY, block_n=256, block_sel=64)]),
]


def few_rows_cases():
    """Kascade's and Lychee's selections at B=1 to 8 over 1 to 8 KV heads, 32k and 128k: the
    split path at each chunk width, the data for `topk.default_tuning`'s narrowest chunk."""
    for rows in (1, 2, 4, 8):
        for n in (32832, 131072, 131136) if rows == 1 else (32832, 131136):
            yield (f"{rows}x{n} k={n // 10}", rows, n, n // 10, None, False,
                   [dict(SPLIT_ONLY, block_n=width) for width in (256, 512, 1024, 2048)])


MAX_RATIO_TO_PEER = 0.5
MATRIX_BATCHES, MATRIX_GROUPS, MATRIX_TOKENS = (1, 4, 16, 64), (1, 2, 8, 32), (4096, 32768, 131072)
SWEEP_BUDGET_S = 300  # later sweep configurations are skipped (and listed as such) after this


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
    if smoke:  # no profiler records on the CPU: one wall-clock call
        return harness.time_ms(fn, *args, calls=1, repeats=1, warmup=1)
    return harness.device_time_ms(fn, *args)


def path_of(num_rows, n, k, tuning):
    """The path `topk_select` takes with these knobs: per_row, split or sampled."""
    chosen = topk.default_tuning(num_rows, n, k, split=tuning.get("split"),
                                 sample_stride=tuning.get("sample_stride"),
                                 block_rows=tuning.get("block_rows"))
    return "sampled" if chosen["sample_stride"] else "split" if chosen["split"] else "per_row"


def run_case(case, num_rows, n, k, target, forced, sweep, *, smoke, started, sweep_budget_s):
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
        entry = {"case": case, "tuning": tuning or "default",
                 "path": path_of(num_rows, n, k, tuning)}
        over_budget = time.perf_counter() - started > sweep_budget_s
        if tuning and set(tuning) - PATH_KNOBS and over_budget:
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
    path_ms = {path: min((t["ms"] for t in ran if t["path"] == path), default=None)
               for path in ("split", "sampled")}

    peer = harness.compiled(lambda s: jax.lax.top_k(s, k), scores)
    peer_ms = timed(peer, scores, smoke=smoke)
    floor = harness.floor_ms(num_rows * n * 4 + num_rows * k * 4)
    default = topk.default_tuning(num_rows, n, k)
    row = harness.row(case, context=n, batch=num_rows, ms=default_ms, floor=floor,
                      peer="lax.top_k", peer_ms=peer_ms, k=k,
                      split=default["split"], block_n=default["block_n"],
                      path=tried[0]["path"], split_ms=path_ms["split"],
                      sampled_ms=path_ms["sampled"], target_ms=target,
                      meets_target=None if target is None else default_ms <= target,
                      meets_ratio=default_ms <= MAX_RATIO_TO_PEER * peer_ms,
                      best_ms=best["ms"], best_tuning=best["tuning"],
                      default_error=tried[0].get("error"), **options)
    return row, tried


def matrix_cases():
    """The decode matrix's selections, once per (rows, N, k): rows = batch x groups over
    tokens with k = 10% or 4096 (Kascade, Lychee), and over pages of 16 with k = 64 (DELTA,
    Quest). Where either path could serve (N <= RESIDENT_WIDTH) the other path is timed too,
    the data for `topk.default_tuning`'s rule."""
    seen = set()
    for batch in MATRIX_BATCHES:
        for groups in MATRIX_GROUPS:
            for tokens in MATRIX_TOKENS:
                for n, k, what in ((tokens, tokens // 10, "10%"), (tokens, 4096, "TopK 4096"),
                                   (tokens // 16, 64, "64 pages")):
                    shape = (batch * groups, n, min(k, n))
                    if shape in seen:
                        continue
                    seen.add(shape)
                    other = [dict(split=not topk.default_tuning(*shape)["split"])]
                    either = n <= topk.RESIDENT_WIDTH
                    yield (f"{shape[0]}x{n} k={shape[2]} (B={batch}, G={groups}, {what})",
                           *shape, None, False, other if either else [])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--smoke", action="store_true", help="tiny shapes, CPU interpret mode")
    mode.add_argument("--matrix", action="store_true", help="the decode matrix's shapes")
    mode.add_argument("--few-rows", action="store_true",
                      help="few long rows at every chunk width of the split path")
    parser.add_argument("--sweep-seconds", type=float, default=SWEEP_BUDGET_S,
                        help="time after which the remaining sweep configurations are skipped")
    args = parser.parse_args()
    if not args.smoke and jax.default_backend() != "gpu":
        sys.exit("bench_topk needs a GPU (or --smoke for a CPU logic check)")
    started = time.perf_counter()
    rows, tried = [], []
    cases = (SMOKE_CASES if args.smoke else matrix_cases() if args.matrix
             else few_rows_cases() if args.few_rows else CASES)
    whole = args.matrix or args.few_rows
    for spec in cases:
        row, case_tried = run_case(*spec, smoke=args.smoke, started=started,
                                   sweep_budget_s=float("inf") if whole else args.sweep_seconds)
        rows.append(row)
        tried += case_tried
        print(f"{row['case']}: {row['ms']} ms (best {row['best_ms']}), "
              f"lax.top_k {row['peer_ms']} ms", flush=True)
    harness.print_table(rows, cols=("case", "batch", "context", "k", "path", "ms", "best_ms",
                                    "split_ms", "sampled_ms", "peer_ms", "ratio_to_peer",
                                    "meets_ratio", "target_ms", "meets_target"))
    for t in tried:
        print(t)
    worst = max(rows, key=lambda r: r["ratio_to_peer"])
    print(f"worst ratio to lax.top_k: {worst['ratio_to_peer']} ({worst['case']})")
    if args.smoke:
        print("smoke run: results not written")
        return
    path = harness.write_results(
        harness.per_gpu_name("topk_matrix" if args.matrix else "topk_few_rows"
                             if args.few_rows else "topk"), rows,
        kernel="pallas_kernels/topk/: per-row radix select (32-step bitwise search), rows "
        "split across programs (8 radix passes over chunks, one compaction), or a strided "
        "sample's threshold, its candidates counted, compacted and selected per row",
        timing="GPU time per call (profiler), lax.top_k likewise",
        sweep=tried, seconds=round(time.perf_counter() - started, 1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
