"""One decode step of a whole model (random weights) at DS-R1-Distill-Qwen-1.5B shapes.

    python benchmarks/bench_decode_step.py            # GPU: every method + the HF peer
    python benchmarks/bench_decode_step.py --smoke    # CPU: a tiny config, logic only

B=64, contexts 4k and 16k, bf16: Dense, DELTA (defaults), RESA(DELTA), Kascade (5 anchors; and
with sparse_anchors),
Lychee (4 of 56 heads retrieval incl. layer 0's two, TopK(1024)). The cache is filled with
random K/V (a decode step's cost does not depend on what the keys say) and donated, so each
timed step updates it in place. Peer: HF transformers (PyTorch, SDPA, static cache, eager)
doing one decode step of the same random-weight Qwen2 model, in its own process.
Floor: the bytes a dense step must read (weights + the K/V of every layer) / 4.8 TB/s.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np

import harness
import shapes

QWEN_1_5B, TINY = "qwen-1.5b", "tiny"  # `shapes.MODELS` names


def methods_for(config):
    from sparsejax import methods as M

    retrieval = np.zeros((config.num_layers, config.num_kv_heads), bool)
    retrieval[0] = True
    retrieval[config.num_layers // 2, 0] = retrieval[3 * config.num_layers // 4, 1] = True
    small = config.num_layers < 28
    delta = M.DELTA().scaled_to(config.num_layers) if small else M.DELTA()
    kascade = M.Kascade().scaled_to(config.num_layers) if small else M.Kascade()
    return {"dense": M.Dense(), "delta": delta, "delta+resa": M.RESA(delta), "kascade": kascade,
            "kascade+sparse_anchors": dataclasses.replace(kascade, sparse_anchors=True),
            "lychee": M.Lychee(retrieval, budget=M.TopK(1024))}


def random_cache(config, plan, batch, context, steps, key):
    """A cache holding `context` random tokens per row (and random RESA priors if needed)."""
    return shapes.random_cache(config, plan, batch, context, steps, key)


def time_steps(model, plan, cache, tokens, *, calls, repeats):
    """Median ms per decode step; the cache is donated and carried from step to step."""
    import sparsejax

    step = jax.jit(sparsejax.decode_step, static_argnames="plan", donate_argnums=1)
    for _ in range(2):
        logits, cache = step(model, cache, tokens, plan=plan)
    jax.block_until_ready(logits)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            logits, cache = step(model, cache, tokens, plan=plan)
        jax.block_until_ready(logits)
        samples.append((time.perf_counter() - t0) * 1e3 / calls)
    return float(np.median(samples))


def check_against_references(model, config, batch=4, context=2048):
    """The whole decode step on the Pallas kernels vs the same step traced on the references:
    relative L2 error of the logits per method. In f32 with every XLA matmul at full precision
    (the kernels' f32 dots are IEEE; XLA's default f32 matmul on GPU is TF32), so a real kernel
    difference stands far above rounding — and top-k boundaries do not flip on TF32 noise."""
    import sparsejax
    from sparsejax.models.decoder import cast_params
    from sparsejax.pallas_kernels.common import use_backend

    model = model.replace(params=cast_params(model.params, jnp.float32))
    errors = {}
    for name, method in methods_for(config).items():
        plan = method.to_plan(config, None)
        cache = random_cache(config, plan, batch, context, 4, jax.random.key(2))
        cache = cache.replace(k=cache.k.astype(jnp.float32), v=cache.v.astype(jnp.float32))
        tokens = jnp.arange(batch, dtype=jnp.int32)
        step = lambda m, c, t: sparsejax.decode_step(m, c, t, plan)[0]  # noqa: E731
        with jax.default_matmul_precision("highest"):
            fast = jax.jit(step)(model, cache, tokens)
            with use_backend("reference"):
                ref = jax.jit(lambda m, c, t: step(m, c, t))(model, cache, tokens)
        fast, ref = np.asarray(fast, np.float32), np.asarray(ref, np.float32)
        errors[name] = float(np.linalg.norm(fast - ref) / np.linalg.norm(ref))
        print(f"check {name:12s}: logits rel err vs references {errors[name]:.2e}", flush=True)
    return errors


def run_ours(args, name, contexts):
    model = shapes.random_model(name)  # the per-layer layout `from_pretrained` returns
    config = model.config
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(model.params))
    errors = check_against_references(model, config, batch=2 if args.smoke else 4,
                                      context=200 if args.smoke else 2048)
    rows = []
    for context in contexts:
        kv_bytes = (2 * config.num_layers * args.batch * context * config.num_kv_heads *
                    config.head_dim * 2)
        floor = harness.floor_ms(weight_bytes + kv_bytes)
        results = {}
        for name, method in methods_for(config).items():
            plan = method.to_plan(config, None)
            steps = 2 + args.calls * args.repeats
            cache = random_cache(config, plan, args.batch, context, steps, jax.random.key(1))
            tokens = jnp.zeros((args.batch,), jnp.int32)
            results[name] = time_steps(model, plan, cache, tokens, calls=args.calls,
                                       repeats=args.repeats)
            del cache
            print(f"{name:12s} @ {context}: {results[name]:.3f} ms", flush=True)
        for name, ms in results.items():
            rows.append(harness.row(name, context=context, batch=args.batch, ms=ms, floor=floor,
                                    peer="dense", peer_ms=results["dense"],
                                    speedup_vs_dense=round(results["dense"] / ms, 3),
                                    logits_rel_err_vs_reference=round(errors[name], 5)))
        rows.append(harness.row("delta+resa vs delta", context=context, batch=args.batch,
                                ms=results["delta+resa"], peer="delta", peer_ms=results["delta"]))
    return rows


def run_hf(args, name, contexts):
    """HF transformers, one decode step with a static cache (SDPA), in this process."""
    import torch
    import transformers

    dims = shapes.MODELS[name]
    cfg = transformers.Qwen2Config(
        vocab_size=dims["vocab_size"], hidden_size=dims["hidden_size"],
        num_hidden_layers=dims["num_layers"], num_attention_heads=dims["num_heads"],
        num_key_value_heads=dims["num_kv_heads"], intermediate_size=dims["intermediate_size"],
        max_position_embeddings=max(contexts) + 64, attn_implementation="sdpa")
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).cuda().eval()
    out = {}
    for context in contexts:
        cache = transformers.StaticCache(config=cfg, max_batch_size=args.batch,
                                         max_cache_len=context + 16)
        ids = torch.zeros((args.batch, 1), dtype=torch.long, device="cuda")
        pos = torch.tensor([context], device="cuda")
        with torch.no_grad():
            def step(cache=cache, ids=ids, pos=pos):
                return model(input_ids=ids, past_key_values=cache, cache_position=pos,
                             use_cache=True)
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            samples = []
            for _ in range(args.repeats):
                start.record()
                for _ in range(args.calls):
                    step()
                end.record()
                torch.cuda.synchronize()
                samples.append(start.elapsed_time(end) / args.calls)
        out[context] = float(np.median(samples))
        print(f"hf-transformers @ {context}: {out[context]:.3f} ms", flush=True)
        del cache
        torch.cuda.empty_cache()
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--hf-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    name, contexts = (TINY, [256, 512]) if args.smoke else (QWEN_1_5B, [4096, 16384])
    if args.smoke:
        args.batch, args.calls, args.repeats = 2, 1, 1
    if args.hf_only:
        print(json.dumps(run_hf(args, name, contexts)))
        return
    hf = {}
    if not args.smoke:
        proc = subprocess.run([sys.executable, __file__, "--hf-only", "--batch", str(args.batch),
                               "--calls", str(args.calls), "--repeats", str(args.repeats)],
                              capture_output=True, text=True)
        print(proc.stderr[-2000:] if proc.returncode else "", end="")
        hf = {int(k): v for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()} \
            if proc.returncode == 0 else {}
    rows = run_ours(args, name, contexts)
    for context, ms in hf.items():
        dense = next(r for r in rows if r["case"] == "dense" and r["context"] == context)
        rows.append(harness.row("hf-transformers-sdpa-static", context=context, batch=args.batch,
                                ms=ms, floor=dense["floor_ms"]))
        rows.append(harness.row("dense vs hf-transformers", context=context, batch=args.batch,
                                ms=dense["ms"], peer="hf-transformers-sdpa-static", peer_ms=ms))
    harness.print_table(rows)
    if not args.smoke:
        path = harness.write_results(
            harness.per_gpu_name("decode_step"), rows, hf_error=None if hf else "HF peer failed",
            model="DS-R1-Distill-Qwen-1.5B shapes, random weights, bf16")
        plot(rows, path.with_suffix(".png"), harness.device_name())
        if os.environ.get("OUT"):
            plot(rows, Path(os.environ["OUT"], path.name).with_suffix(".png"),
                 harness.device_name())


def plot(rows, path: Path, device: str) -> None:
    """ms per decode step per method and context, on a log axis (HF transformers is ~20x)."""
    from sparsejax.plotting import figure, save

    names = ["dense", "delta", "delta+resa", "kascade", "lychee", "hf-transformers-sdpa-static"]
    contexts = sorted({r["context"] for r in rows})
    fig, ((ax,),) = figure(figsize=(7, 4))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ms = [next((r["ms"] for r in rows if r["case"] == name and r["context"] == c), np.nan)
              for c in contexts]
        bars = ax.bar(np.arange(len(contexts)) + i * width, ms, width, label=name)
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks(np.arange(len(contexts)) + 0.4 - width / 2,
                  [f"{c // 1024}k tokens" for c in contexts])
    ax.set_yscale("log")
    ax.set_ylabel("ms per decode step (B=64, log scale)")
    ax.set_title(f"Decode step, DS-Qwen-1.5B shapes, {device}")
    ax.legend(fontsize=8)
    save(fig, path)


if __name__ == "__main__":
    main()
