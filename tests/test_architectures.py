"""The llama, qwen2 and qwen3 architectures against llama.cpp (llama-cpp-python) on random-weight files.

Each file is written by engine/random.write_random_model the way llama.cpp's converter writes one
(`<arch>.*` metadata, llama.cpp's tensor names, vectors in F32) and read by both engines: float32
logits within test_llama_cpp's ATOL, greedy tokens equal, its quantized forms loaded natively (against
llama.cpp on the very weights they hold, dequantized by the `gguf` package), every KV-cache scheme
through a decode step, and any other architecture refused. One file has the full width and vocabulary
of a public model (Qwen3-0.6B, Llama-3.2-1B, TinyLlama-1.1B with its SentencePiece vocabulary) with one layer.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import gguf as gguf_py
import mlx.core as mx
import numpy as np
import pytest
from test_llama_cpp import ATOL, llama_greedy, llama_logits, make_llama, top2_gap

from ref_impl import kernels
from ref_impl.engine import kvquant
from ref_impl.engine.checkpoint import load_model
from ref_impl.engine.generate import Sampler, generate_step
from ref_impl.engine.architectures import ARCHITECTURES
from ref_impl.engine.model import ModelArgs
from ref_impl.engine.random import args_for, write_random_model
from ref_impl.formats import gguf
from ref_impl.formats.quantize import quantize_file

ROOT = Path(__file__).resolve().parent.parent
VOCAB, CONTEXT = 256, 64
IDS = [int(i) for i in np.random.default_rng(0).integers(0, VOCAB, 24)]

# head_dim 64 so that every KV-cache scheme's groups (32, 64 channels) fit a head
VARIANTS = {
    # Mistral-style: untied output, grouped-query attention, a large rope base
    "llama": dict(architecture="llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                  tie_word_embeddings=False, rope_theta=1e6, head_dim=64),
    "llama-linear-rope": dict(architecture="llama", hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                              rope_scaling_factor=4.0),
    "qwen2": dict(architecture="qwen2", hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                  attention_bias=True, rope_theta=1e6, rms_norm_eps=1e-6),
    "qwen2-untied": dict(architecture="qwen2", hidden_size=128, num_attention_heads=2, num_key_value_heads=2,
                         attention_bias=True, tie_word_embeddings=False),
    # Qwen3's heads are wider than hidden_size / heads: its key_length is explicit
    "qwen3": dict(architecture="qwen3", hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=64, rope_theta=1e6, rms_norm_eps=1e-6),
    "qwen3-untied": dict(architecture="qwen3", hidden_size=128, num_attention_heads=4, num_key_value_heads=1,
                         head_dim=64, tie_word_embeddings=False),
}


def variant_args(variant: str) -> ModelArgs:
    return ModelArgs(vocab_size=VOCAB, num_hidden_layers=2, intermediate_size=256, max_position_embeddings=CONTEXT,
                     **VARIANTS[variant])


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    work = tmp_path_factory.mktemp("architectures")
    return {v: write_random_model(work / f"{v}.gguf", variant_args(v), "F32", seed=i) for i, v in enumerate(VARIANTS)}


def same_args(read: ModelArgs, written: ModelArgs) -> bool:
    """Every hyper-parameter read back from the metadata (the norm epsilon is stored as float32)."""
    eps = written.rms_norm_eps
    return read.rms_norm_eps == pytest.approx(eps) and replace(read, rms_norm_eps=eps) == written


def ours(path: Path, quantized: bool = False, dtype: mx.Dtype = mx.float32):
    with gguf.read(path) as f:
        return load_model(f, dtype, quantized=quantized)


def logits(model, ids: list[int]) -> np.ndarray:
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


# --- the float path against llama.cpp -------------------------------------------------------------

@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_llama_cpp(files, variant):
    model = ours(files[variant])
    assert same_args(model.args, variant_args(variant))
    theirs = llama_logits(make_llama(files[variant], CONTEXT), IDS)
    mine = logits(model, IDS)
    diff = np.abs(mine - theirs).max()
    assert diff <= ATOL, f"{variant}: max |logit diff| over {len(IDS)} positions = {diff:.3e}"
    assert np.abs(mine).max() > 1.0                      # the logits are not trivially small


def check_greedy(path: Path, context: int, prompt: list[int], n: int = 24) -> None:
    """n greedy tokens of ours after prompt equal llama.cpp's, no exact tie deciding any, not all one token."""
    model = ours(path)
    steps = generate_step(model, prompt, Sampler(), model.make_cache(len(prompt) + n + 1))
    mine = [t for _, t in zip(range(n), steps)]
    theirs, rows = llama_greedy(make_llama(path, context), prompt, n)
    assert mine == theirs, f"{path.stem}: ours {mine}, llama.cpp {theirs}"
    assert min(top2_gap(r) for r in rows) > 0 and len(set(mine)) > 1


@pytest.mark.parametrize("variant", ["llama", "qwen2", "qwen3"])
def test_greedy_tokens_match_llama_cpp(files, variant):
    check_greedy(files[variant], CONTEXT, IDS[:6])


def test_rope_style_and_scaling_matter(files, tmp_path):
    """The test's weights tell the rope styles and scalings apart: a qwen2 file relabelled llama (same
    tensors; llama.cpp reads q/k/v biases for llama too) gives other logits in llama.cpp, and ours again;
    so does the linear-rope file without its scaling."""
    with gguf.read(files["qwen2"]) as f:
        meta = {k.replace("qwen2.", "llama."): v for k, v in f.fields.items()}
        meta["general.architecture"] = gguf.Value(gguf.ValueType.STRING, "llama")
        gguf.write(tmp_path / "as-llama.gguf", meta, {n: f.tensor_data(n) for n in f.tensors})
    with gguf.read(files["llama-linear-rope"]) as f:
        meta = {k: v for k, v in f.fields.items() if "rope.scaling" not in k}
        gguf.write(tmp_path / "unscaled.gguf", meta, {n: f.tensor_data(n) for n in f.tensors})
    for original, changed in [("qwen2", "as-llama"), ("llama-linear-rope", "unscaled")]:
        theirs = llama_logits(make_llama(tmp_path / f"{changed}.gguf", CONTEXT), IDS)
        assert np.abs(logits(ours(tmp_path / f"{changed}.gguf"), IDS) - theirs).max() <= ATOL
        assert np.abs(logits(ours(files[original]), IDS) - theirs).max() > 100 * ATOL


FULL_WIDTH = {   # one layer of each: llama.cpp and ours on a real model's matrices and vocabulary size; the
    # SentencePiece family's (TinyLlama: Llama 2's 32000 tokens) with that real vocabulary, llama.cpp's test file
    "Qwen3-0.6B": (ModelArgs(151936, 1024, 1, 3072, 16, 8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6,
                             max_position_embeddings=40960, architecture="qwen3"), None),
    "Llama-3.2-1B": (replace(args_for("Llama-3.2-1B", 131072), num_hidden_layers=1, rope_theta=5e5), None),
    "TinyLlama-1.1B": (ModelArgs(32000, 2048, 1, 5632, 32, 4, max_position_embeddings=2048,
                                 tie_word_embeddings=False), "llama-spm"),
}


@pytest.mark.parametrize("name", list(FULL_WIDTH))
def test_full_width_matches_llama_cpp(tmp_path, name):
    """A public model's width, heads, head size and vocabulary (Qwen3's 151936 tokens, Llama 3's 128256, Llama 2's
    32000 SentencePiece tokens, which also tokenize as llama.cpp tokenizes them)."""
    from ref_impl import VOCAB_DIR
    from ref_impl.engine.tokenizer import Tokenizer

    args, vocab = FULL_WIDTH[name]
    metadata = None
    if vocab:
        with gguf.read(VOCAB_DIR / f"ggml-vocab-{vocab}.gguf") as f:
            metadata = dict(f.metadata)
    path = write_random_model(tmp_path / f"{name}-1layer.gguf", args, "F32", tokenizer=metadata)
    ids = [int(i) for i in np.random.default_rng(1).integers(0, args.vocab_size, 16)]
    llm = make_llama(path, CONTEXT)
    theirs = llama_logits(llm, ids)
    model = ours(path)
    assert same_args(model.args, args)
    diff = np.abs(logits(model, ids) - theirs).max()
    assert diff <= ATOL, f"{name} width: max |logit diff| = {diff:.3e}"
    if vocab:
        text = "Hello world, naïve café: 1234 tokens\n\tdef f(x): return x"
        ours_ids = Tokenizer.from_gguf_metadata(metadata).encode(text)
        assert ours_ids == llm.tokenize(text.encode(), add_bos=False, special=False)


# --- quantized weights ----------------------------------------------------------------------------

def dequantized_copy(src: Path, dst: Path) -> Path:
    """src with every tensor dequantized to F32 by llama.cpp's `gguf` package (not our decoders)."""
    tensors = {t.name: gguf_py.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
               for t in gguf_py.GGUFReader(str(src)).tensors}
    with gguf.read(src) as f:
        gguf.write(dst, {**f.fields, "general.file_type": 0}, tensors)
    return dst


@pytest.mark.parametrize("file_type", ["Q8_0", "Q4_K_M"])
@pytest.mark.parametrize("variant", ["llama", "qwen2", "qwen3"])
def test_quantized_weights_load_natively(files, tmp_path, variant, file_type):
    """quantize_file's Q8_0 / Q4_K_M files load with their matrices kept quantized (MLX affine layers; a
    qwen2's biases stay float) and compute llama.cpp's float32 logits of the weights they hold. Q4_K_M's
    Q6_K tensors are re-quantized to MLX's groups of 32 (transcode.py), hence its looser bound."""
    path = tmp_path / f"{variant}-{file_type}.gguf"
    types = quantize_file(files[variant], path, file_type)
    assert {types[n] for n in types if n.endswith("attn_q.weight")} <= {"Q8_0", "Q4_K", "Q5_0"}
    model = ours(path, quantized=True)
    assert type(model.layers[0].self_attn.q_proj).__name__ == "QuantizedLinear"
    theirs = llama_logits(make_llama(dequantized_copy(path, tmp_path / "deq.gguf"), CONTEXT), IDS)
    diff = np.abs(logits(model, IDS) - theirs).max()
    bound = ATOL if file_type == "Q8_0" else 0.05
    assert diff <= bound, f"{variant} {file_type}: max |logit diff| = {diff:.3e}"


# --- every KV-cache scheme ------------------------------------------------------------------------

def scheme_bits(scheme: str) -> int:
    """The bits a scheme stores keys in (32 for the float caches)."""
    return getattr(kvquant.resolve(scheme), "keywords", {}).get("bits", 32)


@pytest.mark.parametrize("variant", ["llama", "qwen2", "qwen3"])
def test_every_kv_cache_scheme_decodes(files, variant):
    """Prefill, then one decode step through every scheme (fused too where it has one): the step's logits
    are the uncached forward's, exactly for float caches (and kivi, whose float window holds all 24
    positions), within 5% of the logit range for 8-bit codes; finite for 4 and 2 bits."""
    model = ours(files[variant])
    full = logits(model, IDS)[-1]
    runs = [(s, False) for s in kvquant.SCHEMES] + [(s, True) for s in kvquant.FUSED]
    for scheme, fused in runs:
        cache = model.make_cache(32, scheme=scheme, **({"fused": True} if fused else {}))
        model(mx.array([IDS[:-1]]), cache)
        step = np.array(model(mx.array([IDS[-1:]]), cache)[0, -1])
        diff, bits = np.abs(step - full).max(), scheme_bits(scheme)
        label = f"{variant} {scheme}{' fused' if fused else ''}: {diff:.3e}"
        assert step.shape == (VOCAB,) and np.isfinite(step).all(), label
        if bits == 32 or kvquant.cache_class(scheme) is kvquant.KIVIKVCache:
            assert diff <= 1e-4, label
        elif bits == 8:
            assert diff <= 0.05 * np.ptp(full), label


# --- our kernels' patch keeps biases and q/k norms -------------------------------------------------

@pytest.mark.parametrize("variant", ["qwen2", "qwen3"])
def test_kernel_patch_keeps_biases_and_qk_norms(files, variant):
    """kernels.patch swaps the float16 projections (a GEMVLinear keeps its bias; biased q/k/v are not fused) and
    leaves the q/k norms in the attention: off CUDA every call stays MLX's built-in, so the logits stay, up to
    float16 rounding (a GEMVLinear adds its bias after the matmul, nn.Linear in one addmm)."""
    model = ours(files[variant], dtype=mx.float16)
    before = logits(model, IDS)
    kernels.patch(model, fuse=True)
    attn = model.layers[0].self_attn
    assert type(attn.q_proj).__name__ == "GEMVLinear" and ("bias" in attn.q_proj) == (variant == "qwen2")
    assert type(attn.qkv).__name__ != "FusedQKV" or variant == "qwen3"
    assert np.abs(logits(model, IDS) - before).max() <= 0.05


# --- refusals ---------------------------------------------------------------------------------------

def test_other_architectures_are_refused(files, tmp_path):
    """Any other general.architecture: a ValueError naming it and the supported ones; from the CLI one
    `error:` line and exit 2."""
    with gguf.read(files["llama"]) as f:
        meta, tensors = dict(f.metadata), dict(f.tensors)
    for arch in ("gpt2", "gemma", "mixtral", None):
        with pytest.raises(ValueError, match=rf"unsupported architecture {arch!r}: this decoder reads "
                                             rf"{', '.join(ARCHITECTURES)}$"):
            ModelArgs.from_gguf({**meta, "general.architecture": arch}, tensors)
    with pytest.raises(ValueError, match="unsupported architecture 'phi2'"):
        replace(variant_args("llama"), architecture="phi2")
    with gguf.read(files["qwen3"]) as f:
        meta = {k.replace("qwen3.", "starcoder2."): v for k, v in f.fields.items()}
        meta["general.architecture"] = gguf.Value(gguf.ValueType.STRING, "starcoder2")
        gguf.write(tmp_path / "starcoder2.gguf", meta, {n: f.tensor_data(n) for n in f.tensors})
    r = subprocess.run([sys.executable, "-m", "ref_impl", "generate", "--model", str(tmp_path / "starcoder2.gguf"),
                        "--prompt", "x"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("error: ") and "'starcoder2'" in r.stderr and ", ".join(ARCHITECTURES) in r.stderr


@pytest.mark.parametrize("change, message", [
    ({"qwen2.rope.scaling.type": "yarn", "qwen2.rope.scaling.factor": 4.0},
     "qwen2.rope.scaling.type is 'yarn': this decoder applies none, linear"),
    ({"qwen2.rope.dimension_count": 32}, r"qwen2.rope.dimension_count \(32\) must equal the head dimension \(64\)"),
    ({"qwen2.attention.value_length": 32}, r"qwen2.attention.value_length \(32\) must equal"),
    ({"qwen2.embedding_length": None}, "GGUF metadata lacks 'qwen2.embedding_length'"),
])
def test_what_this_decoder_cannot_build_is_refused(files, change, message):
    with gguf.read(files["qwen2"]) as f:
        meta, tensors = {**f.metadata, **change}, dict(f.tensors)
    with pytest.raises(ValueError, match=message):
        ModelArgs.from_gguf({k: v for k, v in meta.items() if v is not None}, tensors)


def test_rope_freqs_belong_to_llama_files(files):
    """Llama 3's frequency factors: llama.cpp's qwen2 and qwen3 graphs take none, so such a file is refused."""
    for variant in ("qwen2", "qwen3"):
        with gguf.read(files[variant]) as f:
            with pytest.raises(ValueError, match=f"a {variant} file with rope frequency factors"):
                ModelArgs.from_gguf(f.metadata, f.tensors, rope_freq_factors=(1.0,) * 32)


def test_a_random_file_can_carry_a_real_vocabulary(tmp_path):
    """write_random_model(tokenizer=...) writes a vocabulary's tokenizer keys (here llama.cpp's Llama 2 test file),
    which load as that tokenizer; a vocabulary of another size than the model's is refused."""
    from ref_impl import VOCAB_DIR
    from ref_impl.engine.checkpoint import load

    with gguf.read(VOCAB_DIR / "ggml-vocab-llama-spm.gguf") as f:
        vocab = dict(f.metadata)
    args = ModelArgs(len(vocab["tokenizer.ggml.tokens"]), 64, 1, 128, 4, 2)
    path = write_random_model(tmp_path / "spm.gguf", args, "F32", tokenizer=vocab)
    _, tok = load(path)
    assert (tok.model, tok.vocab_size, tok.bos_id) == ("llama", args.vocab_size, vocab["tokenizer.ggml.bos_token_id"])
    assert tok.encode("Hello world") == llama_cpp_ids(path, "Hello world")
    with pytest.raises(ValueError, match="tokens, the model"):
        write_random_model(tmp_path / "bad.gguf", replace(args, vocab_size=args.vocab_size - 1), "F32", tokenizer=vocab)


def llama_cpp_ids(path: Path, text: str) -> list[int]:
    import llama_cpp

    return llama_cpp.Llama(model_path=str(path), n_ctx=16, verbose=False).tokenize(text.encode(), add_bos=False,
                                                                                     special=False)
