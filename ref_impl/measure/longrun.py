"""Long prompts and long answers: what a prompt's length costs before the first token, and whether a long
answer slows down as it grows.

`bench --long` measures, on a random-weight model with Llama 3's vocabulary (the shape "random-34m":
128,256 tokens, 137 MB of float32 weights, written as an F32 GGUF with llama.cpp's Llama 3 tokenizer test
vocabulary, so every peer runs the same file and text can stream) and on the shipped model:

* per prompt length (512, 2,048, 8,192 tokens; a model whose context is shorter, at its longest prompt
  instead): the time to the first token (TTFT: prefill and one sample), prefill tokens/s, and MLX's peak memory, for our decoder with the
  prompt in chunks of generate.PREFILL_CHUNK and in one pass, mlx-lm (its own chunked prefill) and
  llama.cpp on the same file (TTFT only: its memory is not MLX's to count). Each peak is also given as
  what it holds beyond the weights and the KV cache, the work arrays of a prefill;
* the prefill chunk swept at the longest prompt: TTFT and that peak per chunk, the evidence for the
  default;
* a 4,000-token answer streamed as text (compose.generate with the tokenizer): the inter-token latency of
  its first 500 tokens against its last 500.

Prompts are random token ids from a fixed seed; decoding is greedy with end-of-sequence ignored; each TTFT
is the median of `repeats` runs after a warm-up run.

    python -m ref_impl bench --long --label cpu-2core

See chapter: dispatch-long-prompts
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

import ref_impl
from ref_impl.engine.compose import Techniques, generate
from ref_impl.engine.generate import PREFILL_CHUNK, Sampler, generate_step
from ref_impl.engine.model import Model
from ref_impl.engine.random import args_for, write_random_model
from ref_impl.formats import gguf
from ref_impl.kernels import loading
from ref_impl.measure.peers import llama_cpp_available, llama_cpp_stream, mlx_lm_stream
from ref_impl.measure.records import dtype_name, record
from ref_impl.platform.machine import package_version
from ref_impl.platform.timing import clock, median

EXPERIMENT, ANSWER = "long-prompt", "long-answer"
SHAPE = "random-34m"                     # theory/shapes.py: Llama 3's vocabulary, 256 wide, 2 layers
LLAMA3_VOCAB = "ggml-vocab-llama-bpe.gguf"
Say = Callable[[str], None]


@dataclass(frozen=True)
class LongPlan:
    """What bench --long measures: prompt lengths, the chunks swept, the long answer and its windows."""
    prompts: tuple[int, ...] = (512, 2048, 8192)             # a model with a shorter context: its longest
    chunk: int = PREFILL_CHUNK                                 # ours, chunked
    chunks: tuple[int, ...] = (128, 256, 512, 1024, 2048)     # and one pass, at the longest prompt
    answer_tokens: int = 4000
    window: int = 500                    # the answer's first and last `window` inter-token latencies
    repeats: int = 3
    seed: int = 0

    @classmethod
    def quick(cls) -> LongPlan:
        """Seconds: two short prompts, two chunks, a 120-token answer."""
        return cls(prompts=(32, 96), chunk=16, chunks=(16, 32), answer_tokens=120, window=40, repeats=1)


def llama3_file(work: Path, context: int, vocab_dir: Path = ref_impl.VOCAB_DIR) -> Path:
    """The random-34m model as an F32 GGUF carrying llama.cpp's Llama 3 vocabulary (its tokenizer test file)."""
    vocab = Path(vocab_dir) / LLAMA3_VOCAB
    if not vocab.is_file():
        raise FileNotFoundError(f"{vocab} is missing: `make lab` (or `make setup`) extracts llama.cpp's tokenizer "
                                "test files into .vocab/")
    with gguf.read(vocab) as f:
        keys = {k: v for k, v in f.metadata.items() if k.startswith("tokenizer.")}
    return write_random_model(work / f"{SHAPE}-llama3-vocab.gguf", args_for(SHAPE, context), "F32", tokenizer=keys)


def resident_bytes(model: Model, cache: list) -> int:
    """Bytes the weights and a KV cache hold: what a prefill cannot do without."""
    return sum(v.nbytes for _, v in tree_flatten(model.parameters())) + sum(c.nbytes for c in cache)


def clean_peak() -> None:
    """Free what earlier runs left and restart MLX's peak-memory counter, so a peak is one run's own."""
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()


def first_token(model: Model, prompt: list[int], chunk: int) -> tuple[float, int, int]:
    """One prefill and first sample into a fresh cache for the prompt and one more position: (seconds,
    MLX's peak memory in bytes, the bytes of the weights and the cache)."""
    cache = model.make_cache(len(prompt) + 1)
    clean_peak()
    start = clock()
    next(generate_step(model, prompt, Sampler(), cache, chunk=chunk))
    return clock() - start, mx.get_peak_memory(), resident_bytes(model, cache)


def first_tokens(model: Model, prompt: list[int], chunks: dict[str, int], repeats: int) -> dict[str, list[tuple]]:
    """first_token per variant (name -> chunk), `repeats` times: a warm-up run of each, then the variants
    interleaved round by round, so a machine's drift falls on each alike."""
    for chunk in chunks.values():
        first_token(model, prompt, chunk)
    runs = {name: [] for name in chunks}
    for _ in range(repeats):
        for name, chunk in chunks.items():
            runs[name].append(first_token(model, prompt, chunk))
    return runs


def prompt_records(model: Model, path: Path, fields: dict, prompts: list[list[int]], plan: LongPlan, peers: bool,
                   say: Say) -> list[dict]:
    """TTFT, prefill tokens/s and peak memory per prompt length: ours chunked and in one pass, and the peers."""
    out, name = [], fields["model"]
    mlx_lm = mlx_lm_stream(model) if peers else None
    for prompt in prompts:
        L = len(prompt)
        say(f"long prompts: {name}, {L} tokens")
        ours = {f"chunk {plan.chunk}": plan.chunk, "one pass": L}
        for (variant, chunk), runs in zip(ours.items(), first_tokens(model, prompt, ours, plan.repeats).values()):
            seconds, peak, held = median([r[0] for r in runs]), max(r[1] for r in runs), runs[0][2]
            out += [record(EXPERIMENT, "ttft_ms", "ms", 1e3 * seconds, context=L, variant=variant, chunk=chunk,
                           samples=[1e3 * r[0] for r in runs], **fields),
                    record(EXPERIMENT, "prefill_tokens_per_s", "tokens/s", L / seconds, context=L, variant=variant,
                           chunk=chunk, **fields),
                    record(EXPERIMENT, "peak_memory", "B", peak, context=L, variant=variant, chunk=chunk,
                           resident_bytes=held, **fields),
                    record(EXPERIMENT, "peak_beyond_resident", "B", peak - held, context=L, variant=variant,
                           chunk=chunk, **fields)]
        if peers:
            out += peer_records(mlx_lm, path, prompt, plan, fields)
    return out


def peer_records(mlx_lm, path: Path, prompt: list[int], plan: LongPlan, fields: dict) -> list[dict]:
    """mlx-lm's TTFT and peak memory, and llama.cpp's TTFT, on one prompt (a warm-up run each first)."""
    L, out = len(prompt), []
    name = f"mlx-lm {package_version('mlx-lm')}"
    for stream, peer in [(mlx_lm, name)] + ([(llama_cpp_stream(path, L + 8), "llama.cpp (llama-cpp-python "
                                              f"{package_version('llama_cpp_python')})")]
                                            if llama_cpp_available() else []):
        seconds, peaks = [], []
        for k in range(plan.repeats + 1):
            clean_peak()
            start = clock()
            next(iter(stream(prompt, 1)))
            if k:                                                                  # the first is the warm-up
                seconds.append(clock() - start)
                peaks.append(mx.get_peak_memory())
        t = median(seconds)
        out += [record(EXPERIMENT, "ttft_ms", "ms", 1e3 * t, context=L, variant="default", peer=peer,
                       samples=[1e3 * s for s in seconds], **fields),
                record(EXPERIMENT, "prefill_tokens_per_s", "tokens/s", L / t, context=L, variant="default", peer=peer,
                       **fields)]
        if peer == name:
            out.append(record(EXPERIMENT, "peak_memory", "B", max(peaks), context=L, variant="default", peer=peer,
                              **fields))
    return out


def chunk_records(model: Model, fields: dict, prompt: list[int], plan: LongPlan, say: Say) -> list[dict]:
    """The chunk swept at one prompt: TTFT and the peak beyond weights and cache per chunk (and one pass)."""
    out, L, name = [], len(prompt), fields["model"]
    fields = {**fields, "context": L}
    say(f"long prompts: {name}, {L} tokens in chunks of {', '.join(map(str, plan.chunks))} and in one pass")
    chunks = {f"chunk {c}": c for c in plan.chunks if c < L} | {"one pass": L}
    for (variant, chunk), runs in zip(chunks.items(), first_tokens(model, prompt, chunks, plan.repeats).values()):
        out += [record(EXPERIMENT + "-chunk", "ttft_ms", "ms", 1e3 * median([r[0] for r in runs]), variant=variant,
                       chunk=chunk, samples=[1e3 * r[0] for r in runs], **fields),
                record(EXPERIMENT + "-chunk", "peak_beyond_resident", "B", max(r[1] for r in runs) - runs[0][2],
                       variant=variant, chunk=chunk, **fields)]
    return out


def answer_records(model: Model, tokenizer, fields: dict, plan: LongPlan, say: Say) -> list[dict]:
    """A long answer streamed as text: the ITL of its first and last `window` tokens, and their ratio."""
    say(f"long answer: {fields['model']}, {plan.answer_tokens} tokens")
    prompt = np.random.default_rng(plan.seed).integers(0, model.args.vocab_size, 16).tolist()
    generate(model, tokenizer, prompt, 2 * plan.window, stop_at_eos=False)                 # warm-up
    g = generate(model, tokenizer, prompt, plan.answer_tokens, stop_at_eos=False, techniques=Techniques())
    itl = g.inter_token_latencies * 1e3
    early, late = float(np.median(itl[:plan.window])), float(np.median(itl[-plan.window:]))
    fields = {**fields, "context": len(prompt) + plan.answer_tokens, "window": plan.window}
    return [record(ANSWER, "itl_early_ms", "ms", early, **fields), record(ANSWER, "itl_late_ms", "ms", late, **fields),
            record(ANSWER, "late_over_early", "x", late / early, **fields),
            record(ANSWER, "text_chars", "chars", len(g.text), **fields)]


def bench_long(shipped: Path, work: Path, plan: LongPlan = LongPlan(), peers: bool = True,
               progress: Say = lambda s: None) -> list[dict]:
    """bench --long's records: long prompts on the random Llama-3-vocabulary model and the shipped model (the
    lengths its context takes; the others a "skipped" record), the chunk sweep, and the long answer."""
    rng = np.random.default_rng(plan.seed)
    context = max(max(plan.prompts) + 8, plan.answer_tokens + 32)
    path = llama3_file(work, context)
    out = []
    for file, name in [(path, f"{SHAPE} (Llama 3 vocabulary)"), (shipped, shipped.stem)]:
        with gguf.read(file) as f:
            loaded = loading.load(f, loading.LoadOptions(weights="float", kernels="off"))
        model = loaded.model
        fields = {"model": name, "weights": loaded.matrix_types, "kv": dtype_name(model.norm.weight.dtype)}
        longest = model.args.max_position_embeddings - 8                 # room for the first token, and more
        fits = sorted({min(L, longest) for L in plan.prompts})
        out += [record(EXPERIMENT, "skipped", None, None, model=name, context=L,
                       note=f"past the model's context of {model.args.max_position_embeddings} positions: measured "
                            f"at {longest} tokens instead") for L in plan.prompts if L > longest]
        prompts = [rng.integers(0, model.args.vocab_size, L).tolist() for L in fits]
        out += prompt_records(model, file, fields, prompts, plan, peers, progress)
        if file == path:
            out += chunk_records(model, fields, prompts[-1], plan, progress)
            out += answer_records(model, loaded.tokenizer, fields, plan, progress)
        del model, loaded
        gc.collect()
    return out
