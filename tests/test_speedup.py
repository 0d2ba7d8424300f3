"""The speedup model against hand-computed values and brute force, the α-by-construction drafter
against its α, and `bench --spec`'s records."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from ref_impl import MODELS_DIR
from ref_impl.engine.generate import Sampler, generate_step
from ref_impl.engine.model import ModelArgs
from ref_impl.engine.random import random_model
from ref_impl.engine.speculative import SpeculativeStep, speculative_generate
from ref_impl.measure.spec import AlphaDrafter, SpecPlan, acceptance_by_position, bench_spec
from ref_impl.theory.speedup import break_even_alpha, expected_tokens, optimal_gamma, speedup

# --- the model ---------------------------------------------------------------------------------


def test_expected_tokens_by_hand_and_at_the_limits():
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens(0.8, 4) == pytest.approx(1 + 0.8 + 0.64 + 0.512 + 0.4096)
    assert expected_tokens(1.0, 5) == 6                        # every draft accepted: γ + 1
    assert expected_tokens(0.0, 5) == 1                        # none: the target's own token only
    assert expected_tokens(0.7, 0) == 1                        # no drafts: plain decoding
    assert expected_tokens(1 - 1e-12, 5) == pytest.approx(6, rel=1e-9)   # continuous at α = 1
    assert expected_tokens(0.9, 10_000) == pytest.approx(1 / (1 - 0.9))  # γ -> ∞: 1 / (1 - α)
    grid = expected_tokens(np.array([[0.0], [0.5], [1.0]]), np.array([0, 1, 3]))
    np.testing.assert_allclose(grid, [[1, 1, 1], [1, 1.5, 1.875], [1, 2, 4]])


def test_speedup_by_hand():
    assert speedup(0.8, 4, 0.1) == pytest.approx(3.3616 / 1.4)
    assert speedup(0.8, 4, 0.1, verify_ratio=1.5) == pytest.approx(3.3616 / 1.9)
    assert speedup(0.6, 0, 0.3) == 1                           # γ = 0 is plain decoding
    assert speedup(0.0, 3, 0.0) == 1                           # free drafts that never land: no gain, no loss
    assert speedup(1.0, 3, 0.0) == 4
    assert speedup(0.0, 2, 0.5) == pytest.approx(0.5)          # two wasted drafts at half a step each


def test_optimal_gamma_is_the_brute_force_argmax():
    rng = np.random.default_rng(0)
    for alpha, c in [*zip(rng.random(300), rng.random(300) * 0.6), (0.0, 0.1), (1.0, 0.0), (1.0, 0.5),
                     (0.95, 0.01), (0.3, 0.0), (0.6, 1.0)]:
        g = optimal_gamma(alpha, c, max_gamma=40)
        brute = [speedup(alpha, k, c) for k in range(41)]
        assert speedup(alpha, g, c) == pytest.approx(max(brute), rel=1e-12), (alpha, c, g, int(np.argmax(brute)))
    assert optimal_gamma(0.0, 0.1) == 0                        # nothing pays: plain decoding
    assert optimal_gamma(1.0, 0.0, max_gamma=12) == 12         # everything pays: as many as allowed


def test_break_even_alpha():
    for gamma, c, r in [(1, 0.1, 1.0), (4, 0.05, 1.0), (4, 0.2, 1.3), (8, 0.1, 2.0)]:
        a = break_even_alpha(gamma, c, r)
        assert speedup(a, gamma, c, r) == pytest.approx(1, abs=1e-9)
        assert speedup(a - 0.01, gamma, c, r) < 1 < speedup(a + 0.01, gamma, c, r)
    # γ = 1, c = 0.1: 1 + α = 1.1 -> α = 0.1, by hand
    assert break_even_alpha(1, 0.1) == pytest.approx(0.1)
    assert break_even_alpha(3, 0.0) == 0.0                     # free drafts, free verification: always pays
    assert break_even_alpha(2, 1.6) is None                    # 1 + 2 * 1.6 > 3 tokens at best: never pays


@pytest.mark.parametrize("call, word", [(lambda: expected_tokens(1.2, 3), "alpha"),
                                        (lambda: expected_tokens(0.5, -1), "gamma"),
                                        (lambda: expected_tokens(0.5, 1.5), "gamma"),
                                        (lambda: speedup(0.5, 2, -0.1), "c"),
                                        (lambda: speedup(0.5, 2, 0.1, 0), "verify_ratio"),
                                        (lambda: optimal_gamma(float("nan"), 0.1), "alpha"),
                                        (lambda: break_even_alpha(0, 0.1), "gamma")])
def test_bad_input_is_refused_by_name(call, word):
    with pytest.raises(ValueError, match=word):
        call()


# --- acceptance, counted ---------------------------------------------------------------------------

def test_acceptance_counts_only_judged_drafts():
    steps = [SpeculativeStep([7], 0, 0),                       # the prefill's token: not a verification
             SpeculativeStep([1, 2], 3, 1), SpeculativeStep([1, 2, 3, 4], 3, 3), SpeculativeStep([5], 3, 0)]
    acc = acceptance_by_position(steps)
    # position 1 judged in all three steps (accepted twice); position 2 in the first two (accepted once);
    # position 3 only in the step that accepted everything
    assert (acc.judged, acc.accepted) == ([3, 2, 1], [2, 1, 1])
    assert acc.per_position == pytest.approx([2 / 3, 1 / 2, 1])
    assert acc.alpha == pytest.approx(4 / 6)
    assert (acc.steps, acc.tokens_per_step) == (3, pytest.approx(7 / 3))


# --- the α-by-construction drafter -------------------------------------------------------------------

TARGET = ModelArgs(vocab_size=96, hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
DRAFT = ModelArgs(vocab_size=96, hidden_size=32, num_hidden_layers=1, intermediate_size=64,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def random_pair():
    target, draft = random_model(TARGET, mx.float32, seed=1), random_model(DRAFT, mx.float32, seed=2)
    prompt = np.random.default_rng(0).integers(1, TARGET.vocab_size, 12).tolist()
    n = 600
    greedy = [t for _, t in zip(range(n + 10), generate_step(target, prompt, Sampler(), target.make_cache(n + 40)))]
    return target, draft, prompt, greedy


def run_alpha(random_pair, alpha, gamma, n, seed=0):
    target, draft, prompt, greedy = random_pair
    drafter = AlphaDrafter(draft, draft.make_cache(len(prompt) + n + gamma + 2), prompt + greedy, alpha, seed)
    tokens, steps = [], []
    for step in speculative_generate(target, drafter, prompt, Sampler(), target.make_cache(len(prompt) + n + gamma + 2),
                                     gamma):
        steps.append(step)
        tokens += step.tokens
        if len(tokens) >= n:
            break
    return tokens[:n], steps


def test_alpha_drafter_is_accepted_with_probability_alpha_and_keeps_the_greedy_tokens(random_pair):
    alpha, gamma = 0.7, 4
    tokens, steps = run_alpha(random_pair, alpha, gamma, 600)
    assert tokens == random_pair[3][:600]                      # the verify loop stays exact with any drafter
    acc = acceptance_by_position(steps)
    n = sum(acc.judged)
    # binomial: the pooled acceptance of n independent Bernoulli(α) judgements, within 4 standard deviations
    assert abs(acc.alpha - alpha) < 4 * math.sqrt(alpha * (1 - alpha) / n), (acc.alpha, n)
    assert all(abs(a - alpha) < 4 * math.sqrt(alpha * (1 - alpha) / j) for a, j in zip(acc.per_position, acc.judged))
    assert acc.tokens_per_step == pytest.approx(expected_tokens(alpha, gamma), rel=0.15)


def test_alpha_drafter_at_the_extremes(random_pair):
    tokens, steps = run_alpha(random_pair, 1.0, 3, 40)
    assert tokens == random_pair[3][:40] and all(s.accepted == 3 for s in steps[1:])
    tokens, steps = run_alpha(random_pair, 0.0, 3, 40)
    assert tokens == random_pair[3][:40] and all(s.accepted == 0 for s in steps[1:])
    with pytest.raises(ValueError, match="alpha"):
        AlphaDrafter(random_pair[1], [], [], 1.5)


# --- bench --spec -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def spec_records(tmp_path_factory):
    paths = [MODELS_DIR / "stdlib-10m.gguf", MODELS_DIR / "stdlib-draft-1m.gguf"]
    if not all(p.is_file() for p in paths):
        pytest.skip("the shipped target/draft pair is missing")
    heads = None
    try:
        from ref_impl.engine import mtp
    except ImportError:
        pass
    else:   # zero heads (each repeats the model's next-token guess): the MTP path runs, whatever was trained
        heads = tmp_path_factory.mktemp("mtp") / "zero-mtp.gguf"
        mtp.save_heads(mtp.MTPHeads(384, 2, "stdlib-10m"), heads)
    plan = SpecPlan.for_device(gpu=False, quick=True)
    return plan, heads, bench_spec(*paths, heads, plan)


def test_bench_spec_records_have_the_one_shape(spec_records):
    plan, heads, records = spec_records
    keys = {"experiment", "model", "weights", "kv", "context", "variant", "metric", "unit", "value", "samples", "peer"}
    assert all(keys <= set(r) for r in records)
    assert {r["experiment"] for r in records} == {"spec-alpha", "spec-forward", "spec-attention", "spec-speed"}
    variants = {"draft-model", "alpha-set"} | ({"mtp"} if heads else set())
    for variant in variants:
        speed = [r for r in records if r["experiment"] == "spec-speed" and r["variant"] == variant]
        assert sorted({r["gamma"] for r in speed}) == [g for g in plan.gammas if variant != "mtp" or g <= 2]
        assert all(r["value"] == 1.0 for r in speed if r["metric"] == "greedy_agreement")   # greedy: exact
        assert all(r["value"] > 0 and math.isfinite(r["value"]) for r in speed
                   if r["metric"] in ("tokens_per_s", "speedup", "cost_ratio", "speedup_model"))
    for r in records:
        if r["experiment"] == "spec-alpha" and r["metric"] == "tokens_per_step":
            assert 1 <= r["value"] <= r["gamma"] + 1
        if r["metric"] in ("alpha", "alpha_position"):
            assert 0 <= r["value"] <= 1
        if r["metric"] == "alpha_position":
            assert 1 <= r["position"] <= r["gamma"]
    forward = {(r["model"], r["positions"]) for r in records if r["metric"] == "forward_ms"}
    assert forward == {(m, L) for m in ("stdlib-10m", "tiny", "tiny-draft") for L in range(1, max(plan.gammas) + 2)}


def test_bench_spec_times_attention_at_new_key_lengths_by_both_routes(spec_records):
    plan, _, records = spec_records
    attention = [r for r in records if r["experiment"] == "spec-attention"]
    got = {(r["route"], r["positions"], r["metric"]) for r in attention}
    widths = sorted({1, max(plan.gammas)})
    assert got == {(route, g + 1, m) for route in ("sdpa", "ops") for g in widths for m in ("first_ms", "again_ms")}
    assert all(r["value"] > 0 and len(r["samples"]) == 8 and r["model"] == "stdlib-10m" for r in attention)
