"""bench --long (measure/longrun.py): the records the dispatch chapter's long-prompt section reads, from a
small plan on the random Llama-3-vocabulary model and the shipped model (whose 512-position context a 600-token
prompt outgrows)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ref_impl.measure import longrun
from ref_impl.measure.peers import llama_cpp_available
from tests.conftest import SHIPPED

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """The suite's records from a process of its own, as the bench runs it: MLX's peak-memory counter is the
    process's, so arrays other tests leave alive would count as a prefill's."""
    work = tmp_path_factory.mktemp("long")
    script = (f"import json; from pathlib import Path; from ref_impl.measure import longrun; "
              f"plan = longrun.LongPlan(prompts=(40, 600), chunk=64, chunks=(32, 64), answer_tokens=160, window=40, "
              f"repeats=1); Path({str(work / 'records.json')!r}).write_text(json.dumps(longrun.bench_long("
              f"Path({str(SHIPPED)!r}), Path({str(work)!r}), plan)))")
    subprocess.run([sys.executable, "-c", script], cwd=ROOT, check=True, timeout=300)
    return json.loads((work / "records.json").read_text())


def pick(records, experiment, model, **where):
    return [r for r in records if r["experiment"] == experiment and r["model"].startswith(model)
            and all(r.get(k) == v for k, v in where.items())]


def test_every_prompt_is_timed_for_ours_and_the_peers(records):
    peers = {None, f"mlx-lm {longrun.package_version('mlx-lm')}"}
    for model, lengths in (("random-34m", (40, 600)), ("stdlib-10m", (40, 504))):
        for L in lengths:
            ttft = pick(records, longrun.EXPERIMENT, model, metric="ttft_ms", context=L)
            assert {r["peer"] for r in ttft} >= peers and all(r["value"] > 0 for r in ttft)
            assert {r["variant"] for r in ttft if r["peer"] is None} == {"chunk 64", "one pass"}
            assert len(ttft) == 3 + llama_cpp_available()          # ours twice, mlx-lm, llama.cpp
    assert len([r for r in records if r["peer"] and r["peer"].startswith("llama.cpp")]) == \
        (8 if llama_cpp_available() else 0)


def test_a_prompt_past_the_context_is_skipped_and_measured_at_the_longest_that_fits(records):
    skipped = pick(records, longrun.EXPERIMENT, "stdlib-10m", metric="skipped")
    assert [(r["context"], r["value"]) for r in skipped] == [(600, None)]
    assert "context of 512 positions: measured at 504 tokens instead" in skipped[0]["note"]
    assert not pick(records, longrun.EXPERIMENT, "random-34m", metric="skipped")


def test_chunks_hold_less_than_one_pass_beyond_the_weights_and_cache(records):
    """At 600 tokens, one pass holds every position's scores (4 heads x 600 x 600 floats a layer); a chunk of 32
    holds 32 rows of them."""
    beyond = {r["variant"]: r["value"] for r in pick(records, "long-prompt-chunk", "random-34m",
                                                     metric="peak_beyond_resident")}
    assert set(beyond) == {"chunk 32", "chunk 64", "one pass"}
    assert beyond["chunk 32"] < beyond["one pass"] / 2 and beyond["chunk 64"] < beyond["one pass"] / 2
    peak = {r["variant"]: r for r in pick(records, longrun.EXPERIMENT, "random-34m", metric="peak_memory",
                                          context=600, peer=None)}
    assert peak["chunk 64"]["resident_bytes"] > 130e6        # the 137 MB of float32 weights, and the cache


def test_the_long_answer_streams_text_and_times_both_ends(records):
    answer = {r["metric"]: r["value"] for r in pick(records, longrun.ANSWER, "random-34m")}
    assert answer["text_chars"] > 0 and answer["itl_early_ms"] > 0 and answer["itl_late_ms"] > 0
    assert answer["late_over_early"] == pytest.approx(answer["itl_late_ms"] / answer["itl_early_ms"])


def test_a_missing_vocabulary_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="ggml-vocab-llama-bpe.gguf is missing: `make lab`"):
        longrun.llama3_file(tmp_path, 64, vocab_dir=tmp_path)
