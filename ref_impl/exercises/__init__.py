"""Checkers for the book's exercises: accept a right answer, reject a wrong one with a hint.

A checker takes the learner's answer -- a number, or a function that it calls on several test
inputs -- and compares it with the engine's own computation (here `roofline.py`). An answer is
right within a relative tolerance of `RTOL` (1%). A wrong answer is compared with the values the
usual mistakes produce (bits for bytes, K without V, GiB for GB, ...): a match names the mistake,
otherwise the hint gives the size of the miss and the recipe. Every checker returns a `Result`,
which a notebook displays as ✓ or ✗ with the message; `bool(result)` is `result.ok`.

The tasks are numbered per chapter; `tests/test_exercises.py` names its tests `test_task_<n>_...`.

See chapter: intro
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ref_impl.formats import kquants as kq
from ref_impl.formats.gguf import BLOCK, GGMLType
from ref_impl.theory import roofline as rl
from ref_impl.theory import signalling as sg

RTOL = 0.01  # an answer within 1% of the engine's value is right


@dataclass(frozen=True)
class Result:
    """The verdict on one answer: `ok`, and a message that says why (with a hint when wrong)."""

    ok: bool
    message: str

    def __bool__(self) -> bool:
        return self.ok

    def __repr__(self) -> str:
        return f"{'✓' if self.ok else '✗'} {self.message}"

    def _repr_html_(self) -> str:
        colour, mark = ("#009E73", "✓") if self.ok else ("#D55E00", "✗")
        return (f'<div style="border-left:4px solid {colour};padding:4px 10px">'
                f'<b style="color:{colour}">{mark}</b> {html.escape(self.message)}</div>')


Mistake = tuple[float, str]  # (the value this mistake gives, the hint that names it)


def _run(task: str, label: str, fn: Callable, *args):
    """Call the learner's function: (its value, None), or (None, a ✗ Result saying what went wrong)."""
    try:
        return fn(*args), None
    except NotImplementedError:
        return None, Result(False, f"{task}: not written yet. Replace the `raise NotImplementedError` line.")
    except Exception as exc:  # the learner's code: report it, don't crash the check cell
        return None, Result(False, f"{task} ({label}): your function raised {type(exc).__name__}: {exc}")


def _as_array(task: str, label: str, out, what: str) -> tuple[np.ndarray | None, Result | None]:
    """The learner's output as a float64 array, or a ✗ Result saying it is not one."""
    try:
        return np.asarray(out, dtype=np.float64), None
    except (TypeError, ValueError):
        return None, Result(False, f"{task} ({label}): expected {what}, got {type(out).__name__} {out!r:.80}.")


def _close(a: float, b: float, rtol: float = RTOL) -> bool:
    return math.isclose(a, b, rel_tol=rtol)


def _judge(answer, right: float, unit: str, mistakes: list[Mistake], recipe: str,
           rtol: float = RTOL) -> tuple[bool, str]:
    """(ok, message) for one number against the right value and the values of known mistakes."""
    if isinstance(answer, (np.integer, np.floating)):
        answer = float(answer)
    if isinstance(answer, bool) or not isinstance(answer, (int, float)) or not math.isfinite(answer):
        return False, f"expected a finite number in {unit}, got {answer!r}."
    if _close(answer, right, rtol):
        return True, f"{answer:,.4g} {unit} (engine: {right:,.4g} {unit})."
    if answer <= 0:
        return False, f"{answer:,.4g} {unit}: the answer is a positive number of {unit}."
    # the nearest known mistake within tolerance names the slip (two slips can land close together)
    near = [(abs(answer - value) / value, hint) for value, hint in mistakes
            if _close(answer, value, rtol) and not _close(value, right, rtol)]
    if near:
        return False, f"{answer:,.4g} {unit}, not {right:,.4g}. Hint: {min(near)[1]}"
    return False, (f"{answer:,.4g} {unit} is {answer / right:.3g}× the engine's {right:,.4g} {unit}. "
                   f"Hint: {recipe}")


def _check(task: str, answer, cases: list[tuple[tuple, str, float, list[Mistake]]], unit: str,
           recipe: str, rtol: float = RTOL) -> Result:
    """A number is judged on the first case; a function is called on every case's arguments."""
    if not callable(answer):
        _, label, right, mistakes = cases[0]
        ok, msg = _judge(answer, right, unit, mistakes, recipe, rtol)
        return Result(ok, f"{task} ({label}): {msg}")
    for args, label, right, mistakes in cases:
        value, failed = _run(task, label, answer, *args)
        if failed is not None:
            return failed
        ok, msg = _judge(value, right, unit, mistakes, recipe, rtol)
        if not ok:
            return Result(False, f"{task} ({label}): {msg}")
    return Result(True, f"{task}: right on all {len(cases)} cases, within {100 * rtol:g}%.")


def _units(right: float, unit: str) -> list[Mistake]:
    return [(right / 1e9, f"that is in GB; give the answer in {unit}."),
            (right / 2**30, f"that is in GiB; give the answer in {unit}.")]


# Task 1 -------------------------------------------------------------------------------------

def _bytes_case(model: str, bits: float, context: int):
    s = shapes.PUBLIC[model]
    w, kv = rl.weight_bytes(s, bits), rl.kv_cache_bytes(s, context)
    right = w + kv
    mistakes = [
        (8 * right, "bits vs bytes? Everything came out 8× too big: divide bits by 8."),
        (8 * w + kv, f"bits vs bytes? A weight at {bits:g} bits is {bits / 8:g} bytes: N × b / 8."),
        (w, f"you left out the KV cache: at context {context:,} the token also reads {kv:,.4g} bytes of K and V."),
        (w + kv / 2, "did you count K and V? The cache holds both, hence the factor 2."),
        (w + kv / s.num_hidden_layers, "every layer has its own KV cache: multiply by the number of layers."),
        (w + kv * s.num_attention_heads / s.num_key_value_heads,
         "grouped-query attention caches num_key_value_heads heads, not num_attention_heads."),
        (w + kv * 2, "KV entries are 2 bytes (16-bit) here; did you count 4?"),
        *_units(right, "bytes"),
    ]
    return (s, bits, context), f"{model}, {bits:g} bits/weight, context {context:,}", right, mistakes


def check_bytes_per_token(answer: float | Callable, model: str = "Llama-3.1-8B",
                          bits_per_weight: float = 4.0, context: int = 8192) -> Result:
    """Task 1: bytes read from memory to generate one token, weights plus the KV cache read.

    `answer` is a number of bytes for (`model`, `bits_per_weight`, `context`), or a function
    `f(shape: ModelShape, bits_per_weight, context) -> bytes`, called on four configurations. KV
    entries are 2 bytes; `roofline.param_count(shape)` gives the number of weights. Checked
    against `roofline.decode_bytes_per_token`.
    """
    cases = [_bytes_case(model, bits_per_weight, context), _bytes_case("Llama-3.2-1B", 16, 1),
             _bytes_case("Qwen3-8B", 4.5, 32768), _bytes_case("Llama-3.2-3B", 8, 4096)]
    return _check("Task 1", answer, cases, "bytes", "bytes = N × b / 8 + 2 (K and V) × layers × "
                  "kv_heads × head_dim × 2 bytes × context.")


# Task 2 -------------------------------------------------------------------------------------

def _intensity_case(n: int, k: int, m: int, bits: float):
    right = rl.matmul_intensity(n, k, m, bits, act_bytes=2)
    flops, w, act = 2 * n * k * m, k * m * bits / 8, (n * k + n * m) * 2
    mistakes = [
        (right / 2, "FLOPs are 2 per multiply-add: (n×k)@(k×m) does 2·n·k·m of them."),
        (flops / (8 * w + act), f"bits vs bytes? A weight at {bits:g} bits is {bits / 8:g} bytes."),
        (flops / w, "activations move too: n×k values read and n×m written, 2 bytes each."),
        (flops / (n * w + act), "the weights are read once for all n tokens, not once per token: "
                                "that reuse is the point of batching."),
        (1 / right, "upside down: intensity is FLOPs divided by bytes."),
    ]
    return (n, k, m, bits), f"n={n}, {k}×{m}, {bits:g} bits/weight", right, mistakes


def check_matmul_intensity(answer: float | Callable, n_tokens: int = 1, k: int = 4096, m: int = 14336,
                           bits_per_weight: float = 16) -> Result:
    """Task 2: arithmetic intensity (FLOP/byte) of (n_tokens × k) @ (k × m) with weights at b bits.

    `answer` is a number for the given shape, or a function `f(n_tokens, k, m, bits_per_weight)`
    called on GEMV (n = 1) and GEMM (n in the hundreds) shapes. Activations are 2 bytes, read
    (n×k) and written (n×m) once. Checked against `roofline.matmul_intensity`.
    """
    cases = [_intensity_case(n_tokens, k, m, bits_per_weight), _intensity_case(512, 4096, 14336, 16),
             _intensity_case(1, 4096, 4096, 4), _intensity_case(256, 2048, 8192, 4.5)]
    return _check("Task 2", answer, cases, "FLOP/byte",
                  "FLOPs 2·n·k·m over bytes k·m·b/8 (weights, once) + (n·k + n·m)·2 (activations).")


# Task 3 -------------------------------------------------------------------------------------

def _ridge_case(name: str):
    hw = rl.HARDWARE[name]
    right = rl.ridge_point(hw)
    mistakes = [
        (right / 1000, "units: TFLOP/s is 1e12 FLOP/s but GB/s is 1e9 bytes/s; convert both first."),
        (1 / right, "upside down: the ridge is peak FLOP/s divided by bytes/s."),
        (2 * right, "that peak counts 2:4 sparsity; use the dense figure."),
        (right / 2, "FLOPs are 2 per multiply-add, and the vendor's FLOP/s already counts both."),
        (right / 8, "bits vs bytes? Bandwidth is in bytes/s, not bits/s."),
        (right * 8, "bits vs bytes? Bandwidth is in bytes/s, not bits/s."),
        (right * 1e9 / 2**30, "GiB vs GB: a datasheet's GB/s is 1e9 bytes/s, not 2^30."),
    ]
    return (hw,), name, right, mistakes


def check_ridge_point(answer: float | Callable, hardware: str = "RTX 4090") -> Result:
    """Task 3: the ridge point of a roofline, peak FLOP/s over bandwidth in bytes/s (FLOP/byte).

    `answer` is a number for `hardware` (a key of `roofline.HARDWARE`), or a function
    `f(hw: Hardware) -> FLOP/byte` called on every machine with a sourced peak. Checked against
    `roofline.ridge_point`.
    """
    names = [hardware] + [n for n, h in rl.HARDWARE.items() if h.peak_tflops is not None and n != hardware]
    return _check("Task 3", answer, [_ridge_case(n) for n in names], "FLOP/byte",
                  "ridge = peak_tflops × 1e12 / (bandwidth_gbs × 1e9).")


# Task 4 -------------------------------------------------------------------------------------

def _decode_case(hardware: str, model: str, bits: float, context: int):
    hw, s = rl.HARDWARE[hardware], shapes.PUBLIC[model]
    right = rl.decode_tokens_per_s(hw, s, bits, context)
    w, kv = rl.weight_bytes(s, bits), rl.kv_cache_bytes(s, context)
    mistakes = [
        (right / 8, f"bits vs bytes? A weight at {bits:g} bits is {bits / 8:g} bytes."),
        (hw.bandwidth / (8 * w + kv), f"bits vs bytes? A weight at {bits:g} bits is {bits / 8:g} bytes."),
        (hw.bandwidth / w, f"you left out the KV cache read at context {context:,}: {kv:,.4g} bytes per token."),
        (hw.bandwidth / (w + kv / 2), "did you count K and V? The cache holds both."),
        (hw.bandwidth / (rl.weight_bytes(s, 16) + kv), f"the weights are stored at {bits:g} bits, not 16."),
        (1 / right, "that is seconds per token; the answer is tokens per second."),
        (right * 2**30 / 1e9, "GiB vs GB: the bandwidth is 1e9 bytes/s per GB/s."),
        (right * 1e9 / 2**30, "GiB vs GB: the bandwidth is 1e9 bytes/s per GB/s."),
    ]
    if hw.peak_tflops is not None:
        mistakes.append((hw.peak_flops / rl.flops_per_token(s, context),
                         "that is the compute bound; one token at a time is bound by memory bandwidth."))
    return (hw, s, bits, context), f"{model} on {hardware}, {bits:g} bits/weight, context {context:,}", \
        right, mistakes


def check_decode_tokens_per_s(answer: float | Callable, hardware: str = "Apple M4 Max",
                              model: str = "Llama-3.1-8B", bits_per_weight: float = 4.0,
                              context: int = 4096) -> Result:
    """Task 4: the upper bound on decode tokens/s, bandwidth over bytes per token (Task 1).

    `answer` is a number for the given case, or a function `f(hw, shape, bits_per_weight,
    context) -> tokens/s` called on four cases. KV entries are 2 bytes. Checked against
    `roofline.decode_tokens_per_s` (which also takes the compute bound; it never binds here).
    """
    cases = [_decode_case(hardware, model, bits_per_weight, context),
             _decode_case("RTX 4090", "Llama-3.1-8B", 16, 1), _decode_case("H200 SXM", "Qwen3-32B", 8, 32768),
             _decode_case("Apple M5 Max", "Gemma-3-12B", 4.5, 1000)]
    return _check("Task 4", answer, cases, "tokens/s",
                  "tokens/s = bandwidth (bytes/s) / bytes per token (Task 1).")


# Chapter "GGUF: file layout and alignment" (book/kquants/gguf-layout) --------------------------
# Its tasks are named "GGUF task 1", "GGUF task 2"; tests: `pytest tests/test_exercises.py -k gguf_task`.


def _pad_to(n: int, alignment: int) -> int:
    return n + (-n % alignment)


def _exact(task: str, answer, cases: list[tuple[tuple, str, object, list[tuple[object, str]]]], recipe: str,
           kind: type) -> Result:
    """Exact answers (offsets, yes/no): a value is judged on the first case, a function on every case."""
    def judge(value, label, right, mistakes) -> Result | None:
        if kind is bool and not isinstance(value, (bool, np.bool_)):
            return Result(False, f"{task} ({label}): expected True or False, got {value!r}.")
        if kind is int and isinstance(value, (float, np.floating)) and float(value).is_integer():
            value = int(value)
        if kind is int and (isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer))):
            return Result(False, f"{task} ({label}): expected a whole number of bytes, got {value!r}.")
        if value == right:
            return None
        hint = next((h for v, h in mistakes if v == value and v != right), recipe)
        return Result(False, f"{task} ({label}): {value!r}, not {right!r}. Hint: {hint}")

    if not callable(answer):
        args, label, right, mistakes = cases[0]
        bad = judge(answer, label, right, mistakes)
        return bad if bad is not None else Result(True, f"{task} ({label}): {answer!r}, right.")
    for args, label, right, mistakes in cases:
        value, failed = _run(task, label, answer, *args)
        if failed is not None:
            return failed
        bad = judge(value, label, right, mistakes)
        if bad is not None:
            return bad
    return Result(True, f"{task}: right on all {len(cases)} cases.")


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
    return _exact("GGUF task 1", answer, cases, "next = end rounded up to a multiple of the alignment: "
                  "end + (-end) % alignment, with end = offset + nbytes.", int)


_VIEW_CASES = [(128_224, "float32"), (128_228, "float32"), (128_226, "float32"), (128_226, "float16"),
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
    cases = [((o, d), f"offset {o:,} as {d}", o % np.dtype(d).alignment == 0, []) for o, d in _VIEW_CASES]
    answers, failed = _run("GGUF task 2", "every case", lambda: [answer(o, d) for o, d in _VIEW_CASES])
    if failed is not None:
        return failed
    for rule, hint in patterns:
        if [rule(o, d) for o, d in _VIEW_CASES] == answers and answers != [c[2] for c in cases]:
            cases = [(args, label, right, [(not right, hint)]) for args, label, right, _ in cases]
            break
    return _exact("GGUF task 2", answer, cases, "offset % np.dtype(dtype).alignment == 0 (the element "
                  "size for these dtypes).", bool)


# Chapter "Super-blocks: K-quants" (book/kquants/super-blocks) ---------------------------------
# Its tasks are named "K-quants task 1..3"; tests: `pytest tests/test_exercises.py -k k_quants_task`.


# K-quants task 1 ------------------------------------------------------------------------------

BPW_RTOL = 1e-3  # bits per weight are exact fractions, and two slips can lie 1% apart (Q6_K: 6.5, 6.5625)

# values per block, bits per quant, and the block struct's fields in bytes (ggml-common.h)
_STRUCTS = {
    "Q4_0": (32, 4, {"d": 2, "qs": 16}),
    "Q8_0": (32, 8, {"d": 2, "qs": 32}),
    "Q4_K": (256, 4, {"d": 2, "dmin": 2, "scales": 12, "qs": 128}),
    "Q5_K": (256, 5, {"d": 2, "dmin": 2, "scales": 12, "qh": 32, "qs": 128}),
    "Q6_K": (256, 6, {"ql": 128, "qh": 64, "scales": 16, "d": 2}),
}


def _bpw_case(name: str):
    values, nbytes = BLOCK[GGMLType[name]]
    right = nbytes * 8 / values
    if name not in _STRUCTS:
        return (name,), name, right, []
    _, qbits, f = _STRUCTS[name]

    def bpw(b):
        return b * 8 / values
    extra = ", ".join(f"{k} {v} B" for k, v in f.items() if k not in ("qs", "ql", "qh"))
    mistakes = [
        (qbits, f"{qbits} is only the quant bits; the block also stores {extra}, shared by its {values} values."),
        (right / 8, "that is bytes per weight: multiply by 8 for bits."),
        (nbytes * 8, f"that is bits per block: divide by the {values} values in a block."),
        (nbytes, f"that is bytes per block: × 8 bits, then ÷ the {values} values."),
    ]
    if "dmin" in f:  # Q4_K, Q5_K
        mistakes += [
            (bpw(nbytes - 2), "you left out dmin: a K-quant block has two fp16 super-scales, d for the "
                              "scales and dmin for the mins, 2 bytes each."),
            (bpw(nbytes - 4), "you left out d and dmin, the super-block's two fp16 scales (4 bytes)."),
            (bpw(nbytes + 4), "8 scales and 8 mins of 6 bits are 96 bits, packed into 12 bytes, "
                              "not 16 bytes of 8 bits."),
            (bpw(nbytes - 12), "you left out the 12 bytes of packed 6-bit scales and mins, one pair per sub-block."),
            (qbits + 1, "a sub-block stores a 6-bit scale and a 6-bit min, not an fp16 pair: only the "
                        "super-block's d and dmin are fp16."),
            (nbytes * 8 / 32, f"a super-block holds {values} values (8 sub-blocks of 32): divide by {values}."),
        ]
    if name == "Q5_K":
        mistakes.append((bpw(nbytes - 32), "you left out qh: 32 bytes holding each value's 5th bit."))
    if name == "Q6_K":
        mistakes += [
            (bpw(nbytes - 2), "you left out d, the super-block's fp16 scale (2 bytes)."),
            (bpw(nbytes - 16), "you left out the 16 int8 scales, one per sub-block of 16."),
            (bpw(nbytes - 4), "Q6_K's 16 scales are whole int8 bytes, not packed 6-bit values like Q4_K's."),
            (bpw(nbytes + 2), "Q6_K is symmetric: it has d but no dmin."),
            (bpw(nbytes - 64), "you left out qh: 64 bytes holding each value's top 2 bits."),
        ]
    if name in ("Q4_0", "Q8_0"):
        mistakes.append((qbits + 1, "d is fp16 (2 bytes), not fp32."))
    return (name,), f"{name}: {values} values in {nbytes} bytes", right, mistakes


def check_bits_per_weight(answer, type_name: str = "Q4_K") -> Result:
    """K-quants task 1: bits per weight of GGML type `type_name`, from its block struct.

    `answer` is a number for `type_name`, or a function `f(type_name) -> bits per weight` called
    on Q4_0, Q8_0, Q4_K, Q5_K and Q6_K. Right: block bytes × 8 / values (gguf.BLOCK), within 0.1%.
    """
    names = [type_name] + [n for n in _STRUCTS if n != type_name]
    recipe = "bits per weight = (bytes of every field of the block struct) × 8 / values per block."
    return _check("K-quants task 1", answer, [_bpw_case(n) for n in names], "bits/weight", recipe, BPW_RTOL)


# K-quants task 2 ------------------------------------------------------------------------------

def _unpack_cases() -> list[tuple[np.ndarray, str]]:
    rng = np.random.default_rng(2024)
    packed = kq.pack_scales_q4_k(np.array([[1, 12, 23, 34, 45, 56, 63, 7]]),
                                 np.array([[63, 50, 40, 30, 20, 10, 5, 0]]))[0]
    blocks = [packed] + [rng.integers(0, 256, 12, dtype=np.uint8) for _ in range(6)] + [
        np.full(12, 0xFF, np.uint8), np.zeros(12, np.uint8), np.tile(np.array([0xAA, 0x55], np.uint8), 6),
        np.tile(np.array([0x00, 0xFF], np.uint8), 6), np.tile(np.array([0xC0, 0x3F, 0x0F], np.uint8), 4)]
    return [(b, "bytes " + b.tobytes().hex(" ")) for b in blocks]


def _unpack_variants(b: np.ndarray) -> list[tuple[tuple[np.ndarray, np.ndarray], str]]:
    """The (scales, mins) that each typical slip gives for the 12 bytes `b`, with its hint."""
    lo, mid, hi = (b[i:i + 4].astype(np.int64) for i in (0, 4, 8))
    cat = np.concatenate
    sc_hi, mn_hi = (hi & 15) | ((lo >> 6) << 4), (hi >> 4) | ((mid >> 6) << 4)
    return [
        ((cat([lo & 63, hi & 15]), cat([mid & 63, hi >> 4])),
         "high 2 bits ignored: scales and mins 4-7 are 6-bit too; their top 2 bits are the top 2 bits "
         "of bytes 0-3 (scales) and 4-7 (mins)."),
        ((cat([mid & 63, mn_hi]), cat([lo & 63, sc_hi])),
         "scales and mins swapped: bytes 0-3 hold scales 0-3, bytes 4-7 mins 0-3; return (scales, mins)."),
        ((cat([lo & 63, (hi >> 4) | ((lo >> 6) << 4)]), cat([mid & 63, (hi & 15) | ((mid >> 6) << 4)])),
         "nibbles of bytes 8-11 swapped: the low nibble belongs to the scale, the high nibble to the min."),
        ((cat([lo & 63, (hi & 15) | ((mid >> 6) << 4)]), cat([mid & 63, (hi >> 4) | ((lo >> 6) << 4)])),
         "high bits from the wrong bytes: scale j+4 takes the top 2 bits of byte j (a scale byte), "
         "min j+4 those of byte j+4 (a min byte)."),
        ((cat([lo, sc_hi]), cat([mid, mn_hi])),
         "scales and mins 0-3 are the low 6 bits of their byte (& 63): the top 2 bits belong to sub-block j+4."),
        ((cat([lo & 63, (hi & 15) | (lo & 0xC0)]), cat([mid & 63, (hi >> 4) | (mid & 0xC0)])),
         "the top 2 bits become bits 4-5 of a 6-bit value: (byte >> 6) << 4, not byte & 0xC0."),
    ]


def _int8_pair(out) -> tuple[tuple[np.ndarray, np.ndarray] | None, str]:
    """The learner's (scales, mins) as two int arrays of 8, or None and what is wrong with them."""
    try:
        scales, mins = out
    except (TypeError, ValueError):
        return None, f"return a pair (scales, mins), got {type(out).__name__} {out!r:.80}."
    pair = []
    for name, v in (("scales", scales), ("mins", mins)):
        try:
            a = np.asarray(v, dtype=np.float64).ravel()
        except (TypeError, ValueError):
            return None, f"{name} should be 8 integers, got {v!r:.80}."
        if a.size != 8:
            why = (" Sub-blocks 4-7 have a scale and a min too." if a.size == 4 else
                   " Unpack them; don't return the bytes." if a.size in (6, 12) else "")
            return None, f"{name} has {a.size} values, not 8: one per sub-block of 32.{why}"
        if not (np.isfinite(a).all() and (a == np.round(a)).all()):
            return None, f"{name} should be whole numbers 0..63, got {a.tolist()}."
        pair.append(a.astype(np.int64))
    return (pair[0], pair[1]), ""


def _unpack_right(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    sc, mn = kq.unpack_scales_q4_k(b[None])
    return sc[0].astype(np.int64), mn[0].astype(np.int64)


def check_unpack_scales(fn) -> Result:
    """K-quants task 2: `fn(twelve_bytes: uint8 (12,)) -> (scales, mins)`, 8 ints 0..63 each.

    Called on a dozen blocks (random, all 0xFF, all 0, alternating bits) and checked exactly
    against `kquants.unpack_scales_q4_k`.
    """
    task = "K-quants task 2"
    if not callable(fn):
        return Result(False, f"{task}: write a function f(twelve_bytes) -> (scales, mins); "
                             "it is called on several blocks.")
    cases, got = _unpack_cases(), []
    for b, label in cases:
        out, failed = _run(task, label, fn, b.copy())
        if failed is not None:
            return failed
        pair, why = _int8_pair(out)
        if pair is None:
            return Result(False, f"{task} ({label}): {why}")
        got.append(pair)
    rights = [_unpack_right(b) for b, _ in cases]
    same = [np.array_equal(g[0], r[0]) and np.array_equal(g[1], r[1]) for g, r in zip(got, rights)]
    if all(same):
        return Result(True, f"{task}: right on all {len(cases)} blocks.")
    variants = [_unpack_variants(b) for b, _ in cases]
    for k, (_, hint) in enumerate(variants[0]):
        if all(np.array_equal(g[0], v[k][0][0]) and np.array_equal(g[1], v[k][0][1]) for g, v in zip(got, variants)):
            break
    else:
        hint = ("bytes 0-3: scales 0-3 in the low 6 bits; bytes 4-7: mins 0-3; byte 8+j: low nibble = low "
                "4 bits of scale j+4, high nibble = of min j+4; their top 2 bits are the top 2 bits of "
                "byte j (scale) and byte j+4 (min).")
        if max(int(np.max(g[0])) for g in got) > 63 or max(int(np.max(g[1])) for g in got) > 63:
            hint = "scales and mins are 6-bit, 0..63. " + hint
    i = same.index(False)
    (sc, mn), (rsc, rmn) = got[i], rights[i]
    return Result(False, f"{task} ({cases[i][1]}): got scales {sc.tolist()}, mins {mn.tolist()}; "
                         f"expected {rsc.tolist()}, {rmn.tolist()}. Hint: {hint}")


# K-quants task 3 ------------------------------------------------------------------------------

DECODE_RTOL = 1e-6  # of the block's largest |value|: float64 or float32 arithmetic both pass


def _decode_cases() -> list[tuple[np.ndarray, str]]:
    rng = np.random.default_rng(44)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    x[1] = x[1] * np.float32(0.02) + np.float32(0.005)        # small weights, off-centre
    x[2, ::37] *= 8                                           # a few outliers
    blocks = kq.quantize_q4_k(x)
    cases = [(blocks[0], "Q4_K of N(0, 1), seed 44"), (blocks[1], "Q4_K of 0.02·N(0, 1) + 0.005"),
             (blocks[2], "Q4_K of N(0, 1) with outliers")]
    raw = rng.integers(0, 256, 144, dtype=np.uint8)
    raw[0:4] = np.array([0.0123, 0.0041], "<f2").view(np.uint8)
    return cases + [(raw, "random bytes, d = 0.0123, dmin = 0.0041 (fp16)")]


def _decode_variants(b: np.ndarray) -> list[tuple[np.ndarray, str]]:
    """The 256 values that each typical slip gives for the Q4_K block `b`, with its hint."""
    d, dmin = (np.float32(b[i:i + 2].view("<f2")[0]) for i in (0, 2))
    sc, mn = kq.unpack_scales_q4_k(b[None, 4:16])
    S, M = np.repeat(sc[0], 32).astype(np.float32), np.repeat(mn[0], 32).astype(np.float32)
    qs = b[16:]
    q = np.stack([qs.reshape(4, 32) & 15, qs.reshape(4, 32) >> 4], axis=1).ravel().astype(np.float32)
    q_pairs = np.stack([qs & 15, qs >> 4], axis=1).ravel().astype(np.float32)
    q_halves = np.concatenate([qs & 15, qs >> 4]).astype(np.float32)
    with np.errstate(all="ignore"):
        return [
            (d * S * q_pairs - dmin * M, "nibble order: in each 32 bytes, the low nibbles are the first 32 "
                                         "values (sub-block 2c) and the high nibbles the next 32 (2c+1), "
                                         "not values 2k and 2k+1."),
            (d * S * q_halves - dmin * M, "nibble order: the block is 4 chunks of 32 bytes, each holding two "
                                          "sub-blocks (low nibbles, then high); not all 128 low nibbles first."),
            (d * S * q + dmin * M, "subtract the min: x = d·sc·q − dmin·m."),
            (d * S * q, "you forgot the min: x = d·sc·q − dmin·m."),
            (S * q - dmin * M, "the 6-bit scale is relative: multiply it by the super-block's d."),
            (d * S * q - M, "the 6-bit min is relative: multiply it by the super-block's dmin."),
            (dmin * S * q - d * M, "d and dmin swapped: d is bytes 0-1 (for the scales), dmin bytes 2-3 (for the mins)."),
            (d * M * q - dmin * S, "scales and mins swapped: check your unpacking (task 2)."),
            (d * S * (q - 8) - dmin * M, "Q4_K's quants are 0..15 with no −8: the min does the offset."),
        ]


def _near(a: np.ndarray, b: np.ndarray) -> bool:
    return bool(np.all(np.abs(a - b) <= DECODE_RTOL * max(float(np.max(np.abs(b))), 1e-30)))


def check_decode_q4_k(fn) -> Result:
    """K-quants task 3: `fn(block: uint8 (144,)) -> 256 values` decodes one Q4_K super-block.

    Called on three quantized Gaussian blocks and one of random bytes; checked against
    `kquants.dequantize_q4_k` within 1e-6 of the block's largest |value|.
    """
    task = "K-quants task 3"
    if not callable(fn):
        return Result(False, f"{task}: write a function f(block) -> 256 values; it is called on several blocks.")
    cases, got = _decode_cases(), []
    for b, label in cases:
        out, failed = _run(task, label, fn, b.copy())
        if failed is not None:
            return failed
        a, bad = _as_array(task, label, out, "256 numbers")
        if bad is not None:
            return bad
        if a.size != 256:
            why = {128: " Each byte of qs holds two 4-bit quants: 128 bytes make 256 values.",
                   144: " That is the block's size in bytes; decode it to values.",
                   8: " That is one value per sub-block; each sub-block has 32."}.get(a.size, "")
            return Result(False, f"{task} ({label}): got {a.size} values (shape {a.shape}); a Q4_K "
                                 f"super-block holds 256 (8 sub-blocks of 32).{why}")
        if not np.isfinite(a).all():
            return Result(False, f"{task} ({label}): your values include inf or nan; these blocks have finite d and dmin.")
        got.append(a.ravel())
    rights = [kq.dequantize_q4_k(b).astype(np.float64) for b, _ in cases]
    same = [_near(g, r) for g, r in zip(got, rights)]
    if all(same):
        return Result(True, f"{task}: right on all {len(cases)} blocks.")
    variants = [_decode_variants(b) for b, _ in cases]
    for k, (_, hint) in enumerate(variants[0]):
        if all(_near(g, v[k][0].astype(np.float64)) for g, v in zip(got, variants)):
            break
    else:
        hint = ("x = d·sc[j]·q − dmin·m[j] for value i of sub-block j; bytes 16 + 32c .. 16 + 32c + 31 hold "
                "sub-block 2c in their low nibbles and 2c+1 in their high nibbles.")
        i = same.index(False)
        bad = np.abs(got[i] - rights[i]) > DECODE_RTOL * np.max(np.abs(rights[i]))
        wrong_subs = sorted({int(j) for j in np.flatnonzero(bad) // 32})
        err = max(float(np.max(np.abs(g - r)) / np.max(np.abs(r))) for g, r in zip(got, rights))
        if err < 1e-2:
            hint = (f"close, but off by up to {err:.1g} of the block's largest value: is it computed in float16? "
                    "numpy keeps float16 × uint8 in float16; take d and dmin as float32 (or Python floats).")
        elif min(wrong_subs) >= 4:
            hint = "only sub-blocks 4-7 are wrong: check the unpacking of their scales and mins (task 2)."
    i = same.index(False)
    j = int(np.argmax(np.abs(got[i] - rights[i]) > DECODE_RTOL * np.max(np.abs(rights[i]))))
    return Result(False, f"{task} ({cases[i][1]}): value {j} (sub-block {j // 32}) is {got[i][j]:.6g}, "
                         f"expected {rights[i][j]:.6g}. Hint: {hint}")


# Chapter "GDDR7 and PAM3" (book/signalling/gddr7-pam3) ----------------------------------------
# Its tasks are named "Signalling task 1", "Signalling task 2"; tests: `pytest tests/test_exercises.py -k signalling_task`.


def _pam3_cases() -> list[tuple[list[int], str]]:
    rng = np.random.default_rng(3)
    cases = [[0, 0, 0], [1, 1, 1], [1, 0, 0, 0, 0, 1], [0, 1, 1, 1, 1, 0, 0, 1, 0], [1, 0, 1, 1, 1],
             [1], [1, 1, 0, 1], [0, 0, 1, 0, 1, 1, 1, 0]] + [rng.integers(0, 2, n).tolist() for n in (30, 31, 32)]
    return [(c, f"{len(c)} bits " + "".join(map(str, c[:12])) + ("..." if len(c) > 12 else "")) for c in cases]


def _pam3_variants(bits: list[int]) -> list[tuple[list[int], str]]:
    """What each typical slip gives for `bits`, with its hint."""
    b = np.array(bits + [0] * (-len(bits) % 3), dtype=np.int64).reshape(-1, 3)
    table = np.asarray(sg.PAM3_CODE)
    right = table[4 * b[:, 0] + 2 * b[:, 1] + b[:, 2]]
    whole = len(bits) // 3
    front = np.array([0] * (-len(bits) % 3) + bits, dtype=np.int64).reshape(-1, 3)
    return [
        (table[b[:, 0] + 2 * b[:, 1] + 4 * b[:, 2]].ravel().tolist(),
         "bit order: the first bit of each group of 3 is the most significant, value = 4·b0 + 2·b1 + b2."),
        (right[:whole].ravel().tolist(),
         "no padding: when the length is not a multiple of 3, pad the last group with zeros at the end "
         "(so 2·ceil(n/3) symbols come out); the bit count travels separately."),
        (table[4 * front[:, 0] + 2 * front[:, 1] + front[:, 2]].ravel().tolist(),
         "pad at the end, not the front: the stream's first bit must stay the first bit of the first group."),
        ((right + 1).ravel().tolist(), "levels: the symbols are -1, 0 and +1, not level numbers 0, 1, 2."),
        (right[:, ::-1].ravel().tolist(), "the two symbols of a pair are swapped: PAM3_CODE[v] is (first, second)."),
    ]


def check_encode_pam3(fn) -> Result:
    """Signalling task 1: `fn(bits: list of 0/1) -> list of symbols in {-1, 0, +1}` encodes bits with
    the chapter's PAM3 code: each group of 3 bits (first bit most significant, value 4·b0 + 2·b1 + b2)
    becomes the pair `signalling.PAM3_CODE[value]`; a last group that is short is zero-padded at the end.

    Called on a dozen bit strings, some of lengths not divisible by 3; checked exactly against
    `signalling.encode_pam3`.
    """
    task = "Signalling task 1"
    if not callable(fn):
        return Result(False, f"{task}: write a function f(bits) -> symbols; it is called on several bit strings.")
    cases, got = _pam3_cases(), []
    for bits, label in cases:
        out, failed = _run(task, label, fn, list(bits))
        if failed is not None:
            return failed
        try:
            a = np.asarray(out, dtype=np.float64).ravel()
        except (TypeError, ValueError):
            return Result(False, f"{task} ({label}): expected a list of symbols, got {type(out).__name__} {out!r:.80}.")
        if not (np.isfinite(a).all() and (a == np.round(a)).all()):
            return Result(False, f"{task} ({label}): symbols are whole numbers -1, 0 or +1, got {a.tolist()[:12]}.")
        got.append(a.astype(np.int64).tolist())
    rights = [sg.encode_pam3(bits).tolist() for bits, _ in cases]
    if got == rights:
        return Result(True, f"{task}: right on all {len(cases)} bit strings.")
    variants = [_pam3_variants(bits) for bits, _ in cases]
    hints = [h for k, (_, h) in enumerate(variants[0]) if all(g == v[k][0] for g, v in zip(got, variants))]
    i = next(k for k, (g, r) in enumerate(zip(got, rights)) if g != r)
    pairs = {(g[j], g[j + 1]) for g in got for j in range(0, len(g) - 1, 2)}
    if hints:
        hint = hints[0]
    elif tuple(sg.PAM3_UNUSED) in pairs:
        hint = (f"your symbols use the pair {sg.PAM3_UNUSED}, which the code never sends (it is the one of 9 "
                "pairs left unused); look each value up in signalling.PAM3_CODE.")
    elif len(got[i]) != len(rights[i]):
        n = len(cases[i][0])
        hint = f"{n} bits make {2 * -(-n // 3)} symbols: 2 per group of 3, the last group padded."
    else:
        hint = ("split the bits into groups of 3, value = 4·b0 + 2·b1 + b2, and emit the 2 symbols of "
                "signalling.PAM3_CODE[value]; zero-pad a short last group at the end.")
    return Result(False, f"{task} ({cases[i][1]}): got {got[i][:12]}, expected {rights[i][:12]}. Hint: {hint}")


# Signalling task 2 ------------------------------------------------------------------------------

def _bus_case(pin_gbps: float, bus_bits: int):
    right = sg.bandwidth_gbs(pin_gbps, bus_bits)
    mistakes = [
        (8 * right, "bits vs bytes? pins × Gbps is gigabits per second: divide by 8 for GB/s."),
        (pin_gbps, "that is one pin's rate (in Gbit/s): multiply by the number of data pins."),
        (pin_gbps / 8, "that is one pin's rate in GB/s: multiply by the number of data pins."),
        (sg.bandwidth_gbs(pin_gbps, sg.GDDR7_DEVICE_PINS),
         f"that is one 32-pin device; the bus has {bus_bits} data pins ({bus_bits // 32} devices)."),
        (1.5 * right, "the pin rate is already a data rate (bits, after PAM3's 3-bits-per-2-symbols code): "
                      "don't multiply by 1.5 again."),
        (right / 1.5, "the pin rate is already a data rate (bits, not symbols): don't divide by 1.5."),
        (right / 8, "the bus width is in bits, i.e. pins: divide by 8 only once (bits to bytes)."),
        (right * 1e9 / 2**30, "GiB vs GB: a datasheet's GB/s is 1e9 bytes per second."),
    ]
    return (pin_gbps, bus_bits), f"{pin_gbps:g} Gbps per pin, {bus_bits}-bit bus", right, mistakes


def check_bus_bandwidth(answer, pin_gbps: float = 32, bus_bits: int = 256) -> Result:
    """Signalling task 2: peak bandwidth (GB/s) of a `bus_bits`-wide GDDR bus at `pin_gbps` per pin.

    `answer` is a number for the given bus (default: C03's 32 Gbps on 256 bits), or a function
    `f(pin_gbps, bus_bits) -> GB/s` called on four buses, among them the RTX 5090's (28 Gbps,
    512 bits) and one GDDR7 device at JESD239's top speed (48 Gbps, 32 bits). Checked against
    `signalling.bandwidth_gbs`.
    """
    cases = [_bus_case(pin_gbps, bus_bits), _bus_case(sg.RTX5090_PIN_GBPS, sg.RTX5090_BUS_BITS),
             _bus_case(48, 32), _bus_case(20, 384)]
    return _check("Signalling task 2", answer, cases, "GB/s", "GB/s = pin rate (Gbit/s) × data pins / 8.")


# Chapter "Thunderbolt 5 and PCIe tunnelling" (book/signalling/thunderbolt-pcie) -----------------------
# Its tasks are "Interconnect task 1" to "Interconnect task 3"; tests: `pytest tests/test_exercises.py -k interconnect_task`.

from ref_impl.theory import interconnect as ic  # noqa: E402  (this chapter's section of the file)
from ref_impl.theory import shapes

TLP_RTOL = 1e-3   # an ECRC's 4 bytes move a 512-byte TLP's efficiency by 0.7%: judge to 0.1%


def _tlp_case(payload: int, header_dw: int, ecrc: bool):
    right = ic.tlp_efficiency(payload, 4, header_dw, ecrc)
    h, e = 4 * header_dw, 4 * ecrc
    mistakes = [
        (payload / (payload + h), "only the header: each TLP also carries a 4-byte STP token (framing and "
                                  "sequence number) and a 4-byte LCRC."),
        (payload / (payload + h + 4 + e), "one 4-byte field is missing: the STP token (framing and sequence "
                                          "number) or the LCRC; a TLP carries both."),
        (payload / (payload + header_dw + 8 + e), "header_dw counts double words: 4 bytes each."),
        (100 * right, "give a fraction between 0 and 1, not a percentage."),
        (1 - right, "that is the overheads' share; the efficiency is payload / (payload + overheads)."),
        (right * 128 / 130, "line coding (128b/130b) is a separate factor: this asks for the TLP's own efficiency."),
    ]
    if ecrc:
        mistakes.append((payload / (payload + h + 8), "ECRC is on here: 4 more bytes per TLP."))
    label = f"{payload}-byte payload, {header_dw}-DW header{', ECRC' if ecrc else ''}"
    return (payload, header_dw, ecrc), label, right, mistakes


def check_tlp_efficiency(answer, payload: int = 256, header_dw: int = 3, ecrc: bool = False) -> Result:
    """Interconnect task 1: the share of a Gen3+ TLP's bytes that is payload, payload / (payload +
    header + optional ECRC + STP token + LCRC).

    `answer` is a number for the given TLP, or a function `f(payload, header_dw, ecrc) -> fraction`
    called on four TLPs. Checked against `interconnect.tlp_efficiency` within 0.1%.
    """
    cases = [_tlp_case(payload, header_dw, ecrc), _tlp_case(128, 3, False), _tlp_case(512, 4, True),
             _tlp_case(64, 4, False)]
    return _check("Interconnect task 1", answer, cases, "fraction",
                  "payload / (payload + 4 × header_dw + 4 if ECRC + 4 (STP token) + 4 (LCRC)).", TLP_RTOL)


def _link_case(gen: int, lanes: int, payload: int):
    eff, code = ic.tlp_efficiency(payload, gen), ic.coding_efficiency(gen)
    right = ic.coded_gbs(gen, lanes) * eff
    raw = ic.raw_gbs(gen, lanes)
    other = 128 / 130 if gen <= 2 else 8 / 10
    mistakes = [
        (8 * right, "bits vs bytes: that is Gb/s; a byte is 8 bits, so divide by 8."),
        (raw * eff, f"you left out the line coding: Gen{gen} sends {'8b/10b' if gen <= 2 else '128b/130b'}."),
        (raw * eff * other, f"wrong line code: Gen1/2 use 8b/10b, Gen3 and later 128b/130b (this is Gen{gen})."),
        (raw * code, "you left out the TLP overheads: 20 bytes per TLP with a 3-DW header."),
        (raw, "that is the raw wire rate: take off the line coding and the TLP overheads."),
        (right / lanes, f"that is one lane: multiply by the {lanes} lanes."),
        (2 * right, "one direction only: each direction has its own lanes, so don't add the two."),
    ]
    return (gen, lanes, payload), f"Gen{gen} x{lanes}, {payload}-byte payloads", right, mistakes


def check_link_payload_gbs(answer, gen: int = 4, lanes: int = 4, payload: int = 256) -> Result:
    """Interconnect task 2: payload GB/s of one direction of a PCIe link, TLPs of `payload` bytes
    with 3-DW headers, no ECRC; DLLPs and SKP ordered sets left out.

    `answer` is a number for the given link, or a function `f(gen, lanes, payload) -> GB/s` called on
    four links (Gen2 to Gen5). Checked against `interconnect.coded_gbs × tlp_efficiency`.
    """
    cases = [_link_case(gen, lanes, payload), _link_case(3, 4, 128), _link_case(5, 16, 256), _link_case(2, 8, 128)]
    return _check("Interconnect task 2", answer, cases, "GB/s",
                  "GB/s = GT/s × lanes / 8 × coding (8/10 or 128/130) × payload / (payload + 20).")


STREAM_RESERVE_GB = 1.0   # VRAM kept for KV cache and activations in task 3


def _stream_case(weights: float, vram: float, vram_gbs: float, link_gbs: float, overlap: bool):
    def tps(w=weights, v=vram - STREAM_RESERVE_GB, bw=vram_gbs, link=link_gbs, ov=overlap):
        resident = min(max(v, 0.0), w)
        a, b = resident / bw, (w - resident) / link
        return 1 / (max(a, b) if ov else a + b)
    right = ic.streaming_tokens_per_s(weights, vram, vram_gbs, link_gbs, overlap, STREAM_RESERVE_GB)
    mistakes = [
        (tps(ov=not overlap), "with overlap the VRAM reads and the link transfer run at once: take the max; "
                              "without it they run one after the other: add them." if overlap else
                              "without overlap the VRAM reads and the link transfer run one after the other: "
                              "add them; max is only for overlapped transfers."),
        (tps(link=8 * link_gbs), "Gb/s vs GB/s: the link rate is already in GB/s (bytes); multiplying by 8 makes "
                                 "it bits."),
        (tps(link=link_gbs / 8), "Gb/s vs GB/s: the link rate is given in GB/s; don't divide it by 8 again."),
        (link_gbs / weights, "only the overflow crosses the link; the resident part is read from VRAM."),
        (tps(v=vram), f"keep {STREAM_RESERVE_GB:g} GB of VRAM for the KV cache and activations: it holds no weights."),
        (1 / right, "that is seconds per token; the answer is tokens per second."),
        (right / 8, "bits vs bytes: the sizes are in GB (bytes) and so are the rates."),
    ]
    label = (f"{weights:g} GB of weights, {vram:g} GB VRAM at {vram_gbs:g} GB/s, link {link_gbs:g} GB/s, "
             f"{'overlapped' if overlap else 'not overlapped'}")
    return (weights, vram, vram_gbs, link_gbs, overlap), label, right, mistakes


def check_streaming_tokens_per_s(answer, weights_gb: float = 16.06, vram_gb: float = 8, vram_gbs: float = 1008,
                                 link_gbs: float = 5.6, overlap: bool = True) -> Result:
    """Interconnect task 3: decode tokens/s when the weights overflow VRAM (less 1 GB kept for the KV
    cache) and the overflow crosses the link every token; overlapped (max of the two times) or not (sum).

    `answer` is a number for the given case, or a function `f(weights_gb, vram_gb, vram_gbs, link_gbs,
    overlap) -> tokens/s` called on four cases. Checked against `interconnect.streaming_tokens_per_s`.
    """
    cases = [_stream_case(weights_gb, vram_gb, vram_gbs, link_gbs, overlap), _stream_case(9, 8, 100, 5.6, False),
             _stream_case(8.5, 8, 300, 25, True), _stream_case(20, 12, 456, 7.2, False)]
    return _check("Interconnect task 3", answer, cases, "tokens/s",
                  "resident = VRAM − 1 GB; t = max (overlap) or sum of resident / VRAM GB/s and "
                  "(weights − resident) / link GB/s; tokens/s = 1 / t.")


# Chapter "Pipeline caching, static workspaces and wired memory" (book/dispatch/caching-workspaces) -------
# Its tasks are "Caching task 1" to "Caching task 3"; tests: `pytest tests/test_exercises.py -k caching_task`.

def _amortized_case(first_ms: float, steady_ms: float, n_tokens: int):
    extra = first_ms - steady_ms
    right = extra / n_tokens
    mistakes = [
        (first_ms / n_tokens, "the first token would take a steady step anyway: only first − steady is overhead."),
        (extra / (n_tokens - 1), f"spread the pause over all {n_tokens} tokens, the first one included."),
        (extra, f"that is the whole pause; amortized means divided over the {n_tokens} tokens."),
        (steady_ms + right, "that is the mean time per token; the overhead is what the pause adds to it."),
        (right / 1e3, "give milliseconds, not seconds."),
        (right * 1e3, "the times are already in milliseconds."),
        (100 * right / steady_ms, "give milliseconds per token, not a percentage of the steady step."),
    ]
    label = f"first token {first_ms:g} ms, steady {steady_ms:g} ms, {n_tokens:,} tokens"
    return (first_ms, steady_ms, n_tokens), label, right, mistakes


def check_amortized_overhead(answer, first_ms: float = 6340.0, steady_ms: float = 0.92, n_tokens: int = 256) -> Result:
    """Caching task 1: the milliseconds a first-token pause adds to every token of a generation of
    `n_tokens` tokens, when the first token took `first_ms` and every later one `steady_ms`.

    `answer` is a number for the given case (default: an H200's fresh process, rounded), or a function
    `f(first_ms, steady_ms, n_tokens) -> ms per token` called on four cases.
    """
    cases = [_amortized_case(first_ms, steady_ms, n_tokens), _amortized_case(242.0, 1.09, 16),
             _amortized_case(27.6, 11.4, 8), _amortized_case(51_600.0, 18.0, 300)]
    return _check("Caching task 1", answer, cases, "ms/token",
                  "overhead per token = (first_ms − steady_ms) / n_tokens.")


_DTYPES = {2: "float16", 4: "float32", 1: "uint8"}


def _static_kv_case(shape: str, context: int, dtype_bytes: int):
    import mlx.core as mx

    from ref_impl.engine.kvcache import make_caches
    from ref_impl.engine.random import args_for

    a = args_for(shape, max(context, 1))
    caches = make_caches("static", a.num_hidden_layers, 1, a.num_key_value_heads, a.head_dim, context,
                         getattr(mx, _DTYPES[dtype_bytes]))
    right = sum(c.nbytes for c in caches)            # lazy zeros: nbytes needs no allocation
    per_pos = 2 * a.num_hidden_layers * a.num_key_value_heads * a.head_dim * dtype_bytes
    grown = -(-context // 256) * 256
    mistakes = [
        (right // 2, "a cache holds keys and values: two buffers per layer."),
        (right // a.num_hidden_layers, "every layer has its own cache: multiply by the number of layers."),
        (right * a.num_attention_heads // a.num_key_value_heads,
         "grouped-query attention caches num_key_value_heads heads, not num_attention_heads."),
        (right * 8, "bits vs bytes: dtype_bytes is already in bytes."),
        (per_pos * grown, "that is a chunked cache rounded up to 256 positions; a static cache holds exactly the context."),
        (right * 4 // dtype_bytes, f"the cache is stored in {dtype_bytes}-byte values here, not 4."),
        (right * 2 // dtype_bytes, f"the cache is stored in {dtype_bytes}-byte values here, not 2."),
    ]
    label = f"{shape}, context {context:,}, {dtype_bytes}-byte values"
    return (a, context, dtype_bytes), label, right, mistakes


def check_static_kv_bytes(answer, shape: str = "Llama-3.1-8B", context: int = 8192, dtype_bytes: int = 2) -> Result:
    """Caching task 2: bytes a static (pre-allocated) KV cache holds for one sequence of `context`
    positions, as `kvcache.make_caches("static", ...)` allocates it.

    `answer` is a whole number of bytes for the given case, or a function `f(args, context, dtype_bytes)`
    taking a `model.ModelArgs` (fields num_hidden_layers, num_key_value_heads, num_attention_heads,
    head_dim) and called on four cases. Checked exactly against the caches' `nbytes`.
    """
    cases = [_static_kv_case(shape, context, dtype_bytes), _static_kv_case("Llama-3.2-1B", 2080, 2),
             _static_kv_case("Llama-3.1-8B", 1000, 4), _static_kv_case("Llama-3.2-3B", 131_072, 2)]
    return _exact("Caching task 2", answer, cases, "bytes = 2 (K and V) × layers × kv_heads × context × head_dim "
                  "× dtype_bytes.", int)


def _faults_case(nbytes: int, page: int):
    right = -(-nbytes // page)
    mistakes = [
        (nbytes // page, "a partly used last page faults too: round up."),
        (8 * nbytes // page, "bits vs bytes: the buffer size is in bytes."),
        (-(-nbytes // 4000), "a page is 4 KiB = 4,096 bytes, not 4,000."),
        (-(-nbytes // 4096), f"this machine's pages are {page:,} bytes (Apple silicon uses 16 KiB pages)."),
        (-(-nbytes // (2 << 20)), "that is 2 MiB huge pages; the buffer uses base pages."),
        (0, "a first touch maps every page, and each mapping is one minor fault."),
        (2 * right, "one fault per page: the first touch maps it, later reads find it mapped."),
    ]
    return (nbytes, page), f"{nbytes:,} bytes, {page:,}-byte pages", right, mistakes


def check_page_faults(answer, nbytes: int = 64 << 20, page: int = 4096) -> Result:
    """Caching task 3: minor page faults when a fresh anonymous buffer of `nbytes` is read for the first
    time, with `page`-byte pages (one fault per page, as `loading.wired_reads` counts them).

    `answer` is a whole number for the given case, or a function `f(nbytes, page)` called on six cases.
    """
    cases = [_faults_case(nbytes, page), _faults_case(1 << 30, 4096), _faults_case(10_000, 4096),
             _faults_case(4096, 4096), _faults_case(64 << 20, 16384), _faults_case(1, 4096)]
    return _exact("Caching task 3", answer, cases, "faults = ceil(nbytes / page).", int)


# Chapter "Time to first token and inter-token jitter" (book/dispatch/ttft-jitter) --------------------
# Its tasks are "Jitter task 1" and "Jitter task 2"; tests: `pytest tests/test_exercises.py -k jitter_task`.

P99_RTOL = 1e-6   # percentiles of the same trace: only float rounding separates a right answer


def _token_traces() -> list[tuple[np.ndarray, str]]:
    """Token timestamps (s) of seeded synthetic generations: lognormal ITLs around a few ms, with
    rare pauses, and lengths where linear interpolation, nearest rank and the max all differ."""
    out = []
    for seed, n, ms in ((0, 300, 5.0), (1, 1001, 0.75), (2, 151, 9.5), (3, 64, 2.0)):
        rng = np.random.default_rng(seed)
        itl = ms * rng.lognormal(0.0, 0.15, n)
        itl[rng.choice(n, max(1, n // 100), replace=False)] *= rng.uniform(5, 60, max(1, n // 100))
        out.append((12.5 + np.concatenate([[0.0], np.cumsum(itl)]) / 1e3, f"{n + 1} tokens, ITLs around {ms:g} ms"))
    return out


def _nearest_rank(x: np.ndarray, q: float) -> float:
    return float(np.sort(x)[math.ceil(q / 100 * len(x)) - 1])


def check_p99_itl(fn) -> Result:
    """Jitter task 1: `fn(token_times) -> p99 inter-token latency in ms`, from token timestamps in
    seconds (as `generate.Generation.token_times`). Accepted: the linear-interpolation percentile
    (numpy's default, the one `latency.kv_jitter` records) or the nearest-rank one (the
    ceil(0.99 n)-th smallest ITL); called on four seeded traces."""
    task = "Jitter task 1"
    for times, label in _token_traces():
        value, failed = _run(task, label, fn, times.copy())
        if failed is not None:
            return failed
        itl = np.diff(times) * 1e3
        linear, rank = float(np.percentile(itl, 99)), _nearest_rank(itl, 99)
        if isinstance(value, (np.integer, np.floating)):
            value = float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return Result(False, f"{task} ({label}): expected one number of milliseconds, got {value!r}.")
        if _close(value, linear, P99_RTOL) or _close(value, rank, P99_RTOL):
            continue
        mistakes = [
            (linear / 1e3, "that is in seconds: the timestamps are seconds, give milliseconds (× 1000)."),
            (float(np.percentile(times, 99)) * 1e3, "percentile of the timestamps, not of the gaps between "
                                                    "them: take np.diff first."),
            (float(np.percentile(itl, 1)), "that is p1: the 99th percentile is near the slow end, "
                                            "99% of the ITLs are at or below it."),
            *[(v, "that is p1: the 99th percentile is near the slow end, 99% of the ITLs are at or below it.")
              for v in (_nearest_rank(itl, 1), *(float(np.sort(itl)[int(0.01 * m)]) for m in (len(itl) - 1, len(itl))))],
            (float(itl.max()), "that is the maximum; p99 is the value 99% of the ITLs are at or below."),
            (float(itl.mean()), "that is the mean; p99 is a percentile of the sorted ITLs."),
            (float(np.median(itl)), "that is the median (p50)."),
            (float(np.sort(itl)[min(len(itl) - 1, int(0.99 * len(itl)))]),
             "off by one rank: sorted[int(0.99 n)] is neither nearest rank (index ceil(0.99 n) − 1) "
             "nor interpolation."),
            (float(np.percentile(np.diff(times[:-1]) * 1e3, 99)), "you dropped the last interval."),
        ]
        hint = next((h for v, h in mistakes if _close(value, v, 1e-6) and not _close(v, linear, 1e-6)
                     and not _close(v, rank, 1e-6)),
                    "p99 = np.percentile(np.diff(token_times) * 1e3, 99).")
        return Result(False, f"{task} ({label}): {value:,.6g} ms, not {linear:,.6g} (interpolated) or "
                             f"{rank:,.6g} (nearest rank). Hint: {hint}")
    return Result(True, f"{task}: right on all {len(_token_traces())} traces.")


def _growth_case(prompt_len: int, n_steps: int, step: int = 256):
    first = -(-prompt_len // step) * step
    right = [pos - prompt_len for pos in range(first, prompt_len + n_steps, step)]
    shifted = [k - 1 for k in right if k >= 1]
    mistakes = [
        ([k for k in range(step, n_steps, step)], "positions count from the cache's start, and the prompt "
                                                  "already filled prompt_len of them: step k writes position "
                                                  "prompt_len + k."),
        ([pos - prompt_len for pos in range(first + step, prompt_len + n_steps, step)],
         "the first growth comes when the prefilled buffer is full, at the first multiple of step that is "
         ">= prompt_len."),
        (shifted, "off by one: step k writes position prompt_len + k; growth is at position = multiple of step. "
                  "(The ITL where the pause shows is one earlier, under pipelining; this asks for the step.)"),
        ([pos - prompt_len + 1 for pos in range(first, prompt_len + n_steps, step)],
         "off by one: step 0 writes position prompt_len, so step k writes prompt_len + k."),
    ]
    if prompt_len % step == 0:
        mistakes.insert(0, ([k for k in right if k > 0], "a prompt that exactly fills its buffer grows on "
                                                         "the very first decode step (k = 0)."))
    label = f"prompt of {prompt_len} tokens, {n_steps} decode steps, step {step}"
    return (prompt_len, n_steps, step), label, right, [(m, h) for m, h in mistakes if m is not None]


def check_growth_steps(fn) -> Result:
    """Jitter task 2: `fn(prompt_len, n_steps, step=256) -> list of decode-step indices` at which a
    `kvcache.ChunkedKVCache` grows. Decode step k (0-based) writes cache position prompt_len + k; the
    prefill allocated ceil(prompt_len / step) whole steps. Called on five cases, one prompt an exact
    multiple of step. Checked exactly against the growth rule of ChunkedKVCache.update_and_fetch."""
    cases = [_growth_case(32, 2048), _growth_case(16, 520), _growth_case(300, 1000), _growth_case(256, 600),
             _growth_case(5, 100, 16)]
    task = "Jitter task 2"
    for args, label, right, mistakes in cases:
        value, failed = _run(task, label, fn, *args)
        if failed is not None:
            return failed
        try:
            got = [int(k) for k in value]
        except (TypeError, ValueError):
            return Result(False, f"{task} ({label}): expected a list of step indices, got {value!r}.")
        if got == right:
            continue
        hint = next((h for m, h in mistakes if list(m) == got and list(m) != right),
                    "grow at every position pos = m·step with pos >= prompt_len and pos < prompt_len + n_steps; "
                    "step k = pos − prompt_len.")
        return Result(False, f"{task} ({label}): {got[:8]}{'…' if len(got) > 8 else ''}, not "
                             f"{right[:8]}{'…' if len(right) > 8 else ''}. Hint: {hint}")
    return Result(True, f"{task}: right on all {len(cases)} cases.")


# Chapter "Command buffers and sync bubbles": Dispatch tasks 1-2 -------------------------------------------

def _double_buffer_case(e: float, g: float, n: int, s: float, h: float):
    from ref_impl.theory import queue

    cfg = queue.QueueConfig(kernels_per_token=n, encode_s=e, gpu_s=g, kernels_per_buffer=n, commit_s=0.0,
                               sync_s=s, host_s=h, policy="double_buffer")
    right = 1 / queue.steady_period(cfg)
    cpu, gpu = n * e + s + h, n * g
    mistakes = [
        (1 / (n * e + n * g + s + h), "that is the synchronous queue (per_token: encode, run, wait, one after the "
                                      "other); double buffering overlaps the CPU's work with the GPU's: take the max."),
        (1 / max(n * e, n * g), "the sync s and the host work h happen on the CPU every token: they belong on the "
                                "CPU's side of the max, with n·e."),
        (1 / max(cpu, gpu + s + h), "s and h are the CPU's: the GPU's side is n·g alone."),
        (1 / max(e + s + h, g), "e and g are per kernel: a token has n kernels, so n·e and n·g."),
        (max(cpu, gpu), "that is seconds per token; the answer is tokens per second."),
        (1 / cpu, "that is the CPU's side alone (or the faster side): here the GPU is the slower one "
                  "(n·g > n·e + s + h), and the slower side sets the pace: take the max."),
        (1 / gpu, "that is the GPU's side alone (or the faster side): here the CPU is the slower one "
                  "(n·e + s + h > n·g), and the slower side sets the pace: take the max."),
    ]
    label = f"e = {e * 1e6:g} µs, g = {g * 1e6:g} µs, n = {n}, s = {s * 1e6:g} µs, h = {h * 1e6:g} µs"
    return (e, g, n, s, h), label, right, mistakes


def check_double_buffer_tokens_per_s(answer, e: float = 4e-6, g: float = 3e-6, n: int = 300, s: float = 30e-6,
                                     h: float = 80e-6) -> Result:
    """Dispatch task 1: steady tokens/s of a double-buffered queue, one command buffer per token, no commit cost:
    encode e and run g seconds per kernel, n kernels per token, sync s and host work h per token.

    `answer` is a number for the given case, or a function `f(e, g, n, s, h) -> tokens/s` called on four cases
    (CPU-bound and GPU-bound). Checked against `queue.steady_period(..., policy="double_buffer")`.
    """
    cases = [_double_buffer_case(e, g, n, s, h), _double_buffer_case(2e-6, 20e-6, 400, 20e-6, 60e-6),
             _double_buffer_case(3e-6, 6e-6, 120, 40e-6, 100e-6), _double_buffer_case(1e-6, 8e-6, 1000, 10e-6, 5e-6)]
    return _check("Dispatch task 1", answer, cases, "tokens/s",
                  "the CPU spends n·e + s + h per token, the GPU n·g; with two tokens in flight they overlap, so "
                  "a token takes max(n·e + s + h, n·g) seconds: tokens/s is one over that.")


# model, parameters (billions), layers: public shapes, smallest first (sizes rounded)
GAIN_MODELS = (("stdlib-10m", 0.0126, 6), ("Llama-3.2-1B", 1.24, 16), ("Llama-3.2-3B", 3.2, 28),
               ("Llama-3.1-8B", 8.0, 32), ("Qwen3-14B", 14.8, 40), ("Qwen3-32B", 32.8, 64),
               ("Llama-3.1-70B", 70.6, 80), ("Llama-3.1-405B", 405.9, 126))


def async_gain_table(host_us_per_layer: float = 40.0, gbs: float = 1000.0, bits: float = 16.0,
                     sync_us: float = 30.0, host_us: float = 100.0) -> list[dict]:
    """Sync and pipelined tokens/s of GAIN_MODELS on one machine, from the queue model: the host builds each
    token's graph (host_us_per_layer per layer), the GPU streams the weights at `gbs` GB/s. One command buffer
    per token; per_token for sync, double_buffer for async_eval. Rounded to 0.01 tok/s, as a results table."""
    from dataclasses import replace

    from ref_impl.theory import queue

    rows = []
    for name, params_b, layers in GAIN_MODELS:
        cfg = queue.QueueConfig(kernels_per_token=layers, encode_s=host_us_per_layer * 1e-6,
                                   gpu_s=params_b * 1e9 * bits / 8 / (gbs * 1e9) / layers, kernels_per_buffer=layers,
                                   commit_s=0.0, sync_s=sync_us * 1e-6, host_s=host_us * 1e-6)
        sync, piped = (1 / queue.steady_period(replace(cfg, policy=p)) for p in ("per_token", "double_buffer"))
        rows.append({"model": name, "params_b": params_b, "layers": layers,
                     "sync_tok_s": round(sync, 2), "async_tok_s": round(piped, 2)})
    return rows


def _stops(table: list[dict], threshold: float, gain) -> str | None:
    rows = sorted(table, key=lambda r: r["params_b"])
    gains = [gain(r) for r in rows]
    peak = int(np.argmax(gains))
    return next((r["model"] for r, x in zip(rows[peak + 1:], gains[peak + 1:]) if x < threshold), None)


def _stops_case(threshold: float, **machine):
    table = async_gain_table(**machine)
    rows = sorted(table, key=lambda r: r["params_b"])
    right = _stops(table, threshold, lambda r: r["async_tok_s"] / r["sync_tok_s"] - 1)
    gains = [r["async_tok_s"] / r["sync_tok_s"] - 1 for r in rows]
    peak = int(np.argmax(gains))
    names = [r["model"] for r in rows]
    at = names.index(right) if right in names else len(names)
    mistakes = [
        (next((r["model"] for r, x in zip(rows, gains) if x < threshold), None),
         "the smallest models gain little too (their GPU work is too short to hide the host's): look only at "
         "models larger than the one where async helps most."),
        (names[peak], "that is where async_eval helps most; the question is where its gain drops under the threshold."),
        (_stops(table, threshold, lambda r: 1 - r["sync_tok_s"] / r["async_tok_s"]),
         "the gain is async / sync − 1 (how much faster pipelining is), not 1 − sync / async (how much slower "
         "syncing is)."),
        (names[at - 1] if at - 1 > peak else None, "that model still gains at least the threshold: the answer is "
                                                    "the next larger one."),
        (_stops(table, threshold, lambda r: r["sync_tok_s"] / r["async_tok_s"] - 1),
         "sync / async − 1 is negative everywhere: the gain is async / sync − 1."),
    ]
    label = (f"{machine.get('host_us_per_layer', 40):g} µs of host work per layer, "
             f"{machine.get('gbs', 1000):g} GB/s, threshold {threshold:.0%}")
    return (table, threshold), label, right, mistakes


def check_async_stops_helping(answer, threshold: float = 0.10) -> Result:
    """Dispatch task 2: in a table of sync and async_eval tokens/s by model (`async_gain_table`), the smallest
    model larger than the one with the largest gain (async / sync − 1) whose gain is under `threshold`; None if
    there is none.

    `answer` is a model name for the default table, or a function `f(table, threshold) -> name or None` called
    on four tables (machines with different host and memory speeds).
    """
    cases = [_stops_case(threshold), _stops_case(0.13, host_us_per_layer=150.0, gbs=1000.0),
             _stops_case(0.05, host_us_per_layer=60.0, gbs=3000.0),
             _stops_case(0.05, host_us_per_layer=20.0, gbs=400.0)]
    return _exact("Dispatch task 2", answer, cases,
                  "gain = async_tok_s / sync_tok_s − 1 per model; find the model with the largest gain; the answer "
                  "is the first larger model whose gain is under the threshold.", str)


# Chapter "Quantizing the KV cache" (book/kv-cache/kv-quantization): KV tasks 1-3 ---------------------------

def _kv_bytes_case(shape: str, bits: int, group: int, scale_bytes: int):
    import mlx.core as mx

    from ref_impl.measure.kv import scheme_bytes

    s = shapes.PUBLIC[shape]
    per_layer, _ = scheme_bytes(f"affine{bits}-g{group}", s.num_key_value_heads, s.head_dim,
                                getattr(mx, _DTYPES[scale_bytes]))
    right = per_layer * s.num_hidden_layers                    # read off the caches' real nbytes
    elems = 2 * s.num_hidden_layers * s.num_key_value_heads * s.head_dim   # K and V values per token
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
    `nbytes` of real caches (kvquality.scheme_bytes).
    """
    cases = [_kv_bytes_case(shape, bits, group, scale_bytes), _kv_bytes_case("Qwen3-8B", 8, 32, 2),
             _kv_bytes_case("Llama-3.2-1B", 4, 32, 4), _kv_bytes_case("Qwen3-32B", 8, 64, 2)]
    return _check("KV task 1", answer, cases, "bytes/token",
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
    import mlx.core as mx

    from ref_impl.engine import kvquant

    t = mx.array(keys.T.copy())                      # channels become rows: one scale per channel
    q, scale = kvquant.quantize_symmetric(t, bits, mx.float32)
    return np.array(kvquant.dequantize_symmetric(q, scale, bits)).T


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
        out, failed = _run(task, label, fn, keys.copy(), bits)
        if failed is not None:
            return failed
        got, bad = _as_array(task, label, out, "an array of keys")
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
    from ref_impl.measure.kv import outlier_indices

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
    tokens is above `factor` times the median channel's mean |k| (`kvquality.outlier_indices`).

    Called on three blocks with planted outlier channels and a one-token spike; checked exactly.
    """
    task = "KV task 3"
    for args, label, right, mistakes in [_outlier_case(0, 4.0), _outlier_case(1, 3.0), _outlier_case(2, 8.0)]:
        value, failed = _run(task, label, fn, *args)
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


# Chapter "Speculative decoding and multi-token prediction" (book/speculative/speculative-mtp): Spec tasks 1-3

SPEC_RTOL = 1e-6   # E(α, γ) is a closed form: any float evaluation lands within 1e-6


def _expected_case(alpha: float, gamma: int):
    from ref_impl.theory.speedup import expected_tokens

    right = expected_tokens(alpha, gamma)
    mistakes = [
        (sum(alpha ** i for i in range(gamma)), "that counts the accepted drafts' prefix up to γ − 1: the sum runs "
                                              "1 + α + … + α^γ, γ + 1 terms (the target's own token is the 1)."),
        (alpha * gamma, "α·γ counts the drafts accepted if each were judged alone; a draft counts only when all "
                        "before it were accepted, and the target adds one token of its own."),
        (alpha * gamma + 1, "a draft counts only if every earlier draft was accepted: P(first i accepted) = α^i."),
        (right - 1, "add the token the target emits at the end of every verification (the correction or the bonus)."),
        (sum(alpha ** i for i in range(1, gamma + 1)), "that is the accepted drafts alone; add the target's own token."),
    ]
    return (alpha, gamma), f"α = {alpha:g}, γ = {gamma}", right, mistakes


def check_expected_tokens(answer, alpha: float = 0.7, gamma: int = 4) -> Result:
    """Spec task 1: E(α, γ), the mean tokens one verification emits when each of γ drafts is accepted
    independently with probability α (the accepted prefix plus one token of the target's).

    `answer` is a number for the given case, or a function `f(alpha, gamma)` called on five cases
    (α = 1 among them). Checked against `speedup.expected_tokens`.
    """
    cases = [_expected_case(alpha, gamma), _expected_case(0.6, 1), _expected_case(0.9, 8),
             _expected_case(0.0, 5), _expected_case(1.0, 3)]
    return _check("Spec task 1", answer, cases, "tokens",
                  "E = 1 + α + α² + … + α^γ = (1 − α^(γ+1)) / (1 − α), and γ + 1 at α = 1.", rtol=SPEC_RTOL)


def _optimal_case(alpha: float, c: float, max_gamma: int = 16):
    from ref_impl.theory.speedup import expected_tokens, optimal_gamma, speedup

    right = optimal_gamma(alpha, c, max_gamma)
    grid = range(max_gamma + 1)
    mistakes = [
        (max_gamma, "more drafts always raise E(α, γ), but each costs c target steps: the speedup "
                    "E / (γ·c + 1) peaks and falls."),
        (max(grid, key=lambda g: float(expected_tokens(alpha, g)) - g * c),
         "maximize the ratio E / (γ·c + 1), not the difference."),
        (max(range(1, max_gamma + 1), key=lambda g: float(speedup(alpha, g, c)) / g),
         "maximize the speedup itself, E / (γ·c + 1), not the speedup per draft."),
        (max(grid, key=lambda g: float(expected_tokens(alpha, g)) / (g * c + 1 + c)),
         "a verification costs one target step for all γ + 1 positions: the cost is γ·c + 1."),
    ]
    return (alpha, c, max_gamma), f"α = {alpha:g}, c = {c:g}, γ ≤ {max_gamma}", right, mistakes


def check_optimal_gamma(answer, alpha: float = 0.8, c: float = 0.05) -> Result:
    """Spec task 2: the number of drafts γ (0..16) that maximizes the speedup E(α, γ) / (γ·c + 1) for a
    draft costing c target steps per token; 0 if no draft pays.

    `answer` is a whole number for the given case, or a function `f(alpha, c, max_gamma)` called on five
    cases. Checked exactly against `speedup.optimal_gamma`.
    """
    cases = [_optimal_case(alpha, c), _optimal_case(0.6, 0.1), _optimal_case(0.95, 0.02),
             _optimal_case(0.3, 0.5), _optimal_case(0.9, 0.0, 8)]
    return _exact("Spec task 2", answer, cases, "compute E(α, γ) / (γ·c + 1) for every γ from 0 to max_gamma "
                  "and take the best (γ = 0 is plain decoding, speedup 1).", int)


def _accept_case(seed: int, vocab: int = 8):
    from ref_impl.engine.speculative import accept

    rng = np.random.default_rng(seed)
    p, q = rng.dirichlet(np.ones(vocab) * 0.7), rng.dirichlet(np.ones(vocab) * 0.7)
    x = int(rng.choice(vocab, p=q))
    u_accept, u_sample = float(rng.random()), float(rng.random())
    n, token = accept(np.stack([p, p]), q[None], np.array([x]), np.array([u_accept, u_sample]))
    right = x if n == 1 else int(token)
    return (p, q, x, u_accept, u_sample), right


def _inverse_cdf(weights: np.ndarray, u: float) -> int:
    """The smallest index whose cumulative weight exceeds u × the total."""
    return int(np.searchsorted(np.cumsum(weights), u * weights.sum(), side="right"))


def _accept_variants(p, q, x, u_accept, u_sample) -> list[tuple[int, str]]:
    residual = np.maximum(p - q, 0)
    return [
        (x if u_accept < min(1.0, q[x] / p[x]) else _inverse_cdf(residual, u_sample),
         "accept with probability min(1, p(x)/q(x)): the target's over the draft's, not the inverse."),
        (x if u_accept < min(1.0, p[x] / q[x]) else _inverse_cdf(p, u_sample),
         "on a rejection, sample from the residual max(0, p − q), normalized, not from p: p would count the "
         "tokens the draft already proposes twice."),
        (x if u_accept < min(1.0, p[x] / q[x]) else _inverse_cdf(q, u_sample),
         "on a rejection, sample from the residual max(0, p − q), not from the draft's q."),
        (x if p[x] >= q[x] else _inverse_cdf(residual, u_sample),
         "accept with probability min(1, p(x)/q(x)), using u_accept: a draft with p(x) < q(x) is sometimes kept."),
    ]


def check_accept_one(fn) -> Result:
    """Spec task 3: `fn(p, q, x, u_accept, u_sample) -> token` for one draft position: keep the draft x
    (drawn from q) if u_accept < p(x)/q(x); otherwise return a token drawn from the residual
    max(0, p − q) normalized, by inverse CDF: the smallest token whose cumulative residual weight exceeds
    u_sample × the residual's total.

    Called on twelve seeded cases over an 8-token vocabulary; checked exactly against
    `speculative.accept` with one draft.
    """
    task = "Spec task 3"
    cases, got = [_accept_case(seed) for seed in range(12)], []
    for seed, (args, right) in enumerate(cases):
        p, q, x = args[:3]
        label = f"case {seed}: x = {x}, p(x) = {p[x]:.3f}, q(x) = {q[x]:.3f}"
        value, failed = _run(task, label, fn, p.copy(), q.copy(), *args[2:])
        if failed is not None:
            return failed
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            return Result(False, f"{task} ({label}): expected a token id (an int), got {value!r:.60}.")
        got.append((label, int(value), right))
    wrong = [(label, v, r) for label, v, r in got if v != r]
    if not wrong:
        return Result(True, f"{task}: right on all 12 cases.")
    # the slip that explains every answer names the mistake
    variants = [_accept_variants(*args) for args, _ in cases]
    hint = next((variants[0][k][1] for k in range(len(variants[0]))
                 if all(v[k][0] == g[1] for v, g in zip(variants, got))),
                "accept if u_accept × q(x) < p(x); else inverse-CDF sample max(0, p − q) with u_sample.")
    label, value, right = wrong[0]
    return Result(False, f"{task} ({label}): token {value}, expected {right}. Hint: {hint}")


# Kernel tasks: chapter "Writing a GEMV kernel" (kernels.py) ------------------------------------------------
# Its tasks are "Kernel task 1" to "Kernel task 3"; tests: `pytest tests/test_exercises.py -k kernel_task`.

def _gemv_bytes_case(n: int, k: int, bits: int, group: int, rows: int):
    from ref_impl import kernels

    launch = kernels.launch_config(kernels.Format(bits, group), n, k, rows)
    right = launch.bytes
    weights = launch.fmt.weight_bytes(n, k)
    codes = n * k * bits // 8
    groups, io = weights - codes, right - weights          # scales and biases; x in and y out
    mistakes = [
        (codes + io, f"every group of {group} inputs of a row also stores a float16 scale and a float16 bias."),
        (codes + groups / 2 + io, "an affine group stores a bias as well as a scale: w = scale × q + bias."),
        (weights, "the launch also reads x (rows × k) and writes y (rows × n), 2 bytes a value."),
        (weights + io / rows, f"x and y have {rows} rows here: 2 bytes × rows × (k + n)."),
        (8 * right, "bits vs bytes? Everything came out 8× too big."),
        (8 * codes + groups + io, f"bits vs bytes? A {bits}-bit code is {bits / 8:g} bytes: n × k × bits / 8."),
        (codes + 2 * groups + io, "the scales and biases are float16, 2 bytes each, not 4."),
        *_units(right, "bytes"),
    ]
    return (n, k, bits, group, rows), f"{n:,}×{k:,} {launch.fmt.name}, {rows} row{'s' * (rows > 1)}", right, mistakes


def check_gemv_bytes(answer, n: int = 14336, k: int = 4096, bits: int = 4, group: int = 32, rows: int = 1) -> Result:
    """Kernel task 1: the bytes one GEMV launch (y = x W^T, W of n rows and k inputs) must move at least.

    `answer` is a number for the given case, or a function `f(n, k, bits, group, rows)` called on five cases
    (4- and 8-bit affine weights, float16 with bits 16 and group 0, 1 to 4 rows). Checked exactly (within
    1e-6) against `kernels.launch_config(...).bytes`.
    """
    cases = [_gemv_bytes_case(n, k, bits, group, rows), _gemv_bytes_case(4096, 14336, 8, 64, 1),
             _gemv_bytes_case(4096, 4096, 16, 0, 4), _gemv_bytes_case(128256, 4096, 4, 32, 1),
             _gemv_bytes_case(77, 384, 8, 128, 3)]
    return _check("Kernel task 1", answer, cases, "bytes",
                  "n × k × bits / 8 for the codes, plus (affine) a 2-byte scale and a 2-byte bias per group: "
                  "n × k / group × 4, plus x and y: 2 × rows × (k + n).", rtol=1e-6)


def _gemv_time_case(n: int, k: int, bits: int, group: int, read_gbs: float):
    from ref_impl import kernels

    launch = kernels.launch_config(kernels.Format(bits, group), n, k, 1)
    right = launch.bytes / (read_gbs * 1e9) * 1e6
    us_per_byte = 1e6 / (read_gbs * 1e9)
    io = launch.bytes - launch.fmt.weight_bytes(n, k)
    mistakes = [
        (right / 1e3, "that is in milliseconds; give microseconds."),
        (right / 1e6, "that is in seconds; give microseconds (1 s = 1e6 µs)."),
        (right * 1e9 / 2**30, "a datasheet's GB/s is 1e9 bytes/s, not 2^30."),
        (2 * n * k * us_per_byte, f"the weights are {bits}-bit codes, not 16-bit: n × k × {bits} / 8 bytes."),
        ((n * k * bits // 8 + io) * us_per_byte, "the launch also reads every group's float16 scale and bias."),
    ]
    return (n, k, bits, group, read_gbs), f"{n:,}×{k:,} {launch.fmt.name}, {read_gbs:,g} GB/s", right, mistakes


def check_gemv_time_us(answer, n: int = 14336, k: int = 4096, bits: int = 4, group: int = 32,
                       read_gbs: float = 3300.0) -> Result:
    """Kernel task 2: the least time in µs of one single-row GEMV at a read bandwidth of `read_gbs` GB/s.

    `answer` is a number for the given case, or a function `f(n, k, bits, group, read_gbs)` called on four
    cases. Checked against `kernels.launch_config(..., rows=1).bytes` over the bandwidth.
    """
    cases = [_gemv_time_case(n, k, bits, group, read_gbs), _gemv_time_case(4096, 14336, 8, 64, 3300.0),
             _gemv_time_case(128256, 4096, 16, 0, 4000.0), _gemv_time_case(1024, 4096, 4, 64, 2000.0)]
    return _check("Kernel task 2", answer, cases, "µs",
                  "time = the bytes of Kernel task 1 (rows = 1) / (read_gbs × 1e9 bytes/s), times 1e6 for µs.")


_LAUNCH_CASES = [(14336, 4096, 1, 4), (1024, 4096, 1, 4), (4096, 1024, 1, 4), (128256, 4096, 1, 16),
                 (4096, 4096, 4, 4), (4096, 14336, 9, 8)]
_POWERS = (1, 2, 4, 8)


def _launch_rules(n: int, k: int, rows: int, bits: int, r: int, u: int):
    """(the launch, None) when rows_per_warp r and unroll u keep the chapter's rules, else (None, the broken one)."""
    from ref_impl import kernels as kn

    if r not in _POWERS or u not in _POWERS:
        return None, f"choices: rows_per_warp and unroll are each 1, 2, 4 or 8, not {r} and {u}."
    if r * rows > kn.MAX_ACCUMULATORS:
        return None, (f"accumulators: a lane keeps rows_per_warp × rows = {r * rows} partial sums, more than "
                      f"MAX_ACCUMULATORS = {kn.MAX_ACCUMULATORS}.")
    if r * u > kn.MAX_LOADS:
        return None, (f"loads in flight: rows_per_warp × unroll = {r * u} loads of 16 bytes per lane, more than "
                      f"MAX_LOADS = {kn.MAX_LOADS}.")
    try:
        launch = kn.launch_config(kn.Format(bits, 0 if bits == 16 else 32), n, k, rows, r, u)
    except ValueError as exc:
        return None, f"launch_config refuses it: {exc}"
    if r > 1 and launch.warps_total < 8 * kn.H200_SMS:
        return None, (f"fill the GPU: {launch.warps_total:,} warps, fewer than 8 per SM × {kn.H200_SMS} SMs = "
                      f"{8 * kn.H200_SMS:,}; give each warp fewer rows.")
    if u > launch.chunks_per_lane:
        return None, (f"idle loads: a lane reads only {launch.chunks_per_lane} chunk"
                      f"{'s' * (launch.chunks_per_lane > 1)} of 16 bytes of a row, so unroll {u} leaves loads idle.")
    return launch, None


def _in_flight(launch) -> int:
    return launch.rows_per_warp * min(launch.unroll, launch.chunks_per_lane)


def check_launch_choice(fn) -> Result:
    """Kernel task 3: `fn(n, k, rows, bits) -> (rows_per_warp, unroll)` for one unfused GEMV in
    Format(bits, 32) (bits 16: float16), keeping the chapter's rules: choices 1, 2, 4 or 8; accumulators;
    loads in flight; fill the GPU; no idle loads; and as many bytes in flight as the rules allow (up to 4 loads).

    Called on six cases (a small matrix, a short k, the float16 LM head, 4 and 9 rows); each choice must also be
    accepted by `kernels.launch_config`.
    """
    task = "Kernel task 3"
    for n, k, rows, bits in _LAUNCH_CASES:
        label = f"n={n:,}, k={k:,}, {rows} row{'s' * (rows > 1)}, {bits}-bit"
        value, failed = _run(task, label, fn, n, k, rows, bits)
        if failed is not None:
            return failed
        if (not isinstance(value, tuple) or len(value) != 2
                or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in value)):
            return Result(False, f"{task} ({label}): expected a tuple (rows_per_warp, unroll) of two whole "
                                 f"numbers, got {value!r:.80}.")
        r, u = int(value[0]), int(value[1])
        launch, broken = _launch_rules(n, k, rows, bits, r, u)
        if launch is not None:
            launches = [la for rr in _POWERS for uu in _POWERS
                        if (la := _launch_rules(n, k, rows, bits, rr, uu)[0]) is not None]
            need = min(4, max(map(_in_flight, launches)))
            if _in_flight(launch) < need:
                example = next(la for la in launches if _in_flight(la) >= need)
                broken = (f"bytes in flight: rows_per_warp × min(unroll, chunks per lane) is {_in_flight(launch)}; "
                          f"the rules allow {need} here, e.g. ({example.rows_per_warp}, {example.unroll}).")
        if broken is not None:
            return Result(False, f"{task} ({label}): ({r}, {u}) breaks a rule. Hint: {broken}")
    return Result(True, f"{task}: right on all {len(_LAUNCH_CASES)} cases.")
