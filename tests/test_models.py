"""The decoder and HF loading against transformers (PyTorch, CPU, fp32)."""
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparsejax
from sparsejax.models import ModelConfig

from hf_checkpoints import CASES, NEEDS_TORCH, build, torch_logits


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for name in CASES:
        path = tmp_path_factory.mktemp(name)
        out[name] = (path, build(name, path))
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers(checkpoints, name):
    path, torch_model = checkpoints[name]
    ids = np.random.default_rng(0).integers(0, 97, (2, 21))
    model = sparsejax.from_pretrained(path, dtype=jnp.float32)
    got = np.asarray(sparsejax.logits(model, ids))
    want = torch_logits(torch_model, ids)
    assert got.dtype == np.float32 and got.shape == want.shape
    assert np.max(np.abs(got - want)) <= 1e-4


def test_sharded_checkpoint_has_index(checkpoints):
    path, _ = checkpoints["qwen2-bias-sharded"]
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1


def test_bf16_load_close_to_fp32(checkpoints):
    path, _ = checkpoints["llama-gqa-llama3rope-tied"]
    ids = np.random.default_rng(1).integers(0, 97, (2, 16))
    f32 = np.asarray(sparsejax.logits(sparsejax.from_pretrained(path, dtype=jnp.float32), ids))
    bf16_model = sparsejax.from_pretrained(path, dtype=jnp.bfloat16)
    bf16 = np.asarray(sparsejax.logits(bf16_model, ids))
    rel = np.linalg.norm(bf16 - f32) / np.linalg.norm(f32)
    assert rel <= 2e-2


def test_save_pretrained_round_trip_loads_in_transformers(checkpoints, tmp_path):
    torch = pytest.importorskip("torch", reason=NEEDS_TORCH)
    import transformers

    path, _ = checkpoints["qwen3-qknorm-headdim48"]
    model = sparsejax.from_pretrained(path, dtype=jnp.float32)
    sparsejax.save_pretrained(model, tmp_path / "out", max_shard_bytes=30_000)
    # a llama3 RoPE config writes its rope_scaling and reads back the same
    llama, _ = checkpoints["llama-gqa-llama3rope-tied"]
    llama = sparsejax.from_pretrained(llama, dtype=jnp.float32)
    sparsejax.save_pretrained(llama, tmp_path / "llama")
    assert sparsejax.from_pretrained(tmp_path / "llama").config == llama.config
    assert (tmp_path / "out" / "model.safetensors.index.json").exists()
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out",
                                                              dtype=torch.float32)
    ids = np.random.default_rng(2).integers(0, 97, (1, 12))
    np.testing.assert_allclose(torch_logits(again, ids),
                               np.asarray(sparsejax.logits(model, ids)), atol=1e-4)
    assert not list((tmp_path / "out").glob(".tmp-save-*"))


# ---- bad inputs -------------------------------------------------------------------------------
def _copy(checkpoints, name, tmp_path):
    src, _ = checkpoints[name]
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_missing_tensor_is_named(checkpoints, tmp_path):
    from safetensors.numpy import load_file, save_file

    path = _copy(checkpoints, "mistral", tmp_path)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensor 'model.layers.1.mlp.up_proj.weight'"):
        sparsejax.from_pretrained(path)


def test_extra_tensor_is_named(checkpoints, tmp_path):
    from safetensors.numpy import load_file, save_file

    path = _copy(checkpoints, "mistral", tmp_path)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.mlp.extra.weight"] = np.zeros((2, 2), np.float32)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.extra.weight"):
        sparsejax.from_pretrained(path)


def test_misshaped_tensor_is_named(checkpoints, tmp_path):
    path = _copy(checkpoints, "mistral", tmp_path)
    _edit_config(path, intermediate_size=100)
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.gate_proj.weight' has shape"):
        sparsejax.from_pretrained(path)


@pytest.mark.parametrize("changes,match", [
    ({"model_type": "gpt2"}, "model_type='gpt2'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "rope_parameters": None},
     "rope_scaling type 'yarn'"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"mlp_bias": True}, "mlp_bias"),
])
def test_unsupported_config_fields(checkpoints, tmp_path, changes, match):
    path = _copy(checkpoints, "llama-mha-linearrope", tmp_path)
    _edit_config(path, **changes)
    with pytest.raises(ValueError, match=match):
        sparsejax.from_pretrained(path)


def test_no_checkpoint_files(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises((ValueError, KeyError)):
        sparsejax.from_pretrained(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(ValueError, match="no config.json"):
        sparsejax.from_pretrained(tmp_path)


def test_mistral_sliding_window_refused_past_window(checkpoints):
    path, _ = checkpoints["mistral"]
    cfg = json.loads((path / "config.json").read_text())
    cfg["sliding_window"] = 8
    config = ModelConfig.from_hf_dict(cfg)
    model = sparsejax.Model(config=config, params=sparsejax.from_pretrained(path).params)
    with pytest.raises(ValueError, match="sliding_window=8"):
        sparsejax.logits(model, np.zeros((1, 9), np.int32))
    with pytest.raises(ValueError, match="sliding_window=8"):
        sparsejax.generate(model, np.zeros((1, 4), np.int32), max_new_tokens=5)
    sparsejax.logits(model, np.zeros((1, 8), np.int32))  # within the window: fine


def test_model_is_a_pytree_with_static_config(checkpoints):
    path, _ = checkpoints["llama-mha-linearrope"]
    model = sparsejax.from_pretrained(path, dtype=jnp.float32)
    leaves = jax.tree.leaves(model)
    assert all(isinstance(x, jax.Array) for x in leaves)
    c = model.config
    # the per-layer layout: one dict per layer, each weight its own buffer, q/k/v fused
    assert len(model.params["layers"]) == c.num_layers
    assert model.params["layers"][0]["wqkv"].shape == (c.hidden_size, c.num_heads
                                                       + 2 * c.num_kv_heads, c.head_dim)
    hash(model.config)


@pytest.mark.parametrize("spec, x_shape, w_shape, one_row", [
    ("...h,hnd->...nd", (24,), (24, 3, 8), True),       # no batch axis
    ("...h,hnd->...nd", (1, 24), (24, 3, 8), True),     # batch 1 at decode
    ("...h,hnd->...nd", (1, 1, 24), (24, 3, 8), True),
    ("...nd,ndh->...h", (1, 3, 8), (3, 8, 24), True),   # o_proj contracts two axes
    ("...h,hnd->...nd", (5, 24), (24, 3, 8), False),    # several rows: as they are
])
def test_projection_of_one_row_is_the_einsum(spec, x_shape, w_shape, one_row):
    """`_dot` sends a single row through as two (the second zeros, so that XLA takes its gemm
    path on the GPU); the row's result is the plain einsum's, bit for bit."""
    from sparsejax.models import decoder
    x = jax.random.normal(jax.random.key(0), x_shape, jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), w_shape, jnp.bfloat16)
    got = decoder._dot(spec, x, w)
    want = jnp.einsum(spec, x, w, preferred_element_type=jnp.float32).astype(x.dtype)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    padded = "pad" in str(jax.make_jaxpr(lambda a: decoder._dot(spec, a, w))(x))
    assert padded == one_row


def test_fuse_layer_on_the_host_equals_on_the_device():
    """Checkpoint layers are fused on the host (numpy in, numpy out: no device buffers freed
    between the weights) into exactly what the device fusion gives."""
    from sparsejax.models import fuse_layer, split_layer

    config = ModelConfig(model_type="qwen2", vocab_size=64, hidden_size=32, num_layers=1,
                         num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48,
                         qkv_bias=True)
    rng = np.random.default_rng(0)
    parts = {"wq": (32, 4, 8), "wk": (32, 2, 8), "wv": (32, 2, 8), "bq": (4, 8), "bk": (2, 8),
             "bv": (2, 8), "w_gate": (32, 48), "w_up": (32, 48)}
    host = {k: rng.standard_normal(s).astype(np.float32) for k, s in parts.items()}
    on_host = fuse_layer(host)
    on_device = fuse_layer({k: jnp.asarray(v) for k, v in host.items()})
    assert set(on_host) == set(on_device) == {"wqkv", "bqkv", "w_gate_up"}
    for key, w in on_host.items():
        assert isinstance(w, np.ndarray), key
        np.testing.assert_array_equal(w, np.asarray(on_device[key]))
    back = split_layer({k: jnp.asarray(v) for k, v in on_host.items()}, config)
    for key, w in host.items():
        np.testing.assert_array_equal(np.asarray(back[key]), w)
