"""The ggml tensor types: their ids, their block sizes, and the bytes a tensor of each type takes.

ggml stores a tensor row by row, and cuts each row into blocks: one value per "block" for the plain
number types (F32, F16, BF16, the integers), 32, 64, 128 or 256 values per block for the quantized
types. A block of a quantized type is a fixed number of bytes (its scales and its codes), so every
type's bytes are just whole blocks, and the bytes of a tensor follow from its type and shape alone.
That is all a file reader needs to find, skip or map a tensor it cannot decode (gguf.py), and what
the quantizers' block layouts are checked against (kquants.py).

References: llama.cpp ggml/include/ggml.h (`enum ggml_type`), ggml/src/ggml.c (`type_traits`:
blck_size, type_size), ggml/src/ggml-common.h (the block structs).
See chapter: kquants
"""

from __future__ import annotations

import enum
import math


class GGMLType(enum.IntEnum):
    """ggml tensor type ids (ggml.h `enum ggml_type`). Ids 4, 5, 31-33 and 36-38 were removed upstream."""
    F32 = 0; F16 = 1; Q4_0 = 2; Q4_1 = 3; Q5_0 = 6; Q5_1 = 7; Q8_0 = 8; Q8_1 = 9  # noqa: E702
    Q2_K = 10; Q3_K = 11; Q4_K = 12; Q5_K = 13; Q6_K = 14; Q8_K = 15  # noqa: E702
    IQ2_XXS = 16; IQ2_XS = 17; IQ3_XXS = 18; IQ1_S = 19; IQ4_NL = 20; IQ3_S = 21; IQ2_S = 22  # noqa: E702
    IQ4_XS = 23; I8 = 24; I16 = 25; I32 = 26; I64 = 27; F64 = 28; IQ1_M = 29; BF16 = 30  # noqa: E702
    TQ1_0 = 34; TQ2_0 = 35; MXFP4 = 39; NVFP4 = 40; Q1_0 = 41  # noqa: E702


# (elements per block, bytes per block), as ggml.c's type_traits give them.
BLOCK = {
    GGMLType.F32: (1, 4), GGMLType.F16: (1, 2), GGMLType.BF16: (1, 2), GGMLType.F64: (1, 8),
    GGMLType.I8: (1, 1), GGMLType.I16: (1, 2), GGMLType.I32: (1, 4), GGMLType.I64: (1, 8),
    GGMLType.Q4_0: (32, 18), GGMLType.Q4_1: (32, 20), GGMLType.Q5_0: (32, 22), GGMLType.Q5_1: (32, 24),
    GGMLType.Q8_0: (32, 34), GGMLType.Q8_1: (32, 36), GGMLType.IQ4_NL: (32, 18), GGMLType.MXFP4: (32, 17),
    GGMLType.Q2_K: (256, 84), GGMLType.Q3_K: (256, 110), GGMLType.Q4_K: (256, 144),
    GGMLType.Q5_K: (256, 176), GGMLType.Q6_K: (256, 210), GGMLType.Q8_K: (256, 292),
    GGMLType.IQ2_XXS: (256, 66), GGMLType.IQ2_XS: (256, 74), GGMLType.IQ3_XXS: (256, 98),
    GGMLType.IQ1_S: (256, 50), GGMLType.IQ3_S: (256, 110), GGMLType.IQ2_S: (256, 82),
    GGMLType.IQ4_XS: (256, 136), GGMLType.IQ1_M: (256, 56), GGMLType.TQ1_0: (256, 54),
    GGMLType.TQ2_0: (256, 66), GGMLType.NVFP4: (64, 36), GGMLType.Q1_0: (128, 18),
}

# The types whose elements are plain numbers, as numpy dtypes; numpy has no bfloat16, so BF16 is uint16.
ELEMENT_DTYPE = {
    GGMLType.F32: "<f4", GGMLType.F16: "<f2", GGMLType.BF16: "<u2", GGMLType.F64: "<f8",
    GGMLType.I8: "<i1", GGMLType.I16: "<i2", GGMLType.I32: "<i4", GGMLType.I64: "<i8",
}


def block_size(type_name: str) -> int:
    """Elements per block of the GGML type named `type_name` ("Q4_K" -> 256)."""
    return BLOCK[GGMLType[type_name]][0]


def tensor_nbytes(type: GGMLType, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of numpy `shape`: whole blocks along each row (the last numpy axis).
    ValueError when the row is not a whole number of blocks."""
    block, block_bytes = BLOCK[type]
    if shape[-1] % block:
        raise ValueError(f"row length {shape[-1]} is not a multiple of the {type.name} block size {block}")
    return math.prod(shape[:-1]) * (shape[-1] // block) * block_bytes
