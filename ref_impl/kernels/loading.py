"""Loading a model to decode with: the one place the load-time switches act.

Three switches change what a GGUF file becomes before the first token: how its quantized matrices are
held (`weights`: MLX quantized matrices, or expanded to floats), whether our CUDA GEMV kernels replace
MLX's built-in matmuls where a timing at load finds them faster (`kernels`), and whether whole decoder
layers run as fused launches (kernels/fusedlayer.py; never under a compiled step, which replays MLX's own
operations). `generate`, `chat`, `bench --capstone` and the notebooks load through `load`, so a rung
called "kernels" in the capstone is what `generate --kernels on` runs.

`load` takes an open file, so a caller that checks the metadata first (a chat template, a draft's
vocabulary) reads the file once; `load_file` takes a path.

See chapter: capstone
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx

from ref_impl.engine.checkpoint import load_model, matrix_types
from ref_impl.engine.model import DTYPES, Model
from ref_impl.engine.tokenizer import Tokenizer
from ref_impl.formats import gguf
from ref_impl.kernels import fusedlayer
from ref_impl.kernels.layers import on_cuda
from ref_impl.kernels.launch import MAX_ROWS
from ref_impl.kernels.patching import patch, summary

WEIGHTS = ("auto", "native", "float")
KERNELS = ("auto", "on", "off")
ACTIVATIONS = ("float", "int8")


@dataclass(frozen=True)
class LoadOptions:
    """The load-time switches; a setting that cannot run here raises a ValueError naming it."""
    weights: str = "auto"          # native: MLX quantized matrices; float: expanded; auto: native on a GPU
    kernels: str = "auto"          # on: our CUDA kernels where faster (fails off CUDA); auto: on CUDA only
    dtype: str | None = None       # a key of DTYPES; None: float32 on the CPU, float16 on a GPU
    rows: tuple[int, ...] = (1,)   # activation rows the kernels are timed for (gamma + 1 when verifying)
    compiled: bool = False         # the decode step is mx.compile'd: no fused layers
    activations: str = "float"     # int8: the fused layers' quantized matrices meet int8 copies of their inputs

    def __post_init__(self):
        bad = [f"{name} {value!r} (one of {', '.join(map(str, choices))})" for name, value, choices in
               [("weights", self.weights, WEIGHTS), ("kernels", self.kernels, KERNELS),
                ("dtype", self.dtype, (*DTYPES, None)), ("activations", self.activations, ACTIVATIONS)]
               if value not in choices]
        if bad:
            raise ValueError("invalid load settings: " + ", ".join(bad))
        if self.kernels == "on" and not on_cuda():
            raise ValueError(f"--kernels on: our GEMV kernels need MLX's CUDA backend; this is {mx.default_device()}")
        if self.activations == "int8" and (not self.patched or self.compiled):
            why = ("--kernels off" if self.kernels == "off" else "--compile" if on_cuda()
                   else f"this is {mx.default_device()}, not MLX's CUDA backend")
            raise ValueError(f"--activations int8 is a setting of the fused CUDA layers, which do not run here: {why}")

    @property
    def quantized(self) -> bool:
        """Whether quantized tensors stay MLX quantized: MLX's quantized matmuls pay off on a GPU; on the CPU
        its float32 BLAS path is faster (see chapter k-quants)."""
        return self.weights == "native" or (self.weights == "auto" and mx.default_device() != mx.cpu)

    @property
    def patched(self) -> bool:
        """Whether our kernels are swapped in (they run on MLX's CUDA backend only)."""
        return self.kernels != "off" and on_cuda()


@dataclass
class Loaded:
    """A model ready to decode, its tokenizer, the file's metadata, and what loading chose, in words."""
    model: Model
    tokenizer: Tokenizer | None
    metadata: dict[str, Any]
    matrix_types: str                              # the file's matrix types, most common first: "Q4_K/Q6_K"
    options: LoadOptions
    report: list[str] = field(default_factory=list)   # one line per choice the kernels made at load

    def describe(self) -> str:
        """How the weights are held and whether kernels run: "weights Q4_K/Q6_K as MLX quantized, kernels off"."""
        held = "MLX quantized" if self.options.quantized else str(self.model.norm.weight.dtype).split(".")[-1]
        return f"weights {self.matrix_types} as {held}, kernels {'patched' if self.options.patched else 'off'}"


def load(f: gguf.GGUFFile, options: LoadOptions = LoadOptions(), tokenizer: bool = True) -> Loaded:
    """The model of an open GGUF file with the load-time switches applied (weights held as asked; our kernels
    and fused layers swapped in where a timing at load finds them faster), and its tokenizer."""
    model = load_model(f, DTYPES[options.dtype] if options.dtype else None, options.quantized)
    loaded = Loaded(model, Tokenizer.from_gguf_metadata(f.metadata) if tokenizer else None, dict(f.metadata),
                    matrix_types(f), options)
    if options.patched:
        rows = tuple(r for r in options.rows if r <= MAX_ROWS) or (1,)
        loaded.report += [summary(patch(model, rows=rows, fuse=True)),
                          fused_layers(model, options.compiled, options.activations == "int8")]
    return loaded


def load_file(path: str | Path, options: LoadOptions = LoadOptions()) -> Loaded:
    """load, on the file at `path` (opened and closed here)."""
    with gguf.read(path) as f:
        return load(f, options)


def fused_layers(model: Model, compiled: bool, int8: bool = False) -> str:
    """Run decode through the fused decoder layers (int8: their quantized matrices with int8 activations), with
    the kernel pairs merged or not, as a measurement at load finds fastest; the line that says what was chosen and
    why."""
    if compiled:
        return "fused layers: off (--compile replays one traced graph of MLX's own operations)"
    left = fusedlayer.fuse(model, int8=int8)
    if len(left) == len(model.layers):
        return f"fused layers: none ({next(iter(left.values()))})"
    way, ms = fusedlayer.choose(model)
    n_int8 = sum(isinstance(b, fusedlayer.FusedLayer) and b.plan.int8 for b in model.layers)
    acts = f", {n_int8} with int8 activations" if int8 else ""
    return (f"fused layers: {way} for {len(model.layers) - len(left)} of {len(model.layers)} layers{acts} "
            f"(decode ms/token: {', '.join(f'{k} {v:.2f}' for k, v in ms.items())}; +: a pair as one launch)"
            + "".join(f"; layer {i}: {why}" for i, why in list(left.items())[:3]))
