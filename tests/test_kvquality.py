"""KV-cache quality: key capture and magnitudes, rounding error, cached perplexity, memory table, needle
retrieval, decode speed against context."""

from __future__ import annotations

import math
import re

import mlx.core as mx
import numpy as np
import pytest

from ref_impl.engine import kvquant
from ref_impl.engine.checkpoint import load
from ref_impl.engine.kvquant import outlier_channels
from ref_impl.engine.model import ModelArgs
from ref_impl.engine.random import random_model
from ref_impl.measure import kv
from ref_impl.theory import roofline, shapes
from ref_impl.training import corpus, evaluate, models

CONTEXT, WINDOWS = 128, 2


@pytest.fixture(scope="module")
def shipped(shipped_model):
    model, tokenizer = load(shipped_model, mx.float32)
    stream, _ = corpus.heldout_stream(tokenizer)
    return model, stream


def cached_ppl(model, stream, scheme: str, context: int = CONTEXT, windows: int = WINDOWS, **params) -> float:
    """The held-out perplexity through a `scheme` cache, on `windows` windows of `context` (a sample)."""
    return evaluate.perplexity(evaluate.heldout_losses(model, stream, windows * context, context, scheme, **params))


@pytest.fixture(scope="module")
def float_ppl(shipped):
    model, stream = shipped
    return cached_ppl(model, stream, kv.FLOAT)


def test_capture_matches_model_and_rope_keeps_pair_norms(shipped):
    model, stream = shipped
    a = model.args
    tokens = mx.array(stream[None, 1000:1000 + CONTEXT])
    captured = kv.capture_keys_values(model, tokens)
    assert len(captured) == a.num_hidden_layers
    for pre, post, v in captured:
        assert pre.shape == post.shape == v.shape == (1, a.num_key_value_heads, CONTEXT, a.head_dim)
        pair = lambda k: np.hypot(k[..., 0::2], k[..., 1::2])   # norm of each (2i, 2i+1) pair
        np.testing.assert_allclose(pair(pre), pair(post), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(pre[:, :, 0], post[:, :, 0], rtol=1e-5, atol=1e-6)   # position 0: no turn
        assert not np.allclose(pre[:, :, 1:], post[:, :, 1:])                         # later ones turn
    # the last layer's post-RoPE keys equal what a real cached forward stores
    cache = model.make_cache(CONTEXT)
    model(tokens, cache)
    np.testing.assert_allclose(captured[-1][1], np.array(cache[-1].state[0]), rtol=1e-4, atol=1e-5)

    mags = kv.key_value_magnitudes(model, tokens)
    for name in ("keys_pre_rope", "keys_post_rope", "values"):
        for stat in ("mean", "max"):
            assert mags[name][stat].shape == (a.num_hidden_layers, a.num_key_value_heads, a.head_dim)
        assert (mags[name]["max"] >= mags[name]["mean"]).all()
    counts = outlier_channels(mags, 4.0)
    assert len(counts) == a.num_hidden_layers and all(0 <= c <= a.num_key_value_heads * a.head_dim for c in counts)
    assert outlier_channels(mags, 0.0) == [a.num_key_value_heads * a.head_dim] * a.num_hidden_layers


def test_per_channel_rounding_beats_per_token_with_outlier_channels():
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((2, 64, 32)).astype(np.float32)
    keys[..., 5] *= 30.0                       # one outlier channel
    for bits in (8, 4):
        err = kv.per_channel_rounding_error(keys, bits)
        assert err["per_token"].shape == err["per_channel"].shape == (32,)
        normal = np.arange(32) != 5
        # per token, the outlier sets every channel's step: the ordinary channels lose far more
        assert err["per_token"][normal].mean() > 5 * err["per_channel"][normal].mean()
        # no error beats half a step of the coarsest scale
        assert err["per_token"].max() <= np.abs(keys).max() / (2 ** (bits - 1) - 1) / 2 * 1.001


def test_float_cache_perplexity_equals_mean_loss(shipped, float_ppl):
    model, stream = shipped
    expected = math.exp(evaluate.mean_loss(model, stream, CONTEXT, max_tokens=WINDOWS * CONTEXT, spread=True))
    assert float_ppl == pytest.approx(expected, rel=1e-4)
    # token by token reads the same history
    ppl_1 = cached_ppl(model, stream, kv.FLOAT, 32, 1, chunk=1)
    assert ppl_1 == pytest.approx(math.exp(evaluate.mean_loss(model, stream, 32, max_tokens=32, spread=True)), rel=1e-4)


def test_heldout_perplexity_scores_every_window_unless_sampled(shipped):
    """The one held-out evaluation: every window of the model's context over the stream, or a sample of
    max_tokens of it spread evenly, the same windows for every scheme."""
    model, stream = shipped
    short = stream[:5 * CONTEXT + 1]
    every = evaluate.heldout_losses(model, short, context=CONTEXT)
    assert len(every) == 5
    np.testing.assert_allclose(every, evaluate.window_losses(model, short, CONTEXT), rtol=1e-5)
    sample = evaluate.heldout_losses(model, short, 2 * CONTEXT, CONTEXT)
    np.testing.assert_allclose(sample, every[[0, 4]], rtol=1e-5)             # the first and last, spread evenly
    assert evaluate.perplexity(every) == pytest.approx(math.exp(every.mean()))
    assert len(evaluate.heldout_losses(model, stream[:2 * 512 + 1])) == 2      # the model's own 512-token context


@pytest.mark.parametrize("scheme", ["sym8", "affine8-g64"])
def test_8bit_schemes_near_float(shipped, float_ppl, scheme):
    model, stream = shipped
    ppl = cached_ppl(model, stream, scheme)
    assert ppl != float_ppl and abs(ppl / float_ppl - 1) < 0.01


def test_4bit_sym_costs_more_than_8bit(shipped, float_ppl):
    model, stream = shipped
    p8, p4 = (cached_ppl(model, stream, s) for s in ("sym8", "sym4"))
    assert abs(p4 - float_ppl) > abs(p8 - float_ppl)


def test_memory_table_matches_hand_formulas():
    contexts = (8192, 131072)
    rows = kv.memory_table(["Llama-3.1-8B"], contexts, ["float", "sym8", "sym4", "affine4-g64", "kivi2"])
    got = {(r["scheme"], r["context"]): r["bytes"] for r in rows}
    layers, heads, hd = 32, 8, 128   # Llama-3.1-8B config.json
    per_head = {                     # bytes one token adds per layer, KV head and tensor (K or V)
        "float": hd * 2,
        "sym8": hd + 2,              # int8 codes + one float16 scale
        "sym4": hd // 2 + 2,         # two codes a byte + one scale
        "affine4-g64": hd // 2 + (hd // 64) * 2 * 2,   # codes + float16 scale and bias per group
        "kivi2": hd // 4 + (hd // 32) * 2 * 2,         # keys per channel over 32 tokens: same count
    }
    kivi_fixed = layers * heads * hd * 2 * ((32 + 32) + 32)   # float key window + partial block, value window
    for (scheme, context), value in got.items():
        expected = 2 * layers * heads * per_head[scheme] * context + (kivi_fixed if scheme == "kivi2" else 0)
        assert value == expected, (scheme, context)
    shape = shapes.PUBLIC["Llama-3.1-8B"]
    for c in contexts:
        assert got[("float", c)] == roofline.kv_cache_bytes(shape, c, 2)
    assert {r["vs_float"] for r in rows if r["scheme"] == "float"} == {1.0}


# --- needle retrieval -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def needle_setup(shipped_model):
    _, tokenizer = load(shipped_model, mx.float32)
    texts = corpus.read_corpus(models.config_for("stdlib-10m"))[0]["heldout"]
    return tokenizer, texts


def test_needle_prompts_plant_the_name_and_cue_it(needle_setup):
    tok, texts = needle_setup
    trials = kv.needle_trials(tok, texts, 6, context=512, distance=128, seed=1)
    assert [t.name for t in trials] == [t.name for t in kv.needle_trials(tok, texts, 6, 512, 128, seed=1)]
    assert [t.name for t in trials] != [t.name for t in kv.needle_trials(tok, texts, 6, 512, 128, seed=2)]
    joined = "".join(texts)
    for t in trials:
        word = tok.decode([t.target])
        prefix = t.name[:-len(word)]
        assert len(t.prompt) == len(t.control) == 512 and t.prompt[0] == tok.bos_id
        assert prefix.endswith("_") and re.search(rf"(?<![A-Za-z]){prefix[:-1]}(?![A-Za-z])", joined) is None
        text, control = tok.decode(t.prompt), tok.decode(t.control)
        assert text.endswith(f"\n\n    def run(self):\n        self.{prefix}") and control.endswith(prefix)
        assert text.count(t.name) == 3 and t.name not in control          # def + two calls; none in the control
        assert 128 - 40 < t.distance <= 128 and t.prompt[-t.distance:] == t.control[-t.distance:]
        assert tok.decode(t.prompt[:-t.distance]).endswith(f"self.{t.name}()\n        self.{t.name}()\n\n")
    with pytest.raises(ValueError, match="leaves no room"):
        kv.needle_trials(tok, texts, 1, context=512, distance=500)


def test_needle_float_cache_retrieves_and_control_does_not(shipped, needle_setup):
    """At 128 tokens the float model copies most needles; without one it never guesses the word. The cached
    prefill reads what an uncached forward computes."""
    model, _ = shipped
    trials = kv.needle_trials(*needle_setup, 8, context=512, distance=128, seed=0)
    hits, logp = kv.needle_retrieval(model, trials, kv.FLOAT, batch=4)
    control_hits, control_logp = kv.needle_retrieval(model, trials, kv.FLOAT, control=True)
    assert sum(hits) >= 5 and sum(control_hits) == 0
    assert np.mean(logp) > np.mean(control_logp) + 3
    logits = model(mx.array([t.prompt for t in trials]))[:, -1].astype(mx.float32)
    target = mx.array([t.target for t in trials])
    assert hits == (mx.argmax(logits, axis=-1) == target).tolist()
    want = (mx.take_along_axis(logits, target[:, None], -1)[:, 0] - mx.logsumexp(logits, axis=-1)).tolist()
    np.testing.assert_allclose(logp, want, rtol=1e-4, atol=1e-4)


# --- decode speed -------------------------------------------------------------------------------------

SMALL = ModelArgs(vocab_size=128, hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)   # head_dim 64


def test_fill_random_stores_context_positions():
    model = random_model(SMALL, mx.float32)
    for scheme in (kv.FLOAT, "affine4-g64", "kivi4"):
        caches = model.make_cache(100, 1, scheme)
        kv.fill_random(caches, 70, chunk=32)
        for c in caches:
            keys, values = c.state
            assert c.offset == 70 and keys.shape == values.shape == (1, 1, 70, 64)
            assert 0.8 < np.array(keys).std() < 1.2 and not np.array_equal(np.array(keys), np.array(values))
    with pytest.raises(ValueError, match="takes no parameters"):
        model.make_cache(8, 1, kv.FLOAT, fused=True)


def test_decode_speed_measures_every_variant_at_each_context():
    model = random_model(SMALL, mx.float32)
    variants = [(kv.FLOAT, False), ("affine4-g64", False), ("affine4-g64", True), ("kivi4", False)]
    points = kv.decode_speed(model, "small", variants, [40, 16], n_tokens=3, repeats=2)
    assert [(p.context, p.scheme, p.fused) for p in points] == [(c, s, f) for c in (16, 40) for s, f in variants]
    for p in points:
        assert p.model == "small" and p.tokens_per_s > 0 and len(p.tokens_per_s_runs) == 2 and p.itl_p50_ms > 0
    size = {(p.scheme, p.fused, p.context): p.cache_bytes for p in points}
    slots = 40 + 3 + 2                               # a fused cache rounds its slots up (kvquant.fused_slots)
    assert size[("affine4-g64", True, 40)] * slots == size[("affine4-g64", False, 40)] * kvquant.fused_slots(slots)
    assert size[("affine4-g64", False, 40)] < size[(kv.FLOAT, False, 40)]
    assert size[(kv.FLOAT, False, 40)] == 2 * 2 * 64 * (40 + 3 + 2) * 4     # layers, K and V, f32
    assert [p.context for p in kv.decode_speed(model, "small", variants[:1], [8, 16], 3, 1, budget_s=0.0)] == [8]


def test_crossover_is_where_the_variant_stays_faster():
    def points(float_rates, rates):
        ctx = [256, 1024, 4096, 16384]
        return ([kv.SpeedPoint("m", kv.FLOAT, False, c, r, [r], 1.0, 0) for c, r in zip(ctx, float_rates)]
                + [kv.SpeedPoint("m", "sym8", False, c, r, [r], 1.0, 0) for c, r in zip(ctx, rates)])

    assert kv.crossover(points([10, 10, 8, 5], [7, 9, 9, 6]), "sym8", False) == 4096
    assert kv.crossover(points([10, 10, 8, 5], [11, 9, 9, 6]), "sym8", False) == 4096    # not 256: it dips
    assert kv.crossover(points([10, 10, 8, 5], [11, 11, 9, 6]), "sym8", False) == 256
    assert kv.crossover(points([10, 10, 8, 5], [11, 11, 9, 4]), "sym8", False) is None   # slower at the end
    assert kv.crossover(points([10, 10, 8, 5], [11, 11, 9, 6]), "sym8", True) is None    # no such variant
