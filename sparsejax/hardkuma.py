"""The HardKuma distribution (Bastings et al., 2019) of LycheeDecode's head gates, in pure jnp.

    u ~ U(0.001, 0.999)                       (the reference code's truncation, for stable grads)
    x = (1 - (1 - u)^(1/b))^(1/a)             Kuma(a, b) by its inverse CDF
    t = -0.1 + 1.2 x                          stretched to (p, q) = (-0.1, 1.1)
    z = min(1, max(0, t))                     rectified: point masses at 0 and 1

With the Kuma CDF F(x; a, b) = 1 - (1 - x^a)^b:
    P(z = 0) = P(x <= 1/12)  = F(1/12)        (t <= 0  <=>  x <= 0.1 / 1.2)
    P(z = 1) = P(x >= 11/12) = 1 - F(11/12)   (t >= 1  <=>  x >= 1.1 / 1.2)
    E[L0]    = sum over heads of P(z != 0) = sum (1 - F(1/12))
    E[z]     = integral_0^1 P(z > s) ds = 1.2 * integral_{1/12}^{11/12} (1 - x^a)^b dx
E[z] has no closed form with gradients in JAX (the incomplete beta function's derivatives in
its shape parameters are not implemented), so it is integrated with composite Gauss-Legendre
quadrature: the integrand is smooth and bounded on [1/12, 11/12] for every a, b > 0.

Every function takes a, b > 0 of any (broadcasting) shape and is differentiable in both. Terms
of the form log(1 - y^c) go through `_log1mexp(c log y)`: the naive forms round to log 1 = 0
once y^c < 1e-8 and, worse, lose their gradient there (expm1's derivative is computed as
expm1 + 1), which would freeze a gate that has moved far towards 0 or 1.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

LOWER, UPPER = -0.1, 1.1              # the stretch interval (p, q)
U_EPS = 1e-3                          # u ~ U(U_EPS, 1 - U_EPS)
ZERO_EDGE = -LOWER / (UPPER - LOWER)        # 1/12: x at or below it gives z = 0
ONE_EDGE = (1 - LOWER) / (UPPER - LOWER)    # 11/12: x at or above it gives z = 1

# Composite Gauss-Legendre rule on [1/12, 11/12], 16 panels x 8 nodes: within 2e-7 of adaptive
# quadrature (float64) for a, b anywhere in [1e-4, 1e4].
_PANELS, _NODES = 16, 8
_gl_x, _gl_w = np.polynomial.legendre.leggauss(_NODES)
_edges = np.linspace(ZERO_EDGE, ONE_EDGE, _PANELS + 1)
_half = (_edges[1:] - _edges[:-1])[:, None] / 2
QUAD_X = ((_edges[:-1, None] + _edges[1:, None]) / 2 + _half * _gl_x).reshape(-1)
QUAD_W = (_half * _gl_w).reshape(-1)


def _log1mexp(x):
    """log(1 - e^x) for x < 0, accurate at both ends, with finite gradients: each branch of the
    where only ever sees inputs it is finite on (`sparsejax.resa.log1mexp` is the same function
    without that guard, so its gradient is NaN where the unused branch overflows)."""
    near_zero = x > -math.log(2.0)
    return jnp.where(near_zero, jnp.log(-jnp.expm1(jnp.where(near_zero, x, -1.0))),
                     jnp.log1p(-jnp.exp(jnp.where(near_zero, -1.0, x))))


def _log_survival(x, a, b):
    """log(1 - F(x; a, b)) = b * log(1 - x^a), for 0 < x < 1."""
    return b * _log1mexp(a * jnp.log(x))


def kuma_cdf(x, a, b):
    """Kumaraswamy CDF F(x; a, b) = 1 - (1 - x^a)^b for 0 < x < 1."""
    return -jnp.expm1(_log_survival(x, a, b))


def prob_zero(a, b):
    """P(z = 0) = F(1/12; a, b)."""
    return kuma_cdf(ZERO_EDGE, a, b)


def prob_one(a, b):
    """P(z = 1) = 1 - F(11/12; a, b)."""
    return jnp.exp(_log_survival(ONE_EDGE, a, b))


def prob_nonzero(a, b):
    """P(z != 0) = 1 - F(1/12; a, b): one head's share of E[L0]."""
    return jnp.exp(_log_survival(ZERO_EDGE, a, b))


def expected_l0(a, b):
    """E[||z||_0] = sum of P(z != 0) over every gate in a, b."""
    return jnp.sum(prob_nonzero(a, b))


def mean(a, b):
    """E[z] of the rectified variable (not the plain Kuma mean), by quadrature."""
    a, b = jnp.asarray(a)[..., None], jnp.asarray(b)[..., None]
    survival = jnp.exp(_log_survival(jnp.asarray(QUAD_X, jnp.float32), a, b))
    total = (UPPER - LOWER) * jnp.sum(survival * jnp.asarray(QUAD_W, jnp.float32), axis=-1)
    return jnp.minimum(total, 1.0)   # the float32 weights can overshoot 1 by an ulp


def sample(key: jax.Array, a, b, shape=None):
    """Reparameterised HardKuma samples z in [0, 1] of `shape` (default: the broadcast shape of
    a and b); gradients flow to a and b through x."""
    shape = jnp.broadcast_shapes(jnp.shape(a), jnp.shape(b)) if shape is None else shape
    u = jax.random.uniform(key, shape, jnp.float32, U_EPS, 1.0 - U_EPS)
    log_x = _log1mexp(jnp.log1p(-u) / b) / a     # x = (1 - (1 - u)^(1/b))^(1/a)
    return jnp.clip(LOWER + (UPPER - LOWER) * jnp.exp(log_x), 0.0, 1.0)
