"""The bench command's suites: one table from each `python -m ref_impl bench` flag to the function that
measures it and the lines that summarize its records.

A suite's `run` takes the command's parsed arguments, a scratch directory for the GGUF files it writes,
and a progress callback; it returns records (`records.record`), which the command writes to results/.
Flags are checked in the table's order; no suite flag runs `decode` (`decode.bench_decode`).

See chapter: capstone
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from ref_impl.engine.random import args_for
from ref_impl.measure import (capstone, cupti, gemvdecode, kv, latency, layerlaunch, link, loads, longrun, ncu,
                              oracle, pipeline, spec, unified, window)
from ref_impl.measure.decode import bench_decode, bench_shape, roofs
from ref_impl.measure.kernels import bench_kernels
from ref_impl.measure.moe import MoEPlan, bench_moe, show_moe
from ref_impl.measure.quant import bench_quant, bench_quant_groups

Say = Callable[[str], None]


@dataclass(frozen=True)
class Suite:
    """One bench suite: its measurement, and which of its records the command prints."""
    run: Callable[[argparse.Namespace, Path, Say], list[dict]]
    show: Callable[[list[dict]], list[str]]


def _on_gpu() -> bool:
    return mx.default_device() == mx.gpu


def _heads(a: argparse.Namespace) -> Path | None:
    """The MTP heads: --mtp-heads, else MODEL-mtp.gguf beside --model if it is there, else none."""
    heads = Path(a.mtp_heads or Path(a.model).with_name(Path(a.model).stem + "-mtp.gguf"))
    return heads if a.mtp_heads or heads.is_file() else None


def run_spec(a: argparse.Namespace, work: Path, say: Say) -> list[dict]:
    return spec.bench_spec(Path(a.model), Path(a.draft), _heads(a), spec.SpecPlan.for_device(_on_gpu(), a.quick),
                           progress=say)


def run_capstone(a: argparse.Namespace, work: Path, say: Say) -> list[dict]:
    """bench --capstone: the shipped model with --draft and its MTP heads (as --spec finds them), or --shape."""
    if a.long_only and a.ppl_only:
        raise ValueError("bench --capstone: --long-only and --ppl-only each ask for one part alone; give one")
    if a.ppl_tokens is not None and a.ppl_tokens < 0:
        raise ValueError(f"--ppl-tokens {a.ppl_tokens}: give a number of tokens, or 0 to skip the perplexity")
    if a.ppl_only and (a.shape or a.ppl_tokens == 0):
        raise ValueError("bench --capstone --ppl-only scores held-out text: not with a --shape (random weights, no "
                         "text) or --ppl-tokens 0 (no perplexity)")
    heads = None if a.shape or a.ppl_only else _heads(a)
    parts = ({"long"} if a.long_only else {"ppl"} if a.ppl_only
             else capstone.PARTS - ({"ppl"} if a.ppl_tokens == 0 else set()))
    plan = capstone.CapstonePlan.for_device(_on_gpu(), a.quick, a.prompt_len, a.gen_tokens, a.long_context,
                                             frozenset(parts), a.ppl_tokens or 0)
    draft = None if a.shape or a.ppl_only else Path(a.draft)
    return capstone.bench_capstone(Path(a.model), draft, heads, work, plan, a.shape,
                                   peers=not a.no_peers, llama_bench=Path(a.llama_bench) if a.llama_bench else None,
                                   progress=say)


def run_quant_groups(a: argparse.Namespace, work: Path, say: Say) -> list[dict]:
    if a.ppl_tokens is not None and a.ppl_tokens <= 0:
        raise ValueError("bench --quant-groups measures perplexity: --ppl-tokens must be positive (or left out: "
                         "every held-out token)")
    return bench_quant_groups(Path(a.model), "Q4_K", a.ppl_tokens)


def run_kernels(a: argparse.Namespace, work: Path, say: Say) -> list[dict]:
    shape = a.shape or "Llama-3.1-8B"
    return bench_kernels(shape, args_for(shape), a.weights, work, a.prompt_len, a.gen_tokens, a.repeats,
                         llama_bench_binary=Path(a.llama_bench) if a.llama_bench else None, quick=a.quick,
                         progress=say)


def run_pipeline(a: argparse.Namespace, work: Path, say: Say) -> list[dict]:
    """bench --pipeline: --model and random weights of --shapes (default Llama-3.2-1B) at --pipeline-stages."""
    if a.quick:
        return pipeline.bench_pipeline(pipeline.PipelinePlan.quick(a.model), progress=say)
    plan = pipeline.PipelinePlan(models=(a.model, *(a.shapes or ("Llama-3.2-1B",))), stages=tuple(a.pipeline_stages))
    return pipeline.bench_pipeline(plan, progress=say)


def run_oracle(a: argparse.Namespace, work: Path, say: Say) -> list[dict]:
    """bench --oracle: the pages' comparisons with llama.cpp, on --model (the shipped float model) and the Qwen2-style
    random file; refused without llama.cpp's Python bindings."""
    return oracle.bench_oracle(Path(a.model), work, progress=say)


# ---- what each suite prints ----------------------------------------------------------------------------

def value_text(r: dict) -> str:
    return "-" if r["value"] is None else f"{r['value']:.3f}"


def show_summary(records: list[dict]) -> list[str]:
    """Speed, perplexity, size and bandwidth records, one line each: engine (or peer), metric, value."""
    out = []
    for r in records:
        if r["metric"] in ("tokens_per_s", "ttft_ms", "heldout_perplexity", "bits_per_weight", "bandwidth",
                           "bandwidth_fraction", "peak_flops"):
            who = r["peer"] or "ours" + (f" ({r['variant']})" if r.get("variant") else "")
            out.append(f"  {r['weights'] or '':<7} {who:<44} {r['metric']:<18} {r['value']:10.3f} {r['unit']}")
    return out


def show_link(records: list[dict]) -> list[str]:
    largest = max((r.get("bytes") or 0) for r in records)
    return show_summary(records) + [
        f"  {r['variant']:<40} {r['metric']:<16} {r['value']:10.3f} {r['unit']} {r.get('note', '')}"
        for r in records if (r["metric"] == "copy_bandwidth" and r["bytes"] == largest)
        or r["metric"] in ("completion_ms", "transfer_us", "skipped")]


def show_unified(records: list[dict]) -> list[str]:
    largest = max((r.get("bytes") or 0) for r in records)
    return show_summary(records) + [
        f"  {r['variant']:<44} {r['metric']:<17} {value_text(r):>10} {r['unit']} {r.get('note', '')}"
        for r in records if r["metric"] in ("shares_memory", "writes_seen", "skipped") or (
            r.get("bytes") == largest and r["metric"] in ("convert_us", "convert_bandwidth", "read_bandwidth",
                                                          "export_us"))]


def show_kernels(records: list[dict]) -> list[str]:
    out = []
    for r in records:
        if r["metric"] in ("speedup", "tokens_per_s", "kernels_per_token", "overhead_us_per_kernel",
                           "greedy_agreement", "skipped", "peer_error"):
            where = f"{tuple(r['shape'])} rows {r['rows']}" if "shape" in r else r["experiment"]
            out.append(f"  {r['weights'] or '':<7} {where:<26} {r['variant'] or '':<36} {r['metric']:<22} "
                       f"{value_text(r):>10} {r['unit'] or ''} {r.get('note', '')}")
    return out


def show_gpu_probe(records: list[dict]) -> list[str]:
    """The GPU probes' headline records (kernel-profile, layer-launch, gemv-decode, ncu): one line each."""
    shown = ("tokens_per_s", "busy_ms_per_token", "logits_error", "max_error", "bandwidth", "launch_us",
             "stall_share", "skipped")
    out = []
    for r in records:
        if r["metric"] in shown and r["experiment"] != "roofs":
            what = r.get("setting") or r["variant"] or ""
            where = r.get("kernel") or (f"{tuple(r['shape'])}" if r.get("shape") else "")
            out.append(f"  {r['experiment']:<14} {r['weights'] or '':<6} {what[:40]:<40} {where:<14} {r['metric']:<17} "
                       f"{value_text(r):>10} {r['unit'] or ''} {r.get('note', '')[:200]}")
    return show_summary(records) + out


def show_spec(records: list[dict]) -> list[str]:
    out = []
    for r in records:
        pooled_alpha = r["metric"] == "alpha" and r["experiment"] == "spec-alpha" and r["gamma"] is None
        if r["metric"] == "speedup" or pooled_alpha:
            drafter = r["drafter"] + (f" alpha={r['alpha_set']}" if r.get("alpha_set") is not None else "")
            where = f"gamma={r['gamma']}" if r["gamma"] is not None else f"T={r['temperature']}"
            out.append(f"  {r['experiment']:<11} {r['model']:<13} {drafter:<28} {where:<9} {r['metric']:<8} "
                       f"{r['value']:8.3f}")
    return out


def show_kv(records: list[dict]) -> list[str]:
    return [f"  {r['experiment']:<9} {r['model']:<13} {r['kv']:<12} {r['variant'] or '':<11} "
            f"{r['context'] or '':>6} {r['metric']:<17} {value_text(r):>10} {r['unit'] or ''} {r.get('note', '')}"
            for r in records if r["metric"] in ("ppl_delta", "retrieval_rate", "bytes_per_token", "vs_float",
                                                "crossover_context", "skipped")]


def show_dispatch(records: list[dict]) -> list[str]:
    return [f"  {r['experiment']:<19} {r['model'] or '':<13} {r['variant'] or '':<16} {r['metric']:<20} "
            f"{value_text(r):>10} {r['unit']}"
            for r in records if r["metric"] in ("gain", "slowdown", "launch_us", "break_even_elements", "itl_max_ms",
                                                "first_over_steady")]


def show_pipeline(records: list[dict]) -> list[str]:
    return [f"  {r['model']:<13} {r['variant']:<9} {r['metric']:<26} {value_text(r):>10} {r['unit'] or ''} "
            f"{r.get('note') or ''}"
            for r in records if r["metric"] in ("tokens_per_s", "interval_ms", "compute_ms", "link_ms", "other_ms",
                                                "link_bytes_per_token", "link_bytes_per_token_sent",
                                                "link_bytes_per_token_tcp", "greedy_agreement", "skipped")]


def show_capstone(records: list[dict]) -> list[str]:
    return [f"  {r['experiment']:<13} {r['variant'] or '':<40} {r['weights'] or '':<7} {r['kv'] or '':<12} "
            f"{r['metric']:<17} {value_text(r):>10} {r['unit'] or ''} {r.get('note', '')}"
            for r in records if r["metric"] in ("tokens_per_s", "greedy_agreement", "alpha", "heldout_perplexity",
                                                "peak_memory", "peer_error")]


def show_oracle(records: list[dict]) -> list[str]:
    return [f"  {r['model']:<36} {r['variant']:<9} {r['metric']:<21} {value_text(r):>10} {r['unit'] or ''} "
            f"{r.get('fallback') or (repr(r['text'])[:30] if r.get('text') else '')}" for r in records]


def show_window(records: list[dict]) -> list[str]:
    return [f"  {r['experiment']:<16} {r['model']:<12} {r['context']:>7} {r['variant']:<14} {r['metric']:<17} "
            f"{value_text(r):>16} {r['unit']}" for r in records]


def show_long(records: list[dict]) -> list[str]:
    return [f"  {r['experiment']:<18} {r['model']:<32} {r['context'] or '':>6} {r['variant'] or '':<10} "
            f"{(r['peer'] or 'ours')[:36]:<36} {r['metric']:<21} {value_text(r):>14} {r['unit'] or ''} "
            f"{r.get('note') or ''}" for r in records]


# flag (an attribute of the parsed arguments) -> suite, in the order the flags are checked
SUITES: dict[str, Suite] = {
    "capstone": Suite(run_capstone, show_capstone),
    "dispatch": Suite(lambda a, work, say: latency.bench_dispatch(
        Path(a.model), a.shapes, latency.DispatchPlan.for_device(_on_gpu(), a.quick), progress=say), show_dispatch),
    "spec": Suite(run_spec, show_spec),
    "kv": Suite(lambda a, work, say: kv.bench_kv(Path(a.model), kv.KVPlan.for_device(_on_gpu(), a.quick), a.shapes,
                                                 progress=say), show_kv),
    "link": Suite(lambda a, work, say: link.measure_link(a.link_budget, a.link_max_bytes), show_link),
    "pipeline": Suite(run_pipeline, show_pipeline),
    "unified": Suite(lambda a, work, say: unified.measure_unified(a.unified_max_bytes), show_unified),
    "alignment": Suite(lambda a, work, say: loads.bench_alignment(a.alignment_budget), show_summary),
    "quant_groups": Suite(run_quant_groups, show_summary),
    "oracle": Suite(run_oracle, show_oracle),
    "long": Suite(lambda a, work, say: longrun.bench_long(Path(a.model), work, longrun.LongPlan.quick() if a.quick
                                                          else longrun.LongPlan(), not a.no_peers, say), show_long),
    "window": Suite(lambda a, work, say: window.bench_window(work, window.WindowPlan.quick() if a.quick
                                                             else window.WindowPlan(), say), show_window),
    "moe": Suite(lambda a, work, say: bench_moe(work, MoEPlan.for_device(_on_gpu(), a.quick), not a.no_peers, say),
                 show_moe),
    "quant": Suite(lambda a, work, say: bench_quant(Path(a.model), work, a.quant, a.ppl_tokens, a.prompt_len,
                                                    a.gen_tokens, a.repeats, peers=not a.no_peers), show_summary),
    "kernels": Suite(run_kernels, show_kernels),
    "kernel_profile": Suite(lambda a, work, say: cupti.bench_kernel_profile(a.shape or "Llama-3.1-8B",
                                                                         weights=layerlaunch.mixes(a.weights),
                                                                         progress=say),
                            show_gpu_probe),
    "layer_launches": Suite(lambda a, work, say: layerlaunch.bench_layer_launches(a.shape or "Llama-3.1-8B",
                                                                                  weights=layerlaunch.mixes(a.weights),
                                                                                  progress=say), show_gpu_probe),
    "gemv_decode": Suite(lambda a, work, say: gemvdecode.bench_gemv_decode(roof_bytes=a.roof_bytes, progress=say),
                         show_gpu_probe),
    "ncu": Suite(lambda a, work, say: ncu.bench_ncu(work, layerlaunch.mixes(a.weights), progress=say), show_gpu_probe),
    "shape": Suite(lambda a, work, say: bench_shape(a.shape, args_for(a.shape), a.weights, work, a.prompt_len,
                                                    a.gen_tokens, a.repeats, roof_bytes=a.roof_bytes), show_summary),
    "roofs": Suite(lambda a, work, say: roofs(a.roof_bytes), show_summary),
    "decode": Suite(lambda a, work, say: bench_decode(Path(a.model), a.prompt_len, a.gen_tokens, a.repeats,
                                                      peers=not a.no_peers, roof_bytes=a.roof_bytes), show_summary),
}


def chosen(a: argparse.Namespace) -> str:
    """The suite the arguments ask for: the first flag of SUITES that is set, else "decode"."""
    return next((name for name in SUITES if name != "decode" and getattr(a, name)), "decode")
