"""SparsePlan (static, hashable: a jit static argument) and Selection (the carry between layers).

A method is a constructor of a plan (see `sparsejax.methods`): per-layer roles, a selector
(score rule, unit, groups, budget, sinks, recent window), a head map, retrieval-head flags and
an optional RESA residual. The decode step only ever reads a plan; it never branches on which
method made it.
"""
from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any, NamedTuple, Protocol

import flax.struct
import jax
import jax.numpy as jnp

from sparsejax.cache import check_page_size
from sparsejax.models import ModelConfig
from sparsejax.pallas_kernels.common import Score


class Role(enum.IntEnum):
    DENSE = 0    # dense attention, selection untouched
    SELECT = 1   # dense attention, then its scores choose a new selection for later layers
    REUSE = 2    # sparse attention over the carried selection (through the head map)
    HYBRID = 3   # retrieval heads: DENSE+SELECT for their group; the other heads: REUSE
    SELF = 4     # choose a selection from a pre-attention score, then attend sparsely to it


GROUPS = ("shared", "kv", "query")


@dataclasses.dataclass(frozen=True)
class Budget:
    """How many units a selection keeps, per row and group.

    kind: "fixed" (value units), "ratio" (value × units in the context, at least `minimum`),
    "top_p" (smallest set whose probability mass reaches value), "threshold" (units whose
    probability is at least value). `limit` caps the static buffer (units) for the adaptive
    kinds; None means the whole context.
    """
    kind: str
    value: float
    minimum: int = 0
    limit: int | None = None

    def __post_init__(self):
        kinds = ("fixed", "ratio", "top_p", "threshold")
        if self.kind not in kinds:
            raise ValueError(f"budget kind={self.kind!r}: expected one of {kinds}")
        if not (math.isfinite(self.value) and self.value > 0):
            raise ValueError(f"budget {self.kind}={self.value}: expected a finite value > 0")
        if self.kind in ("ratio", "top_p", "threshold") and self.value > 1:
            raise ValueError(f"budget {self.kind}={self.value}: expected a value in (0, 1]")
        if self.kind == "fixed" and int(self.value) != self.value:
            raise ValueError(f"budget fixed={self.value}: expected a whole number of units")
        if self.minimum < 0:
            raise ValueError(f"budget minimum={self.minimum}: expected >= 0")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"budget limit={self.limit}: expected None (the whole context) or "
                             ">= 1 unit")

    def buffer_size(self, max_units: int) -> int:
        """The static number of slots a selection needs for contexts up to `max_units`."""
        if self.kind == "fixed":
            return max(1, min(int(self.value), max_units))
        if self.kind == "ratio":
            k = max(-(-int(self.value * max_units * 1e6) // 1_000_000), self.minimum)
            return max(1, min(k, max_units))
        return max(1, min(max_units if self.limit is None else self.limit, max_units))


@dataclasses.dataclass(frozen=True)
class Selector:
    """What a selecting layer computes and keeps.

    score: the `Score` rule (or its string): MAX_HEADS (DELTA), GROUP_SUM (Kascade),
      ALL_HEADS_SUM (Kascade pooled), MEAN_QUERY (Lychee), HEAD_PROBS (TidalDecode, oracle
      top-k), QUEST_BOUND (Quest), NONE (StreamingLLM: only the forced sinks and recent window).
    unit: tokens per selected index — 1, the page size, or a multiple of it (blocks).
    groups: "shared" (one set for all heads), "kv" (per KV head), "query" (per query head).
    sinks / recent: tokens always kept at the start / end of the context (rounded up to units).
    """
    score: Score
    unit: int
    groups: str
    budget: Budget
    sinks: int = 0
    recent: int = 0

    def __post_init__(self):
        if self.score not in tuple(Score):
            raise ValueError(f"score={self.score!r}: expected one of {tuple(map(str, Score))}")
        object.__setattr__(self, "score", Score(self.score))
        if self.groups not in GROUPS:
            raise ValueError(f"groups={self.groups!r}: expected one of {GROUPS}")
        if not isinstance(self.unit, int) or self.unit < 1:
            raise ValueError(f"unit={self.unit!r}: expected tokens per index >= 1")
        if self.sinks < 0 or self.recent < 0:
            raise ValueError(f"sinks={self.sinks}, recent={self.recent}: expected >= 0")

    @property
    def force_first(self) -> int:
        return -(-self.sinks // self.unit)

    @property
    def force_last(self) -> int:
        return -(-self.recent // self.unit)

    def num_groups(self, config: ModelConfig) -> int:
        return {"shared": 1, "kv": config.num_kv_heads, "query": config.num_heads}[self.groups]


@dataclasses.dataclass(frozen=True)
class Residual:
    """RESA: the unselected prefill keys' contribution from a rank-1 prior
    (docs/architecture.md, RESA)."""
    lam: float = 1.0
    fold_decode_tokens: bool = False

    def __post_init__(self):
        if not (math.isfinite(self.lam) and self.lam >= 0):
            raise ValueError(f"RESA lam={self.lam}: expected a finite value >= 0")


@dataclasses.dataclass(frozen=True)
class SparsePlan:
    name: str
    roles: tuple[Role, ...]
    page_size: int
    selector: Selector | None = None
    head_map: tuple[tuple[int, ...], ...] | None = None      # [layers][kv_heads]
    retrieval: tuple[tuple[bool, ...], ...] | None = None    # [layers][kv_heads] (HYBRID)
    residual: Residual | None = None
    prefill_tile: int | None = None   # Kascade's sparse prefill: queries per selection tile

    def __post_init__(self):
        check_page_size(self.page_size)
        if self.prefill_tile is not None and (not isinstance(self.prefill_tile, int)
                                              or self.prefill_tile < 1):
            raise ValueError(f"prefill_tile={self.prefill_tile!r}: expected None or an int >= 1")
        roles = tuple(Role(r) for r in self.roles)
        object.__setattr__(self, "roles", roles)
        sparse = [i for i, r in enumerate(roles) if r in (Role.SELECT, Role.REUSE, Role.HYBRID,
                                                         Role.SELF)]
        if sparse and self.selector is None:
            raise ValueError(f"plan {self.name!r} has selecting/sparse layers but no selector")
        first_select = next((i for i, r in enumerate(roles)
                             if r in (Role.SELECT, Role.SELF, Role.HYBRID)), len(roles))
        early = [i for i, r in enumerate(roles) if r == Role.REUSE and i < first_select]
        if early:
            raise ValueError(f"plan {self.name!r}: layers {early} reuse a selection before any "
                             "layer selects one")
        if self.selector is not None and self.selector.unit > 1 and (
                self.selector.unit % self.page_size):
            raise ValueError(f"selection unit={self.selector.unit} tokens must be a multiple of "
                             f"page_size={self.page_size}")
        if self.residual is not None and self.selector is None:
            raise ValueError("RESA needs a sparse plan to wrap")

    @property
    def num_layers(self) -> int:
        return len(self.roles)

    def segments(self) -> list[tuple[Role, int, int]]:
        """Maximal runs [start, stop) of consecutive layers with the same role."""
        out: list[tuple[Role, int, int]] = []
        for i, r in enumerate(self.roles):
            if out and out[-1][0] == r:
                out[-1] = (r, out[-1][1], i + 1)
            else:
                out.append((r, i, i + 1))
        return out

    def check_model(self, config: ModelConfig) -> None:
        if self.num_layers != config.num_layers:
            raise ValueError(f"plan {self.name!r} has {self.num_layers} layers; the model has "
                             f"{config.num_layers}")
        for name, table in (("head_map", self.head_map), ("retrieval", self.retrieval)):
            if table is not None and (len(table) != config.num_layers or
                                      any(len(r) != config.num_kv_heads for r in table)):
                raise ValueError(f"{name} must have shape [{config.num_layers}, "
                                 f"{config.num_kv_heads}]")


class Method(Protocol):
    """Anything with `to_plan(config, page_size)`: the classes in `sparsejax.methods`."""
    def to_plan(self, config: ModelConfig, page_size: int | None) -> SparsePlan: ...


def dense_plan(config: ModelConfig, page_size: int | None = None) -> SparsePlan:
    return SparsePlan("dense", (Role.DENSE,) * config.num_layers,
                      16 if page_size is None else page_size)


def as_plan(method: Any, config: ModelConfig, page_size: int | None) -> SparsePlan:
    """None -> dense; a method -> its plan for this model; a plan is checked and returned."""
    if method is None:
        plan = dense_plan(config, page_size)
    elif isinstance(method, SparsePlan):
        plan = method
        if page_size is not None and page_size != plan.page_size:
            raise ValueError(f"page_size={page_size} disagrees with the plan's "
                             f"page_size={plan.page_size}")
    elif hasattr(method, "to_plan"):
        plan = method.to_plan(config, page_size)
    else:
        raise TypeError(f"method={method!r}: expected None, a sparsejax.methods method or a "
                        "SparsePlan")
    plan.check_model(config)
    return plan


@flax.struct.dataclass
class Selection:
    """The carry between layers: sorted selected unit indices per (row, group), -1 padded."""
    indices: jax.Array   # [B, G, k_max] int32
    count: jax.Array     # [B, G] int32

    @classmethod
    def empty(cls, batch: int, groups: int, k_max: int) -> "Selection":
        return cls(indices=jnp.full((batch, groups, k_max), -1, jnp.int32),
                   count=jnp.zeros((batch, groups), jnp.int32))


class Attended(NamedTuple):
    """What a layer's heads attended to: `sel` through `head_map`, except `dense_heads`."""
    sel: Selection
    head_map: jax.Array | None
    dense_heads: jax.Array | None


def attended_head_map(role: Role, selector: Selector, head_map_row):
    """The head map a sparse layer reads its selection through: the layer's row for per-KV-head
    selections carried from an earlier layer; none for shared or per-query-head ones, nor for
    a SELF layer's own fresh selection."""
    return head_map_row if selector.groups == "kv" and role != Role.SELF else None
