"""The peers our decoder is measured against, on the same weights: mlx-lm and llama.cpp.

mlx-lm runs its own Llama on our model's arrays (under mlx-lm's parameter names, same dtype);
llama.cpp runs the same GGUF file, in this process through llama-cpp-python, or as its own
`llama-bench` binary. Each decode peer returns `timing.TokenRun`s timed exactly as our decoder's
(`decode.ours`): one warm-up generation, then `repeats` timed ones. Both packages are optional and
imported where they are used.

See chapter: capstone
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ref_impl.engine.model import Model
from ref_impl.measure.records import record
from ref_impl.platform.quiet import held_stderr
from ref_impl.platform.timing import TokenRun, token_runs

Stream = Callable[[list[int], int], Iterator[int]]   # (prompt, n) -> greedy token ids, as they come


def mlx_lm_model(ours_model: Model) -> nn.Module:
    """mlx-lm's Llama holding our model's arrays (under mlx-lm's parameter names, same dtype, no copy)."""
    from mlx_lm.models import llama

    a = ours_model.args
    model = llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=a.hidden_size, num_hidden_layers=a.num_hidden_layers,
        intermediate_size=a.intermediate_size, num_attention_heads=a.num_attention_heads,
        num_key_value_heads=a.num_key_value_heads, head_dim=a.head_dim, rms_norm_eps=a.rms_norm_eps,
        vocab_size=a.vocab_size, rope_theta=a.rope_theta, rope_traditional=True,
        max_position_embeddings=a.max_position_embeddings, tie_word_embeddings=a.tie_word_embeddings))
    model.load_weights([(("" if k.startswith("lm_head") else "model.") + k, v)
                        for k, v in tree_flatten(ours_model.parameters())])
    mx.eval(model.parameters())
    return model


def mlx_lm_stream(ours_model: Model, kv_bits: int | None = None, draft: Model | None = None,
                  gamma: int = 2) -> Stream:
    """mlx-lm decoding our model's weights greedily: its own loop (generate_step); kv_bits: its quantized
    KV cache (affine, groups of 64, from the first token); draft: its speculative loop with gamma drafts."""
    from mlx_lm.generate import generate_step, speculative_generate_step

    model = mlx_lm_model(ours_model)
    greedy = {"sampler": lambda x: mx.argmax(x, axis=-1), "kv_bits": kv_bits, "quantized_kv_start": 0}
    if draft is None:
        return lambda prompt, n: (tok for tok, _ in generate_step(mx.array(prompt), model, max_tokens=n, **greedy))
    small = mlx_lm_model(draft)
    return lambda prompt, n: (tok for tok, *_ in speculative_generate_step(
        mx.array(prompt), model, small, num_draft_tokens=gamma, max_tokens=n, **greedy))


def mlx_lm_peer(ours_model: Model, prompt: list[int], n: int, repeats: int) -> list[TokenRun]:
    """mlx-lm's Llama on the same weights (our model's arrays, under mlx-lm's parameter names), greedy."""
    stream = mlx_lm_stream(ours_model)
    return token_runs(lambda: stream(prompt, n), n, repeats)


def llama_cpp_available() -> bool:
    """Whether llama.cpp's Python bindings (llama-cpp-python) import here: the peer is optional (`make lab`
    leaves it out, `make setup` builds it)."""
    try:
        import llama_cpp  # noqa: F401
    except (ImportError, OSError, RuntimeError):   # not installed, or its shared library does not load
        return False
    return True


def llama_cpp_stream(path: Path, n_ctx: int, kv_type: str | None = None) -> Stream:
    """llama.cpp on a GGUF file through llama-cpp-python, greedy, every layer offloaded where it was built
    with a GPU backend; kv_type: its KV cache's GGML type for keys and values (e.g. "Q8_0"; default F16),
    which needs its flash attention for quantized values."""
    import llama_cpp

    kv = {} if kv_type is None else {"type_k": getattr(llama_cpp, f"GGML_TYPE_{kv_type}"),
                                     "type_v": getattr(llama_cpp, f"GGML_TYPE_{kv_type}"), "flash_attn": True}
    # n_gpu_layers=-1 offloads every layer when llama.cpp was built with a GPU backend; a CPU build ignores it
    with held_stderr():   # llama.cpp's warnings about the file (its training context, ...) are not ours to print
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_threads=os.cpu_count(), n_batch=n_ctx,
                              n_gpu_layers=-1, verbose=False, **kv)

    def stream(prompt: list[int], n: int) -> Iterator[int]:
        llm.reset()
        return llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, frequency_penalty=0.0,
                            presence_penalty=0.0, reset=True)
    return stream


def llama_cpp_peer(path: Path, prompt: list[int], n: int, repeats: int) -> list[TokenRun]:
    """llama.cpp on the same GGUF file, through llama-cpp-python, greedy."""
    stream = llama_cpp_stream(path, len(prompt) + n + 8)
    return token_runs(lambda: stream(prompt, n), n, repeats)


def llama_cpp_logits(path: Path, ids: Sequence[int]) -> np.ndarray:
    """llama.cpp's logits (len(ids), vocab) for one batch of tokens from an empty context: CPU, one
    thread (its spinning workers slow badly when another process keeps the other core busy), float32 KV cache."""
    import llama_cpp

    with held_stderr():
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=len(ids), n_batch=len(ids), logits_all=True,
                              type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32,
                              n_gpu_layers=0, n_threads=1, n_threads_batch=1, verbose=False)
    llm.eval(list(ids))
    return np.array(llm.scores[:len(ids)])


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
    """Results records of llama_bench on path (tokens/s and the model's bytes), with the fields of `base`
    (experiment, model, weights ...), or one "peer_error" record that keeps its message: a failing peer
    must not cost the rest of a GPU run."""
    fields = {k: v for k, v in base.items() if k not in ("experiment", "variant", "peer")}

    def rec(metric, unit, value, peer, **extra):
        return record(base.get("experiment"), metric, unit, value, variant="llama.cpp", peer=peer, **fields, **extra)

    try:
        row = llama_bench(binary, path, prompt_len, gen_tokens, repeats)
    except RuntimeError as e:
        return [rec("peer_error", None, None, "llama.cpp (llama-bench)", note=str(e))]
    # a build from a source archive (e.g. llama-cpp-python's vendored copy) knows no commit: say nothing
    commit = row.get("build_commit") if row.get("build_commit") not in (None, "", "unknown") else None
    peer = f"llama.cpp{f' {commit}' if commit else ''} (llama-bench, {row.get('backends', '?')})"
    note = f"{row.get('gpu_info', '')}; -d {prompt_len} -n {gen_tokens} -ngl 99 -fa on"
    return [rec("tokens_per_s", "tok/s", float(row["avg_ts"]), peer, note=note,
                samples=[float(v) for v in row.get("samples_ts", [])]),
            rec("model_bytes", "B", int(row["model_size"]), peer,
                note="llama.cpp's model_size: the file's tensor bytes")]
