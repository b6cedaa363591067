"""Selecting layers against dense ones at decode, one GPU: Kascade's Table 3 and the other roles.

Llama-3.1-8B layer shapes (32 query / 8 KV heads, d=128), bf16, page 16, B=64, contexts
8k-128k (B=32 at 512k with --long, where it fits). Per context, timed as the library runs them
(GPU time from the profiler):
  cudnn       `jax.nn.dot_product_attention` on contiguous K/V (the peer)
  dense       our paged decode kernel, no scores
  <role>      a selecting layer: the dense kernel with the role's scores, then its selection
              (`selection.select`: budget, sinks/recent, top-k); also each half alone
              (<role>_scores, <role>_select): kascade (anchor, 10% and 20%), delta (Δ-layer,
              64 pages), lychee (every KV head a retrieval head, 10%), tidal (10%, per query head)
              Kascade's halves at the first ratio carry their ms per kernel (kernels_ms,
              from the profiler): where the anchor's time goes. Lychee and Tidal hand the
              top-k the kernel's unpooled logits (`selection.score_route(...).topk_pools`), pooled as they are read;
              <role>_pooled_epilogue is the same layer with the pooled scores written by an
              epilogue and read back by the top-k. Kascade keeps the epilogue;
              kascade_pooled_in_topk is its layer the other way.
  kascade_reuse  the sparse kernel over the anchor's selection
  kascade_weighted  Table 3's weighting: 5 of 32 layers at the anchor's cost (layer 0 dense
              with them), 27 at the reuse layer's; its speedup over cuDNN, and the bound
              32 / (5 + 27 r) that an anchor as cheap as our dense layer would give (r = reuse
              over our dense layer).
  kascade_sparse_anchor  an anchor of `Kascade(sparse_anchors=True)` after layer 0, as the
              paper runs it: the scores pass without V (also alone, _scores), the top-k,
              attention over that top-k, reading the scores pass's logits instead of K;
              kascade_sparse_anchor_recomputed recomputes them from K, as the paper does
  kascade_weighted_sparse_anchors  the paper's weighting of its Table 3: 1/32 anchor layer 0
              (the dense anchor above), 4/32 sparse anchors, 27/32 reuse.
The paper's decode rows (H100, fp16, vs FlashAttention-3) are in the JSON beside ours.
Results: results/selecting_layers.json on an H200, results/selecting_layers_<gpu>.json on any
other GPU (selecting_layers_h100.json on an H100), so each GPU's table keeps its own rows.

  python benchmarks/bench_selecting_layers.py            # on the GPU
  python benchmarks/bench_selecting_layers.py --smoke    # tiny shapes on CPU (the references)
"""
from __future__ import annotations

import argparse
import functools
import gc
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")

import jax  # noqa: E402
import numpy as np  # noqa: E402

import harness  # noqa: E402
from bench_decode_attention import make_contiguous, make_paged  # noqa: E402
from shapes import MODELS  # noqa: E402

from sparsejax import methods as M  # noqa: E402
from sparsejax.models import ModelConfig  # noqa: E402
from sparsejax.pallas_kernels import paged_decode_attention, sparse_decode_attention  # noqa: E402
from sparsejax.plan import as_plan  # noqa: E402
from sparsejax.selection import score_route, scores_pass, select  # noqa: E402

LAYER = MODELS["llama-8b"]
FULL = dict(layer=LAYER, page_size=16, batch=64, contexts=(8192, 16384, 32768, 65536, 131072),
            ratios=(0.1, 0.2), long=(32, 524288))
SMOKE = dict(layer=dict(LAYER, hidden_size=256, num_heads=8, num_kv_heads=2, head_dim=64),
             page_size=16, batch=2, contexts=(512,), ratios=(0.1,), long=(2, 1024))
ANCHORS, LAYERS = 5, 32  # Table 3: layer 0 and 4 more anchors of 32 layers, the rest reuse
# Kascade Table 3, decode (H100, fp16, B=64; B=32 at 512k): context -> (FA3 ms, anchor layer 0
# ms, anchor ms, reuse ms, weighted speedup vs FA3), at 10% and 20% of the context.
PAPER = {
    0.1: {8192: (0.70, 0.92, 0.82, 0.13, 2.91), 16384: (1.40, 1.71, 1.45, 0.21, 3.40),
          32768: (2.93, 3.35, 2.71, 0.35, 3.97), 65536: (5.85, 6.74, 5.39, 0.65, 4.08),
          131072: (11.68, 14.08, 10.78, 1.24, 4.12), 524288: (21.85, 25.78, 20.65, 2.30, 4.10)},
    0.2: {8192: (0.70, 0.91, 0.89, 0.20, 2.27), 16384: (1.40, 1.73, 1.61, 0.36, 2.50),
          32768: (2.93, 3.58, 3.22, 0.65, 2.76), 65536: (5.85, 6.97, 6.22, 1.24, 2.87),
          131072: (11.68, 13.85, 12.25, 2.42, 2.92), 524288: (21.85, 28.79, 24.93, 4.55, 2.78)},
}
PAPER_SOURCE = "Kascade, Table 3 (decode rows), H100, fp16, vs FlashAttention-3"


def roles(config, context, ratio):
    """{role: plan} of the selecting layers timed at this ratio of the context."""
    everywhere = np.ones((config.num_layers, config.num_kv_heads), bool)
    out = {"kascade": M.Kascade(ratio=ratio).scaled_to(config.num_layers)}
    if ratio == 0.1:
        out.update(delta=M.DELTA().scaled_to(config.num_layers),
                   lychee=M.Lychee(everywhere, budget=M.Ratio(ratio)),
                   tidal=M.TidalDecode(k=max(1, int(ratio * context))).scaled_to(
                       config.num_layers))
    return out


def timer(smoke):
    if smoke:
        return functools.partial(harness.time_ms, calls=1, repeats=1, warmup=1)
    return functools.partial(harness.device_time_ms, calls=10, warmup=2)


def kernel_shape(config, batch, page_size):
    """The shape dict bench_decode_attention's input builders take (a hashable jit key)."""
    return tuple(sorted(dict(batch=batch, q_heads=config.num_heads,
                             kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                             page_size=page_size).items()))


def cudnn_ms(shape, context, smoke):
    """cuDNN on contiguous K/V, built and freed before the paged cache exists (512k fits)."""
    q, k, v = make_contiguous(jax.random.key(1), shape, context)
    fn = jax.jit(functools.partial(jax.nn.dot_product_attention,
                                   implementation="xla" if smoke else "cudnn"))
    ms = timer(smoke)(fn, q, k, v)
    del q, k, v
    gc.collect()
    return ms


def scores_of(q, k, v, table, lengths, *, plan, values=True, pool_scores=None):
    """The dense kernel with the role's scores, as the library asks for them
    (`score_route(...).kernel_args()`); pool_scores overrides whether they come back pooled."""
    request = score_route(plan.selector).kernel_args()
    if pool_scores is not None:
        request.update(pool_scores=pool_scores)
    return paged_decode_attention(q, k, v, table, lengths, values=values, **request)


def selection_of(scores, lengths, *, plan, config, capacity):
    return select(plan, config, scores, lengths, capacity)


def selecting_layer(q, k, v, table, lengths, *, plan, config, pool_scores=None):
    """What a selecting layer runs: dense attention with the role's scores, then its top-k."""
    r = scores_of(q, k, v, table, lengths, plan=plan, pool_scores=pool_scores)
    return r.out, selection_of(r.scores, lengths, plan=plan, config=config,
                               capacity=table.shape[1] * k.shape[2])


def reuse_layer(q, k, v, table, lengths, indices, count, *, unit):
    return sparse_decode_attention(q, k, v, table, lengths, indices, count, unit=unit).out


def sparse_anchor_layer(q, k, v, table, lengths, *, plan, config, own_logits=True):
    """What `Kascade(sparse_anchors=True)` runs at an anchor after layer 0 (a SELF layer, the
    paper's passes): the scores without V, the top-k, attention over that top-k, which
    reads the scores pass's logits instead of K (own_logits=False: recomputes them)."""
    scores, logits = scores_pass(plan, q, k, v, table, lengths)
    sel = select(plan, config, scores, lengths, table.shape[1] * k.shape[2])
    return sparse_decode_attention(q, k, v, table, lengths, sel.indices, sel.count,
                                   unit=plan.selector.unit,
                                   logits=logits if own_logits else None).out


def context_rows(cfg, rows, batch, context, smoke):
    config = ModelConfig(**cfg["layer"])
    time = timer(smoke)
    shape = kernel_shape(config, batch, cfg["page_size"])
    peer = cudnn_ms(shape, context, smoke)
    row = functools.partial(harness.row, context=context, batch=batch, peer="cudnn",
                            peer_ms=peer)
    rows.append(row("cudnn", ms=peer))
    args = make_paged(jax.random.key(2), shape, context)
    capacity = args[3].shape[1] * cfg["page_size"]
    dense_layer = jax.jit(paged_decode_attention)
    dense = time(dense_layer, *args)
    rows.append(row("dense", ms=dense, ratio_to_dense=1.0, kernels_ms=None if smoke else
                    harness.profile(functools.partial(dense_layer, *args))["top"]))
    for ratio in cfg["ratios"]:
        for name, method in roles(config, context, ratio).items():
            plan = as_plan(method, config, cfg["page_size"])
            layer = jax.jit(functools.partial(selecting_layer, plan=plan, config=config))
            scoring = jax.jit(functools.partial(scores_of, plan=plan))
            selecting = jax.jit(functools.partial(selection_of, plan=plan, config=config,
                                                  capacity=capacity))
            scores = scoring(*args).scores
            times = {name: time(layer, *args), f"{name}_scores": time(scoring, *args),
                     f"{name}_select": time(selecting, scores, args[4])}
            if score_route(plan.selector).rows_poolable:  # the same layer, pooled the other way
                fused = score_route(plan.selector).topk_pools
                times[f"{name}_pooled_{'epilogue' if fused else 'in_topk'}"] = time(
                    jax.jit(functools.partial(selecting_layer, plan=plan, config=config,
                                              pool_scores=fused)), *args)
            kernels = {}
            if name == "kascade" and ratio == cfg["ratios"][0] and not smoke:
                # where the anchor's time goes: ms per kernel of each half (profiler)
                kernels = {f"{name}_scores": functools.partial(scoring, *args),
                           f"{name}_select": functools.partial(selecting, scores, args[4])}
                kernels = {case: harness.profile(fn)["top"] for case, fn in kernels.items()}
            del scores
            for case, ms in times.items():
                rows.append(row(case, ms=ms, ratio=ratio, score=str(plan.selector.score),
                                ratio_to_dense=round(ms / dense, 3),
                                kernels_ms=kernels.get(case)))
            if name != "kascade":
                continue
            _, sel = layer(*args)
            reuse = time(jax.jit(functools.partial(reuse_layer, unit=plan.selector.unit)), *args,
                         sel.indices, sel.count)
            del sel
            anchor = times[name]
            weighted = (ANCHORS * anchor + (LAYERS - ANCHORS) * reuse) / LAYERS
            r = reuse / dense
            paper = PAPER[ratio].get(context)
            rows.append(row("kascade_reuse", ms=reuse, ratio=ratio,
                            ratio_to_dense=round(r, 3)))
            rows.append(row("kascade_weighted", ms=weighted, ratio=ratio,
                            speedup_vs_cudnn=round(peer / weighted, 3),
                            bound_if_anchor_equals_dense=round(LAYERS / (ANCHORS + (LAYERS -
                                                                          ANCHORS) * r), 3),
                            paper=None if paper is None else dict(zip(
                                ("fa3_ms", "anchor0_ms", "anchor_ms", "reuse_ms",
                                 "speedup_vs_fa3"), paper))))
            # sparse anchors (the paper's layout): layer 0 as above, the other 4 anchors
            # attend to their own top-k after a scores pass without V
            sparse_times = {
                "kascade_sparse_anchor": time(jax.jit(functools.partial(
                    sparse_anchor_layer, plan=plan, config=config)), *args),
                "kascade_sparse_anchor_recomputed": time(jax.jit(functools.partial(
                    sparse_anchor_layer, plan=plan, config=config, own_logits=False)), *args),
                "kascade_sparse_anchor_scores": time(jax.jit(functools.partial(
                    scores_pass, plan)), *args)}
            for case, ms in sparse_times.items():
                rows.append(row(case, ms=ms, ratio=ratio, ratio_to_dense=round(ms / dense, 3)))
            weighted = (anchor + (ANCHORS - 1) * sparse_times["kascade_sparse_anchor"] +
                        (LAYERS - ANCHORS) * reuse) / LAYERS
            rows.append(row("kascade_weighted_sparse_anchors", ms=weighted, ratio=ratio,
                            speedup_vs_cudnn=round(peer / weighted, 3)))
    del args
    gc.collect()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU")
    parser.add_argument("--contexts", default=None, help="comma-separated (default 8k-128k)")
    parser.add_argument("--ratios", default=None, help="comma-separated (default 0.1,0.2)")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--long", action="store_true",
                        help="also B=32 at 512k (Table 3's longest row), if it fits")
    args = parser.parse_args(argv)
    if not (args.smoke or jax.default_backend() == "gpu"):
        raise SystemExit("needs a GPU; use --smoke to exercise the script on CPU")
    cfg = dict(SMOKE if args.smoke else FULL)
    if args.contexts:
        cfg["contexts"] = tuple(int(c) for c in args.contexts.split(","))
    if args.ratios:
        cfg["ratios"] = tuple(float(r) for r in args.ratios.split(","))
    batch = args.batch or cfg["batch"]
    name = harness.per_gpu_name("selecting_layers")
    rows = harness.Rows(name, write=not args.smoke, meta=dict(
        shape="Llama-3.1-8B layer (32/8 heads, d=128), bf16, page 16",
        weights=f"kascade_weighted = {ANCHORS}/{LAYERS} anchor + {LAYERS - ANCHORS}/{LAYERS} "
                "reuse (Kascade Table 3)", paper=PAPER_SOURCE))
    shapes = [(batch, c) for c in cfg["contexts"]] + ([cfg["long"]] if args.long else [])
    # a partial rerun (--contexts, --ratios, --long) keeps the committed rows it does not redo
    def redone(r):
        return (r["batch"], r["context"]) in shapes and r.get("ratio") in (None, *cfg["ratios"])
    kept = [r for r in harness.committed_rows(name) if not redone(r)]
    for b, context in shapes:
        try:
            context_rows(cfg, rows, b, context, args.smoke)
        except jax.errors.JaxRuntimeError as e:  # 512k may not fit beside its temporaries
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            rows.append(dict(case="skipped", context=context, batch=b,
                             error=str(e).splitlines()[0][:300]))
            gc.collect()
    harness.print_table(rows, cols=("case", "context", "batch", "ratio", "ms", "peer_ms",
                                    "ratio_to_peer", "ratio_to_dense", "speedup_vs_cudnn"))
    if not args.smoke:
        path = harness.write_results(name, kept + rows, **rows.meta)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
