"""topk_select (Pallas, interpret mode on CPU) vs its lax.top_k reference vs plain numpy."""
import fractions
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kernel_checks import lower_for_cuda
from sparsejax.pallas_kernels import common, topk
from sparsejax.pallas_kernels.topk import keys, sampled, split

SETTINGS = settings(max_examples=20, deadline=None, derandomize=True)


# --------------------------------------------------------------------------------------------
# Independent numpy twins


def numpy_topk(scores, k, valid, k_row=None, force_first=0, force_last=0):
    """Sort each row on (-score, index): np.lexsort puts NaN last and treats -0.0 == +0.0."""
    num_rows, n = scores.shape
    k_row = np.full(num_rows, k) if k_row is None else np.asarray(k_row)
    indices = np.full((num_rows, k), -1, np.int32)
    count = np.zeros(num_rows, np.int32)
    for r in range(num_rows):
        v = int(np.clip(valid[r], 0, n))
        forced = sorted(set(range(min(force_first, v))) | set(range(max(v - force_last, 0), v)))
        c = min(v, max(int(np.clip(k_row[r], 0, k)), len(forced)))
        rest = np.array([j for j in range(v) if j not in forced], np.int64)
        order = rest[np.lexsort((rest, -scores[r, rest]))] if len(rest) else rest
        chosen = sorted(forced + order[: c - len(forced)].tolist())
        indices[r, :c] = chosen
        count[r] = c
    return indices, count


def numpy_probabilities(scores, valid, logits):
    rows = []
    for r, v in enumerate(valid):
        x = scores[r, :v].astype(np.float64)
        w = np.exp(x - x.max(initial=0 if v == 0 else None)) if logits else x
        rows.append(w / w.sum() if v else w)
    return rows


def numpy_top_p(scores, p, valid, logits=True):
    out = []
    for prob in numpy_probabilities(scores, valid, logits):
        mass = np.cumsum(np.sort(prob)[::-1])
        out.append(min(int(np.searchsorted(mass, p)) + 1, len(prob)))
    return np.array(out)


def numpy_threshold(scores, threshold, valid, logits=True):
    return np.array([min(max(int(np.sum(prob >= threshold)), 1), len(prob))
                     for prob in numpy_probabilities(scores, valid, logits)])


def assert_selected(out, expected):
    np.testing.assert_array_equal(np.asarray(out.indices), expected[0])
    np.testing.assert_array_equal(np.asarray(out.count), expected[1])


# --------------------------------------------------------------------------------------------
# Inputs

VALUE_SETS = {
    "normal": None,
    "ties": np.array([-1.0, 0.0, -0.0, 0.5, 2.0], np.float32),
    "specials": np.array([-np.inf, np.nan, 0.0, 1.0, np.inf, -1e30], np.float32),
}


def make_scores(seed, num_rows, n, kind):
    rng = np.random.default_rng(seed)
    if VALUE_SETS[kind] is None:
        return rng.standard_normal((num_rows, n)).astype(np.float32)
    return rng.choice(VALUE_SETS[kind], size=(num_rows, n))


# Kernel layouts: a resident row (block_n >= N) kept from registers, the same row kept in
# re-read tiles, a streamed row (several column tiles), and two rows per program with a
# ragged last program (tiles, and resident).
LAYOUTS = [dict(), dict(block_sel=8), dict(block_n=16, block_sel=8, block_k=4),
           dict(block_rows=2, block_n=32, block_sel=16), dict(block_rows=2, block_n=64)]


@st.composite
def problems(draw):
    num_rows = draw(st.sampled_from([1, 3]))
    n = draw(st.sampled_from([1, 7, 40]))
    k = draw(st.sampled_from([1, 5, 16, 48]))
    force_first = draw(st.integers(0, min(3, k)))
    force_last = draw(st.integers(0, min(4, k - force_first)))
    valid = draw(st.lists(st.integers(0, n), min_size=num_rows, max_size=num_rows))
    k_row = draw(st.one_of(st.none(), st.lists(st.integers(0, k), min_size=num_rows,
                                               max_size=num_rows)))
    kind = draw(st.sampled_from(sorted(VALUE_SETS)))
    scores = make_scores(draw(st.integers(0, 2**16)), num_rows, n, kind)
    layout = draw(st.sampled_from(LAYOUTS))
    return scores, k, np.array(valid, np.int32), k_row, force_first, force_last, [layout]


def run_all(scores, k, valid, k_row, force_first, force_last, layouts, interpret):
    expected = numpy_topk(scores, k, valid, k_row, force_first, force_last)
    kw = dict(valid=valid, k_row=None if k_row is None else np.asarray(k_row, np.int32),
              force_first=force_first, force_last=force_last)
    assert_selected(topk.topk_select_reference(jnp.asarray(scores), k, **kw), expected)
    for layout in layouts:
        out = topk.topk_select(jnp.asarray(scores), k, backend="pallas", interpret=interpret,
                               **kw, **layout)
        assert_selected(out, expected)


# --------------------------------------------------------------------------------------------
# topk_select


@SETTINGS
@given(problems())
def test_random_problems(interpret, problem):
    run_all(*problem, interpret=interpret)


@pytest.mark.parametrize("case", [
    "all_ties", "neg_inf_padding", "valid_le_k", "valid_zero", "forced_overlap",
    "forced_whole_row", "k_row_zero_and_large", "k_above_n"])
def test_edge_cases(interpret, case):
    rng = np.random.default_rng(1)
    n, k, valid, k_row, ff, fl = 24, 8, np.array([24, 24, 24], np.int32), None, 0, 0
    scores = rng.standard_normal((3, n)).astype(np.float32)
    if case == "all_ties":
        scores = np.full((3, n), 0.25, np.float32)
        scores[1, ::3] = 1.0          # 8 winners tied with each other: the first 8 by index
        scores[2, ::2] = 1.0          # 12 tied winners, only 8 fit
        ff, fl = 1, 1
    elif case == "neg_inf_padding":
        scores[:, 10:] = -np.inf      # fewer finite scores than k: -inf columns fill by index
        scores[1, :] = -np.inf
        valid = np.array([24, 24, 5], np.int32)
    elif case == "valid_le_k":
        valid = np.array([8, 3, 1], np.int32)
    elif case == "valid_zero":
        valid = np.array([0, 24, 0], np.int32)
        ff, fl = 2, 2
    elif case == "forced_overlap":
        valid, ff, fl = np.array([5, 6, 24], np.int32), 3, 4   # windows overlap in short rows
        k_row = np.array([1, 2, 3], np.int32)                  # forced count exceeds k_row
    elif case == "forced_whole_row":
        valid, ff, fl = np.array([4, 8, 7], np.int32), 4, 4
    elif case == "k_row_zero_and_large":
        k_row, valid = np.array([0, 8, 8], np.int32), np.array([24, 3, 0], np.int32)
    elif case == "k_above_n":
        n, k = 6, 10
        scores, valid = scores[:, :n], np.array([6, 2, 0], np.int32)
    run_all(scores, k, valid, k_row, ff, fl, LAYOUTS[:2], interpret=interpret)


def test_cases_discriminate():
    """Negative control: a plain lax.top_k on the scores gets the tie and forced cases wrong."""
    scores = np.array([[0.0, 1.0, 1.0, 1.0, 5.0, -1.0]], np.float32)
    expected = numpy_topk(scores, 3, np.array([6]), force_last=1)
    naive = np.sort(np.asarray(jax.lax.top_k(jnp.asarray(scores), 3)[1]), axis=1)
    assert not np.array_equal(naive, expected[0])
    np.testing.assert_array_equal(expected[0], [[1, 4, 5]])


@pytest.mark.parametrize("width", [1, 8, 32, 96, 512, 4096])
def test_grouped_running_sum_is_the_cumsum(width):
    """The keep's two-level scan gives numpy's cumsum and row totals on packed 16-bit counts;
    a scan that restarts at each group boundary (the outer scan left out) does not."""
    rng = np.random.default_rng(width)
    x = (rng.integers(0, 2, (3, width)) | (rng.integers(0, 2, (3, width)) << 16)).astype(np.int32)
    for grouped in (True, False):
        running, total = keys._running_sum(jnp.asarray(x), grouped)
        np.testing.assert_array_equal(running, np.cumsum(x, axis=1))
        np.testing.assert_array_equal(total, x.sum(axis=1))
    if width > keys.SCAN_GROUP:
        restarted = np.cumsum(x.reshape(3, -1, keys.SCAN_GROUP), axis=2).reshape(3, width)
        assert not np.array_equal(restarted, np.cumsum(x, axis=1))


def test_matches_at_a_larger_row(interpret):
    """A 1024-wide row through the default layout and a streamed one, with sinks and recents."""
    scores = make_scores(7, 2, 1024, "normal")
    scores[1] = np.round(scores[1], 1)  # many ties
    valid, k_row = np.array([1024, 700], np.int32), np.array([100, 3], np.int32)
    run_all(scores, 128, valid, k_row, 4, 16, [dict(), dict(block_n=256, block_sel=128)],
            interpret=interpret)


def test_auto_backend_and_jit(interpret):
    scores = make_scores(3, 4, 64, "normal")
    valid = np.array([64, 10, 0, 33], np.int32)
    expected = numpy_topk(scores, 8, valid)
    assert_selected(topk.topk_select(jnp.asarray(scores), 8, valid=valid), expected)
    jitted = jax.jit(lambda s, v: topk.topk_select(s, 8, valid=v, backend="pallas",
                                                   interpret=interpret))
    assert_selected(jitted(jnp.asarray(scores), jnp.asarray(valid)), expected)


@pytest.mark.parametrize("call, match", [
    (lambda s, v: topk.topk_select(s[0], 4, valid=v), "scores: shape=.*expected a \\[R, N\\]"),
    (lambda s, v: topk.topk_select(s.astype(jnp.bfloat16), 4, valid=v), "float32"),
    (lambda s, v: topk.topk_select(s, 0, valid=v), "k=0: expected a static int >= 1"),
    (lambda s, v: topk.topk_select(s, 4.0, valid=v), "k=4.0"),
    (lambda s, v: topk.topk_select(s, 4, valid=v[:1]), "valid: shape=\\(1,\\).*expected \\[2\\]"),
    (lambda s, v: topk.topk_select(s, 4, valid=v.astype(jnp.float32)), "valid: .*float32"),
    (lambda s, v: topk.topk_select(s, 4, valid=v, k_row=v[None]), "k_row: shape=\\(1, 2\\)"),
    (lambda s, v: topk.topk_select(s, 4, valid=v, force_first=-1), "force_first=-1"),
    (lambda s, v: topk.topk_select(s, 4, valid=v, force_first=2, force_last=3),
     "force_first \\+ force_last = 2 \\+ 3 > k=4"),
    (lambda s, v: topk.topk_select(s, 4, valid=v, backend="cuda"), "backend='cuda'"),
    (lambda s, v: topk.topk_select(s, 4, valid=v, backend="pallas", block_n=48),
     "block_n=48: expected a power of 2"),
    (lambda s, v: topk.topk_select(s, 4, valid=v, backend="reference", block_k=3),
     "block_k=3: expected a power of 2"),
    (lambda s, v: topk.topk_select(s, 4, valid=v, split=1), "split=1: expected None or a bool"),
    (lambda s, v: topk.topk_select(s, 4, valid=v, split=True, block_rows=2),
     "block_rows=2 with split=True"),
    (lambda s, v: topk.topk_select(s, 4, valid=v, split=True, block_n=4, block_sel=8),
     "block_sel=8 > block_n=4 with split=True"),
    (lambda s, v: topk.topk_select(s, 4, valid=v, sample_stride=3),
     "sample_stride=3: expected 0 \\(no sample\\) or a power of 2"),
    (lambda s, v: topk.topk_select(s, 4, valid=v, split=False, sample_stride=4),
     "sample_stride=4 with split=False"),
    (lambda s, v: topk.ratio_budget(1.5, v), "ratio=1.5: expected a static number in \\[0, 1\\]"),
    (lambda s, v: topk.ratio_budget(0.1, v, minimum=-1), "minimum=-1"),
    (lambda s, v: topk.ratio_budget(0.1, v, minimum=8, maximum=4), "maximum=4"),
    (lambda s, v: topk.top_p_budget(s, 0.0, v), "p=0.0: expected a static number in \\(0, 1\\]"),
    (lambda s, v: topk.threshold_budget(s, 2.0, v), "threshold=2.0"),
    (lambda s, v: topk.top_p_budget(s, 0.5, v[:1]), "valid: shape=\\(1,\\)"),
    (lambda s, v: topk.fixed_budget(-1, v), "k=-1: expected >= 0"),
])
def test_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call(jnp.zeros((2, 8), jnp.float32), jnp.array([8, 8], jnp.int32))


def test_unknown_tuning_knob():
    with pytest.raises(TypeError, match="block_m"):
        topk.topk_select(jnp.zeros((2, 8), jnp.float32), 4, valid=jnp.array([8, 8]), block_m=4)


# --------------------------------------------------------------------------------------------
# Split path: long rows across (row, chunk) programs

# Chunks of 16 columns scanned 8 at a time, so that a 40-wide row spans two whole chunks and
# a ragged one, and ties and -1 padding cross chunk boundaries.
SPLIT = dict(split=True, block_n=16, block_sel=8, block_k=4)


@SETTINGS
@given(seed=st.integers(0, 2**16), kind=st.sampled_from(sorted(VALUE_SETS)),
       valid=st.lists(st.integers(0, 40), min_size=3, max_size=3),
       k_row=st.one_of(st.none(), st.lists(st.integers(0, 16), min_size=3, max_size=3)))
def test_split_random_problems(interpret, seed, kind, valid, k_row):
    """Three rows; one static shape, so that one compile serves every example."""
    run_all(make_scores(seed, 3, 40, kind), 16, np.array(valid, np.int32), k_row, 2, 3, [SPLIT],
            interpret=interpret)


def split_edge_rows():
    """Eight rows of 24 columns, k=32 > N, one edge case per row: (scores, valid, k_row)."""
    rng = np.random.default_rng(5)
    scores = rng.standard_normal((8, 24)).astype(np.float32)
    scores[0] = 0.25                                # a whole row of ties
    scores[1] = np.where(np.arange(24) % 3 == 0, 1.0, 0.25)  # 8 tied winners over 3 chunks
    scores[2] = np.where(np.arange(24) % 2 == 0, 1.0, 0.25)  # 12 tied winners, fewer fit
    scores[3, 6:] = -np.inf                         # fewer finite scores than the budget
    scores[4] = -np.inf                             # nothing finite, valid 5
    scores[5] = rng.choice(VALUE_SETS["specials"], 24)     # NaN, +-inf, 0
    valid = np.array([24, 24, 24, 24, 5, 24, 24, 0], np.int32)
    k_row = np.array([8, 8, 8, 12, 8, 5, 32, 8], np.int32)  # row 6: budget > N
    return scores, valid, k_row


def test_split_edge_cases(interpret):
    scores, valid, k_row = split_edge_rows()
    run_all(scores, 32, valid, k_row, 1, 2, [dict(SPLIT, block_n=8, block_sel=4)],
            interpret=interpret)


def test_split_full_tile_of_ties(interpret):
    """A widest scan step (32768 columns) with every key in one high bin: the packed pair of
    16-bit counts reaches 2**31 and must still read back exactly."""
    scores = np.ones((1, 32768), np.float32)  # key 0x3F800000: top digit 0xB, a high bin
    run_all(scores, 100, np.array([32768], np.int32), None, 0, 0,
            [dict(split=True, block_n=32768, block_sel=32768, block_k=128)],
            interpret=interpret)


@pytest.mark.parametrize("num_rows, k", [(1, 13107), (8, 4096)])
def test_split_at_131072_columns(interpret, num_rows, k):
    """Rows of 131072 through the default chunks of the split path, against the reference:
    rounded scores (ties across chunks), -inf and NaN tails, valid < N, per-row k_row."""
    n = 131072
    rng = np.random.default_rng(num_rows)
    scores = np.round(rng.standard_normal((num_rows, n)), 1).astype(np.float32)
    valid = np.full(num_rows, n, np.int32)
    k_row = np.full(num_rows, k, np.int32)
    if num_rows > 1:
        scores[1, 100:] = -np.inf                                 # padding fills by index
        scores[2, ::7] = np.nan
        scores[3] = rng.choice(np.float32([0.0, 0.5, 1.0]), n)   # few distinct values
        valid[4:] = [n - 1, 70001, 3000, 0]
        k_row[5:] = [k // 3, k, 17]
    assert topk.default_tuning(num_rows, n, k)["split"]
    kw = dict(valid=valid, k_row=k_row, force_first=4, force_last=64)
    out = topk.topk_select(jnp.asarray(scores), k, backend="pallas", interpret=interpret,
                           sample_stride=0, **kw)
    ref = topk.topk_select_reference(jnp.asarray(scores), k, **kw)
    assert_selected(out, (np.asarray(ref.indices), np.asarray(ref.count)))
    assert np.all(np.asarray(out.count)[:4] == k)  # full rows: the budget binds


def test_split_negative_control(interpret):
    """The split comparison catches a wrong tie rule: ties to the higher index differ from the
    kernel's output on the rows whose ties at T cross chunks and do not all fit."""
    scores, valid, k_row = split_edge_rows()
    kw = dict(valid=np.full(8, 24, np.int32), k_row=k_row)
    out = topk.topk_select(jnp.asarray(scores), 32, backend="pallas", interpret=interpret,
                           **SPLIT, **kw)
    ref = topk.topk_select_reference(jnp.asarray(scores), 32, **kw)
    # Ties to the higher index: the reference on the reversed row, mapped back.
    flipped = topk.topk_select_reference(jnp.asarray(scores[:, ::-1].copy()), 32, **kw)
    count = np.asarray(flipped.count)[:, None]
    slot = np.arange(32)[None, :]
    higher = np.sort(np.where(slot < count, 23 - np.asarray(flipped.indices), 99), axis=1)
    higher = np.where(slot < count, higher, -1)
    np.testing.assert_array_equal(np.asarray(out.indices), np.asarray(ref.indices))
    for r in (0, 2):  # the rows with more ties at T than the budget takes
        assert not np.array_equal(np.asarray(out.indices)[r], higher[r])


@pytest.mark.parametrize("seen_shift", [(1, 0), (0, 1)], ids=["offset+1", "ties_before+1"])
def test_split_mutants_fail(interpret, monkeypatch, seen_shift):
    """Negative control: an off-by-one chunk offset, or a tie share off by one, in the
    compaction must make the comparison with the reference fail."""
    keep_tile = split._keep_tile

    def mutant(indices_ref, store_rows, row_ok, cols, key, thr, ties_wanted, seen, k):
        seen = (seen[0] + seen_shift[0], seen[1] + seen_shift[1])
        return keep_tile(indices_ref, store_rows, row_ok, cols, key, thr, ties_wanted, seen, k)

    monkeypatch.setattr(split, "_keep_tile", mutant)
    scores, valid, k_row = split_edge_rows()
    out = jax.jit(lambda s: split._topk_split_pallas(   # a fresh trace sees the mutant
        s, jnp.asarray(valid), jnp.asarray(k_row), k=32, force_first=1, force_last=2,
        block_n=8, block_sel=4, block_k=2, num_warps=4, num_stages=1,
        interpret=interpret))(jnp.asarray(scores))
    ref = topk.topk_select_reference(jnp.asarray(scores), 32, valid=valid, k_row=k_row,
                                     force_first=1, force_last=2)
    assert not np.array_equal(np.asarray(out[0]), np.asarray(ref.indices))


def test_default_tuning_paths(monkeypatch):
    """The rule: split rows wider than the resident width; rows that fit it stay per-row,
    however few."""
    monkeypatch.setattr(common, "num_sms", lambda: 132)   # an H100's or H200's
    assert topk.default_tuning(8, 131072, 13107, sample_stride=0) == dict(
        split=True, sample_stride=0, block_rows=1, block_n=2048, block_sel=512, block_k=256,
        num_warps=4, num_stages=1)
    # few rows: the narrowest chunk whose grid is at most two programs per SM
    for rows, n, block_n in ((1, 32832, 256), (2, 32832, 256), (4, 32832, 512),
                             (8, 32832, 1024), (1, 131072, 512), (1, 131136, 512),
                             (2, 131136, 1024), (8, 131136, 2048)):
        assert topk.default_tuning(rows, n, n // 10, sample_stride=0)["block_n"] == block_n
    assert topk.default_tuning(512, 131072, 13107)["split"]
    assert topk.default_tuning(8, 32769, 3277)["split"]
    for rows, n in ((1, 32768), (8, 4096), (64, 8192), (128, 32768), (512, 32768), (2, 2048)):
        assert not topk.default_tuning(rows, n, n // 10)["split"], (rows, n)
    assert not topk.default_tuning(8, 131072, 13107, block_rows=2)["split"]
    assert topk.default_tuning(1, 1 << 23, 4096)["block_n"] == 32768  # at most 256 chunks
    # per-row knobs: the keep from the resident row, except at 16384 columns
    for n, warps, block_sel in ((2048, 4, 2048), (8192, 8, 8192), (16384, 16, 4096),
                                (32768, 32, 32768)):
        tuning = topk.default_tuning(512, n, n // 10)
        assert (tuning["num_warps"], tuning["block_sel"]) == (warps, block_sel), n


# --------------------------------------------------------------------------------------------
# Sampled-threshold path: a threshold from every 4th column, candidates over chunks of 256


SAMPLED = dict(sample_stride=4, block_n=256, block_sel=64, block_k=16, num_warps=4,
               num_stages=1)


@functools.partial(jax.jit, static_argnames=("k", "force_first", "force_last", "interpret",
                                             *SAMPLED))
def sampled_path(scores, valid, k_row, **static):
    """The sampled path's (indices, count, fits), fits: the candidates served the call."""
    return sampled._topk_sampled_pallas(scores, valid, k_row, **static)


def run_sampled(scores, k, valid, k_row, force_first, force_last, interpret, knobs=SAMPLED):
    """Assert the sampled path equals the numpy twin -> whether the candidates served."""
    k_row = np.full(len(valid), k, np.int32) if k_row is None else np.asarray(k_row, np.int32)
    indices, count, fits = sampled_path(jnp.asarray(scores), jnp.asarray(valid, jnp.int32),
                                        jnp.asarray(k_row), k=k, force_first=force_first,
                                        force_last=force_last, interpret=interpret, **knobs)
    assert_selected(topk.Selected(indices, count),
                    numpy_topk(scores, k, valid, k_row, force_first, force_last))
    return bool(fits)


def sprinkled_scores(seed, num_rows, n, kind):
    """normal; rounded to 0.1 (ties at the threshold); or normal with -inf, NaN, +-0.0."""
    rng = np.random.default_rng(seed)
    scores = rng.standard_normal((num_rows, n)).astype(np.float32)
    if kind == "rounded":
        return np.round(scores, 1)
    if kind == "specials":
        specials = np.float32([-np.inf, np.nan, 0.0, -0.0])
        where = rng.random((num_rows, n)) < 0.1
        scores[where] = rng.choice(specials, int(where.sum()))
    return scores


@settings(max_examples=10, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**16), kind=st.sampled_from(["normal", "rounded", "specials"]),
       valid=st.lists(st.sampled_from([0, 1, 37, 300, 1000, 1024]), min_size=4, max_size=4),
       k_row=st.one_of(st.none(), st.lists(st.integers(0, 64), min_size=4, max_size=4)))
def test_sampled_random_problems(interpret, seed, kind, valid, k_row):
    """Four rows of 1024; one static shape, so that one compile serves every example. Away
    from a heavy tie at the threshold the candidates must serve, not the fallback."""
    fits = run_sampled(sprinkled_scores(seed, 4, 1024, kind), 64, np.array(valid), k_row, 2, 3,
                       interpret)
    assert fits


def test_sampled_edge_rows(interpret):
    """One edge case per row, all served by the candidates: empty and 1-column rows, a budget
    above valid, k_row 0 (only the forced columns), -inf tails, NaN and -0.0, ties."""
    scores = sprinkled_scores(3, 8, 1024, "specials")
    scores[2, 500:] = -np.inf                          # fewer finite scores than valid
    scores[5] = np.round(scores[5], 1)
    scores[6, 1::2] = -0.0                            # ties of -0.0 with +0.0 (none +0.0 here)
    scores[6, ::2] = np.abs(scores[6, ::2])
    valid = np.array([0, 1, 700, 37, 1024, 1000, 1024, 900], np.int32)
    k_row = np.array([8, 8, 64, 64, 0, 50, 64, 1], np.int32)
    assert run_sampled(scores, 64, valid, k_row, 2, 3, interpret)


def test_sampled_k_above_n(interpret):
    """k = 32 > N = 24 (a capacity larger than the row): every valid column is a candidate,
    ties and all, so the candidates serve even the rows of ties."""
    scores, valid, k_row = split_edge_rows()
    knobs = dict(SAMPLED, sample_stride=2, block_n=8, block_sel=4, block_k=4)
    assert run_sampled(scores, 32, valid, k_row, 1, 2, interpret, knobs)


def test_sampled_streamed_candidates(interpret, monkeypatch):
    """More candidates than a resident row holds: their per-row select streams them in tiles
    (RESIDENT_WIDTH patched to 128 against a capacity of 256), exactly."""
    monkeypatch.setattr(sampled, "RESIDENT_WIDTH", 128)
    assert topk.candidate_capacity(64, 4) == 256
    scores, valid = sprinkled_scores(5, 4, 1024, "rounded"), np.array([1024, 1000, 300, 37])
    k_row = np.array([64, 50, 64, 8])
    static = dict(SAMPLED, k=64, force_first=2, force_last=3, interpret=interpret)
    indices, count, fits = jax.jit(  # a fresh trace, which sees the patched width
        lambda s, v, kr: sampled._topk_sampled_pallas(s, v, kr, **static))(
        jnp.asarray(scores), jnp.asarray(valid, jnp.int32), jnp.asarray(k_row, jnp.int32))
    assert fits
    assert_selected(topk.Selected(indices, count), numpy_topk(scores, 64, valid, k_row, 2, 3))


def fallback_rows(case):
    """Four rows of 1024 that the sample must misjudge."""
    scores = sprinkled_scores(9, 4, 1024, "normal")
    if case == "all_equal":                 # every column ties: all are candidates
        scores[:] = 0.5
    elif case == "top_off_sample":          # the best columns lie between the sampled ones
        scores[:, 1::4] += 10.0             # T^ from the plain ones: too many candidates
    elif case == "top_on_sample":           # only the sampled columns are high
        scores[:, ::4] += 10.0              # T^ among them: too few candidates
    return scores


@pytest.mark.parametrize("case", ["all_equal", "top_off_sample", "top_on_sample"])
def test_sampled_fallback_is_exact(interpret, case):
    assert not run_sampled(fallback_rows(case), 64, np.full(4, 1024), None, 2, 3, interpret)


def test_sampled_negative_control(interpret, monkeypatch):
    """A rank of half the budget's share of the sample sets the threshold too high: rows with
    fewer candidates than their budget, which no select among the candidates could serve.
    The select kernel searches those rows over their own scores, exactly."""
    scores = jnp.asarray(sprinkled_scores(4, 4, 1024, "normal"))
    valid, k_row = jnp.full((4,), 1024, jnp.int32), jnp.full((4,), 64, jnp.int32)
    static = dict(k=64, force_first=2, force_last=3, block_n=256, block_sel=64, num_warps=4,
                  num_stages=1, interpret=interpret, sample_stride=4)
    ref = topk.topk_select_reference(scores, 64, valid=valid, k_row=k_row, force_first=2,
                                     force_last=3)
    ref = (np.asarray(ref.indices), np.asarray(ref.count))

    def select():  # a fresh trace, which sees the patched rank
        def run(s):
            candidates = sampled._sample_candidates(s, valid, k_row, **static)
            return candidates, sampled._select_candidates(s, valid, k_row, candidates, block_k=16,
                                                       **static)
        return jax.jit(run)(scores)

    candidates, out = select()
    assert candidates.fits
    assert_selected(topk.Selected(*out), ref)
    monkeypatch.setattr(sampled, "_sample_rank", lambda budget, stride, xp=jnp: budget // (2 * stride))
    candidates, out = select()
    assert not candidates.fits
    assert np.any(np.asarray(candidates.num) < np.asarray(candidates.budget))
    assert_selected(topk.Selected(*out), ref)


def test_sampled_at_131072_columns(interpret):
    """Eight rows of 131072, k=13107, through the default tuning (the sampled path): rounded
    scores (ties at the threshold), -inf and NaN, ragged valid and k_row; served by the
    candidates."""
    n, k = 131072, 13107
    rng = np.random.default_rng(8)
    scores = np.round(rng.standard_normal((8, n)), 1).astype(np.float32)
    scores[1, 9000:] = -np.inf
    scores[2, ::7] = np.nan
    valid = np.array([n, n, n, n, n - 1, 70001, 3000, 0], np.int32)
    k_row = np.array([k, 100, k, k, k, k // 3, k, 17], np.int32)
    tuning = topk.default_tuning(8, n, k)
    assert tuning.pop("sample_stride") == 16 and tuning.pop("split")
    tuning.pop("block_rows")
    assert run_sampled(scores, k, valid, k_row, 4, 64, interpret,
                       dict(tuning, sample_stride=16))


def test_sampled_capacity_and_rule():
    """The capacity holds the expected candidates of a full budget with SAMPLE_SIGMAS to
    spare; the default samples wide rows whose capacity stays resident."""
    for k, stride in [(13107, 16), (4096, 16), (6553, 8), (64, 4)]:
        rank = np.ceil(k / stride + 4 * np.sqrt(k / stride)) + 4
        expected = stride * rank
        assert expected + 4 * stride * np.sqrt(rank) <= topk.candidate_capacity(k, stride)
        assert topk.candidate_capacity(k, stride) < 2 * (expected + 4 * stride * np.sqrt(rank))
    assert topk.candidate_capacity(13107, 16) == 32768
    for shape, stride in [((512, 131072, 13107), 16), ((8, 131072, 4096), 16),
                          ((1, 131072, 13107), 0),         # one row: split alone
                          ((512, 65536, 6553), 8),
                          ((512, 131072, 30000), 16),      # capacity 65536: streamed
                          ((512, 131072, 120000), 0),      # capacity 262144: split alone
                          ((8, 32768, 3276), 0), ((64, 8192, 64), 0)]:
        assert topk.default_tuning(*shape)["sample_stride"] == stride, shape
    assert topk.default_tuning(512, 131072, 13107, sample_stride=0)["split"]
    assert topk.default_tuning(64, 1024, 64, sample_stride=4)["split"]
    assert topk.default_tuning(512, 32768, 3276)["sample_stride"] == 0


# --------------------------------------------------------------------------------------------
# Budgets


def test_fixed_and_ratio_budgets():
    valid = np.array([0, 1, 9, 10, 30, 1279, 1280, 1281, 131072, 2**31 - 1], np.int32)
    np.testing.assert_array_equal(topk.fixed_budget(64, valid), np.minimum(64, valid))
    for ratio, minimum, maximum in [(0.1, 128, None), (0.3, 0, None), (1 - 0.9, 0, 4096),
                                    (0.05, 3, None), (1.0, 0, None), (0.0, 2, None)]:
        frac = fractions.Fraction(ratio).limit_denominator(1 << 15)
        expected = [min(max(int(frac * v), minimum), v, maximum or v) for v in valid.tolist()]
        got = topk.ratio_budget(ratio, valid, minimum, maximum)
        np.testing.assert_array_equal(got, expected, err_msg=f"{ratio=}")
    # Kascade: k = min(max(0.1 * len, 128), len), floored like the reference code's int().
    np.testing.assert_array_equal(topk.ratio_budget(0.1, np.array([100, 2000, 12345]), 128),
                                  [100, 200, 1234])


def boundary_free_p(prob_rows, p):
    """Nudge p so that it is not within float32 rounding of any prefix mass."""
    for _ in range(100):
        if all(np.min(np.abs(np.cumsum(np.sort(r)[::-1]) - p)) > 1e-4 for r in prob_rows if len(r)):
            return p
        p = p * 0.97
    raise AssertionError("no boundary-free p")


@SETTINGS
@given(seed=st.integers(0, 2**16), p=st.floats(0.05, 1.0), logits=st.booleans(),
       kind=st.sampled_from(["normal", "ties"]))
def test_top_p_budget(seed, p, logits, kind):
    scores = make_scores(seed, 4, 50, kind) * 3
    if not logits:
        scores = np.abs(scores)
        scores[:, 0] = 1.0                         # every non-empty row has some mass
    valid = np.array([50, 17, 1, 0], np.int32)
    p = boundary_free_p(numpy_probabilities(scores, valid, logits), p)
    got = topk.top_p_budget(jnp.asarray(scores), p, valid, logits=logits)
    np.testing.assert_array_equal(got, numpy_top_p(scores, p, valid, logits))


def test_top_p_budget_ties_and_full_mass():
    scores = np.zeros((2, 8), np.float32)           # uniform rows: 1/8 (exact) per column
    valid = np.array([8, 8], np.int32)
    np.testing.assert_array_equal(topk.top_p_budget(jnp.asarray(scores), 0.5, valid), [4, 4])
    np.testing.assert_array_equal(topk.top_p_budget(jnp.asarray(scores), 0.3, valid), [3, 3])
    np.testing.assert_array_equal(topk.top_p_budget(jnp.asarray(scores), 1.0, valid), [8, 8])


@SETTINGS
@given(seed=st.integers(0, 2**16), threshold=st.floats(1e-4, 0.5), logits=st.booleans())
def test_threshold_budget(seed, threshold, logits):
    scores = make_scores(seed, 4, 50, "normal") * 3
    if not logits:
        scores = np.abs(scores)
    valid = np.array([50, 17, 1, 0], np.int32)
    probs = np.concatenate(numpy_probabilities(scores, valid, logits))
    while np.min(np.abs(probs - threshold) / threshold) < 1e-4:
        threshold *= 1.01
    got = topk.threshold_budget(jnp.asarray(scores), threshold, valid, logits=logits)
    np.testing.assert_array_equal(got, numpy_threshold(scores, threshold, valid, logits))


def test_budget_feeds_topk(interpret):
    """Lychee TopP end to end: the budget's columns carry at least p of the mass."""
    scores = make_scores(11, 3, 64, "normal") * 4
    valid = np.array([64, 40, 9], np.int32)
    k_row = topk.top_p_budget(jnp.asarray(scores), 0.9, valid)
    out = topk.topk_select(jnp.asarray(scores), 64, valid=valid, k_row=k_row, backend="pallas",
                           interpret=interpret)
    assert_selected(out, numpy_topk(scores, 64, valid, np.asarray(k_row)))
    for r, prob in enumerate(numpy_probabilities(scores, valid, True)):
        mass = prob[np.asarray(out.indices[r, : int(out.count[r])])]
        assert mass.sum() >= 0.9 - 1e-6 and mass.sum() - mass.min() < 0.9


# --------------------------------------------------------------------------------------------
# LogitRows: the dense kernel's unpooled logits, pooled as each path reads them


def make_logit_rows(seed, num_rows, heads, n, *, lse=True, dtype=jnp.float16, block_n=16):
    """Rows as the decode kernel writes them: logits minus a running max (<= 0, rounded to
    dtype, so that equal values, hence ties, occur), per-block maxes, per-head LSEs."""
    rng = np.random.default_rng(seed)
    relative = -np.abs(rng.standard_normal((num_rows, heads, n))) * 4
    block_max = rng.standard_normal((num_rows, heads, -(-n // block_n))).astype(np.float32)
    rows = topk.LogitRows(jnp.asarray(relative, dtype), jnp.asarray(block_max),
                          jnp.asarray(rng.standard_normal((num_rows, heads)) + 3, jnp.float32)
                          if lse else None, block_n)
    return rows


def numpy_pooled(rows):
    """float64 numpy twin of the pooling: the sum over heads of exp(relative + block max -
    lse), or the logit relative + block max."""
    relative = np.asarray(rows.relative, np.float64)
    block_max = np.repeat(np.asarray(rows.block_max, np.float64), rows.block_n, axis=-1)
    logits = relative + block_max[..., :relative.shape[-1]]
    if rows.lse is None:
        return logits[:, 0]
    return np.exp(logits - np.asarray(rows.lse, np.float64)[..., None]).sum(axis=1)


LOGIT_ROWS = [dict(heads=4), dict(heads=1), dict(heads=1, lse=False),
              dict(heads=3, dtype=jnp.float32, block_n=8)]


@pytest.mark.parametrize("spec", LOGIT_ROWS, ids=["group_sum", "head_probs", "mean_query",
                                                  "f32_g3"])
def test_logit_rows_pool_as_read(spec, interpret):
    """Every path pools LogitRows while loading them and selects what the numpy twin selects
    on the pooled float32 scores (per-row resident and tiled, split, sampled), with ragged
    lengths, budgets and forced columns."""
    rows = make_logit_rows(5, 4, n=200, **spec)
    pooled = numpy_pooled(rows)
    np.testing.assert_allclose(rows.scores(), pooled, rtol=2e-6)
    valid = np.array([200, 131, 0, 17], np.int32)
    k_row = np.array([30, 40, 5, 12], np.int32)
    expected = numpy_topk(pooled, 48, valid, k_row, 2, 5)
    kw = dict(valid=valid, k_row=k_row, force_first=2, force_last=5)
    assert_selected(topk.topk_select_reference(rows, 48, **kw), expected)
    for layout in (dict(), dict(block_sel=64), dict(block_n=64, block_sel=32, block_k=8),
                   dict(block_rows=2, block_n=256), SPLIT, dict(SAMPLED, split=True)):
        out = topk.topk_select(rows, 48, backend="pallas", interpret=interpret, **kw, **layout)
        assert_selected(out, expected)


def test_logit_rows_negative_control(interpret):
    """The block maxes and LSEs change the selection: pooling the relative logits alone, or
    with the maxes of the wrong blocks, selects differently."""
    rows = make_logit_rows(6, 2, 4, 128)
    valid = np.array([128, 128], np.int32)
    want = topk.topk_select(rows, 16, valid=valid, backend="pallas", interpret=interpret)
    for wrong in (topk.LogitRows(rows.relative, jnp.zeros_like(rows.block_max), rows.lse, 16),
                  topk.LogitRows(rows.relative, rows.block_max[..., ::-1], rows.lse, 16),
                  topk.LogitRows(rows.relative, rows.block_max, rows.lse[:, ::-1], 16)):
        got = topk.topk_select(wrong, 16, valid=valid, backend="pallas", interpret=interpret)
        assert not np.array_equal(np.asarray(got.indices), np.asarray(want.indices))


@pytest.mark.parametrize("rows, match", [
    (lambda r: topk.LogitRows(r.relative.astype(jnp.bfloat16), r.block_max, r.lse, 16),
     "LogitRows.relative: .*bfloat16: expected \\[R, G, N\\] float16 or float32"),
    (lambda r: topk.LogitRows(r.relative, r.block_max[..., :-1], r.lse, 16),
     "LogitRows.block_max: shape=\\(2, 4, 3\\).*expected \\[2, 4, 4\\] float32"),
    (lambda r: topk.LogitRows(r.relative, r.block_max, None, 16),
     "lse=None and G=4 heads"),
    (lambda r: topk.LogitRows(r.relative, r.block_max, r.lse[:, :2], 16),
     "LogitRows.lse: shape=\\(2, 2\\).*expected \\[2, 4\\] float32"),
    (lambda r: topk.LogitRows(r.relative, r.block_max, r.lse, 0), "block_n=0"),
])
def test_logit_rows_errors(rows, match):
    with pytest.raises(ValueError, match=match):
        topk.topk_select(rows(make_logit_rows(1, 2, 4, 64)), 8, valid=np.array([64, 64]))


# --------------------------------------------------------------------------------------------
# Lowering for CUDA and native GPU runs


def triton_modules(monkeypatch):
    """Collect the Triton modules a CUDA lowering builds, so that the test can verify them."""
    from jax._src.pallas.triton import pallas_call_registration as registration
    modules, lower = [], registration.lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        result = lower(*args, **kwargs)
        modules.append(result.module)
        return result
    monkeypatch.setattr(registration.lowering, "lower_jaxpr_to_triton_module", capture)
    return modules


@pytest.mark.parametrize("num_rows, n, k, tuning, num_kernels", [
    (512, 32768, 3276, {}, 1),                               # resident row, 32 warps
    (8, 32768, 3276, {}, 1),                                 # few resident rows: per-row
    (512, 131072, 13107, dict(split=False), 1),              # streamed row
    (64, 8192, 64, dict(block_rows=2), 1),
    (7, 1000, 50, dict(block_n=256, num_warps=4), 1),         # ragged N, streamed
    (8, 131072, 13107, dict(sample_stride=0), 2),    # split: radix pass, compaction
    (1, 131072, 4096, dict(sample_stride=0), 2),
    (3, 1000, 50, dict(split=True, block_n=256, block_sel=128), 2),  # split, ragged N
    # sampled: sample threshold, count, gather, select candidates, the misjudged rows
    (8, 131072, 13107, {}, 5),
    (512, 131072, 13107, {}, 5),
    (1, 131072, 4096, dict(sample_stride=16), 5),
    (256, 524288, 52428, {}, 5),                     # streamed candidates (capacity 131072)
    (3, 1000, 50, dict(sample_stride=2, block_n=256, block_sel=128), 5),  # ragged N
])
def test_lowers_for_cuda(monkeypatch, num_rows, n, k, tuning, num_kernels):
    modules = triton_modules(monkeypatch)
    fn = lambda s, v, kr: topk.topk_select(s, k, valid=v, k_row=kr, force_first=4,
                                           force_last=min(64, k - 4), backend="pallas",
                                           interpret=False, **tuning)
    text = lower_for_cuda(fn, jnp.zeros((num_rows, n), jnp.float32),
                          jnp.zeros((num_rows,), jnp.int32), jnp.zeros((num_rows,), jnp.int32))
    assert "triton" in text
    assert len(modules) == num_kernels and all(m.operation.verify() for m in modules)


@pytest.mark.parametrize("num_rows, n, heads, lse, num_kernels", [
    (512, 32768, 4, True, 1),       # Kascade's group sums at 32k: resident per-row path
    (2048, 32768, 1, True, 1),      # TidalDecode's per-head probabilities
    (512, 131072, 1, False, 5),     # Lychee's mean-query logits at 128k: sampled path
    (64, 8192, 4, True, 1),         # two rows per program: block_rows=2
])
def test_logit_rows_lower_for_cuda(monkeypatch, num_rows, n, heads, lse, num_kernels):
    modules = triton_modules(monkeypatch)
    blocks = n // 128

    def fn(relative, block_max, lse_, v, kr):
        rows = topk.LogitRows(relative, block_max, lse_ if lse else None, 128)
        return topk.topk_select(rows, n // 10, valid=v, k_row=kr, force_first=4, force_last=64,
                                backend="pallas", interpret=False,
                                block_rows=2 if n == 8192 else None)
    text = lower_for_cuda(fn, jnp.zeros((num_rows, heads, n), jnp.float16),
                          jnp.zeros((num_rows, heads, blocks), jnp.float32),
                          jnp.zeros((num_rows, heads), jnp.float32),
                          jnp.zeros((num_rows,), jnp.int32), jnp.zeros((num_rows,), jnp.int32))
    assert "triton" in text
    assert len(modules) == num_kernels and all(m.operation.verify() for m in modules)


def assert_selection_near(out, scores, valid, count, rtol):
    """A selection that may differ from the exact one only between scores within rtol of
    each other (the GPU's exp is not XLA's): the counts match, and per row no column left
    out scores above a kept one by more than rtol."""
    np.testing.assert_array_equal(np.asarray(out.count), np.asarray(count))
    scores, indices = np.asarray(scores), np.asarray(out.indices)
    for r, c in enumerate(np.asarray(count)):
        kept = indices[r, :c]
        assert (indices[r, c:] == -1).all() and (np.diff(kept) > 0).all()
        rest = np.setdiff1d(np.arange(int(valid[r])), kept)
        if c and len(rest):
            low, high = scores[r, kept].min(), scores[r, rest].max()
            assert high <= low + rtol * abs(low), (r, low, high)


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows, n, heads, lse", [(512, 32768, 4, True),
                                                     (2048, 32768, 1, True),
                                                     (512, 131072, 1, False)])
def test_native_logit_rows(num_rows, n, heads, lse):
    rows = make_logit_rows(0, num_rows, heads, n, lse=lse, block_n=128)
    rng = np.random.default_rng(1)
    valid = rng.integers(n // 2, n + 1, num_rows).astype(np.int32)
    k = n // 10
    out = topk.topk_select(rows, k, valid=valid, backend="pallas")
    ref = topk.topk_select_reference(rows, k, valid=valid)
    assert_selection_near(out, rows.scores(), valid, ref.count, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("path", [dict(split=False), dict(split=True, sample_stride=0),
                                  dict(split=True, sample_stride=16)],
                         ids=["per_row", "split", "sampled"])
@pytest.mark.parametrize("num_rows, n, k", [(512, 32768, 3276), (512, 131072, 13107),
                                            (512, 2048, 64), (64, 8192, 64),
                                            (8, 131072, 13107), (1, 131072, 4096),
                                            (2, 32832, 3283)])
def test_native_matches_reference(num_rows, n, k, path):
    rng = np.random.default_rng(0)
    scores = jnp.asarray(rng.standard_normal((num_rows, n)).astype(np.float32))
    valid = jnp.asarray(rng.integers(n // 2, n + 1, num_rows).astype(np.int32))
    k_row = jnp.asarray(rng.integers(k // 2, k + 1, num_rows).astype(np.int32))
    for kw in (dict(), dict(force_first=4, force_last=min(64, k - 4), k_row=k_row)):
        out = topk.topk_select(scores, k, valid=valid, backend="pallas", **path, **kw)
        ref = topk.topk_select_reference(scores, k, valid=valid, **kw)
        np.testing.assert_array_equal(np.asarray(out.indices), np.asarray(ref.indices))
        np.testing.assert_array_equal(np.asarray(out.count), np.asarray(ref.count))
