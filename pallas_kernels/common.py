"""Plumbing shared by every kernel family: backend choice, the shapes the kernels take, Triton
compiler params, the tuning convention, the LSE combine, the score rules, the selection group
each query head reads, the dequantization of an fp8 cache.

fp8 cache: k/v pages in float8_e4m3fn with one float32 scale per (page, KV head, slot), the
scales shaped as the pages without head_dim. Every kernel takes them as `k_scale`/`v_scale`
and reads a K tile through `load_fp8`: the fp8 rows converted to q's dtype (exact) and
their scales, unapplied; a V tile through `load_fp8_pairs`, the same values as two halves of
alternate columns, read as 16-bit words (`value_pairs`). `fold_scales` applies each row's
scale past the dot, to the [.., n] logits q.k, not to the [n, D] tile: a multiply per logit
instead of one per element. Each V row's scale enters the online softmax as a logit bias
(`online_softmax_step`). `dequantize` is the formula itself; the references apply it to the
pages they gather (`gather_pages`).

Tuning convention: every kernel file has a public `default_tuning(shapes...) -> dict` of its
static knobs, and its entry point takes each knob as an explicit keyword (None: the default),
merged by `resolve_tuning`. The measurements behind the defaults are in docs/tuning.md
(`## Kernels`).

The LSE combine lives here once: split-K reduction, hybrid dense/sparse merges and RESA all
call `merge_partials`; `merge_splits` is the same combine as one Pallas kernel, for the
decode kernels' split-K partials.
"""
from __future__ import annotations

import contextlib
import enum
import functools
import math
import warnings
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax



@contextlib.contextmanager
def _triton_on_purpose():
    """jax 0.11 marks the Triton backend of Pallas as deprecated in favour of Mosaic GPU. We use
    Triton on purpose (it has an interpret mode on CPU and lowers paged gathers): silence that
    warning where Triton is imported and called, leaving the global filters as they are."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning, message=".*[Tt]riton.*")
        yield


with _triton_on_purpose():
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

Backend = Literal["auto", "pallas", "reference"]
BACKENDS = ("auto", "pallas", "reference")
# What the paged kernels take (`pallas_support`); other shapes run the references.
HEAD_DIMS = (64, 128, 256)
PAGE_SIZES = (8, 16, 32, 64, 128)
DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
FP8 = jnp.dtype(jnp.float8_e4m3fn)  # the quantized cache's dtype; its scales are float32
MAX_GROUP = 16  # query heads per KV head: the GQA group fits one 16-row Triton dot
# SMs assumed where no GPU can be asked (CPU, interpret mode): the GPUs the defaults were
# tuned on have this many (docs/tuning.md), so the CPU tests see their default knobs.
DEFAULT_NUM_SMS = 132


_auto_override: list[str] = []


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


@functools.cache
def num_sms() -> int:
    """Streaming multiprocessors of the default device: the kernels' default grids aim at a
    few waves of this many programs. Asked of the GPU on first use (not at import, so that
    importing the kernels initialises no backend); DEFAULT_NUM_SMS without a GPU."""
    device = jax.devices()[0]
    count = getattr(device, "core_count", None) if device.platform == "gpu" else None
    return int(count) if count else DEFAULT_NUM_SMS


@contextlib.contextmanager
def use_backend(backend: str):
    """Within this block (at trace time), backend="auto" means `backend` — e.g. trace a whole
    decode step on the references on a GPU to check the kernels end to end. Trace a fresh
    function inside the block: an outer jit already traced keeps the path it compiled."""
    if backend not in ("pallas", "reference"):
        raise ValueError(f"backend={backend!r}: expected 'pallas' or 'reference'")
    _auto_override.append(backend)
    try:
        yield
    finally:
        _auto_override.pop()


def backend_overridden() -> bool:
    """Whether a `use_backend` block decides what "auto" means."""
    return bool(_auto_override)


def resolve_backend(backend: str) -> str:
    """'auto' -> 'pallas' on GPU, 'reference' elsewhere (or what `use_backend` says)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: expected one of {BACKENDS}")
    if backend == "auto":
        if _auto_override:
            return _auto_override[-1]
        return "pallas" if on_gpu() else "reference"
    return backend


def choose_backend(backend: str, unsupported: str | None) -> str:
    """Backend for one call. `unsupported` says why the Pallas kernel cannot take these shapes
    (None when it can): "auto" then runs the reference, an explicit "pallas" raises."""
    chosen = resolve_backend(backend)
    if chosen == "pallas" and unsupported is not None:
        if backend == "pallas":
            raise ValueError(unsupported)
        return "reference"
    return chosen


# Pallas-Triton widens a kernel operand's element offsets to 64 bits only past this many bytes
WIDE_OFFSETS_PAST = 2**32


def wide_offsets(x) -> bool:
    """Whether Pallas-Triton indexes kernel operand `x` (an array or its shape and dtype) with
    64-bit element offsets: past 4 GiB, such as a pool holding every layer of a long cache.
    Each gathered element's offset then costs 64-bit integer work, which a kernel's knobs
    must leave time for (`decode_attention.default_tuning`)."""
    return operand_bytes(x) > WIDE_OFFSETS_PAST


def operand_bytes(x) -> int:
    """Bytes of array (or shape-and-dtype) `x`."""
    return math.prod(x.shape) * jnp.dtype(x.dtype).itemsize


def wraps_offsets(nbytes: int, itemsize: int) -> bool:
    """Whether a kernel operand of `nbytes` bytes of `itemsize`-byte elements is one whose
    element offsets Pallas-Triton (jax 0.10-0.11) gets wrong: it indexes an operand with
    32-bit offsets unless it holds more than 4 GiB, and Triton adds them to the base pointer
    as signed, so in a 1-byte (fp8) operand of 2-4 GiB the offsets past 2**31 wrap to an
    illegal address. `cache.allocate` keeps an fp8 pool out of that band."""
    return itemsize == 1 and WIDE_OFFSETS_PAST // 2 < nbytes <= WIDE_OFFSETS_PAST


def pallas_support(q, k_pages) -> str | None:
    """Why the paged kernels cannot run these shapes, or None. q [B, HQ, D],
    k_pages [num_pages, HK, P, D]: head_dim in HEAD_DIMS, page size in PAGE_SIZES, a dtype
    of DTYPES, groups up to MAX_GROUP, and not an fp8 pool of 2-4 GiB (`wraps_offsets`)."""
    _, num_heads, head_dim = q.shape
    _, kv_heads, page_size, _ = k_pages.shape
    itemsize = jnp.dtype(k_pages.dtype).itemsize
    nbytes = operand_bytes(k_pages)
    if wraps_offsets(nbytes, itemsize):
        return (f"k_pages {k_pages.dtype}{list(k_pages.shape)}: {nbytes} bytes, where "
                "Pallas-Triton's 32-bit offsets into a 1-byte array wrap; expected at most "
                "2 GiB or more than 4 GiB (`sparsejax.allocate` adds spare pages past 4 GiB)")
    if head_dim not in HEAD_DIMS:
        return f"head_dim={head_dim}: expected one of {HEAD_DIMS}"
    if page_size not in PAGE_SIZES:
        return f"page_size={page_size}: expected one of {PAGE_SIZES}"
    if q.dtype not in DTYPES:
        return f"q.dtype={q.dtype}: expected one of {tuple(str(jnp.dtype(d)) for d in DTYPES)}"
    if num_heads // kv_heads > MAX_GROUP:
        return f"group size {num_heads // kv_heads}: expected at most {MAX_GROUP}"
    return None


def resolve_tuning(defaults: dict, **given) -> dict:
    """A kernel's `default_tuning` overridden by the knobs its caller gave (those not None)."""
    return {**defaults, **{name: value for name, value in given.items() if value is not None}}


def resolve_interpret(interpret: bool | None) -> bool:
    """None -> interpret mode unless a GPU is present (Pallas-Triton only compiles for GPUs)."""
    return (not on_gpu()) if interpret is None else bool(interpret)


def dot_precision(dtype, interpret: bool):
    """The precision of a compute-bound kernel's dots. f32 inputs on the GPU: three-pass TF32
    (Triton's tf32x3), about f32's accuracy on the tensor cores, where IEEE f32 dots run on
    the far slower CUDA cores (docs/tuning.md); interpret mode keeps IEEE (XLA on the CPU has
    no TF32). bf16/f16 dots are the same under either. The memory-bound decode kernels keep
    IEEE."""
    if jnp.dtype(dtype) == jnp.float32 and not interpret:
        return jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    return jax.lax.Precision.HIGHEST


def triton_params(num_warps: int, num_stages: int) -> plgpu.CompilerParams:
    """Explicit Triton compiler params: without them jax 0.10/0.11 routes to Mosaic GPU."""
    with _triton_on_purpose():
        return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def pallas_call(kernel, *, compiler_params, interpret: bool, **kwargs):
    """`pl.pallas_call` with the Triton params attached (interpret mode ignores them)."""
    with _triton_on_purpose():
        call = pl.pallas_call(kernel, compiler_params=compiler_params, interpret=interpret,
                              **kwargs)

    def run(*args):
        with _triton_on_purpose():
            return call(*args)

    return run


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_power_of_2(name: str, value, lo: int, hi: int) -> None:
    if not isinstance(value, int) or value < lo or value > hi or value & (value - 1):
        raise ValueError(f"{name}={value!r}: expected a power of 2 in [{lo}, {hi}]")


def check_paged_cache(q, k_pages, v_pages, page_table, k_scale=None, v_scale=None) -> None:
    """Checks every paged kernel needs: q [B, ..., HQ, D] against k/v_pages
    [num_pages, HK, P, D] (in q's dtype, or fp8 with their scales: `check_kv_scales`) and
    page_table int32 [B, max_pages]."""
    if k_pages.ndim != 4:
        raise ValueError(f"k_pages.shape={k_pages.shape}: expected "
                         "[num_pages, kv_heads, page_size, head_dim]")
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"v_pages.shape={v_pages.shape}: expected k_pages.shape={k_pages.shape}")
    batch, q_heads, head_dim = q.shape[0], q.shape[-2], q.shape[-1]
    _, num_kv_heads, _, k_dim = k_pages.shape
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q.dtype={q.dtype}: expected a floating dtype")
    if not check_kv_scales(k_pages, v_pages, k_scale, v_scale):
        for name, x in (("k_pages", k_pages), ("v_pages", v_pages)):
            if x.dtype != q.dtype:
                raise ValueError(f"{name}.dtype={x.dtype}: expected q.dtype={q.dtype} (or "
                                 f"{FP8} with k_scale and v_scale)")
    if k_dim != head_dim:
        raise ValueError(f"k_pages head_dim={k_dim}: expected q's head_dim={head_dim}")
    if q_heads % num_kv_heads:
        raise ValueError(f"q_heads={q_heads}: expected a multiple of kv_heads={num_kv_heads}")
    if page_table.ndim != 2 or page_table.shape[0] != batch or page_table.dtype != jnp.int32:
        raise ValueError(f"page_table {page_table.dtype}{list(page_table.shape)}: expected "
                         f"int32[{batch}, max_pages]")


def check_kv_scales(k_pages, v_pages, k_scale, v_scale) -> bool:
    """Whether the cache is fp8: k/v_pages in float8_e4m3fn with k_scale and v_scale, float32
    of the pages' shape without head_dim (one scale per (page, KV head, slot)). A ValueError
    for fp8 pages without scales, scales without fp8 pages, one scale without the other, or
    a scale of another shape or dtype."""
    if (k_scale is None) != (v_scale is None):
        given, missing = ("k_scale", "v_scale") if v_scale is None else ("v_scale", "k_scale")
        raise ValueError(f"{given}=given with {missing}=None: expected both (an fp8 cache) or "
                         "neither")
    for name, pages, scale_name, scale in (("k_pages", k_pages, "k_scale", k_scale),
                                           ("v_pages", v_pages, "v_scale", v_scale)):
        expected = f"float32{list(pages.shape[:-1])} ({name}.shape without head_dim)"
        if scale is None:
            if pages.dtype == FP8:
                raise ValueError(f"{name}.dtype={pages.dtype}: expected {scale_name} "
                                 f"{expected} with an fp8 cache, got {scale_name}=None")
            continue
        if pages.dtype != FP8:
            raise ValueError(f"{scale_name}=given with {name}.dtype={pages.dtype}: expected "
                             f"{name} in {FP8} (scales go with an fp8 cache) or "
                             f"{scale_name}=None")
        if tuple(scale.shape) != tuple(pages.shape[:-1]) or scale.dtype != jnp.float32:
            raise ValueError(f"{scale_name}={scale.dtype}{list(scale.shape)}: expected "
                             f"{expected}")
    return k_scale is not None


FP8_MAX = 448.0   # float8_e4m3fn's largest finite value


def quantize(x):
    """x [..., D] -> (x_fp8 [..., D] float8_e4m3fn, scale [...] f32): scale = absmax over the
    last axis / 448 (at least the smallest normal f32, so an all-zero vector stays zero),
    x_fp8 = x / scale rounded to nearest even. The one formula of the fp8 cache's writes, in
    the cache-write kernel and in jnp alike; `dequantize` inverts it to e4m3's precision."""
    xf = x.astype(jnp.float32)
    scale = jnp.maximum(jnp.max(jnp.abs(xf), axis=-1) / FP8_MAX, jnp.finfo(jnp.float32).tiny)
    return (xf / scale[..., None]).astype(FP8), scale


def dequantize(x, scale, dtype=jnp.float32):
    """fp8 values x [..., D] and their scales [...] -> x * scale, f32 math, as `dtype`. The one
    formula of the fp8 cache: the references apply it to the pages they gather, the kernels
    past their dots (`fold_scales`)."""
    return (x.astype(jnp.float32) * scale.astype(jnp.float32)[..., None]).astype(dtype)


def gather_pages(pages, scale, index):
    """pages[index] (the references' gather of [num_pages, HK, P, D] pages); an fp8 cache's
    dequantized to float32 with scale[index], its scales: only the gathered pages are
    dequantized (the decode step hands every layer's cache at once)."""
    if scale is None:
        return pages[index]
    return dequantize(pages[index], scale[index])


def scale_rows(scale):
    """Scales [num_pages, HK, P] -> [num_pages * HK * P] (a free reshape): indexed by the same
    `cache_row` as the pages viewed as rows; None stays None."""
    return None if scale is None else scale.reshape(-1)


def load_fp8(ref, scale_ref, rows, cols, row_mask, dtype):
    """Inside a kernel: rows `rows` [n] x columns `cols` [1, D] of an fp8 cache `ref` viewed
    as [num_pages * HK * P, D] and their scales from `scale_ref` [num_pages * HK * P] ->
    (x [n, D] in `dtype`, scale [n] f32). x is the stored values, unscaled: e4m3 converts
    exactly to bf16, f16 and f32, so the dots (in q's dtype, `dtype`) take them unrounded;
    `fold_scales` applies the scales after. row_mask [n] (None: every row) reads nothing
    where False; those rows are 0 with scale 0."""
    # A float fill: Pallas-Triton has no integer -> fp8 cast.
    x, scale = _load_rows(ref.at[rows[:, None], cols], scale_ref, rows, cols.shape[-1],
                          row_mask, fill=0.0)
    return x.astype(dtype), scale


def _load_rows(at, scale_ref, rows, width: int, row_mask, fill):
    """The [n, width] tile `at` of rows `rows` [n] and those rows' scales; row_mask [n] (None:
    every row) reads nothing where False: `fill` there, scale 0."""
    if row_mask is None:
        return plgpu.load(at), plgpu.load(scale_ref.at[rows])
    return (plgpu.load(at, mask=jnp.broadcast_to(row_mask[:, None], (rows.shape[0], width)),
                       other=fill),
            plgpu.load(scale_ref.at[rows], mask=row_mask, other=0.0))


def value_pairs(v_rows):
    """An fp8 V cache viewed as rows [R, D] -> [R, D / 2] uint16, columns 2i and 2i + 1 of a
    row as one little-endian word (a free bitcast), which the kernels read through
    `load_fp8_pairs`. Why: P.V contracts over keys, so the MMA wants a V tile's consecutive
    keys in a register; a 16-bit tile gets them from one transposing ldmatrix, an 8-bit one
    has no such instruction and Triton reads it from shared memory a byte at a time (a
    fifth of the fp8 decode kernel's instructions; docs/tuning.md)."""
    rows, head_dim = v_rows.shape
    return lax.bitcast_convert_type(v_rows.reshape(rows, head_dim // 2, 2), jnp.uint16)


def load_fp8_pairs(ref, scale_ref, rows, row_mask, dtype):
    """`load_fp8` of a V tile from `value_pairs`' view `ref` [R, D / 2] -> ((even, odd)
    [n, D / 2] in `dtype`: columns 0, 2, .. and 1, 3, .. of the stored rows, unscaled; scale
    [n] f32). The online softmax takes the pair as its V tile (two dots of N = D / 2) and
    keeps an accumulator for each (`zero_values`); `column_parts` says where each lands."""
    width = ref.shape[-1]
    words, scale = _load_rows(ref.at[rows[:, None], jnp.arange(width)[None, :]], scale_ref,
                              rows, width, row_mask, fill=0)

    def as_values(byte):  # e4m3 bits in the low byte -> dtype, exact
        return lax.bitcast_convert_type(byte.astype(jnp.uint8), FP8).astype(dtype)

    return (as_values(words & 0xFF), as_values(words >> 8)), scale


def zero_values(rows: int, head_dim: int, pairs: bool):
    """The online softmax's value accumulator at the start: [rows, D] f32 zeros, or with
    `load_fp8_pairs`' V tiles (`pairs`) one [rows, D / 2] for the even and one for the odd
    columns."""
    if pairs:
        return (jnp.zeros((rows, head_dim // 2), jnp.float32),) * 2
    return jnp.zeros((rows, head_dim), jnp.float32)


def column_parts(out):
    """An online softmax's result [rows, D], or the (even, odd) halves an fp8 V tile's pair
    (`load_fp8_pairs`) gives -> [(tile, its columns [1, n])], for the kernels' stores."""
    if not isinstance(out, tuple):
        return [(out, jnp.arange(out.shape[1])[None, :])]
    even = 2 * jnp.arange(out[0].shape[1])[None, :]
    return [(out[0], even), (out[1], even + 1)]


def fold_scales(x, scale, axis: int):
    """`dequantize` moved past a dot: x [a, b], f32, made from fp8 rows (`load_fp8`) along
    `axis` -- the logits q.k of the K rows -- times each row's scale [n] -> f32.
    q.(k * s) = (q.k) * s, so the scale costs a multiply per logit, not one per element of
    the [n, D] tile. scale None (a cache stored in q's dtype): x as it is."""
    if scale is None:
        return x
    return x * (scale[None, :] if axis == 1 else scale[:, None])


# The smallest power of 2 `online_softmax_step` biases the weights by, 2**-40: a V row scaled
# below it holds values under 448 * 2**-40 (~4e-10); its weight is then overstated by at most
# that much, its share of the probability mass never.
MIN_V_SCALE_EXPONENT = -40


def _power_of_2_below(scale):
    """scale [n] f32 (>= 0, finite) -> (e, 2**-e) as f32, e = floor(log2 scale) at least
    MIN_V_SCALE_EXPONENT, from the float's exponent bits: integer ops only, no MUFU work."""
    biased = jnp.maximum(lax.shift_right_logical(lax.bitcast_convert_type(scale, jnp.int32), 23),
                         127 + MIN_V_SCALE_EXPONENT)
    # an integer below 2**23 in a float's mantissa at exponent 23 is that integer plus 2**23
    e = lax.bitcast_convert_type(biased | 0x4B000000, jnp.float32) - float(2**23 + 127)
    return e, lax.bitcast_convert_type((254 - biased) << 23, jnp.float32)


def online_softmax_step(s, v, v_scale, acc, m, l, dot, *, base2: bool, empty_rows: bool):
    """One key block of an online softmax: logits s [rows, n] f32 (-inf where masked; base 2
    if `base2`, else base e) and the V tile v [n, D] in the dots' dtype (None: the scores
    alone, acc stays None; a tuple of column parts from `load_fp8_pairs`, acc a tuple too)
    folded into the running (acc [rows, D] f32, max m [rows], sum l [rows]); `dot(a, b)` is
    a @ b with f32 results. `empty_rows`: a row may see no key in the block (all -inf), and
    its alpha and weights must stay 0, not NaN.

    An fp8 V tile comes with its rows' scales v_scale [n] (`load_fp8`): the power of 2 below
    each scale, 2**e, enters as a logit bias, w = exp(s + e log 2 - m), the dot takes
    w * scale / 2**e (at most 2) and l adds w / 2**e. Then acc = sum w (scale / 2**e) v8 and
    l = sum exp(s - m) describe the dequantized cache's softmax exactly as without scales
    (out = acc / l, lse = m + log l), and the weights the V dot takes, in v's dtype, are at
    most 2 whatever the scales: float16 holds them without a per-block rescale (small V rows
    would otherwise leave p * scale subnormal). m is then the running max of the biased
    logits. Powers of 2 keep the bias exact and cost integer ops, where log / exp of each
    scale would load the special-function units that the softmax's exp already does."""
    exp = jnp.exp2 if base2 else jnp.exp
    if v_scale is not None:
        e, inv_pow2 = _power_of_2_below(v_scale)
        s = s + (e if base2 else e * LN2)[None, :]
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_shift = jnp.where(m_new == -jnp.inf, 0.0, m_new) if empty_rows else m_new
    alpha = exp(m - m_shift)
    w = exp(s - m_shift[:, None])
    l = alpha * l + jnp.sum(w if v_scale is None else w * inv_pow2[None, :], axis=1)
    if v_scale is not None:
        w = w * (v_scale * inv_pow2)[None, :]
    if v is not None:
        acc = accumulate_values(acc, alpha, w, v, dot)
    return acc, m_new, l


def accumulate_values(acc, alpha, w, v, dot):
    """acc * alpha + w @ v, the online softmax's value update (weights w [rows, n] f32 cast to
    v's dtype for the dot); for `load_fp8_pairs`' (even, odd) V tile, acc is a pair too and
    each part takes its own dot."""
    if isinstance(v, tuple):
        w = w.astype(v[0].dtype)
        return tuple(a * alpha[:, None] + dot(w, part) for a, part in zip(acc, v))
    return acc * alpha[:, None] + dot(w.astype(v.dtype), v)


def softmax_result(acc, m, l, nonempty=None):
    """An online softmax's running state in base 2 (`online_softmax_step(base2=True)`: acc
    [rows, D] or None, max m, sum l [rows]) -> (out = acc / l, natural-log LSE). Rows not
    `nonempty` (default: l > 0) divide by 1 and get LSE -inf, the convention of
    `merge_partials` for an empty partial."""
    nonempty = l > 0 if nonempty is None else nonempty
    l_safe = jnp.where(nonempty, l, 1.0)
    if isinstance(acc, tuple):
        out = tuple(a / l_safe[:, None] for a in acc)
    else:
        out = None if acc is None else acc / l_safe[:, None]
    return out, jnp.where(nonempty, m * LN2 + jnp.log(l_safe), -jnp.inf)


def replicate_kv_heads(x, heads: int, axis: int):
    """Each of x's KV heads (on `axis`) repeated in place up to `heads` in all: the layout of a
    cache whose KV heads are replicated over tensor-parallel ranks."""
    copies = heads // x.shape[axis]
    return x if copies == 1 else jnp.repeat(x, copies, axis=axis)


def cache_row(page, head, pos, *, kv_heads: int, page_size: int):
    """Row of the cache viewed as [num_pages * HK * P, D] (a free reshape of its pages) that
    holds non-negative position `pos` of KV head `head` on page `page` (page_size a power of
    2). Works in kernels and in jnp alike."""
    return (page * kv_heads + head) * page_size + (pos & (page_size - 1))


LN2 = math.log(2.0)
LOG2E = math.log2(math.e)  # online softmaxes run in base 2: exp2 is one MUFU op, exp is not


def merge_partials(out: jax.Array, lse: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
    """Combine attention partials computed over disjoint key sets.

    out   [..., S, ..., D]  each partial's normalised output (fp32), S on `axis`
    lse   [..., S, ...]     each partial's log-sum-exp (natural log); -inf for an empty partial
    Returns (out [..., D] fp32, lse [...]) over the union, with the S axis reduced.
    An all-empty union gives out = 0 and lse = -inf.
    """
    w, total, lse_all = _lse_weights(lse, axis)
    w = w / jnp.where(total > 0, total, 1.0)
    merged = jnp.sum(out.astype(jnp.float32) * jnp.expand_dims(w, -1), axis=axis)
    return merged, lse_all


def _merge_splits_kernel(out_ref,      # [A, S, C, D] f32: each split's normalised output
                         lse_ref,      # [A, S, C] f32: -inf for an empty split
                         merged_ref,   # [A, C, D] out_dtype
                         merged_lse_ref,  # [A, C] f32
                         *, chunk: int, cols: int):
    a, c, part = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_splits = out_ref.shape[1]
    splits = jnp.arange(next_power_of_2(num_splits))
    lse = plgpu.load(lse_ref.at[a, splits, c], mask=splits < num_splits, other=-jnp.inf)
    m = jnp.max(lse)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    total = jnp.sum(jnp.exp(lse - m_safe))  # empty splits and the padding add 0
    norm = jnp.where(total > 0, total, 1.0)
    chunk = min(chunk, splits.shape[0])
    at_cols = part * cols + jnp.arange(cols)

    def body(i, acc):
        rows = i * chunk + jnp.arange(chunk)
        live = rows < num_splits
        w = jnp.exp(plgpu.load(lse_ref.at[a, rows, c], mask=live, other=-jnp.inf) - m_safe) / norm
        # An empty split's output may be unwritten: never read, weight 0.
        x = plgpu.load(out_ref.at[a, rows[:, None], c, at_cols[None, :]],
                       mask=(live & (w > 0))[:, None], other=0.0)
        return acc + jnp.sum(x * w[:, None], axis=0)

    acc = lax.fori_loop(0, cdiv(num_splits, chunk), body, jnp.zeros((cols,), jnp.float32))
    plgpu.store(merged_ref.at[a, c, at_cols], acc.astype(merged_ref.dtype))
    # every column block computes the same LSE; the first stores it
    plgpu.store(merged_lse_ref.at[a, c], jnp.where(total > 0, m_safe + jnp.log(norm), -jnp.inf),
                mask=part == 0)


def merge_tuning(outer: int, splits: int, rows: int, head_dim: int) -> dict:
    """merge_splits' default knobs. One program per (a, c) and block of `cols` columns of D:
    where the (a, c) pairs fill less than a wave (batch 1: a layer's query heads), D is cut
    into as many blocks as make a wave (at least 16 columns each), so each program reads
    fewer partials from L2 one after the other (DS-Qwen-1.5B at B=1: 12 programs, each
    walking 264 splits, took 6 us a layer). `chunk` partials a load: 32 at 1 warp, 64 at 2
    warps from 128 padded splits, and with a column block more rows at once (~4k values a
    load). The sweeps are in docs/tuning.md."""
    pairs = outer * rows
    blocks = min(next_power_of_2(cdiv(num_sms(), pairs)), max(1, head_dim // 16))
    cols = head_dim // blocks
    wide = next_power_of_2(splits) >= 128
    chunk = 64 if wide else 32
    if blocks > 1:
        chunk = max(chunk, 4096 // cols)
    return dict(cols=cols, chunk=min(chunk, next_power_of_2(splits)),
                num_warps=2 if wide or blocks > 1 else 1)


def merge_splits(out: jax.Array, lse: jax.Array, *, out_dtype, interpret: bool,
                 chunk: int | None = None, num_warps: int | None = None,
                 cols: int | None = None):
    """`merge_partials` of a split-K kernel's partials as one Pallas kernel (XLA makes that
    four launches: two reductions over the LSEs, the weights, the weighted sum), on the
    kernel's own layout. out [A, S, C, D] f32, lse [A, S, C] (S the splits; -inf marks an
    empty split, whose out is never read) -> (out [A, C, D] out_dtype, lse [A, C] f32).

    One program per (a, c) and block of `cols` columns, loading `chunk` partials at a time;
    None takes `merge_tuning`'s."""
    outer, splits, rows, head_dim = out.shape
    tuning = resolve_tuning(merge_tuning(outer, splits, rows, head_dim), chunk=chunk,
                            num_warps=num_warps, cols=cols)
    cols = tuning["cols"]
    if head_dim % cols or cols & (cols - 1):
        raise ValueError(f"cols={cols}: expected a power of 2 dividing head_dim={head_dim}")
    return pallas_call(
        functools.partial(_merge_splits_kernel, chunk=tuning["chunk"], cols=cols),
        grid=(outer, rows, head_dim // cols),
        out_shape=(jax.ShapeDtypeStruct((outer, rows, head_dim), out_dtype),
                   jax.ShapeDtypeStruct((outer, rows), jnp.float32)),
        compiler_params=triton_params(tuning["num_warps"], 1),
        interpret=interpret,
        name="merge_splits",
    )(out, lse)


def merge_lse(lse: jax.Array, axis: int) -> jax.Array:
    """The LSE of `merge_partials` alone (partials without outputs)."""
    return _lse_weights(lse, axis)[2]


def _lse_weights(lse, axis):
    """(exp(lse - max) per partial, their sum, the merged lse; -inf where all are empty)."""
    lse = lse.astype(jnp.float32)
    m = jnp.max(lse, axis=axis, keepdims=True)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lse - m_safe)  # 0 for empty partials
    total = jnp.sum(w, axis=axis, keepdims=True)
    return w, total, jnp.squeeze(jnp.where(total > 0, m_safe + jnp.log(total), -jnp.inf), axis)


class Score(enum.StrEnum):
    """What a selecting layer ranks positions by. The dense kernel computes the first four
    (`paged_decode_attention(score=...)`); members equal their strings, so either is taken."""
    MAX_HEADS = "max_heads"            # DELTA: max over all query heads of the probabilities
    GROUP_SUM = "group_sum"            # Kascade: probabilities summed over each GQA group
    MEAN_QUERY = "mean_query"          # LycheeDecode: logits of each group's mean query
    HEAD_PROBS = "head_probs"          # TidalDecode, oracle top-k: per query head
    ALL_HEADS_SUM = "all_heads_sum"    # Kascade pooled: GROUP_SUM summed over the KV heads
    QUEST_BOUND = "quest_bound"        # Quest: per-page upper bound of the logits
    NONE = "none"                      # StreamingLLM: only the forced sinks and recent window

    @property
    def is_logit(self) -> bool:
        """Logits (pooled over a unit by max) rather than probabilities (pooled by sum)."""
        return self in (Score.MEAN_QUERY, Score.QUEST_BOUND)


def check_choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r}: expected one of {tuple(allowed)}")


def group_of_head(groups: int, num_heads: int, num_kv_heads: int, head_map=None):
    """Selection group each query head reads -> [HQ] int32. groups = 1 (shared), HK (per KV
    head, through `head_map` [HK] when given) or HQ (per query head)."""
    if groups == 1:
        return jnp.zeros((num_heads,), jnp.int32)
    if groups == num_heads and groups != num_kv_heads:
        return jnp.arange(num_heads, dtype=jnp.int32)
    kv_of_head = jnp.arange(num_heads, dtype=jnp.int32) // (num_heads // num_kv_heads)
    if head_map is None:
        return kv_of_head
    return jnp.clip(head_map, 0, num_kv_heads - 1).astype(jnp.int32)[kv_of_head]
