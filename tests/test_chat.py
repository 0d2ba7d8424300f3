"""Chat templates (engine/chat.py, generate --chat): real-world templates rendered in the sandbox.

The templates are the public ones, written out here from the models' tokenizer_config.json; the expected
prompts are derived by hand from the templates' text, and checked against llama.cpp's own (non-Jinja)
formatter for the same conversation. The vocabularies are the 256 byte tokens (token id = byte value,
no merges) plus the model's special tokens, so expected token ids are written down by hand too.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

import pytest

from ref_impl.engine import chat
from ref_impl.engine.tokenizer import TOKEN_CONTROL, TOKEN_NORMAL, Tokenizer, bytes_to_unicode

ROOT = Path(__file__).resolve().parent.parent

# meta-llama/Meta-Llama-3-8B-Instruct, tokenizer_config.json "chat_template" (as also used in llama.cpp's
# tests/test-chat-template.cpp); the content is trimmed and the first message carries bos_token.
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
          "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
          "{{ content }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
# Qwen/Qwen2-7B-Instruct, tokenizer_config.json "chat_template" (ChatML, with a default system message).
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# mistralai/Mistral-7B-Instruct-v0.1, tokenizer_config.json "chat_template": it refuses a system message.
MISTRAL = ("{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
           "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
           "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
           "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token + ' ' }}"
           "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")


def metadata(specials: list[str], bos: str, eos: str, add_bos: bool, template: str | None) -> dict:
    """GGUF tokenizer keys of a byte vocabulary (token b = byte b) plus `specials` as control tokens."""
    table = bytes_to_unicode()
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "llama-bpe",
            "tokenizer.ggml.tokens": [table[b] for b in range(256)] + specials,
            "tokenizer.ggml.token_type": [TOKEN_NORMAL] * 256 + [TOKEN_CONTROL] * len(specials),
            "tokenizer.ggml.merges": [], "tokenizer.ggml.bos_token_id": 256 + specials.index(bos),
            "tokenizer.ggml.eos_token_id": 256 + specials.index(eos), "tokenizer.ggml.add_bos_token": add_bos}
    return meta if template is None else {**meta, chat.TEMPLATE_KEY: template}


LLAMA3_META = metadata(LLAMA3_SPECIALS, "<|begin_of_text|>", "<|eot_id|>", True, LLAMA3)
CHATML_META = metadata(CHATML_SPECIALS, "<|endoftext|>", "<|im_end|>", False, CHATML)
# By hand from the templates: Llama 3 trims the content and writes BOS; ChatML writes no BOS.
LLAMA3_TEXT = ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
               "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
               "<|start_header_id|>assistant<|end_header_id|>\n\n")
CHATML_TEXT = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
               "<|im_start|>assistant\n")
# token ids by hand: bytes are their own ids, the specials follow from 256 in list order
BEGIN, HEAD, END_HEAD, EOT = 256, 258, 259, 260
LLAMA3_IDS = [BEGIN, HEAD, *b"system", END_HEAD, *b"\n\nBe brief.", EOT, HEAD, *b"user", END_HEAD, *b"\n\nHi there",
              EOT, HEAD, *b"assistant", END_HEAD, *b"\n\n"]


def llama_cpp_format(template: str, messages: list[dict[str, str]]) -> str:
    """llama.cpp's built-in formatter (it recognises the template by its markers; no Jinja) as the oracle."""
    import llama_cpp

    arr = (llama_cpp.llama_chat_message * len(messages))(
        *[llama_cpp.llama_chat_message(role=m["role"].encode(), content=m["content"].encode()) for m in messages])
    buf = ctypes.create_string_buffer(1 << 14)
    n = llama_cpp.llama_chat_apply_template(template.encode(), arr, len(messages), True, buf, len(buf))
    assert 0 < n <= len(buf)
    return buf.raw[:n].decode()


def test_llama3_template_renders_a_system_and_a_user_message():
    text = chat.chat_prompt(LLAMA3_META, "llama3.gguf", " Hi there\n", system="Be brief.")  # trim drops the spaces
    assert text == LLAMA3_TEXT
    # llama.cpp leaves BOS to the tokenizer; the rest is the same text
    expected = text.removeprefix("<|begin_of_text|>")
    assert llama_cpp_format(LLAMA3, chat.conversation("Hi there", "Be brief.")) == expected


def test_chatml_template_renders_a_system_and_a_user_message():
    text = chat.chat_prompt(CHATML_META, "qwen2.gguf", "Hi there", system="Be brief.")
    assert text == CHATML_TEXT
    assert llama_cpp_format(CHATML, chat.conversation("Hi there", "Be brief.")) == text


def test_chatml_template_without_system_message_uses_its_default():
    text = chat.chat_prompt(CHATML_META, "qwen2.gguf", "Hi there")
    assert text == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
                    "<|im_start|>assistant\n")


def test_special_tokens_become_their_ids_and_the_template_bos_is_not_doubled():
    tokenizer = Tokenizer.from_gguf_metadata(LLAMA3_META)
    assert tokenizer.add_bos
    assert chat.encode(tokenizer, LLAMA3_TEXT) == LLAMA3_IDS  # one BOS: the template's


@pytest.mark.parametrize("add_bos", [False, True])
def test_bos_is_added_only_when_the_vocabulary_asks_and_the_template_did_not(add_bos):
    tokenizer = Tokenizer.from_gguf_metadata({**CHATML_META, "tokenizer.ggml.add_bos_token": add_bos})
    start, end = 257, 258
    ids = [start, *b"system\nBe brief.", end, *b"\n", start, *b"user\nHi there", end, *b"\n", start, *b"assistant\n"]
    assert chat.encode(tokenizer, CHATML_TEXT) == ([256] if add_bos else []) + ids


def test_generate_takes_the_chat_tokens_as_they_are():
    from ref_impl.engine.compose import generate
    from ref_impl.engine.model import ModelArgs
    from ref_impl.engine.random import random_model

    tokenizer = Tokenizer.from_gguf_metadata(LLAMA3_META)
    model = random_model(ModelArgs(tokenizer.vocab_size, 32, 1, 64, 2, 1, max_position_embeddings=256))
    g = generate(model, tokenizer, chat.encode(tokenizer, LLAMA3_TEXT), max_tokens=2, stop_at_eos=False)
    assert g.prompt_tokens == LLAMA3_IDS and g.prompt_tokens.count(tokenizer.bos_id) == 1


def test_a_file_without_template_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"plain\.gguf has no chat template.*without --chat"):
        chat.chat_prompt({k: v for k, v in LLAMA3_META.items() if k != chat.TEMPLATE_KEY}, "plain.gguf", "Hi")


def test_raise_exception_in_a_template_is_a_value_error_with_its_message():
    meta = {**LLAMA3_META, chat.TEMPLATE_KEY: MISTRAL}
    with pytest.raises(ValueError, match="Conversation roles must alternate"):
        chat.chat_prompt(meta, "mistral.gguf", "Hi", system="Be brief.")
    assert chat.chat_prompt(meta, "mistral.gguf", "Hi") == "<|begin_of_text|>[INST] Hi [/INST]"


@pytest.mark.parametrize("template, word", [
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "unsafe"),      # Python internals: the sandbox says no
    ("{{ messages.append({'role': 'user', 'content': 'x'}) }}", "unsafe"),  # the immutable sandbox: no mutation
    ("{% for m in messages %}{{ m.role + 1 }}", "template"),           # a syntax error (unclosed for)
    ("{{ undefined_helper() }}", "undefined"),
    ("{{ 'a' + 1 }}", "TypeError"),
], ids=["internals", "mutation", "syntax", "undefined", "type-error"])
def test_templates_that_fail_or_break_the_sandbox_are_value_errors(template, word):
    with pytest.raises(ValueError, match=f"(?i)chat template.*{word}"):
        chat.render(template, chat.conversation("Hi"))


def test_helpers_the_templates_use():
    assert chat.render("{{ messages | tojson }}", chat.conversation("é")) == '[{"role": "user", "content": "é"}]'
    assert len(chat.render("{{ strftime_now('%Y-%m-%d') }}", [])) == 10
    assert chat.render("{% if add_generation_prompt %}A{% endif %}", [], add_generation_prompt=False) == ""
    assert chat.render("{% for m in messages %}{% if loop.first %}{% continue %}{% endif %}{{ m.content }}"
                       "{% endfor %}", [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}]) == "y"


# ---- the CLI ---------------------------------------------------------------------------------------

def cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ref_impl", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


@pytest.fixture(scope="module")
def chat_models(tmp_path_factory) -> dict[str, Path]:
    """Tiny random Llamas with the Llama 3 vocabulary above, with the Llama 3 and the Mistral template."""
    from ref_impl.engine.checkpoint import save
    from ref_impl.engine.model import ModelArgs
    from ref_impl.engine.random import random_model

    tmp = tmp_path_factory.mktemp("chat")
    tokenizer = Tokenizer.from_gguf_metadata(LLAMA3_META)
    model = random_model(ModelArgs(tokenizer.vocab_size, 32, 1, 64, 2, 1, max_position_embeddings=256))
    paths = {"llama3": tmp / "llama3.gguf", "mistral": tmp / "mistral.gguf"}
    save(model, tokenizer, paths["llama3"], {chat.TEMPLATE_KEY: LLAMA3})
    save(model, tokenizer, paths["mistral"], {chat.TEMPLATE_KEY: MISTRAL})
    return paths


def test_cli_chat_renders_the_template_once_with_one_bos(chat_models):
    r = cli("generate", "--model", chat_models["llama3"], "--chat", "--system", "Be brief.", "--prompt", "Hi there",
            "--max-tokens", "3")
    assert r.returncode == 0, r.stderr
    assert f"[{len(LLAMA3_IDS)} prompt tokens" in r.stderr  # the hand-derived ids: the template's BOS alone
    assert "Hi there" not in r.stdout  # a chat prints the reply, not the prompt


@pytest.mark.parametrize("args, word", [
    (["--model", "models/stdlib-10m.gguf", "--system", "Be brief.", "--prompt", "x"], "--system"),
    (["--model", "models/stdlib-10m.gguf", "--chat", "--prompt", "x"], "stdlib-10m.gguf has no chat template"),
    (["--model", "{mistral}", "--chat", "--system", "Be brief.", "--prompt", "x"], "roles must alternate"),
], ids=["system-without-chat", "no-template", "template-raises"])
def test_cli_chat_refusals_are_one_line_exit_2(args, word, chat_models):
    r = cli("generate", *(a.format(**chat_models) for a in args))
    assert r.returncode == 2
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and word in lines[0], r.stderr
