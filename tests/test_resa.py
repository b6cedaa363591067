"""RESA: the stable merge against a naive softmax over merged logits, priors per row, λ = 0."""
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparsejax
from sparsejax import cache as kv
from sparsejax import layers, resa
from sparsejax import methods as M
from sparsejax.models import forward, unembed
from sparsejax.pallas_kernels import sparse_decode_attention_reference
from sparsejax.plan import Residual
from small_model import CFG, LENGTHS, RETRIEVAL

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import resa_error_breakdown as breakdown  # noqa: E402

def base_methods():
    return {
        "delta": M.DELTA(delta_layers=(2, 4), budget_pages=3, recent_pages=1),
        "kascade": M.Kascade(anchor_layers=(0, 3), ratio=0.1, min_k=8),
        "lychee": M.Lychee(RETRIEVAL, budget=M.TopK(24), sinks=4, recent=8),
        "quest": M.Quest(token_budget=32),
        "tidal": M.TidalDecode(select_layers=(2, 4), k=24),
        "streaming": M.StreamingLLM(sinks=4, window=20),
        "oracle": M.OracleTopK(k=24),
    }


@pytest.mark.parametrize("name", list(base_methods()))
def test_lambda_zero_is_the_base_method(model, prompts, name):
    base = base_methods()[name]
    kw = dict(lengths=LENGTHS, max_new_tokens=6)
    want = sparsejax.generate(model, prompts, method=base, **kw)
    got = sparsejax.generate(model, prompts, method=M.RESA(base, lam=0.0), **kw)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))


# ---- the merge against a naive computation ------------------------------------------------------
def random_case(rng, dtype, *, T=96, prefill=70, B=2, HQ=4, HK=2, D=16, frac=0.3):
    """Random q, keys, values, a selection per query head and a prior over the prefill."""
    q = rng.normal(size=(B, HQ, D))
    k = rng.normal(size=(B, T, HK, D))
    v = rng.normal(size=(B, T, HK, D))
    g = HQ // HK
    kq, vq = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)      # [B, T, HQ, D]
    sel = rng.random((B, HQ, T)) < frac
    sel[:, :, T - 5:] = True                                       # recent tokens
    mu_q = rng.normal(size=(B, HQ, D)) * 0.5
    mu_k = k[:, :prefill].mean(1)                                  # [B, HK, D]
    return dict(q=q, k=kq, v=vq, sel=sel, mu_q=mu_q, mu_k=np.repeat(mu_k, g, axis=1),
                mu_k_kv=mu_k, prefill=prefill, D=D)


def naive(c, lam):
    """softmax over merged logits times V: selected keys keep their real logits; unselected
    prompt keys get mu_q·k/sqrt(d) + b + log(lam); unselected decode keys are left out."""
    scale = 1 / math.sqrt(c["D"])
    real = np.einsum("bhd,bthd->bht", c["q"], c["k"]) * scale
    prior = np.einsum("bhd,bthd->bht", c["mu_q"], c["k"]) * scale
    b = np.sum((c["q"] - c["mu_q"]) * c["mu_k"], -1)[..., None] * scale
    T = real.shape[-1]
    in_prompt = (np.arange(T) < c["prefill"])[None, None]
    with np.errstate(divide="ignore"):
        est = prior + b + np.log(lam)
    logits = np.where(c["sel"], real, np.where(in_prompt, est, -np.inf))
    w = np.exp(logits - logits.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    return np.einsum("bht,bthd->bhd", w, c["v"])


def merge_inputs(c, xp=np):
    """The quantities the kernel and the prefill provide, computed directly."""
    scale = 1 / math.sqrt(c["D"])
    T = c["k"].shape[1]
    real = np.einsum("bhd,bthd->bht", c["q"], c["k"]) * scale
    prior = np.einsum("bhd,bthd->bht", c["mu_q"], c["k"]) * scale

    def lse_out(logits, mask):
        logits = np.where(mask, logits, -np.inf)
        m = logits.max(-1, keepdims=True)
        w = np.exp(logits - m)
        s = w.sum(-1)
        return m[..., 0] + np.log(s), np.einsum("bht,bthd->bhd", w / s[..., None], c["v"])

    in_prompt = np.broadcast_to(np.arange(T) < c["prefill"], c["sel"].shape)
    lse_sa, out_sa = lse_out(real, c["sel"])
    lse_i, o_i = lse_out(prior, c["sel"] & in_prompt)
    lse_p, o_est = lse_out(prior, in_prompt)
    return out_sa, lse_sa, (lse_i, o_i), resa.Prior(c["mu_q"], c["mu_k_kv"], lse_p, o_est,
                                                    np.full((c["q"].shape[0],), c["prefill"]))


@pytest.mark.parametrize("lam", [1.0, 0.5, 2.0])
def test_merge_equals_naive_fp64(lam):
    rng = np.random.default_rng(1)
    with jax.enable_x64(True):
        for _ in range(5):
            c = random_case(rng, np.float64)
            out_sa, lse_sa, partial, prior = merge_inputs(c)
            args = jax.tree.map(lambda x: jnp.asarray(x, jnp.float64),
                                (c["q"], out_sa, lse_sa, partial, prior))
            got = np.asarray(resa.merge(Residual(lam), *args))
            want = naive(c, lam)
            assert np.max(np.abs(got - want)) / np.max(np.abs(want)) <= 1e-10


def test_merge_equals_naive_fp32_with_the_kernel_partials():
    """fp32 end to end: the sparse kernel's reference gives out/lse and the prior partials."""
    rng = np.random.default_rng(2)
    B, HQ, HK, D, P, T, prefill = 2, 4, 2, 16, 8, 96, 70
    c = random_case(rng, np.float32, T=T, prefill=prefill, B=B, HQ=HQ, HK=HK, D=D, frac=0.0)
    # a per-query-head token selection, expressed as kernel indices (G = HQ)
    sel = np.zeros((B, HQ, T), bool)
    idx = np.full((B, HQ, 40), -1, np.int32)
    count = np.zeros((B, HQ), np.int32)
    for b in range(B):
        for h in range(HQ):
            chosen = np.sort(np.concatenate([rng.choice(T - 5, 30, replace=False),
                                             np.arange(T - 5, T)]))
            sel[b, h, chosen] = True
            idx[b, h, :len(chosen)] = chosen
            count[b, h] = len(chosen)
    c["sel"] = sel
    pages = T // P
    kv_k = c["k"][:, :, ::HQ // HK].reshape(B, pages, P, HK, D).transpose(0, 1, 3, 2, 4)
    kv_v = c["v"][:, :, ::HQ // HK].reshape(B, pages, P, HK, D).transpose(0, 1, 3, 2, 4)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    r = sparse_decode_attention_reference(
        f32(c["q"]), f32(kv_k.reshape(B * pages, HK, P, D)), f32(kv_v.reshape(B * pages, HK, P, D)),
        jnp.arange(B * pages, dtype=jnp.int32).reshape(B, pages), jnp.full((B,), T, jnp.int32),
        jnp.asarray(idx), jnp.asarray(count), unit=1, prior_query=f32(c["mu_q"]),
        prior_length=jnp.full((B,), prefill, jnp.int32))
    _, _, _, prior = merge_inputs(c)
    prior = jax.tree.map(f32, prior)
    got = np.asarray(resa.merge(Residual(1.0), f32(c["q"]), r.out, r.lse, r.prior, prior))
    want = naive(c, 1.0)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) <= 1e-5


def test_log1mexp():
    x = np.array([-1e-12, -1e-6, -0.1, -0.69, -0.7, -5.0, -50.0, -800.0])
    with jax.enable_x64(True):
        got = np.asarray(resa.log1mexp(jnp.asarray(x, jnp.float64)))
    import mpmath

    mpmath.mp.dps = 50
    want = [float(mpmath.log(1 - mpmath.exp(mpmath.mpf(float(v))))) for v in x]
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert float(resa.log1mexp(jnp.float32(0.0))) == -np.inf


# ---- the prior ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_prior_describes_the_cache_as_the_kernels_read_it(model, prompts, kv_dtype):
    """The prefill's prior (from the forward's K/V as stored, mu_q in the kernels' query
    dtype) and the same prior attended over the cache by the decode kernel (its reference
    here) agree to f32 rounding: RESA's rest term o_est - e^x o_I cancels, and a prior that
    saw other logits than the kernel's partial leaves their difference amplified by
    1 / (1 - e^x). A float32 model over a 16-bit or fp8 cache: unrounded keys or mu_q would
    differ by ~1e-2."""
    plan = M.RESA(M.OracleTopK(k=24)).to_plan(CFG)
    cache = kv.allocate(model, len(LENGTHS), prompts.shape[1] + 4, kv_dtype=kv_dtype)
    _, cache = sparsejax.prefill(model, cache, prompts, LENGTHS, plan=plan, chunk="one-pass")
    prior = cache.state.prior
    q_dtype = kv.query_dtype(cache.k.dtype, model.dtype)
    np.testing.assert_array_equal(np.asarray(prior.mu_q.astype(q_dtype).astype(jnp.float32)),
                                  np.asarray(prior.mu_q))        # mu_q as the kernels read it
    read = resa.prior_from_cache(model, cache, prior.mu_q, prior.mu_k, cache.lengths)
    np.testing.assert_allclose(np.asarray(read.lse), np.asarray(prior.lse), rtol=0, atol=2e-5)
    np.testing.assert_allclose(np.asarray(read.o_est), np.asarray(prior.o_est), rtol=0,
                               atol=2e-5)


def test_prior_per_row_with_ragged_lengths(model, prompts):
    out = forward(model, jnp.asarray(prompts), jnp.asarray(LENGTHS))
    prior = resa.init_prior(out, jnp.asarray(LENGTHS))
    scale = 1 / math.sqrt(CFG.head_dim)
    g = CFG.num_heads // CFG.num_kv_heads
    for b, n in enumerate(LENGTHS):
        alone = forward(model, jnp.asarray(prompts[b:b + 1, :n]))   # the row without padding
        for layer in range(CFG.num_layers):
            k = np.asarray(alone.keys[layer, 0], np.float64)          # [n, HK, D]
            v = np.asarray(alone.values[layer, 0], np.float64)
            mu_q = np.asarray(alone.query_means[layer, 0], np.float64)
            logits = np.einsum("hd,thd->ht", mu_q, np.repeat(k, g, axis=1)) * scale
            lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
            o_est = np.einsum("ht,thd->hd", np.exp(logits - lse[:, None]), np.repeat(v, g, axis=1))
            np.testing.assert_allclose(prior.mu_q[layer, b], mu_q, rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(prior.mu_k[layer, b], k.mean(0), rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(prior.lse[layer, b], lse, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(prior.o_est[layer, b], o_est, rtol=1e-4, atol=1e-5)
            assert int(prior.length[layer, b]) == n


def test_fold_equals_a_prior_over_every_token():
    rng = np.random.default_rng(3)
    B, HQ, HK, D, T = 2, 4, 2, 16, 30
    g = HQ // HK
    k = rng.normal(size=(B, T, HK, D)).astype(np.float32)
    v = rng.normal(size=(B, T, HK, D)).astype(np.float32)
    mu_q = rng.normal(size=(1, B, HQ, D)).astype(np.float32)

    def prior_over(n):
        logits = np.einsum("bhd,bthd->bht", mu_q[0], np.repeat(k[:, :n], g, axis=2)) / math.sqrt(D)
        m = logits.max(-1, keepdims=True)
        lse = np.log(np.exp(logits - m).sum(-1)) + m[..., 0]
        o = np.einsum("bht,bthd->bhd", np.exp(logits - lse[..., None]),
                      np.repeat(v[:, :n], g, axis=2))
        return lse, o

    lse, o = prior_over(20)
    p = resa.Prior(jnp.asarray(mu_q), jnp.zeros((1, B, HK, D)), jnp.asarray(lse[None]),
                   jnp.asarray(o[None]), jnp.full((1, B), 20, jnp.int32))
    for t in range(20, T):
        p = resa.fold_token(p, jnp.int32(0), jnp.asarray(k[:, t]), jnp.asarray(v[:, t]))
    lse, o = prior_over(T)
    np.testing.assert_allclose(np.asarray(p.lse[0]), lse, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(p.o_est[0]), o, rtol=1e-4, atol=1e-5)


def test_resa_wraps_every_method_and_fold_runs(model, prompts):
    for name, base in base_methods().items():
        out = sparsejax.generate(model, prompts, lengths=LENGTHS, max_new_tokens=3,
                                 method=M.RESA(base, fold_decode_tokens=name == "delta"))
        assert out.tokens.shape == (3, 3)
    with pytest.raises(ValueError, match="RESA lam=-1"):
        M.RESA(M.DELTA(delta_layers=(2, 4)), lam=-1.0).to_plan(CFG)
    with pytest.raises(ValueError, match="RESA base"):
        M.RESA(M.Dense())


# ---- the model's layers against the paper's rule ------------------------------------------------
@pytest.mark.parametrize("name", ["delta", "kascade", "lychee"])
def test_every_sparse_layer_is_the_papers_merged_softmax(model, prompts, name):
    """Decoding with RESA, each sparse layer's output equals one softmax over merged logits
    computed from the cache (attended keys q·k/sqrt(d), unselected prompt keys
    mu_q·k/sqrt(d) + b), for page and token selections, a head map and dense heads."""
    lengths = jnp.asarray(LENGTHS)
    out = forward(model, jnp.asarray(prompts), lengths)
    last = jnp.take_along_axis(out.hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]
    first = jnp.argmax(unembed(model, last), -1).astype(jnp.int32)
    plan = M.RESA(base_methods()[name]).to_plan(CFG)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(layers, "_diagnostics", breakdown._with_breakdown(layers._diagnostics))
        diag = breakdown._decode(model, out._replace(hidden=None), first, lengths, plan=plan,
                                 steps=2)
    sparse = [i for i, r in enumerate(plan.roles) if r.name not in ("DENSE", "SELECT")]
    assert sparse
    assert float(np.max(np.asarray(diag["resa_vs_eq3"])[:, sparse])) <= 2e-5
    # not vacuous: the prior changes these layers' error against dense attention
    moved = np.abs(np.asarray(diag["resa"]) - np.asarray(diag["base"]))[:, sparse]
    assert float(np.max(moved)) > 1e-2
