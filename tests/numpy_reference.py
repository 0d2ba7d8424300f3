"""An independent float64 numpy forward pass of a GGUF file: the decoder's oracle.

It shares no code with ref_impl: the file is read with llama.cpp's own `gguf` package, and every
operation is written out plainly, in float64, the way llama.cpp's graph for the file's
`general.architecture` does it: llama (dense, or Mixtral-style experts), qwen2, qwen3, qwen3moe,
phi3, gemma2 and gemma3 (text). Pieces: RMSNorm; RoPE on adjacent pairs (llama) or on halves
(the others), with frequency factors, linear scaling and an attention factor; grouped-query causal
attention with an optional sliding window and score soft-capping; SwiGLU or GeGLU feed-forwards,
separate or fused; a routed mixture of experts, looped over tokens and experts; gemma's extra norms,
embedding scale and final soft-capping. Slow, and meant for tiny models.

References (llama.cpp, the version llama-cpp-python 0.3.36 builds): src/models/{llama,qwen2,qwen3,
qwen3moe,phi3,gemma2,gemma3}.cpp (graphs and each architecture's keys), src/llama-graph.cpp
(`build_qkv`, `build_ffn`, `build_moe_ffn`, `build_attn_mha`), src/llama-model.cpp (`load_hparams`,
`llama_model_rope_type`, `get_rope_freq_base`, `get_rope_factors`), src/llama-hparams.{h,cpp}
(`set_swa_pattern`, `is_masked_swa`), src/llama-context.cpp (n_ctx, attention factor),
ggml/src/ggml-cpu/ops.cpp (`rope_yarn`), ggml/src/ggml-cpu/vec.h (GELU through a float16 table).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

# llama.cpp's rope type per architecture: NORM rotates adjacent pairs, NEOX the two halves of a head
ROPE_NEOX = {"llama": False, "qwen2": True, "qwen3": True, "qwen3moe": True, "phi3": True,
             "gemma2": True, "gemma3": True}
ARCHITECTURES = tuple(ROPE_NEOX)
GEMMA = ("gemma2", "gemma3")
MIN_WEIGHT_SUM = 6.103515625e-5  # build_moe_ffn clamps the routing weights' sum to float16's smallest normal
GELU_TABLE_RANGE = 10.0          # ggml's table GELU is exact outside (-10, 10): 0 below, x above

Gelu = Literal["tanh", "fp16-table"]


@dataclass(frozen=True)
class HParams:
    """What llama.cpp's loader makes of a file's metadata, for one architecture. rope_scale multiplies
    positions (1 / `rope.scaling.factor`); `_swa` fields apply to the sliding-window layers; 0 turns a
    window, soft cap or expert count off; n_ctx_orig picks phi3's long or short rope factors."""

    arch: str
    n_layers: int
    n_embd: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_rot: int
    eps: float
    context_length: int
    rope_base: float = 10000.0
    rope_scale: float = 1.0
    rope_base_swa: float = 10000.0
    rope_scale_swa: float = 1.0
    rope_attn_factor: float = 1.0
    n_ctx_orig: int = 0
    swa_window: int = 0
    swa_layers: tuple[bool, ...] = ()
    attn_scale: float = 1.0
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    embed_scale: float = 1.0
    n_expert: int = 0
    n_expert_used: int = 0


def _metadata(reader: GGUFReader) -> dict[str, Any]:
    return {f.name: f.contents() for f in reader.fields.values()}


def swa_pattern(value: int | list, n_layers: int) -> tuple[bool, ...]:
    """Which layers slide: an array gives each layer's flag; a number n makes every n-th layer (the
    last of each group of n) global and the others local, n = 0 all local (set_swa_pattern)."""
    if isinstance(value, list):
        if len(value) != n_layers:
            raise ValueError(f"sliding_window_pattern has {len(value)} entries for {n_layers} layers")
        return tuple(bool(v) for v in value)
    n = int(value)
    return tuple(n == 0 or i % n < n - 1 for i in range(n_layers))


def read_hparams(meta: dict[str, Any]) -> HParams:
    """HParams from GGUF metadata, with each key's llama.cpp default; a ValueError names an
    unsupported architecture, rope scaling or missing key."""
    arch = meta.get("general.architecture")
    if arch not in ROPE_NEOX:
        raise ValueError(f"general.architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}")

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{name}")
        if isinstance(value, list) and name != "attention.sliding_window_pattern":
            raise ValueError(f"{arch}.{name} is a per-layer array; this reference reads one value")
        return value

    n_layers, n_embd, n_heads = key("block_count"), key("embedding_length"), key("attention.head_count")
    head_dim = key("attention.key_length", n_embd // n_heads)
    if key("attention.value_length", head_dim) != head_dim:
        raise ValueError(f"{arch}.attention.value_length differs from key_length; not supported")
    scaling = key("rope.scaling.type", "linear")
    if scaling not in ("none", "linear", "longrope"):  # longrope: linear, plus the factor tensors
        raise ValueError(f"{arch}.rope.scaling.type {scaling!r} is not supported (none, linear, longrope)")
    factor = key("rope.scaling.factor", meta.get(f"{arch}.rope.scale_linear", 0.0))
    scale_train = 1.0 / factor if factor else 1.0
    rope_base = key("rope.freq_base", 10000.0)
    hp = dict(arch=arch, n_layers=n_layers, n_embd=n_embd, n_heads=n_heads,
              n_kv_heads=key("attention.head_count_kv", n_heads), head_dim=head_dim,
              n_rot=key("rope.dimension_count", head_dim), eps=key("attention.layer_norm_rms_epsilon"),
              context_length=key("context_length"), rope_base=rope_base,
              rope_scale=1.0 if scaling == "none" else scale_train,
              rope_attn_factor=key("rope.scaling.attn_factor", 1.0),
              n_ctx_orig=key("rope.scaling.original_context_length", key("context_length")),
              attn_scale=1.0 / np.sqrt(head_dim),
              n_expert=key("expert_count", 0), n_expert_used=key("expert_used_count", 0))
    if arch in GEMMA:
        hp.update(gemma_hparams(arch, key, n_layers, rope_base, scale_train),
                  embed_scale=float(np.sqrt(n_embd)))
        if n_layers == {"gemma2": 46, "gemma3": 62}[arch]:  # the 27B models scale by hidden / heads
            hp["attn_scale"] = 1.0 / np.sqrt(n_embd // n_heads)
    return HParams(**hp)


def gemma_hparams(arch: str, key: Callable[..., Any], n_layers: int, rope_base: float,
                  scale_train: float) -> dict[str, Any]:
    """Gemma's window, per-layer pattern, local rope and soft caps. gemma2 always slides (window 4096,
    pattern 2, local rope = global rope, caps 50 on scores and 30 on logits); gemma3 slides only with a
    window key (pattern 6, local rope base 10000 unscaled) and caps logits only when the key is there."""
    if arch == "gemma2":
        window, pattern = key("attention.sliding_window", 4096), 2
        base_swa, scale_swa = key("rope.freq_base_swa", rope_base), scale_train
        caps = dict(attn_softcap=key("attn_logit_softcapping", 50.0),
                    final_softcap=key("final_logit_softcapping", 30.0))
    else:
        window, pattern = key("attention.sliding_window", 0), 6
        base_swa, scale_swa = key("rope.freq_base_swa", 10000.0), 1.0
        caps = dict(final_softcap=key("final_logit_softcapping", 0.0))
    if window <= 0:
        return caps
    layers = swa_pattern(key("attention.sliding_window_pattern", pattern), n_layers)
    return dict(caps, swa_window=window, swa_layers=layers, rope_base_swa=base_swa, rope_scale_swa=scale_swa)


def load(path: str | Path) -> tuple[HParams, dict[str, np.ndarray]]:
    """Hyper-parameters and float64 weights ((out, in) matrices, (expert, out, in) stacks) from a GGUF
    file whose tensors the `gguf` package can dequantize (F32, F16, BF16, Q8_0, K-quants)."""
    reader = GGUFReader(path)
    hp = read_hparams(_metadata(reader))
    weights = {t.name: dequantize(t.data, t.tensor_type).astype(np.float64)
                       .reshape([int(d) for d in reversed(t.shape)])
               for t in reader.tensors}
    return hp, weights


# --- operations ----------------------------------------------------------------------------------

def rmsnorm(x: np.ndarray, g: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * g


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def gelu(x: np.ndarray, kind: Gelu = "tanh") -> np.ndarray:
    """GELU, tanh approximation. "fp16-table" is what ggml's CPU backend computes: the input rounded to
    float16, looked up in a float16 table of GELU values, exact 0 / x outside (-10, 10)."""
    def tanh_gelu(v):
        return 0.5 * v * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * v * (1.0 + 0.044715 * v * v)))
    if kind == "tanh":
        return tanh_gelu(x)
    table = tanh_gelu(x.astype(np.float16).astype(np.float64)).astype(np.float16).astype(np.float64)
    return np.where(x <= -GELU_TABLE_RANGE, 0.0, np.where(x >= GELU_TABLE_RANGE, x, table))


def linear(x: np.ndarray, w: dict[str, np.ndarray], name: str) -> np.ndarray:
    """x @ W.T, plus the bias when the file has one."""
    y = x @ w[name + ".weight"].T
    return y + w[name + ".bias"] if name + ".bias" in w else y


def rope(x: np.ndarray, hp: HParams, base: float, scale: float, factors: np.ndarray | None) -> np.ndarray:
    """Rotate the first n_rot channels of x (heads, L, D) at positions 0..L-1; angle p * scale *
    base^(-2i/n_rot) / factors[i], cos and sin times the attention factor (ggml rope_yarn, no YaRN)."""
    n = hp.n_rot
    inv_freq = base ** (-np.arange(0, n, 2) / n)
    if factors is not None:
        inv_freq = inv_freq / factors
    angle = (np.arange(x.shape[1]) * scale)[:, None] * inv_freq[None, :]      # (L, n/2)
    cos, sin = np.cos(angle) * hp.rope_attn_factor, np.sin(angle) * hp.rope_attn_factor
    rot = x[..., :n]
    if ROPE_NEOX[hp.arch]:   # pairs (i, i + n/2)
        a, b = rot[..., :n // 2], rot[..., n // 2:]
        out = np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)
    else:                    # pairs (2i, 2i + 1)
        a, b = rot[..., 0::2], rot[..., 1::2]
        out = np.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(rot.shape)
    return np.concatenate([out, x[..., n:]], axis=-1)


def rope_factors(hp: HParams, w: dict[str, np.ndarray], n_ctx: int) -> np.ndarray | None:
    """Llama 3's rope_freqs, else phi3's long factors when the context exceeds the original one, else
    the short ones (get_rope_factors); None when the file has none."""
    if "rope_freqs.weight" in w:
        return w["rope_freqs.weight"]
    if n_ctx > hp.n_ctx_orig:
        return w.get("rope_factors_long.weight")
    return w.get("rope_factors_short.weight")


def attention(hp: HParams, w: dict[str, np.ndarray], p: str, h: np.ndarray, layer: int,
              factors: np.ndarray | None) -> np.ndarray:
    """Causal grouped-query self-attention of one layer on normed input h (L, d), before the residual."""
    L, H, Hkv, D = len(h), hp.n_heads, hp.n_kv_heads, hp.head_dim
    if p + "attn_qkv.weight" in w:   # phi3: one matrix, rows q then k then v
        q, k, v = np.split(linear(h, w, p + "attn_qkv"), [H * D, (H + Hkv) * D], axis=-1)
    else:
        q, k, v = linear(h, w, p + "attn_q"), linear(h, w, p + "attn_k"), linear(h, w, p + "attn_v")
    q = q.reshape(L, H, D).transpose(1, 0, 2)                                   # (H, L, D)
    k = k.reshape(L, Hkv, D).transpose(1, 0, 2)                                 # (Hkv, L, D)
    v = v.reshape(L, Hkv, D).transpose(1, 0, 2)
    if p + "attn_q_norm.weight" in w:
        q = rmsnorm(q, w[p + "attn_q_norm.weight"], hp.eps)
        k = rmsnorm(k, w[p + "attn_k_norm.weight"], hp.eps)
    local = bool(hp.swa_window) and hp.swa_layers[layer]
    base, scale = (hp.rope_base_swa, hp.rope_scale_swa) if local else (hp.rope_base, hp.rope_scale)
    q, k = rope(q, hp, base, scale, factors), rope(k, hp, base, scale, factors)
    k, v = np.repeat(k, H // Hkv, axis=0), np.repeat(v, H // Hkv, axis=0)     # query head j reads kv head j // group
    scores = q @ k.transpose(0, 2, 1) * hp.attn_scale                           # (H, L, L)
    if hp.attn_softcap:
        scores = hp.attn_softcap * np.tanh(scores / hp.attn_softcap)
    qpos, kpos = np.arange(L)[:, None], np.arange(L)[None, :]
    visible = kpos <= qpos
    if local:  # is_masked_swa: a key window or more positions back is hidden
        visible &= qpos - kpos < hp.swa_window
    att = softmax(np.where(visible, scores, -np.inf)) @ v                       # (H, L, D)
    return linear(att.transpose(1, 0, 2).reshape(L, H * D), w, p + "attn_output")


def feed_forward(hp: HParams, w: dict[str, np.ndarray], p: str, h: np.ndarray, gelu_kind: Gelu) -> np.ndarray:
    """act(gate) * up, projected down: SiLU, or GELU for gemma; phi3's fused ffn_up holds gate rows first."""
    if p + "ffn_gate.weight" in w:
        gate, up = linear(h, w, p + "ffn_gate"), linear(h, w, p + "ffn_up")
    else:
        gate, up = np.split(linear(h, w, p + "ffn_up"), 2, axis=-1)
    act = gelu(gate, gelu_kind) if hp.arch in GEMMA else silu(gate)
    return linear(act * up, w, p + "ffn_down")


def mixture_of_experts(hp: HParams, w: dict[str, np.ndarray], p: str, h: np.ndarray) -> np.ndarray:
    """Softmax over every expert's router logit, the top n_expert_used chosen, their probabilities
    renormalised to sum 1, and their SwiGLU outputs summed with those weights (build_moe_ffn,
    norm_w = true for llama and qwen3moe)."""
    probs = softmax(h @ w[p + "ffn_gate_inp.weight"].T)                        # (L, n_expert)
    up_w, down_w = w[p + "ffn_up_exps.weight"], w[p + "ffn_down_exps.weight"]
    gate_w = w.get(p + "ffn_gate_exps.weight")
    out = np.zeros_like(h)
    for t in range(len(h)):
        chosen = np.argsort(-probs[t], kind="stable")[:hp.n_expert_used]
        weights = probs[t, chosen] / max(probs[t, chosen].sum(), MIN_WEIGHT_SUM)
        for e, weight in zip(chosen, weights):
            up = up_w[e] @ h[t]
            act = silu(gate_w[e] @ h[t]) * up if gate_w is not None else silu(up)
            out[t] += weight * (down_w[e] @ act)
    return out


def forward(hp: HParams, w: dict[str, np.ndarray], tokens: list[int], n_ctx: int | None = None,
            gelu: Gelu = "tanh") -> np.ndarray:
    """Logits (L, vocab) for one sequence of token ids from position 0.

    n_ctx is the context the runtime holds (default: the file's context_length); only phi3's choice of
    long or short rope factors reads it. llama.cpp rounds its context up to a multiple of 256 first.
    gelu="fp16-table" reproduces ggml's CPU GELU instead of the exact tanh approximation."""
    if gelu not in ("tanh", "fp16-table"):
        raise ValueError(f"gelu must be 'tanh' or 'fp16-table', not {gelu!r}")
    vocab = w["token_embd.weight"].shape[0]
    if any(not 0 <= t < vocab for t in tokens):
        raise ValueError(f"token ids must lie in [0, {vocab})")
    factors = rope_factors(hp, w, hp.context_length if n_ctx is None else n_ctx)
    x = w["token_embd.weight"][tokens] * hp.embed_scale                          # (L, d)
    for i in range(hp.n_layers):
        p = f"blk.{i}."
        h = attention(hp, w, p, rmsnorm(x, w[p + "attn_norm.weight"], hp.eps), i, factors)
        if hp.arch in GEMMA:
            h = rmsnorm(h, w[p + "post_attention_norm.weight"], hp.eps)
        x = x + h
        h = rmsnorm(x, w[p + "ffn_norm.weight"], hp.eps)
        if p + "ffn_gate_inp.weight" in w:
            h = mixture_of_experts(hp, w, p, h)
        else:
            h = feed_forward(hp, w, p, h, gelu)
        if hp.arch in GEMMA:
            h = rmsnorm(h, w[p + "post_ffw_norm.weight"], hp.eps)
        x = x + h
    x = rmsnorm(x, w["output_norm.weight"], hp.eps)
    logits = linear(x, w, "output") if "output.weight" in w else x @ w["token_embd.weight"].T
    if hp.final_softcap:
        logits = hp.final_softcap * np.tanh(logits / hp.final_softcap)
    return logits
