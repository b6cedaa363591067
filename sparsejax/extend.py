"""Several tokens per row over the paged cache: `extend` and chunked `prefill`.

`extend` runs C tokens per row through every layer at positions start .. start + C - 1:
it writes their K/V into the cache and attends causally to everything cached before them
with `paged_prefill_attention`. Chunked prefill is a `lax.scan` of extends over the prompt;
cache correction re-runs generated tokens with it (dense attention, K/V overwritten).

A prefill step of ROLLED_MIN_TOKENS or more runs the layers as a `lax.scan` over the layer
index (one layer in the compiled program); smaller steps, short extends (correction,
verification) and Kascade's sparse prefill, whose layers differ by role, run them in a
Python loop.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from sparsejax import cache as kv
from sparsejax import method_state, resa, selection, sharded_attention
from sparsejax.models import (Model, attention_inputs, embed, finish_layer, is_stacked,
                              layer_params, unembed)
from sparsejax.pallas_kernels import common, paged_prefill_attention, paged_tile_scores
from sparsejax.pallas_kernels.prefill_attention import CUDNN_MIN_CHUNK
from sparsejax.plan import Role, Selection, SparsePlan


def held_after(lengths: jax.Array, start: jax.Array, num_tokens: jax.Array) -> jax.Array:
    """Tokens each row holds after writing num_tokens at start (a row writing none keeps
    its length, wherever its start points)."""
    return jnp.where(num_tokens > 0, jnp.maximum(lengths, start + num_tokens), lengths)


def extend_layers(model: Model, cache: kv.PagedKVCache, h: jax.Array, start: jax.Array,
                  num_tokens: jax.Array, *, sums: bool = False, plan: SparsePlan | None = None,
                  rolled: bool = False):
    """Every layer for the hidden states h [B, C, H] of tokens at positions start [B] + i,
    the first num_tokens [B] of each row valid (the rest are neither written nor attended).

    Returns (h [B, C, H], cache, sums): the cache with the tokens' K/V written and its
    per-page state (Quest's key bounds) recomputed for the pages they touch, lengths
    untouched; with `sums`, the per-layer sums over the valid tokens of the post-RoPE queries
    [L, B, HQ, D] and keys [L, B, HK, D] in f32 (RESA's means), else None.

    Attention is dense, except with a `plan` that has a `prefill_tile` (Kascade's sparse
    prefill): its SELECT layers attend densely and choose per tile of queries and KV head
    the top keys before the tile (`paged_tile_scores` -> `selection.select_tiles`); its
    REUSE layers attend to those keys, through the head map, plus each tile's own block.

    rolled: run the layers as one `lax.scan` over the layer index (the compiled program holds
    one layer, whatever the depth) instead of a Python loop (one copy of the layer per
    layer; what short extends take: a rolled loop reads each layer's weights through a copy,
    see `_layer_weights`). A sparse prefill, whose layers differ by role, is never rolled.
    """
    c = model.config
    C = h.shape[1]
    positions = start[:, None] + jnp.arange(C, dtype=jnp.int32)[None, :]       # [B, C]
    valid = jnp.arange(C)[None, :] < num_tokens[:, None]
    pages, slots = kv.token_address(cache.page_table, jnp.where(valid, positions, 0),
                                    cache.page_size)
    cached = kv.flat_pages(cache)
    # invalid tokens point past every layer's pages: the write drops them
    pages = jnp.where(valid, pages, cached.k.shape[0])
    filled = held_after(cache.lengths, start, num_tokens)
    tile = None if plan is None else plan.prefill_tile
    head_map = (np.asarray(plan.head_map) if plan is not None and plan.head_map is not None
                else np.broadcast_to(np.arange(c.num_kv_heads), (c.num_layers, c.num_kv_heads)))
    weight = valid.astype(jnp.float32)

    def layer_step(carry, layer, lp, sel):
        """One layer (index `layer`: an int, or traced when rolled) -> (carry, its sums, the
        selection its tiles chose (Kascade's sparse prefill) or None)."""
        h, cached = carry
        offset = layer * cache.num_pages
        with jax.named_scope("qkv"):
            q, k, v = attention_inputs(c, lp, h, positions)
        cached = kv.write_token(cached, offset + pages, slots, k, v,
                                backend=kv.write_backend(model))
        table = cache.page_table + offset
        role = None if tile is None else plan.roles[layer]
        mapped = None
        if role == Role.REUSE:   # the head map, read in the global view
            mapped = Selection(indices=sel.indices[:, :, head_map[layer]],
                               count=sel.count[:, :, head_map[layer]])
        attend = functools.partial(_attend_chunk, role=role, plan=plan, capacity=cache.capacity)
        if model.mesh is not None:
            attend = sharded_attention.prefill_attention(attend, model.mesh, c)
        with jax.named_scope("attention_prefill"):
            out, selected = attend(q.astype(kv.query_dtype(cached.k.dtype, q.dtype)), cached,
                                   mapped, table, start, num_tokens)
        h = finish_layer(c, lp, h, out.astype(h.dtype))
        layer_sums = None
        if sums:   # RESA's mean key: of the keys as cached
            layer_sums = (jnp.einsum("bcnd,bc->bnd", q.astype(jnp.float32), weight),
                          jnp.einsum("bcnd,bc->bnd",
                                     kv.as_stored(k, cached.k.dtype).astype(jnp.float32), weight))
        return (h, cached), layer_sums, selected

    carry = (h, cached)
    if rolled and tile is None:
        def body(carry, layer):
            carry, layer_sums, _ = layer_step(carry, layer,
                                              _layer_weights(model.params, layer), None)
            return carry, layer_sums

        carry, stacked_sums = jax.lax.scan(body, carry,
                                           jnp.arange(c.num_layers, dtype=jnp.int32))
    else:
        sel, per_layer = None, []
        for layer in range(c.num_layers):
            carry, layer_sums, selected = layer_step(
                carry, layer, layer_params(model.params, layer), sel)
            sel = sel if selected is None else selected
            per_layer.append(layer_sums)
        stacked_sums = jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer) if sums else None
    h, cached = carry
    cache = kv.with_pages(cache, cached)
    state = cache.state
    if state is not None and state.kmin is not None:   # after every write: see the function
        state = method_state.refresh_page_bounds(state, cache, start, filled, C)
    return h, cache.replace(state=state), stacked_sums


def _layer_weights(params, layer: jax.Array):
    """Layer `layer` (traced)'s weights in a rolled layer loop: an index into the stacked
    layout, a `lax.switch` over the per-layer one. Either gives the layer's weights as a
    copy (one layer's bytes of temporaries), which a compute-bound prefill chunk does not
    notice and a one-token step would (so decode steps and short extends stay unrolled)."""
    if is_stacked(params):
        return layer_params(params, layer)
    layers = params["layers"]
    return jax.lax.switch(layer, [functools.partial(lambda lp: lp, lp) for lp in layers])


def _attend_chunk(q, pages: kv.KVPages, sel, table, start, num_tokens, *, role, plan,
                  capacity):
    """One layer's attention of a chunk of queries q [B, C, HQ, D] over the flattened cache
    `pages` -> (out [B, C, HQ, D], the selection per tile and KV head when the layer selects
    (Kascade's sparse prefill), else None). A REUSE layer attends to `sel`, already through
    its head map."""
    tile = None if plan is None else plan.prefill_tile
    scales = pages.scales()
    if role == Role.REUSE:
        return paged_prefill_attention(q, pages.k, pages.v, table, start, num_tokens, tile=tile,
                                       indices=sel.indices, count=sel.count, **scales).out, None
    out, lse = paged_prefill_attention(q, pages.k, pages.v, table, start, num_tokens, **scales)
    if role not in (Role.SELECT, Role.SELF):   # Kascade's anchors, sparse ones included
        return out, None
    with jax.named_scope("select_tiles"):
        scores = paged_tile_scores(q, pages.k, table, start, num_tokens, lse, tile=tile,
                                   **({} if pages.k_scale is None else
                                      dict(k_scale=pages.k_scale)))
        tile_lo = start[:, None] + jnp.arange(scores.shape[1]) * tile
        return out, selection.select_tiles(plan, scores, tile_lo, capacity)


ONE_PASS = "one-pass"
# Prefill steps of at least this many tokens (rows x chunk) run their layers rolled: each
# layer's weights are then copied once a step, a few percent of its matmuls' time at this
# size (less beside long-context attention); smaller steps unroll the layers.
ROLLED_MIN_TOKENS = 2048
MAX_PREFILL_CHUNK = 8192   # tokens per row per step: longer chunks add memory, not speed
MIN_PREFILL_CHUNK = 16     # a batch near the memory's limit leaves little for activations
ACTIVATION_SHARE = 8       # one prefill step's temporaries may take 1/8 of the free memory


def activation_bytes_per_token(config) -> int:
    """A generous bound on one token's activations inside one layer of a prefill step (f32:
    gate, up and their product, the q/k/v projections and a few hidden-sized temporaries)."""
    c = config
    return 4 * (3 * c.intermediate_size + 6 * c.hidden_size
                + (c.num_heads + 2 * c.num_kv_heads) * c.head_dim)


def attention_bytes_per_row(config, chunk: int, span: int, dtype=jnp.bfloat16) -> int:
    """A generous bound on one row's attention buffers in a dense prefill step of `chunk`
    queries over `span` cached positions, by the backend `paged_prefill_attention` takes: the
    reference (no GPU) holds f32 logits, probabilities and mask [HQ, chunk, span] and the
    gathered K/V in f32; cuDNN (chunks of CUDNN_MIN_CHUNK+ on a GPU) K/V of the positions
    before the chunk gathered contiguous (a power-of-2 run and the length-masked fallback);
    the Pallas kernel reads the pages in place (its partials are chunk-sized, counted with
    the activations)."""
    c = config
    if not common.on_gpu():
        return 4 * span * (3 * chunk * c.num_heads + 2 * c.num_kv_heads * c.head_dim)
    if chunk >= CUDNN_MIN_CHUNK:
        return 4 * span * c.num_kv_heads * c.head_dim * jnp.dtype(dtype).itemsize
    return 0


def prefill_step_bytes(config, batch: int, chunk: int, span: int, dtype=jnp.bfloat16) -> int:
    """A generous bound on one prefill step's temporaries beside the cache: `batch` rows of
    `chunk` tokens' activations and attention buffers over `span` cached positions."""
    return batch * (chunk * activation_bytes_per_token(config)
                    + attention_bytes_per_row(config, chunk, span, dtype))


def choose_prefill_chunk(config, batch: int, prompt_len: int, *, tile: int | None = None,
                         free_bytes: int | None = None, span: int | None = None,
                         dtype=jnp.bfloat16) -> int:
    """Tokens per row per prefill step when the caller leaves it to us: the largest power of
    two (MIN_PREFILL_CHUNK .. MAX_PREFILL_CHUNK) whose step over `batch` rows of `span` cached
    positions (default: the prompt) keeps its temporaries (`prefill_step_bytes`) within
    1/ACTIVATION_SHARE of `free_bytes` (default: what the devices have free now), never more
    than the prompt (a prompt that short runs in one step). With a sparse prefill's `tile`,
    a multiple of it."""
    free = kv.memory_available() if free_bytes is None else free_bytes
    span = prompt_len if span is None else span
    room = max(free, 0) // ACTIVATION_SHARE
    chunk = MIN_PREFILL_CHUNK
    while (chunk * 2 <= MAX_PREFILL_CHUNK and chunk < prompt_len
           and prefill_step_bytes(config, batch, min(chunk * 2, prompt_len), span, dtype)
           <= room):
        chunk *= 2
    if chunk >= prompt_len:
        chunk = prompt_len
    if tile is not None:
        chunk = max(tile, chunk // tile * tile) if chunk < prompt_len else -(-chunk // tile) * tile
    return chunk


def resolve_prefill_chunk(chunk, config, batch: int, prompt_len: int, *,
                          tile: int | None = None, free_bytes: int | None = None,
                          span: int | None = None, dtype=jnp.bfloat16) -> int | None:
    """`prefill_chunk` as the prefill runs it: None -> `choose_prefill_chunk`; 0 or "one-pass"
    -> None (one pass over the prompt; a sparse prefill's whole prompt in one chunk); an
    int >= 1 as given."""
    if chunk is None:
        return choose_prefill_chunk(config, batch, prompt_len, tile=tile, free_bytes=free_bytes,
                                    span=span, dtype=dtype)
    if isinstance(chunk, str) and chunk == ONE_PASS or (
            isinstance(chunk, int) and not isinstance(chunk, bool) and chunk == 0):
        return None
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
        raise ValueError(f"prefill_chunk={chunk!r}: expected None (chosen from the free memory), "
                         f"an int >= 1 (tokens per step), or 0 / {ONE_PASS!r} (one pass)")
    return chunk


def extend(model: Model, cache: kv.PagedKVCache, tokens: jax.Array, num_tokens: jax.Array,
           *, start: jax.Array | None = None):
    """Run tokens [B, C] (the first num_tokens [B] of each row valid) at positions
    start .. start + C - 1 (default: cache.lengths, i.e. append). Writes their K/V,
    overwriting what was there (cache correction, speculative verification), and advances
    lengths to max(lengths, start + num_tokens).

    Returns (logits [B, C, vocab] f32, cache); logits past a row's num_tokens are garbage.
    """
    start = cache.lengths if start is None else jnp.asarray(start, jnp.int32)
    num_tokens = jnp.asarray(num_tokens, jnp.int32)
    h, cache, _ = extend_layers(model, cache, embed(model, tokens), start, num_tokens)
    cache = cache.replace(lengths=held_after(cache.lengths, start, num_tokens))
    return unembed(model, h), cache


def chunked_prefill(model: Model, cache: kv.PagedKVCache, input_ids: jax.Array,
                    lengths: jax.Array, plan: SparsePlan, chunk: int | None):
    """Prefill right-padded prompts [B, T] of `lengths` [B] in chunks of `chunk` tokens, one
    `extend` each (a `lax.scan`), into an empty cache; then the method state from the cache.

    Returns (logits [B, vocab] f32 at each row's last prompt token, cache), equal to the
    one-pass `sparsejax.prefill` up to rounding. With Kascade's sparse prefill (a plan with
    `prefill_tile`) attention is sparse (see `extend_layers`); chunk (default: the whole
    prompt) must then be a multiple of the tile, so that tiles start at multiples of it.
    """
    B, T = input_ids.shape
    tile = plan.prefill_tile
    if chunk is None and tile is not None:
        chunk = -(-T // tile) * tile
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk={chunk!r}: expected an int >= 1 (tokens per prefill step)")
    if tile is not None and chunk % tile:
        raise ValueError(f"chunk={chunk}: expected a multiple of the sparse prefill's "
                         f"prefill_tile={tile}")
    kv.check_capacity(cache, T, "the prompt")
    n = -(-T // chunk)
    ids = jnp.pad(input_ids, ((0, 0), (0, n * chunk - T))).reshape(B, n, chunk)
    lengths = lengths.astype(jnp.int32)
    resa_prior = plan.residual is not None
    if plan.selector is not None and plan.selector.score == "quest_bound":
        cache = cache.replace(state=method_state.empty_page_bounds(cache))
    c = model.config
    rolled = B * chunk >= ROLLED_MIN_TOKENS
    last = jnp.zeros((B, c.hidden_size), model.dtype)
    sums = (jnp.zeros((c.num_layers, B, c.num_heads, c.head_dim), jnp.float32),
            jnp.zeros((c.num_layers, B, c.num_kv_heads, c.head_dim), jnp.float32))

    def step(carry, xs):
        cache, last, sums = carry
        index, tokens = xs
        start = index * chunk
        num = jnp.clip(lengths - start, 0, chunk)
        h, cache, chunk_sums = extend_layers(model, cache, embed(model, tokens),
                                             jnp.full((B,), start, jnp.int32), num,
                                             sums=resa_prior, plan=plan, rolled=rolled)
        cache = cache.replace(lengths=jnp.minimum(lengths, start + chunk))
        here = (lengths - 1) // chunk == index      # the row's last prompt token is here
        at = jnp.clip(lengths - 1 - start, 0, chunk - 1)
        last = jnp.where(here[:, None], jnp.take_along_axis(h, at[:, None, None], 1)[:, 0], last)
        if resa_prior:
            sums = jax.tree.map(jnp.add, sums, chunk_sums)
        return (cache, last, sums), None

    (cache, last, sums), _ = jax.lax.scan(
        step, (cache, last, sums), (jnp.arange(n, dtype=jnp.int32), ids.transpose(1, 0, 2)))
    if resa_prior:
        mu_q, mu_k = (x / jnp.maximum(lengths, 1)[None, :, None, None].astype(jnp.float32)
                      for x in sums)
        prior = resa.prior_from_cache(model, cache, mu_q, mu_k, lengths)
        cache = cache.replace(state=(cache.state or kv.MethodState()).replace(prior=prior))
    return unembed(model, last), cache


def correct(model: Model, cache: kv.PagedKVCache, tokens: jax.Array,
            plan: SparsePlan) -> kv.PagedKVCache:
    """Cache correction: re-run each row's last N tokens [B, N] (positions lengths - N ..
    lengths - 1, written by sparse decode steps) with dense attention and overwrite their
    K/V, Quest's bounds of the pages they touch and, when decode tokens are folded into
    RESA's prior, the prior's lse / o_est (recomputed over the cache)."""
    N = tokens.shape[1]
    start = cache.lengths - N
    _, cache, _ = extend_layers(model, cache, embed(model, tokens), start,
                                jnp.full_like(start, N))
    if plan.residual is not None and plan.residual.fold_decode_tokens:
        prior = cache.state.prior
        fresh = resa.prior_from_cache(model, cache, prior.mu_q, prior.mu_k, cache.lengths)
        cache = cache.replace(state=cache.state.replace(prior=prior._replace(
            lse=fresh.lse, o_est=fresh.o_est)))
    return cache
