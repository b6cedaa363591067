"""Sparse gather decode attention: Pallas kernel (interpret mode on CPU) vs reference vs numpy."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.extend.core import jaxprs_in_params

from kernel_checks import fp8_cache, fp8_lse_bound, lower_for_cuda, max_row_rel_error
from sparsejax.pallas_kernels import LogitRows, paged_decode_attention
from sparsejax.pallas_kernels.sparse_attention import (
    SparseAttention,
    default_tuning,
    sparse_decode_attention,
    sparse_decode_attention_reference,
)

OUT_TOL = {jnp.bfloat16: 1e-2, jnp.float16: 1e-2, jnp.float32: 1e-5}
LSE_TOL = 1e-4
SMALL_TUNING = dict(block_n=16, split_tokens=32)  # several splits and several steps per split
# One split (>= every stream make_case builds: k_max*unit <= 160, max_pages*P <= 48 by
# default): the direct-write path, several steps per program.
DIRECT_TUNING = dict(block_n=16, split_tokens=256)
TUNINGS = {"split": SMALL_TUNING, "direct": DIRECT_TUNING}


def make_case(seed, *, batch=2, q_heads=8, kv_heads=2, head_dim=64, page_size=8, max_pages=6,
              lengths=None, groups="kv", k_max=10, unit="token", head_map="random",
              dense="none", prior=False, dtype=jnp.float32, budget=None, prior_bound="random"):
    """Random paged cache with a shuffled page table and random sorted selections.

    groups: "shared" (G=1), "kv" (G=HK), "q" (G=HQ); unit: "token", "page" or "block" (2 pages);
    head_map (G=HK): "random" (many-to-one) or "none" (identity); dense: "none"
    (dense_heads=None), "zero", "some" (random), "all". prior_bound (with prior): "random"
    (a random prior_length 70% of the time, else the default), "default" (None), "lengths"
    (the lengths array itself), "copy" (a distinct array equal to lengths), "given" (random).
    """
    rng = np.random.default_rng(seed)
    span = max_pages * page_size
    num_pages = batch * max_pages + 5
    unit = {"token": 1, "page": page_size, "block": 2 * page_size}[unit]
    g = {"shared": 1, "kv": kv_heads, "q": q_heads}[groups]
    if lengths is None:
        lengths = rng.integers(1, span + 1, batch)
    units_in_cache = -(-span // unit)
    indices = rng.integers(-5, 10 * units_in_cache, (batch, g, k_max))  # garbage past count
    count = np.zeros((batch, g), np.int32)
    for b in range(batch):
        for j in range(g):
            # Candidates reach past the length and past the cache: those must be skipped.
            n = rng.integers(0, k_max + 1) if budget is None else budget
            chosen = np.sort(rng.choice(units_in_cache + 2, min(n, units_in_cache + 2), False))
            indices[b, j, :len(chosen)] = chosen
            count[b, j] = len(chosen)
            if count[b, j] < k_max and rng.random() < 0.5:  # far past the cache: no overflow
                indices[b, j, count[b, j]] = (2**31 - 1) // unit
                count[b, j] += 1
    case = dict(
        q=rng.standard_normal((batch, q_heads, head_dim)),
        k_pages=rng.standard_normal((num_pages, kv_heads, page_size, head_dim)),
        v_pages=rng.standard_normal((num_pages, kv_heads, page_size, head_dim)),
        page_table=rng.permutation(num_pages)[:batch * max_pages].reshape(batch, max_pages),
        lengths=np.asarray(lengths), indices=indices, count=count)
    case = {k: jnp.asarray(v, dtype if v.dtype == np.float64 else jnp.int32)
            for k, v in case.items()}
    opts = dict(unit=unit)
    if groups == "kv" and head_map == "random":
        opts["head_map"] = jnp.asarray(rng.integers(0, kv_heads, kv_heads), jnp.int32)
    if dense != "none":
        mask = {"zero": np.zeros(kv_heads, bool), "all": np.ones(kv_heads, bool),
                "some": rng.random(kv_heads) < 0.5}[dense]
        opts["dense_heads"] = jnp.asarray(mask)
    if prior:
        opts["prior_query"] = jnp.asarray(rng.standard_normal((batch, q_heads, head_dim)), dtype)
        if prior_bound == "random":
            prior_bound = "given" if rng.random() < 0.7 else "default"
        if prior_bound == "given":
            opts["prior_length"] = jnp.asarray(rng.integers(0, span + 1, batch), jnp.int32)
        elif prior_bound == "lengths":
            opts["prior_length"] = case["lengths"]
        elif prior_bound == "copy":
            opts["prior_length"] = jnp.array(case["lengths"], copy=True)
    return case, opts


def numpy_oracle(case, opts):
    """Float64 loops over (row, head): the attended positions listed one by one."""
    c = {k: np.asarray(v, np.float64 if jnp.issubdtype(v.dtype, jnp.floating) else np.int64)
         for k, v in case.items()}
    q, kp, vp = c["q"], c["k_pages"], c["v_pages"]
    batch, q_heads, head_dim = q.shape
    kv_heads, page_size = kp.shape[1], kp.shape[2]
    group, unit, groups = q_heads // kv_heads, opts["unit"], c["indices"].shape[1]
    head_map = np.asarray(opts.get("head_map", np.arange(kv_heads)))
    dense = np.asarray(opts.get("dense_heads", np.zeros(kv_heads, bool)))
    prior_q = opts.get("prior_query")
    prior_len = np.asarray(opts.get("prior_length", c["lengths"]))
    scale = opts.get("sm_scale", 1 / np.sqrt(head_dim))

    def attend(query, positions, b, h):
        if not positions:
            return np.zeros(head_dim), -np.inf
        pages = c["page_table"][b, np.asarray(positions) // page_size]
        offs = np.asarray(positions) % page_size
        s = kp[pages, h, offs] @ query * scale
        w = np.exp(s - s.max())
        return w @ vp[pages, h, offs] / w.sum(), s.max() + np.log(w.sum())

    out, lse = np.zeros_like(q), np.zeros(q.shape[:2])
    p_out, p_lse = np.zeros_like(q), np.zeros(q.shape[:2])
    for b in range(batch):
        length = c["lengths"][b]
        for i in range(q_heads):
            h = i // group
            g = 0 if groups == 1 else (i if groups == q_heads != kv_heads else head_map[h])
            if dense[h]:
                positions = list(range(length))
            else:
                positions = [p for e in range(c["count"][b, g])
                             for p in range(c["indices"][b, g, e] * unit,
                                            (c["indices"][b, g, e] + 1) * unit)
                             if 0 <= p < length]
            out[b, i], lse[b, i] = attend(q[b, i], positions, b, h)
            if prior_q is not None:
                mu = np.asarray(prior_q[b, i].astype(case["q"].dtype), np.float64)
                p_out[b, i], p_lse[b, i] = attend(
                    mu, [p for p in positions if p < prior_len[b]], b, h)
    prior = (p_lse, p_out) if prior_q is not None else None
    return SparseAttention(out, lse, prior)


def dense_softmax(case):
    """Plain dense attention over [0, length) from a contiguous copy of each row's cache."""
    q, kp, vp, pt = (np.asarray(case[k], np.float64) for k in ("q", "k_pages", "v_pages",
                                                               "page_table"))
    pt = pt.astype(int)
    batch, q_heads, head_dim = q.shape
    kv_heads = kp.shape[1]
    k = kp[pt].transpose(0, 2, 1, 3, 4).reshape(batch, kv_heads, -1, head_dim)
    v = vp[pt].transpose(0, 2, 1, 3, 4).reshape(batch, kv_heads, -1, head_dim)
    k, v = (np.repeat(x, q_heads // kv_heads, axis=1) for x in (k, v))
    s = np.einsum("bhd,bhtd->bht", q, k) / np.sqrt(head_dim)
    s = np.where(np.arange(k.shape[2]) < np.asarray(case["lengths"])[:, None, None], s, -np.inf)
    lse = np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1)) + s.max(-1)
    return np.einsum("bht,bhtd->bhd", np.exp(s - lse[..., None]), v), lse


def assert_close(got, want, dtype, prior=False):
    tol = OUT_TOL[dtype]
    assert max_row_rel_error(got.out, want.out) <= tol
    np.testing.assert_allclose(np.asarray(got.lse), np.asarray(want.lse), atol=LSE_TOL, rtol=0)
    if prior:
        got_lse, got_out = got.prior
        want_lse, want_out = want.prior
        assert max_row_rel_error(got_out, want_out) <= tol
        np.testing.assert_allclose(np.asarray(got_lse), np.asarray(want_lse), atol=LSE_TOL,
                                   rtol=0)


def run(case, opts, backend, interpret=None, **tuning):
    return sparse_decode_attention(**case, **opts, backend=backend, interpret=interpret,
                                   **tuning)


def kernel_path(case, opts, **tuning) -> str:
    """'direct' (one split, no merge) or 'split': the kernel the call traces to."""
    jaxpr = str(jax.make_jaxpr(lambda c: run(c, opts, "pallas", True, **tuning))(case))
    return re.search(r"sparse_decode_\w+_unit\d+_(direct|split)", jaxpr).group(1)


def kernel_operands(case, opts, **tuning) -> int:
    """Operands of the call's pallas_call, traced with `case` as one argument (so that an
    opts entry that *is* case["lengths"] stays the same traced value)."""
    def find(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                return len(eqn.invars)
            for sub in jaxprs_in_params(eqn.params):
                if (n := find(sub)) is not None:
                    return n
        return None

    def call(c):
        o = {k: c["lengths"] if v is case["lengths"] else v for k, v in opts.items()}
        return run(c, o, "pallas", True, **tuning)
    return find(jax.make_jaxpr(call)(case).jaxpr)


@pytest.mark.parametrize("groups,unit,dense,prior", [
    ("kv", "token", "none", False), ("shared", "page", "some", True),
    ("q", "block", "zero", True), ("kv", "block", "all", False), ("q", "token", "some", False),
])
def test_reference_matches_numpy(groups, unit, dense, prior):
    case, opts = make_case(1, groups=groups, unit=unit, dense=dense, prior=prior)
    opts["sm_scale"] = 0.3
    got = sparse_decode_attention_reference(**case, **opts)
    assert_close(got, numpy_oracle(case, opts), jnp.float32, prior)


CONFIGS = st.fixed_dictionaries(dict(
    groups=st.sampled_from(["shared", "kv", "q"]),
    unit=st.sampled_from(["token", "page", "block"]),
    dense=st.sampled_from(["none", "zero", "some", "all"]),
    prior=st.booleans(),
    dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
    heads=st.sampled_from([(8, 2), (4, 4), (16, 1)]),
    head_map=st.sampled_from(["random", "none"]),
    path=st.sampled_from(["split", "direct"]),
    lookahead=st.sampled_from([0, 1, 2]),
))


@settings(max_examples=16, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(cfg=CONFIGS, seed=st.integers(0, 2**16),
       edge=st.sampled_from([1, 7, 8, 9, 47, 48]))
def test_kernel_matches_reference(interpret, cfg, seed, edge):
    q_heads, kv_heads = cfg.pop("heads")
    tuning = dict(TUNINGS[cfg.pop("path")], lookahead=cfg.pop("lookahead"))
    # One row at a page-boundary length (P = 8), the other random.
    case, opts = make_case(seed, q_heads=q_heads, kv_heads=kv_heads,
                           lengths=[edge, 1 + seed % 48], **cfg)
    got = run(case, opts, "pallas", interpret, **tuning)
    want = sparse_decode_attention_reference(**case, **opts)
    assert_close(got, want, cfg["dtype"], cfg["prior"])


@pytest.mark.parametrize("method,groups,unit,head_map,dense,path", [
    ("kascade", "kv", "token", "random", "none", "direct"),
    ("delta", "shared", "page", "none", "none", "direct"),
    ("lychee", "kv", "block", "none", "some", "split"),
    ("quest", "q", "page", "none", "none", "split"),
])
def test_method_layouts(interpret, method, groups, unit, head_map, dense, path):
    """The selection layouts of the methods, GQA group 4, bf16, with the RESA prior (on the
    path their benchmark shapes take by default)."""
    case, opts = make_case(20, groups=groups, unit=unit, head_map=head_map, dense=dense,
                           prior=True, dtype=jnp.bfloat16, lengths=[8, 47])
    want = sparse_decode_attention_reference(**case, **opts)
    assert_close(run(case, opts, "pallas", interpret, **TUNINGS[path]), want, jnp.bfloat16,
                 prior=True)
    assert_close(want, numpy_oracle(case, opts), jnp.bfloat16, prior=True)


@pytest.mark.parametrize("unit,dtype", [
    ("page", jnp.float32), ("page", jnp.bfloat16), ("block", jnp.float32),
    ("block", jnp.bfloat16), ("token", jnp.bfloat16),
])
def test_direct_write_path(interpret, unit, dtype):
    """One split per row group: out/lse (and the prior) written by the kernel, no merge.
    Lengths on both sides of page boundaries (P = 8) and at the full span, random counts up
    to every unit of the cache, so whole pages and cut last pages are read (the split path
    of the same shapes is the hypothesis test's)."""
    case, opts = make_case(21, batch=4, unit=unit, groups="kv", prior=True, dtype=dtype,
                           lengths=[7, 8, 9, 48], k_max=40 if unit == "token" else 10)
    assert kernel_path(case, opts, **DIRECT_TUNING) == "direct"
    assert kernel_path(case, opts, **SMALL_TUNING) == "split"
    got = run(case, opts, "pallas", interpret, **DIRECT_TUNING)
    assert got.out.dtype == dtype and got.lse.dtype == jnp.float32
    assert_close(got, numpy_oracle(case, opts), dtype, prior=True)


@pytest.mark.parametrize("path", ["split", "direct"])
@pytest.mark.parametrize("bound", ["default", "lengths", "copy", "given"])
def test_prior_bound(interpret, bound, path):
    """prior_length omitted or the lengths array itself: the bound is implied by the
    attended positions (< length), the kernel takes no prior_length operand and applies no
    prior mask. Any other array (even one equal to lengths) is applied per prior row. All
    agree with the oracle; "given" has bounds below the lengths, so the mask matters."""
    case, opts = make_case(22, batch=4, groups="kv", unit="token", prior=True, prior_bound=bound,
                           dtype=jnp.bfloat16, lengths=[1, 17, 40, 48], k_max=40)
    if bound == "given":
        opts["prior_length"] = jnp.asarray([0, 9, 33, 47], jnp.int32)
    without = {k: v for k, v in opts.items() if k != "prior_length"}
    extra = 0 if bound in ("default", "lengths") else 1
    assert (kernel_operands(case, opts, **TUNINGS[path])
            == kernel_operands(case, without, **TUNINGS[path]) + extra)
    got = jax.jit(lambda c: run(c, {k: c["lengths"] if v is case["lengths"] else v
                                    for k, v in opts.items()}, "pallas", interpret,
                                **TUNINGS[path]))(case)
    want = numpy_oracle(case, opts)
    assert_close(got, want, jnp.bfloat16, prior=True)
    if bound == "given":  # the bound changes the prior partial: the mask is not a no-op
        assert max_row_rel_error(got.prior[1], numpy_oracle(case, without).prior[1]) > 0.1


def test_default_split_rule():
    """The default tuning at the benchmark shapes (B=64, 8 KV heads, D=128): one split (the
    direct path) when the row groups fill the GPU, however long the stream, else even splits
    no longer than 2048 tokens, and below a wave down to one step a program; dense heads capped
    at 128 splits; always whole steps."""
    def splits(row_groups, sparse, dense=0, head_dim=128):
        t = default_tuning(head_dim, row_groups, sparse, dense)
        assert t["split_tokens"] % t["block_n"] == 0
        return -(-max(sparse, dense) // t["split_tokens"]), t["split_tokens"]

    assert splits(512, 64 * 16) == (1, 1024)  # DELTA: 64 pages of 16
    assert splits(512, 819)[0] == 1  # Kascade 8k
    assert splits(512, 3276) == (1, 3328)  # Kascade 32k: one split of whole steps
    assert splits(512, 13107)[0] == 1  # Kascade 128k
    n, split = splits(256, 52428)  # Kascade B=32, 512k: even pieces, no short last split
    assert split <= 2048 and split * (n - 1) < 52428 <= split * n
    assert 52428 - split * (n - 1) > split / 2
    assert splits(8, 819)[0] > 1  # a few row groups: split to fill the GPU anyway
    assert splits(64, 13056, 131072)[0] <= 128  # Lychee with dense heads
    assert splits(4, 100) == (2, 64)  # below a wave: one step a program, never less
    # batch 1 (DS-Qwen-1.5B's 2 KV heads): one 64-token step a program, the merge sums them
    assert splits(2, 64 * 16) == (16, 64)  # DELTA: 64 pages of 16
    assert splits(2, 3277) == (52, 64)  # Kascade 32k
    assert splits(2, 13107) == (103, 128)  # Kascade 128k: a wave of programs, two steps each
    assert splits(16, 1024) == (16, 64)  # Llama-8B at B=2
    assert default_tuning(256, 512, 1024)["block_n"] == 32
    # two warps for sparse-only streams at D <= 128, four with dense heads or at D = 256
    assert default_tuning(128, 512, 819)["num_warps"] == 2
    assert default_tuning(128, 64, 13056, 131072)["num_warps"] == 4
    assert default_tuning(256, 512, 1024)["num_warps"] == 4
    # given logits: 4x the rows, 4 warps, the V tile at most 64 KiB (two stages fit)
    given = {(d, size): default_tuning(d, 512, 3277, given_logits=True, itemsize=size)
             for d in (64, 128, 256) for size in (2, 4)}
    assert {k: t["block_n"] for k, t in given.items()} == {
        (64, 2): 256, (64, 4): 256, (128, 2): 256, (128, 4): 128, (256, 2): 128, (256, 4): 64}
    assert {t["num_warps"] for t in given.values()} == {4}


@pytest.mark.parametrize("unit", ["token", "page", "block"])
def test_full_selection_is_dense_attention(interpret, unit):
    case, opts = make_case(2, unit=unit, lengths=[1, 41], budget=100, k_max=100,
                           groups="shared")
    assert int(case["count"].min()) * opts["unit"] >= 48  # every position of the cache
    want_out, want_lse = dense_softmax(case)
    for backend in ("pallas", "reference"):
        got = run(case, opts, backend, interpret, **SMALL_TUNING)
        assert max_row_rel_error(got.out, want_out) <= 1e-5
        np.testing.assert_allclose(np.asarray(got.lse), want_lse, atol=LSE_TOL, rtol=0)


def test_dense_heads_are_dense_attention(interpret):
    case, opts = make_case(3, dense="all", lengths=[7, 16], prior=True)
    want_out, want_lse = dense_softmax(case)
    got = run(case, opts, "pallas", interpret, **SMALL_TUNING)
    assert max_row_rel_error(got.out, want_out) <= 1e-5
    np.testing.assert_allclose(np.asarray(got.lse), want_lse, atol=LSE_TOL, rtol=0)
    assert_close(got, numpy_oracle(case, opts), jnp.float32, prior=True)


def test_default_tuning_and_auto_backend(interpret):
    case, opts = make_case(4, dtype=jnp.bfloat16, unit="page", prior=True, dense="some")
    opts["sm_scale"] = 0.2
    want = sparse_decode_attention_reference(**case, **opts)
    assert_close(run(case, opts, "pallas", interpret), want, jnp.bfloat16, prior=True)
    if jax.default_backend() == "cpu":
        got = run(case, opts, "auto")
        np.testing.assert_array_equal(np.asarray(got.out), np.asarray(want.out))


def test_default_tuning_gives_an_fp8_cache_three_stages():
    """The rule the fp8 knob sweep set (docs/tuning.md): 3 stages on an fp8 cache, unless the
    logits are given (no K tile read); 2 on a 16-bit cache."""
    shape = dict(head_dim=128, row_groups=512, sparse_tokens=3277)
    assert default_tuning(**shape)["num_stages"] == 2
    assert default_tuning(**shape, fp8_cache=True)["num_stages"] == 3
    assert default_tuning(**shape, fp8_cache=True, given_logits=True)["num_stages"] == 2


@pytest.mark.parametrize("path", ["split", "direct"])
def test_empty_selection(interpret, path):
    case, opts = make_case(5, prior=True, groups="q")
    case["count"] = jnp.zeros_like(case["count"])
    for backend in ("pallas", "reference"):
        got = run(case, opts, backend, interpret, **TUNINGS[path])
        assert np.all(np.asarray(got.out) == 0) and np.all(np.asarray(got.lse) == -np.inf)
        assert np.all(np.asarray(got.prior[1]) == 0)
        assert np.all(np.asarray(got.prior[0]) == -np.inf)


@pytest.mark.parametrize("path", ["split", "direct"])
@pytest.mark.parametrize("corrupt", ["swap_kv", "wrong_head_map"])
def test_negative_control_fails_metric(interpret, corrupt, path):
    case, opts = make_case(6, budget=6, lengths=[48, 40])
    opts["head_map"] = jnp.asarray([0, 1], jnp.int32)
    want = numpy_oracle(case, opts)
    if corrupt == "swap_kv":
        case["k_pages"], case["v_pages"] = case["v_pages"], case["k_pages"]
    else:
        opts["head_map"] = jnp.asarray([1, 0], jnp.int32)
    got = run(case, opts, "pallas", interpret, **TUNINGS[path])
    assert max_row_rel_error(got.out, want.out) > 0.1


@pytest.mark.parametrize("backend", ["pallas", "reference"])
def test_inside_scan_over_layers(interpret, backend):
    """Multi-layer cache viewed as [layers*num_pages, ...], page table offset per layer."""
    layers = 3
    cases = [make_case(10 + i, groups="kv", unit="page", dense="some", lengths=[17, 48])
             for i in range(layers)]
    num_pages = cases[0][0]["k_pages"].shape[0]
    k_all = jnp.concatenate([c["k_pages"] for c, _ in cases])
    v_all = jnp.concatenate([c["v_pages"] for c, _ in cases])
    stacked = {k: jnp.stack([c[k] for c, _ in cases]) for k in ("q", "page_table", "indices",
                                                                "count")}
    head_maps = jnp.stack([o["head_map"] for _, o in cases])
    dense = jnp.stack([o["dense_heads"] for _, o in cases])
    lengths = cases[0][0]["lengths"]

    @jax.jit
    def all_layers(k_all, v_all, stacked, head_maps, dense):
        def layer(_, xs):
            i, s, hm, dh = xs
            res = sparse_decode_attention(
                s["q"], k_all, v_all, s["page_table"] + i * num_pages, lengths, s["indices"],
                s["count"], unit=8, head_map=hm, dense_heads=dh, backend=backend,
                interpret=interpret, **SMALL_TUNING)
            return None, (res.out, res.lse)
        return jax.lax.scan(layer, None, (jnp.arange(layers), stacked, head_maps, dense))[1]

    outs, lses = all_layers(k_all, v_all, stacked, head_maps, dense)
    for i, (case, opts) in enumerate(cases):
        case = dict(case, lengths=lengths)
        want = sparse_decode_attention_reference(**case, **opts)
        assert max_row_rel_error(outs[i], want.out) <= 1e-5
        np.testing.assert_allclose(np.asarray(lses[i]), np.asarray(want.lse), atol=LSE_TOL)


BF16_32x8 = dict(q_heads=32, kv_heads=8, head_dim=128, page_size=16, dtype=jnp.bfloat16)


@pytest.mark.parametrize("groups,unit,dense,prior,shape", [
    ("kv", "token", "none", False, BF16_32x8), ("kv", "page", "some", True, BF16_32x8),
    ("kv", "block", "none", True, BF16_32x8), ("shared", "token", "some", False, BF16_32x8),
    ("shared", "page", "none", False, BF16_32x8), ("shared", "block", "some", True, BF16_32x8),
    ("q", "token", "none", True, BF16_32x8), ("q", "page", "some", False, BF16_32x8),
    ("q", "block", "some", True, BF16_32x8),
    ("kv", "token", "some", True, dict(q_heads=64, kv_heads=4, head_dim=64, page_size=8,
                                       dtype=jnp.float16)),  # group 16: 32 padded rows
    ("shared", "block", "some", True, dict(q_heads=16, kv_heads=16, head_dim=256,
                                           page_size=128, max_pages=4, dtype=jnp.float32)),
])
@pytest.mark.parametrize("path", ["split", "direct"])
def test_lowers_for_cuda(groups, unit, dense, prior, shape, path):
    """Every layout through the Triton lowering (which interpret mode skips) at the default
    block_n, on both the split path (partials + merge) and the direct path (a grid of one
    split, no merge)."""
    case, opts = make_case(7, batch=4, groups=groups, unit=unit, dense=dense, prior=prior,
                           k_max=128, **{"max_pages": 32, **shape})
    _lower_and_check_grid(case, opts, dict(split_tokens=64 if path == "split" else 2**16), path)


@pytest.mark.parametrize("bound", ["lengths", "given"])
@pytest.mark.parametrize("groups,unit,path", [("kv", "token", "direct"),
                                              ("shared", "page", "direct"),
                                              ("q", "block", "split")])
def test_lowers_for_cuda_prior_bound(groups, unit, path, bound):
    """The prior with and without its mask (prior_length = the lengths array itself, or a
    separate array) through the Triton lowering, at the benchmark's knobs: one fewer kernel
    operand without the mask."""
    texts = {}
    for b in (bound, "default"):
        case, opts = make_case(7, batch=4, groups=groups, unit=unit, prior=True, prior_bound=b,
                               k_max=64, max_pages=32, **BF16_32x8)
        tuning = dict(lookahead=0, split_tokens=128 if path == "split" else 2**16)
        texts[b] = _lower_and_check_grid(case, opts, tuning, path)
    operands = {b: len(re.search(r"custom_call @__gpu\$xla\.gpu\.triton\(([^)]*)\)", t)
                       .group(1).split(",")) for b, t in texts.items()}
    assert operands[bound] == operands["default"] + (bound == "given")


@pytest.mark.parametrize("groups,unit,dense,prior,path,tuning", [
    ("kv", "token", "none", True, "direct", dict(block_n=32, lookahead=0)),
    ("shared", "page", "some", False, "split", dict(block_n=128, num_warps=8, lookahead=2)),
    ("q", "block", "none", True, "split", dict(block_n=32, num_stages=3, lookahead=2)),
    ("kv", "page", "some", True, "direct", dict(block_n=128, num_stages=3)),
])
def test_lowers_for_cuda_sweep_knobs(groups, unit, dense, prior, path, tuning):
    """The other knobs the benchmark sweeps: block_n 32/128, no lookahead, warps, stages."""
    case, opts = make_case(7, batch=4, groups=groups, unit=unit, dense=dense, prior=prior,
                           k_max=64, max_pages=32, **BF16_32x8)
    tuning = dict(tuning, split_tokens=128 if path == "split" else 2**16)
    _lower_and_check_grid(case, opts, tuning, path)


def _lower_and_check_grid(case, opts, tuning, path):
    """Lowers for CUDA (an opts entry that is case["lengths"] itself stays that traced
    value), checks one kernel on the expected path; returns the StableHLO text."""
    same = [k for k, v in opts.items() if v is case["lengths"]]
    extra = {k: v for k, v in opts.items() if k != "unit" and k not in same}
    names = list(case) + list(extra)

    def fn(*args):
        kwargs = dict(zip(names, args))
        kwargs.update({k: kwargs["lengths"] for k in same})
        return sparse_decode_attention(**kwargs, unit=opts["unit"], backend="pallas",
                                       interpret=False, **tuning)
    text = lower_for_cuda(fn, *case.values(), *extra.values())
    grid_y = [int(g) for g in re.findall(r"grid_y = (\d+)", text)]
    # The attention kernel, then on the split path the merge of its partials (one kernel
    # for the output, one for the prior's).
    merges = 0 if path == "direct" else 1 + ("prior_query" in names)
    assert len(grid_y) == 1 + merges, "the kernel and its merges"
    assert (grid_y[0] == 1) == (path == "direct")
    return text


# ---- given logits: a layer attending to the top-k of its own scores pass ------------------
def own_logits(case, score, backend, interpret=None, **tuning):
    """The scores pass's unpooled logits for the case (`LogitRows`, a row per query head)."""
    return paged_decode_attention(case["q"], case["k_pages"], case["v_pages"],
                                  case["page_table"], case["lengths"], score=score, values=False,
                                  pool_scores=False, backend=backend, interpret=interpret,
                                  **tuning).scores


@pytest.mark.parametrize("groups,unit,score,dtype,path", [
    ("kv", "token", "group_sum", jnp.float32, "direct"),
    ("kv", "token", "group_sum", jnp.bfloat16, "split"),
    ("q", "token", "head_probs", jnp.float32, "split"),
    ("shared", "page", "head_probs", jnp.bfloat16, "direct"),
    ("kv", "block", "group_sum", jnp.float32, "split"),
])
def test_given_logits(interpret, groups, unit, score, dtype, path):
    """Attention over the selection reading the scores pass's logits instead of K equals the
    attention that recomputes them: the kernel's float16 logits over several key blocks
    (16-bit q) or float32 ones, and the reference's exact logits; kernel and reference agree
    on the same given logits. Lengths at page boundaries (P = 8)."""
    case, opts = make_case(31, groups=groups, unit=unit, head_map="none", dtype=dtype,
                           lengths=[8, 41], k_max=40 if unit == "token" else 6)
    want = sparse_decode_attention_reference(**case, **opts)
    kernel_rows = own_logits(case, score, "pallas", interpret, block_n=16)
    assert kernel_rows.relative.dtype == (jnp.float32 if dtype == jnp.float32 else jnp.float16)
    assert kernel_rows.block_max.shape[-1] == 3  # several key blocks of 16
    exact_rows = own_logits(case, score, "reference")
    for rows in (kernel_rows, exact_rows):
        given = dict(opts, logits=rows)
        got = run(case, given, "pallas", interpret, **TUNINGS[path])
        assert kernel_path(case, given, **TUNINGS[path]) == path
        assert_close_given(got, want, dtype, rows, exact_rows, case["lengths"])
        assert_close(got, sparse_decode_attention_reference(**case, **given), dtype)


def assert_close_given(got, want, dtype, rows, exact_rows, lengths):
    """assert_close, with the LSE allowed what float16 logits move it by: a logit s by at
    most 2^-11 |s - m| (m its block's running max, between s and the row max), so an LSE by
    at most 2^-11 of its row's largest distance below the row max over the valid positions
    (the exact rows are relative to the row max)."""
    assert max_row_rel_error(got.out, want.out) <= OUT_TOL[dtype]
    slack = 0.0
    if rows.relative.dtype == jnp.float16:
        batch, span = exact_rows.relative.shape[0], exact_rows.relative.shape[-1]
        below = -exact_rows.relative.reshape(batch, -1, span)
        valid = jnp.arange(span)[None, None, :] < lengths[:, None, None]
        slack = 2.0**-11 * np.asarray(jnp.max(jnp.where(valid, below, 0.0), axis=-1))
    got_lse, want_lse = np.asarray(got.lse), np.asarray(want.lse)
    finite = np.isfinite(want_lse)
    assert np.array_equal(np.isfinite(got_lse), finite)
    err = np.abs(np.where(finite, got_lse, 0) - np.where(finite, want_lse, 0))
    assert np.all(err <= LSE_TOL + slack)


@pytest.mark.parametrize("corrupt", ["block_max", "heads"])
def test_given_logits_negative_control(interpret, corrupt):
    """Logits that are not the selection's own (another key block's max, another head's row)
    fail the comparison the test above passes."""
    case, opts = make_case(32, groups="kv", head_map="none", lengths=[40, 47], k_max=24)
    rows = own_logits(case, "group_sum", "pallas", interpret, block_n=16)
    if corrupt == "block_max":
        rows = LogitRows(rows.relative, jnp.roll(rows.block_max, 1, axis=-1), rows.lse,
                         rows.block_n)
    else:
        rows = LogitRows(jnp.roll(rows.relative, 1, axis=2), rows.block_max, rows.lse,
                         rows.block_n)
    got = run(case, dict(opts, logits=rows), "pallas", interpret, **SMALL_TUNING)
    assert max_row_rel_error(got.out, sparse_decode_attention_reference(**case, **opts).out) > 0.1


@pytest.mark.parametrize("groups,path", [("kv", "direct"), ("q", "split"), ("shared", "direct")])
def test_lowers_for_cuda_given_logits(groups, path):
    """The given-logits step (float16 rows, float32 block maxes, no K) through the Triton
    lowering, with the dense kernel's scores blocks of 128 tokens, at the default block_n
    (direct) and at 64."""
    case, opts = make_case(7, batch=4, groups=groups, head_map="none", k_max=128,
                           max_pages=32, **BF16_32x8)
    b, span = 4, 32 * 16
    opts["logits"] = LogitRows(jnp.zeros((b, 8, 4, span), jnp.float16),
                               jnp.zeros((b, 8, 4, span // 128), jnp.float32), None, 128)
    tuning = dict(block_n=64, split_tokens=64) if path == "split" else dict(split_tokens=2**16)
    text = _lower_and_check_grid(case, opts, tuning, path)
    assert "_given_logits" in text


FP8 = jnp.float8_e4m3fn


def _rows(span=48, block_n=16):
    """LogitRows of the make_case(8) shapes (B=2, 2 KV heads of 4 query heads, 48 positions),
    block maxes sized for blocks of 16."""
    return LogitRows(jnp.zeros((2, 2, 4, span)), jnp.zeros((2, 2, 4, 3)), None, block_n)


def _bad(name, fn):
    """The error must start with the argument's name: `name=value: expected ...`."""
    return pytest.param(fn, "^" + name.replace(".", "\\.").replace("[", "\\[") + "=", id=name)


@pytest.mark.parametrize("mutate,match", [
    _bad("q.shape", lambda c, o: c.update(q=c["q"][0])),
    _bad("q.dtype", lambda c, o: c.update(q=c["q"].astype(jnp.int32))),
    _bad("k_pages.dtype", lambda c, o: c.update(k_pages=c["k_pages"].astype(jnp.bfloat16))),
    _bad("v_pages", lambda c, o: c.update(v_pages=c["v_pages"][:, :1])),
    _bad("head_dim", lambda c, o: c.update(q=c["q"][..., :32], k_pages=c["k_pages"][..., :32],
                                           v_pages=c["v_pages"][..., :32])),
    _bad("page_size", lambda c, o: c.update(k_pages=c["k_pages"][:, :, :6],
                                            v_pages=c["v_pages"][:, :, :6])),
    _bad("q_heads", lambda c, o: c.update(q=c["q"][:, :3])),
    _bad("page_table", lambda c, o: c.update(page_table=c["page_table"].astype(jnp.float32))),
    _bad("lengths", lambda c, o: c.update(lengths=c["lengths"][:1])),
    _bad("indices.shape[1]", lambda c, o: c.update(indices=c["indices"][:, :1].repeat(3, 1),
                                                      count=c["count"][:, :1].repeat(3, 1))),
    _bad("count", lambda c, o: c.update(count=c["count"][:, :1])),
    _bad("unit", lambda c, o: o.update(unit=12)),
    _bad("head_map", lambda c, o: o.update(head_map=jnp.zeros((3,), jnp.int32))),
    _bad("dense_heads", lambda c, o: o.update(dense_heads=jnp.zeros((2,), jnp.int32))),
    _bad("prior_query", lambda c, o: o.update(prior_query=c["q"][:, :4])),
    _bad("prior_length", lambda c, o: o.update(prior_length=c["lengths"])),
    _bad("block_n", lambda c, o: o.update(block_n=24)),
    _bad("split_tokens", lambda c, o: o.update(split_tokens=40, block_n=16)),
    _bad("lookahead", lambda c, o: o.update(lookahead=3)),
    _bad("lookahead", lambda c, o: o.update(lookahead=True)),
    _bad("backend", lambda c, o: o.update(backend="cuda")),
    _bad("logits", lambda c, o: o.update(logits=jnp.zeros((2, 8, 48)))),
    _bad("logits.relative", lambda c, o: o.update(logits=_rows(span=40))),
    _bad("logits.block_max", lambda c, o: o.update(logits=_rows(block_n=8))),
    _bad("prior_query", lambda c, o: o.update(logits=_rows(), prior_query=c["q"])),
    _bad("dense_heads", lambda c, o: o.update(logits=_rows(),
                                              dense_heads=jnp.zeros((2,), bool))),
    _bad("k_pages.dtype", lambda c, o: c.update(k_pages=c["k_pages"].astype(FP8),
                                                v_pages=c["v_pages"].astype(FP8))),
    _bad("k_scale", lambda c, o: c.update(k_pages=c["k_pages"].astype(FP8),
                                          v_pages=c["v_pages"].astype(FP8),
                                          k_scale=jnp.ones(c["k_pages"].shape[:2]),
                                          v_scale=jnp.ones(c["k_pages"].shape[:3]))),
    _bad("v_scale", lambda c, o: c.update(k_pages=c["k_pages"].astype(FP8),
                                          v_pages=c["v_pages"].astype(FP8),
                                          v_scale=jnp.ones(c["k_pages"].shape[:3]))),
])
def test_bad_inputs(mutate, match):
    case, opts = make_case(8)
    opts.setdefault("backend", "pallas")
    mutate(case, opts)
    with pytest.raises(ValueError, match=match):
        sparse_decode_attention(**case, **opts)


def test_unknown_tuning_knob():
    """The knobs are keyword arguments: a misspelt one is Python's TypeError naming it."""
    case, opts = make_case(8)
    with pytest.raises(TypeError, match="blockn"):
        sparse_decode_attention(**case, **opts, backend="pallas", blockn=32)


def test_head_map_needs_per_kv_head_groups():
    case, opts = make_case(9, groups="q")
    with pytest.raises(ValueError, match="head_map"):
        sparse_decode_attention(**case, **opts, head_map=jnp.zeros((2,), jnp.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("groups,unit,dense,prior,dtype", [
    ("kv", "token", "none", False, jnp.bfloat16), ("kv", "token", "some", True, jnp.bfloat16),
    ("shared", "page", "none", True, jnp.bfloat16), ("q", "token", "some", False, jnp.float16),
    ("kv", "block", "some", True, jnp.bfloat16), ("kv", "page", "all", False, jnp.float32),
])
def test_native_gpu(groups, unit, dense, prior, dtype):
    span = 256 * 16
    case, opts = make_case(11, batch=8, q_heads=32, kv_heads=8, head_dim=128, page_size=16,
                           max_pages=256, groups=groups, unit=unit,
                           dense=dense, prior=prior, dtype=dtype, k_max=512,
                           lengths=[1, 15, 16, 17, span - 1, span, 1000, 3000])
    want = sparse_decode_attention_reference(**case, **opts)
    assert_close(run(case, opts, "pallas", interpret=False), want, dtype, prior)
    assert_close(run(case, opts, "pallas", interpret=False, block_n=32, split_tokens=128,
                     num_warps=8, num_stages=3), want, dtype, prior)


@pytest.mark.gpu
@pytest.mark.parametrize("groups,score,dtype,head_dim", [
    ("kv", "group_sum", jnp.bfloat16, 128), ("q", "head_probs", jnp.bfloat16, 128),
    ("kv", "group_sum", jnp.float32, 128), ("kv", "group_sum", jnp.float32, 256)])
def test_native_given_logits(groups, score, dtype, head_dim):
    """The native kernel over the native scores pass's logits (float16 for bf16, blocks of
    128) equals attention that recomputes them, at Llama-3.1-8B's layer shape, and at the
    default knobs of float32 caches (the largest V tiles)."""
    span = 256 * 16
    case, opts = make_case(13, batch=8, q_heads=32, kv_heads=8, head_dim=head_dim,
                           page_size=16, max_pages=256, groups=groups, head_map="none",
                           dtype=dtype, k_max=512,
                           lengths=[1, 15, 16, 17, span - 1, span, 1000, 3000])
    rows = own_logits(case, score, "pallas", interpret=False)
    exact_rows = own_logits(case, score, "reference")
    want = sparse_decode_attention_reference(**case, **opts)
    for tuning in ({}, dict(block_n=32, split_tokens=128)):
        got = run(case, dict(opts, logits=rows), "pallas", interpret=False, **tuning)
        assert_close_given(got, want, dtype, rows, exact_rows, case["lengths"])


def test_reference_takes_any_head_dim_and_page_size():
    """Only the Pallas kernel is limited to D in {64, 128, 256} and P in {8..128}: the
    reference (and backend="auto" off GPU, or on GPU for other shapes) takes any."""
    case, opts = make_case(12, head_dim=64, page_size=8)
    small = dict(case, q=case["q"][..., :16], k_pages=case["k_pages"][:, :, :4, :16],
                 v_pages=case["v_pages"][:, :, :4, :16])
    opts = dict(opts, unit=1)
    got = sparse_decode_attention(**small, **opts, backend="auto")
    want = sparse_decode_attention_reference(**small, **opts)
    np.testing.assert_allclose(np.asarray(got.out, np.float32), np.asarray(want.out, np.float32))


# ---- an fp8 (float8_e4m3fn) cache with a scale per (page, KV head, slot) -------------------
def fp8_case(case, dtype):
    """(case on the fp8 cache of case's pages, case on that cache dequantized to q's
    dtype)."""
    fp8, (k_deq, v_deq) = fp8_cache(case["k_pages"], case["v_pages"], dtype)
    return dict(case, **fp8), dict(case, k_pages=k_deq, v_pages=v_deq)


def assert_fp8_close(got, case, opts, dtype, prior):
    """The kernel on an fp8 cache against its reference on that cache (f32 dequantization)
    at the 16-bit tolerances (its dots take the fp8 values exactly and the scales multiply
    the f32 logits), and against its reference on the cache dequantized to q's dtype within
    what that rounding of K moves the LSE."""
    quantized, dequantized = fp8_case(case, dtype)
    assert_close(got, sparse_decode_attention_reference(**quantized, **opts), dtype, prior)
    want = sparse_decode_attention_reference(**dequantized, **opts)
    assert max_row_rel_error(got.out, want.out) <= OUT_TOL[dtype]
    queries = case["q"] if "prior_query" not in opts else jnp.concatenate(
        [case["q"], opts["prior_query"].astype(case["q"].dtype)], axis=1)
    bound = fp8_lse_bound(queries, dequantized["k_pages"], opts.get("sm_scale",
                                                                    case["q"].shape[-1] ** -0.5))
    for got_lse, want_lse in [(got.lse, want.lse)] + ([(got.prior[0], want.prior[0])]
                                                      if prior else []):
        np.testing.assert_allclose(np.asarray(got_lse), np.asarray(want_lse), rtol=0,
                                   atol=LSE_TOL + bound)


@pytest.mark.parametrize("method,groups,unit,head_map,dense,path,dtype", [
    ("kascade", "kv", "token", "random", "none", "direct", jnp.bfloat16),
    ("delta", "shared", "page", "none", "none", "direct", jnp.bfloat16),
    ("lychee", "kv", "block", "none", "some", "split", jnp.bfloat16),
    ("quest", "q", "page", "none", "none", "split", jnp.float32),
])
def test_fp8_method_layouts(interpret, method, groups, unit, head_map, dense, path, dtype):
    """Each method's selection layout on an fp8 cache, with the RESA prior; lengths on both
    sides of a page boundary (P = 8)."""
    case, opts = make_case(22, groups=groups, unit=unit, head_map=head_map, dense=dense,
                           prior=True, dtype=dtype, lengths=[8, 47])
    quantized, _ = fp8_case(case, dtype)
    got = run(quantized, opts, "pallas", interpret, **TUNINGS[path])
    assert kernel_path(quantized, opts, **TUNINGS[path]) == path
    assert_fp8_close(got, case, opts, dtype, prior=True)


@pytest.mark.parametrize("path", ["direct", "split"])
def test_fp8_given_logits(interpret, path):
    """Given logits on an fp8 cache: the kernel reads only V (and its scales)."""
    case, opts = make_case(33, groups="kv", head_map="none", dtype=jnp.bfloat16,
                           lengths=[9, 40], k_max=24)
    quantized, dequantized = fp8_case(case, jnp.bfloat16)
    rows = own_logits(dequantized, "group_sum", "reference")
    given = dict(opts, logits=rows)
    got = run(quantized, given, "pallas", interpret, **TUNINGS[path])
    assert_close(got, sparse_decode_attention_reference(**quantized, **given), jnp.bfloat16)
    want = sparse_decode_attention_reference(**dequantized, **given)
    assert max_row_rel_error(got.out, want.out) <= OUT_TOL[jnp.bfloat16]
    np.testing.assert_allclose(np.asarray(got.lse), np.asarray(want.lse), rtol=0, atol=LSE_TOL)


def test_fp8_negative_control_wrong_scale_axis(interpret):
    """V scales of the wrong KV head fail the comparison the tests above pass."""
    case, opts = make_case(22, groups="kv", dtype=jnp.bfloat16, lengths=[8, 47])
    quantized, dequantized = fp8_case(case, jnp.bfloat16)
    quantized["v_scale"] = quantized["v_scale"][:, ::-1]
    got = run(quantized, opts, "pallas", interpret, **DIRECT_TUNING)
    want = sparse_decode_attention_reference(**dequantized, **opts)
    assert max_row_rel_error(got.out, want.out) > 10 * OUT_TOL[jnp.bfloat16]


@pytest.mark.parametrize("groups,unit,dense,prior,path,given", [
    ("kv", "token", "none", False, "direct", False), ("kv", "page", "some", True, "split", False),
    ("shared", "block", "some", True, "direct", False), ("q", "token", "none", True, "split",
                                                          False),
    ("kv", "token", "none", False, "direct", True), ("q", "token", "none", False, "split", True),
])
def test_fp8_lowers_for_cuda(groups, unit, dense, prior, path, given):
    """The fp8 gathers, their scales and the conversion through the Triton lowering: each
    selection layout, dense heads, the prior, given logits (no K scales read)."""
    case, opts = make_case(7, batch=4, groups=groups, unit=unit, dense=dense, prior=prior,
                           head_map="none" if given else "random", k_max=128, max_pages=32,
                           **BF16_32x8)
    case, _ = fp8_case(case, jnp.bfloat16)
    if given:
        b, span = 4, 32 * 16
        opts["logits"] = LogitRows(jnp.zeros((b, 8, 4, span), jnp.float16),
                                   jnp.zeros((b, 8, 4, span // 128), jnp.float32), None, 128)
    tuning = dict(block_n=64, split_tokens=64) if path == "split" else dict(split_tokens=2**16)
    _lower_and_check_grid(case, opts, tuning, path)


@pytest.mark.gpu
@pytest.mark.parametrize("groups,unit,dense,prior", [
    ("kv", "token", "none", True), ("shared", "page", "none", True), ("kv", "block", "some", True),
    ("q", "token", "none", False),
])
def test_native_gpu_fp8(groups, unit, dense, prior):
    span = 256 * 16
    case, opts = make_case(11, batch=8, q_heads=32, kv_heads=8, head_dim=128, page_size=16,
                           max_pages=256, groups=groups, unit=unit, dense=dense, prior=prior,
                           dtype=jnp.bfloat16, k_max=512,
                           lengths=[1, 15, 16, 17, span - 1, span, 1000, 3000])
    quantized, _ = fp8_case(case, jnp.bfloat16)
    assert_fp8_close(run(quantized, opts, "pallas", interpret=False), case, opts, jnp.bfloat16,
                     prior)
