"""The command-buffer checks (C01, C21, C31): the queue model by hand, verdicts on faked and recorded results."""

from __future__ import annotations

import pytest

from ref_impl import ledger


def no_results(monkeypatch, tmp_path) -> None:
    """The ledger as a fresh clone without results/ would compute it: core.results reads an empty folder."""
    monkeypatch.setattr(ledger.core, "RESULTS_DIR", tmp_path)


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
    monkeypatch.setattr(ledger.dispatch, "dispatch_records", lambda experiment: rec)


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
