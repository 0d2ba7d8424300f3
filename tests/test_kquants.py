"""Block formats: dequantization bit-exact with llama.cpp's `gguf` package (Q8_0 quantization is
tested with the GGUF container in test_gguf.py)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import quants

from ref_impl import kquants

from conftest import random_kquant_blocks

TYPES = ["Q4_0", "Q5_0", "Q8_0", "Q4_K", "Q6_K"]


def oracle(data: np.ndarray, name: str) -> np.ndarray:
    return quants.dequantize(data, gguf.GGMLQuantizationType[name])


def block_bytes(name: str) -> int:
    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]][1]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")   # inf scales times zero, in the oracle too
@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("shape", [(1, 1), (3, 2), (2, 2, 3)])   # (..., blocks per row)
def test_dequantize_equals_llama_cpp_on_any_bytes(name, shape):
    """Every byte pattern, inf and nan scales included, decodes exactly as gguf-py decodes it."""
    rng = np.random.default_rng(hash((name, shape)) % 2**32)
    data = rng.integers(0, 256, (*shape[:-1], shape[-1] * block_bytes(name)), dtype=np.uint8)
    ours, ref = kquants.DEQUANTIZE[name](data), oracle(data, name)
    assert ours.dtype == np.float32 and ours.shape == ref.shape
    assert np.array_equal(ours, ref, equal_nan=True)


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K"])
def test_dequantize_plausible_weights(name):
    data = random_kquant_blocks(name, 8, 512, np.random.default_rng(0))
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


@pytest.fixture(scope="module")
def q4_k_m(shipped_model, tmp_path_factory):
    """The shipped model quantized to Q4_K_M by llama.cpp itself (Q4_K, Q6_K, and Q5_0/Q8_0 where
    rows of 384 are not a multiple of 256)."""
    import ctypes

    import llama_cpp

    out = tmp_path_factory.mktemp("q4km") / "stdlib-10m-Q4_K_M.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M, 1
    assert llama_cpp.llama_model_quantize(str(shipped_model).encode(), str(out).encode(), ctypes.byref(params)) == 0
    return out


def test_decoder_runs_a_llama_cpp_q4_k_m_file(q4_k_m):
    """Expanded to floats, a llama.cpp Q4_K_M file decodes as llama.cpp decodes it: the same top-1
    token at >= 95% of the positions of held-out text (llama.cpp also rounds the activations to 8
    bits in its dot products, so logits differ by more than float error)."""
    import sysconfig

    import llama_cpp
    import mlx.core as mx

    from ref_impl import gguf as our_gguf
    from ref_impl.model import load

    with our_gguf.read(q4_k_m) as f:
        types = {t.type.name for t in f.tensors.values()}
    assert {"Q4_K", "Q6_K", "Q5_0"} <= types
    model, tok = load(q4_k_m, mx.float32)
    text = open(sysconfig.get_paths()["stdlib"] + "/argparse.py", encoding="utf-8").read()[20000:23000]
    ids = tok.encode(text, bos=True)[:256]
    ours = np.array(model(mx.array([ids]))[0])
    llm = llama_cpp.Llama(str(q4_k_m), n_ctx=512, logits_all=True, n_threads=1, n_threads_batch=1,
                          type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32, verbose=False)
    llm.eval(ids)
    theirs = np.array(llm.scores[: len(ids)])
    agree = np.mean(ours.argmax(-1) == theirs.argmax(-1))
    assert agree >= 0.95, f"top-1 agreement {agree:.3f}, max logit diff {np.abs(ours - theirs).max():.3f}"
