"""Tensor parallelism on 8 host devices: every method's sharded `generate` equals the unsharded
run, outputs are laid out as `sparsejax.sharding`'s table says, bad meshes are refused, and the
compiled sharded decode step holds only the collectives each method needs.

The checks run once in a subprocess (sharding_checks.py): JAX must see 8 CPU devices, which
`XLA_FLAGS` sets only before JAX starts.
"""
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

import sharding_checks as checks

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharding") / "results.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run([sys.executable, str(HERE / "sharding_checks.py"), str(out)],
                          env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """The compiled sharded decode step's collectives and top-k shapes (compiles only)."""
    out = tmp_path_factory.mktemp("collectives") / "results.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run([sys.executable, str(HERE / "sharding_checks.py"), str(out),
                           "collectives"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def _megatron(batch: int = checks.COLLECTIVE_BATCH, hidden: int = 32) -> Counter:
    """What tensor parallelism itself needs: an all-reduce of the [B, H] hidden state after
    each layer's row-parallel o-projection and down projection, and one after the
    vocabulary-sharded embedding (the logits stay split on the vocabulary)."""
    return Counter({("all-reduce", f"f32[{batch},{hidden}]"): 2 * checks.LAYERS + 1})


# Kascade's buffer: 25% of the 48-token capacity
_KASCADE_GATHER = Counter({("all-gather", f"s32[{checks.COLLECTIVE_BATCH},8,12]"): 1,
                           ("all-gather", f"s32[{checks.COLLECTIVE_BATCH},8]"): 1})


@pytest.mark.parametrize("name, extra", [
    ("dense", Counter()),
    # the max over every query head per token crosses devices at the one Δ-layer
    ("delta", Counter({("all-reduce", f"f32[{checks.COLLECTIVE_BATCH},"
                                      f"{checks.COLLECTIVE_CAPACITY}]"): 1})),
    # per-KV-head and per-query-head selections are chosen and read on their own devices
    ("lychee", Counter()), ("tidal", Counter()), ("kascade", Counter()),
    ("kascade_head_map_on_device", Counter()),
    # the last layer reads one device's set at every head: its indices and counts gathered
    ("kascade_head_map_across", _KASCADE_GATHER),
    ("kascade_sparse_anchors", _KASCADE_GATHER),
])
def test_sharded_step_collectives(compiled, name, extra):
    """Every collective in the compiled decode step on model=4 with 2 of 8 KV heads per
    device (Llama-3.1-8B at TP=4 in miniature): Megatron's all-reduces and only the ones a
    method's rules need to cross devices."""
    got = Counter(tuple(c) for c in compiled[f"collectives/{name}"])
    assert got == _megatron() + extra


def test_lychee_hybrid_layer_selects_its_retrieval_heads_per_device(compiled):
    """Layer 0 (every head retrieves) selects for a device's 2 KV heads per row; the hybrid
    layer (one retrieval head) for one per row on every device, as without a mesh, not for
    every head the device holds."""
    b, t = checks.COLLECTIVE_BATCH, checks.COLLECTIVE_CAPACITY
    assert compiled["top_k/lychee"] == [[2 * b, t], [b, t]]


def _generate_cases():
    for kv_heads, mesh_name, _, names in checks.RUNS:
        for name in names or checks.all_methods(kv_heads):
            yield f"generate/kv{kv_heads}/{mesh_name}/{name}"


def test_eight_devices(results):
    assert results["devices"] == 8


@pytest.mark.parametrize("case", list(_generate_cases()))
def test_sharded_generate_equals_unsharded(results, case):
    r = results[case]
    assert r["got"] == r["want"]
    rows = "data" if "data=" in case else None
    assert r["spec"] == [rows, None]


def test_methods_differ_from_dense(results):
    """The control that gives the equalities teeth: on these prompts and budgets the sparse
    methods pick other tokens than dense, so a sharded run that attended to other positions
    (or densely) would be caught."""
    assert len(results["kv4/differ_from_dense"]) >= 6, results["kv4/differ_from_dense"]
    assert results["kv2/differ_from_dense"] == ["delta", "kascade", "kascade_sparse_anchors"]


@pytest.mark.parametrize("mesh", list(checks.EAGER_MESHES))
@pytest.mark.parametrize("chunk", checks.EAGER_CHUNKS)
def test_eager_step_api_on_explicit_meshes(results, mesh, chunk):
    """prefill (one pass or chunked) and decode_step outside any jit on explicit meshes."""
    assert results[f"eager/{mesh}/chunk={chunk}"] < 1e-5


def test_sharded_step_matches_unsharded(results):
    """prefill + decode steps with KV heads replicated twice over model=4, data=2."""
    assert results["layout/kv_copies"] == 2
    assert results["layout/logits_max_abs_diff"] < 1e-5
    assert results["layout/cache_k_max_abs_diff"] < 1e-5
    assert results["layout/prior_o_est_max_abs_diff"] < 1e-6


def test_from_pretrained_onto_a_mesh_equals_shard(results):
    """from_pretrained(mesh=) places each weight from the host as shard() lays it out."""
    got = results["layout/from_pretrained_mesh"]
    assert got == dict(same_tree=True, max_abs_diff=0.0, different_specs=[],
                       mesh_recorded=True), got


def test_layout_table(results):
    s = results["layout/specs"]
    want = {
        "logits": ["data", "model"],
        "k": [None, "data", "model", None, None], "v": [None, "data", "model", None, None],
        "page_table": ["data", None], "lengths": ["data"],
        "prior.mu_q": [None, "data", "model", None],
        "prior.mu_k": [None, "data", None, None],        # 2 KV heads < 4 ranks: replicated
        "params.embed": ["model", None], "params.lm_head": [None, "model"],
        "params.final_norm": [None],
        # one layer's weights; q|k|v are separate under a mesh, gate|up stays fused
        "params.attn_norm": [None], "params.mlp_norm": [None],
        "params.wq": [None, "model", None], "params.wk": [None, None, None],
        "params.wv": [None, None, None], "params.wo": ["model", None, None],
        "params.w_gate_up": [None, None, "model"], "params.w_down": ["model", None],
    }
    assert s == want
    assert results["layout/kv4_wk_spec"] == [None, "model", None]
    assert results["layout/stacked_wq_spec"] == [None, None, "model", None]


@pytest.mark.parametrize("name", ["lychee", "kascade"])
def test_sharded_diagnostics_match_unsharded(results, name):
    """Recall and attention error measured under a mesh (selections gathered to the global
    view) equal the unsharded measurements; recall below 1 shows the selections are real."""
    r = results[f"diagnostics/kv2/model=4/{name}"]
    assert r["min_recall"] < 0.99
    for key in ("recall", "oracle_recall", "attn_error"):
        assert r[key] < 1e-4, (key, r)


def _path_cases():
    for path, (_, _, mesh_name) in checks.PATHS.items():
        yield f"path/{mesh_name}/{path}"
    yield "path/stacked/model=2/delta"


@pytest.mark.parametrize("case", list(_path_cases()))
def test_sharded_path_equals_unsharded(results, case):
    """Chunked / sparse prefill, correction, speculative decoding and the stacked layout."""
    assert results[case]["got"] == results[case]["want"]


@pytest.mark.parametrize("case", list(checks.FP8_RUNS))
def test_sharded_fp8_equals_unsharded(results, case):
    """An fp8 cache (scales split on the KV-head axis with the pages) under a mesh gives the
    unsharded fp8 run's tokens: one-pass and chunked prefill, Quest's bounds, RESA's prior,
    sparse anchors, sparse prefill, the speculative verify and cache correction."""
    assert results[f"fp8/{case}"]["got"] == results[f"fp8/{case}"]["want"]


def test_fp8_cache_layout(results):
    assert results["fp8/logprob_difference_from_f32"] > 1e-4
    assert results["fp8/dtypes"] == ["float8_e4m3fn", "float32"]
    assert results["fp8/specs"] == {
        "k": [None, "data", "model", None, None], "v": [None, "data", "model", None, None],
        "k_scale": [None, "data", "model", None], "v_scale": [None, "data", "model", None]}


def test_jobs_on_a_mesh_match(results):
    """Calibration (tensor parallel over 4 ranks, KV heads replicated) and gate training (over
    2) measure and train what they do without a mesh; the gates moved from their start."""
    assert results["jobs/shift_min"] > 0
    assert results["jobs/shift_max_abs_diff"] < 1e-5
    assert results["jobs/similarity_max_abs_diff"] < 1e-5
    assert results["jobs/gates_moved"] > 1e-3
    assert results["jobs/gates_mean_max_abs_diff"] < 1e-4


@pytest.mark.parametrize("case, words", [
    ("no_model_axis", ["ValueError", "'model'", "('data',)"]),
    ("heads_not_divisible", ["ValueError", "num_attention_heads=8", "size 3"]),
    ("kv_heads_cannot_replicate", ["ValueError", "num_key_value_heads=3", "size 4"]),
    ("unknown_axis", ["ValueError", "pipe"]),
    ("batch_not_divisible", ["ValueError", "batch=3", "'data'"]),
    ("not_a_mesh", ["TypeError", "jax.sharding.Mesh"]),
])
def test_bad_mesh_is_refused(results, case, words):
    message = results["errors"][case]
    assert message is not None, f"{case} was accepted"
    for word in words:
        assert word in message, message
