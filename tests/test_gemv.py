"""The batch-1 projection as split-K partials (`pallas_kernels.gemv`): the Pallas kernel
(interpret mode on CPU) against its reference and numpy, its default split rule, its
refusals, and its lowering for CUDA."""
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_checks import lower_for_cuda
from sparsejax.pallas_kernels import gemv


def operands(seed, rows, k, n, dtype=jnp.bfloat16):
    """Exactly summable operands: products and their sums are exact in f32 in any order."""
    rng = np.random.default_rng(seed)
    x = rng.integers(-8, 9, (rows, k)) / 8
    w = rng.integers(-8, 9, (k, n)) / 16
    return jnp.asarray(x, dtype), jnp.asarray(w, dtype), x @ w


@pytest.mark.parametrize("rows,k,n,splits", [(1, 128, 64, 2), (2, 256, 192, 4), (16, 64, 128, 1),
                                             (2, 1536, 2048, None)])
def test_partials_sum_to_the_product(rows, k, n, splits, interpret):
    x, w, want = operands(rows + k, rows, k, n)
    got = gemv.projection_partials(x, w, splits=splits, backend="pallas", interpret=interpret)
    ref = gemv.projection_partials(x, w, splits=splits, backend="reference")
    assert got.shape == ref.shape and got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    np.testing.assert_array_equal(np.asarray(got).sum(0), want)
    if splits is not None:
        # each slice is its own share of K
        step = k // splits
        for s in range(splits):
            part = np.asarray(x, np.float64)[:, s * step:(s + 1) * step] @ np.asarray(
                w, np.float64)[s * step:(s + 1) * step]
            np.testing.assert_array_equal(np.asarray(got)[s], part)


def test_default_splits_fill_two_waves():
    # DS-Qwen-1.5B's q/k/v: 32 column blocks, ~2 x 132 programs -> 8 splits of K's 24 blocks
    assert gemv.default_tuning(2, 1536, 2048)["splits"] == 8
    # Llama-8B's: 96 column blocks -> 4 splits of 64 blocks
    assert gemv.default_tuning(2, 4096, 6144)["splits"] == 4
    # a wide weight needs no split; K's block count bounds the splits
    assert gemv.default_tuning(2, 1536, 17920)["splits"] == 1
    assert gemv.default_tuning(2, 128, 64)["splits"] == 2


def test_refusals():
    x, w, _ = operands(0, 2, 128, 64)
    with pytest.raises(ValueError, match=r"x.shape=\(17, 128\): expected at most 16 rows"):
        gemv.projection_partials(jnp.zeros((17, 128), jnp.bfloat16), w, backend="pallas")
    with pytest.raises(ValueError, match=r"w.shape=\(100, 64\): expected multiples of"):
        gemv.projection_partials(jnp.zeros((2, 100), jnp.bfloat16),
                                 jnp.zeros((100, 64), jnp.bfloat16), backend="pallas")
    with pytest.raises(ValueError, match=r"w.dtype=float32: expected x's dtype bfloat16"):
        gemv.projection_partials(x, w.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"splits=3: expected a divisor of K's 2 blocks"):
        gemv.projection_partials(x, w, splits=3)
    with pytest.raises(ValueError, match=r"x.shape=\(2, 128\), w.shape=\(64, 64\)"):
        gemv.projection_partials(x, w[:64])
    # what the kernel cannot take runs the reference under "auto"
    x17 = jnp.ones((17, 128), jnp.bfloat16)
    got = gemv.projection_partials(x17, w, splits=1)
    np.testing.assert_array_equal(np.asarray(got[0]),
                                  np.asarray(x17, np.float32) @ np.asarray(w, np.float32))


def test_lowers_for_cuda():
    x, w, _ = operands(1, 2, 1536, 2048)
    mlir = lower_for_cuda(lambda x, w: gemv.projection_partials(x, w, backend="pallas",
                                                                interpret=False), x, w)
    assert "projection_partials" in mlir
