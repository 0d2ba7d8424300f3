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

The heads are trained on the frozen model by training/heads.py
(`python -m ref_impl train --mtp models/stdlib-10m.gguf --out models/`), which writes
`models/stdlib-10m-mtp.gguf`; this module reads, checks and decodes with them.

See chapter: speculative-decoding
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ref_impl.engine.generate import PREFILL_CHUNK, Sampler, check_room, prefill_hidden
from ref_impl.engine.kvcache import KVCache
from ref_impl.engine.model import Model, default_dtype
from ref_impl.engine.speculative import SpeculativeStep, check_gamma, rewind, take, verify
from ref_impl.formats import gguf

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
                 gamma: int = 3, rng: np.random.Generator | None = None,
                 chunk: int = PREFILL_CHUNK) -> Iterator[SpeculativeStep]:
    """Yield one SpeculativeStep per model forward, forever; the caller stops it.

    Args:
        model: the frozen model the heads were trained on.
        heads: its MTP heads; gamma <= heads.k of them draft each step.
        prompt: token ids (at least one).
        sampler: the sampling settings, for the model and the heads alike. Its seed also seeds
            the acceptance draws unless rng is given.
        cache: an empty cache; each step may write γ+1 positions past the emitted tokens, then trims.
        chunk: prompt positions per prefill pass (generate.prefill_hidden).

    The first step is the prefill's token (proposed 0). The emitted tokens are distributed as plain
    decoding of `model` with `sampler`, and with temperature 0 they are exactly its tokens.
    """
    check_heads(heads, model)
    check_gamma(gamma, heads.k)
    rng = rng if rng is not None else np.random.default_rng(sampler.seed)
    h = prefill_hidden(model, mx.array([prompt], dtype=mx.int32), cache, chunk)[0]   # (d,), the prompt in chunks
    y = sampler(model.logits(h[None]))
    yield SpeculativeStep([y.item()], 0, 0)
    while True:
        step, h = mtp_step(model, heads, cache, y, h, gamma, sampler, rng)
        yield step
        y = mx.array(step.tokens[-1:])


def mtp_decode(model: Model, heads: MTPHeads, prompt: list[int], max_tokens: int, gamma: int = 3,
               sampler: Sampler | None = None) -> tuple[list[int], list[SpeculativeStep]]:
    """Generate max_tokens tokens after the prompt, drafting with the heads; return them and the steps."""
    check_room(len(prompt), max_tokens, model.args.max_position_embeddings, gamma, "gamma")
    size = len(prompt) + max_tokens + gamma       # the last step may write γ+1 positions, then trim
    return take(mtp_generate(model, heads, prompt, sampler or Sampler(), model.make_cache(size), gamma), max_tokens)
