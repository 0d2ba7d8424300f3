"""engine/checkpoint.py: GGUF tensor names <-> MLX names, save and load, and what a broken file is told."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import write_random_llama

from ref_impl.engine.checkpoint import gguf_to_mlx_name, load, load_model, mlx_to_gguf_name, save
from ref_impl.engine.tokenizer import train_tokenizer
from ref_impl.formats import gguf

TOKENS = [3, 17, 42, 5, 96, 0, 11, 64, 23, 8, 50, 2]


def test_names_round_trip():
    for name in ["token_embd.weight", "output.weight", "output_norm.weight",
                 "blk.0.attn_q.weight", "blk.11.ffn_down.weight", "blk.3.attn_norm.weight", "blk.0.attn_qkv.weight",
                 "blk.2.post_ffw_norm.weight", "blk.1.ffn_gate_exps.weight", "blk.1.ffn_gate.weight"]:
        assert mlx_to_gguf_name(gguf_to_mlx_name(name)) == name
    with pytest.raises(ValueError, match="unexpected tensor"):
        gguf_to_mlx_name("blk.0.ssm_conv1d.weight")


def test_save_round_trips_the_model(tmp_path):
    """save() writes every parameter and the rope factors; load() gives back the same logits."""
    path = write_random_llama(tmp_path / "m.gguf", rope_freqs=True, tied=False)
    with gguf.read(path) as f:
        model = load_model(f, mx.float32)
    tok = train_tokenizer(["def f(x):\n    return x\n"] * 4, vocab_size=257)
    with pytest.raises(ValueError, match="the tokenizer has 257 tokens, the model 97"):
        save(model, tok, tmp_path / "bad.gguf")
    tok = train_tokenizer(["def f(x):\n    return x + 1\n" * 50], vocab_size=297)
    big = load_model(gguf.read(write_random_llama(tmp_path / "v.gguf", vocab=tok.vocab_size,
                                                  rope_freqs=True, tied=False)), mx.float32)
    save(big, tok, tmp_path / "saved.gguf")
    again, tok2 = load(tmp_path / "saved.gguf", mx.float32)
    assert again.args == big.args and tok2.tokens == tok.tokens
    x = mx.array([TOKENS])
    assert np.array_equal(np.array(again(x)), np.array(big(x)))


def test_missing_or_misshapen_tensor(tmp_path):
    # a model with 3 layers declared but 2 stored lacks tensors; a wrong feed-forward size misfits
    path = write_random_llama(tmp_path / "m.gguf")
    with gguf.read(path) as f:
        metadata = dict(f.metadata)
        tensors = {n: f.array(n).copy() for n in f.tensors}
    for change, message in [({"llama.block_count": 3}, "lacks tensors for: layers.2"),
                            ({"llama.feed_forward_length": 64}, "has shape")]:
        bad = tmp_path / "bad.gguf"
        gguf.write(bad, {**metadata, **change}, tensors)
        with gguf.read(bad) as f, pytest.raises(ValueError, match=message):
            load_model(f, mx.float32)
