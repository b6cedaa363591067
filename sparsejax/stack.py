"""The decode step's layer stack: roles drive attention, the selection is the carry.

The plan's roles are static, so the stack is split into maximal runs of same-role layers and
each run is one `jax.lax.scan` over its layer indices (parameters are indexed inside the body,
exactly as a scan over stacked xs would). That avoids data-dependent branching (`lax.switch`
would put a conditional, and on GPU a predicate read, in every layer of every step) and
compiles one body per role present.

The KV cache is carried flattened to [layers * num_pages, HK, P, D]; layer l's pages are
addressed with `page_table + l * num_pages`, so kernels read the stacked cache in place and
each step's token is written with one in-place update per layer.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from sparsejax import resa, selection
from sparsejax.cache import PagedKVCache, layer_pages, token_address, write_token
from sparsejax.models import Model, attention_inputs, finish_layer
from sparsejax.models.decoder import ForwardOutput
from sparsejax.pallas_kernels import paged_decode_attention, sparse_decode_attention
from sparsejax.plan import Role, Selection, SparsePlan


class StepContext(NamedTuple):
    """Everything a layer body reads but does not carry."""
    positions: jax.Array    # [B] position of this step's token
    lengths: jax.Array      # [B] tokens attended to, this step's included
    pages: jax.Array        # [B] physical page of this step's token (layer 0)
    slots: jax.Array        # [B] slot in that page
    page_table: jax.Array   # [B, max_pages] (layer 0's page ids)
    capacity: int           # tokens per row the cache holds (static)
    head_map: jax.Array     # [L, HK] int32
    retrieval: jax.Array    # [L, HK] bool


class Carry(NamedTuple):
    h: jax.Array
    k: jax.Array            # [L * num_pages, HK, P, D]
    v: jax.Array
    sel: Selection
    state: dict | None


def _tables(plan: SparsePlan, config):
    L, HK = config.num_layers, config.num_kv_heads
    head_map = (jnp.asarray(plan.head_map, jnp.int32) if plan.head_map is not None
                else jnp.broadcast_to(jnp.arange(HK, dtype=jnp.int32), (L, HK)))
    retrieval = (jnp.asarray(plan.retrieval, bool) if plan.retrieval is not None
                 else jnp.zeros((L, HK), bool))
    return head_map, retrieval


def decode_layers(model: Model, cache: PagedKVCache, h: jax.Array, plan: SparsePlan,
                  diagnostics: bool = False):
    """Run every layer for one token per row. Returns (h [B, H], cache, diagnostics or None)."""
    c = model.config
    B = h.shape[0]
    pages, slots = token_address(cache.page_table, cache.lengths, cache.page_size)
    head_map, retrieval = _tables(plan, c)
    ctx = StepContext(cache.lengths, cache.lengths + 1, pages, slots, cache.page_table,
                      cache.capacity, head_map, retrieval)
    sel = (selection.empty_selection(plan, c, B, cache.capacity) if plan.selector is not None
           else Selection.empty(B, 1, 1))
    carry = Carry(h, layer_pages(cache.k), layer_pages(cache.v), sel, cache.state)
    diags = []
    for role, start, stop in plan.segments():
        body = functools.partial(_layer, model=model, plan=plan, role=role, ctx=ctx,
                                 num_pages=cache.num_pages, diagnostics=diagnostics)
        carry, diag = jax.lax.scan(body, carry, jnp.arange(start, stop, dtype=jnp.int32))
        diags.append(diag)
    cache = cache.replace(k=carry.k.reshape(cache.k.shape), v=carry.v.reshape(cache.v.shape),
                          state=carry.state)
    diag = jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *diags) if diagnostics else None
    return carry.h, cache, diag


def _layer(carry: Carry, layer: jax.Array, *, model: Model, plan: SparsePlan, role: Role,
           ctx: StepContext, num_pages: int, diagnostics: bool):
    c = model.config
    lp = jax.tree.map(lambda x: x[layer], model.params["layers"])
    with jax.named_scope("qkv"):
        q, k, v = attention_inputs(c, lp, carry.h, ctx.positions)
    k_flat, v_flat = write_token(carry.k, carry.v, layer * num_pages + ctx.pages, ctx.slots, k, v)
    state = carry.state
    if plan.selector is not None:
        state = selection.update_state(plan, state, layer, ctx, k, v, q)
    table = ctx.page_table + layer * num_pages
    attend = functools.partial(_attend, role=role, plan=plan, config=c, q=q, k_pages=k_flat,
                               v_pages=v_flat, table=table, lengths=ctx.lengths, layer=layer,
                               ctx=ctx, state=state)
    with jax.named_scope(f"attention_{role.name.lower()}"):
        out, sel, attended = attend(sel=carry.sel)
    h = finish_layer(c, lp, carry.h, out)
    diag = None
    if diagnostics:
        unit = plan.selector.unit if plan.selector is not None else 1
        diag = _diagnostics(q, k_flat, v_flat, table, ctx.lengths, out, attended, unit)
    return Carry(h, k_flat, v_flat, sel, state), diag


def _attend(*, role, plan, config, q, k_pages, v_pages, table, lengths, layer, ctx, state, sel):
    """One layer's attention by role. Returns (out [B, HQ, D], selection, attended) where
    `attended` describes what each head attended to (for diagnostics): None means everything."""
    s = plan.selector
    if role == Role.DENSE:
        out = paged_decode_attention(q, k_pages, v_pages, table, lengths).out
        return out, sel, None
    if role == Role.SELECT:
        r = paged_decode_attention(q, k_pages, v_pages, table, lengths,
                                   score=selection.kernel_score(s))
        sel = selection.select(plan, config, r.scores, lengths, ctx.capacity)
        return r.out, sel, None
    if role == Role.SELF:
        scores = selection.pre_attention_scores(plan, q, k_pages, v_pages, table, lengths,
                                                layer, state, ctx.page_table)
        sel = selection.select(plan, config, scores, lengths, ctx.capacity)
    head_map = ctx.head_map[layer] if s.groups == "kv" else None
    if role == Role.HYBRID:
        return _hybrid(plan, config, q, k_pages, v_pages, table, lengths, layer, ctx, state,
                       sel, head_map)
    out = _sparse(plan, q, k_pages, v_pages, table, lengths, layer, state, sel, head_map)
    return out, sel, (sel, head_map, None)


def _sparse(plan, q, k_pages, v_pages, table, lengths, layer, state, sel, head_map,
            dense_heads=None):
    """Sparse attention over `sel` (+ RESA's residual when the plan has one)."""
    prior = resa.layer_prior(state, layer) if plan.residual is not None else None
    r = sparse_decode_attention(
        q, k_pages, v_pages, table, lengths, sel.indices, sel.count, unit=plan.selector.unit,
        head_map=head_map, dense_heads=dense_heads,
        prior_query=None if prior is None else prior.mu_q.astype(q.dtype),
        prior_length=None if prior is None else resa.prior_length(plan, prior, lengths))
    if prior is None:
        return r.out
    merged = resa.merge(plan.residual, q, r.out, r.lse, r.prior, prior)
    if dense_heads is not None:  # dense (retrieval) heads keep their exact output
        group = q.shape[1] // k_pages.shape[1]
        merged = jnp.where(jnp.repeat(dense_heads, group)[None, :, None], r.out, merged)
    return merged.astype(q.dtype)


def _hybrid(plan, config, q, k_pages, v_pages, table, lengths, layer, ctx, state, sel, head_map):
    """Lychee: retrieval heads attend densely and choose their group's next selection; sparse
    heads reuse the latest selection of their head index."""
    retrieval = ctx.retrieval[layer]                                  # [HK]
    r = paged_decode_attention(q, k_pages, v_pages, table, lengths,
                               score=selection.kernel_score(plan.selector), kv_heads=retrieval)
    fresh = selection.select(plan, config, r.scores, lengths, ctx.capacity)
    keep = retrieval[None, :, None]
    sel = Selection(indices=jnp.where(keep, fresh.indices, sel.indices),
                    count=jnp.where(retrieval[None, :], fresh.count, sel.count))
    out = _sparse(plan, q, k_pages, v_pages, table, lengths, layer, state, sel, head_map,
                  dense_heads=retrieval)
    return out, sel, (sel, head_map, retrieval)


# ---- diagnostics ----------------------------------------------------------------------------
def _diagnostics(q, k_pages, v_pages, table, lengths, out, attended, unit):
    """Recall (dense attention mass inside what each head attended to) and the relative L2
    error of the layer's attention output against dense attention, averaged over heads."""
    from sparsejax.pallas_kernels.sparse_attention import attended_mask

    dense = paged_decode_attention(q, k_pages, v_pages, table, lengths, score="head_probs",
                                   backend="reference")
    ref = dense.out.astype(jnp.float32)
    err = jnp.linalg.norm(out.astype(jnp.float32) - ref, axis=-1) / jnp.maximum(
        jnp.linalg.norm(ref, axis=-1), 1e-30)
    if attended is None:
        recall = jnp.ones(q.shape[:2], jnp.float32)
    else:
        sel, head_map, dense_heads = attended
        mask = attended_mask(sel.indices, sel.count, lengths, num_positions=dense.scores.shape[-1],
                             num_heads=q.shape[1], num_kv_heads=k_pages.shape[1],
                             unit=unit, head_map=head_map,
                             dense_heads=dense_heads)
        recall = jnp.sum(jnp.where(mask, dense.scores, 0.0), axis=-1)
    return {"recall": jnp.mean(recall, axis=-1), "attn_error": jnp.mean(err, axis=-1)}


def prefill_state(model: Model, cache: PagedKVCache, out: ForwardOutput, plan: SparsePlan):
    """Per-layer method state computed once from the prompt (RESA priors, Quest page bounds)."""
    if plan.selector is None:
        return None
    return selection.init_state(model, cache, out, plan)
