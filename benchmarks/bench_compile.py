"""Compile time and planned memory of `generate` and of a donated `decode_step`, at real shapes.

Nothing is allocated: the model, the cache and the prompt are abstract (`jax.ShapeDtypeStruct`),
so a 128k Llama-8B program compiles on any card. Per (model, batch, context, method):
  - `generate`: seconds to lower and to compile, and `memory_analysis()` of the compiled
    program (temporaries, arguments, outputs);
  - `decode_step` jitted with the cache donated: temporaries against the cache's own bytes
    (a step that updates the pages in place needs far less than one cache of temporaries).

    python benchmarks/bench_compile.py [--model llama-8b] [--cases 1x32768,1x131072,64x4096]
        [--methods dense,delta] [--prefill-chunk N]
Writes benchmarks/results/compile_memory[_h100].json (and $OUT/ when OUT is set).
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import harness  # noqa: E402
import shapes  # noqa: E402


def abstract_model(name: str):
    return jax.eval_shape(lambda: shapes.random_model(name))


def _memory(compiled) -> dict:
    m = compiled.memory_analysis()
    if m is None:
        return {}
    return {"temp_gb": m.temp_size_in_bytes / 1e9, "argument_gb": m.argument_size_in_bytes / 1e9,
            "output_gb": m.output_size_in_bytes / 1e9, "alias_gb": m.alias_size_in_bytes / 1e9}


def generate_row(model, batch: int, context: int, method: str, max_new: int, chunk) -> dict:
    g = importlib.import_module("sparsejax.generate")   # the package exports the function

    m = shapes.method(method, model.config, context)
    kwargs = dict(max_new_tokens=max_new, method=m)
    if chunk is not None:
        kwargs["prefill_chunk"] = chunk
    args, static = g._prepare(model, np.zeros((batch, context), np.int32), **kwargs)
    t0 = time.perf_counter()
    lowered = g._generate.lower(*args, **static)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    return dict(case=f"generate {method}", batch=batch, context=context, max_new_tokens=max_new,
                prefill_chunk=chunk, lower_s=t1 - t0, compile_s=t2 - t1,
                custom_calls=custom_calls(compiled), **_memory(compiled))


def custom_calls(compiled) -> dict:
    """Custom calls (cuDNN attention, Pallas kernels) in the optimized program, by target:
    what the compile has to build, and so what grows with unrolled loops."""
    import collections
    import re

    found = re.findall(r'custom_call_target="([^"]+)"', compiled.as_text())
    return dict(collections.Counter(found).most_common(8))


def step_row(model, batch: int, context: int, method: str) -> dict:
    import sparsejax
    from sparsejax import cache as kv
    from sparsejax.plan import as_plan

    plan = as_plan(shapes.method(method, model.config, context), model.config, None)
    # with the method's state (Quest's bounds, RESA's prior), as a prefilled cache holds it
    cache = importlib.import_module("sparsejax.generate")._abstract_cache(
        model, batch, context + 64, plan, 1, None)
    cache_gb = kv.cache_bytes(cache) / 1e9
    step = jax.jit(sparsejax.decode_step, static_argnames=("plan",), donate_argnums=(1,))
    tokens = jax.ShapeDtypeStruct((batch,), jnp.int32)
    t0 = time.perf_counter()
    compiled = step.lower(model, cache, tokens, plan=plan).compile()
    return dict(case=f"decode_step {method} (donated)", batch=batch, context=context,
                compile_s=time.perf_counter() - t0, cache_gb=cache_gb, **_memory(compiled))


def main(argv=None):
    p = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="llama-8b", choices=sorted(shapes.MODELS))
    p.add_argument("--cases", default="1x32768,1x131072,64x4096",
                   help="comma-separated BATCHxCONTEXT")
    p.add_argument("--methods", default="dense,delta")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="generate's prefill_chunk (default: generate's own default)")
    p.add_argument("--skip-generate", action="store_true")
    args = p.parse_args(argv)
    model = abstract_model(args.model)
    rows = []
    for case in args.cases.split(","):
        batch, context = (int(x) for x in case.split("x"))
        for method in args.methods.split(","):
            todo = [lambda: step_row(model, batch, context, method)]
            if not args.skip_generate:
                todo.insert(0, lambda: generate_row(model, batch, context, method,
                                                    args.max_new_tokens, args.prefill_chunk))
            for run in todo:
                try:
                    row = run()
                except Exception as e:  # a shape that does not compile is a result too
                    row = dict(case=f"{method}", batch=batch, context=context,
                               error=f"{type(e).__name__}: {str(e)[:300]}")
                row["model"] = args.model
                rows.append(row)
                print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()},
                      flush=True)
    harness.write_results(harness.per_gpu_name("compile_memory"), rows)
    return rows


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    main()
