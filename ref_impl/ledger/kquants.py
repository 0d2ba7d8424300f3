"""Chapter K-quants (book/kquants/super-blocks): C11 and C19.

Q4_K's block layout counted from ggml's table and the engine's packing, its rounding error against
Q4_0's at the same bits for every matrix of the shipped model, llama.cpp's Llama-3-8B perplexity
scoreboard, and the reference runs of the quant and decode-shape suites (`quant_runs`, `shape_decodes`),
which the chapter's tables read too.

See chapter: kquants
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from ref_impl.formats import ggml, gguf, kquants, quantize
from ref_impl.ledger import core
from ref_impl.ledger.core import SHIPPED_MODEL, Number, Verdict, claim, decide
from ref_impl.measure import records
from ref_impl.measure.records import Run

# llama.cpp tools/perplexity/README.md, "LLaMA 3 8b Scoreboard" (revision f364eb6f, wikitext-2, no importance
# matrix): file type -> (model size in GiB, perplexity). Its Q4_K_M row is quantize.cpp's "+0.1754 ppl".
LLAMA3_8B_SCOREBOARD = {"F16": (14.97, 6.233160), "Q8_0": (7.96, 6.234284), "Q6_K": (6.14, 6.253382),
                        "Q5_K_M": (5.33, 6.288607), "Q4_K_M": (4.58, 6.407115)}
COMPARABLE_PCT = 1.0    # "comparable" perplexity: within 1% of F16's (the rule of C11 says why)
FRACTION = 0.5          # "a fraction" of F16's bytes: at most half of them


@dataclass(frozen=True)
class SuperBlock:
    """Q4_K's block: weights, bytes, fp16 numbers, and the 6-bit sub-block scales and minimums."""
    weights: int
    nbytes: int
    fp16: int
    scales: int
    mins: int
    bits: int = 6


def q4_k_block() -> SuperBlock:
    """Q4_K's super-block counted from ggml's block table and the engine's scale packing: what is not
    fp16 numbers or 4-bit codes is 6-bit fields, unpacked by kquants.unpack_scales_q4_k."""
    weights, nbytes = ggml.BLOCK[ggml.GGMLType.Q4_K]
    fp16 = 2                                                         # d and dmin (ggml-common.h block_q4_K)
    packed = nbytes - 2 * fp16 - weights // 2                       # 12 bytes of 6-bit fields
    scales, mins = kquants.unpack_scales_q4_k(np.zeros((1, packed), np.uint8))
    return SuperBlock(weights, nbytes, fp16, scales.shape[-1], mins.shape[-1])


@functools.cache
def matrix_errors() -> dict[str, dict[str, float]]:
    """Relative RMS error of Q4_K and Q4_0 (both 4.5 bits per weight) for every layer matrix of the shipped
    model, by tensor name; deterministic arithmetic, cached because both claims and the chapter use it
    (K-quant blocks run across its 384-wide rows)."""
    with gguf.read(SHIPPED_MODEL) as f:
        return {name: {fmt: quantize.relative_error(f.array(name), fmt) for fmt in ("Q4_K", "Q4_0")}
                for name, t in f.tensors.items() if len(t.shape) == 2 and name.startswith("blk.")}


def kquant_errors() -> dict[str, dict[str, float]]:
    """Mean relative RMS error of Q4_K and Q4_0 per kind of matrix of the shipped model."""
    by_kind: dict[str, dict[str, list[float]]] = {}
    for name, e in matrix_errors().items():
        for fmt, v in e.items():
            by_kind.setdefault(quantize.tensor_kind(name), {}).setdefault(fmt, []).append(v)
    return {k: {fmt: float(np.mean(v)) for fmt, v in d.items()} for k, d in by_kind.items()}


@dataclass(frozen=True)
class NoiseEvidence:
    """C19's evidence: the super-block, and Q4_K's error cut against Q4_0 (%) per matrix, by kind."""
    block: SuperBlock
    cuts: dict[str, tuple[float, ...]]


def gather_c19(live: bool) -> NoiseEvidence:
    cuts: dict[str, list[float]] = {}
    for name, e in matrix_errors().items():
        cuts.setdefault(quantize.tensor_kind(name), []).append(100 * (1 - e["Q4_K"] / e["Q4_0"]))
    return NoiseEvidence(q4_k_block(), {k: tuple(v) for k, v in cuts.items()})


def mean_and_error(values) -> tuple[float, float]:
    """The mean of `values` and its standard error."""
    v = np.asarray(values, float)
    return float(v.mean()), float(v.std(ddof=1) / math.sqrt(len(v))) if len(v) > 1 else 0.0


def judge_c19(ev: NoiseEvidence) -> Verdict:
    """The rule of C19 (see its `rule`), applied to the block and the error cuts."""
    b = ev.block
    group = {g: mean_and_error([c for k in quantize.MATRIX_GROUPS[g] for c in ev.cuts.get(k, ())])
             for g in ("attention projections", "MLP")}
    (attn, se_a), (mlp, se_m) = group["attention projections"], group["MLP"]
    margin = 2 * math.hypot(se_a, se_m)
    layout = b.weights == 256 and b.fp16 >= 1 and b.scales == 8 and b.bits == 6
    status = decide(holds=layout and attn - mlp > margin, contradicted=not layout or attn <= 0)
    evidence = {"weights per Q4_K super-block": Number(b.weights, "weights"),
                f"bytes per super-block ({b.fp16} fp16 + {b.nbytes - 2 * b.fp16 - b.weights // 2} packed + "
                f"{b.weights // 2} codes)": Number(b.nbytes, "B"),
                "bits per weight": Number(8 * b.nbytes / b.weights, "bits"),
                "fp16 numbers per super-block (scale d, minimum dmin)": Number(b.fp16, "fields"),
                f"{b.bits}-bit sub-block scales": Number(b.scales, "fields"),
                f"{b.bits}-bit sub-block minimums": Number(b.mins, "fields"),
                "Q4_K error cut vs Q4_0 (same 4.5 bits), attention projections": Number(attn, "%"),
                "Q4_K error cut vs Q4_0 (same 4.5 bits), MLP matrices": Number(mlp, "%"),
                "two standard errors of the difference": Number(margin, "points")}
    evidence |= {f"Q4_K error cut vs Q4_0, {k} ({len(v)} matrices)": Number(float(np.mean(v)), "%")
                 for k, v in ev.cuts.items()}
    facts = (f"a super-block holds {b.weights} weights in {b.nbytes} bytes ({8 * b.nbytes / b.weights:g} bits per "
             f"weight) with {b.fp16} fp16 numbers and {b.scales} scales of {b.bits} bits"
             + (f", plus {b.mins} minimums of {b.bits} bits that the claim leaves out" if b.mins else ""))
    cut = (f"Q4_K has {attn:.1f}% less rounding error than Q4_0 at the same bits in the attention projections "
           f"and {mlp:.1f}% less in the MLP matrices (two standard errors of the gap: {margin:.1f} points)")
    lead = {"confirmed": "Confirmed: the layout is as stated and the noise falls most in the attention projections",
            "qualified": "The layout is as stated but the noise falls in every kind of matrix, not in the attention "
                         "projections in particular",
            "refuted": "Refuted: " + ("the layout differs from the claim's" if not layout
                                      else "Q4_K is not less noisy than Q4_0 in the attention projections")}[status]
    condition = {"confirmed": "as stated: less noise than a one-scale format at equal bits, most in attention",
                 "qualified": "less noise than a one-scale 4-bit format (Q4_0) at equal bits, in every kind of "
                              "matrix alike; llama.cpp's Q4_K_M gives extra bits to attn_v and ffn_down, not to "
                              "attention as a whole",
                 "refuted": "none: " + ("the layout differs" if not layout else "no noise reduction in attention")}
    return Verdict(status, f"{lead}: {facts}; {cut}.", evidence, condition[status],
                   "ggml-common.h block_q4_K; the shipped model's weights (blocks across rows); arithmetic only")


C19 = claim("C19", "kquants", gather_c19, judge_c19,
            short="Q4_K: 256 weights, one FP16 super-block scale, eight 6-bit sub-block scales, less noise in "
                  "attention projections",
            quote="Super-block K-quants (Q4_K) group 256 weights into chunks with a shared FP16 super-block scale "
                  "and eight 6-bit sub-block scales, reducing quantization noise in attention projection layers.",
            rule="Evidence: Q4_K's super-block counted from ggml's block table and the engine's packing, and the "
                 "relative rounding error of Q4_K against Q4_0 (one fp16 scale per 32 weights, the same 4.5 bits) "
                 "for every matrix of the shipped model. Refuted if the super-block is not 256 weights with an fp16 "
                 "scale and eight 6-bit sub-block scales, or Q4_K is not less noisy than Q4_0 in the attention "
                 "projections. Confirmed if its error cut there exceeds the MLP's by more than two standard errors "
                 "(the claim singles attention out); qualified otherwise: less noise everywhere, not there in "
                 "particular.",
            outcomes=("confirmed", "qualified", "refuted"))


SHAPE = "Llama-3.1-8B"      # the decode-shape suite's model: that shape with random weights (bench --shape)


def quant_runs() -> dict[str, Run]:
    """Per machine label, the shipped model's reference quant run (bench --quant): its file sizes, held-out
    perplexities and decode speeds, peers' included, all from one run."""
    return records.references("quant", core.RESULTS_DIR, model=SHIPPED_MODEL.stem)


@dataclass(frozen=True)
class ShapeDecode:
    """One weight type's recorded decode of Llama-3.1-8B's shape on one machine (bench --shape), and the
    measured bandwidth of its run (`records.bandwidth`) that its share is divided by."""
    weights: str
    run: Run
    bits_per_weight: float
    bytes_per_token: float
    tokens_per_s: float
    bandwidth_gbs: float
    bandwidth_run: Run          # the run whose memory probes gave it: `run` itself where it recorded them

    @property
    def share(self) -> float:
        """Bytes read per second (tok/s x bytes per decode step) over the run's measured bandwidth."""
        return self.tokens_per_s * self.bytes_per_token / 1e9 / self.bandwidth_gbs


def shape_decodes(label: str) -> dict[str, ShapeDecode]:
    """Per weight type recorded on `label`, its reference decode-shape run's decode: the newest complete run
    that holds the type, since one bench --shape run records the types it was given (the H200's five types are
    two runs)."""
    types = {r["weights"]: None for run in records.runs("decode-shape", core.RESULTS_DIR, model=SHAPE, peer=None)
             if run.label == label for r in run.records}
    out = {}
    for wt in types:
        run = records.reference("decode-shape", label, core.RESULTS_DIR, model=SHAPE, weights=wt, peer=None)
        if run is None:
            continue
        gbs, source = records.bandwidth(run, core.RESULTS_DIR)
        value = {m: run.value("decode-shape", m) for m in ("bits_per_weight", "bytes_per_token", "tokens_per_s")}
        out[wt] = ShapeDecode(wt, run, value["bits_per_weight"], value["bytes_per_token"], value["tokens_per_s"], gbs,
                              source)
    return out


@dataclass(frozen=True)
class Q4KMEvidence:
    """C11's evidence: the super-block; per model, F16's and Q4_K_M's perplexity; per measure of bytes,
    F16's and Q4_K_M's; the shipped Q4_K_M's tensors per GGML type; and, shown beside, the recorded
    8B-shaped decode speed and share of measured bandwidth (F16, Q4_K_M) on `gpu`."""
    block: SuperBlock
    ppl: dict[str, tuple[float, float]]
    nbytes: dict[str, tuple[float, float]]
    mix: dict[str, int]
    speed: tuple[float, float]
    share: tuple[float, float]
    gpu: str
    source: str


def gather_c11(live: bool) -> Q4KMEvidence | None:
    """llama.cpp's scoreboard, the shipped model's reference quant run (the first machine's whose run scored
    F16 and Q4_K_M) and the reference decode-shape runs of F16 and Q4_K_M on a machine that recorded both
    (None when either is missing)."""
    scored = {label: run for label, run in quant_runs().items()
              if all(run.select("quant", weights=w, metric="heldout_perplexity", peer=None) for w in ("F16", "Q4_K_M"))}
    decodes = {label: shape_decodes(label) for label in records.references("decode-shape", core.RESULTS_DIR,
                                                                            model=SHAPE, peer=None)}
    decodes = {label: d for label, d in decodes.items() if {"F16", "Q4_K_M"} <= d.keys()}
    if not scored or not decodes:
        return None
    label, gpu = min(scored), min(decodes)
    run, (f16, q4) = scored[label], (decodes[gpu][w] for w in ("F16", "Q4_K_M"))
    ppl_records = [run.select("quant", weights=w, metric="heldout_perplexity", peer=None)[0] for w in ("F16", "Q4_K_M")]
    (g16, p16), (g4, p4) = LLAMA3_8B_SCOREBOARD["F16"], LLAMA3_8B_SCOREBOARD["Q4_K_M"]
    nbytes = tuple(run.value("quant", "tensor_bytes", weights=w, peer=None) for w in ("F16", "Q4_K_M"))
    shape_runs = sorted({d.run.caption for d in (f16, q4)} | {d.bandwidth_run.caption for d in (f16, q4)})
    return Q4KMEvidence(
        q4_k_block(),
        {"Llama-3-8B (llama.cpp's scoreboard)": (p16, p4), f"stdlib-10m (measured, {label})":
            tuple(r["value"] for r in ppl_records)},
        {"Llama-3-8B file (llama.cpp's scoreboard)": (g16, g4), f"stdlib-10m tensors (measured, {label})": nbytes,
         f"Llama-3.1-8B-shaped decode step (measured, {gpu})": (f16.bytes_per_token, q4.bytes_per_token)},
        dict(run.select("quant", weights="Q4_K_M", metric="tensor_bytes", peer=None)[0].get("mix", {})),
        (f16.tokens_per_s, q4.tokens_per_s), (f16.share, q4.share), gpu,
        f"quant: {run.caption}, {records.perplexity_text(ppl_records[0], run)}; decode-shape and its measured "
        f"bandwidth: {'; '.join(shape_runs)}; llama.cpp tools/perplexity/README.md (LLaMA 3 8b Scoreboard)")


def shipped_mix(mix: dict[str, int]) -> str:
    """The shipped Q4_K_M's quantized tensors in words: how many are K-quants, and the other types."""
    quantized = {t: n for t, n in mix.items() if t not in ("F32", "F16")}
    k = {t: n for t, n in quantized.items() if t.endswith("_K")}
    rest = ", ".join(f"{n} {t}" for t, n in sorted(quantized.items(), key=lambda tn: -tn[1]) if t not in k)
    return (f"{sum(k.values())} of {sum(quantized.values())} quantized tensors are K-quants"
            + (f" (the others {rest}: llama.cpp's fallbacks for rows that hold no whole super-block)" if rest else ""))


def judge_c11(ev: Q4KMEvidence) -> Verdict:
    """The rule of C11 (see its `rule`), applied to the perplexities and bytes."""
    b = ev.block
    rise = {m: 100 * (q / f - 1) for m, (f, q) in ev.ppl.items()}
    ratio = {m: 100 * q / f for m, (f, q) in ev.nbytes.items()}
    within = [m for m, r in rise.items() if r <= COMPARABLE_PCT]
    layout = b.weights == 256 and b.scales == b.mins > 0
    fraction = all(r <= 100 * FRACTION for r in ratio.values())
    status = decide(holds=layout and fraction and len(within) == len(rise),
                    contradicted=not layout or not fraction or not within)
    evidence = {"weights per Q4_K super-block": Number(b.weights, "weights"),
                "sub-block scales and minimums (offsets) per super-block": Number(b.scales + b.mins, "fields")}
    evidence |= {f"Q4_K_M perplexity increase over F16, {m}": Number(r, "%") for m, r in rise.items()}
    evidence |= {f"Q4_K_M bytes / F16 bytes, {m}": Number(r, "%") for m, r in ratio.items()}
    evidence |= {f"Llama-3-8B {t} perplexity increase over F16 (llama.cpp's scoreboard)":
                 Number(100 * (p / LLAMA3_8B_SCOREBOARD["F16"][1] - 1), "%")
                 for t, (_, p) in LLAMA3_8B_SCOREBOARD.items() if t not in ("F16", "Q4_K_M")}
    evidence |= {f"8B-shaped decode, Q4_K_M / F16 speed ({ev.gpu}, MLX)": Number(ev.speed[1] / ev.speed[0], "×"),
                 f"share of measured bandwidth reached, F16 ({ev.gpu}, MLX)": Number(100 * ev.share[0], "%"),
                 f"share of measured bandwidth reached, Q4_K_M ({ev.gpu}, MLX)": Number(100 * ev.share[1], "%")}
    ppl = "; ".join(f"{m}: {r:+.2f}% perplexity, {'within' if m in within else 'outside'} the "
                    f"{COMPARABLE_PCT:g}% band" for m, r in rise.items())
    nbytes = ", ".join(f"{r:.0f}% ({m})" for m, r in ratio.items())
    outside = [m for m in rise if m not in within]
    lead = {"confirmed": "Confirmed: Q4_K_M stays within the band on every model, at a fraction of the bytes",
            "qualified": f"Comparable only on some models: Q4_K_M reads a fraction of F16's bytes but its "
                         f"perplexity leaves the {COMPARABLE_PCT:g}% band on {' and '.join(outside)}",
            "refuted": "Refuted: " + ("Q4_K's super-block is not as stated" if not layout else
                                      "Q4_K_M does not read a fraction of F16's bytes" if not fraction else
                                      f"its perplexity leaves the {COMPARABLE_PCT:g}% band on every model")}[status]
    beside = (f"in the shipped model's Q4_K_M {shipped_mix(ev.mix)}; and on {ev.gpu} the bytes saved became "
              f"{ev.speed[1] / ev.speed[0]:.2f}× F16's decode speed (8B-shaped, MLX's quantized GEMV at "
              f"{100 * ev.share[1]:.0f}% of the measured bandwidth against F16's {100 * ev.share[0]:.0f}%)")
    condition = {"confirmed": "as stated, on every model measured",
                 "qualified": f"perplexity within {COMPARABLE_PCT:g}% of F16's only on " + " and ".join(within)
                              + f", not on {' and '.join(outside)}; bytes a fraction of F16's everywhere",
                 "refuted": "none measured"}[status]
    return Verdict(status, f"{lead}. {ppl}; bytes against F16's: {nbytes}. Beside the rule: {beside}.",
                   evidence, condition, ev.source)


C11 = claim("C11", "kquants", gather_c11, judge_c11,
            short="Q4_K_M super-blocks of 256 weights with sub-block scales and offsets keep perplexity comparable "
                  "to FP16 at a fraction of the bandwidth",
            quote="K-quants (Q4_K_M) partition weights into super-blocks of 256 weights containing sub-blocks with "
                  "independent scales and offsets, preserving perplexity comparable to unquantized FP16 at a "
                  "fraction of memory bandwidth.",
            rule="Evidence: Q4_K's super-block (ggml's table); Q4_K_M's perplexity against F16's on Llama-3-8B "
                 "(llama.cpp's perplexity scoreboard) and on the shipped model (recorded quant run); Q4_K_M's bytes "
                 "against F16's in both and in a recorded Llama-3.1-8B-shaped decode step. 'Comparable' is within 1% "
                 "of F16's perplexity, the band of the scoreboard's 5-bit and wider types; 'a fraction' is at most "
                 "half the bytes. Confirmed if every model stays within 1% at a fraction of the bytes; refuted if "
                 "none does, the bytes are no fraction, or the super-block is not 256 weights with sub-block scales "
                 "and offsets; qualified otherwise, naming the model outside the band.",
            outcomes=("confirmed", "qualified", "refuted"),
            pending=("the K-quants chapter's quant and decode-shape results",
                     "python -m ref_impl bench --quant F16 Q4_K_M --label my-machine; "
                     "python -m ref_impl bench --shape Llama-3.1-8B --weights F16 Q4_K_M --label my-gpu"))


CLAIMS = (C11, C19)   # in id order; __init__ assembles the registry
