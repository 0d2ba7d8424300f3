"""Tests for ref_impl.engine.tokenizer: round trips, determinism, GGUF metadata, and llama.cpp as the oracle."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ref_impl.engine.tokenizer import EOT, TOKEN_CONTROL, TOKEN_NORMAL, Tokenizer, train_tokenizer
from ref_impl.formats import gguf as our_gguf

STDLIB = Path(sysconfig.get_paths()["stdlib"])
TRAIN_FILES = ["textwrap.py", "string.py", "fnmatch.py", "shlex.py", "bisect.py", "colorsys.py"]
HELD_OUT_FILES = ["heapq.py", "json/decoder.py", "keyword.py"]
VOCAB = 512

TRICKY = [
    "", " ", "  ", "\t", "\n", "\r\n", "\n\n\n", " \n ", "a  b", "a   b   ", "x\t\ty", "  leading",
    "trailing   ", "\t\tif x:\n\t\t\treturn y\r\n", "don't", "it's", "we'll", "they're", "I've", "I'm",
    "he'd", "'s", "' s", "'S", "DON'T", "x = 1234567890", "3.14159e-10", "0x1F_FF", "12 345 6789",
    "١٢٣ ٤٥", "Ⅻ", "½", "héllo wörld", "naïve café", "Привет, мир", "你好，世界", "こんにちは",
    "🙂🙃 emoji 👍🏽 👨‍👩‍👧", "\x00", "a\x00b", "\x7f\x1b[0m", "\u00a0nbsp\u00a0", "\u2028\u2029",
    "\u3000ideographic", "tab\u000bvt\u000cff", "\u200bzero\u200dwidth", "e\u0301 combining",
    "<|endoftext|>", "a<|endoftext|>b", "Ġ Ċ", "\ufeffbom", "\U0010ffff", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "def f(x):\n    return x ** 2  # square\n",
    "class A(B, metaclass=M):\n    '''Doc.'''\n\n    x: int = 0\n",
    "print(f\"{x!r:>10} {y:.3f}\")", "lambda *a, **kw: (a, kw)", "#" * 80, " " * 40 + "x",
    "if a != b and c <= d or e >= f:\n        pass\n", "s = 'it''s'; t = \"don\\'t\"",
]


def _source(name: str) -> str:
    return (STDLIB / name).read_text(encoding="utf-8")


@pytest.fixture(scope="session")
def tok() -> Tokenizer:
    return train_tokenizer([_source(f) for f in TRAIN_FILES], VOCAB)


@pytest.fixture(scope="session")
def samples() -> list[str]:
    held_out = [_source(f) for f in HELD_OUT_FILES]
    lines = [line for text in held_out for line in text.splitlines(keepends=True)]
    return TRICKY + held_out + lines[:300]


def test_layout(tok):
    assert tok.vocab_size == VOCAB
    assert tok.tokens[0] == EOT and tok.bos_id == tok.eos_id == 0
    assert tok.token_types == [TOKEN_CONTROL] + [TOKEN_NORMAL] * (VOCAB - 1)
    assert len(tok.merges) == VOCAB - 257
    assert sorted(tok.token_bytes(i) for i in range(1, 257)) == [bytes([b]) for b in range(256)]
    assert tok.encode("def f(x):\n    return x") != list(range(1, 257))  # merges actually apply
    assert max(len(tok.token_bytes(i)) for i in range(1, VOCAB)) <= 32


def test_training_is_deterministic(tok):
    again = train_tokenizer([_source(f) for f in TRAIN_FILES], VOCAB)
    assert again.tokens == tok.tokens and again.merges == tok.merges


def test_vocab_size_too_small():
    with pytest.raises(ValueError, match="257"):
        train_tokenizer(["abc"], 200)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text())  # any code points but surrogates (not encodable as UTF-8)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    assert Tokenizer.from_gguf_metadata(tok.gguf_metadata()).encode(text) == ids


def test_special_tokens(tok):
    assert tok.encode("x", bos=True) == [tok.bos_id, *tok.encode("x")]
    assert tok.decode([tok.bos_id, *tok.encode("x"), tok.eos_id]) == "x"
    assert EOT not in (tok.id_to_piece(i) for i in tok.encode(EOT))  # typed EOT is plain text
    assert tok.token_bytes(tok.eos_id) == EOT.encode()


def test_gguf_metadata_keys(tok):
    md = tok.gguf_metadata()
    assert md["tokenizer.ggml.model"] == "gpt2" and md["tokenizer.ggml.pre"] == "gpt-2"
    assert set(md) == {f"tokenizer.ggml.{k}" for k in (
        "model", "pre", "tokens", "token_type", "merges", "bos_token_id", "eos_token_id", "add_bos_token",
        "add_eos_token")}
    assert all(isinstance(m, str) and m.count(" ") == 1 for m in md["tokenizer.ggml.merges"])
    assert md["tokenizer.ggml.add_bos_token"] is True


@pytest.mark.parametrize("change, message", [
    ({"tokenizer.ggml.model": "bert"}, "'bert'; supported: gpt2, llama"),
    ({"tokenizer.ggml.model": "llama"}, "scores"),
    ({"tokenizer.ggml.pre": "jina-v2-zh"}, "'jina-v2-zh' is not supported; known: .*'qwen2'"),
    ({"tokenizer.ggml.token_type": [1, 1]}, "token types"),
    ({"tokenizer.ggml.bos_token_id": 10**6}, "outside"),
    ({"tokenizer.ggml.merges": ["Ġ zzz"]}, "merge 0"),
    ({"tokenizer.ggml.merges": ["nospace"]}, "merge 0"),
])
def test_bad_metadata(tok, change, message):
    with pytest.raises(ValueError, match=message):
        Tokenizer.from_gguf_metadata({**tok.gguf_metadata(), **change})


@pytest.mark.parametrize("key", ["tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.eos_token_id"])
def test_missing_metadata(tok, key):
    md = tok.gguf_metadata()
    del md[key]
    with pytest.raises(ValueError, match=key.split(".")[-1]):
        Tokenizer.from_gguf_metadata(md)


def test_missing_pre_is_default(tok):
    """As llama.cpp: a gpt2 vocabulary without tokenizer.ggml.pre gets the "default" pre-tokenizer."""
    md = tok.gguf_metadata()
    del md["tokenizer.ggml.pre"]
    assert Tokenizer.from_gguf_metadata(md).pre == "default"


# --- GGUF files and llama.cpp ------------------------------------------------------------------

def tiny_llama(n_vocab: int) -> tuple[dict, dict]:
    """Metadata and random F32 weights of a 1-block llama model (numpy shapes are (out, in))."""
    n_embd, n_ff, n_head = 32, 64, 2
    metadata = {"general.architecture": "llama", "llama.context_length": 64, "llama.embedding_length": n_embd,
                "llama.block_count": 1, "llama.feed_forward_length": n_ff, "llama.attention.head_count": n_head,
                "llama.attention.head_count_kv": n_head, "llama.rope.dimension_count": n_embd // n_head,
                "llama.attention.layer_norm_rms_epsilon": 1e-5}
    shapes = {"token_embd.weight": (n_vocab, n_embd), "output_norm.weight": (n_embd,),
              "blk.0.attn_norm.weight": (n_embd,), "blk.0.ffn_norm.weight": (n_embd,),
              "blk.0.attn_q.weight": (n_embd, n_embd), "blk.0.attn_k.weight": (n_embd, n_embd),
              "blk.0.attn_v.weight": (n_embd, n_embd), "blk.0.attn_output.weight": (n_embd, n_embd),
              "blk.0.ffn_gate.weight": (n_ff, n_embd), "blk.0.ffn_up.weight": (n_ff, n_embd),
              "blk.0.ffn_down.weight": (n_embd, n_ff)}
    rng = np.random.default_rng(0)
    return metadata, {k: rng.standard_normal(s).astype(np.float32) * 0.02 for k, s in shapes.items()}


def write_with_gguf_package(path: Path, metadata: dict, tensors: dict) -> None:
    """Write a GGUF file with llama.cpp's own `gguf` package, typing values as ref_impl.formats.gguf does."""
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), metadata["general.architecture"])
    for key, value in metadata.items():
        if key == "general.architecture":
            continue
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value[0], str):
            w.add_array(key, value)
        else:
            w.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT32)
    for name, array in tensors.items():  # the writer reverses numpy shapes into ggml's ne order
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def read_gguf_metadata(path: Path) -> dict:
    gguf = pytest.importorskip("gguf")
    return {name: field.contents() for name, field in gguf.GGUFReader(str(path)).fields.items()}


# a few pre-tokenizers of different kinds (one regex, a fast path in llama.cpp, several regexes);
# tests/test_tokenizer_llama_cpp.py checks every one on real vocabularies
ORACLE_PRES = ["gpt-2", "llama-bpe", "qwen2", "deepseek-coder", "default"]


@pytest.fixture(scope="session", params=ORACLE_PRES)
def pre_and_file(request, tok, tmp_path_factory):
    """Our vocabulary under each supported pre-tokenizer, written to a tiny llama GGUF file."""
    arch, tensors = tiny_llama(tok.vocab_size)
    path = tmp_path_factory.mktemp("gguf") / f"tiny-{request.param}.gguf"
    write_with_gguf_package(path, {**arch, **tok.gguf_metadata(), "tokenizer.ggml.pre": request.param}, tensors)
    return request.param, path


def test_gguf_file_round_trip(tok, pre_and_file):
    pre, path = pre_and_file
    md = read_gguf_metadata(path)
    assert md["tokenizer.ggml.tokens"] == tok.tokens and md["tokenizer.ggml.merges"] == tok.merges
    again = Tokenizer.from_gguf_metadata(md)
    assert again.pre == pre and again.gguf_metadata() == {**tok.gguf_metadata(), "tokenizer.ggml.pre": pre}


@pytest.fixture(scope="session")
def llamas(tok, pre_and_file):
    llama_cpp = pytest.importorskip("llama_cpp")
    pre, path = pre_and_file
    ours = Tokenizer.from_gguf_metadata(read_gguf_metadata(path))
    return ours, llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)


def test_llama_cpp_tokenize_agrees(llamas, samples):
    ours, llm = llamas
    for text in samples:
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == ours.encode(text), repr(text)
    assert llm.tokenize(b"x = 1", add_bos=True, special=False) == ours.encode("x = 1", bos=True)
    assert llm.token_bos() == llm.token_eos() == ours.bos_id


def test_llama_cpp_detokenize_agrees(llamas, samples):
    ours, llm = llamas
    for text in samples:
        ids = ours.encode(text)
        assert llm.detokenize(ids).decode() == ours.decode(ids) == text, repr(text)
    # With BOS first, llama-cpp-python drops one leading space (a Llama-1 habit, _internals.py).
    assert llm.detokenize(ours.encode(" x", bos=True)) == b"x"
    assert ours.decode(ours.encode(" x", bos=True)) == " x"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text())
def test_llama_cpp_agrees_on_any_text(llamas, text):
    ours, llm = llamas
    assert llm.tokenize(text.encode(), add_bos=False, special=False) == ours.encode(text)


def test_pre_tokenizers_differ(tok):
    """The oracle tests compare something: the pre-tokenizers split this text differently."""
    text = "x = 1234567890\n\n    DON'T"
    md = tok.gguf_metadata()
    splits = {pre: [word for word, _ in Tokenizer.from_gguf_metadata({**md, "tokenizer.ggml.pre": pre})
                    .hf.pre_tokenizer.pre_tokenize_str(text)] for pre in ORACLE_PRES}
    assert splits["gpt-2"] == ["x", "Ġ=", "Ġ1234567890", "ĊĊĠĠĠ", "ĠDON", "'", "T"]
    assert len({tuple(words) for words in splits.values()}) == len(ORACLE_PRES)


def test_ref_impl_gguf_file(tok, tmp_path, samples):
    """The course's own GGUF writer and reader carry the vocabulary to llama.cpp and back."""
    llama_cpp = pytest.importorskip("llama_cpp")
    arch, tensors = tiny_llama(tok.vocab_size)
    path = tmp_path / "tiny.gguf"
    our_gguf.write(path, {**arch, **tok.gguf_metadata()}, tensors)
    with our_gguf.read(path) as f:
        again = Tokenizer.from_gguf_metadata(f.metadata)
    assert again.gguf_metadata() == tok.gguf_metadata()
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    for text in samples:
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == tok.encode(text), repr(text)


def test_hf_export(tok, tmp_path, samples):
    transformers = pytest.importorskip("transformers")
    tok.save_hf(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for text in samples[:80]:
        assert hf.encode(text) == tok.encode(text, bos=True), repr(text)
        assert hf.decode(tok.encode(text), skip_special_tokens=True) == text


def _vocab(name: str) -> Tokenizer:
    """One of llama.cpp's tokenizer test vocabularies (`make setup` and `make lab` extract them into .vocab/)."""
    from ref_impl import VOCAB_DIR

    path = VOCAB_DIR / f"ggml-vocab-{name}.gguf"
    if not path.is_file():
        pytest.fail(f"{path} is missing: run `make setup` (it extracts llama.cpp's ggml-vocab-* test files)")
    with our_gguf.read(path) as f:
        return Tokenizer.from_gguf_metadata(f.metadata)


# the course's own byte-level BPE, SentencePiece with byte fallback (llama-spm: "<0xE4>" tokens, "▁"),
# a large byte-level BPE whose tokens split CJK characters and emoji between them (qwen2), and Gemma 4's
# BPE over SentencePiece pieces (no leading "▁" to drop; "</s>" is text there)
STREAMED = {"trained": None, "llama-spm": "llama-spm", "qwen2": "qwen2", "gemma-4": "gemma-4"}


@pytest.fixture(scope="module", params=list(STREAMED))
def streamed(request, tok) -> Tokenizer:
    return tok if STREAMED[request.param] is None else _vocab(STREAMED[request.param])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_streamed_text_is_the_decode_of_every_prefix(streamed, data):
    """Random token sequences (ids from all over the vocabulary, byte tokens, controls, and the tokens of a
    text with characters of 1 to 4 UTF-8 bytes): after each token the streamed text is the full decode of
    the prefix less only the characters still incomplete, and with flush it is the full decode."""
    text = data.draw(st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12))
    noise = data.draw(st.lists(st.integers(0, streamed.vocab_size - 1), max_size=12))
    ids = data.draw(st.permutations(streamed.encode(text) + noise))
    stream, streamed_text = streamed.stream(), ""
    for k, token in enumerate(ids, 1):
        streamed_text += stream.add(token)
        full = streamed.decode(ids[:k])
        assert full.startswith(streamed_text) and set(full[len(streamed_text):]) <= {"\ufffd"}, (ids[:k], streamed_text)
    assert streamed_text + stream.flush() == streamed.decode(ids)
    again = streamed.stream()
    assert "".join(again.add(t) for t in streamed.encode(text)) + again.flush() == streamed.decode(streamed.encode(text))
