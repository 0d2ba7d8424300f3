"""The roofline model against numbers worked by hand, published parameter counts, and its monotone laws."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import SHIPPED
from hypothesis import given, settings
from hypothesis import strategies as st

from ref_impl.theory import roofline as r
from ref_impl.theory import shapes

LLAMA8B = shapes.PUBLIC["Llama-3.1-8B"]
GEMMA12B = shapes.PUBLIC["Gemma-3-12B"]
RTX4090, H100, H200 = r.HARDWARE["RTX 4090"], r.HARDWARE["H100 SXM"], r.HARDWARE["H200 SXM"]


def test_llama_8b_parameter_count_by_hand():
    # embedding 128256 x 4096 = 525,336,576, and again for the untied LM head
    # per layer: q 4096x4096 = 16,777,216; k, v 4096x1024 = 4,194,304 each; o 16,777,216
    #            MLP 3 x 4096 x 14336 = 176,160,768; two norms 2 x 4096 = 8,192 -> 218,112,000
    # 2 x 525,336,576 + 32 x 218,112,000 + 4,096 (final norm) = 8,030,261,248
    assert r.param_count(LLAMA8B) == 8_030_261_248
    # the matmuls a token runs through: 32 layers x 218,103,808 + LM head 525,336,576
    assert r.matmul_params(LLAMA8B) == 7_504_658_432


# Headline counts from the model cards (Llama 3.1/3.2: Meta's cards and HF; Qwen3: "Number of
# Parameters" in Qwen's cards).
@pytest.mark.parametrize("name, published", [
    ("Llama-3.2-1B", 1.23e9), ("Llama-3.2-3B", 3.21e9), ("Llama-3.1-8B", 8.03e9),
    ("Llama-3.1-70B", 70.6e9), ("Llama-3.1-405B", 405e9),
    ("Qwen3-4B", 4.0e9), ("Qwen3-8B", 8.2e9), ("Qwen3-14B", 14.8e9), ("Qwen3-32B", 32.8e9),
])
def test_parameter_counts_match_published_within_1_percent(name, published):
    assert r.param_count(shapes.PUBLIC[name]) == pytest.approx(published, rel=0.01)


def test_gemma_3_12b_language_model_count():
    # per layer: q 3840x4096 + o 4096x3840 = 31,457,280; k, v 3840x2048 = 15,728,640;
    # MLP 3 x 3840 x 15360 = 176,947,200; 4 norms x 3840 + q/k norms 2 x 256 = 15,872
    # -> 224,148,992 x 48 = 10,759,151,616; + tied embedding 262208 x 3840 = 1,006,878,720; + 3840
    assert r.param_count(GEMMA12B) == 11_766_034_176
    # "12B" names the multimodal model; its ~0.4B SigLIP tower is not counted here, hence 2%
    assert r.param_count(GEMMA12B) == pytest.approx(12e9, rel=0.02)


def test_decode_bound_llama_8b_on_4090():
    # 8,030,261,248 params x 2 bytes = 16.06 GB read per token
    assert r.weight_bytes(LLAMA8B, 16) == 16_060_522_496
    # 1008e9 B/s / 16.06e9 B = 62.76 tok/s; the compute bound, 165.2e12 / 15.0e9 FLOP, is ~11,000
    assert r.decode_tokens_per_s(RTX4090, LLAMA8B, 16, context=0) == pytest.approx(62.76, abs=0.01)
    # 4-bit weights: a quarter of the bytes, 4x the tokens: 1008e9 / 4.015e9 = 251.05
    assert r.decode_tokens_per_s(RTX4090, LLAMA8B, 4, context=0) == pytest.approx(251.05, abs=0.01)
    # Apple publishes no FLOP/s, so only the bandwidth bound: 546e9 / 16.06e9 = 34.0 tok/s
    assert r.decode_tokens_per_s(r.HARDWARE["Apple M4 Max"], LLAMA8B, 16, 0) == pytest.approx(34.0, abs=0.01)
    # efficiency scales the bound: 80% of 62.76 = 50.21
    assert r.decode_tokens_per_s(RTX4090, LLAMA8B, 16, 0, efficiency=0.8) == pytest.approx(50.21, abs=0.01)


def test_kv_cache_bytes_llama_8b():
    # 2 (K, V) x 32 layers x 8 kv heads x 128 x 2 bytes = 131,072 bytes per token
    assert r.kv_bytes_per_token(LLAMA8B) == 131_072
    # 8192 tokens x 131,072 = 1 GiB; decode there reads 16.06 + 1.07 GB: 1008e9 / 17.13e9 = 58.83 tok/s
    assert r.kv_cache_bytes(LLAMA8B, 8192) == 2**30
    assert r.decode_tokens_per_s(RTX4090, LLAMA8B, 16, 8192) == pytest.approx(58.83, abs=0.01)
    assert r.decode_bytes_per_token(LLAMA8B, 16, 8192) == 16_060_522_496 + 2**30


def test_gemma_sliding_window_caps_the_cache():
    # per token, every layer: 2 x 48 x 8 x 256 x 2 = 393,216 bytes
    assert r.kv_bytes_per_token(GEMMA12B) == 393_216
    # at 32768: 8 global layers keep 32768 positions, 40 local keep 1024 -> 303,104 layer-positions
    # x (2 x 8 x 256 x 2 = 8192 bytes) = 2,483,027,968 bytes, not 393,216 x 32768 = 12.9 GB
    assert r.kv_cache_bytes(GEMMA12B, 32768) == 2_483_027_968
    # below the window every layer holds every token
    assert r.kv_cache_bytes(GEMMA12B, 1000) == 1000 * 393_216


def test_flops_per_token_llama_8b():
    # 2 x 7,504,658,432 matmul weights = 15,009,316,864
    assert r.flops_per_token(LLAMA8B, 0) == 15_009_316_864
    # attention at 8192: 4 (QK and AV, multiply-add) x 32 heads x 128 x 32 layers x 8192 = 4,294,967,296
    assert r.flops_per_token(LLAMA8B, 8192) == 15_009_316_864 + 4_294_967_296


def test_ttft_llama_8b_4096_prompt_on_4090():
    # matmuls 15,009,316,864 x 4096 = 61,478,161,874,944; causal attention: 524,288 FLOP per
    # attended position (4 x 32 x 128 x 32) x (1 + 2 + ... + 4096 = 8,390,656) = 4,399,120,252,928
    assert r.prefill_flops(LLAMA8B, 4096) == 61_478_161_874_944 + 4_399_120_252_928
    # 65.877e12 FLOP / 165.2e12 FLOP/s = 0.3988 s, compute-bound: reading 16.6 GB takes 16.5 ms
    assert r.ttft_seconds(RTX4090, LLAMA8B, 16, 4096) == pytest.approx(0.3988, abs=1e-4)


def test_ridge_points():
    # H200: 989.5e12 / 4.8e12 = 206.1 FLOP/byte; RTX 4090: 165.2e12 / 1008e9 = 163.9
    assert r.ridge_point(H200) == pytest.approx(206.1, abs=0.05)
    assert r.ridge_point(RTX4090) == pytest.approx(163.9, abs=0.05)
    with pytest.raises(ValueError, match="no sourced peak"):
        r.ridge_point(r.HARDWARE["Apple M3 Max"])


def test_matmul_intensity_decode_vs_prefill():
    # C27, GEMV: 2 x 4096^2 FLOPs over 2 x 4096^2 weight bytes + 2 x 4096 x 2 activation bytes = 0.9995
    assert r.matmul_intensity(1, 4096, 4096) == pytest.approx(1.0, abs=1e-3)
    # C26, GEMM of 512 tokens: 2 x 512 x 4096^2 / (2 x 4096^2 + 2 x 512 x 4096 x 2) = 409.6 > 100
    assert r.matmul_intensity(512, 4096, 4096) == pytest.approx(409.6)
    assert r.matmul_intensity(512, 4096, 4096) > 100
    # 4-bit weights quadruple the GEMV's intensity: 33,554,432 / (8,388,608 + 16,384) = 3.99
    assert r.matmul_intensity(1, 4096, 4096, bits_per_weight=4) == pytest.approx(3.99, abs=0.01)


def test_forward_time_is_flat_then_linear():
    # Llama-3.1-8B on an H100 at 16 bits, last token at 4096: reading 16.06 + 0.54 GB takes 4.954 ms;
    # each token costs ~15.3 GFLOP, 15.5 us at 989.5 TFLOP/s, so the roofs cross near 320 tokens
    flat = (16_060_522_496 + 4096 * 131_072) / 3.35e12
    for n in (1, 64, 256):
        assert r.forward_time(H100, LLAMA8B, 16, n, context=4096) == pytest.approx(flat)
    t2048, t4096 = (r.forward_time(H100, LLAMA8B, 16, n, context=4096) for n in (2048, 4096))
    assert t4096 / t2048 == pytest.approx(2, rel=0.1)  # compute-bound: linear in n
    # one token through forward_time is one decode step
    assert 1 / r.forward_time(H100, LLAMA8B, 16, 1, context=4096) == pytest.approx(
        r.decode_tokens_per_s(H100, LLAMA8B, 16, 4096))
    with pytest.raises(ValueError):
        r.forward_time(H100, LLAMA8B, 16, 10, context=5)


def test_shape_from_our_shipped_model():
    from ref_impl.engine.model import ModelArgs
    from ref_impl.formats import gguf

    with gguf.read(SHIPPED) as f:
        args = ModelArgs.from_gguf(f.metadata, f.tensors)
    shape = args.shape("stdlib-10m")
    assert r.param_count(shape) == args.num_parameters
    assert shape.head_dim == args.head_dim and not shape.sliding_window


def test_tables_are_sourced():
    for item in [*r.HARDWARE.values(), *shapes.PUBLIC.values()]:
        assert "https://" in item.source, item.name
    for hw in r.HARDWARE.values():
        assert hw.bandwidth_gbs > 0 and hw.memory_gb > 0 and hw.peak_kind


hardware = st.sampled_from(sorted(r.HARDWARE.values(), key=lambda h: h.name))
models = st.sampled_from(sorted(shapes.PUBLIC.values(), key=lambda m: m.name))
bits = st.floats(1, 32)
contexts = st.integers(0, 131072)


@settings(max_examples=60, deadline=None)
@given(hardware, models, bits, bits, contexts)
def test_tokens_per_s_falls_as_bits_rise(hw, shape, b1, b2, context):
    lo, hi = sorted((b1, b2))
    assert r.decode_tokens_per_s(hw, shape, hi, context) <= r.decode_tokens_per_s(hw, shape, lo, context)


@settings(max_examples=60, deadline=None)
@given(hardware, models, bits, contexts, contexts)
def test_tokens_per_s_falls_as_context_rises(hw, shape, b, c1, c2):
    lo, hi = sorted((c1, c2))
    assert r.decode_tokens_per_s(hw, shape, b, hi) <= r.decode_tokens_per_s(hw, shape, b, lo)


@settings(max_examples=60, deadline=None)
@given(hardware, models, bits, st.integers(1, 131072), st.integers(1, 131072))
def test_ttft_rises_with_prompt_length(hw, shape, b, n1, n2):
    if hw.peak_tflops is None:  # TTFT needs a compute roof; lend the Apple chips one to test the law
        hw = dataclasses.replace(hw, peak_tflops=10.0)
    lo, hi = sorted((n1, n2))
    assert r.ttft_seconds(hw, shape, b, lo) <= r.ttft_seconds(hw, shape, b, hi)


# ---- mixtures of experts: a token reads only its active experts ---------------------------------

QWEN_MOE, MIXTRAL = shapes.PUBLIC["Qwen3-30B-A3B"], shapes.PUBLIC["Mixtral-8x7B"]


def moe_params_by_hand(s, experts: int) -> int:
    """Weights of a decoder whose layers hold `experts` experts (and the shape's dense MLP, if any)."""
    d, hd, layers = s.hidden_size, s.head_dim, s.num_hidden_layers
    attn = d * hd * (2 * s.num_attention_heads + 2 * s.num_key_value_heads)    # q, o; k, v
    mlp = 3 * d * s.intermediate_size + experts * 3 * d * s.expert_intermediate_size + d * s.num_experts  # + router
    norms = 2 * d + (2 * hd if s.qk_norm else 0)
    embeddings = s.vocab_size * d * (1 if s.tie_word_embeddings else 2)
    return embeddings + layers * (attn + mlp + norms) + d


def test_qwen3_30b_a3b_counts_by_hand():
    # per layer: q, o 2048x4096 = 8,388,608 each; k, v 2048x512 = 1,048,576 each -> 18,874,368
    #            router 2048x128 = 262,144; one expert 3 x 2048 x 768 = 4,718,592; norms 2x2048 + 2x128 = 4,352
    # embedding and untied head 2 x 151936 x 2048 = 622,329,856; final norm 2,048
    # active: 48 x (18,874,368 + 262,144 + 8 x 4,718,592 + 4,352) + 622,329,856 + 2,048 = 3,353,032,704
    # total:  48 x (18,874,368 + 262,144 + 128 x 4,718,592 + 4,352) + 622,329,856 + 2,048 = 30,532,122,624
    assert r.active_param_count(QWEN_MOE) == 3_353_032_704 == moe_params_by_hand(QWEN_MOE, 8)
    assert r.param_count(QWEN_MOE) == 30_532_122_624 == moe_params_by_hand(QWEN_MOE, 128)
    assert r.expert_params(QWEN_MOE) == 4_718_592
    # at 4.5 bits: 3,353,032,704 x 4.5 / 8 = 1,886,080,896 bytes read per token; 17,174,318,976 stored
    assert r.active_weight_bytes(QWEN_MOE, 4.5) == 1_886_080_896
    assert r.weight_bytes(QWEN_MOE, 4.5) == 17_174_318_976
    # FLOPs follow the active matrices: 2 x (3,353,032,704 - embedding 311,164,928 - norms 210,944)
    assert r.flops_per_token(QWEN_MOE, 0) == 2 * (3_353_032_704 - 311_164_928 - 48 * 4_352 - 2_048)


def test_mixtral_counts_by_hand():
    # per layer: q, o 4096x4096 = 16,777,216 each; k, v 4096x1024 = 4,194,304 each -> 41,943,040
    #            router 4096x8 = 32,768; one expert 3 x 4096 x 14336 = 176,160,768; norms 8,192
    # embedding and untied head 2 x 32000 x 4096 = 262,144,000; final norm 4,096
    # active: 32 x (41,943,040 + 32,768 + 2 x 176,160,768 + 8,192) + 262,144,000 + 4,096 = 12,879,925,248
    # total:  32 x (41,943,040 + 32,768 + 8 x 176,160,768 + 8,192) + 262,144,000 + 4,096 = 46,702,792,704
    assert r.active_param_count(MIXTRAL) == 12_879_925_248 == moe_params_by_hand(MIXTRAL, 2)
    assert r.param_count(MIXTRAL) == 46_702_792_704 == moe_params_by_hand(MIXTRAL, 8)
    assert r.active_weight_bytes(MIXTRAL, 4.5) == 12_879_925_248 * 4.5 / 8


# Published totals: Qwen3-30B-A3B model card (https://huggingface.co/Qwen/Qwen3-30B-A3B, "Number of Parameters:
# 30.5B in total and 3.3B activated; Number of Parameters (Non-Embedding): 29.9B"); Mixtral, Mistral AI,
# "Mixtral of experts" (2023-12-11, https://mistral.ai/news/mixtral-of-experts/: "46.7B total parameters but
# only uses 12.9B parameters per token"). Both count the embedding in the active figure.
@pytest.mark.parametrize("name, total, active", [("Qwen3-30B-A3B", 30.5e9, 3.3e9), ("Mixtral-8x7B", 46.7e9, 12.9e9)])
def test_moe_counts_match_published_within_2_percent(name, total, active):
    s = shapes.PUBLIC[name]
    assert r.param_count(s) == pytest.approx(total, rel=0.02)
    assert r.active_param_count(s) == pytest.approx(active, rel=0.02)


def test_qwen3_30b_a3b_non_embedding_count():
    embeddings = 2 * 151936 * 2048
    assert r.param_count(QWEN_MOE) - embeddings == pytest.approx(29.9e9, rel=0.02)


@pytest.mark.parametrize("name", sorted(set(shapes.PUBLIC) | set(shapes.STAND_INS)))
def test_a_dense_shape_reads_every_weight_whatever_the_batch(name):
    s = shapes.shape(name)
    if s.is_moe:
        return
    assert r.active_param_count(s) == r.param_count(s)
    for n in (1, 7, 4096):
        assert r.step_weight_bytes(s, 4.5, n) == r.weight_bytes(s, 4.5) == r.active_weight_bytes(s, 4.5)


def test_expected_distinct_experts_by_hand_and_by_simulation():
    # one token reads k; Mixtral, 2 tokens: 8 x (1 - (6/8)^2) = 8 x 7/16 = 3.5
    assert r.expected_distinct_experts(8, 2, 1) == 2
    assert r.expected_distinct_experts(8, 2, 2) == 3.5
    assert r.expected_distinct_experts(128, 8, 0) == 0 and r.expected_distinct_experts(0, 0, 5) == 0
    assert r.expected_distinct_experts(128, 8, 10_000) == pytest.approx(128)
    # simulated uniform routing: each token draws k distinct experts of E
    rng = np.random.default_rng(0)
    for e, k, n in ((8, 2, 3), (128, 8, 16), (16, 4, 5)):
        picks = np.argsort(rng.random((4000, n, e)), axis=-1)[..., :k]           # (trials, tokens, k)
        touched = np.zeros((4000, e), dtype=bool)
        np.put_along_axis(touched, picks.reshape(4000, -1), True, axis=1)
        assert touched.sum(1).mean() == pytest.approx(r.expected_distinct_experts(e, k, n), rel=0.02)
    with pytest.raises(ValueError, match="experts_per_token"):
        r.expected_distinct_experts(8, 9, 1)


def test_step_weight_bytes_grow_from_active_to_total():
    # Mixtral at 16 bits, 2 tokens: 3.5 experts a layer, 1.5 more than one token reads:
    # 12,879,925,248 + 32 x 1.5 x 176,160,768 = 21,335,642,112 weights x 2 bytes
    assert r.step_weight_bytes(MIXTRAL, 16, 2) == 2 * 21_335_642_112
    assert r.step_weight_bytes(MIXTRAL, 16, 1) == pytest.approx(r.active_weight_bytes(MIXTRAL, 16))
    sizes = [r.step_weight_bytes(QWEN_MOE, 4.5, n) for n in (1, 2, 8, 64, 512, 8192)]
    assert sizes == sorted(sizes) and sizes[-1] == pytest.approx(r.weight_bytes(QWEN_MOE, 4.5))


def test_moe_decode_bound_reads_active_bytes():
    # H100: 3.35e12 B/s / 1,886,080,896 B = 1,776.2 tok/s at 4.5 bits, context 0, ~9x a dense read of all 30.5B
    assert r.decode_bytes_per_token(QWEN_MOE, 4.5, 0) == 1_886_080_896
    assert r.decode_tokens_per_s(H100, QWEN_MOE, 4.5, 0) == pytest.approx(3.35e12 / 1_886_080_896)
    # the KV cache is the same arithmetic as a dense model's: 2 x 48 x 4 x 128 x 2 bytes per position
    assert r.decode_bytes_per_token(QWEN_MOE, 4.5, 1000) == 1_886_080_896 + 1000 * 98_304


def test_batch_of_one_is_the_decode_bound_and_batches_share_the_weight_read():
    for s in (QWEN_MOE, MIXTRAL, LLAMA8B):
        for hw in (H100, r.HARDWARE["Apple M4 Max"]):
            assert r.batch_tokens_per_s(hw, s, 4.5, 1, 4096) == pytest.approx(r.decode_tokens_per_s(hw, s, 4.5, 4096))
    # Llama-3.1-8B at 16 bits, context 0, 8 sequences on an H100: one 16.06 GB read serves all 8 tokens
    assert r.batch_tokens_per_s(H100, LLAMA8B, 16, 8, 0) == pytest.approx(8 * 3.35e12 / 16_060_522_496)
    with pytest.raises(ValueError, match="batch"):
        r.batch_tokens_per_s(H100, LLAMA8B, 16, 0, 0)


def test_moe_decodes_like_its_active_size_and_batches_like_its_total():
    batches = [1, 256]
    got = r.moe_vs_dense(H100, QWEN_MOE, 4.5, batches, context=0)
    moe, same_active, same_total = got.values()
    # one sequence: the MoE reads its active weights, as the dense model of that size does (the router aside)
    assert moe[0] == pytest.approx(same_active[0], rel=0.01)
    assert moe[0] / same_total[0] == pytest.approx(30.53 / 3.353, rel=0.01)
    # 256 sequences: 128 x (1 - (15/16)^256) = 128.0 experts a layer, so one step reads all 17.17 GB again:
    # 256 x 3.35e12 / 17,174,318,976 = 49,935 tok/s, memory-bound (its 256 x 6.1 GFLOP take 1.6 ms of 5.1).
    # The same-active dense model reads 1.89 GB and is compute-bound instead: 3.3x faster
    assert moe[1] == pytest.approx(256 * 3.35e12 / 17_174_318_976, rel=1e-6)
    assert same_active[1] == pytest.approx(989.5e12 / r.flops_per_token(shapes.dense_counterpart(QWEN_MOE, 8), 0))
    assert moe[1] < same_active[1] / 3


def test_a_moe_prefill_is_not_one_weight_read():
    # a dense pass of 16 tokens costs what one token's does; a MoE's reads ~83 of 128 experts, not 8
    assert r.forward_time(H100, LLAMA8B, 4, 16) == pytest.approx(r.forward_time(H100, LLAMA8B, 4, 1), rel=0.01)
    assert r.forward_time(H100, QWEN_MOE, 4, 16) > 5 * r.forward_time(H100, QWEN_MOE, 4, 1)
