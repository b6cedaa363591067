"""The paged KV cache: pure functions from cache to cache.

k, v [layers, num_pages, kv_heads, page_size, head_dim] keep one (page, head) tile contiguous.
Token t of row b lives in page `page_table[b, t // page_size]`, slot `t % page_size`;
`token_address` is the one place that computes this, and `layer_page_ids` the one place that
offsets a page to its layer in the flattened cache.
"""
from __future__ import annotations

import math
import os
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from sparsejax.models import Model, ModelConfig

MAX_PAGE_SIZE = 256


@flax.struct.dataclass
class MethodState:
    """Per-layer state that methods keep in the cache: computed at prefill, updated every step.
    A field is None when the plan needs none of it."""
    prior: Any = None                # resa.Prior, every field stacked [layers, ...] (RESA)
    kmin: jax.Array | None = None    # [layers, num_pages, kv_heads, head_dim] f32: each physical
    kmax: jax.Array | None = None    # page's element-wise key bounds (Quest); +-inf when empty


@flax.struct.dataclass
class PagedKVCache:
    k: jax.Array            # [layers, num_pages, kv_heads, page_size, head_dim]
    v: jax.Array            # [layers, num_pages, kv_heads, page_size, head_dim]
    page_table: jax.Array   # [batch, max_pages] int32
    lengths: jax.Array      # [batch] int32 tokens written per row
    state: MethodState | None = None

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


def check_page_size(page_size) -> None:
    if (not isinstance(page_size, int) or page_size < 1 or page_size > MAX_PAGE_SIZE
            or page_size & (page_size - 1)):
        raise ValueError(f"page_size={page_size!r}: expected a power of two from 1 to {MAX_PAGE_SIZE}")


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
             check_memory: bool = True) -> PagedKVCache:
    """An empty cache for `batch` rows of up to `capacity` tokens each, on the default device
    (`sparsejax.allocate` lays it out on a mesh). `config_or_model`: a Model (the cache takes
    its dtype unless `dtype` is given) or a ModelConfig (dtype default bfloat16).

    Row b owns pages [b * max_pages, (b + 1) * max_pages); any permutation of page ids is
    equally valid — the kernels only go through `page_table` (with a "data" mesh axis, within
    each data shard's rows). `kv_copies`: each KV head stored that many times in a row (what a
    mesh with more model ranks than KV heads needs; a mesh sets it).

    Before allocating, refuses (ValueError naming the largest batch that fits) a cache that,
    with the temporaries of a decode step over it (XLA's memory analysis of the compiled,
    donated step), does not fit in the devices' free memory (`check_memory`).
    """
    config, dtype = config_and_dtype(config_or_model, dtype)
    check_page_size(page_size)
    if capacity < 1:
        raise ValueError(f"capacity={capacity}: expected at least 1 token per row")
    max_pages = -(-capacity // page_size)
    shape = (config.num_layers, batch * max_pages, config.num_kv_heads * kv_copies, page_size,
             config.head_dim)
    if check_memory:
        check_fits(config, batch, capacity, page_size=page_size, dtype=dtype,
                   kv_copies=kv_copies)
    page_table = jnp.arange(batch * max_pages, dtype=jnp.int32).reshape(batch, max_pages)
    return PagedKVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                        page_table=page_table, lengths=jnp.zeros((batch,), jnp.int32))


def kv_bytes(config: ModelConfig, batch: int, capacity: int, *, page_size: int = 16,
             dtype=jnp.bfloat16, kv_copies: int = 1) -> int:
    """Bytes of K and V that `allocate` makes for these arguments."""
    max_pages = -(-capacity // page_size)
    return (2 * config.num_layers * batch * max_pages * config.num_kv_heads * kv_copies
            * page_size * config.head_dim * jnp.dtype(dtype).itemsize)


def cache_bytes(cache: PagedKVCache) -> int:
    """Bytes of a cache's K and V (concrete or traced)."""
    return 2 * math.prod(cache.k.shape) * jnp.dtype(cache.k.dtype).itemsize


# The bytes a donated decode step needs beside its arguments, at a cache's shapes:
# (config, batch, capacity, page_size, dtype, kv_copies) -> bytes. `sparsejax.generate`
# registers the compiled step's memory analysis here (it imports this module, not the
# other way round); without it only the cache itself is counted.
_step_temporaries = None


def register_step_temporaries(fn) -> None:
    global _step_temporaries
    _step_temporaries = fn


def step_temporaries(config, batch, capacity, *, page_size=16, dtype=jnp.bfloat16,
                     kv_copies=1) -> int:
    if _step_temporaries is None:
        return 0
    return _step_temporaries(config, batch, capacity, page_size, jnp.dtype(dtype), kv_copies)


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
               dtype=jnp.bfloat16, kv_copies: int = 1, free: int | None = None) -> None:
    """Refuse (ValueError) a cache of `batch` rows x `capacity` tokens whose bytes, with a
    decode step's temporaries over it, exceed the devices' free memory; the message names
    the largest batch of this context that fits."""
    free = memory_available() if free is None else free
    kw = dict(page_size=page_size, dtype=dtype, kv_copies=kv_copies)
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
        f"a decode step over it {(total - need) / 2**30:.2f} GiB more; the devices have "
        f"{free / 2**30:.2f} GiB free: at most batch={largest} rows of {capacity} tokens fit "
        "(lower the batch, the prompt length or max_new_tokens"
        + (")" if jax.default_backend() == "cpu" else
           ", or let JAX's allocator take more than its default 75% of each device: "
           "XLA_PYTHON_CLIENT_MEM_FRACTION=0.95, set before JAX starts)"))


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


def replicate_kv_heads(x: jax.Array, heads: int, axis: int) -> jax.Array:
    """Each of x's KV heads (on `axis`) repeated in place up to `heads` in all: the layout of a
    cache whose KV heads are replicated over tensor-parallel ranks."""
    copies = heads // x.shape[axis]
    return x if copies == 1 else jnp.repeat(x, copies, axis=axis)


def write_prompt(cache: PagedKVCache, keys: jax.Array, values: jax.Array,
                 lengths: jax.Array) -> PagedKVCache:
    """Write every layer's prompt keys/values [L, B, T, HK, D] and set `lengths` [B]."""
    L, B, T = keys.shape[:3]
    page, slot = token_address(cache.page_table, jnp.broadcast_to(jnp.arange(T), (B, T)),
                               cache.page_size)
    layer = jnp.arange(L)[:, None, None]
    keys, values = (replicate_kv_heads(x, cache.k.shape[2], axis=3) for x in (keys, values))
    k = cache.k.at[layer, page[None], :, slot[None]].set(keys.astype(cache.k.dtype))
    v = cache.v.at[layer, page[None], :, slot[None]].set(values.astype(cache.v.dtype))
    return cache.replace(k=k, v=v, lengths=lengths.astype(jnp.int32))


def write_token(k_flat: jax.Array, v_flat: jax.Array, pages: jax.Array, slots: jax.Array,
                k: jax.Array, v: jax.Array):
    """Write tokens into flattened layer pages (see `layer_pages`).

    pages, slots [B, ...] physical addresses already offset to the layer; k, v [B, ..., HK, D].
    Tokens whose page is out of range (>= the number of pages) are dropped. A scatter, which
    XLA updates in place where the cache is donated or carried (the compiled step's memory
    analysis: no cache-sized temporary; tests/test_memory.py).
    """
    k, v = (replicate_kv_heads(x, k_flat.shape[1], axis=-2) for x in (k, v))
    k_flat = k_flat.at[pages, :, slots].set(k.astype(k_flat.dtype), mode="drop")
    v_flat = v_flat.at[pages, :, slots].set(v.astype(v_flat.dtype), mode="drop")
    return k_flat, v_flat