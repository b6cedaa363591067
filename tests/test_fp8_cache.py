"""The fp8 (float8_e4m3fn) KV cache: the quantizer against its error bound, the kernels'
scales folded past their dots against dequantized tiles, the cache's scale layout, every
method at full budget on an fp8 cache against dense on the same cache (the embedded model),
fp8 against bf16 logits, capacity and refused kv_dtype values. (Sharded equals unsharded
with fp8: test_sharding.py.)"""
import functools
import importlib
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparsejax
from sparsejax import cache as kv
from sparsejax import methods as M
from sparsejax.models import ModelConfig
from sparsejax.pallas_kernels import common
from sparsejax.plan import as_plan
from sparsejax.train import data

E4M3_MAX = 448.0
# e4m3 keeps 3 mantissa bits: round to nearest is within half an ulp, 2^-4 of the value for
# normal numbers; below the smallest normal (2^-6) the ulp is fixed at 2^-9 (of the scale)
REL_BOUND, SUBNORMAL_ABS = 2.0 ** -4, 2.0 ** -10


def e4m3_bound(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Largest round-to-nearest error of each element of x [..., D] stored with scale [...]."""
    return np.maximum(REL_BOUND * np.abs(x), SUBNORMAL_ABS * scale[..., None]) * (1 + 1e-6)


def spread_values(shape, seed=0) -> np.ndarray:
    """Normal values with each vector (last axis) scaled by its own 10^U(-3, 3): a scale
    shared along any other axis than the last would lose the small vectors entirely."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * 10.0 ** rng.uniform(-3, 3, shape[:-1] + (1,))
            ).astype(np.float32)


def test_quantize_round_trip_within_the_e4m3_bound():
    x = spread_values((3, 5, 4, 8, 32))
    x[0, 0, 0, 0] = 0.0                       # an all-zero vector stays zero
    x8, scale = kv.quantize_kv(jnp.asarray(x))
    assert x8.dtype == jnp.float8_e4m3fn and scale.dtype == jnp.float32
    assert scale.shape == x.shape[:-1]
    absmax = np.abs(x).max(-1)
    np.testing.assert_allclose(np.asarray(scale), np.maximum(absmax / E4M3_MAX,
                                                             np.finfo(np.float32).tiny),
                               rtol=1e-6)
    back = np.asarray(kv.dequantize_kv(x8, scale))
    assert np.all(np.abs(back - x) <= e4m3_bound(x, np.asarray(scale)))
    assert np.all(back[0, 0, 0, 0] == 0.0)
    # the largest element of each vector is 448 * scale: representable exactly
    idx = np.abs(x).argmax(-1)[..., None]
    np.testing.assert_allclose(np.take_along_axis(back, idx, -1),
                               np.take_along_axis(x, idx, -1), rtol=1e-6)


@pytest.mark.parametrize("kv_dtype", ["fp8", "bf16"])
def test_as_stored_under_jit_is_what_the_cache_holds(kv_dtype):
    """What Quest's bounds and RESA's prior are computed from: the values a cache of
    `kv_dtype` stores, also inside a jitted program (on the GPU, XLA removes a pair of
    converts through a narrower type unless something keeps it) and also in float32."""
    x = jnp.asarray(spread_values((4, 6, 64), seed=3))
    if kv_dtype == "fp8":
        x8, scale = kv.quantize_kv(x)
        want = np.asarray(x8).astype(np.float32) * np.asarray(scale)[..., None]
    else:
        want = np.asarray(x.astype(jnp.bfloat16).astype(jnp.float32))
    got = jax.jit(kv.as_stored, static_argnums=1)(x, kv.resolve_kv_dtype(kv_dtype, x.dtype))
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), want)
    assert np.any(np.asarray(got) != np.asarray(x))     # it did round


def test_quantize_rounds_to_nearest():
    """Halfway between two e4m3 values (1 and 1.125 at scale 1) rounds to the even one."""
    x = jnp.asarray([[448.0, 1.0625, 1.1875, -1.0625, 3.0]], jnp.float32)
    x8, scale = kv.quantize_kv(x)
    assert float(scale[0]) == 1.0
    np.testing.assert_array_equal(np.asarray(x8.astype(jnp.float32))[0],
                                  [448.0, 1.0, 1.25, -1.0, 3.0])


def test_scales_folded_past_the_dots_equal_dequantized_tiles():
    """The kernels' fp8 math: dots of the rows as stored (fp8 converted exactly), each row's
    scale multiplying the logits q.k (rows along either axis) or the probabilities p that
    weight V (`common.fold_scales`), equal the dots of the dequantized rows (`dequantize`) to
    f32 rounding, over rows 6 decades apart; scales applied along the other axis do not."""
    x = spread_values((16, 64), 6)                          # 16 tokens, each its own scale
    x8, scale = kv.quantize_kv(jnp.asarray(x))
    rng = np.random.default_rng(7)
    q = rng.standard_normal((16, 64)).astype(np.float32)
    p = rng.uniform(0, 1, (16, 16)).astype(np.float32)
    stored, deq = x8.astype(jnp.float32), np.asarray(common.dequantize(x8, scale), np.float64)

    def dot(a, b):
        return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)

    def assert_f32_close(got, a, b):   # a @ b in float64, within f32 rounding of its terms
        want, size = a @ b, np.abs(a) @ np.abs(b)
        assert np.all(np.abs(np.asarray(got, np.float64) - want) <= 1e-6 * size)

    assert_f32_close(common.fold_scales(dot(q, stored.T), scale, axis=1), q, deq.T)
    assert_f32_close(common.fold_scales(dot(stored, q.T), scale, axis=0), deq, q.T)
    assert_f32_close(dot(common.fold_scales(p, scale, axis=1), stored), p, deq)
    wrong = np.asarray(common.fold_scales(dot(q, stored.T), scale, axis=0), np.float64)
    assert not np.allclose(wrong, q @ deq.T, rtol=1e-2, atol=0)


@pytest.mark.parametrize("dtype,size", [(jnp.bfloat16, 1e-6), (jnp.float16, 1e-4),
                                        (jnp.float16, 1e4), (jnp.float32, 1e-6)])
@pytest.mark.parametrize("base2", [False, True])
def test_online_softmax_over_fp8_values_keeps_dtype_precision_at_any_scale(dtype, size,
                                                                           base2):
    """The kernels' online softmax over fp8 V tiles (`common.online_softmax_step`: the power
    of 2 below each row's scale a logit bias) in two blocks, on V rows of absmax ~`size`
    spread over 4 decades, with masked keys (logit -inf, scale 0, as `load_fp8` gives them)
    and one row that sees no key in the first block: out = acc / l and lse = m + log l equal
    the float64 softmax over the dequantized rows, out within that dtype's rounding of the
    weights plus, for weights below float16's normal range, a subnormal's rounding (the V
    dot's weights are at most 2 and l at least 1 / the largest scale, so only terms ~2^14
    below the largest go subnormal), plus the float32 rounding of the biased logits (what
    float32 dots see)."""
    rng = np.random.default_rng(8)
    rows = rng.standard_normal((32, 64)) * size * 10.0 ** rng.uniform(-2, 2, (32, 1))
    x8, scale = kv.quantize_kv(jnp.asarray(rows, jnp.float32))
    scale = np.asarray(scale).copy()
    scale[28:] = 0.0                                        # masked keys
    s = (rng.standard_normal((16, 32)) * 3).astype(np.float32)
    s[:, 28:] = -np.inf
    s[0, :16] = -np.inf                                     # row 0: nothing in block 1
    deq = np.asarray(common.dequantize(x8, jnp.asarray(scale)), np.float64)
    p = np.exp(s.astype(np.float64) - s.max(1, keepdims=True))
    want_lse = np.log(p.sum(1)) + s.max(1)
    p /= p.sum(1, keepdims=True)
    dot = functools.partial(jnp.matmul, precision=jax.lax.Precision.HIGHEST,
                            preferred_element_type=jnp.float32)
    logits = s / np.log(2.0) if base2 else s
    acc, m, l = jnp.zeros((16, 64)), jnp.full((16,), -jnp.inf), jnp.zeros((16,))
    for block in (slice(0, 16), slice(16, 32)):
        acc, m, l = common.online_softmax_step(
            jnp.asarray(logits[:, block]), x8[block].astype(dtype), jnp.asarray(scale[block]),
            acc, m, l, dot, base2=base2, empty_rows=True)
    out = np.asarray(acc / l[:, None], np.float64)
    lse = np.asarray(m, np.float64) * (np.log(2.0) if base2 else 1.0) + np.log(np.asarray(l))
    np.testing.assert_allclose(lse, want_lse, rtol=0, atol=1e-5)
    roundoff = {jnp.bfloat16: 2.0**-8, jnp.float16: 2.0**-11, jnp.float32: 2.0**-23}[dtype]
    tiny = {jnp.bfloat16: 0.0, jnp.float16: 2.0**-25, jnp.float32: 0.0}[dtype]
    subnormal = tiny * np.abs(np.asarray(x8.astype(jnp.float32))).sum() * scale.max()
    # the biased logits' float32 rounding moves each weight by as much, relatively
    biased = np.abs(s[np.isfinite(s)]).max() + np.abs(np.log(scale[:28])).max()
    relative = 2 * roundoff + biased * 2.0**-23
    err = np.abs(out - p @ deq)
    assert np.all(err <= relative * (p @ np.abs(deq)) + subnormal)
    assert np.all(np.isfinite(out))


CFG = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16, intermediate_size=48)


def test_prompt_and_token_writes_keep_each_tokens_scale():
    """Keys written to an fp8 cache (prompt write and token write, through the page table)
    read back dequantized within each (token, KV head)'s bound: the scales lie beside their
    tokens [layers, pages, KV heads, slots]."""
    L, B, T, HK, D, P = CFG.num_layers, 2, 21, CFG.num_kv_heads, CFG.head_dim, 8
    cache = kv.allocate(CFG, B, 32, page_size=P, dtype=jnp.float32, kv_dtype="fp8")
    assert cache.k.dtype == jnp.float8_e4m3fn and cache.k_scale.shape == cache.k.shape[:-1]
    # a shuffled page table: the writes and reads go through it
    perm = np.random.default_rng(1).permutation(cache.num_pages).astype(np.int32)
    cache = cache.replace(page_table=jnp.asarray(perm.reshape(cache.page_table.shape)))
    keys, values = spread_values((L, B, T, HK, D), 2), spread_values((L, B, T, HK, D), 3)
    cache = kv.write_prompt(cache, jnp.asarray(keys), jnp.asarray(values),
                            jnp.full((B,), T, jnp.int32))
    new_k, new_v = spread_values((B, HK, D), 4), spread_values((B, HK, D), 5)
    pages, slots = kv.token_address(cache.page_table, jnp.full((B,), T), P)
    flat = kv.flat_pages(cache)
    for layer in range(L):
        flat = kv.write_token(flat, kv.layer_page_ids(pages, layer, cache.num_pages), slots,
                              jnp.asarray(new_k), jnp.asarray(new_v))
    cache = kv.with_pages(cache, flat)
    want = {"k": np.concatenate([keys, np.broadcast_to(new_k[None, :, None], (L, B, 1, HK, D))], 2),
            "v": np.concatenate([values, np.broadcast_to(new_v[None, :, None], (L, B, 1, HK, D))],
                                2)}
    pos = np.arange(T + 1)
    table = np.asarray(cache.page_table)
    for name in ("k", "v"):
        stored, scale = (np.asarray(getattr(cache, name).astype(jnp.float32)),
                         np.asarray(getattr(cache, f"{name}_scale")))
        for b in range(B):
            page, slot = table[b, pos // P], pos % P
            s = scale[:, page, :, slot].transpose(1, 0, 2)           # [L, T + 1, HK]
            got = stored[:, page, :, slot].transpose(1, 0, 2, 3) * s[..., None]
            x = want[name][:, b]
            assert np.all(np.abs(got - x) <= e4m3_bound(x, s)), (name, b)


@pytest.mark.parametrize("value", ["int8", "fp16", "e5m2", 3, jnp.int8])
def test_bad_kv_dtype_refused_naming_the_accepted_values(value):
    accepted = r"'auto', 'bf16', 'bfloat16', 'f32', 'float32', 'fp8', 'float8_e4m3fn'"
    with pytest.raises(ValueError, match=re.escape(f"kv_dtype={value!r}: expected None or one of ")
                                         + accepted):
        kv.allocate(CFG, 1, 16, dtype=jnp.float32, kv_dtype=value)


def test_kv_dtype_names():
    f32 = jnp.float32
    assert kv.resolve_kv_dtype(None, f32) == kv.resolve_kv_dtype("auto", f32) == f32
    assert kv.resolve_kv_dtype("bf16", f32) == kv.resolve_kv_dtype(jnp.bfloat16, f32) == jnp.bfloat16
    assert kv.resolve_kv_dtype("fp8", f32) == kv.resolve_kv_dtype("float8_e4m3fn", f32)
    assert kv.resolve_kv_dtype("fp8", f32) == jnp.float8_e4m3fn
    assert kv.resolve_kv_dtype(jnp.float16, jnp.float16) == jnp.float16   # the model's own


def test_query_dtype_of_an_fp8_cache():
    """The kernels read an fp8 cache with float16 queries for a bfloat16 model (e4m3 converts
    to float16 in one instruction), with the model's own dtype otherwise; a 16/32-bit cache
    with queries of its own dtype."""
    fp8 = jnp.float8_e4m3fn
    assert kv.query_dtype(fp8, jnp.bfloat16) == jnp.float16
    assert kv.query_dtype(fp8, jnp.float32) == jnp.float32
    assert kv.query_dtype(fp8, jnp.float16) == jnp.float16
    assert kv.query_dtype(jnp.bfloat16, jnp.float32) == jnp.bfloat16


def test_fp8_bytes_and_max_batch(monkeypatch):
    """An fp8 cache holds D bytes and a 4-byte scale per token and KV head where bf16 holds
    2 D: the cache's bytes and max_batch follow (1.94x the rows at head_dim 128). The decode
    step's and the prefill's temporaries are stood in for by a fixed share per row (on CPU
    they are the jnp reference's copies of the cache, which the GPU kernels do not make)."""
    gen = importlib.import_module("sparsejax.generate")   # the module, not the function

    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, num_layers=2,
                      num_heads=2, num_kv_heads=1, head_dim=128, intermediate_size=48)
    context, D = 4096, cfg.head_dim
    bf16 = kv.kv_bytes(cfg, 3, context, dtype=jnp.bfloat16)
    fp8 = kv.kv_bytes(cfg, 3, context, dtype=jnp.bfloat16, kv_dtype="fp8")
    assert bf16 == 2 * 2 * 3 * context * D * 2
    assert fp8 == 2 * 2 * 3 * context * (D + 4)
    cache = kv.allocate(cfg, 3, context, dtype=jnp.bfloat16, kv_dtype="fp8")
    assert kv.cache_bytes(cache) == fp8
    per_row = 10_000
    for program in ("decode_step_memory", "prefill_memory"):
        monkeypatch.setattr(gen, program,
                            lambda config, batch, *args, **kwargs: batch * per_row)
    free = 40 * bf16 // 3 + 12345
    b16 = sparsejax.max_batch(cfg, context, dtype=jnp.bfloat16, free_bytes=free)
    b8 = sparsejax.max_batch(cfg, context, dtype=jnp.bfloat16, free_bytes=free, kv_dtype="fp8")
    assert b16 == free // (bf16 // 3 + per_row) == 39
    assert b8 == free // (fp8 // 3 + per_row)
    assert b8 >= 1.9 * b16


LLAMA_8B_KV = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, num_layers=32,
                          num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=48)


@pytest.mark.parametrize("batch,capacity,spare", [
    (1, 65536, 0),                      # 2 GiB of fp8 K exactly: offsets still below 2**31
    (1, 65537, 8193 - 4097),            # just past 2 GiB: spare pages to just past 4 GiB
    (2, 50000, 8193 - 2 * 3125),
    (1, 131072, 1),                     # 4 GiB exactly: one page more
    (1, 131089, 0),                     # past 4 GiB: Pallas widens its offsets itself
])
def test_an_fp8_pool_of_2_to_4_gib_gets_spare_pages(batch, capacity, spare):
    """Pallas-Triton indexes a kernel operand with 32-bit element offsets unless it holds more
    than 4 GiB, and Triton adds them as signed: in an fp8 K or V pool of 2-4 GiB the offsets
    past 2**31 point before the array (an illegal address on the GPU; Llama-8B's shapes at
    64k-128k tokens). allocate gives such a pool spare pages to just past 4 GiB, which no row
    owns; kv_bytes counts them; a bf16 pool of the same tokens keeps its pages (its element
    offsets stay below 2**31 up to 4 GiB). Shapes only (`jax.eval_shape`)."""
    make = lambda kv_dtype, **kw: jax.eval_shape(lambda: kv.allocate(  # noqa: E731
        LLAMA_8B_KV, batch, capacity, dtype=jnp.bfloat16, kv_dtype=kv_dtype,
        check_memory=False, **kw))
    max_pages = -(-capacity // 16)
    fp8, bf16 = make("fp8"), make("bf16")
    assert fp8.k.shape[1] == fp8.v.shape[1] == batch * max_pages + spare
    assert fp8.k_scale.shape[1] == fp8.k.shape[1]
    assert bf16.k.shape[1] == batch * max_pages
    assert fp8.page_table.shape == (batch, max_pages)
    nbytes = math.prod(fp8.k.shape)
    assert not common.wraps_offsets(nbytes, 1)
    assert spare == 0 or nbytes - 2**32 <= 32 * 8 * 16 * 128   # at most a page past 4 GiB
    assert kv.cache_bytes(fp8) == kv.kv_bytes(LLAMA_8B_KV, batch, capacity, kv_dtype="fp8")
    # split over 2 devices' heads and 2 page shards: each device's share is what is checked
    shards = make("fp8", head_shards=2, page_shards=2) if batch == 2 else None
    if shards is not None:
        assert shards.k.shape[1] == batch * max_pages   # 0.8 GiB a device: nothing to add


def test_spare_pages_follow_each_page_shards_rows():
    """With pages split over data shards, each shard's rows own the first pages of its share
    and its spare pages follow them, so no row's pages leave its shard."""
    cache = jax.eval_shape(lambda: kv.allocate(LLAMA_8B_KV, 4, 40000, dtype=jnp.bfloat16,
                                               kv_dtype="fp8", check_memory=False,
                                               page_shards=2))
    max_pages, shard = 2500, cache.k.shape[1] // 2
    assert shard > 2 * max_pages and cache.k.shape[1] % 2 == 0
    # only the page table is returned: XLA drops the pool's zeros
    table = np.asarray(jax.jit(lambda: kv.allocate(
        LLAMA_8B_KV, 4, 40000, dtype=jnp.bfloat16, kv_dtype="fp8", check_memory=False,
        page_shards=2).page_table)())
    for row in range(4):
        first = row // 2 * shard + row % 2 * max_pages
        np.testing.assert_array_equal(table[row], np.arange(first, first + max_pages))
    table = np.asarray(jax.jit(lambda: kv.allocate(
        ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, num_layers=1,
                    num_heads=2, num_kv_heads=1, head_dim=64, intermediate_size=48),
        4, 64, dtype=jnp.bfloat16, kv_dtype="fp8", check_memory=False,
        page_shards=2).page_table)())
    np.testing.assert_array_equal(table, np.arange(16).reshape(4, 4))   # no spare: as before


@pytest.mark.parametrize("kernel", ["decode", "sparse", "prefill"])
def test_kernels_leave_an_fp8_pool_of_2_to_4_gib_to_the_references(kernel):
    """backend="pallas" refuses such a pool naming its bytes; "auto" runs the reference."""
    S = jax.ShapeDtypeStruct
    pages = S((140000, 8, 16, 128), jnp.float8_e4m3fn)   # 2.29e9 bytes
    assert common.wraps_offsets(math.prod(pages.shape), 1)
    q, small = S((1, 32, 128), jnp.float16), S((1,), jnp.int32)
    args = [q, pages, pages, S((1, 8), jnp.int32), small]
    if kernel == "decode":
        from sparsejax.pallas_kernels.decode_attention import paged_decode_attention as f
    elif kernel == "sparse":
        from sparsejax.pallas_kernels.sparse_attention import sparse_decode_attention as f
        f = functools.partial(f, unit=16)
        args += [S((1, 8, 4), jnp.int32), S((1, 8), jnp.int32)]
    else:
        from sparsejax.pallas_kernels.prefill_attention import paged_prefill_attention as f
        args[0] = S((1, 16, 32, 128), jnp.float16)
        args.append(small)
    scale = S(pages.shape[:-1], jnp.float32)
    call = lambda *a, **kw: f(*a[:-1], k_scale=a[-1], v_scale=a[-1], **kw).out  # noqa: E731
    with pytest.raises(ValueError, match=r"2293760000 bytes, where Pallas-Triton"):
        jax.eval_shape(functools.partial(call, backend="pallas", interpret=False), *args, scale)
    assert jax.eval_shape(functools.partial(call, backend="auto"), *args, scale).shape[-1] == 128


# ---- the embedded model ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def embedded():
    return sparsejax.from_pretrained(sparsejax.embedded_model_path(), dtype=jnp.float32)


@pytest.fixture(scope="module")
def batch():
    samples = [data.make_sample(t, 192, 11, 0) for t in ("niah", "vt")]
    return data.prompt_batch(samples)


NEW = 5


@pytest.fixture(scope="module")
def dense_fp8(embedded, batch):
    ids, lengths = batch
    return np.asarray(sparsejax.generate(embedded, ids, lengths=lengths, max_new_tokens=NEW,
                                         kv_dtype="fp8").tokens)


def full_budget(name, model):
    """A method from the registry whose budget covers every token of these rows."""
    fitted = M.fitted_beside(sparsejax.embedded_model_path(), model)
    return M.REGISTRY[name].at_budget(model.config, M.TopK(256), fitted)


@pytest.mark.parametrize("name", [n for n in M.REGISTRY if n != "dense"])
def test_full_budget_with_fp8_equals_dense_with_fp8(embedded, batch, dense_fp8, name):
    """Dense attention and every method read the same fp8 cache: at a budget covering every
    token each attends exactly as dense does (diagnostics: recall 1, attention error ~0 against
    dense over the same cache)."""
    ids, lengths = batch
    method = full_budget(name, embedded)
    if name == "delta":        # and RESA's prior from the dequantized cache adds nothing
        method = M.RESA(method, lam=1.0)
    out = sparsejax.generate(embedded, ids, lengths=lengths, max_new_tokens=NEW, method=method,
                             kv_dtype="fp8", return_diagnostics=True, prefill_chunk=64)
    np.testing.assert_array_equal(np.asarray(out.tokens), dense_fp8)
    np.testing.assert_allclose(np.asarray(out.diagnostics["recall"]), 1.0, atol=1e-5)
    assert float(np.max(out.diagnostics["attn_error"])) < 1e-4


def test_lossless_with_fp8_equals_dense_with_fp8(embedded, batch, dense_fp8):
    """Lossless mode verifies against dense attention over the same fp8 cache."""
    ids, lengths = batch
    method = M.REGISTRY["quest"].at_budget(embedded.config, M.TopK(32), M.Fitted())
    out = sparsejax.generate(embedded, ids, lengths=lengths, max_new_tokens=NEW, method=method,
                             kv_dtype="fp8", draft_tokens=2)
    np.testing.assert_array_equal(np.asarray(out.tokens), dense_fp8)


def test_fp8_logits_close_to_bf16(embedded, batch):
    """The same tokens through an f32, a bf16 and an fp8 cache (chunked prefill reading the
    cache, then decode steps) of the f32 model. Against the f32 cache's logits the fp8 cache's
    err by at most 6% of the logits' range (4% measured; e4m3 rounds each K/V element by up to
    2^-4, attention averages the errors), and more than bf16's (unit roundoff 2^-8) by a factor
    below their roundoffs' ratio 16 (7 measured): the fp8 path is taken, and adds no error of
    its own beyond rounding. The greedy tokens agree."""
    ids, lengths = jnp.asarray(batch[0]), jnp.asarray(batch[1])
    plan = as_plan(None, embedded.config, None)
    B = ids.shape[0]
    logits = {}
    for kv_dtype in ("f32", "bf16", "fp8"):
        cache = kv.allocate(embedded, B, ids.shape[1] + 8, kv_dtype=kv_dtype)
        out, cache = sparsejax.prefill(embedded, cache, ids, lengths, plan, chunk=64)
        steps = [out]
        for token in (5, 17, 300, 42):
            out, cache = sparsejax.decode_step(embedded, cache, jnp.full((B,), token, jnp.int32),
                                               plan)
            steps.append(out)
        logits[kv_dtype] = np.stack([np.asarray(x) for x in steps])
    spread = np.ptp(logits["f32"], axis=-1, keepdims=True)
    err = {k: np.abs(logits[k] - logits["f32"]) / spread for k in ("bf16", "fp8")}
    assert err["fp8"].max() < 0.06, err["fp8"].max()
    assert 2 < err["fp8"].mean() / err["bf16"].mean() < 16, (err["fp8"].mean(),
                                                              err["bf16"].mean())
    np.testing.assert_array_equal(logits["fp8"].argmax(-1), logits["f32"].argmax(-1))


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_quest_bounds_in_bf16_bound_every_cached_key(embedded, batch, kv_dtype):
    """Quest's page bounds are kept in bf16 for a bf16 and an fp8 cache (f32 bounds would add
    1/8 of a bf16 cache), after a chunked prefill and decode steps: each page's bound holds
    every key the page caches (dequantized) and is within one bf16 step of the tightest."""
    ids, lengths = jnp.asarray(batch[0]), jnp.asarray(batch[1])
    plan = as_plan(M.Quest(token_budget=32, dense_layers=1), embedded.config, None)
    B = ids.shape[0]
    cache = kv.allocate(embedded, B, ids.shape[1] + 8, kv_dtype=kv_dtype)
    _, cache = sparsejax.prefill(embedded, cache, ids, lengths, plan, chunk=64)
    for token in (5, 17, 300):
        _, cache = sparsejax.decode_step(embedded, cache, jnp.full((B,), token, jnp.int32),
                                         plan)
    kmin, kmax = (np.asarray(x, np.float32) for x in (cache.state.kmin, cache.state.kmax))
    assert cache.state.kmin.dtype == cache.state.kmax.dtype == jnp.bfloat16
    keys = np.asarray(kv.dequantized_pages(cache.k, cache.k_scale), np.float32)
    P, table = cache.page_size, np.asarray(cache.page_table)
    checked = 0
    for b, n in enumerate(np.asarray(cache.lengths)):
        for page in range(-(-n // P)):
            phys, held = table[b, page], min(P, n - page * P)
            k = keys[:, phys, :, :held]                          # [L, HK, held, D]
            lo, hi = k.min(axis=2), k.max(axis=2)
            step = np.abs(np.stack([lo, hi])) * 2.0**-7 + 1e-30
            assert np.all(kmin[:, phys] <= lo) and np.all(lo - kmin[:, phys] <= step[0])
            assert np.all(kmax[:, phys] >= hi) and np.all(kmax[:, phys] - hi <= step[1])
            checked += 1
    assert checked >= B


def test_outward_rounding_keeps_bounds():
    from sparsejax.method_state import _outward
    x = jnp.array([1.0001, -1.0001, 3.0, 0.0, jnp.inf, -jnp.inf], jnp.float32)
    lo, hi = _outward(x, x, jnp.bfloat16)
    assert lo.dtype == hi.dtype == jnp.bfloat16
    lo, hi = np.asarray(lo, np.float32), np.asarray(hi, np.float32)
    x = np.asarray(x)
    assert np.all(lo <= x) and np.all(hi >= x)
    np.testing.assert_array_equal(lo[2:], x[2:])     # representable values stay put
    np.testing.assert_array_equal(hi[2:], x[2:])
    assert lo[0] < 1.0001 < hi[0] and hi[0] - lo[0] == 2.0**-7


def test_generate_and_llm_refuse_a_bad_kv_dtype(embedded, batch):
    ids, lengths = batch
    with pytest.raises(ValueError, match=r"kv_dtype='fp4': expected None or one of 'auto'"):
        sparsejax.generate(embedded, ids, lengths=lengths, max_new_tokens=1, kv_dtype="fp4")
    with pytest.raises(ValueError, match=r"kv_dtype='e4m3': expected None or one of 'auto'"):
        sparsejax.LLM(sparsejax.embedded_model_path(), kv_cache_dtype="e4m3")


@pytest.mark.gpu
def test_fp8_token_write_is_in_place():
    """The decode step's write into a donated fp8 cache: k/v and their scales updated in place
    (no cache-sized temporary). On the GPU only: XLA's CPU backend upcasts a float8 (and a
    bf16) scatter to f16 / f32, a copy of the array per write; its GPU backend scatters them
    as the bytes they are. (tests/test_memory.py checks the whole f32 step on CPU.)"""
    L, pages, HK, P, D, B = 4, 64, 2, 16, 64, 4
    flat = kv.KVPages(jnp.zeros((L * pages, HK, P, D), jnp.float8_e4m3fn),
                      jnp.zeros((L * pages, HK, P, D), jnp.float8_e4m3fn),
                      jnp.ones((L * pages, HK, P), jnp.float32),
                      jnp.ones((L * pages, HK, P), jnp.float32))
    size = sum(x.size * x.dtype.itemsize for x in flat)
    args = (flat, jnp.arange(B, dtype=jnp.int32), jnp.zeros((B,), jnp.int32),
            jnp.ones((B, HK, D), jnp.float32), jnp.ones((B, HK, D), jnp.float32))

    def write_layers(flat, pages, slots, k, v):
        for layer in range(L):
            flat = kv.write_token(flat, pages + layer * 64, slots, k * layer, v)
        return flat

    def memory(fn):
        m = jax.jit(fn, donate_argnums=0).lower(*args).compile().memory_analysis()
        # bytes the program needs beside its donated arguments
        return m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes, m

    beyond, m = memory(write_layers)
    assert beyond < size / 8 and m.alias_size_in_bytes >= size
    # negative control: returning the old scales beside the new cache keeps a second copy
    # (an old value only read before the write, e.g. `k_scale * 2`, needs none)
    beyond, _ = memory(lambda flat, *a: (write_layers(flat, *a), flat.k_scale))
    assert beyond >= flat.k_scale.size * 4


def test_command_line_generates_over_an_fp8_cache(capsys):
    """`sparsejax generate --kv-dtype fp8` answers the README's prompt as bf16 does."""
    from sparsejax import cli

    prompt = ("the special magic number for orca 39 20 34 . leave bird again soon now can high "
              "wonder snow listen game claim still eat . what is the special magic number for "
              "orca ? answer : the special magic number for orca")
    assert cli.main(["generate", "--prompt", prompt, "--method", "delta", "--kv-dtype", "fp8",
                     "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.startswith("39 20 34")


@pytest.mark.gpu
def test_kernels_read_the_last_layer_of_a_padded_fp8_pool():
    """An fp8 pool that would be 3 GiB (Llama-8B's K heads, 32 layers, 96k tokens of one row),
    as allocate lays it out past 4 GiB: the dense and sparse kernels read the last layer's
    pages, whose offsets pass 2**31, as their references do (unpadded, they ran to an
    illegal address)."""
    from sparsejax.pallas_kernels.decode_attention import (
        paged_decode_attention, paged_decode_attention_reference)
    from sparsejax.pallas_kernels.sparse_attention import (
        sparse_decode_attention, sparse_decode_attention_reference)
    cache = kv.allocate(LLAMA_8B_KV, 1, 96 * 1024, dtype=jnp.bfloat16, kv_dtype="fp8",
                        check_memory=False)
    pages = kv.flat_pages(cache)
    del cache
    assert math.prod(pages.k.shape) > 2**32
    # fill the last layer's rows of the pool's first 4096 pages (the row's pages at layer 31)
    layer, used = LLAMA_8B_KV.num_layers - 1, 4096
    offset = layer * pages.k.shape[0] // LLAMA_8B_KV.num_layers
    keys = jax.random.split(jax.random.key(5), 2)
    k16, v16 = (jax.random.normal(key, (used,) + pages.k.shape[1:], jnp.float32)
                for key in keys)
    (kq, ks), (vq, vs) = kv.quantize_kv(k16), kv.quantize_kv(v16)
    pages = kv.KVPages(pages.k.at[offset:offset + used].set(kq),
                       pages.v.at[offset:offset + used].set(vq),
                       pages.k_scale.at[offset:offset + used].set(ks),
                       pages.v_scale.at[offset:offset + used].set(vs))
    table = (offset + jnp.arange(used, dtype=jnp.int32))[None]
    lengths = jnp.array([used * 16 - 5], jnp.int32)
    q = jax.random.normal(jax.random.key(6), (1, 32, 128), jnp.float16)
    args = (q, pages.k, pages.v, table, lengths)
    scales = dict(k_scale=pages.k_scale, v_scale=pages.v_scale)
    got = paged_decode_attention(*args, **scales, backend="pallas")
    want = paged_decode_attention_reference(*args, **scales)
    np.testing.assert_allclose(got.lse, want.lse, rtol=0, atol=2e-3)
    np.testing.assert_allclose(np.asarray(got.out, np.float32), np.asarray(want.out, np.float32),
                               rtol=0, atol=2e-2)
    picked = jnp.arange(0, used, 37, dtype=jnp.int32)   # pages of the row, each KV head
    indices = jnp.broadcast_to(picked, (1, 8, picked.shape[0]))
    count = jnp.full((1, 8), picked.shape[0], jnp.int32)
    got = sparse_decode_attention(*args, indices, count, unit=16, **scales, backend="pallas")
    want = sparse_decode_attention_reference(*args, indices, count, unit=16, **scales)
    np.testing.assert_allclose(got.lse, want.lse, rtol=0, atol=2e-3)
