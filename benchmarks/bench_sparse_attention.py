"""Sparse gather decode attention on one GPU: time vs the HBM floor of the bytes gathered and
vs cuDNN dense attention at the same context, measured in the same run.

Cases (bf16, HQ=32, HK=8, D=128, P=16, every row at the full context):
  kascade  reuse layer: B=64, 10% of tokens per KV head, token unit, G=HK, many-to-one head
           map; 8k/32k/128k; also the naive XLA gather (take rows, then attention).
  delta    sparse layer: B=64, 64 pages of 16 shared by all heads (G=1, unit=P); 32k/128k.
  lychee   hybrid layer: B=8, 128k, 64-token blocks, sparse heads keep 10% of blocks
           (LycheeDecode's kernel setting: 90% sparsity, block 64), 0/1/2/4 of 8 KV heads dense.
  batch1   DELTA's and Kascade's layers above at B=1, 32k/128k: 8 row groups, far below a
           wave of programs, so the split count is the knob (`default_splits`); swept.
Each case is first checked natively against the reference; a wrong case is reported and
skipped. Each family sweeps tuning configs at one size (block_n, warps, stages, the
lookahead of the index/page lookups, and splits per row group: one split is the direct-write
path with no merge) and uses the best for the rest; Kascade, whose work per row group scales
with the context, re-picks its split count at 8k and 128k among a few candidates. Every
kernel is also timed with RESA `prior_query` set (target <= 1.15x without).

Times are GPU time per call from the profiler (`harness.device_time_ms`): the host's dispatch
of one call (~0.03-0.05 ms) is as long as the smallest cases here, so back-to-back wall-clock
calls would time the host. Each main row also carries `wall_ms`, the wall-clock time per call
of back-to-back calls, for what a caller dispatching one layer at a time sees.

The prior on the direct (one-split) path is taken apart (`isolate_prior`; ratio_to_no_prior
is against the kernel without the prior at the same tuning):
  +prior            prior_length omitted: the kernel has no prior mask (the bound is implied)
  +prior_bound      prior_length = lengths - 16, another array: the per-row mask in the loop
  +prior/sweep      other knobs with and without the prior (another lookahead, block_n=32,
                    8 warps), and +prior@best: the best prior time / the best time without

  python benchmarks/bench_sparse_attention.py            # H200, < 5 minutes
  python benchmarks/bench_sparse_attention.py --families batch1   # some families only:
                                                    # results/sparse_attention_batch1.json
  python benchmarks/bench_sparse_attention.py --smoke    # tiny shapes, CPU interpret mode
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.90")  # 128k B=64: 2 x 34 GB live

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import harness  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from kernel_checks import max_row_rel_error  # noqa: E402

from sparsejax.pallas_kernels.sparse_attention import (  # noqa: E402
    default_splits,
    default_tuning,
    sparse_decode_attention,
    sparse_decode_attention_reference,
)

NAME = "sparse_attention"
HQ, HK, D, P = 32, 8, 128, 16
DTYPE = jnp.bfloat16
BYTES = 2  # bf16
HEAD_MAP = np.array([3, 3, 0, 5, 5, 1, 7, 7], np.int32)  # many-to-one, not the identity


def sweep_point(block_n=64, splits=None, num_warps=None, num_stages=2, lookahead=None,
                split_tokens=None) -> dict:
    """A tuning config to sweep. splits: per sparse row group (None: the kernel's default
    rule; 1: the direct-write path); split_tokens, when given, overrides splits; num_warps
    None: the kernel's default (2 for sparse-only work at D <= 128, else 4); lookahead None: the
    kernel's default (2)."""
    return dict(block_n=block_n, splits=splits, num_warps=num_warps, num_stages=num_stages,
                lookahead=lookahead, split_tokens=split_tokens)


KNOB_SWEEP = [  # every family, at the default split rule; the first is the default tuning
    sweep_point(), sweep_point(lookahead=0), sweep_point(lookahead=1), sweep_point(num_stages=3),
    sweep_point(128, num_stages=3), sweep_point(32), sweep_point(128, num_warps=8),
    sweep_point(num_warps=2), sweep_point(num_warps=4), sweep_point(num_warps=8),
]
SPLIT_SWEEP = {  # per family; the default rule's split count is noted. block_n=32 halves
    # the K/V buffers: more programs resident per SM, so 512 row groups may fit in one wave.
    "kascade": [*(sweep_point(splits=s) for s in (1, 2, 8)), sweep_point(32, splits=1)],  # 4
    "delta": [sweep_point(splits=2), sweep_point(splits=4), sweep_point(32, splits=2)],  # 1
    "lychee": [sweep_point(split_tokens=512), sweep_point(split_tokens=2048)],  # 1024
}
FAMILIES = {"kascade", "delta", "lychee", "batch1"}
TIME_BUDGET_S = 270  # sweeps stop early, and later families are skipped, past this
PRIOR_GAP = 16  # +prior_bound: the prior covers all but the last 16 positions (a prompt)
COLUMNS = ("case", "context", "batch", "ms", "wall_ms", "floor_ms", "peer_ms", "ratio_to_floor",
           "ratio_to_peer", "ratio_to_no_prior", "num_splits", "out_err")


class Bench:
    def __init__(self, smoke: bool):
        self.smoke = smoke
        self.interpret = smoke
        self.rows: list[dict] = []
        self.cudnn_ms: dict[tuple[int, int], float] = {}
        self.key = jax.random.key(0)
        self.deadline = time.monotonic() + TIME_BUDGET_S
        self.prior_swept: set[str] = set()  # families whose prior knob variants ran
        if smoke:
            self.hq, self.hk, self.d, self.p = 8, 2, 64, 8
        else:
            self.hq, self.hk, self.d, self.p = HQ, HK, D, P

    def rand(self, shape, dtype=DTYPE):
        """Normal samples, made in slices of <= 2**28 so that no RNG temporary is large."""
        self.key, sub = jax.random.split(self.key)
        size, slices = int(np.prod(shape)), 1
        while size // slices > 2**28 and size % (2 * slices) == 0:
            slices *= 2
        make = jax.jit(lambda keys: jax.lax.map(
            lambda k: jax.random.normal(k, (size // slices,), dtype), keys).reshape(shape))
        return make(jax.random.split(sub, slices))

    def time(self, fn, *args) -> float:
        """GPU time per call (the profiler's kernel records); wall clock in smoke runs."""
        if self.smoke:
            return harness.time_ms(fn, *args, calls=1, repeats=1, warmup=1)
        return harness.device_time_ms(fn, *args)

    def wall(self, fn, *args) -> float:
        """Wall-clock time per call: median of 5 batches of back-to-back calls, each batch
        >= ~20 ms, so that the first launch and the final sync of a batch are noise."""
        if self.smoke:
            return self.time(fn, *args)
        rough = harness.time_ms(fn, *args, calls=10, repeats=1, warmup=3)
        calls = int(min(1000, max(20, 20.0 / max(rough, 1e-3))))
        return harness.time_ms(fn, *args, calls=calls, repeats=5, warmup=1)

    def cache(self, batch: int, context: int):
        """Paged cache with every row at full length and a shuffled page table."""
        pages = batch * context // self.p
        k_pages = self.rand((pages, self.hk, self.p, self.d))
        v_pages = self.rand((pages, self.hk, self.p, self.d))
        rng = np.random.default_rng(context + batch)
        page_table = jnp.asarray(rng.permutation(pages).reshape(batch, -1), jnp.int32)
        lengths = jnp.full((batch,), context, jnp.int32)
        return self.rand((batch, self.hq, self.d)), k_pages, v_pages, page_table, lengths

    def selection(self, batch, groups, num_units, k):
        """Sorted, unique random units per (row, group), all k valid."""
        rng = np.random.default_rng(num_units + k)
        idx = [np.sort(rng.choice(num_units, k, replace=False)) for _ in range(batch * groups)]
        return (jnp.asarray(np.reshape(idx, (batch, groups, k)), jnp.int32),
                jnp.full((batch, groups), k, jnp.int32))

    def cudnn(self, batch: int, context: int) -> float:
        """cuDNN dense decode at this context (contiguous K/V), freed before returning."""
        if (batch, context) not in self.cudnn_ms:
            q = self.rand((batch, 1, self.hq, self.d))
            k = self.rand((batch, context, self.hk, self.d))
            v = self.rand((batch, context, self.hk, self.d))
            impl = None if self.smoke else "cudnn"
            fn = harness.compiled(lambda *a: jax.nn.dot_product_attention(
                *a, implementation=impl), q, k, v)
            self.cudnn_ms[(batch, context)] = self.time(fn, q, k, v)
            for x in (q, k, v):
                x.delete()
        return self.cudnn_ms[(batch, context)]

    @staticmethod
    def prior_opts(a) -> dict:
        """args[7:]: the RESA prior query, then an explicit prior_length (when present)."""
        return dict(zip(("prior_query", "prior_length"), a[7:]))

    def kernel(self, args, opts, tuning):
        """The AOT-compiled kernel (args as `prior_opts` reads them)."""
        return harness.compiled(lambda *a: sparse_decode_attention(
            *a[:7], **opts, **self.prior_opts(a), backend="pallas", interpret=self.interpret,
            **tuning), *args)

    def check(self, case, args, opts, kernel_with_prior) -> dict:
        """Native kernel vs reference (out, lse and the RESA prior); raises when wrong."""
        got = kernel_with_prior(*args)
        want = jax.jit(lambda *a: sparse_decode_attention_reference(
            *a[:7], **opts, **self.prior_opts(a)))(*args)
        err = {"out_err": max_row_rel_error(got.out, want.out),
               "lse_err": float(jnp.max(jnp.abs(got.lse - want.lse))),
               "prior_err": max_row_rel_error(got.prior[1], want.prior[1]),
               "prior_lse_err": float(jnp.max(jnp.abs(got.prior[0] - want.prior[0])))}
        print(f"  check {case}: " + " ".join(f"{k}={v:.2e}" for k, v in err.items()))
        if not (err["out_err"] <= 1e-2 and err["prior_err"] <= 1e-2
                and err["lse_err"] <= 1e-3 and err["prior_lse_err"] <= 1e-3):
            raise AssertionError(f"{case}: kernel disagrees with the reference: {err}")
        return {k: float(f"{v:.3g}") for k, v in err.items()}

    def shape_facts(self, args, opts) -> tuple[int, int, int]:
        """(row groups, sparse stream tokens, dense stream tokens) of a case."""
        q, page_table, indices = args[0], args[3], args[5]
        row_groups = q.shape[0] * self.hk  # no case here selects per query head
        dense_tokens = page_table.shape[1] * self.p if "dense_heads" in opts else 0
        return row_groups, indices.shape[2] * opts["unit"], dense_tokens

    def tuning_for(self, args, opts, config) -> dict:
        """The kernel's tuning dict for a sweep config at this size."""
        tuning = default_tuning(self.d, *self.shape_facts(args, opts), splits=config["splits"],
                                block_n=config["block_n"])
        if config["split_tokens"] is not None:
            tuning["split_tokens"] = max(config["block_n"], config["split_tokens"])
        return {**tuning, **{k: config[k] for k in ("num_warps", "num_stages", "lookahead")
                             if config[k] is not None}}

    def num_splits(self, args, opts, tuning) -> int:
        _, sparse, dense = self.shape_facts(args, opts)
        return -(-max(sparse, dense) // tuning["split_tokens"])

    def sweep(self, family, args, opts, floor, configs, label=None) -> dict:
        """Times each config at this size; returns the best config."""
        if self.smoke:
            configs = configs[:2]
        label = label or family
        tried, timed, seen = [], [], set()
        for cfg in configs:
            if tried and time.monotonic() > self.deadline - 90:
                print(f"  sweep {label}: stopped early (time budget)")
                break
            tuning = self.tuning_for(args, opts, cfg)
            if tuple(sorted(tuning.items())) in seen:  # two configs landing on one tuning
                continue
            seen.add(tuple(sorted(tuning.items())))
            info = {**tuning, "num_splits": self.num_splits(args, opts, tuning)}
            try:
                ms = self.time(self.kernel(args, opts, tuning), *args)
            except Exception as e:  # a config that fails to compile is recorded, not fatal
                print(f"  sweep {label} {info}: failed: {type(e).__name__}: {e}")
                tried.append({**info, "ms": None, "error": f"{type(e).__name__}: {e}"[:200]})
                continue
            print(f"  sweep {label} {info}: {ms:.4f} ms ({ms / floor:.2f}x floor)")
            tried.append({**info, "ms": round(ms, 4)})
            timed.append((ms, len(timed), cfg, tried[-1]))
        if not timed:
            raise RuntimeError(f"{label}: every tuning config failed: {tried}")
        _, _, best_config, best = min(timed)
        self.rows.append(harness.row(f"{label}/sweep", context=int(args[4][0]),
                                     batch=args[0].shape[0], ms=best["ms"], floor=floor,
                                     configs_tried=tried, best=best))
        return best_config

    def measure(self, case, context, batch, args, opts, config, floor, gathered_tokens, **extra):
        """Checks, then times the kernel with and without the prior; appends two rows (and on
        the direct path the `isolate_prior` rows)."""
        tuning = self.tuning_for(args, opts, config)
        args_prior = (*args, args[0] * 0.5)
        try:
            with_prior = self.kernel(args_prior, opts, tuning)
            err = self.check(case, args_prior, opts, with_prior)
        except Exception as e:
            traceback.print_exc()
            print(f"!!! {case} at {context}: SKIPPED, {type(e).__name__}: {e}")
            self.rows.append(error_row(case, context, batch, e))
            return None
        peer_ms = self.cudnn(batch, context)
        kernel = self.kernel(args, opts, tuning)
        ms = self.time(kernel, *args)
        ms_prior = self.time(with_prior, *args_prior)
        common = dict(context=context, batch=batch, floor=floor, peer="cudnn", peer_ms=peer_ms,
                      tuning=tuning, num_splits=self.num_splits(args, opts, tuning),
                      gathered_tokens_per_head=gathered_tokens, **err, **extra)
        self.rows.append(harness.row(case, ms=ms, speedup_vs_peer=round(peer_ms / ms, 2),
                                     wall_ms=round(self.wall(kernel, *args), 4), **common))
        self.rows.append(harness.row(case + "+prior", ms=ms_prior,
                                     ratio_to_no_prior=round(ms_prior / ms, 3), **common))
        if common["num_splits"] == 1:
            try:
                self.isolate_prior(case, args_prior, opts, config, ms, ms_prior, common)
            except Exception as e:  # diagnostics only: never lose the family's other rows
                traceback.print_exc()
                print(f"!!! {case} at {context}: prior isolation failed: {e}")
        return ms

    def isolate_prior(self, case, args_prior, opts, config, ms, ms_prior, common):
        """The prior's cost on the direct path taken apart (see the module docstring); the
        knob variants only at the first direct case of a family (`self.prior_swept`).
        ms, ms_prior: the per-call times without and with the prior at `config`."""
        if time.monotonic() > self.deadline - 60 or (self.smoke and self.prior_swept):
            print(f"  isolate {case}: skipped ({'smoke: once' if self.smoke else 'time budget'})")
            return
        tuning = common["tuning"]
        args = args_prior[:7]
        bound = jnp.maximum(args[4] - PRIOR_GAP, 0)  # a separate array: the mask is applied
        with_bound = (*args_prior, bound)
        err = self.check(case + "+prior_bound", with_bound, opts,
                         self.kernel(with_bound, opts, tuning))

        def add(suffix, ms_variant, base_ms, **extra):
            self.rows.append(harness.row(case + suffix, ms=ms_variant,
                                         ratio_to_no_prior=round(ms_variant / base_ms, 3),
                                         **{**common, **extra}))
            print(f"  isolate {case}{suffix}: {ms_variant:.4f} ms "
                  f"({ms_variant / base_ms:.3f}x without the prior)")

        add("+prior_bound", self.time(self.kernel(with_bound, opts, tuning), *with_bound), ms,
            prior_gap=PRIOR_GAP, **{"bound_" + k: v for k, v in err.items() if "prior" in k})

        family = case.split("/")[0]
        if family in self.prior_swept or time.monotonic() > self.deadline - 90:
            return
        self.prior_swept.add(family)
        variants = [{**config, "lookahead": 1 if tuning["lookahead"] == 2 else 2},
                    {**config, "block_n": 32}, {**config, "num_warps": 8}][:1 if self.smoke else 3]
        tried = [{**tuning, "ms": round(ms, 4), "ms_prior": round(ms_prior, 4)}]
        for variant in variants:
            t = self.tuning_for(args, opts, {**variant, "splits": 1, "split_tokens": None})
            if self.num_splits(args, opts, t) != 1:
                continue
            t_ms = self.time(self.kernel(args, opts, t), *args)
            t_prior = self.time(self.kernel(args_prior, opts, t), *args_prior)
            tried.append({**t, "ms": round(t_ms, 4), "ms_prior": round(t_prior, 4)})
            print(f"  prior sweep {case} {t}: {t_ms:.4f} ms, {t_prior:.4f} ms with the prior "
                  f"({t_prior / t_ms:.3f}x)")
        for entry in tried:
            entry["ratio_to_no_prior"] = round(entry["ms_prior"] / entry["ms"], 3)
        best = min(tried, key=lambda e: e["ms_prior"])
        self.rows.append(harness.row(case + "+prior/sweep", ms=best["ms_prior"], **{
            **common, "configs_tried": tried, "best": best}))
        add("+prior@best", best["ms_prior"], min(e["ms"] for e in tried), best_tuning=best)

    # --- case families -------------------------------------------------------------------

    def kascade(self):
        batch = 2 if self.smoke else 64
        contexts = [256, 512] if self.smoke else [8192, 32768, 131072]
        sweep_at = contexts[1]
        order = [sweep_at] + [c for c in contexts if c != sweep_at]
        best = KNOB_SWEEP[0]
        head_map = jnp.asarray(HEAD_MAP[:self.hk] % self.hk, jnp.int32)
        for context in order:
            k = max(1, context // 10)
            self.cudnn(batch, context)  # before the paged cache: only one big cache lives
            q, k_pages, v_pages, page_table, lengths = self.cache(batch, context)
            indices, count = self.selection(batch, self.hk, context, k)
            args = (q, k_pages, v_pages, page_table, lengths, indices, count)
            opts = {"unit": 1, "head_map": head_map}
            floor = harness.floor_ms(batch * self.hk * k * 2 * self.d * BYTES)
            if context == sweep_at:
                best = self.sweep("kascade", args, opts, floor,
                                  KNOB_SWEEP + SPLIT_SWEEP["kascade"])
                cfg = best
            else:  # 4x more or less work per row group: re-pick the split count only
                rule = default_splits(*self.shape_facts(args, opts)[:2])
                splits = [None, best["splits"], *((1, 2) if context < sweep_at else (2 * rule,))]
                local = [{**best, "splits": s, "split_tokens": None} for s in splits]
                if context < sweep_at:
                    local.append(sweep_point(32, splits=1))
                cfg = self.sweep("kascade", args, opts, floor, local,
                                 label=f"kascade@{context}")
            ms = self.measure("kascade", context, batch, args, opts, cfg, floor, k)
            if ms is not None:
                gather = harness.compiled(self.xla_gather, q, k_pages, v_pages, page_table,
                                          indices, head_map)
                xla_ms = self.time(gather, q, k_pages, v_pages, page_table, indices, head_map)
                self.rows.append(harness.row("kascade/xla_gather", context=context, batch=batch,
                                             ms=xla_ms, floor=floor, peer="sparse_kernel",
                                             peer_ms=ms))
            for x in (q, k_pages, v_pages):
                x.delete()

    def xla_gather(self, q, k_pages, v_pages, page_table, indices, head_map):
        """Naive XLA: take the selected K/V rows of every KV head, then attention."""
        batch = q.shape[0]
        pos = indices[:, head_map]  # [B, HK, K]
        pages = jnp.take_along_axis(page_table[:, None, :], pos // self.p, axis=2)
        heads = jnp.arange(self.hk)[None, :, None]
        k = k_pages[pages, heads, pos % self.p]  # [B, HK, K, D]
        v = v_pages[pages, heads, pos % self.p]
        qg = q.reshape(batch, self.hk, -1, self.d)
        s = jnp.einsum("bhgd,bhkd->bhgk", qg, k, preferred_element_type=jnp.float32)
        w = jax.nn.softmax(s / np.sqrt(self.d), axis=-1)
        out = jnp.einsum("bhgk,bhkd->bhgd", w.astype(v.dtype), v)
        return out.reshape(q.shape)

    def delta(self):
        batch = 2 if self.smoke else 64
        contexts = [256, 512] if self.smoke else [32768, 131072]
        n_pages = 8 if self.smoke else 64
        cfg = KNOB_SWEEP[0]
        for context in contexts:
            self.cudnn(batch, context)
            q, k_pages, v_pages, page_table, lengths = self.cache(batch, context)
            indices, count = self.selection(batch, 1, context // self.p, n_pages)
            args = (q, k_pages, v_pages, page_table, lengths, indices, count)
            opts = {"unit": self.p}
            floor = harness.floor_ms(batch * self.hk * n_pages * self.p * 2 * self.d * BYTES)
            if context == contexts[0]:  # the same work at every context: one sweep
                cfg = self.sweep("delta", args, opts, floor, KNOB_SWEEP + SPLIT_SWEEP["delta"])
            self.measure("delta", context, batch, args, opts, cfg, floor, n_pages * self.p)
            for x in (q, k_pages, v_pages):
                x.delete()

    def batch1(self):
        contexts = [256] if self.smoke else [32768, 131072]
        n_pages = 8 if self.smoke else 64
        head_map = jnp.asarray(HEAD_MAP[:self.hk] % self.hk, jnp.int32)
        splits = [sweep_point(splits=s) for s in (1, 4, 16, 64)]
        for context in contexts:
            self.cudnn(1, context)
            q, k_pages, v_pages, page_table, lengths = self.cache(1, context)
            k = max(1, context // 10)
            for family, opts, groups, units, selected, tokens in (
                    ("delta", {"unit": self.p}, 1, context // self.p, n_pages, n_pages * self.p),
                    ("kascade", {"unit": 1, "head_map": head_map}, self.hk, context, k, k)):
                indices, count = self.selection(1, groups, units, selected)
                args = (q, k_pages, v_pages, page_table, lengths, indices, count)
                floor = harness.floor_ms(self.hk * tokens * 2 * self.d * BYTES)
                case = f"{family}/b1"
                cfg = self.sweep(case, args, opts, floor, [KNOB_SWEEP[0], *splits])
                self.measure(case, context, 1, args, opts, cfg, floor, tokens)
            for x in (q, k_pages, v_pages):
                x.delete()

    def lychee(self):
        batch, context = (2, 512) if self.smoke else (8, 131072)
        block = 2 * self.p if self.smoke else 64
        n_blocks = context // block
        k = max(1, n_blocks // 10)
        self.cudnn(batch, context)
        q, k_pages, v_pages, page_table, lengths = self.cache(batch, context)
        indices, count = self.selection(batch, self.hk, n_blocks, k)
        args = (q, k_pages, v_pages, page_table, lengths, indices, count)
        dense_counts = [0, 1] if self.smoke else [2, 0, 1, 4]  # the sweep runs at the first
        for n_dense in dense_counts:
            dense = jnp.asarray(np.arange(self.hk) < n_dense)
            tokens = n_dense * context + (self.hk - n_dense) * k * block
            floor = harness.floor_ms(batch * tokens * 2 * self.d * BYTES)
            opts = {"unit": block, "dense_heads": dense}
            if n_dense == dense_counts[0]:
                cfg = self.sweep("lychee", args, opts, floor,
                                 KNOB_SWEEP + SPLIT_SWEEP["lychee"])
            case = f"lychee/dense{n_dense}of{self.hk}"
            self.measure(case, context, batch, args, opts, cfg, floor, k * block)
            if n_dense == 0:  # no dense_heads array at all: the grid is sized for sparse work
                self.measure(case + "/no_dense_arg", context, batch, args, {"unit": block},
                             {**cfg, "split_tokens": None}, floor, k * block)
        for x in (q, k_pages, v_pages):
            x.delete()


def error_row(case, context, batch, error) -> dict:
    row = harness.row(case, context=context, batch=batch, ms=0.0,
                      error=f"{type(error).__name__}: {error}"[:300])
    row["ms"] = None
    return row


_VARIANTS = {"": "", "prior": " + RESA prior", "prior_bound": " + RESA prior, per-row bound",
             "prior@best": " + RESA prior, best tuning"}


def case_label(case: str, context: int) -> str:
    """'lychee/dense2of8+prior', 131072 -> 'Lychee hybrid, 2/8 KV heads dense + RESA prior, 128k'."""
    family, _, variant = case.partition("+")
    if family.startswith("lychee/"):
        dense = re.match(r"lychee/dense(\d+)of(\d+)", family)
        name = f"Lychee hybrid, {dense[1]}/{dense[2]} KV heads dense"
        if family.endswith("/no_dense_arg"):
            name += " (no dense-head input)"
    else:
        name = {"kascade": "Kascade reuse layer", "delta": "DELTA layer"}[family.split("/")[0]]
        if family.endswith("/b1"):
            name += " at B=1"
    size = f"{context // 1024}k" if context >= 1024 else str(context)
    return f"{name}{_VARIANTS[variant]}, {size}"


def plot(rows, path: Path, device: str, jax_version: str = jax.__version__) -> None:
    """Per case: time over the HBM floor of the bytes it gathers (at `device`'s datasheet
    bandwidth) and the speedup over cuDNN's dense attention at the same context."""
    from sparsejax.plotting import figure, save

    timed = [r for r in rows if r.get("ratio_to_floor") is not None and "/sweep" not in r["case"]
             and r["case"] != "kascade/xla_gather"]
    labels = [case_label(r["case"], r["context"]) for r in timed]
    scale, bandwidth = harness.device_floor(device)
    fig, ((ax0, ax1),) = figure(1, 2, figsize=(16, 6.5))
    # ms / floor before rounding: a smoke run's floors round to 0.0 ms
    ax0.barh(labels, [r["ratio_to_floor"] / scale for r in timed], color="tab:blue")
    ax0.axvline(1.0, color="black", lw=0.8)
    ax0.set_xlabel(f"time / HBM floor of the gathered bytes, lower is better\n(floor at {bandwidth})")
    ax1.barh(labels, [r["peer_ms"] / r["ms"] for r in timed], color="tab:green")
    ax1.set_xscale("log")
    ax1.axvline(1.0, color="black", lw=0.8)
    ax1.set_xlabel("speedup vs cuDNN dense at the same context\n(log scale)")
    ax1.set_yticks(range(len(labels)), [""] * len(labels))
    fig.suptitle(f"sparse_decode_attention, {device}, jax {jax_version}")
    save(fig, path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, CPU interpret mode")
    parser.add_argument("--families", default="kascade,delta,lychee,batch1",
                        help="comma-separated case families to run")
    args = parser.parse_args()
    if not args.smoke and jax.default_backend() != "gpu":
        raise SystemExit("needs a GPU (use --smoke on CPU)")
    bench = Bench(args.smoke)
    families = args.families.split(",")
    unknown = set(families) - FAMILIES
    if unknown:
        parser.error(f"--families {args.families}: unknown {sorted(unknown)}; expected some of "
                     f"{sorted(FAMILIES)}")
    for family in (getattr(bench, name) for name in families):
        if time.monotonic() > bench.deadline:
            print(f"!!! {family.__name__}: skipped, past the {TIME_BUDGET_S} s budget")
            bench.rows.append(error_row(family.__name__, None, None, TimeoutError("budget")))
            continue
        try:
            family()
        except Exception as e:
            traceback.print_exc()
            print(f"!!! {family.__name__}: aborted: {type(e).__name__}: {e}")
            bench.rows.append(error_row(family.__name__, None, None, e))
    harness.print_table(bench.rows, COLUMNS)
    if args.smoke:
        plot(bench.rows, Path(tempfile.mkdtemp()) / f"{NAME}.png", harness.device_name())
        return
    # a subset of the families keeps its own file: the full run's stays whole
    name = NAME if set(families) == FAMILIES else "_".join([NAME, *families])
    path = harness.write_results(harness.per_gpu_name(name), bench.rows)
    plot(bench.rows, path.with_suffix(".png"), harness.device_name())
    if os.environ.get("OUT"):
        plot(bench.rows, Path(os.environ["OUT"], path.name).with_suffix(".png"),
             harness.device_name())
    print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
