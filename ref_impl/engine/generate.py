"""Generation: prefill the prompt, then decode one token at a time.

Two phases with different costs. *Prefill* runs the prompt through the model in forwards of
PREFILL_CHUNK positions (a matrix-matrix product per weight: compute-bound; chunks bound its
memory, see prefill_hidden); its end is the time to first token (TTFT). *Decode* then feeds one token per forward (a matrix-vector product per weight:
every weight is read from memory for one token, so it is bandwidth-bound); the gaps between
tokens are the inter-token latencies (ITL).

MLX is lazy: `model(...)` only builds a graph, and `mx.eval` runs it. The plain loop
evaluates each token and reads it back (`.item()`), so the host waits while the device
computes. With `pipeline=True` the graph of step t+1 is queued with `mx.async_eval` before
step t's token is read, so building the next graph overlaps the current computation
(the dispatch chapter measures what that buys). Both give identical tokens. The loop that
composes this one with every other technique, and streams text, is compose.py's `generate`.

See chapter: dispatch
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import mlx.core as mx

from ref_impl.engine.kvcache import Cache, KVCache, StepCache
from ref_impl.engine.model import Model


@dataclass
class Sampler:
    """How the next token is chosen from logits: greedy when temperature == 0."""
    temperature: float = 0.0
    top_k: int = 0          # 0: no top-k cut
    top_p: float = 1.0      # 1.0: no nucleus cut
    seed: int = 0

    def __post_init__(self):
        bad = [f"{name}={value} (must be {rule})" for name, value, rule, ok in [
            ("temperature", self.temperature, ">= 0", self.temperature >= 0),
            ("top_k", self.top_k, ">= 0", self.top_k >= 0),
            ("top_p", self.top_p, "in (0, 1]", 0.0 < self.top_p <= 1.0)] if not ok]
        if bad:
            raise ValueError("invalid sampling settings: " + ", ".join(bad))
        self._key = mx.random.key(self.seed)

    def _ranked(self, logits: mx.array) -> tuple[mx.array, mx.array]:
        """(order, ranked): the vocabulary sorted most likely first, and the tempered logits in that
        order with the tokens top-k/top-p cut set to -inf."""
        logits = logits.astype(mx.float32) / self.temperature
        order = mx.argsort(-logits, axis=-1)                     # most likely first
        ranked = mx.take_along_axis(logits, order, axis=-1)
        keep = mx.ones(ranked.shape, dtype=mx.bool_)
        if self.top_k:
            keep = keep & (mx.arange(ranked.shape[-1]) < self.top_k)
        if self.top_p < 1.0:
            probs = mx.softmax(ranked, axis=-1)
            # keep a token if the mass strictly before it is below top_p (the first always stays)
            keep = keep & (mx.cumsum(probs, axis=-1) - probs < self.top_p)
        return order, mx.where(keep, ranked, -mx.inf)

    def __call__(self, logits: mx.array) -> mx.array:
        """Pick one token id per row of logits (B, V) -> (B,), without a host sync."""
        if self.temperature == 0:
            return mx.argmax(logits, axis=-1)
        self._key, key = mx.random.split(self._key)
        if self.top_k == 0 and self.top_p == 1.0:
            return mx.random.categorical(logits.astype(mx.float32) / self.temperature, key=key)
        order, ranked = self._ranked(logits)
        choice = mx.random.categorical(ranked, key=key)
        return mx.take_along_axis(order, choice[..., None], axis=-1)[..., 0]

    def probs(self, logits: mx.array) -> mx.array:
        """The distribution __call__ draws from, (..., V) -> (..., V): one-hot at the argmax when greedy.
        Speculative decoding's acceptance rule needs it."""
        if self.temperature == 0:
            return (mx.arange(logits.shape[-1]) == mx.argmax(logits, axis=-1, keepdims=True)).astype(mx.float32)
        if self.top_k == 0 and self.top_p == 1.0:
            return mx.softmax(logits.astype(mx.float32) / self.temperature, axis=-1)
        order, ranked = self._ranked(logits)
        return mx.take_along_axis(mx.softmax(ranked, axis=-1), mx.argsort(order, axis=-1), axis=-1)  # vocab order


PREFILL_CHUNK = 512   # prompt positions a prefill pass runs at once


def check_chunk(chunk: int) -> None:
    """Refuse a prefill chunk of fewer than one position (ValueError)."""
    if chunk < 1:
        raise ValueError(f"the prefill chunk must be at least 1 position, got {chunk}")


def check_room(prompt_len: int, max_tokens: int, context: int, reserve: int = 0, why: str = "") -> None:
    """Refuse max_tokens < 1, or a generation whose cache (prompt + max_tokens + reserve positions, the
    reserve being what a verification writes past the tokens, named by `why`) outgrows `context`."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    if prompt_len + max_tokens + reserve > context:
        extra = f" + {why} ({reserve})" if reserve else ""
        raise ValueError(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}){extra} exceeds the "
                         f"model's context length ({context})")


def prefill_hidden(model: Model, tokens: mx.array, cache: list[Cache], chunk: int = PREFILL_CHUNK) -> mx.array:
    """Run the prompt (B, L) into the cache; return the last position's hidden state (B, hidden_size).

    All positions but the last go through `chunk` at a time, and each chunk is evaluated as far as the cache
    only: its keys and values are computed, while the last layer's attention output and MLP, which nothing
    reads, never run (MLX evaluates only what an evaluated array depends on, as mlx-lm's prefill does). A pass
    then holds activations and attention scores for `chunk` positions (chunk x context scores a head),
    whatever the prompt's length. The last position runs alone, through every layer, for the head.
    """
    if tokens.shape[1] == 0:
        raise ValueError("the prompt is empty: give at least one token (e.g. BOS)")
    check_chunk(chunk)
    for start in range(0, tokens.shape[1] - 1, chunk):
        model.hidden(tokens[:, start:min(start + chunk, tokens.shape[1] - 1)], cache)
        mx.eval([b for c in cache for b in c.buffers()])   # the chunk is in the cache: its graph can go
    return model.hidden(tokens[:, -1:], cache)[:, -1, :]


def prefill(model: Model, tokens: mx.array, cache: list[Cache], chunk: int = PREFILL_CHUNK) -> mx.array:
    """Run the prompt (B, L) through the model, filling the cache; return the last logits (B, V). The LM
    head reads the last position only: a prompt's logits would be L x vocab_size floats (2.1 GB for 4,096
    tokens of a 128k vocabulary), of which generation needs one row."""
    return model.logits(prefill_hidden(model, tokens, cache, chunk))


def decode_one_token(model: Model, token: mx.array, cache: list[Cache]) -> mx.array:
    """One decode step: token (B,) -> logits (B, V) for the next position."""
    return model(token[:, None], cache)[:, -1, :]


def compiled_decoder(model: Model, cache: list[KVCache]) -> Callable[[mx.array], mx.array]:
    """decode_one_token(model, token, cache) as one mx.compile'd graph, for pre-allocated KVCaches: traced at
    the first call and replayed at every position after it, so a step's Python runs once, not once a token
    (the writing-a-kernel chapter times its host work against Python's). Writes the buffers and offsets as
    decode_one_token would."""
    if any(type(c) is not KVCache for c in cache):
        raise ValueError("a compiled decode step needs the pre-allocated float KVCache (model.make_cache)")

    def step(token: mx.array, pos: mx.array, *buffers: mx.array) -> list[mx.array]:
        layers = [StepCache(buffers[i], buffers[i + 1], pos) for i in range(0, len(buffers), 2)]
        logits = model(token[:, None], layers)[:, -1, :]
        return [logits, *(b for c in layers for b in (c.keys, c.values))]

    compiled = mx.compile(step)

    def decode(token: mx.array) -> mx.array:
        if cache[0].offset >= cache[0].max_size:
            raise ValueError(f"KV cache full: {cache[0].max_size} positions allocated")
        buffers = (b for c in cache for b in (c.keys, c.values))
        out = compiled(token, mx.array(cache[0].offset, dtype=mx.int32), *buffers)
        for i, c in enumerate(cache):
            c.keys, c.values = out[1 + 2 * i], out[2 + 2 * i]
            c.offset += 1
        return out[0]
    return decode


def decoder(model: Model, cache: list[Cache], compiled: bool = False) -> Callable[[mx.array], mx.array]:
    """The decode step for `cache`, token (B,) -> logits (B, V): decode_one_token, or compiled_decoder."""
    return compiled_decoder(model, cache) if compiled else lambda t: decode_one_token(model, t, cache)


def generate_step(model: Model, prompt: list[int], sampler: Sampler, cache: list[Cache],
                  pipeline: bool = False, compiled: bool = False, chunk: int = PREFILL_CHUNK) -> Iterator[int]:
    """Yield token ids one at a time, forever; the caller stops it. compiled: decode through
    compiled_decoder (the prompt itself runs uncompiled, `chunk` positions a pass)."""
    step = decoder(model, cache, compiled)
    y = sampler(prefill(model, mx.array([prompt], dtype=mx.int32), cache, chunk))
    mx.async_eval(y)
    while True:
        next_y = sampler(step(y))
        if pipeline:
            mx.async_eval(next_y)   # queue step t+1 before waiting on step t
        yield y.item()
        y = next_y
