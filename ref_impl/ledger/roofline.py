"""Chapter 0, the roofline (book/intro/roofline): C04, C14, C26 and C27.

Decode reads every weight once per token and prefill reuses each weight across the prompt; the
checks put those intensities against the sourced ridge points (roofline.HARDWARE, shapes.PUBLIC),
and with `live=True` time one GEMV and one GEMM with numpy and the shipped model's forward with
MLX on this machine. Live measurements are cached per process, so the ledger times each once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ref_impl.engine.checkpoint import load
from ref_impl.ledger.core import SHIPPED_MODEL, TABLES, Number, Verdict, claim, recorded
from ref_impl.ledger.signalling import C03_BUS_BITS, C03_GBS, GDDR7_CARD
from ref_impl.measure.decode import forward_sweep, this_machine
from ref_impl.platform import blas, timing
from ref_impl.theory import roofline, shapes
from ref_impl.theory.shapes import ModelShape

# ---- live measurements, cached: one run per process -----------------------------------------------

@dataclass(frozen=True)
class MatmulTiming:
    """One weight matrix times one vector (GEMV) and times many (GEMM), timed on this machine."""
    machine: str
    shape: tuple[int, int]      # the float32 weight matrix (rows, cols)
    tokens: int                 # columns of the GEMM's right-hand side
    gemv_gbs: float
    gemv_gflops: float
    gemm_gflops: float
    copy_gbs: float             # decode.this_machine(): copy bandwidth and float32 matmul peak
    peak_gflops: float


@functools.cache
def measure_matmul(rows: int = 8192, cols: int = 4096, tokens: int = 256) -> MatmulTiming:
    """Time one float32 weight matrix (rows x cols: 128 MiB, 4x a 32 MiB L3) times one vector and
    times `tokens` vectors with numpy, best of 10 and of 3, and this machine's roofs."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((rows, cols), dtype=np.float32)
    x, xs = rng.standard_normal(cols, dtype=np.float32), rng.standard_normal((cols, tokens), dtype=np.float32)
    gemv = timing.best(timing.repeat(lambda: w @ x, 10, warmup=0))
    gemm = timing.best(timing.repeat(lambda: w @ xs, 3, warmup=0))
    hw = this_machine(seconds=1.0, array_mb=128)
    return MatmulTiming(hw.name, (rows, cols), tokens, w.nbytes / gemv / 1e9, 2 * w.size / gemv / 1e9,
                        2 * w.size * tokens / gemm / 1e9, hw.bandwidth_gbs, hw.peak_tflops * 1e3)


@dataclass(frozen=True)
class ForwardTiming:
    """Forward time of the shipped model against prompt length, and decode-step time at two contexts."""
    shape: ModelShape
    lengths: tuple[int, ...]          # tokens in one forward from an empty cache
    seconds: tuple[float, ...]
    decode_contexts: tuple[int, int]  # context of the timed decode steps
    decode_seconds: tuple[float, float]


@functools.cache
def measure_forward(max_len: int = 512, rounds: int = 3, steps: int = 8) -> ForwardTiming:
    """Time a forward of the shipped model for L = 1, 2, 4 ... max_len tokens (decode.forward_sweep: the
    median of `rounds` after a warm-up) and decode steps with the KV cache at context 16 and max_len - 100
    (best of `steps`, the two contexts interleaved), on one BLAS thread."""
    model, _ = load(SHIPPED_MODEL)
    tokens = mx.array(np.random.default_rng(0).integers(0, model.args.vocab_size, (1, max_len)))
    lengths, seconds = forward_sweep(model, [2**i for i in range(max_len.bit_length()) if 2**i <= max_len],
                                     repeats=rounds)
    contexts = (16, max_len - 100)
    with blas.one_blas_thread():
        caches = [model.make_cache(max_len) for _ in contexts]
        for cache, start in zip(caches, contexts):
            mx.eval(model(tokens[:, :start - 1], cache))   # the decode steps then run at start, start + 1, ...

        def step(cache):
            off = cache[0].offset
            mx.eval(model(tokens[:, off:off + 1], cache))
        decode = [[timing.repeat(lambda c=c: step(c), 1, warmup=0)[0] for c in caches]   # interleaved
                  for _ in range(steps)]
    d_lo, d_hi = np.min(decode, axis=0)
    return ForwardTiming(model.args.shape(SHIPPED_MODEL.stem), tuple(lengths), tuple(seconds),
                         contexts, (float(d_lo), float(d_hi)))


# ---- arithmetic the checks share --------------------------------------------------------------------

def model_intensity(shape: ModelShape, n_tokens: int, bits: float = 16, act_bytes: float = 2) -> float:
    """FLOP per byte of all of a model's matmuls on n tokens at once (weights and activations moved)."""
    flops, nbytes = zip(*(roofline.matmul_cost(n_tokens, k, m, bits, act_bytes)
                          for k, m in roofline.matmul_shapes(shape)))
    return sum(flops) / sum(nbytes)


def tokens_to_reach(shape: ModelShape, intensity: float, bits: float = 16) -> int:
    """The fewest tokens per pass for which `model_intensity` exceeds `intensity` (bisection)."""
    lo, hi = 1, 1 << 20
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if model_intensity(shape, mid, bits) <= intensity else (lo, mid)
    return lo


def attention_share(shape: ModelShape, prompt_len: int) -> float:
    """Fraction of a prefill's FLOPs spent in attention (Q.K and scores.V): the part that grows as N²."""
    return 1 - 2 * roofline.matmul_params(shape) * prompt_len / roofline.prefill_flops(shape, prompt_len)


def fit_ttft(lengths: tuple[int, ...], seconds: tuple[float, ...]) -> tuple[float, float, float]:
    """(a, b, c) of t(L) = a + b L + c L² by least squares on relative error: a flat cost (weights
    read, dispatch), a linear one (matmul FLOPs) and attention's quadratic one."""
    L, t = np.array(lengths, float), np.array(seconds)
    design = np.stack([np.ones_like(L), L, L * L], axis=1) / t[:, None]
    a, b, c = np.linalg.lstsq(design, np.ones_like(t), rcond=None)[0]
    return float(a), float(b), float(c)


def implied_bandwidth_gbs(tokens_per_s: float, gb_per_token: float) -> float:
    """GB/s a decoder must read to make `tokens_per_s` when each token reads `gb_per_token` GB."""
    return tokens_per_s * gb_per_token


# ---- the checks ---------------------------------------------------------------------------------------

LLAMA8B = shapes.PUBLIC["Llama-3.1-8B"]
RIDGED = [hw for hw in roofline.HARDWARE.values() if hw.peak_tflops is not None]  # Apple: no sourced peak


def check_c27(live: bool) -> Verdict:
    """Decode GEMVs: their intensity in real shapes against every sourced ridge point; live GEMV rates."""
    names = ("Llama-3.2-1B", "Llama-3.1-8B", "Qwen3-32B")
    each = [roofline.matmul_intensity(1, k, m, 16) for n in names for k, m in roofline.matmul_shapes(shapes.PUBLIC[n])]
    ridges = {hw.name: roofline.ridge_point(hw) for hw in RIDGED}
    lo, hi = min(ridges.values()), max(ridges.values())
    ev = {"GEMV intensity, Llama-3.1-8B, 16-bit": Number(model_intensity(LLAMA8B, 1), "FLOP/byte"),
          "lowest GEMV intensity, any matrix of 3 models": Number(min(each), "FLOP/byte"),
          "highest GEMV intensity, any matrix of 3 models": Number(max(each), "FLOP/byte"),
          "GEMV intensity at Q4_K's 4.5 bits/weight": Number(model_intensity(LLAMA8B, 1, 4.5), "FLOP/byte")}
    ev |= {f"ridge point, {name}": Number(r, "FLOP/byte") for name, r in ridges.items()}
    summary = (f"Every 16-bit GEMV of {', '.join(names)} does {min(each):#.3g}-{max(each):#.3g} FLOP/byte "
               f"against ridge points of {lo:.0f}-{hi:.0f} (H200: {ridges['H200 SXM']:.0f}), so the arithmetic "
               f"units could do {lo:.0f}-{hi:.0f}× more work per byte than decode gives them")
    source = TABLES
    if live:
        m = measure_matmul()
        ev |= {"live GEMV read rate": Number(m.gemv_gbs, "GB/s"),
               "live copy bandwidth": Number(m.copy_gbs, "GB/s"),
               "live GEMV arithmetic rate": Number(m.gemv_gflops, "GFLOP/s"),
               f"live GEMM rate, same matrix, {m.tokens} tokens": Number(m.gemm_gflops, "GFLOP/s"),
               "live float32 matmul peak (2048² matmul)": Number(m.peak_gflops, "GFLOP/s")}
        summary += (f"; live on this CPU a {m.shape[0]}×{m.shape[1]} float32 GEMV read {m.gemv_gbs:.1f} GB/s "
                    f"({100 * m.gemv_gbs / m.copy_gbs:.0f}% of the copy bandwidth) but did only "
                    f"{m.gemv_gflops:.1f} GFLOP/s, 1/{m.gemm_gflops / m.gemv_gflops:.0f} of what the same weights "
                    f"did times {m.tokens} tokens")
        source = f"live, numpy on {m.machine}; {TABLES}"
    else:
        summary += " (live GEMV timing not run: live=False)"
    return Verdict("confirmed" if max(each) < 2 < lo else "refuted", summary + ".", ev,
                   "one sequence (batch 1) and 4-16-bit weights; batching B sequences multiplies the "
                   "intensity by about B", source)


C27 = claim("C27", "roofline", check_c27,
            short="decode GEMVs have intensity ~1 FLOP/byte; ALUs idle waiting on DRAM",
            quote="Auto-regressive decoding executes GEMV operations with minimal arithmetic intensity (FLOPs/byte "
                  "approx. 1), causing GPU compute ALUs to sit idle while awaiting memory bus DRAM/GDDR reads.")


def check_c26(live: bool) -> Verdict:
    """Prefill GEMMs: intensity at 128-2048 tokens, the prompt that passes each ridge; live GEMM rate."""
    ev = {f"GEMM intensity, Llama-3.1-8B, {n}-token prompt": Number(model_intensity(LLAMA8B, n), "FLOP/byte")
          for n in (128, 512, 2048)}
    over_100 = tokens_to_reach(LLAMA8B, 100)
    ev["prompt at which intensity passes 100"] = Number(over_100, "tokens")
    ev |= {f"prompt at which it passes the ridge, {hw.name}":
           Number(tokens_to_reach(LLAMA8B, roofline.ridge_point(hw)), "tokens") for hw in RIDGED}
    h200 = ev["prompt at which it passes the ridge, H200 SXM"].value
    summary = (f"Llama-3.1-8B's matmuls pass 100 FLOP/byte from {over_100}-token prompts and the H200's ridge "
               f"from {h200:.0f}, so only prompts that long are compute-bound; scaling with the compute clock "
               "is not testable without clock control")
    source = TABLES
    if live:
        m = measure_matmul()
        ev |= {f"live GEMM rate, {m.tokens} tokens": Number(m.gemm_gflops, "GFLOP/s"),
               "live float32 matmul peak (2048² matmul)": Number(m.peak_gflops, "GFLOP/s"),
               "live GEMV rate, same matrix": Number(m.gemv_gflops, "GFLOP/s"),
               "live GEMM intensity, float32": Number(
                   roofline.matmul_intensity(m.tokens, m.shape[1], m.shape[0], 32, 4), "FLOP/byte"),
               "live ridge point of this CPU": Number(m.peak_gflops / m.copy_gbs, "FLOP/byte")}
        summary += (f"; live on this CPU one weight matrix times {m.tokens} tokens ran at {m.gemm_gflops:.0f} "
                    f"GFLOP/s, {m.gemm_gflops / m.gemv_gflops:.0f}× its one-token rate (a 2048² matmul measured "
                    f"beside it: {m.peak_gflops:.0f} GFLOP/s)")
        source = f"live, numpy on {m.machine}; {TABLES}"
    else:
        summary += " (live GEMM timing not run: live=False)"
    return Verdict("qualified", summary + ".", ev,
                   f"prompts longer than the ridge point in tokens ({h200:.0f} on an H200; {over_100} for "
                   "100 FLOP/byte); clock scaling untested", source)


C26 = claim("C26", "roofline", check_c26,
            short="prefill GEMMs have high arithmetic intensity (>100 FLOP/byte), saturate the tensor units and "
                  "scale with compute clock",
            quote="Prompt pre-fill evaluates GEMM operations where high arithmetic intensity (FLOPs/byte > 100) "
                  "saturates GPU tensor cores and scales linearly with compute clock frequencies.")


def check_c14(live: bool) -> Verdict:
    """TTFT vs prompt length and decode cost vs context: live on the shipped model, roofline at scale."""
    ev = {"KV cache per token, Llama-3.1-8B, bf16": Number(roofline.kv_bytes_per_token(LLAMA8B) / 1e6, "MB")}
    for ctx in (8192, 32768, 131072):
        ev[f"KV read / weight read, {ctx // 1024}k context"] = Number(
            100 * roofline.kv_cache_bytes(LLAMA8B, ctx) / roofline.weight_bytes(LLAMA8B, 16), "%")
    for n in (8192, 131072):
        ev[f"attention share of prefill FLOPs, {n // 1024}k prompt"] = Number(100 * attention_share(LLAMA8B, n), "%")
    kv8, kv128 = ev["KV read / weight read, 8k context"].value, ev["KV read / weight read, 128k context"].value
    summary = (f"Decode cost per token is constant only while the KV read is small next to the weights "
               f"(Llama-3.1-8B: {kv8:.0f}% of them at 8k, {kv128:.0f}% at 128k, where a token costs "
               f"~{1 + kv128 / 100:.1f}×), and TTFT outgrows O(N) once attention's N² FLOPs matter "
               f"({ev['attention share of prefill FLOPs, 128k prompt'].value:.0f}% of a 128k prefill)")
    source = TABLES
    if live:
        t = measure_forward()
        flat, per_token, per_token_sq = fit_ttft(t.lengths, t.seconds)
        n, (d_lo, d_hi) = t.lengths[-1], t.decode_seconds
        quad = 100 * per_token_sq * n**2 / (flat + per_token * n + per_token_sq * n**2)
        ev |= {"live forward, 1 token": Number(1e3 * t.seconds[0], "ms"),
               f"live forward, {n} tokens": Number(1e3 * t.seconds[-1], "ms"),
               "live fit: flat term": Number(1e3 * flat, "ms"),
               "live fit: linear term": Number(1e3 * per_token, "ms/token"),
               "live knee (flat / linear term)": Number(flat / per_token, "tokens"),
               f"live fit: quadratic term's share at {n} tokens": Number(quad, "%"),
               f"attention share of FLOPs, {t.shape.name}, {n} tokens": Number(100 * attention_share(t.shape, n), "%"),
               f"live decode step, context {t.decode_contexts[0]}": Number(1e3 * d_lo, "ms"),
               f"live decode step, context {t.decode_contexts[1]}": Number(1e3 * d_hi, "ms")}
        summary += (f"; live, {t.shape.name} on this CPU: TTFT = {1e3 * flat:.1f} ms + {1e3 * per_token:.2f} "
                    f"ms/token + a quadratic term, flat up to ~{flat / per_token:.0f} tokens, the quadratic term "
                    f"{quad:.0f}% of TTFT at {n} tokens (attention is {100 * attention_share(t.shape, n):.0f}% of "
                    f"the FLOPs there), and a decode step ×{d_hi / d_lo:.2f} from context "
                    f"{t.decode_contexts[0]} to {t.decode_contexts[1]}")
        source = f"live, MLX {t.shape.name} on this CPU, one BLAS thread; {TABLES}"
    else:
        rec = {r["metric"]: (name, mach, r) for name, mach, r in recorded("decode", SHIPPED_MODEL.stem)
               if r.get("variant") == "sync"}
        if {"ttft_ms", "prefill_tokens_per_s", "itl_p50_ms"} <= rec.keys():
            name, mach, r = rec["ttft_ms"]
            prompt = round(rec["prefill_tokens_per_s"][2]["value"] * r["value"] / 1e3)
            ev[f"recorded TTFT, {prompt}-token prompt"] = Number(r["value"], "ms")
            ev[f"recorded decode step p50, context {prompt + 1}-{r['context']}"] = Number(
                rec["itl_p50_ms"][2]["value"], "ms")
            summary += f" (live sweep not run; TTFT and decode step recorded in results/{name})"
            source = f"results/{name} (machine {mach['label']}); {TABLES}"
        else:
            summary += " (live sweep not run: live=False, and no recorded results)"
    return Verdict("qualified", summary + ".", ev,
                   "prompts past the knee yet short enough that attention's N² term stays small; contexts "
                   "short enough that the KV bytes read per token stay small next to the weight bytes", source)


C14 = claim("C14", "roofline", check_c14,
            short="TTFT grows with prompt length (O(N), compute); per-token generation cost is O(1), bandwidth",
            quote="TTFT scales with prompt length in proportion to compute matrix FLOPs (O(N)), while sequential "
                  "token generation scales purely with memory bandwidth per token (O(1)).")


# Quoted from the claim, not measured.
C04_GB, C04_TOKENS, C04_UTIL = 7.8, (85.0, 92.0), (0.80, 0.85)


def check_c04(live: bool) -> Verdict:
    """7.8 GB per token, 80-85% of the bus, 85-92 tok/s: which bus makes all three hold at once."""
    read = [implied_bandwidth_gbs(t, C04_GB) for t in C04_TOKENS]
    bus = (read[0] / C04_UTIL[1], read[1] / C04_UTIL[0])        # the widest range the claim allows
    pins = [b * 8 / C03_BUS_BITS for b in bus]
    card = roofline.HARDWARE[GDDR7_CARD].bandwidth_gbs
    ev = {f"implied read rate at {t:.0f} tok/s": Number(r, "GB/s") for t, r in zip(C04_TOKENS, read)}
    ev |= {"implied theoretical bandwidth, low": Number(bus[0], "GB/s"),
           "implied theoretical bandwidth, high": Number(bus[1], "GB/s"),
           "pin rate that needs on a 256-bit bus, low": Number(pins[0], "Gbps"),
           "pin rate that needs on a 256-bit bus, high": Number(pins[1], "Gbps"),
           "stored bits per weight (nominal 12B in 7.8 GB)": Number(C04_GB * 8 / 12, "bits")}
    expect = {}
    for name, gbs in ((GDDR7_CARD, card), ("C03's 256-bit bus", C03_GBS)):
        expect[name] = [u * gbs / C04_GB for u in C04_UTIL]
        ev |= {f"{name} ({gbs:.0f} GB/s) at {100 * u:.0f}%": Number(x, "tok/s") for u, x in zip(C04_UTIL, expect[name])}
    ev[f"{GDDR7_CARD} at 100%"] = Number(card / C04_GB, "tok/s")
    kv = roofline.kv_cache_bytes(shapes.PUBLIC["Gemma-3-12B"], 8192) / 1e9  # stand-in: Gemma 4 is not in shapes.PUBLIC
    ev["KV read per token at 8k context, Gemma-3-12B shape, bf16"] = Number(kv, "GB")
    (c_lo, c_hi), (b_lo, b_hi) = expect[GDDR7_CARD], expect["C03's 256-bit bus"]
    summary = (f"{C04_TOKENS[0]:.0f}-{C04_TOKENS[1]:.0f} tok/s × {C04_GB} GB is {read[0]:.0f}-{read[1]:.0f} GB/s, "
               f"which at {100 * C04_UTIL[0]:.0f}-{100 * C04_UTIL[1]:.0f}% needs a {bus[0]:.0f}-{bus[1]:.0f} GB/s "
               f"bus; at that utilization the {GDDR7_CARD} ({card:.0f} GB/s) would give {c_lo:.0f}-{c_hi:.0f} "
               f"tok/s and C03's {C03_GBS:.0f} GB/s bus {b_lo:.0f}-{b_hi:.0f}, so the three numbers fit "
               "together only on a slower card (arithmetic only: no GDDR7 card was measured)")
    return Verdict("qualified", summary + ".", ev,
                   f"a GDDR7 card of {bus[0]:.0f}-{bus[1]:.0f} GB/s (a 256-bit bus at {pins[0]:.1f}-{pins[1]:.1f} "
                   f"Gbps per pin), batch 1, short context (at 8k the KV read adds ~{kv:.1f} GB per token)",
                   f"the claim's own numbers and C03's; {TABLES}")


C04 = claim("C04", "roofline", check_c04,
            short="Gemma 4 12B at 7.8 GB fully in GDDR7: 80-85% of theoretical bandwidth, 85-92 tokens/s",
            quote="For models fully resident in GDDR7 VRAM (such as Gemma 4 12B at 7.8 GB), sustained memory bus "
                  "utilization achieves 80-85% of theoretical bandwidth, delivering 85-92 tokens per second.")


CLAIMS = (C04, C14, C26, C27)   # in id order; __init__ assembles the registry
