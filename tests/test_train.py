"""Training: the corpus split, the batches, the loss, the one loop, a micro run whose loss falls, and
MTP heads trained on it by the same loop."""

from __future__ import annotations

import json
import math
from dataclasses import fields, replace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from ref_impl.engine import mtp
from ref_impl.engine.checkpoint import load
from ref_impl.engine.model import Model, ModelArgs
from ref_impl.formats import gguf
from ref_impl.theory import shapes
from ref_impl.training.corpus import CorpusConfig, read_corpus, sample_batch, split_of, stdlib_files
from ref_impl.training.evaluate import mean_loss
from ref_impl.training.heads import MTPConfig, train_heads
from ref_impl.training.loop import fit, schedule
from ref_impl.training.models import PRESETS, config_for, train


def test_split_is_stable_and_proportional():
    cfg = PRESETS["stdlib-10m"]
    root, files = stdlib_files()
    names = [p.relative_to(root).as_posix() for p in files]
    parts = [split_of(n, cfg) for n in names]
    assert parts == [split_of(n, cfg) for n in names]
    share = {p: parts.count(p) / len(parts) for p in ("heldout", "valid", "train")}
    # hashing into 100 buckets: about 5% / 3% / 92% of several hundred files
    assert 0.02 < share["heldout"] < 0.09 and 0.01 < share["valid"] < 0.06 and share["train"] > 0.85


def test_corpus_respects_the_byte_cap():
    cfg = PRESETS["micro"]
    corpus, fingerprint = read_corpus(cfg)
    assert sum(map(len, corpus["train"])) <= cfg.max_corpus_bytes
    assert all(corpus[p] for p in ("train", "valid", "heldout"))
    assert read_corpus(cfg)[1] == fingerprint and len(fingerprint) == 64


def test_the_default_corpus_is_the_shipped_models():
    """heldout_stream's default split is the one stdlib-10m and its draft were trained on."""
    for preset in ("stdlib-10m", "stdlib-draft-1m"):
        assert all(getattr(PRESETS[preset], f.name) == getattr(CorpusConfig(), f.name) for f in fields(CorpusConfig))


def test_presets_take_their_shape_from_the_shape_table():
    for name, cfg in PRESETS.items():
        args, shape = cfg.model_args(), shapes.STAND_INS[cfg.shape]
        assert (args.vocab_size, args.hidden_size, args.num_hidden_layers, args.intermediate_size,
                args.num_attention_heads, args.num_key_value_heads) == (
            shape.vocab_size, shape.hidden_size, shape.num_hidden_layers, shape.intermediate_size,
            shape.num_attention_heads, shape.num_key_value_heads)
        assert args.max_position_embeddings == cfg.context and cfg.name == name == cfg.shape


def test_schedule_warms_up_then_decays_to_a_tenth():
    lr = schedule(1e-3, 100, warmup_steps=20)        # warm-up capped at a tenth of the steps
    assert float(lr(mx.array(0))) == pytest.approx(1e-4) and float(lr(mx.array(10))) == pytest.approx(1e-3)
    assert float(lr(mx.array(100))) == pytest.approx(1e-4)
    no_warmup = schedule(1e-3, 100)
    assert float(no_warmup(mx.array(0))) == pytest.approx(1e-3)
    assert float(no_warmup(mx.array(100))) == pytest.approx(1e-4)


def test_the_loop_keeps_the_best_evaluation():
    """A regression the loop solves; the evaluation says step 4 was best, so its weights are the ones kept."""
    mx.random.seed(0)
    layer, rng = nn.Linear(4, 1), np.random.default_rng(0)
    w = mx.array([[1.0, -2.0, 0.5, 3.0]])
    snapshots, scores = {}, iter([0.5, 0.1, 0.3])

    def batch():
        x = mx.array(rng.standard_normal((32, 4)).astype(np.float32))
        return x, x @ w.T

    def evaluate():
        snapshots[len(snapshots) + 1] = np.array(layer.weight)
        return {"valid_loss": next(scores)}

    run = fit(layer, lambda m, x, y: nn.losses.mse_loss(m(x), y), batch, evaluate, steps=10, learning_rate=0.1,
              eval_every=4, grad_clip=1.0, progress=False)
    assert [e["step"] for e in run.evaluations] == [4, 8, 10] and run.best_step == 8 and run.best_loss == 0.1
    assert np.array_equal(np.array(layer.weight), snapshots[2])
    assert len(run.losses) == len(run.step_seconds) == 10 and run.losses[-1] < run.losses[0]
    assert run.log()["loss_curve"][0] == [1, round(run.losses[0], 4)]


def test_batches_lead_with_bos_and_shift_by_one():
    stream = np.arange(100, 1100, dtype=np.int32)
    x, y = sample_batch(stream, np.random.default_rng(0), batch=4, context=16, bos=7)
    x, y = np.array(x), np.array(y)
    assert x.shape == y.shape == (4, 16)
    assert np.all(x[:, 0] == 7)
    assert np.array_equal(x[:, 1:], y[:, :-1])
    assert np.all(np.diff(y, axis=1) == 1)     # each target row is a contiguous window


def test_mean_loss_is_the_average_next_token_loss():
    mx.random.seed(0)
    model = Model(ModelArgs(vocab_size=50, hidden_size=16, num_hidden_layers=1, intermediate_size=32,
                            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32))
    stream = np.random.default_rng(0).integers(0, 50, 41).astype(np.int32)
    ours = mean_loss(model, stream, context=8, batch=3)       # 5 windows of 8, batches of 3 and 2
    logits = np.array(model(mx.array(stream[:40].reshape(5, 8))), dtype=np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    targets = stream[1:41].reshape(5, 8)
    manual = -np.take_along_axis(logp, targets[..., None], -1).mean()
    assert math.isclose(ours, manual, rel_tol=1e-5)
    with pytest.raises(ValueError, match="shorter than one window"):
        mean_loss(model, stream[:5], context=8)


def test_mean_loss_spread_windows_cover_the_stream():
    """spread=True: 3 windows of 8 spaced over 81 tokens start at 0, 32 and 72, not 0, 8 and 16."""
    mx.random.seed(0)
    model = Model(ModelArgs(vocab_size=50, hidden_size=16, num_hidden_layers=1, intermediate_size=32,
                            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32))
    stream = np.random.default_rng(1).integers(0, 50, 81).astype(np.int32)
    rows = np.array([0, 32, 72])[:, None] + np.arange(9)
    assert math.isclose(mean_loss(model, stream, context=8, max_tokens=24, spread=True),
                        np.mean([mean_loss(model, stream[r], context=8) for r in rows]), rel_tol=1e-5)


@pytest.fixture(scope="module")
def micro_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("micro")
    return out, train(PRESETS["micro"], out, progress=False)


def test_micro_training_lowers_the_loss(micro_run):
    out, log = micro_run
    curve = [loss for _, loss in log["loss_curve"]]
    assert np.mean(curve[:10]) > np.mean(curve[-10:]) + 0.5
    assert log["evaluations"][-1]["valid_loss"] < log["evaluations"][0]["valid_loss"]
    assert math.isfinite(log["heldout_perplexity"])
    assert log["heldout_perplexity"] < PRESETS["micro"].model_args().vocab_size
    assert json.loads((out / "micro.train.json").read_text())["corpus"]["sha256"] == log["corpus"]["sha256"]


def test_micro_model_loads_back(micro_run):
    out, log = micro_run
    model, tok = load(out / "micro.gguf", mx.float32)
    assert model.args.num_parameters == log["model"]["parameters"]
    assert tok.vocab_size == PRESETS["micro"].model_args().vocab_size
    with gguf.read(out / "micro.gguf") as f:
        assert f.metadata["general.name"] == "micro"
        assert f.metadata["general.architecture"] == "llama"


def test_training_is_reproducible(micro_run, tmp_path):
    out, _ = micro_run
    cfg = replace(PRESETS["micro"], steps=20, eval_every=10)
    a, b = train(cfg, tmp_path / "a", progress=False), train(cfg, tmp_path / "b", progress=False)
    assert a["loss_curve"] == b["loss_curve"]
    assert (tmp_path / "a/micro.gguf").read_bytes() == (tmp_path / "b/micro.gguf").read_bytes()


def test_mtp_heads_train_on_the_micro_model(micro_run):
    """The same loop trains heads on the frozen micro model; the file loads back onto the model."""
    out, _ = micro_run
    base = out / "micro.gguf"
    before = base.read_bytes()
    cfg = MTPConfig(base=str(base), k=2, pool_tokens=4096, window=32, steps=20, batch_size=64, eval_every=10,
                    eval_tokens=1024, heldout_tokens=1024)
    log = train_heads(cfg, out, progress=False)
    assert base.read_bytes() == before                     # the base model is frozen
    assert [e["step"] for e in log["evaluations"]] == [10, 20] and log["best_step"] in (10, 20)
    assert len(log["heldout"]) == 3 and all(math.isfinite(e["loss"]) for e in log["heldout"])
    assert json.loads((out / "micro-mtp.train.json").read_text())["machine"] == log["machine"]
    model, _ = load(base, mx.float32)
    heads = mtp.load_heads(out / "micro-mtp.gguf", model, mx.float32)
    assert heads.k == 2 and heads.base_model == "micro"


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        config_for("huge")
