"""Chapter "Two machines: a pipeline over the link" (book/signalling/pipeline-cluster), Pipeline tasks 1 and 2:
`pytest tests/test_exercises_pipeline.py -k pipeline_task`."""

from __future__ import annotations

import pytest

from ref_impl import exercises as ex


def bytes_by_hand(hidden, act_bytes, stages):
    # per hop between stages: a 4-byte header and the hidden state; then the 4-byte token back; one stage: no link
    return 0 if stages == 1 else (stages - 1) * (4 + hidden * act_bytes) + 4


def test_pipeline_task_1_accepts_the_right_number_and_function():
    assert ex.check_link_bytes(4 + 4096 * 2 + 4)                  # Llama-3.1-8B, 16-bit, two machines: 8,200 bytes
    assert ex.check_link_bytes(3 * (4 + 8192 * 2) + 4, hidden=8192, stages=4)
    assert ex.check_link_bytes(bytes_by_hand)


@pytest.mark.parametrize("wrong, hint", [
    (lambda d, b, n: (n - 1) * d * b + 4, "header"),
    (lambda d, b, n: (n - 1) * (4 + d * b), "token that goes back"),
    (lambda d, b, n: n * (4 + d * b) + 4, "hops"),
    (lambda d, b, n: 8 * bytes_by_hand(d, b, n), "bits vs bytes"),
    (lambda d, b, n: (n - 1) * (4 + d) + 4, "hidden_size elements"),
    (lambda d, b, n: 1.5 * bytes_by_hand(d, b, n), "(stages − 1)"),
])
def test_pipeline_task_1_rejects_typical_mistakes_with_their_hint(wrong, hint):
    r = ex.check_link_bytes(wrong)
    assert not r and hint in r.message, r.message


def cluster_by_hand(weights_gb, machines, memory_gbs, hidden, link_gbs, hop_us):
    t = weights_gb / memory_gbs                                       # every weight once per token, one at a time
    t += (machines - 1) * (hop_us * 1e-6 + (4 + 2 * hidden) / (link_gbs * 1e9))   # hidden states forward
    t += hop_us * 1e-6 + 4 / (link_gbs * 1e9)                                      # the token back
    return 1 / t


def test_pipeline_task_2_accepts_the_right_number_and_function():
    assert ex.check_cluster_tokens_per_s(cluster_by_hand(39.7, 2, 546, 8192, 5.6, 100))
    assert ex.check_cluster_tokens_per_s(cluster_by_hand)


@pytest.mark.parametrize("wrong, hint", [
    (lambda w, m, bw, d, lk, h: cluster_by_hand(w / m, m, bw, d, lk, h), "one after another"),
    (lambda w, m, bw, d, lk, h: 1 / (w / bw + (m - 1) * (h * 1e-6 + (4 + 2 * d) / (lk * 1e9))), "token back"),
    (lambda w, m, bw, d, lk, h: bw / w, "not free"),
    (lambda w, m, bw, d, lk, h: cluster_by_hand(w, m, bw, d, lk, 1e3 * h), "microseconds"),
    (lambda w, m, bw, d, lk, h: 1 / cluster_by_hand(w, m, bw, d, lk, h), "seconds per token"),
])
def test_pipeline_task_2_rejects_typical_mistakes_with_their_hint(wrong, hint):
    r = ex.check_cluster_tokens_per_s(wrong)
    assert not r and hint in r.message, r.message
