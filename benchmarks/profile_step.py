"""Where a decode step's time goes: per-kernel GPU time from a `jax.profiler` trace.

    python benchmarks/profile_step.py            # GPU
    python benchmarks/profile_step.py --smoke    # CPU: tiny shapes, logic only

For each case (model shapes, batch, context, method) it runs the library's jitted
`decode_step` with the cache donated, traces a few steps and prints per step: wall ms,
GPU-busy ms, kernel launches, and the time per kernel class (matmuls, our attention kernels,
top-k, copies, the rest) with the heaviest kernels by name. Results go to
`benchmarks/results/profile_step.json`.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp

import harness
import shapes as S


LAYOUTS = ("per_layer", "stacked")


def run_case(model, name, method, batch, context, steps, layout):
    import sparsejax

    config = model.config
    plan = sparsejax.plan.as_plan(method, config, None)
    extra = 8 + (harness.PROFILE_REPEATS + 1) * steps    # every call of `profile` adds a token
    cache = S.random_cache(config, plan, batch, context, extra, jax.random.key(1))
    tokens = jnp.zeros((batch,), jnp.int32)
    step = jax.jit(sparsejax.decode_step, static_argnames="plan", donate_argnums=1)
    t0 = time.perf_counter()
    logits, cache = step(model, cache, tokens, plan=plan)
    jax.block_until_ready(logits)
    compile_s = time.perf_counter() - t0

    def call():
        nonlocal cache
        logits, cache = step(model, cache, tokens, plan=plan)
        return logits

    prof = harness.profile(call, calls=steps)
    del cache
    return dict(case=f"{name}/{layout}", batch=batch, context=context,
                compile_s=round(compile_s, 2), **prof)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--layouts", default="per_layer",
                   help="parameter layouts to compare (sparse methods run the first)")
    p.add_argument("--only", default=None, help="model:batch:context:method, one case")
    p.add_argument("--json", default="profile_step")
    args = p.parse_args()
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
                             layout)
                rows.append(r)
                print(f"{r['case']:34s} B={batch:3d} T={context:6d}: wall {r['wall_ms']:.3f} ms"
                      f"  busy {r['busy_ms']:.3f}  launches {r['launches']:.0f}  compile "
                      f"{r['compile_s']} s  "
                      + "  ".join(f"{k} {v:.3f}" for k, v in r["by_class_ms"].items()),
                      flush=True)
                for kname, ms in r["top"][:10]:
                    print(f"      {ms:8.4f} ms  {kname[:110]}")
            del model
    if not args.smoke:
        harness.write_results(args.json, rows)


if __name__ == "__main__":
    sys.exit(main())
