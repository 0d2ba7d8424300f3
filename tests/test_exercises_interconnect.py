"""Chapter "Thunderbolt 5 and PCIe tunnelling" (book/signalling/thunderbolt-pcie), Interconnect tasks 1 to 3:
`pytest tests/test_exercises_interconnect.py -k interconnect_task`."""

from __future__ import annotations

import pytest

from ref_impl import exercises as ex


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
