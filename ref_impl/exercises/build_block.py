"""Exercises of "Step 3: the transformer block" (book/build-it/03-transformer-block): the four operations of a
decoder layer, written in MLX, then plugged into the shipped model.

`rms_norm`, `rope`, `attend` and `mlp` are the contracts of `engine.model.Parts`. Each is called on random
float32 inputs (fixed seeds) and checked against the engine's own operation: `mx.fast.rms_norm`, `mx.fast.rope`,
`mx.fast.scaled_dot_product_attention` and `engine.model.MLP`, within 1e-4 of the largest value. A wrong output is
compared with what the usual slips give (no eps, the wrong pairs rotated, the mask on the first keys, key heads
tiled, ...): a match names the slip. `check_model_parts` then runs the shipped model with all four through
`Model.use(Parts(...))` and compares its logits and greedy tokens with MLX's own.
Tests: `pytest tests/test_exercises_build_block.py -k build_block_task`.

See chapter: build-block
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ref_impl import MODELS_DIR
from ref_impl.engine.checkpoint import load
from ref_impl.engine.compose import generate
from ref_impl.engine.model import MLP, MLX_PARTS, Model, ModelArgs, Parts
from ref_impl.exercises.core import Result, run_answer

RTOL = 1e-4        # of the largest |value| of the engine's output: float32 in any order of operations passes
MODEL_RTOL = 1e-3  # of the largest |logit|, after six layers of float32 rounding
SHIPPED = "stdlib-10m.gguf"
PROMPT = "import os\n\ndef main("
MODEL_TOKENS = 16

Case = tuple[tuple, str]                                     # (the arguments, a label naming them)
Variant = tuple[Callable[..., np.ndarray], str]              # (a slip's output for the arguments, its hint)


def _np(a) -> np.ndarray:
    return np.array(a, dtype=np.float64)


def _miss(got: np.ndarray, want: np.ndarray) -> float:
    """Largest |got − want| over the largest |want|; nan where both are nan counts as equal."""
    if got.shape != want.shape:
        return float("inf")
    both = np.isnan(got) & np.isnan(want)
    diff = np.where(both, 0.0, np.abs(got - want))
    if np.isnan(diff).any():
        return float("inf")
    return float(diff.max(initial=0.0) / max(float(np.nanmax(np.abs(want), initial=0.0)), 1e-30))


def _name(dtype: mx.Dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")


def _problem(out, want: mx.array, what: str) -> str | None:
    """What is wrong with the type, shape or dtype of an output, or None."""
    if not isinstance(out, mx.array):
        return (f"return an mx.array, got {type(out).__module__}.{type(out).__name__}: the model hands it on "
                "to MLX layers.")
    if out.shape != want.shape:
        return f"shape {tuple(out.shape)}, expected {tuple(want.shape)} ({what})."
    if out.dtype != want.dtype:
        return f"dtype {_name(out.dtype)}, expected {_name(want.dtype)}, the inputs' dtype."
    return None


def _judge(task: str, fn, cases: list[Case], oracle: Callable[..., mx.array], variants: list[Variant],
           recipe: str, what: str, on_raise: Callable[..., str] = lambda *args: "") -> Result:
    """Call fn on every case and compare with the oracle; a wrong answer that matches a variant on every case
    gets that variant's hint, any other the size of the miss and the recipe."""
    if not callable(fn):
        return Result(False, f"{task}: pass your function itself; the check calls it on several inputs.")
    got, wants = [], []
    for args, label in cases:
        want = oracle(*args)
        out, failed = run_answer(task, label, fn, *args)
        if failed is not None:
            extra = on_raise(*args) if "raised" in failed.message else ""
            return Result(False, failed.message + (f" Hint: {extra}" if extra else ""))
        bad = _problem(out, want, what)
        if bad is not None:
            return Result(False, f"{task} ({label}): {bad}")
        value, failed = run_answer(task, label, _np, out)          # MLX evaluates the graph here
        if failed is not None:
            return failed
        got.append(value)
        wants.append(_np(want))
    misses = [_miss(g, w) for g, w in zip(got, wants)]
    if max(misses) <= RTOL:
        within = f"within {max(misses):.1g} of the largest value" if max(misses) else "exactly"
        return Result(True, f"{task}: right on all {len(cases)} cases, {within} (tolerance {RTOL:g}).")
    for variant, hint in variants:
        if all(_miss(g, variant(*args)) <= RTOL for g, (args, _) in zip(got, cases)):
            break
    else:
        hint = recipe
    i = next(k for k, m in enumerate(misses) if m > RTOL)
    size = "nan or inf in your output" if not np.isfinite(got[i]).all() else \
        f"off by {misses[i]:.2g} of the largest value"
    return Result(False, f"{task} ({cases[i][1]}): {size}. Hint: {hint}")


# Step 3 task 1: RMSNorm -----------------------------------------------------------------------------

def _norm_cases() -> list[Case]:
    rng = np.random.default_rng(31)

    def f32(a):
        return mx.array(a.astype(np.float32))
    w64, w384, w48 = (f32(1 + 0.3 * rng.standard_normal(d)) for d in (64, 384, 48))
    return [
        ((f32(rng.standard_normal((2, 3, 64))), w64, 1e-5), "x (2, 3, 64), eps 1e-5"),
        ((f32(1e-3 * rng.standard_normal((1, 2, 384))), w384, 1e-5),
         "x (1, 2, 384) of small values, |x| ≈ 1e-3, eps 1e-5: eps matters"),
        ((f32(2 + 5 * rng.standard_normal((4, 48))), w48, 1e-6), "x (4, 48), off-centre (mean 2), eps 1e-6"),
    ]


def _norm_variants() -> list[Variant]:
    def div(x, w, eps, by):
        x = _np(x)
        return x / by(x, eps) * _np(w)

    def sums(x):
        return (x * x).sum(-1, keepdims=True)
    norm = "divide by the RMS, sqrt(mean(x²) + eps), not by the norm sqrt(sum(x²)): the mean divides by D."
    return [
        (lambda x, w, eps: _np(mx.fast.rms_norm(x, w, 0.0)),
         "eps left out: y = weight · x / sqrt(mean(x²) + eps). It matters on small rows like these."),
        (lambda x, w, eps: div(x, w, eps, lambda x, e: np.sqrt((x * x).mean(-1, keepdims=True)) + e),
         "eps goes inside the square root: sqrt(mean(x²) + eps), not sqrt(mean(x²)) + eps."),
        (lambda x, w, eps: div(x, w, eps, lambda x, e: np.sqrt(sums(x) + e)), norm),
        (lambda x, w, eps: div(x, w, eps, lambda x, e: np.sqrt(sums(x))), norm),
        (lambda x, w, eps: div(x, w, eps, lambda x, e: np.sqrt(sums(x)) + e), norm),
        (lambda x, w, eps: div(x, w, eps, lambda x, e: 1 / np.sqrt((x * x).mean(-1, keepdims=True) + e)),
         "multiplied by the RMS: divide by it (x * mx.rsqrt(mean(x²) + eps))."),
        (lambda x, w, eps: _np(mx.fast.rms_norm(x, mx.ones_like(w), eps)),
         "the result is multiplied by `weight`, one gain per channel."),
        (lambda x, w, eps: _np(mx.fast.layer_norm(x, w, None, eps)),
         "you subtracted the mean: that is LayerNorm. RMSNorm does not centre x, it only divides by the RMS."),
        (lambda x, w, eps: div(x, w, eps, lambda x, e: np.sqrt((x * x).mean() + e)),
         "one RMS per row: take the mean over the last axis only (axis=-1, keepdims=True), not the whole array."),
    ]


def check_rms_norm(fn) -> Result:
    """Step 3 task 1: `fn(x, weight, eps)`, RMSNorm of x over its last axis times weight, against
    `mx.fast.rms_norm` on three float32 inputs (one of them small enough for eps to matter)."""
    return _judge("Step 3 rms_norm", fn, _norm_cases(), mx.fast.rms_norm, _norm_variants(),
                  "y = weight · x / sqrt(mean(x², last axis) + eps).", "the shape of x")


# Step 3 task 2: the rotary embedding ------------------------------------------------------------------

def _rope_cases() -> list[Case]:
    rng = np.random.default_rng(32)

    def x(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32))
    x1 = x(1, 4, 6, 16)
    return [
        ((x1, 0, 10000.0, True), "x (1, 4, 6, 16), offset 0, base 1e4, traditional (adjacent pairs)"),
        ((x1, 0, 10000.0, False), "x (1, 4, 6, 16), offset 0, base 1e4, not traditional (pairs D/2 apart)"),
        ((x(2, 3, 5, 64), 13, 10000.0, True), "x (2, 3, 5, 64) after a cache of 13: offset 13, traditional"),
        ((x(1, 2, 1, 64), 150, 1e6, False), "one decoded position at offset 150, base 1e6, not traditional"),
        ((x(1, 6, 7, 32), 5, 500000.0, True), "x (1, 6, 7, 32), offset 5, base 5e5, traditional"),
    ]


def _rope(x, offset, base, traditional) -> mx.array:
    return mx.fast.rope(x, x.shape[-1], traditional=traditional, base=base, scale=1.0, offset=offset)


def _rope_freqs(x, offset, base, traditional, exponents, sign=1.0) -> np.ndarray:
    """mx.fast.rope with wavelengths base ** exponents (sign −1: the rotation the other way)."""
    freqs = mx.array(sign * np.float64(base) ** exponents, dtype=mx.float32)
    return _np(mx.fast.rope(x, x.shape[-1], traditional=traditional, base=None, scale=1.0, offset=offset,
                            freqs=freqs))


def _rope_variants() -> list[Variant]:
    def right_exponents(D):
        return np.arange(0, D, 2) / D
    return [
        (lambda x, o, b, t: _np(_rope(x, o, b, True)),
         "your pairs are adjacent, (x0, x1), (x2, x3), ..., whatever `traditional` says: when it is False, "
         "x_i pairs with x_{i+D/2}."),
        (lambda x, o, b, t: _np(_rope(x, o, b, False)),
         "your pairs are D/2 apart, (x_i, x_{i+D/2}), whatever `traditional` says: when it is True, adjacent "
         "values (x0, x1), (x2, x3), ... rotate together."),
        (lambda x, o, b, t: _np(_rope(x, o, b, not t)),
         "the flag the other way round: traditional=True means adjacent pairs, False pairs D/2 apart."),
        (lambda x, o, b, t: _np(_rope(x, 0, b, t)),
         "offset ignored: the positions are offset, offset+1, ..., offset+L−1 (right at offset 0, wrong after "
         "a cache)."),
        (lambda x, o, b, t: _np(_rope(x, o, 10000.0, t)), "use the `base` argument, not 10000."),
        (lambda x, o, b, t: _rope_freqs(x, o, b, t, np.arange(x.shape[-1] // 2) / x.shape[-1]),
         "pair i turns at θ_i = base^(−2i/D), i = 0..D/2−1: the exponent is 2i/D, not i/D."),
        (lambda x, o, b, t: _rope_freqs(x, o, b, t, right_exponents(x.shape[-1]), -1.0),
         "the rotation turns the wrong way: (a, b) -> (a·cos − b·sin, a·sin + b·cos)."),
        (lambda x, o, b, t: _np(_rope(x.swapaxes(1, 2), o, b, t).swapaxes(1, 2)),
         "x is (B, heads, L, D): the positions run along axis 2, not axis 1."),
    ]


def check_rope(fn) -> Result:
    """Step 3 task 2: `fn(x, offset, base, traditional)`, the rotary embedding of x (B, heads, L, D) at positions
    offset..offset+L−1, against `mx.fast.rope` with both pair layouts, offsets 0 and > 0, three bases."""
    return _judge("Step 3 rope", fn, _rope_cases(), _rope, _rope_variants(),
                  "position p turns pair i by the angle p·base^(−2i/D): (a, b) -> (a·cos − b·sin, a·sin + b·cos); "
                  "pairs are adjacent when traditional, D/2 apart otherwise.", "the shape of x")


# Step 3 task 3: grouped-query attention ---------------------------------------------------------------

def _attend_cases() -> list[Case]:
    rng = np.random.default_rng(33)

    def qkv(B, H, Hkv, L, T, D):
        return tuple(mx.array(rng.standard_normal(s).astype(np.float32))
                     for s in ((B, H, L, D), (B, Hkv, T, D), (B, Hkv, T, D)))
    s16, s32 = 16 ** -0.5, 32 ** -0.5
    return [
        ((*qkv(1, 4, 4, 6, 6, 16), s16, False), "H = Hkv = 4, L = T = 6, D 16, not causal"),
        ((*qkv(1, 4, 4, 6, 6, 16), s16, True), "H = Hkv = 4, L = T = 6, D 16, causal"),
        ((*qkv(1, 8, 2, 7, 7, 32), s32, True), "GQA H 8, Hkv 2, a causal prefill, L = T = 7"),
        ((*qkv(1, 8, 2, 1, 9, 32), s32, True), "GQA H 8, Hkv 2, one query after 8 cached keys, causal (L 1, T 9)"),
        ((*qkv(2, 8, 2, 4, 11, 32), s32, True), "GQA H 8, Hkv 2, B 2, a chunk of 4 after 7 cached, causal"),
        ((*qkv(1, 8, 2, 5, 12, 16), 0.3, False), "GQA H 8, Hkv 2, L 5, T 12, not causal, scale 0.3"),
    ]


def _sdpa(q, k, v, scale, causal) -> mx.array:
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal" if causal else None)


def _attention(q, k, v, scale, visible, tiled=False, axis=-1, masked=-np.inf) -> np.ndarray:
    """Attention in float64 numpy, for the slips: `visible` (L, T) or None, key heads tiled instead of
    repeated, the softmax over `axis`, the hidden scores set to `masked`."""
    q, k, v = _np(q), _np(k), _np(v)
    g = q.shape[1] // k.shape[1]
    k, v = (np.tile(a, (1, g, 1, 1)) if tiled else np.repeat(a, g, axis=1) for a in (k, v))
    s = q @ k.swapaxes(-1, -2) * scale
    if visible is not None:
        s = np.where(visible, s, masked)
    with np.errstate(invalid="ignore"):
        e = np.exp(s - s.max(axis, keepdims=True))
        return (e / e.sum(axis, keepdims=True)) @ v


def _last(q, k) -> np.ndarray:
    L, T = q.shape[2], k.shape[2]
    return np.arange(T)[None, :] <= np.arange(T - L, T)[:, None]


def _first(q, k) -> np.ndarray:
    return np.arange(k.shape[2])[None, :] <= np.arange(q.shape[2])[:, None]


def _attend_variants() -> list[Variant]:
    def causal(mask):
        return lambda q, k, v, s, c: _attention(q, k, v, s, mask(q, k) if c else None)
    return [
        (causal(_first), "the mask lines up with the LAST L keys: query i sees keys 0..T−L+i (the queries are "
                         "the newest positions, after the cache); yours lets query i see keys 0..i."),
        (lambda q, k, v, s, c: _attention(q, k, v, s, None),
         "causal=True: query i must not see keys after T−L+i; set those scores to −inf before the softmax."),
        (lambda q, k, v, s, c: _attention(q, k, v, s, _last(q, k)),
         "causal=False: every query sees every key; mask only when causal is True."),
        (lambda q, k, v, s, c: _attention(q, k, v, s, _last(q, k) if c else None, masked=0.0),
         "hidden scores must be −inf (weight 0 after the softmax), not 0."),
        (lambda q, k, v, s, c: _attention(q, k, v, s, _last(q, k) if c else None, tiled=True),
         "key head j serves query heads j·g .. j·g+g−1 (g = H/Hkv): repeat each key and value head g times in "
         "place (mx.repeat(k, g, axis=1)), not the whole set (mx.tile)."),
        (lambda q, k, v, s, c: _np(_sdpa(q, k, v, 1.0, c)), "scale the scores q·kᵀ by `scale` before the softmax."),
        (lambda q, k, v, s, c: _np(_sdpa(q, k, v, q.shape[-1] ** -0.5, c)),
         "use the `scale` argument (here 0.3): the model passes its own."),
        (lambda q, k, v, s, c: _np(_sdpa(q, k, v, 1 / s, c)), "multiply the scores by `scale` (it is already 1/√D)."),
        (lambda q, k, v, s, c: _attention(q, k, v, s, _last(q, k) if c else None, axis=-2),
         "softmax over the keys (the last axis of the (L, T) scores), not over the queries."),
    ]


def _gqa_raise(q, k, v, scale, causal) -> str:
    H, Hkv = q.shape[1], k.shape[1]
    if H == Hkv:
        return ""
    return (f"q has {H} heads, k and v {Hkv}: each key/value head serves g = {H // Hkv} query heads; repeat it "
            "(mx.repeat(k, g, axis=1)) before the matmuls.")


def check_attend(fn) -> Result:
    """Step 3 task 3: `fn(q, k, v, scale, causal)`, attention of q (B, H, L, D) over k, v (B, Hkv, T, D), against
    `mx.fast.scaled_dot_product_attention`: H = Hkv and GQA (8 and 2), causal with L = T and L < T, and not."""
    return _judge("Step 3 attend", fn, _attend_cases(), _sdpa, _attend_variants(),
                  "softmax(scale · q·kᵀ, masked with −inf where key j > T−L+i when causal) · v, each key/value "
                  "head repeated H/Hkv times.", "(B, H, L, D), the shape of q", _gqa_raise)


# Step 3 task 4: the SwiGLU MLP -------------------------------------------------------------------------

def _mlp_cases() -> tuple[list[Case], dict[int, MLP]]:
    """Two cases, and the engine's MLP of each, by the id of its gate layer."""
    cases, modules = [], {}
    for seed, (d, f), shape in ((34, (32, 64), (1, 5)), (35, (48, 128), (2, 3))):
        mx.random.seed(seed)
        mlp = MLP(ModelArgs(vocab_size=8, hidden_size=d, num_hidden_layers=1, intermediate_size=f,
                            num_attention_heads=1, num_key_value_heads=1))
        x = 2 * mx.random.normal((*shape, d))
        mx.eval(mlp.parameters(), x)
        modules[id(mlp.gate_proj)] = mlp
        cases.append(((x, mlp.gate_proj, mlp.up_proj, mlp.down_proj), f"x {(*shape, d)}, hidden {d} -> {f} -> {d}"))
    return cases, modules


def _mlp_variants() -> list[Variant]:
    def act(f):
        return lambda x, g, u, d: _np(d(f(g(x)) * u(x)))
    return [
        (act(mx.sigmoid), "the activation is SiLU, x·sigmoid(x) (nn.silu), not the bare sigmoid."),
        (act(nn.relu), "the activation is SiLU, x·sigmoid(x) (nn.silu), not ReLU."),
        (act(nn.gelu), "the activation is SiLU, x·sigmoid(x) (nn.silu), not GELU."),
        (act(lambda z: z), "no activation: silu(gate(x)) multiplies up(x); without it the MLP is linear."),
        (lambda x, g, u, d: _np(d(nn.silu(u(x)) * g(x))),
         "gate and up swapped: silu applies to gate(x), and the result multiplies up(x)."),
        (lambda x, g, u, d: _np(d(nn.silu(g(x) * u(x)))), "silu applies to gate(x) alone, before the product."),
        (lambda x, g, u, d: _np(d(nn.silu(u(x)))), "SwiGLU uses both inputs: down(silu(gate(x)) * up(x))."),
        (lambda x, g, u, d: _np(d(nn.silu(g(x)))), "SwiGLU uses both inputs: down(silu(gate(x)) * up(x))."),
    ]


def check_mlp(fn) -> Result:
    """Step 3 task 4: `fn(x, gate, up, down)`, the SwiGLU MLP given its three projections as callables, against
    the engine's `model.MLP` with random nn.Linear layers."""
    cases, modules = _mlp_cases()
    return _judge("Step 3 mlp", fn, cases, lambda x, gate, up, down: modules[id(gate)](x), _mlp_variants(),
                  "down(silu(gate(x)) * up(x)), silu(z) = z·sigmoid(z).", "the shape of x: down maps back")


# Step 3 task 5: the four in the shipped model --------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _shipped():
    return load(MODELS_DIR / SHIPPED, mx.float32)


def _logits(model: Model, ids: list[int]) -> np.ndarray:
    """Logits of a prefill, a chunk of 3 after it and one decoded position, through one cache."""
    cache = model.make_cache(len(ids) + 8)
    a = model(mx.array([ids[:-3]]), cache)
    b = model(mx.array([ids[-3:]]), cache)
    c = model(mx.argmax(b[:, -1:], axis=-1), cache)
    return _np(mx.concatenate([a, b, c], axis=1))


def check_model_parts(rms_norm, rope=None, attend=None, mlp=None) -> Result:
    """Step 3 task 5: the shipped model (float32) through `Model.use(Parts(rms_norm, rope, attend, mlp))` gives
    MLX's logits within 1e-3 of the largest, over a prefill, a chunk after it and a decode, and its 16 greedy
    tokens (a part left None stays MLX's). Each part alone is tried first, to name the one that breaks the model."""
    task = "Step 3 model"
    mine = {k: v for k, v in {"rms_norm": rms_norm, "rope": rope, "attend": attend, "mlp": mlp}.items() if v is not None}
    for name, fn in mine.items():
        if not callable(fn):
            return Result(False, f"{task}: pass your functions, rms_norm, rope, attend and mlp; "
                                 f"{name} is {type(fn).__name__}.")
    model, tok = _shipped()
    ids = tok.encode(PROMPT, bos=True)
    fields = dict(rms_norm="norm", rope="rope", attend="attend", mlp="mlp")
    try:
        model.use(MLX_PARTS)
        want, ref = _logits(model, ids), generate(model, tok, ids, MODEL_TOKENS)
        for name, fn in mine.items():
            got, failed = run_answer(f"{task}, your {name}", "in the model", _logits,
                                     model.use(Parts(**{fields[name]: fn})), ids)
            if failed is not None:
                return failed
            if (miss := _miss(got, want)) > MODEL_RTOL:
                return Result(False, f"{task}: with only your {name} in the shipped model, its logits are off "
                                     f"by {miss:.2g} of the largest. Hint: run ex.check_{name} on it.")
        model.use(Parts(**{fields[name]: fn for name, fn in mine.items()}))
        miss = _miss(_logits(model, ids), want)
        out = generate(model, tok, ids, MODEL_TOKENS)
    finally:
        model.use(MLX_PARTS)
    if miss > MODEL_RTOL or out.tokens != ref.tokens:
        return Result(False, f"{task}: with all of yours, the logits are off by {miss:.2g} of the largest and "
                             f"{sum(a != b for a, b in zip(out.tokens, ref.tokens))} of {len(ref.tokens)} tokens "
                             "differ. Hint: each part alone was right; check that they keep float32.")
    return Result(True, f"{task}: with your functions the shipped model gives MLX's {len(ref.tokens)} greedy "
                        f"tokens and its logits within {miss:.1g} of the largest: {PROMPT + out.text!r}.")
