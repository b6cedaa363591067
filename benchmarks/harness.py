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
    events as (name, start_ns, duration_ns, hlo_op: the HLO instruction XLA annotated the
    launch with, or None), wall seconds of the traced calls)."""
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
                events.extend((e.name, e.start_ns, e.duration_ns, dict(e.stats).get("hlo_op"))
                              for e in line.events)
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
    for name, _, duration, _ in sorted(events, key=lambda e: e[1]):
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
    ("matmul", ("gemm", "gemv", "projection_partials", "xmma", "cutlass", "cublas", "dot",
                "matmul", "sm90", "nvjet")),
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
    by_op: dict[str, list] = {}
    for name, start, duration, op in events:
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
        # where XLA did not annotate the launch, its kernel is named after its fusion
        entry = by_op.setdefault((op or name).replace(".", "_"), [0.0, 0.0])
        entry[0] += 1 / calls
        entry[1] += duration / 1e6 / calls
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:15]
    return {"wall_ms": round(wall_ms, 4), "busy_ms": round(busy / 1e6 / calls, 4),
            "launches": len(events) / calls,
            "by_class_ms": {k: round(v, 4) for k, v in sorted(by_class.items())},
            "top": [(n, round(ms, 4)) for n, ms in top],
            "kernels": {n: (launches[n] / calls, round(by_name[n], 4))
                        for n in sorted(by_name, key=lambda n: -by_name[n])},
            "by_op": {op: (round(n, 3), round(ms, 5)) for op, (n, ms) in by_op.items()}}


_ELEMENT_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                  "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_SHAPE = re.compile(r"\b(pred|[suf]\d+|bf16|f8e\w+?)\[([\d,]*)\]")
_NO_KERNEL = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while",
              "conditional", "call", "after-all", "partition-id", "replica-id"}
_IN_PLACE = ("dynamic-update-slice", "scatter")


def shape_bytes(text: str) -> int:
    """Bytes of every array shape written in `text` (HLO syntax: bf16[8,1536]{1,0})."""
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        size = _ELEMENT_BYTES.get(dtype, 1)   # the f8 types: one byte
        for d in filter(None, dims.split(",")):
            size *= int(d)
        total += size
    return total


def _closing(text: str, start: int) -> int:
    """Index of the parenthesis closing the one at text[start]."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i
    return len(text)


def hlo_op_costs(hlo: str, charge: dict[int, int] | None = None) -> dict[str, dict]:
    """The bytes each kernel-launching instruction of an optimized HLO module moves, as a
    bandwidth floor's numerator: {name (dots as underscores, as kernels are named): {"op",
    "bytes", "op_name" (the JAX name stack)}}, over the computations that are neither fusion
    bodies nor reducers. Bytes: its operands' and results' shapes; an in-place update (a
    fusion whose body is a dynamic-update-slice or scatter, its result the shape of an
    operand) moves its other operands, read and written, and so does a kernel that updates
    operands in place (`output_to_operand_aliasing`: the cache write), plus its other
    results. A kernel that reads part of an
    operand (a sparse attention kernel's cache) is charged the whole operand, or what
    `charge` maps an operand's bytes to (a layer's share of a cache array that holds every
    layer's pages): its floor is an upper bound."""
    charge = charge or {}
    bodies, name, lines = {}, None, []
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if head and not line.startswith(" "):
            name, lines = head.group(1), []
        elif line.startswith("}") and name is not None:
            bodies[name] = lines
            name = None
        elif name is not None:
            lines.append(line)
    inner = set(re.findall(r"\b(?:calls|to_apply)=%?([\w.\-]+)", hlo))
    costs = {}
    for comp, body in bodies.items():
        if comp in inner:
            continue
        sizes = {}
        for line in body:
            m = re.match(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*", line)
            if not m:
                continue
            rest = line[m.end():]
            cut = _closing(rest, 0) + 1 if rest.startswith("(") else rest.find(" ")
            result, after = rest[:cut], rest[cut:].lstrip()
            out = sizes[m.group(1)] = shape_bytes(result)
            op = re.match(r"([\w\-]+)\(", after)
            if not op or op.group(1) in _NO_KERNEL:
                continue
            operands = after[op.end():_closing(after, op.end() - 1)]
            shapes = [sizes.get(o, 0) for o in re.findall(r"%([\w.\-]+)", operands)]
            if "output_to_operand_aliasing=" in after:
                # a kernel updating operands in place (the cache write) moves the rest
                aliasing = after[after.index("output_to_operand_aliasing="):]
                aliased = {int(i) for i in re.findall(r"\{[\d,\s]*\}:\s*\((\d+),", aliasing)}
                rest = sum(x for i, x in enumerate(shapes) if i not in aliased)
                out_rest = out - sum(shapes[i] for i in aliased if i < len(shapes))
                costs[m.group(1).replace(".", "_")] = dict(
                    op=op.group(1), bytes=2 * rest + max(out_rest, 0),
                    op_name=_op_name(after))
                continue
            if op.group(1) == "custom-call":   # a kernel reads its layer of the cache
                shapes = [charge.get(x, x) for x in shapes]
            callee = re.search(r"\bcalls=%?([\w.\-]+)", after)
            called = "\n".join(bodies.get(callee.group(1), [])) if callee else ""
            in_place = (op.group(1) in _IN_PLACE or any(f"{k}(" in called for k in _IN_PLACE))
            moved = 2 * (sum(shapes) - out) if in_place and out in shapes else sum(shapes) + out
            costs[m.group(1).replace(".", "_")] = dict(op=op.group(1), bytes=moved,
                                                       op_name=_op_name(after))
    return costs


def _op_name(instruction: str) -> str:
    found = re.search(r'op_name="([^"]*)"', instruction)
    return found.group(1) if found else ""


def out_of_memory(e: Exception) -> bool:
    """XLA's out-of-memory error (it surfaces as several exception types)."""
    text = str(e)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def refused_as_too_large(e: Exception) -> bool:
    """The library's refusal, before allocating, of a cache that does not fit (`allocate`'s
    and `generate`'s capacity checks name the free memory)."""
    return isinstance(e, ValueError) and "GiB free" in str(e)


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
    widths = {c: max([len(c)] + [len(str(r.get(c, ""))) for r in rows]) for c in cols}
    print("  ".join(c.ljust(widths[c]) for c in cols))
    for r in rows:
        print("  ".join(str(r.get(c, "")).ljust(widths[c]) for c in cols))
