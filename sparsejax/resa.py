"""RESA: add back the unselected prefill keys' contribution from a rank-1 prior (the
derivation, and why this form is stable: docs/architecture.md, section RESA).

Prior per layer and query head, computed once at the end of prefill (fp32):
  mu_q   mean post-RoPE prompt query,  mu_k  mean prompt key (per KV head),
  P_j = mu_q·k_j/sqrt(d),  lse = LSE_j(P_j),  o_est = softmax(P) V.
At a sparse head with selected set I (real logits s_j, output o_sa, log-normaliser lse_sa):
  b = (q - mu_q)·mu_k/sqrt(d)                     first-order correction of the logits
  x = LSE_{j in I, j < prefill}(P_j) - lse         (the kernel's prior partial, <= 0)
  A = log(lam) + b + lse
  lse_rest = A + log1mexp(x);  lse' = logaddexp(lse_sa, lse_rest)
  o = e^{A - lse'} (o_est - e^x o_I) + e^{lse_sa - lse'} o_sa
lam = 0 gives the base method exactly (A = -inf); I = every prefill key gives x = 0, so
log1mexp(0) = -inf and the output is the exact sparse (= dense) one.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from sparsejax import sharded_attention
from sparsejax.cache import flat_pages, query_dtype, rounded_to
from sparsejax.models.decoder import ForwardOutput
from sparsejax.pallas_kernels import paged_decode_attention


class Prior(NamedTuple):
    mu_q: jax.Array    # [B, HQ, D] f32
    mu_k: jax.Array    # [B, HK, D] f32
    lse: jax.Array     # [B, HQ] f32
    o_est: jax.Array   # [B, HQ, D] f32
    length: jax.Array  # [B] int32 prompt length the prior covers


def init_prior(out: ForwardOutput, lengths: jax.Array, q_dtype=jnp.float32) -> Prior:
    """Stacked [L, ...] priors from the prompt's forward pass (each row over its own length;
    its keys and values as cached, `cache.as_stored`). mu_q is rounded to `q_dtype`, the dtype
    the kernels read it in for the selected keys' part of the prior (x in the module
    docstring): that part and lse must see the same logits, as o_est - e^x o_I cancels."""
    def layer(xs):
        mu_q, k, v = xs                                   # [B,HQ,D], [B,T,HK,D], [B,T,HK,D]
        k, v = k.astype(jnp.float32), v.astype(jnp.float32)
        valid = (jnp.arange(k.shape[1])[None, :] < lengths[:, None]).astype(jnp.float32)
        mu_k = jnp.einsum("btkd,bt->bkd", k, valid) / lengths[:, None, None].astype(jnp.float32)
        # one query per row: out [B, 1, HQ, D], residual (log-sum-exp) [B, 1, HQ]
        # f32's precision: XLA's default for f32 dots on the GPU is lower
        with jax.default_matmul_precision("highest"):
            o_est, lse = jax.nn.dot_product_attention(
                mu_q[:, None], k, v, key_value_seq_lengths=lengths, return_residual=True,
                implementation="xla")
        return mu_k, lse[:, 0], o_est[:, 0]
    mu_q = rounded_to(out.query_means.astype(jnp.float32), q_dtype)
    mu_k, lse, o_est = jax.lax.map(layer, (mu_q, out.keys, out.values))
    L = out.keys.shape[0]
    return Prior(mu_q, mu_k, lse, o_est, jnp.broadcast_to(lengths, (L,) + lengths.shape))


def prior_from_cache(model, cache, mu_q: jax.Array, mu_k: jax.Array, length: jax.Array) -> Prior:
    """Stacked [L, ...] priors from the paged cache: mu_q [L, B, HQ, D] and mu_k [L, B, HK, D]
    (f32 means over each row's first `length` [B] tokens) with lse and o_est attended over
    those tokens by the paged decode kernel (chunked prefill; re-folding after a correction);
    mu_q rounded to the kernels' query dtype, as in `init_prior`."""
    pages = flat_pages(cache)
    q_dtype = query_dtype(pages.k.dtype, model.dtype)
    mu_q = rounded_to(mu_q, q_dtype)

    def attend(q, pages, table, length):
        r = paged_decode_attention(q, pages.k, pages.v, table, length, **pages.scales(),
                                   out_dtype=jnp.float32)   # o_est unrounded, as init_prior's
        return r.lse, r.out

    if model.mesh is not None:
        attend = sharded_attention.prior_attention(attend, model.mesh, model.config)
    lse, o_est = [], []
    for layer in range(mu_q.shape[0]):
        r = attend(mu_q[layer].astype(q_dtype), pages,
                   cache.page_table + layer * cache.num_pages, length)
        lse.append(r[0])
        o_est.append(r[1])
    L = mu_q.shape[0]
    return Prior(mu_q, mu_k, jnp.stack(lse), jnp.stack(o_est),
                 jnp.broadcast_to(length, (L,) + length.shape))


def layer_prior(state, layer: jax.Array) -> Prior:
    """Layer `layer`'s prior from the cache's `MethodState`."""
    return jax.tree.map(lambda x: x[layer], state.prior)


def prior_length(plan, prior: Prior, lengths: jax.Array) -> jax.Array:
    """Keys the prior covers: the prompt, or everything once decode tokens are folded in."""
    return lengths if plan.residual.fold_decode_tokens else prior.length


def log1mexp(x: jax.Array) -> jax.Array:
    """log(1 - e^x) for x <= 0, accurate near 0 and for very negative x; log1mexp(0) = -inf."""
    x = jnp.minimum(x, 0.0)
    return jnp.where(x > -0.6931471805599453, jnp.log(-jnp.expm1(x)), jnp.log1p(-jnp.exp(x)))


def merge(residual, q: jax.Array, out_sa: jax.Array, lse_sa: jax.Array, partial, prior: Prior,
          complete: jax.Array | None = None):
    """RESA output [B, HQ, D] f32 from the sparse attention and the kernel's prior partial.

    partial = (lse_I [B, HQ], o_I [B, HQ, D]): mu_q's log-sum-exp and softmax-weighted values
    over the selected prompt keys. complete [B, HQ] bool: the selection holds every prompt key
    (an exact count). Then x = 0 exactly: computed in floating point it would land a rounding
    error below 0, and e^{A - lse'} <= 1 / (1 - e^x) would amplify that into the output.
    """
    lse_i, o_i = partial
    dtype = prior.o_est.dtype          # the prior's precision (f32; f64 in exactness tests)
    group = q.shape[1] // prior.mu_k.shape[1]
    mu_k = jnp.repeat(prior.mu_k, group, axis=1)
    b = jnp.sum((q.astype(dtype) - prior.mu_q) * mu_k, axis=-1) / math.sqrt(q.shape[-1])
    x = jnp.minimum(lse_i - prior.lse, 0.0)
    if complete is not None:
        x = jnp.where(complete, 0.0, x)
    a = jnp.log(jnp.asarray(residual.lam, dtype)) + b + prior.lse
    lse_rest = a + log1mexp(x)
    lse_new = jnp.logaddexp(lse_sa, lse_rest)
    # No unselected mass (lambda = 0, or a complete selection): the residual adds nothing,
    # not the rounding noise left in o_est - o_I.
    w_rest = jnp.where(jnp.isfinite(lse_rest), jnp.exp(a - lse_new), 0.0)[..., None]
    w_sa = jnp.exp(lse_sa - lse_new)[..., None]
    # e^x o_I is 0 when nothing selected lies in the prompt (x = -inf, o_I = 0)
    rest = prior.o_est - jnp.where(jnp.isfinite(x), jnp.exp(x), 0.0)[..., None] * o_i
    return w_rest * rest + w_sa * out_sa.astype(dtype)


def fold_token(prior: Prior, layer: jax.Array, k: jax.Array, v: jax.Array) -> Prior:
    """Fold this step's key/value [B, HK, D] into layer `layer`'s prior: O(1) per step."""
    return fold_tokens(prior, layer, k[:, None], v[:, None])


def fold_tokens(prior: Prior, layer: jax.Array, k: jax.Array, v: jax.Array,
                valid: jax.Array | None = None) -> Prior:
    """Fold keys/values k, v [B, C, HK, D] into layer `layer`'s prior, those where valid
    [B, C] bool (default all): the prior then covers them as if prefilled with them."""
    p = jax.tree.map(lambda x: x[layer], prior)
    group = p.mu_q.shape[1] // k.shape[2]
    kf = jnp.repeat(k.astype(jnp.float32), group, axis=2)              # [B, C, HQ, D]
    vf = jnp.repeat(v.astype(jnp.float32), group, axis=2)
    logits = jnp.einsum("bhd,bchd->bch", p.mu_q, kf,
                        precision=jax.lax.Precision.HIGHEST) / math.sqrt(k.shape[-1])
    if valid is not None:
        logits = jnp.where(valid[..., None], logits, -jnp.inf)
    lse = jnp.logaddexp(p.lse, jax.nn.logsumexp(logits, axis=1))
    o_est = (jnp.exp(p.lse - lse)[..., None] * p.o_est
             + jnp.einsum("bch,bchd->bhd", jnp.exp(logits - lse[:, None]), vf,
                          precision=jax.lax.Precision.HIGHEST))
    return prior._replace(lse=prior.lse.at[layer].set(lse), o_est=prior.o_est.at[layer].set(o_est))
