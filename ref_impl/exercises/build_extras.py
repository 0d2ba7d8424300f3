"""Exercises of "Build it yourself", steps 6 and 7 (book/build-it/06-quantized-kv-cache, 07-speculative-acceptance).

Step 6: per-token symmetric int8 codes for keys and values (`quantize_sym8`, `dequantize_sym8`) and a cache
that stores them (`Sym8Cache`), checked bit for bit against `engine.kvquant.quantize_symmetric`,
`dequantize_symmetric` and `SymmetricKVCache` (bits 8), then run in the shipped model beside the engine's
sym8 cache and the float cache. Step 7: speculative decoding's acceptance rule, `accept(p, q, drafts, u)`,
checked exactly against `engine.speculative.accept` and for its promise: the first emitted token is
distributed as the target's p. Tests: `pytest tests/test_exercises_build_extras.py -k build_step_6`
(or `build_step_7`).

See chapter: build-kv8
See chapter: build-accept
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

from ref_impl import MODELS_DIR
from ref_impl.engine import checkpoint
from ref_impl.engine.kvquant import (
    SymmetricKVCache,
    dequantize_symmetric,
    make_caches,
    quantize_symmetric,
    scheme_bytes,
)
from ref_impl.engine.speculative import accept as engine_accept
from ref_impl.engine.speculative import chi2_pvalue
from ref_impl.exercises.core import Result, run_answer

QMAX = 127   # int8's symmetric range: codes -127..127 (-128 unused)


# Step 6: quantize_sym8 -------------------------------------------------------------------------

def _sym8_inputs() -> list[tuple[mx.array, str]]:
    """Keys-like tensors (B, H, L, D): Gaussian, with outlier channels, in float16; each has an all-zero token."""
    rng = np.random.default_rng(6)
    a = rng.standard_normal((2, 2, 7, 64)).astype(np.float32)
    a[0, 1, 3] = 0.0
    b = rng.standard_normal((1, 2, 9, 32)).astype(np.float32) * 0.05
    b[..., [3, 17]] *= 40.0                 # two outlier channels, as keys have
    b[0, 0, 5] = 0.0
    c = rng.standard_normal((1, 4, 6, 64)).astype(np.float32) * 2.0
    c[0, 2, 0] = 0.0
    return [(mx.array(a), "float32 (2, 2, 7, 64), token [0, 1, 3] all zero"),
            (mx.array(b), "float32 (1, 2, 9, 32), outlier channels 3 and 17, token [0, 0, 5] all zero"),
            (mx.array(c).astype(mx.float16), "float16 (1, 4, 6, 64), token [0, 2, 0] all zero")]


def _numpy(a) -> np.ndarray | None:
    """An mx or numpy array (or a nested list) as a numpy array keeping its dtype; None if it is not one."""
    try:
        return np.array(a) if isinstance(a, mx.array) else np.asarray(a)
    except (TypeError, ValueError, RuntimeError):
        return None


def _dtype(x: mx.array) -> np.dtype:
    return np.dtype(str(x.dtype).split(".")[-1])


def _pair(task: str, label: str, out, first: str, second: str) -> tuple[tuple | None, Result | None]:
    """The learner's output as two numpy arrays, or a ✗ Result saying why it is not."""
    try:
        if isinstance(out, (mx.array, np.ndarray)):
            raise TypeError("one array")
        a, b = out
    except (TypeError, ValueError):
        return None, Result(False, f"{task} ({label}): return a pair ({first}, {second}), got "
                                   f"{type(out).__name__} {out!r:.80}.")
    arrays = (_numpy(a), _numpy(b))
    for name, arr, raw in ((first, arrays[0], a), (second, arrays[1], b)):
        if arr is None or arr.dtype == object:
            return None, Result(False, f"{task} ({label}): {name} should be an array, got {raw!r:.80}.")
    return arrays, None


def _scales_shape_hint(shape: tuple, x_shape: tuple) -> str:
    B, H, L, D = x_shape
    if int(np.prod(shape)) == 1:
        return "one scale for the whole tensor: take max|x| per token and head, over the head dim only."
    if shape in ((B, H, 1, D), (1, 1, 1, D), (D,), (1, D), (B, H, D)):
        return "one scale per channel (over positions): take max|x| over the head dim instead (axis=-1)."
    if shape == (B, H, L):
        return "keep the reduced axis: mx.abs(x).max(axis=-1, keepdims=True), shape (B, H, L, 1)."
    return "one scale per (B, H, position): max|x| over the last axis, keepdims=True."


def _codes_hint(x: np.ndarray, scales: np.ndarray, codes: np.ndarray, right: np.ndarray) -> str:
    """Name the slip behind codes that differ from the engine's, given the right scales."""
    safe = np.where(scales == 0, 1, scales).astype(np.float32)
    zero_rows = np.broadcast_to(scales == 0, x.shape)
    wrong = codes.astype(np.int64) != right
    if wrong[zero_rows].any() and not wrong[~zero_rows].any():
        return ("an all-zero token has scale 0: its codes are 0. Divide by 1 where the scale is 0 "
                "(mx.where(scales == 0, 1, scales)), not by 0.")
    for rounding, hint in ((np.trunc, "don't truncate toward zero (astype alone)."), (np.floor, "not down.")):
        if np.array_equal(codes.astype(np.int64), np.clip(rounding(x / safe), -QMAX, QMAX).astype(np.int64)):
            return "round to the nearest code (mx.round), " + hint
    miss = np.abs(codes.astype(np.int64) - right)
    if miss.max() == 1 and wrong.mean() < 0.05:
        return (f"{int(wrong.sum())} of {wrong.size} codes are off by one: divide in float32, "
                "x.astype(mx.float32) / scales.astype(mx.float32), then mx.round (a float16 quotient, or x × (1 / "
                "scale), is rounded once before mx.round).")
    return ("codes = clip(round(x / scale), -127, 127) as int8, with x and the stored scale both in float32, "
            "and 0 for an all-zero token.")


def check_quantize_sym8(fn) -> Result:
    """Step 6, quantize_sym8: `fn(x (B, H, L, D)) -> (codes int8 (B, H, L, D), scales (B, H, L, 1))`, one
    scale per token and head, scale = max|x| / 127 (in float32, stored in x's dtype), codes = round(x / scale)
    in float32, 0 for an all-zero token.

    Called on three tensors (float32 and float16, each with an all-zero token); codes and scales must equal
    `kvquant.quantize_symmetric(x, 8, x.dtype)` bit for bit.
    """
    task = "Step 6 (quantize_sym8)"
    if not callable(fn):
        return Result(False, f"{task}: write a function quantize_sym8(x) -> (codes, scales).")
    for x, label in _sym8_inputs():
        out, failed = run_answer(task, label, fn, x)
        if failed is not None:
            return failed
        pair, bad = _pair(task, label, out, "codes", "scales")
        if bad is not None:
            return bad
        codes, scales = pair
        r_codes, r_scales = (np.array(a) for a in quantize_symmetric(x, 8, x.dtype))
        xs, xd = tuple(x.shape), _dtype(x)
        if codes.shape != xs:
            return Result(False, f"{task} ({label}): codes have shape {codes.shape}, expected {xs}: one code "
                                 "per value.")
        if codes.dtype == np.uint8:
            return Result(False, f"{task} ({label}): codes are uint8. Hint: symmetric codes are signed, -127..127: "
                                 "store them as int8 (uint8 wraps -1 to 255).")
        if codes.dtype != np.int8:
            return Result(False, f"{task} ({label}): codes are {codes.dtype}, expected int8: one byte per value "
                                 "is the point of the cache.")
        if scales.shape != r_scales.shape:
            return Result(False, f"{task} ({label}): scales have shape {scales.shape}, expected {r_scales.shape}. "
                                 f"Hint: {_scales_shape_hint(scales.shape, xs)}")
        if scales.dtype != xd:
            return Result(False, f"{task} ({label}): scales are {scales.dtype}; store them in x's dtype, {xd} "
                                 "(compute max|x| / 127 in float32, then .astype(x.dtype)).")
        if not np.array_equal(scales, r_scales):
            return _scales_miss(task, label, scales, r_scales)
        if not np.array_equal(codes, r_codes):
            xf = np.array(x.astype(mx.float32))
            i = np.unravel_index(int(np.argmax(codes != r_codes)), xs)
            return Result(False, f"{task} ({label}): code {list(map(int, i))} is {int(codes[i])}, expected "
                                 f"{int(r_codes[i])}. Hint: {_codes_hint(xf, r_scales, codes, r_codes)}")
    return Result(True, f"{task}: codes and scales equal kvquant.quantize_symmetric(x, 8)'s bit for bit, "
                        "on 3 tensors (float32 and float16, all-zero tokens included).")


def _scales_miss(task: str, label: str, scales: np.ndarray, right: np.ndarray) -> Result:
    s, r = scales.astype(np.float64), right.astype(np.float64)
    zero = r == 0
    with np.errstate(all="ignore"):
        ratio = np.median(s[~zero] / r[~zero])
    if (s[zero] != 0).any() and np.allclose(s[~zero], r[~zero], rtol=1e-3):
        hint = ("an all-zero token's scale is max|x| / 127 = 0: keep it 0 (no clamp, no epsilon); "
                "divide by 1 there when making codes.")
    elif abs(ratio - QMAX / 128) < 1e-3:
        hint = "scale = max|x| / 127: the codes are -127..127, symmetric, so the largest value maps to 127, not 128."
    elif abs(ratio - QMAX / 255) < 1e-3:
        hint = "scale = max|x| / 127: codes are signed, -127..127, not 0..255."
    elif abs(ratio - 1) < 1e-3:
        hint = "close but not exact: compute max|x| / 127 in float32 and store it in x's dtype, with no epsilon."
    else:
        hint = f"your scales are about {ratio:.4g}× the engine's: scale = max|x| / 127 over the head dim."
    i = np.unravel_index(int(np.argmax(s != r)), r.shape)
    return Result(False, f"{task} ({label}): scale {list(map(int, i[:3]))} is {s[i]:.6g}, expected {r[i]:.6g}. "
                         f"Hint: {hint}")


# Step 6: dequantize_sym8 -----------------------------------------------------------------------

def check_dequantize_sym8(fn) -> Result:
    """Step 6, dequantize_sym8: `fn(codes int8 (B, H, L, D), scales (B, H, L, 1)) -> codes × scales`, in the
    scales' dtype, shape (B, H, L, D).

    Called on the engine's codes and scales of three tensors (float32 and float16); checked against
    `kvquant.dequantize_symmetric(codes, scales, 8)` within float rounding (1e-6 of the largest value in
    float32, 1e-3 in float16).
    """
    task = "Step 6 (dequantize_sym8)"
    if not callable(fn):
        return Result(False, f"{task}: write a function dequantize_sym8(codes, scales) -> values.")
    for x, label in _sym8_inputs():
        codes, scales = quantize_symmetric(x, 8, x.dtype)
        out, failed = run_answer(task, label, fn, codes, scales)
        if failed is not None:
            return failed
        got, right = _numpy(out), np.array(dequantize_symmetric(codes, scales, 8))
        if got is None or got.dtype.kind not in "fiu":
            return Result(False, f"{task} ({label}): expected an array of values, got {type(out).__name__}.")
        if got.shape != right.shape:
            return Result(False, f"{task} ({label}): shape {got.shape}, expected {right.shape}: one value per code "
                                 "(scales (B, H, L, 1) broadcast over the head dim).")
        if got.dtype != right.dtype:
            return Result(False, f"{task} ({label}): values are {got.dtype}; return them in the scales' dtype, "
                                 f"{right.dtype}: codes.astype(scales.dtype) * scales.")
        g, r = got.astype(np.float64), right.astype(np.float64)
        tol = (1e-3 if right.dtype == np.float16 else 1e-6) * float(np.abs(r).max())
        if np.all(np.abs(g - r) <= tol):
            continue
        c, s = np.array(codes).astype(np.float64), np.array(scales).astype(np.float64)
        with np.errstate(all="ignore"):
            variants = [(c / s, "value = code × scale: multiply by the scale, don't divide."),
                        (c * s * QMAX, "the scale already includes the 1/127: value = code × scale."),
                        (c * s / QMAX, "the scale already includes the 1/127: value = code × scale."),
                        (c, "multiply each code by its token's scale.")]
        hint = next((h for v, h in variants if np.allclose(g, v, rtol=1e-5, atol=tol, equal_nan=True)),
                    "value = code × scale, per token.")
        i = np.unravel_index(int(np.argmax(np.abs(g - r))), r.shape)
        return Result(False, f"{task} ({label}): value {list(map(int, i))} is {g[i]:.6g}, expected {r[i]:.6g}. "
                             f"Hint: {hint}")
    return Result(True, f"{task}: equal to kvquant.dequantize_symmetric(codes, scales, 8) on 3 tensors "
                        "(float32 and float16).")


# Step 6: Sym8Cache -----------------------------------------------------------------------------

def _held_bytes(obj) -> int:
    """Bytes of every mx or numpy array an object holds in its attributes (in lists, tuples and dicts too)."""
    def size(v) -> int:
        if isinstance(v, (mx.array, np.ndarray)):
            return int(v.nbytes)
        if isinstance(v, (list, tuple)):
            return sum(size(a) for a in v)
        return sum(size(a) for a in v.values()) if isinstance(v, dict) else 0
    return size(vars(obj)) if hasattr(obj, "__dict__") else 0


def _history_miss(got: tuple, right: tuple, floats: tuple, L: int) -> str | None:
    """Why a returned (keys, values) history is wrong, or None if it equals SymmetricKVCache(bits=8)'s."""
    for name, g, r, f in (("keys", got[0], right[0], floats[0]), ("values", got[1], right[1], floats[1])):
        if g.shape != r.shape:
            if g.shape[:2] == r.shape[:2] and g.shape[2] == L and L != r.shape[2]:
                return (f"{name} hold only the new positions ({L}): return the whole history, all "
                        f"{r.shape[2]} positions.")
            return f"{name} have shape {g.shape}, expected {r.shape}: (B, H, offset, D), the whole history."
        if g.dtype != r.dtype:
            return f"{name} are {g.dtype}; return them in the dtype k and v came in, {r.dtype}."
        tol = (1e-3 if r.dtype == np.float16 else 1e-6) * float(np.abs(r).max())
        gd, rd = g.astype(np.float64), r.astype(np.float64)
        if np.all(np.abs(gd - rd) <= tol):
            continue
        if np.all(np.abs(gd - f.astype(np.float64)) <= tol):
            return (f"these are the float {name}, not quantized: store quantize_sym8's codes and scales and "
                    "return dequantize_sym8 of them.")
        other = right[1] if name == "keys" else right[0]
        if g.shape == other.shape and np.all(np.abs(gd - other.astype(np.float64)) <= tol):
            return "keys and values swapped: return (keys, values)."
        return (f"{name} differ from SymmetricKVCache(bits=8)'s by up to {np.abs(gd - rd).max():.3g}: quantize "
                "each new k and v with quantize_sym8 (check it first), keep every code and scale, and return "
                "dequantize_sym8 of all of them.")
    return None


def _feed(task: str, cls, dtype: mx.Dtype) -> tuple[Result | None, float]:
    """Feed chunks of 5, 1, 1 and 3 positions to the learner's cache and to SymmetricKVCache(bits=8):
    (a ✗ Result or None, the learner's bytes per position held)."""
    label = f"Sym8Cache(1, 2, 32, 10, mx.{str(dtype).split('.')[-1]}), chunks of 5, 1, 1, 3"
    cache, failed = run_answer(task, label, cls, 1, 2, 32, 10, dtype)
    if failed is not None:
        return failed, 0.0
    if getattr(cache, "attends", None) != "dense":
        return Result(False, f"{task}: give the class `attends = \"dense\"`: the model's attention reads it, "
                             "then calls update_and_fetch."), 0.0
    if getattr(cache, "offset", None) != 0:
        return Result(False, f"{task}: a new cache has offset 0 (got {getattr(cache, 'offset', None)!r})."), 0.0
    engine = SymmetricKVCache(1, 2, 32, 10, dtype, bits=8)
    rng, kept = np.random.default_rng(7), ([], [])
    for step, L in enumerate((5, 1, 1, 3)):
        k, v = (rng.standard_normal((1, 2, L, 32)).astype(np.float32) for _ in range(2))
        if step == 0:
            k[0, 1, 2] = v[0, 0, 4] = 0.0          # all-zero tokens: scale 0, codes 0
        k, v = mx.array(k).astype(dtype), mx.array(v).astype(dtype)
        kept[0].append(np.array(k))
        kept[1].append(np.array(v))
        at = f"{label}, after the chunk of {L} (offset {engine.offset + L})"
        out, failed = run_answer(task, at, cache.update_and_fetch, k, v)
        if failed is not None:
            return failed, 0.0
        got, bad = _pair(task, at, out, "keys", "values")
        if bad is not None:
            return bad, 0.0
        right = tuple(np.array(a) for a in engine.update_and_fetch(k, v))
        miss = _history_miss(got, right, tuple(np.concatenate(h, axis=2) for h in kept), L)
        if miss is not None:
            return Result(False, f"{task} ({at}): {miss}"), 0.0
        if getattr(cache, "offset", None) != engine.offset:
            return Result(False, f"{task} ({at}): offset is {getattr(cache, 'offset', None)!r}, expected "
                                 f"{engine.offset}: add L, the new positions, each call (the model's rotary "
                                 "embedding reads it)."), 0.0
    per_token = _held_bytes(cache) / engine.offset
    return None, per_token


@functools.lru_cache(maxsize=1)
def _shipped():
    model, tokenizer = checkpoint.load(MODELS_DIR / "stdlib-10m.gguf", mx.float32)
    prompt = tokenizer.encode("class Queue:\n    def __init__(self, maxsize=0):\n        self.maxsize = maxsize\n")
    return model, prompt


def _logits(model, caches: list, tokens: list[int], prompt_len: int) -> np.ndarray:
    """Logits (steps + 1, V) for the prompt's last position and each later token, fed one at a time."""
    rows = [model(mx.array([tokens[:prompt_len]]), caches)[0, -1]]
    for t in tokens[prompt_len:]:
        rows.append(model(mx.array([[t]]), caches)[0, -1])
    return np.array(mx.stack(rows))


def _model_run(task: str, cls, steps: int = 24) -> tuple[Result | None, str]:
    """The shipped model with the learner's caches, the engine's sym8 caches and the float cache, each fed the
    engine sym8 cache's greedy tokens: (a ✗ Result or None, the report)."""
    model, prompt = _shipped()
    a, P = model.args, len(prompt)
    size, layers = P + steps, a.num_hidden_layers    # exactly the positions fed

    def sym8() -> list:
        return make_caches("sym8", layers, 1, a.num_key_value_heads, a.head_dim, size)
    engine, tokens = sym8(), list(prompt)
    logits = model(mx.array([prompt]), engine)[0, -1]
    for _ in range(steps):                       # the engine sym8 cache's greedy tokens
        tokens.append(int(mx.argmax(logits)))
        logits = model(mx.array([tokens[-1:]]), engine)[0, -1]
    label = f"shipped model, {P}-token prompt, {steps} greedy steps"
    mine, failed = run_answer(task, label, lambda: [cls(1, a.num_key_value_heads, a.head_dim, size, mx.float32)
                                                    for _ in range(layers)])
    if failed is not None:
        return failed, ""
    got, failed = run_answer(task, label, _logits, model, mine, tokens, P)
    if failed is not None:
        return failed, ""
    right, flt = _logits(model, sym8(), tokens, P), _logits(model, model.make_cache(size), tokens, P)
    if got.shape != right.shape or not np.isfinite(got).all():
        return Result(False, f"{task} ({label}): logits of shape {got.shape}, finite: {bool(np.isfinite(got).all())}; "
                             f"expected finite logits {right.shape}."), ""
    to_engine, to_float = float(np.abs(got - right).max()), float(np.abs(got - flt).max())
    if to_engine > 1e-3:
        why = " They are the float cache's: is anything quantized?" if to_float < 1e-4 else ""
        return Result(False, f"{task} ({label}): logits differ from the engine's sym8 cache's by up to "
                             f"{to_engine:.3g} (the float cache's differ from them by "
                             f"{float(np.abs(right - flt).max()):.3g}).{why}"), ""
    agree = int((got.argmax(-1) == flt.argmax(-1)).sum())
    held = sum(_held_bytes(c) for c in mine) / size
    sym8_bytes = scheme_bytes("sym8", a.num_key_value_heads, a.head_dim, mx.float32)[0] * layers
    float_bytes = 2 * layers * a.num_key_value_heads * a.head_dim * 4
    return None, (f"{label}: the logits differ from the float cache's by up to {to_float:.3g} "
                  f"(largest |logit| {np.abs(flt).max():.3g}; from the engine's sym8 cache's by {to_engine:.1g}), "
                  f"and the greedy next token agrees with the float cache's at {agree} of {steps + 1} positions. "
                  f"Your caches hold {held:,.0f} bytes per token over the {layers} layers (engine sym8: "
                  f"{sym8_bytes:,.0f}; float32 cache: {float_bytes:,}; float16: {float_bytes // 2:,})")


def check_sym8_cache(cls) -> Result:
    """Step 6, Sym8Cache: a class `cls(batch, n_kv_heads, head_dim, max_size, dtype)` (step 4's Cache and
    `kvquant.SymmetricKVCache`'s arguments) with `offset` (0), `attends = "dense"` and
    `update_and_fetch(k, v) -> (keys, values)`: store int8 codes and scales (in dtype) of k, v (B, H, L, D), return
    the dequantized history (B, H, offset, D) in dtype.

    Fed chunks of 5, 1, 1, 3 positions in float32 and float16 beside `kvquant.SymmetricKVCache(bits=8)`: each
    history must match it; the bytes it holds per position must be codes and scales, not floats. Then one
    cache per layer runs the shipped model (prompt and 24 greedy steps): logits within 1e-3 of the engine's
    sym8 cache's; the report gives the gap to the float cache, the greedy agreement and the bytes per token.
    """
    task = "Step 6 (Sym8Cache)"
    if not callable(cls):
        return Result(False, f"{task}: write a class Sym8Cache; the check builds caches with "
                             "Sym8Cache(batch, n_kv_heads, head_dim, max_size, dtype).")
    for dtype in (mx.float32, mx.float16):
        failed, held = _feed(task, cls, dtype)
        if failed is not None:
            return failed
        codes_scales = 2 * 2 * (32 + dtype.size)       # K and V, 2 heads: 32 int8 codes and one scale each
        if held > 1.01 * codes_scales:
            return Result(False, f"{task}: your {str(dtype).split('.')[-1]} cache holds {held:,.0f} bytes per "
                                 f"position (2 heads × 32 dims); int8 codes and one scale per token and head take "
                                 f"{codes_scales}. Keep the codes and scales and dequantize them when asked, not "
                                 "a float copy.")
    failed, report = _model_run(task, cls)
    if failed is not None:
        return failed
    return Result(True, f"{task}: histories equal SymmetricKVCache(bits=8)'s (float32 and float16); {report}.")


# Step 7: accept --------------------------------------------------------------------------------

def _accept_case(seed: int, lead: tuple, gamma: int, vocab: int, same: bool = False) -> tuple:
    """Random (p, q, drafts, u) with leading dims `lead`; drafts drawn from q; q = p when `same`."""
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(vocab, 0.6), size=lead + (gamma + 1,))
    q = p[..., :gamma, :].copy() if same else rng.dirichlet(np.full(vocab, 0.6), size=lead + (gamma,))
    cdf = np.cumsum(q, axis=-1)
    drafts = np.minimum((cdf < rng.random(lead + (gamma, 1)) * cdf[..., -1:]).sum(-1), vocab - 1)
    return p, q, drafts, rng.random(lead + (gamma + 1,))


def _accept_cases() -> list[tuple[tuple, str]]:
    return [(_accept_case(70, (200,), 3, 8, same=True), "q = p: every draft accepted, 200 trials, γ = 3"),
            (_accept_case(71, (), 4, 10), "one step (no leading dims), γ = 4, 10 tokens"),
            (_accept_case(72, (400,), 1, 6), "400 trials, γ = 1, 6 tokens"),
            (_accept_case(73, (400,), 4, 12), "400 trials, γ = 4, 12 tokens"),
            (_accept_case(74, (4, 50), 2, 8), "leading dims (4, 50), γ = 2, 8 tokens")]


def _draw(weights: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Inverse CDF, as the contract states: the first index whose cumulative weight exceeds u × the total."""
    cdf = np.cumsum(weights, axis=-1)
    return np.minimum((cdf <= (u * cdf[..., -1])[..., None]).sum(-1), weights.shape[-1] - 1)


def _n_hint(p, q, drafts, u, n_got) -> str:
    """Name the slip behind a wrong number of accepted drafts."""
    gamma = drafts.shape[-1]
    p_x = np.take_along_axis(p[..., :gamma, :], drafts[..., None], -1)[..., 0]
    q_x = np.take_along_axis(q, drafts[..., None], -1)[..., 0]
    lead = lambda ok: np.argmin(np.concatenate([ok, np.zeros(ok.shape[:-1] + (1,), bool)], -1), -1)
    ok = u[..., :gamma] * q_x < p_x
    slips = [(lead(u[..., :gamma] * p_x < q_x), ("accept with probability min(1, p(x)/q(x)), the target's over "
                                                 "the draft's: u < p(x)/q(x), not q(x)/p(x).")),
             (ok.sum(-1), ("n counts the leading acceptances: stop at the first rejection; later drafts are "
                           "never judged.")),
             (lead(p_x >= q_x), ("a draft with p(x) < q(x) is still kept with probability p(x)/q(x): compare "
                                 "u[i] with it.")),
             (lead(u[..., :gamma] < p_x), "the ratio is p(x)/q(x): accept when u[i] · q(x) < p(x).")]
    return next((h for v, h in slips if np.array_equal(v, n_got)),
                "n = how many leading drafts pass u[i] < p_i(x_i) / q_i(x_i).")


def _token_hint(p, q, drafts, u, n, tok, vocab: int) -> str:
    """Name the slip behind wrong tokens, given the right n."""
    gamma = drafts.shape[-1]
    rejected = n < gamma
    ni = np.minimum(n, gamma - 1)[..., None, None]
    p_n = np.take_along_axis(p, n[..., None, None], -2)[..., 0, :]
    q_n = np.take_along_axis(q, ni, -2)[..., 0, :]
    res = np.maximum(p_n - q_n, 0)
    u_n = np.take_along_axis(u, n[..., None], -1)[..., 0]
    cdf = np.cumsum(res, -1)
    unnormed = (cdf <= u[..., gamma][..., None]).sum(-1)
    right = engine_accept(p, q, drafts, u)[1]
    if not np.array_equal(tok[~rejected], right[~rejected]):
        return ("when every draft is accepted (n = γ) the token is the bonus: drawn from p[γ], the target's "
                "distribution after the last draft, with u[γ].")
    slips = [(np.take_along_axis(drafts, ni[..., 0], -1)[..., 0], ("the rejected draft is not emitted: the token "
              "after n accepted drafts is drawn from the residual max(0, p − q) at position n.")),
             (_draw(p_n, u[..., gamma]), ("on a rejection, draw from the residual max(0, p − q), normalized, not "
                                          "from p: p would count the tokens the draft proposes twice.")),
             (_draw(q_n, u[..., gamma]), "on a rejection, draw from the residual max(0, p − q), not from q."),
             (_draw(res, u_n), "draw the token with u[γ], the last uniform; u[n] already decided the rejection."),
             (unnormed, ("the residual max(0, p − q) sums to less than 1: normalize it (or scale u by its total) "
                         "before the inverse CDF."))]
    for v, h in slips:
        valid = rejected & (v < vocab)
        if valid.any() and np.array_equal(tok[valid], v[valid]) and not np.array_equal(tok[rejected], right[rejected]):
            return h
    return ("after a rejection at position n, the token is the inverse-CDF draw from max(0, p[n] − q[n]) with u[γ]: "
            "the first index whose cumulative weight exceeds u[γ] × the residual's total.")


def _accept_out(task: str, label: str, out, lead: tuple) -> tuple[tuple | None, Result | None]:
    pair, bad = _pair(task, label, out, "n", "token")
    if bad is not None:
        return None, bad
    for name, a in zip(("n", "token"), pair):
        if a.shape != lead:
            return None, Result(False, f"{task} ({label}): {name} has shape {a.shape}, expected {lead}: one per "
                                       "trial (the leading dims of drafts), n the accepted count, token the one "
                                       "that follows them.")
        if a.dtype.kind not in "iu" and not (a.dtype.kind == "f" and np.all(a == np.round(a))):
            return None, Result(False, f"{task} ({label}): {name} should be whole numbers, got {a.dtype}.")
    return tuple(a.astype(np.int64) for a in pair), None


def _trial(i: tuple) -> str:
    return f", trial {list(map(int, i))}" if i else ""


def _first_token_pvalue(fn, task: str) -> tuple[float | None, Result | None]:
    """The chi-square p-value of the first emitted token against p[0], over 20,000 steps with fixed p and q."""
    p = np.array([[0.35, 0.25, 0.2, 0.1, 0.06, 0.04], [0.1, 0.1, 0.2, 0.3, 0.2, 0.1], [1 / 6] * 6])
    q = np.array([[0.1, 0.15, 0.4, 0.05, 0.2, 0.1], [0.3, 0.1, 0.1, 0.1, 0.3, 0.1]])
    rng, trials = np.random.default_rng(77), 20_000
    cdf = np.cumsum(q, -1)
    drafts = np.minimum((cdf[None] < rng.random((trials, 2, 1)) * cdf[None, :, -1:]).sum(-1), 5)
    label = f"{trials:,} steps, γ = 2, fixed p and q"
    out, failed = run_answer(task, label, fn, np.tile(p, (trials, 1, 1)), np.tile(q, (trials, 1, 1)), drafts,
                             rng.random((trials, 3)))
    if failed is not None:
        return None, failed
    got, bad = _accept_out(task, label, out, (trials,))
    if bad is not None:
        return None, bad
    n, tok = got
    if tok.min() < 0 or tok.max() >= 6:
        return None, Result(False, f"{task} ({label}): token {int(tok.max())} is not in the vocabulary (0..5).")
    return chi2_pvalue(np.where(n >= 1, drafts[:, 0], tok), p[0]), None


def check_accept(fn) -> Result:
    """Step 7, accept: `fn(p (..., γ+1, V), q (..., γ, V), drafts (..., γ), u (..., γ+1)) -> (n, token)`, each
    (...), with exactly `engine.speculative.accept`'s contract: drafts[:n] accepted (u[i] · q(x_i) < p(x_i) for
    the leading ones), token drawn by inverse CDF with u[γ] from max(0, p[n] − q[n]) normalized, or from p[γ]
    when n = γ (the bonus).

    Called on five cases (q = p, one step with no leading dims, batches of trials, two leading dims) and
    checked exactly against the engine; then 20,000 steps with fixed p and q: the first emitted token must be
    distributed as p[0] (chi-square p-value > 0.001).
    """
    task = "Step 7 (accept)"
    if not callable(fn):
        return Result(False, f"{task}: write a function accept(p, q, drafts, u) -> (n, token).")
    for (p, q, drafts, u), label in _accept_cases():
        lead, vocab = drafts.shape[:-1], p.shape[-1]
        out, failed = run_answer(task, label, fn, p.copy(), q.copy(), drafts.copy(), u.copy())
        if failed is not None:
            return failed
        got, bad = _accept_out(task, label, out, lead)
        if bad is not None:
            return bad
        n, tok = got
        rn, rtok = (np.asarray(a) for a in engine_accept(p, q, drafts, u))
        if not np.array_equal(n, rn):
            i = np.unravel_index(int(np.argmax(n != rn)), lead) if lead else ()
            hint = _n_hint(p, q, drafts, u, n)
            if np.array_equal(q, p[..., :-1, :]):
                hint = "with q = p, min(1, p(x)/q(x)) = 1: every draft is accepted, n = γ. " + hint
            return Result(False, f"{task} ({label}){_trial(i)}: n = {int(n[i])}, expected {int(rn[i])}. "
                                 f"Hint: {hint}")
        if not np.array_equal(tok, rtok):
            i = np.unravel_index(int(np.argmax(tok != rtok)), lead) if lead else ()
            hint = _token_hint(p, q, drafts, u, rn, tok, vocab)
            if tok.min() < 0 or tok.max() >= vocab:
                hint = f"token {int(tok.max() if tok.max() >= vocab else tok.min())} is outside 0..{vocab - 1}; " + hint
            return Result(False, f"{task} ({label}){_trial(i)}, n = {int(rn[i])}: token {int(tok[i])}, expected "
                                 f"{int(rtok[i])}. Hint: {hint}")
    pvalue, failed = _first_token_pvalue(fn, task)
    if failed is not None:
        return failed
    if pvalue < 1e-3:
        return Result(False, f"{task}: the first emitted token is not distributed as p (chi-square p-value "
                             f"{pvalue:.2g} over 20,000 steps).")
    return Result(True, f"{task}: equal to speculative.accept on {len(_accept_cases())} cases (q = p, one step, "
                        f"batches, two leading dims); over 20,000 steps the first emitted token follows p "
                        f"(chi-square p-value {pvalue:.2f}).")
