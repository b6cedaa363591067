"""`sparsejax demo` (behind `make demo`): every method on the embedded default model.

Loads the small retrieval model shipped with the package (`sparsejax.embedded_model_path()`,
trained by `sparsejax pretrain`), runs a small eval of every registered method, RESA on DELTA
and lossless mode drafted by DELTA at one budget on the synthetic retrieval tasks it was
trained on, prints a table (method, budget, accuracy, recall, attention error, acceptance,
tokens/s) and writes a plot. `sparsejax eval` is the full harness.
"""
from __future__ import annotations

import time
from pathlib import Path

import jax.numpy as jnp

from sparsejax import methods as M

# every method once, RESA on DELTA, the README's example (at 4096 tokens RESA cuts DELTA's
# attention error the most of the four papers' methods), and DELTA drafting for dense
# attention (lossless: dense's accuracy): 8 prompts of 768 tokens, about 3 minutes on two
# CPU cores
DEMO_METHODS = ",".join([*M.REGISTRY, "delta+resa", "delta+spec"])


def run(args) -> int:
    import sparsejax
    from sparsejax import evaluation
    from sparsejax.files import check_writable
    from sparsejax.train import data

    plot = check_writable(args.plot, "--plot")
    names = evaluation.parse_methods(args.methods)
    gamma = evaluation.lossless_draft_tokens(args, names)
    ratios = evaluation.budget_ratios(args, args.context)
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
          f"tokens, {args.samples} prompts each, budget {', '.join(f'{r:.0%}' for r in ratios)} "
          "of the context")
    doc = evaluation.evaluate(
        model, tasks=data.TASKS, context=args.context, samples=args.samples,
        method_names=names, ratios=ratios, batch=args.samples * len(data.TASKS),
        model_dir=path, vocab=vocab, repeats=args.repeats, draft_tokens=gamma)
    overall = [r for r in doc["results"] if r["task"] == "all"]
    print(f"\n{'method':<14} {'budget':>6} {'accuracy':>8} {'recall':>7} {'attn err':>8} "
          f"{'accepted':>8} {'tokens/s':>9}  layers (D dense, S select, R reuse, H hybrid, "
          "F self-select)")
    for r in overall:
        print(f"{r['method']:<14} {r['budget_ratio']:>6.2f} {r['accuracy']:>8.3f} "
              f"{evaluation.fmt(r['mean_recall'], width=7)} "
              f"{evaluation.fmt(r['mean_attn_error'], width=8)} "
              f"{evaluation.fmt(r['acceptance_rate'], width=8)} {r['tokens_per_s']:>9.1f}  "
              f"{r['config']['roles']}")
    dense = {r["task"]: r["accuracy"] for r in doc["results"] if r["method"] == "dense"}
    if dense:
        print("\ndense accuracy per task: " + ", ".join(
            f"{t} {dense[t]:.2f}" for t in data.TASKS) + f" (what the model itself can do: "
            f"{path / 'README.md'})")
    print(f"\nrecall: dense attention mass inside what the sparse layers attended to; attn err: "
          f"relative L2 error of their attention output vs dense. Lychee's retrieval heads: "
          f"{doc['lychee_retrieval_heads']}; layer choices from the calibration shipped with "
          f"the model: {', '.join(doc['calibrated']) or 'none'}. tokens/s: median of "
          f"{args.repeats} runs after a warm-up, compile excluded.")
    if any(r["draft_tokens"] for r in overall):
        print(f"+spec: lossless mode, the method drafts {gamma} tokens per round and dense "
              "attention verifies them, so the tokens (and the accuracy) are dense's; accepted: "
              "the share of drafts the dense model kept.")
    if evaluation.speed_note():
        print(evaluation.speed_note())
    evaluation.plot(doc, plot)
    print(f"plot: {Path(plot).resolve()}  ({time.perf_counter() - t0:.0f} s)")
    return 0


def add_parser(sub) -> None:
    from sparsejax import evaluation
    from sparsejax.arguments import positive_int, ratio_list, token_list

    p = sub.add_parser("demo", help="every method on the embedded default model (make demo)")
    p.add_argument("--context", type=positive_int, default=768, help="prompt tokens")
    p.add_argument("--samples", type=positive_int, default=2, help="prompts per task")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--budget-ratio", type=ratio_list, default=[0.1],
                        help="comma-separated budgets as shares of the context")
    budget.add_argument("--budget-tokens", type=token_list, default=None,
                        help="comma-separated budgets in tokens (default: --budget-ratio)")
    p.add_argument("--methods", default=DEMO_METHODS,
                   help="comma-separated method names, each optionally with +resa, then +spec")
    evaluation.add_draft_tokens_arg(p)
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="timed runs per method after a warm-up (the median is reported)")
    p.add_argument("--plot", default="sparsejax-demo.png", help="the plot (PNG) to write")
    p.set_defaults(func=run)
