"""The llama.cpp architectures this decoder reads: what sets each apart, and its hyper-parameters in GGUF metadata.

One decoder (model.py) runs them all; an `Architecture` lists the switches that differ, and `read_hparams` reads a
file's `<arch>.*` keys the way llama.cpp's loader does, with llama.cpp's defaults where a key is absent:

- llama (Mistral too; Mixtral when the file has expert tensors): adjacent-pair ("normal") rope, SwiGLU;
- qwen2: NEOX rope (pairs half a head apart), biases on q, k and v;
- qwen3: qwen2 without biases, an RMSNorm over each query and key head before rope;
- qwen3moe: qwen3 with a mixture-of-experts MLP (engine/moe.py) in every layer;
- gemma2: embeddings times sqrt(d), GeGLU (tanh GELU), a norm after attention and after the MLP as well as before,
  sliding-window attention on every other layer (window 4096 unless the file says), attention scores soft-capped
  at 50 (tanh(s / 50) * 50) and logits at 30;
- gemma3: gemma2's block with qwen3's query/key norms, five sliding-window layers in six whose rope base is
  10,000 (`rope.freq_base_swa`), no soft-capping unless the file asks for it;
- phi3 (Phi-3, Phi-4): one fused q-k-v matrix and one fused gate-up matrix, NEOX rope with per-frequency factors
  (`rope_factors_short` / `rope_factors_long`, the long ones when the context exceeds the original one) and an
  attention factor on the rotation. llama.cpp ignores Phi-3's sliding window (llama.cpp PR #13676: results "might be
  suboptimal"), and so, to give llama.cpp's logits, does this decoder.

Gemma's converter stores its norm weights with the 1 that Hugging Face adds at run time already added, so every norm
here is the plain x / rms(x) * w.

References: llama.cpp src/models/{llama,qwen2,qwen3,qwen3moe,gemma2,gemma3,phi3}.cpp (the graphs), src/llama-model.cpp
(`llama_model_rope_type`, rope bases and factors per layer), src/llama-hparams.cpp (`set_swa_pattern`),
src/llama-hparams.h (the soft-capping defaults), src/llama-arch.cpp (key and tensor names).
See chapter: intro-roofline
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ref_impl.formats import gguf


@dataclass(frozen=True)
class Architecture:
    """What sets one llama.cpp architecture apart in this decoder."""
    rope_traditional: bool       # llama.cpp's LLAMA_ROPE_TYPE_NORM (adjacent pairs); False: NEOX (pairs D/2 apart)
    qk_norm: bool = False        # RMSNorm over each query and key head before rope
    gelu: bool = False           # GeGLU (tanh-approximated GELU) in place of SwiGLU
    sandwich_norms: bool = False  # an RMSNorm on the attention's and the MLP's outputs too (Gemma)
    embed_scale: bool = False    # embeddings multiplied by sqrt(hidden_size) (Gemma)
    fused_up: bool = False       # ffn_up holds gate and up, gate first (Phi-3)
    experts: bool = False        # every layer's MLP is a mixture of experts
    swa_pattern: int = 0         # with a window: llama.cpp's default pattern (layer i slides if i % n < n - 1)


ARCHITECTURES = {   # the `general.architecture` values this decoder reads, as llama.cpp builds them
    "llama": Architecture(rope_traditional=True),
    "qwen2": Architecture(rope_traditional=False),
    "qwen3": Architecture(rope_traditional=False, qk_norm=True),
    "qwen3moe": Architecture(rope_traditional=False, qk_norm=True, experts=True),
    "gemma2": Architecture(rope_traditional=False, gelu=True, sandwich_norms=True, embed_scale=True, swa_pattern=2),
    "gemma3": Architecture(rope_traditional=False, qk_norm=True, gelu=True, sandwich_norms=True, embed_scale=True,
                           swa_pattern=6),
    "phi3": Architecture(rope_traditional=False, fused_up=True),
}

# rope scaling types (`<arch>.rope.scaling.type`) this decoder applies; llama.cpp's default is "linear"
ROPE_SCALINGS = ("none", "linear")

GEMMA2_WINDOW = 4096                 # llama.cpp's gemma2 window when the file names none
GEMMA2_CAPS = (50.0, 30.0)           # llama.cpp's default attention and final soft caps (llama-hparams.h)
GEMMA3_LOCAL_BASE = 10000.0          # llama.cpp's rope base of sliding layers without `rope.freq_base_swa`
LARGEST_GEMMA_LAYERS = {"gemma2": 46, "gemma3": 62}   # the 27B models: llama.cpp scales queries by 1/sqrt(d / heads)


def check_architecture(arch: Any) -> Architecture:
    """The Architecture of a `general.architecture` value; a ValueError naming it and the supported ones."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch!r}: this decoder reads {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[arch]


def swa_layers(n_layers: int, pattern: int) -> tuple[bool, ...]:
    """Which layers use the sliding window for llama.cpp's `set_swa_pattern(pattern)`: layer i slides when
    i % pattern < pattern - 1 (pattern 2: every other layer from the first; 6: five of every six); 0: all slide."""
    return tuple(pattern == 0 or i % pattern < pattern - 1 for i in range(n_layers))


def read_hparams(metadata: dict[str, Any], tensors: dict[str, gguf.TensorInfo]) -> dict[str, Any]:
    """ModelArgs' fields read from a GGUF file's metadata and tensor list under the keys, and with the defaults,
    llama.cpp's loader uses for the file's architecture. Rope factors held in tensors are read by the caller."""
    arch = metadata.get("general.architecture")
    spec = check_architecture(arch)

    def key(name: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks '{arch}.{name}'")
        return value

    if "token_embd.weight" not in tensors:
        raise ValueError("GGUF file has no 'token_embd.weight' tensor")
    scaling = key("rope.scaling.type", "linear")
    if scaling not in ROPE_SCALINGS:
        raise ValueError(f"{arch}.rope.scaling.type is {scaling!r}: this decoder applies {', '.join(ROPE_SCALINGS)}")
    # llama.cpp: factor 0 (or absent) and type "none" both mean no scaling; "scale_linear" is the old key
    factor = float(key("rope.scaling.factor", key("rope.scale_linear", 0.0))) if scaling == "linear" else 0.0
    heads = int(key("attention.head_count"))
    n_layers, d = int(key("block_count")), int(key("embedding_length"))
    head_dim = int(key("attention.key_length", d // heads))
    hp = dict(
        vocab_size=int(key("vocab_size", tensors["token_embd.weight"].shape[0])),
        hidden_size=d, num_hidden_layers=n_layers, intermediate_size=int(key("feed_forward_length")),
        num_attention_heads=heads, num_key_value_heads=int(key("attention.head_count_kv", heads)),
        head_dim=head_dim, rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)), max_position_embeddings=int(key("context_length")),
        tie_word_embeddings="output.weight" not in tensors, rope_scaling_factor=factor or 1.0,
        architecture=arch, attention_bias="blk.0.attn_q.bias" in tensors,
        fused_qkv="blk.0.attn_qkv.weight" in tensors)
    if arch == "gemma2" and "output.weight" in tensors:
        raise ValueError("a gemma2 file with output.weight: llama.cpp's gemma2 graph ties the output to token_embd")
    if arch in LARGEST_GEMMA_LAYERS and n_layers == LARGEST_GEMMA_LAYERS[arch]:
        hp["query_scale"] = 1 / math.sqrt(d // heads)
    if arch == "gemma2":
        hp["attn_logit_softcap"] = float(key("attn_logit_softcapping", GEMMA2_CAPS[0]))
        hp["final_logit_softcap"] = float(key("final_logit_softcapping", GEMMA2_CAPS[1]))
        hp["sliding_window"] = int(key("attention.sliding_window", GEMMA2_WINDOW))
        hp["rope_theta_local"] = float(key("rope.freq_base_swa", hp["rope_theta"]))
        hp["rope_scaling_factor_local"] = hp["rope_scaling_factor"]
    if arch == "gemma3":
        hp["final_logit_softcap"] = float(key("final_logit_softcapping", 0.0))
        hp["sliding_window"] = int(key("attention.sliding_window", 0))
        hp["rope_theta_local"] = float(key("rope.freq_base_swa", GEMMA3_LOCAL_BASE))
    if hp.get("sliding_window", 0) > 0:
        pattern = key("attention.sliding_window_pattern", spec.swa_pattern)
        hp["sliding_layers"] = (tuple(bool(b) for b in pattern) if isinstance(pattern, (list, tuple))
                                else swa_layers(n_layers, int(pattern)))
    if arch == "phi3":
        hp["rope_attn_factor"] = float(key("rope.scaling.attn_factor", 1.0))
        hp["rope_original_context"] = int(key("rope.scaling.original_context_length", hp["max_position_embeddings"]))
    if "blk.0.ffn_gate_inp.weight" in tensors:
        if arch not in ("llama", "qwen3moe"):
            raise ValueError(f"a {arch} file with expert tensors (blk.0.ffn_gate_inp): this decoder runs experts "
                             "in llama and qwen3moe files")
        used = int(key("expert_used_count"))
        # llama.cpp's llama graph sizes its experts by feed_forward_length; qwen3moe reads its own key
        hp.update(num_experts=int(key("expert_count")), experts_per_token=used,
                  expert_intermediate_size=hp["intermediate_size"] if arch == "llama"
                  else int(key("expert_feed_forward_length", hp["intermediate_size"] // used)))
    elif spec.experts:
        raise ValueError(f"a {arch} file needs expert tensors (blk.0.ffn_gate_inp.weight), and this one has none")
    # llama.cpp's graphs here rotate whole heads, with values as wide as keys; so does this decoder
    for name in ("rope.dimension_count", "attention.value_length"):
        if int(key(name, head_dim)) != head_dim:
            raise ValueError(f"{arch}.{name} ({metadata[f'{arch}.{name}']}) must equal the head dimension ({head_dim})")
    return hp


def hparam_keys(args: Any) -> dict[str, Any]:
    """The metadata llama.cpp needs to load a model of ModelArgs `args`, under its architecture's prefix: the
    inverse of read_hparams."""
    a = args.architecture
    meta = {
        "general.architecture": a,
        f"{a}.vocab_size": args.vocab_size,
        f"{a}.context_length": args.max_position_embeddings,
        f"{a}.embedding_length": args.hidden_size,
        f"{a}.block_count": args.num_hidden_layers,
        f"{a}.feed_forward_length": args.intermediate_size,
        f"{a}.attention.head_count": args.num_attention_heads,
        f"{a}.attention.head_count_kv": args.num_key_value_heads,
        f"{a}.attention.key_length": args.head_dim,
        f"{a}.attention.value_length": args.head_dim,
        f"{a}.rope.dimension_count": args.head_dim,
        f"{a}.rope.freq_base": args.rope_theta,
        f"{a}.attention.layer_norm_rms_epsilon": args.rms_norm_eps,
    }
    if args.rope_scaling_factor != 1.0:
        meta |= {f"{a}.rope.scaling.type": "linear", f"{a}.rope.scaling.factor": args.rope_scaling_factor}
    if a == "gemma2":
        meta |= {f"{a}.attn_logit_softcapping": args.attn_logit_softcap,
                 f"{a}.final_logit_softcapping": args.final_logit_softcap}
    elif args.final_logit_softcap:
        meta[f"{a}.final_logit_softcapping"] = args.final_logit_softcap
    if args.sliding_window:
        # the pattern as llama.cpp's converters write it: a period when one fits, else one flag per layer
        pattern = next((n for n in range(2, args.num_hidden_layers + 1)
                        if swa_layers(args.num_hidden_layers, n) == args.sliding_layers), list(args.sliding_layers))
        meta |= {f"{a}.attention.sliding_window": args.sliding_window,
                 f"{a}.attention.sliding_window_pattern": pattern,
                 f"{a}.rope.freq_base_swa": args.rope_theta_local}
    if a == "phi3":
        meta |= {f"{a}.rope.scaling.attn_factor": args.rope_attn_factor,
                 f"{a}.rope.scaling.original_context_length": args.rope_original_context}
    if args.num_experts:
        meta |= {f"{a}.expert_count": args.num_experts, f"{a}.expert_used_count": args.experts_per_token,
                 f"{a}.expert_feed_forward_length": args.expert_intermediate_size}
    return meta
