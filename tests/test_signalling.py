"""signalling: the PAM3 code round-trips any bit string and rejects the unused pair; simulated error
rates agree with the exact Gaussian ones; the rate arithmetic and the bank-conflict count against
numbers worked by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ref_impl.theory import roofline
from ref_impl.theory import signalling as sg

bit_lists = st.lists(st.integers(0, 1), max_size=200)


# ---- the PAM3 code ------------------------------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(bit_lists)
def test_pam3_round_trip_on_any_bit_string(bits):
    symbols = sg.encode_pam3(bits)
    assert symbols.size == 2 * math.ceil(len(bits) / 3)          # zero-padded to whole triples
    assert set(symbols.tolist()) <= {-1, 0, 1}
    pairs = set(zip(symbols[0::2].tolist(), symbols[1::2].tolist()))
    assert sg.PAM3_UNUSED not in pairs
    assert sg.decode_pam3(symbols, len(bits)).tolist() == bits
    # the generic level-index path agrees (padding kept)
    padded = bits + [0] * (-len(bits) % 3)
    assert sg.to_bits(sg.PAM3, sg.to_symbols(sg.PAM3, bits)).tolist() == padded


@settings(max_examples=100, deadline=None)
@given(bit_lists)
def test_nrz_and_pam4_round_trip(bits):
    for code in (sg.NRZ, sg.PAM4):
        idx = sg.to_symbols(code, bits)
        assert idx.min(initial=0) >= 0 and idx.max(initial=0) < len(code.levels)
        out = sg.to_bits(code, idx).tolist()
        assert out[:len(bits)] == bits and not any(out[len(bits):])


def test_pam3_table_by_hand():
    # 3 bits, first bit most significant: 000 -> (+1, 0), 100 -> (0, 0), 111 -> (-1, -1)
    assert sg.encode_pam3([0, 0, 0, 1, 0, 0, 1, 1, 1]).tolist() == [1, 0, 0, 0, -1, -1]
    # 5 bits 1,0,1,1,1 -> 101 and 11(0) padded: (0, -1), (-1, 0)
    assert sg.encode_pam3([1, 0, 1, 1, 1]).tolist() == [0, -1, -1, 0]
    assert sg.decode_pam3([0, -1, -1, 0], 5).tolist() == [1, 0, 1, 1, 1]
    assert sg.decode_pam3([], 0).tolist() == []
    # 8 of 9 pairs used, each once; neighbours differ in one bit on 9 of the 10 edges of the grid
    assert len(set(sg.PAM3_CODE)) == 8 and sg.PAM3_UNUSED not in sg.PAM3_CODE
    value = {p: v for v, p in enumerate(sg.PAM3_CODE)}
    edges = [(value[p], value[q]) for p in value for q in ((p[0] + 1, p[1]), (p[0], p[1] + 1)) if q in value]
    assert len(edges) == 10 and sum(bin(a ^ b).count("1") == 1 for a, b in edges) == 9
    # the fallback (0,0) is one bit from both neighbours of the unused pair, (+1,0) and (0,-1)
    for q in ((1, 0), (0, -1)):
        assert bin(sg.PAM3_FALLBACK ^ value[q]).count("1") == 1


def test_invalid_pairs_are_rejected_with_position_and_pair():
    with pytest.raises(ValueError, match=r"invalid PAM3 pair \(1, -1\) at pair 2 \(symbols 4 and 5\)"):
        sg.decode_pam3([0, 0, 1, 1, 1, -1, 0, 0])
    with pytest.raises(ValueError, match="come in pairs"):
        sg.decode_pam3([0, 0, 1])
    with pytest.raises(ValueError, match="symbol 1 is not"):
        sg.decode_pam3([0, 2])
    with pytest.raises(ValueError, match="does not fit"):
        sg.decode_pam3([0, 0], 7)
    with pytest.raises(ValueError, match="0 or 1"):
        sg.encode_pam3([0, 1, 2])


# ---- error rates ---------------------------------------------------------------------------------

def test_analytic_rates_match_the_textbook_formulas():
    for snr in (8.0, 14.0, 20.0):
        s = sg.sigma(snr)
        q = lambda x: 0.5 * math.erfc(x / math.sqrt(2))  # noqa: E731
        ser, ber = sg.analytic_error_rates(sg.NRZ, snr)
        assert ser == pytest.approx(q(1 / s), rel=1e-9) and ber == pytest.approx(ser, rel=1e-9)
        # PAM4, equiprobable levels 1/3 apart from centre to threshold: SER = 2 (M-1)/M Q(d/sigma)
        ser, ber = sg.analytic_error_rates(sg.PAM4, snr)
        assert ser == pytest.approx(1.5 * q(1 / 3 / s), rel=1e-6)
        assert ber == pytest.approx(ser / 2, rel=0.02)                   # Gray: ~one bit per symbol error
        # PAM3 under the code: 0 is 6 of the 16 symbols of the 8 pairs; the middle level errs on
        # both sides (2 Q), an outer one on one side (Q), with Q = Q(0.5 / sigma)
        share_mid = np.mean(np.asarray(sg.PAM3_CODE).ravel() == 0)
        assert share_mid == 6 / 16
        ser, _ = sg.analytic_error_rates(sg.PAM3, snr)
        d = q(0.5 / s)
        assert ser == pytest.approx(share_mid * 2 * d + (1 - share_mid) * d, rel=1e-6)


@pytest.mark.parametrize("code,snr", [(sg.NRZ, 8.0), (sg.NRZ, 11.0), (sg.PAM3, 12.0), (sg.PAM3, 16.0),
                                      (sg.PAM4, 16.0), (sg.PAM4, 20.0)])
def test_simulated_error_rates_agree_with_analytic_within_statistics(code, snr):
    n_bits = 240_000
    ser, ber = sg.simulate_error_rates(code, snr, n_bits, seed=7)
    a_ser, a_ber = sg.analytic_error_rates(code, snr)
    n_sym = n_bits / code.bits_per_ui
    for got, p, n in ((ser, a_ser, n_sym), (ber, a_ber, n_bits)):
        # 5 binomial standard deviations (bit errors cluster in symbols, so bits are not independent)
        assert abs(got - p) * n <= 5 * math.sqrt(n * p * 3) + 3, (got, p)


def test_more_levels_need_more_snr_on_the_same_swing():
    nrz, pam3, pam4 = (sg.snr_for_ber(c, 1e-12) for c in (sg.NRZ, sg.PAM3, sg.PAM4))
    # eye 2x and 3x smaller: 20 log10(2) = 6.02 dB and 20 log10(3) = 9.54 dB, less a little for the
    # levels' different counts of neighbours
    assert 5.8 < pam3 - nrz < 6.3 and 9.2 < pam4 - nrz < 9.7
    assert sg.PAM3.eye_height == 1.0 and sg.NRZ.eye_height == 2.0 and sg.PAM4.eye_height == pytest.approx(2 / 3)


def test_eye_openings_shrink_with_levels_and_noise():
    open_ = {c.name: sg.eye_diagram(c, n_symbols=1500, snr_db=None).openings for c in sg.CODES.values()}
    assert len(open_["PAM3"]) == 2 and len(open_["PAM4"]) == 3
    assert 0.4 < open_["PAM3"].min() / open_["NRZ"][0] < 0.55
    assert 0.25 < open_["PAM4"].min() / open_["NRZ"][0] < 0.36
    noisy = sg.eye_diagram(sg.PAM3, n_symbols=1500, snr_db=20)
    assert noisy.openings.min() < open_["PAM3"].min()
    assert noisy.counts.shape == (80, 64) and noisy.counts.sum() == noisy.symbols * 64
    a, b = sg.eye_diagram(sg.PAM4, 500, jitter_ui=0.05, seed=3), sg.eye_diagram(sg.PAM4, 500, jitter_ui=0.05, seed=3)
    assert np.array_equal(a.counts, b.counts)                            # seeded


def test_lowpass_has_unit_dc_gain_and_its_cutoff():
    step = sg.lowpass(np.ones(4000), cutoff=0.5, samples_per_ui=32)
    assert step[-1] == pytest.approx(1, abs=1e-5)
    # RC time constant tau = 1 / (2 pi f_c): the step reaches 1 - 1/e after tau = 1/pi UI = 10.2 samples
    assert 9 <= int(np.argmax(step >= 1 - math.exp(-1))) <= 11


# ---- rates ------------------------------------------------------------------------------------------

def test_nyquist_arithmetic_by_hand():
    # 10 GHz Nyquist = 20 GBd: NRZ 20 Gbps, PAM3 (3 bits / 2 UI) 30, PAM4 40
    assert [sg.data_rate_gbps(c, 10) for c in (sg.NRZ, sg.PAM3, sg.PAM4)] == [20, 30, 40]
    # 32 Gbps: PAM3 needs 32 / 1.5 = 21.33 GBd, Nyquist 10.67 GHz; NRZ 16 GHz
    assert sg.nyquist_ghz(sg.PAM3, 32) == pytest.approx(32 / 3)
    assert sg.nyquist_ghz(sg.NRZ, 32) == 16
    assert sg.PAM3.ideal_bits_per_ui == pytest.approx(1.58496, abs=1e-5)


def test_bandwidth_arithmetic_by_hand():
    assert sg.bandwidth_gbs(32, 256) == 1024                 # C03: 32 Gbps x 256 pins / 8
    assert sg.bandwidth_gbs(32, sg.GDDR7_DEVICE_PINS) == 128  # one x32 device
    assert sg.bandwidth_gbs(48, 32) == sg.GDDR7["device_gbs"] == 192   # JEDEC's per-device figure
    assert sg.bandwidth_gbs(sg.RTX5090_PIN_GBPS, sg.RTX5090_BUS_BITS) == 1792 \
        == roofline.HARDWARE["RTX 5090"].bandwidth_gbs
    assert sg.GDDR7["channels"] * sg.GDDR7["channel_bits"] == sg.GDDR7_DEVICE_PINS
    assert sg.GDDR6["channels"] * sg.GDDR6["channel_bits"] == 32


# ---- banks -------------------------------------------------------------------------------------------

def test_address_map_by_hand():
    m = sg.AddressMap(channels=2, banks=2, row_bytes=64)
    # 64-byte rows: chunk = addr // 64; channel = chunk % 2, bank = chunk // 2 % 2, row = chunk // 4
    ch, bank, row = m([0, 64, 128, 192, 256, 320])
    assert ch.tolist() == [0, 1, 0, 1, 0, 1] and bank.tolist() == [0, 0, 1, 1, 0, 0] and row.tolist() == [0, 0, 0, 0, 1, 1]
    # xor: slot (channel + 2 bank) ^= the row folded in 2-bit pieces. 256: chunk 4, slot 0, row 1 ->
    # slot 1 = channel 1. 1088: chunk 17, slot 1, row 4 = pieces 0 and 1 -> slot 1 ^ 0 ^ 1 = 0
    ch, bank, row = sg.AddressMap(2, 2, 64, xor=True)([0, 256, 1024 + 64])
    assert ch.tolist() == [0, 1, 0] and bank.tolist() == [0, 0, 0] and row.tolist() == [0, 1, 4]


def test_bank_conflicts_on_a_tiny_stream():
    m = sg.AddressMap(channels=2, banks=2, row_bytes=64)
    # 0 and 256 are channel 0, bank 0, rows 0 and 1: each alternation reopens the bank
    assert sg.bank_conflicts([0, 256, 0, 256], m, window=1) == 3
    assert sg.bank_conflicts([0, 32, 256, 288], m, window=1) == 1       # only the switch to row 1
    # the window counts each channel's own requests: 64 went to channel 1, so on channel 0 256
    # follows 0 directly
    assert sg.bank_conflicts([0, 64, 256], m, window=1) == 1
    assert sg.bank_conflicts([0, 128, 256], m, window=1) == 0            # bank 1 between them
    assert sg.bank_conflicts([0, 128, 256], m, window=2) == 1            # ... but within a window of 2
    assert sg.bank_conflicts([0, 256, 0, 256], sg.AddressMap(2, 2, 64, xor=True), window=1) == 0


def test_concurrent_reads_interleave_streams():
    a = sg.concurrent_reads([0, 1000], 64, granule=32)
    assert a.tolist() == [0, 1000, 32, 1032]


def test_strided_heads_conflict_on_a_linear_map_whatever_the_channels():
    ctx, head_bytes = 1024, 256
    a = sg.concurrent_reads(np.arange(8) * ctx * head_bytes, ctx * head_bytes)
    for channels in (2, 4):
        assert sg.bank_conflicts(a, sg.AddressMap(channels)) > 0.9 * a.size
        assert sg.bank_conflicts(a, sg.AddressMap(channels, xor=True)) < 0.05 * a.size
