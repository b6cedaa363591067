"""Paged prefill attention: Pallas kernel vs the jnp reference, reference vs float64 numpy."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_checks import fp8_cache, fp8_lse_bound, lower_for_cuda, max_row_rel_error
from sparsejax.pallas_kernels import prefill_attention
from sparsejax.pallas_kernels.prefill_attention import (
    PrefillAttention, paged_prefill_attention, paged_prefill_attention_reference,
    paged_tile_scores, paged_tile_scores_reference)

OUT_TOL = {jnp.bfloat16: 1e-2, jnp.float16: 2e-3, jnp.float32: 1e-5}
LSE_ATOL = 1e-4


def make_case(seed, *, batch, chunk, q_heads, kv_heads, head_dim, page_size, max_pages, start,
              lengths, dtype, spare_pages=2):
    """Inputs over a shuffled page pool. Every slot at or past start + length of its row
    holds NaN and page-table entries past the row's pages are invalid ids, so any read past
    a row's last query poisons the result."""
    rng = np.random.default_rng(seed)
    num_pages = batch * max_pages + spare_pages
    q = rng.standard_normal((batch, chunk, q_heads, head_dim), np.float32)
    k = np.full((num_pages, kv_heads, page_size, head_dim), np.nan, np.float32)
    v = np.full_like(k, np.nan)
    page_table = rng.permutation(num_pages)[:batch * max_pages].reshape(batch, max_pages)
    for b in range(batch):
        end = start[b] + lengths[b]
        for t in range(end):
            page = page_table[b, t // page_size]
            k[page, :, t % page_size] = rng.standard_normal((kv_heads, head_dim))
            v[page, :, t % page_size] = rng.standard_normal((kv_heads, head_dim))
        used = -(-end // page_size)
        page_table[b, used:] = rng.choice([-1, num_pages + 5, 2**30], max_pages - used)
    as_i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
            as_i32(page_table), as_i32(start), as_i32(lengths))


def random_selection(seed, args, *, tile, k_max):
    """Per (row, tile, KV head) up to k_max unique positions before the tile, with -1
    padding and a few entries at or past the tile start that the kernel must skip."""
    rng = np.random.default_rng(seed)
    q, k_pages, _, _, start, lengths = args
    batch, chunk = q.shape[:2]
    kv_heads = k_pages.shape[1]
    tiles = -(-chunk // tile)
    indices = np.full((batch, tiles, kv_heads, k_max), -1, np.int32)
    count = np.zeros((batch, tiles, kv_heads), np.int32)
    for b in range(batch):
        for t in range(tiles):
            lo = int(start[b]) + t * tile
            for h in range(kv_heads):
                n = min(lo, int(rng.integers(0, k_max + 1)))
                picks = rng.permutation(lo)[:n]
                if n and rng.random() < 0.5:   # an entry inside the tile: skipped
                    picks[-1] = lo + int(rng.integers(0, tile))
                indices[b, t, h, :n] = picks
                count[b, t, h] = n
    return jnp.asarray(indices), jnp.asarray(count)


def numpy_attention(q, k_pages, v_pages, page_table, start, lengths, sm_scale, *,
                    indices=None, count=None, tile=128):
    """float64 loops over rows, queries and heads: out and lse."""
    q, k_pages, v_pages = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages))
    batch, chunk, q_heads, head_dim = q.shape
    _, kv_heads, page_size, _ = k_pages.shape
    group = q_heads // kv_heads
    out = np.zeros(q.shape)
    lse = np.full(q.shape[:3], -np.inf)
    for b in range(batch):
        for i in range(int(lengths[b])):
            pos = int(start[b]) + i
            for h in range(q_heads):
                kv = h // group
                keys = list(range(pos + 1))
                if indices is not None:
                    t = i // tile
                    lo = int(start[b]) + t * tile
                    sel = {int(x) for x in indices[b, t, kv, :count[b, t, kv]] if 0 <= x < lo}
                    keys = sorted(sel) + list(range(lo, pos + 1))
                kk = np.stack([k_pages[page_table[b, j // page_size], kv, j % page_size]
                               for j in keys])
                vv = np.stack([v_pages[page_table[b, j // page_size], kv, j % page_size]
                               for j in keys])
                s = kk @ q[b, i, h] * sm_scale
                lse[b, i, h] = np.log(np.sum(np.exp(s - s.max()))) + s.max()
                out[b, i, h] = np.exp(s - lse[b, i, h]) @ vv
    return out, lse


def assert_matches(got, want, dtype):
    assert isinstance(got, PrefillAttention)
    assert got.out.shape == want.out.shape and got.out.dtype == want.out.dtype
    assert got.lse.shape == want.lse.shape and got.lse.dtype == jnp.float32
    err = max_row_rel_error(got.out, want.out)
    assert err <= OUT_TOL[dtype], err
    np.testing.assert_array_equal(np.isneginf(got.lse), np.isneginf(want.lse))
    np.testing.assert_allclose(got.lse, want.lse, rtol=0, atol=LSE_ATOL)


def _case(chunk, start, lengths, *, page_size=8, group=2, dtype=jnp.float32, head_dim=64):
    max_pages = -(-(max(start) + chunk) // page_size) + 1
    return dict(batch=len(start), chunk=chunk, q_heads=2 * group, kv_heads=2,
                head_dim=head_dim, page_size=page_size, max_pages=max_pages, start=start,
                lengths=lengths, dtype=dtype)


CASES = [   # chunk sizes 1, 7, 128, 300; starts at 0, mid-page, on a page boundary, deep; ragged
    (_case(1, [0, 13, 24], [1, 1, 0]), {}),
    (_case(7, [0, 5], [7, 3], dtype=jnp.bfloat16, group=4), {}),
    (_case(7, [3, 16], [5, 7], group=3), dict(num_splits=3)),
    # a short chunk deep in the cache: unmasked key blocks, split mid-stream
    (_case(7, [130, 67], [7, 4], group=4), dict(block_n=16, num_splits=3, lookahead=0)),
    (_case(128, [0, 37], [128, 100], page_size=16, dtype=jnp.float16), dict(block_n=32)),
    (_case(300, [0, 21], [300, 151], dtype=jnp.bfloat16, head_dim=128),
     dict(block_q=32, num_splits=2)),
]


@pytest.mark.parametrize("cfg,tuning", CASES)
def test_dense_matches_reference(cfg, tuning, interpret):
    args = make_case(1, **cfg)
    got = paged_prefill_attention(*args, backend="pallas", interpret=interpret, **tuning)
    assert_matches(got, paged_prefill_attention_reference(*args), cfg["dtype"])
    assert not np.any(np.isnan(np.asarray(got.out, np.float32)))


def contiguous_attention(q, k, v, q_len, kv_len, *, causal, sm_scale):
    """cuDNN's stand-in on CPU: XLA's `jax.nn.dot_product_attention` (the same padding and
    top-left causal masks) in float32, whose LSE then stays float32 -> (out, lse [B, T, HQ])."""
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    with jax.default_matmul_precision("highest"):   # not TF32 when the tests run on a GPU
        return jax.nn.dot_product_attention(*f32, scale=sm_scale, is_causal=causal,
                                            query_seq_lengths=q_len,
                                            key_value_seq_lengths=kv_len,
                                            implementation="xla", return_residual=True)


@pytest.mark.parametrize("cfg", [cfg for cfg, _ in CASES])
def test_split_prefill_matches_reference(cfg):
    """cuDNN's path (the chunk over its own keys and over the cache before it, merged by LSE)
    with a jnp attention in cuDNN's place: every case of the kernel test, NaN in unwritten
    slots and invalid page ids included."""
    args = make_case(1, **cfg)
    got = prefill_attention._prefill_split(*args, sm_scale=cfg["head_dim"] ** -0.5,
                                           attend=contiguous_attention)
    assert_matches(got, paged_prefill_attention_reference(*args), cfg["dtype"])


CHUNKED_PREFILL_CASES = [   # one start for every row, a multiple of the chunk
    _case(8, [40, 40], [8, 8]),          # five chunks before: runs of four and one
    _case(7, [21, 21, 21], [7, 7, 7], dtype=jnp.bfloat16, group=4),   # runs of two and one
    _case(16, [0, 0], [16, 16], page_size=16),                        # nothing before
    _case(8, [56, 56], [8, 3]),          # a partial last chunk: its own keys length-masked
]


@pytest.mark.parametrize("cfg", CHUNKED_PREFILL_CASES)
def test_split_prefill_of_chunked_prefill_needs_no_prefix_mask(cfg):
    """At chunked prefill's starts the positions before the chunk are attended in unmasked
    power-of-2 runs of chunks: the length-masked call over the whole span never runs (it is
    poisoned here), nor the masked causal one when every row fills the chunk."""
    full = all(n == cfg["chunk"] for n in cfg["lengths"])

    def attend(q, k, v, q_len, kv_len, *, causal, sm_scale):
        out, lse = contiguous_attention(q, k, v, q_len, kv_len, causal=causal,
                                        sm_scale=sm_scale)
        poisoned = kv_len is not None and (full or not causal)
        return (out * jnp.nan if poisoned else out), lse

    args = make_case(7, **cfg)
    got = prefill_attention._prefill_split(*args, sm_scale=cfg["head_dim"] ** -0.5,
                                           attend=attend)
    assert_matches(got, paged_prefill_attention_reference(*args), cfg["dtype"])


def test_auto_backend_picks_cudnn_for_long_dense_chunks():
    q = jnp.zeros((1, prefill_attention.CUDNN_MIN_CHUNK, 8, 128), jnp.bfloat16)
    k = jnp.zeros((4, 2, 16, 128), jnp.bfloat16)
    choose = prefill_attention._choose_backend
    if jax.default_backend() != "gpu":
        assert choose("auto", q, k, None) == "reference"
        return
    assert choose("auto", q, k, None) == "cudnn"
    assert choose("auto", q[:, :-1], k, None) == "pallas"          # a short chunk
    assert choose("auto", q, k, jnp.zeros((1, 4, 2, 3), jnp.int32)) == "pallas"   # sparse
    assert choose("auto", q.astype(jnp.float32), k.astype(jnp.float32), None) == "pallas"


@pytest.mark.parametrize("cfg,tile,k_max,tuning", [
    (_case(300, [0, 21], [300, 200]), 128, 40, {}),
    (_case(40, [9, 64], [40, 17], group=4, dtype=jnp.bfloat16), 16, 12,
     dict(block_q=8, lookahead=0)),
])
def test_sparse_matches_reference(cfg, tile, k_max, tuning, interpret):
    args = make_case(2, **cfg)
    indices, count = random_selection(3, args, tile=tile, k_max=k_max)
    got = paged_prefill_attention(*args, indices=indices, count=count, tile=tile,
                                  backend="pallas", interpret=interpret, **tuning)
    want = paged_prefill_attention_reference(*args, indices=indices, count=count, tile=tile)
    assert_matches(got, want, cfg["dtype"])


def test_reference_matches_float64_numpy():
    args = make_case(4, **_case(20, [0, 11], [20, 9], group=2))
    sm_scale = 0.3
    out, lse = numpy_attention(*args, sm_scale)
    ref = paged_prefill_attention_reference(*args, sm_scale=sm_scale)
    assert max_row_rel_error(ref.out, out) <= 1e-5
    np.testing.assert_allclose(ref.lse, lse, rtol=0, atol=1e-5)

    indices, count = random_selection(5, args, tile=8, k_max=6)
    out, lse = numpy_attention(*args, sm_scale, indices=np.asarray(indices),
                               count=np.asarray(count), tile=8)
    ref = paged_prefill_attention_reference(*args, indices=indices, count=count, tile=8,
                                            sm_scale=sm_scale)
    assert max_row_rel_error(ref.out, out) <= 1e-5
    np.testing.assert_allclose(ref.lse, lse, rtol=0, atol=1e-5)


def test_full_selection_is_dense(interpret):
    """Selecting every key before each tile gives dense causal attention."""
    cfg = _case(24, [5, 30], [24, 19])
    args = make_case(6, **cfg)
    batch, tile = 2, 8
    start = np.asarray(args[4])
    span = int(start.max()) + 24
    indices = np.full((batch, 3, 2, span), -1, np.int32)
    count = np.zeros((batch, 3, 2), np.int32)
    for b in range(batch):
        for t in range(3):
            lo = int(start[b]) + t * tile
            indices[b, t, :, :lo] = np.arange(lo)
            count[b, t] = lo
    got = paged_prefill_attention(*args, indices=jnp.asarray(indices),
                                  count=jnp.asarray(count), tile=tile, backend="pallas",
                                  interpret=interpret, block_q=8)
    assert_matches(got, paged_prefill_attention_reference(*args), jnp.float32)


def numpy_tile_scores(q, k_pages, page_table, start, lengths, lse, tile, sm_scale):
    """float64: per (row, tile, KV head) the dense probabilities of each key before the
    tile, summed over the tile's valid queries and the head's query group."""
    q, k_pages, lse = (np.asarray(x, np.float64) for x in (q, k_pages, lse))
    batch, chunk, q_heads, _ = q.shape
    _, kv_heads, page_size, _ = k_pages.shape
    group = q_heads // kv_heads
    span = page_table.shape[1] * page_size
    out = np.zeros((batch, -(-chunk // tile), kv_heads, span))
    for b in range(batch):
        for i in range(int(lengths[b])):
            t = i // tile
            lo = int(start[b]) + t * tile
            for h in range(q_heads if lo else 0):
                keys = np.stack([k_pages[page_table[b, j // page_size], h // group,
                                         j % page_size] for j in range(lo)])
                out[b, t, h // group, :lo] += np.exp(keys @ q[b, i, h] * sm_scale - lse[b, i, h])
    return out


@pytest.mark.parametrize("cfg,tile,tuning", [
    (_case(40, [0, 21], [40, 30], group=4), 16, dict(lookahead=0)),
    (_case(70, [5, 64], [70, 33], dtype=jnp.bfloat16, head_dim=128), 32,
     dict(block_q=16, num_splits=2)),
])
def test_tile_scores_match_reference_and_numpy(cfg, tile, tuning, interpret):
    args = make_case(10, **cfg)
    q, k, _, page_table, start, lengths = args
    lse = paged_prefill_attention_reference(*args).lse
    got = paged_tile_scores(q, k, page_table, start, lengths, lse, tile=tile, backend="pallas",
                            interpret=interpret, **tuning)
    want = paged_tile_scores_reference(q, k, page_table, start, lengths, lse, tile=tile)
    assert got.shape == want.shape and got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=2e-5 if cfg["dtype"] == jnp.float32 else 1e-2,
                               atol=1e-5)
    exact = numpy_tile_scores(q, np.where(np.isnan(k), 0, k), np.asarray(page_table), start,
                              lengths, lse, tile, 1 / np.sqrt(q.shape[-1]))
    np.testing.assert_allclose(want, exact, rtol=1e-4, atol=1e-5)


def test_negative_controls_fail_the_metric(interpret):
    """Swapped K/V, or a causal mask one position too wide, must fail the tolerances."""
    cfg = _case(20, [0, 11], [20, 20], dtype=jnp.bfloat16)
    q, k, v, page_table, start, lengths = make_case(7, **cfg)
    want = paged_prefill_attention_reference(q, k, v, page_table, start, lengths)
    swapped = paged_prefill_attention(q, v, k, page_table, start, lengths, backend="pallas",
                                      interpret=interpret)
    assert max_row_rel_error(swapped.out, want.out) > 10 * OUT_TOL[jnp.bfloat16]
    # queries one position later see one more key: an off-by-one causal mask
    shifted = paged_prefill_attention(q, k, v, page_table, start + 1, lengths - 1,
                                      backend="pallas", interpret=interpret)
    err = max_row_rel_error(shifted.out[:, :19], want.out[:, :19])
    assert err > 10 * OUT_TOL[jnp.bfloat16], err


def test_auto_backend_is_reference_on_cpu():
    if jax.default_backend() == "gpu":
        pytest.skip("auto picks Pallas on GPU")
    args = make_case(8, **_case(5, [2, 0], [5, 4]))
    for a, b in zip(paged_prefill_attention(*args), paged_prefill_attention_reference(*args)):
        np.testing.assert_array_equal(a, b)


FP8_CACHE = dict(k_pages=((6, 2, 16, 64), jnp.float8_e4m3fn),
                 v_pages=((6, 2, 16, 64), jnp.float8_e4m3fn))


def _valid_args(**over):
    shapes = dict(q=((2, 4, 8, 64), jnp.bfloat16), k_pages=((6, 2, 16, 64), jnp.bfloat16),
                  v_pages=((6, 2, 16, 64), jnp.bfloat16), page_table=((2, 3), jnp.int32),
                  start=((2,), jnp.int32), lengths=((2,), jnp.int32))
    shapes.update(over)
    return [jnp.zeros(s, d) for s, d in shapes.values()]


@pytest.mark.parametrize("over,kwargs,match", [
    (dict(q=((2, 4, 8, 96), jnp.bfloat16), k_pages=((6, 2, 16, 96), jnp.bfloat16),
          v_pages=((6, 2, 16, 96), jnp.bfloat16)),
     dict(backend="pallas"), r"head_dim=96: expected one of \(64, 128, 256\)"),
    (dict(k_pages=((6, 2, 4, 64), jnp.bfloat16), v_pages=((6, 2, 4, 64), jnp.bfloat16)),
     dict(backend="pallas"), r"page_size=4: expected one of"),
    (dict(q=((2, 4, 64, 64), jnp.bfloat16)), dict(backend="pallas"), r"group size 32"),
    (dict(q=((2, 8, 64), jnp.bfloat16)), {}, r"q\.shape=\(2, 8, 64\)"),
    (dict(q=((2, 4, 7, 64), jnp.bfloat16)), {}, r"q_heads=7: expected a multiple"),
    (dict(v_pages=((6, 2, 16, 64), jnp.float16)), {}, r"v_pages\.dtype=float16"),
    (dict(start=((3,), jnp.int32)), {}, r"start int32\[3\]: expected int32\[2\]"),
    (dict(lengths=((2,), jnp.float32)), {}, r"lengths float32\[2\]"),
    (dict(page_table=((2, 3), jnp.int16)), {}, r"page_table int16\[2, 3\]"),
    ({}, dict(indices=jnp.zeros((2, 1, 2, 5), jnp.int32)), r"indices and count"),
    ({}, dict(indices=jnp.zeros((2, 2, 2, 5), jnp.int32), count=jnp.zeros((2, 2, 2), jnp.int32)),
     r"indices int32\[2, 2, 2, 5\]: expected int32\[2, 1, 2, k\]"),
    ({}, dict(indices=jnp.zeros((2, 1, 2, 5), jnp.int32), count=jnp.zeros((2, 2), jnp.int32)),
     r"count int32\[2, 2\]"),
    ({}, dict(tile=0), r"tile=0"),
    ({}, dict(backend="pallas", block_q=3), r"block_q=3"),
    ({}, dict(backend="pallas", block_q=1), r"block_q=1: block_q x padded group \(4\)"),
    ({}, dict(backend="pallas", block_n=8), r"block_n=8"),
    ({}, dict(backend="pallas", num_splits=0), r"num_splits=0"),
    ({}, dict(backend="pallas", indices=jnp.zeros((2, 1, 2, 5), jnp.int32), tile=8,
              count=jnp.zeros((2, 1, 2), jnp.int32), block_q=16), r"block_q=16 must divide"),
    ({}, dict(backend="gpu"), r"backend='gpu'"),
    ({}, dict(backend="cudnn", indices=jnp.zeros((2, 1, 2, 5), jnp.int32),
              count=jnp.zeros((2, 1, 2), jnp.int32)), r"backend='cudnn': the sparse variant"),
    (dict(q=((2, 4, 8, 64), jnp.float32), k_pages=((6, 2, 16, 64), jnp.float32),
          v_pages=((6, 2, 16, 64), jnp.float32)),
     dict(backend="cudnn"), r"backend='cudnn': q\.dtype=float32: cuDNN takes bfloat16"),
    (FP8_CACHE, {}, r"k_pages\.dtype=float8_e4m3fn: expected k_scale float32\[6, 2, 16\]"),
    (FP8_CACHE, dict(k_scale=jnp.ones((6, 2, 16)), v_scale=jnp.ones((6, 16))),
     r"v_scale=float32\[6, 16\]: expected float32\[6, 2, 16\]"),
    ({}, dict(v_scale=jnp.ones((6, 2, 16))), r"v_scale=given with k_scale=None"),
])
def test_bad_inputs_raise_clear_errors(over, kwargs, match):
    with pytest.raises(ValueError, match=match):
        paged_prefill_attention(*_valid_args(**over), **kwargs)


def test_tile_scores_refuse_an_fp8_cache_without_its_scale():
    q, k, _, page_table, start, lengths = _valid_args(**FP8_CACHE)
    with pytest.raises(ValueError, match=r"k_pages\.dtype=float8_e4m3fn: expected k_scale"):
        paged_tile_scores(q, k, page_table, start, lengths, jnp.zeros(q.shape[:3]))


@pytest.mark.parametrize("head_dim,page_size,dtype,group,sparse", [
    (128, 16, jnp.bfloat16, 4, False), (128, 16, jnp.bfloat16, 4, True),
    (64, 8, jnp.float16, 8, False), (256, 32, jnp.float32, 3, True),
    (128, 64, jnp.bfloat16, 16, False),
])
def test_lowers_for_cuda(head_dim, page_size, dtype, group, sparse):
    kv_heads, batch, chunk, max_pages = 2, 2, 200, 40
    S = jax.ShapeDtypeStruct
    args = [S((batch, chunk, group * kv_heads, head_dim), dtype),
            S((batch * max_pages, kv_heads, page_size, head_dim), dtype),
            S((batch * max_pages, kv_heads, page_size, head_dim), dtype),
            S((batch, max_pages), jnp.int32), S((batch,), jnp.int32), S((batch,), jnp.int32)]
    if sparse:
        args += [S((batch, 2, kv_heads, 100), jnp.int32), S((batch, 2, kv_heads), jnp.int32)]

    def fn(*a):
        extra = dict(indices=a[6], count=a[7]) if sparse else {}
        return paged_prefill_attention(*a[:6], backend="pallas", interpret=False, **extra)
    assert "triton" in lower_for_cuda(fn, *args)


def test_lowers_for_cuda_with_a_cache_over_4gib():
    """The correction benchmark's shape: offsets past 2**31 elements."""
    S = jax.ShapeDtypeStruct
    cache = S((32 * 16 * 2050, 8, 16, 128), jnp.bfloat16)
    args = (S((16, 32, 32, 128), jnp.bfloat16), cache, cache, S((16, 2050), jnp.int32),
            S((16,), jnp.int32), S((16,), jnp.int32))
    assert "triton" in lower_for_cuda(
        lambda *a: paged_prefill_attention(*a, backend="pallas", interpret=False), *args)


def test_tile_scores_lower_for_cuda():
    S = jax.ShapeDtypeStruct
    args = [S((1, 256, 32, 128), jnp.bfloat16), S((80, 8, 16, 128), jnp.bfloat16),
            S((1, 80), jnp.int32), S((1,), jnp.int32), S((1,), jnp.int32),
            S((1, 256, 32), jnp.float32)]
    assert "triton" in lower_for_cuda(
        lambda *a: paged_tile_scores(*a, backend="pallas", interpret=False), *args)


@pytest.mark.gpu
def test_native_gpu_long_chunk():
    args = make_case(9, **_case(1000, [0, 3000], [1000, 777], page_size=16,
                                dtype=jnp.bfloat16, head_dim=128, group=4))
    got = paged_prefill_attention(*args, backend="pallas", interpret=False)
    assert_matches(got, paged_prefill_attention_reference(*args), jnp.bfloat16)


@pytest.mark.gpu
def test_native_gpu_cudnn():
    """cuDNN's path natively: a long chunk deep in the cache, ragged, and a row starting at 0."""
    args = make_case(9, **_case(1000, [0, 3000], [1000, 777], page_size=16,
                                dtype=jnp.bfloat16, head_dim=128, group=4))
    got = paged_prefill_attention(*args, backend="cudnn")
    assert_matches(got, paged_prefill_attention_reference(*args), jnp.bfloat16)
    auto = paged_prefill_attention(*args)   # picks cuDNN: a dense bf16 chunk of 1000 queries
    np.testing.assert_array_equal(np.asarray(auto.out, np.float32),
                                  np.asarray(got.out, np.float32))


# ---- an fp8 (float8_e4m3fn) cache with a scale per (page, KV head, slot) -------------------
def fp8_args(args):
    """(the fp8 cache's k/v pages and scales as keywords, args on that cache dequantized to
    q's dtype: the rows cuDNN's path takes)."""
    q, k, v, page_table, start, lengths = args
    fp8, (k_deq, v_deq) = fp8_cache(k, v, q.dtype)
    return fp8, (q, k_deq, v_deq, page_table, start, lengths)


def assert_fp8_matches(got, args, dtype, *, rounded_k=False, **kw):
    """A result on the fp8 cache of `args` against the reference on that cache (f32
    dequantization) at the 16-bit tolerances, and against the reference on the cache
    dequantized to q's dtype within what that rounding of K moves the LSE: the Pallas
    kernel's dots take the fp8 values exactly and its scales multiply the f32 logits.
    rounded_k (cuDNN's path, which takes the rows dequantized to q's dtype): the other way
    round."""
    fp8, dequantized = fp8_args(args)
    q, _, _, page_table, start, lengths = args
    exact = paged_prefill_attention_reference(q, page_table=page_table, start=start,
                                              lengths=lengths, **fp8, **kw)
    rounded = paged_prefill_attention_reference(*dequantized, **kw)
    tight, loose = (rounded, exact) if rounded_k else (exact, rounded)
    assert_matches(got, tight, dtype)
    assert max_row_rel_error(got.out, loose.out) <= OUT_TOL[dtype]
    finite = np.isfinite(np.asarray(loose.lse))
    bound = fp8_lse_bound(q, dequantized[1], q.shape[-1] ** -0.5)
    np.testing.assert_allclose(np.asarray(got.lse)[finite], np.asarray(loose.lse)[finite],
                               rtol=0, atol=LSE_ATOL + bound)


FP8_CASES = [CASES[1], CASES[3], CASES[4]]  # bf16 / f32 deep and split / f16 chunk of 128


@pytest.mark.parametrize("cfg,tuning", FP8_CASES)
def test_fp8_dense_matches_reference(cfg, tuning, interpret):
    args = make_case(1, **cfg)
    fp8, _ = fp8_args(args)
    q, _, _, page_table, start, lengths = args
    got = paged_prefill_attention(q, page_table=page_table, start=start, lengths=lengths, **fp8,
                                  backend="pallas", interpret=interpret, **tuning)
    assert_fp8_matches(got, args, cfg["dtype"])


def test_fp8_sparse_matches_reference(interpret):
    cfg = _case(40, [9, 64], [40, 17], group=4, dtype=jnp.bfloat16)
    args = make_case(2, **cfg)
    indices, count = random_selection(3, args, tile=16, k_max=12)
    fp8, _ = fp8_args(args)
    q, _, _, page_table, start, lengths = args
    sel = dict(indices=indices, count=count, tile=16)
    got = paged_prefill_attention(q, page_table=page_table, start=start, lengths=lengths, **fp8,
                                  **sel, backend="pallas", interpret=interpret, block_q=8)
    assert_fp8_matches(got, args, jnp.bfloat16, **sel)


def test_fp8_split_prefill_matches_reference():
    """cuDNN's path on an fp8 cache (chunked prefill's unmasked runs and a ragged row): the
    gathered rows dequantized to q's dtype."""
    cfg = _case(8, [40, 40], [8, 5], dtype=jnp.bfloat16)
    args = make_case(1, **cfg)
    fp8, _ = fp8_args(args)
    q, _, _, page_table, start, lengths = args
    got = prefill_attention._prefill_split(q, fp8["k_pages"], fp8["v_pages"], page_table, start,
                                           lengths, sm_scale=cfg["head_dim"] ** -0.5,
                                           attend=contiguous_attention, k_scale=fp8["k_scale"],
                                           v_scale=fp8["v_scale"])
    assert_fp8_matches(got, args, cfg["dtype"], rounded_k=True)


def test_fp8_tile_scores_match_reference(interpret):
    cfg, tile = _case(70, [5, 64], [70, 33], dtype=jnp.bfloat16, head_dim=128), 32
    args = make_case(10, **cfg)
    fp8, dequantized = fp8_args(args)
    q, _, _, page_table, start, lengths = args
    lse = paged_prefill_attention_reference(*dequantized).lse
    got = paged_tile_scores(q, fp8["k_pages"], page_table, start, lengths, lse, tile=tile,
                            k_scale=fp8["k_scale"], backend="pallas", interpret=interpret,
                            block_q=16, num_splits=2)
    # the reference on the fp8 cache (K dequantized in f32): the kernel's dots take the fp8
    # values exactly and its scales multiply the f32 logits
    want = paged_tile_scores_reference(q, fp8["k_pages"], page_table, start, lengths, lse,
                                       tile=tile, k_scale=fp8["k_scale"])
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-5)
    # on the cache dequantized to bf16: its rounding of K moves a logit, so a probability by
    # a factor of at most exp(fp8_lse_bound)
    rounded = paged_tile_scores_reference(q, dequantized[1], page_table, start, lengths, lse,
                                          tile=tile)
    bound = fp8_lse_bound(q, dequantized[1], q.shape[-1] ** -0.5)
    np.testing.assert_allclose(got, rounded, rtol=1e-2 + np.expm1(bound), atol=1e-5)
    # K scales of the wrong head: far off
    wrong = paged_tile_scores(q, fp8["k_pages"], page_table, start, lengths, lse, tile=tile,
                              k_scale=fp8["k_scale"][:, ::-1], backend="pallas",
                              interpret=interpret, block_q=16, num_splits=2)
    assert not np.allclose(wrong, want, rtol=1e-1, atol=1e-3)


@pytest.mark.parametrize("sparse", [False, True])
def test_fp8_lowers_for_cuda(sparse):
    kv_heads, batch, chunk, max_pages, group, head_dim, page_size = 2, 2, 200, 40, 4, 128, 16
    S = jax.ShapeDtypeStruct
    cache = S((batch * max_pages, kv_heads, page_size, head_dim), jnp.float8_e4m3fn)
    scale = S(cache.shape[:-1], jnp.float32)
    args = [S((batch, chunk, group * kv_heads, head_dim), jnp.bfloat16), cache, cache,
            S((batch, max_pages), jnp.int32), S((batch,), jnp.int32), S((batch,), jnp.int32),
            scale, scale]
    if sparse:
        args += [S((batch, 2, kv_heads, 100), jnp.int32), S((batch, 2, kv_heads), jnp.int32)]

    def fn(*a):
        extra = dict(indices=a[8], count=a[9]) if sparse else {}
        return paged_prefill_attention(*a[:6], k_scale=a[6], v_scale=a[7], backend="pallas",
                                       interpret=False, **extra)
    assert "triton" in lower_for_cuda(fn, *args)


def test_fp8_tile_scores_lower_for_cuda():
    S = jax.ShapeDtypeStruct
    args = [S((1, 256, 32, 128), jnp.bfloat16), S((80, 8, 16, 128), jnp.float8_e4m3fn),
            S((1, 80), jnp.int32), S((1,), jnp.int32), S((1,), jnp.int32),
            S((1, 256, 32), jnp.float32), S((80, 8, 16), jnp.float32)]
    assert "triton" in lower_for_cuda(
        lambda *a: paged_tile_scores(*a[:6], k_scale=a[6], backend="pallas", interpret=False),
        *args)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["pallas", "cudnn"])
def test_native_gpu_fp8_long_chunk(backend):
    args = make_case(9, **_case(1000, [0, 3000], [1000, 777], page_size=16,
                                dtype=jnp.bfloat16, head_dim=128, group=4))
    fp8, _ = fp8_args(args)
    q, _, _, page_table, start, lengths = args
    got = paged_prefill_attention(q, page_table=page_table, start=start, lengths=lengths, **fp8,
                                  backend=backend, **({} if backend == "cudnn" else
                                                      dict(interpret=False)))
    # cuDNN takes the rows dequantized to q's dtype: that rounding of K is its reference
    assert_fp8_matches(got, args, jnp.bfloat16, rounded_k=backend == "cudnn")
