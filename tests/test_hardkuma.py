"""HardKuma closed forms against Monte Carlo and an independent float64 integral; gradients."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsejax import hardkuma as hk

PARAMS = [(0.5, 0.5), (0.3, 2.0), (2.0, 0.5), (1.0, 1.0), (3.0, 5.0), (0.8, 1.5)]
SAMPLES = 100_000


@pytest.fixture(scope="module")
def samples():
    a, b = (jnp.asarray(x, jnp.float32) for x in zip(*PARAMS))
    return np.asarray(hk.sample(jax.random.key(0), a, b, (SAMPLES, len(PARAMS))))


def _survival_integral(a, b):
    """1.2 * int_{1/12}^{11/12} (1 - x^a)^b dx in float64 on a fine grid (trapezoid)."""
    x = np.linspace(1 / 12, 11 / 12, 400_001)
    return 1.2 * np.trapezoid((1 - x ** a) ** b, x)


@pytest.mark.parametrize("i", range(len(PARAMS)))
def test_closed_forms_match_monte_carlo(samples, i):
    a, b = PARAMS[i]
    z = samples[:, i]
    assert z.min() >= 0 and z.max() <= 1
    checks = {"P(z=0)": (hk.prob_zero(a, b), np.mean(z == 0)),
              "P(z=1)": (hk.prob_one(a, b), np.mean(z == 1)),
              "P(z!=0)": (hk.prob_nonzero(a, b), np.mean(z != 0)),
              "E[z]": (hk.mean(a, b), z.mean())}
    for name, (closed, empirical) in checks.items():
        assert abs(float(closed) - empirical) < 0.01, (name, a, b, float(closed), empirical)


def test_mean_matches_float64_integral():
    for a, b in PARAMS + [(0.05, 0.05), (50.0, 50.0), (3.0, 200.0), (20.0, 1000.0)]:
        assert float(hk.mean(a, b)) == pytest.approx(_survival_integral(a, b), abs=2e-6)


def test_mean_is_not_the_kuma_mean():
    """Negative control: the plain Kuma mean b * B(1 + 1/a, b) is off by more than the
    tolerance above where the clamped mass matters."""
    a, b = 0.3, 2.0
    kuma_mean = b * math.exp(math.lgamma(1 + 1 / a) + math.lgamma(b) - math.lgamma(1 + 1 / a + b))
    assert abs(kuma_mean - float(hk.mean(a, b))) > 0.02


def test_expected_l0_is_the_sum_of_nonzero_probabilities(samples):
    a, b = (jnp.asarray(x, jnp.float32) for x in zip(*PARAMS))
    empirical = np.mean(np.sum(samples != 0, axis=1))
    assert float(hk.expected_l0(a, b)) == pytest.approx(empirical, rel=0.01)
    assert float(hk.expected_l0(a, b)) == pytest.approx(
        sum((1 - (1 / 12) ** x) ** y for x, y in PARAMS), rel=1e-5)


def test_gradients_finite_and_nonzero():
    key = jax.random.key(1)
    fns = {"prob_zero": hk.prob_zero, "prob_one": hk.prob_one, "mean": hk.mean,
           "expected_l0": hk.expected_l0,
           "sample": lambda a, b: jnp.mean(hk.sample(key, a, b, (1000,)))}
    for a, b in PARAMS:
        for name, fn in fns.items():
            ga, gb = jax.grad(lambda a, b: jnp.sum(fn(a, b)), argnums=(0, 1))(
                jnp.float32(a), jnp.float32(b))
            assert np.isfinite(ga) and np.isfinite(gb) and ga != 0 and gb != 0, (name, a, b)


def test_far_from_the_start_values_and_gradients_stay_finite():
    """log a, log b up to +-30: finite everywhere, and P(z != 0) keeps a gradient where the
    naive log(-expm1(.)) would round it away (a ~ 7-30)."""
    key = jax.random.key(2)
    total = lambda la, lb: (hk.mean(jnp.exp(la), jnp.exp(lb))  # noqa: E731
                            + hk.expected_l0(jnp.exp(la), jnp.exp(lb))
                            + jnp.sum(hk.sample(key, jnp.exp(la), jnp.exp(lb), (16,))))
    for la in (-30.0, -10.0, 0.0, 10.0, 30.0):
        for lb in (-30.0, 0.0, 30.0):
            grads = jax.grad(total, argnums=(0, 1))(jnp.float32(la), jnp.float32(lb))
            assert np.isfinite(float(total(la, lb))) and all(np.isfinite(g) for g in grads)
    g = jax.grad(lambda la: hk.prob_nonzero(jnp.exp(la), 1.0))(jnp.float32(2.5))
    assert 0 < float(g) < 1e-3
