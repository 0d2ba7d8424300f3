"""llama.cpp as the oracle (ref_impl/measure/oracle.py): `bench --oracle` records the pages' comparisons with
llama.cpp, refuses without its Python bindings, and the pages' functions answer from a recorded run where the
bindings are missing, saying so in one line."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from ref_impl.__main__ import main
from ref_impl.formats import gguf
from ref_impl.measure import oracle, peers
from ref_impl.measure.records import record

ROOT = Path(__file__).resolve().parent.parent
needs_llama_cpp = pytest.mark.skipif(not peers.llama_cpp_available(), reason="compares with llama.cpp's bindings")


@pytest.fixture
def no_llama_cpp(monkeypatch):
    """llama.cpp's bindings hidden: `import llama_cpp` raises ImportError, as where they are not installed."""
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    assert not peers.llama_cpp_available()


# ---- the suite -----------------------------------------------------------------------------------------------

@needs_llama_cpp
def test_bench_oracle_records_every_comparison_of_the_pages(shipped_model, tmp_path, monkeypatch, capsys):
    """On the shipped model, and on the Qwen2-style file made narrow (the vocabulary stays the real one)."""
    full = oracle.qwen2_args
    narrow = lambda vocab_size: replace(full(vocab_size), hidden_size=64, intermediate_size=128,  # noqa: E731
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    monkeypatch.setattr(oracle, "qwen2_args", narrow)
    assert main(["bench", "--oracle", "--model", str(shipped_model), "--out", str(tmp_path), "--label", "cpu-test",
                 "--work-dir", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("cpu-test-*.json")
    doc = json.loads(path.read_text())
    rs = doc["records"]
    assert {r["experiment"] for r in rs} == {"oracle"} and all(r["peer"].startswith("llama.cpp") for r in rs)
    by = {(r["variant"], r["metric"], r.get("fallback") or r.get("text")): r for r in rs}
    assert len(by) == len(rs)                                      # one record per comparison
    with gguf.read(shipped_model) as f:
        misfits = sum(len(t.shape) == 2 and t.shape[-1] % 256 != 0 for t in f.tensors.values())
        matrices = sum(len(t.shape) == 2 for t in f.tensors.values())
        tensors = len(f.tensors)
    assert by["quantize", "identical_tensors", None]["value"] == by["quantize", "tensors", None]["value"] == tensors
    assert by["quantize", "matrices", None]["value"] == matrices
    fell_back = {k[2]: r["value"] for k, r in by.items() if k[1] == "fallback_tensors"}
    assert set(fell_back) <= {"Q5_0", "Q5_1", "Q8_0"} and sum(fell_back.values()) == misfits > 0
    assert by["quantize", "tensors", None]["source_sha256"] == oracle.sha256(shipped_model)
    top1 = by["logits", "top1_agreement", None]
    assert top1["context"] == len(top1["samples"]) == 256 and top1["value"] >= 0.95
    assert top1["value"] == sum(top1["samples"]) / 256 and top1["held_out"] == [1000, 1256]
    assert 0 < by["logits", "max_logit_difference", None]["value"] < 2
    assert by["logits", "logit_min", None]["value"] < 0 < by["logits", "logit_max", None]["value"]
    for text in oracle.TEXTS:
        r = by["tokenizer", "tokenizer_agreement", text]
        assert r["value"] == 1.0 and r["ids"] == r["peer_ids"] and len(r["ids"]) > 0
    greedy = by["greedy", "first_tokens_agreeing", None]
    assert greedy["tokens"] == len(greedy["ids"]) == len(greedy["peer_ids"]) == 8
    assert greedy["value"] == oracle.agreeing_prefix(greedy["ids"], greedy["peer_ids"]) == 8
    assert len(rs) == 8 + len(fell_back) + len(oracle.TEXTS)
    out = capsys.readouterr().out
    assert "identical_tensors" in out and "first_tokens_agreeing" in out and f"wrote {path}" in out


def test_bench_oracle_refuses_without_llama_cpp(no_llama_cpp, tmp_path, capsys):
    assert main(["bench", "--oracle", "--out", str(tmp_path), "--label", "cpu-test", "--work-dir",
                 str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "llama-cpp-python" in err and "make setup" in err
    assert not list(tmp_path.glob("*.json"))


# ---- the pages' functions on a made-up run -------------------------------------------------------------------

@pytest.fixture
def made_up(tmp_path, monkeypatch):
    """A results folder holding one made-up "oracle" run of machine "made-up", on files made here."""
    src, blob = tmp_path / "src.gguf", tmp_path / "blob"
    src.write_bytes(b"a float model")
    blob.write_bytes(b"a random Qwen2-style file")
    q = {"model": "src", "weights": "Q4_K_M", "variant": "quantize", "source_sha256": oracle.sha256(src)}
    lg = {"model": "src", "weights": "Q4_K_M", "variant": "logits", "context": 256}
    y = {"model": oracle.QWEN2_MODEL, "weights": "F32", "file_sha256": oracle.sha256(blob)}
    rs = [record("oracle", "identical_tensors", "tensors", 50, **q), record("oracle", "tensors", "tensors", 50, **q),
          record("oracle", "matrices", "tensors", 40, **q),
          record("oracle", "fallback_tensors", "tensors", 3, fallback="Q8_0", **q),
          record("oracle", "fallback_tensors", "tensors", 30, fallback="Q5_0", **q),
          record("oracle", "top1_agreement", "fraction", 0.75, **lg),
          record("oracle", "max_logit_difference", "logit", 0.5, **lg),
          record("oracle", "logit_min", "logit", -9.0, **lg), record("oracle", "logit_max", "logit", 11.0, **lg),
          record("oracle", "first_tokens_agreeing", "tokens", 8, variant="greedy", tokens=8, prompt_ids=[1, 2, 3],
                 ids=list(range(10, 18)), peer_ids=list(range(10, 18)), **y)]
    rs += [record("oracle", "tokenizer_agreement", "fraction", 1.0, variant="tokenizer", text=t, ids=[k, 7],
                  peer_ids=[k, 7], **y) for k, t in enumerate(oracle.TEXTS)]
    results = tmp_path / "results"
    results.mkdir()
    doc = {"schema": 1, "date": "2026-12-06T10:00:00+00:00", "git": "abc1234", "command": "python -m ref_impl bench "
           "--oracle", "machine": {"label": "made-up"}, "records": rs}
    (results / "made-up-20261206-100000.json").write_text(json.dumps(doc))
    monkeypatch.setattr(oracle, "RESULTS", results)
    return src, blob, results


def test_without_llama_cpp_each_page_function_says_so_once_and_answers_from_the_run(made_up, no_llama_cpp, tmp_path):
    src, blob, _ = made_up
    said = []
    match = oracle.q4_k_m_match(src, tmp_path / "ours.gguf", tmp_path, "made-up", said.append)
    assert (match.same, match.tensors, match.matrices) == (50, 50, 40) and match.fell_back == {"Q8_0": 3, "Q5_0": 30}
    assert match.file == tmp_path / "ours.gguf"      # ours stands in for llama.cpp's, identical in every tensor
    assert str(match) == ("50 of 50 tensors identical, byte for byte; llama.cpp fell back on 33 of 40 matrices "
                          "(3 to Q8_0, 30 to Q5_0)")
    logits = oracle.logits_match(match.file, [1, 2], "made-up", said.append)
    assert (logits.agree, logits.max_diff, logits.positions, logits.low, logits.high) == (0.75, 0.5, 256, -9, 11)
    assert str(logits).startswith("same top-1 token at 75.0% of 256 positions; max |logit difference| 0.500")
    assert oracle.llama_cpp_tokens(blob, label="made-up", say=said.append) == [[k, 7] for k in range(4)]
    assert oracle.llama_cpp_tokens(blob, oracle.TEXTS[2:3], "made-up", said.append) == [[2, 7]]
    assert oracle.llama_cpp_greedy(blob, [1, 2, 3], 8, "made-up", said.append) == list(range(10, 18))
    assert oracle.llama_cpp_greedy(blob, [1, 2, 3], 4, "made-up", said.append) == list(range(10, 14))
    assert len(said) == 6 and len(set(said)) == 1 and "\n" not in said[0]
    assert said[0].startswith("llama.cpp's Python bindings are not installed here")
    assert "made-up, 6 Dec 2026, commit abc1234 (results/made-up-20261206-100000.json)" in said[0]


def test_a_recorded_answer_is_refused_for_another_file_prompt_or_text(made_up, no_llama_cpp, tmp_path):
    src, blob, _ = made_up
    quiet = dict(label="made-up", say=lambda s: None)
    other = tmp_path / "elsewhere" / "src.gguf"      # the same name, other bytes
    other.parent.mkdir()
    other.write_bytes(b"another file")
    with pytest.raises(LookupError, match="another file"):
        oracle.q4_k_m_match(other, tmp_path / "ours.gguf", tmp_path, **quiet)
    with pytest.raises(LookupError, match="another file"):
        oracle.llama_cpp_tokens(other, **quiet)
    with pytest.raises(LookupError, match="another file"):
        oracle.llama_cpp_greedy(other, [1, 2, 3], **quiet)
    with pytest.raises(LookupError, match="another prompt"):
        oracle.llama_cpp_greedy(blob, [1, 2, 4], **quiet)
    with pytest.raises(LookupError, match="0 oracle records"):
        oracle.llama_cpp_tokens(blob, ["a text nobody recorded"], **quiet)
    with pytest.raises(LookupError, match="bench --oracle"):
        oracle.recorded("no-such-machine", lambda s: None)


def test_a_recorded_file_that_differed_from_llama_cpps_cannot_stand_in_for_it(made_up, no_llama_cpp, tmp_path):
    src, _, results = made_up
    (path,) = results.glob("*.json")
    doc = json.loads(path.read_text())
    next(r for r in doc["records"] if r["metric"] == "identical_tensors")["value"] = 49
    path.write_text(json.dumps(doc))
    with pytest.raises(LookupError, match="differed from llama.cpp's in 1 tensors"):
        oracle.q4_k_m_match(src, tmp_path / "ours.gguf", tmp_path, "made-up", lambda s: None)


@needs_llama_cpp
def test_with_llama_cpp_the_pages_compare_live_and_say_nothing(made_up):
    said = []
    assert oracle.recorded("made-up", said.append) is None and said == []


def test_agreeing_prefix():
    assert oracle.agreeing_prefix([1, 2, 3], [1, 2, 3]) == 3
    assert oracle.agreeing_prefix([1, 2, 3, 4], [1, 9, 3, 4]) == 1
    assert oracle.agreeing_prefix([5], [6]) == 0 and oracle.agreeing_prefix([1, 2], [1, 2, 3]) == 2


# ---- one definition, for the pages and the bench ---------------------------------------------------------------

def test_the_pages_take_their_comparisons_from_the_oracle_module():
    """The texts, the file's shape and seed, the held-out tokens and the prompt are oracle's, never copied into a
    page; no page imports llama_cpp itself."""
    pages = {p: "\n".join("".join(c["source"]) for c in json.loads((ROOT / p).read_text())["cells"]
                          if c["cell_type"] == "code")
             for p in ("book/kquants/super-blocks.ipynb", "book/appendix/your-model.ipynb")}
    for page, code in pages.items():
        assert "import llama_cpp" not in code and "peers.llama_cpp" not in code, page
    sb, ym = pages.values()
    assert "oracle.q4_k_m_match(" in sb and "oracle.logits_match(" in sb and "stream[oracle.HELD_OUT]" in sb
    for name in ("oracle.write_qwen2(", "oracle.qwen2_prompt(", "oracle.llama_cpp_tokens(", "oracle.TEXTS",
                 "oracle.llama_cpp_greedy(", "oracle.FIRST_TOKENS"):
        assert name in ym, name
    assert not any(t in ym for t in oracle.TEXTS[:2]) and oracle.QUESTION not in ym
