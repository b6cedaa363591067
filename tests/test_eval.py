"""The eval harness on a small random Llama over the project's vocabulary: dense is its own
reference (recall 1, error 0), accuracy agrees with a direct greedy generate, a ragged last
batch is scored on its own rows; lossless mode ('+spec') on the embedded model scores dense's
accuracy with the acceptance a direct generate reports."""
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparsejax
from sparsejax import evaluation
from sparsejax import methods as M
from sparsejax.models import Model, ModelConfig, init_params
from sparsejax.train import data
from sparsejax.train.tokenizer import vocabulary

CONTEXT = 192


@pytest.fixture(scope="module")
def model():
    config = ModelConfig(model_type="llama", vocab_size=len(vocabulary()), hidden_size=64,
                         num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
                         intermediate_size=128, max_position_embeddings=512,
                         tie_word_embeddings=True)
    return Model(config, init_params(config, jax.random.key(3), jnp.float32))


def test_parse_methods():
    assert evaluation.parse_methods("dense, delta+resa,kascade") == ["dense", "delta+resa",
                                                                     "kascade"]
    with pytest.raises(ValueError, match="'dense\\+resa'"):
        evaluation.parse_methods("dense+resa")
    with pytest.raises(ValueError, match="'h2o'"):
        evaluation.parse_methods("dense,h2o")
    assert evaluation.parse_methods("delta+spec,quest+resa+spec") == ["delta+spec",
                                                                     "quest+resa+spec"]
    for bad in ("dense+spec", "delta+spec+resa", "delta+spec+spec"):
        with pytest.raises(ValueError, match=re.escape(repr(bad))):
            evaluation.parse_methods(bad)


def test_compile_generate_equals_generate(model):
    samples = [data.make_sample(t, CONTEXT, 0, i) for i, t in enumerate(data.TASKS)]
    ids, lengths = data.prompt_batch(samples)
    kw = dict(max_new_tokens=5, method=M.DELTA(budget_pages=2, recent_pages=1).scaled_to(4))
    run = sparsejax.compile_generate(model, ids, lengths=lengths, **kw)
    for rows in (slice(None), slice(None, None, -1)):      # the same shape, other prompts
        expected = sparsejax.generate(model, ids[rows], lengths=lengths[rows], **kw)
        got = run(ids[rows], lengths[rows])
        np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(expected.tokens))
    with pytest.raises(TypeError):
        sparsejax.compile_generate(model, ids, max_new_tokens=5, beams=2)


def test_evaluate(model, tmp_path):
    tasks = ("niah", "vt")
    doc = evaluation.evaluate(model, tasks=tasks, context=CONTEXT, samples=2,
                              method_names=["dense", "oracle", "delta+resa"], ratios=[0.25],
                              batch=3, progress=lambda s: None)
    results = {(r["method"], r["task"]): r for r in doc["results"]}
    assert len(doc["results"]) == 3 * 3                      # methods × (tasks + "all")
    dense = results["dense", "all"]
    assert dense["mean_recall"] == 1.0 and dense["mean_attn_error"] == 0.0
    assert dense["samples"] == 4 and dense["tokens_per_s"] > 0
    # accuracy equals a direct greedy generate on the same prompts
    prompts = [data.make_sample(t, CONTEXT, 0, i) for i in range(2) for t in tasks]
    ids, lengths = data.prompt_batch(prompts)
    out = sparsejax.generate(model, ids, lengths=lengths, max_new_tokens=data.MAX_ANSWER_TOKENS,
                             eos_token_id=data.EOS_ID)
    correct = [data.check_answer(t, s) for t, s in zip(np.asarray(out.tokens), prompts)]
    assert dense["correct"] == sum(correct)
    # the oracle attends sparsely at every layer but the first: recall in (0, 1], error >= 0
    oracle = results["oracle", "all"]
    assert oracle["sparse_layers"] and 0 < oracle["mean_recall"] <= 1.0
    assert oracle["oracle_recall_per_layer"] == pytest.approx(oracle["recall_per_layer"])
    assert results["delta+resa", "niah"]["config"]["resa_lambda"] == 1.0
    json.dumps(doc)                                          # serialisable as written
    evaluation.plot(doc, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0
    assert "delta+resa" in evaluation.table(doc)


def test_kascade_options_apply_to_kascade_only(model):
    """--sparse-prefill / --sparse-anchors change the Kascade rows (named after them) and
    nothing else; with sparse anchors its anchors after layer 0 attend sparsely, so their
    recall drops below the dense anchors' 1."""
    doc = evaluation.evaluate(model, tasks=("niah",), context=CONTEXT, samples=2,
                              method_names=["delta", "kascade"], ratios=[0.1], batch=2,
                              timing=False, sparse_anchors=True, sparse_prefill=True,
                              progress=lambda s: None)
    rows = {r["method"]: r for r in doc["results"]}
    assert set(rows) == {"delta", "kascade+sparse_prefill+sparse_anchors"}
    assert doc["sparse_anchors"] and doc["sparse_prefill"]
    plain = evaluation.evaluate(model, tasks=("niah",), context=CONTEXT, samples=2,
                                method_names=["kascade"], ratios=[0.1], batch=2,
                                timing=False, progress=lambda s: None)["results"][0]
    anchors = M.Kascade().scaled_to(model.config.num_layers).anchor_layers
    later = [a for a in anchors if a > 0]
    sparse = rows["kascade+sparse_prefill+sparse_anchors"]
    assert all(plain["recall_per_layer"][a] == pytest.approx(1.0) for a in later)
    assert all(sparse["recall_per_layer"][a] < 1 for a in later)


def test_lossless_rows_score_dense_accuracy_and_the_acceptance_of_generate():
    """StreamingLLM at a tenth of a 192-token prompt loses the needle; drafting for dense
    attention it keeps dense's accuracy, and its acceptance is what generate counts."""
    path = sparsejax.embedded_model_path()
    model = sparsejax.from_pretrained(path, dtype=jnp.float32)
    tasks, gamma = ("niah", "vt"), 3
    doc = evaluation.evaluate(model, tasks=tasks, context=CONTEXT, samples=2,
                              method_names=["dense", "streaming", "streaming+spec"],
                              ratios=[0.1], batch=4, repeats=1, draft_tokens=gamma,
                              model_dir=path, progress=lambda s: None)
    results = {(r["method"], r["task"]): r for r in doc["results"]}
    for task in (*tasks, "all"):
        dense, sparse, spec = (results[m, task] for m in ("dense", "streaming", "streaming+spec"))
        assert spec["correct"] == dense["correct"] and spec["samples"] == dense["samples"]
        assert spec["mean_recall"] is None and spec["recall_per_layer"] is None
        assert spec["draft_tokens"] == gamma and dense["acceptance_rate"] is None
    all_ = {m: results[m, "all"] for m in ("dense", "streaming", "streaming+spec")}
    assert all_["dense"]["correct"] == 4 > all_["streaming"]["correct"]     # negative control
    assert all_["streaming+spec"]["tokens_per_s"] > 0
    # the acceptance a direct lossless generate reports on the same prompts
    prompts = [data.make_sample(t, CONTEXT, 0, i) for i in range(2) for t in tasks]
    ids, lengths = data.prompt_batch(prompts)
    drafter = evaluation.build_methods(model.config, ["streaming+spec"], 0.1)
    out = sparsejax.generate(model, ids, lengths=lengths, max_new_tokens=data.MAX_ANSWER_TOKENS,
                             eos_token_id=data.EOS_ID, method=drafter["streaming+spec"],
                             draft_tokens=gamma)
    rate = float(np.sum(np.asarray(out.accepted)) / np.sum(np.asarray(out.drafted)))
    assert 0 < rate < 1
    assert all_["streaming+spec"]["acceptance_rate"] == pytest.approx(rate, abs=1e-5)
    assert all_["streaming+spec"]["accepted_per_round"] == pytest.approx(rate * gamma, abs=1e-4)
    text = evaluation.table(doc)
    assert re.search(r"streaming\+spec .* all +1\.000 +- +- +0\.\d{3} ", text), text
    with pytest.raises(ValueError, match="draft_tokens=0"):
        evaluation.evaluate(model, tasks=tasks, context=CONTEXT, samples=1, ratios=[0.1],
                            method_names=["delta+spec"], draft_tokens=0)


def test_evaluate_uses_the_calibration_shipped_beside_the_model(model, tmp_path):
    from sparsejax import artifacts as A

    (tmp_path / "calibration").mkdir()
    A.save_calibration(tmp_path / "calibration" / "delta.json", model, method="delta",
                       layers=(3,), curves={}, settings={})
    A.save_calibration(tmp_path / "calibration" / "kascade.json", model, method="kascade",
                       layers=(0, 3), head_map=np.array([[0, 1], [1, 0], [1, 1], [0, 1]]),
                       curves={}, settings={})
    kw = dict(tasks=("niah",), context=CONTEXT, samples=1, method_names=["delta", "kascade"],
              ratios=[0.25], model_dir=tmp_path, timing=False, progress=lambda s: None)
    # roles per layer (D dense, S select, R reuse): the Δ-layer and the anchors from the files
    for calibrated, want in ((True, {"delta": "DDDS", "kascade": "SRRS"}),
                             (False, {"delta": "DDSS", "kascade": "SRSS"})):
        doc = evaluation.evaluate(model, calibrated=calibrated, **kw)
        assert doc["calibrated"] == (["delta", "kascade"] if calibrated else [])
        roles = {r["method"]: r["config"]["roles"] for r in doc["results"]}
        assert roles == want, calibrated
    # a file made for other weights is an error, not silently skipped
    other = Model(model.config, init_params(model.config, jax.random.key(4), jnp.float32))
    A.save_calibration(tmp_path / "calibration" / "delta.json", other, method="delta",
                       layers=(3,), curves={}, settings={})
    with pytest.raises(ValueError, match="params_hash"):
        evaluation.evaluate(model, **kw)


def test_eval_cli_writes_json(tmp_path):
    from sparsejax import cli

    out, png = tmp_path / "eval.json", tmp_path / "eval.png"
    rc = cli.main(["eval", "--task", "niah,vt", "--context", "256", "--samples", "1",
                   "--methods", "dense,streaming+resa", "--budget-ratio", "0.25,0.5",
                   "--json", str(out), "--plot", str(png)])
    assert rc == 0 and png.stat().st_size > 0
    doc = json.loads(out.read_text())
    assert doc["model"] == str(sparsejax.embedded_model_path())
    assert {(r["method"], r["budget_ratio"], r["task"]) for r in doc["results"]} == {
        (m, b, t) for m in ("dense", "streaming+resa") for b in (0.25, 0.5)
        for t in ("niah", "vt", "all")}
    assert all(r["tokens_per_s"] > 0 for r in doc["results"])
    assert cli.main(["eval", "--budget-ratio", "0", "--samples", "1"]) == 2     # clear error


def test_eval_cli_passes_draft_tokens_to_the_lossless_methods(monkeypatch, capsys):
    from sparsejax import cli

    seen = {}

    def record(model, **kw):
        seen.update(kw)
        return {"results": []}

    monkeypatch.setattr(evaluation, "evaluate", record)
    assert cli.main(["eval", "--methods", "dense,delta+spec", "--draft-tokens", "2",
                     "--no-timing"]) == 0
    assert seen["method_names"] == ["dense", "delta+spec"] and seen["draft_tokens"] == 2
    assert cli.main(["eval", "--methods", "delta+spec", "--no-timing"]) == 0
    assert seen["draft_tokens"] == evaluation.DRAFT_TOKENS
