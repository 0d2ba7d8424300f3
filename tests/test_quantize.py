"""Whole-model quantization against llama.cpp's own `llama_model_quantize` (llama-cpp-python).

The oracle is llama.cpp's libllama, whose quantizers live in libggml-base (built for baseline
x86-64, without fused multiply-add: see tests/ggml_oracle.py). Every tensor must get the type
llama.cpp picks and the very same bytes.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from ref_impl.engine.checkpoint import load_model, simulate
from ref_impl.formats import gguf, kquants, quantize
from tests.conftest import write_random_llama


@pytest.fixture(scope="module")
def models(shipped_model, tmp_path_factory):
    """The shipped model (rows of 384: K-quants fall back) and random ones whose rows fit 256-blocks:
    8 tied layers, and 16 untied layers (so use_more_bits picks a non-trivial pattern)."""
    d = tmp_path_factory.mktemp("quantize")
    return {"shipped": shipped_model,
            "tied-8": write_random_llama(d / "tied8.gguf", vocab=300, dim=256, layers=8, heads=4,
                                         kv_heads=2, ff=512, seed=1),
            "untied-16": write_random_llama(d / "untied16.gguf", vocab=256, dim=256, layers=16, heads=4,
                                            kv_heads=1, ff=256, tied=False, seed=2)}


@pytest.mark.parametrize("model", ["shipped", "tied-8", "untied-16"])
@pytest.mark.parametrize("file_type", ["F16", "Q8_0", "Q4_0", "Q6_K", "Q4_K_M", "Q4_K",
                                       "Q3_K_L", "Q3_K_M", "Q3_K_S", "Q2_K"])
def test_file_matches_llama_cpp(models, tmp_path, model, file_type):
    theirs, ours = tmp_path / "llama.cpp.gguf", tmp_path / "ours.gguf"
    quantize.with_llama_cpp(models[model], theirs, file_type)
    types = quantize.quantize_file(models[model], ours, file_type)
    with gguf.read(theirs) as t, gguf.read(ours) as o:
        assert list(o.tensors) == list(t.tensors)
        assert {n: i.type.name for n, i in t.tensors.items()} == types
        assert {n: i.type.name for n, i in o.tensors.items()} == types
        for name in t.tensors:
            assert o.tensors[name].shape == t.tensors[name].shape, name
            assert np.array_equal(o.array(name).view(np.uint8), t.array(name).view(np.uint8)), name
        for key in ("general.file_type", "general.quantization_version"):
            assert o.fields[key] == t.fields[key], key


def test_q4_k_m_mixture_on_the_shipped_shapes(models):
    """Rows of 384 values hold no whole 256-block: the rule's Q4_K becomes Q5_0, its Q6_K Q8_0, and the
    tied embedding (the output matrix) goes straight to Q8_0; only ffn_down (rows of 1024) stays a K-quant."""
    with gguf.read(models["shipped"]) as f:
        types = quantize.tensor_types(f.tensors, "Q4_K_M")
    n = 6
    more = [i for i in range(n) if quantize.use_more_bits(i, n)]
    assert more == [2, 5]                 # n/8 = 0, 7n/8 = 5: layer 5, and (i - 0) % 3 == 2
    assert types["token_embd.weight"] == "Q8_0"
    for i in range(n):
        assert types[f"blk.{i}.ffn_down.weight"] == ("Q6_K" if i in more else "Q4_K")
        assert types[f"blk.{i}.attn_v.weight"] == ("Q8_0" if i in more else "Q5_0")
        for m in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            assert types[f"blk.{i}.{m}.weight"] == "Q5_0"
        assert types[f"blk.{i}.attn_norm.weight"] == "F32"


# Written out by hand from llama-quant.cpp's rules: model -> file type -> {kind: type per layer}
# (rows of 256 fit the K-quants; the shipped model's rows of 384 fall back, its ffn_down rows of 1024 do not)
LOW_BIT_EXPECTED = {
    ("untied-16", "Q3_K_M"): {"attn_v": ["Q5_K"] * 2 + ["Q4_K"] * 14, "ffn_down": ["Q5_K"] + ["Q4_K"] * 15,
                              "attn_output": ["Q4_K"] * 16, "attn_q": ["Q3_K"] * 16, "ffn_up": ["Q3_K"] * 16,
                              "token_embd": "Q3_K", "output": "Q6_K"},
    ("untied-16", "Q2_K"): {"attn_v": ["Q4_K"] * 16, "ffn_down": ["Q3_K"] * 16, "attn_output": ["Q3_K"] * 16,
                            "attn_k": ["Q2_K"] * 16, "ffn_gate": ["Q2_K"] * 16, "token_embd": "Q2_K", "output": "Q6_K"},
    ("tied-8", "Q2_K"): {"attn_v": ["Q3_K"] * 8, "ffn_down": ["Q3_K"] * 8, "attn_q": ["Q2_K"] * 8,
                         "token_embd": "Q6_K"},
    ("tied-8", "Q3_K_L"): {"attn_v": ["Q5_K"] * 8, "ffn_down": ["Q5_K"] * 8, "attn_output": ["Q5_K"] * 8,
                           "ffn_up": ["Q3_K"] * 8, "token_embd": "Q6_K"},
    ("shipped", "Q3_K_M"): {"attn_v": ["Q5_1"] * 2 + ["Q5_0"] * 4, "ffn_down": ["Q4_K"] * 6,
                            "attn_output": ["Q5_0"] * 6, "attn_q": ["Q4_0"] * 6, "token_embd": "Q8_0"},
    ("shipped", "Q2_K"): {"attn_v": ["Q4_0"] * 6, "ffn_down": ["Q3_K"] * 6, "attn_output": ["Q4_0"] * 6,
                          "ffn_up": ["Q4_0"] * 6, "token_embd": "Q8_0"},
}


@pytest.mark.parametrize("model, file_type", list(LOW_BIT_EXPECTED))
def test_low_bit_mixtures(models, model, file_type):
    """untied-16 has 4 query heads per key head (Q2_K's attn_v: Q4_K), tied-8 and the shipped model 2 and 3 (Q3_K)."""
    with gguf.read(models[model]) as f:
        types = quantize.tensor_types(f.tensors, file_type)
    for kind, expected in LOW_BIT_EXPECTED[model, file_type].items():
        if isinstance(expected, str):
            assert types[f"{kind}.weight"] == expected, kind
        else:
            assert [types[f"blk.{i}.{kind}.weight"] for i in range(len(expected))] == expected, kind
    assert {t for n, t in types.items() if n.endswith("_norm.weight")} == {"F32"}


@pytest.mark.parametrize("n, expected", [(8, [0, 3, 6, 7]), (16, [0, 1, 4, 7, 10, 13, 14, 15]),
                                         (32, [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31])])
def test_use_more_bits(n, expected):
    """Written out by hand from the rule: first eighth, last eighth, every third layer from n/8 + 2."""
    assert [i for i in range(n) if quantize.use_more_bits(i, n)] == expected


def test_row_not_a_multiple_of_32_becomes_f16(tmp_path, capfd):
    """Rows of 40 hold no 32-block either: F16, as llama.cpp does (checked against it too). llama.cpp
    warns on the C stderr for every tensor it falls back on: none of it reaches ours (a page's output)."""
    path = write_random_llama(tmp_path / "odd.gguf", vocab=50, dim=64, heads=4, kv_heads=2, ff=40)
    with gguf.read(path) as f:
        types = quantize.tensor_types(f.tensors, "Q4_K_M")
    assert types["blk.0.ffn_down.weight"] == "F16"      # rows of 40
    assert types["blk.0.ffn_gate.weight"] == "Q5_0"     # rows of 64: 32-blocks fit, 256-blocks do not
    capfd.readouterr()
    assert quantize.with_llama_cpp(path, tmp_path / "theirs.gguf", "Q4_K_M") == types
    assert capfd.readouterr().err == ""


def test_bad_requests(models, tmp_path):
    with pytest.raises(ValueError, match="unknown file type 'Q3_K'"):
        quantize.quantize_file(models["shipped"], tmp_path / "x.gguf", "Q3_K")
    with pytest.raises(ValueError, match="unknown file type 'Q3_K'"):
        quantize.with_llama_cpp(models["shipped"], tmp_path / "x.gguf", "Q3_K")
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + bytes(60))    # llama.cpp refuses it: its reason is kept
    with pytest.raises(RuntimeError, match="could not quantize .*bad.gguf to Q4_K_M: .+"):
        quantize.with_llama_cpp(tmp_path / "bad.gguf", tmp_path / "x.gguf", "Q4_K_M")
    quantize.quantize_file(models["tied-8"], tmp_path / "q8.gguf", "Q8_0")
    with pytest.raises(ValueError, match="already Q8_0; quantize from an F32, F16 or BF16 file"):
        quantize.quantize_file(tmp_path / "q8.gguf", tmp_path / "q4.gguf", "Q4_K_M")
    with pytest.raises(gguf.GGUFError):
        quantize.quantize_file(tmp_path / "missing.gguf", tmp_path / "q4.gguf", "Q4_K_M")


def test_roundtrip_across_rows_is_the_blockwise_round_trip():
    """Rows of 384 hold 1.5 super-blocks: the simulation quantizes the flat run of 256-value blocks."""
    x = np.random.default_rng(0).standard_normal((4, 384)).astype(np.float32)
    flat = kquants.dequantize_q4_k(kquants.quantize_q4_k(x.reshape(6, 256))).reshape(4, 384)
    assert np.array_equal(quantize.roundtrip(x, "Q4_K"), flat)
    y = x[:, :256]                                   # whole blocks per row: the real format
    assert np.array_equal(quantize.roundtrip(y, "Q4_K"), kquants.dequantize_q4_k(kquants.quantize_q4_k(y)))
    with pytest.raises(ValueError, match="do not fill whole Q4_K blocks of 256"):
        quantize.roundtrip(x[:, :100], "Q4_K")


def test_relative_error_orders_the_formats():
    """More bits, less error; on Gaussian weights Q4_0 and Q4_K at 4.5 bits differ, Q8_0 is ~100x better."""
    x = np.random.default_rng(1).standard_normal((64, 512)).astype(np.float32)
    err = {t: quantize.relative_error(x, t) for t in ("Q8_0", "Q6_K", "Q5_0", "Q4_K", "Q4_0", "Q3_K", "Q2_K")}
    assert err["Q8_0"] < err["Q6_K"] < err["Q5_0"] < err["Q4_K"] < err["Q4_0"] < err["Q3_K"] < err["Q2_K"]
    assert err["Q8_0"] < err["Q4_0"] / 10
    assert quantize.relative_error(np.full((2, 32), 127, np.float32), "Q8_0") == 0.0   # d = 1, q = 127: exact


def test_simulate_changes_only_the_selected_matrices(models):
    path = models["tied-8"]
    with gguf.read(path) as f:
        base = load_model(f, mx.float32)
    sim = simulate(path, "Q4_0", lambda n: "ffn_down" in n)
    with gguf.read(path) as f:
        w = f.array("blk.3.ffn_down.weight")
    assert np.array_equal(np.array(sim.layers[3].mlp.down_proj.weight), quantize.roundtrip(w, "Q4_0"))
    assert np.array_equal(np.array(sim.layers[3].mlp.up_proj.weight), np.array(base.layers[3].mlp.up_proj.weight))


OTHER_ARCHITECTURES = {   # llama.cpp's rules for a model of 8 experts, Phi-3's fused q-k-v (an attn_v), Gemma's norms
    "qwen3moe": dict(architecture="qwen3moe", num_experts=8, experts_per_token=2, expert_intermediate_size=256,
                     head_dim=64),
    "gemma3": dict(architecture="gemma3", sliding_window=8, sliding_layers=(True, False), rope_theta_local=1e4,
                   head_dim=64),
    "phi3": dict(architecture="phi3", fused_qkv=True, tie_word_embeddings=False, num_key_value_heads=4),
}


@pytest.mark.parametrize("file_type", ["Q4_K_M", "Q3_K_M", "Q2_K"])
@pytest.mark.parametrize("arch", list(OTHER_ARCHITECTURES))
def test_other_architectures_match_llama_cpp(tmp_path, arch, file_type):
    """Random files of the new architectures, whose rows fill whole super-blocks: every tensor's type and bytes
    as llama.cpp's quantizer writes them (the 8-expert rules, the router left float, attn_qkv as an attn_v)."""
    from ref_impl.engine.model import ModelArgs
    from ref_impl.engine.random import write_random_model

    kw = {"num_key_value_heads": 2, **OTHER_ARCHITECTURES[arch]}
    args = ModelArgs(512, 256, 2, 512, 4, max_position_embeddings=256, **kw)
    src = write_random_model(tmp_path / f"{arch}.gguf", args, "F32", seed=0)
    theirs, ours = tmp_path / "llama.cpp.gguf", tmp_path / "ours.gguf"
    quantize.with_llama_cpp(src, theirs, file_type)
    types = quantize.quantize_file(src, ours, file_type)
    with gguf.read(theirs) as t, gguf.read(ours) as o:
        assert {n: i.type.name for n, i in t.tensors.items()} == types
        for name in t.tensors:
            assert np.array_equal(o.array(name).view(np.uint8), t.array(name).view(np.uint8)), name
    if arch == "qwen3moe":
        assert types["blk.0.ffn_gate_inp.weight"] == "F32" and types["blk.0.attn_k.weight"] == "Q8_0"
