"""The score rule is one enum that the plan, selection and kernels share (its strings still
work), and the per-method cache state is a pytree with named fields."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsejax import methods as M
from sparsejax.cache import MethodState
from sparsejax.models import ModelConfig
from sparsejax.pallas_kernels import paged_decode_attention
from sparsejax.plan import Budget, Score, Selector

CFG = ModelConfig(model_type="llama", vocab_size=97, hidden_size=64, num_layers=4, num_heads=4,
                  num_kv_heads=2, head_dim=16, intermediate_size=96)


def test_selector_takes_the_enum_or_its_string():
    budget = Budget("fixed", 4)
    s = Selector("group_sum", 1, "kv", budget)
    assert s.score is Score.GROUP_SUM and s == Selector(Score.GROUP_SUM, 1, "kv", budget)
    assert hash(s) == hash(Selector(Score.GROUP_SUM, 1, "kv", budget))    # a static argument
    with pytest.raises(ValueError, match="score='group_max': expected one of"):
        Selector("group_max", 1, "kv", budget)
    scores = {m.__class__.__name__: m.to_plan(CFG).selector.score for m in (
        M.DELTA(delta_layers=(2,)), M.Kascade(anchor_layers=(0, 2)), M.Quest(),
        M.StreamingLLM(), M.OracleTopK(), M.Lychee(np.ones((4, 2), bool)))}
    assert scores == {"DELTA": Score.MAX_HEADS, "Kascade": Score.GROUP_SUM,
                      "Quest": Score.QUEST_BOUND, "StreamingLLM": Score.NONE,
                      "OracleTopK": Score.HEAD_PROBS, "Lychee": Score.MEAN_QUERY}
    assert [s for s in Score if s.is_logit] == [Score.MEAN_QUERY, Score.QUEST_BOUND]


def test_kernel_score_takes_the_enum():
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((2, 4, 64)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((6, 2, 8, 64)), jnp.float32) for _ in range(2))
    table = jnp.arange(6, dtype=jnp.int32).reshape(2, 3)
    lengths = jnp.array([5, 24], jnp.int32)
    for score in ("max_heads", "group_sum", "mean_query", "head_probs"):
        by_enum = paged_decode_attention(q, k, v, table, lengths, score=Score(score))
        by_name = paged_decode_attention(q, k, v, table, lengths, score=score)
        np.testing.assert_array_equal(np.asarray(by_enum.scores), np.asarray(by_name.scores))
    with pytest.raises(ValueError, match="all_heads_sum"):   # not a rule the kernel computes
        paged_decode_attention(q, k, v, table, lengths, score=Score.ALL_HEADS_SUM)


def test_method_state_is_a_pytree_with_named_fields():
    state = MethodState(kmin=jnp.zeros((4, 3, 2, 16)), kmax=jnp.ones((4, 3, 2, 16)))
    assert state.prior is None
    leaves = jax.tree_util.tree_leaves_with_path(state)
    assert [jax.tree_util.keystr(p) for p, _ in leaves] == [".kmin", ".kmax"]
    bumped = jax.jit(lambda s: s.replace(kmax=s.kmax + 1))(state)
    np.testing.assert_array_equal(np.asarray(bumped.kmax), 2.0)
    np.testing.assert_array_equal(np.asarray(bumped.kmin), 0.0)
