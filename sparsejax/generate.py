"""Generation as small functions: prefill, decode_step, sample, draft, generate.

`generate` = prefill + a `lax.while_loop` of decode steps, jitted end to end. The sparse
method (a `SparsePlan`) is a static argument: one compile per (plan, shapes). Prompts are
right-padded to a length bucket (`bucket_length`), so prompts of many lengths share one
compiled program per bucket. With
`draft_tokens`, each loop iteration is a round of self-speculative decoding instead
(`sparsejax.speculative`): the method drafts, dense attention verifies.

One file: the public entry points share `_prepare`'s checks and `_generate`'s static
arguments, and the memory check compiles the very program `generate` runs.
"""
from __future__ import annotations

import functools
import math
import warnings
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from sparsejax import cache as kv
from sparsejax import method_state, sharding, speculative
from sparsejax.extend import (choose_prefill_chunk, chunked_prefill, correct,
                              resolve_prefill_chunk)
from sparsejax.models import Model, embed, forward, init_params, token_ids, unembed, unstack_layers
from sparsejax.plan import Score, SparsePlan, as_plan
from sparsejax.layers import decode_layers, prefill_state


class GenerateOutput(NamedTuple):
    tokens: jax.Array          # [B, max_new_tokens] int32; after EOS, EOS
    num_generated: jax.Array   # [B] int32, counting the EOS token
    diagnostics: dict | None = None  # per step and layer, when asked (see methods docs)
    drafted: jax.Array | None = None   # [B] int32 tokens drafted (speculative decoding only)
    accepted: jax.Array | None = None  # [B] int32 of those, accepted by the dense verify
    # [B, max_new_tokens] f32 log-softmax of the model's logits (before temperature / top-k /
    # top-p) at each generated token, when asked (`logprobs=`); after a row stops, 0
    logprobs: jax.Array | None = None
    # ([B, max_new_tokens, n] int32 ids, [B, max_new_tokens, n] f32 log-probabilities) of the n
    # most likely tokens at each step, when `logprobs=n` with n >= 1
    top_logprobs: tuple[jax.Array, jax.Array] | None = None


class Sampling(NamedTuple):
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None


# ---- the two model passes -------------------------------------------------------------------
def prefill(model: Model, cache: kv.PagedKVCache, input_ids: jax.Array, lengths: jax.Array,
            plan: SparsePlan, chunk: int | None = None, mesh=None):
    """Dense forward over right-padded prompts; writes the pages, computes method state.

    chunk: tokens per row per step over the paged cache (`sparsejax.extend.chunked_prefill`:
    activations bounded by the chunk, the K/V written into the pages as each chunk runs, the
    same logits as one pass up to rounding). None (the default) chooses it from the model,
    the batch and the free memory (`extend.choose_prefill_chunk`; a short prompt runs in one
    step); 0 or "one-pass" runs the whole prompt through the model in one pass, which holds
    every layer's K/V for the prompt beside the cache. Kascade's sparse prefill always runs
    in chunks.
    Returns (logits [B, vocab] f32 at each row's last prompt token, cache). Concrete ids and
    lengths are checked (see `generate`). `mesh`: run tensor- (and data-) parallel on it,
    as does a model placed with `sparsejax.shard`; the cache from `allocate(..., mesh=mesh)`.
    """
    input_ids = token_ids(input_ids, model.config.vocab_size)
    lengths = prompt_lengths(lengths, *input_ids.shape)
    plan.check_model(model.config)
    model = _placed(model, mesh, input_ids.shape[0])
    if model.mesh is not None:
        return sharding.spmd(functools.partial(_prefill, plan=plan, chunk=chunk), model.mesh,
                             (model, cache, input_ids, lengths),
                             lambda out: _step_specs(model, out[1]))
    return _prefill(model, cache, input_ids, lengths, plan, chunk)


def _prefill(model, cache, input_ids, lengths, plan, chunk=None):
    """`prefill` of valid inputs (on one data shard under a mesh)."""
    B, T = input_ids.shape
    chunk = resolve_prefill_chunk(chunk, model.config, B, T, tile=plan.prefill_tile,
                                  span=cache.capacity, dtype=cache.k.dtype)
    if chunk is not None or plan.prefill_tile is not None:
        return chunked_prefill(model, cache, input_ids, lengths, plan, chunk)
    kv.check_capacity(cache, input_ids.shape[1], "the prompt")
    out = forward(model, input_ids, lengths)
    cache = kv.write_prompt(cache, out.keys, out.values, lengths, kv.write_backend(model))
    cache = cache.replace(state=prefill_state(model, cache, out, plan))
    last = jnp.take_along_axis(out.hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]
    return unembed(model, last), cache


def decode_step(model: Model, cache: kv.PagedKVCache, tokens: jax.Array, plan: SparsePlan,
                diagnostics: bool = False, mesh=None):
    """One token per row: write its K/V at position `lengths`, attend, advance `lengths`.

    Returns (logits [B, vocab] f32, cache[, per-layer diagnostics]). `mesh`: as in `prefill`.
    """
    tokens = token_ids(tokens, model.config.vocab_size, "tokens")
    _check_step(model, cache, plan)
    model = _placed(model, mesh, tokens.shape[0])
    if model.mesh is not None:
        rows = sharding.batch_spec(model.mesh)
        step_specs = _step_specs(model, cache)
        specs = step_specs if not diagnostics else (   # diagnostics: [layers, B, ...]
            lambda out: (*step_specs, jax.tree.map(lambda _: P(None, *rows), out[2])))
        return sharding.spmd(functools.partial(_decode_step, plan=plan, diagnostics=diagnostics),
                             model.mesh, (model, cache, tokens), specs)
    return _decode_step(model, cache, tokens, plan, diagnostics)


def _decode_step(model, cache, tokens, plan, diagnostics=False):
    """`decode_step` (on one data shard under a mesh)."""
    h = embed(model, tokens)
    h, cache, diag = decode_layers(model, cache, h, plan, diagnostics)
    cache = cache.replace(lengths=cache.lengths + 1)
    logits = unembed(model, h)
    return (logits, cache, diag) if diagnostics else (logits, cache)


def _placed(model: Model, mesh, batch: int) -> Model:
    """The model on `mesh` (None: wherever it is), checked against the batch."""
    if mesh is not None and mesh != model.mesh:
        model = sharding.shard(model, mesh)
    if model.mesh is not None:
        sharding.check_mesh(model.mesh, model.config, batch)
    return model


def _step_specs(model: Model, cache):
    """Specs of (logits [B, vocab], cache): vocabulary on "model", rows on "data"."""
    mesh = model.mesh
    return (P(*sharding.batch_spec(mesh), sharding.MODEL),
            sharding.cache_specs(cache, model.config, mesh))


# ---- sampling -------------------------------------------------------------------------------
def sample(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """Greedy at temperature 0; otherwise temperature, then top-k, then top-p (nucleus)."""
    if sampling.temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, sampling_logits(logits, sampling), axis=-1).astype(jnp.int32)


def sampling_logits(logits: jax.Array, sampling: Sampling) -> jax.Array:
    """The logits [..., vocab] that temperature > 0 samples from: divided by the temperature,
    -inf outside the top-k and then outside the top-p nucleus."""
    logits = logits / sampling.temperature
    if sampling.top_k is not None:
        kth = jax.lax.top_k(logits, sampling.top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if sampling.top_p is not None:
        sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        cutoff = jnp.min(jnp.where(mass_before < sampling.top_p, sorted_logits, jnp.inf),
                         axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return logits


# ---- length buckets -------------------------------------------------------------------------
MIN_BUCKET = 16
BUCKET_STEP = 4096


def bucket_length(num_tokens: int) -> int:
    """The padded prompt width that `num_tokens` compiles at: the next power of two from
    MIN_BUCKET up to BUCKET_STEP, then the next multiple of BUCKET_STEP (at most BUCKET_STEP
    - 1 padding tokens, a share that shrinks as prompts grow, for one compile per bucket)."""
    if num_tokens <= BUCKET_STEP:
        return max(MIN_BUCKET, 1 << (max(num_tokens, 1) - 1).bit_length())
    return -(-num_tokens // BUCKET_STEP) * BUCKET_STEP


def enable_compilation_cache(directory, *, min_compile_seconds: float = 0.0) -> None:
    """Keep compiled programs on disk in `directory` (JAX's persistent compilation cache), so
    a later process compiling the same program (same model shapes, method, bucket, batch and
    max_new_tokens, on the same JAX and device) loads it instead. Programs whose compile took
    less than `min_compile_seconds` are not written."""
    from pathlib import Path

    if not (math.isfinite(min_compile_seconds) and min_compile_seconds >= 0):
        raise ValueError(f"min_compile_seconds={min_compile_seconds}: expected a finite value "
                         ">= 0")
    path = Path(directory).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_seconds))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


# ---- generate -------------------------------------------------------------------------------
def generate(model: Model, input_ids, *, lengths=None, attention_mask=None, max_new_tokens: int,
             method=None, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, eos_token_id: int | Sequence[int] | None = None,
             rng: jax.Array | int | None = None, seed: int | None = None,
             page_size: int | None = None, return_diagnostics: bool = False,
             prefill_chunk: int | None = None, correct_every: int | None = None,
             draft_tokens: int | None = None, mesh=None, logprobs: bool | int = False,
             pad_token_id: int | None = None, pad_to_bucket: bool = True,
             kv_dtype=None) -> GenerateOutput:
    """Generate `max_new_tokens` per row from right-padded `input_ids [B, T]` with `lengths [B]`,
    or from left- or right-padded ones with `attention_mask [B, T]` (1 on the prompt's tokens,
    the Hugging Face convention; concrete arrays: the rows are re-packed to the left on the host).

    Without either, every token of `input_ids` is prompt, unless the pad token
    (`pad_token_id`, else the checkpoint's) appears in them and is no EOS: then the mask is
    `input_ids != pad_token_id`, as transformers infers it.

    `method=None` is dense attention; otherwise a method from `sparsejax.methods` (or a plan).
    Greedy when `temperature` is 0, else sampled with the PRNG key `rng` (a key, or an int
    seed; `seed=` is the same as an int `rng`). A row that
    emits an EOS token stops; its remaining tokens are EOS. `eos_token_id=None` takes the
    checkpoint's (generation_config.json, else config.json); `()` never stops. The page size
    defaults to 16, or to the method's own when it selects pages. With `return_diagnostics`,
    also returns per decode step and layer: recall, oracle_recall, attn_error (see
    `sparsejax.layers`).
    `prefill_chunk`: prefill the prompt this many tokens at a time; None (default) chooses
    from the model, batch and free memory, 0 or "one-pass" runs it in one pass (see `prefill`).
    Before running, a program whose cache and temporaries (XLA's memory analysis) exceed the
    devices' free memory is refused, naming the largest batch of this context that fits
    (`sparsejax.max_batch` answers that ahead of time).
    `correct_every=N`: cache correction — every N decode steps, the last N generated tokens
    are re-run with dense attention and their K/V (and per-page method state) overwritten
    (`sparsejax.extend.correct`). Off by default.
    `draft_tokens` (γ): lossless mode. The method drafts γ tokens per round and one dense pass
    over them verifies; the output is dense generation's (token for token when greedy, in
    distribution when sampling), and `drafted` / `accepted` count the drafts per row.
    `mesh`: a `jax.sharding.Mesh` with an axis "model" (tensor parallel) and optionally "data"
    (rows); the model is placed on it with `sparsejax.shard` (a model already placed runs on
    its own mesh). See `sparsejax.sharding`.
    `logprobs`: True also returns each generated token's log-probability under the model
    (`GenerateOutput.logprobs`, the log-softmax of the logits before temperature, top-k and
    top-p); an int n >= 1 also the n most likely tokens' (`top_logprobs`). Off, nothing is
    computed.
    `pad_to_bucket`: right-pad the prompts to `bucket_length(T)` tokens (lengths unchanged, so
    no row's output changes) and compile once per bucket rather than per prompt width.
    `kv_dtype`: what the KV cache stores (`cache.resolve_kv_dtype`): None or "auto" the model's
    dtype, "bf16", "f32", or "fp8" (float8_e4m3fn with a scale per token and KV head: half a
    bf16 cache's bytes; every method, lossless mode and the diagnostics then read that cache,
    dense attention included).

    Concrete `input_ids` must be integer ids in [0, vocab) and `lengths` integers in [1, T];
    a ValueError names the values that are not. Traced ones (generate called inside a jit)
    cannot be inspected: there an id >= vocab embeds as NaN, a negative one wraps around, and
    a length outside [1, T] reads padding.
    """
    args, static = _prepare(model, input_ids, lengths=lengths, attention_mask=attention_mask,
                            max_new_tokens=max_new_tokens,
                            method=method, temperature=temperature, top_k=top_k, top_p=top_p,
                            eos_token_id=eos_token_id, rng=rng, seed=seed,
                            page_size=page_size, return_diagnostics=return_diagnostics,
                            prefill_chunk=prefill_chunk, correct_every=correct_every,
                            draft_tokens=draft_tokens, mesh=mesh, logprobs=logprobs,
                            pad_token_id=pad_token_id, pad_to_bucket=pad_to_bucket,
                            kv_dtype=kv_dtype)
    return _run_within_memory(args, static)


def compile_generate(model: Model, input_ids, **kwargs):
    """`generate(model, input_ids, **kwargs)` compiled ahead of time, without running it.

    Returns `run(input_ids, lengths=None, attention_mask=None)` for inputs of the same batch
    whose prompt width falls in the same length bucket (the same width with
    `pad_to_bucket=False`), e.g. to time generation without the compile (a warm-up call would
    also run it once)."""
    args, static = _prepare(model, input_ids, **kwargs)
    compiled = _generate.lower(*args, **static).compile()
    width = args[1].shape

    def run(input_ids, lengths=None, attention_mask=None):
        args, _ = _prepare(model, input_ids, **{**kwargs, "lengths": lengths,
                                                "attention_mask": attention_mask})
        if args[1].shape != width:
            raise ValueError(f"input_ids of shape {np.shape(input_ids)} pad to {args[1].shape}: "
                             f"this program was compiled for {width} (batch, bucket); "
                             "compile_generate again for these inputs")
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
             rng=None, seed=None, page_size=None, return_diagnostics: bool = False,
             prefill_chunk=None, correct_every=None, draft_tokens=None, mesh=None,
             logprobs=False, pad_token_id=None, pad_to_bucket: bool = True, kv_dtype=None):
    """Validate generate's arguments -> (traced args, static args) of `_generate`."""
    stored = kv.resolve_kv_dtype(kv_dtype, model.dtype)
    kv_dtype = None if stored == jnp.dtype(model.dtype) else stored.name   # static: hashable
    if eos_token_id is None:
        eos_token_id = () if model.config.eos_token_id is None else model.config.eos_token_id
    eos = tuple(int(e) for e in np.atleast_1d(np.asarray(eos_token_id, np.int64)))
    if attention_mask is None and lengths is None:
        attention_mask = _inferred_mask(input_ids, model.config.pad_token_id
                                        if pad_token_id is None else pad_token_id, eos)
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
    resolve_prefill_chunk(prefill_chunk, model.config, 1, 1, free_bytes=0)   # validates it
    if correct_every is not None and not (isinstance(correct_every, int) and correct_every >= 1):
        raise ValueError(f"correct_every={correct_every!r}: expected None or an int >= 1")
    if draft_tokens is not None and not (isinstance(draft_tokens, int) and draft_tokens >= 1):
        raise ValueError(f"draft_tokens={draft_tokens!r}: expected None or an int >= 1")
    if draft_tokens is not None and correct_every is not None:
        raise ValueError(f"correct_every={correct_every!r} with draft_tokens={draft_tokens!r}: "
                         "lossless mode's cache already holds dense K/V for every accepted "
                         "token, so there is nothing to correct; pass one of them")
    if draft_tokens is not None and return_diagnostics:
        raise ValueError("return_diagnostics=True with draft_tokens: diagnostics are per "
                         "decode step of one method; run without draft_tokens for them")
    top_logprobs = _logprobs_count(logprobs, model.config.vocab_size)
    if draft_tokens is not None and top_logprobs is not None:
        raise ValueError(f"logprobs={logprobs!r} with draft_tokens: lossless mode keeps no "
                         "per-token log-probabilities; run without draft_tokens for them")
    rng = prng_key(rng, seed)
    if temperature > 0 and rng is None:
        raise ValueError("temperature > 0 samples: pass a PRNG key or an int seed as rng= "
                         "(or seed=)")
    if temperature == 0 and (top_k is not None or top_p is not None):
        warnings.warn(f"top_k={top_k}, top_p={top_p} have no effect at temperature=0 (greedy "
                      "decoding); pass temperature > 0 to sample", stacklevel=3)
    _check_eos(eos_token_id, model.config.vocab_size)
    plan = as_plan(method, model.config, page_size)
    host_lengths = None if isinstance(lengths, jax.core.Tracer) else np.asarray(lengths)
    model.config.check_context((T if host_lengths is None else int(host_lengths.max()))
                               + max_new_tokens)
    if pad_to_bucket and bucket_length(T) > T:   # lengths stay: the padding is never read
        pad = ((0, 0), (0, bucket_length(T) - T))
        input_ids = (jnp.pad(input_ids, pad) if isinstance(input_ids, jax.core.Tracer)
                     else jnp.asarray(np.pad(np.asarray(input_ids), pad)))
    rng = jax.random.key(0) if rng is None else rng
    model = _placed(model, mesh, B)
    if model.mesh is not None:
        rows = NamedSharding(model.mesh, sharding.batch_spec(model.mesh))
        input_ids, lengths = jax.device_put(input_ids, rows), jax.device_put(lengths, rows)
        rng = jax.device_put(rng, NamedSharding(model.mesh, P()))
    static = dict(max_new_tokens=max_new_tokens, plan=plan,
                  sampling=Sampling(float(temperature), top_k, top_p), eos=eos,
                  diagnostics=bool(return_diagnostics), prefill_chunk=prefill_chunk,
                  correct_every=correct_every, draft_tokens=draft_tokens,
                  top_logprobs=top_logprobs, kv_dtype=kv_dtype)
    return (model, input_ids, lengths, rng), static


def _inferred_mask(input_ids, pad_token_id, eos: tuple[int, ...]):
    """transformers' rule for ids given without a mask: where the pad token occurs in them and
    is no EOS, the mask is `input_ids != pad_token_id`; otherwise None (all prompt)."""
    if pad_token_id is None or pad_token_id in eos or isinstance(input_ids, jax.core.Tracer):
        return None
    ids = np.asarray(input_ids)
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer) or not (ids == pad_token_id).any():
        return None
    mask = ids != pad_token_id
    starts, ends = np.argmax(mask, axis=1), ids.shape[1] - np.argmax(mask[:, ::-1], axis=1)
    inside = [i for i in range(len(ids))
              if not mask[i].any() or not mask[i, starts[i]:ends[i]].all()]
    if inside:
        raise ValueError(f"input_ids rows {inside[:8]} hold the pad token {pad_token_id} inside "
                         "the prompt (or nothing else), so the prompt cannot be told from the "
                         "padding: pass attention_mask= or lengths=")
    return mask.astype(np.int32)


def _logprobs_count(logprobs, vocab_size: int) -> int | None:
    """generate's `logprobs` -> None (off), 0 (the chosen tokens') or n (and the n likeliest)."""
    if logprobs is None or logprobs is False:
        return None
    if logprobs is True:
        return 0
    if isinstance(logprobs, (int, np.integer)) and 0 <= logprobs <= vocab_size:
        return int(logprobs)
    raise ValueError(f"logprobs={logprobs!r}: expected a bool, or an int in [0, {vocab_size}] "
                     "(also return that many most likely tokens per step)")


def prng_key(rng, seed=None):
    """`rng` (a PRNG key, a legacy uint32[2] key, or an int seed) or `seed` (an int) as a typed
    PRNG key; None when neither is given."""
    if seed is not None:
        if rng is not None:
            raise ValueError(f"rng={rng!r:.40} and seed={seed!r}: give one of them")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise ValueError(f"seed={seed!r}: expected an int")
        rng = seed
    if rng is None:
        return None
    if isinstance(rng, (int, np.integer)) and not isinstance(rng, bool):
        return jax.random.key(int(rng))
    if isinstance(rng, (jax.Array, np.ndarray)):
        if jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key) and rng.shape == ():
            return rng
        if rng.dtype == np.uint32 and rng.shape == (2,):      # jax.random.PRNGKey(seed)
            return jax.random.wrap_key_data(rng)
    raise ValueError(f"rng={rng!r:.60}: expected an int seed or one PRNG key "
                     "(jax.random.key(seed))")


def _check_eos(eos_token_id, vocab_size: int) -> None:
    """eos_token_id: None, an int or a sequence of ints, each a token id in [0, vocab)."""
    if eos_token_id is None:
        return
    ids = (list(eos_token_id) if isinstance(eos_token_id, (list, tuple, np.ndarray))
           else [eos_token_id])
    if not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool)
               and 0 <= i < vocab_size for i in ids):
        raise ValueError(f"eos_token_id={eos_token_id!r}: expected None, a token id or token "
                         f"ids in [0, {vocab_size}) (the vocabulary)")


def _check_step(model: Model, cache: kv.PagedKVCache, plan: SparsePlan) -> None:
    """A decode step's plan must be this model's, and the cache must have room for one more
    token per row. The room is checked where the lengths are concrete (an eager call); inside
    a jit they cannot be read, and a step past capacity loses the new token's K/V (`generate`
    allocates prompt + new tokens, so it never gets there)."""
    plan.check_model(model.config)
    state = cache.state
    needs = [(plan.residual is not None, "prior", "RESA's prior"),
             (plan.selector is not None and plan.selector.score == Score.QUEST_BOUND, "kmin",
              "Quest's page key bounds")]
    for needed, field, what in needs:
        if needed and getattr(state, field, None) is None:
            raise ValueError(f"decode_step: plan {plan.name!r} reads {what} from cache.state, "
                             f"and the cache holds none: prefill it with the same plan first "
                             f"(sparsejax.prefill(model, cache, ids, lengths, plan))")
    if isinstance(cache.lengths, jax.core.Tracer):
        return
    longest = int(np.max(np.asarray(cache.lengths)))
    if longest + 1 > cache.capacity:
        raise ValueError(f"decode_step: a row holds {longest} tokens and the cache's capacity is "
                         f"{cache.capacity} ({cache.page_table.shape[1]} pages of "
                         f"{cache.page_size}): no room for one more; allocate more pages")


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
                                             "diagnostics", "prefill_chunk", "correct_every",
                                             "draft_tokens", "top_logprobs", "kv_dtype"))
def _generate(model, input_ids, lengths, rng, **static):
    run = functools.partial(_generate_rows, **static)
    if model.mesh is None:
        return run(model, input_ids, lengths, rng)
    rows = sharding.batch_spec(model.mesh)
    counts = None if static["draft_tokens"] is None else rows
    n = static["top_logprobs"]
    specs = GenerateOutput(rows, rows, None, counts, counts, None if n is None else rows,
                           None if not n else (rows, rows))
    if static["diagnostics"]:   # [steps, layers, B, ...]
        return sharding.spmd(run, model.mesh, (model, input_ids, lengths, rng),
                             lambda out: specs._replace(diagnostics=jax.tree.map(
                                 lambda _: P(None, None, *rows), out.diagnostics)))
    return sharding.spmd(run, model.mesh, (model, input_ids, lengths, rng), specs)


def _generate_rows(model, input_ids, lengths, rng, *, max_new_tokens, plan, sampling, eos,
                   diagnostics, prefill_chunk, correct_every, draft_tokens, top_logprobs=None,
                   kv_dtype=None):
    """`_generate` over the rows of one data shard (all rows without a mesh)."""
    B, T = input_ids.shape
    # the cache holds all but the last token; a speculative round writes γ + 1 past a row's
    # length (rows that finished still run the round's batched compute, unkept)
    capacity = T + max_new_tokens - 1 + (0 if draft_tokens is None else draft_tokens + 1)
    mesh = model.mesh
    # `generate` checks the compiled program's memory (cache and temporaries) before it runs
    cache = kv.allocate(model.config, B, capacity, page_size=plan.page_size, dtype=model.dtype,
                        kv_copies=1 if mesh is None else sharding.kv_copies(model.config, mesh),
                        check_memory=False, kv_dtype=kv_dtype)
    if mesh is not None:
        cache = sharding.constrain(cache, sharding.cache_specs(cache, model.config, mesh), mesh)
    # the cache is made inside this program: the prefill's share is what it leaves free
    prefill_chunk = resolve_prefill_chunk(
        prefill_chunk, model.config, B, T, tile=plan.prefill_tile,
        free_bytes=kv.memory_available() - kv.cache_bytes(cache), span=capacity,
        dtype=model.dtype)
    if prefill_chunk is None:
        prefill_chunk = 0
    logits, cache = _prefill(model, cache, input_ids, lengths, plan, prefill_chunk)
    eos_ids = jnp.asarray(eos if eos else (-1,), jnp.int32)
    pad = eos_ids[0] if eos else jnp.int32(0)
    is_eos = lambda t: jnp.any(t[:, None] == eos_ids[None, :], axis=-1)  # noqa: E731

    key, sub = jax.random.split(rng)
    first = sample(logits, sub, sampling)
    tokens = jnp.full((B, max_new_tokens), pad, jnp.int32).at[:, 0].set(first)
    done = is_eos(first) if eos else jnp.zeros((B,), bool)
    scores = None if top_logprobs is None else _record_logprobs(
        _empty_logprobs(B, max_new_tokens, top_logprobs), 0, logits, first, top_logprobs)
    if draft_tokens is not None:
        return _speculative_loop(model, cache, tokens, done, key, plan=plan, sampling=sampling,
                                 eos_ids=eos_ids if eos else None, draft_tokens=draft_tokens)
    diag = None
    if diagnostics:
        diag = jax.tree.map(lambda x: jnp.zeros((max_new_tokens - 1,) + x.shape, x.dtype),
                            jax.eval_shape(lambda c: _decode_step(model, c, first, plan, True)[2],
                                           cache))

    def cond(s):
        step, _, done, *_ = s
        return (step < max_new_tokens) & ~jnp.all(done)

    def body(s):
        step, tokens, done, num, cache, key, diag, scores = s
        out = _decode_step(model, cache, tokens[:, step - 1], plan, diagnostics)
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
        if top_logprobs is not None:
            scores = _record_logprobs(scores, step, logits, tok, top_logprobs, done)
        num = num + (~done).astype(jnp.int32)
        done = done | is_eos(tok) if eos else done
        return step + 1, tokens, done, num, cache, key, diag, scores

    state = (jnp.int32(1), tokens, done, jnp.ones((B,), jnp.int32), cache, key, diag, scores)
    _, tokens, _, num, _, _, diag, scores = jax.lax.while_loop(cond, body, state)
    if scores is None:
        return GenerateOutput(tokens, num, diag)
    return GenerateOutput(tokens, num, diag, logprobs=scores[0],
                          top_logprobs=scores[1] if top_logprobs else None)


def _empty_logprobs(batch: int, steps: int, top: int):
    """(chosen [B, steps] f32, (ids [B, steps, top] int32, log-probs [B, steps, top] f32))."""
    return (jnp.zeros((batch, steps), jnp.float32),
            (jnp.zeros((batch, steps, top), jnp.int32),
             jnp.zeros((batch, steps, top), jnp.float32)))


def _record_logprobs(scores, step, logits, chosen, top: int, done=None):
    """`scores` with step `step` set from logits [B, vocab]: the log-softmax at the chosen
    tokens [B] and the `top` largest (rows already `done`: left 0)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logp, chosen[:, None], axis=1)[:, 0]
    keep = jnp.ones_like(picked, bool) if done is None else ~done
    out = scores[0].at[:, step].set(jnp.where(keep, picked, 0.0))
    ids, values = scores[1]
    if top:
        best, which = jax.lax.top_k(logp, top)
        ids = ids.at[:, step].set(jnp.where(keep[:, None], which.astype(jnp.int32), 0))
        values = values.at[:, step].set(jnp.where(keep[:, None], best, 0.0))
    return out, (ids, values)


# ---- lossless mode: draft with the method, verify densely -----------------------------------
def draft(model: Model, cache: kv.PagedKVCache, tokens: jax.Array, plan: SparsePlan,
          num_tokens: int, sampling: Sampling, key: jax.Array):
    """`num_tokens` decode steps with `plan` from tokens [B] (the last accepted ones).

    Returns (drafts [B, num_tokens] int32, the logits they were sampled from [B, num_tokens,
    vocab] after temperature / top-k / top-p (None when greedy), cache advanced by num_tokens).
    """
    def step(carry, key):
        cache, token = carry
        logits, cache = _decode_step(model, cache, token, plan)
        if sampling.temperature == 0.0:
            token = sample(logits, key, sampling)
            return (cache, token), (token, None)
        logits = sampling_logits(logits, sampling)
        token = jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
        return (cache, token), (token, logits)

    (cache, _), (drafts, logits) = jax.lax.scan(step, (cache, tokens),
                                                jax.random.split(key, num_tokens))
    return drafts.T, None if logits is None else jnp.moveaxis(logits, 0, 1), cache


def speculative_round(model: Model, cache: kv.PagedKVCache, last: jax.Array, limit: jax.Array,
                      plan: SparsePlan, sampling: Sampling, key: jax.Array, *, draft_tokens: int,
                      eos_ids: jax.Array | None = None):
    """One round of lossless decoding from each row's last accepted token last [B] (not yet
    in the cache; it goes at position cache.lengths): `plan` drafts `draft_tokens` (γ)
    tokens, a dense pass verifies them, the dense model's tokens are kept.

    limit [B]: the most tokens a row may keep (0: a finished row, left as it is).
    Returns (tokens [B, γ + 1], accepted [B] drafts, kept [B], cache): a row's new tokens are
    tokens[:kept], kept = min(accepted + 1, limit), cut after the first of `eos_ids`; the
    cache then holds `last` and the first kept - 1 of them (dense K/V), with the method state
    those alone would have left.
    """
    gamma = draft_tokens
    key_draft, key_accept = jax.random.split(key)
    start = cache.lengths
    prior_before = None if cache.state is None else cache.state.prior
    drafts, q_logits, cache = draft(model, cache, last, plan, gamma, sampling, key_draft)
    p_logits, cache = speculative.verify(model, cache, jnp.concatenate([last[:, None], drafts], 1),
                                         start, jnp.where(limit > 0, gamma + 1, 0))
    if sampling.temperature == 0.0:
        tokens, accepted = speculative.accept_greedy(drafts, p_logits)
    else:
        tokens, accepted = speculative.accept_sampled(
            drafts, sampling_logits(p_logits, sampling), q_logits, key_accept)
    kept = jnp.minimum(accepted + 1, limit)
    if eos_ids is not None:
        hit = (jnp.any(tokens[..., None] == eos_ids, axis=-1)
               & (jnp.arange(gamma + 1)[None, :] < kept[:, None]))
        kept = jnp.where(jnp.any(hit, axis=1), jnp.argmax(hit, axis=1) + 1, kept)
    cache = cache.replace(lengths=start + kept)
    cache = cache.replace(state=method_state.settle_state(plan, cache, prior_before, start, kept,
                                                       gamma + 1))
    return tokens, accepted, kept, cache


def _speculative_loop(model, cache, tokens, done, key, *, plan, sampling, eos_ids, draft_tokens):
    """Rounds of `speculative_round` until every row has its tokens or its EOS.

    tokens [B, max_new] holds each row's first token (from prefill) and padding."""
    B, max_new = tokens.shape
    offsets = jnp.arange(draft_tokens + 1, dtype=jnp.int32)[None, :]
    num = jnp.ones((B,), jnp.int32)
    zero = jnp.zeros((B,), jnp.int32)

    def body(s):
        tokens, num, done, last, cache, key, drafted, accepted = s
        key, sub = jax.random.split(key)
        new, n, kept, cache = speculative_round(
            model, cache, last, jnp.where(done, 0, max_new - num), plan, sampling, sub,
            draft_tokens=draft_tokens, eos_ids=eos_ids)
        at = jnp.where(offsets < kept[:, None], num[:, None] + offsets, max_new)
        tokens = tokens.at[jnp.arange(B)[:, None], at].set(new, mode="drop")
        last = jnp.where(kept > 0, jnp.take_along_axis(new, jnp.maximum(kept - 1, 0)[:, None],
                                                       axis=1)[:, 0], last)
        drafted = drafted + jnp.where(done, 0, draft_tokens)
        accepted = accepted + jnp.where(done, 0, n)
        num = num + kept
        finished = num >= max_new
        if eos_ids is not None:
            finished = finished | jnp.any(last[:, None] == eos_ids, axis=-1)
        return tokens, num, done | finished, last, cache, key, drafted, accepted

    state = (tokens, num, done | (num >= max_new), tokens[:, 0], cache, key, zero, zero)
    tokens, num, _, _, _, _, drafted, accepted = jax.lax.while_loop(
        lambda s: ~jnp.all(s[2]), body, state)
    return GenerateOutput(tokens, num, None, drafted, accepted)


# ---- capacity: what fits on the devices ------------------------------------------------------
def _abstract_model(config, dtype) -> Model:
    """A model of `config` in the per-layer layout, as shapes only (nothing allocated)."""
    return jax.eval_shape(lambda: Model(config, unstack_layers(
        init_params(config, jax.random.key(0), dtype))))


def _abstract_cache(model: Model, batch: int, capacity: int, plan: SparsePlan, kv_copies: int,
                    kv_dtype=None):
    """Shapes of a cache of `batch` rows x `capacity` tokens holding the plan's method state."""
    c = model.config
    make = functools.partial(kv.allocate, c, batch, capacity, page_size=plan.page_size,
                             dtype=model.dtype, kv_copies=kv_copies, check_memory=False,
                             kv_dtype=kv_dtype)
    if plan.selector is None:
        return jax.eval_shape(make)
    width = plan.prefill_tile or 1   # a sparse prefill's chunk is a multiple of its tile
    ids = jnp.zeros((batch, width), jnp.int32)
    return jax.eval_shape(lambda m: _prefill(m, make(), ids, jnp.ones((batch,), jnp.int32),
                                             plan, width)[1], model)


@functools.lru_cache(maxsize=32)
def decode_step_memory(config, batch: int, capacity: int, page_size: int = 16,
                       dtype=jnp.bfloat16, kv_copies: int = 1, plan: SparsePlan | None = None,
                       kv_dtype=None):
    """XLA's memory analysis of a jitted `decode_step` with the cache donated, at these
    shapes (compiled, not run), for a model of `dtype` over a cache of `kv_dtype`: the bytes
    the step needs beside its arguments (weights, cache; `_program_bytes`)."""
    from sparsejax.plan import dense_plan

    plan = dense_plan(config, page_size) if plan is None else plan
    model = _abstract_model(config, jnp.dtype(dtype))
    cache = _abstract_cache(model, batch, capacity, plan, kv_copies, kv_dtype)
    tokens = jax.ShapeDtypeStruct((batch,), jnp.int32)
    step = jax.jit(functools.partial(decode_step, plan=plan), donate_argnums=1)
    return _program_bytes(step.lower(model, cache, tokens).compile())


@functools.lru_cache(maxsize=32)
def prefill_memory(config, batch: int, prompt_len: int, capacity: int, chunk: int,
                   page_size: int = 16, dtype=jnp.bfloat16, kv_copies: int = 1,
                   plan: SparsePlan | None = None, kv_dtype=None):
    """XLA's memory analysis of a jitted `prefill` of `batch` prompts of `prompt_len` tokens,
    `chunk` tokens a step, into a donated cache (of `kv_dtype`) of `capacity` tokens per row
    (compiled, not run; steps of `extend.ROLLED_MIN_TOKENS` or more compile one layer).
    Returns the bytes the prefill needs beside the weights and the cache (`_program_bytes`:
    a chunk's activations and attention buffers)."""
    from sparsejax.plan import dense_plan

    plan = dense_plan(config, page_size) if plan is None else plan
    model = _abstract_model(config, jnp.dtype(dtype))
    cache = jax.eval_shape(functools.partial(
        kv.allocate, config, batch, capacity, page_size=plan.page_size, dtype=model.dtype,
        kv_copies=kv_copies, check_memory=False, kv_dtype=kv_dtype))
    ids = jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
    fill = jax.jit(functools.partial(_prefill, plan=plan, chunk=chunk), donate_argnums=1)
    return _program_bytes(fill.lower(model, cache, ids, lengths).compile())


def _step_temporaries(config, batch, capacity, page_size, dtype, kv_copies, kv_dtype) -> int:
    """What a cache allocated for the step API needs beside itself: the larger of its
    prefill's temporaries (a prompt filling it, the chunk chosen from the free memory) and
    its donated decode step's (the decode step's alone for a cache laid out for a mesh,
    whose prefill runs per device)."""
    from sparsejax.plan import dense_plan

    if kv_copies != 1:
        return decode_step_memory(config, batch, capacity, page_size, dtype, kv_copies,
                                  kv_dtype=kv_dtype)
    plan = dense_plan(config, page_size)
    cache = kv.kv_bytes(config, batch, capacity, page_size=page_size, dtype=dtype,
                        kv_dtype=kv_dtype)
    return program_bytes_at(config, batch, capacity, capacity, plan, dtype,
                            kv.memory_available(), kv_dtype=kv_dtype) - cache


kv.register_step_temporaries(_step_temporaries)


def _device_free(device) -> int:
    """Bytes one device has free (its allocator's limit less what is in use); the host's
    memory for a device that reports none (CPU)."""
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        return stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    return kv.memory_available()


def max_batch(config, context: int, *, dtype=jnp.bfloat16, device=None, method=None,
              page_size: int | None = None, free_bytes: int | None = None,
              kv_dtype=None) -> int:
    """How many rows of `context` tokens (prompt + generated) fit on `device` (default: the
    first) beside what is already on it (load the model first): the largest batch whose cache
    (of `kv_dtype`, default the model's `dtype`; "fp8" about halves its bytes), with the larger
    of its prefill's temporaries (a prompt of `context` tokens in the chunks `generate` would
    choose) and its donated decode step's (XLA's memory analysis of each compiled program,
    with `method`'s state), fits in its free memory (`free_bytes` overrides it). The answer
    `allocate` and `generate` accept."""
    if not isinstance(context, int) or context < 1:
        raise ValueError(f"context={context!r}: expected an int >= 1 (tokens per row)")
    plan = as_plan(method, config, page_size)
    free = _device_free(device or jax.devices()[0]) if free_bytes is None else free_bytes
    dtype = jnp.dtype(dtype)
    kv_dtype = kv.resolve_kv_dtype(kv_dtype, dtype)
    row = kv.kv_bytes(config, 1, context, page_size=plan.page_size, dtype=dtype,
                      kv_dtype=kv_dtype)
    if row > free:
        return 0
    return kv.largest_fitting(
        lambda b: program_bytes_at(config, b, context, context, plan, dtype, free,
                                   kv_dtype=kv_dtype), free, free // row)


def program_bytes_at(config, batch: int, prompt_len: int, capacity: int, plan: SparsePlan,
                     dtype, free: int, kv_copies: int = 1, kv_dtype=None) -> int:
    """Bytes a generate of `batch` rows x `capacity` tokens needs beside the weights: its cache
    (of `kv_dtype`), then the larger of the prefill's temporaries (in the chunk `generate`
    chooses with `free` bytes free) and the donated decode step's (XLA's memory analysis of
    each program)."""
    cache = kv.kv_bytes(config, batch, capacity, page_size=plan.page_size, dtype=dtype,
                        kv_copies=kv_copies, kv_dtype=kv_dtype)
    chunk = choose_prefill_chunk(config, batch, prompt_len, tile=plan.prefill_tile,
                                 free_bytes=free - cache, span=capacity, dtype=dtype)
    step = decode_step_memory(config, batch, capacity, plan.page_size, dtype, kv_copies, plan,
                              kv_dtype)
    fill = prefill_memory(config, batch, prompt_len, capacity, chunk, plan.page_size, dtype,
                          kv_copies, plan, kv_dtype)
    return cache + max(step, fill)


def _shapes_key(args, static):
    leaves, tree = jax.tree.flatten(args)
    return (tree, tuple((x.shape, str(x.dtype), getattr(x, "sharding", None)) for x in leaves),
            tuple(sorted(static.items())))


_checked_runs: dict = {}


def _run_within_memory(args, static):
    """Run `_generate`, first refusing one whose compiled program (cache, temporaries and
    outputs, XLA's memory analysis) needs more than the devices have free. A cache far
    smaller than the free memory runs straight away (no separate compile)."""
    model, input_ids = args[0], args[1]
    B, T = input_ids.shape
    st = static
    capacity = (T + st["max_new_tokens"] - 1
                + (0 if st["draft_tokens"] is None else st["draft_tokens"] + 1))
    plan = st["plan"]
    free = kv.memory_available()
    cache = kv.kv_bytes(model.config, B, capacity, page_size=plan.page_size, dtype=model.dtype,
                        kv_dtype=st["kv_dtype"])
    traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args))
    if traced or kv._ROOM_TO_SPARE * cache <= free:   # inside a jit, or room to spare
        return _generate(*args, **static)
    key = _shapes_key(args, static)
    compiled = _checked_runs.get(key)
    if compiled is None:
        compiled = _generate.lower(*args, **static).compile()
        need = _program_bytes(compiled)
        if need > free:
            largest = None
            if model.mesh is None:
                def need_at(b):
                    ids = jax.ShapeDtypeStruct((b, T), input_ids.dtype)
                    lens = jax.ShapeDtypeStruct((b,), jnp.int32)
                    return _program_bytes(_generate.lower(model, ids, lens, args[3],
                                                          **static).compile())
                # each evaluation compiles generate: two, from the linear estimate
                largest = kv.largest_fitting(need_at, free, B * free // need, limit=B - 1,
                                             evaluations=2)
            raise ValueError(
                f"generate at batch={B} rows x {capacity} tokens (prompt {T} + max_new_tokens "
                f"{st['max_new_tokens']}) needs {need / 2**30:.2f} GiB beside the weights (its "
                f"KV cache {cache / 2**30:.2f} GiB, the rest the prefill's and decode step's "
                f"temporaries); the devices have {free / 2**30:.2f} GiB free"
                + ("" if largest is None else
                   f": at most batch={largest} rows of this context fit"))
        _checked_runs[key] = compiled
    return compiled(*args)


def _program_bytes(compiled) -> int:
    """Device bytes a compiled program needs beside its arguments."""
    m = compiled.memory_analysis()
    return m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
