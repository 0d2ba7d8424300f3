"""The 4-bit i-quants, IQ4_NL and IQ4_XS: codes that index a table of levels instead of being the levels.

Every other GGML format decodes a code q as an evenly spaced level, x = d * q (+ an offset). The
"i-quants" (llama.cpp's IQ types, IQ1_S to IQ4_XS) drop the even spacing. The two 4-bit ones keep one
code per weight but look it up in a fixed non-linear table of 16 integers,

    kvalues_iq4nl = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]

whose levels crowd near zero and spread out in the tails, where trained weights are rare: the same
16 levels waste less of their range on a bell-shaped block than Q4_0's even ones. The table is
asymmetric (-127 to 113, no exact zero) and one scale is all a block needs: x = d * kvalues_iq4nl[q].

    block_iq4_nl = { d: fp16, qs: uint8[16] }                                     # 32 values, 18 bytes
        x[i] = d * kvalues_iq4nl[q[i]], q[i] the low nibbles of qs for i < 16, the high ones for i >= 16
    block_iq4_xs = { d: fp16, scales_h: uint16, scales_l: uint8[4], qs: uint8[128] }   # 256 values, 136 bytes
        8 sub-blocks of 32, each laid out as one IQ4_NL block's 16 bytes, with a 6-bit scale
        ls[j] = (nibble j of scales_l, low nibble first) | (bits 2j, 2j+1 of scales_h) << 4:
        x = d * (ls[j] - 32) * kvalues_iq4nl[q]

IQ4_XS is IQ4_NL's super-block form, as Q4_K is Q4_0's: instead of an fp16 scale per 32 values
(0.5 bits per weight) a super-block of 256 has one fp16 d and a 6-bit signed scale per sub-block,
4.25 bits per weight against IQ4_NL's 4.5. All arithmetic is float32 in the C source's order,
d * (ls - 32) first, so the floats are bit for bit llama.cpp's.

References: llama.cpp ggml/src/ggml-common.h (block_iq4_nl, block_iq4_xs, kvalues_iq4nl) and
ggml/src/ggml-quants.c (`dequantize_row_iq4_nl`, `dequantize_row_iq4_xs`).
See chapter: kquants
"""

from __future__ import annotations

import numpy as np

from ref_impl.formats.kquants import as_rows, check_blocks, f16_column

# The 16 levels of IQ4_NL and IQ4_XS, indexed by the 4-bit code (ggml-common.h kvalues_iq4nl).
KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
_LEVELS = KVALUES_IQ4NL.astype(np.float32)


def codes_iq4(qs: np.ndarray) -> np.ndarray:
    """Bytes (..., 16) of one 32-value (sub-)block -> its 4-bit codes (..., 32) in value order, low nibbles first."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _levels(qs: np.ndarray) -> np.ndarray:
    """Bytes (..., 16) of 32 codes -> their table levels as float32 (..., 32)."""
    return _LEVELS[codes_iq4(qs)]


def unpack_scales_iq4_xs(b: np.ndarray) -> np.ndarray:
    """IQ4_XS super-blocks (n, 136) -> the 8 sub-block scales ls[j] - 32 (n, 8), int16 in -32..31."""
    scales_h = np.ascontiguousarray(b[:, 2:4]).view("<u2")               # (n, 1)
    low = np.stack([b[:, 4:8] & 0x0F, b[:, 4:8] >> 4], axis=2).reshape(-1, 8)   # j even: low nibble
    high = (scales_h >> np.arange(0, 16, 2, dtype=np.uint16)) & 3          # (n, 8)
    return (low | (high << 4)).astype(np.int16) - 32


def dequantize_iq4_nl(blocks: np.ndarray) -> np.ndarray:
    """Expand uint8 IQ4_NL blocks (..., row_bytes), 18 bytes per 32 values, to float32 (..., n)."""
    b = check_blocks(blocks, "IQ4_NL", 18)
    with np.errstate(invalid="ignore"):                       # a signalling-nan fp16 d gives nan, as in C
        return as_rows(f16_column(b[:, 0:2]) * _levels(b[:, 2:]), blocks, 18, 32)


def dequantize_iq4_xs(blocks: np.ndarray) -> np.ndarray:
    """Expand uint8 IQ4_XS super-blocks (..., row_bytes), 136 bytes per 256 values, to float32 (..., n)."""
    b = check_blocks(blocks, "IQ4_XS", 136)
    levels = _levels(b[:, 8:].reshape(-1, 8, 16))                        # (n, 8, 32)
    with np.errstate(invalid="ignore"):                       # an inf d times ls - 32 = 0 is nan, as in C
        dl = f16_column(b[:, 0:2]) * unpack_scales_iq4_xs(b).astype(np.float32)   # (n, 8): d * (ls - 32) first
        return as_rows((dl[:, :, None] * levels).reshape(-1, 256), blocks, 136, 256)


# GGML type name -> dequantizer; gguf.DEQUANTIZE joins it to kquants.DEQUANTIZE
DEQUANTIZE = {"IQ4_NL": dequantize_iq4_nl, "IQ4_XS": dequantize_iq4_xs}
