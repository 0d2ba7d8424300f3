"""Q2_K, Q3_K and Q5_1 writers (lowbits.py) against llama.cpp: the same bytes as ggml-quants.c's
quantize_row_*_ref (llama-cpp-python's non-FMA libggml-base, through ctypes), a round trip through the
`gguf` package's dequantizer that puts every value on the nearest level of its sub-block, and clear
errors for input the formats cannot hold."""

from __future__ import annotations

import ctypes
import re
from functools import cache

import ggml_oracle
import gguf
import numpy as np
import pytest
from gguf import quants
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ref_impl.formats import gguf as our_gguf
from ref_impl.formats import lowbits, quantize

TYPES = ["Q2_K", "Q3_K", "Q5_1"]
K_TYPES = ["Q2_K", "Q3_K"]
C_NAMES = {"Q2_K": "q2_K", "Q3_K": "q3_K", "Q5_1": "q5_1"}


def sizes(name: str) -> tuple[int, int]:
    """(values, bytes) per block, from the gguf package."""
    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]


@cache
def _c_quantizer(name: str):
    ggml_oracle.assert_fma_free()
    fn = getattr(ctypes.CDLL(str(ggml_oracle.library_path())), f"quantize_row_{C_NAMES[name]}_ref")
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64], None
    return fn


def llama_cpp_quantize(x: np.ndarray, name: str) -> np.ndarray:
    """llama.cpp's quantize_row_<type>_ref on float32 rows (..., n) -> uint8 (..., n // block * bytes)."""
    block, nbytes = sizes(name)
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.zeros((*x.shape[:-1], x.shape[-1] // block * nbytes), np.uint8)
    _c_quantizer(name)(x.ctypes.data, out.ctypes.data, x.size)
    return out


def assert_same_bytes(ours: np.ndarray, theirs: np.ndarray, name: str) -> None:
    assert ours.dtype == np.uint8 and ours.shape == theirs.shape
    nb = sizes(name)[1]
    a, b = ours.reshape(-1, nb), theirs.reshape(-1, nb)
    bad = np.flatnonzero((a != b).any(axis=1))
    assert bad.size == 0, (f"{name}: {bad.size} of {len(a)} blocks differ from llama.cpp; first "
                           f"block {bad[0]}: ours {a[bad[0]]}, theirs {b[bad[0]]}")


# ------------------------------------------------------------------ byte equality with llama.cpp

N_VALUES = 256 * 256    # 256 super-blocks (2048 blocks of 32) per case


def _cases() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(38)
    n = N_VALUES
    gauss = rng.standard_normal(n)
    spikes = np.zeros(n)
    spikes[np.arange(0, n, 16) + rng.integers(0, 16, n // 16)] = rng.standard_normal(n // 16) * 10
    return {
        "gaussian": gauss,
        "gaussian_scales_vary": gauss * np.repeat(rng.lognormal(0, 2, n // 16), 16),
        "student_t1": rng.standard_t(1, n),
        "uniform_positive": rng.uniform(0, 1, n),       # min clamped to 0: Q2_K's refit through zero
        "uniform_negative": rng.uniform(-1, 0, n),
        "zero_signed": np.copysign(np.zeros(n), rng.standard_normal(n)),
        "constant_negative": np.full(n, -0.7),
        "constant_per_sub_block": np.repeat(rng.standard_normal(n // 16), 16),
        "sparse": np.where(rng.random(n) < 0.9, 0.0, gauss),   # all-zero sub-blocks beside others
        "one_hot": spikes,
        "tiny_1e-20": gauss * 1e-20,                    # below GROUP_MAX_EPS: Q3_K's all-zero path
        "huge_1e30": gauss * 1e30,                      # x*x overflows, fp16 d is inf
        "small_integers": rng.integers(-4, 4, n),       # exact ties in the final roundings
        "quarter_grid": rng.integers(-64, 65, n) / 4,
    }


CASES = _cases()


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_quantize_writes_llama_cpps_bytes(name, case):
    x = CASES[case].astype(np.float32).reshape(-1, 1024)
    assert_same_bytes(lowbits.QUANTIZE[name](x), llama_cpp_quantize(x, name), name)


@pytest.mark.parametrize("name", K_TYPES)
def test_k_quants_write_llama_cpps_bytes_for_subnormal_input(name):
    """(Q5_1's 1/d overflows there and C's float -> uint8 cast is undefined: left out.)"""
    x = (CASES["gaussian"] * 1e-39).astype(np.float32)
    assert np.any((x != 0) & (np.abs(x) < np.finfo(np.float32).tiny))
    assert_same_bytes(lowbits.QUANTIZE[name](x), llama_cpp_quantize(x, name), name)


def test_quantize_shipped_weights_like_llama_cpp(shipped_model):
    """Real weights, rows of 1024 (ffn_down: the tensor a Q2_K file of the shipped model holds in Q3_K)."""
    with our_gguf.read(shipped_model) as f:
        w = np.array(f.array("blk.2.ffn_down.weight"), dtype=np.float32)
    for name in TYPES:
        assert_same_bytes(lowbits.QUANTIZE[name](w), llama_cpp_quantize(w, name), name)


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(np.float32, st.just((2, 256)), elements=st.floats(width=32, allow_nan=False, allow_infinity=False)),
       st.sampled_from(K_TYPES))
def test_k_quants_write_llama_cpps_bytes_for_any_values(x, name):
    assert_same_bytes(lowbits.QUANTIZE[name](x), llama_cpp_quantize(x, name), name)


@pytest.mark.parametrize("name", TYPES)
def test_quantize_keeps_leading_dimensions(name):
    x = np.random.default_rng(3).standard_normal((2, 3, 512)).astype(np.float32)
    ours = lowbits.QUANTIZE[name](x)
    block, nbytes = sizes(name)
    assert ours.shape == (2, 3, 512 // block * nbytes)
    assert_same_bytes(ours, llama_cpp_quantize(x, name), name)


# -------------------------------------------------------- round trip through the gguf package

def _levels(data: np.ndarray, name: str) -> np.ndarray:
    """Every level each value could decode to, (n_values, n_levels): the gguf package's dequantizer on
    copies of `data` (n, bytes) whose codes are all set to one level; scales, mins and d stay."""
    qtype = gguf.GGMLQuantizationType[name]
    out = []
    for k in range(4 if name == "Q2_K" else 8):
        b = data.copy()
        if name == "Q2_K":
            b[:, 16:80] = 0x55 * k                      # four 2-bit codes a byte
        else:
            b[:, 32:96] = 0x55 * (k & 3)                # low two bits, then hmask's third bit
            b[:, 0:32] = 0xFF if k >= 4 else 0
        out.append(quants.dequantize(b, qtype).reshape(-1))
    return np.stack(out, axis=1)


@pytest.mark.parametrize("name", K_TYPES)
@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
def test_round_trip_lands_on_the_nearest_level(name, scale):
    """The last step of both quantizers re-rounds every value to its sub-block's grid: decoded by the
    gguf package, each value sits on the level nearest to it (up to float32 rounding of the grid)."""
    rng = np.random.default_rng(int(scale * 1000))
    spread = np.repeat(rng.lognormal(0, 1, (16, 64)), 16, axis=1)        # one size per sub-block
    x = (rng.standard_t(3, (16, 1024)) * spread * scale).astype(np.float32)
    data = lowbits.QUANTIZE[name](x)
    back = quants.dequantize(data, gguf.GGMLQuantizationType[name]).reshape(-1)
    levels = _levels(data.reshape(-1, sizes(name)[1]), name)
    xs = x.reshape(-1).astype(np.float64)
    nearest = np.abs(levels - xs[:, None]).min(axis=1)
    slack = 1e-5 * np.abs(levels).max(axis=1) + 1e-30
    assert np.all(np.abs(back - xs) <= nearest + slack)
    rms = np.sqrt(np.mean((back - xs) ** 2) / np.mean(xs ** 2))
    assert rms < {"Q2_K": 0.4, "Q3_K": 0.2}[name], f"relative RMS error {rms:.3f}"


def test_q5_1_round_trip_error_is_half_a_step():
    """Q5_1: 32 levels from min to max, so half a step (max - min)/62, plus fp16's rounding of d and m."""
    x = np.random.default_rng(5).standard_normal((64, 256)).astype(np.float32)
    back = quants.dequantize(lowbits.quantize_q5_1(x), gguf.GGMLQuantizationType.Q5_1).reshape(-1, 32)
    xb = x.reshape(-1, 32).astype(np.float64)
    span = (xb.max(axis=1) - xb.min(axis=1))[:, None]
    bound = (span / 62 + 2.0**-11 * (span + np.abs(xb.min(axis=1))[:, None])) * 1.01
    assert np.all(np.abs(back - xb) <= bound)


# ------------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("shape", [(), (0,), (0, 256), (31,), (4, 33), (2, 272)])
def test_quantize_rejects_rows_that_hold_no_whole_blocks(name, shape):
    block = sizes(name)[0]
    with pytest.raises(ValueError, match=f"{name} needs a last dimension that is a positive multiple of {block}, "
                                         f"got shape {re.escape(str(shape))}"):
        lowbits.QUANTIZE[name](np.ones(shape, np.float32))


@pytest.mark.parametrize("name", K_TYPES)
def test_convert_names_the_type_a_row_of_384_does_not_fit(name):
    """quantize.convert hands a K-quant the whole tensor: rows of 384 (the shipped model's) are refused,
    not run on across rows; tensor_types never asks for it (they fall back to Q4_0)."""
    with pytest.raises(ValueError, match=rf"{name} needs a last dimension that is a positive multiple of 256, "
                                         r"got shape \(2, 384\)"):
        quantize.convert(np.ones((2, 384), np.float32), name)


@pytest.mark.parametrize("name", TYPES)
def test_quantize_rejects_non_float_dtypes(name):
    with pytest.raises(ValueError, match=f"{name} quantizes floating-point values, got dtype int32"):
        lowbits.QUANTIZE[name](np.ones((2, 256), np.int32))
