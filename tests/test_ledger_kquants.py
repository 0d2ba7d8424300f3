"""The K-quants chapter's checks (C11, C19): the block layout by hand, the reference quant and decode-shape
runs read back (and, on synthetic results, the newest complete run per machine and weight type), the rules
on synthetic evidence, and pending when the results are missing."""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path

import pytest

from ref_impl import ledger
from ref_impl.measure import records
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


def test_c11_reads_the_reference_quant_and_decode_shape_runs():
    """C11's perplexity and bytes on the shipped model, from its reference quant run, and the 8B-shaped decode's
    bytes and shares of the measured bandwidth, from the reference decode-shape runs of F16 and Q4_K_M,
    recomputed here from their records; Llama-3-8B's from llama.cpp's scoreboard."""
    runs = ledger.kquants.quant_runs()
    scored = [lab for lab, run in runs.items()
              if run.select("quant", weights="Q4_K_M", metric="heldout_perplexity", peer=None)]
    assert scored, "results/ ships a quant run that scored perplexity (python -m ref_impl bench --quant ...)"
    lab = min(scored)
    run = runs[lab]
    assert run == records.reference("quant", lab, model="stdlib-10m")            # one run per machine
    ppl = {w: run.value("quant", "heldout_perplexity", weights=w, peer=None) for w in ("F16", "Q4_K_M")}
    rise = 100 * (ppl["Q4_K_M"] / ppl["F16"] - 1)
    v = ledger.check("C11", live=False)
    assert v.evidence[f"Q4_K_M perplexity increase over F16, stdlib-10m (measured, {lab})"].value == pytest.approx(rise)
    (_, p16), (_, p4) = LLAMA3_8B_SCOREBOARD["F16"], LLAMA3_8B_SCOREBOARD["Q4_K_M"]
    assert p4 - p16 == pytest.approx(0.1740, abs=1e-4)       # the scoreboard's row; quantize.cpp says +0.1754
    assert v.evidence["Q4_K_M perplexity increase over F16, Llama-3-8B (llama.cpp's scoreboard)"].value == \
        pytest.approx(100 * (p4 / p16 - 1))
    decodes = ledger.kquants.shape_decodes("h200")
    for w in ("F16", "Q4_K_M"):
        d = decodes[w]
        assert d.run == records.reference("decode-shape", "h200", model="Llama-3.1-8B", weights=w, peer=None)
        gbs, source = records.bandwidth(d.run)
        tok, nbytes = (d.run.value("decode-shape", m) for m in ("tokens_per_s", "bytes_per_token"))
        assert (d.bandwidth_gbs, d.bandwidth_run) == (gbs, source)
        assert d.share == pytest.approx(tok * nbytes / 1e9 / gbs)
        # the bench divided by the same measured bandwidth: its own roofs' fastest probe
        assert d.share == pytest.approx(d.run.value("decode-shape", "bandwidth_fraction"))
        assert v.evidence[f"share of measured bandwidth reached, {w} (h200, MLX)"].value == pytest.approx(100 * d.share)
        assert d.run.caption in v.source
    share = 100 * decodes["Q4_K_M"].bytes_per_token / decodes["F16"].bytes_per_token
    assert v.evidence["Q4_K_M bytes / F16 bytes, Llama-3.1-8B-shaped decode step (measured, h200)"].value == \
        pytest.approx(share)
    assert run.caption in v.source
    assert v.status == "qualified" and "Llama-3-8B" in v.condition and f"{rise:+.2f}%" in v.summary


def write_run(folder, label: str, stamp: str, recs: list[dict]) -> str:
    """A results file of `recs` on machine `label`, dated 1-9 Dec 2026 by `stamp`; its name."""
    name = f"{label}-2026120{stamp}-000000.json"
    doc = {"schema": 1, "date": f"2026-12-0{stamp}T00:00:00+00:00", "git": stamp * 7, "command": "bench",
           "machine": {"label": label, "gpu": "NVIDIA H200" if label == "gpu" else None}, "records": recs}
    (folder / name).write_text(json.dumps(doc))
    return name


def quant_recs(ppl16: float, ppl4: float) -> list[dict]:
    return [records.record("quant", m, u, v, model="stdlib-10m", weights=w, **extra)
            for w, p, nbytes in (("F16", ppl16, 22.0e6), ("Q4_K_M", ppl4, 8.0e6))
            for m, u, v, extra in (("heldout_perplexity", "ppl", p, {"tokens": 1024}),
                                   ("tensor_bytes", "B", nbytes, {"mix": {"Q4_K": 4, "Q5_0": 34}}))]


def shape_recs(types: dict[str, float], roof: float | None) -> list[dict]:
    """decode-shape records of each type at the given tok/s (1 GB per token), and the run's roofs if any."""
    out = [records.record("roofs", "bandwidth", "GB/s", v, variant=probe)     # a machine's roofs: both MLX probes
           for probe, v in (("copy", roof), ("read", roof / 2))] if roof else []
    return out + [records.record("decode-shape", m, u, v, model="Llama-3.1-8B", weights=w)
                  for w, tok in types.items()
                  for m, u, v in (("bits_per_weight", "bits", 4.9), ("bytes_per_token", "B", 1e9),
                                  ("tokens_per_s", "tok/s", tok))]


def test_c11_reads_each_key_from_its_newest_complete_run(monkeypatch, tmp_path):
    """Two quant runs on one machine and a newer broken one: the newest complete one is read. On the GPU, F16
    and Q4_K were one run and Q4_K_M another (as the H200's): each type comes from the newest complete run that
    holds it, and its share is divided by that run's own measured bandwidth, or by the machine's reference
    roofs run where it recorded none."""
    write_run(tmp_path, "cpu", "1", quant_recs(7.0, 7.7))
    newest = write_run(tmp_path, "cpu", "2", quant_recs(6.0, 6.03))
    write_run(tmp_path, "cpu", "3", quant_recs(math.nan, 6.0))
    f16_run = write_run(tmp_path, "gpu", "1", shape_recs({"F16": 100.0, "Q4_K": 150.0}, roof=200.0))
    q4_run = write_run(tmp_path, "gpu", "2", shape_recs({"Q4_K_M": 110.0}, roof=None))
    write_run(tmp_path, "gpu", "3", shape_recs({"F16": math.nan}, roof=400.0))
    monkeypatch.setattr(ledger.core, "RESULTS_DIR", tmp_path)
    assert ledger.kquants.quant_runs()["cpu"].file == newest
    d = ledger.kquants.shape_decodes("gpu")
    assert (d["F16"].run.file, d["Q4_K_M"].run.file, d["Q4_K"].run.file) == (f16_run, q4_run, f16_run)
    assert d["F16"].share == pytest.approx(100 / 200)                  # its own run's probe
    assert d["Q4_K_M"].bandwidth_run.file.startswith("gpu-20261203")   # none of its own: the reference roofs run
    assert d["Q4_K_M"].share == pytest.approx(110 / 400)
    v = ledger.check("C11", live=False)
    assert v.evidence["Q4_K_M perplexity increase over F16, stdlib-10m (measured, cpu)"].value == pytest.approx(0.5)
    assert v.evidence["8B-shaped decode, Q4_K_M / F16 speed (gpu, MLX)"].value == pytest.approx(1.1)
    assert all(name in v.source for name in (newest, f16_run, q4_run))


def test_the_ledger_module_measures_nothing():
    """No clock and no timing module; its one cache holds rounding arithmetic (matrix_errors), not a measurement."""
    tree = ast.parse(Path(ledger.kquants.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not imported & {"time", "timing", "clock"} and "ref_impl.platform.timing" not in modules
    assert not [n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name.startswith("measure")]


def test_c11_is_pending_without_its_results_and_c19_needs_none(monkeypatch, tmp_path):
    monkeypatch.setattr(ledger.core, "RESULTS_DIR", tmp_path)
    v = ledger.check("C11", live=False)
    assert v.status == "pending" and "bench --quant F16 Q4_K_M" in v.summary and "--shape Llama-3.1-8B" in v.summary
    assert ledger.check("C19", live=False).status == "qualified"
