"""A model's next-token loss on a token stream: the validation during training, and every perplexity.

Perplexity is exp(mean loss in nats). It is scored on whole windows of `context` tokens fed from an
empty cache, as training saw them, so a trained model and its quantized copies can be compared on the
very same windows.

The held-out perplexity every page reports has one definition, `perplexity(heldout_losses(...))`: every
window of the model's own context over the whole held-out stream (the training log's number is the same one). A sample
of the windows is another quantity: on the shipped model one window's loss spreads by ~0.7 nats, so 8 or 32
windows land 10-20% from the whole text's perplexity. A sample is for paired comparisons (two weight formats
or caches on the same windows) and quick runs; its records say how many tokens it scored.

See chapter: kquants
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ref_impl.engine.model import Model


def window_starts(stream: np.ndarray, context: int, max_tokens: int = 0, spread: bool = False) -> np.ndarray:
    """Start of each non-overlapping window of `context` tokens (plus the next one, the last target): every
    window from the start (max_tokens 0), else max_tokens // context of them, consecutive from the start or
    (spread=True) spaced evenly over the whole stream, so a short evaluation samples every part of it rather
    than its first files."""
    n = (min(len(stream) - 1, max_tokens or len(stream))) // context
    if n == 0:
        raise ValueError(f"the stream ({len(stream)} tokens) is shorter than one window ({context})")
    if spread:
        return np.linspace(0, (len(stream) - 1) // context - 1, n).astype(np.int64) * context
    return np.arange(n) * context


def window_losses(model: Model, stream: np.ndarray, context: int, max_tokens: int = 0, batch: int = 16,
                  spread: bool = False, scheme: str | None = None, chunk: int = 64, **params) -> np.ndarray:
    """Mean next-token loss (nats) of each window of `window_starts`. Per window, so that two models scored
    on the same windows can be compared pair by pair.

    With a KV-cache `scheme` ("float", "sym8", ...; params go to it), each window goes through
    `model(tokens, cache)` in chunks of `chunk` tokens: chunk k attends to the cache's (dequantized) copy of
    chunks 0..k, its own keys included, as a decode step reads its own token's keys from the cache. `chunk=1`
    is token-by-token decoding; larger chunks are a chunked prefill, faster and identical for the per-token
    schemes, while KIVI's float window and OutlierKVCache's calibration (on the first chunk) see chunk-sized
    steps. Without a scheme a window is one forward with no cache."""
    starts = window_starts(stream, context, max_tokens, spread)
    losses = []
    for i in range(0, len(starts), batch):
        rows = stream[starts[i:i + batch, None] + np.arange(context + 1)]
        x, y = mx.array(rows[:, :-1]), mx.array(rows[:, 1:])
        if scheme is None:
            loss = nn.losses.cross_entropy(model(x).astype(mx.float32), y)
        else:
            caches = model.make_cache(context, len(rows), scheme, **params)
            loss = mx.concatenate([nn.losses.cross_entropy(model(x[:, s:s + chunk], caches).astype(mx.float32),
                                                           y[:, s:s + chunk]) for s in range(0, context, chunk)],
                                  axis=1)
        losses.append(np.array(loss.mean(axis=1)))
    return np.concatenate(losses)


def mean_loss(model: Model, stream: np.ndarray, context: int, max_tokens: int = 0,
              batch: int = 16, spread: bool = False) -> float:
    """Mean next-token loss (nats) over the windows of `window_losses` (all of one length)."""
    return float(np.mean(window_losses(model, stream, context, max_tokens, batch, spread)))


def heldout_losses(model: Model, stream: np.ndarray, max_tokens: int = 0, context: int = 0,
                   scheme: str | None = None, **params) -> np.ndarray:
    """The held-out evaluation, per window: the mean loss of every window of the model's own context
    (`context` 0) over the held-out stream, or of a sample of max_tokens of it spread evenly (the same windows
    for every model and cache, for paired comparisons); through a KV cache of `scheme` when given
    (`window_losses`). Its windows hold len(result) x context tokens."""
    context = context or model.args.max_position_embeddings
    return window_losses(model, stream, context, max_tokens, spread=True, scheme=scheme, **params)


def perplexity(losses: np.ndarray) -> float:
    """exp of the mean loss (nats) over windows of one length: the perplexity of `heldout_losses`."""
    return math.exp(float(np.mean(losses)))
