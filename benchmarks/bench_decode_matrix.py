"""The whole decode step as a user calls it, over the shapes users run, for every method.

    python benchmarks/bench_decode_matrix.py           # GPU -> results/decode_matrix.json, .png
                                                       # (decode_matrix_h100.* on an H100)
    python benchmarks/bench_decode_matrix.py --smoke   # CPU: tiny shapes, logic only

Models {DS-R1-Distill-Qwen-1.5B, Llama-3.1-8B shapes} x batch {1, 4, 16, 64} x context
{4k, 32k, 128k} x methods {dense, DELTA, Kascade, Lychee (1/8 of heads retrieval, TopK 4096),
Quest (1024 tokens), RESA(DELTA)}; random bf16 weights and K/V (see shapes.py). Cells whose
cache `allocate` refuses (it and the decode step's temporaries do not fit beside the
weights) are listed as skipped. Per (model, batch, method) the
cache is allocated once at the largest context that fits and only `lengths` changes, so
each method compiles once per batch size.

Each row: `ms` = wall time per step of back-to-back jitted `decode_step` calls with the cache
donated (what a decode loop pays), `busy_ms` = the GPU-busy time per step from a
`jax.profiler` trace, `floor_ms` = (weights + the K/V bytes that method must read at that
step) / the device's bandwidth, measured here as a device-to-device copy (bytes read +
written), `speedup_vs_dense` = our dense step's ms / this ms.

The DELTA trace: B=64 at DS-Qwen-1.5B shapes decoding from 1 to 18k tokens; step time
measured at 9 contexts and integrated (trapezoid) over every step -> tokens/s per method.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import math
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np

import harness
import shapes as S

CONTEXTS = (4096, 32768, 131072)
BATCHES = (1, 4, 16, 64)
MODELS = ("qwen-1.5b", "llama-8b")
METHODS = ("dense", "delta", "kascade", "lychee", "quest", "delta+resa")
TRACE = dict(model="qwen-1.5b", batch=64, contexts=(1, 512, 1024, 2048, 4096, 8192, 12288,
                                                    16384, 18432))
EXTRA_STEPS = 64         # cache slots past the context: `harness.profile`'s calls (42 at 10)


def copy_bandwidth() -> float:
    """Bytes per second of a large device-to-device copy (read + written), on this device."""
    x = jnp.ones((1 << 29,), jnp.float32)   # 2 GiB
    ms = harness.device_time_ms(jax.jit(lambda a: a + 0), x, calls=10)
    return 2 * x.nbytes / (ms / 1e3)


def device_memory() -> int:
    stats = jax.devices()[0].memory_stats() or {}
    return int(stats.get("bytes_limit", 0)) or (1 << 34)


def kv_read_bytes(plan, config, batch: int, context: int, kv_dtype=None) -> int:
    """K/V bytes a decode step at `context` must read for this plan (and the page bounds Quest
    reads): dense layers read the whole context, sparse layers what their selection holds."""
    from sparsejax.plan import Role

    HQ, HK, D = config.num_heads, config.num_kv_heads, config.head_dim
    # K and V per token and KV head: bf16, or fp8 with an f32 scale each
    per_token = 2 * (D + 4) if kv_dtype == "fp8" else 2 * D * 2
    s = plan.selector
    total = 0
    for layer, role in enumerate(plan.roles):
        if role in (Role.DENSE, Role.SELECT):
            total += batch * HK * context * per_token
            continue
        budget = s.budget
        if budget.kind == "fixed":
            kept = min(context, int(budget.value) * s.unit)
        else:   # ratio with a minimum (Kascade)
            kept = min(context, max(math.ceil(budget.value * context), budget.minimum * s.unit))
        kept = min(context, max(kept, s.sinks + s.recent))
        heads = HQ if s.groups == "query" else HK   # per-query-head sets read their own K/V
        if role == Role.HYBRID:
            dense = sum(plan.retrieval[layer])
            total += batch * (dense * context + (HK - dense) * kept) * per_token
        else:
            total += batch * heads * kept * per_token
        if s.score == "quest_bound":   # kmin, kmax f32 of every page
            total += batch * HK * math.ceil(context / plan.page_size) * D * 4 * 2
    return total


def cache_shapes(config, plan, batch, context, kv_dtype=None):
    """The cache's shapes, or None when `allocate` refuses it (more than the device holds)."""
    try:
        return jax.eval_shape(lambda: S.random_cache(config, plan, batch, context, EXTRA_STEPS,
                                                     jax.random.key(1), kv_dtype=kv_dtype))
    except ValueError:
        return None


def compile_step(model, plan, cache_shape, batch):
    import sparsejax

    step = jax.jit(sparsejax.decode_step, static_argnames=("plan", "diagnostics"),
                   donate_argnums=1)
    tokens = jax.ShapeDtypeStruct((batch,), jnp.int32)
    return step.lower(model, cache_shape, tokens, plan=plan).compile()


def time_contexts(compiled, model, config, plan, batch, contexts, steps, key, kv_dtype=None):
    """Step time at each context on one cache allocated for the largest."""
    cache = S.random_cache(config, plan, batch, max(contexts), EXTRA_STEPS, key,
                           kv_dtype=kv_dtype)
    tokens = jnp.zeros((batch,), jnp.int32)
    out = {}
    for context in contexts:
        cache = cache.replace(lengths=jnp.full((batch,), context, jnp.int32))
        state = {"cache": cache}

        def call():
            logits, state["cache"] = compiled(model, state["cache"], tokens)
            return logits

        out[context] = harness.profile(call, calls=steps, warmup=2)
        cache = state["cache"]
    del cache
    return out


def results_name(kv_dtype) -> str:
    return harness.per_gpu_name("decode_matrix" + ("_fp8" if kv_dtype else ""))


def plan_for(name, config, context):
    from sparsejax.plan import as_plan

    return as_plan(S.method(name, config, context), config, None)


def run_matrix(models, batches, contexts, methods, steps, bandwidth, memory, smoke,
               kv_dtype=None):
    rows, skipped = [], []
    for model_name in models:
        model = S.random_model("tiny" if smoke else model_name)
        config = model.config
        weights = S.weight_bytes(model)
        groups = []
        for batch in batches:
            for name in methods:
                plan = plan_for(name, config, max(contexts))
                shapes = {t: cache_shapes(config, plan, batch, t, kv_dtype) for t in contexts}
                # a cell runs where `allocate` accepts its cache beside the loaded weights
                # (the cache and the compiled step's temporaries fit), as a user's would
                fit = [t for t in contexts if shapes[t] is not None]
                skipped += [dict(model=model_name, batch=batch, context=t, method=name)
                            for t in contexts if t not in fit]
                if fit:
                    groups.append((batch, name, plan, fit))
        # compile every (batch, method) at once: XLA compiles in C++ threads
        with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
            futures = [pool.submit(compile_step, model, plan,
                                   cache_shapes(config, plan, batch, max(fit), kv_dtype), batch)
                       for batch, name, plan, fit in groups]
            executables = [f.result() for f in futures]
        dense_ms = {}
        for (batch, name, plan, fit), compiled in zip(groups, executables):
            timed = time_contexts(compiled, model, config, plan, batch, fit, steps,
                                  jax.random.key(batch), kv_dtype)
            for context, prof in timed.items():
                floor = (weights + kv_read_bytes(plan, config, batch, context, kv_dtype)
                         ) / bandwidth * 1e3
                if name == "dense":
                    dense_ms[batch, context] = prof["wall_ms"]
                dense = dense_ms.get((batch, context))
                rows.append(harness.row(
                    f"{model_name}/{name}", context=context, batch=batch, ms=prof["wall_ms"],
                    floor=floor, peer="dense", peer_ms=dense, model=model_name, method=name,
                    busy_ms=prof["busy_ms"], launches=prof["launches"],
                    busy_over_wall=round(prof["busy_ms"] / prof["wall_ms"], 3),
                    speedup_vs_dense=None if dense is None else round(dense / prof["wall_ms"], 3),
                    by_class_ms=prof["by_class_ms"]))
                r = rows[-1]
                print(f"{model_name:10s} B={batch:3d} T={context:6d} {name:11s} {r['ms']:8.3f} ms "
                      f"floor {r['floor_ms']:7.3f} (x{r['ratio_to_floor']:.2f}) busy "
                      f"{prof['busy_ms']:.3f} launches {prof['launches']:.0f} "
                      f"speedup {r['speedup_vs_dense']}", flush=True)
            if not smoke:   # what a cut-off run measured is kept
                harness.write_results(results_name(kv_dtype), rows, partial=True,
                                      skipped=skipped)
        del model
    return rows, skipped


def run_trace(methods, steps, bandwidth, smoke):
    """DELTA's decode trace: integrated step time from 1 to the last context, B=64."""
    model = S.random_model("tiny" if smoke else TRACE["model"])
    config = model.config
    contexts = (1, 64, 128, 256) if smoke else TRACE["contexts"]
    batch = 2 if smoke else TRACE["batch"]
    weights = S.weight_bytes(model)
    out = []
    for name in methods:
        plan = plan_for(name, config, contexts[-1])
        compiled = compile_step(model, plan, cache_shapes(config, plan, batch, contexts[-1]),
                                batch)
        timed = time_contexts(compiled, model, config, plan, batch, contexts, steps,
                              jax.random.key(7))
        ms = np.array([timed[t]["wall_ms"] for t in contexts])
        total_s = np.trapezoid(ms, contexts) / 1e3 if hasattr(np, "trapezoid") else \
            np.trapz(ms, contexts) / 1e3
        floors = [(weights + kv_read_bytes(plan, config, batch, t)) / bandwidth for t in contexts]
        floor_s = np.trapezoid(floors, contexts) if hasattr(np, "trapezoid") else \
            np.trapz(floors, contexts)
        tokens = batch * (contexts[-1] - contexts[0])
        out.append(dict(method=name, batch=batch, context_from=contexts[0],
                        context_to=contexts[-1], step_ms=dict(zip(map(str, contexts),
                                                                  ms.round(4).tolist())),
                        decode_s=round(float(total_s), 3), tokens_per_s=round(tokens / total_s, 1),
                        floor_tokens_per_s=round(tokens / floor_s, 1)))
        print(f"trace {name:11s}: {out[-1]['decode_s']:.2f} s, {out[-1]['tokens_per_s']:.0f} "
              f"tokens/s (floor {out[-1]['floor_tokens_per_s']:.0f})", flush=True)
    dense = next(r["tokens_per_s"] for r in out if r["method"] == "dense")
    for r in out:
        r["speedup_vs_dense"] = round(r["tokens_per_s"] / dense, 3)
    return out


def plot(rows, meta, path):
    """One heat map per method: rows model x batch, columns context; cell = speedup vs our
    dense step (dense: x floor), annotated with x floor."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    keys = sorted({(r["model"], r["batch"]) for r in rows}, key=lambda k: (MODELS.index(k[0])
                                                                         if k[0] in MODELS else 0, k[1]))
    contexts = sorted({r["context"] for r in rows})
    fig = Figure(figsize=(4.2 * len(methods), 0.45 * len(keys) + 2.2))
    FigureCanvasAgg(fig)
    for i, m in enumerate(methods):
        ax = fig.add_subplot(1, len(methods), i + 1)
        grid = np.full((len(keys), len(contexts)), np.nan)
        text = {}
        for r in rows:
            if r["method"] != m:
                continue
            y, x = keys.index((r["model"], r["batch"])), contexts.index(r["context"])
            value = r["ratio_to_floor"] if m == "dense" else r["speedup_vs_dense"]
            floor = f"x{r['ratio_to_floor']:.2f} floor"
            if value is None:   # a run without dense: the cell shows its floor ratio only
                text[y, x] = floor
                continue
            grid[y, x] = value
            text[y, x] = floor if m == "dense" else f"{value:.2f}x\n({floor})"
        cmap, norm = ("Reds", dict(vmin=1, vmax=3)) if m == "dense" else ("RdYlGn",
                                                                          dict(vmin=0, vmax=2))
        ax.imshow(grid, cmap=cmap, aspect="auto", **norm)
        for (y, x), s in text.items():
            ax.text(x, y, s, ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(contexts)), [f"{t // 1024}k" for t in contexts])
        ax.set_yticks(range(len(keys)), [f"{k[0]} B={k[1]}" for k in keys] if i == 0 else [])
        ax.set_title("dense: step / floor" if m == "dense" else f"{m}: speedup vs dense",
                     fontsize=10)
    fig.suptitle(f"Decode step, random bf16 weights — {meta['device']}, jax {meta['jax']}, "
                 f"{meta['date']}; floor = bytes / {meta['bandwidth_tb_s']:.2f} TB/s (measured copy)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, nothing written")
    p.add_argument("--steps", type=int, default=10, help="timed steps per cell")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--batches", default=",".join(map(str, BATCHES)))
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    p.add_argument("--no-trace", action="store_true", help="skip the DELTA trace")
    p.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="bf16",
                   help="the KV cache's dtype (fp8: results/decode_matrix_fp8*.json)")
    args = p.parse_args()
    kv_dtype = None if args.kv_dtype == "bf16" else args.kv_dtype
    methods = args.methods.split(",")
    if args.smoke:
        bandwidth, memory = 1e11, 1 << 34
        contexts, batches, models = (128, 512), (1, 2), ("qwen-1.5b",)
        args.steps = 2
    else:
        bandwidth, memory = copy_bandwidth(), device_memory()
        contexts = tuple(int(t) for t in args.contexts.split(","))
        batches = tuple(int(b) for b in args.batches.split(","))
        models = tuple(args.models.split(","))
    print(f"bandwidth {bandwidth / 1e12:.3f} TB/s (copy), memory {memory / 2**30:.1f} GiB",
          flush=True)
    t0 = time.time()
    rows, skipped = run_matrix(models, batches, contexts, methods, args.steps, bandwidth, memory,
                               args.smoke, kv_dtype)
    trace = [] if args.no_trace else run_trace(methods, args.steps, bandwidth, args.smoke)
    print(f"matrix and trace in {time.time() - t0:.0f} s")
    harness.print_table(rows, cols=("case", "context", "batch", "ms", "floor_ms",
                                    "ratio_to_floor", "speedup_vs_dense", "busy_over_wall"))
    if args.smoke:
        return
    meta = dict(bandwidth_tb_s=round(bandwidth / 1e12, 3),
                bandwidth_source="device-to-device copy of 2 GiB, bytes read + written",
                memory_gib=round(memory / 2**30, 1), skipped=skipped, trace=trace,
                methods={m: S.method.__doc__ for m in methods[:1]})
    path = harness.write_results(results_name(kv_dtype), rows, kv_dtype=args.kv_dtype, **meta)
    if not rows:
        print(f"no cell fits: {skipped}")
        return
    doc = __import__("json").loads(path.read_text())
    plot(rows, dict(device=doc["device"], jax=doc["jax_version"], date=doc["date"],
                    bandwidth_tb_s=meta["bandwidth_tb_s"]), path.with_suffix(".png"))
    if os.environ.get("OUT"):
        import shutil
        shutil.copy(path.with_suffix(".png"), os.environ["OUT"])


if __name__ == "__main__":
    sys.exit(main())
