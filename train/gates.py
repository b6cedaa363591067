"""LycheeDecode's retrieval-head gates: HardKuma distillation training with Orbax checkpoints,
and the gate files `methods.Lychee(gates=PATH)` reads (`save_gates`). The algorithm and its
settings: docs/training.md.

    sparsejax train-gates --model DIR --text book.txt more.jsonl [--target-heads N] [--steps S]
        [--context T] [--out DIR] [--budget-ratio R] [--loss logits|hidden]
        [--checkpoint-dir DIR] [--seed S]
    (defaults that fit the model; the gates go to DIR/gates/gates.json)
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import sys
from pathlib import Path
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from sparsejax import artifacts, hardkuma, selection, sharding
from sparsejax.methods import Lychee, Ratio
from sparsejax.models import (Model, ModelConfig, attention_inputs, embed, finish_layer, forward,
                              stack_layers, unembed)
from sparsejax.models.decoder import rms_norm
from sparsejax.pallas_kernels.sparse_attention import attended_mask
from sparsejax.plan import Budget, SparsePlan

from . import checkpoints
from .passkey import GateBatch, PasskeyData

LOSSES = ("logits", "hidden")
LOG_BOUND = 1.5       # log a and log b are projected onto [-LOG_BOUND, LOG_BOUND]


# ---- settings and state ---------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class GateTraining:
    """Everything besides the model and data that determines a run (hashable: one compile)."""
    target: float
    steps: int
    lr: float
    lambda_lr: float
    budget: Budget
    sinks: int
    recent: int
    block: int
    loss: str

    def to_json(self) -> dict:
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def from_json(cls, d: dict) -> "GateTraining":
        return cls(**{**d, "budget": Budget(**d["budget"])})


@flax.struct.dataclass
class GateState:
    step: jax.Array       # int32 scalar: steps done (= batches read)
    params: dict          # {"log_a", "log_b"}: [layers - 1, kv_heads] float32
    opt_state: Any
    lam: jax.Array        # float32 scalar: the Lagrange multiplier, in units of scale / G
    scale: jax.Array      # float32 scalar: D0, the distillation loss of step 0 (0 before)
    rng: jax.Array        # uint32 key data; step s samples with fold_in(key, s)
    target: float = flax.struct.field(pytree_node=False)
    fingerprint: artifacts.Fingerprint | None = flax.struct.field(pytree_node=False,
                                                                   default=None)

    @property
    def a(self) -> jax.Array:
        return jnp.exp(self.params["log_a"])

    @property
    def b(self) -> jax.Array:
        return jnp.exp(self.params["log_b"])

    def mean(self) -> np.ndarray:
        """E[z] per gated head, [layers - 1, kv_heads]."""
        return np.asarray(hardkuma.mean(self.a, self.b))

    def expected_l0(self) -> float:
        return float(hardkuma.expected_l0(self.a, self.b))

    def retrieval_heads(self) -> np.ndarray:
        """[layers, kv_heads] bool: layer 0, and every head with E[z] > 0.5."""
        gated = self.mean() > 0.5
        return np.concatenate([np.ones((1, gated.shape[1]), bool), gated])


def _warmup_cooldown(steps: int):
    """The reference code's schedule factor: 0.1 -> 1 over the first fifth of the steps, 1,
    then back to 0.1 over the last fifth."""
    ramp = max(steps // 5, 1)

    def factor(count):
        up = jnp.maximum((count + 1) / ramp, 0.1)
        down = jnp.maximum((steps - count) / ramp, 0.1)
        return jnp.minimum(1.0, jnp.minimum(up, down))

    return factor


def _optimizer(training: GateTraining):
    factor = _warmup_cooldown(training.steps)
    return optax.adamw(lambda count: training.lr * factor(count), weight_decay=0.0)


def init_gate_state(num_layers: int, num_kv_heads: int, training: GateTraining, seed: int,
                    fingerprint: artifacts.Fingerprint | None = None) -> GateState:
    """a = b = 1 (a uniform Kuma) for every KV head of layers 1..L-1, lam = 1."""
    shape = (num_layers - 1, num_kv_heads)
    params = {"log_a": jnp.zeros(shape, jnp.float32), "log_b": jnp.zeros(shape, jnp.float32)}
    return GateState(step=jnp.zeros((), jnp.int32), params=params,
                     opt_state=_optimizer(training).init(params),
                     lam=jnp.ones((), jnp.float32), scale=jnp.zeros((), jnp.float32),
                     rng=jax.random.key_data(jax.random.key(seed)),
                     target=float(training.target), fingerprint=fingerprint)


# ---- teacher and student --------------------------------------------------------------------
def features(model: Model, hidden: jax.Array, loss: str) -> jax.Array:
    """What the loss compares: logits, or the final hidden states after the final norm."""
    if loss == "logits":
        return unembed(model, hidden)
    c = model.config
    return rms_norm(hidden, model.params["final_norm"], c.rms_norm_eps).astype(jnp.float32)


def teacher(model: Model, batch: GateBatch, loss: str):
    """The dense model over prompt + targets -> (keys, values [L, B, W, HK, D], features of the
    target positions [B, A, F])."""
    lengths = batch.prompt_lengths + batch.target_positions.shape[1]
    out = forward(model, batch.tokens, lengths)
    hidden = jnp.take_along_axis(out.hidden, batch.target_positions[..., None], axis=1)
    return out.keys, out.values, features(model, hidden, loss)


def student(model: Model, plan: SparsePlan, batch: GateBatch, keys: jax.Array,
            values: jax.Array, z: jax.Array) -> jax.Array:
    """The hybrid model's final hidden states [B, A, H] at the target positions.

    keys, values [L, B, W, HK, D]: the teacher's; the prompt part is shared, the target part
    is replaced layer by layer with the student's own. z [L, HK]: each KV head's mix weight.
    """
    c = model.config
    B, W = batch.tokens.shape
    A = batch.target_positions.shape[1]
    pos = batch.target_positions                                                  # [B, A]
    rows = jnp.arange(B)[:, None]
    visible = jnp.arange(W)[None, None, :] <= pos[:, :, None]                    # [B, A, W]
    slot = jnp.arange(W)[None, :] - batch.prompt_lengths[:, None]                # [B, W]
    own = ((slot >= 0) & (slot < A))[..., None, None]   # key positions of the student's tokens
    slot = jnp.clip(slot, 0, A - 1)
    row_lengths = (pos + 1).reshape(-1)                                           # [B * A]
    group = c.num_heads // c.num_kv_heads

    def layer(carry, xs):
        h, selected = carry                                # selected [B, HQ, A, W] bool
        lp, k_cache, v_cache, z_layer = xs
        q, k, v = attention_inputs(c, lp, h, pos)
        k_all = jnp.where(own, k[rows, slot], k_cache)                          # [B, W, HK, D]
        v_all = jnp.where(own, v[rows, slot], v_cache)
        dense = jax.nn.dot_product_attention(q, k_all, v_all, mask=visible[:, None])
        sparse = jax.nn.dot_product_attention(q, k_all, v_all, mask=selected & visible[:, None])
        w = jnp.repeat(z_layer, group)[:, None]                                  # [HQ, 1]
        out = w * dense.astype(jnp.float32) + (1 - w) * sparse.astype(jnp.float32)
        h = finish_layer(c, lp, h, out.astype(q.dtype))
        return (h, _selection_mask(plan, c, q, k_all, visible, row_lengths)), None

    h = embed(model, jnp.take_along_axis(batch.tokens, pos, axis=1))
    everything = jnp.ones((B, c.num_heads, A, W), bool)   # layer 0 (z = 1) inherits no set
    (h, _), _ = jax.lax.scan(layer, (h, everything), (model.params["layers"], keys, values, z))
    return h


def _selection_mask(plan, config, q, k_all, visible, row_lengths):
    """The next layer's token sets, chosen as Lychee's retrieval heads choose them: top-k of the
    group-mean query's logits per KV head -> [B, HQ, A, W] bool. Integer-valued: no gradient."""
    B, A, HQ, D = q.shape
    _, W, HK, _ = k_all.shape
    q, k_all = jax.lax.stop_gradient(q), jax.lax.stop_gradient(k_all)
    qbar = jnp.mean(q.astype(jnp.float32).reshape(B, A, HK, HQ // HK, D), axis=3)
    scores = jnp.einsum("bahd,bshd->bahs", qbar, k_all.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST) / math.sqrt(D)
    scores = jnp.where(visible[:, :, None, :], scores, -jnp.inf).reshape(B * A, HK, W)
    sel = selection.select(plan, config, scores, row_lengths, W)
    mask = attended_mask(sel.indices, sel.count, row_lengths, num_positions=W, num_heads=HQ,
                         num_kv_heads=HK, unit=plan.selector.unit)
    return mask.reshape(B, A, HQ, W).transpose(0, 2, 1, 3)


def _plan(config: ModelConfig, training: GateTraining) -> SparsePlan:
    """Lychee's plan with every head retrieving: its selector is the one training uses."""
    heads = np.ones((config.num_layers, config.num_kv_heads), bool)
    return Lychee(heads, budget=training.budget, sinks=training.sinks, recent=training.recent,
                  block=training.block).to_plan(config)


# ---- one step -------------------------------------------------------------------------------
@functools.lru_cache(maxsize=8)
def _compiled(config: ModelConfig, training: GateTraining):
    """(jitted teacher, jitted step with the state donated) for this model shape and run."""
    plan = _plan(config, training)
    optimizer = _optimizer(training)
    target = training.target

    def objective(params, state, key, model, batch, keys, values, wanted):
        a, b = jnp.exp(params["log_a"]), jnp.exp(params["log_b"])
        z = jnp.concatenate([jnp.ones((1, a.shape[1])), hardkuma.sample(key, a, b)])
        got = features(model, student(model, plan, batch, keys, values, z), training.loss)
        err = jnp.mean(jnp.square(got - wanted), axis=-1)                            # [B, A]
        mask = batch.target_mask
        distill = jnp.sum(err * mask) / jnp.maximum(jnp.sum(mask), 1.0)
        scale = jnp.where(state.step == 0, jnp.maximum(jax.lax.stop_gradient(distill), 1e-30),
                          state.scale)
        l0 = hardkuma.expected_l0(a, b)
        gated = a.size
        return distill / scale + state.lam * (l0 - target) / gated, (distill, l0, scale)

    def step(state: GateState, model, batch, keys, values, wanted):
        key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        (_, (distill, l0, scale)), grads = jax.value_and_grad(objective, has_aux=True)(
            state.params, state, key, model, batch, keys, values, wanted)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = jax.tree.map(lambda p: jnp.clip(p, -LOG_BOUND, LOG_BOUND),
                              optax.apply_updates(state.params, updates))
        rate = training.lambda_lr * _warmup_cooldown(training.steps)(state.step)
        lam = state.lam * jnp.exp(rate * (l0 - target) / params["log_a"].size)
        heads = jnp.sum(hardkuma.mean(jnp.exp(params["log_a"]), jnp.exp(params["log_b"])) > 0.5)
        metrics = {"loss": distill, "expected_l0": l0, "lambda": lam, "heads": heads}
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                             lam=lam, scale=scale), metrics

    return (jax.jit(functools.partial(teacher, loss=training.loss)),
            jax.jit(step, donate_argnums=0))


# ---- training -------------------------------------------------------------------------------
def train_gates(model: Model, data, *, target_retrieval_heads: float, steps: int = 3000,
                lr: float = 0.01, lambda_lr: float = 0.02, budget: Budget = Ratio(0.3),
                sinks: int = 128, recent: int = 256, block: int = 1, loss: str = "logits",
                seed: int = 0, checkpoint_dir: str | Path | None = None,
                checkpoint_every: int = 100, progress: bool = True,
                callback: Callable[[int, dict], None] | None = None, mesh=None) -> GateState:
    """Train HardKuma head gates of the frozen `model` so that about `target_retrieval_heads`
    KV heads of layers 1..L-1 become retrieval heads (docs/training.md).

    data: `PasskeyData`, or any object with `batch(step) -> GateBatch` (same shapes every
      step, a pure function of step) and `describe() -> dict` (JSON; compared on resume).
    lr: AdamW's peak learning rate on log a, log b; lambda_lr: the multiplier's step on
      log lam (both follow the warm-up / cool-down schedule).
    budget, sinks, recent, block: the sparse heads' token sets, as `methods.Lychee` takes them
      (use the values you will decode with).
    loss: "logits" (the paper) or "hidden" (final hidden states, the reference code).
    checkpoint_dir: Orbax checkpoints every `checkpoint_every` steps and at the end; a run
      resumes from the latest one there (it must hold a run of the same settings).
    callback: called after every step with (steps done, {"loss", "expected_l0", "lambda",
      "heads"}) as floats; "heads" counts gated heads with E[z] > 0.5.
    mesh: the frozen model tensor-parallel on it (`sparsejax.shard`; the gates and batches
      replicated); the same gates as without, up to the all-reduces' rounding.
    """
    c = model.config
    if c.num_layers < 2:
        raise ValueError(f"the model has {c.num_layers} layer: gates need layers >= 1")
    gated = (c.num_layers - 1) * c.num_kv_heads
    if not 0 <= target_retrieval_heads <= gated:
        raise ValueError(f"target_retrieval_heads={target_retrieval_heads}: expected 0..{gated} "
                         f"(KV heads of layers 1..{c.num_layers - 1})")
    for name, value in (("steps", steps), ("checkpoint_every", checkpoint_every)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: expected an int >= 1")
    for name, value in (("lr", lr), ("lambda_lr", lambda_lr)):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name}={value!r}: expected a finite value > 0")
    if loss not in LOSSES:
        raise ValueError(f"loss={loss!r}: expected one of {LOSSES}")
    model = model.replace(params=stack_layers(model.params, c))   # the student scans layers
    if mesh is not None:
        model = sharding.shard(model, mesh)
    training = GateTraining(float(target_retrieval_heads), steps, float(lr), float(lambda_lr),
                            budget, int(sinks), int(recent), int(block), loss)
    teacher_fn, step_fn = _compiled(c, training)   # also validates budget/sinks/recent/block
    fingerprint = artifacts.fingerprint(model)
    meta = {"training": training.to_json(), "data": data.describe(),
            "fingerprint": fingerprint.to_json(), "seed": int(seed),
            "shape": [c.num_layers, c.num_kv_heads]}
    state = init_gate_state(c.num_layers, c.num_kv_heads, training, seed, fingerprint)
    manager = None
    if checkpoint_dir is not None:
        manager = checkpoints.open_manager(checkpoint_dir, checkpoint_every)
        restored = _restore(manager, state, set_aside_damaged=True)
        if restored is not None:
            state, stored = restored
            changed = sorted(k for k in meta if stored.get(k) != meta[k])
            if changed:
                raise ValueError(f"checkpoint_dir={str(checkpoint_dir)!r} holds a run with other "
                                 f"{', '.join(changed)}: resume with the same settings or use "
                                 "another directory")
    bar = _progress(steps, int(state.step), progress)
    shapes = None
    try:
        for s in range(int(state.step), steps):
            batch = _checked_batch(data, s, shapes)
            shapes = [x.shape for x in batch]
            state, metrics = step_fn(state, model, batch, *teacher_fn(model, batch))
            metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
            bar.update(1)
            bar.set_postfix_str(f"loss={metrics['loss']:.4g} E[L0]={metrics['expected_l0']:.2f} "
                                f"λ={metrics['lambda']:.3g} heads={int(metrics['heads'])}",
                                refresh=False)
            if callback is not None:
                callback(s + 1, metrics)
            if manager is not None and (s + 1) % checkpoint_every == 0:
                _save(manager, state, meta)
    finally:
        bar.close()
    if manager is not None and int(state.step) not in manager.all_steps():
        _save(manager, state, meta, force=True)
    return state


def _checked_batch(data, step: int, shapes) -> GateBatch:
    """data.batch(step) on the device, after checking that every row's prompt and targets fit
    its width and that its shapes are those of the batches before (`shapes`, None at first)."""
    batch = GateBatch(*(np.asarray(x) for x in data.batch(step)))
    if shapes is not None and [x.shape for x in batch] != shapes:
        raise ValueError(f"data.batch({step}) has shapes {[x.shape for x in batch]}; earlier "
                         f"batches {shapes}: expected the same every step")
    width, targets = batch.tokens.shape[1], batch.target_positions.shape[1]
    if int(batch.prompt_lengths.max()) + targets > width:
        raise ValueError(f"data.batch({step}): a {int(batch.prompt_lengths.max())}-token prompt "
                         f"and {targets} target slots exceed the batch width {width}")
    return GateBatch(*(jnp.asarray(x) for x in batch))


def _progress(total: int, initial: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, dynamic_ncols=True,
                mininterval=2.0 if sys.stdout.isatty() else 30.0, file=sys.stdout,
                desc="gates")


# ---- checkpoints ----------------------------------------------------------------------------
def _save(manager, state: GateState, meta: dict, force: bool = False) -> None:
    step = int(state.step)
    checkpoints.save(manager, step, state, {**meta, "step": step, "gates": gate_record(state)},
                     force=force)


def _restore(manager, like: GateState, **kwargs) -> tuple[GateState, dict] | None:
    restored = checkpoints.restore(manager, jax.eval_shape(lambda: like), **kwargs)
    if restored is None:
        return None
    leaves = jax.tree.leaves(restored[0])
    return jax.tree.unflatten(jax.tree.structure(like), leaves), restored[1]


def restore_gate_state(checkpoint_dir: str | Path) -> GateState:
    """The GateState of the latest checkpoint in a `train_gates` checkpoint directory."""
    meta = artifacts.latest_checkpoint_record(checkpoint_dir)
    if meta is None:
        raise ValueError(f"checkpoint_dir={str(checkpoint_dir)!r} holds no gate checkpoint")
    like = init_gate_state(*meta["shape"], GateTraining.from_json(meta["training"]),
                           meta["seed"], artifacts.Fingerprint.from_json(meta["fingerprint"]))
    return _restore(checkpoints.open_manager(checkpoint_dir), like)[0]


# ---- gate files -----------------------------------------------------------------------------
def gate_record(state: GateState) -> dict:
    """The gates as JSON: retrieval_heads [layers][kv_heads], a and b of layers 1..L-1, the
    HardKuma means, E[L0], the target, lam, the step and the model fingerprint."""
    return {"retrieval_heads": state.retrieval_heads().tolist(),
            "a": np.asarray(state.a).tolist(), "b": np.asarray(state.b).tolist(),
            "mean": state.mean().tolist(), "expected_l0": state.expected_l0(),
            "target": state.target, "lambda": float(state.lam), "step": int(state.step),
            "fingerprint": None if state.fingerprint is None else state.fingerprint.to_json()}


def save_gates(state: GateState, path: str | Path) -> Path:
    """Write `gate_record(state)` as a gate file (`artifacts.save_gates`)."""
    return artifacts.save_gates(path, gate_record(state))


# ---- command line ---------------------------------------------------------------------------
DEFAULT_HEAD_SHARE = 0.125   # LycheeDecode's 32 of 256 KV heads (Llama-3-8B, matching TidalDecode)
DEFAULT_CONTEXT = 2048


def default_target_heads(config: ModelConfig) -> int:
    """An eighth of the gated KV heads (layers 1..L-1), at least 1: the paper's share."""
    return max(1, round(DEFAULT_HEAD_SHARE * (config.num_layers - 1) * config.num_kv_heads))


def passkeys_that_fit(tokenizer, length: int, wanted: int = 10, words: int = 32) -> int:
    """The most passkeys (up to `wanted`) whose needles fill at most half of a `length`-token
    prompt, so the filler around them stays the larger part; at least 1."""
    one = PasskeyData(tokenizer, min_length=10 ** 6, max_length=10 ** 6, num_passkeys=1,
                      passkey_words=words)
    needle = one._bound("needle", "key", "answer")
    return max(1, min(wanted, (length // 2 - one._ids["prefix"].size) // needle))


def off_target(target: float, heads: int, first_loss: float, last_loss: float) -> list[str]:
    """Warnings for a run that ended away from what it was asked: retrieval heads more than
    max(1, 25%) off the target, or a distillation loss that did not fall below its first step's."""
    out = []
    if abs(heads - target) > max(1.0, 0.25 * target):
        out.append(f"WARNING: {heads} retrieval heads, asked for {target:g}: the head budget's "
                   "multiplier had too few steps to settle (more --steps, or a larger "
                   "--lambda-lr)")
    if not last_loss < first_loss:
        out.append(f"WARNING: the distillation loss ended at {last_loss:.4g}, not below its "
                   f"first step's {first_loss:.4g}: the gates did not learn (more --steps, or "
                   "another --lr)")
    return out


def add_parser(subparsers) -> argparse.ArgumentParser:
    from sparsejax.arguments import positive_int, ratio

    p = subparsers.add_parser(
        "train-gates", help="train LycheeDecode's HardKuma head gates",
        description="Train LycheeDecode's retrieval-head gates for a model: passkeys hidden in "
        "your documents (--text; the paper's BookSum setup) or in built-in filler, distilled "
        "against the dense model. Writes gates/gates.json beside the model (or under --out), "
        "where `generate`, `eval` and `LLM` read it.",
        epilog="--text: a .jsonl file holds one document per line (its \"text\" field); any "
        "other file is one document. How the gates are trained: docs/training.md")
    p.add_argument("--model", default=None,
                   help="HF checkpoint directory with its tokenizer (default: the embedded model)")
    p.add_argument("--target-heads", type=float, default=None,
                   help="retrieval heads wanted among the KV heads of layers 1..L-1 (default: "
                   "an eighth of them, the paper's share)")
    p.add_argument("--steps", type=positive_int, default=3000, help="training steps")
    p.add_argument("--out", default=None, help="directory for gates.json, or a .json file "
                   "(default: the model's gates/ directory, where generate/eval/LLM find it)")
    filler = p.add_mutually_exclusive_group()
    filler.add_argument("--text", nargs="+", default=None, metavar="FILE",
                        help="documents the passkeys are hidden in (.txt: one per file; "
                        ".jsonl: a \"text\" field per line) (default: built-in filler)")
    filler.add_argument("--data", default=None,
                        help="one filler text file (as --text FILE; default: built-in filler)")
    p.add_argument("--context", type=positive_int, default=None,
                   help=f"prompt tokens (default: {DEFAULT_CONTEXT}, or less to fit the model's "
                   "context with the targets); --min-length/--max-length give a range instead")
    p.add_argument("--passkeys", type=positive_int, default=None,
                   help="passkeys per prompt (default: 10, the paper's, or as many as fill half "
                   "the prompt)")
    p.add_argument("--budget-ratio", type=ratio, default=0.3,
                   help="sparse heads' token budget as a share of the context")
    p.add_argument("--sinks", type=int, default=None, help="always-kept first tokens "
                   "(default: 128, at most an eighth of the budget)")
    p.add_argument("--recent", type=int, default=None, help="always-kept most recent tokens "
                   "(default: 256, at most a quarter of the budget)")
    p.add_argument("--loss", choices=LOSSES, default="logits",
                   help="distil the dense model's logits or last hidden states")
    p.add_argument("--lr", type=float, default=0.01, help="learning rate of the gates")
    p.add_argument("--lambda-lr", type=float, default=0.02,
                   help="learning rate of the Lagrange multiplier of the head budget")
    p.add_argument("--min-length", type=positive_int, default=None,
                   help="shortest prompt (tokens; default: --context)")
    p.add_argument("--max-length", type=positive_int, default=None,
                   help="longest prompt (default: --min-length)")
    p.add_argument("--checkpoint-dir", default=None,
                   help="Orbax checkpoints; a run resumes from the newest intact one there "
                   "(default: none)")
    p.add_argument("--checkpoint-every", type=positive_int, default=100,
                   help="steps between checkpoints")
    p.add_argument("--seed", type=int, default=0, help="seed of the gates and the prompts")
    p.add_argument("--tp", type=positive_int, default=1,
                   help="the model tensor parallel over this many devices (README: Several GPUs)")
    p.set_defaults(func=run)
    return p


def _lengths(args, config, tokenizer, filler):
    """PasskeyData that fits the model: --min/--max-length or --context as given (an error
    when prompt + targets exceed the model's context), else the longest prompt up to 2048 tokens
    that leaves room for the targets; as many passkeys as fill half of it unless --passkeys."""
    def data(lo, hi, count):
        return PasskeyData(tokenizer, min_length=lo, max_length=hi, num_passkeys=count,
                           filler=filler, seed=args.seed)

    given = args.min_length or args.context or args.max_length
    if given:
        lo = args.min_length or args.context or args.max_length
        hi = args.max_length or lo
        if lo > hi:
            raise ValueError(f"--min-length {lo} > --max-length {hi}")
        out = data(lo, hi, args.passkeys or passkeys_that_fit(tokenizer, lo))
        room = config.max_position_embeddings - out.target_width
        if hi > room:
            raise ValueError(f"prompts of up to {hi} tokens and {out.target_width} target tokens "
                             f"exceed the model's {config.max_position_embeddings}-token context: "
                             f"give --context {max(room, 0)} or less, or fewer --passkeys")
        return out
    longest = min(DEFAULT_CONTEXT, config.max_position_embeddings)
    count = args.passkeys or passkeys_that_fit(tokenizer, longest)
    for n in range(count, 0, -1):       # fewer passkeys: fewer targets, a longer prompt
        width = data(10 ** 6, 10 ** 6, n).target_width
        length = min(longest, config.max_position_embeddings - width)
        if length > 0 and (args.passkeys or passkeys_that_fit(tokenizer, length) >= n):
            try:
                return data(length, length, n)
            except ValueError:
                continue
    raise ValueError(f"the model's {config.max_position_embeddings}-token context holds no "
                     "prompt with a passkey and its targets: train its gates elsewhere")


def gates_path(out) -> Path:
    out = Path(out)
    return out if out.suffix == ".json" else out / artifacts.GATES_FILE


def run(args) -> int:
    import sparsejax
    from sparsejax.files import read_text
    from .pretrain import compute_dtype

    if args.model is None:
        source = home = sparsejax.embedded_model_path()
    else:
        source, home = args.model, artifacts.fitted_directory(args.model)
    path = gates_path(args.out if args.out else Path(home) / artifacts.GATES_DIR)
    from .calibrate import check_output

    check_output(path, "--out", makes_directory=not (args.out and Path(args.out).suffix
                                                     == ".json"))
    if args.data is not None:
        read_text(args.data, "--data")
    if args.text:
        from .documents import read_documents

        read_documents(args.text)          # a missing or empty file fails before the model loads
    model = sparsejax.from_pretrained(source, dtype=compute_dtype())
    tokenizer = sparsejax.load_tokenizer(source)
    c = model.config
    gated = (c.num_layers - 1) * c.num_kv_heads
    target = default_target_heads(c) if args.target_heads is None else args.target_heads
    if not 0 <= target <= gated:
        raise ValueError(f"--target-heads {target:g}: expected 0..{gated} (the KV heads of "
                         f"layers 1..{c.num_layers - 1}; default {default_target_heads(c)})")
    data = _lengths(args, c, tokenizer, tuple(args.text) if args.text else args.data)
    budget = max(1, math.ceil(args.budget_ratio * data.min_length))
    sinks = min(128, budget // 8) if args.sinks is None else args.sinks
    recent = min(256, budget // 4) if args.recent is None else args.recent
    print(f"sparsejax train-gates: {c.num_layers} layers x {c.num_kv_heads} KV heads, target "
          f"{target:g} retrieval heads; {data.num_passkeys} passkeys in "
          f"{data.describe()['filler']} prompts of {data.min_length}-{data.max_length} tokens + "
          f"{data.target_width} target tokens; budget {args.budget_ratio:g} (sinks {sinks}, "
          f"recent {recent}); {args.steps} steps; {jax.default_backend()}", flush=True)
    losses = []
    state = train_gates(model, data, target_retrieval_heads=target, steps=args.steps,
                        lr=args.lr, lambda_lr=args.lambda_lr, budget=Ratio(args.budget_ratio),
                        sinks=sinks, recent=recent, loss=args.loss, seed=args.seed,
                        checkpoint_dir=args.checkpoint_dir,
                        checkpoint_every=args.checkpoint_every,
                        callback=lambda step, m: losses.append(m["loss"]),
                        mesh=sharding.tensor_parallel_mesh(args.tp))
    path = save_gates(state, path)
    heads = state.retrieval_heads()
    print(f"E[L0] = {state.expected_l0():.2f}, lambda = {float(state.lam):.4g}; "
          f"{int(heads[1:].sum())} retrieval heads in layers 1..{c.num_layers - 1}:")
    for layer, row in enumerate(heads):
        print(f"  layer {layer:3d}  " + " ".join("R" if r else "." for r in row))
    if losses:
        tail = max(1, len(losses) // 10)
        for line in off_target(target, int(heads[1:].sum()), float(np.mean(losses[:tail])),
                               float(np.mean(losses[-tail:]))):
            print(line, file=sys.stderr)
    print(f"wrote {path}")
    return 0
