"""Attention and selection per device: the decode step's, a prefill chunk's and RESA's prior
attention inside `jax.shard_map` over the KV heads of the "model" axis (the layout they run on
is `sparsejax.sharding`'s). Only the rules that cross heads communicate.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from sparsejax.cache import KVPages, replicate_kv_heads
from sparsejax.models import ModelConfig
from sparsejax.plan import Attended, Role, Selection, attended_head_map
from sparsejax.sharding import MODEL, STATE_HEADS, current_mesh, leaf_name, model_size


# ---- attention per device ------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class HeadShards:
    """Handed to a layer's attention inside `decode_attention`: this device holds a slice of
    the heads, and `copies` consecutive devices hold each KV head. The two cross-head score
    rules use it (`selection.unit_scores`)."""
    axis: str
    copies: int

    def max(self, x: jax.Array) -> jax.Array:
        return jax.lax.pmax(x, self.axis)

    def sum(self, x: jax.Array) -> jax.Array:
        """Sum over every KV head, counting each replicated KV head once."""
        primary = jax.lax.axis_index(self.axis) % self.copies == 0
        return jax.lax.psum(jnp.where(primary, x, jnp.zeros_like(x)), self.axis)


class _Heads:
    """Moving head-indexed arrays between the global view and the devices' layout, for a cache
    holding each of the config's KV heads `copies` times."""

    def __init__(self, config: ModelConfig, copies: int):
        self.kv, self.q, self.copies = config.num_kv_heads, config.num_heads, copies

    def per_kv(self, x, axis=1):        # [..., HK, ...] -> [..., HK * copies, ...]
        return replicate_kv_heads(x, self.kv * self.copies, axis)

    def per_q(self, x, axis=1):         # [..., HQ, ...] -> each KV head copy with its group
        shape = x.shape
        x = x.reshape(shape[:axis] + (self.kv, self.q // self.kv) + shape[axis + 1:])
        return self.per_kv(x, axis).reshape(shape[:axis] + (-1,) + shape[axis + 1:])

    def own_q(self, x, axis=1):         # on a device: its KV head's group -> its own share
        if self.copies == 1:
            return x
        share = x.shape[axis] // self.copies
        return jax.lax.dynamic_slice_in_dim(
            x, jax.lax.axis_index(MODEL) % self.copies * share, share, axis=axis)

    def gather_kv(self, x, axis=1):     # on a device: [.., 1, ..] -> [.., HK, ..] everywhere
        return jax.lax.all_gather(x, MODEL, axis=axis, tiled=True).take(
            jnp.arange(0, self.kv * self.copies, self.copies), axis=axis)


def _heads_spec(axis: int) -> P:
    return P(*(None,) * axis, MODEL)


def _on_devices(local: Callable, mesh, args: tuple, in_specs: tuple, out_specs):
    return jax.shard_map(local, mesh=current_mesh(mesh), in_specs=in_specs, out_specs=out_specs,
                         axis_names={MODEL}, check_vma=False)(*args)


def _selection_routes(heads: _Heads, groups: str | None, axis: int):
    """(to the devices' layout, from a device's own result, spec of the result) of a carried
    selection whose group axis is `axis`: per KV head, per query head or shared."""
    spec = _heads_spec(axis)
    if groups == "kv":
        if heads.copies > 1:
            return (functools.partial(heads.per_kv, axis=axis),
                    functools.partial(heads.gather_kv, axis=axis), P())
        return functools.partial(heads.per_kv, axis=axis), None, spec
    if groups == "query":
        return (functools.partial(heads.per_q, axis=axis),
                functools.partial(heads.own_q, axis=axis), spec)
    return None, None, P()


def decode_attention(attend: Callable, mesh) -> Callable:
    """`attend(role, plan, config, at, sel)` (the decode step's per-layer attention) run inside
    `jax.shard_map` over the KV heads of "model": each device attends with its query heads over
    its KV heads.

    In the global view the wrapper lays the head-indexed inputs out per device (the cache is
    already laid out so), gives each device a local config / plan / layer context of its own
    heads, and each device hands back the model's heads it owns in the Megatron layout, so
    nothing moves before the row-parallel o-projection. Selections per query head, and per KV
    head when the KV heads divide over the ranks, stay sharded (a head map that keeps every
    KV head on its device is applied there; one that reads another device's set is gathered
    by the partitioner); with replicated KV heads the per-KV-head selections are
    all-gathered; shared selections are computed identically on every device from scores
    reduced across devices (`HeadShards`). A hybrid layer's static retrieval heads reach each
    device as its own row list (`_retrieval_rows`), so it attends densely to and selects for
    those only. On a "model" axis of size 1 there is nothing to split: `attend` runs as it
    is (so a 1-device mesh costs what no mesh does).
    """
    if model_size(mesh) == 1:
        return attend

    def run(role, plan, config, at, sel):
        copies = at.k_pages.shape[1] // config.num_kv_heads
        heads = _Heads(config, copies)
        per_device = at.k_pages.shape[1] // model_size(mesh)       # cache heads per device
        s = plan.selector
        to_device, from_local, sel_out = _selection_routes(
            heads, None if s is None else s.groups, axis=1)
        sel_in = sel
        local_map = None
        if role == Role.REUSE and s.groups == "kv":
            local_map = _device_head_map(plan, at, per_device) if copies == 1 else None
            if local_map is None and not _identity_head_map(plan, at):
                # a head map reading sets chosen on other devices, applied in the global
                # view: the partitioner all-gathers the selection. (Replicated KV heads
                # carry a replicated selection, which is read where it lies.)
                head_map = at.step.head_map[at.layer]
                sel_in = Selection(indices=sel.indices[:, head_map],
                                   count=sel.count[:, head_map])
        rows = _retrieval_rows(plan, at, copies, per_device) if role == Role.HYBRID else None
        if to_device is not None:
            sel_in = jax.tree.map(to_device, sel_in)
        state_in = None if at.state is None else jax.tree_util.tree_map_with_path(
            lambda path, x: _state_to_device(leaf_name(path), x[at.layer][None], heads),
            at.state)
        retrieval = heads.per_kv(at.step.retrieval[at.layer][None])          # [1, HK * copies]
        # static: closed over
        step = at.step._replace(head_map=None, retrieval=None, capacity=None)
        spec = _heads_spec(1)

        def local(q, k_pages, v_pages, scales, table, step, retrieval, state, sel, local_map,
                  rows):
            hk = k_pages.shape[1]
            if local_map is not None:   # each KV head reads a set chosen on this device
                sel = Selection(indices=sel.indices[:, local_map], count=sel.count[:, local_map])
            local_config = dataclasses.replace(config, num_heads=q.shape[1], num_kv_heads=hk)
            step = step._replace(retrieval=retrieval, capacity=at.step.capacity,
                                 head_map=jnp.arange(hk, dtype=jnp.int32)[None])
            # Row 0 of the per-device tables is this layer's: the layer index is 0, and the
            # static per-layer paths (which read the global plan's tables) are off.
            local_at = at._replace(step=step, layer=jnp.zeros((), jnp.int32), static_layer=None,
                                   q=q, k_pages=k_pages, v_pages=v_pages, table=table,
                                   k_scale=scales[0], v_scale=scales[1],
                                   state=state, head_shards=HeadShards(MODEL, copies),
                                   retrieval_rows=rows)
            out, new_sel, _ = attend(role, plan, local_config, local_at, sel)
            if from_local is not None:
                new_sel = jax.tree.map(from_local, new_sel)
            return heads.own_q(out), new_sel

        state_specs = None if state_in is None else jax.tree_util.tree_map_with_path(
            lambda path, _: _heads_spec(2) if STATE_HEADS[leaf_name(path)] else P(), state_in)
        # an fp8 cache's scales [L * num_pages, HK, P] lie like its pages; (None, None) else
        scales = (at.k_scale, at.v_scale)
        scale_specs = (None, None) if at.k_scale is None else (spec, spec)
        out, new_sel = _on_devices(
            local, mesh,
            (heads.per_q(at.q), at.k_pages, at.v_pages, scales, at.table, step, retrieval,
             state_in, sel_in, local_map, rows),
            (spec, spec, spec, scale_specs, P(), P(), spec, state_specs,
             P() if to_device is None else spec, None if local_map is None else P(MODEL),
             None if rows is None else P(MODEL)),
            (spec, sel_out))
        # reuse carries the selection on unchanged (the head-mapped one was this layer's only)
        carried = sel if role == Role.REUSE else new_sel
        if role in (Role.DENSE, Role.SELECT):
            return out, carried, None
        # what the heads attended to, in the global view (for diagnostics)
        attended = Attended(carried, attended_head_map(role, s, at.step.head_map[at.layer]),
                            at.step.retrieval[at.layer] if role == Role.HYBRID else None)
        return out, carried, attended

    return run


def _head_map_rows(plan, at) -> np.ndarray:
    """The head-map rows this layer may read: its own where the layer is static, else every
    layer's ([rows, HK])."""
    table = np.asarray(plan.head_map, np.int32)
    return table if at.static_layer is None else table[at.static_layer][None]


def _identity_head_map(plan, at) -> bool:
    if plan.head_map is None:
        return True
    rows = _head_map_rows(plan, at)
    return bool((rows == np.arange(rows.shape[1])).all())


def _device_head_map(plan, at, per_device: int):
    """This layer's head map in each device's own indices ([HK] int32, device d's entries
    at d * per_device ...), when every KV head reads a set chosen on its own device: the
    selection is then mapped where it lies, with no collective. None for the identity (read
    as it is) and for a map that crosses devices."""
    if _identity_head_map(plan, at):
        return None
    rows = _head_map_rows(plan, at)
    device = np.arange(rows.shape[1]) // per_device
    if not (rows // per_device == device).all():
        return None
    row = (jnp.asarray(plan.head_map, jnp.int32)[at.layer] if at.static_layer is None
           else jnp.asarray(rows[0]))
    return row - jnp.asarray(device * per_device, jnp.int32)


def _retrieval_rows(plan, at, copies: int, per_device: int) -> jax.Array:
    """A hybrid layer's dense heads per device, flattened [devices * n] (local indices, split
    over "model"): each device's retrieval heads first, padded with its other heads to n, the
    most any device holds. Every device then runs the same n dense heads and n top-k rows;
    the padding's output and selection are dropped. n is this layer's where the layer is
    static, else the most of any hybrid layer (the row is read by the traced layer index)."""
    mask = np.repeat(np.asarray(plan.retrieval, bool), copies, axis=1)       # [L, cache heads]
    mask = mask.reshape(mask.shape[0], -1, per_device)                     # [L, devices, own]
    if at.static_layer is not None:
        layers = [at.static_layer]
    else:
        layers = [layer for layer, role in enumerate(plan.roles) if role == Role.HYBRID]
    n = max(1, int(mask[layers].sum(-1).max()))
    order = np.argsort(~mask, axis=-1, kind="stable")[..., :n].astype(np.int32)
    if at.static_layer is not None:
        return jnp.asarray(order[at.static_layer].reshape(-1))
    return jnp.asarray(order)[at.layer].reshape(-1)


def _state_to_device(name: str, x: jax.Array, heads: _Heads) -> jax.Array:
    """One layer's method-state leaf [1, ...] (head axis 2) in the devices' layout."""
    kind = STATE_HEADS[name]
    if kind == "kv":
        return heads.per_kv(x, axis=2)
    if kind == "query":
        return heads.per_q(x, axis=2)
    return x           # per cache head (already laid out like the cache) or headless


def _pages_spec(pages: KVPages) -> KVPages:
    """Specs of a flattened cache (`cache.KVPages`): pages and scales split on their KV heads."""
    spec = _heads_spec(1)
    return KVPages(spec, spec, *((None, None) if pages.k_scale is None else (spec, spec)))


def prefill_attention(attend: Callable, mesh, config: ModelConfig) -> Callable:
    """`attend(q, pages, sel, *args) -> (out, new_sel)` of several query tokens per row (q
    [B, C, HQ, D]; pages a `cache.KVPages`; sel and new_sel per tile and KV head
    [B, tiles, HK, k], or None; args replicated) inside `jax.shard_map` over the KV heads of
    "model", laid out as in `decode_attention`."""
    if model_size(mesh) == 1:
        return attend

    def run(q, pages, sel, *args):
        heads = _Heads(config, pages.k.shape[1] // config.num_kv_heads)
        to_device, from_local, sel_out = _selection_routes(heads, "kv", axis=2)

        def local(q, pages, sel, *args):
            out, new_sel = attend(q, pages, sel, *args)
            if new_sel is not None and from_local is not None:
                new_sel = jax.tree.map(from_local, new_sel)
            return heads.own_q(out, axis=2), new_sel

        sel_in = None if sel is None else jax.tree.map(to_device, sel)
        return _on_devices(local, mesh, (heads.per_q(q, axis=2), pages, sel_in) + args,
                           (_heads_spec(2), _pages_spec(pages), _heads_spec(2))
                           + (P(),) * len(args),
                           (_heads_spec(2), sel_out))
    return run


def prior_attention(attend: Callable, mesh, config: ModelConfig) -> Callable:
    """`attend(q, pages, *args) -> (lse, out)` of one query per row and head (q [B, HQ, D];
    pages a `cache.KVPages`; lse [B, HQ], out [B, HQ, D]; args replicated) inside
    `jax.shard_map` over the KV heads of "model" (RESA's prior over the cache)."""
    if model_size(mesh) == 1:
        return attend

    def run(q, pages, *args):
        heads = _Heads(config, pages.k.shape[1] // config.num_kv_heads)
        spec = _heads_spec(1)

        def local(q, pages, *args):
            return jax.tree.map(heads.own_q, attend(q, pages, *args))

        return _on_devices(local, mesh, (heads.per_q(q), pages) + args,
                           (spec, _pages_spec(pages)) + (P(),) * len(args), (spec, spec))
    return run
