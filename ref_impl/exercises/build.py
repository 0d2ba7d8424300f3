"""Build it yourself, the finale: the learner's pieces assembled into a decoder that runs the shipped model.

Each step notebook of book/build-it checks one piece. The finale runs every step notebook in its own kernel,
so the learner's functions and the worked solutions (`worked_<name>`) are all defined there; `progress` runs
every piece's check again and picks, per piece, the learner's where it passes and the worked solution where it
does not yet, saying which. `load_with` builds a model from a GGUF file through the learner's reader and Q8_0
dequantizer (the engine's Model class holds the arrays); `decode_with` runs it through the learner's transformer
parts (engine.model.Parts), cache, decode loop and sampler.

See chapter: build-finale
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np

from ref_impl import exercises
from ref_impl.engine.checkpoint import gguf_to_mlx_name
from ref_impl.engine.model import Model, ModelArgs, Parts
from ref_impl.engine.tokenizer import Tokenizer
from ref_impl.exercises.core import Result
from ref_impl.formats.ggml import BLOCK, GGMLType


@dataclass(frozen=True)
class Piece:
    """One piece the learner writes: its step, its name in the step's notebook, and the checker that judges it."""
    step: int
    name: str
    check: str


PIECES = (
    Piece(1, "read_value", "check_read_value"),
    Piece(1, "read_gguf", "check_read_gguf"),
    Piece(2, "dequantize_q8_0", "check_dequantize_q8_0"),
    Piece(2, "dequantize_q4_k", "check_dequantize_q4_k"),
    Piece(3, "rms_norm", "check_rms_norm"),
    Piece(3, "rope", "check_rope"),
    Piece(3, "attend", "check_attend"),
    Piece(3, "mlp", "check_mlp"),
    Piece(4, "Cache", "check_cache"),
    Piece(4, "decode", "check_decode"),
    Piece(5, "sample", "check_sample"),
    Piece(6, "quantize_sym8", "check_quantize_sym8"),
    Piece(6, "dequantize_sym8", "check_dequantize_sym8"),
    Piece(6, "Sym8Cache", "check_sym8_cache"),
    Piece(7, "accept", "check_accept"),
)
STEP_NOTEBOOKS = ("01-gguf-reader", "02-dequantize", "03-transformer-block", "04-kv-cache-and-decode",
                  "05-sampling", "06-quantized-kv-cache", "07-speculative-acceptance")


def progress(namespace: dict) -> tuple[list[tuple], dict[str, Callable]]:
    """Every piece's check on the learner's code in `namespace`: rows (step, piece, what the finale runs, the
    check's message), and the pieces to run: the learner's where its check passes, the worked solution else."""
    rows, chosen = [], {}
    for p in PIECES:
        mine = namespace.get(p.name)
        result = getattr(exercises, p.check)(mine) if mine is not None else \
            Result(False, f"{p.name} is not defined: run step {p.step}'s notebook")
        rows.append((p.step, p.name, "yours" if result else "the worked solution", repr(result)))
        chosen[p.name] = mine if result else namespace[f"worked_{p.name}"]
    return rows, chosen


def load_with(read_gguf: Callable, dequantize_q8_0: Callable, path: Path) -> tuple[Model, Tokenizer]:
    """The model and tokenizer of an F32/Q8_0 GGUF file, read by the learner's `read_gguf` and dequantized by
    their `dequantize_q8_0`, held in float32 by the engine's Model."""
    metadata, tensors, data_offset = read_gguf(path)
    args = ModelArgs.from_gguf(metadata, {n: SimpleNamespace(shape=tuple(s)) for n, (_, s, _) in tensors.items()})
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    weights = []
    for name, (kind, shape, offset) in tensors.items():
        n = int(np.prod(shape))
        per_block, block_bytes = BLOCK[GGMLType(kind)]
        start = data_offset + offset
        data = raw[start:start + n // per_block * block_bytes]
        if kind == GGMLType.F32:
            x = data.view(np.float32)
        elif kind == GGMLType.Q8_0:
            x = np.asarray(dequantize_q8_0(np.array(data), n), dtype=np.float32)
        else:
            raise ValueError(f"{name} is {GGMLType(kind).name}: the finale's file holds F32 and Q8_0 tensors only")
        weights.append((gguf_to_mlx_name(name), mx.array(x.reshape(shape))))
    model = Model(args)
    model.load_weights(weights)
    mx.eval(model.parameters())
    return model, Tokenizer.from_gguf_metadata(metadata)


def decode_with(pieces: dict[str, Callable], model: Model, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens after the prompt through the pieces: the transformer parts, the cache, the decode loop
    and the sampler at temperature 0."""
    a = model.args
    model.use(Parts(pieces["rms_norm"], pieces["rope"], pieces["attend"], pieces["mlp"]))

    def make_cache():
        return [pieces["Cache"](1, a.num_key_value_heads, a.head_dim, len(prompt) + n, mx.float32)
                for _ in range(a.num_hidden_layers)]

    tokens = pieces["decode"](model, prompt, n, make_cache, lambda logits: pieces["sample"](logits, 0.0, 0, 1.0, None))
    return [int(t) for t in tokens]
