"""Exercises of chapter "The roofline" (book/intro/roofline): Tasks 1 to 5.

Bytes per decoded token, a matmul's arithmetic intensity, a machine's ridge point, the decode
tokens/s bound and the weight bytes a mixture of experts reads per token, each checked against
`theory.roofline` on public model shapes (`theory.shapes`).
Tests: `pytest tests/test_exercises_roofline.py -k task_1` (or `task_2`, ...).

See chapter: intro-roofline
"""

from __future__ import annotations

from collections.abc import Callable

from ref_impl.exercises.core import Result, judge_cases, unit_slips
from ref_impl.theory import roofline as rl
from ref_impl.theory import shapes

# Task 1 -------------------------------------------------------------------------------------

def _bytes_case(model: str, bits: float, context: int):
    s = shapes.shape(model)
    right = rl.decode_bytes_per_token(s, bits, context)
    w, kv = rl.weight_bytes(s, bits), rl.kv_cache_bytes(s, context)     # its two parts, for the slips
    mistakes = [
        (8 * right, "bits vs bytes? Everything came out 8× too big: divide bits by 8."),
        (8 * w + kv, f"bits vs bytes? A weight at {bits:g} bits is {bits / 8:g} bytes: N × b / 8."),
        (w, f"you left out the KV cache: at context {context:,} the token also reads {kv:,.4g} bytes of K and V."),
        (w + kv / 2, "did you count K and V? The cache holds both, hence the factor 2."),
        (w + kv / s.num_hidden_layers, "every layer has its own KV cache: multiply by the number of layers."),
        (w + kv * s.num_attention_heads / s.num_key_value_heads,
         "grouped-query attention caches num_key_value_heads heads, not num_attention_heads."),
        (w + kv * 2, "KV entries are 2 bytes (16-bit) here; did you count 4?"),
        *unit_slips(right, "bytes"),
    ]
    return (s, bits, context), f"{model}, {bits:g} bits/weight, context {context:,}", right, mistakes


def check_bytes_per_token(answer: float | Callable, model: str = "Llama-3.1-8B",
                          bits_per_weight: float = 4.0, context: int = 8192) -> Result:
    """Task 1: bytes read from memory to generate one token, weights plus the KV cache read.

    `answer` is a number of bytes for (`model`, `bits_per_weight`, `context`), or a function
    `f(shape: ModelShape, bits_per_weight, context) -> bytes`, called on four configurations. KV
    entries are 2 bytes; `roofline.param_count(shape)` gives the number of weights. Checked
    against `roofline.decode_bytes_per_token`.
    """
    cases = [_bytes_case(model, bits_per_weight, context), _bytes_case("Llama-3.2-1B", 16, 1),
             _bytes_case("Qwen3-8B", 4.5, 32768), _bytes_case("Llama-3.2-3B", 8, 4096)]
    return judge_cases("Task 1", answer, cases, "bytes", "bytes = N × b / 8 + 2 (K and V) × layers × "
                       "kv_heads × head_dim × 2 bytes × context.")


# Task 2 -------------------------------------------------------------------------------------

def _intensity_case(n: int, k: int, m: int, bits: float):
    right = rl.matmul_intensity(n, k, m, bits, act_bytes=2)
    flops, w, act = 2 * n * k * m, k * m * bits / 8, (n * k + n * m) * 2
    mistakes = [
        (right / 2, "FLOPs are 2 per multiply-add: (n×k)@(k×m) does 2·n·k·m of them."),
        (flops / (8 * w + act), f"bits vs bytes? A weight at {bits:g} bits is {bits / 8:g} bytes."),
        (flops / w, "activations move too: n×k values read and n×m written, 2 bytes each."),
        (flops / (n * w + act), "the weights are read once for all n tokens, not once per token: "
                                "that reuse is the point of batching."),
        (1 / right, "upside down: intensity is FLOPs divided by bytes."),
    ]
    return (n, k, m, bits), f"n={n}, {k}×{m}, {bits:g} bits/weight", right, mistakes


def check_matmul_intensity(answer: float | Callable, n_tokens: int = 1, k: int = 4096, m: int = 14336,
                           bits_per_weight: float = 16) -> Result:
    """Task 2: arithmetic intensity (FLOP/byte) of (n_tokens × k) @ (k × m) with weights at b bits.

    `answer` is a number for the given shape, or a function `f(n_tokens, k, m, bits_per_weight)`
    called on GEMV (n = 1) and GEMM (n in the hundreds) shapes. Activations are 2 bytes, read
    (n×k) and written (n×m) once. Checked against `roofline.matmul_intensity`.
    """
    cases = [_intensity_case(n_tokens, k, m, bits_per_weight), _intensity_case(512, 4096, 14336, 16),
             _intensity_case(1, 4096, 4096, 4), _intensity_case(256, 2048, 8192, 4.5)]
    return judge_cases("Task 2", answer, cases, "FLOP/byte",
                       "FLOPs 2·n·k·m over bytes k·m·b/8 (weights, once) + (n·k + n·m)·2 (activations).")


# Task 3 -------------------------------------------------------------------------------------

def _ridge_case(name: str):
    hw = rl.HARDWARE[name]
    right = rl.ridge_point(hw)
    mistakes = [
        (right / 1000, "units: TFLOP/s is 1e12 FLOP/s but GB/s is 1e9 bytes/s; convert both first."),
        (1 / right, "upside down: the ridge is peak FLOP/s divided by bytes/s."),
        (2 * right, "that peak counts 2:4 sparsity; use the dense figure."),
        (right / 2, "FLOPs are 2 per multiply-add, and the vendor's FLOP/s already counts both."),
        (right / 8, "bits vs bytes? Bandwidth is in bytes/s, not bits/s."),
        (right * 8, "bits vs bytes? Bandwidth is in bytes/s, not bits/s."),
        (right * 1e9 / 2**30, "GiB vs GB: a datasheet's GB/s is 1e9 bytes/s, not 2^30."),
    ]
    return (hw,), name, right, mistakes


def check_ridge_point(answer: float | Callable, hardware: str = "RTX 4090") -> Result:
    """Task 3: the ridge point of a roofline, peak FLOP/s over bandwidth in bytes/s (FLOP/byte).

    `answer` is a number for `hardware` (a key of `roofline.HARDWARE`), or a function
    `f(hw: Hardware) -> FLOP/byte` called on every machine with a sourced peak. Checked against
    `roofline.ridge_point`.
    """
    names = [hardware] + [n for n, h in rl.HARDWARE.items() if h.peak_tflops is not None and n != hardware]
    return judge_cases("Task 3", answer, [_ridge_case(n) for n in names], "FLOP/byte",
                       "ridge = peak_tflops × 1e12 / (bandwidth_gbs × 1e9).")


# Task 4 -------------------------------------------------------------------------------------

def _decode_case(hardware: str, model: str, bits: float, context: int):
    hw, s = rl.HARDWARE[hardware], shapes.shape(model)
    right = rl.decode_tokens_per_s(hw, s, bits, context)
    w, kv = rl.weight_bytes(s, bits), rl.kv_cache_bytes(s, context)
    mistakes = [
        (right / 8, f"bits vs bytes? A weight at {bits:g} bits is {bits / 8:g} bytes."),
        (hw.bandwidth / (8 * w + kv), f"bits vs bytes? A weight at {bits:g} bits is {bits / 8:g} bytes."),
        (hw.bandwidth / w, f"you left out the KV cache read at context {context:,}: {kv:,.4g} bytes per token."),
        (hw.bandwidth / (w + kv / 2), "did you count K and V? The cache holds both."),
        (hw.bandwidth / (rl.weight_bytes(s, 16) + kv), f"the weights are stored at {bits:g} bits, not 16."),
        (1 / right, "that is seconds per token; the answer is tokens per second."),
        (right * 2**30 / 1e9, "GiB vs GB: the bandwidth is 1e9 bytes/s per GB/s."),
        (right * 1e9 / 2**30, "GiB vs GB: the bandwidth is 1e9 bytes/s per GB/s."),
    ]
    if hw.peak_tflops is not None:
        mistakes.append((hw.peak_flops / rl.flops_per_token(s, context),
                         "that is the compute bound; one token at a time is bound by memory bandwidth."))
    return (hw, s, bits, context), f"{model} on {hardware}, {bits:g} bits/weight, context {context:,}", \
        right, mistakes


def check_decode_tokens_per_s(answer: float | Callable, hardware: str = "Apple M4 Max",
                              model: str = "Llama-3.1-8B", bits_per_weight: float = 4.0,
                              context: int = 4096) -> Result:
    """Task 4: the upper bound on decode tokens/s, bandwidth over bytes per token (Task 1).

    `answer` is a number for the given case, or a function `f(hw, shape, bits_per_weight,
    context) -> tokens/s` called on four cases. KV entries are 2 bytes. Checked against
    `roofline.decode_tokens_per_s` (which also takes the compute bound; it never binds here).
    """
    cases = [_decode_case(hardware, model, bits_per_weight, context),
             _decode_case("RTX 4090", "Llama-3.1-8B", 16, 1), _decode_case("H200 SXM", "Qwen3-32B", 8, 32768),
             _decode_case("Apple M5 Max", "Gemma-3-12B", 4.5, 1000)]
    return judge_cases("Task 4", answer, cases, "tokens/s",
                       "tokens/s = bandwidth (bytes/s) / bytes per token (Task 1).")


# Task 5 -------------------------------------------------------------------------------------

MOE_RTOL = 1e-3  # exact arithmetic on integer counts; 1% would hide the router (0.4% of Qwen3-30B-A3B's reads)


def _moe_case(model: str, bits: float):
    s = shapes.shape(model)
    right, b = rl.active_weight_bytes(s, bits), bits / 8
    layers, d, k = s.num_hidden_layers, s.hidden_size, s.experts_per_token
    mistakes = [(8 * right, f"bits vs bytes? A weight at {bits:g} bits is {bits / 8:g} bytes."),
                *unit_slips(right, "bytes")]
    if s.tie_word_embeddings:
        mistakes.append((right + s.vocab_size * d * b, "tied embeddings: the input embedding is the LM head's "
                                                       "matrix, counted once."))
    else:
        mistakes.append((right - s.vocab_size * d * b,
                         "you left out the input embedding table. A token's lookup reads one row of it, but this "
                         "course counts the untied table whole, as Task 1 and roofline.active_weight_bytes do "
                         "(an upper bound), and as model cards count active parameters."))
    if s.is_moe:
        attention = layers * d * s.head_dim * 2 * (s.num_attention_heads + s.num_key_value_heads)
        experts = layers * k * rl.expert_params(s)
        mistakes += [
            (rl.weight_bytes(s, bits), f"you counted all {s.num_experts} experts of each layer: that is what the "
                                       f"model stores; a token reads only the {k} its router picks."),
            (right - layers * d * s.num_experts * b, "you forgot the router: a hidden_size × num_experts matrix "
                                                     "per layer, read by every token to pick its experts."),
            (right + (k - 1) * attention * b, "attention is shared: a token runs q, k, v and o once per layer; "
                                              "only the MLP is split into experts."),
            (right - experts / 3 * b, "an expert is a gated MLP: three matrices (gate, up, down) of hidden_size × "
                                      "expert_intermediate_size, not two."),
            (right - experts * (layers - 1) / layers * b, "every layer has its own experts: experts_per_token "
                                                          "experts in each layer."),
        ]
    return (s, bits), f"{model}, {bits:g} bits/weight", right, mistakes


def check_moe_bytes_per_token(answer: float | Callable, model: str = "Qwen3-30B-A3B",
                              bits_per_weight: float = 4.5) -> Result:
    """Task 5: weight bytes a mixture of experts reads to decode one token, only its active experts.

    `answer` is a number of bytes for (`model`, `bits_per_weight`), or a function
    `f(shape: ModelShape, bits_per_weight) -> bytes` called on Qwen3-30B-A3B, Mixtral-8x7B and a dense
    shape: attention, router and `experts_per_token` experts per layer, the LM head, the embedding
    unless tied (counted whole, as in Task 1) and the norms. Within 0.1% of
    `roofline.active_weight_bytes`.
    """
    cases = [_moe_case(model, bits_per_weight), _moe_case("Mixtral-8x7B", 4.5), _moe_case("Qwen3-4B", 8),
             _moe_case("Qwen3-30B-A3B", 16)]
    return judge_cases("Task 5", answer, cases, "bytes",
                       "bytes = (attention + router + k experts, every layer; LM head; embedding unless tied; "
                       "norms) × b / 8.", rtol=MOE_RTOL)
