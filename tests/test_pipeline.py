"""engine/pipeline.py and engine/launch.py: a model's layers split over processes that pass the hidden state
through mx.distributed's ring backend, and the launcher that leaves no rank behind.

Three runs start processes (two stages each, a few seconds apiece): `generate --pipeline 2` on the shipped
model (its greedy text, and the bytes per token the kernel counted on its sockets), one whose second stage
is killed while it decodes, and one whose second stage is stopped (SIGSTOP) until the launcher's timeout.
A port in use and impossible splits are refused before any process starts; the split's arithmetic
(stages chained in one process, quantized caches and native quantized weights included) runs in this one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import signal
import socket
import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from ref_impl.__main__ import main
from ref_impl.engine import pipeline
from ref_impl.engine.checkpoint import load, load_model
from ref_impl.engine.compose import generate
from ref_impl.engine.generate import Sampler, generate_step
from ref_impl.engine.model import ModelArgs
from ref_impl.engine.random import random_model
from ref_impl.formats import gguf
from ref_impl.measure.pipeline import bytes_per_step, pipeline_recorded, run_records
from ref_impl.measure.records import record
from ref_impl.theory import interconnect as ic
from tests.conftest import SHIPPED, write_random_llama
from tests.test_records import write

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for the ranks")


def stage_pids() -> dict[int, int]:
    """rank -> pid of this process's pipeline ranks that are alive (not yet reaped), from /proc."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                mine = int(ppid) == os.getpid() and b"ref_impl.engine.pipeline" in f.read()
            if mine:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
                out[int(env[b"MLX_RANK"])] = int(pid)
        except (OSError, KeyError, ValueError):
            continue
    return out


@dataclasses.dataclass
class CLIRun:
    rc: int
    stdout: str
    stderr: str
    run: pipeline.PipelineRun


PROMPT = "def main(argv):\n    "     # more positions than --prefill-chunk 3: the prompt crosses the ring in chunks


@pytest.fixture(scope="module")
def cli_run(monkeypatch_module) -> CLIRun:
    """`generate --pipeline 2 --prefill-chunk 3` on the shipped model, in this process (its stages are two processes), with
    pipeline.generate spied on to keep the run and have its stages trace their steps."""
    runs, real = [], pipeline.generate

    def spy(config, on_text=None):
        runs.append(real(dataclasses.replace(config, trace=True), on_text))
        return runs[-1]
    monkeypatch_module.setattr(pipeline, "generate", spy)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["generate", "--model", str(SHIPPED), "--prompt", PROMPT, "--max-tokens", "12", "--pipeline", "2",
                   "--prefill-chunk", "3"])
    return CLIRun(rc, out.getvalue(), err.getvalue(), runs[0] if runs else None)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_generate_pipeline_2_prints_the_single_process_greedy_text(cli_run):
    assert cli_run.rc == 0, cli_run.stderr
    model, tok = load(SHIPPED)
    g = generate(model, tok, PROMPT, 12)                       # one process, one prefill pass
    assert len(g.prompt_tokens) > 2 * 3 and cli_run.run.prompt_tokens == g.prompt_tokens
    assert cli_run.stdout == PROMPT + g.text + "\n" and cli_run.run.tokens == g.tokens
    assert "2 pipeline stages over mx.distributed (ring)" in cli_run.stderr
    assert "stages 0: layers 0-2, 1: layers 3-5" in cli_run.stderr


def test_link_bytes_per_token_are_the_hidden_state_and_the_protocol(cli_run):
    """Per decoded token, 2 stages: the hidden state (384 float32) and its 4-byte header forward, the 4-byte
    token back: what the stages handed to mx.distributed.send, and what the kernel saw arrive."""
    d, act = 384, 4
    assert ic.pipeline_link_bytes(d, act, 2) == d * act + ic.HEADER_BYTES + ic.TOKEN_BYTES == 1544
    assert cli_run.run.link_bytes_per_token() == 1544 and "1544 link bytes per token" in cli_run.stderr
    assert set(bytes_per_step(cli_run.run, "sent")) == {1544}
    rx = bytes_per_step(cli_run.run, "rx")
    if sys.platform.startswith("linux"):
        # MLX's ring adds no framing of its own. The counter counts what has arrived, read or not, when a step
        # reads it: on a busy machine a message can land in another step's count (the end-of-run one in the
        # last step's; once, 1,540 more bytes in one of 11 steps), so most steps, not all, count exactly it
        assert rx is not None and np.mean(rx == 1544) >= 0.75


@linux_only
def test_a_stage_that_dies_is_named_and_no_stage_is_left():
    killed = []

    def kill_stage_1(text):
        if not killed:
            killed.append(stage_pids())
            os.kill(killed[0][1], signal.SIGKILL)
    config = pipeline.PipelineConfig(str(SHIPPED), 2, "def ", max_tokens=500)
    with pytest.raises(RuntimeError, match=r"stage 1 of 2 \(layers 3-5\) was killed by SIGKILL") as e:
        pipeline.generate(config, kill_stage_1)
    assert "stage 0 of 2" in str(e.value) and len(killed[0]) == 2
    assert stage_pids() == {}


@linux_only
def test_a_stuck_stage_times_out_and_no_stage_is_left():
    """A stage alive but silent (stopped): the others would wait on their sockets for ever; the launcher's
    timeout stops them all."""
    stopped = []

    def stop_stage_1(text):
        if not stopped:
            stopped.append(stage_pids())
            os.kill(stopped[0][1], signal.SIGSTOP)
    config = pipeline.PipelineConfig(str(SHIPPED), 2, "def ", max_tokens=500, timeout_s=1.5)
    with pytest.raises(TimeoutError, match=r"printed nothing for 1.5 s.*all 2 ranks were stopped"):
        pipeline.generate(config, stop_stage_1)
    assert stage_pids() == {}


def test_a_port_in_use_is_refused_before_any_stage_starts(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        rc = main(["generate", "--model", str(SHIPPED), "--prompt", "def ", "--pipeline", "2",
                   "--pipeline-port", str(port - 1)])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert f"port {port} on 127.0.0.1 is in use" in err
    assert not sys.platform.startswith("linux") or stage_pids() == {}


@pytest.mark.parametrize("args, words", [
    (["--pipeline", "7"], "the model has 6 layers"),
    (["--pipeline", "0"], "at least 1"),
    (["--pipeline", "2", "--compile"], "--compile is not built for a split model"),
    (["--pipeline", "2", "--mtp", "heads.gguf"], "--mtp is not built for a split model"),
    (["--pipeline", "2", "--kernels", "on"], "--kernels on patches the model of one process"),
])
def test_impossible_pipelines_are_refused_in_one_line(capsys, args, words):
    rc = main(["generate", "--model", str(SHIPPED), "--prompt", "def ", *args])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and err.count("\n") == 1 and words in err, err


def test_split_gives_every_stage_contiguous_layers():
    assert pipeline.split(6, 2) == [range(0, 3), range(3, 6)]
    assert pipeline.split(6, 4) == [range(0, 2), range(2, 4), range(4, 5), range(5, 6)]
    assert pipeline.split(80, 3) == [range(0, 27), range(27, 54), range(54, 80)]
    for bad in (0, 7):
        with pytest.raises(ValueError, match="each of 1 to 6 stages needs at least one"):
            pipeline.split(6, bad)


def stages_in_one_process(path, n: int, prompt: list[int], tokens: int, kv: str, fused: bool, native: bool):
    """Greedy tokens from the stages of an n-way split chained in this process: what the ranks compute,
    without the sockets."""
    config = pipeline.PipelineConfig(str(path), n, tuple(prompt), tokens, kv=kv, fused=fused)
    spans = pipeline.split(pipeline.model_args_of(str(path)).num_hidden_layers, n)
    stages = []
    for r, span in enumerate(spans):
        def keep(m, span=span, r=r):
            pipeline.hold(m, span, r == 0, r == n - 1)
        with gguf.read(path) as f:                       # a random file: no tokenizer to load
            model = load_model(f, mx.float32, native, keep=keep)
        stages.append(pipeline.Stage(config, r, span, model, mx.float32,
                                     sampler=config.sampler() if r == n - 1 else None))
        stages[-1].start(len(prompt))
    x, out = mx.array([prompt]), []
    for _ in range(tokens):
        for st in stages:
            x = st.forward(x)
        out.append(int(x.item()))
        x = mx.array([[out[-1]]])
    return out, stages


@pytest.mark.parametrize("kv, fused, native", [("float", False, False), ("sym8", False, False),
                                               ("affine4-g32", True, True)])
def test_stages_chained_in_one_process_decode_the_models_tokens(tmp_path, kv, fused, native):
    path = write_random_llama(tmp_path / "q8.gguf", vocab=97, dim=128, layers=3, weight_type="Q8_0", tied=False)
    prompt = [1, 5, 9, 11]
    got, stages = stages_in_one_process(path, 3, prompt, 6, kv, fused, native)
    with gguf.read(path) as f:
        model = load_model(f, mx.float32, native)
    plain = generate_step(model, prompt, Sampler(), model.make_cache(len(prompt) + 6, scheme=kv, fused=fused))
    assert got == [next(plain) for _ in range(6)]
    held = [{".".join(k.split(".")[:2 if k.startswith("layers") else 1]) for k, _ in tree_flatten(s.model.parameters())}
            for s in stages]
    assert held == [{"embed_tokens", "layers.0", "norm"}, {"layers.1", "norm"}, {"layers.2", "norm", "lm_head"}]


def test_a_random_models_stage_holds_the_values_of_the_whole_model():
    args = ModelArgs(vocab_size=64, hidden_size=32, num_hidden_layers=4, intermediate_size=48,
                     num_attention_heads=4, num_key_value_heads=2)
    whole = random_model(args, mx.float32, seed=3)
    part = random_model(args, mx.float32, seed=3, keep=lambda m: pipeline.hold(m, range(2, 4), False, True))
    a, b = whole.layers[3].mlp.down_proj.weight, part.layers[3].mlp.down_proj.weight
    assert np.array_equal(np.array(a), np.array(b)) and "embed_tokens" in part      # tied: the head is the embedding
    assert not dict(part.layers[1].parameters())


def test_the_bench_splits_each_token_into_compute_link_and_other(cli_run):
    """bench --pipeline's records, from the CLI run's traces (no process of its own): the split adds up, the
    bytes are counted, the tokens agree, and the median step's timeline has each stage's phases."""
    recs = run_records(cli_run.run, "stdlib-10m", "F32", cli_run.run.tokens, skip=1)
    by = {(r["metric"], r.get("stage"), r.get("hop"), r.get("phase")): r for r in recs}
    parts = [np.array(by[f"{k}_ms", None, None, None]["samples"]) for k in ("interval", "compute", "link", "other")]
    assert len(parts[0]) == 10 and np.allclose(parts[1] + parts[2] + parts[3], parts[0])
    assert {("hop_us", None, "0->1", None), ("hop_us", None, "1->0", None)} <= set(by)
    assert by["link_bytes_per_token", None, None, None]["value"] == 1544
    assert by["greedy_agreement", None, None, None]["value"] == 1.0
    assert {(k[1], k[3]) for k in by if k[0] == "timeline_ms"} == {(s, p) for s in (0, 1)
                                                                   for p in ("wait", "compute", "send")}
    assert all(r["experiment"] == "pipeline" and r["stages"] == 2 and r["hidden"] == 384 for r in recs)


def test_the_chapter_reads_the_machines_newest_complete_pipeline_run(tmp_path):
    speed = lambda v: record("pipeline", "tokens_per_s", "tok/s", v, model="m", variant="2 stages")
    write(tmp_path, "c-1.json", "cpu-2core", "2026-01-01T00:00:00+00:00", [speed(10.0)])
    write(tmp_path, "c-2.json", "cpu-2core", "2026-01-02T00:00:00+00:00", [speed(12.0)])
    write(tmp_path, "c-3.json", "cpu-2core", "2026-01-03T00:00:00+00:00", [speed(float("nan"))])   # failed: skipped
    write(tmp_path, "g-1.json", "gpu", "2026-01-04T00:00:00+00:00", [speed(50.0)])
    run = pipeline_recorded(results_dir=tmp_path)
    assert run.file == "c-2.json" and run.value("pipeline", "tokens_per_s") == 12.0
    assert run.caption == "cpu-2core, 2 Jan 2026, commit abc1234 (results/c-2.json)"
    assert pipeline_recorded("gpu", tmp_path).file == "g-1.json" and pipeline_recorded("none", tmp_path) is None
