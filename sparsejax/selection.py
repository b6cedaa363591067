"""Selecting: kernel scores -> per-unit scores per group -> budget -> top-k -> Selection.

Also the per-layer method state that selectors keep in the cache (Quest's page key bounds) and
its updates. Every select step ends in `pallas_kernels.topk_select`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from sparsejax import resa
from sparsejax.cache import (MethodState, PagedKVCache, layer_page_ids, layer_pages,
                             replicate_kv_heads, token_address)
from sparsejax.models import Model, ModelConfig
from sparsejax.models.decoder import ForwardOutput
from sparsejax.pallas_kernels.common import group_of_head
from sparsejax.pallas_kernels import (LogitRows, fixed_budget, paged_decode_attention,
                                      pool_logit_rows, quest_page_bound, ratio_budget,
                                      threshold_budget, top_p_budget, topk_select)
from sparsejax.plan import Score, Selection, Selector, SparsePlan


def kernel_score(s: Selector) -> Score:
    """The dense kernel's score mode a selecting layer asks for (the pooled Kascade rule sums
    the kernel's per-group sums). With heads spread over devices, DELTA's per-token max over
    all heads must cross devices before the page sums: the kernel hands back probabilities."""
    if s.score == Score.MAX_HEADS and s.head_shards is not None:
        return Score.HEAD_PROBS
    return Score.GROUP_SUM if s.score == Score.ALL_HEADS_SUM else s.score


def topk_can_pool(s: Selector) -> bool:
    """Whether `select` can hand the top-k the dense kernel's unpooled logits (`LogitRows`),
    pooled as they are read: per-token scores of one group (Kascade's group sums, Lychee's
    mean-query logits, Tidal's per-head probabilities) under a budget that does not read
    the scores."""
    return (s.unit == 1 and s.head_shards is None and s.budget.kind in ("fixed", "ratio")
            and s.score in (Score.GROUP_SUM, Score.MEAN_QUERY, Score.HEAD_PROBS))


def pools_in_topk(s: Selector) -> bool:
    """Whether a selecting layer asks the kernel for unpooled scores (`pool_scores=False`)
    instead of pooled ones written by an epilogue and read back: where one head's logit
    makes each score (Lychee, Tidal), whose float16 rows also load in half the bytes.
    Kascade's group sums keep the epilogue: the top-k recomputes a G-head pooling on every
    read of a row, so it only wins where the row is read once, and re-read rows lose more
    than resident ones gain (docs/tuning.md)."""
    return topk_can_pool(s) and s.score != Score.GROUP_SUM


def kernel_scores(s: Selector) -> dict:
    """What a selecting layer asks of the dense kernel: `paged_decode_attention`'s score and
    pool_scores arguments."""
    return dict(score=kernel_score(s), pool_scores=not pools_in_topk(s))


def take_groups(scores, groups):
    """scores[:, groups] for a score array or `LogitRows`."""
    if isinstance(scores, LogitRows):
        return scores.take(groups)
    return scores[:, groups]


def max_units(capacity: int, unit: int) -> int:
    return -(-capacity // unit)


def forced_units(s: Selector, n_units: int) -> tuple[int, int]:
    """(force_first, force_last) in units; windows that together span the whole capacity
    become one window over everything."""
    if s.force_first + s.force_last >= n_units:
        return 0, n_units
    return s.force_first, s.force_last


def buffer_size(s: Selector, capacity: int) -> int:
    """Static selection slots: the budget's buffer, never fewer than the forced units."""
    n = max_units(capacity, s.unit)
    return min(max(s.budget.buffer_size(n), sum(forced_units(s, n)), 1), n)


def empty_selection(plan: SparsePlan, config: ModelConfig, batch: int, capacity: int) -> Selection:
    s = plan.selector
    return Selection.empty(batch, s.num_groups(config), buffer_size(s, capacity))


def _pool(scores: jax.Array, factor: int, logits: bool) -> jax.Array:
    """[..., N] -> [..., ceil(N / factor)]: max for logits, sum of probabilities otherwise.
    -inf marks positions past the length and contributes nothing."""
    if factor == 1:
        return scores
    n = scores.shape[-1]
    pad = -n % factor
    scores = jnp.pad(scores, [(0, 0)] * (scores.ndim - 1) + [(0, pad)], constant_values=-jnp.inf)
    scores = scores.reshape(scores.shape[:-1] + (-1, factor))
    if logits:
        return jnp.max(scores, axis=-1)
    finite = jnp.isfinite(scores)
    total = jnp.sum(jnp.where(finite, scores, 0.0), axis=-1)
    return jnp.where(jnp.any(finite, axis=-1), total, -jnp.inf)


def unit_scores(s: Selector, scores: jax.Array, page_size: int, lengths: jax.Array) -> jax.Array:
    """Kernel scores -> [B, G, units] for the selector's unit and groups."""
    B = lengths.shape[0]
    if s.score == Score.NONE:
        return jnp.zeros((B, 1, 1), jnp.float32)
    if s.score == Score.MAX_HEADS:         # [B, pages] page sums
        if s.head_shards is not None:      # [B, HQ on this device, T] probabilities
            per_token = s.head_shards.max(jnp.max(scores, axis=1))
            scores = _pool(per_token, page_size, logits=False)
        return _pool(scores[:, None], s.unit // page_size, logits=False)
    if s.score == Score.QUEST_BOUND:       # [B, HQ, pages]
        return _pool(scores, s.unit // page_size, logits=True)
    if s.score == Score.ALL_HEADS_SUM:     # [B, HK, T] -> one shared row
        finite = jnp.isfinite(scores)
        total = jnp.sum(jnp.where(finite, scores, 0.0), axis=1)
        if s.head_shards is not None:
            total = s.head_shards.sum(total)
        scores = jnp.where(jnp.any(finite, axis=1), total, -jnp.inf)[:, None]
    return _pool(scores, s.unit, logits=s.score.is_logit)


def select(plan: SparsePlan, config: ModelConfig, scores: jax.Array | LogitRows | None,
           lengths: jax.Array, capacity: int, groups: int | None = None) -> Selection:
    """Top-k units per (row, group) under the selector's budget, sinks and recent window.
    `groups` overrides the selector's group count (scores of a subset of the groups)."""
    s = plan.selector
    B = lengths.shape[0]
    G = s.num_groups(config) if groups is None else groups
    valid_units = -(-lengths // s.unit)                                   # [B]
    n_units = max_units(capacity, s.unit)
    valid = jnp.repeat(valid_units, G).astype(jnp.int32)
    k = buffer_size(s, capacity)
    if isinstance(scores, LogitRows) and topk_can_pool(s):
        if scores.shape != (B, G, n_units):
            raise ValueError(f"scores: LogitRows of shape {scores.shape}: expected "
                             f"{(B, G, n_units)} (batch, groups, capacity)")
        rows = scores.rows()    # pooled inside the top-k; garbage past `valid` is never read
    else:
        if isinstance(scores, LogitRows):
            scores = jnp.where(jnp.arange(scores.shape[-1]) < lengths[:, None, None],
                               scores.scores(), -jnp.inf)
        u = unit_scores(s, scores, plan.page_size, lengths)
        u = jnp.broadcast_to(u, (B, G, u.shape[-1]))
        if u.shape[-1] < n_units:   # Score.NONE, or kernels that return fewer columns
            u = jnp.pad(u, ((0, 0), (0, 0), (0, n_units - u.shape[-1])),
                        constant_values=-jnp.inf)
        rows = u[..., :n_units].reshape(B * G, n_units)
    k_row = budget_rows(s, rows, valid, k)
    force_first, force_last = forced_units(s, n_units)
    chosen = topk_select(rows, k, valid=valid, k_row=k_row, force_first=force_first,
                         force_last=force_last)
    return Selection(indices=chosen.indices.reshape(B, G, k), count=chosen.count.reshape(B, G))


def select_tiles(plan: SparsePlan, scores: jax.Array, tile_lo: jax.Array,
                 capacity: int) -> Selection:
    """Kascade's rolling prefill top-k: per (row, tile, KV head) the best keys before the
    tile under the selector's budget (counted over the tile_lo [B, tiles] keys before it).
    scores [B, tiles, HK, T] from `paged_tile_scores` -> indices [B, tiles, HK, k] sorted,
    -1 padded, and count [B, tiles, HK]."""
    s = plan.selector
    B, tiles, G, T = scores.shape
    valid = jnp.repeat(jnp.clip(tile_lo, 0, T).reshape(-1), G).astype(jnp.int32)
    rows = scores.reshape(-1, T)
    k = buffer_size(s, capacity)
    chosen = topk_select(rows, k, valid=valid, k_row=budget_rows(s, rows, valid, k))
    return Selection(indices=chosen.indices.reshape(B, tiles, G, k),
                     count=chosen.count.reshape(B, tiles, G))


def budget_rows(s: Selector, rows: jax.Array, valid: jax.Array, k: int) -> jax.Array:
    """Per-row budget (units) from the selector's budget rule, capped by the buffer size."""
    b = s.budget
    logits = s.score.is_logit
    if b.kind == "fixed":
        k_row = fixed_budget(int(b.value), valid)
    elif b.kind == "ratio":
        k_row = ratio_budget(b.value, valid, minimum=b.minimum)
    elif b.kind == "top_p":
        k_row = top_p_budget(rows, b.value, valid, logits=logits)
    else:
        k_row = threshold_budget(rows, b.value, valid, logits=logits)
    return jnp.minimum(k_row, k).astype(jnp.int32)


def covered_positions(sel: Selection, unit: int, limit: jax.Array, num_heads: int,
                      num_kv_heads: int, head_map=None) -> jax.Array:
    """Positions below `limit` [B] each query head's selection covers -> [B, HQ] int32.
    Exact integer counts (RESA uses them to recognise a selection covering the whole prompt)."""
    live = jnp.arange(sel.indices.shape[-1]) < sel.count[..., None]
    start = sel.indices * unit
    span = jnp.clip(jnp.minimum(start + unit, limit[:, None, None]) - start, 0, unit)
    per_group = jnp.sum(jnp.where(live & (sel.indices >= 0), span, 0), axis=-1)    # [B, G]
    return per_group[:, group_of_head(sel.indices.shape[1], num_heads, num_kv_heads, head_map)]


# ---- scores computed before attention (SELF layers) -----------------------------------------
def pre_attention_scores(plan: SparsePlan, at):
    """(scores, logits): what a SELF layer selects from and, where its sparse attention can
    read them instead of K, the logits behind them; `at` is the layer's
    `layers.LayerContext`. The attention-based scores (oracle top-k, Kascade's sparse
    anchors) come from the dense kernel's scores pass alone: K is read, V is not."""
    s = plan.selector
    if s.score == Score.QUEST_BOUND:
        # Every layer's bounds as one [L * num_pages, HK, D] array read through this layer's
        # page ids, as the cache is: a per-layer slice would be copied for the kernel. (On a
        # mesh each device holds one layer's bounds, and `at.layer` is 0 there.)
        kmin, kmax = (x.reshape((-1,) + x.shape[2:]) for x in (at.state.kmin, at.state.kmax))
        table = layer_page_ids(at.step.page_table, at.layer, at.state.kmin.shape[1])
        return quest_page_bound(at.q, kmin, kmax, table, at.step.lengths,
                                page_size=plan.page_size), None
    if s.score == Score.NONE:
        return None, None
    return scores_pass(plan, at.q, at.k_pages, at.v_pages, at.table, at.step.lengths)


def scores_pass(plan: SparsePlan, q, k_pages, v_pages, page_table, lengths):
    """A SELF layer's scores pass (no V) -> (scores for `select`, logits or None). Scores
    made of every query head's logits (group sums, head probabilities) come back with those
    logits (`LogitRows`, one row per query head), which the layer's sparse attention reads
    in place of K, unless RESA's prior, whose queries have no logits, needs K anyway."""
    s = plan.selector
    score = kernel_score(s)
    own_logits = plan.residual is None and score in (Score.GROUP_SUM, Score.HEAD_PROBS)
    r = paged_decode_attention(q, k_pages, v_pages, page_table, lengths, values=False,
                               score=score, pool_scores=not (own_logits or pools_in_topk(s)))
    if not own_logits:
        return r.scores, None
    scores = r.scores if pools_in_topk(s) else pool_logit_rows(
        score, r.scores, lengths, page_size=k_pages.shape[2])
    return scores, r.scores


# ---- per-layer state ------------------------------------------------------------------------
def init_state(model: Model, cache: PagedKVCache, out: ForwardOutput,
               plan: SparsePlan) -> MethodState | None:
    kmin = kmax = prior = None
    if plan.selector.score == Score.QUEST_BOUND:
        kmin, kmax = _page_bounds(cache, out.keys, cache.lengths)
    if plan.residual is not None:
        prior = resa.init_prior(out, cache.lengths)
    if kmin is None and prior is None:
        return None
    return MethodState(prior=prior, kmin=kmin, kmax=kmax)


def _page_bounds(cache: PagedKVCache, keys: jax.Array, lengths: jax.Array):
    """Element-wise min / max key of each physical page over the prompt's valid tokens.
    keys [L, B, T, HK, D] -> kmin, kmax [L, num_pages, HK, D] f32 (+inf / -inf when empty)."""
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
    lo, hi = (replicate_kv_heads(x, HK, axis=3) for x in (lo, hi))
    kmin = jnp.full((L, cache.num_pages, HK, D), jnp.inf, jnp.float32).at[:, phys].set(lo)
    kmax = jnp.full((L, cache.num_pages, HK, D), -jnp.inf, jnp.float32).at[:, phys].set(hi)
    return kmin, kmax


def empty_page_bounds(cache: PagedKVCache) -> MethodState:
    """Quest's state before any token: kmin +inf, kmax -inf [L, num_pages, HK, D] f32."""
    shape = cache.k.shape[:3] + cache.k.shape[4:]
    return MethodState(kmin=jnp.full(shape, jnp.inf, jnp.float32),
                       kmax=jnp.full(shape, -jnp.inf, jnp.float32))


def refresh_page_bounds(state: MethodState, layer: int, k_flat: jax.Array, offset: int,
                        page_table: jax.Array, start: jax.Array, filled: jax.Array,
                        num_tokens: int) -> MethodState:
    """Recompute layer `layer`'s key bounds of the pages that positions start [B] ..
    start + num_tokens - 1 touch, from the cache's keys at positions < filled [B]: exact
    after K/V are overwritten (a running min/max could not forget the old keys), and a page
    with no position below `filled` is empty again (+inf / -inf: rejected draft tokens).
    k_flat [L * num_pages, HK, P, D]; `offset` = layer * num_pages."""
    P, max_pages = k_flat.shape[2], page_table.shape[1]
    logical = start[:, None] // P + jnp.arange((num_tokens - 1) // P + 2)[None, :]  # [B, n]
    touched = logical < max_pages
    phys = jnp.take_along_axis(page_table, jnp.clip(logical, 0, max_pages - 1), axis=1)
    keys = k_flat[offset + phys].astype(jnp.float32)                  # [B, n, HK, P, D]
    held = (logical[..., None] * P + jnp.arange(P) < filled[:, None, None])[:, :, None, :, None]
    lo = jnp.min(jnp.where(held, keys, jnp.inf), axis=3)
    hi = jnp.max(jnp.where(held, keys, -jnp.inf), axis=3)
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
        k_flat = layer_pages(cache.k)
        state = jax.lax.fori_loop(0, num_layers, lambda layer, b: refresh_page_bounds(
            b, layer, k_flat, layer_page_ids(0, layer, cache.num_pages), cache.page_table,
            start, filled, num_tokens), state)
    if state.prior is not None and plan.residual.fold_decode_tokens:
        offsets = jnp.arange(num_tokens, dtype=jnp.int32)
        positions = jnp.minimum(start[:, None] + offsets, cache.capacity - 1)     # [B, C]
        pages, slots = token_address(cache.page_table, positions, cache.page_size)
        k = jnp.moveaxis(cache.k[:, pages, :, slots], 2, 0)                   # [L, B, C, HK, D]
        v = jnp.moveaxis(cache.v[:, pages, :, slots], 2, 0)
        valid = offsets[None, :] < kept[:, None]
        state = state.replace(prior=jax.lax.fori_loop(
            0, num_layers, lambda layer, prior: resa.fold_tokens(prior, layer, k[layer], v[layer],
                                                                  valid), prior_before))
    return state


def update_state(plan: SparsePlan, state: MethodState | None, layer, ctx, k, v):
    """Fold this step's key [B, HK, D] into the per-layer state (Quest bounds, RESA's optional
    fold); ctx.pages [B] are the physical pages it was written to."""
    if state is None:
        return None
    if state.kmin is not None:
        kf = replicate_kv_heads(k.astype(jnp.float32), state.kmin.shape[2], axis=1)
        state = state.replace(kmin=state.kmin.at[layer, ctx.pages].min(kf),
                              kmax=state.kmax.at[layer, ctx.pages].max(kf))
    if state.prior is not None and plan.residual.fold_decode_tokens:
        state = state.replace(prior=resa.fold_token(state.prior, layer, k, v))
    return state
