"""The roofline of local inference: how fast a model *can* run on a machine, before running it.

A kernel moves bytes between memory and the chip and does floating-point work on them. It
cannot finish sooner than either takes on its own:

    time >= max(bytes / bandwidth, flops / peak_flops)

Its arithmetic intensity, flops / bytes, says which wall it hits. Below the machine's ridge
point (peak_flops / bandwidth, FLOP per byte) it waits on memory; above it, on arithmetic.

Generating one token (decode) multiplies every weight matrix by one vector (GEMV): each
16-bit weight is read once for 2 FLOPs, about 1 FLOP/byte, far below every ridge point
here (C27). So decode speed is bandwidth / bytes per token, and bytes per token are the
weights plus the KV cache read. Processing a prompt (prefill) multiplies the same weights by
a matrix of N tokens (GEMM): N times the FLOPs for the same weight bytes, hundreds of
FLOP/byte (C26), so time to first token grows with N and is set by compute (C14).

A mixture of experts (MoE) changes the weight term: a token reads the shared weights and only the
`experts_per_token` experts its router picks in each layer, so one token costs its *active* weights,
not all it stores. A pass of n tokens reads every expert any of them picks: under uniform routing
E(1 - (1 - k/E)^n) per layer, which tends to all E as n grows, so a large batch or a prefill pays
the total again.

Conventions: GB is 1e9 bytes; `context` is the number of positions a token attends to, its
own included, which is also the KV cache length it reads; `bits_per_weight` is the average
storage of a weight (16 for bf16, ~4.5 for Q4_K); KV entries default to 2 bytes.

See chapter: intro-roofline
"""

from __future__ import annotations

from dataclasses import dataclass

from ref_impl.theory.shapes import ModelShape, dense_counterpart


@dataclass(frozen=True)
class Hardware:
    """A machine's two roofs, memory bandwidth and peak arithmetic, with where the numbers come from."""

    name: str
    memory_gb: float            # largest configuration; unified memory on Apple chips
    bandwidth_gbs: float        # peak DRAM/HBM bandwidth by datasheet, GB/s
    peak_tflops: float | None   # dense (no 2:4 sparsity) rate of `peak_kind`; None: no vendor figure
    peak_kind: str
    source: str

    @property
    def bandwidth(self) -> float:
        """Bytes per second."""
        return self.bandwidth_gbs * 1e9

    @property
    def peak_flops(self) -> float:
        """FLOP per second; raises if the vendor publishes no figure (pass one with dataclasses.replace)."""
        if self.peak_tflops is None:
            raise ValueError(f"{self.name}: no sourced peak FLOP/s; use dataclasses.replace(hw, peak_tflops=...)")
        return self.peak_tflops * 1e12


_APPLE = "Apple publishes no GPU FLOP/s figure for this chip"
_TENSOR = "dense FP16/BF16 tensor cores, FP32 accumulate"
HARDWARE: dict[str, Hardware] = {hw.name: hw for hw in (
    Hardware("Apple M3 Max", 128, 400, None, _APPLE,
             "Apple, 'MacBook Pro (16-inch, Nov 2023) - Tech Specs' (M3 Max, 16-core CPU, 40-core GPU): "
             "https://support.apple.com/en-us/117737"),
    Hardware("Apple M4 Max", 128, 546, None, _APPLE,
             "Apple Newsroom, 'Apple introduces M4 Pro and M4 Max' (2024-10-30), 40-core GPU: "
             "https://www.apple.com/newsroom/2024/10/apple-introduces-m4-pro-and-m4-max/"),
    Hardware("Apple M5 Max", 128, 614, None, _APPLE,
             "Apple Newsroom, 'Apple debuts M5 Pro and M5 Max to supercharge the most demanding pro "
             "workflows' (2026-03), 40-core GPU: https://www.apple.com/newsroom/2026/03/"
             "apple-debuts-m5-pro-and-m5-max-to-supercharge-the-most-demanding-pro-workflows/"),
    Hardware("RTX 4090", 24, 1008, 165.2, _TENSOR + " (FP16 accumulate: 330.3)",
             "NVIDIA, 'NVIDIA Ada GPU Architecture' whitepaper, Appendix A, Table 2: "
             "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf"),
    Hardware("RTX 5090", 32, 1792, 209.5, _TENSOR,
             "NVIDIA, 'NVIDIA RTX Blackwell GPU Architecture' whitepaper, appendix: "
             "https://images.nvidia.com/aem-dam/Solutions/geforce/blackwell/nvidia-rtx-blackwell-gpu-architecture.pdf"
             "; GeForce RTX 5090 specs: https://www.nvidia.com/en-us/geforce/graphics-cards/50-series/rtx-5090/"),
    Hardware("H100 SXM", 80, 3350, 989.5, _TENSOR + " (the page's 1,979 is with sparsity, 2x dense)",
             "NVIDIA, 'H100 Tensor Core GPU', specifications: https://www.nvidia.com/en-us/data-center/h100/"),
    Hardware("H200 SXM", 141, 4800, 989.5, _TENSOR + " (the page's 1,979 is with sparsity, 2x dense)",
             "NVIDIA, 'H200 Tensor Core GPU', specifications: https://www.nvidia.com/en-us/data-center/h200/"),
)}


def matmul_shapes(shape: ModelShape) -> list[tuple[int, int]]:
    """(in, out) of every matrix one token passes through: q, k, v, o and the MLP's gate, up, down per layer
    (a MoE: the router and the gate, up, down of each of the `experts_per_token` experts), and the LM head."""
    d, f, f_e = shape.hidden_size, shape.intermediate_size, shape.expert_intermediate_size
    q, kv = shape.num_attention_heads * shape.head_dim, shape.num_key_value_heads * shape.head_dim
    layer = [(d, q), (d, kv), (d, kv), (q, d)]
    if f:
        layer += [(d, f), (d, f), (f, d)]
    if shape.is_moe:
        layer += [(d, shape.num_experts)] + [(d, f_e), (d, f_e), (f_e, d)] * shape.experts_per_token
    return layer * shape.num_hidden_layers + [(d, shape.vocab_size)]


def matmul_params(shape: ModelShape) -> int:
    """Weights multiplied by every token: attention and MLP matrices of each layer (a MoE: the router and
    the routed experts only), and the LM head."""
    return sum(k * m for k, m in matmul_shapes(shape))


def expert_params(shape: ModelShape) -> int:
    """Weights of one expert, a gated MLP of three d x expert_intermediate_size matrices (0: a dense shape)."""
    return 3 * shape.hidden_size * shape.expert_intermediate_size


def active_param_count(shape: ModelShape) -> int:
    """Weights one token uses: the matrices it passes through, the input embedding unless tied, the norms.

    The embedding table is counted whole, as `param_count` counts it and as model cards count "active"
    parameters; a token's lookup reads one row of it, so the bytes it implies are an upper bound.
    For a dense shape it is `param_count`.
    """
    d = shape.hidden_size
    norms = shape.num_hidden_layers * (shape.norms_per_layer * d + 2 * shape.head_dim * shape.qk_norm) + d
    embedding = 0 if shape.tie_word_embeddings else shape.vocab_size * d
    return matmul_params(shape) + embedding + norms


def param_count(shape: ModelShape) -> int:
    """All weights stored: the active ones (`active_param_count`) and the experts a token is not routed to."""
    idle = shape.num_hidden_layers * (shape.num_experts - shape.experts_per_token) * expert_params(shape)
    return active_param_count(shape) + idle


def weight_bytes(shape: ModelShape, bits_per_weight: float) -> float:
    """Bytes of all weights stored at `bits_per_weight` (every expert, an untied embedding): what must fit in memory."""
    return param_count(shape) * bits_per_weight / 8


def active_weight_bytes(shape: ModelShape, bits_per_weight: float) -> float:
    """Bytes of weights one decoded token reads: its active weights (a MoE: k experts a layer, not all of them).

    Equal to `weight_bytes` for a dense shape; the untied embedding is counted whole (an upper bound).
    """
    return active_param_count(shape) * bits_per_weight / 8


def expected_distinct_experts(num_experts: int, experts_per_token: int, n_tokens: int) -> float:
    """Experts of one layer that n tokens read together, expected under uniform routing: E(1 - (1 - k/E)^n).

    A token picks k distinct experts of E, so it misses a given one with probability 1 - k/E, and n
    independent tokens all miss it with (1 - k/E)^n: 1 token reads k, a large batch or prompt nearly E.
    """
    if not (0 <= experts_per_token <= num_experts and n_tokens >= 0):
        raise ValueError(f"need 0 <= experts_per_token ({experts_per_token}) <= num_experts ({num_experts}) "
                         f"and n_tokens ({n_tokens}) >= 0")
    if num_experts == 0:
        return 0.0
    return num_experts * (1 - (1 - experts_per_token / num_experts) ** n_tokens)


def step_weight_bytes(shape: ModelShape, bits_per_weight: float, n_tokens: int) -> float:
    """Weight bytes one pass of n tokens reads (a batch of decode steps, or a prompt): the shared weights once,
    and every expert any token is routed to once (`expected_distinct_experts` per layer).

    1 token: `active_weight_bytes`; a dense shape: `weight_bytes` whatever n.
    """
    extra = expected_distinct_experts(shape.num_experts, shape.experts_per_token, n_tokens) - shape.experts_per_token
    return (active_param_count(shape) + shape.num_hidden_layers * extra * expert_params(shape)) * bits_per_weight / 8


def kv_bytes_per_token(shape: ModelShape, bytes_per_element: float = 2) -> float:
    """Bytes one token adds to the KV cache: K and V, every layer, every key/value head."""
    return 2 * shape.num_hidden_layers * shape.num_key_value_heads * shape.head_dim * bytes_per_element


def attended_positions(shape: ModelShape, context: int) -> int:
    """Sum over layers of the positions a token at `context` attends to (a window caps local layers)."""
    local = shape.num_hidden_layers - shape.global_layers
    return shape.global_layers * context + local * min(context, shape.sliding_window)


def _attended_sum(shape: ModelShape, n: int) -> int:
    """Sum of `attended_positions(shape, i)` for i = 1..n, in closed form."""
    w, local = shape.sliding_window, shape.num_hidden_layers - shape.global_layers
    windowed = n * (n + 1) // 2 if n <= w else w * (w + 1) // 2 + (n - w) * w
    return shape.global_layers * n * (n + 1) // 2 + local * windowed


def kv_cache_bytes(shape: ModelShape, context: int, bytes_per_element: float = 2) -> float:
    """Bytes of KV cache a token at `context` reads; local layers keep only the last `sliding_window`."""
    return 2 * shape.num_key_value_heads * shape.head_dim * bytes_per_element * attended_positions(shape, context)


def flops_per_token(shape: ModelShape, context: int) -> float:
    """FLOPs for one token: 2 per matmul weight, plus Q.K and softmax(QK).V over `context` positions."""
    attention = 4 * shape.num_attention_heads * shape.head_dim * attended_positions(shape, context)
    return 2 * matmul_params(shape) + attention


def forward_flops(shape: ModelShape, n_tokens: int, context: int) -> float:
    """FLOPs for n tokens in one pass, the last at `context` (causal: they attend context-n+1 .. context)."""
    if not 0 < n_tokens <= context:
        raise ValueError(f"need 0 < n_tokens ({n_tokens}) <= context ({context})")
    attended = _attended_sum(shape, context) - _attended_sum(shape, context - n_tokens)
    return 2 * matmul_params(shape) * n_tokens + 4 * shape.num_attention_heads * shape.head_dim * attended


def prefill_flops(shape: ModelShape, prompt_len: int) -> float:
    """FLOPs to process a prompt of `prompt_len` tokens from an empty cache."""
    return forward_flops(shape, prompt_len, prompt_len)


def decode_bytes_per_token(shape: ModelShape, bits_per_weight: float, context: int, kv_bytes: float = 2) -> float:
    """Bytes read to generate one token: every active weight once (`active_weight_bytes`; a dense model: all of
    them), plus the KV cache at `context`."""
    return active_weight_bytes(shape, bits_per_weight) + kv_cache_bytes(shape, context, kv_bytes)


def arithmetic_intensity(flops: float, nbytes: float) -> float:
    """FLOP per byte moved."""
    return flops / nbytes


def ridge_point(hw: Hardware) -> float:
    """The intensity (FLOP/byte) above which `hw` is compute-bound: peak FLOP/s over bandwidth."""
    return hw.peak_flops / hw.bandwidth


def matmul_intensity(n_tokens: int, k: int, m: int, bits_per_weight: float = 16, act_bytes: float = 2) -> float:
    """Intensity of (n_tokens x k) @ (k x m): 2nkm FLOPs over the weights plus input and output activations.

    n = 1 is decode's GEMV, ~1 FLOP/byte at 16 bits (C27); n in the hundreds is prefill's GEMM (C26).
    """
    return arithmetic_intensity(*matmul_cost(n_tokens, k, m, bits_per_weight, act_bytes))


def matmul_cost(n_tokens: int, k: int, m: int, bits_per_weight: float = 16,
                act_bytes: float = 2) -> tuple[float, float]:
    """(FLOPs, bytes) of (n_tokens x k) @ (k x m): weights read once, input and output activations moved."""
    return 2 * n_tokens * k * m, k * m * bits_per_weight / 8 + (n_tokens * k + n_tokens * m) * act_bytes


def forward_time(hw: Hardware, shape: ModelShape, bits_per_weight: float, n_tokens: int,
                 context: int | None = None, kv_bytes: float = 2, efficiency: float = 1.0) -> float:
    """Seconds for one pass of n tokens ending at `context` (default n_tokens: a fresh prompt).

    max(bytes / bandwidth, flops / peak) with bytes = weights once (a MoE: the experts the n tokens are
    routed to, `step_weight_bytes`) + the KV cache at `context`: flat while the weight read dominates
    (GEMV-like), then linear in n (GEMM, compute-bound). `efficiency` is the fraction of both roofs reached.
    """
    context = n_tokens if context is None else context
    nbytes = step_weight_bytes(shape, bits_per_weight, n_tokens) + kv_cache_bytes(shape, context, kv_bytes)
    flops = forward_flops(shape, n_tokens, context)
    return max(nbytes / hw.bandwidth, flops / hw.peak_flops) / efficiency


def ttft_seconds(hw: Hardware, shape: ModelShape, bits_per_weight: float, prompt_len: int,
                 kv_bytes: float = 2, efficiency: float = 1.0) -> float:
    """Time to first token: prefill of the prompt, max(compute time, weight + KV-write time)."""
    return forward_time(hw, shape, bits_per_weight, prompt_len, None, kv_bytes, efficiency)


def decode_tokens_per_s(hw: Hardware, shape: ModelShape, bits_per_weight: float, context: int,
                        kv_bytes: float = 2, efficiency: float = 1.0) -> float:
    """Upper bound on generated tokens/s at `context`: min of the bandwidth and compute bounds.

    Bytes per token as `decode_bytes_per_token` (a MoE: its active weights); context 0 counts the weights
    alone. Without a sourced peak (Apple) only the bandwidth bound applies.
    """
    bound = efficiency * hw.bandwidth / decode_bytes_per_token(shape, bits_per_weight, context, kv_bytes)
    if hw.peak_tflops is None:
        return bound
    return min(bound, efficiency * hw.peak_flops / flops_per_token(shape, context))


def batch_tokens_per_s(hw: Hardware, shape: ModelShape, bits_per_weight: float, batch: int, context: int,
                       kv_bytes: float = 2, efficiency: float = 1.0) -> float:
    """Upper bound on tokens/s of decode steps that serve `batch` sequences, each at `context`.

    A step reads the weights once for all of them (a MoE: every expert any sequence is routed to,
    `step_weight_bytes`) and each sequence's own KV cache; batch 1 is `decode_tokens_per_s`.
    """
    if batch < 1:
        raise ValueError(f"batch ({batch}) must be at least 1")
    nbytes = step_weight_bytes(shape, bits_per_weight, batch) + batch * kv_cache_bytes(shape, context, kv_bytes)
    seconds = nbytes / hw.bandwidth
    if hw.peak_tflops is not None:
        seconds = max(seconds, batch * flops_per_token(shape, context) / hw.peak_flops)
    return efficiency * batch / seconds


def moe_vs_dense(hw: Hardware, shape: ModelShape, bits_per_weight: float, batches: list[int], context: int,
                 kv_bytes: float = 2) -> dict[str, list[float]]:
    """`batch_tokens_per_s` at each batch size of a MoE and of its two dense counterparts: one with as many
    weights active per token (`experts_per_token` experts wide), one with as many stored (`num_experts` wide).

    One sequence decodes about as fast as the first; a large batch reads nearly every expert, so its weight
    read approaches the second's.
    """
    models = {shape.name: shape,
              "dense, same active weights": dense_counterpart(shape, shape.experts_per_token),
              "dense, same total weights": dense_counterpart(shape, shape.num_experts)}
    return {label: [batch_tokens_per_s(hw, s, bits_per_weight, n, context, kv_bytes) for n in batches]
            for label, s in models.items()}
