"""Chat templates: a conversation turned into the one prompt text an instruction-tuned model was trained on.

A chat model never sees "messages": it sees text with its own markers around each turn, e.g. Llama 3's

    <|begin_of_text|><|start_header_id|>user<|end_header_id|>\\n\\nHi<|eot_id|><|start_header_id|>assistant...

The model's authors ship that layout as a Jinja2 template, and a GGUF file carries it in the metadata key
`tokenizer.chat_template`. Rendering it is running a program that came with the file, so it runs in
Jinja's immutable sandbox (no attribute access to Python internals, no mutating the messages), with the
variables and helpers the templates are written against, as transformers, mlx-lm and llama.cpp give them:

    messages               [{"role": "system" | "user" | "assistant", "content": str}, ...]
    add_generation_prompt  true: end with the assistant's header, so the model writes the reply
    bos_token, eos_token   the vocabulary's BOS and EOS pieces (Llama 3's template writes BOS itself)
    raise_exception(msg)   how a template refuses a conversation ("roles must alternate ...")
    strftime_now(fmt)      today's date, for templates that put it in the system message
    tojson                 a filter: JSON that keeps non-ASCII text as it is

The rendered text holds the markers as text; `encode` turns each marker into its one special token
(the rest is ordinary text) and adds BOS only when the vocabulary asks for it and the text does not
already start with it, so a template that writes BOS does not get a second one.

References: Hugging Face "Chat templates" docs; Jinja2 "Sandbox" docs; llama.cpp common/chat.cpp.
See chapter: your-model
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ref_impl.engine.tokenizer import TOKEN_USER_DEFINED, Tokenizer

TEMPLATE_KEY = "tokenizer.chat_template"


def chat_template(metadata: dict[str, Any], source: str) -> str:
    """The chat template of a GGUF file's metadata; a ValueError naming `source` (the file) when it has none."""
    template = metadata.get(TEMPLATE_KEY)
    if not isinstance(template, str) or not template.strip():
        raise ValueError(f"{source} has no chat template ({TEMPLATE_KEY}): it is not a chat model, or its "
                         "converter left the template out; run generate without --chat to continue plain text")
    return template


def conversation(user: str, system: str | None = None) -> list[dict[str, str]]:
    """The messages of a one-turn chat: an optional system message, then the user's."""
    return ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": user}]


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def render(template: str, messages: Sequence[dict[str, str]], bos_token: str = "", eos_token: str = "",
           add_generation_prompt: bool = True) -> str:
    """The prompt text `template` makes of `messages`, rendered in Jinja's immutable sandbox.

    A template that raises (raise_exception, an undefined call) or tries what the sandbox forbids gives a
    ValueError carrying the template's own message.
    """
    # trim_blocks/lstrip_blocks: a {% tag %} alone on its line leaves no blank line, as the templates assume
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    try:
        return env.from_string(template).render(
            messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
            bos_token=bos_token, eos_token=eos_token)
    except TemplateError as e:  # SecurityError, UndefinedError and syntax errors are TemplateErrors too
        raise ValueError(f"the chat template refused: {e.message or type(e).__name__}") from None
    except (ArithmeticError, LookupError, TypeError, ValueError) as e:  # the template's own bug, e.g. "a" + 1
        raise ValueError(f"the chat template failed: {type(e).__name__}: {e}") from None


def special_pieces(metadata: dict[str, Any]) -> tuple[str, str]:
    """The vocabulary's BOS and EOS pieces, as a template writes them ("" where the file names none)."""
    tokens = metadata.get("tokenizer.ggml.tokens", [])

    def piece(key: str) -> str:
        i = metadata.get(f"tokenizer.ggml.{key}_token_id")
        return str(tokens[i]) if isinstance(i, int) and 0 <= i < len(tokens) else ""

    return piece("bos"), piece("eos")


def chat_prompt(metadata: dict[str, Any], source: str, user: str, system: str | None = None) -> str:
    """The prompt text of a one-turn chat with the model whose GGUF metadata is `metadata` (file `source`)."""
    return render(chat_template(metadata, source), conversation(user, system), *special_pieces(metadata))


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of rendered chat text: each special token's text (the tokenizer's control tokens, typed as
    llama.cpp types them, and user-defined tokens; longest first) becomes its id, the text between is encoded
    as ordinary text; BOS first when the vocabulary adds BOS and the text does not already begin with it."""
    special = {tokenizer.tokens[i]: i for i, kind in enumerate(tokenizer.token_types)
               if (i in tokenizer.control or kind == TOKEN_USER_DEFINED) and tokenizer.tokens[i]}
    pattern = "|".join(re.escape(t) for t in sorted(special, key=len, reverse=True))
    ids = []
    for k, part in enumerate(re.split(f"({pattern})", text) if special else [text]):  # odd parts: special tokens
        ids += [special[part]] if k % 2 else tokenizer.encode(part) if part else []
    return ids if not tokenizer.add_bos or ids[:1] == [tokenizer.bos_id] else [tokenizer.bos_id, *ids]
