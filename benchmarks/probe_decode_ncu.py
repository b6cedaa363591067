"""The dense decode kernel under Nsight Compute: what limits it, instruction by instruction.

    python benchmarks/probe_decode_ncu.py             # GPU, ncu on PATH -> results/decode_ncu.json

For each case (Llama-3.1-8B heads: fp8 at B=1 x 128k and B=64 x 32k, bf16 at B=1 x 128k) the
script runs itself under `ncu --clock-control none` twice on one launch of
`paged_decode_attention` at the default knobs: once for the sections (throughput, occupancy,
scheduler, warp states, launch), once for the per-instruction SASS counts, which it sums by
opcode per warp and key block (the loop runs ceil(context / block_n / splits) blocks a
program; 98% of the instructions sit in it); it times the kernel in its own process (CUPTI,
`harness.device_time_ms`). The fp8 kernel's V tile is read as 16-bit pairs of columns
(`common.value_pairs`); results/decode_ncu.json also keeps the profile of the byte-read tile
before it and the conversion variants tried then.

    python benchmarks/probe_decode_ncu.py run --kv-dtype fp8 --batch 1 --context 131072
        (the kernel a few times: what ncu profiles; --time: its GPU time)
"""
from __future__ import annotations

import argparse
import collections
import csv
import hashlib
import io
import json
import os
import subprocess
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # ncu's child allocates too

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import harness  # noqa: E402
import shapes  # noqa: E402
from bench_decode_attention import make_paged  # noqa: E402
from bench_fp8 import to_fp8  # noqa: E402

from sparsejax.pallas_kernels import common  # noqa: E402
from sparsejax.pallas_kernels.decode_attention import (  # noqa: E402
    default_tuning, paged_decode_attention)

CASES = (("fp8", 1, 131072), ("bf16", 1, 131072), ("fp8", 64, 32768))
SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats", "SchedulerStats", "WarpStateStats",
            "InstructionStats")
METRICS = ("Duration", "DRAM Throughput", "Memory Throughput", "Compute (SM) Throughput",
           "Issue Slots Busy", "Executed Ipc Active", "Registers Per Thread",
           "Dynamic Shared Memory Per Block", "Block Limit Registers", "Block Limit Shared Mem",
           "Theoretical Occupancy", "Achieved Occupancy", "Achieved Active Warps Per SM",
           "Eligible Warps Per Scheduler", "No Eligible", "Warp Cycles Per Issued Instruction",
           "Executed Instructions", "Grid Size", "Block Size")
def _inputs(kv_dtype: str, batch: int, context: int):
    heads = shapes.MODELS["llama-8b"]
    cfg = dict(batch=batch, q_heads=heads["num_heads"], kv_heads=heads["num_kv_heads"],
               head_dim=heads["head_dim"], page_size=16)
    q, k, v, page_table, lengths = make_paged(jax.random.key(context + batch),
                                              tuple(sorted(cfg.items())), context)
    if kv_dtype == "fp8":  # as the runtime reads an fp8 cache of a bf16 model
        return q.astype(jnp.float16), page_table, lengths, to_fp8(k, v)
    return q, page_table, lengths, dict(k_pages=k, v_pages=v)


def _compiled(q, page_table, lengths, cache):
    return harness.compiled(lambda q, pt, ln, c: paged_decode_attention(
        q, page_table=pt, lengths=ln, **c, backend="pallas").out, q, page_table, lengths, cache)


def run(kv_dtype: str, batch: int, context: int, time: bool = False):
    """The kernel a few times; with `time` its GPU time and a digest of its output on one
    line of JSON."""
    q, page_table, lengths, cache = _inputs(kv_dtype, batch, context)
    fn = _compiled(q, page_table, lengths, cache)
    for _ in range(4):
        out = jax.block_until_ready(fn(q, page_table, lengths, cache))
    if time:
        ms = harness.device_time_ms(fn, q, page_table, lengths, cache)
        digest = hashlib.sha256(np.asarray(out.astype(jnp.float32)).tobytes()).hexdigest()
        print(json.dumps(dict(ms=round(ms, 4), digest=digest[:16])), flush=True)


def _ncu(args: list[str], case) -> str:
    kv_dtype, batch, context = case
    cmd = ["ncu", "--clock-control", "none", "-k", "regex:paged_decode_attention",
           "--launch-skip", "2", "--launch-count", "1", "--csv", *args, sys.executable,
           os.path.abspath(__file__), "run", "--kv-dtype", kv_dtype, "--batch", str(batch),
           "--context", str(context)]
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout


def _csv_rows(text: str, first: str) -> list[dict]:
    lines = text[text.index(f'"{first}"'):] if f'"{first}"' in text else ""
    return list(csv.DictReader(io.StringIO(lines)))


def sections(case) -> dict:
    out = _ncu([a for s in SECTIONS for a in ("--section", s)] + ["--page", "details"], case)
    got = {}
    for r in _csv_rows(out, "ID"):
        if r["Metric Name"] in METRICS:
            unit = r["Metric Unit"].strip()
            key = r["Metric Name"] + (f" ({unit})" if unit else "")
            got[key] = float(r["Metric Value"].replace(",", ""))
    return got


def opcode_mix(case, loop_blocks: int, warps: int) -> dict:
    """SASS instructions executed per warp and key block, by opcode (modifiers kept)."""
    out = _ncu(["--section", "SourceCounters", "--page", "source", "--print-source", "sass"],
               case)
    per_op = collections.Counter()
    for r in _csv_rows(out, "Address"):
        words = r["Source"].split()
        if words:
            per_op[words[1] if words[0].startswith("@") else words[0]] += int(
                r["Instructions Executed"])
    per = warps * loop_blocks
    return {"total_per_warp_block": round(sum(per_op.values()) / per, 1),
            "top": {op: round(n / per, 1) for op, n in per_op.most_common(24)}}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mode", nargs="?", choices=("all", "run"), default="all")
    p.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="fp8")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--time", action="store_true", help="with run: print its GPU time")
    a = p.parse_args()
    if a.mode == "run":
        return run(a.kv_dtype, a.batch, a.context, a.time)
    rows = []
    for case in CASES:
        kv_dtype, batch, context = case
        q, page_table, lengths, cache = _inputs(*case)
        heads, pages = shapes.MODELS["llama-8b"], cache["k_pages"]
        knobs = default_tuning(batch, heads["num_kv_heads"], heads["head_dim"], pages.shape[2],
                               context // pages.shape[2], q.dtype, kv_dtype=pages.dtype,
                               wide_offsets=common.wide_offsets(pages))
        fn = _compiled(q, page_table, lengths, cache)
        ms = harness.device_time_ms(fn, q, page_table, lengths, cache)
        for x in (*cache.values(), q):  # the profiled child allocates its own
            x.delete()
        blocks = common.cdiv(common.cdiv(context, knobs["block_n"]), knobs["num_splits"])
        warps = batch * heads["num_kv_heads"] * knobs["num_splits"] * knobs["num_warps"]
        row = harness.row(f"llama-8b/{kv_dtype}", context=context, batch=batch,
                          ms=ms, knobs=knobs, loop_blocks=blocks,
                          ncu=sections(case), sass=opcode_mix(case, blocks, warps))
        rows.append(row)
        print(row, flush=True)
    harness.print_table(rows, cols=("case", "context", "batch", "ms"))
    harness.write_results(harness.per_gpu_name("decode_ncu"), rows, ncu=subprocess.run(
        ["ncu", "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
