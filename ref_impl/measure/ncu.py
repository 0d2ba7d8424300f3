"""Nsight Compute on the fused layer's kernels: their hardware counters and where their warps stall
("ncu-kernel", "ncu-stall").

Nsight Compute (`ncu`, NVIDIA's kernel profiler, in the CUDA toolkit) replays each profiled kernel many
times to read the GPU's counters: it locks the clocks at base and empties the caches before each replay, so
its times are longer than a decode's; the shares it reports are what it is for. `bench_ncu` (`python -m
ref_impl bench --ncu`) runs it as a subprocess on a small decode (`decode_target`: the first layers of a
Llama-3.1-8B-shaped model in `layerlaunch.mix_model`'s weights, fused, a few decode steps after a prompt),
and reads ncu's own CSV export of its report:
- the details page (`--page details --csv`): per kernel launch of a step past the JIT warm-up, every
  metric of the sections in SECTIONS ("ncu-kernel": Duration, DRAM Throughput, Issue Slots Busy ...);
- the source page in SASS with its warp stall sampling (`--set full`, `--page source --print-source sass
  --csv`) of attn_in and mlp_in: the instructions where the most stalled warps were sampled ("ncu-stall"),
  with how often each ran and the nearest global load before it.

References: NVIDIA Nsight Compute CLI documentation (--launch-skip, --launch-count, --section, --page,
--print-source, --csv; the Warp Stall Sampling metrics of the source page).
See chapter: dispatch-kernel
"""

from __future__ import annotations

import csv
import io
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import mlx.core as mx

import ref_impl
from ref_impl.engine.generate import decoder, prefill
from ref_impl.engine.model import TransformerBlock
from ref_impl.engine.random import args_for
from ref_impl.kernels import fusedlayer
from ref_impl.measure.cupti import kernel_name
from ref_impl.measure.layerlaunch import MIXES, mix_model, needs_cuda
from ref_impl.measure.records import record

SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats", "WarpStateStats", "MemoryWorkloadAnalysis",
            "SchedulerStats", "ComputeWorkloadAnalysis")
LAYERS, CONTEXT, STEPS = 4, 256, 4      # the decode ncu profiles: 4 layers, 4 steps after 256 tokens
STALL_KERNELS = ("attn_in", "mlp_in")   # sampled instruction by instruction
TOP = 8                                 # instructions a kernel's stall records keep


def launches_per_layer() -> int:
    """Kernels one fused layer of the profiled shape launches a step (fusedlayer.Launches.order)."""
    block = TransformerBlock(args_for("Llama-3.1-8B"))    # lazy: only its shapes are read
    block.set_dtype(mx.float16)
    return len(fusedlayer.launches(block).order())


def decode_target(weights: str, layers: int = LAYERS, context: int = CONTEXT, steps: int = STEPS) -> None:
    """What ncu profiles: `steps` decode steps of a `layers`-layer Llama-3.1-8B-shaped model in `weights`
    (`layerlaunch.mix_model`), every layer fused, after a `context`-token prompt, each step evaluated alone."""
    model = mix_model(weights, layers=layers)
    left = fusedlayer.fuse(model)
    if left:
        raise RuntimeError(f"ncu's target must run fused: {left}")
    cache = model.make_cache(context + steps + 8)
    y = mx.argmax(prefill(model, mx.zeros((1, context), dtype=mx.int32), cache), axis=-1)
    step = decoder(model, cache)
    for _ in range(steps):
        y = mx.argmax(step(y), axis=-1)
        mx.eval(y)


def ncu_binary() -> str | None:
    """The ncu on PATH, else the CUDA toolkit's, else None."""
    found = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    return found if Path(found).is_file() else None


def run_ncu(args: Sequence[str], timeout_s: float = 600) -> str:
    """ncu's stdout for `args`; RuntimeError with the end of its output when it fails. The profiled Python
    imports this checkout of ref_impl."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(Path(ref_impl.__file__).parents[1]),
                                                                     os.environ.get("PYTHONPATH"))))}
    try:
        out = subprocess.run([ncu_binary() or "ncu", *args], capture_output=True, text=True, timeout=timeout_s,
                             env=env)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"ncu did not run: {e}") from e
    if out.returncode != 0:
        raise RuntimeError(f"ncu failed ({out.returncode}): {(out.stdout + out.stderr)[-2000:]}")
    return out.stdout


def ncu_report(weights: str, report: Path, kernel_regex: str, skip: int, count: int, what: Sequence[str]) -> Path:
    """Profile `count` launches of the kernels matching `kernel_regex` after `skip` of them, in decode_target
    of `weights`, collecting `what` (ncu's --section/--set arguments), into report (.ncu-rep)."""
    target = f"from ref_impl.measure.ncu import decode_target; decode_target({weights!r})"
    run_ncu(["-k", f"regex:{kernel_regex}", "--launch-skip", str(skip), "--launch-count", str(count), *what,
             "-f", "-o", str(report), sys.executable, "-c", target])
    return report.with_suffix(".ncu-rep")


def csv_rows(text: str) -> list[dict[str, str]]:
    """The rows of ncu's CSV on stdout, from its header line (which starts with "ID") on."""
    start = text.find('"ID",')
    return list(csv.DictReader(io.StringIO(text[start:]))) if start >= 0 else []


def number(text: str) -> float | None:
    """A value as ncu prints it ("61,821", "12.51"), or None ("n/a", "no data", "")."""
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def metric_records(text: str, fields: dict) -> list[dict]:
    """ncu-kernel records from the details page as CSV: one per launch and numeric metric, named and in the
    unit ncu gives them, with the kernel (`cupti.kernel_name`), the launch's ID and the section."""
    out = []
    for row in csv_rows(text):
        value = number(row.get("Metric Value", ""))
        if row.get("Metric Name") and value is not None:
            out.append(record("ncu-kernel", row["Metric Name"], row.get("Metric Unit") or None, value, **fields,
                              kernel=kernel_name(row["Kernel Name"]), launch_id=int(row["ID"]),
                              section=row.get("Section Name")))
    return out


def stall_records(text: str, fields: dict, top: int = TOP) -> list[dict]:
    """ncu-stall records from the source page in SASS as CSV (one table per kernel, each under a "Kernel
    Name" line): per kernel its stall samples and instruction count, then its `top` most sampled instructions
    in order: share of the samples (%), times executed, the instruction, and the nearest global load (LDG)
    within the 40 before it."""
    out = []
    for part in text.split('"Kernel Name",')[1:]:
        name, _, table = part.partition("\n")
        rows = list(csv.reader(io.StringIO(table)))
        head = rows[0]
        body = [r for r in rows[1:] if len(r) == len(head)]
        samples, source = head.index("Warp Stall Sampling (All Samples)"), head.index("Source")
        executed = head.index("Instructions Executed")
        counts = [number(r[samples]) or 0.0 for r in body]
        total = sum(counts)
        kernel = {**fields, "kernel": kernel_name(name)}
        out.append(record("ncu-stall", "stall_samples", "samples", total, **kernel, instructions=len(body)))
        for j in sorted(sorted(range(len(body)), key=lambda i: -counts[i])[:top]):
            loads = [i for i in range(max(0, j - 40), j) if body[i][source].split()[:1] and (
                body[i][source].split()[0].startswith("LDG") or " LDG" in body[i][source])]
            before = {"index": loads[-1], "sass": body[loads[-1]][source].strip()} if loads else None
            out.append(record("ncu-stall", "stall_share", "%", 100 * counts[j] / total, **kernel, index=j,
                              executed=int(number(body[j][executed]) or 0), sass=body[j][source].strip(),
                              stall_samples=counts[j], load_before=before))
    return out


def weights_records(weights: str, work: Path, stalls: bool, say: Callable[[str], None]) -> list[dict]:
    """ncu-kernel records of one step's launches past the warm-up (2 steps skipped, the first 2 layers), and
    with `stalls` the ncu-stall records of attn_in and mlp_in in layer 0 of the third step."""
    fields = {"model": "Llama-3.1-8B", "weights": weights, "kv": "f16", "context": CONTEXT, "layers": LAYERS}
    what = [a for s in SECTIONS for a in ("--section", s)]
    per_layer = launches_per_layer()
    report = ncu_report(weights, work / f"ncu-{weights}", "ref_layer", 2 * LAYERS * per_layer, 2 * per_layer, what)
    out = metric_records(run_ncu(["-i", str(report), "--page", "details", "--csv"]), fields)
    say(f"ncu {weights}: {len(out)} metrics of {len({r['launch_id'] for r in out})} launches")
    if stalls:
        report = ncu_report(weights, work / f"ncu-sass-{weights}", f"ref_layer_({'|'.join(STALL_KERNELS)})",
                         2 * LAYERS * len(STALL_KERNELS), len(STALL_KERNELS), ["--set", "full"])
        rec = stall_records(run_ncu(["-i", str(report), "--page", "source", "--print-source", "sass", "--csv"]),
                            fields)
        out += rec
        say(f"ncu {weights} stalls: " + "; ".join(f"{r['kernel']} #{r['index']} {r['value']:.1f}%" for r in rec
                                                  if r["metric"] == "stall_share"))
    return out


def bench_ncu(work_dir: Path, weights: Sequence[str] = MIXES, stall_weights: Sequence[str] = ("q4q8",),
              progress: Callable[[str], None] | None = None) -> list[dict]:
    """Nsight Compute's counters for the fused kernels of a decode step per weights mix, and the stall
    samples of attn_in and mlp_in for `stall_weights`. Off MLX's CUDA backend or without ncu: one "skipped"
    record, at once; a failing ncu (e.g. counters reserved for administrators) one "skipped" record a mix."""
    out = needs_cuda("ncu-kernel", model="Llama-3.1-8B")
    if out:
        return out
    if ncu_binary() is None:
        return [record("ncu-kernel", "skipped", None, None, model="Llama-3.1-8B",
                       note="skipped: needs NVIDIA Nsight Compute (ncu on PATH or in /usr/local/cuda/bin)")]
    work_dir.mkdir(parents=True, exist_ok=True)
    for w in weights:
        try:
            out += weights_records(w, work_dir, w in stall_weights, progress or (lambda msg: None))
        except RuntimeError as e:
            out.append(record("ncu-kernel", "skipped", None, None, model="Llama-3.1-8B", weights=w,
                              note=f"skipped: {e}"))
    return out
