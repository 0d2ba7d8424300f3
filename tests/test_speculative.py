"""Speculative decoding: the acceptance rule keeps the target's distribution, greedy speculative
decoding emits the greedy tokens, and rejected drafts leave both KV caches as plain decoding would."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from ref_impl.engine import speculative
from ref_impl.engine.checkpoint import load
from ref_impl.engine.generate import Sampler, decode_one_token, generate_step, prefill
from ref_impl.engine.speculative import (
    Drafter,
    accept,
    accept_greedy,
    acceptance_rate,
    chi2_pvalue,
    chi2_sf,
    speculative_decode,
    speculative_generate,
)

SIGNIFICANCE = 1e-3     # each chi-square test rejects a correct rule with this probability
N_TRIALS = 200_000


def test_chi2_sf_matches_known_quantiles():
    # the 0.05 and 0.001 critical values of chi-square tables
    for x, df, p in [(3.841, 1, 0.05), (5.991, 2, 0.05), (7.815, 3, 0.05), (16.919, 9, 0.05),
                     (10.828, 1, 0.001), (31.264, 11, 0.001), (51.179, 24, 0.001)]:
        assert chi2_sf(x, df) == pytest.approx(p, rel=2e-3)


def test_chi2_pvalue_rejects_impossible_tokens_and_too_few_samples():
    probs = np.array([0.5, 0.5, 0.0])
    assert chi2_pvalue(np.array([0, 1] * 20 + [2]), probs) == 0.0
    with pytest.raises(ValueError, match="too few samples"):
        chi2_pvalue(np.array([0, 1, 1]), probs)


# --- the acceptance rule on known distributions ----------------------------------------------

def sample(probs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One draw per row of probs (N, V)."""
    return (probs.cumsum(axis=-1) <= rng.random(len(probs))[:, None] * probs.sum(-1, keepdims=True)).sum(-1)


def simulate(rule, P: np.ndarray, Q: np.ndarray, gamma: int, n_tokens: int, n_trials: int, seed: int = 0):
    """Run speculative decoding on N trials at once with Markov-chain 'models': the target's next
    token after token a is drawn from P[a], the draft's from Q[a], and every run starts after
    token 0. Returns the first n_tokens emitted tokens of each run, (N, n_tokens)."""
    rng = np.random.default_rng(seed)
    out = np.full((n_trials, n_tokens), -1)
    count = np.zeros(n_trials, dtype=int)
    rows = np.arange(n_trials)
    last = np.zeros(n_trials, dtype=int)
    while (count < n_tokens).any():
        drafts, prev = [], last
        for _ in range(gamma):
            prev = sample(Q[prev], rng)
            drafts.append(prev)
        drafts = np.stack(drafts, axis=1)                              # (N, γ)
        fed = np.concatenate([last[:, None], drafts], axis=1)           # (N, γ+1)
        n, t = rule(P[fed], Q[fed[:, :-1]], drafts, rng.random((n_trials, gamma + 1)))
        for j in range(gamma + 1):                                      # emit drafts[:n], then t
            emit = (j <= n) & (count < n_tokens)
            token = np.where(j < n, drafts[:, min(j, gamma - 1)], t)
            out[rows[emit], count[emit]] = token[emit]
            count += emit
        last = t
    return out


def accept_resampling_from_p(p, q, drafts, u):
    """Broken: after a rejection, draws from p instead of the residual max(0, p - q)."""
    n, _ = accept(p, q, drafts, u)
    p_n = np.take_along_axis(p, n[..., None, None], axis=-2)[..., 0, :]
    return n, (p_n.cumsum(-1) <= (u[..., -1] * p_n.sum(-1))[..., None]).sum(-1)


def accept_with_p_not_p_over_q(p, q, drafts, u):
    """Broken: accepts a draft with probability p(x) (forgetting q), resampling from p otherwise."""
    return accept(p, np.ones_like(q), drafts, u)   # u * 1 < p(x); the residual max(0, p - 1) is empty


V = 6
FIRST_ROWS = {   # (p, q) after token 0
    "overlapping": ([.3, .2, .15, .15, .1, .1], [.1, .1, .2, .2, .2, .2]),
    "draft_mass_where_target_has_none": ([.5, .3, .2, 0, 0, 0], [.2, .05, .15, .3, .1, .2]),
    "target_mass_where_draft_has_none": ([.1, .1, .1, .2, .2, .3], [.6, .4, 0, 0, 0, 0]),
    "draft_one_hot": ([.1, .1, .1, .2, .2, .3], [0, 0, 0, 1, 0, 0]),
    "equal": ([.3, .2, .15, .15, .1, .1], [.3, .2, .15, .15, .1, .1]),
}


def markov_pair(first: str | None, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Target and draft transition tables (V, V); row 0 from FIRST_ROWS, the rest random, with
    zeros in the target where the draft has mass and the other way round."""
    rng = np.random.default_rng(seed)
    P, Q = rng.dirichlet(np.ones(V), V), rng.dirichlet(np.ones(V), V)
    P[:, 5] = 0                    # the target never emits 5, the draft often proposes it
    Q[:, 5] += 0.3
    Q[:, 4] = 0                    # the draft never proposes 4
    if first is not None:
        P[0], Q[0] = FIRST_ROWS[first]
    return P / P.sum(1, keepdims=True), Q / Q.sum(1, keepdims=True)


@pytest.mark.parametrize("gamma", [1, 3])
@pytest.mark.parametrize("case", list(FIRST_ROWS))
def test_task_1_first_token_is_distributed_as_the_target(case, gamma):
    P, Q = markov_pair(case)
    first = simulate(accept, P, Q, gamma, 1, N_TRIALS)[:, 0]
    p_value = chi2_pvalue(first, P[0])
    print(f"{case} gamma={gamma}: p = {p_value:.3g}")
    assert p_value > SIGNIFICANCE


@pytest.mark.parametrize("broken", [accept_resampling_from_p, accept_with_p_not_p_over_q])
@pytest.mark.parametrize("case", ["overlapping", "draft_mass_where_target_has_none"])
def test_task_1_a_broken_rule_fails_the_same_test(case, broken):
    P, Q = markov_pair(case)
    first = simulate(broken, P, Q, 1, 1, N_TRIALS)[:, 0]
    p_value = chi2_pvalue(first, P[0])
    print(f"{broken.__name__} on {case}: p = {p_value:.3g}")
    assert p_value < SIGNIFICANCE


@pytest.mark.parametrize("rule, gamma, correct", [(accept, 2, True), (accept, 3, True),
                                                  (accept_resampling_from_p, 2, False)])
def test_task_1_first_two_tokens_are_jointly_distributed_as_the_target(rule, gamma, correct):
    """Across positions: the pair (x0, x1), whether x1 was an accepted draft, a residual draw, the
    bonus token or the next step's token, has the target's law P[0, x0] * P[x0, x1]."""
    P, Q = markov_pair(None, seed=2)
    pairs = simulate(rule, P, Q, gamma, 2, N_TRIALS, seed=3)
    joint = P[0][:, None] * P                                            # (x0, x1)
    p_value = chi2_pvalue(pairs[:, 0] * V + pairs[:, 1], joint.ravel())
    print(f"{rule.__name__} gamma={gamma} joint: p = {p_value:.3g}")
    assert (p_value > SIGNIFICANCE) == correct


def test_task_1_accept_bonus_and_edge_cases():
    p = np.array([[.5, .5, 0], [0, 1, 0], [0, 0, 1]])
    q = np.array([[.5, .5, 0], [0, 1, 0]])
    n, t = accept(p, q, np.array([1, 1]), np.array([.99, .99, .5]))
    assert (n, t) == (2, 2)                                   # all accepted: the bonus from p[γ]
    n, t = accept(p, np.array([[0, 0, 1], [0, 1, 0]]), np.array([2, 1]), np.array([0, 0, .7]))
    assert (n, t) == (0, 1)                                   # p(2) = 0: rejected, residual is p[0]


def test_task_1_greedy_rule_is_the_rule_on_one_hot_distributions():
    rng = np.random.default_rng(0)
    for _ in range(200):
        gamma = rng.integers(1, 6)
        target, drafts = rng.integers(0, 3, gamma + 1), rng.integers(0, 3, gamma)
        n, t = accept(np.eye(3)[target], np.eye(3)[drafts], drafts, rng.random(gamma + 1))
        assert (int(n), int(t)) == accept_greedy(target, drafts)


# --- the sampling distribution --------------------------------------------------------------

@pytest.mark.parametrize("settings", [{"temperature": 0.0}, {"temperature": 1.0}, {"temperature": 0.7},
                                      {"temperature": 1.2, "top_k": 3}, {"temperature": 0.9, "top_p": 0.8},
                                      {"temperature": 1.0, "top_k": 4, "top_p": 0.7}])
def test_task_2_sampling_probs_is_what_the_sampler_draws_from(settings):
    logits = np.array([[2.0, 1.5, 1.5, 0.3, -1.0, 0.9, 0.0, -0.5]], dtype=np.float32)  # a tie at 1, 2
    probs = np.array(Sampler(**settings).probs(mx.array(logits)))[0].astype(np.float64)
    assert probs.sum() == pytest.approx(1.0, abs=1e-6)
    draws = np.array(Sampler(**settings, seed=11)(mx.array(np.repeat(logits, 100_000, axis=0))))
    p_value = chi2_pvalue(draws, probs / probs.sum())
    assert p_value > SIGNIFICANCE


# --- the shipped pair ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def pair():
    from ref_impl import MODELS_DIR
    paths = [MODELS_DIR / "stdlib-10m.gguf", MODELS_DIR / "stdlib-draft-1m.gguf"]
    if not all(p.is_file() for p in paths):
        pytest.skip("the shipped target/draft pair is missing")
    (target, tok), (draft, _) = (load(p, mx.float32) for p in paths)
    return target, draft, tok


def greedy_tokens(model, prompt, n):
    return [t for _, t in zip(range(n), generate_step(model, prompt, Sampler(), model.make_cache(len(prompt) + n)))]


@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_task_3_greedy_speculative_emits_exactly_the_greedy_tokens(pair, gamma):
    target, draft, tok = pair
    prompt = tok.encode("import os\n\ndef main(", bos=True)
    tokens, steps = speculative_decode(target, draft, prompt, 64, gamma)
    assert tokens == greedy_tokens(target, prompt, 64)
    assert 0 < acceptance_rate(steps) < 1
    assert len(steps) < 64                      # fewer target forwards than tokens


class ScriptedDrafter(Drafter):
    """The shipped draft (its cache fills for real), but proposing the target's greedy token at every
    position except `wrong`, where it proposes another one: rejections land where the test says."""

    def __init__(self, draft, cache, sequence, wrong, vocab):
        super().__init__(draft, cache, Sampler())
        self.sequence, self.wrong, self.vocab = sequence, wrong, vocab

    def pick(self, logits):
        pos = self.cache[0].offset              # the position of the token being predicted
        want = self.sequence[pos] if pos not in self.wrong else (self.sequence[pos] + 1) % self.vocab
        return mx.array([want]), mx.array(np.eye(self.vocab, dtype=np.float32)[want][None])


def plain_cache(model, tokens):
    """The cache of plain decoding over tokens: prefill the first, then one token at a time."""
    cache = model.make_cache(len(tokens) + 1)
    prefill(model, mx.array([tokens[:1]]), cache)
    for t in tokens[1:]:
        decode_one_token(model, mx.array([t]), cache)
    return cache


def assert_same_cache(cache, reference):
    for layer, ref in zip(cache, reference):
        assert layer.offset == ref.offset
        for a, b in zip(layer.state, ref.state):
            np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-4)


def test_task_4_rejections_roll_both_caches_back_to_plain_decoding(pair):
    target, draft, tok = pair
    prompt = tok.encode("class Foo:\n    def ", bos=True)
    gamma, n_new = 3, 24
    sequence = prompt + greedy_tokens(target, prompt, n_new + gamma + 1)
    P = len(prompt)
    # after the prefill's token (at P) each step proposes 3: wrong first draft, wrong third, none wrong, ...
    wrong = {P + 1, P + 4, P + 6, P + 14, P + 15, P + 16}
    size = P + n_new + gamma + 1
    target_cache, draft_cache = target.make_cache(size), draft.make_cache(size)
    scripted = ScriptedDrafter(draft, draft_cache, sequence, wrong, target.args.vocab_size)
    emitted, accepted = [], []
    for step in speculative_generate(target, scripted, prompt, Sampler(), target_cache, gamma):
        emitted += step.tokens
        accepted.append(step.accepted)
        # both caches hold the prompt and every emitted token but the last
        held = prompt + emitted[:-1]
        assert target_cache[0].offset == draft_cache[0].offset == len(held)
        assert_same_cache(target_cache, plain_cache(target, held))
        assert_same_cache(draft_cache, plain_cache(draft, held))
        if len(emitted) >= n_new:
            break
    assert emitted == sequence[P:P + len(emitted)]
    assert {0, gamma}.issubset(accepted[1:]) and set(accepted[1:]) - {0, gamma}   # none, some and all


# --- sampled speculative decoding ------------------------------------------------------------

def test_task_5_sampled_speculative_decoding_is_seeded_and_reports_acceptance(pair):
    target, draft, tok = pair
    prompt = tok.encode("def read_config(path):\n", bos=True)
    runs = [speculative_decode(target, draft, prompt, 48, 4, Sampler(temperature=0.8, top_p=0.95, seed=s))
            for s in (7, 7, 8)]
    assert runs[0][0] == runs[1][0] and runs[0][0] != runs[2][0]
    alpha = acceptance_rate(runs[0][1])
    print(f"sampled alpha (gamma=4, T=0.8, top_p=0.95): {alpha:.3f}")
    assert 0 < alpha < 1
    assert sum(len(s.tokens) for s in runs[0][1]) >= 48


def test_task_5_a_draft_equal_to_the_target_is_almost_always_accepted(pair):
    """p and q then differ only by rounding (a γ+1-position forward vs one-position ones): α ≈ 1."""
    target, _, tok = pair
    prompt = tok.encode("import sys\n", bos=True)
    tokens, steps = speculative_decode(target, target, prompt, 24, 3, Sampler(temperature=1.0, seed=0))
    assert acceptance_rate(steps) > 0.9


def test_first_tokens_follow_the_target_and_accept_at_sum_min():
    rng = np.random.default_rng(3)
    p, q = rng.dirichlet(np.ones(24) * 0.5), rng.dirichlet(np.ones(24) * 0.5)
    tokens, accepted = speculative.first_tokens(p, q, N_TRIALS, seed=1)
    assert speculative.chi2_pvalue(tokens, p) > SIGNIFICANCE
    assert speculative.chi2_pvalue(tokens, q) < SIGNIFICANCE               # the test can tell p from q
    alpha = float(np.minimum(p, q).sum())                                    # 1 - TV(p, q), by hand
    assert speculative.acceptance_probability(p, q) == pytest.approx(alpha)
    assert abs(accepted.mean() - alpha) < 5 * math.sqrt(alpha * (1 - alpha) / N_TRIALS)
    assert speculative.acceptance_probability(p, q, matching=True) == pytest.approx(float(p @ q))
    assert float(p @ q) <= alpha
