"""Our CUDA GEMV kernels against MLX's built-ins, and where a decode step's time goes.

`bench_kernels` (`python -m ref_impl bench --kernels`) measures in steps: the copy bandwidth (the roof);
`gemv_records`, GB/s per matrix shape of a model (`ref_impl.kernels.gemv_sweep`); then per weight type,
a random-weight model of the shape decoded with MLX's built-ins ("native"), our GEMVs where the patch
finds them faster ("kernels") and with the fused gate/up and q/k/v kernels ("kernels+fused"), each with
and without compiling the decode step (DECODE_VARIANTS), optionally against llama.cpp's llama-bench on
the same GGUF file. Where a token's time goes ("decode-breakdown", ms per token) comes from four probes:
`host_split` (building, submitting and waiting for one step, the GPU idle at its start), `matrix_chain`
(the matrices alone, in order), `decode_without` (the step with every matrix, and attention too,
replaced by a constant) and `queued_ms` (the patch's own per-shape timings, summed per token).

See chapter: dispatch-kernel
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ref_impl import kernels
from ref_impl.engine.generate import decoder, prefill
from ref_impl.engine.model import Model, ModelArgs
from ref_impl.engine.random import random_gguf_model
from ref_impl.kernels import fusedlayer
from ref_impl.measure.decode import decode_bytes, ours, roofs
from ref_impl.measure.peers import llama_bench_records
from ref_impl.measure.records import canonical, dtype_name, fastest_bandwidth, record, weights_name
from ref_impl.platform.timing import clock, decode_metrics, median
from ref_impl.theory.roofline import matmul_shapes

# MLX's built-ins, our GEMVs where faster, with the fused gate/up and q/k/v kernels; "+compiled": each decode
# step one mx.compile'd graph (generate.compiled_decoder); "layers": every decoder layer five fused kernels
# (kernels/fusedlayer.py), their pairs merged into one launch as `fusedlayer.choose` finds fastest at load (the
# records name them, `merged`, with each way's ms a token, `merge_ms`), the LM head as "kernels" runs it; "+int8":
# the fused layers' quantized matrices meet int8 activations (quantized weights only)
DECODE_VARIANTS = ("native", "native+compiled", "kernels", "kernels+fused", "kernels+fused+compiled", "layers",
                   "layers+int8")


# ---- the probes of one decode step ------------------------------------------------------------------------

def host_split(model: Model, prompt: list[int], steps: int = 16, compiled: bool = False) -> dict[str, float]:
    """Median seconds of one greedy decode step, the GPU idle at its start: building the graph in Python
    ("build"; compiled: replaying the traced graph), mx.async_eval returning ("submit": MLX encodes every
    kernel on this thread) and waiting for the token ("wait"). Pipelined decode overlaps build + submit of
    step t+1 with the GPU's step t, so a step costs about max(build + submit, GPU)."""
    cache = model.make_cache(len(prompt) + steps + 3)
    step = decoder(model, cache, compiled)
    y = mx.argmax(prefill(model, mx.array([prompt]), cache), axis=-1)
    y = mx.argmax(step(y), axis=-1)       # compiled: the trace, outside the timing
    mx.eval(y)
    parts = {"build": [], "submit": [], "wait": []}
    for _ in range(steps):
        t0 = clock()
        y = mx.argmax(step(y), axis=-1)
        t1 = clock()
        mx.async_eval(y)
        t2 = clock()
        mx.eval(y)
        t3 = clock()
        for k, v in zip(parts, (t1 - t0, t2 - t1, t3 - t2)):
            parts[k].append(v)
    return {k: median(v) for k, v in parts.items()}


def matrix_chain(model: Model, tokens: int = 32) -> float:
    """Seconds per token of only the decoder's matrix work, in its order and with its dependencies, pipelined
    as decode is: per layer q/k/v projections, o_proj on q, the MLP (as the layer runs it) on that, then the
    LM head; no norms, RoPE, attention or residuals. Values overflow to inf: speed does not depend on them.
    The mean over `tokens` pipelined steps (one span: steps overlap, so no step has a time of its own)."""
    h = mx.full((1, 1, model.args.hidden_size), 0.01, dtype=model.norm.weight.dtype)

    def step(h: mx.array) -> tuple[mx.array, list[mx.array]]:
        outs = []
        for layer in model.layers:
            attn = layer.self_attn
            q, k, v = attn.qkv(h)          # one launch where kernels.patch fused them
            outs += [k, v]
            h = layer.mlp(attn.o_proj(q))
        return h, outs + [model.logits(h)]

    h1, outs = step(h)
    mx.eval(h1, outs)
    t0, prev = clock(), None
    for _ in range(tokens):
        h, outs = step(h)
        mx.async_eval(h, outs)
        if prev is not None:
            mx.eval(prev)
        prev = outs[-1]
    mx.eval(h, outs)
    return (clock() - t0) / tokens


class Const:
    """Stands in for a module in timing variants: returns zeros of the module's output width (one array made
    once for a decode step's single row), so the rest of the step runs without it."""

    def __init__(self, n: int, dtype: mx.Dtype):
        self.n, self.dtype, self.y = n, dtype, mx.zeros((1, 1, n), dtype=dtype)
        mx.eval(self.y)

    def __call__(self, x: mx.array, *args, **kwargs) -> mx.array:
        return self.y if x.shape[:-1] == (1, 1) else mx.zeros((*x.shape[:-1], self.n), dtype=self.dtype)


def _swap(model: Model, name: str, new: object) -> None:
    """Set the module at a dotted path by plain item assignment (a Const is not an nn.Module)."""
    *path, leaf = name.split(".")
    owner = model
    for p in path:
        owner = owner[int(p)] if p.isdigit() else owner[p]
    owner[leaf] = new


def decode_without(model: Model, prompt: list[int], attention: bool, n: int = 64) -> tuple[float, int]:
    """Seconds per token (median run) and kernels per token of pipelined decode with every matrix (and with
    attention=True every layer's attention) replaced by a constant: what the rest of the step costs. The
    model is restored."""
    targets = [(name, m) for name, m in model.named_modules()
               if isinstance(m, (nn.Linear, nn.QuantizedLinear, kernels.GEMVLinear))]
    layers = [(f"layers.{i}.self_attn", layer.self_attn) for i, layer in enumerate(model.layers)] if attention else []
    targets = [(k, m) for k, m in targets if not (attention and ".self_attn." in k)] + layers
    dtype = model.norm.weight.dtype
    stubs = []
    for name, m in targets:
        width = model.args.hidden_size if name.endswith("self_attn") else (
            m.shape[0] if isinstance(m, kernels.GEMVLinear) else m.weight.shape[0])
        stubs.append((name, Const(width, dtype)))
    try:
        for name, stub in stubs:
            _swap(model, name, stub)
        runs = ours(model, prompt, n, 1, pipeline=True)
        return 1 / decode_metrics(runs, len(prompt))["tokens_per_s"][0], kernels.count_kernels(model)
    finally:
        for name, m in targets:
            _swap(model, name, m)


def queued_ms(choices: list, variant: str) -> dict[str, float]:
    """Milliseconds per token of the GEMVs run back to back (patch's queued timings, one row), per matrix
    shape, for MLX's built-ins (native), the chosen launches (kernels) or those with the fused groups."""
    out = {}
    single = {(c.n, c.k): c for c in choices if c.rows == 1 and not c.fuse}
    fused = {c.fuse: c for c in choices if c.rows == 1 and c.fuse}
    for (n, k), c in single.items():
        label = kernels.BUILTIN if variant == "native" or c.launch is None else c.launch.label
        out[f"{n}x{k}"] = c.seconds.get(label, math.nan) * c.layers * 1e3
    if variant == "kernels+fused":
        for fuse, c in fused.items():
            if c.launch is None:
                continue
            shapes = [(p, c.k) for p in c.parts] if fuse == "qkv" else [(c.n, c.k), (c.n, c.k)]
            for shape, count in {s: shapes.count(s) for s in shapes}.items():   # the GEMVs the group replaces
                key = f"{shape[0]}x{shape[1]}"
                out[key] -= single[shape].seconds.get(single[shape].launch.label if single[shape].launch
                                                      else kernels.BUILTIN, math.nan) * count * c.layers * 1e3
            out[f"{fuse} {c.n}x{c.k}"] = c.seconds.get(c.launch.label, math.nan) * c.layers * 1e3
    return out


# ---- the steps of bench_kernels ---------------------------------------------------------------------------

@dataclass
class KernelRun:
    """What every step of one bench_kernels run shares."""
    shape: str
    prompt: list[int]
    gen_tokens: int
    repeats: int
    roof_gbs: float                                # measured bandwidth (records.fastest_bandwidth), the roof
    quick: bool
    say: Callable[[str], None]
    start: float

    def log(self, msg: str) -> None:
        self.say(f"[{clock() - self.start:.0f} s] {msg}")


def gemv_records(shapes: list[tuple[int, int]], model: str, seed: int, say: Callable[[str], None]) -> list[dict]:
    """kernels.gemv_sweep's records per format (4-bit groups of 32, float16; 1 and 4 rows), each line said;
    weights in the records' vocabulary ("F16", `records.canonical`)."""
    records = []
    for fmt in (kernels.Format(4, 32), kernels.Format(16)):
        sweep = [canonical(r) for r in kernels.gemv_sweep(shapes, [fmt], (1, 4), model, seed=seed)]
        records += sweep
        def key(r: dict) -> tuple:
            return r["weights"], tuple(r["shape"]), r["rows"], r["variant"]
        host = {key(r): r["value"] for r in sweep if r["metric"] == "host_us"}
        times = {key(r): r["value"] for r in sweep if r["metric"] == "time_us"}
        for r in sweep:
            if r["metric"] in ("bandwidth", "compile_error"):
                value = "" if r["value"] is None else f"{r['value']:8.0f} GB/s"
                t, h = times.get(key(r)), host.get(key(r))
                timing = f" {t:7.1f} us/call queued, host {h:5.1f} us" if t is not None and h is not None else ""
                say(f"gemv {r['weights']:6} {str(tuple(r['shape'])):14} rows {r['rows']}  {r['variant']:42} {value}"
                    f"{timing}{r.get('note', '')[:300]}")
    return records


def breakdown_without_records(run: KernelRun, model: Model, fields: dict) -> list[dict]:
    """decode-breakdown records of the step without its matrices, and without attention too (MLX's modules)."""
    rest, records = {}, []
    for attention in (False, True):
        s, n_k = decode_without(model, run.prompt, attention)
        key = "no_matrices" + ("_no_attention" if attention else "")
        rest[key] = s * 1e3
        records.append(record("decode-breakdown", "ms_per_token", "ms", s * 1e3, variant="native", **fields, part=key,
                              kernels_per_token=n_k, note="decode with every matrix" +
                              (" and attention" if attention else "") + " replaced by a constant"))
    attention_ms = rest["no_matrices"] - rest["no_matrices_no_attention"]
    records.append(record("decode-breakdown", "ms_per_token", "ms", attention_ms, variant="native", **fields,
                          part="attention",
                          note="no_matrices - no_matrices_no_attention: RoPE, the cache update, SDPA"))
    run.say(f"{fields['weights']}: without matrices {rest['no_matrices']:.2f} ms/token, also without attention "
            f"{rest['no_matrices_no_attention']:.2f}")
    return records


def layer_kernel_ms(model: Model, context: int, passes: int = 4) -> dict[str, tuple[float, int]]:
    """Per fused-layer kernel (kernels/fusedlayer.py), (ms per token, bytes per token): the kernel of every fused
    layer queued `passes` times in one mx.eval, the graph built first (patching.time_calls), so the time is the
    GPU's; the inputs come from one fused step at position `context`. Bytes: the weights and norms it reads.
    A pair's kernels are timed apart too where the layers merge them (fusedlayer.PAIRS), to show each one's share."""
    layers = [b for b in model.layers if isinstance(b, fusedlayer.FusedLayer) and b.on]
    caches = model.make_cache(context + 2)
    for c in caches:
        c.offset = context
    x = (mx.random.normal((1, 1, model.args.hidden_size), key=mx.random.key(0))).astype(model.norm.weight.dtype)
    at = fusedlayer.position(context)
    outs = [b.step(x, c) for b, c in zip(layers, caches)]
    mx.eval(outs)

    def handoff(b: fusedlayer.FusedLayer, pair: str, *args) -> Callable[[mx.array], object]:
        # the calls queued in one graph may run at once, so each of a pass's calls has its own handoff counters
        counters = [mx.zeros((3,), dtype=mx.int32) for _ in range(passes)]
        mx.eval(counters)
        turn = itertools.cycle(counters)
        return lambda _: b.stages[pair](*args, next(turn))

    calls = {
        "attn_in": [lambda _, b=b, c=c: b.stages["attn_in"](x, c, at) for b, c in zip(layers, caches)],
        "attend": [lambda _, b=b, c=c, o=o: b.stages["attend"](o[0], c, at) for b, c, o in zip(layers, caches, outs)],
        "attn_out": [lambda _, b=b, o=o: b.stages["attn_out"](o[1], x) for b, o in zip(layers, outs)],
        "mlp_in": [lambda _, b=b, o=o: b.stages["mlp_in"](o[2]) for b, o in zip(layers, outs)],
        "mlp_out": [lambda _, b=b, o=o: b.stages["mlp_out"](o[3], o[2]) for b, o in zip(layers, outs)],
    }
    merged = layers[0].plan.merged      # the pairs' calls (and their counters) only where the layers merge them
    if "attention" in merged:
        calls["attention"] = [handoff(b, "attention", o[0], c, at, x) for b, c, o in zip(layers, caches, outs)]
    if "mlp" in merged:
        calls["mlp"] = [handoff(b, "mlp", o[2]) for b, o in zip(layers, outs)]
    calls = {k: calls[k] for k in fusedlayer.KERNELS if k in calls}
    per_call, _, errors = kernels.time_calls(calls, x, passes)
    if errors:
        raise RuntimeError(f"fused-layer kernels failed: {errors}")
    nbytes = {k: sum(fusedlayer.kernel_bytes(b, k, context) for b in layers) for k in calls}
    return {k: (per_call[k] * len(layers) * 1e3, nbytes[k]) for k in calls}


def layer_records(run: KernelRun, model: Model, variant: str, fields: dict) -> list[dict]:
    """decode-breakdown records of the fused layers' kernels: ms per token each (queued), with GB/s."""
    records = []
    for name, (ms, nbytes) in layer_kernel_ms(model, len(run.prompt) + run.gen_tokens // 2).items():
        records.append(record("decode-breakdown", "ms_per_token", "ms", ms, variant=variant, **fields,
                              part=f"layer {name}", bytes_per_token=nbytes, gb_per_s=nbytes / ms / 1e6,
                              note="the kernel of every layer queued, graph built first: GPU time"))
        run.say(f"{fields['weights']} {variant}: {name} {ms:.3f} ms/token, {nbytes / ms / 1e6:.0f} GB/s")
    return records


def choice_records(choices: list, fields: dict, say: Callable[[str], None]) -> list[dict]:
    """kernel-choice records: what the patch chose per (format, shape, rows, fused group), with its timings
    (value None, and a note, where the patch chose without timing: --quick)."""
    records = []
    for c in choices:
        chosen = c.launch.label if c.launch else kernels.UNFUSED if c.fuse else kernels.BUILTIN
        timed = chosen in c.seconds
        untimed = {} if timed else {"note": "not timed: launch_config's default launch (--quick)"}
        records.append(record("kernel-choice", "time_us", "us", c.seconds[chosen] * 1e6 if timed else None,
                              **untimed, **{**fields, "weights": weights_name(c.fmt.name)}, variant=chosen,
                              shape=[c.n, c.k], rows=c.rows,
                              layers=c.layers, fuse=c.fuse, parts=list(c.parts),
                              timings_us={k: v * 1e6 for k, v in c.seconds.items()},
                              host_us={k: v * 1e6 for k, v in c.host.items()}, errors=c.errors))
        say(f"patch {fields['weights']} {c.fmt.name} {c.fuse or 'gemv'} {(c.n, c.k)} rows {c.rows}: {chosen}; "
            + ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in c.seconds.items())
            + (f"; failed: {', '.join(c.errors)}" if c.errors else ""))
    return records


def variant_records(run: KernelRun, model: Model, variant: str, step_bytes: int, fields: dict
                    ) -> tuple[list[dict], list[int]]:
    """decode-kernels records of one decode variant (tokens/s, bandwidth share, kernels per token, overhead per
    kernel) and its decode-breakdown parts; and the tokens it decoded."""
    compiled = variant.endswith("+compiled")
    runs = ours(model, run.prompt, run.gen_tokens, run.repeats, pipeline=True, compiled=compiled)
    tps, samples = decode_metrics(runs, len(run.prompt))["tokens_per_s"]
    n_kernels = kernels.count_kernels(model, compiled=compiled)
    overhead = (1 / tps - step_bytes / (run.roof_gbs * 1e9)) / n_kernels
    def rec(metric: str, unit: str, value: float, **extra) -> dict:
        return record("decode-kernels", metric, unit, value, variant=variant, **fields, **extra)
    records = [rec("tokens_per_s", "tok/s", tps, samples=samples),
               rec("bandwidth_fraction", "fraction", step_bytes * tps / 1e9 / run.roof_gbs),
               rec("kernels_per_token", "kernels", n_kernels,
                   note="compute primitives in one decode step's graph, views excluded"),
               rec("overhead_us_per_kernel", "us", overhead * 1e6,
                   note="(token time - bytes_per_token / copy bandwidth) / kernels_per_token")]
    host = host_split(model, run.prompt, compiled=compiled)
    parts = {"decode": 1e3 / tps, "host_build": host["build"] * 1e3, "host_submit": host["submit"] * 1e3,
             "step_wait": host["wait"] * 1e3, "step_sync": sum(host.values()) * 1e3,
             "matrix_chain": matrix_chain(model) * 1e3}
    records += [record("decode-breakdown", "ms_per_token", "ms", v, variant=variant, **fields, part=k)
                for k, v in parts.items()]
    run.say(f"decode {fields['weights']} {variant}: {tps:.1f} tok/s = {parts['decode']:.2f} ms, {n_kernels} "
            f"kernels/token, {overhead * 1e6:.2f} us/kernel beyond the bytes; one step, GPU idle: build "
            f"{parts['host_build']:.2f} + submit {parts['host_submit']:.2f} + wait {parts['step_wait']:.2f} ms; "
            f"matrices alone as a chain {parts['matrix_chain']:.2f} ms")
    return records, runs[0].ids


def queued_records(choices: list, fields: dict, say: Callable[[str], None]) -> list[dict]:
    """decode-breakdown "gemv_queued" records per variant: queued_ms per shape and their sum."""
    records = []
    for variant in ("native", "kernels", "kernels+fused"):
        queued = queued_ms(choices, variant)
        records += [record("decode-breakdown", "ms_per_token", "ms", v, variant=variant, **fields,
                           part=f"gemv_queued {k}") for k, v in queued.items()]
        records.append(record("decode-breakdown", "ms_per_token", "ms", sum(queued.values()), variant=variant, **fields,
                              part="gemv_queued",
                              note="patch's queued time per call x calls per token, summed over shapes"))
        say(f"{fields['weights']} {variant}: GEMVs queued {sum(queued.values()):.2f} ms/token ("
            + ", ".join(f"{k} {v:.2f}" for k, v in queued.items()) + ")")
    return records


def agreement_records(ids: dict[str, list[int]], fields: dict) -> list[dict]:
    """decode-kernels greedy agreement of each variant with native decoding, and where it first diverges."""
    records = []
    for variant in [v for v in DECODE_VARIANTS[1:] if v in ids]:
        same = np.array(ids[variant]) == np.array(ids["native"])
        first = int(np.argmin(same)) if not same.all() else None
        records.append(record("decode-kernels", "greedy_agreement", "fraction", same.mean(), variant=variant,
                              **fields, first_divergence=first,
                              note="random weights: near-tied logits can flip at float32 vs MLX's rounding, and "
                                   "every later token then differs" if first is not None else ""))
    return records


def weight_type_records(run: KernelRun, args: ModelArgs, wt: str, work_dir: Path, seed: int,
                        llama_bench_binary: Path | None) -> list[dict]:
    """Every record of one weight type: llama-bench (if given), the breakdown probes, each decode variant
    (the patch chosen before "kernels"), the queued GEMVs, bytes per token and greedy agreement."""
    context = len(run.prompt) + run.gen_tokens
    fields = {"model": run.shape, "weights": wt, "kv": None, "context": context}
    peer = []

    def run_peer(path: Path) -> None:
        peer.extend(llama_bench_records(llama_bench_binary, path, {"experiment": "decode-kernels", **fields},
                                        len(run.prompt), run.gen_tokens, run.repeats))
        run.log(f"llama-bench {wt}: " + ", ".join(
            f"{r['metric']} {r['value']}" if r["value"] is not None else r["note"] for r in peer))

    model, _ = random_gguf_model(run.shape, args, wt, work_dir, seed, run_peer if llama_bench_binary else None)
    records = peer
    step_bytes = decode_bytes(model, len(run.prompt) + run.gen_tokens // 2)
    fields["kv"] = dtype_name(model.norm.weight.dtype)
    run.log(f"{wt} model loaded")
    records += breakdown_without_records(run, model, fields)
    ids, choices = {}, []
    for variant in DECODE_VARIANTS:
        if variant == "kernels":
            choices = kernels.patch(model, fuse=True, measure=not run.quick)
            records += choice_records(choices, fields, run.say)
        if variant.startswith("kernels"):
            kernels.enable(model, gemv=True, fused="fused" in variant)
        if variant.startswith("layers"):
            int8 = variant.endswith("int8")
            left = fusedlayer.fuse(model, int8=int8)
            said = f"{len(model.layers) - len(left)} of {len(model.layers)} fused" + "".join(
                f"; layer {i}: {why}" for i, why in left.items())
            nothing_int8 = int8 and not any(isinstance(b, fusedlayer.FusedLayer) and b.plan.int8
                                            for b in model.layers)
            if nothing_int8:
                said = "no quantized matrices: the int8 kernels have nothing to read"
            run.say(f"{wt} {variant}: {said}")
            if len(left) == len(model.layers) or nothing_int8:
                records.append(record("decode-kernels", "skipped", None, None, variant=variant, **fields, note=said))
                continue
            way, merge_ms = fusedlayer.choose(model, unfused=False)     # the pairs merged as generate would
            run.say(f"{wt} {variant}: {way} chosen; decode ms/token " + ", ".join(
                f"{k} {v:.2f}" for k, v in merge_ms.items()))
        rec, ids[variant] = variant_records(run, model, variant, step_bytes, fields)
        if variant.startswith("layers"):     # which kernel pairs ran as one launch, and each way's timing at load
            merged = next(list(b.plan.merged) for b in model.layers if isinstance(b, fusedlayer.FusedLayer))
            rec = [{**r, "merged": merged, "merge_ms": merge_ms} for r in rec]
        records += rec
        if variant.startswith("layers"):
            records += layer_records(run, model, variant, fields)
    if not run.quick:   # the quick patch times nothing to queue
        records += queued_records(choices, fields, run.say)
    records.append(record("decode-kernels", "bytes_per_token", "B", step_bytes, variant="kernels", **fields))
    records += agreement_records(ids, fields)
    run.log(f"{wt} done")
    return records


def bench_kernels(shape: str, args: ModelArgs, weight_types: Sequence[str], work_dir: Path, prompt_len: int = 128,
                  gen_tokens: int = 128, repeats: int = 3, seed: int = 0, llama_bench_binary: Path | None = None,
                  quick: bool = False, progress: Callable[[str], None] | None = None) -> list[dict]:
    """kernels.py's CUDA GEMVs against MLX's built-ins: GB/s per matrix shape of `shape` (4-bit groups of 32,
    float16; 1 and 4 rows; queued, with the host time to build each call), then decode of a random model of
    `shape` per weight type: MLX's built-ins ("native"), our GEMVs where faster ("kernels"), and with the
    fused gate/up and q/k/v kernels ("kernels+fused"): tokens/s, share of bandwidth, kernels per token,
    greedy agreement, the patch's choices, and where a token's time goes ("decode-breakdown", ms per token:
    host build and submit of one step, the matrix work alone as a chain, the GEMVs queued per shape, the
    step with every matrix replaced by a constant, and with attention too); each with and without compiling
    the decode step (DECODE_VARIANTS). llama_bench_binary: llama.cpp's llama-bench on the same GGUF file first
    (peer "llama.cpp"). quick: decode only, with launch_config's default launches (no sweep, no timing of
    candidates). Off MLX's CUDA backend: one "skipped" record, at once."""
    say = progress or (lambda msg: None)
    if not kernels.on_cuda():
        return [record("kernels", "skipped", None, None, model=shape,
                       note=f"skipped: needs MLX's CUDA backend; this is {mx.default_device()}")]
    work_dir.mkdir(parents=True, exist_ok=True)
    prompt = np.random.default_rng(seed).integers(1, args.vocab_size, size=prompt_len).tolist()
    start = clock()
    records = roofs()
    roof = fastest_bandwidth(records)
    run = KernelRun(shape, prompt, gen_tokens, repeats, roof, quick, say, start)
    say(f"measured bandwidth {roof:.0f} GB/s")
    if not quick:
        records += gemv_records(sorted({(n, k) for k, n in matmul_shapes(args.shape(shape))}), shape, seed, say)
    run.log("sweep done")
    for wt in weight_types:
        records += weight_type_records(run, args, wt, work_dir, seed, llama_bench_binary)
    return records
