"""Bad input gets a ValueError that names what is wrong: no hang, no silent wrong answer.

One test per kind of bad input, each asserting the exception type and that the message names
the offending argument or file, with the valid call beside it as the control where that is
cheap. Checkpoints are built the way tests/hf_checkpoints.py builds them, but tiny.
"""
import dataclasses
import json
import logging
import math
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import sparsejax
from sparsejax import artifacts
from sparsejax import methods as M
from sparsejax.generate import prompt_lengths
from sparsejax.models import ModelConfig, param_shapes, save_pretrained, stack_layers
from sparsejax.plan import as_plan, dense_plan
from sparsejax.train import checkpoints, gates, pretrain
from sparsejax.train.checkpoints import CheckpointSaveError
from sparsejax.train.passkey import GateBatch

CFG = ModelConfig(model_type="llama", vocab_size=32, hidden_size=16, num_layers=2, num_heads=2,
                  num_kv_heads=1, head_dim=8, intermediate_size=32, max_position_embeddings=64)


@pytest.fixture(scope="module")
def model():
    """Random weights drawn in numpy (init_params compiles a sampler per shape: slower)."""
    rng = np.random.default_rng(0)
    return sparsejax.Model(CFG, jax.tree.map(
        lambda shape: jnp.asarray(0.1 * rng.standard_normal(shape), jnp.float32),
        param_shapes(CFG), is_leaf=lambda x: isinstance(x, tuple)))


# ---- token ids and lengths ------------------------------------------------------------------
@pytest.mark.parametrize("ids,match", [
    ([[1, 2, 32]], r"ids \[32\] outside the vocabulary \[0, 32\)"),
    ([[1, -1, 40, 40]], r"ids \[-1, 40\] outside the vocabulary"),
    ([[1.0, 2.5]], "input_ids has dtype float"),
    ([[True, False]], "input_ids has dtype bool"),
])
def test_token_ids_outside_the_vocabulary_or_not_integers(model, ids, match):
    for call in (lambda: sparsejax.generate(model, ids, max_new_tokens=1),
                 lambda: sparsejax.logits(model, ids),
                 lambda: sparsejax.prefill(model, sparsejax.allocate(CFG, 1, 8, page_size=4),
                                           ids, np.array([2]), dense_plan(CFG, 4))):
        with pytest.raises(ValueError, match=match):
            call()
    ok = sparsejax.logits(model, [[0, 31]])   # the vocabulary's edges are valid ids
    assert np.isfinite(np.asarray(ok)).all()


def test_traced_ids_are_taken_as_they_are(model):
    """Inside a jit the ids cannot be inspected (documented): only the dtype is checked."""
    out = jax.jit(lambda ids: sparsejax.logits(model, ids))(jnp.array([[1, 2]]))
    np.testing.assert_allclose(out, sparsejax.logits(model, [[1, 2]]), rtol=1e-6)
    with pytest.raises(ValueError, match="input_ids has dtype float32"):
        jax.jit(lambda ids: sparsejax.logits(model, ids))(jnp.array([[1.0, 2.0]]))


def test_float_lengths_are_refused(model):
    with pytest.raises(ValueError, match="lengths has dtype float"):
        sparsejax.generate(model, [[1, 2, 3]], lengths=[2.5], max_new_tokens=1)
    with pytest.raises(ValueError, match=r"lengths range over \[0, 3\]"):
        prompt_lengths(np.array([3, 0]), 2, 3)
    np.testing.assert_array_equal(prompt_lengths(np.array([3, 1]), 2, 3), [3, 1])


# ---- float knobs: NaN and inf ---------------------------------------------------------------
@pytest.mark.parametrize("make,match", [
    (lambda: M.RESA(M.DELTA(), lam=math.nan), "RESA lam=nan"),
    (lambda: M.RESA(M.DELTA(), lam=math.inf), "RESA lam=inf"),
    (lambda: M.RESA(M.DELTA(), lam=-1.0), "RESA lam=-1.0"),
    (lambda: M.TopP(math.nan), "budget top_p=nan"),
    (lambda: M.Threshold(math.inf), "budget threshold=inf"),
    (lambda: M.Threshold(1.5), "budget threshold=1.5"),
    (lambda: M.Ratio(math.nan), "budget ratio=nan"),
    (lambda: M.TopP(0.5, limit=0), "budget limit=0"),
    (lambda: M.Kascade(ratio=math.nan), "Kascade ratio=nan"),
    (lambda: M.OracleTopK(ratio=math.inf), "OracleTopK ratio=inf"),
    (lambda: M.Quest(token_budget=math.nan), "Quest token_budget=nan"),
])
def test_non_finite_knobs_are_refused(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_non_finite_training_knobs_are_refused(model):
    with pytest.raises(ValueError, match="minutes=nan: expected a finite value > 0"):
        pretrain.train(pretrain.recipe("tiny"), minutes=math.nan)
    with pytest.raises(ValueError, match="minutes=inf"):
        pretrain.train(pretrain.recipe("tiny"), minutes=math.inf)
    for name in ("lr", "lambda_lr"):
        with pytest.raises(ValueError, match=f"{name}=inf: expected a finite value > 0"):
            gates.train_gates(model, _RandomGateData(), **{**GATE_TRAINING, name: math.inf})
    with pytest.raises(ValueError, match=r"ratio=nan: expected a budget ratio in \(0, 1\]"):
        M.budget_ratio_methods(CFG, math.nan)


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=math.nan), "temperature=nan"),
    (dict(temperature=math.inf), "temperature=inf"),
    (dict(temperature=1.0, top_p=math.nan), "top_p=nan"),
])
def test_non_finite_sampling_is_refused(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        sparsejax.generate(model, [[1, 2]], max_new_tokens=1, rng=jax.random.key(0), **kwargs)


# ---- zero is not "use the default" ----------------------------------------------------------
@pytest.mark.parametrize("make", [
    lambda: M.DELTA(page_size=0), lambda: M.Quest(page_size=0),
    lambda: M.Kascade(anchor_layers=(0,)).to_plan(CFG, page_size=0), lambda: dense_plan(CFG, 0),
])
def test_page_size_zero_is_an_error(make):
    with pytest.raises(ValueError, match="page_size=0"):
        make()


def test_generate_page_size_zero_is_an_error(model):
    with pytest.raises(ValueError, match="page_size=0"):
        sparsejax.generate(model, [[1, 2]], max_new_tokens=1, page_size=0)
    assert dense_plan(CFG).page_size == 16      # None is the default


# ---- Lychee retrieval heads -----------------------------------------------------------------
def test_retrieval_heads_must_be_booleans():
    with pytest.raises(ValueError, match=r"retrieval_heads has dtype float64, values \[0.3, 1.0\]"):
        M.Lychee([[1.0], [0.3]])
    with pytest.raises(ValueError, match=r"values \[0, 2\]"):
        M.Lychee([[0], [2]])
    want = ((True,), (False,))
    assert M.Lychee([[True], [False]]).retrieval_heads == want
    assert M.Lychee([[1], [0]]).retrieval_heads == want


# ---- context and cache size -----------------------------------------------------------------
def test_context_past_max_position_embeddings_warns(model):
    with pytest.warns(UserWarning, match="70 tokens .* exceed the model's "
                                         "max_position_embeddings=64"):
        sparsejax.generate(model, [[1] * 10], max_new_tokens=60)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        CFG.check_context(64)     # up to the limit: no warning


def test_a_cache_that_cannot_fit_is_refused_before_allocating(model):
    """8 rows of 10**9 tokens need 954 GiB of cache even for this tiny model (the prompt of 2
    tokens is padded to its length bucket, 16)."""
    with pytest.raises(ValueError, match=r"batch=8 rows x 1000000015 tokens \(prompt 16 \+ "
                                         r"max_new_tokens 1000000000\) needs .* \(its KV cache "
                                         r"953.67 GiB.* at most batch=0 rows"):
        with pytest.warns(UserWarning):
            sparsejax.generate(model, [[1, 2]] * 8, max_new_tokens=10**9)


# ---- training checkpoints -------------------------------------------------------------------
class _RandomGateData:
    """Tiny random gate-training batches: 2 rows, 16/20-token prompts, 4 targets each."""

    def batch(self, step):
        tokens = np.random.default_rng(step).integers(0, CFG.vocab_size, (2, 24), np.int32)
        prompt = np.array([16, 20], np.int32)
        return GateBatch(tokens, prompt, prompt[:, None] + np.arange(4, dtype=np.int32),
                         np.ones((2, 4), np.float32))

    def describe(self):
        return {"kind": "random"}


# one set of settings, so that the tests share one compiled training step
GATE_TRAINING = dict(target_retrieval_heads=1, steps=4, budget=M.Ratio(0.3), sinks=2, recent=4,
                     progress=False)


def test_checkpoint_dir_that_is_a_file_stops_at_once(model, tmp_path):
    """Refused before any work; the command exits with the error (no Orbax thread left
    waiting), run as a user would, under a timeout."""
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    message = f"checkpoint_dir={str(afile)!r} is a file: expected a directory"
    done = subprocess.run([sys.executable, "-m", "sparsejax", "pretrain", "--size", "tiny",
                           "--steps", "2", "--out", str(tmp_path / "out"), "--checkpoint-dir",
                           str(afile)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert message in done.stderr and "Traceback" not in done.stderr
    with pytest.raises(ValueError, match=message):
        gates.train_gates(model, _RandomGateData(), checkpoint_dir=afile, **GATE_TRAINING)


def test_a_failing_save_stops_training_at_once(model, tmp_path):
    """The step-2 save fails (its directory has become a file): training stops there."""
    ckpt = tmp_path / "ckpt"
    seen = []

    def break_the_directory(step, metrics):
        seen.append(step)
        if step == 2:
            shutil.rmtree(ckpt)
            ckpt.write_text("")

    with pytest.raises(CheckpointSaveError, match=f"saving the step-2 checkpoint to {ckpt} "
                                                  "failed .*training stopped"):
        gates.train_gates(model, _RandomGateData(), checkpoint_dir=ckpt,
                          checkpoint_every=1, callback=break_the_directory, **GATE_TRAINING)
    assert seen == [1, 2]


def _damage(step_dir, how):
    """Damage one step directory the way a crash or a bad disk would."""
    data = max((p for p in (step_dir / "state").rglob("*") if p.is_file()),
               key=lambda p: p.stat().st_size)
    if how == "deleted":
        data.unlink()
    elif how == "truncated":
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    elif how == "bit-flipped":
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        data.write_bytes(bytes(raw))


@pytest.mark.parametrize("how", ["deleted", "truncated", "bit-flipped"])
def test_checkpoints_detect_damage(tmp_path, caplog, how):
    state = {"w": jnp.arange(512, dtype=jnp.float32), "step": jnp.int32(0)}
    manager = checkpoints.open_manager(tmp_path, 1)
    for step in (1, 2):
        checkpoints.save(manager, step, jax.tree.map(lambda x: x + step, state), {"step": step})
    _damage(tmp_path / "2", how)
    (tmp_path / "3").mkdir()    # a stray empty step directory
    with caplog.at_level(logging.WARNING):
        restored, meta = checkpoints.restore(checkpoints.open_manager(tmp_path, 1),
                                             jax.eval_shape(lambda: state),
                                             set_aside_damaged=True)
    assert meta == {"step": 1}
    np.testing.assert_array_equal(restored["w"], np.arange(512) + 1)
    log = caplog.text
    for step in (3, 2):
        assert f"checkpoint {tmp_path / str(step)} is damaged" in log
        assert (tmp_path / f"{step}.damaged").is_dir()
    assert f"using step 1 of {tmp_path}, the newest intact one" in log
    assert checkpoints.open_manager(tmp_path).all_steps() == [1]


def test_every_checkpoint_damaged_is_an_error(tmp_path):
    state = {"w": jnp.arange(512, dtype=jnp.float32)}
    checkpoints.save(checkpoints.open_manager(tmp_path, 1), 1, state, {"step": 1})
    _damage(tmp_path / "1", "deleted")
    with pytest.raises(ValueError, match=f"every checkpoint in {tmp_path} is damaged"):
        checkpoints.restore(checkpoints.open_manager(tmp_path), jax.eval_shape(lambda: state))


def test_training_resumes_from_the_newest_intact_step(model, tmp_path, caplog):
    """Steps 2 and 4 saved, step 4 bit-flipped: the resumed run retrains steps 3-4 from step 2
    and ends bitwise equal to the uninterrupted run."""
    ckpt = tmp_path / "ckpt"
    kwargs = dict(checkpoint_dir=ckpt, checkpoint_every=2, **GATE_TRAINING)
    want = gates.train_gates(model, _RandomGateData(), **kwargs)
    _damage(ckpt / "4", "bit-flipped")
    steps = []
    with caplog.at_level(logging.WARNING):
        got = gates.train_gates(model, _RandomGateData(), callback=lambda s, m: steps.append(s),
                                **kwargs)
    assert steps == [3, 4]
    assert f"checkpoint {ckpt / '4'} is damaged" in caplog.text
    assert "using step 2 of" in caplog.text
    for x, y in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ---- checkpoints on disk: every error names the file and the field ---------------------------
@pytest.fixture(scope="module")
def saved(model, tmp_path_factory):
    """The tiny model as one safetensors file and as shards with an index."""
    root = tmp_path_factory.mktemp("hf")
    return (save_pretrained(model, root / "single"),
            save_pretrained(model, root / "sharded", max_shard_bytes=2000))


def _copy(src, tmp_path):
    return Path(shutil.copytree(src, tmp_path / src.name))


def _edit_json(path, edit):
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))


def _edit_tensors(path, edit):
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_the_checkpoint_control_loads(model, saved):
    for path in saved:
        loaded = sparsejax.from_pretrained(path, dtype=jnp.float32)
        for x, y in zip(jax.tree.leaves(model.params),
                        jax.tree.leaves(stack_layers(loaded.params, CFG)), strict=True):
            np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("damage", [
    lambda b: b[: len(b) // 2], lambda b: b"garbage" * 50, lambda b: b""],
    ids=["truncated", "garbage", "empty"])
def test_damaged_safetensors_name_the_file(saved, tmp_path, damage):
    path = _copy(saved[0], tmp_path)
    file = path / "model.safetensors"
    file.write_bytes(damage(file.read_bytes()))
    with pytest.raises(ValueError, match=f"{file} is not a readable safetensors file"):
        sparsejax.from_pretrained(path)


def test_index_pointing_to_the_wrong_shard(saved, tmp_path):
    path = _copy(saved[1], tmp_path)
    index = path / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    name = "model.layers.0.input_layernorm.weight"
    other = next(f for f in sorted(set(weight_map.values())) if f != weight_map[name])
    _edit_json(index, lambda d: {**d, "weight_map": {**d["weight_map"], name: other}})
    with pytest.raises(ValueError, match=f"maps tensor '{name}' to {other}, which does not "
                                         "hold it"):
        sparsejax.from_pretrained(path)


@pytest.mark.parametrize("text,match", [
    ("{not json", "is not a JSON object: Expecting property name"),
    ("[]", "is not a JSON object"),
    ('{"weight_map": [1]}', r"has weight_map=\[1\]: expected an object"),
])
def test_malformed_index_json(saved, tmp_path, text, match):
    path = _copy(saved[1], tmp_path)
    (path / "model.safetensors.index.json").write_text(text)
    with pytest.raises(ValueError, match=f"{path / 'model.safetensors.index.json'} {match}"):
        sparsejax.from_pretrained(path)


@pytest.mark.parametrize("edit,match", [
    (lambda text: "{not json", "is not valid JSON"),
    (lambda text: "[1, 2]", "holds a list: expected a JSON object"),
    (lambda text: json.dumps({k: v for k, v in json.loads(text).items()
                              if k != "num_hidden_layers"}), r"is missing \['num_hidden_layers'\]"),
    (lambda text: json.dumps({**json.loads(text), "head_dim": 0}), "head_dim=0"),
])
def test_malformed_config_json(saved, tmp_path, edit, match):
    path = _copy(saved[0], tmp_path)
    config = path / "config.json"
    config.write_text(edit(config.read_text()))
    with pytest.raises(ValueError, match=f"{config}: .*{match}|{config} {match}"):
        sparsejax.from_pretrained(path)


def test_non_float_dtype_is_refused(saved):
    with pytest.raises(ValueError, match="dtype=int8: expected a float dtype"):
        sparsejax.from_pretrained(saved[0], dtype=jnp.int8)


def test_integer_weights_are_refused(saved, tmp_path):
    path = _copy(saved[0], tmp_path)
    _edit_tensors(path / "model.safetensors",
                  lambda t: t.update({"model.norm.weight": t["model.norm.weight"].astype(np.int32)}))
    with pytest.raises(ValueError, match="tensor 'model.norm.weight' in .* has dtype int32"):
        sparsejax.from_pretrained(path)


def test_non_finite_weights_are_named(saved, tmp_path):
    path = _copy(saved[0], tmp_path)
    name = "model.layers.1.mlp.up_proj.weight"

    def poison(t):
        t[name][3, 4] = np.nan
        t["model.norm.weight"][0] = np.inf   # read later: the first one is named

    _edit_tensors(path / "model.safetensors", poison)
    with pytest.raises(ValueError, match=f"tensor '{name}' in .* holds 1 non-finite values"):
        sparsejax.from_pretrained(path)
    loaded = sparsejax.from_pretrained(path, check_finite=False, dtype=jnp.float32)
    assert np.isnan(stack_layers(loaded.params, CFG)["layers"]["w_up"]).sum() == 1


def test_float16_overflow_is_non_finite(saved, tmp_path):
    """A weight finite in float32 but past float16's range is refused in float16."""
    path = _copy(saved[0], tmp_path)
    _edit_tensors(path / "model.safetensors",
                  lambda t: t["model.norm.weight"].__setitem__(0, 1e6))
    sparsejax.from_pretrained(path, dtype=jnp.float32)
    with pytest.raises(ValueError, match="'model.norm.weight' .* non-finite values .* in float16"):
        sparsejax.from_pretrained(path, dtype=jnp.float16)


def test_model_directory_without_tokenizer(saved):
    with pytest.raises(ValueError, match=f"{saved[0]} holds no tokenizer"):
        sparsejax.load_tokenizer(saved[0])


# ---- rope: two layouts that disagree ---------------------------------------------------------
def test_rope_parameters_and_rope_scaling_that_disagree_are_refused():
    d = CFG.to_hf_dict()
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    with pytest.raises(ValueError, match="rope_parameters .*'default'.* and the legacy "
                                         "rope_scaling .*'yarn'.* disagree"):
        ModelConfig.from_hf_dict({**d, "rope_parameters": {"rope_type": "default",
                                                           "rope_theta": 10000.0},
                                  "rope_scaling": yarn})
    linear = {"rope_type": "linear", "factor": 2.0}
    both = ModelConfig.from_hf_dict({**d, "rope_parameters": {**linear, "rope_theta": 10000.0},
                                     "rope_scaling": linear})   # agreeing: fine
    assert both.rope_scaling == ("linear", (("factor", 2.0),))
    with pytest.raises(ValueError, match="disagree"):   # the same type, another theta
        ModelConfig.from_hf_dict({**d, "rope_parameters": {**linear, "rope_theta": 5e5},
                                  "rope_scaling": linear, "rope_theta": 1e4})


# ---- gate and calibration files --------------------------------------------------------------
@pytest.mark.parametrize("text,match", [
    ("{not json", "is not valid JSON"),
    ('[1]', "is not a gate file"),
    ('{"format": "%s", "retrieval_heads": [[true, false], [true]]}',
     r"field retrieval_heads=\[\[True, False\], \[True\]\]: expected \[layers\]\[kv_heads\] "
     "booleans, every row as long"),
    ('{"format": "%s", "retrieval_heads": [[1, 0.3], [1, 0]]}', "field retrieval_heads="),
])
def test_malformed_gate_json(tmp_path, text, match):
    path = tmp_path / "gates.json"
    path.write_text(text.replace("%s", artifacts.GATES_FORMAT))
    with pytest.raises(ValueError, match=f"{path} {match}|gate file {path} {match}"):
        artifacts.load_retrieval_heads(path)
    path.write_text(json.dumps({"format": artifacts.GATES_FORMAT,
                                "retrieval_heads": [[True, False], [False, True]],
                                "fingerprint": artifacts.fingerprint(CFG).to_json()}))
    np.testing.assert_array_equal(artifacts.load_retrieval_heads(path), [[1, 1], [0, 1]])


def test_ragged_gate_tsv(tmp_path):
    path = tmp_path / "full_attention_heads.tsv"
    path.write_text("0.1\t0.9\n0.7\n")
    with pytest.raises(ValueError, match=f"gate file {path} is not a table of scores"):
        artifacts.load_retrieval_heads(path)


def test_missing_calibration_file(model, tmp_path):
    path = tmp_path / "missing.json"
    with pytest.raises(ValueError, match=f"calibration file {path} cannot be read: No such file"):
        M.DELTA.from_calibration(path, model)


def test_gates_and_calibration_files_need_their_fingerprint(model, tmp_path):
    """A file of this project's formats without its model fingerprint could be planned for any
    model: refused. (DuoAttention's TSV and the reference code's .pt carry none: read.)"""
    path = tmp_path / "gates.json"
    path.write_text(json.dumps({"format": artifacts.GATES_FORMAT,
                                "retrieval_heads": [[True, False], [False, True]]}))
    with pytest.raises(ValueError, match=f"gate file {path} has no readable model fingerprint"):
        M.Lychee(gates=str(path))
    calib = tmp_path / "delta.json"
    artifacts.save_calibration(calib, model, method="delta", layers=[1], curves={},
                               settings={})
    assert M.DELTA.from_calibration(calib, model).delta_layers == (1,)     # the control
    _edit_json(calib, lambda d: {k: v for k, v in d.items() if k != "model"})
    with pytest.raises(ValueError, match=f"calibration file {calib} has no readable model "
                                         "fingerprint"):
        M.DELTA.from_calibration(calib)


def test_nan_scores_in_a_duoattention_tsv_are_refused(tmp_path):
    path = tmp_path / "full_attention_heads.tsv"
    path.write_text("1\t1\n0.2\tnan\n0.9\t0.1\n")
    with pytest.raises(ValueError, match=r"holds 1 NaN or infinite scores \(first at layer 1, "
                                         r"KV head 1\)"):
        artifacts.load_retrieval_heads(path)
    path.write_text("1\t1\n0.2\t0.7\n0.9\t0.1\n")
    np.testing.assert_array_equal(artifacts.load_retrieval_heads(path),
                                  [[1, 1], [0, 1], [1, 0]])


# ---- method constructors --------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,match", [
    (dict(delta_layers=()), r"DELTA delta_layers=\(\): expected at least one layer"),
    (dict(delta_layers="35"), "DELTA delta_layers='35': expected a tuple of layer indices"),
    (dict(delta_layers=(2.7,)), r"DELTA delta_layers=\(2.7,\): \[2.7\] are not layer indices"),
    (dict(delta_layers=(True,)), "are not layer indices"),
    (dict(dense_layers="01"), "DELTA dense_layers='01'"),
])
def test_delta_layers_must_be_a_tuple_of_ints(kwargs, match):
    with pytest.raises(ValueError, match=match):
        M.DELTA(**kwargs)
    assert M.DELTA(delta_layers=[1, np.int64(3)]).delta_layers == (1, 3)   # lists, numpy ints


@pytest.mark.parametrize("num_layers", [0, -3, 2.0, True])
def test_scaled_to_needs_a_positive_depth(num_layers):
    for method in (M.DELTA(), M.Kascade(), M.TidalDecode()):
        with pytest.raises(ValueError, match=r"scaled_to\(num_layers="):
            method.scaled_to(num_layers)
    assert M.DELTA().scaled_to(32).delta_layers == (2, 16, 25)


def test_lychee_takes_heads_or_gates_not_both(tmp_path):
    path = tmp_path / "heads.tsv"
    path.write_text("1\t1\n0\t1\n")
    with pytest.raises(ValueError, match="Lychee got both retrieval_heads and gates="):
        M.Lychee([[True, True], [False, False]], gates=str(path))
    assert M.Lychee(gates=str(path)).retrieval_heads == ((True, True), (False, True))


# ---- config.json values ---------------------------------------------------------------------
@pytest.mark.parametrize("changes,match", [
    (dict(model_type="gpt2", hidden_size=None),
     r"model_type='gpt2' is not supported: expected one of \('llama'"),
    (dict(tie_word_embeddings="false"), "tie_word_embeddings='false': expected true or false"),
    (dict(attention_bias="no"), "attention_bias='no': expected true or false"),
    (dict(rope_theta=0), "rope_theta=0.0: expected a finite number > 0"),
    (dict(rope_theta=float("nan")), "rope_theta=nan"),
    (dict(rms_norm_eps=-1e-6), "rms_norm_eps=-1e-06"),
    (dict(max_position_embeddings=-5), "max_position_embeddings=-5: expected a positive int"),
    (dict(eos_token_id=32), r"eos_token_id=32: expected token ids in \[0, 32\)"),
    (dict(eos_token_id=2.5), "eos_token_id=2.5"),
    (dict(eos_token_id=[2, -1]), r"eos_token_id=\(2, -1\)"),
    (dict(bos_token_id=True), "bos_token_id=True"),
])
def test_config_values_are_checked(changes, match):
    d = {**CFG.to_hf_dict(), "eos_token_id": 2}
    assert ModelConfig.from_hf_dict(d).tie_word_embeddings is False       # the control
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict({**d, **changes})


def test_config_null_booleans_are_false():
    d = {**CFG.to_hf_dict(), "tie_word_embeddings": None, "attention_bias": None}
    c = ModelConfig.from_hf_dict(d)
    assert (c.tie_word_embeddings, c.o_bias) == (False, False)


# ---- generate and decode_step ---------------------------------------------------------------
def test_eos_outside_the_vocabulary_is_refused(model):
    for eos in (32, -1, 2.0, [3, 40]):
        with pytest.raises(ValueError, match=r"eos_token_id=.*: expected None, a token id"):
            sparsejax.generate(model, [[1, 2]], max_new_tokens=1, eos_token_id=eos)
    out = sparsejax.generate(model, [[1, 2]], max_new_tokens=2, eos_token_id=[31, 0])
    assert out.tokens.shape == (1, 2)


def test_top_k_and_top_p_at_temperature_zero_warn(model):
    with pytest.warns(UserWarning, match="top_k=3, top_p=None have no effect at temperature=0"):
        greedy_k = sparsejax.generate(model, [[1, 2]], max_new_tokens=3, top_k=3)
    greedy = sparsejax.generate(model, [[1, 2]], max_new_tokens=3)
    np.testing.assert_array_equal(greedy_k.tokens, greedy.tokens)


def test_decode_step_past_the_cache_capacity_is_refused(model):
    """allocate(capacity 8), prefill 8 tokens: the next step has no slot for its K/V."""
    plan = dense_plan(CFG, 4)
    cache = sparsejax.allocate(CFG, 1, 8, page_size=4, dtype=jnp.float32)
    _, full = sparsejax.prefill(model, cache, np.arange(8)[None], np.array([8]), plan)
    with pytest.raises(ValueError, match=r"a row holds 8 tokens and the cache's capacity is 8 "
                                         r"\(2 pages of 4\): no room for one more"):
        sparsejax.decode_step(model, full, np.array([3]), plan)
    _, seven = sparsejax.prefill(model, cache, np.arange(8)[None], np.array([7]), plan)
    _, after = sparsejax.decode_step(model, seven, np.array([3]), plan)   # the last slot: fine
    assert int(after.lengths[0]) == 8


@pytest.mark.parametrize("wrap,what", [(False, "Quest's page key bounds"),
                                       (True, "RESA's prior")])
def test_decode_step_without_the_plans_state_is_refused(model, wrap, what):
    """A fresh cache holds no method state: a Quest or RESA step on it is refused by name
    (it used to fail inside the step on a missing attribute), eagerly and under jit."""
    method = M.Quest(page_size=4, token_budget=8, dense_layers=1)
    plan = as_plan(M.RESA(method) if wrap else method, CFG, 4)
    cache = sparsejax.allocate(CFG, 1, 8, page_size=4, dtype=jnp.float32)
    step = jax.jit(sparsejax.decode_step, static_argnames="plan")
    for call in (sparsejax.decode_step, step):
        with pytest.raises(ValueError, match=f"reads {what} from cache.state, and the cache "
                                             "holds none: prefill it with the same plan"):
            call(model, cache, np.array([3]), plan=plan)
    _, cache = sparsejax.prefill(model, cache, np.array([[1, 2]]), np.array([2]), plan)
    sparsejax.decode_step(model, cache, np.array([3]), plan)   # prefilled: it runs


def test_decode_step_with_another_models_plan_is_refused(model):
    one_layer = dataclasses.replace(CFG, num_layers=1)
    cache = sparsejax.allocate(CFG, 1, 8, page_size=4, dtype=jnp.float32)
    _, cache = sparsejax.prefill(model, cache, np.array([[1, 2]]), np.array([2]),
                                 dense_plan(CFG, 4))
    for call in (lambda: sparsejax.decode_step(model, cache, np.array([3]),
                                               dense_plan(one_layer, 4)),
                 lambda: sparsejax.prefill(model, cache, np.array([[1, 2]]), np.array([2]),
                                           dense_plan(one_layer, 4))):
        with pytest.raises(ValueError, match="plan 'dense' has 1 layers; the model has 2"):
            call()


# ---- checkpoint paths: nothing read from outside, nothing that blocks ------------------------
def test_an_index_may_not_name_shards_outside_the_checkpoint(saved, tmp_path):
    ck = _copy(saved[1], tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    index = ck / "model.safetensors.index.json"
    for shard in ck.glob("model-*.safetensors"):
        shutil.move(shard, elsewhere / shard.name)
    want = sparsejax.from_pretrained(saved[1], dtype=jnp.float32)
    for prefix in ("../elsewhere/", f"{elsewhere}/"):
        _edit_json(index, lambda d: {**d, "weight_map": {
            k: prefix + Path(v).name for k, v in d["weight_map"].items()}})
        with pytest.raises(ValueError, match=r"resolves to .*elsewhere/model-00001.*, outside "
                                             "the checkpoint directory"):
            sparsejax.from_pretrained(ck)
        got = sparsejax.from_pretrained(ck, dtype=jnp.float32, allow_outside=True)
        np.testing.assert_array_equal(got.params["embed"], want.params["embed"])


def test_symlinks_out_of_the_checkpoint_are_refused(saved, tmp_path):
    ck = _copy(saved[0], tmp_path)
    (ck / "model.safetensors").unlink()
    (ck / "model.safetensors").symlink_to(saved[0] / "model.safetensors")
    with pytest.raises(ValueError, match="model.safetensors resolves to .*outside"):
        sparsejax.from_pretrained(ck)
    sparsejax.from_pretrained(ck, allow_outside=True)
    (ck / "inside.safetensors").symlink_to(saved[0] / "model.safetensors")
    (ck / "model.safetensors").unlink()
    shutil.copy(saved[0] / "model.safetensors", ck / "real.safetensors")
    (ck / "model.safetensors").symlink_to("real.safetensors")     # a link inside: fine
    sparsejax.from_pretrained(ck)


def test_a_fifo_in_the_checkpoint_is_refused_without_blocking(saved, tmp_path):
    import threading

    for name in ("model.safetensors", "config.json"):
        ck = _copy(saved[0], tmp_path / name)
        (ck / name).unlink()
        os.mkfifo(ck / name)
        result = {}

        def load():
            try:
                sparsejax.from_pretrained(ck)
            except ValueError as e:
                result["error"] = str(e)

        worker = threading.Thread(target=load, daemon=True)
        worker.start()
        worker.join(timeout=30)
        if worker.is_alive():     # release the reader so that the test process can end
            os.close(os.open(ck / name, os.O_WRONLY | os.O_NONBLOCK))
            pytest.fail(f"from_pretrained blocked on the FIFO {name}")
        assert f"{name}: {ck / name} is not a regular file" in result["error"]


def test_an_oversized_config_json_is_refused_before_reading(saved, tmp_path):
    ck = _copy(saved[0], tmp_path)
    with open(ck / "config.json", "r+b") as f:
        f.truncate(17 << 20)     # sparse: 17 MiB without writing them
    with pytest.raises(ValueError, match=r"config.json holds 17.0 MiB: expected at most 16 MiB"):
        sparsejax.from_pretrained(ck)


# ---- outputs: devices, FIFOs, links, one path for two outputs, interrupted runs ---------------
def test_outputs_refuse_devices_fifos_and_directories(tmp_path):
    from sparsejax.files import check_outputs, check_writable, write_text_atomic

    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match=f"--json {fifo} is a FIFO: expected a regular file"):
        check_writable(fifo, "--json")
    with pytest.raises(ValueError, match="is a FIFO"):
        write_text_atomic(fifo, "x")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    with pytest.raises(ValueError, match="is a character device"):
        check_writable("/dev/null", "--json")
    if os.geteuid() == 0:      # a device node of our own, so that a regression harms nothing
        dev = tmp_path / "null"
        os.mknod(dev, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        with pytest.raises(ValueError, match="is a character device"):
            write_text_atomic(dev, "x")
        assert stat.S_ISCHR(os.lstat(dev).st_mode)
    with pytest.raises(ValueError, match="--json and --plot both name"):
        check_outputs({"--json": tmp_path / "a", "--plot": tmp_path / "." / "a"})
    assert check_outputs({"--json": tmp_path / "a", "--plot": None}) == {"--json": tmp_path / "a"}


def test_outputs_write_through_a_symlink(tmp_path):
    from sparsejax.files import check_outputs, write_text_atomic

    target = tmp_path / "target.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target.name)
    write_text_atomic(link, "new")
    assert link.is_symlink() and target.read_text() == "new"
    with pytest.raises(ValueError, match="both name"):       # the link and its target: one file
        check_outputs({"--json": link, "--plot": target})


def test_output_directories_are_tried_before_the_work(tmp_path):
    from sparsejax.files import check_writable

    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(ValueError, match=f"--out {afile}: {afile} is a file, expected a "
                                         "directory"):
        check_writable(afile, "--out", directory=True)
    with pytest.raises(ValueError, match="--out /proc/sparsejax-out: cannot write in /proc"):
        check_writable("/proc/sparsejax-out", "--out", directory=True)
    assert check_writable(tmp_path / "new" / "dir", "--out", directory=True)
    assert list(tmp_path.iterdir()) == [afile]         # the write test leaves nothing behind


def test_an_interrupted_run_replaces_no_output(tmp_path):
    from sparsejax import files

    path = tmp_path / "results.json"
    path.write_text("complete")
    with files.handle_signals():
        with pytest.raises(files.Interrupted) as stopped:
            files.write_atomic(path, lambda tmp: (tmp.write_text("partial"),
                                                  signal.raise_signal(signal.SIGTERM)))
        assert files.interrupted() and stopped.value.status == 143
        files.mark_handled()
    assert path.read_text() == "complete" and list(tmp_path.iterdir()) == [path]
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL       # restored
    # the signal stopped that block only: a later write in the process replaces its file
    assert not files.interrupted()
    files.write_text_atomic(path, "later")
    assert path.read_text() == "later"


def test_an_interrupt_lost_in_a_gc_callback_prints_no_traceback(capsys, monkeypatch):
    """The signal's exception raised inside a gc callback (JAX has one) is ignored by Python,
    which prints its traceback; the watcher raises it again, so only other exceptions print."""
    import gc

    from sparsejax import files

    def callback(phase, info):
        if phase == "start":
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(sys, "unraisablehook", sys.__unraisablehook__)   # Python's, not pytest's
    with files.handle_signals():
        gc.callbacks.append(callback)
        try:
            gc.collect()
        finally:
            gc.callbacks.remove(callback)
        assert files.interrupted()
        files.mark_handled()
    assert "Traceback" not in capsys.readouterr().err
    assert sys.unraisablehook is sys.__unraisablehook__        # restored


def test_write_errors_name_the_path(tmp_path, monkeypatch):
    import errno

    from sparsejax.files import strerror_of, write_text_atomic

    def full(self, *a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(OSError) as e:
        write_text_atomic(tmp_path / "r.json", "x")
    assert strerror_of(e.value) == (f"{tmp_path / 'r.json'}: No space left on device: the disk "
                                    "is full; free space or write elsewhere")


# ---- the command line: one line per failure, flags that would do nothing ----------------------
def _cli(capsys, *argv):
    from sparsejax import cli

    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, err


@pytest.mark.parametrize("argv,match", [
    (["generate", "--prompt", "x", "--top-k", "5"],
     "--top-k 5 only shape sampling, and --temperature 0"),
    (["generate", "--prompt", "x", "--top-p", "0.5", "--top-k", "2"], "--top-k 2 and --top-p 0.5"),
    (["generate", "--prompt", "x", "--seed", "99999999999999999999"],
     r"--seed 99999999999999999999: expected an integer in \[-2\*\*63"),
    (["eval", "--methods", ""], "--methods '': expected at least one of"),
    (["eval", "--task", " , "], "--task ' , ': expected some of"),
    (["eval", "--json", "SAME", "--plot", "SAME"], "--json and --plot both name"),
    (["pretrain", "--steps", "1", "--workers", "-1", "--out", "OUT"], "--workers -1: expected"),
])
def test_cli_refuses_in_one_line_before_loading(capsys, tmp_path, argv, match):
    argv = [str(tmp_path / a) if a in ("SAME", "OUT") else a for a in argv]
    rc, err = _cli(capsys, *argv)
    assert rc == 2 and re.search(match, err), err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_cli_failures_are_one_line_and_debug_shows_the_traceback(capsys, tmp_path, monkeypatch):
    from sparsejax import cli

    def broken(args):
        raise OSError(28, "No space left on device", str(tmp_path / "x.json"))

    monkeypatch.setattr(cli, "cmd_generate", broken)
    parser = cli.build_parser
    monkeypatch.setattr(cli, "build_parser", lambda: _with_func(parser(), broken))
    rc, err = _cli(capsys, "generate", "--prompt", "x")
    assert rc == 1 and err.strip() == (f"sparsejax generate: error: {tmp_path / 'x.json'}: No "
                                       "space left on device: the disk is full; free space or "
                                       "write elsewhere")
    rc, err = _cli(capsys, "generate", "--prompt", "x", "--debug")
    assert rc == 1 and "Traceback" in err and err.strip().endswith("write elsewhere")


def _with_func(parser, func):
    sub = next(a for a in parser._actions if a.dest == "command")
    sub.choices["generate"].set_defaults(func=func)
    return parser
