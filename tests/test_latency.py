"""latency: the measurements through MLX, and the growing KV caches they compare with the static one.

The measurement functions run at tiny sizes on the CPU and return well-typed, sane results; no
assertion depends on how fast anything runs. The cache strategies give the same logits and tokens
as the static cache; an eval per layer gives the same tokens as one graph per token. The CLI's
`bench --dispatch --quick` writes a well-formed results file, and refuses bad input in one line.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from ref_impl.engine.generate import Sampler, generate_step
from ref_impl.engine.kvcache import ChunkedKVCache, ConcatKVCache, KVCache
from ref_impl.engine.kvquant import FLOATS, SCHEMES
from ref_impl.engine.kvquant import make_caches
from ref_impl.engine.random import args_for
from ref_impl.measure import latency, loads
from ref_impl.measure.latency import (
    MODES,
    CompileCost,
    DecodeRate,
    JitterRun,
    KernelLatency,
    break_even,
    decode_modes,
    kv_jitter,
    layer_eval_step,
    random_model,
)

ROOT = Path(__file__).resolve().parent.parent
EXPERIMENTS = {"dispatch-async", "dispatch-layer-eval", "first-call", "kernel-latency", "kv-jitter", "wired",
               "ttft", "itl"}


@pytest.fixture(scope="module")
def tiny():
    return random_model(args_for("tiny", 256), mx.float32, seed=1)


def caches_of(model, kind, size, step=None):
    a = model.args
    if kind == "chunked" and step:
        return [ChunkedKVCache(1, a.num_key_value_heads, a.head_dim, size, mx.float32, step=step)
                for _ in range(a.num_hidden_layers)]
    return make_caches(kind, a.num_hidden_layers, 1, a.num_key_value_heads, a.head_dim, size, mx.float32)


def take(stream, n):
    return [t for _, t in zip(range(n), stream)]


# ---- the growing caches ---------------------------------------------------------------------------

@pytest.mark.parametrize("kind, step", [("concat", None), ("chunked", None), ("chunked", 4)])
def test_cache_strategies_give_the_static_logits(tiny, kind, step):
    """Prefill 5 tokens, then 20 single-token steps (step 4 crosses five chunk boundaries)."""
    tokens = np.random.default_rng(0).integers(1, tiny.args.vocab_size, 25)
    static, other = tiny.make_cache(32), caches_of(tiny, kind, 32, step)
    for lo, hi in [(0, 5)] + [(i, i + 1) for i in range(5, 25)]:
        x = mx.array(tokens[None, lo:hi])
        a, b = tiny(x, static), tiny(x, other)
        np.testing.assert_allclose(np.array(b), np.array(a), rtol=1e-5, atol=1e-5)
    assert [c.offset for c in other] == [25] * tiny.args.num_hidden_layers


@pytest.mark.parametrize("kind", FLOATS)
def test_cache_contract(kind):
    c = SCHEMES[kind](1, 2, 4, 8)
    k = mx.arange(24, dtype=mx.float32).reshape(1, 2, 3, 4)
    keys, values = c.update_and_fetch(k, -k)
    assert c.offset == 3 and keys.shape == (1, 2, 3, 4) and np.array_equal(np.array(values), -np.array(k))
    assert c.trim(2) == 2 and c.offset == 1 and c.state[0].shape == (1, 2, 1, 4)
    keys, _ = c.update_and_fetch(mx.full((1, 2, 1, 4), 7.0), mx.zeros((1, 2, 1, 4)))
    assert keys.shape == (1, 2, 2, 4) and float(keys[0, 0, 1, 0]) == 7.0 and float(keys[0, 0, 0, 0]) == 0.0
    assert c.trim(9) == 2 and c.state[0].shape == (1, 2, 0, 4)
    assert c.nbytes >= 0
    with pytest.raises(ValueError, match="KV cache full: 9 positions needed"):
        c.update_and_fetch(mx.zeros((1, 2, 9, 4)), mx.zeros((1, 2, 9, 4)))
    with pytest.raises(ValueError, match="expects keys/values of shape"):
        c.update_and_fetch(mx.zeros((1, 3, 1, 4)), mx.zeros((1, 3, 1, 4)))


def test_cache_sizes():
    chunked, concat = ChunkedKVCache(1, 2, 4, 1000, step=256), ConcatKVCache(1, 2, 4, 1000)
    assert chunked.nbytes == concat.nbytes == 0
    for c in (chunked, concat):
        c.update_and_fetch(mx.zeros((1, 2, 300, 4)), mx.zeros((1, 2, 300, 4)))
        c.update_and_fetch(mx.zeros((1, 2, 1, 4)), mx.zeros((1, 2, 1, 4)))
    assert chunked.keys.shape[2] == 512                   # two whole steps of 256 hold 301 positions
    assert concat.keys.shape[2] == 301                    # exactly what is stored
    assert KVCache(1, 2, 4, 1000).nbytes == 2 * 1000 * 8 * 4
    with pytest.raises(ValueError, match="unknown KV-cache scheme"):
        make_caches("paged", 1, 1, 2, 4, 8)


@pytest.mark.parametrize("sampler", [{}, {"temperature": 0.9, "seed": 3}])
def test_strategies_and_layer_eval_give_the_same_tokens(tiny, sampler):
    prompt = [1, 5, 9, 4]
    n = 40
    sync = take(generate_step(tiny, prompt, Sampler(**sampler), tiny.make_cache(64)), n)
    for kind in FLOATS:
        for pipeline in (False, True):
            cache = caches_of(tiny, kind, 64, step=8 if kind == "chunked" else None)
            assert take(generate_step(tiny, prompt, Sampler(**sampler), cache, pipeline), n) == sync, (kind, pipeline)
    assert take(layer_eval_step(tiny, prompt, Sampler(**sampler), tiny.make_cache(64)), n) == sync


# ---- the measurements -----------------------------------------------------------------------------

def test_decode_modes(tiny):
    rates = decode_modes(tiny, prompt_len=4, n_tokens=5, repeats=2, seed=2)
    assert list(rates) == list(MODES)
    for mode, r in rates.items():
        assert isinstance(r, DecodeRate) and r.mode == mode
        assert r.tokens_per_s > 0 and len(r.tokens_per_s_runs) == 2 and r.ttft_ms > 0 and r.itl_p50_ms > 0
        assert r.tokens == rates["sync"].tokens and len(r.tokens) == 5
    with pytest.raises(ValueError, match="decode_modes needs"):
        decode_modes(tiny, n_tokens=1)
    with pytest.raises(ValueError, match="decode_modes needs"):
        decode_modes(tiny, modes=("sync", "turbo"))


def test_token_times_and_compile_cost(tiny):
    times = latency.token_times_ms(tiny, prompt_len=4, n_tokens=3)
    assert len(times) == 3 and all(t > 0 for t in times)
    cost = latency.compile_cost(elements=64, ops=3, calls=3)
    assert isinstance(cost, CompileCost) and (cost.elements, cost.ops) == (64, 3)
    assert min(cost.first_call_ms, cost.later_call_ms, cost.uncompiled_call_ms, cost.uncompiled_first_call_ms) > 0


def test_first_call_in_a_fresh_process(shipped_model):
    (fc,) = latency.first_call(shipped_model, prompt_len=4, n_tokens=3, runs=2, processes=1, timeout_s=120)
    assert fc.model == "stdlib-10m" and "empty kernel cache" in fc.label
    assert len(fc.runs_token_ms) == 2 and all(len(r) == 3 and min(r) > 0 for r in fc.runs_token_ms)
    assert fc.process_s > 0 and fc.load_ms > 0 and math.isfinite(fc.startup_s)
    assert isinstance(fc.compile, CompileCost)


def test_first_call_child_refuses_bad_arguments():
    r = subprocess.run([sys.executable, "-m", "ref_impl.measure.latency", "first-call"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("usage:")


def test_kernel_latency_and_break_even():
    res = latency.kernel_latency(sizes=(1, 64, 4096), chains=(1, 3), compiled=(False, True), target_s=0.001,
                                  rounds=2)
    assert len(res) == 3 * 2 * 2 and all(isinstance(r, KernelLatency) for r in res)
    for r in res:
        assert r.call_us > 0 and r.per_op_us == pytest.approx(r.call_us / r.chain) and r.gb_per_s > 0
    assert set(break_even(res, chain=3)) == {"launch_us", "break_even_elements"}
    with pytest.raises(ValueError, match="no results"):
        break_even(res, chain=7)


def test_break_even_by_hand():
    """Floor = median per-op time up to 4096 elements; break-even = first size at twice the floor."""
    def row(n, us):
        return KernelLatency(n, 1, False, us, us, 1.0)
    rows = [row(1, 10.0), row(64, 12.0), row(4096, 11.0), row(2**16, 15.0), row(2**20, 23.0), row(2**24, 90.0)]
    assert break_even(rows) == {"launch_us": 11.0, "break_even_elements": 2**20}
    assert break_even(rows[:4])["break_even_elements"] is None


def test_live_readings_the_ledger_shows_are_measured_here_once_per_process():
    """measure_launch_floor, measure_compile and measure_wired (moved out of the ledger, which only judges): the
    ledger's live readings, sane and typed, timed once per process (the second call returns the first's result)."""
    device, floors = latency.measure_launch_floor(2)
    assert device == str(mx.default_device()) and len(floors) == 2 and min(floors) > 0
    assert latency.measure_launch_floor(2) == (device, floors)
    costs = latency.measure_compile(2)
    assert len(costs) == 2 and all(isinstance(c, CompileCost) and c.first_call_ms > 0 for c in costs)
    assert latency.measure_compile(2) is costs
    reads = latency.measure_wired(1 << 20, 256 << 10, rounds=2)
    assert list(reads) == ["first_touch", "prefaulted", "mlocked"]
    assert all(len(r) == 2 and all(w.variant == k and w.gb_per_s > 0 for w in r) for k, r in reads.items())
    assert latency.measure_wired(1 << 20, 256 << 10, rounds=2) is reads


def test_kv_jitter(tiny):
    runs = kv_jitter(tiny, n_tokens=12, prompt_len=4, warmup_tokens=4)
    assert [r.strategy for r in runs] == list(FLOATS)
    for r in runs:
        assert isinstance(r, JitterRun) and len(r.itl_ms) == 11 and len(r.token_ids) == 12
        assert r.itl_p50_ms <= r.itl_p99_ms <= r.itl_max_ms and r.tokens_per_s > 0
        assert r.peak_bytes >= r.active_before_bytes >= 0 and r.cache_bytes > 0
        assert r.token_ids == runs[0].token_ids
    with pytest.raises(ValueError, match="exceeds the model's context length"):
        kv_jitter(tiny, n_tokens=300)
    with pytest.raises(ValueError, match="strategies from"):
        kv_jitter(tiny, n_tokens=4, strategies=("paged",))


def test_context_sweep_skips_lengths_past_the_context(tiny):
    points = latency.context_sweep(tiny, [8, 4, 10_000], n_tokens=3)
    assert [p.context for p in points] == [4, 8]
    assert all(p.ttft_ms > 0 and p.itl_p50_ms > 0 and p.tokens_per_s > 0 for p in points)


def test_shapes():
    assert args_for("tiny", 100).max_position_embeddings == 100
    assert args_for("Llama-3.1-8B").num_hidden_layers == 32
    with pytest.raises(ValueError, match="no model shape 'GPT-5'"):
        args_for("GPT-5")


def test_wired_reads():
    res = loads.wired_reads(1 << 20, 256 << 10, repeats=1)
    assert [r.variant for r in res] == ["first_touch", "prefaulted", "mlocked"]
    for r in res:
        assert r.buffer_bytes == 1 << 20 and len(r.tensor_read_ms) == 4 and r.read_ms > 0 and r.gb_per_s > 0
        assert r.minor_faults >= 0 and r.major_faults >= 0
    first, pre, locked = res
    assert first.locked is None and pre.locked is None
    assert locked.locked is True or locked.error.startswith("mlock failed")
    if sys.platform == "linux":
        assert first.minor_faults > 0        # every untouched page faults on its first read


def test_wired_reads_records_a_failed_mlock(monkeypatch):
    monkeypatch.setattr(loads, "_mlock", lambda address, n, lock=True: "mlock failed: Operation not permitted")
    (r,) = loads.wired_reads(1 << 20, 1 << 20, repeats=1, variants=("mlocked",))
    assert r.locked is False and "not permitted" in r.error and r.read_ms > 0
    with pytest.raises(ValueError, match="wired_reads needs"):
        loads.wired_reads(1024, 4096)


# ---- the CLI --------------------------------------------------------------------------------------

def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ref_impl", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_bench_dispatch_writes_a_well_formed_results_file(tmp_path):
    r = cli("bench", "--dispatch", "--quick", "--shapes", "tiny", "--out", tmp_path, "--label", "test")
    assert r.returncode == 0, r.stderr
    (path,) = tmp_path.glob("test-*.json")
    assert f"wrote {path}" in r.stdout
    doc = json.loads(path.read_text())
    assert doc["schema"] == 1 and doc["command"].startswith("python -m ref_impl bench --dispatch")
    assert doc["machine"]["label"] == "test"
    records = doc["records"]
    assert {rec["experiment"] for rec in records} == EXPERIMENTS
    keys = {"experiment", "model", "weights", "kv", "context", "variant", "metric", "unit", "value", "samples", "peer"}
    for rec in records:
        assert keys <= set(rec) and rec["peer"] is None
        assert rec["value"] is None or math.isfinite(rec["value"])
        assert isinstance(rec["samples"], list) and all(math.isfinite(x) for x in rec["samples"])
    models = {rec["model"] for rec in records if rec["experiment"] == "dispatch-async"}
    assert models == {"stdlib-10m", "tiny"}
    gains = [rec for rec in records if rec["metric"] == "gain"]
    assert len(gains) == 2 and all(rec["unit"] == "fraction" for rec in gains)
    assert {rec["variant"] for rec in records if rec["experiment"] == "kv-jitter"} == set(FLOATS)
    assert {rec["run"] for rec in records if rec["metric"] == "token_ms"} == {1, 2}


@pytest.mark.parametrize("args, message", [
    (["--shapes", "GPT-5"], "no model shape 'GPT-5'"),
    (["--model", "no/such/model.gguf"], "no model file"),
])
def test_bench_dispatch_refuses_bad_input(tmp_path, args, message):
    r = cli("bench", "--dispatch", "--quick", *args, "--out", tmp_path, timeout=120)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0]
    assert not list(tmp_path.glob("*.json"))


def test_launch_floor_ignores_a_slow_first_size_and_finds_the_break_even():
    # floor: median of 59.1, 49.7, 24.2, 25.8, 24.1, 24.2, 25.3 (sizes <= 4096) = 25.3 µs; 2 x 25.3 = 50.6:
    # 64k (30.1) is under it, 1M (73.6) the first over; the 59.1 µs of one element is not a break-even
    rows = [(1, 59.1), (4, 49.7), (16, 24.2), (64, 25.8), (256, 24.1), (1024, 24.2), (4096, 25.3),
            (65536, 30.1), (1 << 20, 73.6), (1 << 22, 77.1)]
    assert latency.launch_floor(rows) == (pytest.approx(25.3), 1 << 20)
    assert latency.launch_floor([(1, 10.0), (1 << 20, 15.0)]) == (10.0, None)
