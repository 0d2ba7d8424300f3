"""Whole-model quantization: which GGML type each tensor gets, and a GGUF file in, a GGUF file out.

A "file type" such as Q4_K_M is not one format but a mixture. llama.cpp's `llama-quantize` picks a
type per tensor (src/llama-quant.cpp, `llama_tensor_get_type_impl`); for the llama architecture
(and qwen2/qwen3, whose rules are the same) and the file types below the rules are:

- 1-D tensors (the norms), a mixture of experts' router (`ffn_gate_inp`) and anything not ending in "weight"
  stay as they are (F32).
- The output matrix gets Q6_K unless the file type is Q8_0. With tied embeddings llama.cpp treats
  `token_embd` as the output matrix, so it gets Q6_K too; an untied `token_embd` keeps the default.
- Q4_K_M: `attn_v` and `ffn_down` get Q6_K in "more bits" layers: the first eighth, the last
  eighth, and every third layer in between (`use_more_bits(i, n)`: i < n/8, i >= 7n/8, or
  (i - n/8) % 3 == 2). Everything else is Q4_K.
- Q3_K_M: the first two `attn_v` get Q5_K, the others Q4_K; `ffn_down` gets Q5_K in the first
  sixteenth of the layers (i < n/16), Q4_K elsewhere; `attn_output` Q4_K. Everything else is Q3_K.
- Q3_K_L: `attn_v`, `ffn_down` and `attn_output` get Q5_K; Q3_K_S has no rule beyond the output.
- Q2_K: `attn_v` gets Q4_K where query heads share a key head four or more ways (n_head / n_head_kv
  >= 4), Q3_K otherwise; `ffn_down` and `attn_output` get Q3_K. Everything else is Q2_K.
- Shape fallback: a K-quant needs rows whose length is a multiple of 256. If it is not, Q4_K falls
  back to Q5_0, Q5_K to Q5_1, Q6_K to Q8_0, and Q2_K and Q3_K to Q4_0 (blocks of 32); the output
  rule itself goes straight to Q8_0 (32 divides the row, 256 does not). A row that 32 does not
  divide either becomes F16.

llama.cpp's further rules for mixture-of-experts, Falcon and 70B models are left out. `--type Q4_K`
is every matrix in Q4_K with the shape fallback only: llama.cpp's `llama-quantize --pure ... Q4_K_S`.
The other names are llama.cpp's file types of the same name. No importance matrix is used, so the
quantizers are llama.cpp's reference ones (`ref_impl.formats.kquants`, `ref_impl.formats.lowbits`).

See chapter: kquants
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass

import numpy as np

from ref_impl.formats import gguf, kquants, lowbits
from ref_impl.formats.ggml import GGMLType, block_size
from ref_impl.platform.quiet import held_stderr


@dataclass(frozen=True)
class FileType:
    """One llama.cpp file type: its `general.file_type` id, default tensor type, and mixture rules."""
    name: str
    ftype: int          # llama.h LLAMA_FTYPE_*, stored as general.file_type
    default: str        # GGML type of a matrix without a special rule
    mixture: bool       # apply llama.cpp's per-tensor rules (False: --pure)


FILE_TYPES = {ft.name: ft for ft in (
    FileType("F32", 0, "F32", False),
    FileType("F16", 1, "F16", False),
    FileType("Q8_0", 7, "Q8_0", True),
    FileType("Q6_K", 18, "Q6_K", True),
    FileType("Q4_K_M", 15, "Q4_K", True),
    FileType("Q4_K", 14, "Q4_K", False),    # LLAMA_FTYPE_MOSTLY_Q4_K_S with --pure
    FileType("Q4_0", 2, "Q4_0", True),
    FileType("Q3_K_L", 13, "Q3_K", True),
    FileType("Q3_K_M", 12, "Q3_K", True),
    FileType("Q3_K_S", 11, "Q3_K", True),
    FileType("Q2_K", 10, "Q2_K", True),
)}
# llama.cpp's own published numbers for Llama-3-8B: file size (GiB) and perplexity increase over F16,
# from the QUANT_OPTIONS table of tools/quantize/quantize.cpp (the llama.cpp llama-cpp-python 0.3.36
# vendors). Llama-3-8B has 8,030,261,248 weights (meta-llama/Meta-Llama-3-8B, model.safetensors.index.json).
LLAMA3_8B_WEIGHTS = 8_030_261_248
LLAMA_CPP_PUBLISHED = {"Q3_K_M": (3.74, 0.6569), "Q4_0": (4.34, 0.4685), "Q4_K_S": (4.37, 0.2689),
                       "Q4_K_M": (4.58, 0.1754), "Q5_0": (5.21, 0.1316), "Q5_K_M": (5.33, 0.0569),
                       "Q6_K": (6.14, 0.0217), "Q8_0": (7.96, 0.0026)}
QUANTIZATION_VERSION = 2  # ggml.h GGML_QNT_VERSION, written as general.quantization_version
FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
# GGML type name -> quantizer, float32 (..., n) -> uint8 (..., row_bytes): every type a file type can give
QUANTIZE = {**kquants.QUANTIZE, **lowbits.QUANTIZE}


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """Q4_K_M's layers that get Q6_K: the first and last eighth, and every third one between."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def _fallback(type_name: str, row: int) -> str:
    """The type llama.cpp uses when `row` values do not fill whole blocks of `type_name`."""
    if row % block_size(type_name) == 0:
        return type_name
    smaller = FALLBACK.get(type_name, type_name)
    return smaller if row % block_size(smaller) == 0 else "F16"


def llama_order(names) -> list[str]:
    """Tensor names in the order llama.cpp's loader keeps them (and writes them): names outside the
    blocks first, then block by block in layer order, each sorted by name. The Q4_K_M counters run in it."""
    def key(name: str):
        parts = name.split(".")
        if parts[0] == "blk" and len(parts) > 2 and parts[1].isdigit():
            return (1, int(parts[1]), name)
        return (0, 0, name)
    return sorted(names, key=key)


def _rule(file_type: str, kind: str, i: int, n: int, n_gqa: int) -> str | None:
    """llama_tensor_get_type_impl's type for the i-th of n `kind` matrices ("attn_v", "ffn_down",
    "attn_output") in a `file_type` file; None where the file type's default stands."""
    if kind == "attn_v":
        return {"Q2_K": "Q4_K" if n_gqa >= 4 else "Q3_K", "Q3_K_M": "Q5_K" if i < 2 else "Q4_K", "Q3_K_L": "Q5_K",
                "Q4_K_M": "Q6_K" if use_more_bits(i, n) else None}.get(file_type)
    if kind == "ffn_down":
        return {"Q2_K": "Q3_K", "Q3_K_M": "Q5_K" if i < n // 16 else "Q4_K", "Q3_K_L": "Q5_K",
                "Q4_K_M": "Q6_K" if use_more_bits(i, n) else None}.get(file_type)
    if kind == "attn_output":
        return {"Q2_K": "Q3_K", "Q3_K_M": "Q4_K", "Q3_K_L": "Q5_K"}.get(file_type)
    return None


# llama.cpp's `category_is_attn_v`: a fused q-k-v matrix (Phi-3) follows the attn_v rules, and counts among them
V_MATRICES = ("attn_v.weight", "attn_qkv.weight")
# the file types whose attn_output llama.cpp raises to Q5_K in a model of 8 experts (llama-quant.cpp)
EIGHT_EXPERT_Q5_K_OUTPUT = ("Q2_K", "Q3_K_S", "Q3_K_M", "Q4_K_M")


def _n_gqa(tensors: dict[str, gguf.TensorInfo]) -> int:
    """llama.cpp's n_head / n_head_kv (layer 0), read off the projections: attn_q has n_head * head_dim
    rows, attn_k n_head_kv * head_dim. 1 where a layer 0 lacks either."""
    q, k = tensors.get("blk.0.attn_q.weight"), tensors.get("blk.0.attn_k.weight")
    return q.shape[0] // k.shape[0] if q is not None and k is not None else 1


def tensor_types(tensors: dict[str, gguf.TensorInfo], file_type: str) -> dict[str, str]:
    """The GGML type llama.cpp's `llama-quantize` gives every tensor of a llama model for `file_type`."""
    if file_type not in FILE_TYPES:
        raise ValueError(f"unknown file type {file_type!r}; choose one of {', '.join(FILE_TYPES)}")
    ft = FILE_TYPES[file_type]
    n_layers = 1 + max((int(n.split(".")[1]) for n in tensors if n.startswith("blk.")), default=-1)
    n_attn_v = sum(n.endswith(V_MATRICES) for n in tensors)
    tied = "output.weight" not in tensors
    router = tensors.get("blk.0.ffn_gate_inp.weight")
    eight_experts = router is not None and router.shape[0] == 8   # llama.cpp's `hparams.n_expert == 8` rules
    i_attn_v = 0
    types = {}
    for name in llama_order(tensors):
        info = tensors[name]
        # llama.cpp never quantizes a mixture of experts' router (llama-quant.cpp: "ffn_gate_inp.weight")
        if len(info.shape) < 2 or not name.endswith("weight") or name.endswith(("_norm.weight", "ffn_gate_inp.weight")):
            types[name] = info.type.name
            continue
        new = ft.default
        quantized = new not in ("F32", "F16")
        row = info.shape[-1]
        if quantized and ft.mixture:  # llama_tensor_get_type_impl, for the llama architecture
            if name == "output.weight" or (tied and name == "token_embd.weight"):
                if row % block_size(new):
                    new = "Q8_0"
                elif new != "Q8_0":
                    new = "Q6_K"
            elif name.endswith(V_MATRICES):     # counted over those matrices, in llama_order
                new = _rule(file_type, "attn_v", i_attn_v, n_attn_v, _n_gqa(tensors)) or new
                new = "Q8_0" if eight_experts else new   # llama.cpp: "for the 8-expert model ... ~128MB"
                i_attn_v += 1
            elif "attn_k.weight" in name and eight_experts:
                new = "Q8_0"
            elif "attn_output.weight" in name:
                new = ("Q5_K" if file_type in EIGHT_EXPERT_Q5_K_OUTPUT else new) if eight_experts else \
                    _rule(file_type, "attn_output", 0, n_layers, 0) or new
            elif "ffn_down" in name:
                new = _rule(file_type, "ffn_down", int(name.split(".")[1]), n_layers, 0) or new
        types[name] = _fallback(new, row) if quantized else new
    return types


def as_float32(f: gguf.GGUFFile, name: str) -> np.ndarray:
    """Tensor `name` of a float file as float32; a ValueError if it is already quantized."""
    info = f.tensors[name]
    if info.type.name not in ("F32", "F16", "BF16"):
        raise ValueError(f"tensor {name!r} is already {info.type.name}; quantize from an F32, F16 or "
                         "BF16 file (requantizing compounds the errors, and llama.cpp refuses it too)")
    return f.dequantize(name).astype(np.float32)


def convert(x: np.ndarray, type_name: str) -> np.ndarray | gguf.TensorData:
    """A float32 tensor in GGML type `type_name`: a float array, or quantized blocks as TensorData."""
    if type_name == "F32":
        return x
    if type_name == "F16":
        return x.astype(np.float16)
    if type_name not in QUANTIZE:
        raise ValueError(f"no quantizer for {type_name}; have {', '.join(QUANTIZE)}")
    return gguf.TensorData(GGMLType[type_name], x.shape, QUANTIZE[type_name](x))


def quantize_file(src: str | os.PathLike, dst: str | os.PathLike, file_type: str) -> dict[str, str]:
    """Write `src` (a float llama GGUF) to `dst` as `file_type`; return each tensor's new type."""
    with gguf.read(src) as f:
        types = tensor_types(f.tensors, file_type)
        meta = dict(f.fields)  # Values with their stored types, so every key round-trips exactly
        meta["general.file_type"] = gguf.Value(gguf.ValueType.UINT32, FILE_TYPES[file_type].ftype)
        meta["general.quantization_version"] = gguf.Value(gguf.ValueType.UINT32, QUANTIZATION_VERSION)
        tensors = {}
        for name in types:
            if types[name] == f.tensors[name].type.name:
                tensors[name] = f.tensor_data(name)
            else:
                tensors[name] = convert(as_float32(f, name), types[name])
        gguf.write(dst, meta, tensors)
    return types


def roundtrip(x: np.ndarray, type_name: str) -> np.ndarray:
    """float32 `x` quantized to `type_name` and back: the rounding the format alone adds. Where a row
    holds no whole block (the shipped model's rows of 384 against 256-value super-blocks), blocks
    run on across rows: a simulation of the format, since llama.cpp would fall back to another type."""
    x = np.asarray(x, dtype=np.float32)
    block = block_size(type_name)
    if x.size % block:
        raise ValueError(f"{x.size} values do not fill whole {type_name} blocks of {block}")
    rows = x.reshape(-1, block) if x.shape[-1] % block else x
    return kquants.DEQUANTIZE[type_name](QUANTIZE[type_name](rows)).reshape(x.shape)


def relative_error(x: np.ndarray, type_name: str) -> float:
    """RMS of the rounding error over RMS of the weights, for one tensor in one format."""
    x = np.asarray(x, dtype=np.float32)
    return float(np.sqrt(np.mean((roundtrip(x, type_name) - x) ** 2) / np.mean(x ** 2)))


#: Groups of matrices by tensor kind, each rounded on its own to see which layers mind it (see k-quants).
MATRIX_GROUPS = {"attention projections": ("attn_q", "attn_k", "attn_v", "attn_output"),
                 "MLP": ("ffn_gate", "ffn_up", "ffn_down"),
                 "embedding (also the output matrix)": ("token_embd",)}


def tensor_kind(name: str) -> str:
    """The kind of a GGUF tensor: "attn_q" for "blk.3.attn_q.weight", "token_embd" for "token_embd.weight"."""
    return name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]


def with_llama_cpp(src: str | os.PathLike, dst: str | os.PathLike, file_type: str) -> dict[str, str]:
    """The same job done by llama.cpp itself (llama-cpp-python's `llama_model_quantize`, one thread,
    its log held aside and shown only if it fails): the oracle our files are compared with. Returns each
    tensor's type."""
    import llama_cpp  # its import routes llama.cpp's log through the "llama-cpp-python" logger

    if file_type not in FILE_TYPES:
        raise ValueError(f"unknown file type {file_type!r}; choose one of {', '.join(FILE_TYPES)}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.pure, params.nthread = FILE_TYPES[file_type].ftype, file_type == "Q4_K", 1
    logger = logging.getLogger("llama-cpp-python")
    level = logger.level
    logger.setLevel(logging.DEBUG)   # every line of its log, to say why when it fails
    try:
        with held_stderr() as log:   # its quantizer warns once per tensor it falls back on: no page shows it
            failed = llama_cpp.llama_model_quantize(os.fsencode(src), os.fsencode(dst), ctypes.byref(params)) != 0
            if failed:
                said = log().strip()[-2000:]
                raise RuntimeError(f"llama.cpp could not quantize {src} to {file_type}" + (f": {said}" if said else ""))
    finally:
        logger.setLevel(level)
    with gguf.read(dst) as f:
        return {n: t.type.name for n, t in f.tensors.items()}
