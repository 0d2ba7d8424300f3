"""A model's weights in a GGUF file: tensor names, loading and saving.

llama.cpp names a Llama's tensors `token_embd.weight`, `blk.3.attn_q.weight`, `output_norm.weight`
(a Qwen2's also `blk.3.attn_q.bias`, a Qwen3's `blk.3.attn_q_norm.weight`);
model.py names its parameters as Hugging Face and mlx-lm do (`embed_tokens.weight`,
`layers.3.self_attn.q_proj.weight`, `norm.weight`). One table maps the names both ways, and the
loader checks that a file holds exactly the model's tensors, in the model's shapes, before loading
anything. The hyper-parameters come from the file's `<architecture>.*` metadata (ModelArgs.from_gguf:
architectures.py lists the architectures), and rope factors from `rope_freqs.weight` (Llama 3) or
`rope_factors_*` (Phi-3).

Quantized tensors either expand to floats (`GGUFFile.dequantize`, the kquants decoders) or, with
`quantized=True`, stay quantized as MLX affine layers (transcode.py). `save` writes float32, the
file the course's training ships and llama.cpp loads; formats/quantize.py turns it into the
llama.cpp file types.

References: llama.cpp src/llama-arch.cpp (LLM_TENSOR_NAMES); mlx-lm gguf.py `translate_weight_names`.
See chapter: gguf
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ref_impl.engine import transcode
from ref_impl.engine.model import Model, ModelArgs, default_dtype
from ref_impl.engine.tokenizer import Tokenizer
from ref_impl.formats import gguf
from ref_impl.formats.ggml import GGMLType
from ref_impl.formats.quantize import as_float32, roundtrip

# GGUF tensor names (llama.cpp) -> this module's parameter names (Hugging Face / mlx-lm style).
GGUF_TOP_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}
GGUF_BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "self_attn.qkv_proj",                                        # Phi-3's fused projections
    "post_attention_norm": "attn_output_norm", "post_ffw_norm": "mlp_output_norm",   # Gemma's sandwich norms
    "ffn_gate_inp": "mlp.router", "ffn_gate_exps": "mlp.gate_exps",          # a mixture of experts (moe.py)
    "ffn_up_exps": "mlp.up_exps", "ffn_down_exps": "mlp.down_exps",
}
ROPE_FACTORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")  # read into args


def gguf_to_mlx_name(name: str) -> str:
    """'blk.3.attn_q.weight' -> 'layers.3.self_attn.q_proj.weight'."""
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in GGUF_BLOCK_NAMES:
        return f"layers.{parts[1]}.{GGUF_BLOCK_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in GGUF_TOP_NAMES:
        return f"{GGUF_TOP_NAMES[parts[0]]}.{parts[1]}"
    raise ValueError(f"unexpected tensor {name!r} in a GGUF file of the architectures this decoder reads")


def mlx_to_gguf_name(name: str) -> str:
    """The inverse of gguf_to_mlx_name."""
    stem, leaf = name.rsplit(".", 1)
    if stem.startswith("layers."):
        _, i, sub = stem.split(".", 2)
        block = {m: g for g, m in GGUF_BLOCK_NAMES.items()}
        if sub in block:
            return f"blk.{i}.{block[sub]}.{leaf}"
    top = {m: g for g, m in GGUF_TOP_NAMES.items()}
    if stem in top:
        return f"{top[stem]}.{leaf}"
    raise ValueError(f"no GGUF name for parameter {name!r}")


def gguf_weight_names(f: gguf.GGUFFile, model: Model) -> dict[str, str]:
    """GGUF tensor name -> model parameter name for every weight in f, after checking that the file
    holds exactly the model's tensors in the model's shapes (rope_freqs, read into args, is left out)."""
    expected = dict(nn.utils.tree_flatten(model.parameters()))
    names = {}
    for name, info in f.tensors.items():
        if name in ROPE_FACTORS:
            continue
        mlx_name = gguf_to_mlx_name(name)
        if mlx_name not in expected:
            raise ValueError(f"tensor {name!r} does not belong to a {model.args.num_hidden_layers}-layer model")
        if tuple(info.shape) != tuple(expected[mlx_name].shape):
            raise ValueError(f"tensor {name!r} has shape {info.shape}, "
                             f"the model expects {tuple(expected[mlx_name].shape)}")
        names[name] = mlx_name
    missing = sorted(set(expected) - set(names.values()))
    if missing:
        raise ValueError(f"GGUF file lacks tensors for: {', '.join(missing[:5])}"
                         + (" ..." if len(missing) > 5 else ""))
    return names


def model_args(f: gguf.GGUFFile) -> ModelArgs:
    """The hyper-parameters of an open GGUF file, its rope frequency factors included: Llama 3's `rope_freqs`, or
    Phi-3's long factors where the file's context exceeds the original one, its short ones otherwise (llama.cpp's
    `llama_model::get_rope_factors`, run at the file's context, as llama.cpp runs by default)."""
    def factors(name: str) -> tuple[float, ...]:
        return tuple(f.dequantize(name).astype(float).tolist())

    args = ModelArgs.from_gguf(f.metadata, f.tensors)
    found = [n for n in ROPE_FACTORS if n in f.tensors]
    if not found:
        return args
    if "rope_freqs.weight" in found:
        return ModelArgs.from_gguf(f.metadata, f.tensors, factors("rope_freqs.weight"))
    if set(found) != {"rope_factors_long.weight", "rope_factors_short.weight"}:
        raise ValueError(f"the file has {found[0]} alone: Phi-3's long rope needs rope_factors_long and _short")
    long = args.max_position_embeddings > args.rope_original_context
    return ModelArgs.from_gguf(f.metadata, f.tensors, factors(f"rope_factors_{'long' if long else 'short'}.weight"))


def _to_mlx(f: gguf.GGUFFile, name: str, dtype: mx.Dtype) -> mx.array:
    info = f.tensors[name]
    if info.type in (GGMLType.F32, GGMLType.F16):
        return mx.array(f.array(name)).astype(dtype)
    if info.type == GGMLType.BF16:
        return mx.array(f.array(name)).view(mx.bfloat16).astype(dtype)
    return mx.array(f.dequantize(name)).astype(dtype)


def load_model(f: gguf.GGUFFile, dtype: mx.Dtype | None = None, quantized: bool = False,
               scale_dtype: mx.Dtype | None = None, keep: Callable[[Model], None] | None = None) -> Model:
    """Build a Model from an open GGUF file, weights cast to dtype (default: model.default_dtype()).

    quantized=True keeps quantized matrices quantized: MLX QuantizedLinear/QuantizedEmbedding layers
    with the file's bits (transcode.swap_quantized), their scales and biases in scale_dtype (default:
    dtype); norms, float tensors and types with no MLX mapping load as floats in dtype.
    keep(model) removes, once the file is checked against the whole model, the parts this process will not
    hold (a pipeline stage's, engine/pipeline.py): their tensors are then never read.
    """
    dtype = dtype or default_dtype()
    model = Model(model_args(f))
    names = gguf_weight_names(f, model)
    if keep is not None:
        keep(model)
        held = dict(nn.utils.tree_flatten(model.parameters()))
        names = {name: mlx_name for name, mlx_name in names.items() if mlx_name in held}
    kept = transcode.swap_quantized(model, f, names, scale_dtype or dtype) if quantized else {}
    weights = [w for arrays in kept.values() for w in arrays]
    weights += [(mlx_name, _to_mlx(f, name, dtype)) for name, mlx_name in names.items() if name not in kept]
    model.load_weights(weights)
    mx.eval(model.parameters())
    return model


def load(path: str | Path, dtype: mx.Dtype | None = None, quantized: bool = False,
         keep: Callable[[Model], None] | None = None) -> tuple[Model, Tokenizer]:
    """Load a GGUF file of an architecture this decoder reads: the model and its tokenizer (quantized, keep: see
    load_model)."""
    with gguf.read(path) as f:
        return load_model(f, dtype, quantized, keep=keep), Tokenizer.from_gguf_metadata(f.metadata)


def save(model: Model, tokenizer: Tokenizer, path: str | Path, metadata: dict[str, Any] | None = None) -> None:
    """Write model and tokenizer as a float32 GGUF file of the model's architecture (llama.cpp loads it too)."""
    if tokenizer.vocab_size != model.args.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens, the model "
                         f"{model.args.vocab_size}")
    meta = {**model.args.gguf_metadata(), "general.file_type": 0,  # 0: all F32, llama.cpp's LLAMA_FTYPE_ALL_F32
            **(metadata or {}), **tokenizer.gguf_metadata()}
    tensors = {mlx_to_gguf_name(k): np.array(v.astype(mx.float32))
               for k, v in nn.utils.tree_flatten(model.parameters())}
    if model.args.rope_freq_factors is not None:
        tensors["rope_freqs.weight"] = np.array(model.args.rope_freq_factors, dtype=np.float32)
    gguf.write(path, meta, tensors)


def simulate(path: str | os.PathLike, type_name: str, select: Callable[[str], bool] = lambda name: True) -> Model:
    """The float model at `path` in float32, with the matrices whose GGUF names `select` accepts replaced
    by their round trip through `type_name` (quantize.roundtrip): what one format does to chosen layers,
    with every other weight exact. See chapter: kquants"""
    with gguf.read(path) as f:
        model = load_model(f, mx.float32)
        chosen = [n for n, t in f.tensors.items() if len(t.shape) == 2 and select(n)]
        model.load_weights([(gguf_to_mlx_name(n), mx.array(roundtrip(as_float32(f, n), type_name)))
                            for n in chosen], strict=False)
    return model


def matrix_types(f: gguf.GGUFFile) -> str:
    """The GGML types of an open file's matrices, most common first, e.g. "Q4_K/Q6_K" (what a run reports)."""
    return "/".join(t for t, _ in Counter(t.type.name for t in f.tensors.values() if len(t.shape) == 2).most_common())


def weight_types(path: str | os.PathLike) -> str:
    """matrix_types of the file at `path`."""
    with gguf.read(path) as f:
        return matrix_types(f)
