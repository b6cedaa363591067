"""Lossless mode: a sparse method drafts, dense attention verifies.

Greedy output equals dense greedy output token for token; sampled output follows the dense
distribution; a round leaves the cache and the method state as the kept tokens alone would.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparsejax
from sparsejax import cache as kv
from sparsejax import methods as M
from sparsejax import speculative
from sparsejax.generate import Sampling, draft, speculative_round
from sparsejax.models import init_params
from sparsejax.plan import as_plan, dense_plan
from sparsejax.train import data

PATH = sparsejax.embedded_model_path()
MAX_NEW = 10
# ragged prompts; niah's answer (3 tokens + EOS) ends inside MAX_NEW, multivalue's does not
TASKS = (("niah", 96), ("multivalue", 140), ("vt", 120))


@pytest.fixture(scope="module")
def embedded():
    model = sparsejax.from_pretrained(PATH, dtype=jnp.float32)
    ids, lengths = data.prompt_batch([data.make_sample(t, n, 5, 0) for t, n in TASKS])
    return model, ids, lengths


@functools.lru_cache(maxsize=None)
def drafter(name: str, page_size: int, num_layers: int):
    """Each method with a budget of about a fifth of these prompts (so that drafts are
    sometimes rejected), layers from the calibration shipped with the embedded model."""
    calib = PATH / "calibration"
    if name == "dense":
        return M.Dense()
    if name == "oracle":
        return M.OracleTopK(k=24)
    if name == "streaming":
        return M.StreamingLLM(sinks=4, window=20)
    if name == "quest":
        return M.Quest(page_size=page_size, token_budget=page_size, dense_layers=1)
    if name == "tidal":
        return M.TidalDecode(k=24).scaled_to(num_layers)
    if name == "delta":
        return M.DELTA.from_calibration(calib / "delta.json", page_size=page_size,
                                        budget_pages=1, recent_pages=1)
    if name == "kascade":
        return M.Kascade.from_calibration(calib / "kascade.json", ratio=0.15, min_k=0)
    if name == "kascade-sparse-anchors":
        return M.Kascade.from_calibration(calib / "kascade.json", ratio=0.15, min_k=0,
                                          sparse_anchors=True)
    if name == "lychee":
        return M.Lychee(gates=PATH / "gates" / "target-4.json", budget=M.TopK(24), sinks=4,
                        recent=8)
    if name == "delta+resa-fold":
        return M.RESA(drafter("delta", page_size, num_layers), lam=1.0, fold_decode_tokens=True)
    if name == "kascade+resa":
        return M.RESA(drafter("kascade", page_size, num_layers))
    raise ValueError(name)


# Quest, whose page bounds the rollback recomputes, at every γ and both page sizes (γ = 8
# crosses page boundaries). The other methods' drafts leave only K/V and lengths (and RESA's
# folded prior, checked array by array in the state test below); they take one γ each,
# cycling through 1, 3 and 8 over both page sizes, so that each compile adds a method.
CASES = ([("quest", g, p) for g, p in ((1, 16), (3, 64), (8, 16))]
         + [("dense", 3, 16), ("oracle", 1, 64), ("streaming", 8, 16), ("tidal", 3, 16),
            ("delta", 8, 64), ("kascade", 1, 16), ("lychee", 3, 64), ("kascade+resa", 8, 16),
            ("delta+resa-fold", 8, 64), ("kascade-sparse-anchors", 3, 64)])


@pytest.fixture(scope="module")
def dense_tokens(embedded):
    model, ids, lengths = embedded
    out = {}
    for page_size in (16, 64):
        o = sparsejax.generate(model, ids, lengths=lengths, max_new_tokens=MAX_NEW,
                               eos_token_id=data.EOS_ID, page_size=page_size)
        assert o.drafted is None and o.accepted is None
        out[page_size] = (np.asarray(o.tokens), np.asarray(o.num_generated))
    # the batch exercises a row that stops at EOS and a row that runs to MAX_NEW
    num = out[16][1]
    assert num.min() < MAX_NEW and num.max() == MAX_NEW, num
    return out


@pytest.mark.parametrize("name,gamma,page_size", CASES)
def test_greedy_equals_dense(embedded, dense_tokens, name, gamma, page_size):
    model, ids, lengths = embedded
    method = drafter(name, page_size, model.config.num_layers)
    out = sparsejax.generate(model, ids, lengths=lengths, max_new_tokens=MAX_NEW, method=method,
                             eos_token_id=data.EOS_ID, page_size=page_size, draft_tokens=gamma)
    want_tokens, want_num = dense_tokens[page_size]
    np.testing.assert_array_equal(np.asarray(out.tokens), want_tokens)
    np.testing.assert_array_equal(np.asarray(out.num_generated), want_num)
    drafted, accepted = np.asarray(out.drafted), np.asarray(out.accepted)
    assert drafted.dtype == accepted.dtype == np.int32 and drafted.shape == (len(TASKS),)
    assert (drafted % gamma == 0).all() and (0 <= accepted).all() and (accepted <= drafted).all()
    # each round keeps accepted + 1 tokens (fewer only at the row's end): the counts agree
    rounds = drafted // gamma
    assert (want_num - 1 <= accepted + rounds).all() and (rounds <= want_num - 1).all()
    if name == "dense":   # the drafter is the verifier: every draft is accepted
        np.testing.assert_array_equal(accepted, drafted)
    print(f"{name} γ={gamma} P={page_size}: accepted {accepted} of {drafted}")


# ---- one round leaves what the kept tokens alone would --------------------------------------
def page_bounds_reference(cache, lengths):
    """Quest's key bounds recomputed from scratch (fp64): per layer and physical page, the
    element-wise min / max over the row's valid keys in it; +inf / -inf for empty pages."""
    k = np.asarray(cache.k, np.float64)                      # [L, num_pages, HK, P, D]
    L, num_pages, HK, P, D = k.shape
    kmin = np.full((L, num_pages, HK, D), np.inf)
    kmax = np.full((L, num_pages, HK, D), -np.inf)
    table = np.asarray(cache.page_table)
    for b, n in enumerate(lengths):
        for logical in range(-(-n // P)):
            page, held = table[b, logical], min(P, n - logical * P)
            kmin[:, page] = k[:, page, :, :held].min(axis=2)
            kmax[:, page] = k[:, page, :, :held].max(axis=2)
    return kmin, kmax


def fold_reference(prior, cache, start, count):
    """RESA's prior with the keys/values at positions start[b] .. start[b] + count[b] - 1 of
    `cache` added to its softmax (fp64, one token at a time)."""
    lse, o_est = np.asarray(prior.lse, np.float64), np.asarray(prior.o_est, np.float64)
    mu_q = np.asarray(prior.mu_q, np.float64)                          # [L, B, HQ, D]
    P, table = cache.page_size, np.asarray(cache.page_table)
    group = mu_q.shape[2] // cache.k.shape[2]
    for b in range(len(start)):
        for pos in range(start[b], start[b] + count[b]):
            page, slot = table[b, pos // P], pos % P
            k = np.repeat(np.asarray(cache.k[:, page, :, slot], np.float64), group, axis=1)
            v = np.repeat(np.asarray(cache.v[:, page, :, slot], np.float64), group, axis=1)
            logit = np.sum(mu_q[:, b] * k, -1) / np.sqrt(k.shape[-1])          # [L, HQ]
            new = np.logaddexp(lse[:, b], logit)
            o_est[:, b] = (np.exp(lse[:, b] - new)[..., None] * o_est[:, b]
                           + np.exp(logit - new)[..., None] * v)
            lse[:, b] = new
    return lse, o_est


def test_round_leaves_the_state_of_the_kept_tokens(prompts):
    """After a round with rejections, the cache's valid K/V, lengths, Quest's page bounds
    and RESA's folded prior are those of dense decoding of the kept tokens: K/V against
    teacher-forced dense decode steps, the state recomputed from scratch in fp64. A row
    with no tokens left (limit 0) is untouched. Negative control: the drafted state differs."""
    from small_model import CFG, LENGTHS

    gamma, P = 5, 4
    # weights large enough for peaked attention, so that Quest's drafts get rejected
    model = sparsejax.Model(CFG, init_params(CFG, jax.random.key(0), std=0.3))
    plan = as_plan(M.RESA(M.Quest(page_size=P, token_budget=8, dense_layers=1),
                          fold_decode_tokens=True), CFG, None)
    B = len(LENGTHS)
    empty = kv.allocate(CFG, B, int(LENGTHS.max()) + 2 * (gamma + 1), page_size=P,
                        dtype=jnp.float32)
    # one pass: the atol below was set on this cache (chunks give K/V equal to rounding)
    logits, before = jax.jit(sparsejax.prefill, static_argnames=("plan", "chunk"))(
        model, empty, prompts, LENGTHS, plan=plan, chunk="one-pass")
    last = jnp.argmax(logits, -1).astype(jnp.int32)
    limit = np.array([gamma + 1, 2, 0], np.int32)
    run = jax.jit(speculative_round, static_argnames=("plan", "sampling", "draft_tokens"))
    tokens, accepted, kept, after = run(model, before, last, jnp.asarray(limit), plan,
                                        Sampling(), jax.random.key(0), draft_tokens=gamma)
    tokens, accepted, kept = np.asarray(tokens), np.asarray(accepted), np.asarray(kept)
    np.testing.assert_array_equal(kept, np.minimum(accepted + 1, limit))
    # drafts were rejected; row 1 kept one of them, and row 0's rejected drafts reached a page
    # it does not keep
    assert accepted[0] == 0 and accepted[1] == 1, accepted
    assert LENGTHS[0] // P < (LENGTHS[0] + gamma - 1) // P
    np.testing.assert_array_equal(np.asarray(after.lengths), LENGTHS + kept)

    # dense decode steps over [last, kept tokens...] from the same prefilled cache
    step = jax.jit(sparsejax.decode_step, static_argnames="plan")
    ref, feed = before, np.asarray(last)
    for j in range(int(kept.max())):
        _, ref = step(model, ref, jnp.asarray(feed), plan=dense_plan(CFG, P))
        feed = tokens[:, j]
    held = LENGTHS + kept
    table, k_ref, k_got = np.asarray(ref.page_table), np.asarray(ref.k), np.asarray(after.k)
    v_ref, v_got = np.asarray(ref.v), np.asarray(after.v)
    for b in range(B):
        pos = np.arange(held[b])
        pages, slots = table[b, pos // P], pos % P
        np.testing.assert_allclose(k_got[:, pages, :, slots], k_ref[:, pages, :, slots], atol=1e-5)
        np.testing.assert_allclose(v_got[:, pages, :, slots], v_ref[:, pages, :, slots], atol=1e-5)

    kmin, kmax = page_bounds_reference(ref, held)
    lse, o_est = fold_reference(before.state.prior, ref, LENGTHS, kept)

    def check(state):
        for got, want in ((state.kmin, kmin), (state.kmax, kmax)):
            got = np.asarray(got)
            np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
            np.testing.assert_allclose(got[np.isfinite(want)], want[np.isfinite(want)], atol=1e-5)
        np.testing.assert_allclose(np.asarray(state.prior.lse), lse, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(state.prior.o_est), o_est, rtol=1e-4, atol=1e-5)

    check(after.state)
    for field in ("mu_q", "mu_k", "length"):
        np.testing.assert_array_equal(np.asarray(getattr(after.state.prior, field)),
                                      np.asarray(getattr(before.state.prior, field)))
    # negative control: the state as the drafts left it
    _, _, drafted = jax.jit(draft, static_argnames=("plan", "num_tokens", "sampling"))(
        model, before, last, plan, gamma, Sampling(), jax.random.key(0))
    with pytest.raises(AssertionError):
        check(drafted.state)


def test_bad_draft_tokens(model, prompts):
    for bad in (0, 2.5):
        with pytest.raises(ValueError, match=f"draft_tokens={bad}"):
            sparsejax.generate(model, prompts, max_new_tokens=2, draft_tokens=bad)
    with pytest.raises(ValueError, match="return_diagnostics=True with draft_tokens"):
        sparsejax.generate(model, prompts, max_new_tokens=2, draft_tokens=2,
                           return_diagnostics=True)
    with pytest.raises(ValueError, match="correct_every=4 with draft_tokens=2"):
        sparsejax.generate(model, prompts, max_new_tokens=2, draft_tokens=2, correct_every=4)


# ---- sampling follows the dense distribution ------------------------------------------------
TINY = sparsejax.ModelConfig(model_type="llama", vocab_size=12, hidden_size=32, num_layers=2,
                             num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64)
SAMPLES = 12000


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's chi-square test of counts against probabilities; cells expecting fewer
    than 5 are pooled into one."""
    from scipy import stats

    expected = probs * counts.sum()
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    return float(stats.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue)


def test_sampling_follows_the_dense_distribution(monkeypatch):
    """SAMPLES rows of one prompt, temperature 1 with top-k, StreamingLLM drafting γ = 2:
    the joint distribution of the first two tokens and the marginal of the third, against
    the exact dense probabilities from the full forward pass (chi-square, p > 1e-3). The
    same test with an acceptance rule that ignores the draft's distribution q (it keeps every
    draft that p allows) fails it (p < 1e-6)."""
    model = sparsejax.Model(TINY, init_params(TINY, jax.random.key(3), std=0.6))
    V, T, top_k = TINY.vocab_size, 16, 10
    prompt = np.random.default_rng(0).integers(0, V, T).astype(np.int32)

    def dense_probs(seqs):     # [N, t] -> next-token probabilities [N, V] as `sample` draws
        logits = sparsejax.logits(model, jnp.asarray(seqs))[:, -1]
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        return np.asarray(jax.nn.softmax(jnp.where(logits < kth, -jnp.inf, logits)), np.float64)

    grid = np.stack(np.meshgrid(np.arange(V), np.arange(V), indexing="ij"), -1).reshape(-1, 2)
    p1 = dense_probs(prompt[None])[0]
    p2 = dense_probs(np.concatenate([np.repeat(prompt[None], V, 0), np.arange(V)[:, None]], 1))
    p3 = dense_probs(np.concatenate([np.repeat(prompt[None], V * V, 0), grid], 1))
    joint12 = p1[:, None] * p2                                           # [V, V]
    marginal3 = np.einsum("ab,abc->c", joint12, p3.reshape(V, V, V))

    def pvalues():
        out = sparsejax.generate(model, np.repeat(prompt[None], SAMPLES, 0), max_new_tokens=3,
                                 method=M.StreamingLLM(sinks=1, window=6), temperature=1.0,
                                 top_k=top_k, rng=jax.random.key(7), draft_tokens=2)
        toks = np.asarray(out.tokens)
        counts12 = np.bincount(toks[:, 0] * V + toks[:, 1], minlength=V * V)
        counts3 = np.bincount(toks[:, 2], minlength=V)
        rate = float(np.asarray(out.accepted).sum() / np.asarray(out.drafted).sum())
        return (chi_square_pvalue(counts12, joint12.ravel()),
                chi_square_pvalue(counts3, marginal3), rate)

    p12, p3_, rate = pvalues()
    print(f"p-values {p12:.3g} {p3_:.3g}, acceptance {rate:.2f}")
    assert 0.2 < rate < 0.95, rate           # both acceptances and rejections are exercised
    assert p12 > 1e-3 and p3_ > 1e-3, (p12, p3_)

    right = speculative.accept_sampled
    monkeypatch.setattr(speculative, "accept_sampled",
                        lambda drafts, p, q, key: right(drafts, p, p[:, :-1], key))
    jax.clear_caches()
    wrong12, wrong3, _ = pvalues()
    print(f"q-blind rule p-values {wrong12:.3g} {wrong3:.3g}")
    assert min(wrong12, wrong3) < 1e-6
