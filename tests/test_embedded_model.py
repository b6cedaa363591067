"""The model shipped with the package: format, transformers parity, and what it can do."""
import jax.numpy as jnp
import numpy as np
import pytest

import sparsejax
from sparsejax.train import data

PATH = sparsejax.embedded_model_path()


@pytest.fixture(scope="module")
def model():
    return sparsejax.from_pretrained(PATH, dtype=jnp.float32)


def test_shipped_files(model):
    names = {p.name for p in PATH.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "README.md", "training_log.json", "training_curve.png"} <= names
    assert sum(p.stat().st_size for p in PATH.rglob("*") if p.is_file()) <= 20 * 10**6
    c = model.config
    assert c.model_type == "llama" and c.num_layers >= 8 and c.num_kv_heads < c.num_heads
    assert c.max_position_embeddings >= 4096


def test_tokenizer_round_trip():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(PATH)
    sample = data.make_sample("niah", 256, 7, 0)
    text = tok.decode(sample.input_ids, skip_special_tokens=True)
    assert not text.startswith("<s>")
    # encoding prepends <s>, as the prompts have it
    np.testing.assert_array_equal(tok(text)["input_ids"], sample.input_ids)


def test_logits_match_transformers(model):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(PATH, dtype=torch.float32).eval()
    ids = np.stack([data.make_sample(t, 512, 3, 0).input_ids for t in ("niah", "vt")])
    with torch.no_grad():
        expected = hf(torch.as_tensor(ids, dtype=torch.long)).logits.numpy()
    got = np.asarray(sparsejax.logits(model, ids))
    np.testing.assert_allclose(got, expected, atol=2e-4 * np.abs(expected).max(), rtol=0)
    np.testing.assert_array_equal(got[:, -1].argmax(-1), expected[:, -1].argmax(-1))


# What the shipped model solves at 1024 tokens: greedy exact match on 20 held-out samples per
# task, dense attention (it was trained on prompts of up to 4096 tokens).
@pytest.mark.parametrize("task", data.TASKS)
def test_dense_accuracy_at_1024(model, task):
    samples = [data.make_sample(task, 1024, 1234, i) for i in range(20)]
    ids, lengths = data.prompt_batch(samples)
    out = sparsejax.generate(model, ids, lengths=lengths, max_new_tokens=data.MAX_ANSWER_TOKENS,
                             eos_token_id=data.EOS_ID)
    correct = [data.check_answer(t, s) for t, s in zip(np.asarray(out.tokens), samples)]
    assert np.mean(correct) >= 0.9, f"{task}: {sum(correct)}/20"
