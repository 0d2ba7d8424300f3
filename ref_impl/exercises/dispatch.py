"""Exercises of the dispatch chapters: "Pipeline caching, static workspaces and wired memory" (Caching
tasks 1-3), "Time to first token and inter-token jitter" (Jitter tasks 1-2) and "Command buffers and sync
bubbles" (Dispatch tasks 1-2), all in book/dispatch/.

A first token's pause amortized, a static KV cache's bytes, page faults on first touch; p99 inter-token
latency and the decode steps where a chunked cache grows; a double-buffered queue's tokens/s and where
`async_eval` stops helping, from `theory.queue` on the public shapes of `theory.shapes`.

See chapter: dispatch
"""

from __future__ import annotations

import math
from dataclasses import replace

import mlx.core as mx
import numpy as np

from ref_impl.engine.kvquant import make_caches
from ref_impl.engine.random import args_for
from ref_impl.exercises.core import DTYPE_NAMES, Result, close, judge_cases, judge_exact, run_answer
from ref_impl.theory import queue, shapes
from ref_impl.theory import roofline as rl

# Chapter "Pipeline caching, static workspaces and wired memory" (book/dispatch/caching-workspaces) -------
# Its tasks are "Caching task 1" to "Caching task 3"; tests: `pytest tests/test_exercises_dispatch.py -k caching_task`.

def _amortized_case(first_ms: float, steady_ms: float, n_tokens: int):
    extra = first_ms - steady_ms
    right = extra / n_tokens
    mistakes = [
        (first_ms / n_tokens, "the first token would take a steady step anyway: only first − steady is overhead."),
        (extra / (n_tokens - 1), f"spread the pause over all {n_tokens} tokens, the first one included."),
        (extra, f"that is the whole pause; amortized means divided over the {n_tokens} tokens."),
        (steady_ms + right, "that is the mean time per token; the overhead is what the pause adds to it."),
        (right / 1e3, "give milliseconds, not seconds."),
        (right * 1e3, "the times are already in milliseconds."),
        (100 * right / steady_ms, "give milliseconds per token, not a percentage of the steady step."),
    ]
    label = f"first token {first_ms:g} ms, steady {steady_ms:g} ms, {n_tokens:,} tokens"
    return (first_ms, steady_ms, n_tokens), label, right, mistakes


def check_amortized_overhead(answer, first_ms: float = 6340.0, steady_ms: float = 0.92, n_tokens: int = 256) -> Result:
    """Caching task 1: the milliseconds a first-token pause adds to every token of a generation of
    `n_tokens` tokens, when the first token took `first_ms` and every later one `steady_ms`.

    `answer` is a number for the given case (default: an H200's fresh process, rounded), or a function
    `f(first_ms, steady_ms, n_tokens) -> ms per token` called on four cases.
    """
    cases = [_amortized_case(first_ms, steady_ms, n_tokens), _amortized_case(242.0, 1.09, 16),
             _amortized_case(27.6, 11.4, 8), _amortized_case(51_600.0, 18.0, 300)]
    return judge_cases("Caching task 1", answer, cases, "ms/token",
                       "overhead per token = (first_ms − steady_ms) / n_tokens.")


def _static_kv_case(shape: str, context: int, dtype_bytes: int):
    a = args_for(shape, max(context, 1))
    caches = make_caches("float", a.num_hidden_layers, 1, a.num_key_value_heads, a.head_dim, context,
                         getattr(mx, DTYPE_NAMES[dtype_bytes]))
    right = sum(c.nbytes for c in caches)            # lazy zeros: nbytes needs no allocation
    per_pos = right // context                       # bytes per cached position, all layers
    grown = -(-context // 256) * 256
    mistakes = [
        (right // 2, "a cache holds keys and values: two buffers per layer."),
        (right // a.num_hidden_layers, "every layer has its own cache: multiply by the number of layers."),
        (right * a.num_attention_heads // a.num_key_value_heads,
         "grouped-query attention caches num_key_value_heads heads, not num_attention_heads."),
        (right * 8, "bits vs bytes: dtype_bytes is already in bytes."),
        (per_pos * grown, "that is a chunked cache rounded up to 256 positions; a static cache holds exactly the "
                          "context."),
        (right * 4 // dtype_bytes, f"the cache is stored in {dtype_bytes}-byte values here, not 4."),
        (right * 2 // dtype_bytes, f"the cache is stored in {dtype_bytes}-byte values here, not 2."),
    ]
    label = f"{shape}, context {context:,}, {dtype_bytes}-byte values"
    return (a, context, dtype_bytes), label, right, mistakes


def check_static_kv_bytes(answer, shape: str = "Llama-3.1-8B", context: int = 8192, dtype_bytes: int = 2) -> Result:
    """Caching task 2: bytes a static (pre-allocated) KV cache holds for one sequence of `context`
    positions, as `kvquant.make_caches("float", ...)` allocates it.

    `answer` is a whole number of bytes for the given case, or a function `f(args, context, dtype_bytes)`
    taking a `model.ModelArgs` (fields num_hidden_layers, num_key_value_heads, num_attention_heads,
    head_dim) and called on four cases. Checked exactly against the caches' `nbytes`.
    """
    cases = [_static_kv_case(shape, context, dtype_bytes), _static_kv_case("Llama-3.2-1B", 2080, 2),
             _static_kv_case("Llama-3.1-8B", 1000, 4), _static_kv_case("Llama-3.2-3B", 131_072, 2)]
    return judge_exact("Caching task 2", answer, cases, "bytes = 2 (K and V) × layers × kv_heads × context × head_dim "
                       "× dtype_bytes.", int)


def _faults_case(nbytes: int, page: int):
    right = -(-nbytes // page)
    mistakes = [
        (nbytes // page, "a partly used last page faults too: round up."),
        (8 * nbytes // page, "bits vs bytes: the buffer size is in bytes."),
        (-(-nbytes // 4000), "a page is 4 KiB = 4,096 bytes, not 4,000."),
        (-(-nbytes // 4096), f"this machine's pages are {page:,} bytes (Apple silicon uses 16 KiB pages)."),
        (-(-nbytes // (2 << 20)), "that is 2 MiB huge pages; the buffer uses base pages."),
        (0, "a first touch maps every page, and each mapping is one minor fault."),
        (2 * right, "one fault per page: the first touch maps it, later reads find it mapped."),
    ]
    return (nbytes, page), f"{nbytes:,} bytes, {page:,}-byte pages", right, mistakes


def check_page_faults(answer, nbytes: int = 64 << 20, page: int = 4096) -> Result:
    """Caching task 3: minor page faults when a fresh anonymous buffer of `nbytes` is read for the first
    time, with `page`-byte pages (one fault per page, as `measure.loads.wired_reads` counts them).

    `answer` is a whole number for the given case, or a function `f(nbytes, page)` called on six cases.
    """
    cases = [_faults_case(nbytes, page), _faults_case(1 << 30, 4096), _faults_case(10_000, 4096),
             _faults_case(4096, 4096), _faults_case(64 << 20, 16384), _faults_case(1, 4096)]
    return judge_exact("Caching task 3", answer, cases, "faults = ceil(nbytes / page).", int)


# Chapter "Time to first token and inter-token jitter" (book/dispatch/ttft-jitter) --------------------
# Its tasks are "Jitter task 1" and "Jitter task 2"; tests: `pytest tests/test_exercises_dispatch.py -k jitter_task`.

P99_RTOL = 1e-6   # percentiles of the same trace: only float rounding separates a right answer


def _token_traces() -> list[tuple[np.ndarray, str]]:
    """Token timestamps (s) of seeded synthetic generations: lognormal ITLs around a few ms, with
    rare pauses, and lengths where linear interpolation, nearest rank and the max all differ."""
    out = []
    for seed, n, ms in ((0, 300, 5.0), (1, 1001, 0.75), (2, 151, 9.5), (3, 64, 2.0)):
        rng = np.random.default_rng(seed)
        itl = ms * rng.lognormal(0.0, 0.15, n)
        itl[rng.choice(n, max(1, n // 100), replace=False)] *= rng.uniform(5, 60, max(1, n // 100))
        out.append((12.5 + np.concatenate([[0.0], np.cumsum(itl)]) / 1e3, f"{n + 1} tokens, ITLs around {ms:g} ms"))
    return out


def _nearest_rank(x: np.ndarray, q: float) -> float:
    return float(np.sort(x)[math.ceil(q / 100 * len(x)) - 1])


def check_p99_itl(fn) -> Result:
    """Jitter task 1: `fn(token_times) -> p99 inter-token latency in ms`, from token timestamps in
    seconds (as `generate.Generation.token_times`). Accepted: the linear-interpolation percentile
    (numpy's default, the one `measure.latency.kv_jitter` records) or the nearest-rank one (the
    ceil(0.99 n)-th smallest ITL); called on four seeded traces."""
    task = "Jitter task 1"
    for times, label in _token_traces():
        value, failed = run_answer(task, label, fn, times.copy())
        if failed is not None:
            return failed
        itl = np.diff(times) * 1e3
        linear, rank = float(np.percentile(itl, 99)), _nearest_rank(itl, 99)
        if isinstance(value, (np.integer, np.floating)):
            value = float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return Result(False, f"{task} ({label}): expected one number of milliseconds, got {value!r}.")
        if close(value, linear, P99_RTOL) or close(value, rank, P99_RTOL):
            continue
        mistakes = [
            (linear / 1e3, "that is in seconds: the timestamps are seconds, give milliseconds (× 1000)."),
            (float(np.percentile(times, 99)) * 1e3, "percentile of the timestamps, not of the gaps between "
                                                    "them: take np.diff first."),
            (float(np.percentile(itl, 1)), "that is p1: the 99th percentile is near the slow end, "
                                            "99% of the ITLs are at or below it."),
            *[(v, "that is p1: the 99th percentile is near the slow end, 99% of the ITLs are at or below it.")
              for v in (_nearest_rank(itl, 1), *(float(np.sort(itl)[int(0.01 * m)]) for m in (len(itl) - 1, len(itl))))],
            (float(itl.max()), "that is the maximum; p99 is the value 99% of the ITLs are at or below."),
            (float(itl.mean()), "that is the mean; p99 is a percentile of the sorted ITLs."),
            (float(np.median(itl)), "that is the median (p50)."),
            (float(np.sort(itl)[min(len(itl) - 1, int(0.99 * len(itl)))]),
             "off by one rank: sorted[int(0.99 n)] is neither nearest rank (index ceil(0.99 n) − 1) "
             "nor interpolation."),
            (float(np.percentile(np.diff(times[:-1]) * 1e3, 99)), "you dropped the last interval."),
        ]
        hint = next((h for v, h in mistakes if close(value, v, 1e-6) and not close(v, linear, 1e-6)
                     and not close(v, rank, 1e-6)),
                    "p99 = np.percentile(np.diff(token_times) * 1e3, 99).")
        return Result(False, f"{task} ({label}): {value:,.6g} ms, not {linear:,.6g} (interpolated) or "
                             f"{rank:,.6g} (nearest rank). Hint: {hint}")
    return Result(True, f"{task}: right on all {len(_token_traces())} traces.")


def _engine_growth_steps(prompt_len: int, n_steps: int, step: int) -> list[int]:
    """The decode steps at which the engine's chunked cache grows, read off a real one (one head of width 1)."""
    cache = make_caches("chunked", 1, 1, 1, 1, prompt_len + n_steps, mx.float16, step=step)[0]
    prompt, one = mx.zeros((1, 1, prompt_len, 1), mx.float16), mx.zeros((1, 1, 1, 1), mx.float16)
    cache.update_and_fetch(prompt, prompt)
    grew = []
    for k in range(n_steps):
        size = cache.nbytes
        cache.update_and_fetch(one, one)
        if cache.nbytes > size:
            grew.append(k)
            mx.eval(cache.state)                     # keep the lazy graph short
    return grew


def _growth_case(prompt_len: int, n_steps: int, step: int = 256):
    right = _engine_growth_steps(prompt_len, n_steps, step)
    first = -(-prompt_len // step) * step            # the slips below: where the prefilled buffer ends
    shifted = [k - 1 for k in right if k >= 1]
    mistakes = [
        ([k for k in range(step, n_steps, step)], "positions count from the cache's start, and the prompt "
                                                  "already filled prompt_len of them: step k writes position "
                                                  "prompt_len + k."),
        ([pos - prompt_len for pos in range(first + step, prompt_len + n_steps, step)],
         "the first growth comes when the prefilled buffer is full, at the first multiple of step that is "
         ">= prompt_len."),
        (shifted, "off by one: step k writes position prompt_len + k; growth is at position = multiple of step. "
                  "(The ITL where the pause shows is one earlier, under pipelining; this asks for the step.)"),
        ([pos - prompt_len + 1 for pos in range(first, prompt_len + n_steps, step)],
         "off by one: step 0 writes position prompt_len, so step k writes prompt_len + k."),
    ]
    if prompt_len % step == 0:
        mistakes.insert(0, ([k for k in right if k > 0], "a prompt that exactly fills its buffer grows on "
                                                         "the very first decode step (k = 0)."))
    label = f"prompt of {prompt_len} tokens, {n_steps} decode steps, step {step}"
    return (prompt_len, n_steps, step), label, right, [(m, h) for m, h in mistakes if m is not None]


def check_growth_steps(fn) -> Result:
    """Jitter task 2: `fn(prompt_len, n_steps, step=256) -> list of decode-step indices` at which a
    `kvcache.ChunkedKVCache` grows. Decode step k (0-based) writes cache position prompt_len + k; the
    prefill allocated ceil(prompt_len / step) whole steps. Called on five cases, one prompt an exact
    multiple of step. Checked exactly against the growth rule of ChunkedKVCache.update_and_fetch."""
    cases = [_growth_case(32, 2048), _growth_case(16, 520), _growth_case(300, 1000), _growth_case(256, 600),
             _growth_case(5, 100, 16)]
    task = "Jitter task 2"
    for args, label, right, mistakes in cases:
        value, failed = run_answer(task, label, fn, *args)
        if failed is not None:
            return failed
        try:
            got = [int(k) for k in value]
        except (TypeError, ValueError):
            return Result(False, f"{task} ({label}): expected a list of step indices, got {value!r}.")
        if got == right:
            continue
        hint = next((h for m, h in mistakes if list(m) == got and list(m) != right),
                    "grow at every position pos = m·step with pos >= prompt_len and pos < prompt_len + n_steps; "
                    "step k = pos − prompt_len.")
        return Result(False, f"{task} ({label}): {got[:8]}{'…' if len(got) > 8 else ''}, not "
                             f"{right[:8]}{'…' if len(right) > 8 else ''}. Hint: {hint}")
    return Result(True, f"{task}: right on all {len(cases)} cases.")


# Chapter "Command buffers and sync bubbles" (book/dispatch/command-buffers) -------------------------------
# Its tasks are "Dispatch task 1" and "Dispatch task 2";
# tests: `pytest tests/test_exercises_dispatch.py -k dispatch_task`.

def _double_buffer_case(e: float, g: float, n: int, s: float, h: float):
    cfg = queue.QueueConfig(kernels_per_token=n, encode_s=e, gpu_s=g, kernels_per_buffer=n, commit_s=0.0,
                            sync_s=s, host_s=h, policy="double_buffer")
    right = 1 / queue.steady_period(cfg)
    sync = 1 / queue.steady_period(replace(cfg, policy="per_token"))
    cpu, gpu = n * e + s + h, n * g
    mistakes = [
        (sync, "that is the synchronous queue (per_token: encode, run, wait, one after the other); double "
               "buffering overlaps the CPU's work with the GPU's: take the max."),
        (1 / max(n * e, n * g), "the sync s and the host work h happen on the CPU every token: they belong on the "
                                "CPU's side of the max, with n·e."),
        (1 / max(cpu, gpu + s + h), "s and h are the CPU's: the GPU's side is n·g alone."),
        (1 / max(e + s + h, g), "e and g are per kernel: a token has n kernels, so n·e and n·g."),
        (max(cpu, gpu), "that is seconds per token; the answer is tokens per second."),
        (1 / cpu, "that is the CPU's side alone (or the faster side): here the GPU is the slower one "
                  "(n·g > n·e + s + h), and the slower side sets the pace: take the max."),
        (1 / gpu, "that is the GPU's side alone (or the faster side): here the CPU is the slower one "
                  "(n·e + s + h > n·g), and the slower side sets the pace: take the max."),
    ]
    label = f"e = {e * 1e6:g} µs, g = {g * 1e6:g} µs, n = {n}, s = {s * 1e6:g} µs, h = {h * 1e6:g} µs"
    return (e, g, n, s, h), label, right, mistakes


def check_double_buffer_tokens_per_s(answer, e: float = 4e-6, g: float = 3e-6, n: int = 300, s: float = 30e-6,
                                     h: float = 80e-6) -> Result:
    """Dispatch task 1: steady tokens/s of a double-buffered queue, one command buffer per token, no commit cost:
    encode e and run g seconds per kernel, n kernels per token, sync s and host work h per token.

    `answer` is a number for the given case, or a function `f(e, g, n, s, h) -> tokens/s` called on four cases
    (CPU-bound and GPU-bound). Checked against `queue.steady_period(..., policy="double_buffer")`.
    """
    cases = [_double_buffer_case(e, g, n, s, h), _double_buffer_case(2e-6, 20e-6, 400, 20e-6, 60e-6),
             _double_buffer_case(3e-6, 6e-6, 120, 40e-6, 100e-6), _double_buffer_case(1e-6, 8e-6, 1000, 10e-6, 5e-6)]
    return judge_cases("Dispatch task 1", answer, cases, "tokens/s",
                       "the CPU spends n·e + s + h per token, the GPU n·g; with two tokens in flight they overlap, so "
                       "a token takes max(n·e + s + h, n·g) seconds: tokens/s is one over that.")


# the models of Dispatch task 2's table, smallest first: the course's shipped model to the largest public shape
GAIN_MODELS = ("stdlib-10m", "Llama-3.2-1B", "Llama-3.2-3B", "Llama-3.1-8B", "Qwen3-14B", "Qwen3-32B",
               "Llama-3.1-70B", "Llama-3.1-405B")


def async_gain_table(host_us_per_layer: float = 40.0, gbs: float = 1000.0, bits: float = 16.0,
                     sync_us: float = 30.0, host_us: float = 100.0) -> list[dict]:
    """Sync and pipelined tokens/s of GAIN_MODELS on one machine, from the queue model: the host builds each
    token's graph (host_us_per_layer per layer), the GPU streams the weights at `gbs` GB/s. One command buffer
    per token; per_token for sync, double_buffer for async_eval. Rounded to 0.01 tok/s, as a results table."""
    rows = []
    for name in GAIN_MODELS:
        s = shapes.shape(name)
        layers = s.num_hidden_layers
        cfg = queue.QueueConfig(kernels_per_token=layers, encode_s=host_us_per_layer * 1e-6,
                                gpu_s=rl.weight_bytes(s, bits) / (gbs * 1e9) / layers, kernels_per_buffer=layers,
                                commit_s=0.0, sync_s=sync_us * 1e-6, host_s=host_us * 1e-6)
        sync, piped = (1 / queue.steady_period(replace(cfg, policy=p)) for p in ("per_token", "double_buffer"))
        rows.append({"model": name, "params_b": rl.param_count(s) / 1e9, "layers": layers,
                     "sync_tok_s": round(sync, 2), "async_tok_s": round(piped, 2)})
    return rows


def _stops(table: list[dict], threshold: float, gain) -> str | None:
    rows = sorted(table, key=lambda r: r["params_b"])
    gains = [gain(r) for r in rows]
    peak = int(np.argmax(gains))
    return next((r["model"] for r, x in zip(rows[peak + 1:], gains[peak + 1:]) if x < threshold), None)


def _stops_case(threshold: float, **machine):
    table = async_gain_table(**machine)
    rows = sorted(table, key=lambda r: r["params_b"])
    right = _stops(table, threshold, lambda r: r["async_tok_s"] / r["sync_tok_s"] - 1)
    gains = [r["async_tok_s"] / r["sync_tok_s"] - 1 for r in rows]
    peak = int(np.argmax(gains))
    names = [r["model"] for r in rows]
    at = names.index(right) if right in names else len(names)
    mistakes = [
        (next((r["model"] for r, x in zip(rows, gains) if x < threshold), None),
         "the smallest models gain little too (their GPU work is too short to hide the host's): look only at "
         "models larger than the one where async helps most."),
        (names[peak], "that is where async_eval helps most; the question is where its gain drops under the threshold."),
        (_stops(table, threshold, lambda r: 1 - r["sync_tok_s"] / r["async_tok_s"]),
         "the gain is async / sync − 1 (how much faster pipelining is), not 1 − sync / async (how much slower "
         "syncing is)."),
        (names[at - 1] if at - 1 > peak else None, "that model still gains at least the threshold: the answer is "
                                                    "the next larger one."),
        (_stops(table, threshold, lambda r: r["sync_tok_s"] / r["async_tok_s"] - 1),
         "sync / async − 1 is negative everywhere: the gain is async / sync − 1."),
    ]
    label = (f"{machine.get('host_us_per_layer', 40):g} µs of host work per layer, "
             f"{machine.get('gbs', 1000):g} GB/s, threshold {threshold:.0%}")
    return (table, threshold), label, right, mistakes


def check_async_stops_helping(answer, threshold: float = 0.10) -> Result:
    """Dispatch task 2: in a table of sync and async_eval tokens/s by model (`async_gain_table`), the smallest
    model larger than the one with the largest gain (async / sync − 1) whose gain is under `threshold`; None if
    there is none.

    `answer` is a model name for the default table, or a function `f(table, threshold) -> name or None` called
    on four tables (machines with different host and memory speeds).
    """
    cases = [_stops_case(threshold), _stops_case(0.13, host_us_per_layer=150.0, gbs=1000.0),
             _stops_case(0.05, host_us_per_layer=60.0, gbs=3000.0),
             _stops_case(0.05, host_us_per_layer=20.0, gbs=400.0)]
    return judge_exact("Dispatch task 2", answer, cases,
                       "gain = async_tok_s / sync_tok_s − 1 per model; find the model with the largest gain; the "
                       "answer is the first larger model whose gain is under the threshold.", str)
