"""The roofline chapter's checks (C04, C14, C26, C27): each rule on synthetic evidence on both sides of its
thresholds (RULE_CASES, run by test_ledger.py), the arithmetic worked by hand, the recorded sweep it reads,
and live timings that never decide a status."""

from __future__ import annotations

import ast
import dataclasses
import json
import math
from pathlib import Path

import pytest

from ref_impl import ledger
from ref_impl.ledger import roofline as rf
from ref_impl.measure import decode, records
from ref_impl.measure.decode import ForwardTiming, MatmulTiming
from ref_impl.theory import roofline, shapes

LLAMA = shapes.PUBLIC["Llama-3.1-8B"]
LENGTHS = (128, 512, 2048, 8192, 32768)
# The reference H200's recorded sweep of Llama-3.1-8B's shape (its reference "ttft" and "itl" run,
# results/h200-20261129-132359.json), rounded: synthetic evidence with the real numbers' shape.
H200_TTFT = dict(zip(LENGTHS, (19.1, 28.4, 56.1, 247.8, 1359.4)))
H200_STEP = dict(zip(LENGTHS, (7.02, 4.97, 4.75, 7.22, 11.54)))
H200_PEAK = 989.5


def sweep(ttft: dict[int, float], step: dict[int, float], peak: float | None = H200_PEAK) -> rf.Sweep:
    """A sweep of Llama-3.1-8B's shape with the given TTFT and decode steps (ms), its arithmetic computed."""
    return rf.Sweep("gpu", "results/synthetic.json", LLAMA.name, ttft, step,
                    {n: roofline.prefill_flops(LLAMA, n) for n in ttft}, {n: rf.attention_share(LLAMA, n) for n in ttft},
                    {n: rf.model_intensity(LLAMA, n) for n in ttft}, 57_255, "H200 SXM" if peak else "", peak)


def at_rate(share_of_peak: float) -> dict[int, float]:
    """TTFT (ms) of prompts that run at a fixed share of the H200's dense peak: in proportion to the FLOPs."""
    return {n: roofline.prefill_flops(LLAMA, n) / (share_of_peak * H200_PEAK * 1e12) * 1e3 for n in LENGTHS}


FLAT_STEP = dict.fromkeys(LENGTHS, 5.0)
GEMV = rf.GemvEvidence({"M": (0.998, 1.0)}, {"M": (3.52, 3.55)}, {"H200 SXM": 206.1, "RTX 5090": 116.9})
PREFILL = rf.PrefillEvidence(LLAMA.name, 104, {"H200 SXM": (206.1, 224), "RTX 5090": (116.9, 123)},
                             (sweep(H200_TTFT, H200_STEP),))
LOW_RIDGES = {"a GPU with a low ridge": (90.0, 94)}     # synthetic: a ridge under the claim's 100 FLOP/byte
SCALING = rf.ScalingEvidence((sweep(H200_TTFT, H200_STEP),), {16: 122_532, 4.5: 34_462})
BUS = rf.BusEvidence(7.8, (85.0, 92.0), (0.80, 0.85), {"RTX 5090": 1792.0}, (28.0, 48.0), 512, 0.87)

RULE_CASES = {
    "C27": [
        (GEMV, "qualified"),                                                     # ~1 at 16 bits only
        (dataclasses.replace(GEMV, at_q4k={"M": (0.9, 1.2)}), "confirmed"),      # ~1 at 4.5 bits too
        (dataclasses.replace(GEMV, at16={"M": (1.6, 2.0)}), "refuted"),          # not approx. 1 at 16 bits
        (dataclasses.replace(GEMV, ridges={"a slow-ALU GPU": 3.0}), "refuted"),  # a 4.5-bit GEMV reaches the ridge
    ],
    "C26": [
        (PREFILL, "refuted"),                                                    # ridges over 100; short prompts idle
        (dataclasses.replace(PREFILL, ridges=LOW_RIDGES), "refuted"),            # the recorded short prompts alone
        (dataclasses.replace(PREFILL, sweeps=(sweep(at_rate(0.6), FLAT_STEP),)), "refuted"),   # the ridges alone
        (dataclasses.replace(PREFILL, ridges=LOW_RIDGES, sweeps=(sweep(at_rate(0.6), FLAT_STEP),)), "qualified"),
    ],
    "C14": [
        (SCALING, "qualified"),                                                  # the H200's sweep
        (dataclasses.replace(SCALING, sweeps=(sweep(at_rate(0.5), FLAT_STEP),)), "confirmed"),
        (dataclasses.replace(SCALING, sweeps=(sweep(dict.fromkeys(LENGTHS, 20.0), FLAT_STEP),)), "refuted"),
        (dataclasses.replace(SCALING, sweeps=(sweep(at_rate(0.5), {c: 1e-3 * c for c in LENGTHS}),)), "refuted"),
    ],
    "C04": [
        (BUS, "qualified"),                                                      # fits a ~0.8-0.9 TB/s card, not the 5090
        (dataclasses.replace(BUS, tokens=(400.0, 450.0)), "refuted"),            # more than any GDDR7 bus gives
        (dataclasses.replace(BUS, cards={"a 256-bit card at 28 Gbps": 896.0}), "not testable here"),
    ],
}


def no_results(monkeypatch, tmp_path) -> None:
    """The ledger as a fresh clone without results/ would compute it: the selector reads an empty folder."""
    monkeypatch.setattr(ledger.core, "RESULTS_DIR", tmp_path)


# ---- the recorded sweep and the rules on it --------------------------------------------------------

def test_the_recorded_h200_sweep_is_read_with_its_arithmetic():
    [s] = [s for s in rf.forward_sweeps() if s.machine == "h200" and s.model == LLAMA.name]
    assert sorted(s.ttft_ms) == list(LENGTHS) and sorted(s.step_ms) == list(LENGTHS)
    run = records.reference("ttft", "h200", metric="ttft_ms", peer=None)
    assert s.gpu == "H200 SXM" and s.peak_tflops == H200_PEAK and s.source == run.caption
    assert s.ttft_ms == pytest.approx(H200_TTFT, abs=0.06) and s.step_ms == pytest.approx(H200_STEP, abs=0.01)
    assert s.intensity[128] == pytest.approx(rf.model_intensity(LLAMA, 128))        # F16 weights: 16 bits
    assert rf.attention_share(LLAMA, s.attention_half) >= 0.5 > rf.attention_share(LLAMA, s.attention_half - 1)


def test_c14_and_c26_read_the_recorded_sweep_and_are_pending_without_it(monkeypatch, tmp_path):
    for cid in ("C14", "C26"):
        v = ledger.check(cid, live=False)
        assert v.source.startswith("h200, ") and "(results/h200-" in v.source, cid      # the run's caption
        assert any("on h200" in k for k in v.evidence), cid
    no_results(monkeypatch, tmp_path)
    for cid in ("C14", "C26"):
        v = ledger.check(cid, live=False)
        assert v.status == "pending" and "bench --dispatch --shapes" in v.summary, cid
    for cid in ("C04", "C27"):                      # tables and arithmetic only: never pending
        assert ledger.check(cid, live=False).status != "pending", cid


def test_c26_finds_the_recorded_short_prompts_below_half_the_peak():
    v = rf.judge_c26(PREFILL)
    share = {n: v.evidence[f"{LLAMA.name}, {n:,}-token prefill on gpu: share of the H200 SXM's dense peak"].value
             for n in LENGTHS}
    assert share[128] < 50 and share[512] < 50 and all(share[n] > 50 for n in (2048, 8192, 32768))
    assert "10% and 28% busy" in v.summary and "from 2,048 tokens on" in v.condition


def test_c14_names_where_each_half_holds_on_the_h200_sweep():
    v = rf.judge_c14(SCALING)
    assert "2,048-32,768 tokens" in v.condition and "but not at 128 and 512" in v.summary
    # decode step = a + b c by least squares on relative error; the context part passes the flat part near 26k
    a = v.evidence["Llama-3.1-8B on gpu: decode step's fitted flat part"].value
    b = v.evidence["Llama-3.1-8B on gpu: decode step's fitted context part"].value * 1e-6
    assert 8192 < a / b < 32768 and "~26,000 tokens" in v.condition


# ---- arithmetic by hand -----------------------------------------------------------------------------

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


def test_c04_buses_that_fit_by_hand():
    # a GDDR7 device has 32 pins: 112 GB/s at 28 Gbps, 192 at 48. 780-897 GB/s needs 5 (560-960) to 8
    # (896-1536) devices; 4 give at most 768, 9 at least 1008. A 256-bit bus fits only at 28.0 Gbps (896 GB/s).
    v = rf.judge_c04(BUS)
    assert "buses of 5-8 GDDR7 devices (160-256 bits)" in v.summary and "a 256-bit one at 28.0 Gbps" in v.summary
    assert "RTX 5090 (1,792 GB/s) at that utilization would give 184-195 tok/s" in v.summary


def test_c27_gemv_intensity_and_ridge_points_by_hand():
    ev = ledger.check("C27", live=False).evidence
    # 4096 x 4096 GEMV at 16 bits: 2 * 4096^2 FLOPs / (2 * 4096^2 + 2 * 8192 bytes) = 1 / (1 + 1/2048)
    assert roofline.matmul_intensity(1, 4096, 4096, 16) == pytest.approx(2048 / 2049)
    models = "Llama-3.2-1B, Llama-3.1-8B, Qwen3-32B"
    assert 0.99 < ev[f"lowest GEMV intensity, 16-bit, any matrix of {models}"].value < 1.0
    assert ev["ridge point, H200 SXM"].value == pytest.approx(989.5 / 4.8)     # 206 FLOP/byte
    # at 4.5 bits a k x m weight matrix is 4.5 / 16 of the bytes: about 16 / 4.5 = 3.56 FLOP/byte
    assert ev["highest GEMV intensity at Q4_K's 4.5 bits/weight"].value == pytest.approx(16 / 4.5, rel=0.01)
    # the ALUs are busy at most 3.55 / 116.9 = 3.0% of the time (the RTX 5090's ridge is the lowest)
    assert ev["most the ALUs can be busy (highest GEMV over the RTX 5090's ridge)"].value == pytest.approx(3.04, abs=0.01)


def test_c26_prompt_lengths_are_the_first_to_pass_their_threshold():
    for threshold in [100] + [roofline.ridge_point(hw) for hw in rf.RIDGED]:
        n = rf.tokens_to_reach(LLAMA, threshold)
        assert rf.model_intensity(LLAMA, n - 1) <= threshold < rf.model_intensity(LLAMA, n)


def test_attention_share_by_hand():
    # Llama-3.1-8B, 8192-token prompt: attention 4 * 32 heads * 128 * 32 layers * (8192 * 8193 / 2) FLOPs,
    # matmuls 2 * 7,504,658,432 * 8192
    att = 4 * 32 * 128 * 32 * 8192 * 8193 / 2
    assert rf.attention_share(LLAMA, 8192) == pytest.approx(att / (att + 2 * 7_504_658_432 * 8192))


def test_fit_terms_recovers_flat_linear_and_quadratic_terms():
    lengths = tuple(2**i for i in range(10))
    seconds = tuple(0.01 + 1e-3 * n + 1e-6 * n * n for n in lengths)
    assert rf.fit_terms(lengths, seconds, 2) == pytest.approx((0.01, 1e-3, 1e-6), rel=1e-6)
    assert rf.fit_terms(lengths, [2 + 0.5 * n for n in lengths], 1) == pytest.approx((2, 0.5))


def test_listed_and_spans_read_as_text():
    assert rf.listed(["10%"]) == "10%" and rf.listed(["a", "b"]) == "a and b" and rf.listed(["a", "b", "c"]) == "a, b and c"
    assert rf.spans([512, 128]) == "128 and 512" and rf.spans([2048, 8192, 32768]) == "2,048-32,768"


# ---- live timings are shown, never decide ---------------------------------------------------------------

MATMUL = MatmulTiming("a test machine", (8192, 4096), 256, (0.05, 0.06, 0.07), (1.0, 1.1, 1.2), (5.0, 5.5, 6.0),
                      (20.0, 25.0, 30.0))
FORWARD = ForwardTiming(shapes.PUBLIC["Llama-3.2-1B"], (1, 2, 4, 8), ((0.01, 0.011, 0.012),) * 3 + ((0.02,) * 3,),
                        (16, 412), ((0.01, 0.02), (0.011, 0.012)))


@pytest.mark.parametrize("cid, live", [("C27", MATMUL), ("C26", MATMUL), ("C14", FORWARD)])
def test_live_timings_are_reported_with_their_spread_but_do_not_decide(cid, live):
    judge = ledger.CLAIMS[cid].judge
    for evidence, status in RULE_CASES[cid]:
        v = judge(dataclasses.replace(evidence, live=live))
        assert v.status == status and v.source.startswith("live")
        spread = [n for k, n in v.evidence.items() if k.startswith("live") and n.rounds > 1]
        assert spread and all(n.low <= n.value <= n.high for n in spread)


def test_matmul_rates_are_medians_of_the_repeats():
    r = rf.matmul_rates(MATMUL)
    nbytes = 4 * 8192 * 4096
    assert r["gemv_gbs"].value == pytest.approx(nbytes / 0.06 / 1e9) and r["gemv_gbs"].rounds == 3
    assert r["gemm_gflops"].low == pytest.approx(2 * 8192 * 4096 * 256 / 1.2 / 1e9)


def test_the_live_readings_come_from_measure_and_run_once():
    """gather calls measure.decode's functions (the ledger times nothing itself), each once per process: a small
    matmul, timed, gives 10 GEMV samples, `rounds` GEMM samples and `rounds` readings of this machine's roofs."""
    assert rf.measure_matmul is decode.measure_matmul and rf.measure_forward is decode.measure_forward
    m = decode.measure_matmul(rows=256, cols=128, tokens=8, rounds=3)
    assert decode.measure_matmul(rows=256, cols=128, tokens=8, rounds=3) is m
    assert (m.shape, m.tokens, len(m.gemv_s), len(m.gemm_s), len(m.copy_gbs)) == ((256, 128), 8, 10, 3, 3)
    assert all(t > 0 for t in m.gemv_s + m.gemm_s) and all(g > 0 for g in m.copy_gbs + m.peak_gflops)


def test_the_ledger_module_measures_nothing():
    """No clock, no timing module, no measuring function, no cache: the chapter's ledger module only judges."""
    tree = ast.parse(Path(rf.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not imported & {"time", "timing", "clock", "functools", "blas"} and "ref_impl.platform.timing" not in modules
    defined = [n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    assert not [name for name in defined if name.startswith("measure") or name.endswith("Timing")]


def write_run(folder, label: str, stamp: str, recs: list[dict], gpu: str | None = "NVIDIA H200") -> str:
    """A results file of `recs` on machine `label`, dated 1-9 Dec 2026 by `stamp`; its name."""
    name = f"{label}-2026120{stamp}-000000.json"
    doc = {"schema": 1, "date": f"2026-12-0{stamp}T00:00:00+00:00", "git": stamp * 7, "command": "bench",
           "machine": {"label": label, "gpu": gpu, "backend": "cuda" if gpu else "cpu"}, "records": recs}
    (folder / name).write_text(json.dumps(doc))
    return name


def sweep_recs(scale: float) -> list[dict]:
    """A bench --dispatch --shapes run of Llama-3.1-8B's shape: TTFT and decode steps at three lengths."""
    return [records.record(e, m, "ms", scale * n / 128, model=LLAMA.name, weights="F16", kv="f16", context=n)
            for n in (128, 512, 2048) for e, m in (("ttft", "ttft_ms"), ("itl", "itl_p50_ms"))]


def test_the_newest_complete_run_of_each_machine_is_read(monkeypatch, tmp_path):
    """Two runs per machine and a newer broken one: the sweep and the C04 analog come from the newest complete
    run of each machine (never from an older one, nor from one with a NaN), named by its caption."""
    write_run(tmp_path, "gpu", "1", sweep_recs(1.0))
    newest = write_run(tmp_path, "gpu", "2", sweep_recs(2.0))
    write_run(tmp_path, "gpu", "3", sweep_recs(math.nan))
    shape = [records.record("decode-shape", m, u, v, model=LLAMA.name, weights="F16")
             for m, u, v in (("tokens_per_s", "tok/s", 100.0), ("bytes_per_token", "B", 16e9))]
    write_run(tmp_path, "gpu", "4", shape)
    faster = [dict(r, value=150.0) if r["metric"] == "tokens_per_s" else r for r in shape]
    analog = write_run(tmp_path, "gpu", "5", faster)
    write_run(tmp_path, "gpu", "6", [dict(r, value=math.nan) for r in shape])
    monkeypatch.setattr(ledger.core, "RESULTS_DIR", tmp_path)
    [s] = rf.forward_sweeps()
    assert s.machine == "gpu" and newest in s.source and s.source.startswith("gpu, 2 Dec 2026, commit 2222222")
    assert s.ttft_ms == {128: 2.0, 512: 8.0, 2048: 32.0} and s.step_ms == s.ttft_ms
    label, source, achieved, sheet = rf.decode_analog()
    assert (label, sheet) == ("gpu", roofline.HARDWARE["H200 SXM"].bandwidth_gbs) and analog in source
    assert achieved == pytest.approx(150.0 * 16)                       # GB/s: tok/s x bytes per step
