"""A Llama-family decoder in MLX, loaded from a GGUF file: llama (Mistral, Mixtral), qwen2, qwen3, qwen3moe, gemma2,
gemma3 and phi3.

One pass through the network, for tokens (B, L):

    embed -> n_layers x [ x + Attention(RMSNorm(x)),  x + MLP(RMSNorm(x)) ] -> RMSNorm -> logits

Attention is grouped-query (n_kv_heads <= n_heads key/value heads, each shared by a group of
query heads) with rotary position embeddings; the MLP is SwiGLU. The hot operations go
through `mx.fast` (rope, scaled_dot_product_attention, rms_norm), as mlx-lm does.

The architectures differ in switches of `ModelArgs` (architectures.py lists them), one model for all:
- rope style: llama.cpp's converter reorders a llama's query and key rows for "normal" RoPE, which
  rotates *adjacent* pairs (x0, x1), (x2, x3), ... (`traditional=True` in `mx.fast.rope`); the others
  keep Hugging Face's order, rotated NEOX-style in pairs half a head apart (x0, x_{D/2}), ...;
- attention_bias: q, k and v projections with biases (qwen2; llama.cpp reads them for any of the three);
- qk_norm: an RMSNorm over each head of the queries and keys before rope (qwen3, gemma3);
- Gemma's block: embeddings times sqrt(d), GeGLU, norms on the attention's and the MLP's outputs, sliding-window
  layers (a key more than `sliding_window - 1` positions back is masked) and soft-capped scores and logits;
- a mixture of experts in place of the MLP (engine/moe.py), and Phi-3's fused projections.

Weights follow llama.cpp's conventions, so a GGUF written by llama.cpp's own converter loads as well
as the course's model: matrices are stored (out, in). Llama 3's frequency scaling arrives as the
`rope_freqs.weight` tensor, linear rope scaling as `<arch>.rope.scaling.factor`; both are applied here.

References: llama.cpp src/models/*.cpp (the graphs), src/llama-model.cpp
(`llama_model_rope_type`, the hyper-parameter keys).

See chapter: intro-roofline
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ref_impl.engine.architectures import ARCHITECTURES, Architecture, check_architecture, hparam_keys, read_hparams
from ref_impl.engine.kvcache import Cache, WindowKVCache
from ref_impl.engine.kvquant import FLOAT, make_caches
from ref_impl.engine.moe import MoE
from ref_impl.formats import gguf
from ref_impl.theory.shapes import ModelShape

# Query blocks this short (a speculative verification: γ + 1 positions) attend by plain matmuls and a
# softmax. MLX's CUDA backend runs `scaled_dot_product_attention` on more than one query through cuDNN,
# building a graph for each key length it meets, tens of milliseconds each: every verification step
# lands on a new length, so each would pay that build (measured in results/, experiment spec-attention).
SHORT_QUERIES = 16


@functools.lru_cache(maxsize=64)
def window_bias(L: int, T: int, window: int, dtype: mx.Dtype) -> mx.array:
    """(L, T): 0 where query i of L may see key j of T (the last L keys are the queries' own positions) and -inf
    elsewhere: causal, and with window > 0 only the `window` newest keys up to the query's own (llama.cpp's
    LLAMA_SWA_TYPE_STANDARD masks a key at p0 from a query at p1 when p1 - p0 >= window). Cached, so every layer
    of one forward shares one array."""
    distance = mx.arange(T - L, T)[:, None] - mx.arange(T)[None, :]
    visible = (distance >= 0) & ((distance < window) if window else True)
    return mx.where(visible, 0.0, -mx.inf).astype(dtype)


@functools.lru_cache(maxsize=64)
def causal_bias(L: int, T: int, groups: int, dtype: mx.Dtype) -> mx.array:
    """(groups * L, T): window_bias's causal mask (no window) for each of `groups` query heads stacked."""
    return mx.tile(window_bias(L, T, 0, dtype), (groups, 1))


def causal_attention(q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
    """Attention of L queries (B, H, L, D) over T keys (B, Hkv, T, D), query i seeing keys up to T - L + i
    (the causal mask lined up with the last L keys), as one scaled matmul plus mask (addmm), a softmax and a
    matmul: no shape-keyed plan, and few launches, since a host-bound GPU pays for each."""
    B, H, L, D = q.shape
    n_kv, T = k.shape[1], k.shape[2]
    q = q.reshape(B, n_kv, H // n_kv * L, D)                    # each key head's group of query heads
    scores = mx.addmm(causal_bias(L, T, H // n_kv, q.dtype), q, k.swapaxes(-1, -2), alpha=scale)
    return (mx.softmax(scores, axis=-1, precise=True) @ v).reshape(B, H, L, D)


@dataclass
class ModelArgs:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 0                  # 0: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    rope_freq_factors: tuple[float, ...] | None = None   # one divisor per frequency (Llama 3, Phi-3's long rope)
    rope_scaling_factor: float = 1.0   # linear scaling: positions divided by it (llama.cpp's 1 / freq_scale)
    architecture: str = "llama"        # a key of architectures.ARCHITECTURES
    attention_bias: bool = False       # biases on the q, k and v projections (qwen2)
    fused_qkv: bool = False            # one attn_qkv matrix in place of three (Phi-3)
    query_scale: float = 0.0           # attention's score scale; 0: 1 / sqrt(head_dim)
    attn_logit_softcap: float = 0.0    # scores become tanh(s / cap) * cap (Gemma 2); 0: none
    final_logit_softcap: float = 0.0   # the same on the logits
    sliding_window: int = 0            # keys a sliding layer's query sees, itself included; 0: no window
    sliding_layers: tuple[bool, ...] = ()   # per layer: whether it slides (needs sliding_window)
    rope_theta_local: float = 0.0      # the sliding layers' rope base; 0: rope_theta
    rope_scaling_factor_local: float = 1.0  # the sliding layers' linear rope scaling
    rope_attn_factor: float = 1.0      # rotations multiplied by it (Phi-3's long-rope attention factor)
    rope_original_context: int = 0     # Phi-3: the context beyond which the long rope factors apply
    num_experts: int = 0               # a mixture of experts in every layer's MLP (engine/moe.py); 0: dense
    experts_per_token: int = 0
    expert_intermediate_size: int = 0

    def __post_init__(self):
        check_architecture(self.architecture)
        if min(self.rope_scaling_factor, self.rope_scaling_factor_local) <= 0:
            raise ValueError(f"rope scaling factor {self.rope_scaling_factor} must be positive")
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.head_dim // 2:
            raise ValueError(f"the rope factors are {len(self.rope_freq_factors)}, "
                             f"a head of {self.head_dim} needs {self.head_dim // 2}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple "
                             f"of num_key_value_heads ({self.num_key_value_heads})")
        self.sliding_layers = tuple(bool(b) for b in self.sliding_layers)
        if self.sliding_window < 0 or bool(self.sliding_window) != any(self.sliding_layers) \
                or len(self.sliding_layers) not in (0, self.num_hidden_layers):
            raise ValueError(f"a sliding window of {self.sliding_window} with sliding layers {self.sliding_layers}: "
                             f"a window needs a flag for each of the {self.num_hidden_layers} layers, some set")
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(f"{self.experts_per_token} experts per token of {self.num_experts}")
        if ARCHITECTURES[self.architecture].experts and not self.num_experts:
            raise ValueError(f"a {self.architecture} model needs num_experts")

    @property
    def spec(self) -> Architecture:
        return ARCHITECTURES[self.architecture]

    @property
    def rope_traditional(self) -> bool:
        return self.spec.rope_traditional

    @property
    def qk_norm(self) -> bool:
        return self.spec.qk_norm

    @property
    def attention_scale(self) -> float:
        return self.query_scale or self.head_dim ** -0.5

    @property
    def plain_attention(self) -> bool:
        """Whether every layer attends plainly (no sliding window, no soft cap): what fused caches, a compiled
        step and Parts.attend compute."""
        return not (self.sliding_window or self.attn_logit_softcap)

    def slides(self, layer: int) -> bool:
        """Whether that layer attends through the sliding window."""
        return bool(self.sliding_window) and self.sliding_layers[layer]

    @property
    def num_parameters(self) -> int:
        """Weights in the network (the tied embedding counted once)."""
        d, f, hd = self.hidden_size, self.intermediate_size, self.head_dim
        attn = d * hd * (2 * self.num_attention_heads + 2 * self.num_key_value_heads)
        attn += hd * (self.num_attention_heads + 2 * self.num_key_value_heads) * self.attention_bias
        mlp = (d * self.num_experts + 3 * d * self.expert_intermediate_size * self.num_experts
               if self.num_experts else 3 * d * f)
        block = attn + mlp + (4 if self.spec.sandwich_norms else 2) * d + 2 * hd * self.qk_norm
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.num_hidden_layers * block + d + head

    @classmethod
    def from_gguf(cls, metadata: dict[str, Any], tensors: dict[str, gguf.TensorInfo],
                  rope_freq_factors: tuple[float, ...] | None = None) -> ModelArgs:
        """Read the hyper-parameters from GGUF metadata under the keys llama.cpp reads for the file's architecture
        (architectures.read_hparams), with the rope frequency factors the caller read from the file's tensors."""
        hp = read_hparams(metadata, tensors)
        if rope_freq_factors is not None and hp["architecture"] not in ("llama", "phi3"):
            raise ValueError(f"a {hp['architecture']} file with rope frequency factors: llama.cpp's "
                             f"{hp['architecture']} graph applies none (only llama's and phi3's do)")
        return cls(**hp, rope_freq_factors=rope_freq_factors)

    @classmethod
    def from_shape(cls, shape: ModelShape, context: int = 4096) -> ModelArgs:
        """The decoder's hyper-parameters for a shape of theory/shapes.py, attending to `context` positions;
        a ValueError when the shape is not the Llama architecture this decoder builds from a shape."""
        if not shape.is_llama:
            raise ValueError(f"{shape.name} is not the Llama architecture this decoder builds "
                             "(query/key norms, a sliding window or a mixture of experts)")
        return cls(shape.vocab_size, shape.hidden_size, shape.num_hidden_layers, shape.intermediate_size,
                   shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim,
                   max_position_embeddings=context, tie_word_embeddings=shape.tie_word_embeddings)

    def shape(self, name: str) -> ModelShape:
        """This model as a shape of theory/shapes.py, for the roofline's arithmetic."""
        dense = 0 if self.num_experts else self.intermediate_size   # a mixture of experts has no dense MLP
        return ModelShape(name, self.vocab_size, self.hidden_size, self.num_hidden_layers, dense,
                          self.num_attention_heads, self.num_key_value_heads, self.head_dim,
                          self.tie_word_embeddings, "ref_impl.engine.model.ModelArgs", qk_norm=self.qk_norm,
                          num_experts=self.num_experts, experts_per_token=self.experts_per_token,
                          expert_intermediate_size=self.expert_intermediate_size)

    def gguf_metadata(self) -> dict[str, Any]:
        """The metadata llama.cpp needs to load this model, under its architecture's prefix."""
        return hparam_keys(self)


@dataclass(frozen=True)
class Parts:
    """The operations a decoder is made of, each replaceable by a function with the same contract (book/build-it
    plugs a learner's in, one at a time, through `Model.use`); None keeps MLX's own.

        norm(x, weight, eps)                RMSNorm of x over its last axis, times weight
        rope(x, offset, base, traditional)  rotary embedding of x (B, heads, L, D) at positions offset..offset+L-1;
                                            traditional: adjacent pairs rotate, else pairs D/2 apart
        attend(q, k, v, scale, causal)      attention of q (B, H, L, D) over k, v (B, Hkv, T, D) -> (B, H, L, D),
                                            each key head shared by H/Hkv query heads; causal: query i sees keys
                                            up to T - L + i
        mlp(x, gate, up, down)              the gated MLP, given the layer's three projections as callables
    """
    norm: Callable[[mx.array, mx.array, float], mx.array] | None = None
    rope: Callable[[mx.array, int, float, bool], mx.array] | None = None
    attend: Callable[[mx.array, mx.array, mx.array, float, bool], mx.array] | None = None
    mlp: Callable[[mx.array, Callable, Callable, Callable], mx.array] | None = None


MLX_PARTS = Parts()


def rms_norm(norm: nn.RMSNorm, x: mx.array, parts: Parts) -> mx.array:
    """An RMSNorm layer applied to x: MLX's, or parts.norm on its weight and eps."""
    return norm(x) if parts.norm is None else parts.norm(x, norm.weight, norm.eps)


def capped_attention(q: mx.array, k: mx.array, v: mx.array, scale: float, bias: mx.array, cap: float) -> mx.array:
    """Attention whose scores are soft-capped, tanh(s / cap) * cap, before the mask and the softmax (Gemma 2):
    plain matmuls, since MLX's fused attention has no cap."""
    B, H, L, D = q.shape
    n_kv = k.shape[1]
    q = q.reshape(B, n_kv, H // n_kv, L, D)
    scores = (q * scale) @ k[:, :, None].swapaxes(-1, -2)
    if cap:
        scores = mx.tanh(scores / cap) * cap
    weights = mx.softmax(scores + bias, axis=-1, precise=True)
    return (weights @ v[:, :, None]).reshape(B, H, L, D)


class Attention(nn.Module):
    parts = MLX_PARTS

    def __init__(self, args: ModelArgs, layer: int = 0):
        super().__init__()
        d, hd = args.hidden_size, args.head_dim
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.scale = args.attention_scale
        bias = args.attention_bias
        if args.fused_qkv:   # Phi-3: one matrix, queries then keys then values
            self.qkv_proj = nn.Linear(d, (self.n_heads + 2 * self.n_kv_heads) * hd, bias=bias)
        else:
            self.q_proj = nn.Linear(d, self.n_heads * hd, bias=bias)
            self.k_proj = nn.Linear(d, self.n_kv_heads * hd, bias=bias)
            self.v_proj = nn.Linear(d, self.n_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=False)
        # qwen3 and gemma3 normalise each head of the queries and keys; elsewhere the heads pass unchanged
        self.q_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps) if args.qk_norm else nn.Identity()
        self.k_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps) if args.qk_norm else nn.Identity()
        self.window = args.sliding_window if args.slides(layer) else 0
        self.softcap = args.attn_logit_softcap
        local = self.window and args.rope_theta_local
        self.head_dim, self.rope_theta = hd, args.rope_theta_local if local else args.rope_theta
        scaling = args.rope_scaling_factor_local if local else args.rope_scaling_factor
        self.rope_traditional, self.rope_scale = args.rope_traditional, 1.0 / scaling
        self.rope_attn_factor = args.rope_attn_factor
        self._rope_freqs = None  # wavelengths; the underscore keeps them out of the parameters
        if args.rope_freq_factors is not None:
            # llama.cpp divides each rotation frequency by its factor; MLX takes wavelengths
            exponents = np.arange(0, hd, 2) / hd
            self._rope_freqs = mx.array(args.rope_theta ** exponents * np.array(args.rope_freq_factors),
                                        dtype=mx.float32)

    @property
    def plain(self) -> bool:
        """Whether this layer's attention is the plain causal kind (no window, no cap) that MLX's fused attention,
        the fused caches and Parts.attend compute."""
        return not (self.window or self.softcap)

    def rope(self, x: mx.array, offset: int) -> mx.array:
        if self.parts.rope is not None:
            return self.parts.rope(x, offset, self.rope_theta, self.rope_traditional)
        base = None if self._rope_freqs is not None else self.rope_theta
        x = mx.fast.rope(x, self.head_dim, traditional=self.rope_traditional, base=base, scale=self.rope_scale,
                         offset=offset, freqs=self._rope_freqs)
        # llama.cpp multiplies the rotation's cos and sin by the factor: the same as scaling its output
        return x if self.rope_attn_factor == 1.0 else x * self.rope_attn_factor

    def qkv(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """The query, key and value projections of x (kernels.patch may set one fused launch in its place)."""
        if "qkv_proj" in self:
            q_width, kv_width = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
            return tuple(mx.split(self.qkv_proj(x), [q_width, q_width + kv_width], axis=-1))
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def __call__(self, x: mx.array, mask=None, cache: Cache | None = None) -> mx.array:
        B, L, _ = x.shape
        q, k, v = self.qkv(x)
        q = self.q_norm(q.reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)     # (B,H,L,D)
        k = self.k_norm(k.reshape(B, L, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)  # (B,Hkv,L,D)
        v = v.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        offset = cache.offset if cache is not None else 0
        q, k = self.rope(q, offset), self.rope(k, offset)
        if cache is not None and cache.attends == "fused":   # the cache stores k, v and attends (kvcache.Cache)
            if not self.plain:
                raise ValueError(f"{type(cache).__name__} attends by itself, with no sliding window or soft cap: "
                                 "this model needs a cache that returns its keys")
            out = cache.attend(q, k, v, self.scale, mask)
        else:
            if cache is not None:
                k, v = cache.update_and_fetch(k, v)  # the history the cache keeps: (B, Hkv, T, D), newest last
            if not self.plain:
                bias = window_bias(L, k.shape[2], self.window, q.dtype)
                out = capped_attention(q, k, v, self.scale, bias, self.softcap) if self.softcap else \
                    mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=bias)
            elif self.parts.attend is not None:
                out = self.parts.attend(q, k, v, self.scale, mask == "causal")
            elif mask == "causal" and L <= SHORT_QUERIES:
                out = causal_attention(q, k, v, self.scale)
            else:
                out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MLP(nn.Module):
    parts = MLX_PARTS

    def __init__(self, args: ModelArgs):
        super().__init__()
        d, f = args.hidden_size, args.intermediate_size
        if args.spec.fused_up:   # Phi-3: ffn_up holds the gate's rows, then the up projection's
            self.up_proj = nn.Linear(d, 2 * f, bias=False)
        else:
            self.gate_proj = nn.Linear(d, f, bias=False)
            self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)
        # Gemma's GeGLU: llama.cpp's GELU is the tanh approximation, as MLX's gelu_approx
        self.act = nn.gelu_approx if args.spec.gelu else nn.silu

    def __call__(self, x: mx.array) -> mx.array:
        if "gate_proj" not in self:
            gate, up = mx.split(self.up_proj(x), 2, axis=-1)
            return self.down_proj(self.act(gate) * up)
        if self.parts.mlp is not None:
            return self.parts.mlp(x, self.gate_proj, self.up_proj, self.down_proj)
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class TransformerBlock(nn.Module):
    parts = MLX_PARTS

    def __init__(self, args: ModelArgs, layer: int = 0):
        super().__init__()
        self.self_attn = Attention(args, layer)
        self.mlp = MoE(args.hidden_size, args.expert_intermediate_size, args.num_experts, args.experts_per_token) \
            if args.num_experts else MLP(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        if args.spec.sandwich_norms:   # Gemma: the attention's and the MLP's outputs are normalised too
            self.attn_output_norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
            self.mlp_output_norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, mask=None, cache: Cache | None = None) -> mx.array:
        a = self.self_attn(rms_norm(self.input_layernorm, x, self.parts), mask, cache)
        h = x + (rms_norm(self.attn_output_norm, a, self.parts) if "attn_output_norm" in self else a)
        m = self.mlp(rms_norm(self.post_attention_layernorm, h, self.parts))
        return h + (rms_norm(self.mlp_output_norm, m, self.parts) if "mlp_output_norm" in self else m)


class Model(nn.Module):
    parts = MLX_PARTS

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [TransformerBlock(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, tokens: mx.array, cache: list[Cache] | None = None) -> mx.array:
        """Logits (B, L, vocab_size) for tokens (B, L), continuing after what `cache` holds."""
        return self.logits(self.hidden(tokens, cache))

    def hidden(self, tokens: mx.array, cache: list[Cache] | None = None) -> mx.array:
        """The last hidden states (B, L, hidden_size), after the final norm: what the LM head reads
        (and what mtp.py's multi-token-prediction heads read)."""
        return rms_norm(self.norm, self.blocks(self.embed(tokens), cache), self.parts)

    def embed(self, tokens: mx.array) -> mx.array:
        """The embedding rows of tokens (B, L) -> (B, L, hidden_size), times sqrt(hidden_size) where the
        architecture scales them (Gemma; llama.cpp scales in float32 before the first layer)."""
        h = self.embed_tokens(tokens)
        return h * math.sqrt(self.args.hidden_size) if self.args.spec.embed_scale else h

    def blocks(self, h: mx.array, cache: list[Cache] | None = None, first: int = 0, stop: int | None = None
               ) -> mx.array:
        """Hidden states (B, L, hidden_size) through decoder layers first..stop-1 (default: all), cache[k]
        serving layer first + k: the whole stack for `hidden`, one stage's share for engine/pipeline.py."""
        # "causal" lines the mask up with the *last* L keys, so it also holds after a cache offset.
        mask = "causal" if h.shape[1] > 1 else None
        for k, layer in enumerate(self.layers[first:stop]):
            h = layer(h, mask, cache[k] if cache is not None else None)
        return h

    def use(self, parts: Parts) -> Model:
        """Run this model's norms, rotary embedding, attention and MLPs through `parts` (MLX_PARTS: MLX's own);
        returns the model. A part replaces an operation whose contract the file's architecture meets: rope
        with per-frequency factors or a scaled context, and qwen3's per-head norms, stay MLX's; a model whose
        layers are not the plain Llama block (sliding windows, soft caps, experts, fused projections) is refused."""
        a = self.args
        if a.architecture not in ("llama", "qwen2", "qwen3") or a.num_experts or a.fused_qkv:
            raise ValueError(f"a {a.architecture} model{' with experts' if a.num_experts else ''}: Parts replace "
                             "the operations of the llama, qwen2 and qwen3 blocks")
        if parts.rope is not None and (self.args.rope_freq_factors is not None or self.args.rope_scaling_factor != 1):
            raise ValueError("this model's rotary embedding has per-frequency factors or a scaled context: "
                             "Parts.rope takes a base alone")
        for module in (self, *self.layers, *(b.self_attn for b in self.layers), *(b.mlp for b in self.layers)):
            module.parts = parts
        return self

    def logits(self, h: mx.array) -> mx.array:
        """The LM head: hidden states (..., hidden_size) -> logits (..., vocab_size)."""
        logits = self.embed_tokens.as_linear(h) if self.args.tie_word_embeddings else self.lm_head(h)
        cap = self.args.final_logit_softcap
        return logits if not cap else mx.tanh(logits / cap) * cap

    def make_cache(self, max_size: int | None = None, batch: int = 1, scheme: str = FLOAT, **params) -> list[Cache]:
        """One KV cache per layer for this model, for up to max_size positions (default: the context length):
        kvquant.make_caches of `scheme` (default the pre-allocated float KVCache; params go to it). A sliding-window
        layer's float cache is a kvcache.WindowKVCache, which holds only what its window can reach."""
        a = self.args
        size = max_size or a.max_position_embeddings
        dtype = self.norm.weight.dtype  # embed_tokens.weight may be quantized codes
        if params.get("fused") and not a.plain_attention:
            raise ValueError(f"fused caches attend without a sliding window or soft cap: this {a.architecture} "
                             "model needs a cache that returns its keys (fused=False)")
        if not (scheme == FLOAT and a.sliding_window):
            return make_caches(scheme, a.num_hidden_layers, batch, a.num_key_value_heads, a.head_dim, size, dtype,
                               **params)
        return [WindowKVCache(batch, a.num_key_value_heads, a.head_dim, size, dtype, window=a.sliding_window)
                if a.slides(i) else make_caches(scheme, 1, batch, a.num_key_value_heads, a.head_dim, size, dtype)[0]
                for i in range(a.num_hidden_layers)]


DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}   # the dtypes a model runs in, by name


def default_dtype() -> mx.Dtype:
    """float32 on the CPU (MLX's CPU half-precision matmuls are slow), float16 on a GPU."""
    return mx.float32 if mx.default_device() == mx.cpu else mx.float16
