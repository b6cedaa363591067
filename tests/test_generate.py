"""Paged cache, prefill/decode and generate() against transformers and the full forward."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparsejax
from sparsejax import cache as kv
from sparsejax.plan import dense_plan

from hf_checkpoints import NEEDS_TORCH, build


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    torch_model = build("llama-gqa-llama3rope-tied", path)
    return sparsejax.from_pretrained(path, dtype=jnp.float32), torch_model


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    torch_model = build("qwen3-qknorm-headdim48", path)
    return sparsejax.from_pretrained(path, dtype=jnp.float32), torch_model


def ragged(lengths, vocab=97, seed=0):
    rng = np.random.default_rng(seed)
    ids = np.zeros((len(lengths), max(lengths)), np.int32)
    for i, n in enumerate(lengths):
        ids[i, :n] = rng.integers(0, vocab, n)
    return ids, np.asarray(lengths, np.int32)


@pytest.mark.parametrize("which", ["llama", "qwen3"])
def test_greedy_matches_transformers(request, which):
    torch = pytest.importorskip("torch", reason=NEEDS_TORCH)

    model, torch_model = request.getfixturevalue(which)
    ids, lengths = ragged([5, 19, 11])
    out = sparsejax.generate(model, ids, lengths=lengths, max_new_tokens=32)
    assert out.tokens.shape == (3, 32) and out.tokens.dtype == jnp.int32
    for i, n in enumerate(lengths):
        with torch.no_grad():
            want = torch_model.generate(torch.tensor(ids[i:i + 1, :n], dtype=torch.long),
                                        max_new_tokens=32, min_new_tokens=32, do_sample=False)
        np.testing.assert_array_equal(np.asarray(out.tokens[i]), want[0, n:].numpy())
    np.testing.assert_array_equal(np.asarray(out.num_generated), [32, 32, 32])


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_decode_logits_equal_full_forward(llama, page_size):
    """Prompts of P-1, P and P+1 tokens, then decode steps across further page boundaries."""
    model, _ = llama
    P = page_size
    prompt_lengths = [max(P - 1, 1), P, P + 1]
    steps = P + 2
    total = max(prompt_lengths) + steps
    rng = np.random.default_rng(3)
    seq = rng.integers(0, 97, (3, total)).astype(np.int32)
    full = np.asarray(sparsejax.logits(model, seq))

    plan = dense_plan(model.config, P)
    cache = kv.allocate(model.config, 3, total, page_size=P, dtype=jnp.float32)
    lengths = np.asarray(prompt_lengths, np.int32)
    prompt = np.where(np.arange(max(prompt_lengths))[None] < lengths[:, None],
                      seq[:, :max(prompt_lengths)], 0)
    logits, cache = jax.jit(sparsejax.prefill, static_argnames="plan")(
        model, cache, prompt, lengths, plan=plan)
    rows = np.arange(3)
    np.testing.assert_allclose(np.asarray(logits), full[rows, lengths - 1], atol=1e-4)
    step = jax.jit(sparsejax.decode_step, static_argnames="plan")
    for s in range(steps):
        pos = lengths + s
        logits, cache = step(model, cache, seq[rows, pos], plan=plan)
        np.testing.assert_allclose(np.asarray(logits), full[rows, pos], atol=1e-4,
                                   err_msg=f"step {s}")
    np.testing.assert_array_equal(np.asarray(cache.lengths), lengths + steps)


@pytest.mark.parametrize("method", [None, "kascade"])
def test_batch_of_one_steps_as_two_rows(llama, method, monkeypatch):
    """A batch of one carries a zero second row through its layers (`layers.TWO_ROW_STEP`):
    its logits equal the full forward and the one-row step's, the cache it writes is the
    one-row step's, and Kascade's diagnostics (the layer's input among them) are one row."""
    from sparsejax import layers, methods
    from sparsejax.plan import as_plan
    model, _ = llama
    rng = np.random.default_rng(5)
    n, steps = 21, 4
    seq = rng.integers(0, 97, (1, n + steps)).astype(np.int32)
    full = np.asarray(sparsejax.logits(model, seq))[0]
    plan = as_plan(None if method is None else methods.Kascade(k=4, min_k=4), model.config, 4)

    def run(two_rows):
        monkeypatch.setattr(layers, "TWO_ROW_STEP", two_rows)
        cache = kv.allocate(model.config, 1, n + steps, page_size=4, dtype=jnp.float32)
        _, cache = sparsejax.prefill(model, cache, seq[:, :n], np.asarray([n]), plan=plan)
        out = []
        for s in range(steps):
            logits, cache, diag = sparsejax.decode_step(model, cache, seq[:, n + s], plan=plan,
                                                        diagnostics=True)
            assert logits.shape == (1, model.config.vocab_size)
            out.append(np.asarray(logits[0]))
        return np.stack(out), cache, diag

    assert layers._two_rows(model, 1) and not layers._two_rows(model, 2)

    got, got_cache, diag = run(True)
    want, want_cache, _ = run(False)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    if method is None:
        np.testing.assert_allclose(got, full[n:n + steps], atol=1e-4)
    for a, b in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    assert diag["hidden"].shape[1] == 1 and diag["recall"].shape[1] == 1


def test_batch_of_one_projects_a_small_model_as_partials(tmp_path, monkeypatch):
    """On the Pallas path a batch-1 step of a small model (Qwen2: q/k/v bias) runs its four
    projections as split-K partials (`layers.PARTIAL_QKV_MAX_BYTES`, the pre-norm inside the
    kernel; `PARTIAL_MLP_MAX_BYTES`): the same tokens' logits and cache as XLA's projections,
    to bf16 rounding."""
    from sparsejax import layers
    from sparsejax.pallas_kernels import gemv
    from sparsejax.pallas_kernels.common import use_backend
    build("qwen2-bias-sharded", tmp_path, hidden_size=128, num_attention_heads=2,
          num_key_value_heads=1, intermediate_size=192)
    model = sparsejax.from_pretrained(tmp_path, dtype=jnp.bfloat16)
    assert model.config.qkv_bias and model.config.head_dim == 64
    plan = dense_plan(model.config, 16)
    seq = np.random.default_rng(6).integers(0, 97, (1, 24)).astype(np.int32)
    calls = []
    partials = gemv.projection_partials
    monkeypatch.setattr(gemv, "projection_partials", lambda x, w, **k: calls.append(
        (x.shape, w.shape, "norm" if k.get("norm") is not None else "")) or partials(x, w, **k))

    def run(qkv_bytes, mlp_bytes):
        monkeypatch.setattr(layers, "PARTIAL_QKV_MAX_BYTES", qkv_bytes)
        monkeypatch.setattr(layers, "PARTIAL_MLP_MAX_BYTES", mlp_bytes)
        cache = kv.allocate(model.config, 1, 32, page_size=16, dtype=jnp.bfloat16)
        _, cache = sparsejax.prefill(model, cache, seq[:, :20], np.asarray([20]), plan=plan)
        out = []
        with use_backend("pallas"):
            for s in range(4):
                logits, cache = sparsejax.decode_step(model, cache, seq[:, 20 + s], plan=plan)
                out.append(np.asarray(logits[0], np.float32))
        return np.stack(out), cache

    qkv_max, mlp_max = layers.PARTIAL_QKV_MAX_BYTES, layers.PARTIAL_MLP_MAX_BYTES
    want, want_cache = run(0, 0)
    assert calls == []
    for qkv_bytes, mlp_bytes, layer_calls in (
            (qkv_max, 0, [((2, 128), (128, 256), "norm")]),
            # o takes the attention's one row, the MLP both rows of the step
            (0, mlp_max, [((1, 128), (128, 128), ""), ((2, 128), (128, 384), ""),
                          ((2, 192), (192, 128), "")])):
        calls.clear()
        got, got_cache = run(qkv_bytes, mlp_bytes)
        assert calls == layer_calls * 4 * model.config.num_layers
        scale = np.abs(want).max()
        np.testing.assert_allclose(got, want, atol=2**-6 * scale)
        np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))
        for a, b in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache)):
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            np.testing.assert_allclose(a, b, atol=2**-6 * max(np.abs(b).max(), 1))


def test_cache_is_paged_through_the_table(llama):
    """A shuffled page table gives the same logits as the identity one."""
    model, _ = llama
    plan = dense_plan(model.config, 4)
    ids, lengths = ragged([7, 10], seed=5)
    base = kv.allocate(model.config, 2, 16, page_size=4, dtype=jnp.float32)
    perm = np.random.default_rng(0).permutation(base.num_pages).astype(np.int32)
    shuffled = base.replace(page_table=jnp.asarray(perm.reshape(base.page_table.shape)))
    outs = []
    for c in (base, shuffled):
        _, c = sparsejax.prefill(model, c, ids, lengths, plan)
        logits, c = sparsejax.decode_step(model, c, jnp.array([3, 4]), plan)
        outs.append(np.asarray(logits))
    np.testing.assert_allclose(outs[0], outs[1], atol=1e-5)


def test_eos_stops_rows(llama):
    model, _ = llama
    ids, lengths = ragged([6, 9, 4], seed=1)
    free = sparsejax.generate(model, ids, lengths=lengths, max_new_tokens=12)
    eos = int(free.tokens[1, 3])   # row 1 emits this at step 3
    out = sparsejax.generate(model, ids, lengths=lengths, max_new_tokens=12, eos_token_id=eos)
    toks, num = np.asarray(out.tokens), np.asarray(out.num_generated)
    for i in range(3):
        row = np.asarray(free.tokens[i])
        hits = np.flatnonzero(row == eos)
        stop = hits[0] + 1 if hits.size else 12
        assert num[i] == stop
        np.testing.assert_array_equal(toks[i, :stop], row[:stop])
        assert (toks[i, stop:] == eos).all()
    assert num[1] <= 4


def test_sampling(llama):
    model, _ = llama
    ids, lengths = ragged([6, 9], seed=2)
    greedy = sparsejax.generate(model, ids, lengths=lengths, max_new_tokens=8)
    top1 = sparsejax.generate(model, ids, lengths=lengths, max_new_tokens=8, temperature=0.7,
                              top_k=1, rng=jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(top1.tokens), np.asarray(greedy.tokens))
    a = sparsejax.generate(model, ids, lengths=lengths, max_new_tokens=8, temperature=1.5,
                           top_p=0.9, rng=jax.random.key(1))
    b = sparsejax.generate(model, ids, lengths=lengths, max_new_tokens=8, temperature=1.5,
                           top_p=0.9, rng=jax.random.key(1))
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    c = sparsejax.generate(model, ids, lengths=lengths, max_new_tokens=8, temperature=1.5,
                           rng=jax.random.key(2))
    assert not np.array_equal(np.asarray(a.tokens), np.asarray(c.tokens))


def test_sample_top_p_keeps_the_nucleus():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    seen = set()
    for s in range(200):
        seen.add(int(sparsejax.sample(logits, jax.random.key(s),
                                      sparsejax.Sampling(1.0, None, 0.75))[0]))
    assert seen == {0, 1}


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_new_tokens=0), "max_new_tokens=0"),
    (dict(max_new_tokens=4, temperature=-1.0), "temperature=-1.0"),
    (dict(max_new_tokens=4, temperature=1.0), "rng="),
    (dict(max_new_tokens=4, top_k=0), "top_k=0"),
    (dict(max_new_tokens=4, top_p=1.5), "top_p=1.5"),
    (dict(max_new_tokens=4, page_size=3), "page_size=3"),
    (dict(max_new_tokens=4, page_size=512), "page_size=512"),
    (dict(max_new_tokens=4, lengths=np.array([0, 3])), "lengths range"),
    (dict(max_new_tokens=4, lengths=np.array([3, 9])), "lengths range"),
    (dict(max_new_tokens=4, lengths=np.array([3])), "lengths has shape"),
])
def test_generate_bad_inputs(llama, kwargs, match):
    model, _ = llama
    with pytest.raises(ValueError, match=match):
        sparsejax.generate(model, np.zeros((2, 5), np.int32), **kwargs)


def test_prompt_larger_than_cache_refused_before_compute(llama):
    model, _ = llama
    cache = kv.allocate(model.config, 1, 10, page_size=4)   # 3 pages = 12 tokens
    with pytest.raises(ValueError, match="needs 13 tokens per row but the cache holds 12"):
        sparsejax.prefill(model, cache, np.zeros((1, 13), np.int32), np.array([13]),
                          dense_plan(model.config, 4))


def test_page_sizes_power_of_two_up_to_256(llama):
    model, _ = llama
    for p in (1, 2, 256):
        assert kv.allocate(model.config, 1, 5, page_size=p).page_size == p
    for p in (0, 3, 512):
        with pytest.raises(ValueError, match=f"page_size={p}"):
            kv.allocate(model.config, 1, 5, page_size=p)


def test_attention_mask_left_padding_equals_right_padding(llama):
    model, _ = llama
    ids, lengths = ragged([5, 19, 11])
    T = ids.shape[1]
    left, left_mask = np.zeros_like(ids), np.zeros_like(ids)
    for i, n in enumerate(lengths):
        left[i, T - n:], left_mask[i, T - n:] = ids[i, :n], 1
    right_mask = (np.arange(T) < lengths[:, None]).astype(np.int32)
    method = sparsejax.methods.DELTA(budget_pages=1, recent_pages=1, delta_layers=(1,),
                                     dense_layers=(0,))
    for m in (None, method):
        kw = dict(max_new_tokens=10, method=m, eos_token_id=())
        want = sparsejax.generate(model, ids, lengths=lengths, **kw)
        for x, mask in ((left, left_mask), (ids, right_mask)):
            got = sparsejax.generate(model, x, attention_mask=mask, **kw)
            np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
        # negative control: the left-padded rows read without their mask are other prompts
        unmasked = sparsejax.generate(model, left, **kw)
        assert not np.array_equal(np.asarray(unmasked.tokens), np.asarray(want.tokens))
    holed = left_mask.copy()
    holed[1, T - 3] = 0
    for kwargs, match in ((dict(attention_mask=holed), r"rows \[1\] are not one run"),
                          (dict(attention_mask=left_mask * 2), "0s and 1s"),
                          (dict(attention_mask=left_mask[:, 1:]), "shape"),
                          (dict(attention_mask=left_mask, lengths=lengths), "not both")):
        with pytest.raises(ValueError, match=match):
            sparsejax.generate(model, left, max_new_tokens=2, **kwargs)


def test_eos_defaults_to_the_checkpoints_generation_config(llama, tmp_path):
    import json

    model, _ = llama
    ids, lengths = ragged([5, 19, 11])
    kw = dict(lengths=lengths, max_new_tokens=12)
    free = sparsejax.generate(model, ids, eos_token_id=(), **kw)
    eos = int(free.tokens[1, 3])       # row 1 emits this at step 3
    explicit = sparsejax.generate(model, ids, eos_token_id=eos, **kw)
    assert int(explicit.num_generated[1]) <= 4 < 12
    build("llama-gqa-llama3rope-tied", tmp_path)        # the fixture's checkpoint again
    (tmp_path / "generation_config.json").unlink(missing_ok=True)
    config_eos = json.loads((tmp_path / "config.json").read_text())["eos_token_id"]
    assert sparsejax.from_pretrained(tmp_path, dtype=jnp.float32).config.eos_token_id == (
        tuple(config_eos) if isinstance(config_eos, list) else config_eos)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    loaded = sparsejax.from_pretrained(tmp_path, dtype=jnp.float32)
    assert loaded.config.eos_token_id == (eos,)
    default = sparsejax.generate(loaded, ids, **kw)
    np.testing.assert_array_equal(np.asarray(default.tokens), np.asarray(explicit.tokens))
    np.testing.assert_array_equal(np.asarray(default.num_generated),
                                  np.asarray(explicit.num_generated))
    never = sparsejax.generate(loaded, ids, eos_token_id=(), **kw)
    np.testing.assert_array_equal(np.asarray(never.tokens), np.asarray(free.tokens))
