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

from . import roofline as rl

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


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=RTOL)


def _judge(answer, right: float, unit: str, mistakes: list[Mistake], recipe: str) -> tuple[bool, str]:
    """(ok, message) for one number against the right value and the values of known mistakes."""
    if isinstance(answer, bool) or not isinstance(answer, (int, float)) or not math.isfinite(answer):
        return False, f"expected a finite number in {unit}, got {answer!r}."
    if _close(answer, right):
        return True, f"{answer:,.4g} {unit} (engine: {right:,.4g} {unit})."
    if answer <= 0:
        return False, f"{answer:,.4g} {unit}: the answer is a positive number of {unit}."
    # the nearest known mistake within tolerance names the slip (two slips can land close together)
    near = [(abs(answer - value) / value, hint) for value, hint in mistakes
            if _close(answer, value) and not _close(value, right)]
    if near:
        return False, f"{answer:,.4g} {unit}, not {right:,.4g}. Hint: {min(near)[1]}"
    return False, (f"{answer:,.4g} {unit} is {answer / right:.3g}× the engine's {right:,.4g} {unit}. "
                   f"Hint: {recipe}")


def _check(task: str, answer, cases: list[tuple[tuple, str, float, list[Mistake]]], unit: str,
           recipe: str) -> Result:
    """A number is judged on the first case; a function is called on every case's arguments."""
    if not callable(answer):
        _, label, right, mistakes = cases[0]
        ok, msg = _judge(answer, right, unit, mistakes, recipe)
        return Result(ok, f"{task} ({label}): {msg}")
    for args, label, right, mistakes in cases:
        try:
            value = answer(*args)
        except NotImplementedError:
            return Result(False, f"{task}: not written yet. Replace the `raise NotImplementedError` line.")
        except Exception as exc:  # the learner's code: report it, don't crash the check cell
            return Result(False, f"{task} ({label}): your function raised {type(exc).__name__}: {exc}")
        ok, msg = _judge(value, right, unit, mistakes, recipe)
        if not ok:
            return Result(False, f"{task} ({label}): {msg}")
    return Result(True, f"{task}: right on all {len(cases)} cases, within {RTOL:.0%}.")


def _units(right: float, unit: str) -> list[Mistake]:
    return [(right / 1e9, f"that is in GB; give the answer in {unit}."),
            (right / 2**30, f"that is in GiB; give the answer in {unit}.")]


# Task 1 -------------------------------------------------------------------------------------

def _bytes_case(model: str, bits: float, context: int):
    s = rl.MODELS[model]
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
    hw, s = rl.HARDWARE[hardware], rl.MODELS[model]
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

import numpy as np  # noqa: E402  (this chapter's section of a shared file: appended, not merged above)

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
        try:
            value = answer(*args)
        except NotImplementedError:
            return Result(False, f"{task}: not written yet. Replace the `raise NotImplementedError` line.")
        except Exception as exc:  # the learner's code: report it, don't crash the check cell
            return Result(False, f"{task} ({label}): your function raised {type(exc).__name__}: {exc}")
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
    try:
        answers = [answer(o, d) for o, d in _VIEW_CASES]
    except NotImplementedError:
        return Result(False, "GGUF task 2: not written yet. Replace the `raise NotImplementedError` line.")
    except Exception as exc:
        return Result(False, f"GGUF task 2: your function raised {type(exc).__name__}: {exc}")
    for rule, hint in patterns:
        if [rule(o, d) for o, d in _VIEW_CASES] == answers and answers != [c[2] for c in cases]:
            cases = [(args, label, right, [(not right, hint)]) for args, label, right, _ in cases]
            break
    return _exact("GGUF task 2", answer, cases, "offset % np.dtype(dtype).alignment == 0 (the element "
                  "size for these dtypes).", bool)
