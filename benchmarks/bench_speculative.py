"""Lossless mode's speed: greedy `generate(draft_tokens=γ)` against dense `generate`.

    python benchmarks/bench_speculative.py                 # GPU, both parts (a few minutes)
    python benchmarks/bench_speculative.py --part random   # one part: embedded | random
    python benchmarks/bench_speculative.py --smoke         # CPU: tiny shapes, logic only

1. embedded: the embedded model on its four tasks at 4096 tokens (train/data.py prompts,
   EOS-terminated answers), B=16, each drafter at a budget of 10% of the context with what
   ships beside the model (DELTA's and Kascade's calibration, Lychee's gates), as `sparsejax
   eval` runs them. Per drafter and γ: acceptance rate, tokens/s of the whole call, speedup
   over dense `generate`, and whether every token equals dense's; a prefill-only call's time
   beside them (answers are at most 16 tokens, so the calls are prefill-bound). Then the cost
   model below on the same model, batch and context, evaluated at the measured acceptance:
   the decode phase's speedup. A batch's generate calls compile concurrently.
2. random: random-weight DS-R1-Distill-Qwen-1.5B shapes (bf16) at 16k tokens, B = 1, 16, 64,
   where acceptance means nothing: the cost model's inputs — ms of one draft step per
   drafter, of one dense verify of γ + 1 tokens, and of one dense decode step — and what
   they predict.

Every cell prints a line as it finishes, and the results file is rewritten after each one
(marked partial until the end), so a run cut off by a time limit keeps what it measured.

Cost model: with per-token acceptance α, a round of γ drafts yields
E = (1 - α^(γ+1)) / (1 - α) tokens for γ·t_draft + t_verify, so the speedup over dense
decoding is E·t_dense / (γ·t_draft + t_verify); `break_even_acceptance` is the α where it is 1.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import functools
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np

import harness
import shapes
from bench_decode_step import QWEN_1_5B, TINY, methods_for, time_steps

DRAFTERS = ("delta", "kascade", "lychee", "streaming")


def tokens_per_round(alpha: float, gamma: int) -> float:
    """Expected tokens a round keeps when each draft is accepted with probability alpha."""
    return gamma + 1.0 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


def predicted_speedup(alpha, gamma, draft_ms, verify_ms, dense_ms) -> float:
    return tokens_per_round(alpha, gamma) * dense_ms / (gamma * draft_ms + verify_ms)


def break_even_acceptance(gamma, draft_ms, verify_ms, dense_ms) -> float | None:
    """The acceptance rate at which lossless mode matches dense decoding (None: never)."""
    lo, hi = 0.0, 1.0
    if predicted_speedup(hi, gamma, draft_ms, verify_ms, dense_ms) < 1:
        return None
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if predicted_speedup(mid, gamma, draft_ms, verify_ms, dense_ms) < 1 \
            else (lo, mid)
    return hi


# ---- 1. the embedded model on its tasks -------------------------------------------------------
def embedded_drafters(model, context: int, names=DRAFTERS) -> dict:
    """The drafters at 10% of the context, with the calibration and gates shipped beside the
    embedded model (as `sparsejax eval` uses them)."""
    import sparsejax
    from sparsejax import methods as M

    path = sparsejax.embedded_model_path()
    calibration = {kind: path / "calibration" / f"{kind}.json" for kind in ("delta", "kascade")}
    heads = np.asarray(M.Lychee(gates=sorted((path / "gates").glob("*.json"))[0]).retrieval_heads)
    every = M.budget_ratio_methods(model.config, 0.1, retrieval_heads=heads,
                                   calibration=calibration)
    return {name: every[name] for name in names}


def timed_call(run, ids, lengths, repeats: int):
    """(median seconds of a compiled generate call, its output)."""
    out, samples = None, []
    for _ in range(repeats + 1):            # the first call warms up
        t0 = time.perf_counter()
        out = run(ids, lengths)
        jax.block_until_ready(out.tokens)
        samples.append(time.perf_counter() - t0)
    return float(np.median(samples[1:])), out


def compile_all(model, ids, calls: dict, common: dict) -> dict:
    """{key: `compile_generate(model, ids, **calls[key], **common)`}, compiled at once (XLA
    compiles in C++ threads)."""
    from sparsejax.generate import compile_generate

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        futures = {key: pool.submit(compile_generate, model, ids, **kw, **common)
                   for key, kw in calls.items()}
        runs = {key: f.result() for key, f in futures.items()}
    print(f"compiled {len(runs)} generate calls in {time.perf_counter() - t0:.0f} s", flush=True)
    return runs


def run_embedded(args, record) -> None:
    """Each row to `record` as it is measured."""
    import sparsejax
    from sparsejax import methods as M
    from sparsejax.train import data

    dtype = jnp.float32 if args.dtype == "f32" else jnp.bfloat16
    model = sparsejax.from_pretrained(sparsejax.embedded_model_path(), dtype=dtype)
    context, max_new = args.context, data.MAX_ANSWER_TOKENS
    drafters = embedded_drafters(model, context)
    for batch in args.embedded_batches:
        # the four tasks in turn, so every batch mixes them
        samples = [data.make_sample(data.TASKS[i % 4], context, 0, i // 4) for i in range(batch)]
        ids, lengths = data.prompt_batch(samples)
        gammas = args.gammas if batch == args.sweep_batch else (args.gamma,)
        calls = {"prefill": dict(max_new_tokens=1), "dense": dict(max_new_tokens=max_new)}
        calls.update({(name, gamma): dict(max_new_tokens=max_new, method=method,
                                          draft_tokens=gamma)
                      for name, method in drafters.items() for gamma in gammas})
        runs = compile_all(model, ids, calls, dict(lengths=lengths, eos_token_id=data.EOS_ID,
                                                   prefill_chunk=args.prefill_chunk))
        prefill_s, _ = timed_call(runs.pop("prefill"), ids, lengths, args.repeats)
        dense_s, dense = timed_call(runs.pop("dense"), ids, lengths, args.repeats)
        dense_tokens = np.asarray(dense.tokens)
        new = int(np.sum(np.asarray(dense.num_generated)))
        accuracy = float(np.mean([data.check_answer(t, s) for t, s in zip(dense_tokens, samples)]))
        record(harness.row("dense", context=context, batch=batch, ms=dense_s * 1e3,
                           tokens_per_s=round(new / dense_s, 1),
                           prefill_ms=round(prefill_s * 1e3, 3), accuracy=accuracy))
        print(f"B={batch} dense: {dense_s * 1e3:.1f} ms (prefill {prefill_s * 1e3:.1f}), "
              f"accuracy {accuracy:.2f}", flush=True)
        acceptance = {}
        for (name, gamma), run in runs.items():
            spec_s, out = timed_call(run, ids, lengths, args.repeats)
            drafted, accepted = np.asarray(out.drafted), np.asarray(out.accepted)
            identical = bool(np.array_equal(np.asarray(out.tokens), dense_tokens))
            rate = acceptance[name, gamma] = round(float(accepted.sum() / max(drafted.sum(), 1)),
                                                   4)
            record(harness.row(
                f"{name} γ={gamma}", context=context, batch=batch, ms=spec_s * 1e3,
                peer="dense generate", peer_ms=dense_s * 1e3, drafter=name, gamma=gamma,
                acceptance=rate, tokens_per_s=round(new / spec_s, 1),
                speedup_vs_dense=round(dense_s / spec_s, 3), identical_to_dense=identical))
            print(f"B={batch} {name} γ={gamma}: acceptance {rate:.2f}, "
                  f"{spec_s * 1e3:.1f} ms ({dense_s / spec_s:.2f}x dense), "
                  f"identical {identical}", flush=True)
        del runs
        # the calls above are prefill-bound (answers are at most 16 tokens): the decode
        # phase's speedup is the cost model's at the acceptance just measured
        cost_model(model, {"dense": M.Dense(), **drafters}, batch, context, gammas, args,
                   record, acceptance)


# ---- 2. random weights: the cost model --------------------------------------------------------
def time_verify(model, cache, batch: int, gamma: int, *, calls: int, repeats: int) -> float:
    """Median ms of one dense verify of γ + 1 tokens per row at the cache's lengths."""
    from sparsejax import speculative

    verify = jax.jit(speculative.verify, donate_argnums=1)
    tokens = jnp.zeros((batch, gamma + 1), jnp.int32)
    # a copy of the lengths: the cache's own buffer is donated
    start, num = jnp.array(np.asarray(cache.lengths)), jnp.full((batch,), gamma + 1, jnp.int32)
    for _ in range(2):
        logits, cache = verify(model, cache, tokens, start, num)
    jax.block_until_ready(logits)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            logits, cache = verify(model, cache, tokens, start, num)
        jax.block_until_ready(logits)
        samples.append((time.perf_counter() - t0) * 1e3 / calls)
    return float(np.median(samples))


def cost_model(model, methods: dict, batch: int, context: int, gammas, args, record,
               acceptance: dict | None = None) -> None:
    """The cost model's inputs at (batch, context): one decode step per method ("dense" the
    peer), one dense verify per γ; then per drafter and γ what they predict (and, given the
    drafter's measured `acceptance`, the speedup at it). Each row to `record`."""
    config = model.config
    steps, verify = {}, {}
    for name, method in methods.items():
        plan = method.to_plan(config, None)
        cache = shapes.random_cache(config, plan, batch, context,
                                    2 + args.calls * args.repeats, jax.random.key(1), model.dtype)
        steps[name] = time_steps(model, plan, cache, jnp.zeros((batch,), jnp.int32),
                                 calls=args.calls, repeats=args.repeats)
        del cache
        record(harness.row(f"step {name}", context=context, batch=batch, ms=steps[name],
                           peer="dense step", peer_ms=steps["dense"]))
        print(f"B={batch} {name} step: {steps[name]:.3f} ms", flush=True)
    dense = steps["dense"]
    for gamma in gammas:
        cache = shapes.random_cache(config, methods["dense"].to_plan(config, None), batch,
                                    context, gamma + 1, jax.random.key(1), model.dtype)
        verify[gamma] = time_verify(model, cache, batch, gamma, calls=args.calls,
                                    repeats=args.repeats)
        del cache
        record(harness.row(f"verify γ={gamma}", context=context, batch=batch,
                           ms=verify[gamma], peer="dense step", peer_ms=dense, gamma=gamma))
        print(f"B={batch} verify γ={gamma}: {verify[gamma]:.3f} ms", flush=True)
    for name in (n for n in methods if n != "dense"):
        for gamma in gammas:
            t = (gamma, steps[name], verify[gamma], dense)
            measured = (acceptance or {}).get((name, gamma))
            record(harness.row(
                f"cost model {name} γ={gamma}", context=context, batch=batch,
                ms=gamma * steps[name] + verify[gamma], peer="dense step", peer_ms=dense,
                drafter=name, gamma=gamma, draft_ms=round(steps[name], 4),
                verify_ms=round(verify[gamma], 4),
                break_even_acceptance=_round(break_even_acceptance(*t)),
                **{f"predicted_speedup_at_{a}": round(predicted_speedup(a, *t), 3)
                   for a in (0.5, 0.7, 0.8, 0.9, 1.0)},
                **({} if measured is None else dict(
                    acceptance=measured,
                    predicted_speedup_at_acceptance=round(predicted_speedup(measured, *t),
                                                          3)))))


def run_random(args, record) -> None:
    """Each row to `record` as it is measured (the dense step first: the others' peer)."""
    from sparsejax import methods as M

    # the per-layer layout `from_pretrained` returns (a stacked one would run the decode
    # step's layers as a scan that copies each layer's weights)
    model = shapes.random_model(TINY if args.smoke else QWEN_1_5B)
    context = args.random_context
    methods = {k: v for k, v in methods_for(model.config).items()
               if k in ("dense",) + DRAFTERS}
    methods["streaming"] = M.StreamingLLM(sinks=4, window=min(1024, context // 8))
    for batch in args.batches:
        cost_model(model, methods, batch, context, args.gammas, args, record)


def _round(x, digits: int = 3):
    return None if x is None else round(x, digits)


def plot(rows, path, device: str | None = None):
    """Left: the embedded model's speedup per γ (whole call, and the decode phase from the cost
    model). Right: the cost model's speedup against the acceptance rate. Rows without a device
    were measured on `device` (the result file's; default: this machine's)."""
    from sparsejax.plotting import figure, save

    device = device or harness.device_name()
    fig, axes = figure(1, 2, figsize=(12, 4.4))
    axes = axes[0]
    emb = [r for r in rows if r.get("part") == "embedded" and "speedup_vs_dense" in r]
    predicted = {(r["drafter"], r["batch"], r["gamma"]): r["predicted_speedup_at_acceptance"]
                 for r in rows if "predicted_speedup_at_acceptance" in r}
    if emb:
        batch = max({r["batch"] for r in emb}, key=lambda b: sum(x["batch"] == b for x in emb))
        for i, name in enumerate(DRAFTERS):
            rs = sorted((r for r in emb if r["drafter"] == name and r["batch"] == batch),
                        key=lambda r: r["gamma"])
            if not rs:
                continue
            gammas, color = [r["gamma"] for r in rs], f"C{i}"
            axes[0].plot(gammas, [r["speedup_vs_dense"] for r in rs], marker="o", color=color,
                         label=f"{name} (acceptance {min(r['acceptance'] for r in rs):.2f}-"
                         f"{max(r['acceptance'] for r in rs):.2f})")
            decode = [predicted.get((name, batch, g)) for g in gammas]
            if None not in decode:
                axes[0].plot(gammas, decode, ls="--", marker="x", color=color)
        axes[0].axhline(1.0, color="gray", lw=0.8)
        axes[0].set(xlabel="draft tokens γ", ylabel="speedup over dense",
                    title=f"embedded model, {emb[0]['context']} tokens, B={batch}, "
                    f"{emb[0].get('device', device)}\nwhole call (solid), "
                    "decode phase (dashed: cost model at the acceptance)")
        axes[0].legend(fontsize=8)
    cost = [r for r in rows if r["case"].startswith("cost model") and r["part"] == "random"]
    if cost:
        batch = max(r["batch"] for r in cost)
        gamma = sorted({r["gamma"] for r in cost})[len({r["gamma"] for r in cost}) // 2]
        alphas = np.linspace(0, 1, 101)
        for r in (r for r in cost if r["batch"] == batch and r["gamma"] == gamma):
            axes[1].plot(alphas, [predicted_speedup(a, gamma, r["draft_ms"], r["verify_ms"],
                                                    r["peer_ms"]) for a in alphas],
                         label=f"{r['drafter']} (break-even α {r['break_even_acceptance']})")
        axes[1].axhline(1.0, color="gray", lw=0.8)
        axes[1].set(xlabel="acceptance rate α", ylabel="predicted speedup over dense",
                    title=f"cost model, DS-Qwen-1.5B shapes, {cost[0]['context'] // 1024}k, "
                    f"B={batch}, γ={gamma}\n{cost[0].get('device', device)}")
        axes[1].legend(fontsize=8)
    fig.suptitle("Lossless mode (sparse drafts, dense verify)")
    save(fig, path)
    if os.environ.get("OUT"):
        save(fig, Path(os.environ["OUT"], Path(path).name))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true", help="CPU: tiny shapes, logic only")
    p.add_argument("--part", choices=("all", "embedded", "random"), default="all")
    p.add_argument("--batches", default="1,16,64", help="the random part's")
    p.add_argument("--embedded-batches", default="16", help="the embedded part's")
    p.add_argument("--gammas", default="2,4,8")
    p.add_argument("--gamma", type=int, default=4, help="γ at the batches outside the sweep")
    p.add_argument("--sweep-batch", type=int, default=16, help="the batch every γ runs at")
    p.add_argument("--context", type=int, default=4096, help="embedded model's prompts")
    p.add_argument("--random-context", type=int, default=16384)
    p.add_argument("--dtype", choices=("f32", "bf16"), default="f32",
                   help="the embedded model's (f32 as `sparsejax eval`)")
    p.add_argument("--prefill-chunk", type=int, default=1024,
                   help="prefill in chunks (bounds the f32 prefill's memory at B=64)")
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    args.embedded_batches = [int(b) for b in args.embedded_batches.split(",")]
    args.gammas = [int(g) for g in args.gammas.split(",")]
    if args.smoke:
        args.batches, args.embedded_batches, args.gammas = [2], [2], [2]
        args.gamma, args.sweep_batch = 2, 2
        args.context, args.random_context, args.prefill_chunk = 128, 256, 64
        args.calls, args.repeats = 1, 1
    name = "speculative"
    parts = ("embedded", "random") if args.part == "all" else (args.part,)
    # a one-part run keeps the committed rows of the other part
    kept = [r for r in harness.committed_rows(name) if r.get("part") not in parts]
    meta = dict(embedded_model=f"retrieval-tiny, {args.dtype}, 4 tasks, greedy, budget 10%, "
                f"prefill_chunk {args.prefill_chunk}",
                random_model="DS-R1-Distill-Qwen-1.5B shapes, random weights, bf16",
                repeats=args.repeats, calls=args.calls)
    rows = []

    def record(part, row):
        rows.append(dict(row, part=part))
        if not args.smoke:      # what a cut-off run measured is kept
            harness.write_results(name, kept + rows, partial=True, **meta)

    if args.part in ("all", "embedded"):
        run_embedded(args, functools.partial(record, "embedded"))
    if args.part in ("all", "random"):
        run_random(args, functools.partial(record, "random"))
    harness.print_table(rows, cols=("part", "case", "batch", "ms", "peer_ms", "ratio_to_peer",
                                    "acceptance", "identical_to_dense"))
    if args.smoke:      # the plot too, away from the results
        plot(rows, Path(tempfile.mkdtemp()) / "speculative.png")
        return
    harness.write_results(name, kept + rows, **meta)
    plot(kept + rows, harness.RESULTS / f"{name}.png")


if __name__ == "__main__":
    main()
