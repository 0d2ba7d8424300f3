"""An independent float64 numpy forward pass of a llama GGUF file: the decoder's oracle.

It shares no code with ref_impl: the file is read with llama.cpp's own `gguf` package, and
every operation is written out plainly (RMSNorm, adjacent-pair RoPE, grouped-query causal
attention, SwiGLU, tied or separate output head).
"""

from __future__ import annotations

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


def load(path) -> tuple[dict, dict[str, np.ndarray]]:
    """Hyper-parameters and float64 weights, (out, in) matrices, from a GGUF file whose tensors
    the `gguf` package can dequantize (F32, F16, BF16, Q8_0, K-quants)."""
    reader = GGUFReader(path)
    fields = {f.name: f for f in reader.fields.values()}

    def scalar(key, default=None):
        if key not in fields:
            return default
        f = fields[key]
        return f.parts[f.data[0]][0].item()

    hp = {
        "n_layers": scalar("llama.block_count"),
        "n_heads": scalar("llama.attention.head_count"),
        "n_kv_heads": scalar("llama.attention.head_count_kv"),
        "eps": scalar("llama.attention.layer_norm_rms_epsilon"),
        "theta": scalar("llama.rope.freq_base", 10000.0),
    }
    weights = {t.name: dequantize(t.data, t.tensor_type).astype(np.float64)
                       .reshape([int(d) for d in reversed(t.shape)])
               for t in reader.tensors}
    return hp, weights


def forward(hp: dict, w: dict[str, np.ndarray], tokens: list[int]) -> np.ndarray:
    """Logits (L, vocab) for one sequence of token ids."""
    L = len(tokens)
    H, Hkv = hp["n_heads"], hp["n_kv_heads"]

    def rmsnorm(x, g):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + hp["eps"]) * g

    def rope(x):  # x: (heads, L, D); rotate adjacent pairs (x0, x1), (x2, x3), ...
        D = x.shape[-1]
        inv_freq = hp["theta"] ** (-np.arange(0, D, 2) / D)
        if "rope_freqs.weight" in w:  # Llama 3 scaling: llama.cpp divides each frequency by a factor
            inv_freq = inv_freq / w["rope_freqs.weight"]
        angle = np.arange(L)[:, None] * inv_freq[None, :]            # (L, D/2)
        cos, sin = np.cos(angle), np.sin(angle)
        even, odd = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = even * cos - odd * sin
        out[..., 1::2] = even * sin + odd * cos
        return out

    x = w["token_embd.weight"][tokens]                                # (L, d)
    causal = np.triu(np.full((L, L), -np.inf), k=1)
    for i in range(hp["n_layers"]):
        p = f"blk.{i}."
        h = rmsnorm(x, w[p + "attn_norm.weight"])
        q = (h @ w[p + "attn_q.weight"].T).reshape(L, H, -1).transpose(1, 0, 2)      # (H, L, D)
        k = (h @ w[p + "attn_k.weight"].T).reshape(L, Hkv, -1).transpose(1, 0, 2)    # (Hkv, L, D)
        v = (h @ w[p + "attn_v.weight"].T).reshape(L, Hkv, -1).transpose(1, 0, 2)
        q, k = rope(q), rope(k)
        k, v = np.repeat(k, H // Hkv, axis=0), np.repeat(v, H // Hkv, axis=0)        # share kv heads
        scores = q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1]) + causal
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        att = (scores / scores.sum(-1, keepdims=True)) @ v                             # (H, L, D)
        x = x + att.transpose(1, 0, 2).reshape(L, -1) @ w[p + "attn_output.weight"].T
        h = rmsnorm(x, w[p + "ffn_norm.weight"])
        gate = h @ w[p + "ffn_gate.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * (h @ w[p + "ffn_up.weight"].T)) @ w[p + "ffn_down.weight"].T
    x = rmsnorm(x, w["output_norm.weight"])
    head = w.get("output.weight", w["token_embd.weight"])
    return x @ head.T
