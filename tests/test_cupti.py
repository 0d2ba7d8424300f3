"""measure/cupti.py: CUPTI's kernel times turned into "kernel-profile" records, from made-up profiler events (no
GPU needed)."""

from types import SimpleNamespace

import pytest

from ref_impl import kernels
from ref_impl.measure import cupti

MLX_GEMV = "void mlx::core::cu::gemv_single<__half, 8, 4>(__half const*, __half const*, __half*, int, int)"
ATTN_IN = "custom_kernel_ref_layer_attn_in_6fa3f4ddcb_18448_float16_t_8_4_32_4_32_8_32_128_t_2_0"


def test_kernel_name_shortens_ours_and_cuts_the_rest():
    assert cupti.kernel_name(ATTN_IN) == "attn_in"
    assert cupti.kernel_name("custom_kernel_ref_layer_mlp_out_03347d3bad_64528_float16_t_8") == "mlp_out"
    assert cupti.kernel_name(MLX_GEMV) == MLX_GEMV[:cupti.NAME_CHARS]


def test_busy_time_is_the_union_of_the_kernels_intervals():
    events = [cupti.KernelEvent("a", 0, 10), cupti.KernelEvent("b", 5, 15), cupti.KernelEvent("c", 20, 30),
              cupti.KernelEvent("d", 22, 25)]
    assert cupti.busy_us(events) == 25            # 0-15 and 20-30
    assert cupti.busy_us([]) == 0


def test_profile_records_per_token_and_per_kernel():
    """Two tokens: attn_in twice a token (10 us each), MLX's GEMV once (100 us); the GPU idle in between."""
    events = []
    for t in range(2):
        start = 1000 * t
        events += [cupti.KernelEvent(ATTN_IN, start, start + 10), cupti.KernelEvent(ATTN_IN, start + 10, start + 20),
                   cupti.KernelEvent(MLX_GEMV, start + 50, start + 150)]
    fields = {"model": "m", "weights": "q4q8", "kv": "f16", "context": 8, "variant": "fused", "setting": "defaults"}
    recs = cupti.profile_records(events, tokens=2, wall_s=2e-3, fields=fields)
    assert all(r["experiment"] == "kernel-profile" and r["setting"] == "defaults" for r in recs)
    by = {(r["metric"], r.get("kernel")): r for r in recs}
    assert by["tokens_per_s", None]["value"] == pytest.approx(1000)
    assert by["wall_ms_per_token", None]["value"] == pytest.approx(1.0)
    assert by["busy_ms_per_token", None]["value"] == pytest.approx(0.12)    # (20 + 100) us a token
    gemv = MLX_GEMV[:cupti.NAME_CHARS]
    assert by["us_per_call", "attn_in"]["value"] == 10 and by["us_per_call", "attn_in"]["calls_per_token"] == 2
    assert by["ms_per_token", "attn_in"]["value"] == pytest.approx(0.02)
    assert by["us_per_call", gemv]["value"] == 100 and by["ms_per_token", gemv]["value"] == pytest.approx(0.1)
    kernels_in_order = [r["kernel"] for r in recs if r["metric"] == "ms_per_token"]
    assert kernels_in_order == [gemv, "attn_in"]                   # most time a token first


def test_kernel_events_keep_the_device_kernels_only():
    def event(name, kind, device_us, start, end):
        return SimpleNamespace(name=name, device_type=SimpleNamespace(name=kind), device_time_total=device_us,
                               time_range=SimpleNamespace(start=start, end=end))
    prof = SimpleNamespace(events=lambda: [event(ATTN_IN, "CUDA", 10, 0, 10), event("cudaLaunchKernel", "CPU", 0, 0, 3),
                                           event("cudaMemset", "CUDA", 0, 11, 11)])
    assert cupti.kernel_events(prof) == [cupti.KernelEvent(ATTN_IN, 0, 10)]


def test_the_settings_start_with_todays_defaults():
    assert all(settings[0].label == "defaults" for settings in cupti.SETTINGS.values())
    assert all({"merge": ["attention"]} in [s.changed for s in settings] for settings in cupti.SETTINGS.values())


@pytest.mark.skipif(kernels.on_cuda(), reason="checks the skip off CUDA")
def test_off_cuda_the_profile_is_one_skipped_record(monkeypatch):
    monkeypatch.setattr(cupti, "mix_model", lambda *a, **k: pytest.fail("off CUDA nothing is built"))
    (rec,) = cupti.bench_kernel_profile()
    assert rec["experiment"] == "kernel-profile" and rec["metric"] == "skipped" and rec["value"] is None
    assert "needs MLX's CUDA backend" in rec["note"]
