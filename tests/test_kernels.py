"""The custom GEMV kernels (ref_impl/kernels/).

On any machine: the launch configuration (every row and input covered, bytes, occupancy), the layout
and float tricks the CUDA source relies on, checked against mx.quantize/mx.dequantize, the generated
kernel bodies, errors for bad shapes and formats, the patched decoder's fallback to MLX's built-ins
giving identical outputs, and its routing (GEMVs, fused gate/up, fused q/k/v) through stand-in kernels.
On MLX's CUDA backend (skipped elsewhere): every kernel against a float64 oracle built from
mx.dequantize of the same arrays, within a bound derived from float32 accumulation, on the
Llama-3.1-8B shapes, 1 to 9 rows, the fused kernels, odd sizes, zeros and large magnitudes; the
built-in mx.quantized_matmul / matmul's own error is printed beside it; the patched decoder's greedy
tokens; and, last, misaligned inputs (MLX's built-ins fault on those, so the references use aligned
copies; as a script that test runs in a child process, so a sticky CUDA error cannot hide the rest).

The GPU machine may lack pytest, so this file also runs as a script: `python3 tests/test_kernels.py`
runs every test, prints each case's errors, and ends with "N passed, N failed, N skipped".
"""

from __future__ import annotations

import contextlib
import inspect
import math
import re
import subprocess
import sys
import tempfile
import traceback
from dataclasses import replace
from pathlib import Path

if __name__ == "__main__":   # as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ref_impl import MODELS_DIR, kernels
from ref_impl.engine.checkpoint import load, load_model
from ref_impl.engine.generate import Sampler, generate_step
from ref_impl.engine.model import ModelArgs, TransformerBlock
from ref_impl.engine.random import args_for, random_model, write_random_model
from ref_impl.formats import gguf
from ref_impl.kernels import cuda, fusedlayer, fusedlayer_cuda, layers
from ref_impl.measure import kernels as suite, layerlaunch
from ref_impl.measure.kernels import bench_kernels
from ref_impl.measure.records import dtype_name
from ref_impl.platform.timing import clock
from ref_impl.theory.roofline import matmul_shapes
from ref_impl.theory.shapes import PUBLIC

try:
    import pytest
except ImportError:   # the GPU machine runs this file as a script
    pytest = None

SHIPPED = MODELS_DIR / "stdlib-10m.gguf"
SHAPES_8B = sorted({(n, k) for k, n in matmul_shapes(PUBLIC["Llama-3.1-8B"])})
QKV_8B, GATE_8B = (4096, 1024, 1024), (14336, 4096)
Q4, F16 = kernels.Format(4, 32), kernels.Format(16)
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
    cases = [(f, n, k, "", ()) for f in (Q4, kernels.Format(8, 64), F16)
             for n, k in [*SHAPES_8B, (1, 256), (33, 384), (1000, 1024)]]
    cases += [(Q4, GATE_8B[0], 4096, "glu", ()), (F16, 33, 384, "glu", ()), (Q4, sum(QKV_8B), 4096, "qkv", QKV_8B),
              (F16, 7 + 5 + 3, 256, "qkv", (7, 5, 3))]
    for fmt, n, k, fuse, parts in cases:
        for rows in (1, 4, 8):
            for la in kernels.candidates(fmt, n, k, rows, fuse, parts):
                r = la.rows_per_warp
                for size in parts or (n,):   # each matrix's rows are covered by its own warps
                    warps = -(-size // r)
                    assert (warps - 1) * r < size <= warps * r
                assert la.warps_total == sum(-(-s // r) for s in parts or (n,))
                assert la.blocks * la.warps >= la.warps_total > (la.blocks - 1) * la.warps
                assert la.grid == (la.blocks * la.threads, 1, 1) and la.threadgroup == (la.threads, 1, 1)
                # a lane's chunks times 32 lanes span every row's k inputs
                per_lane, values = la.chunks_per_lane, 16 * 8 // fmt.bits
                assert per_lane * 32 * values >= k > (per_lane - 1) * 32 * values
                assert la.weight_rows_per_warp * rows <= kernels.MAX_ACCUMULATORS
                assert la.weight_rows_per_warp * la.unroll <= kernels.MAX_LOADS


def test_default_launch():
    # rows per warp: 2 when n / 2 still gives 8 warps per SM (n >= 2112) and 2 x rows <= 16; unroll: a lane's
    # share of k in 16-byte loads, at most 4
    rule = {(1024, 1): (1, 4), (4096, 1): (2, 4), (14336, 1): (2, 4), (128256, 1): (2, 4), (4096, 4): (2, 4),
            (4096, 8): (2, 4), (4096, 9): (1, 4), (2048, 1): (1, 4), (100, 1): (1, 4)}
    for (n, rows), (r, u) in rule.items():
        la = kernels.launch_config(Q4, n, 4096, rows)
        assert (la.rows_per_warp, la.unroll) == (r, u), (n, rows, la)
    assert kernels.launch_config(Q4, 4096, 1024, 1).unroll == 1        # 32 chunks: one per lane
    assert kernels.launch_config(F16, 4096, 1024, 1).unroll == 4       # 128 chunks
    assert kernels.launch_config(kernels.Format(8, 32), 4096, 1024, 1).unroll == 2
    glu = kernels.launch_config(Q4, 14336, 4096, 1, fuse="glu")
    assert (glu.rows_per_warp, glu.weight_rows_per_warp) == (1, 2)      # 2 matrices x 4 loads = 8 in flight
    assert kernels.candidates(Q4, 4096, 4096, 1)[0] == kernels.launch_config(Q4, 4096, 4096, 1)
    assert len(kernels.candidates(Q4, 4096, 4096, 1)) == 4 and len(kernels.candidates(Q4, 4096, 4096, 4)) == 2


def test_launch_bytes_are_the_arrays_bytes():
    for fmt, n, k, rows, fuse in ((Q4, 96, 256, 1, ""), (kernels.Format(4, 64, "bfloat16"), 7, 512, 3, ""),
                                  (kernels.Format(8, 128), 5, 384, 8, ""), (F16, 11, 64, 2, ""),
                                  (Q4, 40, 256, 2, "glu"), (F16, 9, 64, 1, "glu")):
        dt = kernels.DTYPES[fmt.dtype]
        w = mx.zeros((n, k), dtype=dt)
        arrays = [w] if fmt.bits == 16 else list(mx.quantize(w, fmt.group_size, fmt.bits))
        x, y = mx.zeros((rows, k), dtype=dt), mx.zeros((rows, n), dtype=dt)
        mats = 2 if fuse else 1
        assert kernels.launch_config(fmt, n, k, rows, fuse=fuse).bytes == mats * sum(a.nbytes for a in arrays) + (
            x.nbytes + y.nbytes)
    la = kernels.launch_config(Q4, sum(QKV_8B), 4096, 1, fuse="qkv", parts=QKV_8B)
    assert la.bytes == Q4.weight_bytes(6144, 4096) + 2 * (4096 + 6144)


def test_occupancy():
    la = kernels.launch_config(Q4, 4096, 4096, 1, 2, 4)
    full = kernels.occupancy(la, 32)            # 32 x 2048 = 65536 registers: the thread limit binds
    assert (full.blocks_per_sm, full.warps_per_sm, full.fraction) == (16, 64, 1.0)
    regs = kernels.occupancy(la, 96)            # 96 x 32 = 3072 a warp, 12288 a block: 5 blocks
    assert (regs.blocks_per_sm, regs.warps_per_sm) == (5, 20)
    assert regs.waves == 512 / (5 * 132)        # 2048 warps of 2 rows, 4 to a block
    assert regs.bytes_in_flight_per_sm == 20 * 32 * 16 * 2 * 4      # 4 chunks per lane, all in flight
    short = kernels.occupancy(kernels.launch_config(Q4, 4096, 1024, 1, 1, 4), 56)
    assert short.bytes_in_flight_per_sm == short.warps_per_sm * 32 * 16 * 1 * 1   # k = 1024: one chunk a lane
    odd = kernels.occupancy(la, 100)            # 100 x 32 = 3200, allocated as 3328 per warp: 4 blocks
    assert odd.blocks_per_sm == 4
    small = kernels.occupancy(kernels.launch_config(Q4, 4096, 4096, 1, warps=1), 16)
    assert small.blocks_per_sm == 32            # the 32-blocks-per-SM limit binds
    with raises(ValueError, "registers"):
        kernels.occupancy(la, 300)


def test_bad_shapes_and_formats_are_named():
    with raises(ValueError, "group size"):
        kernels.launch_config(Q4, 64, 4100, 1)
    with raises(ValueError, "16 bytes"):
        kernels.launch_config(F16, 64, 100, 1)
    with raises(ValueError, "rows=10"):
        kernels.launch_config(Q4, 64, 256, 10)
    with raises(ValueError, "rows=0"):
        kernels.launch_config(Q4, 64, 256, 0)
    with raises(ValueError, "warps=3"):
        kernels.launch_config(Q4, 64, 256, 1, warps=3)
    with raises(ValueError, "unroll=3"):
        kernels.launch_config(Q4, 64, 256, 1, unroll=3)
    with raises(ValueError, "rows_per_warp=3"):
        kernels.launch_config(Q4, 64, 256, 1, rows_per_warp=3)
    with raises(ValueError, "rows_per_warp=4 with rows=5"):
        kernels.launch_config(Q4, 64, 256, 5, rows_per_warp=4)
    with raises(ValueError, "rows_per_warp=1 with rows=9"):
        kernels.launch_config(Q4, 64, 256, 9, fuse="glu")              # 2 matrices x 9 rows > 16 partial sums
    with raises(ValueError, "loads in flight"):
        kernels.launch_config(Q4, 64, 256, 1, rows_per_warp=4, unroll=8)
    with raises(ValueError, "positive"):
        kernels.launch_config(Q4, 0, 256, 1)
    with raises(ValueError, "parts"):
        kernels.launch_config(Q4, 64, 256, 1, fuse="qkv", parts=(32, 32))
    with raises(ValueError, "parts"):
        kernels.launch_config(Q4, 64, 256, 1, parts=(32, 16, 16))
    with raises(ValueError, "fuse='mlp'"):
        kernels.launch_config(Q4, 64, 256, 1, fuse="mlp")
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
        kernels.gemv(x.astype(mx.float32), [(w, s, b)], Q4)
    with raises(ValueError, "activation dtype"):
        kernels.gemv(x.astype(mx.bfloat16), [(w, s, b)], Q4)                  # not the weights' dtype
    with raises(ValueError, "features"):
        kernels.gemv(mx.zeros((1, 128), dtype=mx.float16), [(w, s, b)], Q4)
    with raises(ValueError, "scales must be"):
        kernels.gemv(x, [(w, s[:, :4], b)], Q4)
    with raises(ValueError, "biases must be"):
        kernels.gemv(x, [(w, s, b.astype(mx.bfloat16))], Q4)
    with raises(ValueError, "uint32"):
        kernels.gemv(x, [(w.astype(mx.int32), s, b)], Q4)
    with raises(ValueError, "rows=10"):
        kernels.gemv(mx.zeros((10, 256), dtype=mx.float16), [(w, s, b)], Q4)
    with raises(ValueError, "scales must be"):
        kernels.gemv(x, [(w, s, b)], kernels.Format(4, 64))                  # groups of 32 read as 64
    with raises(ValueError, "used for"):
        kernels.gemv(x, [(w, s, b)], Q4, "", kernels.launch_config(Q4, 64, 256, 2))
    with raises(ValueError, "float16 matrix"):
        kernels.gemv(x, [(mx.zeros((64, 256)),)], F16)
    with raises(ValueError, "takes 2 matrices"):
        kernels.gemv(x, [(w, s, b)], Q4, "glu")
    with raises(ValueError, "must agree"):
        kernels.gemv(x, [(w, s, b), (w[:32], s[:32], b[:32])], Q4, "glu")
    if not CUDA:
        with raises(RuntimeError, "CUDA backend"):
            kernels.gemv(x, [(w, s, b)], Q4)
        with raises(RuntimeError, "CUDA backend"):
            kernels.gemv(x, [(mx.zeros((64, 256), dtype=mx.float16),)], F16)


# --- what the CUDA source relies on --------------------------------------------------------------------

def unpack_codes(w: np.ndarray, bits: int) -> np.ndarray:
    """The kernels' reading of MLX's layout: code e of word i is input (32 / bits) i + e, in bits
    bits*e .. bits*e + bits - 1."""
    per = 32 // bits
    shifts = np.arange(per, dtype=np.uint32) * bits
    return ((w[:, :, None] >> shifts) & ((1 << bits) - 1)).reshape(w.shape[0], -1)


def test_layout_matches_mx_dequantize():
    # mx.dequantize may round scale*q+bias once (an FMA) where this rounds twice: equal within 2 roundings
    rng = np.random.default_rng(0)
    for bits in (4, 8):
        for group in kernels.GROUP_SIZES:
            w, s, b = mx.quantize(mx.array(rng.standard_normal((6, 512)).astype(np.float32)), group, bits)
            q = unpack_codes(np.array(w), bits).astype(np.float32)
            g = np.repeat(np.arange(512 // group), group)                 # the group of each input
            sq, bias = np.array(s)[:, g] * q, np.array(b)[:, g]
            ours, theirs = sq + bias, np.array(mx.dequantize(w, s, b, group, bits))
            tol = 2.0 ** -23 * (np.abs(sq) + np.abs(bias))
            assert (np.abs(ours - theirs) <= tol).all(), (bits, group, np.abs(ours - theirs).max())
            # a wrong code order would be off by whole scales
            assert not np.allclose(np.array(s)[:, g] * q[:, ::-1] + bias, theirs, atol=1e-3)


def test_float_tricks_in_the_source_are_exact():
    src = cuda.HEADER
    # 4-bit: each code OR-ed into the mantissa of a magic float from one of four views of the word
    assert re.search(r"l8 = v << 8, r8 = v >> 8, rot = __funnelshift_l\(v, v, 16\);", src)
    views = {"v": lambda w: w, "l8": lambda w: w << 8, "r8": lambda w: w >> 8, "rot": lambda w: (w << 16) | (w >> 16)}
    lines = re.findall(r"q\[(\d)\] = __uint_as_float\(\((\w+) & (0x[0-9A-Fa-f]+)u\) \| (0x[0-9A-Fa-f]+)u\);", src)
    assert sorted(int(e) for e, *_ in lines) == list(range(8))
    odd, even = map(np.float32, re.search(r"fmaf\(([\d.]+)f, xodd, ([\d.]+)f \* xeven\)", src).groups())
    words = np.random.default_rng(0).integers(0, 2 ** 32, 4096, dtype=np.uint64)
    words[:16] = np.arange(16, dtype=np.uint64) * 0x11111111                 # every code value in every slot
    want = unpack_codes(words.astype(np.uint32)[None, :], 4).reshape(-1, 8).astype(np.float32)
    halves = np.arange(2 ** 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float64)
    brains = (np.arange(2 ** 16, dtype=np.uint32) << 16).view(np.float32)
    brains = brains[np.isfinite(brains)].astype(np.float64)        # NaNs left out before the cast, which warns
    xs = np.concatenate([halves[np.isfinite(halves)], brains[np.abs(brains) < 1e30]])
    for e, view, mask, magic in lines:
        e = int(e)
        f = ((views[view](words) & 0xFFFFFFFF & int(mask, 16)) | int(magic, 16)).astype(np.uint32).view(np.float32)
        np.testing.assert_array_equal(f - (odd if e % 2 else even), want[:, e])
        # x f is exact in float32 for every float16 and bfloat16 x: the dot sums x f, the offsets leave later
        for fv in np.unique(f):
            assert (np.float32(fv) * xs.astype(np.float32) == fv * xs).all(), (e, fv)
    # the old trick's float, 2^23 + c, times x is not exact: its offset must leave before the multiply
    assert not (np.float32(2.0 ** 23 + 5) * halves[np.isfinite(halves)].astype(np.float32)
                == (2.0 ** 23 + 5) * halves[np.isfinite(halves)]).all()
    # 8-bit: the byte permute builds magic | byte
    prmt = re.search(r"__byte_perm\(v, (0x[0-9A-Fa-f]+)u, (0x[0-9A-Fa-f]+)u", src)
    magic8, perm = (int(h, 16) for h in prmt.groups())
    words = words.astype(np.uint32)
    magic_bytes = np.frombuffer(np.uint32(magic8).tobytes(), np.uint8)[None].repeat(len(words), 0)
    for e in range(4):
        sel = [(perm | e) >> (4 * i) & 7 for i in range(4)]                    # PRMT: byte i <- source byte sel[i]
        src_bytes = np.concatenate([words.view(np.uint8).reshape(-1, 4), magic_bytes], 1)
        built = src_bytes[:, sel].copy().view(np.uint32).ravel().view(np.float32)
        byte = (words >> np.uint32(8 * e)) & 0xFF
        np.testing.assert_array_equal(built - np.float32(2 ** 23), byte.astype(np.float32))


def test_kernel_bodies_name_their_inputs():
    for dense in (False, True):
        for fuse in kernels.FUSES:
            body, names = cuda.body(dense, fuse), kernels.input_names(dense, fuse)
            mats = {"": 1, "glu": 2, "qkv": 3}[fuse]
            assert names == ["x"] + [f"{a}{i}" for i in range(mats) for a in (("w",) if dense else ("w", "s", "b"))]
            for name in names[1:]:
                assert re.search(rf"\b{name}\b", body), (dense, fuse, name)
            # MLX adds w0_shape (and w1_shape, w2_shape for qkv) to the signature because the body names them
            assert "w0_shape" in body and ("w2_shape" in body) == (fuse == "qkv") and "x_shape" not in body
            for y in ("y0", "y1", "y2")[:3 if fuse == "qkv" else 1]:
                assert re.search(rf"\b{y}\b", body)
    small = cuda.minified(cuda.HEADER)
    assert "//" not in small and len(small) < 0.8 * len(cuda.HEADER) and "ld.global.nc" in small


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
    assert kernels.patch(model, rows=range(1, 10), fuse=True) == []          # nothing chosen off CUDA
    assert [k for k, _ in nn.utils.tree_flatten(model.parameters())] == names
    assert sum(isinstance(m, kernels.GEMVLinear) for m in model.modules()) == 7 * model.args.num_hidden_layers
    assert sum(isinstance(m, kernels.GatedMLP) for m in model.modules()) == model.args.num_hidden_layers
    assert mx.array_equal(model(tokens), before).item()
    assert greedy(model, [3, 17, 42], 6) == ids
    with raises(ValueError, "each must be 1 to 9"):
        kernels.patch(model, rows=(0,))


class StandIn:
    """kernels.runner for the CPU: each launch computed with MLX's built-ins, calls counted per fuse."""

    def __init__(self):
        self.calls = {"": 0, "glu": 0, "qkv": 0}

    def __call__(self, launch: kernels.Launch):
        fmt = launch.fmt

        def one(x, arrays):
            if fmt.bits == 16:
                return x @ arrays[0].T
            return mx.quantized_matmul(x, *arrays, transpose=True, group_size=fmt.group_size, bits=fmt.bits)

        def run(x, *arrays):
            self.calls[launch.fuse] += 1
            per = 1 if fmt.bits == 16 else 3
            outs = [one(x, arrays[i:i + per]) for i in range(0, len(arrays), per)]
            return [nn.silu(outs[0]) * outs[1]] if launch.fuse == "glu" else outs
        return run


def stand_in_stages(layer: nn.Module) -> dict:
    """FusedLayer.bind on any backend: each fused kernel stood in for by the layer's own modules (MLX's ops),
    the k/v write into the cache included; `attend` hands attn_out the attention output itself, and each pair
    (attention, mlp) runs its two."""
    attn, mlp = layer.self_attn, layer.mlp

    def heads(t: mx.array, n: int) -> mx.array:
        return t.reshape(1, 1, n, -1).transpose(0, 2, 1, 3)

    def attn_in(x: mx.array, cache, at: mx.array) -> mx.array:
        q, k, v = attn.qkv(layer.input_layernorm(x))
        i = cache.offset
        cache.keys[:, :, i:i + 1, :] = attn.rope(heads(k, attn.n_kv_heads), i)
        cache.values[:, :, i:i + 1, :] = heads(v, attn.n_kv_heads)
        return attn.rope(heads(q, attn.n_heads), i)

    def attend(q: mx.array, cache, at: mx.array) -> mx.array:
        n = cache.offset + 1
        return mx.fast.scaled_dot_product_attention(q, cache.keys[:, :, :n], cache.values[:, :, :n],
                                                    scale=attn.scale)

    def mlp_in(h: mx.array) -> mx.array:
        hn = layer.post_attention_layernorm(h)
        return nn.silu(mlp.gate_proj(hn)) * mlp.up_proj(hn)

    def attn_out(o: mx.array, x: mx.array) -> mx.array:
        return x + attn.o_proj(o.transpose(0, 2, 1, 3).reshape(1, 1, -1))

    def attention(q: mx.array, cache, at: mx.array, x: mx.array, sync=None) -> tuple[mx.array, mx.array]:
        o = attend(q, cache, at)
        return o, attn_out(o, x)

    def mlp_both(h: mx.array, sync=None) -> tuple[mx.array, mx.array]:
        a = mlp_in(h)
        return a, h + mlp.down_proj(a)

    return {"attn_in": attn_in, "attend": attend, "attn_out": attn_out, "attention": attention,
            "mlp_in": mlp_in, "mlp_out": lambda a, h: h + mlp.down_proj(a), "mlp": mlp_both}


@contextlib.contextmanager
def stand_in_kernels():
    """Our kernels stood in for by MLX's matmuls (a StandIn, yielded: its call counts) on any backend: the
    layers' `runner` and the fused layer's kernels swapped, and `on_cuda` answering True in every ref_impl
    module that holds it."""
    stand_in, real = StandIn(), kernels.on_cuda
    swaps = [(layers, "runner", stand_in), (fusedlayer.FusedLayer, "bind", stand_in_stages)] + [
        (m, "on_cuda", lambda: True) for name, m in list(sys.modules.items())
        if name.split(".")[0] == "ref_impl" and getattr(m, "on_cuda", None) is real]
    saved = [(m, attr, getattr(m, attr)) for m, attr, _ in swaps]
    for m, attr, new in swaps:
        setattr(m, attr, new)
    try:
        yield stand_in
    finally:
        for m, attr, old in saved:
            setattr(m, attr, old)


def test_routing_through_stand_in_kernels():
    """patch's calls go where its choices say: one fused q/k/v and one fused gate/up call per layer and row
    count chosen, the other GEMVs through their own runs, everything else MLX's; enable switches them."""
    with stand_in_kernels() as stand_in:
        ref, _ = load(SHIPPED, mx.float16)
        model, _ = load(SHIPPED, mx.float16)
        choices = kernels.patch(model, rows=(1, 4), measure=False, fuse=True)
        layers = model.args.num_hidden_layers
        assert {(c.fuse, c.rows) for c in choices} == {(f, r) for f in kernels.FUSES for r in (1, 4)}
        assert all(c.launch is not None for c in choices)
        cache_a, cache_b = ref.make_cache(16), model.make_cache(16)
        prompt = mx.array([[3, 17, 42, 5, 96, 11, 64, 23]])                 # 8 rows: no choice, MLX's built-ins
        assert mx.allclose(ref(prompt, cache_a), model(prompt, cache_b), atol=1e-2).item()
        assert stand_in.calls == {"": 0, "glu": 0, "qkv": 0}
        a, b = ref(mx.array([[7]]), cache_a), model(mx.array([[7]]), cache_b)
        assert mx.allclose(a, b, atol=1e-2).item()
        # per layer: q/k/v fused once, gate/up fused once, o and down alone; the tied LM head stays MLX's
        assert stand_in.calls == {"": 2 * layers, "glu": layers, "qkv": layers}
        model(mx.array([[1, 2, 3, 4]]), cache_b)                            # 4 rows: chosen too
        assert stand_in.calls == {"": 4 * layers, "glu": 2 * layers, "qkv": 2 * layers}
        kernels.enable(model, gemv=True, fused=False)
        model(mx.array([[5]]), cache_b)
        assert stand_in.calls == {"": 4 * layers + 7 * layers, "glu": 2 * layers, "qkv": 2 * layers}
        kernels.enable(model, gemv=False, fused=False)
        model(mx.array([[6]]), cache_b)
        assert stand_in.calls["qkv"] == 2 * layers and stand_in.calls[""] == 11 * layers
        # the attention's qkv is one fused call giving all three; a projection called alone runs by itself
        kernels.enable(model, gemv=True, fused=True)
        attn, want = model.layers[0].self_attn, ref.layers[0].self_attn
        assert isinstance(attn.qkv, kernels.FusedQKV) and not isinstance(want.qkv, kernels.FusedQKV)
        x, x2 = mx.ones((1, 1, 384), mx.float16), mx.full((1, 1, 384), 2.0, mx.float16)
        fused, single = stand_in.calls["qkv"], stand_in.calls[""]
        for got, ref_y in zip(attn.qkv(x), want.qkv(x)):
            assert mx.array_equal(got, ref_y).item()
        assert (stand_in.calls["qkv"], stand_in.calls[""]) == (fused + 1, single)
        assert mx.array_equal(attn.k_proj(x2), want.k_proj(x2)).item()
        assert (stand_in.calls["qkv"], stand_in.calls[""]) == (fused + 1, single + 1)
        attn.qkv(mx.ones((1, 2, 384), mx.float16))                       # 2 rows: no choice, MLX's built-ins
        assert (stand_in.calls["qkv"], stand_in.calls[""]) == (fused + 1, single + 1)


def test_summary_names_every_choice_and_counts_ours():
    la = kernels.launch_config(Q4, 14336, 4096, 1)
    choices = [kernels.Choice(Q4, 14336, 4096, 1, 32, la, {kernels.BUILTIN: 36e-6, la.label: 20e-6}),
               kernels.Choice(Q4, 1024, 4096, 1, 64, None, {kernels.BUILTIN: 5e-6}),
               kernels.Choice(Q4, 14336, 4096, 1, 32, None, fuse="glu")]
    lines = kernels.summary(choices).splitlines()
    assert lines[0].startswith("kernels: ours for 32 of 128 matrices") and "(1 of 3 shapes)" in lines[0]
    assert f"q4g32 gemv 14336x4096 rows 1 (x32): {la.label} [mlx built-in 36.0 us, {la.label} 20.0 us]" in lines[1]
    assert lines[2].endswith(": mlx built-in [mlx built-in 5.0 us]")
    assert lines[3].endswith("glu 14336x4096 rows 1 (x32): unfused")


def compile_adds_primitives() -> bool:
    """What mx.compile does to a decode step's primitive count on this backend. On the CPU it fuses the
    elementwise operations of RMSNorm, RoPE and attention's fallbacks: fewer primitives. On CUDA those are
    single mx.fast primitives already, and the compiled step has more (743 vs 583 for the 8B shape,
    measured on an H200 with MLX 0.32.4): the chapter says so, and these tests hold it to that."""
    return kernels.on_cuda()


def test_count_kernels_of_a_compiled_step_changes_as_the_backend_does():
    model, _ = load(SHIPPED)
    compiled, plain = kernels.count_kernels(model, compiled=True), kernels.count_kernels(model)
    assert compiled > plain if compile_adds_primitives() else compiled < plain, (compiled, plain)


def test_count_kernels_grows_linearly_with_layers():
    from dataclasses import replace

    counts = [kernels.count_kernels(random_model(replace(args_for("tiny"), num_hidden_layers=n))) for n in (1, 2, 3)]
    assert counts[0] > 0 and counts[2] - counts[1] == counts[1] - counts[0] > 0


@off_cuda_only
def test_bench_kernels_off_cuda_is_one_skipped_record(tmp_path, monkeypatch):
    def measured(*_):
        raise AssertionError("off CUDA, bench --kernels measures nothing")

    monkeypatch.setattr(suite, "roofs", measured)
    records = bench_kernels("Llama-3.1-8B", args_for("Llama-3.1-8B"), ["Q4_K"], tmp_path)
    assert len(records) == 1 and not any(tmp_path.iterdir())
    assert records[0]["metric"] == "skipped" and "needs MLX's CUDA backend" in records[0]["note"]


def test_bench_kernels_quick_flow_with_stand_in_kernels(tmp_path):
    """bench --kernels --quick end to end on the CPU, our kernels stood in for by MLX's matmuls: every decode
    variant (compiled or not) is timed and its tokens match MLX's built-ins exactly."""
    cuda = compile_adds_primitives()   # (stand-ins are several primitives each: not counted)
    with stand_in_kernels():
        args = ModelArgs(512, 256, 2, 512, 4, 2, tie_word_embeddings=False)
        records = bench_kernels("tiny", args, ["Q4_K_M"], tmp_path, prompt_len=8, gen_tokens=8, repeats=1,
                                quick=True)
    # the CPU loads float32 weights, which the fused layer does not read: "layers" runs on CUDA's float16
    variants = suite.DECODE_VARIANTS if CUDA else tuple(v for v in suite.DECODE_VARIANTS if not v.startswith("layers"))
    speed = {r["variant"]: r["value"] for r in records if r["metric"] == "tokens_per_s"}
    assert set(speed) == set(variants) and all(v > 0 for v in speed.values())
    agree = {r["variant"]: r["value"] for r in records if r["metric"] == "greedy_agreement"}
    assert agree == {v: 1.0 for v in variants[1:]}
    parts = {(r["variant"], r["part"]) for r in records if r["experiment"] == "decode-breakdown"}
    assert {(v, "host_build") for v in variants} <= parts
    count = {r["variant"]: r["value"] for r in records if r["metric"] == "kernels_per_token"}
    assert (count["native+compiled"] > count["native"] if cuda else count["native+compiled"] < count["native"]), count
    assert not [r for r in records if r["experiment"] == "gemv"]          # quick: no per-matrix sweep
    assert not [r for r in records if isinstance(r["value"], float) and math.isnan(r["value"])]
    layered = [r for r in records if r["experiment"] == "decode-kernels" and r["variant"].startswith("layers")
               and r["metric"] == "tokens_per_s"]
    assert len(layered) == CUDA * 2     # what ran: the pairs of the way choose found fastest, each way timed
    assert all(min(r["merge_ms"], key=r["merge_ms"].get) == "+".join(["on", *r["merged"]]) for r in layered)


def test_an_untimed_kernel_choice_records_no_time():
    """--quick's patch chooses launch_config's default without timing it: its record says so, with no number."""
    timed = kernels.Choice(Q4, 4096, 4096, 1, 32, None, seconds={kernels.BUILTIN: 20e-6})
    untimed = kernels.Choice(Q4, 4096, 4096, 1, 32, None)
    fields = {"model": "m", "weights": "Q4_K_M", "kv": None, "context": 8}
    a, b = suite.choice_records([timed, untimed], fields, lambda msg: None)
    assert abs(a["value"] - 20.0) < 1e-9 and "note" not in a
    assert b["value"] is None and "not timed" in b["note"]


def test_fused_layer_timing_flow_with_stand_in_kernels():
    """The fused layer's measurements on any backend, its kernels stood in for: per-kernel queued times with
    the bytes each reads, and choose's timed decision between fused and unfused decode."""
    with stand_in_kernels():
        model = layer_model(256, 8, 2, 512, "q4q8", layers=2)
        assert fusedlayer.fuse(model) == {}
        per = suite.layer_kernel_ms(model, context=20, passes=1)
        assert list(per) == list(fusedlayer.STAGES) and all(ms > 0 for ms, _ in per.values())
        assert per["attend"][1] == 2 * 2 * 2 * 20 * 32 * 2                  # layers x k,v x heads x keys x D x 2 B
        assert per["mlp_in"][1] > per["attn_out"][1]
        with layerlaunch.applied(layerlaunch.Setting(merge=("attention", "mlp"))):   # each pair timed too
            layerlaunch.relaunch(model)
            both = suite.layer_kernel_ms(model, context=20, passes=1)
        assert list(both) == list(fusedlayer.KERNELS)
        assert both["attention"][1] == both["attend"][1] + both["attn_out"][1]
        assert both["mlp"][1] == both["mlp_in"][1] + both["mlp_out"][1]
        layerlaunch.relaunch(model)
        way, ms = fusedlayer.choose(model, rounds=1, tokens=2, context=8)    # off, and on with each merge
        assert list(ms) == ["off", "on", "on+attention", "on+attention+mlp"] and ms[way] == min(ms.values())
        assert all(b.on == (way != "off") and b.plan.merged == tuple(way.split("+")[1:]) for b in model.layers)
        wide = layer_model(1024, 8, 1, 512, "q4q8", layers=2)   # 8 x 128 values: attention does not fit
        fusedlayer.fuse(wide, int8=True)
        way, ms = fusedlayer.choose(wide, rounds=1, tokens=2, context=8, unfused=False)   # the layers on
        assert list(ms) == ["on", "on+mlp"] and way in ms
        assert all(b.on and b.plan.int8 and b.plan.merged == tuple(way.split("+")[1:]) for b in wide.layers)


def test_generate_says_what_it_chose_for_the_fused_layers():
    """generate --kernels prints one line on the fused layers: off under --compile, a timed choice where layers
    fuse (stand-ins timed here), and the first reason where none can."""
    from ref_impl.kernels.loading import fused_layers

    with stand_in_kernels():
        model = layer_model(256, 8, 2, 512, "f16", layers=2)
        assert "off (--compile" in fused_layers(model, compiled=True)
        line = fused_layers(model, compiled=False)
        ways = r"(off|on|on\+attention|on\+attention\+mlp)"
        pattern = (rf"fused layers: {ways} for 2 of 2 layers \(decode ms/token: off [\d.]+, on [\d.]+, "
                   r"on\+attention [\d.]+, on\+attention\+mlp [\d.]+; \+: a pair as one launch\)")
        assert re.fullmatch(pattern, line), line
        q4 = layer_model(256, 8, 2, 512, "q4q8", layers=2)
        line = fused_layers(q4, compiled=False, int8=True)
        assert ", 2 with int8 activations (decode" in line and all(b.plan.int8 for b in q4.layers), line
        assert ", 0 with int8 activations" in fused_layers(model, compiled=False, int8=True)   # float16: none
        wide = layer_model(256, 8, 2, 512, "f16", dtype=mx.float32)
        assert fused_layers(wide, compiled=False).startswith("fused layers: none (q_proj")

# --- on the GPU: every kernel against a float64 oracle ---------------------------------------------------

def chain(la: kernels.Launch) -> int:
    """Roundings a product passes through in the kernels' order (to first order): a chunk's FMAs, scale and
    bias, the lane's chunks, 5 shuffles, and one for the oracle's float32 weights."""
    within = la.fmt.values_per_load + 2 + la.chunks_per_lane if la.fmt.bits != 16 else 8 * la.chunks_per_lane
    return within + 5 + 1


def bound(la: kernels.Launch, mag: np.ndarray, ref: np.ndarray, extra: np.ndarray | float = 0.0) -> np.ndarray:
    """Largest error the kernel may make: float32 accumulation relative to sum |terms| (mag), plus `extra`
    (the fused epilogue's), then y rounds once to float16/bfloat16, by at most half an ulp."""
    accumulated = chain(la) * 2.0 ** -24 * mag + extra
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


def aligned_copy(a: mx.array) -> mx.array:
    """A fresh (16-byte aligned) array with a's values: MLX's built-ins fault on misaligned views."""
    out = mx.array(np.array(a.view(mx.uint16) if a.dtype in (mx.float16, mx.bfloat16) else a))
    return out.view(a.dtype) if a.dtype in (mx.float16, mx.bfloat16) else out


def as_f64(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32)).astype(np.float64)


def check(fmt: kernels.Format, n: int, k: int, rows: int, launch: kernels.Launch | None = None, kind: str = "random",
          x_offset: int = 0, w_offset: int = 0, seed: int = 0, fuse: str = "", parts: tuple[int, ...] = ()) -> None:
    """One kernel call against the oracle, on sampled weight rows for the largest matrices; prints the case.
    fuse "glu": gate and up of n rows each; "qkv": matrices of `parts` rows (n their sum)."""
    dt = kernels.DTYPES[fmt.dtype]
    sizes = parts if fuse == "qkv" else (n, n) if fuse == "glu" else (n,)
    scale = 0.0 if kind == "zero weights" else 0.2 if kind == "large" else 0.05
    mats = [random_weights(fmt, size, k, seed + 7 * i, scale) for i, size in enumerate(sizes)]
    x = mx.random.normal((rows, k), key=mx.random.key(seed + 1))
    if kind == "zero x":
        x = x * 0
    elif kind == "large":        # terms up to ~100 whose sum cancels, sized to keep y (glu: gate x up) in float16
        x = mx.sign(x) * (50 + 50 * mx.abs(x)) * math.sqrt(4096 / k) * (0.05 if fuse == "glu" else 1)
    x = x.astype(dt)
    mx.eval(x, *[a for m in mats for a in m])
    refs = [m for m in mats]                      # aligned arrays for the oracle and the built-in
    x_ref = x
    if x_offset:                 # a flat view starting x_offset elements in: misaligned for 16-byte loads
        x = mx.concatenate([mx.zeros((x_offset,), dtype=dt), x.reshape(-1)])[x_offset:].reshape(rows, k)
    if w_offset:
        views = []
        for m in mats:
            flat = mx.concatenate([mx.zeros((w_offset,), dtype=m[0].dtype), m[0].reshape(-1)])
            views.append((flat[w_offset:].reshape(m[0].shape), *m[1:]))
        mats = views
    mx.eval(x, *[a for m in mats for a in m])
    la = launch or kernels.launch_config(fmt, sum(sizes) if fuse == "qkv" else n, k, rows, fuse=fuse, parts=parts)
    t0 = clock()
    ys = kernels.gemv(x, mats, fmt, fuse, la)
    mx.eval(ys)
    first_ms = (clock() - t0) * 1e3
    if x_offset or w_offset:     # references from aligned copies (ours ran on the views)
        x_ref, refs = aligned_copy(x_ref), [tuple(aligned_copy(a) for a in m) for m in refs]
    outs = []                    # (what, got, ref, tol, the built-in's result or None)
    for i, (y, m) in enumerate(zip(ys, refs if fuse != "glu" else refs[:1])):
        size = sizes[i]
        sample = np.arange(size)
        if size > 16384:         # the LM head: its first and last rows (partial warps) and a random sample
            sample = np.unique(np.r_[0:4096, size - 4096:size, np.random.default_rng(seed).integers(0, size, 4096)])
        got = as_f64(y)[:, sample]
        if fuse == "glu":        # silu(g) u: first-order error from g and u, plus the float32 epilogue
            (g, mag_g), (u, mag_u) = oracle(fmt, x_ref, refs[0], sample), oracle(fmt, x_ref, refs[1], sample)
            sig = 0.5 * (1 + np.tanh(g / 2))
            ref = g * sig * u
            dg, du = chain(la) * 2.0 ** -24 * mag_g, chain(la) * 2.0 ** -24 * mag_u
            tol = bound(la, 0, ref, 1.1 * np.abs(u) * dg + np.abs(g * sig) * du + 2.0 ** -20 * np.abs(ref))
            theirs = as_f64(nn.silu(builtin(fmt, x_ref, refs[0])) * builtin(fmt, x_ref, refs[1]))[:, sample]
        else:
            ref, mag = oracle(fmt, x_ref, m, sample)
            tol = bound(la, mag, ref)
            theirs = as_f64(builtin(fmt, x_ref, m))[:, sample]
        outs.append((f"y{i}", got, ref, tol, theirs))
    for what, got, ref, tol, theirs in outs:
        ratio, their_ratio = float((np.abs(got - ref) / tol).max()), float((np.abs(theirs - ref) / tol).max())
        print(f"  {fmt.name:10} {fuse or '-':3} {what} ({got.shape[1]:6}, {k:5}) rows {rows} {la.label:42} {kind:12} "
              f"off ({x_offset},{w_offset}): max err {np.abs(got - ref).max():.3g} = {ratio:.3f} of the bound; "
              f"built-in {their_ratio:.3f}; |ours - built-in| {np.abs(got - theirs).max():.3g}; "
              f"first call {first_ms:.0f} ms", flush=True)
        assert np.isfinite(got).all(), f"{fmt.name} {(n, k)} rows {rows} {kind}: non-finite output"
        if kind in ("zero x", "zero weights"):
            assert not got.any(), f"{fmt.name} {(n, k)} rows {rows} {kind}: output not exactly zero"
        assert ratio <= 1, f"{fmt.name} {(n, k)} rows {rows} {la.label} {kind}: error {ratio:.3f} x the float32 bound"


@cuda_only
def test_affine_4bit_on_8b_shapes():
    for n, k in SHAPES_8B:
        for rows in (1, 4):
            check(Q4, n, k, rows)
    check(kernels.Format(4, 64), 4096, 4096, 1)
    check(kernels.Format(4, 32, "bfloat16"), 4096, 4096, 1)


@cuda_only
def test_dense_on_8b_shapes():
    for n, k in SHAPES_8B:
        for rows in (1, 4):
            check(F16, n, k, rows)
    check(kernels.Format(16, 0, "bfloat16"), 4096, 4096, 1)


@cuda_only
def test_fused_gate_up_and_qkv():
    for fmt in (Q4, F16):
        for rows in (1, 4):
            check(fmt, GATE_8B[0], GATE_8B[1], rows, fuse="glu")
            check(fmt, sum(QKV_8B), 4096, rows, fuse="qkv", parts=QKV_8B)
        # odd sizes with the same kernels: a partial last warp in each matrix
        check(fmt, 33, 4096, 1, kernels.launch_config(fmt, 33, 4096, 1, fuse="glu"), fuse="glu")
        check(fmt, 7 + 5 + 3, 4096, 1, kernels.launch_config(fmt, 15, 4096, 1, 2, 4, fuse="qkv", parts=(7, 5, 3)),
              fuse="qkv", parts=(7, 5, 3))
        check(fmt, 4096, 4096, 1, kind="large", fuse="glu")
        check(fmt, 4096, 4096, 1, kind="zero x", fuse="glu")


@cuda_only
def test_every_row_count_and_format():
    for rows in range(1, kernels.MAX_ROWS + 1):
        check(Q4, 1000, 4096, rows)
    check(F16, 1000, 4096, 9)
    for rows in (1, 9):
        check(kernels.Format(8, 32), 1000, 4096, rows)
    for fmt in (kernels.Format(4, 128), kernels.Format(8, 64, "bfloat16")):
        check(fmt, 1000, 4096, 3)


@cuda_only
def test_every_candidate_launch():
    for fmt in (Q4, F16):
        for rows in (1, 4):
            for la in kernels.candidates(fmt, 4096, 4096, rows):
                check(fmt, 4096, 4096, rows, la)


@cuda_only
def test_adversarial_inputs():
    for fmt in (Q4, kernels.Format(8, 32), F16):
        for kind in ("zero x", "zero weights", "large"):
            check(fmt, 4096, 4096, 1, kind=kind)
        check(fmt, 1000, 4096, 4, kind="large")
        # odd sizes, with the kernels compiled above (unroll 4 beyond a short k: the guarded loads)
        for n, k in ((1, 128), (3, 256), (33, 384), (1000, 1024)):
            check(fmt, n, k, 1, kernels.launch_config(fmt, n, k, 1, 1, 4))
        check(fmt, 4097, 1024, 1, kernels.launch_config(fmt, 4097, 1024, 1, 2, 4))   # a partial last warp
    check(F16, 300, 104, 1, kernels.launch_config(F16, 300, 104, 1, 1, 4))           # k a multiple of 8, not of 32


def near_tie_or_equal(ref: mx.array, got: mx.array) -> bool:
    """Same argmax, or the reference's top two logits closer than twice the largest logit difference."""
    ref, got = np.array(ref.astype(mx.float32)).ravel(), np.array(got.astype(mx.float32)).ravel()
    if ref.argmax() == got.argmax():
        return True
    top2 = np.sort(ref)[-2:]
    return top2[1] - top2[0] <= 2 * np.abs(ref - got).max()


def agree_teacher_forced(ref: nn.Module, model: nn.Module, prompt: list[int], want: list[int], label: str) -> None:
    """Teacher-forced on the reference's greedy tokens `want`: one row at a time for 12 tokens, then 4 rows at once
    (a speculative verification), each argmax equal to the reference's or a near tie."""
    caches = ref.make_cache(64), model.make_cache(64)
    a, b = ref(mx.array([prompt]), caches[0]), model(mx.array([prompt]), caches[1])
    for t in want[:12]:
        assert near_tie_or_equal(a[0, -1], b[0, -1]), f"{label}: greedy token differs beyond a near tie"
        a, b = ref(mx.array([[t]]), caches[0]), model(mx.array([[t]]), caches[1])
    a, b = ref(mx.array([want[12:16]]), caches[0]), model(mx.array([want[12:16]]), caches[1])
    for i in range(4):
        assert near_tie_or_equal(a[0, i], b[0, i]), f"{label}: 4-row verification differs beyond a near tie"


@cuda_only
def test_patched_decoder_keeps_greedy_tokens():
    """Float16 measured for one row (every candidate timed, fused kernels included), 4-bit with the default
    launches for 1 and 4 rows, fused, and 8-bit for one row: greedy tokens and teacher-forced logits agree
    with the built-ins' but for near ties."""
    prompt = [3, 17, 42, 5, 96, 11, 64, 23]
    for quant, measure, fuse, rows in ((None, True, True, (1,)), ((32, 4), False, True, (1, 4)),
                                       ((64, 8), False, False, (1,))):
        ref, _ = load(SHIPPED, mx.float16)
        model, _ = load(SHIPPED, mx.float16)
        for m in (ref, model):
            if quant:
                nn.quantize(m, group_size=quant[0], bits=quant[1])
        choices = kernels.patch(model, rows=rows, measure=measure, fuse=fuse)
        assert choices and all(not c.errors for c in choices), [c.errors for c in choices if c.errors]
        for c in choices if measure else ():
            chosen = c.launch.label if c.launch else kernels.UNFUSED if c.fuse else kernels.BUILTIN
            print(f"  {c.fmt.name} {c.fuse or 'gemv'} {(c.n, c.k)} rows {c.rows}: {chosen}; "
                  + ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in c.seconds.items()), flush=True)
            assert c.seconds[chosen] == min(c.seconds.values())
        if not measure:          # the defaults: every shape and fused group runs our kernels
            assert all(c.launch is not None for c in choices)
        want, ids = greedy(ref, prompt, 24), greedy(model, prompt, 24)
        print(f"  shipped model {quant or 'float16'} fuse={fuse}: greedy tokens equal: {want == ids}", flush=True)
        agree_teacher_forced(ref, model, prompt, want, str(quant))


# --- the fused decoder layer (kernels/fusedlayer.py) ----------------------------------------------------------

def layer_model(hidden: int, heads: int, kv_heads: int, inter: int, quant: str, arch: str = "llama",
                dtype: mx.Dtype = mx.float16, layers: int = 1, seed: int = 0) -> nn.Module:
    """A random model of one Llama layer shape: quant "f16" (dense), "q4q8" (4-bit groups of 32, v and down
    8-bit: a Q4_K_M file's mix), "q4g64" (nn.quantize's default group)."""
    args = ModelArgs(vocab_size=512, hidden_size=hidden, num_hidden_layers=layers, intermediate_size=inter,
                     num_attention_heads=heads, num_key_value_heads=kv_heads, architecture=arch,
                     tie_word_embeddings=False, rope_theta=500000.0)
    model = random_model(args, dtype, seed)
    if quant == "q4q8":
        nn.quantize(model, class_predicate=lambda path, m: isinstance(m, nn.Linear) and {
            "group_size": 32, "bits": 8 if path.endswith(("v_proj", "down_proj")) else 4})
    elif quant == "q4g64":
        nn.quantize(model, group_size=64, bits=4, class_predicate=lambda path, m: isinstance(m, nn.Linear))
    mx.eval(model.parameters())
    return model


def dense64(layer: nn.Module) -> np.ndarray:
    """A projection's weights (n, k) in float64, from mx.dequantize of its own arrays."""
    if isinstance(layer, nn.QuantizedLinear):
        w = mx.dequantize(layer.weight, layer.scales.astype(mx.float32), layer.biases.astype(mx.float32),
                          layer.group_size, layer.bits)
        return np.array(w).astype(np.float64)
    return as_f64(layer.weight)


def int8_rounded(v: np.ndarray) -> np.ndarray:
    """v as the int8 kernels see it (llama.cpp's q8_1): per block of 32 values d = max|v| / 127 and v / d
    rounded to an integer, both in float32 as the kernel computes them; returns d * round(v / d)."""
    b = v.astype(np.float32).reshape(-1, 32)
    amax = np.abs(b).max(axis=1, keepdims=True)
    d = amax / np.float32(127)
    q = np.rint(np.divide(b, d, out=np.zeros_like(b), where=amax > 0))
    return (q.astype(np.float64) * d.astype(np.float64)).ravel()


def project(layer: nn.Module, v: np.ndarray, int8: bool) -> np.ndarray:
    """layer's matrix times v in float64; int8 (a quantized matrix): as the int8 kernels compute it, the codes
    and scales times the int8-rounded v, each group's bias times the exact sum of v over the group."""
    if not (int8 and isinstance(layer, nn.QuantizedLinear)):
        return dense64(layer) @ v
    vq = int8_rounded(v)
    group_sums = lambda a: a.reshape(-1, layer.group_size).sum(axis=1)
    return dense64(layer) @ vq + as_f64(layer.biases) @ (group_sums(v) - group_sums(vq))


def layer_oracle(block: nn.Module, x: mx.array, keys: np.ndarray, values: np.ndarray, pos: int,
                 int8: bool = False) -> dict:
    """One decode step of a Llama layer in float64, rounding to the activation type (float16 or bfloat16)
    wherever MLX's graph stores an intermediate: the rotated query, the new key and value, the attention
    output, h after attention, the MLP hidden, and y. keys/values (H_kv, >= pos, D) hold positions < pos.
    int8: every quantized matrix meets its input as the int8 kernels do (`project`)."""
    dt = x.dtype
    mm = lambda layer, v: project(layer, v, int8)
    r = lambda a: np.array(mx.array(a.astype(np.float32)).astype(dt).astype(mx.float32)).astype(np.float64)
    attn, mlp = block.self_attn, block.mlp
    H, Hkv, D = attn.n_heads, attn.n_kv_heads, attn.head_dim

    def norm(v: np.ndarray, layer: nn.Module) -> np.ndarray:
        return r(r(v / np.sqrt(np.mean(v * v) + layer.eps)) * as_f64(layer.weight))

    def rope(v: np.ndarray) -> np.ndarray:       # (heads, D), every head at position pos
        wavelengths = (np.array(attn._rope_freqs, dtype=np.float64) if attn._rope_freqs is not None
                       else attn.rope_theta ** (np.arange(0, D, 2) / D))
        ang = pos * attn.rope_scale / wavelengths
        i0 = np.arange(0, D, 2) if attn.rope_traditional else np.arange(D // 2)
        i1 = i0 + 1 if attn.rope_traditional else i0 + D // 2
        out = v.copy()
        out[:, i0] = v[:, i0] * np.cos(ang) - v[:, i1] * np.sin(ang)
        out[:, i1] = v[:, i0] * np.sin(ang) + v[:, i1] * np.cos(ang)
        return r(out)

    xf = as_f64(x).ravel()
    xn = norm(xf, block.input_layernorm)
    q = rope(r(mm(attn.q_proj, xn)).reshape(H, D))
    k = rope(r(mm(attn.k_proj, xn)).reshape(Hkv, D))
    v = r(mm(attn.v_proj, xn)).reshape(Hkv, D)
    K = np.concatenate([keys[:, :pos], k[:, None]], axis=1)
    V = np.concatenate([values[:, :pos], v[:, None]], axis=1)
    o = np.empty((H, D))
    for h in range(H):
        s = K[h // (H // Hkv)] @ q[h] * attn.scale
        p = np.exp(s - s.max())
        o[h] = p @ V[h // (H // Hkv)] / p.sum()
    h = r(xf + r(mm(attn.o_proj, r(o.ravel()))))
    hn = norm(h, block.post_attention_layernorm)
    g, u = r(mm(mlp.gate_proj, hn)), r(mm(mlp.up_proj, hn))
    a = r(r(g * r(1 / (1 + np.exp(-g)))) * u)
    return {"q": q.ravel(), "k": k, "v": v, "h": h, "a": a, "y": r(h + r(mm(mlp.down_proj, a)))}


def close(got: np.ndarray, want: np.ndarray) -> float:
    """The largest error relative to the stage's largest value; the fused layer rounds where the oracle does,
    so what remains is float32 summation order and the roundings it flips (an ulp of the type, 2^-8 for
    float16 after a few stages): 2^-7 of the largest value bounds it, a wrong row, rotation or scale does not."""
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def test_fused_layer_says_why_it_leaves_a_layer():
    assert fusedlayer.why_not(layer_model(256, 8, 2, 512, "f16").layers[0]) is None
    assert fusedlayer.why_not(layer_model(256, 8, 2, 512, "q4q8").layers[0]) is None
    assert "norms" in fusedlayer.why_not(layer_model(256, 8, 2, 512, "f16", "qwen3").layers[0])
    assert "head size 48" in fusedlayer.why_not(layer_model(384, 8, 2, 512, "f16").layers[0])
    assert "format" in fusedlayer.why_not(layer_model(256, 8, 2, 512, "f16", dtype=mx.float32).layers[0])
    wide_norm = layer_model(256, 8, 2, 512, "f16").layers[0]
    wide_norm.input_layernorm.weight = wide_norm.input_layernorm.weight.astype(mx.float32)
    assert "float types" in fusedlayer.why_not(wide_norm)
    mixed = layer_model(256, 8, 2, 512, "f16")
    nn.quantize(mixed, group_size=32, bits=4, class_predicate=lambda path, m: path.endswith("o_proj"))
    assert "mixed" in fusedlayer.why_not(mixed.layers[0])
    odd = layer_model(256, 8, 2, 512, "f16")
    nn.quantize(odd, class_predicate=lambda path, m: isinstance(m, nn.Linear) and {
        "group_size": 64 if path.endswith("up_proj") else 32, "bits": 4})
    assert "gate and up" in fusedlayer.why_not(odd.layers[0])
    five = layer_model(256, 8, 2, 512, "f16")
    nn.quantize(five, group_size=32, bits=5, class_predicate=lambda path, m: isinstance(m, nn.Linear))
    reason = fusedlayer.why_not(five.layers[0])
    assert reason.endswith("down_proj: affine 5-bit in groups of 32, a format the kernels do not read"), reason
    biased = layer_model(256, 8, 2, 512, "f16", "qwen2")
    biased.layers[0].self_attn.q_proj = nn.Linear(256, 256, bias=True)
    biased.layers[0].self_attn.q_proj.set_dtype(mx.float16)
    assert fusedlayer.why_not(biased.layers[0]) == "q_proj: a bias, which the kernels do not add"


def test_numbers_the_kernels_read_are_over_eight_bytes():
    """eps, scale and the write position reach the kernels as arrays of more than 8 bytes, each value first: MLX's
    CUDA allocator keeps arrays of 8 bytes or less in one pool in host memory, which the GPU reads across PCIe."""
    for offset in (0, 17, 4095):
        at = fusedlayer.position(offset)
        assert at.dtype == mx.int32 and at.nbytes > 8 and at[0].item() == offset
    assert fusedlayer.position(17) is fusedlayer.position(17)       # one array a step, shared by every layer
    for value in (1e-5, 1e-6, 128 ** -0.5):
        x = fusedlayer.scalar(value, mx.float32)
        assert x.dtype == mx.float32 and x.nbytes > 8 and x[0].item() == np.float32(value)


def test_fused_layer_launches_cover_every_row():
    """The 8B layer's launch geometry: every output row (attn_in: every RoPE pair) has a warp, no block is
    wholly idle, each staged row fits its shared memory, attend splits the keys."""
    block = TransformerBlock(args_for("Llama-3.1-8B"))       # lazy: only shapes are read, nothing is computed
    nn.quantize(block, class_predicate=lambda path, m: isinstance(m, nn.Linear) and {
        "group_size": 32, "bits": 8 if path.endswith(("v_proj", "down_proj")) else 4})
    block.set_dtype(mx.float16)
    plan = fusedlayer.launches(block)
    rows = {"attn_in": (32 + 16) * 128, "attn_out": 4096, "mlp_in": 14336, "mlp_out": 4096}
    for name, n in rows.items():
        warps = plan.grids[name] // 32
        need = -(-n // (2 if name == "attn_in" else fusedlayer.ROWS_PER_WARP))
        per = fusedlayer.GROUPS_PER_BLOCK.get(name, 1)
        assert need <= warps * per < need + fusedlayer.WARPS[name] * per, (name, warps, need)
        assert plan.grids[name] % plan.threads[name] == 0 and plan.threads[name] == 32 * fusedlayer.WARPS[name]
    widths = {"attn_in": 4096, "attn_out": 4096, "mlp_in": 4096, "mlp_out": 14336}
    for name, k in widths.items():      # the last padded index, k - 1 + 4 (k - 1) // 32, fits
        assert plan.shared[name] >= 4 * (k + 4 * ((k - 1) // 32))
    assert plan.shared["attn_out"] >= 4 * (4096 + 4 * 4095 // 32 + 32 * fusedlayer.MAX_SPLITS)   # + split weights
    # attend: each warp's partial results for the 4 query heads (128 values, max, sum), then the 4 queries in
    # quarters of 32 values, each padded by 4
    assert plan.shared["attend"] == 4 * (fusedlayer.WARPS["attend"] * 4 * 130 + 4 * 4 * 36)
    assert dict(plan.templates["attend"])["G"] == 4
    assert dict(plan.templates["attn_in"])["B2"] == 8 and dict(plan.templates["mlp_out"])["B0"] == 8
    assert [fusedlayer.splits(n) for n in (1, 64, 65, 256, 10 ** 6)] == [1, 1, 2, 4, fusedlayer.MAX_SPLITS]
    # attention: attend's blocks (a key head and split each), then attn_out's, in attn_out's block size, with the
    # larger of the two kernels' shared memory; merged while attend's accumulators fit 128 registers a thread.
    # mlp: mlp_in's blocks, then mlp_out's
    assert plan.merged == () and plan.order() == fusedlayer.STAGES    # by default, no pair merged
    with layerlaunch.applied(layerlaunch.Setting(merge=("attention", "mlp"))):
        both = fusedlayer.launches(block)
    assert both.merged == ("attention", "mlp") and both.order() == ("attn_in", "attention", "mlp")
    assert plan.grids["mlp"] == plan.grids["mlp_in"] + plan.grids["mlp_out"] and plan.threads["mlp"] == 8 * 32
    # three groups of rows a block: a third of the blocks (rounded up), but merged mlp keeps a group per block
    with layerlaunch.applied(layerlaunch.Setting(groups={"attn_in": 3, "mlp_in": 3})):
        grouped = fusedlayer.launches(block)
    assert grouped.grids["attn_in"] // 256 == -(-3072 // (8 * 3)) and grouped.grids["mlp_in"] // 256 == -(-7168 // 24)
    assert grouped.grids["mlp"] == plan.grids["mlp"] and grouped.grids["attn_out"] == plan.grids["attn_out"]
    assert plan.shared["mlp"] == plan.shared["mlp_out"] > plan.shared["mlp_in"]
    assert dict(plan.templates["mlp"])["B1"] == 8 and dict(plan.templates["mlp"])["B0"] == 4
    for keys in (1, 300):
        blocks = 8 * fusedlayer.splits(keys) + plan.grids["attn_out"] // plan.threads["attn_out"]
        assert fusedlayer.grid(plan, "attention", keys, 8) == blocks * plan.threads["attention"]
        assert fusedlayer.grid(plan, "attend", keys, 8) == 8 * fusedlayer.splits(keys) * plan.threads["attend"]
    assert plan.threads["attention"] == plan.threads["attn_out"]
    assert plan.shared["attention"] == max(plan.shared["attend"], plan.shared["attn_out"])
    assert dict(plan.templates["attention"])["NA"] == fusedlayer.WARPS["attend"]
    wide = TransformerBlock(replace(args_for("Llama-3.1-8B"), num_key_value_heads=4))   # 8 query heads a key head
    wide.set_dtype(mx.float16)
    with layerlaunch.applied(layerlaunch.Setting(merge=("attention", "mlp"))):
        assert fusedlayer.launches(wide).merged == ("mlp",)
        assert fusedlayer.launches(wide).order() == ("attn_in", "attend", "attn_out", "mlp")
        with layerlaunch.applied(layerlaunch.Setting(warps={"mlp_out": 16})):
            assert fusedlayer.launches(block).merged == ("attention",)
    # int8 activations: the matrix kernels but mlp_out say so, and each holds the row's int8 copy after its floats
    # (a float2 per 16 values, then k bytes in two regions 64 bytes apart); a dense layer has no int8 kernels
    q8 = fusedlayer.launches(block, int8=True)
    for name, k in widths.items():
        assert q8.int8 and not plan.int8 and not dict(plan.templates[name])["Q8"]
        assert dict(q8.templates[name])["Q8"] == (name != "mlp_out")
        assert q8.shared[name] >= 4 * (k + 4 * (k // 32) + 4) + (8 * (k // 16) + k + 64 if name != "mlp_out" else 0)
    assert dict(q8.templates["attention"])["Q8"] and q8.shared["mlp_out"] == plan.shared["mlp_out"]
    assert dict(q8.templates["mlp"])["Q8"] and not dict(q8.templates["mlp"])["Q8D"]
    dense = TransformerBlock(args_for("Llama-3.1-8B"))
    dense.set_dtype(mx.float16)
    assert not any(dict(t).get("Q8") for t in fusedlayer.launches(dense, int8=True).templates.values())


def test_fused_layer_sources_match_their_inputs():
    """Each body names only inputs it is given and the shapes it reads; kernel names change with the source."""
    for name, (inputs, outputs, body) in fusedlayer_cuda.SOURCES.items():
        for shape in re.findall(r"(\w+)_shape", body):
            assert shape in inputs, (name, shape)
        for arg in inputs + outputs:
            assert re.search(rf"\b{arg}\b", body), (name, arg)
    assert "ref_gemv" in fusedlayer_cuda.HEADER and "namespace ref_layer" in fusedlayer_cuda.HEADER
    # each kernel carries the header parts it calls, and fewer than all of them
    defined = lambda text: set(re.findall(r"__device__ __forceinline__ \w+ (\w+)\(", text))
    for name, (_, _, body) in fusedlayer_cuda.SOURCES.items():
        text = fusedlayer_cuda.header(fusedlayer_cuda.NEEDS[name])
        assert set(re.findall(r"::ref_layer::(\w+)", body)) <= defined(text), name
        assert len(text) < len(fusedlayer_cuda.HEADER), name
    every = defined(fusedlayer_cuda.HEADER)
    for name, parts in fusedlayer_cuda.NEEDS.items():   # and every function its parts call
        text = fusedlayer_cuda.header(parts)
        assert set(re.findall(r"\b(\w+)(?:<[^<>()]*>)?\(", text)) & every <= defined(text), name


class FakeStep:
    """A FusedLayer's step for the CPU: the plain layer's output through MLX, the k/v write included."""

    def __init__(self, layer: nn.Module):
        self.layer, self.calls = layer, 0

    def __call__(self, x: mx.array, cache) -> tuple:
        self.calls += 1
        probe = cache.offset
        y = TransformerBlock.__call__(self.layer, x, None, cache)
        cache.offset = probe                # the fused step leaves the offset to the caller
        return (y,)


def test_fused_layer_routes_one_token_steps_only():
    """A one-token step on a KVCache takes the fused step and advances the cache; a prompt, a quantized cache
    or the switch off run the plain layer; parameter names do not change; off CUDA fuse swaps nothing."""
    model = layer_model(256, 8, 2, 512, "f16", layers=2)
    names = [k for k, _ in nn.utils.tree_flatten(model.parameters())]
    if not CUDA:
        reasons = fusedlayer.fuse(model)
        assert set(reasons) == {0, 1} and "CUDA" in reasons[0]
        assert not any(isinstance(b, fusedlayer.FusedLayer) for b in model.layers)
    ref = [model(mx.array([[5, 9, 2]]), c := model.make_cache(16)), model(mx.array([[7]]), c)]
    model.layers = [fusedlayer.FusedLayer(b) for b in model.layers]
    assert [k for k, _ in nn.utils.tree_flatten(model.parameters())] == names
    steps = [FakeStep(b) for b in model.layers]
    for b, s in zip(model.layers, steps):
        b.on, b.step = True, s              # the instance's step in place of the kernels
    cache = model.make_cache(16)
    out = [model(mx.array([[5, 9, 2]]), cache), model(mx.array([[7]]), cache)]
    assert [s.calls for s in steps] == [1, 1] and cache[0].offset == 4
    assert all(mx.allclose(a, b).item() for a, b in zip(ref, out))
    model(mx.array([[7]]), model.make_cache(16, scheme="affine8-g32"))
    assert [s.calls for s in steps] == [1, 1]
    full = model.make_cache(1)
    model(mx.array([[7]]), full)
    with raises(ValueError, "KV cache full"):
        model(mx.array([[7]]), full)


@cuda_only
def test_fused_layer_against_float64_oracle():
    """Every kernel of the fused layer (fusedlayer_cuda.py) on random layers: dense float16 and bfloat16, the
    Q4_K_M mix of 4- and 8-bit groups of 32, 4-bit groups of 64 at Llama-3.1-8B's layer shape; adjacent and
    half-head RoPE pairs; head sizes 64 and 128; at positions that give attend 1 to 4 key-length splits. The
    quantized layers run twice: float activations, and int8 ones against the oracle that rounds as they do (and
    within a few percent of the float oracle: the rounding itself). Each pair of kernels runs as one launch
    (attention, mlp), and as two for the first case of each kind; attn_in and mlp_in also with blocks that
    compute three groups of rows each (a last block with fewer)."""
    cases = [(512, 8, 2, 1408, "f16", "llama", mx.float16, (0, 5, 300)),
             (512, 8, 8, 1024, "f16", "qwen2", mx.bfloat16, (1, 260)),
             (1024, 8, 2, 2816, "q4q8", "qwen2", mx.float16, (3, 700)),
             (1024, 16, 4, 2048, "q4q8", "llama", mx.float16, (17,)),
             (4096, 32, 8, 14336, "q4g64", "llama", mx.float16, (1000,))]
    rng = np.random.default_rng(0)
    runs = [(case, int8, fusedlayer.PAIRS, {}) for case in cases
            for int8 in ((False, True) if case[4] != "f16" else (False,))]
    grouped = {"attn_in": 3, "mlp_in": 3}     # blocks that stage once and compute 3 groups of rows
    runs += [(cases[0], False, (), grouped), (cases[2], False, (), {}), (cases[2], True, (), grouped)]
    for (hidden, heads, kv, inter, quant, arch, dt, positions), int8, merge, groups in runs:
        model = layer_model(hidden, heads, kv, inter, quant, arch, dt)
        with layerlaunch.applied(layerlaunch.Setting(merge=merge, groups=groups)):
            assert fusedlayer.fuse(model, int8=int8) == {}
        layer = model.layers[0]
        assert layer.plan.merged == tuple(merge)
        D = layer.self_attn.head_dim
        for pos in positions:
            cache = model.make_cache(pos + 8)[0]
            keys = rng.standard_normal((kv, pos + 8, D)).astype(np.float32)
            values = rng.standard_normal((kv, pos + 8, D)).astype(np.float32)
            cache.keys, cache.values = (mx.array(a[None]).astype(dt) for a in (keys, values))
            cache.offset = pos
            x = (mx.random.normal((1, 1, hidden), key=mx.random.key(pos)) * 2).astype(dt)
            mx.eval(x, cache.keys, cache.values)
            keys, values = as_f64(cache.keys)[0], as_f64(cache.values)[0]    # as stored, before the write
            want = layer_oracle(layer, x, keys, values, pos, int8)
            query, part, h, a, y = layer.step(x, cache)
            mx.eval(y)
            assert part.shape[0] == fusedlayer.splits(pos + 1)
            got = {"q": as_f64(query).ravel(), "k": as_f64(cache.keys)[0, :, pos], "v": as_f64(cache.values)[0, :, pos],
                   "h": as_f64(h).ravel(), "a": as_f64(a).ravel(), "y": as_f64(y).ravel()}
            errs = {s: close(got[s], want[s]) for s in want}
            if int8:
                plain = layer_oracle(layer, x, keys, values, pos)
                drift = {s: close(want[s], plain[s]) for s in ("q", "h", "y")}
                print("    int8 rounding against float activations: " + ", ".join(
                    f"{s} {e:.1e}" for s, e in drift.items()), flush=True)
                assert max(drift.values()) < 0.05, drift
            print(f"  {quant}{' int8' if int8 else ''}{'' if merge else ' five launches'}{' 3 groups a block' if groups else ''} "
                  f"{dtype_name(dt)} {arch} d={hidden} "
                  f"H={heads}/{kv} D={D} f={inter} pos {pos} ({part.shape[0]} splits): "
                  + ", ".join(f"{s} {e:.1e}" for s, e in errs.items()), flush=True)
            assert max(errs.values()) < 2 ** -7, errs
            untouched = np.delete(np.arange(pos + 8), pos)
            assert np.array_equal(as_f64(cache.keys)[0][:, untouched], keys[:, untouched]), "other positions changed"


@cuda_only
def test_merged_pairs_hand_over_on_their_own_counters():
    """attention and mlp (each pair of kernels in one launch) on the 8B layer's shape: launches queued at once on
    counters of their own all give the two-launch result, the counters are zero again after each, and counters that
    never see the first half's blocks arrive give NaN (within a second) instead of a hung GPU, and are zero after."""
    model = layer_model(4096, 32, 8, 14336, "q4q8")
    assert fusedlayer.fuse(model) == {}
    st = model.layers[0].stages
    cache = model.make_cache(300)[0]
    cache.offset = 257
    x = (mx.random.normal((1, 1, 4096), key=mx.random.key(1))).astype(mx.float16)
    at = fusedlayer.position(cache.offset)
    query = st["attn_in"](x, cache, at)
    h = st["attn_out"](st["attend"](query, cache, at), x)
    pairs = {"attention": ((query, cache, at, x), h), "mlp": ((h,), st["mlp_out"](st["mlp_in"](h), h))}
    for pair, (args, want) in pairs.items():
        counters = [mx.zeros((3,), dtype=mx.int32) for _ in range(8)]
        mx.eval(want, counters)
        got = [st[pair](*args, c)[1] for c in counters]
        mx.eval(got)
        assert all(mx.array_equal(g, want).item() for g in got), pair
        assert all(c.tolist() == [0, 0, 0] for c in counters), pair
        broken = mx.array([0, -10 ** 6, 0], dtype=mx.int32)
        start = clock()
        y = st[pair](*args, broken)[1]
        mx.eval(y)
        print(f"  {pair}: a handoff that never completes gives NaN after {clock() - start:.1f} s", flush=True)
        assert mx.isnan(y).all().item() and broken.tolist() == [0, 0, 0], pair


@cuda_only
def test_fused_decoder_keeps_greedy_tokens():
    """The shipped model in float16 and 4-bit, and 4- and 8-bit with int8 activations, every layer fused: the
    same greedy tokens as MLX's built-ins, and a prompt or a speculative verification (several rows) still runs
    the plain layer on the same cache."""
    prompt = [3, 17, 42, 5, 96, 11, 64, 23]
    for quant, int8 in ((None, False), ((32, 4), False), ((32, 4), True), ((32, 8), True)):
        ref, _ = load(SHIPPED, mx.float16)
        model, _ = load(SHIPPED, mx.float16)
        for m in (ref, model):
            if quant:
                nn.quantize(m, group_size=quant[0], bits=quant[1])
        assert fusedlayer.fuse(model, int8=int8) == {}
        want, ids = greedy(ref, prompt, 24), greedy(model, prompt, 24)
        label = f"{quant or 'float16'}{' int8 activations' if int8 else ''}"
        print(f"  shipped model {label}, fused layers: greedy tokens equal: {want == ids}", flush=True)
        agree_teacher_forced(ref, model, prompt, want, f"{label} fused layers")
        assert want == ids
        assert kernels.count_kernels(model) < kernels.count_kernels(ref) / 2


# One random file per architecture the decoder reads, shaped so that every K-quant row fills whole super-blocks.
ARCH_FILES = {
    "llama": dict(architecture="llama", tie_word_embeddings=False),
    "qwen2": dict(architecture="qwen2", attention_bias=True),
    "qwen3": dict(architecture="qwen3"),
    "gemma2": dict(architecture="gemma2", sliding_window=8, sliding_layers=(True, False), attn_logit_softcap=50.0,
                   final_logit_softcap=30.0, rope_theta_local=10000.0),
    "gemma3": dict(architecture="gemma3", sliding_window=8, sliding_layers=(True, False), tie_word_embeddings=False,
                   rope_theta_local=10000.0),
    "phi3": dict(architecture="phi3", fused_qkv=True, tie_word_embeddings=False),
    "qwen3moe": dict(architecture="qwen3moe", num_experts=8, experts_per_token=2, expert_intermediate_size=256),
}


def arch_file(arch: str, file_type: str, work: Path) -> Path:
    args = ModelArgs(vocab_size=512, hidden_size=256, num_hidden_layers=2, intermediate_size=512,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
                     **ARCH_FILES[arch])
    return write_random_model(work / f"{arch}-{file_type}.gguf", args, file_type, seed=3)


def test_fused_layers_step_aside_for_other_architectures(tmp_path):
    """The fused decoder layer is the llama/qwen2 block: every other architecture's layer names why it stays MLX's."""
    reasons = {"qwen2": "a bias", "qwen3": "query/key norms", "gemma2": "sliding-window or soft-capped attention",
               "gemma3": "query/key norms", "phi3": "fused q-k-v and gate-up matrices", "qwen3moe": "query/key norms"}
    for arch in ARCH_FILES:
        with gguf.read(arch_file(arch, "F16", tmp_path)) as f:
            model = load_model(f, mx.float16)
        for patched in (False, True):   # as loaded, and after patch swapped in GEMVLinears and GatedMLPs
            if patched:
                kernels.patch(model, measure=False, fuse=True)
            why = fusedlayer.why_not(model.layers[0])
            assert (why is None) if arch not in reasons else (why is not None and reasons[arch] in why), (arch, why)


@cuda_only
def test_every_architecture_keeps_greedy_tokens():
    """Each architecture in float16, and in Q4_K_M and Q3_K_M held natively, with our GEMVs, fused groups and fused layers
    swapped in where they apply (and stepping aside where they do not): the same greedy tokens as MLX's
    built-ins, teacher-forced logits equal but for near ties."""
    prompt = [3, 17, 42, 5, 96, 11, 64, 23]
    with tempfile.TemporaryDirectory() as work:
        for arch in ARCH_FILES:
            for file_type in ("F16", "Q4_K_M", "Q3_K_M"):   # Q3_K: held as 8-bit groups of 32 (transcode.py)
                path = arch_file(arch, file_type, Path(work))
                with gguf.read(path) as f:
                    ref = load_model(f, mx.float16, quantized=file_type != "F16")
                    model = load_model(f, mx.float16, quantized=file_type != "F16")
                choices = kernels.patch(model, rows=(1, 4), measure=False, fuse=True)
                assert all(not c.errors for c in choices), [c.errors for c in choices if c.errors]
                left = fusedlayer.fuse(model)
                assert arch != "llama" or file_type != "F16" or not left, left
                want, ids = greedy(ref, prompt, 24), greedy(model, prompt, 24)
                print(f"  {arch} {file_type}: {sum(c.launch is not None for c in choices)} kernel choices, "
                      f"{len(model.layers) - len(left)} fused layers; greedy tokens equal: {want == ids}", flush=True)
                agree_teacher_forced(ref, model, prompt, want, f"{arch} {file_type}")


# Last: a fault here is sticky for the whole process (as a script it runs in a child process).
@cuda_only
def test_misaligned_inputs():
    for fmt in (Q4, kernels.Format(8, 32), F16):
        check(fmt, 1000, 4096, 1, x_offset=1)                              # misaligned x: the 2-byte path
        check(fmt, 1000, 4096, 1, w_offset=1)                              # misaligned w
    check(Q4, 1000, 4096, 1, x_offset=3, fuse="glu")
    check(F16, 15, 4096, 1, w_offset=1, fuse="qkv", parts=(7, 5, 3))


test_misaligned_inputs.isolated = True


# --- as a script -----------------------------------------------------------------------------------------

def main(only: str | None = None, part: str = "1/1") -> int:
    """Run every test here (CUDA tests only on CUDA), isolated ones in a child process; print failures; end
    with the summary line. only: run that one test in this process; part "K/N": every Nth test from the Kth
    (two processes can then share one GPU's run)."""
    print(f"MLX {mx.__version__}, device {mx.default_device()}, CUDA backend: {CUDA}, part {part}", flush=True)
    k, n = map(int, part.split("/"))
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    tests = [(name, f) for name, f in globals().items() if name.startswith("test_") and callable(f)]
    for name, test in tests[k - 1::n]:
        if (only and name != only) or getattr(test, "needs_cuda", CUDA) != CUDA:
            counts["skipped"] += not only
            continue
        if set(inspect.signature(test).parameters) - {"tmp_path"}:      # pytest's other fixtures: run under pytest
            counts["skipped"] += 1
            print(f"{name} skipped: needs pytest's fixtures", flush=True)
            continue
        print(f"{name} ...", flush=True)
        t0 = clock()
        if getattr(test, "isolated", False) and not only:
            rc = subprocess.run([sys.executable, __file__, "--only", name]).returncode
            counts["passed" if rc == 0 else "failed"] += 1
            print(f"{name} {'passed' if rc == 0 else f'FAILED (child exit {rc})'} in {clock() - t0:.1f} s",
                  flush=True)
            continue
        try:
            with tempfile.TemporaryDirectory() as d:
                test(*([Path(d)] if "tmp_path" in inspect.signature(test).parameters else []))
            counts["passed"] += 1
            print(f"{name} passed in {clock() - t0:.1f} s", flush=True)
        except Exception:     # noqa: BLE001 -- report every failure and go on to the next test
            counts["failed"] += 1
            print(f"{name} FAILED in {clock() - t0:.1f} s\n{traceback.format_exc()}", flush=True)
    print(f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    flags = dict(zip(sys.argv[1::2], sys.argv[2::2]))   # --only NAME, --part K/N
    sys.exit(main(flags.get("--only"), flags.get("--part", "1/1")))
