"""Chapter "Super-blocks: K-quants" (book/kquants/super-blocks), K-quants tasks 1 to 3:
`pytest tests/test_exercises_kquants.py -k k_quants_task`."""

from __future__ import annotations

import numpy as np
import pytest

from ref_impl import exercises as ex
from ref_impl.formats.kquants import pack_scales_q4_k

# The block structs of ggml-common.h, field by field in bytes, and the values each block holds
STRUCT_BYTES = {"Q4_0": (32, 2 + 16),                 # d, qs[16]
                "Q8_0": (32, 2 + 32),                 # d, qs[32]
                "Q4_K": (256, 2 + 2 + 12 + 128),      # d, dmin, scales[12], qs[128]
                "Q5_K": (256, 2 + 2 + 12 + 32 + 128),  # d, dmin, scales[12], qh[32], qs[128]
                "Q6_K": (256, 128 + 64 + 16 + 2)}     # ql[128], qh[64], scales[16], d


def bits_per_weight(type_name):
    values, nbytes = STRUCT_BYTES[type_name]
    return nbytes * 8 / values


def test_k_quants_task_1_accepts_the_right_number_and_function():
    assert bits_per_weight("Q4_K") == 4.5 and bits_per_weight("Q6_K") == 6.5625
    assert ex.check_bits_per_weight(4.5)
    assert ex.check_bits_per_weight(144 * 8 / 256)
    assert ex.check_bits_per_weight(6.5625, type_name="Q6_K")
    assert ex.check_bits_per_weight(6.56, type_name="Q6_K")  # rounded to 3 figures
    r = ex.check_bits_per_weight(bits_per_weight)
    assert r and "5 cases" in r.message


@pytest.mark.parametrize("wrong, type_name, hint", [
    (4, "Q4_K", "only the quant bits"),
    (6, "Q6_K", "only the quant bits"),
    (0.5625, "Q4_K", "bytes per weight"),
    (1152, "Q4_K", "bits per block"),
    (4.625, "Q4_K", "packed into 12 bytes"),                   # 16 scale bytes of 8 bits: 148 B
    (4.4375, "Q4_K", "left out dmin"),                         # 142 B
    (4.375, "Q4_K", "left out d and dmin"),                    # 140 B: only the 6-bit scales and mins
    (4.125, "Q4_K", "12 bytes of packed 6-bit scales"),        # 132 B
    (5.0, "Q4_K", "not an fp16 pair"),                         # 4 + 32/32: fp16 scale and min per sub-block
    (36, "Q4_K", "8 sub-blocks of 32"),                        # 144 × 8 / 32
    (4.5, "Q5_K", "left out qh"),
    (5.4375, "Q5_K", "left out dmin"),
    (6.5, "Q6_K", "left out d"),                               # 208 B: 1% from the right 6.5625
    (6.4375, "Q6_K", "whole int8 bytes"),
    (6.625, "Q6_K", "no dmin"),
    (5.0, "Q4_0", "not fp32"),
])
def test_k_quants_task_1_rejects_typical_mistakes_with_their_hint(wrong, type_name, hint):
    r = ex.check_bits_per_weight(wrong, type_name=type_name)
    assert not r and hint in r.message, r.message


def test_k_quants_task_1_a_function_that_forgets_dmin_fails_on_q4_k():
    def no_dmin(name):
        values, nbytes = STRUCT_BYTES[name]
        return (nbytes - (2 if name in ("Q4_K", "Q5_K") else 0)) * 8 / values
    r = ex.check_bits_per_weight(no_dmin, type_name="Q4_0")  # Q4_0, Q8_0 right, then Q4_K wrong
    assert not r and "Q4_K" in r.message and "left out dmin" in r.message


def test_k_quants_task_1_garbage_and_crashes():

    assert "raised KeyError" in ex.check_bits_per_weight(lambda name: {}[name]).message
    for garbage in (None, "4.5", True, float("nan"), [4.5]):
        r = ex.check_bits_per_weight(garbage)
        assert not r and "finite number" in r.message
    assert ex.check_bits_per_weight(np.float32(4.5))
    assert not ex.check_bits_per_weight(-4.5)


def unpack_by_hand(b):
    """get_scale_min_k4, bit by bit."""
    b = [int(x) for x in b]
    scales, mins = [], []
    for j in range(8):
        if j < 4:
            scales.append(b[j] & 0b111111)
            mins.append(b[j + 4] & 0b111111)
        else:
            scales.append((b[j + 4] & 0x0F) | ((b[j - 4] >> 6) << 4))
            mins.append((b[j + 4] >> 4) | ((b[j] >> 6) << 4))
    return scales, mins


def unpack_no_high_bits(b):
    s, m = unpack_by_hand(b)
    return s[:4] + [int(x) & 15 for x in b[8:12]], m[:4] + [int(x) >> 4 for x in b[8:12]]


def unpack_swapped(b):
    s, m = unpack_by_hand(b)
    return m, s


def unpack_nibbles_swapped(b):
    b = [int(x) for x in b]
    s, m = unpack_by_hand(b)
    return (s[:4] + [(b[j + 8] >> 4) | ((b[j] >> 6) << 4) for j in range(4)],
            m[:4] + [(b[j + 8] & 15) | ((b[j + 4] >> 6) << 4) for j in range(4)])


def unpack_high_bits_from_wrong_bytes(b):
    b = [int(x) for x in b]
    s, m = unpack_by_hand(b)
    return (s[:4] + [(b[j + 8] & 15) | ((b[j + 4] >> 6) << 4) for j in range(4)],
            m[:4] + [(b[j + 8] >> 4) | ((b[j] >> 6) << 4) for j in range(4)])


def unpack_unmasked(b):
    s, m = unpack_by_hand(b)
    return [int(x) for x in b[0:4]] + s[4:], [int(x) for x in b[4:8]] + m[4:]


def unpack_high_bits_unshifted(b):
    b = [int(x) for x in b]
    s, m = unpack_by_hand(b)
    return (s[:4] + [(b[j + 8] & 15) | (b[j] & 0xC0) for j in range(4)],
            m[:4] + [(b[j + 8] >> 4) | (b[j + 4] & 0xC0) for j in range(4)])


def test_k_quants_task_2_accepts_a_right_unpacker():
    r = ex.check_unpack_scales(unpack_by_hand)
    assert r and "12 blocks" in r.message
    assert ex.check_unpack_scales(lambda b: tuple(np.array(v, np.uint8) for v in unpack_by_hand(b)))
    assert ex.check_unpack_scales(lambda b: np.array(unpack_by_hand(b)))  # a (2, 8) array unpacks too


@pytest.mark.parametrize("wrong, hint", [
    (unpack_no_high_bits, "high 2 bits ignored"),
    (unpack_swapped, "scales and mins swapped"),
    (unpack_nibbles_swapped, "nibbles of bytes 8-11 swapped"),
    (unpack_high_bits_from_wrong_bytes, "high bits from the wrong bytes"),
    (unpack_unmasked, "low 6 bits of their byte"),
    (unpack_high_bits_unshifted, "(byte >> 6) << 4"),
    (lambda b: ([0] * 8, [0] * 8), "bytes 0-3: scales 0-3"),
])
def test_k_quants_task_2_rejects_typical_mistakes_with_their_hint(wrong, hint):
    r = ex.check_unpack_scales(wrong)
    assert not r and hint in r.message, r.message


def test_k_quants_task_2_wrong_lengths_and_garbage():
    assert "raised IndexError" in ex.check_unpack_scales(lambda b: (b[20], b[21])).message
    r = ex.check_unpack_scales(lambda b: tuple(v[:4] for v in unpack_by_hand(b)))
    assert not r and "4 values, not 8" in r.message and "Sub-blocks 4-7" in r.message
    r = ex.check_unpack_scales(lambda b: unpack_by_hand(b)[0])  # scales only: 8 items, not a pair
    assert not r and "pair (scales, mins)" in r.message
    assert "pair (scales, mins)" in ex.check_unpack_scales(lambda b: None).message
    assert "whole numbers" in ex.check_unpack_scales(lambda b: ([0.5] * 8, [0] * 8)).message
    assert "8 integers" in ex.check_unpack_scales(lambda b: ("abcdefgh", [0] * 8)).message
    for garbage in (None, 3, unpack_by_hand([0] * 12)):
        assert "write a function" in ex.check_unpack_scales(garbage).message


def decode_by_hand(block, qs_order="chunks", sign=-1.0, use_min=True, use_d=True, centre=0):
    """dequantize_row_q4_K, loop by loop, in Python floats; the keywords make its typical slips."""
    d = float(np.frombuffer(bytes(block[0:2]), "<f2")[0])
    dmin = float(np.frombuffer(bytes(block[2:4]), "<f2")[0])
    scales, mins = unpack_by_hand(block[4:16])
    qs = [int(x) for x in block[16:144]]
    if qs_order == "chunks":       # right: 4 chunks of 32 bytes, low nibbles then high nibbles
        q = []
        for c in range(4):
            q += [x & 15 for x in qs[32 * c:32 * c + 32]] + [x >> 4 for x in qs[32 * c:32 * c + 32]]
    elif qs_order == "pairs":      # values 2k, 2k+1 from byte k
        q = [n for x in qs for n in (x & 15, x >> 4)]
    else:                          # all low nibbles, then all high nibbles, as Q4_0
        q = [x & 15 for x in qs] + [x >> 4 for x in qs]
    y = []
    for i in range(256):
        j = i // 32
        scale = (d if use_d else 1.0) * scales[j]
        y.append(scale * (q[i] - centre) + (sign * dmin * mins[j] if use_min else 0.0))
    return y


def test_k_quants_task_3_accepts_a_right_decoder():
    r = ex.check_decode_q4_k(decode_by_hand)
    assert r and "4 blocks" in r.message
    assert ex.check_decode_q4_k(lambda b: np.array(decode_by_hand(b), np.float32).reshape(8, 32))


def decode_float16(block):
    """numpy's promotion: float16 × uint8 stays float16."""
    d, dmin = np.frombuffer(bytes(block[0:4]), "<f2")
    sc, mn = (np.array(v, np.uint8) for v in unpack_by_hand(block[4:16]))
    qs = np.asarray(block[16:]).reshape(4, 32)
    q = np.stack([qs & 15, qs >> 4], axis=1).reshape(8, 32)
    return ((d * sc)[:, None] * q - (dmin * mn)[:, None]).ravel()


def with_bytes(block, at, new):
    b = np.array(block, np.uint8)
    b[at:at + len(new)] = new
    return b


def decode_swapped_d(block):
    return decode_by_hand(with_bytes(with_bytes(block, 0, block[2:4]), 2, block[0:2]))


def decode_swapped_scales(block):
    s, m = unpack_by_hand(block[4:16])
    return decode_by_hand(with_bytes(block, 4, pack_scales_q4_k(np.array([m]), np.array([s]))[0]))


def decode_unit_min(block):
    return decode_by_hand(with_bytes(block, 2, np.array([1.0], "<f2").view(np.uint8)))


def decode_no_high_scale_bits(block):
    s, m = unpack_no_high_bits(block[4:16])
    return decode_by_hand(with_bytes(block, 4, pack_scales_q4_k(np.array([s]), np.array([m]))[0]))


@pytest.mark.parametrize("wrong, hint", [
    (lambda b: decode_by_hand(b, qs_order="pairs"), "not values 2k and 2k+1"),
    (lambda b: decode_by_hand(b, qs_order="halves"), "not all 128 low nibbles first"),
    (lambda b: decode_by_hand(b, sign=+1.0), "subtract the min"),
    (lambda b: decode_by_hand(b, use_min=False), "forgot the min"),
    (lambda b: decode_by_hand(b, use_d=False), "multiply it by the super-block's d"),
    (decode_unit_min, "multiply it by the super-block's dmin"),
    (decode_swapped_d, "d and dmin swapped"),
    (decode_swapped_scales, "scales and mins swapped"),
    (lambda b: decode_by_hand(b, centre=8), "no −8"),
    (decode_float16, "float16"),
    (decode_no_high_scale_bits, "only sub-blocks 4-7 are wrong"),
    (lambda b: decode_by_hand(b)[::-1], "x = d·sc[j]·q − dmin·m[j]"),
])
def test_k_quants_task_3_rejects_typical_mistakes_with_their_hint(wrong, hint):
    r = ex.check_decode_q4_k(wrong)
    assert not r and hint in r.message, r.message


def test_k_quants_task_3_wrong_shapes_and_garbage():
    r = ex.check_decode_q4_k(lambda b: [x & 15 for x in b[16:]])
    assert not r and "got 128 values" in r.message and "two 4-bit quants" in r.message
    assert "got 144 values" in ex.check_decode_q4_k(lambda b: b).message
    assert "got 1 values" in ex.check_decode_q4_k(lambda b: None).message
    assert "expected 256 numbers" in ex.check_decode_q4_k(lambda b: ["x"] * 256).message
    assert "inf or nan" in ex.check_decode_q4_k(lambda b: [float("nan")] * 256).message
    for garbage in (None, "decode", decode_by_hand([0] * 144)):
        assert "write a function" in ex.check_decode_q4_k(garbage).message
