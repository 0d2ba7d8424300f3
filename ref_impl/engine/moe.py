"""The mixture-of-experts MLP of qwen3moe and Mixtral-style llama models, in MLX.

In place of one SwiGLU MLP, a layer holds n_experts of them and a router; each token runs through
only n_used of them (Qwen3-30B-A3B: 8 of 128; Mixtral 8x7B: 2 of 8), as llama.cpp's `build_moe_ffn`
computes it with softmax gating and `norm_w`:

    p        = softmax(router @ x)                  over all experts, in float32
    chosen   = the n_used experts of largest p      (ties: the lower expert index)
    w_e      = p_e / sum of p over the chosen       renormalised to sum 1
    out      = sum over chosen e of  w_e * down_e(silu(gate_e(x)) * up_e(x))

The experts' matrices are stacked (n_experts, out, in), so one gathered matmul (`mx.gather_mm`, or
`mx.gather_qmm` for quantized experts) runs every (token, chosen expert) pair at once, each against
its own expert's matrix; no Python loop visits the experts. GGUF stores them that way too:
`blk.N.ffn_gate_exps.weight` and `ffn_up_exps` (n_expert, n_ff_exp, n_embd), `ffn_down_exps`
(n_expert, n_embd, n_ff_exp), the router `ffn_gate_inp` (n_expert, n_embd); the sizes come from
`<arch>.expert_count`, `<arch>.expert_used_count` and `<arch>.expert_feed_forward_length`.
Parameter names: `router` (ffn_gate_inp), `gate_exps`, `up_exps`, `down_exps` (the _exps tensors).

Ties: llama.cpp picks the top n_used with `std::sort`, which leaves equal probabilities in no fixed
order; here they go to the lower expert index (MLX's CPU argsort breaks ties by index; tested on the
CPU only). llama.cpp also clamps the renormalising sum at 2^-14; after a softmax the chosen
probabilities sum to at least n_used / n_experts, so that clamp never acts and is left out.

References: llama.cpp src/llama-graph.cpp (`build_moe_ffn`), src/models/qwen3moe.cpp and
src/models/llama.cpp (softmax gating, norm_w true), src/llama-model.cpp (the hyper-parameter keys);
MLX `gather_mm`, `gather_qmm` docs.
See chapter: intro-roofline
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

# From this many (token, expert) rows on (prefill, not a decode step), rows are sorted by expert before the
# gathered matmuls. On a 2-core CPU (OpenBLAS; hidden 1024, expert 384, 64 experts, 8 used) sorting was even
# at 16-32 rows, 1.3x faster at 64 and 3.6x at 1024.
SORT_MIN_ROWS = 64


class Experts(nn.Module):
    """n_experts float matrices stacked as `weight` (n_experts, output_dims, input_dims). MLX's CPU
    gather_mm takes float32 only: a float16 model with float experts runs on a GPU."""

    def __init__(self, n_experts: int, input_dims: int, output_dims: int):
        super().__init__()
        scale = math.sqrt(1.0 / input_dims)
        self.weight = mx.random.uniform(-scale, scale, (n_experts, output_dims, input_dims))

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        """x (..., M, input_dims) times the transposed matrix of expert indices[...] -> (..., M, output_dims);
        the batch dimensions of x and indices broadcast."""
        return mx.gather_mm(x, self.weight.swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sorted_indices)


class QuantizedExperts(nn.Module):
    """n_experts matrices in MLX's affine layout, stacked as nn.QuantizedLinear stores one:
    `weight` uint32 (n_experts, output_dims, input_dims * bits / 32), `scales` and `biases`
    (n_experts, output_dims, input_dims / group_size). transcode.transcode_stacked makes them from GGUF blocks."""

    def __init__(self, n_experts: int, input_dims: int, output_dims: int, group_size: int = 32, bits: int = 4):
        super().__init__()
        if bits not in (2, 3, 4, 5, 6, 8) or input_dims % group_size or input_dims * bits % 32:
            raise ValueError(f"QuantizedExperts: input_dims {input_dims} with group_size {group_size} "
                             f"and bits {bits} is no MLX affine layout")
        self.group_size, self.bits = group_size, bits
        self.weight = mx.zeros((n_experts, output_dims, input_dims * bits // 32), dtype=mx.uint32)
        self.scales = mx.zeros((n_experts, output_dims, input_dims // group_size))
        self.biases = mx.zeros((n_experts, output_dims, input_dims // group_size))
        self.freeze()

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        """As Experts.__call__, on the quantized matrices."""
        return mx.gather_qmm(x, self.weight, self.scales, self.biases, rhs_indices=indices, transpose=True,
                             group_size=self.group_size, bits=self.bits, sorted_indices=sorted_indices)


def route(logits: mx.array, n_used: int) -> tuple[mx.array, mx.array]:
    """Router logits (..., n_experts) -> (weights float32 (..., n_used), expert indices uint32 (..., n_used)):
    the n_used most probable experts under a float32 softmax, most probable first, ties to the lower
    index, their probabilities renormalised to sum 1 (llama.cpp build_moe_ffn, softmax gating, norm_w)."""
    probs = mx.softmax(logits.astype(mx.float32), axis=-1)
    chosen = mx.argsort(-probs, axis=-1)[..., :n_used]                # negation is exact: order kept
    weights = mx.take_along_axis(probs, chosen, axis=-1)
    return weights / weights.sum(axis=-1, keepdims=True), chosen.astype(mx.uint32)


class MoE(nn.Module):
    """A SwiGLU mixture-of-experts MLP: `router` (n_experts, hidden_size) and the stacked experts
    `gate_exps`, `up_exps` (n_experts, expert_hidden, hidden_size), `down_exps` (n_experts, hidden_size,
    expert_hidden). Called on x (B, L, hidden_size), returns (B, L, hidden_size) in x's dtype."""

    def __init__(self, hidden_size: int, expert_hidden: int, n_experts: int, n_used: int):
        super().__init__()
        if min(hidden_size, expert_hidden, n_experts) < 1 or not 1 <= n_used <= n_experts:
            raise ValueError(f"MoE: needs positive sizes and 1 <= n_used <= n_experts, got hidden_size "
                             f"{hidden_size}, expert_hidden {expert_hidden}, n_experts {n_experts}, n_used {n_used}")
        self.hidden_size, self.n_used = hidden_size, n_used
        self.router = nn.Linear(hidden_size, n_experts, bias=False)
        self.gate_exps = Experts(n_experts, hidden_size, expert_hidden)
        self.up_exps = Experts(n_experts, hidden_size, expert_hidden)
        self.down_exps = Experts(n_experts, expert_hidden, hidden_size)

    def experts(self, x: mx.array, indices: mx.array, sorted_indices: bool) -> mx.array:
        """The chosen experts' SwiGLU MLPs: x (..., 1, d), indices broadcasting with x's batch -> (..., 1, d)."""
        h = nn.silu(self.gate_exps(x, indices, sorted_indices)) * self.up_exps(x, indices, sorted_indices)
        return self.down_exps(h, indices, sorted_indices)

    def __call__(self, x: mx.array) -> mx.array:
        if x.ndim != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"MoE: input must be (B, L, {self.hidden_size}), got shape {tuple(x.shape)}")
        B, L, d = x.shape
        T, k = B * L, self.n_used
        # the router's matmul promotes to float32 (a float16 weight times float32 x), as llama.cpp gates
        weights, chosen = route(self.router(x.astype(mx.float32)), k)  # (B, L, k) each
        x, chosen = x.reshape(T, 1, d), chosen.reshape(T, k)
        if T * k >= SORT_MIN_ROWS:
            # Sorted by expert, each expert's rows are contiguous: gather_mm multiplies them as one matrix
            # product per expert (on CUDA a grouped GEMM) instead of one matrix-vector product per row.
            flat = chosen.flatten()
            order = mx.argsort(flat)                                 # row r is token r // k
            y = self.experts(x[order // k], flat[order], True)      # (T*k, 1, d), in expert order
            y = y[mx.argsort(order)].reshape(T, k, d)                # back to (token, slot) order
        else:
            y = self.experts(x[:, None], chosen, False).reshape(T, k, d)  # x (T,1,1,d) against (T,k)
        out = (y * weights.reshape(T, k, 1)).sum(axis=1)             # float32, as llama.cpp sums
        return out.astype(x.dtype).reshape(B, L, d)
