"""Chapter "Writing a GEMV kernel" (book/dispatch/writing-a-kernel), Kernel tasks 1 to 5:
`pytest tests/test_exercises_kernels.py -k kernel_task`."""

from __future__ import annotations

import numpy as np
import pytest

from ref_impl import exercises as ex
from ref_impl.kernels import launch as launch_rules


def gemv_bytes_by_hand(n, k, bits, group, rows):
    scales = 2 * 2 * n * k // group if bits < 16 else 0        # a float16 scale and bias per group of each row
    return n * k * bits // 8 + scales + 2 * rows * (k + n)     # codes + scales and biases + x in and y out


# Llama-3.1-8B's gate (14336 x 4096) in q4 g32: codes 14336 x 4096 / 2 = 29,360,128; scales and biases
# 14336 x 128 groups x 4 bytes = 7,340,032; x and y 2 x (4096 + 14336) = 36,864 -> 36,737,024 bytes
K1_RIGHT = 36_737_024


def test_kernel_tasks_are_in_the_stub_and_crash_test():
    checkers = {name for name in dir(ex) if name.startswith("check_")}   # as tests/test_exercises_core.py picks them
    assert {"check_gemv_bytes", "check_gemv_time_us", "check_launch_choice", "check_merge_splits",
            "check_q8_dot"} <= checkers


def test_kernel_task_1_accepts_the_hand_formula():
    assert gemv_bytes_by_hand(14336, 4096, 4, 32, 1) == K1_RIGHT
    assert ex.check_gemv_bytes(K1_RIGHT)
    r = ex.check_gemv_bytes(gemv_bytes_by_hand)
    assert r and "5 cases" in r.message
    assert not ex.check_gemv_bytes(K1_RIGHT + 4096)               # counted exactly: 4 KiB is 1e-4 of it


@pytest.mark.parametrize("wrong, hint", [
    (lambda n, k, b, g, r: n * k * b // 8 + 2 * r * (k + n), "float16 scale and a float16 bias"),
    (lambda n, k, b, g, r: n * k * b // 8 + (2 * n * k // g if b < 16 else 0) + 2 * r * (k + n), "bias as well"),
    (lambda n, k, b, g, r: gemv_bytes_by_hand(n, k, b, g, r) - 2 * r * (k + n), "also reads x"),
    (lambda n, k, b, g, r: gemv_bytes_by_hand(n, k, b, g, 1), "4 rows here"),     # right on the 1-row cases
    (lambda n, k, b, g, r: 8 * gemv_bytes_by_hand(n, k, b, g, r), "8× too big"),
    (lambda n, k, b, g, r: gemv_bytes_by_hand(n, k, b, g, r) + n * k * b * 7 // 8, "4-bit code is 0.5 bytes"),
    (lambda n, k, b, g, r: gemv_bytes_by_hand(n, k, b, g, r) + (4 * n * k // g if b < 16 else 0), "not 4"),
    (lambda n, k, b, g, r: gemv_bytes_by_hand(n, k, b, g, r) / 1e9, "in GB"),
    (lambda n, k, b, g, r: gemv_bytes_by_hand(n, k, b, g, r) / 2**30, "in GiB"),
])
def test_kernel_task_1_rejects_typical_mistakes_with_their_hint(wrong, hint):
    r = ex.check_gemv_bytes(wrong)
    assert not r and hint in r.message, r.message


def test_kernel_task_1_rejects_a_number_without_scales_and_garbage():
    r = ex.check_gemv_bytes(29_360_128 + 36_864)
    assert not r and "float16 scale" in r.message, r.message
    assert "finite number" in ex.check_gemv_bytes("36 MB").message


def gemv_time_by_hand(n, k, bits, group, read_gbs):
    return gemv_bytes_by_hand(n, k, bits, group, 1) / (read_gbs * 1e9) * 1e6


def test_kernel_task_2_accepts_the_hand_formula():
    # 36,737,024 bytes / 3.3e12 bytes/s = 11.13 µs
    assert gemv_time_by_hand(14336, 4096, 4, 32, 3300.0) == pytest.approx(11.132, abs=1e-3)
    assert ex.check_gemv_time_us(11.13)
    r = ex.check_gemv_time_us(gemv_time_by_hand)
    assert r and "4 cases" in r.message


@pytest.mark.parametrize("wrong, hint", [
    (lambda n, k, b, g, bw: gemv_time_by_hand(n, k, b, g, bw) / 1e3, "milliseconds"),
    (lambda n, k, b, g, bw: gemv_time_by_hand(n, k, b, g, bw) / 1e6, "in seconds"),
    (lambda n, k, b, g, bw: gemv_bytes_by_hand(n, k, b, g, 1) / (bw * 2**30) * 1e6, "not 2^30"),
    (lambda n, k, b, g, bw: 2 * n * k / (bw * 1e9) * 1e6, "not 16-bit"),
    (lambda n, k, b, g, bw: (n * k * b // 8 + 2 * (k + n)) / (bw * 1e9) * 1e6, "scale and bias"),
])
def test_kernel_task_2_rejects_typical_mistakes_with_their_hint(wrong, hint):
    r = ex.check_gemv_time_us(wrong)
    assert not r and hint in r.message, r.message


LAUNCH_CASES = [(14336, 4096, 1, 4), (1024, 4096, 1, 4), (4096, 1024, 1, 4), (128256, 4096, 1, 16),
                (4096, 4096, 4, 4), (4096, 14336, 9, 8)]


def launch_choices_by_hand(n, k, rows, bits):
    """Every (rows_per_warp, unroll) that keeps the chapter's rules, by brute force."""
    chunks = -(-k // (128 // bits) // 32)                       # 16-byte chunks of one row per lane
    ok = {(r, u): r * min(u, chunks) for r in (1, 2, 4, 8) for u in (1, 2, 4, 8)
          if r * rows <= 16 and r * u <= 8 and (r == 1 or -(-n // r) >= 8 * 132) and u <= chunks}
    return [c for c, in_flight in ok.items() if in_flight >= min(4, max(ok.values()))]


def launch_by_hand(n, k, rows, bits):
    return launch_choices_by_hand(n, k, rows, bits)[0]


def test_kernel_task_3_hand_choices():
    assert launch_choices_by_hand(1024, 4096, 1, 4) == [(1, 4)]             # 1024 rows: one row a warp
    assert launch_choices_by_hand(4096, 1024, 1, 4) == [(2, 1)]             # one chunk a lane: unroll 1
    assert launch_choices_by_hand(4096, 14336, 9, 8) == [(1, 4), (1, 8)]    # 9 rows: one weight row a warp
    assert all(launch_choices_by_hand(*case) for case in LAUNCH_CASES)     # a right answer exists everywhere


@pytest.mark.parametrize("case, choice", [(case, c) for case in LAUNCH_CASES for c in launch_choices_by_hand(*case)])
def test_kernel_task_3_accepts_every_right_choice(case, choice):
    r = ex.check_launch_choice(lambda *args: choice if args == case else launch_by_hand(*args))
    assert r, r.message


def test_kernel_task_3_launch_config_default_passes():
    def default(n, k, rows, bits):
        launch = launch_rules.launch_config(launch_rules.Format(bits, 0 if bits == 16 else 32), n, k, rows)
        return launch.rows_per_warp, launch.unroll
    r = ex.check_launch_choice(default)
    assert r and "6 cases" in r.message, r.message


def only_on(test, choice):
    """launch_by_hand, except `choice` on the cases where test(n, k, rows, bits) holds."""
    return lambda *args: choice if test(*args) else launch_by_hand(*args)


@pytest.mark.parametrize("wrong, hint", [
    (lambda *_: (3, 4), "each 1, 2, 4 or 8"),
    (only_on(lambda n, k, rows, b: rows == 9, (2, 4)), "MAX_ACCUMULATORS = 16"),
    (lambda *_: (4, 4), "MAX_LOADS = 8"),
    (only_on(lambda n, k, rows, b: n == 1024, (2, 4)), "fill the GPU: 512 warps"),
    (lambda *_: (1, 8), "idle loads"),
    (only_on(lambda n, k, rows, b: k == 1024, (2, 2)), "only 1 chunk of 16 bytes"),
    (lambda *_: (1, 1), "bytes in flight"),
    (only_on(lambda n, k, rows, b: k == 1024, (1, 1)), "the rules allow 2 here"),
])
def test_kernel_task_3_rejects_each_broken_rule_by_name(wrong, hint):
    r = ex.check_launch_choice(wrong)
    assert not r and hint in r.message, r.message


@pytest.mark.parametrize("wrong", [lambda *_: 2, lambda *_: (2, 4, 1), lambda *_: [2, 4], lambda *_: (2.0, 4),
                                   lambda *_: (True, 4)])
def test_kernel_task_3_wants_a_tuple_of_two_whole_numbers(wrong):
    r = ex.check_launch_choice(wrong)
    assert not r and "expected a tuple (rows_per_warp, unroll)" in r.message, r.message


def test_kernel_task_3_reports_launch_config_refusing_a_choice(monkeypatch):
    real = launch_rules.launch_config

    def refuses_2_4(fmt, n, k, rows, rows_per_warp=None, unroll=None, **kw):
        if (rows_per_warp, unroll) == (2, 4):
            raise ValueError("no (2, 4) here")
        return real(fmt, n, k, rows, rows_per_warp, unroll, **kw)
    monkeypatch.setattr(launch_rules, "launch_config", refuses_2_4)   # the launch rules the checker reads
    r = ex.check_launch_choice(lambda *_: (2, 4))
    assert not r and "launch_config refuses it: no (2, 4) here" in r.message, r.message


def merge_by_hand(m, l, acc):
    w = np.exp(m - np.max(m))                 # each split rescaled to the largest maximum; an empty split weighs 0
    return w @ acc / (w @ l)


def test_kernel_task_4_accepts_the_merged_softmax():
    r = ex.check_merge_splits(merge_by_hand)
    assert r and "4 cases" in r.message


@pytest.mark.parametrize("wrong, hint", [
    (lambda m, l, acc: acc.sum(0) / l.sum(), "rescale split s"),
    (lambda m, l, acc: (acc / l[:, None])[l > 0].mean(0), "not 1 / splits"),
    (lambda m, l, acc: np.exp(m - m.max()) @ acc, "dividing by the merged denominator"),
    (lambda m, l, acc: np.exp(m - m.max()) @ acc / np.exp(m - m.max()).sum(), "denominator"),
    (lambda m, l, acc: np.exp(m) @ acc / (np.exp(m) @ l), "NaN or inf"),
    (lambda m, l, acc: merge_by_hand(m, l, acc)[:-1], "one per dimension"),
])
def test_kernel_task_4_names_the_mistake(wrong, hint):
    with np.errstate(all="ignore"):
        r = ex.check_merge_splits(wrong)
    assert not r and hint in r.message, r.message


def q8_dot_by_hand(codes, scales, biases, x, group):
    """Written from the task's text: x rounded per block of 32 (d = max|x| / 127), the bias on the exact sums."""
    y = 0.0
    for b in range(len(x) // 32):
        xs = x[32 * b: 32 * b + 32]
        d = max(abs(v) for v in xs) / 127
        for i, v in enumerate(xs):
            j = 32 * b + i
            q = round(v / d) if d > 0 else 0               # Python's round: half to even, as np.rint
            y += scales[j // group] * codes[j] * q * d
    return y + sum(biases[g] * sum(x[g * group:(g + 1) * group]) for g in range(len(x) // group))


def test_kernel_task_5_accepts_the_rounding_by_hand():
    r = ex.check_q8_dot(q8_dot_by_hand)
    assert r and "4 cases" in r.message, r.message


def no_rounding(codes, scales, biases, x, group):
    w = np.repeat(scales, group) * codes + np.repeat(biases, group)
    return float(w @ x)


def bias_on_rounded(codes, scales, biases, x, group):
    blocks = x.reshape(-1, 32)
    d = np.abs(blocks).max(axis=1, keepdims=True) / 127
    xq = (np.rint(np.divide(blocks, d, out=np.zeros_like(blocks), where=d > 0)) * d).ravel()
    return float((np.repeat(scales, group) * codes + np.repeat(biases, group)) @ xq)


def one_d(codes, scales, biases, x, group):
    d = np.abs(x).max() / 127
    xq = np.rint(x / d) * d
    return float((np.repeat(scales, group) * codes) @ xq + np.repeat(biases, group) @ x)


def zero_division(codes, scales, biases, x, group):
    blocks = x.reshape(-1, 32)
    d = np.abs(blocks).max(axis=1, keepdims=True) / 127
    xq = (np.rint(blocks / d) * d).ravel()
    return float((np.repeat(scales, group) * codes) @ xq + np.repeat(biases, group) @ x)


@pytest.mark.parametrize("wrong, hint", [
    (no_rounding, "round x first"),
    (bias_on_rounded, "exact sum of x"),
    (one_d, "one d per block of 32"),
    (zero_division, "NaN or inf"),
    (lambda codes, scales, biases, x, group: np.zeros(2), "expected one number"),
    (lambda codes, scales, biases, x, group: 1.0, "off by"),
])
def test_kernel_task_5_names_the_mistake(wrong, hint):
    with np.errstate(all="ignore"):
        r = ex.check_q8_dot(wrong)
    assert not r and hint in r.message, r.message
