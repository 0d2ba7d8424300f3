"""Chapter 0, the roofline (book/intro/roofline): C04, C14, C26 and C27.

Decode reads every weight once per token; prefill reuses each weight across the prompt. The rules put
those intensities against the sourced ridge points and each machine's reference forward sweep (TTFT per
prompt, decode step per context: `forward_sweeps`). With `live=True` gather also asks measure.decode for
this machine's GEMV and GEMM (`measure_matmul`) and the shipped model's forward (`measure_forward`), each
measured once per process there: reported beside a verdict, never deciding it.

See chapter: intro-roofline
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ref_impl.formats import ggml
from ref_impl.ledger import core
from ref_impl.ledger.core import SHIPPED_MODEL, TABLES, Number, Verdict, claim, decide, figure, repeated
from ref_impl.ledger.signalling import C03_BUS_BITS, C03_GBS, GDDR7_CARD
from ref_impl.measure import records
from ref_impl.measure.decode import ForwardTiming, MatmulTiming, measure_forward, measure_matmul
from ref_impl.theory import roofline, shapes
from ref_impl.theory import signalling as sg
from ref_impl.theory.shapes import ModelShape

# ---- the live readings as evidence --------------------------------------------------------------------

def matmul_rates(m: MatmulTiming) -> dict[str, Number]:
    """A live `MatmulTiming` as rates, each the median of its repeats with their range."""
    nbytes, flops = 4 * m.shape[0] * m.shape[1], 2 * m.shape[0] * m.shape[1]
    return {"gemv_gbs": repeated([nbytes / s / 1e9 for s in m.gemv_s], "GB/s"),
            "gemv_gflops": repeated([flops / s / 1e9 for s in m.gemv_s], "GFLOP/s"),
            "gemm_gflops": repeated([flops * m.tokens / s / 1e9 for s in m.gemm_s], "GFLOP/s"),
            "copy_gbs": repeated(list(m.copy_gbs), "GB/s"),
            "peak_gflops": repeated(list(m.peak_gflops), "GFLOP/s")}


# ---- arithmetic the checks share --------------------------------------------------------------------

def model_intensity(shape: ModelShape, n_tokens: int, bits: float = 16, act_bytes: float = 2) -> float:
    """FLOP per byte of all of a model's matmuls on n tokens at once (weights and activations moved)."""
    flops, nbytes = zip(*(roofline.matmul_cost(n_tokens, k, m, bits, act_bytes)
                          for k, m in roofline.matmul_shapes(shape)))
    return sum(flops) / sum(nbytes)


def first_length(reaches: Callable[[int], bool], longest: int = 1 << 20) -> int:
    """The fewest tokens for which a quantity that grows with the length `reaches` its mark (bisection)."""
    lo, hi = 1, longest
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if reaches(mid) else (mid + 1, hi)
    return lo


def tokens_to_reach(shape: ModelShape, intensity: float, bits: float = 16) -> int:
    """The fewest tokens per pass for which `model_intensity` exceeds `intensity`."""
    return first_length(lambda n: model_intensity(shape, n, bits) > intensity)


def attention_share(shape: ModelShape, prompt_len: int) -> float:
    """Fraction of a prefill's FLOPs spent in attention (Q.K and scores.V): the part that grows as N²."""
    return 1 - 2 * roofline.matmul_params(shape) * prompt_len / roofline.prefill_flops(shape, prompt_len)


def fit_terms(lengths, seconds, degree: int) -> tuple[float, ...]:
    """(a, b, ...) of t(L) = a + b L + c L² ... up to L**degree by least squares on relative error."""
    L, t = np.array(lengths, float), np.array(seconds, float)
    design = np.stack([L**k for k in range(degree + 1)], axis=1) / t[:, None]
    return tuple(float(v) for v in np.linalg.lstsq(design, np.ones_like(t), rcond=None)[0])


def hardware_of(machine: dict) -> roofline.Hardware | None:
    """The datasheet entry of a results file's GPU ("NVIDIA H200, ..." -> H200 SXM), None on a CPU."""
    found = [hw for hw in roofline.HARDWARE.values() if hw.name.removesuffix(" SXM") in (machine.get("gpu") or "")]
    return found[0] if found and machine.get("backend") != "cpu" else None


def bits_of(ggml_type: str) -> float:
    """Bits per weight of a GGML type name ("F16": 16, "Q4_K": 4.5)."""
    return 8 * ggml.BLOCK[ggml.GGMLType[ggml_type]][1] / ggml.BLOCK[ggml.GGMLType[ggml_type]][0]


def listed(items: list[str]) -> str:
    """'a', 'a and b', 'a, b and c'."""
    return " and ".join(filter(None, [", ".join(items[:-1]), items[-1]])) if items else "none"


def spans(lengths) -> str:
    """Lengths in tokens as the text prints them: '128 and 512', '2,048-32,768'."""
    xs = sorted(lengths)
    return f"{xs[0]:,}-{xs[-1]:,}" if len(xs) > 2 else listed([f"{x:,}" for x in xs])


# ---- the recorded forward sweep ------------------------------------------------------------------------

@dataclass(frozen=True)
class Sweep:
    """One machine's recorded sweep of a public model shape: TTFT per prompt length and the decode step
    per context (`bench --dispatch --shapes`), with the shape's arithmetic at those lengths."""
    machine: str                      # its label in results/
    source: str                       # the caption of its run (`records.Run.caption`)
    model: str
    ttft_ms: dict[int, float]         # prompt length -> TTFT
    step_ms: dict[int, float]         # context -> decode step, median
    flops: dict[int, float]           # prompt length -> FLOPs of its prefill (roofline.prefill_flops)
    attention: dict[int, float]       # prompt length -> attention's share of those FLOPs
    intensity: dict[int, float]       # prompt length -> FLOP/byte of the matmuls at the recorded weights
    attention_half: int               # the prompt at which attention is half the prefill's FLOPs
    gpu: str = ""                     # the GPU's name in roofline.HARDWARE; "" on a CPU
    peak_tflops: float | None = None  # its datasheet dense peak


SWEEP_PENDING = ("the forward sweep of a public model shape (TTFT per prompt, decode step per context)",
                 "python -m ref_impl bench --dispatch --shapes Llama-3.1-8B")


def forward_sweeps() -> list[Sweep]:
    """Every machine's reference sweep of a public shape (its reference "ttft" run, and the decode steps of
    its reference "itl" run: one `bench --dispatch --shapes` run records both) with at least 3 prompt
    lengths and contexts."""
    sweeps = []
    for label, run in records.references("ttft", core.RESULTS_DIR, metric="ttft_ms", peer=None).items():
        steps = records.reference("itl", label, core.RESULTS_DIR, metric="itl_p50_ms", peer=None)
        source = run.caption if steps is None or steps.file == run.file else \
            f"{run.caption}; its decode steps: {steps.caption}"
        for model in sorted({r["model"] for r in run.records if r["model"] in shapes.PUBLIC}):
            ttft = {r["context"]: r for r in run.select(model=model)}
            step = {r["context"]: r["value"] for r in (steps.select(model=model) if steps else ())}
            if len(ttft) < 3 or len(step) < 3:
                continue
            shape, hw = shapes.PUBLIC[model], hardware_of(run.machine)
            sweeps.append(Sweep(
                label, source, model, {n: r["value"] for n, r in ttft.items()}, step,
                {n: roofline.prefill_flops(shape, n) for n in ttft}, {n: attention_share(shape, n) for n in ttft},
                {n: model_intensity(shape, n, bits_of(r["weights"])) for n, r in ttft.items()},
                first_length(lambda n: attention_share(shape, n) >= 0.5),
                hw.name if hw else "", hw.peak_tflops if hw else None))
    return sweeps


# ---- C27: decode GEMVs ---------------------------------------------------------------------------------

LLAMA8B = shapes.PUBLIC["Llama-3.1-8B"]
RIDGED = [hw for hw in roofline.HARDWARE.values() if hw.peak_tflops is not None]  # Apple: no sourced peak
C27_MODELS = ("Llama-3.2-1B", "Llama-3.1-8B", "Qwen3-32B")
APPROX_ONE = (0.5, 1.5)   # "approx. 1": what rounds to 1 at one significant figure
Q4K_BITS = 4.5            # Q4_K's bits per weight (the kquants chapter), the weights local inference runs


@dataclass(frozen=True)
class GemvEvidence:
    """C27: FLOP/byte of one token through every weight matrix of each model, (lowest, highest) over its
    matrices at 16 bits and at Q4_K's 4.5; the sourced ridge points; this machine's matmuls."""
    at16: dict[str, tuple[float, float]]
    at_q4k: dict[str, tuple[float, float]]
    ridges: dict[str, float]                  # GPU -> peak FLOP/s over bandwidth
    live: MatmulTiming | None = None


def gather_c27(live: bool) -> GemvEvidence:
    """Arithmetic on the sourced tables, and with `live` this machine's GEMV and GEMM."""
    def span(bits: float) -> dict[str, tuple[float, float]]:
        each = {n: [roofline.matmul_intensity(1, k, m, bits) for k, m in roofline.matmul_shapes(shapes.PUBLIC[n])]
                for n in C27_MODELS}
        return {n: (min(v), max(v)) for n, v in each.items()}
    return GemvEvidence(span(16), span(Q4K_BITS), {hw.name: roofline.ridge_point(hw) for hw in RIDGED},
                        measure_matmul() if live else None)


def live_matmul(m: MatmulTiming) -> tuple[dict[str, Number], str, str]:
    """This machine's GEMV and GEMM as evidence, and a clause on each: reported beside a verdict, never deciding it."""
    r = matmul_rates(m)
    gbs, gemv, gemm, copy, peak = (n.value for n in r.values())     # in matmul_rates' order
    ev = {"live GEMV read rate": r["gemv_gbs"], "live bandwidth, numpy's copy": r["copy_gbs"],
          "live GEMV rate": r["gemv_gflops"], f"live GEMM rate, same matrix, {m.tokens} tokens": r["gemm_gflops"],
          "live float32 matmul peak (2048² matmul)": r["peak_gflops"], "live ridge point of this CPU":
          Number(peak / copy, "FLOP/byte"), "live GEMM intensity, float32": Number(
              roofline.matmul_intensity(m.tokens, m.shape[1], m.shape[0], 32, 4), "FLOP/byte")}
    head = "; this machine's reading (beside the rule): "
    return (ev, f"{head}one {m.shape[0]}×{m.shape[1]} float32 GEMV read {figure(gbs)} GB/s ({100 * gbs / copy:.0f}% "
                f"of this machine's bandwidth, numpy's copy) but did {figure(gemv)} GFLOP/s, 1/{gemm / gemv:.0f} of "
                f"what the same weights did times {m.tokens} tokens",
            f"{head}one weight matrix times {m.tokens} tokens ran at {figure(gemm)} GFLOP/s, {gemm / gemv:.0f}× its "
            f"one-token rate (a 2048² matmul beside it: {figure(peak)} GFLOP/s)")


def judge_c27(e: GemvEvidence) -> Verdict:
    """'approx. 1' at 16 bits and at Q4_K's 4.5, and under every ridge: the ALUs wait on memory."""
    lo16, hi16 = min(v[0] for v in e.at16.values()), max(v[1] for v in e.at16.values())
    lo4, hi4 = min(v[0] for v in e.at_q4k.values()), max(v[1] for v in e.at_q4k.values())
    low_gpu = min(e.ridges, key=e.ridges.get)
    ridge_lo, ridge_hi = e.ridges[low_gpu], max(e.ridges.values())
    one16 = APPROX_ONE[0] <= lo16 and hi16 < APPROX_ONE[1]
    one4 = APPROX_ONE[0] <= lo4 and hi4 < APPROX_ONE[1]
    waits = max(hi16, hi4) < ridge_lo
    status = decide(one4, contradicted=not (one16 and waits))
    busy = 100 * max(hi16, hi4) / ridge_lo     # at most, while memory streams at full rate
    models = ", ".join(e.at16)
    ev = {f"lowest GEMV intensity, 16-bit, any matrix of {models}": Number(lo16, "FLOP/byte"),
          f"highest GEMV intensity, 16-bit, any matrix of {models}": Number(hi16, "FLOP/byte"),
          f"lowest GEMV intensity at Q4_K's {Q4K_BITS} bits/weight": Number(lo4, "FLOP/byte"),
          f"highest GEMV intensity at Q4_K's {Q4K_BITS} bits/weight": Number(hi4, "FLOP/byte")}
    ev |= {f"ridge point, {name}": Number(r, "FLOP/byte") for name, r in e.ridges.items()}
    ev[f"most the ALUs can be busy (highest GEMV over the {low_gpu}'s ridge)"] = Number(busy, "%")
    widths = "at 16 and at 4.5 bits" if one4 else "at 16 bits" if one16 else "at neither 16 nor 4.5 bits"
    head = {"confirmed": "A GEMV does about 1 FLOP per byte at 16 bits and at Q4_K's 4.5 alike",
            "qualified": f"About 1 FLOP per byte holds for 16-bit weights only: a GEMV does {lo16:#.3g}-{hi16:#.3g} "
                         f"at 16 bits but {lo4:#.3g}-{hi4:#.3g} at Q4_K's {Q4K_BITS} bits per weight",
            "refuted": f"A GEMV is about 1 FLOP per byte {widths}; the ALUs {'do' if waits else 'do not'} wait"}[status]
    summary = (f"{head}; at {lo16:#.3g}-{max(hi16, hi4):#.3g} FLOP/byte ({models}, every weight matrix, one token) "
               f"it is {'under' if waits else 'not under'} every sourced ridge point ({ridge_lo:.0f}-{ridge_hi:.0f} "
               f"FLOP/byte), so the ALUs are busy at most {busy:.1f}% of the time while memory streams the weights")
    condition = (f"one sequence (batch 1; B sequences multiply the intensity by about B); 'approx. 1' {widths} "
                 f"(rounds to 1: {APPROX_ONE[0]}-{APPROX_ONE[1]}); the ALUs wait on memory on every sourced GPU"
                 if waits else f"one sequence; intensities under {ridge_lo:.0f} FLOP/byte, the {low_gpu}'s ridge")
    source = TABLES
    if e.live is not None:
        live_ev, text, _ = live_matmul(e.live)
        ev, summary = ev | live_ev, summary + text
        source = f"live, numpy on {e.live.machine} (beside the rule); {source}"
    return Verdict(status, summary + ".", ev, condition, source)


C27 = claim("C27", "roofline", gather_c27, judge_c27,
            short="decode GEMVs have intensity ~1 FLOP/byte; ALUs idle waiting on DRAM",
            quote="Auto-regressive decoding executes GEMV operations with minimal arithmetic intensity (FLOPs/byte "
                  "approx. 1), causing GPU compute ALUs to sit idle while awaiting memory bus DRAM/GDDR reads.",
            rule="Evidence: FLOP/byte of one token through every weight matrix of three public models, at 16 bits "
                 "and at Q4_K's 4.5, against every sourced ridge point; 'approx. 1' means it rounds to 1 (0.5-1.5), "
                 "and ALUs wait on memory below the ridge. Refuted if a 16-bit GEMV is not approx. 1 or any GEMV "
                 "reaches a ridge; confirmed if the 4.5-bit ones are approx. 1 too; qualified otherwise.",
            outcomes=("confirmed", "qualified", "refuted"))


# ---- C26: prefill GEMMs ----------------------------------------------------------------------------------

C26_INTENSITY = 100.0   # quoted from the claim: FLOP/byte
SATURATED = 0.5         # tensor units busy at least half the time: the share of the dense peak that counts


@dataclass(frozen=True)
class PrefillEvidence:
    """C26: where a model's matmuls pass 100 FLOP/byte and each ridge, and the GPU sweeps with a datasheet peak."""
    model: str
    over_100: int                             # tokens
    ridges: dict[str, tuple[float, int]]      # GPU -> (ridge FLOP/byte, the prompt that passes it)
    sweeps: tuple[Sweep, ...]
    live: MatmulTiming | None = None


def gather_c26(live: bool) -> PrefillEvidence | None:
    """The tables' arithmetic and the recorded GPU sweeps (None when none is recorded); live: this CPU's GEMM."""
    sweeps = tuple(s for s in forward_sweeps() if s.peak_tflops)
    if not sweeps:
        return None
    ridges = {hw.name: (roofline.ridge_point(hw), tokens_to_reach(LLAMA8B, roofline.ridge_point(hw))) for hw in RIDGED}
    return PrefillEvidence(LLAMA8B.name, tokens_to_reach(LLAMA8B, C26_INTENSITY), ridges, sweeps,
                           measure_matmul() if live else None)


def judge_c26(e: PrefillEvidence) -> Verdict:
    """Does more than 100 FLOP/byte keep the tensor units at least half busy? Arithmetic and the sweeps."""
    low_gpu = min(e.ridges, key=lambda g: e.ridges[g][0])
    ridge_lo, ridge_hi = e.ridges[low_gpu][0], max(r for r, _ in e.ridges.values())
    runs = [(s, n, s.intensity[n], s.flops[n] / (s.ttft_ms[n] / 1e3) / (s.peak_tflops * 1e12))
            for s in e.sweeps for n in sorted(s.ttft_ms)]
    short = [(s, n, i, u) for s, n, i, u in runs if i > C26_INTENSITY and u < SATURATED]
    busy = [(s, n, i, u) for s, n, i, u in runs if u >= SATURATED]
    status = decide(False, contradicted=ridge_lo > C26_INTENSITY or bool(short))
    ev = {f"prompt at which {e.model}'s matmuls pass {C26_INTENSITY:.0f} FLOP/byte": Number(e.over_100, "tokens")}
    ev |= {f"prompt at which they pass the ridge, {g} ({r:.0f} FLOP/byte)": Number(n, "tokens")
           for g, (r, n) in e.ridges.items()}
    for s, n, i, u in runs:
        ev[f"{s.model}, {n:,}-token prefill on {s.machine}: intensity"] = Number(i, "FLOP/byte")
        ev[f"{s.model}, {n:,}-token prefill on {s.machine}: share of the {s.gpu}'s dense peak"] = Number(100 * u, "%")
    parts = []
    if ridge_lo > C26_INTENSITY:
        parts.append(f"every sourced ridge point is higher ({ridge_lo:.0f}-{ridge_hi:.0f} FLOP/byte), so just over "
                     f"{C26_INTENSITY:.0f} each GPU in the table waits on memory")
    if short:
        parts.append(f"on {short[0][0].machine} the recorded {spans(n for _, n, _, _ in short)}-token prefills "
                     f"({listed([f'{i:.0f}' for _, _, i, _ in short])} FLOP/byte) kept the tensor units "
                     f"{listed([f'{100 * u:.0f}%' for *_, u in short])} busy")
    reach = (f"the recorded rate reached {100 * max(u for *_, u in busy):.0f}% of the dense peak from "
             f"{min(n for _, n, _, _ in busy):,} tokens on" if busy else
             f"no recorded prefill kept them half busy (at most {100 * max(u for *_, u in runs):.0f}%)")
    passes = f"{e.model}'s matmuls pass {C26_INTENSITY:.0f} FLOP/byte from {e.over_100}-token prompts"
    summary = (f"More than {C26_INTENSITY:.0f} FLOP/byte does not saturate the tensor units: {'; and '.join(parts)}. "
               f"{passes}; {reach}" if status == "refuted" else f"{passes}, and every recorded prefill over it kept "
               f"the tensor units at least half busy ({reach}), so only prompts that long qualify"
               ) + "; scaling with the compute clock is not measured"
    condition = (f"prompts long enough to keep the tensor units busy ({reach}), not a fixed "
                 f"{C26_INTENSITY:.0f} FLOP/byte; clock scaling untested (the H200's clocks are left as they are)")
    source = "; ".join(sorted({s.source for s in e.sweeps})) + f"; {TABLES}"
    if e.live is not None:
        live_ev, _, text = live_matmul(e.live)
        ev, summary = ev | live_ev, summary + text
        source = f"live, numpy on {e.live.machine} (beside the rule); {source}"
    return Verdict(status, summary + ".", ev, condition, source)


C26 = claim("C26", "roofline", gather_c26, judge_c26,
            short="prefill GEMMs have high arithmetic intensity (>100 FLOP/byte), saturate the tensor units and "
                  "scale with compute clock",
            quote="Prompt pre-fill evaluates GEMM operations where high arithmetic intensity (FLOPs/byte > 100) "
                  "saturates GPU tensor cores and scales linearly with compute clock frequencies.",
            rule="Evidence: the prompt at which Llama-3.1-8B's matmuls pass 100 FLOP/byte and each sourced ridge; a "
                 "recorded GPU prefill sweep, FLOPs / TTFT as a share of the dense peak (saturated from half). Refuted "
                 "if every ridge exceeds 100 or a recorded prefill over 100 FLOP/byte ran under half the peak; else "
                 "qualified, naming the prompt length. Never confirmed: clock scaling is not measurable here.",
            outcomes=("qualified", "refuted"), pending=SWEEP_PENDING)


# ---- C14: TTFT against the prompt, a decode step against the context -------------------------------------

@dataclass(frozen=True)
class ScalingEvidence:
    """C14: the recorded sweeps, the roofline's crossovers for Llama-3.1-8B beside them, this CPU's sweep."""
    sweeps: tuple[Sweep, ...]
    kv_equals_weights: dict[float, int]   # bits per weight -> context at which the KV read equals the weight read
    live: ForwardTiming | None = None


def gather_c14(live: bool) -> ScalingEvidence | None:
    """The recorded sweeps (None when none is recorded) and the roofline's KV crossovers; live: this CPU's."""
    sweeps = tuple(forward_sweeps())
    if not sweeps:
        return None
    kv = roofline.kv_bytes_per_token(LLAMA8B)
    return ScalingEvidence(sweeps, {b: round(roofline.weight_bytes(LLAMA8B, b) / kv) for b in (16, Q4K_BITS)},
                           measure_forward(SHIPPED_MODEL) if live else None)


def live_forward(t: ForwardTiming) -> tuple[dict[str, Number], str]:
    """Evidence and a clause on the shipped model's forward on this CPU: reported beside a verdict."""
    med = [float(np.median(x)) for x in t.seconds]
    flat, per_token, per_token_sq = fit_terms(t.lengths, med, 2)   # weights and dispatch, matmuls, attention
    n = t.lengths[-1]
    quad = 100 * per_token_sq * n**2 / (flat + per_token * n + per_token_sq * n**2)
    (c_lo, c_hi), (d_lo, d_hi) = t.decode_contexts, t.decode_seconds
    ev = {"live forward, 1 token": repeated([1e3 * x for x in t.seconds[0]], "ms"),
          f"live forward, {n} tokens": repeated([1e3 * x for x in t.seconds[-1]], "ms"),
          "live fit: flat term": Number(1e3 * flat, "ms"), "live fit: linear term": Number(1e3 * per_token, "ms/token"),
          "live knee (flat / linear term)": Number(flat / per_token, "tokens"),
          f"live fit: quadratic term's share at {n} tokens": Number(quad, "%"),
          f"live decode step, context {c_lo}": repeated([1e3 * x for x in d_lo], "ms"),
          f"live decode step, context {c_hi}": repeated([1e3 * x for x in d_hi], "ms")}
    text = (f"; this machine's reading (beside the rule), {t.shape.name} on this CPU: TTFT = {1e3 * flat:.1f} ms + "
            f"{1e3 * per_token:.2f} ms/token + a quadratic term, flat up to ~{flat / per_token:.0f} tokens, and a "
            f"decode step ×{np.median(d_hi) / np.median(d_lo):.2f} from context {c_lo} to {c_hi}")
    return ev, text


def sweep_text(s: Sweep) -> tuple[bool, bool, str, str, dict[str, Number]]:
    """C14's rule on one sweep: (holds at every length, contradicted, the finding, the condition, evidence)."""
    rates = {n: s.flops[n] / t for n, t in s.ttft_ms.items()}                  # FLOP per ms
    best, contexts = max(rates.values()), sorted(s.step_ms)
    follows = [n for n in sorted(rates) if rates[n] >= best / 2 and s.attention[n] < 0.5]
    share = {n: 100 * r / best for n, r in rates.items()}                    # % of TTFT the FLOPs explain
    a, b = fit_terms(contexts, [s.step_ms[c] for c in contexts], 1)          # step = a + b * context
    flat = [c for c in contexts if b * c <= a]
    where, others = f"{s.model} on {s.machine}", sorted(set(s.ttft_ms) - set(follows))
    ev = {f"{where}: TTFT at {n:,} tokens": Number(t, "ms") for n, t in sorted(s.ttft_ms.items())}
    ev |= {f"{where}: FLOPs at the best rate / TTFT, {n:,} tokens": Number(share[n], "%") for n in sorted(share)}
    ev |= {f"{where}: decode step at context {c:,}": Number(t, "ms") for c, t in sorted(s.step_ms.items())}
    ev |= {f"{where}: decode step's fitted flat part": Number(a, "ms"),
           f"{where}: decode step's fitted context part": Number(1e6 * b, "ns per token of context"),
           f"{where}: attention's FLOPs equal the matmuls' at": Number(s.attention_half, "tokens")}
    cross = f"~{float(f'{a / b:.2g}'):,.0f} tokens" if b > 0 else "every context"      # a fit: two figures
    text = (f"on {s.machine}, {s.model}'s TTFT followed its FLOPs at {spans(follows) if follows else 'no'} tokens "
            f"(the FLOPs at the best rate, {figure(best / 1e9)} TFLOP/s, explain "
            f"{figure(min(share[n] for n in follows or share))}% of it or more)"
            + (f" but not at {spans(others)}, where they explain {listed([f'{share[n]:.0f}%' for n in others])}"
               if others else "")
            + f"; a decode step went from {s.step_ms[contexts[0]]:.2f} ms at context {contexts[0]:,} to "
            f"{s.step_ms[contexts[-1]]:.2f} ms at {contexts[-1]:,}, and its fitted context part ({1e6 * b:.0f} ns per "
            f"token) " + (f"passes its flat part ({a:.2f} ms) from {cross}" if len(flat) < len(contexts) else
                          f"stays under its flat part ({a:.2f} ms)"))
    condition = (f"on {s.machine}: prompts of {spans(follows) if follows else 'no recorded length'} tokens, below the "
                 f"{s.attention_half:,} where attention's N² FLOPs equal the matmuls'; decode contexts under {cross}")
    return (len(follows) == len(s.ttft_ms) and len(flat) == len(contexts), len(follows) < 2 or b * contexts[0] > a,
            text, condition, ev)


def judge_c14(e: ScalingEvidence) -> Verdict:
    """TTFT follows the FLOPs and the FLOPs are O(N); a decode step's flat part outweighs its context part."""
    found = [sweep_text(s) for s in e.sweeps]
    status = decide(all(f[0] for f in found), any(f[1] for f in found))
    ev = {k: n for f in found for k, n in f[4].items()}
    ev |= {f"roofline: KV read equals the weight read, Llama-3.1-8B, {b}-bit weights, 16-bit cache": Number(c, "tokens")
           for b, c in e.kv_equals_weights.items()}
    head = {"confirmed": "Both halves hold at every recorded length",
            "qualified": "Both halves hold only between bounds the claim leaves out",
            "refuted": "The recorded sweep contradicts a half of it"}[status]
    kv16, kv4 = e.kv_equals_weights[16], e.kv_equals_weights[Q4K_BITS]
    summary = (f"{head}: {'; '.join(f[2] for f in found)}. By the roofline, the KV read alone equals the weight read "
               f"at {kv16:,} tokens of context with 16-bit weights ({kv4:,} with Q4_K's), past which no step is O(1)")
    source = "; ".join(sorted({s.source for s in e.sweeps})) + f"; {TABLES}"
    if e.live is not None:
        live_ev, text = live_forward(e.live)
        ev, summary = ev | live_ev, summary + text
        source = f"live, MLX {e.live.shape.name} on this CPU (beside the rule); {source}"
    return Verdict(status, summary + ".", ev, "; ".join(f[3] for f in found), source)


C14 = claim("C14", "roofline", gather_c14, judge_c14,
            short="TTFT grows with prompt length (O(N), compute); per-token generation cost is O(1), bandwidth",
            quote="TTFT scales with prompt length in proportion to compute matrix FLOPs (O(N)), while sequential "
                  "token generation scales purely with memory bandwidth per token (O(1)).",
            rule="Evidence: a recorded sweep (TTFT per prompt, decode step per context). TTFT follows the FLOPs where "
                 "they explain half of it or more at the best recorded rate and attention is under half of them; a "
                 "decode step is O(1) where its fitted context part (a + b·c) is at most its flat part. Confirmed if "
                 "both hold at every length; refuted if TTFT follows at under two lengths or the context part "
                 "dominates from the shortest; qualified otherwise.",
            outcomes=("confirmed", "qualified", "refuted"), pending=SWEEP_PENDING)


# ---- C04: 7.8 GB at 80-85% of a GDDR7 bus, 85-92 tok/s ---------------------------------------------------

# Quoted from the claim, not measured.
C04_GB, C04_TOKENS, C04_UTIL = 7.8, (85.0, 92.0), (0.80, 0.85)
GDDR7_PINS = (float(sg.RTX5090_PIN_GBPS), float(sg.GDDR7["max_pin_gbps"]))   # the RTX 5090's rate to JESD239's top


@dataclass(frozen=True)
class BusEvidence:
    """C04: the claim's numbers, what GDDR7 buses can be, the GDDR7 cards in the table, the recorded analog."""
    gb: float
    tokens: tuple[float, float]
    util: tuple[float, float]
    cards: dict[str, float]                   # GDDR7 card -> datasheet GB/s
    pin_gbps: tuple[float, float]             # GDDR7 pin rates, slowest to fastest sourced
    max_bus_bits: int                         # the widest GDDR7 bus in the table
    kv_gb: float                              # KV read per token at 8k context, Gemma-3-12B's shape, bf16
    analog: tuple[str, str, float, float] | None = None   # (machine, source, achieved GB/s, datasheet GB/s)


def decode_analog() -> tuple[str, str, float, float] | None:
    """The reference 16-bit decode of Llama-3.1-8B's shape on a GPU (`bench --shape`; the newest run where
    several GPUs recorded one): its machine, its run's caption, the GB/s it read and its GPU's datasheet GB/s."""
    found = [run for run in records.references("decode-shape", core.RESULTS_DIR, model=LLAMA8B.name, weights="F16",
                                               peer=None).values() if hardware_of(run.machine)]
    if not found:
        return None
    run = max(found, key=lambda r: (r.date, r.file))
    read = run.value("decode-shape", "tokens_per_s") * run.value("decode-shape", "bytes_per_token") / 1e9
    return run.label, run.caption, read, hardware_of(run.machine).bandwidth_gbs


def gather_c04(live: bool) -> BusEvidence:
    """The claim's numbers, the tables' GDDR7 entries and the recorded analog (shown when recorded)."""
    kv = roofline.kv_cache_bytes(shapes.PUBLIC["Gemma-3-12B"], 8192) / 1e9   # stand-in: Gemma 4 is not in the table
    return BusEvidence(C04_GB, C04_TOKENS, C04_UTIL, {GDDR7_CARD: roofline.HARDWARE[GDDR7_CARD].bandwidth_gbs},
                       GDDR7_PINS, sg.RTX5090_BUS_BITS, kv, decode_analog())


def judge_c04(e: BusEvidence) -> Verdict:
    """Which bus makes 7.8 GB per token, 80-85% of it and 85-92 tok/s hold at once, and is it a GDDR7 one?"""
    read = [t * e.gb for t in e.tokens]                     # GB/s: every token reads the model once
    bus = (read[0] / e.util[1], read[1] / e.util[0])        # the widest range the claim allows
    device = [p * sg.GDDR7_DEVICE_PINS / 8 for p in e.pin_gbps]
    fits = [n for n in range(1, e.max_bus_bits // sg.GDDR7_DEVICE_PINS + 1)
            if n * device[0] <= bus[1] and n * device[1] >= bus[0]]
    outside = {c: g for c, g in e.cards.items() if not bus[0] <= g <= bus[1]}
    status = "not testable here" if fits and not outside else decide(False, contradicted=not fits)
    pins, tok = [b * 8 / C03_BUS_BITS for b in bus], {}          # on C03's bus; tok/s per bus at the claim's use
    ev = {f"implied read rate at {t:.0f} tok/s": Number(r, "GB/s") for t, r in zip(e.tokens, read)}
    ev |= {"implied theoretical bandwidth, low": Number(bus[0], "GB/s"),
           "implied theoretical bandwidth, high": Number(bus[1], "GB/s"),
           f"pin rate that needs on a {C03_BUS_BITS}-bit bus, low": Number(pins[0], "Gbps"),
           f"pin rate that needs on a {C03_BUS_BITS}-bit bus, high": Number(pins[1], "Gbps"),
           f"stored bits per weight (nominal 12B in {e.gb} GB)": Number(e.gb * 8 / 12, "bits")}
    for name, gbs in (*e.cards.items(), (f"C03's {C03_BUS_BITS}-bit bus", C03_GBS)):
        tok[name] = [u * gbs / e.gb for u in e.util]
        ev |= {f"{name} ({gbs:.0f} GB/s) at {100 * u:.0f}%": Number(x, "tok/s") for u, x in zip(e.util, tok[name])}
    ev |= {f"{c} at 100%": Number(g / e.gb, "tok/s") for c, g in e.cards.items()}
    ev["KV read per token at 8k context, Gemma-3-12B shape, bf16"] = Number(e.kv_gb, "GB")
    rates = f"{e.pin_gbps[0]:.0f}-{e.pin_gbps[1]:.0f} Gbps per pin"
    low = max(pins[0], e.pin_gbps[0])
    at256 = f"{low:.1f} Gbps" if pins[1] - low < 0.05 else f"{low:.1f}-{pins[1]:.1f} Gbps"
    widths = [n * sg.GDDR7_DEVICE_PINS for n in fits]
    buses = (f"buses of {min(fits)}-{max(fits)} GDDR7 devices ({min(widths)}-{max(widths)} bits) at {rates} can give "
             f"it" + (f", a {C03_BUS_BITS}-bit one at {at256}" if low <= pins[1] else "") if fits else
             f"no bus of whole GDDR7 devices up to {e.max_bus_bits} bits at {rates} gives that")
    cards = "; ".join(f"the {c} ({figure(g)} GB/s) at that utilization would give {tok[c][0]:.0f}-{tok[c][1]:.0f} tok/s"
                      for c, g in outside.items())
    head = {"qualified": f"The three numbers fit together only on a GDDR7 card of {bus[0]:.0f}-{bus[1]:.0f} GB/s",
            "refuted": f"No GDDR7 bus gives the {bus[0]:.0f}-{bus[1]:.0f} GB/s the three numbers need together",
            "not testable here": "Every GDDR7 card in the table fits the three numbers; only GDDR7 silicon can "
                                 "measure the utilization"}[status]
    summary = (f"{head}: {e.tokens[0]:.0f}-{e.tokens[1]:.0f} tok/s × {e.gb} GB is {read[0]:.0f}-{read[1]:.0f} GB/s, "
               f"which at {100 * e.util[0]:.0f}-{100 * e.util[1]:.0f}% needs a {bus[0]:.0f}-{bus[1]:.0f} GB/s bus, and "
               f"{buses}" + (f"; {cards}" if cards else "") + "; the utilization needs a GDDR7 card: not measured")
    source = f"the claim's own numbers and C03's; {TABLES}; {sg.SOURCES['jedec'].split(':')[0]}"
    if e.analog:
        label, src, achieved, sheet = e.analog
        ev[f"analog: 16-bit Llama-3.1-8B decode on {label}, share of the datasheet bandwidth"] = Number(
            100 * achieved / sheet, "%")
        summary += (f"; the portable analog, beside the rule: a 16-bit Llama-3.1-8B-shaped decode on {label} read "
                    f"{figure(achieved)} GB/s, {100 * achieved / sheet:.0f}% of the datasheet's {figure(sheet)}")
        source += f"; {src}"
    return Verdict(status, summary + ".", ev, f"a GDDR7 card of {bus[0]:.0f}-{bus[1]:.0f} GB/s (a {C03_BUS_BITS}-bit "
                   f"bus at {pins[0]:.1f}-{pins[1]:.1f} Gbps per pin), batch 1, short context (at 8k the KV read adds "
                   f"~{e.kv_gb:.1f} GB per token)", source)


C04 = claim("C04", "roofline", gather_c04, judge_c04,
            short="Gemma 4 12B at 7.8 GB fully in GDDR7: 80-85% of theoretical bandwidth, 85-92 tokens/s",
            quote="For models fully resident in GDDR7 VRAM (such as Gemma 4 12B at 7.8 GB), sustained memory bus "
                  "utilization achieves 80-85% of theoretical bandwidth, delivering 85-92 tokens per second.",
            rule="Evidence: the bus the claim's own numbers imply (7.8 GB per token, 85-92 tok/s at 80-85%); GDDR7 "
                 "buses of whole 32-pin devices at 28-48 Gbps per pin; the table's GDDR7 cards. Refuted if no such bus "
                 "gives it; qualified if one does but a card lies outside it; not testable here if every card fits "
                 "(the 80-85% needs GDDR7 silicon; a recorded GPU decode is shown as the analog).",
            outcomes=("qualified", "refuted", "not testable here"))


CLAIMS = (C04, C14, C26, C27)   # in id order; __init__ assembles the registry
