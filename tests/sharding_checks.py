"""Tensor-parallel checks on 8 host devices, run by test_sharding.py in a subprocess (the
device count must be set before JAX starts). Writes one JSON object, check name -> result,
to the path given as its argument.

Every sharded run is compared with the same call unsharded (mesh=None) in this process.
"""
import json
import os
import sys
import tempfile

# 8 host devices; and cheaper CPU code generation, which halves the compile time that these
# checks are made of (every comparison is between two runs compiled alike).
os.environ["XLA_FLAGS"] = " ".join([
    os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8",
    "--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"]).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

import sparsejax  # noqa: E402
from sparsejax import methods, sharding  # noqa: E402
from sparsejax.models import ModelConfig, init_params, unstack_layers  # noqa: E402
from sparsejax.plan import as_plan  # noqa: E402

LAYERS, HEADS = 3, 8
LENGTHS = np.array([40, 29, 13, 34], np.int32)
NEW_TOKENS = 3


def config(kv_heads: int, heads: int = HEADS) -> ModelConfig:
    return ModelConfig(model_type="llama", vocab_size=128, hidden_size=32, num_layers=LAYERS,
                       num_heads=heads, num_kv_heads=kv_heads, head_dim=16, intermediate_size=64)


def model(kv_heads: int, stacked: bool = False) -> sparsejax.Model:
    """Per-layer fused weights, as `from_pretrained` returns them (or the stacked training
    layout)."""
    c = config(kv_heads)
    params = init_params(c, jax.random.key(kv_heads), std=0.1)
    return sparsejax.Model(c, params if stacked else unstack_layers(params))


def prompts() -> np.ndarray:
    rng = np.random.default_rng(0)
    ids = np.zeros((len(LENGTHS), LENGTHS.max()), np.int32)
    for i, n in enumerate(LENGTHS):
        ids[i, :n] = rng.integers(0, 128, n)
    return ids


def all_methods(kv_heads: int) -> dict:
    """Every method, with budgets well under the prompts so that selection matters. Kascade's
    head map sends KV heads to sets chosen on other devices; Lychee has hybrid layers."""
    head_map = np.array([list(range(kv_heads)), list(range(kv_heads))[::-1],
                         [kv_heads - 1] * kv_heads])
    retrieval = np.zeros((LAYERS, kv_heads), bool)
    retrieval[1, 0] = True
    lychee = methods.Lychee(retrieval, budget=methods.TopK(12), sinks=4, recent=4)
    delta = methods.DELTA(dense_layers=(0,), delta_layers=(1,), page_size=8, budget_pages=2,
                          recent_pages=1)
    extra = {}
    if kv_heads == 4:   # pairs of KV heads swap sets: on 2 KV heads per device, a map that
        # stays on each device, applied there (on data=2,model=2)
        extra["kascade_head_map_on_device"] = methods.Kascade(
            anchor_layers=(0, 1), ratio=0.25, min_k=4,
            head_map=np.array([[0, 1, 2, 3], [1, 0, 3, 2], [1, 1, 2, 2]]))
    return {
        **extra,
        "dense": methods.Dense(),
        "delta": delta,
        "kascade": methods.Kascade(anchor_layers=(0, 1), ratio=0.25, min_k=4, head_map=head_map),
        "kascade_pooled": methods.Kascade(anchor_layers=(0, 1), ratio=0.25, min_k=4,
                                          pooled_all_heads=True),
        # layer 1 attends to its own top-k (a SELF layer: the scores pass without V)
        "kascade_sparse_anchors": methods.Kascade(anchor_layers=(0, 1), ratio=0.25, min_k=4,
                                                  head_map=head_map, sparse_anchors=True),
        "lychee": lychee,
        "quest": methods.Quest(page_size=8, token_budget=16, dense_layers=1),
        "tidal": methods.TidalDecode(dense_layers=(0,), select_layers=(1,), k=12),
        "oracle": methods.OracleTopK(k=10),
        "streaming": methods.StreamingLLM(sinks=4, window=8),
        "lychee+resa": methods.RESA(lychee),
        "delta+resa": methods.RESA(delta, fold_decode_tokens=True),
    }


# Generation paths beyond one-pass prefill + decode steps, each against the same call unsharded:
# name -> (method name, generate keywords, mesh). Replicated KV heads (kv 2 on model=4) for the
# paths that carry per-KV-head selections across devices; divided ones on data x model.
PATHS = {
    "sparse_prefill": ("kascade_tiles", {}, "kv2/model=4"),
    "speculative": ("lychee", dict(draft_tokens=2), "kv2/model=4"),
    "correct_every": ("delta+resa", dict(correct_every=2), "kv2/model=4"),
    "chunked_prefill": ("quest", dict(prefill_chunk=16), "kv4/data=2,model=2"),
    "speculative_quest": ("quest", dict(draft_tokens=3), "kv4/data=2,model=2"),
}


def mesh(model_size: int, data: int = 0, axis_type=AxisType.Auto):
    shape, names = ((data, model_size), ("data", "model")) if data else ((model_size,), ("model",))
    return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))


def spec(x) -> list:
    """A sharding's spec as JSON: one mesh axis (or None) per dimension; axes of size 1
    shard nothing and read as None."""
    sizes = x.sharding.mesh.shape
    s = tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))
    return [a if a is not None and sizes[a] > 1 else None for a in s]


# ---- generate: every method, sharded == unsharded --------------------------------------------
# (kv_heads, mesh name, mesh, methods or ALL). With 4 KV heads every method runs with each KV
# head held by 2 of 8 ranks, and on a data x model mesh with explicit axes (KV heads divided);
# with 2 KV heads, each held by 4 ranks (Kascade: head map and all-gathered selections).
ALL = None
RUNS = [
    (4, "model=8", lambda: mesh(8), ALL),
    (4, "data=2,model=2 explicit", lambda: mesh(2, 2, AxisType.Explicit), ALL),
    (4, "model=4", lambda: mesh(4), ("kascade",)),
    (2, "model=8", lambda: mesh(8), ("kascade", "kascade_sparse_anchors")),
    (2, "model=2", lambda: mesh(2), ("delta",)),
    (2, "model=1", lambda: mesh(1), ("dense", "delta")),
]
PATH_MESHES = {"kv2/model=4": (2, lambda: mesh(4)), "kv4/data=2,model=2": (4, lambda: mesh(2, 2))}


def path_methods(kv_heads: int) -> dict:
    table = all_methods(kv_heads)
    table["kascade_tiles"] = methods.Kascade(anchor_layers=(0, 1), ratio=0.25, min_k=4,
                                             head_map=table["kascade"].head_map,
                                             sparse_prefill=True, prefill_tile=16)
    return table


def generate_checks(results: dict) -> None:
    ids = prompts()
    for kv_heads in (4, 2):
        m = model(kv_heads)
        table = all_methods(kv_heads)
        runs = [(name, make_mesh, names or tuple(table))
                for heads, name, make_mesh, names in RUNS if heads == kv_heads]
        want = {name: np.asarray(sparsejax.generate(m, ids, lengths=LENGTHS,
                                                    max_new_tokens=NEW_TOKENS,
                                                    method=table[name]).tokens)
                for name in table if any(name in names for _, _, names in runs)}
        results[f"kv{kv_heads}/differ_from_dense"] = sorted(
            name for name in want if "dense" in want and not np.array_equal(want[name],
                                                                           want["dense"]))
        for mesh_name, make_mesh, names in runs:
            msh = make_mesh()
            for name in names:
                out = sparsejax.generate(m, ids, lengths=LENGTHS, max_new_tokens=NEW_TOKENS,
                                         method=table[name], mesh=msh)
                results[f"generate/kv{kv_heads}/{mesh_name}/{name}"] = {
                    "want": want[name].tolist(), "got": np.asarray(out.tokens).tolist(),
                    "spec": spec(out.tokens)}


def path_checks(results: dict) -> None:
    """Chunked and sparse prefill, cache correction and speculative decoding on meshes with
    replicated (kv 2 on model=4) and divided (kv 4 on data x model) KV heads."""
    ids = prompts()
    for mesh_name, (kv_heads, make_mesh) in PATH_MESHES.items():
        m, table, msh = model(kv_heads), path_methods(kv_heads), make_mesh()
        for path, (name, kw, where) in PATHS.items():
            if where != mesh_name:
                continue
            run = lambda mesh: np.asarray(sparsejax.generate(  # noqa: E731
                m, ids, lengths=LENGTHS, max_new_tokens=NEW_TOKENS + 1, method=table[name],
                mesh=mesh, **kw).tokens).tolist()
            results[f"path/{mesh_name}/{path}"] = {"want": run(None), "got": run(msh)}
    # diagnostics (dense reference attention in the global view) against the unsharded ones
    m, table = model(2), all_methods(2)
    for name in ("lychee", "kascade"):
        diag = [sparsejax.generate(m, ids, lengths=LENGTHS, max_new_tokens=NEW_TOKENS,
                                   method=table[name], return_diagnostics=True,
                                   mesh=msh).diagnostics for msh in (None, mesh(4))]
        results[f"diagnostics/kv2/model=4/{name}"] = {
            key: float(np.max(np.abs(np.asarray(diag[0][key]) - np.asarray(diag[1][key]))))
            for key in ("recall", "oracle_recall", "attn_error")}
        results[f"diagnostics/kv2/model=4/{name}"]["min_recall"] = float(
            np.min(np.asarray(diag[0]["recall"])))
    m = model(4, stacked=True)
    results["path/stacked/model=2/delta"] = {
        "want": np.asarray(sparsejax.generate(m, ids, lengths=LENGTHS, max_new_tokens=NEW_TOKENS,
                                              method=all_methods(4)["delta"]).tokens).tolist(),
        "got": np.asarray(sparsejax.generate(m, ids, lengths=LENGTHS, max_new_tokens=NEW_TOKENS,
                                             method=all_methods(4)["delta"],
                                             mesh=mesh(2)).tokens).tolist()}


# ---- an fp8 cache: sharded == unsharded ------------------------------------------------------
# name -> (kv heads, mesh, method name, generate keywords): the scales travel with the pages
# through every per-device path (KV heads divided on data x model, replicated on model=4)
FP8_RUNS = {
    "kv4/data=2,model=2/dense": (4, lambda: mesh(2, 2), "dense", {}),
    "kv4/data=2,model=2/quest_chunked": (4, lambda: mesh(2, 2), "quest", dict(prefill_chunk=16)),
    "kv4/data=2,model=2/lychee+resa": (4, lambda: mesh(2, 2), "lychee+resa", {}),
    "kv2/model=4/kascade_sparse_anchors": (2, lambda: mesh(4), "kascade_sparse_anchors", {}),
    "kv2/model=4/kascade_tiles": (2, lambda: mesh(4), "kascade_tiles", {}),
    "kv2/model=4/lychee_speculative": (2, lambda: mesh(4), "lychee", dict(draft_tokens=2)),
    "kv2/model=4/delta+resa_correct": (2, lambda: mesh(4), "delta+resa", dict(correct_every=2)),
}


def fp8_checks(results: dict) -> None:
    ids = prompts()
    for case, (kv_heads, make_mesh, name, kw) in FP8_RUNS.items():
        m, method = model(kv_heads), path_methods(kv_heads)[name]
        run = lambda msh: np.asarray(sparsejax.generate(  # noqa: E731
            m, ids, lengths=LENGTHS, max_new_tokens=NEW_TOKENS + 1, method=method, mesh=msh,
            kv_dtype="fp8", **kw).tokens).tolist()
        results[f"fp8/{case}"] = {"want": run(None), "got": run(make_mesh())}
    # the control: the runs read an fp8 cache (the log-probabilities differ from an f32 one's)
    logprobs = [np.asarray(sparsejax.generate(model(4), ids, lengths=LENGTHS, max_new_tokens=2,
                                              logprobs=True, kv_dtype=kv_dtype).logprobs)
                for kv_dtype in ("fp8", None)]
    results["fp8/logprob_difference_from_f32"] = float(np.max(np.abs(logprobs[0] - logprobs[1])))
    cache = sparsejax.allocate(config(2), 4, 48, page_size=8, mesh=mesh(4, 2), kv_dtype="fp8",
                               dtype=jnp.float32)
    results["fp8/specs"] = {name: spec(getattr(cache, name))
                            for name in ("k", "v", "k_scale", "v_scale")}
    results["fp8/dtypes"] = [str(cache.k.dtype), str(cache.k_scale.dtype)]


# ---- layout: parameters, cache, logits -------------------------------------------------------
def layout_checks(results: dict) -> None:
    """prefill + 2 decode steps (DELTA + RESA: selection and per-head state) on a data x model
    mesh with KV heads replicated, under the caller's jit: logits and caches against the same
    calls unsharded, and every output's partition spec."""
    m = model(2)
    msh = mesh(4, 2)
    ids = prompts()
    method = methods.RESA(all_methods(2)["delta"])
    plan = as_plan(method, m.config, None)
    capacity = int(LENGTHS.max()) + 2

    def run(mesh):
        params = m if mesh is None else sparsejax.shard(m, mesh)
        cache = sparsejax.allocate(m.config, len(LENGTHS), capacity, page_size=plan.page_size,
                                   dtype=jnp.float32, mesh=mesh)
        pre = jax.jit(lambda mo, c, i, n: sparsejax.prefill(mo, c, i, n, plan, mesh=mesh))
        step = jax.jit(lambda mo, c, t: sparsejax.decode_step(mo, c, t, plan, mesh=mesh))
        logits, cache = pre(params, cache, jnp.asarray(ids), jnp.asarray(LENGTHS))
        trace = [logits]
        for _ in range(2):
            logits, cache = step(params, cache, jnp.argmax(logits, -1).astype(jnp.int32))
            trace.append(logits)
        return params, trace, cache

    _, want_logits, want_cache = run(None)
    params, got_logits, got_cache = run(msh)
    copies = sharding.kv_copies(m.config, msh)
    results["layout/kv_copies"] = copies
    results["layout/logits_max_abs_diff"] = float(max(
        np.max(np.abs(np.asarray(a) - np.asarray(b))) for a, b in zip(want_logits, got_logits)))
    # each KV head twice in a row; equal up to the all-reduces' summation order
    results["layout/cache_k_max_abs_diff"] = float(np.max(np.abs(
        np.repeat(np.asarray(want_cache.k), copies, axis=2) - np.asarray(got_cache.k))))
    results["layout/prior_o_est_max_abs_diff"] = float(np.max(np.abs(
        np.asarray(want_cache.state.prior.o_est) - np.asarray(got_cache.state.prior.o_est))))
    results["layout/specs"] = {
        "logits": spec(got_logits[-1]), "k": spec(got_cache.k), "v": spec(got_cache.v),
        "page_table": spec(got_cache.page_table), "lengths": spec(got_cache.lengths),
        "prior.mu_q": spec(got_cache.state.prior.mu_q),
        "prior.mu_k": spec(got_cache.state.prior.mu_k),
        **{f"params.{name}": spec(x) for name, x in
           [("embed", params.params["embed"]), ("lm_head", params.params["lm_head"]),
            ("final_norm", params.params["final_norm"])] +
           list(params.params["layers"][1].items())},
    }
    with tempfile.TemporaryDirectory() as tmp:   # a checkpoint loaded straight onto the mesh
        sparsejax.save_pretrained(m, tmp)
        loaded = sparsejax.from_pretrained(tmp, dtype=jnp.float32, mesh=msh)
        placed = sparsejax.shard(sparsejax.from_pretrained(tmp, dtype=jnp.float32), msh)
    pairs = list(zip(jax.tree.leaves_with_path(loaded.params),
                     jax.tree.leaves_with_path(placed.params)))
    results["layout/from_pretrained_mesh"] = dict(
        same_tree=jax.tree.structure(loaded.params) == jax.tree.structure(placed.params),
        max_abs_diff=float(max(np.max(np.abs(np.asarray(a) - np.asarray(b)))
                               for (_, a), (_, b) in pairs)),
        different_specs=[jax.tree_util.keystr(p) for (p, a), (_, b) in pairs
                         if spec(a) != spec(b)],
        mesh_recorded=loaded.mesh is msh)
    results["layout/kv4_wk_spec"] = spec(sparsejax.shard(model(4), msh).params["layers"][0]["wk"])
    results["layout/stacked_wq_spec"] = spec(
        sparsejax.shard(model(4, stacked=True), msh).params["layers"]["wq"])


# ---- the jobs: calibration and gate training ---------------------------------------------------
EAGER_MESHES = {"model=2": lambda: mesh(2, axis_type=AxisType.Explicit),
                "data=2,model=2": lambda: mesh(2, 2, AxisType.Explicit)}
EAGER_CHUNKS = (None, 16)


def eager_checks(results: dict) -> None:
    """The step API called as the README shows it, eagerly (no caller's jit) on explicit
    meshes: prefill in one pass and in chunks, then a decode step, against the same calls
    unsharded (max abs difference of their logits)."""
    m, ids = model(4), jnp.asarray(prompts())
    plan = as_plan(methods.Dense(), m.config, 8)

    def run(mesh, chunk):
        params = m if mesh is None else sparsejax.shard(m, mesh)
        cache = sparsejax.allocate(m.config, len(LENGTHS), int(LENGTHS.max()) + 1, page_size=8,
                                   dtype=jnp.float32, mesh=mesh)
        logits, cache = sparsejax.prefill(params, cache, ids, jnp.asarray(LENGTHS), plan,
                                          chunk=chunk)
        step, _ = sparsejax.decode_step(params, cache, jnp.argmax(logits, -1), plan)
        return np.asarray(logits), np.asarray(step)

    for chunk in EAGER_CHUNKS:
        want = run(None, chunk)
        for name, make in EAGER_MESHES.items():
            got = run(make(), chunk)
            results[f"eager/{name}/chunk={chunk}"] = float(max(
                np.max(np.abs(a - b)) for a, b in zip(want, got)))


def job_checks(results: dict, tmp_dir: str) -> None:
    """DELTA's shift probe and Kascade's similarity, and 3 steps of gate training, on a mesh
    against the same calls without."""
    from sparsejax.train import calibrate, gates
    from sparsejax.train.passkey import PasskeyData
    from sparsejax.train.tokenizer import save_tokenizer

    m, ids = model(2), prompts()
    measure = dict(lengths=LENGTHS, decode_steps=2, batch_size=4, progress=False)
    shift = [calibrate.attention_shift(m, ids, mesh=msh, **measure) for msh in (None, mesh(4))]
    sim = [calibrate.kascade_similarity(m, ids, k=4, mesh=msh, **measure)[0]
           for msh in (None, mesh(4))]
    results["jobs/shift_max_abs_diff"] = float(np.max(np.abs(shift[0] - shift[1])))
    results["jobs/shift_min"] = float(np.min(shift[0]))
    results["jobs/similarity_max_abs_diff"] = float(np.nanmax(np.abs(sim[0] - sim[1])))
    tokenizer = sparsejax.load_tokenizer(save_tokenizer(tmp_dir, 1024))
    c = ModelConfig(model_type="llama", vocab_size=1024, hidden_size=64, num_layers=3,
                    num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96)
    gm = sparsejax.Model(c, init_params(c, jax.random.key(0), std=0.3))
    data = PasskeyData(tokenizer, min_length=60, max_length=80, num_passkeys=2,
                       passkey_words=8, batch_size=2)
    states = [gates.train_gates(gm, data, target_retrieval_heads=2, steps=3, lr=0.1,
                                lambda_lr=0.3, sinks=4, recent=8, progress=False, mesh=msh)
              for msh in (None, mesh(2))]
    results["jobs/gates_mean_max_abs_diff"] = float(np.max(np.abs(
        states[0].mean() - states[1].mean())))
    results["jobs/gates_moved"] = float(np.max(np.abs(states[0].params["log_a"])))  # from 0


# ---- collectives in the compiled sharded decode step -------------------------------------------
# Llama-3.1-8B's layout at TP=4 in miniature: 8 KV heads, 2 per device on model=4
COLLECTIVE_KV_HEADS, COLLECTIVE_BATCH, COLLECTIVE_CAPACITY = 8, 4, 48
COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                    "collective-permute")


def collective_methods() -> dict:
    """The methods the benchmark runs, and Kascade's head map three ways: the identity, one
    that keeps every KV head on its device (pairs swapped, then one set shared per pair),
    and all_methods' map, whose last layer reads one device's set everywhere."""
    table = all_methods(COLLECTIVE_KV_HEADS)
    kascade = dict(anchor_layers=(0, 1), ratio=0.25, min_k=4)
    on_device = np.array([range(8), [1, 0, 3, 2, 5, 4, 7, 6], [0, 0, 3, 3, 4, 4, 6, 6]])
    return {
        "dense": table["dense"], "delta": table["delta"], "lychee": table["lychee"],
        "tidal": table["tidal"],
        "kascade": methods.Kascade(**kascade),
        "kascade_head_map_on_device": methods.Kascade(**kascade, head_map=on_device),
        "kascade_head_map_across": table["kascade"],
        "kascade_sparse_anchors": table["kascade_sparse_anchors"],
    }


def collectives(compiled_text: str) -> list:
    """[kind, result shape] of every collective in an optimized HLO module, in order."""
    import re
    pattern = re.compile(r"= (\S+?)(?:\{[^}]*\})? (" + "|".join(COLLECTIVE_KINDS)
                         + r")(?:-start)?\(")
    return [[m.group(2), m.group(1)] for m in map(pattern.search, compiled_text.splitlines())
            if m]


def top_k_shapes(jaxpr) -> list:
    """The operand shape of every `lax.top_k` in a jaxpr and the jaxprs inside it, in order
    (inside a shard_map: one device's)."""
    shapes = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "top_k":
            shapes.append(list(eqn.invars[0].aval.shape))
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    shapes += top_k_shapes(inner)
    return shapes


def collective_checks(results: dict) -> None:
    """Every collective of the jitted decode step compiled on model=4 (not run), per method,
    and the rows of each top-k (CPU runs `lax.top_k`) on one device."""
    from sparsejax.plan import as_plan

    c = ModelConfig(model_type="llama", vocab_size=128, hidden_size=32, num_layers=LAYERS,
                    num_heads=16, num_kv_heads=COLLECTIVE_KV_HEADS, head_dim=16,
                    intermediate_size=64)
    msh = mesh(4)
    m = sparsejax.shard(sparsejax.Model(c, unstack_layers(init_params(c, jax.random.key(0)))),
                        msh)
    step = jax.jit(sparsejax.decode_step, static_argnames=("plan",))
    tokens = jnp.zeros((COLLECTIVE_BATCH,), jnp.int32)
    for name, method in collective_methods().items():
        plan = as_plan(method, c, None)
        cache = sparsejax.allocate(c, COLLECTIVE_BATCH, COLLECTIVE_CAPACITY,
                                   page_size=plan.page_size, dtype=jnp.float32, mesh=msh)
        compiled = step.lower(m, cache, tokens, plan=plan).compile().as_text()
        results[f"collectives/{name}"] = collectives(compiled)
        jaxpr = jax.make_jaxpr(lambda *a, plan=plan: sparsejax.decode_step(*a, plan))(
            m, cache, tokens)
        results[f"top_k/{name}"] = top_k_shapes(jaxpr.jaxpr)


# ---- bad meshes ------------------------------------------------------------------------------
def error_checks(results: dict) -> None:
    m = model(2)
    ids = prompts()

    def error(fn):
        try:
            fn()
        except (ValueError, TypeError) as e:
            return f"{type(e).__name__}: {e}"
        return None

    odd = ModelConfig(model_type="llama", vocab_size=128, hidden_size=32, num_layers=1,
                      num_heads=12, num_kv_heads=3, head_dim=16, intermediate_size=64)
    results["errors"] = {
        "no_model_axis": error(lambda: sparsejax.generate(
            m, ids, lengths=LENGTHS, max_new_tokens=1,
            mesh=jax.make_mesh((2,), ("data",), axis_types=(AxisType.Auto,)))),
        "heads_not_divisible": error(lambda: sparsejax.shard(m, mesh(3))),
        "kv_heads_cannot_replicate": error(lambda: sharding.check_mesh(mesh(4), odd)),
        "unknown_axis": error(lambda: sparsejax.shard(m, jax.make_mesh(
            (2, 2), ("model", "pipe"), axis_types=(AxisType.Auto,) * 2))),
        "batch_not_divisible": error(lambda: sparsejax.generate(
            m, ids[:3], lengths=LENGTHS[:3], max_new_tokens=1, mesh=mesh(2, 2))),
        "not_a_mesh": error(lambda: sparsejax.shard(m, "model=2")),
    }


if __name__ == "__main__":
    results = {"devices": jax.device_count()}
    if sys.argv[2:] == ["collectives"]:   # compiles only: its own, short run
        collective_checks(results)
        with open(sys.argv[1], "w") as f:
            json.dump(results, f)
        sys.exit(0)
    for checks in (error_checks, layout_checks, eager_checks, path_checks, generate_checks,
                   fp8_checks):
        checks(results)
    with tempfile.TemporaryDirectory() as tmp:
        job_checks(results, tmp)
    with open(sys.argv[1], "w") as f:
        json.dump(results, f)
