"""Plumbing shared by every kernel family: backend choice, Triton compiler params, the LSE combine,
the score rules, the selection group each query head reads.

The LSE combine lives here once: split-K reduction, hybrid dense/sparse merges and RESA all
call `merge_partials`.
"""
from __future__ import annotations

import contextlib
import enum
import warnings
from typing import Literal

import jax
import jax.numpy as jnp

# jax 0.11 marks the Triton backend of Pallas as deprecated in favour of Mosaic GPU. We use
# Triton on purpose (it has an interpret mode on CPU and lowers paged gathers); silence the
# warning here, once, rather than at every call site.
warnings.filterwarnings("ignore", category=DeprecationWarning, message=".*[Tt]riton.*")

from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import triton as plgpu  # noqa: E402

Backend = Literal["auto", "pallas", "reference"]
BACKENDS = ("auto", "pallas", "reference")


_auto_override: list[str] = []


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


@contextlib.contextmanager
def use_backend(backend: str):
    """Within this block (at trace time), backend="auto" means `backend` — e.g. trace a whole
    decode step on the references on a GPU to check the kernels end to end. Trace a fresh
    function inside the block: an outer jit already traced keeps the path it compiled."""
    if backend not in ("pallas", "reference"):
        raise ValueError(f"backend={backend!r}: expected 'pallas' or 'reference'")
    _auto_override.append(backend)
    try:
        yield
    finally:
        _auto_override.pop()


def resolve_backend(backend: str) -> str:
    """'auto' -> 'pallas' on GPU, 'reference' elsewhere (or what `use_backend` says)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: expected one of {BACKENDS}")
    if backend == "auto":
        if _auto_override:
            return _auto_override[-1]
        return "pallas" if on_gpu() else "reference"
    return backend


def choose_backend(backend: str, unsupported: str | None) -> str:
    """Backend for one call. `unsupported` says why the Pallas kernel cannot take these shapes
    (None when it can): "auto" then runs the reference, an explicit "pallas" raises."""
    chosen = resolve_backend(backend)
    if chosen == "pallas" and unsupported is not None:
        if backend == "pallas":
            raise ValueError(unsupported)
        return "reference"
    return chosen


def pallas_support(q, k_pages, *, head_dims, page_sizes, dtypes, max_group: int) -> str | None:
    """Why the paged kernels cannot run these shapes, or None. q [B, HQ, D],
    k_pages [num_pages, HK, P, D]."""
    _, num_heads, head_dim = q.shape
    _, kv_heads, page_size, _ = k_pages.shape
    if head_dim not in head_dims:
        return f"head_dim={head_dim}: expected one of {head_dims}"
    if page_size not in page_sizes:
        return f"page_size={page_size}: expected one of {page_sizes}"
    if q.dtype not in dtypes:
        return f"q.dtype={q.dtype}: expected one of {tuple(str(jnp.dtype(d)) for d in dtypes)}"
    if num_heads // kv_heads > max_group:
        return f"group size {num_heads // kv_heads}: expected at most {max_group}"
    return None


def resolve_interpret(interpret: bool | None) -> bool:
    """None -> interpret mode unless a GPU is present (Pallas-Triton only compiles for GPUs)."""
    return (not on_gpu()) if interpret is None else bool(interpret)


def triton_params(num_warps: int, num_stages: int) -> plgpu.CompilerParams:
    """Explicit Triton compiler params: without them jax 0.10/0.11 routes to Mosaic GPU."""
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def pallas_call(kernel, *, compiler_params, interpret: bool, **kwargs):
    """`pl.pallas_call` with the Triton params attached (interpret mode ignores them)."""
    return pl.pallas_call(kernel, compiler_params=compiler_params, interpret=interpret, **kwargs)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def merge_partials(out: jax.Array, lse: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
    """Combine attention partials computed over disjoint key sets.

    out   [..., S, ..., D]  each partial's normalised output (fp32), S on `axis`
    lse   [..., S, ...]     each partial's log-sum-exp (natural log); -inf for an empty partial
    Returns (out [..., D] fp32, lse [...]) over the union, with the S axis reduced.
    An all-empty union gives out = 0 and lse = -inf.
    """
    lse = lse.astype(jnp.float32)
    m = jnp.max(lse, axis=axis, keepdims=True)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lse - m_safe)  # 0 for empty partials
    total = jnp.sum(w, axis=axis, keepdims=True)
    lse_all = jnp.squeeze(jnp.where(total > 0, m_safe + jnp.log(total), -jnp.inf), axis)
    w = w / jnp.where(total > 0, total, 1.0)
    merged = jnp.sum(out.astype(jnp.float32) * jnp.expand_dims(w, -1), axis=axis)
    return merged, lse_all


class Score(enum.StrEnum):
    """What a selecting layer ranks positions by. The dense kernel computes the first four
    (`paged_decode_attention(score=...)`); members equal their strings, so either is taken."""
    MAX_HEADS = "max_heads"            # DELTA: max over all query heads of the probabilities
    GROUP_SUM = "group_sum"            # Kascade: probabilities summed over each GQA group
    MEAN_QUERY = "mean_query"          # LycheeDecode: logits of each group's mean query
    HEAD_PROBS = "head_probs"          # TidalDecode, oracle top-k: per query head
    ALL_HEADS_SUM = "all_heads_sum"    # Kascade pooled: GROUP_SUM summed over the KV heads
    QUEST_BOUND = "quest_bound"        # Quest: per-page upper bound of the logits
    NONE = "none"                      # StreamingLLM: only the forced sinks and recent window

    @property
    def is_logit(self) -> bool:
        """Logits (pooled over a unit by max) rather than probabilities (pooled by sum)."""
        return self in (Score.MEAN_QUERY, Score.QUEST_BOUND)


def check_choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r}: expected one of {tuple(allowed)}")


def group_of_head(groups: int, num_heads: int, num_kv_heads: int, head_map=None):
    """Selection group each query head reads -> [HQ] int32. groups = 1 (shared), HK (per KV
    head, through `head_map` [HK] when given) or HQ (per query head)."""
    if groups == 1:
        return jnp.zeros((num_heads,), jnp.int32)
    if groups == num_heads and groups != num_kv_heads:
        return jnp.arange(num_heads, dtype=jnp.int32)
    kv_of_head = jnp.arange(num_heads, dtype=jnp.int32) // (num_heads // num_kv_heads)
    if head_map is None:
        return kv_of_head
    return jnp.clip(head_map, 0, num_kv_heads - 1).astype(jnp.int32)[kv_of_head]
