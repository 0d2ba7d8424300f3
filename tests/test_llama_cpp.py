"""llama.cpp itself (through llama-cpp-python) as the oracle: tokens, float32 logits, greedy text.

The shipped model and files our own writer produces must load in llama.cpp and give the same
numbers there as here. Both engines run in float32 (weights, activations and, set explicitly
below, the KV cache), so logits agree to ~1e-5; the bound is 1e-3 to leave room for summation
order on other CPUs. Greedy decoding compares token ids: equal logits up to rounding give equal
argmaxes unless the top two nearly tie, and a failure prints that gap.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import llama_cpp
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ref_impl.engine.checkpoint import load, save
from ref_impl.engine.generate import Sampler, generate_step
from ref_impl.engine.model import Model, ModelArgs
from ref_impl.engine.tokenizer import train_tokenizer
from ref_impl.formats import gguf
from ref_impl.training.corpus import split_of, stdlib_files
from ref_impl.training.models import TrainConfig

ATOL = 1e-3            # float32 against float32: measured differences are ~1e-5
GREEDY_STEPS = 32
STDLIB = Path(sysconfig.get_paths()["stdlib"])


def make_llama(path: Path, n_ctx: int) -> llama_cpp.Llama:
    """A CPU llama.cpp context keeping every position's logits, with a float32 KV cache.

    One thread: llama.cpp's worker threads spin at their barriers, so with a second thread and
    the other core busy (MLX's or OpenBLAS's threads, another job) an 11M-parameter model
    slows ~10x: 200-token prefill 1.2 s instead of 0.1 s, one token 40 ms instead of 4 ms.
    Rows are split over threads, not sums, so the thread count does not change the logits.
    """
    return llama_cpp.Llama(
        model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, logits_all=True,
        type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32,  # the default is F16
        n_gpu_layers=0, n_threads=1, n_threads_batch=1, seed=1234, verbose=False)


def llama_logits(llm: llama_cpp.Llama, ids: list[int]) -> np.ndarray:
    """llama.cpp's logits (len(ids), V) for ids evaluated from an empty context in one batch."""
    llm.reset()  # n_tokens = 0; the next eval drops the KV cache from position 0 on
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)])  # copy: the buffer is overwritten by the next eval


def held_out_snippets(n_files: int = 4, n_chars: int = 1500) -> list[tuple[str, str]]:
    """Slices of stdlib files the shipped model never trained on (its held-out split)."""
    root, files = stdlib_files()
    cfg, out = TrainConfig(), []
    for path in files:
        name = path.relative_to(root).as_posix()
        if "test" in name or split_of(name, cfg) != "heldout":
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if len(text) < 3 * n_chars:
            continue
        mid = len(text) // 2
        out += [(f"{name}[:{n_chars}]", text[:n_chars]), (f"{name}[mid]", text[mid:mid + n_chars])]
        if len(out) >= 2 * n_files:
            return out
    raise RuntimeError(f"fewer than {n_files} held-out stdlib files under {root}")


SNIPPETS = held_out_snippets()

TRICKY = {
    "empty": "", "space": " ", "spaces-run": "x" + " " * 37 + "y", "indent-run": " " * 24 + "return",
    "trailing-spaces": "pass    \n", "tabs": "\tif x:\n\t\treturn y\n", "mixed-ws": " \t \n\t \n",
    "crlf": "import os\r\nimport sys\r\n\r\n", "lone-cr": "a\rb\r", "newlines": "\n\n\n\n",
    "digits": "x = 1234567890 + 3.14159e-10 - 0x1F_FF", "digit-groups": "12 345 6789 00007",
    "latin": "héllo wörld, naïve café", "cyrillic": "Привет, мир", "cjk": "你好，世界 こんにちは",
    "emoji": "🙂🙃 ok 👍🏽 👨‍👩‍👧", "arabic-digits": "١٢٣ ٤٥ Ⅻ ½", "combining": "e\u0301 ñ",
    "nbsp-zwj": "\u00a0a\u200bb\u200dc\u3000", "control": "\x00a\x1b[0m\x7f\x0b\x0c",
    "contractions": "don't it's we'll they're I've I'm he'd DON'T 'S",
    "special-as-text": "a<|endoftext|>b",
    "fstring": "print(f\"{x!r:>10} {y:.3f}\")  # ok\n",
    "docstring": "    def f(self, *a, **kw) -> None:\n        \"\"\"Do it.\"\"\"\n        return a[0] ** 2\n",
    "comment-bar": "#" * 79 + "\n",
}

TEXTS = {**TRICKY, **dict(SNIPPETS)}


@pytest.fixture(scope="module")
def ours(shipped_model):
    return load(shipped_model, mx.float32)


@pytest.fixture(scope="module")
def llm(shipped_model):
    return make_llama(shipped_model, n_ctx=512)


@pytest.fixture(scope="module")
def prompt_ids(ours) -> list[int]:
    """BOS + ~150-200 tokens of held-out Python source."""
    _, tok = ours
    ids = tok.encode(SNIPPETS[1][1], bos=True)[:200]
    assert len(ids) >= 100
    return ids


# --- loading ------------------------------------------------------------------------------------

def test_llama_cpp_loads_shipped_model(llm, ours):
    model, tok = ours
    a = model.args
    assert llm.n_vocab() == a.vocab_size == tok.vocab_size == 4096
    assert llm.n_embd() == a.hidden_size
    assert llm.n_ctx() == 512 and llm._model.n_ctx_train() == a.max_position_embeddings == 512
    assert llm.token_bos() == llm.token_eos() == tok.bos_id == tok.eos_id == 0
    assert llm.metadata["general.architecture"] == "llama"
    assert int(llm.metadata["llama.block_count"]) == a.num_hidden_layers
    assert int(llm.metadata["llama.attention.head_count_kv"]) == a.num_key_value_heads
    assert llm.context_params.type_k == llm.context_params.type_v == llama_cpp.GGML_TYPE_F32


# --- tokenizer ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(TEXTS))
def test_tokenize_matches(llm, ours, name):
    _, tok = ours
    text = TEXTS[name]
    ids = tok.encode(text)
    assert llm.tokenize(text.encode(), add_bos=False, special=False) == ids
    assert llm.tokenize(text.encode(), add_bos=True, special=False) == tok.encode(text, bos=True) == [0, *ids]
    # llama-cpp-python's detokenize drops one leading space after BOS, so compare without BOS
    assert llm.detokenize(ids) == text.encode()


def test_snippets_are_held_out_source(ours):
    """The stdlib slices are real code that the vocabulary compresses (not 1 token per byte)."""
    _, tok = ours
    for name, text in SNIPPETS:
        assert len(tok.encode(text)) < len(text.encode()) / 2, name


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=60))
def test_tokenize_matches_any_text(llm, ours, text):
    _, tok = ours
    assert llm.tokenize(text.encode(), add_bos=False, special=False) == tok.encode(text)


# --- logits -------------------------------------------------------------------------------------

def test_prefill_logits_match(llm, ours, prompt_ids):
    model, _ = ours
    theirs = llama_logits(llm, prompt_ids)
    mine = np.array(model(mx.array([prompt_ids]))[0])
    assert mine.shape == theirs.shape == (len(prompt_ids), 4096)
    diff = np.abs(mine - theirs).max()
    assert diff <= ATOL, f"max |logit diff| over {len(prompt_ids)} positions = {diff:.3e}"
    assert (mine.argmax(-1) == theirs.argmax(-1)).mean() > 0.99


def test_incremental_decode_logits_match(llm, ours, prompt_ids):
    """Token by token through both engines' KV caches: every position's logits agree."""
    model, _ = ours
    ids = prompt_ids[:120]
    cache = model.make_cache(len(ids))
    llm.reset()
    mine, theirs = [], []
    for t in ids:
        mine.append(np.array(model(mx.array([[t]]), cache)[0, -1]))
        llm.eval([t])
        theirs.append(np.array(llm.scores[llm.n_tokens - 1]))
    mine, theirs = np.stack(mine), np.stack(theirs)
    diff = np.abs(mine - theirs).max()
    assert diff <= ATOL, f"max |logit diff| over {len(ids)} one-token steps = {diff:.3e}"
    full = llama_logits(llm, ids)  # and llama.cpp's own cached decode equals its batched prefill
    assert np.abs(theirs - full).max() <= ATOL


# --- greedy generation --------------------------------------------------------------------------

def llama_greedy(llm: llama_cpp.Llama, ids: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """Argmax over llama.cpp's own logits, one eval per token; also returns each step's logits."""
    llm.reset()
    llm.eval(ids)
    out, rows = [], []
    for _ in range(n):
        row = np.array(llm.scores[llm.n_tokens - 1])
        rows.append(row)
        out.append(int(row.argmax()))
        llm.eval([out[-1]])
    return out, np.stack(rows)


def top2_gap(row: np.ndarray) -> float:
    a, b = np.sort(row)[-2:]
    return float(b - a)


@pytest.mark.parametrize("prompt", ["def ", "import os\n\n", "class Foo:\n    def __init__(self",
                                    "    for i in range(", "from collections import"])
def test_greedy_continuation_matches(llm, ours, prompt):
    model, tok = ours
    ids = tok.encode(prompt, bos=True)
    steps = generate_step(model, ids, Sampler(), model.make_cache(len(ids) + GREEDY_STEPS + 1))
    mine = [t for _, t in zip(range(GREEDY_STEPS), steps)]
    theirs, rows = llama_greedy(llm, ids, GREEDY_STEPS)
    if mine != theirs:
        i = next(k for k, (a, b) in enumerate(zip(mine, theirs)) if a != b)
        ours_row = np.array(model(mx.array([ids + mine[:i]]))[0, -1])
        pytest.fail(f"greedy tokens diverge at step {i}: ours {mine[i]} vs llama.cpp {theirs[i]}; "
                    f"top-2 gap ours {top2_gap(ours_row):.2e}, llama.cpp {top2_gap(rows[i]):.2e}; "
                    f"max |logit diff| there {np.abs(ours_row - rows[i]).max():.2e}\n"
                    f"ours:      {tok.decode(mine)!r}\nllama.cpp: {tok.decode(theirs)!r}")
    # llama.cpp's own sampler chain, greedy and with penalties off, picks the same tokens
    sampled = [t for _, t in zip(range(GREEDY_STEPS),
                                 llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0,
                                              frequency_penalty=0.0, presence_penalty=0.0))]
    assert sampled == theirs
    assert min(top2_gap(r) for r in rows) > 0  # no exact tie decided the tokens


# --- files our writer produces ------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_tokenizer():
    texts = [(STDLIB / name).read_text(encoding="utf-8") for name in ("textwrap.py", "string.py", "bisect.py")]
    return train_tokenizer(texts, vocab_size=320)


def random_model(args: ModelArgs, seed: int = 0) -> Model:
    """MLX's default initialisation, with norm weights away from 1 so they count."""
    mx.random.seed(seed)
    model = Model(args)
    norms = {k: mx.random.uniform(0.5, 1.5, v.shape) for k, v in nn.utils.tree_flatten(model.parameters())
             if k.endswith("norm.weight")}
    model.load_weights(list(norms.items()), strict=False)
    mx.eval(model.parameters())
    return model


SAVED_VARIANTS = {
    "gqa1-untied": dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False),
    "mha-tied": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
    "head-dim-32": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False),
    "theta-eps": dict(num_attention_heads=2, num_key_value_heads=1, rope_theta=500000.0, rms_norm_eps=1e-6),
}


@pytest.mark.parametrize("variant", list(SAVED_VARIANTS))
def test_saved_model_matches_llama_cpp(tmp_path, small_tokenizer, variant):
    """A random model written by ref_impl.engine.checkpoint.save loads in llama.cpp and gives our logits."""
    args = ModelArgs(vocab_size=small_tokenizer.vocab_size, hidden_size=64, num_hidden_layers=2,
                     intermediate_size=96, max_position_embeddings=64, **SAVED_VARIANTS[variant])
    path = tmp_path / f"{variant}.gguf"
    save(random_model(args), small_tokenizer, path)
    model, tok = load(path, mx.float32)  # compare what the file holds, read back by us
    ids = tok.encode((STDLIB / "bisect.py").read_text(encoding="utf-8")[:400], bos=True)[:64]
    llm = make_llama(path, n_ctx=64)
    assert llm.n_vocab() == args.vocab_size
    assert llm.tokenize(b"x = 1", add_bos=True) == tok.encode("x = 1", bos=True)
    theirs = llama_logits(llm, ids)
    mine = np.array(model(mx.array([ids]))[0])
    diff = np.abs(mine - theirs).max()
    assert diff <= ATOL, f"{variant}: max |logit diff| = {diff:.3e}"
    assert np.abs(mine).max() > 0.5  # logits are not trivially small


def test_rope_freqs_matches_llama_cpp(tmp_path, small_tokenizer):
    """Llama 3 frequency factors (rope_freqs.weight): our reading of them is llama.cpp's."""
    args = ModelArgs(vocab_size=small_tokenizer.vocab_size, hidden_size=64, num_hidden_layers=2,
                     intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=64)
    plain = tmp_path / "plain.gguf"
    save(random_model(args), small_tokenizer, plain)
    factors = np.random.default_rng(0).uniform(1.0, 8.0, args.head_dim // 2).astype(np.float32)
    path = tmp_path / "rope_freqs.gguf"
    with gguf.read(plain) as f:
        gguf.write(path, f.fields, {**{n: np.array(f.array(n)) for n in f.tensors}, "rope_freqs.weight": factors})
    ids = small_tokenizer.encode("def insort(a, x, lo=0, hi=None):\n    lo = bisect_right(a, x, lo, hi)\n",
                                 bos=True)
    model, _ = load(path, mx.float32)
    theirs = llama_logits(make_llama(path, n_ctx=64), ids)
    mine = np.array(model(mx.array([ids]))[0])
    diff = np.abs(mine - theirs).max()
    assert diff <= ATOL, f"rope_freqs: max |logit diff| = {diff:.3e}"
    unscaled, _ = load(plain, mx.float32)  # the factors matter: without them the logits differ
    assert np.abs(np.array(unscaled(mx.array([ids]))[0]) - theirs).max() > 10 * ATOL
