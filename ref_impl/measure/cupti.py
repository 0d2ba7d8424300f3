"""Where a decode token's time goes on the GPU's own clock: every kernel's time from CUPTI ("kernel-profile").

A host-side timer sees a token's wall time; it cannot say how long the GPU worked in it. CUPTI, NVIDIA's
profiling interface, records the start and end of every kernel the device runs, MLX's included; PyTorch's
profiler (`torch.profiler`, CUDA activity) reads it. `profiled_decode` profiles pipelined greedy decode
(async_eval, as `fusedlayer.decode_seconds` runs it) and `profile_records` turns the kernels it saw into
records: per kernel its calls a token, µs a call and ms a token; per token the wall time, the time the GPU
was busy at all (the union of the kernels' intervals) and tokens/s. The rest of the wall time the GPU
waited for the host.

`bench_kernel_profile` (`python -m ref_impl bench --kernel-profile`) profiles random Llama-3.1-8B-shaped
models (`layerlaunch.mix_model`: "q4q8" and float16) decoded by MLX's built-ins ("unfused") and by the fused
layers ("fused") under each launch setting given as data (`layerlaunch.Setting`), and checks each fused
setting's logits of one step against the unfused layers' (`step_error`).

References: PyTorch profiler (torch.profiler.profile, ProfilerActivity.CUDA, FunctionEvent.time_range);
NVIDIA CUPTI Activity API (kernel records with device start and end timestamps).
See chapter: dispatch-kernel
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ref_impl.engine.generate import decoder, prefill
from ref_impl.engine.model import Model
from ref_impl.kernels import fusedlayer
from ref_impl.measure.layerlaunch import (MIXES, Setting, applied, fused_or_skipped, launch_fields, mix_model,
                                          needs_cuda, relaunch)
from ref_impl.measure.records import record
from ref_impl.platform.timing import clock

NAME_CHARS = 60   # a kernel other than ours is named by this many characters of its demangled name

# the launch settings profiled per weights: today's defaults (five launches a layer), each pair of kernels merged
# into one launch alone and both, int8 activations, and attend without its prefetch of attn_out's matrix
SETTINGS: dict[str, tuple[Setting, ...]] = {
    "q4q8": (Setting(), Setting(merge=("attention",)), Setting(merge=("mlp",)), Setting(merge=("attention", "mlp")),
             Setting(int8=True), Setting(prefetch=False)),
    "F16": (Setting(), Setting(merge=("attention",)), Setting(prefetch=False)),
}


@dataclass(frozen=True)
class KernelEvent:
    """One kernel the GPU ran: its demangled name and its start and end on the device's clock (µs)."""
    name: str
    start_us: float
    end_us: float


def kernel_name(name: str) -> str:
    """A fused-layer kernel by its short name ("attn_in", ...: its name carries ref_layer_<kernel>_), any
    other kernel by its first NAME_CHARS characters."""
    return next((k for k in fusedlayer.KERNELS if f"ref_layer_{k}_" in name), name[:NAME_CHARS])


def busy_us(events: Sequence[KernelEvent]) -> float:
    """µs during which at least one kernel ran: the union of the kernels' intervals."""
    busy, end = 0.0, -np.inf
    for e in sorted(events, key=lambda e: e.start_us):
        if e.end_us > end:
            busy += e.end_us - max(e.start_us, end)
            end = e.end_us
    return busy


def profile_records(events: Sequence[KernelEvent], tokens: int, wall_s: float, fields: dict) -> list[dict]:
    """kernel-profile records of `tokens` decoded in `wall_s` seconds while the GPU ran `events`: tokens/s,
    wall and GPU-busy ms a token, then per kernel (`kernel_name`; most time a token first) µs a call, with its
    calls a token, and ms a token."""
    per: dict[str, list[float]] = defaultdict(list)
    for e in events:
        per[kernel_name(e.name)].append(e.end_us - e.start_us)
    out = [record("kernel-profile", "tokens_per_s", "tok/s", tokens / wall_s, **fields),
           record("kernel-profile", "wall_ms_per_token", "ms", wall_s * 1e3 / tokens, **fields),
           record("kernel-profile", "busy_ms_per_token", "ms", busy_us(events) / 1e3 / tokens, **fields,
                  note="the union of the kernels' intervals on the GPU's clock")]
    for name, us in sorted(per.items(), key=lambda kv: -sum(kv[1])):
        out += [record("kernel-profile", "us_per_call", "us", float(np.mean(us)), **fields, kernel=name,
                       calls_per_token=len(us) / tokens),
                record("kernel-profile", "ms_per_token", "ms", sum(us) / 1e3 / tokens, **fields, kernel=name)]
    return out


def kernel_events(prof) -> list[KernelEvent]:
    """The kernels of a finished torch.profiler.profile (CUDA activity): every device event that took time."""
    return [KernelEvent(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
            if e.device_type.name == "CUDA" and e.device_time_total > 0]


def profiled_decode(model: Model, tokens: int = 16, context: int = 256) -> tuple[float, list[KernelEvent]]:
    """(wall seconds, kernels) of `tokens` pipelined greedy decode steps after a `context`-token prompt of
    zeros and three untimed steps, only the timed steps profiled."""
    from torch.profiler import ProfilerActivity, profile

    cache = model.make_cache(context + tokens + 8)
    y = mx.argmax(prefill(model, mx.zeros((1, context), dtype=mx.int32), cache), axis=-1)
    step = decoder(model, cache)
    for _ in range(3):
        y = mx.argmax(step(y), axis=-1)
        mx.eval(y)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = clock()
        for _ in range(tokens):
            y = mx.argmax(step(y), axis=-1)
            mx.async_eval(y)
        mx.eval(y)
        wall = clock() - start
    return wall, kernel_events(prof)


def step_logits(model: Model, fused: bool) -> np.ndarray:
    """The logits of one decode step after an 8-token prompt, with the fused layers on or off."""
    fusedlayer.enable(model, fused)
    cache = model.make_cache(64)
    y = mx.argmax(prefill(model, mx.arange(1, 9, dtype=mx.int32)[None], cache), axis=-1)
    out = decoder(model, cache)(y).astype(mx.float32)
    mx.eval(out)
    return np.array(out)


def step_error(model: Model, reference: np.ndarray) -> float:
    """max |fused - unfused| / max |unfused| of one step's logits, the fused layers as they are launched now."""
    return float(np.abs(step_logits(model, True) - reference).max() / np.abs(reference).max())


def torch_missing() -> str | None:
    """Why CUPTI cannot be read here (PyTorch or its CUDA missing), or None."""
    try:
        import torch
    except ImportError as e:
        return f"needs PyTorch's profiler for CUPTI's kernel times: {e}"
    return None if torch.cuda.is_available() else "needs PyTorch with CUDA for CUPTI's kernel times"


def weights_records(weights: str, shape: str, settings: Sequence[Setting], tokens: int, context: int,
                    say: Callable[[str], None]) -> list[dict]:
    """kernel-profile records of one weights mix: MLX's built-ins, then the fused layers per setting."""
    model = mix_model(weights, shape)
    fields = {"model": shape, "weights": weights, "kv": "f16", "context": context, "tokens": tokens}
    refused = fused_or_skipped("kernel-profile", model, fields)
    if refused:
        return refused
    reference = step_logits(model, False)
    wall, events = profiled_decode(model, tokens, context)
    out = profile_records(events, tokens, wall, {**fields, "variant": "unfused"})
    for setting in settings:
        with applied(setting):
            relaunch(model, setting.int8)
            extra = {"variant": "fused", "setting": setting.label, "launch": launch_fields(weights != "F16"),
                     "changed": setting.changed}
            error = step_error(model, reference)
            wall, events = profiled_decode(model, tokens, context)
        rec = profile_records(events, tokens, wall, {**fields, **extra})
        out += rec + [record("kernel-profile", "logits_error", "fraction", error, **fields, **extra,
                             note="max |fused - unfused| / max |unfused| of one step's logits")]
        say(f"kernel-profile {weights} fused {setting.label}: {rec[0]['value']:.1f} tok/s, wall {rec[1]['value']:.2f}, "
            f"GPU busy {rec[2]['value']:.2f} ms/token, logits error {error:.1e}")
    relaunch(model)
    return out


def bench_kernel_profile(shape: str = "Llama-3.1-8B", settings: Mapping[str, Sequence[Setting]] | None = None,
                         tokens: int = 16, context: int = 256, weights: Sequence[str] = MIXES,
                         progress: Callable[[str], None] | None = None) -> list[dict]:
    """CUPTI's kernel times of pipelined decode of random `shape` models of each of `weights`, by MLX's
    built-ins and by the fused layers under each of their settings (SETTINGS); the fused logits' error.
    Off MLX's CUDA backend, or without PyTorch's CUDA profiler: one "skipped" record, at once."""
    out = needs_cuda("kernel-profile", model=shape)
    missing = None if out else torch_missing()
    if out or missing:
        return out or [record("kernel-profile", "skipped", None, None, model=shape, note=f"skipped: {missing}")]
    import torch

    torch.cuda.init()
    chosen = SETTINGS if settings is None else settings
    for w in weights:
        out += weights_records(w, shape, chosen.get(w, (Setting(),)), tokens, context, progress or (lambda m: None))
        mx.clear_cache()
    return out
