"""The chapter-0 checkers accept right answers worked from first principles and reject the usual
wrong ones with a hint that names the mistake. `pytest -k task_2` selects one task."""

from __future__ import annotations

import numpy as np
import pytest

from ref_impl import exercises as ex

# Llama-3.1-8B (meta-llama/Llama-3.1-8B config.json): vocab 128256, hidden 4096, 32 layers,
# MLP 14336, 32 query heads, 8 KV heads, head_dim 128, untied LM head. Its weights, counted by
# hand in tests/test_roofline.py: 8,030,261,248.
LLAMA8B_PARAMS = 8_030_261_248


CHECKERS = sorted(name for name in dir(ex) if name.startswith("check_"))


@pytest.mark.parametrize("name", CHECKERS)
def test_every_checker_reports_a_stub_and_a_crash_instead_of_raising(name):
    """A learner's unwritten stub says so; an exception inside their code becomes a ✗ naming it."""
    def stub(*_):
        raise NotImplementedError

    def crash(*_):
        return 1 / 0
    checker = getattr(ex, name)
    assert "not written yet" in checker(stub).message
    r = checker(crash)
    assert not r and "raised ZeroDivisionError" in r.message


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
    from ref_impl.theory.roofline import MODELS
    assert params_by_hand(MODELS["Llama-3.1-8B"]) == LLAMA8B_PARAMS
    assert bytes_per_token(MODELS["Llama-3.1-8B"], 4, 8192) == T1_RIGHT


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


def test_results_display_as_tick_or_cross():
    good, bad = ex.check_ridge_point(T3_RIGHT), ex.check_ridge_point(1.0)
    assert repr(good).startswith("✓") and repr(bad).startswith("✗") and "Hint" in repr(bad)
    assert bool(good) and not bad
    assert "✓" in good._repr_html_() and "<script" not in ex.Result(False, "<script>")._repr_html_()


# Chapter "GGUF: file layout and alignment": GGUF tasks 1 and 2 (`pytest -k gguf_task`) ---------------

def right_next_offset(offset, nbytes, alignment):
    end = offset + nbytes
    return end + (-end) % alignment


def test_gguf_task_1_accepts_the_padded_offset_and_a_right_function():
    # seven 18-byte Q4_0 blocks at offset 128 end at 254; the next multiple of 32 is 256
    assert ex.check_next_offset(256)
    assert ex.check_next_offset(256.0)
    assert ex.check_next_offset(right_next_offset)
    assert ex.check_next_offset(lambda o, n, a: -(-(o + n) // a) * a)


def test_gguf_task_1_matches_what_gguf_write_does(tmp_path):

    from ref_impl.formats import gguf
    for alignment in (1, 32, 64):
        path = tmp_path / f"a{alignment}.gguf"
        gguf.write(path, {}, {"a": np.zeros(7, np.float32), "b": np.zeros(3, np.float16)}, alignment=alignment)
        with gguf.read(path) as f:
            a, b = f.tensors["a"], f.tensors["b"]
            assert b.offset == right_next_offset(a.offset, a.nbytes, alignment)


@pytest.mark.parametrize("wrong, hint", [
    (254, "pad the end up"),
    (224, "round up, not down"),
    (128, "add the tensor's own offset"),
    (lambda o, n, a: o + n, "pad the end up"),
    (lambda o, n, a: o + n + a - (o + n) % a, "already aligned needs no padding"),
    (lambda o, n, a: right_next_offset(o, n, 32), "not GGUF's default 32"),
    (lambda o, n, a: (o + n) // a * a, "round up, not down"),
])
def test_gguf_task_1_rejects_typical_mistakes_with_their_hint(wrong, hint):
    r = ex.check_next_offset(wrong)
    assert not r and hint in r.message, r.message


def test_gguf_task_1_non_integer():
    assert "whole number" in ex.check_next_offset(256.5).message
    assert "whole number" in ex.check_next_offset(True).message


def test_gguf_task_2_accepts_the_element_alignment_rule():
    assert ex.check_zero_copy_view(lambda o, d: o % np.dtype(d).alignment == 0)
    assert ex.check_zero_copy_view(lambda o, d: o % np.dtype(d).itemsize == 0)


def test_gguf_task_2_rule_is_what_numpy_reports():
    buf = bytes(200_000)
    for offset, dtype in ex._VIEW_CASES:
        view = np.frombuffer(buf, dtype, count=4, offset=offset)
        # bytes objects start 16-byte aligned + a 32-byte header: check relative to an aligned start
        base = np.frombuffer(buf, np.uint8).ctypes.data
        assert view.flags.aligned == ((base + offset) % np.dtype(dtype).alignment == 0)


@pytest.mark.parametrize("wrong, hint", [
    (lambda o, d: o % 32 == 0, "GGUF's choice"),
    (lambda o, d: o % 4 == 0, "float16 elements are 2 bytes"),
    (lambda o, d: True, "slow path or a copy"),
    (lambda o, d: o % 64 == 0, "cache line"),
    (lambda o, d: o % 2 == 0, "np.dtype(dtype).alignment"),
])
def test_gguf_task_2_rejects_typical_mistakes_with_their_hint(wrong, hint):
    r = ex.check_zero_copy_view(wrong)
    assert not r and hint in r.message, r.message


def test_gguf_task_2_wants_a_function_returning_bools():
    assert "write a function" in ex.check_zero_copy_view(True).message
    assert "True or False" in ex.check_zero_copy_view(lambda o, d: 1).message


# Chapter "Super-blocks: K-quants": K-quants tasks 1-3 (`pytest -k k_quants_task`) -------------------

# The block structs of ggml-common.h, field by field in bytes, and the values each block holds
STRUCT_BYTES = {"Q4_0": (32, 2 + 16),                 # d, qs[16]
                "Q8_0": (32, 2 + 32),                 # d, qs[32]
                "Q4_K": (256, 2 + 2 + 12 + 128),      # d, dmin, scales[12], qs[128]
                "Q5_K": (256, 2 + 2 + 12 + 32 + 128),  # d, dmin, scales[12], qh[32], qs[128]
                "Q6_K": (256, 128 + 64 + 16 + 2)}     # ql[128], qh[64], scales[16], d


def bits_per_weight(type_name):
    values, nbytes = STRUCT_BYTES[type_name]
    return nbytes * 8 / values


def test_k_quants_task_1_accepts_the_right_number_and_function():
    assert bits_per_weight("Q4_K") == 4.5 and bits_per_weight("Q6_K") == 6.5625
    assert ex.check_bits_per_weight(4.5)
    assert ex.check_bits_per_weight(144 * 8 / 256)
    assert ex.check_bits_per_weight(6.5625, type_name="Q6_K")
    assert ex.check_bits_per_weight(6.56, type_name="Q6_K")  # rounded to 3 figures
    r = ex.check_bits_per_weight(bits_per_weight)
    assert r and "5 cases" in r.message


@pytest.mark.parametrize("wrong, type_name, hint", [
    (4, "Q4_K", "only the quant bits"),
    (6, "Q6_K", "only the quant bits"),
    (0.5625, "Q4_K", "bytes per weight"),
    (1152, "Q4_K", "bits per block"),
    (4.625, "Q4_K", "packed into 12 bytes"),                   # 16 scale bytes of 8 bits: 148 B
    (4.4375, "Q4_K", "left out dmin"),                         # 142 B
    (4.375, "Q4_K", "left out d and dmin"),                    # 140 B: only the 6-bit scales and mins
    (4.125, "Q4_K", "12 bytes of packed 6-bit scales"),        # 132 B
    (5.0, "Q4_K", "not an fp16 pair"),                         # 4 + 32/32: fp16 scale and min per sub-block
    (36, "Q4_K", "8 sub-blocks of 32"),                        # 144 × 8 / 32
    (4.5, "Q5_K", "left out qh"),
    (5.4375, "Q5_K", "left out dmin"),
    (6.5, "Q6_K", "left out d"),                               # 208 B: 1% from the right 6.5625
    (6.4375, "Q6_K", "whole int8 bytes"),
    (6.625, "Q6_K", "no dmin"),
    (5.0, "Q4_0", "not fp32"),
])
def test_k_quants_task_1_rejects_typical_mistakes_with_their_hint(wrong, type_name, hint):
    r = ex.check_bits_per_weight(wrong, type_name=type_name)
    assert not r and hint in r.message, r.message


def test_k_quants_task_1_a_function_that_forgets_dmin_fails_on_q4_k():
    def no_dmin(name):
        values, nbytes = STRUCT_BYTES[name]
        return (nbytes - (2 if name in ("Q4_K", "Q5_K") else 0)) * 8 / values
    r = ex.check_bits_per_weight(no_dmin, type_name="Q4_0")  # Q4_0, Q8_0 right, then Q4_K wrong
    assert not r and "Q4_K" in r.message and "left out dmin" in r.message


def test_k_quants_task_1_garbage_and_crashes():

    assert "raised KeyError" in ex.check_bits_per_weight(lambda name: {}[name]).message
    for garbage in (None, "4.5", True, float("nan"), [4.5]):
        r = ex.check_bits_per_weight(garbage)
        assert not r and "finite number" in r.message
    assert ex.check_bits_per_weight(np.float32(4.5))
    assert not ex.check_bits_per_weight(-4.5)


def unpack_by_hand(b):
    """get_scale_min_k4, bit by bit."""
    b = [int(x) for x in b]
    scales, mins = [], []
    for j in range(8):
        if j < 4:
            scales.append(b[j] & 0b111111)
            mins.append(b[j + 4] & 0b111111)
        else:
            scales.append((b[j + 4] & 0x0F) | ((b[j - 4] >> 6) << 4))
            mins.append((b[j + 4] >> 4) | ((b[j] >> 6) << 4))
    return scales, mins


def unpack_no_high_bits(b):
    s, m = unpack_by_hand(b)
    return s[:4] + [int(x) & 15 for x in b[8:12]], m[:4] + [int(x) >> 4 for x in b[8:12]]


def unpack_swapped(b):
    s, m = unpack_by_hand(b)
    return m, s


def unpack_nibbles_swapped(b):
    b = [int(x) for x in b]
    s, m = unpack_by_hand(b)
    return (s[:4] + [(b[j + 8] >> 4) | ((b[j] >> 6) << 4) for j in range(4)],
            m[:4] + [(b[j + 8] & 15) | ((b[j + 4] >> 6) << 4) for j in range(4)])


def unpack_high_bits_from_wrong_bytes(b):
    b = [int(x) for x in b]
    s, m = unpack_by_hand(b)
    return (s[:4] + [(b[j + 8] & 15) | ((b[j + 4] >> 6) << 4) for j in range(4)],
            m[:4] + [(b[j + 8] >> 4) | ((b[j] >> 6) << 4) for j in range(4)])


def unpack_unmasked(b):
    s, m = unpack_by_hand(b)
    return [int(x) for x in b[0:4]] + s[4:], [int(x) for x in b[4:8]] + m[4:]


def unpack_high_bits_unshifted(b):
    b = [int(x) for x in b]
    s, m = unpack_by_hand(b)
    return (s[:4] + [(b[j + 8] & 15) | (b[j] & 0xC0) for j in range(4)],
            m[:4] + [(b[j + 8] >> 4) | (b[j + 4] & 0xC0) for j in range(4)])


def test_k_quants_task_2_accepts_a_right_unpacker():
    r = ex.check_unpack_scales(unpack_by_hand)
    assert r and "12 blocks" in r.message
    assert ex.check_unpack_scales(lambda b: tuple(np.array(v, np.uint8) for v in unpack_by_hand(b)))
    assert ex.check_unpack_scales(lambda b: np.array(unpack_by_hand(b)))  # a (2, 8) array unpacks too


@pytest.mark.parametrize("wrong, hint", [
    (unpack_no_high_bits, "high 2 bits ignored"),
    (unpack_swapped, "scales and mins swapped"),
    (unpack_nibbles_swapped, "nibbles of bytes 8-11 swapped"),
    (unpack_high_bits_from_wrong_bytes, "high bits from the wrong bytes"),
    (unpack_unmasked, "low 6 bits of their byte"),
    (unpack_high_bits_unshifted, "(byte >> 6) << 4"),
    (lambda b: ([0] * 8, [0] * 8), "bytes 0-3: scales 0-3"),
])
def test_k_quants_task_2_rejects_typical_mistakes_with_their_hint(wrong, hint):
    r = ex.check_unpack_scales(wrong)
    assert not r and hint in r.message, r.message


def test_k_quants_task_2_wrong_lengths_and_garbage():
    assert "raised IndexError" in ex.check_unpack_scales(lambda b: (b[20], b[21])).message
    r = ex.check_unpack_scales(lambda b: tuple(v[:4] for v in unpack_by_hand(b)))
    assert not r and "4 values, not 8" in r.message and "Sub-blocks 4-7" in r.message
    r = ex.check_unpack_scales(lambda b: unpack_by_hand(b)[0])  # scales only: 8 items, not a pair
    assert not r and "pair (scales, mins)" in r.message
    assert "pair (scales, mins)" in ex.check_unpack_scales(lambda b: None).message
    assert "whole numbers" in ex.check_unpack_scales(lambda b: ([0.5] * 8, [0] * 8)).message
    assert "8 integers" in ex.check_unpack_scales(lambda b: ("abcdefgh", [0] * 8)).message
    for garbage in (None, 3, unpack_by_hand([0] * 12)):
        assert "write a function" in ex.check_unpack_scales(garbage).message


def decode_by_hand(block, qs_order="chunks", sign=-1.0, use_min=True, use_d=True, centre=0):
    """dequantize_row_q4_K, loop by loop, in Python floats; the keywords make its typical slips."""
    d = float(np.frombuffer(bytes(block[0:2]), "<f2")[0])
    dmin = float(np.frombuffer(bytes(block[2:4]), "<f2")[0])
    scales, mins = unpack_by_hand(block[4:16])
    qs = [int(x) for x in block[16:144]]
    if qs_order == "chunks":       # right: 4 chunks of 32 bytes, low nibbles then high nibbles
        q = []
        for c in range(4):
            q += [x & 15 for x in qs[32 * c:32 * c + 32]] + [x >> 4 for x in qs[32 * c:32 * c + 32]]
    elif qs_order == "pairs":      # values 2k, 2k+1 from byte k
        q = [n for x in qs for n in (x & 15, x >> 4)]
    else:                          # all low nibbles, then all high nibbles, as Q4_0
        q = [x & 15 for x in qs] + [x >> 4 for x in qs]
    y = []
    for i in range(256):
        j = i // 32
        scale = (d if use_d else 1.0) * scales[j]
        y.append(scale * (q[i] - centre) + (sign * dmin * mins[j] if use_min else 0.0))
    return y


def test_k_quants_task_3_accepts_a_right_decoder():
    r = ex.check_decode_q4_k(decode_by_hand)
    assert r and "4 blocks" in r.message
    assert ex.check_decode_q4_k(lambda b: np.array(decode_by_hand(b), np.float32).reshape(8, 32))


def decode_float16(block):
    """numpy's promotion: float16 × uint8 stays float16."""
    d, dmin = np.frombuffer(bytes(block[0:4]), "<f2")
    sc, mn = (np.array(v, np.uint8) for v in unpack_by_hand(block[4:16]))
    qs = np.asarray(block[16:]).reshape(4, 32)
    q = np.stack([qs & 15, qs >> 4], axis=1).reshape(8, 32)
    return ((d * sc)[:, None] * q - (dmin * mn)[:, None]).ravel()


def with_bytes(block, at, new):
    b = np.array(block, np.uint8)
    b[at:at + len(new)] = new
    return b


def decode_swapped_d(block):
    return decode_by_hand(with_bytes(with_bytes(block, 0, block[2:4]), 2, block[0:2]))


def decode_swapped_scales(block):

    from ref_impl.formats.kquants import pack_scales_q4_k
    s, m = unpack_by_hand(block[4:16])
    return decode_by_hand(with_bytes(block, 4, pack_scales_q4_k(np.array([m]), np.array([s]))[0]))


def decode_unit_min(block):
    return decode_by_hand(with_bytes(block, 2, np.array([1.0], "<f2").view(np.uint8)))


def decode_no_high_scale_bits(block):

    from ref_impl.formats.kquants import pack_scales_q4_k
    s, m = unpack_no_high_bits(block[4:16])
    return decode_by_hand(with_bytes(block, 4, pack_scales_q4_k(np.array([s]), np.array([m]))[0]))


@pytest.mark.parametrize("wrong, hint", [
    (lambda b: decode_by_hand(b, qs_order="pairs"), "not values 2k and 2k+1"),
    (lambda b: decode_by_hand(b, qs_order="halves"), "not all 128 low nibbles first"),
    (lambda b: decode_by_hand(b, sign=+1.0), "subtract the min"),
    (lambda b: decode_by_hand(b, use_min=False), "forgot the min"),
    (lambda b: decode_by_hand(b, use_d=False), "multiply it by the super-block's d"),
    (decode_unit_min, "multiply it by the super-block's dmin"),
    (decode_swapped_d, "d and dmin swapped"),
    (decode_swapped_scales, "scales and mins swapped"),
    (lambda b: decode_by_hand(b, centre=8), "no −8"),
    (decode_float16, "float16"),
    (decode_no_high_scale_bits, "only sub-blocks 4-7 are wrong"),
    (lambda b: decode_by_hand(b)[::-1], "x = d·sc[j]·q − dmin·m[j]"),
])
def test_k_quants_task_3_rejects_typical_mistakes_with_their_hint(wrong, hint):
    r = ex.check_decode_q4_k(wrong)
    assert not r and hint in r.message, r.message


def test_k_quants_task_3_wrong_shapes_and_garbage():
    r = ex.check_decode_q4_k(lambda b: [x & 15 for x in b[16:]])
    assert not r and "got 128 values" in r.message and "two 4-bit quants" in r.message
    assert "got 144 values" in ex.check_decode_q4_k(lambda b: b).message
    assert "got 1 values" in ex.check_decode_q4_k(lambda b: None).message
    assert "expected 256 numbers" in ex.check_decode_q4_k(lambda b: ["x"] * 256).message
    assert "inf or nan" in ex.check_decode_q4_k(lambda b: [float("nan")] * 256).message
    for garbage in (None, "decode", decode_by_hand([0] * 144)):
        assert "write a function" in ex.check_decode_q4_k(garbage).message


# Signalling tasks (book/signalling/gddr7-pam3) ---------------------------------------------------

# The chapter's PAM3 code, written out by hand: value 4·b0 + 2·b1 + b2 -> (first, second) symbol
PAM3_BY_HAND = {0: (1, 0), 1: (1, 1), 2: (-1, 1), 3: (0, 1), 4: (0, 0), 5: (0, -1), 6: (-1, 0), 7: (-1, -1)}


def pam3_by_hand(bits, msb_first=True, pad="end", table=PAM3_BY_HAND):
    bits = list(bits)
    fill = [0] * (-len(bits) % 3)
    bits = bits + fill if pad == "end" else fill + bits if pad == "front" else bits[:len(bits) // 3 * 3]
    out = []
    for i in range(0, len(bits), 3):
        b0, b1, b2 = bits[i:i + 3]
        out += table[4 * b0 + 2 * b1 + b2 if msb_first else b0 + 2 * b1 + 4 * b2]
    return out


def test_signalling_task_1_accepts_the_code_written_by_hand():
    assert pam3_by_hand([1, 0, 1, 1, 1]) == [0, -1, -1, 0]           # 101 -> (0,-1); 11(0) -> (-1,0)
    r = ex.check_encode_pam3(pam3_by_hand)
    assert r and "right on all" in r.message


@pytest.mark.parametrize("wrong,hint", [
    (lambda b: pam3_by_hand(b, msb_first=False), "most significant"),
    (lambda b: pam3_by_hand(b, pad="none"), "no padding"),
    (lambda b: pam3_by_hand(b, pad="front"), "pad at the end, not the front"),
    (lambda b: [s + 1 for s in pam3_by_hand(b)], "not level numbers 0, 1, 2"),
    (lambda b: pam3_by_hand(b, table={v: p[::-1] for v, p in PAM3_BY_HAND.items()}), "swapped"),
    # a table that sends the unused pair (+1,-1) instead of (0,0)
    (lambda b: pam3_by_hand(b, table={**PAM3_BY_HAND, 4: (1, -1)}), "never sends"),
    (lambda b: pam3_by_hand(b, table={**PAM3_BY_HAND, 0: (1, 1), 1: (1, 0)}), "PAM3_CODE[value]"),
])
def test_signalling_task_1_rejects_typical_mistakes_with_their_hint(wrong, hint):
    r = ex.check_encode_pam3(wrong)
    assert not r and hint in r.message, r.message


def test_signalling_task_1_garbage():
    assert "expected a list of symbols" in ex.check_encode_pam3(lambda b: ["a"]).message
    assert "whole numbers" in ex.check_encode_pam3(lambda b: [0.5, 1]).message
    for garbage in (None, [1, 0, -1]):
        assert "write a function" in ex.check_encode_pam3(garbage).message


def test_signalling_task_2_accepts_the_bandwidth_worked_by_hand():
    assert ex.check_bus_bandwidth(32 * 256 / 8)                         # 1024 GB/s, C03's bus
    assert ex.check_bus_bandwidth(1792, pin_gbps=28, bus_bits=512)      # RTX 5090
    r = ex.check_bus_bandwidth(lambda gbps, bits: gbps * bits / 8)
    assert r and "right on all 4" in r.message


@pytest.mark.parametrize("wrong,hint", [
    (32 * 256, "bits vs bytes"),
    (32, "one pin's rate (in Gbit/s)"),
    (4, "one pin's rate in GB/s"),
    (128, "one 32-pin device"),
    (1536, "don't multiply by 1.5"),
    (1024 / 1.5, "don't divide by 1.5"),
    (1024 * 1e9 / 2**30, "GiB vs GB"),
    (700, "GB/s = pin rate (Gbit/s) × data pins / 8"),
])
def test_signalling_task_2_rejects_typical_mistakes_with_their_hint(wrong, hint):
    r = ex.check_bus_bandwidth(wrong)
    assert not r and hint in r.message, r.message


def test_signalling_task_2_a_per_device_function_fails_on_a_wide_bus():
    r = ex.check_bus_bandwidth(lambda gbps, bits: gbps * 32 / 8)
    assert not r and "one 32-pin device" in r.message


# Chapter "Thunderbolt 5 and PCIe tunnelling": Interconnect tasks 1-3 (`pytest -k interconnect_task`) --------

def tlp_by_hand(payload, header_dw, ecrc):
    # Gen3+: 4-byte STP token (framing + sequence number), header, optional ECRC, 4-byte LCRC
    return payload / (payload + 4 + 4 * header_dw + 4 * ecrc + 4)


def test_interconnect_task_1_accepts_the_right_number_and_function():
    assert ex.check_tlp_efficiency(256 / 276)                       # 256 / (256 + 20) = 92.75%
    assert ex.check_tlp_efficiency(128 / 148, payload=128)          # 86.49%
    assert ex.check_tlp_efficiency(tlp_by_hand)


@pytest.mark.parametrize("wrong, hint", [
    (lambda p, h, e: p / (p + 4 * h), "only the header"),
    (lambda p, h, e: p / (p + 4 * h + 4 + 4 * e), "one 4-byte field is missing"),
    (lambda p, h, e: p / (p + h + 8 + 4 * e), "double words"),
    (lambda p, h, e: 100 * tlp_by_hand(p, h, e), "not a percentage"),
    (lambda p, h, e: 1 - tlp_by_hand(p, h, e), "overheads' share"),
    (lambda p, h, e: tlp_by_hand(p, h, e) * 128 / 130, "separate factor"),
    (lambda p, h, e: p / (p + 4 * h + 8), "ECRC is on here"),
])
def test_interconnect_task_1_rejects_typical_mistakes_with_their_hint(wrong, hint):
    r = ex.check_tlp_efficiency(wrong)
    assert not r and hint in r.message, r.message


def link_by_hand(gen, lanes, payload):
    gt = {2: 5.0, 3: 8.0, 4: 16.0, 5: 32.0}[gen]
    coding = 8 / 10 if gen <= 2 else 128 / 130
    return gt * lanes * coding / 8 * payload / (payload + 20)


def test_interconnect_task_2_accepts_the_right_number_and_function():
    # Gen4 x4: 16 GT/s x 4 x 128/130 / 8 = 7.877 GB/s; x 256/276 = 7.306 GB/s
    assert ex.check_link_payload_gbs(7.306)
    assert ex.check_link_payload_gbs(link_by_hand)


@pytest.mark.parametrize("wrong, hint", [
    (lambda g, n, p: 8 * link_by_hand(g, n, p), "bits vs bytes"),
    (lambda g, n, p: link_by_hand(g, n, p) * (130 / 128 if g > 2 else 10 / 8), "left out the line coding"),
    (lambda g, n, p: {2: 5.0, 3: 8.0, 4: 16.0, 5: 32.0}[g] * n / 8 * 128 / 130 * p / (p + 20), "wrong line code"),
    (lambda g, n, p: link_by_hand(g, n, p) * (p + 20) / p, "TLP overheads"),
    (lambda g, n, p: link_by_hand(g, n, p) / n, "one lane"),
    (lambda g, n, p: 2 * link_by_hand(g, n, p), "one direction only"),
])
def test_interconnect_task_2_rejects_typical_mistakes_with_their_hint(wrong, hint):
    r = ex.check_link_payload_gbs(wrong)
    assert not r and hint in r.message, r.message


def stream_by_hand(weights, vram, vram_gbs, link_gbs, overlap):
    resident = vram - 1.0                      # 1 GB kept for the KV cache and activations
    t_vram, t_link = resident / vram_gbs, (weights - resident) / link_gbs
    return 1 / (max(t_vram, t_link) if overlap else t_vram + t_link)


def test_interconnect_task_3_accepts_the_right_number_and_function():
    # 16.06 GB on 8 GB: 9.06 GB cross at 5.6 GB/s = 1.618 s; 7 GB at 1008 GB/s = 6.9 ms hidden under it
    assert ex.check_streaming_tokens_per_s(5.6 / 9.06)
    assert ex.check_streaming_tokens_per_s(stream_by_hand)


@pytest.mark.parametrize("wrong, hint", [
    (lambda w, v, b, k, o: stream_by_hand(w, v, b, k, not o), "one after the other: add them"),
    (lambda w, v, b, k, o: stream_by_hand(w, v, b, 8 * k, o), "Gb/s vs GB/s"),
    (lambda w, v, b, k, o: stream_by_hand(w, v, b, k / 8, o), "Gb/s vs GB/s"),
    (lambda w, v, b, k, o: k / w, "only the overflow crosses the link"),
    (lambda w, v, b, k, o: stream_by_hand(w, v + 1, b, k, o), "KV cache"),
    (lambda w, v, b, k, o: 1 / stream_by_hand(w, v, b, k, o), "seconds per token"),
])
def test_interconnect_task_3_rejects_typical_mistakes_with_their_hint(wrong, hint):
    r = ex.check_streaming_tokens_per_s(wrong)
    assert not r and hint in r.message, r.message


def test_interconnect_task_3_a_serial_sum_fails_when_overlapped_and_a_stub_says_so():
    r = ex.check_streaming_tokens_per_s(lambda w, v, b, k, o: stream_by_hand(w, v, b, k, False))
    assert not r and "take the max" in r.message


# ---- Caching tasks (book/dispatch/caching-workspaces) ------------------------------------------------------

def overhead_by_hand(first_ms, steady_ms, n):
    return (first_ms - steady_ms) / n


def test_caching_task_1_accepts_the_right_number_and_function():
    # (6340 - 0.92) / 256 = 24.76 ms per token
    assert ex.check_amortized_overhead(24.76)
    assert ex.check_amortized_overhead(overhead_by_hand)


@pytest.mark.parametrize("wrong, hint", [
    (lambda f, s, n: f / n, "only first − steady"),
    (lambda f, s, n: (f - s) / (n - 1), "the first one included"),
    (lambda f, s, n: f - s, "whole pause"),
    (lambda f, s, n: s + (f - s) / n, "mean time per token"),
    (lambda f, s, n: (f - s) / n / 1e3, "not seconds"),
    (lambda f, s, n: 100 * (f - s) / n / s, "percentage"),
])
def test_caching_task_1_rejects_typical_mistakes_with_their_hint(wrong, hint):
    r = ex.check_amortized_overhead(wrong)
    assert not r and hint in r.message, r.message


def kv_by_hand_static(a, context, dtype_bytes):
    return 2 * a.num_hidden_layers * a.num_key_value_heads * context * a.head_dim * dtype_bytes


def test_caching_task_2_accepts_the_right_number_and_function():
    # Llama-3.1-8B: 2 x 32 layers x 8 KV heads x 8192 x 128 x 2 bytes = 1 GiB
    assert ex.check_static_kv_bytes(1_073_741_824)
    assert ex.check_static_kv_bytes(kv_by_hand_static)


@pytest.mark.parametrize("wrong, hint", [
    (lambda a, c, b: kv_by_hand_static(a, c, b) // 2, "keys and values"),
    (lambda a, c, b: kv_by_hand_static(a, c, b) // a.num_hidden_layers, "every layer"),
    (lambda a, c, b: kv_by_hand_static(a, c, b) * a.num_attention_heads // a.num_key_value_heads, "grouped-query"),
    (lambda a, c, b: 8 * kv_by_hand_static(a, c, b), "bits vs bytes"),
    (lambda a, c, b: kv_by_hand_static(a, -(-c // 256) * 256, b), "chunked cache"),
    (lambda a, c, b: kv_by_hand_static(a, c, 2), "not 2"),
    (lambda a, c, b: float(kv_by_hand_static(a, c, b)) + 0.5, "whole number"),
])
def test_caching_task_2_rejects_typical_mistakes_with_their_hint(wrong, hint):
    r = ex.check_static_kv_bytes(wrong)
    assert not r and hint in r.message, r.message


def test_caching_task_3_accepts_the_right_number_and_function():
    assert ex.check_page_faults(16_384)                     # 64 MiB / 4 KiB
    assert ex.check_page_faults(lambda n, p: (n + p - 1) // p)


@pytest.mark.parametrize("wrong, hint", [
    (lambda n, p: n // p, "round up"),
    (lambda n, p: 8 * n // p, "bits vs bytes"),
    (lambda n, p: -(-n // 4000), "not 4,000"),
    (lambda n, p: -(-n // 4096), "16 KiB pages"),
    (lambda n, p: 2 * -(-n // p), "one fault per page"),
])
def test_caching_task_3_rejects_typical_mistakes_with_their_hint(wrong, hint):
    r = ex.check_page_faults(wrong)
    assert not r and hint in r.message, r.message


# Chapter "Time to first token and inter-token jitter": Jitter tasks 1-2 (`pytest -k jitter_task`) -----------

def p99_by_hand(times):
    itl = [1e3 * (b - a) for a, b in zip(times, times[1:])]
    s = sorted(itl)
    r = 0.99 * (len(s) - 1)                      # linear interpolation between closest ranks
    lo = int(r)
    return s[lo] + (r - lo) * (s[min(lo + 1, len(s) - 1)] - s[lo])


def test_jitter_task_1_accepts_interpolated_and_nearest_rank():
    import math
    assert ex.check_p99_itl(p99_by_hand)
    assert ex.check_p99_itl(lambda t: sorted(1e3 * (b - a) for a, b in zip(t, t[1:]))[math.ceil(0.99 * (len(t) - 1)) - 1])


@pytest.mark.parametrize("wrong, hint", [
    (lambda t: p99_by_hand(t) / 1e3, "in seconds"),
    (lambda t: 1e3 * sorted(t)[int(0.99 * len(t))], "timestamps"),
    (lambda t: max(1e3 * (b - a) for a, b in zip(t, t[1:])), "maximum"),
    (lambda t: sum(1e3 * (b - a) for a, b in zip(t, t[1:])) / (len(t) - 1), "mean"),
    (lambda t: sorted(1e3 * (b - a) for a, b in zip(t, t[1:]))[int(0.99 * (len(t) - 1))], "off by one rank"),
    (lambda t: sorted(1e3 * (b - a) for a, b in zip(t, t[1:]))[int(0.01 * (len(t) - 1))], "p1"),
])
def test_jitter_task_1_rejects_typical_mistakes_with_their_hint(wrong, hint):
    r = ex.check_p99_itl(wrong)
    assert not r and hint in r.message, r.message


def test_jitter_task_1_garbage():
    assert "one number" in ex.check_p99_itl(lambda t: [1.0]).message


def growth_by_hand(prompt_len, n_steps, step=256):
    # the prefill's buffer holds the prompt rounded up to whole steps; it grows when a write falls past it
    cap, out = -(-prompt_len // step) * step, []
    for k in range(n_steps):
        if prompt_len + k >= cap:
            out.append(k)
            cap += step
    return out


def test_jitter_task_2_accepts_the_rule_worked_by_hand():
    assert growth_by_hand(32, 600) == [224, 480]
    assert ex.check_growth_steps(growth_by_hand)


@pytest.mark.parametrize("wrong, hint", [
    (lambda p, n, s=256: list(range(s, n, s)), "prompt already filled"),
    (lambda p, n, s=256: [k - 1 for k in growth_by_hand(p, n, s) if k >= 1], "off by one"),
    (lambda p, n, s=256: [k + 1 for k in growth_by_hand(p, n, s)], "off by one"),
    (lambda p, n, s=256: [k for k in growth_by_hand(p, n, s) if k > 0], "very first decode step"),
])
def test_jitter_task_2_rejects_typical_mistakes_with_their_hint(wrong, hint):
    r = ex.check_growth_steps(wrong)
    assert not r and hint in r.message, r.message


def test_jitter_task_2_garbage():
    assert "expected a list" in ex.check_growth_steps(lambda p, n, s=256: 3.5).message


# Chapter "Command buffers and sync bubbles": Dispatch tasks 1-2 (`pytest -k dispatch_task`) ----------------

def double_buffer_by_hand(e, g, n, s, h):
    return 1 / max(n * e + s + h, n * g)


def test_dispatch_task_1_accepts_the_right_number_and_function():
    # CPU: 300 x 4 + 30 + 80 = 1310 µs, GPU: 300 x 3 = 900 µs -> 1 / 1310 µs = 763.4 tokens/s
    assert ex.check_double_buffer_tokens_per_s(1e6 / 1310)
    assert ex.check_double_buffer_tokens_per_s(double_buffer_by_hand)


@pytest.mark.parametrize("wrong, hint", [
    (lambda e, g, n, s, h: 1 / (n * e + n * g + s + h), "synchronous queue"),
    (lambda e, g, n, s, h: 1 / max(n * e, n * g), "CPU's side of the max"),
    (lambda e, g, n, s, h: 1 / max(n * e + s + h, n * g + s + h), "n·g alone"),
    (lambda e, g, n, s, h: 1 / max(e + s + h, g), "per kernel"),
    (lambda e, g, n, s, h: 1 / min(n * e + s + h, n * g), "GPU's side alone (or the faster side)"),
    (lambda e, g, n, s, h: max(n * e + s + h, n * g), "seconds per token"),
    (lambda e, g, n, s, h: 1 / (n * e + s + h), "CPU's side alone"),     # right in case 1 (CPU-bound), not case 2
    (lambda e, g, n, s, h: 1 / (n * g), "CPU is the slower one"),
])
def test_dispatch_task_1_rejects_typical_mistakes_with_their_hint(wrong, hint):
    r = ex.check_double_buffer_tokens_per_s(wrong)
    assert not r and hint in r.message, r.message


def test_dispatch_task_1_garbage():
    assert not ex.check_double_buffer_tokens_per_s("fast")


def stops_by_hand(table, threshold):
    rows = sorted(table, key=lambda r: r["params_b"])
    gains = [r["async_tok_s"] / r["sync_tok_s"] - 1 for r in rows]
    peak = gains.index(max(gains))
    return next((r["model"] for r, x in zip(rows[peak + 1:], gains[peak + 1:]) if x < threshold), None)


def degradation_by_hand(table, threshold):   # the slip: how much slower syncing is, 1 - sync / async
    rows = sorted(table, key=lambda r: r["params_b"])
    loss = [1 - r["sync_tok_s"] / r["async_tok_s"] for r in rows]
    peak = loss.index(max(loss))
    return next((r["model"] for r, x in zip(rows[peak + 1:], loss[peak + 1:]) if x < threshold), None)


def test_dispatch_task_2_table_and_answer_by_hand():
    table = ex.async_gain_table()
    # Llama-3.1-8B: host 32 x 40 = 1280 µs + s 30 + h 100 = 1410 µs; GPU 16 GB / 1000 GB/s = 16 ms
    # sync 1 / 17.41 ms = 57.44 tok/s, async 1 / 16 ms = 62.5 tok/s: gain 8.8%, under 10%; Llama-3.2-3B's is 19.5%
    row = next(r for r in table if r["model"] == "Llama-3.1-8B")
    assert row["sync_tok_s"] == pytest.approx(1 / 17.41e-3, abs=0.01) and row["async_tok_s"] == 62.5
    assert stops_by_hand(table, 0.10) == "Llama-3.1-8B"
    assert ex.check_async_stops_helping("Llama-3.1-8B")
    assert ex.check_async_stops_helping(stops_by_hand)


@pytest.mark.parametrize("wrong, hint", [
    (lambda t, th: next((r["model"] for r in sorted(t, key=lambda r: r["params_b"])
                         if r["async_tok_s"] / r["sync_tok_s"] - 1 < th), None), "smallest models gain little"),
    (lambda t, th: max(t, key=lambda r: r["async_tok_s"] / r["sync_tok_s"])["model"], "helps most"),
    (lambda t, th: degradation_by_hand(t, th), "not 1 − sync / async"),
    (lambda t, th: (lambda names, a: names[names.index(a) - 1] if a else None)(
        [r["model"] for r in sorted(t, key=lambda r: r["params_b"])], stops_by_hand(t, th)), "next larger one"),
])
def test_dispatch_task_2_rejects_typical_mistakes_with_their_hint(wrong, hint):
    r = ex.check_async_stops_helping(wrong)
    assert not r and hint in r.message, r.message
    assert not ex.check_async_stops_helping("Llama-3.2-3B")


# KV tasks (book/kv-cache/kv-quantization) ---------------------------------------------------------

def affine_bytes_by_hand(layers, kv_heads, head_dim, bits, group, scale_bytes):
    values = 2 * layers * kv_heads * head_dim                       # K and V
    return values * bits / 8 + values / group * 2 * scale_bytes     # codes + a scale and a bias per group


def test_kv_task_1_accepts_the_hand_formula():
    # Llama-3.1-8B: 2 x 32 x 8 x 128 = 65,536 values; 4 bits + 2 x 16 bits / 64 = 4.5 bits -> 36,864 bytes
    assert affine_bytes_by_hand(32, 8, 128, 4, 64, 2) == 36_864
    assert ex.check_kv_bytes_per_token(36_864)
    assert ex.check_kv_bytes_per_token(affine_bytes_by_hand)


@pytest.mark.parametrize("wrong, hint", [
    (lambda L, kv, hd, b, g, sb: 2 * L * kv * hd * b / 8, "codes alone"),
    (lambda L, kv, hd, b, g, sb: 2 * L * kv * hd * (b / 8 + sb / g), "bias"),
    (lambda L, kv, hd, b, g, sb: affine_bytes_by_hand(L, kv, hd, b, g, sb) / 2, "keys and values"),
    (lambda L, kv, hd, b, g, sb: affine_bytes_by_hand(L, kv * 4, hd, b, g, sb), "num_key_value_heads"),
    (lambda L, kv, hd, b, g, sb: 8 * affine_bytes_by_hand(L, kv, hd, b, g, sb), "bits vs bytes"),
])
def test_kv_task_1_rejects_typical_mistakes_with_their_hint(wrong, hint):
    r = ex.check_kv_bytes_per_token(wrong)
    assert not r and hint in r.message, r.message


def per_channel_by_hand(keys, bits, axis=0):
    qmax = 2 ** (bits - 1) - 1
    scale = np.abs(keys).max(axis=axis, keepdims=True) / qmax
    return np.clip(np.round(keys / np.where(scale == 0, 1, scale)), -qmax, qmax) * scale


def test_kv_task_2_accepts_per_channel_rounding_and_rejects_per_token():
    assert ex.check_quantize_keys_per_channel(per_channel_by_hand)
    r = ex.check_quantize_keys_per_channel(lambda k, b: per_channel_by_hand(k, b, axis=1))
    assert not r and "one scale per token" in r.message, r.message
    r = ex.check_quantize_keys_per_channel(lambda k, b: k)           # no rounding at all
    assert not r and "expected" in r.message
    r = ex.check_quantize_keys_per_channel(lambda k, b: per_channel_by_hand(k, b)[:, :8])
    assert not r and "shape" in r.message


def test_kv_task_2_rejects_an_unsafe_zero_channel():
    def divides_by_zero(keys, bits):
        qmax = 2 ** (bits - 1) - 1
        with np.errstate(invalid="ignore", divide="ignore"):
            scale = np.abs(keys).max(axis=0, keepdims=True) / qmax
            return np.clip(np.round(keys / scale), -qmax, qmax) * scale
    r = ex.check_quantize_keys_per_channel(divides_by_zero)
    assert not r and "zero" in r.message, r.message


def outliers_by_hand(keys, factor):
    m = np.abs(keys).mean(axis=0)
    return [c for c in range(keys.shape[1]) if m[c] > factor * np.median(m)]


def test_kv_task_3_accepts_the_rule_and_rejects_max_mean_and_counts():
    assert ex.check_outlier_channels(outliers_by_hand)
    by_max = lambda k, f: [c for c in range(k.shape[1])
                           if np.abs(k).max(0)[c] > f * np.median(np.abs(k).max(0))]
    r = ex.check_outlier_channels(by_max)
    assert not r and "spike" in r.message, r.message
    r = ex.check_outlier_channels(lambda k, f: len(outliers_by_hand(k, f)))
    assert not r and "indices" in r.message
    r = ex.check_outlier_channels(lambda k, f: outliers_by_hand(k, f)[:-1])
    assert not r


# Spec tasks (book/speculative/speculative-mtp) ------------------------------------------------------

def expected_by_hand(alpha, gamma):
    return float(sum(alpha ** i for i in range(gamma + 1)))        # 1 + α + ... + α^γ


def test_spec_task_1_accepts_the_geometric_sum():
    # α = 0.7, γ = 4: 1 + 0.7 + 0.49 + 0.343 + 0.2401 = 2.7731
    assert expected_by_hand(0.7, 4) == pytest.approx(2.7731)
    assert ex.check_expected_tokens(2.7731)
    assert ex.check_expected_tokens(expected_by_hand)


@pytest.mark.parametrize("wrong, hint", [
    (lambda a, g: a * g, "judged alone"),
    (lambda a, g: expected_by_hand(a, g) - 1, "target emits"),
    (lambda a, g: expected_by_hand(a, g - 1), "γ + 1 terms"),
])
def test_spec_task_1_rejects_typical_mistakes_with_their_hint(wrong, hint):
    r = ex.check_expected_tokens(wrong)
    assert not r and hint in r.message, r.message


def optimal_by_hand(alpha, c, max_gamma):
    return max(range(max_gamma + 1), key=lambda g: expected_by_hand(alpha, g) / (g * c + 1))


def test_spec_task_2_accepts_the_best_gamma_and_rejects_the_largest():
    # α = 0.8, c = 0.05: γ = 8 gives 4.33 / 1.40 = 3.093; γ = 7 3.083, γ = 9 3.089
    assert optimal_by_hand(0.8, 0.05, 16) == 8
    assert ex.check_optimal_gamma(8) and ex.check_optimal_gamma(optimal_by_hand)
    r = ex.check_optimal_gamma(lambda a, c, m: m)
    assert not r and "peaks and falls" in r.message, r.message
    r = ex.check_optimal_gamma(lambda a, c, m: max(range(m + 1), key=lambda g: expected_by_hand(a, g) - g * c))
    assert not r and "ratio" in r.message, r.message


def inverse_cdf(weights, u):
    return int(np.searchsorted(np.cumsum(weights), u * weights.sum(), side="right"))


def accept_by_hand(p, q, x, u_accept, u_sample):
    if u_accept * q[x] < p[x]:
        return x
    return inverse_cdf(np.maximum(p - q, 0), u_sample)


def test_spec_task_3_accepts_the_rule_and_names_the_residual_slip():
    assert ex.check_accept_one(accept_by_hand)
    from_p = lambda p, q, x, ua, us: x if ua * q[x] < p[x] else inverse_cdf(p, us)
    r = ex.check_accept_one(from_p)
    assert not r and "residual" in r.message, r.message
    inverted = lambda p, q, x, ua, us: x if ua * p[x] < q[x] else inverse_cdf(np.maximum(p - q, 0), us)
    r = ex.check_accept_one(inverted)
    assert not r and "not the inverse" in r.message, r.message
    r = ex.check_accept_one(lambda p, q, x, ua, us: float(x))
    assert not r and "token id" in r.message


# Kernel tasks (chapter "Writing a GEMV kernel", kernels.py) -------------------------------------------------

def gemv_bytes_by_hand(n, k, bits, group, rows):
    scales = 2 * 2 * n * k // group if bits < 16 else 0        # a float16 scale and bias per group of each row
    return n * k * bits // 8 + scales + 2 * rows * (k + n)     # codes + scales and biases + x in and y out


# Llama-3.1-8B's gate (14336 x 4096) in q4 g32: codes 14336 x 4096 / 2 = 29,360,128; scales and biases
# 14336 x 128 groups x 4 bytes = 7,340,032; x and y 2 x (4096 + 14336) = 36,864 -> 36,737,024 bytes
K1_RIGHT = 36_737_024


def test_kernel_tasks_are_in_the_stub_and_crash_test():
    assert {"check_gemv_bytes", "check_gemv_time_us", "check_launch_choice"} <= set(CHECKERS)


def test_kernel_task_1_accepts_the_hand_formula():
    assert gemv_bytes_by_hand(14336, 4096, 4, 32, 1) == K1_RIGHT
    assert ex.check_gemv_bytes(K1_RIGHT)
    r = ex.check_gemv_bytes(gemv_bytes_by_hand)
    assert r and "5 cases" in r.message
    assert not ex.check_gemv_bytes(K1_RIGHT + 4096)               # counted exactly: 4 KiB is 1e-4 of it


@pytest.mark.parametrize("wrong, hint", [
    (lambda n, k, b, g, r: n * k * b // 8 + 2 * r * (k + n), "float16 scale and a float16 bias"),
    (lambda n, k, b, g, r: n * k * b // 8 + (2 * n * k // g if b < 16 else 0) + 2 * r * (k + n), "bias as well"),
    (lambda n, k, b, g, r: gemv_bytes_by_hand(n, k, b, g, r) - 2 * r * (k + n), "also reads x"),
    (lambda n, k, b, g, r: gemv_bytes_by_hand(n, k, b, g, 1), "4 rows here"),     # right on the 1-row cases
    (lambda n, k, b, g, r: 8 * gemv_bytes_by_hand(n, k, b, g, r), "8× too big"),
    (lambda n, k, b, g, r: gemv_bytes_by_hand(n, k, b, g, r) + n * k * b * 7 // 8, "4-bit code is 0.5 bytes"),
    (lambda n, k, b, g, r: gemv_bytes_by_hand(n, k, b, g, r) + (4 * n * k // g if b < 16 else 0), "not 4"),
    (lambda n, k, b, g, r: gemv_bytes_by_hand(n, k, b, g, r) / 1e9, "in GB"),
    (lambda n, k, b, g, r: gemv_bytes_by_hand(n, k, b, g, r) / 2**30, "in GiB"),
])
def test_kernel_task_1_rejects_typical_mistakes_with_their_hint(wrong, hint):
    r = ex.check_gemv_bytes(wrong)
    assert not r and hint in r.message, r.message


def test_kernel_task_1_rejects_a_number_without_scales_and_garbage():
    r = ex.check_gemv_bytes(29_360_128 + 36_864)
    assert not r and "float16 scale" in r.message, r.message
    assert "finite number" in ex.check_gemv_bytes("36 MB").message


def gemv_time_by_hand(n, k, bits, group, read_gbs):
    return gemv_bytes_by_hand(n, k, bits, group, 1) / (read_gbs * 1e9) * 1e6


def test_kernel_task_2_accepts_the_hand_formula():
    # 36,737,024 bytes / 3.3e12 bytes/s = 11.13 µs
    assert gemv_time_by_hand(14336, 4096, 4, 32, 3300.0) == pytest.approx(11.132, abs=1e-3)
    assert ex.check_gemv_time_us(11.13)
    r = ex.check_gemv_time_us(gemv_time_by_hand)
    assert r and "4 cases" in r.message


@pytest.mark.parametrize("wrong, hint", [
    (lambda n, k, b, g, bw: gemv_time_by_hand(n, k, b, g, bw) / 1e3, "milliseconds"),
    (lambda n, k, b, g, bw: gemv_time_by_hand(n, k, b, g, bw) / 1e6, "in seconds"),
    (lambda n, k, b, g, bw: gemv_bytes_by_hand(n, k, b, g, 1) / (bw * 2**30) * 1e6, "not 2^30"),
    (lambda n, k, b, g, bw: 2 * n * k / (bw * 1e9) * 1e6, "not 16-bit"),
    (lambda n, k, b, g, bw: (n * k * b // 8 + 2 * (k + n)) / (bw * 1e9) * 1e6, "scale and bias"),
])
def test_kernel_task_2_rejects_typical_mistakes_with_their_hint(wrong, hint):
    r = ex.check_gemv_time_us(wrong)
    assert not r and hint in r.message, r.message


LAUNCH_CASES = [(14336, 4096, 1, 4), (1024, 4096, 1, 4), (4096, 1024, 1, 4), (128256, 4096, 1, 16),
                (4096, 4096, 4, 4), (4096, 14336, 9, 8)]


def launch_choices_by_hand(n, k, rows, bits):
    """Every (rows_per_warp, unroll) that keeps the chapter's rules, by brute force."""
    chunks = -(-k // (128 // bits) // 32)                       # 16-byte chunks of one row per lane
    ok = {(r, u): r * min(u, chunks) for r in (1, 2, 4, 8) for u in (1, 2, 4, 8)
          if r * rows <= 16 and r * u <= 8 and (r == 1 or -(-n // r) >= 8 * 132) and u <= chunks}
    return [c for c, in_flight in ok.items() if in_flight >= min(4, max(ok.values()))]


def launch_by_hand(n, k, rows, bits):
    return launch_choices_by_hand(n, k, rows, bits)[0]


def test_kernel_task_3_hand_choices():
    assert launch_choices_by_hand(1024, 4096, 1, 4) == [(1, 4)]             # 1024 rows: one row a warp
    assert launch_choices_by_hand(4096, 1024, 1, 4) == [(2, 1)]             # one chunk a lane: unroll 1
    assert launch_choices_by_hand(4096, 14336, 9, 8) == [(1, 4), (1, 8)]    # 9 rows: one weight row a warp
    assert all(launch_choices_by_hand(*case) for case in LAUNCH_CASES)     # a right answer exists everywhere


@pytest.mark.parametrize("case, choice", [(case, c) for case in LAUNCH_CASES for c in launch_choices_by_hand(*case)])
def test_kernel_task_3_accepts_every_right_choice(case, choice):
    r = ex.check_launch_choice(lambda *args: choice if args == case else launch_by_hand(*args))
    assert r, r.message


def test_kernel_task_3_launch_config_default_passes():
    from ref_impl import kernels

    def default(n, k, rows, bits):
        launch = kernels.launch_config(kernels.Format(bits, 0 if bits == 16 else 32), n, k, rows)
        return launch.rows_per_warp, launch.unroll
    r = ex.check_launch_choice(default)
    assert r and "6 cases" in r.message, r.message


def only_on(test, choice):
    """launch_by_hand, except `choice` on the cases where test(n, k, rows, bits) holds."""
    return lambda *args: choice if test(*args) else launch_by_hand(*args)


@pytest.mark.parametrize("wrong, hint", [
    (lambda *_: (3, 4), "each 1, 2, 4 or 8"),
    (only_on(lambda n, k, rows, b: rows == 9, (2, 4)), "MAX_ACCUMULATORS = 16"),
    (lambda *_: (4, 4), "MAX_LOADS = 8"),
    (only_on(lambda n, k, rows, b: n == 1024, (2, 4)), "fill the GPU: 512 warps"),
    (lambda *_: (1, 8), "idle loads"),
    (only_on(lambda n, k, rows, b: k == 1024, (2, 2)), "only 1 chunk of 16 bytes"),
    (lambda *_: (1, 1), "bytes in flight"),
    (only_on(lambda n, k, rows, b: k == 1024, (1, 1)), "the rules allow 2 here"),
])
def test_kernel_task_3_rejects_each_broken_rule_by_name(wrong, hint):
    r = ex.check_launch_choice(wrong)
    assert not r and hint in r.message, r.message


@pytest.mark.parametrize("wrong", [lambda *_: 2, lambda *_: (2, 4, 1), lambda *_: [2, 4], lambda *_: (2.0, 4),
                                   lambda *_: (True, 4)])
def test_kernel_task_3_wants_a_tuple_of_two_whole_numbers(wrong):
    r = ex.check_launch_choice(wrong)
    assert not r and "expected a tuple (rows_per_warp, unroll)" in r.message, r.message


def test_kernel_task_3_reports_launch_config_refusing_a_choice(monkeypatch):
    from ref_impl import kernels
    real = kernels.launch_config

    def refuses_2_4(fmt, n, k, rows, rows_per_warp=None, unroll=None, **kw):
        if (rows_per_warp, unroll) == (2, 4):
            raise ValueError("no (2, 4) here")
        return real(fmt, n, k, rows, rows_per_warp, unroll, **kw)
    monkeypatch.setattr(kernels, "launch_config", refuses_2_4)
    r = ex.check_launch_choice(lambda *_: (2, 4))
    assert not r and "launch_config refuses it: no (2, 4) here" in r.message, r.message
