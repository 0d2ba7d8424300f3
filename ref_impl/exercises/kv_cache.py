"""Exercises of chapter "Quantizing the KV cache" (book/kv-cache/kv-quantization): KV tasks 1 to 3.

The bytes one token adds to an affine-quantized cache, per-channel symmetric rounding of keys, and
finding outlier channels; checked against the engine's quantized caches (`engine.kvquant`).
Tests: `pytest tests/test_exercises_kv_cache.py -k kv_task`.

See chapter: kv-cache
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ref_impl.engine.kvquant import dequantize_symmetric, outlier_indices, quantize_symmetric, scheme_bytes
from ref_impl.exercises.core import DTYPE_NAMES, Result, array_answer, judge_cases, run_answer
from ref_impl.theory import roofline as rl
from ref_impl.theory import shapes


def _kv_bytes_case(shape: str, bits: int, group: int, scale_bytes: int):
    s = shapes.shape(shape)
    per_layer, _ = scheme_bytes(f"affine{bits}-g{group}", s.num_key_value_heads, s.head_dim,
                                getattr(mx, DTYPE_NAMES[scale_bytes]))
    right = per_layer * s.num_hidden_layers                    # read off the caches' real nbytes
    elems = rl.kv_bytes_per_token(s, bytes_per_element=1)      # K and V values per token, all layers
    codes = elems * bits / 8
    mistakes = [
        (codes, f"the codes alone: every group of {group} values also stores a scale and a bias."),
        (codes + elems / group * scale_bytes, "an affine group stores a bias (its minimum) as well as a scale."),
        (right / 2, "a cache holds keys and values: count both."),
        (right * 8, "bits vs bytes: a 4-bit code is half a byte."),
        (right / s.num_hidden_layers, "every layer has its own cache: multiply by the number of layers."),
        (right * s.num_attention_heads / s.num_key_value_heads,
         "grouped-query attention caches num_key_value_heads heads, not num_attention_heads."),
        (elems * 2, "that is the float16 cache; the question is about the quantized one."),
    ]
    args = (s.num_hidden_layers, s.num_key_value_heads, s.head_dim, bits, group, scale_bytes)
    label = f"{shape}, {bits}-bit, groups of {group}, {scale_bytes}-byte scales and biases"
    return args, label, right, mistakes


def check_kv_bytes_per_token(answer, shape: str = "Llama-3.1-8B", bits: int = 4, group: int = 64,
                             scale_bytes: int = 2) -> Result:
    """KV task 1: bytes one token adds to an affine-quantized KV cache (kvquant.AffineKVCache, what
    mlx-lm's QuantizedKVCache stores), over all layers.

    `answer` is a number for the given case, or a function
    `f(layers, kv_heads, head_dim, bits, group, scale_bytes)` called on four cases. Checked against the
    `nbytes` of real caches (`kvquant.scheme_bytes`).
    """
    cases = [_kv_bytes_case(shape, bits, group, scale_bytes), _kv_bytes_case("Qwen3-8B", 8, 32, 2),
             _kv_bytes_case("Llama-3.2-1B", 4, 32, 4), _kv_bytes_case("Qwen3-32B", 8, 64, 2)]
    return judge_cases("KV task 1", answer, cases, "bytes/token",
                       "per token: 2 (K and V) × layers × kv_heads × head_dim values; each costs bits/8 bytes, and "
                       "every group of `group` values adds a scale and a bias of scale_bytes each.", rtol=1e-6)


KEYS_RTOL = 1e-5   # of the block's largest |key|: float32 or float64 arithmetic both pass


def _keys_block(seed: int, tokens: int = 16, channels: int = 64, outliers: tuple[int, ...] = (3, 40)) -> np.ndarray:
    """Keys (tokens, channels) with a few large channels, as in the chapter's heatmaps."""
    x = np.random.default_rng(seed).normal(0.0, 1.0, (tokens, channels)).astype(np.float32)
    x[:, list(outliers)] *= 12.0
    return x


def _per_channel(keys: np.ndarray, bits: int, qmax: float | None = None, rounding=np.round,
                 axis: int = 0) -> np.ndarray:
    """Symmetric rounding with one scale per channel (axis 0: over tokens), or per token (axis 1)."""
    qmax = qmax if qmax is not None else 2 ** (bits - 1) - 1
    scale = np.abs(keys).max(axis=axis, keepdims=True) / qmax
    safe = np.where(scale == 0, 1.0, scale)
    return np.clip(rounding(keys / safe), -qmax, qmax) * scale


def _engine_per_channel(keys: np.ndarray, bits: int) -> np.ndarray:
    t = mx.array(keys.T.copy())                      # channels become rows: one scale per channel
    q, scale = quantize_symmetric(t, bits, mx.float32)
    return np.array(dequantize_symmetric(q, scale, bits)).T


def check_quantize_keys_per_channel(fn) -> Result:
    """KV task 2: `fn(keys: float32 (tokens, channels), bits) -> dequantized keys (tokens, channels)`:
    symmetric `bits`-bit rounding with one scale per channel, scale = max over tokens of |k| / (2^(bits-1) − 1),
    codes rounded to nearest and clipped to ±(2^(bits-1) − 1).

    Called on four blocks (4 and 8 bits, one with an all-zero channel); checked against
    `kvquant.quantize_symmetric` applied along the token axis, within 1e-5 of the block's largest |key|.
    """
    task = "KV task 2"
    blocks = [(_keys_block(0), 4, "4-bit, outlier channels 3 and 40"), (_keys_block(1), 8, "8-bit"),
              (_keys_block(2, 32, 128, (7,)), 4, "4-bit, 32 tokens × 128 channels")]
    zero = _keys_block(3)
    zero[:, 10] = 0.0
    blocks.append((zero, 4, "4-bit, channel 10 all zero"))
    for keys, bits, label in blocks:
        got, bad = array_answer(task, label, "an array of keys", fn, keys.copy(), bits)
        if bad is not None:
            return bad
        if got.shape != keys.shape:
            return Result(False, f"{task} ({label}): shape {got.shape}, expected {keys.shape} (dequantized keys, "
                                 "not codes or scales).")
        if not np.isfinite(got).all():
            return Result(False, f"{task} ({label}): inf or nan in your keys: does an all-zero channel divide by a "
                                 "zero scale? Give it codes 0.")
        right = _engine_per_channel(keys, bits).astype(np.float64)
        tol = KEYS_RTOL * float(np.abs(keys).max())
        if np.all(np.abs(got - right) <= tol):
            continue
        variants = [(_per_channel(keys, bits, axis=1), "that is one scale per token (over its channels); take the "
                                                         "max over the tokens of each channel instead (axis 0)."),
                    (_per_channel(keys, bits, qmax=2 ** (bits - 1)), f"the largest code is 2^(bits-1) − 1 = "
                                                                     f"{2 ** (bits - 1) - 1}, keeping the grid symmetric."),
                    (_per_channel(keys, bits, qmax=2 ** bits - 1), "symmetric codes are signed: ±(2^(bits-1) − 1), "
                                                                   "not 0..2^bits − 1."),
                    (_per_channel(keys, bits, rounding=np.trunc), "round to the nearest code (np.round), don't "
                                                                  "truncate toward zero."),
                    (_per_channel(keys, bits, rounding=np.floor), "round to the nearest code (np.round), not down.")]
        hint = next((h for v, h in variants if np.all(np.abs(got - v) <= tol)),
                    "scale[c] = max_t |k[t, c]| / (2^(bits-1) − 1); k̂ = clip(round(k / scale), ±qmax) × scale.")
        t, c = np.unravel_index(int(np.argmax(np.abs(got - right))), keys.shape)
        return Result(False, f"{task} ({label}): key [{t}, {c}] is {got[t, c]:.6g}, expected {right[t, c]:.6g}. "
                             f"Hint: {hint}")
    return Result(True, f"{task}: right on all {len(blocks)} blocks.")


def _outlier_case(seed: int, factor: float):
    keys = _keys_block(seed, 64, 64, (5, 17, 50))
    keys[3, 30] = 60.0                  # one token's spike: a large max, an ordinary mean |k|
    keys[:, 44] += 6.0                  # an offset channel: its signed mean is large too
    right = [int(i) for i in outlier_indices(np.abs(keys).mean(axis=0), factor)]
    mistakes = [
        ([int(i) for i in outlier_indices(np.abs(keys).max(axis=0), factor)],
         "that ranks channels by their max |k|: one token's spike is not an outlier channel; use the mean."),
        ([int(i) for i in np.flatnonzero(np.abs(keys).mean(0) > factor * np.abs(keys).mean(0).mean())],
         "compare with the median channel, not the mean: the outliers themselves pull the mean up."),
        ([int(i) for i in outlier_indices(np.abs(keys.mean(axis=0)) + 1e-12, factor)],
         "take |k| before averaging: positive and negative keys cancel in a plain mean."),
    ]
    return (keys, factor), f"64 tokens × 64 channels, factor {factor:g}", right, mistakes


def check_outlier_channels(fn) -> Result:
    """KV task 3: `fn(keys: (tokens, channels), factor) -> sorted channel indices` whose mean |k| over the
    tokens is above `factor` times the median channel's mean |k| (`kvquant.outlier_indices`).

    Called on three blocks with planted outlier channels and a one-token spike; checked exactly.
    """
    task = "KV task 3"
    for args, label, right, mistakes in [_outlier_case(0, 4.0), _outlier_case(1, 3.0), _outlier_case(2, 8.0)]:
        value, failed = run_answer(task, label, fn, *args)
        if failed is not None:
            return failed
        if isinstance(value, (int, np.integer)):
            return Result(False, f"{task} ({label}): got the number {value}; return the channels' indices, "
                                 f"e.g. [{', '.join(map(str, right))}].")
        try:
            got = sorted(int(i) for i in np.asarray(value).ravel())
        except (TypeError, ValueError):
            return Result(False, f"{task} ({label}): expected a list of channel indices, got {value!r:.80}.")
        if got == right:
            continue
        hint = next((h for m, h in mistakes if sorted(m) == got and sorted(m) != right),
                    "mean over tokens of |k| per channel; an outlier is above factor × the median of those means.")
        return Result(False, f"{task} ({label}): {got}, not {right}. Hint: {hint}")
    return Result(True, "KV task 3: right on all 3 blocks.")
