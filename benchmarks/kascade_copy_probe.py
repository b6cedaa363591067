"""Where a sparse method loses the needle while the model copies it: teacher-forced decoding of
single-needle prompts along the needle's digits, and per layer the share of dense attention
on the position to copy next (the needle's next digit) that each method's attended set keeps.

    python benchmarks/kascade_copy_probe.py [--model smollm2] [--context 2048] [--samples 4]
        [--methods kascade,kascade@default,oracle] [--ratio 0.1]

SmolLM2 writes one token per digit, so answering a 7-digit needle is 7 copy steps: at each the
heads that copy put most of their probability on one prompt position. A method that keeps
high mean recall can still drop that one position at the layers where the copying heads sit.
-> results/kascade_copy_probe.json and .png.
"""
from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import sparsejax
from sparsejax import cache as kv
from sparsejax import layers, methods as M, tasks
from sparsejax.generate import _decode_step
from sparsejax.pallas_kernels.sparse_attention import attended_mask
from sparsejax.plan import Score

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fidelity_real  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
OUT = RESULTS / "kascade_copy_probe.json"


def _with_target_probs(diagnostics):
    """`layers._diagnostics` plus, per query head, the dense probability on every position
    and whether the head attended to it (read at the target positions afterwards)."""
    def diag(plan, config, at, out, attended, carried):
        d = diagnostics(plan, config, at, out, attended, carried)
        dense = layers._dense(at, score=Score.HEAD_PROBS, backend="reference")
        probs = jnp.where(jnp.isfinite(dense.scores), dense.scores, 0.0)       # [B, HQ, T]
        if attended is None:
            mask = jnp.ones(probs.shape, bool)
        else:
            sel = attended.sel
            mask = attended_mask(sel.indices, sel.count, at.step.lengths,
                                 num_positions=probs.shape[-1], num_heads=at.q.shape[1],
                                 num_kv_heads=config.num_kv_heads, unit=plan.selector.unit,
                                 head_map=attended.head_map, dense_heads=attended.dense_heads)
        d.update(head_probs=probs, head_mask=mask)
        return d
    return diag


def _needle_start(row: np.ndarray, digits: list[int]) -> int | None:
    hits = [i for i in range(len(row) - len(digits) + 1)
            if list(row[i:i + len(digits)]) == digits]
    return hits[0] if len(hits) == 1 else None


def probe(args) -> dict:
    model = sparsejax.from_pretrained(args.model, dtype=jnp.float32)
    tok = sparsejax.load_tokenizer(args.model)
    fitted = M.fitted_beside(args.model, model)
    cfg = model.config
    samples, teachers, starts = [], [], []
    for seed in range(args.seed0, args.seed0 + 8 * args.samples):
        s = tasks.build("niah", tok, args.context, seed)
        digits = tok.encode(s.answers[0], add_special_tokens=False)
        start = _needle_start(np.asarray(s.prompt_ids), digits)
        if start is not None:
            samples.append(s)
            starts.append(start)
            teachers.append(digits)
        if len(samples) == args.samples:
            break
    ids, lengths = tasks.prompt_batch(samples, tok.pad_token_id or 0, length=args.context)
    out, first = fidelity_real._forward(model, jnp.asarray(ids), jnp.asarray(lengths))
    first = np.asarray(first)
    steps = max(len(t) for t in teachers) + 1
    # teacher tokens: the dense first token, then the digits; target of step j: the position
    # of the digit the step should write
    seq = np.zeros((len(samples), steps), np.int32)
    target = np.full((len(samples), steps), -1)
    for b, (digits, start) in enumerate(zip(teachers, starts)):
        offset = 0 if first[b] == digits[0] else 1
        row = ([] if offset == 0 else [int(first[b])]) + digits
        row = (row + [digits[-1]] * steps)[:steps]
        seq[b] = row
        for j in range(steps - 1):
            i = j + 1 - offset
            if 0 <= i < len(digits):
                target[b, j] = start + i
    layers._diagnostics = _with_target_probs(layers._diagnostics)
    doc = {"model": Path(str(args.model)).name, "context": args.context, "ratio": args.ratio,
           "prompts": len(samples), "device": jax.default_backend(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "methods": {}}
    for name in args.methods.split(","):
        plan = fidelity_real.build_method(name, cfg, args.ratio, fitted).to_plan(cfg)

        @jax.jit
        def run(model, out, lengths, seq):
            cache = kv.allocate(cfg, seq.shape[0], args.context + steps,
                                page_size=plan.page_size, dtype=model.dtype)
            cache = kv.write_prompt(cache, out.keys, out.values, lengths)
            cache = cache.replace(state=layers.prefill_state(model, cache, out, plan))

            def body(cache, token):
                logits, cache, d = _decode_step(model, cache, token, plan, True)
                return cache, (jnp.argmax(logits, -1), d["head_probs"], d["head_mask"])
            return jax.lax.scan(body, cache, seq.T)[1]

        pred, probs, mask = run(model, out, jnp.asarray(lengths), jnp.asarray(seq))
        pred, probs, mask = np.asarray(pred), np.asarray(probs), np.asarray(mask)
        # probs / mask [steps, L, B, HQ, T] -> at each (step, row)'s target position
        valid = target.T >= 0                                               # [steps, B]
        pos = np.maximum(target.T, 0)[:, None, :, None, None]
        p = np.take_along_axis(probs, np.broadcast_to(pos, probs.shape[:-1] + (1,)), -1)[..., 0]
        m = np.take_along_axis(mask, np.broadcast_to(pos, mask.shape[:-1] + (1,)), -1)[..., 0]
        w = valid[:, None, :, None]
        dense_mass = (p * w).sum((0, 2)) / w.sum((0, 2))                     # [L, HQ]
        kept = (p * m * w).sum((0, 2, 3)) / np.maximum((p * w).sum((0, 2, 3)), 1e-30)
        correct = (pred[:-1] == seq.T[1:])[valid[:-1]]
        doc["methods"][name] = {
            "roles": "".join("DSRHF"[int(r)] for r in plan.roles),
            "kept_share_per_layer": np.round(kept, 4).tolist(),
            "dense_max_head_mass_per_layer": np.round(dense_mass.max(-1), 4).tolist(),
            "teacher_forced_digit_accuracy": round(float(correct.mean()), 4)}
        print(f"{name:<16} digits right {correct.mean():.2f}  kept share "
              f"{np.round(kept, 2).tolist()}", flush=True)
    return doc


def plot(doc: dict, path: Path) -> None:
    from sparsejax.plotting import figure, save

    fig, ((ax,),) = figure(figsize=(9, 4))
    first = next(iter(doc["methods"].values()))
    ax.bar(range(len(first["dense_max_head_mass_per_layer"])),
           first["dense_max_head_mass_per_layer"], color="lightgray",
           label="dense: largest head probability on the digit to copy")
    for name, r in doc["methods"].items():
        ax.plot(r["kept_share_per_layer"], marker="o", ms=3,
                label=f"{name}: share kept (digits right {r['teacher_forced_digit_accuracy']:.2f})")
        anchors = [i for i, c in enumerate(r["roles"]) if c == "S"]
        if name.startswith("kascade"):
            ax.scatter(anchors, [r["kept_share_per_layer"][i] for i in anchors], s=60,
                       facecolors="none", edgecolors="black")
    ax.set_xlabel("layer (circles: Kascade anchors)")
    ax.set_ylabel("share of the dense attention on\nthe next digit that is attended")
    ax.set_title(f"{doc['model']}: niah {doc['context']} tokens, budget {doc['ratio']:.0%}, "
                 f"{doc['prompts']} prompts, teacher-forced ({doc['device']})", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    save(fig, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--seed0", type=int, default=0)
    p.add_argument("--ratio", type=float, default=0.1)
    p.add_argument("--methods", default="kascade,kascade@default,oracle")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    doc = probe(args)
    fidelity_real._save(doc, args.out)
    plot(doc, args.out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
