"""Tensor parallelism over a `jax.sharding.Mesh`: where every array lives.

The mesh has an axis "model" (tensor parallel) and optionally "data" (batch). `shard(model,
mesh)` places the parameters in the Megatron layout from one table (`LAYER_AXES`, `TOP_AXES`
-> `partition_spec`) and returns a model that carries its mesh. The model math runs unchanged
in the global view, and XLA's SPMD partitioner adds the all-reduces after the row-parallel
o/down projections and around the vocabulary-sharded embedding and LM head. Attention and
selection run inside `jax.shard_map` over KV heads (`sparsejax.sharded_attention`): every
device runs the same Pallas kernels on its heads, and only the rules that cross heads
communicate. A "data" axis runs the whole program per data shard (`spmd`: a
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

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec as P

from sparsejax import cache, models
from sparsejax.cache import PagedKVCache
from sparsejax.models import Model, ModelConfig, split_layer

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
    # an fp8 cache's scales, one per (token, KV head): laid out like k / v
    "k_scale": (None, "pages", "cache_heads", None),
    "v_scale": (None, "pages", "cache_heads", None),
    "page_table": ("batch", None), "lengths": ("batch",),
    "kmin": (None, "pages", "cache_heads", None), "kmax": (None, "pages", "cache_heads", None),
    "mu_q": (None, "batch", "heads", None), "mu_k": (None, "batch", "kv_heads", None),
    "lse": (None, "batch", "heads"), "o_est": (None, "batch", "heads", None),
    "length": (None, "batch"),
}
# How each method-state leaf is indexed by head (axis 2 of its stacked [L, ...] array).
STATE_HEADS = {"kmin": "cache", "kmax": "cache", "mu_k": "kv", "mu_q": "query", "lse": "query",
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
            hint = ("; pad the embedding and LM head to a multiple of it (the padded logits are "
                    "never sampled) or pick a mesh size that divides it"
                    if name == "vocab_size" else "")
            raise ValueError(f"{name}={value} is not divisible by the mesh's {MODEL!r} axis "
                             f"size {m}{hint}")
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


def leaf_name(path) -> str:
    key = path[-1]
    return str(getattr(key, "key", getattr(key, "name", key)))


def _specs(tree, table: dict, rules: dict, lead: tuple = ()):
    """The pytree of PartitionSpecs for `tree`, each leaf looked up by its name in `table`."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: partition_spec(lead + table[leaf_name(path)], rules), tree)


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
    mesh recorded on it, so that attention runs per device. No copy if already placed.
    (`from_pretrained(..., mesh=mesh)` places a checkpoint's weights from the host instead.)"""
    check_mesh(mesh, model.config)
    c, layers = model.config, model.params["layers"]
    top = place({name: x for name, x in model.params.items() if name != "layers"}, c, mesh)
    if isinstance(layers, dict):       # stacked: a leading layer axis
        specs = _specs(layers, LAYER_AXES, _rules(c, mesh), lead=(None,))
        layers = jax.device_put(layers, _named(specs, mesh))
    else:
        layers = tuple(place(lp, c, mesh, layer=True) for lp in layers)
    return model.replace(params={**top, "layers": layers}, mesh=mesh)


def from_pretrained(path_or_id, *, mesh: Mesh | None = None, **kwargs) -> Model:
    """`models.from_pretrained` (same arguments); with `mesh`, each weight goes from the host
    straight to its shards, as `shard` lays them out, and the mesh is recorded on the model:
    no unsharded copy on the first device, whose freed space would sit below its shards."""
    if mesh is None:
        return models.from_pretrained(path_or_id, **kwargs)

    def placement(config):
        check_mesh(mesh, config)
        return lambda weights, layer=False: place(weights, config, mesh, layer=layer)

    return models.from_pretrained(path_or_id, placement=placement, **kwargs).replace(mesh=mesh)


def place(weights: dict, config: ModelConfig, mesh: Mesh, *, layer: bool = False) -> dict:
    """One layer's weights (`layer`) or the top-level ones (embedding, final norm, LM head),
    on the host or a device, placed on `mesh` as `shard` lays them out."""
    rules = _rules(config, mesh)
    if not layer:
        specs = {name: partition_spec(TOP_AXES[name], rules) for name in weights}
    else:
        if model_size(mesh) > 1:
            weights = _unfuse_qkv(weights, config)
        specs = _specs(weights, LAYER_AXES, rules)
    return jax.device_put(weights, _named(specs, mesh))


def batch_spec(mesh) -> P:
    """Arrays with a leading batch axis: split over "data" when the mesh has it."""
    return P(DATA if DATA in mesh.axis_names else None)


def _explicit(mesh) -> bool:
    return any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ()))


def current_mesh(mesh):
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
        per_shard = jax.shard_map(_local_pages(fn), mesh=current_mesh(mesh), in_specs=in_specs,
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
    current = current_mesh(mesh)
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


def allocate(config: ModelConfig | Model, batch: int, capacity: int, *, mesh=None,
             **kwargs) -> PagedKVCache:
    """`sparsejax.cache.allocate`, laid out for tensor parallelism on `mesh` when one is given:
    created in place on its devices, each KV head stored `kv_copies` times when the mesh has
    more model ranks than KV heads."""
    if mesh is None:
        return cache.allocate(config, batch, capacity, **kwargs)
    config, kwargs["dtype"] = cache.config_and_dtype(config, kwargs.get("dtype"))
    check_mesh(mesh, config, batch)
    make = lambda: cache.allocate(  # noqa: E731
        config, batch, capacity, kv_copies=kv_copies(config, mesh), head_shards=model_size(mesh),
        page_shards=data_size(mesh), **kwargs)
    specs = cache_specs(jax.eval_shape(make), config, mesh)
    return jax.jit(make, out_shardings=_named(specs, mesh))()
