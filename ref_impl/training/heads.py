"""Train multi-token-prediction heads (engine/mtp.py) on a frozen model.

The model does not change, so its hidden states on a pool of training windows are computed once;
each step of the shared loop (training/loop.py) then draws a batch of positions from the pool and
trains only the heads. The corpus and its split are the base model's (its preset in
training/models.py): the valid split picks the checkpoint, the held-out split is scored once.

    python -m ref_impl train --mtp models/stdlib-10m.gguf --out models/

writes `models/stdlib-10m-mtp.gguf` and its log `models/stdlib-10m-mtp.train.json`.

See chapter: speculative-decoding
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ref_impl.engine.checkpoint import load
from ref_impl.engine.model import Model
from ref_impl.engine.mtp import HEAD_ARCHITECTURE, MTPHeads, save_heads
from ref_impl.formats import gguf
from ref_impl.platform.timing import clock
from ref_impl.training.corpus import corpus_log, read_corpus, sample_batch, token_stream
from ref_impl.training.loop import fit, write_log
from ref_impl.training.models import config_for


@dataclass
class MTPConfig:
    base: str = "models/stdlib-10m.gguf"
    k: int = 4
    pool_tokens: int = 262_144          # training positions whose hidden states are computed once
    window: int = 256                   # pool windows: shorter than the context, to cover more files
    steps: int = 1500
    batch_size: int = 512               # positions per step, drawn at random from the pool
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    eval_every: int = 250
    eval_tokens: int = 16_384           # valid positions scored at each evaluation (picks the checkpoint)
    heldout_tokens: int = 65_536        # held-out positions scored once, at the end
    stdlib: str = ""                    # another Python's Lib/ directory; "": this interpreter's
    corpus_python: str = ""
    seed: int = 0


def spread_windows(stream: np.ndarray, length: int, max_tokens: int) -> np.ndarray:
    """Non-overlapping windows (n, length) spaced evenly over a token stream, about max_tokens in all."""
    n = min(max_tokens // length, len(stream) // length)
    if n == 0:
        raise ValueError(f"the stream ({len(stream)} tokens) is shorter than one window ({length})")
    starts = np.linspace(0, len(stream) - length, n).astype(np.int64)
    return stream[starts[:, None] + np.arange(length)]


@dataclass
class Positions:
    """The frozen model's hidden states and what follows each position, one row per position."""
    hidden: np.ndarray      # (N, d)
    tokens: np.ndarray      # (N, k+1): the text's tokens t+1 .. t+1+k
    greedy: np.ndarray      # (N, k+1): the model's argmax for t+1 .. t+1+k, each given the text before it


def positions(model: Model, windows: np.ndarray, k: int, batch: int = 8) -> Positions:
    """Positions for the first L tokens of each window (n, L + k + 1), read in one forward per batch."""
    L = windows.shape[1] - k - 1
    hs, greedy = [], []
    for i in range(0, len(windows), batch):
        h = model.hidden(mx.array(windows[i:i + batch, :L + k]))          # (b, L+k, d)
        greedy.append(np.array(mx.argmax(model.logits(h), axis=-1)))
        hs.append(np.array(h[:, :L].astype(mx.float32)).reshape(-1, h.shape[-1]))
    ahead = np.arange(L)[:, None] + np.arange(k + 1)                       # (L, k+1): t+j for j = 0..k
    return Positions(np.concatenate(hs), windows[:, 1 + ahead].reshape(-1, k + 1),
                     np.concatenate(greedy)[:, ahead].reshape(-1, k + 1))


def head_loss(model: Model, heads: MTPHeads, h: mx.array, targets: mx.array) -> mx.array:
    """Mean cross-entropy over heads and positions: h (N, d), targets (N, k) for heads 1..k."""
    return nn.losses.cross_entropy(model.logits(heads(h)), targets, reduction="mean")


def evaluate(model: Model, heads: MTPHeads, pos: Positions, batch: int = 2048) -> list[dict]:
    """Per head (head 0 is the model's own next-token prediction): mean loss (nats) and top-1 accuracy
    against the text, and agreement with the model's own argmax there (what greedy verification checks)."""
    k = heads.k
    loss, correct, agree = np.zeros(k + 1), np.zeros(k + 1), np.zeros(k + 1)
    for i in range(0, len(pos.hidden), batch):
        h = mx.array(pos.hidden[i:i + batch])
        tokens, greedy = mx.array(pos.tokens[i:i + batch]), mx.array(pos.greedy[i:i + batch])
        logits = model.logits(mx.concatenate([h[:, None], heads(h)], axis=1))   # (B, k+1, V)
        guess = mx.argmax(logits, axis=-1)
        loss += np.array(nn.losses.cross_entropy(logits, tokens, reduction="none").sum(axis=0))
        correct += np.array((guess == tokens).sum(axis=0))
        agree += np.array((guess == greedy).sum(axis=0))
    n = len(pos.hidden)
    return [{"head": j, "predicts": f"t+{j + 1}", "loss": float(loss[j] / n), "accuracy": float(correct[j] / n),
             "agrees_with_model": float(agree[j] / n)} for j in range(k + 1)]


def train_heads(cfg: MTPConfig, out_dir: Path, progress: bool = True) -> dict:
    """Train k heads on the frozen base model; write <base>-mtp.gguf and <base>-mtp.train.json; return the log.

    The hidden states of pool_tokens training positions (random windows led by BOS, as the base was
    trained) are computed once, then each step draws batch_size of them.
    """
    if cfg.steps < 1:
        raise ValueError(f"steps must be at least 1, got {cfg.steps}")
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = clock()
    mx.random.seed(cfg.seed)
    model, tokenizer = load(cfg.base, mx.float32)
    model.freeze()
    with gguf.read(cfg.base) as f:
        base_name = str(f.metadata.get("general.name", Path(cfg.base).stem))
    base_cfg = config_for(base_name, stdlib=cfg.stdlib or None, corpus_python=cfg.corpus_python or None)
    corpus, fingerprint = read_corpus(base_cfg)
    ids = {part: token_stream(tokenizer, texts) for part, texts in corpus.items()}
    rng = np.random.default_rng(cfg.seed)
    L, W = model.args.max_position_embeddings, cfg.window
    x, y = sample_batch(ids["train"], rng, cfg.pool_tokens // W, W + cfg.k, tokenizer.bos_id)
    pool = positions(model, np.concatenate([np.array(x[:, :1]), np.array(y)], axis=1), cfg.k)  # BOS + W + k
    valid = positions(model, spread_windows(ids["valid"], L + cfg.k + 1, cfg.eval_tokens), cfg.k)
    t_pool = clock() - t0

    heads = MTPHeads(model.args.hidden_size, cfg.k, base_name)

    def batch() -> tuple[mx.array, mx.array]:
        rows = rng.integers(0, len(pool.hidden), cfg.batch_size)
        return mx.array(pool.hidden[rows]), mx.array(pool.tokens[rows, 1:])

    def valid_record() -> dict:
        per_head = evaluate(model, heads, valid)
        return {"valid_loss": float(np.mean([e["loss"] for e in per_head[1:]])),
                "valid_accuracy": [round(e["accuracy"], 4) for e in per_head[1:]]}

    # no warm-up: the heads start as a working predictor (the model's own), not from noise
    run = fit(heads, lambda trained, h, t: head_loss(model, trained, h, t), batch, valid_record,
              steps=cfg.steps, learning_rate=cfg.learning_rate, eval_every=cfg.eval_every,
              weight_decay=cfg.weight_decay, desc="train MTP heads", progress=progress,
              describe=lambda r: f"valid loss {r['valid_loss']:.3f}, accuracy per head {r['valid_accuracy']}")
    heldout_pos = positions(model, spread_windows(ids["heldout"], L + cfg.k + 1, cfg.heldout_tokens), cfg.k)
    heldout = evaluate(model, heads, heldout_pos)

    name = f"{base_name}-mtp"
    path = out_dir / f"{name}.gguf"
    base_sha = hashlib.sha256(Path(cfg.base).read_bytes()).hexdigest()
    about = corpus_log(base_cfg, corpus, fingerprint, ids)
    save_heads(heads, path, {"general.name": name, "mtp.base_sha256": base_sha,
                             "general.description": f"{cfg.k} multi-token-prediction heads for {base_name}"})
    log = {
        "name": name,
        "config": asdict(cfg),
        "heads": {"k": cfg.k, "architecture": HEAD_ARCHITECTURE, "file": path.name,
                  "parameters": sum(w.size for _, w in nn.utils.tree_flatten(heads.parameters())),
                  "file_bytes": path.stat().st_size},
        "base": {"name": base_name, "file": Path(cfg.base).name, "sha256": base_sha, "frozen": True},
        "corpus": {**about, "positions": {"train_pool": len(pool.hidden), "valid": len(valid.hidden),
                                          "heldout": len(heldout_pos.hidden)},
                   "split": f"the base model's ({base_name} preset in ref_impl.training.models)"},
        **run.log(),
        "heldout": heldout,
        "seconds": {"data_and_hidden_states": round(t_pool, 2), **run.times(), "total": round(clock() - t0, 2)},
    }
    command = (f"python -m ref_impl train --mtp {cfg.base} --steps {cfg.steps} --seed {cfg.seed}"
               + (f" --stdlib {cfg.stdlib} --corpus-python {about['python']}" if cfg.stdlib else ""))
    return write_log(out_dir / f"{name}.train.json", log, command)
