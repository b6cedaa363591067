"""Model shapes, random weights, filled caches and the methods the benchmarks run.

Random bf16 weights and random K/V: a decode step's cost does not depend on what the numbers
say, only on the shapes, the lengths and the selections' sizes.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

MODELS = {
    # DeepSeek-R1-Distill-Qwen-1.5B
    "qwen-1.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=1536, num_layers=28,
                      num_heads=12, num_kv_heads=2, head_dim=128, intermediate_size=8960,
                      rope_theta=10000.0, tie_word_embeddings=False, qkv_bias=True,
                      max_position_embeddings=131072),
    # Llama-3.1-8B (RoPE scaling does not change the cost)
    "llama-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, num_layers=32,
                     num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336,
                     rope_theta=500000.0, tie_word_embeddings=False,
                     max_position_embeddings=131072),
    # DeepSeek-R1-Distill-Qwen-7B / -14B (DELTA's Figure 5 models)
    "qwen-7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, num_layers=28,
                    num_heads=28, num_kv_heads=4, head_dim=128, intermediate_size=18944,
                    rope_theta=10000.0, tie_word_embeddings=False, qkv_bias=True,
                    max_position_embeddings=131072),
    "qwen-14b": dict(model_type="qwen2", vocab_size=152064, hidden_size=5120, num_layers=48,
                     num_heads=40, num_kv_heads=8, head_dim=128, intermediate_size=13824,
                     rope_theta=10000.0, tie_word_embeddings=False, qkv_bias=True,
                     max_position_embeddings=131072),
    "tiny-tp": dict(model_type="qwen2", vocab_size=512, hidden_size=128, num_layers=6,
                    num_heads=8, num_kv_heads=4, head_dim=32, intermediate_size=256,
                    qkv_bias=True, max_position_embeddings=4096),
    "tiny": dict(model_type="qwen2", vocab_size=512, hidden_size=128, num_layers=6,
                 num_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=256,
                 qkv_bias=True, max_position_embeddings=4096),
}

# (model, batch, context, methods) for benchmarks/profile_step.py
PROFILE_CASES = [
    ("qwen-1.5b", 64, 1024, ["dense"]),
    ("qwen-1.5b", 1, 32768, ["dense", "delta"]),    # a small model's step, kernel by kernel
    ("qwen-1.5b", 64, 16384, ["dense", "delta"]),
    ("llama-8b", 1, 4096, ["dense"]),
    ("llama-8b", 1, 131072, ["dense", "delta", "kascade", "lychee"]),
]
SMOKE_PROFILE = [("tiny", 2, 256, ["dense", "kascade", "lychee"])]

METHOD_NAMES = ("dense", "delta", "kascade", "lychee", "quest", "delta+resa")


def config(name: str):
    """The shapes of MODELS[name]; "name@N" keeps only N of its layers (a cache that fits one
    GPU at batches where the whole model's would not)."""
    from sparsejax.models import ModelConfig

    base, _, layers = name.partition("@")
    if base not in MODELS or (layers and not layers.isdigit()):
        raise ValueError(f"model {name!r}: expected one of {sorted(MODELS)}, optionally with "
                         "@<layers>")
    return ModelConfig(**{**MODELS[base], **({"num_layers": int(layers)} if layers else {})})


@functools.partial(jax.jit, static_argnames=("shapes", "dtype", "fuse"))
def _draw(key, *, shapes: tuple, dtype, fuse: bool):
    """{name: weight} for (name, shape) pairs: norms 1, the rest N(0, 0.02) in `dtype`; `fuse`:
    one layer's weights in the fused per-layer form (`fuse_layer`)."""
    from sparsejax.models import fuse_layer

    keys = jax.random.split(key, len(shapes))
    out = {name: jnp.ones(shape, dtype) if name.endswith("norm")
           else 0.02 * jax.random.normal(k, shape, dtype) for (name, shape), k in zip(shapes, keys)}
    return fuse_layer(out) if fuse else out


def random_model(name: str, dtype=jnp.bfloat16, seed: int = 0, stacked: bool = False,
                 mesh=None):
    """A model of these shapes with N(0, 0.02) weights drawn directly in `dtype`, in the
    per-layer layout `from_pretrained` returns (or stacked, as training holds it); with a
    `mesh`, each layer placed on it as it is drawn (`sparsejax.shard`'s layout).

    Drawn a layer at a time straight into that layout: each draw's temporaries are one
    layer's, and no stacked copy is freed beneath the weights. (One draw of the whole model
    left a free block the size of its temporaries below the weights in the GPU allocator's
    pool, so a cache that fills the rest of the GPU found no contiguous block for its K or V.)"""
    import sparsejax
    from sparsejax import sharding
    from sparsejax.models import param_shapes

    c = config(name)
    put = ((lambda w, layer=False: w) if mesh is None
           else (lambda w, layer=False: sharding.place(w, c, mesh, layer=layer)))
    shapes = param_shapes(c)
    key = jax.random.key(seed)
    top = tuple((k, v) for k, v in shapes.items() if k != "layers")
    params = put(_draw(jax.random.fold_in(key, c.num_layers), shapes=top, dtype=dtype,
                       fuse=False))
    if stacked:
        params["layers"] = _draw(key, shapes=tuple(shapes["layers"].items()), dtype=dtype,
                                 fuse=False)
        model = sparsejax.Model(c, params)
        return model if mesh is None else sparsejax.shard(model, mesh)
    layer = tuple((k, v[1:]) for k, v in shapes["layers"].items())
    params["layers"] = tuple(put(_draw(jax.random.fold_in(key, i), shapes=layer, dtype=dtype,
                                       fuse=True), layer=True) for i in range(c.num_layers))
    return sparsejax.Model(c, params, mesh=mesh)


def weight_bytes(model) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(model.params))


# Filled a layer at a time into the donated cache: the temporaries are one layer's, so a
# cache that fills the GPU beside the model can be built.
@functools.partial(jax.jit, donate_argnums=0)
def _fill_layer(x, scale, layer, key):
    """Layer `layer` of a cache array (and, for fp8, of its scales) with random N(0, 1) values,
    quantized as the cache stores them."""
    from sparsejax import cache as kv

    values = jax.random.normal(key, x.shape[1:], jnp.bfloat16)
    if scale is None:
        return x.at[layer].set(values.astype(x.dtype)), None
    q, s = kv.quantize_kv(values)
    return x.at[layer].set(q), scale.at[layer].set(s)


def random_cache(config, plan, batch: int, context: int, extra: int, key, dtype=jnp.bfloat16,
                 kv_dtype=None):
    """A cache of `context + extra` tokens per row holding `context` random tokens (and random
    RESA priors / Quest bounds when the plan keeps them); `kv_dtype` as `allocate` takes it."""
    from sparsejax import cache as kv

    c = kv.allocate(config, batch, context + extra, page_size=plan.page_size, dtype=dtype,
                    kv_dtype=kv_dtype)
    fill_key, state_key = jax.random.split(key)
    k, v, k_scale, v_scale = c.k, c.v, c.k_scale, c.v_scale
    for layer in range(config.num_layers):
        keys = jax.random.split(jax.random.fold_in(fill_key, layer))
        k, k_scale = _fill_layer(k, k_scale, layer, keys[0])
        v, v_scale = _fill_layer(v, v_scale, layer, keys[1])
    c = c.replace(k=k, v=v, k_scale=k_scale, v_scale=v_scale,
                  lengths=jnp.full((batch,), context, jnp.int32))
    return c.replace(state=random_state(config, plan, c, context, state_key))


def random_state(config, plan, cache, context, key):
    """Per-layer method state of the right shapes with plausible random values: RESA priors
    and Quest's page key bounds."""
    from sparsejax.cache import MethodState
    from sparsejax.resa import Prior

    if plan.selector is None:
        return None
    L, B = config.num_layers, cache.lengths.shape[0]
    HQ, HK, D = config.num_heads, config.num_kv_heads, config.head_dim
    ks = jax.random.split(key, 6)
    kmin = kmax = prior = None
    if plan.selector.score == "quest_bound":
        k = jax.random.normal(ks[4], (L, cache.num_pages, HK, D), jnp.float32)
        kmin, kmax = k - 1.0, k + 1.0
    if plan.residual is not None:
        prior = Prior(mu_q=jax.random.normal(ks[0], (L, B, HQ, D)),
                      mu_k=jax.random.normal(ks[1], (L, B, HK, D)),
                      lse=10 + jax.random.normal(ks[2], (L, B, HQ)),
                      o_est=jax.random.normal(ks[3], (L, B, HQ, D)),
                      length=jnp.full((L, B), context, jnp.int32))
    if kmin is None and prior is None:
        return None
    return MethodState(prior=prior, kmin=kmin, kmax=kmax)


def method(name: str, config, context: int, ratio: float = 0.1):
    """The benchmark's version of each method for a model of this depth.

    delta: the paper's Δ-layers scaled to the depth, 64 pages of 16 (1024 tokens); delta@pP:
      pages of P tokens, as many as make 1024 tokens
    kascade: 5 anchors scaled to the depth, 10% of the context (at least 128)
    lychee: layer 0 all retrieval and 1/8 of the other (layer, KV head) pairs retrieval heads,
      TopK(4096) tokens, 128 sinks, 256 recent
    quest: 1024-token budget, first 2 layers dense
    """
    from sparsejax import methods as M

    L = config.num_layers
    base, _, page_size = name.removesuffix("+resa").partition("@p")
    if page_size and base != "delta":
        raise ValueError(f"method {name!r}: only delta takes @pP (pages of P tokens)")
    if base == "dense":
        m = M.Dense()
    elif base == "delta":
        p = int(page_size or 16)
        m = M.DELTA(page_size=p, budget_pages=1024 // p).scaled_to(L)
    elif base == "kascade":
        m = M.Kascade(ratio=ratio).scaled_to(L)
    elif base == "lychee":
        m = M.Lychee(lychee_heads(config), budget=M.TopK(4096))
    elif base == "quest":
        m = M.Quest(token_budget=1024)
    else:
        raise ValueError(f"method {name!r}: expected one of {METHOD_NAMES} "
                         "(delta@pP: DELTA with pages of P tokens)")
    return M.RESA(m) if name.endswith("+resa") else m


def lychee_heads(config) -> np.ndarray:
    """~1/8 of the (layer >= 1, KV head) pairs as retrieval heads, spread evenly."""
    L, HK = config.num_layers, config.num_kv_heads
    mask = np.zeros((L, HK), bool)
    mask[0] = True
    count = max(1, (L - 1) * HK // 8)
    flat = np.linspace(0, (L - 1) * HK - 1, count).round().astype(int)
    mask[1:].reshape(-1)[flat] = True
    return mask
