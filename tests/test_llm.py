"""Text in, text out on the embedded model, and checkpoints named by Hub id (offline cache)."""
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparsejax
from sparsejax.models import ModelConfig, init_params, unstack_layers
from sparsejax.train import data


def test_llm_round_trip_on_the_embedded_model():
    path = sparsejax.embedded_model_path()
    tok = sparsejax.load_tokenizer(path)
    samples = [data.make_sample("niah", 96, 0, 0), data.make_sample("multikey", 160, 0, 1)]
    prompts = [tok.decode(s.input_ids[1:]) for s in samples]      # text without <s>
    assert [tok(p)["input_ids"] for p in prompts] == [s.input_ids.tolist() for s in samples]
    llm = sparsejax.LLM(path, method="delta")
    answers = [tok.decode(s.answer_ids, skip_special_tokens=True) for s in samples]
    outputs = llm.generate(prompts, sparsejax.SamplingParams(max_tokens=8))   # ragged, one batch
    assert [o.outputs[0].text for o in outputs] == answers
    # the array API on the same prompts gives the same tokens (the method is the bucket's)
    ids, lengths = data.prompt_batch(samples)
    out = sparsejax.generate(llm.model, ids, lengths=lengths, max_new_tokens=8,
                             method=llm.method_for(sparsejax.bucket_length(int(lengths.max()))))
    assert [tok.decode(t[:n], skip_special_tokens=True) for t, n in
            zip(np.asarray(out.tokens), np.asarray(out.num_generated))] == answers
    with pytest.raises(ValueError, match="'h2o'"):
        sparsejax.LLM(path, method="h2o")


def test_from_pretrained_takes_a_hub_id_from_the_offline_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    config = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
                         max_position_embeddings=256, eos_token_id=5)
    model = sparsejax.Model(config, init_params(config, jax.random.key(0), jnp.float32))
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--org--tiny"
    sparsejax.save_pretrained(model, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    shutil.copy(sparsejax.embedded_model_path() / "tokenizer.json",
                repo / "snapshots" / commit / "tokenizer.json")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    loaded = sparsejax.from_pretrained("org/tiny", dtype=jnp.float32)
    assert loaded.config == config
    want = unstack_layers(model.params)   # from_pretrained returns the per-layer layout
    assert jax.tree.structure(loaded.params) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert sparsejax.load_tokenizer("org/tiny")("the")["input_ids"]
    with pytest.raises(ValueError, match="'org/absent'"):
        sparsejax.from_pretrained("org/absent")
