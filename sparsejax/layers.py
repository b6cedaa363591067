"""The decode step's layer stack: roles drive attention, the selection is the carry.

Roles are static, so there is no data-dependent branching (`lax.switch` would put a
conditional, and on GPU a predicate read, in every layer of every step). With per-layer params
(the layout `from_pretrained` returns) the layers run as a Python loop: each layer's weights
are separate buffers that its matmuls read in place, once per step. Stacked params run one
`jax.lax.scan` per maximal run of same-role layers; there XLA copies each layer's weight
slice before its matmul, so a step reads the weights twice.

The KV cache is carried flattened to [layers * num_pages, HK, P, D]; layer l's pages are
addressed with `cache.layer_page_ids`, so kernels read the stacked cache in place and
each step's token is written with one in-place update per layer.

A model placed on a mesh (`sparsejax.shard`) runs each layer's attention and selection per
device over its KV heads (`sharded_attention.decode_attention`); the rest is the partitioner's.
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sparsejax import method_state, resa, selection, sharded_attention
from sparsejax.cache import (KVPages, MethodState, PagedKVCache, as_stored, flat_pages,
                             layer_page_ids, query_dtype, token_address, with_pages,
                             write_backend, write_token)
from sparsejax.models import (Model, attention_inputs, attention_projection, finish_layer,
                              is_stacked, layer_params)
from sparsejax.models import decoder
from sparsejax.models.decoder import (ForwardOutput, normed_dot, qkv_projection,
                                      rope_angles)
from sparsejax.pallas_kernels import (paged_decode_attention, rope_and_write,
                                     sparse_decode_attention)
from sparsejax.pallas_kernels import common as kernel_common
from sparsejax.pallas_kernels import gemv
from sparsejax.pallas_kernels.sparse_attention import attended_mask
from sparsejax.plan import Attended, Role, Score, Selection, SparsePlan, attended_head_map


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
    rope: tuple             # (cos, sin) [B, D] f32 of `positions`, shared by every layer


class Carry(NamedTuple):
    h: jax.Array
    kv: KVPages             # [L * num_pages, HK, P, D] (+ fp8 scales)
    sel: Selection
    state: MethodState | None


class LayerContext(NamedTuple):
    """What one layer's attention reads besides the carried selection."""
    step: StepContext
    layer: jax.Array        # int32 scalar
    q: jax.Array            # [B, HQ, D]
    k_pages: jax.Array      # [L * num_pages, HK, P, D]: the flattened cache, this token written
    v_pages: jax.Array
    table: jax.Array        # [B, max_pages] this layer's pages (`cache.layer_page_ids`)
    state: MethodState | None
    static_layer: int | None = None   # the layer's index where it is known at trace time
    head_shards: Any = None  # `sharded_attention.HeadShards` inside its shard_map, else None
    k_scale: jax.Array | None = None  # [L * num_pages, HK, P] f32: an fp8 cache's scales
    v_scale: jax.Array | None = None
    # On a device of a mesh at a hybrid layer: [n] int32, the local KV heads this device
    # attends to densely and selects for (its retrieval heads first, padded with others to the
    # n that every device runs), so the top-k reads n rows per batch row, not every head's.
    retrieval_rows: jax.Array | None = None

    def scales(self) -> dict:
        """The kernels' scale arguments (none for a bf16 / f32 cache)."""
        return {} if self.k_scale is None else dict(k_scale=self.k_scale, v_scale=self.v_scale)


def _tables(plan: SparsePlan, config):
    L, HK = config.num_layers, config.num_kv_heads
    head_map = (jnp.asarray(plan.head_map, jnp.int32) if plan.head_map is not None
                else jnp.broadcast_to(jnp.arange(HK, dtype=jnp.int32), (L, HK)))
    retrieval = (jnp.asarray(plan.retrieval, bool) if plan.retrieval is not None
                 else jnp.zeros((L, HK), bool))
    return head_map, retrieval


# A batch of one runs its residual stream as two rows, the second a padding row (zeros at
# first) that nothing reads: XLA takes a one-row dot as a multiply and a reduce or a slow
# gemm, so each projection would otherwise pad its input to two rows in a kernel of its own
# (`decoder._dot`; four a layer). The attention, the cache write and the methods see the
# real row only; the output projection's row joins both (docs/tuning.md).
TWO_ROW_STEP = True


# A step of at most two rows (batch 1) projects q/k/v weights up to this size as split-K
# partials (`gemv.projection_partials`, the pre-norm inside it) and one XLA fusion sums them:
# DS-Qwen-1.5B's 6 MiB 8.2 -> 3.9 us in the step, where Llama-8B's 48 MiB is as fast in
# XLA's gemm (docs/tuning.md).
PARTIAL_QKV_MAX_BYTES = 16 * 2**20
# Likewise the o, gate|up and down projections of a layer whose gate weight (gate|up) is up
# to this size: DS-Qwen-1.5B's o 3.5 us + a pad to two rows -> 3.4, its down 9.7 -> 8.7 in
# the step, gate|up as fast as XLA's (docs/tuning.md).
PARTIAL_MLP_MAX_BYTES = 64 * 2**20


def _two_rows(model: Model, batch: int) -> bool:
    """Whether a step of `batch` rows carries a second, padding row through its layers: a
    batch of one on per-layer weights (the fused q|k|v the write kernel splits) off a mesh."""
    return TWO_ROW_STEP and batch == 1 and model.mesh is None and not is_stacked(model.params)


def decode_layers(model: Model, cache: PagedKVCache, h: jax.Array, plan: SparsePlan,
                  diagnostics: bool = False):
    """Run every layer for one token per row. Returns (h [B, H], cache, diagnostics or None)."""
    c = model.config
    B = h.shape[0]
    if _two_rows(model, B):
        h = jnp.pad(h, ((0, 1), (0, 0)))
    pages, slots = token_address(cache.page_table, cache.lengths, cache.page_size)
    head_map, retrieval = _tables(plan, c)
    ctx = StepContext(cache.lengths, cache.lengths + 1, pages, slots, cache.page_table,
                      cache.capacity, head_map, retrieval, rope_angles(c, cache.lengths))
    sel = (selection.empty_selection(plan, c, B, cache.capacity) if plan.selector is not None
           else Selection.empty(B, 1, 1))
    carry = Carry(h, flat_pages(cache), sel, cache.state)
    layer_fn = functools.partial(_layer, model=model, plan=plan, ctx=ctx,
                                 num_pages=cache.num_pages, diagnostics=diagnostics)
    diags = []
    if is_stacked(model.params):
        for role, start, stop in plan.segments():
            body = functools.partial(layer_fn, role=role, static_layer=None)
            carry, diag = jax.lax.scan(body, carry, jnp.arange(start, stop, dtype=jnp.int32))
            diags.append(diag)
        join = lambda *xs: jnp.concatenate(xs, axis=0)  # noqa: E731
    else:
        for layer, role in enumerate(plan.roles):
            with jax.named_scope(f"layer{layer}"):   # names each kernel's layer in a profile
                carry, diag = layer_fn(carry, layer, role=role, static_layer=layer)
            diags.append(diag)
        join = lambda *xs: jnp.stack(xs)  # noqa: E731
    diag = jax.tree.map(join, *diags) if diagnostics else None
    cache = with_pages(cache, carry.kv).replace(state=carry.state)
    return carry.h[:B], cache, diag


def _layer(carry: Carry, layer: jax.Array | int, *, model: Model, plan: SparsePlan, role: Role,
           static_layer: int | None, ctx: StepContext, num_pages: int, diagnostics: bool):
    c = model.config
    lp = layer_params(model.params, layer)
    q, kv, k, v = _project_and_write(model, lp, carry, ctx, layer_page_ids(ctx.pages, layer,
                                                                           num_pages),
                                     positioned_kv=plan.selector is not None)
    state = carry.state
    if plan.selector is not None:   # the state describes the token as cached
        state = method_state.update_state(plan, state, layer, ctx, as_stored(k, kv.k.dtype),
                                          as_stored(v, kv.v.dtype))
    table = layer_page_ids(ctx.page_table, layer, num_pages)
    at = LayerContext(ctx, layer, q, kv.k, kv.v, table, state, static_layer,
                      k_scale=kv.k_scale, v_scale=kv.v_scale)
    attend = (_attend if model.mesh is None
              else sharded_attention.decode_attention(_attend, model.mesh))
    with jax.named_scope(f"attention_{role.name.lower()}"):
        out, sel, attended = attend(role, plan, c, at, carry.sel)
    out = out.astype(carry.h.dtype)
    with jax.named_scope("mlp"):   # the output projection, the residuals and the MLP
        h = _finish_layer(c, lp, carry.h, out, write_backend(model),
                          per_layer=static_layer is not None)
    diag = None
    if diagnostics:
        diag = _diagnostics(plan, c, at, out, attended, sel)
        # the layer's input and its attention block's output (Kascade's layer importance)
        diag.update(hidden=carry.h[:out.shape[0]], attn_block=attention_projection(c, lp, out))
        h = _after(h, diag)
    return Carry(h, kv, sel, state), diag


def _project_and_write(model: Model, lp, carry: Carry, ctx: StepContext, pages: jax.Array,
                       positioned_kv: bool):
    """The layer's q/k/v from its input, K and V written into the cache -> (q [B, HQ, D] in
    the attention's dtype (`query_dtype`), the cache, and k, v [B, HK, D] as the model
    computed them, or None unless `positioned_kv`). With the fused q/k/v weight (the
    per-layer layout) the heads' split, q/k norm, RoPE and the write are one kernel on a GPU
    (`pallas_kernels.rope_and_write`)."""
    c, backend = model.config, write_backend(model)
    if "wqkv" not in lp:
        with jax.named_scope("qkv"):
            q, k, v = attention_inputs(c, lp, carry.h, ctx.positions)
        with jax.named_scope("cache_write"):
            kv = write_token(carry.kv, pages, ctx.slots, k, v, backend=backend)
        # a cache stored in another float dtype than the model's is read with queries of its own
        return q.astype(query_dtype(kv.k.dtype, q.dtype)), kv, k, v
    with jax.named_scope("qkv"):   # h may hold a padding row (`_two_rows`): not written
        qkv = _qkv_rows(c, lp, carry.h, backend)
    norms = dict(q_norm=lp["q_norm"], k_norm=lp["k_norm"]) if c.qk_norm else {}
    with jax.named_scope("cache_write"):
        q, *pools, k, v = rope_and_write(
            qkv, *ctx.rope, carry.kv.k, carry.kv.v, pages, ctx.slots, num_heads=c.num_heads,
            k_scale=carry.kv.k_scale, v_scale=carry.kv.v_scale, eps=c.rms_norm_eps,
            q_dtype=query_dtype(carry.kv.k.dtype, qkv.dtype), return_kv=positioned_kv,
            backend=backend, **norms)
    return q, KVPages(*pools), k, v


def _split_k(h: jax.Array, weight: jax.Array, max_bytes: int, backend: str) -> bool:
    """Whether a projection of h's rows by `weight` takes the split-K kernel: at most two rows
    (a batch-1 step) of a weight up to max_bytes on the Pallas path."""
    return (h.ndim == 2 and h.shape[0] <= 2 and weight.nbytes <= max_bytes
            and kernel_common.resolve_backend(backend) == "pallas")


def _qkv_rows(c, lp, h: jax.Array, backend: str) -> jax.Array:
    """`decoder.qkv_projection` of h [R, H] -> [R, HQ + 2 HK, D], as split-K partials with
    the pre-norm inside when `_split_k`."""
    split_k = _split_k(h, lp["wqkv"], PARTIAL_QKV_MAX_BYTES, backend)
    return qkv_projection(c, lp, h, project=_split_k_normed_dot if split_k else normed_dot)


def _split_k_normed_dot(spec: str, h: jax.Array, norm_weight: jax.Array, eps: float,
                        w: jax.Array) -> jax.Array:
    """`decoder.normed_dot` as `_split_k_product` with the norm inside (what the kernel
    cannot take goes to `normed_dot`)."""
    out = _split_k_product(h, w, norm=norm_weight, eps=eps)
    return normed_dot(spec, h, norm_weight, eps, w) if out is None else out


def _finish_layer(c, lp, h: jax.Array, attn: jax.Array, backend: str,
                  per_layer: bool) -> jax.Array:
    """`decoder.finish_layer` (h [R, H], attn [R' <= R, HQ, D]), its o, gate|up and down
    projections as split-K partials when `_split_k` takes the gate|up weight of per-layer
    weights (a stacked layer's slice inside a scan would be copied out for the kernel)."""
    weight = lp.get("w_gate_up", lp.get("w_gate"))
    split_k = per_layer and _split_k(h, weight, PARTIAL_MLP_MAX_BYTES, backend)
    return finish_layer(c, lp, h, attn, dot=_split_k_dot if split_k else decoder._dot)


def _split_k_dot(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """`decoder._dot(spec, x, w)` as `_split_k_product` (what the kernel cannot take goes to
    `_dot`)."""
    out = _split_k_product(x, w)
    return decoder._dot(spec, x, w) if out is None else out


def _split_k_product(x: jax.Array, w: jax.Array, norm=None, eps: float = 0.0):
    """x [R, contracted...] @ w [contracted..., out...] (x first `rms_norm`ed with `norm`) as
    `gemv.projection_partials`, summed and cast to x's dtype as `decoder._dot` casts its f32
    dot -> [R, out...]; None where the kernel cannot take them. The rows go in as they are:
    the kernel masks them, so a single row needs no pad to two."""
    contracted = x.ndim - 1
    x2 = x.reshape(x.shape[0], -1)
    w2 = w.reshape(x2.shape[1], -1)
    dtypes = {x.dtype} if norm is None else {x.dtype, norm.dtype}
    if dtypes != {w.dtype} or gemv.unsupported(x2, w2, norm=norm) is not None:
        return None
    partials = gemv.projection_partials(x2, w2, norm=norm, eps=eps, backend="pallas")
    return jnp.sum(partials, axis=0).astype(x.dtype).reshape(x.shape[0], *w.shape[contracted:])


def _after(h: jax.Array, diag: dict) -> jax.Array:
    """h, made to depend on the layer's diagnostics (unchanged unless one is NaN). Their dense
    reference reads the pages the next layer writes into; without a data path from those reads
    to that write XLA keeps a copy of the whole page pool per layer to serve them late (58 pool
    copies in a CPU scan of steps; ~30x the cache of temporaries in one step on an H200)."""
    tied = sum(jnp.sum(diag[k]) for k in ("recall", "oracle_recall", "attn_error"))
    return h + jnp.where(jnp.isnan(tied), jnp.nan, 0.0).astype(h.dtype)


def _dense(at: LayerContext, **kwargs):
    """Dense paged attention of the layer's query (`paged_decode_attention`'s result)."""
    return paged_decode_attention(at.q, at.k_pages, at.v_pages, at.table, at.step.lengths,
                                  **at.scales(), **kwargs)


def _attend(role: Role, plan: SparsePlan, config, at: LayerContext, sel: Selection):
    """One layer's attention by role -> (out [B, HQ, D], carried selection, Attended or None
    when every head attended densely)."""
    s = plan.selector
    lengths, capacity = at.step.lengths, at.step.capacity
    if role == Role.DENSE:
        return _dense(at).out, sel, None
    route = selection.score_route(s, sharded=at.head_shards is not None)
    select = functools.partial(selection.select, plan, config, lengths=lengths,
                               capacity=capacity, head_shards=at.head_shards)
    if role == Role.SELECT:
        r = _dense(at, **route.kernel_args())
        return r.out, select(r.scores), None
    head_map_row, retrieval_row = _layer_rows(plan, config, at)
    head_map = attended_head_map(role, s, head_map_row)
    dense_heads = None
    dense_out = None
    logits = None
    if role == Role.SELF:
        scores, logits = selection.pre_attention_scores(plan, at)
        sel = select(scores)
    elif role == Role.HYBRID:
        # Retrieval heads attend densely (only their KV heads are computed) and choose their
        # group's next selection; sparse heads reuse the latest selection of their index.
        dense_heads = retrieval_row
        if at.static_layer is not None or at.retrieval_rows is not None:
            sel, dense_out = _hybrid_select(plan, at, sel, select, route)
        else:
            r = _dense(at, kv_heads=dense_heads, **route.kernel_args())
            fresh = select(r.scores)
            sel = Selection(
                indices=jnp.where(dense_heads[None, :, None], fresh.indices, sel.indices),
                count=jnp.where(dense_heads[None, :], fresh.count, sel.count))
            dense_out = r.out
    out = _sparse(plan, at, sel, head_map, logits)
    if dense_out is not None:
        group = at.q.shape[1] // at.k_pages.shape[1]
        out = jnp.where(jnp.repeat(dense_heads, group)[None, :, None], dense_out, out)
    return out, sel, Attended(sel, head_map, dense_heads)


def _layer_rows(plan: SparsePlan, config, at: LayerContext):
    """The layer's rows of the step's head map and retrieval table -> (head map [HK], None for
    the identity where the layer is static; retrieval [HK] bool). A static layer takes the
    plan's rows as constants: a row of the traced [L, HK] tables is a slice kernel of its own
    on a GPU, one a layer (~30 a step of Kascade or Lychee)."""
    if at.static_layer is None:
        return at.step.head_map[at.layer], at.step.retrieval[at.layer]
    HK = config.num_kv_heads
    head_map = (None if plan.head_map is None
                else np.asarray(plan.head_map, np.int32)[at.static_layer])
    if head_map is not None and (head_map == np.arange(HK)).all():
        head_map = None
    retrieval = (np.zeros(HK, bool) if plan.retrieval is None
                 else np.asarray(plan.retrieval, bool)[at.static_layer])
    return head_map, retrieval


def _hybrid_select(plan: SparsePlan, at: LayerContext, sel: Selection, select, route):
    """A hybrid layer whose dense heads are known by count: the top-k reads their rows only
    (1/HK of the rows when one head in HK retrieves, as is typical). Where the layer is
    static they are the plan's retrieval heads, and the static mask also sizes the kernel's
    splits for them. On a device of a mesh they are `at.retrieval_rows`: its retrieval heads
    padded to the count every device runs; the padding's selection is dropped (and its
    output by the caller's mask). -> (selection, dense output)."""
    if at.retrieval_rows is None:
        mask = np.asarray(plan.retrieval[at.static_layer], bool)
        rows, computed, keep = np.flatnonzero(mask), mask, None
    else:
        rows = at.retrieval_rows
        computed = jnp.zeros((at.k_pages.shape[1],), bool).at[rows].set(True)
        keep = at.step.retrieval[at.layer][rows]
    r = _dense(at, kv_heads=computed, **route.kernel_args())
    fresh = select(selection.take_groups(r.scores, rows), groups=len(rows))
    if keep is not None:
        fresh = Selection(indices=jnp.where(keep[None, :, None], fresh.indices,
                                            sel.indices[:, rows]),
                          count=jnp.where(keep[None, :], fresh.count, sel.count[:, rows]))
    return Selection(indices=sel.indices.at[:, rows].set(fresh.indices),
                     count=sel.count.at[:, rows].set(fresh.count)), r.out


def _sparse(plan: SparsePlan, at: LayerContext, sel: Selection, head_map, logits=None):
    """Sparse attention over `sel` (+ RESA's residual when the plan has one), reading the
    layer's own `logits` instead of K when given."""
    q, lengths = at.q, at.step.lengths
    prior = resa.layer_prior(at.state, at.layer) if plan.residual is not None else None
    r = sparse_decode_attention(
        q, at.k_pages, at.v_pages, at.table, lengths, sel.indices, sel.count,
        unit=plan.selector.unit, head_map=head_map, logits=logits, **at.scales(),
        prior_query=None if prior is None else prior.mu_q.astype(q.dtype),
        prior_length=None if prior is None else resa.prior_length(plan, prior, lengths))
    if prior is None:
        return r.out
    prior_len = resa.prior_length(plan, prior, lengths)
    covered = selection.covered_positions(sel, plan.selector.unit, prior_len, q.shape[1],
                                          at.k_pages.shape[1], head_map)
    return resa.merge(plan.residual, q, r.out, r.lse, r.prior, prior,
                      complete=covered >= prior_len[:, None]).astype(q.dtype)


# ---- diagnostics ----------------------------------------------------------------------------
def _diagnostics(plan, config, at: LayerContext, out, attended, carried):
    """Per row (averaged over query heads): recall = dense attention mass inside what each
    head attended to; oracle_recall = the most mass any set of the same size could hold (the
    top-|S| probabilities); attn_error = relative L2 error of the layer's attention output
    against dense attention. Also the layer's query and selection, for inspection."""
    q, lengths = at.q, at.step.lengths
    dense = _dense(at, score=Score.HEAD_PROBS, backend="reference")
    probs = jnp.where(jnp.isfinite(dense.scores), dense.scores, 0.0)          # [B, HQ, T]
    ref = dense.out.astype(jnp.float32)
    err = jnp.linalg.norm(out.astype(jnp.float32) - ref, axis=-1) / jnp.maximum(
        jnp.linalg.norm(ref, axis=-1), 1e-30)
    if attended is None:
        recall = oracle = jnp.ones(q.shape[:2], jnp.float32)
        sel = carried
    else:
        sel = attended.sel
        mask = attended_mask(sel.indices, sel.count, lengths, num_positions=probs.shape[-1],
                             num_heads=q.shape[1], num_kv_heads=config.num_kv_heads,
                             unit=plan.selector.unit, head_map=attended.head_map,
                             dense_heads=attended.dense_heads)
        recall = jnp.sum(jnp.where(mask, probs, 0.0), axis=-1)
        size = jnp.sum(mask, axis=-1)
        top = jnp.cumsum(-jnp.sort(-probs, axis=-1), axis=-1)
        oracle = jnp.take_along_axis(top, jnp.maximum(size - 1, 0)[..., None], axis=-1)[..., 0]
        oracle = jnp.where(size > 0, oracle, 0.0)
    return {"recall": jnp.mean(recall, axis=-1), "oracle_recall": jnp.mean(oracle, axis=-1),
            "attn_error": jnp.mean(err, axis=-1), "query": q,
            "indices": sel.indices, "count": sel.count}


def prefill_state(model: Model, cache: PagedKVCache, out: ForwardOutput, plan: SparsePlan):
    """Per-layer method state computed once from the prompt (RESA priors, Quest page bounds)."""
    if plan.selector is None:
        return None
    return method_state.init_state(model, cache, out, plan)
