"""`sparsejax demo` (behind `make demo`): every method on the embedded default model.

Loads the small retrieval model shipped with the package (`sparsejax.embedded_model_path()`,
trained by `sparsejax pretrain`), runs a small eval of every method at one budget on the
synthetic retrieval tasks it was trained on, prints a table (method, budget, accuracy, recall,
attention error, tokens/s) and writes a plot. `sparsejax eval` is the full harness.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import jax.numpy as jnp

# every method once, and RESA on DELTA, the README's example (`sparsejax eval` runs them all;
# at 4096 tokens RESA cuts DELTA's attention error the most of the four papers' methods):
# two compiles per method, 8 prompts of 768 tokens: about 2.5 minutes on two CPU cores
DEMO_METHODS = "dense,oracle,streaming,quest,tidal,delta,kascade,lychee,delta+resa"


def run(args) -> int:
    import sparsejax
    from sparsejax import eval as evaluation
    from sparsejax.train import data

    path = sparsejax.embedded_model_path()
    if not (path / "config.json").exists():
        raise ValueError(f"the embedded model is missing from {path}; "
                         "`sparsejax pretrain --out DIR` trains one")
    t0 = time.perf_counter()
    model = sparsejax.from_pretrained(path, dtype=jnp.float32)
    c = model.config
    vocab = sparsejax.load_tokenizer(path).get_vocab()
    print(f"sparsejax demo: {path.name} ({c.num_layers} layers, {c.num_heads}/{c.num_kv_heads} "
          f"heads, head_dim {c.head_dim}), tasks {', '.join(data.TASKS)} at {args.context} "
          f"tokens, {args.samples} prompts each, budget {args.budget:.0%} of the context")
    doc = evaluation.evaluate(
        model, tasks=data.TASKS, context=args.context, samples=args.samples,
        method_names=evaluation.parse_methods(args.methods), ratios=[args.budget],
        batch=args.samples * len(data.TASKS), model_dir=path, vocab=vocab,
        progress=lambda s: print("  " + s, file=sys.stderr, flush=True))
    overall = [r for r in doc["results"] if r["task"] == "all"]
    print(f"\n{'method':<14} {'budget':>6} {'accuracy':>8} {'recall':>7} {'attn err':>8} "
          f"{'tokens/s':>9}  layers (D dense, S select, R reuse, H hybrid, F self-select)")
    for r in overall:
        print(f"{r['method']:<14} {r['budget_ratio']:>6.2f} {r['accuracy']:>8.3f} "
              f"{r['mean_recall']:>7.3f} {r['mean_attn_error']:>8.3f} {r['tokens_per_s']:>9.1f}  "
              f"{r['config']['roles']}")
    dense = {r["task"]: r["accuracy"] for r in doc["results"] if r["method"] == "dense"}
    if dense:
        print("\ndense accuracy per task: " + ", ".join(
            f"{t} {dense[t]:.2f}" for t in data.TASKS) + f" (what the model itself can do: "
            f"{path / 'README.md'})")
    print(f"\nrecall: dense attention mass inside what the sparse layers attended to; attn err: "
          f"relative L2 error of their attention output vs dense. Lychee's retrieval heads: "
          f"{doc['lychee_retrieval_heads']}; layer choices from the calibration shipped with "
          f"the model: {', '.join(doc['calibrated']) or 'none'}. CPU timings include no compile.")
    plot = Path(args.plot)
    evaluation.plot(doc, plot)
    print(f"plot: {plot.resolve()}  ({time.perf_counter() - t0:.0f} s)")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="every method on the embedded default model")
    p.add_argument("--context", type=int, default=768)
    p.add_argument("--samples", type=int, default=2, help="prompts per task")
    p.add_argument("--budget", type=float, default=0.1, help="budget ratio of the context")
    p.add_argument("--methods", default=DEMO_METHODS)
    p.add_argument("--plot", default="sparsejax-demo.png")
    p.set_defaults(func=run)
