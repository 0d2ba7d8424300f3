"""Exercises of chapter "GDDR7 and PAM3" (book/signalling/gddr7-pam3): Signalling tasks 1 and 2.

Encoding bits with the chapter's PAM3 code, and a GDDR bus's peak bandwidth; checked against
`theory.signalling`. Tests: `pytest tests/test_exercises_signalling.py -k signalling_task`.

See chapter: signalling
"""

from __future__ import annotations

import numpy as np

from ref_impl.exercises.core import Result, judge_cases, run_answer
from ref_impl.theory import signalling as sg


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
        out, failed = run_answer(task, label, fn, list(bits))
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
    return judge_cases("Signalling task 2", answer, cases, "GB/s", "GB/s = pin rate (Gbit/s) × data pins / 8.")
