"""The mixture-of-experts MLP (engine/moe.py) against a plain numpy float64 loop over tokens and chosen
experts written here from llama.cpp's `build_moe_ffn` (softmax over all experts, top n_used, weights
renormalised, SwiGLU experts, weighted sum); quantized experts against the same loop on the weights
llama.cpp's `gguf` package dequantizes; the gathered matmuls against a loop over experts."""

from __future__ import annotations

import gguf as gguf_py
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from ref_impl.engine import moe, transcode
from ref_impl.engine.moe import MoE, QuantizedExperts
from ref_impl.engine.random import random_blocks
from ref_impl.formats import gguf, kquants
from ref_impl.formats.ggml import GGMLType

D, FF = 64, 32          # hidden size, expert hidden size
SHAPES = [(8, 2), (16, 4)]   # (n_experts, n_used): Mixtral-like, and more experts as qwen3moe has


def random_weights(n_experts: int, seed: int = 0) -> dict[str, np.ndarray]:
    """float32 router (E, D), gate and up (E, FF, D), down (E, D, FF), as GGUF stores them."""
    rng = np.random.default_rng(seed)
    return {"router": rng.standard_normal((n_experts, D)).astype(np.float32),
            "gate_exps": (rng.standard_normal((n_experts, FF, D)) / np.sqrt(D)).astype(np.float32),
            "up_exps": (rng.standard_normal((n_experts, FF, D)) / np.sqrt(D)).astype(np.float32),
            "down_exps": (rng.standard_normal((n_experts, D, FF)) / np.sqrt(FF)).astype(np.float32)}


def build(w: dict[str, np.ndarray], n_used: int, dtype=mx.float32) -> MoE:
    m = MoE(D, FF, len(w["router"]), n_used)
    m.load_weights([(f"{k}.weight", mx.array(v).astype(dtype)) for k, v in w.items()])
    return m


def choose(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's gating for one token in float64: softmax, the k most probable (ties: lower index),
    their probabilities renormalised to sum 1."""
    p = np.exp(logits - logits.max())
    p /= p.sum()
    chosen = np.argsort(-p, kind="stable")[:k]
    return chosen, p[chosen] / p[chosen].sum()


def reference(x: np.ndarray, w: dict[str, np.ndarray], k: int) -> np.ndarray:
    """The MoE MLP of x (B, L, D) as a float64 loop over tokens and their chosen experts."""
    w = {name: a.astype(np.float64) for name, a in w.items()}
    rows = x.reshape(-1, D).astype(np.float64)
    out = np.zeros_like(rows)
    for t, xt in enumerate(rows):
        for e, we in zip(*choose(w["router"] @ xt, k)):
            g, u = w["gate_exps"][e] @ xt, w["up_exps"][e] @ xt
            out[t] += we * (w["down_exps"][e] @ (g / (1 + np.exp(-g)) * u))
    return out.reshape(x.shape)


def per_expert_loop(m: MoE, x: mx.array, matmul) -> np.ndarray:
    """The MoE MLP as a loop over experts, each on the tokens that chose it, with plain MLX matmuls:
    matmul(layer, e, rows) multiplies rows by expert e's matrix of `layer`."""
    rows = x.reshape(-1, D)
    logits = np.array((rows.astype(mx.float32) @ m.router.weight.astype(mx.float32).T), dtype=np.float64)
    k = m.n_used
    routes = [choose(lg, k) for lg in logits]
    out = mx.zeros(rows.shape, dtype=mx.float32)
    for e in range(m.router.weight.shape[0]):
        tokens = [t for t, (chosen, _) in enumerate(routes) if e in chosen]
        if not tokens:
            continue
        weight = mx.array([float(routes[t][1][list(routes[t][0]).index(e)]) for t in tokens])[:, None]
        xs = rows[mx.array(tokens)]
        h = nn.silu(matmul(m.gate_exps, e, xs)) * matmul(m.up_exps, e, xs)
        out = out.at[mx.array(tokens)].add(weight * matmul(m.down_exps, e, h))
    return np.array(out).reshape(x.shape)


def float_matmul(layer, e, rows):
    return rows @ layer.weight[e].T


def quantized_matmul(layer, e, rows):
    return mx.quantized_matmul(rows, layer.weight[e], layer.scales[e], layer.biases[e], transpose=True,
                               group_size=layer.group_size, bits=layer.bits)


def inputs(B: int, L: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((B, L, D)).astype(np.float32)


# --- float experts -------------------------------------------------------------------------------------

@pytest.mark.parametrize("n_experts,n_used", SHAPES)
@pytest.mark.parametrize("B,L", [(1, 1), (3, 1), (1, 37), (2, 37)])
def test_float32_matches_the_numpy_loop(n_experts, n_used, B, L):
    """Decode (L=1: unsorted gathers) and prefill (L=37: rows sorted by expert) give llama.cpp's MoE output."""
    assert (B * L * n_used >= moe.SORT_MIN_ROWS) == (L == 37)    # both paths are exercised
    w, x = random_weights(n_experts), inputs(B, L)
    out = build(w, n_used)(mx.array(x))
    assert out.shape == (B, L, D) and out.dtype == mx.float32
    np.testing.assert_allclose(np.array(out), reference(x, w, n_used), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("sort_min_rows", [0, 10 ** 9])
def test_gathered_matches_a_loop_over_experts(monkeypatch, sort_min_rows):
    """Sorted or not, the gathered matmuls compute what a loop over experts computes."""
    monkeypatch.setattr(moe, "SORT_MIN_ROWS", sort_min_rows)
    w, x = random_weights(16, seed=2), mx.array(inputs(2, 37, seed=3))
    m = build(w, 4)
    np.testing.assert_allclose(np.array(m(x)), per_expert_loop(m, x, float_matmul), rtol=1e-5, atol=1e-5)


def test_route_ties_go_to_the_lower_expert():
    """Experts 1, 2 and 4 have the same router row, so their probabilities are equal (integer inputs
    make every logit exact); two slots among three tied experts go to experts 1 and 2."""
    w = random_weights(6, seed=4)
    w["router"] = np.zeros((6, D), np.float32)
    w["router"][[1, 2, 4]] = 1.0
    w["router"][0, 0] = w["router"][3, 0] = w["router"][5, 0] = -1.0
    x = np.random.default_rng(5).integers(1, 4, (1, 9, D)).astype(np.float32)
    weights, chosen = moe.route(mx.array(x) @ mx.array(w["router"]).T, 2)
    assert np.array(chosen).tolist() == [[[1, 2]] * 9]
    assert np.array(weights).tolist() == [[[0.5, 0.5]] * 9]
    np.testing.assert_allclose(np.array(build(w, 2)(mx.array(x))), reference(x, w, 2), rtol=1e-4, atol=1e-4)


def quantize_experts(m: MoE, bits: int, dtype: mx.Dtype) -> dict[str, np.ndarray]:
    """Swap m's experts for QuantizedExperts made by mx.quantize (scales in dtype); return every weight as
    the model now holds it, in float32, for the numpy loop."""
    held = {"router": np.array(m.router.weight.astype(mx.float32))}
    for name in ("gate_exps", "up_exps", "down_exps"):
        w = getattr(m, name).weight
        n, out, n_in = w.shape
        q = QuantizedExperts(n, n_in, out, group_size=32, bits=bits)
        codes, scales, biases = mx.quantize(w.astype(mx.float32), group_size=32, bits=bits)
        q.load_weights([("weight", codes), ("scales", scales.astype(dtype)), ("biases", biases.astype(dtype))])
        setattr(m, name, q)
        held[name] = np.array(mx.dequantize(codes, q.scales, q.biases, group_size=32, bits=bits).astype(mx.float32))
    return held


def test_gating_is_float32_in_a_float16_model():
    """Expert 1's logit beats expert 0's by 2^-11, below float16's resolution at 2: float32 gating picks
    expert 1, as llama.cpp does; float16 gating would see a tie and pick expert 0. (Experts quantized:
    MLX's CPU gather_mm takes float32 only, its gather_qmm float16 too.)"""
    w = random_weights(4, seed=6)
    w["router"] = np.zeros((4, D), np.float32)
    w["router"][[0, 1]] = 0.0625
    w["router"][1, 0] += 2 ** -10                      # every value exact in float16
    m = build(w, 1, mx.float16)
    held = quantize_experts(m, 8, mx.float16)
    x = np.full((1, 1, D), 0.5, np.float32)
    out = m(mx.array(x, dtype=mx.float16))
    assert out.dtype == mx.float16
    expected = reference(x, held, 1)
    assert np.abs(expected - reference(x, held | {"router": held["router"][[1, 0, 2, 3]]}, 1)).max() > 0.1
    np.testing.assert_allclose(np.array(out.astype(mx.float32)), expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("L", [1, 37])
def test_float16_with_quantized_experts_matches_the_numpy_loop(L):
    """The GPU configuration: float16 activations, 4-bit experts with float16 scales."""
    m = build(random_weights(8, seed=7), 2, mx.float16)
    held = quantize_experts(m, 4, mx.float16)
    x = inputs(1, L, seed=8).astype(np.float16).astype(np.float32)
    out = m(mx.array(x, dtype=mx.float16))
    assert out.dtype == mx.float16
    np.testing.assert_allclose(np.array(out.astype(mx.float32)), reference(x, held, 2), rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(mx.default_device() != mx.gpu, reason="MLX's CPU gather_mm takes float32 only")
def test_float16_float_experts_match_the_numpy_loop():
    w = {name: a.astype(np.float16).astype(np.float32) for name, a in random_weights(8, seed=7).items()}
    x = inputs(1, 37, seed=8).astype(np.float16).astype(np.float32)
    out = build(w, 2, mx.float16)(mx.array(x, dtype=mx.float16))
    assert out.dtype == mx.float16
    np.testing.assert_allclose(np.array(out.astype(mx.float32)), reference(x, w, 2), rtol=2e-2, atol=2e-2)


# --- quantized experts ---------------------------------------------------------------------------------

QUANTIZE = {"Q8_0": kquants.quantize_q8_0, "Q4_0": kquants.quantize_q4_0}


@pytest.fixture(scope="module", params=["Q8_0", "Q4_0"])
def quantized_file(request, tmp_path_factory):
    """A GGUF holding one MoE layer, 16 experts: the router in F32, the experts quantized by kquants."""
    type_name = request.param
    w = random_weights(16, seed=9)
    tensors = {"blk.0.ffn_gate_inp.weight": w["router"]}
    for gguf_name, name in [("ffn_gate_exps", "gate_exps"), ("ffn_up_exps", "up_exps"), ("ffn_down_exps", "down_exps")]:
        tensors[f"blk.0.{gguf_name}.weight"] = gguf.TensorData(GGMLType[type_name], w[name].shape,
                                                               QUANTIZE[type_name](w[name]))
    path = tmp_path_factory.mktemp("moe") / f"moe-{type_name}.gguf"
    gguf.write(path, {"general.architecture": "qwen3moe"}, tensors)
    return type_name, gguf.read(path)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = MoE(D, FF, 16, 4)


NAMES = {"blk.0.ffn_gate_inp.weight": "mlp.router.weight", "blk.0.ffn_gate_exps.weight": "mlp.gate_exps.weight",
         "blk.0.ffn_up_exps.weight": "mlp.up_exps.weight", "blk.0.ffn_down_exps.weight": "mlp.down_exps.weight"}


def load_quantized(f: gguf.GGUFFile) -> Layer:
    layer = Layer()
    kept = transcode.swap_quantized(layer, f, NAMES, mx.float32)
    layer.load_weights([w for arrays in kept.values() for w in arrays]
                       + [("mlp.router.weight", mx.array(f.array("blk.0.ffn_gate_inp.weight")))])
    return layer


def oracle_weights(f: gguf.GGUFFile) -> dict[str, np.ndarray]:
    """Every tensor as llama.cpp's gguf package decodes it, by parameter name ("router", "gate_exps", ...)."""
    return {NAMES[name].split(".")[1]: gguf_py.quants.dequantize(
                f.array(name), gguf_py.GGMLQuantizationType(int(f.tensors[name].type))) for name in NAMES}


@pytest.mark.parametrize("B,L", [(1, 1), (1, 37)])
def test_quantized_experts_match_the_numpy_loop(quantized_file, B, L):
    """Experts loaded quantized from GGUF (swap_quantized) run as gather_qmm and give the MoE output of
    the weights llama.cpp's gguf package dequantizes."""
    type_name, f = quantized_file
    assert {transcode.plan(f)[n].bits for n in NAMES if "exps" in n} == {8 if type_name == "Q8_0" else 4}
    layer = load_quantized(f)
    assert all(isinstance(getattr(layer.mlp, p), QuantizedExperts) for p in ("gate_exps", "up_exps", "down_exps"))
    assert layer.mlp.gate_exps.weight.shape == (16, FF, D * layer.mlp.gate_exps.bits // 32)
    assert layer.mlp.down_exps.scales.shape == (16, D, FF // 32)
    x = inputs(B, L, seed=10)
    np.testing.assert_allclose(np.array(layer.mlp(mx.array(x))), reference(x, oracle_weights(f), 4),
                               rtol=1e-4, atol=1e-4)


def test_quantized_gathered_matches_a_loop_over_experts(quantized_file):
    layer = load_quantized(quantized_file[1])
    x = mx.array(inputs(2, 37, seed=11))
    np.testing.assert_allclose(np.array(layer.mlp(x)), per_expert_loop(layer.mlp, x, quantized_matmul),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_K", "Q6_K"])
def test_transcode_stacked_is_each_expert_transcoded(type_name):
    """A stack transcodes as its matrices one by one (Q6_K's re-quantizing rule included), and dequantizes as
    llama.cpp's gguf package decodes it where the type maps exactly."""
    rng = np.random.default_rng(12)
    data = np.stack([random_blocks(type_name, 3, 256, rng) for _ in range(5)])   # (5, 3, row_bytes)
    a = transcode.transcode_stacked("w", GGMLType[type_name], data, (5, 3, 256))
    assert a.weight.shape == (5, 3, 256 * a.bits // 32) and a.scales.shape == a.biases.shape == (5, 3, 8)
    for e in range(5):
        one = transcode.transcode_tensor("w", GGMLType[type_name], data[e], (3, 256))
        assert all(np.array_equal(x[e], y) for x, y in zip((a.weight, a.scales, a.biases),
                                                              (one.weight, one.scales, one.biases)))
    if type_name != "Q6_K":
        ours = mx.dequantize(mx.array(a.weight), mx.array(a.scales), mx.array(a.biases), group_size=32, bits=a.bits)
        assert np.array_equal(np.array(ours), gguf_py.quants.dequantize(data, gguf_py.GGMLQuantizationType[type_name]))


# --- bad input -----------------------------------------------------------------------------------------

def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="n_used"):
        MoE(D, FF, 8, 9)
    with pytest.raises(ValueError, match="n_used"):
        MoE(D, FF, 8, 0)
    m = MoE(D, FF, 8, 2)
    for shape in [(2, D), (1, 3, D + 1)]:
        with pytest.raises(ValueError, match=r"input must be \(B, L, 64\)"):
            m(mx.zeros(shape))
    with pytest.raises(ValueError, match="QuantizedExperts"):
        QuantizedExperts(8, 48, 16, group_size=32, bits=4)
    data = kquants.quantize_q8_0(np.zeros((4, 2, 64), np.float32))
    with pytest.raises(ValueError, match="'w': a stack of matrices has 3 dimensions"):
        transcode.transcode_stacked("w", GGMLType.Q8_0, data[0], (2, 64))
    with pytest.raises(ValueError, match=r"'w': Q8_0 data of shape \(4, 2, 68\) does not hold 5 matrices"):
        transcode.transcode_stacked("w", GGMLType.Q8_0, data, (5, 2, 64))
    with pytest.raises(ValueError, match="'w'.*does not hold"):
        transcode.transcode_stacked("w", GGMLType.Q8_0, data, (4, 2, 96))
