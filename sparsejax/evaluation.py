"""Task accuracy, attention recall, attention-output error and speed of every method.

    sparsejax eval --model DIR --task niah,vt --context 4096 --samples 20 \
        --methods dense,delta,kascade,lychee,quest,tidal,streaming,oracle,delta+resa \
        --budget-ratio 0.1,0.25 --json out.json --plot out.png

Tasks: a model whose tokenizer is the synthetic tasks' vocabulary (`sparsejax.train.tokenizer`,
as the embedded model's) runs the synthetic tasks of `sparsejax.train.data` (niah, multikey,
multivalue, vt: exact-match answer tokens); any other model runs the tasks of the same names on
real prose, and passkey, cwe and qa, from `sparsejax.tasks` (RULER's prompts, chat-templated
where the tokenizer has a template; scored by the share of expected answers the completion
contains).
Each method runs greedy `generate` with diagnostics (accuracy, and per decode step and layer
the recall and attention-output error against dense attention), then without them for tokens/s:
compiled ahead of time, one warm-up run, the median of `repeats` timed runs. Methods are the
registry's (`methods.REGISTRY`) at each budget, layer choices scaled to the model's depth; what
was fitted to the model and ships beside it is used (`methods.fitted_beside`: Lychee's gates,
DELTA's and Kascade's calibration; `--no-calibration` keeps the scaled defaults).
A name with '+spec' (`delta+spec`) runs lossless mode: the method drafts `--draft-tokens`
tokens per round and dense attention verifies them (`generate(draft_tokens=...)`), so its
accuracy is dense's; it reports the share of drafts accepted instead of recall and error.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from sparsejax import methods as M, sharding
from sparsejax.generate import GenerateOutput, compile_generate, generate
from sparsejax.plan import Role

log = logging.getLogger("sparsejax")
RESA = "+resa"
SPEC = "+spec"
DRAFT_TOKENS = 4    # γ of the '+spec' methods unless --draft-tokens says otherwise

CPU_NOTE = ("on CPU the kernels run as their jnp references: tokens/s here compares no kernel "
            "and sparse methods are slower than dense; speed is only meaningful on a GPU")


def speed_note() -> str:
    """The line to print beside tokens/s measured on this backend ("" on a GPU)."""
    return "" if jax.default_backend() == "gpu" else f"note: {CPU_NOTE}"


def parse_methods(spec: str) -> list[str]:
    """'dense,delta+resa,kascade+spec,...' -> names; each a `methods.REGISTRY` name, optionally
    with '+resa' and then '+spec' (lossless mode)."""
    names = [m.strip() for m in spec.split(",") if m.strip()]
    if not names:
        raise ValueError(f"--methods {spec!r}: expected at least one of {tuple(M.REGISTRY)}, "
                         "comma-separated")
    for name in names:
        base = name.removesuffix(SPEC).removesuffix(RESA)
        if base not in M.REGISTRY or (base == "dense" and name != base):
            raise ValueError(f"--methods entry {name!r}: expected one of {tuple(M.REGISTRY)}, "
                             "optionally with '+resa' and then '+spec' (neither for dense)")
    return names


def build_methods(config, names, ratio: float, fitted=M.Fitted()) -> dict:
    """{name: method} at `ratio` of each prompt's own length (see `parse_methods`)."""
    out = {}
    for name in names:
        drafter = name.removesuffix(SPEC)
        method = M.REGISTRY[drafter.removesuffix(RESA)].at_budget(config, M.Ratio(ratio), fitted)
        out[name] = M.RESA(method) if drafter.endswith(RESA) else method
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


class SyntheticTasks:
    """The synthetic tasks' prompts (`train.data.Sample`): batches, EOS and exact-match scoring
    of the answer tokens."""
    name = "synthetic"

    def __init__(self):
        from sparsejax.train import data

        self.data = data
        self.eos_token_id = data.EOS_ID
        self.max_new_tokens = data.MAX_ANSWER_TOKENS

    def samples(self, tasks, context: int, count: int, seed: int, vocab) -> list:
        return [self.data.make_sample(t, context, seed, i, vocab)
                for i in range(count) for t in tasks]

    def batch(self, samples):
        return self.data.prompt_batch(samples)

    def score(self, tokens: np.ndarray, generated: int, sample) -> float:
        """`tokens`: the row's generated tokens (EOS-padded past `generated`)."""
        return float(self.data.check_answer(tokens, sample))


class ProseTasks:
    """`sparsejax.tasks` prompts in `tokenizer`: padded to the context (one shape a batch),
    the model's own EOS, and RULER's scoring of the decoded completion."""
    name = "prose"

    def __init__(self, tokenizer, context: int):
        from sparsejax import tasks

        self.tasks, self.tokenizer, self.context = tasks, tokenizer, context
        self.eos_token_id = None            # generate's default: the model config's EOS
        self.max_new_tokens = None          # set by `samples`: the longest answer's

    def samples(self, tasks, context: int, count: int, seed: int, vocab=None) -> list:
        out = [self.tasks.build(t, self.tokenizer, context, seed + i)
               for i in range(count) for t in tasks]
        self.max_new_tokens = max(s.max_new_tokens for s in out)
        return out

    def batch(self, samples):
        pad = self.tokenizer.pad_token_id
        return self.tasks.prompt_batch(samples, 0 if pad is None else pad, length=self.context)

    def score(self, tokens: np.ndarray, generated: int, sample) -> float:
        """`tokens`: the row's generated tokens, of which the first `generated` count."""
        return self.tasks.score(self.tokenizer.decode(tokens[:generated],
                                                      skip_special_tokens=True), sample.answers)


def task_set(tokenizer, tasks, context: int):
    """`SyntheticTasks` when the tokenizer's vocabulary is the synthetic tasks' (or there is no
    tokenizer), else `ProseTasks`; `tasks` checked against the chosen set's names."""
    from sparsejax import tasks as prose
    from sparsejax.train import data

    synthetic = tokenizer is None
    if not synthetic:
        try:
            data.as_vocab(tokenizer.get_vocab())
            synthetic = True
        except ValueError:          # another vocabulary: the prose tasks
            pass
    names = data.TASKS if synthetic else prose.TASKS
    unknown = [t for t in tasks if t not in names]
    if unknown:
        other = "" if synthetic else " (the synthetic tasks need the embedded model's vocabulary)"
        if synthetic and all(t in prose.TASKS for t in unknown):
            other = (" (the prose tasks passkey, cwe and qa need a model with a real "
                     "tokenizer, e.g. --model smollm2)")
        raise ValueError(f"--task {','.join(unknown)}: this model's tokenizer runs the "
                         f"{'synthetic' if synthetic else 'prose'} tasks, expected some of "
                         f"{names}{other}")
    return SyntheticTasks() if synthetic else ProseTasks(tokenizer, context)


def run_method(model, samples, method, *, batch: int, max_new_tokens: int | None = None,
               timing: bool = True, repeats: int = 3, correct_every: int | None = None,
               draft_tokens: int | None = None, task_set=None, kv_dtype=None) -> list[dict]:
    """Per sample: correct (its score, in [0, 1]), and per-layer recall / oracle recall /
    attention error averaged over the decode steps it ran, or with `draft_tokens` (lossless
    mode, which has no diagnostics) the tokens it drafted and the dense verify accepted; plus,
    when `timing`, the batch's tokens/s: the median of `repeats` runs after a warm-up (compile
    excluded). `task_set` (default `SyntheticTasks()`) batches and scores the samples.
    `kv_dtype`: the KV cache's (`generate`'s), default the model's dtype."""
    task_set = SyntheticTasks() if task_set is None else task_set
    max_new_tokens = task_set.max_new_tokens if max_new_tokens is None else max_new_tokens
    rows, run = [], None
    batch = min(batch, len(samples))
    for start in range(0, len(samples), batch):
        chunk = samples[start:start + batch]
        # the last batch is padded with repeats of its first prompt: one shape, one compile
        ids, lengths = task_set.batch(chunk + chunk[:1] * (batch - len(chunk)))
        kw = dict(lengths=lengths, max_new_tokens=max_new_tokens, method=method,
                  eos_token_id=task_set.eos_token_id, correct_every=correct_every,
                  draft_tokens=draft_tokens, kv_dtype=kv_dtype)
        compiled_now = timing and run is None
        if compiled_now:        # every batch has one shape: one compile per method
            run = compile_generate(model, ids, **kw)
        if draft_tokens is None:
            out = generate(model, ids, return_diagnostics=True, **kw)
            per_row = _diagnostics_per_row(out)
            if compiled_now:
                jax.block_until_ready(run(ids, lengths).tokens)             # warm-up
        else:                   # the timed executable's first run is also the warm-up
            out = run(ids, lengths) if timing else generate(model, ids, **kw)
            per_row = {"drafted": np.asarray(out.drafted), "accepted": np.asarray(out.accepted)}
        toks, generated = np.asarray(out.tokens), np.asarray(out.num_generated)
        tokens_per_s = None
        if timing:
            seconds = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                timed = run(ids, lengths)
                jax.block_until_ready(timed.tokens)
                seconds.append(time.perf_counter() - t0)
            tokens_per_s = float(np.sum(np.asarray(timed.num_generated)[:len(chunk)])) / (
                statistics.median(seconds))
        for i, sample in enumerate(chunk):
            rows.append({"task": sample.task,
                         "correct": task_set.score(toks[i], int(generated[i]), sample),
                         "tokens_per_s": tokens_per_s,
                         **{k: v[..., i] for k, v in per_row.items()}})
    return rows


def _diagnostics_per_row(out: GenerateOutput) -> dict:
    """{recall, oracle_recall, attn_error: [L, B]}, each row's mean over its decode steps."""
    diag = {k: np.asarray(out.diagnostics[k], np.float64)
            for k in ("recall", "oracle_recall", "attn_error")}        # [steps, L, B]
    mask = _valid_steps(np.asarray(out.num_generated), diag["recall"].shape[0])[:, None, :]
    steps = np.maximum(mask.sum(0), 1)                                   # [1, B]
    return {k: np.sum(np.where(mask, v, 0.0), axis=0) / steps for k, v in diag.items()}


def summarize(rows: list[dict], method, config, task: str,
              draft_tokens: int | None = None) -> dict:
    """Accuracy, per-layer means, and the mean recall / error over layers that attend sparsely;
    in lossless mode (`draft_tokens`), which has no diagnostics, instead the share of drafts
    the dense verify accepted and the drafts accepted per round (of γ). What a row does not
    measure is None."""
    rows = [r for r in rows if task == "all" or r["task"] == task]
    plan = method.to_plan(config, None)
    sparse = [i for i, role in enumerate(plan.roles) if role not in (Role.DENSE, Role.SELECT)]
    res = {
        "task": task, "accuracy": float(np.mean([r["correct"] for r in rows])),
        "correct": int(sum(r["correct"] >= 1 for r in rows)), "samples": len(rows),
        "recall_per_layer": None, "oracle_recall_per_layer": None, "attn_error_per_layer": None,
        "sparse_layers": sparse, "mean_recall": None, "mean_attn_error": None,
        "tokens_per_s": (None if rows[0]["tokens_per_s"] is None else
                         round(float(np.mean([r["tokens_per_s"] for r in rows])), 2)),
        "draft_tokens": draft_tokens, "acceptance_rate": None, "accepted_per_round": None,
    }
    if draft_tokens is not None:
        drafted = sum(int(r["drafted"]) for r in rows)
        rate = sum(int(r["accepted"]) for r in rows) / drafted if drafted else None
        if rate is not None:
            res.update(acceptance_rate=round(rate, 5),
                       accepted_per_round=round(rate * draft_tokens, 4))
        return res
    layer = {k: np.mean([r[k] for r in rows], axis=0)
             for k in ("recall", "oracle_recall", "attn_error")}
    res.update({f"{k}_per_layer": v.round(5).tolist() for k, v in layer.items()})
    res["mean_recall"] = round(float(np.mean(layer["recall"][sparse])), 5) if sparse else 1.0
    res["mean_attn_error"] = (round(float(np.mean(layer["attn_error"][sparse])), 5) if sparse
                              else 0.0)
    return res


def evaluate(model, *, tasks, context: int, samples: int, ratios, method_names=(),
             methods=None, seed: int = 0, batch: int = 8, model_dir=None, vocab=None,
             timing: bool = True, repeats: int = 3, calibrated: bool = True,
             progress=log.info, correct_every: int | None = None,
             sparse_prefill: bool = False, sparse_anchors: bool = False,
             draft_tokens: int = DRAFT_TOKENS, tokenizer=None, kv_dtype=None) -> dict:
    """Every method at every budget ratio on `samples` prompts of each task (tasks share
    batches: every prompt has exactly `context` tokens). One result per method, ratio and
    task, plus task "all". Methods are `method_names` (see `parse_methods`) scaled to the
    model, with what ships beside it (`methods.fitted_beside`; the calibration unless
    `calibrated` is False), or `methods(ratio) -> {name: method}` for any others; a name
    ending in '+spec' runs lossless mode, its method drafting `draft_tokens` per round.
    `correct_every`, `sparse_prefill` and `sparse_anchors` (Kascade's) apply to every method
    they concern: none in lossless mode, whose output is dense decoding's.
    `tokenizer`: the model's; None or the synthetic tasks' vocabulary runs the synthetic tasks
    (with `vocab`), any other the prose tasks of `sparsejax.tasks` (see `task_set`).
    `kv_dtype`: the KV cache's for every method (see `generate`), default the model's."""
    if not (isinstance(draft_tokens, int) and draft_tokens >= 1):
        raise ValueError(f"draft_tokens={draft_tokens!r}: expected an int >= 1")

    chosen_set = task_set(tokenizer, tasks, context)
    prompts = chosen_set.samples(tasks, context, samples, seed, vocab)
    fitted = M.fitted_beside(model_dir, model, calibrated=calibrated and methods is None)
    doc = {"model": str(model_dir) if model_dir else None, "tasks": list(tasks),
           "task_set": chosen_set.name,
           "context": context, "samples_per_task": samples, "seed": seed,
           "device": getattr(jax.devices()[0], "device_kind", jax.default_backend()),
           "jax_version": jax.__version__, "date": datetime.date.today().isoformat(),
           "lychee_retrieval_heads": "shipped gates" if fitted.retrieval_heads is not None else
           "random (no gates shipped with the model)",
           "calibrated": sorted(fitted.calibration), "correct_every": correct_every,
           "sparse_prefill": sparse_prefill, "sparse_anchors": sparse_anchors,
           "kv_dtype": kv_dtype or "auto",
           "timing": {"warmup_runs": 1, "repeats": repeats, "statistic": "median"} if timing
           else None, "results": []}
    for ratio in ratios:
        chosen = (methods(ratio) if methods is not None else
                  build_methods(model.config, method_names, ratio, fitted))
        for name, method in chosen.items():
            lossless = name.endswith(SPEC)
            label = name  # names the options that changed the run
            for option, wanted in (("sparse_prefill", sparse_prefill),
                                   ("sparse_anchors", sparse_anchors)):
                if wanted and isinstance(method, M.Kascade) and not lossless:
                    method = dataclasses.replace(method, **{option: True})
                    label += f"+{option}"
            if correct_every and not (lossless or isinstance(method, M.Dense)):
                label += f"+correct{correct_every}"
            t0 = time.perf_counter()
            gamma = draft_tokens if lossless else None
            rows = run_method(model, prompts, method, batch=batch, timing=timing,
                              repeats=repeats, correct_every=None if lossless else correct_every,
                              draft_tokens=gamma, task_set=chosen_set, kv_dtype=kv_dtype)
            for task in list(tasks) + (["all"] if len(tasks) > 1 else []):
                res = summarize(rows, method, model.config, task, gamma)
                res.update(method=label, budget_ratio=ratio,
                           config=describe(method, model.config))
                doc["results"].append(res)
            overall = doc["results"][-1]
            progress(f"{label:<16} ratio {ratio:<5} acc {overall['accuracy']:.3f} "
                     f"recall {fmt(overall['mean_recall'])} err {fmt(overall['mean_attn_error'])} "
                     f"accepted {fmt(overall['acceptance_rate'], '.2f')} "
                     f"{fmt(overall['tokens_per_s'], '.1f')} tok/s "
                     f"({time.perf_counter() - t0:.0f}s)")
    return doc


def fmt(value, spec: str = ".3f", width: int = 0) -> str:
    """`value` formatted, or '-' where it was not measured (None)."""
    return f"{'-' if value is None else format(value, spec):>{width}}"


def table(doc: dict) -> str:
    """One line per result; 'accepted' is lossless mode's share of accepted drafts, and
    recall / attn err are not measured there ('-')."""
    rows = [f"{'method':<16} {'budget':>6} {'task':<10} {'accuracy':>8} {'recall':>7} "
            f"{'attn err':>8} {'accepted':>8} {'tokens/s':>9}"]
    for r in doc["results"]:
        rows.append(f"{r['method']:<16} {r['budget_ratio']:>6} {r['task']:<10} "
                    f"{r['accuracy']:>8.3f} {fmt(r['mean_recall'], width=7)} "
                    f"{fmt(r['mean_attn_error'], width=8)} "
                    f"{fmt(r.get('acceptance_rate'), width=8)} "
                    f"{fmt(r['tokens_per_s'], '.1f', 9)}")
    return "\n".join(rows)


METRICS = {"accuracy": "task accuracy (exact match)",
           "mean_recall": "attention recall, sparse layers",
           "mean_attn_error": "attention-output error, sparse layers",
           "acceptance_rate": "drafts accepted (+spec)",
           "tokens_per_s": "tokens/s"}


def on_cpu(doc: dict) -> bool:
    """Whether the doc's timings were measured on a CPU (its kernels as jnp references)."""
    return str(doc.get("device", "")).lower().startswith("cpu")


def has_resa(names) -> bool:
    return any(RESA in name for name in names)


def plot(doc: dict, path: Path, metrics=None, title: str | None = None) -> Path:
    """One panel per metric (default: those measured for some method) over the methods, mean
    over the tasks: bars, one per budget (lighter for smaller ones), up to three budgets; lines
    against the budget ratio beyond; none where a method does not measure the metric. A colour
    per base method; its RESA variant hatched (dashed) in it. By default a metric with a single
    value (one lossless method's acceptance at one budget) is written in the title instead of
    a panel of one bar; tokens/s measured on a CPU says it does not tell GPU speed."""
    import textwrap

    from matplotlib.patches import Patch

    from sparsejax.plotting import figure, method_style, save

    overall = "all" if len(doc["tasks"]) > 1 else doc["tasks"][0]
    results = [r for r in doc["results"] if r["task"] == overall]
    measured = {m: [r for r in results if r.get(m) is not None] for m in METRICS}
    notes = []
    if metrics is None:
        metrics = [m for m in METRICS if len(measured[m]) > 1 or
                   (measured[m] and m != "acceptance_rate")]
        for r in measured["acceptance_rate"] if "acceptance_rate" not in metrics else ():
            notes.append(f"{r['method']}: {r['acceptance_rate']:.0%} of drafts accepted")
    names = list(dict.fromkeys(r["method"] for r in results))
    bases = list(dict.fromkeys(m.removesuffix(RESA) for m in names))
    ratios = sorted({r["budget_ratio"] for r in results})
    value = {(r["method"], r["budget_ratio"]): r for r in results}
    bars = len(ratios) <= 3
    panel = min(14.0, max(3.6, 0.45 * len(names) * len(ratios) + 1.2)) if bars else 4.5
    ncols = len(metrics) if panel * len(metrics) <= 16 else min(2, len(metrics))  # two a row
    nrows = -(-len(metrics) // ncols)
    fig, axes = figure(nrows, ncols, figsize=(panel * ncols, 4.4 * nrows))
    axes = axes.ravel()
    for ax in axes[len(metrics):]:
        ax.set_visible(False)
    for ax, key in zip(axes, metrics):
        for i, name in enumerate(names):
            style = method_style(name, bases)
            ys = [np.nan if value.get((name, x), {}).get(key) is None else value[name, x][key]
                  for x in ratios]
            if bars:
                for j, y in enumerate(ys):
                    offset = (j - (len(ratios) - 1) / 2) * 0.8 / len(ratios)
                    shade = dict(alpha=0.4 + 0.6 * (j + 1) / len(ratios))
                    if style["resa"]:
                        shade.update(facecolor="none", edgecolor=style["color"], hatch="///")
                    else:
                        shade.update(color=style["color"])
                    ax.bar(i + offset, y, width=0.8 / len(ratios), **shade)
            else:
                ax.plot(ratios, ys, marker="o", color=style["color"], label=name,
                        linestyle="--" if style["resa"] else "-",
                        markerfacecolor="none" if style["resa"] else style["color"])
        label = textwrap.wrap(METRICS[key], width=max(24, int(panel * 8)))
        if key == "tokens_per_s" and on_cpu(doc):
            label.append("CPU: not indicative of GPU speed")
        ax.set_title("\n".join(label), fontsize=10)
        ax.grid(alpha=0.3, axis="y" if bars else "both")
        if bars:
            ax.set_xticks(range(len(names)), names, rotation=45, ha="right")
        else:
            ax.set_xlabel("budget ratio")
    if bars and len(ratios) > 1:
        fig.legend(handles=[Patch(color="grey", alpha=0.4 + 0.6 * (j + 1) / len(ratios),
                                  label=f"budget {x:g} of the context")
                            for j, x in enumerate(ratios)], fontsize=8, loc="upper right")
    elif not bars:
        axes[len(metrics) - 1].legend(fontsize=8, loc="center left", bbox_to_anchor=(1.02, 0.5))
    if title is None:
        budget = f", budget {ratios[0]:g} of the context" if len(ratios) == 1 else ""
        lines = textwrap.wrap(f"{Path(doc['model'] or 'model').name}, context {doc['context']}, "
                              f"{', '.join(doc['tasks'])}{budget}", width=int(panel * ncols * 9))
        lines += ["hatched: with RESA"] if has_resa(names) else []
    else:
        lines = title.split("\n")
    fig.suptitle("\n".join(lines + notes), fontsize=11)
    return save(fig, path)


def add_parser(sub) -> None:
    from sparsejax.arguments import (KV_DTYPE_CHOICES, KV_DTYPE_HELP, positive_int, ratio_list,
                                     token_list)

    p = sub.add_parser("eval", help="accuracy / recall / error / speed of every method",
                       description="Accuracy, attention recall, attention-output error and "
                       "tokens/s of the methods on long-context tasks. A model whose tokenizer "
                       "is the synthetic tasks' 1024-word vocabulary (sparsejax.train.tokenizer; "
                       "the embedded model) runs the synthetic tasks of sparsejax.train.data; "
                       "any other model (e.g. --model smollm2) runs the RULER-style tasks of "
                       "sparsejax.tasks on real prose, in its chat template.")
    p.add_argument("--model", default=None,
                   help="HF checkpoint dir, .gguf file, Hub id or 'smollm2' (default: the "
                   "embedded model)")
    p.add_argument("--task", default="niah,multikey,multivalue,vt",
                   help="comma-separated. Both task sets: niah (one needle), multikey (four "
                   "keys, one asked), multivalue (four values of one key), vt (variable "
                   "tracking); prose tasks only (a model with a real tokenizer): passkey, cwe "
                   "(common-word extraction), qa (a fact question)")
    p.add_argument("--context", type=positive_int, default=1024, help="prompt tokens")
    p.add_argument("--samples", type=positive_int, default=8, help="prompts per task")
    p.add_argument("--methods", default=",".join(M.REGISTRY),
                   help="comma-separated method names, each optionally with +resa, then +spec "
                   "(lossless mode: the method drafts, dense attention verifies)")
    add_draft_tokens_arg(p)
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--budget-ratio", type=ratio_list, default=[0.1],
                        help="comma-separated budgets as shares of the context")
    budget.add_argument("--budget-tokens", type=token_list, default=None,
                        help="comma-separated budgets in tokens (default: --budget-ratio)")
    p.add_argument("--batch", type=positive_int, default=8, help="prompts decoded together")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="timed runs per method after a warm-up (the median is reported)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    p.add_argument("--dtype", choices=["f32", "bf16"], default="f32", help="compute dtype")
    p.add_argument("--kv-dtype", choices=KV_DTYPE_CHOICES, default="auto", help=KV_DTYPE_HELP)
    p.add_argument("--no-calibration", action="store_true",
                   help="DELTA/Kascade layer choices from the defaults scaled to the depth, not "
                   "from the calibration shipped beside the model")
    p.add_argument("--no-timing", action="store_true",
                   help="skip the tokens/s runs")
    p.add_argument("--correct-every", type=positive_int, default=None, metavar="N",
                   help="cache correction: re-run every N generated tokens densely "
                   "(default: off)")
    p.add_argument("--sparse-prefill", action="store_true", help="Kascade's sparse prefill")
    p.add_argument("--sparse-anchors", action="store_true",
                   help="Kascade's anchors after layer 0 attend to their own top-k (the paper's "
                   "decode passes) instead of densely")
    p.add_argument("--json", default=None, help="write the results here (default: not written)")
    p.add_argument("--plot", default=None,
                   help="write the accuracy/recall/error/speed plot here, PNG "
                   "(default: not written)")
    p.set_defaults(func=run)


def add_draft_tokens_arg(p) -> None:
    from sparsejax.arguments import positive_int

    p.add_argument("--draft-tokens", type=positive_int, default=None, metavar="N",
                   help="tokens the +spec methods draft per round before the dense verify "
                   f"(default: {DRAFT_TOKENS})")
    p.add_argument("--tp", type=positive_int, default=1,
                   help="tensor parallel over this many devices (README: Several GPUs)")


def lossless_draft_tokens(args, names: list[str]) -> int:
    """--draft-tokens (or the default); an error when no '+spec' method would draft."""
    if args.draft_tokens is None:
        return DRAFT_TOKENS
    if not any(name.endswith(SPEC) for name in names):
        raise ValueError(f"--draft-tokens {args.draft_tokens}: sets how many tokens the '+spec' "
                         "methods draft (lossless mode), and --methods names none: add one, "
                         "e.g. delta+spec")
    return args.draft_tokens


def budget_ratios(args, context: int) -> list[float]:
    """--budget-tokens as shares of `context`, or --budget-ratio (each checked in (0, 1])."""
    if args.budget_tokens is None:
        return args.budget_ratio
    too_long = [t for t in args.budget_tokens if t > context]
    if too_long:
        raise ValueError(f"--budget-tokens {too_long}: expected at most the context, {context}")
    return [t / context for t in args.budget_tokens]


def run(args) -> int:
    import sparsejax
    from sparsejax import tasks as prose
    from sparsejax.files import check_outputs, write_text_atomic
    from sparsejax.train import data

    outputs = check_outputs({"--json": args.json, "--plot": args.plot})
    tasks = [t.strip() for t in args.task.split(",") if t.strip()]
    known = tuple(dict.fromkeys(data.TASKS + prose.TASKS))
    if not tasks:
        raise ValueError(f"--task {args.task!r}: expected some of {known}, comma-separated")
    for t in tasks:
        if t not in known:
            raise ValueError(f"--task {t!r}: expected some of {known}")
    ratios = budget_ratios(args, args.context)
    names = parse_methods(args.methods)
    gamma = lossless_draft_tokens(args, names)
    mesh = sharding.tensor_parallel_mesh(args.tp)
    model_dir = (sparsejax.models.loading.checkpoint_dir(args.model) if args.model
                 else sparsejax.embedded_model_path())
    tokenizer = sparsejax.load_tokenizer(model_dir)
    chosen = task_set(tokenizer, tasks, args.context)     # a wrong --task fails before loading
    vocab = tokenizer.get_vocab() if isinstance(chosen, SyntheticTasks) else None
    model = sparsejax.from_pretrained(model_dir, dtype=jnp.float32 if args.dtype == "f32"
                                      else jnp.bfloat16, mesh=mesh)
    doc = evaluate(model, tasks=tasks, context=args.context, samples=args.samples,
                   method_names=names, ratios=ratios, seed=args.seed,
                   batch=args.batch, model_dir=model_dir, vocab=vocab, tokenizer=tokenizer,
                   timing=not args.no_timing, repeats=args.repeats,
                   calibrated=not args.no_calibration, correct_every=args.correct_every,
                   sparse_prefill=args.sparse_prefill, sparse_anchors=args.sparse_anchors,
                   draft_tokens=gamma, kv_dtype=args.kv_dtype)
    print(table(doc))
    if not args.no_timing and speed_note():
        print(speed_note())
    if "--json" in outputs:
        write_text_atomic(outputs["--json"], json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}")
    if "--plot" in outputs:
        plot(doc, outputs["--plot"])
        print(f"wrote {args.plot}")
    return 0
