"""The 2- and 3-bit K-quant writers, bit-exact with llama.cpp's reference C code, and Q5_1.

These are the quantizers that llama.cpp's file types Q2_K and Q3_K_S/M/L need beyond kquants.py's:

    block_q2_K = { scales: uint8[16], qs: uint8[64], d, dmin: fp16 }         # 256 values, 84 bytes
    block_q3_K = { hmask: uint8[32], qs: uint8[64], scales: uint8[12], d: fp16 }   # 256 values, 110 bytes
    block_q5_1 = { d, m: fp16, qh: uint32, qs: uint8[16] }                   # 32 values, 24 bytes

(kquants.py decodes all three; its docstring gives the bit layouts.) Q5_1 is here because it is the
fallback of Q5_K, which Q3_K_M and Q3_K_L put on attn_v and ffn_down: a row that 256 does not divide
gets Q5_1.

Q2_K (ggml-quants.c `quantize_row_q2_K_ref`): each sub-block of 16 is fitted as x ~ scale*q - min
with q in 0..3 by `make_qkx2_quants` (kquants.py: nmax 3, 16 step counts 2.5 + 0.1*k, weights |x|,
and, unlike Q4_K, the weighted *absolute* error as the criterion). The 16 scales and the 16 mins
become 4-bit integers against the largest of each (d = max_scale/15, dmin = max_min/15), packed as
scales[j] = sc | m << 4, and the quants are recomputed: q = nearest((x + dmin*m)/(d*sc)) in 0..3.

Q3_K (`quantize_row_q3_K_ref`, `make_q3_quants`): each sub-block of 16 is symmetric, q in -4..3.
It starts from scale = max/-4 (the value of largest magnitude on level -4), then improves the fit
one value at a time: for value i, the best code given all the others is nearest(x_i * S_ll / S_xl)
(sums without i), and the change is kept if it raises the explained energy S_xl^2 / S_ll (weights
x^2); up to five passes over the 16 values, stopping after a pass that changes nothing. The 16
scales S_xl / S_ll become 6-bit signed integers against the largest in magnitude (d = max/-32),
and the quants are recomputed with d*s[j].

Q5_1 (`quantize_row_q5_1_ref`): d = (max - min)/31, m = min, q = (uint8)((x - min)/d + 0.5).

The same float32 rules as kquants.py: every product and sum rounded in the C source's order, sums
one term at a time, nearest_int's round-half-to-even, and the non-FMA build of llama.cpp as the
reference. The Q3_K search is sequential within a sub-block but independent across sub-blocks, so
it runs as 16 x 5 steps over all sub-blocks at once.

See chapter: kquants
"""

from __future__ import annotations

import numpy as np

from ref_impl.formats.kquants import (GROUP_MAX_EPS, first_absmax, fp16_bytes, make_qkx2_quants, nearest_int,
                                      quantize_rows, running_max, seqsum, trunc_int8)

f32 = np.float32


def _pack_2bit(q: np.ndarray) -> np.ndarray:
    """Codes 0..3 (n, 256) -> qs (n, 64): value 128h + 32k + l goes to bits 2k, 2k+1 of byte 32h + l."""
    q = q.astype(np.uint8).reshape(-1, 2, 4, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)).reshape(-1, 64)


# ------------------------------------------------------------------------------------------- Q2_K

def quantize_q2_k(x: np.ndarray) -> np.ndarray:
    """Float32 (..., n), n a multiple of 256 -> uint8 Q2_K super-blocks (..., n // 256 * 84).

    As ggml-quants.c quantize_row_q2_K_ref (make_qkx2_quants with nmax 3, rmin -0.5, rdelta 0.1,
    15 steps, absolute error), which llama.cpp's quantizer runs when there is no importance matrix."""
    return quantize_rows(x, "Q2_K", _q2_k_blocks, chunk=512)


def _q2_k_blocks(x: np.ndarray) -> np.ndarray:
    n = len(x)
    xs = np.ascontiguousarray(x.reshape(n * 16, 16).T)         # (16, n*16): sub-blocks in columns
    q, scales, mins = make_qkx2_quants(xs, np.abs(xs), 3, -0.5, 0.1, 15, mad=True)
    scales, mins = scales.reshape(n, 16), mins.reshape(n, 16)
    max_scale, max_min = running_max(scales), running_max(mins)
    # 4-bit scale and min against the largest ones; each lands in a uint8_t (mod 256), the min shifted up
    has_scale, has_min = (max_scale > 0)[:, None], (max_min > 0)[:, None]
    ls = np.where(has_scale, nearest_int((f32(15) / max_scale)[:, None] * scales), 0)
    lm = np.where(has_min, nearest_int((f32(15) / max_min)[:, None] * mins), 0)
    packed = ((ls & 0xFF) | ((lm << 4) & 0xFF)).astype(np.uint8)
    d16 = np.where(has_scale[:, 0], max_scale / f32(15), f32(0)).astype("<f2")
    dmin16 = np.where(has_min[:, 0], max_min / f32(15), f32(0)).astype("<f2")
    d = (d16.astype(np.float32)[:, None] * (packed & 0x0F).astype(np.float32))[:, :, None]   # (n, 16, 1)
    dm = (dmin16.astype(np.float32)[:, None] * (packed >> 4).astype(np.float32))[:, :, None]
    requant = np.clip(nearest_int((x.reshape(n, 16, 16) + dm) / d), 0, 3)
    q = np.where(d != 0, requant, q.T.reshape(n, 16, 16))      # d == 0 keeps the search's codes
    return np.concatenate([packed, _pack_2bit(q.reshape(n, 256)), d16.view(np.uint8).reshape(n, 2),
                           dmin16.view(np.uint8).reshape(n, 2)], axis=1)


# ------------------------------------------------------------------------------------------- Q3_K

def _make_q3_quants(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml-quants.c make_q3_quants (nmax 4, do_rmse) for sub-blocks x (16, n) position-major.

    Returns codes (16, n) as float32 0..7 (0 in an all-zero sub-block) and scale (n,), x ~ scale*(q - 4)."""
    amax, vmax = first_absmax(x)
    w = x * x
    wx = w * x
    lv = np.clip(nearest_int((f32(-4) / vmax) * x), -4, 3).astype(np.float32)   # levels -4..3
    sumlx, suml2 = seqsum(wx * lv), seqsum(w * lv * lv)
    for _ in range(5):
        changed = np.zeros(x.shape[1], bool)
        for i in range(len(x)):                # value i's best level given the others, kept if the fit improves
            slx = sumlx - wx[i] * lv[i]
            sl2 = suml2 - w[i] * lv[i] * lv[i]
            new = np.clip(nearest_int(x[i] * sl2 / slx), -4, 3).astype(np.float32)
            slx_new = slx + wx[i] * new
            sl2_new = sl2 + w[i] * new * new
            take = ((slx > 0) & (new != lv[i]) & (sl2_new > 0)
                    & (slx_new * slx_new * suml2 > sumlx * sumlx * sl2_new))
            lv[i] = np.where(take, new, lv[i])
            sumlx, suml2 = np.where(take, slx_new, sumlx), np.where(take, sl2_new, suml2)
            changed |= take
        if not changed.any():                  # a pass without change would repeat itself
            break
    zero = amax < GROUP_MAX_EPS
    scale = np.where(suml2 > 0, sumlx / suml2, f32(0))
    return np.where(zero, f32(0), lv + f32(4)), np.where(zero, f32(0), scale)


def quantize_q3_k(x: np.ndarray) -> np.ndarray:
    """Float32 (..., n), n a multiple of 256 -> uint8 Q3_K super-blocks (..., n // 256 * 110).

    As ggml-quants.c quantize_row_q3_K_ref (make_q3_quants, then 6-bit scales against the largest),
    which llama.cpp's quantizer runs when there is no importance matrix."""
    return quantize_rows(x, "Q3_K", _q3_k_blocks, chunk=512)


def _q3_k_blocks(x: np.ndarray) -> np.ndarray:
    n = len(x)
    q, scales = _make_q3_quants(np.ascontiguousarray(x.reshape(n * 16, 16).T))
    scales = scales.reshape(n, 16)
    _, max_scale = first_absmax(scales.T)
    has_scale = (max_scale != 0)[:, None]      # C's `if (max_scale)`: nan counts as set
    iscale = f32(-32) / max_scale
    # int8_t l = nearest_int(.) wraps mod 256, then MAX(-32, MIN(31, l)) + 32: 6 bits, 0 where unset
    ls = np.where(has_scale, np.clip(nearest_int(iscale[:, None] * scales).astype(np.int8), -32, 31) + 32, 0)
    ls = ls.astype(np.uint8)
    high = (ls >> 4).reshape(n, 4, 4)          # (n, j // 4, j % 4): 2 bits each into bytes 8..11
    packed = np.concatenate([(ls[:, :8] & 0x0F) | ((ls[:, 8:] & 0x0F) << 4),
                             high[:, 0] | (high[:, 1] << 2) | (high[:, 2] << 4) | (high[:, 3] << 6)], axis=1)
    d16 = np.where(has_scale[:, 0], f32(1) / iscale, f32(0)).astype("<f2")
    d = (d16.astype(np.float32)[:, None] * (ls.astype(np.float32) - f32(32)))[:, :, None]   # (n, 16, 1)
    requant = np.clip(nearest_int(x.reshape(n, 16, 16) / d), -4, 3) + 4
    codes = np.where(d != 0, requant, q.T.reshape(n, 16, 16)).astype(np.uint8).reshape(n, 256)
    high_bit = (codes > 3).reshape(n, 8, 32)   # value 32b + m: bit b of hmask[m]
    hmask = np.zeros((n, 32), np.uint8)
    for b in range(8):
        hmask |= high_bit[:, b].astype(np.uint8) << b
    return np.concatenate([hmask, _pack_2bit(codes & 3), packed, d16.view(np.uint8).reshape(n, 2)], axis=1)


# ------------------------------------------------------------------------------------------- Q5_1

def quantize_q5_1(x: np.ndarray) -> np.ndarray:
    """Float32 (..., n), n a multiple of 32 -> uint8 Q5_1 blocks (..., n // 32 * 24).

    As ggml-quants.c quantize_row_q5_1_ref. llama.cpp writes Q5_1 for a Q5_K tensor whose rows are
    not a multiple of 256 (Q3_K_M's first attn_v matrices, for one)."""
    return quantize_rows(x, "Q5_1", _q5_1_blocks)


def _q5_1_blocks(x: np.ndarray) -> np.ndarray:
    lo, hi = np.full(len(x), np.inf, np.float32), np.full(len(x), -np.inf, np.float32)
    for v in x.T:                              # C's `if (v < min)`: the first of equal values (+-0) stays
        lo, hi = np.where(v < lo, v, lo), np.where(v > hi, v, hi)
    d = (hi - lo) / f32(31)
    inv_d = np.where(d != 0, f32(1) / d, f32(0))
    q = trunc_int8((x - lo[:, None]) * inv_d[:, None] + f32(0.5)).view(np.uint8)   # (uint8_t) cast: 0..31
    qh = ((q >> 4).astype(np.uint32) << np.arange(32, dtype=np.uint32)).sum(axis=1, dtype=np.uint32)
    return np.concatenate([fp16_bytes(d), fp16_bytes(lo), qh.astype("<u4").view(np.uint8).reshape(-1, 4),
                           (q[:, :16] & 0x0F) | ((q[:, 16:] & 0x0F) << 4)], axis=1)


# GGML type name -> quantizer, float32 (..., n) -> uint8 (..., row_bytes); quantize.QUANTIZE joins it to kquants'
QUANTIZE = {"Q2_K": quantize_q2_k, "Q3_K": quantize_q3_k, "Q5_1": quantize_q5_1}
