"""Q2_K, Q3_K, Q4_1, Q5_1 (kquants.py) and IQ4_NL, IQ4_XS (iquants.py): every block decodes bit for bit
as llama.cpp's `gguf` package (and its C library) decodes it, a file of these types loads in the float
path and computes what a numpy forward on the `gguf` package's weights computes, the native path maps
each type as transcode.plan says, and llama.cpp itself runs the same file to the same logits."""

from __future__ import annotations

import argparse
import ctypes
import zlib
from pathlib import Path

import gguf as gguf_py
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import quants
from numpy_reference import forward as np_forward
from numpy_reference import load as np_load

from ref_impl.engine import transcode
from ref_impl.engine.checkpoint import gguf_to_mlx_name, load, load_model
from ref_impl.engine.model import ModelArgs
from ref_impl.engine.random import random_blocks, write_random_model
from ref_impl.engine.runnable import why_not
from ref_impl.engine.tokenizer import train_tokenizer
from ref_impl.formats import gguf, iquants, kquants
from ref_impl.formats.ggml import GGMLType
from ref_impl.formats.quantize import llama_order
from ref_impl.measure.peers import llama_cpp_available

TYPES = ["Q2_K", "Q3_K", "Q4_1", "Q5_1", "IQ4_NL", "IQ4_XS"]
C_NAMES = {"Q2_K": "q2_K", "Q3_K": "q3_K", "Q4_1": "q4_1", "Q5_1": "q5_1", "IQ4_NL": "iq4_nl", "IQ4_XS": "iq4_xs"}
# byte offsets of each block's fp16 fields (ggml-common.h); IQ4_XS's scales_h at 2 is a uint16, not a float
FP16_FIELDS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_1": (0, 2), "Q5_1": (0, 2), "IQ4_NL": (0,), "IQ4_XS": (0,)}
# fp16 bit patterns: +-65504, +-the smallest subnormal, the smallest normal, +-0, +-inf, a quiet and a
# signalling nan, 1.0
EXTREMES = np.array([0x7BFF, 0xFBFF, 0x0001, 0x8001, 0x0400, 0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E00, 0x7C01,
                     0x3C00], dtype="<u2")
ARGS = ModelArgs(vocab_size=264, hidden_size=256, num_hidden_layers=2, intermediate_size=512, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
IDS = [int(i) for i in np.random.default_rng(0).integers(0, ARGS.vocab_size, 16)]
N_BLOCKS = 512


def oracle(data: np.ndarray, name: str) -> np.ndarray:
    """llama.cpp's `gguf` package's dequantizer."""
    return quants.dequantize(data, gguf_py.GGMLQuantizationType[name])


def sizes(name: str) -> tuple[int, int]:
    """(values, bytes) per block, from the gguf package rather than our ggml.BLOCK."""
    return gguf_py.GGML_QUANT_SIZES[gguf_py.GGMLQuantizationType[name]]


def assert_bit_equal(ours: np.ndarray, ref: np.ndarray) -> None:
    """Same shape, float32, nan where ref has nan, and every other value the same 32 bits (-0.0 too)."""
    assert ours.dtype == np.float32 and ours.shape == ref.shape
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(ours), nan)
    assert np.array_equal(ours.view(np.uint32)[~nan], ref.view(np.uint32)[~nan])


def extreme_blocks(name: str, seed: int) -> np.ndarray:
    """N_BLOCKS blocks (8, N_BLOCKS // 8 * bytes) of random bytes whose fp16 fields are all extreme values."""
    rng = np.random.default_rng(seed)
    values, nbytes = sizes(name)
    data = rng.integers(0, 256, (N_BLOCKS, nbytes), dtype=np.uint8)
    for at in FP16_FIELDS[name]:
        data[:, at:at + 2] = rng.choice(EXTREMES, N_BLOCKS).astype("<u2").view(np.uint8).reshape(-1, 2)
    return data.reshape(8, -1)


# --- blocks ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", TYPES)
def test_random_valid_blocks_decode_as_the_gguf_package(name):
    """random.random_blocks (random codes, small finite scales): equal bits, and plausible weights."""
    values, nbytes = sizes(name)
    data = random_blocks(name, 64, N_BLOCKS // 64 * values, np.random.default_rng(zlib.crc32(name.encode())))
    ours = gguf.DEQUANTIZE[name](data)
    assert_bit_equal(ours, oracle(data, name))
    assert ours.shape == (64, N_BLOCKS // 64 * values) and np.isfinite(ours).all() and 0.1 < np.abs(ours).max() < 1
    stacked = data.reshape(4, 16, -1)                          # any leading shape, rows of whole blocks
    assert np.array_equal(gguf.DEQUANTIZE[name](stacked), ours.reshape(4, 16, -1))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")        # inf and nan scales, in the oracle too
@pytest.mark.parametrize("name", TYPES)
def test_extreme_scales_decode_as_the_gguf_package(name):
    """fp16 fields of +-max, subnormals, +-0, +-inf and nans, every other byte random: equal bits."""
    for seed in range(2):
        data = extreme_blocks(name, zlib.crc32(f"{name} {seed}".encode()))
        assert_bit_equal(gguf.DEQUANTIZE[name](data), oracle(data, name))


@pytest.mark.skipif(not llama_cpp_available(), reason="llama-cpp-python is not installed")
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("name", TYPES)
def test_blocks_decode_as_llama_cpp_c(name):
    """The same bytes through ggml-quants.c's own dequantize_row_<type> (llama-cpp-python's libggml-base)."""
    import ggml_oracle

    fn = getattr(ctypes.CDLL(str(ggml_oracle.library_path())), f"dequantize_row_{C_NAMES[name]}")
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64], None
    data = np.ascontiguousarray(extreme_blocks(name, 7))
    ours = gguf.DEQUANTIZE[name](data)
    theirs = np.empty_like(ours)
    fn(data.ctypes.data, theirs.ctypes.data, theirs.size)
    assert_bit_equal(ours, theirs)


def test_scale_unpacking_by_hand():
    # Q3_K scale j: low nibble of byte j (j < 8) or high nibble of byte j - 8, top 2 bits from byte
    # 8 + j % 4 at bit 2 * (j // 4); stored + 32
    packed = np.zeros((1, 12), np.uint8)
    packed[0, 1] = 0x5_3             # scale 1 low bits 3, scale 9 low bits 5
    packed[0, 9] = 0b10_00_00_01     # top bits: scale 1 -> 1 (bits 0-1), scale 13 -> 2 (bits 6-7)
    s = kquants.unpack_scales_q3_k(packed)
    assert s[0, 1] == (3 | 1 << 4) - 32 and s[0, 9] == 5 - 32 and s[0, 13] == (2 << 4) - 32 and s[0, 0] == -32
    # IQ4_XS sub-block j: nibble j of scales_l (low first) | bits 2j, 2j+1 of scales_h << 4, minus 32
    block = np.zeros((1, 136), np.uint8)
    block[0, 2:4] = np.array([0b11 << 6], "<u2").view(np.uint8)    # sub-block 3's top bits 3
    block[0, 5] = 0xA_7                                             # sub-block 2: 7, sub-block 3: 10
    ls = iquants.unpack_scales_iq4_xs(block)
    assert ls[0, 2] == 7 - 32 and ls[0, 3] == (10 | 3 << 4) - 32 and ls[0, 0] == -32


@pytest.mark.parametrize("name", TYPES)
def test_wrong_byte_count_is_a_clear_error(name):
    with pytest.raises(ValueError, match=f"{name} data must be uint8 with a last dimension that is a multiple"):
        gguf.DEQUANTIZE[name](np.zeros((2, sizes(name)[1] + 1), np.uint8))


# --- a file of these types --------------------------------------------------------------------------------

def signed_blocks(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """random_blocks with each fp16 field's sign drawn at random. random_blocks' scales are all positive,
    so every Q4_1 weight d q + m is: the residual stream of such a model grows to ~2000 and, at some
    positions, cancels to ~25, which costs float32 100x its usual relative error."""
    data = random_blocks(name, *shape, rng)
    blocks = data.reshape(-1, sizes(name)[1])
    for at in FP16_FIELDS[name]:
        blocks[:, at + 1] ^= rng.integers(0, 2, len(blocks), dtype=np.uint8) << 7   # the sign bit
    return data


@pytest.fixture(scope="module")
def lowbit_file(tmp_path_factory) -> Path:
    """A random 2-layer llama (with a tokenizer, so it runs) whose 16 matrices cycle through TYPES."""
    work = tmp_path_factory.mktemp("lowbit")
    tok = train_tokenizer(["def f(x):\n    return x + 1\n" * 50], vocab_size=ARGS.vocab_size)   # 7 merges: llama.cpp
    assert tok.vocab_size == ARGS.vocab_size                                                    # wants some
    src = write_random_model(work / "f32.gguf", ARGS, "F32", tokenizer=tok.gguf_metadata())
    rng, path = np.random.default_rng(1), work / "lowbit.gguf"
    with gguf.read(src) as f:
        matrices = [n for n in llama_order(f.tensors) if len(f.tensors[n].shape) == 2]
        types = {n: TYPES[i % len(TYPES)] for i, n in enumerate(matrices)}
        tensors = {n: gguf.TensorData(GGMLType[types[n]], f.tensors[n].shape,
                                      signed_blocks(types[n], f.tensors[n].shape, rng))
                   if n in types else f.tensor_data(n) for n in f.tensors}
        gguf.write(path, dict(f.fields), tensors)
    return path


def logits(model: nn.Module, ids: list[int]) -> np.ndarray:
    """float32 logits (len(ids), vocab) of one uncached forward."""
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


def test_float_path_matches_numpy_on_the_gguf_packages_weights(lowbit_file):
    """checkpoint.load in float32 holds exactly the `gguf` package's floats for every matrix, and its
    logits are numpy_reference's float64 forward on them, to float32 rounding (1e-5 of the largest)."""
    with gguf.read(lowbit_file) as f:
        assert {t.type.name for t in f.tensors.values()} == {*TYPES, "F32"}
    model, _ = load(lowbit_file, mx.float32)
    hp, w = np_load(lowbit_file)
    params = dict(nn.utils.tree_flatten(model.parameters()))
    for name, ref in w.items():
        assert np.array_equal(np.array(params[gguf_to_mlx_name(name)]), ref.astype(np.float32)), name
    ours, ref = logits(model, IDS), np_forward(hp, w, IDS)
    assert np.abs(ref).max() > 1.0
    assert np.abs(ours - ref).max() <= 1e-5 * np.abs(ref).max()


def test_runs_here_and_inspect_says_so(lowbit_file, capsys):
    """runnable.why_not accepts the file and `inspect --mlx` lists each type's MLX representation."""
    from ref_impl.__main__ import cmd_inspect

    with gguf.read(lowbit_file) as f:
        assert why_not(f) is None
    assert set(TYPES) <= {t.name for t in gguf.DECODABLE}
    cmd_inspect(argparse.Namespace(path=str(lowbit_file), mlx=True))
    out = capsys.readouterr().out
    assert "runs here: yes" in out and "cannot decode" not in out
    assert "no MLX affine mapping for Q2_K: expanded to float" in out and "table levels as 8-bit codes: exact" in out


NATIVE = {"Q2_K": None, "Q3_K": 8, "Q4_1": 4, "Q5_1": 5, "IQ4_NL": 8, "IQ4_XS": 8}   # MLX bits; None: float


def test_native_path_is_exact_where_plan_says_so(lowbit_file):
    """--weights native: plan gives Q4_1, Q5_1, Q3_K and the IQ4s affine layouts that decode with max
    diff 0.0 (float32 scales) and leaves Q2_K float; the model built so computes the float path's logits."""
    with gguf.read(lowbit_file) as f:
        table = transcode.plan(f)
        for name, p in table.items():
            if p.ggml_type in NATIVE:
                assert p.bits == NATIVE[p.ggml_type], (name, p)
                if p.bits:
                    assert transcode.transcode_error(f, name) == 0.0, name
        native = load_model(f, mx.float32, quantized=True, scale_dtype=mx.float32)
        expanded = load_model(f, mx.float32)
    modules = dict(native.named_modules())
    for name, p in table.items():
        if p.ggml_type in NATIVE:
            layer = modules[gguf_to_mlx_name(name).rsplit(".", 1)[0]]
            held = (type(layer).__name__.startswith("Quantized"), getattr(layer, "bits", None))
            assert held == ((True, p.bits) if p.bits else (False, None)), (name, p)
    ours, ref = logits(native, IDS), logits(expanded, IDS)
    assert np.abs(ours - ref).max() <= 1e-5 * np.abs(ref).max()


@pytest.mark.skipif(not llama_cpp_available(), reason="llama-cpp-python is not installed")
def test_logits_match_llama_cpp(lowbit_file, tmp_path):
    """llama.cpp on the file the `gguf` package dequantized to F32 gives our float path's logits to
    test_llama_cpp's ATOL. On the quantized file itself llama.cpp rounds the activations to 8 bits (Q8_K,
    Q8_0, Q8_1) in every dot product, which moves this random model's logits by a few percent (rms 4.3%
    measured here; 2.5% for an all-Q4_K and 5.8% for an all-Q6_K file of the same shape), so there the
    bound is 10% rms and the same top-1 tokens: a block read another way gives unrelated logits (~110%)."""
    from test_architectures import dequantized_copy
    from test_llama_cpp import ATOL, llama_logits, make_llama

    ours = logits(load(lowbit_file, mx.float32)[0], IDS)
    on_floats = llama_logits(make_llama(dequantized_copy(lowbit_file, tmp_path / "deq.gguf"), 64), IDS)
    diff = np.abs(ours - on_floats).max()
    assert diff <= ATOL, f"max |logit diff| against llama.cpp on F32 = {diff:.3e}"
    on_blocks = llama_logits(make_llama(lowbit_file, 64), IDS)
    rms = np.sqrt(np.mean((ours - on_blocks) ** 2) / np.mean(ours ** 2))
    top1 = np.mean(ours.argmax(-1) == on_blocks.argmax(-1))
    assert rms <= 0.1 and top1 >= 0.9, f"against llama.cpp on the blocks: rms relative diff {rms:.3f}, top-1 {top1:.2f}"
