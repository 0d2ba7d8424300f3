"""The command-buffer checks (C01, C21, C31): each rule on synthetic evidence either side of its thresholds, the
queue model by hand, the evidence as recorded, each machine's newest complete run read and named (a synthetic
results folder of two runs per machine), the live reading measured in measure/ and shown only, and pending when a
GPU's results are missing. `write_run` and `results_in` serve the other dispatch ledger tests too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ref_impl import ledger
from ref_impl.ledger.dispatch import C21Evidence, C31Evidence, LaunchFloor, LayerEvalRun, SyncRun
from ref_impl.measure import latency
from ref_impl.measure.records import record


def no_results(monkeypatch, tmp_path) -> None:
    """The ledger as a fresh clone without results/ would compute it: it reads an empty folder."""
    results_in(monkeypatch, tmp_path)


def results_in(monkeypatch, folder: Path) -> None:
    """The ledger reads its results from `folder` (ledger.core.RESULTS_DIR, which every rule passes to the
    selector)."""
    monkeypatch.setattr(ledger.core, "RESULTS_DIR", folder)


def write_run(folder: Path, label: str, backend: str, day: int, recs: list[dict]) -> str:
    """A results file of machine `label` dated `day` Jan 2026 (1-9), as bench writes it; its file name."""
    name = f"{label}-2026010{day}.json"
    machine = {"label": label, "backend": backend, "cpu": "x"}
    doc = {"schema": 1, "date": f"2026-01-0{day}T00:00:00+00:00", "git": f"abc000{day}",
           "command": "python -m ref_impl bench --dispatch", "machine": machine, "records": recs}
    (folder / name).write_text(json.dumps(doc))
    return name


# ---- the rules on synthetic evidence ----------------------------------------------------------------

def layer_run(model: str, graph: tuple, layer: tuple, backend: str = "cuda") -> LayerEvalRun:
    return LayerEvalRun("gpu" if backend != "cpu" else "cpu", backend, model, graph, layer, 45.0)


STALL = layer_run("tiny", (100.0, 105.0, 110.0), (80.0, 85.0, 90.0))          # layer's fastest < graph's slowest
OVERLAP = layer_run("8B", (100.0, 105.0, 110.0), (90.0, 95.0, 101.0))         # slower median, within the rounds' spread
NO_STALL = layer_run("8B", (100.0, 105.0, 110.0), (110.0, 115.0, 120.0))
CPU_FASTER = layer_run("tiny", (100.0,), (120.0,), backend="cpu")              # context: never moves the verdict


def sync_run(model: str, params: float, sync: float, piped: float = 100.0, backend: str = "cuda") -> SyncRun:
    return SyncRun("gpu" if backend != "cpu" else "cpu", backend, model, params, sync, piped)


QUEUE = (("per_token", 522.0), ("double_buffer", 384.0))
SMALL, BIG = 5e6, 8e9


def floor(chain: int, per_op_us: float, compiled: bool = False, machine: str = "gpu") -> LaunchFloor:
    return LaunchFloor(machine, "cuda", chain, compiled, per_op_us)


RULE_CASES = {
    "C01": [((STALL, layer_run("8B", (50.0, 52.0), (30.0, 31.0))), "confirmed"),
            ((STALL, CPU_FASTER), "confirmed"),                     # a CPU without a queue does not downgrade it
            ((STALL, OVERLAP), "qualified"),
            ((NO_STALL, OVERLAP), "refuted"),
            ((NO_STALL, layer_run("tiny", (100.0,), (60.0,), backend="cpu")), "refuted")],
    "C21": [(C21Evidence((sync_run("tiny", SMALL, 80.0), sync_run("8B", BIG, 95.0)), QUEUE), "confirmed"),
            (C21Evidence((sync_run("tiny", SMALL, 75.0), sync_run("8B", BIG, 95.0),
                          sync_run("tiny", SMALL, 99.0, backend="cpu")), QUEUE), "confirmed"),   # exactly 25%: up to
            (C21Evidence((sync_run("tiny", SMALL, 70.0), sync_run("8B", BIG, 95.0)), QUEUE), "qualified"),  # 30%
            (C21Evidence((sync_run("tiny", SMALL, 95.0), sync_run("8B", BIG, 80.0)), QUEUE), "qualified"),  # grows
            (C21Evidence((sync_run("tiny", SMALL, 90.0), sync_run("8B", BIG, 100.0)), QUEUE), "qualified"),
            (C21Evidence((sync_run("tiny", SMALL, 100.0), sync_run("8B", BIG, 101.0)), QUEUE), "refuted")],
    "C31": [(C31Evidence((floor(1, 0.5), floor(16, 0.1))), "confirmed"),
            (C31Evidence((floor(1, 0.5), floor(1, 30.0, machine="cpu"))), "qualified"),
            (C31Evidence((floor(1, 25.0), floor(16, 0.9))), "qualified"),
            # fused by mx.compile, 0.5 µs per add is one 8 µs kernel per 16 adds: not a kernel under 1 µs
            (C31Evidence((floor(1, 25.0), floor(16, 12.0), floor(16, 0.5, compiled=True))),
             "refuted")],
}


def test_c01_decides_on_the_gpu_and_shows_the_cpu_as_context():
    v = ledger.CLAIMS["C01"].judge((STALL, CPU_FASTER))
    assert v.status == "confirmed" and "1 of 1 models" in v.summary and "context only" in v.summary
    assert v.evidence["context, CPU: throughput lost to the evals, tiny (cpu)"].value == pytest.approx(-20.0)
    assert v.evidence["time added per extra sync, tiny (gpu)"].value == 45.0
    assert v.evidence["ggml-metal: most command buffers per graph (GGML_METAL_MAX_COMMAND_BUFFERS)"].value == 8
    v = ledger.CLAIMS["C01"].judge((STALL, OVERLAP))
    assert "not for 8B" in v.summary and "8B" in v.condition


def test_c21_names_what_qualifies_it():
    v = ledger.CLAIMS["C21"].judge(C21Evidence((sync_run("tiny", SMALL, 95.0), sync_run("8B", BIG, 60.0)), QUEUE))
    assert v.status == "qualified" and "from 5% (tiny) to 40% (8B)" in v.summary and "8B (40%)" in v.summary
    assert v.evidence["throughput lost by syncing each token, 8B (gpu)"].value == pytest.approx(40.0)


# ---- the recorded evidence ---------------------------------------------------------------------------

def test_c21_queue_model_evidence_by_hand():
    # defaults: n = 48 kernels of e = 3 µs and g = 8 µs, 16 per buffer (3 buffers), c = 10, s = 20, h = 60 µs
    # per_buffer: E = 48*3 + 3*10 = 174, G = 384: 174 + 384 + 3*20 + 60 = 678
    # per_token: commit ends 58, 116, 174; GPU work left 384, 256, 128: max(442, 372, 302) + 20 + 60 = 522
    # double_buffer: max(174 + 20 + 60, 384) = 384
    ev = ledger.check("C21", live=False).evidence
    for policy, us in (("per_buffer", 678), ("per_token", 522), ("double_buffer", 384)):
        assert ev[f"queue model, default costs: {policy} ITL"].value == pytest.approx(us)


def test_c21_recorded_losses_are_one_minus_sync_over_async():
    rec = ledger.dispatch_records("dispatch-async")
    v = ledger.check("C21", live=False)
    for (lab, model, var, metric), r in rec.items():
        if var == "sync" and metric == "tokens_per_s":
            loss = 100 * (1 - r["value"] / rec[lab, model, "async_eval", "tokens_per_s"]["value"])
            cpu = "context, CPU: " if r["backend"] == "cpu" else ""
            key = f"{cpu}throughput lost by syncing each token, {model} ({lab})"
            assert v.evidence[key].value == pytest.approx(loss)


def test_c01_recorded_rounds_and_losses():
    rec = ledger.dispatch_records("dispatch-layer-eval")
    v = ledger.check("C01", live=False)
    for (lab, model, var, metric), r in rec.items():
        if var == "layer_eval" and metric == "slowdown" and r["backend"] != "cpu":
            assert v.evidence[f"throughput lost to the evals, {model} ({lab})"].value == pytest.approx(100 * r["value"])
            n = v.evidence[f"an eval after every layer, {model} ({lab})"]
            assert (n.low, n.high, n.rounds) == (min(rec[lab, model, var, "tokens_per_s"]["samples"]),
                                                 max(rec[lab, model, var, "tokens_per_s"]["samples"]),
                                                 len(rec[lab, model, var, "tokens_per_s"]["samples"]))


def dispatch_run(sync: float, layer: float, floor_us: float) -> list[dict]:
    """One machine's dispatch records of the tiny model and kernel latencies: a sync loop at `sync` tok/s against
    100 pipelined, an eval per layer at `layer` tok/s against one graph per token at 100, one add at `floor_us`."""
    tok = dict(model="tiny", context=48)
    rounds = lambda v: [v - 1.0, v, v + 1.0]                                          # noqa: E731
    recs = [record("dispatch-async", "tokens_per_s", "tok/s", v, variant=var, samples=rounds(v), **tok)
            for var, v in (("sync", sync), ("async_eval", 100.0))]
    recs += [record("dispatch-layer-eval", "tokens_per_s", "tok/s", v, variant=var, samples=rounds(v), **tok)
             for var, v in (("layer_eval", layer), ("per_token_graph", 100.0))]
    recs += [record("dispatch-layer-eval", "extra_us_per_layer_eval", "us", 45.0, variant="layer_eval", layers=4,
                    **tok)]
    recs += [record("kernel-latency", "per_op_us", "us", floor_us * (1 if n <= 4096 else n / 4096), weights="F32",
                    variant="chain=1", elements=n) for n in (1, 4096, 1 << 20)]
    return recs


def test_each_machine_reads_its_newest_complete_run_and_names_it(monkeypatch, tmp_path):
    write_run(tmp_path, "gpu", "cuda", 1, dispatch_run(sync=50.0, layer=50.0, floor_us=40.0))     # older
    newer = write_run(tmp_path, "gpu", "cuda", 2, dispatch_run(sync=80.0, layer=70.0, floor_us=20.0))
    failed = dispatch_run(sync=float("nan"), layer=1.0, floor_us=1.0)          # its one measurement failed (a NaN)
    write_run(tmp_path, "gpu", "cuda", 3, [r for r in failed if r["experiment"] == "dispatch-async"])
    write_run(tmp_path, "cpu", "cpu", 1, dispatch_run(sync=10.0, layer=150.0, floor_us=90.0))
    cpu = write_run(tmp_path, "cpu", "cpu", 2, dispatch_run(sync=90.0, layer=120.0, floor_us=30.0))
    results_in(monkeypatch, tmp_path)
    for experiment in ("dispatch-async", "dispatch-layer-eval", "kernel-latency"):
        assert {k: r.file for k, r in ledger.dispatch_runs(experiment).items()} == {"gpu": newer, "cpu": cpu}
    rec = ledger.dispatch_records("dispatch-async")
    assert rec["gpu", "tiny", "sync", "tokens_per_s"]["value"] == 80.0
    assert rec["gpu", "tiny", "sync", "tokens_per_s"]["caption"] == f"gpu, 2 Jan 2026, commit abc0002 (results/{newer})"
    v21 = ledger.check("C21", live=False)
    assert v21.evidence["throughput lost by syncing each token, tiny (gpu)"].value == pytest.approx(20.0)
    assert v21.evidence["context, CPU: throughput lost by syncing each token, tiny (cpu)"].value == pytest.approx(10.0)
    v01 = ledger.check("C01", live=False)
    assert v01.evidence["throughput lost to the evals, tiny (gpu)"].value == pytest.approx(30.0)
    v31 = ledger.check("C31", live=False)
    assert v31.evidence["µs per kernel, smallest sizes, chain=1 (gpu)"].value == 20.0
    for v in (v01, v21, v31):                  # the source names the runs read, and no other
        assert f"results/{newer}" in v.source and f"results/{cpu}" in v.source
        assert "20260101" not in v.source and "20260103" not in v.source


def test_c01_and_c21_are_pending_without_a_gpu_run(monkeypatch, tmp_path):
    write_run(tmp_path, "cpu", "cpu", 1, dispatch_run(sync=90.0, layer=120.0, floor_us=30.0))
    results_in(monkeypatch, tmp_path)
    for cid in ("C01", "C21"):
        v = ledger.check(cid, live=False)
        assert v.status == "pending" and "python -m ref_impl bench --dispatch" in v.summary, cid
    assert ledger.check("C31", live=False).status == "refuted"      # a CPU's kernel latencies decide C31
    no_results(monkeypatch, tmp_path / "empty")
    for cid in ("C01", "C21", "C31"):
        assert ledger.check(cid, live=False).status == "pending", cid


def test_c31_recorded_latencies_are_all_above_a_microsecond():
    v = ledger.check("C31", live=False)
    per_kernel = [n.value for k, n in v.evidence.items() if k.startswith("µs per kernel")]
    assert v.status == "refuted" and per_kernel and min(per_kernel) > 1.0
    assert all(n.value > 4096 for k, n in v.evidence.items() if k.startswith("break-even"))
    assert not any(k.startswith("live") for k in v.evidence)


def test_c31_live_reading_is_measured_in_measure_shown_and_never_decides(monkeypatch):
    monkeypatch.setattr(latency, "measure_launch_floor", lambda: ("Device(gpu, 0)", (0.1, 0.2, 0.05)))
    v = ledger.check("C31", live=True)
    assert v.status == ledger.check("C31", live=False).status == "refuted"
    n = v.evidence["live: µs per kernel, one add on ≤ 4096 values (Device(gpu, 0))"]
    assert (n.value, n.low, n.high, n.rounds) == (0.1, 0.05, 0.2, 3)
    assert v.source.startswith("live: ref_impl.measure.latency.measure_launch_floor")
