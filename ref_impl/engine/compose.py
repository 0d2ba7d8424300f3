"""The composed decoder: every technique of the book as a switch on one generation loop.

Each chapter built one technique in its own module. Two act on the model and are chosen when it is
loaded: the weights' format (checkpoint.load: floats, or MLX quantized matrices) and our CUDA
kernels (kernels.patch). The rest act on the decode loop and are the switches of `Techniques`:

* the KV cache: the float cache or any quantized scheme (kvquant.resolve's names), attention on the
  dequantized history or, for affine codes, fused on the codes themselves (kvquant);
* speculation: a draft model (speculative.py) or MTP heads (mtp.py) propose γ tokens that one forward
  of the model verifies by the exact rejection rule (with temperature 0, the argmax rule);
* the host side of plain decoding: async_eval pipelining and a compiled step (generate.py);
* pipeline stages: the layers split across processes that pass the hidden state over `mx.distributed`
  (pipeline.py runs them; each process loads only its share, so a split names a file, not a Model).

`generate` runs them together and returns a `Generation`: tokens, text, a clock reading per token,
the drafts proposed and accepted, peak memory; `Generation.summary` is the line the CLI prints. Its text
loop (`follow`: stop at EOS or max_tokens, stream text as it forms) is the one loop of every decoder:
the pipeline's first stage runs it too.

Not every pair composes. What cannot run as the chapters define it is refused with one ValueError
naming the pair: by `Techniques` itself, from the switches alone, before any model is loaded; by
`check_files` from the files' metadata, before their weights are read; by `check` on loaded models.
* A compiled step needs the float cache: mx.compile traces its buffers (generate.compiled_decoder).
* A compiled step decodes one position and a verification forward γ+1: compiling and speculating
  are exclusive.
* Speculation needs a cache that rewinds exactly (kvcache.Cache.rewinds_exactly). KIVI quantizes a
  key block once a forward's end passes it, so a verification of γ+1 positions sees a cache that
  one-at-a-time decoding never had (and a trim back re-rounds the block): its tokens would not be
  plain decoding's under the same cache.
* A draft model must share the model's vocabulary token for token; MTP heads must have been trained
  on the model (its width, and its name where both files carry one), and γ <= the number of heads.
* Pipeline stages decode plainly, one position per step through every stage: no speculation (a
  verification would cross every stage γ+1 positions wide, and its rewind reach every stage's cache) and
  no compiled step (one traced graph cannot span processes).
Pipelining is plain decoding's: a speculative step waits for its verification either way, so there
`pipeline` changes nothing, and the summary says so rather than claiming it.

With temperature 0 every combination emits exactly the tokens of plain greedy decoding under the
same cache (speculation verifies, it never changes the target); sampled, the tokens are distributed
as plain sampling under that cache. tests/test_compose.py checks both.

See chapter: capstone
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from ref_impl.engine.generate import PREFILL_CHUNK, Sampler, check_chunk, check_room, generate_step
from ref_impl.engine.kvcache import REWIND_MARGIN, KVCache
from ref_impl.engine.kvquant import FLOAT, FUSED, FUSED_CLASSES, cache_class
from ref_impl.engine.model import Model
from ref_impl.engine.mtp import MTPHeads, check_heads, mtp_generate
from ref_impl.engine.speculative import Drafter, SpeculativeStep, check_gamma, speculative_generate
from ref_impl.engine.tokenizer import Tokenizer
from ref_impl.formats import gguf
from ref_impl.platform.timing import clock

SPECULATORS = ("draft", "mtp")


@dataclass(frozen=True)
class Techniques:
    """The switches that act on the decode loop; a combination that cannot run raises a ValueError
    here, naming it (see the module docstring)."""
    kv: str = FLOAT                 # the KV-cache scheme: a name kvquant.resolve takes
    fused: bool = False             # attention on the cache's affine codes, not on a dequantized copy
    speculate: str | None = None    # "draft" (a draft model) or "mtp" (MTP heads) proposes, the model verifies
    gamma: int = 4                  # drafts per verification
    pipeline: bool = True           # plain decoding: queue step t+1 (async_eval) before reading step t
    compiled: bool = False          # plain decoding: one mx.compile'd step over the float cache
    stages: int = 1                 # processes the layers are split across (pipeline.py); 1: this one
    prefill_chunk: int = PREFILL_CHUNK   # prompt positions per prefill pass (generate.prefill_hidden)

    def __post_init__(self):
        cache = cache_class(self.kv)                    # an unknown scheme raises, naming the known ones
        if self.fused and cache not in FUSED_CLASSES:
            raise ValueError(f"--kv {self.kv} has no fused attention (mx.quantized_matmul reads affine codes "
                             f"only): fused schemes are {', '.join(FUSED)} and any affine or outlier family")
        if self.speculate not in (None, *SPECULATORS):
            raise ValueError(f"speculate must be one of {', '.join(SPECULATORS)} or None, got {self.speculate!r}")
        check_gamma(self.gamma)
        check_chunk(self.prefill_chunk)
        if self.compiled and cache is not KVCache:
            raise ValueError(f"a compiled step traces the float cache's buffers; --compile cannot decode with "
                             f"--kv {self.kv}")
        if self.compiled and self.speculate:
            raise ValueError(f"a compiled step decodes one position and a verification forward gamma+1: "
                             f"--compile and --{self.speculate} are exclusive")
        if self.stages < 1:
            raise ValueError(f"--pipeline takes a number of stages of at least 1, got {self.stages}")
        if self.stages > 1 and (self.speculate or self.compiled):
            what = f"--{self.speculate}" if self.speculate else "--compile"
            raise ValueError(f"--pipeline {self.stages} decodes one position per step through every stage; "
                             f"{what} is not built for a split model (see engine/compose.py)")
        if self.speculate and not cache.rewinds_exactly:
            raise ValueError(f"--kv {self.kv} cannot be rewound exactly (its key blocks are quantized when a "
                             f"forward passes them), so --{self.speculate} would not emit plain decoding's "
                             f"tokens; use a per-token scheme (sym, affine, outlier)")

    def cache_size(self, prompt_len: int, max_tokens: int) -> int:
        """Positions the caches need: plain decoding builds the step after each token before yielding it
        (token k needs prompt_len + k + 1); a last verification may write gamma positions past the tokens."""
        return prompt_len + max_tokens + (self.gamma if self.speculate else 0)

    def describe(self) -> str:
        """What these switches run, in words: the cache, the speculation, the loop."""
        kv = "float" if cache_class(self.kv) is KVCache else self.kv
        kv += " (fused attention)" if self.fused else " (dequantized)" if kv != "float" else ""
        if self.speculate:
            loop = f"{self.speculate} gamma={self.gamma}, one sync per verification"
        elif self.stages > 1:
            loop = f"{self.stages} pipeline stages over mx.distributed (ring), synchronous"
        else:
            loop = ("compiled step, " if self.compiled else "") + ("pipelined" if self.pipeline else "synchronous")
        return f"kv {kv}, {loop}"


def check_files(metadata: dict, model: str | Path, draft: str | Path | None = None,
                heads: str | Path | None = None) -> None:
    """Refuse, from the files' metadata alone (no weights read; `metadata` is the model file's), a draft model
    whose vocabulary is not the model's, or MTP heads trained on another model: a ValueError naming both files."""
    arch = metadata.get("general.architecture")
    tokens, width = metadata.get("tokenizer.ggml.tokens"), metadata.get(f"{arch}.embedding_length")
    name = metadata.get("general.name")
    if draft is not None:
        with gguf.read(draft) as f:
            theirs = f.metadata.get("tokenizer.ggml.tokens")
        if tokens is None or theirs is None:
            raise ValueError(f"draft {draft} cannot propose tokens for {model}: "
                             f"{draft if theirs is None else model} has no vocabulary")
        if list(tokens) != list(theirs):
            same = ", same count, different tokens" if len(theirs) == len(tokens) else ""
            raise ValueError(f"draft {draft} cannot propose tokens for {model}: it has another vocabulary "
                             f"({len(theirs)} tokens, the model's {len(tokens)}{same})")
    if heads is not None:
        with gguf.read(heads) as f:
            base, d = f.metadata.get("mtp.base_model"), f.metadata.get("mtp.embedding_length")
        if base and name and base != name:
            raise ValueError(f"MTP heads {heads} were trained on {base!r}, not on {model} ({name!r})")
        if d is not None and width is not None and int(d) != int(width):
            raise ValueError(f"MTP heads {heads} read hidden states of width {d}; {model}'s are {width}")


def check(model: Model, techniques: Techniques, proposer: Model | MTPHeads | None) -> None:
    """Refuse a proposer that does not fit the switches or the model (ValueError, naming it)."""
    want = {"draft": Model, "mtp": MTPHeads, None: type(None)}[techniques.speculate]
    if not isinstance(proposer, want):
        raise ValueError(f"speculate={techniques.speculate!r} needs a {want.__name__} proposer, "
                         f"got {type(proposer).__name__}")
    if isinstance(proposer, Model) and proposer.args.vocab_size != model.args.vocab_size:
        raise ValueError(f"the draft model has {proposer.args.vocab_size} tokens, the model {model.args.vocab_size}: "
                         "a draft must share the model's vocabulary")
    if isinstance(proposer, MTPHeads):
        check_heads(proposer, model)
        check_gamma(techniques.gamma, proposer.k)
    for m in (model, proposer) if isinstance(proposer, Model) else (model,):
        if m.args.sliding_window and techniques.speculate and techniques.gamma + 1 > REWIND_MARGIN:
            raise ValueError(f"gamma {techniques.gamma}: a sliding-window layer's cache keeps {REWIND_MARGIN} "
                             "positions to rewind, and a verification may reject gamma + 1")
        if techniques.compiled and not m.args.plain_attention:
            raise ValueError(f"a compiled step attends over the whole float buffer: --compile cannot decode a "
                             f"{m.args.architecture} model's sliding-window or soft-capped attention")


def steps(model: Model, prompt: list[int], sampler: Sampler, techniques: Techniques, size: int,
          proposer: Model | MTPHeads | None = None) -> Iterator[SpeculativeStep]:
    """The decode loop the switches choose, as one SpeculativeStep per model forward (plain decoding:
    one token, nothing proposed), forever; caches for `size` positions are built here."""
    t = techniques
    cache = model.make_cache(size, scheme=t.kv, fused=t.fused)
    if t.speculate == "draft":
        drafter = Drafter(proposer, proposer.make_cache(size), sampler)
        return speculative_generate(model, drafter, prompt, sampler, cache, t.gamma, chunk=t.prefill_chunk)
    if t.speculate == "mtp":
        return mtp_generate(model, proposer, prompt, sampler, cache, t.gamma, chunk=t.prefill_chunk)
    return (SpeculativeStep([y], 0, 0)
            for y in generate_step(model, prompt, sampler, cache, t.pipeline, t.compiled, t.prefill_chunk))


@dataclass
class Generation:
    """The tokens, the text, the per-token clock readings and what ran, of one generation."""
    prompt_tokens: list[int]
    techniques: Techniques = field(default_factory=Techniques)
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    start: float = 0.0                                        # clock before prefill
    token_times: list[float] = field(default_factory=list)    # clock when each token arrived
    forwards: int = 0                                         # model forwards after the prefill's
    proposed: int = 0                                         # drafts proposed
    accepted: int = 0                                         # drafts accepted
    peak_memory_bytes: int = 0                                # MLX's peak allocation while generating

    @property
    def ttft(self) -> float:
        """Seconds from the start to the first generated token (prefill + one sample)."""
        return self.token_times[0] - self.start if self.token_times else float("nan")

    @property
    def inter_token_latencies(self) -> np.ndarray:
        """Seconds between consecutive generated tokens (0 between tokens of one verification)."""
        return np.diff(np.array(self.token_times))

    @property
    def decode_tokens_per_s(self) -> float:
        """Decode throughput: tokens after the first over the time they took."""
        itl = self.inter_token_latencies
        return len(itl) / itl.sum() if len(itl) and itl.sum() > 0 else float("nan")

    @property
    def prefill_tokens_per_s(self) -> float:
        return len(self.prompt_tokens) / self.ttft

    @property
    def acceptance(self) -> float:
        """α: the share of proposed drafts accepted (NaN when nothing was proposed)."""
        return self.accepted / self.proposed if self.proposed else float("nan")

    def summary(self) -> str:
        """One line: what ran, acceptance where speculative, TTFT, ITL p50/p99, tok/s, peak memory."""
        itl = self.inter_token_latencies * 1e3
        p50, p99 = (np.percentile(itl, [50, 99]) if len(itl) else (float("nan"),) * 2)
        spec = (f"; acceptance {self.acceptance:.2f} ({self.accepted}/{self.proposed} drafts), "
                f"{(len(self.tokens) - 1) / max(self.forwards, 1):.2f} tokens per forward") if self.proposed else ""
        return (f"[{len(self.prompt_tokens)} prompt tokens, {len(self.tokens)} generated] {self.techniques.describe()}"
                f"{spec}; TTFT {self.ttft * 1e3:.1f} ms, ITL p50 {p50:.2f} ms p99 {p99:.2f} ms, "
                f"decode {self.decode_tokens_per_s:.1f} tok/s, peak memory {self.peak_memory_bytes / 1e6:.1f} MB")


def generate(model: Model, tokenizer: Tokenizer, prompt: str | list[int], max_tokens: int = 64,
             sampler: Sampler | None = None, techniques: Techniques = Techniques(),
             proposer: Model | MTPHeads | None = None, stop_at_eos: bool = True,
             on_text: Callable[[str], None] | None = None) -> Generation:
    """Generate up to max_tokens after the prompt with the switches of `techniques` (a draft model or MTP
    heads as the proposer when speculating); stream text pieces to on_text as they form.

    A str prompt is encoded with BOS first; a list is taken as token ids.
    """
    if techniques.stages > 1:
        raise ValueError(f"{techniques.stages} pipeline stages run in as many processes, each loading its "
                         "share of the file: use engine.pipeline.generate, which takes the file")
    check(model, techniques, proposer)
    ids = tokenizer.encode(prompt, bos=True) if isinstance(prompt, str) else list(prompt)
    size = techniques.cache_size(len(ids), max_tokens)
    models = [model] + ([proposer] if isinstance(proposer, Model) else [])
    check_context(len(ids), max_tokens, techniques, min(m.args.max_position_embeddings for m in models))
    sampler = sampler or Sampler()
    mx.reset_peak_memory()
    out = Generation(prompt_tokens=ids, techniques=techniques, start=clock())
    return follow(steps(model, ids, sampler, techniques, size, proposer), out, tokenizer, max_tokens,
                  stop_at_eos, on_text)


def check_context(prompt_len: int, max_tokens: int, techniques: Techniques, context: int) -> None:
    """Refuse max_tokens < 1, or a generation whose cache would outgrow the model's context (ValueError)."""
    reserve = techniques.cache_size(prompt_len, max_tokens) - prompt_len - max_tokens
    check_room(prompt_len, max_tokens, context, reserve, "gamma")


def follow(model_steps: Iterator[SpeculativeStep], out: Generation, tokenizer: Tokenizer | None,
           max_tokens: int, stop_at_eos: bool = True, on_text: Callable[[str], None] | None = None) -> Generation:
    """The text loop of every decoder: take steps until max_tokens or EOS, stamping the clock as each
    step's tokens arrive and streaming text to on_text as it forms (a character whose bytes are still
    incomplete is held back); fills and returns `out`. Without a tokenizer (random weights) no text
    forms and only max_tokens stops."""
    stream = tokenizer.stream() if tokenizer is not None else None   # constant work per token, however long the answer
    end_ids = tokenizer.end_ids if tokenizer is not None and stop_at_eos else ()
    pieces = [out.text] if out.text else []

    def emit(piece: str) -> None:
        if piece:
            pieces.append(piece)
            if on_text is not None:
                on_text(piece)

    for step in model_steps:
        now = clock()
        out.forwards += 1 if out.token_times else 0
        out.proposed, out.accepted = out.proposed + step.proposed, out.accepted + step.accepted
        done = False
        for token in step.tokens:
            done = len(out.tokens) == max_tokens or token in end_ids
            if done:
                break
            out.tokens.append(token)
            out.token_times.append(now)
            if stream is not None:
                emit(stream.add(token))
        if done or len(out.tokens) == max_tokens:
            break
    out.peak_memory_bytes = mx.get_peak_memory()
    if stream is not None:
        emit(stream.flush())
    out.text = "".join(pieces)
    return out
