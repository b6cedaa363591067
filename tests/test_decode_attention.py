"""Paged decode attention: Pallas kernel vs the jnp reference, reference vs float64 numpy."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernel_checks import (E4M3_MAX, E4M3_REL, E4M3_SUBNORMAL_STEP, fp8_cache, fp8_lse_bound,
                           lower_for_cuda, max_row_rel_error, quantize_kv)
from sparsejax.pallas_kernels import LogitRows, common, topk_select, topk_select_reference
from sparsejax.pallas_kernels.common import dequantize
from sparsejax.pallas_kernels.decode_attention import (
    MAX_MASKED_SPLITS, UNPOOLED_SCORES, DecodeAttention, default_tuning, float16_logits_bound,
    logits_dtype_for, paged_decode_attention, paged_decode_attention_reference)

OUT_TOL = {jnp.bfloat16: 1e-2, jnp.float16: 2e-3, jnp.float32: 1e-5}
LSE_ATOL = 1e-4
SCORE_RTOL, SCORE_ATOL = 1e-4, 1e-5
SCORES = (None, "max_heads", "group_sum", "mean_query", "head_probs")


def make_case(seed, *, batch, q_heads, kv_heads, head_dim, page_size, max_pages, lengths,
              dtype, spare_pages=3):
    """Inputs over a shuffled, non-contiguous page pool.

    Every cache slot that is not a valid token (tails of last pages, unused pages) holds NaN
    and every page-table entry past a row's pages is an invalid id, so any read past the
    length poisons the result.
    """
    rng = np.random.default_rng(seed)
    num_pages = batch * max_pages + spare_pages
    q = rng.standard_normal((batch, q_heads, head_dim), np.float32)
    k = np.full((num_pages, kv_heads, page_size, head_dim), np.nan, np.float32)
    v = np.full_like(k, np.nan)
    page_table = rng.permutation(num_pages)[:batch * max_pages].reshape(batch, max_pages)
    for b, n in enumerate(lengths):
        used = -(-n // page_size)
        for t in range(n):
            page = page_table[b, t // page_size]
            k[page, :, t % page_size] = rng.standard_normal((kv_heads, head_dim))
            v[page, :, t % page_size] = rng.standard_normal((kv_heads, head_dim))
        page_table[b, used:] = rng.choice([-1, num_pages + 5, 2**30], max_pages - used)
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
            jnp.asarray(page_table, jnp.int32), jnp.asarray(lengths, jnp.int32))


def assert_scores_match(got, want, bound=0.0):
    """got within SCORE_RTOL / SCORE_ATOL of want, plus `bound` (per element: what float16
    logits may add, `float16_logits_bound`)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    finite = np.isfinite(want)
    assert np.isfinite(got[finite]).all()
    err = np.abs(got[finite] - want[finite])
    allowed = (SCORE_ATOL + SCORE_RTOL * np.abs(want) + bound)[finite]
    assert (err <= allowed).all(), np.max(err / allowed)


def logits_bound(args, score, kv_heads=None, logits_dtype=None, **scales):
    """The bound the kernel's logits dtype (its default: float16 for 16-bit q) allows;
    `scales`: k_scale and v_scale of an fp8 cache."""
    if logits_dtype_for(args[0].dtype, logits_dtype) == jnp.float32:
        return 0.0
    return np.asarray(float16_logits_bound(*args, score=score, kv_heads=kv_heads, **scales))


def assert_matches_reference(args, *, score, dtype, interpret, kv_heads=None, **tuning):
    if kv_heads is not None:
        kv_heads = jnp.asarray(kv_heads)
    got = paged_decode_attention(*args, score=score, kv_heads=kv_heads, backend="pallas",
                                 interpret=interpret, **tuning)
    want = paged_decode_attention_reference(*args, score=score, kv_heads=kv_heads)
    assert isinstance(got, DecodeAttention)
    assert got.out.shape == args[0].shape and got.out.dtype == args[0].dtype
    assert got.lse.shape == args[0].shape[:2] and got.lse.dtype == jnp.float32
    err = max_row_rel_error(got.out, want.out)
    assert err <= OUT_TOL[dtype], err
    np.testing.assert_allclose(got.lse, want.lse, rtol=0, atol=LSE_ATOL)
    if score is None:
        assert got.scores is None and want.scores is None
    else:
        assert_scores_match(got.scores, want.scores,
                            logits_bound(args, score, kv_heads, tuning.get("logits_dtype")))


def special_lengths(draw, batch, page_size, max_tokens):
    picks = [1, page_size - 1, page_size, page_size + 1, max_tokens, max_tokens - 1]
    choice = st.one_of(st.sampled_from(picks), st.integers(1, max_tokens))
    return [min(max(draw(choice), 1), max_tokens) for _ in range(batch)]


@st.composite
def cases(draw):
    dtype = draw(st.sampled_from([jnp.bfloat16, jnp.float16, jnp.float32]))
    head_dim = draw(st.sampled_from([64, 128, 256]))
    page_size = draw(st.sampled_from([8, 16, 32, 64, 128]))
    group = draw(st.sampled_from([1, 3, 4, 8, 16]))
    kv_heads = draw(st.sampled_from([1, 2]))
    batch = draw(st.integers(1, 3))
    max_pages = draw(st.integers(1, max(1, 256 // page_size)))
    max_tokens = max_pages * page_size
    cfg = dict(batch=batch, q_heads=group * kv_heads, kv_heads=kv_heads, head_dim=head_dim,
               page_size=page_size, max_pages=max_pages, dtype=dtype,
               lengths=special_lengths(draw, batch, page_size, max_tokens))
    opts = dict(block_n=draw(st.sampled_from([None, 16, 32, 64])),
                num_splits=draw(st.sampled_from([None, 1, 2, 3, 8])),
                kv_heads=draw(st.one_of(st.none(), st.lists(
                    st.booleans(), min_size=kv_heads, max_size=kv_heads))))
    return cfg, draw(st.sampled_from(SCORES)), opts, draw(st.integers(0, 2**16))


@settings(max_examples=20, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=cases())
def test_matches_reference_hypothesis(case, interpret):
    cfg, score, opts, seed = case
    opts = {k: v for k, v in opts.items() if v is not None}
    assert_matches_reference(make_case(seed, **cfg), score=score, dtype=cfg["dtype"],
                             interpret=interpret, **opts)


# Hand-picked corners that a small derandomized sample might miss: every score with groups
# 1/4/8/16, every head_dim and page size, lengths at page boundaries, splits left empty,
# skipped KV heads, an empty row.
def _corner(q_heads, num_kv_heads, head_dim, page_size, max_pages, lengths, score, dtype,
            **opts):
    cfg = dict(q_heads=q_heads, kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
               max_pages=max_pages, lengths=lengths)
    return cfg, score, dtype, opts


CORNERS = [
    _corner(8, 8, 64, 8, 6, [1, 7, 8, 9, 48], None, jnp.float32),
    _corner(16, 4, 128, 16, 5, [15, 16, 17, 80], "max_heads", jnp.bfloat16, block_n=32,
            num_splits=4),
    _corner(16, 2, 256, 32, 3, [31, 96, 33], "group_sum", jnp.float16, num_splits=8),
    _corner(16, 1, 128, 64, 2, [1, 65, 128], "mean_query", jnp.float32, block_n=16),
    _corner(32, 2, 64, 128, 2, [129, 256], "max_heads", jnp.float32, block_n=64, num_splits=3),
    _corner(12, 3, 128, 8, 9, [72, 1, 40], "group_sum", jnp.bfloat16),
    _corner(8, 2, 64, 16, 4, [17, 64], "head_probs", jnp.bfloat16, block_n=32),
    _corner(12, 3, 64, 8, 5, [9, 0, 40], "max_heads", jnp.float32, kv_heads=(True, False, True),
            num_splits=2),
    _corner(8, 2, 128, 16, 3, [1, 33], "mean_query", jnp.bfloat16, kv_heads=(False, True)),
]


@pytest.mark.parametrize("cfg,score,dtype,opts", CORNERS)
def test_matches_reference_corners(cfg, score, dtype, opts, interpret):
    args = make_case(7, batch=len(cfg["lengths"]), dtype=dtype, **cfg)
    assert_matches_reference(args, score=score, dtype=dtype, interpret=interpret, **opts)


def numpy_attention(q, k_pages, v_pages, page_table, lengths, sm_scale):
    """float64 loops over rows and heads: out, lse and every score."""
    q, k_pages, v_pages = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages))
    batch, q_heads, _ = q.shape
    _, kv_heads, page_size, _ = k_pages.shape
    max_pages = page_table.shape[1]
    group = q_heads // kv_heads
    out, lse = np.zeros(q.shape), np.zeros((batch, q_heads))
    max_heads = np.full((batch, max_pages), -np.inf)
    group_sum = np.full((batch, kv_heads, max_pages * page_size), -np.inf)
    mean_query = np.full_like(group_sum, -np.inf)
    head_probs = np.full((batch, q_heads, max_pages * page_size), -np.inf)
    for b in range(batch):
        n = int(lengths[b])
        pages = [int(page_table[b, t // page_size]) for t in range(n)]
        probs = head_probs[b, :, :n]
        for h in range(q_heads):
            kv = h // group
            k = np.stack([k_pages[p, kv, t % page_size] for t, p in enumerate(pages)])
            v = np.stack([v_pages[p, kv, t % page_size] for t, p in enumerate(pages)])
            s = k @ q[b, h] * sm_scale
            lse[b, h] = np.log(np.sum(np.exp(s - s.max()))) + s.max()
            probs[h] = np.exp(s - lse[b, h])
            out[b, h] = probs[h] @ v
        for kv in range(kv_heads):
            rows = slice(kv * group, (kv + 1) * group)
            k = np.stack([k_pages[p, kv, t % page_size] for t, p in enumerate(pages)])
            group_sum[b, kv, :n] = probs[rows].sum(0)
            mean_query[b, kv, :n] = k @ q[b, rows].mean(0) * sm_scale
        per_token = probs.max(0)
        for page in range(-(-n // page_size)):
            max_heads[b, page] = per_token[page * page_size:(page + 1) * page_size].sum()
    return out, lse, dict(max_heads=max_heads, group_sum=group_sum, mean_query=mean_query,
                          head_probs=head_probs)


@pytest.mark.parametrize("seed,cfg", [
    (1, dict(q_heads=8, kv_heads=2, head_dim=64, page_size=8, max_pages=4, lengths=[1, 9, 32])),
    (2, dict(q_heads=4, kv_heads=4, head_dim=128, page_size=16, max_pages=3, lengths=[16, 47])),
])
def test_reference_matches_float64_numpy(seed, cfg):
    args = make_case(seed, batch=len(cfg["lengths"]), dtype=jnp.float32, **cfg)
    sm_scale = 0.3
    out, lse, scores = numpy_attention(*args, sm_scale)
    for score in SCORES:
        ref = paged_decode_attention_reference(*args, score=score, sm_scale=sm_scale)
        assert max_row_rel_error(ref.out, out) <= 1e-5
        np.testing.assert_allclose(ref.lse, lse, rtol=0, atol=1e-5)
        if score is not None:
            got = np.asarray(ref.scores)
            np.testing.assert_array_equal(np.isneginf(got), np.isneginf(scores[score]))
            finite = np.isfinite(scores[score])
            np.testing.assert_allclose(got[finite], scores[score][finite], rtol=1e-5, atol=1e-6)


def test_negative_controls_fail_the_metric(interpret):
    """Reading K for V, or ignoring the page table, must fail the tolerances used above."""
    cfg = dict(batch=2, q_heads=8, kv_heads=2, head_dim=64, page_size=16, max_pages=4,
               lengths=[40, 64], dtype=jnp.bfloat16)
    q, k, v, page_table, lengths = make_case(3, **cfg)
    want = paged_decode_attention_reference(q, k, v, page_table, lengths)
    swapped = paged_decode_attention(q, v, k, page_table, lengths, backend="pallas",
                                     interpret=interpret)
    assert max_row_rel_error(swapped.out, want.out) > 10 * OUT_TOL[jnp.bfloat16]
    assert np.max(np.abs(np.asarray(swapped.lse - want.lse))) > 10 * LSE_ATOL
    in_order = jnp.arange(page_table.size, dtype=jnp.int32).reshape(page_table.shape)
    unpaged = paged_decode_attention(q, k, v, in_order, lengths, backend="pallas",
                                     interpret=interpret)
    assert not max_row_rel_error(unpaged.out, want.out) <= OUT_TOL[jnp.bfloat16]


def test_scan_over_layers_with_offset_page_table(interpret):
    """The model's use: one multi-layer cache, page ids offset by layer * num_pages."""
    layers = 3
    q0, k0, v0, page_table, lengths = make_case(10, batch=2, q_heads=8, kv_heads=2, head_dim=64,
                                                page_size=8, max_pages=4, lengths=[5, 29],
                                                dtype=jnp.float32, spare_pages=0)
    bf16 = lambda x: x.astype(jnp.bfloat16)
    q = bf16(jnp.stack([q0 * (i + 1) for i in range(layers)]))
    ks = [bf16(k0 * (1 - 0.3 * i)) for i in range(layers)]
    vs = [bf16(v0 + i) for i in range(layers)]
    k_all, v_all = jnp.concatenate(ks), jnp.concatenate(vs)
    num_pages = k0.shape[0]

    @jax.jit
    def run(q, k_all, v_all):
        def layer(_, xs):
            q_l, offset = xs
            r = paged_decode_attention(q_l, k_all, v_all, page_table + offset, lengths,
                                       score="group_sum", backend="pallas", interpret=interpret)
            return None, r
        return jax.lax.scan(layer, None, (q, jnp.arange(layers, dtype=jnp.int32) * num_pages))[1]

    got = run(q, k_all, v_all)
    for i in range(layers):
        args = (q[i], ks[i], vs[i], page_table, lengths)
        want = paged_decode_attention_reference(*args, score="group_sum")
        assert max_row_rel_error(got.out[i], want.out) <= OUT_TOL[jnp.bfloat16]
        np.testing.assert_allclose(got.lse[i], want.lse, rtol=0, atol=LSE_ATOL)
        assert_scores_match(got.scores[i], want.scores, logits_bound(args, "group_sum"))


@pytest.mark.parametrize("score", ["max_heads", "group_sum", "head_probs", "mean_query"])
def test_logits_dtype(score, interpret):
    """bf16 inputs: float32 logits meet the strict tolerance; the default float16 logits stay
    within their derived bound, their error is 10x float32's (the float16 path is the one
    taken) and uses at least 1/50 of the bound (the bound is not loose: max_heads adds the
    worst case of a page's independent roundings, 4% of which are used here)."""
    args = make_case(12, batch=2, q_heads=8, kv_heads=2, head_dim=64, page_size=8,
                     max_pages=8, lengths=[37, 64], dtype=jnp.bfloat16)
    want = np.asarray(paged_decode_attention_reference(*args, score=score).scores)
    run = functools.partial(paged_decode_attention, *args, score=score, backend="pallas",
                            interpret=interpret, block_n=16)
    exact, got = np.asarray(run(logits_dtype=jnp.float32).scores), np.asarray(run().scores)
    assert_scores_match(exact, want)
    bound = np.asarray(float16_logits_bound(*args, score=score))
    assert_scores_match(got, want, bound)
    finite = np.isfinite(want)
    err, err_exact = (np.abs(x[finite] - want[finite]) for x in (got, exact))
    assert err.max() > 10 * err_exact.max()
    assert np.max(err / bound[finite]) > 0.02


def test_auto_backend_is_reference_on_cpu():
    args = make_case(4, batch=2, q_heads=4, kv_heads=2, head_dim=64, page_size=8, max_pages=2,
                     lengths=[3, 16], dtype=jnp.float32)
    if jax.default_backend() == "gpu":
        pytest.skip("auto picks Pallas on GPU")
    auto = paged_decode_attention(*args, score="mean_query")
    ref = paged_decode_attention_reference(*args, score="mean_query")
    for a, b in zip(auto, ref):
        np.testing.assert_array_equal(a, b)


FP8_CACHE = dict(k_pages=((6, 2, 16, 64), jnp.float8_e4m3fn),
                 v_pages=((6, 2, 16, 64), jnp.float8_e4m3fn))


def _valid_args(**over):
    shapes = dict(q=((2, 8, 64), jnp.bfloat16), k_pages=((6, 2, 16, 64), jnp.bfloat16),
                  v_pages=((6, 2, 16, 64), jnp.bfloat16), page_table=((2, 3), jnp.int32),
                  lengths=((2,), jnp.int32))
    shapes.update(over)
    return [jnp.zeros(s, d) for s, d in shapes.values()]


@pytest.mark.parametrize("over,kwargs,error,match", [
    (dict(q=((2, 8, 96), jnp.bfloat16), k_pages=((6, 2, 16, 96), jnp.bfloat16),
          v_pages=((6, 2, 16, 96), jnp.bfloat16)),
     dict(backend="pallas"), ValueError, r"head_dim=96: expected one of \(64, 128, 256\)"),
    (dict(k_pages=((6, 2, 24, 64), jnp.bfloat16), v_pages=((6, 2, 24, 64), jnp.bfloat16)),
     dict(backend="pallas"), ValueError, r"page_size=24: expected one of \(8, 16, 32, 64, 128\)"),
    (dict(q=((2, 64, 64), jnp.bfloat16)), dict(backend="pallas"), ValueError,
     r"group size 32: expected at most 16"),
    (dict(q=((2, 7, 64), jnp.bfloat16)), {}, ValueError, r"q_heads=7: expected a multiple of"),
    (dict(k_pages=((6, 2, 16, 64), jnp.float32)), {}, ValueError, r"k_pages\.dtype=float32"),
    (dict(v_pages=((6, 2, 16, 64), jnp.float16)), {}, ValueError, r"v_pages\.dtype=float16"),
    (dict(q=((2, 8, 64), jnp.int32), k_pages=((6, 2, 16, 64), jnp.int32),
          v_pages=((6, 2, 16, 64), jnp.int32)), {}, ValueError, r"q\.dtype=int32"),
    (dict(v_pages=((7, 2, 16, 64), jnp.bfloat16)),
     {}, ValueError, r"v_pages\.shape=\(7, 2, 16, 64\)"),
    (dict(k_pages=((6, 16, 64), jnp.bfloat16)), {}, ValueError, r"k_pages\.shape"),
    (dict(q=((2, 64), jnp.bfloat16)), {}, ValueError, r"q\.shape=\(2, 64\)"),
    (dict(page_table=((3, 3), jnp.int32)), {}, ValueError, r"page_table int32\[3, 3\]"),
    (dict(page_table=((2, 3), jnp.float32)), {}, ValueError, r"page_table float32"),
    (dict(lengths=((2, 1), jnp.int32)), {}, ValueError, r"lengths int32\[2, 1\]"),
    ({}, dict(score="top"), ValueError, r"score='top'"),
    ({}, dict(score="group_sum", logits_dtype=jnp.bfloat16), ValueError,
     r"logits_dtype=.*bfloat16.*: expected None, float16 or float32"),
    ({}, dict(score="group_sum", logits_dtype="fast"), ValueError, r"logits_dtype='fast'"),
    ({}, dict(backend="cuda"), ValueError, r"backend='cuda'"),
    ({}, dict(backend="pallas", block_n=48), ValueError, r"block_n=48"),
    ({}, dict(backend="pallas", block_n=8), ValueError, r"block_n=8"),
    ({}, dict(backend="pallas", num_splits=0), ValueError, r"num_splits=0"),
    ({}, dict(backend="pallas", num_warps=3), ValueError, r"num_warps=3"),
    ({}, dict(backend="pallas", num_stages=0), ValueError, r"num_stages=0"),
    ({}, dict(pages_per_blok=2), TypeError, r"pages_per_blok"),
    ({}, dict(kv_heads=jnp.ones((3,), bool)), ValueError, r"kv_heads bool\[3\]"),
    ({}, dict(kv_heads=jnp.ones((2,), jnp.float32)), ValueError, r"kv_heads float32\[2\]"),
    ({}, dict(values=False), ValueError, r"values=False .* needs a score, got score=None"),
    # an fp8 cache: its scales, both, of the pages' shape without head_dim, float32
    (FP8_CACHE, {}, ValueError,
     r"k_pages\.dtype=float8_e4m3fn: expected k_scale float32\[6, 2, 16\] .*got k_scale=None"),
    (FP8_CACHE, dict(k_scale=jnp.ones((6, 2, 16))), ValueError,
     r"k_scale=given with v_scale=None: expected both"),
    (FP8_CACHE, dict(k_scale=jnp.ones((6, 2, 8)), v_scale=jnp.ones((6, 2, 16))), ValueError,
     r"k_scale=float32\[6, 2, 8\]: expected float32\[6, 2, 16\]"),
    (FP8_CACHE, dict(k_scale=jnp.ones((6, 2, 16)), v_scale=jnp.ones((6, 2, 16), jnp.bfloat16)),
     ValueError, r"v_scale=bfloat16\[6, 2, 16\]: expected float32\[6, 2, 16\]"),
    ({}, dict(k_scale=jnp.ones((6, 2, 16)), v_scale=jnp.ones((6, 2, 16))), ValueError,
     r"k_scale=given with k_pages\.dtype=bfloat16: expected k_pages in float8_e4m3fn"),
])
def test_bad_inputs_raise_clear_errors(over, kwargs, error, match):
    with pytest.raises(error, match=match):
        paged_decode_attention(*_valid_args(**over), **kwargs)


def test_reference_checks_inputs_too():
    with pytest.raises(ValueError, match=r"lengths int32\[3\]"):
        paged_decode_attention_reference(*_valid_args(lengths=((3,), jnp.int32)))


def test_shapes_outside_the_kernel_run_the_reference_under_auto():
    """Tiny test models (head_dim 16, page size 4, group 32) still get attention under auto."""
    args = make_case(5, batch=2, q_heads=32, kv_heads=1, head_dim=16, page_size=4, max_pages=3,
                     lengths=[5, 12], dtype=jnp.float32)
    auto = paged_decode_attention(*args, score="group_sum")
    ref = paged_decode_attention_reference(*args, score="group_sum")
    for a, b in zip(auto, ref):
        np.testing.assert_array_equal(a, b)


def _lowering_families():
    """Every (head_dim, page_size) pair, cycling dtypes, group sizes and scores."""
    dtypes = [jnp.bfloat16, jnp.float16, jnp.float32]
    groups = [1, 4, 8, 16, 3]
    fams = []
    for i, (d, p) in enumerate((d, p) for d in (64, 128, 256) for p in (8, 16, 32, 64, 128)):
        fams.append((d, p, dtypes[i % 3], groups[(i + i // 5) % 5], SCORES[i % 5], False))
    fams += [(128, 16, jnp.bfloat16, 4, s, True) for s in SCORES]
    return fams


@pytest.mark.parametrize("head_dim,page_size,dtype,group,score,masked", _lowering_families())
def test_lowers_for_cuda(head_dim, page_size, dtype, group, score, masked):
    kv_heads, batch, max_pages = 2, 3, 5
    S = jax.ShapeDtypeStruct
    args = (S((batch, group * kv_heads, head_dim), dtype),
            S((batch * max_pages, kv_heads, page_size, head_dim), dtype),
            S((batch * max_pages, kv_heads, page_size, head_dim), dtype),
            S((batch, max_pages), jnp.int32), S((batch,), jnp.int32), S((kv_heads,), jnp.bool_))
    hlo = lower_for_cuda(lambda *a: paged_decode_attention(
        *a[:5], score=score, kv_heads=a[5] if masked else None, backend="pallas",
        interpret=False), *args)
    assert "triton" in hlo


def assert_scores_pass_matches(args, *, score, interpret, kv_heads=None, **tuning):
    """The scores pass alone (values=False): out None, lse and scores those of the full pass
    at the same knobs (the same kernel arithmetic; XLA fuses the pooling epilogue differently
    without the output: up to 2e-6 relative on an H100, 10x under the kernel-vs-reference
    tolerance), for the kernel and the reference alike; at its own default knobs (twice the
    splits: other running maxes, so other float16 roundings) within the reference's bound."""
    if kv_heads is not None:
        kv_heads = jnp.asarray(kv_heads)
    run = lambda **kw: paged_decode_attention(*args, score=score, kv_heads=kv_heads,  # noqa: E731
                                              **kw)
    q, k_pages, _, page_table, _ = args
    same = dict(tuning)
    same.setdefault("num_splits", default_tuning(
        q.shape[0], k_pages.shape[1], q.shape[2], k_pages.shape[2], page_table.shape[1],
        q.dtype, scores=True)["num_splits"])
    full = run(backend="pallas", interpret=interpret, **same)
    alone = run(backend="pallas", interpret=interpret, values=False, **same)
    want = paged_decode_attention_reference(*args, score=score, kv_heads=kv_heads)
    want_alone = paged_decode_attention_reference(*args, score=score, kv_heads=kv_heads,
                                                  values=False)
    for got, ref in ((alone, full), (want_alone, want)):
        assert got.out is None
        np.testing.assert_allclose(got.lse, ref.lse, rtol=1e-5, atol=0)
        np.testing.assert_allclose(got.scores, ref.scores, rtol=1e-5, atol=1e-12)
    alone = run(backend="pallas", interpret=interpret, values=False, **tuning)
    assert alone.out is None
    np.testing.assert_allclose(alone.lse, want.lse, rtol=0, atol=LSE_ATOL)
    assert_scores_match(alone.scores, want.scores,
                        logits_bound(args, score, kv_heads, tuning.get("logits_dtype")))


@pytest.mark.parametrize("cfg,score,dtype,opts", [c for c in CORNERS if c[1] is not None])
def test_scores_pass_alone_equals_the_full_pass(cfg, score, dtype, opts, interpret):
    """Kascade's sparse anchors read K only; the pass must not change what it selects by."""
    args = make_case(11, batch=len(cfg["lengths"]), dtype=dtype, **cfg)
    assert_scores_pass_matches(args, score=score, interpret=interpret, **opts)


def test_scores_pass_alone_negative_control(interpret):
    """The check above sees a different pass: scores of another query differ."""
    cfg, score, dtype, opts = CORNERS[2]
    args = make_case(11, batch=len(cfg["lengths"]), dtype=dtype, **cfg)
    other = (args[0][::-1],) + args[1:]
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(
            paged_decode_attention(*other, score=score, values=False, backend="pallas",
                                   interpret=interpret, **opts).scores,
            paged_decode_attention(*args, score=score, backend="pallas", interpret=interpret,
                                   **opts).scores, rtol=1e-5, atol=1e-12)


UNPOOLED_CORNERS = [c for c in CORNERS if c[1] in UNPOOLED_SCORES]


@pytest.mark.parametrize("values", [True, False], ids=["full", "scores_pass"])
@pytest.mark.parametrize("cfg,score,dtype,opts", UNPOOLED_CORNERS)
def test_unpooled_scores(cfg, score, dtype, opts, values, interpret):
    """pool_scores=False hands back the kernel's logits as LogitRows [B, groups, G, T]:
    pooled (and masked where the pooled scores are -inf) they are the pooled scores, for the
    kernel and the reference alike, and the top-k that pools them as it reads selects what
    the reference top-k selects on the pooled scores."""
    args = make_case(13, batch=len(cfg["lengths"]), dtype=dtype, **cfg)
    opts = dict(opts)
    kv_heads = opts.pop("kv_heads", None)
    kw = dict(score=score, values=values, kv_heads=None if kv_heads is None else
              jnp.asarray(kv_heads))
    lengths = np.asarray(args[4])
    for backend in ("pallas", "reference"):
        tuning = dict(interpret=interpret, **opts) if backend == "pallas" else {}
        pooled = paged_decode_attention(*args, backend=backend, **kw, **tuning).scores
        raw = paged_decode_attention(*args, backend=backend, pool_scores=False, **kw,
                                     **tuning).scores
        assert isinstance(raw, LogitRows) and raw.shape == pooled.shape
        masked = jnp.where(jnp.isneginf(pooled), -jnp.inf, raw.scores())
        scale = np.max(np.abs(pooled[np.isfinite(pooled)]), initial=0.0)
        # the same values up to rounding: logits are rebuilt as (s - m) + m, probabilities
        # as exp(s - m) exp(m - lse)
        np.testing.assert_allclose(masked, pooled, rtol=2e-6, atol=1e-6 * scale)
        groups = pooled.shape[1]
        valid = np.repeat(np.minimum(lengths, pooled.shape[-1]), groups)
        if kv_heads is not None:  # the rows of skipped heads hold garbage: select none
            valid = valid * np.tile(np.repeat(kv_heads, groups // len(kv_heads)), len(lengths))
        k = max(1, pooled.shape[-1] // 4)
        got = topk_select(raw.rows(), k, valid=valid, backend="pallas", interpret=interpret)
        want = topk_select_reference(pooled.reshape(-1, pooled.shape[-1]), k, valid=valid)
        np.testing.assert_array_equal(got.count, want.count)
        if interpret:  # the GPU's exp may swap columns whose scores are within an ulp or two
            np.testing.assert_array_equal(got.indices, want.indices)


def test_unpooled_scores_reject_max_heads():
    args = make_case(4, batch=1, q_heads=4, kv_heads=2, head_dim=64, page_size=8,
                     max_pages=2, lengths=[9], dtype=jnp.float32)
    with pytest.raises(ValueError, match="pool_scores=False with score='max_heads'"):
        paged_decode_attention(*args, score="max_heads", pool_scores=False)


@pytest.mark.parametrize("score", SCORES[1:])
def test_scores_pass_lowers_for_cuda(score):
    S = jax.ShapeDtypeStruct
    kv_heads, batch, max_pages, page_size = 8, 64, 64, 16
    cache = S((batch * max_pages, kv_heads, page_size, 128), jnp.bfloat16)
    args = (S((batch, 4 * kv_heads, 128), jnp.bfloat16), cache, cache,
            S((batch, max_pages), jnp.int32), S((batch,), jnp.int32))
    hlo = lower_for_cuda(lambda *a: paged_decode_attention(
        *a, score=score, values=False, backend="pallas", interpret=False), *args)
    assert "triton" in hlo


def test_default_tuning_doubles_key_blocks_for_scores_at_a_full_wave():
    """The rule the selecting layers' benchmark measured (B=64, 8 KV heads, D=128 bf16)."""
    shape = (8, 128, 16, 8192, jnp.bfloat16)
    plain, scored = default_tuning(64, *shape), default_tuning(64, *shape, scores=True)
    assert (plain["block_n"], plain["num_stages"]) == (64, 2)
    assert (scored["block_n"], scored["num_stages"]) == (128, 3)
    assert default_tuning(4, *shape, scores=True) == default_tuning(4, *shape)  # 32 programs
    # the scores pass alone streams half the bytes per block: twice the splits
    assert (scored["num_splits"], default_tuning(64, *shape, scores=True, values=False)[
        "num_splits"]) == (2, 4)
    # the scores pass alone: 2 warps below a wave of row groups (16-bit), 4 from there
    alone = lambda b, **kw: default_tuning(b, *shape, scores=True, values=False, **kw)  # noqa: E731
    assert [alone(b)["num_warps"] for b in (1, 8, 16, 17, 64)] == [2, 2, 2, 4, 4]
    assert alone(8, kv_dtype=jnp.float8_e4m3fn)["num_warps"] == 4
    assert default_tuning(8, 8, 128, 16, 8192, jnp.float32, scores=True,
                          values=False)["num_warps"] == 4
    assert default_tuning(8, *shape, scores=True)["num_warps"] == 4


def test_default_splits_are_powers_of_2_once_row_groups_fill_the_sms():
    """B=32 x 8 KV heads wants 3 splits for ~4 waves, which measured slower than 2 or 4: a
    power of 2 once batch x kv_heads reaches the SM count; fewer row groups keep the count
    (B=16: 5). Two warps without scores from two waves of row groups (B=64), 16-bit only."""
    shape = (128, 16, 2048, jnp.bfloat16)
    assert [default_tuning(b, 8, *shape)["num_splits"] for b in (16, 32, 64)] == [5, 2, 2]
    assert default_tuning(32, 8, *shape, scores=True)["num_splits"] == 2
    assert default_tuning(32, 8, *shape, scores=True, values=False)["num_splits"] == 6
    assert [default_tuning(b, 8, *shape)["num_warps"] for b in (16, 32, 64)] == [4, 4, 2]
    assert default_tuning(64, 8, *shape, scores=True)["num_warps"] == 4
    assert default_tuning(64, 8, 128, 16, 2048, jnp.float32)["num_warps"] == 4


def test_default_tuning_of_an_fp8_cache():
    """An fp8 cache without scores: 3 stages; 2 warps and the 16-bit block below two waves of
    row groups, 1 warp and 32-token blocks from there (the H200 sweep: B=64 x 8 KV heads on
    132 SMs), and no more than 4 waves of programs below one wave of row groups; with
    scores, and for 16-bit caches, the rules above."""
    shape = (8, 128, 16, 2048, jnp.float16)
    for batch in (1, 16, 32):
        fp8 = default_tuning(batch, *shape, kv_dtype=jnp.float8_e4m3fn)
        assert (fp8["num_warps"], fp8["num_stages"]) == (2, 3)
        assert fp8["block_n"] == default_tuning(batch, *shape)["block_n"]
    fp8 = default_tuning(64, *shape, kv_dtype=jnp.float8_e4m3fn)
    assert (fp8["num_warps"], fp8["num_stages"], fp8["block_n"]) == (1, 3, 32)
    # below a wave of row groups at most 4 waves of programs (bf16: at least 4 waves)
    splits = lambda b, **kw: default_tuning(b, *shape, **kw)["num_splits"]  # noqa: E731
    assert [splits(b, kv_dtype=jnp.float8_e4m3fn) for b in (1, 8, 16)] == [66, 8, 4]
    assert [splits(b) for b in (1, 8, 16)] == [66, 9, 5]
    assert fp8["num_splits"] == default_tuning(64, *shape)["num_splits"]
    assert default_tuning(64, *shape, scores=True, kv_dtype=jnp.float8_e4m3fn) == default_tuning(
        64, *shape, scores=True)
    assert default_tuning(1, *shape, kv_dtype=jnp.bfloat16) == default_tuning(1, *shape)


def test_a_pool_past_4_gib_gets_knobs_for_64_bit_offsets():
    """Pallas-Triton widens an operand's offsets past 4 GiB (not at exactly 4 GiB): a 16-bit
    pool there, below two waves of row groups, takes 32-token blocks, 2 warps, 3 stages
    (DS-Qwen-1.5B heads at B=64: 128 row groups); a pass with scores and values from a
    quarter of a wave of row groups takes the 32 KiB tiles and 3 stages of a full wave's
    scores rule; two waves, fewer row groups, the scores pass alone and fp8 keep their rules;
    the kernel asks its pool."""
    S = jax.ShapeDtypeStruct
    page = 2 * 16 * 128  # elements of a page of 2 KV heads
    four_gib = 2**32 // (2 * page)
    assert not common.wide_offsets(S((four_gib, 2, 16, 128), jnp.bfloat16))
    assert common.wide_offsets(S((four_gib + 1, 2, 16, 128), jnp.bfloat16))
    assert not common.wide_offsets(S((four_gib + 1, 2, 16, 128), jnp.float8_e4m3fn))
    shape = (128, 16, 1024, jnp.bfloat16)
    knobs = lambda t: (t["block_n"], t["num_warps"], t["num_stages"])  # noqa: E731
    assert knobs(default_tuning(64, 2, *shape)) == (64, 4, 2)
    wide = default_tuning(64, 2, *shape, wide_offsets=True)
    assert knobs(wide) == (32, 2, 3)
    assert wide["num_splits"] == default_tuning(64, 2, *shape)["num_splits"]
    assert knobs(default_tuning(1, 8, 128, 16, 8192, jnp.bfloat16, wide_offsets=True)) == (32, 2, 3)
    scored = default_tuning(64, 2, *shape, wide_offsets=True, scores=True)
    assert knobs(scored) == (128, 4, 3)
    assert knobs(default_tuning(64, 2, *shape, scores=True)) == (64, 4, 2)
    assert knobs(default_tuning(8, 8, 128, 16, 2048, jnp.bfloat16, wide_offsets=True,
                                scores=True)) == (128, 4, 3)    # 64 row groups
    for batch in (1, 4):   # 8 and 32 row groups: many short splits
        assert knobs(default_tuning(batch, 8, 128, 16, 8192, jnp.bfloat16, wide_offsets=True,
                                    scores=True)) == (64, 4, 2)
    for kw in (dict(scores=True, values=False), dict(kv_dtype=jnp.float8_e4m3fn),
               dict(scores=True, kv_dtype=jnp.float8_e4m3fn)):
        assert default_tuning(64, 2, *shape, wide_offsets=True, **kw) == default_tuning(
            64, 2, *shape, **kw)
    assert default_tuning(64, 8, *shape, wide_offsets=True) == default_tuning(64, 8, *shape)
    batch, max_pages = 64, 1024
    for pages, block_n in ((four_gib, 64), (four_gib + 1, 32)):
        pool = S((pages, 2, 16, 128), jnp.bfloat16)
        hlo = lower_for_cuda(lambda *a: paged_decode_attention(*a, backend="pallas",
                                                               interpret=False),
                             S((batch, 12, 128), jnp.bfloat16), pool, pool,
                             S((batch, max_pages), jnp.int32), S((batch,), jnp.int32))
        assert f"block_n={block_n}_" in hlo


def test_default_splits_go_down_to_one_key_block():
    """B=1 on a cache sized to its context: as many splits as ~4 waves want, up to one per
    key block of 64 tokens (a 4160-token cache has 65), none at a single block."""
    assert default_tuning(1, 8, 128, 16, 260, jnp.bfloat16)["num_splits"] == 65
    assert default_tuning(1, 2, 128, 16, 65, jnp.bfloat16)["num_splits"] == 17
    assert default_tuning(1, 8, 128, 16, 8196, jnp.bfloat16)["num_splits"] == 66
    assert default_tuning(1, 8, 128, 16, 4, jnp.bfloat16)["num_splits"] == 1


def test_a_concrete_mask_sizes_the_splits_for_its_heads(interpret, monkeypatch):
    """One retrieval head of four, as numpy: the default splits are those of one KV head (a
    traced mask keeps the four heads' count), and the result is the traced mask's."""
    from sparsejax.pallas_kernels import decode_attention
    seen = []

    def recording(batch, kv_heads, *args, **kwargs):
        seen.append(kv_heads)
        return default_tuning(batch, kv_heads, *args, **kwargs)

    monkeypatch.setattr(decode_attention, "default_tuning", recording)
    args = make_case(3, batch=2, q_heads=8, kv_heads=4, head_dim=64, page_size=8, max_pages=6,
                     lengths=[40, 17], dtype=jnp.float32)
    mask = np.array([False, False, True, False])
    run = functools.partial(paged_decode_attention, *args, score="group_sum",
                            backend="pallas", interpret=interpret)
    concrete, traced = run(kv_heads=mask), jax.jit(lambda m: run(kv_heads=m))(jnp.asarray(mask))
    assert seen == [1, 4]
    long = (64, 8, 4096, jnp.float32)  # 32k tokens: enough key blocks for either count
    assert (default_tuning(2, 1, *long)["num_splits"], default_tuning(2, 4, *long)[
        "num_splits"]) == (264, 66)
    assert default_tuning(2, 1, *long, masked=True)["num_splits"] == MAX_MASKED_SPLITS
    np.testing.assert_allclose(concrete.out, traced.out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(concrete.lse, traced.lse, rtol=1e-6)
    assert_scores_match(concrete.scores, traced.scores, 1e-6)


def test_a_masked_selecting_pass_of_few_row_groups_takes_2_warps_and_3_stages():
    """LycheeDecode's retrieval pass (one KV head computed, scores and values, 16-bit cache)
    at up to a sixteenth of a wave of row groups; more row groups, the scores pass alone, an
    fp8 or float32 cache and an unmasked pass keep the other rules' knobs."""
    sms = common.num_sms()
    shape = (128, 16, 2048, jnp.bfloat16)
    pick = lambda b, *a, **kw: default_tuning(b, 1, *a, masked=True, **kw)  # noqa: E731
    few = sms // 16
    assert (pick(few, *shape, scores=True)["num_warps"],
            pick(few, *shape, scores=True)["num_stages"]) == (2, 3)
    assert pick(few + 1, *shape, scores=True)["num_warps"] == 4
    assert pick(1, *shape)["num_stages"] == 2
    assert pick(1, *shape, scores=True, values=False)["num_stages"] == 2
    assert pick(1, *shape, scores=True, kv_dtype=jnp.float8_e4m3fn)["num_warps"] == 4
    assert pick(1, 128, 16, 2048, jnp.float32, scores=True)["num_warps"] == 4
    assert default_tuning(1, 1, *shape, scores=True)["num_warps"] == 4


def test_lowers_for_cuda_with_a_cache_over_4gib():
    """The benchmark's 128k shape: offsets past 2**31 elements need 64-bit indexing."""
    S = jax.ShapeDtypeStruct
    batch, max_pages = 64, 8192
    cache = S((batch * max_pages, 8, 16, 128), jnp.bfloat16)
    args = (S((batch, 32, 128), jnp.bfloat16), cache, cache, S((batch, max_pages), jnp.int32),
            S((batch,), jnp.int32))
    hlo = lower_for_cuda(lambda *a: paged_decode_attention(
        *a, score="max_heads", backend="pallas", interpret=False), *args)
    assert "triton" in hlo


@pytest.mark.gpu
@pytest.mark.parametrize("batch,splits,warps", [(48, 2, 4), (72, 2, 2)])
def test_native_gpu_defaults_where_row_groups_fill_the_sms(batch, splits, warps):
    """The defaults that only many row groups reach: 48 x 4 KV heads rounds 3 splits down to
    2, 72 x 4 also takes 2 warps; against the reference, ragged rows, with and without
    scores."""
    kv_heads, page_size, max_pages = 4, 16, 24
    tuning = default_tuning(batch, kv_heads, 128, page_size, max_pages, jnp.bfloat16)
    assert (tuning["num_splits"], tuning["num_warps"]) == (splits, warps)
    keys = jax.random.split(jax.random.key(1), 3)
    num_pages = batch * max_pages
    q = jax.random.normal(keys[0], (batch, 4 * kv_heads, 128), jnp.bfloat16)
    k = jax.random.normal(keys[1], (num_pages, kv_heads, page_size, 128), jnp.bfloat16)
    v = jax.random.normal(keys[2], (num_pages, kv_heads, page_size, 128), jnp.bfloat16)
    page_table = jnp.asarray(np.random.default_rng(1).permutation(num_pages)
                             .reshape(batch, max_pages), jnp.int32)
    lengths = jnp.asarray(np.random.default_rng(2).integers(1, max_pages * page_size + 1,
                                                            batch), jnp.int32)
    args = (q, k, v, page_table, lengths)
    for score in (None, "group_sum"):
        assert_matches_reference(args, score=score, dtype=jnp.bfloat16, interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,head_dim,group", [(jnp.bfloat16, 128, 4),
                                                  (jnp.float16, 256, 8),
                                                  (jnp.float32, 64, 16)])
def test_native_gpu_moderate_size(dtype, head_dim, group):
    batch, kv_heads, page_size, max_pages = 8, 4, 16, 256
    rng = np.random.default_rng(0)
    lengths = [1, 15, 16, 17, 1000, 2049, max_pages * page_size - 1, max_pages * page_size]
    num_pages = batch * max_pages + 16
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (batch, group * kv_heads, head_dim), dtype)
    k = jax.random.normal(keys[1], (num_pages, kv_heads, page_size, head_dim), dtype)
    v = jax.random.normal(keys[2], (num_pages, kv_heads, page_size, head_dim), dtype)
    page_table = jnp.asarray(rng.permutation(num_pages)[:batch * max_pages]
                             .reshape(batch, max_pages), jnp.int32)
    args = (q, k, v, page_table, jnp.asarray(lengths, jnp.int32))
    for score in SCORES:
        assert_matches_reference(args, score=score, dtype=dtype, interpret=False)
        if score is not None:
            assert_scores_pass_matches(args, score=score, interpret=False)
    auto = paged_decode_attention(*args, score="max_heads")
    pallas = paged_decode_attention(*args, score="max_heads", backend="pallas", interpret=False)
    for a, b in zip(auto, pallas):
        np.testing.assert_array_equal(a, b)


# ---- an fp8 (float8_e4m3fn) cache with a scale per (page, KV head, slot) -------------------
def assert_fp8_matches(args, *, score, dtype, interpret, kv_heads=None, values=True,
                       **tuning):
    """The kernel on the fp8 cache of `args` against its reference on that cache (dequantized
    in f32) at the 16-bit tolerances: the kernel's dots take the fp8 values exactly and its
    scales multiply the f32 logits, so its logits are the reference's up to f32 rounding.
    And against the reference on the cache dequantized to q's dtype within what that
    rounding of K moves the LSE (`fp8_lse_bound`)."""
    q, k, v, page_table, lengths = args
    fp8, (k_deq, v_deq) = fp8_cache(k, v, dtype)
    kv_heads = None if kv_heads is None else jnp.asarray(kv_heads)
    kw = dict(score=score, kv_heads=kv_heads, values=values)
    got = paged_decode_attention(q, page_table=page_table, lengths=lengths, **fp8, **kw,
                                 backend="pallas", interpret=interpret, **tuning)
    fp8_args = (q, fp8["k_pages"], fp8["v_pages"], page_table, lengths)
    scales = dict(k_scale=fp8["k_scale"], v_scale=fp8["v_scale"])
    tight = paged_decode_attention_reference(*fp8_args, **scales, **kw)
    rounded = paged_decode_attention_reference(q, k_deq, v_deq, page_table, lengths, **kw)
    if values:
        assert got.out.dtype == dtype
        assert max_row_rel_error(got.out, tight.out) <= OUT_TOL[dtype]
        assert max_row_rel_error(got.out, rounded.out) <= OUT_TOL[dtype]
    else:
        assert got.out is None
    np.testing.assert_allclose(got.lse, tight.lse, rtol=0, atol=LSE_ATOL)
    bound = fp8_lse_bound(q, k_deq, q.shape[-1] ** -0.5)
    np.testing.assert_allclose(got.lse, rounded.lse, rtol=0, atol=LSE_ATOL + bound)
    if score is not None:
        assert_scores_match(got.scores, tight.scores,
                            logits_bound(fp8_args, score, kv_heads, **scales))


FP8_CORNERS = [  # every score and the scores pass, page boundaries, ragged and empty rows
    _corner(16, 4, 128, 16, 5, [15, 16, 17, 80], None, jnp.bfloat16, block_n=32, num_splits=3),
    _corner(12, 3, 64, 8, 5, [9, 0, 40], "max_heads", jnp.float32, kv_heads=(True, False, True),
            num_splits=2),
    _corner(16, 2, 128, 32, 3, [31, 96, 33], "group_sum", jnp.bfloat16, num_splits=4),
    _corner(8, 2, 128, 16, 3, [1, 33], "mean_query", jnp.float16, block_n=16),
    _corner(8, 2, 64, 16, 4, [17, 64], "head_probs", jnp.bfloat16, block_n=32),
    _corner(16, 2, 128, 16, 4, [16, 49], "group_sum", jnp.bfloat16, values=False),
    # the default at two waves of row groups: one warp, 32-token blocks, 3 stages
    _corner(16, 4, 128, 16, 6, [1, 31, 32, 33, 95], None, jnp.float16, block_n=32,
            num_splits=2, num_warps=1, num_stages=3),
]


@pytest.mark.parametrize("cfg,score,dtype,opts", FP8_CORNERS)
def test_fp8_matches_reference(cfg, score, dtype, opts, interpret):
    args = make_case(17, batch=len(cfg["lengths"]), dtype=dtype, **cfg)
    assert_fp8_matches(args, score=score, dtype=dtype, interpret=interpret, **opts)


@pytest.mark.parametrize("v_size", [1e-3, 1e3])
def test_fp8_float16_values_far_from_one(v_size, interpret):
    """float16 q with V rows of absmax ~1e-2 (scales below float16's normal range, where the
    probabilities times a scale would lose their digits) and ~1e4 (far above): the values
    still match at float16's tolerance."""
    cfg, score, dtype, opts = FP8_CORNERS[3]
    q, k, v, page_table, lengths = make_case(17, batch=len(cfg["lengths"]), dtype=dtype, **cfg)
    assert_fp8_matches((q, k, (v * v_size).astype(dtype), page_table, lengths), score=score,
                       dtype=dtype, interpret=interpret, **opts)


def test_fp8_negative_control_wrong_scale_axis(interpret):
    """Scales read along the wrong axis (each page's slots reversed) fail the check above."""
    cfg, score, dtype, opts = FP8_CORNERS[2]
    q, k, v, page_table, lengths = make_case(17, batch=len(cfg["lengths"]), dtype=dtype, **cfg)
    fp8, (k_deq, v_deq) = fp8_cache(k, v, dtype)
    fp8 = dict(fp8, k_scale=fp8["k_scale"][:, :, ::-1], v_scale=fp8["v_scale"][:, :, ::-1])
    got = paged_decode_attention(q, page_table=page_table, lengths=lengths, **fp8,
                                 backend="pallas", interpret=interpret, **opts)
    want = paged_decode_attention_reference(q, k_deq, v_deq, page_table, lengths)
    assert not max_row_rel_error(got.out, want.out) <= OUT_TOL[dtype]


def e4m3_round_trip_error(x, x_fp8, scale):
    """|x - dequantize(x_fp8, scale)| over the e4m3 bound of each element: half a step of
    its binade (2^-4 |x| relative) plus half the subnormal step, both in units of the
    scale its own (token, head) row should have had (absmax / 448)."""
    x = np.asarray(x, np.float64)
    row_scale = np.abs(x).max(axis=-1, keepdims=True) / E4M3_MAX
    bound = E4M3_REL * np.abs(x) + E4M3_SUBNORMAL_STEP / 2 * row_scale + 1e-30
    return np.abs(np.asarray(dequantize(x_fp8, scale), np.float64) - x) / bound


def test_fp8_quantize_round_trip_is_within_the_e4m3_bound_per_token_and_head():
    """quantize_kv: a scale per (page, KV head, slot) = absmax over head_dim / 448; every
    element comes back within the e4m3 bound of its own row, over rows 8 decades apart (and
    an all-zero row); a scale over the wrong axis (per page and head, over its slots) fails
    that bound."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 2, 16, 64)) * 10.0 ** rng.uniform(-4, 4, (4, 2, 16, 1))
    x[1, 0, 3] = 0.0
    x = jnp.asarray(x, jnp.float32)
    x_fp8, scale = quantize_kv(x)
    assert x_fp8.dtype == jnp.float8_e4m3fn and x_fp8.shape == x.shape
    assert scale.dtype == jnp.float32 and scale.shape == x.shape[:-1]
    np.testing.assert_allclose(scale, np.maximum(np.abs(np.asarray(x)).max(-1) / E4M3_MAX,
                                                 np.finfo(np.float32).tiny), rtol=1e-6)
    ratio = e4m3_round_trip_error(x, x_fp8, scale)
    assert ratio.max() <= 1.0 + 1e-5
    assert ratio.max() > 0.5  # the bound is not loose
    assert np.all(np.asarray(dequantize(x_fp8, scale))[1, 0, 3] == 0)
    # one scale per (page, head) over its slots: small tokens of a page lose their digits
    page_scale = jnp.max(jnp.abs(x), axis=(-2, -1)) / E4M3_MAX
    per_page = (x / page_scale[..., None, None]).astype(jnp.float8_e4m3fn)
    page_scale = jnp.broadcast_to(page_scale[..., None], scale.shape)
    assert e4m3_round_trip_error(x, per_page, page_scale).max() > 10


@pytest.mark.parametrize("score,values,q_dtype,head_dim,page_size,masked", [
    (None, True, jnp.bfloat16, 128, 16, False), ("max_heads", True, jnp.bfloat16, 128, 16, True),
    ("group_sum", True, jnp.float16, 64, 8, False), ("mean_query", True, jnp.float32, 256, 32,
                                                      False),
    ("head_probs", True, jnp.bfloat16, 128, 128, False),
    ("group_sum", False, jnp.bfloat16, 128, 16, False),
    ("max_heads", False, jnp.bfloat16, 128, 64, True),
])
def test_fp8_lowers_for_cuda(score, values, q_dtype, head_dim, page_size, masked):
    """The fp8 loads, their scales and the conversion through the Pallas -> Triton lowering,
    every score, the scores pass alone, a KV-head mask."""
    kv_heads, batch, max_pages, group = 2, 3, 5, 4
    S = jax.ShapeDtypeStruct
    cache = S((batch * max_pages, kv_heads, page_size, head_dim), jnp.float8_e4m3fn)
    scale = S(cache.shape[:-1], jnp.float32)
    args = (S((batch, group * kv_heads, head_dim), q_dtype), cache, cache,
            S((batch, max_pages), jnp.int32), S((batch,), jnp.int32), scale, scale,
            S((kv_heads,), jnp.bool_))
    hlo = lower_for_cuda(lambda *a: paged_decode_attention(
        *a[:5], k_scale=a[5], v_scale=a[6], score=score, values=values,
        kv_heads=a[7] if masked else None, backend="pallas", interpret=False), *args)
    assert "triton" in hlo


@pytest.mark.gpu
def test_native_gpu_fp8_llama_shapes():
    """Llama-8B's heads (32 / 8, head_dim 128, pages of 16) natively, ragged rows up to 4k,
    every score and the scores pass."""
    batch, kv_heads, page_size, max_pages = 4, 8, 16, 256
    args = make_case(3, batch=batch, q_heads=32, kv_heads=kv_heads, head_dim=128,
                     page_size=page_size, max_pages=max_pages,
                     lengths=[1, 17, 2049, max_pages * page_size], dtype=jnp.bfloat16)
    for score in SCORES:
        assert_fp8_matches(args, score=score, dtype=jnp.bfloat16, interpret=False)
    assert_fp8_matches(args, score="group_sum", dtype=jnp.bfloat16, interpret=False,
                       values=False)
