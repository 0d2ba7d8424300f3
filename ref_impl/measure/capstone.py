"""The capstone's bench: the composed decoder's switches one at a time and together, beside mlx-lm and
llama.cpp on the same weights, in one run.

    python -m ref_impl bench --capstone --label cpu-2core
    python -m ref_impl bench --capstone --shape Llama-3.1-8B --llama-bench PATH --label h200
    python -m ref_impl bench --capstone --quick            (tiny sizes: checks that it runs)

A *rung* is one configuration of `compose.generate`: the weights (the float file, or a Q4_K_M file held
as MLX quantized matrices), our CUDA kernels patched in or not, and the loop's `Techniques`. The ladder
adds one switch at a time, from plain float decoding (synchronous) to everything on; the single rungs
turn one technique on over the pipelined float decoder, so each technique is seen alone and stacked.
Every rung decodes the same held-out prompts (a warm-up generation, then each prompt once), greedy, and
records tokens/s, TTFT, ITL p50/p99, peak memory, greedy agreement with the plain rung, acceptance when it
speculates, the share of the measured bandwidth its speed implies, and the held-out perplexity of its
weights and cache (speculation, pipelining and compiling leave the model's distribution as it is).

The peers decode the same prompts on the same weights: mlx-lm (its own loop, its 8-bit KV cache, its
speculative loop with our draft) and llama.cpp (the float and the Q4_K_M file, its Q8_0 KV cache; on a
GPU, `llama-bench` on the shape's files). A long-context case repeats the cache rungs after a prompt of
several thousand tokens, where the cache, not the weights, is most of what a step reads: the shipped
model is trained on 512 positions, so there it is timed only (its text past 512 means nothing).

With `--shape` the weights are random values of a public model's shape (speed does not depend on them):
no draft or MTP heads exist for them and perplexity means nothing, so those rungs are left out.

Read back, a run's records become one row per rung or peer (`table`), and the chapter shows those rows with
`rung_table` (a column per metric, its unit in the header and its meaning under the table) and `not_measured`.

See chapter: capstone
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from ref_impl import kernels, viz
from ref_impl.kernels import loading
from ref_impl.engine.checkpoint import load, load_model
from ref_impl.engine.compose import Techniques, steps
from ref_impl.engine.generate import Sampler
from ref_impl.engine.kvquant import FLOAT
from ref_impl.engine.model import Model, ModelArgs
from ref_impl.engine.mtp import MTPHeads, load_heads
from ref_impl.engine.random import args_for, write_random_model
from ref_impl.engine.tokenizer import Tokenizer
from ref_impl.formats import gguf
from ref_impl.formats.quantize import quantize_file
from ref_impl.measure.decode import decode_bytes, roofs
from ref_impl.measure.peers import Stream, llama_bench_records, llama_cpp_stream, mlx_lm_stream
from ref_impl.measure.records import Run, bandwidth, dtype_name, fastest_bandwidth, record
from ref_impl.measure.spec import heldout_prompts
from ref_impl.platform.machine import package_version
from ref_impl.platform.timing import TokenRun, decode_metrics, time_tokens
from ref_impl.training.corpus import heldout_stream
from ref_impl.training.evaluate import heldout_losses, perplexity

Say = Callable[[str], None]
QUANTIZED = "Q4_K_M"     # the quantized weights of every rung that turns weights on
PARTS = frozenset({"ladder", "long", "ppl"})   # a run's parts: the rungs and peers, the long-context case, perplexity


@dataclass(frozen=True)
class CapstonePlan:
    """The sizes of one capstone run."""
    prompts: int = 4                 # held-out prompts, each decoded once per rung after a warm-up
    prompt_len: int = 128
    gen_tokens: int = 128
    gamma: int = 4                   # drafts per verification, draft model
    mtp_gamma: int = 3               # drafts per verification, MTP heads
    kv: str = "sym8"                 # the dequantized quantized-cache rung
    fused_kv: str = "affine8-g64"    # the fused-attention cache rung: mlx-lm's own 8-bit cache format
    long_context: int = 4096         # the long-context case's prompt (0: none)
    long_tokens: int = 32
    ppl_context: int = 0             # held-out perplexity: window length (0: the model's context)
    ppl_tokens: int = 0              # and tokens scored (0: the whole held-out text, `evaluate.heldout_losses`)
    bandwidth_bytes: int = 1 << 30   # the array decode.roofs copies and reads
    parts: frozenset[str] = PARTS     # which to run: all, or some where a call's time is short ("long" alone) or
                                      # the machine is busy ("ppl" alone: a perplexity times nothing)

    @classmethod
    def for_device(cls, gpu: bool, quick: bool = False, prompt_len: int = 128, gen_tokens: int = 128,
                   long_context: int = 4096, parts: frozenset[str] = PARTS, ppl_tokens: int = 0) -> CapstonePlan:
        if not parts or not parts <= PARTS:
            raise ValueError(f"capstone parts {sorted(parts)}: give some of {sorted(PARTS)}")
        if parts == {"long"} and long_context <= 0:
            raise ValueError("--long-only needs a long-context case: --long-context must be positive")
        long_context = long_context if "long" in parts else 0
        if quick:
            return cls(prompts=2, prompt_len=16, gen_tokens=8, long_context=long_context and 96, long_tokens=4,
                       ppl_context=32, ppl_tokens=32, bandwidth_bytes=64 << 20, parts=parts)
        return cls(prompts=4, prompt_len=prompt_len, gen_tokens=gen_tokens, long_context=long_context,
                   ppl_tokens=ppl_tokens, parts=parts)


@dataclass(frozen=True)
class Rung:
    """One configuration: its name, its place on the ladder (None: a single switch over the pipelined float
    decoder), the weights ("float" or QUANTIZED), our kernels or not, and the loop's switches."""
    name: str
    ladder: int | None
    weights: str
    kernels: bool
    techniques: Techniques


def rungs(plan: CapstonePlan, gpu: bool, draft: bool, heads: bool, fused_runs: bool = True) -> list[Rung]:
    """The ladder and the single switches this run measures (kernels only on a GPU, speculation only with a
    proposer), the plain rung first: every other rung's agreement is against its tokens. The ladder's cache is
    plan.fused_kv with fused attention, or plan.kv dequantized where fused attention cannot run here
    (fused_runs False; its single rung then records why)."""
    T, q, k = Techniques, QUANTIZED, gpu
    fused = {"kv": plan.fused_kv, "fused": True}
    best = fused if fused_runs else {"kv": plan.kv}
    ladder = [("plain", "float", False, T(pipeline=False)), ("+pipeline", "float", False, T()),
              (f"+{q}", q, False, T())]
    ladder += [("+kernels", q, True, T())] if k else []
    ladder += [(f"+kv {plan.fused_kv} fused" if fused_runs else f"+kv {plan.kv}", q, k, T(**best))]
    ladder += [("+draft", q, k, T(**best, speculate="draft", gamma=plan.gamma))] if draft else []
    out = [Rung(name, i, w, kern, t) for i, (name, w, kern, t) in enumerate(ladder)]
    singles = [("compile", "float", False, T(compiled=True)), (f"kv {plan.kv}", "float", False, T(kv=plan.kv)),
               (f"kv {plan.fused_kv} fused", "float", False, T(**fused))]
    singles += [("kernels", "float", True, T())] if k else []
    singles += [("draft", "float", False, T(speculate="draft", gamma=plan.gamma))] if draft else []
    singles += [("mtp", "float", False, T(speculate="mtp", gamma=plan.mtp_gamma))] if heads else []
    singles += [("everything, mtp", q, k, T(**best, speculate="mtp", gamma=plan.mtp_gamma))] if heads else []
    return out + [Rung(name, None, w, kern, t) for name, w, kern, t in singles]


def token_stream(model: Model, techniques: Techniques, proposer: Model | MTPHeads | None,
                 log: list) -> Stream:
    """compose's loop as a greedy token stream (prompt, n) -> ids; each step's drafts (proposed, accepted)
    appended to log."""
    def stream(prompt: list[int], n: int) -> Iterator[int]:
        for step in steps(model, prompt, Sampler(), techniques, techniques.cache_size(len(prompt), n), proposer):
            log.append((step.proposed, step.accepted))
            yield from step.tokens
    return stream


def timed(stream: Stream, prompts: Sequence[list[int]], n: int, log: list | None = None) -> tuple[list[TokenRun], int]:
    """One warm-up generation, then each prompt once: the runs and MLX's peak memory over them (bytes). log: the
    stream's step log, emptied after the warm-up so it holds the timed runs' steps only."""
    time_tokens(stream(prompts[0], n), n)
    if log is not None:
        log.clear()
    mx.reset_peak_memory()
    runs = [time_tokens(stream(p, n), n) for p in prompts]
    return runs, mx.get_peak_memory()


def run_records(experiment: str, runs: list[TokenRun], reference: list[TokenRun] | None, prompt_len: int,
                fields: dict, peak: int | None = None, log: Sequence[tuple[int, int]] = (),
                step_bytes: int | None = None, bandwidth: float | None = None) -> list[dict]:
    """Records of one rung or peer: timing.decode_metrics over its runs, peak memory, greedy agreement with
    the reference runs (the share of positions whose token matches, prompt by prompt), acceptance, and the
    share of the bandwidth roof that tokens/s x step_bytes is (speculative rungs: an effective share, since
    one weight read emits several tokens)."""
    metrics = decode_metrics(runs, prompt_len)
    units = {"tokens_per_s": "tok/s", "prefill_tokens_per_s": "tok/s"}
    out = [record(experiment, m, units.get(m, "ms"), v, samples=s, **fields) for m, (v, s) in metrics.items()]
    if peak is not None:   # resident: what the peak covers (the rung's own model, since Weights keeps one loaded)
        out.append(record(experiment, "peak_memory", "B", peak, resident="rung", **fields))
    if reference is not None:
        agree = [float(np.mean(np.array(r.ids) == np.array(ref.ids))) for r, ref in zip(runs, reference)]
        out.append(record(experiment, "greedy_agreement", "fraction", np.mean(agree), samples=agree, **fields))
    proposed, accepted = (sum(x) for x in zip(*log)) if log else (0, 0)
    if proposed:
        out.append(record(experiment, "alpha", "fraction", accepted / proposed, proposed=proposed, **fields))
    if step_bytes and bandwidth:
        out.append(record(experiment, "bandwidth_fraction", "fraction",
                          metrics["tokens_per_s"][0] * step_bytes / 1e9 / bandwidth, bytes_per_token=step_bytes,
                          **fields))
    return out


@dataclass
class Weights:
    """A run's two weight files, by rung weights ("float", QUANTIZED), with the GGML name of each, and the
    model loaded from one of them (float: the default dtype; QUANTIZED: MLX quantized matrices; patched with
    our kernels, for `rows` rows, or not). One model is resident at a time, so a rung's peak memory is its own
    model's and its decoding's, not that of every model the run loaded before it."""
    name: str
    files: dict[str, Path]
    types: dict[str, str]
    rows: tuple[int, ...] = (1,)
    models: dict[tuple[str, bool], Model] = dataclasses.field(default_factory=dict)

    def model(self, weights: str, patched: bool) -> Model:
        key = (weights, patched)
        if key not in self.models:
            self.models.clear()
            gc.collect()
            mx.clear_cache()
            options = loading.LoadOptions(weights="float" if weights == "float" else "native",
                                  kernels="on" if patched else "off", rows=self.rows)
            with gguf.read(self.files[weights]) as f:      # as generate loads it: kernels and fused layers
                self.models[key] = loading.load(f, options, tokenizer=False).model
        return self.models[key]


def fields_of(rung: Rung, weights: Weights, model: Model, context: int) -> dict:
    """A rung's record fields: what ran, switch by switch."""
    t = rung.techniques
    return {"model": weights.name, "weights": weights.types[rung.weights],
            "kv": dtype_name(model.norm.weight.dtype) if t.kv == FLOAT else t.kv, "context": context,
            "variant": rung.name, "ladder": rung.ladder, "native": rung.weights != "float", "kernels": rung.kernels,
            "fused": t.fused, "speculate": t.speculate, "gamma": t.gamma if t.speculate else None,
            "pipeline": t.pipeline, "compiled": t.compiled, "techniques": t.describe()}


def ladder_records(plan: CapstonePlan, weights: Weights, prompts: list[list[int]], draft: Model | None,
                   heads: MTPHeads | None, gpu: bool, roof: float, say: Say) -> tuple[list[dict], list[TokenRun]]:
    """Every rung on the prompts, the plain rung first, then grouped by weights and kernels so each model is
    loaded (and patched) once; and the plain rung's runs (the agreement reference)."""
    try:   # fused attention refused here (kvquant.check_fused) leaves the ladder its dequantized cache
        weights.model("float", False).make_cache(8, scheme=plan.fused_kv, fused=True)
        fused_runs = True
    except ValueError as e:
        say(f"capstone: {e}")
        fused_runs = False
    order = rungs(plan, gpu, draft is not None, heads is not None, fused_runs)
    reference, out = None, []
    context = plan.prompt_len + plan.gen_tokens
    for rung in sorted(order, key=lambda r: (r.ladder != 0, r.weights != "float", r.kernels)):
        model = weights.model(rung.weights, rung.kernels)
        proposer = {"draft": draft, "mtp": heads, None: None}[rung.techniques.speculate]
        say(f"capstone: {rung.name} ({rung.techniques.describe()})")
        fields = fields_of(rung, weights, model, context)

        def measure(model=model, rung=rung, proposer=proposer, fields=fields):
            nonlocal reference
            log: list = []
            runs, peak = timed(token_stream(model, rung.techniques, proposer, log), prompts, plan.gen_tokens, log)
            reference = reference or runs
            return run_records("capstone", runs, reference, plan.prompt_len, fields, peak, log,
                               decode_bytes(model, plan.prompt_len + plan.gen_tokens // 2), roof)
        out += guarded("capstone", fields, measure, (ValueError,), "skipped")
    return out, reference


PEER_FAILURES = (ImportError, OSError, RuntimeError, ValueError, AttributeError)


def guarded(experiment: str, fields: dict, measure: Callable[[], list[dict]], failures: tuple = PEER_FAILURES,
            metric: str = "peer_error") -> list[dict]:
    """measure()'s records, or one `metric` record keeping the message of what failed: a missing or failing
    peer ("peer_error"), or a rung this device refuses (ValueError, "skipped": e.g. fused attention where
    kvquant.check_fused finds MLX's quantized matmul wrong), must not cost the rest of the run."""
    try:
        return measure()
    except failures as e:
        return [record(experiment, metric, None, None, note=f"{type(e).__name__}: {e}", **fields)]


def peer_streams(weights: Weights, draft: Model | None, gamma: int, n_ctx: int, gpu: bool,
                 long: bool = False) -> list[tuple[str, str, str, Callable[[], Stream]]]:
    """(label, weights, kv, stream builder) of each peer: mlx-lm on our float arrays (its loop, its 8-bit
    cache, its speculative loop with our draft), llama.cpp through llama-cpp-python on the two files (its
    F16 cache, its Q8_0 cache; not on a GPU, where llama-bench stands in). long: the caches only."""
    base = weights.model("float", False)
    mlx_lm = f"mlx-lm {package_version('mlx-lm')}"
    llama = f"llama.cpp (llama-cpp-python {package_version('llama_cpp_python')})"
    q = QUANTIZED
    out = [(mlx_lm, "float", dtype_name(base.norm.weight.dtype), lambda: mlx_lm_stream(base)),
           (mlx_lm, "float", "affine8-g64", lambda: mlx_lm_stream(base, kv_bits=8))]
    if draft is not None and not long:
        out.append((mlx_lm + " speculative", "float", dtype_name(base.norm.weight.dtype),
                    lambda: mlx_lm_stream(base, draft=draft, gamma=gamma)))
    if not gpu:
        out += [(llama, w, kv, lambda w=w, kv=kv: llama_cpp_stream(weights.files[w], n_ctx, None if kv == "f16"
                                                                   else kv))
                for w, kv in ([("float", "f16"), ("float", "Q8_0")] if long else
                              [("float", "f16"), (q, "f16"), (q, "Q8_0")])]
    return out


def peer_records(experiment: str, weights: Weights, prompts: list[list[int]], n: int, draft: Model | None,
                 gamma: int, reference: list[TokenRun] | None, roof: float, say: Say, long: bool = False) -> list[dict]:
    """Each peer of peer_streams on the prompts, timed as the rungs are, with its agreement and bandwidth share."""
    gpu = mx.default_device() == mx.gpu
    out = []
    for label, w, kv, build in peer_streams(weights, draft, gamma, len(prompts[0]) + n + 8, gpu, long):
        fields = {"model": weights.name, "weights": weights.types[w], "kv": kv, "context": len(prompts[0]) + n,
                  "variant": label.split(" (")[0] + f" {weights.types[w]} kv {kv}", "peer": label}
        say(f"{experiment}: {fields['variant']}")

        def measure(build=build, fields=fields, w=w):
            runs, peak = timed(build(), prompts, n)
            step = decode_bytes(weights.model(w, False), len(prompts[0]) + n // 2)
            return run_records(experiment, runs, reference, len(prompts[0]), fields, None, (), step, roof)
        out += guarded(experiment, fields, measure)
    return out


def long_records(plan: CapstonePlan, weights: Weights, prompt: list[int], peers: bool, roof: float,
                 say: Say) -> list[dict]:
    """The cache rungs (float, plan.kv, plan.fused_kv fused, 4-bit affine fused) and the peers' caches after
    a prompt of plan.long_context tokens, two timed runs each: speed and memory only."""
    model = weights.model("float", False)
    trained = model.args
    model.args = dataclasses.replace(trained, max_position_embeddings=len(prompt) + plan.long_tokens + 8)
    out = []
    for name, t in (("float", Techniques()), (f"kv {plan.kv}", Techniques(kv=plan.kv)),
                    (f"kv {plan.fused_kv} fused", Techniques(kv=plan.fused_kv, fused=True)),
                    ("kv affine4-g64 fused", Techniques(kv="affine4-g64", fused=True))):
        say(f"capstone-long: {name} after {len(prompt)} tokens")
        fields = fields_of(Rung(name, None, "float", False, t), weights, model, len(prompt))

        def measure(t=t, fields=fields):
            runs, peak = timed(token_stream(model, t, None, []), [prompt, prompt], plan.long_tokens)
            return run_records("capstone-long", runs, None, len(prompt), fields, peak, (),
                               decode_bytes(model, len(prompt)), roof)
        out += guarded("capstone-long", fields, measure, (ValueError,), "skipped")
    model.args = trained          # the model stays loaded: later rungs and the perplexity see its own context
    if peers:
        out += peer_records("capstone-long", weights, [prompt, prompt], plan.long_tokens, None, 0, None, roof, say,
                            long=True)
    return out


def perplexity_records(plan: CapstonePlan, weights: Weights, tokenizer: Tokenizer, say: Say) -> list[dict]:
    """Held-out perplexity per weights and cache of the rungs: the quality each costs (the loop's other
    switches keep the model's distribution). The weights are scored in float32 whatever format the rungs run
    them in (MLX's quantized matmul on a CPU takes ~50 minutes for the whole held-out text)."""
    stream, fingerprint = heldout_stream(tokenizer)
    out = []
    for w in ("float", QUANTIZED):
        with gguf.read(weights.files[w]) as f:   # the file's exact weights in float32, at the context it was trained
            model = load_model(f, mx.float32)    # for, as bench --quant scores them
            trained = ModelArgs.from_gguf(f.metadata, f.tensors).max_position_embeddings
        for kv, fused in ((FLOAT, False), (plan.kv, False), (plan.fused_kv, True)):
            say(f"capstone-ppl: {weights.types[w]} weights, kv {kv}")
            context = plan.ppl_context or trained
            fields = {"model": weights.name, "weights": weights.types[w], "context": context, "fused": fused,
                      "kv": dtype_name(model.norm.weight.dtype) if kv == FLOAT else kv}

            def measure(model=model, kv=kv, fused=fused, fields=fields, context=context):
                losses = heldout_losses(model, stream, plan.ppl_tokens, context, kv, fused=fused)
                return [record("capstone-ppl", "heldout_perplexity", "ppl", perplexity(losses), **fields,
                               tokens=len(losses) * context, corpus_sha256=fingerprint)]
            out += guarded("capstone-ppl", fields, measure, (ValueError,), "skipped")
    return out


def bench_capstone(model_path: str | Path, draft_path: str | Path | None, heads_path: str | Path | None,
                   work: Path, plan: CapstonePlan | None = None, shape: str | None = None, peers: bool = True,
                   llama_bench: Path | None = None, seed: int = 0, progress: Say | None = None) -> list[dict]:
    """Records "capstone" (every rung and peer on the prompts), "capstone-long" (the cache rungs and the
    peers' caches after plan.long_context tokens), "capstone-ppl" (held-out perplexity per weights and cache;
    not for a --shape) and "roofs" (`decode.roofs`: the bandwidth the shares divide by; not for a perplexity
    alone), each for the plan's parts. A --shape run decodes random prompts on random weights of that shape
    (F16 and Q4_K_M files written to work), with llama-bench as llama.cpp's peer when given."""
    gpu = mx.default_device() == mx.gpu
    plan = plan or CapstonePlan.for_device(gpu)
    say = progress or (lambda msg: None)
    work.mkdir(parents=True, exist_ok=True)
    rows = tuple(sorted({1, *(g + 1 for g in (plan.gamma, plan.mtp_gamma) if g + 1 <= kernels.MAX_ROWS)}))
    out = roofs(plan.bandwidth_bytes) if plan.parts - {"ppl"} else []   # a perplexity alone times nothing
    roof = fastest_bandwidth(out) if out else 0.0
    rng = np.random.default_rng(seed)
    if shape:
        args = args_for(shape, max(plan.long_context, plan.prompt_len + plan.gen_tokens) + plan.long_tokens + 8)
        files = {w: write_random_model(work / f"{shape}-{t}.gguf", args, t, seed)
                 for w, t in (("float", "F16"), (QUANTIZED, QUANTIZED))}
        weights = Weights(shape, files, {"float": "F16", QUANTIZED: QUANTIZED}, rows)
        tokenizer, draft, heads = None, None, None
        prompts = [[1, *rng.integers(1, args.vocab_size, plan.prompt_len - 1).tolist()] for _ in range(plan.prompts)]
        long_prompt = ([1, *rng.integers(1, args.vocab_size, plan.long_context - 1).tolist()]
                       if plan.long_context else None)
    else:
        model_path = Path(model_path)
        q = work / f"{model_path.stem}-{QUANTIZED}.gguf"
        quantize_file(model_path, q, QUANTIZED)
        with gguf.read(model_path) as f:
            tokenizer = Tokenizer.from_gguf_metadata(f.metadata)
            float_type = f.tensors["blk.0.attn_q.weight"].type.name
        weights = Weights(model_path.stem, {"float": model_path, QUANTIZED: q},
                          {"float": float_type, QUANTIZED: QUANTIZED}, rows)
        draft = load(draft_path)[0] if draft_path else None
        heads = load_heads(heads_path, weights.model("float", False)) if heads_path else None
        prompts, _ = heldout_prompts(tokenizer, plan.prompts, plan.prompt_len)
        long_prompt, _ = heldout_prompts(tokenizer, 1, plan.long_context) if plan.long_context else (None, None)
        long_prompt = long_prompt[0] if long_prompt else None
    if "ladder" in plan.parts:
        records, reference = ladder_records(plan, weights, prompts, draft, heads, gpu, roof, say)
        out += records
    if "ladder" in plan.parts and peers:
        out += peer_records("capstone", weights, prompts, plan.gen_tokens, draft, plan.gamma, reference, roof, say)
        if llama_bench is not None:
            for w, path in weights.files.items():
                out += llama_bench_records(llama_bench, path, {"experiment": "capstone", "model": weights.name,
                                                               "weights": weights.types[w]},
                                           plan.prompt_len, plan.gen_tokens, 3)
    if long_prompt:
        out += long_records(plan, weights, long_prompt, peers, roof, say)
    if "ppl" in plan.parts and tokenizer is not None:
        out += perplexity_records(plan, weights, tokenizer, say)
    del weights
    gc.collect()
    return out


# ---- reading a run back -------------------------------------------------------------------------------

ROW_FIELDS = ("variant", "peer", "weights", "kv", "context", "ladder", "native", "kernels", "fused", "speculate",
              "gamma", "pipeline", "compiled", "techniques")


def table(records: Sequence[dict]) -> list[dict]:
    """One row per rung or peer of one run's records (one experiment): its fields (ROW_FIELDS) and each metric's
    value by name; a refused rung or a failed peer keeps its note. Rungs in the order they were recorded.
    peak_scope says what a peak_memory covers: "rung" (its own model) or "run" (recorded before the bench kept
    one model resident: every model loaded before the rung too)."""
    rows: dict[tuple, dict] = {}
    for r in records:
        row = rows.setdefault((r["variant"], r.get("peer"), r["weights"], r["kv"]),
                              {k: r.get(k) for k in ROW_FIELDS})
        row[r["metric"]] = r["value"]
        if r["metric"] == "peak_memory":
            row["peak_scope"] = r.get("resident", "run")
        if r["metric"] in ("skipped", "peer_error"):
            row["note"] = r.get("note")
    return list(rows.values())


# ---- showing a run ------------------------------------------------------------------------------------

LOOPS = {"plain": "plain (synchronous loop)", "+pipeline": "+pipeline (pipelined loop)"}   # the ladder's two loops
METRICS = (   # (metric, column header, format, scale to the header's unit, what the column means)
    ("tokens_per_s", "decode (tok/s)", ",.1f", 1, "tokens per second after the first, median over the prompts"),
    ("ttft_ms", "TTFT (ms)", ",.1f", 1, "time to first token (the prompt's prefill and one step), median over the prompts"),
    ("itl_p50_ms", "ITL p50 (ms)", ",.2f", 1, "inter-token latency, the median gap between two tokens; a speculative "
     "rung emits a verification's tokens together, so its median gap is near 0"),
    ("itl_p99_ms", "ITL p99 (ms)", ",.1f", 1, "the 99th percentile of the same gaps: for a speculative rung, one whole "
     "draft-and-verify step"),
    ("peak_memory", "peak memory (MB)", ",.1f", 1e-6, "MLX's peak memory while it decoded: weights, cache, work arrays"),
    ("greedy_agreement", "agreement (%)", ",.1f", 100, "the share of generated positions whose token is the plain "
     "rung's, mean over the prompts; decoding is greedy, so after the first token that differs the two texts part: a "
     "low share says how early a text departs, not how far"),
    ("alpha", "acceptance (%)", ",.1f", 100, "the share of drafted tokens the model accepted"),
    ("bandwidth_fraction", "bandwidth (%)", ",.2f", 100, ""),   # its note names the run's measured bandwidth
)
KV_NAMES = {"f32": "float32", "f16": "float16", "sym8": "8-bit symmetric, dequantized for attention",
            "affine8-g64": "8-bit affine in groups of 64 (a fused rung's attention reads the codes)",
            "affine4-g64": "4-bit affine in groups of 64", "Q8_0": "llama.cpp's 8-bit blocks of 32"}


def row_name(row: dict) -> str:
    """A row as a table names it: the peer that ran it, or the rung (the ladder's first two name their loop)."""
    return row["peer"] or LOOPS.get(row["variant"], row["variant"])


def rung_table(rows: Sequence[dict], run: Run, caption: str, first: str = "rung",
               leave_out: Sequence[str] = ()) -> viz.Table:
    """Rows of `table` (one run's rungs or peers) as a table: a column per metric that some row has, in the
    header's unit, with what it means under the table; the bandwidth column's note names the measured
    bandwidth of the run it divides by (`records.bandwidth`). A rung the machine refused, or a peer that
    failed, reads "not measured" (`not_measured` says why)."""
    gbs, roofs_run = bandwidth(run)
    where = "this run's" if roofs_run.file == run.file else f"results/{roofs_run.file}'s"
    shown = [m for m in METRICS if m[0] not in leave_out and any(r.get(m[0]) is not None for r in rows)]
    scopes = {r.get("peak_scope") for r in rows if r.get("peak_memory") is not None}
    ladder = any(r.get("ladder") is not None for r in rows)
    columns = [viz.Column(first, note="the ladder's rungs (+) each add one switch to the rung above; the others "
                                      "turn one on over the pipelined float rung" if ladder else ""),
               viz.Column("weights", note="F32 or F16 is the float file, Q4_K_M its 4-bit K-quants"),
               viz.Column("KV cache", note="; ".join(f"{kv}: {KV_NAMES[kv]}" for kv in
                                                     dict.fromkeys(r["kv"] for r in rows) if kv in KV_NAMES))]
    for metric, header, fmt, _, note in shown:
        if metric == "bandwidth_fraction":
            note = (f"decode tok/s times the bytes one plain step reads, over the measured bandwidth, {gbs:,.1f} GB/s "
                    f"({where} fastest memory probe); a speculative rung's share is an effective one")
        if metric == "peak_memory" and "run" in scopes:
            note += ("; this run kept every model it had loaded in memory, so each peak covers them too, not the "
                     "rung's alone" if scopes == {"run"} else "; *: recorded while the run kept every model it had "
                     "loaded in memory, so the peak covers them too, not the rung's alone")
        columns.append(viz.Column(header, fmt, note))
    body = []
    for r in rows:
        values = []
        for metric, _, fmt, scale, _ in shown:
            v = r.get(metric)
            v = None if v is None else v * scale
            if metric == "peak_memory" and v is not None and len(scopes) > 1 and r.get("peak_scope") == "run":
                v = f"{v:{fmt}}*"
            values.append(v)
        if r.get("note") and values:
            values[0] = "not measured"
        body.append([row_name(r), r["weights"] or "–", r["kv"] or "–", *values])
    return viz.table(columns, body, caption)


def not_measured(rows: Sequence[dict]) -> list[str]:
    """One line per row of `rung_table` that reads "not measured": the rung or peer, and the error's first clause."""
    out = []
    for r in rows:
        if r.get("note"):
            message = r["note"].partition(": ")[2] or r["note"]      # without the error's class
            name = f"{row_name(r)}, kv {r['kv']}" if r["peer"] else row_name(r)
            out.append(f"{name}: not measured: {message.split(': ')[0]}")
    return out
