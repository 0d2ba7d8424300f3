"""The benchmark runs our decoder and both peers on the same weights, and they agree."""

from __future__ import annotations

import json
import math

import mlx.core as mx
import pytest

from ref_impl import gguf
from ref_impl.bench import bench_decode, forward_sweep, write_results
from ref_impl.model import load_model


@pytest.fixture(scope="module")
def records(shipped_model):
    return bench_decode(shipped_model, prompt_len=16, gen_tokens=24, repeats=1, peers=True)


def test_every_engine_reports_every_metric(records):
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


def test_results_file_has_the_one_shape(records, tmp_path):
    path = write_results(records, tmp_path, "python -m ref_impl bench (test)", label="test-machine")
    doc = json.loads(path.read_text())
    assert path.name.startswith("test-machine-") and doc["schema"] == 1
    assert set(doc) == {"schema", "date", "git", "command", "machine", "records"}
    assert {"label", "cpu", "cores", "gpu", "backend", "mlx", "python", "blas"} <= set(doc["machine"])
    assert doc["records"] == records


def test_forward_sweep_times_each_length_and_respects_its_budget(random_llama):
    with gguf.read(random_llama) as f:
        model = load_model(f, mx.float32)
    lengths, seconds = forward_sweep(model, [1, 2, 4, 8], repeats=2)
    assert lengths == [1, 2, 4, 8] and all(s > 0 for s in seconds)
    # a budget of zero still times the first length, then stops
    assert forward_sweep(model, [1, 2, 4, 8], repeats=1, budget_s=0.0)[0] == [1]
