"""The one training loop: AdamW on a schedule, periodic evaluation, the best evaluation's weights kept.

The course trains two things: its models (training/models.py) and MTP heads on a frozen model
(training/heads.py). Both run this loop; each brings its own loss, batches and evaluation. One
step is compiled with its optimizer state (`mx.compile` with the state as inputs and outputs, as in
mlx-lm's trainer), so a step costs one graph launch; the clock stops only after `mx.eval`.

The log each run writes (<name>.train.json) records the loss at every step, each evaluation, the
step chosen, the step times and the machine (the same record the benchmarks write).

See chapter: training
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from tqdm import tqdm

from ref_impl.platform.machine import machine_info
from ref_impl.platform.timing import clock, median


def schedule(learning_rate: float, steps: int, warmup_steps: int = 0) -> Callable[[mx.array], mx.array]:
    """Linear warm-up over min(warmup_steps, steps // 10 or 1) steps, none for 0, then cosine decay to a
    tenth of the peak: the warm-up keeps a model from noise out of wild first steps."""
    warmup = min(warmup_steps, max(1, steps // 10))
    decay = optim.cosine_decay(learning_rate, max(1, steps - warmup), learning_rate / 10)
    if not warmup:
        return decay
    return optim.join_schedules([optim.linear_schedule(learning_rate / warmup, learning_rate, warmup), decay],
                                [warmup])


@dataclass
class Fit:
    """What a run of the loop leaves besides the trained module: its curve, evaluations and step times."""
    losses: list[float]             # training loss at every step
    evaluations: list[dict]         # one per evaluation: step, train_loss (since the last one), valid_loss, ...
    step_seconds: list[float]       # each step's wall time (the first includes compiling it)
    best_step: int
    best_loss: float                # the valid_loss of best_step, whose weights the module holds
    seconds: float                  # the whole loop

    def log(self) -> dict:
        """The loop's part of a training log: the loss curve, the evaluations and the step kept."""
        return {"loss_curve": [[i + 1, round(v, 4)] for i, v in enumerate(self.losses)],
                "evaluations": self.evaluations, "best_step": self.best_step}

    def times(self) -> dict:
        """Step times for the log's "seconds": the first step (compiling it), the median, the whole loop."""
        return {"first_step": round(self.step_seconds[0], 2), "median_step": median(self.step_seconds),
                "training": round(self.seconds, 2)}


def describe_losses(record: dict) -> str:
    return f"train loss {record['train_loss']:.3f}, valid loss {record['valid_loss']:.3f}"


def fit(module: nn.Module, loss: Callable[..., mx.array], batch: Callable[[], tuple[mx.array, ...]],
        evaluate: Callable[[], dict], *, steps: int, learning_rate: float, eval_every: int,
        warmup_steps: int = 0, weight_decay: float = 0.0, grad_clip: float = 0.0,
        describe: Callable[[dict], str] = describe_losses, desc: str = "train", progress: bool = True) -> Fit:
    """Train module's trainable parameters for `steps` steps; leave it holding the best evaluation's weights.

    Args:
        loss: loss(module, *batch()) -> scalar; its gradient with respect to module's trainable parameters
            is what AdamW follows (`schedule`'s learning rate, decoupled weight decay).
        batch: the next batch, a tuple of arrays.
        evaluate: called every eval_every steps and after the last: a dict with at least "valid_loss"
            (lower is better: it picks the weights kept), plus anything else to log.
        grad_clip: the largest global gradient norm (0: none).
        describe: the progress line of an evaluation record.
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    optimizer = optim.AdamW(learning_rate=schedule(learning_rate, steps, warmup_steps), weight_decay=weight_decay)
    loss_and_grad = nn.value_and_grad(module, loss)
    state = [module.state, optimizer.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step(*inputs):
        value, grads = loss_and_grad(module, *inputs)
        if grad_clip:
            grads, _ = optim.clip_grad_norm(grads, grad_clip)
        optimizer.update(module, grads)
        return value

    t0 = clock()
    losses, evaluations, step_seconds = [], [], []
    best = (math.inf, 0, None)  # (valid loss, step, weights)
    bar = tqdm(range(1, steps + 1), desc=desc, disable=not progress)
    for it in bar:
        ts = clock()
        value = step(*batch())
        mx.eval(state, value)
        step_seconds.append(clock() - ts)
        losses.append(value.item())
        if it % 10 == 0:
            bar.set_postfix(loss=f"{np.mean(losses[-10:]):.3f}")
        if it % eval_every == 0 or it == steps:
            record = {"step": it, "train_loss": float(np.mean(losses[-eval_every:])), **evaluate()}
            evaluations.append(record)
            if progress:
                tqdm.write(f"step {it}: {describe(record)}")
            if record["valid_loss"] < best[0]:
                weights = [(k, mx.array(w)) for k, w in nn.utils.tree_flatten(module.parameters())]
                best = (record["valid_loss"], it, weights)
    module.load_weights(best[2])
    return Fit(losses, evaluations, step_seconds, best[1], best[0], clock() - t0)


def write_log(path: Path, log: dict, command: str) -> dict:
    """Write a training log as JSON, ending with the machine it ran on and the command that reproduces it."""
    log = {**log, "machine": machine_info(), "command": command}
    path.write_text(json.dumps(log, indent=1) + "\n")
    return log
