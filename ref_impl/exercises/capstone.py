"""Exercises of chapter "Capstone: everything at once" (book/capstone/capstone): capstone tasks 1 and 2.

The share of a machine's memory bandwidth a decode speed implies (the capstone's bandwidth column), and which
switches of the composed decoder compose; checked against theory.roofline's bytes per token and against
`engine.compose.Techniques` itself. Tests: `pytest tests/test_exercises_capstone.py -k capstone_task`.

See chapter: capstone
"""

from __future__ import annotations

from ref_impl.engine.compose import Techniques
from ref_impl.exercises.core import Result, judge_cases, judge_exact
from ref_impl.theory import roofline as rl
from ref_impl.theory import shapes


def _share_case(shape: str, bits: float, context: int, tokens_per_s: float, bandwidth_gbs: float):
    step = rl.decode_bytes_per_token(shapes.shape(shape), bits, context)
    right = tokens_per_s * step / (bandwidth_gbs * 1e9)
    mistakes = [(right * 1e9, "the bandwidth is in GB/s: multiply it by 1e9 to get bytes per second."),
                (right * 1e9 / 2**30, "a GB here is 1e9 bytes, not 2^30."),
                (right * 8, "bytes, not bits: the step reads bytes_per_token bytes."),
                (right * 100, "give a fraction (0.8), not a percentage (80)."),
                (right / tokens_per_s, "multiply by the tokens per second: each token reads the step's bytes once.")]
    label = f"{shape} at {bits:g} bits per weight, context {context}, {tokens_per_s:g} tok/s on {bandwidth_gbs:g} GB/s"
    return (tokens_per_s, step, bandwidth_gbs), label, right, mistakes


def check_bandwidth_share(answer) -> Result:
    """Capstone task 1: `answer(tokens_per_s, bytes_per_token, bandwidth_gbs)`, the fraction of the bandwidth a
    decode speed implies when every token reads bytes_per_token (weights and KV cache) once; called on four
    cases whose bytes per token are theory.roofline.decode_bytes_per_token's."""
    cases = [_share_case("Llama-3.1-8B", 4.5, 4096, 130.0, 4300.0), _share_case("Llama-3.2-1B", 16, 512, 35.0, 14.0),
             _share_case("Qwen3-8B", 8.5, 32768, 60.0, 800.0), _share_case("Llama-3.1-8B", 16, 128, 210.0, 4240.0)]
    return judge_cases("Capstone task 1", answer, cases, "of the bandwidth",
                       "tokens/s × bytes per token is the bytes read per second; divide by the bandwidth in "
                       "bytes per second (GB/s × 1e9).", rtol=1e-6)


# (kv, fused, speculate, compiled), each a combination the chapter's table asks about, with the slip a wrong
# answer usually is
COMBINATIONS = [
    (("sym8", False, "draft", False), "sym8 stores each token on its own: a verification writes what decoding would."),
    (("kivi4", False, "mtp", False), "KIVI quantizes a key block when a forward's end passes it: a verification of "
                                     "gamma+1 positions sees a cache that one-at-a-time decoding never had."),
    (("float", False, "draft", True), "a compiled step is one position; a verification is gamma+1."),
    (("sym8", False, None, True), "mx.compile traces the float cache's buffers; a quantized cache is another object."),
    (("affine4-g32", True, "draft", False), "affine codes have a fused path, and they rewind exactly."),
    (("sym4", True, None, False), "MLX's quantized matmul reads affine codes only: symmetric codes stay dequantized."),
    (("float", False, None, True), "the float cache compiles: that is the writing-a-kernel chapter's compiled step."),
    (("outlier4", True, "mtp", False), "outlier4 stores its float channels per token too: it rewinds exactly."),
]


def _composes(kv: str, fused: bool, speculate: str | None, compiled: bool) -> bool:
    try:
        Techniques(kv=kv, fused=fused, speculate=speculate, compiled=compiled)
    except ValueError:
        return False
    return True


def check_composes(answer) -> Result:
    """Capstone task 2: `answer(kv, fused, speculate, compiled)`, True where the composed decoder runs that
    combination and False where it refuses it; called on eight combinations, judged by compose.Techniques."""
    cases = []
    for args, hint in COMBINATIONS:
        right = _composes(*args)
        cases.append((args, f"kv={args[0]}, fused={args[1]}, speculate={args[2]}, compiled={args[3]}", right,
                      [(not right, hint)]))
    return judge_exact("Capstone task 2", answer, cases, "see the refusals in the module docstring of "
                       "ref_impl/engine/compose.py", bool)
