"""Block quantization in the GGML formats, bit-exact with llama.cpp's reference C code.

Q8_0 cuts each row into blocks of 32 values and stores every block as 34 bytes: one fp16 scale d,
then 32 int8 quants q, so that x ~ d * q. With d = max|x| / 127 the largest value maps to +-127.

    block_q8_0 = { d: fp16, qs: int8[32] }      # ggml-common.h
    quantize:    d = amax / 127;  id = 1/d (0 when d == 0);  q = roundf(x * id)
    dequantize:  x = q * d

All arithmetic is float32 as in ggml-quants.c `quantize_row_q8_0_ref`, and `roundf` rounds halves
away from zero (numpy's `round` rounds them to even, which would differ on exact .5 products).
Inputs whose max|x| is below ~3.7e-37 make 1/d overflow to inf; llama.cpp's result is undefined there.

The K-quants (Q4_0, Q4_K, Q6_K) arrive in their own issue.
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


def dequantize_q8_0(blocks: np.ndarray) -> np.ndarray:
    """Expand uint8 Q8_0 blocks of shape (..., row_bytes), row_bytes a multiple of 34, to float32 (..., n)."""
    blocks = np.asarray(blocks)
    if blocks.dtype != np.uint8 or blocks.ndim == 0 or blocks.shape[-1] % BLOCK_BYTES_Q8_0:
        raise ValueError(f"Q8_0 data must be uint8 with a last dimension that is a multiple of "
                         f"{BLOCK_BYTES_Q8_0}, got {blocks.dtype} of shape {blocks.shape}")
    b = blocks.reshape(-1, BLOCK_BYTES_Q8_0)                   # (n_blocks, 34)
    d = b[:, :2].view("<f2").astype(np.float32)               # (n_blocks, 1)
    q = b[:, 2:].view(np.int8).astype(np.float32)             # (n_blocks, 32)
    with np.errstate(invalid="ignore"):                       # an inf scale times q = 0 is nan, as in C
        return (q * d).reshape(*blocks.shape[:-1], blocks.shape[-1] // BLOCK_BYTES_Q8_0 * QK8_0)
