"""GGML blocks as MLX affine quantization: each mapping's exactness against llama.cpp's `gguf`
package and kquants, the module swap, and the quantized decoder against llama.cpp itself."""

from __future__ import annotations

import logging

import gguf as gguf_py
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import write_random_llama
from gguf.quants import dequantize as oracle
from numpy_reference import forward as np_forward
from numpy_reference import load as np_load

from ref_impl.engine import random, transcode
from ref_impl.engine.checkpoint import load, load_model
from ref_impl.engine.compose import generate
from ref_impl.engine.generate import Sampler
from ref_impl.engine.model import ModelArgs
from ref_impl.engine.tokenizer import Tokenizer
from ref_impl.formats import ggml, gguf, kquants

TOKENS = [3, 17, 42, 5, 96, 0, 11, 64, 23, 8, 50, 2]
EXACT = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K",   # codes re-packed, not re-rounded
         "Q3_K", "IQ4_NL", "IQ4_XS"]                                # exact integers as 8-bit codes
BITS = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_0": 8, "Q4_K": 4, "Q5_K": 5, "Q6_K": 8,
        "Q3_K": 8, "IQ4_NL": 8, "IQ4_XS": 8}


def mlx_dequantize(a: transcode.Affine, scale_dtype=mx.float32) -> np.ndarray:
    w = mx.dequantize(mx.array(a.weight), mx.array(a.scales).astype(scale_dtype),
                      mx.array(a.biases).astype(scale_dtype), group_size=a.group_size, bits=a.bits)
    return np.array(w.astype(mx.float32))


def random_tensor(type_name: str, rows=6, cols=512, seed=0) -> tuple[np.ndarray, transcode.Affine]:
    data = random.random_blocks(type_name, rows, cols, np.random.default_rng(seed))
    return data, transcode.transcode_tensor("w", ggml.GGMLType[type_name], data, (rows, cols))


# --- packing and exactness ---------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_pack_is_mlx_layout(bits):
    """Our packer and mx.quantize agree: MLX decodes our codes as the codes, and re-packing MLX's
    own codes (read back with scale 1, bias 0) reproduces its words."""
    q = np.random.default_rng(bits).integers(0, 2 ** bits, (3, 64)).astype(np.uint8)
    ones, zeros = mx.ones((3, 2)), mx.zeros((3, 2))
    packed = transcode.pack(q, bits)
    assert packed.dtype == np.uint32 and packed.shape == (3, 64 * bits // 32)
    assert np.array_equal(np.array(mx.dequantize(mx.array(packed), ones, zeros, group_size=32, bits=bits)), q)
    wq, _, _ = mx.quantize(mx.random.normal((3, 64), key=mx.random.key(bits)), group_size=32, bits=bits)
    codes = np.array(mx.dequantize(wq, ones, zeros, group_size=32, bits=bits)).astype(np.uint8)
    assert np.array_equal(transcode.pack(codes, bits), np.array(wq))


@pytest.mark.parametrize("name", EXACT)
def test_exact_with_float32_scales(name):
    """Re-packed types decode bit for bit as llama.cpp's gguf package decodes them: max diff 0.0."""
    data, a = random_tensor(name)
    ref = oracle(data, gguf_py.GGMLQuantizationType[name])
    assert a.bits == BITS[name] and a.group_size == 32 and a.scales.shape == (6, 512 // 32)
    assert a.weight.shape == (6, 512 * a.bits // 32)
    assert np.abs(mlx_dequantize(a) - ref).max() == 0.0
    assert np.array_equal(mlx_dequantize(a), gguf.DEQUANTIZE[name](data))


@pytest.mark.parametrize("name", EXACT)
def test_float16_scales_error(name):
    """float16 scales cost at most float16 rounding of d*sc, dmin*m and the result: ~2^-10 relative."""
    data, a = random_tensor(name)
    ref = oracle(data, gguf_py.GGMLQuantizationType[name])
    err = np.abs(mlx_dequantize(a, mx.float16) - ref).max()
    assert err <= 2 ** -9 * np.abs(ref).max()


def q6_k_with_scales(s_a: np.ndarray, s_b: np.ndarray, rng) -> np.ndarray:
    """Random Q6_K blocks (n, 210) whose groups of 32 have sub-block scales (s_a, s_b)."""
    data = random.random_blocks("Q6_K", len(s_a), 256, rng).reshape(-1, 210)
    s = np.stack([np.broadcast_to(s_a[:, None], (len(s_a), 8)),
                  np.broadcast_to(s_b[:, None], (len(s_a), 8))], axis=2).reshape(-1, 16)
    data[:, 192:208] = s.astype(np.int8).view(np.uint8)
    return data


def test_q6_k_requantized_within_half_a_step():
    """Q6_K -> 8-bit g32 moves each value by at most half the MLX step (its scale), and groups whose
    two 16-value scales are equal, or multiples of one another, come back exact."""
    rng = np.random.default_rng(0)
    data, a = random_tensor("Q6_K", rows=8, cols=1024)
    ref = oracle(data, gguf_py.GGMLQuantizationType.Q6_K)
    err = np.abs(mlx_dequantize(a) - ref).reshape(8, -1, 32)
    assert (err <= a.scales[:, :, None] * 0.5001).all() and err.max() > 0   # ties, float rounding
    s_a = rng.integers(-127, 128, 64)
    for s_b in (s_a, -s_a, s_a * np.where(np.abs(s_a) < 64, 2, 1)):   # equal, opposite, double
        data = q6_k_with_scales(s_a, s_b, rng)
        a = transcode.transcode_tensor("w", ggml.GGMLType.Q6_K, data, (64, 256))
        assert np.abs(mlx_dequantize(a) - kquants.dequantize_q6_k(data)).max() == 0.0


def test_llama_q4_k_m_tensors_exact(llama_q4_k_m):
    """llama.cpp's own Q4_K_M: Q4_K, Q5_0 and Q8_0 tensors are exact with float32 scales; Q6_K
    (re-quantized) and float16 scales stay within the bounds the module docstring states."""
    worst = {}
    with gguf.read(llama_q4_k_m) as f:
        for name, info in f.tensors.items():
            if info.type.name == "F32":
                continue
            amax = float(np.abs(f.dequantize(name)).max())
            e32, e16 = (transcode.transcode_error(f, name, dt) for dt in (mx.float32, mx.float16))
            w = worst.setdefault(info.type.name, [0.0, 0.0, 0.0])
            worst[info.type.name] = [max(w[0], e32), max(w[1], e16), max(w[2], amax)]
    print("\nmax |MLX - kquants| per type (float32 scales, float16 scales, max|w|):", worst)
    assert set(worst) == {"Q4_K", "Q5_0", "Q6_K", "Q8_0"}
    for t in ("Q4_K", "Q5_0", "Q8_0"):
        assert worst[t][0] == 0.0
        assert 0 < worst[t][1] <= 2 ** -8 * worst[t][2]   # float16: ~2^-11 of |d sc q| and |dmin m|, which cancel
    assert 0 < worst["Q6_K"][0] <= 2e-3 and worst["Q6_K"][1] <= 2e-3   # measured 1.03e-3, 1.09e-3


# --- the model ---------------------------------------------------------------------------------------

def layer_types(model) -> dict[str, tuple[str, int | None]]:
    return {name: (type(m).__name__, getattr(m, "bits", None)) for name, m in model.named_modules()
            if isinstance(m, (nn.Linear, nn.Embedding, nn.QuantizedLinear, nn.QuantizedEmbedding))}


def test_module_swap_follows_the_file(llama_q4_k_m):
    """Every matrix becomes the quantized layer its GGML type maps to (a Q4_K_M file mixes 4, 5 and
    8 bits); norms stay float in the model dtype."""
    with gguf.read(llama_q4_k_m) as f:
        model = load_model(f, mx.float32, quantized=True)
        table = transcode.plan(f)
        types = {n: i.type.name for n, i in f.tensors.items()}
    layers = layer_types(model)
    assert layers["embed_tokens"] == ("QuantizedEmbedding", 8)         # Q8_0: rows of 384
    assert model.args.tie_word_embeddings and "lm_head" not in layers
    for i in range(model.args.num_hidden_layers):
        for gname, path in [("attn_q", "self_attn.q_proj"), ("attn_v", "self_attn.v_proj"),
                            ("ffn_down", "mlp.down_proj"), ("ffn_up", "mlp.up_proj")]:
            t = types[f"blk.{i}.{gname}.weight"]
            assert layers[f"layers.{i}.{path}"] == ("QuantizedLinear", BITS[t])
            assert model.layers[i].mlp.down_proj.group_size == 32
        assert model.layers[i].input_layernorm.weight.dtype == mx.float32
    assert table["blk.0.attn_norm.weight"].bits is None and table["blk.0.ffn_down.weight"].bits == 4


def test_quantized_decoder_agrees_with_llama_cpp(llama_q4_k_m):
    """The quantized decoder (no float expansion) picks llama.cpp's top-1 token at >= 95% of the
    positions of held-out text. Logits differ by more than float error: llama.cpp rounds the
    activations to 8 bits in its dot products, and Q6_K is re-quantized here."""
    from test_llama_cpp import SNIPPETS, llama_logits, make_llama

    model, tok = load(llama_q4_k_m, mx.float32, quantized=True)
    ids = tok.encode(SNIPPETS[1][1], bos=True)[:256]
    ours = np.array(model(mx.array([ids]))[0])
    theirs = llama_logits(make_llama(llama_q4_k_m, n_ctx=512), ids)
    agree = float(np.mean(ours.argmax(-1) == theirs.argmax(-1)))
    diff = float(np.abs(ours - theirs).max())
    print(f"\nquantized vs llama.cpp on {len(ids)} tokens: top-1 agreement {agree:.3f}, max |logit diff| {diff:.3f}")
    assert agree >= 0.95 and diff < 1.0, (agree, diff)          # measured 0.984, 0.295


def test_quantized_and_dequantized_paths_agree(llama_q4_k_m):
    """Both paths run the same weights except Q6_K's re-quantization: logits close, same argmax."""
    model_q, tok = load(llama_q4_k_m, mx.float32, quantized=True)
    model_f, _ = load(llama_q4_k_m, mx.float32)
    ids = mx.array([tok.encode("import os\nimport sys\n\n\ndef main(argv):\n    parser = ", bos=True)])
    a, b = np.array(model_q(ids)[0]), np.array(model_f(ids)[0])
    assert np.abs(a - b).max() < 0.1 and np.mean(a.argmax(-1) == b.argmax(-1)) >= 0.9


@pytest.mark.parametrize("weight_type,tied", [("Q4_0", True), ("Q8_0", False), ("Q5_0", True), ("Q4_1", False)])
def test_exact_types_match_numpy_forward(tmp_path, weight_type, tied):
    """Q4_0/Q8_0 files (llama.cpp's Q4_K_M has no Q4_0): the quantized decoder, tied embedding
    through QuantizedEmbedding.as_linear or a separate lm_head, matches the float64 numpy forward."""
    path = write_random_llama(tmp_path / "m.gguf", weight_type=weight_type, tied=tied)
    with gguf.read(path) as f:
        model = load_model(f, mx.float32, quantized=True)
    layers = layer_types(model)
    assert layers["embed_tokens"] == ("QuantizedEmbedding", BITS[weight_type])
    assert layers.get("lm_head") == (None if tied else ("QuantizedLinear", BITS[weight_type]))
    ours = np.array(model(mx.array([TOKENS]))[0])
    assert np.abs(ours - np_forward(*np_load(path), TOKENS)).max() <= 1e-4


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_cached_decode_and_dtype(tmp_path, dtype):
    """Through the KV cache the quantized model gives its full-forward logits, in the model dtype
    (scales are stored in dtype, so float16 activations stay float16)."""
    path = write_random_llama(tmp_path / "m.gguf", weight_type="Q8_0")
    with gguf.read(path) as f:
        model = load_model(f, dtype, quantized=True)
    full = model(mx.array([TOKENS]))
    assert full.dtype == dtype and model.embed_tokens.scales.dtype == dtype
    cache = model.make_cache(len(TOKENS))
    parts = [model(mx.array([TOKENS[:5]]), cache)] + [model(mx.array([[t]]), cache) for t in TOKENS[5:]]
    tol = 1e-4 if dtype == mx.float32 else 2e-2
    assert np.abs(np.array(mx.concatenate(parts, axis=1).astype(mx.float32))
                  - np.array(full.astype(mx.float32))).max() <= tol


def test_generate_runs_quantized(llama_q4_k_m):
    model, tok = load(llama_q4_k_m, mx.float32, quantized=True)
    out = generate(model, tok, "def ", max_tokens=8, sampler=Sampler(temperature=0.0), stop_at_eos=False)
    assert len(out.tokens) == 8 and isinstance(tok, Tokenizer)


def test_write_random_model(tmp_path):
    """Random Llama-shaped files build from raw blocks, typed as llama.cpp types a Q4_K_M (or F16)
    file, and load."""
    args = ModelArgs(300, 256, 8, 512, 4, 2, max_position_embeddings=64, tie_word_embeddings=False)
    for file_type in ("Q4_K_M", "F16"):
        path = random.write_random_model(tmp_path / f"{file_type}.gguf", args, file_type)
        with gguf.read(path) as f:
            types = {n: i.type.name for n, i in f.tensors.items()}
            model = load_model(f, mx.float32, quantized=True)
        logits = model(mx.array([TOKENS]))
        assert logits.shape == (1, len(TOKENS), 300) and np.isfinite(np.array(logits)).all()
        if file_type == "F16":
            assert set(types.values()) == {"F16", "F32"}
            assert layer_types(model)["lm_head"] == ("Linear", None)
        else:   # use_more_bits(i, 8): layers 0, 3, 6, 7
            assert types["output.weight"] == "Q6_K" and types["blk.1.attn_q.weight"] == "Q4_K"
            assert [types[f"blk.{i}.ffn_down.weight"] for i in range(8)] == \
                ["Q6_K", "Q4_K", "Q4_K", "Q6_K", "Q4_K", "Q4_K", "Q6_K", "Q6_K"]
            assert np.abs(kquants.dequantize_q4_k(random.random_blocks(
                "Q4_K", 4, 256, np.random.default_rng(0)))).max() < 2


# --- the table and bad input -------------------------------------------------------------------------

def test_plan_names_every_representation(tmp_path):
    """plan() reads no data: float types and vectors stay float, mapped types say their bits, and a
    type with no mapping (Q2_K: 16-value sub-blocks with scales and mins) says it is expanded to float."""
    rng = np.random.default_rng(0)
    gguf.write(tmp_path / "m.gguf", {"general.architecture": "llama"}, {
        "a.weight": gguf.TensorData(ggml.GGMLType.Q2_K, (4, 256), rng.integers(0, 256, (4, 84), np.uint8)),
        "b.weight": gguf.TensorData(ggml.GGMLType.Q4_K, (4, 256), random.random_blocks("Q4_K", 4, 256, rng)),
        "c.weight": np.zeros((4, 32), np.float16), "norm.weight": np.ones(32, np.float32)})
    with gguf.read(tmp_path / "m.gguf") as f:
        table = transcode.plan(f)
    assert table["a.weight"].representation == "float" and "no MLX affine mapping for Q2_K" in table["a.weight"].reason
    assert table["b.weight"].representation == "affine 4-bit g32"
    assert table["c.weight"].bits is None and "F16 is a float type" in table["c.weight"].reason
    assert table["norm.weight"].bits is None
    b = table["b.weight"]
    assert b.bits_per_weight() == 5.0 and b.bits_per_weight(scale_bits=32) == 6.0


def test_type_without_mapping_falls_back_to_float(tmp_path, monkeypatch, caplog):
    """A type with no affine mapping loads as floats (here Q8_0, its mapping removed), and the
    log says which types were expanded."""
    path = write_random_llama(tmp_path / "m.gguf", weight_type="Q8_0")
    monkeypatch.delitem(transcode.REPACK, ggml.GGMLType.Q8_0)
    with gguf.read(path) as f, caplog.at_level(logging.WARNING, logger="ref_impl.engine.transcode"):
        model = load_model(f, mx.float32, quantized=True)
    assert "no MLX affine mapping for Q8_0" in caplog.text
    assert layer_types(model)["layers.0.mlp.up_proj"] == ("Linear", None)
    assert np.abs(np.array(model(mx.array([TOKENS]))[0]) - np_forward(*np_load(path), TOKENS)).max() <= 1e-4


def test_bad_input_raises_naming_the_tensor():
    with pytest.raises(ValueError, match=r"tensor 'blk.0.attn_q.weight': row length 40 is not a multiple"):
        transcode.transcode_tensor("blk.0.attn_q.weight", ggml.GGMLType.Q8_0, np.zeros((2, 34), np.uint8), (2, 40))
    with pytest.raises(ValueError, match=r"tensor 'x': Q2_K has no MLX affine mapping"):
        transcode.transcode_tensor("x", ggml.GGMLType.Q2_K, np.zeros((2, 84), np.uint8), (2, 256))
    with pytest.raises(ValueError, match=r"tensor 'x': Q4_K data of shape \(2, 144\) does not hold a \(2, 512\)"):
        transcode.transcode_tensor("x", ggml.GGMLType.Q4_K, np.zeros((2, 144), np.uint8), (2, 512))
