"""A model's next-token loss on a token stream: the validation during training, and every perplexity.

Perplexity is exp(mean loss in nats). It is scored on whole windows of `context` tokens fed from an
empty cache, as training saw them, so a trained model and its quantized copies can be compared on the
very same windows.

See chapter: models
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ref_impl.engine.model import Model


def window_losses(model: Model, stream: np.ndarray, context: int, max_tokens: int = 0,
                  batch: int = 16, spread: bool = False) -> np.ndarray:
    """Mean next-token loss (nats) of each non-overlapping window of a token stream: consecutive ones
    from the start, or (spread=True) as many spaced evenly over the whole stream, so a short
    evaluation samples every part of it rather than its first files. Per window, so that two models
    scored on the same windows can be compared pair by pair."""
    n = (min(len(stream) - 1, max_tokens or len(stream))) // context
    if n == 0:
        raise ValueError(f"the stream ({len(stream)} tokens) is shorter than one window ({context})")
    if spread:
        starts = np.linspace(0, (len(stream) - 1) // context - 1, n).astype(np.int64) * context
    else:
        starts = np.arange(n) * context
    losses = []
    for i in range(0, n, batch):
        windows = stream[starts[i:i + batch, None] + np.arange(context + 1)]
        loss = nn.losses.cross_entropy(model(mx.array(windows[:, :-1])), mx.array(windows[:, 1:]))
        losses.append(np.array(loss.astype(mx.float32).mean(axis=1)))
    return np.concatenate(losses)


def mean_loss(model: Model, stream: np.ndarray, context: int, max_tokens: int = 0,
              batch: int = 16, spread: bool = False) -> float:
    """Mean next-token loss (nats) over the windows of `window_losses` (all of one length)."""
    return float(np.mean(window_losses(model, stream, context, max_tokens, batch, spread)))
