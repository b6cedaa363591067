"""Tensor-parallel decode steps on the GPUs of one host, as a user calls them.

    python benchmarks/bench_tensor_parallel.py           # GPUs -> results/tensor_parallel.json, .png
    python benchmarks/bench_tensor_parallel.py --smoke   # CPU, 8 host devices, tiny shapes

Parts (each runs the cells the host's GPU count allows and lists the others as skipped):
  one_gpu   mesh=None against a 1-device mesh (the cost of the sharding machinery on one GPU):
            Llama-3.1-8B B=1 at 4k / 32k and DS-Qwen-1.5B B=16 at 4k, dense and DELTA.
  delta     DELTA's own settings (its Figure 5): DS-R1-Distill-Qwen-7B shapes, TP=2, B=64, and
            DS-R1-Distill-Qwen-14B shapes, TP=4, B=32; dense / DELTA / Kascade / Lychee step ms
            over the decode trace, integrated (trapezoid) into tokens/s.
  scaling   Llama-3.1-8B shapes, 32k, B=16: step ms at TP = 1, 2, 4 per method, efficiency
            (TP=1 ms / (N x TP=N ms)) and the share of GPU time in collectives (profile).
Random bf16 weights and K/V (benchmarks/shapes.py); the cache is created sharded in place.
"""
from __future__ import annotations

import argparse
import math
import os
import shutil
import sys

SMOKE = "--smoke" in sys.argv
if SMOKE:   # host devices must be set before JAX starts
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
    os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")   # fits() reads the limit

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
    steps=20)
TINY = dict(
    one_gpu=[("tiny-tp", 2, (256,), ("dense", "delta"))],
    delta=[("tiny-tp", 2, 4, (1, 128, 256)), ("tiny-tp", 4, 4, (1, 128, 256))],
    scaling=("tiny-tp", 256, (4,), (1, 2, 4)),
    steps=2)
EXTRA_STEPS = 96  # cache slots past the context: `harness.profile`'s calls (82 at 20 steps)


def mesh_of(tp: int | None):
    """A ("model",) mesh over the first `tp` devices (None: no mesh)."""
    if tp is None:
        return None
    return jax.make_mesh((tp,), ("model",), devices=jax.devices()[:tp])


def place(model, mesh):
    import sparsejax

    return model if mesh is None else sparsejax.shard(model, mesh)


def random_cache(config, plan, batch, context, mesh, key):
    """`context` random tokens per row in a cache of context + EXTRA_STEPS, created where the
    mesh lays it out (the methods timed here keep no per-layer state)."""
    from sparsejax import sharding

    cache = sharding.allocate(config, batch, context + EXTRA_STEPS, page_size=plan.page_size,
                              dtype=jnp.bfloat16, mesh=mesh)

    def fill(c, key):
        kk, kv_ = jax.random.split(key)
        return c.replace(k=jax.random.normal(kk, c.k.shape, c.k.dtype),
                         v=jax.random.normal(kv_, c.v.shape, c.v.dtype),
                         lengths=jnp.full(c.lengths.shape, context, jnp.int32))

    where = jax.tree.map(lambda x: x.sharding, cache)
    return jax.jit(fill, donate_argnums=0, out_shardings=where)(cache, key)


def step_times(model, name, batch, contexts, mesh, steps):
    """Profile of the jitted, cache-donating `decode_step` at each context (one cache and one
    compile, at the largest context; only `lengths` changes)."""
    import sparsejax
    from sparsejax.plan import as_plan

    config = model.config
    plan = as_plan(S.method(name, config, max(contexts)), config, None)
    cache = random_cache(config, plan, batch, max(contexts), mesh, jax.random.key(batch))
    step = jax.jit(sparsejax.decode_step, static_argnames=("plan", "diagnostics"),
                   donate_argnums=1)
    tokens = jnp.zeros((batch,), jnp.int32)
    compiled = step.lower(model, cache, tokens, plan=plan).compile()
    out = {}
    state = {"cache": cache}
    for context in contexts:
        state["cache"] = state["cache"].replace(
            lengths=jnp.full((batch,), context, jnp.int32))

        def call():
            logits, state["cache"] = compiled(model, state["cache"], tokens)
            return logits

        prof = harness.profile(call, calls=steps, warmup=2)
        total = sum(prof["by_class_ms"].values())
        prof["collective_share"] = round(prof["by_class_ms"].get("collective", 0.0)
                                         / max(total, 1e-9), 4)
        out[context] = prof
    return out


# XLA's temporaries beside a sharded cache: 2.35x measured before the cache was written in
# place on one GPU (then ~1.05x); not re-measured under tensor parallelism.
CACHE_HEADROOM = 2.35


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


def part_one_gpu(cfg, rows, skipped):
    for model_name, batch, contexts, names in cfg["one_gpu"]:
        model = S.random_model(model_name)
        for name in names:
            times = {tp: step_times(place(model, mesh_of(tp)), name, batch, contexts,
                                    mesh_of(tp), cfg["steps"]) for tp in (None, 1)}
            for context in contexts:
                bare, meshed = times[None][context]["wall_ms"], times[1][context]["wall_ms"]
                rows.append(harness.row(f"one_gpu/{model_name}/{name}", context=context,
                                        batch=batch, ms=meshed, peer="mesh=None", peer_ms=bare,
                                        part="one_gpu", model=model_name, method=name, tp=1,
                                        mesh_over_none=round(meshed / bare, 4)))
                print(f"one_gpu {model_name} B={batch} T={context} {name}: mesh=None {bare:.3f} "
                      f"ms, 1-device mesh {meshed:.3f} ms (x{meshed / bare:.3f})", flush=True)
        del model


def integrate(contexts, ms, batch):
    """Tokens/s of decoding from contexts[0] to contexts[-1], step ms interpolated."""
    trap = getattr(np, "trapezoid", None) or np.trapz
    seconds = trap(ms, contexts) / 1e3
    return batch * (contexts[-1] - contexts[0]) / seconds


def part_delta(cfg, rows, skipped):
    for model_name, tp, batch, contexts in cfg["delta"]:
        config = S.config(model_name)
        if tp > jax.device_count() or not fits(config, batch, contexts[-1], tp):
            skipped.append(dict(part="delta", model=model_name, tp=tp, batch=batch,
                                why=f"{jax.device_count()} devices" if tp > jax.device_count()
                                else "memory"))
            continue
        mesh = mesh_of(tp)
        model = place(S.random_model(model_name), mesh)
        dense_tps = None
        for name in METHODS:
            times = step_times(model, name, batch, contexts, mesh, cfg["steps"])
            ms = [times[t]["wall_ms"] for t in contexts]
            tps = integrate(contexts, ms, batch)
            dense_tps = tps if name == "dense" else dense_tps
            for t in contexts:
                rows.append(harness.row(
                    f"delta/{model_name}/tp{tp}/{name}", context=t, batch=batch,
                    ms=times[t]["wall_ms"], part="delta", model=model_name, method=name, tp=tp,
                    collective_share=times[t]["collective_share"],
                    by_class_ms=times[t]["by_class_ms"]))
            rows.append(harness.row(
                f"delta/{model_name}/tp{tp}/{name}/trace", context=contexts[-1], batch=batch,
                ms=float(np.mean(ms)), part="delta_trace", model=model_name, method=name, tp=tp,
                tokens_per_s=round(tps, 1), speedup_vs_dense=round(tps / dense_tps, 3)))
            print(f"delta {model_name} TP={tp} B={batch} {name}: "
                  + " ".join(f"{t}:{m:.3f}" for t, m in zip(contexts, ms))
                  + f" ms -> {tps:.0f} tokens/s (x{tps / dense_tps:.2f} dense)", flush=True)
        del model


def part_scaling(cfg, rows, skipped):
    model_name, context, batches, tps_ = cfg["scaling"]
    config = S.config(model_name)
    for batch in batches:
        one = {}
        for tp in tps_:
            if tp > jax.device_count() or not fits(config, batch, context, tp):
                skipped.append(dict(part="scaling", model=model_name, tp=tp, batch=batch,
                                    why=f"{jax.device_count()} devices"
                                    if tp > jax.device_count() else "memory"))
                continue
            mesh = mesh_of(tp)
            model = place(S.random_model(model_name), mesh)   # the unplaced copy is freed
            for name in METHODS:
                prof = step_times(model, name, batch, (context,), mesh, cfg["steps"])[context]
                ms = prof["wall_ms"]
                one.setdefault(name, {})[tp] = ms
                t1 = one[name].get(1)
                dense = one.get("dense", {}).get(tp)
                rows.append(harness.row(
                    f"scaling/{model_name}/tp{tp}/{name}", context=context, batch=batch, ms=ms,
                    part="scaling", model=model_name, method=name, tp=tp,
                    efficiency=None if t1 is None else round(t1 / (tp * ms), 3),
                    tp1_ms=t1, speedup_vs_dense=None if dense is None else round(dense / ms, 3),
                    collective_share=prof["collective_share"], by_class_ms=prof["by_class_ms"]))
                print(f"scaling {model_name} T={context} B={batch} TP={tp} {name}: {ms:.3f} ms, "
                      f"collectives {100 * prof['collective_share']:.1f}%"
                      + ("" if t1 is None else f", efficiency {t1 / (tp * ms):.2f}"), flush=True)
            del model


def plot(doc, path):
    """Left: DELTA's decode trace in tokens/s per method at TP=2. Right: the decode step
    against the number of GPUs, a colour per method and a line style per batch."""
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    from sparsejax.plotting import figure, save

    rows = doc["rows"]
    fig, ((ax, bx),) = figure(1, 2, figsize=(12, 4.4))
    trace = [r for r in rows if r.get("part") == "delta_trace"]
    for i, r in enumerate(trace):
        ax.bar(i, r["tokens_per_s"], color=f"C{METHODS.index(r['method'])}")
    ax.set_xticks(range(len(trace)), [r["method"] for r in trace])
    if trace:
        ax.set_title(f"{trace[0]['model']}, TP={trace[0]['tp']}, B={trace[0]['batch']}, "
                     "decode trace", fontsize=10)
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
    bx.xaxis.set_major_locator(MaxNLocator(integer=True))
    bx.set_xlabel("tensor-parallel GPUs")
    bx.set_ylabel("decode step ms")
    if scaling:
        bx.set_title(f"{scaling[0]['model']} shapes, {scaling[0]['context'] // 1024}k",
                     fontsize=10)
    handles = [Line2D([], [], color=f"C{i}", lw=4, label=name)
               for i, name in enumerate(METHODS) if any(r["method"] == name for r in scaling)]
    handles += [Line2D([], [], color="gray", ls=styles[b][0], marker=styles[b][1], label=f"B={b}")
                for b in batches]
    bx.legend(handles=handles, fontsize=8, loc="center left", bbox_to_anchor=(1.02, 0.5))
    fig.suptitle(f"Tensor-parallel decode — {doc['device']} x{doc['devices']}, jax "
                 f"{doc['jax_version']}, {doc['date']}", fontsize=10)
    save(fig, path, dpi=110)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, 8 host devices, tiny shapes")
    parser.add_argument("--parts", default="one_gpu,delta,scaling")
    args = parser.parse_args(argv)
    if not (args.smoke or jax.default_backend() == "gpu"):
        raise SystemExit("needs GPUs; use --smoke to exercise the script on CPU")
    cfg = TINY if args.smoke else FULL
    rows, skipped = [], []
    parts = dict(one_gpu=part_one_gpu, delta=part_delta, scaling=part_scaling)
    meta = dict(devices=jax.device_count(), skipped=skipped,
                methods="benchmarks/shapes.py method(): DELTA, Kascade 10%, Lychee TopK(4096)")
    for name in args.parts.split(","):
        parts[name](cfg, rows, skipped)
        if not args.smoke:   # what a cut-off run measured is kept
            harness.write_results("tensor_parallel", rows, partial=True, **meta)
    harness.print_table(rows, cols=("case", "context", "batch", "ms", "peer_ms", "tp"))
    if skipped:
        print("skipped:", skipped)
    if not args.smoke:
        path = harness.write_results("tensor_parallel", rows, **meta)
        plot(json_doc(path), path.with_suffix(".png"))
        if os.environ.get("OUT"):
            shutil.copy(path.with_suffix(".png"), os.environ["OUT"])
        print(f"wrote {path}")


def json_doc(path):
    import json

    return json.loads(path.read_text())


if __name__ == "__main__":
    main()
