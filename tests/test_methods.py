"""The method framework: every method through generate(), and each selection rule against an
independent numpy implementation on the same queries and keys."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparsejax
from sparsejax import cache as kv
from sparsejax import methods as M
from sparsejax.models import ModelConfig
from sparsejax.pallas_kernels import LogitRows, paged_decode_attention, sparse_decode_attention
from sparsejax.plan import Role
from sparsejax.selection import score_route, scores_pass, select
from small_model import CFG, LENGTHS, RETRIEVAL
from test_sparse_attention import make_case

HEAD_MAP = np.array([[0, 1], [1, 0], [0, 1], [1, 1], [0, 0], [1, 0]])


def full_budget_methods(page_size: int, capacity: int):
    """Each method with a budget that covers the whole context."""
    return {
        "oracle": M.OracleTopK(ratio=1.0),
        "streaming": M.StreamingLLM(sinks=4, window=capacity),
        "quest": M.Quest(page_size=page_size, token_budget=capacity),
        "tidal": M.TidalDecode(select_layers=(2, 4), k=capacity),
        "delta": M.DELTA(delta_layers=(2, 4), page_size=page_size,
                         budget_pages=math.ceil(capacity / page_size), recent_pages=1),
        "kascade": M.Kascade(anchor_layers=(0, 3), ratio=1.0, head_map=HEAD_MAP),
        "kascade-sparse-anchors": M.Kascade(anchor_layers=(0, 3), ratio=1.0, head_map=HEAD_MAP,
                                            sparse_anchors=True),
        "lychee": M.Lychee(RETRIEVAL, budget=M.TopK(capacity), sinks=4, recent=8),
        "lychee-blocks": M.Lychee(RETRIEVAL, budget=M.TopK(capacity), block=2 * page_size),
    }


@pytest.fixture(scope="module")
def dense_tokens(model, prompts):
    return {p: np.asarray(sparsejax.generate(model, prompts, lengths=LENGTHS, max_new_tokens=5,
                                             page_size=p).tokens) for p in (16, 64)}


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("name", list(full_budget_methods(16, 1)))
def test_full_budget_equals_dense(model, prompts, dense_tokens, name, page_size):
    method = full_budget_methods(page_size, 256)[name]
    out = sparsejax.generate(model, prompts, lengths=LENGTHS, max_new_tokens=5, method=method,
                             page_size=page_size, return_diagnostics=True)
    np.testing.assert_array_equal(np.asarray(out.tokens), dense_tokens[page_size])
    np.testing.assert_allclose(np.asarray(out.diagnostics["recall"]), 1.0, atol=1e-5)
    assert float(np.max(out.diagnostics["attn_error"])) < 1e-4


@pytest.mark.parametrize("name", ["delta", "kascade", "lychee", "quest"])
def test_full_budget_with_resa_equals_dense(model, prompts, dense_tokens, name):
    """A selection covering everything leaves nothing for the residual: RESA (λ = 1) is dense
    exactly (log1mexp(0) = -inf, no clamp)."""
    method = M.RESA(full_budget_methods(16, 256)[name], lam=1.0)
    out = sparsejax.generate(model, prompts, lengths=LENGTHS, max_new_tokens=5, method=method,
                             page_size=16, return_diagnostics=True)
    np.testing.assert_array_equal(np.asarray(out.tokens), dense_tokens[16])
    assert float(np.max(out.diagnostics["attn_error"])) < 1e-4


# ---- one decode step's selection vs numpy ------------------------------------------------------
def one_step(model, prompts, method, page_size=16):
    """Prefill + one decode step with diagnostics. Returns (plan, diag as numpy, keys) where
    keys[l] [B, T, HK, D] are layer l's cached keys in logical order after the step."""
    plan = method.to_plan(CFG, None)
    capacity = int(LENGTHS.max()) + 8
    cache = kv.allocate(CFG, 3, capacity, page_size=plan.page_size, dtype=jnp.float32)
    perm = np.random.default_rng(7).permutation(cache.num_pages).astype(np.int32)
    cache = cache.replace(page_table=jnp.asarray(perm.reshape(cache.page_table.shape)))
    logits, cache = sparsejax.prefill(model, cache, prompts, LENGTHS, plan)
    first = jnp.argmax(logits, -1).astype(jnp.int32)
    _, cache, diag = sparsejax.decode_step(model, cache, first, plan, diagnostics=True)
    P = plan.page_size
    T = cache.capacity
    pos = np.arange(T)
    table = np.asarray(cache.page_table)
    k = np.asarray(cache.k, np.float64)                       # [L, NP, HK, P, D]
    keys = k[:, table[:, pos // P], :, pos % P]               # [B, T, L, HK, D]
    keys = np.transpose(keys, (2, 0, 1, 3, 4))                # [L, B, T, HK, D]
    return plan, jax.tree.map(np.asarray, diag), keys


def probs(q, keys, length):
    """Per query head softmax over the row's valid keys (float64). q [HQ, D], keys [T, HK, D]."""
    g = CFG.num_heads // CFG.num_kv_heads
    k = np.repeat(keys[:length], g, axis=1)                  # [t, HQ, D]
    s = np.einsum("hd,thd->ht", q.astype(np.float64), k) / math.sqrt(CFG.head_dim)
    p = np.exp(s - s.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True), s


def np_select(scores, budget, valid, force_first=0, force_last=0):
    """Forced units first, then the highest scores (ties: lower index); sorted ascending."""
    if valid <= budget:
        return list(range(valid))
    forced = set(range(min(force_first, valid))) | set(range(max(valid - force_last, 0), valid))
    rest = sorted((i for i in range(valid) if i not in forced), key=lambda i: (-scores[i], i))
    return sorted(forced | set(rest[:max(budget - len(forced), 0)]))


def selected(diag, layer, row, group):
    n = diag["count"][layer, row, group]
    return list(diag["indices"][layer, row, group, :n])


def test_delta_pages(model, prompts):
    method = M.DELTA(delta_layers=(2, 4), budget_pages=4, recent_pages=1)
    plan, diag, keys = one_step(model, prompts, method)
    length = LENGTHS + 1
    for layer in (2, 4):      # Δ-layer l selects; layer l + 1 attends to it
        for b in range(3):
            p, _ = probs(diag["query"][layer, b], keys[layer, b], length[b])
            token = p.max(0)
            pages = np.add.reduceat(token, np.arange(0, length[b], 16))
            want = np_select(pages, 4, len(pages), force_last=1)
            assert selected(diag, layer + 1, b, 0) == want


def test_kascade_tokens_per_kv_head_with_head_map(model, prompts):
    method = M.Kascade(anchor_layers=(0, 3), ratio=0.1, min_k=20, head_map=HEAD_MAP)
    plan, diag, keys = one_step(model, prompts, method)
    length = LENGTHS + 1
    g = CFG.num_heads // CFG.num_kv_heads
    for anchor, reuse in ((0, 1), (3, 4)):
        for b in range(3):
            p, _ = probs(diag["query"][anchor, b], keys[anchor, b], length[b])
            budget = min(max(int(0.1 * length[b]), 20), length[b])
            sets = []
            for h in range(CFG.num_kv_heads):
                want = np_select(p[h * g:(h + 1) * g].sum(0), budget, length[b])
                assert selected(diag, reuse, b, h) == want
                sets.append(want)
            # the reuse layer's KV head h attends to the set of anchor head head_map[reuse, h]
            q_probs, _ = probs(diag["query"][reuse, b], keys[reuse, b], length[b])
            recall = np.mean([q_probs[i, sets[HEAD_MAP[reuse, i // g]]].sum()
                              for i in range(CFG.num_heads)])
            np.testing.assert_allclose(diag["recall"][reuse, b], recall, rtol=1e-5)


def test_kascade_sparse_anchor_attends_to_its_own_top_k(model, prompts):
    """An anchor after layer 0 selects from its own group-summed probabilities (the scores
    pass without V) and attends only to that set; its reuse layer reads it through the head
    map; layer 0 stays dense."""
    method = M.Kascade(anchor_layers=(0, 3), ratio=0.1, min_k=20, head_map=HEAD_MAP,
                       sparse_anchors=True)
    plan, diag, keys = one_step(model, prompts, method)
    assert plan.roles[0] == Role.SELECT and plan.roles[3] == Role.SELF
    length = LENGTHS + 1
    g = CFG.num_heads // CFG.num_kv_heads
    np.testing.assert_allclose(diag["recall"][0], 1.0, atol=1e-6)
    for b in range(3):
        p, _ = probs(diag["query"][3, b], keys[3, b], length[b])
        budget = min(max(int(0.1 * length[b]), 20), length[b])
        sets = [np_select(p[h * g:(h + 1) * g].sum(0), budget, length[b])
                for h in range(CFG.num_kv_heads)]
        for h in range(CFG.num_kv_heads):
            assert selected(diag, 3, b, h) == sets[h]        # the anchor's own set
            assert selected(diag, 4, b, h) == sets[h]        # carried to the reuse layer
        # the anchor's heads attend to their own group's set: its recall is that set's mass
        recall = np.mean([p[i, sets[i // g]].sum() for i in range(CFG.num_heads)])
        np.testing.assert_allclose(diag["recall"][3, b], recall, rtol=1e-5)
        assert recall < 1 - 1e-6
        q_probs, _ = probs(diag["query"][4, b], keys[4, b], length[b])
        recall = np.mean([q_probs[i, sets[HEAD_MAP[4, i // g]]].sum()
                          for i in range(CFG.num_heads)])
        np.testing.assert_allclose(diag["recall"][4, b], recall, rtol=1e-5)


def test_lychee_inherits_per_head_index(model, prompts):
    method = M.Lychee(RETRIEVAL, budget=M.TopK(24), sinks=4, recent=8)
    plan, diag, keys = one_step(model, prompts, method)
    length = LENGTHS + 1
    g = CFG.num_heads // CFG.num_kv_heads
    retrieval = RETRIEVAL.copy()
    retrieval[0] = True
    for layer in range(1, CFG.num_layers):
        for h in range(CFG.num_kv_heads):
            if retrieval[layer, h]:
                continue
            source = max(l for l in range(layer) if retrieval[l, h])
            for b in range(3):
                _, logits = probs(diag["query"][source, b], keys[source, b], length[b])
                mean_logit = logits[h * g:(h + 1) * g].mean(0)
                want = np_select(mean_logit, 24, length[b], force_first=4, force_last=8)
                assert selected(diag, layer, b, h) == want, (layer, h, b, source)


def test_quest_page_bound_per_query_head(model, prompts):
    method = M.Quest(token_budget=48, dense_layers=2)
    plan, diag, keys = one_step(model, prompts, method)
    length = LENGTHS + 1
    g = CFG.num_heads // CFG.num_kv_heads
    for layer in range(2, CFG.num_layers):
        for b in range(3):
            k = keys[layer, b, :length[b]]
            pages = [k[i:i + 16] for i in range(0, length[b], 16)]
            q = diag["query"][layer, b].astype(np.float64)
            for i in range(CFG.num_heads):
                bound = [np.sum(np.maximum(q[i] * pg[:, i // g].max(0), q[i] * pg[:, i // g].min(0)))
                         for pg in pages]
                assert selected(diag, layer, b, i) == np_select(bound, 3, len(pages))


def test_tidal_top_k_per_query_head(model, prompts):
    method = M.TidalDecode(select_layers=(2, 4), k=30)
    plan, diag, keys = one_step(model, prompts, method)
    length = LENGTHS + 1
    for layer in (2, 4):
        for b in range(3):
            p, _ = probs(diag["query"][layer, b], keys[layer, b], length[b])
            for i in range(CFG.num_heads):
                assert selected(diag, layer + 1, b, i) == np_select(p[i], 30, length[b])


def test_oracle_and_streaming(model, prompts):
    _, diag, keys = one_step(model, prompts, M.OracleTopK(k=25))
    length = LENGTHS + 1
    for layer in range(CFG.num_layers):
        p, _ = probs(diag["query"][layer, 1], keys[layer, 1], length[1])
        for i in range(CFG.num_heads):
            assert selected(diag, layer, 1, i) == np_select(p[i], 25, length[1])
    _, diag, _ = one_step(model, prompts, M.StreamingLLM(sinks=3, window=20))
    for b in range(3):
        want = list(range(3)) + list(range(length[b] - 20, length[b]))
        for layer in range(CFG.num_layers):
            assert selected(diag, layer, b, 0) == want


# ---- small budgets ----------------------------------------------------------------------------
def small_budget_methods():
    return {
        "oracle": M.OracleTopK(k=24), "streaming": M.StreamingLLM(sinks=4, window=20),
        "quest": M.Quest(token_budget=32), "tidal": M.TidalDecode(select_layers=(2, 4), k=24),
        "delta": M.DELTA(delta_layers=(2, 4), budget_pages=2, recent_pages=1),
        "kascade": M.Kascade(anchor_layers=(0, 3), ratio=0.1, min_k=0, head_map=HEAD_MAP),
        "kascade-sparse-anchors": M.Kascade(anchor_layers=(0, 3), ratio=0.1, min_k=0,
                                            head_map=HEAD_MAP, sparse_anchors=True),
        "lychee": M.Lychee(RETRIEVAL, budget=M.TopK(24), sinks=4, recent=4),
        "lychee-ratio": M.Lychee(RETRIEVAL, budget=M.Ratio(0.1), sinks=2, recent=4),
        "lychee-top-p": M.Lychee(RETRIEVAL, budget=M.TopP(0.5), sinks=2, recent=4),
        "lychee-threshold": M.Lychee(RETRIEVAL, budget=M.Threshold(0.01), sinks=2, recent=4),
    }


@pytest.mark.parametrize("name", list(small_budget_methods()))
def test_small_budgets_finite_and_bounded_by_the_oracle(model, prompts, name):
    method = small_budget_methods()[name]
    plan = method.to_plan(CFG, None)
    cache = kv.allocate(CFG, 3, int(LENGTHS.max()) + 4, page_size=plan.page_size,
                        dtype=jnp.float32)
    logits, cache = sparsejax.prefill(model, cache, prompts, LENGTHS, plan)
    logits, cache, diag = sparsejax.decode_step(model, cache, jnp.argmax(logits, -1), plan,
                                                diagnostics=True)
    assert np.isfinite(np.asarray(logits)).all()
    recall, oracle = np.asarray(diag["recall"]), np.asarray(diag["oracle_recall"])
    assert (recall > 0).all() and (recall <= 1 + 1e-6).all()
    assert (recall <= oracle + 1e-6).all()       # no set of the same size holds more mass
    sparse_layers = [i for i, r in enumerate(plan.roles) if r not in (Role.DENSE, Role.SELECT)]
    assert (recall[sparse_layers] < 1 - 1e-6).any()
    if name == "oracle":
        np.testing.assert_allclose(recall, oracle, atol=1e-6)


@pytest.mark.parametrize("method,own_logits", [
    (M.Kascade(anchor_layers=(0, 3), ratio=0.1, min_k=20, sparse_anchors=True), True),
    (M.OracleTopK(ratio=0.1), True),
    (M.RESA(M.OracleTopK(ratio=0.1)), False),
])
def test_self_layer_reads_its_own_logits(method, own_logits):
    """A SELF layer's scores pass (`selection.scores_pass`) hands its sparse attention the
    logits behind its scores (Kascade's sparse anchors, oracle top-k), unless RESA's prior
    queries need K: the same selection as from the pooled scores, and attention over it equal
    to the attention that recomputes q.k from K."""
    plan = method.to_plan(CFG, None)
    case, _ = make_case(5, batch=3, q_heads=CFG.num_heads, kv_heads=CFG.num_kv_heads,
                        head_dim=CFG.head_dim, page_size=16, max_pages=8, lengths=[16, 77, 128])
    args = [case[k] for k in ("q", "k_pages", "v_pages", "page_table", "lengths")]
    capacity = 8 * 16
    scores, logits = scores_pass(plan, *args)
    assert isinstance(logits, LogitRows) == own_logits and (own_logits or logits is None)
    pooled = paged_decode_attention(*args, values=False,
                                    **dict(score_route(plan.selector).kernel_args(), pool_scores=True))
    sel = select(plan, CFG, scores, case["lengths"], capacity)
    want_sel = select(plan, CFG, pooled.scores, case["lengths"], capacity)
    np.testing.assert_array_equal(np.asarray(sel.indices), np.asarray(want_sel.indices))
    if own_logits:
        def attend(given):
            return sparse_decode_attention(*args, sel.indices, sel.count,
                                           unit=plan.selector.unit, logits=given).out
        np.testing.assert_allclose(np.asarray(attend(logits)), np.asarray(attend(None)),
                                   rtol=1e-5, atol=1e-5)


# ---- plans, compiles and errors ---------------------------------------------------------------
def test_roles():
    assert M.DELTA().to_plan(ModelConfig("llama", 11, 8, 28, 2, 1, 4, 8)).roles == (
        (Role.DENSE,) * 2 + (Role.SELECT,) + (Role.REUSE,) * 11 + (Role.SELECT,) +
        (Role.REUSE,) * 7 + (Role.SELECT,) + (Role.REUSE,) * 5)
    lychee = M.Lychee(RETRIEVAL).to_plan(CFG)
    assert lychee.roles == (Role.SELECT, Role.HYBRID, Role.HYBRID, Role.REUSE, Role.HYBRID,
                            Role.HYBRID)
    assert M.Quest(dense_layers=2).to_plan(CFG).roles == (Role.DENSE,) * 2 + (Role.SELF,) * 4


def test_one_compile_per_plan_and_shapes(model, prompts):
    from sparsejax.generate import _generate

    method = M.DELTA(delta_layers=(2, 4), budget_pages=2, recent_pages=1)
    sparsejax.generate(model, prompts, lengths=LENGTHS, max_new_tokens=3, method=method)
    before = _generate._cache_size()
    sparsejax.generate(model, prompts, lengths=LENGTHS, max_new_tokens=3, method=method)
    sparsejax.generate(model, prompts, lengths=LENGTHS - 1, max_new_tokens=3,
                       method=M.DELTA(delta_layers=(2, 4), budget_pages=2, recent_pages=1))
    assert _generate._cache_size() == before


@pytest.mark.parametrize("make,match", [
    (lambda: M.DELTA(delta_layers=(2, 9)), r"delta_layers=\(2, 9\).*\[9\] are out of range"),
    (lambda: M.TidalDecode(select_layers=(-1,)), r"select_layers.*out of range"),
    (lambda: M.Kascade(anchor_layers=(0, 6)), r"anchor_layers.*\[6\] are out of range"),
    (lambda: M.Kascade(anchor_layers=(2, 3)), "layer 0 must be an anchor"),
    (lambda: M.DELTA(budget_pages=0), "budget_pages=0"),
    (lambda: M.Quest(token_budget=-4), "token_budget=-4"),
    (lambda: M.TidalDecode(k=0), "k=0"),
    (lambda: M.Lychee(RETRIEVAL, budget=M.TopK(0)), r"TopK\(k=0\)"),
    (lambda: M.Lychee(RETRIEVAL, budget=M.Ratio(0.0)), "ratio=0.0"),
    (lambda: M.Kascade((0, 3), head_map=np.zeros((6, 3), int)), r"head_map has shape \(6, 3\)"),
    (lambda: M.Kascade((0, 3), head_map=np.zeros((6,), int)), r"head_map has shape \(6,\)"),
    (lambda: M.Kascade(anchor_layers=(0,), head_map=np.full((6, 2), 2)), "KV head indices"),
    (lambda: M.Lychee(np.ones((5, 2), bool)), r"retrieval_heads has shape \(5, 2\)"),
    (lambda: M.Lychee(np.ones((6,), bool)), r"retrieval_heads has shape \(6,\)"),
    (lambda: M.Lychee(RETRIEVAL, block=24), "multiple of page_size=16"),
])
def test_bad_method_arguments(make, match):
    with pytest.raises(ValueError, match=match):
        make().to_plan(CFG, None)


def test_page_selecting_methods_fix_the_page_size(model, prompts):
    for method in (M.DELTA(delta_layers=(2,)), M.Quest()):
        with pytest.raises(ValueError, match="page_size=32 disagrees"):
            sparsejax.generate(model, prompts, lengths=LENGTHS, max_new_tokens=2, method=method,
                               page_size=32)
    assert M.DELTA(page_size=32, delta_layers=(2,)).to_plan(CFG, None).page_size == 32


@pytest.mark.parametrize("name", ["delta+resa", "lychee"])
def test_per_layer_and_stacked_params_decode_alike(model, prompts, name):
    """The unrolled layer loop over per-layer params (what from_pretrained returns) and the
    scan over stacked params (what training uses) are one decode step: same tokens and
    diagnostics to rounding."""
    from sparsejax.models import is_stacked, unstack_layers

    method = {"delta+resa": M.RESA(M.DELTA(delta_layers=(2, 4), budget_pages=2, recent_pages=1)),
              "lychee": M.Lychee(RETRIEVAL, budget=M.TopK(24), sinks=4, recent=4)}[name]
    per_layer = model.replace(params=unstack_layers(model.params))
    assert is_stacked(model.params) and not is_stacked(per_layer.params)
    outs = [sparsejax.generate(m, prompts, lengths=LENGTHS, max_new_tokens=6, method=method,
                               return_diagnostics=True) for m in (model, per_layer)]
    np.testing.assert_array_equal(np.asarray(outs[0].tokens), np.asarray(outs[1].tokens))
    for key in ("recall", "attn_error"):
        np.testing.assert_allclose(np.asarray(outs[0].diagnostics[key]),
                                   np.asarray(outs[1].diagnostics[key]), rtol=1e-4, atol=1e-5)


# ---- budgets per row ---------------------------------------------------------------------------
RATIO = 0.25


@pytest.fixture(scope="module")
def registry_at_ratio():
    """Every registered method at RATIO of each row's length, as LLM, eval and the CLI run it."""
    return {name: spec.at_budget(CFG, M.Ratio(RATIO), M.Fitted())
            for name, spec in M.REGISTRY.items()}


@pytest.fixture(scope="module")
def batch_tokens(model, prompts, registry_at_ratio):
    return {name: np.asarray(sparsejax.generate(model, prompts, lengths=LENGTHS, max_new_tokens=5,
                                                method=method).tokens)
            for name, method in registry_at_ratio.items()}


@pytest.mark.parametrize("name", list(M.REGISTRY))
def test_a_row_alone_decodes_as_in_a_longer_batch(model, prompts, registry_at_ratio,
                                                  batch_tokens, name):
    """A ratio budget applies to each row's own length: the shortest row (93 tokens) decoded
    alone, in a cache and selection buffer sized for it, gives the tokens it gives beside
    rows of 150 and 200 tokens."""
    short = int(np.argmin(LENGTHS))
    alone = sparsejax.generate(model, prompts[short:short + 1, :LENGTHS[short]],
                               max_new_tokens=5, method=registry_at_ratio[name])
    np.testing.assert_array_equal(np.asarray(alone.tokens)[0], batch_tokens[name][short])


def test_the_ratio_budgets_select(batch_tokens, dense_tokens):
    """The control that gives the equalities above teeth: at RATIO most methods decode other
    tokens than dense on these prompts."""
    differ = [n for n, t in batch_tokens.items() if n != "dense" and
              not np.array_equal(t, dense_tokens[16])]
    assert len(differ) >= 5, differ


def test_ratio_budgets_grow_with_the_row_and_its_tokens():
    """The static buffer holds the largest row's budget (sized from the cache capacity); the
    per-row k is the ratio of each row's current length, generated tokens included."""
    from sparsejax.selection import budget_rows, buffer_size

    plan = M.Kascade(ratio=0.1, min_k=0).to_plan(CFG)
    valid = jnp.array([9, 30, 95, 400], jnp.int32)
    k = buffer_size(plan.selector, 400)
    assert k == 40
    k_row = budget_rows(plan.selector, jnp.zeros((4, 400)), valid, k)
    np.testing.assert_array_equal(np.asarray(k_row), [1, 3, 9, 40])   # at least one unit
    delta = M.DELTA(ratio=0.5).to_plan(CFG).selector
    assert buffer_size(delta, 400) == 13                 # ceil(0.5 * 25 pages)
    pages = jnp.array([2, 7, 25], jnp.int32)
    np.testing.assert_array_equal(np.asarray(budget_rows(delta, jnp.zeros((3, 25)), pages, 13)),
                                  [1, 3, 12])


def test_full_ratio_equals_dense_past_the_prompt(model):
    """budget_ratio=1.0 is dense for every registered method, also once a row has generated
    more tokens than its prompt held (a budget fixed at the prompt's length would not be)."""
    rng = np.random.default_rng(3)
    lengths = np.array([10, 40, 27], np.int32)
    ids = rng.integers(0, CFG.vocab_size, (3, 40)).astype(np.int32)
    want = np.asarray(sparsejax.generate(model, ids, lengths=lengths, max_new_tokens=16).tokens)
    for name, spec in M.REGISTRY.items():
        method = spec.at_budget(CFG, M.Ratio(1.0), M.Fitted())
        got = sparsejax.generate(model, ids, lengths=lengths, max_new_tokens=16, method=method)
        np.testing.assert_array_equal(np.asarray(got.tokens), want, err_msg=name)


def test_streaming_at_a_ratio_keeps_the_sinks_and_the_newest(model, prompts):
    _, diag, _ = one_step(model, prompts, M.StreamingLLM(sinks=3, ratio=0.1))
    for b in range(3):
        n = LENGTHS[b] + 1
        keep = int(0.1 * n)
        want = list(range(3)) + list(range(n - (keep - 3), n))
        for layer in range(CFG.num_layers):
            assert selected(diag, layer, b, 0) == want
