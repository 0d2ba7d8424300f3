"""Benchmarks: measure the decoder and its peers on this machine, write results/*.json.

Every measured number in the book comes from a file this module writes, one file per machine
and run, in one shape (DESIGN.md, "Measured results"): the machine, the command, and tidy
records {experiment, model, weights, kv, context, metric, unit, value, samples, peer}.

Decode benchmarks follow the usual discipline: a warm-up run first, random prompt tokens from
a fixed seed, greedy sampling, end-of-sequence ignored, every result evaluated before the clock
stops; prefill (TTFT) and decode (tokens/s, inter-token latency) reported separately. Peers run
in the same process on the same weights: mlx-lm (weights converted from the GGUF, same dtype)
and llama.cpp (the same GGUF file, through llama-cpp-python).

    python -m ref_impl bench --model models/stdlib-10m.gguf

See chapter: capstone
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ref_impl.engine.generate import Sampler, decoder, generate_step, prefill
from ref_impl.engine.model import Model, ModelArgs, load_model
from ref_impl.engine.random import random_gguf_model
from ref_impl.formats import gguf
from ref_impl.platform import blas
from ref_impl.platform.machine import package_version


def _time_tokens(tokens: Iterator, n: int) -> tuple[float, list[float], list[int]]:
    """Pull n tokens from a started generator; return (start, per-token timestamps, token ids)."""
    start = time.perf_counter()
    times, ids = [], []
    for _, token in zip(range(n), tokens):
        times.append(time.perf_counter())
        ids.append(int(token))
    return start, times, ids


def _summarize(runs: list[tuple[float, list[float]]], prompt_len: int) -> dict[str, tuple[float, list]]:
    """TTFT, prefill and decode throughput, ITL percentiles over repeated runs (medians of runs)."""
    ttft = [t[0] - s for s, t, _ in runs]
    itl = [np.diff(t) for _, t, _ in runs]
    tps = [len(d) / d.sum() for d in itl]
    all_itl = np.concatenate(itl) * 1e3
    return {
        "tokens_per_s": (float(np.median(tps)), tps),
        "ttft_ms": (float(np.median(ttft)) * 1e3, [x * 1e3 for x in ttft]),
        "prefill_tokens_per_s": (prompt_len / float(np.median(ttft)), [prompt_len / x for x in ttft]),
        "itl_p50_ms": (float(np.percentile(all_itl, 50)), []),
        "itl_p99_ms": (float(np.percentile(all_itl, 99)), []),
    }


def _repeat(make_stream: Callable[[], Iterator], n: int, repeats: int) -> list:
    _time_tokens(make_stream(), n)  # warm-up: kernels compiled, caches allocated, pages touched
    return [_time_tokens(make_stream(), n) for _ in range(repeats)]


def ours(model: Model, prompt: list[int], n: int, repeats: int, pipeline: bool, compiled: bool = False) -> list:
    """Our decoder (compiled: each decode step one mx.compile'd graph)."""

    def stream():
        cache = model.make_cache(len(prompt) + n)
        return generate_step(model, prompt, Sampler(), cache, pipeline=pipeline, compiled=compiled)
    return _repeat(stream, n, repeats)


def mlx_lm_peer(ours_model: Model, prompt: list[int], n: int, repeats: int) -> list:
    """mlx-lm's Llama on the same weights (our model's arrays, under mlx-lm's parameter names)."""
    from mlx_lm.generate import generate_step as mlx_lm_generate_step
    from mlx_lm.models import llama

    a = ours_model.args
    model = llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=a.hidden_size, num_hidden_layers=a.num_hidden_layers,
        intermediate_size=a.intermediate_size, num_attention_heads=a.num_attention_heads,
        num_key_value_heads=a.num_key_value_heads, head_dim=a.head_dim, rms_norm_eps=a.rms_norm_eps,
        vocab_size=a.vocab_size, rope_theta=a.rope_theta, rope_traditional=True,
        max_position_embeddings=a.max_position_embeddings, tie_word_embeddings=a.tie_word_embeddings))
    weights = [(("" if k.startswith("lm_head") else "model.") + k, v)
               for k, v in tree_flatten(ours_model.parameters())]
    model.load_weights(weights)
    mx.eval(model.parameters())

    def stream():
        gen = mlx_lm_generate_step(mx.array(prompt), model, max_tokens=n, sampler=lambda x: mx.argmax(x, axis=-1))
        return (tok for tok, _ in gen)
    return _repeat(stream, n, repeats)


def llama_cpp_peer(path: Path, prompt: list[int], n: int, repeats: int) -> list:
    """llama.cpp on the same GGUF file, through llama-cpp-python, greedy."""
    import llama_cpp

    # n_gpu_layers=-1 offloads every layer when llama.cpp was built with a GPU backend; a CPU build ignores it
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=len(prompt) + n + 8, n_threads=os.cpu_count(),
                          n_batch=max(512, len(prompt)), n_gpu_layers=-1, verbose=False)

    def stream():
        llm.reset()
        return llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, frequency_penalty=0.0,
                            presence_penalty=0.0, reset=True)
    return _repeat(stream, n, repeats)


def llama_cpp_logits(path: Path, ids: Sequence[int]) -> np.ndarray:
    """llama.cpp's logits (len(ids), vocab) for one batch of tokens from an empty context: CPU, one
    thread (its spinning workers slow ~10x when the other core is busy), float32 KV cache."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=len(ids), n_batch=len(ids), logits_all=True,
                          type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32,
                          n_gpu_layers=0, n_threads=1, n_threads_batch=1, verbose=False)
    llm.eval(list(ids))
    return np.array(llm.scores[:len(ids)])


def forward_sweep(model: Model, lengths: Sequence[int], repeats: int = 3, budget_s: float = math.inf,
                  seed: int = 0, offset: int = 0) -> tuple[list[int], list[float]]:
    """Median seconds of one uncached forward over L random tokens, for each L in turn (a warm-up
    pass first), on one BLAS thread so a busy machine gives stable times. Stops before an L whose
    likely cost (twice the last L's, repeats + 1 passes) would overrun budget_s; returns the
    lengths it timed and their seconds. The flat-then-linear curve of chapter 0. With offset > 0
    each forward continues after `offset` cached random tokens (a decode or speculative verify
    step at that context) and the cache is trimmed back after it."""
    tokens = mx.array(np.random.default_rng(seed).integers(0, model.args.vocab_size, (1, offset + max(lengths))))
    cache = model.make_cache(offset + max(lengths)) if offset else None
    if cache:
        mx.eval(model(tokens[:, :offset], cache))

    def forward(L: int) -> None:
        mx.eval(model(tokens[:, offset:offset + L], cache))
        for layer_cache in cache or ():
            layer_cache.trim(L)

    timed, seconds, start = [], [], time.perf_counter()
    with blas.one_blas_thread():
        for L in lengths:
            if seconds and time.perf_counter() - start + 2 * (repeats + 1) * seconds[-1] > budget_s:
                break
            forward(L)                                       # warm-up
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                forward(L)
                times.append(time.perf_counter() - t0)
            timed.append(L)
            seconds.append(float(np.median(times)))
    return timed, seconds


def bench_decode(path: Path, prompt_len: int = 128, gen_tokens: int = 128, repeats: int = 3,
                 peers: bool = True, seed: int = 0) -> list[dict]:
    """Decode records for our decoder (sync and pipelined) and, if asked, mlx-lm and llama.cpp."""
    if prompt_len < 1 or gen_tokens < 2 or repeats < 1:
        raise ValueError(f"bench needs prompt_len >= 1, gen_tokens >= 2 (a decode speed takes two "
                         f"token times) and repeats >= 1; got {prompt_len}, {gen_tokens}, {repeats}")
    with gguf.read(path) as f:
        context = ModelArgs.from_gguf(f.metadata, f.tensors).max_position_embeddings  # a llama file, or a clear error
        if prompt_len + gen_tokens > context:
            raise ValueError(f"prompt_len {prompt_len} + gen_tokens {gen_tokens} exceeds the model's "
                             f"context length ({context})")
        weights = f.tensors.get("blk.0.attn_q.weight", f.tensors["token_embd.weight"]).type.name
        name = f.metadata.get("general.name", path.stem)
        model = load_model(f, mx.float32)
    prompt = np.random.default_rng(seed).integers(1, model.args.vocab_size, size=prompt_len).tolist()
    runs = {("ours", "sync"): ours(model, prompt, gen_tokens, repeats, pipeline=False),
            ("ours", "async_eval"): ours(model, prompt, gen_tokens, repeats, pipeline=True)}
    if peers:
        runs[("mlx-lm " + package_version("mlx-lm"), "default")] = mlx_lm_peer(model, prompt, gen_tokens, repeats)
        runs[("llama.cpp (llama-cpp-python " + package_version("llama_cpp_python") + ")", "default")] = \
            llama_cpp_peer(path, prompt, gen_tokens, repeats)
    units = {"tokens_per_s": "tok/s", "prefill_tokens_per_s": "tok/s", "greedy_agreement": "fraction"}
    reference = runs[("ours", "sync")][0][2]
    records = []
    for (engine, variant), r in runs.items():
        metrics = _summarize(r, prompt_len)
        # the same weights must give the same greedy tokens: the share of positions that match ours
        metrics["greedy_agreement"] = (float(np.mean(np.array(r[0][2]) == np.array(reference))), [])
        for metric, (value, samples) in metrics.items():
            records.append({"experiment": "decode", "model": name, "weights": weights,
                            "kv": "f32", "context": prompt_len + gen_tokens, "variant": variant,
                            "metric": metric, "unit": units.get(metric, "ms"), "value": value,
                            "samples": samples, "peer": None if engine == "ours" else engine})
    return records


QUANT_TYPES = ("F32", "F16", "Q8_0", "Q6_K", "Q4_K_M", "Q4_K", "Q4_0")


def bench_quant(path: Path, work_dir: Path, file_types: Sequence[str] = QUANT_TYPES, ppl_tokens: int = 16384,
                prompt_len: int = 128, gen_tokens: int = 128, repeats: int = 3, peers: bool = True,
                seed: int = 0) -> list[dict]:
    """Per llama.cpp file type of a float model, quantized by us into work_dir: tensor bytes, bits per
    weight, held-out perplexity (ppl_tokens tokens of the files the model never trained on, the
    same tokens for every type; 0 skips it) and decode speed with the weights MLX-quantized
    ("native") and expanded to floats ("dequantized"), and llama.cpp on the same file."""
    from ref_impl.engine import transcode
    from ref_impl.engine.tokenizer import Tokenizer
    from ref_impl.formats.quantize import quantize_file

    work_dir.mkdir(parents=True, exist_ok=True)
    with gguf.read(path) as f:
        tokenizer = Tokenizer.from_gguf_metadata(f.metadata)
        name = f.metadata.get("general.name", path.stem)
        context = ModelArgs.from_gguf(f.metadata, f.tensors).max_position_embeddings
    if ppl_tokens:
        from ref_impl.training.train import heldout_stream, mean_loss
        stream, fingerprint = heldout_stream(tokenizer)
    prompt = np.random.default_rng(seed).integers(1, tokenizer.vocab_size, size=prompt_len).tolist()
    records = []

    def record(ft, metric, unit, value, samples=(), variant=None, peer=None, **extra):
        records.append({"experiment": "quant", "model": name, "weights": ft, "kv": "f32" if peer is None else None,
                        "context": prompt_len + gen_tokens, "variant": variant, "metric": metric,
                        "unit": unit, "value": value, "samples": list(samples), "peer": peer, **extra})

    for ft in file_types:
        qpath = work_dir / f"{path.stem}-{ft}.gguf"
        types = quantize_file(path, qpath, ft)
        with gguf.read(qpath) as f:
            nbytes = sum(t.nbytes for t in f.tensors.values())
            weights = sum(int(np.prod(t.shape)) for t in f.tensors.values())
            mix = {t: sum(v == t for v in types.values()) for t in sorted(set(types.values()))}
            record(ft, "tensor_bytes", "B", nbytes, mix=mix)
            record(ft, "file_bytes", "B", qpath.stat().st_size)
            record(ft, "bits_per_weight", "bits", 8 * nbytes / weights)
            if ppl_tokens:
                with blas.one_blas_thread():   # the file's exact weights, in float32
                    loss = mean_loss(load_model(f, mx.float32), stream, context, ppl_tokens, spread=True)
                record(ft, "heldout_perplexity", "ppl", math.exp(loss), tokens=ppl_tokens // context * context,
                       corpus_sha256=fingerprint)
            models = {"dequantized": load_model(f, None), "native": transcode.load_model(f, None)}
        for variant, model in models.items():
            runs = ours(model, prompt, gen_tokens, repeats, pipeline=True)
            tps = _summarize(runs, prompt_len)["tokens_per_s"]
            record(ft, "tokens_per_s", "tok/s", tps[0], tps[1], variant=variant,
                   dtype=str(model.norm.weight.dtype).split(".")[-1])
        del models
        if peers:
            runs = llama_cpp_peer(qpath, prompt, gen_tokens, repeats)
            tps = _summarize(runs, prompt_len)["tokens_per_s"]
            record(ft, "tokens_per_s", "tok/s", tps[0], tps[1],
                   peer="llama.cpp (llama-cpp-python " + package_version("llama_cpp_python") + ")")
    return records


def bench_quant_groups(path: Path, type_name: str = "Q4_K", ppl_tokens: int = 16384) -> list[dict]:
    """Held-out perplexity of the float model at `path` with one group of its matrices rounded through
    `type_name` (quantize.MATRIX_GROUPS, then every matrix; the rest float32), and each group's float32
    bytes: which layers mind the rounding, per weight. The same tokens for every group."""
    from ref_impl.engine.tokenizer import Tokenizer
    from ref_impl.formats.quantize import MATRIX_GROUPS, simulate, tensor_kind
    from ref_impl.training.train import heldout_stream, window_losses

    with gguf.read(path) as f:
        tokenizer = Tokenizer.from_gguf_metadata(f.metadata)
        name = f.metadata.get("general.name", path.stem)
        context = ModelArgs.from_gguf(f.metadata, f.tensors).max_position_embeddings
        matrices = {n: t.nbytes for n, t in f.tensors.items() if len(t.shape) == 2}
    stream, fingerprint = heldout_stream(tokenizer)
    groups = {"none (float32)": (), **MATRIX_GROUPS, "every matrix": tuple({tensor_kind(n) for n in matrices})}
    records = []
    for group, kinds in groups.items():
        model = simulate(path, type_name, lambda n: tensor_kind(n) in kinds)
        with blas.one_blas_thread():
            losses = window_losses(model, stream, context, ppl_tokens, spread=True)
        common = {"experiment": "quant-groups", "model": name, "weights": type_name, "kv": "f32", "context": context,
                  "variant": group, "peer": None}
        records.append({**common, "metric": "heldout_perplexity", "unit": "ppl", "value": math.exp(losses.mean()),
                        "samples": [], "tokens": len(losses) * context, "corpus_sha256": fingerprint})
        records.append({**common, "metric": "window_loss", "unit": "nats", "value": float(losses.mean()),
                        "samples": losses.tolist()})      # per window, the same windows for every group
        records.append({**common, "metric": "matrix_bytes", "unit": "B", "samples": [],
                        "value": sum(b for n, b in matrices.items() if tensor_kind(n) in kinds)})
    return records


def memory_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> dict[str, float]:
    """MLX's own memory bandwidth on the default device, in GB/s: a copy (x + 1: reads and writes every
    byte once, as STREAM's Copy) and a read (a sum). The roof a decode step's weight reads run against."""
    x = mx.ones((nbytes // 4,), dtype=mx.float32)
    mx.eval(x)
    out = {}
    for kind, op, moved in (("copy", lambda: x + 1, 2 * nbytes), ("read", lambda: x.sum(), nbytes)):
        mx.eval(op())
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            mx.eval(op())
            times.append(time.perf_counter() - t0)
        out[kind] = moved / min(times) / 1e9
    return out


def decode_bytes(model: Model, context: int) -> int:
    """Bytes one decode step reads: every parameter except the embedding table (one row of it is read,
    unless it doubles as the output matrix), plus the KV cache at this context."""
    a = model.args
    params = dict(tree_flatten(model.parameters()))
    nbytes = sum(v.nbytes for k, v in params.items() if a.tie_word_embeddings or not k.startswith("embed_tokens"))
    return nbytes + 2 * a.num_hidden_layers * a.num_key_value_heads * a.head_dim * context * params["norm.weight"].itemsize


def bandwidth_records(bw: dict[str, float]) -> list[dict]:
    """memory_bandwidth's result as records (experiment "bandwidth"), the roof the decode records divide by."""
    return [{"experiment": "bandwidth", "model": None, "weights": None, "kv": None, "context": None,
             "variant": kind, "metric": "bandwidth", "unit": "GB/s", "value": v, "samples": [], "peer": None}
            for kind, v in bw.items()]


def llama_bench(binary: Path, path: Path, prompt_len: int, gen_tokens: int, repeats: int, timeout_s: float = 600
                ) -> dict:
    """llama.cpp's own benchmark on the GGUF at path: every layer on the GPU, flash attention, gen_tokens
    decoded after prompt_len tokens of context (-d), repeats runs; its JSON row (avg_ts, samples_ts, build_commit,
    gpu_info, model_size, ...). Raises RuntimeError with llama-bench's own message when it fails."""
    cmd = [str(binary), "-m", str(path), "-p", "0", "-n", str(gen_tokens), "-d", str(prompt_len), "-ngl", "99",
           "-fa", "on", "-r", str(repeats), "-o", "json"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"llama-bench did not run: {e}") from e
    if out.returncode != 0:
        raise RuntimeError(f"llama-bench exited with {out.returncode}: {out.stderr.strip()[-1500:]}")
    try:
        rows = [r for r in json.loads(out.stdout) if r.get("n_gen") == gen_tokens]
    except json.JSONDecodeError as e:
        raise RuntimeError(f"llama-bench printed no JSON ({e}): {out.stdout[:300]!r}") from e
    if not rows:
        raise RuntimeError(f"llama-bench reported no decode of {gen_tokens} tokens: {out.stdout[:300]!r}")
    return rows[0]


def llama_bench_records(binary: Path, path: Path, base: dict, prompt_len: int, gen_tokens: int,
                        repeats: int) -> list[dict]:
    """Results records of llama_bench on path (tokens/s and the model's bytes), or one "peer_error" record
    that keeps its message: a failing peer must not cost the rest of a GPU run."""
    try:
        row = llama_bench(binary, path, prompt_len, gen_tokens, repeats)
    except RuntimeError as e:
        return [{**base, "variant": "llama.cpp", "metric": "peer_error", "unit": None, "value": None, "samples": [],
                 "peer": "llama.cpp (llama-bench)", "note": str(e)}]
    # a build from a source archive (e.g. llama-cpp-python's vendored copy) knows no commit: say nothing
    commit = row.get("build_commit") if row.get("build_commit") not in (None, "", "unknown") else None
    peer = f"llama.cpp{f' {commit}' if commit else ''} (llama-bench, {row.get('backends', '?')})"
    note = f"{row.get('gpu_info', '')}; -d {prompt_len} -n {gen_tokens} -ngl 99 -fa on"
    return [{**base, "variant": "llama.cpp", "metric": "tokens_per_s", "unit": "tok/s", "value": float(row["avg_ts"]),
             "samples": [float(v) for v in row.get("samples_ts", [])], "peer": peer, "note": note},
            {**base, "variant": "llama.cpp", "metric": "model_bytes", "unit": "B", "value": int(row["model_size"]),
             "samples": [], "peer": peer, "note": "llama.cpp's model_size: the file's tensor bytes"}]


def bench_shape(shape: str, args: ModelArgs, weight_types: Sequence[str], work_dir: Path, prompt_len: int = 128,
                gen_tokens: int = 128, repeats: int = 3, seed: int = 0) -> list[dict]:
    """Decode speed of a random-weight model of a public model's shape (speed does not depend on the
    values), per weight type, native MLX quantization, with the share of measured bandwidth it reaches."""
    work_dir.mkdir(parents=True, exist_ok=True)
    bw = memory_bandwidth()
    records = bandwidth_records(bw)
    prompt = np.random.default_rng(seed).integers(1, args.vocab_size, size=prompt_len).tolist()
    for wt in weight_types:
        model, bits_per_weight = random_gguf_model(shape, args, wt, work_dir, seed)
        step_bytes = decode_bytes(model, prompt_len + gen_tokens // 2)
        tps = _summarize(ours(model, prompt, gen_tokens, repeats, pipeline=True), prompt_len)["tokens_per_s"]
        base = {"experiment": "decode-shape", "model": shape, "weights": wt, "kv": str(model.norm.weight.dtype).split(".")[-1],
                "context": prompt_len + gen_tokens, "variant": "native", "peer": None}
        records += [{**base, "metric": "bits_per_weight", "unit": "bits", "value": bits_per_weight, "samples": []},
                    {**base, "metric": "bytes_per_token", "unit": "B", "value": step_bytes, "samples": []},
                    {**base, "metric": "tokens_per_s", "unit": "tok/s", "value": tps[0], "samples": tps[1]},
                    {**base, "metric": "bandwidth_fraction", "unit": "fraction",
                     "value": step_bytes * tps[0] / 1e9 / max(bw.values()), "samples": []}]
        del model
    return records


def _host_split(model: Model, prompt: list[int], steps: int = 16, compiled: bool = False) -> dict[str, float]:
    """Median seconds of one greedy decode step, the GPU idle at its start: building the graph in Python
    ("build"; compiled: replaying the traced graph), mx.async_eval returning ("submit": MLX encodes every
    kernel on this thread) and waiting for the token ("wait"). Pipelined decode overlaps build + submit of
    step t+1 with the GPU's step t, so a step costs about max(build + submit, GPU)."""
    cache = model.make_cache(len(prompt) + steps + 3)
    step = decoder(model, cache, compiled)
    y = mx.argmax(prefill(model, mx.array([prompt]), cache), axis=-1)
    y = mx.argmax(step(y), axis=-1)       # compiled: the trace, outside the timing
    mx.eval(y)
    parts = {"build": [], "submit": [], "wait": []}
    for _ in range(steps):
        t0 = time.perf_counter()
        y = mx.argmax(step(y), axis=-1)
        t1 = time.perf_counter()
        mx.async_eval(y)
        t2 = time.perf_counter()
        mx.eval(y)
        t3 = time.perf_counter()
        for k, v in zip(parts, (t1 - t0, t2 - t1, t3 - t2)):
            parts[k].append(v)
    return {k: float(np.median(v)) for k, v in parts.items()}


def _matrix_chain(model: Model, tokens: int = 32) -> float:
    """Seconds per token of only the decoder's matrix work, in its order and with its dependencies, pipelined
    as decode is: per layer q/k/v projections, o_proj on q, the MLP (as the layer runs it) on that, then the
    LM head; no norms, RoPE, attention or residuals. Values overflow to inf: speed does not depend on them."""
    h = mx.full((1, 1, model.args.hidden_size), 0.01, dtype=model.norm.weight.dtype)

    def step(h: mx.array) -> tuple[mx.array, list[mx.array]]:
        outs = []
        for layer in model.layers:
            attn = layer.self_attn
            q = attn.q_proj(h)
            outs += [attn.k_proj(h), attn.v_proj(h)]
            h = layer.mlp(attn.o_proj(q))
        return h, outs + [model.logits(h)]

    h1, outs = step(h)
    mx.eval(h1, outs)
    t0, prev = time.perf_counter(), None
    for _ in range(tokens):
        h, outs = step(h)
        mx.async_eval(h, outs)
        if prev is not None:
            mx.eval(prev)
        prev = outs[-1]
    mx.eval(h, outs)
    return (time.perf_counter() - t0) / tokens


class _Const:
    """Stands in for a module in timing variants: returns zeros of the module's output width (one array made
    once for a decode step's single row), so the rest of the step runs without it."""

    def __init__(self, n: int, dtype: mx.Dtype):
        self.n, self.dtype, self.y = n, dtype, mx.zeros((1, 1, n), dtype=dtype)
        mx.eval(self.y)

    def __call__(self, x: mx.array, *args, **kwargs) -> mx.array:
        return self.y if x.shape[:-1] == (1, 1) else mx.zeros((*x.shape[:-1], self.n), dtype=self.dtype)


def _decode_without(model: Model, prompt: list[int], attention: bool, n: int = 64) -> tuple[float, int]:
    """Seconds per token and kernels per token of pipelined decode with every matrix (and with attention=True
    every layer's attention) replaced by a constant: what the rest of the step costs. The model is restored."""
    import mlx.nn as nn

    from ref_impl import kernels

    targets = [(name, m) for name, m in model.named_modules()
               if isinstance(m, (nn.Linear, nn.QuantizedLinear, kernels.GEMVLinear))]
    layers = [(f"layers.{i}.self_attn", layer.self_attn) for i, layer in enumerate(model.layers)] if attention else []
    targets = [(k, m) for k, m in targets if not (attention and ".self_attn." in k)] + layers
    dtype = model.norm.weight.dtype
    stubs = []
    for name, m in targets:
        width = model.args.hidden_size if name.endswith("self_attn") else (
            m.shape[0] if isinstance(m, kernels.GEMVLinear) else m.weight.shape[0])
        stubs.append((name, _Const(width, dtype)))
    def swap(name: str, new: object) -> None:      # a plain item swap: a _Const is not an nn.Module
        *path, leaf = name.split(".")
        owner = model
        for p in path:
            owner = owner[int(p)] if p.isdigit() else owner[p]
        owner[leaf] = new

    try:
        for name, stub in stubs:
            swap(name, stub)
        runs = ours(model, prompt, n, 1, pipeline=True)
        return 1 / _summarize(runs, len(prompt))["tokens_per_s"][0], kernels.count_kernels(model)
    finally:
        for name, m in targets:
            swap(name, m)


def _queued_ms(choices: list, variant: str) -> dict[str, float]:
    """Milliseconds per token of the GEMVs run back to back (patch's queued timings, one row), per matrix
    shape, for MLX's built-ins (native), the chosen launches (kernels) or those with the fused groups."""
    from ref_impl import kernels

    out = {}
    single = {(c.n, c.k): c for c in choices if c.rows == 1 and not c.fuse}
    fused = {c.fuse: c for c in choices if c.rows == 1 and c.fuse}
    for (n, k), c in single.items():
        label = kernels.BUILTIN if variant == "native" or c.launch is None else c.launch.label
        out[f"{n}x{k}"] = c.seconds.get(label, math.nan) * c.layers * 1e3
    if variant == "kernels+fused":
        for fuse, c in fused.items():
            if c.launch is None:
                continue
            shapes = [(p, c.k) for p in c.parts] if fuse == "qkv" else [(c.n, c.k), (c.n, c.k)]
            for shape, count in {s: shapes.count(s) for s in shapes}.items():   # the GEMVs the group replaces
                key = f"{shape[0]}x{shape[1]}"
                out[key] -= single[shape].seconds.get(single[shape].launch.label if single[shape].launch
                                                      else kernels.BUILTIN, math.nan) * count * c.layers * 1e3
            out[f"{fuse} {c.n}x{c.k}"] = c.seconds.get(c.launch.label, math.nan) * c.layers * 1e3
    return out


# MLX's built-ins, our GEMVs where faster, with the fused gate/up and q/k/v kernels; "+compiled": each decode
# step one mx.compile'd graph (generate.compiled_decoder)
DECODE_VARIANTS = ("native", "native+compiled", "kernels", "kernels+fused", "kernels+fused+compiled")


def bench_kernels(shape: str, args: ModelArgs, weight_types: Sequence[str], work_dir: Path, prompt_len: int = 128,
                  gen_tokens: int = 128, repeats: int = 3, seed: int = 0, llama_bench_binary: Path | None = None,
                  quick: bool = False, progress: Callable[[str], None] | None = None) -> list[dict]:
    """kernels.py's CUDA GEMVs against MLX's built-ins: GB/s per matrix shape of `shape` (4-bit groups of 32,
    float16; 1 and 4 rows; queued, with the host time to build each call), then decode of a random model of
    `shape` per weight type: MLX's built-ins ("native"), our GEMVs where faster ("kernels"), and with the
    fused gate/up and q/k/v kernels ("kernels+fused"): tokens/s, share of bandwidth, kernels per token,
    greedy agreement, the patch's choices, and where a token's time goes ("decode-breakdown", ms per token:
    host build and submit of one step, the matrix work alone as a chain, the GEMVs queued per shape, the
    step with every matrix replaced by a constant, and with attention too); each with and without compiling
    the decode step (DECODE_VARIANTS). llama_bench_binary: llama.cpp's llama-bench on the same GGUF file first
    (peer "llama.cpp"). quick: decode only, with launch_config's default launches (no sweep, no timing of
    candidates). Off MLX's CUDA backend: one "skipped" record, at once."""
    from ref_impl import kernels
    from ref_impl.theory.roofline import matmul_shapes

    say = progress or (lambda msg: None)
    if not kernels.on_cuda():
        return [{"experiment": "kernels", "model": shape, "weights": None, "kv": None, "context": None,
                 "variant": None, "metric": "skipped", "unit": None, "value": None, "samples": [], "peer": None,
                 "note": f"skipped: needs MLX's CUDA backend; this is {mx.default_device()}"}]
    work_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    bw = memory_bandwidth()
    records = bandwidth_records(bw)
    say(f"copy bandwidth {bw['copy']:.0f} GB/s")
    shapes = sorted({(n, k) for k, n in matmul_shapes(args.shape(shape))})
    for fmt in (kernels.Format(4, 32), kernels.Format(16)) if not quick else ():
        sweep = kernels.gemv_sweep(shapes, [fmt], (1, 4), shape, seed=seed)
        records += sweep
        host = {(r["weights"], tuple(r["shape"]), r["rows"], r["variant"]): r["value"] for r in sweep
                if r["metric"] == "host_us"}
        for r in sweep:
            if r["metric"] in ("bandwidth", "compile_error"):
                value = "" if r["value"] is None else f"{r['value']:8.0f} GB/s"
                t = next((x["value"] for x in sweep if x["metric"] == "time_us" and x["variant"] == r["variant"]
                          and x["shape"] == r["shape"] and x["rows"] == r["rows"]), None)
                h = host.get((r["weights"], tuple(r["shape"]), r["rows"], r["variant"]))
                timing = f" {t:7.1f} us/call queued, host {h:5.1f} us" if t is not None and h is not None else ""
                say(f"gemv {r['weights']:6} {str(tuple(r['shape'])):14} rows {r['rows']}  {r['variant']:42} {value}"
                    f"{timing}{r.get('note', '')[:300]}")
    say(f"[{time.perf_counter() - t_start:.0f} s] sweep done")
    prompt = np.random.default_rng(seed).integers(1, args.vocab_size, size=prompt_len).tolist()
    for wt in weight_types:
        base = {"experiment": "decode-kernels", "model": shape, "weights": wt, "kv": None,
                "context": prompt_len + gen_tokens, "peer": None}
        peer = []

        def run_peer(path: Path) -> None:
            peer.extend(llama_bench_records(llama_bench_binary, path, base, prompt_len, gen_tokens, repeats))
            say(f"[{time.perf_counter() - t_start:.0f} s] llama-bench {wt}: " + ", ".join(
                f"{r['metric']} {r['value']}" if r["value"] is not None else r["note"] for r in peer))

        model, _ = random_gguf_model(shape, args, wt, work_dir, seed, run_peer if llama_bench_binary else None)
        records += peer
        step_bytes = decode_bytes(model, prompt_len + gen_tokens // 2)
        base["kv"] = str(model.norm.weight.dtype).split(".")[-1]
        part = {**base, "experiment": "decode-breakdown", "metric": "ms_per_token", "unit": "ms", "samples": []}
        say(f"[{time.perf_counter() - t_start:.0f} s] {wt} model loaded")
        # what the step costs without its matrices (and without attention too): measured once, MLX's modules
        rest = {}
        for attention in (False, True):
            s, n_k = _decode_without(model, prompt, attention)
            key = "no_matrices" + ("_no_attention" if attention else "")
            rest[key] = s * 1e3
            records.append({**part, "variant": "native", "part": key, "value": s * 1e3, "kernels_per_token": n_k,
                            "note": "decode with every matrix" + (" and attention" if attention else "")
                                    + " replaced by a constant"})
        records.append({**part, "variant": "native", "part": "attention",
                        "value": rest["no_matrices"] - rest["no_matrices_no_attention"],
                        "note": "no_matrices - no_matrices_no_attention: RoPE, the cache update, SDPA"})
        say(f"{wt}: without matrices {rest['no_matrices']:.2f} ms/token, also without attention "
            f"{rest['no_matrices_no_attention']:.2f}")
        ids, choices = {}, []
        for variant in DECODE_VARIANTS:
            compiled = variant.endswith("+compiled")
            if variant == "kernels":
                choices = kernels.patch(model, fuse=True, measure=not quick)
                for c in choices:
                    chosen = c.launch.label if c.launch else kernels.UNFUSED if c.fuse else kernels.BUILTIN
                    records.append({**base, "experiment": "kernel-choice", "weights": c.fmt.name, "variant": chosen,
                                    "metric": "time_us", "unit": "us", "value": c.seconds.get(chosen, math.nan) * 1e6,
                                    "samples": [], "shape": [c.n, c.k], "rows": c.rows, "layers": c.layers,
                                    "fuse": c.fuse, "parts": list(c.parts),
                                    "timings_us": {k: v * 1e6 for k, v in c.seconds.items()},
                                    "host_us": {k: v * 1e6 for k, v in c.host.items()}, "errors": c.errors})
                    say(f"patch {wt} {c.fmt.name} {c.fuse or 'gemv'} {(c.n, c.k)} rows {c.rows}: {chosen}; "
                        + ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in c.seconds.items())
                        + (f"; failed: {', '.join(c.errors)}" if c.errors else ""))
            if variant.startswith("kernels"):
                kernels.enable(model, gemv=True, fused="fused" in variant)
            runs = ours(model, prompt, gen_tokens, repeats, pipeline=True, compiled=compiled)
            ids[variant] = runs[0][2]
            tps = _summarize(runs, prompt_len)["tokens_per_s"]
            n_kernels = kernels.count_kernels(model, compiled=compiled)
            overhead = (1 / tps[0] - step_bytes / (bw["copy"] * 1e9)) / n_kernels
            records += [{**base, "variant": variant, "metric": "tokens_per_s", "unit": "tok/s", "value": tps[0],
                         "samples": tps[1]},
                        {**base, "variant": variant, "metric": "bandwidth_fraction", "unit": "fraction",
                         "value": step_bytes * tps[0] / 1e9 / bw["copy"], "samples": []},
                        {**base, "variant": variant, "metric": "kernels_per_token", "unit": "kernels",
                         "value": n_kernels, "samples": [],
                         "note": "compute primitives in one decode step's graph, views excluded"},
                        {**base, "variant": variant, "metric": "overhead_us_per_kernel", "unit": "us",
                         "value": overhead * 1e6, "samples": [],
                         "note": "(token time - bytes_per_token / copy bandwidth) / kernels_per_token"}]
            host = _host_split(model, prompt, compiled=compiled)
            chain = _matrix_chain(model)
            parts = {"decode": 1e3 / tps[0], "host_build": host["build"] * 1e3, "host_submit": host["submit"] * 1e3,
                     "step_wait": host["wait"] * 1e3, "step_sync": sum(host.values()) * 1e3,
                     "matrix_chain": chain * 1e3}
            records += [{**part, "variant": variant, "part": k, "value": v} for k, v in parts.items()]
            say(f"decode {wt} {variant}: {tps[0]:.1f} tok/s = {parts['decode']:.2f} ms, {n_kernels} kernels/token, "
                f"{overhead * 1e6:.2f} us/kernel beyond the bytes; one step, GPU idle: build {parts['host_build']:.2f} "
                f"+ submit {parts['host_submit']:.2f} + wait {parts['step_wait']:.2f} ms; matrices alone as a chain "
                f"{parts['matrix_chain']:.2f} ms")
        for variant in ("native", "kernels", "kernels+fused"):
            queued = _queued_ms(choices, variant)
            records += [{**part, "variant": variant, "part": f"gemv_queued {k}", "value": v} for k, v in queued.items()]
            records.append({**part, "variant": variant, "part": "gemv_queued", "value": sum(queued.values()),
                            "note": "patch's queued time per call x calls per token, summed over shapes"})
            say(f"{wt} {variant}: GEMVs queued {sum(queued.values()):.2f} ms/token ("
                + ", ".join(f"{k} {v:.2f}" for k, v in queued.items()) + ")")
        records.append({**base, "variant": "kernels", "metric": "bytes_per_token", "unit": "B", "value": step_bytes,
                        "samples": []})
        for variant in DECODE_VARIANTS[1:]:
            same = np.array(ids[variant]) == np.array(ids["native"])
            first = int(np.argmin(same)) if not same.all() else None
            records.append({**base, "variant": variant, "metric": "greedy_agreement", "unit": "fraction",
                            "value": float(same.mean()), "samples": [], "first_divergence": first,
                            "note": "random weights: near-tied logits can flip at float32 vs MLX's rounding, and "
                                    "every later token then differs" if first is not None else ""})
        say(f"[{time.perf_counter() - t_start:.0f} s] {wt} done")
        del model
    return records


def bench_link(budget_s: float = 60.0, max_bytes: int = 1 << 30) -> list[dict]:
    """Link records (experiment "link"): host memory copies, and host<->device copies through PyTorch
    where it sees a CUDA GPU (else one "skipped" record with the reason). See interconnect.measure_link."""
    from ref_impl.theory.interconnect import measure_link

    return measure_link(budget_s, max_bytes)


def bench_alignment(budget_s: float = 60.0) -> list[dict]:
    """Alignment records (experiment "alignment"): the GGUF chapter's sweep of GEMV and sum read rates at
    byte offsets past a cache line, in a buffer inside L2 and one that streams from DRAM, numpy and MLX.
    See loads.throughput_sweep."""
    from ref_impl.measure import loads

    rows = loads.throughput_sweep(loads.SWEEP_OFFSETS, loads.sweep_sizes(), budget_s=budget_s)
    return loads.sweep_records(rows)


def bench_unified(max_bytes: int = 256 << 20, budget_s: float = 20.0) -> list[dict]:
    """Unified-memory records (experiment "unified"): numpy <-> MLX conversions (copy or share, by
    address; writes seen or not; time vs size) and the first host/device read of a fresh array on the
    default device against a second read. See unified.measure_unified."""
    from ref_impl.measure.unified import measure_unified

    return measure_unified(max_bytes, budget_s)


def bench_dispatch(path: Path, shapes: Sequence[str] | None = None, quick: bool = False, progress=None) -> list[dict]:
    """Dispatch records (experiments "dispatch-async", "dispatch-layer-eval", "first-call", "kernel-latency",
    "kv-jitter", "wired", "ttft", "itl") for the GGUF model at path and random models of `shapes`, sized for
    this device (quick: seconds on a CPU, a smoke test). See latency.bench_dispatch."""
    from ref_impl.measure import latency

    plan = latency.DispatchPlan.for_device(mx.default_device() == mx.gpu, quick)
    return latency.bench_dispatch(path, shapes, plan, progress=progress)


def bench_spec(target: Path, draft: Path, heads: Path | None = None, quick: bool = False, progress=None) -> list[dict]:
    """Speculative decoding records ("spec-alpha", "spec-forward", "spec-speed") for the GGUF target and
    draft, MTP heads (None: no MTP) and random-weight pairs with α set by construction, sized for this
    device (quick: seconds on a CPU, a smoke test). See spec.bench_spec."""
    from ref_impl.measure import spec

    plan = spec.SpecPlan.for_device(mx.default_device() == mx.gpu, quick)
    return spec.bench_spec(target, draft, heads, plan, progress=progress)


def bench_kv(path: Path, shapes: Sequence[str] | None = None, quick: bool = False, progress=None) -> list[dict]:
    """KV-cache quantization records ("kv-ppl", "kv-needle", "kv-bytes", "kv-speed") for the GGUF model at
    path and random-weight models of `shapes` ("stdlib-10m": the GGUF model itself), sized for this device
    (quick: seconds on a CPU, a smoke test). See kv.bench_kv."""
    from ref_impl.measure import kv

    plan = kv.KVPlan.for_device(mx.default_device() == mx.gpu, quick)
    return kv.bench_kv(path, plan, shapes, progress=progress)


