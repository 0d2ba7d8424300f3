"""Latency: where the time of a decode step goes, measured through MLX on this machine's default device.

What `ref_impl.theory.queue`'s queue model takes as given, and what the Dispatch part's claims say:
decode with a host sync per token, with `mx.async_eval` pipelining and with an `mx.eval` after every
layer (C01, C21); the first tokens of a fresh process and `mx.compile`'s tracing (C09, C28; on CUDA
MLX compiles kernels at run time and caches them on disk); the latency of one tiny kernel against
its size (C31); inter-token jitter and memory with static vs growing KV caches (C02, C16); TTFT and
ITL against context. Every function is bounded by its size and time arguments, seeded, evaluates
before each clock stop, and returns plain dataclasses whose field names carry their units.
`bench_dispatch` runs them all into results records (`python -m ref_impl bench --dispatch`); the
`measure_*` functions are the live readings the ledger shows beside its verdicts, timed once per process.

See chapter: dispatch
"""

from __future__ import annotations

import functools
import gc
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from ref_impl import ROOT
from ref_impl.engine.checkpoint import load
from ref_impl.engine.generate import Sampler, generate_step, prefill
from ref_impl.engine.kvcache import KVCache
from ref_impl.engine.kvquant import FLOATS, make_caches
from ref_impl.engine.model import Model, default_dtype
from ref_impl.engine.random import args_for, random_model
from ref_impl.measure.decode import ours
from ref_impl.measure.loads import WiredRead, wired_reads
from ref_impl.measure.records import dtype_name, record
from ref_impl.platform.timing import (TokenRun, calls_per_sample, clock, decode_metrics, interleaved, median, repeat,
                                      time_tokens, wall)

MODES = ("sync", "async_eval", "layer_eval")


def _prompt(model: Model, n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, model.args.vocab_size, size=n).tolist()


# ---- sync, async_eval and an eval per layer (C01, C21) -----------------------------------------------

def decode_layerwise(model: Model, token: mx.array, cache: list[KVCache]) -> mx.array:
    """`generate.decode_one_token` with an `mx.eval` after every transformer block: the host waits
    n_layers times per token, as when intermediate outputs are read back (C01). Token (B,) -> logits (B, V)."""
    h = model.embed(token[:, None])
    for layer, layer_cache in zip(model.layers, cache):
        h = layer(h, None, layer_cache)   # one position: no mask, as Model.__call__ passes
        mx.eval(h)
    h = model.norm(h)
    logits = model.embed_tokens.as_linear(h) if model.args.tie_word_embeddings else model.lm_head(h)
    return logits[:, -1, :]


def layer_eval_step(model: Model, prompt: list[int], sampler: Sampler, cache: list[KVCache]) -> Iterator[int]:
    """`generate_step(pipeline=False)` with every decode step run by `decode_layerwise`: the same tokens."""
    y = sampler(prefill(model, mx.array([prompt]), cache))
    mx.async_eval(y)
    while True:
        next_y = sampler(decode_layerwise(model, y, cache))
        yield y.item()
        y = next_y


def _stream(model: Model, mode: str, prompt: list[int], n: int) -> Iterator[int]:
    cache = model.make_cache(len(prompt) + n)
    if mode == "layer_eval":
        return layer_eval_step(model, prompt, Sampler(), cache)
    return generate_step(model, prompt, Sampler(), cache, pipeline=mode == "async_eval")


@dataclass
class DecodeRate:
    """Greedy decode of one model in one mode, over repeated runs."""
    mode: str                          # "sync", "async_eval" or "layer_eval"
    tokens_per_s: float                # median over runs (decode only: tokens after the first)
    tokens_per_s_runs: list[float]     # one per run, in run order (runs of all modes interleave)
    ttft_ms: float                     # median time to the first token (prefill)
    itl_p50_ms: float
    tokens: list[int]                  # the ids of the last run: every mode must give the same


def decode_modes(model: Model, prompt_len: int = 32, n_tokens: int = 64, repeats: int = 3,
                 modes: Sequence[str] = MODES, seed: int = 0) -> dict[str, DecodeRate]:
    """Decode n_tokens greedy tokens after a random prompt in each mode: "sync" (the host waits on
    each token: `generate_step(pipeline=False)`), "async_eval" (step t+1 queued before token t is
    read: pipeline=True) and "layer_eval" (an eval after every layer). One warm-up run per mode,
    then `repeats` rounds that run every mode once, so a busy neighbour slows all modes alike."""
    if prompt_len < 1 or n_tokens < 2 or repeats < 1 or not set(modes) <= set(MODES):
        raise ValueError(f"decode_modes needs prompt_len >= 1, n_tokens >= 2, repeats >= 1 and modes "
                         f"from {MODES}; got {prompt_len}, {n_tokens}, {repeats}, {list(modes)}")
    prompt = _prompt(model, prompt_len, seed)

    def run(mode: str) -> TokenRun:
        timed = time_tokens(_stream(model, mode, prompt, n_tokens), n_tokens)
        mx.synchronize()               # a pipelined run leaves one step queued: let it finish
        return timed

    runs = interleaved({mode: functools.partial(run, mode) for mode in modes}, repeats)
    out = {}
    for mode, r in runs.items():
        s = decode_metrics(r, prompt_len)
        out[mode] = DecodeRate(mode, s["tokens_per_s"][0], [float(x) for x in s["tokens_per_s"][1]],
                               s["ttft_ms"][0], s["itl_p50_ms"][0], r[-1].ids)
    return out


# ---- the first tokens of a process, and mx.compile's tracing (C09, C28) ------------------------------

def token_times_ms(model: Model, prompt_len: int = 16, n_tokens: int = 8, seed: int = 0) -> list[float]:
    """Milliseconds of each token of one synchronous generation: token 1 is prefill + sampling,
    token k > 1 one decode step. The first run of a process includes every kernel's first use."""
    prompt = _prompt(model, prompt_len, seed)
    cache = model.make_cache(prompt_len + n_tokens)
    run = time_tokens(generate_step(model, prompt, Sampler(), cache), n_tokens)
    mx.synchronize()
    return (np.diff([run.start, *run.times]) * 1e3).tolist()


@dataclass
class CompileCost:
    """A small elementwise function under `mx.compile`: first call (trace, fuse, build the kernel, run)
    against later calls, and against the same function uncompiled."""
    elements: int
    ops: int
    first_call_ms: float
    later_call_ms: float               # median of `calls` calls
    uncompiled_first_call_ms: float
    uncompiled_call_ms: float          # median of `calls` calls


def compile_cost(elements: int = 4096, ops: int = 8, calls: int = 20, seed: int = 0) -> CompileCost:
    """Time `mx.compile` of a chain of `ops` elementwise steps over a vector; run it first in a process
    (before anything else is compiled) to see the whole cost of a cold compile."""
    x = mx.random.normal((elements,), key=mx.random.key(seed))
    mx.eval(x)

    def f(x):
        for i in range(ops):
            x = mx.tanh(x) * 0.5 + (0.25 + i / 64)
        return x

    def ms(fn, n):        # no warm-up: the first call is the one measured
        return [t * 1e3 for t in repeat(lambda: mx.eval(fn(x)), n, warmup=0)]

    compiled = mx.compile(f)
    first = ms(compiled, 1)[0]
    later = median(ms(compiled, calls))
    un_first = ms(f, 1)[0]
    return CompileCost(elements, ops, first, later, un_first, median(ms(f, calls)))


@dataclass
class FirstCall:
    """One process that loads a model and generates: per-token times of each of its runs."""
    label: str                         # e.g. "fresh process, empty kernel cache"
    model: str
    startup_s: float                   # launch until the measuring code starts (interpreter, imports)
    load_ms: float                     # loading the model (its first kernels included)
    runs_token_ms: list[list[float]]   # run i, token k: ms (token 1: prefill)
    compile: CompileCost
    process_s: float                   # the whole process, launch to exit


def first_call_profile(model_path: str | Path, prompt_len: int = 16, n_tokens: int = 8, runs: int = 2,
                       seed: int = 0) -> dict:
    """In this process: `compile_cost` first, then load the GGUF model and time `runs` generations.
    What `python -m ref_impl.measure.latency first-call` prints (as JSON) for `first_call`."""
    began = wall()                # compared with the parent's clock: perf_counter's zero is per process
    cost = compile_cost(seed=seed)
    t0 = clock()
    model, _ = load(model_path, default_dtype())
    load_ms = (clock() - t0) * 1e3
    return {"began": began, "load_ms": load_ms, "compile": asdict(cost),
            "runs_token_ms": [token_times_ms(model, prompt_len, n_tokens, seed) for _ in range(runs)]}


def first_call(model_path: str | Path, prompt_len: int = 16, n_tokens: int = 8, runs: int = 2,
               processes: int = 2, timeout_s: float = 300.0, seed: int = 0) -> list[FirstCall]:
    """Run `first_call_profile` in `processes` fresh Python processes one after another, all sharing
    one new, empty on-disk kernel cache (MLX_PTX_CACHE_DIR: where MLX's CUDA backend keeps the kernels
    it compiles at run time): the first process compiles everything, later ones find it on disk.
    (On the CPU the directory is unused and processes differ only by the OS's file caches.)"""
    out = []
    with tempfile.TemporaryDirectory(prefix="mlx-kernels-") as cache_dir:
        env = {**os.environ, "MLX_PTX_CACHE_DIR": cache_dir}
        for i in range(processes):
            launched = wall()
            r = subprocess.run([sys.executable, "-m", "ref_impl.measure.latency", "first-call", str(model_path),
                                str(prompt_len), str(n_tokens), str(runs), str(seed)],
                               capture_output=True, text=True, timeout=timeout_s, env=env,
                               cwd=ROOT)
            ended = wall()
            if r.returncode != 0:
                tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
                raise RuntimeError(f"first-call process {i + 1} failed ({r.returncode}): {tail}")
            d = json.loads(r.stdout.strip().splitlines()[-1])
            label = "fresh process, empty kernel cache" if i == 0 else f"process {i + 1}, kernel cache on disk"
            out.append(FirstCall(label, Path(model_path).stem, d["began"] - launched, d["load_ms"],
                                 d["runs_token_ms"], CompileCost(**d["compile"]), ended - launched))
    return out


# ---- one tiny kernel against its size (C31) ----------------------------------------------------------

@dataclass(frozen=True)
class KernelLatency:
    """Wall time of evaluating `chain` elementwise adds (x + 1, ...) over `elements` float32 values
    in one graph: launch + sync dominate small sizes, memory traffic large ones."""
    elements: int
    chain: int
    compiled: bool                     # the chain fused into one kernel by mx.compile
    call_us: float                     # median of the timed rounds, per evaluated call
    per_op_us: float                   # call_us / chain
    gb_per_s: float                    # bytes read and written (once per kernel) over call_us


def _chain(k: int):
    def f(x):
        for _ in range(k):
            x = x + 1
        return x
    return f


def kernel_latency(sizes: Sequence[int] = tuple(4 ** k for k in range(13)), chains: Sequence[int] = (1, 16),
                   compiled: Sequence[bool] = (False,), target_s: float = 0.01, rounds: int = 5,
                   budget_s: float = 30.0, seed: int = 0) -> list[KernelLatency]:
    """Time `mx.eval` of a chain of adds per size (1 .. 2^24 elements by default), per chain length;
    each result is the median of `rounds` loops of about `target_s`. Sizes run smallest first and
    stop once `budget_s` has passed."""
    if min(sizes) < 1 or min(chains) < 1 or rounds < 1:
        raise ValueError("kernel_latency needs sizes >= 1, chains >= 1 and rounds >= 1")
    key, out, start = mx.random.key(seed), [], clock()
    for n in sorted(sizes):
        if clock() - start > budget_s:
            break
        x = mx.random.uniform(shape=(n,), key=key)
        mx.eval(x)
        for k in chains:
            for comp in compiled:
                fn = mx.compile(_chain(k)) if comp else _chain(k)
                mx.eval(fn(x))                                     # warm-up: the kernels' first use
                calls = calls_per_sample(lambda: mx.eval(fn(x)), target_s)
                call = median(repeat(lambda: mx.eval(fn(x)), rounds, warmup=0, calls=calls))
                moved = 2 * 4 * n * (1 if comp else k)
                out.append(KernelLatency(n, k, comp, call * 1e6, call * 1e6 / k, moved / call / 1e9))
    return out


def launch_floor(points: Sequence[tuple[int, float]], small: int = 4096) -> tuple[float, int | None]:
    """(launch floor, break-even size) from (elements, µs per op) points: the floor is the median over
    sizes up to `small` elements, where the work is negligible on any device; break-even is the first
    larger size whose time is at least twice the floor, where the work costs as much as the launch
    (None if none is). Sizes in the floor's range are not candidates: a slow one there is noise."""
    points = sorted(points)
    floor = float(np.median([t for n, t in points if n <= small] or [points[0][1]]))
    return floor, next((n for n, t in points if n > small and t >= 2 * floor), None)


def break_even(results: Sequence[KernelLatency], chain: int = 1, compiled: bool = False) -> dict:
    """`launch_floor` of one chain length's measurements."""
    rows = [(r.elements, r.per_op_us) for r in results if r.chain == chain and r.compiled == compiled]
    if not rows:
        raise ValueError(f"no results for chain={chain}, compiled={compiled}")
    floor, elements = launch_floor(rows)
    return {"launch_us": floor, "break_even_elements": elements}


# ---- live readings the ledger shows beside its verdicts, timed once per process (C15, C28, C31) ----------

@functools.cache
def measure_launch_floor(repeats: int = 3) -> tuple[str, tuple[float, ...]]:
    """(device, µs per add, `repeats` times): this machine's launch + sync floor through MLX (`launch_floor` of
    one add on 1 to 4096 float32 values)."""
    floors = tuple(launch_floor([(r.elements, r.per_op_us) for r in kernel_latency(
        sizes=(1, 16, 256, 4096), chains=(1,), target_s=0.005, rounds=3, budget_s=1.0)])[0] for _ in range(repeats))
    return str(mx.default_device()), floors


@functools.cache
def measure_compile(rounds: int = 5) -> tuple[CompileCost, ...]:
    """`compile_cost` `rounds` times: each round compiles a new function of the same graph, so the first pays
    what compiling it costs in this process (not a cold one: imports came first), later ones find it built."""
    return tuple(compile_cost(seed=i) for i in range(rounds))


@functools.cache
def measure_wired(nbytes: int = 16 << 20, tensor_bytes: int = 1 << 20,
                  rounds: int = 5) -> dict[str, tuple[WiredRead, ...]]:
    """`loads.wired_reads` of a small buffer, `rounds` passes of each variant, by variant."""
    reads = wired_reads(nbytes, tensor_bytes, rounds)
    return {v: tuple(w for w in reads if w.variant == v) for v in dict.fromkeys(w.variant for w in reads)}


# ---- static vs growing KV caches: jitter and memory (C02, C16) ---------------------------------------

@dataclass
class JitterRun:
    """One greedy pipelined generation with one KV-cache strategy."""
    strategy: str                      # a name of kvquant.FLOATS
    prompt_len: int
    tokens: int
    itl_ms: list[float]                # every inter-token latency, in order
    itl_p50_ms: float
    itl_p99_ms: float
    itl_max_ms: float
    tokens_per_s: float
    active_before_bytes: int           # mx.get_active_memory() before the caches exist
    active_after_bytes: int            # ... after the last token, caches alive
    peak_bytes: int                    # mx.get_peak_memory(), reset before the run
    cache_bytes: int                   # bytes the caches hold at the end
    token_ids: list[int]


def kv_jitter(model: Model, n_tokens: int = 1024, prompt_len: int = 16, strategies: Sequence[str] = FLOATS,
              warmup_tokens: int = 264, seed: int = 0) -> list[JitterRun]:
    """Generate n_tokens greedy tokens (async_eval pipelined) with each KV-cache strategy in turn and
    record every inter-token latency and the memory counters. A warm-up run of each strategy first
    (warmup_tokens, capped at n_tokens; 264 crosses one 256-step growth) takes kernel compilation out."""
    a = model.args
    size = prompt_len + n_tokens + 1
    if prompt_len < 1 or n_tokens < 2 or not set(strategies) <= set(FLOATS):
        raise ValueError(f"kv_jitter needs prompt_len >= 1, n_tokens >= 2, strategies from {FLOATS}")
    if size > a.max_position_embeddings:
        raise ValueError(f"prompt_len {prompt_len} + n_tokens {n_tokens} + 1 exceeds the model's context "
                         f"length ({a.max_position_embeddings})")
    prompt, dtype = _prompt(model, prompt_len, seed), model.norm.weight.dtype

    def caches(kind):
        return make_caches(kind, a.num_hidden_layers, 1, a.num_key_value_heads, a.head_dim, size, dtype)

    for kind in strategies:
        time_tokens(generate_step(model, prompt, Sampler(), caches(kind), pipeline=True), min(warmup_tokens, n_tokens))
        mx.synchronize()
    out = []
    for kind in strategies:
        gc.collect()
        mx.clear_cache()
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        cache = caches(kind)
        steps = generate_step(model, prompt, Sampler(), cache, pipeline=True)
        run = time_tokens(steps, n_tokens)
        mx.synchronize()
        after, peak = mx.get_active_memory(), mx.get_peak_memory()
        itl = np.diff(run.times) * 1e3
        out.append(JitterRun(kind, prompt_len, n_tokens, itl.tolist(), float(np.percentile(itl, 50)),
                             float(np.percentile(itl, 99)), float(itl.max()), 1e3 * len(itl) / itl.sum(),
                             before, after, peak, sum(c.nbytes for c in cache), run.ids))
        del steps, cache
    return out


# ---- TTFT against prompt length, ITL against context ----------------------------------------------

@dataclass
class ContextPoint:
    """Decode after a random prompt of `context` tokens (`decode.ours`, pipelined, median of runs)."""
    context: int
    ttft_ms: float                     # prefill of the prompt + the first token
    itl_p50_ms: float                  # decode steps starting at this context
    itl_p99_ms: float
    tokens_per_s: float


def context_sweep(model: Model, lengths: Sequence[int], n_tokens: int = 16, repeats: int = 1,
                  budget_s: float = 60.0, seed: int = 0) -> list[ContextPoint]:
    """TTFT and ITL at each prompt length (shortest first; lengths past the model's context are
    skipped). Stops before a length whose likely cost (the last one's, scaled by the length ratio)
    would overrun budget_s."""
    out, start, last = [], clock(), None
    for L in sorted(lengths):
        if L < 1 or L + n_tokens > model.args.max_position_embeddings:
            continue
        if last is not None and clock() - start + last[1] * L / last[0] > budget_s:
            break
        t0 = clock()
        s = decode_metrics(ours(model, _prompt(model, L, seed), n_tokens, repeats, pipeline=True), L)
        mx.synchronize()
        last = (L, clock() - t0)
        out.append(ContextPoint(L, s["ttft_ms"][0], s["itl_p50_ms"][0], s["itl_p99_ms"][0], s["tokens_per_s"][0]))
    return out


# ---- every measurement above, as results records -------------------------------------------------

@dataclass
class DispatchPlan:
    """Sizes and budgets for `bench_dispatch`; `for_device` picks them for a GPU, the CPU or a quick check."""
    prompt_len: int = 32
    decode_tokens: int = 128              # per run of decode_modes
    repeats: int = 5
    first_call_tokens: int = 16
    kernel_sizes: tuple[int, ...] = tuple(4 ** k for k in range(15))   # 1 .. 2^28 elements (1 GiB)
    kernel_chains: tuple[int, ...] = (1, 16)
    kernel_budget_s: float = 30.0
    kv_tokens: int = 2048                 # at most: fewer where decode is too slow for kv_budget_s
    kv_budget_s: float = 60.0             # per model
    wired_bytes: int = 1 << 30
    wired_repeats: int = 3
    contexts: tuple[int, ...] = (128, 512, 2048, 8192, 32768)
    context_tokens: int = 32
    context_repeats: int = 2
    context_budget_s: float = 60.0        # per model
    timeout_s: float = 300.0              # per first-call process (a cold CUDA kernel cache compiles all)

    @classmethod
    def for_device(cls, gpu: bool, quick: bool = False) -> DispatchPlan:
        if quick:   # seconds on a CPU: checks that everything runs, measures nothing well
            return cls(prompt_len=8, decode_tokens=6, repeats=1, first_call_tokens=3, kernel_sizes=(1, 256, 65536),
                       kernel_chains=(1, 4), kernel_budget_s=2.0, kv_tokens=24, kv_budget_s=5.0,
                       wired_bytes=4 << 20, wired_repeats=1, contexts=(8, 32), context_tokens=4,
                       context_repeats=1, context_budget_s=5.0, timeout_s=120.0)
        if gpu:
            return cls()
        return cls(prompt_len=16, decode_tokens=48, repeats=3, first_call_tokens=8,
                   kernel_sizes=tuple(4 ** k for k in range(11)), kernel_chains=(1, 8), kernel_budget_s=10.0,
                   kv_tokens=400, kv_budget_s=20.0, wired_bytes=64 << 20, wired_repeats=2, contexts=(16, 64, 256),
                   context_tokens=8, context_repeats=1, context_budget_s=20.0)


def _model_records(name: str, model: Model, plan: DispatchPlan, sweep: bool, seed: int) -> list[dict]:
    """dispatch-async, dispatch-layer-eval, kv-jitter and (if sweep) ttft/itl records of one model."""
    kv = dtype_name(model.norm.weight.dtype)
    fields = {"model": name, "weights": kv.upper(), "kv": kv}
    ctx = plan.prompt_len + plan.decode_tokens
    rec = []
    rates = decode_modes(model, plan.prompt_len, plan.decode_tokens, plan.repeats, MODES, seed)
    for mode, r in rates.items():
        exp = "dispatch-layer-eval" if mode == "layer_eval" else "dispatch-async"
        rec += [record(exp, "tokens_per_s", "tok/s", r.tokens_per_s, samples=r.tokens_per_s_runs, context=ctx,
                       variant=mode, **fields, agrees_with_sync=r.tokens == rates["sync"].tokens),
                record(exp, "itl_p50_ms", "ms", r.itl_p50_ms, context=ctx, variant=mode, **fields)]
    sync, piped, layer = rates["sync"], rates["async_eval"], rates["layer_eval"]
    # layer_eval's baseline is sync with one graph per token: repeat its rate under that experiment
    rec.append(record("dispatch-layer-eval", "tokens_per_s", "tok/s", sync.tokens_per_s,
                      samples=sync.tokens_per_s_runs, context=ctx, variant="per_token_graph", **fields))
    pairs = zip(piped.tokens_per_s_runs, sync.tokens_per_s_runs)
    rec.append(record("dispatch-async", "gain", "fraction", piped.tokens_per_s / sync.tokens_per_s - 1,
                      samples=[a / s - 1 for a, s in pairs], context=ctx, variant="async_eval", **fields))
    rec.append(record("dispatch-layer-eval", "slowdown", "fraction", 1 - layer.tokens_per_s / sync.tokens_per_s,
                      context=ctx, variant="layer_eval", **fields))
    per_sync_us = (1 / layer.tokens_per_s - 1 / sync.tokens_per_s) / model.args.num_hidden_layers * 1e6
    rec.append(record("dispatch-layer-eval", "extra_us_per_layer_eval", "us", per_sync_us, context=ctx,
                      variant="layer_eval", **fields, layers=model.args.num_hidden_layers))
    rec += _jitter_records(model, plan, piped.tokens_per_s, fields, seed)
    if sweep:
        for p in context_sweep(model, plan.contexts, plan.context_tokens, plan.context_repeats,
                               plan.context_budget_s, seed):
            rec += [record("ttft", "ttft_ms", "ms", p.ttft_ms, context=p.context, **fields),
                    record("itl", "itl_p50_ms", "ms", p.itl_p50_ms, context=p.context, **fields),
                    record("itl", "itl_p99_ms", "ms", p.itl_p99_ms, context=p.context, **fields),
                    record("itl", "tokens_per_s", "tok/s", p.tokens_per_s, context=p.context, **fields)]
    return rec


def _jitter_records(model: Model, plan: DispatchPlan, tokens_per_s: float, fields: dict, seed: int) -> list[dict]:
    """kv-jitter records of one model: as many tokens as plan.kv_budget_s allows at its pipelined rate."""
    room = model.args.max_position_embeddings - plan.prompt_len - 1
    n = max(16, min(plan.kv_tokens, room, int(plan.kv_budget_s * tokens_per_s / 6)))
    runs = kv_jitter(model, min(n, room), plan.prompt_len, warmup_tokens=min(264, n), seed=seed)
    float_ids = runs[0].token_ids
    rec = []
    for r in runs:
        where = {"context": r.prompt_len + r.tokens, "variant": r.strategy, **fields}
        match = float(np.mean(np.array(r.token_ids) == np.array(float_ids)))
        rec += [record("kv-jitter", metric, unit, value, samples=r.itl_ms if metric == "itl_ms" else (), **where)
                for metric, unit, value in (
                    ("itl_ms", "ms", float(np.mean(r.itl_ms))), ("itl_p50_ms", "ms", r.itl_p50_ms),
                    ("itl_p99_ms", "ms", r.itl_p99_ms), ("itl_max_ms", "ms", r.itl_max_ms),
                    ("tokens_per_s", "tok/s", r.tokens_per_s), ("peak_memory", "B", r.peak_bytes),
                    ("active_memory_before", "B", r.active_before_bytes),
                    ("active_memory_after", "B", r.active_after_bytes), ("cache_bytes", "B", r.cache_bytes),
                    ("greedy_agreement", "fraction", match))]
    return rec


def _first_call_records(model_path: Path, plan: DispatchPlan, seed: int) -> list[dict]:
    """first-call records: two fresh processes on the GGUF model, per run and token, and mx.compile's cost."""
    rec = []
    for p, fc in enumerate(first_call(model_path, plan.prompt_len, plan.first_call_tokens, 2, 2, plan.timeout_s, seed)):
        where = {"variant": f"process-{p + 1}", "process": p + 1, "kernel_cache": "empty" if p == 0 else "on disk"}
        for i, times in enumerate(fc.runs_token_ms):
            steady = median(times[2:]) if len(times) > 2 else float(times[-1])
            run = {"model": fc.model, "context": plan.prompt_len + plan.first_call_tokens, **where, "run": i + 1}
            rec += [record("first-call", "token_ms", "ms", times[0], samples=times, **run),
                    record("first-call", "steady_token_ms", "ms", steady, **run),
                    record("first-call", "first_over_steady", "ratio", times[0] / steady, **run)]
        rec += [record("first-call", metric, unit, value, model=fc.model, **where)
                for metric, unit, value in (("startup_s", "s", fc.startup_s), ("load_ms", "ms", fc.load_ms),
                                            ("process_s", "s", fc.process_s))]
        c = fc.compile
        rec += [record("first-call", metric, "ms", getattr(c, metric), **{**where, "variant": "mx.compile"},
                       elements=c.elements, ops=c.ops)
                for metric in ("first_call_ms", "later_call_ms", "uncompiled_first_call_ms", "uncompiled_call_ms")]
    return rec


def _kernel_latency_records(plan: DispatchPlan, seed: int) -> list[dict]:
    """kernel-latency records: per size and chain, plain and compiled; the launch floor and break-even."""
    lat = kernel_latency(plan.kernel_sizes, plan.kernel_chains, (False, True), budget_s=plan.kernel_budget_s, seed=seed)
    rec = []
    for r in lat:
        variant = f"chain={r.chain}" + (", compiled" if r.compiled else "")
        rec += [record("kernel-latency", metric, unit, getattr(r, metric), weights="F32", variant=variant,
                       elements=r.elements)
                for metric, unit in (("call_us", "us"), ("per_op_us", "us"), ("gb_per_s", "GB/s"))]
    for chain in plan.kernel_chains:
        be = break_even(lat, chain)
        rec += [record("kernel-latency", "launch_us", "us", be["launch_us"], weights="F32", variant=f"chain={chain}"),
                record("kernel-latency", "break_even_elements", "elements", be["break_even_elements"], weights="F32",
                       variant=f"chain={chain}")]
    return rec


def _wired_records(plan: DispatchPlan) -> list[dict]:
    """wired records: loads.wired_reads of a weight-sized buffer, first touch, prefaulted and mlocked."""
    rec = []
    for w in wired_reads(plan.wired_bytes, min(4 << 20, plan.wired_bytes), plan.wired_repeats):
        extra = {"variant": w.variant, "bytes": w.buffer_bytes, "tensor_bytes": w.tensor_bytes, "locked": w.locked,
                 "note": w.error}
        t = np.array(w.tensor_read_ms)
        rec += [record("wired", "read_ms", "ms", w.read_ms, **extra),
                record("wired", "read_bandwidth", "GB/s", w.gb_per_s, **extra),
                record("wired", "tensor_read_p50_ms", "ms", np.percentile(t, 50), **extra),
                record("wired", "tensor_read_p99_ms", "ms", np.percentile(t, 99), **extra),
                record("wired", "tensor_read_max_ms", "ms", t.max(), samples=t, **extra),
                record("wired", "minor_faults", "faults", w.minor_faults, **extra),
                record("wired", "major_faults", "faults", w.major_faults, **extra)]
    return rec


def bench_dispatch(model_path: str | Path, shapes: Sequence[str] | None = None, plan: DispatchPlan | None = None,
                   seed: int = 0, progress=None) -> list[dict]:
    """Every measurement of this section as results records: first-call (fresh processes on the GGUF
    model at model_path), kernel-latency, wired, then per model -- the GGUF model and a random-weight
    model of each shape ("tiny" or a Llama shape; default: tiny, Llama-3.2-1B, Llama-3.1-8B on a GPU,
    tiny on the CPU) -- dispatch-async, dispatch-layer-eval and kv-jitter, and ttft/itl for the GGUF
    model and the largest shape. `plan` sizes it all (default: DispatchPlan.for_device)."""
    gpu = mx.default_device() == mx.gpu
    plan = plan or DispatchPlan.for_device(gpu)
    shapes = list(shapes) if shapes is not None else (["tiny", "Llama-3.2-1B", "Llama-3.1-8B"] if gpu else ["tiny"])
    for s in shapes:
        args_for(s)                                   # an unknown shape fails before anything runs
    say = progress or (lambda msg: None)
    model_path = Path(model_path)
    if not model_path.is_file():
        raise OSError(f"no model file {model_path}")
    say("first-call: two fresh processes")
    rec = _first_call_records(model_path, plan, seed)
    say("kernel-latency")
    rec += _kernel_latency_records(plan, seed)
    say("wired")
    rec += _wired_records(plan)
    largest = max(shapes, key=lambda s: args_for(s).num_parameters, default=None)
    models = [(model_path.stem, None), *[(s, s) for s in shapes]]
    for name, shape in models:
        say(f"decode, kv-jitter{', ttft/itl' if shape in (None, largest) else ''}: {name}")
        if shape is None:
            model, _ = load(model_path, default_dtype())
        else:
            context = max(plan.prompt_len + plan.kv_tokens + 1, max(plan.contexts) + plan.context_tokens,
                          plan.prompt_len + plan.decode_tokens)
            model = random_model(args_for(shape, context), seed=seed)
        rec += _model_records(name, model, plan, shape in (None, largest), seed)
        del model
        gc.collect()
        mx.clear_cache()
    return rec


def _main(argv: list[str]) -> int:
    """`python -m ref_impl.measure.latency first-call MODEL PROMPT_LEN N_TOKENS RUNS SEED`: the child process of
    `first_call`; prints `first_call_profile`'s result as one JSON line."""
    if len(argv) != 6 or argv[0] != "first-call":
        print("usage: python -m ref_impl.measure.latency first-call MODEL PROMPT_LEN N_TOKENS RUNS SEED", file=sys.stderr)
        return 2
    model, *numbers = argv[1:]
    print(json.dumps(first_call_profile(model, *map(int, numbers))))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
