"""The readers of the GPU probes' logs (measure/profiles.py): hand-written snippets in each log's format, and the
committed logs the chapters read."""

import pytest

from ref_impl.measure import profiles

PROFILE = """0.32.4 Device(gpu, 0)
f16 unfused (MLX built-ins): 150.0 tok/s, wall 6.67 ms/token, GPU busy 5.00 ms/token (1 s)
    void mlx::core::cu::gemv_single<__half, 8, 4>(__half const*,    1.0/token x   230.5 us = 0.231 ms
    void mlx::core::cu::rope_single<__half, true, true>(__half c   64.0/token x     3.5 us = 0.224 ms
f16 fused W {} U {}: 200.0 tok/s, wall 5.00 ms/token, GPU busy 4.75 ms/token (0 s)
    mlp_in                                     32.0/token x    60.0 us = 1.920 ms
f16 fused W {} U {}: 100.0 tok/s, wall 10.00 ms/token, GPU busy 9.00 ms/token (0 s)
    mlp_in                                     32.0/token x   120.0 us = 3.840 ms
"""

LOOPS = """q4q8 fuse: {} kernels/token 164
q4q8 L 2 P 4 U {'attn_in': (4, 2)}: 195.0 tok/s, wall 5.13, GPU busy 4.82 ms/token, logits err 2.3e-03 (12 s)
    us/call: attn_in  32.7  attend  15.7  mlp_out  32.4
"""

NCU = """==PROF== Disconnected from process 1
  custom_kernel_ref_layer_mlp_in_c7e43ce5f2_18448_float16_t(const __half *) (896, 1, 1)x(256, 1, 1), Context 1
    Section: GPU Speed Of Light Throughput
    ----------------------- ----------- ------------
    Metric Name             Metric Unit Metric Value
    ----------------------- ----------- ------------
    Elapsed Cycles                cycle       89,748
    Memory Throughput                 %        26.20
    Duration                         us        60.03
    Section: Memory Workload Analysis
    Memory Throughput                          Tbyte/s         1.26
    Issued Warp Per Scheduler                        0.51
    OPT   This workload exhibits low compute throughput and memory bandwidth utilization relative to the peak
  custom_kernel_ref_layer_attend_6cec0a3f59_16640_float16_t(const __half *) (32, 1, 1)x(256, 1, 1), Context 1
    Duration                         us        20.77
"""

STALLS = """attn_in: 4840 SASS instructions, 2606 warp stall samples; the 8 most sampled:
  #258    39.5% of samples, executed   6144 times: HADD2.F32 R19, -RZ, R7.H0_H0; the nearest load before it: #255 LDG.E
  #4138   13.5% of samples, executed   3072 times: IMAD R11, R11, 0x8, R2
mlp_in: 3224 SASS instructions, 5030 warp stall samples; the 8 most sampled:
  #132    22.9% of samples, executed  14336 times: HADD2.F32 R18, -RZ, R16.H0_H0
"""


def test_cupti_tokens_reads_each_setting_once_with_its_kernels(tmp_path):
    path = tmp_path / "h200-1-fused_profile.log"
    path.write_text(PROFILE)
    tokens = profiles.cupti_tokens(path)
    assert list(tokens) == [("f16", "unfused (MLX built-ins)"), ("f16", "fused W {} U {}")]
    mlx = tokens["f16", "unfused (MLX built-ins)"]
    assert (mlx.wall_ms, mlx.busy_ms) == (6.67, 5.0) and len(mlx.us) == 2 and mlx.error is None
    fused = tokens["f16", "fused W {} U {}"]
    assert fused.us == {"mlp_in": 60.0} and fused.ms == {"mlp_in": 1.92}      # the first of the repeated setting
    assert profiles.kernel_us(path, "void mlx::core::cu::gemv_single<__half") == 230.5
    with pytest.raises(ValueError, match="no kernel named"):
        profiles.kernel_us(path, "void mlx::core::cu::qmv")


def test_loop_tokens_reads_the_settings_and_times_a_call(tmp_path):
    path = tmp_path / "h200-1-fused_loops.log"
    path.write_text(LOOPS)
    ((key, token),) = profiles.loop_tokens(path).items()
    assert key == ("q4q8", 2, 4, "{'attn_in': (4, 2)}")
    assert token.us == {"attn_in": 32.7, "attend": 15.7, "mlp_out": 32.4} and token.busy_ms == 4.82
    assert token.error == 2.3e-3 and token.ms == {}


def test_ncu_kernels_names_the_kernels_and_keeps_units_apart(tmp_path):
    path = tmp_path / "h200-1-ncu_fused_q4q8.log"
    path.write_text(NCU)
    (name, m), (name2, m2) = profiles.ncu_kernels(path)
    assert (name, name2) == ("mlp_in", "attend")
    assert m["Memory Throughput (%)"] == 26.2 and m["Memory Throughput (Tbyte/s)"] == 1.26
    assert m["Elapsed Cycles (cycle)"] == 89748 and m["Issued Warp Per Scheduler"] == 0.51
    assert m2 == {"Duration (us)": 20.77}


def test_ncu_stalls_by_kernel(tmp_path):
    path = tmp_path / "h200-1-ncu_stalls.log"
    path.write_text(STALLS)
    stalls = profiles.ncu_stalls(path)
    assert [s[:2] for s in stalls["attn_in"]] == [(39.5, 6144), (13.5, 3072)]
    assert stalls["mlp_in"][0][2] == "HADD2.F32 R18, -RZ, R16.H0_H0"


def test_newest_names_what_is_missing(tmp_path):
    (tmp_path / "h200-20260101-fused_loops.log").write_text(LOOPS)
    (tmp_path / "h200-20260102-fused_loops.log").write_text(LOOPS)
    assert profiles.newest("h200-*-fused_loops.log", tmp_path).name == "h200-20260102-fused_loops.log"
    with pytest.raises(FileNotFoundError, match="ncu"):
        profiles.newest("h200-*-ncu_stalls.log", tmp_path)


def test_the_committed_probe_logs_read():
    """What the chapters read is there: both models of the CUPTI profile, every resident-loop setting of both
    models, ten kernel launches in each Nsight Compute report, two kernels' stalls."""
    tokens = profiles.cupti_tokens(profiles.newest("h200-*-fused_profile.log"))
    assert {m for m, _ in tokens} == {"q4q8", "f16"}
    loops = profiles.loop_tokens(profiles.newest("h200-*-fused_loops.log"))
    assert {m for m, *_ in loops} == {"q4q8", "f16"} and all(len(t.us) == 5 for t in loops.values())
    for model in ("q4q8", "f16"):
        launches = profiles.ncu_kernels(profiles.newest(f"h200-*-ncu_fused_{model}.log"))
        assert len(launches) == 10 and all("Duration (us)" in m for _, m in launches)
    assert set(profiles.ncu_stalls(profiles.newest("h200-*-ncu_stalls.log"))) == {"attn_in", "mlp_in"}
