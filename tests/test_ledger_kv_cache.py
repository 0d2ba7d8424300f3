"""The KV-cache checks (C05, C12, C17, C20, C30) on the recorded results."""

from __future__ import annotations

import pytest

from ref_impl import ledger


def no_results(monkeypatch, tmp_path) -> None:
    """The ledger as a fresh clone without results/ would compute it: core.results reads an empty folder."""
    monkeypatch.setattr(ledger.core, "RESULTS_DIR", tmp_path)


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
    best = ledger.kv_cache.kv_best()
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
