"""Chapter "GGUF: file layout and alignment" (book/kquants/gguf-layout), GGUF tasks 1 and 2:
`pytest tests/test_exercises_gguf.py -k gguf_task`."""

from __future__ import annotations

import numpy as np
import pytest

from ref_impl import exercises as ex
from ref_impl.exercises.gguf import VIEW_CASES
from ref_impl.formats import gguf


def right_next_offset(offset, nbytes, alignment):
    end = offset + nbytes
    return end + (-end) % alignment


def test_gguf_task_1_accepts_the_padded_offset_and_a_right_function():
    # seven 18-byte Q4_0 blocks at offset 128 end at 254; the next multiple of 32 is 256
    assert ex.check_next_offset(256)
    assert ex.check_next_offset(256.0)
    assert ex.check_next_offset(right_next_offset)
    assert ex.check_next_offset(lambda o, n, a: -(-(o + n) // a) * a)


def test_gguf_task_1_matches_what_gguf_write_does(tmp_path):
    for alignment in (1, 32, 64):
        path = tmp_path / f"a{alignment}.gguf"
        gguf.write(path, {}, {"a": np.zeros(7, np.float32), "b": np.zeros(3, np.float16)}, alignment=alignment)
        with gguf.read(path) as f:
            a, b = f.tensors["a"], f.tensors["b"]
            assert b.offset == right_next_offset(a.offset, a.nbytes, alignment)


@pytest.mark.parametrize("wrong, hint", [
    (254, "pad the end up"),
    (224, "round up, not down"),
    (128, "add the tensor's own offset"),
    (lambda o, n, a: o + n, "pad the end up"),
    (lambda o, n, a: o + n + a - (o + n) % a, "already aligned needs no padding"),
    (lambda o, n, a: right_next_offset(o, n, 32), "not GGUF's default 32"),
    (lambda o, n, a: (o + n) // a * a, "round up, not down"),
])
def test_gguf_task_1_rejects_typical_mistakes_with_their_hint(wrong, hint):
    r = ex.check_next_offset(wrong)
    assert not r and hint in r.message, r.message


def test_gguf_task_1_non_integer():
    assert "whole number" in ex.check_next_offset(256.5).message
    assert "whole number" in ex.check_next_offset(True).message


def test_gguf_task_2_accepts_the_element_alignment_rule():
    assert ex.check_zero_copy_view(lambda o, d: o % np.dtype(d).alignment == 0)
    assert ex.check_zero_copy_view(lambda o, d: o % np.dtype(d).itemsize == 0)


def test_gguf_task_2_rule_is_what_numpy_reports():
    buf = bytes(200_000)
    for offset, dtype in VIEW_CASES:
        view = np.frombuffer(buf, dtype, count=4, offset=offset)
        # bytes objects start 16-byte aligned + a 32-byte header: check relative to an aligned start
        base = np.frombuffer(buf, np.uint8).ctypes.data
        assert view.flags.aligned == ((base + offset) % np.dtype(dtype).alignment == 0)


@pytest.mark.parametrize("wrong, hint", [
    (lambda o, d: o % 32 == 0, "GGUF's choice"),
    (lambda o, d: o % 4 == 0, "float16 elements are 2 bytes"),
    (lambda o, d: True, "slow path or a copy"),
    (lambda o, d: o % 64 == 0, "cache line"),
    (lambda o, d: o % 2 == 0, "np.dtype(dtype).alignment"),
])
def test_gguf_task_2_rejects_typical_mistakes_with_their_hint(wrong, hint):
    r = ex.check_zero_copy_view(wrong)
    assert not r and hint in r.message, r.message


def test_gguf_task_2_wants_a_function_returning_bools():
    assert "write a function" in ex.check_zero_copy_view(True).message
    assert "True or False" in ex.check_zero_copy_view(lambda o, d: 1).message
