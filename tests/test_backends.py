"""Backend dispatch: "auto" resolves per call (outside any jit cache), and use_backend
overrides it at trace time — so a whole step can be traced on either path."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsejax.pallas_kernels import (paged_decode_attention, sparse_decode_attention,
                                      topk_select)
from sparsejax.pallas_kernels.common import choose_backend, use_backend


def _inputs():
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(2, 4, 64)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(8, 2, 8, 64)), jnp.float32)
    table = jnp.arange(8, dtype=jnp.int32).reshape(2, 4)
    lengths = jnp.array([20, 31], jnp.int32)
    return q, k, table, lengths


CALLS = {
    "dense": lambda q, k, t, l: paged_decode_attention(q, k, k, t, l, score="group_sum"),
    "sparse": lambda q, k, t, l: sparse_decode_attention(
        q, k, k, t, l, jnp.zeros((2, 2, 3), jnp.int32) + jnp.arange(3, dtype=jnp.int32),
        jnp.full((2, 2), 3, jnp.int32), unit=8),
    "topk": lambda q, k, t, l: topk_select(q.reshape(8, 64), 5, valid=jnp.full((8,), 60)),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_use_backend_switches_after_a_previous_trace(name):
    args = _inputs()
    traced = {}
    for backend in ("pallas", "reference", "pallas"):
        with use_backend(backend):
            # a fresh function: an outer trace cache does not know about the override
            traced[backend] = str(jax.make_jaxpr(lambda *a: CALLS[name](*a))(*args))
        assert ("pallas_call" in traced[backend]) == (backend == "pallas"), backend


def test_choose_backend():
    assert choose_backend("reference", None) == "reference"
    assert choose_backend("auto", "head_dim=16: expected one of (64, 128, 256)") == "reference"
    with pytest.raises(ValueError, match="head_dim=16"):
        choose_backend("pallas", "head_dim=16: expected one of (64, 128, 256)")
    with pytest.raises(ValueError, match="backend='cuda'"):
        choose_backend("cuda", None)
