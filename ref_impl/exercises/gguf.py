"""Exercises of chapter "GGUF: file layout and alignment" (book/kquants/gguf-layout): GGUF tasks 1 and 2.

Where the next tensor's data starts (the padding rule of `formats.gguf.write`), and when numpy can
view a mapped file's bytes in place with aligned elements. Both are exact answers.
Tests: `pytest tests/test_exercises_gguf.py -k gguf_task`.

See chapter: gguf
"""

from __future__ import annotations

import numpy as np

from ref_impl.exercises.core import Result, judge_exact, run_answer


def _pad_to(n: int, alignment: int) -> int:
    return n + (-n % alignment)


def _offset_case(offset: int, nbytes: int, alignment: int):
    end = offset + nbytes
    right = _pad_to(end, alignment)
    mistakes = [
        (end, "the next tensor starts on the next multiple of the alignment: pad the end up."),
        (end // alignment * alignment, "round up, not down: the padding comes after the data."),
        (end + alignment - end % alignment, "an end that is already aligned needs no padding: "
                                            "pad by (-end) % alignment, which is 0 then."),
        (_pad_to(nbytes, alignment), "add the tensor's own offset: the next one starts after it."),
        (_pad_to(end, 32), f"this file's alignment is {alignment}, not GGUF's default 32."),
        (offset + _pad_to(nbytes, 32), f"this file's alignment is {alignment}, not GGUF's default 32."),
    ]
    return (offset, nbytes, alignment), f"offset {offset:,}, {nbytes:,} bytes, alignment {alignment}", right, mistakes


def check_next_offset(answer, offset: int = 128, nbytes: int = 7 * 18, alignment: int = 32) -> Result:
    """GGUF task 1: the offset of the next tensor's data, given this tensor's `offset` (itself a
    multiple of `alignment`), its size `nbytes` and the file's `alignment` (bytes).

    `answer` is a number for the given case (default: seven 18-byte Q4_0 blocks at offset 128), or
    a function `f(offset, nbytes, alignment)` called on cases with alignments 32, 64 and 1 and an
    end that is already aligned. Checked exactly against the padding rule of gguf.write.
    """
    cases = [_offset_case(offset, nbytes, alignment), _offset_case(0, 4096 * 384 * 4, 32),
             _offset_case(1024, 3 * 34, 64), _offset_case(6_291_456, 1536 + 210, 32), _offset_case(7, 5, 1),
             _offset_case(192, 144, 64)]
    return judge_exact("GGUF task 1", answer, cases, "next = end rounded up to a multiple of the alignment: "
                       "end + (-end) % alignment, with end = offset + nbytes.", int)


# (offset, dtype) pairs of GGUF task 2: aligned and misaligned offsets for each element size
VIEW_CASES = [(128_224, "float32"), (128_228, "float32"), (128_226, "float32"), (128_226, "float16"),
               (128_225, "float16"), (0, "float32"), (6, "float16"), (6, "float32"), (3, "uint8"),
               (4096 + 32, "float16"), (40, "float64"), (44, "float64")]


def check_zero_copy_view(answer) -> Result:
    """GGUF task 2: can numpy view `nbytes` of an mmap'd file at byte `offset` as `dtype` with no
    copy and with aligned elements (`flags.aligned`, the fast path)? The map starts on a page
    boundary, so only the offset counts.

    `answer` is a function `f(offset: int, dtype: str) -> bool` ("float32", "float16", "float64",
    "uint8"), called on a dozen offsets. Right: offset % np.dtype(dtype).alignment == 0.
    """
    if not callable(answer):
        return Result(False, "GGUF task 2: write a function f(offset, dtype) -> bool; it is called on several cases.")
    patterns = [
        (lambda o, d: o % 32 == 0, "32 bytes is GGUF's choice, not numpy's need: an aligned view needs the "
                                   "offset to be a multiple of the element's size (4 for float32)."),
        (lambda o, d: o % 4 == 0, "the element size depends on the dtype: float16 elements are 2 bytes, "
                                  "float64 8, uint8 1."),
        (lambda o, d: True, "numpy can wrap any offset, but a misaligned float32 array (flags.aligned False) "
                            "takes a slow path or a copy: the offset must be a multiple of the element size."),
        (lambda o, d: o % 64 == 0, "a cache line (64 bytes) is not what numpy checks: the offset must be a "
                                   "multiple of the element size."),
    ]
    cases = [((o, d), f"offset {o:,} as {d}", o % np.dtype(d).alignment == 0, []) for o, d in VIEW_CASES]
    answers, failed = run_answer("GGUF task 2", "every case", lambda: [answer(o, d) for o, d in VIEW_CASES])
    if failed is not None:
        return failed
    for rule, hint in patterns:
        if [rule(o, d) for o, d in VIEW_CASES] == answers and answers != [c[2] for c in cases]:
            cases = [(args, label, right, [(not right, hint)]) for args, label, right, _ in cases]
            break
    return judge_exact("GGUF task 2", answer, cases, "offset % np.dtype(dtype).alignment == 0 (the element "
                       "size for these dtypes).", bool)
