"""Where RESA's attention error comes from: per sparse layer, on the same decode trajectory, the
base method's error, RESA's, RESA against the paper's merged-logit softmax (its Eq. 3, computed
here in jnp from the cache), and what an exact part of the correction would leave.

    python benchmarks/resa_error_breakdown.py [--model smollm2|embedded|PATH] [--context 2048]
        [--samples 2] [--steps 6] [--methods delta,kascade,lychee] [--ratios 0.1 0.2]
        [--kv-dtype auto|bf16|f32|fp8]

Each method runs wrapped in RESA (lambda = 1); at every step and sparse layer, with the layer's
query, attended set and prior, against dense attention over the same cache (relative L2 error
of the attention output, mean over query heads, as `fidelity_real.py` measures it):

  base         softmax over the attended keys only (the base method on RESA's trajectory)
  resa         RESA's output as the model computes it
  eq3          the paper's rule: attended keys keep q·k/sqrt(d), unselected prompt keys get
               mu_q·k/sqrt(d) + b, one softmax (resa_vs_eq3: RESA's distance from it)
  exact_mass   the unselected keys' true softmax mass, spread along the prior's direction
  exact_dir    the prior's mass along the unselected keys' true output
  best_scale   the base output moved along the prior's direction by the best weight per head
               (a bound on any rescaling of the prior, lambda included)
  lam2, lam4   eq3 with lambda 2 and 4
Also the true mass outside the attended set (prompt / decoded keys), the prior's estimate of it,
the spread (std over the unselected keys) of the rank-1 logit error
delta_j = (q - mu_q)·(k_j - mu_k)/sqrt(d) beside that of the true logits, and the L1 error of
the attention scores (the paper's error measure) without and with RESA.
-> results/resa_error_breakdown.json.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import sparsejax
from sparsejax import cache as kv
from sparsejax import layers, methods as M, resa
from sparsejax.arguments import KV_DTYPE_CHOICES, KV_DTYPE_HELP
from sparsejax.generate import _decode_step
from sparsejax.pallas_kernels.common import merge_partials
from sparsejax.pallas_kernels.sparse_attention import attended_mask

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fidelity_real import _prompt_cache, build_method  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "resa_error_breakdown.json"
ERRORS = ("base", "resa", "eq3", "exact_mass", "exact_dir", "best_scale", "lam2", "lam4")
OTHER = ("resa_vs_eq3", "missed_prompt", "missed_decoded", "prior_estimate", "delta_std",
         "logit_std", "score_l1_base", "score_l1_resa")


def _rel(o, ref):
    return jnp.mean(jnp.linalg.norm(o - ref, axis=-1)
                    / jnp.maximum(jnp.linalg.norm(ref, axis=-1), 1e-30), axis=-1)


def _attend(logits, v):
    """softmax(logits) v and log-sum-exp (0 and -inf where every logit is -inf)."""
    m = jnp.max(logits, -1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(logits - m)
    z = jnp.sum(w, -1, keepdims=True)
    return (jnp.einsum("bht,bthd->bhd", w / jnp.maximum(z, 1e-30), v),
            jnp.log(z[..., 0]) + m[..., 0])


def _combine(o1, l1, o2, l2):
    """Two softmax parts (output, log-sum-exp) as one (the kernels' merge)."""
    return merge_partials(jnp.stack([o1, o2]), jnp.stack([l1, l2]), axis=0)[0]


def _std(x, mask):
    n = jnp.maximum(jnp.sum(mask, -1), 1)
    mean = jnp.sum(jnp.where(mask, x, 0.0), -1) / n
    return jnp.sqrt(jnp.sum(jnp.where(mask, (x - mean[..., None]) ** 2, 0.0), -1) / n)


def _breakdown(plan, config, at, out, attended):
    """The module docstring's quantities for one layer -> {name: [B]}."""
    q = at.q.astype(jnp.float32)
    B, HQ, D = q.shape
    scales = (None, None) if at.k_scale is None else (at.k_scale[at.table], at.v_scale[at.table])
    kp, vp = (kv.dequantized_pages(x[at.table], scale)               # [B, pages, HK, P, D]
              for x, scale in zip((at.k_pages, at.v_pages), scales))
    HK = kp.shape[2]
    group = HQ // HK

    def tokens(pages):                                             # -> [B, T, HQ, D] f32
        x = pages.transpose(0, 1, 3, 2, 4).reshape(B, -1, HK, D)
        return jnp.repeat(x, group, axis=2)

    K, V = tokens(kp), tokens(vp)
    T = K.shape[1]
    lengths = at.step.lengths
    sel = attended.sel
    mask = attended_mask(sel.indices, sel.count, lengths, num_positions=T, num_heads=HQ,
                         num_kv_heads=HK, unit=plan.selector.unit, head_map=attended.head_map,
                         dense_heads=attended.dense_heads)
    prior = resa.layer_prior(at.state, at.layer)
    pos = jnp.arange(T)[None, None]
    valid = pos < lengths[:, None, None]
    in_prior = pos < prior.length[:, None, None]
    unselected = valid & ~mask & in_prior
    scale = 1 / math.sqrt(D)
    s = jnp.einsum("bhd,bthd->bht", q, K) * scale                  # true logits
    p = jnp.einsum("bhd,bthd->bht", prior.mu_q, K) * scale         # prior logits
    b = jnp.sum((q - prior.mu_q) * jnp.repeat(prior.mu_k, group, axis=1), -1)[..., None] * scale
    est = p + b
    ninf = -jnp.inf

    def eq3(lam):
        return _attend(jnp.where(mask, s, jnp.where(unselected, est + math.log(lam), ninf)), V)[0]

    dense, lse_all = _attend(jnp.where(valid, s, ninf), V)
    base, lse_sel = _attend(jnp.where(mask, s, ninf), V)
    o_u, lse_u = _attend(jnp.where(unselected, s, ninf), V)        # the unselected keys, exact
    o_est, lse_est = _attend(jnp.where(unselected, est, ninf), V)  # ... as the prior has them
    step = o_est - base
    w = jnp.clip(jnp.sum(step * (dense - base), -1)
                 / jnp.maximum(jnp.sum(step * step, -1), 1e-30), 0.0, 1.0)
    resa_out = out.astype(jnp.float32)
    reference = eq3(1.0)

    def probs(logits):
        return jnp.where(jnp.isfinite(logits), jax.nn.softmax(logits, -1), 0.0)

    p_dense = probs(jnp.where(valid, s, ninf))
    decoded = valid & ~mask & ~in_prior
    mean = lambda x: jnp.mean(x, -1)                               # noqa: E731 over heads
    return {
        "base": _rel(base, dense), "resa": _rel(resa_out, dense), "eq3": _rel(reference, dense),
        "exact_mass": _rel(_combine(base, lse_sel, o_est, lse_u), dense),
        "exact_dir": _rel(_combine(base, lse_sel, o_u, lse_est), dense),
        "best_scale": _rel(base + w[..., None] * step, dense),
        "lam2": _rel(eq3(2.0), dense), "lam4": _rel(eq3(4.0), dense),
        "resa_vs_eq3": _rel(resa_out, reference),
        "missed_prompt": mean(jnp.exp(lse_u - lse_all)),
        "missed_decoded": mean(jnp.sum(jnp.where(decoded, p_dense, 0.0), -1)),
        "prior_estimate": mean(jnp.exp(lse_est - jnp.logaddexp(lse_sel, lse_est))),
        "delta_std": mean(_std(s - est, unselected)), "logit_std": mean(_std(s, unselected)),
        "score_l1_base": mean(jnp.sum(jnp.abs(probs(jnp.where(mask, s, ninf)) - p_dense), -1)),
        "score_l1_resa": mean(jnp.sum(jnp.abs(probs(jnp.where(
            mask, s, jnp.where(unselected, est, ninf))) - p_dense), -1)),
    }


def _with_breakdown(diagnostics):
    """`layers._diagnostics` plus `_breakdown` (zeros at layers that attended densely)."""
    def diag(plan, config, at, out, attended, carried):
        d = diagnostics(plan, config, at, out, attended, carried)
        if attended is None or plan.residual is None:
            zero = jnp.zeros(at.q.shape[:1], jnp.float32)
            d.update({k: zero for k in ERRORS + OTHER})
        else:
            d.update(_breakdown(plan, config, at, out, attended))
        return d
    return diag


@functools.partial(jax.jit, static_argnames=("plan", "steps", "kv_dtype"))
def _decode(model, out, first, lengths, *, plan, steps: int, kv_dtype=None):
    """Greedy decoding of `steps` tokens under `plan` (K/V stored as `kv_dtype`) -> the
    breakdown [steps, L, B]."""
    L, B, T = out.keys.shape[:3]
    cache = kv.allocate(model.config, B, T + steps, page_size=plan.page_size, dtype=model.dtype,
                        kv_dtype=kv_dtype)
    cache = kv.write_prompt(cache, out.keys, out.values, lengths)
    cache = cache.replace(state=layers.prefill_state(model, cache, out, plan))

    def body(carry, _):
        cache, token = carry
        logits, cache, diag = _decode_step(model, cache, token, plan, True)
        return ((cache, jnp.argmax(logits, -1).astype(jnp.int32)),
                {k: diag[k] for k in ERRORS + OTHER})

    return jax.lax.scan(body, (cache, first), None, length=steps)[1]


def _prompts(path, model, context: int, samples: int):
    """(out, first token, lengths) of `samples` single-needle prompts of `context` tokens: the
    prose task for a model with a real tokenizer, the synthetic one for the embedded model."""
    from sparsejax import evaluation

    tokenizer = sparsejax.load_tokenizer(path)
    task_set = evaluation.task_set(tokenizer, ["niah"], context)
    built = task_set.samples(["niah"], context, samples, 0, tokenizer.get_vocab())
    ids, lengths = task_set.batch(built)
    ids, lengths = np.asarray(ids), np.asarray(lengths)
    return _prompt_cache(model, ids, lengths, ids.shape[1])


def measure(args) -> dict:
    path = (sparsejax.embedded_model_path() if args.model == "embedded"
            else sparsejax.real_model_path() if args.model == "smollm2" else Path(args.model))
    model = sparsejax.from_pretrained(path, dtype=jnp.float32)
    fitted = M.fitted_beside(path, model)
    prepared = _prompts(path, model, args.context, args.samples)
    layers._diagnostics = _with_breakdown(layers._diagnostics)
    rows = []
    for name in args.methods.split(","):
        for ratio in args.ratios:
            plan = build_method(name + "+resa", model.config, ratio, fitted).to_plan(model.config)
            t0 = time.perf_counter()
            diag = {k: np.asarray(v) for k, v in
                    _decode(model, *prepared, plan=plan, steps=args.steps,
                            kv_dtype=args.kv_dtype).items()}
            sparse = [i for i, r in enumerate(plan.roles) if r.name != "DENSE"]
            means = {k: float(v[:, sparse].mean()) for k, v in diag.items()}
            row = {"method": name, "budget_ratio": ratio,
                   "error": {k: round(means[k], 4) for k in ERRORS},
                   "cut": {k: round(1 - means[k] / means["base"], 3) for k in ERRORS[1:]},
                   **{k: round(means[k], 4) for k in OTHER},
                   "score_l1_cut": round(1 - means["score_l1_resa"] / means["score_l1_base"], 3),
                   "per_layer": {k: np.round(diag[k].mean(axis=(0, 2)), 4).tolist()
                                 for k in ("base", "resa", "exact_mass", "best_scale",
                                           "missed_prompt", "prior_estimate", "delta_std")},
                   "roles": "".join("DSRHF"[int(r)] for r in plan.roles),
                   "seconds": round(time.perf_counter() - t0, 1)}
            rows.append(row)
            print(f"{name:<8} {ratio:.2f} " + " ".join(
                f"{k} {v:+.2f}" for k, v in row["cut"].items()) + f" | resa_vs_eq3 "
                f"{row['resa_vs_eq3']:.1e} missed {row['missed_prompt']:.3f} estimate "
                f"{row['prior_estimate']:.3f} delta_std {row['delta_std']:.2f} logit_std "
                f"{row['logit_std']:.2f} score_l1_cut {row['score_l1_cut']:+.2f}", flush=True)
    return {"model": Path(str(path)).name, "context": args.context, "samples": args.samples,
            "steps": args.steps, "task": "niah", "kv_dtype": args.kv_dtype,
            "device": jax.devices()[0].device_kind,
            "jax_version": jax.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "rows": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="smollm2, embedded or a checkpoint path")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--steps", type=int, default=6, help="decode steps measured")
    p.add_argument("--methods", default="delta,kascade,lychee")
    p.add_argument("--ratios", type=float, nargs="+", default=[0.1, 0.2])
    p.add_argument("--kv-dtype", choices=KV_DTYPE_CHOICES, default="auto",
                   help=KV_DTYPE_HELP + " (the model runs in float32)")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    doc = measure(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
