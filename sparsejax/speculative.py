"""Self-speculative decoding: a sparse plan drafts, one dense multi-token pass verifies.

Each round, the sparse plan decodes γ draft tokens d_1..d_γ from the last accepted token t;
then `verify` runs [t, d_1, .., d_γ] through every layer densely (`sparsejax.extend`), which
overwrites the drafts' K/V with the dense ones and gives the dense logits after each of them.
The acceptance rules keep the longest prefix of drafts the dense model agrees with and add
one token of its own, so the output is the dense model's:
  greedy     accept d_i while d_i = argmax p_{i-1}; then argmax p_n (n drafts accepted)
  sampling   accept d_i with probability min(1, p(d_i) / q(d_i)) (p dense, q the draft's,
             both after temperature / top-k / top-p); at the first rejection sample from
             normalize(max(0, p - q)), after γ acceptances from p_γ (Leviathan et al. 2023)
`method_state.settle_state` then puts back the per-layer method state the drafts moved.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from sparsejax.cache import PagedKVCache
from sparsejax.extend import extend
from sparsejax.models import Model


def verify(model: Model, cache: PagedKVCache, tokens: jax.Array, start: jax.Array,
           num_tokens: jax.Array):
    """Dense pass over tokens [B, C] at positions start [B] + i (the first num_tokens [B] of
    each row; 0 leaves a row untouched): writes their dense K/V and returns their logits
    [B, C, vocab] f32. The method state is left as it is (see `method_state.settle_state`)."""
    logits, verified = extend(model, cache.replace(state=None), tokens, num_tokens, start=start)
    return logits, verified.replace(state=cache.state)


def accept_greedy(drafts: jax.Array, logits: jax.Array):
    """drafts [B, γ] int32, dense logits [B, γ + 1, vocab] after [t, d_1, .., d_γ].

    Returns (tokens [B, γ + 1], accepted [B]): a row's new tokens are tokens[:accepted + 1]
    (its accepted drafts, which equal the dense argmax, then the dense argmax after them)."""
    target = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    agree = drafts == target[:, :-1]
    return target, jnp.sum(jnp.cumprod(agree, axis=1), axis=1).astype(jnp.int32)


def accept_sampled(drafts: jax.Array, p_logits: jax.Array, q_logits: jax.Array, key: jax.Array):
    """drafts [B, γ] int32 sampled from q_logits [B, γ, vocab]; p_logits [B, γ + 1, vocab] the
    dense model's after [t, d_1, .., d_γ] (both after temperature / top-k / top-p).

    Returns (tokens [B, γ + 1], accepted [B]) as `accept_greedy`; tokens[:accepted + 1] are
    distributed as dense sampling would draw them."""
    B, gamma = drafts.shape
    p = jax.nn.softmax(p_logits, axis=-1)
    q = jax.nn.softmax(q_logits, axis=-1)
    p_draft = jnp.take_along_axis(p[:, :-1], drafts[..., None], axis=-1)[..., 0]   # [B, γ]
    q_draft = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    key_accept, key_fix = jax.random.split(key)
    u = jax.random.uniform(key_accept, (B, gamma))
    accepted = jnp.sum(jnp.cumprod(u * q_draft < p_draft, axis=1), axis=1).astype(jnp.int32)
    # the token after the accepted drafts: from max(0, p - q) at a rejection, from p after all
    rows = jnp.arange(B)
    p_next = p[rows, accepted]
    q_next = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)[rows, accepted]
    residual = jnp.maximum(p_next - q_next, 0.0)
    # all zero only where p = q to rounding, where a rejection had probability ~0: use p
    residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, p_next)
    fix = jax.random.categorical(key_fix, jnp.log(residual), axis=-1).astype(jnp.int32)
    drafts_then_fix = jnp.concatenate([drafts, fix[:, None]], axis=1)
    tokens = jnp.where(jnp.arange(gamma + 1)[None, :] < accepted[:, None], drafts_then_fix,
                       fix[:, None])
    return tokens, accepted
