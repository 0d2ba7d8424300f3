"""Quantized key/value caches: the decoder's static cache, stored in fewer bits; and `make_caches`,
the one builder of every cache scheme, float or quantized.

Every cache here is a sibling of `kvcache.KVCache` under the interface `kvcache.Cache`:
pre-allocated packed buffers (codes plus scales and, for affine formats, biases) sized for
`max_size` positions, written in place by `update_and_fetch`, with the same `offset`, `trim(n)`,
`state` and `nbytes`. Four schemes:

* `SymmetricKVCache`: per-token symmetric int8/int4 for K and V alike (the uniform baseline);
  scale = max|x| / (2^(b-1) - 1) per (token, head), |error| <= scale / 2.
* `AffineKVCache`: per-token groups of `group` channels through MLX's `mx.quantize` (affine),
  K and V alike: what mlx-lm's `QuantizedKVCache` stores.
* `KIVIKVCache`: asymmetric, after KIVI (Liu et al. 2024, arXiv:2402.02750): keys per channel
  over blocks of `group` tokens, values per token, with the newest `window` tokens in float.
* `OutlierKVCache`: after KVQuant's dense-and-sparse keys (Hooper et al. 2024, arXiv:2401.18079):
  `n_outliers` key channels per KV head, picked by `calibrate`, kept in float16; the other key
  channels and all values are 4-bit affine groups.
They share code through the small functions below (`affine_buffers`, `write_affine`,
`read_affine`, `quantized_attention`), not through each other.

Attention path, two of them, chosen by the constructor flag `fused` (default False), which sets
the cache's `attends` field (kvcache.Cache) that `model.Attention` reads:
* "dense", dequantized (every scheme): `update_and_fetch` returns the *dequantized* float keys and
  values of the filled part and `model.Attention` calls `mx.fast.scaled_dot_product_attention` on
  them. The simplest correct drop-in; it re-expands the whole history every step (a float copy
  written and read again), so it saves memory, not bandwidth.
* "fused" (`AffineKVCache` and `OutlierKVCache` only, `FUSED`): model.Attention calls the cache's
  `attend(q, k, v, scale, mask)`: it stores k, v, then runs `quantized_attention`, two
  `mx.quantized_matmul`s straight on the packed codes (q.K^T with transpose=True, softmax, p.V
  with transpose=False), as mlx-lm's `models/base.py: quantized_scaled_dot_product_attention`
  does. The outlier cache adds q.K^T of its float16 channels. No float history is made. The
  matmuls read the whole pre-allocated buffers, max_size slots (rounded up to a multiple of
  32: `fused_slots`), with the unfilled ones masked, as
  gpt-fast attends over its static cache: the filled part alone, buffer[:, :, :offset], is a
  strided view, which MLX's CUDA quantized matmul has no kernel for (its CPU one copies it to
  rows), and a copy per step would move 3x the codes' bytes instead of 1x. So size a fused cache
  for the request, as `generate` sizes its cache and `measure.kv.decode_speed` does: a step costs
  max_size positions, not offset. MLX has no quantized kernel for symmetric codes or KIVI's
  per-channel key blocks, so those stay dequantized. `measure.kv.decode_speed` measures both
  paths against the float cache.

MLX's affine rule (mx.quantize) is not plain min/max: it snaps the group's edge of larger
magnitude to an exact code and rescales so that zero is a code, which can shorten the grid at
the far end. Its worst-case error is therefore (max - min) / 2^b per group, not the half step
(max - min) / (2 (2^b - 1)) of textbook affine quantization (tests/test_kvquant.py checks it).

`SCHEMES` is the one registry of cache names: FLOAT ("float", the static, pre-allocated KVCache),
kvcache's growing "chunked" and "concat" (`FLOATS`, the three float caches), and the quantized
schemes (`QUANTIZED`); `make_caches(scheme, ...)` builds one cache per layer for any of them, or for a
quantized family spelled out. `scheme_bytes` reads a scheme's bytes per token off real caches' `nbytes`;
`outlier_indices` is the chapter's rule for an outlier channel.

Shapes: keys and values are (B, n_kv_heads, L, head_dim). Scales and biases are stored in the
cache dtype (float16 on a GPU, float32 on the CPU), as mlx-lm does.

See chapter: kv-cache
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from functools import partial

import mlx.core as mx
import numpy as np

from ref_impl.engine.kvcache import Cache, ChunkedKVCache, ConcatKVCache, FloatCache, KVCache

FLOAT = "float"   # the scheme name of the unquantized static cache, kvcache.KVCache

# --- symmetric per-token codes: int8, or two 4-bit codes per byte -----------------------------

def quantize_symmetric(x: mx.array, bits: int, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
    """x (..., D) -> packed codes (..., D * bits / 8) uint8/int8 and scales (..., 1) in dtype."""
    qmax = 2 ** (bits - 1) - 1
    scale = (mx.abs(x).max(axis=-1, keepdims=True).astype(mx.float32) / qmax).astype(dtype)
    safe = mx.where(scale == 0, 1, scale).astype(mx.float32)   # an all-zero row gets codes 0
    q = mx.clip(mx.round(x.astype(mx.float32) / safe), -qmax, qmax).astype(mx.int8)
    if bits == 8:
        return q, scale
    u = (q + 8).astype(mx.uint8)                      # [-7, 7] -> [1, 15]: one nibble
    return u[..., 0::2] | (u[..., 1::2] << 4), scale  # even channel in the low nibble


def dequantize_symmetric(codes: mx.array, scale: mx.array, bits: int) -> mx.array:
    """The inverse of quantize_symmetric: codes * scale, in the scale's dtype."""
    if bits == 8:
        return codes.astype(scale.dtype) * scale
    lo, hi = (codes & 15).astype(mx.int8) - 8, (codes >> 4).astype(mx.int8) - 8
    q = mx.stack([lo, hi], axis=-1).reshape(*codes.shape[:-1], 2 * codes.shape[-1])   # (..., D)
    return q.astype(scale.dtype) * scale


# --- affine codes (mx.quantize): (codes, scales, biases) buffers -----------------------------------

def affine_buffers(lead: tuple, width: int, bits: int, group: int, dtype: mx.Dtype) -> list[mx.array]:
    """Empty (codes, scales, biases) for mx.quantize output over rows of `width` values."""
    return [mx.zeros(lead + (width * bits // 32,), dtype=mx.uint32),
            mx.zeros(lead + (width // group,), dtype=dtype), mx.zeros(lead + (width // group,), dtype=dtype)]


def write_affine(bufs: Sequence[mx.array], x: mx.array, start: int, end: int, group: int, bits: int) -> None:
    """mx.quantize rows x (B, H, end - start, ..., width) into slots start .. end-1 (axis 2) of bufs."""
    for buf, part in zip(bufs, mx.quantize(x, group, bits)):
        buf[:, :, start:end] = part


def read_affine(bufs: Sequence[mx.array], n: int, group: int, bits: int) -> mx.array:
    """Slots 0 .. n-1 (axis 2) of bufs dequantized, in the scales' dtype; also for n = 0."""
    codes, scales, biases = (b[:, :, :n] for b in bufs)
    if codes.size == 0:
        return mx.zeros(codes.shape[:-1] + (codes.shape[-1] * 32 // bits,), dtype=scales.dtype)
    return mx.dequantize(codes, scales, biases, group_size=group, bits=bits)


def check_affine(bits: int, group: int, width: int, what: str) -> None:
    """A ValueError unless mx.quantize takes `bits`-bit groups of `group` over rows of `width` values."""
    if bits not in (2, 3, 4, 5, 6, 8) or group not in (32, 64, 128) or width % group:
        raise ValueError(f"mx.quantize needs bits in 2..8, group 32/64/128 dividing {what} ({width}); "
                         f"got bits={bits}, group={group}")


# --- fused attention on affine codes ----------------------------------------------------------

FUSED_SLOTS = 32   # a fused cache allocates its slots in multiples of this (fused_slots)


def fused_slots(max_size: int) -> int:
    """The slots a fused cache allocates for max_size positions: max_size rounded up to a multiple of
    FUSED_SLOTS. The p.V product reduces over the slots, and MLX 0.32.4's CUDA quantized matmul hands its
    input to the GPU's tensor-memory accelerator, which needs rows of a multiple of 16 bytes: at 260
    float16 slots (520 bytes) it printed "Failed to initialize the TMA descriptor" thousands of times and
    decoded garbage (one H200, results/h200-20261201-184545-capstone.log). The extra slots are masked as
    every unfilled one is."""
    return -(-max_size // FUSED_SLOTS) * FUSED_SLOTS


@functools.lru_cache(maxsize=None)
def quantized_matmul_error(device: str, dtype: str, width: int, bits: int, group: int) -> float:
    """mx.quantized_matmul's q.K^T on `device` against the dequantized product, for rows of `width` values
    in `bits`-bit groups of `group`, on a fixed random probe: the largest error relative to the product's
    largest value (rounding gives ~1e-3 in float16). device and dtype by name, so a probe runs once each."""
    rng = np.random.default_rng(0)
    rows, keys = (mx.array(rng.standard_normal(shape).astype(np.float32)).astype(getattr(mx, dtype))
                  for shape in ((1, 1, 4, width), (1, 1, 16, width)))
    codes = mx.quantize(keys, group, bits)
    fused = mx.quantized_matmul(rows, *codes, transpose=True, group_size=group, bits=bits)
    dense = rows @ mx.dequantize(*codes, group_size=group, bits=bits).swapaxes(-1, -2)
    return float(mx.abs(fused - dense).max() / mx.abs(dense).max())


def check_fused(width: int, bits: int, group: int, dtype: mx.Dtype) -> None:
    """A ValueError unless mx.quantized_matmul on this device gives q.K^T for rows of `width` as the dequantized
    product does: MLX 0.32.4's CUDA kernel got rows of 64 wrong (errors ~20 where the product is ~10;
    results/h200-20261201-190000-fused_diagnosis.log; this check is that diagnosis's q.K^T half, run where
    it matters), so fused attention there would decode garbage."""
    device = str(mx.default_device())
    error = quantized_matmul_error(device, str(dtype).split(".")[-1], width, bits, group)
    if error > 0.05:
        raise ValueError(f"fused attention is wrong on {device}: mx.quantized_matmul's q.K^T for rows of {width} "
                         f"({bits}-bit, groups of {group}) is off the dequantized product by {error:.0%} of its "
                         f"largest value on a probe; use dequantized attention (no --kv-fused)")


def _mask_rows(mask, B: int, H: int, L: int, n: int, T: int, n_kv: int) -> mx.array | None:
    """`mask` (over the n filled keys) for scores laid out as `quantized_attention`'s rows, over all T
    key slots, the n .. T-1 past the filled part hidden: None, (1, T), (n_rep * L, T) or (B, n_kv, n_rep * L, T)."""
    if mask is None:
        return None if n == T else mx.arange(T)[None] < n
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"mask must be None, 'causal' or an array; got {mask!r}")
        causal = mx.arange(T)[None] <= mx.arange(n - L, n)[:, None]   # query l sees keys 0 .. n - L + l
        return mx.tile(causal, (H // n_kv, 1))
    hidden = False if mask.dtype == mx.bool_ else mx.finfo(mask.dtype).min
    mask = mx.pad(mx.broadcast_to(mask, (B, H, L, n)), [(0, 0)] * 3 + [(0, T - n)], constant_values=hidden)
    return mask.reshape(B, n_kv, H // n_kv * L, T)


def quantized_attention(q: mx.array, k_quant: Sequence[mx.array], v_quant: Sequence[mx.array], scale: float,
                        mask=None, group: int = 64, bits: int = 8,
                        k_float: tuple[mx.array, mx.array] | None = None, length: int | None = None) -> mx.array:
    """softmax(scale q.K^T + mask).V for q (B, H, L, D), read straight from affine codes: k_quant and
    v_quant are mx.quantize's (codes, scales, biases) of keys and values (B, n_kv_heads, T, D), of
    which the first `length` (default T) are filled; the queries are the last L of those.

    Grouped-query attention without repeating K/V: the n_rep = H / n_kv_heads query heads sharing a
    KV head (head h uses KV head h // n_rep, MLX's and Llama's order) are stacked as rows,
    (B, n_kv_heads, n_rep * L, D), so each head's codes are read once by `mx.quantized_matmul`.
    mask: None, "causal" (aligned with the last L keys, as in mx.fast.scaled_dot_product_attention),
    or a boolean (True attends) or additive array broadcastable to (B, H, L, length). k_float:
    optional (channels (n_kv_heads, n), keys (B, n_kv_heads, T, n)) of key channels held in float,
    whose slots in the codes are ignored (OutlierKVCache). The recipe is mlx-lm's
    `models/base.py: quantized_scaled_dot_product_attention`; the row layout and the slots past
    `length`, masked (gpt-fast's static-cache attention), are ours.
    """
    B, H, L, D = q.shape
    n_kv, T = k_quant[0].shape[1], k_quant[0].shape[2]
    length = T if length is None else length
    rows = (q * scale).reshape(B, n_kv, H // n_kv * L, D)                   # (B, Hkv, n_rep * L, D)
    if k_float is not None:
        channels, keys = k_float
        idx = mx.broadcast_to(channels[None, :, None, :], rows.shape[:3] + channels.shape[-1:])
        extra = mx.take_along_axis(rows, idx, axis=-1) @ keys.astype(rows.dtype).swapaxes(-1, -2)
        rows = mx.put_along_axis(rows, idx, mx.array(0, rows.dtype), axis=-1)
    scores = mx.quantized_matmul(rows, *k_quant, transpose=True, group_size=group, bits=bits)   # (B, Hkv, R, T)
    if k_float is not None:
        scores = scores + extra
    mask = _mask_rows(mask, B, H, L, length, T, n_kv)
    if mask is not None:
        scores = mx.where(mask, scores, mx.finfo(scores.dtype).min) if mask.dtype == mx.bool_ else scores + mask
    probs = mx.softmax(scores, axis=-1, precise=True)
    out = mx.quantized_matmul(probs, *v_quant, transpose=False, group_size=group, bits=bits)
    return out.reshape(B, H, L, D)


# --- the caches -----------------------------------------------------------------------------------

class SymmetricKVCache(Cache):
    """Per-token symmetric int8 or int4 keys and values (one scale per token and head)."""

    def __init__(self, batch: int, n_kv_heads: int, head_dim: int, max_size: int,
                 dtype: mx.Dtype = mx.float32, bits: int = 8):
        super().__init__(batch, n_kv_heads, head_dim, max_size, dtype)
        if bits not in (4, 8) or head_dim % 2:
            raise ValueError(f"symmetric caches store 8 or 4 bits (even head_dim); got bits={bits}")
        self.bits = bits
        lead = (batch, n_kv_heads, max_size)
        code = mx.int8 if bits == 8 else mx.uint8
        self.k_codes, self.v_codes = (mx.zeros(lead + (head_dim * bits // 8,), dtype=code) for _ in range(2))
        self.k_scales, self.v_scales = (mx.zeros(lead + (1,), dtype=dtype) for _ in range(2))

    def update_and_fetch(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        """Quantize k, v (B, H, L, D) into the next L slots; return the dequantized history."""
        end = self.reserve(k, v)
        for x, codes, scales in ((k, self.k_codes, self.k_scales), (v, self.v_codes, self.v_scales)):
            q, s = quantize_symmetric(x, self.bits, self.dtype)
            codes[:, :, self.offset:end, :] = q
            scales[:, :, self.offset:end, :] = s
        self.offset = end
        return self.state

    @property
    def state(self) -> tuple[mx.array, mx.array]:
        """The dequantized filled part: (keys, values), each (B, H, offset, D)."""
        n = self.offset
        return (dequantize_symmetric(self.k_codes[:, :, :n], self.k_scales[:, :, :n], self.bits),
                dequantize_symmetric(self.v_codes[:, :, :n], self.v_scales[:, :, :n], self.bits))

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.k_codes, self.v_codes, self.k_scales, self.v_scales))


class AffineKVCache(Cache):
    """Per-token affine groups of `group` channels (mx.quantize), keys and values alike.

    fused=True sets attends = "fused": model.Attention calls `attend`, attention on the packed codes,
    instead of `update_and_fetch` and attention on the dequantized history (see the module docstring)."""

    def __init__(self, batch: int, n_kv_heads: int, head_dim: int, max_size: int,
                 dtype: mx.Dtype = mx.float32, bits: int = 8, group: int = 64, fused: bool = False):
        super().__init__(batch, n_kv_heads, head_dim, max_size, dtype)
        check_affine(bits, group, head_dim, "head_dim")
        self.bits, self.group = bits, group
        self.attends = "fused" if fused else "dense"
        if fused:
            check_fused(head_dim, bits, group, dtype)
            self.max_size = fused_slots(max_size)
        lead = (batch, n_kv_heads, self.max_size)
        self.k_quant = affine_buffers(lead, head_dim, bits, group, dtype)   # codes, scales, biases
        self.v_quant = affine_buffers(lead, head_dim, bits, group, dtype)

    def store(self, k: mx.array, v: mx.array) -> None:
        """Quantize k, v (B, H, L, D) into the next L slots and advance the offset."""
        end = self.reserve(k, v)
        write_affine(self.k_quant, k.astype(self.dtype), self.offset, end, self.group, self.bits)
        write_affine(self.v_quant, v.astype(self.dtype), self.offset, end, self.group, self.bits)
        self.offset = end

    def update_and_fetch(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        """Quantize k, v (B, H, L, D) into the next L slots; return the dequantized history."""
        self.store(k, v)
        return self.state

    def attend(self, q: mx.array, k: mx.array, v: mx.array, scale: float, mask=None) -> mx.array:
        """Store k, v (B, Hkv, L, D) as update_and_fetch does, then attention of q (B, H, L, D) over the
        whole history on the packed codes (`quantized_attention`): (B, H, L, D). It reads all max_size
        slots, the unfilled ones masked (see the module docstring)."""
        self.store(k, v)
        return quantized_attention(q, self.k_quant, self.v_quant, scale, mask, self.group, self.bits,
                                   length=self.offset)

    @property
    def state(self) -> tuple[mx.array, mx.array]:
        """The dequantized filled part: (keys, values), each (B, H, offset, D)."""
        return (read_affine(self.k_quant, self.offset, self.group, self.bits),
                read_affine(self.v_quant, self.offset, self.group, self.bits))

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k_quant + self.v_quant)


class KIVIKVCache(Cache):
    """KIVI: keys per channel over blocks of `group` tokens, values per token, recent tokens in float.

    The rule, with n = offset, G = group, R = window:
      keys   0 .. qk-1 quantized, qk = G * floor(max(n - R, 0) / G): a block of G tokens is
             quantized per channel (one scale and bias per channel and block) once all of it
             is at least R tokens old; the rest (the partial block and the window, < R + G
             tokens) stays in float;
      values 0 .. qv-1 quantized per token (groups of G channels), qv = max(n - R, 0); the
             last R tokens stay in float.
    Trimming into the quantized part keeps the quantized values quantized; the key block the new
    end falls into is dequantized back into the float window (keys that are then re-quantized
    with a later block pick up a second rounding). `state` is unchanged by the trim but for its end.
    """

    # when a block is quantized depends on the end of the forward that crossed it: a verification of
    # γ+1 positions quantizes earlier than decoding them one by one, and a trim back re-rounds a block
    rewinds_exactly = False

    def __init__(self, batch: int, n_kv_heads: int, head_dim: int, max_size: int,
                 dtype: mx.Dtype = mx.float32, bits: int = 4, group: int = 32, window: int = 32):
        super().__init__(batch, n_kv_heads, head_dim, max_size, dtype)
        check_affine(bits, group, head_dim, "head_dim")
        if window < 0:
            raise ValueError(f"window must be >= 0, got {window}")
        self.bits, self.group, self.window = bits, group, window
        B, H, D = batch, n_kv_heads, head_dim
        # keys: (B, H, block, D, G) per-channel rows, quantized along their G tokens
        self.k_quant = affine_buffers((B, H, max_size // group, D), group, bits, group, dtype)
        self.v_quant = affine_buffers((B, H, max_size), D, bits, group, dtype)
        self.k_float = mx.zeros((B, H, window + group, D), dtype=dtype)   # positions qk .. offset-1
        self.v_float = mx.zeros((B, H, window, D), dtype=dtype)           # positions qv .. offset-1
        self.qk = self.qv = 0

    def quantize_keys(self, x: mx.array, start: int) -> None:
        """Quantize whole blocks x (B, H, nG, D) per channel into blocks start/G onward."""
        B, H, L, D = x.shape
        G = self.group
        rows = x.reshape(B, H, L // G, G, D).transpose(0, 1, 2, 4, 3)   # (B, H, blocks, D, G)
        write_affine(self.k_quant, rows.astype(self.dtype), start // G, (start + L) // G, G, self.bits)

    def dequantize_keys(self, n: int) -> mx.array:
        """Keys 0 .. n-1 (n a multiple of group) back as (B, H, n, D)."""
        rows = read_affine(self.k_quant, n // self.group, self.group, self.bits)   # (B, H, blocks, D, G)
        B, H, _, D, _ = rows.shape
        return rows.transpose(0, 1, 2, 4, 3).reshape(B, H, n, D)

    def update_and_fetch(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        """Store k, v (B, H, L, D); quantize what left the float window; return the dequantized history."""
        end = self.reserve(k, v)
        G, R = self.group, self.window
        fk = mx.concatenate([self.k_float[:, :, :self.offset - self.qk], k.astype(self.dtype)], axis=2)
        fv = mx.concatenate([self.v_float[:, :, :self.offset - self.qv], v.astype(self.dtype)], axis=2)
        qk = max(G * (max(end - R, 0) // G), self.qk)
        if qk > self.qk:
            self.quantize_keys(fk[:, :, :qk - self.qk], self.qk)
        qv = max(end - R, self.qv)
        if qv > self.qv:
            write_affine(self.v_quant, fv[:, :, :qv - self.qv], self.qv, qv, G, self.bits)
        if end > qk:
            self.k_float[:, :, :end - qk] = fk[:, :, qk - self.qk:]
        if end > qv:
            self.v_float[:, :, :end - qv] = fv[:, :, qv - self.qv:]
        self.qk, self.qv, self.offset = qk, qv, end
        return self.state

    def trim(self, n: int) -> int:
        """Forget the last n positions (see the class docstring for trims into the quantized part)."""
        n = max(0, min(self.offset, n))
        end = self.offset - n
        if end < self.qk:   # dequantize the block the new end falls in back into the float window
            qk = self.group * (end // self.group)
            self.k_float[:, :, :end - qk] = self.dequantize_keys(qk + self.group)[:, :, qk:end]
            self.qk = qk
        self.qv = min(self.qv, end)
        self.offset = end
        return n

    @property
    def state(self) -> tuple[mx.array, mx.array]:
        """The dequantized filled part: (keys, values), each (B, H, offset, D)."""
        n = self.offset
        keys = mx.concatenate([self.dequantize_keys(self.qk), self.k_float[:, :, :n - self.qk]], axis=2)
        vq = read_affine(self.v_quant, self.qv, self.group, self.bits)
        return keys, mx.concatenate([vq, self.v_float[:, :, :n - self.qv]], axis=2)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k_quant + self.v_quant + [self.k_float, self.v_float])


class OutlierKVCache(Cache):
    """Keys: `n_outliers` channels per KV head in float16, the rest `bits`-bit affine per token;
    values: `bits`-bit affine per token. Both in groups of `group` channels; `fused` as AffineKVCache's.

    The outlier channels are the n_outliers largest max|k| channels of each head in the keys given
    to `calibrate`; if it was not called, the first `update_and_fetch` (the prompt's prefill)
    calibrates on its own keys. The dense codes keep a slot for each outlier channel, set to 0
    before quantizing, so the group layout stays mx.quantize's. Float16, not 8-bit float: MLX's
    `mx.to_fp8` (e4m3) saturates at 448 and keeps 3 mantissa bits, poor for the largest channels.
    """

    def __init__(self, batch: int, n_kv_heads: int, head_dim: int, max_size: int,
                 dtype: mx.Dtype = mx.float32, bits: int = 4, group: int = 32, n_outliers: int = 4,
                 fused: bool = False):
        if not 0 < n_outliers < head_dim:
            raise ValueError(f"n_outliers must be in 1..head_dim-1, got {n_outliers}")
        super().__init__(batch, n_kv_heads, head_dim, max_size, dtype)
        check_affine(bits, group, head_dim, "head_dim")
        self.bits, self.group, self.n_outliers = bits, group, n_outliers
        self.attends = "fused" if fused else "dense"
        if fused:
            check_fused(head_dim, bits, group, dtype)
            self.max_size = fused_slots(max_size)
        lead = (batch, n_kv_heads, self.max_size)
        self.k_quant = affine_buffers(lead, head_dim, bits, group, dtype)   # codes, scales, biases
        self.v_quant = affine_buffers(lead, head_dim, bits, group, dtype)
        self.k_outliers = mx.zeros(lead + (n_outliers,), dtype=mx.float16)
        self.channels = mx.zeros((n_kv_heads, n_outliers), dtype=mx.int32)   # per head, ascending
        self.calibrated = False

    def calibrate(self, keys: mx.array) -> None:
        """Pick each head's n_outliers channels of largest max|k| over keys (B, H, L, D)."""
        magnitude = mx.abs(keys.astype(mx.float32)).max(axis=(0, 2))   # (H, D)
        top = mx.argsort(-magnitude, axis=-1)[:, :self.n_outliers]
        self.channels = mx.sort(top, axis=-1).astype(mx.int32)
        self.calibrated = True

    def index(self, x: mx.array) -> mx.array:
        """The outlier channels' indices broadcast over x (B, H, L, D): (B, H, L, n_outliers)."""
        B, H, L, _ = x.shape
        return mx.broadcast_to(self.channels[None, :, None, :], (B, H, L, self.n_outliers))

    def store(self, k: mx.array, v: mx.array) -> None:
        """The outlier channels of k (B, H, L, D) into k_outliers, the rest (outlier slots 0) and v as
        codes, in the next L slots; advance the offset."""
        end = self.reserve(k, v)
        if not self.calibrated:
            self.calibrate(k)
        idx = self.index(k)
        self.k_outliers[:, :, self.offset:end] = mx.take_along_axis(k, idx, axis=-1).astype(mx.float16)
        dense = mx.put_along_axis(k.astype(self.dtype), idx, mx.array(0, self.dtype), axis=-1)
        write_affine(self.k_quant, dense, self.offset, end, self.group, self.bits)
        write_affine(self.v_quant, v.astype(self.dtype), self.offset, end, self.group, self.bits)
        self.offset = end

    def update_and_fetch(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        """Store k, v (B, H, L, D) in the next L slots; return the dequantized history."""
        self.store(k, v)
        return self.state

    def attend(self, q: mx.array, k: mx.array, v: mx.array, scale: float, mask=None) -> mx.array:
        """AffineKVCache.attend, plus the float16 outlier channels' share of q.K^T."""
        self.store(k, v)
        return quantized_attention(q, self.k_quant, self.v_quant, scale, mask, self.group, self.bits,
                                   (self.channels, self.k_outliers), self.offset)

    @property
    def state(self) -> tuple[mx.array, mx.array]:
        """The dequantized filled part: (keys, values), each (B, H, offset, D)."""
        dense = read_affine(self.k_quant, self.offset, self.group, self.bits)
        values = read_affine(self.v_quant, self.offset, self.group, self.bits)
        outliers = self.k_outliers[:, :, :self.offset].astype(self.dtype)
        return mx.put_along_axis(dense, self.index(dense), outliers, axis=-1), values

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k_quant + self.v_quant + [self.k_outliers, self.channels])


# --- the scheme names, and the one builder ----------------------------------------------------------

SCHEMES = {   # every cache by its one name: the float caches, then the quantized schemes
    FLOAT: KVCache,
    "chunked": ChunkedKVCache,
    "concat": ConcatKVCache,
    "sym8": partial(SymmetricKVCache, bits=8),
    "sym4": partial(SymmetricKVCache, bits=4),
    "affine8-g64": partial(AffineKVCache, bits=8, group=64),
    "affine8-g32": partial(AffineKVCache, bits=8, group=32),
    "affine4-g64": partial(AffineKVCache, bits=4, group=64),
    "affine4-g32": partial(AffineKVCache, bits=4, group=32),
    "kivi4": partial(KIVIKVCache, bits=4, group=32, window=32),
    "kivi2": partial(KIVIKVCache, bits=2, group=32, window=32),
    "outlier4": partial(OutlierKVCache, bits=4, group=32, n_outliers=4),
}

# the schemes whose attention can run on the codes (fused=True): mx.quantized_matmul reads affine codes only
FUSED_CLASSES = (AffineKVCache, OutlierKVCache)
FUSED = tuple(name for name, make in SCHEMES.items() if getattr(make, "func", make) in FUSED_CLASSES)
FLOATS = tuple(name for name, make in SCHEMES.items() if issubclass(getattr(make, "func", make), FloatCache))
QUANTIZED = tuple(name for name in SCHEMES if name not in FLOATS)

# a quantized family with its sizes spelled out: bits, then -g<group> and (kivi) -w<window>
FAMILIES = {"sym": SymmetricKVCache, "affine": AffineKVCache, "kivi": KIVIKVCache, "outlier": OutlierKVCache}
SPELLED = re.compile(r"(sym|affine|kivi|outlier)(\d+)(?:-g(\d+))?(?:-w(\d+))?")


def resolve(scheme: str) -> Callable[..., Cache]:
    """The cache class of a scheme name, its sizes bound: a key of SCHEMES, or a quantized family
    spelled out (`affine4` is 4-bit affine groups of the class's default 64 channels, `affine4-g128`
    groups of 128, `kivi2-g64-w128` a 128-token float window, `sym4`). A ValueError names what is wrong."""
    if scheme in SCHEMES:
        return SCHEMES[scheme]
    m = SPELLED.fullmatch(scheme)
    if m is None:
        raise ValueError(f"unknown KV-cache scheme {scheme!r}; have {', '.join(SCHEMES)}, or a family with its "
                         f"sizes: sym<bits>, affine<bits>[-g<group>], outlier<bits>[-g<group>], "
                         f"kivi<bits>[-g<group>][-w<window>]")
    family, bits, group, window = m.groups()
    if family == "sym" and group or family != "kivi" and window:
        raise ValueError(f"{scheme!r}: {family} caches take no {'group' if group else 'window'} "
                         f"(only kivi has a float window; sym scales whole tokens)")
    sizes = {"bits": bits, "group": group, "window": window}
    return partial(FAMILIES[family], **{k: int(v) for k, v in sizes.items() if v})


def cache_class(scheme: str) -> type[Cache]:
    """The class of cache a scheme name builds (resolve's, unbound)."""
    make = resolve(scheme)
    return getattr(make, "func", make)


def make_caches(scheme: str, n_layers: int, batch: int, n_kv_heads: int, head_dim: int, max_size: int,
                dtype: mx.Dtype = mx.float32, **params) -> list[Cache]:
    """One cache of `scheme` (a name `resolve` takes: a key of SCHEMES, or a quantized family spelled out)
    per layer, each for up to max_size positions; params
    override the scheme's bits/group/window/... (chunked: step). `fused=True` (affine and outlier
    schemes) makes attention run on the packed codes; fused=False is accepted by every scheme.

    Example: `make_caches("kivi2", a.num_hidden_layers, 1, a.num_key_value_heads, a.head_dim, 512,
    window=64)`; `Model.make_cache(max_size, batch, scheme, **params)` fills in the model's shape.
    """
    make = resolve(scheme)
    fused = params.pop("fused", False)
    if make is KVCache and (fused or params):
        raise ValueError(f"the float cache takes no parameters; got {params or 'fused=True'}")
    if fused:
        if cache_class(scheme) not in FUSED_CLASSES:
            raise ValueError(f"{scheme} has no fused attention path (mx.quantized_matmul reads affine codes "
                             f"only); fused schemes: {', '.join(FUSED)} and any affine or outlier family")
        params["fused"] = True
    return [make(batch, n_kv_heads, head_dim, max_size, dtype, **params) for _ in range(n_layers)]


def scheme_bytes(scheme: str, n_kv_heads: int, head_dim: int, dtype: mx.Dtype = mx.float16,
                 sizes: tuple[int, int] = (256, 512), **params) -> tuple[float, float]:
    """(bytes per token, fixed bytes) of one layer's cache, read off `nbytes` of a batch-1 cache of
    the scheme built at two max_size values: no formula of its own, so it cannot drift from the caches."""
    a, b = (make_caches(scheme, 1, 1, n_kv_heads, head_dim, s, dtype, **params)[0].nbytes for s in sizes)
    per_token = (b - a) / (sizes[1] - sizes[0])
    return per_token, a - per_token * sizes[0]


# --- outlier channels: the chapter's rule ---------------------------------------------------------

def outlier_indices(magnitude: np.ndarray, factor: float) -> np.ndarray:
    """Indices of the channels whose magnitude (one value per channel, (C,)) exceeds factor times
    the median channel's: the outlier rule used throughout the chapter."""
    magnitude = np.asarray(magnitude, dtype=np.float64)
    if magnitude.ndim != 1 or magnitude.size == 0:
        raise ValueError(f"expected one magnitude per channel (a non-empty 1-D array), got shape {magnitude.shape}")
    return np.flatnonzero(magnitude > factor * np.median(magnitude))


def outlier_channels(mags: dict, factor: float, which: str = "keys_pre_rope", stat: str = "mean") -> list[int]:
    """Per layer, how many channels (over all KV heads) are outliers (`outlier_indices`) by
    mags[which][stat], mags as measure.kv.key_value_magnitudes returns them: (n_layers, n_kv_heads, head_dim)."""
    m = mags[which][stat]
    return [len(outlier_indices(row, factor)) for row in m.reshape(m.shape[0], -1)]
