"""GPU probe, run at the tree of the commit that adds this file (LOOPS and PREFETCH in fusedlayer.py). GPU probe: resident row-group loops in the fused layer's matrix kernels (issue 21), on the GPU's own clock.

Each matrix kernel (attn_in, attn_out, mlp_in, mlp_out) stages its input row once per block; with LOOPS[k] = L
each warp then computes L row groups in turn (the grid shrinks L-fold), prefetching its next group's first P
chunks a row into L2 (PREFETCH[k] = P) while it computes the current one. CUPTI (torch.profiler) gives every
kernel's GPU time; the logits of one fused step are checked against the unfused layers' for every setting.
Models: random Llama-3.1-8B shape, "q4q8" (4-bit groups of 32, v and down 8-bit: a Q4_K_M file's mix) and float16.
"""
import contextlib
import sys
import time
from collections import defaultdict

sys.path.insert(0, ".")
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import numpy as np  # noqa: E402

from ref_impl import kernels  # noqa: E402
from ref_impl.engine.generate import decoder, prefill  # noqa: E402
from ref_impl.engine.random import args_for, random_model  # noqa: E402
from ref_impl.kernels import fusedlayer as fl  # noqa: E402

print(mx.__version__, mx.default_device(), flush=True)
try:
    import torch
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.init()
    print("torch", torch.__version__, torch.version.cuda, flush=True)
except Exception as e:  # noqa: BLE001
    torch = None
    print("no torch profiler:", e, flush=True)

TOKENS = 16
MATS = ("attn_in", "attn_out", "mlp_in", "mlp_out")


def short(name: str) -> str:
    for k in fl.KERNELS:
        if f"ref_layer_{k}_" in name:
            return k
    return name[:60]


def profiled(model, tokens=TOKENS, context=256):
    cache = model.make_cache(context + tokens + 8)
    y = mx.argmax(prefill(model, mx.zeros((1, context), dtype=mx.int32), cache), axis=-1)
    step = decoder(model, cache)
    for _ in range(3):
        y = mx.argmax(step(y), axis=-1)
        mx.eval(y)
    ctx = profile(activities=[ProfilerActivity.CUDA]) if torch is not None else contextlib.nullcontext()
    with ctx as prof:
        t0 = time.perf_counter()
        for _ in range(tokens):
            y = mx.argmax(step(y), axis=-1)
            mx.async_eval(y)
        mx.eval(y)
        wall = (time.perf_counter() - t0) / tokens
    if torch is None:
        return wall * 1e3, {}, float("nan")
    per = defaultdict(list)
    intervals = []
    for e in prof.events():
        if e.device_type.name == "CUDA" and e.device_time_total > 0:
            per[short(e.name)].append(e.device_time_total)
            intervals.append((e.time_range.start, e.time_range.end))
    intervals.sort()
    busy, end = 0.0, -1e30
    for a, b in intervals:
        if b > end:
            busy += b - max(a, end)
            end = b
    return wall * 1e3, {k: (len(v) / tokens, float(np.mean(v))) for k, v in per.items()}, busy / 1e3 / tokens


def step_logits(model, on):
    fl.enable(model, on)
    cache = model.make_cache(64)
    y = mx.argmax(prefill(model, mx.arange(1, 9, dtype=mx.int32)[None], cache), axis=-1)
    out = decoder(model, cache)(y).astype(mx.float32)
    mx.eval(out)
    return np.array(out)


def report(tag, model, ref):
    t0 = time.time()
    try:
        got = step_logits(model, True)
        err = float(np.abs(got - ref).max() / np.abs(ref).max())
        wall, per, busy = profiled(model)
    except Exception as e:  # noqa: BLE001
        print(f"{tag}: FAILED {str(e)[:800]}", flush=True)
        return
    line = "  ".join(f"{k} {per[k][1]:5.1f}" for k in fl.KERNELS if k in per)
    print(f"{tag}: {1e3 / wall:.1f} tok/s, wall {wall:.2f}, GPU busy {busy:.2f} ms/token, logits err {err:.1e} "
          f"({time.time() - t0:.0f} s)\n    us/call: {line}", flush=True)


args = args_for("Llama-3.1-8B", context=512)
base = (dict(fl.WARPS), dict(fl.UNROLL), dict(fl.LOOPS), dict(fl.PREFETCH))
SETTINGS = {
    "q4q8": [(1, 0, {}), (2, 0, {}), (2, 4, {}), (3, 4, {}), (4, 0, {}), (4, 4, {}), (4, 8, {}), (8, 4, {}),
             (4, 4, {"attn_in": (4, 4), "attn_out": (4, 2)}), (4, 4, {"mlp_in": (2, 4), "mlp_out": (4, 2)})],
    "f16": [(1, 0, {}), (2, 4, {}), (4, 4, {}), (4, 16, {}), (8, 16, {})],
}
for quant, settings in SETTINGS.items():
    model = random_model(args, mx.float16, 0)
    if quant == "q4q8":
        nn.quantize(model, class_predicate=lambda path, m: isinstance(m, nn.Linear) and not path.endswith("lm_head") and {
            "group_size": 32, "bits": 8 if path.endswith(("v_proj", "down_proj")) else 4})
    mx.eval(model.parameters())
    print(quant, "fuse:", fl.fuse(model), "kernels/token", kernels.count_kernels(model), flush=True)
    ref = step_logits(model, False)
    for loops, pf, unroll in settings:
        fl.WARPS, fl.UNROLL = dict(base[0]), {**base[1], **unroll}
        fl.LOOPS, fl.PREFETCH = {k: loops for k in MATS}, {k: pf for k in MATS}
        model.layers = [fl.FusedLayer(b) for b in model.layers]
        fl.enable(model, True)
        report(f"{quant} L {loops} P {pf} U {fl.UNROLL}", model, ref)
    fl.WARPS, fl.UNROLL, fl.LOOPS, fl.PREFETCH = (dict(b) for b in base)
    del model
    mx.clear_cache()
