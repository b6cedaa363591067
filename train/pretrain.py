"""Train the small retrieval model shipped with sparsejax, from scratch, on the synthetic tasks of
`sparsejax.train.data` generated on the fly. The recipe, the model's shape and the throughput
estimate: docs/training.md.

    sparsejax pretrain --out DIR (--minutes M | --steps S) [--size {tiny,default}] [--batch B]
                       [--max-context N] [--seed S] [--checkpoint-dir DIR]
    python -m sparsejax.train.pretrain …   (the same)
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import functools
import json
import math
import multiprocessing
import os
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from sparsejax.models import Model, ModelConfig, forward, init_params, save_pretrained, unembed
from sparsejax.models.decoder import cast_params, num_params

from . import checkpoints, data
from .tokenizer import BOS_ID, EOS_ID, save_tokenizer, vocabulary

# eval samples take indices from here on, so they never coincide with a training sample
EVAL_INDEX_BASE = 1 << 40


# ---- recipe ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Stage:
    context: int                          # longest prompt of the stage (tokens)
    batch: int                            # sequences per step
    share: float                          # of the training time (--minutes) or steps (--steps)
    tasks: tuple[str, ...] = data.TRAIN_TASKS   # taken in turn, row by row
    short_rows: float = 0.25              # share of rows with a log-uniform amount of filler


@dataclasses.dataclass(frozen=True)
class Recipe:
    model: ModelConfig
    stages: tuple[Stage, ...]
    peak_lr: float
    warmup_steps: int
    end_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    eval_samples: int = 4         # per (task, context) at each periodic eval
    final_eval_samples: int = 32  # per (task, context) after training
    num_evals: int = 8            # periodic evals over the run

    @property
    def max_context(self) -> int:
        return self.stages[-1].context

    @property
    def eval_contexts(self) -> tuple[int, ...]:
        c = self.max_context
        lo = min(128, c)
        return tuple(sorted({max(lo, c // 8), max(lo, c // 2), c}))

    def seq_len(self, stage: int) -> int:
        """Width of a training batch: the stage's longest prompt plus the longest answer."""
        return self.stages[stage].context + data.MAX_ANSWER_TOKENS


# name: (hidden, layers, query heads, KV heads, MLP width; head_dim is 64)
_SHAPES = {"tiny": (128, 2, 2, 1, 256), "default": (256, 8, 8, 4, 768)}
_ALL = data.TRAIN_TASKS
# name: stages as (context, batch, share, tasks, short_rows). Copying is learned first, on
# 128-token prompts: "copy" alone (continue a random sequence of the haystack: only an
# induction head, attend to what followed the current token last time, solves it), then with
# multikey, then every task; then 512, 2048 and 4096 tokens. The order matters: a model that
# meets niah before it can copy by content learns to copy by position ("the k-th token after a
# needle's start"), which solves niah and multivalue but reads each token of a multikey answer
# from a random needle, and ten minutes of multikey did not move it off that circuit. Stages of
# one shape share one compiled step.
_STAGES = {
    "default": ((128, 256, 0.04, ("copy",), 1.0), (128, 256, 0.08, ("copy", "multikey"), 1.0),
                (128, 256, 0.13, _ALL, 1.0), (512, 128, 0.15, _ALL, 0.25),
                (2048, 64, 0.2, _ALL, 0.25), (4096, 32, 0.4, _ALL, 0.25)),
    "tiny": ((80, 32, 0.2, ("copy",), 1.0), (80, 32, 0.3, ("copy", "multikey"), 1.0),
             (128, 32, 0.2, _ALL, 1.0), (256, 16, 0.15, _ALL, 0.25), (512, 8, 0.15, _ALL, 0.25)),
}
_LR = {"default": (2e-3, 300), "tiny": (3e-3, 50)}   # (peak, warm-up steps)
# Continuing from a trained checkpoint (--init): retrieval is there, so no basics stage; the
# tasks that need more than a single lookup (multikey's key matching, vt's hops) get twice the
# rows, at every context, under a lower peak learning rate.
_FOCUS = ("multikey", "vt", "niah", "multikey", "vt", "multivalue", "copy")
_CONTINUED_STAGES = {
    "default": ((128, 256, 0.3, _FOCUS, 1.0), (512, 128, 0.2, _FOCUS, 0.25),
                (2048, 64, 0.2, _FOCUS, 0.25), (4096, 32, 0.3, _FOCUS, 0.25)),
    "tiny": ((128, 32, 0.4, _FOCUS, 1.0), (256, 16, 0.3, _FOCUS, 0.25),
             (512, 8, 0.3, _FOCUS, 0.25)),
}
_CONTINUED_LR = {"default": (1e-3, 100), "tiny": (1.5e-3, 25)}


def _model_config(size: str, max_context: int) -> ModelConfig:
    hidden, layers, heads, kv_heads, mlp = _SHAPES[size]
    return ModelConfig(
        model_type="llama", vocab_size=len(vocabulary()), hidden_size=hidden, num_layers=layers,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=64, intermediate_size=mlp,
        rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
        # the longest trained sequence: a max_context prompt and the longest answer
        max_position_embeddings=max_context + data.MAX_ANSWER_TOKENS,
        bos_token_id=BOS_ID, eos_token_id=EOS_ID)


def recipe(size: str = "default", *, max_context: int | None = None,
           batch: int | None = None, continued: bool = False) -> Recipe:
    """The recipe of `size`; `max_context` ends the curriculum there, `batch` sets the
    sequences per step of the longest stage (the others scale with it). `continued`: the
    stages and learning rate for training on from a trained checkpoint."""
    if size not in _STAGES:
        raise ValueError(f"size={size!r}: expected one of {tuple(_STAGES)}")
    stages = [Stage(*s) for s in (_CONTINUED_STAGES if continued else _STAGES)[size]]
    if max_context is not None:
        floor = max(data.min_context(t) for t in data.TASKS) + 1
        if max_context < floor:
            raise ValueError(f"max_context={max_context}: expected at least {floor} tokens")
        # stages at or past max_context merge into one final stage of all tasks
        kept = [s for s in stages if s.context < max_context]
        cut = [s for s in stages if s.context >= max_context]
        if cut:
            stages = kept + [Stage(max_context, cut[0].batch, sum(s.share for s in cut),
                                   short_rows=cut[-1].short_rows)]
        else:
            stages[-1] = dataclasses.replace(stages[-1], context=max_context)
    if batch is not None:
        if batch < 1:
            raise ValueError(f"batch={batch}: expected >= 1")
        scale = batch / stages[-1].batch
        stages = [dataclasses.replace(s, batch=max(1, round(s.batch * scale))) for s in stages]
    peak_lr, warmup = (_CONTINUED_LR if continued else _LR)[size]
    return Recipe(model=_model_config(size, stages[-1].context), stages=tuple(stages),
                  peak_lr=peak_lr, warmup_steps=warmup)


@dataclasses.dataclass(frozen=True)
class StageSchedule:
    """Steps per curriculum stage, fixed before training (stored in checkpoints as "plan")."""
    stage_steps: tuple[int, ...]

    @property
    def total(self) -> int:
        return sum(self.stage_steps)

    def stage_of(self, step: int) -> int:
        end = 0
        for i, n in enumerate(self.stage_steps):
            end += n
            if step < end:
                return i
        raise ValueError(f"step={step}: the plan has {self.total} steps")

    def first_sample(self, step: int, recipe: Recipe) -> int:
        """Training samples drawn before `step` (the data position)."""
        count, begin = 0, 0
        for n, stage in zip(self.stage_steps, recipe.stages):
            count += stage.batch * min(max(step - begin, 0), n)
            begin += n
        return count


def plan_by_steps(recipe: Recipe, steps: int) -> StageSchedule:
    if steps < 1:
        raise ValueError(f"steps={steps}: expected >= 1")
    shares = np.asarray([s.share for s in recipe.stages])
    counts = np.floor(shares / shares.sum() * steps).astype(int)
    counts[-1] += steps - counts.sum()
    return StageSchedule(tuple(int(c) for c in counts))


def plan_by_time(recipe: Recipe, seconds: float, step_seconds: list[float]) -> StageSchedule:
    shares = np.asarray([s.share for s in recipe.stages])
    counts = np.floor(shares / shares.sum() * seconds / np.asarray(step_seconds)).astype(int)
    counts[-1] = max(counts[-1], 1)
    return StageSchedule(tuple(int(c) for c in counts))


# ---- data -----------------------------------------------------------------------------------
def make_batch(recipe: Recipe, plan: StageSchedule, seed: int, step: int) -> data.TrainBatch:
    """The batch of `step`: the stage's tasks in turn, at the stage's context or (short rows)
    the task's needles and question plus a log-uniform amount of filler (4 tokens up), with
    sample indices continuing the run's sample count."""
    s = plan.stage_of(step)
    stage = recipe.stages[s]
    rng = np.random.default_rng((seed, step))
    indices = plan.first_sample(step, recipe) + np.arange(stage.batch)
    tasks = [stage.tasks[i % len(stage.tasks)] for i in indices]
    bare = np.asarray([data.min_context(t) for t in tasks])
    most = np.maximum(stage.context - bare, 4)
    filler = np.exp(rng.uniform(np.log(4), np.log(most))).astype(int)
    short = np.minimum(bare + filler, stage.context)
    contexts = np.where(rng.random(stage.batch) < stage.short_rows, short, stage.context)
    samples = [data.make_sample(t, int(c), seed, int(i))
               for t, c, i in zip(tasks, contexts, indices)]
    return data.train_batch(samples, recipe.seq_len(s))


def _data_worker_init():
    # data workers only run numpy: keep them off the accelerator (its memory is the trainer's)
    jax.config.update("jax_platforms", "cpu")


class BatchFeed:
    """Batches of consecutive steps, built ahead in `workers` processes (in line when 0)."""

    def __init__(self, build, start: int, stop: int, workers: int):
        self._build, self._next, self._stop = build, start, stop
        self._pending: collections.deque = collections.deque()
        self._pool = None
        if workers > 0:
            # spawn: forking a process that runs JAX threads can deadlock
            self._pool = concurrent.futures.ProcessPoolExecutor(
                workers, mp_context=multiprocessing.get_context("spawn"),
                initializer=_data_worker_init)
            for _ in range(2 * workers):
                self._submit()

    def _submit(self):
        if self._next < self._stop:
            self._pending.append(self._pool.submit(self._build, self._next))
            self._next += 1

    def get(self, step: int) -> data.TrainBatch:
        if self._pool is None:
            return self._build(step)
        batch = self._pending.popleft().result()
        self._submit()
        return batch

    def close(self):
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)


# ---- model and step -------------------------------------------------------------------------
class TrainState(NamedTuple):
    step: jax.Array           # int32 scalar: steps done
    total_steps: jax.Array    # int32 scalar: the plan's length (the learning-rate schedule's)
    params: Any               # fp32 master params
    opt_state: Any


def compute_dtype():
    """bf16 forward on accelerators (cuDNN attention), fp32 on CPU."""
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


def make_optimizer(recipe: Recipe):
    """AdamW without its learning rate (applied in the step, from `learning_rate`)."""
    decay = lambda params: jax.tree_util.tree_map_with_path(  # noqa: E731
        lambda path, _: not str(path[-1].key).endswith("norm"), params)
    return optax.chain(optax.clip_by_global_norm(recipe.clip_norm),
                       optax.scale_by_adam(b1=0.9, b2=0.95),
                       optax.add_decayed_weights(recipe.weight_decay, mask=decay))


def learning_rate(recipe: Recipe, step, total_steps):
    """Linear warm-up, then cosine decay to `end_lr_ratio` of the peak at `total_steps`.

    A function of traced (step, total_steps), so one compiled step serves any plan length."""
    warmup = jnp.clip(total_steps // 10, 1, recipe.warmup_steps).astype(jnp.float32)
    step = jnp.asarray(step, jnp.float32)
    progress = jnp.clip((step - warmup) / jnp.maximum(total_steps - warmup, 1.0), 0.0, 1.0)
    end = recipe.end_lr_ratio
    cosine = end + (1 - end) * 0.5 * (1 + jnp.cos(jnp.pi * progress))
    return recipe.peak_lr * jnp.where(step < warmup, (step + 1) / warmup, cosine)


def load_init(recipe: Recipe, path: str | Path):
    """fp32 params of the HF checkpoint at `path`, which must have the recipe's architecture."""
    from sparsejax.models import from_pretrained

    model = from_pretrained(path, dtype=jnp.float32)
    if model.config != recipe.model:
        raise ValueError(f"init={path}: its config {model.config} is not the recipe's model "
                         f"{recipe.model} (use the same --size and --max-context)")
    return model.params


def _init_record(path: str | Path) -> dict:
    """What the run starts from: the path, and the plan and time of the run that made it."""
    record = {"path": str(path)}
    log = Path(path) / "training_log.json"
    if log.exists():
        prior = json.loads(log.read_text())
        record.update({k: prior.get(k) for k in ("plan", "seed", "train_seconds", "steps_done",
                                                  "init")})
    return record


def init_state(recipe: Recipe, total_steps: int, seed: int) -> TrainState:
    params = init_params(recipe.model, jax.random.key(seed), jnp.float32)
    return TrainState(jnp.zeros((), jnp.int32), jnp.asarray(total_steps, jnp.int32), params,
                      make_optimizer(recipe).init(params))


@functools.lru_cache(maxsize=8)
def train_step_fn(recipe: Recipe, dtype_name: str):
    """The jitted train step (state donated): (state, batch) -> (state, metrics)."""
    config = recipe.model
    optimizer = make_optimizer(recipe)
    dtype = jnp.dtype(dtype_name)
    num_tasks = len(data.TRAIN_TASKS)

    def loss_fn(params, batch: data.TrainBatch):
        model = Model(config=config, params=cast_params(params, dtype))
        hidden = forward(model, batch.tokens, batch.lengths).hidden
        # the LM head only where the next token is an answer token: [B, A, H]
        hidden = jnp.take_along_axis(hidden, batch.target_positions[..., None], axis=1)
        logits = unembed(model, hidden)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch.targets)
        mask = batch.target_mask
        # mean over each row's answer tokens, then over rows: every task weighs the same
        # (a token mean lets multivalue's 16-token answers drown out the others)
        per_row = jnp.sum(ce * mask, axis=1) / jnp.maximum(jnp.sum(mask, axis=1), 1.0)
        return jnp.mean(per_row), logits

    def step(state: TrainState, batch: data.TrainBatch):
        (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, batch)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        lr = learning_rate(recipe, state.step, state.total_steps)
        params = jax.tree.map(lambda p, u: p - lr * u, state.params, updates)
        mask = batch.target_mask > 0
        hit = (jnp.argmax(logits, axis=-1) == batch.targets) & mask
        per_task = jax.nn.one_hot(batch.task_ids, num_tasks, dtype=jnp.float32).T   # [K, B]
        metrics = {
            "loss": loss,
            "grad_norm": jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads))),
            "token_hits": per_task @ jnp.sum(hit, axis=1).astype(jnp.float32),
            "tokens": per_task @ jnp.sum(mask, axis=1).astype(jnp.float32),
            # teacher-forced exact match = greedy exact match (every answer token the argmax)
            "exact": per_task @ jnp.all(hit | ~mask, axis=1).astype(jnp.float32),
            "rows": jnp.sum(per_task, axis=1),
        }
        return TrainState(state.step + 1, state.total_steps, params, opt_state), metrics

    return jax.jit(step, donate_argnums=0)


def _batch_spec(recipe: Recipe, stage: int) -> data.TrainBatch:
    B, T, A = recipe.stages[stage].batch, recipe.seq_len(stage), data.MAX_ANSWER_TOKENS
    s = jax.ShapeDtypeStruct
    return data.TrainBatch(s((B, T), jnp.int32), s((B,), jnp.int32), s((B, A), jnp.int32),
                           s((B, A), jnp.int32), s((B, A), jnp.float32), s((B,), jnp.int32))


# ---- evaluation -----------------------------------------------------------------------------
def eval_samples(recipe: Recipe, seed: int, per_cell: int) -> list[data.Sample]:
    """Fixed held-out samples: `per_cell` per (task, eval context)."""
    return [data.make_sample(task, context, seed, EVAL_INDEX_BASE + i)
            for i in range(per_cell) for context in recipe.eval_contexts for task in data.TASKS]


def dense_accuracy(model: Model, samples: list[data.Sample], rows: int, width: int) -> dict:
    """Accuracy of dense greedy decoding: exact match through `sparsejax.generate`, in
    batches of `rows` prompts padded to `width` (one compiled shape). Returns
    {task: {context: accuracy}}."""
    import sparsejax

    hits: dict = collections.defaultdict(lambda: collections.defaultdict(list))
    for start in range(0, len(samples), rows):
        chunk = samples[start:start + rows]
        ids, lengths = data.prompt_batch(chunk + chunk[:1] * (rows - len(chunk)), width)
        out = sparsejax.generate(model, ids, lengths=lengths,
                                 max_new_tokens=data.MAX_ANSWER_TOKENS, eos_token_id=EOS_ID)
        tokens = np.asarray(out.tokens)
        for s, generated in zip(chunk, tokens):
            hits[s.task][s.context].append(data.check_answer(generated, s))
    return {task: {str(c): float(np.mean(v)) for c, v in sorted(by_ctx.items())}
            for task, by_ctx in hits.items()}


# ---- training -------------------------------------------------------------------------------
class Run(NamedTuple):
    """What `train` returns: the final state and the training log."""
    state: TrainState
    log: dict


def train(recipe: Recipe, *, steps: int | None = None, minutes: float | None = None,
          seed: int = 0, init: str | Path | None = None,
          checkpoint_dir: str | Path | None = None, checkpoint_every: int = 500,
          log_every: int = 50, workers: int = 0, progress: bool = True) -> Run:
    """Train under `recipe` for `steps` steps or `minutes` of training (both: whichever ends
    first). Resumes from the newest intact checkpoint in `checkpoint_dir` when there is one."""
    if steps is None and minutes is None:
        raise ValueError("give steps= or minutes= (the training length)")
    if minutes is not None and not (math.isfinite(minutes) and minutes > 0):
        raise ValueError(f"minutes={minutes}: expected a finite value > 0")
    if steps is not None and steps < 1:
        raise ValueError(f"steps={steps}: expected >= 1")
    dtype = jnp.dtype(compute_dtype())
    recipe_json = json.loads(json.dumps(dataclasses.asdict(recipe), default=str))
    manager = None if checkpoint_dir is None else checkpoints.open_manager(checkpoint_dir,
                                                                           checkpoint_every)
    state, meta = init_state(recipe, 1, seed), None
    if init is not None:
        state = state._replace(params=load_init(recipe, init))
        state = state._replace(opt_state=make_optimizer(recipe).init(state.params))
    restored = None if manager is None else checkpoints.restore(
        manager, jax.eval_shape(lambda: state), set_aside_damaged=True)
    if restored is not None:
        state, meta = TrainState(*restored[0]), restored[1]
        if meta["recipe"] != recipe_json or meta["seed"] != seed:
            raise ValueError(f"checkpoint_dir={checkpoint_dir} holds a run of another recipe or "
                             f"seed (seed {meta['seed']}): use another checkpoint directory")
        if steps is not None and minutes is None and sum(meta["plan"]) != steps:
            raise ValueError(f"checkpoint_dir={checkpoint_dir} holds a run planned for "
                             f"{sum(meta['plan'])} steps, not steps={steps}")

    t0 = time.perf_counter()
    compiled, attention = _compile(recipe, state, dtype, seed)
    compile_s = time.perf_counter() - t0
    if meta is not None:       # resume: the stored plan, log and clock continue the run
        plan = StageSchedule(tuple(meta["plan"]))
        log, train_s = meta["log"], float(meta["train_seconds"])
    else:
        if steps is not None:
            plan = plan_by_steps(recipe, steps)
        else:
            step_seconds, eval_seconds = _time_stages(recipe, compiled, state, dtype, seed,
                                                      workers)
            # the periodic evals count against the budget too
            seconds = minutes * 60.0 - (recipe.num_evals + 1) * eval_seconds
            if seconds <= 0:
                raise ValueError(f"minutes={minutes} leaves no time to train: one eval takes "
                                 f"{eval_seconds:.1f} s")
            plan = plan_by_time(recipe, seconds, step_seconds)
        state = state._replace(total_steps=jnp.asarray(plan.total, jnp.int32))
        log = {"recipe": recipe_json, "seed": seed, "plan": list(plan.stage_steps),
               "init": None if init is None else _init_record(init),
               "params": num_params(state.params), "device": _device_name(),
               "jax_version": jax.__version__, "compute_dtype": dtype.name, "records": [],
               "evals": [], "compile_seconds": []}
        train_s = 0.0
    log["attention"] = attention
    log["compile_seconds"].append(round(compile_s, 1))

    def checkpoint(force=False):
        checkpoints.save(manager, int(state.step), state,
                         {"step": int(state.step), "recipe": recipe_json, "seed": seed,
                          "plan": list(plan.stage_steps), "log": log,
                          "train_seconds": train_s + time.perf_counter() - seg_t}, force=force)

    start = int(state.step)
    evals = eval_samples(recipe, seed, recipe.eval_samples)
    eval_every = max(1, plan.total // recipe.num_evals)
    feed = BatchFeed(functools.partial(make_batch, recipe, plan, seed), start, plan.total,
                     workers)
    bar = _progress(plan.total, start, progress)
    window: list = []
    window_tokens, window_t = 0, time.perf_counter()
    seg_t = time.perf_counter()
    stopped_early = False
    try:
        for step in range(start, plan.total):
            if minutes is not None and train_s + time.perf_counter() - seg_t > minutes * 60:
                stopped_early = True
                break
            stage = plan.stage_of(step)
            state, metrics = compiled[stage](state, feed.get(step))
            window.append(metrics)
            window_tokens += recipe.stages[stage].batch * recipe.seq_len(stage)
            bar.update(1)
            done = step + 1
            if done % log_every == 0 or done == plan.total:
                # the one host sync of the loop (besides evals and checkpoints)
                record = _record(jax.device_get(window), done, recipe.stages[stage].context,
                                 window_tokens / (time.perf_counter() - window_t),
                                 float(learning_rate(recipe, step, plan.total)),
                                 train_s + time.perf_counter() - seg_t)
                log["records"].append(record)
                bar.set_postfix_str(_postfix(record), refresh=False)
                window, window_tokens, window_t = [], 0, time.perf_counter()
            if done % eval_every == 0 or done == plan.total:
                t = time.perf_counter()
                model = Model(recipe.model, cast_params(state.params, dtype))
                acc = dense_accuracy(model, evals, len(evals), recipe.max_context)
                log["evals"].append({"step": done, "exact_match": acc})
                bar.write(f"step {done}: greedy exact match {_summary(acc)}")
                window_t += time.perf_counter() - t   # tokens/s counts training time only
            if manager is not None and done % checkpoint_every == 0:
                checkpoint()
    finally:
        feed.close()
        bar.close()
    jax.block_until_ready(state)
    log["train_seconds"] = round(train_s + time.perf_counter() - seg_t, 1)
    log["steps_done"] = int(state.step)
    log["stopped_early"] = stopped_early
    if manager is not None:
        if int(state.step) not in manager.all_steps():
            checkpoint(force=True)
    return Run(state, log)


def _compile(recipe: Recipe, state: TrainState, dtype, seed: int):
    """AOT-compile the train step of every stage shape and warm up the eval's `generate`, in
    parallel threads. Returns one compiled step per stage (stages of one shape share it) and
    which attention the steps lowered to."""
    step_fn = train_step_fn(recipe, dtype.name)
    abstract_state = jax.eval_shape(lambda: state)
    shapes = [(s.batch, recipe.seq_len(i)) for i, s in enumerate(recipe.stages)]
    first_of_shape = {shape: shapes.index(shape) for shape in shapes}

    def lower(i):
        return step_fn.lower(abstract_state, _batch_spec(recipe, i)).compile()

    def warm_eval():
        model = Model(recipe.model, cast_params(state.params, dtype))
        samples = eval_samples(recipe, seed, recipe.eval_samples)
        dense_accuracy(model, samples[:1], len(samples), recipe.max_context)

    with concurrent.futures.ThreadPoolExecutor(len(first_of_shape) + 1) as pool:
        futures = {shape: pool.submit(lower, i) for shape, i in first_of_shape.items()}
        pool.submit(warm_eval).result()
        by_shape = {shape: f.result() for shape, f in futures.items()}
    compiled = [by_shape[shape] for shape in shapes]
    attention = "cudnn" if "cudnn$fmha" in compiled[-1].as_text() else "xla"
    _check_memory(recipe, compiled, attention)
    return compiled, attention


def _check_memory(recipe: Recipe, compiled: list, attention: str) -> None:
    """Refuse, before training, a stage whose step does not fit in the device's memory."""
    limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
    for stage, fn in zip(recipe.stages, compiled):
        m = fn.memory_analysis()
        if not limit or m is None:
            return
        need = (m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes
                - m.alias_size_in_bytes)
        if need > limit:
            raise ValueError(
                f"a step of the {stage.context}-token stage (batch {stage.batch}) needs "
                f"{need / 2**30:.1f} GiB; the device has {limit / 2**30:.1f} GiB: lower "
                f"--batch.")


def _time_stages(recipe: Recipe, compiled: list, state: TrainState, dtype, seed: int,
                 workers: int) -> tuple[list[float], float]:
    """Seconds per step of each stage (the second of two steps on a copy of the state, or the
    time `workers` data processes take to build its batch, if that is longer), and seconds
    per periodic eval."""
    provisional = StageSchedule(tuple(1 for _ in recipe.stages))
    seconds = []
    for i, fn in enumerate(compiled):
        t = time.perf_counter()
        batch = make_batch(recipe, provisional, seed, i)
        build = time.perf_counter() - t
        scratch, _ = fn(jax.tree.map(jnp.copy, state), batch)
        jax.block_until_ready(scratch)
        t = time.perf_counter()
        jax.block_until_ready(fn(scratch, batch))
        step = time.perf_counter() - t
        # building overlaps the steps in worker processes, and is in line without them
        seconds.append(max(step, 1.25 * build / workers) if workers else step + build)
    t = time.perf_counter()
    evals = eval_samples(recipe, seed, recipe.eval_samples)
    dense_accuracy(Model(recipe.model, cast_params(state.params, dtype)), evals, len(evals),
                   recipe.max_context)
    return seconds, time.perf_counter() - t


def _record(window: list[dict], step: int, context: int, tokens_per_s: float, lr: float,
            elapsed: float) -> dict:
    total = {k: np.sum([w[k] for w in window], axis=0) for k in window[0]}
    per_task = lambda num, den: {t: round(float(n / d), 4) if d else None  # noqa: E731
                                 for t, n, d in zip(data.TRAIN_TASKS, total[num], total[den])}
    return {"step": step, "context": context,
            "loss": round(float(np.mean([w["loss"] for w in window])), 5),
            "grad_norm": round(float(np.mean([w["grad_norm"] for w in window])), 4),
            "token_accuracy": per_task("token_hits", "tokens"),
            "exact_match": per_task("exact", "rows"),
            "tokens_per_s": round(tokens_per_s), "lr": lr, "elapsed_s": round(elapsed, 1)}


def _postfix(record: dict) -> str:
    acc = " ".join(f"{t}={v:.2f}" for t, v in record["exact_match"].items() if v is not None)
    return (f"ctx={record['context']} loss={record['loss']:.3f} {acc} "
            f"tok/s={record['tokens_per_s'] / 1e3:.0f}k")


def _summary(acc: dict) -> str:
    return "  ".join(f"{task} " + "/".join(f"{v:.2f}" for v in by_ctx.values())
                     for task, by_ctx in acc.items()) + \
        f"  (contexts {'/'.join(next(iter(acc.values())))})"


def _progress(total: int, initial: int, enabled: bool):
    from tqdm.auto import tqdm

    # redrawn every 2 s on a terminal, every 30 s into a log file
    return tqdm(total=total, initial=initial, disable=not enabled, dynamic_ncols=True,
                mininterval=2.0 if sys.stdout.isatty() else 30.0, file=sys.stdout)


def _device_name() -> str:
    d = jax.devices()[0]
    return getattr(d, "device_kind", str(d))


# ---- export ---------------------------------------------------------------------------------
def export(run: Run, recipe: Recipe, out: str | Path, seed: int = 0) -> Path:
    """A final greedy exact-match eval of the bf16 weights (recorded in the log), then the bf16
    HF checkpoint, tokenizer, training_log.json and training_curve.png into `out`."""
    out = Path(out)
    model = Model(recipe.model, cast_params(run.state.params, jnp.bfloat16))
    samples = eval_samples(recipe, seed, recipe.final_eval_samples)
    rows = len(data.TASKS) * len(recipe.eval_contexts) * recipe.eval_samples
    t = time.perf_counter()
    accuracy = dense_accuracy(model, samples, rows, recipe.max_context)
    run.log["final_eval"] = {"samples_per_cell": recipe.final_eval_samples,
                             "exact_match": accuracy,
                             "seconds": round(time.perf_counter() - t, 1)}
    save_pretrained(model, out)
    save_tokenizer(out, recipe.model.max_position_embeddings)
    (out / "training_log.json").write_text(json.dumps(run.log, indent=1) + "\n")
    plot_curve(run.log, out / "training_curve.png")
    return out


def plot_curve(log: dict, path: Path) -> None:
    from sparsejax.plotting import figure, save

    records = log["records"]
    steps = [r["step"] for r in records]
    fig, ((ax_loss, ax_acc),) = figure(1, 2, figsize=(12, 4.5))
    ax_loss.plot(steps, [r["loss"] for r in records], color="black")
    ax_loss.set_yscale("log")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("answer cross-entropy")
    ctx_ax = ax_loss.twinx()
    ctx_ax.step(steps, [r["context"] for r in records], color="gray", alpha=0.5, where="post")
    ctx_ax.set_ylabel("curriculum context (tokens)", color="gray")
    for i, task in enumerate(data.TRAIN_TASKS):
        color = f"C{i}"
        ax_acc.plot(steps, [r["exact_match"][task] for r in records], color=color, alpha=0.5,
                    label=f"{task} (train batch)")
        evals = [(e["step"], list(e["exact_match"][task].values())[-1]) for e in log["evals"]
                 if task in e["exact_match"]]
        if evals:
            ax_acc.plot(*zip(*evals), "o-", color=color, label=f"{task} (greedy, longest ctx)")
    ax_acc.set_ylim(-0.02, 1.02)
    ax_acc.set_xlabel("step")
    ax_acc.set_ylabel("exact match")
    ax_acc.legend(fontsize=7, loc="best")
    fig.suptitle(f"{log['params'] / 1e6:.2f} M params, {log['device']}, "
                 f"{log.get('train_seconds', 0):.0f} s of training")
    save(fig, path, dpi=110)


# ---- command line ---------------------------------------------------------------------------
def add_parser(subparsers) -> argparse.ArgumentParser:
    from sparsejax.arguments import positive_int

    p = subparsers.add_parser("pretrain", help="train a small retrieval model from scratch",
                              description="Train a small Llama from scratch on the synthetic "
                              "tasks of sparsejax.train.data and export it as an HF checkpoint "
                              "(the embedded model's recipe; --size tiny trains on a CPU).",
                              epilog="The recipe, the curriculum and why: docs/training.md")
    p.add_argument("--out", required=True, help="export directory (HF checkpoint + logs)")
    p.add_argument("--minutes", type=float, default=None,
                   help="training time, compile excluded (plans the step counts; "
                   "default: --steps)")
    p.add_argument("--steps", type=positive_int, default=None,
                   help="training steps (default: planned from --minutes; one is needed)")
    p.add_argument("--size", choices=tuple(_STAGES), default="default",
                   help="model and curriculum size")
    p.add_argument("--batch", type=positive_int, default=None,
                   help="sequences per step at the longest context, other stages scale "
                   "(default: the size's)")
    p.add_argument("--max-context", type=positive_int, default=None,
                   help="end the context curriculum at this prompt length (default: the size's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the data")
    p.add_argument("--init", default=None,
                   help="continue from this exported checkpoint (its --size), with the "
                        "continued-training stages and learning rate (default: from scratch)")
    p.add_argument("--checkpoint-dir", default=None,
                   help="Orbax checkpoints; a run resumes from the newest intact one there "
                   "(default: none)")
    p.add_argument("--checkpoint-every", type=positive_int, default=500,
                   help="steps between checkpoints")
    p.add_argument("--log-every", type=positive_int, default=50,
                   help="steps between logged records")
    p.add_argument("--workers", type=int, default=None,
                   help="data processes (default: none on CPU, up to 8 on accelerators)")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    from sparsejax.files import check_writable

    if args.minutes is None and args.steps is None:
        raise ValueError("pretrain needs --minutes M or --steps S")
    if args.workers is not None and args.workers < 0:
        raise ValueError(f"--workers {args.workers}: expected an int >= 0 (0: no data processes)")
    check_writable(args.out, "--out", directory=True)       # before the training, not after
    rcp = recipe(args.size, max_context=args.max_context, batch=args.batch,
                 continued=args.init is not None)
    workers = args.workers
    if workers is None:
        workers = 0 if jax.default_backend() == "cpu" else min(8, (os.cpu_count() or 2) // 2)
    c = rcp.model
    print(f"sparsejax pretrain: {args.size} llama, {c.num_layers} layers, hidden "
          f"{c.hidden_size}, {c.num_heads}/{c.num_kv_heads} heads × {c.head_dim}; stages "
          + ", ".join(f"{s.context}×{s.batch}" for s in rcp.stages)
          + f"; {jax.default_backend()}, {workers} data workers", flush=True)
    result = train(rcp, steps=args.steps, minutes=args.minutes, seed=args.seed, init=args.init,
                   checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                   log_every=args.log_every, workers=workers)
    log = result.log
    print(f"trained {log['steps_done']} steps (plan {log['plan']}) in {log['train_seconds']} s; "
          f"compile {log['compile_seconds']} s; attention {log['attention']}", flush=True)
    out = export(result, rcp, args.out, seed=args.seed)
    final = log["final_eval"]
    print(f"final greedy exact match ({final['samples_per_cell']} per cell): "
          f"{_summary(final['exact_match'])}")
    print(f"exported to {out}: {', '.join(sorted(p.name for p in out.iterdir()))}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sparsejax.train.pretrain")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    try:
        args = parser.parse_args(["pretrain", *(sys.argv[1:] if argv is None else argv)])
    except SystemExit as e:         # argparse has printed the usage error
        return e.code
    try:
        return args.func(args)
    except (ValueError, checkpoints.CheckpointSaveError) as e:
        print(f"sparsejax pretrain: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
