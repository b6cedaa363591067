"""Sparse decoding methods: each a small frozen (hashable) constructor of a `SparsePlan`.

Defaults follow the papers. Layer choices left unset are the papers' (chosen for 28-layer
models) scaled to the depth of the model a method is planned for (`to_plan(config)`;
`scaled_to(num_layers)` shows the choice); layer indices given are kept and checked. Budgets
are a count of tokens (`k=`, `token_budget=`, `budget_pages=`, `window=`: the same for every
row) or a `ratio=` of each row's own length, growing with the tokens it generates; both are
rounded up to the selection unit.

One file: the registry that the command line, eval and `LLM` read builds every method here.

  Dense()                                  every layer dense
  OracleTopK(ratio=0.1 | k=...)            every layer picks its own exact top-k per query head
  StreamingLLM(sinks=4, window=1024 | ratio=...)   sinks + the most recent tokens, every layer
  Quest(token_budget=1024 | ratio=...)     per-query-head page bound, first 2 layers dense
  TidalDecode(k=4096 | ratio=...)          layers 0-1 dense, per-query-head top-k re-selected at
                                           layers 2 and 13 of 28
  DELTA(budget_pages=64 | ratio=...)       pages chosen by the max over all heads at the
                                           Δ-layers 2, 14 and 22 of 28
  Kascade(ratio=0.1 | k=...)               per-KV-head token top-k at the anchors 0, 2, 8, 13, 14
                                           of 28, head-mapped reuse (sparse_prefill=True: also
                                           per 128-query prefill tile)
  Lychee(retrieval_heads=..., budget=TopK(4096) | Ratio(...))   retrieval heads select per
                                           head, sparse heads inherit
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
    """Keep floor(ratio × each row's length) tokens, at least `minimum` and one (never more
    than the row holds)."""
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


def _layer_tuple(name: str, layers, *, empty: bool = True) -> tuple[int, ...] | None:
    """`layers` as a tuple of ints (None stays None: the paper's choice, scaled at planning);
    ValueError for a string ("35" is not layers 3 and 5), a float, a bool, or (unless
    `empty`) no layers at all."""
    if layers is None:
        return None
    if isinstance(layers, (str, bytes)) or not isinstance(layers, (tuple, list, np.ndarray)):
        raise ValueError(f"{name}={layers!r}: expected a tuple of layer indices (ints)")
    bad = [i for i in layers if isinstance(i, (bool, np.bool_))
           or not isinstance(i, (int, np.integer))]
    if bad:
        raise ValueError(f"{name}={tuple(layers)!r}: {bad} are not layer indices (ints)")
    if not layers and not empty:
        raise ValueError(f"{name}=(): expected at least one layer")
    return tuple(int(i) for i in layers)


def _scale_layers(layers, num_layers: int, reference: int = 28) -> tuple[int, ...]:
    """Map layer indices chosen for a `reference`-deep model onto `num_layers`.

    Indices <= 2 (the papers' fixed early choices) stay; later ones scale with depth, never
    below 3 (after the early ones), and are kept strictly increasing; any that fall off the
    end are dropped."""
    if isinstance(num_layers, bool) or not isinstance(num_layers, (int, np.integer)) or (
            num_layers < 1):
        raise ValueError(f"scaled_to(num_layers={num_layers!r}): expected an int >= 1")
    out: list[int] = []
    for i in sorted(layers):
        j = i if i <= 2 else max(3, round(i * (num_layers - 1) / (reference - 1)))
        j = max(j, out[-1] + 1) if out else j
        if j < num_layers:
            out.append(j)
    return tuple(out)


def _layer_choice(name: str, given, paper, num_layers: int) -> tuple[int, ...]:
    """The layers given (checked against the model), or the paper's scaled to its depth."""
    if given is None:
        return _scale_layers(paper, num_layers)
    layers = tuple(int(i) for i in given)
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"{name}={layers}: layer indices {bad} are out of range for a model "
                         f"with {num_layers} layers (leave {name.split()[-1]} unset for the "
                         f"paper's choice scaled to {num_layers} layers: "
                         f"{_scale_layers(paper, num_layers)})")
    return _layers(name, layers, num_layers)


def _given_or(given, paper):
    return paper if given is None else given


def _early_layers(given, paper, num_layers: int) -> tuple[int, ...]:
    """Fixed early layers (the papers' dense layers 0 and 1): those the model has."""
    return tuple(i for i in paper if i < num_layers) if given is None else tuple(given)


def _one_budget(method: str, counts: dict, ratio, default: dict) -> dict:
    """{field: value} of the budget a method keeps: the one count or ratio given, else
    `default`. Only one may be given."""
    given = {k: v for k, v in {**counts, "ratio": ratio}.items() if v is not None}
    if len(given) > 1:
        shown = ", ".join(f"{k}={v}" for k, v in given.items())
        raise ValueError(f"{method}: give one budget, not {shown}")
    for k, v in given.items():
        _positive(f"{method} {k}", v)
        if k == "ratio" and v > 1:
            raise ValueError(f"{method} ratio={v}: expected 0 < ratio <= 1 (a share of each "
                             "row's length)")
        if k != "ratio" and int(v) != v:
            raise ValueError(f"{method} {k}={v!r}: expected a whole number")
    return given or default


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
        budget = _one_budget("OracleTopK", {"k": self.k}, self.ratio, {"ratio": 0.1})
        object.__setattr__(self, "ratio", budget.get("ratio"))

    def to_plan(self, config, page_size=None):
        budget = TopK(self.k) if self.k is not None else Ratio(self.ratio, self.min_k)
        return SparsePlan("oracle", (Role.SELF,) * config.num_layers,
                          _page_size("OracleTopK", None, page_size),
                          Selector(Score.HEAD_PROBS, 1, "query", budget))


@dataclasses.dataclass(frozen=True)
class StreamingLLM:
    """The first `sinks` tokens and the most recent ones: a `window` of tokens (1024 when
    neither is given), or as many as make `ratio` of each row's length with the sinks (the
    newest token at least)."""
    sinks: int = 4
    window: int | None = None
    ratio: float | None = None

    def __post_init__(self):
        _one_budget("StreamingLLM", {"window": self.window}, self.ratio, {})
        if self.sinks < 0:
            raise ValueError(f"StreamingLLM sinks={self.sinks}: expected >= 0")

    def to_plan(self, config, page_size=None):
        roles = (Role.SELF,) + (Role.REUSE,) * (config.num_layers - 1)
        if self.ratio is not None:     # ranked by position: the newest first, after the sinks
            selector = Selector(Score.NONE, 1, "shared", Ratio(self.ratio, self.sinks + 1),
                                sinks=self.sinks)
        else:
            window = 1024 if self.window is None else int(self.window)
            selector = Selector(Score.NONE, 1, "shared", TopK(self.sinks + window),
                                sinks=self.sinks, recent=window)
        return SparsePlan("streaming", roles, _page_size("StreamingLLM", None, page_size),
                          selector)


@dataclasses.dataclass(frozen=True)
class Quest:
    """Per query head, the pages whose key bounds promise the largest logit: `token_budget`
    tokens (1024 when neither is given) or `ratio` of each row's pages. The first
    `dense_layers` layers are dense (2, or as many as the model has)."""
    page_size: int = 16
    token_budget: int | None = None
    dense_layers: int | None = None
    ratio: float | None = None

    def __post_init__(self):
        check_page_size(self.page_size)
        _one_budget("Quest", {"token_budget": self.token_budget}, self.ratio, {})
        if self.dense_layers is not None and self.dense_layers < 0:
            raise ValueError(f"Quest dense_layers={self.dense_layers}: expected >= 0")

    def to_plan(self, config, page_size=None):
        p = _page_size("Quest", self.page_size, page_size)
        L = config.num_layers
        dense = min(2, L) if self.dense_layers is None else self.dense_layers
        if dense > L:
            raise ValueError(f"Quest dense_layers={dense} exceeds the model's {L} layers")
        roles = (Role.DENSE,) * dense + (Role.SELF,) * (L - dense)
        if self.ratio is not None:
            budget = Ratio(self.ratio)
        else:
            budget = _in_units(TopK(1024 if self.token_budget is None else
                                    int(self.token_budget)), p)
        return SparsePlan("quest", roles, p, Selector(Score.QUEST_BOUND, p, "query", budget))


TIDAL_SELECT_LAYERS = (2, 13)
DELTA_LAYERS = (2, 14, 22)
KASCADE_ANCHORS = (0, 2, 8, 13, 14)
PAPER_DENSE_LAYERS = (0, 1)


@dataclasses.dataclass(frozen=True)
class TidalDecode:
    """Layers 0 and 1 dense; per query head, the top `k` tokens (4096 when neither is given)
    or `ratio` of each row's length, re-selected at `select_layers` (unset: the paper's 2
    and 13 of 28, scaled to the model's depth)."""
    dense_layers: tuple[int, ...] | None = None
    select_layers: tuple[int, ...] | None = None
    k: int | None = None
    ratio: float | None = None

    def __post_init__(self):
        _one_budget("TidalDecode", {"k": self.k}, self.ratio, {})

    def scaled_to(self, num_layers: int) -> "TidalDecode":
        """This method with its layer choices for a `num_layers`-deep model spelled out."""
        return dataclasses.replace(
            self, dense_layers=_early_layers(self.dense_layers, PAPER_DENSE_LAYERS, num_layers),
            select_layers=_scale_layers(_given_or(self.select_layers, TIDAL_SELECT_LAYERS),
                                        num_layers))

    def to_plan(self, config, page_size=None):
        L = config.num_layers
        dense = _layers("TidalDecode dense_layers",
                        _early_layers(self.dense_layers, PAPER_DENSE_LAYERS, L), L)
        select = _layer_choice("TidalDecode select_layers", self.select_layers,
                               TIDAL_SELECT_LAYERS, L)
        if set(dense) & set(select):
            raise ValueError(f"TidalDecode: layers {sorted(set(dense) & set(select))} are both "
                             "dense and selecting")
        budget = Ratio(self.ratio) if self.ratio is not None else TopK(
            4096 if self.k is None else int(self.k))
        return SparsePlan("tidal", _roles(L, dense, select),
                          _page_size("TidalDecode", None, page_size),
                          Selector(Score.HEAD_PROBS, 1, "query", budget))


@dataclasses.dataclass(frozen=True)
class DELTA:
    """Pages chosen at the Δ-layers (unset: the paper's 2, 14 and 22 of 28, scaled to the
    model's depth) by the max over all query heads, reused by the layers after them; layers
    0 and 1 dense. The budget: `budget_pages` pages (64 when neither is given) or `ratio` of
    each row's pages. The `recent_pages` newest pages are always kept: unset, a quarter of
    `budget_pages` up to 8, or one page (the current one) with a `ratio`."""
    dense_layers: tuple[int, ...] | None = None
    delta_layers: tuple[int, ...] | None = None
    page_size: int = 16
    budget_pages: int | None = None
    recent_pages: int | None = None
    ratio: float | None = None
    origin: artifacts.Origin | None = _origin()

    def __post_init__(self):
        object.__setattr__(self, "dense_layers", _layer_tuple("DELTA dense_layers",
                                                              self.dense_layers))
        object.__setattr__(self, "delta_layers", _layer_tuple("DELTA delta_layers",
                                                              self.delta_layers, empty=False))
        check_page_size(self.page_size)
        _one_budget("DELTA", {"budget_pages": self.budget_pages}, self.ratio, {})
        if self.recent_pages is not None and self.recent_pages < 0:
            raise ValueError(f"DELTA recent_pages={self.recent_pages}: expected >= 0")
        if (self.recent_pages is not None and self.ratio is None
                and self.recent_pages > self.pages):
            raise ValueError(f"DELTA recent_pages={self.recent_pages} exceeds "
                             f"budget_pages={self.pages}: lower recent_pages or raise "
                             "budget_pages")

    @property
    def pages(self) -> int | None:
        """The fixed budget in pages (None for a ratio)."""
        if self.ratio is not None:
            return None
        return 64 if self.budget_pages is None else int(self.budget_pages)

    @property
    def recent(self) -> int:
        """The newest pages always kept."""
        if self.recent_pages is not None:
            return int(self.recent_pages)
        return 1 if self.ratio is not None else max(1, min(8, self.pages // 4))

    def scaled_to(self, num_layers: int) -> "DELTA":
        """This method with its layer choices for a `num_layers`-deep model spelled out."""
        return dataclasses.replace(
            self, dense_layers=_early_layers(self.dense_layers, PAPER_DENSE_LAYERS, num_layers),
            delta_layers=_scale_layers(_given_or(self.delta_layers, DELTA_LAYERS), num_layers))

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
        dense = _layers("DELTA dense_layers",
                        _early_layers(self.dense_layers, PAPER_DENSE_LAYERS, L), L)
        delta = _layer_choice("DELTA delta_layers", self.delta_layers, DELTA_LAYERS, L)
        if set(dense) & set(delta):
            raise ValueError(f"DELTA: layers {sorted(set(dense) & set(delta))} are both dense and "
                             "Δ-layers")
        budget = Ratio(self.ratio) if self.ratio is not None else TopK(self.pages)
        return SparsePlan("delta", _roles(L, dense, delta), p,
                          Selector(Score.MAX_HEADS, p, "shared", budget, recent=self.recent * p))


@dataclasses.dataclass(frozen=True)
class Kascade:
    """Per KV head, the top tokens of the group-summed probabilities at the anchor layers
    (unset: the paper's 0, 2, 8, 13 and 14 of 28, scaled to the model's depth), reused by the
    layers after them through the head map. The budget: `ratio` of each row's length, at
    least `min_k` tokens (the paper's 0.1 and 128), or `k` tokens."""
    anchor_layers: tuple[int, ...] | None = None
    ratio: float | None = None    # 0.1 when neither ratio nor k is given
    min_k: int = 128
    head_map: Any = None          # [layers, kv_heads] ints, or None for identity
    pooled_all_heads: bool = False
    sparse_prefill: bool = False  # the rolling per-tile top-k prefill (Kascade §3.6)
    prefill_tile: int = 128
    # decode: the anchors after layer 0 attend only to their own top-k (Kascade §3.6's passes:
    # scores without V, top-k, top-k attention) rather than densely
    sparse_anchors: bool = False
    k: int | None = None
    origin: artifacts.Origin | None = _origin()

    def __post_init__(self):
        budget = _one_budget("Kascade", {"k": self.k}, self.ratio, {"ratio": 0.1})
        object.__setattr__(self, "ratio", budget.get("ratio"))
        _positive("Kascade prefill_tile", self.prefill_tile)
        if self.sparse_prefill and self.pooled_all_heads:
            raise ValueError("Kascade sparse_prefill selects per KV head: it needs "
                             "pooled_all_heads=False")
        if self.min_k < 0:
            raise ValueError(f"Kascade min_k={self.min_k}: expected >= 0")
        if self.head_map is not None:
            hm = np.asarray(self.head_map)
            if hm.ndim != 2 or not np.issubdtype(hm.dtype, np.integer):
                raise ValueError(f"Kascade head_map has shape {hm.shape} ({hm.dtype}): expected "
                                 "integers of shape [layers, kv_heads]")
            object.__setattr__(self, "head_map", tuple(tuple(int(x) for x in r) for r in hm))

    def scaled_to(self, num_layers: int) -> "Kascade":
        """This method with its anchors for a `num_layers`-deep model spelled out."""
        return dataclasses.replace(
            self, anchor_layers=_scale_layers(_given_or(self.anchor_layers, KASCADE_ANCHORS),
                                         num_layers))

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
        anchors = _layer_choice("Kascade anchor_layers", self.anchor_layers, KASCADE_ANCHORS, L)
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
        budget = TopK(self.k) if self.k is not None else Ratio(self.ratio, self.min_k)
        return SparsePlan("kascade", roles, _page_size("Kascade", None, page_size),
                          Selector(score, 1, groups, budget),
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
        if self.gates is not None and self.retrieval_heads is not None:
            raise ValueError("Lychee got both retrieval_heads and gates=: give one (gates=PATH "
                             "is the same as retrieval_heads=PATH)")
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

    at_budget(config, budget, fitted) -> method: the method attending to `budget`, a
    `Ratio(r)` of each row's own length (what `LLM`, `sparsejax eval`, `demo` and
    `--budget-ratio` run: a row's output does not depend on its batch-mates) or a `TopK(n)`
    of n tokens (`--budget-tokens`), with layer choices scaled to the depth or taken from
    `fitted`. Each option overrides one constructor field.
    """
    constructor: type
    summary: str
    at_budget: Callable[[ModelConfig, Budget, Fitted], Any]
    options: tuple[Option, ...] = ()


def _share_or_tokens(budget: Budget) -> tuple[float | None, int | None]:
    """(ratio, None) for a `Ratio`, (None, tokens) for a `TopK`."""
    if not isinstance(budget, Budget) or budget.kind not in ("ratio", "fixed"):
        raise ValueError(f"budget={budget!r}: expected methods.Ratio(share of each row) or "
                         "methods.TopK(tokens)")
    return (budget.value, None) if budget.kind == "ratio" else (None, int(budget.value))


# The forced windows at a ratio cannot follow each row's budget (they are static): the
# attention sinks (StreamingLLM's 4 tokens) and the current page.
RATIO_SINKS, RATIO_RECENT = 4, DEFAULT_PAGE_SIZE


def _delta_at(config, budget, fitted):
    ratio, tokens = _share_or_tokens(budget)
    kw = (dict(ratio=ratio) if tokens is None else
          dict(budget_pages=max(1, math.ceil(tokens / DEFAULT_PAGE_SIZE))))
    if "delta" in fitted.calibration:
        return DELTA.from_calibration(fitted.calibration["delta"], **kw)
    return DELTA(**kw)


def _kascade_at(config, budget, fitted):
    ratio, tokens = _share_or_tokens(budget)
    kw = dict(ratio=ratio, min_k=0) if tokens is None else dict(k=tokens)
    if "kascade" in fitted.calibration:
        return Kascade.from_calibration(fitted.calibration["kascade"], **kw)
    return Kascade(**kw)


def _lychee_at(config, budget, fitted):
    heads = fitted.retrieval_heads
    if heads is None:
        heads = random_retrieval_heads(config, max(1, (config.num_layers - 1)
                                                   * config.num_kv_heads // 8))
    ratio, tokens = _share_or_tokens(budget)
    if tokens is None:
        return Lychee(heads, budget=Ratio(ratio), sinks=RATIO_SINKS, recent=RATIO_RECENT)
    return Lychee(heads, budget=TopK(tokens), sinks=min(128, tokens // 8),
                  recent=min(256, tokens // 4))


def _streaming_at(config, budget, fitted):
    ratio, tokens = _share_or_tokens(budget)
    if tokens is None:
        return StreamingLLM(sinks=RATIO_SINKS, ratio=ratio)
    return StreamingLLM(sinks=4, window=max(1, tokens - 4))


def _by_budget(make_ratio, make_tokens):
    def at(config, budget, fitted):
        ratio, tokens = _share_or_tokens(budget)
        return make_ratio(ratio) if tokens is None else make_tokens(tokens)
    return at


_SINKS = Option("--sinks", "sinks", "always-kept first tokens")
REGISTRY: dict[str, MethodSpec] = {
    "dense": MethodSpec(Dense, "every layer attends to the whole cache",
                        lambda config, budget, fitted: Dense()),
    "oracle": MethodSpec(OracleTopK, "exact top-k of every layer's own attention (the ceiling)",
                         _by_budget(lambda r: OracleTopK(ratio=r), lambda n: OracleTopK(k=n))),
    "streaming": MethodSpec(StreamingLLM, "attention sinks and the most recent tokens",
                            _streaming_at, (_SINKS,)),
    "quest": MethodSpec(Quest, "per-query-head page bounds",
                        _by_budget(lambda r: Quest(ratio=r), lambda n: Quest(token_budget=n))),
    "tidal": MethodSpec(
        TidalDecode, "per-query-head top-k re-selected at a few layers",
        _by_budget(lambda r: TidalDecode(ratio=r), lambda n: TidalDecode(k=n)),
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


def budget_ratio_methods(config: ModelConfig, ratio: float, *, retrieval_heads=None,
                         calibration=None) -> dict[str, Any]:
    """Every registered method at `ratio` of each row's own length (see `MethodSpec`)."""
    if not (isinstance(ratio, (int, float)) and math.isfinite(ratio) and 0 < ratio <= 1):
        raise ValueError(f"ratio={ratio}: expected a budget ratio in (0, 1]")
    fitted = Fitted(retrieval_heads, calibration or {})
    return {name: spec.at_budget(config, Ratio(ratio), fitted) for name, spec in REGISTRY.items()}
