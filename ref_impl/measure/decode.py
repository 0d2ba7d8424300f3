"""Decode speed: our decoder against its peers, forward time against length, and the roofs it runs under.

`bench_decode` (`python -m ref_impl bench --model ...`) decodes the GGUF model with our decoder, host-
synchronous and `async_eval`-pipelined, and with the peers (`peers.py`) on the same weights; `bench_shape`
(`bench --shape`) decodes a random-weight model of a public shape per weight type and sets its speed against
the bandwidth roof. Both record the machine's roofs first (`roofs`: the memory probes of `memory_bandwidth`
and the matmul peak of `matmul_peak`; `bench --roofs` records them alone); `decode_bytes` is what a step
reads. `forward_sweep` times one uncached forward against its length (the flat-then-linear curve of
chapter 0), and `this_machine` measures a CPU's two roofs live with numpy, for `roofline.Hardware`.
`measure_matmul` (a GEMV and a GEMM of one weight matrix) and `measure_forward` (the shipped model's forward
against its length, and its decode steps at two contexts) are the live readings the claim ledger shows beside
its verdicts, once per process.

The discipline is the usual one: a warm-up run first, random prompt tokens from a fixed seed, greedy
sampling, end-of-sequence ignored, every result evaluated before the clock stops; prefill (TTFT) and decode
(tokens/s, inter-token latency) reported separately (`timing.decode_metrics`).

    python -m ref_impl bench --model models/stdlib-10m.gguf

See chapter: capstone
"""

from __future__ import annotations

import functools
import math
import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ref_impl import MODELS_DIR
from ref_impl.engine.checkpoint import load, load_model
from ref_impl.engine.generate import Sampler, generate_step
from ref_impl.engine.model import Model, ModelArgs
from ref_impl.engine.random import random_gguf_model
from ref_impl.formats import gguf
from ref_impl.measure.peers import llama_cpp_peer, mlx_lm_peer
from ref_impl.measure.records import ROOFS, dtype_name, fastest_bandwidth, record
from ref_impl.platform import blas
from ref_impl.platform.machine import package_version
from ref_impl.platform.timing import TokenRun, best, clock, decode_metrics, median, repeat, token_runs, within
from ref_impl.theory.roofline import Hardware
from ref_impl.theory.shapes import ModelShape


def ours(model: Model, prompt: list[int], n: int, repeats: int, pipeline: bool, compiled: bool = False
         ) -> list[TokenRun]:
    """Our decoder, greedy, one warm-up run and then `repeats` timed runs of n tokens (pipeline:
    `async_eval` overlaps step t+1's graph building with step t; compiled: each decode step one
    mx.compile'd graph)."""

    def stream():
        cache = model.make_cache(len(prompt) + n)
        return generate_step(model, prompt, Sampler(), cache, pipeline=pipeline, compiled=compiled)
    return token_runs(stream, n, repeats)


def forward_sweep(model: Model, lengths: Sequence[int], repeats: int = 3, budget_s: float = math.inf,
                  seed: int = 0, offset: int = 0) -> tuple[list[int], list[float]]:
    """Median seconds of one uncached forward over L random tokens, for each L in turn (a warm-up
    pass first), on one BLAS thread so a busy machine gives stable times. Stops before an L whose
    likely cost (twice the last L's, repeats + 1 passes) would overrun budget_s; returns the
    lengths it timed and their seconds. The flat-then-linear curve of chapter 0. With offset > 0
    each forward continues after `offset` cached random tokens (a decode or speculative verify
    step at that context) and the cache is trimmed back after it."""
    tokens = mx.array(np.random.default_rng(seed).integers(0, model.args.vocab_size, (1, offset + max(lengths))))
    cache = model.make_cache(offset + max(lengths)) if offset else None
    if cache:
        mx.eval(model(tokens[:, :offset], cache))

    def forward(L: int) -> None:
        mx.eval(model(tokens[:, offset:offset + L], cache))
        for layer_cache in cache or ():
            layer_cache.trim(L)

    timed, seconds, start = [], [], clock()
    with blas.one_blas_thread():
        for L in lengths:
            if seconds and clock() - start + 2 * (repeats + 1) * seconds[-1] > budget_s:
                break
            timed.append(L)
            seconds.append(median(repeat(lambda: forward(L), repeats)))
    return timed, seconds


def decode_records(runs: dict[tuple[str, str], list[TokenRun]], prompt_len: int, **fields) -> list[dict]:
    """"decode" records of timed runs per (engine, variant): timing.decode_metrics, and the share of
    positions whose greedy token matches ours (sync): the same weights must give the same tokens."""
    units = {"tokens_per_s": "tok/s", "prefill_tokens_per_s": "tok/s", "greedy_agreement": "fraction"}
    reference = np.array(runs[("ours", "sync")][0].ids)
    out = []
    for (engine, variant), r in runs.items():
        metrics = decode_metrics(r, prompt_len)
        metrics["greedy_agreement"] = (float(np.mean(np.array(r[0].ids) == reference)), [])
        out += [record("decode", metric, units.get(metric, "ms"), value, samples=samples, variant=variant,
                       peer=None if engine == "ours" else engine, **fields)
                for metric, (value, samples) in metrics.items()]
    return out


def bench_decode(path: Path, prompt_len: int = 128, gen_tokens: int = 128, repeats: int = 3,
                 peers: bool = True, seed: int = 0, roof_bytes: int = 1 << 30) -> list[dict]:
    """Decode records for our decoder (sync and pipelined) and, if asked, mlx-lm and llama.cpp, after this
    machine's roofs (`roofs` on `roof_bytes`), which their shares of the bandwidth are divided by."""
    if prompt_len < 1 or gen_tokens < 2 or repeats < 1:
        raise ValueError(f"bench needs prompt_len >= 1, gen_tokens >= 2 (a decode speed takes two "
                         f"token times) and repeats >= 1; got {prompt_len}, {gen_tokens}, {repeats}")
    with gguf.read(path) as f:
        context = ModelArgs.from_gguf(f.metadata, f.tensors).max_position_embeddings  # a llama file, or a clear error
        if prompt_len + gen_tokens > context:
            raise ValueError(f"prompt_len {prompt_len} + gen_tokens {gen_tokens} exceeds the model's "
                             f"context length ({context})")
        weights = f.tensors.get("blk.0.attn_q.weight", f.tensors["token_embd.weight"]).type.name
        name = f.metadata.get("general.name", path.stem)
        model = load_model(f, mx.float32)
    machine = roofs(roof_bytes)
    prompt = np.random.default_rng(seed).integers(1, model.args.vocab_size, size=prompt_len).tolist()
    runs = {("ours", "sync"): ours(model, prompt, gen_tokens, repeats, pipeline=False),
            ("ours", "async_eval"): ours(model, prompt, gen_tokens, repeats, pipeline=True)}
    if peers:
        runs[("mlx-lm " + package_version("mlx-lm"), "default")] = mlx_lm_peer(model, prompt, gen_tokens, repeats)
        runs[("llama.cpp (llama-cpp-python " + package_version("llama_cpp_python") + ")", "default")] = \
            llama_cpp_peer(path, prompt, gen_tokens, repeats)
    return machine + decode_records(runs, prompt_len, model=name, weights=weights,
                                    kv=dtype_name(model.norm.weight.dtype), context=prompt_len + gen_tokens)


def memory_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> dict[str, float]:
    """The memory probes, in GB/s, best of `repeats` each (noise only adds time): MLX's copy (x + 1: reads
    and writes every byte once, as STREAM's Copy) and read (a sum) of one `nbytes` array on the default
    device, and on the CPU numpy's copy of the same bytes (`np.copyto`, libc's memcpy: MLX's elementwise
    kernels do not stream a CPU's memory as fast). The fastest of them is the roof a decode step's weight
    reads run against (`records.fastest_bandwidth`)."""
    x = mx.ones((nbytes // 4,), dtype=mx.float32)
    mx.eval(x)
    out = {}
    for kind, op, moved in (("copy", lambda: x + 1, 2 * nbytes), ("read", lambda: x.sum(), nbytes)):
        out[kind] = moved / best(repeat(lambda: mx.eval(op()), repeats)) / 1e9
    if mx.default_device() == mx.cpu:
        src = np.ones(nbytes // 8)
        dst = np.empty_like(src)
        out["host copy"] = 2 * nbytes / best(repeat(lambda: np.copyto(dst, src), repeats)) / 1e9
    return out


def matmul_peak(repeats: int = 5) -> tuple[str, float]:
    """(dtype, FLOP/s): the best of `repeats` square matmuls through MLX on the default device, float32 n = 2048
    on the CPU (its BLAS), float16 n = 8192 on a GPU: the compute roof a prefill runs against."""
    n, dtype = (2048, mx.float32) if mx.default_device() == mx.cpu else (8192, mx.float16)
    a, b = mx.ones((n, n), dtype=dtype), mx.ones((n, n), dtype=dtype)
    mx.eval(a, b)
    return dtype_name(dtype), 2 * n**3 / best(repeat(lambda: mx.eval(a @ b), repeats))


def roofs(nbytes: int = 1 << 30, repeats: int = 5) -> list[dict]:
    """This machine's roofs as "roofs" records: each memory probe (`memory_bandwidth`) and the matmul peak
    (`matmul_peak`). Every share of a run's speed is divided by its fastest probe (`records.bandwidth`)."""
    dtype, flops = matmul_peak(repeats)
    probes = memory_bandwidth(nbytes, repeats)
    return ([record(ROOFS, "bandwidth", "GB/s", v, variant=kind) for kind, v in probes.items()]
            + [record(ROOFS, "peak_flops", "FLOP/s", flops, variant="matmul", dtype=dtype)])


def decode_bytes(model: Model, context: int) -> int:
    """Bytes one decode step reads: every parameter except the embedding table (one row of it is read,
    unless it doubles as the output matrix), plus the KV cache at this context."""
    a = model.args
    params = dict(tree_flatten(model.parameters()))
    nbytes = sum(v.nbytes for k, v in params.items() if a.tie_word_embeddings or not k.startswith("embed_tokens"))
    kv = 2 * a.num_hidden_layers * a.num_key_value_heads * a.head_dim * context * params["norm.weight"].itemsize
    return nbytes + kv


def bench_shape(shape: str, args: ModelArgs, weight_types: Sequence[str], work_dir: Path, prompt_len: int = 128,
                gen_tokens: int = 128, repeats: int = 3, seed: int = 0, roof_bytes: int = 1 << 30) -> list[dict]:
    """Decode speed of a random-weight model of a public model's shape (speed does not depend on the
    values), per weight type, native MLX quantization, with the share of measured bandwidth it reaches."""
    work_dir.mkdir(parents=True, exist_ok=True)
    records = roofs(roof_bytes)
    roof = fastest_bandwidth(records)
    prompt = np.random.default_rng(seed).integers(1, args.vocab_size, size=prompt_len).tolist()
    for wt in weight_types:
        model, bits_per_weight = random_gguf_model(shape, args, wt, work_dir, seed)
        step_bytes = decode_bytes(model, prompt_len + gen_tokens // 2)
        runs = ours(model, prompt, gen_tokens, repeats, pipeline=True)
        value, samples = decode_metrics(runs, prompt_len)["tokens_per_s"]
        fields = {"model": shape, "weights": wt, "kv": dtype_name(model.norm.weight.dtype),
                  "context": prompt_len + gen_tokens, "variant": "native"}
        records += [record("decode-shape", "bits_per_weight", "bits", bits_per_weight, **fields),
                    record("decode-shape", "bytes_per_token", "B", step_bytes, **fields),
                    record("decode-shape", "tokens_per_s", "tok/s", value, samples=samples, **fields),
                    record("decode-shape", "bandwidth_fraction", "fraction",
                           step_bytes * value / 1e9 / roof, **fields)]
        del model
    return records


def this_machine(seconds: float = 2.0, array_mb: int = 256, matmul_n: int = 2048) -> Hardware:
    """Measure this machine's roofs live with numpy, best of as many runs as `seconds` allows (>= 3 each).

    Bandwidth: `np.copyto` between two `array_mb` MiB float64 arrays, counting 2 x array bytes per
    copy (one read, one write). Write-allocate caches may move a third array's worth unseen, so
    this is a lower bound on the traffic, as STREAM's Copy is. Peak: float32 `matmul_n`-square
    matmul through numpy's BLAS, 2 n^3 FLOPs, all cores -- a CPU float32 figure, not bf16.
    """
    src = np.ones(array_mb * 2**20 // 8)
    dst = np.zeros_like(src)
    a = np.ones((matmul_n, matmul_n), np.float32)
    b = np.ones((matmul_n, matmul_n), np.float32)
    copy_s = best(within(lambda: np.copyto(dst, src), seconds / 2, max_reps=10**9))
    matmul_s = best(within(lambda: a @ b, seconds / 2, max_reps=10**9))
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    return Hardware(f"this machine ({platform.machine()}, {os.cpu_count()} CPUs)", memory,
                    2 * src.nbytes / copy_s / 1e9, 2 * matmul_n**3 / matmul_s / 1e12,
                    f"float32 numpy matmul, n={matmul_n} (CPU)", "measured live on this machine")


# ---- live readings the claim ledger shows beside its verdicts, once per process --------------------------

@dataclass(frozen=True)
class MatmulTiming:
    """One weight matrix times one vector (GEMV) and times many (GEMM), timed on this machine, repeated."""
    machine: str
    shape: tuple[int, int]            # the float32 weight matrix (rows, cols)
    tokens: int                       # columns of the GEMM's right-hand side
    gemv_s: tuple[float, ...]         # seconds, one per repeat
    gemm_s: tuple[float, ...]
    copy_gbs: tuple[float, ...]       # `this_machine` per round: numpy's copy bandwidth and float32 matmul peak
    peak_gflops: tuple[float, ...]


@functools.cache
def measure_matmul(rows: int = 8192, cols: int = 4096, tokens: int = 256, rounds: int = 3) -> MatmulTiming:
    """Time one float32 weight matrix (rows x cols: 128 MiB, 4x a 32 MiB L3) times one vector (10
    repeats) and times `tokens` vectors (`rounds` repeats) with numpy, and this machine's roofs `rounds` times
    (`this_machine`): the GEMV against the GEMM that the ledger's C26 and C27 show beside their verdicts."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((rows, cols), dtype=np.float32)
    x, xs = rng.standard_normal(cols, dtype=np.float32), rng.standard_normal((cols, tokens), dtype=np.float32)
    gemv = repeat(lambda: w @ x, 10)
    gemm = repeat(lambda: w @ xs, rounds)
    machine = [this_machine(seconds=0.5, array_mb=128) for _ in range(rounds)]
    return MatmulTiming(machine[0].name, (rows, cols), tokens, tuple(gemv), tuple(gemm),
                        tuple(hw.bandwidth_gbs for hw in machine), tuple(hw.peak_tflops * 1e3 for hw in machine))


@dataclass(frozen=True)
class ForwardTiming:
    """Forward time of a model against prompt length, and decode-step time at two contexts, repeated."""
    shape: ModelShape
    lengths: tuple[int, ...]                  # tokens in one forward from an empty cache
    seconds: tuple[tuple[float, ...], ...]    # per length, one sample per round
    decode_contexts: tuple[int, int]          # context of the timed decode steps
    decode_seconds: tuple[tuple[float, ...], tuple[float, ...]]   # per context, one sample per step


@functools.cache
def measure_forward(path: Path = MODELS_DIR / "stdlib-10m.gguf", max_len: int = 512, rounds: int = 3,
                    steps: int = 8) -> ForwardTiming:
    """Time a forward of the model at `path` (the shipped one) for L = 1, 2, 4 ... max_len tokens
    (`forward_sweep`, `rounds` times) and `steps` decode steps at contexts 16 and max_len - 100, interleaved,
    on one BLAS thread: the sweep the ledger's C14 shows beside its verdict."""
    model, _ = load(path)
    tokens = mx.array(np.random.default_rng(0).integers(0, model.args.vocab_size, (1, max_len)))
    lengths = [2**i for i in range(max_len.bit_length()) if 2**i <= max_len]
    sweeps = [forward_sweep(model, lengths, repeats=1)[1] for _ in range(rounds)]
    contexts = (16, max_len - 100)
    with blas.one_blas_thread():
        caches = [model.make_cache(max_len) for _ in contexts]
        for cache, start in zip(caches, contexts):
            mx.eval(model(tokens[:, :start - 1], cache))   # the decode steps then run at start, start + 1, ...

        def step(cache):
            off = cache[0].offset
            mx.eval(model(tokens[:, off:off + 1], cache))
        decode = [[repeat(lambda c=c: step(c), 1, warmup=0)[0] for c in caches]   # interleaved
                  for _ in range(steps)]
    return ForwardTiming(model.args.shape(Path(path).stem), tuple(lengths), tuple(zip(*sweeps)),
                         contexts, tuple(tuple(col) for col in zip(*decode)))
