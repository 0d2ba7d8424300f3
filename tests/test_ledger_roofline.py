"""The roofline chapter's checks (C04, C14, C26, C27) against numbers worked by hand."""

from __future__ import annotations

import pytest

from ref_impl import ledger
from ref_impl.theory import roofline


def no_results(monkeypatch, tmp_path) -> None:
    """The ledger as a fresh clone without results/ would compute it: core.results reads an empty folder."""
    monkeypatch.setattr(ledger.core, "RESULTS_DIR", tmp_path)


def test_c14_offline_reads_recorded_results(monkeypatch, tmp_path):
    v = ledger.check("C14", live=False)
    assert v.source.startswith("results/") and any(k.startswith("recorded TTFT") for k in v.evidence)
    no_results(monkeypatch, tmp_path)
    v = ledger.check("C14", live=False)
    assert "no recorded results" in v.summary and not any(k.startswith("recorded") for k in v.evidence)


def test_c04_arithmetic_by_hand():
    ev = ledger.check("C04", live=False).evidence
    # 85 tok/s x 7.8 GB = 663 GB/s; 92 x 7.8 = 717.6
    assert ev["implied read rate at 85 tok/s"].value == pytest.approx(663.0)
    assert ev["implied read rate at 92 tok/s"].value == pytest.approx(717.6)
    # the widest theoretical bus: 663 / 0.85 = 780, 717.6 / 0.80 = 897; x 8 bits / 256 pins = 24.4, 28.0 Gbps
    assert ev["implied theoretical bandwidth, low"].value == pytest.approx(780.0)
    assert ev["implied theoretical bandwidth, high"].value == pytest.approx(897.0)
    assert ev["pin rate that needs on a 256-bit bus, low"].value == pytest.approx(24.375)
    assert ev["pin rate that needs on a 256-bit bus, high"].value == pytest.approx(28.03125)
    # RTX 5090: 1792 x 0.80 / 7.8 = 183.8, x 0.85 = 195.3, all of it 229.7; C03's 1024: 105.0, 111.6
    assert ev["RTX 5090 (1792 GB/s) at 80%"].value == pytest.approx(183.79, abs=0.01)
    assert ev["RTX 5090 (1792 GB/s) at 85%"].value == pytest.approx(195.28, abs=0.01)
    assert ev["RTX 5090 at 100%"].value == pytest.approx(229.74, abs=0.01)
    assert ev["C03's 256-bit bus (1024 GB/s) at 80%"].value == pytest.approx(105.03, abs=0.01)
    assert ev["C03's 256-bit bus (1024 GB/s) at 85%"].value == pytest.approx(111.59, abs=0.01)
    assert ev["stored bits per weight (nominal 12B in 7.8 GB)"].value == pytest.approx(5.2)


def test_c27_gemv_intensity_and_ridge_points_by_hand():
    ev = ledger.check("C27", live=False).evidence
    # 4096 x 4096 GEMV at 16 bits: 2 * 4096^2 FLOPs / (2 * 4096^2 + 2 * 8192 bytes) = 1 / (1 + 1/2048)
    assert roofline.matmul_intensity(1, 4096, 4096, 16) == pytest.approx(2048 / 2049)
    assert 0.99 < ev["GEMV intensity, Llama-3.1-8B, 16-bit"].value < 1.0
    assert ev["ridge point, H200 SXM"].value == pytest.approx(989.5 / 4.8)     # 206 FLOP/byte
    assert ev["GEMV intensity at Q4_K's 4.5 bits/weight"].value == pytest.approx(16 / 4.5, rel=0.01)


def test_c26_prompt_lengths_are_the_first_to_pass_their_threshold():
    llama = ledger.roofline.LLAMA8B
    for threshold in [100] + [roofline.ridge_point(hw) for hw in ledger.roofline.RIDGED]:
        n = ledger.roofline.tokens_to_reach(llama, threshold)
        assert ledger.roofline.model_intensity(llama, n - 1) <= threshold < ledger.roofline.model_intensity(llama, n)


def test_attention_share_by_hand():
    # Llama-3.1-8B, 8192-token prompt: attention 4 * 32 heads * 128 * 32 layers * (8192 * 8193 / 2) FLOPs,
    # matmuls 2 * 7,504,658,432 * 8192
    att = 4 * 32 * 128 * 32 * 8192 * 8193 / 2
    assert ledger.roofline.attention_share(ledger.roofline.LLAMA8B, 8192) == pytest.approx(att / (att + 2 * 7_504_658_432 * 8192))


def test_fit_ttft_recovers_flat_linear_and_quadratic_terms():
    lengths = tuple(2**i for i in range(10))
    seconds = tuple(0.01 + 1e-3 * n + 1e-6 * n * n for n in lengths)
    assert ledger.roofline.fit_ttft(lengths, seconds) == pytest.approx((0.01, 1e-3, 1e-6), rel=1e-6)
