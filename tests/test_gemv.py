"""The batch-1 projection as split-K partials (`pallas_kernels.gemv`): the Pallas kernel
(interpret mode on CPU), plain and with the RMSNorm inside, against its reference and numpy,
its default split rule, its refusals, and its lowering for CUDA."""
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
                                             (2, 1536, 2048, None), (40, 128, 64, 2),
                                             (64, 256, 128, 2)])
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
    # the fewest splits dividing K's blocks for ~2 x 132 programs; DS-Qwen-1.5B's q/k/v: 32
    # column blocks -> 12 of K's 24 blocks
    assert gemv.default_tuning(2, 1536, 2048)["splits"] == 12
    # its down projection: 24 column blocks -> 14 of 140 (not a power of 2: 4 is under a wave)
    assert gemv.default_tuning(2, 8960, 1536)["splits"] == 14
    # Llama-8B's q/k/v: 96 column blocks -> 4 splits of 64 blocks
    assert gemv.default_tuning(2, 4096, 6144)["splits"] == 4
    # a wide weight needs no split; K's block count bounds the splits
    assert gemv.default_tuning(2, 1536, 17920)["splits"] == 1
    assert gemv.default_tuning(2, 128, 64)["splits"] == 2


def bf16(a):
    return np.asarray(jnp.asarray(a, jnp.float32).astype(jnp.bfloat16), np.float64)


def close_to_bf16_inputs(got, want, x_in, w):
    """got equals `want` (float64 from float64 inputs) but for rounding each input of the
    product to bf16: |got - want| <= 2^-7 |x_in| @ |w| (two bf16 ulps per term)."""
    bound = 2.0 ** -7 * (np.abs(x_in) @ np.abs(np.asarray(w, np.float64))) + 1e-6
    assert np.all(np.abs(got - want) <= bound), np.max(np.abs(got - want) - bound)


@pytest.mark.parametrize("rows,k,n,splits", [(1, 256, 128, 2), (2, 1536, 192, None),
                                             (3, 128, 64, 1)])
def test_norm_inside(rows, k, n, splits, interpret):
    """rms_norm(x, weight, eps) @ w: equal to the reference (decoder.rms_norm) to f32
    summation order and to numpy in float64 to bf16 rounding; 3 rows pad to 4 for the RMS."""
    rng = np.random.default_rng(rows * k)
    x = jnp.asarray(rng.normal(size=(rows, k)) * 3, jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(k, n)) / 16, jnp.bfloat16)
    weight = jnp.asarray(1 + rng.normal(size=(k,)) / 4, jnp.bfloat16)
    got = gemv.projection_partials(x, w, norm=weight, eps=1e-5, splits=splits,
                                   backend="pallas", interpret=interpret)
    ref = gemv.projection_partials(x, w, norm=weight, eps=1e-5, splits=splits,
                                   backend="reference")
    assert got.shape == ref.shape == (got.shape[0], rows, n)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=0, atol=1e-5)
    xf = np.asarray(x, np.float64)
    normed = xf / np.sqrt(np.mean(xf * xf, axis=1, keepdims=True) + 1e-5)
    x_in = normed * np.asarray(weight, np.float64)
    close_to_bf16_inputs(np.asarray(got, np.float64).sum(0), x_in @ np.asarray(w, np.float64),
                         x_in, w)


@pytest.mark.parametrize("normed", [False, True])
def test_lowers_for_cuda(normed):
    x, w, _ = operands(1, 2, 1536, 2048)
    kw = dict(norm=jnp.ones((1536,), jnp.bfloat16)) if normed else {}
    mlir = lower_for_cuda(lambda x, w: gemv.projection_partials(
        x, w, backend="pallas", interpret=False, **kw), x, w)
    assert "projection_partials" in mlir
