"""llama.cpp as the oracle: the same work done by our code and by llama.cpp, and the comparison recorded, so that a
page reads the same where llama.cpp's Python bindings (llama-cpp-python, which builds llama.cpp from source) are
not installed.

Two pages compare with llama.cpp. K-quants: the shipped model quantized to Q4_K_M by us and by llama.cpp, tensor by
tensor (`q4_k_m_match`), and our decoder's logits on llama.cpp's file against llama.cpp's own on the same HELD_OUT
held-out tokens (`logits_match`). Your model: a random-weight file of Qwen2.5-0.5B's width with the real Qwen2
vocabulary (`write_qwen2`, one definition of its shape and seed), tokenized (TEXTS) and continued greedily for
FIRST_TOKENS tokens after one chat prompt (`qwen2_prompt`) by both (`llama_cpp_tokens`, `llama_cpp_greedy`).

Each of those functions measures live where the bindings import (`peers.llama_cpp_available`), and otherwise says so
in one line and answers from the reference run of experiment "oracle" (`records.reference`). `bench_oracle`
(`python -m ref_impl bench --oracle`) measures everything and writes those records; it times nothing.

See chapter: kquants
"""

from __future__ import annotations

import functools
import hashlib
import itertools
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

import ref_impl
from ref_impl.engine import chat
from ref_impl.engine.checkpoint import load, load_model
from ref_impl.engine.compose import generate
from ref_impl.engine.model import ModelArgs
from ref_impl.engine.random import write_random_model
from ref_impl.engine.tokenizer import Tokenizer
from ref_impl.formats import gguf, quantize
from ref_impl.measure import peers, records
from ref_impl.measure.records import Run, record
from ref_impl.platform.machine import package_version
from ref_impl.platform.quiet import held_stderr
from ref_impl.training.corpus import heldout_stream

EXPERIMENT = "oracle"
REFERENCE = "cpu-2core"                 # the machine whose reference run a page shows without llama.cpp
RESULTS = ref_impl.RESULTS_DIR          # where that run is read from
VOCAB = ref_impl.VOCAB_DIR              # llama.cpp's tokenizer test files
FILE_TYPE = "Q4_K_M"
HELD_OUT = slice(1000, 1256)            # the held-out tokens both engines score: 256 of them
QWEN2_MODEL = "Qwen2.5-0.5B width, 1 layer, random"
QWEN2_VOCAB = "ggml-vocab-qwen2.gguf"   # llama.cpp's tokenizer test file (`make lab` extracts it into .vocab/)
QWEN2_SEED = 0
TEXTS = ("The quick brown fox", "def f(x):\n    return x ** 2", "naïve café, 你好, 🙂", "  1234567 tokens")
QUESTION, SYSTEM = "Why is decoding memory-bound?", "Answer in one sentence."
FIRST_TOKENS = 8
Say = Callable[[str], None]


# ---- the Qwen2-style file: one definition ----------------------------------------------------------------

def qwen2_vocab(vocab_dir: Path = VOCAB) -> dict:
    """The `tokenizer.*` keys of llama.cpp's Qwen2 vocabulary file: 151,936 tokens and ChatML's template."""
    path = Path(vocab_dir) / QWEN2_VOCAB
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: `make lab` (or `make setup`) extracts llama.cpp's tokenizer "
                                "test files into .vocab/")
    with gguf.read(path) as f:
        return {k: v for k, v in f.metadata.items() if k.startswith("tokenizer.")}


def qwen2_args(vocab_size: int) -> ModelArgs:
    """Qwen2.5-0.5B's width (its config.json: 896 wide, 14 query heads sharing 2 key-value heads of 64, rope base
    1e6, biases on q, k and v), one layer."""
    return ModelArgs(vocab_size=vocab_size, hidden_size=896, num_hidden_layers=1, intermediate_size=4864,
                     num_attention_heads=14, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1e6,
                     max_position_embeddings=32768, architecture="qwen2", attention_bias=True)


def write_qwen2(path: str | Path, vocab: dict) -> Path:
    """The random-weight Qwen2-style file both pages' comparisons run on: F32, seed QWEN2_SEED."""
    args = qwen2_args(len(vocab["tokenizer.ggml.tokens"]))
    return write_random_model(path, args, "F32", seed=QWEN2_SEED, tokenizer=vocab)


def qwen2_prompt(vocab: dict, source: str) -> str:
    """The one chat prompt (SYSTEM, then QUESTION) in the vocabulary's template; source names the file."""
    return chat.chat_prompt(vocab, source, QUESTION, SYSTEM)


@functools.lru_cache(maxsize=8)
def _digest(path: str, mtime_ns: int, size: int) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def sha256(path: str | Path) -> str:
    """The SHA-256 of a file's bytes (once per version of the file): which file a recorded comparison was of."""
    stat = Path(path).stat()
    return _digest(str(path), stat.st_mtime_ns, stat.st_size)


# ---- live, or the recorded comparison --------------------------------------------------------------------

def notice(run: Run) -> str:
    """The one line a page prints where it shows a recorded comparison instead of a live one."""
    return ("llama.cpp's Python bindings are not installed here (`make setup` adds them): the comparison as "
            f"recorded on {run.caption}")


def recorded(label: str = REFERENCE, say: Say = print) -> Run | None:
    """None where llama.cpp's bindings import (compare live); else the reference "oracle" run of `label` (in
    RESULTS), after saying so in one line. LookupError where that machine recorded none."""
    if peers.llama_cpp_available():
        return None
    run = records.reference(EXPERIMENT, label, RESULTS)
    if run is None:
        raise LookupError(f"llama.cpp's Python bindings are not installed here and {label} recorded no comparison "
                          "with llama.cpp: run `python -m ref_impl bench --oracle` where they are (`make setup`)")
    say(notice(run))
    return run


def _one(run: Run, metric: str, **where) -> dict:
    found = run.select(EXPERIMENT, metric=metric, **where)
    if len(found) != 1:
        raise LookupError(f"results/{run.file}: {len(found)} oracle records of {metric} with {where}, not one")
    return found[0]


def _same_file(run: Run, r: dict, path: str | Path, key: str) -> None:
    if r.get(key) != sha256(path):
        raise LookupError(f"results/{run.file} compared another file than {Path(path).name} (SHA-256 "
                          f"{str(r.get(key))[:12]}...): run `python -m ref_impl bench --oracle` again")


# ---- K-quants: Q4_K_M byte for byte, and the logits on llama.cpp's file ----------------------------------

@dataclass(frozen=True)
class QuantMatch:
    """Our Q4_K_M file of a model against llama.cpp's: tensors of the same type and bytes, and the matrices
    llama.cpp gave a fallback type (K-quant rows that are not whole super-blocks), per type."""
    same: int
    tensors: int
    matrices: int
    fell_back: dict[str, int]
    file: Path          # llama.cpp's file; without llama.cpp, ours, which the recorded run found identical

    def __str__(self) -> str:
        types = ", ".join(f"{n} to {t}" for t, n in self.fell_back.items())
        return (f"{self.same} of {self.tensors} tensors identical, byte for byte; llama.cpp fell back on "
                f"{sum(self.fell_back.values())} of {self.matrices} matrices ({types})")


def compare_quantized(ours: Path, theirs: Path) -> QuantMatch:
    """Tensor by tensor, llama.cpp's file against ours (a tensor missing from ours is a KeyError)."""
    with gguf.read(ours) as o, gguf.read(theirs) as t:
        same = sum(o.tensors[n].type == t.tensors[n].type
                   and np.array_equal(o.array(n).view(np.uint8), t.array(n).view(np.uint8)) for n in t.tensors)
        fell_back = Counter(x.type.name for x in t.tensors.values() if x.type.name in quantize.FALLBACK.values()
                            and len(x.shape) == 2)
        matrices = sum(len(x.shape) == 2 for x in t.tensors.values())
        return QuantMatch(int(same), len(t.tensors), matrices, dict(fell_back), Path(theirs))


def q4_k_m_match(src: Path, ours: Path, work: Path, label: str = REFERENCE, say: Say = print) -> QuantMatch:
    """Our Q4_K_M file of src (already written at `ours`) against llama.cpp's, which it writes into work; without
    llama.cpp, the reference run's comparison of the same src."""
    run = recorded(label, say)
    if run is None:
        theirs = Path(work) / f"llama.cpp-{FILE_TYPE}.gguf"
        quantize.with_llama_cpp(src, theirs, FILE_TYPE)
        return compare_quantized(Path(ours), theirs)
    where = {"model": Path(src).stem, "variant": "quantize"}
    same = _one(run, "identical_tensors", **where)
    _same_file(run, same, src, "source_sha256")
    total = _one(run, "tensors", **where)["value"]
    if same["value"] != total:
        raise LookupError(f"results/{run.file}: our {FILE_TYPE} file differed from llama.cpp's in "
                          f"{total - same['value']} tensors, so ours cannot stand in for it")
    fell_back = {r["fallback"]: r["value"] for r in run.select(EXPERIMENT, metric="fallback_tensors", **where)}
    return QuantMatch(same["value"], total, _one(run, "matrices", **where)["value"], fell_back, Path(ours))


@dataclass(frozen=True)
class LogitsMatch:
    """Our decoder on a quantized file against llama.cpp on the same file and tokens."""
    agree: float        # share of positions where both pick the same next token
    max_diff: float     # largest |logit difference|
    positions: int
    low: float          # our logits' span
    high: float

    def __str__(self) -> str:
        return (f"same top-1 token at {100 * self.agree:.1f}% of {self.positions} positions; max |logit difference| "
                f"{self.max_diff:.3f} (logits span {self.low:.1f} to {self.high:.1f})")


def compare_logits(path: Path, ids: Sequence[int]) -> tuple[LogitsMatch, np.ndarray]:
    """Our decoder (quantized weights kept quantized, float32) and llama.cpp on the file at path, one batch of ids;
    with whether each position's top-1 token agrees."""
    with gguf.read(path) as f:
        model = load_model(f, mx.float32, quantized=True)
    ours = np.array(model(mx.array([list(ids)]))[0])
    theirs = peers.llama_cpp_logits(path, ids)
    agree = ours.argmax(-1) == theirs.argmax(-1)
    return LogitsMatch(float(agree.mean()), float(np.abs(ours - theirs).max()), len(ids), float(ours.min()),
                       float(ours.max())), agree


def logits_match(path: Path, ids: Sequence[int], label: str = REFERENCE, say: Say = print) -> LogitsMatch:
    """Our logits against llama.cpp's on its Q4_K_M file at path; without llama.cpp, the reference run's (its own
    held-out tokens: ids is not read then)."""
    run = recorded(label, say)
    if run is None:
        return compare_logits(path, ids)[0]
    r = _one(run, "top1_agreement", variant="logits")
    value = {m: _one(run, m, variant="logits")["value"] for m in ("max_logit_difference", "logit_min", "logit_max")}
    return LogitsMatch(r["value"], value["max_logit_difference"], r["context"], value["logit_min"], value["logit_max"])


# ---- Your model: the Qwen2 vocabulary's tokens and the first greedy tokens -------------------------------

def llama_cpp_tokens(path: Path, texts: Sequence[str] = TEXTS, label: str = REFERENCE, say: Say = print
                     ) -> list[list[int]]:
    """llama.cpp's token ids of each text (no BOS, special tokens as text) with the vocabulary of the file at path;
    without llama.cpp, those the reference run recorded for the same file."""
    run = recorded(label, say)
    if run is None:
        import llama_cpp

        with held_stderr():   # llama.cpp's warnings about the file are not ours to print
            llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, verbose=False)
        return [llm.tokenize(t.encode(), add_bos=False, special=False) for t in texts]
    found = [_one(run, "tokenizer_agreement", variant="tokenizer", text=t) for t in texts]
    _same_file(run, found[0], path, "file_sha256")
    return [list(r["peer_ids"]) for r in found]


def llama_cpp_greedy(path: Path, prompt: Sequence[int], n: int = FIRST_TOKENS, label: str = REFERENCE,
                     say: Say = print) -> list[int]:
    """llama.cpp's first n greedy tokens after prompt (ids) on the file at path; without llama.cpp, those the
    reference run recorded for the same file and prompt."""
    run = recorded(label, say)
    if run is None:
        return list(itertools.islice(peers.llama_cpp_stream(path, len(prompt) + n)(list(prompt), n), n))
    r = _one(run, "first_tokens_agreeing", variant="greedy")
    _same_file(run, r, path, "file_sha256")
    if list(r["prompt_ids"]) != list(prompt) or r["tokens"] < n:
        raise LookupError(f"results/{run.file} recorded {r['tokens']} tokens after another prompt")
    return list(r["peer_ids"])[:n]


def agreeing_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens two greedy continuations share from the start (after a difference each follows its own)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# ---- the bench suite ---------------------------------------------------------------------------------------

def _peer() -> str:
    return f"llama.cpp (llama-cpp-python {package_version('llama_cpp_python')})"


def kquants_records(src: Path, work: Path) -> list[dict]:
    """The K-quants page's comparisons on the float model at src: Q4_K_M by us and by llama.cpp, and the logits of
    our decoder and llama.cpp's on llama.cpp's file over the HELD_OUT tokens."""
    ours = Path(work) / f"ours-{FILE_TYPE}.gguf"
    quantize.quantize_file(src, ours, FILE_TYPE)
    theirs = Path(work) / f"llama.cpp-{FILE_TYPE}.gguf"
    quantize.with_llama_cpp(src, theirs, FILE_TYPE)
    match = compare_quantized(ours, theirs)
    fields = {"model": src.stem, "weights": FILE_TYPE, "peer": _peer()}
    q = {**fields, "variant": "quantize", "source_sha256": sha256(src)}
    out = [record(EXPERIMENT, "identical_tensors", "tensors", match.same, **q,
                  note="tensors of the same type and bytes in both files"),
           record(EXPERIMENT, "tensors", "tensors", match.tensors, **q),
           record(EXPERIMENT, "matrices", "tensors", match.matrices, **q)]
    out += [record(EXPERIMENT, "fallback_tensors", "tensors", n, **q, fallback=t) for t, n in match.fell_back.items()]
    with gguf.read(src) as f:
        stream, fingerprint = heldout_stream(Tokenizer.from_gguf_metadata(f.metadata))
    ids = stream[HELD_OUT].tolist()
    logits, agree = compare_logits(theirs, ids)
    lg = {**fields, "variant": "logits", "context": len(ids), "corpus_sha256": fingerprint,
          "held_out": [HELD_OUT.start, HELD_OUT.stop]}
    return out + [record(EXPERIMENT, "top1_agreement", "fraction", logits.agree, samples=agree, **lg),
                  record(EXPERIMENT, "max_logit_difference", "logit", logits.max_diff, **lg),
                  record(EXPERIMENT, "logit_min", "logit", logits.low, **lg),
                  record(EXPERIMENT, "logit_max", "logit", logits.high, **lg)]


def your_model_records(vocab_dir: Path, work: Path) -> list[dict]:
    """The Your-model page's comparisons on the Qwen2-style file (`write_qwen2`): each of TEXTS tokenized, and the
    first FIRST_TOKENS greedy tokens after the chat prompt."""
    vocab = qwen2_vocab(vocab_dir)
    path = write_qwen2(Path(work) / "qwen2-random.gguf", vocab)
    model, tokenizer = load(path)
    fields = {"model": QWEN2_MODEL, "weights": "F32", "peer": _peer(), "file_sha256": sha256(path)}
    out = []
    for text, theirs in zip(TEXTS, llama_cpp_tokens(path, TEXTS, say=lambda s: None)):
        ours = tokenizer.encode(text)
        out.append(record(EXPERIMENT, "tokenizer_agreement", "fraction", ours == theirs, variant="tokenizer", **fields,
                          text=text, ids=ours, peer_ids=[int(i) for i in theirs]))
    prompt = chat.encode(tokenizer, qwen2_prompt(vocab, path.name))
    ours = generate(model, tokenizer, prompt, FIRST_TOKENS, stop_at_eos=False).tokens
    theirs = llama_cpp_greedy(path, prompt, FIRST_TOKENS, say=lambda s: None)
    out.append(record(EXPERIMENT, "first_tokens_agreeing", "tokens", agreeing_prefix(ours, theirs), variant="greedy",
                      **fields, tokens=FIRST_TOKENS, prompt_ids=prompt, ids=[int(i) for i in ours],
                      peer_ids=[int(i) for i in theirs], note="the first tokens both greedy continuations share"))
    return out


def bench_oracle(src: Path, work: Path, vocab_dir: Path = VOCAB, progress: Say = lambda s: None) -> list[dict]:
    """`bench --oracle`: every comparison the pages make with llama.cpp, as "oracle" records. Refused where
    llama.cpp's bindings do not import."""
    if not peers.llama_cpp_available():
        raise RuntimeError("bench --oracle compares our code with llama.cpp, whose Python bindings "
                           "(llama-cpp-python) are not installed here: `make setup` installs them")
    qwen2_vocab(vocab_dir)          # refused before any work when .vocab/ is missing
    progress(f"oracle: {src.name} to {FILE_TYPE} by us and by llama.cpp, and the logits on llama.cpp's file")
    out = kquants_records(Path(src), Path(work))
    progress("oracle: the Qwen2-style file's tokens and first greedy tokens")
    return out + your_model_records(Path(vocab_dir), Path(work))
