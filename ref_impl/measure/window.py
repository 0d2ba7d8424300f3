"""What a sliding window does to the KV cache: the bytes the decoder holds against the context, and the decode
speed that follows.

A sliding-window layer's query sees only the `window` newest positions, its own included (llama.cpp masks a key at
p0 from a query at p1 when p1 - p0 >= window), so its cache need keep no more, whatever the context. Gemma 3 slides
in five layers of every six; the sixth attends to everything. `bench --window` measures both sides of that:

* "kv-window-bytes": the caches the decoder builds (`Model.make_cache`) for Gemma-3-12B's shape (theory/shapes.py:
  48 layers, 8 KV heads of 256, a window of 1,024 in five layers of six) at each context from 1k to 128k positions,
  in float16 (a GPU's cache), with the window and with every layer global, beside theory's count
  (`roofline.kv_cache_bytes`). Nothing is allocated: MLX is lazy, so a model of that shape and its caches are
  graphs whose `nbytes` the shapes give while no array is evaluated; each record carries the bytes MLX did allocate
  while building them (`allocated_bytes`, a few kB), the check that the 9 GB never were. The decoder's
  `WindowKVCache` keeps window - 1 positions plus a margin for speculative rewinds and room to write
  (engine/kvcache.py), so a sliding layer holds a constant few hundred positions more than theory's `window`.
* "kv-window-decode": a tiny random-weight gemma3 file (`TINY`: six layers, five of them sliding) decoded greedily
  after growing contexts, and a copy of it whose `gemma3.attention.sliding_window` covers every position (the
  window off; the same code path, masks and all): tokens/s, the cache allocated, and the keys and values the next
  step's attention reads (its caches' filled part), which stop growing in the sliding layers.

    python -m ref_impl bench --window --label cpu-2core

References: llama.cpp src/llama-hparams.h (`is_masked_swa`), src/llama-hparams.cpp (`set_swa_pattern`),
src/llama-kv-cache-iswa.cpp (llama.cpp's own sliding-window cache: window + a micro-batch, padded to 256 cells).
See chapter: kv-cache
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import mlx.core as mx
import numpy as np

from ref_impl.engine.architectures import ARCHITECTURES, swa_layers
from ref_impl.engine.checkpoint import load_model
from ref_impl.engine.kvcache import Cache, WindowKVCache
from ref_impl.engine.model import DTYPES, Model, ModelArgs
from ref_impl.engine.random import write_random_model
from ref_impl.formats import gguf
from ref_impl.measure.kv import decode_after, fill_random
from ref_impl.measure.records import dtype_name, record
from ref_impl.platform.timing import decode_metrics, interleaved, median
from ref_impl.theory import roofline
from ref_impl.theory.shapes import ModelShape, shape as named_shape

BYTES, DECODE = "kv-window-bytes", "kv-window-decode"          # the two experiments
WINDOWED, ALL_GLOBAL, WINDOW_OFF = "sliding window", "all global", "window off"   # their variants
TINY_NAME = "tiny-gemma3"
# the decoded model: attention wide enough (4 KV heads of 128) that at long contexts its cache outweighs its weights
TINY = dict(vocab_size=1024, hidden_size=256, num_hidden_layers=6, intermediate_size=512, num_attention_heads=4,
            num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6, rope_theta_local=10000.0)
Say = Callable[[str], None]


@dataclass(frozen=True)
class WindowPlan:
    """What bench --window measures: the shape and contexts of the byte count, and the tiny model's decode."""
    shape: str = "Gemma-3-12B"                 # a shape of theory/shapes.py with a sliding window
    contexts: tuple[int, ...] = tuple(1024 << i for i in range(8))   # 1k .. 128k positions
    cache_dtype: str = "float16"               # the byte count's cache (a GPU's); a key of model.DTYPES
    decode_window: int = 256                   # the tiny model's window
    decode_contexts: tuple[int, ...] = (256, 512, 1024, 2048, 4096, 8192, 16384)
    decode_tokens: int = 32                    # per timed run; a WindowKVCache rewinds at most 64 (its margin)
    repeats: int = 7                           # timed runs per variant and context, after one warm-up run each
    seed: int = 0

    def __post_init__(self):
        if not self.contexts or not self.decode_contexts or min(*self.contexts, *self.decode_contexts) < 1:
            raise ValueError(f"WindowPlan contexts must be positive and non-empty, got {self.contexts} and "
                             f"{self.decode_contexts}")
        if self.cache_dtype not in DTYPES:
            raise ValueError(f"WindowPlan cache_dtype {self.cache_dtype!r}: one of {', '.join(DTYPES)}")
        if not 2 <= self.decode_tokens <= 48 or self.repeats < 1 or self.decode_window < 1:
            raise ValueError(f"WindowPlan needs 2 <= decode_tokens <= 48 (within a window cache's rewind margin), "
                             f"repeats >= 1 and decode_window >= 1; got {self.decode_tokens}, {self.repeats}, "
                             f"{self.decode_window}")

    @classmethod
    def quick(cls) -> WindowPlan:
        """Seconds: two byte contexts, and the tiny model past its window at one context only."""
        return cls(contexts=(1024, 8192), decode_window=32, decode_contexts=(64, 512), decode_tokens=4, repeats=1)


# ---- the bytes of a large model's caches, built but never allocated ----------------------------------------

def gemma_args(shape: ModelShape, context: int, window: bool = True) -> ModelArgs:
    """The decoder's ModelArgs of a sliding-window shape (gemma3: its window in all layers but one of every
    `global_every`, llama.cpp's pattern), attending to `context` positions; window=False: every layer global."""
    if not shape.sliding_window:
        raise ValueError(f"{shape.name} has no sliding window (ModelShape.sliding_window is 0): nothing to compare")
    n = shape.num_hidden_layers
    return ModelArgs(shape.vocab_size, shape.hidden_size, n, shape.intermediate_size, shape.num_attention_heads,
                     shape.num_key_value_heads, shape.head_dim, max_position_embeddings=context,
                     tie_word_embeddings=shape.tie_word_embeddings, architecture="gemma3",
                     sliding_window=shape.sliding_window if window else 0,
                     sliding_layers=swa_layers(n, shape.global_every) if window else ())


def unbuilt_caches(args: ModelArgs, context: int, dtype: mx.Dtype) -> tuple[list[Cache], int]:
    """The caches `Model.make_cache(context)` builds for a model of args in `dtype`, with the model and the caches
    left unevaluated (MLX is lazy: no buffer exists until an array is evaluated), and the bytes MLX allocated
    while building them. Their nbytes come from the shapes; evaluating them would allocate it all."""
    before = mx.get_active_memory()
    model = Model(args)
    model.set_dtype(dtype)
    caches = model.make_cache(context)
    return caches, mx.get_active_memory() - before


def split_bytes(caches: Sequence[Cache]) -> tuple[int, int]:
    """(bytes of the sliding layers' caches, bytes of the global layers')."""
    sliding = sum(c.nbytes for c in caches if isinstance(c, WindowKVCache))
    return sliding, sum(c.nbytes for c in caches) - sliding


def byte_records(plan: WindowPlan, say: Say) -> list[dict]:
    """kv-window-bytes: per context and variant (the window, every layer global), the bytes of the caches the
    decoder builds (with the sliding and global layers' shares and the bytes MLX allocated building them), theory's
    count, and the bytes per position of context. A RuntimeError when building them allocated their bytes."""
    shape, dtype = named_shape(plan.shape), DTYPES[plan.cache_dtype]
    dt, out = dtype_name(dtype), []
    say(f"kv-window-bytes: {shape.name}, contexts {', '.join(map(str, plan.contexts))}")
    for context in plan.contexts:
        for variant, window in ((WINDOWED, True), (ALL_GLOBAL, False)):
            caches, allocated = unbuilt_caches(gemma_args(shape, context, window), context, dtype)
            sliding, global_ = split_bytes(caches)
            total = sliding + global_
            if allocated > total / 100:
                raise RuntimeError(f"building {shape.name}'s caches for {context} positions allocated {allocated} "
                                   f"of their {total} bytes: something evaluated them")
            held = next((c.keys.shape[2] for c in caches if isinstance(c, WindowKVCache)), None)
            theory = roofline.kv_cache_bytes(shape if window else replace(shape, sliding_window=0), context,
                                             dtype.size)
            fields = dict(model=shape.name, kv=dt, context=context, variant=variant)
            out += [record(BYTES, "cache_bytes", "B", total, **fields, sliding_layers_bytes=sliding,
                           global_layers_bytes=global_, allocated_bytes=allocated, window_positions=held,
                           window=shape.sliding_window if window else None),
                    record(BYTES, "theory_bytes", "B", theory, **fields),
                    record(BYTES, "bytes_per_token", "B", total / context, **fields)]
            del caches
    gc.collect()
    return out


# ---- a tiny gemma3 decoded with its window and without -------------------------------------------------------

def tiny_args(window: int, context: int) -> ModelArgs:
    """The tiny gemma3 of `TINY`: five sliding layers of six (llama.cpp's gemma3 pattern) with `window`."""
    layers = TINY["num_hidden_layers"]
    return ModelArgs(**TINY, architecture="gemma3", max_position_embeddings=context, sliding_window=window,
                     sliding_layers=swa_layers(layers, ARCHITECTURES["gemma3"].swa_pattern))


def window_shape(args: ModelArgs, name: str) -> ModelShape:
    """A gemma3 model's shape for theory's arithmetic, its window and global layers included."""
    return replace(args.shape(name), sliding_window=args.sliding_window,
                   global_every=ARCHITECTURES["gemma3"].swa_pattern, norms_per_layer=4)


def decode_files(work: Path, plan: WindowPlan) -> dict[str, Path]:
    """variant -> GGUF file: the tiny gemma3 with random F32 weights, and a copy whose window key covers every
    position a decode of the plan reaches (the window off, as a file can say it)."""
    reach = max(plan.decode_contexts) + plan.decode_tokens + 8
    path = write_random_model(work / f"{TINY_NAME}.gguf", tiny_args(plan.decode_window, reach), "F32", plan.seed)
    off = work / f"{TINY_NAME}-window-off.gguf"
    with gguf.read(path) as f:
        fields = {**f.fields, "gemma3.attention.sliding_window": gguf.Value(gguf.ValueType.UINT32, reach)}
        gguf.write(off, fields, {n: f.tensor_data(n) for n in f.tensors})
    return {WINDOWED: path, WINDOW_OFF: off}


def read_bytes(caches: Sequence[Cache]) -> int:
    """Bytes of the keys and values the caches hold filled: what the next step's attention reads, but its own."""
    return sum(k.nbytes + v.nbytes for k, v in (c.state for c in caches))


def timed_runs(models: dict[str, Model], caches: dict[str, list[Cache]], context: int, plan: WindowPlan
               ) -> dict[str, list]:
    """variant -> `plan.repeats` timed greedy decodes of plan.decode_tokens after `context` cached positions: a
    warm-up run of each variant, then the variants interleaved round by round (a machine's drift falls on each
    alike); each run's caches trimmed back to `context` after it."""
    token = int(np.random.default_rng(plan.seed).integers(1, TINY["vocab_size"]))
    return interleaved({v: partial(decode_after, model, caches[v], token, plan.decode_tokens, context)
                        for v, model in models.items()}, plan.repeats)


def decode_records(files: dict[str, Path], plan: WindowPlan, say: Say) -> list[dict]:
    """kv-window-decode: per context (shortest first) and variant, decode tokens/s, the ITL's median, the caches'
    bytes allocated, the bytes attention reads per token, and theory's count of the latter; and the windowed
    model's speed over the window-off model's, the median of the rounds' ratios."""
    models = {}
    for v, path in files.items():
        with gguf.read(path) as f:
            models[v] = load_model(f, mx.float32)
    dt = dtype_name(mx.float32)
    theory = {v: window_shape(m.args, TINY_NAME) for v, m in models.items()}
    out = []
    for context in sorted(plan.decode_contexts):
        say(f"kv-window-decode: {TINY_NAME}, {context} positions, {', '.join(models)}")
        caches = {v: m.make_cache(context + plan.decode_tokens + 2) for v, m in models.items()}
        for c in caches.values():
            fill_random(c, context, plan.seed)
        read = {v: read_bytes(c) for v, c in caches.items()}
        runs = timed_runs(models, caches, context, plan)
        metrics = {v: decode_metrics(r, 1) for v, r in runs.items()}
        for v, model in models.items():
            s = metrics[v]
            sliding, global_ = split_bytes(caches[v])
            fields = dict(model=TINY_NAME, weights="F32", kv=dt, context=context, variant=v,
                          window=model.args.sliding_window)
            out += [record(DECODE, "tokens_per_s", "tok/s", s["tokens_per_s"][0], samples=s["tokens_per_s"][1],
                           tokens=plan.decode_tokens, **fields),
                    record(DECODE, "itl_p50_ms", "ms", s["itl_p50_ms"][0], **fields),
                    record(DECODE, "cache_bytes", "B", sliding + global_, sliding_layers_bytes=sliding,
                           global_layers_bytes=global_, **fields),
                    record(DECODE, "read_bytes", "B", read[v], **fields),
                    record(DECODE, "theory_read_bytes", "B",
                           roofline.kv_cache_bytes(theory[v], context, mx.float32.size), **fields)]
        # each round's two runs ran back to back: their ratio is what a machine's drift leaves alone
        ratios = [w / o for w, o in zip(metrics[WINDOWED]["tokens_per_s"][1], metrics[WINDOW_OFF]["tokens_per_s"][1])]
        out.append(record(DECODE, "speed_vs_window_off", "x", median(ratios), samples=ratios, model=TINY_NAME,
                          weights="F32", kv=dt, context=context, variant=WINDOWED, window=plan.decode_window))
        del caches
        gc.collect()
        mx.clear_cache()
    return out


def bench_window(work: Path, plan: WindowPlan = WindowPlan(), progress: Say = lambda s: None) -> list[dict]:
    """bench --window's records: kv-window-bytes (a large shape's caches, built unallocated) and kv-window-decode
    (the tiny gemma3 with its window and without, files written to `work`)."""
    out = byte_records(plan, progress)
    return out + decode_records(decode_files(Path(work), plan), plan, progress)
