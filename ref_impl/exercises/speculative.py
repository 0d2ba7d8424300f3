"""Exercises of chapter "Speculative decoding and multi-token prediction" (book/speculative/speculative-mtp):
Spec tasks 1 to 3.

E(α, γ), the tokens one verification emits; the number of drafts that maximizes the speedup; and
the accept-or-resample rule for one draft position; checked against `theory.speedup` and
`engine.speculative.accept`. Tests: `pytest tests/test_exercises_speculative.py -k spec_task`.

See chapter: speculative-decoding
"""

from __future__ import annotations

import numpy as np

from ref_impl.engine.speculative import accept
from ref_impl.exercises.core import Result, judge_cases, judge_exact, run_answer
from ref_impl.theory.speedup import expected_tokens, optimal_gamma, speedup

SPEC_RTOL = 1e-6   # E(α, γ) is a closed form: any float evaluation lands within 1e-6


def _expected_case(alpha: float, gamma: int):
    right = expected_tokens(alpha, gamma)
    mistakes = [
        (sum(alpha ** i for i in range(gamma)), "that counts the accepted drafts' prefix up to γ − 1: the sum runs "
                                              "1 + α + … + α^γ, γ + 1 terms (the target's own token is the 1)."),
        (alpha * gamma, "α·γ counts the drafts accepted if each were judged alone; a draft counts only when all "
                        "before it were accepted, and the target adds one token of its own."),
        (alpha * gamma + 1, "a draft counts only if every earlier draft was accepted: P(first i accepted) = α^i."),
        (right - 1, "add the token the target emits at the end of every verification (the correction or the bonus)."),
        (sum(alpha ** i for i in range(1, gamma + 1)), "that is the accepted drafts alone; add the target's own token."),
    ]
    return (alpha, gamma), f"α = {alpha:g}, γ = {gamma}", right, mistakes


def check_expected_tokens(answer, alpha: float = 0.7, gamma: int = 4) -> Result:
    """Spec task 1: E(α, γ), the mean tokens one verification emits when each of γ drafts is accepted
    independently with probability α (the accepted prefix plus one token of the target's).

    `answer` is a number for the given case, or a function `f(alpha, gamma)` called on five cases
    (α = 1 among them). Checked against `speedup.expected_tokens`.
    """
    cases = [_expected_case(alpha, gamma), _expected_case(0.6, 1), _expected_case(0.9, 8),
             _expected_case(0.0, 5), _expected_case(1.0, 3)]
    return judge_cases("Spec task 1", answer, cases, "tokens",
                       "E = 1 + α + α² + … + α^γ = (1 − α^(γ+1)) / (1 − α), and γ + 1 at α = 1.", rtol=SPEC_RTOL)


def _optimal_case(alpha: float, c: float, max_gamma: int = 16):
    right = optimal_gamma(alpha, c, max_gamma)
    grid = range(max_gamma + 1)
    mistakes = [
        (max_gamma, "more drafts always raise E(α, γ), but each costs c target steps: the speedup "
                    "E / (γ·c + 1) peaks and falls."),
        (max(grid, key=lambda g: float(expected_tokens(alpha, g)) - g * c),
         "maximize the ratio E / (γ·c + 1), not the difference."),
        (max(range(1, max_gamma + 1), key=lambda g: float(speedup(alpha, g, c)) / g),
         "maximize the speedup itself, E / (γ·c + 1), not the speedup per draft."),
        (max(grid, key=lambda g: float(expected_tokens(alpha, g)) / (g * c + 1 + c)),
         "a verification costs one target step for all γ + 1 positions: the cost is γ·c + 1."),
    ]
    return (alpha, c, max_gamma), f"α = {alpha:g}, c = {c:g}, γ ≤ {max_gamma}", right, mistakes


def check_optimal_gamma(answer, alpha: float = 0.8, c: float = 0.05) -> Result:
    """Spec task 2: the number of drafts γ (0..16) that maximizes the speedup E(α, γ) / (γ·c + 1) for a
    draft costing c target steps per token; 0 if no draft pays.

    `answer` is a whole number for the given case, or a function `f(alpha, c, max_gamma)` called on five
    cases. Checked exactly against `speedup.optimal_gamma`.
    """
    cases = [_optimal_case(alpha, c), _optimal_case(0.6, 0.1), _optimal_case(0.95, 0.02),
             _optimal_case(0.3, 0.5), _optimal_case(0.9, 0.0, 8)]
    return judge_exact("Spec task 2", answer, cases, "compute E(α, γ) / (γ·c + 1) for every γ from 0 to max_gamma "
                       "and take the best (γ = 0 is plain decoding, speedup 1).", int)


def _accept_case(seed: int, vocab: int = 8):
    rng = np.random.default_rng(seed)
    p, q = rng.dirichlet(np.ones(vocab) * 0.7), rng.dirichlet(np.ones(vocab) * 0.7)
    x = int(rng.choice(vocab, p=q))
    u_accept, u_sample = float(rng.random()), float(rng.random())
    n, token = accept(np.stack([p, p]), q[None], np.array([x]), np.array([u_accept, u_sample]))
    right = x if n == 1 else int(token)
    return (p, q, x, u_accept, u_sample), right


def _inverse_cdf(weights: np.ndarray, u: float) -> int:
    """The smallest index whose cumulative weight exceeds u × the total."""
    return int(np.searchsorted(np.cumsum(weights), u * weights.sum(), side="right"))


def _accept_variants(p, q, x, u_accept, u_sample) -> list[tuple[int, str]]:
    residual = np.maximum(p - q, 0)
    return [
        (x if u_accept < min(1.0, q[x] / p[x]) else _inverse_cdf(residual, u_sample),
         "accept with probability min(1, p(x)/q(x)): the target's over the draft's, not the inverse."),
        (x if u_accept < min(1.0, p[x] / q[x]) else _inverse_cdf(p, u_sample),
         "on a rejection, sample from the residual max(0, p − q), normalized, not from p: p would count the "
         "tokens the draft already proposes twice."),
        (x if u_accept < min(1.0, p[x] / q[x]) else _inverse_cdf(q, u_sample),
         "on a rejection, sample from the residual max(0, p − q), not from the draft's q."),
        (x if p[x] >= q[x] else _inverse_cdf(residual, u_sample),
         "accept with probability min(1, p(x)/q(x)), using u_accept: a draft with p(x) < q(x) is sometimes kept."),
    ]


def check_accept_one(fn) -> Result:
    """Spec task 3: `fn(p, q, x, u_accept, u_sample) -> token` for one draft position: keep the draft x
    (drawn from q) if u_accept < p(x)/q(x); otherwise return a token drawn from the residual
    max(0, p − q) normalized, by inverse CDF: the smallest token whose cumulative residual weight exceeds
    u_sample × the residual's total.

    Called on twelve seeded cases over an 8-token vocabulary; checked exactly against
    `speculative.accept` with one draft.
    """
    task = "Spec task 3"
    cases, got = [_accept_case(seed) for seed in range(12)], []
    for seed, (args, right) in enumerate(cases):
        p, q, x = args[:3]
        label = f"case {seed}: x = {x}, p(x) = {p[x]:.3f}, q(x) = {q[x]:.3f}"
        value, failed = run_answer(task, label, fn, p.copy(), q.copy(), *args[2:])
        if failed is not None:
            return failed
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            return Result(False, f"{task} ({label}): expected a token id (an int), got {value!r:.60}.")
        got.append((label, int(value), right))
    wrong = [(label, v, r) for label, v, r in got if v != r]
    if not wrong:
        return Result(True, f"{task}: right on all 12 cases.")
    # the slip that explains every answer names the mistake
    variants = [_accept_variants(*args) for args, _ in cases]
    hint = next((variants[0][k][1] for k in range(len(variants[0]))
                 if all(v[k][0] == g[1] for v, g in zip(variants, got))),
                "accept if u_accept × q(x) < p(x); else inverse-CDF sample max(0, p − q) with u_sample.")
    label, value, right = wrong[0]
    return Result(False, f"{task} ({label}): token {value}, expected {right}. Hint: {hint}")
