"""Chapter "Quantizing the KV cache" (book/kv-cache/kv-quantization), KV tasks 1 to 3:
`pytest tests/test_exercises_kv_cache.py -k kv_task`."""

from __future__ import annotations

import numpy as np
import pytest

from ref_impl import exercises as ex


def affine_bytes_by_hand(layers, kv_heads, head_dim, bits, group, scale_bytes):
    values = 2 * layers * kv_heads * head_dim                       # K and V
    return values * bits / 8 + values / group * 2 * scale_bytes     # codes + a scale and a bias per group


def test_kv_task_1_accepts_the_hand_formula():
    # Llama-3.1-8B: 2 x 32 x 8 x 128 = 65,536 values; 4 bits + 2 x 16 bits / 64 = 4.5 bits -> 36,864 bytes
    assert affine_bytes_by_hand(32, 8, 128, 4, 64, 2) == 36_864
    assert ex.check_kv_bytes_per_token(36_864)
    assert ex.check_kv_bytes_per_token(affine_bytes_by_hand)


@pytest.mark.parametrize("wrong, hint", [
    (lambda L, kv, hd, b, g, sb: 2 * L * kv * hd * b / 8, "codes alone"),
    (lambda L, kv, hd, b, g, sb: 2 * L * kv * hd * (b / 8 + sb / g), "bias"),
    (lambda L, kv, hd, b, g, sb: affine_bytes_by_hand(L, kv, hd, b, g, sb) / 2, "keys and values"),
    (lambda L, kv, hd, b, g, sb: affine_bytes_by_hand(L, kv * 4, hd, b, g, sb), "num_key_value_heads"),
    (lambda L, kv, hd, b, g, sb: 8 * affine_bytes_by_hand(L, kv, hd, b, g, sb), "bits vs bytes"),
])
def test_kv_task_1_rejects_typical_mistakes_with_their_hint(wrong, hint):
    r = ex.check_kv_bytes_per_token(wrong)
    assert not r and hint in r.message, r.message


def per_channel_by_hand(keys, bits, axis=0):
    qmax = 2 ** (bits - 1) - 1
    scale = np.abs(keys).max(axis=axis, keepdims=True) / qmax
    return np.clip(np.round(keys / np.where(scale == 0, 1, scale)), -qmax, qmax) * scale


def test_kv_task_2_accepts_per_channel_rounding_and_rejects_per_token():
    assert ex.check_quantize_keys_per_channel(per_channel_by_hand)
    r = ex.check_quantize_keys_per_channel(lambda k, b: per_channel_by_hand(k, b, axis=1))
    assert not r and "one scale per token" in r.message, r.message
    r = ex.check_quantize_keys_per_channel(lambda k, b: k)           # no rounding at all
    assert not r and "expected" in r.message
    r = ex.check_quantize_keys_per_channel(lambda k, b: per_channel_by_hand(k, b)[:, :8])
    assert not r and "shape" in r.message


def test_kv_task_2_rejects_an_unsafe_zero_channel():
    def divides_by_zero(keys, bits):
        qmax = 2 ** (bits - 1) - 1
        with np.errstate(invalid="ignore", divide="ignore"):
            scale = np.abs(keys).max(axis=0, keepdims=True) / qmax
            return np.clip(np.round(keys / scale), -qmax, qmax) * scale
    r = ex.check_quantize_keys_per_channel(divides_by_zero)
    assert not r and "zero" in r.message, r.message


def outliers_by_hand(keys, factor):
    m = np.abs(keys).mean(axis=0)
    return [c for c in range(keys.shape[1]) if m[c] > factor * np.median(m)]


def test_kv_task_3_accepts_the_rule_and_rejects_max_mean_and_counts():
    assert ex.check_outlier_channels(outliers_by_hand)
    by_max = lambda k, f: [c for c in range(k.shape[1])
                           if np.abs(k).max(0)[c] > f * np.median(np.abs(k).max(0))]
    r = ex.check_outlier_channels(by_max)
    assert not r and "spike" in r.message, r.message
    r = ex.check_outlier_channels(lambda k, f: len(outliers_by_hand(k, f)))
    assert not r and "indices" in r.message
    r = ex.check_outlier_channels(lambda k, f: outliers_by_hand(k, f)[:-1])
    assert not r
