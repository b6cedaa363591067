"""Budgets: k_row [R] int32 for `topk_select`, one per row, for LycheeDecode's four budget
modes and Kascade's ratio.

  TopK       fixed_budget(k, valid)
  Ratio      ratio_budget(ratio, valid, minimum, maximum): Lychee's sparsity theta is
             ratio = 1 - theta; Kascade is ratio_budget(0.1, valid, minimum=128)
  TopP       top_p_budget(scores, p, valid, logits=...)
  Threshold  threshold_budget(scores, threshold, valid, logits=...)
"""
from __future__ import annotations

import fractions

import jax.numpy as jnp
from jax import lax


def _check_valid(valid):
    valid = jnp.asarray(valid)
    if valid.ndim != 1 or not jnp.issubdtype(valid.dtype, jnp.integer):
        raise ValueError(f"valid: shape={valid.shape} dtype={valid.dtype}: expected [R] int")
    return jnp.maximum(valid.astype(jnp.int32), 0)


def _check_fraction(name, value, *, allow_zero):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (
        0 <= value <= 1 if allow_zero else 0 < value <= 1)
    if not ok:
        raise ValueError(f"{name}={value!r}: expected a static number in "
                         f"{'[0, 1]' if allow_zero else '(0, 1]'}")


def fixed_budget(k, valid):
    """TopK: min(k, valid) per row. k: int >= 0 or [R] int."""
    if isinstance(k, int) and k < 0:
        raise ValueError(f"k={k}: expected >= 0")
    return jnp.minimum(jnp.asarray(k, jnp.int32), _check_valid(valid))


def ratio_budget(ratio: float, valid, minimum: int = 0, maximum: int | None = None):
    """Ratio: min(max(floor(ratio * valid), minimum), valid[, maximum]) per row.

    Kascade's k = min(max(0.1 * len, 128), len) is ratio_budget(0.1, valid, minimum=128);
    LycheeDecode's Ratio with sparsity theta keeps int((1 - theta) * len): ratio = 1 - theta.
    `ratio` is taken as the nearest fraction num/den with den <= 2**15 (exact for decimals such
    as 0.1 or 0.05) and the floor is computed exactly in int32, so 0.1 * 30 gives 3 and never
    2 through float rounding. `maximum` (e.g. the static k of the buffer) caps the result.
    """
    _check_fraction("ratio", ratio, allow_zero=True)
    if not isinstance(minimum, int) or minimum < 0:
        raise ValueError(f"minimum={minimum!r}: expected a static int >= 0")
    if maximum is not None and (not isinstance(maximum, int) or maximum < minimum):
        raise ValueError(f"maximum={maximum!r}: expected None or a static int >= {minimum=}")
    valid = _check_valid(valid)
    frac = fractions.Fraction(ratio).limit_denominator(1 << 15)
    num, den = frac.numerator, frac.denominator
    # num * valid overflows int32; split valid = q * den + r (num <= den, r < den <= 2**15).
    k = num * (valid // den) + (num * (valid % den)) // den
    k = jnp.minimum(jnp.maximum(k, minimum), valid)
    return k if maximum is None else jnp.minimum(k, maximum)


def _row_probabilities(scores, valid, logits: bool):
    """(probabilities [R, N] over each row's valid columns, 0 elsewhere; that mask; valid)."""
    if scores.ndim != 2 or not jnp.issubdtype(scores.dtype, jnp.floating):
        raise ValueError(f"scores: shape={scores.shape} dtype={scores.dtype}: "
                         "expected a [R, N] float array")
    valid = _check_valid(valid)
    if valid.shape[0] != scores.shape[0]:
        raise ValueError(f"valid: shape={valid.shape}: expected [{scores.shape[0]}] "
                         f"(one per row of scores {scores.shape})")
    scores = scores.astype(jnp.float32)
    present = jnp.arange(scores.shape[1])[None, :] < valid[:, None]
    if logits:
        top = jnp.max(jnp.where(present, scores, -jnp.inf), axis=1, keepdims=True)
        mass = jnp.where(present, jnp.exp(scores - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)
    else:
        mass = jnp.where(present, scores, 0.0)
    total = jnp.sum(mass, axis=1, keepdims=True)
    return mass / jnp.where(total > 0, total, 1.0), present, valid


def top_p_budget(scores, p: float, valid, *, logits: bool = True):
    """TopP: the fewest columns whose probability mass reaches p (0 < p <= 1), per row.

    scores [R, N]: logits (probabilities = softmax over the valid columns) when logits=True,
    else non-negative weights (probabilities = weights / their sum over the valid columns,
    e.g. post-softmax attention pooled over heads). Forced columns get no special treatment:
    the budget counts the columns the scores themselves need. A row whose float mass falls
    short of p (or that has no mass at all) keeps all valid columns; an empty row gets 0.
    NaN scores give an unspecified budget.

    No sort: a 31-step bitwise search over the bits of the (non-negative) probabilities finds
    the largest probability t with mass(prob >= t) >= p, each step one masked row sum; ties
    at t are then counted as ceil((p - mass(prob > t)) / t).
    """
    _check_fraction("p", p, allow_zero=False)
    prob, present, valid = _row_probabilities(scores, valid, logits)

    def step(i, t):  # t [R]: int32 bits of a non-negative float; such bits order like the floats
        cand = t | lax.shift_left(jnp.int32(1), 30 - i)
        mass = jnp.sum(jnp.where(prob >= lax.bitcast_convert_type(cand, jnp.float32)[:, None],
                                 prob, 0.0), axis=1)
        return jnp.where(mass >= p, cand, t)

    t_bits = lax.fori_loop(0, 31, step, jnp.zeros(prob.shape[:1], jnp.int32))
    t = lax.bitcast_convert_type(t_bits, jnp.float32)[:, None]
    above = prob > t
    mass_above = jnp.sum(jnp.where(above, prob, 0.0), axis=1)
    ties = jnp.sum(present & (prob == t), axis=1)
    need = jnp.ceil((p - mass_above) / jnp.where(t[:, 0] > 0, t[:, 0], 1.0)).astype(jnp.int32)
    count = jnp.sum(above, axis=1) + jnp.clip(need, 1, ties)
    return jnp.where(t_bits > 0, count, valid).astype(jnp.int32)


def threshold_budget(scores, threshold: float, valid, *, logits: bool = True):
    """Threshold: valid columns with probability >= threshold, at least 1 (0 for an empty row).

    Probabilities as in `top_p_budget`. LycheeDecode's reference code keeps prob > threshold;
    the two differ only on exact equality.
    """
    _check_fraction("threshold", threshold, allow_zero=False)
    prob, present, valid = _row_probabilities(scores, valid, logits)
    count = jnp.sum(present & (prob >= threshold), axis=1)
    return jnp.minimum(jnp.maximum(count, 1), valid).astype(jnp.int32)
