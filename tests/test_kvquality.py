"""KV-cache quality: key capture and magnitudes, rounding error, cached perplexity, memory table."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from ref_impl import kvquality, roofline, train
from ref_impl.model import load

CONTEXT, WINDOWS = 128, 2


@pytest.fixture(scope="module")
def shipped(shipped_model):
    model, tokenizer = load(shipped_model, mx.float32)
    stream, _ = train.heldout_stream(tokenizer)
    return model, stream


@pytest.fixture(scope="module")
def float_ppl(shipped):
    model, stream = shipped
    return kvquality.cache_perplexity(model, stream, kvquality.FLOAT, CONTEXT, WINDOWS)


def test_capture_matches_model_and_rope_keeps_pair_norms(shipped):
    model, stream = shipped
    a = model.args
    tokens = mx.array(stream[None, 1000:1000 + CONTEXT])
    captured = kvquality.capture_keys_values(model, tokens)
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

    mags = kvquality.key_value_magnitudes(model, tokens)
    for name in ("keys_pre_rope", "keys_post_rope", "values"):
        for stat in ("mean", "max"):
            assert mags[name][stat].shape == (a.num_hidden_layers, a.num_key_value_heads, a.head_dim)
        assert (mags[name]["max"] >= mags[name]["mean"]).all()
    counts = kvquality.outlier_channels(mags, 4.0)
    assert len(counts) == a.num_hidden_layers and all(0 <= c <= a.num_key_value_heads * a.head_dim for c in counts)
    assert kvquality.outlier_channels(mags, 0.0) == [a.num_key_value_heads * a.head_dim] * a.num_hidden_layers


def test_per_channel_rounding_beats_per_token_with_outlier_channels():
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((2, 64, 32)).astype(np.float32)
    keys[..., 5] *= 30.0                       # one outlier channel
    for bits in (8, 4):
        err = kvquality.per_channel_rounding_error(keys, bits)
        assert err["per_token"].shape == err["per_channel"].shape == (32,)
        normal = np.arange(32) != 5
        # per token, the outlier sets every channel's step: the ordinary channels lose far more
        assert err["per_token"][normal].mean() > 5 * err["per_channel"][normal].mean()
        # no error beats half a step of the coarsest scale
        assert err["per_token"].max() <= np.abs(keys).max() / (2 ** (bits - 1) - 1) / 2 * 1.001


def test_float_cache_perplexity_equals_mean_loss(shipped, float_ppl):
    model, stream = shipped
    expected = math.exp(train.mean_loss(model, stream, CONTEXT, max_tokens=WINDOWS * CONTEXT, spread=True))
    assert float_ppl == pytest.approx(expected, rel=1e-4)
    # token by token reads the same history
    ppl_1 = kvquality.cache_perplexity(model, stream, kvquality.FLOAT, 32, 1, chunk=1)
    assert ppl_1 == pytest.approx(math.exp(train.mean_loss(model, stream, 32, max_tokens=32, spread=True)), rel=1e-4)


@pytest.mark.parametrize("scheme", ["sym8", "affine8-g64"])
def test_8bit_schemes_near_float(shipped, float_ppl, scheme):
    model, stream = shipped
    ppl = kvquality.cache_perplexity(model, stream, scheme, CONTEXT, WINDOWS)
    assert ppl != float_ppl and abs(ppl / float_ppl - 1) < 0.01


def test_4bit_sym_costs_more_than_8bit(shipped, float_ppl):
    model, stream = shipped
    p8, p4 = (kvquality.cache_perplexity(model, stream, s, CONTEXT, WINDOWS) for s in ("sym8", "sym4"))
    assert abs(p4 - float_ppl) > abs(p8 - float_ppl)


def test_memory_table_matches_hand_formulas():
    contexts = (8192, 131072)
    rows = kvquality.memory_table(["Llama-3.1-8B"], contexts, ["float", "sym8", "sym4", "affine4-g64", "kivi2"])
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
    shape = roofline.MODELS["Llama-3.1-8B"]
    for c in contexts:
        assert got[("float", c)] == roofline.kv_cache_bytes(shape, c, 2)
    assert {r["vs_float"] for r in rows if r["scheme"] == "float"} == {1.0}
