"""The benchmark runs our decoder and both peers on the same weights, and they agree."""

from __future__ import annotations

import json
import math
from pathlib import Path

import mlx.core as mx
import pytest

from ref_impl.engine.checkpoint import load_model
from ref_impl.formats import gguf
from ref_impl.measure import peers, quant
from ref_impl.measure.decode import bench_decode, bench_shape, forward_sweep, this_machine
from ref_impl.measure.link import SIZES, measure_link
from ref_impl.measure.records import write_results
from ref_impl.theory import roofline


@pytest.fixture(scope="module")
def records(shipped_model):
    return bench_decode(shipped_model, prompt_len=16, gen_tokens=24, repeats=1, peers=True, roof_bytes=16 << 20)


def test_every_engine_reports_every_metric(records):
    roofs = [r for r in records if r["experiment"] == "roofs"]   # the machine's roofs, first
    assert records[:len(roofs)] == roofs and {r["variant"] for r in roofs} == {"copy", "read", "host copy", "matmul"}
    records = records[len(roofs):]
    engines = {(r["peer"], r["variant"]) for r in records}
    assert (None, "sync") in engines and (None, "async_eval") in engines
    peers = {p for p, _ in engines if p}
    assert any(p.startswith("mlx-lm") for p in peers) and any(p.startswith("llama.cpp") for p in peers)
    for engine in engines:
        metrics = {r["metric"] for r in records if (r["peer"], r["variant"]) == engine}
        assert metrics == {"tokens_per_s", "ttft_ms", "prefill_tokens_per_s", "itl_p50_ms", "itl_p99_ms",
                           "greedy_agreement"}
    assert all(math.isfinite(r["value"]) and r["value"] > 0 for r in records)


def test_peers_decode_the_same_greedy_tokens(records):
    """Same weights, same prompt: mlx-lm and llama.cpp must emit our greedy tokens, else speeds are moot."""
    agreement = {(r["peer"], r["variant"]): r["value"] for r in records if r["metric"] == "greedy_agreement"}
    assert agreement and all(v == 1.0 for v in agreement.values()), agreement


def test_results_file_has_the_one_shape(records, tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_USE_CUDA_GRAPHS", "0")
    path = write_results(records, tmp_path, "python -m ref_impl bench (test)", label="test-machine")
    doc = json.loads(path.read_text())
    assert path.name.startswith("test-machine-") and doc["schema"] == 1
    assert set(doc) == {"schema", "date", "git", "command", "machine", "records"}
    assert {"label", "cpu", "cores", "gpu", "backend", "mlx", "python", "blas"} <= set(doc["machine"])
    assert doc["machine"]["mlx_env"]["MLX_USE_CUDA_GRAPHS"] == "0"     # how MLX ran is part of the machine
    assert doc["records"] == records


def test_forward_sweep_times_each_length_and_respects_its_budget(random_llama):
    with gguf.read(random_llama) as f:
        model = load_model(f, mx.float32)
    lengths, seconds = forward_sweep(model, [1, 2, 4, 8], repeats=2)
    assert lengths == [1, 2, 4, 8] and all(s > 0 for s in seconds)
    # a budget of zero still times the first length, then stops
    assert forward_sweep(model, [1, 2, 4, 8], repeats=1, budget_s=0.0)[0] == [1]


def test_bench_shape_reports_bytes_speed_and_bandwidth_share(tmp_path):
    """A tiny untied shape: bits per weight of each type, the bytes a step reads (every matrix and its
    scales, not the embedding table, plus the KV cache), and the share of bandwidth that implies."""
    from ref_impl.engine.model import ModelArgs

    args = ModelArgs(256, 256, 2, 512, 4, 2, max_position_embeddings=64, tie_word_embeddings=False)
    recs = bench_shape("tiny", args, ["F16", "Q4_K"], tmp_path, prompt_len=4, gen_tokens=4, repeats=1,
                       roof_bytes=16 << 20)
    got = {(r["weights"], r["metric"]): r["value"] for r in recs}
    assert {r["variant"] for r in recs if r["metric"] == "bandwidth"} == {"copy", "read", "host copy"}   # a CPU
    assert [r["variant"] for r in recs if r["metric"] == "peak_flops"] == ["matmul"]
    assert got["Q4_K", "bits_per_weight"] == pytest.approx(4.5, abs=0.05)   # 144 B / 256 values, + F32 norms
    assert got["F16", "bits_per_weight"] == pytest.approx(16, abs=0.05)
    # by hand: 2 layers of q, k, v, o, gate, up, down + the output matrix; MLX Q4_K is 4 bits + 2 x 32-bit
    # scale/bias per 32 on the CPU (float32 model): 6 bits per weight; KV: 2 x 2 layers x 2 heads x 64 x 8 x 4 B
    matrices = 2 * (256 * 256 * 2 + 128 * 256 * 2 + 3 * 256 * 512) + 256 * 256
    norms = (2 * 2 + 1) * 256 * 4
    kv = 2 * 2 * 2 * 64 * (4 + 4 // 2) * 4
    assert got["Q4_K", "bytes_per_token"] == matrices * 6 / 8 + norms + kv
    bw = max(r["value"] for r in recs if r["metric"] == "bandwidth")   # the fastest probe: records.bandwidth's
    assert got["Q4_K", "bandwidth_fraction"] == pytest.approx(
        got["Q4_K", "bytes_per_token"] * got["Q4_K", "tokens_per_s"] / 1e9 / bw)
    assert not list(tmp_path.glob("*.gguf"))          # the multi-GB files of real shapes are not kept


def test_args_for_public_shapes():
    from ref_impl.engine.random import args_for

    a = args_for("Llama-3.1-8B")
    assert (a.hidden_size, a.num_hidden_layers, a.intermediate_size, a.num_key_value_heads) == (4096, 32, 14336, 8)
    assert not a.tie_word_embeddings and a.num_parameters == 8_030_261_248
    with pytest.raises(ValueError, match="Qwen3-8B is not the Llama architecture"):
        args_for("Qwen3-8B")                       # q/k norms: not our decoder's architecture


def test_bench_link_records_host_copies_in_the_one_shape(tmp_path):
    """The CPU part of `bench --link`: one numpy copy record per size up to max_bytes, GB/s with samples;
    without PyTorch and a GPU, one "skipped" record that says why instead of device copies."""
    records = measure_link(budget_s=1.0, max_bytes=1 << 20)
    host = [r for r in records if r["variant"] == "host copy (numpy)"]
    assert [r["bytes"] for r in host] == [s for s in SIZES if s <= 1 << 20]
    for r in records:
        assert {"experiment", "model", "weights", "kv", "context", "metric", "unit", "value", "samples",
                "peer"} <= r.keys() and r["experiment"] == "link" and r["peer"] is None
    for r in host:
        assert r["metric"] == "copy_bandwidth" and r["unit"] == "GB/s"
        assert r["value"] > 0 and r["samples"] and max(r["samples"]) == r["value"]
    try:
        import torch
        gpu = torch.cuda.is_available()
    except ImportError:
        gpu = False
    if not gpu:
        (skip,) = [r for r in records if r["metric"] == "skipped"]
        assert "not measured" in skip["note"]
    doc = json.loads(write_results(records, tmp_path, "python -m ref_impl bench --link (test)", "test").read_text())
    assert doc["records"] == records


def _fake_llama_bench(tmp_path, body: str) -> Path:
    """An executable standing in for llama-bench: a shell script with the given body."""
    exe = tmp_path / "llama-bench"
    exe.write_text("#!/bin/sh\n" + body + "\n")
    exe.chmod(0o755)
    return exe


def test_llama_bench_records_parse_its_json_and_pass_our_arguments(tmp_path):
    # the fake prints its arguments to a file and one JSON row, as llama-bench -o json does
    row = {"build_commit": "abc123", "backends": "CUDA", "gpu_info": "NVIDIA H200", "model_size": 4920000000,
           "n_prompt": 0, "n_gen": 128, "n_depth": 128, "avg_ts": 281.5, "samples_ts": [280.0, 283.0]}
    exe = _fake_llama_bench(tmp_path, f"echo \"$@\" > {tmp_path}/args\ncat <<'J'\n{json.dumps([row])}\nJ")
    gguf_file = tmp_path / "m.gguf"
    recs = peers.llama_bench_records(exe, gguf_file, {"experiment": "decode-kernels", "weights": "Q4_K_M"}, 128, 128, 3)
    speed = next(r for r in recs if r["metric"] == "tokens_per_s")
    assert speed["value"] == 281.5 and speed["samples"] == [280.0, 283.0]
    assert "abc123" in speed["peer"] and speed["weights"] == "Q4_K_M"
    assert next(r for r in recs if r["metric"] == "model_bytes")["value"] == 4920000000
    args = (tmp_path / "args").read_text().split()
    assert args[args.index("-m") + 1] == str(gguf_file)
    assert [args[args.index(f) + 1] for f in ("-n", "-d", "-r", "-ngl")] == ["128", "128", "3", "99"]


def test_a_llama_bench_built_from_an_archive_is_named_without_a_made_up_version(tmp_path):
    row = {"build_commit": "unknown", "backends": "CUDA", "model_size": 1, "n_prompt": 0, "n_gen": 128,
           "n_depth": 128, "avg_ts": 200.0, "samples_ts": [200.0]}
    exe = _fake_llama_bench(tmp_path, f"cat <<'J'\n{json.dumps([row])}\nJ")
    recs = peers.llama_bench_records(exe, tmp_path / "m.gguf", {"weights": "F16"}, 128, 128, 3)
    assert {r["peer"] for r in recs} == {"llama.cpp (llama-bench, CUDA)"}


@pytest.mark.parametrize("body, message", [("echo 'failed to load model' >&2; exit 1", "failed to load model"),
                                           ("echo not json", "no JSON"),
                                           ("echo '[]'", "no decode of 128 tokens")])
def test_a_failing_llama_bench_becomes_one_error_record(tmp_path, body, message):
    exe = _fake_llama_bench(tmp_path, body)
    recs = peers.llama_bench_records(exe, tmp_path / "m.gguf", {"weights": "F16"}, 128, 128, 3)
    assert len(recs) == 1 and recs[0]["metric"] == "peer_error" and message in recs[0]["note"]


def test_a_missing_llama_bench_binary_is_named(tmp_path):
    recs = peers.llama_bench_records(tmp_path / "nope", tmp_path / "m.gguf", {}, 128, 128, 3)
    assert recs[0]["metric"] == "peer_error" and "did not run" in recs[0]["note"]


def test_bench_quant_groups_scores_each_group_on_the_same_windows(shipped_model):
    from ref_impl.engine.tokenizer import Tokenizer
    from ref_impl.formats.quantize import MATRIX_GROUPS
    from ref_impl.training.corpus import heldout_stream
    from ref_impl.training.evaluate import mean_loss

    records = quant.bench_quant_groups(shipped_model, "Q4_K", ppl_tokens=1024)
    by = {(r["variant"], r["metric"]): r for r in records}
    groups = ["none (float32)", *MATRIX_GROUPS, "every matrix"]
    assert [v for v, m in by if m == "window_loss"] == groups
    with gguf.read(shipped_model) as f:
        matrix_bytes = sum(t.nbytes for t in f.tensors.values() if len(t.shape) == 2)
        float_loss = mean_loss(load_model(f, mx.float32), heldout_stream(Tokenizer.from_gguf_metadata(f.metadata))[0],
                               512, 1024, spread=True)
    # the groups split the matrices (the output matrix is the tied embedding): nothing counted twice or left out
    assert sum(by[g, "matrix_bytes"]["value"] for g in MATRIX_GROUPS) == by["every matrix", "matrix_bytes"]["value"] \
        == matrix_bytes and by["none (float32)", "matrix_bytes"]["value"] == 0
    for g in groups:
        losses = by[g, "window_loss"]["samples"]
        assert len(losses) == 2 and by[g, "window_loss"]["value"] == pytest.approx(sum(losses) / 2)
        assert by[g, "heldout_perplexity"]["value"] == pytest.approx(math.exp(by[g, "window_loss"]["value"]))
        assert by[g, "heldout_perplexity"]["tokens"] == 1024
    assert by["none (float32)", "window_loss"]["value"] == pytest.approx(float_loss, rel=1e-6)
    assert by["every matrix", "window_loss"]["samples"] != by["none (float32)", "window_loss"]["samples"]


def test_this_machine_measures_positive_finite_numbers():
    hw = this_machine(seconds=0.1, array_mb=8, matmul_n=128)
    for value in (hw.memory_gb, hw.bandwidth_gbs, hw.peak_tflops):
        assert value > 0 and math.isfinite(value)
    assert hw.source == "measured live on this machine"
    assert roofline.ridge_point(hw) > 0
