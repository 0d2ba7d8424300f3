"""Block quantization in the GGML formats, bit-exact with llama.cpp's reference C code.

Q8_0 cuts each row into blocks of 32 values and stores every block as 34 bytes: one fp16 scale d,
then 32 int8 quants q, so that x ~ d * q. With d = max|x| / 127 the largest value maps to +-127.

    block_q8_0 = { d: fp16, qs: int8[32] }      # ggml-common.h
    quantize:    d = amax / 127;  id = 1/d (0 when d == 0);  q = roundf(x * id)
    dequantize:  x = q * d

All arithmetic is float32 as in ggml-quants.c `quantize_row_q8_0_ref`, and `roundf` rounds halves
away from zero (numpy's `round` rounds them to even, which would differ on exact .5 products).
Inputs whose max|x| is below ~3.7e-37 make 1/d overflow to inf; llama.cpp's result is undefined there.

Dequantization also covers Q4_0, Q5_0, Q4_K and Q6_K (the types of a llama.cpp Q4_K_M file), so the
decoder can run such files by expanding them to floats; their quantizers arrive with the K-quants
chapter.

    block_q4_0 = { d: fp16, qs: uint8[16] }                                  # 32 values, 18 bytes
        x[i] = (q[i] - 8) * d, q[i] the low nibbles of qs for i < 16, the high ones for i >= 16
    block_q5_0 = { d: fp16, qh: uint32, qs: uint8[16] }                      # 32 values, 22 bytes
        as Q4_0 with a 5th bit per value from qh, centred on 16
    block_q4_K = { d: fp16, dmin: fp16, scales: uint8[12], qs: uint8[128] }  # 256 values, 144 bytes
        8 sub-blocks of 32 with 6-bit scale sc[j] and min m[j]:  x = d * sc[j] * q - dmin * m[j]
    block_q6_K = { ql: uint8[128], qh: uint8[64], scales: int8[16], d: fp16 } # 256 values, 210 bytes
        16 sub-blocks of 16 with int8 scale s[j]; q = 4 low bits + 2 high bits - 32:  x = d * s[j] * q

See chapter: k-quants
"""

from __future__ import annotations

import numpy as np

QK8_0 = 32          # values per Q8_0 block
BLOCK_BYTES_Q8_0 = 34  # 2-byte fp16 scale + 32 int8 quants


def _roundf(x: np.ndarray) -> np.ndarray:
    """C roundf: halves away from zero. Done in float64, where x + 0.5 is exact for float32 x."""
    x = x.astype(np.float64)
    return np.trunc(x + np.copysign(0.5, x))


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """Quantize float32 `x` of shape (..., n), n a multiple of 32, to uint8 blocks of shape (..., n // 32 * 34)."""
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 0 or x.shape[-1] == 0 or x.shape[-1] % QK8_0:
        raise ValueError(f"Q8_0 needs a last dimension that is a positive multiple of {QK8_0}, got shape {x.shape}")
    blocks = x.reshape(-1, QK8_0)                             # (n_blocks, 32)
    d = np.abs(blocks).max(axis=1) / np.float32(127)          # (n_blocks,) float32
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        inv_d = np.where(d != 0, np.float32(1) / d, np.float32(0))
        q = _roundf(blocks * inv_d[:, None]).astype(np.int8)  # float32 product, then roundf
        d16 = d.astype("<f2")                                 # round to nearest even, like GGML_FP32_TO_FP16
    out = np.empty((blocks.shape[0], BLOCK_BYTES_Q8_0), dtype=np.uint8)
    out[:, :2] = d16.view(np.uint8).reshape(-1, 2)
    out[:, 2:] = q.view(np.uint8)
    return out.reshape(*x.shape[:-1], x.shape[-1] // QK8_0 * BLOCK_BYTES_Q8_0)


def _blocks(data: np.ndarray, name: str, block_bytes: int) -> np.ndarray:
    """Check uint8 rows of whole blocks, shape (..., row_bytes); return them as (n_blocks, block_bytes)."""
    data = np.asarray(data)
    if data.dtype != np.uint8 or data.ndim == 0 or data.shape[-1] % block_bytes:
        raise ValueError(f"{name} data must be uint8 with a last dimension that is a multiple of "
                         f"{block_bytes}, got {data.dtype} of shape {data.shape}")
    return data.reshape(-1, block_bytes)


def _rows(values: np.ndarray, data: np.ndarray, block_bytes: int, block_values: int) -> np.ndarray:
    """Reshape per-block values (n_blocks, block_values) back to the rows of `data`."""
    return values.reshape(*data.shape[:-1], data.shape[-1] // block_bytes * block_values)


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes per row (n, 2) as a float32 column (n, 1)."""
    return np.ascontiguousarray(b).view("<f2").astype(np.float32)


def dequantize_q8_0(blocks: np.ndarray) -> np.ndarray:
    """Expand uint8 Q8_0 blocks of shape (..., row_bytes), row_bytes a multiple of 34, to float32 (..., n)."""
    b = _blocks(blocks, "Q8_0", BLOCK_BYTES_Q8_0)              # (n_blocks, 34)
    q = b[:, 2:].view(np.int8).astype(np.float32)             # (n_blocks, 32)
    with np.errstate(invalid="ignore"):                       # an inf scale times q = 0 is nan, as in C
        return _rows(q * _f16(b[:, :2]), blocks, BLOCK_BYTES_Q8_0, QK8_0)


def dequantize_q4_0(blocks: np.ndarray) -> np.ndarray:
    """Expand uint8 Q4_0 blocks (..., row_bytes), 18 bytes per 32 values, to float32 (..., n)."""
    b = _blocks(blocks, "Q4_0", 18)
    qs = b[:, 2:]                                             # (n_blocks, 16): two 4-bit quants a byte
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32) - 8   # low nibbles first
    with np.errstate(invalid="ignore"):
        return _rows(q * _f16(b[:, :2]), blocks, 18, 32)


def dequantize_q5_0(blocks: np.ndarray) -> np.ndarray:
    """Expand uint8 Q5_0 blocks (..., row_bytes), 22 bytes per 32 values, to float32 (..., n).

    llama.cpp falls back to Q5_0 where a Q4_K_M tensor's rows are not a multiple of 256."""
    b = _blocks(blocks, "Q5_0", 22)
    high = np.ascontiguousarray(b[:, 2:6]).view("<u4")          # (n, 1): bit i is value i's 5th bit
    qs = b[:, 6:]
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.uint32)
    q = (low | (((high >> np.arange(32, dtype=np.uint32)) & 1) << 4)).astype(np.float32) - 16
    with np.errstate(invalid="ignore"):
        return _rows(q * _f16(b[:, :2]), blocks, 22, 32)


def unpack_scales_q4_k(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 packed bytes of a Q4_K block (n, 12) -> 6-bit scales and mins, each (n, 8).

    Bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3; the top 2 bits of those
    8 bytes, with the nibbles of bytes 8-11, make scales and mins 4-7 (ggml-quants.c get_scale_min_k4).
    """
    s = scales.astype(np.uint8)
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([lo & 63, (hi & 0x0F) | ((lo >> 6) << 4)], axis=1)
    mn = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=1)
    return sc, mn


def dequantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    """Expand uint8 Q4_K super-blocks (..., row_bytes), 144 bytes per 256 values, to float32 (..., n)."""
    b = _blocks(blocks, "Q4_K", 144)
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])                # (n, 1) each
    sc, mn = unpack_scales_q4_k(b[:, 4:16])                   # (n, 8) each
    qs = b[:, 16:].reshape(-1, 4, 32)                         # 4 chunks of 32 bytes
    # each chunk holds two sub-blocks: its low nibbles, then its high nibbles
    q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32).astype(np.float32)
    scale = (d * sc.astype(np.float32))[:, :, None]
    offset = (dmin * mn.astype(np.float32))[:, :, None]
    with np.errstate(invalid="ignore"):
        return _rows((scale * q - offset).reshape(-1, 256), blocks, 144, 256)


def dequantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    """Expand uint8 Q6_K super-blocks (..., row_bytes), 210 bytes per 256 values, to float32 (..., n)."""
    b = _blocks(blocks, "Q6_K", 210)
    ql = b[:, 0:128].reshape(-1, 2, 64)                       # two halves of 128 values
    qh = b[:, 128:192].reshape(-1, 2, 32)
    scales = b[:, 192:208].view(np.int8).astype(np.float32)   # (n, 16)
    d = _f16(b[:, 208:210])
    # in each half, value l + 32*k takes 4 low bits from ql and 2 high bits from qh (l < 32, k < 4)
    low = np.stack([ql[:, :, :32] & 0x0F, ql[:, :, 32:] & 0x0F, ql[:, :, :32] >> 4, ql[:, :, 32:] >> 4], axis=2)
    high = np.stack([(qh >> (2 * k)) & 3 for k in range(4)], axis=2)
    q = (low | (high << 4)).astype(np.float32) - 32           # (n, 2, 4, 32)
    s = scales.reshape(-1, 2, 4, 2)                           # one scale per 16 values
    with np.errstate(invalid="ignore"):
        x = d[:, :, None, None] * np.repeat(s, 16, axis=3) * q
    return _rows(x.reshape(-1, 256), blocks, 210, 256)


# GGML type name -> dequantizer, for gguf.GGUFFile.dequantize
DEQUANTIZE = {"Q8_0": dequantize_q8_0, "Q4_0": dequantize_q4_0, "Q5_0": dequantize_q5_0,
              "Q4_K": dequantize_q4_k, "Q6_K": dequantize_q6_k}
