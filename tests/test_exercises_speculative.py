"""Chapter "Speculative decoding and multi-token prediction" (book/speculative/speculative-mtp), Spec tasks
1 to 3: `pytest tests/test_exercises_speculative.py -k spec_task`."""

from __future__ import annotations

import numpy as np
import pytest

from ref_impl import exercises as ex


def expected_by_hand(alpha, gamma):
    return float(sum(alpha ** i for i in range(gamma + 1)))        # 1 + α + ... + α^γ


def test_spec_task_1_accepts_the_geometric_sum():
    # α = 0.7, γ = 4: 1 + 0.7 + 0.49 + 0.343 + 0.2401 = 2.7731
    assert expected_by_hand(0.7, 4) == pytest.approx(2.7731)
    assert ex.check_expected_tokens(2.7731)
    assert ex.check_expected_tokens(expected_by_hand)


@pytest.mark.parametrize("wrong, hint", [
    (lambda a, g: a * g, "judged alone"),
    (lambda a, g: expected_by_hand(a, g) - 1, "target emits"),
    (lambda a, g: expected_by_hand(a, g - 1), "γ + 1 terms"),
])
def test_spec_task_1_rejects_typical_mistakes_with_their_hint(wrong, hint):
    r = ex.check_expected_tokens(wrong)
    assert not r and hint in r.message, r.message


def optimal_by_hand(alpha, c, max_gamma):
    return max(range(max_gamma + 1), key=lambda g: expected_by_hand(alpha, g) / (g * c + 1))


def test_spec_task_2_accepts_the_best_gamma_and_rejects_the_largest():
    # α = 0.8, c = 0.05: γ = 8 gives 4.33 / 1.40 = 3.093; γ = 7 3.083, γ = 9 3.089
    assert optimal_by_hand(0.8, 0.05, 16) == 8
    assert ex.check_optimal_gamma(8) and ex.check_optimal_gamma(optimal_by_hand)
    r = ex.check_optimal_gamma(lambda a, c, m: m)
    assert not r and "peaks and falls" in r.message, r.message
    r = ex.check_optimal_gamma(lambda a, c, m: max(range(m + 1), key=lambda g: expected_by_hand(a, g) - g * c))
    assert not r and "ratio" in r.message, r.message


def inverse_cdf(weights, u):
    return int(np.searchsorted(np.cumsum(weights), u * weights.sum(), side="right"))


def accept_by_hand(p, q, x, u_accept, u_sample):
    if u_accept * q[x] < p[x]:
        return x
    return inverse_cdf(np.maximum(p - q, 0), u_sample)


def test_spec_task_3_accepts_the_rule_and_names_the_residual_slip():
    assert ex.check_accept_one(accept_by_hand)
    from_p = lambda p, q, x, ua, us: x if ua * q[x] < p[x] else inverse_cdf(p, us)
    r = ex.check_accept_one(from_p)
    assert not r and "residual" in r.message, r.message
    inverted = lambda p, q, x, ua, us: x if ua * p[x] < q[x] else inverse_cdf(np.maximum(p - q, 0), us)
    r = ex.check_accept_one(inverted)
    assert not r and "not the inverse" in r.message, r.message
    r = ex.check_accept_one(lambda p, q, x, ua, us: float(x))
    assert not r and "token id" in r.message
