"""measure/layerlaunch.py: the fused layer's launch settings as data, applied and restored, and the "layer-launch"
records of one setting, on any backend (the fused kernels stood in for by MLX's matmuls off CUDA)."""

import mlx.core as mx
import mlx.nn as nn
import pytest

from ref_impl import kernels
from ref_impl.kernels import fusedlayer
from ref_impl.measure import layerlaunch
from ref_impl.measure.layerlaunch import Setting
from tests.test_kernels import layer_model, stand_in_kernels


def test_a_setting_names_what_it_changes():
    assert Setting().label == "defaults" and Setting().changed == {}
    s = Setting(warps={"attn_out": 16}, unroll={"attn_in": 2, "mlp_out": 2}, keys_per_split=32)
    assert s.changed == {"warps": {"attn_out": 16}, "unroll": {"attn_in": 2, "mlp_out": 2}, "keys_per_split": 32}
    assert s.label == "warps attn_out=16; unroll attn_in=2, mlp_out=2; keys_per_split 32"
    assert layerlaunch.SWEEP[0] == Setting() and len({x.label for x in layerlaunch.SWEEP}) == len(layerlaunch.SWEEP)


def test_applied_sets_the_tables_and_restores_them_even_on_error():
    tables = lambda: (dict(fusedlayer.WARPS), dict(fusedlayer.UNROLL), fusedlayer.ROWS_PER_WARP,
                      fusedlayer.KEYS_PER_SPLIT, fusedlayer.PREFETCH, fusedlayer.MERGE)
    before = tables()
    with pytest.raises(RuntimeError):
        setting = Setting(warps={"mlp_in": 4}, unroll={"attn_in": 8}, rows_per_warp=1, keys_per_split=32,
                          prefetch=not before[4], merge=("mlp",))
        with layerlaunch.applied(setting):
            assert fusedlayer.WARPS["mlp_in"] == 4 and fusedlayer.WARPS["attn_out"] == before[0]["attn_out"]
            assert fusedlayer.UNROLL["attn_in"] == (8, 8) and fusedlayer.UNROLL["mlp_in"] == before[1]["mlp_in"]
            assert (fusedlayer.ROWS_PER_WARP, fusedlayer.KEYS_PER_SPLIT, fusedlayer.PREFETCH) == (1, 32, not before[4])
            fields = layerlaunch.launch_fields(quantized=True)
            assert fields["unroll"]["attn_in"] == 8 and fields["warps"]["mlp_in"] == 4 and fields["rows_per_warp"] == 1
            assert fields["prefetch"] is not before[4] and fields["merge"] == ["mlp"] == list(fusedlayer.MERGE)
            assert Setting(merge=()).label == "merge none" and Setting(merge=("mlp",)).changed == {"merge": ["mlp"]}
            raise RuntimeError("a failed measurement")
    assert before == tables()
    dense, quantized = layerlaunch.launch_fields(False), layerlaunch.launch_fields(True)
    assert dense["unroll"] == {k: v[0] for k, v in fusedlayer.UNROLL.items()}
    assert quantized["unroll"] == {k: v[1] for k, v in fusedlayer.UNROLL.items()}


def test_mix_model_quantizes_as_a_q4_k_m_file_mixes():
    model = layerlaunch.mix_model("q4q8", "tiny", layers=1)
    layer = model.layers[0]
    assert len(model.layers) == 1 and not isinstance(model.embed_tokens, nn.QuantizedEmbedding)   # tiny ties its head
    assert (layer.self_attn.q_proj.bits, layer.self_attn.v_proj.bits, layer.mlp.down_proj.bits) == (4, 8, 8)
    assert layer.self_attn.q_proj.group_size == 32
    with pytest.raises(ValueError, match="q4q8 or F16"):
        layerlaunch.mix_model("Q4_K")


def test_a_setting_is_measured_as_its_records_say():
    """relaunch takes the tables as they stand; setting_records times every kernel and decode under the setting,
    records the launch that ran, and leaves the layers on today's launches."""
    with stand_in_kernels():
        model = layer_model(256, 8, 2, 512, "q4q8", layers=2)
        assert layerlaunch.fused_or_skipped("layer-launch", model, {"model": "m"}) == []
        with layerlaunch.applied(Setting(warps={"mlp_in": 4})):
            assert layerlaunch.relaunch(model) == 2 and model.layers[0].plan.threads["mlp_in"] == 4 * 32
        with layerlaunch.applied(Setting(int8=True, prefetch=False)):
            layerlaunch.relaunch(model, int8=True)
            attend = dict(model.layers[0].plan.templates["attend"])
            assert model.layers[0].plan.int8 and not attend["PF"] and Setting(int8=True).changed == {"int8": True}
        layerlaunch.relaunch(model)
        assert not model.layers[0].plan.int8 and dict(model.layers[0].plan.templates["attend"])["PF"]
        fields = {"model": "m", "weights": "q4q8", "kv": "f16", "context": 24}
        recs = layerlaunch.setting_records(model, Setting(warps={"mlp_in": 4}), fields, context=24, tokens=4)
        assert model.layers[0].plan.threads["mlp_in"] == fusedlayer.WARPS["mlp_in"] * 32
    assert recs[0]["metric"] == "tokens_per_s" and recs[0]["value"] > 0
    assert [r["kernel"] for r in recs[1:]] == list(fusedlayer.STAGES)      # no pair merged by default
    assert all(r["variant"] == "warps mlp_in=4" and r["launch"]["warps"]["mlp_in"] == 4 for r in recs)
    assert all(r["changed"] == {"warps": {"mlp_in": 4}} and r["experiment"] == "layer-launch" for r in recs)
    assert all(r["gb_per_s"] == pytest.approx(r["bytes_per_token"] / r["value"] / 1e6) for r in recs[1:])


def test_a_model_the_fused_layer_cannot_run_is_one_skipped_record():
    model = layer_model(256, 8, 2, 512, "q4g64", dtype=mx.float32, layers=2)   # float32: never fused
    (rec,) = layerlaunch.fused_or_skipped("layer-launch", model, {"model": "m", "weights": "q4q8"})
    assert rec["metric"] == "skipped" and rec["note"].startswith("0 of 2 layers fused; layer 0: ")


@pytest.mark.skipif(kernels.on_cuda(), reason="checks the skip off CUDA")
def test_off_cuda_the_sweep_is_one_skipped_record(monkeypatch):
    monkeypatch.setattr(layerlaunch, "mix_model", lambda *a, **k: pytest.fail("off CUDA nothing is built"))
    (rec,) = layerlaunch.bench_layer_launches()
    assert rec["experiment"] == "layer-launch" and rec["metric"] == "skipped"
    assert "needs MLX's CUDA backend" in rec["note"]


def test_bench_weights_names_pick_the_probes_mixes():
    assert layerlaunch.mixes(["F16", "Q4_K"]) == ("q4q8", "F16")     # bench's default: both, in MIXES' order
    assert layerlaunch.mixes(["F16"]) == ("F16",)
    assert layerlaunch.mixes(["Q4_K_M", "q4q8"]) == ("q4q8",)
    with pytest.raises(ValueError, match="'Q8_0'.*F16 or a 4-bit K-quant"):
        layerlaunch.mixes(["F16", "Q8_0"])
