"""The custom GEMV kernels (ref_impl/kernels.py).

On any machine: the launch configuration (every row and input covered, bytes, occupancy), the layout
and float tricks the CUDA source relies on, checked against mx.quantize/mx.dequantize, errors for bad
shapes and formats, and the patched decoder's fallback to MLX's built-ins giving identical outputs.
On MLX's CUDA backend (skipped elsewhere): every kernel against a float64 oracle built from
mx.dequantize of the same arrays, within a bound derived from float32 accumulation, on the
Llama-3.1-8B shapes, 1 to 9 rows, odd sizes, zeros, large magnitudes and misaligned inputs; the
built-in mx.quantized_matmul / matmul's own error is printed beside it; and the patched decoder's
greedy tokens.

The GPU machine may lack pytest, so this file also runs as a script: `python3 tests/test_kernels.py`
runs every test, prints each case's errors, and ends with "N passed, N failed, N skipped".
"""

from __future__ import annotations

import contextlib
import inspect
import math
import re
import sys
import tempfile
import time
import traceback
from pathlib import Path

if __name__ == "__main__":   # as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ref_impl import MODELS_DIR, kernels
from ref_impl.bench import bench_kernels, args_for
from ref_impl.generate import Sampler, generate_step
from ref_impl.latency import TINY, random_model
from ref_impl.model import load
from ref_impl.roofline import MODELS, matmul_shapes

try:
    import pytest
except ImportError:   # the GPU machine runs this file as a script
    pytest = None

SHIPPED = MODELS_DIR / "stdlib-10m.gguf"
SHAPES_8B = sorted({(n, k) for k, n in matmul_shapes(MODELS["Llama-3.1-8B"])})
Q4 = kernels.Format(4, 32)
CUDA = kernels.on_cuda()


def cuda_only(test):
    """Mark a test that needs MLX's CUDA backend."""
    test.needs_cuda = True
    return pytest.mark.skipif(not CUDA, reason="needs MLX's CUDA backend")(test) if pytest else test


def off_cuda_only(test):
    """Mark a test of what happens without MLX's CUDA backend."""
    test.needs_cuda = False
    return pytest.mark.skipif(CUDA, reason="checks the fallback off CUDA")(test) if pytest else test


@contextlib.contextmanager
def raises(exc: type[Exception], match: str):
    try:
        yield
    except exc as e:
        assert re.search(match, str(e)), f"{exc.__name__}({e}) does not mention {match!r}"
    else:
        raise AssertionError(f"no {exc.__name__} raised (expected one mentioning {match!r})")


# --- launch configuration ------------------------------------------------------------------------------

def test_launch_covers_every_row_and_input():
    for fmt in (Q4, kernels.Format(8, 64), kernels.Format(16)):
        for n, k in [*SHAPES_8B, (1, 256), (33, 384), (1000, 1024)]:
            for rows in (1, 4, 9):
                for la in kernels.candidates(fmt, n, k, rows):
                    assert (la.blocks - 1) * la.rows_per_block < n <= la.blocks * la.rows_per_block
                    assert la.grid == (la.blocks * la.threads, 1, 1) and la.threadgroup == (la.threads, 1, 1)
                    # each thread's 16-byte loads times the block's threads span every row's k inputs
                    per_row, values = la.loads_per_thread // la.rows_per_block, 16 * 8 // fmt.bits
                    assert per_row * la.threads * values >= k > (per_row - 1) * la.threads * values
                    assert la.rows_per_block == 1 or la.rows_per_block * rows <= kernels.MAX_ACCUMULATORS


def test_default_rows_per_block():
    # four blocks per SM on 132 SMs need >= 528 blocks: n = 1024 only reaches that with one row per block
    rule = {(1024, 1): 1, (4096, 1): 4, (14336, 1): 4, (128256, 1): 4, (4096, 4): 4, (4096, 5): 2,
            (4096, 8): 2, (4096, 9): 1, (2048, 1): 2, (100, 1): 1}
    for (n, rows), r in rule.items():
        assert kernels.launch_config(Q4, n, 4096, rows).rows_per_block == r, (n, rows)


def test_launch_bytes_are_the_arrays_bytes():
    for fmt, n, k, rows in ((Q4, 96, 256, 1), (kernels.Format(4, 64, "bfloat16"), 7, 512, 3),
                            (kernels.Format(8, 128), 5, 384, 9), (kernels.Format(16), 11, 64, 2)):
        dt = kernels.DTYPES[fmt.dtype]
        w = mx.zeros((n, k), dtype=dt)
        arrays = [w] if fmt.bits == 16 else list(mx.quantize(w, fmt.group_size, fmt.bits))
        x, y = mx.zeros((rows, k), dtype=dt), mx.zeros((rows, n), dtype=dt)
        assert kernels.launch_config(fmt, n, k, rows).bytes == sum(a.nbytes for a in [*arrays, x, y])


def test_occupancy():
    la = kernels.launch_config(Q4, 4096, 4096, 1, 128, 4)
    full = kernels.occupancy(la, 32)            # 32 x 2048 = 65536 registers: the thread limit binds
    assert (full.blocks_per_sm, full.warps_per_sm, full.fraction) == (16, 64, 1.0)
    half = kernels.occupancy(la, 64)            # 8192 registers a block
    assert (half.blocks_per_sm, half.fraction) == (8, 0.5)
    assert half.waves == 1024 / (8 * 132)
    assert half.bytes_in_flight_per_sm == 8 * 128 * 16 * 4 * 1      # k = 4096: one 32-code chunk per thread
    long = kernels.occupancy(kernels.launch_config(Q4, 4096, 14336, 1, 128, 4), 64)
    assert long.bytes_in_flight_per_sm == 8 * 128 * 16 * 4 * 2      # 448 chunks: unroll 2 of them in flight
    odd = kernels.occupancy(la, 100)            # 100 x 32 = 3200, allocated as 3328 per warp: 4 blocks
    assert odd.blocks_per_sm == 4
    small = kernels.occupancy(kernels.launch_config(Q4, 4096, 4096, 1, 64, 4), 16)
    assert small.blocks_per_sm == 32            # the 32-blocks-per-SM limit binds
    with raises(ValueError, "registers"):
        kernels.occupancy(la, 300)


def test_bad_shapes_and_formats_are_named():
    with raises(ValueError, "group size"):
        kernels.launch_config(Q4, 64, 4100, 1)
    with raises(ValueError, "16 bytes"):
        kernels.launch_config(kernels.Format(16), 64, 100, 1)
    with raises(ValueError, "rows=10"):
        kernels.launch_config(Q4, 64, 256, 10)
    with raises(ValueError, "rows=0"):
        kernels.launch_config(Q4, 64, 256, 0)
    with raises(ValueError, "threads=96"):
        kernels.launch_config(Q4, 64, 256, 1, threads=96)
    with raises(ValueError, "rows_per_block=3"):
        kernels.launch_config(Q4, 64, 256, 1, rows_per_block=3)
    with raises(ValueError, "rows_per_block=4 with rows=5"):
        kernels.launch_config(Q4, 64, 256, 5, rows_per_block=4)
    with raises(ValueError, "positive"):
        kernels.launch_config(Q4, 0, 256, 1)
    with raises(ValueError, "bits 3"):
        kernels.Format(3, 32)
    with raises(ValueError, "group size 16"):
        kernels.Format(4, 16)
    with raises(ValueError, "no group size"):
        kernels.Format(16, 32)
    with raises(ValueError, "dtype 'float32'"):
        kernels.Format(4, 32, "float32")


def test_kernel_calls_check_inputs_then_need_cuda():
    w, s, b = mx.quantize(mx.zeros((64, 256)), 32, 4)
    s, b = s.astype(mx.float16), b.astype(mx.float16)
    x = mx.zeros((1, 256), dtype=mx.float16)
    with raises(ValueError, "activation dtype"):
        kernels.affine_gemv(x.astype(mx.float32), w, s, b, 32, 4)
    with raises(ValueError, "features"):
        kernels.affine_gemv(mx.zeros((1, 128), dtype=mx.float16), w, s, b, 32, 4)
    with raises(ValueError, "scales must be"):
        kernels.affine_gemv(x, w, s[:, :4], b, 32, 4)
    with raises(ValueError, "biases must be"):
        kernels.affine_gemv(x, w, s, b.astype(mx.bfloat16), 32, 4)
    with raises(ValueError, "uint32"):
        kernels.affine_gemv(x, w.astype(mx.int32), s, b, 32, 4)
    with raises(ValueError, "rows=10"):
        kernels.affine_gemv(mx.zeros((10, 256), dtype=mx.float16), w, s, b, 32, 4)
    with raises(ValueError, "group size 16"):
        kernels.affine_gemv(x, w, s, b, 16, 4)
    with raises(ValueError, "used for"):
        kernels.affine_gemv(x, w, s, b, 32, 4, kernels.launch_config(Q4, 64, 256, 2))
    with raises(ValueError, "float16 matrix"):
        kernels.dense_gemv(x, mx.zeros((64, 256)))
    if not CUDA:
        with raises(RuntimeError, "CUDA backend"):
            kernels.affine_gemv(x, w, s, b, 32, 4)
        with raises(RuntimeError, "CUDA backend"):
            kernels.dense_gemv(x, mx.zeros((64, 256), dtype=mx.float16))


# --- what the CUDA source relies on --------------------------------------------------------------------

def unpack_codes(w: np.ndarray, bits: int) -> np.ndarray:
    """The kernels' reading of MLX's layout: code e of word i is input (32 / bits) i + e, in bits
    bits*e .. bits*e + bits - 1."""
    per = 32 // bits
    shifts = np.arange(per, dtype=np.uint32) * bits
    return ((w[:, :, None] >> shifts) & ((1 << bits) - 1)).reshape(w.shape[0], -1)


def test_layout_matches_mx_dequantize():
    rng = np.random.default_rng(0)
    for bits in (4, 8):
        for group in kernels.GROUP_SIZES:
            w, s, b = mx.quantize(mx.array(rng.standard_normal((6, 512)).astype(np.float32)), group, bits)
            q = unpack_codes(np.array(w), bits).astype(np.float32)
            g = np.repeat(np.arange(512 // group), group)                 # the group of each input
            ours = np.array(s)[:, g] * q + np.array(b)[:, g]
            np.testing.assert_array_equal(ours, np.array(mx.dequantize(w, s, b, group, bits)))


def test_float_tricks_in_the_source_are_exact():
    src = kernels._HEADER
    magic = int(re.search(r"\| (0x[0-9A-Fa-f]+)u\)", src).group(1), 16)   # ORed into the code's word
    shift = int(re.search(r"v >> (\d+);", src).group(1))                     # codes 5-7 come from v >> shift
    offset = -float(re.search(r"-(\d+)\.0f \* inv", src).group(1))
    words = np.random.default_rng(0).integers(0, 2 ** 32, 4096, dtype=np.uint64).astype(np.uint32)
    words[:16] = np.arange(16, dtype=np.uint32) * 0x11111111                 # every code value in every slot
    want = unpack_codes(words[None, :], 4).reshape(-1, 8).astype(np.float32)
    for e in range(8):
        j, src_word = (e, words) if e < 5 else (e - 5, words >> np.uint32(shift))
        f = ((src_word & np.uint32(0xF << (4 * j))) | np.uint32(magic)).view(np.float32)
        inv = np.float32(1 / 16 ** j)
        np.testing.assert_array_equal(f * inv + np.float32(offset) * inv, want[:, e])
    # without the shift, code 5 would reach the exponent: the trick needs codes * 16^j < 2^23
    f = ((words & np.uint32(0xF << 20)) | np.uint32(magic)).view(np.float32)
    assert not np.array_equal(f / np.float32(16 ** 5) - np.float32(2 ** 23 / 16 ** 5), want[:, 5])
    # 8-bit: the byte permute builds magic | byte
    perm = int(re.search(r"__byte_perm\(v, (0x[0-9A-Fa-f]+)u, (0x[0-9A-Fa-f]+)u", src).group(2), 16)
    for e in range(4):
        sel = [(perm | e) >> (4 * i) & 7 for i in range(4)]                    # PRMT: byte i <- source byte sel[i]
        src_bytes = np.concatenate([words.view(np.uint8).reshape(-1, 4),
                                    np.frombuffer(np.uint32(magic).tobytes(), np.uint8)[None].repeat(len(words), 0)], 1)
        built = src_bytes[:, sel].copy().view(np.uint32).ravel().view(np.float32)
        byte = (words >> np.uint32(8 * e)) & 0xFF
        np.testing.assert_array_equal(built - np.float32(2 ** 23), byte.astype(np.float32))


# --- in the decoder, any backend ------------------------------------------------------------------------

def test_format_of():
    lin = nn.Linear(64, 32, bias=False)
    assert kernels.format_of(lin) is None                                   # float32: MLX's built-in
    lin.set_dtype(mx.float16)
    assert kernels.format_of(lin) == kernels.Format(16)
    q = nn.QuantizedLinear(256, 32, bias=False, group_size=64, bits=4)
    q.set_dtype(mx.bfloat16)
    assert kernels.format_of(q) == kernels.Format(4, 64, "bfloat16")
    for bits, mode in ((2, "affine"), (5, "affine"), (4, "mxfp4")):
        q = nn.QuantizedLinear(256, 32, bias=False, bits=bits, group_size=32, mode=mode)
        q.set_dtype(mx.float16)
        assert kernels.format_of(q) is None, (bits, mode)
    assert kernels.format_of(nn.Embedding(10, 64)) is None


def greedy(model: nn.Module, prompt: list[int], n: int) -> list[int]:
    stream = generate_step(model, prompt, Sampler(), model.make_cache(len(prompt) + n))
    return [next(stream) for _ in range(n)]


@off_cuda_only
def test_patched_model_falls_back_on_cpu_with_identical_outputs():
    model, _ = load(SHIPPED, mx.float16)
    tokens = mx.array([[3, 17, 42, 5, 96, 11]])
    before = model(tokens)
    ids = greedy(model, [3, 17, 42], 6)
    names = [k for k, _ in nn.utils.tree_flatten(model.parameters())]
    assert kernels.patch(model, rows=range(1, 10)) == []                    # nothing chosen off CUDA
    assert [k for k, _ in nn.utils.tree_flatten(model.parameters())] == names
    assert sum(isinstance(m, kernels.GEMVLinear) for m in model.modules()) == 7 * model.args.num_hidden_layers
    assert mx.array_equal(model(tokens), before).item()
    assert greedy(model, [3, 17, 42], 6) == ids
    with raises(ValueError, "each must be 1 to 9"):
        kernels.patch(model, rows=(0,))


def test_count_kernels_grows_linearly_with_layers():
    from dataclasses import replace

    counts = [kernels.count_kernels(random_model(replace(TINY, num_hidden_layers=n))) for n in (1, 2, 3)]
    assert counts[0] > 0 and counts[2] - counts[1] == counts[1] - counts[0] > 0


@off_cuda_only
def test_bench_kernels_off_cuda_is_one_skipped_record(tmp_path):
    t0 = time.perf_counter()
    records = bench_kernels("Llama-3.1-8B", args_for("Llama-3.1-8B"), ["Q4_K"], tmp_path)
    assert time.perf_counter() - t0 < 5 and len(records) == 1
    assert records[0]["metric"] == "skipped" and "needs MLX's CUDA backend" in records[0]["note"]


# --- on the GPU: every kernel against a float64 oracle ---------------------------------------------------

def bound(la: kernels.Launch, mag: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Largest error float32 accumulation in the kernels' order allows (to first order): each product passes
    through at most `chain` roundings of 2^-24 (a chunk's FMAs, scale and bias, the thread's chunks, 5
    shuffles, the warps, and one for the oracle's float32 weights), relative to sum |terms| (mag); then y
    rounds once to float16/bfloat16, by at most half an ulp of the computed value."""
    per_thread = -(-la.k // la.fmt.values_per_load // la.threads)
    within = la.fmt.values_per_load + 2 + per_thread if la.fmt.bits != 16 else 8 * per_thread
    chain = within + 5 + la.threads // 32 + 1
    accumulated = chain * 2.0 ** -24 * mag
    unit = 2.0 ** -11 if la.fmt.dtype == "float16" else 2.0 ** -8             # half an ulp, relative
    return accumulated + unit * (np.abs(ref) + accumulated) + 2.0 ** -25      # 2^-25: half float16's least subnormal


def random_weights(fmt: kernels.Format, n: int, k: int, seed: int, scale: float = 0.05) -> tuple:
    """(w,) or (codes, scales, biases) of normal weights times scale; scale 0: random codes whose scales
    and biases are 0, so every weight is exactly 0."""
    key = mx.random.key(seed)
    w = (mx.random.normal((n, k), key=key) * scale).astype(kernels.DTYPES[fmt.dtype])
    if fmt.bits == 16:
        return (w,)
    q, s, b = mx.quantize(w, fmt.group_size, fmt.bits)
    if scale == 0:
        q = mx.random.randint(0, 2 ** 31, q.shape, key=key).astype(mx.uint32)
        s, b = mx.zeros_like(s), mx.zeros_like(b)
    return q, s, b


def oracle(fmt: kernels.Format, x: mx.array, weights: tuple, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(x W^T, |x| |W|^T) in float64 for the given weight rows; W from mx.dequantize in float32 (exact for
    float16 scales and 4/8-bit codes but for the last bit of scale * q + bias)."""
    idx = mx.array(rows)
    xf = np.array(x.astype(mx.float32)).astype(np.float64).reshape(-1, x.shape[-1])
    if fmt.bits == 16:
        w = np.array(weights[0][idx].astype(mx.float32)).astype(np.float64)
        return xf @ w.T, np.abs(xf) @ np.abs(w).T
    q, s, b = (a[idx] for a in weights)
    s, b = s.astype(mx.float32), b.astype(mx.float32)
    w = np.array(mx.dequantize(q, s, b, fmt.group_size, fmt.bits)).astype(np.float64)
    w_abs = np.array(mx.dequantize(q, mx.abs(s), mx.abs(b), fmt.group_size, fmt.bits)).astype(np.float64)  # |s| q + |b|
    return xf @ w.T, np.abs(xf) @ w_abs.T


def builtin(fmt: kernels.Format, x: mx.array, weights: tuple) -> mx.array:
    if fmt.bits == 16:
        return x @ weights[0].T
    q, s, b = weights
    return mx.quantized_matmul(x, q, s, b, transpose=True, group_size=fmt.group_size, bits=fmt.bits)


def check(fmt: kernels.Format, n: int, k: int, rows: int, launch: kernels.Launch | None = None, kind: str = "random",
          x_offset: int = 0, w_offset: int = 0, seed: int = 0) -> None:
    """One kernel call against the oracle, on sampled weight rows for the largest matrices; prints the case."""
    dt = kernels.DTYPES[fmt.dtype]
    weights = random_weights(fmt, n, k, seed, 0.0 if kind == "zero weights" else 0.2 if kind == "large" else 0.05)
    x = mx.random.normal((rows, k), key=mx.random.key(seed + 1))
    if kind == "zero x":
        x = x * 0
    elif kind == "large":        # terms up to ~100 whose sum cancels, sized to keep y inside float16
        x = mx.sign(x) * (50 + 50 * mx.abs(x)) * math.sqrt(4096 / k)
    x = x.astype(dt)
    if x_offset:                 # a flat view starting x_offset elements in: misaligned for 16-byte loads
        x = mx.concatenate([mx.zeros((x_offset,), dtype=dt), x.reshape(-1)])[x_offset:].reshape(rows, k)
    if w_offset:
        w0 = weights[0]
        flat = mx.concatenate([mx.zeros((w_offset,), dtype=w0.dtype), w0.reshape(-1)])
        weights = (flat[w_offset:].reshape(w0.shape), *weights[1:])
    mx.eval(x, *weights)
    la = launch or kernels.launch_config(fmt, n, k, rows)
    t0 = time.perf_counter()
    y = kernels.dense_gemv(x, weights[0], la) if fmt.bits == 16 else kernels.affine_gemv(
        x, *weights, fmt.group_size, fmt.bits, la)
    mx.eval(y)
    first_ms = (time.perf_counter() - t0) * 1e3
    sample = np.arange(n)
    if n > 16384:               # the LM head: its first and last rows (partial blocks) and a random sample
        sample = np.unique(np.r_[0:4096, n - 4096:n, np.random.default_rng(seed).integers(0, n, 4096)])
    ref, mag = oracle(fmt, x, weights, sample)
    got = np.array(y.astype(mx.float32)).astype(np.float64)[:, sample]
    theirs = np.array(builtin(fmt, x, weights).astype(mx.float32)).astype(np.float64)[:, sample]
    tol = bound(la, mag, ref)
    ratio, their_ratio = float((np.abs(got - ref) / tol).max()), float((np.abs(theirs - ref) / tol).max())
    print(f"  {fmt.name:10} ({n:6}, {k:5}) rows {rows} {la.label:32} {kind:12} off ({x_offset},{w_offset}): "
          f"max err {np.abs(got - ref).max():.3g} = {ratio:.3f} of the bound; built-in {their_ratio:.3f}; "
          f"|ours - built-in| {np.abs(got - theirs).max():.3g}; first call {first_ms:.0f} ms", flush=True)
    assert np.isfinite(got).all(), f"{fmt.name} {(n, k)} rows {rows} {kind}: non-finite output"
    if kind in ("zero x", "zero weights"):
        assert not got.any(), f"{fmt.name} {(n, k)} rows {rows} {kind}: output not exactly zero"
    assert ratio <= 1, f"{fmt.name} {(n, k)} rows {rows} {la.label} {kind}: error {ratio:.3f} x the float32 bound"


@cuda_only
def test_affine_4bit_on_8b_shapes():
    for n, k in SHAPES_8B:
        for rows in (1, 4):
            check(Q4, n, k, rows)
        check(kernels.Format(4, 64), n, k, 1)
    check(kernels.Format(4, 32, "bfloat16"), 4096, 4096, 1)


@cuda_only
def test_dense_on_8b_shapes():
    for n, k in SHAPES_8B:
        for rows in (1, 4):
            check(kernels.Format(16), n, k, rows)
    check(kernels.Format(16, 0, "bfloat16"), 4096, 4096, 1)


@cuda_only
def test_every_row_count_and_format():
    for rows in range(1, kernels.MAX_ROWS + 1):
        for fmt in (Q4, kernels.Format(16)):
            check(fmt, 1000, 4096, rows)
    for rows in (1, 5, 9):
        check(kernels.Format(8, 32), 1000, 4096, rows)
    for fmt in (kernels.Format(4, 128), kernels.Format(8, 64, "bfloat16")):
        check(fmt, 1000, 2048, 3)


@cuda_only
def test_every_candidate_launch():
    for fmt in (Q4, kernels.Format(16)):
        for rows in (1, 4):
            for la in kernels.candidates(fmt, 4096, 4096, rows):
                check(fmt, 4096, 4096, rows, la)


@cuda_only
def test_adversarial_inputs():
    for fmt in (Q4, kernels.Format(8, 32), kernels.Format(16)):
        for kind in ("zero x", "zero weights", "large"):
            check(fmt, 4096, 4096, 1, kind=kind)
        check(fmt, 1000, 4096, 4, kind="large")
        for n, k in ((1, 128), (3, 256), (33, 384), (4097, 1024)):      # odd sizes: a partial last block
            check(fmt, n, k, 2)
        check(fmt, 1000, 4096, 1, x_offset=1)                              # misaligned x: the 2-byte path
        check(fmt, 1000, 4096, 3, w_offset=1)                              # misaligned w
    check(kernels.Format(16), 300, 104, 1)                                 # k a multiple of 8, not of 32


def near_tie_or_equal(ref: mx.array, got: mx.array) -> bool:
    """Same argmax, or the reference's top two logits closer than twice the largest logit difference."""
    ref, got = np.array(ref.astype(mx.float32)).ravel(), np.array(got.astype(mx.float32)).ravel()
    if ref.argmax() == got.argmax():
        return True
    top2 = np.sort(ref)[-2:]
    return top2[1] - top2[0] <= 2 * np.abs(ref - got).max()


@cuda_only
def test_patched_decoder_keeps_greedy_tokens():
    prompt = [3, 17, 42, 5, 96, 11, 64, 23]
    for quant in (None, (32, 4), (64, 8)):
        ref, _ = load(SHIPPED, mx.float16)
        model, _ = load(SHIPPED, mx.float16)
        for m in (ref, model):
            if quant:
                nn.quantize(m, group_size=quant[0], bits=quant[1])
        choices = kernels.patch(model, rows=range(1, kernels.MAX_ROWS + 1), measure=False)
        assert choices and all(c.launch is not None for c in choices)
        want, ids = greedy(ref, prompt, 24), greedy(model, prompt, 24)
        print(f"  shipped model {quant or 'float16'}: greedy tokens equal: {want == ids}", flush=True)
        # teacher-forced on the reference's tokens, one row at a time, then 4 rows (speculative verification)
        caches = ref.make_cache(64), model.make_cache(64)
        a, b = ref(mx.array([prompt]), caches[0]), model(mx.array([prompt]), caches[1])
        for t in want[:12]:
            assert near_tie_or_equal(a[0, -1], b[0, -1]), f"{quant}: greedy token differs beyond a near tie"
            a, b = ref(mx.array([[t]]), caches[0]), model(mx.array([[t]]), caches[1])
        a, b = ref(mx.array([want[12:16]]), caches[0]), model(mx.array([want[12:16]]), caches[1])
        for i in range(4):
            assert near_tie_or_equal(a[0, i], b[0, i]), f"{quant}: 4-row verification differs beyond a near tie"


@cuda_only
def test_patch_measures_and_picks_the_fastest():
    model, _ = load(SHIPPED, mx.float16)
    choices = kernels.patch(model, rows=(1, 4))
    for c in choices:
        print(f"  {c.fmt.name} {(c.n, c.k)} rows {c.rows}: {c.launch.label if c.launch else 'built-in'}; "
              + ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in c.seconds.items()), flush=True)
        assert not c.errors, c.errors
        chosen = c.launch.label if c.launch else kernels.BUILTIN
        assert c.seconds[chosen] == min(c.seconds.values())


# --- as a script -----------------------------------------------------------------------------------------

def main() -> int:
    """Run every test here (CUDA tests only on CUDA), print failures, end with the summary line."""
    print(f"MLX {mx.__version__}, device {mx.default_device()}, CUDA backend: {CUDA}", flush=True)
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    for name, test in [(n, f) for n, f in globals().items() if n.startswith("test_") and callable(f)]:
        if getattr(test, "needs_cuda", CUDA) != CUDA:
            counts["skipped"] += 1
            continue
        print(f"{name} ...", flush=True)
        t0 = time.perf_counter()
        try:
            with tempfile.TemporaryDirectory() as d:
                test(*([Path(d)] if "tmp_path" in inspect.signature(test).parameters else []))
            counts["passed"] += 1
            print(f"{name} passed in {time.perf_counter() - t0:.1f} s", flush=True)
        except Exception:     # noqa: BLE001 -- report every failure and go on to the next test
            counts["failed"] += 1
            print(f"{name} FAILED in {time.perf_counter() - t0:.1f} s\n{traceback.format_exc()}", flush=True)
    print(f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
