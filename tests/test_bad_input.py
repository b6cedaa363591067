"""Bad input gets a ValueError that names what is wrong: no hang, no silent wrong answer.

One test per kind of bad input, each asserting the exception type and that the message names
the offending argument or file, with the valid call beside it as the control where that is
cheap. Checkpoints are built the way tests/hf_checkpoints.py builds them, but tiny.
"""
import json
import logging
import math
import shutil
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
from sparsejax.plan import dense_plan
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
    """8 rows of 10**9 tokens need 954 GiB of cache even for this tiny model."""
    with pytest.raises(ValueError, match=r"KV cache of 8 rows × 1000000001 tokens needs "
                                         r"953.7 GiB; the devices have room for"):
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
                                "retrieval_heads": [[True, False], [False, True]]}))
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
