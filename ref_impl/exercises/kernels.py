"""Exercises of chapter "Writing a GEMV kernel" (book/dispatch/writing-a-kernel): Kernel tasks 1 to 3.

The bytes one GEMV launch must move, its least time at a given bandwidth, and a launch choice
(rows per warp, unroll) that keeps the chapter's rules; checked against the kernels' launch rules
(`kernels.launch_config`, pure Python: no GPU needed).
Tests: `pytest tests/test_exercises_kernels.py -k kernel_task`.

See chapter: dispatch-kernel
"""

from __future__ import annotations

import numpy as np

from ref_impl.exercises.core import Result, judge_cases, run_answer, unit_slips
from ref_impl.kernels import launch as kn


def _gemv_bytes_case(n: int, k: int, bits: int, group: int, rows: int):
    launch = kn.launch_config(kn.Format(bits, group), n, k, rows)
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
        *unit_slips(right, "bytes"),
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
    return judge_cases("Kernel task 1", answer, cases, "bytes",
                       "n × k × bits / 8 for the codes, plus (affine) a 2-byte scale and a 2-byte bias per group: "
                       "n × k / group × 4, plus x and y: 2 × rows × (k + n).", rtol=1e-6)


def _gemv_time_case(n: int, k: int, bits: int, group: int, read_gbs: float):
    launch = kn.launch_config(kn.Format(bits, group), n, k, 1)
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
    return judge_cases("Kernel task 2", answer, cases, "µs",
                       "time = the bytes of Kernel task 1 (rows = 1) / (read_gbs × 1e9 bytes/s), times 1e6 for µs.")


_LAUNCH_CASES = [(14336, 4096, 1, 4), (1024, 4096, 1, 4), (4096, 1024, 1, 4), (128256, 4096, 1, 16),
                 (4096, 4096, 4, 4), (4096, 14336, 9, 8)]
_POWERS = (1, 2, 4, 8)


def _launch_rules(n: int, k: int, rows: int, bits: int, r: int, u: int):
    """(the launch, None) when rows_per_warp r and unroll u keep the chapter's rules, else (None, the broken one)."""
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
        value, failed = run_answer(task, label, fn, n, k, rows, bits)
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
