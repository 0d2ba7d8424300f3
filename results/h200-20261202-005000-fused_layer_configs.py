"""GPU probe run at commit 79cca95 (fused layers before the float4 staging and per-kernel warps): each fused kernel timed
queued over the 32 layers of random Llama-3.1-8B-shape models (float16; 4-bit groups of 32 with v and down 8-bit) for
rows per warp R, warps per block W, loads in flight U, and attend's keys per split; its output is the .log beside it.
Note: attn_in always computes RoPE pairs, so its R=1 and R=4 rows here are wrong launches (half or double the warps)."""
import sys, time
sys.path.insert(0, ".")
import mlx.core as mx, mlx.nn as nn, numpy as np
from ref_impl import kernels
from ref_impl.kernels import fusedlayer as fl
from ref_impl.engine.random import args_for, random_model
from ref_impl.measure.kernels import layer_kernel_ms, host_split
print(mx.__version__, mx.default_device(), flush=True)
args = args_for("Llama-3.1-8B", context=512)
prompt = np.random.default_rng(0).integers(1, args.vocab_size, size=128).tolist()
CONFIGS = [dict(R=2, W=8, U=None), dict(R=1, W=8, U=None), dict(R=4, W=8, U=None), dict(R=2, W=4, U=None),
           dict(R=2, W=8, U=8), dict(R=4, W=4, U=2)]
for quant in ("f16", "q4q8"):
    model = random_model(args, mx.float16, 0)
    if quant == "q4q8":
        nn.quantize(model, class_predicate=lambda path, m: isinstance(m, nn.Linear) and not path.endswith("lm_head") and {
            "group_size": 32, "bits": 8 if path.endswith(("v_proj", "down_proj")) else 4})
    mx.eval(model.parameters())
    print(quant, "fuse:", fl.fuse(model), "kernels/token", kernels.count_kernels(model), flush=True)
    for rnd in range(2):
        for on in (False, True):
            fl.enable(model, on)
            print(f"{quant} fused={on}: {1 / fl.decode_seconds(model, 64, 128):.1f} tok/s", flush=True)
    fl.enable(model, True)
    print(quant, "host split fused", {k: round(v * 1e3, 3) for k, v in host_split(model, prompt).items()}, flush=True)
    base_u = dict(fl.UNROLL)
    for cfg in CONFIGS:
        fl.ROWS_PER_WARP, fl.WARPS = cfg["R"], cfg["W"]
        fl.UNROLL = {k: (cfg["U"] if cfg["U"] and k != "mlp_in" else v) for k, v in base_u.items()}
        if cfg["U"] == 2:
            fl.UNROLL = {k: 2 for k in base_u}
        model.layers = [fl.FusedLayer(b) for b in model.layers]
        fl.enable(model, True)
        t0 = time.time()
        try:
            per = layer_kernel_ms(model, 192)
            tps = 1 / fl.decode_seconds(model, 64, 128)
            print(f"{quant} {cfg}: {tps:.1f} tok/s; " + ", ".join(f"{k} {ms:.3f} ms {b / ms / 1e6:.0f} GB/s" for k, (ms, b) in per.items())
                  + f" ({time.time() - t0:.1f} s)", flush=True)
        except Exception as e:
            print(f"{quant} {cfg}: FAILED {str(e)[:300]}", flush=True)
    fl.ROWS_PER_WARP, fl.WARPS, fl.UNROLL = 2, 8, base_u
    model.layers = [fl.FusedLayer(b) for b in model.layers]
    for keys in (64, 32, 128):
        fl.KEYS_PER_SPLIT = keys
        fl.enable(model, True)
        per = layer_kernel_ms(model, 192)
        print(f"{quant} keys/split {keys}: attend {per['attend'][0]:.3f} attn_out {per['attn_out'][0]:.3f} ms", flush=True)
    fl.KEYS_PER_SPLIT = 64
    del model
    mx.clear_cache()
