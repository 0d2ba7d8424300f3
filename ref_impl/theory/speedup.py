"""What speculative decoding buys, in theory: the speedup model E(α, γ) and what follows from it.

The model (Leviathan, Kalman and Matias 2023, "Fast Inference from Transformers via Speculative
Decoding", section 3): if each of γ drafts is accepted independently with probability α, one
verification emits E(α, γ) = (1 - α^(γ+1)) / (1 - α) tokens on average (the accepted prefix plus
the target's own token; their eq. 1). A draft token costs c target steps and, in the paper's
model, verifying γ+1 positions costs one target step, so the walltime speedup is
E / (γ·c + 1) (their Theorem 3.8). Decode being bandwidth-bound is what makes the "+1" plausible;
`speedup` also takes the measured ratio t(γ+1)/t(1) of a target forward over γ+1 positions to
one over a single position, since that is a claim to check (C24), not a given.

The measurements that test it are in measure/spec.py.

See chapter: speculative-decoding
"""

from __future__ import annotations

import numpy as np

Scalars = float | np.ndarray      # the model's functions take and give floats, or arrays that broadcast


def _checked(alpha: Scalars, gamma: Scalars, c: Scalars = 0.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    a, g, c = np.asarray(alpha, dtype=float), np.asarray(gamma), np.asarray(c, dtype=float)
    if np.any(~((a >= 0) & (a <= 1))):
        raise ValueError(f"alpha is an acceptance probability, in [0, 1]; got {alpha}")
    if g.dtype.kind not in "iu" and not np.all(np.mod(g, 1) == 0) or np.any(g < 0):
        raise ValueError(f"gamma counts drafts per verification, an integer >= 0; got {gamma}")
    if np.any(~(c >= 0)):
        raise ValueError(f"c is a cost ratio (draft token / target token), >= 0; got {c}")
    return a, g.astype(float), c


def _scalar_or_array(x: np.ndarray) -> Scalars:
    return float(x) if np.ndim(x) == 0 else x


def expected_tokens(alpha: Scalars, gamma: Scalars) -> Scalars:
    """E(α, γ) = (1 - α^(γ+1)) / (1 - α) = 1 + α + ... + α^γ: the mean tokens one verification emits
    when each of γ drafts is accepted independently with probability α (γ + 1 at α = 1, 1 at
    α = 0 or γ = 0). Leviathan et al. 2023, eq. 1. Broadcasts over arrays."""
    a, g, _ = _checked(alpha, gamma)
    with np.errstate(divide="ignore", invalid="ignore"):
        # 1 - α^(γ+1) as -expm1((γ+1) log α): no cancellation as α -> 1
        e = -np.expm1((g + 1) * np.log(a)) / (1 - a)
    return _scalar_or_array(np.where(a == 1, g + 1, e))


def speedup(alpha: Scalars, gamma: Scalars, c: Scalars, verify_ratio: Scalars = 1.0) -> Scalars:
    """Walltime speedup of speculative over plain decoding: E(α, γ) / (γ·c + verify_ratio), where c is
    a draft token's cost in target steps and verify_ratio = t(γ+1)/t(1), the cost of the target's
    forward over γ+1 positions in single-position steps (1 in Leviathan et al. 2023, Theorem 3.8:
    a bandwidth-bound target reads its weights once either way). γ = 0 is plain decoding: 1."""
    a, g, c = _checked(alpha, gamma, c)
    r = np.asarray(verify_ratio, dtype=float)
    if np.any(~(r > 0)):
        raise ValueError(f"verify_ratio is a time ratio t(γ+1)/t(1), > 0; got {verify_ratio}")
    return _scalar_or_array(np.asarray(expected_tokens(a, g)) / (g * c + np.where(g == 0, 1.0, r)))


def optimal_gamma(alpha: float, c: float, max_gamma: int = 64) -> int:
    """The γ in 0..max_gamma with the highest model speedup (verification costing one step); 0 when no
    draft pays. E(α, γ) is concave in γ and γ·c + 1 affine, so the speedup rises to one peak and
    falls: walk up while it improves."""
    _checked(alpha, max_gamma, c)
    g = 0
    while g < max_gamma and speedup(alpha, g + 1, c) > speedup(alpha, g, c):
        g += 1
    return g


def break_even_alpha(gamma: int, c: float, verify_ratio: float = 1.0) -> float | None:
    """The smallest α at which γ drafts per verification beat plain decoding (speedup >= 1): 0.0 if
    they pay even when every draft is rejected, None if not even α = 1 pays. Bisection on α: E rises
    from 1 to γ+1 as α goes from 0 to 1."""
    if gamma < 1:
        raise ValueError(f"gamma must be at least 1 to have a break-even acceptance, got {gamma}")
    if speedup(0.0, gamma, c, verify_ratio) >= 1:
        return 0.0
    if speedup(1.0, gamma, c, verify_ratio) < 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if speedup(mid, gamma, c, verify_ratio) >= 1 else (mid, hi)
    return hi
