"""Build it yourself, steps 4 and 5: the KV cache, the decode loop and the sampler (book/build-it).

Step 4 (book/build-it/04-kv-cache-and-decode): `Cache`, a pre-allocated key/value cache for one layer, is checked
against the engine's `kvcache.KVCache` (same history after every update, offset, buffers allocated once); `decode`,
prefill then one token per forward, runs the shipped model greedily and must give the engine's tokens
(`compose.generate`) with the engine's call pattern (the whole prompt once, then one token per forward).
Step 5 (book/build-it/05-sampling): `sample` draws one token from a row of logits with temperature, top-k and top-p;
its draws under fixed keys are compared with the distribution of `generate.Sampler.probs`, and the usual slips
(top-p's crossing token, temperature after the softmax, ties at the k-th logit, ...) are named when the draws fit
them better. Tests: `pytest tests/test_exercises_build_decode.py -k build_step`.

See chapter: build-decode
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import mlx.core as mx
import numpy as np

from ref_impl import MODELS_DIR
from ref_impl.engine import checkpoint, compose
from ref_impl.engine.generate import Sampler
from ref_impl.engine.kvcache import KVCache
from ref_impl.engine.model import Model
from ref_impl.engine.tokenizer import Tokenizer
from ref_impl.exercises.core import Result, run_answer

CACHE, DECODE, SAMPLE = "Step 4 (Cache)", "Step 4 (decode)", "Step 5 (sample)"

# (batch, n_kv_heads, head_dim, max_size, dtype, lengths of the successive updates)
CACHE_CASES = ((2, 2, 8, 16, "float32", (5, 1, 1)),
               (1, 4, 16, 8, "float16", (3, 4, 1)))        # the last update fills the buffer exactly


def _buffers(cache) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every array the object holds, directly or in a list, tuple or dict attribute."""
    out = {}
    for name, v in getattr(cache, "__dict__", {}).items():
        inner = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, (list, tuple)) else ()
        items = [(name, v)] if isinstance(v, mx.array) else [(f"{name}[{i!r}]", x) for i, x in inner]
        out.update((n, tuple(x.shape)) for n, x in items if isinstance(x, mx.array))
    return out


def _judge_fetch(out, want: tuple[mx.array, mx.array], cache, oracle: KVCache, before: int, L: int,
                 dtype: mx.Dtype) -> str | None:
    """What is wrong with one update_and_fetch (its return value and the cache's offset after it), or None."""
    if not isinstance(out, (tuple, list)) or len(out) != 2 or not all(isinstance(x, mx.array) for x in out):
        return f"update_and_fetch returned {type(out).__name__}; return a pair (keys, values) of mx.arrays."
    offset = getattr(cache, "offset", None)
    if offset != oracle.offset:
        if offset == before:
            return f"offset is still {before} after storing {L} positions: offset not advanced (add L after writing)."
        return f"offset is {offset!r} after storing {L} positions at offset {before}; expected {oracle.offset}."
    keys, values = out
    shape = want[0].shape
    if tuple(keys.shape) != tuple(shape) or tuple(values.shape) != tuple(shape):
        got = keys.shape[2] if keys.ndim == 4 else None
        if got == L and before > 0:
            return (f"keys of shape {tuple(keys.shape)}: the cache returns only the new keys; return the whole "
                    f"history, the first offset + L = {before + L} positions (attention needs every earlier key).")
        if got == oracle.max_size:
            return (f"keys of shape {tuple(keys.shape)}: that is the whole buffer, unwritten slots included; "
                    f"return the filled part, keys[:, :, :offset].")
        return (f"keys of shape {tuple(keys.shape)}, values {tuple(values.shape)}; expected {tuple(shape)} "
                "(B, Hkv, offset, D).")
    if keys.dtype != dtype or values.dtype != dtype:
        return f"history in {keys.dtype}/{values.dtype}; the cache was made for {dtype}: allocate the buffers in it."
    got_k, got_v, want_k, want_v = (np.array(x.astype(mx.float32)) for x in (keys, values, *want))
    if np.array_equal(got_k, want_k) and np.array_equal(got_v, want_v):
        return None
    if np.array_equal(got_k, want_v) and np.array_equal(got_v, want_k):
        return "keys and values are swapped: return (keys, values)."
    t = int(np.flatnonzero(np.any(got_k != want_k, axis=(0, 1, 3)) | np.any(got_v != want_v, axis=(0, 1, 3)))[0])
    return (f"position {t} of the history differs from what was stored there: write the new L positions at slots "
            f"offset .. offset + L - 1, then advance offset.")


def _check_cache_case(cls, case) -> Result | None:
    B, H, D, size, dname, lengths = case
    dtype, label = getattr(mx, dname), f"batch {B}, {H} KV heads, head_dim {D}, max_size {size}, {dname}"
    cache, failed = run_answer(CACHE, label, cls, B, H, D, size, dtype)
    if failed is not None:
        return failed
    if getattr(cache, "offset", None) != 0 or getattr(cache, "attends", None) != "dense":
        return Result(False, f"{CACHE} ({label}): a new cache has offset 0 (an int: positions held) and "
                             f"attends = \"dense\" (Attention reads both); got offset {getattr(cache, 'offset', None)!r}, "
                             f"attends {getattr(cache, 'attends', None)!r}.")
    held = {n: s for n, s in _buffers(cache).items() if len(s) >= 4 and s[-2] == size}   # (..., max_size, D)
    if not held:
        return Result(False, f"{CACHE} ({label}): no buffer with room for max_size = {size} positions after __init__: "
                             f"allocate keys and values once, mx.zeros((B, Hkv, max_size, D), dtype). A cache that grows "
                             "(concatenating each step's keys) allocates and copies the whole history every token.")
    oracle, rng = KVCache(B, H, D, size, dtype), np.random.default_rng(size)
    for step, L in enumerate(lengths):
        k, v = (mx.array(rng.normal(size=(B, H, L, D)).astype(np.float32)).astype(dtype) for _ in range(2))
        before = oracle.offset
        where = f"{label}; update {step + 1}: L = {L} at offset {before}"
        out, failed = run_answer(CACHE, where, cache.update_and_fetch, k, v)
        if failed is not None:
            return failed
        wrong = _judge_fetch(out, oracle.update_and_fetch(k, v), cache, oracle, before, L, dtype)
        if wrong is not None:
            return Result(False, f"{CACHE} ({where}): {wrong}")
        now = _buffers(cache)
        moved = [n for n in held if now.get(n) != held[n]]
        if moved:
            return Result(False, f"{CACHE} ({where}): buffer {moved[0]} is now {now.get(moved[0])}, allocated as "
                                 f"{held[moved[0]]}: write into the allocated slots (keys[:, :, offset:offset + L] = k) "
                                 "instead of re-creating or growing it.")
    return None


def check_cache(cls) -> Result:
    """Step 4: `Cache(batch, n_kv_heads, head_dim, max_size, dtype)`, with `offset` (int), `attends = "dense"` and
    `update_and_fetch(k, v) -> (keys, values)`: k, v (B, Hkv, L, D) stored at the next L slots of buffers allocated
    once in __init__, the whole history (B, Hkv, offset + L, D) returned. Two caches (float32 and float16, the second
    filled to max_size) get updates of L = 5, 1, 1 and 3, 4, 1, each compared with `kvcache.KVCache`."""
    for case in CACHE_CASES:
        failed = _check_cache_case(cls, case)
        if failed is not None:
            return failed
    return Result(True, f"{CACHE}: the same history as the engine's KVCache after {sum(len(c[5]) for c in CACHE_CASES)} "
                        f"updates in {len(CACHE_CASES)} caches, offsets right, buffers allocated once.")


@functools.lru_cache(maxsize=1)
def shipped() -> tuple[Model, Tokenizer]:
    """The shipped model (float32) and its tokenizer, loaded once."""
    return checkpoint.load(MODELS_DIR / "stdlib-10m.gguf", mx.float32)


@functools.lru_cache(maxsize=8)
def greedy_tokens(prompt: tuple[int, ...], n: int) -> tuple[int, ...]:
    """The engine's n greedy tokens after the prompt (compose.generate, EOS ignored)."""
    model, tok = shipped()
    return tuple(compose.generate(model, tok, list(prompt), n, stop_at_eos=False).tokens)


class CountingModel:
    """The model, recording the shape of the tokens and the cache of each call."""

    def __init__(self, model: Model):
        self.model, self.calls = model, []

    def __call__(self, tokens, cache=None):
        self.calls.append((tuple(getattr(tokens, "shape", ())), cache))
        return self.model(tokens, cache)

    def __getattr__(self, name):
        return getattr(self.model, name)


def decode_cases() -> list[tuple[list[int], int, str]]:
    """(prompt ids, n, label) of the decode check: a code prompt, BOS alone, and n = 1."""
    _, tok = shipped()
    code, imp = tok.encode("def main(args):\n    ", bos=True), tok.encode("import os\n", bos=True)
    return [(code, 10, f"a {len(code)}-token prompt, 10 tokens"), ([tok.bos_id], 5, "BOS alone, 5 tokens"),
            (imp, 1, f"a {len(imp)}-token prompt, 1 token")]


def _calls_wrong(calls: list, L: int, n: int | None, right_tokens: bool) -> str | None:
    """What is wrong with the forwards decode made (prompt once, then one token each; n of them, or one more,
    unless n is None), or None."""
    if not calls:
        return "decode never called the model."
    if any(c is None for _, c in calls):
        return "a forward got no cache: pass the cache list to every call, model(tokens, cache)."
    if any(c is not calls[0][1] for _, c in calls):
        return "the forwards got different caches: call make_cache() once and pass the same list at every step."
    shapes = [s for s, _ in calls]
    if shapes[0] != (1, L):
        if L > 1 and all(s == (1, 1) for s in shapes):
            return (f"the prompt went in one token at a time ({L} forwards before the first new token)"
                    f"{', and your tokens are right' if right_tokens else ''}: prefill it in one forward, "
                    f"model(mx.array([prompt]), cache). One pass reads every weight once for all {L} positions; "
                    f"{L} passes read them {L} times, and that wait is the time to first token.")
        return f"the first forward got tokens of shape {shapes[0]}; prefill the whole prompt at once, shape (1, {L})."
    longer = [(i, s) for i, s in enumerate(shapes[1:], 1) if s != (1, 1)]
    if longer:
        i, s = longer[0]
        return (f"forward {i + 1} got tokens of shape {s}: after the prefill feed only the new token, shape (1, 1); "
                "the cache holds the rest (re-running the sequence costs a prefill per token).")
    if n is not None and len(calls) not in (n, n + 1):
        return f"{len(calls)} forwards for {n} tokens: the prefill gives the first token, then one forward per token."
    return None


def _tokens_wrong(tokens: list[int], want: tuple[int, ...], prompt: list[int], n: int) -> str | None:
    """What is wrong with the returned ids (count, then the first that differs), or None."""
    if len(tokens) != n:
        slips = {n - 1: "one token short (off by one in n)", n + 1: "one token too many (off by one in n)",
                 len(prompt) + n: "the prompt came back too: return only the n generated ids"}
        return f"{len(tokens)} ids for n = {n}: {slips.get(len(tokens), f'return exactly n = {n} generated ids')}."
    if tuple(tokens) == want:
        return None
    i = next(j for j, (a, b) in enumerate(zip(tokens, want)) if a != b)
    model, _ = shipped()
    if i == 0 and len(prompt) > 1 and tokens[0] == int(mx.argmax(model(mx.array([prompt]))[0, 0])):
        return (f"the first token is {tokens[0]}, the engine's {want[0]}: that is the prediction after the prompt's "
                "first position (logits[0, 0]); the next token comes from the last position, logits[0, -1].")
    agree = " (those before it agree)" if i else ""
    return (f"token {i} is {tokens[i]}, the engine's greedy decoding gives {want[i]}{agree}: "
            "sample the first token from the prefill's last position, then feed each sampled token back alone, "
            "model(mx.array([[token]]), cache), with the same cache.")


def _decode_case(fn: Callable, cache_cls, prompt: list[int], n: int, label: str) -> Result:
    model, _ = shipped()
    a, vocab = model.args, model.args.vocab_size
    counting, rows = CountingModel(model), []

    def make_cache():
        return [cache_cls(1, a.num_key_value_heads, a.head_dim, len(prompt) + n, mx.float32)
                for _ in range(a.num_hidden_layers)]

    def greedy(row):
        rows.append(tuple(getattr(row, "shape", ())))
        return int(mx.argmax(row))

    out, failed = run_answer(DECODE, label, fn, counting, list(prompt), n, make_cache, greedy)
    if failed is not None:   # a crash after forwards of the wrong shape (a full cache, say): name the shape
        wrong = _calls_wrong(counting.calls, len(prompt), None, False) if counting.calls else None
        return failed if wrong is None else \
            Result(False, f"{DECODE} ({label}): {wrong} (Then {failed.message.split('): ', 1)[-1]})")
    if any(s != (vocab,) for s in rows):
        s = next(s for s in rows if s != (vocab,))
        return Result(False, f"{DECODE} ({label}): sample got logits of shape {s}; it takes one row, shape (V,) = "
                             f"({vocab},): the batch's only row at the last position, logits[0, -1].")
    try:
        tokens = [int(t) for t in out]
    except (TypeError, ValueError):
        return Result(False, f"{DECODE} ({label}): expected a list of token ids (ints), got {type(out).__name__}.")
    want = greedy_tokens(tuple(prompt), n)
    # the count first (a wrong count makes the forwards look wrong too), then the forwards, then the ids
    wrong = (_tokens_wrong(tokens, want, prompt, n) if len(tokens) != n else None) \
        or _calls_wrong(counting.calls, len(prompt), n, tuple(tokens) == want) or _tokens_wrong(tokens, want, prompt, n)
    if wrong:
        return Result(False, f"{DECODE} ({label}): {wrong}")
    calls = len(counting.calls)
    return Result(True, f"{label}: {calls} forward{'s' if calls > 1 else ''}" + ("*" if calls == n + 1 else ""))


def check_decode(fn, cache=None) -> Result:
    """Step 4: `decode(model, prompt, n, make_cache, sample) -> list[int]`: prefill the prompt (a list of ids) in one
    forward `model(tokens (1, L), cache)` with `cache = make_cache()`, draw each token with `sample(logits_row)` from
    the last position's logits (V,), then feed one token per forward; return the n new ids. Runs the shipped model
    greedily on three prompts with `cache` (default the engine's KVCache; pass your Cache class to run it) and
    compares with `compose.generate` and with the engine's call pattern."""
    if cache is not None:
        own = check_cache(cache)
        if not own:
            return Result(False, f"{DECODE} with your Cache: the Cache fails its own check first. {own.message}")
    notes = []
    for prompt, n, label in decode_cases():
        result = _decode_case(fn, cache or KVCache, prompt, n, label)
        if not result:
            return result
        notes.append(result.message)
    which = "your Cache" if cache is not None else "the engine's KVCache"
    extra = " (*note: one forward more than needed: the last one's logits go unused; stop after the n-th token)" \
        if any(m.endswith("*") for m in notes) else ""
    return Result(True, f"{DECODE}: the engine's greedy tokens on the shipped model, through {which}; "
                        + "; ".join(notes) + "." + extra)


# ---- Step 5: sampling -------------------------------------------------------------------------------------------

DRAWS = 250          # draws per setting
P_VALUE = 1e-7       # a frequency is off when its exact binomial p-value is below this: over the check's ~50
                     # comparisons a right sampler fails by chance less than once in 10^5, whatever its random stream
A = (1.2, -0.3, 2.0, 0.4, -1.0, 0.9, -2.0, 0.0)
B = (0.3, 2.1, -1.2, 1.6, 0.9, -0.4, 1.1, -2.5)
C = (0.8, -0.6, 1.9, 0.2, 1.4, -1.8, 0.5, -0.1)
E = (0.47, 1.39, 0.19, 1.80, 0.70, 0.27, 0.88, 0.41)   # top-k 4 binds; top-p after renormalising would cut 2
TIES = (1.0, -1.0, 2.0, 0.0, 1.0, -0.5, 1.0, -2.0)   # top-k 2: the top token and one of three tied at 1.0
# (temperature, top_k, top_p, logits, label)
SETTINGS = ((1.0, 0, 1.0, A, "temperature 1, no cut"), (0.5, 0, 1.0, A, "temperature 0.5"),
            (1.0, 3, 1.0, B, "top-k 3"), (1.0, 0, 0.6, B, "top-p 0.6"), (2.0, 0, 0.8, C, "temperature 2, top-p 0.8"),
            (1.0, 4, 0.66, E, "top-k 4 and top-p 0.66"), (1.0, 2, 1.0, TIES, "top-k 2, three logits tied"))


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def slipped(logits, T: float, k: int, p: float, slip: str) -> np.ndarray:
    """The distribution a sampler with one named slip draws from (numpy; the oracle is Sampler.probs)."""
    l = np.asarray(logits, np.float64)
    t = l * T if slip == "multiply" else l if slip == "no_temperature" else l / T
    rank, keep = np.argsort(-t, kind="stable"), np.ones(l.size, bool)
    if k:
        if slip == "keep_ties":
            keep &= t >= t[rank[k - 1]]
        else:
            first = np.argsort(t, kind="stable") if slip == "ascending" else rank
            keep &= np.isin(np.arange(l.size), first[:k + {"k_plus": 1, "k_minus": -1}.get(slip, 0)])
    if p < 1.0:
        probs = _softmax(l if slip == "raw_mass" else t)
        if slip == "renorm_after_k":
            probs = np.where(keep, probs, 0.0) / probs[keep].sum()
        order = np.arange(l.size) if slip == "vocab_order" else rank
        mass = np.cumsum(probs[order])
        kept = mass <= p if slip == "drop_crossing" else mass - probs[order] < p
        keep &= np.isin(np.arange(l.size), order[kept])
    if not keep.any():
        return np.zeros(l.size)
    if slip == "zero_fill":
        return _softmax(np.where(keep, t, 0.0))
    q = _softmax(np.where(keep, t, -np.inf))
    if slip == "probs_as_logits":
        return _softmax(q)
    return _softmax(np.where(keep, q, -np.inf)) if slip == "kept_probs_as_logits" else q


SLIPS = {
    "no_temperature": "the temperature has no effect on your draws: divide the logits by T before the softmax "
                      "(probabilities divided by T after it are renormalised back).",
    "multiply": "logits multiplied by T: divide them by the temperature (T < 1 sharpens, T > 1 flattens).",
    "probs_as_logits": "probabilities passed to mx.random.categorical, which takes logits (log-probabilities, "
                       "renormalised for you): pass the masked logits, or mx.log of the probabilities.",
    "zero_fill": "cut tokens masked with 0 instead of -inf: a logit of 0 still has weight e^0; use -mx.inf.",
    "drop_crossing": "top-p dropped the token that crosses top_p: keep a token when the mass strictly before it is "
                     "below top_p, so the token that reaches top_p stays (the engine's rule).",
    "vocab_order": "top-p mass summed in vocabulary order: sort the tokens most likely first, then take the "
                   "cumulative sum.",
    "raw_mass": "top-p measured on the probabilities before temperature: measure it on softmax(logits / T).",
    "renorm_after_k": "top-p measured after the top-k cut and renormalising (llama.cpp's chain): here both cuts "
                      "read the same full distribution softmax(logits / T), and a token must pass both.",
    "keep_ties": "top-k kept every token tied with the k-th logit: keep exactly top_k tokens (sort, take the first k).",
    "k_plus": "top-k kept top_k + 1 tokens: keep exactly top_k.",
    "k_minus": "top-k kept top_k - 1 tokens: keep exactly top_k.",
    "ascending": "top-k kept the least likely tokens: sort most likely first (argsort of -logits).",
}
SLIPS["kept_probs_as_logits"] = SLIPS["probs_as_logits"]   # the cut tokens masked with -inf, the rest as probabilities


def buckets(logits) -> list[np.ndarray]:
    """Token ids grouped by equal logits: a tie may keep either member, so frequencies are compared per group."""
    l = np.asarray(logits)
    return [np.flatnonzero(l == v) for v in np.unique(l)]


def _as_token(out, vocab: int) -> tuple[int | None, str | None]:
    """The learner's token as an int in range, or what is wrong with it."""
    if isinstance(out, (bool, np.bool_)) or not isinstance(out, (int, np.integer)):
        return None, (f"expected a token id, a Python int (int(...) of the drawn array), got "
                      f"{type(out).__name__} {out!r:.60}.")
    if not 0 <= int(out) < vocab:
        return None, (f"token id {int(out)} is outside the vocabulary 0..{vocab - 1}: an index past the end (kept "
                      "probabilities that do not sum to 1? let mx.random.categorical draw, it renormalises).")
    return int(out), None


def _check_greedy(fn) -> Result | None:
    rng = np.random.default_rng(5)
    for i, (k, p) in enumerate(((0, 1.0), (0, 1.0), (5, 0.5))):
        row = mx.array(rng.normal(size=64).astype(np.float32))
        label = f"temperature 0, top-k {k}, top-p {p:g}, key None"
        out, failed = run_answer(SAMPLE, label, fn, row, 0.0, k, p, None)
        if failed is not None:
            return failed if "not written yet" in failed.message else Result(False, failed.message + (
                " Temperature 0 is greedy: return the argmax before dividing by T or using the key "
                "(the finale passes key=None)."))
        tok, bad = _as_token(out, 64)
        if bad is not None:
            return Result(False, f"{SAMPLE} ({label}): {bad}")
        if tok != int(mx.argmax(row)):
            return Result(False, f"{SAMPLE} ({label}): token {tok}, not the argmax {int(mx.argmax(row))}: temperature 0 "
                                 "is greedy, int(mx.argmax(logits)), whatever top_k and top_p say.")
    return None


def _check_same_key(fn) -> Result | None:
    row = mx.zeros((16,))
    for key in mx.random.split(mx.random.key(7), 4):
        label = "temperature 1, 16 equal logits, one key twice"
        (a, failed), (b, _) = (run_answer(SAMPLE, label, fn, row, 1.0, 0, 1.0, key) for _ in range(2))
        if failed is not None:
            return failed
        if a != b:
            return Result(False, f"{SAMPLE} ({label}): tokens {a!r} and {b!r} from the same key: draw with the key you "
                                 "are given, mx.random.categorical(..., key=key), not MLX's global random state.")
    return None


@functools.lru_cache(maxsize=4)
def log_choose(n: int) -> np.ndarray:
    """log C(n, k) for k = 0..n."""
    return np.array([math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) for k in range(n + 1)])


def binomial_p_value(c: int, n: int, P: float) -> float:
    """Two-sided exact binomial p-value of c successes in n draws of probability P."""
    if P <= 0.0 or P >= 1.0:
        return float(c == round(n * P))
    ks = np.arange(n + 1)
    pmf = np.exp(log_choose(n) + ks * math.log(P) + (n - ks) * math.log1p(-P))
    return float(min(1.0, 2 * min(pmf[:c + 1].sum(), pmf[c:].sum())))


def _fit(counts: np.ndarray, probs: np.ndarray, groups: list[np.ndarray]) -> str | None:
    """Why the draws do not fit `probs` (a drawn token it never draws, or a frequency whose binomial p-value is
    below P_VALUE), or None."""
    n = counts.sum()
    for g in groups:
        drawn, allowed = np.count_nonzero(counts[g]), np.count_nonzero(probs[g] > 0)
        if drawn > allowed:
            t = int(g[np.argmax(counts[g])]) if not allowed else [int(x) for x in g]
            return (f"token {t} was drawn {int(counts[g].max())} times; the engine never draws it (top-k/top-p cut "
                    "it: probability 0)." if not allowed else
                    f"tokens {t}, tied, were drawn {drawn} different ways; the engine keeps {allowed} of them.")
        P, c = float(probs[g].sum()), int(counts[g].sum())
        if binomial_p_value(c, int(n), P) < P_VALUE:
            f = c / n
            what = f"token {int(g[0])}" if len(g) == 1 else f"tokens {[int(x) for x in g]} (tied)"
            return f"{what} drawn {f:.1%} of {n} times; the engine's probability is {P:.1%}."
    return None


def _log_likelihood(counts: np.ndarray, probs: np.ndarray, groups: list[np.ndarray]) -> float:
    return float(sum(counts[g].sum() * np.log(max(probs[g].sum(), 1e-12)) for g in groups))


def _check_setting(fn, setting, seed: int) -> Result | None:
    T, k, p, logits, label = setting
    row = mx.array(np.array(logits, np.float32))
    counts = np.zeros(row.size, np.int64)
    for key in mx.random.split(mx.random.key(seed), DRAWS):
        out, failed = run_answer(SAMPLE, label, fn, row, T, k, p, key)
        if failed is not None:
            return failed
        tok, bad = _as_token(out, row.size)
        if bad is not None:
            return Result(False, f"{SAMPLE} ({label}): {bad}")
        counts[tok] += 1
    right = np.array(Sampler(T, k, p).probs(row), dtype=np.float64)
    groups = buckets(logits)
    miss = _fit(counts, right, groups)
    if miss is None:
        return None
    fits = [(_log_likelihood(counts, q, groups), slip) for slip in SLIPS         # the slips the draws fit
            if not np.allclose(q := slipped(logits, T, k, p, slip), right, atol=1e-6) and _fit(counts, q, groups) is None]
    if not fits and np.count_nonzero(counts) == 1 and right.max() < 0.9:
        return Result(False, f"{SAMPLE} ({label}): every draw gave token {int(np.argmax(counts))}: draw with the key "
                             "you are given, mx.random.categorical(..., key=key).")
    hint = SLIPS[max(fits)[1]] if fits else (
        "temperature 0: argmax; else softmax(logits / T); keep the top_k most likely (0: all) and the tokens whose "
        "mass strictly before them is below top_p; -inf for the rest; one draw, mx.random.categorical(..., key=key).")
    return Result(False, f"{SAMPLE} ({label}, {DRAWS} draws with fixed keys): {miss} Hint: {hint}")


def check_sample(fn) -> Result:
    """Step 5: `sample(logits, temperature, top_k, top_p, key) -> int` for one row of logits (V,): temperature 0
    gives the argmax (key None allowed); else one draw with `mx.random.categorical(..., key=key)` from
    softmax(logits / T) cut to the top_k most likely (0: all) and to the tokens whose mass strictly before them is
    below top_p (1.0: all). Checks greedy exactness, one token per key, and the frequencies of 250 draws with fixed
    keys in each of seven settings against `generate.Sampler.probs` (exact binomial p-value above 1e-7)."""
    for check in (_check_greedy, _check_same_key):
        failed = check(fn)
        if failed is not None:
            return failed
    for seed, setting in enumerate(SETTINGS):
        failed = _check_setting(fn, setting, seed)
        if failed is not None:
            return failed
    return Result(True, f"{SAMPLE}: greedy exact, one token per key, and the engine's distribution in "
                        f"{len(SETTINGS)} settings, {DRAWS} draws each: {'; '.join(s[4] for s in SETTINGS)}.")
