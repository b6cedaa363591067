"""Where the device memory of a decode step, a prefill chunk and generate goes: XLA's memory
analysis of each compiled program, and any cache-sized copy left in its optimized HLO.

    python benchmarks/memory_probe.py            # GPU: Llama-3.1-8B shapes, bf16
    python benchmarks/memory_probe.py --smoke    # CPU: tiny shapes, logic only

Nothing is allocated: the programs are lowered from shapes (weights, cache) and compiled, so
this runs in a few minutes whatever the cache size. Per program it prints and records
(JSON to $OUT/memory_probe.json when OUT is set, else benchmarks/results/memory_probe.json):
  argument / output / alias / temp bytes (`compiled.memory_analysis()`),
  need = arguments + temporaries + outputs not aliased to a donated argument (the peak XLA
  plans), and the target weights + 1.05 x cache + 3 GiB,
  copies: the optimized HLO's `copy` instructions (and copy fusions) whose result is at least
  one layer's K pages — a cache update that is not in place shows up here.
Programs: `decode_step` jitted with the cache donated (B x context: 64 x 4k, 8 x 32k,
2 x 128k, 1 x 128k; dense and DELTA), one prefill chunk (`extend`, cache donated) and
`generate` with default arguments (its cache is one of its temporaries), plus generate with
cache correction and with speculative rounds at 1 x 32k.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import re
import sys
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np

import shapes as S

GIB = 2**30
HEADROOM = 3 * GIB   # the target: weights + 1.05 x cache + 3 GiB

DECODE = [(64, 4096), (8, 32768), (2, 131072), (1, 131072)]
CHUNKS = [(1, 131072, 8192), (64, 4096, 128)]       # (batch, cache context, chunk tokens)
GENERATE = [(1, 131072, {}), (64, 4096, {}), (1, 32768, dict(correct_every=16)),
            (1, 32768, dict(draft_tokens=4))]
NEW_TOKENS = 129
SMOKE = dict(decode=[(4, 512), (1, 1024)], chunks=[(2, 1024, 64)],
             generate=[(2, 512, {}), (2, 256, dict(correct_every=4)),
                       (2, 256, dict(draft_tokens=3))], new_tokens=17)


def memory(compiled) -> dict:
    m = compiled.memory_analysis()
    return dict(argument=m.argument_size_in_bytes, output=m.output_size_in_bytes,
                alias=m.alias_size_in_bytes, temp=m.temp_size_in_bytes,
                need=m.argument_size_in_bytes + m.temp_size_in_bytes
                + m.output_size_in_bytes - m.alias_size_in_bytes)


_SHAPE = re.compile(r"=\s*(\w+)\[([\d,]*)\]\{?[^ ]*\s+([\w-]+)\(")
_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1,
          "f64": 8, "s64": 8}


def large_copies(hlo: str, min_bytes: int) -> list[dict]:
    """Instructions of the optimized HLO that copy at least min_bytes: their name, opcode,
    shape and bytes. In-place cache writes leave none. (A scatter is not one: XLA:GPU writes
    a fused scatter into its donated operand's buffer, and one that is not in place shows up
    as temporaries in the memory analysis.)"""
    out = []
    for line in hlo.splitlines():
        m = _SHAPE.search(line)
        if not m:
            continue
        dtype, dims, opcode = m.groups()
        name = line.strip().split(" ")[0].lstrip("%")
        copying = opcode in ("copy", "copy-start") or (opcode == "fusion" and "copy" in name)
        if not copying or dtype not in _BYTES:
            continue
        size = int(np.prod([int(d) for d in dims.split(",") if d])) * _BYTES[dtype]
        operand = line[m.end():].split(")")[0].split(",")[0].strip().lstrip("%")
        # a copy of a broadcast materialises a fresh (zero) cache: no second copy of one
        if size >= min_bytes and not (opcode == "copy" and "broadcast" in operand):
            out.append(dict(name=name, opcode=opcode, shape=f"{dtype}[{dims}]", bytes=size,
                            operand=operand))
    return out


def report(kind, compiled, *, weights, cache, layer_bytes, **info) -> dict:
    mem = memory(compiled)
    target = weights + 1.05 * cache + HEADROOM
    copies = large_copies(compiled.as_text(), layer_bytes)
    row = dict(program=kind, **info, cache_bytes=cache, weight_bytes=weights, **mem,
               target=int(target), within_target=mem["need"] <= target,
               temp_over_cache=round(mem["temp"] / cache, 3), copies=copies)
    print(f"{kind:9s} {json.dumps(info):60s} need {mem['need'] / GIB:6.2f} GiB (target "
          f"{target / GIB:6.2f}) temp {mem['temp'] / GIB:6.2f} = {row['temp_over_cache']:.2f} "
          f"cache, alias {mem['alias'] / GIB:6.2f}, {len(copies)} cache-sized copies", flush=True)
    for c in copies[:8]:
        print(f"    {c['opcode']:10s} {c['name']:40s} {c['shape']} {c['bytes'] / GIB:.2f} GiB")
    return row


def run_cases(name: str, cases: list[tuple[int, int]], methods: list[str]) -> list[dict]:
    """Runs what the compiled analysis only plans: per (batch, context), a cache allocated at
    that size, two donated decode steps per method, then `generate` of context - 64 prompt
    tokens; after each, the device's bytes in use and peak, and whether the donated cache's
    arrays were consumed (a donation refused at run time keeps the old cache beside the new)."""
    import sparsejax
    from sparsejax import cache as kv
    from sparsejax.plan import as_plan

    device = jax.devices()[0]

    def stats():
        m = device.memory_stats() or {}
        return dict(in_use=m.get("bytes_in_use", 0), peak=m.get("peak_bytes_in_use", 0),
                    largest_free_block=m.get("largest_free_block_bytes"))

    model = S.random_model(name)
    cfg = model.config
    rows = []
    for batch, context in cases:
        for method in methods:
            plan = as_plan(S.method(method, cfg, context), cfg, None)
            step = jax.jit(functools.partial(sparsejax.decode_step, plan=plan),
                           donate_argnums=1)
            row = dict(program="run-decode", batch=batch, context=context, method=method,
                       before=stats())
            try:
                cache = kv.allocate(model, batch, context + 64, page_size=plan.page_size)
                cache = cache.replace(lengths=jnp.full((batch,), context, jnp.int32))
                row["cache_bytes"] = kv.cache_bytes(cache)
                row["allocated"] = stats()
                old = cache
                tokens = jnp.zeros((batch,), jnp.int32)
                for i in range(2):
                    logits, cache = step(model, cache, tokens)
                    jax.block_until_ready(logits)
                    row[f"step{i}"] = stats()
                    if i == 0:
                        leaves = jax.tree.leaves(old)
                        row["donated"] = f"{sum(x.is_deleted() for x in leaves)}/{len(leaves)}"
                row["result"] = "ran"
            except Exception as e:  # noqa: BLE001 - the OOM is the finding
                row["result"] = str(e).splitlines()[0][:300]
            old = cache = None
            row["after"] = stats()
            rows.append(row)
            print(json.dumps(row), flush=True)
        row = dict(program="run-generate", batch=batch, context=context, before=stats())
        try:
            ids = np.zeros((batch, context - 64), np.int32)
            out = sparsejax.generate(model, ids, max_new_tokens=64, eos_token_id=())
            jax.block_until_ready(out.tokens)
            row["result"] = "ran"
        except Exception as e:  # noqa: BLE001
            row["result"] = str(e).splitlines()[0][:300]
        out = None
        row["after"] = stats()
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main():
    p = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU")
    p.add_argument("--model", default="llama-8b")
    p.add_argument("--methods", default="dense,delta", help="methods of the decode steps")
    p.add_argument("--programs", default="decode,chunk,generate")
    p.add_argument("--layers", type=int, default=None,
                   help="the model's shapes with this many layers (a small program to dump: "
                        "XLA_FLAGS=--xla_dump_to=DIR shows its buffer assignment)")
    p.add_argument("--name", default="memory_probe", help="<name>.json")
    p.add_argument("--run", default=None, metavar="BxCONTEXT,...",
                   help="instead: allocate and run these cases on the device (run_cases)")
    args = p.parse_args()
    if args.run:
        cases = [tuple(int(v) for v in c.split("x")) for c in args.run.split(",")]
        name = "tiny" if args.smoke else args.model
        return write(args, name, None, run_cases(name, cases, args.methods.split(",")))
    programs = set(args.programs.split(","))
    from sparsejax import cache as kv
    from sparsejax.extend import extend
    from sparsejax.generate import (_abstract_cache, _abstract_model, _generate, _prepare,
                                    decode_step)
    from sparsejax.plan import as_plan

    name = "tiny" if args.smoke else args.model
    cfg = S.config(name)
    if args.layers:
        cfg = dataclasses.replace(cfg, num_layers=args.layers)
    dtype = jnp.bfloat16
    model = _abstract_model(cfg, dtype)
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(model.params))
    decode_cases = SMOKE["decode"] if args.smoke else DECODE
    chunk_cases = SMOKE["chunks"] if args.smoke else CHUNKS
    gen_cases = SMOKE["generate"] if args.smoke else GENERATE
    new_tokens = SMOKE["new_tokens"] if args.smoke else NEW_TOKENS
    print(f"{name}: weights {weights / GIB:.2f} GiB, jax {jax.__version__}, {jax.devices()[0]}")
    rows = []

    def sizes(batch, capacity, page_size=16):
        cache = kv.kv_bytes(cfg, batch, capacity, page_size=page_size, dtype=dtype)
        return dict(weights=weights, cache=cache, layer_bytes=cache // (2 * cfg.num_layers))

    for method in args.methods.split(",") if "decode" in programs else ():
        plan = as_plan(S.method(method, cfg, 4096), cfg, None)
        step = jax.jit(functools.partial(decode_step, plan=plan), donate_argnums=1)
        for batch, context in decode_cases:
            cache = _abstract_cache(model, batch, context + 64, plan, 1)
            tokens = jax.ShapeDtypeStruct((batch,), jnp.int32)
            compiled = step.lower(model, cache, tokens).compile()
            rows.append(report("decode", compiled, batch=batch, context=context, method=method,
                               **sizes(batch, context + 64, plan.page_size)))
    dense = as_plan(None, cfg, None)
    for batch, context, chunk in chunk_cases if "chunk" in programs else ():
        cache = _abstract_cache(model, batch, context, dense, 1)
        num = jnp.full((batch,), chunk, jnp.int32)
        run = jax.jit(lambda m, c, t: extend(m, c, t, num), donate_argnums=1)
        compiled = run.lower(model, cache, jax.ShapeDtypeStruct((batch, chunk), jnp.int32)).compile()
        rows.append(report("chunk", compiled, batch=batch, context=context, chunk=chunk,
                           **sizes(batch, context)))
    for batch, prompt, kwargs in gen_cases if "generate" in programs else ():
        ids = np.zeros((batch, prompt), np.int32)
        method = S.method("delta", cfg, prompt) if kwargs else None
        gen_args, static = _prepare(model, ids, max_new_tokens=new_tokens, method=method,
                                    **kwargs)
        compiled = _generate.lower(*gen_args, **static).compile()
        capacity = prompt + new_tokens - 1 + (kwargs.get("draft_tokens", -1) + 1)
        # generate makes its cache: the target counts it once, as a temporary
        rows.append(report("generate", compiled, batch=batch, prompt=prompt,
                           max_new_tokens=new_tokens, **{k: str(v) for k, v in kwargs.items()},
                           **sizes(batch, capacity, static["plan"].page_size)))
    write(args, name, cfg.num_layers, rows)
    bad = [r for r in rows if r["copies"] or not r["within_target"]]
    print(f"{len(bad)} of {len(rows)} programs over target or with cache-sized copies")
    return 0


def write(args, name: str, layers: int | None, rows: list[dict]) -> int:
    """rows -> $OUT/<name>.json (else results/), with the device, versions and date."""
    doc = dict(device=str(jax.devices()[0].device_kind), jax_version=jax.__version__,
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               model=name, layers=layers, rows=rows)
    if args.smoke:
        return 0
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else (
        Path(__file__).resolve().parent / "results")
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(doc, indent=1))
    print(f"wrote {out / args.name}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
