"""Build it yourself, step 3 (book/build-it/03-transformer-block), tasks 1 to 5:
`pytest tests/test_exercises_build_block.py -k build_block_task`."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from ref_impl.exercises import build_block as bb
from ref_impl.engine.model import MLX_PARTS

# The right answers, written here from the formulas ------------------------------------------------------


def norm(x, w, eps):
    return w * x * mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + eps)


def rope(x, offset, base, traditional, positions_axis=2, exponent=2, sign=1):
    """The keywords make slips: positions along another axis, the exponent i/D, the rotation reversed."""
    D, n = x.shape[-1], x.shape[positions_axis]
    pos = (offset + mx.arange(n)).astype(mx.float32)
    angle = pos[:, None] * base ** (-exponent * mx.arange(D // 2) / D)[None, :] * sign       # (L, D/2)
    if positions_axis == 1:
        angle = angle[:, None, :]
    cos, sin = mx.cos(angle), mx.sin(angle)
    a, b = (x[..., 0::2], x[..., 1::2]) if traditional else (x[..., :D // 2], x[..., D // 2:])
    pair = (a * cos - b * sin, a * sin + b * cos)
    return mx.stack(pair, axis=-1).reshape(x.shape) if traditional else mx.concatenate(pair, axis=-1)


def attend(q, k, v, scale, causal, align="last", spread="repeat", axis=-1, hidden=-mx.inf, use_scale=True):
    """The keywords make slips: the mask on the first keys, key heads tiled, the softmax's axis, ..."""
    L, T, g = q.shape[2], k.shape[2], q.shape[1] // k.shape[1]
    if spread == "repeat":
        k, v = mx.repeat(k, g, axis=1), mx.repeat(v, g, axis=1)
    elif spread == "tile":
        k, v = mx.tile(k, (1, g, 1, 1)), mx.tile(v, (1, g, 1, 1))
    s = q @ k.swapaxes(-1, -2)
    s = s * (scale if use_scale is True else 1.0 if use_scale is False else use_scale)
    if causal:
        first = T - L if align == "last" else 0
        s = mx.where(mx.arange(T)[None, :] <= mx.arange(first, first + L)[:, None], s, hidden)
    return mx.softmax(s, axis=axis) @ v


def mlp(x, gate, up, down):
    g = gate(x)
    return down(g * mx.sigmoid(g) * up(x))


def stub(*args):
    raise NotImplementedError("Step 3: write it")


# Tasks 1 to 4: each function against the engine's operation ---------------------------------------------

@pytest.mark.parametrize("check, right", [(bb.check_rms_norm, norm), (bb.check_rope, rope),
                                          (bb.check_attend, attend), (bb.check_mlp, mlp)])
def test_build_block_tasks_1_to_4_accept_the_right_answer_and_reject_the_stub(check, right):
    r = check(right)
    assert r and "right on all" in r.message, r.message
    r = check(stub)
    assert not r and "not written yet" in r.message
    assert "pass your function" in check(None).message


@pytest.mark.parametrize("wrong, hint", [
    (lambda x, w, eps: w * x * mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True)), "eps left out"),
    (lambda x, w, eps: w * x / (mx.sqrt(mx.mean(x * x, axis=-1, keepdims=True)) + eps), "inside the square root"),
    (lambda x, w, eps: w * x / mx.linalg.norm(x, axis=-1, keepdims=True), "not by the norm"),
    (lambda x, w, eps: w * x / mx.sqrt(mx.sum(x * x, axis=-1, keepdims=True) + eps), "not by the norm"),
    (lambda x, w, eps: w * x * mx.sqrt(mx.mean(x * x, axis=-1, keepdims=True) + eps), "multiplied by the RMS"),
    (lambda x, w, eps: norm(x, mx.ones_like(w), eps), "multiplied by `weight`"),
    (lambda x, w, eps: norm(x - mx.mean(x, axis=-1, keepdims=True), w, eps), "LayerNorm"),
    (lambda x, w, eps: w * x * mx.rsqrt(mx.mean(x * x) + eps), "one RMS per row"),
    (lambda x, w, eps: norm(x, w, eps) + 0.1, "y = weight · x / sqrt(mean(x², last axis) + eps)"),
])
def test_build_block_task_1_rejects_typical_mistakes_with_their_hint(wrong, hint):
    r = bb.check_rms_norm(wrong)
    assert not r and hint in r.message, r.message


@pytest.mark.parametrize("wrong, hint", [
    (lambda x, o, b, t: rope(x, o, b, True), "your pairs are adjacent"),
    (lambda x, o, b, t: rope(x, o, b, False), "your pairs are D/2 apart"),
    (lambda x, o, b, t: rope(x, o, b, not t), "the flag the other way round"),
    (lambda x, o, b, t: rope(x, 0, b, t), "offset ignored"),
    (lambda x, o, b, t: rope(x, o, 10000.0, t), "use the `base` argument"),
    (lambda x, o, b, t: rope(x, o, b, t, exponent=1), "not i/D"),
    (lambda x, o, b, t: rope(x, o, b, t, sign=-1), "the wrong way"),
    (lambda x, o, b, t: rope(x, o, b, t, positions_axis=1), "not axis 1"),
    (lambda x, o, b, t: rope(x, o + 1, b, t), "position p turns pair i"),
])
def test_build_block_task_2_rejects_typical_mistakes_with_their_hint(wrong, hint):
    r = bb.check_rope(wrong)
    assert not r and hint in r.message, r.message


@pytest.mark.parametrize("wrong, hint", [
    (lambda q, k, v, s, c: attend(q, k, v, s, c, align="first"), "LAST L keys"),
    (lambda q, k, v, s, c: attend(q, k, v, s, False), "must not see keys after"),
    (lambda q, k, v, s, c: attend(q, k, v, s, True), "every query sees every key"),
    (lambda q, k, v, s, c: attend(q, k, v, s, c, hidden=0.0), "not 0"),
    (lambda q, k, v, s, c: attend(q, k, v, s, c, spread="tile"), "mx.tile"),
    (lambda q, k, v, s, c: attend(q, k, v, s, c, use_scale=False), "by `scale` before the softmax"),
    (lambda q, k, v, s, c: attend(q, k, v, s, c, use_scale=q.shape[-1] ** -0.5), "use the `scale` argument"),
    (lambda q, k, v, s, c: attend(q, k, v, s, c, use_scale=1 / s), "it is already 1/√D"),
    (lambda q, k, v, s, c: attend(q, k, v, s, c, axis=-2), "not over the queries"),
    (lambda q, k, v, s, c: attend(q, k, v, s, c, spread="none"), "repeat it"),          # a shape error on GQA
    (lambda q, k, v, s, c: 1.01 * attend(q, k, v, s, c), "each key/value head repeated"),
])
def test_build_block_task_3_rejects_typical_mistakes_with_their_hint(wrong, hint):
    r = bb.check_attend(wrong)
    assert not r and hint in r.message, r.message


def test_build_block_task_3_names_the_first_failing_case():
    r = bb.check_attend(lambda q, k, v, s, c: attend(q, k, v, s, c, spread="tile"))
    assert "GQA" in r.message                                   # right while H = Hkv
    r = bb.check_attend(lambda q, k, v, s, c: attend(q, k, v, s, c, align="first"))
    assert "one query after 8 cached keys" in r.message        # right while L = T


@pytest.mark.parametrize("wrong, hint", [
    (lambda x, g, u, d: d(mx.sigmoid(g(x)) * u(x)), "not the bare sigmoid"),
    (lambda x, g, u, d: d(nn.relu(g(x)) * u(x)), "not ReLU"),
    (lambda x, g, u, d: d(nn.gelu(g(x)) * u(x)), "not GELU"),
    (lambda x, g, u, d: d(g(x) * u(x)), "no activation"),
    (lambda x, g, u, d: d(nn.silu(u(x)) * g(x)), "gate and up swapped"),
    (lambda x, g, u, d: d(nn.silu(g(x) * u(x))), "gate(x) alone"),
    (lambda x, g, u, d: d(nn.silu(u(x))), "uses both inputs"),
    (lambda x, g, u, d: 2 * mlp(x, g, u, d), "silu(z) = z·sigmoid(z)"),
])
def test_build_block_task_4_rejects_typical_mistakes_with_their_hint(wrong, hint):
    r = bb.check_mlp(wrong)
    assert not r and hint in r.message, r.message


def test_build_block_tasks_1_to_4_outputs_of_the_wrong_kind():
    assert "return an mx.array" in bb.check_rms_norm(lambda x, w, e: np.array(norm(x, w, e))).message
    assert "dtype float16" in bb.check_rms_norm(lambda x, w, e: norm(x, w, e).astype(mx.float16)).message
    weights = lambda q, k, v, s, c: mx.softmax(q @ mx.repeat(k, q.shape[1] // k.shape[1], 1).swapaxes(-1, -2))  # noqa: E731
    r = bb.check_attend(weights)                                 # the weights (B, H, L, T), not their average of v
    assert not r and "expected (1, 4, 6, 16)" in r.message
    r = bb.check_mlp(lambda x, g, u, d: nn.silu(g(x)) * u(x))
    assert not r and "down maps back" in r.message
    assert "raised ZeroDivisionError" in bb.check_rope(lambda x, o, b, t: 1 / 0).message


# Task 5: the four in the shipped model ------------------------------------------------------------------

def test_build_block_task_5_the_shipped_model_runs_on_the_right_four():
    r = bb.check_model_parts(norm, rope, attend, mlp)
    assert r and "16 greedy tokens" in r.message, r.message
    assert bb._shipped()[0].layers[0].parts is MLX_PARTS            # restored


@pytest.mark.parametrize("parts, hint", [
    ((stub, rope, attend, mlp), "your rms_norm: not written yet"),
    ((norm, lambda x, o, b, t: rope(x, 0, b, t), attend, mlp), "only your rope"),
    ((norm, rope, lambda q, k, v, s, c: attend(q, k, v, s, c, align="first"), mlp), "only your attend"),
    ((norm, rope, attend, lambda x, g, u, d: d(nn.silu(u(x)) * g(x))), "only your mlp"),
    ((norm, rope, attend, 3), "mlp is int"),
])
def test_build_block_task_5_names_the_part_that_breaks_the_model(parts, hint):
    r = bb.check_model_parts(*parts)
    assert not r and hint in r.message, r.message
    assert bb._shipped()[0].layers[0].mlp.parts is MLX_PARTS
