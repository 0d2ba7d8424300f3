"""Our tokenizer against llama.cpp on llama.cpp's own tokenizer test vocabularies (models/ggml-vocab-*.gguf).

`make setup` extracts them from the pinned llama-cpp-python source package into .vocab/. Three oracles:
the .inp/.out vectors (made by llama.cpp's tests/test-tokenizer-0.cpp: add_special and parse_special
off), llama.cpp itself through llama-cpp-python on a varied text set, and its token pieces for decode.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import llama_cpp
import numpy as np
import pytest

from ref_impl import VOCAB_DIR
from ref_impl.__main__ import main
from ref_impl.engine.tokenizer import Tokenizer
from ref_impl.formats import gguf as our_gguf

SEPARATOR = "\n__ggml_vocab_test__\n"  # between two inputs of a .inp file (test-tokenizer-0.cpp)
SUPPORTED = ["aquila", "baichuan", "command-r", "deepseek-coder", "deepseek-llm", "falcon", "gemma-4", "gpt-2",
             "gpt-neox", "llama-bpe", "llama-spm", "mpt", "phi-3", "qwen2", "qwen35", "refact", "starcoder"]
REFUSED = {"bert-bge": "bert", "nomic-bert-moe": "t5"}  # tokenizer.ggml.model

TEXTS = [
    "", " ", "  ", "\t", "\n", "\r\n", "\n\n\n", " \n ", "a  b", "a   b   ", "x\t\ty", "  leading", "trailing   ",
    "\t\tif x:\n\t\t\treturn y\r\n", "don't", "it's", "DON'T", "We'Ve a'lL", "x = 1234567890", "3.14159e-10",
    "0x1F_FF", "12 345 6789", "3333333333 4444 55555 666666", "1,000,000.00", "١٢٣ ٤٥", "Ⅻ", "½", "²³",
    "héllo wörld", "naïve café", "Привет, мир", "你好，世界", "こんにちは", "안녕하세요", "Ελληνικά", "עברית",
    "العربية", "हिन्दी", "ไทย", "🙂🙃 emoji 👍🏽 👨‍👩‍👧", "🦙🦙", "\x00", "a\x00b", "\x7f\x1b[0m",
    "\u00a0nbsp\u00a0", "\u2028\u2029", "\u3000ideographic", "tab\u000bvt\u000cff", "\u200bzero\u200dwidth",
    "e\u0301 combining", "\ufeffbom", "\U0010ffff", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "def f(x):\n    return x ** 2  # square\n", "class A(B, metaclass=M):\n    '''Doc.'''\n\n    x: int = 0\n",
    "print(f\"{x!r:>10} {y:.3f}\")", "lambda *a, **kw: (a, kw)", "#" * 80, " " * 40 + "x", "\n" * 20,
    "int main() {\n\tprintf(\"%d\\n\", 42);\n}\n", "SELECT * FROM t WHERE id = 7;", "https://example.com/a?b=c&d=1",
    "$$ a+b=c <x> ^~|` @", "   \n\n   \t\t  x  ", "Hello World!", " Hello World!", "   Hello\n\nWorld",
    # special-token strings: control ones stay text, user-defined ones are matched (special=False)
    "<s>", "</s>", "<unk>", "<|endoftext|>", "a<|endoftext|>b", "<|im_start|>user\nhi<|im_end|>",
    "<|user|> hi </s> x", "<|begin_of_text|><|start_header_id|>", "<fim_prefix>x<fim_suffix>", "<0x41>",
    "▁▁x ▁", "Ġ Ċ",
]


def vocab_path(name: str) -> Path:
    if not VOCAB_DIR.is_dir():
        pytest.fail(f"{VOCAB_DIR} is missing: run `make setup` (it extracts llama.cpp's ggml-vocab-* test files)")
    return VOCAB_DIR / f"ggml-vocab-{name}.gguf"


def read_metadata(path: Path) -> dict:
    with our_gguf.read(path) as f:
        return dict(f.metadata)


def read_vectors(path: Path) -> list[tuple[str, list[int]]]:
    """The (text, ids) pairs of a .inp/.out pair, split as test-tokenizer-0.cpp splits them."""
    raw = Path(f"{path}.inp").read_bytes().decode()
    texts = raw.split(SEPARATOR)
    if texts[-1] == "":  # the file ends with a separator
        texts.pop()
    lines = Path(f"{path}.out").read_text(encoding="utf-8").split("\n")
    assert len(lines) >= len(texts)
    return [(text, [int(t) for t in line.split()]) for text, line in zip(texts, lines)]


def pieces(llm, ids: list[int]) -> bytes:
    """llama.cpp's `token_to_piece` for each id, joined (llama-cpp-python's detokenize, without its
    32-byte limit per piece nor its dropped leading space after BOS)."""
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    buf = (ctypes.c_char * 1024)()
    return b"".join(bytes(buf[:llama_cpp.llama_token_to_piece(vocab, t, buf, len(buf), 0, False)]) for t in ids)


def test_vocab_files_are_all_classified():
    """Every ggml-vocab file is either checked against llama.cpp or refused; a new one must be added here."""
    vocab_path("gpt-2")
    names = {p.name[len("ggml-vocab-"):-len(".gguf")] for p in VOCAB_DIR.glob("ggml-vocab-*.gguf")}
    assert names == set(SUPPORTED) | set(REFUSED)


@pytest.fixture(scope="module", params=SUPPORTED)
def pair(request):
    """Our tokenizer and llama.cpp's (vocab only) for one vocabulary file, loaded once."""
    path = vocab_path(request.param)
    metadata = read_metadata(path)
    return request.param, metadata, Tokenizer.from_gguf_metadata(metadata), \
        llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)


def test_vectors(pair):
    """Our ids equal llama.cpp's expected ids for every input of the vocabulary's .inp file."""
    name, _, tok, _ = pair
    path = vocab_path(name)
    if not Path(f"{path}.inp").exists():
        assert name in ("aquila", "baichuan", "gpt-neox")  # llama.cpp ships these without vectors
        return
    vectors = read_vectors(path)
    assert len(vectors) >= 46
    wrong = [(text, tok.encode(text), ids) for text, ids in vectors if tok.encode(text) != ids]
    assert not wrong, f"{len(wrong)} of {len(vectors)} vectors differ, first: {wrong[0]!r}"


def test_tokenize_agrees(pair):
    """Our ids equal llama.cpp's on varied text, without and with the vocabulary's BOS/EOS."""
    name, _, tok, llm = pair
    texts = TEXTS + [text for text, _ in read_vectors(vocab_path(name))] if name not in (
        "aquila", "baichuan", "gpt-neox") else TEXTS
    for text in texts:
        assert tok.encode(text) == llm.tokenize(text.encode(), add_bos=False, special=False), repr(text)
    with_special = llm.tokenize(b"Hello world", add_bos=True, special=False)  # add_special: the file's keys
    assert tok.encode("Hello world", bos=tok.add_bos, eos=tok.add_eos) == with_special
    assert (tok.bos_id, tok.eos_id) == (llm.token_bos(), llm.token_eos())


def test_generation_ends_where_llama_cpp_ends_it(pair):
    """Our end-of-generation tokens are llama.cpp's (llama_vocab_is_eog over the whole vocabulary)."""
    _, _, tok, llm = pair
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    theirs = {i for i in range(tok.vocab_size) if llama_cpp.llama_vocab_is_eog(vocab, i)}
    assert tok.end_ids == theirs, (sorted(tok.end_ids - theirs)[:5], sorted(theirs - tok.end_ids)[:5])


def test_decode_agrees(pair):
    """decode gives llama.cpp's pieces joined (less the SentencePiece leading space): round trips where they do."""
    _, _, tok, llm = pair
    round_trips = 0
    for text in TEXTS:
        ids = llm.tokenize(text.encode(), add_bos=False, special=False)
        theirs = pieces(llm, ids).decode("utf-8", errors="replace")
        if tok.model == "llama" and theirs.startswith(" "):
            theirs = theirs[1:]
        assert tok.decode(ids) == theirs, repr(text)
        round_trips += theirs == text
    assert round_trips >= len(TEXTS) - 12  # only user-defined tokens ("</s>" in Phi-3) and unknowns stop them


def test_gguf_metadata_round_trip(pair):
    """What gguf_metadata writes is the file's own tokenizer keys, read back as the same tokenizer."""
    name, metadata, tok, _ = pair
    written = tok.gguf_metadata()
    for key, value in written.items():
        if key in metadata:
            expected = metadata[key]
            if key == "tokenizer.ggml.scores":
                expected = np.asarray(expected, dtype=np.float32).tolist()
            assert value == expected or (isinstance(value, list) and list(expected) == value), key
    if name in ("llama-spm", "gpt-2", "deepseek-coder"):  # rebuilding costs seconds; the small ones
        again = Tokenizer.from_gguf_metadata(written)
        assert again.gguf_metadata() == written
        assert all(again.encode(text) == tok.encode(text) for text in TEXTS)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused(name):
    """A vocabulary llama.cpp tokenizes with neither BPE nor SentencePiece is refused by name."""
    with pytest.raises(ValueError, match=f"tokenizer.ggml.model is '{REFUSED[name]}'; supported: gpt2, llama"):
        Tokenizer.from_gguf_metadata(read_metadata(vocab_path(name)))


def test_gemma_4_vocabulary_runs(tmp_path):
    """runnable.why_not (inspect's verdict) accepts a model file carrying Gemma 4's vocabulary."""
    from ref_impl.engine import runnable
    from tests.test_tokenizer import tiny_llama
    metadata = {k: v for k, v in read_metadata(vocab_path("gemma-4")).items() if k.startswith("tokenizer.")}
    arch, tensors = tiny_llama(len(metadata["tokenizer.ggml.tokens"]))
    path = tmp_path / "gemma-4-vocab.gguf"
    our_gguf.write(path, {**arch, **metadata}, tensors)
    with our_gguf.read(path) as f:
        assert runnable.why_not(f) is None


def test_refused_at_cli(tmp_path, capsys):
    """The CLI answers a refused tokenizer with one error line and exit status 2."""
    from tests.test_tokenizer import tiny_llama
    metadata = {k: v for k, v in read_metadata(vocab_path("bert-bge")).items() if k.startswith("tokenizer.")}
    arch, tensors = tiny_llama(len(metadata["tokenizer.ggml.tokens"]))
    path = tmp_path / "bert-vocab.gguf"
    our_gguf.write(path, {**arch, **metadata}, tensors)
    assert main(["generate", "--model", str(path), "--prompt", "x", "--max-tokens", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: tokenizer.ggml.model is 'bert'"), err
