"""The kernels on an fp8 (float8_e4m3fn) KV cache beside bf16, each against its own HBM floor.

Llama-3.1-8B's attention shapes (32 query / 8 KV heads, head_dim 128, pages of 16, bf16 q):
  dense   `paged_decode_attention` (no score), B=1 and B=64 at 8k/32k/128k (cells whose cache
          does not fit in the device's memory are listed as skipped), at the kernel's default
          knobs, and for fp8 also at twice the default block_n (the default sizes a K tile
          by q's dtype: a 1-byte tile of the same rows is half the bytes) and with q in
          float16 (the fp8 tiles then convert to f16 for the dots instead of bf16): the
          `@q=f16` row is what a bf16 model runs (`cache.query_dtype`).
  kascade `sparse_decode_attention`, Kascade's reuse layer: B=64, 10% of the tokens per KV
          head, a many-to-one head map, 32k.
  delta   `sparse_decode_attention`, DELTA's sparse layer: B=64, 64 pages of 16 shared by
          every head, 32k.
  The sparse rows' fp8 cases take q in float16, as a bf16 model runs them.
Every row at full context, the page table a random permutation of the page pool. The fp8
cache is the bf16 cache's distribution quantized per (page, KV head, slot) as the runtime
does (`quantize_kv`). Each kernel is first checked against its reference on the first rows
(the fp8 one on the cache dequantized in f32); a wrong case is reported and not timed.

`ms` is GPU time per call (`harness.device_time_ms`). `floor_ms` is the bytes the kernel must
read (K and V of the attended tokens; with fp8 also their float32 scales) over the device's
bandwidth measured as a device-to-device copy (`bench_decode_matrix.copy_bandwidth`);
`speedup_vs_bf16` is the bf16 row's ms over this one's at the same cell.

  python benchmarks/bench_fp8.py            # GPU -> results/fp8.json (fp8_h100.json on an H100)
  python benchmarks/bench_fp8.py --smoke    # tiny shapes, CPU interpret mode (~1 minute)
  python benchmarks/bench_fp8.py --sparse-knobs   # the sparse rows' knobs on fp8 (GPU)
"""
from __future__ import annotations

import argparse
import functools
import gc
import itertools
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")  # B=64 x 128k: 34 GB of bf16

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import harness  # noqa: E402
from bench_decode_attention import CHECK_ROWS, make_paged  # noqa: E402
from bench_decode_matrix import copy_bandwidth  # noqa: E402
from bench_sparse_attention import HEAD_MAP, Bench  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from kernel_checks import max_row_rel_error, quantize_kv  # noqa: E402

from sparsejax.cache import query_dtype  # noqa: E402
from sparsejax.pallas_kernels.decode_attention import (  # noqa: E402
    default_tuning, paged_decode_attention, paged_decode_attention_reference)
from sparsejax.pallas_kernels.sparse_attention import (  # noqa: E402
    sparse_decode_attention, sparse_decode_attention_reference)

NAME = "fp8"
FULL = dict(q_heads=32, kv_heads=8, head_dim=128, page_size=16, batches=(1, 64),
            contexts=(8192, 32768, 131072), sparse_batch=64, sparse_context=32768,
            delta_pages=64)
SMOKE = dict(q_heads=8, kv_heads=2, head_dim=64, page_size=16, batches=(2,),
             contexts=(256,), sparse_batch=2, sparse_context=256, delta_pages=4)
SCALE_BYTES = 4  # one float32 scale per (token, KV head) of K and of V
OUT_TOL, LSE_TOL = 2e-2, 1e-2  # bf16 rounding of the dequantized tiles included (see tests)
# --sparse-knobs: the sparse kernel's knobs swept on the fp8 cache (its default tuning's pick
# is the sweep's row at the defaults)
SPARSE_KNOBS = dict(block_n=(32, 64, 128), num_warps=(2, 4), num_stages=(2, 3, 4))
COLUMNS = ("case", "context", "batch", "ms", "floor_ms", "ratio_to_floor", "speedup_vs_bf16",
           "out_err")


def cache_bytes(tokens: int, cfg, kv_dtype: str) -> int:
    """K + V bytes of `tokens` (token, KV head) rows: fp8 adds a float32 scale per row."""
    rows = tokens * cfg["kv_heads"]
    per_row = cfg["head_dim"] * (1 if kv_dtype == "fp8" else 2)
    return 2 * rows * (per_row + (SCALE_BYTES if kv_dtype == "fp8" else 0))


@functools.partial(jax.jit, static_argnums=1)
def quantize_pages(pages, slices: int):
    """quantize_kv over the page pool in `slices` pieces: no float32 copy of the whole cache."""
    n = pages.shape[0]
    parts = jax.lax.map(quantize_kv, pages.reshape(slices, n // slices, *pages.shape[1:]))
    return tuple(x.reshape(n, *x.shape[2:]) for x in parts)


def to_fp8(k_pages, v_pages) -> dict:
    """The bf16 pages as an fp8 cache (dict of k_pages, v_pages, k_scale, v_scale); the bf16
    pages are deleted."""
    slices = 1
    while k_pages.shape[0] % (2 * slices) == 0 and k_pages.size // slices > 2**27:
        slices *= 2
    k, k_scale = quantize_pages(k_pages, slices)
    v, v_scale = quantize_pages(v_pages, slices)
    k_pages.delete()
    v_pages.delete()
    return dict(k_pages=k, v_pages=v, k_scale=k_scale, v_scale=v_scale)


def first_rows(page_table, lengths, cache: dict, rows: int):
    """The first `rows` rows on a cache of only their pages (the references gather in f32)."""
    used = page_table[:rows]
    small = {name: x[used.reshape(-1)] for name, x in cache.items()}
    table = jnp.arange(used.size, dtype=jnp.int32).reshape(used.shape)
    return table, lengths[:rows], small


def errors(got, want) -> dict:
    """The kernel's first rows (those the reference ran) against the reference (out_err 0 for
    the scores pass alone, which has no output)."""
    rows = want.lse.shape[0]
    out_err = 0.0 if want.out is None else max_row_rel_error(got.out[:rows], want.out)
    return dict(out_err=round(out_err, 6),
                lse_err=round(float(jnp.max(jnp.abs(got.lse[:rows] - want.lse))), 6))


class Fp8Bench:
    def __init__(self, smoke: bool, name: str = NAME):
        self.smoke = smoke
        self.interpret = smoke
        self.cfg = dict(SMOKE if smoke else FULL)
        self.sparse = Bench(smoke)  # its random caches and selections, at these heads
        self.sparse.hq, self.sparse.hk = self.cfg["q_heads"], self.cfg["kv_heads"]
        self.sparse.d, self.sparse.p = self.cfg["head_dim"], self.cfg["page_size"]
        self.bandwidth = 1e11 if smoke else copy_bandwidth()
        memory = (jax.devices()[0].memory_stats() or {}).get("bytes_limit", 0)
        self.memory = int(memory) or (1 << 34)
        self.name = harness.per_gpu_name(name)
        self.rows = harness.Rows(self.name, write=not smoke)   # a cut-off run keeps its rows
        self.skipped: list[dict] = []
        self.failures: list[dict] = []
        print(f"bandwidth {self.bandwidth / 1e12:.3f} TB/s (copy), memory "
              f"{self.memory / 2**30:.1f} GiB", flush=True)

    def time(self, fn, *args) -> float:
        if self.smoke:
            return harness.time_ms(fn, *args, calls=1, repeats=1, warmup=1)
        return harness.device_time_ms(fn, *args)

    def floor(self, num_bytes: int) -> float:
        return num_bytes / self.bandwidth * 1e3

    def record(self, case, context, batch, kv_dtype, num_bytes, fn, args, err, bf16_ms=None,
               **extra):
        """Times `fn(*args)` and appends its row; returns the ms."""
        ms = self.time(fn, *args)
        speedup = None if bf16_ms is None else round(bf16_ms / ms, 3)
        self.rows.append(harness.row(case, context=context, batch=batch, ms=ms,
                                     floor=self.floor(num_bytes), kv_dtype=kv_dtype,
                                     bytes=num_bytes, speedup_vs_bf16=speedup, **err, **extra))
        return ms

    def checked(self, case, context, got, want) -> dict | None:
        """Errors of the kernel against its reference; None (recorded) when out of tolerance."""
        err = errors(got, want)
        print(f"  check {case} @ {context}: {err}", flush=True)
        if err["out_err"] <= OUT_TOL and err["lse_err"] <= LSE_TOL:
            return err
        print(f"!!! {case} @ {context}: FAILED THE CHECK; not timed", flush=True)
        self.failures.append(dict(case=case, context=context, **err))
        return None

    # --- the dense paged decode kernel ---------------------------------------------------
    def dense(self, batch: int, context: int):
        cfg = self.cfg
        # the bf16 cache, then beside it the fp8 one it is quantized into
        need = cache_bytes(batch * context, cfg, "bf16") * 1.6
        if need > self.memory:
            print(f"dense B={batch} @ {context}: skipped, needs ~{need / 2**30:.0f} GiB")
            self.skipped.append(dict(case="dense", batch=batch, context=context,
                                     bytes_needed=int(need)))
            return
        shape = dict(batch=batch, **{n: cfg[n] for n in ("q_heads", "kv_heads", "head_dim",
                                                         "page_size")})
        q, k, v, page_table, lengths = make_paged(jax.random.key(context + batch),
                                                  tuple(sorted(shape.items())), context)
        rows = min(batch, CHECK_ROWS)

        def kernel(q, **tuning):
            return harness.compiled(lambda q, pt, ln, c: paged_decode_attention(
                q, page_table=pt, lengths=ln, **c, backend="pallas", interpret=self.interpret,
                **tuning), q, page_table, lengths, cache)

        def reference(cache):
            table, lens, small = first_rows(page_table, lengths, cache, rows)
            return jax.jit(lambda q, pt, ln, c: paged_decode_attention_reference(
                q, page_table=pt, lengths=ln, **c))(q[:rows], table, lens, small)

        cache = dict(k_pages=k, v_pages=v)
        fn = kernel(q)
        err = self.checked("dense/bf16", context, fn(q, page_table, lengths, cache),
                           reference(cache))
        bf16_ms = None
        if err:
            bf16_ms = self.record("dense/bf16", context, batch, "bf16",
                                  cache_bytes(batch * context, cfg, "bf16"), fn,
                                  (q, page_table, lengths, cache), err)
        del fn
        cache = to_fp8(k, v)
        del k, v
        gc.collect()
        want = reference(cache)
        base = default_tuning(batch, cfg["kv_heads"], cfg["head_dim"], cfg["page_size"],
                              context // cfg["page_size"], jnp.bfloat16,
                              kv_dtype=cache["k_pages"].dtype)
        # q in float16 too: e4m3 converts to f16 in one instruction a pair on sm_90, to bf16
        # through f32, so the dots may be cheaper in f16 (q's values fit its range)
        variants = [("dense/fp8", q, {}), ("dense/fp8@q=f16", q.astype(jnp.float16), {})]
        if not self.smoke:  # the smoke run checks the plumbing, not the knobs
            variants.append((f"dense/fp8@block_n={2 * base['block_n']}", q,
                             dict(block_n=2 * base["block_n"])))
        for label, q_in, tuning in variants:
            try:
                fn = kernel(q_in, **tuning)
                got = fn(q_in, page_table, lengths, cache)
                err = self.checked(label, context, got, want)
                if err:
                    self.record(label, context, batch, "fp8",
                                cache_bytes(batch * context, cfg, "fp8"), fn,
                                (q_in, page_table, lengths, cache), err, bf16_ms,
                                tuning={**base, **tuning})
            except Exception as e:  # one variant failing to build must not end the run
                traceback.print_exc()
                self.failures.append(dict(case=label, context=context, batch=batch,
                                          error=f"{type(e).__name__}: {e}"[:300]))
        for x in cache.values():
            x.delete()
        gc.collect()

    # --- the sparse (gather) kernel --------------------------------------------------------
    def sparse_case(self, family: str, kv_dtypes=("bf16", "fp8"), knobs: dict | None = None):
        """`family`'s sparse layer on each cache of `kv_dtypes`, at the kernel's default knobs
        or at `knobs` (the row then names them)."""
        cfg, bench = self.cfg, self.sparse
        knobs = knobs or {}
        batch, context = cfg["sparse_batch"], cfg["sparse_context"]
        q, k, v, page_table, lengths = bench.cache(batch, context)
        if family == "kascade":
            kept = max(1, context // 10)
            indices, count = bench.selection(batch, cfg["kv_heads"], context, kept)
            opts = dict(unit=1, head_map=jnp.asarray(HEAD_MAP[:cfg["kv_heads"]]
                                                     % cfg["kv_heads"], jnp.int32))
            tokens = batch * kept
        else:  # delta: pages shared by every head
            indices, count = bench.selection(batch, 1, context // cfg["page_size"],
                                             cfg["delta_pages"])
            opts = dict(unit=cfg["page_size"])
            tokens = batch * cfg["delta_pages"] * cfg["page_size"]

        def kernel():
            return harness.compiled(lambda q, pt, ln, idx, cnt, c: sparse_decode_attention(
                q, page_table=pt, lengths=ln, indices=idx, count=cnt, **c, **opts, **knobs,
                backend="pallas", interpret=self.interpret), *args(cache))

        def args(cache):   # the queries' dtype the runtime reads this cache with
            qq = q.astype(query_dtype(cache["k_pages"].dtype, q.dtype))
            return qq, page_table, lengths, indices, count, cache

        def reference(cache):
            rows = min(batch, CHECK_ROWS)
            table, lens, small = first_rows(page_table, lengths, cache, rows)
            return jax.jit(lambda q, pt, ln, idx, cnt, c: sparse_decode_attention_reference(
                q, page_table=pt, lengths=ln, indices=idx, count=cnt, **c, **opts))(
                    q[:rows], table, lens, indices[:rows], count[:rows], small)

        bf16_ms = None
        for kv_dtype in kv_dtypes:
            case = f"{family}/{kv_dtype}" + "".join(f"@{k_}={v_}" for k_, v_ in knobs.items())
            cache = dict(k_pages=k, v_pages=v) if kv_dtype == "bf16" else to_fp8(k, v)
            try:
                fn = kernel()
                got = fn(*args(cache))
                err = self.checked(case, context, got, reference(cache))
                if err:
                    ms = self.record(case, context, batch, kv_dtype,
                                     cache_bytes(tokens, cfg, kv_dtype), fn, args(cache), err,
                                     bf16_ms, **{k_: v_ for k_, v_ in opts.items()
                                                 if k_ == "unit"}, **knobs)
                    bf16_ms = ms if kv_dtype == "bf16" else bf16_ms
            except Exception as e:
                traceback.print_exc()
                self.failures.append(dict(case=case, context=context, batch=batch,
                                          error=f"{type(e).__name__}: {e}"[:300]))
        for x in to_delete(cache, q):
            x.delete()
        gc.collect()


def to_delete(cache: dict, *more):
    return [x for x in (*cache.values(), *more) if not x.is_deleted()]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sparse-knobs", action="store_true",
                        help="instead: the sparse cases on fp8 over SPARSE_KNOBS -> "
                             "results/sparse_knobs_fp8.json")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on CPU in interpret mode; results go to a temp dir")
    args = parser.parse_args(argv)
    if not (args.smoke or jax.default_backend() == "gpu"):
        raise SystemExit("needs a GPU; use --smoke to exercise the script on CPU")
    if args.smoke:
        harness.RESULTS = Path(tempfile.mkdtemp(prefix="bench_fp8_"))
    start = time.perf_counter()
    bench = Fp8Bench(args.smoke, "sparse_knobs_fp8" if args.sparse_knobs else NAME)
    if args.sparse_knobs:
        for family, (block_n, num_warps, num_stages) in itertools.product(
                ("kascade", "delta"), itertools.product(*SPARSE_KNOBS.values())):
            bench.sparse_case(family, ("fp8",), dict(block_n=block_n, num_warps=num_warps,
                                                     num_stages=num_stages))
    else:
        for batch in bench.cfg["batches"]:
            for context in bench.cfg["contexts"]:
                bench.dense(batch, context)
                print(f"dense B={batch} @ {context} done ({time.perf_counter() - start:.0f}s)",
                      flush=True)
        for family in ("kascade", "delta"):
            bench.sparse_case(family)
            print(f"{family} done ({time.perf_counter() - start:.0f}s)", flush=True)
    rows = list(bench.rows)
    shape = {n: bench.cfg[n] for n in ("q_heads", "kv_heads", "head_dim", "page_size")}
    path = harness.write_results(
        bench.name, rows, shape=shape,
        q_dtype="bfloat16; float16 in the @q=f16 rows and the sparse fp8 rows (cache.query_dtype)",
        bandwidth_tb_s=round(bench.bandwidth / 1e12, 3),
        bandwidth_source="device-to-device copy (bytes read + written)",
        skipped=bench.skipped, failures=bench.failures,
        seconds=round(time.perf_counter() - start, 1))
    harness.print_table(rows, COLUMNS)
    print(f"wrote {path}")
    if bench.failures:
        print(f"!!! {len(bench.failures)} failure(s): {bench.failures}")
        raise SystemExit(1)


if __name__ == "__main__":
    main()
