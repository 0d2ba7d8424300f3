"""A conversation: turns of a chat whose KV cache is kept between them.

A chat model sees one text, the whole conversation laid out by its chat template (chat.py). Laying it out
again at each turn and running it all through the model would make the tenth question cost ten prefills.
The conversation instead keeps the cache and the token ids it holds; a new turn is rendered whole,
encoded, and compared with those ids: the common prefix stays in the cache, and only the rest (the new
question, and whatever of the last answer the template writes differently from how it was generated)
is prefilled. Greedy text is then what a fresh run on the whole conversation gives.

The cache is allocated once, for `context` positions. A turn whose prompt and answer would outgrow it
drops the oldest exchanges (the system message stays), and says so; a single message too long for it is
refused. Stopping an answer midway (Ctrl-C: KeyboardInterrupt) keeps what was shown as the answer and
the cache as far as its positions are known.

See chapter: your-model
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import mlx.core as mx

from ref_impl.engine import chat
from ref_impl.engine.compose import Generation, Techniques, follow
from ref_impl.engine.generate import Sampler, generate_step
from ref_impl.engine.model import Model
from ref_impl.engine.speculative import SpeculativeStep
from ref_impl.engine.tokenizer import Tokenizer
from ref_impl.platform.timing import clock

DEFAULT_CONTEXT = 4096   # positions a conversation's cache holds unless the model's context is shorter


@dataclass
class Reply:
    """One turn's answer: the generation (its prompt_tokens are the positions prefilled this turn), whether
    Ctrl-C stopped it, and a line about the context when turns were dropped to fit."""
    generation: Generation
    interrupted: bool = False
    notice: str = ""


@dataclass
class Conversation:
    """Messages, and the cache holding the token ids `cached` (positions 0..len-1) of the last rendering."""
    model: Model
    tokenizer: Tokenizer
    metadata: dict
    source: str                                   # the file, named in errors
    techniques: Techniques = field(default_factory=Techniques)
    sampler: Sampler = field(default_factory=Sampler)
    max_tokens: int = 512                         # per answer
    context: int | None = None                    # cache positions; None: DEFAULT_CONTEXT or the model's, less
    system: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)

    def __post_init__(self):
        t = self.techniques
        if t.speculate or t.stages > 1:
            raise ValueError("chat decodes one token per forward in this process: --draft, --mtp and --pipeline "
                             "are generate's")
        chat.chat_template(self.metadata, self.source)          # a file without a template is refused here
        limit = self.model.args.max_position_embeddings
        self.context = min(self.context or DEFAULT_CONTEXT, limit)
        if self.context < 2 or self.max_tokens < 1:
            raise ValueError(f"a conversation needs a context of at least 2 positions and max_tokens of at least "
                             f"1, got {self.context} and {self.max_tokens}")
        self.cache = self.model.make_cache(self.context, scheme=t.kv, fused=t.fused)

    def render(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of the conversation `messages` (the system message first), ready for the answer."""
        system = [{"role": "system", "content": self.system}] if self.system is not None else []
        text = chat.render(chat.chat_template(self.metadata, self.source), system + messages,
                           *chat.special_pieces(self.metadata))
        return chat.encode(self.tokenizer, text)

    def fit(self, messages: list[dict[str, str]]) -> tuple[list[dict[str, str]], list[int], str]:
        """The messages that fit the context with room for an answer (the oldest exchanges dropped), their ids
        and the line that says what was dropped ("" when nothing was); a ValueError when the last message alone
        does not fit."""
        ids = self.render(messages)
        dropped = 0
        while len(ids) + self.max_tokens > self.context and len(messages) > 1:
            messages = messages[2:] if len(messages) > 2 else messages[1:]     # one user-assistant exchange
            dropped += 1
            ids = self.render(messages)
        if len(ids) + self.max_tokens > self.context:
            raise ValueError(f"refused: this message is {len(ids)} tokens with the template; with an answer of "
                             f"up to {self.max_tokens} it exceeds the context of {self.context} positions "
                             f"(shorten it, lower --max-tokens or raise --context)")
        notice = (f"context: dropped the oldest {dropped} exchange{'s' * (dropped > 1)} to fit {self.context} "
                  f"positions") if dropped else ""
        return messages, ids, notice

    def keep(self, n: int) -> int:
        """Forget the cache past its first n positions (all of it where a cache cannot be rewound exactly);
        the positions kept."""
        n = min(n, *(c.offset for c in self.cache))
        if not all(c.rewinds(c.offset - n) for c in self.cache):
            n = 0
        for c in self.cache:
            c.trim(c.offset - n)
        self.cached = self.cached[:n]
        return n

    def reset(self) -> None:
        """Start over: no turns (the system message stays), an empty cache."""
        self.messages = []
        self.keep(0)

    def say(self, user: str, on_text: Callable[[str], None] | None = None) -> Reply:
        """Answer `user`: prefill what the cache does not hold yet, generate up to max_tokens, keep the turn."""
        messages, ids, notice = self.fit([*self.messages, {"role": "user", "content": user}])
        common = 0
        while common < min(len(ids) - 1, len(self.cached)) and ids[common] == self.cached[common]:
            common += 1                                 # at least one new position: the answer needs logits
        common = self.keep(common)
        new, fed = ids[common:], []
        t = self.techniques

        def recorded() -> Iterator[SpeculativeStep]:    # every token yielded was fed to the cache first
            for y in generate_step(self.model, new, self.sampler, self.cache, t.pipeline, t.compiled,
                                   t.prefill_chunk):
                fed.append(y)
                yield SpeculativeStep([y], 0, 0)

        mx.reset_peak_memory()
        out, shown = Generation(prompt_tokens=new, techniques=t, start=clock()), []

        def show(piece: str) -> None:
            shown.append(piece)
            if on_text is not None:
                on_text(piece)

        interrupted = False
        try:
            follow(recorded(), out, self.tokenizer, self.max_tokens, on_text=show)
        except KeyboardInterrupt:
            interrupted = True
        self.cached = ids + fed
        self.keep(len(self.cached))                    # an interrupted forward may have left layers uneven
        self.messages = [*messages, {"role": "assistant", "content": out.text if not interrupted else "".join(shown)}]
        return Reply(out, interrupted, notice)
