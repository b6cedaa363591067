"""Sparse decoding methods: each a small frozen (hashable) constructor of a `SparsePlan`.

Defaults follow the papers (layer indices are for 28-32-layer models; `scaled_to(num_layers)`
maps them onto another depth). Token budgets are in tokens and rounded up to the selection unit.

  Dense()                                  every layer dense
  OracleTopK(ratio=0.1 | k=...)            every layer picks its own exact top-k per query head
  StreamingLLM(sinks=4, window=1024)       sinks + recent window, every layer
  Quest(page_size=16, token_budget=1024)   per-query-head page bound, first 2 layers dense
  TidalDecode(select_layers=(2, 13))       layers 0-1 dense, per-query-head top-k re-selected at 2, 13
  DELTA(delta_layers=(2, 14, 22))          pages chosen by the max over all heads at Δ-layers
  Kascade(anchor_layers=(0, 2, 8, 13, 14)) per-KV-head token top-k at anchors, head-mapped reuse
                                           (sparse_prefill=True: also per 128-query prefill tile)
  Lychee(retrieval_heads=...)              retrieval heads select per head, sparse heads inherit
  RESA(base, lam=1.0)                      any of the above + the unselected prompt's residual
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from sparsejax import artifacts
from sparsejax.cache import check_page_size
from sparsejax.models import ModelConfig
from sparsejax.plan import Budget, Residual, Role, Score, Selector, SparsePlan

DEFAULT_PAGE_SIZE = 16


# ---- budgets (tokens) -----------------------------------------------------------------------
def TopK(k: int) -> Budget:
    """Keep k tokens (rounded up to whole units)."""
    if not isinstance(k, (int, np.integer)) or k <= 0:
        raise ValueError(f"TopK(k={k!r}): expected an int > 0")
    return Budget("fixed", int(k))


def Ratio(ratio: float, minimum: int = 0) -> Budget:
    """Keep ceil(ratio × context), at least `minimum` tokens (and never more than the context)."""
    return Budget("ratio", float(ratio), minimum=int(minimum))


def TopP(p: float, limit: int | None = None) -> Budget:
    """Keep the smallest set whose attention mass reaches p (buffer capped at `limit` tokens)."""
    return Budget("top_p", float(p), limit=limit)


def Threshold(t: float, limit: int | None = None) -> Budget:
    """Keep every token whose attention probability is at least t."""
    return Budget("threshold", float(t), limit=limit)


def _in_units(budget: Budget, unit: int) -> Budget:
    up = lambda n: None if n is None else -(-int(n) // unit)  # noqa: E731
    if budget.kind == "fixed":
        return Budget("fixed", up(budget.value))
    return Budget(budget.kind, budget.value, minimum=up(budget.minimum), limit=up(budget.limit))


# ---- validation -----------------------------------------------------------------------------
def _layers(name: str, layers, num_layers: int) -> tuple[int, ...]:
    layers = tuple(int(i) for i in layers)
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"{name}={layers}: layer indices {bad} are out of range for a model "
                         f"with {num_layers} layers")
    if len(set(layers)) != len(layers):
        raise ValueError(f"{name}={layers}: repeated layer indices")
    return tuple(sorted(layers))


def _page_size(method: str, fixed: int | None, requested: int | None) -> int:
    if fixed is not None and requested is not None and requested != fixed:
        raise ValueError(f"{method} selects pages of {fixed} tokens; page_size={requested} "
                         "disagrees (leave page_size unset or make them equal)")
    if fixed is not None:
        return fixed
    return DEFAULT_PAGE_SIZE if requested is None else requested


def _positive(name: str, value) -> None:
    if (isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating))
            or not math.isfinite(value) or value <= 0):
        raise ValueError(f"{name}={value!r}: expected a finite number > 0")


def _scale_layers(layers, num_layers: int, reference: int = 28) -> tuple[int, ...]:
    """Map layer indices chosen for a `reference`-deep model onto `num_layers`.

    Indices <= 2 (the papers' fixed early choices) stay; later ones scale with depth and are
    kept strictly increasing; any that fall off the end are dropped."""
    out: list[int] = []
    for i in sorted(layers):
        j = i if i <= 2 else round(i * (num_layers - 1) / (reference - 1))
        j = max(j, out[-1] + 1) if out else j
        if j < num_layers:
            out.append(j)
    return tuple(out)


def _roles(num_layers: int, dense=(), select=(), default=Role.REUSE) -> tuple[Role, ...]:
    """Dense and selecting layers as given; the rest reuse, or are dense before the first select."""
    first = min(select) if select else num_layers
    roles = []
    for i in range(num_layers):
        if i in select:
            roles.append(Role.SELECT)
        elif i in dense or i < first:
            roles.append(Role.DENSE)
        else:
            roles.append(default)
    return tuple(roles)


def _origin():
    """The file a method's layer choices or heads were read from (`artifacts.Origin`): checked
    against the model in `to_plan`, not part of the method's value."""
    return dataclasses.field(default=None, compare=False, repr=False)


def _check_origin(origin: artifacts.Origin | None, config: ModelConfig) -> None:
    if origin is not None:
        origin.check(config)


# ---- methods --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Dense:
    def to_plan(self, config: ModelConfig, page_size: int | None = None) -> SparsePlan:
        return SparsePlan("dense", (Role.DENSE,) * config.num_layers,
                          _page_size("Dense", None, page_size))


@dataclasses.dataclass(frozen=True)
class OracleTopK:
    """Every layer attends to the top-k of its own exact attention, per query head: the
    accuracy ceiling for a given budget (it still computes dense attention to know it)."""
    ratio: float | None = None   # 0.1 when neither ratio nor k is given
    k: int | None = None
    min_k: int = 0

    def __post_init__(self):
        if self.ratio is not None and self.k is not None:
            raise ValueError(f"OracleTopK: give one of ratio={self.ratio} and k={self.k}")
        if self.ratio is None and self.k is None:
            object.__setattr__(self, "ratio", 0.1)
        _positive("OracleTopK k" if self.k is not None else "OracleTopK ratio",
                  self.k if self.k is not None else self.ratio)

    def to_plan(self, config, page_size=None):
        budget = TopK(self.k) if self.k is not None else Ratio(self.ratio, self.min_k)
        return SparsePlan("oracle", (Role.SELF,) * config.num_layers,
                          _page_size("OracleTopK", None, page_size),
                          Selector(Score.HEAD_PROBS, 1, "query", budget))


@dataclasses.dataclass(frozen=True)
class StreamingLLM:
    sinks: int = 4
    window: int = 1024

    def __post_init__(self):
        _positive("StreamingLLM window", self.window)
        if self.sinks < 0:
            raise ValueError(f"StreamingLLM sinks={self.sinks}: expected >= 0")

    def to_plan(self, config, page_size=None):
        roles = (Role.SELF,) + (Role.REUSE,) * (config.num_layers - 1)
        return SparsePlan("streaming", roles, _page_size("StreamingLLM", None, page_size),
                          Selector(Score.NONE, 1, "shared", TopK(self.sinks + self.window),
                                   sinks=self.sinks, recent=self.window))


@dataclasses.dataclass(frozen=True)
class Quest:
    page_size: int = 16
    token_budget: int = 1024
    dense_layers: int = 2

    def __post_init__(self):
        check_page_size(self.page_size)
        _positive("Quest token_budget", self.token_budget)
        if self.dense_layers < 0:
            raise ValueError(f"Quest dense_layers={self.dense_layers}: expected >= 0")

    def to_plan(self, config, page_size=None):
        p = _page_size("Quest", self.page_size, page_size)
        if self.dense_layers > config.num_layers:
            raise ValueError(f"Quest dense_layers={self.dense_layers} exceeds the model's "
                             f"{config.num_layers} layers")
        roles = (Role.DENSE,) * self.dense_layers + (Role.SELF,) * (
            config.num_layers - self.dense_layers)
        return SparsePlan("quest", roles, p,
                          Selector(Score.QUEST_BOUND, p, "query",
                                   _in_units(TopK(self.token_budget), p)))


@dataclasses.dataclass(frozen=True)
class TidalDecode:
    dense_layers: tuple[int, ...] = (0, 1)
    select_layers: tuple[int, ...] = (2, 13)
    k: int = 4096

    def __post_init__(self):
        _positive("TidalDecode k", self.k)

    def scaled_to(self, num_layers: int) -> "TidalDecode":
        return dataclasses.replace(self, select_layers=_scale_layers(self.select_layers, num_layers))

    def to_plan(self, config, page_size=None):
        L = config.num_layers
        dense = _layers("TidalDecode dense_layers", self.dense_layers, L)
        select = _layers("TidalDecode select_layers", self.select_layers, L)
        if set(dense) & set(select):
            raise ValueError(f"TidalDecode: layers {sorted(set(dense) & set(select))} are both "
                             "dense and selecting")
        return SparsePlan("tidal", _roles(L, dense, select), _page_size("TidalDecode", None, page_size),
                          Selector(Score.HEAD_PROBS, 1, "query", TopK(self.k)))


@dataclasses.dataclass(frozen=True)
class DELTA:
    dense_layers: tuple[int, ...] = (0, 1)
    delta_layers: tuple[int, ...] = (2, 14, 22)
    page_size: int = 16
    budget_pages: int = 64
    recent_pages: int = 8
    origin: artifacts.Origin | None = _origin()

    def __post_init__(self):
        check_page_size(self.page_size)
        _positive("DELTA budget_pages", self.budget_pages)
        if not 0 <= self.recent_pages <= self.budget_pages:
            raise ValueError(f"DELTA recent_pages={self.recent_pages}: expected 0 <= recent_pages "
                             f"<= budget_pages={self.budget_pages}")

    def scaled_to(self, num_layers: int) -> "DELTA":
        return dataclasses.replace(self, delta_layers=_scale_layers(self.delta_layers, num_layers))

    @classmethod
    def from_calibration(cls, path, model=None, **overrides) -> "DELTA":
        """Δ-layers from a `sparsejax calibrate` file; with `model`, checked to be made for it
        (and against every model it is planned for)."""
        calib = artifacts.load_calibration(path, "delta", model=model)
        return cls(delta_layers=tuple(calib["layers"]), origin=calib["origin"], **overrides)

    def to_plan(self, config, page_size=None):
        _check_origin(self.origin, config)
        L = config.num_layers
        p = _page_size("DELTA", self.page_size, page_size)
        dense = _layers("DELTA dense_layers", self.dense_layers, L)
        delta = _layers("DELTA delta_layers", self.delta_layers, L)
        if set(dense) & set(delta):
            raise ValueError(f"DELTA: layers {sorted(set(dense) & set(delta))} are both dense and "
                             "Δ-layers")
        return SparsePlan("delta", _roles(L, dense, delta), p,
                          Selector(Score.MAX_HEADS, p, "shared", Budget("fixed", self.budget_pages),
                                   recent=self.recent_pages * p))


@dataclasses.dataclass(frozen=True)
class Kascade:
    anchor_layers: tuple[int, ...] = (0, 2, 8, 13, 14)
    ratio: float = 0.1
    min_k: int = 128
    head_map: Any = None          # [layers, kv_heads] ints, or None for identity
    pooled_all_heads: bool = False
    sparse_prefill: bool = False  # the rolling per-tile top-k prefill (Kascade §3.6)
    prefill_tile: int = 128
    # decode: the anchors after layer 0 attend only to their own top-k (Kascade §3.6's passes:
    # scores without V, top-k, top-k attention) rather than densely
    sparse_anchors: bool = False
    origin: artifacts.Origin | None = _origin()

    def __post_init__(self):
        _positive("Kascade ratio", self.ratio)
        _positive("Kascade prefill_tile", self.prefill_tile)
        if self.sparse_prefill and self.pooled_all_heads:
            raise ValueError("Kascade sparse_prefill selects per KV head: it needs "
                             "pooled_all_heads=False")
        if self.ratio > 1:
            raise ValueError(f"Kascade ratio={self.ratio}: expected 0 < ratio <= 1")
        if self.min_k < 0:
            raise ValueError(f"Kascade min_k={self.min_k}: expected >= 0")
        if self.head_map is not None:
            hm = np.asarray(self.head_map)
            if hm.ndim != 2 or not np.issubdtype(hm.dtype, np.integer):
                raise ValueError(f"Kascade head_map has shape {hm.shape} ({hm.dtype}): expected "
                                 "integers of shape [layers, kv_heads]")
            object.__setattr__(self, "head_map", tuple(tuple(int(x) for x in r) for r in hm))

    def scaled_to(self, num_layers: int) -> "Kascade":
        return dataclasses.replace(self, anchor_layers=_scale_layers(self.anchor_layers, num_layers))

    @classmethod
    def from_calibration(cls, path, model=None, **overrides) -> "Kascade":
        """Anchors and head map from a `sparsejax calibrate` file; with `model`, checked to be
        made for it."""
        calib = artifacts.load_calibration(path, "kascade", model=model)
        return cls(anchor_layers=tuple(calib["layers"]), head_map=calib["head_map"],
                   origin=calib["origin"], **overrides)

    def to_plan(self, config, page_size=None):
        _check_origin(self.origin, config)
        L, HK = config.num_layers, config.num_kv_heads
        anchors = _layers("Kascade anchor_layers", self.anchor_layers, L)
        if 0 not in anchors:
            raise ValueError(f"Kascade anchor_layers={anchors}: layer 0 must be an anchor (it is "
                             "always dense and selecting)")
        head_map = self.head_map
        if head_map is not None:
            hm = np.asarray(head_map)
            if hm.shape != (L, HK):
                raise ValueError(f"Kascade head_map has shape {hm.shape}: expected [{L}, {HK}]")
            if hm.min() < 0 or hm.max() >= HK:
                raise ValueError(f"Kascade head_map values span [{hm.min()}, {hm.max()}]: expected "
                                 f"KV head indices in [0, {HK})")
        groups = "shared" if self.pooled_all_heads else "kv"
        score = Score.ALL_HEADS_SUM if self.pooled_all_heads else Score.GROUP_SUM
        roles = _roles(L, (), anchors)
        if self.sparse_anchors:     # layer 0 stays dense and selecting
            roles = tuple(Role.SELF if r == Role.SELECT and i > 0 else r
                          for i, r in enumerate(roles))
        return SparsePlan("kascade", roles, _page_size("Kascade", None, page_size),
                          Selector(score, 1, groups, Ratio(self.ratio, self.min_k)),
                          head_map=None if self.pooled_all_heads else head_map,
                          prefill_tile=self.prefill_tile if self.sparse_prefill else None)


@dataclasses.dataclass(frozen=True)
class Lychee:
    """retrieval_heads: [layers, kv_heads] bools, or the path of a gate checkpoint (Orbax
    directory, the reference code's a.pt/b.pt/full_head.pt, or a DuoAttention TSV)."""
    retrieval_heads: Any = None
    budget: Budget = TopK(4096)
    sinks: int = 128
    recent: int = 256
    block: int = 1
    gates: Any = None   # alias of retrieval_heads given as a checkpoint path
    origin: artifacts.Origin | None = _origin()

    def __post_init__(self):
        source = self.gates if self.gates is not None else self.retrieval_heads
        if source is None:
            raise ValueError("Lychee needs retrieval_heads=[layers, kv_heads] bools or gates=PATH")
        if isinstance(source, (str, Path)):
            source, origin = artifacts.load_gates(source)
            object.__setattr__(self, "origin", origin)
        mask = np.asarray(source)
        if mask.ndim != 2:
            raise ValueError(f"Lychee retrieval_heads has shape {mask.shape}: expected "
                             "[layers, kv_heads]")
        if not (mask.dtype == bool or (np.issubdtype(mask.dtype, np.integer)
                                       and np.isin(mask, (0, 1)).all())):
            raise ValueError(f"Lychee retrieval_heads has dtype {mask.dtype}, values "
                             f"{np.unique(mask)[:8].tolist()}: expected booleans or integers 0/1")
        object.__setattr__(self, "retrieval_heads", tuple(tuple(bool(x) for x in r) for r in mask))
        object.__setattr__(self, "gates", None)
        if not isinstance(self.budget, Budget):
            raise ValueError(f"Lychee budget={self.budget!r}: expected TopK, Ratio, TopP or "
                             "Threshold")
        if self.sinks < 0 or self.recent < 0:
            raise ValueError(f"Lychee sinks={self.sinks}, recent={self.recent}: expected >= 0")
        _positive("Lychee block", self.block)

    def to_plan(self, config, page_size=None):
        L, HK = config.num_layers, config.num_kv_heads
        mask = np.array(self.retrieval_heads, bool)
        if mask.shape != (L, HK):
            raise ValueError(f"Lychee retrieval_heads has shape {mask.shape}: expected [{L}, {HK}] "
                             "([layers, kv_heads] of this model; gates trained for another model?)")
        _check_origin(self.origin, config)
        mask[0] = True   # layer 0 is all retrieval
        p = _page_size("Lychee", None, page_size)
        roles = tuple(Role.SELECT if r.all() else Role.REUSE if not r.any() else Role.HYBRID
                      for r in mask)
        budget = _in_units(self.budget, self.block)
        return SparsePlan("lychee", roles, p,
                          Selector(Score.MEAN_QUERY, self.block, "kv", budget, sinks=self.sinks,
                                   recent=self.recent),
                          retrieval=tuple(tuple(bool(x) for x in r) for r in mask))


@dataclasses.dataclass(frozen=True)
class RESA:
    base: Any
    lam: float = 1.0
    fold_decode_tokens: bool = False

    def __post_init__(self):
        if isinstance(self.base, (RESA, Dense)) or not hasattr(self.base, "to_plan"):
            raise ValueError(f"RESA base={self.base!r}: expected a sparse method to wrap")
        Residual(float(self.lam), self.fold_decode_tokens)   # checks lam now, not at plan time

    def to_plan(self, config, page_size=None):
        plan = self.base.to_plan(config, page_size)
        return dataclasses.replace(plan, name=f"{plan.name}+resa",
                                   residual=Residual(float(self.lam), self.fold_decode_tokens))


def random_retrieval_heads(config: ModelConfig, count: int, seed: int = 0) -> np.ndarray:
    """`count` retrieval heads drawn uniformly among layers >= 1 (layer 0 is all retrieval)."""
    L, HK = config.num_layers, config.num_kv_heads
    if not 0 <= count <= (L - 1) * HK:
        raise ValueError(f"count={count}: expected 0..{(L - 1) * HK} retrieval heads")
    rng = np.random.default_rng(seed)
    mask = np.zeros((L, HK), bool)
    mask[0] = True
    flat = rng.choice((L - 1) * HK, size=count, replace=False)
    mask[1:].reshape(-1)[flat] = True
    return mask


# ---- the registry: every method as the CLI, eval and the demo see it -------------------------
@dataclasses.dataclass(frozen=True)
class Option:
    """A command-line option that sets one constructor field of a method."""
    flag: str                       # "--delta-layers"
    field: str                      # "delta_layers"
    help: str
    type: Callable = int
    nargs: str | None = None        # "+" for a list of layers


@dataclasses.dataclass(frozen=True)
class Fitted:
    """What was fitted to a model: Lychee's retrieval heads [layers, kv_heads] and
    {"delta" / "kascade": calibration file} (see `fitted_beside`)."""
    retrieval_heads: Any = None
    calibration: Mapping[str, Path] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    """A method's constructor, its defaults at a budget and its command-line options.

    at_budget(config, tokens, ratio, fitted) -> method: the method attending to `tokens` of the
    context (`ratio` of it), layer choices scaled to the depth or taken from `fitted`; what
    `sparsejax eval`, `demo` and `generate` run. Each option overrides one constructor field.
    """
    constructor: type
    summary: str
    at_budget: Callable[[ModelConfig, int, float, Fitted], Any]
    options: tuple[Option, ...] = ()


def _delta_at(config, tokens, ratio, fitted):
    pages = max(1, math.ceil(tokens / DEFAULT_PAGE_SIZE))
    kw = dict(budget_pages=pages, recent_pages=max(1, min(8, pages // 4)))
    if "delta" in fitted.calibration:
        return DELTA.from_calibration(fitted.calibration["delta"], **kw)
    return DELTA(**kw).scaled_to(config.num_layers)


def _kascade_at(config, tokens, ratio, fitted):
    if "kascade" in fitted.calibration:
        return Kascade.from_calibration(fitted.calibration["kascade"], ratio=ratio, min_k=0)
    return Kascade(ratio=ratio, min_k=0).scaled_to(config.num_layers)


def _lychee_at(config, tokens, ratio, fitted):
    heads = fitted.retrieval_heads
    if heads is None:
        heads = random_retrieval_heads(config, max(1, (config.num_layers - 1)
                                                   * config.num_kv_heads // 8))
    return Lychee(heads, budget=TopK(tokens), sinks=min(128, tokens // 8),
                  recent=min(256, tokens // 4))


_SINKS = Option("--sinks", "sinks", "always-kept first tokens")
REGISTRY: dict[str, MethodSpec] = {
    "dense": MethodSpec(Dense, "every layer attends to the whole cache",
                        lambda config, tokens, ratio, fitted: Dense()),
    "oracle": MethodSpec(OracleTopK, "exact top-k of every layer's own attention (the ceiling)",
                         lambda config, tokens, ratio, fitted: OracleTopK(k=tokens)),
    "streaming": MethodSpec(
        StreamingLLM, "attention sinks and a recent window",
        lambda config, tokens, ratio, fitted: StreamingLLM(sinks=4, window=max(1, tokens - 4)),
        (_SINKS,)),
    "quest": MethodSpec(
        Quest, "per-query-head page bounds",
        lambda config, tokens, ratio, fitted: Quest(token_budget=tokens,
                                                    dense_layers=min(2, config.num_layers))),
    "tidal": MethodSpec(
        TidalDecode, "per-query-head top-k re-selected at a few layers",
        lambda config, tokens, ratio, fitted: TidalDecode(k=tokens).scaled_to(config.num_layers),
        (Option("--select-layers", "select_layers", "layers that select", nargs="+"),)),
    "delta": MethodSpec(
        DELTA, "pages chosen at a few Δ-layers, reused by the layers after them", _delta_at,
        (Option("--delta-layers", "delta_layers", "layers that select pages", nargs="+"),
         Option("--recent-pages", "recent_pages", "most recent pages always kept"))),
    "kascade": MethodSpec(
        Kascade, "per-KV-head tokens chosen at anchor layers, reused through a head map",
        _kascade_at,
        (Option("--anchor-layers", "anchor_layers", "layers that select (0 among them)",
                nargs="+"),
         Option("--min-k", "min_k", "fewest tokens kept"))),
    "lychee": MethodSpec(
        Lychee, "retrieval heads select per head, the other heads inherit", _lychee_at,
        (Option("--gates", "retrieval_heads", "gate file or directory (`sparsejax train-gates`)",
                type=str),
         Option("--block", "block", "selection block (tokens)"),
         _SINKS,
         Option("--recent", "recent", "most recent tokens always kept"))),
}


def fitted_beside(model_dir: str | Path | None, model, calibrated: bool = True) -> Fitted:
    """What was fitted to a model: Lychee's gates (gates/*.json, the first by name) and, when
    `calibrated`, DELTA's / Kascade's calibration (calibration/<method>.json), each checked to be
    made for `model` (a stale file is an error, not skipped). They are read from
    `artifacts.fitted_directory(model_dir)` (a checkpoint's own directory; a packaged model's
    models/assets/<name>/; <file>.fitted/ beside a model file) and, when that holds none, from
    the models/assets/ directory whose files carry the model's exact fingerprint. No
    `model_dir` (a model made in memory): nothing."""
    home = None
    if model_dir is not None:
        try:
            home = artifacts.fitted_directory(model_dir)
        except ValueError:
            home = None
    calibration, gates = artifacts.fitted_files(home, model) if home else ({}, [])
    if home is not None and not calibration and not gates and model is not None:
        shipped = artifacts.shipped_for(model)
        if shipped is not None:
            calibration, gates = artifacts.fitted_files(shipped, model)
    calibration = calibration if calibrated else {}
    for kind, path in calibration.items():
        artifacts.load_calibration(path, kind, model=model)
    heads = None
    if gates:
        heads, origin = artifacts.load_gates(gates[0])
        origin.check(model, "gate file")
    return Fitted(heads, calibration)


def budget_ratio_methods(config: ModelConfig, ratio: float, context: int, *,
                         retrieval_heads=None, calibration=None) -> dict[str, Any]:
    """Every registered method at one budget ratio of the context (see `MethodSpec`)."""
    if not (math.isfinite(ratio) and 0 < ratio <= 1):
        raise ValueError(f"ratio={ratio}: expected a budget ratio in (0, 1]")
    fitted = Fitted(retrieval_heads, calibration or {})
    tokens = max(1, math.ceil(ratio * context))
    return {name: spec.at_budget(config, tokens, ratio, fitted) for name, spec in REGISTRY.items()}
