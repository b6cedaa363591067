"""Paged decode attention on one GPU: the Pallas kernel (plain and with each score) vs cuDNN.

B=64, 32 query / 8 KV heads, d=128, bf16, page size 16, contexts 8k/32k/128k, page table a
random permutation of the page pool. Peers in the same run: cuDNN
`jax.nn.dot_product_attention` on contiguous K/V and JAX's Pallas `decode_attention.gqa`;
the floor is the K+V bytes at 4.8 TB/s in the JSON (the plot redraws it at the device's
bandwidth). A small tuning sweep at 32k picks the knobs used for
every row. Each kernel variant is checked against the reference on a few rows before timing.

  python benchmarks/bench_decode_attention.py            # on the GPU
  python benchmarks/bench_decode_attention.py --smoke    # tiny shapes, CPU interpret mode
"""
from __future__ import annotations

import argparse
import functools
import gc
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

# Room for the 128k case: 34 GB of paged K/V, or contiguous K/V plus gqa's transposed copy.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import harness  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from kernel_checks import max_row_rel_error  # noqa: E402

from sparsejax.pallas_kernels import common  # noqa: E402
from sparsejax.pallas_kernels.decode_attention import (  # noqa: E402
    default_tuning, float16_logits_bound, paged_decode_attention,
    paged_decode_attention_reference)

FULL = dict(batch=64, q_heads=32, kv_heads=8, head_dim=128, page_size=16,
            contexts=(8192, 32768, 131072), tune_context=32768)
SMOKE = dict(batch=2, q_heads=8, kv_heads=2, head_dim=64, page_size=16,
             contexts=(256, 512), tune_context=512)
SCORES = (None, "max_heads", "group_sum", "mean_query", "head_probs")
# (block_n, num_splits, num_warps, num_stages); None keeps the default for that knob.
SWEEP = [(None, None, None, None), (128, None, 4, 2), (64, None, 4, 3), (32, None, 4, 2),
         (128, None, 4, 3), (128, None, 8, 2), (64, 1, 4, 2), (64, 4, 4, 2), (128, 4, 4, 2),
         (32, 8, 4, 3)]
SMOKE_SWEEP = SWEEP[:2]
CHECK_ROWS = 4
OUT_TOL, LSE_TOL, SCORE_TOL = 1e-2, 1e-3, 1e-3
DTYPE = jnp.bfloat16


def calls_for(context: int) -> dict:
    """Fewer back-to-back calls at long contexts keep the whole run within a few minutes."""
    if jax.default_backend() != "gpu":  # the smoke run checks the plumbing, not the numbers
        return dict(calls=2, repeats=2, warmup=1)
    return dict(calls=min(50, max(10, 50 * 8192 // context)), repeats=5)


@functools.partial(jax.jit, static_argnums=(1, 2))
def make_paged(key, cfg_items, context):
    cfg = dict(cfg_items)
    b, hq, hk, d, p = (cfg[n] for n in ("batch", "q_heads", "kv_heads", "head_dim", "page_size"))
    max_pages = context // p
    kq, kk, kv, kp = jax.random.split(key, 4)
    q = jax.random.normal(kq, (b, hq, d), DTYPE)
    k = jax.random.normal(kk, (b * max_pages, hk, p, d), DTYPE)
    v = jax.random.normal(kv, (b * max_pages, hk, p, d), DTYPE)
    page_table = jax.random.permutation(kp, b * max_pages).astype(jnp.int32).reshape(b, max_pages)
    return q, k, v, page_table, jnp.full((b,), context, jnp.int32)


@functools.partial(jax.jit, static_argnums=(1, 2))
def make_contiguous(key, cfg_items, context):
    cfg = dict(cfg_items)
    b, hq, hk, d = (cfg[n] for n in ("batch", "q_heads", "kv_heads", "head_dim"))
    kq, kk, kv = jax.random.split(key, 3)
    return (jax.random.normal(kq, (b, 1, hq, d), DTYPE),
            jax.random.normal(kk, (b, context, hk, d), DTYPE),
            jax.random.normal(kv, (b, context, hk, d), DTYPE))


@functools.cache
def _reference(score):
    return jax.jit(functools.partial(paged_decode_attention_reference, score=score))


def check_rows(args):
    """The first CHECK_ROWS rows (all pages stay, only those rows gather)."""
    q, k, v, page_table, lengths = args
    return q[:CHECK_ROWS], k, v, page_table[:CHECK_ROWS], lengths[:CHECK_ROWS]


def reference_rows(args, score):
    """The reference on the first CHECK_ROWS rows."""
    return _reference(score)(*check_rows(args))


def compare(got, want, score, bound=0.0) -> dict:
    """Errors of the first CHECK_ROWS rows; `ok` says all are within tolerance. `bound`: what
    the kernel's float16 logits may add to each score (`float16_logits_bound`); score_err is
    the error beyond it, relative to the largest score."""
    res = dict(out_err=max_row_rel_error(got.out[:CHECK_ROWS], want.out),
               lse_err=float(jnp.max(jnp.abs(got.lse[:CHECK_ROWS] - want.lse))))
    ok = res["out_err"] <= OUT_TOL and res["lse_err"] <= LSE_TOL
    if score is not None:
        g, w = np.asarray(got.scores[:CHECK_ROWS]), np.asarray(want.scores)
        finite = np.isfinite(w)
        same_inf = bool(np.array_equal(np.isneginf(g), np.isneginf(w)))
        beyond = np.abs(g - w)[finite] - np.broadcast_to(bound, w.shape)[finite]
        res["score_err"] = float(max(0.0, np.max(beyond)) / np.max(np.abs(w[finite])))
        ok = ok and same_inf and res["score_err"] <= SCORE_TOL
    res["ok"] = bool(ok)
    return res


def kernel_fn(score, tuning, interpret):
    return functools.partial(paged_decode_attention, score=score, backend="pallas",
                             interpret=interpret, **tuning)


def sweep(cfg, interpret, configs):
    """Time the plain kernel at the tuning context for each config; return (best, tried)."""
    context = cfg["tune_context"]
    args = make_paged(jax.random.key(1), tuple(sorted(cfg.items())), context)
    base = default_tuning(cfg["batch"], cfg["kv_heads"], cfg["head_dim"], cfg["page_size"],
                          context // cfg["page_size"], DTYPE,
                          wide_offsets=common.wide_offsets(args[1]))
    want = reference_rows(args, None)
    tried = []
    for knobs in configs:
        tuning = {**base, **{n: x for n, x in zip(base, knobs) if x is not None}}
        entry = dict(tuning)
        try:
            fn = harness.compiled(kernel_fn(None, tuning, interpret), *args)
            res = compare(fn(*args), want, None)
            entry.update(res)
            if res["ok"]:
                entry["ms"] = round(harness.time_ms(fn, *args, **calls_for(context)), 4)
        except Exception as e:  # a config that does not compile must not end the sweep
            entry["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print("sweep", entry, flush=True)
        tried.append(entry)
    del args
    gc.collect()
    timed = [e for e in tried if "ms" in e]
    if not timed:
        raise SystemExit("no tuning config compiled and passed the check")
    best = min(timed, key=lambda e: e["ms"])
    return {n: best[n] for n in base}, tried


def time_peers(cfg, context, interpret, smoke):
    """(cudnn_ms | None, gqa_ms | None, notes) on contiguous K/V, freed before returning.

    The smoke run stands in XLA's attention for cuDNN, which needs a GPU.
    """
    q4, k, v = make_contiguous(jax.random.key(2), tuple(sorted(cfg.items())), context)
    timing = calls_for(context)
    notes, cudnn_ms, gqa_ms = {}, None, None
    impl = "xla" if smoke else "cudnn"
    try:
        fn = harness.compiled(functools.partial(jax.nn.dot_product_attention, implementation=impl),
                              q4, k, v)
        cudnn_ms = harness.time_ms(fn, q4, k, v, **timing)
    except Exception as e:
        notes["cudnn_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    try:
        from jax.experimental.pallas.ops.gpu.decode_attention import gqa
        fn = harness.compiled(functools.partial(gqa, interpret=interpret), q4[:, 0], k, v)
        gqa_ms = harness.time_ms(fn, q4[:, 0], k, v, **timing)
    except Exception as e:
        notes["gqa_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    del q4, k, v
    gc.collect()
    return cudnn_ms, gqa_ms, notes


def plot(rows, path, device: str, measured_tb_s: float | None = None) -> None:
    """ms per context for every case, log-log, beside the HBM floor of the K+V bytes at
    `device`'s bandwidth (the measured one if given, else its datasheet's)."""
    from matplotlib.ticker import NullLocator

    from sparsejax.plotting import figure, save

    fig, ((ax,),) = figure(figsize=(10, 4.5))
    for case in dict.fromkeys(r["case"] for r in rows):
        pts = sorted((r["context"], r["ms"]) for r in rows if r["case"] == case)
        ax.plot(*zip(*pts), marker="o", label=case)
    scale, bandwidth = harness.device_floor(device, measured_tb_s)
    floor = sorted({(r["context"], r["floor_ms"] * scale) for r in rows})
    ax.plot(*zip(*floor), "k--", label=f"HBM floor ({bandwidth})")
    ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="ms",
           title=f"paged decode attention, {device}")
    ax.set_xticks([c for c, _ in floor], [f"{c // 1024}k" if c >= 1024 else str(c)
                                          for c, _ in floor])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1))
    save(fig, path)
    out = os.environ.get("OUT")
    if out:
        shutil.copy(path, Path(out) / path.name)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on CPU in interpret mode; results go to a temp dir")
    parser.add_argument("--contexts", type=int, nargs="+", help="override the context list")
    args = parser.parse_args(argv)
    cfg = dict(SMOKE if args.smoke else FULL)
    if args.contexts:
        cfg["contexts"] = tuple(args.contexts)
    on_gpu = jax.default_backend() == "gpu"
    if not (on_gpu or args.smoke):
        raise SystemExit("needs a GPU; use --smoke to exercise the script on CPU")
    interpret = not on_gpu
    if args.smoke:
        harness.RESULTS = Path(tempfile.mkdtemp(prefix="bench_decode_attention_"))
    shape = {n: cfg[n] for n in ("batch", "q_heads", "kv_heads", "head_dim", "page_size")}
    start = time.perf_counter()

    tuning, tried = sweep(cfg, interpret, SMOKE_SWEEP if args.smoke else SWEEP)
    print(f"tuning {tuning}  ({time.perf_counter() - start:.0f}s)", flush=True)

    rows, failures = [], []
    for context in cfg["contexts"]:
        cudnn_ms, gqa_ms, notes = time_peers(cfg, context, interpret, args.smoke)
        floor = harness.floor_ms(2 * cfg["batch"] * context * cfg["kv_heads"] * cfg["head_dim"]
                                 * jnp.dtype(DTYPE).itemsize)
        peer = "xla_sdpa" if args.smoke else "cudnn"
        at = dict(context=context, batch=cfg["batch"], floor=floor, peer=peer, peer_ms=cudnn_ms)
        if cudnn_ms is not None:
            rows.append(harness.row(peer, ms=cudnn_ms, **at))
        if gqa_ms is not None:
            rows.append(harness.row("jax_pallas_gqa", ms=gqa_ms, **at))
        if notes:
            failures.append(dict(context=context, **notes))
            print(f"peer errors at {context}: {notes}", flush=True)

        kv_args = make_paged(jax.random.key(3), tuple(sorted(cfg.items())), context)
        for score in SCORES:
            case = "pallas" if score is None else f"pallas+{score}"
            try:
                fn = harness.compiled(kernel_fn(score, tuning, interpret), *kv_args)
                bound = 0.0 if score is None else np.asarray(float16_logits_bound(
                    *check_rows(kv_args), score=score))  # bf16 inputs: float16 logits
                res = compare(fn(*kv_args), reference_rows(kv_args, score), score, bound)
            except Exception as e:  # one variant failing to build must not end the run
                res = dict(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
            print(f"{case} @ {context}: {res}", flush=True)
            if not res["ok"]:
                print(f"!!! {case} @ {context} FAILED THE CHECK; not timed", flush=True)
                failures.append(dict(case=case, context=context, **res))
                continue
            ms = harness.time_ms(fn, *kv_args, **calls_for(context))
            rows.append(harness.row(case, ms=ms, **at, **tuning,
                                    **{k: round(v, 6) for k, v in res.items() if k != "ok"}))
        del kv_args
        gc.collect()
        print(f"context {context} done ({time.perf_counter() - start:.0f}s)", flush=True)

    path = harness.write_results(harness.per_gpu_name("decode_attention"), rows, shape=shape,
                                 dtype="bfloat16", tuning=tuning, tuning_sweep=tried,
                                 sweep_context=cfg["tune_context"], failures=failures,
                                 seconds=round(time.perf_counter() - start, 1))
    if rows:
        plot(rows, path.with_suffix(".png"), harness.device_name())
    harness.print_table(rows)
    print(f"wrote {path}")
    if failures:
        print(f"!!! {len(failures)} failure(s): {failures}")


if __name__ == "__main__":
    main()
