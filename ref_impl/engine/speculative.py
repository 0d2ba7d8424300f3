"""Speculative decoding: a small draft model proposes, the target model verifies.

Decode is bandwidth-bound: one target forward over γ+1 positions costs about as much as one
over a single position, because every weight is read once either way. So a cheap draft model
proposes γ tokens one at a time, the target scores all of them in one forward, and an
acceptance rule keeps a prefix of the proposals plus one token of the target's own. Each
target forward then yields between 1 and γ+1 tokens.

The rule (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding";
Chen et al. 2023, "Accelerating LLM Decoding with Speculative Sampling") keeps the target's
output distribution *exactly*: accept draft token x with probability min(1, p(x)/q(x)), where
p and q are the target's and the draft's sampling distributions at that position; at the first
rejection, draw from the residual max(0, p - q) normalized; if all γ are accepted, draw a bonus
token from the target's distribution after the last draft. With temperature 0 it reduces to
the greedy rule: accept while the draft equals the target's argmax (`accept_greedy`).

Rejected drafts are forgotten by trimming the KV caches (`kvcache.Cache.trim`), never by copying
them. Between steps both caches hold the same tokens: the prompt and every emitted token
except the last one, which the next step feeds first. A `Drafter` holds the draft side (model,
cache, and how a proposal is picked), so other proposers can be measured on the same loop.

See chapter: speculative-decoding
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from ref_impl.engine.generate import PREFILL_CHUNK, Sampler, check_room, decode_one_token, prefill
from ref_impl.engine.kvcache import Cache
from ref_impl.engine.model import Model


def _sample_inverse_cdf(weights: np.ndarray, u: np.ndarray) -> np.ndarray:
    """One index per row of non-negative weights (..., V), chosen by uniforms u (...) in [0, 1)."""
    cdf = np.cumsum(weights, axis=-1)
    idx = np.sum(cdf <= (u * cdf[..., -1])[..., None], axis=-1)
    last = weights.shape[-1] - 1 - np.argmax(weights[..., ::-1] > 0, axis=-1)   # last index with mass
    return np.minimum(idx, last)


def accept(p: np.ndarray, q: np.ndarray, drafts: np.ndarray, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The rejection-sampling rule: how many drafts to keep, and the token that follows them.

    Args:
        p: target probabilities (..., γ+1, V): after the last emitted token and after each draft.
        q: draft probabilities (..., γ, V), the distributions the drafts were drawn from.
        drafts: the proposed tokens (..., γ).
        u: uniforms in [0, 1), (..., γ+1): u[i] decides draft i, u[γ] draws the final token.

    Returns:
        (n, token), each (...): drafts[:n] are accepted and `token` comes next, drawn from the
        residual max(0, p - q) at position n, or from p[γ] (the bonus) when n == γ.
    Leading dimensions are independent trials, so the rule can be tested on many at once.
    """
    gamma = drafts.shape[-1]
    p_x = np.take_along_axis(p[..., :gamma, :], drafts[..., None], axis=-1)[..., 0]   # p(x_i)
    q_x = np.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]                   # q(x_i) > 0
    # accept x_i with probability min(1, p/q): u < p/q, written without dividing by q
    ok = u[..., :gamma] * q_x < p_x
    # n = the number of leading acceptances (the first False, with a False appended after γ)
    n = np.argmin(np.concatenate([ok, np.zeros(ok.shape[:-1] + (1,), dtype=bool)], axis=-1), axis=-1)
    # the residual at position n; a zero row of q after the drafts makes it p[γ] when n == γ
    q_pad = np.concatenate([q, np.zeros_like(q[..., :1, :])], axis=-2)
    p_n = np.take_along_axis(p, n[..., None, None], axis=-2)[..., 0, :]
    q_n = np.take_along_axis(q_pad, n[..., None, None], axis=-2)[..., 0, :]
    residual = np.maximum(p_n - q_n, 0.0)
    # a rejection has probability 0 when p == q, but rounding can still land there: fall back to p
    residual = np.where(residual.sum(axis=-1, keepdims=True) > 0, residual, p_n)
    return n, _sample_inverse_cdf(residual, u[..., gamma])


def accept_greedy(target_tokens: np.ndarray, drafts: np.ndarray) -> tuple[int, int]:
    """The greedy rule: keep drafts while they equal the target's argmax; then the target's token.

    target_tokens (γ+1,) are the target's argmax after the last emitted token and after each draft.
    """
    n = 0
    while n < len(drafts) and drafts[n] == target_tokens[n]:
        n += 1
    return n, int(target_tokens[n])


def rewind(cache: list[Cache], n: int) -> None:
    """Forget the last n positions of every layer's cache."""
    for layer_cache in cache:
        layer_cache.trim(n)


class Drafter:
    """The draft side of speculative decoding: a draft model, its own KV cache, and how it picks each
    proposal from its logits (`pick`: a draw from the sampler). Between steps its cache holds the
    same tokens as the target's. A subclass that changes only `pick` (a scripted or α-controlled
    proposer, as the speedup measurements use) keeps the draft model's real cost."""

    def __init__(self, model: Model, cache: list[Cache], sampler: Sampler):
        self.model, self.cache, self.sampler = model, cache, sampler

    def prefill(self, tokens: mx.array, chunk: int = PREFILL_CHUNK) -> mx.array:
        """Run the prompt (1, P) into the cache, `chunk` positions a pass; return the last logits (1, V),
        not evaluated."""
        return prefill(self.model, tokens, self.cache, chunk)

    def pick(self, logits: mx.array) -> tuple[mx.array, mx.array]:
        """The proposal (1,) after logits (1, V), and the distribution (1, V) it was drawn from."""
        return self.sampler(logits), self.sampler.probs(logits)

    def propose(self, y: mx.array, gamma: int) -> tuple[mx.array, mx.array]:
        """Propose γ tokens after y (1,): the tokens (γ,) and the distributions they came from (γ, V).

        Feeds y and the first γ-1 proposals, so the cache grows by γ. Nothing is evaluated here.
        """
        tokens, qs = [], []
        for _ in range(gamma):
            y, q = self.pick(decode_one_token(self.model, y, self.cache))   # (1,), (1, V)
            tokens.append(y)
            qs.append(q)
        return mx.concatenate(tokens), mx.concatenate(qs)

    def keep(self, drafts: mx.array, n: int) -> None:
        """After the target accepted n of the drafts (γ,): hold y and drafts[:n], as the target does."""
        gamma = drafts.shape[0]
        if n == gamma:
            decode_one_token(self.model, drafts[-1:], self.cache)   # the draft never fed its last proposal
        else:
            rewind(self.cache, gamma - n - 1)


@dataclass
class SpeculativeStep:
    """What one step emitted, and how many drafts it proposed and accepted (α = accepted / proposed)."""
    tokens: list[int]
    proposed: int
    accepted: int
    drafts: list[int] = field(default_factory=list)   # all γ proposals, the rejected ones included


def check_gamma(gamma: int, heads: int | None = None) -> None:
    """Refuse gamma < 1, or (MTP) more drafts than there are heads to propose them (ValueError)."""
    if gamma < 1:
        raise ValueError(f"gamma must be at least 1, got {gamma}")
    if heads is not None and gamma > heads:
        raise ValueError(f"gamma {gamma} needs as many MTP heads; the heads file has {heads}")


def speculative_step(target: Model, drafter: Drafter, target_cache: list[Cache], y: mx.array, gamma: int,
                     sampler: Sampler, rng: np.random.Generator) -> SpeculativeStep:
    """One draft-then-verify step after the last emitted token y (1,), which neither cache holds yet.

    Returns what it emitted (the accepted drafts, then one target token), the drafts proposed and
    the number accepted. Afterwards both caches hold y and the accepted drafts.
    """
    drafts, q = drafter.propose(y, gamma)
    logits = target(mx.concatenate([y, drafts])[None], target_cache)[0]     # (γ+1, V) in one forward
    proposed, n, token = verify(logits, drafts, q, sampler, rng)
    rewind(target_cache, gamma - n)             # keep y and the n accepted drafts
    drafter.keep(drafts, n)
    return SpeculativeStep(proposed[:n].tolist() + [token], gamma, n, proposed.tolist())


def verify(logits: mx.array, drafts: mx.array, q: mx.array, sampler: Sampler,
           rng: np.random.Generator) -> tuple[np.ndarray, int, int]:
    """The acceptance rule on the target's logits (γ+1, V) for drafts (γ,) drawn from q (γ, V):
    (the drafts as numpy, how many are accepted, the token that follows them). Greedy when the
    sampler's temperature is 0 (q unused), else `accept` on the sampler's distributions."""
    if sampler.temperature == 0:
        target_tokens = np.array(mx.argmax(logits, axis=-1))      # evaluates the drafts and the verification
        proposed = np.array(drafts)
        n, token = accept_greedy(target_tokens, proposed)
        return proposed, n, token
    p = sampler.probs(logits)
    mx.eval(p, q, drafts)
    proposed = np.array(drafts)
    n, token = accept(np.array(p).astype(np.float64), np.array(q).astype(np.float64), proposed,
                      rng.random(len(proposed) + 1))
    return proposed, int(n), int(token)


def take(steps: Iterator[SpeculativeStep], max_tokens: int) -> tuple[list[int], list[SpeculativeStep]]:
    """Draw steps until they have emitted max_tokens tokens: (the first max_tokens tokens, the steps)."""
    taken, tokens = [], []
    for step in steps:
        taken.append(step)
        tokens += step.tokens
        if len(tokens) >= max_tokens:
            break
    return tokens[:max_tokens], taken


def speculative_generate(target: Model, drafter: Drafter, prompt: list[int], sampler: Sampler,
                         target_cache: list[Cache], gamma: int = 4, rng: np.random.Generator | None = None,
                         chunk: int = PREFILL_CHUNK) -> Iterator[SpeculativeStep]:
    """Yield one SpeculativeStep per target forward, forever; the caller stops it.

    Args:
        target: the model whose output is kept.
        drafter: a draft model with the same tokenizer, its empty cache and its sampler.
        prompt: token ids (at least one).
        sampler: the target's sampling settings (the drafter's should be the same). Its seed also
            seeds the acceptance draws unless rng is given.
        target_cache: an empty cache. Each step may write γ+1 positions past the tokens emitted
            so far into either cache before trimming back.
        gamma: drafts proposed per step.
        chunk: prompt positions per prefill pass (generate.prefill_hidden).

    The first step is the prefill's token (proposed 0); both prompts are evaluated before it is
    yielded. The emitted tokens are distributed as plain decoding of `target` with `sampler`,
    and with temperature 0 they are exactly its tokens.
    """
    check_gamma(gamma)
    rng = rng if rng is not None else np.random.default_rng(sampler.seed)
    tokens = mx.array([prompt], dtype=mx.int32)
    y = sampler(prefill(target, tokens, target_cache, chunk))
    mx.eval(y, drafter.prefill(tokens, chunk))
    yield SpeculativeStep([y.item()], 0, 0)
    while True:
        step = speculative_step(target, drafter, target_cache, y, gamma, sampler, rng)
        yield step
        y = mx.array(step.tokens[-1:])


def speculative_decode(target: Model, draft: Model, prompt: list[int], max_tokens: int, gamma: int = 4,
                       sampler: Sampler | None = None) -> tuple[list[int], list[SpeculativeStep]]:
    """Generate max_tokens tokens after the prompt speculatively; return them and the steps."""
    context = min(target.args.max_position_embeddings, draft.args.max_position_embeddings)
    check_room(len(prompt), max_tokens, context, gamma, "gamma")  # the last step may write γ+1 positions, then trim
    size = len(prompt) + max_tokens + gamma
    sampler = sampler or Sampler()
    return take(speculative_generate(target, Drafter(draft, draft.make_cache(size), sampler), prompt, sampler,
                                     target.make_cache(size), gamma), max_tokens)


def acceptance_probability(p: np.ndarray, q: np.ndarray, matching: bool = False) -> float:
    """The chance one draft from q is accepted against target p (both (V,)): sum min(p, q) = 1 - TV(p, q)
    under the rejection-sampling rule; sum p q under exact matching (accept only when the draft equals
    the target's own sample, as mlx-lm does), which also keeps the target's distribution (every emitted
    token is the target's sample) but accepts less often."""
    return float(np.sum(p * q) if matching else np.sum(np.minimum(p, q)))


def first_tokens(p: np.ndarray, q: np.ndarray, n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """n independent one-draft steps against fixed distributions p (target) and q (draft), both (V,):
    the token each step emits first (the accepted draft, or the residual's draw) and whether the draft
    was accepted. Distributed as p if the rule is exact: `chi2_pvalue(tokens, p)` tests it."""
    rng = np.random.default_rng(seed)
    drafts = _sample_inverse_cdf(np.broadcast_to(q, (n, q.size)), rng.random(n))[:, None]
    k, token = accept(np.broadcast_to(p, (n, 2, p.size)), np.broadcast_to(q, (n, 1, q.size)), drafts,
                      rng.random((n, 2)))
    return np.where(k == 1, drafts[:, 0], token), k == 1


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-square(df), in closed form (the Poisson sum; erfc for odd df): the
    p-value of a goodness-of-fit statistic, without scipy."""
    h = x / 2
    if df % 2 == 0:
        return sum(math.exp(-h + i * math.log(h) - math.lgamma(i + 1)) for i in range(df // 2)) if h > 0 else 1.0
    if h == 0:
        return 1.0
    tail = sum(math.exp(-h + (i - 0.5) * math.log(h) - math.lgamma(i + 0.5)) for i in range(1, df // 2 + 1))
    return math.erfc(math.sqrt(h)) + tail


def chi2_pvalue(samples: np.ndarray, probs: np.ndarray) -> float:
    """p-value of the hypothesis that samples (token ids) were drawn from probs (V,): Pearson's
    chi-square over the tokens with probability > 0, those expected fewer than 5 times pooled into
    one bin (the approximation's usual condition); 0 if any sample falls where probs is 0."""
    counts = np.bincount(np.asarray(samples).ravel(), minlength=probs.size)
    if counts[probs == 0].any():
        return 0.0
    observed, expected = counts[probs > 0], counts.sum() * probs[probs > 0] / probs.sum()
    if len(expected) == 1:
        return 1.0                                    # one possible token, and every sample is it
    rare = expected < 5
    if rare.any():
        observed = np.append(observed[~rare], observed[rare].sum())
        expected = np.append(expected[~rare], expected[rare].sum())
        if expected[-1] < 5 and len(expected) > 2:    # the pooled bin itself is rare: join the next smallest
            k = int(np.argmin(expected[:-1]))
            observed[k] += observed[-1]
            expected[k] += expected[-1]
            observed, expected = observed[:-1], expected[:-1]
    if len(expected) < 2 or expected.min() < 5:
        raise ValueError(f"too few samples for the chi-square approximation ({counts.sum()} over "
                         f"{int((probs > 0).sum())} tokens)")
    stat = float(((observed - expected) ** 2 / expected).sum())
    return chi2_sf(stat, len(expected) - 1)


def acceptance_rate(steps: list[SpeculativeStep]) -> float:
    """The fraction of proposed drafts that were accepted. For γ > 1 it is below the per-draft
    acceptance α of the speedup model: drafts after a rejection count as proposed, never judged
    (`measure.spec.acceptance_by_position` counts only the judged ones)."""
    proposed = sum(s.proposed for s in steps)
    return sum(s.accepted for s in steps) / proposed if proposed else float("nan")
