"""Pipeline-parallel decoding, measured: each token's time split into compute and link, bytes on the link.

`python -m ref_impl bench --pipeline` (experiment "pipeline") decodes with engine/pipeline.py on this host,
the layers split over 1, 2 and 4 processes that talk over loopback TCP through MLX's ring backend, for
the shipped model and random weights of a public shape, from one seeded random prompt. Every stage stamps
each step (wall clock: one clock for every process of the host), so a decoded token's time splits
exactly (`token_split`):

    interval = sum over stages of compute + sum over hops of link + other

compute: a stage's layers (and the first stage's embedding, the last stage's head and sampler), from its
input in hand to its output evaluated; link: from one stage's output evaluated to the next stage's input
in hand, the sends and receives included (the last hop carries the token back); other: the first stage's
host work between a token's arrival and the next step (compose.follow's text loop, the event it prints).
Bytes per token are counted three ways: the protocol's formula (interconnect.pipeline_link_bytes), the
bytes the stages handed to mx.distributed.send, and the payload bytes the kernel's TCP counters saw
arrive (platform/tcp.py, Linux).

On one host the stages share its cores. They take turns (one sequence), so each gets every core's
OpenBLAS thread, a waiting stage sleeps in select(2) until its input arrives (MLX's ring would poll its
sockets at a full core, mlx/distributed/ring/ring.cpp) and its idle BLAS threads sleep at once
(engine/pipeline.py, blas_env). With more stages than cores the records say so (note); each stage's CPU
use per second of decoding is recorded (cpu_share), and the OpenBLAS settings (blas).

See chapter: pipeline
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ref_impl import MODELS_DIR, RESULTS_DIR
from ref_impl.engine.checkpoint import weight_types
from ref_impl.engine.pipeline import PipelineConfig, PipelineRun, blas_env, generate, is_shape, model_args_of
from ref_impl.measure.records import Run, record, reference
from ref_impl.platform.timing import median

Say = Callable[[str], None]
REFERENCE_CPU = "cpu-2core"     # the machine whose pipeline run the chapter reads


@dataclass(frozen=True)
class PipelinePlan:
    """What `bench --pipeline` runs: models (GGUF files or shape names), stage counts, sizes, the seed."""
    models: tuple[str, ...] = (str(MODELS_DIR / "stdlib-10m.gguf"), "Llama-3.2-1B")
    stages: tuple[int, ...] = (1, 2, 4)
    prompt_len: int = 32
    gen_tokens: int = 32            # tokens per run of a file model
    shape_tokens: int = 12          # tokens per run of a random-weight shape (a CPU decodes 1B in ~1 s a token)
    warmup_steps: int = 2           # decode steps left out of the statistics (first calls at each shape)
    seed: int = 0

    @classmethod
    def quick(cls, model: str) -> PipelinePlan:
        """Seconds: the file model alone, 1 and 2 stages, a few tokens."""
        return cls(models=(model,), stages=(1, 2), prompt_len=8, gen_tokens=8, warmup_steps=1)


def token_split(run: PipelineRun, skip: int = 0) -> dict[str, np.ndarray]:
    """Per decode step (the steps after the prefill, the first `skip` of them left out), in seconds:
    "interval" between tokens at the first stage, "compute" (stages summed) and "link" (hops summed) and
    "other" (interval - compute - link); "compute k" per stage and "hop a->b" per hop."""
    n = run.config.stages
    tr = [run.traces[r]["trace"] for r in range(n)]
    steps = min(len(t) for t in tr)
    ks = np.arange(1 + skip, steps)
    at = {(r, key): np.array([tr[r][k][key] for k in range(steps)]) for r in range(n) for key in tr[r][0]}
    out = {f"compute {r}": (at[r, "t_done"] - at[r, "t_in"])[ks] for r in range(n)}
    for r in range(n - 1):
        out[f"hop {r}->{r + 1}"] = (at[r + 1, "t_in"] - at[r, "t_done"])[ks]
    if n > 1:
        out[f"hop {n - 1}->0"] = (at[0, "t_back"] - at[n - 1, "t_done"])[ks]
    out["compute"] = sum(out[f"compute {r}"] for r in range(n))
    out["link"] = sum((v for k, v in out.items() if k.startswith("hop")), np.zeros(len(ks)))
    out["interval"] = (at[0, "t_back"][1:] - at[0, "t_back"][:-1])[ks - 1]
    out["other"] = out["interval"] - out["compute"] - out["link"]
    return out


def bytes_per_step(run: PipelineRun, key: str, skip: int = 0) -> np.ndarray | None:
    """Per decode step, bytes summed over the stages of one trace counter: "sent" (handed to
    mx.distributed.send) or "rx" (the kernel's count of payload received); None where not counted."""
    tr = [run.traces[r]["trace"] for r in range(run.config.stages)]
    if any(s[key] is None for t in tr for s in t):
        return None
    totals = np.sum([[s[key] for s in t[:min(map(len, tr))]] for t in tr], axis=0)
    return np.diff(totals)[skip:]


def timeline(run: PipelineRun, step: int) -> list[dict]:
    """One step's phases per stage, in ms from the first stage's start of it: compute, send, and the wait
    (a later stage's for its input; the first stage's for the token to come back)."""
    t0 = run.traces[0]["trace"][step]["t_in"]
    out = []
    for r in range(run.config.stages):
        s = run.traces[r]["trace"][step]
        waits = [("wait", s["t_sent"], s["t_back"])] if r == 0 else [("wait", s["t_wait"], s["t_in"])]
        for phase, a, b in [*waits, ("compute", s["t_in"], s["t_done"]), ("send", s["t_done"], s["t_sent"])]:
            out.append({"stage": r, "phase": phase, "start_ms": 1e3 * (a - t0), "end_ms": 1e3 * (b - t0)})
    return out


def run_records(run: PipelineRun, name: str, weights: str, baseline: list[int] | None, skip: int) -> list[dict]:
    """The records of one run (see the module docstring): time split, per stage and hop, bytes, agreement,
    each stage's CPU share, and the timeline of the step with the median interval."""
    n, cores = run.config.stages, os.cpu_count() or 1
    split = token_split(run, skip)
    tr0 = run.traces[0]
    common = dict(model=name, weights=weights, kv=f"f{8 * tr0['act_bytes']}", context=len(run.prompt_tokens),
                  variant=f"{n} stage{'s' * (n > 1)}", stages=n, cores=cores, blas=blas_env(),
                  hidden=tr0["hidden"], act_bytes=tr0["act_bytes"], seed=run.config.seed,
                  gen_tokens=len(run.tokens), note=(f"{n} processes on {cores} cores: more stages than cores; they "
                                                    "take turns, a waiting stage asleep in select(2)" if n > cores
                                                    else None))
    ms = {k: v * 1e3 for k, v in split.items()}
    out = [record("pipeline", "tokens_per_s", "tok/s", len(split["interval"]) / split["interval"].sum(), **common),
           *(record("pipeline", f"{k}_ms", "ms", median(ms[k]), samples=ms[k], **common)
             for k in ("interval", "compute", "link", "other"))]
    out += [record("pipeline", "stage_compute_ms", "ms", median(ms[f"compute {r}"]), samples=ms[f"compute {r}"],
                   stage=r, layers=[run.spans[r].start, run.spans[r].stop], **common) for r in range(n)]
    out += [record("pipeline", "hop_us", "us", median(v * 1e6), samples=v * 1e6, hop=k[4:], **common)
            for k, v in split.items() if k.startswith("hop ")]
    out.append(record("pipeline", "link_bytes_per_token", "bytes", run.link_bytes_per_token(), **common))
    for key, metric in (("sent", "link_bytes_per_token_sent"), ("rx", "link_bytes_per_token_tcp")):
        b = bytes_per_step(run, key, skip) if n > 1 else np.zeros(len(split["interval"]))   # one stage: no link
        out.append(record("pipeline", metric, "bytes", median(b), samples=b, **common) if b is not None else
                   record("pipeline", "skipped", "count", 0, **common | {"note": f"{metric}: no TCP counters here"}))
    for r in range(n):
        t = run.traces[r]["trace"]
        cpu, wall_s = t[-1]["cpu"] - t[1 + skip]["cpu"], t[-1]["t_sent"] - t[1 + skip]["t_sent"]
        out.append(record("pipeline", "cpu_share", "cores", cpu / wall_s, stage=r, **common))
    if baseline is not None:
        out.append(record("pipeline", "greedy_agreement", "fraction", float(run.tokens == baseline), **common))
    step = 1 + skip + int(np.argsort(split["interval"])[len(split["interval"]) // 2])
    out += [record("pipeline", "timeline_ms", "ms", p["end_ms"] - p["start_ms"], step=step, **p, **common)
            for p in timeline(run, step)]
    return out


def bench_pipeline(plan: PipelinePlan = PipelinePlan(), progress: Say = print) -> list[dict]:
    """Every (model, stage count) of the plan as records (`run_records`), greedy, EOS off, from one seeded
    random prompt per model (its ids said through progress)."""
    out = []
    for model in plan.models:
        args = model_args_of(model)
        prompt = tuple(int(t) for t in np.random.default_rng(plan.seed).integers(1, args.vocab_size, plan.prompt_len))
        name, tokens = (model, plan.shape_tokens) if is_shape(model) else (Path(model).stem, plan.gen_tokens)
        weights = "F32" if is_shape(model) else weight_types(model)      # random weights: float32, no file
        progress(f"pipeline {name}: seed {plan.seed}, prompt ids {list(prompt)}, {tokens} tokens")
        baseline = None
        for n in plan.stages:
            if n > args.num_hidden_layers:
                continue
            cfg = PipelineConfig(model, n, prompt, tokens, seed=plan.seed, stop_at_eos=False, trace=True,
                                 timeout_s=600.0)
            run = generate(cfg)
            baseline = run.tokens if n == 1 else baseline
            out += run_records(run, name, weights, baseline if n > 1 else None, plan.warmup_steps)
            progress(f"  {n} stage(s): {run.summary}")
    return out


def pipeline_recorded(label: str = REFERENCE_CPU, results_dir: Path = RESULTS_DIR) -> Run | None:
    """The run of `bench --pipeline` the chapter reads: machine `label`'s reference run (`records.reference`,
    its pipeline records), or None where that machine has none."""
    return reference("pipeline", label, results_dir)
