"""A conversation keeps its KV cache between turns (engine/conversation.py, python -m ref_impl chat).

The model is a tiny random Llama with the byte vocabulary of tests/test_chat.py and the Llama 3 template,
its LM head zeroed except for the lowercase letters and <|eot_id|>: a reply is then letters that encode back
to the very tokens generated (the template trims spaces; a byte vocabulary has no merges), so a turn's
rendering starts with exactly what the cache holds, and what "only the new tokens" means is exact.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import mlx.core as mx
import numpy as np
import pytest

from ref_impl.engine import chat
from ref_impl.engine.checkpoint import save
from ref_impl.engine.compose import Techniques, generate
from ref_impl.engine.conversation import Conversation
from ref_impl.engine.model import ModelArgs
from ref_impl.engine.random import random_model
from ref_impl.engine.tokenizer import Tokenizer
from tests.test_chat import EOT, LLAMA3, LLAMA3_META
from tests.test_cli import ROOT, cli

LETTERS = list(b"abcdefghijklmnopqrstuvwxyz")


@pytest.fixture(scope="module")
def llama3():
    """The model, its tokenizer and the metadata a file of it would carry."""
    tokenizer = Tokenizer.from_gguf_metadata(LLAMA3_META)
    model = random_model(ModelArgs(tokenizer.vocab_size, 128, 2, 256, 4, 2, max_position_embeddings=1024,
                                   tie_word_embeddings=False), mx.float32, seed=1)
    head = np.array(model.lm_head.weight)
    keep = np.zeros(len(head), bool)
    keep[LETTERS + [EOT]] = True
    model.lm_head.weight = mx.array(np.where(keep[:, None], head, 0.0))
    return model, tokenizer, {**LLAMA3_META, chat.TEMPLATE_KEY: LLAMA3}


def talk(llama3, **kw) -> Conversation:
    model, tokenizer, meta = llama3
    return Conversation(model, tokenizer, meta, "llama3.gguf", **{"max_tokens": 12, **kw})


def fresh(llama3, ids: list[int], max_tokens: int = 12):
    model, tokenizer, _ = llama3
    return generate(model, tokenizer, ids, max_tokens)


@pytest.mark.parametrize("kv", ["float", "sym8"])
def test_each_turn_prefills_only_its_new_tokens_and_answers_as_a_fresh_run(llama3, kv):
    conv = talk(llama3, techniques=Techniques(kv=kv), system="Be brief.")
    first = conv.say("Hi there")
    assert first.generation.prompt_tokens == conv.render([{"role": "user", "content": "Hi there"}])
    assert set(first.generation.tokens) <= set(LETTERS) and first.generation.tokens   # the head allows no more
    held = conv.cache[0].offset
    assert held == len(conv.cached) >= len(first.generation.prompt_tokens) + len(first.generation.tokens)
    for question in ("And then?", "Why?"):
        ids = conv.render([*conv.messages, {"role": "user", "content": question}])
        before = list(conv.cached)
        reply = conv.say(question)
        assert ids[:len(before)] == before                       # the cache's tokens start the new rendering
        assert reply.generation.prompt_tokens == ids[len(before):]  # and only the rest is prefilled
        ref = fresh(llama3, ids)
        assert reply.generation.tokens == ref.tokens and reply.generation.text == ref.text
    assert [m["role"] for m in conv.messages] == ["user", "assistant"] * 3


def test_reset_and_a_new_system_message_prefill_from_where_the_text_changed(llama3):
    conv = talk(llama3)
    first = conv.say("Hi there")
    conv.reset()
    assert conv.cache[0].offset == 0 and conv.messages == []
    again = conv.say("Hi there")
    assert again.generation.prompt_tokens == first.generation.prompt_tokens
    assert again.generation.tokens == first.generation.tokens
    conv.system = "Be brief."
    ids = conv.render([*conv.messages, {"role": "user", "content": "More"}])
    reply = conv.say("More")
    # the rendering now reads BOS, <|start_header_id|>, "system"...: the first two positions are kept
    assert reply.generation.prompt_tokens == ids[2:] and ids[:2] == [256, 258]
    assert reply.generation.tokens == fresh(llama3, ids).tokens


def test_a_cache_that_cannot_rewind_starts_over_rather_than_drift(llama3):
    conv = talk(llama3, techniques=Techniques(kv="kivi4"))
    conv.say("Hi there")
    kept = len(conv.cached)
    ids = conv.render([*conv.messages, {"role": "user", "content": "Go on"}])
    assert conv.say("Go on").generation.prompt_tokens == ids[kept:]     # appending needs no rewind
    conv.system = "Be brief."
    ids = conv.render([*conv.messages, {"role": "user", "content": "More"}])
    reply = conv.say("More")
    assert reply.generation.prompt_tokens == ids                        # a rewind would quantize again: all anew
    model, tokenizer, _ = llama3
    assert reply.generation.tokens == generate(model, tokenizer, ids, 12, techniques=Techniques(kv="kivi4")).tokens


def test_a_conversation_that_outgrows_the_context_drops_its_oldest_exchanges(llama3):
    conv = talk(llama3, context=160, max_tokens=8)
    notices = [conv.say(f"question number {i}").notice for i in range(6)]
    assert notices[0] == "" and any(n.startswith("context: dropped the oldest") for n in notices)
    assert len(conv.cached) <= 160 and conv.messages[0]["role"] == "user"
    assert conv.messages[-2]["content"] == "question number 5"
    before = (list(conv.messages), list(conv.cached))
    with pytest.raises(ValueError, match=r"refused: this message is \d+ tokens .* context of 160 positions"):
        conv.say("x" * 200)
    assert (conv.messages, conv.cached) == before                        # a refused message changes nothing


def test_ctrl_c_keeps_what_was_shown_and_the_cache_it_filled(llama3):
    conv = talk(llama3, max_tokens=40)
    shown = []

    def impatient(piece: str) -> None:
        shown.append(piece)
        if len(shown) == 3:
            raise KeyboardInterrupt

    reply = conv.say("Hi there", on_text=impatient)
    assert reply.interrupted and conv.messages[-1] == {"role": "assistant", "content": "".join(shown)}
    assert conv.cache[0].offset == len(conv.cached) and all(c.offset == len(conv.cached) for c in conv.cache)
    ids = conv.render([*conv.messages, {"role": "user", "content": "Go on"}])
    assert conv.say("Go on").generation.tokens == fresh(llama3, ids, 40).tokens


def test_bad_settings_are_refused(llama3):
    model, tokenizer, meta = llama3
    with pytest.raises(ValueError, match="no chat template"):
        Conversation(model, tokenizer, LLAMA3_META | {chat.TEMPLATE_KEY: ""}, "plain.gguf")
    with pytest.raises(ValueError, match="--draft, --mtp and --pipeline are generate's"):
        talk(llama3, techniques=Techniques(speculate="mtp"))
    with pytest.raises(ValueError, match="max_tokens of at least 1"):
        talk(llama3, max_tokens=0)


# ---- the CLI ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama3_file(llama3, tmp_path_factory):
    model, tokenizer, _ = llama3
    path = tmp_path_factory.mktemp("conversation") / "llama3.gguf"
    save(model, tokenizer, path, {chat.TEMPLATE_KEY: LLAMA3})
    return path


def test_cli_chat_keeps_the_conversation_and_obeys_its_commands(llama3_file):
    lines = "Hi there\nAnd then?\n/system Be brief.\n/reset\nHi there\n/bogus\n/exit\nnever read\n"
    r = subprocess.run([sys.executable, "-m", "ref_impl", "chat", "--model", str(llama3_file), "--max-tokens", "6"],
                       input=lines, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    answers = r.stdout.splitlines()
    assert len(answers) == 3 and all(set(a) <= set("abcdefghijklmnopqrstuvwxyz") for a in answers)
    prefilled = [int(s.split()[0][1:]) for s in r.stderr.splitlines() if s.startswith("[")]
    # turn 2 prefills what its rendering adds to the cache's: turn 1's prompt and the reply's tokens (one a
    # letter), with <|eot_id|> where it ended the reply early
    tokenizer = Tokenizer.from_gguf_metadata(LLAMA3_META)
    turns = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": answers[0]},
             {"role": "user", "content": "And then?"}]
    whole = chat.encode(tokenizer, chat.render(LLAMA3, turns, "<|begin_of_text|>", "<|eot_id|>"))
    held = prefilled[0] + len(answers[0]) + (len(answers[0]) < 6)
    assert prefilled[1] == len(whole) - held
    system = chat.encode(tokenizer, "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>")[1:]   # BOS aside
    assert prefilled[2] == prefilled[0] + len(system)     # after /reset, with the system message: all of it
    assert "(conversation reset)" in r.stderr and "unknown command /bogus" in r.stderr
    assert "/reset: start over" in r.stderr.splitlines()[1]


def test_cli_chat_refuses_a_file_without_template_in_one_line():
    r = cli("chat", "--model", "models/stdlib-10m.gguf")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "has no chat template" in r.stderr


@pytest.fixture(scope="module")
def endless_file(llama3, tmp_path_factory):
    """The llama3 model with <|eot_id|>'s head row zeroed too: letters win every step (each has a positive logit
    at some letter with probability 1 - 2^-26), so an answer runs to --max-tokens unless stopped."""
    model, tokenizer, _ = llama3
    head = np.array(model.lm_head.weight)
    head[EOT] = 0.0
    endless = random_model(model.args, mx.float32, seed=1)
    endless.update(model.parameters())
    endless.lm_head.weight = mx.array(head)
    reply = Conversation(endless, tokenizer, {**LLAMA3_META, chat.TEMPLATE_KEY: LLAMA3}, "endless.gguf",
                         max_tokens=300).say("Hi there")
    assert len(reply.generation.tokens) == 300                      # the premise: nothing ends an answer early
    path = tmp_path_factory.mktemp("endless") / "endless.gguf"
    save(endless, tokenizer, path, {chat.TEMPLATE_KEY: LLAMA3})
    return path


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT to a child process")
def test_cli_chat_ctrl_c_stops_the_answer_not_the_program(endless_file):
    p = subprocess.Popen([sys.executable, "-u", "-m", "ref_impl", "chat", "--model", str(endless_file),
                          "--max-tokens", "900", "--context", "1024"], cwd=ROOT, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        p.stdin.write("Hi there\n")
        p.stdin.flush()
        os.set_blocking(p.stdout.fileno(), True)
        p.stdout.read(1)                                 # the answer has begun
        time.sleep(0.05)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate("/exit\n", timeout=120)
    finally:
        p.kill()
    assert p.returncode == 0, err
    assert "(stopped)" in err and "900 generated" not in err


def test_generate_chat_and_chat_read_the_model_file_once(llama3_file, monkeypatch, capsys):
    """The chat template is checked, the weights loaded and the tokenizer built from one opening of the file."""
    import io

    from ref_impl.__main__ import main
    from ref_impl.formats import gguf

    opened, real = [], gguf.read
    monkeypatch.setattr(gguf, "read", lambda path, *a, **kw: opened.append(str(path)) or real(path, *a, **kw))
    assert main(["generate", "--model", str(llama3_file), "--chat", "--prompt", "Hi", "--max-tokens", "3"]) == 0
    assert opened == [str(llama3_file)]
    opened.clear()
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\n"))
    assert main(["chat", "--model", str(llama3_file), "--max-tokens", "3"]) == 0
    assert opened == [str(llama3_file)]
    capsys.readouterr()
