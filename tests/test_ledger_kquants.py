"""The K-quants chapter's checks (C11, C19): block layout by hand, recorded quant results."""

from __future__ import annotations

import pytest

from ref_impl import ledger


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
