"""The peer's capacity: the largest batch jax-llm-examples' Llama 3 `decode_step` runs at
Llama-3.1-8B shapes, bf16 (weights and cache unquantized), one GPU, per context.

    python benchmarks/peers/jax_llm_examples_capacity.py /path/to/jax-llm-examples/llama3 \\
        [--contexts 4096,32768,131072] [--json OUT.json]

Their code is not vendored: pass the `llama3` folder of a checkout of
https://github.com/jax-ml/jax-llm-examples (written against commit
8b4b24602e0652100e9835ec6d91fed58bbea472, llama3/ last changed in
202fcd375d44d887f94386fe5d0e60d53cd633e2). Their model.py imports jax and etils (orbax's
dependency). To bring it along as an ignored folder of this repository:

    mkdir -p build/jax-llm-examples && git --git-dir=PATH/TO/jax-llm-examples/.git archive \
        8b4b24602e0652100e9835ec6d91fed58bbea472 llama3 | tar -x -C build/jax-llm-examples

Their `KVCache` is one contiguous [batch, kv_heads, max_seq_len, head_dim] buffer per layer
and K/V, written with `dynamic_update_slice` at one position shared by all rows, and
`decode_step` is jitted with the cache donated. For each context we set
`max_seq_len = context`, start from the arithmetic limit (free memory after the weights /
the cache's bytes per row) and step down until a cache allocates and 4 decode steps at the
end of the context run; the row then records that batch, its peak memory
(`peak_bytes_in_use`, the process's high-water mark) and the compiled step's memory analysis.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
import time

# the allocator settings of bench_capacity.py, so both fill the same pool
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "true")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.93")

import jax
import jax.numpy as jnp

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                num_key_value_heads=8, num_hidden_layers=32, head_dim=128, vocab_size=128256,
                rope_theta=500000.0,
                rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                  original_max_position_embeddings=8192))
TINY = dict(LLAMA_8B, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, num_hidden_layers=2, head_dim=16, vocab_size=128)
STEPS = 4
SMOKE_ROWS = 4   # on CPU (no allocator limit): the batch a smoke run starts from


def free_bytes() -> int:
    s = jax.devices()[0].memory_stats() or {}
    return s.get("bytes_limit", 0) - s.get("bytes_in_use", 0)


def runs(l3, weights, cfg, batch: int, context: int) -> dict | None:
    """Allocate a cache of `batch` rows and run STEPS decode steps near its end; None on OOM."""
    cache = tokens = None
    try:
        cache = l3.KVCache.init(jax.random.key(1), cfg, batch)
        cache = dataclasses.replace(cache, iter=jnp.full_like(cache.iter, context - STEPS - 1))
        tokens = jnp.zeros((batch, 1), jnp.int32)
        lowered = l3.decode_step.lower(tokens, weights, cache, cfg)
        mem = lowered.compile().memory_analysis()
        for _ in range(STEPS):
            tokens, cache = l3.decode_step(tokens, weights, cache, cfg)
        jax.block_until_ready(tokens)
        return dict(temp_bytes=mem.temp_size_in_bytes, alias_bytes=mem.alias_size_in_bytes,
                    argument_bytes=mem.argument_size_in_bytes)
    except Exception as e:   # XLA's RESOURCE_EXHAUSTED surfaces as several exception types
        if "RESOURCE_EXHAUSTED" not in str(e) and "out of memory" not in str(e).lower():
            raise
        return None
    finally:
        del cache, tokens


def main():
    p = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("llama3_dir", help="the llama3/ folder of a jax-llm-examples checkout")
    p.add_argument("--contexts", default="4096,32768,131072")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--smoke", action="store_true", help="CPU: a tiny config, context 64")
    args = p.parse_args()
    sys.path.insert(0, os.path.abspath(args.llama3_dir))
    try:   # their checkpoint save/load only; it needs flatbuffers, which we do not
        importlib.import_module("jax.experimental.array_serialization.pytree_serialization")
    except ImportError:
        import types
        sys.modules["jax.experimental.array_serialization.pytree_serialization"] = \
            types.ModuleType("pytree_serialization")
    from llama3_jax import model as l3

    mesh = jax.make_mesh((1, 1, 1), ("x", "y", "z"), devices=jax.devices()[:1],
                         axis_types=(jax.sharding.AxisType.Explicit,) * 3)
    rows = []
    with jax.sharding.set_mesh(mesh):
        base = dataclasses.replace(l3.llama_to_jax_config(TINY if args.smoke else LLAMA_8B),
                                   mesh=mesh,
                                   quant_layer=False, quant_cache=False)
        weights = l3.Weights.init(jax.random.key(0), base)
        weight_bytes = sum(x.nbytes for x in jax.tree.leaves(weights))
        contexts = "64" if args.smoke else args.contexts
        for context in (int(t) for t in contexts.split(",")):
            cfg = dataclasses.replace(base, max_seq_len=context)
            per_row = 2 * cfg.num_layers * cfg.kv_heads * context * cfg.head_dim * 2
            limit = SMOKE_ROWS if args.smoke else free_bytes() // per_row
            t0 = time.time()
            batch, found, tried = limit, None, []
            while batch >= 1 and found is None:
                tried.append(batch)
                found = runs(l3, weights, cfg, batch, context)
                if found is None:
                    batch = min(batch - 1, int(batch * 0.97))
            stats = jax.devices()[0].memory_stats() or {}
            row = dict(peer="jax-llm-examples llama3", context=context, largest_batch=batch,
                       arithmetic_limit=int(limit), tried=tried, weight_bytes=weight_bytes,
                       cache_bytes=batch * per_row, peak_bytes_in_use=stats.get("peak_bytes_in_use"),
                       seconds=round(time.time() - t0, 1), **(found or {}))
            rows.append(row)
            print(json.dumps(row), flush=True)
    doc = dict(device=jax.devices()[0].device_kind, jax_version=jax.__version__, rows=rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
