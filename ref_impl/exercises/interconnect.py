"""Exercises of chapter "Thunderbolt 5 and PCIe tunnelling" (book/signalling/thunderbolt-pcie):
Interconnect tasks 1 to 3.

A TLP's payload efficiency, a PCIe link's payload GB/s, and decode tokens/s when weights overflow
VRAM and stream over the link; checked against `theory.interconnect`.
Tests: `pytest tests/test_exercises_interconnect.py -k interconnect_task`.

See chapter: interconnect
"""

from __future__ import annotations

from ref_impl.exercises.core import Result, judge_cases
from ref_impl.theory import interconnect as ic

TLP_RTOL = 1e-3   # an ECRC's 4 bytes move a 512-byte TLP's efficiency by 0.7%: judge to 0.1%


def _tlp_case(payload: int, header_dw: int, ecrc: bool):
    right = ic.tlp_efficiency(payload, 4, header_dw, ecrc)
    h, e = 4 * header_dw, 4 * ecrc
    mistakes = [
        (payload / (payload + h), "only the header: each TLP also carries a 4-byte STP token (framing and "
                                  "sequence number) and a 4-byte LCRC."),
        (payload / (payload + h + 4 + e), "one 4-byte field is missing: the STP token (framing and sequence "
                                          "number) or the LCRC; a TLP carries both."),
        (payload / (payload + header_dw + 8 + e), "header_dw counts double words: 4 bytes each."),
        (100 * right, "give a fraction between 0 and 1, not a percentage."),
        (1 - right, "that is the overheads' share; the efficiency is payload / (payload + overheads)."),
        (right * 128 / 130, "line coding (128b/130b) is a separate factor: this asks for the TLP's own efficiency."),
    ]
    if ecrc:
        mistakes.append((payload / (payload + h + 8), "ECRC is on here: 4 more bytes per TLP."))
    label = f"{payload}-byte payload, {header_dw}-DW header{', ECRC' if ecrc else ''}"
    return (payload, header_dw, ecrc), label, right, mistakes


def check_tlp_efficiency(answer, payload: int = 256, header_dw: int = 3, ecrc: bool = False) -> Result:
    """Interconnect task 1: the share of a Gen3+ TLP's bytes that is payload, payload / (payload +
    header + optional ECRC + STP token + LCRC).

    `answer` is a number for the given TLP, or a function `f(payload, header_dw, ecrc) -> fraction`
    called on four TLPs. Checked against `interconnect.tlp_efficiency` within 0.1%.
    """
    cases = [_tlp_case(payload, header_dw, ecrc), _tlp_case(128, 3, False), _tlp_case(512, 4, True),
             _tlp_case(64, 4, False)]
    return judge_cases("Interconnect task 1", answer, cases, "fraction",
                       "payload / (payload + 4 × header_dw + 4 if ECRC + 4 (STP token) + 4 (LCRC)).", TLP_RTOL)


def _link_case(gen: int, lanes: int, payload: int):
    eff, code = ic.tlp_efficiency(payload, gen), ic.coding_efficiency(gen)
    right = ic.coded_gbs(gen, lanes) * eff
    raw = ic.raw_gbs(gen, lanes)
    other = 128 / 130 if gen <= 2 else 8 / 10
    mistakes = [
        (8 * right, "bits vs bytes: that is Gb/s; a byte is 8 bits, so divide by 8."),
        (raw * eff, f"you left out the line coding: Gen{gen} sends {'8b/10b' if gen <= 2 else '128b/130b'}."),
        (raw * eff * other, f"wrong line code: Gen1/2 use 8b/10b, Gen3 and later 128b/130b (this is Gen{gen})."),
        (raw * code, "you left out the TLP overheads: 20 bytes per TLP with a 3-DW header."),
        (raw, "that is the raw wire rate: take off the line coding and the TLP overheads."),
        (right / lanes, f"that is one lane: multiply by the {lanes} lanes."),
        (2 * right, "one direction only: each direction has its own lanes, so don't add the two."),
    ]
    return (gen, lanes, payload), f"Gen{gen} x{lanes}, {payload}-byte payloads", right, mistakes


def check_link_payload_gbs(answer, gen: int = 4, lanes: int = 4, payload: int = 256) -> Result:
    """Interconnect task 2: payload GB/s of one direction of a PCIe link, TLPs of `payload` bytes
    with 3-DW headers, no ECRC; DLLPs and SKP ordered sets left out.

    `answer` is a number for the given link, or a function `f(gen, lanes, payload) -> GB/s` called on
    four links (Gen2 to Gen5). Checked against `interconnect.coded_gbs × tlp_efficiency`.
    """
    cases = [_link_case(gen, lanes, payload), _link_case(3, 4, 128), _link_case(5, 16, 256), _link_case(2, 8, 128)]
    return judge_cases("Interconnect task 2", answer, cases, "GB/s",
                       "GB/s = GT/s × lanes / 8 × coding (8/10 or 128/130) × payload / (payload + 20).")


STREAM_RESERVE_GB = 1.0   # VRAM kept for KV cache and activations in task 3


def _stream_case(weights: float, vram: float, vram_gbs: float, link_gbs: float, overlap: bool):
    def tps(link=link_gbs, ov=overlap, reserve=STREAM_RESERVE_GB):   # the engine's rule, with one slip
        return ic.streaming_tokens_per_s(weights, vram, vram_gbs, link, ov, reserve)
    right = tps()
    mistakes = [
        (tps(ov=not overlap), "with overlap the VRAM reads and the link transfer run at once: take the max; "
                              "without it they run one after the other: add them." if overlap else
                              "without overlap the VRAM reads and the link transfer run one after the other: "
                              "add them; max is only for overlapped transfers."),
        (tps(link=8 * link_gbs), "Gb/s vs GB/s: the link rate is already in GB/s (bytes); multiplying by 8 makes "
                                 "it bits."),
        (tps(link=link_gbs / 8), "Gb/s vs GB/s: the link rate is given in GB/s; don't divide it by 8 again."),
        (link_gbs / weights, "only the overflow crosses the link; the resident part is read from VRAM."),
        (tps(reserve=0.0), f"keep {STREAM_RESERVE_GB:g} GB of VRAM for the KV cache and activations: it holds "
                           "no weights."),
        (1 / right, "that is seconds per token; the answer is tokens per second."),
        (right / 8, "bits vs bytes: the sizes are in GB (bytes) and so are the rates."),
    ]
    label = (f"{weights:g} GB of weights, {vram:g} GB VRAM at {vram_gbs:g} GB/s, link {link_gbs:g} GB/s, "
             f"{'overlapped' if overlap else 'not overlapped'}")
    return (weights, vram, vram_gbs, link_gbs, overlap), label, right, mistakes


def check_streaming_tokens_per_s(answer, weights_gb: float = 16.06, vram_gb: float = 8, vram_gbs: float = 1008,
                                 link_gbs: float = 5.6, overlap: bool = True) -> Result:
    """Interconnect task 3: decode tokens/s when the weights overflow VRAM (less 1 GB kept for the KV
    cache) and the overflow crosses the link every token; overlapped (max of the two times) or not (sum).

    `answer` is a number for the given case, or a function `f(weights_gb, vram_gb, vram_gbs, link_gbs,
    overlap) -> tokens/s` called on four cases. Checked against `interconnect.streaming_tokens_per_s`.
    """
    cases = [_stream_case(weights_gb, vram_gb, vram_gbs, link_gbs, overlap), _stream_case(9, 8, 100, 5.6, False),
             _stream_case(8.5, 8, 300, 25, True), _stream_case(20, 12, 456, 7.2, False)]
    return judge_cases("Interconnect task 3", answer, cases, "tokens/s",
                       "resident = VRAM − 1 GB; t = max (overlap) or sum of resident / VRAM GB/s and "
                       "(weights − resident) / link GB/s; tokens/s = 1 / t.")
