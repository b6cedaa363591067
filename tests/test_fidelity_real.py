"""benchmarks/fidelity_real.py runs every context and task through one decode shape: prompt keys
right-padded past the prompt width (lengths unchanged). The table is only right if the padding
changes nothing: the same tokens and per-layer diagnostics as decoding at the prompt's own
width, for a token-unit and a page-unit method at a ratio budget."""
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from small_model import CFG, LENGTHS

import sparsejax
from sparsejax import methods as M

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import fidelity_real  # noqa: E402

STEPS = 6


@pytest.mark.parametrize("method", [
    M.Kascade(anchor_layers=(0, 3), ratio=0.1, min_k=8),
    M.Quest(ratio=0.2, page_size=16)], ids=["kascade", "quest"])
def test_padded_prompt_cache_decodes_as_the_prompt_width(model, prompts, method):
    plan = method.to_plan(CFG)
    lengths = LENGTHS
    decoded = {}
    for width in (prompts.shape[1], prompts.shape[1] + 3 * 16 + 5):
        out, first, lens = fidelity_real._prompt_cache(model, prompts, lengths, width)
        assert out.keys.shape[2] == width
        decoder = fidelity_real.Decoder(model, out, first, lens, plan, STEPS)
        tokens, diag = decoder(model, out, first, lens)
        decoded[width] = (np.asarray(tokens), {k: np.asarray(v) for k, v in diag.items()})
    (narrow, d_narrow), (wide, d_wide) = decoded.values()
    np.testing.assert_array_equal(wide, narrow)
    for key in ("recall", "oracle_recall", "attn_error"):
        np.testing.assert_allclose(d_wide[key], d_narrow[key], atol=2e-5, err_msg=key)
    assert d_narrow["recall"].min() < 0.999       # the budget really left keys out


def test_decoding_in_row_groups_matches_one_group(model, prompts):
    """A Decoder given too little memory for every row at once decodes them in groups (one
    row at a time here) with the same tokens and diagnostics."""
    plan = M.Kascade(anchor_layers=(0, 3), ratio=0.1, min_k=8).to_plan(CFG)
    out, first, lens = fidelity_real._prompt_cache(model, prompts, LENGTHS, prompts.shape[1])
    whole = fidelity_real.Decoder(model, out, first, lens, plan, STEPS)
    grouped = fidelity_real.Decoder(model, out, first, lens, plan, STEPS, memory=1)
    assert (whole.rows, grouped.rows) == (len(LENGTHS), 1)
    (t1, d1), (t2, d2) = whole(model, out, first, lens), grouped(model, out, first, lens)
    np.testing.assert_array_equal(np.asarray(t2), np.asarray(t1))
    for key in fidelity_real.DIAGNOSTICS:
        np.testing.assert_allclose(np.asarray(d2[key]), np.asarray(d1[key]), atol=2e-5)


def test_step_bucket():
    class Sample:
        def __init__(self, n):
            self.max_new_tokens = n
    assert fidelity_real._step_bucket([Sample(9), Sample(16)]) == 16
    assert fidelity_real._step_bucket([Sample(17)]) == 32
    assert fidelity_real._step_bucket([Sample(43), Sample(3)]) == 48


def test_row_chunks_of_the_forward_match_one_batch(model, prompts, monkeypatch):
    """The forward in row chunks (bounding the attention scores) equals one batch."""
    monkeypatch.setattr(fidelity_real, "FORWARD_SCORES", prompts.shape[1] ** 2)  # 1 row a chunk
    whole = fidelity_real._forward(model, jnp.asarray(prompts), jnp.asarray(LENGTHS))
    out, first, _ = fidelity_real._prompt_cache(model, prompts, LENGTHS, prompts.shape[1])
    np.testing.assert_array_equal(np.asarray(first), np.asarray(whole[1]))
    np.testing.assert_allclose(np.asarray(out.keys), np.asarray(whole[0].keys), atol=1e-5)


def test_decoder_with_an_fp8_cache_decodes_as_generate(model, prompts):
    """`--kv-dtype fp8`: the table's Decoder stores the prompt's K/V in fp8 and decodes the
    same tokens as `generate` with kv_dtype="fp8" (its one-pass prefill writes the same
    quantized cache)."""
    method = M.Kascade(anchor_layers=(0, 3), ratio=0.1, min_k=8)
    plan = method.to_plan(CFG)
    out, first, lens = fidelity_real._prompt_cache(model, prompts, LENGTHS, prompts.shape[1])
    decoder = fidelity_real.Decoder(model, out, first, lens, plan, STEPS, kv_dtype="fp8")
    cache = decoder.start(model, out, lens)
    assert cache.k.dtype == jnp.float8_e4m3fn
    tokens, _ = decoder(model, out, first, lens)
    reference = sparsejax.generate(model, prompts, lengths=LENGTHS, max_new_tokens=STEPS,
                                   method=method, prefill_chunk=0, kv_dtype="fp8")
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(reference.tokens))


def test_compare_counts_cells_within_a_point():
    def doc(kv_dtype, scores):
        return {"kv_dtype": kv_dtype, "results": [
            {"method": m, "budget_ratio": r, "context": 2048, "task": "niah",
             "accuracy": float(np.mean(s)), "scores": s, "mean_attn_error": 0.1}
            for (m, r), s in scores.items()]}
    base = doc("bf16", {("dense", None): [1, 1, 0, 1], ("delta", 0.1): [1, 0, 0, 1]})
    fp8 = doc("fp8", {("dense", None): [1, 1, 0, 1], ("delta", 0.1): [0, 1, 0, 1],
                      ("kascade", 0.1): [1, 1, 1, 1]})
    got = fidelity_real.compare(base, fp8)
    assert [(c["method"], c["points"], c["prompts_changed"], c["meets"]) for c in got["cells"]] \
        == [("dense", 0.0, 0, True), ("delta", 0.0, 2, True)]   # kascade: no base cell
    fp8["results"][1]["scores"] = [1, 1, 0, 1]
    fp8["results"][1]["accuracy"] = 0.75
    got = fidelity_real.compare(base, fp8)
    assert got["cells"][1]["points"] == 25.0 and not got["cells"][1]["meets"]
    assert got["target"]["met"] == 1 and got["target"]["of"] == 2
