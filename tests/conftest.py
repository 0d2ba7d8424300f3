"""Shared fixtures: tiny random llama models written as GGUF by llama.cpp's own `gguf` package, and the built book."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ref_impl import MODELS_DIR  # first: loads the optimized BLAS before anything imports mlx
from ref_impl.engine.random import random_blocks
from ref_impl.formats.quantize import with_llama_cpp

SHIPPED = MODELS_DIR / "stdlib-10m.gguf"
BOOK_ROOT = Path(__file__).resolve().parent.parent
BOOK_HTML = BOOK_ROOT / "_build" / "html"


def write_random_llama(path: Path, vocab=97, dim=64, layers=2, heads=4, kv_heads=2, ff=96,
                       context=64, tied=True, rope_freqs=False, seed=0, weight_type=None) -> Path:
    """A random llama-architecture GGUF written with the `gguf` package, not ours: matrices in
    `weight_type` (a gguf.GGMLQuantizationType name such as "Q8_0"; default F32), norms in F32."""
    import gguf

    rng = np.random.default_rng(seed)
    hd = dim // heads

    def mat(out, inp):
        return (rng.standard_normal((out, inp)) / np.sqrt(inp)).astype(np.float32)

    w = gguf.GGUFWriter(str(path), "llama")
    qtype = gguf.GGMLQuantizationType[weight_type] if weight_type else None

    def add_matrix(name, m):
        if qtype is None:
            w.add_tensor(name, m)
        elif qtype.name in ("Q4_K", "Q5_K", "Q6_K"):  # the gguf package has no K-quant quantizer: random blocks
            w.add_tensor(name, random_blocks(qtype.name, *m.shape, rng), raw_dtype=qtype)
        else:
            w.add_tensor(name, gguf.quants.quantize(m, qtype), raw_dtype=qtype)

    w.add_context_length(context)
    w.add_embedding_length(dim)
    w.add_block_count(layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    add_matrix("token_embd.weight", mat(vocab, dim) * 4)
    if rope_freqs:
        w.add_tensor("rope_freqs.weight", rng.uniform(1.0, 8.0, hd // 2).astype(np.float32))
    for i in range(layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", rng.uniform(0.5, 1.5, dim).astype(np.float32))
        add_matrix(p + "attn_q.weight", mat(heads * hd, dim))
        add_matrix(p + "attn_k.weight", mat(kv_heads * hd, dim))
        add_matrix(p + "attn_v.weight", mat(kv_heads * hd, dim))
        add_matrix(p + "attn_output.weight", mat(dim, heads * hd))
        w.add_tensor(p + "ffn_norm.weight", rng.uniform(0.5, 1.5, dim).astype(np.float32))
        add_matrix(p + "ffn_gate.weight", mat(ff, dim))
        add_matrix(p + "ffn_up.weight", mat(ff, dim))
        add_matrix(p + "ffn_down.weight", mat(dim, ff))
    w.add_tensor("output_norm.weight", rng.uniform(0.5, 1.5, dim).astype(np.float32))
    if not tied:
        add_matrix("output.weight", mat(vocab, dim))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="session")
def random_llama(tmp_path_factory) -> Path:
    return write_random_llama(tmp_path_factory.mktemp("models") / "random.gguf")


@pytest.fixture(scope="session")
def shipped_model() -> Path:
    if not SHIPPED.is_file():
        pytest.fail(f"the shipped model {SHIPPED} is missing: train it (python -m ref_impl train)")
    return SHIPPED


@pytest.fixture(scope="session")
def llama_q4_k_m(shipped_model, tmp_path_factory) -> Path:
    """The shipped model quantized to Q4_K_M by llama.cpp itself (Q4_K, Q6_K, and Q5_0/Q8_0 where
    rows of 384 are not a multiple of 256)."""
    out = tmp_path_factory.mktemp("q4km") / "stdlib-10m-Q4_K_M.gguf"
    with_llama_cpp(shipped_model, out, "Q4_K_M")
    return out


@pytest.fixture(scope="session")
def built_book() -> Path:
    """The book as `make book` builds it, into the repository's _build/html: once per test run, shared by
    every test that reads the built pages (executed notebooks are reused from the build's cache)."""
    jb = Path(sys.executable).parent / "jupyter-book"
    run = subprocess.run([str(jb), "build", str(BOOK_ROOT), "--warningiserror", "--keep-going"],
                         cwd=BOOK_ROOT, capture_output=True, text=True, timeout=3600)
    if run.returncode:
        failed = "".join(f"\n--- {log.name}\n{log.read_text()[-3000:]}" for log in (BOOK_HTML / "reports").rglob("*.log"))
        pytest.fail(f"jupyter-book build failed (rc {run.returncode}):\n{(run.stdout + run.stderr)[-6000:]}{failed}")
    return BOOK_HTML
