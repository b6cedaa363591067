"""The paged KV cache: pure functions from cache to cache.

k, v [layers, num_pages, kv_heads, page_size, head_dim] keep one (page, head) tile contiguous.
An fp8 cache (`kv_dtype="fp8"`) stores them as float8_e4m3fn with one f32 scale per (token,
KV head) in k_scale, v_scale [layers, num_pages, kv_heads, page_size] (`quantize_kv`): a page
fills one token at a time during decode, so a per-page scale would force requantizing its
earlier tokens whenever its absolute max grew.
Token t of row b lives in page `page_table[b, t // page_size]`, slot `t % page_size`;
`token_address` is the one place that computes this, and `layer_page_ids` the one place that
offsets a page to its layer in the flattened cache.
"""
from __future__ import annotations

import math
import os
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp

from sparsejax.models import Model, ModelConfig
from sparsejax.pallas_kernels.cache_write import write_tokens
from sparsejax.pallas_kernels.common import (WIDE_OFFSETS_PAST, dequantize, quantize,
                                            replicate_kv_heads, wraps_offsets)

MAX_PAGE_SIZE = 256

FP8 = jnp.dtype(jnp.float8_e4m3fn)
# kv_dtype's accepted names -> the stored dtype (None: the model's dtype)
KV_DTYPES = {"auto": None, "bf16": jnp.dtype(jnp.bfloat16), "bfloat16": jnp.dtype(jnp.bfloat16),
             "f32": jnp.dtype(jnp.float32), "float32": jnp.dtype(jnp.float32),
             "fp8": FP8, "float8_e4m3fn": FP8}


def resolve_kv_dtype(kv_dtype, dtype) -> jnp.dtype:
    """The dtype a cache stores K/V in: `kv_dtype` None or "auto" -> `dtype` (the model's);
    "bf16"/"bfloat16", "f32"/"float32", "fp8"/"float8_e4m3fn" (also as the dtypes themselves)
    -> that dtype. Anything else is refused, naming the accepted values."""
    if kv_dtype is None:
        return jnp.dtype(dtype)
    name = kv_dtype if isinstance(kv_dtype, str) else None
    if name is None:
        try:
            given = jnp.dtype(kv_dtype)
        except TypeError:
            given = None
        if given is not None and given == jnp.dtype(dtype):   # the model's own (e.g. float16)
            return given
        name = None if given is None else given.name
    if name not in KV_DTYPES:
        raise ValueError(f"kv_dtype={kv_dtype!r}: expected None or one of "
                         f"{', '.join(map(repr, KV_DTYPES))}")
    return jnp.dtype(dtype) if KV_DTYPES[name] is None else KV_DTYPES[name]


def is_fp8(dtype) -> bool:
    return jnp.dtype(dtype) == FP8


def quantize_kv(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., D] -> (x_fp8 [..., D] float8_e4m3fn, scale [...] f32): scale = absmax over the
    last axis / 448, x_fp8 = x / scale rounded to nearest even (`common.quantize`).
    `dequantize_kv` inverts it to e4m3's precision."""
    return quantize(x)


def dequantize_kv(x_fp8: jax.Array, scale: jax.Array) -> jax.Array:
    """float8_e4m3fn values [..., D] and their scales [...] -> f32 [..., D]: the kernels' own
    formula (`pallas_kernels.common.dequantize`)."""
    return dequantize(x_fp8, scale)


def query_dtype(stored, model_dtype) -> jnp.dtype:
    """The query dtype the kernels read a cache of `stored` dtype with: the cache's own, except
    for fp8, which takes the model's, and float16 for a bfloat16 model: e4m3 converts to
    float16 exactly in one instruction a pair on sm_90 but to bfloat16 through f32, which made
    the dense decode kernel 1.34x slower at B=64 x 32k on an H100 (decode_knobs_h100.json), and
    float16 holds q with 3 more mantissa bits (queries past float16's 65504 would not fit; a
    model's projected queries are orders of magnitude below it)."""
    if not is_fp8(stored):
        return jnp.dtype(stored)
    model_dtype = jnp.dtype(model_dtype)
    return jnp.dtype(jnp.float16) if model_dtype == jnp.bfloat16 else model_dtype


def as_stored(x: jax.Array, kv_dtype) -> jax.Array:
    """x [..., D] as a cache of `kv_dtype` gives it back: quantized and dequantized (f32) for
    fp8, else rounded to `kv_dtype`'s precision (in x's dtype). What Quest's page bounds and
    RESA's prior are computed from, so that they describe the cached keys and values."""
    if not is_fp8(kv_dtype):
        return rounded_to(x, kv_dtype)
    # the barrier keeps the f32 -> fp8 -> f32 converts: XLA on the GPU removes such a pair
    # (excess precision), which gave back x unquantized
    return dequantize_kv(*jax.lax.optimization_barrier(quantize_kv(x)))


def rounded_to(x: jax.Array, dtype) -> jax.Array:
    """x's values rounded to nearest in `dtype`'s precision, kept in x's dtype (x itself where
    `dtype` is no narrower). `reduce_precision`, not a cast there and back: XLA on the GPU
    removes such a pair of converts (excess precision) and the values would stay unrounded."""
    info, mine = jnp.finfo(dtype), jnp.finfo(x.dtype)
    if info.nmant >= mine.nmant and info.nexp >= mine.nexp:
        return x
    return jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)


@flax.struct.dataclass
class MethodState:
    """Per-layer state that methods keep in the cache: computed at prefill, updated every step.
    A field is None when the plan needs none of it."""
    prior: Any = None                # resa.Prior, every field stacked [layers, ...] (RESA)
    kmin: jax.Array | None = None    # [layers, num_pages, kv_heads, head_dim]: each physical page's
    kmax: jax.Array | None = None    # element-wise key bounds (Quest; +-inf when empty) in the
    #                                  cache's dtype, bf16 for fp8 (method_state.bound_dtype)


@flax.struct.dataclass
class PagedKVCache:
    k: jax.Array            # [layers, num_pages, kv_heads, page_size, head_dim]
    v: jax.Array            # [layers, num_pages, kv_heads, page_size, head_dim]
    page_table: jax.Array   # [batch, max_pages] int32
    lengths: jax.Array      # [batch] int32 tokens written per row
    state: MethodState | None = None
    k_scale: jax.Array | None = None   # [layers, num_pages, kv_heads, page_size] f32 (fp8 only)
    v_scale: jax.Array | None = None

    @property
    def page_size(self) -> int:
        return self.k.shape[3]

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    @property
    def capacity(self) -> int:
        """Tokens each row can hold."""
        return self.page_table.shape[1] * self.page_size


class KVPages(NamedTuple):
    """A cache's K/V flattened over layers (`layer_pages`), as the kernels read them in place:
    k, v [L * num_pages, HK, P, D] and, for fp8, their scales [L * num_pages, HK, P]."""
    k: jax.Array
    v: jax.Array
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None

    def scales(self) -> dict:
        """The kernels' scale arguments: none for a bf16 / f32 cache."""
        return {} if self.k_scale is None else dict(k_scale=self.k_scale, v_scale=self.v_scale)


def flat_pages(cache: PagedKVCache) -> KVPages:
    """The cache's K/V (and scales) flattened over layers: free reshapes."""
    scales = (None, None) if cache.k_scale is None else (layer_pages(cache.k_scale),
                                                         layer_pages(cache.v_scale))
    return KVPages(layer_pages(cache.k), layer_pages(cache.v), *scales)


def with_pages(cache: PagedKVCache, pages: KVPages) -> PagedKVCache:
    """`cache` holding the flattened `pages` (back in the [layers, num_pages, ...] shape)."""
    unflat = lambda x, like: None if x is None else x.reshape(like.shape)  # noqa: E731
    return cache.replace(k=unflat(pages.k, cache.k), v=unflat(pages.v, cache.v),
                         k_scale=unflat(pages.k_scale, cache.k_scale),
                         v_scale=unflat(pages.v_scale, cache.v_scale))


def dequantized_pages(pages: jax.Array, scale: jax.Array | None) -> jax.Array:
    """Gathered cache pages [..., P, D] as f32 values: dequantized when `scale` [..., P] is
    given (fp8), else converted."""
    return pages.astype(jnp.float32) if scale is None else dequantize_kv(pages, scale)


def check_page_size(page_size) -> None:
    if (not isinstance(page_size, int) or page_size < 1 or page_size > MAX_PAGE_SIZE
            or page_size & (page_size - 1)):
        raise ValueError(f"page_size={page_size!r}: expected a power of two from 1 to "
                         f"{MAX_PAGE_SIZE}")


def config_and_dtype(config_or_model, dtype=None):
    """(ModelConfig, cache dtype) of `allocate`'s first argument: a Model's config and, unless
    `dtype` is given, its dtype; a ModelConfig and `dtype`, else bfloat16."""
    if isinstance(config_or_model, Model):
        return config_or_model.config, config_or_model.dtype if dtype is None else dtype
    if not isinstance(config_or_model, ModelConfig):
        raise ValueError(f"allocate got {type(config_or_model).__name__}: expected a Model "
                         "(its config and dtype) or a ModelConfig")
    return config_or_model, jnp.bfloat16 if dtype is None else dtype


def allocate(config_or_model: ModelConfig | Model, batch: int, capacity: int, *,
             page_size: int = 16, dtype=None, kv_copies: int = 1,
             check_memory: bool = True, kv_dtype=None, head_shards: int = 1,
             page_shards: int = 1) -> PagedKVCache:
    """An empty cache for `batch` rows of up to `capacity` tokens each, on the default device
    (`sparsejax.allocate` lays it out on a mesh). `config_or_model`: a Model (the cache takes
    its dtype unless `dtype` is given) or a ModelConfig (dtype default bfloat16). `kv_dtype`
    (`resolve_kv_dtype`): what K/V are stored as, default that dtype; "fp8" stores
    float8_e4m3fn with per-(token, KV head) scales.

    Row b owns pages [b * max_pages, (b + 1) * max_pages); any permutation of page ids is
    equally valid — the kernels only go through `page_table` (with a "data" mesh axis, within
    each data shard's rows). `kv_copies`: each KV head stored that many times in a row (what a
    mesh with more model ranks than KV heads needs; a mesh sets it). An fp8 pool whose bytes
    per device would be 2-4 GiB gets spare pages that no row owns (`pool_pages`);
    `head_shards` and `page_shards` (a mesh sets them) say how its heads and pages split
    over the devices.

    Before allocating, refuses (ValueError naming the largest batch that fits) a cache that,
    with the temporaries of filling it and stepping over it (XLA's memory analysis of the
    compiled prefill and donated decode step), does not fit in the devices' free memory
    (`check_memory`).
    """
    config, dtype = config_and_dtype(config_or_model, dtype)
    stored = resolve_kv_dtype(kv_dtype, dtype)
    check_page_size(page_size)
    if capacity < 1:
        raise ValueError(f"capacity={capacity}: expected at least 1 token per row")
    max_pages = -(-capacity // page_size)
    num_pages = pool_pages(config, batch, max_pages, page_size, stored, kv_copies,
                           head_shards=head_shards, page_shards=page_shards)
    shape = (config.num_layers, num_pages, config.num_kv_heads * kv_copies, page_size,
             config.head_dim)
    if check_memory:
        check_fits(config, batch, capacity, page_size=page_size, dtype=dtype,
                   kv_copies=kv_copies, kv_dtype=stored)
    page_table = jnp.arange(batch * max_pages, dtype=jnp.int32).reshape(batch, max_pages)
    spare = (num_pages - batch * max_pages) // page_shards
    if spare:   # each page shard's spare pages follow its rows' pages
        rows = jnp.arange(batch, dtype=jnp.int32) // (batch // page_shards)
        page_table = page_table + (rows * spare)[:, None]
    scales = {}
    if is_fp8(stored):
        scales = dict(k_scale=jnp.ones(shape[:-1], jnp.float32),
                      v_scale=jnp.ones(shape[:-1], jnp.float32))
    return PagedKVCache(k=jnp.zeros(shape, stored), v=jnp.zeros(shape, stored),
                        page_table=page_table, lengths=jnp.zeros((batch,), jnp.int32), **scales)


def pool_pages(config: ModelConfig, batch: int, max_pages: int, page_size: int, stored,
               kv_copies: int = 1, *, head_shards: int = 1, page_shards: int = 1) -> int:
    """Pages in the K (and V) pool of `batch` rows of `max_pages`: batch * max_pages, and for
    a 1-byte (fp8) pool whose share on each device (every layer; heads split `head_shards`
    ways, pages `page_shards` ways) would hold 2-4 GiB, where the kernels' 32-bit offsets
    wrap (`common.wraps_offsets`), spare pages to just past 4 GiB, as many on each page
    shard. The alternative, reading that pool through the references, is far slower."""
    pages, itemsize = batch * max_pages, jnp.dtype(stored).itemsize
    page_bytes = (config.num_layers * config.num_kv_heads * kv_copies // head_shards * page_size
                  * config.head_dim * itemsize)
    local = pages // page_shards
    if not wraps_offsets(local * page_bytes, itemsize):
        return pages
    return pages + page_shards * (WIDE_OFFSETS_PAST // page_bytes + 1 - local)


def kv_bytes(config: ModelConfig, batch: int, capacity: int, *, page_size: int = 16,
             dtype=jnp.bfloat16, kv_copies: int = 1, kv_dtype=None) -> int:
    """Bytes of K and V (and an fp8 cache's f32 scales) that `allocate` makes for these
    arguments without a mesh."""
    stored = resolve_kv_dtype(kv_dtype, dtype)
    pages = pool_pages(config, batch, -(-capacity // page_size), page_size, stored, kv_copies)
    per_token = config.head_dim * stored.itemsize + (4 if is_fp8(stored) else 0)
    return (2 * config.num_layers * pages * config.num_kv_heads * kv_copies * page_size
            * per_token)


def cache_bytes(cache: PagedKVCache) -> int:
    """Bytes of a cache's K and V and their scales (concrete or traced)."""
    def size(x):
        return 0 if x is None else math.prod(x.shape) * jnp.dtype(x.dtype).itemsize

    return sum(size(x) for x in (cache.k, cache.v, cache.k_scale, cache.v_scale))


# The bytes a donated decode step needs beside its arguments, at a cache's shapes:
# (config, batch, capacity, page_size, dtype, kv_copies, kv_dtype) -> bytes. `sparsejax.generate`
# registers the compiled step's memory analysis here (it imports this module, not the
# other way round); without it only the cache itself is counted.
_step_temporaries = None


def register_step_temporaries(fn) -> None:
    global _step_temporaries
    _step_temporaries = fn


def step_temporaries(config, batch, capacity, *, page_size=16, dtype=jnp.bfloat16,
                     kv_copies=1, kv_dtype=None) -> int:
    if _step_temporaries is None:
        return 0
    return _step_temporaries(config, batch, capacity, page_size, jnp.dtype(dtype), kv_copies,
                             resolve_kv_dtype(kv_dtype, dtype))


# A cache this much smaller than the free memory fits beside any decode step's temporaries
# (they are a fraction of the cache): no step is compiled to say so.
_ROOM_TO_SPARE = 4


def largest_fitting(need_at, free: int, guess: int, limit: int | None = None,
                    evaluations: int = 6) -> int:
    """The largest batch b >= 0 with need_at(b) <= free, for need_at increasing and close to
    linear in b (bytes), found by secant steps from `guess` (at most `evaluations` calls;
    with fewer, the largest that fitted among those tried)."""
    fit, fail, points = 0, limit + 1 if limit is not None else None, []
    b = max(1, guess if fail is None else min(guess, fail - 1))
    for _ in range(evaluations):
        need = need_at(b)
        points.append((b, need))
        if need <= free:
            fit = max(fit, b)
        else:
            fail = b if fail is None else min(fail, b)
        if fail is not None and fail <= fit + 1:
            break
        if len(points) > 1 and points[-1][0] != points[-2][0]:
            (b0, n0), (b1, n1) = points[-2], points[-1]
            slope = max((n1 - n0) / (b1 - b0), 1.0)
        else:
            slope = max(need / b, 1.0)
        nxt = int(b + (free - need) // slope)
        nxt = max(nxt, fit + 1)
        if fail is not None:
            nxt = min(nxt, fail - 1)
        if nxt == b or nxt < 1:
            break
        b = nxt
    return fit


def check_fits(config: ModelConfig, batch: int, capacity: int, *, page_size: int = 16,
               dtype=jnp.bfloat16, kv_copies: int = 1, free: int | None = None,
               kv_dtype=None) -> None:
    """Refuse (ValueError) a cache of `batch` rows x `capacity` tokens whose bytes, with a
    decode step's temporaries over it, exceed the devices' free memory; the message names
    the largest batch of this context that fits."""
    free = memory_available() if free is None else free
    kw = dict(page_size=page_size, dtype=dtype, kv_copies=kv_copies,
              kv_dtype=resolve_kv_dtype(kv_dtype, dtype))
    need = kv_bytes(config, batch, capacity, **kw)
    if _ROOM_TO_SPARE * need <= free:
        return
    need_at = lambda b: (kv_bytes(config, b, capacity, **kw)  # noqa: E731
                         + step_temporaries(config, b, capacity, **kw))
    total = need_at(batch)
    if total <= free:
        return
    largest = largest_fitting(need_at, free, batch * free // max(total, 1))
    raise ValueError(
        f"a KV cache of batch={batch} rows x {capacity} tokens needs {need / 2**30:.2f} GiB and "
        f"its prefill and decode step {(total - need) / 2**30:.2f} GiB more; the devices have "
        f"{free / 2**30:.2f} GiB free: at most batch={largest} rows of {capacity} tokens fit "
        "(lower the batch, the prompt length or max_new_tokens"
        + (")" if jax.default_backend() == "cpu" else
           ", or let JAX's allocator take more than its default 75% of each device: "
           "XLA_PYTHON_CLIENT_MEM_FRACTION=0.93 with preallocation on, JAX's default, set "
           "before JAX starts)"))


def memory_available() -> int:
    """Bytes the local devices have free (their allocators' limit less what is in use), or the
    host's physical memory where they report none (CPU)."""
    stats = [d.memory_stats() or {} for d in jax.local_devices()]
    if all("bytes_limit" in s for s in stats):
        return sum(s["bytes_limit"] - s.get("bytes_in_use", 0) for s in stats)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_capacity(cache: PagedKVCache, num_tokens: int, what: str) -> None:
    """Static check, before any compute, that `num_tokens` per row fit in the allocated pages."""
    if num_tokens > cache.capacity:
        raise ValueError(
            f"{what} needs {num_tokens} tokens per row but the cache holds {cache.capacity} "
            f"({cache.page_table.shape[1]} pages of {cache.page_size}); allocate more pages")


def token_address(page_table: jax.Array, positions: jax.Array, page_size: int):
    """Physical (page, slot) of logical `positions` [B, ...] through `page_table` [B, max_pages]."""
    logical_page = positions // page_size
    rows = jnp.arange(page_table.shape[0]).reshape((-1,) + (1,) * (positions.ndim - 1))
    return page_table[rows, logical_page], positions % page_size


def layer_pages(cache_kv: jax.Array) -> jax.Array:
    """[layers, num_pages, ...] -> [layers * num_pages, ...]: a free reshape. Layer l's pages are
    then addressed by `layer_page_ids`, so kernels read the stacked cache in place."""
    return cache_kv.reshape((-1,) + cache_kv.shape[2:])


def layer_page_ids(pages: jax.Array, layer, num_pages: int) -> jax.Array:
    """Physical page ids `pages` (a page table, or one page per row) of layer `layer` (broadcast
    against them) in the flattened cache of `layer_pages`."""
    return pages + layer * num_pages


def write_prompt(cache: PagedKVCache, keys: jax.Array, values: jax.Array,
                 lengths: jax.Array, backend: str = "auto") -> PagedKVCache:
    """Write every layer's prompt keys/values [L, B, T, HK, D] and set `lengths` [B]
    (`backend` as `write_token` takes it)."""
    L, B, T = keys.shape[:3]
    page, slot = token_address(cache.page_table, jnp.broadcast_to(jnp.arange(T), (B, T)),
                               cache.page_size)
    pages = layer_page_ids(page[None], jnp.arange(L)[:, None, None], cache.num_pages)
    stored = write_token(flat_pages(cache), pages, jnp.broadcast_to(slot, pages.shape), keys,
                         values, backend=backend)
    return with_pages(cache, stored).replace(lengths=lengths.astype(jnp.int32))


def write_backend(model: Model) -> str:
    """How a model's steps write the cache: the kernel (on a GPU), or under a mesh XLA's
    scatters, which the partitioner splits over the devices (a Pallas call it cannot)."""
    return "auto" if model.mesh is None else "reference"


def write_token(kv: KVPages, pages: jax.Array, slots: jax.Array, k: jax.Array,
                v: jax.Array, backend: str = "auto") -> KVPages:
    """Write tokens into flattened layer pages (see `flat_pages`), quantized for an fp8 cache.

    pages, slots [B, ...] physical addresses already offset to the layer; k, v [B, ..., HK, D].
    Tokens whose page is out of range (>= the number of pages) are dropped. One Pallas kernel
    on a GPU (`pallas_kernels.write_tokens`), XLA scatters elsewhere; either updates the pools
    in place where the cache is donated or carried (the compiled step's memory analysis: no
    cache-sized temporary; tests/test_memory.py). `backend="reference"` keeps the scatters,
    which XLA partitions over a mesh.
    """
    k, v = (replicate_kv_heads(x, kv.k.shape[1], axis=-2) for x in (k, v))
    return KVPages(*write_tokens(kv.k, kv.v, pages, slots, k, v, k_scale=kv.k_scale,
                                 v_scale=kv.v_scale, backend=backend))