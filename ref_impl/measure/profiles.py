"""Readers of the GPU profilers' logs in results/: CUPTI's kernel times and Nsight Compute's reports.

The fused-layer probes (results/h200-*-fused_profile.py, -fused_loops.py, -ncu_*.py) ran on the reference
H200 and printed text, not results records: kernel times from the GPU's own clock (CUPTI, through
torch.profiler) and Nsight Compute's counters and stall samples. These functions turn that text into
numbers, so that every chapter citing one of these logs reads it the same way.
See chapter: dispatch-kernel
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ref_impl import RESULTS_DIR


@dataclass(frozen=True)
class Token:
    """One decode setting's token on the GPU's clock: wall and GPU-busy milliseconds a token, each kernel's
    time in ms a token (`ms`) and in µs a call (`us`), and the logits' error against the unfused layers
    (max |difference| / max |unfused|) where the probe checked it."""
    wall_ms: float
    busy_ms: float
    ms: dict[str, float]
    us: dict[str, float]
    error: float | None = None


def newest(pattern: str, results_dir: Path = RESULTS_DIR) -> Path:
    """The newest results file matching a glob pattern (names start with the run's date and time)."""
    found = sorted(results_dir.glob(pattern))
    if not found:
        raise FileNotFoundError(f"no results file matches {pattern} in {results_dir}")
    return found[-1]


def cupti_tokens(path: Path) -> dict[tuple[str, str], Token]:
    """(model, setting) -> Token from a profile log (-fused_profile.log: a kernel a line, 'name  n/token x
    us = ms'), in the order the log gives them; a setting the log repeats keeps its first run."""
    out: dict[tuple[str, str], Token] = {}
    pattern = (r"^(\S+) (unfused \(MLX built-ins\)|fused .*?): [\d.]+ tok/s, wall ([\d.]+) ms/token, "
               r"GPU busy ([\d.]+) ms/token.*\n((?:    .*\n)*)")
    for model, setting, wall, busy, body in re.findall(pattern, path.read_text(), re.M):
        rows = re.findall(r"^    (.+?)\s+([\d.]+)/token x\s+([\d.]+) us = ([\d.]+) ms$", body, re.M)
        out.setdefault((model, setting), Token(float(wall), float(busy), {k: float(ms) for k, _, _, ms in rows},
                                               {k: float(us) for k, _, us, _ in rows}))
    return out


def loop_tokens(path: Path) -> dict[tuple[str, int, int, str], Token]:
    """(model, loops, prefetch, unroll) -> Token from the resident-loop probe (-fused_loops.log), which gives
    µs a call ('us/call:' lines), not ms a token: `ms` stays empty."""
    pattern = (r"^(\S+) L (\d+) P (\d+) U (\{.*?\}): [\d.]+ tok/s, wall ([\d.]+), GPU busy ([\d.]+) ms/token, "
               r"logits err (\S+) .*\n    us/call: (.*)$")
    out = {}
    for model, loops, pf, unroll, wall, busy, err, calls in re.findall(pattern, path.read_text(), re.M):
        us = {k: float(v) for k, v in re.findall(r"(\w+)\s+([\d.]+)", calls)}
        out.setdefault((model, int(loops), int(pf), unroll), Token(float(wall), float(busy), {}, us, float(err)))
    return out


def kernel_us(path: Path, name_start: str) -> float:
    """µs a call of the first kernel in a profile log whose name starts with `name_start` (e.g. MLX's
    'void mlx::core::cu::gemv_single<__half'), as the log prints it."""
    for token in cupti_tokens(path).values():
        for name, us in token.us.items():
            if name.startswith(name_start):
                return us
    raise ValueError(f"{path.name}: no kernel named {name_start}...")


def ncu_kernels(path: Path) -> list[tuple[str, dict[str, float]]]:
    """(kernel, {"metric (unit)": value}) per kernel launch of an Nsight Compute details report, in launch
    order ("Duration (us)", "DRAM Throughput (%)", ...; a metric without a unit, its name alone). A kernel is
    named as the fused layer names it (attn_in, ...), or by its first 40 characters."""
    out = []
    for block in re.split(r"^  (?=\S)", path.read_text(), flags=re.M)[1:]:
        head = block.split("(", 1)[0]
        m = re.search(r"ref_layer_([a-z]+_[a-z]+|attend)_", head)
        metrics = {f"{name.strip()} ({unit})" if unit else name.strip(): float(value.replace(",", ""))
                   for name, unit, value in
                   re.findall(r"^    ([A-Z][\w ./()%-]*?)\s{2,}([\w/%.]*)\s+([\d,]+\.?\d*)\s*$", block, re.M)}
        if metrics:
            out.append((m.group(1) if m else head[:40], metrics))
    return out


def ncu_stalls(path: Path) -> dict[str, list[tuple[float, int, str]]]:
    """kernel -> (share of the warp stall samples in %, times executed, SASS) of its most sampled
    instructions, from a -ncu_stalls.log."""
    out: dict[str, list[tuple[float, int, str]]] = {}
    kernel = None
    for line in path.read_text().splitlines():
        if m := re.match(r"^(\w+): \d+ SASS instructions", line):
            kernel = m.group(1)
            out[kernel] = []
        elif (m := re.match(r"^\s+#\d+\s+([\d.]+)% of samples, executed\s+(\d+) times: (.*)$", line)) and kernel:
            out[kernel].append((float(m.group(1)), int(m.group(2)), m.group(3)))
    return out
