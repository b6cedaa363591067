"""Fidelity of every method on a real model (SmolLM2-135M-Instruct by default), on the long-
context tasks over real prose (`sparsejax.tasks`): accuracy, attention recall and attention-
output error per method, budget and context, with the fitted (calibrated / trained) layer
choices against the defaults scaled to the depth.

    python benchmarks/fidelity_real.py --model smollm2 --contexts 2048 4096 --samples 8 \\
        [--ratios 0.1 0.2] [--tasks passkey,niah,multikey,qa] [--methods ...]
    python benchmarks/fidelity_real.py plot          # results/fidelity_real.json -> .png
    python benchmarks/fidelity_real.py merge A.json B.json   # runs split by method -> --out

Every cell appends to results/fidelity_real.json as it finishes (a rerun skips the cells
already there), so a long run can be stopped and resumed.

How a cell runs: the prompts' dense forward pass is computed once per task and context, and
every method decodes greedily from the cache written from it (what `generate` does: its
prefill is this dense forward for every method here; none runs Kascade's sparse prefill),
with per-step diagnostics (`sparsejax.layers`: recall, oracle recall, attention error per
layer). Sharing the forward pass is what makes a table of ~20 methods per budget fit on a CPU.

Targets the table is read against: every seed method (DELTA, Kascade, Lychee with trained
gates, and RESA on each) at >= 95% of dense accuracy at a 10% budget on every cell where dense
is >= 0.75; RESA cutting each base method's attention-output error by >= 50%.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import sparsejax
from sparsejax import cache as kv
from sparsejax import methods as M
from sparsejax.generate import _decode_step
from sparsejax.layers import prefill_state
from sparsejax.models import forward, unembed

RESULTS = Path(__file__).resolve().parent / "results"
OUT = RESULTS / "fidelity_real.json"
TASKS = ("passkey", "niah", "multikey", "qa")
# name -> (registry method, fitted files used); "+resa" wraps it in RESA (λ = 1)
VARIANTS = {
    "dense": ("dense", True), "oracle": ("oracle", True), "streaming": ("streaming", True),
    "quest": ("quest", True), "tidal": ("tidal", True),
    "delta": ("delta", True), "delta@default": ("delta", False),
    "kascade": ("kascade", True), "kascade@default": ("kascade", False),
    "lychee": ("lychee", True), "lychee@random": ("lychee", False),
}
DEFAULT_METHODS = ("dense,oracle,streaming,quest,tidal,delta,delta@default,kascade,"
                   "kascade@default,lychee,lychee@random,oracle+resa,streaming+resa,quest+resa,"
                   "tidal+resa,delta+resa,kascade+resa,lychee+resa")
SEED = ("delta", "kascade", "lychee", "delta+resa", "kascade+resa", "lychee+resa")
DENSE_BAR = 0.75
TARGET_SHARE = 0.95
TARGET_RESA_CUT = 0.5


def build_method(name: str, config, tokens: int, ratio: float, fitted: M.Fitted):
    base, resa = name.removesuffix("+resa"), name.endswith("+resa")
    registry, use_fitted = VARIANTS[base]
    method = M.REGISTRY[registry].at_budget(config, M.Ratio(ratio),
                                            fitted if use_fitted else M.Fitted())
    return M.RESA(method) if resa else method


@jax.jit
def _forward(model, ids, lengths):
    out = forward(model, ids, lengths)
    last = jnp.take_along_axis(out.hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]
    return out._replace(hidden=None), jnp.argmax(unembed(model, last), -1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("plan", "steps"))
def _decode(model, out, first, lengths, *, plan, steps: int):
    """Greedy decoding of `steps` tokens from the prompt cache `out` (the dense forward's keys
    and values) under `plan`, with every step's diagnostics (as `generate` with
    return_diagnostics, without stopping at EOS: the score reads the text up to it)."""
    L, B, T = out.keys.shape[:3]
    cache = kv.allocate(model.config, B, T + steps, page_size=plan.page_size, dtype=model.dtype)
    cache = kv.write_prompt(cache, out.keys, out.values, lengths)
    cache = cache.replace(state=prefill_state(model, cache, out, plan))

    def body(carry, _):
        cache, token = carry
        logits, cache, diag = _decode_step(model, cache, token, plan, True)
        diag = {k: diag[k] for k in ("recall", "oracle_recall", "attn_error")}
        nxt = jnp.argmax(logits, -1).astype(jnp.int32)
        return (cache, nxt), (nxt, diag)

    _, (tokens, diag) = jax.lax.scan(body, (cache, first), None, length=steps - 1)
    return jnp.concatenate([first[:, None], tokens.T], axis=1), diag


def _text_until_eos(tokenizer, ids, eos):
    ids = list(ids)
    for i, t in enumerate(ids):
        if t in eos:
            ids = ids[:i]
            break
    return tokenizer.decode(ids, skip_special_tokens=True)


def run_cell(model, tokenizer, samples, prepared, method, eos, steps):
    """Accuracy, per-sample scores, per-layer recall / oracle recall / error (means over the
    steps each row generated before EOS or its sample's max_new_tokens, then rows), and the
    sparse layers' means. `steps`: tokens decoded, one number for every task of a context so
    that each method compiles once per context."""
    from sparsejax import tasks

    out, first, lengths = prepared
    plan = method.to_plan(model.config) if method is not None else None
    plan = plan or M.Dense().to_plan(model.config)
    tokens, diag = _decode(model, out, first, lengths, plan=plan, steps=steps)
    tokens = np.asarray(tokens)
    tokens = [row[:s.max_new_tokens] for row, s in zip(tokens, samples)]
    texts = [_text_until_eos(tokenizer, row, eos) for row in tokens]
    scores = [tasks.score(t, s.answers) for t, s in zip(texts, samples)]
    # diagnostics [steps - 1, L, B]: step j made token j + 1; count steps up to each row's EOS
    made = np.asarray([next((i for i, t in enumerate(row) if t in eos), len(row))
                       for row in tokens])
    valid = (np.arange(steps - 1)[:, None] < np.maximum(made - 1, 1)[None, :])[:, None, :]
    valid = valid.astype(np.float32)
    layer = {k: (np.asarray(v) * valid).sum(0) / valid.sum(0) for k, v in diag.items()}
    layer = {k: v.mean(axis=-1) for k, v in layer.items()}                       # [L]
    sparse = [i for i, r in enumerate(plan.roles) if r.name != "DENSE"]
    return {
        "accuracy": float(np.mean(scores)), "scores": [round(s, 3) for s in scores],
        "completions": texts[:2],
        "recall_per_layer": np.round(layer["recall"], 4).tolist(),
        "oracle_recall_per_layer": np.round(layer["oracle_recall"], 4).tolist(),
        "attn_error_per_layer": np.round(layer["attn_error"], 4).tolist(),
        "mean_recall": float(np.mean(layer["recall"][sparse])) if sparse else 1.0,
        "mean_attn_error": float(np.mean(layer["attn_error"][sparse])) if sparse else 0.0,
        "roles": "".join("DSRHF"[int(r)] for r in plan.roles),
    }


def _load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _save(doc: dict, path: Path) -> None:
    from sparsejax.files import write_text_atomic

    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(doc, indent=1) + "\n")


def measure(args) -> dict:
    from sparsejax import tasks

    model = sparsejax.from_pretrained(args.model, dtype=jnp.float32)
    tokenizer = sparsejax.load_tokenizer(args.model)
    fitted = M.fitted_beside(args.model, model)
    eos = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
    doc = _load(args.out) or {"model": str(Path(str(args.model)).name), "results": []}
    doc.update(device=jax.default_backend(), host=platform.machine(),
               samples_per_task=args.samples, fitted={
                   "calibration": {k: str(Path(v).relative_to(Path(v).parents[2]))
                                   for k, v in fitted.calibration.items()},
                   "lychee_retrieval_heads": None if fitted.retrieval_heads is None else int(
                       np.sum(np.asarray(fitted.retrieval_heads)[1:]))},
               fingerprint=sparsejax.artifacts.fingerprint(model).to_json())
    done = {(r["method"], r["budget_ratio"], r["context"], r["task"]) for r in doc["results"]}
    names = [n for n in args.methods.split(",") if n]
    for context in args.contexts:
        built = {task: [tasks.build(task, tokenizer, context, seed)
                        for seed in range(args.samples)] for task in args.tasks.split(",")}
        steps = max(s.max_new_tokens for samples in built.values() for s in samples)
        for task, samples in built.items():
            todo = [(n, r) for r in args.ratios for n in names
                    if (n, r if n != "dense" else None, context, task) not in done
                    and not (n == "dense" and (n, None, context, task) in done)]
            todo = list(dict.fromkeys((n, None if n == "dense" else r) for n, r in todo))
            if not todo:
                continue
            t0 = time.perf_counter()
            ids, lengths = tasks.prompt_batch(samples, tokenizer.pad_token_id or 0)
            width = -(-context // 16) * 16        # one shape per context: one compile
            ids = np.pad(ids, ((0, 0), (0, width - ids.shape[1])))
            out, first = _forward(model, jnp.asarray(ids), jnp.asarray(lengths))
            prepared = (out, first, jnp.asarray(lengths))
            print(f"[{context} {task}] forward {time.perf_counter() - t0:.0f}s", flush=True)
            dense_acc = next((r["accuracy"] for r in doc["results"] if r["method"] == "dense"
                              and r["context"] == context and r["task"] == task), None)
            for name, ratio in sorted(todo, key=lambda x: x[0] != "dense"):
                if name != "dense" and dense_acc is not None and dense_acc < DENSE_BAR:
                    continue              # the table reads only cells where dense can do it
                if name.startswith("lychee") and "@" not in name and fitted.retrieval_heads \
                        is None:
                    print(f"  {name}: no trained gates for this model, skipped", flush=True)
                    continue
                tokens = max(1, math.ceil((ratio or 1.0) * context))
                method = None if name == "dense" else build_method(
                    name, model.config, tokens, ratio, fitted)
                t0 = time.perf_counter()
                cell = run_cell(model, tokenizer, samples, prepared, method, eos, steps)
                cell.update(method=name, budget_ratio=ratio, context=context, task=task,
                            seconds=round(time.perf_counter() - t0, 1),
                            mean_prompt_tokens=float(np.mean(lengths)))
                if name == "dense":
                    dense_acc = cell["accuracy"]
                doc["results"].append(cell)
                doc["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(
                    timespec="seconds")
                _save(doc, args.out)
                print(f"  {name:<16} {ratio or '':>4} acc {cell['accuracy']:.2f} recall "
                      f"{cell['mean_recall']:.3f} err {cell['mean_attn_error']:.3f} "
                      f"({cell['seconds']}s)", flush=True)
    summarize(doc)
    _save(doc, args.out)
    return doc


def summarize(doc: dict) -> None:
    """doc["targets"]: each seed method's share of dense accuracy per cell where dense >= 0.75,
    and each base method's attention-error cut by RESA, against the targets."""
    results = doc["results"]
    dense = {(r["context"], r["task"]): r["accuracy"] for r in results if r["method"] == "dense"}
    share, cut = [], []
    for r in results:
        d = dense.get((r["context"], r["task"]))
        if r["method"] in SEED and d is not None and d >= DENSE_BAR:
            share.append({"method": r["method"], "budget_ratio": r["budget_ratio"],
                          "context": r["context"], "task": r["task"], "dense": d,
                          "accuracy": r["accuracy"], "share": round(r["accuracy"] / d, 3),
                          "meets": r["accuracy"] >= TARGET_SHARE * d})
        if r["method"].endswith("+resa"):
            base = next((b for b in results if b["method"] == r["method"][:-5]
                         and b["budget_ratio"] == r["budget_ratio"]
                         and b["context"] == r["context"] and b["task"] == r["task"]), None)
            if base is not None and base["mean_attn_error"] > 0:
                c = 1 - r["mean_attn_error"] / base["mean_attn_error"]
                cut.append({"method": r["method"][:-5], "budget_ratio": r["budget_ratio"],
                            "context": r["context"], "task": r["task"],
                            "error": round(base["mean_attn_error"], 4),
                            "error_resa": round(r["mean_attn_error"], 4), "cut": round(c, 3),
                            "meets": c >= TARGET_RESA_CUT})
    doc["targets"] = {
        "accuracy": {"rule": f"seed method >= {TARGET_SHARE:.0%} of dense where dense >= "
                     f"{DENSE_BAR}", "cells": share,
                     "met": sum(c["meets"] for c in share), "of": len(share)},
        "resa_error_cut": {"rule": f"RESA cuts the base method's mean attention error "
                           f"(sparse layers) by >= {TARGET_RESA_CUT:.0%}", "cells": cut,
                           "met": sum(c["meets"] for c in cut), "of": len(cut)}}


def plot(doc: dict, path: Path) -> None:
    """Accuracy (top) and attention error (bottom) per method, one column per context and
    budget, averaged over the tasks where dense >= 0.75."""
    from sparsejax.plotting import figure, save

    results = doc["results"]
    dense = {(r["context"], r["task"]): r["accuracy"] for r in results if r["method"] == "dense"}
    cols = sorted({(r["context"], r["budget_ratio"]) for r in results
                   if r["budget_ratio"] is not None})
    methods = list(dict.fromkeys(r["method"] for r in results if r["method"] != "dense"))
    fig, axes = figure(2, max(1, len(cols)), figsize=(5 * max(1, len(cols)), 7))
    for j, (context, ratio) in enumerate(cols):
        rows = [r for r in results if r["context"] == context and r["budget_ratio"] == ratio
                and dense.get((context, r["task"]), 0) >= DENSE_BAR]
        ok = [t for (c, t), a in dense.items() if c == context and a >= DENSE_BAR]
        dense_mean = np.mean([dense[context, t] for t in ok]) if ok else np.nan
        for i, key in enumerate(("accuracy", "mean_attn_error")):
            ax = axes[i][j]
            vals = [np.mean([r[key] for r in rows if r["method"] == m] or [np.nan])
                    for m in methods]
            colors = ["tab:red" if m.endswith("+resa") else "tab:blue" for m in methods]
            ax.bar(range(len(methods)), vals, color=colors)
            if key == "accuracy":
                ax.axhline(dense_mean, color="black", ls="--", label="dense")
                ax.axhline(TARGET_SHARE * dense_mean, color="gray", ls=":",
                           label="95% of dense")
                ax.legend(fontsize=7)
            ax.set_xticks(range(len(methods)))
            ax.set_xticklabels(methods, rotation=70, fontsize=7)
            ax.set_title(f"{context} tokens, budget {ratio:.0%}: "
                         f"{'accuracy' if i == 0 else 'attention error (sparse layers)'}",
                         fontsize=9)
    fig.suptitle(f"{doc.get('model', '')} on real prose ({doc.get('device')}, "
                 f"{doc.get('samples_per_task')} prompts a task; tasks: {', '.join(sorted({r['task'] for r in results}))})",
                 fontsize=10)
    save(fig, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("command", nargs="?", default="measure", choices=["measure", "plot", "merge"])
    p.add_argument("inputs", nargs="*", type=Path, help="merge: result files (a later one's "
                   "cell replaces an earlier one's)")
    p.add_argument("--model", default="smollm2", help="checkpoint directory, .gguf or name")
    p.add_argument("--contexts", type=int, nargs="+", default=[2048])
    p.add_argument("--ratios", type=float, nargs="+", default=[0.1, 0.2])
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--samples", type=int, default=8, help="prompts per task")
    p.add_argument("--methods", default=DEFAULT_METHODS)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    if args.command == "merge":
        docs = [_load(p) for p in args.inputs]
        cells = {(r["method"], r["budget_ratio"], r["context"], r["task"]): r
                 for d in docs for r in d["results"]}
        doc = dict(docs[0], results=list(cells.values()), merged_from=[p.name for p in
                                                                       args.inputs])
    else:
        doc = measure(args) if args.command == "measure" else _load(args.out)
    if args.command != "measure":
        summarize(doc)
        _save(doc, args.out)
    plot(doc, args.out.with_suffix(".png"))
    print(json.dumps({k: {kk: v[kk] for kk in ("met", "of")} for k, v in
                      doc["targets"].items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
