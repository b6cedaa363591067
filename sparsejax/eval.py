"""Task accuracy, attention recall, attention-output error and speed of every method.

    sparsejax eval --model DIR --task niah,vt --context 4096 --samples 20 \
        --methods dense,delta,kascade,lychee,quest,tidal,streaming,oracle,delta+resa \
        --budget-ratio 0.1,0.25 --json out.json --plot out.png

Tasks are the synthetic long-context tasks of `sparsejax.train.data` (exact-match answers).
Each method runs greedy `generate` twice: once with diagnostics (accuracy, and per decode step
and layer the recall and attention-output error against dense attention), once without them
for tokens/s (compiled ahead of time once per method, so the compile is excluded). Methods'
layer choices are scaled to the model's depth (`methods.budget_ratio_methods`); the chosen
layers are in the output. What was trained or calibrated for the model and ships beside it is
used: Lychee's gates (`gates/*.json`, the first by name; random retrieval heads when there are
none), DELTA's Δ-layers and Kascade's anchors and head map (`calibration/delta.json`,
`calibration/kascade.json`, made by `sparsejax calibrate`; `--no-calibration` keeps the
defaults).
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from sparsejax import methods as M
from sparsejax.generate import compile_generate, generate
from sparsejax.plan import Role

METHOD_NAMES = ("dense", "oracle", "streaming", "quest", "tidal", "delta", "kascade", "lychee")


def parse_methods(spec: str) -> list[str]:
    """'dense,delta+resa,...' -> names; each a method name with an optional '+resa'."""
    names = [m.strip() for m in spec.split(",") if m.strip()]
    for name in names:
        base = name.removesuffix("+resa")
        if base not in METHOD_NAMES or (name.endswith("+resa") and base == "dense"):
            raise ValueError(f"--methods entry {name!r}: expected one of {METHOD_NAMES}, "
                             "optionally with '+resa' (not for dense)")
    return names


def shipped_retrieval_heads(model_dir: Path | None):
    """Retrieval heads trained for the model and shipped beside it (gates/), if any."""
    if model_dir is None:
        return None
    gates = Path(model_dir) / "gates"
    if not gates.is_dir():
        return None
    from sparsejax.train.gates import load_retrieval_heads

    candidates = sorted(p for p in gates.iterdir() if p.suffix == ".json")
    return load_retrieval_heads(candidates[0]) if candidates else None


def shipped_calibration(model_dir: Path | None, model) -> dict[str, Path]:
    """Calibration files shipped beside the model (calibration/<method>.json), by method;
    each is checked to be made for these weights (a stale one is an error, not skipped)."""
    if model_dir is None:
        return {}
    from sparsejax.calibrate import load_calibration

    paths = {kind: Path(model_dir) / "calibration" / f"{kind}.json"
             for kind in ("delta", "kascade")}
    found = {kind: path for kind, path in paths.items() if path.is_file()}
    for kind, path in found.items():
        load_calibration(path, kind, model=model)
    return found


def build_methods(config, names, ratio: float, context: int, retrieval_heads=None,
                  calibration=None) -> dict:
    base = M.budget_ratio_methods(config, ratio, context, retrieval_heads=retrieval_heads,
                                  calibration=calibration)
    out = {}
    for name in names:
        method = base[name.removesuffix("+resa")]
        out[name] = M.RESA(method) if name.endswith("+resa") else method
    return out


def describe(method, config) -> dict:
    """The plan a method runs on this model: name, roles, unit, budget (for the output)."""
    plan = method.to_plan(config, None)
    d = {"plan": plan.name, "page_size": plan.page_size,
         "roles": "".join("DSRHF"[int(r)] for r in plan.roles)}
    if plan.selector is not None:
        s = plan.selector
        d.update(score=s.score, unit=s.unit, groups=s.groups, budget=dataclasses.asdict(s.budget),
                 sinks=s.sinks, recent=s.recent)
    if plan.retrieval is not None:
        d["retrieval_heads"] = int(np.sum(np.asarray(plan.retrieval)[1:]))
    if plan.residual is not None:
        d["resa_lambda"] = plan.residual.lam
    return d


def _valid_steps(num_generated: np.ndarray, steps: int) -> np.ndarray:
    """[steps, B] mask of decode steps each row actually ran (diagnostics index s made token
    s + 1)."""
    return np.arange(steps)[:, None] < (num_generated[None, :] - 1)


def run_method(model, samples, method, *, batch: int, max_new_tokens: int,
               timing: bool = True, correct_every: int | None = None) -> list[dict]:
    """Per sample: correct, and per-layer recall / oracle recall / attention error averaged
    over the decode steps it ran; plus the batch's tokens/s (compile excluded) when `timing`."""
    from sparsejax.train import data

    rows, run = [], None
    batch = min(batch, len(samples))
    for start in range(0, len(samples), batch):
        chunk = samples[start:start + batch]
        # the last batch is padded with repeats of its first prompt: one shape, one compile
        ids, lengths = data.prompt_batch(chunk + chunk[:1] * (batch - len(chunk)))
        kw = dict(lengths=lengths, max_new_tokens=max_new_tokens, method=method,
                  eos_token_id=data.EOS_ID, correct_every=correct_every)
        out = generate(model, ids, return_diagnostics=True, **kw)
        toks, num = np.asarray(out.tokens), np.asarray(out.num_generated)
        diag = {k: np.asarray(out.diagnostics[k], np.float64)
                for k in ("recall", "oracle_recall", "attn_error")}        # [steps, L, B]
        mask = _valid_steps(num, diag["recall"].shape[0])[:, None, :]
        steps = np.maximum(mask.sum(0), 1)                                   # [1, B]
        per_row = {k: np.sum(np.where(mask, v, 0.0), axis=0) / steps for k, v in diag.items()}
        tokens_per_s = None
        if timing:
            if run is None:     # every batch has one shape: one compile per method
                run = compile_generate(model, ids, **kw)
            t0 = time.perf_counter()
            timed = run(ids, lengths)
            jax.block_until_ready(timed.tokens)
            tokens_per_s = float(np.sum(np.asarray(timed.num_generated)[:len(chunk)])) / (
                time.perf_counter() - t0)
        for i, sample in enumerate(chunk):
            rows.append({"task": sample.task, "correct": data.check_answer(toks[i], sample),
                         "tokens_per_s": tokens_per_s,
                         **{k: v[:, i] for k, v in per_row.items()}})
    return rows


def summarize(rows: list[dict], method, config, task: str) -> dict:
    """Accuracy, per-layer means, and the mean recall / error over layers that attend sparsely."""
    rows = [r for r in rows if task == "all" or r["task"] == task]
    plan = method.to_plan(config, None)
    sparse = [i for i, role in enumerate(plan.roles) if role not in (Role.DENSE, Role.SELECT)]
    layer = {k: np.mean([r[k] for r in rows], axis=0)
             for k in ("recall", "oracle_recall", "attn_error")}
    return {
        "task": task, "accuracy": float(np.mean([r["correct"] for r in rows])),
        "correct": int(sum(r["correct"] for r in rows)), "samples": len(rows),
        "recall_per_layer": layer["recall"].round(5).tolist(),
        "oracle_recall_per_layer": layer["oracle_recall"].round(5).tolist(),
        "attn_error_per_layer": layer["attn_error"].round(5).tolist(),
        "sparse_layers": sparse,
        "mean_recall": round(float(np.mean(layer["recall"][sparse])), 5) if sparse else 1.0,
        "mean_attn_error": round(float(np.mean(layer["attn_error"][sparse])), 5) if sparse else 0.0,
        "tokens_per_s": (None if rows[0]["tokens_per_s"] is None else
                         round(float(np.mean([r["tokens_per_s"] for r in rows])), 2)),
    }


def evaluate(model, *, tasks, context: int, samples: int, ratios, method_names=(),
             methods=None, seed: int = 0, batch: int = 8, model_dir=None, vocab=None,
             timing: bool = True, calibrated: bool = True, progress=print,
             correct_every: int | None = None, sparse_prefill: bool = False) -> dict:
    """Every method at every budget ratio on `samples` prompts of each task (tasks share
    batches: every prompt has exactly `context` tokens). One result per method, ratio and
    task, plus task "all". Methods are `method_names` (see `parse_methods`) scaled to the
    model, with the calibration shipped beside it unless `calibrated` is False, or
    `methods(ratio) -> {name: method}` for any others. `correct_every` and `sparse_prefill`
    (Kascade's) apply to every method they concern."""
    from sparsejax.train import data

    retrieval = shipped_retrieval_heads(model_dir)
    calibration = shipped_calibration(model_dir, model) if calibrated and methods is None else {}
    doc = {"model": str(model_dir) if model_dir else None, "tasks": list(tasks),
           "context": context, "samples_per_task": samples, "seed": seed,
           "device": getattr(jax.devices()[0], "device_kind", jax.default_backend()),
           "jax_version": jax.__version__, "date": datetime.date.today().isoformat(),
           "lychee_retrieval_heads": "shipped gates" if retrieval is not None else
           "random (no gates shipped with the model)",
           "calibrated": sorted(calibration), "correct_every": correct_every,
           "sparse_prefill": sparse_prefill, "results": []}
    prompts = [data.make_sample(t, context, seed, i, vocab) for i in range(samples) for t in tasks]
    for ratio in ratios:
        chosen = (methods(ratio) if methods is not None else
                  build_methods(model.config, method_names, ratio, context, retrieval,
                                calibration))
        for name, method in chosen.items():
            if sparse_prefill and isinstance(method, M.Kascade):
                method = dataclasses.replace(method, sparse_prefill=True)
            t0 = time.perf_counter()
            rows = run_method(model, prompts, method, batch=batch,
                              max_new_tokens=data.MAX_ANSWER_TOKENS, timing=timing,
                              correct_every=correct_every)
            for task in list(tasks) + (["all"] if len(tasks) > 1 else []):
                res = summarize(rows, method, model.config, task)
                res.update(method=name, budget_ratio=ratio, config=describe(method, model.config))
                doc["results"].append(res)
            overall = doc["results"][-1]
            progress(f"{name:<16} ratio {ratio:<5} acc {overall['accuracy']:.3f} "
                     f"recall {overall['mean_recall']:.3f} err {overall['mean_attn_error']:.3f} "
                     f"{_speed(overall['tokens_per_s'])} tok/s ({time.perf_counter() - t0:.0f}s)")
    return doc


def _speed(tokens_per_s) -> str:
    return "-" if tokens_per_s is None else f"{tokens_per_s:.1f}"


def table(doc: dict) -> str:
    rows = [f"{'method':<16} {'budget':>6} {'task':<10} {'accuracy':>8} {'recall':>7} "
            f"{'attn err':>8} {'tokens/s':>9}"]
    for r in doc["results"]:
        rows.append(f"{r['method']:<16} {r['budget_ratio']:>6} {r['task']:<10} "
                    f"{r['accuracy']:>8.3f} {r['mean_recall']:>7.3f} {r['mean_attn_error']:>8.3f} "
                    f"{_speed(r['tokens_per_s']):>9}")
    return "\n".join(rows)


def plot(doc: dict, path: Path) -> None:
    """Accuracy and recall against the budget ratio, one line per method (mean over tasks)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    overall = "all" if len(doc["tasks"]) > 1 else doc["tasks"][0]
    results = [r for r in doc["results"] if r["task"] == overall]
    methods = list(dict.fromkeys(r["method"] for r in results))
    # one colour per base method; its RESA variant dashed in the same colour
    bases = list(dict.fromkeys(m.removesuffix("+resa") for m in methods))
    colours = plt.get_cmap("tab20" if len(bases) > 10 else "tab10")
    for name in methods:
        rs = [r for r in results if r["method"] == name]
        ratios = sorted({r["budget_ratio"] for r in rs})
        style = dict(marker="o", label=name, color=colours(bases.index(name.removesuffix("+resa"))),
                     linestyle="--" if name.endswith("+resa") else "-")
        for ax, key in zip(axes, ("accuracy", "mean_recall")):
            ax.plot(ratios, [np.mean([r[key] for r in rs if r["budget_ratio"] == x])
                             for x in ratios], **style)
    for ax, title in zip(axes, ("task accuracy (exact match)", "attention recall, sparse layers")):
        ax.set_xlabel("budget ratio")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8, loc="center left", bbox_to_anchor=(1.02, 0.5))
    fig.suptitle(f"{Path(doc['model'] or 'model').name}, context {doc['context']}, "
                 f"{', '.join(doc['tasks'])}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="accuracy / recall / error / speed of every method")
    p.add_argument("--model", default=None, help="HF checkpoint dir (default: the embedded model)")
    p.add_argument("--task", default="niah,multikey,multivalue,vt",
                   help="comma-separated: niah, multikey, multivalue, vt")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--samples", type=int, default=8, help="samples per task")
    p.add_argument("--methods", default=",".join(METHOD_NAMES))
    p.add_argument("--budget-ratio", default="0.1", help="comma-separated budget ratios")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    p.add_argument("--no-calibration", action="store_true",
                   help="DELTA/Kascade layer choices from the defaults scaled to the depth, not "
                   "from the calibration shipped beside the model")
    p.add_argument("--no-timing", action="store_true",
                   help="skip the tokens/s runs (half the generate calls)")
    p.add_argument("--correct-every", type=int, default=None, metavar="N",
                   help="cache correction: re-run every N generated tokens densely")
    p.add_argument("--sparse-prefill", action="store_true", help="Kascade's sparse prefill")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--plot", default=None, help="write the accuracy/recall plot here (PNG)")
    p.set_defaults(func=run)


def run(args) -> int:
    import sparsejax
    from sparsejax.train import data

    model_dir = Path(args.model) if args.model else sparsejax.embedded_model_path()
    model = sparsejax.from_pretrained(model_dir, dtype=jnp.float32 if args.dtype == "f32"
                                      else jnp.bfloat16)
    tasks = [t.strip() for t in args.task.split(",") if t.strip()]
    for t in tasks:
        if t not in data.TASKS:
            raise ValueError(f"--task {t!r}: expected some of {data.TASKS}")
    ratios = [float(r) for r in args.budget_ratio.split(",")]
    for r in ratios:
        if not 0 < r <= 1:
            raise ValueError(f"--budget-ratio {r}: expected 0 < ratio <= 1")
    vocab = sparsejax.load_tokenizer(model_dir).get_vocab()
    doc = evaluate(model, tasks=tasks, context=args.context, samples=args.samples,
                   method_names=parse_methods(args.methods), ratios=ratios, seed=args.seed,
                   batch=args.batch, model_dir=model_dir, vocab=vocab,
                   timing=not args.no_timing, calibrated=not args.no_calibration,
                   correct_every=args.correct_every, sparse_prefill=args.sparse_prefill,
                   progress=lambda s: print(s, file=sys.stderr, flush=True))
    print(table(doc))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        plot(doc, Path(args.plot))
        print(f"wrote {args.plot}")
    return 0
