"""Mixture of experts on the roofline: a decoded token reads its active weights, not all it stores.

`bench --moe` writes three random-weight GGUF files (engine/random.write_random_model) and decodes each:

* "moe": a qwen3moe model, `num_experts` experts of width `expert_intermediate_size` in every layer, of
  which the router picks `experts_per_token` for each token;
* "dense, same total": a qwen3 model whose one MLP is as wide as all the experts side by side
  (theory/shapes.dense_counterpart with num_experts): as many bytes stored, less the routers;
* "dense, same active": a qwen3 model whose MLP is as wide as the used experts (experts_per_token): as many
  bytes read per token, less the routers.

The three share attention, vocabulary (a tied embedding, so the output matrix is read whole by every
token and the roofline's count is exact) and depth. Per file it records the bytes the file stores
(`total_bytes`: the file's own tensor bytes), the bytes a decoded token reads (`bytes_per_token`:
theory/roofline.decode_bytes_per_token on the file's shape at the storage the decoder holds, the active
weights and the KV cache at the mean context), decode tokens/s (median of `repeats` rounds after a
warm-up round, the three files interleaved within each round so that a machine's drift falls on each
alike, one engine after the other) and the bandwidth the two imply (bytes per token x tokens/s).
llama.cpp decodes the same files where llama-cpp-python is installed, its bytes counted at the file's
storage.

Weights: on a CPU the files are F32 and our decoder holds float32. MLX's CPU quantized matmuls are slower
than its float32 ones: on the reference 2-core CPU a Q8_0 MoE file (16 experts, 2 used) held quantized
decoded at half the speed of the same file expanded to float32 (24 against 50 tok/s), and a dense Q8_0
file as large no faster (6.6 against 7.2) though it read 3.8 times fewer bytes. With F32 files both
engines read the very bytes each file holds. On a GPU the files are Q8_0, held as MLX's 8-bit affine
matrices (the experts through mx.gather_qmm): every matrix gets the one type, so the byte relations
between the three files are the theory's, whose one bits-per-weight applies to all (Q4_K_M would give
some matrices Q6_K, and not the same ones in a MoE file and a dense one).

    python -m ref_impl bench --moe --label cpu-2core

See chapter: intro-roofline
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ref_impl.engine.generate import Sampler, generate_step
from ref_impl.engine.model import Model, ModelArgs
from ref_impl.engine.random import write_random_model
from ref_impl.formats import ggml, gguf
from ref_impl.kernels import loading
from ref_impl.measure.decode import roofs
from ref_impl.measure.peers import llama_cpp_available, llama_cpp_stream
from ref_impl.measure.records import dtype_name, record
from ref_impl.platform.machine import package_version
from ref_impl.platform.timing import TokenRun, decode_metrics, interleaved, time_tokens
from ref_impl.theory import roofline as rl

EXPERIMENT = "moe-decode"
MOE, SAME_TOTAL, SAME_ACTIVE = "moe", "dense, same total", "dense, same active"
ROLES = (MOE, SAME_TOTAL, SAME_ACTIVE)
FILE_WEIGHTS = {"F32": "float", "Q8_0": "native"}    # file type -> how our decoder holds it (loading.LoadOptions)
Say = Callable[[str], None]
Stream = Callable[[list[int], int], Iterator[int]]


@dataclass(frozen=True)
class MoEPlan:
    """What bench --moe measures: the MoE's shape (its two dense counterparts follow from it), the file type,
    and the decode runs."""
    hidden_size: int = 1024
    num_hidden_layers: int = 6
    num_experts: int = 32
    experts_per_token: int = 4
    expert_intermediate_size: int = 384
    vocab_size: int = 2048
    head_dim: int = 128
    num_key_value_heads: int = 2
    file_type: str = "F32"            # F32 on a CPU, Q8_0 on a GPU (the module docstring says why)
    prompt_tokens: int = 16
    gen_tokens: int = 64
    repeats: int = 5                  # rounds after the warm-up round
    roof_bytes: int = 1 << 30         # the memory probes' array (decode.roofs); 0: no probes
    seed: int = 0

    def __post_init__(self):
        d, e, k, f_e = self.hidden_size, self.num_experts, self.experts_per_token, self.expert_intermediate_size
        if self.file_type not in FILE_WEIGHTS:
            raise ValueError(f"MoEPlan: file_type {self.file_type!r} is not one of {', '.join(FILE_WEIGHTS)}")
        if not 0 < k < e:
            raise ValueError(f"MoEPlan: need 0 < experts_per_token ({k}) < num_experts ({e}): with every expert "
                             "used the MoE reads what it stores, and there is nothing to compare")
        if min(d, f_e, self.num_hidden_layers, self.vocab_size, self.head_dim, self.num_key_value_heads) < 1:
            raise ValueError(f"MoEPlan: every size must be positive: {self}")
        if d % self.head_dim or (d // self.head_dim) % self.num_key_value_heads:
            raise ValueError(f"MoEPlan: hidden_size {d} must be a multiple of head_dim {self.head_dim}, in a number "
                             f"of heads that is a multiple of num_key_value_heads {self.num_key_value_heads}")
        block = ggml.BLOCK[ggml.GGMLType[self.file_type]][0]
        if d % block or f_e % block:
            raise ValueError(f"MoEPlan: {self.file_type} rows hold blocks of {block}: hidden_size {d} and "
                             f"expert_intermediate_size {f_e} must be multiples of it")
        if self.prompt_tokens < 1 or self.gen_tokens < 2 or self.repeats < 1 or self.roof_bytes < 0:
            raise ValueError(f"MoEPlan: need prompt_tokens >= 1, gen_tokens >= 2 (a decode speed takes two token "
                             f"times), repeats >= 1 and roof_bytes >= 0; got {self.prompt_tokens}, "
                             f"{self.gen_tokens}, {self.repeats}, {self.roof_bytes}")

    @classmethod
    def quick(cls, file_type: str = "F32") -> MoEPlan:
        """Seconds: two layers 64 wide, 8 experts of which 2 are used, 8 tokens, no memory probe."""
        return cls(hidden_size=64, num_hidden_layers=2, num_experts=8, experts_per_token=2,
                   expert_intermediate_size=32, vocab_size=256, head_dim=32,
                   file_type=file_type, prompt_tokens=4, gen_tokens=8, repeats=1, roof_bytes=0)

    @classmethod
    def for_device(cls, gpu: bool, quick: bool) -> MoEPlan:
        """The CPU plan (F32, minutes on 2 cores), or on a GPU Q8_0 files large enough that a dense file's weight
        read takes milliseconds (about 11 GB stored; a token of the MoE, and of the dense file of the same active
        size, reads about 2.1 GB)."""
        if not gpu:
            return cls.quick() if quick else cls()
        if quick:
            return cls.quick("Q8_0")
        return cls(hidden_size=4096, num_hidden_layers=16, num_experts=32, experts_per_token=4,
                   expert_intermediate_size=1536, vocab_size=32000, num_key_value_heads=8, file_type="Q8_0",
                   gen_tokens=128)

    def args(self) -> dict[str, ModelArgs]:
        """The three files' hyper-parameters, by role: the MoE and its two dense counterparts."""
        common = dict(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                      num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.hidden_size // self.head_dim,
                      num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim, rope_theta=1e6,
                      rms_norm_eps=1e-6, max_position_embeddings=self.prompt_tokens + self.gen_tokens + 8,
                      tie_word_embeddings=True)
        f_e = self.expert_intermediate_size
        return {MOE: ModelArgs(intermediate_size=0, architecture="qwen3moe", num_experts=self.num_experts,
                               experts_per_token=self.experts_per_token, expert_intermediate_size=f_e, **common),
                SAME_TOTAL: ModelArgs(intermediate_size=self.num_experts * f_e, architecture="qwen3", **common),
                SAME_ACTIVE: ModelArgs(intermediate_size=self.experts_per_token * f_e, architecture="qwen3",
                                       **common)}


def file_bytes(path: Path) -> tuple[int, int]:
    """(bytes, weights) of every tensor a GGUF file stores."""
    with gguf.read(path) as f:
        return (sum(t.nbytes for t in f.tensors.values()),
                sum(int(np.prod(t.shape)) for t in f.tensors.values()))


def held_bytes(model: Model) -> int:
    """Bytes of every parameter our decoder holds (quantized matrices: their codes, scales and biases)."""
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def ours_stream(model: Model) -> Stream:
    """Our decoder on one model, greedy, the pipelined loop (step t+1 queued before token t is read), a fresh
    cache per generation."""
    def stream(prompt: list[int], n: int) -> Iterator[int]:
        return generate_step(model, prompt, Sampler(), model.make_cache(len(prompt) + n), pipeline=True)
    return stream


def decode_rounds(streams: dict[tuple[str, str], Stream], prompt: list[int], n: int, repeats: int
                  ) -> dict[tuple[str, str], list[TokenRun]]:
    """n tokens from every stream: a warm-up round, then `repeats` rounds that run each stream once, so a
    machine's drift (a neighbour, the clock) falls on every file alike. One engine's streams at a time: on the
    2-core CPU llama.cpp decoded 1.4 to 15 times slower interleaved with MLX than alone (its threads meet at a
    barrier after every operation, and MLX's and OpenBLAS's workers still held the cores)."""
    def run(stream: Stream) -> TokenRun:
        timed = time_tokens(stream(prompt, n), n)
        mx.synchronize()                    # the pipelined loop leaves one step queued: let it finish
        return timed

    return interleaved({key: partial(run, stream) for key, stream in streams.items()}, repeats)


def file_records(role: str, args: ModelArgs, path: Path, model: Model, plan: MoEPlan, runs: dict,
                 peer: str | None) -> list[dict]:
    """One file's records: the bytes it stores; per engine (ours, and llama.cpp where it ran) the bytes a token
    reads at the storage that engine holds, its decode tokens/s and the bandwidth the two imply."""
    total, weights = file_bytes(path)
    shape = args.shape(role)
    context = plan.prompt_tokens + plan.gen_tokens // 2            # the mean context of the generated tokens
    kv = model.norm.weight.dtype.size
    fields = {"model": role, "weights": plan.file_type, "context": plan.prompt_tokens + plan.gen_tokens,
              "file": path.name, "architecture": args.architecture, "experts": args.num_experts,
              "experts_used": args.experts_per_token,
              "ffn_width": args.expert_intermediate_size or args.intermediate_size}     # an expert's, or the MLP's
    out = [record(EXPERIMENT, "total_bytes", "B", total, weight_count=weights, note="the file's tensor bytes",
                  **fields)]
    engines = [(None, 8 * held_bytes(model) / weights, kv, dtype_name(model.norm.weight.dtype))]
    if peer is not None:                                           # llama.cpp reads the file's bytes, an F16 cache
        engines.append((peer, 8 * total / weights, 2, "f16"))
    for who, bits, kv_bytes, kv_name in engines:
        value, samples = decode_metrics(runs[(role, who or "ours")], plan.prompt_tokens)["tokens_per_s"]
        weight_bytes = rl.active_weight_bytes(shape, bits)
        nbytes = rl.decode_bytes_per_token(shape, bits, context, kv_bytes)
        extra = {**fields, "kv": kv_name, "peer": who, "bits_per_weight": bits}
        out += [record(EXPERIMENT, "bytes_per_token", "B", nbytes, weight_bytes=weight_bytes,
                       kv_bytes=nbytes - weight_bytes, mean_context=context, **extra),
                record(EXPERIMENT, "tokens_per_s", "tok/s", value, samples=samples, **extra),
                record(EXPERIMENT, "achieved_bandwidth", "GB/s", nbytes * value / 1e9,
                       note="bytes_per_token x tokens_per_s", **extra)]
    return out


def bench_moe(work: Path, plan: MoEPlan = MoEPlan(), peers: bool = True, progress: Say = lambda s: None
              ) -> list[dict]:
    """bench --moe's records: the machine's roofs (unless plan.roof_bytes is 0), then per file (the MoE and its
    two dense counterparts, written to `work`) its bytes stored and read per token, and decode tokens/s with the
    bandwidth it implies, ours and llama.cpp's (peers, where llama-cpp-python is installed; else one "skipped"
    record)."""
    work.mkdir(parents=True, exist_ok=True)
    out = roofs(plan.roof_bytes) if plan.roof_bytes else []
    peer = f"llama.cpp (llama-cpp-python {package_version('llama_cpp_python')})" \
        if peers and llama_cpp_available() else None
    if peers and peer is None:
        out.append(record(EXPERIMENT, "skipped", None, None, peer="llama.cpp",
                          note="llama-cpp-python is not installed: `make setup` builds it"))
    files, models = {}, {}
    options = loading.LoadOptions(weights=FILE_WEIGHTS[plan.file_type], kernels="off")
    for role, args in plan.args().items():
        progress(f"moe: writing and loading {role} ({plan.file_type})")
        files[role] = write_random_model(work / f"moe-{role.replace(', ', '-').replace(' ', '-')}.gguf", args,
                                         plan.file_type, plan.seed)
        with gguf.read(files[role]) as f:
            models[role] = loading.load(f, options, tokenizer=False).model
    prompt = np.random.default_rng(plan.seed).integers(0, plan.vocab_size, plan.prompt_tokens).tolist()
    progress(f"moe: ours, {plan.gen_tokens} tokens per file, {plan.repeats} rounds after a warm-up")
    runs = decode_rounds({(role, "ours"): ours_stream(m) for role, m in models.items()}, prompt, plan.gen_tokens,
                         plan.repeats)
    if peer is not None:       # after ours, not within its rounds: see decode_rounds
        progress(f"moe: llama.cpp, {plan.gen_tokens} tokens per file, {plan.repeats} rounds after a warm-up")
        n_ctx = plan.prompt_tokens + plan.gen_tokens + 8
        runs |= decode_rounds({(role, peer): llama_cpp_stream(path, n_ctx) for role, path in files.items()}, prompt,
                              plan.gen_tokens, plan.repeats)
    for role, args in plan.args().items():
        out += file_records(role, args, files[role], models[role], plan, runs, peer)
    del models
    gc.collect()
    return out


def show_moe(records: list[dict]) -> list[str]:
    """bench --moe's lines: per file and engine, the bytes a token reads, tokens/s and the implied bandwidth."""
    out = []
    for r in records:
        if r["experiment"] == EXPERIMENT and r["metric"] in ("total_bytes", "bytes_per_token", "tokens_per_s",
                                                             "achieved_bandwidth", "skipped"):
            value = "-" if r["value"] is None else f"{r['value']:.4g}"
            who = "the file" if r["metric"] == "total_bytes" else r["peer"] or "ours"
            out.append(f"  {r['model'] or '':<20} {who:<44} {r['metric']:<19} {value:>12} "
                       f"{r['unit'] or ''} {r.get('note', '') if r['metric'] == 'skipped' else ''}")
    return out
