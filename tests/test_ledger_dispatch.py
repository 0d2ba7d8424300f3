"""The command-buffer checks (C01, C21, C31): each rule on synthetic evidence either side of its thresholds, the
queue model by hand, the evidence as recorded, and pending when a GPU's results are missing."""

from __future__ import annotations

import pytest

from ref_impl import ledger
from ref_impl.ledger.dispatch import C21Evidence, C31Evidence, LaunchFloor, LayerEvalRun, SyncRun


def no_results(monkeypatch, tmp_path) -> None:
    """The ledger as a fresh clone without results/ would compute it: core.results reads an empty folder."""
    monkeypatch.setattr(ledger.core, "RESULTS_DIR", tmp_path)


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


def _fake_records(monkeypatch, rows):
    """rows: (label, backend, model, variant, metric, value) -> what dispatch_records returns for any experiment."""
    rec = {(lab, model, var, metric): {"value": v, "backend": b} for lab, b, model, var, metric, v in rows}
    monkeypatch.setattr(ledger.dispatch, "dispatch_records", lambda experiment: rec)


def test_c01_and_c21_are_pending_without_a_gpu_run(monkeypatch, tmp_path):
    _fake_records(monkeypatch, [("cpu", "cpu", "tiny", "layer_eval", "tokens_per_s", 120.0),
                                ("cpu", "cpu", "tiny", "per_token_graph", "tokens_per_s", 100.0),
                                ("cpu", "cpu", "tiny", "sync", "tokens_per_s", 90.0),
                                ("cpu", "cpu", "tiny", "async_eval", "tokens_per_s", 100.0)])
    for cid in ("C01", "C21"):
        v = ledger.check(cid, live=False)
        assert v.status == "pending" and "python -m ref_impl bench --dispatch" in v.summary, cid
    monkeypatch.undo()
    no_results(monkeypatch, tmp_path)
    for cid in ("C01", "C21", "C31"):
        assert ledger.check(cid, live=False).status == "pending", cid


def test_c31_recorded_latencies_are_all_above_a_microsecond():
    v = ledger.check("C31", live=False)
    per_kernel = [n.value for k, n in v.evidence.items() if k.startswith("µs per kernel")]
    assert v.status == "refuted" and per_kernel and min(per_kernel) > 1.0
    assert all(n.value > 4096 for k, n in v.evidence.items() if k.startswith("break-even"))
    assert not any(k.startswith("live") for k in v.evidence)


def test_c31_live_reading_is_shown_and_never_decides(monkeypatch):
    monkeypatch.setattr(ledger.dispatch, "measure_launch_floor", lambda: ("Device(gpu, 0)", ledger.Number(0.1, "µs")))
    v = ledger.check("C31", live=True)
    assert v.status == ledger.check("C31", live=False).status == "refuted"
    assert v.evidence["live: µs per kernel, one add on ≤ 4096 values (Device(gpu, 0))"].value == 0.1
    assert v.source.startswith("live")
