"""Issue 18 follow-up on the H200 (not part of the course): one host, three routes for a verification block's
attention in the Llama-3.1-8B shape: plain ops as at dccf55f, addmm as at 8095af2, and cuDNN's sdpa with its graph
already built (the same key length repeated). Median ms of a synchronous forward over 1, 2 and 9 positions."""
from ref_impl import MODELS_DIR  # first: the BLAS

import mlx.core as mx

from ref_impl.engine import model as M
from ref_impl.engine.random import args_for, random_model
from ref_impl.measure.decode import forward_sweep


def ops_at_dccf55f(q, k, v, scale):
    B, H, L, D = q.shape
    n_kv, T = k.shape[1], k.shape[2]
    q = (q * scale).reshape(B, n_kv, H // n_kv * L, D)
    scores = (q @ k.swapaxes(-1, -2)).reshape(B, n_kv, H // n_kv, L, T)
    visible = mx.arange(T)[None, :] <= mx.arange(T - L, T)[:, None]
    scores = mx.where(visible, scores, mx.array(-mx.inf, scores.dtype))
    weights = mx.softmax(scores, axis=-1, precise=True).reshape(B, n_kv, H // n_kv * L, T)
    return (weights @ v).reshape(B, H, L, D)


print("mlx", mx.__version__, mx.default_device(), flush=True)
for name in ("Llama-3.1-8B", "stdlib-10m"):
    model = random_model(args_for(name, 512), seed=0) if name != "stdlib-10m" else \
        __import__("ref_impl.engine.checkpoint", fromlist=["load"]).load(MODELS_DIR / "stdlib-10m.gguf", mx.float16)[0]
    addmm = M.causal_attention
    for route in ("addmm", "ops", "sdpa-warm", "addmm", "ops", "sdpa-warm"):
        M.SHORT_QUERIES = 0 if route == "sdpa-warm" else 16
        M.causal_attention = ops_at_dccf55f if route == "ops" else addmm
        L, s = forward_sweep(model, [1, 2, 9], repeats=15, offset=192)
        print(f"{name} {route:>9}: " + ", ".join(f"{n} positions {t * 1e3:.2f} ms" for n, t in zip(L, s)), flush=True)
    del model
