"""Will a GGUF file run here? The checks loading makes, answered from the header alone.

A GGUF file someone already has (from llama.cpp's converters, Hugging Face, an Ollama store) may hold an
architecture this decoder does not build, a vocabulary it cannot tokenize, tensor types it cannot decode,
or more weights than this machine holds in the form generate keeps them. `why_not` asks the same code
that loading runs (checkpoint.model_args and gguf_weight_names, Tokenizer.from_gguf_metadata) and the
reader's list of decodable types, reading metadata and the tensor table but no weight, so `inspect` can
say "no" and why in a second, even for a file of many GB.

See chapter: your-model
"""

from __future__ import annotations

import os
from collections import Counter

import mlx.core as mx

from ref_impl.engine.checkpoint import gguf_weight_names, model_args
from ref_impl.engine.model import Model, default_dtype
from ref_impl.engine.tokenizer import Tokenizer
from ref_impl.formats import gguf


def memory_bytes() -> int:
    """This machine's physical memory in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def why_not(f: gguf.GGUFFile) -> str | None:
    """Why `python -m ref_impl generate` would refuse the open file `f` on this machine, or None if it runs.

    In order: the architecture and its hyper-parameters, the tensor names and shapes, the tensor types
    the reader decodes, the vocabulary; on the CPU, where generate holds every weight as a float, whether
    those floats fit in this machine's memory.
    """
    try:
        args = model_args(f)
        gguf_weight_names(f, Model(args))  # parameters are lazy MLX arrays: nothing is allocated
    except (ValueError, TypeError) as e:
        return str(e)
    odd = Counter(t.type.name for t in f.tensors.values() if t.type not in gguf.DECODABLE)
    if odd:
        found = ", ".join(f"{n} {name}" for name, n in odd.most_common())
        return (f"tensors of types this reader cannot decode ({found} tensors); it decodes "
                f"{', '.join(t.name for t in gguf.DECODABLE)}")
    try:
        Tokenizer.from_gguf_metadata(f.metadata)
    except (ValueError, TypeError) as e:
        return str(e)
    dtype = default_dtype()
    need, have = args.num_parameters * dtype.size, memory_bytes()
    if mx.default_device() == mx.cpu and need > have:
        return (f"its {args.num_parameters / 1e6:,.1f}M weights take {need / 1e9:,.2f} GB as "
                f"{str(dtype).split('.')[-1]} (how generate holds them on the CPU), more than this machine's "
                f"{have / 1e9:,.2f} GB of memory")
    return None
