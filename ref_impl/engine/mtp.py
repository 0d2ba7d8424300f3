"""Multi-token prediction: small heads on a frozen model draft its next tokens, the model verifies.

Speculative decoding needs a cheap guess at the next few tokens. Instead of a second model
(speculative.py), k small heads read the model's own last hidden state h_t and head j (1..k)
guesses token t+1+j: the model's LM head already gives t+1, the heads reach further. This is
Medusa (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple
Decoding Heads", arXiv:2401.10774): each head is one residual block, h + SiLU(W h + b), whose
output goes through the model's LM head (here the frozen, tied embedding). W and b start at
zero, so before training every head repeats the model's next-token guess.

The heads read h_t *after* the final RMSNorm: it is what the LM head was trained to read, so a
zero block gives well-scaled logits from the first step, and the norm's scale is already folded in.

Self-speculative decoding then needs no draft model and no extra forward: the verification
forward over [y, d_1 .. d_γ] returns the hidden state of every position, and the one at the
last accepted position feeds the heads for the next step's drafts. Acceptance is
speculative.py's rule with q = the sampler's distribution over each head's logits, so sampled
output keeps the model's distribution exactly (the drafts may ignore y and each other: the rule
only needs q to be the distribution each draft was drawn from).

    python -m ref_impl train --mtp models/stdlib-10m.gguf --out models/

trains the heads (the model frozen; its hidden states on a pool of training windows computed
once) and writes `models/stdlib-10m-mtp.gguf` and its log `models/stdlib-10m-mtp.train.json`.

See chapter: speculative-decoding
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from tqdm import tqdm

from ref_impl.engine.generate import Sampler
from ref_impl.engine.kvcache import KVCache
from ref_impl.engine.model import Model, default_dtype, load
from ref_impl.engine.speculative import SpeculativeStep, rewind, take, verify
from ref_impl.formats import gguf
from ref_impl.training.train import config_for, read_corpus, sample_batch, token_stream

ARCHITECTURE = "mtp"
HEAD_ARCHITECTURE = "medusa-resblock: h + silu(W h + b), h after the final norm, then the base model's LM head"


class MTPHeads(nn.Module):
    """k Medusa heads for a model of width hidden_size; `base_model` names the model they were trained on."""

    def __init__(self, hidden_size: int, k: int, base_model: str = ""):
        super().__init__()
        if k < 1:
            raise ValueError(f"k (the number of heads) must be at least 1, got {k}")
        self.layers = [nn.Linear(hidden_size, hidden_size) for _ in range(k)]
        for layer in self.layers:      # zero blocks: every head starts as the model's next-token guess
            layer.weight, layer.bias = mx.zeros_like(layer.weight), mx.zeros_like(layer.bias)
        self.hidden_size, self.k, self.base_model = hidden_size, k, base_model

    def __call__(self, h: mx.array, n: int | None = None) -> mx.array:
        """The first n heads' states (..., n, hidden_size) from hidden states h (..., hidden_size);
        the base model's `logits` turns them into logits."""
        return mx.stack([h + nn.silu(layer(h)) for layer in self.layers[:n]], axis=-2)


def check_heads(heads: MTPHeads, model: Model) -> None:
    """Raise a ValueError naming the mismatch if heads cannot read this model's hidden states."""
    if heads.hidden_size != model.args.hidden_size:
        raise ValueError(f"the MTP heads read hidden states of width {heads.hidden_size} (trained on "
                         f"{heads.base_model or 'an unnamed model'}), the model's are {model.args.hidden_size}")


# ---------------------------------------------------------------------------------------- file

def gguf_names(k: int) -> dict[str, str]:
    """GGUF tensor name -> MTPHeads parameter name: head j (1..k) is mtp.<j>.weight and mtp.<j>.bias."""
    return {f"mtp.{j + 1}.{leaf}": f"layers.{j}.{leaf}" for j in range(k) for leaf in ("weight", "bias")}


def save_heads(heads: MTPHeads, path: str | Path, metadata: dict | None = None) -> None:
    """Write the heads as a float32 GGUF file, with metadata naming k, the width, the architecture and
    the base model (not a llama file: llama.cpp does not load it)."""
    params = dict(nn.utils.tree_flatten(heads.parameters()))
    tensors = {name: np.array(params[mlx_name].astype(mx.float32)) for name, mlx_name in gguf_names(heads.k).items()}
    gguf.write(path, {"general.architecture": ARCHITECTURE, "general.file_type": 0,
                      "mtp.head_count": heads.k, "mtp.embedding_length": heads.hidden_size,
                      "mtp.head_architecture": HEAD_ARCHITECTURE, "mtp.base_model": heads.base_model,
                      **(metadata or {})}, tensors)


def load_heads(path: str | Path, model: Model | None = None, dtype: mx.Dtype | None = None) -> MTPHeads:
    """Read heads written by save_heads, cast to dtype (default: the model's default); with a model,
    also check that they fit it. Every problem raises a ValueError naming the file and the cause."""
    with gguf.read(path) as f:
        meta = f.metadata
        if meta.get("general.architecture") != ARCHITECTURE:
            raise ValueError(f"{path} is not an MTP heads file (general.architecture is "
                             f"{meta.get('general.architecture')!r}, expected {ARCHITECTURE!r})")
        for key in ("mtp.head_count", "mtp.embedding_length", "mtp.head_architecture"):
            if key not in meta:
                raise ValueError(f"{path} lacks the metadata key {key!r}")
        if meta["mtp.head_architecture"] != HEAD_ARCHITECTURE:
            raise ValueError(f"{path} holds heads of another architecture: {meta['mtp.head_architecture']!r}")
        k, d = int(meta["mtp.head_count"]), int(meta["mtp.embedding_length"])
        heads = MTPHeads(d, k, str(meta.get("mtp.base_model", "")))
        names, expected = gguf_names(k), dict(nn.utils.tree_flatten(heads.parameters()))
        missing = sorted(set(names) - set(f.tensors))
        if missing:
            raise ValueError(f"{path} lacks tensor(s) {', '.join(missing)} for its {k} heads")
        extra = sorted(set(f.tensors) - set(names))
        if extra:
            raise ValueError(f"{path} has unexpected tensor(s) {', '.join(extra)} for {k} heads")
        for name, mlx_name in names.items():
            if tuple(f.tensors[name].shape) != expected[mlx_name].shape:
                raise ValueError(f"{path}: tensor {name!r} has shape {tuple(f.tensors[name].shape)}, "
                                 f"heads of width {d} need {expected[mlx_name].shape}")
        dtype = dtype or default_dtype()
        heads.load_weights([(mlx_name, mx.array(f.dequantize(name)).astype(dtype)) for name, mlx_name in names.items()])
    mx.eval(heads.parameters())
    if model is not None:
        check_heads(heads, model)
    return heads


# ---------------------------------------------------------------------------------------- decoding

def mtp_step(model: Model, heads: MTPHeads, cache: list[KVCache], y: mx.array, h: mx.array, gamma: int,
             sampler: Sampler, rng: np.random.Generator) -> tuple[SpeculativeStep, mx.array]:
    """One draft-then-verify step after the last emitted token y (1,), which the cache does not hold
    yet; h (hidden_size,) is the hidden state that predicted y.

    Returns the step (emitted tokens: accepted drafts, then one of the model's; the drafts; how many
    were accepted) and the hidden state that predicted the last emitted token (the next step's h).
    Afterwards the cache holds y and the accepted drafts.
    """
    head_logits = model.logits(heads(h, gamma))                        # (γ, V): guesses at y+1 .. y+γ
    drafts = sampler(head_logits)                                      # (γ,)
    hidden = model.hidden(mx.concatenate([y, drafts])[None], cache)[0]  # (γ+1, d) in one forward
    # q: what the drafts were drawn from, the sampler's distribution over each head's logits
    proposed, n, token = verify(model.logits(hidden), drafts, sampler.probs(head_logits), sampler, rng)
    rewind(cache, gamma - n)                                           # keep y and the n accepted drafts
    return SpeculativeStep(proposed[:n].tolist() + [token], gamma, n, proposed.tolist()), hidden[n]


def mtp_generate(model: Model, heads: MTPHeads, prompt: list[int], sampler: Sampler, cache: list[KVCache],
                 gamma: int = 3, rng: np.random.Generator | None = None) -> Iterator[SpeculativeStep]:
    """Yield one SpeculativeStep per model forward, forever; the caller stops it.

    Args:
        model: the frozen model the heads were trained on.
        heads: its MTP heads; gamma <= heads.k of them draft each step.
        prompt: token ids (at least one).
        sampler: the sampling settings, for the model and the heads alike. Its seed also seeds
            the acceptance draws unless rng is given.
        cache: an empty cache; each step may write γ+1 positions past the emitted tokens, then trims.

    The first step is the prefill's token (proposed 0). The emitted tokens are distributed as plain
    decoding of `model` with `sampler`, and with temperature 0 they are exactly its tokens.
    """
    check_heads(heads, model)
    if not prompt:
        raise ValueError("the prompt is empty: give at least one token (e.g. BOS)")
    if not 1 <= gamma <= heads.k:
        raise ValueError(f"gamma must be between 1 and the number of heads ({heads.k}), got {gamma}")
    rng = rng if rng is not None else np.random.default_rng(sampler.seed)
    h = model.hidden(mx.array([prompt]), cache)[0, -1]                  # (d,)
    y = sampler(model.logits(h[None]))
    yield SpeculativeStep([y.item()], 0, 0)
    while True:
        step, h = mtp_step(model, heads, cache, y, h, gamma, sampler, rng)
        yield step
        y = mx.array(step.tokens[-1:])


def mtp_decode(model: Model, heads: MTPHeads, prompt: list[int], max_tokens: int, gamma: int = 3,
               sampler: Sampler | None = None) -> tuple[list[int], list[SpeculativeStep]]:
    """Generate max_tokens tokens after the prompt, drafting with the heads; return them and the steps."""
    size = len(prompt) + max_tokens + gamma       # the last step may write γ+1 positions, then trim
    if size > model.args.max_position_embeddings:
        raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) + gamma ({gamma}) "
                         f"exceeds the model's context length ({model.args.max_position_embeddings})")
    return take(mtp_generate(model, heads, prompt, sampler or Sampler(), model.make_cache(size), gamma), max_tokens)


# ---------------------------------------------------------------------------------------- training

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

    The corpus and its split are the base model's (its preset in train.py); the hidden states of
    pool_tokens training positions (random windows led by BOS, as the base was trained) are
    computed once, then each step draws batch_size of them. The valid split picks the checkpoint;
    the held-out split is scored once, at the end.
    """
    if cfg.steps < 1:
        raise ValueError(f"steps must be at least 1, got {cfg.steps}")
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
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
    t_pool = time.perf_counter() - t0

    heads = MTPHeads(model.args.hidden_size, cfg.k, base_name)
    # no warm-up: the heads start as a working predictor (the model's own), not from noise
    schedule = optim.cosine_decay(cfg.learning_rate, cfg.steps, cfg.learning_rate / 10)
    optimizer = optim.AdamW(learning_rate=schedule, weight_decay=cfg.weight_decay)
    loss_and_grad = nn.value_and_grad(heads, lambda heads, h, t: head_loss(model, heads, h, t))
    state = [heads.state, optimizer.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step(h, t):
        loss, grads = loss_and_grad(heads, h, t)
        optimizer.update(heads, grads)
        return loss

    losses, evals, step_times = [], [], []
    best = (math.inf, 0, None)
    bar = tqdm(range(1, cfg.steps + 1), desc="train MTP heads", disable=not progress)
    for it in bar:
        ts = time.perf_counter()
        rows = rng.integers(0, len(pool.hidden), cfg.batch_size)
        loss = step(mx.array(pool.hidden[rows]), mx.array(pool.tokens[rows, 1:]))
        mx.eval(state, loss)
        step_times.append(time.perf_counter() - ts)
        losses.append(loss.item())
        if it % 10 == 0:
            bar.set_postfix(loss=f"{np.mean(losses[-10:]):.3f}")
        if it % cfg.eval_every == 0 or it == cfg.steps:
            per_head = evaluate(model, heads, valid)
            v = float(np.mean([e["loss"] for e in per_head[1:]]))
            evals.append({"step": it, "train_loss": float(np.mean(losses[-cfg.eval_every:])), "valid_loss": v,
                          "valid_accuracy": [round(e["accuracy"], 4) for e in per_head[1:]]})
            if progress:
                tqdm.write(f"step {it}: valid loss {v:.3f}, accuracy per head {evals[-1]['valid_accuracy']}")
            if v < best[0]:
                best = (v, it, [(n, mx.array(w)) for n, w in nn.utils.tree_flatten(heads.parameters())])
    heads.load_weights(best[2])
    t_train = time.perf_counter() - t0 - t_pool
    heldout_pos = positions(model, spread_windows(ids["heldout"], L + cfg.k + 1, cfg.heldout_tokens), cfg.k)
    heldout = evaluate(model, heads, heldout_pos)

    name = f"{base_name}-mtp"
    path = out_dir / f"{name}.gguf"
    base_sha = hashlib.sha256(Path(cfg.base).read_bytes()).hexdigest()
    python = cfg.corpus_python or platform.python_version()
    save_heads(heads, path, {"general.name": name, "mtp.base_sha256": base_sha,
                             "general.description": f"{cfg.k} multi-token-prediction heads for {base_name}"})
    from ref_impl.platform.machine import machine_info  # the same machine record the benchmarks write
    log = {
        "name": name,
        "config": asdict(cfg),
        "heads": {"k": cfg.k, "architecture": HEAD_ARCHITECTURE, "file": path.name,
                  "parameters": sum(w.size for _, w in nn.utils.tree_flatten(heads.parameters())),
                  "file_bytes": path.stat().st_size},
        "base": {"name": base_name, "file": Path(cfg.base).name, "sha256": base_sha, "frozen": True},
        "corpus": {"python": python, "stdlib": cfg.stdlib or sysconfig.get_paths()["stdlib"],
                   "sha256": fingerprint, "files": {k: len(v) for k, v in corpus.items()},
                   "tokens": {k: int(len(v)) for k, v in ids.items()},
                   "positions": {"train_pool": len(pool.hidden), "valid": len(valid.hidden),
                                 "heldout": len(heldout_pos.hidden)},
                   "split": f"the base model's ({base_name} preset in ref_impl.training.train)"},
        "loss_curve": [[i + 1, round(v, 4)] for i, v in enumerate(losses)],
        "evaluations": evals,
        "best_step": best[1],
        "heldout": heldout,
        "seconds": {"data_and_hidden_states": round(t_pool, 2), "training": round(t_train, 2),
                    "median_step": float(np.median(step_times)), "total": round(time.perf_counter() - t0, 2)},
        "machine": machine_info(),
        "command": f"python -m ref_impl train --mtp {cfg.base} --steps {cfg.steps} --seed {cfg.seed}"
                   + (f" --stdlib {cfg.stdlib} --corpus-python {python}" if cfg.stdlib else ""),
    }
    (out_dir / f"{name}.train.json").write_text(json.dumps(log, indent=1) + "\n")
    return log
