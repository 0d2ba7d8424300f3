"""Generation and the KV cache: sampling rules, pipelining, streaming, cache contract."""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest

from ref_impl.engine.checkpoint import load, load_model
from ref_impl.engine.compose import generate
from ref_impl.engine.generate import Sampler, compiled_decoder, generate_step, prefill
from ref_impl.engine.kvcache import ConcatKVCache, KVCache, StepCache
from ref_impl.engine.model import Model
from ref_impl.formats import gguf


@pytest.fixture(scope="module")
def shipped(shipped_model):
    return load(shipped_model, mx.float32)


@pytest.fixture(scope="module")
def random_model(random_llama):
    with gguf.read(random_llama) as f:
        return load_model(f, mx.float32)


def take(model, prompt, sampler, n, pipeline):
    cache = model.make_cache(len(prompt) + n)
    return [t for _, t in zip(range(n), generate_step(model, prompt, sampler, cache, pipeline))]


@pytest.mark.parametrize("settings", [{}, {"temperature": 0.9, "seed": 3},
                                      {"temperature": 1.0, "top_k": 20, "seed": 4},
                                      {"temperature": 0.8, "top_p": 0.9, "seed": 5}])
def test_pipelined_equals_synchronous(shipped, settings):
    model, tok = shipped
    prompt = tok.encode("import os\n\ndef ", bos=True)
    sync = take(model, prompt, Sampler(**settings), 32, pipeline=False)
    piped = take(model, prompt, Sampler(**settings), 32, pipeline=True)
    assert sync == piped


def test_compiled_decode_equals_uncompiled(shipped, random_model):
    # the same tokens and cache contents; the compiled step writes the same buffers decode_one_token would
    model, tok = shipped
    prompt = tok.encode("import os\n\ndef ", bos=True)
    for m, p in ((model, prompt), (random_model, [1, 5, 9])):
        caches = [m.make_cache(len(p) + 24) for _ in range(2)]
        runs = [[t for _, t in zip(range(24), generate_step(m, p, Sampler(), c, True, compiled=flag))]
                for c, flag in zip(caches, (False, True))]
        assert runs[0] == runs[1]
        assert caches[1][0].offset == caches[0][0].offset
        for a, b in zip(caches[0], caches[1]):
            np.testing.assert_allclose(np.array(b.keys[:, :, :a.offset]), np.array(a.state[0]), atol=1e-5)


def test_compiled_decoder_checks_its_cache(random_model):
    with pytest.raises(ValueError, match="pre-allocated float KVCache"):
        compiled_decoder(random_model, [ConcatKVCache(1, 2, 8, 4)])
    cache = random_model.make_cache(3)
    step = compiled_decoder(random_model, cache)
    for _ in range(3):
        mx.eval(step(mx.array([1])))
    with pytest.raises(ValueError, match="KV cache full"):
        step(mx.array([1]))
    one = StepCache(mx.zeros((1, 2, 4, 8)), mx.zeros((1, 2, 4, 8)), mx.array(0))
    with pytest.raises(ValueError, match="one token"):
        one.attend(mx.zeros((1, 4, 2, 8)), mx.zeros((1, 2, 2, 8)), mx.zeros((1, 2, 2, 8)), 1.0)


def test_greedy_is_argmax_of_full_forward(random_model):
    """Each greedy token is the argmax of a fresh, uncached forward over everything before it."""
    seq = [1, 5, 9]
    tokens = take(random_model, seq, Sampler(), 8, pipeline=True)
    for t in tokens:
        logits = random_model(mx.array([seq]))[0, -1]
        assert t == int(mx.argmax(logits).item())
        seq.append(t)


def test_top_k_1_and_tiny_top_p_are_greedy(random_model):
    greedy = take(random_model, [1, 2, 3], Sampler(), 12, True)
    assert take(random_model, [1, 2, 3], Sampler(temperature=1.5, top_k=1, seed=9), 12, True) == greedy
    assert take(random_model, [1, 2, 3], Sampler(temperature=1.5, top_p=1e-6, seed=9), 12, True) == greedy


def test_same_seed_same_tokens_other_seed_other_tokens(random_model):
    runs = [take(random_model, [1, 2, 3], Sampler(temperature=1.0, seed=s), 24, True) for s in (7, 7, 8)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def empirical(sampler: Sampler, logits: np.ndarray, n: int) -> np.ndarray:
    batch = mx.array(np.tile(logits, (n, 1)))     # n independent rows, one draw each
    counts = np.bincount(np.array(sampler(batch)), minlength=len(logits))
    return counts / n


@pytest.mark.parametrize("top_k, top_p, allowed", [
    (0, 1.0, [0, 1, 2, 3, 4]),
    (3, 1.0, [0, 1, 2]),
    (0, 0.75, [0, 1, 2]),     # mass before token 2 is 0.4+0.25 = 0.65 < 0.75: kept; before 3 it is 0.8
    (2, 0.75, [0, 1]),
])
def test_sampler_matches_the_truncated_distribution(top_k, top_p, allowed):
    probs = np.array([0.4, 0.25, 0.15, 0.12, 0.08])
    sampler = Sampler(temperature=1.0, top_k=top_k, top_p=top_p, seed=0)
    freq = empirical(sampler, np.log(probs), 40_000)
    expect = np.zeros_like(probs)
    expect[allowed] = probs[allowed] / probs[allowed].sum()
    assert set(np.flatnonzero(freq)) == set(allowed)
    # 40k draws: a standard error below 0.0025 per token; 5 sigma
    assert np.abs(freq - expect).max() < 0.0125


def test_temperature_sharpens(random_model):
    probs = np.array([0.5, 0.3, 0.2])
    hot = empirical(Sampler(temperature=2.0, seed=1), np.log(probs), 20_000)
    cold = empirical(Sampler(temperature=0.5, seed=1), np.log(probs), 20_000)
    assert cold[0] > probs[0] + 0.1 and hot[0] < probs[0] - 0.05


@pytest.mark.parametrize("bad", [{"temperature": -1}, {"top_k": -2}, {"top_p": 0.0}, {"top_p": 1.5}])
def test_sampler_rejects_bad_settings(bad):
    with pytest.raises(ValueError, match="invalid sampling settings"):
        Sampler(**bad)


def test_generate_streams_the_final_text_and_times_every_token(shipped):
    model, tok = shipped
    pieces = []
    g = generate(model, tok, "class Foo:\n    def ", max_tokens=40, on_text=pieces.append, stop_at_eos=False)
    assert "".join(pieces) == g.text == tok.decode(g.tokens)
    assert len(g.tokens) == len(g.token_times) == 40
    assert g.ttft > 0 and np.all(g.inter_token_latencies >= 0) and g.decode_tokens_per_s > 0


def test_generate_stops_at_eos(shipped):
    model, tok = shipped
    g = generate(model, tok, "x = 1\n", max_tokens=8, stop_at_eos=False)
    # pretend the 4th greedy token is end-of-sequence: generation must stop before it
    stopper = copy.copy(tok)
    stopper.eos_id = g.tokens[3]
    assert g.tokens[3] not in g.tokens[:3]
    stopped = generate(model, stopper, "x = 1\n", max_tokens=8, stop_at_eos=True)
    assert stopped.tokens == g.tokens[:3] and len(stopped.token_times) == 3


def test_generate_rejects_too_long_requests(shipped):
    model, tok = shipped
    with pytest.raises(ValueError, match="exceeds the model's context length"):
        generate(model, tok, "def ", max_tokens=model.args.max_position_embeddings)
    with pytest.raises(ValueError, match="prompt is empty"):
        next(generate_step(model, [], Sampler(), model.make_cache(4)))


# --- the KV cache contract -------------------------------------------------------------

def kv(L, value=1.0, B=1, H=2, D=4):
    return mx.full((B, H, L, D), value), mx.full((B, H, L, D), -value)


def test_cache_returns_the_whole_history():
    c = KVCache(1, 2, 4, max_size=8)
    c.update_and_fetch(*kv(3, 1.0))
    k, v = c.update_and_fetch(*kv(2, 2.0))
    assert c.offset == 5 and k.shape == (1, 2, 5, 4)
    assert np.array_equal(np.array(k[0, 0, :, 0]), [1, 1, 1, 2, 2])
    assert np.array_equal(np.array(v), -np.array(k))


@pytest.mark.parametrize("stored, n, left", [(5, 0, 5), (5, 2, 3), (5, 5, 0), (5, 9, 0)])
def test_cache_trim(stored, n, left):
    c = KVCache(1, 2, 4, max_size=8)
    c.update_and_fetch(*kv(stored))
    assert c.trim(n) == stored - left
    assert c.offset == left and c.state[0].shape == (1, 2, left, 4)
    k, _ = c.update_and_fetch(*kv(1, 7.0))   # the next write lands right after what is left
    assert float(k[0, 0, left, 0]) == 7.0


def test_cache_errors_and_size():
    c = KVCache(1, 2, 4, max_size=4, dtype=mx.float16)
    with pytest.raises(ValueError, match="KV cache full: 5 positions needed, 4 allocated"):
        c.update_and_fetch(*kv(5))
    with pytest.raises(ValueError, match="expects keys/values of shape"):
        c.update_and_fetch(*kv(1, H=3))
    with pytest.raises(ValueError, match="must be positive"):
        KVCache(1, 0, 4, 4)
    assert c.nbytes == c.keys.nbytes + c.values.nbytes == 2 * 1 * 2 * 4 * 4 * 2


def test_chunked_prefill_fills_the_cache_as_one_pass_does_and_reads_the_head_once(shipped, monkeypatch):
    """A prompt run in chunks of 7 leaves the cache and the last logits of one whole pass (float cache), and
    greedy decoding after it is the same; the LM head reads one position, not the prompt's."""
    model, _ = shipped
    prompt = mx.array([list(range(1, 60))])
    whole, chunked = model.make_cache(), model.make_cache()
    one = model(prompt, whole)[:, -1, :]
    heads = []
    logits = Model.logits
    monkeypatch.setattr(Model, "logits", lambda self, h: heads.append(h.shape) or logits(self, h))
    seven = prefill(model, prompt, chunked, chunk=7)
    assert heads == [(1, model.args.hidden_size)]                 # the head on the last position only
    assert mx.allclose(one, seven, atol=1e-4).item() and chunked[0].offset == whole[0].offset == 59
    for a, b in zip(whole, chunked):
        assert mx.allclose(a.keys[..., :59, :], b.keys[..., :59, :], atol=1e-5).item()
    with pytest.raises(ValueError, match="at least 1 position"):
        prefill(model, prompt, model.make_cache(), chunk=0)
