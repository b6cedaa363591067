"""Per-layer state that methods keep in the cache, and its updates: Quest's page key bounds and
RESA's prior (`sparsejax.resa`), computed at prefill, folded on every step, recomputed where
tokens are overwritten (cache correction) or rolled back (speculative decoding)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from sparsejax import resa
from sparsejax.cache import (KVPages, MethodState, PagedKVCache, as_stored, dequantized_pages,
                             flat_pages, is_fp8, layer_page_ids, query_dtype,
                             replicate_kv_heads, rounded_to, token_address)
from sparsejax.models import Model
from sparsejax.models.decoder import ForwardOutput
from sparsejax.plan import Score, SparsePlan


def init_state(model: Model, cache: PagedKVCache, out: ForwardOutput,
               plan: SparsePlan) -> MethodState | None:
    kmin = kmax = prior = None
    # the state describes the keys and values as cached (an fp8 cache's, dequantized)
    keys, values = (as_stored(x, cache.k.dtype) for x in (out.keys, out.values))
    if plan.selector.score == Score.QUEST_BOUND:
        kmin, kmax = _page_bounds(cache, keys, cache.lengths)
    if plan.residual is not None:
        prior = resa.init_prior(out._replace(keys=keys, values=values), cache.lengths,
                                query_dtype(cache.k.dtype, model.dtype))
    if kmin is None and prior is None:
        return None
    return MethodState(prior=prior, kmin=kmin, kmax=kmax)


def bound_dtype(stored) -> jnp.dtype:
    """The dtype of Quest's page key bounds for a cache of `stored` dtype: the cache's own (a
    page's min and max of stored keys are stored keys, so exact; f32 bounds would add 1/8 of
    a bf16 cache at page size 16), bfloat16 for fp8 (the dequantized keys' bounds rounded
    outward, `_outward`)."""
    return jnp.dtype(jnp.bfloat16) if is_fp8(stored) else jnp.dtype(stored)


def _outward(lo: jax.Array, hi: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """Lower and upper bounds in `dtype`, lo rounded down and hi up, so that they still bound
    what they bounded (exact where the values are representable)."""
    def rounded(x, toward):
        # x rounded to `dtype`, compared in x's dtype (a cast there and back would be removed
        # by XLA on the GPU: `moved` always False, the bounds rounded inside the keys)
        near = rounded_to(x, dtype)
        moved = near > x if toward < 0 else near < x
        y = near.astype(dtype)
        return jnp.where(moved, jnp.nextafter(y, jnp.array(toward, dtype)), y)
    return rounded(lo, -jnp.inf), rounded(hi, jnp.inf)


def _page_bounds(cache: PagedKVCache, keys: jax.Array, lengths: jax.Array):
    """Element-wise min / max key of each physical page over the prompt's valid tokens.
    keys [L, B, T, HK, D] -> kmin, kmax [L, num_pages, HK, D] in `bound_dtype` (+inf / -inf
    when empty)."""
    L, B, T, HK, D = keys.shape
    P = cache.page_size
    pages = -(-T // P)
    pad = pages * P - T
    kf = jnp.pad(keys.astype(jnp.float32), ((0, 0), (0, 0), (0, pad), (0, 0), (0, 0)))
    kf = kf.reshape(L, B, pages, P, HK, D)
    valid = (jnp.arange(pages * P) < lengths[:, None]).reshape(B, pages, P)[None, :, :, :, None,
                                                                            None]
    lo = jnp.min(jnp.where(valid, kf, jnp.inf), axis=3)
    hi = jnp.max(jnp.where(valid, kf, -jnp.inf), axis=3)
    phys = cache.page_table[:, :pages]
    HK = cache.k.shape[2]     # the cache's heads (KV heads replicated for a mesh)
    lo, hi = _outward(*(replicate_kv_heads(x, HK, axis=3) for x in (lo, hi)),
                      bound_dtype(cache.k.dtype))
    kmin = jnp.full((L, cache.num_pages, HK, D), jnp.inf, lo.dtype).at[:, phys].set(lo)
    kmax = jnp.full((L, cache.num_pages, HK, D), -jnp.inf, hi.dtype).at[:, phys].set(hi)
    return kmin, kmax


def empty_page_bounds(cache: PagedKVCache) -> MethodState:
    """Quest's state before any token: kmin +inf, kmax -inf [L, num_pages, HK, D] in
    `bound_dtype`."""
    shape, dtype = cache.k.shape[:3] + cache.k.shape[4:], bound_dtype(cache.k.dtype)
    return MethodState(kmin=jnp.full(shape, jnp.inf, dtype), kmax=jnp.full(shape, -jnp.inf, dtype))


def refresh_page_bounds(state: MethodState, cache: PagedKVCache, start: jax.Array,
                        filled: jax.Array, num_tokens: int) -> MethodState:
    """Recompute every layer's key bounds of the pages that positions start [B] ..
    start + num_tokens - 1 touch, from the cache's keys at positions < filled [B]: exact
    after K/V are overwritten (a running min/max could not forget the old keys), and a page
    with no position below `filled` is empty again (+inf / -inf: rejected draft tokens). Keys
    are read dequantized when fp8. Called once every layer's K/V are written: a read of the
    cache between two layers' writes made XLA copy the whole donated K cache."""
    pages = flat_pages(cache)
    return jax.lax.fori_loop(0, cache.k.shape[0], lambda layer, b: _refresh_layer_bounds(
        b, layer, pages, layer_page_ids(0, layer, cache.num_pages), cache.page_table, start,
        filled, num_tokens), state)


def _refresh_layer_bounds(state: MethodState, layer, pages: KVPages, offset,
                          page_table: jax.Array, start: jax.Array, filled: jax.Array,
                          num_tokens: int) -> MethodState:
    """`refresh_page_bounds` of layer `layer`; pages: the flattened cache, `offset` = layer *
    num_pages."""
    P, max_pages = pages.k.shape[2], page_table.shape[1]
    logical = start[:, None] // P + jnp.arange((num_tokens - 1) // P + 2)[None, :]  # [B, n]
    touched = logical < max_pages
    phys = jnp.take_along_axis(page_table, jnp.clip(logical, 0, max_pages - 1), axis=1)
    keys = dequantized_pages(pages.k[offset + phys],                  # [B, n, HK, P, D]
                             None if pages.k_scale is None else pages.k_scale[offset + phys])
    held = (logical[..., None] * P + jnp.arange(P) < filled[:, None, None])[:, :, None, :, None]
    lo, hi = _outward(jnp.min(jnp.where(held, keys, jnp.inf), axis=3),
                      jnp.max(jnp.where(held, keys, -jnp.inf), axis=3), state.kmin.dtype)
    phys = jnp.where(touched, phys, state.kmin.shape[1])              # dropped by the write
    return state.replace(kmin=state.kmin.at[layer, phys].set(lo, mode="drop"),
                         kmax=state.kmax.at[layer, phys].set(hi, mode="drop"))


def settle_state(plan: SparsePlan, cache: PagedKVCache, prior_before, start: jax.Array,
                 kept: jax.Array, num_tokens: int):
    """The state once only the first kept [B] of the num_tokens positions from start [B] are
    kept, as if only they had been decoded (speculative decoding: drafts folded their own,
    now overwritten or rejected, tokens). Quest's bounds of the pages those positions touch
    are recomputed from the cache; RESA's folded prior is `prior_before` (the prior before
    drafting) with the kept tokens' cached K/V folded in."""
    state = cache.state
    if state is None:
        return None
    filled = start + kept
    num_layers = cache.k.shape[0]
    if state.kmin is not None:
        state = refresh_page_bounds(state, cache, start, filled, num_tokens)
    if state.prior is not None and plan.residual.fold_decode_tokens:
        offsets = jnp.arange(num_tokens, dtype=jnp.int32)
        positions = jnp.minimum(start[:, None] + offsets, cache.capacity - 1)     # [B, C]
        pages, slots = token_address(cache.page_table, positions, cache.page_size)
        k, v = (jnp.moveaxis(dequantized_pages(x[:, pages, :, slots],         # [L, B, C, HK, D]
                                               None if scale is None else
                                               scale[:, pages, :, slots]), 2, 0)
                for x, scale in ((cache.k, cache.k_scale), (cache.v, cache.v_scale)))
        valid = offsets[None, :] < kept[:, None]
        state = state.replace(prior=jax.lax.fori_loop(
            0, num_layers, lambda layer, prior: resa.fold_tokens(prior, layer, k[layer], v[layer],
                                                                  valid), prior_before))
    return state


def update_state(plan: SparsePlan, state: MethodState | None, layer, ctx, k, v):
    """Fold this step's key [B, HK, D] (as cached: `cache.as_stored`) into the per-layer state
    (Quest bounds, RESA's optional fold); ctx.pages [B] are the physical pages it was written
    to."""
    if state is None:
        return None
    if state.kmin is not None:
        lo, hi = _outward(k, k, state.kmin.dtype)
        lo, hi = (replicate_kv_heads(x, state.kmin.shape[2], axis=1) for x in (lo, hi))
        state = state.replace(kmin=state.kmin.at[layer, ctx.pages].min(lo),
                              kmax=state.kmax.at[layer, ctx.pages].max(hi))
    if state.prior is not None and plan.residual.fold_decode_tokens:
        state = state.replace(prior=resa.fold_token(state.prior, layer, k, v))
    return state
