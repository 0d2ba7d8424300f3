"""The GGUF layout chapter's checks (C10, C32): layout facts by hand, the split-load cost read from the
recorded sweep, the rules on synthetic evidence, pending without a recorded sweep, and live sweeps that
are shown but never decide."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from ref_impl import ledger
from ref_impl.ledger.gguf import AlignmentEvidence, SplitLoads, split_loads, split_share
from ref_impl.measure import loads, records
from ref_impl.measure.loads import Throughput

L2_COST = SplitLoads(l2=20.0, dram=0.2, scatter_l2=2.8, scatter_dram=0.7, one_byte_l2=190.0)   # the recorded h200
EVERYWHERE = SplitLoads(l2=20.0, dram=5.0, scatter_l2=2.8, scatter_dram=0.7, one_byte_l2=190.0)
NOWHERE = SplitLoads(l2=1.0, dram=0.2, scatter_l2=2.8, scatter_dram=0.7, one_byte_l2=190.0)
REAL_BLOCKS = {"Q4_0": 6.25, "Q8_0": 6.25, "Q4_K": 50.0, "Q6_K": 6.25}
ALIGNED_BLOCKS = {"Q4_0": 100.0, "Q4_K": 100.0}        # a hypothetical format whose blocks are whole 32-byte units


def evidence(recorded, blocks=REAL_BLOCKS, offsets=100.0, live=()) -> AlignmentEvidence:
    return AlignmentEvidence(32, 56, offsets, blocks, recorded, "results/synthetic.json", live)


RULE_CASES = {
    "C10": [
        (evidence({"h200": L2_COST}), "qualified"),                         # the recorded case
        (evidence({"h200": EVERYWHERE}), "qualified"),                      # penalty everywhere, blocks misaligned
        (evidence({"h200": L2_COST}, ALIGNED_BLOCKS), "qualified"),         # blocks aligned, nothing from DRAM
        (evidence({"h200": EVERYWHERE}, ALIGNED_BLOCKS), "confirmed"),
        (evidence({"a": EVERYWHERE, "b": L2_COST}, ALIGNED_BLOCKS), "qualified"),   # one machine without
        (evidence({"h200": EVERYWHERE}, ALIGNED_BLOCKS, offsets=98.0), "refuted"),  # an offset off 32 bytes
        (evidence({"h200": NOWHERE}), "refuted"),                           # no penalty to avoid
        (evidence({"a": NOWHERE, "b": L2_COST}), "qualified"),              # a penalty on one machine
    ],
    "C32": [
        (evidence({"h200": L2_COST}), "qualified"),
        (evidence({"h200": EVERYWHERE}), "qualified"),                      # GPU threads unmeasured: no confirming
        (evidence({"a": NOWHERE, "b": L2_COST}), "qualified"),
        (evidence({"h200": NOWHERE}), "refuted"),
        (evidence({"a": NOWHERE, "b": NOWHERE}), "refuted"),
    ],
}


def sweep(l2_split: float, dram_split: float = 1.0, scatter: float = 1.0) -> tuple[Throughput, ...]:
    """Synthetic sweep rows: time 1 at 0 and 32 bytes, `scatter` at 64, the split cost at 4 and 16, 3 at 1 byte."""
    rows = []
    for op in ("sum", "gemv"):
        for size, split in ((256 * 2**10, l2_split), (96 * 2**20, dram_split)):
            for off, t in ((0, 1.0), (1, 3.0), (4, split), (16, split), (32, 1.0), (64, scatter)):
                rows.append(Throughput("numpy", op, size, off, off % 64, t, size / t / 1e9, off % 4 == 0, 3))
    return tuple(rows)


def test_c10_c32_facts_by_hand():
    v = ledger.check("C10", live=False)
    ev = v.evidence
    assert ev["GGUF default alignment (general.alignment absent)"].value == 32
    assert ev["shipped model: tensor data offsets that are multiples of 32 (56 tensors)"].value == 100
    # block k starts at k * 18 bytes: a multiple of 32 when 16 divides k (gcd(18, 32) = 2, so 2/32)
    assert ev["Q4_0 blocks (18 bytes) that start 32-byte aligned"].value == pytest.approx(6.25)
    assert ev["Q4_K blocks (144 bytes) that start 32-byte aligned"].value == pytest.approx(50)
    assert v.status == "qualified" and "not quantized blocks" in v.condition and "from DRAM" in v.condition
    # the geometry: 32-byte loads from 0 or 32 bytes past a line never split it, from 4 bytes every second one does
    assert split_share(0) == split_share(32) == 0 and split_share(4) == split_share(16) == 50
    assert split_share(32, 64) == 100 and split_share(0, 64) == 0
    v = ledger.check("C32", live=False)
    assert v.status == "qualified" and "GPU threads were not measured" in v.summary


def test_the_verdicts_read_the_recorded_sweep():
    """The split-load cost in the evidence is recomputed here from the recorded rows: numpy GEMV's time at
    the worse of 4 and 16 bytes against the better of 0 and 32."""
    sweep = loads.recorded_sweeps()["h200"]
    assert sweep.run == records.reference("alignment", "h200", metric="read_rate")     # the machine's reference run
    t = {(r.op, r.buffer_bytes, r.offset_bytes): r.seconds for r in sweep.rows}
    near, far = sorted({r.buffer_bytes for r in sweep.rows})
    cost = {size: 100 * (max(t["gemv", size, 4], t["gemv", size, 16])
                         / min(t["gemv", size, 0], t["gemv", size, 32]) - 1) for size in (near, far)}
    for cid in ("C10", "C32"):
        v = ledger.check(cid, live=False)
        assert v.evidence["recorded (h200): split-load cost, numpy GEMV in L2 (4/16 vs 0/32 bytes)"].value == \
            pytest.approx(cost[near])
        assert v.evidence["recorded (h200): split-load cost, numpy GEMV from DRAM"].value == pytest.approx(cost[far])
        assert sweep.run.caption in v.source and f"{cost[near]:+.1f}%" in v.summary


def test_split_loads_of_a_synthetic_sweep():
    s = split_loads(sweep(1.2, 1.0, scatter=1.01))
    assert s.l2 == pytest.approx(20) and s.dram == pytest.approx(0) and s.one_byte_l2 == pytest.approx(200)
    assert s.scatter_l2 == pytest.approx(1) and s.scatter_dram == s.scatter_l2


def test_without_a_recorded_sweep_both_are_pending_with_its_command(monkeypatch, tmp_path):
    monkeypatch.setattr(ledger.core, "RESULTS_DIR", tmp_path)
    for cid in ("C10", "C32"):
        v = ledger.check(cid, live=False)
        assert v.status == "pending" and "bench --alignment" in v.summary, cid


def test_live_sweeps_are_shown_with_their_spread_and_never_decide(monkeypatch):
    """Live sweeps that show no penalty anywhere (which would refute both) leave the recorded verdicts
    as they are; their median and range are in the evidence, labelled live."""
    monkeypatch.setattr(ledger.gguf, "measure_alignment", lambda: (sweep(1.0), sweep(1.01), sweep(0.99)))
    for cid in ("C10", "C32"):
        live, recorded = ledger.check(cid, live=True), ledger.check(cid, live=False)
        assert live.status == recorded.status == "qualified", cid
        n = live.evidence["live split-load cost, numpy GEMV in L2 (this machine)"]
        assert n.rounds == 3 and n.value == pytest.approx(0)
        assert (n.low, n.high) == (pytest.approx(-1), pytest.approx(1))
        assert live.source.startswith("live") and "not deciding" in live.summary
        assert not any(k.startswith("live") for k in recorded.evidence)


def test_the_live_sweep_comes_from_measure_and_runs_once():
    """gather calls loads.measure_alignment (the ledger measures nothing itself): repeated, once per process."""
    assert ledger.gguf.measure_alignment is loads.measure_alignment
    sweeps = loads.measure_alignment()
    assert len(sweeps) == loads.LIVE_SWEEPS >= 3
    assert loads.measure_alignment() is sweeps                          # cached: C10 and C32 share one sweep
    assert {(r.op, r.offset_bytes) for r in sweeps[0]} == {(op, o) for op in ("sum", "gemv")
                                                          for o in loads.SWEEP_OFFSETS}


def test_the_ledger_module_measures_nothing():
    """No clock, no timing module, no measuring function: the chapter's ledger module only judges."""
    tree = ast.parse(Path(ledger.gguf.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not imported & {"time", "timing", "clock", "functools"} and "ref_impl.platform.timing" not in modules
    assert not [n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name.startswith("measure")]


def test_the_newest_complete_sweep_decides(monkeypatch, tmp_path):
    """Two recorded runs of one machine: the verdict reads the newer (here one without a penalty in L2: refuted),
    and its caption is the source."""
    def write(stamp: str, l2_split: float) -> None:
        recs = [records.record("alignment", "read_rate", "GB/s", r.gb_per_s, weights="F32", variant=f"numpy {r.op}",
                               backend="numpy", op=r.op, buffer_bytes=r.buffer_bytes, offset_bytes=r.offset_bytes,
                               line_offset=r.line_offset, seconds=r.seconds, float32_aligned=r.float32_aligned,
                               rounds=r.rounds, numpy_blas="a BLAS") for r in sweep(l2_split)]
        doc = {"schema": 1, "date": f"2026-12-0{stamp}T00:00:00+00:00", "git": stamp * 7, "command": "bench",
               "machine": {"label": "cpu", "cpu": "a CPU"}, "records": recs}
        (tmp_path / f"cpu-2026120{stamp}-000000.json").write_text(json.dumps(doc))
    write("1", 1.2)            # older: split loads cost 20% in L2
    write("2", 1.0)            # newer: nothing
    monkeypatch.setattr(ledger.core, "RESULTS_DIR", tmp_path)
    v = ledger.check("C32", live=False)
    assert v.status == "refuted" and "cpu-20261202-000000.json" in v.source and "20261201" not in v.source
