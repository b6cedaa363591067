"""Bad input gets a ValueError that names what is wrong: no hang, no silent wrong answer.

One test per kind of bad input, each asserting the exception type and that the message names
the offending argument or file, with the valid call beside it as the control where that is
cheap. Checkpoints are built the way tests/hf_checkpoints.py builds them, but tiny.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparsejax
from sparsejax import methods as M
from sparsejax.generate import prompt_lengths
from sparsejax.models import ModelConfig, init_params
from sparsejax.plan import dense_plan

CFG = ModelConfig(model_type="llama", vocab_size=32, hidden_size=16, num_layers=2, num_heads=2,
                  num_kv_heads=1, head_dim=8, intermediate_size=32, max_position_embeddings=64)


@pytest.fixture(scope="module")
def model():
    return sparsejax.Model(CFG, init_params(CFG, jax.random.key(0), std=0.1))


# ---- token ids and lengths ------------------------------------------------------------------
@pytest.mark.parametrize("ids,match", [
    ([[1, 2, 32]], r"ids \[32\] outside the vocabulary \[0, 32\)"),
    ([[1, -1, 40, 40]], r"ids \[-1, 40\] outside the vocabulary"),
    ([[1.0, 2.5]], "input_ids has dtype float"),
    ([[True, False]], "input_ids has dtype bool"),
])
def test_token_ids_outside_the_vocabulary_or_not_integers(model, ids, match):
    for call in (lambda: sparsejax.generate(model, ids, max_new_tokens=1),
                 lambda: sparsejax.logits(model, ids),
                 lambda: sparsejax.prefill(model, sparsejax.allocate(CFG, 1, 8, page_size=4),
                                           ids, np.array([2]), dense_plan(CFG, 4))):
        with pytest.raises(ValueError, match=match):
            call()
    ok = sparsejax.logits(model, [[0, 31]])   # the vocabulary's edges are valid ids
    assert np.isfinite(np.asarray(ok)).all()


def test_traced_ids_are_taken_as_they_are(model):
    """Inside a jit the ids cannot be inspected (documented): only the dtype is checked."""
    out = jax.jit(lambda ids: sparsejax.logits(model, ids))(jnp.array([[1, 2]]))
    np.testing.assert_allclose(out, sparsejax.logits(model, [[1, 2]]), rtol=1e-6)
    with pytest.raises(ValueError, match="input_ids has dtype float32"):
        jax.jit(lambda ids: sparsejax.logits(model, ids))(jnp.array([[1.0, 2.0]]))


def test_float_lengths_are_refused(model):
    with pytest.raises(ValueError, match="lengths has dtype float"):
        sparsejax.generate(model, [[1, 2, 3]], lengths=[2.5], max_new_tokens=1)
    with pytest.raises(ValueError, match=r"lengths range over \[0, 3\]"):
        prompt_lengths(np.array([3, 0]), 2, 3)
    np.testing.assert_array_equal(prompt_lengths(np.array([3, 1]), 2, 3), [3, 1])


# ---- float knobs: NaN and inf ---------------------------------------------------------------
@pytest.mark.parametrize("make,match", [
    (lambda: M.RESA(M.DELTA(), lam=math.nan), "RESA lam=nan"),
    (lambda: M.RESA(M.DELTA(), lam=math.inf), "RESA lam=inf"),
    (lambda: M.RESA(M.DELTA(), lam=-1.0), "RESA lam=-1.0"),
    (lambda: M.TopP(math.nan), "budget top_p=nan"),
    (lambda: M.Threshold(math.inf), "budget threshold=inf"),
    (lambda: M.Threshold(1.5), "budget threshold=1.5"),
    (lambda: M.Ratio(math.nan), "budget ratio=nan"),
    (lambda: M.TopP(0.5, limit=0), "budget limit=0"),
    (lambda: M.Kascade(ratio=math.nan), "Kascade ratio=nan"),
    (lambda: M.OracleTopK(ratio=math.inf), "OracleTopK ratio=inf"),
    (lambda: M.Quest(token_budget=math.nan), "Quest token_budget=nan"),
])
def test_non_finite_knobs_are_refused(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=math.nan), "temperature=nan"),
    (dict(temperature=math.inf), "temperature=inf"),
    (dict(temperature=1.0, top_p=math.nan), "top_p=nan"),
])
def test_non_finite_sampling_is_refused(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        sparsejax.generate(model, [[1, 2]], max_new_tokens=1, rng=jax.random.key(0), **kwargs)


# ---- zero is not "use the default" ----------------------------------------------------------
@pytest.mark.parametrize("make", [
    lambda: M.DELTA(page_size=0), lambda: M.Quest(page_size=0),
    lambda: M.Kascade(anchor_layers=(0,)).to_plan(CFG, page_size=0), lambda: dense_plan(CFG, 0),
])
def test_page_size_zero_is_an_error(make):
    with pytest.raises(ValueError, match="page_size=0"):
        make()


def test_generate_page_size_zero_is_an_error(model):
    with pytest.raises(ValueError, match="page_size=0"):
        sparsejax.generate(model, [[1, 2]], max_new_tokens=1, page_size=0)
    assert dense_plan(CFG).page_size == 16      # None is the default


# ---- Lychee retrieval heads -----------------------------------------------------------------
def test_retrieval_heads_must_be_booleans():
    with pytest.raises(ValueError, match=r"retrieval_heads has dtype float64, values \[0.3, 1.0\]"):
        M.Lychee([[1.0], [0.3]])
    with pytest.raises(ValueError, match=r"values \[0, 2\]"):
        M.Lychee([[0], [2]])
    want = ((True,), (False,))
    assert M.Lychee([[True], [False]]).retrieval_heads == want
    assert M.Lychee([[1], [0]]).retrieval_heads == want


# ---- context and cache size -----------------------------------------------------------------
def test_context_past_max_position_embeddings_warns(model):
    with pytest.warns(UserWarning, match="70 tokens .* exceed the model's "
                                         "max_position_embeddings=64"):
        sparsejax.generate(model, [[1] * 10], max_new_tokens=60)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sparsejax.generate(model, [[1] * 10], max_new_tokens=54)


def test_a_cache_that_cannot_fit_is_refused_before_allocating(model):
    """8 rows of 10**9 tokens need 954 GiB of cache even for this tiny model."""
    with pytest.raises(ValueError, match=r"KV cache of 8 rows × 1000000001 tokens needs "
                                         r"953.7 GiB; the devices have room for"):
        with pytest.warns(UserWarning):
            sparsejax.generate(model, [[1, 2]] * 8, max_new_tokens=10**9)
