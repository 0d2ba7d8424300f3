"""Chapter dispatch, command buffers (book/dispatch/command-buffers): C01, C21 and C31.

ggml-metal's batching is read from its source; the stalls and launch costs are measured through
MLX (an eval after every layer, sync per token against mx.async_eval, one small op), the portable
analog of Metal, and read from each machine's reference run of the experiments dispatch-layer-eval,
dispatch-async and kernel-latency (`dispatch_runs`, which the caching and jitter pages read too).
C01 and C21 are about a GPU's command queue, so the GPU records decide them; the CPU's are shown
beside them as context (there the "device" is the host's own cores, with no queue of its own).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ref_impl.engine.random import args_for
from ref_impl.ledger import core
from ref_impl.ledger.core import Number, Verdict, claim, decide, figure, repeated
from ref_impl.measure import latency, records
from ref_impl.measure.records import Run
from ref_impl.theory import queue

GGML_METAL_MAX_COMMAND_BUFFERS = 8   # ggml/src/ggml-metal/ggml-metal-context.m: command buffers per graph, at most
GGML_METAL_MAIN_NODES = 64           # the same file: the caller encodes MAX(64, 0.1 * n_nodes) nodes first
_METAL_SOURCE = ("llama.cpp ggml/src/ggml-metal/ggml-metal-context.m (ggml_metal_graph_compute: n_cb command "
                 "buffers, commit, wait in ggml_metal_synchronize); Apple Metal docs (MTLCommandBuffer commit, "
                 "waitUntilCompleted)")
C21_LOSS = 0.25                      # "up to 25% throughput degradation", quoted from the claim
C31_BOUND_US = 1.0                   # "sub-microsecond", quoted from the claim
DISPATCH_BENCH = "python -m ref_impl bench --dispatch"


def dispatch_runs(experiment: str) -> dict[str, Run]:
    """Per machine label, the run the dispatch pages and claims read for one experiment: its reference run
    (`records.references`: the newest complete one), our engine's records only."""
    return records.references(experiment, core.RESULTS_DIR, peer=None)


def dispatch_records(experiment: str) -> dict[tuple[str, str | None, str | None, str], dict]:
    """(machine label, model, variant, metric) -> record of each machine's reference run of one dispatch
    experiment (`dispatch_runs`). Each record gains the machine's backend and its run's caption."""
    return {(label, r["model"], r.get("variant"), r["metric"]): r | {"backend": run.machine["backend"],
                                                                     "caption": run.caption}
            for label, run in dispatch_runs(experiment).items() for r in run.records}


def kernel_latency_recorded(run: Run) -> dict[str, dict[int, float]]:
    """Per variant of one kernel-latency run ("chain=16, compiled"): µs per add by vector size."""
    out: dict[str, dict[int, float]] = {}
    for r in run.select(metric="per_op_us"):
        out.setdefault(r["variant"], {})[r["elements"]] = r["value"]
    return out


def _captions(items) -> str:
    """The caption lines of the runs evidence came from, once each."""
    return "; ".join(sorted({i.caption for i in items}))


def _rounds(r: dict) -> tuple[float, ...]:
    """A record's repeated rounds, or its value alone when it kept none."""
    return tuple(r.get("samples") or (r["value"],))


def _percent_range(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    return f"{100 * lo:.0f}%" if round(100 * lo) == round(100 * hi) else f"{100 * lo:.0f}-{100 * hi:.0f}%"


def _names(items) -> str:
    return ", ".join(sorted(set(items)))


# ---- C01: reading an intermediate output stalls the queue ---------------------------------------------

@dataclass(frozen=True)
class LayerEvalRun:
    """One model's recorded decode on one machine: one graph per token against an eval after every layer."""
    machine: str
    backend: str
    model: str
    graph_tok_s: tuple[float, ...]      # rounds, one graph per token
    layer_tok_s: tuple[float, ...]      # rounds, an mx.eval after every transformer block
    extra_us: float | None = None       # time added per extra sync, as recorded
    caption: str = ""                   # the run it was recorded in (Run.caption)

    @property
    def lost(self) -> float:
        """Throughput lost to the evals: 1 - median(layer) / median(graph)."""
        return 1 - float(np.median(self.layer_tok_s)) / float(np.median(self.graph_tok_s))

    @property
    def stalls(self) -> bool:
        """Slower in its fastest round than one graph per token in its slowest: beyond the rounds' spread."""
        return max(self.layer_tok_s) < min(self.graph_tok_s)


def gather_c01(live: bool) -> tuple[LayerEvalRun, ...] | None:
    """Each machine's reference dispatch-layer-eval run, per model; None without a GPU's."""
    rec = dispatch_records("dispatch-layer-eval")
    runs = []
    for (lab, model, var, metric), r in sorted(rec.items()):
        graph = rec.get((lab, model, "per_token_graph", "tokens_per_s"))
        if var == "layer_eval" and metric == "tokens_per_s" and graph:
            extra = rec.get((lab, model, "layer_eval", "extra_us_per_layer_eval"))
            runs.append(LayerEvalRun(lab, r["backend"], model, _rounds(graph), _rounds(r),
                                     extra["value"] if extra else None, r["caption"]))
    return tuple(runs) if any(r.backend != "cpu" for r in runs) else None


def judge_c01(runs: tuple[LayerEvalRun, ...]) -> Verdict:
    """Confirmed if every GPU model stalls beyond its rounds' spread, refuted if none does, qualified otherwise."""
    gpu = [r for r in runs if r.backend != "cpu"]
    cpu = [r for r in runs if r.backend == "cpu"]
    stalled = [r for r in gpu if r.stalls]
    status = decide(len(stalled) == len(gpu), contradicted=not stalled)
    ev = {"ggml-metal: most command buffers per graph (GGML_METAL_MAX_COMMAND_BUFFERS)":
          Number(GGML_METAL_MAX_COMMAND_BUFFERS, "buffers"),
          "ggml-metal: nodes the caller encodes and commits first (at least)": Number(GGML_METAL_MAIN_NODES, "nodes")}
    for r in gpu:
        for name, rounds in (("one graph per token", r.graph_tok_s), ("an eval after every layer", r.layer_tok_s)):
            ev[f"{name}, {r.model} ({r.machine})"] = repeated(list(rounds), "tok/s")
        ev[f"throughput lost to the evals, {r.model} ({r.machine})"] = Number(100 * r.lost, "%")
        if r.extra_us is not None:
            ev[f"time added per extra sync, {r.model} ({r.machine})"] = Number(r.extra_us, "µs")
    for r in cpu:
        ev[f"context, CPU: throughput lost to the evals, {r.model} ({r.machine})"] = Number(100 * r.lost, "%")
    found = {"confirmed": "stalls the queue", "qualified": "stalled the queue for only some models",
             "refuted": "did not stall the queue"}[status]
    summary = (f"ggml-metal batches a graph's kernels into a few command buffers and waits once per graph, and on a "
               f"GPU reading an intermediate output {found} (ggml-metal's source: the calling thread encodes and "
               f"commits the first {GGML_METAL_MAIN_NODES}+ nodes, helper threads encode the rest into at most "
               f"{GGML_METAL_MAX_COMMAND_BUFFERS} buffers). Through MLX on a GPU ({_names(r.machine for r in gpu)}), "
               f"the portable analog, an eval after every layer stalled decode beyond the spread of its rounds for "
               f"{len(stalled)} of {len(gpu)} models")
    if stalled:
        summary += f", costing {_percent_range([r.lost for r in stalled])} of their throughput"
    if len(stalled) < len(gpu):
        summary += f"; not for {_names(r.model for r in gpu if not r.stalls)}"
    if cpu:
        summary += (f"; on the CPU ({_names(r.machine for r in cpu)}), context only since there the device is the "
                    f"host's own cores, the evals changed throughput by "
                    + ", ".join(f"{-100 * r.lost:+.0f}% ({r.model})" for r in cpu))
    condition = {"confirmed": "a device with its own command queue, which must drain before the host reads an "
                              "intermediate output; measured through MLX's CUDA backend (an mx.eval after each "
                              "layer against one graph per token), the portable analog; Metal itself was not run",
                 "qualified": "the stall shows only for "
                              f"{_names(r.model for r in stalled)}, not for "
                              f"{_names(r.model for r in gpu if not r.stalls)}, measured through MLX's CUDA backend",
                 "refuted": "measured through MLX's CUDA backend, an eval after every layer cost no throughput "
                            "beyond the rounds' spread on any model"}[status]
    return Verdict(status, summary + ".", ev, condition, f"{_METAL_SOURCE}; dispatch-layer-eval: {_captions(runs)}")


C01 = claim("C01", "dispatch", gather_c01, judge_c01,
            short="ggml-metal batches matmul+activation kernels into command buffers; querying intermediate outputs "
                  "synchronously stalls the pipeline",
            quote="ggml-metal batches matrix multiplication and activation kernels into Metal command buffers, but "
                  "host-device barrier synchronization causes pipeline stalls if intermediate outputs are queried "
                  "synchronously.",
            rule="Evidence: ggml-metal's source for the batching; for the stall, decode tokens/s over repeated rounds "
                 "on each GPU model through MLX (the portable analog; Metal not run), an mx.eval after every layer "
                 "against one graph per token. A model stalls if its fastest eval-per-layer round is slower than its "
                 "slowest one-graph round. Confirmed if every GPU model stalls, refuted if none does, qualified "
                 "otherwise. CPU runs are context (no device queue to drain).",
            outcomes=("confirmed", "qualified", "refuted"),
            pending=("a GPU's dispatch-layer-eval results (an eval after every layer)", DISPATCH_BENCH))


# ---- C21: a wait per token stops the overlap ----------------------------------------------------------

@dataclass(frozen=True)
class SyncRun:
    """One model's recorded decode on one machine: a sync per token against mx.async_eval pipelining."""
    machine: str
    backend: str
    model: str
    params: float               # the model's parameters (its shape's count)
    sync_tok_s: float           # medians of the recorded rounds
    async_tok_s: float
    caption: str = ""           # the run it was recorded in (Run.caption)

    @property
    def loss(self) -> float:
        """Throughput lost by blocking on every token: 1 - sync / async_eval."""
        return 1 - self.sync_tok_s / self.async_tok_s


@dataclass(frozen=True)
class C21Evidence:
    runs: tuple[SyncRun, ...]
    queue_itl_us: tuple[tuple[str, float], ...]    # the queue model's steady ITL per policy, default costs


def gather_c21(live: bool) -> C21Evidence | None:
    """Each machine's reference dispatch-async run with each model's size, and the queue model's arithmetic;
    None without a GPU's."""
    rec = dispatch_records("dispatch-async")
    runs = tuple(SyncRun(lab, r["backend"], model, float(args_for(model).num_parameters), r["value"],
                         rec[lab, model, "async_eval", "tokens_per_s"]["value"], r["caption"])
                 for (lab, model, var, metric), r in sorted(rec.items())
                 if var == "sync" and metric == "tokens_per_s" and (lab, model, "async_eval", "tokens_per_s") in rec)
    if not any(r.backend != "cpu" for r in runs):
        return None
    cfg = queue.QueueConfig()
    itl = tuple((p, 1e6 * queue.steady_period(replace(cfg, policy=p))) for p in queue.POLICIES)
    return C21Evidence(runs, itl)


def judge_c21(e: C21Evidence) -> Verdict:
    """Refuted if no GPU model loses throughput; confirmed if every one does, none past 25%, and no machine's
    largest model loses more than its smallest; qualified otherwise."""
    gpu = [r for r in e.runs if r.backend != "cpu"]
    cpu = [r for r in e.runs if r.backend == "cpu"]
    losing = [r for r in gpu if r.loss > 0]
    over = [r for r in gpu if r.loss > C21_LOSS]
    ends = {lab: (min(rs, key=lambda r: r.params), max(rs, key=lambda r: r.params))
            for lab in {r.machine for r in gpu} for rs in [[r for r in gpu if r.machine == lab]]}
    grows = {lab: (s, b) for lab, (s, b) in ends.items() if b.loss > s.loss}
    status = decide(len(losing) == len(gpu) and not over and not grows, contradicted=not losing)
    ev = {f"queue model, default costs: {p} ITL": Number(us, "µs") for p, us in e.queue_itl_us}
    for r in gpu:
        ev[f"throughput lost by syncing each token, {r.model} ({r.machine})"] = Number(100 * r.loss, "%")
    for r in cpu:
        ev[f"context, CPU: throughput lost by syncing each token, {r.model} ({r.machine})"] = Number(100 * r.loss, "%")
    summary = (f"Blocking on every token cost throughput on {len(losing)} of {len(gpu)} models on the GPU "
               f"({_names(r.machine for r in gpu)}; MLX, a sync per token against mx.async_eval, the portable analog)")
    if losing:
        summary += f", {_percent_range([r.loss for r in losing])}"
    if over:
        summary += (f"; more than the claim's {C21_LOSS:.0%} for "
                    + ", ".join(f"{r.model} ({100 * r.loss:.0f}%)" for r in over))
    for lab, (s, b) in sorted(grows.items()):
        summary += (f"; on {lab} the loss grew with model size, from {100 * s.loss:.0f}% ({s.model}) to "
                    f"{100 * b.loss:.0f}% ({b.model}), where the claim puts it on small models")
    if cpu:
        summary += (f"; on the CPU ({_names(r.machine for r in cpu)}), context only, "
                    + ", ".join(f"{100 * r.loss:.0f}% ({r.model})" for r in cpu))
    if status == "confirmed":
        condition = ("small models on a GPU, where a sync per token leaves the device idle while the host reads the "
                     "token and builds the next step; measured through MLX's CUDA backend, Metal not run")
    elif status == "refuted":
        condition = "measured through MLX's CUDA backend, a sync per token cost no model any throughput"
    else:
        parts = ["the loss follows the host work a sync leaves exposed (in MLX, Python building every layer's "
                 f"graph), which grew with model size on {_names(grows)}, not the model being small"] if grows else []
        parts += [f"it passed the claim's {C21_LOSS:.0%} for {_names(r.model for r in over)}"] if over else []
        parts += [f"no loss for {_names(r.model for r in gpu if r.loss <= 0)}"] if len(losing) < len(gpu) else []
        condition = "; ".join(parts)
    source = (f"dispatch-async: {_captions(e.runs)}; MLX's mx.async_eval stands in for Metal's commit without "
              "waitUntilCompleted; ref_impl.theory.queue (arithmetic)")
    return Verdict(status, summary + ".", ev, condition, source)


C21 = claim("C21", "dispatch", gather_c21, judge_c21,
            short="blocking the CPU on command-buffer completion stops CPU/GPU overlap: up to 25% lower throughput "
                  "on small models",
            quote="Synchronously blocking CPU execution on MTLCommandBuffer waitUntilCompleted() prevents "
                  "overlapping CPU dispatch with GPU execution, causing up to 25% throughput degradation on small "
                  "models.",
            rule="Evidence: throughput lost by syncing every token, 1 - sync / async_eval tokens/s, for each model "
                 "recorded on a GPU through MLX (the portable analog of waitUntilCompleted against commit). Refuted "
                 "if no model loses throughput; confirmed if all do, none past the claim's 25%, and no machine's "
                 "largest model loses more than its smallest (the claim puts the loss on small models); qualified "
                 "otherwise, naming them. CPU runs are context.",
            outcomes=("confirmed", "qualified", "refuted"),
            pending=("a GPU's dispatch-async results (sync per token against mx.async_eval)", DISPATCH_BENCH))


# ---- C31: kernel invocation from Python ---------------------------------------------------------------

@dataclass(frozen=True)
class LaunchFloor:
    """One recorded kernel-latency configuration on one machine: its launch floor from Python through MLX."""
    machine: str
    backend: str
    chain: int                  # adds per evaluated call
    compiled: bool              # fused by mx.compile into one kernel per call
    per_op_us: float            # median µs per add over sizes up to 4096 elements (latency.launch_floor)
    break_even: int | None = None
    caption: str = ""           # the run it was recorded in (Run.caption)

    @property
    def per_kernel_us(self) -> float:
        """µs per kernel invoked: one kernel per add, or one per call when mx.compile fused the chain."""
        return self.per_op_us * self.chain if self.compiled else self.per_op_us

    @property
    def name(self) -> str:
        return f"chain={self.chain}{', compiled' if self.compiled else ''} ({self.machine})"


@dataclass(frozen=True)
class C31Evidence:
    floors: tuple[LaunchFloor, ...]
    live: Number | None = None          # this machine's floor, one add, repeated: shown, never decides
    device: str = ""


def gather_c31(live: bool) -> C31Evidence | None:
    """The launch floors of each machine's reference kernel-latency run, per configuration, and with `live` this
    machine's (latency.measure_launch_floor, shown only); None without a recorded run."""
    floors = []
    for lab, run in sorted(dispatch_runs("kernel-latency").items()):
        for var, d in sorted(kernel_latency_recorded(run).items()):
            floor, be = latency.launch_floor(list(d.items()))
            chain = int(var.split(",")[0].removeprefix("chain="))
            floors.append(LaunchFloor(lab, run.machine["backend"], chain, "compiled" in var, floor, be, run.caption))
    if not floors:
        return None
    if not live:
        return C31Evidence(tuple(floors))
    device, reading = latency.measure_launch_floor()
    return C31Evidence(tuple(floors), repeated(list(reading), "µs"), device)


def judge_c31(e: C31Evidence) -> Verdict:
    """Confirmed if one add evaluated alone costs under 1 µs on every machine; qualified if only chained
    launches get under it; refuted if no configuration does."""
    alone = [f for f in e.floors if f.chain == 1 and not f.compiled]
    under = [f for f in e.floors if f.per_kernel_us < C31_BOUND_US]
    status = decide(bool(alone) and all(f.per_kernel_us < C31_BOUND_US for f in alone), contradicted=not under)
    ev = {"the claim's bound": Number(C31_BOUND_US, "µs")}
    for f in e.floors:
        ev[f"µs per kernel, smallest sizes, {f.name}"] = Number(f.per_kernel_us, "µs")
        if f.compiled and f.chain > 1:
            ev[f"µs per add fused by mx.compile, {f.name}"] = Number(f.per_op_us, "µs")
        if f.break_even and f.chain == 1 and not f.compiled:
            ev[f"break-even size (work = launch), {f.name}"] = Number(f.break_even, "elements")
    best = min(e.floors, key=lambda f: f.per_kernel_us)
    summary = (f"From Python through MLX (the portable analog; Metal not run) no recorded configuration invoked a "
               f"kernel in under {C31_BOUND_US:g} µs" if not under else
               f"{len(under)} of {len(e.floors)} recorded configurations invoked a kernel in under "
               f"{C31_BOUND_US:g} µs from Python through MLX (the portable analog; Metal not run)")
    if alone:
        summary += ("; one add evaluated alone costs "
                    + ", ".join(f"{figure(f.per_kernel_us)} µs on {f.machine}" for f in alone)
                    + ", with its inputs already in the device's memory, so no copy is in that time: the host round "
                      "trip (Python, graph, launch, wait) is")
    summary += f"; the cheapest kernel, {best.name}, cost {figure(best.per_kernel_us)} µs"
    fused = [f for f in e.floors if f.compiled and f.chain > 1]
    if fused:
        f = min(fused, key=lambda f: f.per_op_us)
        summary += (f", and fusing {f.chain} adds into one kernel with mx.compile brought the cost per add to "
                    f"{figure(f.per_op_us)} µs ({f.machine}) at {figure(f.per_kernel_us)} µs per kernel")
    source = f"kernel-latency: {_captions(e.floors)}"
    if e.live is not None:
        ev[f"live: µs per kernel, one add on ≤ 4096 values ({e.device})"] = e.live
        source = (f"live: ref_impl.measure.latency.measure_launch_floor on this machine ({e.device}), shown only; "
                  + source)
    alone_under = _names(f.machine for f in alone if f.per_kernel_us < C31_BOUND_US)
    condition = {"confirmed": "one kernel evaluated from Python at a time, measured through MLX",
                 "qualified": (f"one add evaluated alone gets under the bound only on {alone_under}" if alone_under
                               else "only launches queued back to back and waited on together get under the bound; "
                                    "one kernel evaluated from Python at a time does not"),
                 "refuted": "zero-copy sharing removes transfers, not the host's launch and wait: measured through "
                            "MLX from Python on a CPU and a CUDA GPU; Metal not run"}[status]
    return Verdict(status, summary + ".", ev, condition, source)


C31 = claim("C31", "dispatch", gather_c31, judge_c31,
            short="passing unified buffers between Python and GPU kernels is zero-copy and brings kernel invocation "
                  "latency to sub-microsecond",
            quote="Passing unified buffer pointers between host Python runtimes and Metal compute kernels enables "
                  "zero-copy tensor evaluation, reducing kernel invocation latency to sub-microsecond levels.",
            rule="Evidence: recorded µs per kernel invoked from Python through MLX (CPU and CUDA, the portable "
                 "analog; Metal not run) on adds of 1-4096 elements already in the device's memory: one add per "
                 "evaluation, chains evaluated together, chains fused by mx.compile into one kernel. Confirmed if one "
                 "add alone "
                 "costs under the claim's 1 µs on every machine; qualified if only chains do; refuted if none does. "
                 "A live reading is shown, never used.",
            outcomes=("confirmed", "qualified", "refuted"),
            pending=("the kernel-latency results", DISPATCH_BENCH))


CLAIMS = (C01, C21, C31)   # in id order; __init__ assembles the registry
