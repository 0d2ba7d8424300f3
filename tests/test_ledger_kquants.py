"""The K-quants chapter's checks (C11, C19): the block layout by hand, the recorded quant and decode-shape
results read back, the rules on synthetic evidence, and pending when the results are missing."""

from __future__ import annotations

import pytest

from ref_impl import ledger
from ref_impl.ledger.kquants import LLAMA3_8B_SCOREBOARD, NoiseEvidence, Q4KMEvidence, SuperBlock

Q4_K = SuperBlock(weights=256, nbytes=144, fp16=2, scales=8, mins=8)
ATTN, MLP = ("attn_q", "attn_k", "attn_v", "attn_output"), ("ffn_gate", "ffn_up", "ffn_down")


def cuts(attn: float, mlp: float, spread: float = 0.3) -> dict[str, tuple[float, ...]]:
    """Six matrices of each kind, their error cuts spread around `attn` or `mlp` (%)."""
    offsets = tuple(spread * (k - 2.5) / 2.5 for k in range(6))
    return {k: tuple((attn if k in ATTN else mlp) + o for o in offsets) for k in ATTN + MLP}


def q4km(ppl_rise=(2.8, 0.7), byte_share=(31.0, 37.0, 36.0), block=Q4_K) -> Q4KMEvidence:
    """Synthetic C11 evidence: Q4_K_M's perplexity rise (%) on two models and its share of F16's bytes (%)."""
    models = ("Llama-3-8B (scoreboard)", "stdlib-10m (measured, cpu)")
    return Q4KMEvidence(block, {m: (10.0, 10.0 * (1 + r / 100)) for m, r in zip(models, ppl_rise)},
                        {f"bytes {i}": (100.0, s) for i, s in enumerate(byte_share)},
                        {"F32": 13, "Q4_K": 4, "Q5_0": 34, "Q6_K": 2, "Q8_0": 3}, (180.0, 184.0), (0.78, 0.29),
                        "gpu", "synthetic")


RULE_CASES = {
    "C19": [
        (NoiseEvidence(Q4_K, cuts(16.6, 17.0)), "qualified"),               # the shipped model's case
        (NoiseEvidence(Q4_K, cuts(16.7, 16.6)), "qualified"),               # larger in attention, within the noise
        (NoiseEvidence(Q4_K, cuts(25.0, 17.0)), "confirmed"),               # attention's cut clearly the largest
        (NoiseEvidence(Q4_K, cuts(-2.0, 17.0)), "refuted"),                 # Q4_K noisier than Q4_0 in attention
        (NoiseEvidence(SuperBlock(128, 72, 2, 4, 4), cuts(25.0, 17.0)), "refuted"),   # not the stated layout
    ],
    "C11": [
        (q4km(), "qualified"),                                              # the recorded case
        (q4km((0.9, 0.7)), "confirmed"),                                    # within 1% on both models
        (q4km((1.2, 0.7)), "qualified"),                                    # just outside on one
        (q4km((2.8, 1.5)), "refuted"),                                      # outside on every model
        (q4km((0.9, 0.7), (31.0, 55.0, 36.0)), "refuted"),                  # more than half the bytes
        (q4km((0.9, 0.7), block=SuperBlock(256, 136, 1, 8, 0)), "refuted"),  # no sub-block offsets
    ],
}


def test_c19_block_layout_and_error_cut_by_hand():
    """144 bytes = 2 + 2 (fp16 d, dmin) + 12 (sixteen 6-bit fields) + 128 (256 nibbles); the error cut
    is recomputed here from the formats, not read from the check."""
    from ref_impl.formats import gguf, quantize

    assert 2 + 2 + 16 * 6 // 8 + 256 // 2 == 144
    assert ledger.kquants.q4_k_block() == Q4_K
    v = ledger.check("C19", live=False)
    assert v.evidence["bytes per super-block (2 fp16 + 12 packed + 128 codes)"].value == 144
    assert v.evidence["bits per weight"].value == 4.5
    with gguf.read(ledger.SHIPPED_MODEL) as f:
        w = f.array("blk.1.attn_q.weight")
    cut = 100 * (1 - quantize.relative_error(w, "Q4_K") / quantize.relative_error(w, "Q4_0"))
    assert 5 < cut < 40              # one matrix: the same order as the check's mean over all of them
    assert abs(v.evidence["Q4_K error cut vs Q4_0 (same 4.5 bits), attention projections"].value - cut) < 5
    assert v.status == "qualified" and "minimums" in v.summary


def test_c11_reads_the_recorded_quant_and_decode_shape_results():
    """C11's perplexity and bytes on the shipped model and its bytes per 8B-shaped decode step, recomputed
    here from the raw records; Llama-3-8B's from llama.cpp's scoreboard."""
    from ref_impl.measure import records

    recs = {(m["label"], r["weights"], r["metric"]): r["value"] for _, m, r in records.read_results("quant")
            if r["peer"] is None and r.get("variant") is None}
    labels = [lab for lab, w, metric in recs if w == "Q4_K_M" and metric == "heldout_perplexity"]
    assert labels, "results/ ships a quant run (python -m ref_impl bench --quant ...)"
    lab = labels[-1]
    ppl = 100 * (recs[lab, "Q4_K_M", "heldout_perplexity"] / recs[lab, "F16", "heldout_perplexity"] - 1)
    v = ledger.check("C11", live=False)
    assert v.evidence[f"Q4_K_M perplexity increase over F16, stdlib-10m (measured, {lab})"].value == pytest.approx(ppl)
    (_, p16), (_, p4) = LLAMA3_8B_SCOREBOARD["F16"], LLAMA3_8B_SCOREBOARD["Q4_K_M"]
    assert p4 - p16 == pytest.approx(0.1740, abs=1e-4)       # the scoreboard's row; quantize.cpp says +0.1754
    assert v.evidence["Q4_K_M perplexity increase over F16, Llama-3-8B (llama.cpp's scoreboard)"].value == \
        pytest.approx(100 * (p4 / p16 - 1))
    shape = {(m["label"], r["weights"], r["metric"]): r["value"] for _, m, r in records.read_results("decode-shape")}
    gpu = next(lab for lab, w, _ in shape if w == "Q4_K_M")
    share = 100 * shape[gpu, "Q4_K_M", "bytes_per_token"] / shape[gpu, "F16", "bytes_per_token"]
    assert v.evidence[f"Q4_K_M bytes / F16 bytes, Llama-3.1-8B-shaped decode step (measured, {gpu})"].value == \
        pytest.approx(share)
    assert lab in v.source and gpu in v.source
    assert v.status == "qualified" and "Llama-3-8B" in v.condition and f"{ppl:+.2f}%" in v.summary


def test_c11_is_pending_without_its_results_and_c19_needs_none(monkeypatch, tmp_path):
    monkeypatch.setattr(ledger.core, "RESULTS_DIR", tmp_path)
    v = ledger.check("C11", live=False)
    assert v.status == "pending" and "bench --quant F16 Q4_K_M" in v.summary and "--shape Llama-3.1-8B" in v.summary
    assert ledger.check("C19", live=False).status == "qualified"
