"""Chapter dispatch, command buffers (book/dispatch/command-buffers): C01, C21 and C31.

ggml-metal's batching is read from its source; the stalls and launch costs are measured through
MLX (sync per token against mx.async_eval, an eval after every layer, one small op), the portable
analog of Metal, and read from results/ (dispatch-async, dispatch-layer-eval, kernel-latency).
"""

from __future__ import annotations

import functools
from dataclasses import replace

import mlx.core as mx

from ref_impl.ledger.core import SHIPPED_MODEL, Number, Verdict, claim, results
from ref_impl.measure import latency
from ref_impl.theory import queue

GGML_METAL_MAX_COMMAND_BUFFERS = 8   # ggml/src/ggml-metal/ggml-metal-context.m: command buffers per graph, at most
GGML_METAL_MAIN_NODES = 64           # the same file: the caller encodes MAX(64, 0.1 * n_nodes) nodes first
_METAL_SOURCE = ("llama.cpp ggml/src/ggml-metal/ggml-metal-context.m (ggml_metal_graph_compute: n_cb command "
                 "buffers, commit, wait in ggml_metal_synchronize); Apple Metal docs (MTLCommandBuffer commit, "
                 "waitUntilCompleted)")
C21_LOSS = 0.25                      # "up to 25% throughput degradation", quoted from the claim


def dispatch_records(experiment: str) -> dict[tuple[str, str | None, str | None, str], dict]:
    """(machine label, model, variant, metric) -> record, for one dispatch experiment in results/ (ours only;
    a later file of the same machine replaces an earlier one). Each record gains the machine's backend."""
    return {(m["label"], r["model"], r.get("variant"), r["metric"]): r | {"backend": m["backend"]}
            for _, m, r in results(experiment) if r["peer"] is None}


def _sync_losses() -> dict[tuple[str, str], tuple[float, float, str]]:
    """(label, model) -> (sync tok/s, async_eval tok/s, backend) from the dispatch-async records."""
    rec = dispatch_records("dispatch-async")
    return {(lab, model): (r["value"], rec[lab, model, "async_eval", "tokens_per_s"]["value"], r["backend"])
            for (lab, model, var, metric), r in rec.items()
            if var == "sync" and metric == "tokens_per_s" and (lab, model, "async_eval", "tokens_per_s") in rec}


def _queue_model_evidence() -> dict[str, Number]:
    """The queue model's steady ITL with its default costs, per policy (arithmetic: nothing is timed)."""
    cfg = queue.QueueConfig()
    return {f"queue model, default costs: {p} ITL": Number(1e6 * queue.steady_period(replace(cfg, policy=p)), "µs")
            for p in queue.POLICIES}


def check_c21(live: bool) -> Verdict:
    """Sync per token vs async_eval pipelining, recorded through MLX on the CPU and the H200, by model size."""
    ev = _queue_model_evidence()
    pt, db = (ev[f"queue model, default costs: {p} ITL"].value for p in ("per_token", "double_buffer"))
    losses = _sync_losses()
    if not losses:
        return Verdict("not testable here", f"No recorded dispatch-async results; the queue model alone gives a sync "
                       f"loss of {100 * (1 - db / pt):.0f}% with its default costs.", ev,
                       "needs `python -m ref_impl bench --dispatch` results", "ref_impl.theory.queue (arithmetic)")
    for (lab, model), (s, a, _) in losses.items():
        ev[f"throughput lost by syncing each token, {model} ({lab})"] = Number(100 * (1 - s / a), "%")
    by_machine: dict[str, list[tuple[str, float]]] = {}
    for (lab, model), (s, a, _) in losses.items():
        by_machine.setdefault(lab, []).append((model, 1 - s / a))
    gpu = [lab for (lab, _), (_, _, b) in losses.items() if b != "cpu"]
    worst_lab, worst_model = max(losses, key=lambda k: 1 - losses[k][0] / losses[k][1])
    worst = 1 - losses[worst_lab, worst_model][0] / losses[worst_lab, worst_model][1]
    everywhere = all(s < a for s, a, _ in losses.values())
    summary = (f"Blocking on every token does stop the overlap and costs throughput on every recorded model and machine "
               f"({'all' if everywhere else 'not all'} of {len(losses)} runs lost speed), up to {100 * worst:.0f}% "
               f"({worst_model} on {worst_lab})")
    status = "confirmed" if everywhere and worst <= C21_LOSS + 0.02 else "qualified"
    if gpu:
        lab = gpu[0]
        order = sorted(by_machine[lab], key=lambda mv: mv[1])
        summary += (f"; but on the {lab} GPU the loss is not a small-model effect: it is smallest for "
                    f"{order[0][0]} and largest for {order[-1][0]}, because MLX builds each token's graph in Python, "
                    "layer by layer, so the host work that a sync leaves exposed grows with the layer count as fast "
                    "as the GPU work does")
        if order[-1][0] not in ("tiny", SHIPPED_MODEL.stem):
            status = "qualified"
    source = "results/ (dispatch-async: " + ", ".join(sorted(by_machine)) + "); MLX's mx.async_eval stands in for " \
             "Metal's commit without waitUntilCompleted"
    return Verdict(status, summary + ".", ev,
                   "measured through MLX (sync per token vs mx.async_eval) on a CPU and a CUDA GPU, the portable "
                   "analog of waitUntilCompleted; Metal itself was not run. The loss is bounded by the host work a "
                   "sync exposes, so it depends on how heavy the host side is, not on model size alone", source)


C21 = claim("C21", "dispatch", check_c21,
            short="blocking the CPU on command-buffer completion stops CPU/GPU overlap: up to 25% lower throughput "
                  "on small models",
            quote="Synchronously blocking CPU execution on MTLCommandBuffer waitUntilCompleted() prevents "
                  "overlapping CPU dispatch with GPU execution, causing up to 25% throughput degradation on small "
                  "models.")


def check_c01(live: bool) -> Verdict:
    """ggml-metal's command buffers (from its source) and the cost of reading each layer's output (MLX, recorded)."""
    ev = {"ggml-metal: most command buffers per graph (GGML_METAL_MAX_COMMAND_BUFFERS)":
          Number(GGML_METAL_MAX_COMMAND_BUFFERS, "buffers"),
          "ggml-metal: nodes the caller encodes and commits first (at least)": Number(GGML_METAL_MAIN_NODES, "nodes")}
    rec = dispatch_records("dispatch-layer-eval")
    slow = {(lab, model): (r["value"], r["backend"]) for (lab, model, var, metric), r in rec.items()
            if metric == "slowdown"}
    for (lab, model), (v, _) in slow.items():
        ev[f"decode slowdown with an eval after every layer, {model} ({lab})"] = Number(100 * v, "%")
        extra = rec.get((lab, model, "layer_eval", "extra_us_per_layer_eval"))
        if extra:
            ev[f"time added per extra sync, {model} ({lab})"] = Number(extra["value"], "µs")
    summary = ("ggml-metal does batch a graph's kernels into a few command buffers (its source: the calling thread "
               f"encodes and commits the first {GGML_METAL_MAIN_NODES}+ nodes, helper threads encode the rest into at "
               f"most {GGML_METAL_MAX_COMMAND_BUFFERS} buffers, and the host waits once per graph); Metal could not "
               "be run here")
    gpu = {k: v for k, (v, b) in slow.items() if b != "cpu"}
    cpu = {k: v for k, (v, b) in slow.items() if b == "cpu"}
    if not gpu:
        return Verdict("not testable here", summary + ", and no GPU dispatch-layer-eval results are recorded.", ev,
                       "needs a GPU run of `python -m ref_impl bench --dispatch`", _METAL_SOURCE)
    lo, hi = min(gpu.values()), max(gpu.values())
    summary += (f"; the stall is real on a GPU: through MLX on CUDA, evaluating every layer's output slows decode by "
                f"{100 * lo:.0f}-{100 * hi:.0f}% ({', '.join(sorted({k[0] for k in gpu}))})")
    if cpu:
        c_lo, c_hi = min(cpu.values()), max(cpu.values())
        summary += (f", while on the CPU it made decode {100 * -c_hi:.0f}-{100 * -c_lo:.0f}% faster, not slower"
                    if c_hi < 0 else f", while on the CPU it cost at most {100 * c_hi:.0f}%")
        summary += ": there the 'device' is the host's own cores, with no separate queue to drain"
    status = "qualified" if cpu and max(cpu.values()) < 0.05 else "confirmed" if lo > 0.05 else "qualified"
    labels = sorted({k[0] for k in slow})
    return Verdict(status, summary + ".", ev,
                   "the batching half from ggml-metal's source; the stall half measured through MLX (an mx.eval after "
                   "each layer vs one graph per token), the portable analog, on a GPU; on a CPU backend there is no "
                   "stall to speak of", f"{_METAL_SOURCE}; results/ (dispatch-layer-eval: {', '.join(labels)})")


C01 = claim("C01", "dispatch", check_c01,
            short="ggml-metal batches matmul+activation kernels into command buffers; querying intermediate outputs "
                  "synchronously stalls the pipeline",
            quote="ggml-metal batches matrix multiplication and activation kernels into Metal command buffers, but "
                  "host-device barrier synchronization causes pipeline stalls if intermediate outputs are queried "
                  "synchronously.")


@functools.cache
def measure_launch_floor() -> tuple[str, float]:
    """This machine's launch + sync floor through MLX: one add on 1 to 4096 float32 values, a second or less."""
    rows = latency.kernel_latency(sizes=(1, 16, 256, 4096), chains=(1,), target_s=0.005, rounds=3, budget_s=1.0)
    return str(mx.default_device()), latency.launch_floor([(r.elements, r.per_op_us) for r in rows])[0]


def check_c31(live: bool) -> Verdict:
    """Kernel invocation latency from Python through MLX (recorded on the CPU and the H200), against 1 µs."""
    per: dict[tuple[str, str], dict[int, float]] = {}
    backend = {}

    for _, m, r in results("kernel-latency"):
        if r["peer"] is None and r["metric"] == "per_op_us":
            per.setdefault((m["label"], r["variant"]), {})[r["elements"]] = r["value"]   # later files win
            backend[m["label"]] = m["backend"]
    ev, source = {}, []
    for (lab, var), d in sorted(per.items()):
        floor, be = latency.launch_floor(list(d.items()))
        ev[f"µs per op, smallest sizes, {var} ({lab})"] = Number(floor, "µs")
        if be and var == "chain=1":
            ev[f"break-even size (work = launch), {var} ({lab})"] = Number(be, "elements")
    if live:
        device, floor = measure_launch_floor()
        ev[f"live: µs per op, one add on ≤ 4096 values ({device})"] = Number(floor, "µs")
        source.append(f"live: ref_impl.measure.latency.kernel_latency on this machine ({device})")
    if not per and not live:
        return Verdict("not testable here", "No recorded kernel-latency results, and live=False times nothing.",
                       {"the claim's bound": Number(1.0, "µs")}, "needs results or a live run", "the claim")
    best = min(v.value for k, v in ev.items() if "µs per op" in k)
    plain = [v.value for k, v in ev.items() if "µs per op" in k and "compiled" not in k]
    status = "refuted" if best > 1.0 else "qualified"
    summary = (f"Nothing measured here comes near a microsecond: an evaluated call from Python through MLX costs "
               f"{min(plain):.0f}-{max(plain):.0f} µs per operation at small sizes, and even sixteen adds fused by "
               f"mx.compile into one kernel and evaluated together cost {best:.1f} µs per add at best")
    if per:
        floors = {lab: ev[f"µs per op, smallest sizes, chain=1 ({lab})"].value for lab in backend
                  if f"µs per op, smallest sizes, chain=1 ({lab})" in ev}
        summary += ("; one add alone costs " + ", ".join(f"{v:.0f} µs on {lab}" for lab, v in floors.items())
                    + ", where the inputs were already in the device's memory, so copies were not the cost: the host "
                    "round trip (Python, graph, launch, wait) is")
        source.append("results/ (kernel-latency: " + ", ".join(sorted(backend)) + ")")
    return Verdict(status, summary + ". Zero-copy sharing is how MLX works on Apple silicon's unified memory, but it "
                   "removes transfers, not launch and synchronization.", ev,
                   "measured through MLX from Python on a CPU and a CUDA GPU (the portable analog); Metal not run. "
                   "A launch that is never waited on can cost less per kernel, which is what batching into command "
                   "buffers and pipelining buy", "; ".join(source))


C31 = claim("C31", "dispatch", check_c31,
            short="passing unified buffers between Python and GPU kernels is zero-copy and brings kernel invocation "
                  "latency to sub-microsecond",
            quote="Passing unified buffer pointers between host Python runtimes and Metal compute kernels enables "
                  "zero-copy tensor evaluation, reducing kernel invocation latency to sub-microsecond levels.")


CLAIMS = (C01, C21, C31)   # in id order; __init__ assembles the registry
