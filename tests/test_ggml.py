"""ggml's type facts (ref_impl.formats.ggml): every type's block size against llama.cpp's `gguf` package,
and the bytes of a tensor as whole blocks per row."""

from __future__ import annotations

import gguf as gguf_py
import pytest

from ref_impl.formats.ggml import BLOCK, GGMLType, block_size, tensor_nbytes


def test_every_ggml_type_has_a_block_size():
    assert set(BLOCK) == set(GGMLType)
    for t, (block, nbytes) in BLOCK.items():
        if t == GGMLType.Q8_1:  # ggml-common.h: two fp16 + 32 int8 = 36; gguf-py still says 4 + 4 + 32
            continue
        assert gguf_py.GGML_QUANT_SIZES[gguf_py.GGMLQuantizationType[t.name]] == (block, nbytes), t
    assert {t.name: t.value for t in GGMLType} == {t.name: t.value for t in gguf_py.GGMLQuantizationType
                                                   if t.name in GGMLType.__members__}


def test_tensor_bytes_are_whole_blocks():
    """A tensor is whole blocks per row, or not a tensor of that type at all."""
    assert tensor_nbytes(GGMLType.Q4_K, (3, 512)) == 3 * 2 * 144 and block_size("Q4_K") == 256
    assert tensor_nbytes(GGMLType.F16, (2, 3, 5)) == 60
    with pytest.raises(ValueError, match="row length 100 is not a multiple of the Q8_0 block size 32"):
        tensor_nbytes(GGMLType.Q8_0, (2, 100))
