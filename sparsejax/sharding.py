"""Tensor parallelism over a `jax.sharding.Mesh`: where every array lives, and attention per device.

The mesh has an axis "model" (tensor parallel) and optionally "data" (batch). `shard(model,
mesh)` places the parameters in the Megatron layout from one table (`LAYER_AXES`, `TOP_AXES`
-> `partition_spec`) and returns a model that carries its mesh. The model math runs unchanged
in the global view, and XLA's SPMD partitioner adds the all-reduces after the row-parallel
o/down projections and around the vocabulary-sharded embedding and LM head. Attention and
selection run inside `jax.shard_map` over KV heads (`decode_attention`, `prefill_attention`,
`prior_attention`): every device runs the same Pallas kernels on its heads, and only the rules
that cross heads communicate. A "data" axis runs the whole program per data shard (`spmd`: a
shard_map over "data" that leaves "model" to the partitioner), so each shard's rows and cache
pages stay local.

KV heads fewer than the model ranks: the cache holds each KV head on `kv_copies` =
ranks / kv_heads consecutive ranks (cache head axis kv_heads * copies, sharded over "model"),
and each of those ranks computes the whole GQA group of its KV head, then keeps its own share
of the query heads. So every rank reads exactly one KV head, and every per-KV-head rule
(Kascade's group sums, Lychee's mean query) stays local and exact; the k/v projections are then
replicated (they are 1/group of q's). Layout table and per-method collectives:
docs/architecture.md.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec as P

from sparsejax.cache import PagedKVCache, replicate_kv_heads
from sparsejax.models import Model, ModelConfig, split_layer
from sparsejax.plan import Attended, Role, Selection, attended_head_map

MODEL, DATA = "model", "data"

# Parameter name -> logical axes per dimension (None: never sharded); logical axes map to mesh
# axes in `_rules`. One layer's weights; the stacked (training) layout adds a leading layer axis.
LAYER_AXES = {
    "attn_norm": (None,), "mlp_norm": (None,), "q_norm": (None,), "k_norm": (None,),
    "wq": (None, "heads", None),                    # [H, HQ, D]  column-parallel
    "wk": (None, "kv_heads", None), "wv": (None, "kv_heads", None),
    "bq": ("heads", None), "bk": ("kv_heads", None), "bv": ("kv_heads", None),
    "wo": ("heads", None, None),                    # [HQ, D, H]  row-parallel
    "bo": (None,),
    "w_gate": (None, "mlp"), "w_up": (None, "mlp"),  # [H, I]      column-parallel
    "w_gate_up": (None, None, "mlp"),               # [H, 2, I]
    "w_down": ("mlp", None),                        # [I, H]      row-parallel
    # fused q|k|v: kept only on a "model" axis of size 1 (see `_unfuse_qkv`)
    "wqkv": (None, None, None), "bqkv": (None, None),
}
TOP_AXES = {"embed": ("vocab", None), "lm_head": (None, "vocab"), "final_norm": (None,)}
# The cache and its per-layer method state (leaf name -> logical axes). Quest's page bounds
# follow the cache's head axis; RESA's prior is per query head (mu_k per KV head).
CACHE_AXES = {
    "k": (None, "pages", "cache_heads", None, None),   # [L, num_pages, HK * copies, P, D]
    "v": (None, "pages", "cache_heads", None, None),
    "page_table": ("batch", None), "lengths": ("batch",),
    "kmin": (None, "pages", "cache_heads", None), "kmax": (None, "pages", "cache_heads", None),
    "mu_q": (None, "batch", "heads", None), "mu_k": (None, "batch", "kv_heads", None),
    "lse": (None, "batch", "heads"), "o_est": (None, "batch", "heads", None),
    "length": (None, "batch"),
}
# How each method-state leaf is indexed by head (axis 2 of its stacked [L, ...] array).
_STATE_HEADS = {"kmin": "cache", "kmax": "cache", "mu_k": "kv", "mu_q": "query", "lse": "query",
                "o_est": "query", "length": None}


# ---- the mesh --------------------------------------------------------------------------------
def tensor_parallel_mesh(size: int) -> Mesh | None:
    """A ("model",) mesh over the first `size` devices (the command line's `--tp`); None for 1."""
    if not isinstance(size, int) or not 1 <= size <= jax.device_count():
        raise ValueError(f"--tp {size!r}: expected 1 to the {jax.device_count()} devices JAX "
                         "sees")
    if size == 1:
        return None
    return jax.make_mesh((size,), (MODEL,), devices=jax.devices()[:size])


def model_size(mesh) -> int:
    return mesh.shape[MODEL]


def data_size(mesh) -> int:
    return mesh.shape.get(DATA, 1)


def kv_copies(config: ModelConfig, mesh) -> int:
    """Ranks holding each KV head: 1 when kv_heads divide over the ranks, else ranks / kv_heads."""
    m, hk = model_size(mesh), config.num_kv_heads
    return 1 if hk % m == 0 else m // hk


def check_mesh(mesh, config: ModelConfig, batch: int | None = None) -> None:
    """ValueError (TypeError for a non-mesh) naming what this mesh cannot shard."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh={mesh!r}: expected a jax.sharding.Mesh (e.g. jax.make_mesh)")
    names = tuple(mesh.axis_names)
    if MODEL not in names:
        raise ValueError(f"mesh axes {names}: expected an axis named {MODEL!r} (tensor "
                         f"parallel) and optionally {DATA!r}")
    if set(names) - {MODEL, DATA}:
        raise ValueError(f"mesh axes {names}: unknown axes {sorted(set(names) - {MODEL, DATA})}; "
                         f"expected {MODEL!r} and optionally {DATA!r}")
    m, c = model_size(mesh), config
    for name, value in (("num_attention_heads", c.num_heads), ("intermediate_size",
                        c.intermediate_size), ("vocab_size", c.vocab_size)):
        if value % m:
            raise ValueError(f"{name}={value} is not divisible by the mesh's {MODEL!r} axis "
                             f"size {m}")
    if c.num_kv_heads % m and m % c.num_kv_heads:
        raise ValueError(f"num_key_value_heads={c.num_kv_heads} neither divides over nor "
                         f"replicates onto the mesh's {MODEL!r} axis size {m}")
    if batch is not None and batch % data_size(mesh):
        raise ValueError(f"batch={batch} is not divisible by the mesh's {DATA!r} axis size "
                         f"{data_size(mesh)}")


def _rules(config: ModelConfig, mesh) -> dict:
    """Logical axis -> mesh axis."""
    data = DATA if DATA in mesh.axis_names else None
    return {"vocab": MODEL, "heads": MODEL, "mlp": MODEL, "cache_heads": MODEL,
            "kv_heads": MODEL if kv_copies(config, mesh) == 1 else None,
            "batch": data, "pages": data}


def partition_spec(axes: tuple, rules: dict) -> P:
    return P(*(rules.get(a) for a in axes))


def _leaf_name(path) -> str:
    key = path[-1]
    return str(getattr(key, "key", getattr(key, "name", key)))


def _specs(tree, table: dict, rules: dict, lead: tuple = ()):
    """The pytree of PartitionSpecs for `tree`, each leaf looked up by its name in `table`."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: partition_spec(lead + table[_leaf_name(path)], rules), tree)


def param_specs(params: dict, config: ModelConfig, mesh) -> dict:
    rules = _rules(config, mesh)
    layers = params["layers"]
    specs = {name: partition_spec(TOP_AXES[name], rules) for name in params if name != "layers"}
    if isinstance(layers, dict):       # stacked: a leading layer axis
        specs["layers"] = _specs(layers, LAYER_AXES, rules, lead=(None,))
    else:
        specs["layers"] = tuple(_specs(lp, LAYER_AXES, rules) for lp in layers)
    return specs


def cache_specs(cache: PagedKVCache, config: ModelConfig, mesh) -> PagedKVCache:
    return _specs(cache, CACHE_AXES, _rules(config, mesh))


def _named(specs, mesh) -> NamedSharding:
    """A pytree of PartitionSpecs -> the same tree of NamedShardings on `mesh`."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda x: isinstance(x, P))


def _unfuse_qkv(lp: dict, config: ModelConfig) -> dict:
    """A contiguous split of the fused q|k|v columns would hand ranks a mix of q, k and v
    heads: under a mesh they are separate weights again (gate|up stays fused: its I axis,
    the one sharded, is its own)."""
    fused = {name: lp[name] for name in ("wqkv", "bqkv") if name in lp}
    rest = {name: x for name, x in lp.items() if name not in fused}
    return {**rest, **split_layer(fused, config)}


def shard(model: Model, mesh: Mesh) -> Model:
    """`model` with its parameters placed on `mesh` (Megatron layout, see `LAYER_AXES`) and the
    mesh recorded on it, so that attention runs per device. No copy if already placed."""
    check_mesh(mesh, model.config)
    params = model.params
    if model_size(mesh) > 1 and not isinstance(params["layers"], dict):
        params = {**params, "layers": tuple(_unfuse_qkv(lp, model.config)
                                            for lp in params["layers"])}
    specs = param_specs(params, model.config, mesh)
    return model.replace(params=jax.device_put(params, _named(specs, mesh)), mesh=mesh)


def batch_spec(mesh) -> P:
    """Arrays with a leading batch axis: split over "data" when the mesh has it."""
    return P(DATA if DATA in mesh.axis_names else None)


def _explicit(mesh) -> bool:
    return any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ()))


def _current(mesh):
    """The mesh to name inside a trace: the context's (set by `spmd`) or `mesh` itself."""
    context = jax.sharding.get_abstract_mesh()
    return mesh if context.empty else context


# ---- the program per data shard ------------------------------------------------------------
def _without(spec: P, axis: str) -> P:
    return P(*(None if a == axis else a for a in spec))


def _is_spec(x) -> bool:
    return isinstance(x, P)


def spmd(fn: Callable, mesh: Mesh, args: tuple, out_specs):
    """fn(*args) on `mesh`, outputs placed by `out_specs` (PartitionSpecs over both axes, or a
    function from fn's abstract outputs to them).

    With a "data" axis, fn sees one data shard: its rows, and a cache whose pages are the
    shard's own, addressed by local page ids (the shard's rows must own the shard's pages,
    as `allocate` lays them out). "model" stays with the SPMD partitioner. Explicit meshes
    run through `jax.sharding.auto_axes`: the model math stays free of sharding annotations.
    """
    if callable(out_specs):   # fn's outputs, traced as it runs below: on auto axes
        auto = AbstractMesh(mesh.axis_sizes, mesh.axis_names,
                            (AxisType.Auto,) * len(mesh.axis_names))
        with jax.sharding.use_abstract_mesh(auto):
            out_specs = out_specs(jax.eval_shape(fn, *jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)))
    out_shardings = _named(out_specs, mesh)

    def body(*args):
        if DATA not in mesh.axis_names:
            return fn(*args)
        in_specs = tuple(_data_specs(a) for a in args)
        per_shard = jax.shard_map(_local_pages(fn), mesh=_current(mesh), in_specs=in_specs,
                                  out_specs=jax.tree.map(lambda s: _without(s, MODEL),
                                                         out_specs, is_leaf=_is_spec),
                                  axis_names={DATA}, check_vma=False)
        # traced even when called eagerly: shard_map's eager path takes every axis as manual
        return jax.jit(per_shard)(*args)

    if _explicit(mesh):
        return jax.sharding.auto_axes(body, out_sharding=out_shardings)(*args)
    return jax.lax.with_sharding_constraint(body(*args), out_shardings)


def constrain(tree, specs, mesh: Mesh):
    """Place `tree` by `specs` inside `spmd` (the data axis, if any, is already manual): a
    sharding constraint on auto axes, a reshard on explicit ones (tracing outside
    `auto_axes`, as `jax.eval_shape` of a per-shard program does)."""
    current = _current(mesh)
    manual = {n for n, t in zip(current.axis_names, current.axis_types) if t == AxisType.Manual}
    specs = jax.tree.map(lambda s: P(*(None if a in manual else a for a in s)), specs,
                         is_leaf=_is_spec)
    if _explicit(current):
        return jax.sharding.reshard(tree, specs)
    return jax.lax.with_sharding_constraint(tree, _named(specs, current))


def _data_specs(arg):
    """Specs over "data" of one argument of a per-shard program: the model is replicated,
    a cache by `CACHE_AXES`, arrays split on their leading batch axis, PRNG keys replicated."""
    rules = {"batch": DATA, "pages": DATA}
    if isinstance(arg, Model):
        return P()
    if isinstance(arg, PagedKVCache):
        return _specs(arg, CACHE_AXES, rules)
    if jnp.issubdtype(arg.dtype, jax.dtypes.prng_key) or arg.ndim == 0:
        return P()
    return P(DATA)


def _local_pages(fn):
    """Caches in and out of `fn` address this data shard's pages with local page ids."""
    def shift(x, sign):
        if not isinstance(x, PagedKVCache):
            return x
        first_page = jax.lax.axis_index(DATA) * x.num_pages
        return x.replace(page_table=x.page_table + sign * first_page)

    def run(*args):
        out = fn(*(shift(a, -1) for a in args))
        return jax.tree.map(lambda x: shift(x, 1), out,
                            is_leaf=lambda x: isinstance(x, PagedKVCache))
    return run


def allocate(make: Callable[[], PagedKVCache], config: ModelConfig, mesh: Mesh) -> PagedKVCache:
    """The empty cache `make()` laid out for `mesh`, created in place on its devices."""
    specs = cache_specs(jax.eval_shape(make), config, mesh)
    return jax.jit(make, out_shardings=_named(specs, mesh))()


# ---- attention per device ------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class HeadShards:
    """Set on a selector inside `decode_attention`: this device holds a slice of the heads, and
    `copies` consecutive devices hold each KV head. The two cross-head score rules use it."""
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
    return jax.shard_map(local, mesh=_current(mesh), in_specs=in_specs, out_specs=out_specs,
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
        return (functools.partial(heads.per_q, axis=axis), functools.partial(heads.own_q, axis=axis),
                spec)
    return None, None, P()


def decode_attention(attend: Callable, mesh) -> Callable:
    """`attend(role, plan, config, at, sel)` (the decode step's per-layer attention) run inside
    `jax.shard_map` over the KV heads of "model": each device attends with its query heads over
    its KV heads.

    In the global view the wrapper lays the head-indexed inputs out per device (the cache is
    already laid out so), gives each device a local config / plan / layer context of its own
    heads, and each device hands back the model's heads it owns in the Megatron layout, so
    nothing moves before the row-parallel o-projection. Selections per query head, and per KV
    head when the KV heads divide over the ranks, stay sharded (a head map that reads another
    device's set is gathered by the partitioner); with replicated KV heads the per-KV-head
    selections are all-gathered; shared selections are computed identically on every device
    from scores reduced across devices (`HeadShards`). On a "model" axis of size 1 there is
    nothing to split: `attend` runs as it is (so a 1-device mesh costs what no mesh does).
    """
    if model_size(mesh) == 1:
        return attend

    def run(role, plan, config, at, sel):
        copies = at.k_pages.shape[1] // config.num_kv_heads
        heads = _Heads(config, copies)
        s = plan.selector
        to_device, from_local, sel_out = _selection_routes(
            heads, None if s is None else s.groups, axis=1)
        sel_in = sel
        if role == Role.REUSE and s.groups == "kv":
            # the head map, read in the global view: the partitioner gathers what it needs
            head_map = at.step.head_map[at.layer]
            sel_in = Selection(indices=sel.indices[:, head_map], count=sel.count[:, head_map])
        if to_device is not None:
            sel_in = jax.tree.map(to_device, sel_in)
        state_in = None if at.state is None else jax.tree_util.tree_map_with_path(
            lambda path, x: _state_to_device(_leaf_name(path), x[at.layer][None], heads),
            at.state)
        retrieval = heads.per_kv(at.step.retrieval[at.layer][None])          # [1, HK * copies]
        step = at.step._replace(head_map=None, retrieval=None, capacity=None)   # static: closed over
        spec = _heads_spec(1)

        def local(q, k_pages, v_pages, table, step, retrieval, state, sel):
            hk = k_pages.shape[1]
            local_config = dataclasses.replace(config, num_heads=q.shape[1], num_kv_heads=hk)
            local_plan = plan if s is None else dataclasses.replace(
                plan, selector=dataclasses.replace(s, head_shards=HeadShards(MODEL, copies)))
            step = step._replace(retrieval=retrieval, capacity=at.step.capacity,
                                 head_map=jnp.arange(hk, dtype=jnp.int32)[None])
            # a traced layer index: the static per-layer paths read the global plan's tables
            local_at = at._replace(step=step, layer=jnp.zeros((), jnp.int32), q=q,
                                   k_pages=k_pages, v_pages=v_pages, table=table, state=state)
            out, new_sel, _ = attend(role, local_plan, local_config, local_at, sel)
            if from_local is not None:
                new_sel = jax.tree.map(from_local, new_sel)
            return heads.own_q(out), new_sel

        state_specs = None if state_in is None else jax.tree_util.tree_map_with_path(
            lambda path, _: _heads_spec(2) if _STATE_HEADS[_leaf_name(path)] else P(), state_in)
        out, new_sel = _on_devices(
            local, mesh,
            (heads.per_q(at.q), at.k_pages, at.v_pages, at.table, step, retrieval, state_in,
             sel_in),
            (spec, spec, spec, P(), P(), spec, state_specs, P() if to_device is None else spec),
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


def _state_to_device(name: str, x: jax.Array, heads: _Heads) -> jax.Array:
    """One layer's method-state leaf [1, ...] (head axis 2) in the devices' layout."""
    kind = _STATE_HEADS[name]
    if kind == "kv":
        return heads.per_kv(x, axis=2)
    if kind == "query":
        return heads.per_q(x, axis=2)
    return x           # per cache head (already laid out like the cache) or headless


def prefill_attention(attend: Callable, mesh, config: ModelConfig) -> Callable:
    """`attend(q, k_pages, v_pages, sel, *args) -> (out, new_sel)` of several query tokens per
    row (q [B, C, HQ, D]; sel and new_sel per tile and KV head [B, tiles, HK, k], or None; args
    replicated) inside `jax.shard_map` over the KV heads of "model", laid out as in
    `decode_attention`."""
    if model_size(mesh) == 1:
        return attend

    def run(q, k_pages, v_pages, sel, *args):
        heads = _Heads(config, k_pages.shape[1] // config.num_kv_heads)
        to_device, from_local, sel_out = _selection_routes(heads, "kv", axis=2)
        spec = _heads_spec(1)

        def local(q, k_pages, v_pages, sel, *args):
            out, new_sel = attend(q, k_pages, v_pages, sel, *args)
            if new_sel is not None and from_local is not None:
                new_sel = jax.tree.map(from_local, new_sel)
            return heads.own_q(out, axis=2), new_sel

        sel_in = None if sel is None else jax.tree.map(to_device, sel)
        return _on_devices(local, mesh, (heads.per_q(q, axis=2), k_pages, v_pages, sel_in) + args,
                           (_heads_spec(2), spec, spec, _heads_spec(2)) + (P(),) * len(args),
                           (_heads_spec(2), sel_out))
    return run


def prior_attention(attend: Callable, mesh, config: ModelConfig) -> Callable:
    """`attend(q, k_pages, v_pages, *args) -> (lse, out)` of one query per row and head (q
    [B, HQ, D], lse [B, HQ], out [B, HQ, D]; args replicated) inside `jax.shard_map` over the
    KV heads of "model" (RESA's prior over the cache)."""
    if model_size(mesh) == 1:
        return attend

    def run(q, k_pages, v_pages, *args):
        heads = _Heads(config, k_pages.shape[1] // config.num_kv_heads)
        spec = _heads_spec(1)

        def local(q, k_pages, v_pages, *args):
            return jax.tree.map(heads.own_q, attend(q, k_pages, v_pages, *args))

        return _on_devices(local, mesh, (heads.per_q(q), k_pages, v_pages) + args,
                           (spec, spec, spec) + (P(),) * len(args), (spec, spec))
    return run
