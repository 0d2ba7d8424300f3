"""What quantizing the KV cache costs: key/value magnitudes, rounding error, perplexity, retrieval,
memory and decode speed.

The measurements behind the KV-cache chapter's choice of scheme (`kvquant.QUANTIZED`):

* `key_value_magnitudes`: per layer and channel, mean and max |k| and |v| over a prompt, keys both
  before and after RoPE. Keys carry a few *outlier channels* (`kvquant.outlier_channels` counts them);
  values do not. RoPE rotates each pair (2i, 2i+1) by a position-dependent angle, so after it a
  pre-RoPE outlier channel spreads over its pair, but the pair's norm is unchanged.
* `per_channel_rounding_error`: the RMS error per channel of symmetric rounding with one scale per
  token (the max over channels: an outlier channel sets a coarse step for all the others) versus
  one scale per channel (over tokens: each channel gets its own step). This is KIVI's argument.
* held-out perplexity when attention reads the history from a quantized cache (`evaluate.heldout_losses`
  with a scheme: the one held-out evaluation of the course, through the cache).
* `memory_table`: analytic KV bytes for public model shapes at long contexts, per scheme.
* `needle_retrieval`: does the model still copy an identifier defined ~440 tokens earlier?
  (`needle_trials` builds the prompts; the module docstring of that section says how.)
* `decode_speed`: decode tokens/s against context, float vs quantized caches, attention on the
  dequantized history or fused on the codes (kvquant's `fused=True`); `crossover` reads off
  the context from which a quantized cache is the faster.
`bench_kv` runs them into results records (`python -m ref_impl bench --kv`).

How the keys are captured: `capture_keys_values` runs the decoder's layers itself, exactly as
`Model.__call__` does (embed, then each block with the causal mask), and hands each block a
`_Recorder` in place of its cache. The recorder sees the post-RoPE keys and the values in
`update_and_fetch` (model.py's Attention applies RoPE before calling it) and returns them
unchanged, so the forward is the uncached one; the pre-RoPE keys are the block's own `k_proj` on
its normed input, computed alongside. model.py is not touched.

Shapes: keys and values are (B, n_kv_heads, L, head_dim); magnitudes are (n_layers, n_kv_heads,
head_dim) numpy arrays.

See chapter: kv-cache
"""

from __future__ import annotations

import gc
import math
import re
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import mlx.core as mx
import numpy as np

from ref_impl.engine import kvquant
from ref_impl.engine.checkpoint import load
from ref_impl.engine.generate import Sampler, generate_step, prefill
from ref_impl.engine.kvcache import Cache, KVCache
from ref_impl.engine.kvquant import FLOAT, scheme_bytes
from ref_impl.engine.model import Model
from ref_impl.engine.random import args_for, random_model
from ref_impl.engine.tokenizer import Tokenizer
from ref_impl.measure.records import dtype_name, record
from ref_impl.platform.timing import TokenRun, clock, decode_metrics, interleaved, time_tokens
from ref_impl.theory import roofline
from ref_impl.theory.shapes import ModelShape
from ref_impl.theory.shapes import shape as named_shape
from ref_impl.training.corpus import read_corpus, token_stream
from ref_impl.training.evaluate import heldout_losses, perplexity
from ref_impl.training.models import config_for


class _Recorder:
    """A stand-in cache that keeps what attention gives it and stores nothing between calls."""

    offset, attends = 0, "dense"

    def update_and_fetch(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        self.keys, self.values = k, v
        return k, v


def capture_keys_values(model: Model, tokens: mx.array) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per layer (keys before RoPE, keys after RoPE, values), each (B, n_kv_heads, L, head_dim),
    for tokens (B, L) run through the model without a cache (see the module docstring)."""
    h = model.embed(tokens)
    B, L, _ = h.shape
    mask = "causal" if L > 1 else None
    out = []
    for layer in model.layers:
        attn, rec = layer.self_attn, _Recorder()
        pre = attn.k_proj(layer.input_layernorm(h)).reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
        h = layer(h, mask, rec)
        mx.eval(h, pre, rec.keys, rec.values)
        out.append(tuple(np.array(a.astype(mx.float32)) for a in (pre, rec.keys, rec.values)))
    return out


def key_value_magnitudes(model: Model, tokens: mx.array) -> dict[str, dict[str, np.ndarray]]:
    """Per layer and channel magnitudes over a prompt's positions (and batch), for tokens (B, L):
    {"keys_pre_rope" | "keys_post_rope" | "values": {"mean": |x| mean, "max": |x| max}}, each
    (n_layers, n_kv_heads, head_dim)."""
    captured = capture_keys_values(model, tokens)
    mags = {}
    for i, name in enumerate(("keys_pre_rope", "keys_post_rope", "values")):
        absx = [np.abs(c[i]) for c in captured]
        mags[name] = {"mean": np.stack([a.mean(axis=(0, 2)) for a in absx]),
                      "max": np.stack([a.max(axis=(0, 2)) for a in absx])}
    return mags


def per_channel_rounding_error(keys, bits: int) -> dict[str, np.ndarray]:
    """RMS rounding error per channel (head_dim,) of keys (..., L, head_dim) quantized symmetric
    `bits`-bit (kvquant.quantize_symmetric: 8 or 4) with one scale per token ("per_token", over its
    channels) or one per channel ("per_channel", over the L tokens; L even for 4 bits).
    The error is averaged over tokens and every leading axis."""
    x = mx.array(np.asarray(keys, dtype=np.float32))

    def roundtrip(rows: mx.array) -> mx.array:   # symmetric over the last axis
        return kvquant.dequantize_symmetric(*kvquant.quantize_symmetric(rows, bits, mx.float32), bits)

    per_token = roundtrip(x)
    per_channel = roundtrip(x.swapaxes(-1, -2)).swapaxes(-1, -2)
    axes = tuple(range(x.ndim - 1))
    return {name: np.sqrt(np.array(mx.mean((q - x) ** 2, axis=axes)))
            for name, q in (("per_token", per_token), ("per_channel", per_channel))}


# A 30B-class model for C05's "35B" (Qwen3-30B-A3B: 48 layers, 4 KV heads of 128; config.json at
# https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json). Its mixture-of-experts MLP does not fit
# roofline's dense ModelShape, so this shape serves KV arithmetic only: intermediate_size 0 makes any
# weight count taken from it visibly wrong rather than plausibly wrong.
DEFAULT_SHAPES = ("Llama-3.1-8B", "Qwen3-4B", "Qwen3-8B", "Qwen3-32B", "Qwen3-30B-A3B")
DEFAULT_CONTEXTS = (8192, 16384, 32768, 65536, 131072)


def memory_table(shapes: Iterable[str | ModelShape] = DEFAULT_SHAPES,
                 contexts: Sequence[int] = DEFAULT_CONTEXTS,
                 schemes: Sequence[str] = (FLOAT, *kvquant.QUANTIZED),
                 dtype: mx.Dtype = mx.float16) -> list[dict]:
    """KV-cache bytes of one sequence at each context, per model shape and scheme (batch 1).

    bytes = per_token * (positions stored over all layers, `roofline`'s count, which caps
    sliding-window layers) + fixed * n_layers, with per_token and fixed from `scheme_bytes`
    (float16 scales, the GPU case). "float" is the float16 static cache, equal to
    `roofline.kv_cache_bytes(shape, context, 2)`. Rows: model, scheme, context, bytes,
    bytes_per_token (per token over all layers at that context), vs_float (bytes / float bytes)."""
    rows = []
    for shape in shapes:
        shape = named_shape(shape) if isinstance(shape, str) else shape
        cost = {s: scheme_bytes(s, shape.num_key_value_heads, shape.head_dim, dtype) for s in (FLOAT, *schemes)}
        for context in contexts:
            stored = roofline.attended_positions(shape, context)   # sum over layers of positions kept
            size = {s: per * stored + fixed * shape.num_hidden_layers for s, (per, fixed) in cost.items()}
            rows += [{"model": shape.name, "scheme": s, "context": context, "bytes": size[s],
                      "bytes_per_token": size[s] / context, "vs_float": size[s] / size[FLOAT]}
                     for s in schemes]
    return rows


# ---- needle retrieval: copy an identifier defined far back ---------------------------------------
#
# The shipped model copies poorly from far back: while this probe was designed, it almost never
# reproduced a made-up identifier of random letters, or of random words, defined a few hundred
# tokens earlier, whatever the cue. What it does copy is a name it saw used in a pattern that comes
# back. So the needle is a class whose method has a made-up name, called twice by `run`; the cue
# reopens `run` after the filler and gives the name's unique first part:
#
#     <held-out code>  class Base: def <w1>_<w2>(self): ... def run(self): self.<w1>_<w2>() x2
#     <held-out code, `distance` tokens>  def run(self): self.<w1>_      -> the model must say <w2>
#
# w1 glues two vocabulary words into a word the held-out files never use (so the cue points at the
# needle alone); w2 is a common code word, one token. The control prompts plant another made-up
# name instead: the rate at which w2 is guessed without the needle (bench_kv records both).

NEEDLE = ("\n\nclass Base:\n    def {name}(self):\n        pass\n\n"
          "    def run(self):\n        self.{name}()\n        self.{name}()\n\n")
NEEDLE_CUE = "\n\n    def run(self):\n        self.{prefix}"


@dataclass
class NeedleTrial:
    """One retrieval prompt of exactly `context` tokens: the model must continue it with `target`."""
    name: str                   # the planted identifier
    prompt: list[int]           # BOS, held-out code, the needle, `distance` tokens of held-out code, the cue
    control: list[int]          # the same with another made-up name in the needle: the guess rate
    target: int                 # the one token the cue must be continued with
    distance: int               # tokens from the needle's end to the end of the prompt


def _code_lines(rng: np.random.Generator, texts: Sequence[str], tokenizer: Tokenizer, n: int) -> list[int]:
    """Tokens of whole lines of a random held-out file from a random line on: n or a few fewer."""
    while True:
        lines = texts[rng.integers(len(texts))].splitlines(keepends=True)
        ids: list[int] = []
        for line in lines[rng.integers(len(lines)):]:
            line_ids = tokenizer.encode(line)
            if len(ids) + len(line_ids) > n:
                break
            ids += line_ids
        if len(ids) > n - 40:
            return ids


def needle_trials(tokenizer: Tokenizer, texts: Sequence[str], n: int, context: int = 512, distance: int = 440,
                  seed: int = 0) -> list[NeedleTrial]:
    """n seeded retrieval prompts, each `context` tokens long, from held-out source files `texts`
    (see the section comment for the layout); `distance` is at most context - ~60."""
    rng = np.random.default_rng(seed)
    used = Counter(re.findall(r"[A-Za-z]+", "".join(texts)))
    vocab = [t for t in (tokenizer.decode([i]) for i in range(tokenizer.vocab_size))
             if re.fullmatch(r"[a-z]{4,}", t) and used[t] >= 20]          # common code words, one token each

    def name() -> tuple[str, str]:
        while True:
            a, b, c = rng.choice(vocab, 3, replace=False)
            if not used[a + b] and len(tokenizer.encode(a + b)) == 2:
                return f"{a}{b}_", str(c)

    trials = []
    while len(trials) < n:
        prefix, word = name()
        cue = tokenizer.encode(NEEDLE_CUE.format(prefix=prefix))
        target = tokenizer.encode(word)
        if tokenizer.encode(NEEDLE_CUE.format(prefix=prefix + word)) != cue + target:
            continue   # the name must tokenize the same at the cue as in the needle's calls
        needle = tokenizer.encode(NEEDLE.format(name=prefix + word))
        other = needle
        while len(other) != len(needle) or other == needle:
            other = tokenizer.encode(NEEDLE.format(name="".join(name())))
        filler = _code_lines(rng, texts, tokenizer, distance - len(cue))
        lead = context - 1 - len(needle) - len(filler) - len(cue)
        if lead < 0:
            raise ValueError(f"distance {distance} leaves no room for the needle in a context of {context}")
        lines = _code_lines(rng, texts, tokenizer, lead + 64)                    # at least lead + 24 tokens
        head = [tokenizer.bos_id] + lines[len(lines) - lead:]
        trials.append(NeedleTrial(prefix + word, head + needle + filler + cue, head + other + filler + cue,
                                  target[0], len(filler) + len(cue)))
    return trials


def needle_retrieval(model: Model, trials: Sequence[NeedleTrial], scheme: str, control: bool = False,
                     batch: int = 16, **params) -> tuple[list[bool], list[float]]:
    """Per trial: does greedy decoding continue the prompt with the needle's token, and its log-prob
    (nats), with the decoder reading the prompt from a `scheme` cache filled by one prefill, as
    `generate` does. control=True asks the same of the control prompts (no needle)."""
    hits, logprobs = [], []
    for i in range(0, len(trials), batch):
        part = trials[i:i + batch]
        prompts = mx.array([t.control if control else t.prompt for t in part])
        caches = model.make_cache(prompts.shape[1], len(part), scheme, **params)
        logits = prefill(model, prompts, caches).astype(mx.float32)                  # (B, V)
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        target = mx.array([t.target for t in part])
        hits += (mx.argmax(logits, axis=-1) == target).tolist()
        logprobs += mx.take_along_axis(logp, target[:, None], axis=-1)[:, 0].tolist()
    return hits, logprobs


# ---- decode speed against context ------------------------------------------------------------------

def decode_after(model: Model, cache: list[Cache], token: int, n: int, context: int) -> TokenRun:
    """n greedy tokens decoded by the pipelined loop after `token`, on caches holding `context` positions, which are
    trimmed back to them afterwards: one run of a decode-speed-against-context measurement, repeatable."""
    run = time_tokens(generate_step(model, [token], Sampler(), cache, pipeline=True), n)
    mx.synchronize()               # the pipelined step left queued, before the trim
    for c in cache:
        c.trim(c.offset - context)
    return run


def fill_random(caches: Sequence[KVCache], context: int, seed: int = 0, chunk: int = 4096) -> None:
    """Store `context` positions of random keys and values (standard normal, in the cache dtype) in
    every layer's cache, `chunk` positions per update_and_fetch: what a prefill of that length leaves,
    without running it (decode speed does not depend on the values, and a real 32k-token prefill of
    an 8B shape would cost more than the decode it sets up)."""
    key = mx.random.key(seed)
    for cache in caches:
        B, H, D = cache.batch, cache.n_kv_heads, cache.head_dim
        for start in range(0, context, chunk):
            key, sub = mx.random.split(key)
            kv = mx.random.normal((2, B, H, min(chunk, context - start), D), key=sub).astype(cache.dtype)
            cache.update_and_fetch(kv[0], kv[1])
        mx.eval(cache.state)      # the stored buffers, one layer at a time (bounds the lazy graph and memory)


@dataclass
class SpeedPoint:
    """Greedy pipelined decode of one model after `context` cached positions, with one cache variant."""
    model: str
    scheme: str                        # FLOAT or a name of kvquant.QUANTIZED
    fused: bool                        # attention on the codes (kvquant fused=True) or on the dequantized history
    context: int
    tokens_per_s: float                # median over runs
    tokens_per_s_runs: list[float]
    itl_p50_ms: float
    cache_bytes: int                   # all layers' caches, allocated for context + n_tokens + 2 positions


def decode_speed(model: Model, name: str, variants: Sequence[tuple[str, bool]], contexts: Sequence[int],
                 n_tokens: int = 32, repeats: int = 3, budget_s: float = math.inf, seed: int = 0) -> list[SpeedPoint]:
    """Decode tokens/s of each (scheme, fused) variant at each context, shortest first.

    Per context every variant's caches are built and filled with `fill_random`; then a warm-up run and
    `repeats` rounds that decode n_tokens with every variant in turn (`generate_step` pipelined, one
    random token as the prompt), trimming each cache back to `context` after its run, so a busy
    neighbour slows all variants alike. Stops before a context whose likely cost would overrun
    budget_s: the last context's cost, extrapolated along the line through the last two (a step reads
    fixed weights plus a cache that grows with the context)."""
    if n_tokens < 2 or repeats < 1 or not variants:
        raise ValueError(f"decode_speed needs n_tokens >= 2, repeats >= 1 and a variant; got {n_tokens}, {repeats}")
    token = int(np.random.default_rng(seed).integers(1, model.args.vocab_size))
    out, start, costs = [], clock(), []
    for context in sorted(contexts):
        if costs:
            (c0, t0), (c1, t1) = costs[-2:] if len(costs) > 1 else costs * 2
            likely = t1 + (t1 - t0) / (c1 - c0) * (context - c1) if c1 > c0 else t1
            if clock() - start + likely > budget_s:
                break
        begun = clock()
        caches = {v: model.make_cache(context + n_tokens + 2, 1, v[0], fused=v[1]) for v in variants}
        for c in caches.values():
            fill_random(c, context, seed)
        runs = interleaved({v: partial(decode_after, model, cache, token, n_tokens, context)
                            for v, cache in caches.items()}, repeats)
        for (scheme, fused), r in runs.items():
            s = decode_metrics(r, 1)
            out.append(SpeedPoint(name, scheme, fused, context, s["tokens_per_s"][0],
                                  [float(x) for x in s["tokens_per_s"][1]], s["itl_p50_ms"][0],
                                  sum(c.nbytes for c in caches[(scheme, fused)])))
        del caches
        gc.collect()
        mx.clear_cache()
        costs.append((context, clock() - begun))
    return out


def crossover(points: Sequence[SpeedPoint], scheme: str, fused: bool) -> int | None:
    """The shortest measured context from which on (at it and every longer one measured) the variant
    decodes faster than the float cache of the same model run; None if it is not faster at the longest."""
    rate = {(p.scheme, p.fused, p.context): p.tokens_per_s for p in points}
    contexts = sorted(c for s, f, c in rate if (s, f) == (scheme, fused) and (FLOAT, False, c) in rate)
    faster = [rate[(scheme, fused, c)] > rate[(FLOAT, False, c)] for c in contexts]
    if not faster or not faster[-1]:
        return None
    first = len(faster)
    while first > 0 and faster[first - 1]:
        first -= 1
    return contexts[first]


# ---- every measurement above, as results records -------------------------------------------------

SPEED_VARIANTS = ((FLOAT, False), ("sym8", False), ("affine8-g64", False), ("affine8-g64", True),
                  ("affine4-g64", False), ("affine4-g64", True), ("kivi4", False), ("outlier4", False),
                  ("outlier4", True))


@dataclass
class KVPlan:
    """Sizes for `bench_kv`; `for_device` picks them for a GPU or the CPU, or a quick check. The perplexity
    covers the whole held-out text per scheme (about 4 minutes a scheme on 2 CPU cores)."""
    ppl_context: int = 0                   # window length: 0, the model's whole context
    ppl_tokens: int = 0                    # held-out tokens per scheme (0: all of them; the same for every scheme)
    needle_context: int = 512
    needle_trials: int = 128
    needle_distances: tuple[int, ...] = (128, 440)
    shapes: tuple[str, ...] = ("stdlib-10m", "Llama-3.2-1B", "Llama-3.1-8B")   # for kv-speed and kv-bytes
    contexts: tuple[int, ...] = (1024, 4096, 16384, 32768)
    variants: tuple[tuple[str, bool], ...] = SPEED_VARIANTS
    speed_tokens: int = 32
    speed_repeats: int = 2
    speed_budget_s: float = 75.0           # per shape

    @classmethod
    def for_device(cls, gpu: bool, quick: bool = False) -> KVPlan:
        if quick:   # seconds on a CPU: checks that everything runs, measures nothing well
            return cls(ppl_context=64, ppl_tokens=64, needle_trials=2, needle_distances=(128,), shapes=("stdlib-10m",),
                       contexts=(64, 256), speed_tokens=3, speed_repeats=1, speed_budget_s=10.0)
        if gpu:
            return cls()
        return cls(needle_trials=32, needle_distances=(440,), shapes=("stdlib-10m",),
                   contexts=(256, 1024, 4096, 16384), speed_tokens=16, speed_repeats=2, speed_budget_s=150.0)


def _fused_failure(scheme: str, args, dtype: mx.Dtype) -> str | None:
    """Why fused attention of `scheme` fails on this device for a model of args' head shape, or None: a
    prefill chunk and a decode step on a small cache (MLX's quantized matmul lacks some cases on CUDA)."""
    cache = kvquant.make_caches(scheme, 1, 1, args.num_key_value_heads, args.head_dim, 8, dtype, fused=True)[0]
    try:
        for L, mask in ((3, "causal"), (1, None)):
            q = mx.zeros((1, args.num_attention_heads, L, args.head_dim), dtype)
            kv = mx.zeros((1, args.num_key_value_heads, L, args.head_dim), dtype)
            mx.eval(cache.attend(q, kv, kv, 1.0, mask))
    except (RuntimeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _speed_model(shape: str, path: Path, context: int) -> Model:
    """The GGUF model at path for "stdlib-10m" (its own weights; past its 512-token context only the speed
    means anything), else a random-weight model of a public Llama shape (`random.args_for`)."""
    if shape == path.stem:
        return load(path)[0]
    return random_model(args_for(shape, context))


def _check_shapes(model: Model, model_path: Path, shapes: Sequence[str], plan: KVPlan) -> None:
    """Fail before anything runs on an unknown shape, or one a scheme cannot hold (e.g. groups of 64 in a
    head of 32)."""
    for shape in shapes:
        a = model.args if shape == model_path.stem else args_for(shape)
        for s, fused in plan.variants:
            try:
                if s != FLOAT:
                    kvquant.make_caches(s, 1, 1, a.num_key_value_heads, a.head_dim, 1, fused=fused)
            except ValueError as e:
                raise ValueError(f"shape {shape} cannot hold a {s} cache: {e}") from e


def kv_name(scheme: str, dtype: str) -> str:
    """The records' name of a cache: the scheme of a quantized one, the dtype ("f16") of the float one."""
    return dtype if scheme == FLOAT else scheme


def _quality_records(model: Model, tokenizer: Tokenizer, name: str, plan: KVPlan, seed: int,
                     say: Callable[[str], None]) -> list[dict]:
    """kv-ppl and kv-needle records of the GGUF model, on the stdlib-10m preset's held-out files."""
    dt = dtype_name(model.norm.weight.dtype)                        # f32 on the CPU, f16 on a GPU
    schemes = (FLOAT, *kvquant.QUANTIZED)
    corpus, fingerprint = read_corpus(config_for("stdlib-10m"))    # its held-out files: never trained on
    context = plan.ppl_context or model.args.max_position_embeddings
    say(f"kv-ppl: {len(schemes)} schemes, {plan.ppl_tokens or 'every'} held-out tokens in windows of {context}")
    stream = token_stream(tokenizer, corpus["heldout"])
    losses = {s: heldout_losses(model, stream, plan.ppl_tokens, context, s) for s in schemes}
    ppl = {s: (perplexity(v), len(v) * context) for s, v in losses.items()}
    rec = []
    for s, (p, tokens) in ppl.items():
        fields = {"model": name, "kv": kv_name(s, dt), "context": context}
        extra = {"windows": tokens // context, "tokens": tokens, "corpus_sha256": fingerprint, "dtype": dt}
        rec += [record("kv-ppl", "heldout_perplexity", "ppl", p, **fields, **extra),
                record("kv-ppl", "ppl_delta", "ppl", p - ppl[FLOAT][0], **fields, **extra)]
    for distance in plan.needle_distances:
        say(f"kv-needle: {plan.needle_trials} trials, needle {distance} tokens back")
        trials = needle_trials(tokenizer, corpus["heldout"], plan.needle_trials, plan.needle_context, distance, seed)
        mean_distance = float(np.mean([t.distance for t in trials]))
        for s, control in [(FLOAT, True)] + [(s, False) for s in schemes]:
            hits, logp = needle_retrieval(model, trials, s, control)
            fields = {"model": name, "kv": kv_name(s, dt), "context": plan.needle_context,
                      "variant": "no-needle" if control else None}
            extra = {"trials": len(trials), "distance": mean_distance, "dtype": dt}
            rec += [record("kv-needle", "retrieval_rate", "fraction", np.mean(hits), samples=hits, **fields, **extra),
                    record("kv-needle", "target_logprob", "nats", np.mean(logp), samples=logp, **fields, **extra)]
    return rec


def _shape_records(model: Model, shape: str, plan: KVPlan, seed: int) -> list[dict]:
    """kv-bytes and kv-speed records of one model: bytes per scheme, then decode speed per variant and
    context (fused variants this device cannot run are "skipped" records), its ratio to the float
    cache, and each variant's crossover context."""
    a, dtype = model.args, model.norm.weight.dtype
    dt = dtype_name(dtype)
    rec = []
    for s in (FLOAT, *kvquant.QUANTIZED):
        per_token, fixed = scheme_bytes(s, a.num_key_value_heads, a.head_dim, dtype)
        rec += [record("kv-bytes", "bytes_per_token", "B", per_token * a.num_hidden_layers, model=shape,
                       kv=kv_name(s, dt), dtype=dt),
                record("kv-bytes", "fixed_bytes", "B", fixed * a.num_hidden_layers, model=shape, kv=kv_name(s, dt),
                       dtype=dt)]
    failed = {s: _fused_failure(s, a, dtype) for s, fused in plan.variants if fused}
    rec += [record("kv-speed", "skipped", None, None, model=shape, weights=dt.upper(), kv=s, variant="fused", note=note)
            for s, note in failed.items() if note]
    variants = [(s, fused) for s, fused in plan.variants if not (fused and failed[s])]
    points = decode_speed(model, shape, variants, plan.contexts, plan.speed_tokens, plan.speed_repeats,
                          plan.speed_budget_s, seed)
    floats = {p.context: p.tokens_per_s for p in points if p.scheme == FLOAT}
    for p in points:
        fields = {"model": shape, "weights": dt.upper(), "kv": kv_name(p.scheme, dt), "context": p.context,
                  "variant": "fused" if p.fused else "dequantized" if p.scheme != FLOAT else None}
        rec += [record("kv-speed", "tokens_per_s", "tok/s", p.tokens_per_s, samples=p.tokens_per_s_runs, **fields,
                       tokens=plan.speed_tokens),
                record("kv-speed", "itl_p50_ms", "ms", p.itl_p50_ms, **fields),
                record("kv-speed", "vs_float", "ratio", p.tokens_per_s / floats[p.context], **fields),
                record("kv-speed", "cache_bytes", "B", p.cache_bytes, **fields)]
    rec += [record("kv-speed", "crossover_context", "tokens", crossover(points, s, fused), model=shape,
                   weights=dt.upper(), kv=s, variant="fused" if fused else "dequantized", contexts=sorted(floats))
            for s, fused in variants if s != FLOAT]
    return rec


def bench_kv(model_path: str | Path, plan: KVPlan | None = None, shapes: Sequence[str] | None = None,
             seed: int = 0, progress=None) -> list[dict]:
    """Records "kv-ppl" (held-out perplexity and its delta vs float per scheme: the GGUF model on the stdlib-10m
    preset's held-out files, `evaluate.heldout_losses`), "kv-needle" (retrieval rate and
    log-prob per scheme and distance, plus the float cache on the control prompts), "kv-bytes" (bytes
    per token per scheme and model shape, from nbytes) and "kv-speed" (tok/s per shape, scheme,
    context and attention path, its ratio to float, and the crossover context). `shapes` overrides
    plan.shapes (the GGUF model's file stem, "stdlib-10m", names the GGUF model itself). The float
    cache is recorded under its dtype (kv "f16" or "f32"), a quantized one under its scheme."""
    plan = plan or KVPlan.for_device(mx.default_device() == mx.gpu)
    model_path = Path(model_path)
    if not model_path.is_file():
        raise OSError(f"no model file {model_path}")
    shapes = tuple(shapes or plan.shapes)
    model, tokenizer = load(model_path)
    _check_shapes(model, model_path, shapes, plan)
    say = progress or (lambda msg: None)
    rec = _quality_records(model, tokenizer, model_path.stem, plan, seed, say)
    del model
    gc.collect()
    for shape in shapes:
        say(f"kv-bytes, kv-speed: {shape} at contexts {', '.join(map(str, plan.contexts))}")
        model = _speed_model(shape, model_path, max(plan.contexts) + plan.speed_tokens + 2)
        rec += _shape_records(model, shape, plan, seed)
        del model
        gc.collect()
        mx.clear_cache()
    return rec
