"""The composed decoder (engine/compose.py): every switch together in one loop.

- Greedy, a quantized cache with a draft model or MTP heads emits exactly the tokens of plain greedy
  decoding under the same cache; from the command line, the same text.
- Sampled, speculation over a quantized cache keeps the target's distribution under that cache
  (chi-square on many verification steps from one state, and the same test rejects the draft's).
- Every refused combination raises one ValueError naming it, before any model is loaded where the
  switches alone decide; from the command line, one "error:" line and exit status 2.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from ref_impl import MODELS_DIR
from ref_impl.__main__ import main
from ref_impl.engine import kvquant, mtp
from ref_impl.engine.checkpoint import load
from ref_impl.engine.model import Model
from ref_impl.engine.compose import Techniques, check_files, generate
from ref_impl.engine.generate import Sampler, prefill
from ref_impl.engine.speculative import Drafter, rewind, speculative_step
from ref_impl.engine.tokenizer import Tokenizer
from ref_impl.formats import gguf
from tests.conftest import write_random_llama
from tests.test_cli import cli
from tests.test_speculative import SIGNIFICANCE, chi2_pvalue

MODEL, DRAFT, HEADS = (MODELS_DIR / n for n in ("stdlib-10m.gguf", "stdlib-draft-1m.gguf", "stdlib-10m-mtp.gguf"))
PROMPT = "import os\n\ndef main("


@pytest.fixture(scope="module")
def models():
    (model, tok), (draft, _) = load(MODEL, mx.float32), load(DRAFT, mx.float32)
    return model, draft, mtp.load_heads(HEADS, model, mx.float32), tok


def run(models, n=40, **switches):
    model, draft, heads, tok = models
    t = Techniques(**switches)
    proposer = {"draft": draft, "mtp": heads, None: None}[t.speculate]
    return generate(model, tok, PROMPT, n, techniques=t, proposer=proposer, stop_at_eos=False)


# ---- chunked prefill: bounded work per pass, the same tokens -----------------------------------------

@pytest.mark.parametrize("kv, fused, speculate", [("float", False, None), ("sym8", False, "draft"),
                                                  ("affine4-g32", True, "mtp"), ("outlier4", False, None),
                                                  ("kivi4", False, None)])
def test_a_prompt_runs_in_chunks_and_the_head_reads_only_what_is_sampled(models, plain, monkeypatch, kv, fused,
                                                                           speculate):
    """With --prefill-chunk 3, no forward of the model or the draft takes more than 3 positions (a verification
    gamma + 1), and the LM head never reads more than a verification's gamma + 1: a prompt's activations,
    scores and logits are those of a chunk, whatever its length. The tokens are one pass's (kivi's key blocks quantize as a chunk passes
    them: its text may differ, its bound may not)."""
    positions, heads = [], []
    hidden, logits = Model.hidden, Model.logits
    monkeypatch.setattr(Model, "hidden", lambda self, x, cache=None: positions.append(x.shape[1]) or
                        hidden(self, x, cache))
    monkeypatch.setattr(Model, "logits", lambda self, h: heads.append(h.shape[-2] if h.ndim > 2 else 1) or
                        logits(self, h))
    gamma = 3
    g = run(models, n=12, kv=kv, fused=fused, speculate=speculate, gamma=gamma, prefill_chunk=3)
    assert len(g.prompt_tokens) > 2 * 3 and max(positions) <= gamma + 1 and max(heads) <= gamma + 1
    assert positions[:4] == [3, 3, 1, 1]          # the prompt's first 7 positions in chunks, then the last alone
    if kv != "kivi4":
        assert g.tokens == plain(kv, fused).tokens[:12]


# ---- greedy: speculation never changes the tokens -------------------------------------------------

@pytest.fixture(scope="module")
def plain(models):
    """Plain greedy decoding under each cache, once per cache."""
    done = {}
    return lambda kv, fused: done.setdefault((kv, fused), run(models, kv=kv, fused=fused))


CASES = [("sym8", False, "draft", 4), ("sym8", False, "mtp", 3), ("affine4-g32", True, "mtp", 3),
         ("outlier4", False, "draft", 2)]


@pytest.mark.parametrize("kv, fused, speculate, gamma", CASES)
def test_greedy_speculation_over_a_quantized_cache_emits_plain_decodings_tokens(models, plain, kv, fused, speculate,
                                                                                gamma):
    plain = plain(kv, fused)
    spec = run(models, kv=kv, fused=fused, speculate=speculate, gamma=gamma)
    assert spec.tokens == plain.tokens
    assert spec.proposed > 0 and 0 < spec.accepted < spec.proposed
    assert spec.forwards < plain.forwards            # fewer model forwards for the same tokens


def test_generation_reports_what_ran(models):
    g = run(models, kv="sym8", speculate="draft", gamma=4)
    line = g.summary()
    for part in ("kv sym8 (dequantized)", "draft gamma=4", f"acceptance {g.acceptance:.2f}", "TTFT", "ITL p50",
                 "p99", "tok/s", "peak memory"):
        assert part in line, (part, line)
    assert g.peak_memory_bytes > sum(v.nbytes for _, v in tree_flatten(models[0].parameters()))
    assert len(g.tokens) == len(g.token_times) == 40 and np.all(g.inter_token_latencies >= 0)
    plain = run(models, pipeline=False)
    assert "synchronous" in plain.summary() and "acceptance" not in plain.summary()
    assert np.isnan(plain.acceptance) and plain.forwards == 39


def test_cli_greedy_with_sym8_and_a_draft_prints_plain_greedy_text():
    args = ("generate", "--model", MODEL, "--prompt", "def ", "--max-tokens", "48", "--temp", "0", "--kv", "sym8")
    plain, draft = cli(*args), cli(*args, "--draft", DRAFT)
    heads = cli(*args, "--mtp", HEADS, "--gamma", "3")
    for r in (plain, draft, heads):
        assert r.returncode == 0, r.stderr
    assert draft.stdout == plain.stdout == heads.stdout and len(plain.stdout) > len("def ") + 20
    assert "acceptance" in draft.stderr and "draft gamma=4" in draft.stderr and "mtp gamma=3" in heads.stderr
    assert "weights F32 as float32" in plain.stderr and "kv sym8 (dequantized), pipelined" in plain.stderr


# ---- sampled: the target's distribution under the quantized cache ----------------------------------

def first_tokens_of_steps(models, kv: str, speculate: str, n: int, seed: int = 0):
    """n verification steps from one state (the prompt and a fixed y), each rewound after it: the first
    token each emitted, the target's distribution there under the cache `kv`, and the draft's."""
    model, draft, heads, tok = models
    sampler = Sampler(temperature=1.0, top_k=6, seed=seed)
    rng = np.random.default_rng(seed)
    prompt = mx.array([tok.encode(PROMPT, bos=True)])
    size = prompt.shape[1] + 8
    cache = model.make_cache(size, scheme=kv)
    hidden = model.hidden(prompt, cache)[0, -1]
    y = mx.argmax(model.logits(hidden))[None]
    p = sampler.probs(model(y[None], cache)[0, -1])        # the target after y, under this cache
    rewind(cache, 1)
    if speculate == "draft":
        drafter = Drafter(draft, draft.make_cache(size), sampler)
        mx.eval(drafter.prefill(prompt))
        q = sampler.probs(draft(y[None], drafter.cache)[0, -1])
        rewind(drafter.cache, 1)
    else:
        q = sampler.probs(model.logits(heads(hidden, 1))[0])
    first = []
    for _ in range(n):
        if speculate == "draft":
            step = speculative_step(model, drafter, cache, y, 1, sampler, rng)
            rewind(drafter.cache, step.accepted + 1)
        else:
            step, _ = mtp.mtp_step(model, heads, cache, y, hidden, 1, sampler, rng)
        rewind(cache, step.accepted + 1)
        first.append(step.tokens[0])
    return np.array(first), np.array(p, dtype=np.float64), np.array(q, dtype=np.float64)


@pytest.mark.parametrize("kv, speculate", [("sym4", "draft")])   # MTP's sampled rule: tests/test_mtp.py
def test_sampled_speculation_keeps_the_targets_distribution_under_a_quantized_cache(models, kv, speculate):
    # three independent streams of 100 steps pooled: a single stream's uniforms also drive the acceptance, and at
    # significance 0.001 one stream in a thousand fails a correct rule (seed 0 of 200 steps did here: p 0.0006,
    # while seeds 1 to 5 gave 0.14 to 0.96)
    runs = [first_tokens_of_steps(models, kv, speculate, 100, seed) for seed in range(3)]
    first, p, q = np.concatenate([r[0] for r in runs]), runs[0][1], runs[0][2]
    assert all(np.array_equal(r[1], p) for r in runs)   # one state, one target distribution
    assert chi2_pvalue(first, p) > SIGNIFICANCE
    assert np.abs(p - q).sum() > 0.2                   # the proposer disagrees: the rule does real work
    assert chi2_pvalue(first, q) < SIGNIFICANCE        # and the test can tell the target from the proposer


def test_the_quantized_cache_changes_the_target():
    """The distribution the sampled test checks is the cache's own: a 4-bit cache moves it off the float one."""
    model, tok = load(MODEL, mx.float32)
    ids = mx.array([tok.encode(PROMPT, bos=True)])
    logits = {kv: prefill(model, ids, model.make_cache(ids.shape[1], scheme=kv)) for kv in ("float", "sym4")}
    assert 1e-3 < float(mx.abs(logits["float"] - logits["sym4"]).max()) < 5


# ---- refusals ------------------------------------------------------------------------------------

@pytest.mark.parametrize("switches, words", [
    ({"kv": "int3"}, "unknown KV-cache scheme 'int3'"),
    ({"kv": "sym8", "fused": True}, "no fused attention"),
    ({"kv": "sym8", "compiled": True}, "float cache's buffers"),
    ({"compiled": True, "speculate": "draft"}, "exclusive"),
    ({"kv": "kivi4", "speculate": "mtp"}, "cannot be rewound exactly"),
    ({"speculate": "medusa"}, "speculate must be one of"),
    ({"speculate": "draft", "gamma": 0}, "gamma must be at least 1"),
    ({"kv": "sym4-g32"}, "take no group"),
])
def test_impossible_switches_are_refused_before_loading(switches, words):
    with pytest.raises(ValueError, match=words):
        Techniques(**switches)


def test_what_composes():
    for kv in ("float", "chunked", "sym8", "affine4", "affine8-g128", "outlier4", "kivi2-g64-w128"):
        Techniques(kv=kv)                                # every scheme decodes plainly
    Techniques(kv="affine4-g32", fused=True, speculate="draft", gamma=6)
    Techniques(kv="float", compiled=True, pipeline=False)
    assert type(kvquant.make_caches("affine4", 1, 1, 2, 64, 8)[0]) is kvquant.AffineKVCache
    c = kvquant.make_caches("kivi2-g64-w128", 1, 1, 2, 64, 256)[0]
    assert (c.bits, c.group, c.window, c.rewinds_exactly) == (2, 64, 128, False)


@pytest.fixture(scope="module")
def strangers(tmp_path_factory):
    """A draft with another vocabulary, and MTP heads trained on another model."""
    tmp = tmp_path_factory.mktemp("compose")
    heads, vocab = tmp / "other-mtp.gguf", tmp / "other-vocab.gguf"
    mtp.save_heads(mtp.MTPHeads(384, 2, "another-model"), heads)
    with gguf.read(DRAFT) as f:                          # the shipped draft, one token renamed
        meta, tensors = dict(f.metadata), {name: f.array(name) for name in f.tensors}
    meta["tokenizer.ggml.tokens"] = [*meta["tokenizer.ggml.tokens"][:100], "<renamed>",
                                     *meta["tokenizer.ggml.tokens"][101:]]
    gguf.write(vocab, meta, tensors)
    return {"vocab": vocab, "heads": heads, "none": write_random_llama(tmp / "random.gguf")}


def test_strangers_are_refused_from_metadata(strangers, models):
    with gguf.read(MODEL) as f:
        meta = f.metadata
        with pytest.raises(ValueError, match=r"another vocabulary \(4096 tokens, the model's 4096, same count"):
            check_files(meta, MODEL, draft=strangers["vocab"])
        with pytest.raises(ValueError, match="has no vocabulary"):
            check_files(meta, MODEL, draft=strangers["none"])
        with pytest.raises(ValueError, match="trained on 'another-model'"):
            check_files(meta, MODEL, heads=strangers["heads"])
        check_files(meta, MODEL, DRAFT, HEADS)
    model, draft, heads, tok = models
    with pytest.raises(ValueError, match="needs as many MTP heads"):
        generate(model, tok, "x", 4, techniques=Techniques(speculate="mtp", gamma=heads.k + 1), proposer=heads)
    with pytest.raises(ValueError, match="needs a Model proposer"):
        generate(model, tok, "x", 4, techniques=Techniques(speculate="draft"), proposer=heads)


@pytest.mark.parametrize("args, words", [
    (["--draft", str(DRAFT), "--mtp", str(HEADS)], "choose one"),
    (["--kv", "sym8", "--compile"], "--compile cannot decode with --kv sym8"),
    (["--draft", str(DRAFT), "--compile"], "exclusive"),
    (["--kv", "kivi4", "--draft", str(DRAFT)], "cannot be rewound exactly"),
    (["--kv", "sym8", "--kv-fused"], "no fused attention"),
    (["--kv", "paged"], "unknown KV-cache scheme"),
    (["--draft", "{vocab}"], "another vocabulary"),
    (["--mtp", "{heads}"], "trained on 'another-model'"),
    (["--mtp", str(HEADS), "--gamma", "9"], "needs as many MTP heads"),
    (["--draft", "nope.gguf"], "no such file"),
    (["--draft", str(DRAFT), "--max-tokens", "508"], "gamma (4) exceeds"),
    (["--prefill-chunk", "0"], "prefill chunk must be at least 1 position, got 0"),
    (["--prompt-file", "missing.txt"], "--prompt-file missing.txt: no such file"),
], ids=["two-proposers", "compile-quantized", "compile-draft", "kivi-draft", "fused-sym", "unknown-scheme",
        "draft-vocabulary", "heads-other-model", "gamma-past-heads", "draft-missing", "gamma-past-context",
        "chunk-0", "prompt-file-missing"])
def test_cli_refusals_are_one_line_and_exit_2(args, words, strangers, capsys):
    prompt = [] if "--prompt-file" in args else ["--prompt", "def "]
    argv = ["generate", "--model", str(MODEL), *prompt, *(a.format(**strangers) for a in args)]
    assert main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and words in err[0], err


def test_heads_file_names_its_model():
    with gguf.read(HEADS) as f, gguf.read(MODEL) as g:
        assert f.metadata["mtp.base_model"] == g.metadata["general.name"]


def test_streamed_text_costs_one_piece_per_token_however_long_the_answer(models, monkeypatch):
    """The text loop decodes each token's bytes once (Tokenizer.stream), never the whole answer again: the
    work per token does not grow with the answer's length. The pieces streamed are the answer's text."""
    calls, pieces = [], []
    piece_bytes = Tokenizer.piece_bytes
    monkeypatch.setattr(Tokenizer, "piece_bytes", lambda self, i: calls.append(i) or piece_bytes(self, i))
    monkeypatch.setattr(Tokenizer, "decode", lambda self, ids: pytest.fail("follow re-decoded the whole answer"))
    model, _, _, tok = models
    g = generate(model, tok, PROMPT, 40, stop_at_eos=False, on_text=pieces.append)
    assert calls == g.tokens and "".join(pieces) == g.text and g.text
