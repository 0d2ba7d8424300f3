"""Tiny random GGUF files of each architecture, written with llama.cpp's own writer (`gguf.GGUFWriter`).

One function per architecture returns the path of a file llama.cpp loads: the `<arch>.*` keys its
loader reads and exactly the tensors its `load_arch_tensors` creates (llama.cpp refuses a file with
a tensor it does not use), all F32, with a "none" vocabulary (token ids only, as
ref_impl/engine/random.py writes one). Nothing here comes from ref_impl, so these files can check
its writer and decoder as well as tests/numpy_reference.py.

References: llama.cpp src/models/{llama,qwen2,qwen3,qwen3moe,phi3,gemma2,gemma3}.cpp (tensors and keys),
src/llama-arch.cpp (names), src/llama-model.cpp `load_hparams` (common keys).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np


@dataclass(frozen=True)
class Shape:
    """The sizes of a tiny model; head_dim None is hidden // heads (what llama.cpp assumes without
    `attention.key_length`)."""

    vocab: int = 256
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int | None = None
    ff: int = 96
    context: int = 256
    eps: float = 1e-6
    seed: int = 0

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden // self.heads


class _Random:
    """Random F32 tensors sized so activations stay O(1): matrices ~ N(0, 1/in), norms in [0.5, 1.5)."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def mat(self, *shape: int, gain: float = 1.0) -> np.ndarray:
        return (self.rng.standard_normal(shape) * gain / np.sqrt(shape[-1])).astype(np.float32)

    def norm(self, n: int) -> np.ndarray:
        return self.rng.uniform(0.5, 1.5, n).astype(np.float32)

    def uniform(self, lo: float, hi: float, n: int) -> np.ndarray:
        return self.rng.uniform(lo, hi, n).astype(np.float32)


@contextmanager
def _writer(path: Path, arch: str, s: Shape, rope_base: float = 10000.0,
            head_dim_key: bool = False) -> Iterator[tuple[gguf.GGUFWriter, _Random]]:
    """A GGUFWriter with the keys every architecture shares; the body adds tensors and keys, the
    exit writes the file."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(s.context)
    w.add_embedding_length(s.hidden)
    w.add_block_count(s.layers)
    w.add_feed_forward_length(s.ff)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_layer_norm_rms_eps(s.eps)
    w.add_rope_freq_base(rope_base)
    if head_dim_key:
        w.add_key_length(s.hd)
        w.add_value_length(s.hd)
    w.add_vocab_size(s.vocab)  # a "none" vocabulary has no token list to count
    w.add_tokenizer_model("none")
    r = _Random(s.seed)
    w.add_tensor("token_embd.weight", r.mat(s.vocab, s.hidden, gain=4.0))
    yield w, r
    w.add_tensor("output_norm.weight", r.norm(s.hidden))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _attention(w: gguf.GGUFWriter, r: _Random, s: Shape, p: str, qk_norm: bool = False,
               bias: bool = False) -> None:
    w.add_tensor(p + "attn_norm.weight", r.norm(s.hidden))
    for name, rows in (("attn_q", s.heads * s.hd), ("attn_k", s.kv_heads * s.hd), ("attn_v", s.kv_heads * s.hd)):
        w.add_tensor(p + name + ".weight", r.mat(rows, s.hidden))
        if bias:
            w.add_tensor(p + name + ".bias", r.uniform(-0.5, 0.5, rows))
    w.add_tensor(p + "attn_output.weight", r.mat(s.hidden, s.heads * s.hd))
    if qk_norm:
        w.add_tensor(p + "attn_q_norm.weight", r.norm(s.hd))
        w.add_tensor(p + "attn_k_norm.weight", r.norm(s.hd))


def _dense_ffn(w: gguf.GGUFWriter, r: _Random, s: Shape, p: str) -> None:
    w.add_tensor(p + "ffn_norm.weight", r.norm(s.hidden))
    w.add_tensor(p + "ffn_gate.weight", r.mat(s.ff, s.hidden))
    w.add_tensor(p + "ffn_up.weight", r.mat(s.ff, s.hidden))
    w.add_tensor(p + "ffn_down.weight", r.mat(s.hidden, s.ff))


def _experts(w: gguf.GGUFWriter, r: _Random, s: Shape, p: str, n_expert: int, n_ff: int) -> None:
    """Router and stacked experts, numpy (expert, out, in) = GGUF {in, out, expert}."""
    w.add_tensor(p + "ffn_norm.weight", r.norm(s.hidden))
    w.add_tensor(p + "ffn_gate_inp.weight", r.mat(n_expert, s.hidden, gain=2.0))
    w.add_tensor(p + "ffn_gate_exps.weight", r.mat(n_expert, n_ff, s.hidden))
    w.add_tensor(p + "ffn_up_exps.weight", r.mat(n_expert, n_ff, s.hidden))
    w.add_tensor(p + "ffn_down_exps.weight", r.mat(n_expert, s.hidden, n_ff))


def write_llama(path: Path, s: Shape = Shape(), tied: bool = False, n_expert: int = 0,
                n_expert_used: int = 0) -> Path:
    """A llama file; with n_expert > 0 Mixtral-style (every FFN a routed mixture of s.ff-wide experts,
    `llama.expert_count`/`expert_used_count`, no dense ffn_gate/up/down)."""
    with _writer(path, "llama", s) as (w, r):
        if n_expert:
            w.add_expert_count(n_expert)
            w.add_expert_used_count(n_expert_used)
        for i in range(s.layers):
            _attention(w, r, s, f"blk.{i}.")
            if n_expert:
                _experts(w, r, s, f"blk.{i}.", n_expert, s.ff)
            else:
                _dense_ffn(w, r, s, f"blk.{i}.")
        if not tied:
            w.add_tensor("output.weight", r.mat(s.vocab, s.hidden))
    return path


def write_qwen2(path: Path, s: Shape = Shape()) -> Path:
    """A qwen2 file: biases on q, k and v, tied output."""
    with _writer(path, "qwen2", s, rope_base=1e6) as (w, r):
        for i in range(s.layers):
            _attention(w, r, s, f"blk.{i}.", bias=True)
            _dense_ffn(w, r, s, f"blk.{i}.")
    return path


def write_qwen3(path: Path, s: Shape = Shape(head_dim=32)) -> Path:
    """A qwen3 file: q/k RMSNorm per head, explicit head dim (`key_length`), untied output."""
    with _writer(path, "qwen3", s, rope_base=1e6, head_dim_key=True) as (w, r):
        for i in range(s.layers):
            _attention(w, r, s, f"blk.{i}.", qk_norm=True)
            _dense_ffn(w, r, s, f"blk.{i}.")
        w.add_tensor("output.weight", r.mat(s.vocab, s.hidden))
    return path


def write_qwen3moe(path: Path, s: Shape = Shape(head_dim=32), n_expert: int = 8, n_expert_used: int = 2,
                   expert_ff: int = 32) -> Path:
    """A qwen3moe file: q/k RMSNorm per head, explicit head dim (`key_length`), routed experts of width
    `expert_feed_forward_length`, untied output."""
    with _writer(path, "qwen3moe", s, rope_base=1e6, head_dim_key=True) as (w, r):
        w.add_expert_count(n_expert)
        w.add_expert_used_count(n_expert_used)
        w.add_expert_feed_forward_length(expert_ff)
        for i in range(s.layers):
            _attention(w, r, s, f"blk.{i}.", qk_norm=True)
            _experts(w, r, s, f"blk.{i}.", n_expert, expert_ff)
        w.add_tensor("output.weight", r.mat(s.vocab, s.hidden))
    return path


def _gemma_layers(w: gguf.GGUFWriter, r: _Random, s: Shape, qk_norm: bool) -> None:
    for i in range(s.layers):
        p = f"blk.{i}."
        _attention(w, r, s, p, qk_norm=qk_norm)
        w.add_tensor(p + "post_attention_norm.weight", r.norm(s.hidden))
        _dense_ffn(w, r, s, p)
        w.add_tensor(p + "post_ffw_norm.weight", r.norm(s.hidden))


def write_gemma2(path: Path, s: Shape = Shape(head_dim=32), window: int = 16, attn_softcap: float | None = 50.0,
                 final_softcap: float | None = 30.0, rope_base_swa: float | None = None) -> Path:
    """A gemma2 file: even layers slide a `window`-position window (pattern 2), odd ones are global;
    logit soft-capping keys (None: omitted, llama.cpp's defaults 50 and 30 apply); always tied output."""
    with _writer(path, "gemma2", s, head_dim_key=True) as (w, r):
        w.add_sliding_window(window)
        if attn_softcap is not None:
            w.add_attn_logit_softcapping(attn_softcap)
        if final_softcap is not None:
            w.add_final_logit_softcapping(final_softcap)
        if rope_base_swa is not None:
            w.add_rope_freq_base_swa(rope_base_swa)
        _gemma_layers(w, r, s, qk_norm=False)
    return path


def write_gemma3(path: Path, s: Shape = Shape(layers=6, head_dim=32), window: int = 16, pattern: int | None = None,
                 rope_base: float = 1e6, rope_base_swa: float | None = None, rope_scale: float | None = None,
                 final_softcap: float | None = None, tied: bool = True) -> Path:
    """A gemma3 text file: q/k norms; local layers (window, pattern default 6 = five local then one
    global, or `sliding_window_pattern`) use rope base `rope_base_swa` (llama.cpp default 10000) and no
    scaling, global ones `rope_base` and linear `rope_scale` (`rope.scaling.factor`); window 0 writes no
    window key, making every layer global."""
    with _writer(path, "gemma3", s, rope_base=rope_base, head_dim_key=True) as (w, r):
        if window:
            w.add_sliding_window(window)
        if pattern is not None:
            w.add_sliding_window_pattern(pattern)
        if rope_base_swa is not None:
            w.add_rope_freq_base_swa(rope_base_swa)
        if rope_scale is not None:
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rope_scale)
        if final_softcap is not None:
            w.add_final_logit_softcapping(final_softcap)
        _gemma_layers(w, r, s, qk_norm=True)
        if not tied:
            w.add_tensor("output.weight", r.mat(s.vocab, s.hidden))
    return path


def write_phi3(path: Path, s: Shape = Shape(), rope_factors: bool = False, original_context: int | None = None,
               attn_factor: float | None = None) -> Path:
    """A phi3 file: fused attn_qkv (q rows, then k, then v), fused ffn_up (gate rows, then up), untied
    output; with rope_factors, `rope_factors_long/short.weight` (head_dim/2 each), chosen by llama.cpp
    as n_ctx > `rope.scaling.original_context_length`; `rope.scaling.attn_factor` scales cos and sin."""
    if s.heads * s.hd != s.hidden:
        raise ValueError(f"phi3 needs heads * head_dim == hidden ({s.heads} * {s.hd} != {s.hidden})")
    with _writer(path, "phi3", s) as (w, r):
        w.add_rope_dimension_count(s.hd)
        if original_context is not None:
            w.add_rope_scaling_orig_ctx_len(original_context)
        if attn_factor is not None:
            w.add_rope_scaling_attn_factors(attn_factor)
        if rope_factors:
            w.add_tensor("rope_factors_long.weight", r.uniform(1.0, 8.0, s.hd // 2))
            w.add_tensor("rope_factors_short.weight", r.uniform(0.5, 2.0, s.hd // 2))
        for i in range(s.layers):
            p = f"blk.{i}."
            w.add_tensor(p + "attn_norm.weight", r.norm(s.hidden))
            w.add_tensor(p + "attn_qkv.weight", r.mat((s.heads + 2 * s.kv_heads) * s.hd, s.hidden))
            w.add_tensor(p + "attn_output.weight", r.mat(s.hidden, s.hidden))
            w.add_tensor(p + "ffn_norm.weight", r.norm(s.hidden))
            w.add_tensor(p + "ffn_up.weight", r.mat(2 * s.ff, s.hidden))
            w.add_tensor(p + "ffn_down.weight", r.mat(s.hidden, s.ff))
        w.add_tensor("output.weight", r.mat(s.vocab, s.hidden))
    return path
