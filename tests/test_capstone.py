"""bench --capstone's reading side: which run the chapter's tables come from."""

import json
import re

from ref_impl.measure import capstone, records
from ref_impl.measure.records import record, references


def _results(path, label, records):
    date = f"{path.stem[-15:-11]}-{path.stem[-11:-9]}-{path.stem[-9:-7]}T{path.stem[-6:-4]}:00:00+00:00"
    path.write_text(json.dumps({"schema": 1, "date": date, "git": "", "command": "",
                                "machine": {"label": label}, "records": records}))


def test_the_reference_runs_keep_a_machines_shipped_model_and_shape_runs_apart(tmp_path):
    def rung(model, tps):
        return record("capstone", "tokens_per_s", "tok/s", tps, model=model, variant="plain", weights="F32", kv="f32")

    _results(tmp_path / "gpu-20261201-100000.json", "gpu", [rung("stdlib-10m", 700.0)])
    _results(tmp_path / "gpu-20261201-110000.json", "gpu", [rung("Llama-3.1-8B", 150.0)])
    _results(tmp_path / "cpu-20261201-090000.json", "cpu", [rung("stdlib-10m", 60.0)])
    newest = references("capstone", tmp_path)
    assert {k: v.file for k, v in newest.items()} == {"gpu": "gpu-20261201-110000.json",
                                                      "cpu": "cpu-20261201-090000.json"}
    shipped = references("capstone", tmp_path, model="stdlib-10m")
    assert shipped["gpu"].file == "gpu-20261201-100000.json" and shipped["gpu"].records[0]["value"] == 700.0
    assert set(references("capstone", tmp_path, model="Llama-3.1-8B")) == {"gpu"}
    assert references("capstone", tmp_path, model="Qwen3-8B") == {}


def test_weights_keeps_one_model_resident_so_a_rungs_peak_is_its_own(tmp_path):
    import mlx.core as mx

    from ref_impl.engine.random import args_for, write_random_model

    args = args_for("tiny", 64)
    files = {w: write_random_model(tmp_path / f"{t}.gguf", args, t) for w, t in (("float", "F16"),
                                                                                 (capstone.QUANTIZED, "Q4_K_M"))}
    weights = capstone.Weights("tiny", files, {"float": "F16", capstone.QUANTIZED: "Q4_K_M"})
    float_model = weights.model("float", False)
    assert weights.model("float", False) is float_model              # loaded once while it is the one in use
    del float_model
    mx.eval(weights.model(capstone.QUANTIZED, False).parameters())
    alone = mx.get_active_memory()
    assert list(weights.models) == [(capstone.QUANTIZED, False)]
    assert weights.model("float", False) is not None and list(weights.models) == [("float", False)]
    weights.model(capstone.QUANTIZED, False)
    assert mx.get_active_memory() <= alone * 1.05                    # the float model's arrays were freed


def test_table_says_what_each_peak_covers():
    fields = dict(model="m", weights="F32", kv="f32")
    old = [record("capstone", "peak_memory", "B", 9e6, variant="a", **fields)]
    new = [record("capstone", "peak_memory", "B", 3e6, variant="b", resident="rung", **fields),
           record("capstone", "tokens_per_s", "tok/s", 50.0, variant="b", **fields)]
    (a,), (b,) = capstone.table(old), capstone.table(new)
    assert (a["peak_memory"], a["peak_scope"]) == (9e6, "run")
    assert (b["peak_memory"], b["peak_scope"], b["tokens_per_s"]) == (3e6, "rung", 50.0)


def test_perplexity_scores_windows_of_the_files_own_context_after_the_long_case(tmp_path, shipped_model):
    """The long-context case lengthens the loaded model's context; the held-out windows stay the trained 512."""
    import dataclasses

    from ref_impl.engine.tokenizer import Tokenizer
    from ref_impl.formats import gguf

    weights = capstone.Weights("stdlib-10m", {"float": shipped_model, capstone.QUANTIZED: shipped_model},
                               {"float": "F32", capstone.QUANTIZED: "F32"})
    model = weights.model("float", False)
    model.args = dataclasses.replace(model.args, max_position_embeddings=4136)     # as long_records leaves it
    with gguf.read(shipped_model) as f:
        tokenizer = Tokenizer.from_gguf_metadata(f.metadata)
    plan = capstone.CapstonePlan(ppl_tokens=512)
    recs = capstone.perplexity_records(plan, weights, tokenizer, lambda msg: None)
    scored = [r for r in recs if r["metric"] == "heldout_perplexity"]
    assert scored and all((r["context"], r["tokens"]) == (512, 512) for r in scored)


def test_rung_table_has_units_no_e_notation_and_says_what_was_not_measured():
    run = records.reference("capstone", "h200", model="stdlib-10m")
    rows = capstone.table(run.records)
    page = capstone.rung_table(rows, run, "H200")._repr_html_()
    assert not re.search(r"\d\.?\d*e[+-]\d+", page) and "(tok/s)" in page
    assert any("not measured" in line for line in capstone.not_measured(rows))
