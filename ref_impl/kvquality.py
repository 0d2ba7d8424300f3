"""What quantizing the KV cache costs: key/value magnitudes, rounding error, perplexity, memory.

Four measurements behind the KV-cache chapter's choice of scheme (`kvquant.CACHES`):

* `key_value_magnitudes`: per layer and channel, mean and max |k| and |v| over a prompt, keys both
  before and after RoPE. Keys carry a few *outlier channels* (`outlier_channels` counts them);
  values do not. RoPE rotates each pair (2i, 2i+1) by a position-dependent angle, so after it a
  pre-RoPE outlier channel spreads over its pair, but the pair's norm is unchanged.
* `per_channel_rounding_error`: the RMS error per channel of symmetric rounding with one scale per
  token (the max over channels: an outlier channel sets a coarse step for all the others) versus
  one scale per channel (over tokens: each channel gets its own step). This is KIVI's argument.
* `cache_perplexity`: held-out perplexity when attention reads the history from a quantized cache.
* `memory_table`: analytic KV bytes for public model shapes at long contexts, per scheme.

How the keys are captured: `capture_keys_values` runs the decoder's layers itself, exactly as
`Model.__call__` does (embed, then each block with the causal mask), and hands each block a
`_Recorder` in place of its cache. The recorder sees the post-RoPE keys and the values in
`update_and_fetch` (model.py's Attention applies RoPE before calling it) and returns them
unchanged, so the forward is the uncached one; the pre-RoPE keys are the block's own `k_proj` on
its normed input, computed alongside. model.py is not touched.

Shapes: keys and values are (B, n_kv_heads, L, head_dim); magnitudes are (n_layers, n_kv_heads,
head_dim) numpy arrays.

See chapter: kv-cache
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from . import kvquant, roofline
from .kvcache import KVCache
from .model import Model

FLOAT = "float"   # the scheme name of the unquantized static cache (kvcache.KVCache)


class _Recorder:
    """A stand-in cache that keeps what attention gives it and stores nothing between calls."""

    offset = 0

    def update_and_fetch(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        self.keys, self.values = k, v
        return k, v


def capture_keys_values(model: Model, tokens: mx.array) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per layer (keys before RoPE, keys after RoPE, values), each (B, n_kv_heads, L, head_dim),
    for tokens (B, L) run through the model without a cache (see the module docstring)."""
    h = model.embed_tokens(tokens)
    B, L, _ = h.shape
    mask = "causal" if L > 1 else None
    out = []
    for layer in model.layers:
        attn, rec = layer.self_attn, _Recorder()
        pre = attn.k_proj(layer.input_layernorm(h)).reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
        h = layer(h, mask, rec)
        mx.eval(h, pre, rec.keys, rec.values)
        out.append(tuple(np.array(a.astype(mx.float32)) for a in (pre, rec.keys, rec.values)))
    return out


def key_value_magnitudes(model: Model, tokens: mx.array) -> dict[str, dict[str, np.ndarray]]:
    """Per layer and channel magnitudes over a prompt's positions (and batch), for tokens (B, L):
    {"keys_pre_rope" | "keys_post_rope" | "values": {"mean": |x| mean, "max": |x| max}}, each
    (n_layers, n_kv_heads, head_dim)."""
    captured = capture_keys_values(model, tokens)
    mags = {}
    for i, name in enumerate(("keys_pre_rope", "keys_post_rope", "values")):
        absx = [np.abs(c[i]) for c in captured]
        mags[name] = {"mean": np.stack([a.mean(axis=(0, 2)) for a in absx]),
                      "max": np.stack([a.max(axis=(0, 2)) for a in absx])}
    return mags


def outlier_indices(magnitude: np.ndarray, factor: float) -> np.ndarray:
    """Indices of the channels whose magnitude (one value per channel, (C,)) exceeds factor times
    the median channel's: the outlier rule used throughout the chapter."""
    magnitude = np.asarray(magnitude, dtype=np.float64)
    if magnitude.ndim != 1 or magnitude.size == 0:
        raise ValueError(f"expected one magnitude per channel (a non-empty 1-D array), got shape {magnitude.shape}")
    return np.flatnonzero(magnitude > factor * np.median(magnitude))


def outlier_channels(mags: dict, factor: float, which: str = "keys_pre_rope", stat: str = "mean") -> list[int]:
    """Per layer, how many channels (over all KV heads) are outliers (`outlier_indices`) by
    mags[which][stat]."""
    m = mags[which][stat]
    return [len(outlier_indices(row, factor)) for row in m.reshape(m.shape[0], -1)]


def per_channel_rounding_error(keys, bits: int) -> dict[str, np.ndarray]:
    """RMS rounding error per channel (head_dim,) of keys (..., L, head_dim) quantized symmetric
    `bits`-bit (kvquant.quantize_symmetric: 8 or 4) with one scale per token ("per_token", over its
    channels) or one per channel ("per_channel", over the L tokens; L even for 4 bits).
    The error is averaged over tokens and every leading axis."""
    x = mx.array(np.asarray(keys, dtype=np.float32))

    def roundtrip(rows: mx.array) -> mx.array:   # symmetric over the last axis
        return kvquant.dequantize_symmetric(*kvquant.quantize_symmetric(rows, bits, mx.float32), bits)

    per_token = roundtrip(x)
    per_channel = roundtrip(x.swapaxes(-1, -2)).swapaxes(-1, -2)
    axes = tuple(range(x.ndim - 1))
    return {name: np.sqrt(np.array(mx.mean((q - x) ** 2, axis=axes)))
            for name, q in (("per_token", per_token), ("per_channel", per_channel))}


def window_starts(stream: np.ndarray, context: int, windows: int) -> np.ndarray:
    """Start of each window: `train.mean_loss(..., max_tokens=windows * context, spread=True)`'s."""
    n = min(len(stream) - 1, windows * context) // context
    if n == 0:
        raise ValueError(f"the stream ({len(stream)} tokens) is shorter than one window ({context})")
    return np.linspace(0, (len(stream) - 1) // context - 1, n).astype(np.int64) * context


def make_scheme_caches(model: Model, scheme: str, batch: int, max_size: int, **params) -> list:
    """One cache per layer: the float static KVCache for scheme "float", else kvquant's `scheme`."""
    a, dtype = model.args, model.norm.weight.dtype
    if scheme == FLOAT:
        return [KVCache(batch, a.num_key_value_heads, a.head_dim, max_size, dtype)
                for _ in range(a.num_hidden_layers)]
    return kvquant.make_caches(scheme, a.num_hidden_layers, batch, a.num_key_value_heads, a.head_dim,
                               max_size, dtype, **params)


def cache_perplexity(model: Model, stream: np.ndarray, scheme: str, context: int, windows: int,
                     chunk: int = 64, batch: int = 16, **params) -> float:
    """Held-out perplexity exp(mean NLL) with the decoder reading its history from a `scheme` cache.

    The windows are `train.mean_loss`'s (spread=True, max_tokens = windows * context), each fed
    through `model(tokens, cache)` in chunks of `chunk` tokens: chunk k attends to the cache's
    (dequantized) copy of chunks 0..k, its own keys included, as a decode step reads its own
    token's keys from the cache. `chunk=1` is token-by-token decoding; larger chunks are a chunked
    prefill, faster and identical for the per-token schemes (sym*, affine*), while KIVI's float
    window and OutlierKVCache's calibration (on the first chunk) see chunk-sized steps. The float
    baseline (scheme "float") goes the same way through the static KVCache, so the difference
    between two schemes is the quantization alone. params go to the scheme (bits, group, ...).
    """
    starts = window_starts(stream, context, windows)
    total = 0.0
    for i in range(0, len(starts), batch):
        rows = stream[starts[i:i + batch, None] + np.arange(context + 1)]
        x, y = mx.array(rows[:, :-1]), mx.array(rows[:, 1:])
        caches = make_scheme_caches(model, scheme, len(rows), context, **params)
        for s in range(0, context, chunk):
            logits = model(x[:, s:s + chunk], caches)
            loss = nn.losses.cross_entropy(logits.astype(mx.float32), y[:, s:s + chunk], reduction="sum")
            total += loss.item()
    return float(np.exp(total / (len(starts) * context)))


def _one_cache(scheme: str, n_kv_heads: int, head_dim: int, max_size: int, dtype: mx.Dtype, **params):
    """A single batch-1 cache of the scheme (one layer)."""
    if scheme == FLOAT:
        return KVCache(1, n_kv_heads, head_dim, max_size, dtype)
    return kvquant.make_caches(scheme, 1, 1, n_kv_heads, head_dim, max_size, dtype, **params)[0]


def scheme_bytes(scheme: str, n_kv_heads: int, head_dim: int, dtype: mx.Dtype = mx.float16,
                 sizes: tuple[int, int] = (256, 512), **params) -> tuple[float, float]:
    """(bytes per token, fixed bytes) of one layer's cache, read off `nbytes` of a batch-1 cache of
    the scheme built at two max_size values: no formula of its own, so it cannot drift from kvquant."""
    a, b = (_one_cache(scheme, n_kv_heads, head_dim, s, dtype, **params).nbytes for s in sizes)
    per_token = (b - a) / (sizes[1] - sizes[0])
    return per_token, a - per_token * sizes[0]


# A 30B-class model for C05's "35B" (Qwen3-30B-A3B: 48 layers, 4 KV heads of 128; config.json at
# https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json). Its mixture-of-experts MLP does not fit
# roofline's dense ModelShape, so this shape serves KV arithmetic only: intermediate_size 0 makes any
# weight count taken from it visibly wrong rather than plausibly wrong.
QWEN3_30B_A3B = roofline.ModelShape("Qwen3-30B-A3B", 151936, 2048, 48, 0, 32, 4, 128, False,
                                    "Qwen/Qwen3-30B-A3B, config.json: https://huggingface.co/Qwen/Qwen3-30B-A3B/"
                                    "blob/main/config.json (KV heads and layers only; MoE MLP not modelled)",
                                    qk_norm=True)
KV_SHAPES = {**roofline.MODELS, QWEN3_30B_A3B.name: QWEN3_30B_A3B}   # every shape memory_table knows by name
DEFAULT_SHAPES = ("Llama-3.1-8B", "Qwen3-4B", "Qwen3-8B", "Qwen3-32B", "Qwen3-30B-A3B")
DEFAULT_CONTEXTS = (8192, 16384, 32768, 65536, 131072)


def memory_table(shapes: Iterable[str | roofline.ModelShape] = DEFAULT_SHAPES,
                 contexts: Sequence[int] = DEFAULT_CONTEXTS,
                 schemes: Sequence[str] = (FLOAT, *kvquant.CACHES),
                 dtype: mx.Dtype = mx.float16) -> list[dict]:
    """KV-cache bytes of one sequence at each context, per model shape and scheme (batch 1).

    bytes = per_token * (positions stored over all layers, `roofline`'s count, which caps
    sliding-window layers) + fixed * n_layers, with per_token and fixed from `scheme_bytes`
    (float16 scales, the GPU case). "float" is the float16 static cache, equal to
    `roofline.kv_cache_bytes(shape, context, 2)`. Rows: model, scheme, context, bytes,
    bytes_per_token (per token over all layers at that context), vs_float (bytes / float bytes)."""
    rows = []
    for shape in shapes:
        shape = KV_SHAPES[shape] if isinstance(shape, str) else shape
        cost = {s: scheme_bytes(s, shape.num_key_value_heads, shape.head_dim, dtype) for s in (FLOAT, *schemes)}
        for context in contexts:
            stored = roofline.attended_positions(shape, context)   # sum over layers of positions kept
            size = {s: per * stored + fixed * shape.num_hidden_layers for s, (per, fixed) in cost.items()}
            rows += [{"model": shape.name, "scheme": s, "context": context, "bytes": size[s],
                      "bytes_per_token": size[s] / context, "vs_float": size[s] / size[FLOAT]}
                     for s in schemes]
    return rows
