"""bench --window (measure/window.py): the KV cache of a sliding window, as the decoder builds it and as it decodes.

The oracles: Gemma-3-12B's bytes counted here in plain numpy from its published shape (which layers slide is
llama.cpp's `set_swa_pattern(6)`, written out below), the window key of the written files read back by llama.cpp's
own `gguf` package, and the results file read back as JSON.
"""

from __future__ import annotations

import json

import gguf as gguf_py
import numpy as np
import pytest

from ref_impl.__main__ import parser
from ref_impl.measure import suites, window
from ref_impl.theory.shapes import shape as named_shape

GEMMA = named_shape("Gemma-3-12B")
CONTEXTS = (512, 1024, 2048, 131072)
# engine/kvcache.py's WindowKVCache, as documented: window - 1 positions, a rewind margin of 64, room for 256 writes
MARGIN, STEP = 64, 256


def gemma_bytes(context: int, held: int | None) -> int:
    """Float16 KV bytes of Gemma-3-12B at `context`: llama.cpp's gemma3 layers slide unless i % 6 == 5; a sliding
    layer holds min(context, held) positions (held None: every layer global)."""
    layers = np.arange(GEMMA.num_hidden_layers)
    slides = (layers % 6 < 5) if held else np.zeros_like(layers, dtype=bool)
    positions = np.where(slides, min(context, held or context), context)
    return int(positions.sum()) * 2 * GEMMA.num_key_value_heads * GEMMA.head_dim * 2


@pytest.fixture(scope="module")
def byte_records():
    return window.byte_records(window.WindowPlan(contexts=CONTEXTS), lambda s: None)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """`bench --window --quick` as a user runs it: the results file it writes."""
    out = tmp_path_factory.mktemp("window")
    a = parser().parse_args(["bench", "--window", "--quick", "--out", str(out), "--label", "cpu-test",
                             "--work-dir", str(out)])
    a.run(a)
    (path,) = out.glob("cpu-test-*.json")
    return json.loads(path.read_text())


def value(records, experiment, metric, **where) -> float:
    (r,) = [r for r in records if r["experiment"] == experiment and r["metric"] == metric
            and all(r[k] == v for k, v in where.items())]
    return r["value"]


def test_the_flag_chooses_the_suite():
    assert suites.chosen(parser().parse_args(["bench", "--window"])) == "window"


def test_the_caches_the_decoder_builds_hold_what_numpy_counts(byte_records):
    """Every layer global: the decoder's caches hold exactly context positions a layer. With the window, a sliding
    layer holds min(context, window - 1 + margin + step) positions: theory's bytes up to the window, then theory's
    plus a constant, the 40 sliding layers' margin and write room."""
    held = GEMMA.sliding_window - 1 + MARGIN + STEP
    for c in CONTEXTS:
        assert value(byte_records, window.BYTES, "cache_bytes", context=c, variant=window.ALL_GLOBAL) == \
            gemma_bytes(c, None) == value(byte_records, window.BYTES, "theory_bytes", context=c,
                                          variant=window.ALL_GLOBAL)
        measured = value(byte_records, window.BYTES, "cache_bytes", context=c, variant=window.WINDOWED)
        theory = value(byte_records, window.BYTES, "theory_bytes", context=c, variant=window.WINDOWED)
        assert measured == gemma_bytes(c, held) and theory == gemma_bytes(c, GEMMA.sliding_window)
        assert value(byte_records, window.BYTES, "bytes_per_token", context=c, variant=window.WINDOWED) == measured / c
    assert gemma_bytes(1024, held) == gemma_bytes(1024, GEMMA.sliding_window)          # equal up to the window
    gap = {c: gemma_bytes(c, held) - gemma_bytes(c, GEMMA.sliding_window) for c in (2048, 131072)}
    assert gap[2048] == gap[131072] == 40 * (MARGIN + STEP - 1) * 2 * 8 * 256 * 2


def test_building_the_caches_allocated_nothing(byte_records):
    """The 128k caches (51 GB, every layer global) were shapes only: MLX allocated a few kB building them."""
    big = [r for r in byte_records if r["metric"] == "cache_bytes" and r["context"] == 131072]
    assert max(r["value"] for r in big) > 50e9
    assert all(r["allocated_bytes"] < 1 << 20 for r in big)
    split = {r["variant"]: (r["sliding_layers_bytes"], r["global_layers_bytes"]) for r in big}
    assert split[window.ALL_GLOBAL][0] == 0 and split[window.WINDOWED][1] == gemma_bytes(131072, None) * 8 // 48


def test_the_window_off_file_covers_every_position(tmp_path):
    plan = window.WindowPlan.quick()
    files = window.decode_files(tmp_path, plan)

    def key(path):
        field = gguf_py.GGUFReader(path).fields["gemma3.attention.sliding_window"]
        return int(field.parts[-1][0])

    assert key(files[window.WINDOWED]) == plan.decode_window
    assert key(files[window.WINDOW_OFF]) > max(plan.decode_contexts) + plan.decode_tokens


def test_the_quick_run_decodes_both_files_and_the_window_caps_the_read(quick):
    """Past the window, the windowed model's attention reads less than the whole context; the window-off model
    reads every position of its six layers (4 KV heads of 128 in float32: 4 kB a position and layer)."""
    rec, plan = quick["records"], window.WindowPlan.quick()
    assert quick["machine"]["label"] == "cpu-test" and quick["schema"] == 1
    for c in plan.decode_contexts:
        for v in (window.WINDOWED, window.WINDOW_OFF):
            assert value(rec, window.DECODE, "tokens_per_s", context=c, variant=v) > 0
        assert value(rec, window.DECODE, "read_bytes", context=c, variant=window.WINDOW_OFF) == 6 * c * 2 * 4 * 128 * 4
    longest = max(plan.decode_contexts)
    reads = {v: value(rec, window.DECODE, "read_bytes", context=longest, variant=v)
             for v in (window.WINDOWED, window.WINDOW_OFF)}
    held = {v: value(rec, window.DECODE, "cache_bytes", context=longest, variant=v) for v in reads}
    assert reads[window.WINDOWED] < reads[window.WINDOW_OFF] / 2 and held[window.WINDOWED] < held[window.WINDOW_OFF]
    assert {r["unit"] for r in rec if r["metric"].endswith("bytes")} == {"B"}
    for c in plan.decode_contexts:      # the ratio is each round's windowed run over its window-off run
        (ratio,) = [r for r in rec if r["metric"] == "speed_vs_window_off" and r["context"] == c]
        (w,), (o,) = ([r["samples"] for r in rec if r["metric"] == "tokens_per_s" and r["context"] == c
                       and r["variant"] == v] for v in (window.WINDOWED, window.WINDOW_OFF))
        assert ratio["value"] == pytest.approx(np.median(np.array(w) / np.array(o)))


@pytest.mark.parametrize("bad, match", [
    (dict(decode_tokens=100), "decode_tokens <= 48"),
    (dict(repeats=0), "repeats >= 1"),
    (dict(cache_dtype="int8"), "cache_dtype 'int8'"),
    (dict(contexts=()), "contexts must be positive and non-empty"),
    (dict(decode_contexts=(0, 256)), "contexts must be positive"),
])
def test_a_bad_plan_is_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        window.WindowPlan(**bad)


def test_a_shape_without_a_window_is_refused():
    with pytest.raises(ValueError, match="Llama-3.1-8B has no sliding window"):
        window.gemma_args(named_shape("Llama-3.1-8B"), 1024)
