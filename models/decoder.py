"""One decoder for Llama, Qwen2, Qwen3 and Mistral, in stage order.

config -> params -> rope/norm -> attention inputs -> block -> forward over the stack.

`params["layers"]` comes in two layouts: a tuple of per-layer dicts (what `from_pretrained`
returns: every weight its own buffer, so a decode step's unrolled layer loop reads each weight
in place, once) or one dict stacked on a leading layer axis (what training scans over).
`layer_params`, `unstack_layers` and `stack_layers` move between them. The functions here are
the model's math only; the paged cache and decode-time attention live in `sparsejax`, which
calls `attention_inputs` / `finish_layer` per layer.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from .config import ModelConfig, rope_inv_freq

Params = dict[str, Any]


@flax.struct.dataclass
class Model:
    config: ModelConfig = flax.struct.field(pytree_node=False)
    params: Params
    # the jax.sharding.Mesh the params are placed on (`sparsejax.shard`), else None
    mesh: Any = flax.struct.field(pytree_node=False, default=None)

    @property
    def dtype(self):
        return self.params["embed"].dtype


# ---- params ---------------------------------------------------------------------------------
def param_shapes(config: ModelConfig) -> Params:
    """Shapes of every parameter (the stacked layout). Optional tensors appear only when used."""
    c = config
    L, H, Q, K, D, I = (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                        c.intermediate_size)
    layers = {
        "attn_norm": (L, H), "wq": (L, H, Q, D), "wk": (L, H, K, D), "wv": (L, H, K, D),
        "wo": (L, Q, D, H), "mlp_norm": (L, H), "w_gate": (L, H, I), "w_up": (L, H, I),
        "w_down": (L, I, H),
    }
    if c.qkv_bias:
        layers.update(bq=(L, Q, D), bk=(L, K, D), bv=(L, K, D))
    if c.o_bias:
        layers["bo"] = (L, H)
    if c.qk_norm:
        layers.update(q_norm=(L, D), k_norm=(L, D))
    shapes = {"embed": (c.vocab_size, H), "final_norm": (H,), "layers": layers}
    if not c.tie_word_embeddings:
        shapes["lm_head"] = (H, c.vocab_size)
    return shapes


def init_params(config: ModelConfig, key: jax.Array, dtype=jnp.float32,
                std: float = 0.02) -> Params:
    """Random params as HF initialises them: normal(std) matrices, zero biases, unit norms
    (stacked layout; `unstack_layers` gives the decode layout)."""
    shapes = param_shapes(config)
    flat, treedef = jax.tree.flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(key, len(flat))
    leaves = []
    for (path, shape), k in zip(flat, keys):
        name = path[-1].key
        if name.endswith("norm"):
            leaves.append(jnp.ones(shape, dtype))
        elif name in ("bq", "bk", "bv", "bo"):
            leaves.append(jnp.zeros(shape, dtype))
        else:
            leaves.append((std * jax.random.normal(k, shape, jnp.float32)).astype(dtype))
    return jax.tree.unflatten(treedef, leaves)


# ---- the two layer layouts ------------------------------------------------------------------
# The per-layer layout concatenates the weights that read the same input, so one matmul does
# the work of several: at batch 1 one fused projection streams its weights far faster than
# separate q/k/v ones (docs/tuning.md).
#   wqkv [H, HQ + 2 HK, D] = wq | wk | wv,  bqkv [HQ + 2 HK, D],  w_gate_up [H, 2, I]


def _array_module(lp: Params):
    """numpy for a layer of host weights (kept on the host), else jax.numpy."""
    return np if all(isinstance(x, np.ndarray) for x in lp.values()) else jnp


def fuse_layer(lp: Params) -> Params:
    """One layer's separate q/k/v and gate/up weights -> the fused per-layer form. Host
    (numpy) weights are fused on the host: a checkpoint's layers then reach the device as
    the buffers they stay in, without pieces freed between them."""
    lp = dict(lp)
    xp = _array_module(lp)
    if "wq" in lp:
        lp["wqkv"] = xp.concatenate([lp.pop("wq"), lp.pop("wk"), lp.pop("wv")], axis=1)
    if "bq" in lp:
        lp["bqkv"] = xp.concatenate([lp.pop("bq"), lp.pop("bk"), lp.pop("bv")], axis=0)
    if "w_gate" in lp:
        lp["w_gate_up"] = xp.stack([lp.pop("w_gate"), lp.pop("w_up")], axis=1)
    return lp


def split_layer(lp: Params, config: ModelConfig) -> Params:
    """The inverse of `fuse_layer` (a layer already split is returned as it is; host weights
    are split on the host)."""
    lp = dict(lp)
    xp = _array_module(lp)
    cuts = [config.num_heads, config.num_heads + config.num_kv_heads]
    if "wqkv" in lp:
        lp["wq"], lp["wk"], lp["wv"] = xp.split(lp.pop("wqkv"), cuts, axis=1)
    if "bqkv" in lp:
        lp["bq"], lp["bk"], lp["bv"] = xp.split(lp.pop("bqkv"), cuts, axis=0)
    if "w_gate_up" in lp:
        gate_up = lp.pop("w_gate_up")
        lp["w_gate"], lp["w_up"] = gate_up[:, 0], gate_up[:, 1]
    return lp


def is_stacked(params: Params) -> bool:
    """True when `params["layers"]` is one dict stacked on a leading layer axis."""
    return isinstance(params["layers"], dict)


def layer_params(params: Params, layer) -> Params:
    """Layer `layer`'s parameters from either layout (a Python int for the per-layer one)."""
    layers = params["layers"]
    return jax.tree.map(lambda x: x[layer], layers) if is_stacked(params) else layers[layer]


def unstack_layers(params: Params) -> Params:
    """The per-layer layout: a tuple of fused per-layer dicts (copies the weights once)."""
    if not is_stacked(params):
        return params
    num_layers = jax.tree.leaves(params["layers"])[0].shape[0]
    return {**params, "layers": tuple(fuse_layer(layer_params(params, i))
                                      for i in range(num_layers))}


def stack_layers(params: Params, config: ModelConfig) -> Params:
    """The stacked layout: one dict of separate weights with a leading layer axis (copies the
    weights once)."""
    if is_stacked(params):
        return params
    layers = [split_layer(lp, config) for lp in params["layers"]]
    return {**params, "layers": jax.tree.map(lambda *xs: jnp.stack(xs), *layers)}


# ---- norm and rope --------------------------------------------------------------------------
def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in fp32, cast back before the weight (as transformers does)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def rope_angles(config: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin [..., head_dim] in fp32 for integer positions [...]."""
    inv_freq = jnp.asarray(rope_inv_freq(config), jnp.float32)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [..., heads, D] with cos/sin [..., D] (HF's rotate_half convention)."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    out = (x.astype(jnp.float32) * cos[..., None, :]
           + rotated.astype(jnp.float32) * sin[..., None, :])
    return out.astype(x.dtype)


def _dot(spec: str, x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
    """einsum(spec) of activations x [..., contracted dims] and a weight, accumulated in f32,
    in x's dtype or `out_dtype`.

    A single row (batch 1 at decode) goes in as two, the second zeros, and comes out as one:
    XLA turns a one-row dot into a multiply and a reduce (weights under ~10M elements) or a
    slower gemm, where two rows take the faster gemm of larger batches (docs/tuning.md).
    Every row is its own dot, so the row's result does not change."""
    contracted = len(spec.split(",")[0].removeprefix("..."))
    lead = x.shape[:x.ndim - contracted]
    single = math.prod(lead) == 1
    if single:
        x = x.reshape(1, *x.shape[len(lead):])
        x = jnp.pad(x, ((0, 1),) + ((0, 0),) * contracted)
    y = jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)
    y = y.astype(x.dtype if out_dtype is None else out_dtype)
    return y[:1].reshape(*lead, *y.shape[1:]) if single else y


def normed_dot(spec: str, h: jax.Array, norm_weight: jax.Array, eps: float,
               w: jax.Array) -> jax.Array:
    """`_dot(spec, rms_norm(h, norm_weight, eps), w)`: a pre-norm projection."""
    return _dot(spec, rms_norm(h, norm_weight, eps), w)


# ---- one block ------------------------------------------------------------------------------
def attention_inputs(config: ModelConfig, lp: Params, h: jax.Array, positions: jax.Array):
    """Pre-norm, q/k/v projections, optional bias and q/k norm, RoPE.

    h [..., H], positions [...] -> q [..., HQ, D], k [..., HK, D], v [..., HK, D]
    """
    if "wqkv" in lp:
        q, k, v = split_qkv(config, qkv_projection(config, lp, h))
    else:
        x = rms_norm(h, lp["attn_norm"], config.rms_norm_eps)
        q, k, v = (_dot("...h,hnd->...nd", x, lp[name]) for name in ("wq", "wk", "wv"))
        if config.qkv_bias:
            q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    q, k = position_heads(config, lp, q, k, *rope_angles(config, positions))
    return q, k, v


def qkv_projection(config: ModelConfig, lp: Params, h: jax.Array,
                   project=normed_dot) -> jax.Array:
    """Pre-norm, the fused q/k/v projection (`lp["wqkv"]`, the per-layer layout) and its
    optional bias: h [..., H] -> [..., HQ + 2 HK, D], the query heads, then the key heads,
    then the value heads. `project(spec, h, norm_weight, eps, w)`: the product of
    rms_norm(h) and w (`normed_dot`; a batch-1 decode step may pass a split-K kernel's that
    norms as it loads)."""
    qkv = project("...h,hnd->...nd", h, lp["attn_norm"], config.rms_norm_eps, lp["wqkv"])
    return qkv + lp["bqkv"] if config.qkv_bias else qkv


def split_qkv(config: ModelConfig, qkv: jax.Array):
    """[..., HQ + 2 HK, D] -> q [..., HQ, D], k [..., HK, D], v [..., HK, D]."""
    return jnp.split(qkv, [config.num_heads, config.num_heads + config.num_kv_heads], axis=-2)


def position_heads(config: ModelConfig, lp: Params, q: jax.Array, k: jax.Array,
                   cos: jax.Array, sin: jax.Array):
    """q, k with their optional per-head RMSNorm (Qwen3's q/k norm), then RoPE (`cos`, `sin`
    of `rope_angles`)."""
    if config.qk_norm:
        q = rms_norm(q, lp["q_norm"], config.rms_norm_eps)
        k = rms_norm(k, lp["k_norm"], config.rms_norm_eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def finish_layer(config: ModelConfig, lp: Params, h: jax.Array, attn: jax.Array,
                 dot=_dot) -> jax.Array:
    """Output projection + residual, then the SwiGLU MLP block + residual.

    h [..., H], attn [..., HQ, D] -> h [..., H]. `dot(spec, x, w)`: the projections' product
    (`_dot`; a batch-1 decode step may pass a split-K kernel's).
    """
    h = h + attention_projection(config, lp, attn, dot)
    x = rms_norm(h, lp["mlp_norm"], config.rms_norm_eps)
    if "w_gate_up" in lp:
        gate_up = dot("...h,hti->...ti", x, lp["w_gate_up"])
        gate, up = gate_up[..., 0, :], gate_up[..., 1, :]
    else:
        gate = dot("...h,hi->...i", x, lp["w_gate"])
        up = dot("...h,hi->...i", x, lp["w_up"])
    return h + dot("...i,ih->...h", jax.nn.silu(gate) * up, lp["w_down"])


def attention_projection(config: ModelConfig, lp: Params, attn: jax.Array,
                         dot=_dot) -> jax.Array:
    """attn [..., HQ, D] -> [..., H] (o_proj; `dot` as in `finish_layer`)."""
    out = dot("...nd,ndh->...h", attn.astype(lp["wo"].dtype), lp["wo"])
    return out + lp["bo"] if config.o_bias else out


def token_ids(ids, vocab_size: int, name: str = "input_ids") -> jax.Array:
    """`ids` as int32, refused unless they are integers in [0, vocab_size).

    The range is checked only where the ids are concrete. Traced ids (inside a jit) are taken
    as they are: an id >= vocab_size then embeds as NaN and a negative one wraps around.
    """
    if isinstance(ids, jax.core.Tracer):
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise ValueError(f"{name} has dtype {ids.dtype}: expected integer token ids")
        return ids.astype(jnp.int32)
    host = np.asarray(ids)
    if host.size and not np.issubdtype(host.dtype, np.integer):
        raise ValueError(f"{name} has dtype {host.dtype} (e.g. {host.flat[0]!r}): expected "
                         "integer token ids")
    bad = host[(host < 0) | (host >= vocab_size)]
    if bad.size:
        raise ValueError(f"{name} holds ids {np.unique(bad)[:8].tolist()} outside the "
                         f"vocabulary [0, {vocab_size})")
    return jnp.asarray(host, jnp.int32)


def embed(model: Model, tokens: jax.Array) -> jax.Array:
    return jnp.take(model.params["embed"], tokens, axis=0)


def unembed(model: Model, h: jax.Array) -> jax.Array:
    """Final norm and LM head -> float32 logits [..., vocab]."""
    p, c = model.params, model.config
    x = rms_norm(h, p["final_norm"], c.rms_norm_eps)
    w = p["embed"].T if c.tie_word_embeddings else p["lm_head"]
    return _dot("...h,hv->...v", x, w, out_dtype=jnp.float32)


# ---- full-sequence forward ------------------------------------------------------------------
class ForwardOutput(NamedTuple):
    hidden: jax.Array        # [B, T, H] final hidden states (before the final norm)
    keys: jax.Array          # [L, B, T, HK, D] post-RoPE keys, for the KV cache
    values: jax.Array        # [L, B, T, HK, D]
    query_means: jax.Array   # [L, B, HQ, D] fp32 mean post-RoPE query over each row's length


def attention_implementation(dtype, head_dim: int) -> str | None:
    """cuDNN's flash attention for bf16/f16 on GPU (it never holds the [T, T] scores, which
    training at long context cannot afford), else XLA (`implementation=None` is always XLA)."""
    if (jax.default_backend() == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
            and head_dim % 8 == 0 and head_dim <= 128):
        return "cudnn"
    return None


def forward(model: Model, input_ids: jax.Array, lengths: jax.Array | None = None) -> ForwardOutput:
    """Dense causal forward of right-padded rows `input_ids [B, T]` with true `lengths [B]`.

    Attention is `jax.nn.dot_product_attention` (cuDNN on GPU for bf16/f16, XLA otherwise).
    Positions at or past a row's length compute garbage that no valid position reads.
    """
    c = model.config
    B, T = input_ids.shape
    if lengths is None:
        lengths = jnp.full((B,), T, jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    valid = (positions < lengths[:, None]).astype(jnp.float32)

    def layer(h, lp):
        with jax.named_scope("attention"):
            q, k, v = attention_inputs(c, lp, h, positions)
            attn = jax.nn.dot_product_attention(
                q, k, v, is_causal=True, key_value_seq_lengths=lengths.astype(jnp.int32),
                implementation=attention_implementation(q.dtype, c.head_dim))
            q_mean = jnp.einsum("btnd,bt->bnd", q.astype(jnp.float32), valid) / jnp.maximum(
                lengths, 1)[:, None, None].astype(jnp.float32)
        with jax.named_scope("mlp"):
            h = finish_layer(c, lp, h, attn)
        return h, (k, v, q_mean)

    h = embed(model, input_ids)
    if is_stacked(model.params):
        h, (ks, vs, q_means) = jax.lax.scan(layer, h, model.params["layers"])
    else:
        per_layer = []
        for lp in model.params["layers"]:
            h, out = layer(h, lp)
            per_layer.append(out)
        ks, vs, q_means = (jnp.stack(xs) for xs in zip(*per_layer))
    return ForwardOutput(h, ks, vs, q_means)


def logits(model: Model, input_ids: jax.Array) -> jax.Array:
    """Dense full-sequence forward -> float32 logits [B, T, vocab].

    Concrete `input_ids` must be integer ids in [0, vocab) (see `token_ids`)."""
    input_ids = token_ids(input_ids, model.config.vocab_size)
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids has shape {input_ids.shape}: expected [batch, seq]")
    model.config.check_context(input_ids.shape[1])
    return _logits(model, input_ids)


@jax.jit
def _logits(model: Model, input_ids: jax.Array) -> jax.Array:
    return unembed(model, forward(model, input_ids).hidden)


def cast_params(params: Params, dtype) -> Params:
    return jax.tree.map(lambda x: x.astype(dtype), params)


def num_params(params: Params) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))
