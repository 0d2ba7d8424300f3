"""Train the course's own models on the Python standard library's source code.

No model can be downloaded while the book builds, so the course trains its own: a byte-level
BPE tokenizer and a small Llama-style decoder, on the `.py` files of the standard library of
the Python that runs this (found with `sysconfig`; nothing is copied into the repository).
A fixed slice of the files, chosen by a hash of each file's path, is held out for perplexity.
Seeds are fixed, so the same Python version and configuration give the same model.

    python -m ref_impl train --preset stdlib-10m --out models/

writes `models/stdlib-10m.gguf` and beside it `models/stdlib-10m.train.json`: the configuration,
the loss curve, held-out perplexity, the Python version of the corpus, the machine, wall time.

See chapter: models
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
import sysconfig
import time
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from tqdm import tqdm

from ref_impl.engine.model import Model, ModelArgs, save
from ref_impl.engine.tokenizer import Tokenizer, train_tokenizer


@dataclass
class TrainConfig:
    name: str = "stdlib-10m"
    vocab_size: int = 4096
    hidden_size: int = 384
    num_hidden_layers: int = 6
    num_attention_heads: int = 6
    num_key_value_heads: int = 2
    intermediate_size: int = 1024
    context: int = 512
    batch_size: int = 32
    steps: int = 3000
    learning_rate: float = 1e-3
    warmup_steps: int = 200
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_tokens: int = 262_144          # held-out tokens scored at each evaluation
    heldout_percent: int = 5            # files never seen in training: the reported perplexity
    valid_percent: int = 3              # files that choose the checkpoint (the best of the evaluations)
    max_corpus_bytes: int = 0           # 0: the whole standard library
    stdlib: str = ""                    # another Python's Lib/ directory; "": this interpreter's
    corpus_python: str = ""             # the version of that Python (recorded in the log)
    seed: int = 0

    def model_args(self) -> ModelArgs:
        return ModelArgs(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                         num_hidden_layers=self.num_hidden_layers,
                         intermediate_size=self.intermediate_size,
                         num_attention_heads=self.num_attention_heads,
                         num_key_value_heads=self.num_key_value_heads,
                         max_position_embeddings=self.context)


PRESETS = {
    "stdlib-10m": TrainConfig(),
    # the draft model for speculative decoding: same corpus and vocabulary (so the same tokenizer)
    "stdlib-draft-1m": TrainConfig(name="stdlib-draft-1m", hidden_size=128, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, intermediate_size=384,
                                   learning_rate=2e-3),
    # a few seconds on a CPU: proves the whole path (CI trains this one)
    "micro": TrainConfig(name="micro", vocab_size=384, hidden_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                         context=64, batch_size=16, steps=60, learning_rate=3e-3, warmup_steps=10,
                         eval_every=30, eval_tokens=8192, max_corpus_bytes=1_500_000),
}


def stdlib_files(stdlib: str = "") -> tuple[Path, list[Path]]:
    """The standard library's directory and its .py files, in a fixed order (no site-packages)."""
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py")
                   if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts))
    if not files:
        raise ValueError(f"no .py files under {root}: is the standard library's source installed?")
    return root, files


def split_of(relative_path: str, cfg: TrainConfig) -> str:
    """'heldout', 'valid' or 'train', from a hash of the file's path (stable across machines)."""
    bucket = int(hashlib.sha256(relative_path.encode()).hexdigest(), 16) % 100
    if bucket < cfg.heldout_percent:
        return "heldout"
    return "valid" if bucket < cfg.heldout_percent + cfg.valid_percent else "train"


def read_corpus(cfg: TrainConfig) -> tuple[dict[str, list[str]], str]:
    """The train, valid and held-out texts (every readable UTF-8 .py file, within max_corpus_bytes)
    and a sha256 fingerprint of the files used, for reproducing the corpus elsewhere."""
    root, files = stdlib_files(cfg.stdlib)
    digest = hashlib.sha256()
    split: dict[str, list[str]] = {"train": [], "valid": [], "heldout": []}
    share = {"train": 100 - cfg.heldout_percent - cfg.valid_percent,
             "valid": cfg.valid_percent, "heldout": cfg.heldout_percent}
    size = dict.fromkeys(split, 0)
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a few test files are deliberately not UTF-8
        name = path.relative_to(root).as_posix()
        part = split_of(name, cfg)
        if cfg.max_corpus_bytes and size[part] + len(text) > cfg.max_corpus_bytes * share[part] // 100:
            continue
        split[part].append(text)
        size[part] += len(text)
        digest.update(f"{name}\0{text}\0".encode())
    return split, digest.hexdigest()


def token_stream(tokenizer: Tokenizer, texts: list[str]) -> np.ndarray:
    """All texts as one stream of token ids, each file preceded by the BOS token."""
    ids = [tokenizer.encode(t, bos=True) for t in texts]
    return np.concatenate([np.array(i, dtype=np.int32) for i in ids])


def heldout_stream(tokenizer: Tokenizer, preset: str = "stdlib-10m") -> tuple[np.ndarray, str]:
    """The token stream of the files `preset` held out (never trained on), and the corpus fingerprint:
    the text every perplexity in the book is measured on."""
    corpus, fingerprint = read_corpus(config_for(preset))
    return token_stream(tokenizer, corpus["heldout"]), fingerprint


def sample_batch(stream: np.ndarray, rng: np.random.Generator, batch: int, context: int, bos: int):
    """Inputs and next-token targets (batch, context): random windows, each led by BOS.

    A prompt starts anywhere in a file, not only at its top; leading every window with BOS
    teaches the model that BOS means "text follows", so a short prompt like "def " is in
    distribution.
    """
    starts = rng.integers(0, len(stream) - context, size=batch)
    targets = stream[starts[:, None] + np.arange(context)]
    inputs = np.concatenate([np.full((batch, 1), bos, dtype=targets.dtype), targets[:, :-1]], axis=1)
    return mx.array(inputs), mx.array(targets)


def loss_fn(model: Model, x: mx.array, y: mx.array) -> mx.array:
    return nn.losses.cross_entropy(model(x), y, reduction="mean")


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


def train(cfg: TrainConfig, out_dir: Path, progress: bool = True) -> dict:
    """Train tokenizer and model; write <name>.gguf and <name>.train.json to out_dir; return the log.

    The model is evaluated on the valid files every eval_every steps and the best evaluation's
    weights are kept; the held-out files are scored once, at the end.
    """
    if cfg.steps < 1:
        raise ValueError(f"steps must be at least 1, got {cfg.steps}")
    out_dir.mkdir(parents=True, exist_ok=True)  # fail on a bad path before, not after, training
    t0 = time.perf_counter()
    mx.random.seed(cfg.seed)
    corpus, fingerprint = read_corpus(cfg)
    tokenizer = train_tokenizer(corpus["train"], cfg.vocab_size)
    ids = {part: token_stream(tokenizer, texts) for part, texts in corpus.items()}
    t_data = time.perf_counter() - t0

    args = cfg.model_args()
    model = Model(args)
    warmup = min(cfg.warmup_steps, max(1, cfg.steps // 10))
    schedule = optim.join_schedules(
        [optim.linear_schedule(cfg.learning_rate / warmup, cfg.learning_rate, warmup),
         optim.cosine_decay(cfg.learning_rate, max(1, cfg.steps - warmup), cfg.learning_rate / 10)],
        [warmup])
    optimizer = optim.AdamW(learning_rate=schedule, weight_decay=cfg.weight_decay)
    loss_and_grad = nn.value_and_grad(model, loss_fn)
    state = [model.state, optimizer.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step(x, y):
        loss, grads = loss_and_grad(model, x, y)
        grads, _ = optim.clip_grad_norm(grads, cfg.grad_clip)
        optimizer.update(model, grads)
        return loss

    rng = np.random.default_rng(cfg.seed)
    losses, evals, step_times = [], [], []
    best = (math.inf, 0, None)  # (valid loss, step, weights)
    bar = tqdm(range(1, cfg.steps + 1), desc=f"train {cfg.name}", disable=not progress)
    for it in bar:
        ts = time.perf_counter()
        loss = step(*sample_batch(ids["train"], rng, cfg.batch_size, cfg.context, tokenizer.bos_id))
        mx.eval(state, loss)
        step_times.append(time.perf_counter() - ts)
        losses.append(loss.item())
        if it % 10 == 0:
            bar.set_postfix(loss=f"{np.mean(losses[-10:]):.3f}")
        if it % cfg.eval_every == 0 or it == cfg.steps:
            v = mean_loss(model, ids["valid"], cfg.context, cfg.eval_tokens)
            evals.append({"step": it, "train_loss": float(np.mean(losses[-cfg.eval_every:])),
                          "valid_loss": v, "valid_perplexity": math.exp(v)})
            if progress:
                tqdm.write(f"step {it}: train loss {evals[-1]['train_loss']:.3f}, valid ppl {math.exp(v):.2f}")
            if v < best[0]:
                best = (v, it, [(k, mx.array(w)) for k, w in nn.utils.tree_flatten(model.parameters())])
    model.load_weights(best[2])
    heldout = mean_loss(model, ids["heldout"], cfg.context)

    gguf_path = out_dir / f"{cfg.name}.gguf"
    python = cfg.corpus_python or platform.python_version()
    save(model, tokenizer, gguf_path, {
        "general.name": cfg.name,
        "general.description": f"Llama-style decoder trained on the Python {python} standard library"})
    from ref_impl.platform.machine import machine_info  # the same machine record the benchmarks write
    log = {
        "name": cfg.name,
        "config": asdict(cfg),
        "model": {"parameters": args.num_parameters, "args": asdict(args), "file": gguf_path.name,
                  "file_bytes": gguf_path.stat().st_size},
        "corpus": {"python": python, "stdlib": cfg.stdlib or sysconfig.get_paths()["stdlib"],
                   "sha256": fingerprint,
                   "files": {k: len(v) for k, v in corpus.items()},
                   "characters": {k: sum(map(len, v)) for k, v in corpus.items()},
                   "tokens": {k: int(len(v)) for k, v in ids.items()},
                   "split_rule": f"bucket = sha256(path relative to stdlib) % 100; heldout: bucket < "
                                 f"{cfg.heldout_percent}; valid: next {cfg.valid_percent}; train: the rest"},
        "loss_curve": [[i + 1, round(v, 4)] for i, v in enumerate(losses)],
        "evaluations": evals,
        "best_step": best[1],
        "valid_perplexity": math.exp(best[0]),
        "heldout_loss": heldout,
        "heldout_perplexity": math.exp(heldout),
        "tokens_seen": cfg.steps * cfg.batch_size * cfg.context,
        "seconds": {"data_and_tokenizer": round(t_data, 2), "first_step": round(step_times[0], 2),
                    "median_step": float(np.median(step_times)),
                    "total": round(time.perf_counter() - t0, 2)},
        "machine": machine_info(),
        "command": f"python -m ref_impl train --preset {cfg.name} --steps {cfg.steps} --seed {cfg.seed}"
                   + (f" --stdlib {cfg.stdlib} --corpus-python {python}" if cfg.stdlib else ""),
    }
    (out_dir / f"{cfg.name}.train.json").write_text(json.dumps(log, indent=1) + "\n")
    return log


def config_for(preset: str, **overrides) -> TrainConfig:
    """A preset with some fields replaced (None values are ignored)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    return replace(PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None})
