"""Build it yourself, steps 6 and 7 (book/build-it/06-quantized-kv-cache, 07-speculative-acceptance):
`pytest tests/test_exercises_build_extras.py -k build_step_6` (or `build_step_7`)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from ref_impl import exercises as ex

# Step 6: per-token int8, written here in numpy, independently of the engine ------------------------

def quantize_numpy(x, qmax=127, rounding=np.rint, code_dtype=np.int8, eps=0.0, axis=-1, scale_dtype=None):
    """Symmetric codes with one scale per row of the last axis; the keywords make the usual slips."""
    xf = np.array(x.astype(mx.float32))
    dtype = scale_dtype or np.dtype(str(x.dtype).split(".")[-1])
    scale = (np.abs(xf).max(axis=axis, keepdims=True) / np.float32(qmax) + np.float32(eps)).astype(dtype)
    safe = np.where(scale == 0, 1, scale).astype(np.float32)
    codes = np.clip(rounding(xf / safe), -127, 127).astype(code_dtype)
    return mx.array(codes), mx.array(scale)


def quantize_in_float16(x):
    """Everything in x's dtype: a float16 quotient is rounded before the codes are."""
    scale = mx.abs(x).max(axis=-1, keepdims=True) / 127
    return mx.round(x / mx.where(scale == 0, 1, scale)).astype(mx.int8), scale


def test_build_step_6_quantize_accepts_the_rule_in_numpy_and_in_mlx():
    assert ex.check_quantize_sym8(quantize_numpy)
    r = ex.check_quantize_sym8(lambda x: tuple(np.array(a) for a in quantize_numpy(x)))   # numpy arrays out
    assert r and "bit for bit" in r.message


def not_written(*args):
    raise NotImplementedError("Step 6: write it")


@pytest.mark.parametrize("wrong, hint", [
    (not_written, "not written yet"),
    (lambda x: quantize_numpy(x, code_dtype=np.uint8), "store them as int8"),
    (lambda x: quantize_numpy(x, code_dtype=np.int32), "expected int8"),
    (lambda x: quantize_numpy(x, qmax=128), "not 128"),
    (lambda x: quantize_numpy(x, axis=None), "whole tensor"),
    (lambda x: quantize_numpy(x, axis=2), "one scale per channel"),
    (lambda x: quantize_numpy(x, eps=1e-8), "all-zero token"),
    (lambda x: quantize_numpy(x, rounding=np.trunc), "don't truncate"),
    (lambda x: quantize_numpy(x, rounding=np.floor), "not down"),
    (lambda x: quantize_numpy(x, scale_dtype=np.float32), "store them in x's dtype"),
    (quantize_in_float16, "off by one: divide in float32"),
    (lambda x: quantize_numpy(x)[0], "return a pair (codes, scales)"),
    (lambda x: (quantize_numpy(x)[0], mx.abs(x).max(axis=-1) / 127), "keepdims=True"),
])
def test_build_step_6_quantize_rejects_typical_mistakes_with_their_hint(wrong, hint):
    r = ex.check_quantize_sym8(wrong)
    assert not r and hint in r.message, r.message


def test_build_step_6_quantize_crashes_and_garbage():
    assert "raised ZeroDivisionError" in ex.check_quantize_sym8(lambda x: 1 / 0).message
    assert "write a function" in ex.check_quantize_sym8(None).message


def dequantize_numpy(codes, scales):
    return mx.array((np.array(codes).astype(np.float32) * np.array(scales).astype(np.float32))
                    .astype(np.dtype(str(scales.dtype).split(".")[-1])))


def test_build_step_6_dequantize_accepts_code_times_scale():
    assert ex.check_dequantize_sym8(dequantize_numpy)
    assert ex.check_dequantize_sym8(lambda c, s: c.astype(s.dtype) * s)


@pytest.mark.parametrize("wrong, hint", [
    (not_written, "not written yet"),
    (lambda c, s: c.astype(s.dtype) / s, "don't divide"),
    (lambda c, s: c.astype(s.dtype) * s * 127, "already includes the 1/127"),
    (lambda c, s: c.astype(s.dtype) * s / 127, "already includes the 1/127"),
    (lambda c, s: c.astype(mx.float32) * s.astype(mx.float32), "in the scales' dtype"),
    (lambda c, s: c.astype(s.dtype) * s.max(), "value = code × scale, per token"),
    (lambda c, s: (c.astype(s.dtype) * s)[..., :1], "one value per code"),
    (lambda c, s: "values", "expected an array of values"),
])
def test_build_step_6_dequantize_rejects_typical_mistakes_with_their_hint(wrong, hint):
    r = ex.check_dequantize_sym8(wrong)
    assert not r and hint in r.message, r.message


class ChunkCache:
    """Right: codes and scales kept as lists of chunks (max_size unused), the history dequantized on every call."""

    attends = "dense"

    def __init__(self, batch, n_kv_heads, head_dim, max_size, dtype):
        self.offset, self.chunks = 0, []

    def update_and_fetch(self, k, v):
        self.chunks.append((quantize_numpy(k), quantize_numpy(v)))
        self.offset += k.shape[2]
        return tuple(mx.concatenate([dequantize_numpy(*c[i]) for c in self.chunks], axis=2) for i in (0, 1))


class FloatCopy(ChunkCache):
    def update_and_fetch(self, k, v):
        self.history = super().update_and_fetch(k, v)       # a float copy kept besides the codes
        return self.history


class NewOnly(ChunkCache):
    def update_and_fetch(self, k, v):
        keys, values = super().update_and_fetch(k, v)
        return keys[:, :, -k.shape[2]:], values[:, :, -k.shape[2]:]


class NoQuantization(ChunkCache):
    def update_and_fetch(self, k, v):
        super().update_and_fetch(k, v)
        self.kv = [k, v] if self.offset == k.shape[2] else [mx.concatenate([a, b], 2) for a, b in zip(self.kv, (k, v))]
        return tuple(self.kv)


class Swapped(ChunkCache):
    def update_and_fetch(self, k, v):
        return super().update_and_fetch(k, v)[::-1]


class StuckOffset(ChunkCache):
    def update_and_fetch(self, k, v):
        out = super().update_and_fetch(k, v)
        self.offset = 0
        return out


class NoAttends(ChunkCache):
    attends = None


class Float32Out(ChunkCache):
    def update_and_fetch(self, k, v):
        return tuple(a.astype(mx.float32) for a in super().update_and_fetch(k, v))


class SlotCache:
    """Right: buffers of codes and scales allocated once, as step 4's Cache and the engine's."""

    attends = "dense"

    def __init__(self, batch, n_kv_heads, head_dim, max_size, dtype):
        self.offset = 0
        self.codes = [mx.zeros((batch, n_kv_heads, max_size, head_dim), dtype=mx.int8) for _ in "kv"]
        self.scales = [mx.zeros((batch, n_kv_heads, max_size, 1), dtype=dtype) for _ in "kv"]

    def update_and_fetch(self, k, v):
        end = self.offset + k.shape[2]
        for i, x in enumerate((k, v)):
            codes, scales = quantize_numpy(x)
            self.codes[i][:, :, self.offset:end] = codes
            self.scales[i][:, :, self.offset:end] = scales
        self.offset = end
        return tuple(c[:, :, :end].astype(s.dtype) * s[:, :, :end] for c, s in zip(self.codes, self.scales))


class NotWritten:
    def __init__(self, *args):
        raise NotImplementedError("Step 6: write Sym8Cache")


def test_build_step_6_cache_accepts_a_right_cache_and_reports_the_model():
    r = ex.check_sym8_cache(ChunkCache)
    assert r, r.message
    assert ex.check_sym8_cache(SlotCache)
    for part in ("SymmetricKVCache(bits=8)", "greedy next token agrees", "1,632 bytes per token", "engine sym8: 1,632",
                 "float32 cache: 6,144"):
        assert part in r.message, r.message


@pytest.mark.parametrize("wrong, hint", [
    (NotWritten, "not written yet"),
    (FloatCopy, "not a float copy"),
    (NewOnly, "hold only the new positions"),
    (NoQuantization, "these are the float keys, not quantized"),
    (Swapped, "keys and values swapped"),
    (StuckOffset, "offset is 0, expected 5"),
    (NoAttends, 'attends = "dense"'),
    (Float32Out, "in the dtype k and v came in"),
    (None, "write a class Sym8Cache"),
])
def test_build_step_6_cache_rejects_typical_mistakes_with_their_hint(wrong, hint):
    r = ex.check_sym8_cache(wrong)
    assert not r and hint in r.message, r.message


# Step 7: the acceptance rule, one trial at a time --------------------------------------------------

def inverse_cdf(weights, u, normalise=True):
    cdf = np.cumsum(weights)
    return int(np.searchsorted(cdf, u * (cdf[-1] if normalise else 1.0), side="right"))


def accept_loop(p, q, drafts, u, ratio="p/q", count="leading", on_reject="residual", bonus=True, u_token="last",
                normalise=True):
    """accept() trial by trial; the keywords make the usual slips."""
    lead, gamma = drafts.shape[:-1], drafts.shape[-1]
    n_out, tok_out = np.zeros(lead, np.int64), np.zeros(lead, np.int64)
    for t in np.ndindex(lead):
        P, Q, x, U = p[t], q[t], drafts[t], u[t]
        ok = [(U[i] * Q[i, x[i]] < P[i, x[i]]) if ratio == "p/q" else (U[i] * P[i, x[i]] < Q[i, x[i]])
              for i in range(gamma)]
        n = sum(ok) if count == "all" else next((i for i in range(gamma) if not ok[i]), gamma)
        uu = U[gamma] if u_token == "last" else U[min(n, gamma)]
        if n == gamma:
            w = P[gamma] if bonus else np.maximum(P[gamma - 1] - Q[gamma - 1], 0)
        else:
            w = {"residual": np.maximum(P[n] - Q[n], 0), "p": P[n], "q": Q[n], "draft": None}[on_reject]
        n_out[t] = n
        tok_out[t] = x[n] if w is None else inverse_cdf(w, uu, normalise)
    return n_out, tok_out


def test_build_step_7_accept_accepts_the_rule():
    r = ex.check_accept(accept_loop)
    assert r and "5 cases" in r.message and "follows p" in r.message, r.message


@pytest.mark.parametrize("slip, hint", [
    ({"ratio": "q/p"}, "not q(x)/p(x)"),
    ({"count": "all"}, "stop at the first rejection"),
    ({"on_reject": "p"}, "normalized, not from p"),
    ({"on_reject": "q"}, "not from q"),
    ({"on_reject": "draft"}, "the rejected draft is not emitted"),
    ({"bonus": False}, "the token is the bonus"),
    ({"u_token": "n"}, "u[γ], the last uniform"),
    ({"normalise": False}, "normalize it"),
])
def test_build_step_7_accept_rejects_typical_mistakes_with_their_hint(slip, hint):
    r = ex.check_accept(lambda p, q, d, u: accept_loop(p, q, d, u, **slip))
    assert not r and hint in r.message, r.message


def test_build_step_7_accept_stub_shapes_and_garbage():
    assert "not written yet" in ex.check_accept(not_written).message
    r = ex.check_accept(lambda p, q, d, u: (1, 2))
    assert not r and "expected (200,)" in r.message
    assert "return a pair (n, token)" in ex.check_accept(lambda p, q, d, u: None).message
    r = ex.check_accept(lambda p, q, d, u: (np.full(d.shape[:-1], 0.5), np.zeros(d.shape[:-1])))
    assert not r and "whole numbers" in r.message
    assert "write a function" in ex.check_accept(3).message


def test_build_step_7_accept_every_draft_kept_when_q_equals_p():
    """The q = p case comes first: a rule that never accepts is told that q = p accepts everything."""
    r = ex.check_accept(lambda p, q, d, u: (np.zeros(d.shape[:-1], int), np.zeros(d.shape[:-1], int)))
    assert not r and "q = p" in r.message and "every draft is accepted" in r.message, r.message
