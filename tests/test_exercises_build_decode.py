"""Build it yourself, steps 4 and 5 (book/build-it/04-kv-cache-and-decode, 05-sampling): the checkers of the KV
cache, the decode loop and the sampler: `pytest tests/test_exercises_build_decode.py -k build_step`."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from ref_impl import exercises as ex
from ref_impl.exercises import build_decode

# ---- step 4: the cache ------------------------------------------------------------------------------------------

class RightCache:
    attends = "dense"

    def __init__(self, batch, n_kv_heads, head_dim, max_size, dtype):
        self.keys = mx.zeros((batch, n_kv_heads, max_size, head_dim), dtype=dtype)
        self.values = mx.zeros((batch, n_kv_heads, max_size, head_dim), dtype=dtype)
        self.offset = 0

    def update_and_fetch(self, k, v):
        end = self.offset + k.shape[2]
        self.keys[:, :, self.offset:end, :] = k
        self.values[:, :, self.offset:end, :] = v
        self.offset = end
        return self.keys[:, :, :end, :], self.values[:, :, :end, :]


class SliceUpdateCache(RightCache):
    """Functional writes into the same fixed-size buffers (the engine's StepCache writes this way): also right."""

    def update_and_fetch(self, k, v):
        at = mx.array([self.offset])
        self.keys = mx.slice_update(self.keys, k, at, axes=(2,))
        self.values = mx.slice_update(self.values, v, at, axes=(2,))
        self.offset += k.shape[2]
        return self.keys[:, :, :self.offset], self.values[:, :, :self.offset]


class StubCache:
    attends = "dense"

    def __init__(self, batch, n_kv_heads, head_dim, max_size, dtype):
        raise NotImplementedError("Step 4: allocate the buffers")


class NewOnly(RightCache):
    def update_and_fetch(self, k, v):
        super().update_and_fetch(k, v)
        return k, v


class NoAdvance(RightCache):
    def update_and_fetch(self, k, v):
        end = self.offset + k.shape[2]
        self.keys[:, :, self.offset:end, :] = k
        self.values[:, :, self.offset:end, :] = v
        return self.keys[:, :, :end, :], self.values[:, :, :end, :]


class WholeBuffer(RightCache):
    def update_and_fetch(self, k, v):
        super().update_and_fetch(k, v)
        return self.keys, self.values


class Swapped(RightCache):
    def update_and_fetch(self, k, v):
        keys, values = super().update_and_fetch(k, v)
        return values, keys


class WritesAtZero(RightCache):
    def update_and_fetch(self, k, v):
        L = k.shape[2]
        self.keys[:, :, :L, :] = k
        self.values[:, :, :L, :] = v
        self.offset += L
        return self.keys[:, :, :self.offset, :], self.values[:, :, :self.offset, :]


class Concatenating:
    attends = "dense"

    def __init__(self, batch, n_kv_heads, head_dim, max_size, dtype):
        self.keys = self.values = None
        self.offset = 0

    def update_and_fetch(self, k, v):
        self.keys = k if self.keys is None else mx.concatenate([self.keys, k], axis=2)
        self.values = v if self.values is None else mx.concatenate([self.values, v], axis=2)
        self.offset += k.shape[2]
        return self.keys, self.values


class GrowsPastBuffer(RightCache):
    def update_and_fetch(self, k, v):
        self.keys = mx.concatenate([self.keys, k], axis=2)[:, :, k.shape[2]:]     # a copy per step
        self.values = mx.concatenate([self.values, v], axis=2)
        self.offset += k.shape[2]
        return self.keys[:, :, -self.offset:], self.values[:, :, -self.offset:]


class NoAttends(RightCache):
    attends = None


def test_build_step_4_cache_accepts_the_right_cache_both_ways_of_writing():
    for cls in (RightCache, SliceUpdateCache):
        r = ex.check_cache(cls)
        assert r and "allocated once" in r.message, r.message


@pytest.mark.parametrize("wrong, hint", [
    (StubCache, "not written yet"),
    (NewOnly, "returns only the new keys"),
    (NoAdvance, "offset not advanced"),
    (WholeBuffer, "the whole buffer, unwritten slots"),
    (Swapped, "keys and values are swapped"),
    (WritesAtZero, "position 0 of the history differs"),
    (Concatenating, "no buffer with room for max_size"),
    (GrowsPastBuffer, "instead of re-creating or growing it"),
    (NoAttends, 'attends = "dense"'),
])
def test_build_step_4_cache_rejects_typical_mistakes_with_their_hint(wrong, hint):
    r = ex.check_cache(wrong)
    assert not r and hint in r.message, r.message


# ---- step 4: the decode loop ------------------------------------------------------------------------------------

def right_decode(model, prompt, n, make_cache, sample):
    cache = make_cache()
    token = sample(model(mx.array([prompt]), cache)[0, -1])
    out = [token]
    for _ in range(n - 1):
        token = sample(model(mx.array([[token]]), cache)[0, -1])
        out.append(token)
    return out


def stub_decode(model, prompt, n, make_cache, sample):
    raise NotImplementedError("Step 4: prefill, then one token per forward")


def one_forward_too_many(model, prompt, n, make_cache, sample):
    cache, out = make_cache(), []
    logits = model(mx.array([prompt]), cache)
    for _ in range(n):
        out.append(sample(logits[0, -1]))
        logits = model(mx.array([[out[-1]]]), cache)
    return out


def prompt_token_by_token(model, prompt, n, make_cache, sample):
    cache = make_cache()
    for t in prompt:
        logits = model(mx.array([[t]]), cache)
    out = [sample(logits[0, -1])]
    while len(out) < n:
        out.append(sample(model(mx.array([[out[-1]]]), cache)[0, -1]))
    return out


def first_position(model, prompt, n, make_cache, sample):
    cache = make_cache()
    out = [sample(model(mx.array([prompt]), cache)[0, 0])]
    while len(out) < n:
        out.append(sample(model(mx.array([[out[-1]]]), cache)[0, 0]))
    return out


def whole_rows(model, prompt, n, make_cache, sample):
    cache = make_cache()
    return [sample(model(mx.array([prompt]), cache)[0])]


def one_short(model, prompt, n, make_cache, sample):
    return right_decode(model, prompt, n, make_cache, sample)[:-1]


def one_more(model, prompt, n, make_cache, sample):
    return right_decode(model, prompt, n + 1, make_cache, sample)


def with_prompt(model, prompt, n, make_cache, sample):
    return list(prompt) + right_decode(model, prompt, n, make_cache, sample)


def no_cache(model, prompt, n, make_cache, sample):
    seq = list(prompt)
    for _ in range(n):
        seq.append(sample(model(mx.array([seq]), None)[0, -1]))
    return seq[len(prompt):]


def fresh_cache_each_step(model, prompt, n, make_cache, sample):
    seq = list(prompt)
    for _ in range(n):
        seq.append(sample(model(mx.array([seq]), make_cache())[0, -1]))
    return seq[len(prompt):]


def rerun_with_one_cache(model, prompt, n, make_cache, sample):
    cache = make_cache()
    out = [sample(model(mx.array([prompt]), cache)[0, -1])]
    while len(out) < n:
        out.append(sample(model(mx.array([list(prompt[-1:]) + out[-1:]]), cache)[0, -1]))
    return out


def test_build_step_4_decode_accepts_the_right_loop_with_the_engines_cache_and_a_learners():
    r = ex.check_decode(right_decode)
    assert r and "KVCache" in r.message and "10 forwards" in r.message, r.message
    r = ex.check_decode(right_decode, RightCache)
    assert r and "your Cache" in r.message, r.message


def test_build_step_4_decode_one_forward_too_many_passes_with_a_note():
    r = ex.check_decode(one_forward_too_many)
    assert r and "note" in r.message and "11 forwards" in r.message, r.message


@pytest.mark.parametrize("wrong, hint", [
    (stub_decode, "not written yet"),
    (prompt_token_by_token, "one token at a time"),
    (first_position, "logits[0, 0]"),
    (whole_rows, "sample got logits of shape (7, 4096)"),
    (one_short, "one token short"),
    (one_more, "one token too many"),
    (with_prompt, "the prompt came back too"),
    (no_cache, "got no cache"),
    (fresh_cache_each_step, "different caches"),
    (rerun_with_one_cache, "got tokens of shape (1, 2)"),
])
def test_build_step_4_decode_rejects_typical_mistakes_with_their_hint(wrong, hint):
    r = ex.check_decode(wrong)
    assert not r and hint in r.message, r.message


def test_build_step_4_decode_token_by_token_prefill_says_the_tokens_are_right():
    r = ex.check_decode(prompt_token_by_token)
    assert "your tokens are right" in r.message and "time to first token" in r.message


def test_build_step_4_decode_with_a_broken_cache_blames_the_cache():
    r = ex.check_decode(right_decode, NewOnly)
    assert not r and "fails its own check" in r.message and "only the new keys" in r.message, r.message


# ---- step 5: sampling -------------------------------------------------------------------------------------------

def right_sample(logits, temperature, top_k, top_p, key):
    if temperature == 0:
        return int(mx.argmax(logits))
    z = logits.astype(mx.float32) / temperature
    order = mx.argsort(-z)                    # most likely first
    ranked = z[order]
    probs = mx.softmax(ranked)
    keep = mx.arange(z.size) < (top_k or z.size)
    keep = keep & (mx.cumsum(probs) - probs < top_p)
    return int(order[mx.random.categorical(mx.where(keep, ranked, -mx.inf), key=key)])


def right_sample_in_vocab_order(logits, temperature, top_k, top_p, key):
    """Another right sampler: numpy for the cut, the draw in vocabulary order (other draws, same distribution)."""
    if temperature == 0:
        return int(np.argmax(np.array(logits)))
    z = np.array(logits, dtype=np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-z, kind="stable")
    keep = np.zeros(z.size, bool)
    before = np.cumsum(p[order]) - p[order]
    keep[order[(before < top_p) & (np.arange(z.size) < (top_k or z.size))]] = True
    return int(mx.random.categorical(mx.array(np.where(keep, z, -np.inf).astype(np.float32)), key=key))


def slipped_sample(slip):
    """A sampler with one of the usual mistakes."""
    def sample(logits, temperature, top_k, top_p, key):
        if temperature == 0:
            return int(mx.argmax(logits))
        z = logits.astype(mx.float32)
        z = z * temperature if slip == "multiply" else z if slip == "no_temperature" else z / temperature
        order = mx.argsort(z) if slip == "ascending" else mx.argsort(-z)
        ranked = z[order]
        keep = mx.arange(z.size) < ((top_k + (slip == "k_plus") - (slip == "k_minus")) if top_k else z.size)
        if slip == "keep_ties" and top_k:
            keep = ranked >= ranked[top_k - 1]
        probs = mx.softmax(logits[order] if slip == "raw_mass" else ranked)
        if slip == "renorm_after_k":
            probs = mx.where(keep, probs, 0.0) / mx.where(keep, probs, 0.0).sum()
        mass = mx.cumsum(probs)
        keep = keep & ((mass <= top_p) if slip == "drop_crossing" else (mass - probs < top_p))
        if slip == "zero_fill":
            return int(order[mx.random.categorical(mx.where(keep, ranked, 0.0), key=key)])
        if slip == "probs_as_logits":
            return int(order[mx.random.categorical(mx.where(keep, mx.softmax(mx.where(keep, ranked, -mx.inf)), 0.0),
                                                   key=key)])
        if slip == "global_random":
            return int(order[mx.random.categorical(mx.where(keep, ranked, -mx.inf))])
        if slip == "fixed_key":
            return int(order[mx.random.categorical(mx.where(keep, ranked, -mx.inf), key=mx.random.key(0))])
        pick = mx.random.categorical(mx.where(keep, ranked, -mx.inf), key=key)
        return order[pick] if slip == "array" else int(order[pick])
    return sample


def vocab_order_top_p(logits, temperature, top_k, top_p, key):
    if temperature == 0:
        return int(mx.argmax(logits))
    z = logits.astype(mx.float32) / temperature
    probs = mx.softmax(z)
    keep = mx.cumsum(probs) - probs < top_p             # summed in vocabulary order: forgot to sort
    if top_k:
        keep = keep & (z >= mx.sort(z)[-top_k])
    return int(mx.random.categorical(mx.where(keep, z, -mx.inf), key=key))


def no_greedy_branch(logits, temperature, top_k, top_p, key):
    return int(mx.random.categorical(logits / temperature, key=key))     # T = 0: logits / 0


def test_build_step_5_sample_accepts_two_right_samplers():
    for fn in (right_sample, right_sample_in_vocab_order):
        r = ex.check_sample(fn)
        assert r and "7 settings" in r.message, r.message


@pytest.mark.parametrize("slip", sorted(build_decode.SLIPS.keys() - {"kept_probs_as_logits", "vocab_order"}))
def test_build_step_5_sample_names_each_slip(slip):
    r = ex.check_sample(slipped_sample(slip))
    assert not r and build_decode.SLIPS[slip] in r.message, r.message


@pytest.mark.parametrize("wrong, hint", [
    (lambda logits, temperature, top_k, top_p, key: (_ for _ in ()).throw(NotImplementedError("Step 5")),
     "not written yet"),
    (vocab_order_top_p, "summed in vocabulary order"),
    (no_greedy_branch, "temperature 0 is greedy"),
    (slipped_sample("global_random"), "from the same key"),
    (slipped_sample("fixed_key"), "every draw gave token"),
    (slipped_sample("array"), "a Python int"),
])
def test_build_step_5_sample_rejects_typical_mistakes_with_their_hint(wrong, hint):
    r = ex.check_sample(wrong)
    assert not r and hint in r.message, r.message


def test_build_step_5_greedy_with_key_none_never_touches_the_key():
    def needs_key(logits, temperature, top_k, top_p, key):
        mx.random.split(key)
        return right_sample(logits, temperature, top_k, top_p, key)
    r = ex.check_sample(needs_key)
    assert not r and "key=None" in r.message, r.message


def test_build_step_5_binomial_p_value_and_the_slip_table_agree_with_the_engine():
    assert build_decode.binomial_p_value(5, 10, 0.5) == pytest.approx(1.0)
    assert build_decode.binomial_p_value(0, 250, 0.3) < 1e-30
    assert build_decode.binomial_p_value(0, 250, 0.0) == 1.0 and build_decode.binomial_p_value(1, 250, 0.0) == 0.0
    for T, k, p, logits, _ in build_decode.SETTINGS:   # the slip-free numpy distribution is the engine's
        right = np.array(build_decode.Sampler(T, k, p).probs(mx.array(np.array(logits, np.float32))))
        mine = build_decode.slipped(logits, T, k, p, "none")
        merged = [(right[g].sum(), mine[g].sum()) for g in build_decode.buckets(logits)]
        assert np.allclose(*zip(*merged), atol=1e-5)
