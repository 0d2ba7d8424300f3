"""Chapter K-quants (book/kquants/super-blocks): C11 and C19.

Q4_K's block layout counted from ggml's, its rounding error against Q4_0's at the same bits per
kind of matrix of the shipped model, llama.cpp's published perplexity table, and the recorded
quant and decode-shape runs.
"""

from __future__ import annotations

import functools

import numpy as np

from ref_impl.formats import ggml, gguf, quantize
from ref_impl.ledger.core import SHIPPED_MODEL, Number, Verdict, claim, results


@functools.cache
def kquant_errors() -> dict[str, dict[str, float]]:
    """Mean relative RMS error of Q4_K and Q4_0 (both 4.5 bits per weight) per kind of matrix of the
    shipped model; deterministic arithmetic, no timing (K-quant blocks run across its 384-wide rows)."""
    out: dict[str, dict[str, list[float]]] = {}
    with gguf.read(SHIPPED_MODEL) as f:
        for name, t in f.tensors.items():
            if len(t.shape) == 2 and name.startswith("blk."):
                kind = quantize.tensor_kind(name)
                for fmt in ("Q4_K", "Q4_0"):
                    out.setdefault(kind, {}).setdefault(fmt, []).append(quantize.relative_error(f.array(name), fmt))
    return {k: {fmt: float(np.mean(v)) for fmt, v in d.items()} for k, d in out.items()}


def check_c19(live: bool) -> Verdict:
    """The block layout, counted; and Q4_K's error against Q4_0's at the same bits, per kind of matrix."""
    values, nbytes = ggml.BLOCK[ggml.GGMLType.Q4_K]
    ATTENTION, MLP = quantize.MATRIX_GROUPS["attention projections"], quantize.MATRIX_GROUPS["MLP"]
    err = kquant_errors()
    gain = {k: 100 * (1 - e["Q4_K"] / e["Q4_0"]) for k, e in err.items()}
    attn, mlp = np.mean([gain[k] for k in ATTENTION]), np.mean([gain[k] for k in MLP])
    ev = {"weights per Q4_K super-block": Number(values, "weights"),
          "bytes per super-block (2 fp16 + 12 packed + 128 codes)": Number(nbytes, "B"),
          "bits per weight": Number(8 * nbytes / values, "bits"),
          "6-bit fields per super-block (8 scales + 8 minimums)": Number(16, "fields"),
          "Q4_K error cut vs Q4_0 (same 4.5 bits), attention projections": Number(attn, "%"),
          "Q4_K error cut vs Q4_0 (same 4.5 bits), MLP matrices": Number(mlp, "%")}
    ev |= {f"relative RMS error, Q4_K, {k}": Number(100 * err[k]["Q4_K"], "%") for k in ATTENTION + MLP}
    summary = (f"The layout is as stated but incomplete: a super-block holds {values} weights in {nbytes} bytes "
               f"({8 * nbytes / values:g} bits per weight) with two fp16 numbers (the scale d and a minimum dmin) "
               "and eight 6-bit scales plus eight 6-bit minimums; on the shipped model Q4_K has "
               f"{attn:.0f}% less rounding error than Q4_0 at the same size in the attention projections and "
               f"{mlp:.0f}% less in the MLP matrices, so it reduces noise everywhere, not in attention "
               "projections in particular")
    status = "qualified" if attn > 0 else "refuted"
    return Verdict(status, summary + ".", ev,
                   "reduced noise against a one-scale 4-bit format (Q4_0) at equal bits, in every kind of matrix; "
                   "llama.cpp's Q4_K_M gives extra bits to attn_v and ffn_down, not to attention as a whole",
                   "ggml-common.h block_q4_K; the shipped model's weights (blocks across rows); no timing")


C19 = claim("C19", "kquants", check_c19,
            short="Q4_K: 256 weights, one FP16 super-block scale, eight 6-bit sub-block scales, less noise in "
                  "attention projections",
            quote="Super-block K-quants (Q4_K) group 256 weights into chunks with a shared FP16 super-block scale "
                  "and eight 6-bit sub-block scales, reducing quantization noise in attention projection layers.")


def check_c11(live: bool) -> Verdict:
    """Q4_K_M's perplexity and bytes against F16: our measurements in results/, and llama.cpp's own table."""
    gib16 = quantize.LLAMA3_8B_WEIGHTS * 2 / 2**30
    gib, dppl = quantize.LLAMA_CPP_PUBLISHED["Q4_K_M"]
    ev = {"Llama-3-8B Q4_K_M size / F16 size (llama.cpp's table)": Number(100 * gib / gib16, "%"),
          "Llama-3-8B Q4_K_M perplexity increase (llama.cpp's table)": Number(dppl, "ppl")}
    summary = (f"llama.cpp publishes +{dppl} perplexity for Llama-3-8B at Q4_K_M, in {100 * gib / gib16:.0f}% "
               "of the F16 bytes")
    source = "llama.cpp tools/quantize/quantize.cpp (published table)"
    quant = {(m["label"], r["weights"], r["metric"], r.get("variant")): r["value"]
             for _, m, r in results("quant")
             if r["peer"] is None and r["model"] == SHIPPED_MODEL.stem}
    ppl = {(label, w): v for (label, w, metric, _), v in quant.items() if metric == "heldout_perplexity"}
    label = next((lab for lab, w in ppl if w == "Q4_K_M" and (lab, "F16") in ppl), None)
    if label:
        p16, p4 = ppl[label, "F16"], ppl[label, "Q4_K_M"]
        size = quant[label, "Q4_K_M", "tensor_bytes", None] / quant[label, "F16", "tensor_bytes", None]
        ev |= {"stdlib-10m Q4_K_M perplexity increase (measured)": Number(100 * (p4 / p16 - 1), "%"),
               "stdlib-10m Q4_K_M bytes / F16 bytes (measured)": Number(100 * size, "%")}
        summary += (f"; measured here, the shipped model's Q4_K_M (mostly Q5_0 and Q8_0, since its 384-wide rows "
                    f"hold no 256-value super-block) costs {100 * (p4 / p16 - 1):+.2f}% perplexity in "
                    f"{100 * size:.0f}% of the F16 bytes")
        source = f"results/ (machine {label}); {source}"
    shape = {(m["label"], r["weights"], r["metric"]): r["value"]
             for _, m, r in results("decode-shape")}
    gpu = next((lab for lab, w, _ in shape if w == "Q4_K_M" and (lab, "F16", "tokens_per_s") in shape), None)
    if gpu:
        t16, t4 = shape[gpu, "F16", "tokens_per_s"], shape[gpu, "Q4_K_M", "tokens_per_s"]
        ev |= {"Llama-3.1-8B-shaped decode, Q4_K_M / F16 speed (MLX, measured)": Number(t4 / t16, "×"),
               "share of measured bandwidth reached, Q4_K_M (MLX)": Number(100 * shape[gpu, "Q4_K_M", "bandwidth_fraction"], "%"),
               "share of measured bandwidth reached, F16 (MLX)": Number(100 * shape[gpu, "F16", "bandwidth_fraction"], "%")}
        summary += (f"; but the saved bandwidth becomes speed only with a kernel that streams the packed weights "
                    f"as fast as floats: on {gpu}, MLX's quantized GEMV decodes an 8B-shaped Q4_K_M model "
                    f"{t4 / t16:.2f}× as fast as F16")
        source += f"; results/ (machine {gpu})"
    return Verdict("qualified", summary + ".", ev,
                   "perplexity: comparable (well under 1% here, +0.18 on Llama-3-8B); bandwidth: a fraction of the "
                   "bytes is read, a matching speed-up needs a bandwidth-bound quantized kernel", source)


C11 = claim("C11", "kquants", check_c11,
            short="Q4_K_M super-blocks of 256 weights with sub-block scales and offsets keep perplexity comparable "
                  "to FP16 at a fraction of the bandwidth",
            quote="K-quants (Q4_K_M) partition weights into super-blocks of 256 weights containing sub-blocks with "
                  "independent scales and offsets, preserving perplexity comparable to unquantized FP16 at a "
                  "fraction of memory bandwidth.")


CLAIMS = (C11, C19)   # in id order; __init__ assembles the registry
