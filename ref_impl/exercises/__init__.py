"""Checkers for the book's exercises: accept a right answer, reject a wrong one with a hint.

A checker takes the learner's answer -- a number, or a function that it calls on several test
inputs -- and compares it with the engine's own computation (theory, formats, engine). A wrong
answer is compared with the values the usual mistakes produce (bits for bytes, K without V, GiB
for GB, ...): a match names the mistake, otherwise the hint gives the size of the miss and the
recipe. Every checker returns a `Result`, which a notebook displays as ✓ or ✗ with the message.

`core` holds the result type and the shared judges; each chapter's checkers live in a module of
their own, and its tests in `tests/test_exercises_<module>.py`, named `test_<chapter>_task_<n>_...`
(the roofline's `test_task_<n>_...`), so `pytest -k <chapter>_task_<n>` selects one task.
Notebooks use `from ref_impl import exercises as ex` and call `ex.check_...`.

See chapter: intro-roofline
"""

from ref_impl.exercises.build_block import check_attend, check_mlp, check_model_parts, check_rms_norm, check_rope
from ref_impl.exercises.build_decode import check_cache, check_decode, check_sample
from ref_impl.exercises.build_extras import check_accept, check_dequantize_sym8, check_quantize_sym8, check_sym8_cache
from ref_impl.exercises.build_format import (
    check_dequantize_q4_k,
    check_dequantize_q8_0,
    check_read_gguf,
    check_read_value,
)
from ref_impl.exercises.capstone import check_bandwidth_share, check_composes
from ref_impl.exercises.core import RTOL, Result
from ref_impl.exercises.dispatch import (
    async_gain_table,
    check_amortized_overhead,
    check_async_stops_helping,
    check_double_buffer_tokens_per_s,
    check_growth_steps,
    check_p99_itl,
    check_page_faults,
    check_static_kv_bytes,
)
from ref_impl.exercises.gguf import check_next_offset, check_zero_copy_view
from ref_impl.exercises.interconnect import check_link_payload_gbs, check_streaming_tokens_per_s, check_tlp_efficiency
from ref_impl.exercises.kernels import (check_gemv_bytes, check_gemv_time_us, check_launch_choice, check_merge_splits,
                                        check_q8_dot)
from ref_impl.exercises.kquants import check_bits_per_weight, check_decode_q4_k, check_unpack_scales
from ref_impl.exercises.kv_cache import (
    check_kv_bytes_per_token,
    check_outlier_channels,
    check_quantize_keys_per_channel,
)
from ref_impl.exercises.pipeline import check_cluster_tokens_per_s, check_link_bytes
from ref_impl.exercises.roofline import (
    check_bytes_per_token,
    check_decode_tokens_per_s,
    check_matmul_intensity,
    check_moe_bytes_per_token,
    check_ridge_point,
)
from ref_impl.exercises.signalling import check_bus_bandwidth, check_encode_pam3
from ref_impl.exercises.speculative import check_accept_one, check_expected_tokens, check_optimal_gamma

__all__ = [
    "RTOL", "Result",
    # chapter "The roofline"
    "check_bytes_per_token", "check_matmul_intensity", "check_ridge_point", "check_decode_tokens_per_s",
    "check_moe_bytes_per_token",
    # "GGUF: file layout and alignment", "Super-blocks: K-quants"
    "check_next_offset", "check_zero_copy_view",
    "check_bits_per_weight", "check_unpack_scales", "check_decode_q4_k",
    # "GDDR7 and PAM3", "Thunderbolt 5 and PCIe tunnelling"
    "check_encode_pam3", "check_bus_bandwidth",
    "check_tlp_efficiency", "check_link_payload_gbs", "check_streaming_tokens_per_s",
    # "Two machines: a pipeline over the link"
    "check_link_bytes", "check_cluster_tokens_per_s",
    # the dispatch chapters: caching and workspaces, TTFT and jitter, command buffers
    "check_amortized_overhead", "check_static_kv_bytes", "check_page_faults",
    "check_p99_itl", "check_growth_steps",
    "check_double_buffer_tokens_per_s", "async_gain_table", "check_async_stops_helping",
    # "Quantizing the KV cache", "Speculative decoding and multi-token prediction", "Writing a GEMV kernel"
    "check_kv_bytes_per_token", "check_quantize_keys_per_channel", "check_outlier_channels",
    "check_expected_tokens", "check_optimal_gamma", "check_accept_one",
    "check_gemv_bytes", "check_gemv_time_us", "check_launch_choice", "check_merge_splits", "check_q8_dot",
    # "Capstone: everything at once"
    "check_bandwidth_share", "check_composes",
    # "Build it yourself", steps 1-7
    "check_read_value", "check_read_gguf", "check_dequantize_q8_0", "check_dequantize_q4_k",
    "check_rms_norm", "check_rope", "check_attend", "check_mlp", "check_model_parts",
    "check_cache", "check_decode", "check_sample",
    "check_quantize_sym8", "check_dequantize_sym8", "check_sym8_cache", "check_accept",
]
