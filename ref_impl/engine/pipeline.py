"""Pipeline-parallel decoding: a model's layers split across processes that pass the hidden state on.

When a model outgrows one machine, several can hold it: stage s of N keeps a contiguous span of layers
(`split`) and their KV caches, the first stage also the embedding, the last the final norm, the LM head
and the sampler. Each step the first stage embeds the token and runs its layers; the hidden state goes to
stage 1, which runs its layers and passes it on; the last stage samples the next token and sends it back
to the first, which closes the ring. Only activations cross a link, a few kilobytes per token, where
streaming the weights over it (theory/interconnect.py, C08) moves gigabytes.

The stages talk through `mx.distributed` with MLX's ring backend (TCP sockets, so it runs on any
machine): each process reads its rank from MLX_RANK and every rank's address from the hostfile
MLX_HOSTFILE names, as MLX's launcher writes them (`mlx.launch --backend ring`; engine/launch.py does the
same on one host). The ring backend sends only to a rank's two neighbours, which is all a pipeline
needs: s -> s+1, and the last stage -> 0.

Protocol, per step and hop s -> s+1: a header (one int32: the positions that follow; 0 stops the stage,
which passes the 0 on and exits), then the hidden states (1, L, d) in the model's dtype, the two as one
message of bytes in decode steps (L = 1); from the last stage to the first, the token (one int32). The
prompt goes through in chunks of config.prefill_chunk positions, each its own header and states; its
header counts the prompt's positions still to come, this chunk's included, so a stage sizes its caches
at the first and knows the last (the only one the last stage samples after) without another message. A
decoded token puts (N-1)(4 + d x dtype bytes) + 4 bytes on the links (interconnect.pipeline_link_bytes);
MLX's ring writes an array's bytes with no framing of its own, which the kernel's counters confirm
(platform/tcp.py, recorded by `bench --pipeline`). The token comes back to the first stage alone, over
the ring's closing hop: no other stage reads it, and a broadcast (all_sum) would cost N-1 hops.

Greedy tokens are plain decoding's: each stage applies `Model`'s own operations (embed_tokens, blocks,
norm, logits) to the values a single process would, and the hidden state crosses bit for bit. The first
stage's loop is compose.follow, the text loop of every decoder.

References: MLX documentation, "Distributed Communication" (mx.distributed, the ring backend) and
"Launching Distributed Programs" (mlx.launch, the hostfile):
https://ml-explore.github.io/mlx/build/html/usage/distributed.html; mlx/distributed/ring/ring.cpp
(send and recv to neighbours only, raw array bytes).

See chapter: pipeline
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ref_impl.engine import chat
from ref_impl.engine.checkpoint import load, model_args
from ref_impl.engine.compose import Generation, Techniques, check_context, follow
from ref_impl.engine.generate import PREFILL_CHUNK, Sampler
from ref_impl.engine.kvquant import FLOAT, make_caches
from ref_impl.engine.launch import Ranks, Ring, check_ports, emit, free_ports
from ref_impl.engine.model import DTYPES, Model, ModelArgs, default_dtype
from ref_impl.engine.random import args_for, random_model
from ref_impl.engine.speculative import SpeculativeStep
from ref_impl.formats import gguf
from ref_impl.platform.tcp import Connections
from ref_impl.platform.timing import clock, wall
from ref_impl.theory.interconnect import HEADER_BYTES, pipeline_link_bytes
from ref_impl.theory.shapes import PUBLIC, STAND_INS

@dataclass(frozen=True)
class PipelineConfig:
    """One pipeline run: what to decode, how, and where the ranks listen. Every rank gets it as JSON."""
    model: str                          # a GGUF file, or a shape of theory/shapes.py (random weights, seeded)
    stages: int = 2
    prompt: str | tuple[int, ...] = ""  # text (encoded with BOS by the first stage) or token ids
    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0                       # the sampler's, and a random model's weights'
    kv: str = FLOAT
    fused: bool = False
    weights: str = "float"              # "native": quantized tensors stay MLX quantized (checkpoint.load)
    dtype: str | None = None            # a key of DTYPES; None: model.default_dtype()
    chat: bool = False                  # the prompt was laid out by the file's chat template (chat.encode)
    stop_at_eos: bool = True
    trace: bool = False                 # stamp every step and read the links' byte counters (bench --pipeline)
    host: str = "127.0.0.1"
    port: int = 0                       # rank r listens on port + r; 0: ports the OS reports free
    timeout_s: float = 120.0            # a pipeline silent this long is stopped (engine/launch.py)
    context: int = 4096                 # a random model's context length
    prefill_chunk: int = PREFILL_CHUNK  # prompt positions a stage runs and passes on at once

    def __post_init__(self):
        if isinstance(self.prompt, list):
            object.__setattr__(self, "prompt", tuple(self.prompt))
        bad = [f"{name}={value!r} ({rule})" for name, value, rule, ok in [
            ("max_tokens", self.max_tokens, "at least 1", self.max_tokens >= 1),
            ("weights", self.weights, "float or native", self.weights in ("float", "native")),
            ("dtype", self.dtype, f"one of {', '.join(DTYPES)} or None", self.dtype in (None, *DTYPES)),
            ("timeout_s", self.timeout_s, "positive", self.timeout_s > 0),
            ("port", self.port, "0 or 1024..65535 less the stages",
             self.port == 0 or 1024 <= self.port <= 65536 - self.stages)] if not ok]
        if bad:
            raise ValueError("invalid pipeline settings: " + ", ".join(bad))
        self.techniques()                                   # stages >= 1, the cache scheme
        self.sampler()

    def techniques(self) -> Techniques:
        """The decode loop's switches this run uses (they refuse what a pipeline cannot run)."""
        return Techniques(kv=self.kv, fused=self.fused, pipeline=False, stages=self.stages,
                          prefill_chunk=self.prefill_chunk)

    def sampler(self) -> Sampler:
        """The last stage's sampler (seeded: every run of a config samples the same tokens)."""
        return Sampler(self.temperature, self.top_k, self.top_p, self.seed)

    def to_json(self) -> str:
        """The config as the one argument of every rank's command line."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> PipelineConfig:
        """A rank's config from its command line (validated again, as any config)."""
        return cls(**json.loads(text))


def is_shape(model: str) -> bool:
    """Whether `model` names a shape of theory/shapes.py (random weights) rather than a GGUF file."""
    return model in PUBLIC or model in STAND_INS


def model_args_of(model: str, context: int = 4096) -> ModelArgs:
    """The hyper-parameters of a GGUF file (its metadata; no weight is read) or of a named shape."""
    if is_shape(model):
        return args_for(model, context)
    with gguf.read(model) as f:
        return model_args(f)


def split(n_layers: int, stages: int) -> list[range]:
    """Contiguous spans of layers, one per stage, sizes differing by at most one (the first stages take
    the extra layers: the last one also runs the LM head). A ValueError when a stage would get none."""
    if not 1 <= stages <= n_layers:
        raise ValueError(f"--pipeline {stages}: the model has {n_layers} layers, and each of 1 to {n_layers} "
                         "stages needs at least one")
    sizes = [n_layers // stages + (s < n_layers % stages) for s in range(stages)]
    starts = np.cumsum([0, *sizes])
    return [range(int(a), int(b)) for a, b in zip(starts[:-1], starts[1:])]


def hold(model: Model, span: range, first: bool, last: bool) -> None:
    """Remove from a freshly built model what a stage does not hold: the other stages' layers (an empty
    module keeps the numbering), the embedding unless the stage embeds or its LM head is the tied
    embedding, the untied LM head unless it is the last. Their weights are then never read or computed."""
    model.layers = [layer if i in span else nn.Module() for i, layer in enumerate(model.layers)]
    tied = model.args.tie_word_embeddings
    if not (first or last and tied):
        model.pop("embed_tokens")
    if not last and not tied:
        model.pop("lm_head")


def describe(spans: list[range]) -> list[str]:
    """Each stage in words, for messages: 'stage 1 of 2 (layers 3-5)', 'stage 3 of 4 (layer 5)'."""
    return [f"stage {s} of {len(spans)} " + (f"(layers {r.start}-{r.stop - 1})" if len(r) > 1 else f"(layer {r.start})")
            for s, r in enumerate(spans)]


@dataclass
class Stage:
    """One rank: its layers, its caches, and its half of the protocol with its neighbours."""
    config: PipelineConfig
    rank: int
    span: range
    model: Model
    dtype: mx.Dtype
    links: Connections | None = None       # the kernel's view of this stage's sockets (Linux)
    caches: list | None = None
    sampler: Sampler | None = None
    trace: list[dict] = field(default_factory=list)
    sent_bytes: int = 0                    # bytes this stage handed to mx.distributed.send

    @property
    def first(self) -> bool:
        """Whether this stage embeds the tokens (and leads: it runs the text loop)."""
        return self.rank == 0

    @property
    def last(self) -> bool:
        """Whether this stage runs the head and samples."""
        return self.rank == self.config.stages - 1

    def start(self, positions: int) -> None:
        """Caches for the prompt's positions and every token after it, as compose.generate sizes them."""
        a, t = self.model.args, self.config.techniques()
        size = t.cache_size(positions, self.config.max_tokens)
        self.caches = make_caches(t.kv, len(self.span), 1, a.num_key_value_heads, a.head_dim, size, self.dtype,
                                  fused=t.fused)

    def forward(self, x: mx.array, sample: bool = True) -> mx.array:
        """This stage's share of Model.__call__: token ids (first stage) or hidden states (1, L, d) in, hidden
        states out, or on the last stage the token sampled after the last position (1,); a prompt's earlier
        chunks (sample False) stop at the caches there (their arrays, to evaluate). The LM head reads one
        position, never L."""
        m = self.model
        h = m.embed(x) if self.first else x
        h = m.blocks(h, self.caches, self.span.start, self.span.stop)
        if not self.last:
            return h
        if not sample:          # evaluated as far as the cache: the last layer's output is nobody's input
            return [b for c in self.caches for b in c.buffers()]
        return self.sampler(m.logits(m.norm(h[:, -1, :])))

    def send(self, x: mx.array, dst: int) -> None:
        """Send one array to a neighbour (evaluated: it has left when this returns), counting its bytes."""
        mx.eval(mx.distributed.send(x, dst))
        self.sent_bytes += x.nbytes

    def send_hidden(self, h: mx.array | None, remaining: int = 0) -> None:
        """To the next stage: a prompt chunk's hidden states as a header (the prompt's positions still to come,
        `remaining`, this chunk's included), then the states; a decode step's as one message, the 4-byte
        header (1) and then the state's bytes; a stop (h None) as a decode step's message with header 0. One
        message per decode hop: one eval, one wake-up, each side."""
        nxt = self.rank + 1
        if remaining:
            self.send(mx.array([remaining], dtype=mx.int32), nxt)
            self.send(h.astype(self.dtype), nxt)
            return
        header = mx.array([0 if h is None else 1], dtype=mx.int32)
        body = mx.zeros((self.model.args.hidden_size,), self.dtype) if h is None else h.astype(self.dtype)
        self.send(mx.concatenate([header.view(mx.uint8), body.reshape(-1).view(mx.uint8)]), nxt)

    def recv_hidden(self, prefill: bool = False) -> tuple[mx.array | None, int]:
        """The previous stage's hidden states (1, L, d) as send_hidden sent them, or None for a stop; and, for
        a prompt chunk, the prompt's positions still to come, this chunk's included (0 otherwise)."""
        prev, d = self.rank - 1, self.model.args.hidden_size
        self.wait()
        n = 0
        if prefill:
            n = int(mx.distributed.recv((1,), mx.int32, prev).item())   # a stop's header reads 0 here too
            h = mx.distributed.recv((1, min(n, self.config.prefill_chunk), d), self.dtype, prev) if n else None
        else:
            msg = mx.distributed.recv((HEADER_BYTES + d * self.dtype.size,), mx.uint8, prev)
            mx.eval(msg)
            n = int(msg[:HEADER_BYTES].view(mx.int32).item())
            h = msg[HEADER_BYTES:].view(self.dtype).reshape(1, 1, d) if n else None
        if h is not None:
            mx.eval(h)
        return h, n

    def wait(self) -> None:
        """Sleep in the kernel until the next message starts to arrive, then let MLX's ring read it: its
        socket threads would poll for it meanwhile, a core per waiting stage (on one host, the computing
        stage's core)."""
        if self.links is not None:
            self.links.wait_readable()

    def stamp(self, step: int, positions: int, **times: float) -> None:
        """One step's instants (wall clock, comparable across processes) and the kernel's byte counter."""
        if self.config.trace:
            rx = self.links.received() if self.links is not None else None
            self.trace.append({"step": step, "positions": positions, **times, "rx": rx, "sent": self.sent_bytes,
                               "cpu": time.process_time()})


def first_steps(stage: Stage, prompt: list[int]) -> Iterator[SpeculativeStep]:
    """The first stage's decode loop, one token per step, for compose.follow: embed and run its layers,
    pass the hidden state on, wait for the token to come back around the ring (N = 1: sample it here).
    The first step runs the prompt chunk by chunk (its times span them all)."""
    chunk = stage.config.prefill_chunk
    pieces, step = [prompt[i:i + chunk] for i in range(0, len(prompt), chunk)], 0
    stage.start(len(prompt))
    while True:
        t_in = wall()
        for k, piece in enumerate(pieces):
            out = stage.forward(mx.array([piece], dtype=mx.int32), sample=k == len(pieces) - 1)
            mx.eval(out)
            if not stage.last:
                stage.send_hidden(out, remaining=len(prompt) - k * chunk if step == 0 else 0)
        t_done, positions = wall(), len(prompt) if step == 0 else 1
        if stage.last:                                      # one stage: the token is already here
            y = int(out.item())
            stage.stamp(step, positions, t_in=t_in, t_done=t_done, t_sent=t_done, t_back=t_done)
        else:
            t_sent = wall()
            stage.wait()
            y = int(mx.distributed.recv((1,), mx.int32, stage.config.stages - 1).item())
            stage.stamp(step, positions, t_in=t_in, t_done=t_done, t_sent=t_sent, t_back=wall())
        yield SpeculativeStep([y], 0, 0)
        pieces, step = [[y]], step + 1


def serve(stage: Stage) -> None:
    """A later stage's loop: receive, run its layers, pass the hidden state on (the last stage: send the
    token back to the first), until a stop arrives, which it passes on."""
    step, left, begun = 0, -1, {}          # left: the prompt's positions still to come (-1: not yet begun)
    while True:
        begun.setdefault("t_wait", wall())  # a step's first message: the prompt's first chunk, or the token's
        h, remaining = stage.recv_hidden(prefill=left != 0)
        if h is None:
            if not stage.last:
                stage.send_hidden(None)
            return
        begun.setdefault("t_in", wall())
        if stage.caches is None:
            stage.start(remaining)
        left = remaining - h.shape[1] if remaining else 0
        out = stage.forward(h, sample=left == 0)
        mx.eval(out)
        t_done = wall()
        if stage.last and left == 0:
            stage.send(out.astype(mx.int32), 0)
        elif not stage.last:
            stage.send_hidden(out, remaining)
        if left == 0:                       # the step is done: one stamp, whatever its chunks
            stage.stamp(step, stage.caches[0].offset if step == 0 else 1, **begun, t_done=t_done, t_sent=wall())
            step, begun = step + 1, {}


def join(config: PipelineConfig) -> int:
    """This process's rank: mx.distributed's ring group from MLX_RANK and MLX_HOSTFILE (one stage: 0, no
    group). A ValueError when the hostfile's ranks are not the config's stages."""
    if config.stages == 1:
        return 0
    group = mx.distributed.init(strict=True, backend="ring")
    if group.size() != config.stages:
        raise ValueError(f"the hostfile lists {group.size()} ranks; the pipeline has {config.stages} stages")
    return group.rank()


def load_stage(config: PipelineConfig, rank: int) -> tuple[Stage, object | None]:
    """The rank's stage, its share of the weights loaded (a file) or computed (a shape, seeded), and the
    tokenizer (a file's; None for random weights)."""
    spans = split(model_args_of(config.model, config.context).num_hidden_layers, config.stages)
    span, first, last = spans[rank], rank == 0, rank == config.stages - 1
    dtype = DTYPES[config.dtype] if config.dtype else default_dtype()

    def keep(m: Model) -> None:
        hold(m, span, first, last)

    if is_shape(config.model):
        model, tokenizer = random_model(args_for(config.model, config.context), dtype, config.seed, keep), None
    else:
        model, tokenizer = load(config.model, dtype, config.weights == "native", keep)
    stage = Stage(config, rank, span, model, dtype, sampler=config.sampler() if last else None)
    if config.stages > 1:
        ports = {int(a.rsplit(":", 1)[1]) for r in json.loads(Path(os.environ["MLX_HOSTFILE"]).read_text())
                 for a in r}
        stage.links = Connections.find(ports)
    return stage, tokenizer


def lead(stage: Stage, tokenizer) -> Generation:
    """The first stage's run: encode the prompt, decode through the ring with compose.follow (the text
    loop every decoder shares), streaming text as events, then stop the other stages."""
    c, t = stage.config, stage.config.techniques()
    if isinstance(c.prompt, str):
        if tokenizer is None:
            raise ValueError(f"{c.model} has random weights and no tokenizer: give the prompt as token ids")
        ids = chat.encode(tokenizer, c.prompt) if c.chat else tokenizer.encode(c.prompt, bos=True)
    else:
        ids = list(c.prompt)
    check_context(len(ids), c.max_tokens, t, stage.model.args.max_position_embeddings)
    mx.reset_peak_memory()
    out = Generation(prompt_tokens=ids, techniques=t, start=clock())
    try:
        return follow(first_steps(stage, ids), out, tokenizer, c.max_tokens, c.stop_at_eos,
                      on_text=lambda s: emit({"event": "text", "text": s}))
    finally:
        if not stage.last:
            stage.send_hidden(None)


def main(argv: list[str] | None = None) -> int:
    """A rank's entry point (`python -m ref_impl.engine.pipeline CONFIG_JSON`, under engine/launch.py or
    `mlx.launch --backend ring`): events on stdout, a failure as one line on stderr and status 2."""
    config = PipelineConfig.from_json((argv or sys.argv[1:])[0])
    rank = int(os.environ.get("MLX_RANK", "0"))
    try:
        rank = join(config)
        stage, tokenizer = load_stage(config, rank)
        emit({"event": "ready", "rank": rank, "span": [stage.span.start, stage.span.stop]})
        if stage.first:
            g = lead(stage, tokenizer)
            held = "MLX quantized" if config.weights == "native" else str(stage.dtype).split(".")[-1]
            emit({"event": "done", "tokens": g.tokens, "text": g.text, "prompt_tokens": g.prompt_tokens,
                  "summary": g.summary(), "held": held})
        else:
            serve(stage)
        emit({"event": "trace", "rank": rank, "trace": stage.trace, "sent_bytes": stage.sent_bytes,
              "hidden": stage.model.args.hidden_size, "act_bytes": stage.dtype.size})
    except Exception as e:                         # noqa: BLE001 -- the launcher reports it, by rank
        print(f"error: stage {rank}: " + " ".join(str(e).split()), file=sys.stderr, flush=True)
        return 2
    return 0


@dataclass
class PipelineRun:
    """What a pipeline run gave: the first stage's tokens, text and summary line, every stage's trace."""
    config: PipelineConfig
    spans: list[range]
    tokens: list[int] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    text: str = ""
    summary: str = ""
    held: str = ""
    traces: dict[int, dict] = field(default_factory=dict)    # rank -> its "trace" event
    seconds: float = 0.0                                      # from launch to the last rank's exit

    def link_bytes_per_token(self) -> int:
        """What the protocol puts on the links per decoded token (interconnect.pipeline_link_bytes)."""
        t = next(iter(self.traces.values()))
        return pipeline_link_bytes(t["hidden"], t["act_bytes"], self.config.stages)


def check(config: PipelineConfig) -> tuple[list[range], tuple[int, ...]]:
    """The stages' layer spans and the ranks' ports, before any process starts: a ValueError for more
    stages than layers (the file's metadata alone is read), an OSError for a port another program holds."""
    spans = split(model_args_of(config.model, config.context).num_hidden_layers, config.stages)
    if config.port:
        ports = tuple(range(config.port, config.port + config.stages))
        check_ports(config.host, ports)
        return spans, ports
    return spans, free_ports(config.host, config.stages)


BLAS_THREAD_TIMEOUT = "4"   # OpenBLAS idle threads spin 2^4 cycles, not its default 2^28, before they sleep


def blas_env() -> dict[str, str]:
    """OpenBLAS settings for the stages on one host, unless set already: every stage gets every core (the
    stages take turns, and a waiting one sleeps), and a stage's idle BLAS threads sleep at once instead of
    spinning on the cores the next stage computes on (platform/blas.py says what spinning threads cost)."""
    return {"OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS") or str(os.cpu_count() or 1),
            "OPENBLAS_THREAD_TIMEOUT": os.environ.get("OPENBLAS_THREAD_TIMEOUT") or BLAS_THREAD_TIMEOUT}


def generate(config: PipelineConfig, on_text: Callable[[str], None] | None = None) -> PipelineRun:
    """Decode with the model split over config.stages processes on this host (engine/launch.py), text
    streamed to on_text. Refused before any process starts: more stages than layers, a port in use."""
    spans, ports = check(config)
    run, t0 = PipelineRun(config, spans), clock()
    ring = Ring(config.host, ports)
    with Ranks("ref_impl.engine.pipeline", [config.to_json()], ring, describe(spans), blas_env()) as ranks:
        for rank, ev in ranks.events(config.timeout_s):
            if ev["event"] == "text" and on_text is not None:
                on_text(ev["text"])
            elif ev["event"] == "done":
                run.tokens, run.text, run.summary = ev["tokens"], ev["text"], ev["summary"]
                run.prompt_tokens, run.held = ev["prompt_tokens"], ev["held"]
            elif ev["event"] == "trace":
                run.traces[rank] = ev
    run.seconds = clock() - t0
    return run


if __name__ == "__main__":
    sys.exit(main())
