"""measure/ncu.py: Nsight Compute's CSV pages turned into "ncu-kernel" and "ncu-stall" records, from made-up
exports and the committed SASS page of the reference H200 (ncu itself needs an NVIDIA GPU)."""

import json
import lzma

import pytest

from ref_impl import RESULTS_DIR, kernels
from ref_impl.measure import ncu

KERNEL = "custom_kernel_ref_layer_mlp_in_c7e43ce5f2_18448_float16_t_8_4_32_2_2_0(const __half *, __half *)"
HEAD = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
        '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"\n')
DETAILS = ("==PROF== Connected to process 1\nq4q8 {}\n==PROF== Disconnected from process 1\n" + HEAD
           + f'"0","1","python3","h","{KERNEL}","1","14","(256, 1, 1)","(896, 1, 1)","0","9.0",'
             '"GPU Speed Of Light Throughput","Elapsed Cycles","cycle","89,748"\n'
           + f'"0","1","python3","h","{KERNEL}","1","14","(256, 1, 1)","(896, 1, 1)","0","9.0",'
             '"Memory Workload Analysis","Local Memory Spilling Request Overhead","%","no data"\n'
           + f'"1","1","python3","h","{KERNEL}","1","14","(256, 1, 1)","(896, 1, 1)","0","9.0",'
             '"Scheduler Statistics","Issued Warp Per Scheduler","","0.51"\n')

SASS_HEAD = ('"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
             '"Instructions Executed"\n')


def sass_table(name: str, rows: list[tuple[str, int, int]]) -> str:
    """One kernel's source page as ncu exports it: the kernel's name line, then its instructions."""
    body = "".join(f'"0x{i:x}","      {src}","{samples}","0","{executed}"\n' for i, (src, samples, executed)
                   in enumerate(rows))
    return f'"Kernel Name","{name}"\n' + SASS_HEAD + body


def test_metric_records_read_the_details_page():
    fields = {"model": "Llama-3.1-8B", "weights": "q4q8", "kv": "f16", "context": 256}
    a, b = ncu.metric_records(DETAILS, fields)               # "no data" is no number: left out
    assert (a["metric"], a["unit"], a["value"], a["kernel"], a["launch_id"]) == ("Elapsed Cycles", "cycle", 89748,
                                                                                   "mlp_in", 0)
    assert a["section"] == "GPU Speed Of Light Throughput" and a["experiment"] == "ncu-kernel"
    assert (b["metric"], b["unit"], b["value"], b["launch_id"]) == ("Issued Warp Per Scheduler", None, 0.51, 1)
    assert ncu.metric_records("ncu failed before any CSV", fields) == []


def test_stall_records_keep_each_kernels_most_sampled_instructions_in_order():
    rows = [("LDG.E R21, desc[UR10][R16.64]", 1, 96), ("HADD2.F32 R19, -RZ, R7.H0_H0", 60, 192),
            ("IMAD R11, R11, 0x8, R2", 30, 96), ("EXIT", 9, 96)]
    text = "==PROF== noise\n" + sass_table("mlx::core::cu::custom_kernel_ref_layer_attn_in_1(const __half *)", rows)
    total, *top = ncu.stall_records(text, {"weights": "q4q8"}, top=2)
    assert (total["metric"], total["value"], total["instructions"]) == ("stall_samples", 100, 4)
    assert total["kernel"] == "attn_in"
    assert [(r["index"], r["value"], r["executed"]) for r in top] == [(1, 60.0, 192), (2, 30.0, 96)]
    assert top[0]["sass"] == "HADD2.F32 R19, -RZ, R7.H0_H0" and top[0]["stall_samples"] == 60
    assert top[0]["load_before"] == {"index": 0, "sass": "LDG.E R21, desc[UR10][R16.64]"}


def test_the_committed_stall_records_are_the_committed_sass_page_read_again():
    """The H200's stall run: its records (results/h200-20261202-062700.json) are ncu.stall_records of the SASS page
    ncu exported then (results/h200-20261202-062700-ncu_sass.csv.xz)."""
    doc = json.loads((RESULTS_DIR / "h200-20261202-062700.json").read_text())
    fields = {k: doc["records"][0][k] for k in ("model", "weights", "kv", "context", "layers")}
    again = ncu.stall_records(lzma.open(RESULTS_DIR / doc["transcribed_from"], "rt").read(), fields)
    assert again == doc["records"]
    assert {r["kernel"] for r in again} == set(ncu.STALL_KERNELS)


def test_a_mix_is_profiled_past_the_warm_up_with_the_sections(monkeypatch, tmp_path):
    """weights_records asks ncu for one step's launches of the first two layers after two steps, then reads the
    report's details page (and, for stalls, attn_in and mlp_in of layer 0 in the third step, and its SASS page)."""
    calls = []

    def fake(args, timeout_s=600):
        calls.append(list(args))
        if "details" in args:
            return DETAILS
        if "source" in args:
            return sass_table("custom_kernel_ref_layer_mlp_in_2", [("HADD2.F32 R1, -RZ, R2.H0_H0", 5, 7168)])
        return ""
    monkeypatch.setattr(ncu, "run_ncu", fake)
    recs = ncu.weights_records("q4q8", tmp_path, stalls=True, say=lambda msg: None)
    profile, details, sass_profile, sass = calls
    # 2 steps x 4 layers x 5 launches (no pair merged), then one step of the first 2 layers
    assert profile[:6] == ["-k", "regex:ref_layer", "--launch-skip", "40", "--launch-count", "10"]
    assert "--section" in profile and "SpeedOfLight" in profile and "decode_target('q4q8')" in profile[-1]
    assert details[:2] == ["-i", str(tmp_path / "ncu-q4q8.ncu-rep")] and "--csv" in details
    assert sass_profile[:6] == ["-k", "regex:ref_layer_(attn_in|mlp_in)", "--launch-skip", "16", "--launch-count", "2"]
    assert ["--set", "full"] == sass_profile[6:8] and "sass" in sass
    assert {r["experiment"] for r in recs} == {"ncu-kernel", "ncu-stall"}
    assert all(r["weights"] == "q4q8" and r["layers"] == ncu.LAYERS for r in recs)


@pytest.mark.skipif(kernels.on_cuda(), reason="checks the skip off CUDA")
def test_off_cuda_ncu_is_one_skipped_record(monkeypatch, tmp_path):
    monkeypatch.setattr(ncu, "run_ncu", lambda *a, **k: pytest.fail("off CUDA ncu is not run"))
    (rec,) = ncu.bench_ncu(tmp_path)
    assert rec["experiment"] == "ncu-kernel" and rec["metric"] == "skipped" and "CUDA" in rec["note"]
