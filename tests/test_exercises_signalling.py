"""Chapter "GDDR7 and PAM3" (book/signalling/gddr7-pam3), Signalling tasks 1 and 2:
`pytest tests/test_exercises_signalling.py -k signalling_task`."""

from __future__ import annotations

import pytest

from ref_impl import exercises as ex

# The chapter's PAM3 code, written out by hand: value 4·b0 + 2·b1 + b2 -> (first, second) symbol
PAM3_BY_HAND = {0: (1, 0), 1: (1, 1), 2: (-1, 1), 3: (0, 1), 4: (0, 0), 5: (0, -1), 6: (-1, 0), 7: (-1, -1)}


def pam3_by_hand(bits, msb_first=True, pad="end", table=PAM3_BY_HAND):
    bits = list(bits)
    fill = [0] * (-len(bits) % 3)
    bits = bits + fill if pad == "end" else fill + bits if pad == "front" else bits[:len(bits) // 3 * 3]
    out = []
    for i in range(0, len(bits), 3):
        b0, b1, b2 = bits[i:i + 3]
        out += table[4 * b0 + 2 * b1 + b2 if msb_first else b0 + 2 * b1 + 4 * b2]
    return out


def test_signalling_task_1_accepts_the_code_written_by_hand():
    assert pam3_by_hand([1, 0, 1, 1, 1]) == [0, -1, -1, 0]           # 101 -> (0,-1); 11(0) -> (-1,0)
    r = ex.check_encode_pam3(pam3_by_hand)
    assert r and "right on all" in r.message


@pytest.mark.parametrize("wrong,hint", [
    (lambda b: pam3_by_hand(b, msb_first=False), "most significant"),
    (lambda b: pam3_by_hand(b, pad="none"), "no padding"),
    (lambda b: pam3_by_hand(b, pad="front"), "pad at the end, not the front"),
    (lambda b: [s + 1 for s in pam3_by_hand(b)], "not level numbers 0, 1, 2"),
    (lambda b: pam3_by_hand(b, table={v: p[::-1] for v, p in PAM3_BY_HAND.items()}), "swapped"),
    # a table that sends the unused pair (+1,-1) instead of (0,0)
    (lambda b: pam3_by_hand(b, table={**PAM3_BY_HAND, 4: (1, -1)}), "never sends"),
    (lambda b: pam3_by_hand(b, table={**PAM3_BY_HAND, 0: (1, 1), 1: (1, 0)}), "PAM3_CODE[value]"),
])
def test_signalling_task_1_rejects_typical_mistakes_with_their_hint(wrong, hint):
    r = ex.check_encode_pam3(wrong)
    assert not r and hint in r.message, r.message


def test_signalling_task_1_garbage():
    assert "expected a list of symbols" in ex.check_encode_pam3(lambda b: ["a"]).message
    assert "whole numbers" in ex.check_encode_pam3(lambda b: [0.5, 1]).message
    for garbage in (None, [1, 0, -1]):
        assert "write a function" in ex.check_encode_pam3(garbage).message


def test_signalling_task_2_accepts_the_bandwidth_worked_by_hand():
    assert ex.check_bus_bandwidth(32 * 256 / 8)                         # 1024 GB/s, C03's bus
    assert ex.check_bus_bandwidth(1792, pin_gbps=28, bus_bits=512)      # RTX 5090
    r = ex.check_bus_bandwidth(lambda gbps, bits: gbps * bits / 8)
    assert r and "right on all 4" in r.message


@pytest.mark.parametrize("wrong,hint", [
    (32 * 256, "bits vs bytes"),
    (32, "one pin's rate (in Gbit/s)"),
    (4, "one pin's rate in GB/s"),
    (128, "one 32-pin device"),
    (1536, "don't multiply by 1.5"),
    (1024 / 1.5, "don't divide by 1.5"),
    (1024 * 1e9 / 2**30, "GiB vs GB"),
    (700, "GB/s = pin rate (Gbit/s) × data pins / 8"),
])
def test_signalling_task_2_rejects_typical_mistakes_with_their_hint(wrong, hint):
    r = ex.check_bus_bandwidth(wrong)
    assert not r and hint in r.message, r.message


def test_signalling_task_2_a_per_device_function_fails_on_a_wide_bus():
    r = ex.check_bus_bandwidth(lambda gbps, bits: gbps * 32 / 8)
    assert not r and "one 32-pin device" in r.message
