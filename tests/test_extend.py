"""Several tokens per row over the paged cache: extend, chunked prefill = one-pass prefill."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparsejax
from sparsejax import cache as kv
from sparsejax import methods
from sparsejax.extend import extend
from sparsejax.plan import Role, as_plan, dense_plan

from hf_checkpoints import build
from test_generate import ragged

LENGTHS = [5, 19, 11]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for name in ("llama-gqa-llama3rope-tied", "qwen2-bias-sharded", "qwen3-qknorm-headdim48"):
        path = tmp_path_factory.mktemp(name)
        build(name, path)
        out[name] = sparsejax.from_pretrained(path, dtype=jnp.float32)
    return out


prefill = jax.jit(sparsejax.prefill, static_argnames=("plan", "chunk"))


def valid_kv(cache, lengths):
    """Every layer's K and V of each row's first lengths[b] tokens, in position order."""
    P = cache.page_size
    rows = []
    for b, n in enumerate(lengths):
        pos = np.arange(n)
        pages = np.asarray(cache.page_table)[b, pos // P]
        rows.append((np.asarray(cache.k[:, pages, :, pos % P]),
                     np.asarray(cache.v[:, pages, :, pos % P])))
    return rows


def assert_same_cache(got, want, lengths, atol=1e-5):
    np.testing.assert_array_equal(np.asarray(got.lengths), np.asarray(want.lengths))
    for (gk, gv), (wk, wv) in zip(valid_kv(got, lengths), valid_kv(want, lengths)):
        np.testing.assert_allclose(gk, wk, atol=atol)
        np.testing.assert_allclose(gv, wv, atol=atol)


@pytest.mark.parametrize("name,chunks,page_size", [
    ("llama-gqa-llama3rope-tied", (1, 7), 4),
    ("qwen2-bias-sharded", (4,), 8),
    ("qwen3-qknorm-headdim48", (6, 32), 16),
])
def test_chunked_prefill_equals_one_pass(checkpoints, name, chunks, page_size):
    model = checkpoints[name]
    ids, lengths = ragged(LENGTHS, seed=len(name))
    plan = dense_plan(model.config, page_size)
    empty = kv.allocate(model.config, 3, 40, page_size=page_size, dtype=jnp.float32)
    want, want_cache = prefill(model, empty, ids, lengths, plan=plan, chunk="one-pass")
    for chunk in chunks:
        got, cache = prefill(model, empty, ids, lengths, plan=plan, chunk=chunk)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4,
                                   err_msg=f"chunk={chunk}")
        assert_same_cache(cache, want_cache, lengths)


@pytest.mark.parametrize("method", [
    methods.Quest(page_size=4, token_budget=8, dense_layers=1),
    methods.RESA(methods.Kascade(anchor_layers=(0, 2)), lam=0.7),
])
def test_chunked_prefill_method_state(checkpoints, method):
    """Quest's page bounds and RESA's prior, computed from the cache after the last chunk,
    equal those of the one-pass prefill."""
    model = checkpoints["llama-gqa-llama3rope-tied"]
    ids, lengths = ragged(LENGTHS, seed=3)
    plan = as_plan(method, model.config, 4)
    empty = kv.allocate(model.config, 3, 24, page_size=4, dtype=jnp.float32)
    _, want = prefill(model, empty, ids, lengths, plan=plan, chunk="one-pass")
    _, got = prefill(model, empty, ids, lengths, plan=plan, chunk=6)
    want_leaves, tree = jax.tree.flatten(want.state)
    got_leaves, got_tree = jax.tree.flatten(got.state)
    assert tree == got_tree
    for g, w in zip(got_leaves, want_leaves):
        g, w = np.asarray(g), np.asarray(w)
        np.testing.assert_array_equal(np.isfinite(g), np.isfinite(w))
        np.testing.assert_allclose(g[np.isfinite(w)], w[np.isfinite(w)], atol=1e-5)


def test_extend_matches_full_forward(checkpoints):
    """Prefill, then extend ragged multi-token chunks (the verify step's shape): logits at
    every new position equal the full forward's, lengths advance by each row's count, and
    re-running the same tokens at an explicit start rewrites identical K/V."""
    model = checkpoints["qwen2-bias-sharded"]
    rng = np.random.default_rng(1)
    seq = rng.integers(0, 97, (2, 30)).astype(np.int32)
    full = np.asarray(sparsejax.logits(model, seq))
    prompt = np.asarray([9, 14], np.int32)
    plan = dense_plan(model.config, 8)
    cache = kv.allocate(model.config, 2, 32, page_size=8, dtype=jnp.float32)
    _, cache = prefill(model, cache, np.where(np.arange(14) < prompt[:, None], seq[:, :14], 0),
                       prompt, plan=plan)
    step = jax.jit(extend)
    num = np.asarray([6, 3], np.int32)
    chunk = np.stack([seq[b, prompt[b]:prompt[b] + 6] for b in range(2)])
    logits, after = step(model, cache, chunk, num)
    np.testing.assert_array_equal(np.asarray(after.lengths), prompt + num)
    for b in range(2):
        pos = prompt[b] + np.arange(num[b])
        np.testing.assert_allclose(np.asarray(logits[b, :num[b]]), full[b, pos], atol=1e-4)
    again, rewritten = step(model, after, chunk, num, start=prompt)
    np.testing.assert_allclose(np.asarray(again), np.asarray(logits), atol=1e-5)
    assert_same_cache(rewritten, after, prompt + num)
    # negative control: the chunk one position late reads a different cache
    late, _ = step(model, cache, chunk, num, start=prompt + 1)
    assert np.abs(np.asarray(late[0, :6]) - full[0, prompt[0] + np.arange(6)]).max() > 1e-2


def test_generate_with_prefill_chunk(checkpoints):
    model = checkpoints["llama-gqa-llama3rope-tied"]
    ids, lengths = ragged(LENGTHS, seed=4)
    want = sparsejax.generate(model, ids, lengths=lengths, max_new_tokens=6,
                              prefill_chunk="one-pass")
    got = sparsejax.generate(model, ids, lengths=lengths, max_new_tokens=6, prefill_chunk=8)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    for bad in (-1, 2.5):
        with pytest.raises(ValueError, match=f"prefill_chunk={bad}"):
            sparsejax.generate(model, ids, lengths=lengths, max_new_tokens=2, prefill_chunk=bad)


# ---- cache correction -----------------------------------------------------------------------
def test_correction_with_full_budget_is_dense(checkpoints):
    model = checkpoints["llama-gqa-llama3rope-tied"]
    ids, lengths = ragged(LENGTHS, seed=5)
    want = sparsejax.generate(model, ids, lengths=lengths, max_new_tokens=7)
    got = sparsejax.generate(model, ids, lengths=lengths, max_new_tokens=7, correct_every=3,
                             method=methods.Quest(page_size=4, token_budget=64, dense_layers=1))
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    with pytest.raises(ValueError, match="correct_every=0"):
        sparsejax.generate(model, ids, lengths=lengths, max_new_tokens=2, correct_every=0)


@pytest.mark.parametrize("fold", [False, True])
def test_correction_rewrites_what_dense_prefill_writes(checkpoints, fold):
    """Small-budget sparse decode steps write K/V that differ from dense; after `correct`,
    the cache rows (and Quest's page bounds, and RESA's folded prior) equal what a dense
    prefill of the same tokens writes."""
    from sparsejax import resa
    from sparsejax.extend import correct
    from sparsejax.models import forward

    model = checkpoints["llama-gqa-llama3rope-tied"]
    steps = 4
    ids, lengths = ragged(LENGTHS, seed=6)
    seq = np.concatenate([ids, np.zeros((3, steps), np.int32)], axis=1)
    generated = np.random.default_rng(7).integers(0, 97, (3, steps)).astype(np.int32)
    for b, n in enumerate(lengths):
        seq[b, n:n + steps] = generated[b]
    method = methods.RESA(methods.Quest(page_size=4, token_budget=8, dense_layers=1),
                          fold_decode_tokens=fold)
    plan = as_plan(method, model.config, 4)
    empty = kv.allocate(model.config, 3, 24, page_size=4, dtype=jnp.float32)
    _, cache = prefill(model, empty, ids, lengths, plan=plan)
    decode = jax.jit(sparsejax.decode_step, static_argnames="plan")
    for s in range(steps):
        _, cache = decode(model, cache, generated[:, s], plan=plan)
    _, dense = prefill(model, empty, seq, lengths + steps, plan=plan)
    total = lengths + steps
    sparse_k = valid_kv(cache, total)
    assert max(np.abs(a[0] - b[0]).max() for a, b in zip(sparse_k, valid_kv(dense, total))) > 1e-3

    fixed = jax.jit(correct, static_argnames="plan")(model, cache, generated, plan=plan)
    assert_same_cache(fixed, dense, total)
    for name in ("kmin", "kmax"):
        got, want = (np.asarray(getattr(c.state, name)) for c in (fixed, dense))
        np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
        np.testing.assert_allclose(got[np.isfinite(want)], want[np.isfinite(want)], atol=1e-5)
    prior = fixed.state.prior
    # the prompt's prior, then each generated token's dense K/V folded in (when folding)
    want = resa.init_prior(forward(model, ids, lengths), jnp.asarray(lengths))
    full = forward(model, seq, total)
    for s in range(steps if fold else 0):
        keys, values = full.keys, full.values
        pos = lengths + s
        for layer in range(model.config.num_layers):
            want = resa.fold_token(want, layer, keys[layer, np.arange(3), pos],
                                   values[layer, np.arange(3), pos])
    np.testing.assert_allclose(np.asarray(prior.lse), np.asarray(want.lse), atol=1e-5)
    np.testing.assert_allclose(np.asarray(prior.o_est), np.asarray(want.o_est), atol=1e-5)


# ---- Kascade's sparse prefill ---------------------------------------------------------------
def test_kascade_sparse_prefill_full_ratio_is_dense(checkpoints):
    model = checkpoints["llama-gqa-llama3rope-tied"]
    ids, lengths = ragged([13, 19, 6], seed=8)
    empty = kv.allocate(model.config, 3, 24, page_size=4, dtype=jnp.float32)
    want, want_cache = prefill(model, empty, ids, lengths, plan=dense_plan(model.config, 4),
                               chunk="one-pass")
    for ratio, close in ((1.0, True), (0.1, False)):
        plan = as_plan(methods.Kascade(anchor_layers=(0, 1), ratio=ratio, min_k=0,
                                       sparse_prefill=True, prefill_tile=4), model.config, 4)
        got, cache = prefill(model, empty, ids, lengths, plan=plan, chunk=8)
        err = np.abs(np.asarray(got) - np.asarray(want)).max()
        assert (err <= 1e-4) == close, (ratio, err)
        # sparse anchors change decode only: their anchors select tiles in prefill as before
        sparse_anchors = as_plan(methods.Kascade(anchor_layers=(0, 1), ratio=ratio, min_k=0,
                                                 sparse_prefill=True, prefill_tile=4,
                                                 sparse_anchors=True), model.config, 4)
        assert sparse_anchors.roles[1] == Role.SELF
        np.testing.assert_array_equal(
            prefill(model, empty, ids, lengths, plan=sparse_anchors, chunk=8)[0], got)
        if close:
            assert_same_cache(cache, want_cache, lengths)
    with pytest.raises(ValueError, match="chunk=6: expected a multiple"):
        sparsejax.prefill(model, empty, ids, lengths, plan, chunk=6)
    with pytest.raises(ValueError, match="pooled_all_heads=False"):
        methods.Kascade(sparse_prefill=True, pooled_all_heads=True)


def test_kascade_prefill_selection_is_the_rolling_top_k():
    """Per tile of queries and KV head, the selected keys are the top 10% (at least min_k)
    of the keys before the tile by post-softmax probability summed over the tile and group."""
    from sparsejax.models import ModelConfig
    from sparsejax.pallas_kernels.prefill_attention import (paged_prefill_attention_reference,
                                                            paged_tile_scores_reference)
    from sparsejax.selection import select_tiles
    from test_prefill_attention import make_case

    tile, min_k = 16, 3
    args = make_case(11, batch=2, chunk=64, q_heads=8, kv_heads=2, head_dim=64, page_size=8,
                     max_pages=20, start=[0, 80], lengths=[64, 40], dtype=jnp.float32)
    q, k, _, page_table, start, lengths = args
    config = ModelConfig(model_type="llama", vocab_size=8, hidden_size=64, num_layers=2,
                         num_heads=8, num_kv_heads=2, head_dim=64, intermediate_size=8)
    plan = methods.Kascade(anchor_layers=(0,), ratio=0.1, min_k=min_k, sparse_prefill=True,
                           prefill_tile=tile).to_plan(config, 8)
    lse = paged_prefill_attention_reference(*args).lse
    scores = paged_tile_scores_reference(q, k, page_table, start, lengths, lse, tile=tile)
    tile_lo = start[:, None] + jnp.arange(4) * tile
    sel = select_tiles(plan, scores, tile_lo, capacity=160)
    scores, indices, count = (np.asarray(x) for x in (scores, sel.indices, sel.count))
    for b in range(2):
        for t in range(4):
            lo = int(tile_lo[b, t])
            for h in range(2):
                want_k = min(max(lo // 10, min_k), lo)   # floor, as ratio_budget
                want = np.argsort(-scores[b, t, h, :lo], kind="stable")[:want_k]
                assert count[b, t, h] == want_k
                np.testing.assert_array_equal(indices[b, t, h, :want_k], np.sort(want))
