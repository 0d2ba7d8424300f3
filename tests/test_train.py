"""Training: the corpus split, the batches, the loss, and a micro run whose loss falls."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from ref_impl.engine.model import Model, ModelArgs, load
from ref_impl.formats import gguf
from ref_impl.training.train import (
    PRESETS,
    config_for,
    mean_loss,
    read_corpus,
    sample_batch,
    split_of,
    stdlib_files,
    train,
)


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
    assert math.isfinite(log["heldout_perplexity"]) and log["heldout_perplexity"] < PRESETS["micro"].vocab_size
    assert json.loads((out / "micro.train.json").read_text())["corpus"]["sha256"] == log["corpus"]["sha256"]


def test_micro_model_loads_back(micro_run):
    out, log = micro_run
    model, tok = load(out / "micro.gguf", mx.float32)
    assert model.args.num_parameters == log["model"]["parameters"]
    assert tok.vocab_size == PRESETS["micro"].vocab_size
    with gguf.read(out / "micro.gguf") as f:
        assert f.metadata["general.name"] == "micro"
        assert f.metadata["general.architecture"] == "llama"


def test_training_is_reproducible(micro_run, tmp_path):
    out, _ = micro_run
    cfg = replace(PRESETS["micro"], steps=20, eval_every=10)
    a, b = train(cfg, tmp_path / "a", progress=False), train(cfg, tmp_path / "b", progress=False)
    assert a["loss_curve"] == b["loss_curve"]
    assert (tmp_path / "a/micro.gguf").read_bytes() == (tmp_path / "b/micro.gguf").read_bytes()


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        config_for("huge")
