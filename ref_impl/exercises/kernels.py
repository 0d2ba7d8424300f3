"""Exercises of chapter "Writing a GEMV kernel" (book/dispatch/writing-a-kernel): Kernel tasks 1 to 5.

The bytes one GEMV launch must move, its least time at a given bandwidth, and a launch choice
(rows per warp, unroll) that keeps the chapter's rules, checked against the kernels' launch rules
(`kernels.launch_config`, pure Python: no GPU needed); the merge of attention's key-length splits
that the fused layer's attn_out does, checked against the softmax over all keys at once; and one row's
dot product with int8 activations, as the fused layers' `dot_q8` computes it (kernels/int8_cuda.py).
Tests: `pytest tests/test_exercises_kernels.py -k kernel_task`.

See chapter: dispatch-kernel
"""

from __future__ import annotations

import numpy as np

from ref_impl.exercises.core import Result, array_answer, judge_cases, run_answer, unit_slips
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


def _split_case(seed: int, keys: int, splits: int, d: int, spread: float, empty: bool):
    """One head's attention over `keys` scores (normal, standard deviation `spread`) cut into `splits` runs of
    keys (and a last split with none when `empty`): the partials (m, l, acc) attend writes, the output the
    whole softmax gives, and the outputs of the usual wrong merges."""
    rng = np.random.default_rng(seed)
    scores, values = rng.normal(0.0, spread, keys), rng.normal(0.0, 1.0, (keys, d))
    runs = np.array_split(np.arange(keys), splits) + ([np.arange(0)] if empty else [])
    m = np.array([scores[r].max() if len(r) else -np.inf for r in runs])
    e = [np.exp(scores[r] - mr) for r, mr in zip(runs, m)]
    l = np.array([x.sum() for x in e])
    acc = np.array([x @ values[r] for x, r in zip(e, runs)])
    p = np.exp(scores - scores.max())
    right = p @ values / p.sum()
    with np.errstate(all="ignore"):
        w = np.exp(m - m.max())
        mistakes = [
            (acc.sum(0) / l.sum(), "each split's sums are relative to its own maximum: rescale split s by "
                                   "exp(m_s - M), M the largest m, before adding them up."),
            ((acc / l[:, None])[l > 0].mean(0), "a split's share is not 1 / splits: weight split s by "
                                                "exp(m_s - M) l_s over the merged denominator."),
            (w @ acc, "the merged sum still needs dividing by the merged denominator, sum_s exp(m_s - M) l_s."),
            (w @ acc / w.sum(), "the denominator is sum_s exp(m_s - M) l_s: l_s counts a split's keys' weights."),
            (np.exp(m) @ acc / (np.exp(m) @ l), "exp(m_s) alone overflows for large scores: subtract the "
                                                 "largest m first (the same factor cancels above and below)."),
        ]
    label = f"{keys} keys in {splits} split{'s' * (splits > 1)}" + (" and an empty one" if empty else "") + \
        (f", scores up to ~{3 * spread:g}" if spread > 10 else "")
    return (m, l, acc), label, right, mistakes


def check_merge_splits(fn) -> Result:
    """Kernel task 4: `fn(m, l, acc) -> out`, the attention output of one head (d values) from its key-length
    splits' partials, as attend writes them and attn_out merges them: per split s, m[s] the largest score, l[s] =
    sum_j exp(score_j - m[s]) and acc[s] = sum_j exp(score_j - m[s]) v_j (a split with no keys: -inf, 0, zeros).

    Called on four cases (one split; uneven splits; an empty split; scores in the hundreds) against the softmax of
    all the scores at once, within 1e-9 relative.
    """
    task = "Kernel task 4"
    cases = [_split_case(0, 64, 1, 8, 1.0, False), _split_case(1, 300, 5, 16, 2.0, False),
             _split_case(2, 100, 4, 8, 1.0, True), _split_case(3, 200, 3, 4, 300.0, False)]
    for args, label, right, mistakes in cases:
        got, bad = array_answer(task, label, f"{right.size} numbers", fn, *args)
        if bad is not None:
            return bad
        if got.shape != right.shape:
            return Result(False, f"{task} ({label}): expected {right.size} values (one per dimension of v), "
                                 f"got shape {got.shape}.")
        if np.allclose(got, right, rtol=1e-9, atol=1e-12):
            continue
        if not np.isfinite(got).all():
            return Result(False, f"{task} ({label}): the output has NaN or inf. Hint: a split with no keys has "
                                 "m = -inf and l = 0; subtract the largest m (finite: some split has keys), so its "
                                 "weight exp(-inf) is 0; and exp of scores in the hundreds overflows unless you "
                                 "subtract it.")
        hint = next((h for value, h in mistakes if np.shape(value) == right.shape and np.isfinite(value).all()
                     and np.allclose(got, value, rtol=1e-9, atol=1e-12)),
                    "out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s, with M the largest m.")
        err = np.abs(got - right).max() / np.abs(right).max()
        return Result(False, f"{task} ({label}): off by {err:.3g} of the largest value. Hint: {hint}")
    return Result(True, f"{task}: right on all {len(cases)} cases, within 1e-9.")


def _q8_case(seed: int, k: int, group: int, zero_block: bool, outlier: bool):
    """One row of 4-bit codes with a scale and bias per group, an activation row x, the row's dot product as the
    int8 kernels compute it, and the outputs of the usual wrong roundings."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 16, k)
    scales, biases = rng.uniform(0.01, 0.05, k // group), rng.uniform(-0.4, -0.1, k // group)
    x = rng.normal(0.0, 1.0, k)
    if zero_block:
        x[32:64] = 0.0
    if outlier:
        x[::32] *= 20.0
    blocks = x.reshape(-1, 32)
    amax = np.abs(blocks).max(axis=1, keepdims=True)
    d = amax / 127
    q = np.rint(np.divide(blocks, d, out=np.zeros_like(blocks), where=amax > 0))
    xq = (q * d).ravel()
    per_group = lambda a: a.reshape(-1, group).sum(axis=1)
    right = scales @ per_group(codes * xq) + biases @ per_group(x)
    whole_d = np.abs(x).max() / 127
    mistakes = [
        (scales @ per_group(codes * x) + biases @ per_group(x), "round x first: per block of 32 values, d = max|x| "
                                                               "/ 127 and x ~ d round(x / d)."),
        (scales @ per_group(codes * xq) + biases @ per_group(xq), "the bias multiplies the exact sum of x over the "
                                                                 "group, not the rounded one (the kernel keeps it)."),
        (scales @ per_group(codes * np.rint(x / whole_d) * whole_d) + biases @ per_group(x),
         "one d per block of 32 values, not one for the whole row: an outlier would flatten every block."),
    ]
    label = f"k = {k}, groups of {group}" + (", a block of zeros" if zero_block else "") + \
        (", an outlier in every block" if outlier else "")
    return (codes, scales, biases, x, group), label, right, mistakes


def check_q8_dot(fn) -> Result:
    """Kernel task 5: `fn(codes, scales, biases, x, group) -> y`, one row's dot product with int8 activations as the
    fused layers compute it: weights s_g c_i + b_g (4-bit codes c, a scale and bias per group of `group` values),
    x rounded per block of 32 values (d = max|x| / 127, round(x / d)), the bias times the exact sum of x.

    Called on four cases (groups of 32 and 64; a block of zeros; an outlier in every block), within 1e-9 relative.
    """
    task = "Kernel task 5"
    cases = [_q8_case(0, 256, 32, False, False), _q8_case(1, 512, 64, False, False),
             _q8_case(2, 256, 32, True, False), _q8_case(3, 512, 32, False, True)]
    for args, label, right, mistakes in cases:
        got, bad = array_answer(task, label, "one number", fn, *args)
        if bad is not None:
            return bad
        if got.size != 1:
            return Result(False, f"{task} ({label}): expected one number (the row's dot product), got {got.size}.")
        value = float(got.ravel()[0])
        if np.isclose(value, right, rtol=1e-9, atol=1e-12):
            continue
        if not np.isfinite(value):
            return Result(False, f"{task} ({label}): the result is NaN or inf. Hint: a block of zeros has d = 0; "
                                 "its rounded values are 0, not x / 0.")
        hint = next((h for wrong, h in mistakes if np.isclose(value, wrong, rtol=1e-9, atol=1e-12)),
                    "y = sum_g s_g sum_(i in g) c_i d round(x_i / d) + b_g sum_(i in g) x_i, d per block of 32.")
        return Result(False, f"{task} ({label}): off by {abs(value - right) / abs(right):.3g} of the answer. "
                             f"Hint: {hint}")
    return Result(True, f"{task}: right on all {len(cases)} cases, within 1e-9.")
