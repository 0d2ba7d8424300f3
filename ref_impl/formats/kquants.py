"""Block quantization in the GGML formats, bit-exact with llama.cpp's reference C code.

Q8_0 cuts each row into blocks of 32 values and stores every block as 34 bytes: one fp16 scale d,
then 32 int8 quants q, so that x ~ d * q. With d = max|x| / 127 the largest value maps to +-127.

    block_q8_0 = { d: fp16, qs: int8[32] }      # ggml-common.h
    quantize:    d = amax / 127;  id = 1/d (0 when d == 0);  q = roundf(x * id)
    dequantize:  x = q * d

All arithmetic is float32 as in ggml-quants.c `quantize_row_q8_0_ref`, and `roundf` rounds halves
away from zero (numpy's `round` rounds them to even, which would differ on exact .5 products).
Inputs whose max|x| is below ~3.7e-37 make 1/d overflow to inf; llama.cpp's result is undefined there.

The other formats (those of a llama.cpp Q4_K_M file, plus Q5_K):

    block_q4_0 = { d: fp16, qs: uint8[16] }                                  # 32 values, 18 bytes
        x[i] = (q[i] - 8) * d, q[i] the low nibbles of qs for i < 16, the high ones for i >= 16
    block_q5_0 = { d: fp16, qh: uint32, qs: uint8[16] }                      # 32 values, 22 bytes
        as Q4_0 with a 5th bit per value from qh, centred on 16
    block_q4_K = { d: fp16, dmin: fp16, scales: uint8[12], qs: uint8[128] }  # 256 values, 144 bytes
        8 sub-blocks of 32 with 6-bit scale sc[j] and min m[j]:  x = d * sc[j] * q - dmin * m[j]
    block_q5_K = { d, dmin: fp16, scales: uint8[12], qh: uint8[32], qs: uint8[128] }   # 176 bytes
        as Q4_K with a 5th bit per value from qh (q in 0..31)
    block_q6_K = { ql: uint8[128], qh: uint8[64], scales: int8[16], d: fp16 } # 256 values, 210 bytes
        16 sub-blocks of 16 with int8 scale s[j]; q = 4 low bits + 2 high bits - 32:  x = d * s[j] * q

Decoded here, written by lowbits.py (Q2_K, Q3_K, Q5_1; nothing writes Q4_1):

    block_q4_1 = { d, m: fp16, qs: uint8[16] }                               # 32 values, 20 bytes
        x = d * q + m, q the nibbles in Q4_0's order (0..15, no offset)
    block_q5_1 = { d, m: fp16, qh: uint32, qs: uint8[16] }                   # 32 values, 24 bytes
        as Q4_1 with Q5_0's 5th bit (q in 0..31)
    block_q2_K = { scales: uint8[16], qs: uint8[64], d, dmin: fp16 }         # 256 values, 84 bytes
        16 sub-blocks of 16, scales[j] = sc[j] | m[j] << 4 (4 bits each):  x = d * sc[j] * q - dmin * m[j]
    block_q3_K = { hmask: uint8[32], qs: uint8[64], scales: uint8[12], d: fp16 }   # 256 values, 110 bytes
        16 sub-blocks of 16 with 6-bit scale s[j] stored + 32; q = 2 low bits + 1 high bit - 4:  x = d * s[j] * q

Q2_K and Q3_K (ggml-quants.c `dequantize_row_q2_K`, `_q3_K`) store 2-bit codes four to a byte: value
128h + 32k + l (l < 32) is bits 2k, 2k+1 of qs[32h + l]; Q3_K's third bit is bit 4h + k of hmask[l].
The i-quants (IQ4_NL, IQ4_XS) are in iquants.py.

Q4_0/Q5_0 (`quantize_row_q4_0_ref`): d = (the value of largest magnitude) / -8 (or -16), so that
value lands on the extreme level -8; q = (int8)(x/d + 8.5) truncated, capped at 15 (31).

Q4_K/Q5_K (`quantize_row_q4_K_ref`, `make_qkx2_quants`): each sub-block of 32 first gets its own
float scale and min. The search starts from the range [min(x, 0), max(x)] cut into nmax = 15 (31)
steps, then tries 21 (16) slightly wider or narrower step counts nmax + rmin + 0.1*k; for each it
rounds, solves the weighted least-squares fit x ~ scale*q - min in closed form (weights |x| plus
the sub-block's rms), and keeps the fit with the smallest weighted squared error. The eight scales
(and mins) are then quantized to 6 bits against the block's largest one: d = max_scale/63 in fp16,
sc[j] = nearest(63 * scale[j] / max_scale), and the quants are recomputed with the rounded d*sc[j].

Q6_K (`quantize_row_q6_K_ref`, `make_qx_quants`): each sub-block of 16 is symmetric: scale
= max/-32 and 18 more step counts 32 +- 0.1*k, keeping the one that maximizes the explained energy
(sum w x q)^2 / (sum w q^2) with weights x^2. The 16 scales become int8 against the largest one
(d = max_scale/-128), and the quants are recomputed with d*s[j].

Bit-exactness needs C's float32 semantics: each operation rounded in the C source's order, sums
accumulated one term at a time (numpy's pairwise `sum` differs), `nearest_int` rounding halves to
even and fp16 conversion rounding to nearest even. The FMA trap: a llama.cpp compiled with FMA
contraction (`-march=native` under GCC's default `-ffp-contract=fast`, or clang on Apple silicon)
fuses `a*b + c` into one rounding, and the scale search then picks a different candidate in some
blocks (the k-quants chapter counts them). Our reference is the non-FMA build (llama-cpp-python's libggml-base),
and we match it byte for byte.

Non-finite input (inf, nan) raises ValueError naming its first position: llama.cpp would write a
block of meaningless bytes. A Q4_0 (Q5_0) block with 0 < max|x| < ~2.4e-38 (~4.7e-38) overflows
1/d as Q8_0 does; C's float -> int8 cast of inf is undefined there, and we write what this x86
build writes: d = +-0 and every quant 0.

See chapter: kquants
"""

from __future__ import annotations

import numpy as np

from ref_impl.formats.ggml import BLOCK, GGMLType

f32 = np.float32
QK8_0 = 32          # values per Q8_0 block
BLOCK_BYTES_Q8_0 = 34  # 2-byte fp16 scale + 32 int8 quants
GROUP_MAX_EPS = f32(1e-15)  # below this max|x| a sub-block counts as all zero (ggml-quants.c)


def _size(name: str) -> tuple[int, int]:
    """(values, bytes) per block of GGML type `name`, from ggml.BLOCK."""
    return BLOCK[GGMLType[name]]


def _check_input(x: np.ndarray, name: str) -> np.ndarray:
    """Float rows (..., n) for `name`'s quantizer as float32; ValueError on a bad shape, dtype or value."""
    x = np.asarray(x)
    block = _size(name)[0]
    if x.ndim == 0 or x.shape[-1] == 0 or x.shape[-1] % block or x.size == 0:
        raise ValueError(f"{name} needs a last dimension that is a positive multiple of {block}, got shape {x.shape}")
    if x.dtype.kind != "f":
        raise ValueError(f"{name} quantizes floating-point values, got dtype {x.dtype}")
    with np.errstate(over="ignore"):            # a float64 beyond float32's range becomes inf: refused below
        x = x.astype(np.float32, copy=False)
    finite = np.isfinite(x)
    if not finite.all():
        at = tuple(int(i) for i in np.unravel_index(np.argmin(finite), x.shape))
        raise ValueError(f"{name} input has a non-finite value {x[at]} (as float32) at index {at}")
    return x


def quantize_rows(x: np.ndarray, name: str, kernel, chunk: int = 2048) -> np.ndarray:
    """Check `x`, run kernel((blocks, values)) -> (blocks, bytes) over chunks that fit in cache."""
    x = _check_input(x, name)
    block, nbytes = _size(name)
    xb = x.reshape(-1, block)
    out = np.empty((len(xb), nbytes), dtype=np.uint8)
    with np.errstate(all="ignore"):  # inf and nan appear where they appear in the C too (huge or tiny x)
        for start in range(0, len(xb), chunk):
            out[start:start + chunk] = kernel(xb[start:start + chunk])
    return out.reshape(*x.shape[:-1], x.shape[-1] // block * nbytes)


# ------------------------------------------------------------------------- float32 helpers, as in C

def _roundf(x: np.ndarray) -> np.ndarray:
    """C roundf: halves away from zero. Done in float64, where x + 0.5 is exact for float32 x."""
    x = x.astype(np.float64)
    return np.trunc(x + np.copysign(0.5, x))


def nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml-quants.c nearest_int: add 1.5 * 2**23 in float32 and read the low mantissa bits, which
    rounds halves to even for |v| < 2**22 (and gives llama.cpp's own answer beyond, 0 for nan)."""
    bits = (v.astype(np.float32) + f32(12582912.0)).view(np.int32)
    return (bits & 0x007FFFFF) - 0x00400000


def trunc_int8(v: np.ndarray) -> np.ndarray:
    """C's (int8_t) cast of a float: truncation toward zero. Where C leaves it undefined (nan, inf,
    huge) x86's cvttss2si gives INT32_MIN, whose low byte is 0."""
    t = np.trunc(v.astype(np.float64))
    return np.where(np.abs(t) < 2.0**31, t, 0).astype(np.int64).astype(np.int8)


def _clamp(i: np.ndarray, lo: int, hi: int) -> np.ndarray:
    return np.minimum(np.maximum(i, lo), hi)


def seqsum(terms: np.ndarray, from_first: bool = False) -> np.ndarray:
    """Sum over axis 0 one term at a time, like a C loop `s += t[i]` from s = 0 (or s = t[0])."""
    s = terms[0].copy() if from_first else f32(0) + terms[0]
    for t in terms[1:]:
        s += t
    return s


def first_absmax(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Over axis 0: the largest |x| and the first value that has it (+0.0 where all |x| are 0),
    as the C loop `if (amax < fabsf(v)) { amax = fabsf(v); max = v; }` finds them (nan never wins)."""
    amax = np.zeros(x.shape[1:], np.float32)
    vmax = np.zeros(x.shape[1:], np.float32)
    for v in x:
        a = np.abs(v)
        take = a > amax
        amax, vmax = np.where(take, a, amax), np.where(take, v, vmax)
    return amax, vmax


def running_max(a: np.ndarray) -> np.ndarray:
    """max(0, a[:, 0], a[:, 1], ...) with C's `if (v > m) m = v` (nan never wins)."""
    m = np.zeros(a.shape[0], np.float32)
    for v in a.T:
        m = np.where(v > m, v, m)
    return m


def fp16_bytes(a: np.ndarray) -> np.ndarray:
    """float32 (n,) -> fp16 bytes (n, 2), round to nearest even like GGML_FP32_TO_FP16."""
    return a.astype("<f2").view(np.uint8).reshape(-1, 2)


# ------------------------------------------------------------------------------- Q8_0, Q4_0, Q5_0

def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """Quantize float32 `x` of shape (..., n), n a multiple of 32, to uint8 blocks of shape (..., n // 32 * 34).

    As ggml-quants.c quantize_row_q8_0_ref."""
    return quantize_rows(x, "Q8_0", _q8_0_blocks)


def _q8_0_blocks(blocks: np.ndarray) -> np.ndarray:
    d = np.abs(blocks).max(axis=1) / f32(127)                 # (n_blocks,) float32
    inv_d = np.where(d != 0, f32(1) / d, f32(0))
    q = _roundf(blocks * inv_d[:, None]).astype(np.int8)      # float32 product, then roundf
    return np.concatenate([fp16_bytes(d), q.view(np.uint8)], axis=1)


def _q_0_blocks(blocks: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_0 (levels 8) and Q5_0 (16): fp16 d (n, 2) and quants q (n, 32) in 0..2*levels-1."""
    _, vmax = first_absmax(blocks.T)
    d = vmax / f32(-levels)                                   # the largest-magnitude value maps to level 0
    inv_d = np.where(d != 0, f32(1) / d, f32(0))
    q = trunc_int8(blocks * inv_d[:, None] + f32(levels + 0.5))
    return fp16_bytes(d), (np.minimum(2 * levels - 1, q.astype(np.int16)) & 0xFF).astype(np.uint8)


def quantize_q4_0(x: np.ndarray) -> np.ndarray:
    """Float32 (..., n), n a multiple of 32 -> uint8 Q4_0 blocks (..., n // 32 * 18).

    As ggml-quants.c quantize_row_q4_0_ref."""
    def kernel(blocks):
        d, q = _q_0_blocks(blocks, 8)
        return np.concatenate([d, q[:, :16] | (q[:, 16:] << 4)], axis=1)
    return quantize_rows(x, "Q4_0", kernel)


def quantize_q5_0(x: np.ndarray) -> np.ndarray:
    """Float32 (..., n), n a multiple of 32 -> uint8 Q5_0 blocks (..., n // 32 * 22).

    As ggml-quants.c quantize_row_q5_0_ref. llama.cpp writes Q5_0 for a Q4_K_M tensor whose rows
    are not a multiple of 256."""
    def kernel(blocks):
        d, q = _q_0_blocks(blocks, 16)
        high = ((q >> 4).astype(np.uint32) << np.arange(32, dtype=np.uint32)).sum(axis=1, dtype=np.uint32)
        qh = high.astype("<u4").view(np.uint8).reshape(-1, 4)  # bit i: value i's 5th bit
        return np.concatenate([d, qh, (q[:, :16] & 0x0F) | (q[:, 16:] << 4)], axis=1)
    return quantize_rows(x, "Q5_0", kernel)


# ---------------------------------------------------------------------------------- K-quants

def pack_scales_q4_k(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """6-bit scales and mins, each (n, 8) in 0..63 -> the 12 packed bytes (n, 12) of Q4_K and Q5_K.

    The inverse of unpack_scales_q4_k, as written by ggml-quants.c quantize_row_q4_K_ref."""
    sc, mn = np.asarray(sc), np.asarray(mn)
    if sc.shape != mn.shape or sc.shape[-1:] != (8,) or sc.min(initial=0) < 0 or mn.min(initial=0) < 0 \
            or sc.max(initial=0) > 63 or mn.max(initial=0) > 63:
        raise ValueError(f"Q4_K scales and mins must be two (n, 8) arrays of 6-bit values 0..63, "
                         f"got shapes {sc.shape} and {mn.shape}")
    sc, mn = sc.astype(np.uint8).reshape(-1, 8), mn.astype(np.uint8).reshape(-1, 8)
    return np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6),     # scales 0-3, top bits of scales 4-7
                           mn[:, :4] | ((mn[:, 4:] >> 4) << 6),     # mins 0-3, top bits of mins 4-7
                           (sc[:, 4:] & 0x0F) | (mn[:, 4:] << 4)], axis=1)  # low nibbles of 4-7


def unpack_scales_q4_k(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 packed bytes of a Q4_K block (n, 12) -> 6-bit scales and mins, each (n, 8).

    Bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3; the top 2 bits of those
    8 bytes, with the nibbles of bytes 8-11, make scales and mins 4-7 (ggml-quants.c get_scale_min_k4).
    """
    s = scales.astype(np.uint8)
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([lo & 63, (hi & 0x0F) | ((lo >> 6) << 4)], axis=1)
    mn = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=1)
    return sc, mn


def _weighted_error(scale, q, mn, x, w, mad: bool):
    """sum_i w_i (scale*q_i + mn - x_i)^2 (|.| with `mad`) over axis 0, rounded in make_qkx2_quants' order."""
    diff = scale * q + mn - x
    return seqsum(w * (np.abs(diff) if mad else diff * diff))


def make_qkx2_quants(x, w, nmax: int, rmin: float, rdelta: float, nstep: int, mad: bool = False):
    """ggml-quants.c make_qkx2_quants for many sub-blocks at once: x, w (values, n) position-major;
    `mad` weighs absolute errors instead of squared ones (its use_mad, which Q2_K sets).

    Returns quants (values, n) as float32 0..nmax, scale (n,) and the_min (n,), x ~ scale*q - the_min."""
    lo, hi = x[0].copy(), x[0].copy()
    for v in x[1:]:
        lo, hi = np.where(v < lo, v, lo), np.where(v > hi, v, hi)
    sum_w, sum_x = seqsum(w, from_first=True), seqsum(w * x, from_first=True)
    lo = np.where(lo > 0, f32(0), lo)              # the range always includes 0
    iscale = f32(nmax) / (hi - lo)
    scale = f32(1) / iscale
    best_q = _clamp(nearest_int(iscale * (x - lo)), 0, nmax).astype(np.float32)
    best = _weighted_error(scale, best_q, lo, x, w, mad)
    mn = lo
    for step in range(nstep + 1):                  # try nmax + rmin + rdelta*step steps across the range
        iscale = (f32(rmin) + f32(rdelta) * f32(step) + f32(nmax)) / (hi - mn)
        q = _clamp(nearest_int(iscale * (x - mn)), 0, nmax).astype(np.float32)
        wq = w * q
        sum_l, sum_l2, sum_xl = seqsum(wq), seqsum(wq * q), seqsum(wq * x)
        det = sum_w * sum_l2 - sum_l * sum_l       # least squares for x ~ this_scale*q + this_min
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
        positive = this_min > 0                    # a positive min is not allowed: refit through 0
        this_min = np.where(positive, f32(0), this_min)
        this_scale = np.where(positive, sum_xl / sum_l2, this_scale)
        err = _weighted_error(this_scale, q, this_min, x, w, mad)
        better = (det > 0) & (err < best)
        best_q = np.where(better, q, best_q)
        best, scale, mn = np.where(better, err, best), np.where(better, this_scale, scale), np.where(better, this_min, mn)
    flat = hi == lo                                # one value (or all zero): q = 0, scale 0
    return np.where(flat, f32(0), best_q), np.where(flat, f32(0), scale), -np.where(flat, lo, mn)


def _qkx_blocks(x: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int):
    """Q4_K (nmax 15) and Q5_K (31) super-blocks (n, 256) -> header bytes (n, 16) and quants (n, 256)."""
    n = len(x)
    xs = np.ascontiguousarray(x.reshape(n * 8, 32).T)          # (32, n*8): sub-blocks in columns
    av_x = np.sqrt(seqsum(xs * xs) / f32(32))
    q, scales, mins = make_qkx2_quants(xs, av_x + np.abs(xs), nmax, rmin, rdelta, nstep)
    scales, mins = scales.reshape(n, 8), mins.reshape(n, 8)
    max_scale, max_min = running_max(scales), running_max(mins)
    inv_scale = np.where(max_scale > 0, f32(63) / max_scale, f32(0))
    inv_min = np.where(max_min > 0, f32(63) / max_min, f32(0))
    # 6-bit scales against the largest one; nearest_int lands in a uint8_t (mod 256) before MIN(63, .)
    ls = np.minimum(63, nearest_int(inv_scale[:, None] * scales) & 0xFF)
    lm = np.minimum(63, nearest_int(inv_min[:, None] * mins) & 0xFF)
    d16, dmin16 = (max_scale / f32(63)).astype("<f2"), (max_min / f32(63)).astype("<f2")
    d = (d16.astype(np.float32)[:, None] * ls.astype(np.float32))[:, :, None]      # (n, 8, 1)
    dm = (dmin16.astype(np.float32)[:, None] * lm.astype(np.float32))[:, :, None]
    requant = _clamp(nearest_int((x.reshape(n, 8, 32) + dm) / d), 0, nmax)
    q = np.where(d != 0, requant, q.T.reshape(n, 8, 32)).astype(np.uint8)  # d == 0 keeps the search's q
    head = np.concatenate([d16.view(np.uint8).reshape(n, 2), dmin16.view(np.uint8).reshape(n, 2),
                           pack_scales_q4_k(ls, lm)], axis=1)
    return head, q.reshape(n, 4, 2, 32)                        # 4 chunks of 64 values: 2 sub-blocks each


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """Float32 (..., n), n a multiple of 256 -> uint8 Q4_K super-blocks (..., n // 256 * 144).

    As ggml-quants.c quantize_row_q4_K_ref (make_qkx2_quants with rmin -1, rdelta 0.1, 20 steps)."""
    def kernel(blocks):
        head, q = _qkx_blocks(blocks, 15, -1.0, 0.1, 20)
        return np.concatenate([head, (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(len(q), 128)], axis=1)
    return quantize_rows(x, "Q4_K", kernel, chunk=512)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """Float32 (..., n), n a multiple of 256 -> uint8 Q5_K super-blocks (..., n // 256 * 176).

    As ggml-quants.c quantize_row_q5_K_ref (make_qkx2_quants with rmin -0.5, rdelta 0.1, 15 steps)."""
    def kernel(blocks):
        head, q = _qkx_blocks(blocks, 31, -0.5, 0.1, 15)
        high = q >> 4                                          # (n, 4, 2, 32): chunk c sets bits 2c, 2c+1
        qh = np.zeros((len(q), 32), np.uint8)
        for c in range(4):
            qh |= (high[:, c, 0] << (2 * c)) | (high[:, c, 1] << (2 * c + 1))
        low = q & 0x0F
        return np.concatenate([head, qh, (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(len(q), 128)], axis=1)
    return quantize_rows(x, "Q5_K", kernel, chunk=512)


def _make_qx_quants(x: np.ndarray, nmax: int):
    """ggml-quants.c make_qx_quants with rmse_type 1 (weights x^2) for sub-blocks x (16, n).

    Returns quants (16, n) as float32 0..2*nmax-1 (offset by nmax) and scale (n,), x ~ scale*(q - nmax)."""
    amax, vmax = first_absmax(x)
    w = x * x
    wx = w * x

    def trial(iscale):
        q = _clamp(nearest_int(iscale * x), -nmax, nmax - 1).astype(np.float32)
        return q, seqsum(wx * q), seqsum(w * q * q)

    best_q, sumlx, suml2 = trial(f32(-nmax) / vmax)
    scale = np.where(suml2 != 0, sumlx / suml2, f32(0))
    best = scale * sumlx                                       # the energy explained, sumlx^2 / suml2
    for step in range(-9, 10):
        if step:
            q, sumlx, suml2 = trial(-(f32(nmax) + f32(0.1) * f32(step)) / vmax)
            better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
            best_q, scale = np.where(better, q, best_q), np.where(better, sumlx / suml2, scale)
            best = np.where(better, scale * sumlx, best)
    zero = amax < GROUP_MAX_EPS
    return np.where(zero, f32(0), best_q + f32(nmax)), np.where(zero, f32(0), scale)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """Float32 (..., n), n a multiple of 256 -> uint8 Q6_K super-blocks (..., n // 256 * 210).

    As ggml-quants.c quantize_row_q6_K_ref (make_qx_quants, then int8 scales against the largest)."""
    return quantize_rows(x, "Q6_K", _q6_k_blocks, chunk=512)


def _q6_k_blocks(x: np.ndarray) -> np.ndarray:
    n = len(x)
    q, scales = _make_qx_quants(np.ascontiguousarray(x.reshape(n * 16, 16).T), 32)
    max_abs, max_scale = first_absmax(scales.reshape(n, 16).T)
    iscale = f32(-128) / max_scale                             # the largest scale maps to -128
    d16 = (f32(1) / iscale).astype("<f2")
    # MIN(127, nearest_int(.)) stored in an int8_t: wraps mod 256
    sc = (np.minimum(127, nearest_int(iscale[:, None] * scales.reshape(n, 16))) & 0xFF).astype(np.uint8)
    d = (d16.astype(np.float32)[:, None] * sc.view(np.int8).astype(np.float32))[:, :, None]   # (n, 16, 1)
    requant = _clamp(nearest_int(x.reshape(n, 16, 16) / d), -32, 31) + 32
    q = np.where(d != 0, requant, q.T.reshape(n, 16, 16)).astype(np.uint8).reshape(n, 2, 4, 32)
    low = q & 0x0F
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=2)
    qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)
    out = np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc, d16.view(np.uint8).reshape(n, 2)], axis=1)
    out[max_abs < GROUP_MAX_EPS] = 0                           # an all-zero super-block: every byte 0
    return out


# ------------------------------------------------------------------------------- dequantization

def check_blocks(data: np.ndarray, name: str, block_bytes: int) -> np.ndarray:
    """Check uint8 rows of whole blocks, shape (..., row_bytes); return them as (n_blocks, block_bytes)."""
    data = np.asarray(data)
    if data.dtype != np.uint8 or data.ndim == 0 or data.shape[-1] == 0 or data.shape[-1] % block_bytes:
        raise ValueError(f"{name} data must be uint8 with a last dimension that is a multiple of "
                         f"{block_bytes}, got {data.dtype} of shape {data.shape}")
    return data.reshape(-1, block_bytes)


def as_rows(values: np.ndarray, data: np.ndarray, block_bytes: int, block_values: int) -> np.ndarray:
    """Reshape per-block values (n_blocks, block_values) back to the rows of `data`."""
    return values.reshape(*data.shape[:-1], data.shape[-1] // block_bytes * block_values)


def f16_column(b: np.ndarray) -> np.ndarray:
    """Two bytes per row (n, 2) as a float32 column (n, 1)."""
    return np.ascontiguousarray(b).view("<f2").astype(np.float32)


def dequantize_q8_0(blocks: np.ndarray) -> np.ndarray:
    """Expand uint8 Q8_0 blocks of shape (..., row_bytes), row_bytes a multiple of 34, to float32 (..., n)."""
    b = check_blocks(blocks, "Q8_0", BLOCK_BYTES_Q8_0)              # (n_blocks, 34)
    q = b[:, 2:].view(np.int8).astype(np.float32)             # (n_blocks, 32)
    with np.errstate(invalid="ignore"):                       # an inf scale times q = 0 is nan, as in C
        return as_rows(q * f16_column(b[:, :2]), blocks, BLOCK_BYTES_Q8_0, QK8_0)


def dequantize_q4_0(blocks: np.ndarray) -> np.ndarray:
    """Expand uint8 Q4_0 blocks (..., row_bytes), 18 bytes per 32 values, to float32 (..., n)."""
    b = check_blocks(blocks, "Q4_0", 18)
    qs = b[:, 2:]                                             # (n_blocks, 16): two 4-bit quants a byte
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32) - 8   # low nibbles first
    with np.errstate(invalid="ignore"):
        return as_rows(q * f16_column(b[:, :2]), blocks, 18, 32)


def dequantize_q5_0(blocks: np.ndarray) -> np.ndarray:
    """Expand uint8 Q5_0 blocks (..., row_bytes), 22 bytes per 32 values, to float32 (..., n).

    llama.cpp falls back to Q5_0 where a Q4_K_M tensor's rows are not a multiple of 256."""
    b = check_blocks(blocks, "Q5_0", 22)
    q = _q5_codes(b[:, 2:6], b[:, 6:]) - 16
    with np.errstate(invalid="ignore"):
        return as_rows(q * f16_column(b[:, :2]), blocks, 22, 32)


def _q5_codes(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1 codes 0..31 as float32 (n, 32): nibbles of qs (n, 16), low ones first, and value i's
    5th bit from bit i of the little-endian uint32 qh (n, 4)."""
    high = np.ascontiguousarray(qh).view("<u4")                 # (n, 1)
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.uint32)
    return (low | (((high >> np.arange(32, dtype=np.uint32)) & 1) << 4)).astype(np.float32)


def dequantize_q4_1(blocks: np.ndarray) -> np.ndarray:
    """Expand uint8 Q4_1 blocks (..., row_bytes), 20 bytes per 32 values, to float32 (..., n): x = d * q + m."""
    b = check_blocks(blocks, "Q4_1", 20)
    qs = b[:, 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)   # low nibbles first, as Q4_0
    with np.errstate(invalid="ignore"):
        return as_rows(q * f16_column(b[:, 0:2]) + f16_column(b[:, 2:4]), blocks, 20, 32)


def dequantize_q5_1(blocks: np.ndarray) -> np.ndarray:
    """Expand uint8 Q5_1 blocks (..., row_bytes), 24 bytes per 32 values, to float32 (..., n): x = d * q + m."""
    b = check_blocks(blocks, "Q5_1", 24)
    with np.errstate(invalid="ignore"):
        return as_rows(_q5_codes(b[:, 4:8], b[:, 8:]) * f16_column(b[:, 0:2]) + f16_column(b[:, 2:4]), blocks, 24, 32)


def _affine_k(b: np.ndarray, q: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    """x = d * sc[j] * q - dmin * m[j] per 32-value sub-block j (Q4_K, Q5_K): b (n, block bytes) starts
    with fp16 d, fp16 dmin and the 12 packed scale bytes; q (n, 8, 32) holds the codes."""
    d, dmin = f16_column(b[:, 0:2]), f16_column(b[:, 2:4])                # (n, 1) each
    sc, mn = unpack_scales_q4_k(b[:, 4:16])                   # (n, 8) each
    with np.errstate(invalid="ignore"):                       # an inf d times a zero code is nan, as in C
        scale = (d * sc.astype(np.float32))[:, :, None]
        offset = (dmin * mn.astype(np.float32))[:, :, None]
        return as_rows((scale * q - offset).reshape(-1, 256), blocks, b.shape[1], 256)


def dequantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    """Expand uint8 Q4_K super-blocks (..., row_bytes), 144 bytes per 256 values, to float32 (..., n)."""
    b = check_blocks(blocks, "Q4_K", 144)
    qs = b[:, 16:].reshape(-1, 4, 32)                         # 4 chunks of 32 bytes
    # each chunk holds two sub-blocks: its low nibbles, then its high nibbles
    q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32).astype(np.float32)
    return _affine_k(b, q, blocks)


def dequantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    """Expand uint8 Q5_K super-blocks (..., row_bytes), 176 bytes per 256 values, to float32 (..., n)."""
    b = check_blocks(blocks, "Q5_K", 176)
    qh, qs = b[:, 16:48], b[:, 48:].reshape(-1, 4, 32)
    low = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)   # as Q4_K
    high = np.stack([(qh >> j) & 1 for j in range(8)], axis=1)        # sub-block j: bit j of qh
    return _affine_k(b, (low | (high << 4)).astype(np.float32), blocks)


def dequantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    """Expand uint8 Q6_K super-blocks (..., row_bytes), 210 bytes per 256 values, to float32 (..., n)."""
    b = check_blocks(blocks, "Q6_K", 210)
    ql = b[:, 0:128].reshape(-1, 2, 64)                       # two halves of 128 values
    qh = b[:, 128:192].reshape(-1, 2, 32)
    scales = b[:, 192:208].view(np.int8).astype(np.float32)   # (n, 16)
    d = f16_column(b[:, 208:210])
    # in each half, value l + 32*k takes 4 low bits from ql and 2 high bits from qh (l < 32, k < 4)
    low = np.stack([ql[:, :, :32] & 0x0F, ql[:, :, 32:] & 0x0F, ql[:, :, :32] >> 4, ql[:, :, 32:] >> 4], axis=2)
    high = np.stack([(qh >> (2 * k)) & 3 for k in range(4)], axis=2)
    q = (low | (high << 4)).astype(np.float32) - 32           # (n, 2, 4, 32)
    s = scales.reshape(-1, 2, 4, 2)                           # one scale per 16 values
    with np.errstate(invalid="ignore"):
        x = d[:, :, None, None] * np.repeat(s, 16, axis=3) * q
    return as_rows(x.reshape(-1, 256), blocks, 210, 256)


def _two_bit_codes(qs: np.ndarray) -> np.ndarray:
    """Q2_K/Q3_K low bits: qs (n, 64) -> codes 0..3 (n, 256) in value order (128h + 32k + l takes
    bits 2k, 2k+1 of qs[32h + l])."""
    shifts = np.arange(0, 8, 2, dtype=np.uint8)[None, None, :, None]
    return ((qs.reshape(-1, 2, 1, 32) >> shifts) & 3).reshape(-1, 256)


def dequantize_q2_k(blocks: np.ndarray) -> np.ndarray:
    """Expand uint8 Q2_K super-blocks (..., row_bytes), 84 bytes per 256 values, to float32 (..., n)."""
    b = check_blocks(blocks, "Q2_K", 84)
    sc = b[:, 0:16]                                           # sub-block j: scale low nibble, min high
    q = _two_bit_codes(b[:, 16:80]).reshape(-1, 16, 16).astype(np.float32)   # (n, sub-block, 16)
    d, dmin = f16_column(b[:, 80:82]), f16_column(b[:, 82:84])
    with np.errstate(invalid="ignore"):                       # as _affine_k: d * sc first, then * q
        scale = (d * (sc & 0x0F).astype(np.float32))[:, :, None]
        offset = (dmin * (sc >> 4).astype(np.float32))[:, :, None]
        return as_rows((scale * q - offset).reshape(-1, 256), blocks, 84, 256)


def unpack_scales_q3_k(scales: np.ndarray) -> np.ndarray:
    """The 12 scale bytes of Q3_K blocks (n, 12) -> the 16 signed 6-bit scales s[j] (n, 16), -32..31.

    Scale j's low 4 bits are the low (j < 8) or high (j >= 8) nibble of byte j % 8; its top 2 bits are
    bits 2*(j // 4), 2*(j // 4) + 1 of byte 8 + j % 4 (ggml-quants.c dequantize_row_q3_K)."""
    s = scales.astype(np.uint8)
    low = np.concatenate([s[:, 0:8] & 0x0F, s[:, 0:8] >> 4], axis=1)
    high = (s[:, None, 8:12] >> np.arange(0, 8, 2, dtype=np.uint8)[None, :, None]) & 3   # (n, j // 4, j % 4)
    return (low | (high.reshape(-1, 16) << 4)).astype(np.int16) - 32


def codes_q3_k(b: np.ndarray) -> np.ndarray:
    """Q3_K super-blocks (n, 110) -> their codes q (n, 256), int8 in -4..3: 2 low bits from qs, the
    third from hmask, minus 4."""
    high = (b[:, None, 0:32] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1   # (n, 4h + k, l)
    return (_two_bit_codes(b[:, 32:96]) | (high.reshape(-1, 256) << 2)).astype(np.int8) - 4


def dequantize_q3_k(blocks: np.ndarray) -> np.ndarray:
    """Expand uint8 Q3_K super-blocks (..., row_bytes), 110 bytes per 256 values, to float32 (..., n)."""
    b = check_blocks(blocks, "Q3_K", 110)
    q = codes_q3_k(b).astype(np.float32)
    s = unpack_scales_q3_k(b[:, 96:108]).astype(np.float32)  # (n, 16)
    with np.errstate(invalid="ignore"):                       # d * s[j] first, then * q, as in C
        scale = (f16_column(b[:, 108:110]) * s)[:, :, None]
        return as_rows((scale * q.reshape(-1, 16, 16)).reshape(-1, 256), blocks, 110, 256)


# GGML type name -> dequantizer; gguf.DEQUANTIZE, which GGUFFile.dequantize reads, adds iquants'
DEQUANTIZE = {"Q8_0": dequantize_q8_0, "Q4_0": dequantize_q4_0, "Q5_0": dequantize_q5_0,
              "Q4_1": dequantize_q4_1, "Q5_1": dequantize_q5_1, "Q2_K": dequantize_q2_k,
              "Q3_K": dequantize_q3_k, "Q4_K": dequantize_q4_k, "Q5_K": dequantize_q5_k, "Q6_K": dequantize_q6_k}
# GGML type name -> quantizer, float32 (..., n) -> uint8 (..., row_bytes); block sizes are ggml.BLOCK's
QUANTIZE = {"Q8_0": quantize_q8_0, "Q4_0": quantize_q4_0, "Q5_0": quantize_q5_0,
            "Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}
