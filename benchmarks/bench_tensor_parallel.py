"""Tensor-parallel decode steps on the GPUs of one host, as a user calls them.

    python benchmarks/bench_tensor_parallel.py           # GPUs -> results/tensor_parallel.json, .png
    python benchmarks/bench_tensor_parallel.py --smoke   # CPU, 8 host devices, tiny shapes

    python benchmarks/bench_tensor_parallel.py --tps 2 --name tp2   # only the TP=2 cells
    python benchmarks/bench_tensor_parallel.py --merge tp1.json tp2.json ...  # one results file

Parts (each runs the cells the host's GPU count allows and lists the others as skipped):
  one_gpu   mesh=None against a 1-device mesh (the cost of the sharding machinery on one GPU):
            Llama-3.1-8B B=1 at 4k / 32k and DS-Qwen-1.5B B=16 at 4k, dense and DELTA.
  delta     DELTA's own settings (its Figure 5): DS-R1-Distill-Qwen-7B shapes, TP=2, B=64, and
            DS-R1-Distill-Qwen-14B shapes, TP=4, B=32; dense / DELTA / Kascade / Lychee step ms
            over the decode trace, integrated (trapezoid) into tokens/s.
  scaling   Llama-3.1-8B shapes, 32k, B=16: step ms at TP = 1, 2, 4 per method, efficiency
            (TP=1 ms / (N x TP=N ms)) and the share of GPU time in collectives (profile).
  capacity  Llama-3.1-8B shapes, 128k: the largest batch whose sharded cache and donated decode
            step run at TP = 1 and 4, from the arithmetic limit down.
Each cell shares one random cache between the methods and compiles their steps on threads.
Random bf16 weights and K/V (benchmarks/shapes.py); the cache is created sharded in place.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import threading
from pathlib import Path

SMOKE = "--smoke" in sys.argv
if SMOKE:   # host devices must be set before JAX starts
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
    os.environ["JAX_PLATFORMS"] = "cpu"
# preallocated, as bench_capacity.py (one pool region per GPU); 10% left outside the pool
# for NCCL's own buffers (at 0.92 and grown on demand, a TP=2 cell's NCCL init ran out)
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "true")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.90")   # fits() reads the limit

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import harness  # noqa: E402
import shapes as S  # noqa: E402

METHODS = ("dense", "delta", "kascade", "lychee")
FULL = dict(
    one_gpu=[("llama-8b", 1, (4096, 32768), ("dense", "delta")),
             ("qwen-1.5b", 16, (4096,), ("dense", "delta"))],
    delta=[("qwen-7b", 2, 64, (1, 2048, 4096, 8192, 12288, 16384)),
           ("qwen-14b", 4, 32, (1, 2048, 4096, 8192, 16384, 19456))],
    # B=8 as well: at B=16 one GPU cannot hold the cache with XLA's temporaries
    scaling=("llama-8b", 32768, (16, 8), (1, 2, 4)),
    # (model, context, TPs, methods, batches tried from the arithmetic limit down, free bytes)
    capacity=("llama-8b", 131072, (1, 4), ("dense", "delta"), 3, None),
    steps=10)
TINY = dict(
    one_gpu=[("tiny-tp", 2, (256,), ("dense", "delta"))],
    delta=[("tiny-tp", 2, 4, (1, 128, 256)), ("tiny-tp", 4, 4, (1, 128, 256))],
    scaling=("tiny-tp", 256, (4,), (1, 2, 4)),
    capacity=("tiny-tp", 256, (1, 4), ("dense",), 2, 2 << 20),
    steps=2)
EXTRA_STEPS = 96  # cache slots past the context: `harness.profile`'s calls (82 at 20 steps)


def mesh_of(tp: int | None):
    """A ("model",) mesh over the first `tp` devices (None: no mesh; scaling and capacity run
    TP=1 as one GPU is used, without a mesh)."""
    if tp is None:
        return None
    return jax.make_mesh((tp,), ("model",), devices=jax.devices()[:tp])


def place(model, mesh):
    import sparsejax

    return model if mesh is None else sparsejax.shard(model, mesh)


def random_cache(config, page_size, batch, context, mesh, key):
    """`context` random tokens per row in a cache of context + EXTRA_STEPS, created where the
    mesh lays it out (the methods timed here keep no per-layer state)."""
    from sparsejax import sharding

    cache = sharding.allocate(config, batch, context + EXTRA_STEPS, page_size=page_size,
                              dtype=jnp.bfloat16, mesh=mesh)

    def fill(c, key):
        # a layer at a time: a whole-cache draw would hold its random bits (2x the cache)
        def layer(i, kv):
            k, v = kv
            kk, kv_ = jax.random.split(jax.random.fold_in(key, i))
            return (k.at[i].set(jax.random.normal(kk, k.shape[1:], k.dtype)),
                    v.at[i].set(jax.random.normal(kv_, v.shape[1:], v.dtype)))

        k, v = jax.lax.fori_loop(0, c.k.shape[0], layer, (c.k, c.v))
        return c.replace(k=k, v=v, lengths=jnp.full(c.lengths.shape, context, jnp.int32))

    where = jax.tree.map(lambda x: x.sharding, cache)
    return jax.jit(fill, donate_argnums=0, out_shardings=where)(cache, key)


class CompiledTooLarge(Exception):
    """A compiled step needs more memory than the devices have free (checked before it runs:
    a device that runs out of memory mid-step leaves the others waiting in a collective)."""


def memory_need(compiled) -> dict:
    """Per device: the step's temporaries and the output bytes not aliased to a donated input."""
    ma = compiled.memory_analysis()
    return dict(temp=ma.temp_size_in_bytes,
                extra=ma.temp_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes)


def compile_steps(model, names, cache, mesh):
    """Each method's jitted, cache-donating `decode_step` for this cache, compiled on threads
    (XLA compiles outside the GIL: a 4-method cell compiles in about the time of one)."""
    from concurrent.futures import ThreadPoolExecutor

    import sparsejax
    from sparsejax.plan import as_plan

    step = jax.jit(sparsejax.decode_step, static_argnames=("plan", "diagnostics"),
                   donate_argnums=1)
    tokens = jnp.zeros((cache.lengths.shape[0],), jnp.int32)
    capacity = cache.capacity - EXTRA_STEPS
    plans = {name: as_plan(S.method(name, model.config, capacity), model.config, None)
             for name in names}
    for name, plan in plans.items():
        if plan.page_size != cache.page_size:
            raise ValueError(f"{name}: page_size={plan.page_size}, the shared cache's is "
                             f"{cache.page_size}")
    with ThreadPoolExecutor(len(names)) as pool:
        futures = {name: pool.submit(lambda p: step.lower(model, cache, tokens, plan=p).compile(),
                                     plan) for name, plan in plans.items()}
        compiled = {name: f.result() for name, f in futures.items()}
    free = free_bytes(jax.devices()[:mesh.size] if mesh is not None else jax.devices()[:1])
    for name, c in compiled.items():
        if os.environ.get("TP_HLO_DIR") and name == "dense" and mesh and mesh.size > 1:
            # the first sharded step's optimized HLO: where its memory goes
            dump = Path(os.environ.pop("TP_HLO_DIR"), f"hlo_tp{mesh.size}.txt")
            dump.write_text(c.as_text())
        need = memory_need(c)
        if need["extra"] > free:
            raise CompiledTooLarge(
                f"out of memory (compiled): {name} needs {need['extra'] / 1e9:.2f} GB beyond its "
                f"arguments per device ({need['temp'] / 1e9:.2f} GB temporaries), "
                f"{free / 1e9:.2f} GB free")
    return compiled


def step_times(model, names, batch, contexts, mesh, steps):
    """{method: {context: profile}} of the jitted, cache-donating `decode_step`: one random
    cache at the largest context shared by every method (only `lengths` changes), one compile
    per method."""
    from sparsejax.plan import as_plan

    page_size = as_plan(S.method("dense", model.config, max(contexts)), model.config,
                        None).page_size
    cache = random_cache(model.config, page_size, batch, max(contexts), mesh,
                         jax.random.key(batch))
    compiled = compile_steps(model, names, cache, mesh)
    tokens = jnp.zeros((batch,), jnp.int32)
    state = {"cache": cache}
    out = {}
    for name in names:
        for context in contexts:
            state["cache"] = state["cache"].replace(
                lengths=jnp.full((batch,), context, jnp.int32))

            def call(fn=compiled[name]):
                logits, state["cache"] = fn(model, state["cache"], tokens)
                return logits

            prof = harness.profile(call, calls=steps, warmup=2)
            prof["temp_gb"] = round(memory_need(compiled[name])["temp"] / 1e9, 3)
            total = sum(prof["by_class_ms"].values())
            prof["collective_share"] = round(prof["by_class_ms"].get("collective", 0.0)
                                             / max(total, 1e-9), 4)
            out.setdefault(name, {})[context] = prof
    return out


# XLA's temporaries beside a sharded cache, a pre-filter only (a cell that runs out of memory
# anyway is listed as skipped): the cache is written in place, ~1.1x on one GPU.
CACHE_HEADROOM = 1.15


def fits(config, batch, context, tp) -> bool:
    """Weights + CACHE_HEADROOM x the cache per GPU."""
    from bench_decode_matrix import device_memory
    from sparsejax.models import param_shapes

    c = config
    kv_bytes = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 2 * batch * (context + EXTRA_STEPS)
    weights = 2 * sum(math.prod(shape) for shape in jax.tree.leaves(
        param_shapes(c), is_leaf=lambda x: isinstance(x, tuple)))
    copies = max(1, tp // c.num_kv_heads)
    return (weights / tp + CACHE_HEADROOM * kv_bytes * copies / tp) <= device_memory()


def out_of_memory(e: Exception) -> bool:
    """XLA's out-of-memory, or the library's refusal of a cache that does not fit."""
    return (isinstance(e, CompiledTooLarge) or harness.out_of_memory(e)
            or harness.refused_as_too_large(e))


# Seconds a cell may take. A device that runs out of memory in a sharded step at run time
# leaves the others waiting in its collective for good; past this the process exits (the rows
# measured so far are already written) instead of holding the GPUs until the call's limit.
CELL_TIMEOUT_S = 300.0


def _abandon(part, where):
    print(f"{part} {where}: no result in {CELL_TIMEOUT_S:.0f} s (a device out of memory mid-step "
          "leaves the others in a collective); exiting with the rows measured so far",
          flush=True)
    os._exit(3)


def measured(part, skipped, where, fn):
    """fn() or, when the cell runs out of GPU memory (or its cache is refused as too large),
    None with the cell listed as skipped; a cell that hangs past CELL_TIMEOUT_S ends the
    process."""
    watchdog = threading.Timer(CELL_TIMEOUT_S, _abandon, (part, where))
    watchdog.daemon = True
    watchdog.start()
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - only memory exhaustion is a skip
        if not out_of_memory(e):
            raise
        skipped.append(dict(part=part, **where, why=str(e).splitlines()[0][:300]))
        print(f"{part} {where}: out of memory", flush=True)
    finally:
        watchdog.cancel()
    gc.collect()   # the failed cell's arrays sit in its traceback's frame cycle
    return None


def unavailable(config, batch, context, tp) -> str | None:
    if tp > jax.device_count():
        return f"{jax.device_count()} devices"
    return None if fits(config, batch, context, tp) else "memory (pre-filter)"


def part_one_gpu(cfg, rows, skipped, tps):
    for model_name, batch, contexts, names in cfg["one_gpu"]:
        model = S.random_model(model_name)
        times = {tp: step_times(place(model, mesh_of(tp)), names, batch, contexts,
                                mesh_of(tp), cfg["steps"]) for tp in (None, 1)}
        for name in names:
            for context in contexts:
                bare, meshed = (times[None][name][context]["wall_ms"],
                                times[1][name][context]["wall_ms"])
                rows.append(harness.row(f"one_gpu/{model_name}/{name}", context=context,
                                        batch=batch, ms=meshed, peer="mesh=None", peer_ms=bare,
                                        part="one_gpu", model=model_name, method=name, tp=1,
                                        mesh_over_none=round(meshed / bare, 4)))
                print(f"one_gpu {model_name} B={batch} T={context} {name}: mesh=None {bare:.3f} "
                      f"ms, 1-device mesh {meshed:.3f} ms (x{meshed / bare:.3f})", flush=True)
        model = None   # the placed weights go before the next setting


def integrate(contexts, ms, batch):
    """Tokens/s of decoding from contexts[0] to contexts[-1], step ms interpolated."""
    trap = getattr(np, "trapezoid", None) or np.trapz
    seconds = trap(ms, contexts) / 1e3
    return batch * (contexts[-1] - contexts[0]) / seconds


def part_delta(cfg, rows, skipped, tps):
    for model_name, tp, batch, contexts in cfg["delta"]:
        if tp not in tps:
            continue
        config = S.config(model_name)
        where = dict(model=model_name, tp=tp, batch=batch)
        why = unavailable(config, batch, contexts[-1], tp)
        if why:
            skipped.append(dict(part="delta", **where, why=why))
            continue
        mesh = mesh_of(tp)
        model = S.random_model(model_name, mesh=mesh)
        times = measured("delta", skipped, where,
                         lambda: step_times(model, METHODS, batch, contexts, mesh, cfg["steps"]))
        model = None   # the placed weights go before the next setting
        if times is None:
            continue
        dense_tps = integrate(contexts, [times["dense"][t]["wall_ms"] for t in contexts], batch)
        for name in METHODS:
            ms = [times[name][t]["wall_ms"] for t in contexts]
            tps_ = integrate(contexts, ms, batch)
            for t in contexts:
                rows.append(harness.row(
                    f"delta/{model_name}/tp{tp}/{name}", context=t, batch=batch,
                    ms=times[name][t]["wall_ms"], part="delta", model=model_name, method=name,
                    tp=tp, collective_share=times[name][t]["collective_share"],
                    temp_gb=times[name][t]["temp_gb"], by_class_ms=times[name][t]["by_class_ms"]))
            rows.append(harness.row(
                f"delta/{model_name}/tp{tp}/{name}/trace", context=contexts[-1], batch=batch,
                ms=float(np.mean(ms)), part="delta_trace", model=model_name, method=name, tp=tp,
                tokens_per_s=round(tps_, 1), speedup_vs_dense=round(tps_ / dense_tps, 3)))
            print(f"delta {model_name} TP={tp} B={batch} {name}: "
                  + " ".join(f"{t}:{m:.3f}" for t, m in zip(contexts, ms))
                  + f" ms -> {tps_:.0f} tokens/s (x{tps_ / dense_tps:.2f} dense)", flush=True)


def part_scaling(cfg, rows, skipped, tps):
    model_name, context, batches, all_tps = cfg["scaling"]
    config = S.config(model_name)
    for tp in [t for t in all_tps if t in tps]:
        mesh = mesh_of(tp if tp > 1 else None)
        model = S.random_model(model_name, mesh=mesh)   # placed a layer at a time
        for batch in batches:
            where = dict(model=model_name, tp=tp, batch=batch)
            why = unavailable(config, batch, context, tp)
            if why:
                skipped.append(dict(part="scaling", **where, why=why))
                continue
            times = measured("scaling", skipped, where,
                             lambda: step_times(model, METHODS, batch, (context,), mesh,
                                                cfg["steps"]))
            if times is None:
                continue
            for name in METHODS:
                prof = times[name][context]
                rows.append(harness.row(
                    f"scaling/{model_name}/tp{tp}/{name}", context=context, batch=batch,
                    ms=prof["wall_ms"], part="scaling", model=model_name, method=name, tp=tp,
                    speedup_vs_dense=round(times["dense"][context]["wall_ms"]
                                           / prof["wall_ms"], 3),
                    collective_share=prof["collective_share"], temp_gb=prof["temp_gb"], by_class_ms=prof["by_class_ms"]))
                print(f"scaling {model_name} T={context} B={batch} TP={tp} {name}: "
                      f"{prof['wall_ms']:.3f} ms, collectives "
                      f"{100 * prof['collective_share']:.1f}%", flush=True)
        model = None   # the placed weights go before the next setting
    add_efficiency(rows)


def add_efficiency(rows):
    """TP=1 ms / (N x TP=N ms) on every scaling row whose TP=1 cell ran (also from an earlier
    process's rows: the parts may run on disjoint GPUs at the same time), and
    `speedup_kept`: the method's speedup over dense at TP=N as a share of its speedup at
    TP=1 (1.0: sharding costs the sparse step what it costs dense)."""
    scaling = [r for r in rows if r.get("part") == "scaling"]
    one = {(r["method"], r["batch"]): r["ms"] for r in scaling if r["tp"] == 1}
    one_speedup = {(r["method"], r["batch"]): r.get("speedup_vs_dense")
                   for r in scaling if r["tp"] == 1}
    for r in scaling:
        t1 = one.get((r["method"], r["batch"]))
        r["tp1_ms"] = t1
        r["efficiency"] = None if t1 is None else round(t1 / (r["tp"] * r["ms"]), 3)
        s1 = one_speedup.get((r["method"], r["batch"]))
        r["speedup_kept"] = (None if not s1 or r.get("speedup_vs_dense") is None
                             else round(r["speedup_vs_dense"] / s1, 3))


def free_bytes(devices) -> int:
    """The allocator's room left on the fullest of `devices`."""
    stats = [d.memory_stats() or {} for d in devices]
    return min(int(s.get("bytes_limit", 1 << 34)) - int(s.get("bytes_in_use", 0))
               for s in stats)


def part_capacity(cfg, rows, skipped, tps):
    """The largest batch of `context` tokens whose sharded cache and donated decode step run,
    stepping down from the arithmetic limit (free memory after the weights / a row's cache
    bytes per GPU) while the step runs out of memory."""
    from sparsejax import cache as kv

    model_name, context, all_tps, names, tries, pretend_free = cfg["capacity"]
    config = S.config(model_name)
    for tp in [t for t in all_tps if t in tps and t <= jax.device_count()]:
        mesh = mesh_of(tp if tp > 1 else None)
        model = S.random_model(model_name, mesh=mesh)
        shards = min(tp, config.num_kv_heads)
        row = kv.kv_bytes(config, 1, context + EXTRA_STEPS, dtype=jnp.bfloat16) / shards
        free = pretend_free or free_bytes(jax.devices()[:tp])
        arithmetic = int(free // row)
        for name in names:
            batch, ran = arithmetic, None
            for _ in range(tries):
                where = dict(model=model_name, tp=tp, batch=batch, method=name)
                ran = measured("capacity", skipped, where, lambda: step_times(
                    model, (name,), batch, (context,), mesh, 3))
                if ran is not None or batch == 1:
                    break
                batch -= 1
            peak = max(int((d.memory_stats() or {}).get("peak_bytes_in_use", 0))
                       for d in jax.devices()[:tp])
            rows.append(harness.row(
                f"capacity/{model_name}/tp{tp}/{name}", context=context, batch=batch, tp=tp,
                ms=ran[name][context]["wall_ms"] if ran else None, part="capacity",
                model=model_name, method=name, ran=ran is not None, arithmetic=arithmetic,
                of_arithmetic=round(batch / arithmetic, 3), free_gb=round(free / 1e9, 2),
                row_gb_per_gpu=round(row / 1e9, 3), peak_gb=round(peak / 1e9, 2)))
            print(f"capacity {model_name} T={context} TP={tp} {name}: batch {batch} "
                  f"{'ran' if ran else 'did not run'} (arithmetic {arithmetic})", flush=True)
        model = None   # the placed weights go before the next setting


def plot(doc, path):
    """Left: DELTA's decode trace in tokens/s per method and setting. Right: the decode step
    against the number of GPUs, a colour per method and a line style per batch."""
    from matplotlib.lines import Line2D

    from sparsejax.plotting import figure, save

    rows = doc["rows"]
    fig, ((ax, bx),) = figure(1, 2, figsize=(12, 4.4))
    trace = [r for r in rows if r.get("part") == "delta_trace"]
    settings = list(dict.fromkeys((r["model"], r["tp"], r["batch"]) for r in trace))
    for r in trace:
        i = settings.index((r["model"], r["tp"], r["batch"]))
        m = METHODS.index(r["method"])
        ax.bar(i * (len(METHODS) + 1) + m, r["tokens_per_s"], color=f"C{m}")
    ax.set_xticks([i * (len(METHODS) + 1) + (len(METHODS) - 1) / 2 for i in range(len(settings))],
                  [f"{m}\nTP={tp}, B={b}" for m, tp, b in settings], fontsize=8)
    ax.set_title("DELTA's decode trace setting (Figure 5), integrated", fontsize=10)
    ax.set_ylabel("tokens/s")
    scaling = [r for r in rows if r.get("part") == "scaling"]
    batches = sorted({r["batch"] for r in scaling})
    styles = dict(zip(batches, [("-", "o"), ("--", "s"), (":", "^"), ("-.", "D")]))
    for i, name in enumerate(METHODS):
        for batch in batches:
            pts = sorted((r["tp"], r["ms"]) for r in scaling
                         if r["method"] == name and r["batch"] == batch)
            if pts:
                ls, marker = styles[batch]
                bx.plot(*zip(*pts), marker=marker, color=f"C{i}", ls=ls)
    tps = sorted({r["tp"] for r in scaling})
    bx.set_xticks(tps)   # GPUs come in integers
    if len(tps) == 1:
        bx.set_xlim(tps[0] - 1, tps[0] + 1)
    bx.set_xlabel("tensor-parallel GPUs")
    bx.set_ylabel("decode step ms")
    if scaling:
        bx.set_title(f"{scaling[0]['model']} shapes, {scaling[0]['context'] // 1024}k",
                     fontsize=10)
    handles = [Line2D([], [], color=f"C{i}", lw=4, label=name)
               for i, name in enumerate(METHODS) if any(r.get("method") == name for r in rows)]
    handles += [Line2D([], [], color="gray", ls=styles[b][0], marker=styles[b][1], label=f"B={b}")
                for b in batches]
    bx.legend(handles=handles, fontsize=8, loc="center left", bbox_to_anchor=(1.02, 0.5))
    fig.suptitle(f"Tensor-parallel decode — {doc['device']} x{doc['devices']}, jax "
                 f"{doc['jax_version']}, {doc['date']}", fontsize=10)
    save(fig, path, dpi=110)


def main(argv=None):
    global CELL_TIMEOUT_S  # noqa: PLW0603 - the watchdog of measured() reads it
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, 8 host devices, tiny shapes")
    parser.add_argument("--parts", default="one_gpu,delta,scaling,capacity")
    parser.add_argument("--tps", default="1,2,4",
                        help="tensor-parallel sizes to run (parts on disjoint GPUs can run at "
                             "once: CUDA_VISIBLE_DEVICES=0,1 ... --tps 2 --name tp2 &)")
    parser.add_argument("--name", default="tensor_parallel", help="results/<name>.json")
    parser.add_argument("--cell-timeout-s", type=float, default=CELL_TIMEOUT_S,
                        help="end the process when a cell takes longer (a hung collective)")
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help="no run: join these results files into results/tensor_parallel.json")
    args = parser.parse_args(argv)
    CELL_TIMEOUT_S = args.cell_timeout_s
    if args.merge:
        return merge([Path(f) for f in args.merge])
    if not (args.smoke or jax.default_backend() == "gpu"):
        raise SystemExit("needs GPUs; use --smoke to exercise the script on CPU")
    cfg = TINY if args.smoke else FULL
    tps = {int(t) for t in args.tps.split(",")}
    skipped = []
    meta = dict(devices=jax.device_count(), skipped=skipped, methods=METHOD_NOTE)
    rows = harness.Rows(args.name, meta, write=not args.smoke)   # a cut-off run keeps its rows
    parts = dict(one_gpu=part_one_gpu, delta=part_delta, scaling=part_scaling,
                 capacity=part_capacity)
    for name in args.parts.split(","):
        parts[name](cfg, rows, skipped, tps)
    harness.print_table(rows, cols=("case", "context", "batch", "ms", "peer_ms", "tp"))
    if skipped:
        print("skipped:", skipped)
    if not args.smoke:
        path = harness.write_results(args.name, rows, **meta)
        print(f"wrote {path}")


METHOD_NOTE = "benchmarks/shapes.py method(): DELTA, Kascade 10%, Lychee TopK(4096)"


def merge(paths):
    """One results file (and its plot) from the files of parts run as separate processes."""
    docs = [json.loads(p.read_text()) for p in paths]
    rows = [r for d in docs for r in d["rows"]]
    add_efficiency(rows)
    first = docs[0]
    doc = dict(device=first["device"], jax_version=first["jax_version"], date=first["date"],
               devices=max(d["devices"] for d in docs), methods=METHOD_NOTE,
               skipped=[s for d in docs for s in d["skipped"]],
               runs=[dict(file=p.name, devices=d["devices"], device=d["device"], date=d["date"])
                     for p, d in zip(paths, docs)], rows=rows)
    path = harness.RESULTS / "tensor_parallel.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    plot(doc, path.with_suffix(".png"))
    print(f"wrote {path} ({len(rows)} rows from {len(paths)} files)")


if __name__ == "__main__":
    main()
