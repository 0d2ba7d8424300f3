"""The claim registry: every seed claim once and verbatim, the implemented checks against numbers worked
by hand, evidence with units, and `live=False` that times nothing."""

from __future__ import annotations

import math
import re
import time
from pathlib import Path

import numpy as np
import pytest

from ref_impl import ledger
from ref_impl.theory import roofline

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"          # CI keeps a copy of shared/ beside the clone
IMPLEMENTED = ("C03", "C04", "C07", "C08", "C10", "C11", "C14", "C18", "C19", "C23", "C25", "C26", "C27", "C29",
               "C32",
               "C01", "C21", "C31",
               "C02", "C09", "C15", "C28",
               "C16",
               "C12", "C30", "C05", "C17", "C20", "C06", "C13", "C22", "C24")
IDS = [f"C{i:02d}" for i in range(1, 33)]


@pytest.fixture(scope="module")
def live_ledger():
    return dict((c.id, v) for c, v in ledger.ledger(live=True))


def test_every_id_c01_to_c32_is_registered_once_in_order():
    assert [row[0] for row in ledger._TABLE] == IDS
    assert list(ledger.CLAIMS) == IDS
    assert all(ledger.CLAIMS[i].id == i for i in IDS)


def test_claims_name_a_valid_chapter_and_seed_file_and_every_chapter_has_claims():
    for c in ledger.CLAIMS.values():
        assert c.chapter in ledger.CHAPTERS, c.id
        assert c.seed == ledger.SEEDS[0 if int(c.id[1:]) <= 16 else 1], c.id
        assert c.short and c.quote.endswith("."), c.id
    assert {c.chapter for c in ledger.CLAIMS.values()} == set(ledger.CHAPTERS)
    assert len({c.quote for c in ledger.CLAIMS.values()}) == 32


def test_quotes_are_verbatim_sentences_of_their_seed_file():
    seeds = SHARED / "seeds"
    if not seeds.is_dir():
        pytest.skip(f"the seed notes are not beside the checkout ({seeds}); quotes are checked where they are")
    texts = {name: (seeds / name).read_text() for name in ledger.SEEDS}
    for c in ledger.CLAIMS.values():
        assert f"- {c.quote} (high confidence)" in texts[c.seed], c.id
    assert sum(t.count("(high confidence)") for t in texts.values()) == len(ledger.CLAIMS)


def test_chapters_match_the_claims_table():
    table = SHARED / "CLAIMS.md"
    if not table.is_file():
        pytest.skip(f"{table} is not beside the checkout")
    rows = dict(re.findall(r"^\| (C\d\d) \| ([\w-]+) \|", table.read_text(), re.M))
    assert rows == {c.id: c.chapter for c in ledger.CLAIMS.values()}


def test_pending_claims_say_pending_and_name_their_chapter():
    for cid, c in ledger.CLAIMS.items():
        if cid in IMPLEMENTED:
            continue
        v = ledger.check(cid, live=False)
        assert v.status == "pending" and c.chapter in v.summary and not v.evidence, cid
    with pytest.raises(KeyError, match="C99"):
        ledger.check("C99")


def test_live_false_times_nothing(monkeypatch):
    def no_clock(*_):
        raise AssertionError("live=False must not time anything")
    for name in ("perf_counter", "perf_counter_ns", "time", "monotonic"):
        monkeypatch.setattr(time, name, no_clock)
    monkeypatch.setattr(ledger, "measure_matmul", no_clock)
    monkeypatch.setattr(ledger, "measure_forward", no_clock)
    monkeypatch.setattr(ledger, "measure_alignment", no_clock)
    rows = ledger.ledger(live=False)
    assert len(rows) == 32
    verdicts = {c.id: v for c, v in rows}
    assert all(not k.startswith("live") for cid in IMPLEMENTED for k in verdicts[cid].evidence)
    assert "live=False" in verdicts["C27"].summary and "live=False" in verdicts["C26"].summary
    assert all("live=False" in verdicts[c].summary for c in ("C10", "C32"))


def _check_evidence(v: ledger.Verdict) -> None:
    assert v.status in ledger.STATUSES and v.status != "pending"
    assert v.summary.endswith(".") and v.condition and v.source
    assert v.evidence
    for name, n in v.evidence.items():
        assert isinstance(n, ledger.Number) and n.unit.strip(), name
        assert math.isfinite(n.value), name


@pytest.mark.parametrize("cid", IMPLEMENTED)
def test_implemented_checks_give_a_verdict_with_evidence_in_units(cid, live_ledger):
    _check_evidence(ledger.check(cid, live=False))
    _check_evidence(live_ledger[cid])


def test_live_verdicts_carry_live_measurements_and_say_so(live_ledger):
    for cid in ("C10", "C14", "C26", "C27", "C32"):
        v = live_ledger[cid]
        assert any(k.startswith("live") for k in v.evidence) and v.source.startswith("live"), cid
    assert live_ledger["C27"].status == "confirmed"
    assert live_ledger["C04"].status == ledger.check("C04", live=False).status == "qualified"


def test_the_ledger_does_not_time_twice(live_ledger, monkeypatch):
    monkeypatch.setattr(time, "perf_counter", lambda: (_ for _ in ()).throw(AssertionError("timed again")))
    assert {c.id: v.status for c, v in ledger.ledger(live=True)} == {k: v.status for k, v in live_ledger.items()}


def no_results(monkeypatch, tmp_path) -> None:
    """The ledger as a fresh clone without results/ would compute it."""
    monkeypatch.setattr(ledger, "RESULTS_DIR", tmp_path)


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
    llama = ledger.LLAMA8B
    for threshold in [100] + [roofline.ridge_point(hw) for hw in ledger.RIDGED]:
        n = ledger.tokens_to_reach(llama, threshold)
        assert ledger.model_intensity(llama, n - 1) <= threshold < ledger.model_intensity(llama, n)


def test_attention_share_by_hand():
    # Llama-3.1-8B, 8192-token prompt: attention 4 * 32 heads * 128 * 32 layers * (8192 * 8193 / 2) FLOPs,
    # matmuls 2 * 7,504,658,432 * 8192
    att = 4 * 32 * 128 * 32 * 8192 * 8193 / 2
    assert ledger.attention_share(ledger.LLAMA8B, 8192) == pytest.approx(att / (att + 2 * 7_504_658_432 * 8192))


def test_fit_ttft_recovers_flat_linear_and_quadratic_terms():
    lengths = tuple(2**i for i in range(10))
    seconds = tuple(0.01 + 1e-3 * n + 1e-6 * n * n for n in lengths)
    assert ledger.fit_ttft(lengths, seconds) == pytest.approx((0.01, 1e-3, 1e-6), rel=1e-6)


def test_every_claim_links_to_the_page_that_checks_it():
    book = ROOT / "book"
    for c in ledger.CLAIMS.values():
        page = book / f"{ledger.page_of(c)}.ipynb"
        assert page.is_file() and re.search(rf"\b{c.id}\b", page.read_text()), f"{c.id}: {page} does not check it"
    row = ledger.ledger_html([(ledger.CLAIMS["C16"], ledger.Verdict("qualified", "The first sentence here gives the whole reason. Second one."))])
    assert "href='../dispatch/ttft-jitter.html'" in row and "href='../appendix/ledger.html#claim-C16'" in row
    assert ": The first sentence here gives the whole reason.<details>" in row and "Second one." in row   # the reason in the row, the rest a click away


def test_first_sentence_is_the_reason_without_its_asides():
    assert ledger.first_sentence("Held at 1.5x on the H200 and the CPU alike. The CPU differs.") == \
        "Held at 1.5x on the H200 and the CPU alike."
    assert ledger.first_sentence("It batches the kernels it has (its source: 64+ nodes (a few)) into buffers. More.") \
        == "It batches the kernels it has into buffers."
    assert ledger.first_sentence("The worst pauses do come from growing the cache: on h200, 6 of 1,900") == \
        "The worst pauses do come from growing the cache."
    # a clause too short to give a reason takes the next one with it
    assert ledger.first_sentence("Half of it holds: the draft is exact; the speedup is not. Rest.") == \
        "Half of it holds: the draft is exact."
    assert ledger.first_sentence("No sentence end") == "No sentence end."


def test_number_formatting_keeps_three_figures_and_the_unit():
    assert str(ledger.Number(663.0, "GB/s")) == "663 GB/s"
    assert str(ledger.Number(1169.4, "FLOP/byte")) == "1,169 FLOP/byte"
    assert str(ledger.Number(24.375, "Gbps")) == "24.4 Gbps"
    assert str(ledger.Number(0.99951, "FLOP/byte")) == "1.00 FLOP/byte"


def test_ledger_html_escapes_text_and_has_one_row_per_claim():
    rows = ledger.ledger(live=False)
    page = ledger.ledger_html(rows)
    assert page.count("<tr id='claim-") == 32 and "C32" in page
    evil = ledger.Claim("C99", "roofline", "a <b>", "x < y & z.", ledger.SEEDS[0])
    page = ledger.ledger_html([(evil, ledger.Verdict("refuted", "<script>alert(1)</script>."))])
    assert "<script>" not in page and "&lt;script&gt;" in page and "x &lt; y &amp; z." in page
    assert ledger.status_counts(rows)["pending"] == 32 - len(IMPLEMENTED)


def test_c10_c32_facts_by_hand():
    ev = ledger.check("C10", live=False).evidence
    assert ev["GGUF default alignment (general.alignment absent)"].value == 32
    assert ev["shipped model: tensor data offsets that are multiples of 32"].value == 100
    # block k starts at k * 18 bytes: a multiple of 32 when 16 divides k (gcd(18, 32) = 2, so 2/32)
    assert ev["Q4_0 blocks (18 bytes) that start 32-byte aligned"].value == pytest.approx(6.25)
    assert ev["Q4_K blocks (144 bytes) that start 32-byte aligned"].value == pytest.approx(50)
    assert ledger.check("C10", live=False).status == "qualified"
    v = ledger.check("C32", live=False)
    assert v.status == "qualified" and "GPU threads were not measured" in v.summary


def test_c10_c32_live_verdicts_follow_the_measured_penalty(live_ledger, monkeypatch):
    for cid in ("C10", "C32"):
        v = live_ledger[cid]
        assert any(k.startswith("live GEMV") or k.startswith("live gemv") for k in v.evidence), cid
    assert live_ledger["C10"].status == "qualified"
    assert live_ledger["C32"].status in ("qualified", "refuted")
    # the rule: C32 is refuted when the in-cache split-load penalty is within the noise
    from ref_impl.measure.loads import Throughput

    def rows(slow):
        return tuple(Throughput("numpy", op, size, off, off % 64, t, size / t / 1e9, True)
                     for op in ("sum", "gemv") for size in (256 * 2**10, 64 * 2**20)
                     for off, t in ((0, 1.0), (4, slow), (16, slow), (32, 1.0)))
    monkeypatch.setattr(ledger, "measure_alignment", lambda: rows(1.01))
    assert ledger.check("C32", live=True).status == "refuted"
    monkeypatch.setattr(ledger, "measure_alignment", lambda: rows(1.10))
    v = ledger.check("C32", live=True)
    assert v.status == "qualified" and v.evidence["live gemv in L2: extra time at 4/16 bytes vs 0/32"].value == \
        pytest.approx(10)


def test_c19_block_layout_and_error_cut_by_hand():
    """144 bytes = 2 + 2 (fp16 d, dmin) + 12 (sixteen 6-bit fields) + 128 (256 nibbles); the error cut
    is recomputed here from the formats, not read from the check."""
    from ref_impl.formats import gguf, quantize

    assert 2 + 2 + 16 * 6 // 8 + 256 // 2 == 144
    v = ledger.check("C19", live=False)
    assert v.evidence["bytes per super-block (2 fp16 + 12 packed + 128 codes)"].value == 144
    assert v.evidence["bits per weight"].value == 4.5
    with gguf.read(ledger.SHIPPED_MODEL) as f:
        w = f.array("blk.1.attn_q.weight")
    cut = 100 * (1 - quantize.relative_error(w, "Q4_K") / quantize.relative_error(w, "Q4_0"))
    assert 5 < cut < 40              # one matrix: the same order as the check's mean over all of them
    assert abs(v.evidence["Q4_K error cut vs Q4_0 (same 4.5 bits), attention projections"].value - cut) < 5


def test_c11_reads_the_recorded_quant_results():
    """With results/ holding a quant run, C11 quotes its Q4_K_M perplexity and size against F16,
    recomputed here from the raw records."""
    from ref_impl.measure import records

    recs = {(m["label"], r["weights"], r["metric"]): r["value"] for _, m, r in records.read_results("quant")
            if r["peer"] is None}
    labels = [lab for lab, w, metric in recs if w == "Q4_K_M" and metric == "heldout_perplexity"]
    v = ledger.check("C11", live=False)
    assert v.evidence["Llama-3-8B Q4_K_M perplexity increase (llama.cpp's table)"].value == 0.1754
    assert labels, "results/ ships a quant run (python -m ref_impl bench --quant ...)"
    lab = labels[0]
    ppl = 100 * (recs[lab, "Q4_K_M", "heldout_perplexity"] / recs[lab, "F16", "heldout_perplexity"] - 1)
    assert v.evidence["stdlib-10m Q4_K_M perplexity increase (measured)"].value == pytest.approx(ppl)
    assert lab in v.source


# ---- Signalling (C03, C23, C29) ------------------------------------------------------------------

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


# ---- Interconnect (C07, C08, C18, C25) ----------------------------------------------------------------

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


# ---- Dispatch: command buffers and sync bubbles (C01, C21, C31) ----------------------------------------

def test_c21_queue_model_evidence_by_hand():
    # defaults: n = 48 kernels of e = 3 µs and g = 8 µs, 16 per buffer (3 buffers), c = 10, s = 20, h = 60 µs
    # per_buffer: E = 48*3 + 3*10 = 174, G = 384: 174 + 384 + 3*20 + 60 = 678
    # per_token: commit ends 58, 116, 174; GPU work left 384, 256, 128: max(442, 372, 302) + 20 + 60 = 522
    # double_buffer: max(174 + 20 + 60, 384) = 384
    ev = ledger.check("C21", live=False).evidence
    for policy, us in (("per_buffer", 678), ("per_token", 522), ("double_buffer", 384)):
        assert ev[f"queue model, default costs: {policy} ITL"].value == pytest.approx(us)


def _fake_records(monkeypatch, rows):
    """rows: (label, backend, model, variant, metric, value) -> what dispatch_records returns for any experiment."""
    rec = {(lab, model, var, metric): {"value": v, "backend": b} for lab, b, model, var, metric, v in rows}
    monkeypatch.setattr(ledger, "dispatch_records", lambda experiment: rec)


def test_c21_small_model_losses_confirm_and_large_model_losses_qualify(monkeypatch):
    # sync 75 vs async 100 tok/s: 25% lost on the tiny model; 95 vs 100: 5% on the 8B shape -> the claim as stated
    _fake_records(monkeypatch, [("gpu", "cuda", "tiny", "sync", "tokens_per_s", 75.0),
                                ("gpu", "cuda", "tiny", "async_eval", "tokens_per_s", 100.0),
                                ("gpu", "cuda", "Llama-3.1-8B", "sync", "tokens_per_s", 95.0),
                                ("gpu", "cuda", "Llama-3.1-8B", "async_eval", "tokens_per_s", 100.0)])
    v = ledger.check("C21", live=False)
    assert v.status == "confirmed"
    assert v.evidence["throughput lost by syncing each token, tiny (gpu)"].value == pytest.approx(25.0)
    _fake_records(monkeypatch, [("gpu", "cuda", "tiny", "sync", "tokens_per_s", 95.0),
                                ("gpu", "cuda", "tiny", "async_eval", "tokens_per_s", 100.0),
                                ("gpu", "cuda", "Llama-3.1-8B", "sync", "tokens_per_s", 60.0),
                                ("gpu", "cuda", "Llama-3.1-8B", "async_eval", "tokens_per_s", 100.0)])
    v = ledger.check("C21", live=False)
    assert v.status == "qualified" and "largest for Llama-3.1-8B" in v.summary and "40%" in v.summary
    _fake_records(monkeypatch, [])
    assert ledger.check("C21", live=False).status == "not testable here"


def test_c21_recorded_losses_are_one_minus_sync_over_async():
    rec = ledger.dispatch_records("dispatch-async")
    v = ledger.check("C21", live=False)
    for (lab, model, var, metric), r in rec.items():
        if var == "sync" and metric == "tokens_per_s":
            loss = 100 * (1 - r["value"] / rec[lab, model, "async_eval", "tokens_per_s"]["value"])
            assert v.evidence[f"throughput lost by syncing each token, {model} ({lab})"].value == pytest.approx(loss)


def test_c01_gpu_stall_qualified_by_a_cpu_without_one(monkeypatch):
    _fake_records(monkeypatch, [("gpu", "cuda", "tiny", "layer_eval", "slowdown", 0.2),
                                ("gpu", "cuda", "tiny", "layer_eval", "extra_us_per_layer_eval", 45.0),
                                ("gpu", "cuda", "Llama-3.1-8B", "layer_eval", "slowdown", 0.4)])
    v = ledger.check("C01", live=False)
    assert v.status == "confirmed" and "20-40%" in v.summary
    assert v.evidence["time added per extra sync, tiny (gpu)"].value == 45.0
    assert v.evidence["ggml-metal: most command buffers per graph (GGML_METAL_MAX_COMMAND_BUFFERS)"].value == 8
    _fake_records(monkeypatch, [("gpu", "cuda", "tiny", "layer_eval", "slowdown", 0.2),
                                ("cpu", "cpu", "tiny", "layer_eval", "slowdown", -0.1)])
    v = ledger.check("C01", live=False)
    assert v.status == "qualified" and "10-10% faster" in v.summary
    _fake_records(monkeypatch, [("cpu", "cpu", "tiny", "layer_eval", "slowdown", -0.1)])
    assert ledger.check("C01", live=False).status == "not testable here"


def test_c31_recorded_latencies_are_all_above_a_microsecond(monkeypatch, tmp_path):
    v = ledger.check("C31", live=False)
    per_op = [n.value for k, n in v.evidence.items() if "µs per op" in k]
    assert v.status == "refuted" and per_op and min(per_op) > 1.0
    assert all(n.value > 4096 for k, n in v.evidence.items() if k.startswith("break-even"))
    no_results(monkeypatch, tmp_path)
    assert ledger.check("C31", live=False).status == "not testable here"


# ---- Caching, static workspaces and wired memory (C02, C09, C15, C28) -------------------------------------

def test_growth_pauses_finds_the_steps_by_hand():
    # prompt 32: ITL i ends with the step writing position 32 + i + 1, so growth steps of 256 fall at
    # i = 479 (position 512) and i = 735 (768); median 1 ms, pauses over 5 ms only there
    itl = [1.0] * 800
    itl[479], itl[735] = 300.0, 40.0
    pauses, growth = ledger.growth_pauses(itl, 32)
    assert pauses == [479, 735] and growth == [223, 479, 735]
    assert ledger.growth_pauses([1.0] * 10, 5, step=4) == ([], [2, 6])


def test_c09_c28_read_the_recorded_first_call_results(monkeypatch, tmp_path):
    rec = ledger.first_call_recorded()
    gpu = [lab for lab, d in rec.items() if d["backend"] == "cuda"]
    assert gpu, "results/ holds an H200 first-call run"
    for cid in ("C09", "C28"):
        v = ledger.check(cid, live=False)
        assert v.status == "qualified" and "portable analog" in v.summary and "Metal" in v.summary
        g = gpu[0]
        fresh = v.evidence[f"first token, fresh process, empty kernel cache ({g})"].value
        cached = v.evidence[f"first token, second process, kernel cache on disk ({g})"].value
        steady = v.evidence[f"steady decode step, median ({g})"].value
        # the cache removes most of the pause but the first token still exceeds a steady one
        assert fresh > 10 * cached > 10 * steady
        assert fresh == rec[g]["tokens"][1, 1][0]
    no_results(monkeypatch, tmp_path)
    assert ledger.check("C09", live=False).status == ledger.check("C28", live=False).status == "not testable here"


def test_c02_pauses_sit_at_growth_steps_and_concat_never_pauses(monkeypatch, tmp_path):
    v = ledger.check("C02", live=False)
    ev = v.evidence
    assert v.status == "qualified"
    near = [n.value for k, n in ev.items() if k.startswith("chunked: pauses within one token of a growth step")]
    total = [n.value for k, n in ev.items() if k.startswith("chunked: pauses over") and "Llama-3.1-8B" in k]
    assert near and near[0] == total[0] > 0
    assert all(n.value == 0 for k, n in ev.items() if k.startswith("concat: pauses over"))
    copy = next(n.value for k, n in ev.items() if k.startswith("copying the whole chunked cache"))
    longest = next(n.value for k, n in ev.items() if k.startswith("chunked: longest ITL (Llama-3.1-8B"))
    assert longest > 100 * copy          # the pause is not the copy
    no_results(monkeypatch, tmp_path)
    assert ledger.check("C02", live=False).status == "not testable here"


def test_c15_faults_one_per_page_and_says_not_testable():
    v = ledger.check("C15", live=False)
    assert v.status == "not testable here" and "macOS" in v.summary
    for k, n in v.evidence.items():
        if k.startswith("first touch of"):
            mib = float(k.split("of ")[1].split(" MiB")[0].replace(",", ""))
            assert n.value == mib * 2**20 / 4096      # 4 KiB pages: 64 MiB -> 16,384 faults


# ---- Dispatch: TTFT and jitter (C16) ---------------------------------------------------------------

def test_c16_growth_positions_by_hand():
    # a 32-token prompt fills a 256-slot buffer: grows at positions 256, 512, ...; 300 tokens: 512 slots first
    assert ledger.growth_positions(32, 1000) == [256, 512, 768]
    assert ledger.growth_positions(300, 1000) == [512, 768]
    assert ledger.growth_positions(256, 600) == [256, 512]          # full after prefill: grows on step 0
    assert ledger.growth_positions(5, 40, step=16) == [16, 32]


def test_c16_threshold_pauses_on_a_trace_built_by_hand():
    # prompt 32, 600 intervals of 1 ms; interval j submits the step writing position 33 + j:
    # position 512 is interval 479, position 300 (off threshold) is interval 267
    itl = np.ones(600)
    itl[479], itl[267], itl[223] = 400.0, 50.0, 5.0                 # 256 (interval 223) only 5x: no pause
    t = ledger.JitterTrace("f.json", "gpu", "cuda", "m", "chunked", 32, itl)
    assert t.positions[0] == 33 and t.positions[479] == 512
    p = ledger.threshold_pauses(t)
    assert p == {"thresholds": [256, 512], "paused": [512], "off_threshold": [300]}


def test_c16_reads_the_recorded_kv_jitter_runs(monkeypatch, tmp_path):
    v = ledger.check("C16", live=False)
    traces = ledger.jitter_traces()
    assert traces and v.status == "qualified" and "locks are not testable here" in v.summary
    assert all(f"results/{t.file}" in v.source for t in traces)
    for t in traces:    # prompt + generated tokens = context: ITLs are one fewer than the tokens
        assert t.prompt_len >= 1 and t.prompt_len + len(t.itl_ms) + 1 <= 1 << 16
    # p99 / p50 evidence is what numpy says of the recorded samples
    for key, n in v.evidence.items():
        if key.endswith("ITL p99 / p50"):
            machine, model, s = key.split(": ")[0].split(", ")
            t = next(t for t in traces if (t.machine, t.model, t.strategy) == (machine, model, s))
            assert math.isclose(n.value, np.percentile(t.itl_ms, 99) / np.percentile(t.itl_ms, 50))
    no_results(monkeypatch, tmp_path)
    assert ledger.check("C16", live=False).status == "not testable here"


# ---- KV cache: unified memory (C12, C30) --------------------------------------------------------------

def test_c12_c30_read_the_unified_records_and_stay_honest_about_apple():
    rec = ledger.unified_recorded()
    v12, v30 = ledger.check("C12", live=False), ledger.check("C30", live=False)
    assert v12.status == "qualified" and v30.status == "not testable here"
    for label, d in rec.items():     # the copy facts the verdicts state are the recorded ones
        assert d["facts"][("mx.array(np)", "shares_memory")] == 0.0
        assert d["facts"][("np.asarray(mx)", "shares_memory")] == 1.0
        key = f"np.asarray(mx) shares the source's memory ({label})"
        assert v12.evidence[key].value == 1.0
        if d["backend"] == "cuda":    # a discrete GPU's first reads are slower than its second ones
            size, r = ledger.first_reads(d)
            assert r["host first"] < r["host again"] and r["device first"] < r["device again"]
            assert f"{r['host first']:.1f} GB/s" in v12.summary


# ---- KV cache: memory, outliers, quality (C05, C17, C20) ---------------------------------------------

def test_c05_memory_by_hand():
    v = ledger.check("C05", live=False)
    ev = v.evidence
    # Llama-3.1-8B: 2 (K, V) x 32 layers x 8 heads x 128 x 2 bytes x 65,536 = 8.59 GB; Qwen3-32B 64 layers: 17.2 GB
    assert ev["Llama-3.1-8B, float16 cache at 64k"].value == pytest.approx(2 * 32 * 8 * 128 * 2 * 65536 / 1e9)
    assert ev["Qwen3-32B, float16 cache at 64k"].value == pytest.approx(2 * 64 * 8 * 128 * 2 * 65536 / 1e9)
    assert ev["Qwen3-30B-A3B, float16 cache at 64k"].value == pytest.approx(2 * 48 * 4 * 128 * 2 * 65536 / 1e9)
    assert ev["4-bit g64 / float16 (4.5 of 16 bits)"].value == pytest.approx(4.5 / 16)
    assert v.status == "qualified" and "2.53 GB" in v.summary


def test_c17_c20_read_the_recorded_perplexities(monkeypatch, tmp_path):
    best = ledger._kv_best()
    v17, v20 = ledger.check("C17", live=False), ledger.check("C20", live=False)
    assert best is not None, "results/ holds bench --kv runs"
    label, d = best
    assert d["delta"]["float"] == 0.0
    for scheme, delta in d["delta"].items():        # the deltas are differences of the recorded perplexities
        assert delta == pytest.approx(d["ppl"][scheme] - d["ppl"]["float"], abs=1e-9)
    rel_sym4 = 100 * d["delta"]["sym4"] / d["ppl"]["float"]
    assert v17.evidence["perplexity change, sym4"].value == pytest.approx(rel_sym4)
    # outlier4 on a Llama-3.1-8B layer: keys 4 fp16 channels x 8 heads (64 B) + 124 4-bit codes x 8 (496 B) +
    # 4 groups of 32 x 8 heads x fp16 scale and bias (128 B); values 512 + 128 B: 1,344 of 4,096 B
    assert v20.evidence["outlier4 bytes per token per layer (Llama-3.1-8B shape)"].value == 1344
    assert v20.evidence["memory saved by outlier4 (4 fp16 key channels per head, 4-bit g32)"].value == pytest.approx(
        100 * (1 - 1344 / 4096))
    assert v20.status == ("qualified" if d["delta"]["outlier4"] < 0.1 else "refuted")
    no_results(monkeypatch, tmp_path)
    assert ledger.check("C17", live=False).status == ledger.check("C20", live=False).status == "pending"


# ---- Speculative decoding (C06, C13, C22, C24) ---------------------------------------------------------

def test_c06_exactness_is_a_test_that_can_fail():
    p_rule, p_broken = ledger._exactness()
    assert p_rule > 1e-3 > p_broken
    v = ledger.check("C06", live=False)
    assert v.status == "qualified" and f"p = {p_rule:.2f}" in v.summary


def test_spec_speedups_are_the_recorded_ones():
    for label, d in ledger.spec_recorded().items():
        for key, m in d["speed"].items():
            best = ledger._best_speedup(d["speed"], model=key[0], variant=key[1], alpha_set=key[3])
            assert best[0] >= max(m["speedup"].values()) - 1e-12
            for g, s in m["speedup"].items():     # a speedup is tokens/s over the plain decoder's, > 0
                assert s > 0 and m["tokens_per_s"][g] > 0


def test_c24_c22_c13_evidence_is_the_recorded_numbers():
    rec = ledger.spec_recorded()
    v24, v22, v13 = (ledger.check(c, live=False) for c in ("C24", "C22", "C13"))
    for label, d in rec.items():
        for model, ratios in d["forward"].items():
            top = max(ratios)
            assert ratios[1] == 1.0                                     # a ratio to the one-position forward
            assert v24.evidence[f"{model}, {top} positions / 1 ({label})"].value == ratios[top]
        for (model, variant, drafter, a), m in d["speed"].items():
            if variant == "alpha-set" and a is not None and a >= 0.6:
                g = max(m["speedup"], key=m["speedup"].get)
                n = v22.evidence[f"{model} / {drafter}, α set {a}, best γ = {g} ({label})"]
                assert n.value == pytest.approx(100 * (m["speedup"][g] - 1))
        if ("mtp", "stdlib-10m-mtp") in d["pooled"]:
            assert v13.evidence[f"MTP heads, greedy α on held-out text ({label})"].value == d["pooled"]["mtp", "stdlib-10m-mtp"]
