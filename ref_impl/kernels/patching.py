"""Patching a model: swap its matrices for the kernels' layers and choose, per shape, ours or MLX's.

`patch(model)` swaps each nn.Linear and affine nn.QuantizedLinear for a `GEMVLinear` with the same
parameters (fuse=True: also each engine.model.MLP for a `GatedMLP`, and each attention's q/k/v projections
for one `FusedQKV` call). On MLX's CUDA backend a short measurement per (format, shape, rows) on the
model's own weights picks the fastest of a few launches and MLX's built-in (fused groups: against their
unfused calls), and records it (`Choice`): many calls queued in one mx.eval, the graph built before the
clock starts, so the time per call is the GPU's (MLX encodes while the GPU runs; independent calls in one
CUDA graph may overlap, so small matrices look better than in a chain: bench --kernels times the
decoder's matrices as a chain too). Other row counts, other backends (CPU; Metal, where MLX's quantized
kernels are already strong) and tied embeddings keep MLX's built-ins; `enable` switches the choices on
and off.

A decode step with our kernels can still wait on the host: MLX builds a step's graph in Python and encodes
it primitive by primitive (its CUDA backend rebuilds its CUDA graphs node by node at every evaluation,
mlx/backend/cuda/device.cpp, CommandEncoder::commit), so `count_kernels`, the primitives per step, is what
fusion cuts; llama.cpp captures a decode step's kernels as one CUDA graph and replays it (GGML_CUDA_GRAPHS).
bench --kernels records the breakdown; `gemv_sweep` gives its per-matrix records.
See chapter: dispatch-kernel
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from ref_impl.engine.generate import decoder
from ref_impl.engine.model import MLP, Attention
from ref_impl.kernels.launch import DTYPES, MAX_ROWS, Format, Launch, candidates, launch_config
from ref_impl.kernels.layers import FusedQKV, GatedMLP, GEMVLinear, format_of, on_cuda, random_layer
from ref_impl.platform.timing import best, clock

BUILTIN = "mlx built-in"
UNFUSED = "unfused"


@dataclass
class Choice:
    """What a measurement chose for one (format, shape, rows): a launch or MLX's built-in (None), with the
    seconds per call of every variant timed (queued), their host seconds to build, and failed variants'
    errors. fuse "glu"/"qkv": a fused group, against the unfused calls ("unfused")."""
    fmt: Format
    n: int
    k: int
    rows: int
    layers: int
    launch: Launch | None
    seconds: dict[str, float] = field(default_factory=dict)
    host: dict[str, float] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    fuse: str = ""
    parts: tuple[int, ...] = ()


# --- timing ----------------------------------------------------------------------------------------------

def _timed(make: Callable[[], list], reps: int) -> tuple[float, float]:
    """(eval, build): the best (minimum) seconds of mx.eval on a graph from make(), built before the clock
    starts, over reps after one warm-up (which compiles), and the best seconds make() took. The minimum:
    a queued batch's noise (a preempted host, a busy GPU) only ever adds time."""
    mx.eval(make())
    evals, builds = [], []
    for _ in range(reps):
        t0 = clock()
        outs = make()
        t1 = clock()
        mx.eval(outs)
        t2 = clock()
        builds.append(t1 - t0)
        evals.append(t2 - t1)
    return best(evals), best(builds)


def time_calls(calls: dict[str, Sequence[Callable[[mx.array], object]]], x: mx.array, passes: int, reps: int = 5
               ) -> tuple[dict[str, float], dict[str, float], dict[str, str]]:
    """Per label: seconds per call of `passes` rounds of every function in its list on x, queued in one
    mx.eval (graph built first, untimed: the time per call is the kernel's, with MLX's encoding overlapping
    it), the host seconds per call to build that graph, and the labels that failed (an NVRTC compile
    error, which MLX raises at eval) with their message."""
    per_call, host, errors = {}, {}, {}
    for label, fns in calls.items():
        try:
            ev, build = _timed(lambda: [f(x) for _ in range(passes) for f in fns], reps)
        except RuntimeError as e:
            errors[label] = str(e)
            continue
        per_call[label], host[label] = ev / (passes * len(fns)), build / (passes * len(fns))
    return per_call, host, errors


def activation(fmt: Format, rows: int, k: int, seed: int = 0) -> mx.array:
    """Random activations x (rows, k) in fmt's dtype, evaluated: what the timings call the matrices on."""
    x = (mx.random.normal((rows, k), key=mx.random.key(seed)) * 0.1).astype(DTYPES[fmt.dtype])
    mx.eval(x)
    return x


def _passes(nbytes: int, calls: int, min_bytes: int) -> int:
    """Rounds over `calls` matrices of nbytes each so a timing reads at least min_bytes (more than L2)."""
    return max(1, min(64, -(-min_bytes // (calls * nbytes))))


def time_variants(layers: Sequence[GEMVLinear], rows: int, launches: Sequence[Launch], reps: int = 5,
                  min_bytes: int = 256 << 20, seed: int = 0
                  ) -> tuple[dict[str, float], dict[str, float], dict[str, str]]:
    """time_calls for MLX's built-in and each launch over all `layers` (same format and shape) in turn,
    repeated until min_bytes of weights are read per timing."""
    n, k = layers[0].shape
    x = activation(layers[0].fmt, rows, k, seed)
    calls = {BUILTIN: [m.builtin for m in layers]}
    calls.update({la.label: [m.bind(la) for m in layers] for la in launches})
    return time_calls(calls, x, _passes(layers[0].fmt.weight_bytes(n, k), len(layers), min_bytes), reps)


# --- choosing --------------------------------------------------------------------------------------------

def _launches(fmt: Format, n: int, k: int, rows: int, measure: bool, fuse: str = "", parts: tuple = ()
              ) -> list[Launch]:
    """The launches to time (measure) or the default alone; none for a k the kernels cannot tile."""
    try:
        return candidates(fmt, n, k, rows, fuse, parts) if measure else [
            launch_config(fmt, n, k, rows, fuse=fuse, parts=parts)]
    except ValueError:     # e.g. k not a multiple of 8: the built-in
        return []


def _choose(choice: Choice, launches: Sequence[Launch], baseline: str) -> None:
    """Set choice.launch to the fastest timed launch, or None when `baseline` was fastest."""
    fastest = min(choice.seconds, key=choice.seconds.get) if choice.seconds else baseline
    choice.launch = next((la for la in launches if la.label == fastest), None)


def _choose_single(swapped: Sequence[GEMVLinear], rows: Sequence[int], measure: bool, reps: int) -> list[Choice]:
    """Per (format, shape) and row count, our fastest launch or MLX's built-in (BUILTIN), used by every
    matrix of that shape."""
    groups: dict[tuple[Format, int, int], list[GEMVLinear]] = {}
    for m in swapped:
        groups.setdefault((m.fmt, *m.shape), []).append(m)
    choices = []
    for (fmt, n, k), layers in groups.items():
        for r in rows:
            launches = _launches(fmt, n, k, r, measure)
            choice = Choice(fmt, n, k, r, len(layers), launches[0] if launches else None)
            if measure and launches:
                choice.seconds, choice.host, choice.errors = time_variants(layers, r, launches, reps)
                _choose(choice, launches, BUILTIN)
            for m in layers:
                m.use(r, choice.launch)
            choices.append(choice)
    return choices


def _choose_fused(items: Sequence[GatedMLP | FusedQKV], fuse: str, rows: Sequence[int], measure: bool, reps: int,
                  min_bytes: int = 256 << 20) -> list[Choice]:
    """Per shape and row count, the fastest fused launch or the unfused calls (UNFUSED), as patch does."""
    groups: dict[tuple, list] = {}
    for it in items:
        first = it.gate_proj if fuse == "glu" else it.mods[0]
        parts = () if fuse == "glu" else it.shape[0]
        groups.setdefault((first.fmt, first.shape, parts), []).append(it)
    choices = []
    for (fmt, (n, k), parts), its in groups.items():
        total = sum(parts) if parts else n
        for r in rows:
            launches = _launches(fmt, total, k, r, measure, fuse, parts)
            choice = Choice(fmt, total, k, r, len(its), launches[0] if launches else None, fuse=fuse, parts=parts)
            if measure and launches:
                calls = {UNFUSED: [it.hidden if fuse == "glu" else it.unfused for it in its]}
                calls.update({la.label: [it.bind(la) for it in its] for la in launches})
                nbytes = launches[0].bytes - 2 * r * (k + total)
                choice.seconds, choice.host, choice.errors = time_calls(
                    calls, activation(fmt, r, k), _passes(nbytes, len(its), min_bytes), reps)
                _choose(choice, launches, UNFUSED)
            for it in its:
                it.use(r, choice.launch)
            choices.append(choice)
    return choices


# --- the patch -------------------------------------------------------------------------------------------

def patch(model: nn.Module, rows: Sequence[int] = (1,), measure: bool = True, fuse: bool = False,
          reps: int = 5) -> list[Choice]:
    """Swap every nn.Linear / affine nn.QuantizedLinear the kernels can run for a GEMVLinear (fuse: and each
    model.MLP for a GatedMLP, each attention's q/k/v for a FusedQKV). On MLX's CUDA backend, per (format,
    shape) and row count in `rows`, choose our fastest launch or MLX's built-in by timing them on the
    model's own weights (measure=False: launch_config's default, untimed); fused groups against their
    unfused calls. Elsewhere nothing is chosen and every call stays MLX's built-in. Returns the choices."""
    if not rows or any(not 1 <= r <= MAX_ROWS for r in rows):
        raise ValueError(f"rows {list(rows)}: each must be 1 to {MAX_ROWS}")
    swaps = [(name, GEMVLinear(m, fmt)) for name, m in model.named_modules() if (fmt := format_of(m)) is not None]
    model.update_modules(tree_unflatten(swaps))
    mlps, qkvs = [], []
    if fuse:
        # the fused gate-up kernel computes SwiGLU: Gemma's GeGLU and Phi-3's one gate-up matrix step aside
        mlps = [(name, GatedMLP(m)) for name, m in model.named_modules()
                if type(m) is MLP and m.act is nn.silu and "gate_proj" in m
                and _fusable((m.gate_proj, m.up_proj), same_n=True)]
        model.update_modules(tree_unflatten(mlps))
        for _, m in model.named_modules():
            if isinstance(m, Attention) and "q_proj" in m and _fusable((m.q_proj, m.k_proj, m.v_proj), same_n=False):
                m.qkv = FusedQKV(m.q_proj, m.k_proj, m.v_proj)   # replaces Attention.qkv on this instance
                qkvs.append(m.qkv)
    choices = []
    if on_cuda():
        choices += _choose_single([m for _, m in swaps], rows, measure, reps)
        if fuse:
            choices += _choose_fused([m for _, m in mlps], "glu", rows, measure, reps)
            choices += _choose_fused(qkvs, "qkv", rows, measure, reps)
    enable(model, gemv=True, fused=fuse)
    return choices


def enable(model: nn.Module, gemv: bool = True, fused: bool = True) -> None:
    """Use the launches patch chose (gemv: the single GEMVs; fused: gate/up and q/k/v), or MLX's built-ins
    where False. The model's parameters are not touched."""
    for m in model.modules():
        if isinstance(m, GEMVLinear):
            m.switch(gemv)
        elif isinstance(m, GatedMLP):
            m.switch(fused)
        if isinstance(m, Attention) and isinstance(m.qkv, FusedQKV):
            m.qkv.switch(fused)


def summary(choices: Sequence[Choice]) -> str:
    """What patch chose, a line per (format, shape, rows, fusion): the launch or MLX's built-in, with the
    timings that decided it; the first line counts the matrices and groups that run our kernels."""
    ours = [c for c in choices if c.launch is not None]
    lines = [f"kernels: ours for {sum(c.layers for c in ours)} of {sum(c.layers for c in choices)} matrices and "
             f"fused groups ({len(ours)} of {len(choices)} shapes), MLX's built-in for the rest"]
    for c in choices:
        chosen = c.launch.label if c.launch else UNFUSED if c.fuse else BUILTIN
        timed = ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in c.seconds.items())
        lines.append(f"  {c.fmt.name} {c.fuse or 'gemv'} {c.n}x{c.k} rows {c.rows} (x{c.layers}): {chosen}"
                     + (f" [{timed}]" if timed else ""))
    return "\n".join(lines)


def _fusable(mods: Sequence[object], same_n: bool) -> bool:
    """True when these GEMVLinears can run as one fused kernel: same format and inputs, no bias."""
    if not mods or not all(isinstance(m, GEMVLinear) and "bias" not in m for m in mods):
        return False
    return (len({m.fmt for m in mods}) == 1 and len({m.shape[1] for m in mods}) == 1
            and (not same_n or len({m.shape[0] for m in mods}) == 1))


# --- measurement ------------------------------------------------------------------------------------------

VIEWS = frozenset({"Broadcast", "Reshape", "Flatten", "Unflatten", "ExpandDims", "Squeeze", "Transpose",
                   "Slice", "AsStrided"})


def count_kernels(model: nn.Module, context: int = 8, compiled: bool = False) -> int:
    """Compute primitives in the graph of one decode step (views excluded): about the kernels MLX
    launches per token on this device (a fused or compiled primitive counts once; compiled: the step as
    generate.compiled_decoder runs it)."""
    cache = model.make_cache(context + 2)
    mx.eval(model(mx.zeros((1, context), dtype=mx.int32), cache))
    step = decoder(model, cache, compiled)
    mx.eval(step(mx.zeros((1,), dtype=mx.int32)))         # compiled: traced here, so the count sees the replay
    logits = step(mx.zeros((1,), dtype=mx.int32))
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "step.dot"
        mx.export_to_dot(str(path), logits)
        labels = re.findall(r'label ="([^"]+)", shape=rectangle', path.read_text())
    mx.eval(logits)
    return sum(label not in VIEWS for label in labels)


def gemv_sweep(shapes: Sequence[tuple[int, int]], formats: Sequence[Format], rows: Sequence[int] = (1, 4),
               model: str | None = None, reps: int = 5, min_bytes: int = 256 << 20, seed: int = 0) -> list[dict]:
    """Results records (experiment "gemv") per format, (n, k) shape and row count: GB/s and µs per GEMV of
    MLX's built-in and of each candidate launch, queued over enough random copies of the matrix that they
    do not fit in L2 (time_calls), the host µs per call to build the graph, our best launch's speedup and
    its largest difference from the built-in's output; a launch that fails to compile gives a
    "compile_error" record with MLX's message instead."""
    records = []
    for fmt in formats:
        for n, k in shapes:
            copies = max(1, min(64, -(-min_bytes // fmt.weight_bytes(n, k))))
            layers = [random_layer(fmt, n, k, seed + i) for i in range(copies)]
            for r in rows:
                launches = candidates(fmt, n, k, r)
                seconds, host, errors = time_variants(layers, r, launches, reps, min_bytes, seed)
                base = {"experiment": "gemv", "model": model, "weights": fmt.name, "kv": None, "context": None,
                        "samples": [], "peer": None, "shape": [n, k], "rows": r, "bytes": launches[0].bytes,
                        "copies": copies}
                for label, s in seconds.items():
                    records += [{**base, "variant": label, "metric": "bandwidth", "unit": "GB/s",
                                 "value": launches[0].bytes / s / 1e9},
                                {**base, "variant": label, "metric": "time_us", "unit": "us", "value": s * 1e6},
                                {**base, "variant": label, "metric": "host_us", "unit": "us",
                                 "value": host[label] * 1e6,
                                 "note": "host time per call to build the graph (Python and MLX), before eval"}]
                records += [{**base, "variant": label, "metric": "compile_error", "unit": None, "value": None,
                             "note": e[-2000:]} for label, e in errors.items()]
                ours = {la.label: la for la in launches if la.label in seconds}
                if ours and BUILTIN in seconds:
                    best = min(ours, key=seconds.get)
                    x = activation(fmt, r, k, seed)
                    ref = layers[0].builtin(x).astype(mx.float32)
                    diff = mx.abs(layers[0].kernel(x, ours[best]).astype(mx.float32) - ref).max().item()
                    records += [{**base, "variant": best, "metric": "speedup", "unit": "x",
                                 "value": seconds[BUILTIN] / seconds[best]},
                                {**base, "variant": best, "metric": "max_abs_diff", "unit": None, "value": diff,
                                 "note": f"vs the built-in, whose outputs reach {mx.abs(ref).max().item():.3g}"}]
            del layers
    return records
