"""Generation as small functions: prefill, decode_step, sample, generate.

`generate` = prefill + a `lax.while_loop` of decode steps, jitted end to end. The sparse
method (a `SparsePlan`) is a static argument: one compile per (plan, shapes).
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sparsejax import cache as kv
from sparsejax.extend import chunked_prefill, correct
from sparsejax.models import Model, embed, forward, token_ids, unembed
from sparsejax.plan import SparsePlan, as_plan
from sparsejax.stack import decode_layers, prefill_state


class GenerateOutput(NamedTuple):
    tokens: jax.Array          # [B, max_new_tokens] int32; after EOS, EOS
    num_generated: jax.Array   # [B] int32, counting the EOS token
    diagnostics: dict | None = None  # per step and layer, when asked (see methods docs)


class Sampling(NamedTuple):
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None


# ---- the two model passes -------------------------------------------------------------------
def prefill(model: Model, cache: kv.PagedKVCache, input_ids: jax.Array, lengths: jax.Array,
            plan: SparsePlan, chunk: int | None = None):
    """Dense forward over right-padded prompts; writes the pages, computes method state.

    chunk: None runs the whole prompt in one pass; an int runs it `chunk` tokens at a time
    over the paged cache (`sparsejax.extend.chunked_prefill`: bounded activation memory,
    the same logits up to rounding). Kascade's sparse prefill always takes that path.
    Returns (logits [B, vocab] f32 at each row's last prompt token, cache). Concrete ids and
    lengths are checked (see `generate`).
    """
    input_ids = token_ids(input_ids, model.config.vocab_size)
    lengths = prompt_lengths(lengths, *input_ids.shape)
    if chunk is not None or plan.prefill_tile is not None:
        return chunked_prefill(model, cache, input_ids, lengths, plan, chunk)
    kv.check_capacity(cache, input_ids.shape[1], "the prompt")
    out = forward(model, input_ids, lengths)
    cache = kv.write_prompt(cache, out.keys, out.values, lengths)
    cache = cache.replace(state=prefill_state(model, cache, out, plan))
    last = jnp.take_along_axis(out.hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]
    return unembed(model, last), cache


def decode_step(model: Model, cache: kv.PagedKVCache, tokens: jax.Array, plan: SparsePlan,
                diagnostics: bool = False):
    """One token per row: write its K/V at position `lengths`, attend, advance `lengths`.

    Returns (logits [B, vocab] f32, cache[, per-layer diagnostics]).
    """
    h = embed(model, token_ids(tokens, model.config.vocab_size, "tokens"))
    h, cache, diag = decode_layers(model, cache, h, plan, diagnostics)
    cache = cache.replace(lengths=cache.lengths + 1)
    logits = unembed(model, h)
    return (logits, cache, diag) if diagnostics else (logits, cache)


# ---- sampling -------------------------------------------------------------------------------
def sample(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """Greedy at temperature 0; otherwise temperature, then top-k, then top-p (nucleus)."""
    if sampling.temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / sampling.temperature
    if sampling.top_k is not None:
        kth = jax.lax.top_k(logits, sampling.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if sampling.top_p is not None:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        cutoff = jnp.min(jnp.where(mass_before < sampling.top_p, sorted_logits, jnp.inf),
                         axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


# ---- generate -------------------------------------------------------------------------------
def generate(model: Model, input_ids, *, lengths=None, attention_mask=None, max_new_tokens: int,
             method=None, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, eos_token_id: int | Sequence[int] | None = None,
             rng: jax.Array | None = None, page_size: int | None = None,
             return_diagnostics: bool = False, prefill_chunk: int | None = None,
             correct_every: int | None = None) -> GenerateOutput:
    """Generate `max_new_tokens` per row from right-padded `input_ids [B, T]` with `lengths [B]`,
    or from left- or right-padded ones with `attention_mask [B, T]` (1 on the prompt's tokens,
    the Hugging Face convention; concrete arrays: the rows are re-packed to the left on the host).

    `method=None` is dense attention; otherwise a method from `sparsejax.methods` (or a plan).
    Greedy when `temperature` is 0, else sampled with the explicit PRNG key `rng`. A row that
    emits an EOS token stops; its remaining tokens are EOS. `eos_token_id=None` takes the
    checkpoint's (generation_config.json, else config.json); `()` never stops. The page size
    defaults to 16, or to the method's own when it selects pages. With `return_diagnostics`,
    also returns per decode step and layer: recall, oracle_recall, attn_error (see
    `sparsejax.stack`).
    `prefill_chunk`: prefill the prompt this many tokens at a time (see `prefill`).
    `correct_every=N`: cache correction — every N decode steps, the last N generated tokens
    are re-run with dense attention and their K/V (and per-page method state) overwritten
    (`sparsejax.extend.correct`). Off by default.

    Concrete `input_ids` must be integer ids in [0, vocab) and `lengths` integers in [1, T];
    a ValueError names the values that are not. Traced ones (generate called inside a jit)
    cannot be inspected: there an id >= vocab embeds as NaN, a negative one wraps around, and
    a length outside [1, T] reads padding.
    """
    args, static = _prepare(model, input_ids, lengths=lengths, attention_mask=attention_mask,
                            max_new_tokens=max_new_tokens,
                            method=method, temperature=temperature, top_k=top_k, top_p=top_p,
                            eos_token_id=eos_token_id, rng=rng, page_size=page_size,
                            return_diagnostics=return_diagnostics, prefill_chunk=prefill_chunk,
                            correct_every=correct_every)
    return _generate(*args, **static)


def compile_generate(model: Model, input_ids, **kwargs):
    """`generate(model, input_ids, **kwargs)` compiled ahead of time, without running it.

    Returns `run(input_ids, lengths=None, attention_mask=None)` for inputs of the same shape,
    e.g. to time generation without the compile (a warm-up call would also run it once)."""
    args, static = _prepare(model, input_ids, **kwargs)
    compiled = _generate.lower(*args, **static).compile()

    def run(input_ids, lengths=None, attention_mask=None):
        args, _ = _prepare(model, input_ids, **{**kwargs, "lengths": lengths,
                                                "attention_mask": attention_mask})
        return compiled(*args)

    return run


def _right_padded(input_ids, attention_mask):
    """Left- or right-padded `input_ids [B, T]` with `attention_mask [B, T]` -> the same prompts
    right-padded, and their lengths [B] (positions then count from each prompt's first token)."""
    if any(isinstance(x, jax.core.Tracer) for x in (input_ids, attention_mask)):
        raise ValueError("attention_mask= needs concrete arrays; inside jit pass right-padded "
                         "input_ids with lengths=")
    ids, mask = np.asarray(input_ids), np.asarray(attention_mask)
    if mask.shape != ids.shape or ids.ndim != 2:
        raise ValueError(f"attention_mask has shape {mask.shape}: expected input_ids' "
                         f"{ids.shape} [batch, seq]")
    if not np.isin(mask, (0, 1)).all():
        raise ValueError(f"attention_mask holds {np.unique(mask)[:8]}: expected 0s and 1s")
    mask = mask.astype(bool)
    lengths = mask.sum(1)
    start = np.argmax(mask, axis=1)
    pos = np.arange(ids.shape[1])
    one_run = (pos >= start[:, None]) & (pos < (start + lengths)[:, None])
    bad = np.flatnonzero((lengths == 0) | np.any(one_run != mask, axis=1))
    if bad.size:
        raise ValueError(f"attention_mask rows {bad[:8].tolist()} are not one run of ones: "
                         "expected left or right padding around a non-empty prompt")
    packed = np.take_along_axis(ids, np.minimum(start[:, None] + pos, ids.shape[1] - 1), axis=1)
    return np.where(pos < lengths[:, None], packed, 0), lengths


def _prepare(model, input_ids, *, lengths=None, attention_mask=None, max_new_tokens: int,
             method=None, temperature: float = 0.0, top_k=None, top_p=None, eos_token_id=None,
             rng=None, page_size=None, return_diagnostics: bool = False, prefill_chunk=None,
             correct_every=None):
    """Validate generate's arguments -> (traced args, static args) of `_generate`."""
    if attention_mask is not None:
        if lengths is not None:
            raise ValueError("give lengths= (right padding) or attention_mask=, not both")
        input_ids, lengths = _right_padded(input_ids, attention_mask)
    input_ids = token_ids(input_ids, model.config.vocab_size)
    if input_ids.ndim != 2 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids has shape {input_ids.shape}: expected [batch, seq >= 1]")
    B, T = input_ids.shape
    lengths = prompt_lengths(lengths, B, T)
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r}: expected an int >= 1")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature={temperature}: expected a finite value >= 0")
    if top_k is not None and not (isinstance(top_k, int) and 1 <= top_k <= model.config.vocab_size):
        raise ValueError(f"top_k={top_k!r}: expected an int in [1, {model.config.vocab_size}]")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p}: expected 0 < top_p <= 1")
    if prefill_chunk is not None and not (isinstance(prefill_chunk, int) and prefill_chunk >= 1):
        raise ValueError(f"prefill_chunk={prefill_chunk!r}: expected None or an int >= 1")
    if correct_every is not None and not (isinstance(correct_every, int) and correct_every >= 1):
        raise ValueError(f"correct_every={correct_every!r}: expected None or an int >= 1")
    if temperature > 0 and rng is None:
        raise ValueError("temperature > 0 samples: pass an explicit PRNG key as rng=")
    plan = as_plan(method, model.config, page_size)
    model.config.check_context(T + max_new_tokens)
    if eos_token_id is None:
        eos_token_id = () if model.config.eos_token_id is None else model.config.eos_token_id
    eos = tuple(int(e) for e in np.atleast_1d(np.asarray(eos_token_id, np.int64)))
    rng = jax.random.key(0) if rng is None else rng
    static = dict(max_new_tokens=max_new_tokens, plan=plan,
                  sampling=Sampling(float(temperature), top_k, top_p), eos=eos,
                  diagnostics=bool(return_diagnostics), prefill_chunk=prefill_chunk,
                  correct_every=correct_every)
    return (model, input_ids, lengths, rng), static


def prompt_lengths(lengths, batch: int, width: int) -> jax.Array:
    """lengths [batch] as int32 (None: every row `width` long), refused unless integers in
    [1, width]; the range is checked only where they are concrete."""
    if lengths is None:
        return jnp.full((batch,), width, jnp.int32)
    host = None if isinstance(lengths, jax.core.Tracer) else np.asarray(lengths)
    dtype = lengths.dtype if host is None else host.dtype
    if not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(f"lengths has dtype {dtype}: expected integers")
    if jnp.shape(lengths) != (batch,):
        raise ValueError(f"lengths has shape {jnp.shape(lengths)}: expected ({batch},)")
    if host is not None and (host.min() < 1 or host.max() > width):
        raise ValueError(f"lengths range over [{host.min()}, {host.max()}]: expected "
                         f"1 <= length <= {width}")
    return jnp.asarray(lengths, jnp.int32)


@functools.partial(jax.jit, static_argnames=("max_new_tokens", "plan", "sampling", "eos",
                                             "diagnostics", "prefill_chunk", "correct_every"))
def _generate(model, input_ids, lengths, rng, *, max_new_tokens, plan, sampling, eos,
              diagnostics, prefill_chunk, correct_every):
    B, T = input_ids.shape
    cache = kv.allocate(model.config, B, T + max_new_tokens - 1, page_size=plan.page_size,
                        dtype=model.dtype)
    logits, cache = prefill(model, cache, input_ids, lengths, plan, prefill_chunk)
    eos_ids = jnp.asarray(eos if eos else (-1,), jnp.int32)
    pad = eos_ids[0] if eos else jnp.int32(0)
    is_eos = lambda t: jnp.any(t[:, None] == eos_ids[None, :], axis=-1)  # noqa: E731

    key, sub = jax.random.split(rng)
    first = sample(logits, sub, sampling)
    tokens = jnp.full((B, max_new_tokens), pad, jnp.int32).at[:, 0].set(first)
    done = is_eos(first) if eos else jnp.zeros((B,), bool)
    diag = None
    if diagnostics:
        diag = jax.tree.map(lambda x: jnp.zeros((max_new_tokens - 1,) + x.shape, x.dtype),
                            jax.eval_shape(lambda c: decode_step(model, c, first, plan, True)[2],
                                           cache))

    def cond(s):
        step, _, done, *_ = s
        return (step < max_new_tokens) & ~jnp.all(done)

    def body(s):
        step, tokens, done, num, cache, key, diag = s
        out = decode_step(model, cache, tokens[:, step - 1], plan, diagnostics)
        logits, cache = out[0], out[1]
        if correct_every is not None:   # the cache now holds generated tokens 0 .. step-1
            recent = jax.lax.dynamic_slice_in_dim(tokens, step - correct_every, correct_every, 1)
            cache = jax.lax.cond(step % correct_every == 0,
                                 lambda c: correct(model, c, recent, plan), lambda c: c, cache)
        if diagnostics:
            diag = jax.tree.map(lambda acc, x: acc.at[step - 1].set(x), diag, out[2])
        key, sub = jax.random.split(key)
        tok = jnp.where(done, pad, sample(logits, sub, sampling))
        tokens = tokens.at[:, step].set(tok)
        num = num + (~done).astype(jnp.int32)
        done = done | is_eos(tok) if eos else done
        return step + 1, tokens, done, num, cache, key, diag

    state = (jnp.int32(1), tokens, done, jnp.ones((B,), jnp.int32), cache, key, diag)
    _, tokens, _, num, _, _, diag = jax.lax.while_loop(cond, body, state)
    return GenerateOutput(tokens, num, diag)
