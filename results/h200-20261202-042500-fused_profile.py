"""GPU probe run at commit 38c8299 plus the two-magic 4-bit decode (the tree of the next commit, launch settings
before it): where a fused-layer decode token's time goes on the H200, kernel by kernel, from the GPU's own clock.

CUPTI (through torch.profiler, which records every kernel of the process on the device, MLX's included) gives each
kernel's GPU duration; the sum per token against the token's wall time says how much the GPU idles waiting for the
host. Models: random Llama-3.1-8B shape, "q4q8" (4-bit groups of 32, v and down 8-bit: a Q4_K_M file's mix) and
float16. For q4q8, launch settings of the fused kernels are swept (warps per block, loads in flight).
Its output is the .log beside it. It ran twice in one process: saved as .gpu/profile.py, it shadowed the standard
library's `profile` module, which torch.profiler imports, so the import ran it once more; both passes are in the log.
Their q4q8 numbers agree within a few percent; in the second, float16 decode took longer per token (7.17 ms against
5.82 fused) with the same GPU busy time (5.55 ms against 5.51): a slower host. Saved here under another name.
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


def short(name: str) -> str:
    for k in fl.KERNELS:
        if f"ref_layer_{k}_" in name:
            return k
    return name[:60]


def profiled(model, tokens=TOKENS, context=256):
    """(wall ms per token, {kernel: (calls per token, GPU us per call)}, GPU busy ms per token) of pipelined
    greedy decode (async_eval, as fusedlayer.decode_seconds), only the decode steps profiled."""
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
    if not per:
        evs = list(prof.events())
        print("    no device kernels recorded:", len(evs), "events;", sorted({e.device_type.name for e in evs}),
              [e.name[:40] for e in evs[:5]], flush=True)
    intervals.sort()
    busy, end = 0.0, -1e30
    for a, b in intervals:      # the union of the kernels' intervals
        if b > end:
            busy += b - max(a, end)
            end = b
    return wall * 1e3, {k: (len(v) / tokens, float(np.mean(v))) for k, v in per.items()}, busy / 1e3 / tokens


def report(tag, model):
    t0 = time.time()
    try:
        wall, per, busy = profiled(model)
    except Exception as e:  # noqa: BLE001
        print(f"{tag}: FAILED {str(e)[:500]}", flush=True)
        return
    top = sorted(per.items(), key=lambda kv: -kv[1][0] * kv[1][1])
    print(f"{tag}: {1e3 / wall:.1f} tok/s, wall {wall:.2f} ms/token, GPU busy {busy:.2f} ms/token ({time.time() - t0:.0f} s)",
          flush=True)
    for k, (n, us) in top[:12]:
        print(f"    {k:40} {n:6.1f}/token x {us:7.1f} us = {n * us / 1e3:.3f} ms", flush=True)


args = args_for("Llama-3.1-8B", context=512)
for quant in ("q4q8", "f16"):
    model = random_model(args, mx.float16, 0)
    if quant == "q4q8":
        nn.quantize(model, class_predicate=lambda path, m: isinstance(m, nn.Linear) and not path.endswith("lm_head") and {
            "group_size": 32, "bits": 8 if path.endswith(("v_proj", "down_proj")) else 4})
    mx.eval(model.parameters())
    print(quant, "fuse:", fl.fuse(model), "kernels/token", kernels.count_kernels(model), flush=True)
    fl.enable(model, False)
    report(f"{quant} unfused (MLX built-ins)", model)
    fl.enable(model, True)
    report(f"{quant} fused {fl.WARPS} U {fl.UNROLL}", model)
    if quant == "q4q8":
        base_w, base_u = dict(fl.WARPS), dict(fl.UNROLL)
        for w, u in (({"mlp_in": 8}, {}), ({"attn_in": 4, "attn_out": 4}, {}), ({"attn_out": 16}, {}),
                     ({}, {"attn_in": 2, "attn_out": 2, "mlp_out": 2}), ({}, {"attn_in": 8, "attn_out": 8}),
                     ({"mlp_in": 8}, {"mlp_in": 4})):
            fl.WARPS, fl.UNROLL = {**base_w, **w}, {**base_u, **u}
            model.layers = [fl.FusedLayer(b) for b in model.layers]
            fl.enable(model, True)
            report(f"{quant} fused W {w} U {u}", model)
        fl.WARPS, fl.UNROLL = base_w, base_u
    del model
    mx.clear_cache()
