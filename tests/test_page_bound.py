"""Quest's page bound: Pallas kernel (interpret mode on CPU) vs reference vs numpy."""
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_checks import lower_for_cuda
from sparsejax.pallas_kernels.page_bound import (default_tuning, quest_page_bound,
                                                 quest_page_bound_reference)


def make_case(seed, *, batch=3, q_heads=8, kv_heads=2, head_dim=64, page_size=8, max_pages=9,
              lengths=None, dtype=jnp.float32, bound_dtype=jnp.float32):
    """Random keys per physical page (page count spare beyond the table), their element-wise
    bounds as the cache keeps them, a shuffled page table and ragged lengths (one page, a
    page boundary, the whole table by default)."""
    rng = np.random.default_rng(seed)
    num_pages = batch * max_pages + 3
    keys = rng.standard_normal((num_pages, kv_heads, page_size, head_dim)).astype(np.float32)
    held = rng.integers(1, page_size + 1, num_pages)    # slots written per page
    slot = np.arange(page_size)[None, None, :, None]
    live = slot < held[:, None, None, None]
    kmin = np.where(live, keys, np.inf).min(axis=2)
    kmax = np.where(live, keys, -np.inf).max(axis=2)
    table = rng.permutation(num_pages)[:batch * max_pages].reshape(batch, max_pages)
    if lengths is None:
        lengths = [1, 2 * page_size, max_pages * page_size][:batch]
    q = rng.standard_normal((batch, q_heads, head_dim)).astype(np.float32)
    return dict(q=jnp.asarray(q, dtype), kmin=jnp.asarray(kmin, bound_dtype),
                kmax=jnp.asarray(kmax, bound_dtype),
                page_table=jnp.asarray(table, jnp.int32),
                lengths=jnp.asarray(lengths, jnp.int32)), page_size


def numpy_bound(q, kmin, kmax, page_table, lengths, page_size):
    """The bound by loops: per row, head and logical page, from the page's bounds."""
    q, kmin, kmax = (np.asarray(x, np.float64) for x in (q, kmin, kmax))
    batch, q_heads, _ = q.shape
    group = q_heads // kmin.shape[1]
    max_pages = page_table.shape[1]
    out = np.full((batch, q_heads, max_pages), -np.inf)
    for b in range(batch):
        for p in range(-(-int(lengths[b]) // page_size)):
            page = int(page_table[b, p])
            for h in range(q_heads):
                lo, hi = kmin[page, h // group], kmax[page, h // group]
                out[b, h, p] = np.sum(np.where(q[b, h] >= 0, q[b, h] * hi, q[b, h] * lo))
    return out


def test_reference_matches_numpy():
    case, page_size = make_case(0, q_heads=6, kv_heads=2)
    got = quest_page_bound_reference(**case, page_size=page_size)
    np.testing.assert_allclose(got, numpy_bound(**case, page_size=page_size), rtol=1e-5,
                               atol=1e-5)


def test_bound_holds_over_every_key_of_the_page():
    """The property Quest relies on: no key of a page has q.k above the page's bound, and
    a page of one key is bounded by exactly q.k."""
    rng = np.random.default_rng(1)
    keys = rng.standard_normal((5, 1, 4, 32)).astype(np.float32)   # [pages, HK, P, D]
    keys[4, :, 1:] = keys[4, :, :1]                                # page 4: one distinct key
    q = rng.standard_normal((1, 2, 32)).astype(np.float32)
    table = jnp.arange(5, dtype=jnp.int32)[None]
    bound = quest_page_bound_reference(jnp.asarray(q), jnp.asarray(keys.min(2)),
                                       jnp.asarray(keys.max(2)), table,
                                       jnp.asarray([20], jnp.int32), page_size=4)
    per_page = np.einsum("hd,ptd->hpt", q[0], keys[:, 0]).max(-1)  # [HQ, pages]
    assert np.all(np.asarray(bound[0]) >= per_page - 1e-5)
    np.testing.assert_allclose(bound[0, :, 4], per_page[:, 4], rtol=1e-5)


@pytest.mark.parametrize("q_heads,kv_heads,head_dim,dtype,tuning", [
    (8, 2, 64, jnp.float32, {}),
    (6, 2, 64, jnp.bfloat16, {}),                                   # group 3
    (4, 4, 128, jnp.float32, dict(block_p=4, num_splits=3)),       # split blocks and tail
    (16, 1, 64, jnp.float16, dict(block_p=2, num_splits=1, num_warps=1)),
    (8, 2, 64, jnp.float32, dict(block_p=16, num_splits=8)),       # more splits than blocks
])
def test_kernel_matches_reference(q_heads, kv_heads, head_dim, dtype, tuning):
    """Bounds in the cache's dtype (f32 for f32 queries, else bf16 / f16), read into f32."""
    case, page_size = make_case(2, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                                dtype=dtype, batch=4, lengths=[1, 16, 17, 72], bound_dtype=dtype)
    want = quest_page_bound_reference(**case, page_size=page_size)
    got = quest_page_bound(**case, page_size=page_size, backend="pallas", interpret=True,
                           **tuning)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_negative_control_other_pages_fail():
    """The comparison above catches a kernel that reads the wrong physical pages."""
    case, page_size = make_case(3)
    want = quest_page_bound_reference(**case, page_size=page_size)
    wrong = dict(case, page_table=jnp.roll(case["page_table"], 1, axis=1))
    got = quest_page_bound(**wrong, page_size=page_size, backend="pallas", interpret=True)
    assert not np.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_default_tuning():
    assert default_tuning(1, 8, 8193) == dict(block_p=32, num_splits=66, num_warps=8)
    assert default_tuning(64, 8, 260)["num_splits"] == 2
    assert default_tuning(1, 1, 3) == dict(block_p=4, num_splits=1, num_warps=8)


@pytest.mark.parametrize("mutate,match", [
    (lambda c: dict(c, kmin=c["kmin"].astype(jnp.int32)), "kmin.dtype=int32"),
    (lambda c: dict(c, kmax=c["kmax"][:, :1]), r"kmax.shape=\(30, 1, 64\)"),
    (lambda c: dict(c, q=c["q"][..., :32]), "kmin head_dim=64"),
    (lambda c: dict(c, page_table=c["page_table"].astype(jnp.float32)), "page_table"),
    (lambda c: dict(c, lengths=c["lengths"][:1]), "lengths"),
])
def test_bad_inputs(mutate, match):
    case, page_size = make_case(4)
    with pytest.raises(ValueError, match=match):
        quest_page_bound(**mutate(case), page_size=page_size)


def test_bad_tuning():
    case, page_size = make_case(4)
    with pytest.raises(ValueError, match="block_p=3"):
        quest_page_bound(**case, page_size=page_size, backend="pallas", block_p=3)


@pytest.mark.parametrize("head_dim,group", [(128, 4), (64, 6), (128, 1)])
def test_lowers_for_cuda(head_dim, group):
    case, page_size = make_case(5, q_heads=2 * group, kv_heads=2, head_dim=head_dim,
                                dtype=jnp.bfloat16, bound_dtype=jnp.bfloat16)
    text = lower_for_cuda(lambda *a: quest_page_bound(*a, page_size=page_size,
                                                      backend="pallas", interpret=False),
                          *case.values())
    assert "quest_page_bound" in text


@pytest.mark.gpu
@pytest.mark.parametrize("batch,max_pages,lengths", [
    (1, 8193, [4096]), (2, 2049, [1, 32768]), (4, 260, [16, 17, 4095, 4160])])
def test_native_gpu(batch, max_pages, lengths):
    case, page_size = make_case(6, batch=batch, q_heads=32, kv_heads=8, head_dim=128,
                                page_size=16, max_pages=max_pages, lengths=lengths,
                                dtype=jnp.bfloat16, bound_dtype=jnp.bfloat16)
    want = quest_page_bound_reference(**case, page_size=page_size)
    got = quest_page_bound(**case, page_size=page_size, backend="pallas", interpret=False)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
