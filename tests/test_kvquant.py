"""Quantized KV caches: format error bounds, attention error, greedy decoding, bytes, cache contract."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ref_impl.engine import kvquant
from ref_impl.engine.checkpoint import load
from ref_impl.engine.generate import Sampler, generate_step
from ref_impl.engine.kvcache import Cache, ChunkedKVCache, ConcatKVCache, FloatCache, KVCache

KINDS = list(kvquant.QUANTIZED)
B, H, D = 1, 2, 64


def random_kv(seed: int, L: int, scale: float, outlier_gain: float = 1.0):
    """Keys and values (B, H, L, D) exactly representable in float16; a few key channels scaled up."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((B, H, L, D)) * scale
    k[..., rng.choice(D, 3, replace=False)] *= outlier_gain
    v = rng.standard_normal((B, H, L, D)) * scale
    return k.astype(np.float16).astype(np.float32), v.astype(np.float16).astype(np.float32)


def fill(cache, k: np.ndarray, v: np.ndarray, chunks: list[int]):
    """Write k, v in consecutive chunks (a prefill, then shorter steps), as a decoder would."""
    start = 0
    for n in chunks:
        cache.update_and_fetch(mx.array(k[:, :, start:start + n]), mx.array(v[:, :, start:start + n]))
        start += n
    return [np.array(a) for a in cache.state]


# --- the error bound each format guarantees ------------------------------------------------------

def symmetric_bound(x: np.ndarray, bits: int) -> np.ndarray:
    """Per token: |err| <= scale / 2, scale = max|x| / (2^(b-1) - 1)."""
    scale = np.abs(x).max(-1, keepdims=True) / (2 ** (bits - 1) - 1)
    return np.broadcast_to(scale / 2, x.shape)


def affine_bound(x: np.ndarray, group: int, bits: int) -> np.ndarray:
    """mx.quantize per group of the last axis: |err| <= (max - min) / 2^b (see kvquant's docstring:
    MLX snaps an edge to a code, so the worst case is n/(n+1) of a step, n = 2^b - 1, not half)."""
    g = x.reshape(*x.shape[:-1], x.shape[-1] // group, group)
    return np.repeat((g.max(-1) - g.min(-1)) / 2 ** bits, group, axis=-1).reshape(x.shape)


def bounds(cache, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Elementwise error bounds for the cache's state after storing k, v (0 where stored in float)."""
    if isinstance(cache, kvquant.SymmetricKVCache):
        return symmetric_bound(k, cache.bits), symmetric_bound(v, cache.bits)
    if isinstance(cache, kvquant.AffineKVCache):
        return affine_bound(k, cache.group, cache.bits), affine_bound(v, cache.group, cache.bits)
    if isinstance(cache, kvquant.KIVIKVCache):
        n, G, R = k.shape[2], cache.group, cache.window
        qk, qv = G * (max(n - R, 0) // G), max(n - R, 0)
        bk, bv = np.zeros_like(k), np.zeros_like(v)
        blocks = k[:, :, :qk].reshape(B, H, -1, G, D).swapaxes(-1, -2)        # (B, H, blocks, D, G)
        bk[:, :, :qk] = affine_bound(blocks, G, cache.bits).swapaxes(-1, -2).reshape(B, H, qk, D)
        bv[:, :, :qv] = affine_bound(v[:, :, :qv], G, cache.bits)
        return bk, bv
    assert isinstance(cache, kvquant.OutlierKVCache)
    outlier = np.zeros((H, D), bool)
    np.put_along_axis(outlier, np.array(cache.channels), True, axis=-1)
    dense = np.where(outlier[None, :, None, :], 0, k)
    bk = np.where(outlier[None, :, None, :], 0, affine_bound(dense, cache.group, cache.bits))
    return bk, affine_bound(v, cache.group, cache.bits)


def within(got: np.ndarray, want: np.ndarray, bound: np.ndarray) -> bool:
    """|got - want| <= bound, with float32 rounding slack; bound 0 means exact."""
    slack = np.where(bound > 0, 1e-5 * bound + 1e-6 * np.abs(want).max(), 0)
    return bool(np.all(np.abs(got - want) <= bound + slack))


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2 ** 32 - 1), scale=st.floats(0.05, 50.0),
       chunks=st.lists(st.integers(1, 48), min_size=1, max_size=4))
def test_round_trip_within_the_format_bound(kind, seed, scale, chunks):
    k, v = random_kv(seed, sum(chunks), scale, outlier_gain=8.0)
    cache = kvquant.SCHEMES[kind](B, H, D, 192)
    keys, values = fill(cache, k, v, chunks)
    bk, bv = bounds(cache, k, v)
    assert keys.shape == values.shape == k.shape and cache.offset == k.shape[2]
    assert within(keys, k, bk) and within(values, v, bv)


def test_float_parts_are_exact():
    """KIVI's window and partial block, and the outlier channels, come back bit for bit."""
    k, v = random_kv(1, 100, 3.0, outlier_gain=10.0)
    kivi = kvquant.KIVIKVCache(B, H, D, 128, bits=2, group=32, window=32)
    keys, values = fill(kivi, k, v, [70, 1, 29])
    assert (kivi.qk, kivi.qv) == (64, 68)          # 32 * floor((100 - 32) / 32), 100 - 32
    assert np.array_equal(keys[:, :, 64:], k[:, :, 64:]) and np.array_equal(values[:, :, 68:], v[:, :, 68:])
    assert not np.array_equal(keys[:, :, :64], k[:, :, :64])
    out = kvquant.OutlierKVCache(B, H, D, 128)
    keys, _ = fill(out, k, v, [40, 60])
    chan = np.array(out.channels)
    assert np.array_equal(np.take_along_axis(keys, chan[None, :, None, :], -1),
                          np.take_along_axis(k, chan[None, :, None, :], -1))


def test_calibration_picks_the_largest_channels():
    k, v = random_kv(2, 50, 1.0)
    k[:, 0, :, [5, 17, 40, 63]] *= 20.0
    k[:, 1, :, [0, 1, 2, 3]] *= 20.0
    c = kvquant.OutlierKVCache(B, H, D, 64)
    c.update_and_fetch(mx.array(k), mx.array(v))     # no calibrate(): the prefill's keys pick
    assert np.array(c.channels).tolist() == [[5, 17, 40, 63], [0, 1, 2, 3]]
    c.calibrate(mx.array(k[:, ::-1].copy()))              # an explicit call sets them from its keys
    assert np.array(c.channels).tolist() == [[0, 1, 2, 3], [5, 17, 40, 63]]


# --- attention on dequantized keys/values -------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", [0, 1])
def test_attention_error_within_the_bound(kind, seed):
    """Scores move by at most delta = scale * sum_d |q_d| bk_d, so softmax weights by a factor within
    e^(+-2 delta), and |out' - out| <= max_i bv_i + (e^(2 delta) - 1) * (max_i v_i - min_i v_i) / 2."""
    n_heads, L = 4, 90
    k, v = random_kv(seed, L, 2.0, outlier_gain=6.0)
    q = np.random.default_rng(seed + 7).standard_normal((B, n_heads, 1, D)).astype(np.float32)
    cache = kvquant.SCHEMES[kind](B, H, D, 128)
    keys, values = fill(cache, k, v, [L - 2, 1, 1])
    bk, bv = bounds(cache, k, v)
    s = D ** -0.5
    exact = np.array(mx.fast.scaled_dot_product_attention(mx.array(q), mx.array(k), mx.array(v), scale=s))
    quant = np.array(mx.fast.scaled_dot_product_attention(mx.array(q), mx.array(keys), mx.array(values), scale=s))
    group = n_heads // H
    for h in range(n_heads):
        kv_h = h // group
        delta = s * (np.abs(q[0, h, 0]) * bk[0, kv_h]).sum(-1).max()
        spread = v[0, kv_h].max(0) - v[0, kv_h].min(0)
        tol = bv[0, kv_h].max(0) + math.expm1(2 * delta) * spread / 2 + 1e-5
        assert np.all(np.abs(quant[0, h, 0] - exact[0, h, 0]) <= tol)


# --- fused attention on the packed codes equals attention on the dequantized history ---------------

def random_mask(seed: int, n_heads: int, L: int, T: int, boolean: bool) -> mx.array:
    """A boolean mask (B, n_heads, L, T), one per head, key 0 always visible; or an additive (L, T)."""
    rng = np.random.default_rng(seed)
    if boolean:
        m = rng.random((B, n_heads, L, T)) < 0.7
        m[..., 0] = True
        return mx.array(m)
    return mx.array(rng.uniform(-3.0, 0.0, (L, T)).astype(np.float32))


@pytest.mark.parametrize("kind", kvquant.FUSED)
@pytest.mark.parametrize("n_heads", [2, 6])
def test_fused_attention_equals_dequantized(kind, n_heads):
    """Prefill chunks (causal, boolean and additive masks) then single-token decode steps, at several
    offsets, and a step after a trim: `attend` on the codes gives mx.fast.scaled_dot_product_attention
    on the dequantized history, for plain (n_heads = H) and grouped-query (n_heads = 3 H) attention."""
    k, v = random_kv(11, 120, 2.0, outlier_gain=6.0)
    q = np.random.default_rng(12).standard_normal((B, n_heads, 120, D)).astype(np.float32)
    plain, fused = kvquant.SCHEMES[kind](B, H, D, 128), kvquant.SCHEMES[kind](B, H, D, 128, fused=True)
    assert fused.attends == "fused" and plain.attends == "dense"
    steps = [(0, 40, "causal"), (40, 1, None), (41, 30, "bool"), (71, 1, None), (72, 24, "additive"),
             (96, 20, "causal"), (116, 1, None), (117, 1, None)]
    s = D ** -0.5
    for start, L, how in steps:
        sl = slice(start, start + L)
        kk, vv, qq = mx.array(k[:, :, sl]), mx.array(v[:, :, sl]), mx.array(q[:, :, sl])
        mask = how if how in (None, "causal") else random_mask(start, n_heads, L, start + L, how == "bool")
        want = mx.fast.scaled_dot_product_attention(qq, *plain.update_and_fetch(kk, vv), scale=s, mask=mask)
        got = fused.attend(qq, kk, vv, s, mask)
        assert got.shape == (B, n_heads, L, D) and fused.offset == plain.offset == start + L
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-5, err_msg=f"{start}+{L} {how}")
    # after a trim the forgotten slots still hold codes: the fused path must not read them
    assert plain.trim(30) == fused.trim(30) == 30
    kk, vv, qq = mx.array(k[:, :, :1] * 5), mx.array(v[:, :, :1] * 5), mx.array(q[:, :, :1])
    want = mx.fast.scaled_dot_product_attention(qq, *plain.update_and_fetch(kk, vv), scale=s)
    np.testing.assert_allclose(np.array(fused.attend(qq, kk, vv, s)), np.array(want), rtol=1e-4, atol=1e-5)


def test_fused_only_where_mlx_has_a_kernel():
    assert set(kvquant.FUSED) == {k for k in KINDS if k.startswith(("affine", "outlier"))}
    with pytest.raises(ValueError, match="sym8 has no fused attention path"):
        kvquant.make_caches("sym8", 1, 1, 2, 64, 8, fused=True)
    c = kvquant.make_caches("affine4-g64", 1, 1, 2, 64, 8, fused=True)[0]
    with pytest.raises(ValueError, match="mask must be None, 'causal' or an array"):
        c.attend(mx.zeros((1, 2, 2, 64)), mx.zeros((1, 2, 2, 64)), mx.zeros((1, 2, 2, 64)), 0.125, "sliding")


# --- the shipped model: 8-bit caches keep the greedy tokens -----------------------------------------

GREEDY_TOKENS = 64


@pytest.fixture(scope="module")
def shipped(shipped_model):
    return load(shipped_model, mx.float32)


@pytest.mark.parametrize("kind, fused", [("sym8", False), ("affine8-g64", False), ("affine8-g32", False),
                                         ("affine8-g64", True)])
def test_8_bit_cache_keeps_greedy_tokens(shipped, kind, fused):
    """Measured on "import os\\n\\ndef ": all 64 greedy tokens agree for every 8-bit scheme, attention
    dequantized or fused (and for kivi4, whose float window holds half of them; sym4 diverges at
    token 1, affine4-g32 at 9)."""
    model, tok = shipped
    a = model.args
    prompt = tok.encode("import os\n\ndef ", bos=True)
    size = len(prompt) + GREEDY_TOKENS + 1

    def take(cache):
        return [t for _, t in zip(range(GREEDY_TOKENS), generate_step(model, prompt, Sampler(), cache))]

    quant = kvquant.make_caches(kind, a.num_hidden_layers, 1, a.num_key_value_heads, a.head_dim, size, fused=fused)
    assert take(quant) == take(model.make_cache(size))


# --- memory: real bytes, and bytes per token by hand --------------------------------------------

def stored_arrays(cache) -> list[mx.array]:
    arrays = []
    for value in vars(cache).values():
        arrays += [a for a in (value if isinstance(value, list) else [value]) if isinstance(a, mx.array)]
    return arrays


def bytes_per_token(kind: str, n_kv_heads: int, head_dim: int, scale_bytes: int) -> float:
    """Per layer, keys + values, one token: codes, plus scales (and biases) at scale_bytes each."""
    h, d, sb = n_kv_heads, head_dim, scale_bytes
    per_head = {
        "sym8": 2 * (d + sb),                       # int8 codes + one scale, K and V
        "sym4": 2 * (d / 2 + sb),                   # two codes a byte
        "affine8-g64": 2 * (d + 2 * sb * d / 64),   # scale and bias per 64 channels
        "affine8-g32": 2 * (d + 2 * sb * d / 32),
        "affine4-g64": 2 * (d / 2 + 2 * sb * d / 64),
        "affine4-g32": 2 * (d / 2 + 2 * sb * d / 32),
        # keys: scale and bias per channel per 32-token block; values: per 32 channels per token
        "kivi4": (d / 2 + 2 * sb * d / 32) + (d / 2 + 2 * sb * d / 32),
        "kivi2": (d / 4 + 2 * sb * d / 32) + (d / 4 + 2 * sb * d / 32),
        "outlier4": (d / 2 + 2 * sb * d / 32 + 4 * 2) + (d / 2 + 2 * sb * d / 32),   # + 4 float16 channels
    }[kind]
    return h * per_head


def fixed_bytes(kind: str, n_kv_heads: int, head_dim: int, float_bytes: int) -> int:
    """Bytes that do not grow with max_size: KIVI's float windows, the outlier channel indices."""
    if kind.startswith("kivi"):
        return n_kv_heads * head_dim * float_bytes * ((32 + 32) + 32)   # keys R + G, values R
    if kind == "outlier4":
        return n_kv_heads * 4 * 4                                        # int32 per head and channel
    return 0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [mx.float16, mx.float32])
def test_bytes_are_real_and_match_the_hand_formula(kind, dtype):
    sb = 2 if dtype == mx.float16 else 4
    sizes = {}
    for max_size in (64, 128):
        c = kvquant.SCHEMES[kind](1, H, D, max_size, dtype)
        c.update_and_fetch(*(mx.ones((1, H, 40, D), dtype=dtype),) * 2)
        assert c.nbytes == sum(a.nbytes for a in stored_arrays(c))
        sizes[max_size] = c.nbytes
    per_token = (sizes[128] - sizes[64]) / 64
    assert per_token == bytes_per_token(kind, H, D, sb)
    assert sizes[64] == 64 * per_token + fixed_bytes(kind, H, D, sb)
    assert per_token < KVCache(1, H, D, 1, mx.float16).nbytes       # below float16's 2 * H * D * 2


# --- the cache contract: offset, trim, state, errors ---------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n, left", [(0, 70), (3, 67), (40, 30), (70, 0), (99, 0)])
def test_trim_like_kvcache(kind, n, left):
    k, v = random_kv(5, 71, 1.0)
    c = kvquant.SCHEMES[kind](B, H, D, 96)
    keys, values = fill(c, k[:, :, :70], v[:, :, :70], [60, 10])
    assert c.trim(n) == 70 - left and c.offset == left
    after = [np.array(a) for a in c.state]
    assert after[0].shape == (B, H, left, D)
    assert np.array_equal(after[0], keys[:, :, :left]) and np.array_equal(after[1], values[:, :, :left])
    new_k, new_v = (np.array(a) for a in c.update_and_fetch(mx.array(k[:, :, 70:]), mx.array(v[:, :, 70:])))
    assert c.offset == left + 1 and new_k.shape == (B, H, left + 1, D)
    assert np.array_equal(new_k[:, :, :left], keys[:, :, :left])   # earlier positions untouched
    both = [np.concatenate([x[:, :, :left], x[:, :, 70:]], axis=2) for x in (k, v)]
    bk, bv = bounds(c, *both)
    assert within(new_k[:, :, left:], k[:, :, 70:], bk[:, :, left:])
    assert within(new_v[:, :, left:], v[:, :, 70:], bv[:, :, left:])


@pytest.mark.parametrize("kind", KINDS)
def test_errors_match_kvcache(kind):
    c = kvquant.SCHEMES[kind](1, 2, 64, 4)
    assert c.state[0].shape == (1, 2, 0, 64)
    with pytest.raises(ValueError, match="KV cache full: 5 positions needed, 4 allocated"):
        c.update_and_fetch(mx.zeros((1, 2, 5, 64)), mx.zeros((1, 2, 5, 64)))
    with pytest.raises(ValueError, match="expects keys/values of shape"):
        c.update_and_fetch(mx.zeros((1, 3, 1, 64)), mx.zeros((1, 3, 1, 64)))


def test_make_caches():
    caches = kvquant.make_caches("kivi2", 3, 1, 2, 64, 64, window=64)
    assert len(caches) == 3 and caches[0].bits == 2 and caches[0].window == 64
    with pytest.raises(ValueError, match="unknown KV-cache scheme 'int3'"):
        kvquant.make_caches("int3", 1, 1, 2, 64, 8)
    with pytest.raises(ValueError, match="mx.quantize needs"):
        kvquant.AffineKVCache(1, 2, 48, 8, group=32)


def test_one_builder_for_every_scheme():
    """make_caches builds the float caches too: "float" is the pre-allocated KVCache, its one name. Every
    quantized cache is a sibling of the float ones under kvcache.Cache (none subclasses a concrete cache); the
    three float caches share their buffers' bookkeeping through FloatCache."""
    assert kvquant.FLOATS == (kvquant.FLOAT, "chunked", "concat") and len(kvquant.QUANTIZED) == 9
    assert list(kvquant.SCHEMES) == [*kvquant.FLOATS, *KINDS]
    assert len({getattr(m, "func", m) for m in kvquant.SCHEMES.values()}) == 3 + 4       # one name per class and size
    for scheme in kvquant.SCHEMES:
        c = kvquant.make_caches(scheme, 1, 1, 2, 64, 16, mx.float16)[0]
        base = FloatCache if scheme in kvquant.FLOATS else Cache
        assert type(c).__bases__ == (base,) and c.attends == "dense" and c.dtype == mx.float16
    with pytest.raises(ValueError, match="unknown KV-cache scheme 'static'"):
        kvquant.make_caches("static", 1, 1, 2, 64, 8)                                 # the float cache has one name
    assert [type(c) for c in kvquant.make_caches(kvquant.FLOAT, 2, 1, 2, 64, 8)] == [KVCache, KVCache]
    assert kvquant.make_caches("chunked", 1, 1, 2, 64, 600, step=64)[0].step == 64
    assert isinstance(kvquant.make_caches("concat", 1, 1, 2, 64, 8)[0], ConcatKVCache)
    assert isinstance(kvquant.make_caches("chunked", 1, 1, 2, 64, 8)[0], ChunkedKVCache)
    with pytest.raises(ValueError, match="takes no parameters"):
        kvquant.make_caches(kvquant.FLOAT, 1, 1, 2, 64, 8, fused=True)
    with pytest.raises(ValueError, match="chunked has no fused attention path"):
        kvquant.make_caches("chunked", 1, 1, 2, 64, 8, fused=True)


def test_attention_follows_the_attends_field(shipped):
    """Model.make_cache builds any scheme; a fused cache gives the logits of the same scheme dequantized."""
    model, tok = shipped
    tokens = mx.array([tok.encode("import os\n\ndef main():", bos=True)])
    plain, fused = model.make_cache(32, 1, "affine8-g64"), model.make_cache(32, 1, "affine8-g64", fused=True)
    assert {c.attends for c in plain} == {"dense"} and {c.attends for c in fused} == {"fused"}
    np.testing.assert_allclose(np.array(model(tokens, fused)), np.array(model(tokens, plain)), rtol=1e-4, atol=1e-4)


def test_scheme_bytes_read_off_real_caches():
    """Bytes per token and fixed bytes of one layer, from nbytes at two sizes: the hand formula."""
    for kind in KINDS:
        assert kvquant.scheme_bytes(kind, H, D, mx.float16) == (bytes_per_token(kind, H, D, 2),
                                                                 fixed_bytes(kind, H, D, 2))
    assert kvquant.scheme_bytes(kvquant.FLOAT, 8, 128) == (2 * 8 * 128 * 2, 0)    # K and V, float16


def test_outlier_indices():
    """Channels above factor times the median channel's magnitude, counted per layer over all heads."""
    m = np.array([1.0, 1.2, 0.9, 9.0, 1.1, 5.0])
    assert kvquant.outlier_indices(m, 4.0).tolist() == [3, 5] and kvquant.outlier_indices(m, 7.0).tolist() == [3]
    with pytest.raises(ValueError, match="one magnitude per channel"):
        kvquant.outlier_indices(np.ones((2, 3)), 4.0)
    mags = {"keys_pre_rope": {"mean": np.stack([m.reshape(2, 3), np.ones((2, 3))])}}
    assert kvquant.outlier_channels(mags, 4.0) == [2, 0]


def test_the_cache_interface_is_abstract_and_a_dense_cache_will_not_attend():
    """Cache is the interface: a subclass that leaves out update_and_fetch, state or nbytes cannot be built, and
    a cache that attends "dense" refuses `attend` by name rather than storing nothing."""
    class Partial(Cache):
        def update_and_fetch(self, k, v):
            return k, v

    with pytest.raises(TypeError, match="abstract"):
        Partial(1, 2, 64, 8)
    dense = KVCache(1, 2, 64, 8)
    x = mx.zeros((1, 2, 1, 64))
    with pytest.raises(TypeError, match="KVCache attends 'dense': use update_and_fetch"):
        dense.attend(x, x, x, 1.0)


def test_fused_caches_round_their_slots_and_probe_the_backend(monkeypatch):
    """A fused cache allocates whole multiples of FUSED_SLOTS (MLX's CUDA kernel needs 16-byte rows) and, built on
    a backend whose quantized matmul gets q.K^T wrong, refuses with the error it measured."""
    c = kvquant.make_caches("affine8-g64", 1, 1, 2, 64, 260, fused=True)[0]
    assert c.max_size == 288 and c.k_quant[0].shape[2] == 288 and kvquant.fused_slots(256) == 256
    assert kvquant.make_caches("affine8-g64", 1, 1, 2, 64, 260)[0].max_size == 260    # dequantized: as asked
    assert kvquant.quantized_matmul_error(str(mx.default_device()), "float32", 64, 8, 64) < 0.01
    # the probe's verdict as MLX 0.32.4's CUDA kernel gave it for rows of 64
    monkeypatch.setattr(kvquant, "quantized_matmul_error", lambda *probe: 2.3)
    with pytest.raises(ValueError, match="fused attention is wrong on .*rows of 64 .* off the dequantized "
                                         "product by 230%"):
        kvquant.make_caches("affine8-g64", 1, 1, 2, 64, 8, fused=True)
