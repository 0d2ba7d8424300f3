"""Exercises of chapter "Super-blocks: K-quants" (book/kquants/super-blocks): K-quants tasks 1 to 3.

Bits per weight from a block struct, unpacking Q4_K's twelve bytes of 6-bit scales and mins, and
decoding one Q4_K super-block; checked against `formats.ggml`'s block sizes and `formats.kquants`.
Tests: `pytest tests/test_exercises_kquants.py -k k_quants_task`.

See chapter: kquants
"""

from __future__ import annotations

import numpy as np

from ref_impl.exercises.core import Result, array_answer, judge_cases, run_answer
from ref_impl.formats import kquants as kq
from ref_impl.formats.ggml import BLOCK, GGMLType

# K-quants task 1 ------------------------------------------------------------------------------

BPW_RTOL = 1e-3  # bits per weight are exact fractions, and two slips can lie 1% apart (Q6_K: 6.5, 6.5625)

# bits per quant, and the block struct's fields in bytes (ggml-common.h), for the hints; the values per
# block and the block's bytes come from formats' BLOCK
_STRUCTS = {
    "Q4_0": (4, {"d": 2, "qs": 16}),
    "Q8_0": (8, {"d": 2, "qs": 32}),
    "Q4_K": (4, {"d": 2, "dmin": 2, "scales": 12, "qs": 128}),
    "Q5_K": (5, {"d": 2, "dmin": 2, "scales": 12, "qh": 32, "qs": 128}),
    "Q6_K": (6, {"ql": 128, "qh": 64, "scales": 16, "d": 2}),
}


def _bpw_case(name: str):
    values, nbytes = BLOCK[GGMLType[name]]
    right = nbytes * 8 / values
    if name not in _STRUCTS:
        return (name,), name, right, []
    qbits, f = _STRUCTS[name]

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
    on Q4_0, Q8_0, Q4_K, Q5_K and Q6_K. Right: block bytes × 8 / values (ggml.BLOCK), within 0.1%.
    """
    names = [type_name] + [n for n in _STRUCTS if n != type_name]
    recipe = "bits per weight = (bytes of every field of the block struct) × 8 / values per block."
    return judge_cases("K-quants task 1", answer, [_bpw_case(n) for n in names], "bits/weight", recipe, BPW_RTOL)


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
        out, failed = run_answer(task, label, fn, b.copy())
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
        a, bad = array_answer(task, label, "256 numbers", fn, b.copy())
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
