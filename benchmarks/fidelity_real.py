"""Fidelity of every method on a real model (SmolLM2-135M-Instruct by default), on the long-
context tasks over real prose (`sparsejax.tasks`): accuracy, attention recall and attention-
output error per method, budget and context, with the fitted (calibrated / trained) layer
choices against the defaults scaled to the depth.

    python benchmarks/fidelity_real.py --model FILE.gguf     # the full table (one GPU)
    python benchmarks/fidelity_real.py --quick               # 2k, 2 tasks, 4 prompts, 3 methods
    python benchmarks/fidelity_real.py plot          # results/fidelity_real.json -> .png
    python benchmarks/fidelity_real.py merge A.json B.json   # runs split by method -> --out
    python benchmarks/fidelity_real.py --kv-dtype fp8        # the cache in fp8 (or bf16)

The full table: dense and every method with and without RESA (and the fitted choices against
the defaults) at budgets 10% and 20% of each row's length, contexts 2k / 4k / 8k, 32 prompts a
task; a task enters a context's table only where dense scores >= 0.75 on it. `--model`
defaults to $SPARSEJAX_REAL_MODEL, else the installed `smollm2`. Results go to
results/fidelity_real.json and .png, and are copied to $OUT when it is set.

How it runs in one process: the prompts' dense forward pass is computed once per task and
context, and every method decodes greedily from the cache written from it (what `generate`
does: its prefill is this dense forward for every method here; none runs Kascade's sparse
prefill), with per-step diagnostics (`sparsejax.layers`: recall, oracle recall, attention error
per layer). The decode programs share one shape: the prompt keys are right-padded to the
longest context (lengths unchanged, so no row reads the padding) and a task decodes its
longest answer's tokens rounded up to 16, so each (method, budget) compiles once for every
context and every short-answer task (a long-answer task on which dense passes adds its own),
ahead of time in a thread pool while the forward passes run. Each program decodes a group of
rows: all of a task's prompts where its temporaries fit in DECODE_SHARE of the free device
memory, else fewer (`Decoder`).

Targets the table is read against: every seed method (DELTA, Kascade, Lychee with trained
gates, and RESA on each) at >= 95% of dense accuracy at a 10% budget on every cell where dense
is >= 0.75; RESA cutting each base method's attention-output error by >= 50%.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import functools
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import sparsejax
from sparsejax import cache as kv
from sparsejax import methods as M
from sparsejax.arguments import KV_DTYPE_CHOICES, KV_DTYPE_HELP
from sparsejax.generate import _decode_step
from sparsejax.layers import prefill_state
from sparsejax.models import forward, unembed

RESULTS = Path(__file__).resolve().parent / "results"
OUT = RESULTS / "fidelity_real.json"
TASKS = ("passkey", "niah", "multikey", "qa")
# name -> (registry method, fitted files used); "+resa" wraps it in RESA (λ = 1), "@pP" sets
# pages of P tokens (e.g. delta@p8)
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
QUICK = dict(contexts=[2048], ratios=[0.1], tasks="niah,qa", samples=4,
             methods="dense,oracle,kascade")
FULL_TASKS = "passkey,niah,multikey,multivalue,vt,cwe,qa"
SEED = ("delta", "kascade", "lychee", "delta+resa", "kascade+resa", "lychee+resa")
DENSE_BAR = 0.75
TARGET_SHARE = 0.95
TARGET_RESA_CUT = 0.5
TARGET_KV_POINTS = 1.0      # `compare`: accuracy points an fp8 cache may move a cell
STEP_BUCKET = 16
DECODE_SHARE = 0.6          # of the free device memory, for one decode group's programs
FORWARD_SCORES = 2 ** 27    # attention scores per head a forward chunk holds (rows x T x T)


def build_method(name: str, config, ratio: float, fitted: M.Fitted):
    """A variant's method at `ratio`; "NAME@pP" is NAME with pages of P tokens (DELTA, Quest)."""
    base, resa = name.removesuffix("+resa"), name.endswith("+resa")
    base, _, page_size = base.partition("@p")
    registry, use_fitted = VARIANTS[base]
    method = M.REGISTRY[registry].at_budget(config, M.Ratio(ratio),
                                            fitted if use_fitted else M.Fitted())
    if page_size:
        method = dataclasses.replace(method, page_size=int(page_size))
    return M.RESA(method) if resa else method


@jax.jit
def _forward(model, ids, lengths):
    out = forward(model, ids, lengths)
    last = jnp.take_along_axis(out.hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]
    return out._replace(hidden=None), jnp.argmax(unembed(model, last), -1).astype(jnp.int32)


DIAGNOSTICS = ("recall", "oracle_recall", "attn_error")


@functools.partial(jax.jit, static_argnames=("plan", "steps", "kv_dtype"))
def _start(model, out, lengths, *, plan, steps: int, kv_dtype=None):
    """The cache (K/V stored as `kv_dtype`, default the model's dtype) for greedy decoding of
    `steps` tokens from the prompt cache `out` (the dense forward's keys and values), with
    `plan`'s state."""
    L, B, T = out.keys.shape[:3]
    cache = kv.allocate(model.config, B, T + steps, page_size=plan.page_size, dtype=model.dtype,
                        kv_dtype=kv_dtype)
    cache = kv.write_prompt(cache, out.keys, out.values, lengths)
    return cache.replace(state=prefill_state(model, cache, out, plan))


@functools.partial(jax.jit, static_argnames=("plan",), donate_argnums=1)
def _step(model, cache, token, *, plan):
    """One greedy step with its diagnostics (as `generate` with return_diagnostics), run in a
    host loop with the cache donated."""
    logits, cache, diag = _decode_step(model, cache, token, plan, True)
    return jnp.argmax(logits, -1).astype(jnp.int32), cache, {k: diag[k] for k in DIAGNOSTICS}


class Decoder:
    """`_start` and `_step` compiled ahead of time for one plan, step count and shapes; called
    as (model, out, first, lengths) -> (tokens [B, steps], {diagnostic: [steps - 1, L, B]}),
    without stopping at EOS (the score reads the text up to it). The programs take `rows` of
    the B prompts at a time: the most, halving from B, whose step's temporaries and cache fit
    in `memory` bytes (None: all B): the diagnostics' dense reference holds a layer's K/V
    gathered in f32 beside the cache."""

    def __init__(self, model, out, first, lengths, plan, steps: int, memory: int | None = None,
                 kv_dtype=None):
        self.steps, self.kv_dtype = steps, kv_dtype
        rows = first.shape[0]
        while True:
            take = lambda x: jax.ShapeDtypeStruct((rows, *x.shape[1:]), x.dtype)  # noqa: E731
            shapes = (jax.tree.map(lambda x: jax.ShapeDtypeStruct(
                (x.shape[0], rows, *x.shape[2:]), x.dtype), out), take(first), take(lengths))
            self._compile(model, *shapes, plan, steps)
            need = max(c.memory_analysis().temp_size_in_bytes for c in (self.start, self.step))
            need += self.step.memory_analysis().output_size_in_bytes
            if memory is None or need <= memory or rows == 1:
                break
            rows = max(d for d in range(1, rows // 2 + 1) if first.shape[0] % d == 0)
        self.rows = rows

    def _compile(self, model, out, first, lengths, plan, steps):
        options = dict(plan=plan, steps=steps, kv_dtype=self.kv_dtype)
        self.start = _start.lower(model, out, lengths, **options).compile()
        cache = jax.eval_shape(functools.partial(_start, **options), model, out, lengths)
        self.step = _step.lower(model, cache, first, plan=plan).compile()

    def _group(self, model, out, first, lengths):
        cache, token = self.start(model, out, lengths), first
        tokens, diags = [first], []
        for _ in range(self.steps - 1):
            token, cache, diag = self.step(model, cache, token)
            tokens.append(token)
            diags.append(diag)
        return (jnp.stack(tokens, axis=1),
                {k: jnp.stack([d[k] for d in diags]) for k in DIAGNOSTICS})

    def __call__(self, model, out, first, lengths):
        if self.rows == first.shape[0]:    # one group: no sliced copy of the prompt cache
            return self._group(model, out, first, lengths)
        parts = []
        for i in range(0, first.shape[0], self.rows):
            rows = slice(i, i + self.rows)
            group = jax.tree.map(lambda x: x[:, rows], out)
            parts.append(self._group(model, group, first[rows], lengths[rows]))
        return (jnp.concatenate([p[0] for p in parts]),
                {k: jnp.concatenate([p[1][k] for p in parts], axis=-1) for k in DIAGNOSTICS})


def _text_until_eos(tokenizer, ids, eos):
    ids = list(ids)
    for i, t in enumerate(ids):
        if t in eos:
            ids = ids[:i]
            break
    return tokenizer.decode(ids, skip_special_tokens=True)


def run_cell(model, tokenizer, samples, prepared, program, plan, eos, steps):
    """Accuracy, per-sample scores, per-layer recall / oracle recall / error (means over the
    steps each row generated before EOS or its sample's max_new_tokens, then rows), and the
    sparse layers' means. `program`: a `Decoder` for `plan` and these shapes; `steps`:
    tokens decoded (the task's step bucket)."""
    from sparsejax import tasks

    out, first, lengths = prepared
    tokens, diag = program(model, out, first, lengths)
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


def _cell_key(r: dict) -> tuple:
    """A result cell's identity: (method, budget_ratio, context, task)."""
    return r["method"], r["budget_ratio"], r["context"], r["task"]


def _load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _save(doc: dict, path: Path) -> None:
    from sparsejax.files import write_text_atomic

    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(doc, indent=1) + "\n")


def _prompt_cache(model, ids: np.ndarray, lengths: np.ndarray, width: int):
    """The dense forward of right-padded `ids [B, T]` (in row chunks that bound the
    [rows, heads, T, T] attention scores) with its keys and values right-padded to `width`
    -> (out, first token, lengths)."""
    context = ids.shape[1]
    rows = max(1, min(len(ids), FORWARD_SCORES // context ** 2))
    parts = [_forward(model, jnp.asarray(ids[i:i + rows]), jnp.asarray(lengths[i:i + rows]))
             for i in range(0, len(ids), rows)]
    pad = [(0, 0), (0, 0), (0, width - context), (0, 0), (0, 0)]
    out = parts[0][0]._replace(
        keys=jnp.pad(jnp.concatenate([p[0].keys for p in parts], axis=1), pad),
        values=jnp.pad(jnp.concatenate([p[0].values for p in parts], axis=1), pad),
        query_means=jnp.concatenate([p[0].query_means for p in parts], axis=1))
    first = jnp.concatenate([p[1] for p in parts])
    return out, first, jnp.asarray(lengths)


def _plans(names, ratios, config, fitted) -> dict:
    """(name, ratio) -> plan for every cell to run (dense once, with ratio None); Lychee with
    trained gates only where the model has them."""
    plans = {}
    for name in names:
        if name == "dense":
            plans[name, None] = M.Dense().to_plan(config)
            continue
        if name.startswith("lychee") and "@" not in name and fitted.retrieval_heads is None:
            print(f"  {name}: no trained gates for this model, skipped", flush=True)
            continue
        for ratio in ratios:
            plans[name, ratio] = build_method(name, config, ratio, fitted).to_plan(config)
    return plans


def _step_bucket(samples) -> int:
    """Tokens a task's decode program makes: its longest answer's budget rounded up to
    STEP_BUCKET, so the short-answer tasks share one program and a long-answer task does not
    lengthen every decode."""
    return -(-max(s.max_new_tokens for s in samples) // STEP_BUCKET) * STEP_BUCKET


class Programs:
    """A `Decoder` compiled ahead of time for each (plan, steps) at (batch, width), in a thread
    pool (XLA compiles without the GIL): `submit` starts a compile, `get` waits for it."""

    def __init__(self, model, plans: dict, batch: int, width: int, workers: int, kv_dtype=None):
        self.model, self.plans, self.kv_dtype = model, plans, kv_dtype
        ids = jax.ShapeDtypeStruct((batch, width), jnp.int32)
        self.lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
        self.out, self.first = jax.eval_shape(_forward, model, ids, self.lengths)
        # what a decode group may take: a share of the device's free memory, the rest for the
        # prompt caches (None where the backend does not say, as on CPU)
        stats = jax.devices()[0].memory_stats() or {}
        self.memory = (None if "bytes_limit" not in stats else
                       int(DECODE_SHARE * (stats["bytes_limit"] - stats["bytes_in_use"])))
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers)
        self.futures = {}

    def _build(self, key, steps):
        return Decoder(self.model, self.out, self.first, self.lengths, self.plans[key], steps,
                       self.memory, self.kv_dtype)

    def submit(self, key, steps: int) -> None:
        if (key, steps) not in self.futures:
            self.futures[key, steps] = self.pool.submit(self._build, key, steps)

    def get(self, key, steps: int):
        self.submit(key, steps)
        return self.futures[key, steps].result()


def measure(args) -> dict:
    from sparsejax import tasks

    t_start = time.perf_counter()
    model = sparsejax.from_pretrained(args.model, dtype=jnp.float32)
    tokenizer = sparsejax.load_tokenizer(args.model)
    fitted = M.fitted_beside(args.model, model)
    eos = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
    pad_id = tokenizer.pad_token_id or 0
    doc = (_load(args.out) if args.resume else {}) or {"results": []}
    if doc.get("kv_dtype", "auto") != args.kv_dtype and doc["results"]:
        raise SystemExit(f"--resume: {args.out} holds cells of kv_dtype="
                         f"{doc.get('kv_dtype', 'auto')!r}, not --kv-dtype {args.kv_dtype}")
    doc.update(model=Path(str(args.model)).name, device=jax.default_backend(),
               device_kind=jax.devices()[0].device_kind, host=platform.machine(),
               samples_per_task=args.samples, kv_dtype=args.kv_dtype, fitted={
                   "calibration": {k: str(Path(v).relative_to(Path(v).parents[2]))
                                   for k, v in fitted.calibration.items()},
                   "lychee_retrieval_heads": None if fitted.retrieval_heads is None else int(
                       np.sum(np.asarray(fitted.retrieval_heads)[1:]))},
               fingerprint=sparsejax.artifacts.fingerprint(model).to_json())
    done = {_cell_key(r) for r in doc["results"]}
    names = [n for n in args.methods.split(",") if n]
    if "dense" not in names:
        names.insert(0, "dense")          # the bar every other cell is read against
    task_names = args.tasks.split(",")
    contexts = sorted(args.contexts)
    t0 = time.perf_counter()

    def build(context):
        """The context's prompts per task and each task's step bucket."""
        built = {task: [tasks.build(task, tokenizer, context, seed)
                        for seed in range(args.samples)] for task in task_names}
        return built, {task: _step_bucket(samples) for task, samples in built.items()}

    built, steps = build(contexts[0])
    print(f"{contexts[0]}-token prompts built ({time.perf_counter() - t0:.0f}s)", flush=True)
    plans = _plans(names, args.ratios, model.config, fitted)
    programs = Programs(model, plans, args.samples, max(contexts), args.compile_workers,
                        args.kv_dtype)
    # dense at every task's step count; the methods at the shortest (the retrieval tasks'),
    # while the prompts of the other contexts are built and the forwards run
    for n in sorted(set(steps.values())):
        programs.submit(("dense", None), n)
    for key in plans:
        programs.submit(key, min(steps.values()))
    for context in contexts:
        if context != contexts[0]:
            t1 = time.perf_counter()
            built, steps = build(context)
            print(f"{context}-token prompts built ({time.perf_counter() - t1:.0f}s)", flush=True)
        for task in sorted(task_names, key=lambda t: steps[t]):      # short answers first
            samples = built[task]
            cells = [key for key in plans if (key[0], key[1], context, task) not in done]
            if not cells:
                continue
            t1 = time.perf_counter()
            ids, lengths = tasks.prompt_batch(samples, pad_id, length=context)
            prepared = _prompt_cache(model, ids, lengths, max(contexts))
            print(f"[{context} {task}] forward {time.perf_counter() - t1:.1f}s", flush=True)
            dense_acc = next((r["accuracy"] for r in doc["results"] if r["method"] == "dense"
                              and r["context"] == context and r["task"] == task), None)
            for name, ratio in sorted(cells, key=lambda key: key[0] != "dense"):
                if name != "dense" and dense_acc is not None and dense_acc < DENSE_BAR:
                    break                 # the table reads only cells where dense can do it
                program = programs.get((name, ratio), steps[task])
                t1 = time.perf_counter()
                cell = run_cell(model, tokenizer, samples, prepared, program,
                                plans[name, ratio], eos, steps[task])
                cell.update(method=name, budget_ratio=ratio, context=context, task=task,
                            device=doc["device_kind"], kv_dtype=args.kv_dtype,
                            seconds=round(time.perf_counter() - t1, 2),
                            mean_prompt_tokens=float(np.mean(prepared[2])))
                if name == "dense":
                    dense_acc = cell["accuracy"]
                    if dense_acc >= DENSE_BAR:    # this task's programs, all at once
                        for key in cells:
                            programs.submit(key, steps[task])
                doc["results"].append(cell)
                print(f"  {name:<16} {ratio or '':>4} acc {cell['accuracy']:.2f} recall "
                      f"{cell['mean_recall']:.3f} err {cell['mean_attn_error']:.3f} "
                      f"({cell['seconds']}s)", flush=True)
            doc["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds")
            _save(doc, args.out)
            del prepared
    doc["seconds"] = {"total": round(time.perf_counter() - t_start, 1),
                      "after_load": round(time.perf_counter() - t0, 1)}
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
    fitted_vs_default = []
    for r in results:
        default = {"delta": "delta@default", "kascade": "kascade@default",
                   "lychee": "lychee@random"}.get(r["method"])
        d = dense.get((r["context"], r["task"]))
        other = next((b for b in results if b["method"] == default
                      and b["budget_ratio"] == r["budget_ratio"]
                      and b["context"] == r["context"] and b["task"] == r["task"]), None)
        if other is not None and d is not None and d >= DENSE_BAR:
            fitted_vs_default.append({
                "method": r["method"], "budget_ratio": r["budget_ratio"],
                "context": r["context"], "task": r["task"], "fitted": r["accuracy"],
                "default": other["accuracy"], "meets": r["accuracy"] >= other["accuracy"]})
    doc["targets"] = {
        "accuracy": {"rule": f"seed method >= {TARGET_SHARE:.0%} of dense where dense >= "
                     f"{DENSE_BAR}", "cells": share,
                     "met": sum(c["meets"] for c in share), "of": len(share)},
        "resa_error_cut": {"rule": f"RESA cuts the base method's mean attention error "
                           f"(sparse layers) by >= {TARGET_RESA_CUT:.0%}", "cells": cut,
                           "met": sum(c["meets"] for c in cut), "of": len(cut)},
        "fitted_vs_default": {"rule": "the fitted (calibrated / trained) layer choices no worse "
                              "than the defaults", "cells": fitted_vs_default,
                              "met": sum(c["meets"] for c in fitted_vs_default),
                              "of": len(fitted_vs_default)}}


def compare(base: dict, other: dict) -> dict:
    """Cell by cell, `other`'s accuracy and attention error against `base`'s (runs of one
    model with two KV cache dtypes): accuracy points, prompts answered differently, and the
    cells within TARGET_KV_POINTS."""
    theirs = {_cell_key(r): r for r in other["results"]}
    cells = []
    for r in base["results"]:
        o = theirs.get(_cell_key(r))
        if o is None:
            continue
        points = 100 * (o["accuracy"] - r["accuracy"])
        cells.append({"method": r["method"], "budget_ratio": r["budget_ratio"],
                      "context": r["context"], "task": r["task"], "prompts": len(r["scores"]),
                      "accuracy_base": r["accuracy"], "accuracy": o["accuracy"],
                      "points": round(points, 2),
                      "prompts_changed": int(sum(a != b for a, b in zip(r["scores"],
                                                                          o["scores"]))),
                      "attn_error_base": round(r["mean_attn_error"], 4),
                      "attn_error": round(o["mean_attn_error"], 4),
                      "meets": abs(points) <= TARGET_KV_POINTS})
    return {"base_kv_dtype": base.get("kv_dtype"), "kv_dtype": other.get("kv_dtype"),
            "model": base.get("model"), "device_kind": base.get("device_kind"),
            "samples_per_task": base.get("samples_per_task"), "cells": cells,
            "target": {"rule": f"accuracy within {TARGET_KV_POINTS} point(s) of the base dtype's",
                       "met": sum(c["meets"] for c in cells), "of": len(cells)}}


def plot(doc: dict, path: Path) -> None:
    """Accuracy, attention recall and attention error (rows) per method, one column per context and
    budget, averaged over the tasks where dense >= 0.75."""
    from sparsejax.plotting import figure, save

    results = doc["results"]
    dense = {(r["context"], r["task"]): r["accuracy"] for r in results if r["method"] == "dense"}
    cols = sorted({(r["context"], r["budget_ratio"]) for r in results
                   if r["budget_ratio"] is not None})
    methods = list(dict.fromkeys(r["method"] for r in results if r["method"] != "dense"))
    keys = ("accuracy", "mean_recall", "mean_attn_error")
    titles = ("accuracy", "attention recall (sparse layers)", "attention error (sparse layers)")
    fig, axes = figure(len(keys), max(1, len(cols)), figsize=(5 * max(1, len(cols)), 10))
    for j, (context, ratio) in enumerate(cols):
        rows = [r for r in results if r["context"] == context and r["budget_ratio"] == ratio
                and dense.get((context, r["task"]), 0) >= DENSE_BAR]
        ok = [t for (c, t), a in dense.items() if c == context and a >= DENSE_BAR]
        dense_mean = np.mean([dense[context, t] for t in ok]) if ok else np.nan
        for i, key in enumerate(keys):
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
            ax.set_title(f"{context} tokens, budget {ratio:.0%}: {titles[i]}", fontsize=9)
    names = ", ".join(sorted({r["task"] for r in results}))
    device = doc.get("device_kind") or doc.get("device")
    fig.suptitle(f"{doc.get('model', '')} on real prose ({device}, "   # two lines: one column
                 f"{doc.get('samples_per_task')} prompts a task)\ntasks: {names}", fontsize=10)
    save(fig, path)


def _copy_to_out(paths) -> None:
    """Copies of the result files in $OUT (the device machine's returned folder), if set."""
    folder = os.environ.get("OUT")
    if not folder:
        return
    for path in paths:
        target = Path(folder) / Path(path).name
        if Path(path).exists() and not (target.exists() and target.samefile(path)):
            shutil.copy2(path, target)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("command", nargs="?", default="measure",
                   choices=["measure", "plot", "merge", "compare"])
    p.add_argument("inputs", nargs="*", type=Path, help="merge: result files (a later one's "
                   "cell replaces an earlier one's); compare: BASE.json OTHER.json (two KV "
                   "cache dtypes) -> --out")
    p.add_argument("--model", default=os.environ.get("SPARSEJAX_REAL_MODEL", "smollm2"),
                   help="checkpoint directory, .gguf or name (default: $SPARSEJAX_REAL_MODEL, "
                   "else smollm2)")
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--ratios", type=float, nargs="+", default=[0.1, 0.2])
    p.add_argument("--tasks", default=FULL_TASKS, help="dense runs on each; the methods on "
                   f"those where dense >= {DENSE_BAR} (default: %(default)s)")
    p.add_argument("--samples", type=int, default=32, help="prompts per task (default 32)")
    p.add_argument("--methods", default=DEFAULT_METHODS)
    p.add_argument("--quick", action="store_true", help="a check of the whole path: "
                   + ", ".join(f"{k} {v}" for k, v in QUICK.items())
                   + "; writes to the temporary directory unless --out is given")
    p.add_argument("--kv-dtype", choices=KV_DTYPE_CHOICES, default="auto",
                   help=KV_DTYPE_HELP + " (the model runs in float32; default: %(default)s)")
    p.add_argument("--resume", action="store_true", help="keep --out's cells and run the rest")
    p.add_argument("--compile-workers", type=int, default=min(8, os.cpu_count() or 1),
                   help="threads compiling the decode programs ahead of time")
    p.add_argument("--out", type=Path, default=None, help=f"default {OUT}")
    args = p.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    if args.out is None:
        args.out = (Path(tempfile.gettempdir()) / "fidelity_real_quick.json" if args.quick
                    else OUT.with_name("fidelity_real_kv_dtype.json") if args.command == "compare"
                    else OUT if args.kv_dtype == "auto"
                    else OUT.with_name(f"fidelity_real_{args.kv_dtype}.json"))
    if args.command == "compare":
        if len(args.inputs) != 2:
            p.error(f"compare: got {len(args.inputs)} inputs, expected BASE.json OTHER.json")
        doc = compare(*map(_load, args.inputs))
        doc["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        for c in doc["cells"]:
            print(f"{c['method']:<14} {c['budget_ratio'] or '':>4} {c['context']:>5} "
                  f"{c['task']:<10} {c['accuracy_base']:.3f} -> {c['accuracy']:.3f} "
                  f"({c['prompts_changed']} changed) err {c['attn_error_base']:.4f} -> "
                  f"{c['attn_error']:.4f}")
        _save(doc, args.out)
        _copy_to_out([args.out])
        print(json.dumps(doc["target"]))
        return 0
    if args.command == "merge":
        docs = [_load(p) for p in args.inputs]
        kv_dtypes = {d.get("kv_dtype", "auto") for d in docs}
        if len(kv_dtypes) > 1:
            p.error(f"merge: the inputs hold runs of kv_dtype {sorted(kv_dtypes)}; expected "
                    "one (compare runs of two dtypes with `compare`)")
        # each cell keeps the device it ran on (the runs merged may differ)
        cells = {_cell_key(r): {**r, "device": r.get("device") or d.get("device_kind")
                                or d.get("device")}
                 for d in docs for r in d["results"]}
        counts = sorted({len(r["scores"]) for r in cells.values()})   # runs may differ
        # the first input's own sources stay listed when it is itself a merge
        sources = docs[0].get("merged_from", [args.inputs[0].name])
        doc = dict(docs[0], results=list(cells.values()),
                   merged_from=[*sources, *(p.name for p in args.inputs[1:])],
                   samples_per_task=counts[0] if len(counts) == 1 else
                   f"{counts[0]}-{counts[-1]}")
    else:
        doc = measure(args) if args.command == "measure" else _load(args.out)
    if args.command != "measure":
        summarize(doc)
        _save(doc, args.out)
    plot(doc, args.out.with_suffix(".png"))
    _copy_to_out([args.out, args.out.with_suffix(".png")])
    print(json.dumps({k: {kk: v[kk] for kk in ("met", "of")} for k, v in
                      doc["targets"].items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
