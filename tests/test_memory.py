"""The KV cache is updated in place, prefill runs in chunks that fit, and what does not fit is
refused before it is allocated.

Copies of the cache are found in XLA's memory analysis of the compiled programs: with the
cache donated, a step's temporaries stay well under one cache; a program that keeps the old
cache alive beside the new one (the negative controls) holds a second copy in temporaries.
"""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparsejax
from sparsejax import cache as kv
from sparsejax import extend as ext
from sparsejax import methods
from sparsejax.generate import _abstract_cache, _generate, _prepare, decode_step
from sparsejax.models import ModelConfig, init_params, unstack_layers
from sparsejax.plan import as_plan

from small_model import CFG, LENGTHS

# 8 layers: a reference kernel's per-layer temporaries are a small share of the cache
DEEP = ModelConfig(model_type="llama", vocab_size=101, hidden_size=64, num_layers=8, num_heads=4,
                   num_kv_heads=2, head_dim=16, intermediate_size=96)
# 2 layers: cheap to compile, for the capacity searches
SHALLOW = ModelConfig(model_type="llama", vocab_size=101, hidden_size=32, num_layers=2,
                      num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=48)


def temp_bytes(compiled) -> int:
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.fixture(scope="module")
def deep():
    return sparsejax.Model(DEEP, init_params(DEEP, jax.random.key(0), std=0.1))


def cache_shapes(model, plan, batch, capacity):
    """A cache with the plan's method state, as shapes (lowering needs no values)."""
    return _abstract_cache(model, batch, capacity, plan, kv_copies=1)


@pytest.mark.parametrize("method", [None, methods.Quest(token_budget=64, page_size=16),
                                    methods.RESA(methods.DELTA().scaled_to(8))])
def test_decode_step_updates_the_donated_cache_in_place(deep, method):
    plan = as_plan(method, DEEP, None)
    cache = cache_shapes(deep, plan, 4, 1024)
    size = kv.cache_bytes(cache)
    tokens = jnp.zeros((4,), jnp.int32)
    step = jax.jit(functools.partial(decode_step, plan=plan), donate_argnums=1)
    compiled = step.lower(deep, cache, tokens).compile()
    assert temp_bytes(compiled) < size / 2
    assert compiled.memory_analysis().alias_size_in_bytes >= size
    # negative control: reading the old cache after the step keeps it alive beside the new one
    def step_and_read_old(model, cache, tokens):
        logits, new = decode_step(model, cache, tokens, plan)
        return logits + cache.k[0, 0, 0, 0, 0] + cache.v[0, 0, 0, 0, 0], new
    copying = jax.jit(step_and_read_old, donate_argnums=1).lower(deep, cache, tokens).compile()
    assert temp_bytes(copying) >= size / 2


def test_prefill_chunk_updates_the_donated_cache_in_place(deep):
    plan = as_plan(None, DEEP, None)
    cache = cache_shapes(deep, plan, 4, 1024)
    size = kv.cache_bytes(cache)
    num = jnp.full((4,), 8, jnp.int32)
    chunk = jax.jit(lambda m, c, t: ext.extend(m, c, t, num), donate_argnums=1)
    compiled = chunk.lower(deep, cache, jnp.zeros((4, 8), jnp.int32)).compile()
    assert temp_bytes(compiled) < size / 2


def cache_copies(compiled, cache) -> int:
    """Copy instructions of an array as large as the K (or V) cache, in any shape, in the
    optimized HLO (a cache-sized copy: the program keeps the old cache alive beside the one it
    writes; the layer loop works on the pages flattened to one pool)."""
    size = int(np.prod(cache.k.shape))
    count = 0
    for line in compiled.as_text().splitlines():
        m = re.search(r"= [a-z0-9]+\[([0-9,]+)\]\{[0-9,]*\} copy\(", line)
        count += bool(m) and int(np.prod([int(d) for d in m.group(1).split(",")])) == size
    return count


QUEST = methods.Quest(token_budget=64, page_size=16)


@pytest.mark.parametrize("method", [QUEST, methods.RESA(methods.DELTA().scaled_to(8),
                                                    fold_decode_tokens=True)])
def test_chunk_correction_and_verify_write_the_donated_cache_in_place(deep, method):
    """A prefill chunk, cache correction (the last N tokens re-run densely; Quest's bounds and
    RESA's folded prior refreshed) and the speculative verify write into the donated cache
    without copying it. (Their temporaries on CPU are the reference attention's gathers, so
    this counts copies in the compiled program.)"""
    from sparsejax.extend import correct
    from sparsejax.speculative import verify

    plan = as_plan(method, DEEP, None)
    cache = cache_shapes(deep, plan, 4, 1024)
    tokens = jnp.zeros((4, 4), jnp.int32)
    start = jnp.zeros((4,), jnp.int32)
    programs = {"chunk": lambda m, c, t: ext.extend(m, c, t, jnp.full((4,), 4, jnp.int32)),
                "correct": functools.partial(correct, plan=plan),
                "verify": lambda m, c, t: verify(m, c, t, start, start)}
    for name, fn in programs.items():
        compiled = jax.jit(fn, donate_argnums=1).lower(deep, cache, tokens).compile()
        assert cache_copies(compiled, cache) == 0, name
        assert compiled.memory_analysis().alias_size_in_bytes >= kv.cache_bytes(cache), name
    # negative control: the old cache read after the write stays alive beside the new one
    keep = jax.jit(lambda m, c, t: (programs["correct"](m, c, t), c.k[0, 0, 0, 0, 0]),
                   donate_argnums=1)
    assert cache_copies(keep.lower(deep, cache, tokens).compile(), cache) >= 1


@pytest.mark.parametrize("method", [None, methods.DELTA().scaled_to(8)])
def test_steps_with_diagnostics_keep_one_cache(deep, method):
    """Decode steps with diagnostics in a scan (a jitted loop of steps): the diagnostics'
    dense reference reads the pages the next layer writes, which made XLA copy the whole page
    pool at every layer (~30x the cache of temporaries on a GPU). Negative control: the loop
    without the tie of each layer's output to its diagnostics (`layers._after`)."""
    from sparsejax import layers as L
    from sparsejax.generate import _decode_step

    model = sparsejax.Model(DEEP, unstack_layers(deep.params))
    plan = as_plan(method, DEEP, None)
    cache = cache_shapes(model, plan, 4, 1024)
    tokens = jnp.zeros((4,), jnp.int32)

    def loop(model, cache, tokens, diagnostics):
        def body(carry, _):
            logits, cache, *diag = _decode_step(model, *carry, plan, diagnostics)
            out = diag[0]["attn_error"] if diagnostics else logits
            return (cache, jnp.argmax(logits, -1).astype(jnp.int32)), out
        return jax.lax.scan(body, (cache, tokens), None, length=4)[1]

    def copies(diagnostics):
        fn = jax.jit(functools.partial(loop, diagnostics=diagnostics), donate_argnums=1)
        return cache_copies(fn.lower(model, cache, tokens).compile(), cache)

    plain = copies(False)       # the loop's own copy of the carried cache on CPU (K and V)
    assert plain <= 2
    assert copies(True) == plain
    original = L._after
    try:   # without the tie of h to the diagnostics
        L._after = lambda h, diag: h
        assert copies(True) >= plain + DEEP.num_layers - 1
    finally:
        L._after = original


@pytest.mark.parametrize("layers", ["unrolled", "rolled"])
def test_generate_holds_one_cache(monkeypatch, layers):
    """generate's cache lives inside the program: one cache of its temporaries, with the
    prefill's layers unrolled (small steps) or rolled into a scan nested in the chunk scan
    (large steps). A second copy (the one-pass prefill's stacked K/V, the old default; a copy
    around a loop) takes it past two.
    12 layers and chunks of 16: the CPU reference attention's per-layer [chunk, context]
    temporaries stay a small share (1.58 caches unrolled, 1.25 rolled). (Correction and
    speculative rounds measure about the same; benchmarks/memory_probe.py checks them on the
    GPU.)"""
    from sparsejax.generate import _generate_rows

    config = ModelConfig(model_type="llama", vocab_size=101, hidden_size=64, num_layers=12,
                         num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96)
    model = sparsejax.Model(config, init_params(config, jax.random.key(0), std=0.1))
    ids = jnp.zeros((4, 192), jnp.int32)
    # the prompt pads to its length bucket, 256: 256 + 63 tokens a row
    size = kv.kv_bytes(config, 4, 256 + 63, dtype=jnp.float32)
    if layers == "rolled":
        monkeypatch.setattr(ext, "ROLLED_MIN_TOKENS", 1)
    args, static = _prepare(model, ids, max_new_tokens=64, prefill_chunk=16)
    # a fresh jit: the rolled choice is read when the program is traced
    program = jax.jit(functools.partial(_generate_rows, **static))
    assert temp_bytes(program.lower(*args).compile()) < 2 * size
    if layers == "rolled":
        return
    # negative control: the one-pass prefill (the default before) holds every layer's prompt
    # K/V beside the cache
    args, static = _prepare(model, ids, max_new_tokens=64, prefill_chunk="one-pass")
    assert temp_bytes(_generate.lower(*args, **static).compile()) >= 2 * size      # 2.8


# ---- prefill in chunks by default ------------------------------------------------------------
def test_chosen_chunk():
    """One step for a prompt that fits the memory share; powers of two, tile multiples and the
    minimum when memory is short; never more than the prompt."""
    big = 1 << 40
    assert ext.choose_prefill_chunk(CFG, 3, 200, free_bytes=big) == 200
    assert ext.choose_prefill_chunk(CFG, 3, 20000, free_bytes=big) == ext.MAX_PREFILL_CHUNK
    assert ext.choose_prefill_chunk(CFG, 3, 200, free_bytes=0) == ext.MIN_PREFILL_CHUNK
    assert ext.choose_prefill_chunk(CFG, 3, 200, tile=48, free_bytes=big) == 240
    assert ext.choose_prefill_chunk(CFG, 3, 2000, tile=48, free_bytes=0) == 48
    # the largest power of two whose step (activations and attention buffers over the span)
    # takes at most 1/ACTIVATION_SHARE of the free memory
    def step(chunk):
        return ext.ACTIVATION_SHARE * ext.prefill_step_bytes(CFG, 2, chunk, 5000)

    assert ext.choose_prefill_chunk(CFG, 2, 5000, free_bytes=step(512)) == 512
    assert ext.choose_prefill_chunk(CFG, 2, 5000, free_bytes=step(512) - 1) == 256
    # the attention's buffers grow with the positions it reads: a longer span, a smaller chunk
    assert ext.choose_prefill_chunk(CFG, 2, 5000, free_bytes=step(512), span=20000) < 512
    assert ext.resolve_prefill_chunk("one-pass", CFG, 1, 9) is None
    assert ext.resolve_prefill_chunk(0, CFG, 1, 9) is None
    for bad in (-1, 2.5, "chunks", True):
        with pytest.raises(ValueError, match="prefill_chunk="):
            ext.resolve_prefill_chunk(bad, CFG, 1, 9)


prefill = jax.jit(sparsejax.prefill, static_argnames=("plan", "chunk"))


QUEST = methods.Quest(page_size=16, token_budget=32)
RESA = methods.RESA(methods.DELTA().scaled_to(6))


@pytest.mark.parametrize("method, layers", [
    (None, "unrolled"), (QUEST, "unrolled"), (RESA, "unrolled"),
    (None, "rolled, per-layer"), (QUEST, "rolled, per-layer"), (RESA, "rolled, per-layer"),
    (None, "rolled, stacked")],
    ids=["dense", "quest", "resa", "dense-rolled", "quest-rolled", "resa-rolled",
         "dense-rolled-stacked"])
def test_default_chunked_prefill_equals_one_pass(model, prompts, monkeypatch, method, layers):
    """With little free memory the default prefill runs the ragged prompts (200, 150 and 93
    tokens: one shorter than a chunk, none a multiple of it) in chunks of 128: logits, the
    cache's valid K/V and the method state (Quest's bounds, RESA's prior) equal one pass's,
    with the layers unrolled (steps this small) or rolled into a scan (larger steps; weights
    picked per layer from either layout)."""
    free = ext.ACTIVATION_SHARE * ext.prefill_step_bytes(CFG, 3, 128, 256)
    monkeypatch.setattr(kv, "memory_available", lambda: free)
    assert ext.choose_prefill_chunk(CFG, 3, prompts.shape[1], span=256) == 128
    if layers.startswith("rolled"):
        monkeypatch.setattr(ext, "ROLLED_MIN_TOKENS", 1)
    if layers == "rolled, per-layer":
        model = sparsejax.Model(CFG, unstack_layers(model.params))
    plan = as_plan(method, CFG, None)
    empty = kv.allocate(CFG, 3, 256, page_size=plan.page_size, dtype=jnp.float32,
                        check_memory=False)
    want, want_cache = prefill(model, empty, prompts, LENGTHS, plan=plan, chunk="one-pass")
    # a fresh jit: the rolled choice is read when the prefill is traced
    fill = jax.jit(functools.partial(sparsejax.prefill, plan=plan))
    got, cache = fill(model, empty, prompts, LENGTHS)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4)
    np.testing.assert_array_equal(np.asarray(cache.lengths), LENGTHS)
    P = plan.page_size
    for b, n in enumerate(LENGTHS):
        pos = np.arange(n)
        pages = np.asarray(cache.page_table)[b, pos // P]
        for x, y in ((cache.k, want_cache.k), (cache.v, want_cache.v)):
            np.testing.assert_allclose(np.asarray(x[:, pages, :, pos % P]),
                                       np.asarray(y[:, pages, :, pos % P]), atol=1e-5)
    got_leaves, tree = jax.tree.flatten(cache.state)
    want_leaves, want_tree = jax.tree.flatten(want_cache.state)
    assert tree == want_tree and (method is None) == (not got_leaves)
    for g, w in zip(got_leaves, want_leaves):
        g, w = np.asarray(g), np.asarray(w)
        np.testing.assert_array_equal(np.isfinite(g), np.isfinite(w))
        np.testing.assert_allclose(g[np.isfinite(w)], w[np.isfinite(w)], atol=1e-4)


# ---- capacity ---------------------------------------------------------------------------------
def test_allocate_refuses_what_does_not_fit_and_names_the_largest_batch(monkeypatch):
    context = 2000
    row = kv.kv_bytes(SHALLOW, 1, context, dtype=jnp.float32)
    free = 20 * row + row // 2
    monkeypatch.setattr(kv, "memory_available", lambda: free)
    largest = sparsejax.max_batch(SHALLOW, context, dtype=jnp.float32, free_bytes=free)
    # the step's temporaries take room beside the cache: fewer rows than the bytes alone allow
    assert 1 <= largest < 20
    kv.allocate(SHALLOW, largest, context, dtype=jnp.float32)
    with pytest.raises(ValueError, match=rf"batch={largest + 1} rows x {context} tokens .*"
                                         rf"at most batch={largest} rows"):
        kv.allocate(SHALLOW, largest + 1, context, dtype=jnp.float32)
    # the step's own memory analysis says the same
    need = lambda b: (kv.kv_bytes(SHALLOW, b, context, dtype=jnp.float32)  # noqa: E731
                      + kv.step_temporaries(SHALLOW, b, context, dtype=jnp.float32))
    assert need(largest) <= free < need(largest + 1)


def test_max_batch_without_room():
    assert sparsejax.max_batch(SHALLOW, 4096, free_bytes=1000) == 0
    with pytest.raises(ValueError, match="context=0"):
        sparsejax.max_batch(SHALLOW, 0)


def test_generate_refuses_what_does_not_fit(monkeypatch):
    """generate compiles first and compares the program's bytes (XLA's memory analysis) with
    the free memory: 6 rows in room for 4 are refused, naming 4, and 4 rows run."""
    from sparsejax.generate import _program_bytes

    model = sparsejax.Model(SHALLOW, init_params(SHALLOW, jax.random.key(0)))
    ids = np.ones((6, 100), np.int32)
    # a fixed chunk: the chosen one would shrink with the free memory (and so would the need)
    run = functools.partial(sparsejax.generate, model, max_new_tokens=28, prefill_chunk=100)
    args, static = _prepare(model, ids[:4], max_new_tokens=28, prefill_chunk=100)
    free = int(1.1 * _program_bytes(_generate.lower(*args, **static).compile()))
    monkeypatch.setattr(kv, "memory_available", lambda: free)
    # at these shapes the CPU reference attention's temporaries are ~30x the cache: compile
    # and check even a cache that small (the shortcut assumes temporaries a fraction of it)
    monkeypatch.setattr(kv, "_ROOM_TO_SPARE", 10**9)
    # the prompt of 100 tokens pads to its length bucket, 128: 128 + 28 - 1 tokens a row
    with pytest.raises(ValueError, match=r"batch=6 rows x 155 tokens.*at most batch=4 rows"):
        run(ids)
    out = run(ids[:4])
    assert out.tokens.shape == (4, 28)


def test_max_batch_counts_the_prefill(monkeypatch):
    """max_batch counts the prefill's temporaries (here the CPU reference attention's, far
    larger than the cache) beside the cache, not only the decode step's: its answer is the
    batch whose whole generate program (one memory analysis of everything it runs) fits, and
    generate refuses one row more."""
    from sparsejax.generate import _program_bytes, decode_step_memory, program_bytes_at
    from sparsejax.plan import dense_plan

    context, f32 = 256, jnp.dtype(jnp.float32)
    plan = dense_plan(SHALLOW, 16)
    def need(batch, free):
        return program_bytes_at(SHALLOW, batch, context, context, plan, f32, free)

    # the chunk is chosen from what the cache leaves free: near 1 MB, the smallest
    free = (need(5, 10**6) + need(6, 10**6)) // 2
    assert need(5, free) <= free < need(6, free)
    assert sparsejax.max_batch(SHALLOW, context, dtype=f32, free_bytes=free) == 5
    # counting the decode step alone would have taken a sixth row
    assert (kv.kv_bytes(SHALLOW, 6, context, dtype=f32)
            + decode_step_memory(SHALLOW, 6, context, 16, f32)) <= free
    model = sparsejax.Model(SHALLOW, init_params(SHALLOW, jax.random.key(0)))
    monkeypatch.setattr(kv, "memory_available", lambda: free)
    monkeypatch.setattr(kv, "_ROOM_TO_SPARE", 10**9)   # compile and check even a small cache
    ids = np.ones((6, context), np.int32)
    for batch in (5, 6):
        args, static = _prepare(model, ids[:batch], max_new_tokens=1)
        whole = _program_bytes(_generate.lower(*args, **static).compile())
        assert (whole <= free) == (batch == 5), (batch, whole, free)
    with pytest.raises(ValueError, match=r"batch=6 rows x 256 tokens.*at most batch=5 rows"):
        sparsejax.generate(model, ids, max_new_tokens=1)
