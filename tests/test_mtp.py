"""Multi-token prediction: greedy self-speculative decoding emits the model's greedy tokens, each step's
drafts come from the last accepted position, the cache ends as plain decoding leaves it, sampled output
keeps the model's distribution, the shipped heads beat chance on held-out text, and heads files
round-trip and fail clearly."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from ref_impl import MODELS_DIR
from ref_impl.engine import mtp, speculative
from ref_impl.engine.checkpoint import load
from ref_impl.engine.generate import Sampler
from ref_impl.engine.model import Model, ModelArgs
from ref_impl.engine.speculative import acceptance_rate
from ref_impl.formats import gguf
from ref_impl.training.corpus import heldout_stream
from tests.test_speculative import (
    SIGNIFICANCE,
    accept_resampling_from_p,
    assert_same_cache,
    chi2_pvalue,
    greedy_tokens,
    plain_cache,
)

HEADS = MODELS_DIR / "stdlib-10m-mtp.gguf"


@pytest.fixture(scope="module")
def shipped():
    paths = [MODELS_DIR / "stdlib-10m.gguf", HEADS]
    if not all(p.is_file() for p in paths):
        pytest.skip("the shipped model or its MTP heads are missing")
    model, tok = load(paths[0], mx.float32)
    return model, mtp.load_heads(HEADS, model, mx.float32), tok


def random_heads(hidden_size: int, k: int, scale: float, seed: int = 0) -> mtp.MTPHeads:
    """Heads with random (not zero) blocks, so their guesses differ from the model's."""
    heads = mtp.MTPHeads(hidden_size, k, "random")
    rng = np.random.default_rng(seed)
    heads.load_weights([(name, mx.array(scale * rng.standard_normal(w.shape).astype(np.float32)))
                        for name, w in nn.utils.tree_flatten(heads.parameters())])
    return heads


def tiny_model(vocab: int = 8, seed: int = 0) -> Model:
    """A random 1-layer model over a small vocabulary, its embedding scaled so no token is rare."""
    mx.random.seed(seed)
    model = Model(ModelArgs(vocab_size=vocab, hidden_size=32, num_hidden_layers=1, intermediate_size=64,
                            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32))
    model.embed_tokens.weight = 0.25 * model.embed_tokens.weight
    mx.eval(model.parameters())
    return model


# --- greedy decoding on the shipped model -------------------------------------------------------

@pytest.mark.parametrize("gamma", [1, 4])
def test_greedy_mtp_emits_exactly_the_greedy_tokens(shipped, gamma):
    model, heads, tok = shipped
    prompt = tok.encode("import os\n\ndef main(", bos=True)
    tokens, steps = mtp.mtp_decode(model, heads, prompt, 48, gamma)
    assert tokens == greedy_tokens(model, prompt, 48)
    assert all(s.proposed == gamma for s in steps[1:]) and steps[0].proposed == 0
    assert 0 < acceptance_rate(steps) < 1
    assert len(steps) < 48                      # fewer model forwards than tokens


def test_drafts_come_from_the_hidden_state_of_the_last_accepted_position(shipped):
    """Rebuild each greedy step offline from one forward over the whole output: the step whose first
    token lands at index s drafts from the hidden state at s - 2 (the one that predicted the token
    before), so it accepts as many drafts as lead the greedy sequence from s."""
    model, heads, tok = shipped
    prompt, gamma = tok.encode("class Config:\n    def __init__(self", bos=True), 3
    tokens, steps = mtp.mtp_decode(model, heads, prompt, 40, gamma)
    sequence = prompt + tokens
    hidden = model.hidden(mx.array([sequence]))[0]                           # (len, d)
    guesses = np.array(mx.argmax(model.logits(heads(hidden, gamma)), axis=-1))   # (len, γ)
    s = len(prompt) + 1
    for step in steps[1:]:
        if s + gamma > len(sequence):
            break
        match = guesses[s - 2] == np.array(sequence[s:s + gamma])
        assert step.accepted == (gamma if match.all() else int(np.argmin(match)))
        s += len(step.tokens)


def test_cache_after_each_step_equals_plain_decoding_of_the_emitted_prefix(shipped):
    model, heads, tok = shipped
    prompt, gamma = tok.encode("for i in range(", bos=True), 3
    cache = model.make_cache(len(prompt) + 32 + gamma)
    emitted, accepted = [], []
    for step in mtp.mtp_generate(model, heads, prompt, Sampler(), cache, gamma):
        emitted += step.tokens
        accepted.append(step.accepted)
        held = prompt + emitted[:-1]             # the cache holds all but the last emitted token
        assert cache[0].offset == len(held)
        assert_same_cache(cache, plain_cache(model, held))
        if len(emitted) >= 24:
            break
    assert emitted == greedy_tokens(model, prompt, len(emitted))
    assert min(accepted[1:]) < gamma and max(accepted[1:]) > 0     # rejections and acceptances both rolled back


# --- sampled decoding keeps the model's distribution ---------------------------------------------

def first_tokens(model, heads, prompt, n_runs, gamma):
    """The first two emitted tokens of n_runs seeded sampled runs, (n_runs, 2)."""
    return np.array([mtp.mtp_decode(model, heads, prompt, 2, gamma, Sampler(temperature=1.0, seed=i))[0]
                     for i in range(n_runs)])


def exact_first_two(model, prompt):
    """The model's law of the first two sampled tokens, P(x0, x1), (V, V), by enumeration."""
    V = model.args.vocab_size
    p0 = np.array(mx.softmax(model(mx.array([prompt]))[0, -1]), dtype=np.float64)
    batch = mx.array([prompt + [x0] for x0 in range(V)])
    p1 = np.array(mx.softmax(model(batch)[:, -1], axis=-1), dtype=np.float64)   # (V, V): row x0
    joint = p0[:, None] * p1
    return joint / joint.sum()


@pytest.mark.parametrize("rule, correct", [(None, True), (accept_resampling_from_p, False)])
def test_sampled_mtp_first_tokens_are_distributed_as_the_model(monkeypatch, rule, correct):
    """The pair (x0, x1): x0 is the prefill's draw, x1 the first verified position (an accepted draft
    or a residual draw). Heads with random blocks make q far from p, so the residual matters; the
    same test fails when the rejection rule resamples from p instead of the residual."""
    model, prompt = tiny_model(), [1, 2, 3]
    heads = random_heads(model.args.hidden_size, 2, scale=2.0)    # rejects about 40% of first drafts
    if rule is not None:
        monkeypatch.setattr(speculative, "accept", rule)       # the rule verify() applies
    joint = exact_first_two(model, prompt)
    samples = first_tokens(model, heads, prompt, 1500, gamma=2)
    V = model.args.vocab_size
    p_value = chi2_pvalue(samples[:, 0] * V + samples[:, 1], joint.ravel())
    print(f"{'correct' if rule is None else rule.__name__}: p = {p_value:.3g}")
    assert (p_value > SIGNIFICANCE) == correct


# --- the shipped heads have learned something -----------------------------------------------------

def test_shipped_heads_beat_chance_on_heldout_text(shipped):
    """Top-1 accuracy of head j on token t+1+j over held-out windows, against two baselines computed
    here: always the most frequent token, and untrained (zero) heads, which repeat the model's guess
    at t+1."""
    model, heads, tok = shipped
    stream, _ = heldout_stream(tok)
    L, k = 256, heads.k
    starts = np.linspace(0, len(stream) - L - k - 1, 10).astype(int)
    windows = stream[starts[:, None] + np.arange(L + k + 1)]
    hidden = model.hidden(mx.array(windows[:, :L]))                            # (n, L, d)

    def accuracy(h_heads):
        guess = np.array(mx.argmax(model.logits(h_heads(hidden)), axis=-1))    # (n, L, k)
        return [float((guess[..., j - 1] == windows[:, 1 + j:1 + j + L]).mean()) for j in range(1, k + 1)]

    trained, untrained = accuracy(heads), accuracy(mtp.MTPHeads(model.args.hidden_size, k))
    frequent = np.bincount(windows.ravel()).max() / windows.size
    print(f"held-out top-1 per head: trained {np.round(trained, 3)}, untrained {np.round(untrained, 3)}, "
          f"most frequent token {frequent:.3f}")
    for j in range(k):
        assert trained[j] > max(untrained[j], frequent) + 0.01
    assert trained[0] > max(untrained[0], frequent) + 0.12


# --- the heads file ---------------------------------------------------------------------------------

def test_heads_round_trip_through_gguf(tmp_path):
    heads = random_heads(48, 3, scale=0.1, seed=5)
    heads.base_model = "some-model"
    mtp.save_heads(heads, tmp_path / "h.gguf")
    back = mtp.load_heads(tmp_path / "h.gguf", dtype=mx.float32)
    assert (back.k, back.hidden_size, back.base_model) == (3, 48, "some-model")
    for (name, a), (name_b, b) in zip(nn.utils.tree_flatten(heads.parameters()),
                                      nn.utils.tree_flatten(back.parameters())):
        assert name == name_b
        np.testing.assert_array_equal(np.array(a), np.array(b))
    with gguf.read(tmp_path / "h.gguf") as f:
        assert f.metadata["mtp.head_architecture"] == mtp.HEAD_ARCHITECTURE
        assert sorted(f.tensors) == sorted(f"mtp.{j}.{leaf}" for j in (1, 2, 3) for leaf in ("weight", "bias"))


def test_heads_for_another_model_width_are_refused(tmp_path):
    model = tiny_model()                                        # width 32
    mtp.save_heads(mtp.MTPHeads(48, 2, "wider"), tmp_path / "h.gguf")
    with pytest.raises(ValueError, match="width 48.*wider.*32"):
        mtp.load_heads(tmp_path / "h.gguf", model)
    heads = mtp.load_heads(tmp_path / "h.gguf")
    with pytest.raises(ValueError, match="width 48"):
        mtp.mtp_decode(model, heads, [1, 2], 4, gamma=2)


def test_bad_heads_files_name_the_problem(tmp_path):
    good = tmp_path / "good.gguf"
    mtp.save_heads(mtp.MTPHeads(16, 2), good)
    with gguf.read(good) as f:
        meta, tensors = dict(f.metadata), {n: f.array(n).copy() for n in f.tensors}
    gguf.write(tmp_path / "missing.gguf", meta, {n: t for n, t in tensors.items() if n != "mtp.2.bias"})
    with pytest.raises(ValueError, match=r"lacks tensor\(s\) mtp\.2\.bias"):
        mtp.load_heads(tmp_path / "missing.gguf")
    gguf.write(tmp_path / "shape.gguf", meta, {**tensors, "mtp.1.weight": np.zeros((16, 8), np.float32)})
    with pytest.raises(ValueError, match=r"mtp\.1\.weight.*\(16, 8\)"):
        mtp.load_heads(tmp_path / "shape.gguf")
    gguf.write(tmp_path / "llama.gguf", {**meta, "general.architecture": "llama"}, tensors)
    with pytest.raises(ValueError, match="not an MTP heads file"):
        mtp.load_heads(tmp_path / "llama.gguf")
    with pytest.raises(ValueError, match="gamma 3 needs as many MTP heads"):
        mtp.mtp_decode(tiny_model(), mtp.MTPHeads(32, 2), [1, 2], 4, gamma=3)
