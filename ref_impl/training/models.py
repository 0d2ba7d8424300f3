"""Train the course's own models on the Python standard library's source code.

No model can be downloaded while the book builds, so the course trains its own: a byte-level
BPE tokenizer and a small Llama-style decoder, on the corpus of training/corpus.py. A preset's
shape is a stand-in of the one shape table (theory/shapes.py); the rest of the preset is how to
train it. Seeds are fixed, so the same Python version and configuration give the same model.

    python -m ref_impl train --preset stdlib-10m --out models/

writes `models/stdlib-10m.gguf` and beside it `models/stdlib-10m.train.json`: the configuration,
the loss curve, held-out perplexity, the Python version of the corpus, the machine, wall time.

See chapter: training
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ref_impl.engine.checkpoint import save
from ref_impl.engine.model import Model, ModelArgs
from ref_impl.engine.tokenizer import train_tokenizer
from ref_impl.platform.timing import clock
from ref_impl.theory import shapes
from ref_impl.training.corpus import CorpusConfig, corpus_log, read_corpus, sample_batch, split_rule, token_stream
from ref_impl.training.evaluate import mean_loss
from ref_impl.training.loop import fit, write_log


@dataclass
class TrainConfig(CorpusConfig):
    """A model to train: its corpus (CorpusConfig's fields), its shape and how to train it."""
    name: str = "stdlib-10m"
    shape: str = "stdlib-10m"           # a stand-in of theory/shapes.py: vocabulary, widths, layers, heads
    context: int = 512
    batch_size: int = 32
    steps: int = 3000
    learning_rate: float = 1e-3
    warmup_steps: int = 200
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_tokens: int = 262_144          # valid tokens scored at each evaluation
    seed: int = 0

    def model_args(self) -> ModelArgs:
        return ModelArgs.from_shape(shapes.shape(self.shape), self.context)


PRESETS = {
    "stdlib-10m": TrainConfig(),
    # the draft model for speculative decoding: same corpus and vocabulary (so the same tokenizer)
    "stdlib-draft-1m": TrainConfig(name="stdlib-draft-1m", shape="stdlib-draft-1m", learning_rate=2e-3),
    # a few seconds on a CPU: proves the whole path (CI trains this one)
    "micro": TrainConfig(name="micro", shape="micro", context=64, batch_size=16, steps=60, learning_rate=3e-3,
                         warmup_steps=10, eval_every=30, eval_tokens=8192, max_corpus_bytes=1_500_000),
}


def config_for(preset: str, **overrides) -> TrainConfig:
    """A preset with some fields replaced (None values are ignored)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    return replace(PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None})


def loss_fn(model: Model, x: mx.array, y: mx.array) -> mx.array:
    """Mean next-token cross-entropy of a batch: inputs x, targets y, both (batch, context)."""
    return nn.losses.cross_entropy(model(x), y, reduction="mean")


def train(cfg: TrainConfig, out_dir: Path, progress: bool = True) -> dict:
    """Train tokenizer and model; write <name>.gguf and <name>.train.json to out_dir; return the log.

    The model is evaluated on the valid files every eval_every steps and the best evaluation's
    weights are kept; the held-out files are scored once, at the end.
    """
    if cfg.steps < 1:
        raise ValueError(f"steps must be at least 1, got {cfg.steps}")
    out_dir.mkdir(parents=True, exist_ok=True)  # fail on a bad path before, not after, training
    t0 = clock()
    mx.random.seed(cfg.seed)
    args = cfg.model_args()
    corpus, fingerprint = read_corpus(cfg)
    tokenizer = train_tokenizer(corpus["train"], args.vocab_size)
    ids = {part: token_stream(tokenizer, texts) for part, texts in corpus.items()}
    t_data = clock() - t0

    model = Model(args)
    rng = np.random.default_rng(cfg.seed)

    def evaluate() -> dict:
        v = mean_loss(model, ids["valid"], cfg.context, cfg.eval_tokens)
        return {"valid_loss": v, "valid_perplexity": math.exp(v)}

    run = fit(model, loss_fn, lambda: sample_batch(ids["train"], rng, cfg.batch_size, cfg.context, tokenizer.bos_id),
              evaluate, steps=cfg.steps, learning_rate=cfg.learning_rate, eval_every=cfg.eval_every,
              warmup_steps=cfg.warmup_steps, weight_decay=cfg.weight_decay, grad_clip=cfg.grad_clip,
              describe=lambda r: f"train loss {r['train_loss']:.3f}, valid ppl {r['valid_perplexity']:.2f}",
              desc=f"train {cfg.name}", progress=progress)
    heldout = mean_loss(model, ids["heldout"], cfg.context)

    gguf_path = out_dir / f"{cfg.name}.gguf"
    about = corpus_log(cfg, corpus, fingerprint, ids)
    save(model, tokenizer, gguf_path, {
        "general.name": cfg.name,
        "general.description": f"Llama-style decoder trained on the Python {about['python']} standard library"})
    log = {
        "name": cfg.name,
        "config": asdict(cfg),
        "model": {"parameters": args.num_parameters, "args": asdict(args), "file": gguf_path.name,
                  "file_bytes": gguf_path.stat().st_size},
        "corpus": {**about, "split_rule": split_rule(cfg)},
        **run.log(),
        "valid_perplexity": math.exp(run.best_loss),
        "heldout_loss": heldout,
        "heldout_perplexity": math.exp(heldout),
        "tokens_seen": cfg.steps * cfg.batch_size * cfg.context,
        "seconds": {"data_and_tokenizer": round(t_data, 2), **run.times(), "total": round(clock() - t0, 2)},
    }
    command = (f"python -m ref_impl train --preset {cfg.name} --steps {cfg.steps} --seed {cfg.seed}"
               + (f" --stdlib {cfg.stdlib} --corpus-python {about['python']}" if cfg.stdlib else ""))
    return write_log(out_dir / f"{cfg.name}.train.json", log, command)
