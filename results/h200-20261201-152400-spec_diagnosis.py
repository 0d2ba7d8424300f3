"""Issue 18 diagnosis on the H200 (not part of the course): first-use cost of multi-query attention per key
length, speculative decoding cold and warm with each attention route, and MTP acceptance by prompt count."""
import time

from ref_impl import MODELS_DIR  # first: the BLAS

import mlx.core as mx
import numpy as np

from ref_impl.engine import model as M
from ref_impl.engine import mtp
from ref_impl.engine.checkpoint import load
from ref_impl.engine.generate import Sampler, generate_step
from ref_impl.engine.speculative import speculative_decode
from ref_impl.measure import spec
from ref_impl.theory import shapes

print("mlx", mx.__version__, mx.default_device(), flush=True)
for name, args in (("stdlib-10m", load(MODELS_DIR / "stdlib-10m.gguf")[0].args),
                   ("Llama-3.1-8B", M.ModelArgs.from_shape(shapes.shape("Llama-3.1-8B")))):
    for q in (2, 5, 9):
        r = spec.attention_first_use(args, q, 256 + 40 * q)
        print(name, f"{q} queries:", {k: ([round(x * 1e3, 2) for x in a], round(float(np.median(b)) * 1e3, 3))
                                       for k, (a, b) in r.items()}, flush=True)

target, tok = load(MODELS_DIR / "stdlib-10m.gguf", mx.float16)
draft, _ = load(MODELS_DIR / "stdlib-draft-1m.gguf", mx.float16)
prompts, _ = spec.heldout_prompts(tok, 4, 128)
for route, short in (("sdpa", 0), ("ops", 16)):
    M.SHORT_QUERIES = short
    prompt = prompts[0 if short == 0 else 1]
    for rep in range(3):
        cache = target.make_cache(len(prompt) + 200)
        t0 = time.perf_counter()
        for _, _t in zip(range(128), generate_step(target, prompt, Sampler(), cache)):
            pass
        plain = time.perf_counter() - t0
        for gamma in (1, 4):
            t0 = time.perf_counter()
            toks, steps = speculative_decode(target, draft, prompt, 128, gamma, Sampler())
            t = time.perf_counter() - t0
            acc = sum(s.accepted for s in steps) / max(1, sum(s.proposed for s in steps))
            print(f"{route} run {rep}: plain 128 tokens {plain * 1e3:.0f} ms; speculative γ {gamma}: {t * 1e3:.0f} ms "
                  f"({len(steps)} steps, α {acc:.2f}, speedup {plain / t:.2f}x)", flush=True)
M.SHORT_QUERIES = 16

for device, dtype in ((mx.gpu, mx.float16), (mx.cpu, mx.float32)):
    mx.set_default_device(device)
    model, tok = load(MODELS_DIR / "stdlib-10m.gguf", dtype)
    heads = mtp.load_heads(MODELS_DIR / "stdlib-10m-mtp.gguf", model, dtype)
    for n_prompts, n_tokens in ((2, 32), (12, 96)):
        prompts, fp = spec.heldout_prompts(tok, n_prompts, 64)
        for g in (1, 4):
            acc = spec.measure_acceptance(lambda p, n, g, s: mtp.mtp_decode(model, heads, p, n, g, s), prompts, g,
                                          n_tokens)
            print(f"MTP {device} {dtype} {n_prompts} prompts x {n_tokens} tokens (corpus {fp[:12]}), γ {g}: "
                  f"α {acc.alpha:.3f} judged {sum(acc.judged)}", flush=True)
        for i, p in enumerate(prompts[:2]):
            acc = spec.measure_acceptance(lambda p, n, g, s: mtp.mtp_decode(model, heads, p, n, g, s), [p], 1, 32)
            print(f"   prompt {i}: α {acc.alpha:.3f}; text {tok.decode(p)[-80:]!r}", flush=True)
