"""Calibration and gate files: one model fingerprint for both, checked whenever a method read
from a file is planned for a model, and the files shipped beside the embedded model match it."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparsejax
from sparsejax import artifacts as A
from sparsejax import methods as M
from sparsejax.models import ModelConfig, init_params

CFG = ModelConfig(model_type="llama", vocab_size=97, hidden_size=64, num_layers=4, num_heads=4,
                  num_kv_heads=2, head_dim=16, intermediate_size=96)
# the same shapes but for the hidden size: only the config-level fingerprint tells them apart
WIDER = dataclasses.replace(CFG, hidden_size=128)


def model(config=CFG, seed=0):
    return sparsejax.Model(config, init_params(config, jax.random.key(seed), std=0.02))


def test_fingerprint_of_config_and_model():
    m = model()
    full, shapes = A.fingerprint(m), A.fingerprint(CFG)
    assert shapes == dataclasses.replace(full, params_hash=None)
    assert len(full.params_hash) == 16
    assert full.params_hash != A.fingerprint(model(seed=1)).params_hash
    assert A.Fingerprint.from_json(json.loads(json.dumps(full.to_json()))) == full
    assert A.Fingerprint.from_json("349e3c25959b7d85") is None     # a gates/1 string: unchecked
    # a config knows no hash: it is compared on the shapes only
    assert full.differences(shapes) == []
    assert full.differences(A.fingerprint(WIDER)) == ["hidden: file 64, model 128"]


@pytest.mark.parametrize("kind", ["delta", "kascade"])
def test_calibrated_method_is_checked_when_planned(tmp_path, kind):
    path = tmp_path / f"{kind}.json"
    head_map = np.array([[0, 1], [1, 0], [0, 0], [1, 1]]) if kind == "kascade" else None
    A.save_calibration(path, model(), method=kind, layers=(0, 2) if kind == "kascade" else (2,),
                       head_map=head_map, curves={}, settings={})
    cls = M.Kascade if kind == "kascade" else M.DELTA
    method = cls.from_calibration(path)                     # no model given: not checked yet
    assert method.origin.fingerprint == A.fingerprint(model())
    assert method == cls.from_calibration(path, model=model())   # the origin is not its value
    method.to_plan(CFG)                                     # negative control: the right model
    with pytest.raises(ValueError) as e:
        method.to_plan(WIDER)
    msg = str(e.value)
    assert str(path) in msg and "hidden: file 64, model 128" in msg
    assert "'params_hash': " in msg and "'hidden': 128" in msg       # both fingerprints
    with pytest.raises(ValueError, match="hidden: file 64, model 128"):
        sparsejax.generate(model(WIDER), np.ones((1, 8), np.int32), max_new_tokens=1,
                           method=method)


def test_gate_file_is_checked_when_planned(tmp_path):
    heads = np.array([[1, 1], [0, 1], [0, 0], [1, 0]], bool)
    record = {"retrieval_heads": heads.tolist(), "fingerprint": A.fingerprint(model()).to_json()}
    path = A.save_gates(tmp_path / "gates.json", record)
    assert json.loads(path.read_text())["format"] == A.GATES_FORMAT
    got, origin = A.load_gates(path)
    np.testing.assert_array_equal(got, heads | np.array([[1], [0], [0], [0]], bool))
    assert origin.fingerprint == A.fingerprint(model())
    origin.check(model())
    with pytest.raises(ValueError, match="params_hash: file"):
        origin.check(model(seed=1))
    lychee = M.Lychee(gates=path)
    lychee.to_plan(CFG)
    with pytest.raises(ValueError, match=f"{path}.*hidden: file 64, model 128"):
        lychee.to_plan(WIDER)
    # a file of the previous format still loads; its fingerprint (another hash) is not checked
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"format": "sparsejax-gates/1", "retrieval_heads": heads.tolist(),
                               "fingerprint": "349e3c25959b7d85"}))
    assert A.load_gates(old)[1].fingerprint is None
    M.Lychee(gates=old).to_plan(WIDER)


def test_shipped_files_match_the_shipped_model():
    path = sparsejax.embedded_model_path()
    shipped = sparsejax.from_pretrained(path, dtype=jnp.bfloat16)
    want = A.fingerprint(shipped)
    origins = [A.load_calibration(path / "calibration" / f"{kind}.json", kind)["origin"]
               for kind in ("delta", "kascade")]
    origins += [A.load_gates(p)[1] for p in sorted((path / "gates").glob("*.json"))]
    assert len(origins) == 4
    for origin in origins:
        assert origin.fingerprint == want, origin.path
        origin.check(shipped)
    # the check can fail: other weights of the same shapes
    other = sparsejax.Model(shipped.config, jax.tree.map(lambda x: x[..., ::-1], shipped.params))
    with pytest.raises(ValueError, match="params_hash"):
        origins[0].check(other)
