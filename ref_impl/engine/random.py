"""Random-weight models: the public shapes, at full size, for measuring speed.

Decode speed depends on a model's shape (bytes per token, kernels per layer), never on its weight
values, so speed is measured on random weights in the real shapes of public models (theory/shapes.py).
Two kinds: an MLX model initialised on the device (`random_model`, float weights, no file), and a
GGUF file typed per tensor as llama.cpp would type it (`write_random_model`), so quantized formats,
our loader and llama.cpp run on the very same bytes.

See chapter: capstone
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from ref_impl.engine import checkpoint
from ref_impl.engine.model import Model, ModelArgs, default_dtype
from ref_impl.formats import ggml, gguf, quantize
from ref_impl.theory.shapes import shape


def args_for(name: str, context: int = 4096) -> ModelArgs:
    """ModelArgs of a named shape (public or stand-in, theory/shapes.py) attending to `context` positions."""
    return ModelArgs.from_shape(shape(name), context)


def random_model(args: ModelArgs, dtype: mx.Dtype | None = None, seed: int = 0,
                 keep: Callable[[Model], None] | None = None) -> Model:
    """A Model of args' shape with MLX's default random initialisation, built on the device (no
    file): decode speed does not depend on the values. keep(model) removes the parts this process will
    not hold before any weight is computed (a pipeline stage's); the rest get the values they would
    have in the whole model, since MLX draws each initial array's key when the layer is built."""
    mx.random.seed(seed)
    model = Model(args)
    if keep is not None:
        keep(model)
    model.set_dtype(dtype or default_dtype())
    mx.eval(model.parameters())
    return model


# fp16 fields of each block (byte offsets) and the largest scale that keeps weights plausible (|w| < ~1)
_SCALE_FIELDS = {"Q4_0": ((0,), 0.1), "Q4_1": ((0, 2), 0.05), "Q5_0": ((0,), 0.05), "Q5_1": ((0, 2), 0.03),
                 "Q8_0": ((0,), 0.008), "Q4_K": ((0, 2), 1e-3), "Q5_K": ((0, 2), 5e-4), "Q6_K": ((208,), 2e-4),
                 "Q2_K": ((80, 82), 0.02), "Q3_K": ((108,), 0.007),           # |w| <= 45 d + 15 dmin; 128 d
                 "IQ4_NL": ((0,), 0.007), "IQ4_XS": ((0,), 2e-4)}             # 127 d; 32 * 127 d (scales_h is no fp16)


def _random_bytes(n: int, rng: np.random.Generator) -> np.ndarray:
    """n random uint8, straight from the bit generator (~4x faster than rng.bytes)."""
    return rng.bit_generator.random_raw(-(-n // 8)).view(np.uint8)[:n]


def random_blocks(type_name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random valid blocks (rows, row_bytes) of a quantized type: random codes and small finite fp16
    scales, generated as bytes (no float quantization), so a multi-GB model takes seconds."""
    values, nbytes = ggml.BLOCK[ggml.GGMLType[type_name]]
    fields, d_max = _SCALE_FIELDS[type_name]
    n_blocks = rows * cols // values
    blocks = _random_bytes(n_blocks * nbytes, rng).reshape(n_blocks, nbytes)
    # an fp16 in [d_max/8, d_max): biased exponent e or e+1, mantissa random -- a few integer ops
    e = int(np.floor(np.log2(d_max))) + 15 - 2
    for at in fields:
        half = blocks[:, at:at + 2].copy().view("<u2")
        half[:] = (half & 0x03FF) + np.uint16(e << 10) + (half & 0x0400)
        blocks[:, at:at + 2] = half.view(np.uint8)
    return blocks.reshape(rows, -1)


def _random_f16(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random float16 (rows, cols), sign random, made from raw bits: |x| in [s/4, s) for the power of two s
    nearest 2 / sqrt(cols), so a row times a unit-RMS input is about 1 (scores and logits that matter)."""
    e = 15 + round(np.log2(2 / np.sqrt(cols))) - 2   # biased exponent of s/4
    bits = _random_bytes(rows * cols * 2, rng).view("<u2").reshape(rows, cols)
    bits &= 0x87FF                                     # sign, mantissa and the exponent's lowest bit (0 or 1)
    bits += np.uint16(e << 10)                         # exponent e or e + 1
    return bits.view("<f2")


def tensor_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor llama.cpp loads for a model of args' architecture and shape, by GGUF name, in GGUF's
    order of dimensions reversed (rows first, as numpy and our reader give them; experts first in 3-D ones)."""
    d, hd, q, kv = args.hidden_size, args.head_dim, args.num_attention_heads, args.num_key_value_heads
    f, e, fe = args.intermediate_size, args.num_experts, args.expert_intermediate_size
    shapes = {"token_embd.weight": (args.vocab_size, d), "output_norm.weight": (d,)}
    if not args.tie_word_embeddings:
        shapes["output.weight"] = (args.vocab_size, d)
    if args.rope_freq_factors is not None and args.architecture == "phi3":
        shapes |= {"rope_factors_long.weight": (hd // 2,), "rope_factors_short.weight": (hd // 2,)}
    for i in range(args.num_hidden_layers):
        p = f"blk.{i}."
        shapes.update({p + "attn_norm.weight": (d,), p + "ffn_norm.weight": (d,),
                       p + "attn_output.weight": (d, q * hd)})
        if args.fused_qkv:
            shapes[p + "attn_qkv.weight"] = ((q + 2 * kv) * hd, d)
        else:
            shapes.update({p + "attn_q.weight": (q * hd, d), p + "attn_k.weight": (kv * hd, d),
                           p + "attn_v.weight": (kv * hd, d)})
        if e:
            shapes.update({p + "ffn_gate_inp.weight": (e, d), p + "ffn_gate_exps.weight": (e, fe, d),
                           p + "ffn_up_exps.weight": (e, fe, d), p + "ffn_down_exps.weight": (e, d, fe)})
        elif args.spec.fused_up:
            shapes.update({p + "ffn_up.weight": (2 * f, d), p + "ffn_down.weight": (d, f)})
        else:
            shapes.update({p + "ffn_gate.weight": (f, d), p + "ffn_up.weight": (f, d), p + "ffn_down.weight": (d, f)})
        if args.attention_bias:
            shapes.update({p + "attn_q.bias": (q * hd,), p + "attn_k.bias": (kv * hd,), p + "attn_v.bias": (kv * hd,)})
        if args.qk_norm:
            shapes.update({p + "attn_q_norm.weight": (hd,), p + "attn_k_norm.weight": (hd,)})
        if args.spec.sandwich_norms:
            shapes.update({p + "post_attention_norm.weight": (d,), p + "post_ffw_norm.weight": (d,)})
    return shapes


def write_random_model(path: str | Path, args: ModelArgs, file_type: str = "Q4_K", seed: int = 0,
                       tokenizer: dict[str, Any] | None = None) -> Path:
    """A GGUF of args' architecture (any of architectures.ARCHITECTURES; Phi-3's with random long and short rope
    factors where args has rope factors) and shape with random weights, typed per tensor
    as llama.cpp's quantizer would type a `file_type` file (quantize.tensor_types: "Q4_K_M" mixes Q4_K and
    Q6_K; "Q4_K", "Q8_0", "F16", "F32", ...), vectors (norms, biases) F32 as llama.cpp's converter writes
    them -- for speed measurements, e.g. Llama-3.1-8B:
    ModelArgs(128256, 4096, 32, 14336, 32, 8, tie_word_embeddings=False) (4.9 GB in Q4_K_M).
    Blocks are random bytes with valid scales: nothing is quantized, so 5 GB take seconds. Float matrices
    are scaled for their width and norms drawn from [0.5, 1.5), so a float file is also a fair test of a
    decoder against llama.cpp. The file has no tokenizer ("none"), so llama.cpp's llama-bench runs on the
    same file, unless `tokenizer` gives one: the `tokenizer.*` keys of a real vocabulary (and its chat template),
    whose size must be args.vocab_size. Returns path."""
    if tokenizer is not None and len(tokenizer.get("tokenizer.ggml.tokens", ())) != args.vocab_size:
        raise ValueError(f"the tokenizer holds {len(tokenizer.get('tokenizer.ggml.tokens', ()))} tokens, the model "
                         f"{args.vocab_size}: make vocab_size the vocabulary's size")
    rng = np.random.default_rng(seed)
    shapes = tensor_shapes(args)
    infos = {n: gguf.TensorInfo(n, ggml.GGMLType.F32, s, 0, 0) for n, s in shapes.items()}
    tensors = {}
    for name, t in quantize.tensor_types(infos, file_type).items():
        shape = shapes[name]
        rows = int(np.prod(shape[:-1]))   # an expert tensor's experts stacked as more rows
        if name.endswith(".bias"):
            tensors[name] = rng.uniform(-0.5, 0.5, shape).astype(np.float32)
        elif name.startswith("rope_factors"):   # Phi-3's per-frequency divisors: above 1, as trained ones are
            tensors[name] = rng.uniform(1.0, 4.0, shape).astype(np.float32)
        elif len(shape) == 1:
            tensors[name] = rng.uniform(0.5, 1.5, shape).astype(np.float32)
        elif t == "F32":
            tensors[name] = _random_f16(rows, shape[-1], rng).astype(np.float32).reshape(shape)
        elif t == "F16":
            tensors[name] = _random_f16(rows, shape[-1], rng).reshape(shape)
        else:
            blocks = random_blocks(t, rows, shape[-1], rng)
            tensors[name] = gguf.TensorData(ggml.GGMLType[t], shape, blocks.reshape(*shape[:-1], -1))
    # no tokenizer ("none"): llama.cpp then adds vocab_size dummy tokens, which is all llama-bench needs
    meta = {**args.gguf_metadata(), "general.file_type": quantize.FILE_TYPES[file_type].ftype}
    vocab = {k: v for k, v in (tokenizer or {}).items() if k.startswith("tokenizer.")}
    gguf.write(path, {**meta, **(vocab or {"tokenizer.ggml.model": "none"})}, tensors)
    return Path(path)


def random_gguf_model(name: str, args: ModelArgs, weight_type: str, work_dir: Path, seed: int = 0,
                      before_load: Callable[[Path], None] | None = None) -> tuple[Model, float]:
    """A random-weight model of args' shape as llama.cpp would type a `weight_type` file, written to a GGUF
    in work_dir and loaded with its quantized tensors kept quantized (checkpoint.load_model); and its
    bits per weight. before_load(path) runs on the file first (a peer on the same file); the file is deleted
    once loaded."""
    path = write_random_model(work_dir / f"{name}-{weight_type}.gguf", args, weight_type, seed)
    try:
        if before_load is not None:
            before_load(path)
        with gguf.read(path) as f:
            model = checkpoint.load_model(f, None, quantized=True)
            weights = sum(int(np.prod(t.shape)) for t in f.tensors.values())
            nbytes = sum(t.nbytes for t in f.tensors.values())
    finally:
        path.unlink()
    return model, 8 * nbytes / weights
