"""The GDDR7 and PAM3 checks (C03, C23, C29) against arithmetic by hand."""

from __future__ import annotations

import math

import pytest

from ref_impl import ledger
from ref_impl.theory import roofline


def test_c03_bandwidth_arithmetic_by_hand():
    v = ledger.check("C03", live=False)
    ev = v.evidence
    assert v.status == "confirmed" and "unit interval" in v.summary
    assert ev["C03's bus: 32 Gbps x 256 pins / 8"].value == 1024          # 32e9 * 256 / 8 bytes/s
    assert ev["symbol rate per pin at 32 Gbps"].value == pytest.approx(21.333, abs=1e-3)   # 32 / 1.5
    assert ev["one device (32 data pins) at 32 Gbps"].value == 128       # 32 * 32 / 8
    assert ev["devices on a 256-bit bus"].value == 8
    assert ev["JESD239's per-device peak (48 Gbps x 32 pins / 8)"].value == 192
    assert ev["RTX 5090: 28 Gbps x 512 pins / 8"].value == 1792 == roofline.HARDWARE["RTX 5090"].bandwidth_gbs
    assert ev["a 256-bit bus at the RTX 5090's 28 Gbps"].value == 896


def test_c23_rates_and_snr_penalty_by_hand():
    v = ledger.check("C23", live=False)
    ev = v.evidence
    assert v.status == "qualified"
    # 32 Gbps PAM3 = 21.33 GBd, Nyquist 10.67 GHz; there NRZ carries 21.33 Gbps, PAM4 42.67
    f = "data rate at a 10.67 GHz Nyquist frequency, "
    assert ev[f + "NRZ"].value == pytest.approx(64 / 3) and ev[f + "PAM3"].value == pytest.approx(32)
    assert ev[f + "PAM4"].value == pytest.approx(128 / 3)
    assert ev["PAM3 / NRZ data rate, same Nyquist frequency"].value == pytest.approx(1.5)
    assert ev["PAM3 / NRZ eye height, same swing"].value == 50
    # NRZ: Q(1/sigma) = 1e-12 at 1/sigma = 7.034, 20 log10 = 16.94 dB; PAM3's eye is half: + 6.02 dB
    # (less a little: its outer levels have one neighbour)
    assert ev["SNR for a bit error rate of 1e-12, NRZ"].value == pytest.approx(20 * math.log10(7.0345), abs=0.01)
    assert 5.9 < ev["PAM3's SNR penalty vs NRZ at 1e-12"].value < 6.1
    assert 9.3 < ev["PAM4's SNR penalty vs NRZ at 1e-12"].value < 9.6
    sim, exact = (ev[f"PAM3 bit error rate at 16 dB, {k}"].value for k in ("simulated (600k bits, seed 0)", "exact"))
    assert abs(sim - exact) < 5 * math.sqrt(3 * exact / 600_000)


def test_c29_channels_and_conflicts():
    v = ledger.check("C29", live=False)
    ev = v.evidence
    assert v.status == "refuted" and "GDDR6's organisation" in v.summary
    assert ev["independent channels per device, GDDR7 (JESD239)"].value == 4
    assert ev["independent channels per device, GDDR6"].value == 2
    assert 4 * ev["channel width, GDDR7 (4 x 8 of a device's 32 data pins)"].value == 32
    k = "bank conflicts, K cache, head-major: 8 heads at once, {} channels, {} map"
    assert ev[k.format(2, "linear")].value > 90 and ev[k.format(4, "linear")].value > 90
    assert ev[k.format(2, "XOR")].value < 5 and ev[k.format(4, "XOR")].value < 5
    assert ev["bank conflicts, weights: 8 rows at once, 4 channels, linear map"].value == 0
