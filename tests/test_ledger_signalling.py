"""The GDDR7 and PAM3 checks (C03, C23, C29): their evidence against arithmetic by hand, and each rule
on synthetic evidence on both sides of its thresholds (RULE_CASES, read by test_ledger)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from ref_impl import ledger
from ref_impl.ledger.signalling import STRIDED, BusArithmetic, Channels, LineCodes
from ref_impl.theory import roofline

# ---- the rules on synthetic evidence ----------------------------------------------------------------

BUS = BusArithmetic(32.0, 256, 1024.0, 1.5, 32, 48.0, "RTX 5090", 28.0, 512, 1792.0)
CODES = LineCodes(32 / 3, {"NRZ": 1.0, "PAM3": 1.5, "PAM4": 2.0}, {"NRZ": 2, "PAM3": 3, "PAM4": 4},
                  {"NRZ": 16.9, "PAM3": 22.9, "PAM4": 26.4}, 16.0, 600_000, 8.9e-4, 8.7e-4)


def channels(gddr7=(4, 8), lin=(0.998, 0.998), xor=(0.0001, 0.024)) -> Channels:
    """C29's evidence with the strided read's conflict shares (2 channels, 4 channels) under each map."""
    conflicts = {(STRIDED, ch, False): r for ch, r in zip((2, 4), lin)}
    conflicts |= {(STRIDED, ch, True): r for ch, r in zip((2, 4), xor)}
    conflicts |= {("weights: 8 rows at once", ch, x): 0.0 for ch in (2, 4) for x in (False, True)}
    return Channels(gddr7, (2, 16), conflicts)


RULE_CASES = {
    "C03": [(BUS, "confirmed"),
            (dataclasses.replace(BUS, claim_gbs=1000.0), "refuted"),          # the arithmetic gives 1024, not 1000
            (dataclasses.replace(BUS, bits_per_ui=math.log2(3)), "refuted"),  # an ideal code, not 3 bits per 2 UI
            (dataclasses.replace(BUS, pin_gbps=64.0, claim_gbs=2048.0), "refuted")],   # above JESD239's 48 Gbps
    "C23": [(CODES, "qualified"),                                             # 1.5x, at 6 dB more SNR
            (dataclasses.replace(CODES, snr_db={"NRZ": 16.9, "PAM3": 16.9, "PAM4": 26.4}), "confirmed"),   # free
            (dataclasses.replace(CODES, snr_db={"NRZ": 16.9, "PAM3": 16.95, "PAM4": 26.4}), "qualified"),
            (dataclasses.replace(CODES, bits_per_ui={"NRZ": 1.0, "PAM3": math.log2(3), "PAM4": 2.0}), "refuted"),
            (dataclasses.replace(CODES, bits_per_ui={"NRZ": 1.0, "PAM3": 1.0, "PAM4": 2.0},
                                 snr_db={"NRZ": 16.9, "PAM3": 16.9, "PAM4": 26.4}), "refuted")],
    "C29": [(channels(), "refuted"),                                          # 8-bit channels, and only the map helps
            (channels(gddr7=(4, 16)), "qualified"),                           # the claim's layout; only the map helps
            (channels(gddr7=(4, 16), lin=(0.998, 0.499)), "confirmed"),       # 4 channels halve the conflicts
            (channels(gddr7=(4, 16), lin=(0.998, 0.5)), "qualified"),         # just short of half
            (channels(gddr7=(4, 16), lin=(0.998, 0.9), xor=(0.9, 0.9)), "refuted"),   # nothing removes them
            (channels(gddr7=(2, 16), lin=(0.998, 0.1)), "refuted")],          # no split: GDDR6's layout
}


def test_the_rules_read_no_results(monkeypatch, tmp_path):
    monkeypatch.setattr(ledger.core, "RESULTS_DIR", tmp_path)
    assert {c: ledger.check(c, live=False).status for c in ("C03", "C23", "C29")} == \
        {"C03": "confirmed", "C23": "qualified", "C29": "refuted"}
    assert all(ledger.CLAIMS[c].pending is None for c in ("C03", "C23", "C29"))


def test_summaries_follow_the_numbers():
    v = ledger.CLAIMS["C23"].judge(dataclasses.replace(CODES, snr_db={"NRZ": 16.9, "PAM3": 20.9, "PAM4": 26.4}))
    assert "4.0 dB more SNR than NRZ" in v.summary and "4.0 dB more SNR" in v.condition
    v = ledger.CLAIMS["C29"].judge(channels(gddr7=(4, 16), lin=(0.998, 0.3)))
    assert "4 channels at least halve" in v.summary and "of 16 bits, as claimed" in v.summary
    v = ledger.CLAIMS["C03"].judge(dataclasses.replace(BUS, claim_gbs=1000.0))
    assert v.summary.startswith("The arithmetic does not hold") and "1,024 GB/s, not 1,000" in v.summary


# ---- the evidence, by hand ------------------------------------------------------------------------

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
    assert ev["RTX 5090: datasheet bandwidth"].value == 1792               # the formula reproduces the datasheet
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
    assert ev["PAM3 states in 2 unit intervals (3 levels each)"].value == 9
    assert ev["bits those states carry whole (floor of log2)"].value == 3
    # NRZ: Q(1/sigma) = 1e-12 at 1/sigma = 7.034, 20 log10 = 16.94 dB; PAM3's eye is half: + 6.02 dB
    # (less a little: its outer levels have one neighbour)
    assert ev["SNR for a bit error rate of 1e-12, NRZ"].value == pytest.approx(20 * math.log10(7.0345), abs=0.01)
    assert 5.9 < ev["PAM3's SNR penalty vs NRZ at 1e-12"].value < 6.1
    assert 9.3 < ev["PAM4's SNR penalty vs NRZ at 1e-12"].value < 9.6
    sim, exact = (ev[f"PAM3 bit error rate at 16 dB, {k}"].value for k in ("simulated (600,000 bits, seed 0)", "exact"))
    assert abs(sim - exact) < 5 * math.sqrt(3 * exact / 600_000)
    penalty = ev["PAM3's SNR penalty vs NRZ at 1e-12"].value
    assert f"{penalty:.1f} dB more SNR" in v.condition and f"{penalty:.1f} dB more SNR than NRZ" in v.summary


def test_c29_channels_and_conflicts():
    v = ledger.check("C29", live=False)
    ev = v.evidence
    assert v.status == "refuted" and "of 8 bits, where the claim has 16" in v.summary
    assert ev["independent channels per device, GDDR7 (JESD239)"].value == 4
    assert ev["independent channels per device, GDDR6"].value == 2
    assert 4 * ev["channel width, GDDR7"].value == 32
    k = "bank conflicts, K cache, head-major: 8 heads at once, {} channels, {} map"
    assert ev[k.format(2, "linear")].value > 90 and ev[k.format(4, "linear")].value > 90
    assert ev[k.format(2, "XOR")].value < 5 and ev[k.format(4, "XOR")].value < 5
    assert ev["bank conflicts, weights: 8 rows at once, 4 channels, linear map"].value == 0
    assert "the address map, not the channel count, removes" in v.summary
