"""Selecting: kernel scores -> per-unit scores per group -> budget -> top-k -> Selection.

`score_route` decides once per selector how its scores travel from the dense kernel to the
top-k. Every select step ends in `pallas_kernels.topk_select`. The per-layer state some
selectors keep in the cache lives in `sparsejax.method_state`.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from sparsejax.cache import layer_page_ids
from sparsejax.models import ModelConfig
from sparsejax.pallas_kernels.common import group_of_head
from sparsejax.pallas_kernels import (LogitRows, fixed_budget, paged_decode_attention,
                                      pool_logit_rows, quest_page_bound, ratio_budget,
                                      threshold_budget, top_p_budget, topk_select)
from sparsejax.plan import Score, Selection, Selector, SparsePlan


class ScoreRoute(NamedTuple):
    """How a selecting layer's scores travel from the dense kernel to the top-k, decided once
    per (selector, placement) by `score_route`.

    kernel_score: the score mode the dense kernel computes (Kascade's pooled rule sums the
      kernel's per-group sums; on a mesh DELTA's max over every head must cross devices
      before the page sums, so the kernel hands back probabilities).
    rows_poolable: `select` may hand the top-k unpooled logits (`LogitRows`), pooled as they
      are read: per-token scores of one group under a budget that does not read the scores.
    topk_pools: the layer asks the kernel for unpooled logits and lets the top-k pool them:
      where one head's logit makes each score (Lychee, Tidal), whose float16 rows also load
      in half the bytes. Kascade's group sums keep the kernel's epilogue: the top-k would
      redo a G-head pooling on every read of a row (docs/tuning.md).
    """
    kernel_score: Score
    rows_poolable: bool
    topk_pools: bool

    @property
    def pool_scores(self) -> bool:
        """The kernel pools its scores in its epilogue (`paged_decode_attention`'s argument)."""
        return not self.topk_pools

    def kernel_args(self) -> dict:
        """`paged_decode_attention`'s score arguments."""
        return dict(score=self.kernel_score, pool_scores=self.pool_scores)


def score_route(s: Selector, sharded: bool = False) -> ScoreRoute:
    """The route of `s`'s scores; `sharded`: its layer's heads are spread over devices. The
    rules of one KV head's group (or one query head) pool the same rows on a device as
    without a mesh: each device holds whole groups, so only the cross-head rules differ."""
    score = s.score
    if score == Score.MAX_HEADS and sharded:
        score = Score.HEAD_PROBS
    elif score == Score.ALL_HEADS_SUM:
        score = Score.GROUP_SUM
    rows_poolable = (s.unit == 1 and s.budget.kind in ("fixed", "ratio")
                     and s.score in (Score.GROUP_SUM, Score.MEAN_QUERY, Score.HEAD_PROBS))
    return ScoreRoute(score, rows_poolable, rows_poolable and s.score != Score.GROUP_SUM)


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


def unit_scores(s: Selector, scores: jax.Array, page_size: int, lengths: jax.Array,
                head_shards=None) -> jax.Array:
    """Kernel scores -> [B, G, units] for the selector's unit and groups. `head_shards`
    (`sharded_attention.HeadShards`, inside its shard_map only): this device holds a slice of
    the heads, and the rules that pool over every head (MAX_HEADS, ALL_HEADS_SUM) reduce
    across devices."""
    if s.score == Score.MAX_HEADS:         # [B, pages] page sums
        if head_shards is not None:        # [B, HQ on this device, T] probabilities
            per_token = head_shards.max(jnp.max(scores, axis=1))
            scores = _pool(per_token, page_size, logits=False)
        return _pool(scores[:, None], s.unit // page_size, logits=False)
    if s.score == Score.QUEST_BOUND:       # [B, HQ, pages]
        return _pool(scores, s.unit // page_size, logits=True)
    if s.score == Score.ALL_HEADS_SUM:     # [B, HK, T] -> one shared row
        finite = jnp.isfinite(scores)
        total = jnp.sum(jnp.where(finite, scores, 0.0), axis=1)
        if head_shards is not None:
            total = head_shards.sum(total)
        scores = jnp.where(jnp.any(finite, axis=1), total, -jnp.inf)[:, None]
    return _pool(scores, s.unit, logits=s.score.is_logit)


def select(plan: SparsePlan, config: ModelConfig, scores: jax.Array | LogitRows | None,
           lengths: jax.Array, capacity: int, groups: int | None = None,
           head_shards=None) -> Selection:
    """Top-k units per (row, group) under the selector's budget, sinks and recent window.
    `groups` overrides the selector's group count (scores of a subset of the groups);
    `head_shards` as in `unit_scores`."""
    s = plan.selector
    B = lengths.shape[0]
    G = s.num_groups(config) if groups is None else groups
    valid_units = -(-lengths // s.unit)                                   # [B]
    n_units = max_units(capacity, s.unit)
    valid = jnp.repeat(valid_units, G).astype(jnp.int32)
    k = buffer_size(s, capacity)
    if s.score == Score.NONE:   # StreamingLLM: ranked by position, the newest first
        rows = jnp.broadcast_to(jnp.arange(n_units, dtype=jnp.float32), (B * G, n_units))
    elif isinstance(scores, LogitRows) and score_route(s, head_shards is not None).rows_poolable:
        if scores.shape != (B, G, n_units):
            raise ValueError(f"scores: LogitRows of shape {scores.shape}: expected "
                             f"{(B, G, n_units)} (batch, groups, capacity)")
        rows = scores.rows()    # pooled inside the top-k; garbage past `valid` is never read
    else:
        if isinstance(scores, LogitRows):
            scores = jnp.where(jnp.arange(scores.shape[-1]) < lengths[:, None, None],
                               scores.scores(), -jnp.inf)
        u = unit_scores(s, scores, plan.page_size, lengths, head_shards)
        u = jnp.broadcast_to(u, (B, G, u.shape[-1]))
        if u.shape[-1] < n_units:   # kernels that return fewer columns
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
    """Per-row budget (units) from the selector's budget rule, capped by the buffer size. A
    ratio applies to each row's own valid units (its length now, generated tokens included)
    and keeps at least one unit of a non-empty row."""
    b = s.budget
    logits = s.score.is_logit
    if b.kind == "fixed":
        k_row = fixed_budget(int(b.value), valid)
    elif b.kind == "ratio":
        k_row = ratio_budget(b.value, valid, minimum=max(1, b.minimum))
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
    return scores_pass(plan, at.q, at.k_pages, at.v_pages, at.table, at.step.lengths,
                       sharded=at.head_shards is not None, scales=at.scales())


def scores_pass(plan: SparsePlan, q, k_pages, v_pages, page_table, lengths, *,
                sharded: bool = False, scales: dict | None = None):
    """A SELF layer's scores pass (no V) -> (scores for `select`, logits or None). Scores
    made of every query head's logits (group sums, head probabilities) come back with those
    logits (`LogitRows`, one row per query head), which the layer's sparse attention reads
    in place of K, unless RESA's prior, whose queries have no logits, needs K anyway.
    `scales`: an fp8 cache's k_scale / v_scale."""
    route = score_route(plan.selector, sharded)
    score = route.kernel_score
    own_logits = plan.residual is None and score in (Score.GROUP_SUM, Score.HEAD_PROBS)
    r = paged_decode_attention(q, k_pages, v_pages, page_table, lengths, values=False,
                               score=score, pool_scores=not (own_logits or route.topk_pools),
                               **(scales or {}))
    if not own_logits:
        return r.scores, None
    scores = r.scores if route.topk_pools else pool_logit_rows(
        score, r.scores, lengths, page_size=k_pages.shape[2])
    return scores, r.scores
