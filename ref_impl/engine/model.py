"""A Llama-family decoder in MLX, loaded from a GGUF file: llama (Mistral too), qwen2 and qwen3.

One pass through the network, for tokens (B, L):

    embed -> n_layers x [ x + Attention(RMSNorm(x)),  x + MLP(RMSNorm(x)) ] -> RMSNorm -> logits

Attention is grouped-query (n_kv_heads <= n_heads key/value heads, each shared by a group of
query heads) with rotary position embeddings; the MLP is SwiGLU. The hot operations go
through `mx.fast` (rope, scaled_dot_product_attention, rms_norm), as mlx-lm does.

The three architectures differ in three switches of `ModelArgs`, one model for all:
- rope style: llama.cpp's converter reorders a llama's query and key rows for "normal" RoPE, which
  rotates *adjacent* pairs (x0, x1), (x2, x3), ... (`traditional=True` in `mx.fast.rope`); qwen2 and
  qwen3 keep Hugging Face's order, rotated NEOX-style in pairs half a head apart (x0, x_{D/2}), ...;
- attention_bias: q, k and v projections with biases (qwen2; llama.cpp reads them for any of the three);
- qk_norm: an RMSNorm over each head of the queries and keys before rope (qwen3).

Weights follow llama.cpp's conventions, so a GGUF written by llama.cpp's own converter loads as well
as the course's model: matrices are stored (out, in). Llama 3's frequency scaling arrives as the
`rope_freqs.weight` tensor, linear rope scaling as `<arch>.rope.scaling.factor`; both are applied here.

References: llama.cpp src/models/llama.cpp, qwen2.cpp, qwen3.cpp (the graphs), src/llama-model.cpp
(`llama_model_rope_type`, the hyper-parameter keys).

See chapter: intro-roofline
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ref_impl.engine.kvcache import Cache
from ref_impl.engine.kvquant import FLOAT, make_caches
from ref_impl.formats import gguf
from ref_impl.theory.shapes import ModelShape

# Query blocks this short (a speculative verification: γ + 1 positions) attend by plain matmuls and a
# softmax. MLX's CUDA backend runs `scaled_dot_product_attention` on more than one query through cuDNN,
# building a graph for each key length it meets, tens of milliseconds each: every verification step
# lands on a new length, so each would pay that build (measured in results/, experiment spec-attention).
SHORT_QUERIES = 16


@functools.lru_cache(maxsize=64)
def causal_bias(L: int, T: int, groups: int, dtype: mx.Dtype) -> mx.array:
    """(groups * L, T): 0 where query i of L (in each of `groups` query heads) may see key j of T, that is
    j <= T - L + i, and -inf elsewhere. Cached, so every layer of one forward shares one array."""
    visible = mx.arange(T)[None, :] <= mx.arange(T - L, T)[:, None]
    return mx.tile(mx.where(visible, 0.0, -mx.inf).astype(dtype), (groups, 1))


def causal_attention(q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
    """Attention of L queries (B, H, L, D) over T keys (B, Hkv, T, D), query i seeing keys up to T - L + i
    (the causal mask lined up with the last L keys), as one scaled matmul plus mask (addmm), a softmax and a
    matmul: no shape-keyed plan, and few launches, since a host-bound GPU pays for each."""
    B, H, L, D = q.shape
    n_kv, T = k.shape[1], k.shape[2]
    q = q.reshape(B, n_kv, H // n_kv * L, D)                    # each key head's group of query heads
    scores = mx.addmm(causal_bias(L, T, H // n_kv, q.dtype), q, k.swapaxes(-1, -2), alpha=scale)
    return (mx.softmax(scores, axis=-1, precise=True) @ v).reshape(B, H, L, D)


@dataclass(frozen=True)
class Architecture:
    """What sets one llama.cpp architecture apart in this decoder."""
    rope_traditional: bool   # llama.cpp's LLAMA_ROPE_TYPE_NORM (adjacent pairs); False: NEOX (pairs D/2 apart)
    qk_norm: bool            # RMSNorm over each query and key head before rope


# the `general.architecture` values this decoder reads, as llama.cpp builds them
ARCHITECTURES = {
    "llama": Architecture(rope_traditional=True, qk_norm=False),
    "qwen2": Architecture(rope_traditional=False, qk_norm=False),
    "qwen3": Architecture(rope_traditional=False, qk_norm=True),
}

# rope scaling types (`<arch>.rope.scaling.type`) this decoder applies; llama.cpp's default is "linear"
ROPE_SCALINGS = ("none", "linear")


def check_architecture(arch: Any) -> Architecture:
    """The Architecture of a `general.architecture` value; a ValueError naming it and the supported ones."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch!r}: this decoder reads {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[arch]


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
    rope_freq_factors: tuple[float, ...] | None = None   # Llama 3 scaling: one divisor per frequency
    rope_scaling_factor: float = 1.0   # linear scaling: positions divided by it (llama.cpp's 1 / freq_scale)
    architecture: str = "llama"        # a key of ARCHITECTURES: the rope style, q/k norms
    attention_bias: bool = False       # biases on the q, k and v projections (qwen2)

    def __post_init__(self):
        check_architecture(self.architecture)
        if self.rope_scaling_factor <= 0:
            raise ValueError(f"rope scaling factor {self.rope_scaling_factor} must be positive")
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.head_dim // 2:
            raise ValueError(f"rope_freqs has {len(self.rope_freq_factors)} factors, "
                             f"a head of {self.head_dim} needs {self.head_dim // 2}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple "
                             f"of num_key_value_heads ({self.num_key_value_heads})")

    @property
    def rope_traditional(self) -> bool:
        return ARCHITECTURES[self.architecture].rope_traditional

    @property
    def qk_norm(self) -> bool:
        return ARCHITECTURES[self.architecture].qk_norm

    @property
    def num_parameters(self) -> int:
        """Weights in the network (the tied embedding counted once)."""
        d, f, hd = self.hidden_size, self.intermediate_size, self.head_dim
        attn = d * hd * (2 * self.num_attention_heads + 2 * self.num_key_value_heads)
        attn += hd * (self.num_attention_heads + 2 * self.num_key_value_heads) * self.attention_bias
        block = attn + 3 * d * f + 2 * d + 2 * hd * self.qk_norm
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.num_hidden_layers * block + d + head

    @classmethod
    def from_gguf(cls, metadata: dict[str, Any], tensors: dict[str, gguf.TensorInfo],
                  rope_freq_factors: tuple[float, ...] | None = None) -> ModelArgs:
        """Read the hyper-parameters from GGUF metadata under the keys llama.cpp reads for the file's
        architecture (`<arch>.embedding_length`, ...), and biases from the tensors present."""
        arch = metadata.get("general.architecture")
        check_architecture(arch)

        def key(name: str, default: Any = None) -> Any:
            value = metadata.get(f"{arch}.{name}", default)
            if value is None:
                raise ValueError(f"GGUF metadata lacks '{arch}.{name}'")
            return value

        if "token_embd.weight" not in tensors:
            raise ValueError("GGUF file has no 'token_embd.weight' tensor")
        if rope_freq_factors is not None and arch != "llama":
            raise ValueError(f"a {arch} file with rope_freqs.weight: llama.cpp's {arch} graph applies no "
                             "frequency factors (only llama's does)")
        scaling = key("rope.scaling.type", "linear")
        if scaling not in ROPE_SCALINGS:
            raise ValueError(f"{arch}.rope.scaling.type is {scaling!r}: this decoder applies "
                             f"{', '.join(ROPE_SCALINGS)}")
        # llama.cpp: factor 0 (or absent) and type "none" both mean no scaling; "scale_linear" is the old key
        factor = float(key("rope.scaling.factor", key("rope.scale_linear", 0.0))) if scaling == "linear" else 0.0
        vocab_size = tensors["token_embd.weight"].shape[0]
        args = cls(
            vocab_size=int(key("vocab_size", vocab_size)),
            hidden_size=int(key("embedding_length")),
            num_hidden_layers=int(key("block_count")),
            intermediate_size=int(key("feed_forward_length")),
            num_attention_heads=int(key("attention.head_count")),
            num_key_value_heads=int(key("attention.head_count_kv", key("attention.head_count"))),
            head_dim=int(key("attention.key_length", 0)),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            max_position_embeddings=int(key("context_length")),
            tie_word_embeddings="output.weight" not in tensors,
            rope_freq_factors=rope_freq_factors,
            rope_scaling_factor=factor or 1.0,
            architecture=arch,
            attention_bias="blk.0.attn_q.bias" in tensors,
        )
        # llama.cpp's llama, qwen2 and qwen3 graphs rotate whole heads, with values as wide as keys; so does this one
        for name in ("rope.dimension_count", "attention.value_length"):
            if int(key(name, args.head_dim)) != args.head_dim:
                raise ValueError(f"{arch}.{name} ({metadata[f'{arch}.{name}']}) must equal the head dimension "
                                 f"({args.head_dim})")
        return args

    @classmethod
    def from_shape(cls, shape: ModelShape, context: int = 4096) -> ModelArgs:
        """The decoder's hyper-parameters for a shape of theory/shapes.py, attending to `context` positions;
        a ValueError when the shape is not the Llama architecture this decoder builds."""
        if not shape.is_llama:
            raise ValueError(f"{shape.name} is not the Llama architecture this decoder builds "
                             "(query/key norms, a sliding window or a mixture of experts)")
        return cls(shape.vocab_size, shape.hidden_size, shape.num_hidden_layers, shape.intermediate_size,
                   shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim,
                   max_position_embeddings=context, tie_word_embeddings=shape.tie_word_embeddings)

    def shape(self, name: str) -> ModelShape:
        """This model as a shape of theory/shapes.py, for the roofline's arithmetic."""
        return ModelShape(name, self.vocab_size, self.hidden_size, self.num_hidden_layers, self.intermediate_size,
                          self.num_attention_heads, self.num_key_value_heads, self.head_dim,
                          self.tie_word_embeddings, "ref_impl.engine.model.ModelArgs", qk_norm=self.qk_norm)

    def gguf_metadata(self) -> dict[str, Any]:
        """The metadata llama.cpp needs to load this model, under its architecture's prefix."""
        a = self.architecture
        scaling = {f"{a}.rope.scaling.type": "linear", f"{a}.rope.scaling.factor": self.rope_scaling_factor}
        return {
            "general.architecture": a,
            f"{a}.vocab_size": self.vocab_size,
            f"{a}.context_length": self.max_position_embeddings,
            f"{a}.embedding_length": self.hidden_size,
            f"{a}.block_count": self.num_hidden_layers,
            f"{a}.feed_forward_length": self.intermediate_size,
            f"{a}.attention.head_count": self.num_attention_heads,
            f"{a}.attention.head_count_kv": self.num_key_value_heads,
            f"{a}.attention.key_length": self.head_dim,
            f"{a}.attention.value_length": self.head_dim,
            f"{a}.rope.dimension_count": self.head_dim,
            f"{a}.rope.freq_base": self.rope_theta,
            **(scaling if self.rope_scaling_factor != 1.0 else {}),
            f"{a}.attention.layer_norm_rms_epsilon": self.rms_norm_eps,
        }


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


class Attention(nn.Module):
    parts = MLX_PARTS

    def __init__(self, args: ModelArgs):
        super().__init__()
        d, hd = args.hidden_size, args.head_dim
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.scale = hd ** -0.5
        bias = args.attention_bias
        self.q_proj = nn.Linear(d, self.n_heads * hd, bias=bias)
        self.k_proj = nn.Linear(d, self.n_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(d, self.n_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=False)
        # qwen3 normalises each head of the queries and keys; elsewhere the heads pass unchanged
        self.q_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps) if args.qk_norm else nn.Identity()
        self.k_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps) if args.qk_norm else nn.Identity()
        self.head_dim, self.rope_theta = hd, args.rope_theta
        self.rope_traditional, self.rope_scale = args.rope_traditional, 1.0 / args.rope_scaling_factor
        self._rope_freqs = None  # wavelengths; the underscore keeps them out of the parameters
        if args.rope_freq_factors is not None:
            # llama.cpp divides each rotation frequency by its factor; MLX takes wavelengths
            exponents = np.arange(0, hd, 2) / hd
            self._rope_freqs = mx.array(args.rope_theta ** exponents * np.array(args.rope_freq_factors),
                                        dtype=mx.float32)

    def rope(self, x: mx.array, offset: int) -> mx.array:
        if self.parts.rope is not None:
            return self.parts.rope(x, offset, self.rope_theta, self.rope_traditional)
        base = None if self._rope_freqs is not None else self.rope_theta
        return mx.fast.rope(x, self.head_dim, traditional=self.rope_traditional, base=base, scale=self.rope_scale,
                            offset=offset, freqs=self._rope_freqs)

    def qkv(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """The query, key and value projections of x (kernels.patch may set one fused launch in its place)."""
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
            out = cache.attend(q, k, v, self.scale, mask)
        else:
            if cache is not None:
                k, v = cache.update_and_fetch(k, v)  # whole history: (B, Hkv, offset + L, D)
            if self.parts.attend is not None:
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
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        if self.parts.mlp is not None:
            return self.parts.mlp(x, self.gate_proj, self.up_proj, self.down_proj)
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerBlock(nn.Module):
    parts = MLX_PARTS

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, mask=None, cache: Cache | None = None) -> mx.array:
        h = x + self.self_attn(rms_norm(self.input_layernorm, x, self.parts), mask, cache)
        return h + self.mlp(rms_norm(self.post_attention_layernorm, h, self.parts))


class Model(nn.Module):
    parts = MLX_PARTS

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [TransformerBlock(args) for _ in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, tokens: mx.array, cache: list[Cache] | None = None) -> mx.array:
        """Logits (B, L, vocab_size) for tokens (B, L), continuing after what `cache` holds."""
        return self.logits(self.hidden(tokens, cache))

    def hidden(self, tokens: mx.array, cache: list[Cache] | None = None) -> mx.array:
        """The last hidden states (B, L, hidden_size), after the final norm: what the LM head reads
        (and what mtp.py's multi-token-prediction heads read)."""
        return rms_norm(self.norm, self.blocks(self.embed_tokens(tokens), cache), self.parts)

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
        with per-frequency factors or a scaled context, and qwen3's per-head norms, stay MLX's."""
        if parts.rope is not None and (self.args.rope_freq_factors is not None or self.args.rope_scaling_factor != 1):
            raise ValueError("this model's rotary embedding has per-frequency factors or a scaled context: "
                             "Parts.rope takes a base alone")
        for module in (self, *self.layers, *(b.self_attn for b in self.layers), *(b.mlp for b in self.layers)):
            module.parts = parts
        return self

    def logits(self, h: mx.array) -> mx.array:
        """The LM head: hidden states (..., hidden_size) -> logits (..., vocab_size)."""
        if self.args.tie_word_embeddings:
            return self.embed_tokens.as_linear(h)
        return self.lm_head(h)

    def make_cache(self, max_size: int | None = None, batch: int = 1, scheme: str = FLOAT, **params) -> list[Cache]:
        """One KV cache per layer for this model, for up to max_size positions (default: the context length):
        kvquant.make_caches of `scheme` (default the pre-allocated float KVCache; params go to it)."""
        a = self.args
        size = max_size or a.max_position_embeddings
        dtype = self.norm.weight.dtype  # embed_tokens.weight may be quantized codes
        return make_caches(scheme, a.num_hidden_layers, batch, a.num_key_value_heads, a.head_dim, size, dtype,
                           **params)


DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}   # the dtypes a model runs in, by name


def default_dtype() -> mx.Dtype:
    """float32 on the CPU (MLX's CPU half-precision matmuls are slow), float16 on a GPU."""
    return mx.float32 if mx.default_device() == mx.cpu else mx.float16
