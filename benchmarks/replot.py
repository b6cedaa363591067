"""Redraw the plots of benchmarks/results/ from their JSON files (no measurement; CPU is enough).

    python benchmarks/replot.py

Every PNG there is drawn from the JSON of the same run, with the device, versions and date the
JSON records, except the calibration plots: `sparsejax calibrate --plot` draws those from the
per-layer probes of the model, which the calibration JSON does not keep.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_decode_attention  # noqa: E402
import bench_decode_matrix  # noqa: E402
import bench_decode_step  # noqa: E402
import bench_prefill  # noqa: E402
import bench_sparse_attention  # noqa: E402
import bench_speculative  # noqa: E402
import bench_tensor_parallel  # noqa: E402
import fidelity  # noqa: E402
from harness import RESULTS  # noqa: E402

NOT_FROM_JSON = ("calibration_delta_shift.png", "calibration_kascade_layer_similarity.png")


def redraw(name: str, doc: dict) -> list[Path]:
    """The plots of result file `name` (stem of benchmarks/results/<name>.json)."""
    png = RESULTS / f"{name}.png"
    if name.startswith("decode_attention"):
        bench_decode_attention.plot(doc["rows"], png, doc["device"], doc.get("bandwidth_tb_s"))
    elif name.startswith("decode_matrix"):
        bench_decode_matrix.plot(doc["rows"], dict(device=doc["device"], jax=doc["jax_version"],
                                                   date=doc["date"],
                                                   bandwidth_tb_s=doc["bandwidth_tb_s"]), png)
    elif name.startswith("decode_step"):
        bench_decode_step.plot(doc["rows"], png, doc["device"])
    elif name.startswith("sparse_attention"):
        bench_sparse_attention.plot(doc["rows"], png, doc["device"], doc["jax_version"])
    elif name.startswith("prefill"):
        bench_prefill.plot(doc, png)
    elif name.startswith("speculative"):
        bench_speculative.plot(doc["rows"], png, doc["device"])
    elif name.startswith("tensor_parallel"):
        bench_tensor_parallel.plot(doc, png)
    elif name == "fidelity":
        return fidelity.plot_questions(doc, RESULTS)
    else:
        return []
    return [png]


def main() -> int:
    drawn = []
    for path in sorted(RESULTS.glob("*.json")):
        drawn += redraw(path.stem, json.loads(path.read_text()))
    for path in drawn:
        print(f"wrote {path}")
    left = sorted(p.name for p in RESULTS.glob("*.png")
                  if p not in drawn and p.name not in NOT_FROM_JSON)
    if left:
        print(f"no JSON draws {', '.join(left)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
