"""Fidelity of the sparse methods on the embedded model (CPU is enough: the model is small).

    python benchmarks/fidelity.py merge A.json B.json ...      -> results/fidelity.json and
                                                              fidelity_{accuracy,recall,error}.png
    python benchmarks/fidelity.py resa results/fidelity.json   -> results/resa_error.json
    python benchmarks/fidelity.py gates --gates DIR_4 DIR_8    -> results/gates.json
    python benchmarks/fidelity.py calibration --delta D.json --kascade K.json
                                                              -> results/calibration.json
    python benchmarks/fidelity.py kv-dtype --kv-dtype bf16,fp8 -> results/fidelity_kv_dtype.json
    python benchmarks/fidelity.py kv-dtype --model smollm2 --task niah --out F.json

`merge` joins `sparsejax eval --json` outputs of one model, context and task set (e.g. runs
split by method). `resa` reads the attention-output error of every base method with and
without RESA at one budget ratio. `gates` compares Lychee with trained gates against random
retrieval heads of the same count; `calibration` compares calibrated layer choices against
evenly spaced ones. Both run the eval harness on the shipped model. `kv-dtype` runs dense
and every method (the eval harness, at one budget ratio) over KV caches of each `--kv-dtype`
(the first is the baseline): each cell's accuracy, recall and attention error per cache
dtype and the accuracy's change in points; and dense attention's output error with each
cache against the model's own dtype (f32) on the same prompts.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
_SAME = ("model", "tasks", "context", "samples_per_task", "seed")


def _write(doc: dict, path: Path) -> None:
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {path}")


def _flat(values):
    """Values and lists of values (a merged document's) as one stream."""
    for v in values:
        yield from (v if isinstance(v, list) else [v])


def merge(paths: list[Path]) -> dict:
    """One document from several runs; a later run's result replaces an earlier one of the
    same method, ratio and task (so a partial rerun merges into a full table)."""
    docs = [json.loads(p.read_text()) for p in paths]

    def same(d, key):  # the model by its folder name: runs on other machines have other roots
        if key == "kv_dtype":      # runs from before the option read the model's dtype
            return d.get(key, "auto")
        return Path(d[key]).name if key == "model" and d[key] else d[key]
    for p, d in zip(paths[1:], docs[1:]):
        for key in _SAME + ("kv_dtype",):
            if same(d, key) != same(docs[0], key):
                raise ValueError(f"{p}: {key}={same(d, key)!r}, but {paths[0]} has "
                                 f"{same(docs[0], key)!r}")
    results = {(r["method"], r["budget_ratio"], r["task"]): dict(r, date=r.get("date", d["date"]))
               for d in docs for r in d["results"]}  # each result keeps its run's date
    out = dict(docs[0], results=list(results.values()), date=max(d["date"] for d in docs),
               lychee_retrieval_heads=sorted(set(_flat(d["lychee_retrieval_heads"] for d in docs))),
               calibrated=sorted({c for d in docs for c in d.get("calibrated", [])}),
               merged_from=[p.name for p in paths])
    return out


QUESTIONS = {
    "accuracy": ("accuracy", "How often does each method still answer exactly?"),
    "recall": ("mean_recall", "How much of dense attention's mass does each method attend to?"),
    "error": ("mean_attn_error", "How far is each method's attention output from dense, "
              "and how much does RESA close the gap?"),
}


def plot_questions(doc: dict, directory: Path) -> list[Path]:
    """One PNG per question: fidelity_accuracy.png, fidelity_recall.png, fidelity_error.png."""
    from sparsejax import evaluation

    return [evaluation.plot(doc, directory / f"fidelity_{name}.png", metrics=[key],
                            title=f"{question}\n{Path(doc['model']).name}, {doc['context']} "
                            f"tokens, {', '.join(doc['tasks'])}" + (
                                "; hatched: with RESA" if evaluation.has_resa(
                                    r["method"] for r in doc["results"]) else ""))
            for name, (key, question) in QUESTIONS.items()]


def resa_table(fidelity: dict, ratio: float) -> dict:
    """Per base method: mean attention-output error of its sparse layers without and with RESA,
    per layer too, and the reduction."""
    overall = "all" if len(fidelity["tasks"]) > 1 else fidelity["tasks"][0]
    by_name = {r["method"]: r for r in fidelity["results"]
               if r["task"] == overall and r["budget_ratio"] == ratio}
    rows = []
    for name, with_resa in by_name.items():
        if not name.endswith("+resa") or name.removesuffix("+resa") not in by_name:
            continue
        base = by_name[name.removesuffix("+resa")]
        layers = base["sparse_layers"]
        rows.append({
            "method": base["method"], "sparse_layers": layers,
            "attn_error": base["mean_attn_error"], "attn_error_resa": with_resa["mean_attn_error"],
            "reduction": round(1 - with_resa["mean_attn_error"] / base["mean_attn_error"], 4),
            "attn_error_per_layer": [base["attn_error_per_layer"][i] for i in layers],
            "attn_error_resa_per_layer": [with_resa["attn_error_per_layer"][i] for i in layers],
            "accuracy": base["accuracy"], "accuracy_resa": with_resa["accuracy"],
        })
    keys = ("model", "tasks", "context", "samples_per_task", "device", "jax_version", "date")
    return {**{k: fidelity[k] for k in keys}, "budget_ratio": ratio, "resa_lambda": 1.0,
            "rows": rows}


def _load(name=None):
    """-> (path, the model in f32, its tokenizer): the embedded model unless `name` (a
    checkpoint directory, a .gguf file or a packaged name such as smollm2)."""
    import jax.numpy as jnp

    import sparsejax

    path = name or sparsejax.embedded_model_path()
    return path, sparsejax.from_pretrained(path, dtype=jnp.float32), \
        sparsejax.load_tokenizer(path)


def _run(methods, args) -> dict:
    from sparsejax import evaluation

    path, model, tokenizer = _load()
    vocab = tokenizer.get_vocab()
    return evaluation.evaluate(
        model, tasks=args.task.split(","), context=args.context, samples=args.samples,
        ratios=[args.ratio], methods=lambda ratio: methods(model, ratio), batch=args.batch,
        model_dir=path, vocab=vocab, timing=False,
        progress=lambda s: print(s, file=sys.stderr, flush=True))


def gates(args) -> dict:
    import math

    from sparsejax import methods as M
    from sparsejax.artifacts import load_retrieval_heads

    def build(model, ratio):
        tokens = max(1, math.ceil(ratio * args.context))
        kw = dict(budget=M.TopK(tokens), sinks=min(128, tokens // 8), recent=min(256, tokens // 4))
        out = {"dense": M.Dense()}
        for directory in args.gates:
            heads = np.asarray(load_retrieval_heads(directory))
            count = int(heads[1:].sum())
            out[f"lychee trained {count}"] = M.Lychee(heads, **kw)
            out[f"lychee random {count}"] = M.Lychee(
                M.random_retrieval_heads(model.config, count, seed=args.seed), **kw)
        return out

    return _run(build, args)


def calibration(args) -> dict:
    from sparsejax import methods as M

    def build(model, ratio):
        L = model.config.num_layers
        base = M.budget_ratio_methods(model.config, ratio)
        delta, kascade = base["delta"], base["kascade"]
        calibrated_delta = M.DELTA.from_calibration(args.delta, model, ratio=delta.ratio,
                                                    recent_pages=delta.recent_pages)
        calibrated_kascade = M.Kascade.from_calibration(args.kascade, model, ratio=ratio,
                                                        min_k=kascade.min_k)
        count = len(calibrated_delta.delta_layers)
        anchors = len(calibrated_kascade.anchor_layers)
        even_delta = tuple(int(x) for x in np.round(np.linspace(2, L - 1, count)))
        even_anchors = tuple(int(x) for x in np.round(np.linspace(0, L - 1, anchors)))
        return {
            "dense": M.Dense(),
            f"delta calibrated {calibrated_delta.delta_layers}": calibrated_delta,
            f"delta even {even_delta}": M.DELTA(delta_layers=even_delta, ratio=delta.ratio,
                                                recent_pages=delta.recent_pages),
            f"kascade calibrated {calibrated_kascade.anchor_layers}": calibrated_kascade,
            f"kascade even {even_anchors}": M.Kascade(anchor_layers=even_anchors, ratio=ratio,
                                                      min_k=kascade.min_k),
        }

    return _run(build, args)


def dense_attention_error(model, samples, kv_dtypes, *, batch: int, task_set) -> dict:
    """Per cache dtype: the relative L2 error of each layer's attention block output at the
    first decode step, dense attention over a cache of that dtype against the model's own
    dtype (mean over rows and layers, and per layer). The step's input is the same for every
    cache (the prompt's forward pass does not read the cache); its attention reads the cache."""
    import jax.numpy as jnp

    from sparsejax import generate

    def blocks(kv_dtype):
        out = []
        for start in range(0, len(samples), batch):
            ids, lengths = task_set.batch(samples[start:start + batch])
            d = generate(model, ids, lengths=lengths, max_new_tokens=2, eos_token_id=(),
                         return_diagnostics=True, kv_dtype=kv_dtype, prefill_chunk=0)
            out.append(np.asarray(d.diagnostics["attn_block"][0], np.float64))   # [L, B, H]
        return np.concatenate(out, axis=1)

    want = blocks(None)
    doc = {}
    for kv_dtype in kv_dtypes:
        got = blocks(kv_dtype)
        err = np.linalg.norm(got - want, axis=-1) / np.maximum(np.linalg.norm(want, axis=-1),
                                                               1e-30)      # [L, rows]
        doc[kv_dtype] = {"mean": float(err.mean()), "max": float(err.max()),
                         "per_layer": [round(float(e), 6) for e in err.mean(axis=1)]}
    doc["reference"] = str(jnp.dtype(model.dtype))
    return doc


def kv_dtype_table(args) -> dict:
    """Dense and every method with each KV cache dtype (see the module's docstring)."""
    from sparsejax import evaluation

    path, model, tokenizer = _load(args.model)
    vocab = tokenizer.get_vocab()
    kv_dtypes = [k.strip() for k in args.kv_dtype.split(",") if k.strip()]
    names = evaluation.parse_methods(args.methods)
    tasks = args.task.split(",")
    runs = {}
    for kv_dtype in kv_dtypes:
        runs[kv_dtype] = evaluation.evaluate(
            model, tasks=tasks, context=args.context, samples=args.samples, ratios=[args.ratio],
            method_names=names, batch=args.batch, model_dir=path, vocab=vocab, timing=False,
            seed=args.seed, kv_dtype=kv_dtype, tokenizer=tokenizer,
            progress=lambda s, k=kv_dtype: print(f"[{k}] {s}", file=sys.stderr, flush=True))
    base = kv_dtypes[0]
    cells = {}
    for kv_dtype, doc in runs.items():
        for r in doc["results"]:
            cell = cells.setdefault((r["method"], r["task"]),
                                    {"method": r["method"], "task": r["task"]})
            for key in ("accuracy", "mean_recall", "mean_attn_error"):
                cell[f"{key}_{kv_dtype}"] = r[key]
    rows = list(cells.values())
    for row in rows:
        for kv_dtype in kv_dtypes[1:]:
            row[f"accuracy_points_{kv_dtype}_vs_{base}"] = round(
                100 * (row[f"accuracy_{kv_dtype}"] - row[f"accuracy_{base}"]), 2)
    first = runs[base]
    task_set = evaluation.task_set(tokenizer, tasks, args.context)
    samples = task_set.samples(tasks, args.context, args.samples, args.seed, vocab)
    keys = ("model", "tasks", "task_set", "context", "samples_per_task", "seed", "device",
            "jax_version", "date", "lychee_retrieval_heads", "calibrated")
    return {**{k: first[k] for k in keys}, "budget_ratio": args.ratio, "kv_dtypes": kv_dtypes,
            "baseline": base, "rows": rows,
            "largest_accuracy_change_points": {
                k: max(abs(r[f"accuracy_points_{k}_vs_{base}"]) for r in rows)
                for k in kv_dtypes[1:]},
            "dense_attention_error_vs_model_dtype": dense_attention_error(
                model, samples, kv_dtypes, batch=args.batch, task_set=task_set),
            "runs": runs}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("merge")
    m.add_argument("inputs", nargs="+", type=Path)
    m.add_argument("--out", type=Path, default=RESULTS / "fidelity.json")
    m.add_argument("--plots", type=Path, default=RESULTS, help="directory for the PNGs")
    r = sub.add_parser("resa")
    r.add_argument("fidelity", type=Path)
    r.add_argument("--ratio", type=float, default=0.1)
    r.add_argument("--out", type=Path, default=RESULTS / "resa_error.json")
    for name in ("gates", "calibration", "kv-dtype"):
        s = sub.add_parser(name)
        s.add_argument("--task", default="niah,multivalue")
        s.add_argument("--context", type=int, default=2048)
        s.add_argument("--samples", type=int, default=8)
        s.add_argument("--ratio", type=float, default=0.1)
        s.add_argument("--batch", type=int, default=8)
        s.add_argument("--seed", type=int, default=0)
        s.add_argument("--out", type=Path, default=RESULTS / (
            "fidelity_kv_dtype.json" if name == "kv-dtype" else f"{name}.json"))
        if name == "kv-dtype":
            s.add_argument("--model", default=None, help="a checkpoint directory, .gguf "
                           "file or 'smollm2' (default: the embedded model; a real tokenizer "
                           "runs the prose tasks)")
            s.add_argument("--kv-dtype", default="bf16,fp8",
                           help="KV cache dtypes, comma-separated, the baseline first "
                           "(auto, bf16, f32, fp8)")
            s.add_argument("--methods", default="dense,oracle,streaming,quest,tidal,delta,"
                           "kascade,lychee,delta+resa", help="as sparsejax eval's --methods")
        elif name == "gates":
            s.add_argument("--gates", nargs="+", required=True,
                           help="gate files or directories (one per head count)")
        else:
            s.add_argument("--delta", required=True, help="DELTA calibration JSON")
            s.add_argument("--kascade", required=True, help="Kascade calibration JSON")
    args = p.parse_args(argv)
    if args.command == "merge":
        from sparsejax import evaluation

        doc = merge(args.inputs)
        plot_questions(doc, args.plots)
        print(evaluation.table(doc))
    elif args.command == "resa":
        doc = resa_table(json.loads(args.fidelity.read_text()), args.ratio)
        for row in doc["rows"]:
            print(f"{row['method']:<10} attention error {row['attn_error']:.3f} -> "
                  f"{row['attn_error_resa']:.3f} with RESA (reduced by {row['reduction']:.0%})")
    elif args.command == "kv-dtype":
        doc = kv_dtype_table(args)
        base = doc["baseline"]
        for row in doc["rows"]:
            print(f"{row['method']:<12} {row['task']:<10} " + "  ".join(
                f"{k} acc {row[f'accuracy_{k}']:.3f} err {row[f'mean_attn_error_{k}'] or 0:.4f}"
                for k in doc["kv_dtypes"]) + "".join(
                f"  {k}-{base} {row[f'accuracy_points_{k}_vs_{base}']:+.1f} pts"
                for k in doc["kv_dtypes"][1:]))
        print("dense attention-block error vs the model's dtype:",
              {k: v["mean"] for k, v in doc["dense_attention_error_vs_model_dtype"].items()
               if k != "reference"})
    else:
        doc = gates(args) if args.command == "gates" else calibration(args)
        from sparsejax import evaluation
        print(evaluation.table(doc))
    _write(doc, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
