"""GGML blocks rewritten as MLX affine quantization, so a GGUF file runs without expanding to floats.

MLX's affine format (`mx.quantize`) stores a matrix (out, in) as three arrays: `weight`, the
unsigned b-bit codes q packed into uint32 words as one little-endian bit stream (value 0 in the
lowest bits), and `scales`, `biases` of shape (out, in / group), so that

    w = scales[g] * q + biases[g]          for the `group` consecutive inputs of group g

Most GGML blocks are already this shape: a 32-value (sub-)block with one scale and one offset. So
the codes are re-packed, never re-rounded, and `nn.Linear`/`nn.Embedding` become
`nn.QuantizedLinear`/`nn.QuantizedEmbedding` with per-layer bits (a Q4_K_M file mixes types).

    GGML   MLX affine     scale      bias        codes
    Q4_0   4-bit g32      d          -8 d        as stored (0..15)
    Q4_1   4-bit g32      d          m           as stored
    Q5_0   5-bit g32      d          -16 d       4 low bits | 5th bit from qh
    Q5_1   5-bit g32      d          m           as Q5_0
    Q8_0   8-bit g32      d          -128 d      int8 q + 128 (the sign bit flipped)
    Q4_K   4-bit g32      d sc[j]    -dmin m[j]  nibbles re-ordered (below)
    Q5_K   5-bit g32      d sc[j]    -dmin m[j]  as Q4_K plus the 5th bit from qh
    Q6_K   8-bit g32      d t        d vmin      re-quantized (below)
    Q3_K   8-bit g32      d          -124 d      s[j] q + 124: the exact integers (below)
    IQ4_NL 8-bit g32      d          -128 d      the table level + 128 (1..241)
    IQ4_XS 8-bit g32      d (ls-32)  -128 d (ls-32)  as IQ4_NL
    Q2_K   float                                 expanded (below)

Nibble order: in each 32-byte chunk of Q4_K (16 bytes of Q4_0) the low nibbles are the first
half of a span of values and the high nibbles the second half; MLX wants values 2k and 2k+1 in
one byte, so every byte is rebuilt from two source bytes (`nibbles_to_mlx`).

Exactness, measured by `transcode_error` (tests/test_transcode.py checks every claim): with
float32 scales every type but Q6_K decodes bit for bit as `kquants` (`iquants`) decode it (max diff 0.0): d*sc
(17 significand bits), dmin*m and d*sc*q (21) are exact in float32, so MLX's `scales * q + biases`
rounds once, where kquants' `scale * q - offset` rounds. float16 scales (a float16 model on a GPU)
round d*sc and dmin*m to 11 bits, and mx.dequantize then computes in float16: Q5_0 and Q8_0 keep
an exact scale and bias, but the product and the sum round separately, a little more than rounding
the exact values to float16 costs anyway (the k-quants chapter measures it). `mx.quantized_matmul`
does accept float32 scales with float16 activations, but computes and returns float32, so the
residual stream silently turns float32: scales are stored in the model dtype unless `scale_dtype`
says otherwise.

Q6_K has 16-value sub-blocks with int8 scales s[j] and MLX has no group 16, so each group of 32
spans two scales. Its exact values are integers v = s[j] q in units of d (|v| <= 4096), re-quantized
to 8 bits over [vmin, vmax] of the group: with step g, the gcd of the two scales, when 255 steps of g
span the group (then it is exact: equal scales always are), else with min-max's step span / 255,
error <= step / 2, small against the error Q6_K itself adds (the k-quants chapter measures both on
the shipped model). Floats would be exact but cost 16 bits per weight against 9 (8-bit
codes plus a float16 scale and bias per 32), and Q6_K is a quarter of a Q4_K_M Llama-3.1-8B (1.3 of
4.9 GB: the output matrix, attn_v and ffn_down in 16 of 32 layers), so 8 bits it is.

Q3_K (16-value sub-blocks, 6-bit scales s[j] in -32..31, codes q in -4..3) needs no rounding: every
value is d times an integer v = s[j] q in [-124, 128], so 8-bit codes v + 124 with scale d and bias
-124 d hold it, whatever the two scales of a group. With float32 scales, d * code, 124 d and their
sum d * v each fit float32's 24 significand bits (d has 11), so MLX's one rounding changes nothing.
IQ4_NL and IQ4_XS (iquants.py) likewise: a level of their table is an integer in [-127, 113], stored
as level + 128 with bias -128 d, and d (IQ4_XS: d (ls - 32), 16 bits) times a level, a code or 128 is
exact. 8 bits (9.0 per weight) is more than their 3.4 to 4.5, but well under float16's 16.
Q2_K has no such grid: the two 16-value sub-blocks of a group have unrelated scales and mins
(d sc q - dmin m), and MLX has no group 16, so it is expanded to floats, logged, as is any type with
no mapping (the other i-quants' codebooks); `plan` says so per tensor.

Cost: MLX bits per weight are bits + 2 x 16 / 32 with float16 scales (4-bit 5.0, 5-bit 6.0, 8-bit
9.0; float32 scales add 1.0), against Q4_K's 4.5, Q5_0's 5.5, Q8_0's 8.5 and Q6_K's 6.56. Repacking
is vectorized numpy on all cores, so a multi-GB file transcodes in seconds. On a CPU, MLX's quantized
matmul is slower than float32 through OpenBLAS, so `checkpoint.load` expands unless asked; on a GPU,
reading ~3x fewer bytes is the point. `swap_quantized` puts the layers into a model; checkpoint.py
builds the model and loads the rest.

References: MLX `mx.quantize` docs (affine mode); llama.cpp ggml-quants.c `dequantize_row_q4_K`,
`dequantize_row_q5_K`, `dequantize_row_q6_K`, `dequantize_row_q3_K`; block layouts in kquants.py, iquants.py.
See chapter: kquants
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ref_impl.engine.moe import QuantizedExperts
from ref_impl.formats import gguf, iquants, kquants
from ref_impl.formats.ggml import BLOCK, GGMLType

GROUP = 32   # every mapping uses MLX group 32: the GGML (sub-)block size
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Affine:
    """One matrix in MLX's affine layout; scales and biases float32 (cast on load)."""
    weight: np.ndarray   # uint32 (out, in * bits / 32)
    scales: np.ndarray   # float32 (out, in / group)
    biases: np.ndarray   # float32 (out, in / group)
    bits: int
    group_size: int = GROUP


@dataclass(frozen=True)
class Plan:
    """How one GGUF tensor is represented in MLX: a row of the table `inspect` and the book show."""
    name: str               # GGUF tensor name
    ggml_type: str
    shape: tuple[int, ...]
    bits: int | None        # MLX affine bits; None: kept as float
    reason: str

    @property
    def representation(self) -> str:
        return f"affine {self.bits}-bit g{GROUP}" if self.bits else "float"

    def bits_per_weight(self, scale_bits: int = 16, float_bits: int = 16) -> float:
        """Stored bits per weight: codes plus one scale and one bias per group."""
        return self.bits + 2 * scale_bits / GROUP if self.bits else float(float_bits)


# --- packing -------------------------------------------------------------------------------------

def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned codes (rows, n), each < 2**bits, to MLX's layout: one little-endian bit stream per
    row, as uint32 (rows, n * bits / 32). n must be a multiple of 32."""
    rows, n = q.shape
    if bits == 8:
        return np.ascontiguousarray(q, dtype=np.uint8).view("<u4")
    if bits == 4:
        q = q.astype(np.uint8, copy=False).reshape(rows, -1, 2)
        return np.ascontiguousarray(q[:, :, 0] | (q[:, :, 1] << 4)).view("<u4")
    # 8 codes fill exactly `bits` bytes: shift them into one uint64 and keep its low bytes
    shifts = np.arange(8, dtype=np.uint64) * np.uint64(bits)
    words = (q.reshape(rows, -1, 8).astype(np.uint64) << shifts).sum(axis=2, dtype=np.uint64)
    return np.ascontiguousarray(words.view(np.uint8).reshape(rows, -1, 8)[:, :, :bits]).reshape(rows, -1).view("<u4")


def nibbles_to_mlx(qs: np.ndarray) -> np.ndarray:
    """GGML nibble order to MLX's: bytes (..., m) whose low nibbles are values 0..m-1 and high nibbles
    values m..2m-1 of a span -> bytes (..., m) holding values 2k, 2k+1 in byte k (low nibble first)."""
    even, odd = qs[..., 0::2], qs[..., 1::2]
    low_half = (even & 0x0F) | (odd << 4)        # values 0..m-1
    high_half = (even >> 4) | (odd & 0xF0)       # values m..2m-1
    return np.concatenate([low_half, high_half], axis=-1)


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes per block (n, 2) as float32 (n, 1)."""
    return np.ascontiguousarray(b).view("<f2").astype(np.float32)


def _high_bits(qh: np.ndarray, n: int) -> np.ndarray:
    """Bit i of little-endian uint32 qh (blocks, 1) for i < n, as uint8 (blocks, n)."""
    return ((qh >> np.arange(n, dtype=np.uint32)) & 1).astype(np.uint8)


# Each repacker takes uint8 blocks (rows, row_bytes) and returns codes as uint32 (rows, n*bits/32)
# plus float32 scales and biases (rows, n / 32).

def repack_q4_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rows = b.shape[0]
    b = b.reshape(rows, -1, 18)                                     # (rows, blocks, 18)
    d = _f16(b[:, :, 0:2].reshape(-1, 2)).reshape(rows, -1)
    w = nibbles_to_mlx(b[:, :, 2:]).reshape(rows, -1).view("<u4")
    return w, d, -8 * d


def repack_q4_1(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rows = b.shape[0]
    b = b.reshape(rows, -1, 20)
    d = _f16(b[:, :, 0:2].reshape(-1, 2)).reshape(rows, -1)
    m = _f16(b[:, :, 2:4].reshape(-1, 2)).reshape(rows, -1)
    return nibbles_to_mlx(b[:, :, 4:]).reshape(rows, -1).view("<u4"), d, m


def _q5_codes(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: 32 codes per block from qh (blocks, 4) and qs (blocks, 16)."""
    high = _high_bits(np.ascontiguousarray(qh).view("<u4"), 32)
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=1)
    return low | (high << 4)


def repack_q5_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rows = b.shape[0]
    blk = b.reshape(-1, 22)
    d = _f16(blk[:, 0:2]).reshape(rows, -1)
    q = _q5_codes(blk[:, 2:6], blk[:, 6:]).reshape(rows, -1)
    return pack(q, 5), d, -16 * d


def repack_q5_1(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rows = b.shape[0]
    blk = b.reshape(-1, 24)
    d, m = _f16(blk[:, 0:2]).reshape(rows, -1), _f16(blk[:, 2:4]).reshape(rows, -1)
    return pack(_q5_codes(blk[:, 4:8], blk[:, 8:]).reshape(rows, -1), 5), d, m


def repack_q8_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rows = b.shape[0]
    b = b.reshape(rows, -1, 34)
    d = _f16(b[:, :, 0:2].reshape(-1, 2)).reshape(rows, -1)
    w = (b[:, :, 2:] ^ 0x80).reshape(rows, -1).view("<u4")          # int8 q -> q + 128
    return w, d, -128 * d


def _k_scales(blk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K super-blocks (n, bytes) -> per sub-block scale d*sc and bias -dmin*m, (n, 8) each."""
    d, dmin = _f16(blk[:, 0:2]), _f16(blk[:, 2:4])
    sc, mn = kquants.unpack_scales_q4_k(blk[:, 4:16])
    return d * sc.astype(np.float32), -(dmin * mn.astype(np.float32))


def repack_q4_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rows = b.shape[0]
    blk = b.reshape(-1, 144)
    scale, bias = _k_scales(blk)
    # 4 chunks of 32 bytes, each two sub-blocks of 32: the low nibbles, then the high ones
    w = nibbles_to_mlx(blk[:, 16:].reshape(-1, 4, 32)).reshape(rows, -1).view("<u4")
    return w, scale.reshape(rows, -1), bias.reshape(rows, -1)


def repack_q5_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """block_q5_K = { d, dmin: fp16, scales: uint8[12], qh: uint8[32], qs: uint8[128] }, 176 bytes:
    as Q4_K, and value l of sub-block j takes its 5th bit from bit j of qh[l]."""
    rows = b.shape[0]
    blk = b.reshape(-1, 176)
    scale, bias = _k_scales(blk)
    qs = blk[:, 48:].reshape(-1, 4, 1, 32)
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)         # (n, sub-block, l)
    high = (blk[:, None, 16:48] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    q = (low | (high << 4)).reshape(rows, -1)
    return pack(q, 5), scale.reshape(rows, -1), bias.reshape(rows, -1)


def q6_k_integers(blk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K super-blocks (n, 210) -> the exact values in units of d: int16 s[j]*q (n, 256), and d (n, 1)."""
    ql = blk[:, 0:128].reshape(-1, 2, 64)
    qh = blk[:, 128:192].reshape(-1, 2, 32)
    # value 128*h + 32*k + l: 4 low bits from ql, 2 high bits from qh (as kquants.dequantize_q6_k)
    low = np.stack([ql[:, :, :32] & 0x0F, ql[:, :, 32:] & 0x0F, ql[:, :, :32] >> 4, ql[:, :, 32:] >> 4], axis=2)
    high = np.stack([(qh >> (2 * k)) & 3 for k in range(4)], axis=2)
    q = (low | (high << 4)).astype(np.int16) - 32                     # (n, 2, 4, 32)
    s = blk[:, 192:208].view(np.int8).astype(np.int16).reshape(-1, 2, 4, 2, 1)
    v = (q.reshape(-1, 2, 4, 2, 16) * s).reshape(-1, 256)
    return v, _f16(blk[:, 208:210])


def repack_q6_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Re-quantize Q6_K to 8-bit g32 on an integer grid (module docstring): exact when the group's
    range divided by the gcd of its two scales is <= 255."""
    rows = b.shape[0]
    blk = b.reshape(-1, 210)
    v, d = q6_k_integers(blk)
    v = v.reshape(-1, 8, 32)                                          # (n, group, 32)
    s = blk[:, 192:208].view(np.int8).astype(np.int16).reshape(-1, 8, 2)
    g = np.maximum(np.gcd(s[:, :, 0], s[:, :, 1]), 1)                 # every value is a multiple of g
    vmin, vmax = v.min(axis=2), v.max(axis=2)
    span = (vmax - vmin).astype(np.float32)
    # step g keeps every value when 255 codes of g span the group; else min-max's span / 255
    t = np.where(span <= 255 * g, g.astype(np.float32), span / 255)  # (n, 8) in units of d
    x = (v - vmin[:, :, None]).astype(np.float32)
    x *= (1 / t)[:, :, None]
    x += 0.5
    q = x.astype(np.uint8).reshape(rows, -1)                          # x >= 0.5: truncation rounds half up
    scale = (d * t).reshape(rows, -1)
    bias = (d * vmin).reshape(rows, -1)
    return pack(q, 8), scale.astype(np.float32), bias.astype(np.float32)


def repack_q3_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q3_K as 8-bit g32, exact: codes s[j] q + 124 (0..252), scale d, bias -124 d (module docstring)."""
    rows = b.shape[0]
    blk = b.reshape(-1, 110)
    s = kquants.unpack_scales_q3_k(blk[:, 96:108])                   # (n, 16) in -32..31
    v = kquants.codes_q3_k(blk).reshape(-1, 16, 16) * s[:, :, None]  # int16 in -124..128
    d = np.repeat(_f16(blk[:, 108:110]), 8, axis=1).reshape(rows, -1)  # one d for the 8 groups
    return pack((v + 124).astype(np.uint8).reshape(rows, -1), 8), d, -124 * d


def _iq4_codes(qs: np.ndarray) -> np.ndarray:
    """IQ4 bytes (..., 16) -> 8-bit codes (..., 32): the table level + 128 (1..241)."""
    return (iquants.KVALUES_IQ4NL.astype(np.int16)[iquants.codes_iq4(qs)] + 128).astype(np.uint8)


def repack_iq4_nl(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """IQ4_NL as 8-bit g32, exact: codes level + 128, scale d, bias -128 d."""
    rows = b.shape[0]
    blk = b.reshape(-1, 18)
    d = _f16(blk[:, 0:2]).reshape(rows, -1)
    return pack(_iq4_codes(blk[:, 2:]).reshape(rows, -1), 8), d, -128 * d


def repack_iq4_xs(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """IQ4_XS as 8-bit g32, exact: codes level + 128, scale d (ls - 32), bias -128 d (ls - 32)."""
    rows = b.shape[0]
    blk = b.reshape(-1, 136)
    dl = (_f16(blk[:, 0:2]) * iquants.unpack_scales_iq4_xs(blk).astype(np.float32)).reshape(rows, -1)
    return pack(_iq4_codes(blk[:, 8:].reshape(-1, 8, 16)).reshape(rows, -1), 8), dl, -128 * dl


REPACK = {GGMLType.Q4_0: (4, repack_q4_0), GGMLType.Q4_1: (4, repack_q4_1),
          GGMLType.Q5_0: (5, repack_q5_0), GGMLType.Q5_1: (5, repack_q5_1),
          GGMLType.Q8_0: (8, repack_q8_0), GGMLType.Q4_K: (4, repack_q4_k),
          GGMLType.Q5_K: (5, repack_q5_k), GGMLType.Q6_K: (8, repack_q6_k),
          GGMLType.Q3_K: (8, repack_q3_k), GGMLType.IQ4_NL: (8, repack_iq4_nl), GGMLType.IQ4_XS: (8, repack_iq4_xs)}
# Why a mapped type is what plan() says it is; and why a type with none is expanded, where there is more to say
REASONS = {GGMLType.Q6_K: "re-quantized from 16-value sub-blocks (MLX has no group 16)",
           GGMLType.Q3_K: "the integers s*q of its 16-value sub-blocks as 8-bit codes: exact",
           GGMLType.IQ4_NL: "table levels as 8-bit codes: exact", GGMLType.IQ4_XS: "table levels as 8-bit codes: exact",
           GGMLType.Q2_K: "a group of 32 spans two sub-blocks with unrelated scales and mins; MLX has no group 16"}
FLOAT_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)
FLOAT_NAMES = {t.name for t in FLOAT_TYPES}


def transcode_tensor(name: str, type: GGMLType, data: np.ndarray, shape: tuple[int, ...]) -> Affine:
    """Rewrite one 2-D GGML tensor's blocks (uint8 (rows, row_bytes), as GGUFFile.array gives them)
    as MLX affine arrays. Large tensors are cut into row chunks repacked on all cores (numpy
    releases the GIL). Raises ValueError naming the tensor if it has no mapping or its rows are
    not whole groups."""
    if type not in REPACK:
        raise ValueError(f"tensor {name!r}: {type.name} has no MLX affine mapping")
    if len(shape) != 2:
        raise ValueError(f"tensor {name!r}: only matrices are transcoded, got shape {shape}")
    rows, n = shape
    if n % GROUP:
        raise ValueError(f"tensor {name!r}: row length {n} is not a multiple of the group size {GROUP}")
    block_values, block_bytes = BLOCK[type]
    if n % block_values or data.shape != (rows, n // block_values * block_bytes):
        raise ValueError(f"tensor {name!r}: {type.name} data of shape {data.shape} does not hold "
                         f"a ({rows}, {n}) matrix")
    bits, repack = REPACK[type]
    weight = np.empty((rows, n * bits // 32), np.uint32)
    scales, biases = np.empty((rows, n // GROUP), np.float32), np.empty((rows, n // GROUP), np.float32)

    def run(lo: int, hi: int) -> None:
        weight[lo:hi], scales[lo:hi], biases[lo:hi] = repack(data[lo:hi])

    chunk = max(1, (4 << 20) // data.shape[1])                        # ~4 MB of blocks a chunk
    if rows <= chunk:
        run(0, rows)
    else:
        with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            list(pool.map(lambda lo: run(lo, min(lo + chunk, rows)), range(0, rows, chunk)))
    return Affine(weight, scales, biases, bits)


def transcode_stacked(name: str, type: GGMLType, data: np.ndarray, shape: tuple[int, ...]) -> Affine:
    """Rewrite a stack of matrices (n, rows, n_in), such as a MoE layer's experts (uint8 (n, rows, row_bytes),
    as GGUFFile.array gives them), as MLX affine arrays stacked the same way: weight (n, rows, packed),
    scales and biases (n, rows, n_in / 32), for mx.gather_qmm. No GGML block crosses a row, so the stack
    is transcoded as one (n * rows, n_in) matrix by transcode_tensor: each expert gets the 2-D rule of its type."""
    if len(shape) != 3:
        raise ValueError(f"tensor {name!r}: a stack of matrices has 3 dimensions, got shape {shape}")
    n, rows, n_in = shape
    if data.ndim != 3 or data.shape[:2] != (n, rows):
        raise ValueError(f"tensor {name!r}: {type.name} data of shape {data.shape} does not hold "
                         f"{n} matrices of {rows} rows")
    a = transcode_tensor(name, type, data.reshape(n * rows, -1), (n * rows, n_in))
    return Affine(*(x.reshape(n, rows, -1) for x in (a.weight, a.scales, a.biases)), a.bits, a.group_size)


# --- the model -----------------------------------------------------------------------------------

def plan(f: gguf.GGUFFile) -> dict[str, Plan]:
    """Which MLX representation each tensor gets, and why; reads no tensor data."""
    out = {}
    for name, info in f.tensors.items():
        t = info.type
        if t in FLOAT_TYPES:
            bits, reason = None, f"{t.name} is a float type"
        elif len(info.shape) not in (2, 3):    # 3: a MoE layer's stacked experts
            bits, reason = None, "vectors (norms, rope factors) stay float"
        elif t in REPACK:
            bits, reason = REPACK[t][0], REASONS.get(t, "codes re-packed, exact")
        else:
            why = f" ({REASONS[t]})" if t in REASONS else ""
            bits, reason = None, f"no MLX affine mapping for {t.name}: expanded to float{why}"
        out[name] = Plan(name, t.name, tuple(info.shape), bits, reason)
    return out


def swap_quantized(model: nn.Module, f: gguf.GGUFFile, names: dict[str, str], scale_dtype: mx.Dtype
                   ) -> dict[str, list[tuple[str, mx.array]]]:
    """Swap every matrix of `model` that `f` holds in a mapped GGML type for a QuantizedLinear or
    QuantizedEmbedding (a MoE layer's stacked experts: a moe.QuantizedExperts) with the file's bits, and
    return the arrays to load into it, by GGUF name:
    its codes, and its scales and biases in `scale_dtype` (float32 makes every mapping but Q6_K exact;
    with float16 activations it also makes matmuls return float32). A projection's own bias (qwen2's q, k, v)
    stays a float parameter of the new layer, loaded like the norms.

    names: GGUF tensor name -> parameter name (checkpoint.gguf_weight_names). A matrix of a type with
    no mapping is left as it is, to be loaded as floats like the norms, and logged; `plan(f)` gives
    the table of what became what.
    """
    modules = dict(model.named_modules())
    table = plan(f)
    fallbacks = sorted({p.ggml_type for p in table.values()
                        if p.bits is None and len(p.shape) in (2, 3) and p.ggml_type not in FLOAT_NAMES})
    if fallbacks:
        log.warning("no MLX affine mapping for %s: those tensors are expanded to floats", ", ".join(fallbacks))
    swaps, weights = [], {}
    for name, mlx_name in names.items():
        if table[name].bits is None:
            continue
        info = f.tensors[name]
        stacked = len(info.shape) == 3               # a MoE layer's experts (moe.Experts)
        a = (transcode_stacked if stacked else transcode_tensor)(name, info.type, f.array(name), info.shape)
        path = mlx_name.rsplit(".", 1)[0]
        rows, n = info.shape[-2:]
        if stacked:
            q = QuantizedExperts(info.shape[0], n, rows, group_size=a.group_size, bits=a.bits)
        elif isinstance(modules[path], nn.Embedding):
            q = nn.QuantizedEmbedding(rows, n, group_size=a.group_size, bits=a.bits)
        else:
            q = nn.QuantizedLinear(n, rows, bias="bias" in modules[path], group_size=a.group_size, bits=a.bits)
        swaps.append((path, q))
        weights[name] = [(f"{path}.weight", mx.array(a.weight)),
                         (f"{path}.scales", mx.array(a.scales).astype(scale_dtype)),
                         (f"{path}.biases", mx.array(a.biases).astype(scale_dtype))]
    model.update_modules(nn.utils.tree_unflatten(swaps))
    return weights


def transcode_error(f: gguf.GGUFFile, name: str, scale_dtype: mx.Dtype = mx.float32) -> float:
    """Max |MLX's dequantization of our arrays - kquants' dequantization| for one tensor, with
    scales and biases stored in scale_dtype (mx.dequantize then also returns scale_dtype)."""
    info = f.tensors[name]
    a = transcode_tensor(name, info.type, f.array(name), info.shape)
    ours = mx.dequantize(mx.array(a.weight), mx.array(a.scales).astype(scale_dtype),
                         mx.array(a.biases).astype(scale_dtype), group_size=a.group_size, bits=a.bits)
    return float(np.abs(np.array(ours.astype(mx.float32)) - f.dequantize(name)).max())
