"""Chapter "The roofline" (book/intro/roofline), Tasks 1 to 5: the checkers accept right answers worked
from first principles and reject the usual wrong ones with a hint that names the mistake.
`pytest tests/test_exercises_roofline.py -k task_2` selects one task."""

from __future__ import annotations

import pytest

from ref_impl import exercises as ex
from ref_impl.exercises import roofline as ex_roofline
from ref_impl.theory import shapes

# Llama-3.1-8B (meta-llama/Llama-3.1-8B config.json): vocab 128256, hidden 4096, 32 layers,
# MLP 14336, 32 query heads, 8 KV heads, head_dim 128, untied LM head. Its weights, counted by
# hand in tests/test_roofline.py: 8,030,261,248.
LLAMA8B_PARAMS = 8_030_261_248


def params_by_hand(s) -> int:
    """Weights of a Llama/Qwen3-style decoder from its config fields (no window, no Gemma norms)."""
    d, hd, layers = s.hidden_size, s.head_dim, s.num_hidden_layers
    attn = d * hd * (2 * s.num_attention_heads + 2 * s.num_key_value_heads)  # q, o; k, v
    mlp = 3 * d * s.intermediate_size                                          # gate, up, down
    norms = 2 * d + (2 * hd if s.qk_norm else 0)                               # + q_norm, k_norm
    embeddings = s.vocab_size * d * (1 if s.tie_word_embeddings else 2)        # + LM head if untied
    return embeddings + layers * (attn + mlp + norms) + d                      # + final norm


def kv_by_hand(s, context: int) -> int:
    # K and V, every layer, every KV head, head_dim values of 2 bytes, for each cached position
    return 2 * s.num_hidden_layers * s.num_key_value_heads * s.head_dim * 2 * context


def bytes_per_token(s, bits, context):
    return params_by_hand(s) * bits / 8 + kv_by_hand(s, context)


# Task 1: bytes per decoded token -------------------------------------------------------------

# Llama-3.1-8B, 4 bits, context 8192:
#   weights 8,030,261,248 x 4 / 8 = 4,015,130,624 bytes
#   KV      2 x 32 x 8 x 128 x 2 bytes x 8192 = 1,073,741,824 bytes (1 GiB)
T1_WEIGHTS, T1_KV = 4_015_130_624, 1_073_741_824
T1_RIGHT = T1_WEIGHTS + T1_KV  # 5,088,872,448


def test_task_1_hand_numbers_agree_with_the_hand_formula():
    assert params_by_hand(shapes.shape("Llama-3.1-8B")) == LLAMA8B_PARAMS
    assert bytes_per_token(shapes.shape("Llama-3.1-8B"), 4, 8192) == T1_RIGHT


def test_task_1_accepts_the_right_number_within_1_percent():
    assert ex.check_bytes_per_token(T1_RIGHT).ok
    assert ex.check_bytes_per_token(T1_RIGHT * 1.009).ok
    assert not ex.check_bytes_per_token(T1_RIGHT * 1.02).ok


def test_task_1_accepts_a_right_function_on_every_case():
    result = ex.check_bytes_per_token(bytes_per_token)
    assert result.ok and "4 cases" in result.message


def test_task_1_rejects_bits_for_bytes():
    r = ex.check_bytes_per_token(LLAMA8B_PARAMS * 4 + T1_KV)  # weights counted in bits
    assert not r.ok and "bits vs bytes" in r.message
    r = ex.check_bytes_per_token(8 * T1_RIGHT)
    assert not r.ok and "bits vs bytes" in r.message


def test_task_1_rejects_a_missing_or_half_kv_cache():
    r = ex.check_bytes_per_token(T1_WEIGHTS)
    assert not r.ok and "left out the KV cache" in r.message
    r = ex.check_bytes_per_token(T1_WEIGHTS + T1_KV / 2)
    assert not r.ok and "K and V" in r.message


def test_task_1_rejects_query_heads_for_kv_heads_and_one_layer():
    r = ex.check_bytes_per_token(T1_WEIGHTS + T1_KV * 32 // 8)
    assert not r.ok and "num_key_value_heads" in r.message
    r = ex.check_bytes_per_token(T1_WEIGHTS + T1_KV // 32)
    assert not r.ok and "every layer" in r.message


def test_task_1_rejects_gb_and_gib():
    assert "in GB" in ex.check_bytes_per_token(T1_RIGHT / 1e9).message
    assert "in GiB" in ex.check_bytes_per_token(T1_RIGHT / 2**30).message


def test_task_1_a_function_wrong_on_one_case_is_named_by_that_case():
    def forgets_kv(s, bits, context):
        return params_by_hand(s) * bits / 8
    r = ex.check_bytes_per_token(forgets_kv)
    # right on no case with a long context: the first case (context 8192) already fails
    assert not r.ok and "context 8,192" in r.message and "left out the KV cache" in r.message


def test_task_1_non_number():
    assert "finite number" in ex.check_bytes_per_token("5e9").message
    assert "finite number" in ex.check_bytes_per_token(float("nan")).message
    assert "positive" in ex.check_bytes_per_token(-T1_RIGHT).message


# Task 2: arithmetic intensity of a matmul ----------------------------------------------------

def intensity(n, k, m, bits):
    flops = 2 * n * k * m                          # one multiply and one add per weight per token
    nbytes = k * m * bits / 8 + (n * k + n * m) * 2  # weights once; activations in and out, 2 bytes
    return flops / nbytes


# GEMV of Llama-3.1-8B's MLP (n=1, 4096 x 14336, 16 bits):
#   FLOPs 2 x 4096 x 14336 = 117,440,512; bytes 117,440,512 + (4096 + 14336) x 2 = 117,477,376
T2_RIGHT = 117_440_512 / 117_477_376  # 0.99969 FLOP/byte: "~1 FLOP/byte" (C27)


def test_task_2_accepts_the_gemv_number_and_a_right_function():
    assert T2_RIGHT == pytest.approx(intensity(1, 4096, 14336, 16))
    assert ex.check_matmul_intensity(T2_RIGHT).ok
    assert ex.check_matmul_intensity(intensity).ok


def test_task_2_gemm_intensity_is_hundreds():
    # n=512: FLOPs 512 x 117,440,512; bytes 117,440,512 + 512 x 18,432 x 2 -> 443 FLOP/byte (C26)
    right = 512 * 117_440_512 / (117_440_512 + 512 * 18_432 * 2)
    assert ex.check_matmul_intensity(right, n_tokens=512).ok and 400 < right < 500


def test_task_2_rejects_one_flop_per_multiply_add():
    r = ex.check_matmul_intensity(T2_RIGHT / 2)
    assert not r.ok and "2 per multiply-add" in r.message
    r = ex.check_matmul_intensity(lambda n, k, m, b: intensity(n, k, m, b) / 2)
    assert not r.ok and "2 per multiply-add" in r.message


def test_task_2_rejects_bits_for_bytes_and_forgotten_activations():
    r = ex.check_matmul_intensity(117_440_512 / (4096 * 14336 * 16 + 18_432 * 2))
    assert not r.ok and "bits vs bytes" in r.message
    # at n=512 the activations are 14% of the bytes; leaving them out is visible
    r = ex.check_matmul_intensity(512 * 117_440_512 / 117_440_512, n_tokens=512)
    assert not r.ok and "activations move" in r.message


def test_task_2_rejects_weights_read_once_per_token():
    def rereads(n, k, m, bits):
        return 2 * n * k * m / (n * k * m * bits / 8 + (n * k + n * m) * 2)
    r = ex.check_matmul_intensity(rereads)  # right at n=1, wrong at n=512
    assert not r.ok and "n=512" in r.message and "once for all n tokens" in r.message


# Task 3: the ridge point ---------------------------------------------------------------------

# RTX 4090: 165.2 TFLOP/s dense FP16 tensor (FP32 accumulate), 1008 GB/s
#   165.2e12 FLOP/s / 1008e9 bytes/s = 163.89 FLOP/byte
T3_RIGHT = 165.2e12 / 1008e9


def test_task_3_accepts_the_ridge_and_a_right_function():
    assert ex.check_ridge_point(T3_RIGHT).ok
    r = ex.check_ridge_point(lambda hw: hw.peak_tflops * 1e12 / (hw.bandwidth_gbs * 1e9))
    assert r.ok and "cases" in r.message


def test_task_3_rejects_unconverted_units_and_inversion():
    r = ex.check_ridge_point(165.2 / 1008)  # TFLOP/s over GB/s, no 1e12 / 1e9
    assert not r.ok and "TFLOP/s is 1e12" in r.message
    r = ex.check_ridge_point(1008e9 / 165.2e12)
    assert not r.ok and "upside down" in r.message


def test_task_3_rejects_sparse_peak_bits_and_gib():
    assert "sparsity" in ex.check_ridge_point(2 * T3_RIGHT).message
    assert "bits vs bytes" in ex.check_ridge_point(165.2e12 / (8 * 1008e9)).message
    assert "GiB vs GB" in ex.check_ridge_point(165.2e12 / (1008 * 2**30)).message


# Task 4: the decode tokens/s bound -----------------------------------------------------------

# Llama-3.1-8B, 4 bits, context 4096, on an Apple M4 Max (546 GB/s):
#   bytes per token 4,015,130,624 + 2 x 32 x 8 x 128 x 2 x 4096 (536,870,912) = 4,552,001,536
#   546e9 / 4,552,001,536 = 119.95 tokens/s
T4_BYTES = 4_015_130_624 + 536_870_912
T4_RIGHT = 546e9 / T4_BYTES


def test_task_4_accepts_the_bound_and_a_right_function():
    assert ex.check_decode_tokens_per_s(T4_RIGHT).ok
    r = ex.check_decode_tokens_per_s(lambda hw, s, bits, c: hw.bandwidth_gbs * 1e9 / bytes_per_token(s, bits, c))
    assert r.ok, r.message


def test_task_4_rejects_bits_for_bytes_and_seconds_per_token():
    r = ex.check_decode_tokens_per_s(546e9 / (LLAMA8B_PARAMS * 4 + 536_870_912))  # weights in bits
    assert not r.ok and "bits vs bytes" in r.message
    r = ex.check_decode_tokens_per_s(T4_RIGHT / 8)
    assert not r.ok and "bits vs bytes" in r.message
    r = ex.check_decode_tokens_per_s(T4_BYTES / 546e9)
    assert not r.ok and "seconds per token" in r.message


def test_task_4_rejects_missing_kv_and_16_bit_weights():
    r = ex.check_decode_tokens_per_s(546e9 / 4_015_130_624)
    assert not r.ok and "left out the KV cache" in r.message
    r = ex.check_decode_tokens_per_s(546e9 / (LLAMA8B_PARAMS * 2 + 536_870_912))
    assert not r.ok and "not 16" in r.message


def test_task_4_rejects_the_compute_bound():
    # RTX 4090, 16 bits, context 1: FLOPs per token ~ 2 x 7,504,658,432 matmul weights (+ attention)
    compute = 165.2e12 / (2 * 7_504_658_432 + 4 * 32 * 128 * 32 * 1)
    r = ex.check_decode_tokens_per_s(compute, hardware="RTX 4090", bits_per_weight=16, context=1)
    assert not r.ok and "compute bound" in r.message


# Task 5: weight bytes a mixture of experts reads per token -----------------------------------

def active_bytes_by_hand(s, bits):
    """A token's weights: attention, router and experts_per_token experts per layer, plus the rest as Task 1."""
    d, layers = s.hidden_size, s.num_hidden_layers
    dense_like = params_by_hand(s)                                             # attention, dense MLP, norms, embeddings
    routed = layers * (d * s.num_experts + s.experts_per_token * 3 * d * s.expert_intermediate_size)
    return (dense_like + routed) * bits / 8


# Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B config.json), 4.5 bits/weight:
#   per layer: attention 2 x 2048 x 4096 + 2 x 2048 x 512 = 18,874,368; router 2048 x 128 = 262,144;
#              8 experts x 3 x 2048 x 768 = 37,748,736; norms 4,352
#   48 layers x 56,889,600 + embedding and LM head 2 x 151936 x 2048 (622,329,856) + 2,048 = 3,353,032,704
#   x 4.5 / 8 = 1,886,080,896 bytes (all 128 experts: 30,532,122,624 weights, 17,174,318,976 bytes)
T5_PARAMS, T5_RIGHT, T5_TOTAL = 3_353_032_704, 1_886_080_896, 17_174_318_976
QWEN_MOE = shapes.shape("Qwen3-30B-A3B")


def test_task_5_hand_numbers_agree_with_the_hand_formula():
    assert active_bytes_by_hand(QWEN_MOE, 4.5) == T5_RIGHT == T5_PARAMS * 4.5 / 8


def test_task_5_accepts_the_right_number_and_a_right_function():
    assert ex_roofline.check_moe_bytes_per_token(T5_RIGHT).ok
    r = ex_roofline.check_moe_bytes_per_token(active_bytes_by_hand)
    assert r.ok and "4 cases" in r.message, r.message


def test_task_5_rejects_all_experts():
    r = ex_roofline.check_moe_bytes_per_token(T5_TOTAL)
    assert not r.ok and "all 128 experts" in r.message


def test_task_5_rejects_a_forgotten_router():
    # 48 x 262,144 = 12,582,912 router weights: 0.38% of the read, past the task's 0.1%
    r = ex_roofline.check_moe_bytes_per_token((T5_PARAMS - 12_582_912) * 4.5 / 8)
    assert not r.ok and "forgot the router" in r.message
    r = ex_roofline.check_moe_bytes_per_token(
        lambda s, bits: active_bytes_by_hand(s, bits) - s.num_hidden_layers * s.hidden_size * s.num_experts * bits / 8)
    assert not r.ok and "forgot the router" in r.message


def test_task_5_rejects_a_left_out_embedding_table():
    # the course counts the untied table whole, as Task 1 does; a lookup of one row reads 2048 weights of it
    r = ex_roofline.check_moe_bytes_per_token((T5_PARAMS - 151936 * 2048 + 2048) * 4.5 / 8)
    assert not r.ok and "embedding table" in r.message and "upper bound" in r.message


def test_task_5_rejects_attention_per_expert():
    # attention counted 8 times: + 7 x 48 x 18,874,368 weights
    r = ex_roofline.check_moe_bytes_per_token((T5_PARAMS + 7 * 48 * 18_874_368) * 4.5 / 8)
    assert not r.ok and "attention is shared" in r.message


def test_task_5_rejects_two_matrix_experts_and_one_layer_of_experts():
    r = ex_roofline.check_moe_bytes_per_token((T5_PARAMS - 48 * 8 * 2048 * 768) * 4.5 / 8)
    assert not r.ok and "three matrices" in r.message
    r = ex_roofline.check_moe_bytes_per_token((T5_PARAMS - 47 * 37_748_736) * 4.5 / 8)
    assert not r.ok and "every layer has its own experts" in r.message


def test_task_5_rejects_bits_for_bytes_and_gb():
    assert "bits vs bytes" in ex_roofline.check_moe_bytes_per_token(T5_PARAMS * 4.5).message
    assert "in GB" in ex_roofline.check_moe_bytes_per_token(T5_RIGHT / 1e9).message


def test_task_5_a_function_that_ignores_tied_embeddings_fails_on_the_dense_case():
    def always_untied(s, bits):
        extra = 0 if not s.tie_word_embeddings else s.vocab_size * s.hidden_size
        return active_bytes_by_hand(s, bits) + extra * bits / 8
    r = ex_roofline.check_moe_bytes_per_token(always_untied)
    assert not r.ok and "Qwen3-4B" in r.message and "counted once" in r.message


def test_task_5_a_stub_is_not_written_yet():
    def stub(s, bits):
        raise NotImplementedError
    r = ex_roofline.check_moe_bytes_per_token(stub)
    assert not r.ok and "not written yet" in r.message
