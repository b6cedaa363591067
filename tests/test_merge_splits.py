"""The split-K merge kernel (`common.merge_splits`) against `merge_partials` and numpy."""
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_checks import lower_for_cuda
from sparsejax.pallas_kernels import common


def make_partials(seed, outer, splits, rows, head_dim=64, empty=0.3):
    """Random partials with about `empty` of the (row, split) pairs empty (lse -inf, out NaN:
    an unwritten partial must not leak), and the last row empty in every split."""
    rng = np.random.default_rng(seed)
    out = rng.standard_normal((outer, splits, rows, head_dim)).astype(np.float32)
    lse = (rng.standard_normal((outer, splits, rows)) * 4).astype(np.float32)
    gone = rng.random((outer, splits, rows)) < empty
    gone[:, :, -1] = True
    lse[gone] = -np.inf
    out[gone] = np.nan
    return out, lse


def numpy_merge(out, lse):
    """softmax(lse) over the splits weighting the outputs, in float64."""
    out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
    m = np.max(lse, axis=1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    w = np.exp(lse - m)
    total = w.sum(axis=1)
    merged = np.einsum("asc,ascd->acd", w, np.where(w[..., None] > 0, out, 0.0))
    merged = merged / np.where(total > 0, total, 1.0)[..., None]
    return merged, np.where(total > 0, m[:, 0] + np.log(np.where(total > 0, total, 1.0)),
                            -np.inf)


@pytest.mark.parametrize("outer,splits,rows", [(1, 1, 3), (2, 3, 5), (1, 17, 4), (3, 66, 2)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_merge_splits_matches_numpy_and_merge_partials(outer, splits, rows, dtype):
    out, lse = make_partials(outer * splits + rows, outer, splits, rows)
    got, got_lse = common.merge_splits(jnp.asarray(out), jnp.asarray(lse), out_dtype=dtype,
                                       interpret=True)
    assert got.dtype == dtype and got.shape == (outer, rows, 64)
    want, want_lse = numpy_merge(out, lse)
    tol = 1e-6 if dtype == jnp.float32 else 8e-3
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol, atol=tol)
    np.testing.assert_allclose(got_lse, want_lse, rtol=1e-6)
    assert np.all(np.asarray(got[:, -1], np.float32) == 0)                 # every split empty
    assert np.all(np.isneginf(got_lse[:, -1]))
    masked = jnp.where(jnp.isfinite(lse)[..., None], out, 0.0)
    ref, ref_lse = common.merge_partials(masked, jnp.asarray(lse), axis=1)
    np.testing.assert_allclose(np.asarray(got, np.float32), ref.astype(dtype).astype(np.float32),
                               rtol=tol, atol=tol)
    np.testing.assert_array_equal(np.isfinite(got_lse), np.isfinite(ref_lse))


def test_negative_control_swapped_weights_fail():
    """The comparison catches a merge that weights the wrong split."""
    out, lse = make_partials(9, 1, 4, 3, empty=0.0)
    got, _ = common.merge_splits(jnp.asarray(out), jnp.asarray(lse[:, ::-1]),
                                 out_dtype=jnp.float32, interpret=True)
    want, _ = numpy_merge(out, lse)
    assert not np.allclose(np.asarray(got[:, :-1]), want[:, :-1], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("cols,chunk", [(64, None), (32, 8), (16, None), (16, 4)])
def test_column_blocks_agree(cols, chunk):
    """Any column block and chunk give numpy's merge; the default cuts D where the (a, c)
    pairs fill less than a wave (a batch-1 layer's query heads) and not where they fill it."""
    out, lse = make_partials(5, 1, 40, 3)
    got, got_lse = common.merge_splits(jnp.asarray(out), jnp.asarray(lse), out_dtype=jnp.float32,
                                       interpret=True, cols=cols, chunk=chunk)
    want, want_lse = numpy_merge(out, lse)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got_lse, want_lse, rtol=1e-6)
    assert common.merge_tuning(1, 264, 12, 128)["cols"] == 16
    assert common.merge_tuning(64, 2, 32, 128)["cols"] == 128


def test_bad_column_block_refused():
    out, lse = make_partials(5, 1, 4, 3)
    with pytest.raises(ValueError, match="cols=24"):
        common.merge_splits(jnp.asarray(out), jnp.asarray(lse), out_dtype=jnp.float32,
                            interpret=True, cols=24)


@pytest.mark.parametrize("splits,dtype", [(66, jnp.bfloat16), (3, jnp.float32)])
def test_merge_splits_lowers_for_cuda(splits, dtype):
    out, lse = make_partials(1, 2, splits, 32, head_dim=128)
    text = lower_for_cuda(lambda o, s: common.merge_splits(o, s, out_dtype=dtype,
                                                           interpret=False),
                          jnp.asarray(out), jnp.asarray(lse))
    assert "merge_splits" in text


@pytest.mark.gpu
@pytest.mark.parametrize("outer,splits,rows", [(1, 66, 32), (64, 2, 32), (1, 128, 1), (1, 264, 12)])
def test_native_gpu(outer, splits, rows):
    out, lse = make_partials(3, outer, splits, rows, head_dim=128)
    got, got_lse = common.merge_splits(jnp.asarray(out), jnp.asarray(lse),
                                       out_dtype=jnp.float32, interpret=False)
    want, want_lse = numpy_merge(out, lse)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-5, atol=1e-5)
    # the GPU's exp and log: a few ulp, so an absolute bound for LSEs near 0
    np.testing.assert_allclose(got_lse, want_lse, rtol=1e-6, atol=1e-5)
