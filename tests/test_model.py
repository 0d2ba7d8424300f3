"""The MLX decoder against an independent numpy forward, with and without the KV cache."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import write_random_llama
from numpy_reference import forward as np_forward
from numpy_reference import load as np_load

from ref_impl.engine.checkpoint import load_model
from ref_impl.engine.model import ModelArgs, causal_attention
from ref_impl.formats import gguf

TOKENS = [3, 17, 42, 5, 96, 0, 11, 64, 23, 8, 50, 2]


def mlx_logits(path, tokens, dtype=mx.float32) -> np.ndarray:
    with gguf.read(path) as f:
        model = load_model(f, dtype)
    return np.array(model(mx.array([tokens]))[0].astype(mx.float32))


@pytest.mark.parametrize("variant", [
    {}, {"kv_heads": 4}, {"kv_heads": 1}, {"tied": False}, {"rope_freqs": True}, {"layers": 3, "heads": 2},
])
def test_forward_matches_numpy(tmp_path, variant):
    path = write_random_llama(tmp_path / "m.gguf", **variant)
    ours = mlx_logits(path, TOKENS)
    ref = np_forward(*np_load(path), TOKENS)
    assert ours.shape == ref.shape == (len(TOKENS), 97)
    assert np.abs(ours - ref).max() <= 1e-4


@pytest.mark.parametrize("weight_type", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q6_K"])
def test_stored_weight_types_load(tmp_path, weight_type):
    """F16, BF16, Q8_0 and the types of a Q4_K_M file load (expanded to floats) and compute right."""
    kquant = weight_type in ("Q4_K", "Q6_K")   # rows of 256 values
    path = write_random_llama(tmp_path / "m.gguf", weight_type=weight_type, tied=False,
                              **({"dim": 256, "ff": 512, "heads": 4, "kv_heads": 2} if kquant else {}))
    with gguf.read(path) as f:
        assert f.tensors["blk.0.attn_q.weight"].type.name == weight_type
    assert np.abs(mlx_logits(path, TOKENS) - np_forward(*np_load(path), TOKENS)).max() <= 1e-4


def test_shipped_forward_matches_numpy(shipped_model):
    with gguf.read(shipped_model) as f:
        vocab = f.tensors["token_embd.weight"].shape[0]
    tokens = np.random.default_rng(1).integers(0, vocab, 48).tolist()
    ours = mlx_logits(shipped_model, tokens)
    ref = np_forward(*np_load(shipped_model), tokens)
    assert np.abs(ours - ref).max() <= 1e-4


@pytest.mark.parametrize("chunks", [[12], [5, 1, 1, 1, 1, 1, 1, 1], [4, 3, 1, 4], [1] * 12])
def test_cached_decode_equals_full_forward(random_llama, chunks):
    """Feeding the sequence in pieces through the KV cache gives the full forward's logits."""
    with gguf.read(random_llama) as f:
        model = load_model(f, mx.float32)
    full = np.array(model(mx.array([TOKENS]))[0])
    cache = model.make_cache(len(TOKENS))
    pieces, start = [], 0
    for n in chunks:
        pieces.append(np.array(model(mx.array([TOKENS[start:start + n]]), cache)[0]))
        start += n
    assert cache[0].offset == len(TOKENS)
    # float32 sums in another order (a GEMV per token against one GEMM): logits near 11 differ by ~1e-5
    # (seen once with OpenBLAS); a cache bug moves them by whole units
    np.testing.assert_allclose(np.concatenate(pieces), full, atol=1e-5, rtol=1e-5)


def test_batch_rows_are_independent(random_llama):
    with gguf.read(random_llama) as f:
        model = load_model(f, mx.float32)
    a, b = TOKENS[:6], TOKENS[6:]
    both = np.array(model(mx.array([a, b])))
    np.testing.assert_allclose(both[0], np.array(model(mx.array([a])))[0], atol=1e-5)
    np.testing.assert_allclose(both[1], np.array(model(mx.array([b])))[0], atol=1e-5)


def test_float16_close_to_float32(random_llama):
    f32 = mlx_logits(random_llama, TOKENS, mx.float32)
    f16 = mlx_logits(random_llama, TOKENS, mx.float16)
    assert np.abs(f16 - f32).max() < 5e-2 * max(1.0, np.abs(f32).max())


def test_num_parameters_counts_the_weights(random_llama):
    with gguf.read(random_llama) as f:
        model = load_model(f, mx.float32)
        stored = sum(int(np.prod(t.shape)) for t in f.tensors.values())
    assert model.args.num_parameters == stored


def test_bad_models_raise_clear_errors(tmp_path):
    path = write_random_llama(tmp_path / "m.gguf")
    with gguf.read(path) as f:
        metadata, tensors = dict(f.metadata), dict(f.tensors)
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        ModelArgs.from_gguf({**metadata, "general.architecture": "gpt2"}, tensors)
    with pytest.raises(ValueError, match="lacks 'llama.block_count'"):
        ModelArgs.from_gguf({k: v for k, v in metadata.items() if k != "llama.block_count"}, tensors)
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        ModelArgs.from_gguf({**metadata, "llama.attention.head_count_kv": 3}, tensors)
    with pytest.raises(ValueError, match="must equal the head dimension"):
        ModelArgs.from_gguf({**metadata, "llama.rope.dimension_count": 8}, tensors)
    with pytest.raises(ValueError, match="the rope factors are 3, a head of 16 needs 8"):
        ModelArgs.from_gguf(metadata, tensors, (1.0, 2.0, 3.0))


@pytest.mark.parametrize("heads,kv_heads,L,T", [(4, 2, 2, 9), (4, 4, 5, 5), (8, 1, 9, 40), (6, 3, 1, 7)])
def test_causal_attention_against_float64(heads, kv_heads, L, T):
    """Short query blocks attend by plain ops (model.causal_attention): query i sees keys up to T - L + i."""
    rng = np.random.default_rng(L * T)
    q, k, v = (rng.standard_normal((1, h, n, 8)) for h, n in ((heads, L), (kv_heads, T), (kv_heads, T)))
    got = np.array(causal_attention(*(mx.array(a.astype(np.float32)) for a in (q, k, v)), 0.35))
    group = heads // kv_heads
    want = np.empty_like(q)
    for h in range(heads):
        s = 0.35 * q[0, h] @ k[0, h // group].T                          # (L, T)
        s[np.arange(T)[None, :] > np.arange(T - L, T)[:, None]] = -np.inf
        w = np.exp(s - s.max(-1, keepdims=True))
        want[0, h] = (w / w.sum(-1, keepdims=True)) @ v[0, h // group]
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


def test_parts_replace_the_models_operations_one_contract_each(shipped_model):
    """Model.use(Parts(...)): plain MLX implementations of the four contracts, written here from their formulas,
    give the shipped model's greedy tokens; each part is called; a rope part is refused where the file's
    rotary embedding has per-frequency factors."""
    import dataclasses

    from ref_impl.engine.checkpoint import load
    from ref_impl.engine.compose import generate
    from ref_impl.engine.model import MLX_PARTS, Parts

    calls = set()

    def norm(x, w, eps):
        calls.add("norm")
        return w * x * mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + eps)

    def rope(x, offset, base, traditional):
        calls.add("rope")
        D = x.shape[-1]
        angle = (offset + mx.arange(x.shape[2]))[:, None] * base ** (-mx.arange(0, D, 2) / D)[None, :]
        cos, sin = mx.cos(angle), mx.sin(angle)
        a, b = (x[..., 0::2], x[..., 1::2]) if traditional else (x[..., :D // 2], x[..., D // 2:])
        pair = (a * cos - b * sin, a * sin + b * cos)
        return mx.stack(pair, axis=-1).reshape(x.shape) if traditional else mx.concatenate(pair, axis=-1)

    def attend(q, k, v, scale, causal):
        calls.add("attend")
        L, T, g = q.shape[2], k.shape[2], q.shape[1] // k.shape[1]
        s = (q @ mx.repeat(k, g, axis=1).swapaxes(-1, -2)) * scale
        if causal:
            s = mx.where(mx.arange(T)[None, :] <= mx.arange(T - L, T)[:, None], s, -mx.inf)
        return mx.softmax(s, axis=-1) @ mx.repeat(v, g, axis=1)

    def mlp(x, gate, up, down):
        calls.add("mlp")
        return down(nn.silu(gate(x)) * up(x))

    model, tok = load(shipped_model, mx.float32)
    ref = generate(model, tok, "import os\n\ndef main(", 24)
    assert model.use(Parts(norm, rope, attend, mlp)) is model
    mine = generate(model, tok, "import os\n\ndef main(", 24)
    assert mine.tokens == ref.tokens and calls == {"norm", "rope", "attend", "mlp"}
    model.use(MLX_PARTS)
    assert generate(model, tok, "import os\n\ndef main(", 24).tokens == ref.tokens
    model.args = dataclasses.replace(model.args, rope_freq_factors=(1.0,) * (model.args.head_dim // 2))
    with pytest.raises(ValueError, match="per-frequency factors"):
        model.use(Parts(rope=rope))
