"""Exercises of chapter "Two machines: a pipeline over the link" (book/signalling/pipeline-cluster):
Pipeline tasks 1 and 2.

The bytes a pipeline step puts on its links, and the tokens/s of a model split over machines in a
pipeline; checked against `theory.interconnect` (pipeline_link_bytes, pipeline_tokens_per_s).
Tests: `pytest tests/test_exercises_pipeline.py -k pipeline_task`.

See chapter: pipeline
"""

from __future__ import annotations

from ref_impl.exercises.core import Result, judge_cases, judge_exact
from ref_impl.theory import interconnect as ic


def _bytes_case(hidden: int, act_bytes: int, stages: int):
    right = ic.pipeline_link_bytes(hidden, act_bytes, stages)
    hops, state = stages - 1, hidden * act_bytes
    one_short = (f"count the {ic.HEADER_BYTES}-byte header on each hop, and the {ic.TOKEN_BYTES}-byte token that "
                 "goes back to the first stage.")                    # with 2 stages the two slips give one value
    mistakes = [
        (hops * state + ic.TOKEN_BYTES, one_short),
        (hops * (state + ic.HEADER_BYTES), one_short),
        (stages * (state + ic.HEADER_BYTES) + ic.TOKEN_BYTES,
         f"{stages} stages are joined by {hops} hops; the last hop carries the token, not a hidden state."),
        (hops * state, "count the header on each hop and the token back, not only the hidden states."),
        (8 * right, "bits vs bytes: the answer is in bytes."),
        (hops * (hidden + ic.HEADER_BYTES) + ic.TOKEN_BYTES, "a hidden state is hidden_size elements of "
                                                             f"{act_bytes} bytes each, not hidden_size bytes."),
    ]
    return (hidden, act_bytes, stages), f"hidden {hidden}, {act_bytes}-byte activations, {stages} stages", right, \
        [(v, h) for v, h in mistakes if v != right]


def check_link_bytes(answer, hidden: int = 4096, act_bytes: int = 2, stages: int = 2) -> Result:
    """Pipeline task 1: bytes one decoded token puts on the links of a pipeline of `stages` stages: per hop
    between stages a 4-byte header and the hidden state (hidden x act_bytes), and the 4-byte token back.

    `answer` is a whole number for the given pipeline, or a function `f(hidden, act_bytes, stages) -> bytes`
    called on four pipelines. Checked exactly against `interconnect.pipeline_link_bytes`.
    """
    cases = [_bytes_case(hidden, act_bytes, stages), _bytes_case(384, 4, 2), _bytes_case(8192, 2, 4),
             _bytes_case(2048, 4, 3)]
    return judge_exact("Pipeline task 1", answer, cases,
                       "(stages − 1) × (4 + hidden × act_bytes) + 4; one stage puts nothing on a link.", int)


CLUSTER_RTOL = 1e-4   # closed-form arithmetic: tight enough that leaving out the hops (0.3% here) is caught


def _cluster_case(weights_gb: float, machines: int, memory_gbs: float, hidden: int, link_gbs: float,
                  hop_us: float):
    link = ic.Link(payload_gbs=link_gbs, handshake_us=0.0, credit_bytes=1 << 40)
    right = ic.pipeline_tokens_per_s(weights_gb, machines, memory_gbs, hidden, 2, link, hop_us)

    def tps(split_compute=False, token_back=True, hop_s=hop_us * 1e-6, state_bytes=2 * hidden):
        compute = weights_gb / memory_gbs / (machines if split_compute else 1)
        forward = (machines - 1) * (hop_s + (ic.HEADER_BYTES + state_bytes) / (link_gbs * 1e9))
        back = hop_s + ic.TOKEN_BYTES / (link_gbs * 1e9) if token_back else 0.0
        return 1 / (compute + forward + back)
    mistakes = [
        (tps(split_compute=True), "with one sequence the stages run one after another: each token still reads "
                                  "every weight once, at one machine's bandwidth; the machines don't add up."),
        (tps(token_back=False), "count the hop that takes the token back to the first machine: one hop per "
                                "machine in all."),
        (tps(hop_s=0.0), "the hops are small but not free: add each hop's fixed time."),
        (tps(hop_s=hop_us * 1e-3), "µs vs ms: the hop time is given in microseconds."),
        (tps(state_bytes=hidden), "16-bit activations: a hidden state is 2 × hidden bytes."),
        (1 / right, "that is seconds per token; the answer is tokens per second."),
    ]
    label = (f"{weights_gb:g} GB on {machines} machines at {memory_gbs:g} GB/s, hidden {hidden}, "
             f"link {link_gbs:g} GB/s, {hop_us:g} µs per hop")
    return (weights_gb, machines, memory_gbs, hidden, link_gbs, hop_us), label, right, mistakes


def check_cluster_tokens_per_s(answer, weights_gb: float = 39.7, machines: int = 2, memory_gbs: float = 546,
                               hidden: int = 8192, link_gbs: float = 5.6, hop_us: float = 100) -> Result:
    """Pipeline task 2: decode tokens/s of a model split in a pipeline over `machines`: every weight read
    once per token at one machine's bandwidth (the stages run one after another), plus one hop per machine
    (machines − 1 hidden states forward, the token back), each `hop_us` plus its bytes over the link;
    16-bit activations, a 4-byte header per hidden state.

    `answer` is a number for the given cluster, or a function `f(weights_gb, machines, memory_gbs, hidden,
    link_gbs, hop_us) -> tokens/s` called on four clusters. Checked against `interconnect.pipeline_tokens_per_s`
    within 0.01%: the arithmetic is exact, and the hops are a small part of the answer.
    """
    cases = [_cluster_case(weights_gb, machines, memory_gbs, hidden, link_gbs, hop_us),
             _cluster_case(16.1, 3, 1008, 4096, 1.18, 300), _cluster_case(141.1, 4, 819, 8192, 5.6, 50),
             _cluster_case(8.0, 2, 273, 4096, 1.18, 1000)]
    return judge_cases("Pipeline task 2", answer, cases, "tokens/s",
                       "t = weights / bandwidth + (machines − 1) × (hop + (4 + 2 × hidden) / link) "
                       "+ (hop + 4 / link); tokens/s = 1 / t.", CLUSTER_RTOL)
