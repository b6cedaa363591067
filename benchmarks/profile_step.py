"""Where a decode step's time goes: per-kernel GPU time from a `jax.profiler` trace.

    python benchmarks/profile_step.py            # GPU
    python benchmarks/profile_step.py --smoke    # CPU: tiny shapes, logic only

For each case (model shapes, batch, context, method) it runs the library's jitted
`decode_step` with the cache donated, traces a few steps and prints per step: wall ms,
GPU-busy ms, kernel launches, and the time per kernel class (matmuls, our attention kernels,
top-k, copies, the rest) with the heaviest kernels by name, and per layer and part (q/k/v,
the K/V write, attention, MLP) the kernel time beside the bytes those kernels move and their
floor (`per_layer`). Results go to `benchmarks/results/profile_step.json`.
"""
from __future__ import annotations

import argparse
import functools
import os
import re
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp

import harness
import shapes as S


LAYOUTS = ("per_layer", "stacked")


def run_case(model, name, method, batch, context, steps, layout, kv_dtype=None):
    import sparsejax

    config = model.config
    plan = sparsejax.plan.as_plan(method, config, None)
    extra = 16 + 2 * (harness.PROFILE_REPEATS + 1) * steps   # each step adds a token
    cache = S.random_cache(config, plan, batch, context, extra, jax.random.key(1),
                           kv_dtype=kv_dtype)
    tokens = jnp.zeros((batch,), jnp.int32)
    step = jax.jit(sparsejax.decode_step, static_argnames="plan", donate_argnums=1)
    # an attention kernel takes every layer's pages and reads its own layer's
    shares = {x.nbytes: x.nbytes // config.num_layers for x in jax.tree.leaves(cache)
              if x.ndim and x.shape[0] == config.num_layers}
    # Inside XLA's CUDA graphs the profiler tags every kernel with the graph's name, not its
    # HLO instruction: the step the layers are attributed from launches its kernels one by one
    # (the kernels are the same; only the launch gaps, which the wall time shows, differ).
    one_by_one = step.lower(model, cache, tokens, plan=plan).compile(
        compiler_options={"xla_gpu_enable_command_buffer": ""})
    costs = harness.hlo_op_costs(one_by_one.as_text(), charge=shares)
    t0 = time.perf_counter()
    logits, cache = step(model, cache, tokens, plan=plan)
    jax.block_until_ready(logits)
    compile_s = time.perf_counter() - t0

    def call(run=functools.partial(step, plan=plan)):
        nonlocal cache
        logits, cache = run(model, cache, tokens)
        return logits

    prof = harness.profile(call, calls=steps)
    prof.pop("by_op")
    by_op = harness.profile(functools.partial(call, one_by_one), calls=steps)["by_op"]
    del cache
    return dict(case=f"{name}/{layout}", batch=batch, context=context,
                compile_s=round(compile_s, 2), **prof,
                **per_layer(by_op, costs, jax.devices()[0].device_kind))


PARTS = ("qkv", "cache_write", "attention", "mlp")


def per_layer(by_op: dict, costs: dict, device: str) -> dict:
    """The step's kernel time by layer and part (the named scopes of `sparsejax.layers`: the
    RMSNorm + q/k/v projection + RoPE, the token's K/V write, attention, and the output
    projection + residuals + MLP), beside the bytes its kernels move (`harness.hlo_op_costs`)
    and their floor at the device's datasheet bandwidth -> {"layers": [{layer, part, launches,
    ms, bytes, floor_ms}], "parts": the same summed over layers, "unattributed_ms": kernels
    no HLO instruction or layer was found for, "bandwidth"}."""
    bandwidth = harness.datasheet_bandwidth(device) or harness.HBM_BYTES_PER_S
    cells: dict[tuple, list] = {}
    unattributed = 0.0
    for op, (launches, ms) in by_op.items():
        cost = costs.get(op)
        layer = re.search(r"/layer(\d+)/", cost["op_name"]) if cost else None
        if layer is None:
            unattributed += ms
            continue
        part = next((p for p in PARTS if f"/{p}" in cost["op_name"]), "other")
        cell = cells.setdefault((int(layer.group(1)), part), [0.0, 0.0, 0])
        cell[0] += launches
        cell[1] += ms
        cell[2] += cost["bytes"]

    def entry(launches, ms, num_bytes, **where):
        floor = num_bytes / bandwidth * 1e3
        return dict(where, launches=round(launches, 2), ms=round(ms, 4), bytes=num_bytes,
                    floor_ms=round(floor, 4),
                    ratio_to_floor=round(ms / floor, 2) if floor else None)

    layers = [entry(*v, layer=k[0], part=k[1]) for k, v in sorted(cells.items())]
    parts = []
    for part in (*PARTS, "other"):
        mine = [v for k, v in cells.items() if k[1] == part]
        if mine:
            parts.append(entry(*(sum(x) for x in zip(*mine)), part=part))
    return dict(layers=layers, parts=parts, unattributed_ms=round(unattributed, 4),
                bandwidth=bandwidth)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--layouts", default="per_layer",
                   help="parameter layouts to compare (sparse methods run the first)")
    p.add_argument("--only", default=None, help="model:batch:context:method, one case")
    p.add_argument("--json", default="profile_step")
    p.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="bf16",
                   help="the KV cache's dtype")
    args = p.parse_args()
    kv_dtype = None if args.kv_dtype == "bf16" else args.kv_dtype
    layouts = args.layouts.split(",")
    cases = S.SMOKE_PROFILE if args.smoke else S.PROFILE_CASES
    if args.only:
        m, b, t, meth = args.only.split(":")
        cases = [(m, int(b), int(t), [meth])]
    rows = []
    for model_name, batch, context, methods in cases:
        for layout in layouts:
            model = S.random_model("tiny" if args.smoke else model_name,
                                   stacked=layout == "stacked")
            for mname in methods:
                if mname != "dense" and layout != layouts[0]:
                    continue
                method = S.method(mname, model.config, context)
                r = run_case(model, f"{model_name}/{mname}", method, batch, context, args.steps,
                             layout, kv_dtype)
                rows.append({**r, "kv_dtype": args.kv_dtype})
                print(f"{r['case']:34s} B={batch:3d} T={context:6d}: wall {r['wall_ms']:.3f} ms"
                      f"  busy {r['busy_ms']:.3f}  launches {r['launches']:.0f}  compile "
                      f"{r['compile_s']} s  "
                      + "  ".join(f"{k} {v:.3f}" for k, v in r["by_class_ms"].items()),
                      flush=True)
                for kname, ms in r["top"][:10]:
                    print(f"      {ms:8.4f} ms  {kname[:110]}")
                for e in r["parts"]:   # summed over the layers
                    print(f"      {e['part']:12s} {e['launches']:6.1f} launches {e['ms']:8.4f} ms"
                          f"  floor {e['floor_ms']:8.4f} ms  ({e['ratio_to_floor']}x)")
                print(f"      not in a layer: {r['unattributed_ms']:.4f} ms")
            del model
    if not args.smoke:
        harness.write_results(args.json, rows)


if __name__ == "__main__":
    sys.exit(main())
