"""Prefill over the paged cache on one GPU: attention per layer, whole-model prefill, correction.

1. Prefill attention of one layer at Llama-3.1-8B shapes (32 query / 8 KV heads, d=128,
   bf16, page size 16, B=1), contexts 8k-128k: ours dense in chunks of 8k tokens (the
   library's default, cuDNN on the gathered pages, and the Pallas kernel), cuDNN
   `jax.nn.dot_product_attention` on contiguous K/V (the peer), and Kascade's sparse prefill
   at 10% and 20% weighted as the paper's Table 3: 1/32 layer 0 and 4/32 anchors (dense
   attention + tile scores + top-k), 27/32 reuse (selected keys + the tile's own block);
   the tile scores and the top-k are also timed alone (where an anchor's time goes).
   Floor: causal attention's FLOPs (2 T^2 HQ d for QK and PV) at the bf16 dense peak.
2. Whole-model prefill (random bf16 weights, Llama-3.1-8B shapes) at 32k and 128k: dense
   chunked, Kascade sparse prefill, and the one-pass cuDNN prefill.
3. Cache correction every 32 tokens relative to 32 decode steps (TidalDecode) at 32k, B=16
   (B=8 where B=16 does not fit).
A small sweep at 32k picks the Pallas kernel's knobs for its dense rows, and times the sparse
stream and the tile scores with and without lookahead (the sweep rows), and the cost of the
length mask in cuDNN's chunked path (the last chunk over the keys before it, masked as the
library runs it and unmasked).

  python benchmarks/bench_prefill.py            # on the GPU (an H200: part 3 needs ~85 GB)
  python benchmarks/bench_prefill.py --smoke    # tiny shapes on CPU (the references)
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import harness  # noqa: E402
from shapes import MODELS, random_cache  # noqa: E402

import sparsejax  # noqa: E402
from sparsejax import cache as kv  # noqa: E402
from sparsejax import methods  # noqa: E402
from sparsejax.extend import correct  # noqa: E402
from sparsejax.models import ModelConfig, init_params, unstack_layers  # noqa: E402
from sparsejax.pallas_kernels import paged_prefill_attention, paged_tile_scores  # noqa: E402
from sparsejax.pallas_kernels import prefill_attention  # noqa: E402
from sparsejax.pallas_kernels.common import use_backend  # noqa: E402
from sparsejax.plan import as_plan  # noqa: E402
from sparsejax.selection import select_tiles  # noqa: E402

PEAK_FLOPS = 989e12  # H100/H200 SXM dense bf16
LLAMA_8B = MODELS["llama-8b"]
FULL = dict(config=LLAMA_8B, page_size=16, chunk=8192, tile=128,
            contexts=(8192, 16384, 32768, 65536, 131072), model_contexts=(32768, 131072),
            correct_context=32768, correct_batches=(16, 8), correct_every=32)
SMOKE = dict(config=dict(LLAMA_8B, vocab_size=97, hidden_size=64, num_layers=4, num_heads=4,
                         num_kv_heads=2, head_dim=64, intermediate_size=96),
             page_size=16, chunk=256, tile=64, contexts=(512,), model_contexts=(512,),
             correct_context=512, correct_batches=(2,), correct_every=8)
# Table 3's weighting: layer 0, the other 4 anchors, 27 reuse layers of 32
WEIGHTS = dict(layer0=1 / 32, anchor=4 / 32, reuse=27 / 32)
DTYPE = jnp.bfloat16
PALLAS = "pallas" if jax.default_backend() == "gpu" else "reference"  # the smoke run on CPU
# (block_q, block_n, num_warps, num_stages) for the dense kernel; None keeps the default
SWEEP = [(None, None, None, None, None), (64, 64, 8, 3, 0), (64, 64, 8, 4, 1),
         (64, 64, 16, 3, 1), (32, 64, 4, 3, 1)]
KNOBS = ("block_q", "block_n", "num_warps", "num_stages", "lookahead")
SWEEP_CONTEXT = 32768
# Kascade's reuse layer (the sparse stream) and the anchor's tile scores, defaults first
REUSE_SWEEP = [{}, dict(lookahead=1), dict(block_n=32), dict(block_n=128), dict(num_stages=4),
               dict(block_q=64, num_warps=8), dict(block_q=16)]
SCORES_SWEEP = [{}, dict(lookahead=1), dict(block_n=32), dict(block_n=128), dict(num_stages=2),
                dict(num_warps=4)]
META = dict(shape="Llama-3.1-8B (32/8 heads, d=128), bf16, page 16",
            weights="kascade_weighted = (1/32 + 4/32) anchor + 27/32 reuse (Kascade Table 3)",
            floor="causal attention FLOPs 2*T^2*HQ*d at 989 TFLOP/s")


def new_rows(smoke):
    """Rows printed as measured and, on the GPU, written after each (partial results)."""
    return harness.Rows(harness.per_gpu_name("prefill"), META, write=not smoke)


def timer(smoke, calls=5):
    if smoke:
        return functools.partial(harness.time_ms, calls=1, repeats=1, warmup=1)
    return functools.partial(harness.device_time_ms, calls=calls, warmup=min(2, calls))


def attention_floor_ms(context, heads, head_dim):
    return 2.0 * context * context * heads * head_dim / PEAK_FLOPS * 1e3


def contiguous(pages, table, cfg):
    """A row's paged K or V [pages, HK, P, D] in position order: [1, T, HK, D] (cuDNN's)."""
    return pages[table[0]].transpose(0, 2, 1, 3).reshape(1, -1, cfg["config"]["num_kv_heads"],
                                                         cfg["config"]["head_dim"])


def paged_layer(key, context, cfg):
    """One layer's prompt: q [1, T, HQ, D] and a paged cache holding its K/V."""
    c, p = cfg["config"], cfg["page_size"]
    kq, kk, kv_, kp = jax.random.split(key, 4)
    pages = context // p
    q = jax.random.normal(kq, (1, context, c["num_heads"], c["head_dim"]), DTYPE)
    k = jax.random.normal(kk, (pages, c["num_kv_heads"], p, c["head_dim"]), DTYPE)
    v = jax.random.normal(kv_, (pages, c["num_kv_heads"], p, c["head_dim"]), DTYPE)
    table = jax.random.permutation(kp, pages).astype(jnp.int32)[None]
    return q, k, v, table


def chunked_dense(q, k, v, table, *, chunk, tuning, backend="auto"):
    """The whole prompt's attention, one paged_prefill_attention per chunk."""
    outs = []
    for s in range(0, q.shape[1], chunk):
        n = min(chunk, q.shape[1] - s)
        outs.append(paged_prefill_attention(q[:, s:s + n], k, v, table, jnp.array([s], jnp.int32),
                                            jnp.array([n], jnp.int32), backend=backend,
                                            **tuning).out)
    return jnp.concatenate(outs, axis=1)


def sweep(cfg, smoke):
    """Time the Pallas kernel's dense chunked prefill at the sweep context under each SWEEP
    knob set (None keeps the default) -> (the fastest knobs, one row per knob set)."""
    context = cfg["contexts"][0] if smoke else SWEEP_CONTEXT
    q, k, v, table = paged_layer(jax.random.key(0), context, cfg)
    rows, best = new_rows(smoke), None
    for knobs in SWEEP[:2] if smoke else SWEEP:
        tuning = {n: x for n, x in zip(KNOBS, knobs) if x is not None}
        fn = jax.jit(functools.partial(chunked_dense, chunk=cfg["chunk"], tuning=tuning,
                                       backend=PALLAS))
        try:
            ms = timer(smoke)(fn, q, k, v, table)
        except jax.errors.JaxRuntimeError as e:  # e.g. more shared memory than the GPU has
            rows.append(dict(case="sweep_dense_chunked", context=context, tuning=tuning,
                             error=str(e).splitlines()[0][:200]))
            continue
        rows.append(harness.row("sweep_dense_chunked", context=context, batch=1, ms=ms,
                                tuning=tuning))
        best = (ms, tuning) if best is None or ms < best[0] else best
    if not smoke:
        rows += cudnn_mask_rows(q, k, v, table, cfg)
    # The lookahead of Kascade's sparse stream and of the tile scores
    plan, tile = kascade_plan(cfg, 0.1), cfg["tile"]
    _, sel = jax.jit(functools.partial(anchor_layer, plan=plan, tile=tile))(q, k, v, table)
    lse = paged_prefill_attention(q, k, v, table, jnp.zeros((1,), jnp.int32),
                                  jnp.array([context], jnp.int32)).lse
    for case, fn, args, sweeps in (
            ("sweep_reuse", reuse_layer, (q, k, v, table, sel.indices, sel.count),
             REUSE_SWEEP[:1] if smoke else REUSE_SWEEP),
            ("sweep_anchor_scores", tile_scores, (q, k, table, lse),
             SCORES_SWEEP[:1] if smoke else SCORES_SWEEP)):
        for tuning in sweeps:
            try:
                ms = timer(smoke)(jax.jit(functools.partial(fn, tile=tile, **tuning)), *args)
            except jax.errors.JaxRuntimeError as e:
                rows.append(dict(case=case, context=context, tuning=tuning,
                                 error=str(e).splitlines()[0][:200]))
                continue
            rows.append(harness.row(case, context=context, batch=1, ms=ms, ratio=0.1,
                                    tuning=tuning))
    return best[1], rows


def cudnn_mask_rows(q, k, v, table, cfg):
    """What cuDNN's length mask costs, which chunked prefill's unmasked runs of chunks avoid:
    the last chunk's queries over the keys before it, length-masked (as the library's
    fallback for ragged starts calls it, over the whole span) and unmasked (a static slice
    of exactly those keys, `jax.nn.dot_product_attention`)."""
    chunk, c = cfg["chunk"], cfg["config"]
    start = q.shape[1] - chunk
    kc, vc = contiguous(k, table, cfg), contiguous(v, table, cfg)
    qc, scale = q[:, start:], c["head_dim"] ** -0.5
    masked = functools.partial(prefill_attention._cudnn_attention, causal=False, sm_scale=scale)
    calls = {
        "cudnn_prefix_length_masked": (jax.jit(lambda q, k, v: masked(
            q, k, v, jnp.array([chunk], jnp.int32), jnp.array([start], jnp.int32))[0]),
            (qc, kc, vc)),
        "cudnn_prefix_unmasked": (jax.jit(functools.partial(
            jax.nn.dot_product_attention, scale=scale, implementation="cudnn")),
            (qc, kc[:, :start], vc[:, :start]))}
    flops = 4 * chunk * start * c["num_heads"] * c["head_dim"]
    rows = []
    for case, (fn, args) in calls.items():
        ms = timer(False)(fn, *args)
        rows.append(harness.row(case, context=q.shape[1], batch=1, ms=ms, queries=chunk,
                                keys=start, tflops=round(flops / ms / 1e9)))
    return rows


def kascade_plan(cfg, ratio):
    config = ModelConfig(**cfg["config"])
    return methods.Kascade(ratio=ratio, min_k=0, sparse_prefill=True, prefill_tile=cfg["tile"]
                           ).scaled_to(config.num_layers).to_plan(config, cfg["page_size"])


def anchor_layer(q, k, v, table, *, plan, tile):
    """Dense attention, the tile scores and the rolling top-k (an anchor layer's work)."""
    start, length = jnp.zeros((1,), jnp.int32), jnp.array([q.shape[1]], jnp.int32)
    r = paged_prefill_attention(q, k, v, table, start, length)
    scores = tile_scores(q, k, table, r.lse, tile=tile)
    return r.out, tile_selection(scores, k, table, plan=plan, tile=tile)


def tile_scores(q, k, table, lse, *, tile, **tuning):
    start, length = jnp.zeros((1,), jnp.int32), jnp.array([q.shape[1]], jnp.int32)
    return paged_tile_scores(q, k, table, start, length, lse, tile=tile, **tuning)


def tile_selection(scores, k, table, *, plan, tile):
    return select_tiles(plan, scores, jnp.arange(scores.shape[1])[None] * tile,
                        table.shape[1] * k.shape[2])


def reuse_layer(q, k, v, table, indices, count, *, tile, **tuning):
    start, length = jnp.zeros((1,), jnp.int32), jnp.array([q.shape[1]], jnp.int32)
    return paged_prefill_attention(q, k, v, table, start, length, indices=indices, count=count,
                                   tile=tile, **tuning).out


def layer_rows(cfg, smoke):
    time = timer(smoke)
    c, tile = cfg["config"], cfg["tile"]
    tuning, rows = sweep(cfg, smoke)
    for context in cfg["contexts"]:
        q, k, v, table = paged_layer(jax.random.key(context), context, cfg)
        floor = attention_floor_ms(context, c["num_heads"], c["head_dim"])
        kc, vc = contiguous(k, table, cfg), contiguous(v, table, cfg)
        cudnn = jax.jit(functools.partial(jax.nn.dot_product_attention, is_causal=True,
                                          implementation=None if smoke else "cudnn"))
        cudnn_ms = time(cudnn, q, kc, vc)
        del kc, vc
        # the library's default (cuDNN on the chunks, through the gathered pages), and the
        # Pallas kernel at the sweep's best knobs
        for case, backend, knobs in (("dense_chunked", "auto", {}),
                                     ("dense_chunked_pallas", PALLAS, tuning)):
            ours = jax.jit(functools.partial(chunked_dense, chunk=cfg["chunk"], tuning=knobs,
                                             backend=backend))
            rows.append(harness.row(case, context=context, batch=1, ms=time(ours, q, k, v, table),
                                    floor=floor, peer="cudnn", peer_ms=cudnn_ms, tuning=knobs))
        rows.append(harness.row("cudnn", context=context, batch=1, ms=cudnn_ms, floor=floor,
                                peer="cudnn", peer_ms=cudnn_ms))
        for ratio in (0.1, 0.2):
            plan = kascade_plan(cfg, ratio)
            anchor = jax.jit(functools.partial(anchor_layer, plan=plan, tile=tile))
            anchor_ms = time(anchor, q, k, v, table)
            _, sel = anchor(q, k, v, table)
            # where an anchor layer's time goes, beside the dense pass above
            lse = paged_prefill_attention(q, k, v, table, jnp.zeros((1,), jnp.int32),
                                          jnp.array([context], jnp.int32)).lse
            scoring = jax.jit(functools.partial(tile_scores, tile=tile))
            scores = scoring(q, k, table, lse)
            selecting = jax.jit(functools.partial(tile_selection, plan=plan, tile=tile))
            for case, ms in (("kascade_anchor_scores", time(scoring, q, k, table, lse)),
                             ("kascade_anchor_select", time(selecting, scores, k, table))):
                rows.append(harness.row(case, context=context, batch=1, ms=ms, ratio=ratio))
            del lse, scores
            reuse = jax.jit(functools.partial(reuse_layer, tile=tile))
            reuse_ms = time(reuse, q, k, v, table, sel.indices, sel.count)
            weighted = ((WEIGHTS["layer0"] + WEIGHTS["anchor"]) * anchor_ms
                        + WEIGHTS["reuse"] * reuse_ms)
            for case, ms in (("kascade_anchor", anchor_ms), ("kascade_reuse", reuse_ms),
                             ("kascade_weighted", weighted)):
                rows.append(harness.row(case, context=context, batch=1, ms=ms, floor=floor,
                                        peer="cudnn", peer_ms=cudnn_ms, ratio=ratio,
                                        speedup_vs_cudnn=round(cudnn_ms / ms, 3)))
        del q, k, v, table
    return rows


def random_model(cfg):
    """Random weights in the per-layer layout `from_pretrained` returns (the decode step's)."""
    config = ModelConfig(**cfg["config"])
    return sparsejax.Model(config, unstack_layers(init_params(config, jax.random.key(0),
                                                              dtype=DTYPE)))


def model_rows(model, cfg, smoke):
    time = timer(smoke, calls=2)  # seconds per call at 128k
    rows = new_rows(smoke)
    config = model.config
    for context in cfg["model_contexts"]:
        ids = jax.random.randint(jax.random.key(1), (1, context), 0, config.vocab_size)
        lengths = jnp.array([context], jnp.int32)
        cache = kv.allocate(config, 1, context, page_size=cfg["page_size"], dtype=DTYPE)
        kascade = methods.Kascade(ratio=0.1, sparse_prefill=True, prefill_tile=cfg["tile"])
        kascade = kascade.scaled_to(config.num_layers)
        runs = {"model_prefill_dense_chunked": (None, cfg["chunk"], "auto"),
                "model_prefill_dense_chunked_pallas": (None, cfg["chunk"], PALLAS),
                "model_prefill_kascade": (kascade, cfg["chunk"], "auto"),
                "model_prefill_cudnn_one_pass": (None, None, "auto")}
        times = {}
        for case, (method, chunk, backend) in runs.items():
            plan = as_plan(method, config, cfg["page_size"])
            fn = jax.jit(functools.partial(sparsejax.prefill, plan=plan, chunk=chunk))
            with contextlib.ExitStack() as scope:
                if backend != "auto":   # every kernel call of the trace on that backend
                    scope.enter_context(use_backend(backend))
                    fn = harness.compiled(fn, model, cache, ids, lengths)
                times[case] = time(fn, model, cache, ids, lengths)
        for case, ms in times.items():
            rows.append(harness.row(case, context=context, batch=1, ms=ms,
                                    peer="model_prefill_dense_chunked",
                                    peer_ms=times["model_prefill_dense_chunked"]))
    return rows


def correction_rows(model, cfg, smoke):
    """Correcting N tokens once vs the N decode steps it follows (TidalDecode). A batch that
    does not fit is recorded and the next smaller one runs."""
    rows = new_rows(smoke)
    for batch in cfg["correct_batches"]:
        try:
            for row in correction_at(model, cfg, smoke, batch):
                rows.append(row)
            break
        except jax.errors.JaxRuntimeError as e:
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            rows.append(dict(case=f"correction_every_{cfg['correct_every']}", batch=batch,
                             context=cfg["correct_context"], error=str(e).splitlines()[0][:300]))
    return rows


def correction_at(model, cfg, smoke, batch):
    time = timer(smoke)
    config, n, context = model.config, cfg["correct_every"], cfg["correct_context"]
    plan = as_plan(methods.TidalDecode(k=max(1, context // 10)).scaled_to(config.num_layers),
                   config, cfg["page_size"])
    cache = random_cache(config, plan, batch, context, n, jax.random.key(2), dtype=DTYPE)
    tokens = jax.random.randint(jax.random.key(3), (batch, n), 0, config.vocab_size)
    # The cache is donated and threaded through the calls, as generate's loop does: a copy of
    # it (69 GB at 32k, B=16) would not fit beside it. The steps stay within the n spare slots.
    step = jax.jit(functools.partial(sparsejax.decode_step, plan=plan), donate_argnums=1)
    fix = jax.jit(functools.partial(correct, plan=plan), donate_argnums=1)
    # The compiled step's scratch memory beside its arguments (a copy of the cache would show).
    temp = step.lower(model, cache, tokens[:, 0]).compile().memory_analysis().temp_size_in_bytes
    state = [cache]
    del cache

    def decode():
        state[0] = step(model, state[0], tokens[:, 0])[1]
        return state[0].lengths

    def correction():
        state[0] = fix(model, state[0], tokens)
        return state[0].lengths
    decode_ms = time(decode)
    correct_ms = time(correction)
    state.clear()  # the cache is freed before the next batch or part
    return [harness.row("decode_step_tidal", context=context, batch=batch, ms=decode_ms,
                        step_temp_gib=round(temp / 2**30, 2)),
            harness.row(f"correction_every_{n}", context=context, batch=batch, ms=correct_ms,
                        peer=f"{n}_decode_steps", peer_ms=n * decode_ms,
                        share_of_decode=round(correct_ms / (n * decode_ms + correct_ms), 4))]


def plot(doc, path):
    """Left: one layer's prefill attention against the context; right: whole-model prefill."""
    from sparsejax.plotting import figure, save

    rows = doc["rows"]
    fig, ((ax, bx),) = figure(1, 2, figsize=(12, 4.5), gridspec_kw=dict(width_ratios=[3, 2]))
    layer = [("cudnn", None, "cuDNN (one pass, contiguous K/V)"),
             ("dense_chunked", None, "ours, dense, 8k chunks (cuDNN over the gathered pages)"),
             ("dense_chunked_pallas", None, "ours, dense, 8k chunks, Pallas kernel"),
             ("kascade_weighted", 0.1, "Kascade sparse prefill 10%, Table 3 weighting"),
             ("kascade_weighted", 0.2, "Kascade sparse prefill 20%, Table 3 weighting"),
             ("kascade_anchor", 0.1, "Kascade anchor layer (dense + tile scores + top-k)"),
             ("kascade_reuse", 0.1, "Kascade reuse layer, 10%")]
    for case, ratio, label in layer:
        pts = sorted((r["context"], r["ms"]) for r in rows
                     if r["case"] == case and r.get("ratio") == ratio and "ms" in r)
        if pts:
            ax.plot(*zip(*pts), marker="o", label=label)
    contexts = sorted({r["context"] for r in rows if r["case"] == "cudnn"})
    ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="ms per layer",
           title=f"prefill attention, Llama-3.1-8B shapes, B=1, {doc['device']}")
    ax.set_xticks(contexts, [f"{c // 1024}k" for c in contexts])
    ax.minorticks_off()
    ax.legend(fontsize=7)
    model = [r for r in rows if r["case"].startswith("model_prefill_")]
    cases = list(dict.fromkeys(r["case"] for r in model))
    ctxs = sorted({r["context"] for r in model})
    width = 0.8 / max(1, len(cases))
    for i, case in enumerate(cases):
        secs = [next((r["ms"] / 1e3 for r in model if r["case"] == case and r["context"] == c),
                     0.0) for c in ctxs]
        bx.bar([j + i * width for j in range(len(ctxs))], secs, width,
               label=case.removeprefix("model_prefill_").replace("_", " "))
    bx.set_xticks([j + width * (len(cases) - 1) / 2 for j in range(len(ctxs))],
                  [f"{c // 1024}k" for c in ctxs])
    bx.set(ylabel="seconds", title="whole-model prefill (random weights)")
    bx.legend(fontsize=7, loc="upper left")
    save(fig, path)


PARTS = ("layer", "model", "correction")


def part_of(row):
    case = row["case"]
    return ("model" if case.startswith("model_") else
            "correction" if case.startswith(("correction_", "decode_step_")) else "layer")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU")
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--contexts", default=None,
                        help="comma-separated contexts of the layer part (default: 8k-128k)")
    parser.add_argument("--model-contexts", default=None,
                        help="comma-separated contexts of the model part (default: 32k,128k)")
    args = parser.parse_args(argv)
    if not (args.smoke or jax.default_backend() == "gpu"):
        raise SystemExit("needs a GPU; use --smoke to exercise the script on CPU")
    cfg = SMOKE if args.smoke else FULL
    for name in ("contexts", "model_contexts"):
        if getattr(args, name):
            cfg = dict(cfg, **{name: tuple(int(c) for c in getattr(args, name).split(","))})
    parts = args.parts.split(",")
    # a partial rerun keeps what it skips
    committed = harness.committed_rows(harness.per_gpu_name("prefill"))
    rows = layer_rows(cfg, args.smoke) if "layer" in parts else []
    if {"model", "correction"} & set(parts):
        model = random_model(cfg)
        rows += correction_rows(model, cfg, args.smoke) if "correction" in parts else []
        rows += model_rows(model, cfg, args.smoke) if "model" in parts else []
    harness.print_table(rows)
    if not args.smoke:
        rerun = {"layer": cfg["contexts"], "model": cfg["model_contexts"],
                 "correction": (cfg["correct_context"],)}
        rows = [r for r in committed
                if not (part_of(r) in parts and r["context"] in rerun[part_of(r)])] + rows
        path = harness.write_results("prefill", rows, parts=sorted({part_of(r) for r in rows}),
                                     **META)
        plot(json.loads(path.read_text()), path.with_suffix(".png"))
        print(f"wrote {path} and its plot")


if __name__ == "__main__":
    main()
