"""The Thunderbolt 5 and PCIe checks (C07, C08, C18, C25) against arithmetic by hand."""

from __future__ import annotations

import pytest

from ref_impl import ledger


def test_c07_pcie_gen4_x4_ceiling_by_hand():
    v = ledger.check("C07", live=False)
    ev = v.evidence
    assert v.status == "qualified" and "5.6" in v.summary
    # 16 GT/s x 4 lanes / 8 = 8 GB/s; x 128/130 = 7.877 GB/s
    assert ev["PCIe Gen4 x4 on the wire: 16 GT/s x 4 / 8"].value == 8.0
    assert ev["after 128b/130b coding"].value == pytest.approx(7.8769, abs=1e-4)
    # 256-byte payload, 20 bytes per TLP (12 header + 4 STP token + 4 LCRC), 0.5 x 8 B of DLLPs, SKP 370/371
    by_hand = 7.876923 * 370 / 371 * 256 / (256 + 20 + 4)
    assert ev["protocol ceiling, 256-byte payloads (TLP, DLLP, SKP)"].value == pytest.approx(by_hand, rel=1e-6)
    assert ev["protocol ceiling, 128-byte payloads (TLP, DLLP, SKP)"].value < ledger.C07_GBS \
        < ev["protocol ceiling, 256-byte payloads (TLP, DLLP, SKP)"].value
    assert ev["measured TB5 host-to-device / the claim's 7.0 GB/s"].value == pytest.approx(80.0)


def test_c18_usb4_headers_fit_in_the_wire_headroom():
    v = ledger.check("C18", live=False)
    ev = v.evidence
    assert v.status == "qualified"
    # a 276-byte TLP needs two USB4 packets (<= 256 B each): 8 header bytes, 8 / 284 = 2.82%
    assert ev["USB4 packets per 256-byte-payload TLP"].value == 2
    assert ev["USB4 header share of tunnelled bytes, TLP with framing and LCRC"].value == pytest.approx(800 / 284)
    assert ev["wire needed to carry the Gen4 x4 payload ceiling"].value < ev["TB5 wire, one direction"].value == 10
    # 1 - 5.6 / 6.6 = 15.2%
    assert ev["measured: TB5 below OCuLink, host-to-device"].value == pytest.approx(100 * (1 - 5.6 / 6.6))


def test_c08_streaming_bound_by_hand():
    v = ledger.check("C08", live=False)
    ev = v.evidence
    assert v.status == "qualified"
    # 1 token/s needs the overflow to cross in 1 s: 5.6 GB at 5.6 GB/s
    assert ev["overflow at which streaming alone allows 1 token/s"].value == pytest.approx(5.6)
    # Llama-3.1-8B at 16 bits: 8,030,261,248 x 2 = 16.06 GB; 8 GB card less 1 GB reserved: 9.06 GB over
    # the link at 5.6 GB/s = 1.618 s; the resident 7 GB at 1008 GB/s = 7 ms, hidden under it
    assert ev["Llama-3.1-8B 16-bit on 8 GB: streamed"].value == pytest.approx(5.6 / (16.060522496 - 7), rel=1e-6)
    assert ev["Llama-3.1-8B 16-bit: resident at the RTX 4090's bandwidth"].value == pytest.approx(1008 / 16.060522496)
    under, over = (ev[f"overflowing configurations {k}"].value for k in ("under 1 token/s", "at 1 token/s or more"))
    assert under > 0 and over > 0
    assert ev["32 per-layer handshakes (10 µs each) per token"].value == pytest.approx(0.32)


def test_c25_simulation_favours_one_transfer_only_for_small_layers():
    v = ledger.check("C25", live=False)
    ev = v.evidence
    assert v.status == "qualified"
    assert ev["retimer jitter / handshake"].value == pytest.approx(2e-12 / 10e-6)
    assert ev["transfer size at which data time = handshake"].value == pytest.approx(56.0)   # 10 µs x 5.6 GB/s
    small = ev["64 × 64 KiB, per-layer: p99"].value / ev["64 × 64 KiB, one transfer: p99"].value
    large = ev["64 × 16 MiB, per-layer: p99"].value / ev["64 × 16 MiB, one transfer: p99"].value
    assert small > 1.5 and 1 < large < 1.01
    # one 4 MiB transfer at 5.6 GB/s is 0.749 ms, plus a ~10 µs handshake
    assert ev["64 × 64 KiB, one transfer: p50"].value == pytest.approx(64 * 65536 / 5.6e6 + 0.010, rel=0.01)
    assert ledger.check("C25", live=False).evidence == ev          # seeded: the same numbers every time
