"""Calibration: DELTA's layer-shift probe and Kascade's anchor layers with head remapping.

Both run dense greedy decoding over a few prompts and measure, after every decode step, every
layer's attention of that step's query over the cache (`paged_decode_attention`):

  DELTA (App. D)   attention_shift -> suggest_delta_layers
  Kascade (§3.2-3.5, Alg. 1)
                   kascade_similarity -> layer_similarity -> select_anchor_layers -> head_mapping

The choice is kept in a calibration file (`sparsejax.artifacts.save_calibration`) that names
the model it was made for; `methods.DELTA/Kascade.from_calibration` read it.
`sparsejax calibrate` runs the whole job from the command line:

    sparsejax calibrate --model DIR --text book.txt notes.jsonl --samples 8 --context 2048
        (both methods from one decoding pass; DIR/calibration/{delta,kascade}.json)
    sparsejax calibrate --method kascade --task niah,vt --samples 16 --context 2048 \
        --decode-steps 16 --anchors 5 --out kascade.json --plot plots/
        (--task: the synthetic tasks for the embedded model's vocabulary, else the prose
        tasks of `sparsejax.tasks`, as `sparsejax eval` runs them)
"""
from __future__ import annotations

import functools
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from sparsejax import sharding
from sparsejax.artifacts import CALIBRATED_METHODS, save_calibration
from sparsejax.cache import layer_page_ids, layer_pages
from sparsejax.files import check_writable, read_text
from sparsejax.generate import decode_step, prefill
from sparsejax.models import Model
from sparsejax.pallas_kernels import paged_decode_attention
from sparsejax.plan import dense_plan

log = logging.getLogger("sparsejax")


# ---- dense decoding with per-step measurements ----------------------------------------------
@jax.jit
def _prefill(model, cache, input_ids, lengths):
    logits, cache = prefill(model, cache, input_ids, lengths, dense_plan(model.config,
                                                                         cache.page_size))
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache


@functools.partial(jax.jit, static_argnames=("measure", "options"), donate_argnames=("cache",))
def _step(model, cache, tokens, *, measure, options):
    """One greedy dense decode step, then `measure(model, cache, diagnostics, *options)`."""
    logits, cache, diag = decode_step(model, cache, tokens,
                                      dense_plan(model.config, cache.page_size), diagnostics=True)
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache, measure(model, cache, diag,
                                                                          *options)


def _check_prompts(prompts, lengths, decode_steps):
    prompts = np.asarray(prompts)
    if prompts.ndim != 2 or prompts.shape[0] < 1 or prompts.shape[1] < 1 or not np.issubdtype(
            prompts.dtype, np.integer):
        raise ValueError(f"prompts has shape {prompts.shape} ({prompts.dtype}): expected "
                         "right-padded token ids [num_prompts >= 1, seq >= 1]")
    N, T = prompts.shape
    lengths = np.full((N,), T) if lengths is None else np.asarray(lengths)
    if lengths.shape != (N,):
        raise ValueError(f"lengths has shape {lengths.shape}: expected ({N},)")
    if lengths.min() < 1 or lengths.max() > T:
        raise ValueError(f"lengths range over [{lengths.min()}, {lengths.max()}]: expected "
                         f"1 <= length <= {T}")
    if not isinstance(decode_steps, (int, np.integer)) or decode_steps < 1:
        raise ValueError(f"decode_steps={decode_steps!r}: expected an int >= 1")
    return prompts.astype(np.int32), lengths.astype(np.int32)


def _measure_decoding(model: Model, prompts, lengths, *, decode_steps: int, batch_size: int,
                      measure, options=(), progress: bool, desc: str, mesh=None):
    """Dense greedy decoding of `prompts` in batches; yields, per batch, `measure`'s outputs
    (each [rows, ...]) stacked over the decode steps: [decode_steps, rows, ...] numpy.
    `mesh`: decode tensor-parallel on it (`sparsejax.shard`; a placed model runs on its own);
    the per-layer score kernel of the measurements then reads K/V gathered by the
    partitioner (calibration is offline: correctness over speed)."""
    from tqdm.auto import tqdm

    prompts, lengths = _check_prompts(prompts, lengths, decode_steps)
    if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r}: expected an int >= 1")
    N, T = prompts.shape
    model.config.check_context(T + decode_steps)
    B = min(batch_size, N)
    if mesh is not None:
        model = sharding.shard(model, mesh)
    with tqdm(total=N * decode_steps, desc=desc, unit="token", disable=not progress) as bar:
        for start in range(0, N, B):
            rows = min(B, N - start)
            # A short last batch is filled with copies of its first prompt (dropped below), so
            # every batch has one shape and the step compiles once.
            pick = np.concatenate([np.arange(start, start + rows), np.full(B - rows, start)])
            cache = sharding.allocate(model.config, B, T + decode_steps, dtype=model.dtype,
                             mesh=model.mesh)
            tokens, cache = _prefill(model, cache, prompts[pick], lengths[pick])
            steps = []
            for _ in range(decode_steps):
                tokens, cache, out = _step(model, cache, tokens, measure=measure,
                                           options=options)
                steps.append(out)
                jax.block_until_ready(tokens)
                bar.update(rows)
            yield jax.tree.map(lambda *xs: np.stack([np.asarray(x[:rows]) for x in xs]), *steps)


def _layer_scores(model, cache, query, score: str) -> jax.Array:
    """`paged_decode_attention`'s `score` for every layer's query of this step.

    query [L, B, HQ, D] -> [L, B, heads, max_pages * P] f32, 0 past each row's length. The
    layers are folded into the kernel's batch, each reading its pages of the flattened cache.
    """
    L, B = query.shape[:2]
    layers = jnp.arange(L, dtype=jnp.int32)[:, None, None]
    tables = layer_page_ids(cache.page_table[None], layers, cache.num_pages).reshape(L * B, -1)
    k, v = layer_pages(cache.k), layer_pages(cache.v)
    copies = k.shape[1] // model.config.num_kv_heads
    if copies > 1:   # a cache laid out for a mesh holds each KV head `copies` times: one
        # copy of each, from K/V gathered first (an explicit-axes mesh refuses a strided slice
        # of the sharded head axis)
        whole = NamedSharding(model.mesh, PartitionSpec())
        k, v = (jax.sharding.reshard(x, whole)[:, ::copies] for x in (k, v))
    scores = paged_decode_attention(
        query.reshape((L * B,) + query.shape[2:]), k, v, tables, jnp.tile(cache.lengths, L),
        score=score).scores
    scores = scores.reshape((L, B) + scores.shape[1:])
    return jnp.where(jnp.isfinite(scores), scores, 0.0)


def _cosine(x: jax.Array, y: jax.Array) -> jax.Array:
    """Cosine similarity over the last axis (f32)."""
    x, y = x.astype(jnp.float32), y.astype(jnp.float32)
    norms = jnp.linalg.norm(x, axis=-1) * jnp.linalg.norm(y, axis=-1)
    return jnp.sum(x * y, axis=-1) / jnp.maximum(norms, jnp.finfo(jnp.float32).tiny)


# ---- DELTA: the layer-shift probe -----------------------------------------------------------
def _shift_measure(model, cache, diag):
    """-> [B, L-1]: 1 - cos between consecutive layers' concatenated per-head probabilities."""
    probs = _layer_scores(model, cache, diag["query"], "head_probs")     # [L, B, HQ, T]
    flat = probs.reshape(probs.shape[:2] + (-1,))
    return (1.0 - _cosine(flat[:-1], flat[1:])).T


def attention_shift(model: Model, prompts, *, decode_steps: int, lengths=None,
                    batch_size: int = 8, progress: bool = True, mesh=None) -> np.ndarray:
    """DELTA's layer-shift probe (App. D) -> shift [layers - 1] float64.

    shift[l - 1] is the mean over decode steps and prompts of 1 - cos(a_{l-1}, a_l), where a_l
    is layer l's attention of the step's query: every query head's probabilities over the valid
    context, concatenated. Dense greedy decoding of `prompts` (right-padded ids [N, T] with
    `lengths` [N]; default all T): prefill, then `decode_steps` measured steps. `mesh`:
    tensor parallel (see `_measure_decoding`).
    """
    parts = [s.mean(axis=0) for s in _measure_decoding(
        model, prompts, lengths, decode_steps=decode_steps, batch_size=batch_size,
        measure=_shift_measure, progress=progress, desc="attention shift", mesh=mesh)]
    return np.concatenate(parts).mean(axis=0).astype(np.float64)


def suggest_delta_layers(shift, count: int, dense_layers=(0, 1)) -> tuple[int, ...]:
    """`count` Δ-layers: high-shift layers spread over the depth.

    shift [L - 1] from `attention_shift` (shift[l - 1] is the shift into layer l). The rule:
      1. the first Δ-layer is the layer right after the dense layers (DELTA: layer 2), which
         makes the first selection;
      2. the other count - 1 are taken greedily in order of decreasing shift (ties: the lower
         layer), skipping a layer closer than `spacing = max(1, L // (2 * count))` layers to one
         already taken;
      3. if that leaves fewer than `count`, the pass repeats with the spacing one smaller,
         keeping what was taken, down to spacing 1 (any free layer).
    """
    shift = np.asarray(shift, np.float64)
    if shift.ndim != 1 or shift.shape[0] < 1 or not np.all(np.isfinite(shift)):
        raise ValueError(f"shift has shape {shift.shape}: expected finite values [layers - 1 >= 1]")
    L = shift.shape[0] + 1
    dense = tuple(int(d) for d in dense_layers)
    if any(not 0 <= d < L - 1 for d in dense):
        raise ValueError(f"dense_layers={dense}: expected layers in [0, {L - 1}) so that a "
                         f"Δ-layer follows them in a {L}-layer model")
    first = max(dense) + 1 if dense else 0
    if not isinstance(count, (int, np.integer)) or not 1 <= count <= L - first:
        raise ValueError(f"count={count!r}: expected an int in [1, {L - first}] (the layers "
                         f"{first}..{L - 1} after dense_layers={dense})")
    order = sorted(range(first + 1, L), key=lambda layer: (-shift[layer - 1], layer))
    chosen = [first]
    for spacing in range(max(1, L // (2 * count)), 0, -1):
        for layer in order:
            if len(chosen) == count:
                break
            if all(abs(layer - c) >= spacing for c in chosen):
                chosen.append(layer)
    return tuple(sorted(chosen))


# ---- Kascade: cross-layer similarity, importance, anchors, head map --------------------------
def _similarity_measure(model, cache, diag, k):
    """-> sim [B, L, L, HK, HK] (layer b head h2's mass on layer a head h1's top-k over its mass
    on its own top-k) and importance [B, L] (1 - cos(x, x + attn_out))."""
    # GQA pooling (Kascade §3.4): the query group's probabilities summed, normalised to sum 1
    probs = _layer_scores(model, cache, diag["query"], "group_sum") / model.config.group_size
    top, index = jax.lax.top_k(probs, min(k, probs.shape[-1]))     # [L, B, HK, k]
    own = jnp.sum(top, axis=-1)                                     # [L, B, HK]
    chosen = jnp.put_along_axis(jnp.zeros_like(probs), index, 1.0, axis=-1, inplace=False)
    kept = jnp.einsum("arht,brgt->rabhg", chosen, probs, precision=jax.lax.Precision.HIGHEST)
    sim = kept / jnp.transpose(own, (1, 0, 2))[:, None, :, None, :]
    x = diag["hidden"].astype(jnp.float32)                          # [L, B, H]
    importance = 1.0 - _cosine(x, x + diag["attn_block"].astype(jnp.float32))
    return sim, importance.T


def kascade_similarity(model: Model, prompts, *, k: int = 64, decode_steps: int, lengths=None,
                       batch_size: int = 8, progress: bool = True, mesh=None):
    """Kascade's cross-layer, cross-head similarity and layer importance.

    Returns (sim [L, L, HK, HK], importance [L]) float64:
      sim[a, b, h1, h2] = P_b,h2(topk(P_a,h1, k)) / P_b,h2(topk(P_b,h2, k)), where P_l,h is
        layer l's post-softmax attention of the step's query summed over KV head h's query
        group and normalised to sum 1: how much of its own top-k mass layer b head h2 keeps when
        it reuses layer a head h1's top-k. Minimum over the decode steps of a prompt (the worst
        token, §3.3), mean over prompts. The paper scores every prompt token; here only the
        decode steps, the queries sparse decoding serves, so prompts that end where decoding
        reads from far back (a task's question) place the anchors for retrieval. Defined for
        a <= b (a reuse layer only reads an earlier anchor; sim[a, a, h, h] = 1); NaN where
        a > b.
      importance[l] = 1 - cos(x, x + attn_out), x = layer l's input hidden state and attn_out
        its attention block's output (after o_proj); mean over decode steps and prompts.
    Dense greedy decoding as in `attention_shift` (`mesh` too).
    """
    if not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k={k!r}: expected an int >= 1")
    sims, importances = [], []
    for sim, importance in _measure_decoding(
            model, prompts, lengths, decode_steps=decode_steps, batch_size=batch_size,
            measure=_similarity_measure, options=(int(k),), progress=progress,
            desc="kascade similarity", mesh=mesh):
        sims.append(sim.min(axis=0))
        importances.append(importance.mean(axis=0))
    sim = np.concatenate(sims).mean(axis=0).astype(np.float64)
    L = sim.shape[0]
    sim[np.tril(np.ones((L, L), bool), -1)] = np.nan
    return sim, np.concatenate(importances).mean(axis=0).astype(np.float64)


def _check_sim(sim) -> np.ndarray:
    sim = np.asarray(sim, np.float64)
    if sim.ndim != 4 or sim.shape[0] != sim.shape[1] or sim.shape[2] != sim.shape[3]:
        raise ValueError(f"sim has shape {sim.shape}: expected [layers, layers, kv_heads, "
                         "kv_heads]")
    return sim


def layer_similarity(sim, importance) -> np.ndarray:
    """Layer-level similarity [L, L] for the anchor DP (Kascade §3.3, §3.5):

        layer_sim[a, b] = importance[b] * mean over h2 of max over h1 of sim[a, b, h1, h2]

    i.e. each reuse head reads the best head of the anchor (head remapping), and the layer
    counts by how much its attention changes the residual stream. The diagonal is the layer's
    own importance (an anchor keeps all of its own top-k mass); NaN where a > b.
    """
    sim = _check_sim(sim)
    importance = np.asarray(importance, np.float64)
    if importance.shape != (sim.shape[0],):
        raise ValueError(f"importance has shape {importance.shape}: expected ({sim.shape[0]},)")
    return sim.max(axis=2).mean(axis=2) * importance[None, :]


def _check_anchors(anchors, num_layers: int) -> tuple[int, ...]:
    anchors = tuple(sorted(int(a) for a in anchors))
    if (len(set(anchors)) != len(anchors) or not anchors or anchors[0] != 0
            or anchors[-1] >= num_layers):
        raise ValueError(f"anchors={anchors}: expected distinct layers in [0, {num_layers}) "
                         "including layer 0")
    return anchors


def anchor_of(anchors, num_layers: int) -> np.ndarray:
    """[num_layers] int: for each layer the latest anchor at or before it."""
    anchors = _check_anchors(anchors, num_layers)
    return np.asarray(anchors)[np.searchsorted(anchors, np.arange(num_layers), side="right") - 1]


def select_anchor_layers(layer_sim, num_anchors: int) -> tuple[int, ...]:
    """Kascade's anchor-layer dynamic program (Alg. 1), exact, O(L² · num_anchors).

    Chooses `num_anchors` layers, layer 0 always one of them, maximising

        sum over all layers b of layer_sim[anchor(b), b],  anchor(b) = latest anchor <= b,

    so an anchor contributes its own layer_sim[a, a] (as in Alg. 1, whose segment sums start at
    the anchor) and a reuse layer what it keeps of its anchor's selection. Only a <= b is read.
    Among equal optima the lexicographically smallest set of layers is returned.
    """
    S = np.asarray(layer_sim, np.float64)
    if S.ndim != 2 or S.shape[0] != S.shape[1] or S.shape[0] < 1:
        raise ValueError(f"layer_sim has shape {S.shape}: expected [layers, layers]")
    L = S.shape[0]
    upper = np.triu(np.ones((L, L), bool))
    if not np.all(np.isfinite(S[upper])):
        raise ValueError("layer_sim has non-finite values at or above the diagonal")
    if not isinstance(num_anchors, (int, np.integer)) or not 1 <= num_anchors <= L:
        raise ValueError(f"num_anchors={num_anchors!r}: expected an int in [1, {L}] (layer 0 "
                         "included)")
    # segment[i, j] = value of layers i..j-1 all reusing anchor i (j > i)
    segment = np.concatenate([np.zeros((L, 1)), np.cumsum(np.where(upper, S, 0.0), axis=1)],
                             axis=1)
    # best[r, i]: the most layers i..L-1 can hold with an anchor at i and r more after it
    best = np.full((num_anchors, L), -np.inf)
    best[0] = segment[np.arange(L), L]
    for r in range(1, num_anchors):
        for i in range(L - r):
            nxt = np.arange(i + 1, L - r + 1)
            best[r, i] = np.max(segment[i, nxt] + best[r - 1, nxt])
    anchors = [0]
    for r in range(num_anchors - 1, 0, -1):
        i = anchors[-1]
        nxt = np.arange(i + 1, L - r + 1)
        anchors.append(int(nxt[np.argmax(segment[i, nxt] + best[r - 1, nxt])]))
    return tuple(anchors)


def head_mapping(sim, anchors) -> np.ndarray:
    """Kascade's head remapping (§3.5) -> [L, HK] int32: a reuse layer b's KV head h2 reads the
    selection of head argmax_h1 sim[anchor(b), b, h1, h2] of its anchor; anchors map to
    themselves."""
    sim = _check_sim(sim)
    L, HK = sim.shape[0], sim.shape[2]
    source = anchor_of(anchors, L)
    layers = np.arange(L)
    best = np.argmax(sim[source, layers], axis=1)                   # [L, HK]
    return np.where((source == layers)[:, None], np.arange(HK)[None, :], best).astype(np.int32)


# ---- plots ----------------------------------------------------------------------------------
def plot_shift(shift, layers, path, *, dense_layers=(), title: str = "") -> None:
    """The shift curve (x = layer l, the right member of the pair (l-1, l)), Δ-layers marked,
    dense layers shaded."""
    from sparsejax.plotting import figure, save

    shift = np.asarray(shift)
    x = np.arange(1, shift.shape[0] + 1)
    fig, ((ax,),) = figure(figsize=(8, 3.5))
    ax.plot(x, shift, marker="o", color="black", label="1 - cos(layer l-1, layer l)")
    if dense_layers:
        ax.axvspan(min(dense_layers) - 0.5, max(dense_layers) + 0.5, color="gray", alpha=0.15,
                   label="dense layers")
    chosen = [layer for layer in layers if layer >= 1]
    ax.scatter(chosen, shift[np.asarray(chosen, int) - 1], s=120, facecolors="none",
               edgecolors="red", linewidths=2, label=f"Δ-layers {tuple(layers)}", zorder=3)
    ax.set_xlabel("layer l")
    ax.set_ylabel("attention shift")
    ax.set_title(title or "DELTA layer-shift probe")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, path)


def plot_layer_similarity(layer_sim, importance, anchors, path, *, title: str = "") -> None:
    """The layer-similarity matrix (rows: anchor a, columns: reuse layer b) with each layer's
    chosen (anchor(b), b) cell marked, and the importance per layer with anchors highlighted."""
    from sparsejax.plotting import figure, save

    layer_sim = np.asarray(layer_sim, np.float64)
    L = layer_sim.shape[0]
    fig, ((ax, bx),) = figure(1, 2, figsize=(11, 4.5), gridspec_kw={"width_ratios": [1.2, 1]})
    im = ax.imshow(np.ma.masked_invalid(layer_sim), cmap="viridis")
    fig.colorbar(im, ax=ax, shrink=0.8)
    ax.scatter(np.arange(L), anchor_of(anchors, L), marker="s", s=30, facecolors="none",
               edgecolors="red", label="anchor(b), b")
    ax.set_xlabel("reuse layer b")
    ax.set_ylabel("anchor layer a")
    ax.set_title("importance[b] × mean_h2 max_h1 sim")
    ax.legend(fontsize=8, loc="lower left")
    colors = ["red" if layer in anchors else "gray" for layer in range(L)]
    bx.bar(np.arange(L), np.asarray(importance), color=colors)
    bx.set_xlabel("layer (red: anchors)")
    bx.set_title("importance 1 - cos(x, x + attn_out)")
    fig.suptitle(title or f"Kascade anchors {tuple(anchors)}")
    save(fig, path)


# ---- command line ---------------------------------------------------------------------------
CALIBRATION_DIR = "calibration"   # <model dir>/calibration/<method>.json: `methods.fitted_beside`


def _both_measure(model, cache, diag, k):
    """DELTA's shift and Kascade's similarity and importance from one decode step."""
    return (_shift_measure(model, cache, diag),) + _similarity_measure(model, cache, diag, k)


def calibrate_both(model: Model, prompts, *, k: int = 64, decode_steps: int, lengths=None,
                   batch_size: int = 8, progress: bool = True, mesh=None):
    """`attention_shift` and `kascade_similarity` from one dense decoding of `prompts`
    -> (shift [L-1], sim [L, L, HK, HK], importance [L]), each as the two functions give it."""
    shifts, sims, importances = [], [], []
    for shift, sim, importance in _measure_decoding(
            model, prompts, lengths, decode_steps=decode_steps, batch_size=batch_size,
            measure=_both_measure, options=(int(k),), progress=progress,
            desc="calibration", mesh=mesh):
        shifts.append(shift.mean(axis=0))
        sims.append(sim.min(axis=0))
        importances.append(importance.mean(axis=0))
    sim = np.concatenate(sims).mean(axis=0).astype(np.float64)
    L = sim.shape[0]
    sim[np.tril(np.ones((L, L), bool), -1)] = np.nan
    return (np.concatenate(shifts).mean(axis=0).astype(np.float64), sim,
            np.concatenate(importances).mean(axis=0).astype(np.float64))


def calibration_path(out, method: str, methods) -> Path:
    """Where `--out` puts `method`'s file: OUT itself when it names a .json file (one method
    only), else OUT/calibration/<method>.json, the layout `methods.fitted_beside` reads."""
    out = Path(out)
    if out.suffix == ".json":
        if len(methods) > 1:
            raise ValueError(f"--out {out} names one file; calibrating {', '.join(methods)} "
                             "writes one per method: give a directory (or --method)")
        return out
    return out / CALIBRATION_DIR / f"{method}.json"


def check_output(path, flag: str, *, makes_directory: bool) -> Path:
    """A .json file given outright must go in an existing directory; a file in a directory the
    job makes (calibration/, gates/, a new --out DIR) needs only a writable ancestor."""
    path = Path(path)
    if not makes_directory or path.parent.is_dir():
        return check_writable(path, flag)
    check_writable(path.parent, flag, directory=True)
    return path


def add_parser(sub) -> None:
    from sparsejax.arguments import positive_int
    from sparsejax.train.data import TASKS

    p = sub.add_parser(
        "calibrate", help="DELTA layer-shift probe / Kascade anchor DP",
        description="Calibrate DELTA's Δ-layers and Kascade's anchor layers and head map for a "
        "model, on your own text (--text) or the synthetic tasks (--task, the shipped model's "
        "vocabulary only). Writes calibration/<method>.json beside the model (or under --out), "
        "where `generate`, `eval` and `LLM` read it.",
        epilog="--text: a .jsonl file holds one document per line (its \"text\" field); any "
        "other file is one document (blank lines do not split it). Documents are cut into "
        "windows of --context tokens, round-robin over the documents.")
    p.add_argument("--model", default=None, help="HF checkpoint dir (default: the embedded model)")
    p.add_argument("--method", default="all", choices=CALIBRATED_METHODS + ("all",),
                   help="what to calibrate (all: both, from one decoding pass)")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--text", nargs="+", default=None, metavar="FILE",
                        help="documents (.txt: one per file; .jsonl: a \"text\" field per line) "
                        "cut into --context-token windows (default: --prompts, else the "
                        "synthetic --task prompts)")
    source.add_argument("--prompts", default=None, help="text file, ONE PROMPT PER LINE, "
                        "tokenized with the model's tokenizer (for documents use --text; "
                        "default: none)")
    source.add_argument("--task", default=None, help="task prompts of these comma-separated "
                        "tasks, in turn: the synthetic tasks for the shipped model's "
                        "vocabulary, else the long-context prose tasks of `sparsejax eval` "
                        f"(default without --text/--prompts: {','.join(TASKS)})")
    p.add_argument("--samples", type=positive_int, default=16, help="prompts (windows of "
                   "--text, the first N lines of --prompts)")
    p.add_argument("--context", type=positive_int, default=None, help="prompt tokens: the "
                   "window of --text, exact for --task, at most for --prompts (default: 2048, "
                   "or less to fit the model's context with the decode steps)")
    p.add_argument("--decode-steps", type=positive_int, default=16,
                   help="measured decode steps per prompt")
    p.add_argument("--count", type=int, default=None, help="delta: Δ-layers (default 3, the "
                   "paper's, or fewer on a shallow model)")
    p.add_argument("--anchors", type=int, default=None, help="kascade: anchor layers, layer 0 "
                   "included (default 5, the paper's, or fewer on a shallow model)")
    p.add_argument("--k", type=positive_int, default=64, help="kascade: top-k of the similarity")
    p.add_argument("--batch", type=positive_int, default=8, help="prompts decoded together")
    p.add_argument("--seed", type=int, default=0, help="seed of the --task prompts (the prose "
                   "tasks' prompt i has seed SEED + i; evaluations start at seed 0, so a "
                   "seed past theirs keeps the calibration prompts apart)")
    p.add_argument("--dtype", choices=["f32", "bf16"], default="f32", help="compute dtype")
    p.add_argument("--tp", type=positive_int, default=1,
                   help="tensor parallel over this many devices (README: Several GPUs)")
    p.add_argument("--out", default=None, help="a directory (gets calibration/<method>.json, "
                   "as beside a model) or, with one --method, a .json file (default: beside "
                   "the model, where generate/eval/LLM find it)")
    p.add_argument("--plot", default=None, help="directory for the PNGs (default: none)")
    p.set_defaults(func=run)


def default_context(config, decode_steps: int, wanted: int | None = None) -> int:
    """--context: `wanted`, or 2048 capped so that prompt + decode steps fit the model."""
    room = config.max_position_embeddings - decode_steps
    if wanted is not None:
        config.check_context(wanted + decode_steps)
        return wanted
    if room < 2:
        raise ValueError(f"--decode-steps {decode_steps} leaves no room for a prompt in the "
                         f"model's {config.max_position_embeddings}-token context")
    return min(2048, room)


def _cli_prompts(args, tokenizer, context, texts=None):
    """-> (ids [N, T], lengths [N], description of the source); `texts`: --text's documents."""
    from sparsejax.train import data, documents

    if args.text:
        ids, lengths = documents.token_windows(texts, tokenizer, context, args.samples)
        return ids, lengths, documents.describe(args.text)
    if args.prompts:
        lines = [s for s in read_text(args.prompts, "--prompts").splitlines() if s.strip()]
        if not lines:
            raise ValueError(f"--prompts {args.prompts}: no non-empty lines")
        rows = [tokenizer(s)["input_ids"][:context] for s in lines[:args.samples]]
        lengths = np.asarray([len(r) for r in rows], np.int32)
        ids = np.full((len(rows), lengths.max()), tokenizer.pad_token_id or 0, np.int32)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = r
        return ids, lengths, f"file {args.prompts} (one prompt per line)"
    from sparsejax.evaluation import task_set

    tasks = [t.strip() for t in (args.task or ",".join(data.TASKS)).split(",") if t.strip()]
    # the task set `sparsejax eval` would run for this tokenizer: the synthetic tasks in the
    # shipped model's vocabulary, else the long-context prose tasks (`sparsejax.tasks`)
    if not tasks:
        raise ValueError(f"--task {args.task!r}: expected comma-separated task names")
    chosen = task_set(tokenizer, tasks, context)
    per_task = -(-args.samples // len(tasks))
    try:
        samples = chosen.samples(tasks, context, per_task, args.seed,
                                 tokenizer.get_vocab())[:args.samples]  # round-robin over tasks
    except ValueError as e:
        raise ValueError(f"--task {','.join(tasks)} at --context {context}: {e}") from None
    ids, lengths = chosen.batch(samples)
    return ids, lengths, f"{chosen.name} tasks {','.join(tasks)} (seed {args.seed})"


def _check_counts(args, num_layers: int, shortest_prompt: int) -> None:
    """--count, --anchors and --k against this model and these prompts, before measuring."""
    if args.method == "delta" and args.count is not None and not (
            1 <= args.count <= max(1, num_layers - 2)):
        raise ValueError(f"--count {args.count}: expected 1..{max(1, num_layers - 2)} Δ-layers "
                         f"for this {num_layers}-layer model (layers 0 and 1 stay dense)")
    if args.method != "kascade":
        return
    if args.anchors is not None and not 1 <= args.anchors <= num_layers:
        raise ValueError(f"--anchors {args.anchors}: expected 1..{num_layers} anchor layers for "
                         f"this {num_layers}-layer model")
    if args.k > shortest_prompt:
        raise ValueError(f"--k {args.k}: the shortest prompt has {shortest_prompt} tokens; "
                         f"expected a top-k of at most {shortest_prompt}")


def _model_location(args):
    """(checkpoint to load, directory its fitted files go in by default)."""
    import sparsejax

    if args.model is None:
        path = sparsejax.embedded_model_path()
        return path, path
    return args.model, sparsejax.artifacts.fitted_directory(args.model)


def run(args) -> int:
    import sparsejax

    source, home = _model_location(args)
    methods = CALIBRATED_METHODS if args.method == "all" else (args.method,)
    out = Path(args.out) if args.out else Path(home)
    paths = {m: calibration_path(out, m, methods) for m in methods}
    for path in paths.values():
        check_output(path, "--out", makes_directory=out.suffix != ".json")
    if args.plot:
        check_writable(args.plot, "--plot", directory=True)
    from sparsejax.train.documents import read_documents

    texts = read_documents(args.text) if args.text else None    # before the model loads
    model = sparsejax.from_pretrained(source, dtype=jnp.float32 if args.dtype == "f32"
                                      else jnp.bfloat16)
    c = model.config
    context = default_context(c, args.decode_steps, args.context)
    ids, lengths, described = _cli_prompts(args, sparsejax.load_tokenizer(source), context,
                                           texts)
    L = c.num_layers
    _check_counts(args, L, int(lengths.min()))
    settings = {"decode_steps": args.decode_steps, "samples": int(ids.shape[0]),
                "context": int(lengths.max()), "prompts": described, "dtype": args.dtype,
                "model_dir": str(source)}
    print(f"sparsejax calibrate {'/'.join(methods)}: {ids.shape[0]} prompts of "
          f"{int(lengths.min())}-{int(lengths.max())} tokens from {described}, "
          f"{args.decode_steps} decode steps; {jax.default_backend()}", flush=True)
    measure = dict(lengths=lengths, decode_steps=args.decode_steps, batch_size=args.batch,
                   mesh=sharding.tensor_parallel_mesh(args.tp))
    plot = Path(args.plot) if args.plot else None
    if plot:
        plot.mkdir(parents=True, exist_ok=True)
    name = Path(str(source)).name
    if len(methods) == 2:
        shift, sim, importance = calibrate_both(model, ids, k=args.k, **measure)
    elif methods == ("delta",):
        shift = attention_shift(model, ids, **measure)
    else:
        sim, importance = kascade_similarity(model, ids, k=args.k, **measure)
    if "delta" in methods:
        dense_layers = (0, 1) if L > 2 else ()
        count = args.count if args.count is not None else max(1, min(3, L - len(dense_layers)
                                                                      - 1))
        layers = suggest_delta_layers(shift, count, dense_layers)
        save_calibration(paths["delta"], model, method="delta", layers=layers,
                         curves={"shift": shift},
                         settings={**settings, "count": count, "dense_layers": list(dense_layers)})
        print(f"shift: {np.round(shift, 4).tolist()}\nΔ-layers: {layers}")
        print(f"wrote {paths['delta']}")
        if plot:
            plot_shift(shift, layers, plot / "delta_shift.png", dense_layers=dense_layers,
                       title=f"{name}: DELTA layer shift")
    if "kascade" in methods:
        anchors = args.anchors if args.anchors is not None else min(5, L)
        layer_sim = layer_similarity(sim, importance)
        layers = select_anchor_layers(layer_sim, anchors)
        head_map = head_mapping(sim, layers)
        save_calibration(paths["kascade"], model, method="kascade", layers=layers,
                         head_map=head_map,
                         curves={"layer_similarity": layer_sim, "importance": importance},
                         settings={**settings, "k": args.k, "anchors": anchors})
        print(f"importance: {np.round(importance, 4).tolist()}\nanchor layers: {layers}\n"
              f"head map: {head_map.tolist()}")
        print(f"wrote {paths['kascade']}")
        if plot:
            plot_layer_similarity(layer_sim, importance, layers,
                                  plot / "kascade_layer_similarity.png",
                                  title=f"{name}: Kascade anchors {layers}")
    if plot:
        log.info(f"wrote PNGs in {plot}")
    return 0


__all__ = [
    "CALIBRATION_DIR", "add_parser", "anchor_of", "attention_shift", "calibrate_both",
    "calibration_path", "default_context", "head_mapping", "kascade_similarity",
    "layer_similarity", "plot_layer_similarity", "plot_shift", "select_anchor_layers",
    "suggest_delta_layers",
]
