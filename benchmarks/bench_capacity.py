"""How many rows of a long context fit on one GPU: the largest batch that runs `generate`,
against the arithmetic limit (free memory after the weights / the KV cache's bytes per row).

    python benchmarks/bench_capacity.py            # GPU: every method, 4k / 32k / 128k
    python benchmarks/bench_capacity.py --quick    # GPU, ~6 minutes: dense at each context,
                                                   #   DELTA at 4k
    python benchmarks/bench_capacity.py --smoke    # CPU: tiny shapes, a pretend memory size

Llama-3.1-8B shapes, random bf16 weights (shapes.py). Per (context, method) a fresh process
(so that `peak_bytes_in_use`, the process's high-water mark, is that cell's): it asks
`sparsejax.max_batch` for the largest batch of `context` tokens per row (prompt context - 64,
then max_new_tokens=64), runs `generate` at that batch and steps down while it is refused
or runs out of memory (with --probe-up, also tries one row more). Each row: the batch that
ran, max_batch's answer, the arithmetic limit and the ratio, the peak memory and the target
weights + 1.05 x cache + 3 GiB, and the seconds the cell took. Results (when run on a GPU):
benchmarks/results/capacity.json {"device", "jax_version", "date", "rows": [...]} and a copy
in $OUT when it is set.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

# JAX's own default, preallocation, with a larger share: one pool region, so a cache near the
# card's size finds one block (growing the pool region by region, PREALLOCATE=false, refused
# 48 GiB of K/V with 60 GiB free on an H100)
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "true")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.93")

HERE = Path(__file__).resolve().parent
CONTEXTS = (4096, 32768, 131072)
METHODS = ("dense", "delta", "kascade", "lychee", "quest", "delta+resa")
QUICK = [(4096, "dense"), (32768, "dense"), (131072, "dense"), (4096, "delta")]
NEW_TOKENS = 64
GIB = 2**30
SMOKE_MEMORY = 48 * 2**20    # bytes a smoke cell pretends the device has free


def cell(context: int, method: str, *, smoke: bool, probe_up: bool, kv_dtype: str) -> dict:
    """One (context, method) in this process -> its row."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import harness
    import shapes as S
    import sparsejax
    from sparsejax import cache as kv

    t0 = time.time()
    model = S.random_model("tiny" if smoke else "llama-8b")
    config = model.config
    weights = S.weight_bytes(model)
    device = jax.devices()[0]
    loaded_stats = dict(device.memory_stats() or {})   # its largest free block, where reported
    if smoke:   # a pretend device: max_batch and generate's check read this much free memory
        kv.memory_available = lambda: SMOKE_MEMORY
        free, limit_bytes = SMOKE_MEMORY, SMOKE_MEMORY + weights
    else:
        limit_bytes = loaded_stats["bytes_limit"]
        free = limit_bytes - loaded_stats["bytes_in_use"]
    m = S.method(method, config, context)
    plan = sparsejax.plan.as_plan(m, config, None)
    prompt = context - NEW_TOKENS
    # generate pads the prompt to its length bucket: the cache it allocates holds that
    capacity = sparsejax.bucket_length(prompt) + NEW_TOKENS - 1
    kv_dtype = None if kv_dtype == "bf16" else kv_dtype   # None: the model's dtype
    row_bytes = kv.kv_bytes(config, 1, capacity, page_size=plan.page_size, dtype=jnp.bfloat16,
                            kv_dtype=kv_dtype)
    arithmetic = (limit_bytes - weights) // row_bytes
    t = time.time()
    answer = sparsejax.max_batch(config, capacity, dtype=jnp.bfloat16, method=m,
                                 free_bytes=free, kv_dtype=kv_dtype)
    max_batch_s = time.time() - t
    rng = np.random.default_rng(0)
    attempts = []

    def attempt(batch: int):
        """-> (ran, the batch to try next: generate's refusal names the largest that fits)"""
        ids = rng.integers(0, config.vocab_size, (batch, prompt)).astype(np.int32)
        t = time.time()
        following = min(batch - 1, int(batch * 0.98))
        error = None
        try:
            out = sparsejax.generate(model, ids, max_new_tokens=NEW_TOKENS, method=m,
                                     eos_token_id=(), kv_dtype=kv_dtype)
            jax.block_until_ready(out.tokens)
            result = "ran"
        except ValueError as e:
            if not harness.refused_as_too_large(e):
                raise
            result = "refused"
            named = re.search(r"at most batch=(\d+)", str(e))
            if named:
                following = min(following, int(named.group(1)))
        except Exception as e:  # noqa: BLE001 - XLA's OOM comes as several types
            if not harness.out_of_memory(e):
                raise
            result = "out of memory"
            error = str(e)[:600]   # XLA's own account of what it asked for
        if result != "ran":
            gc.collect()   # the failed attempt's arrays sit in its traceback's frame cycle
        attempts.append(dict(batch=batch, result=result, seconds=round(time.time() - t, 1),
                             **({} if error is None else dict(error=error))))
        print(f"  context {context} {method} batch {batch}: {result}", file=sys.stderr,
              flush=True)
        return result == "ran", following

    batch = max(answer, 1)
    ran = None
    while batch >= 1 and ran is None:
        ok, following = attempt(batch)
        ran, batch = (batch, batch) if ok else (None, following)
    if ran is not None and probe_up and attempt(ran + 1)[0]:
        ran += 1
    stats = device.memory_stats() or {}
    cache = 0 if ran is None else kv.kv_bytes(config, ran, capacity, page_size=plan.page_size,
                                              dtype=jnp.bfloat16, kv_dtype=kv_dtype)
    peak = stats.get("peak_bytes_in_use")
    target = weights + 1.05 * cache + 3 * GIB
    return dict(context=context, method=method, kv_dtype=kv_dtype or "bf16",
                device=device.device_kind,
                jax_version=jax.__version__, largest_batch=ran, max_batch=answer,
                arithmetic_limit=int(arithmetic),
                of_arithmetic=None if ran is None else round(ran / max(arithmetic, 1), 3),
                cached_tokens=None if ran is None else ran * capacity,
                weight_bytes=weights, cache_bytes=cache, peak_bytes=peak, target_bytes=int(target),
                peak_within_target=None if peak is None or ran is None else peak <= target,
                free_bytes_at_start=int(free), max_batch_seconds=round(max_batch_s, 1),
                attempts=attempts, memory_stats_after_weights=loaded_stats,
                seconds=round(time.time() - t0, 1))


def main():
    p = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"only {QUICK}")
    p.add_argument("--smoke", action="store_true", help="CPU: tiny model, contexts 256 / 512")
    p.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--probe-up", action="store_true", help="also try one row more than ran")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no cell after this many seconds (default 330 with --quick)")
    p.add_argument("--cell-timeout-s", type=float, default=None,
                   help="stop a cell's process after this many seconds (it is then skipped)")
    p.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="bf16",
                   help="the cache's storage (fp8: float8_e4m3fn with per-token scales)")
    p.add_argument("--name", default="capacity", help="results/<name>.json")
    p.add_argument("--cell", help="internal: run one CONTEXT,METHOD and print its row")
    args = p.parse_args()
    if args.cell:
        context, method = args.cell.split(",")
        row = cell(int(context), method, smoke=args.smoke, probe_up=args.probe_up,
                   kv_dtype=args.kv_dtype)
        print("ROW " + json.dumps(row), flush=True)
        return 0
    if args.smoke:
        cells = [(t, m) for t in (256, 512) for m in ("dense", "quest")]
    elif args.quick:
        cells = QUICK
    else:
        cells = [(int(t), m) for t in args.contexts.split(",") for m in args.methods.split(",")]
    budget = args.budget_s if args.budget_s is not None else (330 if args.quick else None)
    rows, skipped, t0 = [], [], time.time()
    for context, method in cells:
        if budget is not None and time.time() - t0 > budget:
            skipped.append(dict(context=context, method=method, reason="time budget"))
            continue
        cmd = [sys.executable, str(Path(__file__).resolve()), "--cell", f"{context},{method}"]
        cmd += ["--smoke"] * args.smoke + ["--probe-up"] * args.probe_up
        cmd += ["--kv-dtype", args.kv_dtype]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE,
                                  timeout=args.cell_timeout_s)
        except subprocess.TimeoutExpired as e:
            err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
            print(err[-3000:], file=sys.stderr)
            skipped.append(dict(context=context, method=method,
                                reason=f"stopped after {args.cell_timeout_s:.0f} s: {err[-600:]}"))
            write(rows, skipped, t0, args)
            continue
        found = [line[4:] for line in proc.stdout.splitlines() if line.startswith("ROW ")]
        if proc.returncode or not found:
            print(proc.stderr[-3000:], file=sys.stderr)
            skipped.append(dict(context=context, method=method,
                                reason=f"exit {proc.returncode}: {proc.stderr[-300:]}"))
            write(rows, skipped, t0, args)
            continue
        row = json.loads(found[-1])
        rows.append(row)
        write(rows, skipped, t0, args)
        peak = row["peak_bytes"]
        print(f"{context:7d} {method:11s} batch {row['largest_batch']} (max_batch "
              f"{row['max_batch']}, arithmetic {row['arithmetic_limit']}, "
              f"{row['of_arithmetic']}) peak "
              f"{'-' if peak is None else f'{peak / GIB:.1f}'} GiB (target "
              f"{row['target_bytes'] / GIB:.1f}) in {row['seconds']:.0f} s", flush=True)
    doc = write(rows, skipped, t0, args)
    if args.smoke:
        print(json.dumps(doc)[:2000])
        return 0 if rows and not skipped else 1
    return 0


def write(rows, skipped, t0, args) -> dict:
    """The results so far -> results/capacity.json (and $OUT/capacity.json), after every cell:
    a run stopped from outside keeps the cells it finished. The device and JAX version are
    the cells' own (this process never starts the GPU: its context would take memory from
    the cells)."""
    first = rows[0] if rows else {}
    doc = dict(device=first.get("device"), jax_version=first.get("jax_version"),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               model="llama-8b shapes, random bf16 weights", new_tokens=NEW_TOKENS,
               rows=rows, skipped=skipped, seconds=round(time.time() - t0, 1))
    if args.smoke:
        return doc
    path = HERE / "results" / f"{args.name}.json"
    path.write_text(json.dumps(doc, indent=1))
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / path.name).write_text(json.dumps(doc, indent=1))
    print(f"wrote {path}", flush=True)
    return doc


if __name__ == "__main__":
    sys.exit(main())
