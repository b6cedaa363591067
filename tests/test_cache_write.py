"""Writing tokens into the paged cache: Pallas kernel (interpret mode on CPU) vs reference vs
numpy, every cache dtype, odd KV-head counts, dropped tokens."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_checks import _quantize_kv_here, lower_for_cuda
from sparsejax.pallas_kernels.cache_write import write_tokens

FP8 = jnp.float8_e4m3fn


def make_case(seed, *, num_pages=12, kv_heads=3, page_size=8, head_dim=64, shape=(5,),
              dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16):
    """A pool filled with noise (so a write to the wrong place shows) and tokens at distinct
    random (page, slot) addresses, the last one dropped (page == num_pages) and, with two or
    more tokens, the first one too (page -1)."""
    rng = np.random.default_rng(seed)
    pool_shape = (num_pages, kv_heads, page_size, head_dim)
    pools = {name: rng.standard_normal(pool_shape).astype(np.float32) for name in "kv"}
    n = int(np.prod(shape))
    address = rng.choice(num_pages * page_size, n, replace=False)
    pages, slots = address // page_size, address % page_size
    pages[-1] = num_pages
    if n > 1:
        pages[0] = -1
    tokens = {name: (rng.standard_normal((n, kv_heads, head_dim)) * rng.uniform(
        1e-3, 1e3, (n, kv_heads, 1))).astype(np.float32) for name in "kv"}
    case = dict(pages=jnp.asarray(pages.reshape(shape), jnp.int32),
                slots=jnp.asarray(slots.reshape(shape), jnp.int32),
                k=jnp.asarray(tokens["k"].reshape(*shape, kv_heads, head_dim), dtype),
                v=jnp.asarray(tokens["v"].reshape(*shape, kv_heads, head_dim), dtype))
    if kv_dtype == FP8:
        (k8, ks), (v8, vs) = (_quantize_kv_here(pools[name]) for name in "kv")
        case.update(k_pages=k8, v_pages=v8, k_scale=ks, v_scale=vs)
    else:
        case.update(k_pages=jnp.asarray(pools["k"], kv_dtype),
                    v_pages=jnp.asarray(pools["v"], kv_dtype))
    return case


def numpy_write(case):
    """Each in-range token's vectors stored at its page and slot, one by one (quantized with
    the cache contract's formula for an fp8 cache)."""
    out = {name: np.asarray(case[name]).copy() for name in ("k_pages", "v_pages")}
    quantized = "k_scale" in case
    if quantized:
        out.update({name: np.asarray(case[name]).copy() for name in ("k_scale", "v_scale")})
    num_pages = out["k_pages"].shape[0]
    pages, slots = np.asarray(case["pages"]).ravel(), np.asarray(case["slots"]).ravel()
    for name in "kv":
        x = np.asarray(case[name]).reshape(pages.size, *case[name].shape[-2:])
        for t, (page, slot) in enumerate(zip(pages, slots)):
            if not 0 <= page < num_pages:
                continue
            if quantized:
                x8, scale = _quantize_kv_here(x[t])
                out[f"{name}_pages"][page, :, slot] = np.asarray(x8)
                out[f"{name}_scale"][page, :, slot] = np.asarray(scale)
            else:
                out[f"{name}_pages"][page, :, slot] = np.asarray(
                    jnp.asarray(x[t]).astype(out[f"{name}_pages"].dtype))
    return out


def run(case, **kwargs):
    names = ("k_pages", "v_pages", "k_scale", "v_scale")
    got = write_tokens(case["k_pages"], case["v_pages"], case["pages"], case["slots"],
                       case["k"], case["v"], k_scale=case.get("k_scale"),
                       v_scale=case.get("v_scale"), **kwargs)
    return {name: x for name, x in zip(names, got) if x is not None}


def assert_same_bits(got, want):
    assert set(got) == set(want)
    for name in want:
        a, b = np.asarray(got[name]), np.asarray(want[name])
        assert a.dtype == b.dtype and a.shape == b.shape, name
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg=name)


CASES = [  # (kv_dtype, token dtype, kv_heads, head_dim)
    (jnp.bfloat16, jnp.bfloat16, 3, 64),
    (jnp.float32, jnp.bfloat16, 1, 128),
    (jnp.float16, jnp.float32, 8, 64),
    (FP8, jnp.bfloat16, 3, 64),
    (FP8, jnp.float32, 2, 128),
]


@pytest.mark.parametrize("kv_dtype,dtype,kv_heads,head_dim", CASES)
def test_reference_matches_numpy(kv_dtype, dtype, kv_heads, head_dim):
    case = make_case(0, kv_dtype=kv_dtype, dtype=dtype, kv_heads=kv_heads, head_dim=head_dim)
    assert_same_bits(run(case, backend="reference"), numpy_write(case))


@pytest.mark.parametrize("kv_dtype,dtype,kv_heads,head_dim", CASES)
def test_kernel_matches_reference(kv_dtype, dtype, kv_heads, head_dim, interpret):
    """Bit for bit: the same cast, or the same quantization (absmax, division, round to
    nearest even) in the kernel as in XLA."""
    case = make_case(1, kv_dtype=kv_dtype, dtype=dtype, kv_heads=kv_heads, head_dim=head_dim,
                     shape=(4, 6), num_pages=20)
    want = run(case, backend="reference")
    assert_same_bits(run(case, backend="pallas", interpret=interpret), want)
    assert_same_bits(want, numpy_write(case))


def test_one_token_and_zero_vectors(interpret):
    """A decode step's single row, and an all-zero K vector (scale the smallest normal, the
    values 0) in an fp8 cache."""
    case = make_case(2, kv_dtype=FP8, shape=(1,), kv_heads=2)
    case["pages"] = case["pages"].at[0].set(3)
    case["k"] = case["k"].at[0, 1].set(0.0)
    got = run(case, backend="pallas", interpret=interpret)
    assert_same_bits(got, run(case, backend="reference"))
    slot = int(case["slots"][0])
    assert float(got["k_scale"][3, 1, slot]) == np.finfo(np.float32).tiny
    assert not np.asarray(got["k_pages"][3, 1, slot].astype(jnp.float32)).any()


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, FP8])
def test_in_place_under_jit_with_donation(kv_dtype):
    """Called inside a jitted function that donates the pools, the kernel's aliased outputs
    take the donated buffers: the program allocates nothing cache-sized. (GPU only: interpret
    mode on the CPU works on copies.)"""
    case = make_case(3, kv_dtype=kv_dtype, num_pages=256, shape=(4,))
    pools = {name: case[name] for name in ("k_pages", "v_pages", "k_scale", "v_scale")
             if name in case}
    size = sum(x.size * x.dtype.itemsize for x in pools.values())

    def step(pools, pages, slots, k, v):
        return write_tokens(pools["k_pages"], pools["v_pages"], pages, slots, k, v,
                            k_scale=pools.get("k_scale"), v_scale=pools.get("v_scale"),
                            backend="pallas")

    m = (jax.jit(step, donate_argnums=0)
         .lower(pools, case["pages"], case["slots"], case["k"], case["v"])
         .compile().memory_analysis())
    assert m.alias_size_in_bytes >= size
    assert m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes < size / 8


def test_bad_shapes_are_refused():
    case = make_case(4)
    with pytest.raises(ValueError, match=r"k.shape=\(5, 2, 64\): expected \(5, 3, 64\)"):
        write_tokens(case["k_pages"], case["v_pages"], case["pages"], case["slots"],
                     case["k"][:, :2], case["v"])
    with pytest.raises(ValueError, match="slots.shape"):
        write_tokens(case["k_pages"], case["v_pages"], case["pages"], case["slots"][:3],
                     case["k"], case["v"])


@pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, FP8])
def test_lowers_for_cuda(kv_dtype):
    case = make_case(5, kv_dtype=kv_dtype)
    args = [case[name] for name in ("k_pages", "v_pages", "pages", "slots", "k", "v")]
    scales = [case[name] for name in ("k_scale", "v_scale")] if kv_dtype == FP8 else []

    def fn(*a):
        return write_tokens(*a[:6], k_scale=a[6] if scales else None,
                            v_scale=a[7] if scales else None, backend="pallas",
                            interpret=False)

    text = lower_for_cuda(fn, *args, *scales)
    assert "write_tokens" in text



ROPE_CASES = [  # (num_heads, kv_heads, head_dim, qk_norm, kv_dtype, q_dtype)
    (9, 3, 64, False, jnp.bfloat16, jnp.bfloat16),     # SmolLM2: a GQA group of 3
    (12, 2, 128, False, FP8, jnp.float16),            # DS-Qwen-1.5B, fp8 cache, f16 queries
    (8, 4, 128, True, jnp.bfloat16, jnp.bfloat16),     # Qwen3's q/k norm
    (4, 4, 64, True, FP8, jnp.float16),
]


def rope_case(seed, num_heads, kv_heads, head_dim, qk_norm, kv_dtype, batch=5):
    """A q/k/v projection's output for `batch` rows at ragged positions, their RoPE angles,
    norm weights, and a cache (`make_case`) to write them into."""
    from sparsejax.models import ModelConfig
    from sparsejax.models.decoder import rope_angles
    rng = np.random.default_rng(seed)
    case = make_case(seed, kv_heads=kv_heads, head_dim=head_dim, shape=(batch,),
                     kv_dtype=kv_dtype)
    qkv = rng.standard_normal((batch, num_heads + 2 * kv_heads, head_dim)) * 3
    config = ModelConfig(model_type="llama", vocab_size=8, hidden_size=num_heads * head_dim,
                         intermediate_size=8,
                         num_layers=1, num_heads=num_heads, num_kv_heads=kv_heads,
                         head_dim=head_dim, rope_theta=500000.0)
    cos, sin = rope_angles(config, jnp.asarray(rng.integers(0, 100000, batch), jnp.int32))
    norms = {}
    if qk_norm:
        norms = {name: jnp.asarray(rng.uniform(0.5, 2, head_dim), jnp.bfloat16)
                 for name in ("q_norm", "k_norm")}
    args = dict(qkv=jnp.asarray(qkv, jnp.bfloat16), cos=cos, sin=sin,
                k_pages=case["k_pages"], v_pages=case["v_pages"], pages=case["pages"],
                slots=case["slots"], k_scale=case.get("k_scale"), v_scale=case.get("v_scale"),
                num_heads=num_heads, eps=1e-6, **norms)
    return args


@pytest.mark.parametrize("num_heads,kv_heads,head_dim,qk_norm,kv_dtype,q_dtype", ROPE_CASES)
def test_rope_and_write_matches_the_model(num_heads, kv_heads, head_dim, qk_norm, kv_dtype,
                                          q_dtype, interpret):
    """The fused kernel against its reference, the model's own split / q-k norm / RoPE and
    `write_tokens_reference`: bit for bit in interpret mode without q/k norm; else within a
    rounding of bf16 (a norm's sum may run in another order, the GPU may contract RoPE's
    multiply-add differently), the fp8 pages within one e4m3 step of their row's largest
    value."""
    from sparsejax.pallas_kernels.cache_write import rope_and_write, rope_and_write_reference
    args = rope_case(6, num_heads, kv_heads, head_dim, qk_norm, kv_dtype)
    names = ("q", "k_pages", "v_pages", "k_scale", "v_scale", "k", "v")
    got = dict(zip(names, rope_and_write(**args, q_dtype=q_dtype, return_kv=True,
                                         backend="pallas", interpret=interpret)))
    kw = {n: args[n] for n in ("k_scale", "v_scale", "eps")}
    kw.update({n: args.get(n) for n in ("q_norm", "k_norm")})
    want = dict(zip(names, rope_and_write_reference(
        *(args[n] for n in ("qkv", "cos", "sin", "k_pages", "v_pages", "pages", "slots",
                            "num_heads")), **kw, q_dtype=q_dtype, return_kv=True)))
    assert got["q"].dtype == q_dtype and got["q"].shape == (5, num_heads, head_dim)
    got = {n: x for n, x in got.items() if x is not None}
    want = {n: x for n, x in want.items() if x is not None}
    if interpret and not qk_norm:
        assert_same_bits(got, want)
        return
    for name in ("q", "k", "v"):   # a bf16 rounding of RoPE's two inputs, at the head's scale
        a, b = (np.asarray(x[name], np.float32) for x in (got, want))
        assert (np.abs(a - b) <= 2**-6 * np.abs(b).max(axis=-1, keepdims=True)).all(), name
    for name in ("k", "v"):
        pages = [np.asarray(x[f"{name}_pages"].astype(jnp.float32)) for x in (got, want)]
        if f"{name}_scale" in want:
            pages = [p * np.asarray(x[f"{name}_scale"])[..., None]
                     for p, x in zip(pages, (got, want))]
        step = np.abs(pages[1]).max(axis=-1, keepdims=True) * 2.0**-3
        assert (np.abs(pages[0] - pages[1]) <= step + 1e-6).all(), name


def test_rope_and_write_without_kv_and_bad_qkv(interpret):
    from sparsejax.pallas_kernels.cache_write import rope_and_write
    args = rope_case(7, 9, 3, 64, False, jnp.bfloat16)
    out = rope_and_write(**args, backend="pallas", interpret=interpret)
    assert out[0].dtype == jnp.bfloat16 and out[-2] is None and out[-1] is None
    with pytest.raises(ValueError, match=r"qkv.shape=\(5, 14, 64\): expected"):
        rope_and_write(**{**args, "qkv": args["qkv"][:, :14]})


def test_rope_and_write_reads_only_the_pages_rows(interpret):
    """qkv may carry more rows than pages (a batch of one's padding row): they are not read
    (NaN there changes nothing); fewer rows than pages are refused."""
    from sparsejax.pallas_kernels.cache_write import rope_and_write
    args = rope_case(9, 12, 2, 128, False, jnp.bfloat16)
    padded = jnp.concatenate([args["qkv"], jnp.full((2, *args["qkv"].shape[1:]), jnp.nan,
                                                     jnp.bfloat16)])
    for backend in ("pallas", "reference"):
        got = rope_and_write(**{**args, "qkv": padded}, backend=backend, interpret=interpret)
        want = rope_and_write(**args, backend=backend, interpret=interpret)
        assert got[0].shape == (5, 12, 128)
        assert_same_bits({i: x for i, x in enumerate(got) if x is not None},
                         {i: x for i, x in enumerate(want) if x is not None})
    with pytest.raises(ValueError, match=r"qkv.shape=\(4, 16, 128\), pages.shape=\(5,\)"):
        rope_and_write(**{**args, "qkv": args["qkv"][:4]})


def test_rope_and_write_lowers_for_cuda():
    from sparsejax.pallas_kernels.cache_write import rope_and_write
    args = rope_case(8, 12, 2, 128, True, FP8)
    arrays = {n: x for n, x in args.items() if isinstance(x, jax.Array)}

    def fn(arrays):
        return rope_and_write(**arrays, num_heads=12, eps=1e-6, q_dtype=jnp.float16,
                              return_kv=True, backend="pallas", interpret=False)

    assert "rope_and_write" in lower_for_cuda(fn, arrays)
