"""Timing and result files shared by the benchmark scripts.

Every script writes `benchmarks/results/<name>.json` (and `$OUT/<name>.json` when OUT is set)
in one schema, so that any two runs can be compared; the single-GPU benchmarks name it
`per_gpu_name(<bench>)` (`decode_step.json` on an H200, `decode_step_h100.json` on an H100),
so that a run on another card never overwrites the reference tables:
  {"device", "jax_version", "date", "rows": [{"case", "context", "batch", "ms", "floor_ms",
   "peer", "peer_ms", "ratio_to_floor", "ratio_to_peer", ...}]}
`ratio_to_peer` = ms / peer_ms (lower is better).
"""
from __future__ import annotations

import datetime
import json
import os
import re
import statistics
import time
from pathlib import Path

import jax

HBM_BYTES_PER_S = 4.8e12  # H200 datasheet; the floor every memory-bound figure is compared to
RESULTS = Path(__file__).resolve().parent / "results"
# Datasheet HBM bandwidth by device name (first match wins), for floors drawn from a result
# file of another card than the one HBM_BYTES_PER_S describes.
DATASHEET_BYTES_PER_S = (("H100 PCIe", 2.0e12), ("H100 NVL", 3.9e12), ("H100", 3.35e12),
                         ("H200", 4.8e12))


def datasheet_bandwidth(device: str) -> float | None:
    """HBM bytes/s of `device` (a `device_kind` such as "NVIDIA H100 80GB HBM3"), None if the
    table does not know it."""
    return next((bw for name, bw in DATASHEET_BYTES_PER_S if name in device), None)


def device_floor(device: str, measured_tb_s: float | None = None) -> tuple[float, str]:
    """-> (factor, label): `floor_ms` as `floor_ms()` recorded it (at HBM_BYTES_PER_S) times
    factor is the floor at `device`'s bandwidth, the measured one when the result file has it,
    else the datasheet's; label names the number used, for a plot."""
    if measured_tb_s:
        return HBM_BYTES_PER_S / (measured_tb_s * 1e12), f"{measured_tb_s:.2f} TB/s, measured"
    bandwidth = datasheet_bandwidth(device)
    if bandwidth is None:
        return 1.0, f"{HBM_BYTES_PER_S / 1e12:.2f} TB/s, assumed ({device} not in the table)"
    return HBM_BYTES_PER_S / bandwidth, f"{bandwidth / 1e12:.2f} TB/s, {device} datasheet"


def floor_ms(num_bytes: float) -> float:
    return num_bytes / HBM_BYTES_PER_S * 1e3


def time_ms(fn, *args, calls: int = 50, repeats: int = 7, warmup: int = 3) -> float:
    """Median over `repeats` of the mean time of `calls` back-to-back asynchronous calls.

    `fn` should be jitted (ideally AOT-compiled) so that Python dispatch stays far below the
    kernel time; the queue stays full and the wall clock measures the device.
    """
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = None
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) * 1e3 / calls)
    return statistics.median(samples)


def _gpu_events(fn, calls: int, warmup: int):
    """Run `fn()` `calls` times under `jax.profiler.trace` -> (GPU kernel, memcpy and memset
    events as (name, start_ns, duration_ns), wall seconds of the traced calls)."""
    import glob
    import tempfile

    for _ in range(warmup):
        jax.block_until_ready(fn())
    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp)
        t0 = time.perf_counter()
        out = None
        for _ in range(calls):
            out = fn()
        jax.block_until_ready(out)
        wall = time.perf_counter() - t0
        jax.profiler.stop_trace()
        paths = glob.glob(os.path.join(tmp, "**", "*.xplane.pb"), recursive=True)
        if not paths:
            raise RuntimeError("jax.profiler wrote no trace")
        data = jax.profiler.ProfileData.from_file(paths[0])
    events = []
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if line.name.startswith("Stream"):  # the other lines are views of the same events
                events.extend((e.name, e.start_ns, e.duration_ns) for e in line.events)
    return events, wall


def device_time_ms(fn, *args, calls: int = 30, warmup: int = 3) -> float:
    """GPU time per call, from the profiler's records of what the device ran (CUPTI).

    Host dispatch of one executable costs ~0.03-0.05 ms on the benchmark machines, as much as
    the smallest sparse kernels: `time_ms` of back-to-back calls then measures the host, and
    only device-side timing sees the kernel. Per kernel (or memcpy/memset) name and launch
    within a call (the i-th of that name: the chunks of a prefill share a name but not their
    work), the median over calls, summed; a name whose launches do not divide evenly into the
    calls counts its median duration times its launches per call. Gaps between the launches
    of one call are not counted.
    """
    events, _ = _gpu_events(lambda: fn(*args), calls, warmup)
    if not events:
        raise RuntimeError("the profiler recorded no GPU activity (needs a GPU and CUPTI)")
    durations: dict[str, list[float]] = {}
    for name, _, duration in sorted(events, key=lambda e: e[1]):
        durations.setdefault(name, []).append(duration)
    total = 0.0
    for d in durations.values():
        per_call, extra = divmod(len(d), calls)
        if per_call and not extra:
            total += sum(statistics.median(d[i::per_call]) for i in range(per_call))
        else:
            total += statistics.median(d) * len(d) / calls
    return total / 1e6


KERNEL_CLASSES = (  # (class, substrings of kernel names), first match wins
    ("collective", ("nccl", "all_reduce", "allreduce", "all_gather", "allgather",
                    "reduce_scatter", "collective_permute")),
    ("attention", ("paged_decode", "sparse_decode", "prefill_attention", "cudnn", "flash")),
    ("topk", ("topk",)),
    ("matmul", ("gemm", "gemv", "xmma", "cutlass", "cublas", "dot", "matmul", "sm90", "nvjet")),
    ("slice_copy", ("dynamic_slice", "slice_fusion", "copy")),
    ("memcpy", ("memcpy", "memset")),
)


def kernel_class(name: str) -> str:
    low = name.lower()
    for cls, keys in KERNEL_CLASSES:
        if any(k in low for k in keys):
            return cls
    return "other"


PROFILE_REPEATS = 3  # untraced runs of `calls` calls in `profile`; it reports their median


def profile(fn, *, calls: int = 10, warmup: int = 3) -> dict:
    """Per call of `fn()`: wall ms (untraced: the median over PROFILE_REPEATS runs of
    `calls` back-to-back calls, as one slow run, 2x at times, must not set the figure),
    GPU-busy ms (the union of kernel intervals in one traced run), kernel launches, ms per
    kernel class and the heaviest kernels by name. fn() is called
    warmup + (PROFILE_REPEATS + 1) * calls times."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    runs = []
    for _ in range(PROFILE_REPEATS):
        t0 = time.perf_counter()
        out = None
        for _ in range(calls):
            out = fn()
        jax.block_until_ready(out)
        runs.append((time.perf_counter() - t0) * 1e3 / calls)
    wall_ms = statistics.median(runs)
    events, _ = _gpu_events(fn, calls, 0)
    events.sort(key=lambda e: e[1])
    busy, end = 0, None
    by_name: dict[str, float] = {}
    by_class: dict[str, float] = {}
    launches: dict[str, int] = {}
    for name, start, duration in events:
        stop = start + duration
        if end is None or start >= end:
            busy += duration
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
        by_name[name] = by_name.get(name, 0.0) + duration / 1e6 / calls
        launches[name] = launches.get(name, 0) + 1
        cls = kernel_class(name)
        by_class[cls] = by_class.get(cls, 0.0) + duration / 1e6 / calls
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:15]
    return {"wall_ms": round(wall_ms, 4), "busy_ms": round(busy / 1e6 / calls, 4),
            "launches": len(events) / calls,
            "by_class_ms": {k: round(v, 4) for k, v in sorted(by_class.items())},
            "top": [(n, round(ms, 4)) for n, ms in top],
            "kernels": {n: (launches[n] / calls, round(by_name[n], 4))
                        for n in sorted(by_name, key=lambda n: -by_name[n])}}


def compiled(fn, *args, **static):
    """AOT-compile `jax.jit(fn)` for these args: the cheapest call path for timing."""
    return jax.jit(fn, **static).lower(*args).compile()


def row(case: str, *, context: int | None, batch: int | None, ms: float | None,
        floor: float | None = None, peer: str | None = None, peer_ms: float | None = None,
        **extra) -> dict:
    """One result; ms None: the case did not run (the row says why)."""
    r = {"case": case, "context": context, "batch": batch,
         "ms": None if ms is None else round(ms, 4),
         "floor_ms": None if floor is None else round(floor, 4),
         "peer": peer, "peer_ms": None if peer_ms is None else round(peer_ms, 4),
         "ratio_to_floor": None if floor is None or ms is None else round(ms / floor, 3),
         "ratio_to_peer": None if peer_ms is None or ms is None else round(ms / peer_ms, 3)}
    r.update(extra)
    return r


def device_name() -> str:
    d = jax.devices()[0]
    return getattr(d, "device_kind", str(d))


def per_gpu_name(base: str) -> str:
    """`base` on an H200 (the reference tables), `base_<gpu>` elsewhere (base_h100 on an
    H100), so each GPU's results keep their own file."""
    kind = device_name()
    if "H200" in kind:
        return base
    gpu = re.search(r"[A-Z]\d{2,3}", kind)
    return f"{base}_{(gpu.group(0) if gpu else kind).lower().replace(' ', '_')}"


def write_results(name: str, rows: list[dict], **meta) -> Path:
    doc = {"device": device_name(), "jax_version": jax.__version__,
           "date": datetime.date.today().isoformat(), **meta, "rows": rows}
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    out = os.environ.get("OUT")
    if out:
        Path(out, f"{name}.json").write_text(json.dumps(doc, indent=2) + "\n")
    return path


def committed_rows(name: str) -> list[dict]:
    """results/<name>.json's rows as they stand (read before a partial rerun overwrites the
    file, to keep the rows it does not redo), each with the date and device it was measured on
    (a rerun may come on another GPU)."""
    path = RESULTS / f"{name}.json"
    if not path.exists():
        return []
    doc = json.loads(path.read_text())
    return [{"date": doc["date"], "device": doc["device"], **row} for row in doc["rows"]]


class Rows(list):
    """Rows printed as they come and written (partial) to results/<name>.json after each, so
    a run cut short by a time limit still shows and keeps how far it got. Every Rows of one
    name adds to the same file."""

    measured: dict[str, list] = {}

    def __init__(self, name: str, meta: dict | None = None, write: bool = True):
        super().__init__()
        self.name, self.meta, self.write = name, meta or {}, write

    def append(self, row):
        super().append(row)
        measured = Rows.measured.setdefault(self.name, [])
        measured.append(row)
        print(" ".join(f"{k}={v}" for k, v in row.items() if v is not None), flush=True)
        if self.write:
            write_results(self.name, measured, partial=True, **self.meta)


def print_table(rows: list[dict], cols=("case", "context", "batch", "ms", "floor_ms", "peer_ms",
                                        "ratio_to_floor", "ratio_to_peer")) -> None:
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols}
    print("  ".join(c.ljust(widths[c]) for c in cols))
    for r in rows:
        print("  ".join(str(r.get(c, "")).ljust(widths[c]) for c in cols))
