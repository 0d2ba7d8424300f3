"""The training text: the `.py` files of a Python standard library, split by a hash of each path.

No text can be downloaded while the book builds, so the course trains on the standard library of the
Python that runs it (found with `sysconfig`; nothing is copied into the repository), or of another
Python given by its `Lib/` directory. A fixed slice of the files, chosen by a hash of each file's
path, is held out: every perplexity in the book is measured on it. Another slice (valid) picks the
checkpoint; the rest is trained on.

See chapter: training
"""

from __future__ import annotations

import hashlib
import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from ref_impl.engine.tokenizer import Tokenizer


@dataclass
class CorpusConfig:
    """Which files, and how they split. The defaults are the shipped models' corpus."""
    heldout_percent: int = 5            # files never seen in training: the reported perplexity
    valid_percent: int = 3              # files that choose the checkpoint (the best of the evaluations)
    max_corpus_bytes: int = 0           # 0: the whole standard library
    stdlib: str = ""                    # another Python's Lib/ directory; "": this interpreter's
    corpus_python: str = ""             # the version of that Python (recorded in the log)


def stdlib_files(stdlib: str = "") -> tuple[Path, list[Path]]:
    """The standard library's directory and its .py files, in a fixed order (no site-packages)."""
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py")
                   if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts))
    if not files:
        raise ValueError(f"no .py files under {root}: is the standard library's source installed?")
    return root, files


def split_of(relative_path: str, cfg: CorpusConfig) -> str:
    """'heldout', 'valid' or 'train', from a hash of the file's path (stable across machines)."""
    bucket = int(hashlib.sha256(relative_path.encode()).hexdigest(), 16) % 100
    if bucket < cfg.heldout_percent:
        return "heldout"
    return "valid" if bucket < cfg.heldout_percent + cfg.valid_percent else "train"


def split_rule(cfg: CorpusConfig) -> str:
    """`split_of` in words, for the training log."""
    return (f"bucket = sha256(path relative to stdlib) % 100; heldout: bucket < {cfg.heldout_percent}; "
            f"valid: next {cfg.valid_percent}; train: the rest")


def read_corpus(cfg: CorpusConfig) -> tuple[dict[str, list[str]], str]:
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


def corpus_log(cfg: CorpusConfig, corpus: dict[str, list[str]], fingerprint: str,
               ids: dict[str, np.ndarray]) -> dict:
    """The corpus part of a training log: which Python's library, its fingerprint, and the size of each split."""
    return {"python": cfg.corpus_python or platform.python_version(),
            "stdlib": cfg.stdlib or sysconfig.get_paths()["stdlib"],
            "sha256": fingerprint,
            "files": {k: len(v) for k, v in corpus.items()},
            "characters": {k: sum(map(len, v)) for k, v in corpus.items()},
            "tokens": {k: int(len(v)) for k, v in ids.items()}}


def token_stream(tokenizer: Tokenizer, texts: list[str]) -> np.ndarray:
    """All texts as one stream of token ids, each file preceded by the BOS token."""
    ids = [tokenizer.encode(t, bos=True) for t in texts]
    return np.concatenate([np.array(i, dtype=np.int32) for i in ids])


def heldout_stream(tokenizer: Tokenizer, cfg: CorpusConfig | None = None) -> tuple[np.ndarray, str]:
    """The token stream of the held-out files (never trained on; default: the shipped models' split)
    and the corpus fingerprint: the text every perplexity in the book is measured on."""
    corpus, fingerprint = read_corpus(cfg or CorpusConfig())
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
