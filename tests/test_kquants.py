"""Block formats, against llama.cpp itself: our quantizers write the same bytes as ggml-quants.c's
quantize_row_*_ref (called through ctypes, tests/ggml_oracle.py), and our dequantizers give the same
floats as llama.cpp's `gguf` package and its dequantize_row_*. Then error bounds derived from each
format, the 6-bit scale packing, and corrupt input."""

from __future__ import annotations

import sysconfig
import zlib

import ggml_oracle
import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import quants
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ref_impl.engine.checkpoint import load
from ref_impl.engine.random import random_blocks
from ref_impl.formats import gguf as our_gguf
from ref_impl.formats import kquants, quantize
from ref_impl.formats.kquants import dequantize_q8_0, quantize_q8_0

TYPES = ["Q4_0", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
K_TYPES = ["Q4_K", "Q5_K", "Q6_K"]
Q8 = gguf.GGMLQuantizationType.Q8_0


def oracle(data: np.ndarray, name: str) -> np.ndarray:
    return quants.dequantize(data, gguf.GGMLQuantizationType[name])


def block_bytes(name: str) -> int:
    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]][1]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")   # inf scales times zero, in the oracle too
@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("shape", [(1, 1), (3, 2), (2, 2, 3)])   # (..., blocks per row)
def test_dequantize_equals_llama_cpp_on_any_bytes(name, shape):
    """Every byte pattern, inf and nan scales included, decodes exactly as gguf-py decodes it."""
    seed = zlib.crc32(f"{name} {shape}".encode())     # fixed across runs (hash() is salted per process)
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (*shape[:-1], shape[-1] * block_bytes(name)), dtype=np.uint8)
    ours, ref = kquants.DEQUANTIZE[name](data), oracle(data, name)
    assert ours.dtype == np.float32 and ours.shape == ref.shape, f"seed {seed}"
    assert np.array_equal(ours, ref, equal_nan=True), f"seed {seed}"
    assert np.array_equal(ours, ggml_oracle.dequantize(data, name), equal_nan=True), f"seed {seed}"


@pytest.mark.parametrize("name", K_TYPES)
def test_dequantize_plausible_weights(name):
    data = random_blocks(name, 8, 512, np.random.default_rng(0))
    ours = kquants.DEQUANTIZE[name](data)
    assert ours.shape == (8, 512) and np.isfinite(ours).all() and np.abs(ours).max() < 2
    assert np.array_equal(ours, oracle(data, name))


def test_q4_k_scale_unpacking_by_hand():
    # scales 0-3 and mins 0-3 are the low 6 bits of bytes 0-3 and 4-7; scale 4 is the low nibble of
    # byte 8 plus byte 0's top two bits << 4; min 4 is byte 8's high nibble plus byte 4's top bits << 4
    packed = np.zeros((1, 12), dtype=np.uint8)
    packed[0, 0] = 0b11_000101      # scale 0 = 5, top bits 3
    packed[0, 4] = 0b01_001001      # min 0 = 9, top bits 1
    packed[0, 8] = 0b1010_0110      # scale 4 low nibble 6, min 4 low nibble 10
    sc, mn = kquants.unpack_scales_q4_k(packed)
    assert sc[0, 0] == 5 and mn[0, 0] == 9
    assert sc[0, 4] == 6 | (3 << 4) and mn[0, 4] == 10 | (1 << 4)


@pytest.mark.parametrize("name", TYPES)
def test_wrong_byte_count_is_a_clear_error(name):
    bad = np.zeros((2, block_bytes(name) + 1), dtype=np.uint8)
    with pytest.raises(ValueError, match=f"{name} data must be uint8 with a last dimension that is a multiple"):
        kquants.DEQUANTIZE[name](bad)
    with pytest.raises(ValueError, match=f"{name} data must be uint8"):
        kquants.DEQUANTIZE[name](np.zeros((2, block_bytes(name)), dtype=np.float32))


def test_decoder_runs_a_llama_cpp_q4_k_m_file(llama_q4_k_m):
    """Expanded to floats, a llama.cpp Q4_K_M file decodes as llama.cpp decodes it: the same top-1
    token at >= 95% of the positions of held-out text (llama.cpp also rounds the activations to 8
    bits in its dot products, so logits differ by more than float error)."""
    import llama_cpp

    with our_gguf.read(llama_q4_k_m) as f:
        types = {t.type.name for t in f.tensors.values()}
    assert {"Q4_K", "Q6_K", "Q5_0"} <= types
    model, tok = load(llama_q4_k_m, mx.float32)
    text = open(sysconfig.get_paths()["stdlib"] + "/argparse.py", encoding="utf-8").read()[20000:23000]
    ids = tok.encode(text, bos=True)[:256]
    ours = np.array(model(mx.array([ids]))[0])
    llm = llama_cpp.Llama(str(llama_q4_k_m), n_ctx=512, logits_all=True, n_threads=1, n_threads_batch=1,
                          type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32, verbose=False)
    llm.eval(ids)
    theirs = np.array(llm.scores[: len(ids)])
    agree = np.mean(ours.argmax(-1) == theirs.argmax(-1))
    assert agree >= 0.95, f"top-1 agreement {agree:.3f}, max logit diff {np.abs(ours - theirs).max():.3f}"


# ------------------------------------------------------------ quantization: byte equality with llama.cpp

N_VALUES = 2048 * 256   # 2048 super-blocks, 16384 blocks of 32: an FMA-like 6% disagreement could not hide


def _cases() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1234)
    n = N_VALUES
    gauss = rng.standard_normal(n)
    spikes = np.zeros(n)
    spikes[np.arange(0, n, 32) + rng.integers(0, 32, n // 32)] = rng.standard_normal(n // 32) * 10
    return {
        "gaussian": gauss,
        "gaussian_scales_vary": gauss * np.repeat(rng.lognormal(0, 2, n // 32), 32),
        "student_t1": rng.standard_t(1, n),
        "student_t2": rng.standard_t(2, n),
        "cauchy": rng.standard_cauchy(n),
        "uniform_positive": rng.uniform(0, 1, n),
        "zero_signed": np.copysign(np.zeros(n), rng.standard_normal(n)),    # +0.0 and -0.0
        "constant_positive": np.full(n, 0.7),
        "constant_negative": np.full(n, -0.7),
        "constant_per_block": np.repeat(rng.standard_normal(n // 256), 256),
        "one_hot": spikes,
        "spikes_on_noise": spikes * 10 + gauss * 0.01,
        "tiny_1e-20": gauss * 1e-20,                # x*x is subnormal: weights lose precision
        "tiny_1e-30": gauss * 1e-30,                # x*x underflows to 0
        "huge_1e4": gauss * 1e4,
        "huge_1e30": gauss * 1e30,                  # fp16 d is inf; x*x overflows float32 in the K-quants
        "fp16_values": gauss.astype(np.float16),
        "quarter_grid": rng.integers(-64, 65, n) / 4,   # exact ties in the K-quants' final rounding
    }


CASES = _cases()
# Blocks with max|x| below ~2.4e-38 overflow 1/d in Q4_0/Q5_0/Q8_0, and C's float -> int8 cast of
# inf is undefined: llama.cpp's bytes there are not defined, so this case runs for the K-quants only
# (their nearest_int is bit arithmetic and defined for any float; an assert-enabled build aborts).
SUBNORMAL = CASES["gaussian"] * 1e-39


def _block_bytes(name: str) -> int:
    return ggml_oracle.TYPES[name][1]


@pytest.fixture(scope="module")
def fma_free_oracle():
    ggml_oracle.assert_fma_free()
    return ggml_oracle


def test_oracle_is_the_non_fma_build():
    """libggml-base.so has no fused multiply-add, so its rounding is the C source's (see ggml_oracle)."""
    ggml_oracle.assert_fma_free()


def _assert_same_bytes(ours: np.ndarray, theirs: np.ndarray, name: str) -> None:
    assert ours.dtype == np.uint8 and ours.shape == theirs.shape
    nb = _block_bytes(name)
    bad = np.flatnonzero((ours.reshape(-1, nb) != theirs.reshape(-1, nb)).any(axis=1))
    assert bad.size == 0, (f"{name}: {bad.size} of {ours.size // nb} blocks differ from llama.cpp; first "
                           f"block {bad[0]}: ours {ours.reshape(-1, nb)[bad[0]]}, theirs {theirs.reshape(-1, nb)[bad[0]]}")


def _assert_dequantizers_agree(data: np.ndarray, name: str) -> None:
    ours = kquants.DEQUANTIZE[name](data)
    with np.errstate(invalid="ignore", over="ignore"):
        assert np.array_equal(ours, oracle(data, name), equal_nan=True)
    assert np.array_equal(ours, ggml_oracle.dequantize(data, name), equal_nan=True)


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_quantize_writes_llama_cpps_bytes(fma_free_oracle, name, case):
    x = CASES[case].astype(np.float32).reshape(-1, 1024)
    theirs = fma_free_oracle.quantize(x, name)
    _assert_same_bytes(kquants.QUANTIZE[name](x), theirs, name)
    _assert_dequantizers_agree(theirs, name)


@pytest.mark.parametrize("name", K_TYPES)
def test_k_quants_write_llama_cpps_bytes_for_subnormal_input(fma_free_oracle, name):
    x = SUBNORMAL.astype(np.float32)
    assert np.any((x != 0) & (np.abs(x) < np.finfo(np.float32).tiny))
    _assert_same_bytes(kquants.QUANTIZE[name](x), fma_free_oracle.quantize(x, name), name)


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("tensor", ["token_embd.weight", "blk.0.attn_k.weight", "blk.3.ffn_down.weight"])
def test_quantize_shipped_weights_like_llama_cpp(fma_free_oracle, shipped_model, name, tensor):
    """Real weights. Rows of 384 are no multiple of 256; the *_ref functions only see blocks, so the
    K-quants get the tensor flattened (llama.cpp itself would write Q5_0 for such a Q4_K tensor)."""
    with our_gguf.read(shipped_model) as f:
        w = np.array(f.array(tensor), dtype=np.float32)
    if name in K_TYPES:
        w = w.reshape(-1)
    theirs = fma_free_oracle.quantize(w, name)
    _assert_same_bytes(kquants.QUANTIZE[name](w), theirs, name)
    _assert_dequantizers_agree(theirs, name)


def _final_rounding_ties(x: np.ndarray, data: np.ndarray, name: str) -> int:
    """How many values sit exactly halfway between two quants in the K-quants' last rounding,
    (x + dm) / (d * sc), with the scales read back from llama.cpp's bytes (by gguf-py)."""
    b = data.reshape(-1, _block_bytes(name))
    if name == "Q6_K":
        step = b[:, 208:210].copy().view("<f2").astype(np.float32) * b[:, 192:208].view(np.int8).astype(np.float32)
        v = x.reshape(len(b), 16, 16) / step[:, :, None]
    else:
        sc, mn = quants.Q4_K.get_scale_min(b[:, 4:16])
        step = b[:, 0:2].copy().view("<f2").astype(np.float32) * sc.reshape(-1, 8).astype(np.float32)
        offset = b[:, 2:4].copy().view("<f2").astype(np.float32) * mn.reshape(-1, 8).astype(np.float32)
        v = (x.reshape(len(b), 8, 32) + offset[:, :, None]) / step[:, :, None]
    v = v.astype(np.float64)
    return int(np.sum(v - np.floor(v) == 0.5))


@pytest.mark.parametrize("name", K_TYPES)
def test_quarter_grid_case_has_exact_ties(fma_free_oracle, name):
    """The quarter_grid case above really exercises nearest_int's round-half-to-even."""
    x = CASES["quarter_grid"].astype(np.float32)
    assert _final_rounding_ties(x, fma_free_oracle.quantize(x, name), name) > 0


@pytest.mark.parametrize("name,levels", [("Q4_0", 8), ("Q5_0", 16), ("Q8_0", -127)])
def test_q_0_types_on_exact_rounding_boundaries(fma_free_oracle, name, levels):
    """d = 1 exactly, and every other value is k + 0.5: Q4_0/Q5_0 truncate x/d + 8.5 (16.5), which
    is then an exact integer; Q8_0's roundf takes the halves away from zero."""
    rng = np.random.default_rng(7)
    x = rng.integers(-abs(levels), abs(levels), (4096, 32)) + 0.5
    x[:, 0] = -levels
    x = x.astype(np.float32)
    _assert_same_bytes(kquants.QUANTIZE[name](x), fma_free_oracle.quantize(x, name), name)


@pytest.mark.parametrize("name", TYPES)
def test_quantize_keeps_leading_dimensions(fma_free_oracle, name):
    x = np.random.default_rng(3).standard_normal((2, 3, 512)).astype(np.float32)
    ours = kquants.QUANTIZE[name](x)
    assert ours.shape == (2, 3, 512 // ggml_oracle.TYPES[name][0] * _block_bytes(name))
    _assert_same_bytes(ours, fma_free_oracle.quantize(x, name), name)


def test_nearest_int_rounds_halves_to_even():
    v = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.49999997, 14.5, 15.5, -0.0, 4194303.0], np.float32)
    assert kquants.nearest_int(v).tolist() == np.rint(v).astype(int).tolist()


# ------------------------------------------------------------------- error bounds from the formats

def _fp16_normal(d: np.ndarray) -> np.ndarray:
    return np.abs(d) >= 2.0**-14


@settings(max_examples=100, deadline=None)
@given(hnp.arrays(np.float32, st.tuples(st.integers(1, 3), st.integers(1, 3).map(lambda n: 32 * n)),
                  elements=st.floats(-1e4, 1e4, width=32)),
       st.sampled_from([("Q4_0", 8), ("Q5_0", 16), ("Q8_0", 127)]))
def test_q_0_error_bound(x, kind):
    """Q8_0: half a step, d = max|x|/127. Q4_0/Q5_0: d = -max/8 (16) puts the largest-magnitude value
    on the bottom level; values of the other sign beyond level 7 (15) clip there. Plus fp16's 2**-11
    relative rounding of d, times at most `levels` steps."""
    name, levels = kind
    blocks = x.reshape(-1, 32).astype(np.float64)
    vmax = blocks[np.arange(len(blocks)), np.abs(blocks).argmax(axis=1)]
    d = np.abs(vmax)[:, None] / levels
    err = np.abs(kquants.DEQUANTIZE[name](kquants.QUANTIZE[name](x)).reshape(-1, 32) - blocks)
    if name == "Q8_0":
        step_err = np.full_like(blocks, 0.5)
    else:
        with np.errstate(invalid="ignore", divide="ignore"):   # all-zero blocks: d = 0
            t = blocks / (-vmax[:, None] / levels)      # x/d in [-levels, levels]
        step_err = np.maximum(0.5, t - (levels - 1))    # above levels - 1 clips to the top level
    bound = d * (step_err + levels * 2.0**-11 + 1e-5)
    ok = _fp16_normal(d[:, 0])
    assert np.all(err[ok] <= bound[ok])


def _k_bound(x: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Per value: the error of a quantize/dequantize round trip and its bound.

    Q4_K/Q5_K: a sub-block of range R = max(x) - min(x, 0) gets a step of about R/(nmax-1) or finer,
    so rounding costs half of that. The scale and min are a weighted least-squares fit, which may leave
    a value within a step of either end off the grid: it clips, by up to a step (seed 1078's uniform
    block, which the half step alone missed). The 6-bit scale and min are off by up to half of max_scale/63
    and max_min/63 (both at most R_max/63 over the super-block's largest range R_max), which
    moves the far end of the sub-block's grid by up to (nmax*max_scale + max_min)/126 ~ R_max/63.
    Q6_K: step about amax/32 (amax/31.1 to amax/32.9 in the search), so half of amax/31 inside the
    grid; a value of the other sign beyond 31 steps clips there. The int8 scales are off by up to
    max_scale/256, which moves the 32nd step by amax_max/248.
    fp16 rounds d and dmin by up to 2**-11 of themselves, which moves a value by up to 2**-10 max|x|,
    and a slack of 2**-25 * 63 * 63 covers subnormal fp16 scales; super-blocks with max|x| > 1e6, whose
    fp16 dmin (up to max|x|/63) may overflow, are left out."""
    if name == "Q6_K":
        xs = x.reshape(-1, 16, 16).astype(np.float64)
        a = np.abs(xs).max(axis=2, keepdims=True)
        bound = 0.5 * a / 31 + np.maximum(0, np.abs(xs) - 31 * a / 33) + a.max(axis=1, keepdims=True) / 200
    else:
        nmax = 15 if name == "Q4_K" else 31
        xs = x.reshape(-1, 8, 32).astype(np.float64)
        lo, hi = np.minimum(xs.min(axis=2, keepdims=True), 0), xs.max(axis=2, keepdims=True)
        r = hi - lo
        step = r / (nmax - 1)
        ends = (xs - lo < step) | (hi - xs < step)            # may clip: a whole step
        bound = np.where(ends, step, 0.5 * step) + r.max(axis=1, keepdims=True) / 50
    bound = bound + 2.0**-10 * np.abs(xs).max(axis=(1, 2), keepdims=True)   # fp16 rounding of d, dmin
    err = np.abs(kquants.DEQUANTIZE[name](kquants.QUANTIZE[name](x)).reshape(xs.shape) - xs)
    fits_fp16 = np.abs(xs).max(axis=(1, 2), keepdims=True) <= 1e6   # beyond, dmin can overflow fp16
    return np.where(fits_fp16, err, 0), bound * (1 + 1e-5) + 2.0**-25 * 63 * 63


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from(["normal", "t2", "cauchy", "uniform", "spiky", "scaled"]),
       st.sampled_from([1e-3, 1.0, 1e3]), st.sampled_from(K_TYPES))
@example(1078, "uniform", 1.0, "Q4_K")      # an end value clipped by nearly a step (found by this test)
@example(1105, "normal", 1.0, "Q4_K")
def test_k_quant_error_bound(seed, dist, scale, name):
    rng = np.random.default_rng(seed)
    n = 4 * 256
    x = {"normal": rng.standard_normal(n), "t2": rng.standard_t(2, n), "cauchy": rng.standard_cauchy(n),
         "uniform": rng.uniform(-0.2, 1, n), "spiky": np.where(rng.random(n) < 0.02, 50.0, rng.standard_normal(n)),
         "scaled": rng.standard_normal(n) * np.repeat(rng.lognormal(0, 2, n // 16), 16)}[dist]
    err, bound = _k_bound((x * scale).astype(np.float32), name)
    assert np.all(err <= bound), f"worst value: err/bound = {(err / bound).max():.3f}"


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(np.float32, st.just(256), elements=st.floats(-1e3, 1e3, width=32)), st.sampled_from(K_TYPES))
def test_k_quant_error_bound_any_values(x, name):
    err, bound = _k_bound(x, name)
    assert np.all(err <= bound), f"worst value: err/bound = {(err / bound).max():.3f}"


# ---------------------------------------------------------------------------- 6-bit scale packing

def test_q4_k_scale_packing_round_trips_every_value():
    v = np.arange(64, dtype=np.uint8)
    sc = np.stack([np.roll(v, j) for j in range(8)], axis=1)        # (64, 8): every value at every position
    mn = sc[::-1]
    packed = kquants.pack_scales_q4_k(sc, mn)
    assert packed.shape == (64, 12) and packed.dtype == np.uint8
    back_sc, back_mn = kquants.unpack_scales_q4_k(packed)
    assert np.array_equal(back_sc, sc) and np.array_equal(back_mn, mn)
    gguf_sc, gguf_mn = quants.Q4_K.get_scale_min(packed)            # llama.cpp's own unpacking
    assert np.array_equal(gguf_sc.reshape(64, 8), sc) and np.array_equal(gguf_mn.reshape(64, 8), mn)


@settings(max_examples=100, deadline=None)
@given(hnp.arrays(np.uint8, st.tuples(st.integers(1, 4), st.just(16)), elements=st.integers(0, 63)))
def test_q4_k_scale_packing_round_trips(both):
    sc, mn = both[:, :8], both[:, 8:]
    assert all(np.array_equal(a, b) for a, b in zip(kquants.unpack_scales_q4_k(kquants.pack_scales_q4_k(sc, mn)), (sc, mn)))


def test_q4_k_scale_packing_rejects_7_bit_values():
    with pytest.raises(ValueError, match="6-bit values 0..63"):
        kquants.pack_scales_q4_k(np.full((1, 8), 64), np.zeros((1, 8)))


# ------------------------------------------------------------------------------- corrupt input

@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0), (0, 256), (31,), (4, 33), (2, 272)])
def test_quantize_rejects_bad_shapes(name, shape):
    block = ggml_oracle.TYPES[name][0]
    with pytest.raises(ValueError, match=f"{name} needs a last dimension that is a positive multiple of {block}"):
        kquants.QUANTIZE[name](np.ones(shape, np.float32))


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("dtype", [np.int32, np.uint8, np.complex64, bool])
def test_quantize_rejects_non_float_dtypes(name, dtype):
    with pytest.raises(ValueError, match=f"{name} quantizes floating-point values, got dtype"):
        kquants.QUANTIZE[name](np.ones((2, 256), dtype))


@pytest.mark.parametrize("name", list(quantize.QUANTIZE))   # lowbits.py's quantizers too
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 1e39])   # 1e39 is inf as float32
def test_quantize_rejects_non_finite_values_and_names_the_first(name, bad):
    x = np.zeros((3, 512), np.float64)
    x[1, 300] = x[2, 5] = bad
    with pytest.raises(ValueError, match=rf"{name} input has a non-finite value .* at index \(1, 300\)"):
        quantize.QUANTIZE[name](x)


@pytest.mark.parametrize("name", TYPES)
def test_dequantize_rejects_truncated_and_mistyped_data(name):
    good = kquants.QUANTIZE[name](np.ones((2, 512), np.float32))
    nb = _block_bytes(name)
    for bad in (good[:, :-1], good[:, : nb - 3], good.reshape(-1)[:-nb // 2], good[:, :0]):
        with pytest.raises(ValueError, match=f"{name} data must be uint8 with a last dimension that is a multiple of {nb}"):
            kquants.DEQUANTIZE[name](bad)
    for bad in (good.view(np.int8), good.astype(np.float32), np.uint8(7)):
        with pytest.raises(ValueError, match=f"{name} data must be uint8"):
            kquants.DEQUANTIZE[name](bad)


# ------------------------------------------------------------------------------------------------ Q8_0

def _q8_cases():
    rng = np.random.default_rng(2)
    half = np.concatenate([[127.0], np.arange(-15.5, 15.5, 1.0)])  # amax 127 -> d = 1: products at exact .5
    halves2 = np.concatenate([[254.0], np.arange(-61.0, 0.0, 2.0)])  # d = 2: odd values land on .5
    return {
        "gaussian": rng.standard_normal((8, 256)),
        "heavy_tailed": rng.standard_cauchy((8, 256)),
        "zeros": np.zeros((2, 64)),
        "constant": np.full((2, 64), 3.0),
        "negative_constant": np.full((1, 96), -0.7),
        "tiny": rng.standard_normal((4, 64)) * 1e-30,
        "huge": rng.standard_normal((4, 64)) * 1e30,  # scale overflows fp16 to inf, as in llama.cpp
        "half_boundaries": np.stack([half, -half, halves2, np.full(32, 0.49999997)]),
        "one_big_value": np.where(np.arange(64) == 5, 1e4, rng.standard_normal(64)),
    }


@pytest.mark.parametrize("case", list(_q8_cases()))
def test_q8_0_matches_gguf_package(case):
    x = _q8_cases()[case].astype(np.float32)
    ours = quantize_q8_0(x)
    assert ours.dtype == np.uint8 and ours.shape == (*x.shape[:-1], x.shape[-1] // 32 * 34)
    with np.errstate(over="ignore", invalid="ignore"):
        assert ours.tobytes() == quants.quantize(x, Q8).tobytes()
        theirs = quants.dequantize(ours, Q8)
    np.testing.assert_array_equal(dequantize_q8_0(ours), theirs)


def test_q8_0_rounds_halves_away_from_zero():
    x = np.zeros(32, np.float32)
    x[:5] = [127.0, 0.5, -0.5, 2.5, -2.5]  # d = 1
    q = quantize_q8_0(x)[2:7].view(np.int8)
    assert q.tolist() == [127, 1, -1, 3, -3]  # numpy's round() would give 0, -0, 2, -2


@settings(max_examples=150, deadline=None)
@given(hnp.arrays(np.float32, st.tuples(st.integers(1, 3), st.integers(1, 4).map(lambda n: 32 * n)),
                  elements=st.floats(-1e6, 1e6, width=32)))
def test_q8_0_property_matches_gguf_package(x):
    amax = np.abs(x.reshape(-1, 32)).max(axis=1)
    x[np.repeat((amax > 0) & (amax < 1e-35), 32).reshape(x.shape)] = 0  # llama.cpp is undefined there
    with np.errstate(under="ignore"):
        assert quantize_q8_0(x).tobytes() == quants.quantize(x, Q8).tobytes()
    err = np.abs(dequantize_q8_0(quantize_q8_0(x)) - x).reshape(-1, 32)
    # With a normal fp16 scale d the error is half a step plus |q| <= 127 times d's fp16 rounding (2**-11 d).
    d = amax[:, None] / 127
    normal = d[:, 0] >= 2.0**-14
    assert np.all(err[normal] <= (d * (0.5 + 127 * 2.0**-11) * 1.001)[normal])


@settings(max_examples=50, deadline=None)
@given(st.binary(min_size=34 * 3, max_size=34 * 3))
def test_q8_0_dequantize_any_bytes_matches_gguf_package(raw):
    blocks = np.frombuffer(raw, np.uint8).reshape(1, -1)
    with np.errstate(invalid="ignore", over="ignore"):
        theirs = quants.dequantize(blocks, Q8)
    np.testing.assert_array_equal(dequantize_q8_0(blocks), theirs)


@pytest.mark.parametrize("shape", [(), (0,), (31,), (4, 33)])
def test_q8_0_rejects_bad_shapes(shape):
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q8_0(np.ones(shape, np.float32))
    with pytest.raises(ValueError, match="multiple of 34"):
        dequantize_q8_0(np.zeros((2, 35), np.uint8))
