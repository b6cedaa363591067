"""Redraw the plots of benchmarks/results/ from their JSON files (no measurement; CPU is enough).

    python benchmarks/replot.py
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_decode_attention  # noqa: E402
import bench_decode_step  # noqa: E402
import bench_prefill  # noqa: E402
import bench_sparse_attention  # noqa: E402
import fidelity  # noqa: E402
from harness import RESULTS  # noqa: E402


def main() -> int:
    def load(name):
        return json.loads((RESULTS / f"{name}.json").read_text())

    doc = load("decode_attention")
    bench_decode_attention.plot(doc["rows"], RESULTS / "decode_attention.png", doc["device"])
    doc = load("decode_step")
    bench_decode_step.plot(doc["rows"], RESULTS / "decode_step.png", doc["device"])
    doc = load("sparse_attention")
    bench_sparse_attention.plot(doc["rows"], RESULTS / "sparse_attention.png", doc["device"],
                                doc["jax_version"])
    bench_prefill.plot(load("prefill"), RESULTS / "prefill.png")
    for path in fidelity.plot_questions(load("fidelity"), RESULTS):
        print(f"wrote {path}")
    print(f"wrote {RESULTS}/decode_attention.png, decode_step.png, sparse_attention.png, "
          "prefill.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
