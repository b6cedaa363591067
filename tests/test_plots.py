"""The plots say what their data holds: a floor at the measuring device's bandwidth, integer GPU
counts, a RESA note only beside RESA methods, a CPU caveat beside CPU timings, no panel of one
bar. Each figure is caught where it would be saved and read back."""
import json
import sys
from pathlib import Path

import pytest

from sparsejax import evaluation, plotting

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import harness  # noqa: E402


@pytest.fixture
def saved(monkeypatch, tmp_path):
    """The figures the plot functions save, instead of files."""
    figures = []

    def keep(fig, path, dpi=120):
        fig.canvas.draw()
        figures.append(fig)
        return Path(path)

    monkeypatch.setattr(plotting, "save", keep)
    return figures


def titles(fig) -> list[str]:
    return [ax.get_title() for ax in fig.axes if ax.get_visible()]


def eval_doc(methods, device="cpu", acceptance=0.93):
    rows = [dict(task="all", method=m, budget_ratio=0.1, accuracy=1.0,
                 mean_recall=None if "+spec" in m else 0.4,
                 mean_attn_error=None if "+spec" in m else 0.2,
                 acceptance_rate=acceptance if "+spec" in m else None, tokens_per_s=50.0)
            for m in methods]
    return {"model": "/m/retrieval-tiny", "tasks": ["niah", "vt"], "context": 256,
            "device": device, "results": rows}


def test_eval_plot_notes_resa_only_beside_a_resa_method(saved):
    evaluation.plot(eval_doc(["dense", "delta"]), Path("a.png"))
    evaluation.plot(eval_doc(["dense", "delta", "delta+resa"]), Path("b.png"))
    without, with_resa = (fig._suptitle.get_text() for fig in saved)
    assert "RESA" not in without and "hatched: with RESA" in with_resa


def test_eval_plot_says_cpu_speed_is_not_gpu_speed(saved):
    evaluation.plot(eval_doc(["dense", "delta"], device="cpu"), Path("a.png"))
    evaluation.plot(eval_doc(["dense", "delta"], device="NVIDIA H100 80GB HBM3"), Path("b.png"))
    cpu, gpu = ([t for t in titles(fig) if t.startswith("tokens/s")] for fig in saved)
    assert cpu == ["tokens/s\nCPU: not indicative of GPU speed"] and gpu == ["tokens/s"]


def test_eval_plot_writes_a_single_acceptance_in_the_title_not_a_panel_of_one_bar(saved):
    evaluation.plot(eval_doc(["dense", "delta", "delta+spec"]), Path("a.png"))
    evaluation.plot(eval_doc(["dense", "delta+spec", "kascade+spec"]), Path("b.png"))
    one, two = saved
    assert not any("drafts accepted" in t for t in titles(one))
    assert "delta+spec: 93% of drafts accepted" in one._suptitle.get_text()
    assert "drafts accepted (+spec)" in titles(two)
    assert len(titles(one)) == 4 and len(titles(two)) == 5


def test_device_floor_uses_the_measuring_devices_bandwidth():
    scale, label = harness.device_floor("NVIDIA H100 80GB HBM3")
    assert scale == pytest.approx(4.8 / 3.35) and label.startswith("3.35 TB/s")
    assert harness.device_floor("NVIDIA H200") == (pytest.approx(1.0),
                                                   "4.80 TB/s, NVIDIA H200 datasheet")
    scale, label = harness.device_floor("NVIDIA H100 80GB HBM3", measured_tb_s=3.031)
    assert scale == pytest.approx(4.8 / 3.031) and label == "3.03 TB/s, measured"
    assert harness.device_floor("NVIDIA H100 PCIe")[0] == pytest.approx(4.8 / 2.0)
    assert "assumed" in harness.device_floor("TPU v5e")[1]


def test_decode_attention_floor_is_drawn_at_the_json_devices_bandwidth(saved):
    import bench_decode_attention

    doc = json.loads((BENCHMARKS / "results" / "decode_attention_h100.json").read_text())
    bench_decode_attention.plot(doc["rows"], Path("x.png"), doc["device"])
    (ax,) = saved[0].axes
    (floor,) = [line for line in ax.get_lines() if line.get_label().startswith("HBM floor")]
    assert "3.35 TB/s" in floor.get_label()
    # K and V of B=64, 8 KV heads, d=128, bf16 at 8k tokens over 3.35 TB/s
    assert floor.get_ydata()[0] == pytest.approx(2 * 64 * 8192 * 8 * 128 * 2 / 3.35e12 * 1e3,
                                                 rel=1e-3)


def test_tensor_parallel_plot_counts_gpus_in_integers_and_keeps_the_legend_off_the_lines(saved):
    import bench_tensor_parallel

    for name in ("tensor_parallel_h200", "tensor_parallel"):
        doc = json.loads((BENCHMARKS / "results" / f"{name}.json").read_text())
        gpus = sorted({r["tp"] for r in doc["rows"] if r["part"] == "scaling"})   # as run
        bench_tensor_parallel.plot(doc, Path("x.png"))
        ax = saved[-1].axes[1]
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks == gpus
        renderer = saved[-1].canvas.get_renderer()
        legend, frame = ax.get_legend().get_window_extent(renderer), ax.get_window_extent(renderer)
        assert legend.x0 >= frame.x1        # beside the axes, not over the lines


def test_decode_matrix_plot_of_a_run_without_dense(tmp_path):
    """A run of methods alone has no dense step to compare with: each cell shows its floor
    ratio and no speedup, where the plot used to fail on the missing speedup."""
    import bench_decode_matrix
    rows = [dict(method=m, model="qwen-1.5b", batch=1, context=t, ratio_to_floor=2.2,
                 speedup_vs_dense=None) for m in ("delta", "kascade") for t in (4096, 32768)]
    path = tmp_path / "m.png"
    bench_decode_matrix.plot(rows, dict(device="d", jax="j", date="t", bandwidth_tb_s=4.2), path)
    assert path.stat().st_size > 0
