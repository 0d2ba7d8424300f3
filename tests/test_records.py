"""measure/records.py: the one record shape, and the reader that maps older files to today's vocabulary
without touching a measured value."""

from __future__ import annotations

import json

import numpy as np

import pytest

from ref_impl import RESULTS_DIR
from ref_impl.measure import records
from ref_impl.measure.records import ROOFS, canonical, record

OLD_FLOAT_NAMES = {"float", "float16", "float32", "bfloat16"}


def test_record_has_the_one_shape_and_plain_numbers():
    r = record("decode", "tokens_per_s", "tok/s", np.float32(12.5), model="m", kv="f16",
               samples=[np.int64(3), np.bool_(True), 0.25], gamma=2)
    assert list(r) == ["experiment", "model", "weights", "kv", "context", "variant", "metric", "unit", "value",
                       "samples", "peer", "gamma"]
    assert r["value"] == 12.5 and type(r["value"]) is float
    assert r["samples"] == [3, 1.0, 0.25] and [type(x) for x in r["samples"]] == [int, float, float]
    assert json.loads(json.dumps(r)) == r


def test_canonical_maps_old_names_and_leaves_the_record_alone():
    old = {"experiment": "kv-speed", "kv": "float", "weights": "f16", "value": 1.0}
    assert canonical(old) == {**old, "kv": "f16", "weights": "F16"} and old["kv"] == "float"
    assert canonical({"kv": "float16", "weights": "Q4_K"})["kv"] == "f16"
    assert canonical({"kv": "float", "dtype": "float32", "weights": None}) == {"kv": "f32", "dtype": "f32",
                                                                              "weights": None}
    assert canonical({"kv": "f32", "dtype": "float16"})["kv"] == "f16"        # bench --quant's float16 GPU runs
    assert canonical({"kv": "affine4-g64", "weights": "q4g32"}) == {"kv": "affine4-g64", "weights": "q4g32"}


def test_every_recorded_file_reads_back_with_its_values_untouched_in_one_vocabulary():
    for path in sorted(RESULTS_DIR.glob("*.json")):
        raw = json.loads(path.read_text())
        run = records.read_run(path)
        assert (run.file, run.machine, run.date, run.git) == (path.name, raw["machine"], raw["date"], raw["git"])
        assert len(run.records) == len(raw["records"])
        for before, after in zip(raw["records"], run.records):
            assert (after["value"], after["samples"], after["metric"]) == (before["value"], before["samples"],
                                                                         before["metric"])
            assert after["experiment"] == (ROOFS if before["experiment"] in records.OLD_ROOFS else before["experiment"])
            assert after.get("kv") not in OLD_FLOAT_NAMES and after.get("weights") not in {"f16", "f32", "bf16"}
    experiments = {r["experiment"] for run in records.all_runs() for r in run.records}
    assert ROOFS in experiments and not experiments & set(records.OLD_ROOFS)
    for experiment in experiments:   # runs() keeps every record of the experiment, oldest run first
        assert [r for run in records.runs(experiment) for r in run.records] == [
            r for run in records.all_runs() for r in run.records if r["experiment"] == experiment]


def test_runs_keep_the_records_whose_fields_all_match(tmp_path):
    recs = [record("link", "copy_bandwidth", "GB/s", v, variant=var) for v, var in ((1, "a"), (2, "b"), (3, "a"))]
    (tmp_path / "m-1.json").write_text(json.dumps({"schema": 1, "machine": {"label": "m"}, "records": recs}))
    assert [r["value"] for run in records.runs("link", tmp_path, variant="a") for r in run.records] == [1, 3]
    assert records.runs("link", tmp_path, variant="a", metric="other") == []


def write(tmp_path, name: str, label: str, date: str, recs: list[dict], git: str = "abc1234", **machine) -> None:
    doc = {"schema": 1, "date": date, "git": git, "command": "python -m ref_impl bench",
           "machine": {"label": label, **machine}, "records": recs}
    (tmp_path / name).write_text(json.dumps(doc))


def test_the_reference_run_is_the_newest_complete_one_per_machine(tmp_path):
    speed = lambda v, model="m": record("decode", "tokens_per_s", "tok/s", v, model=model)
    write(tmp_path, "a-3.json", "a", "2026-01-03T00:00:00+00:00", [speed(float("nan"))])     # a failed measurement
    write(tmp_path, "a-2.json", "a", "2026-01-02T00:00:00+00:00", [speed(2.0), speed(9.0, "other")])
    write(tmp_path, "a-1.json", "a", "2026-01-01T00:00:00+00:00", [speed(1.0)])
    write(tmp_path, "b-1.json", "b", "2026-01-05T00:00:00+00:00",
          [record("decode", "skipped", None, None, model="m", note="no GPU"), speed(5.0, "other")])
    assert [r.file for r in records.runs("decode", tmp_path, model="m")] == ["a-1.json", "a-2.json", "a-3.json",
                                                                              "b-1.json"]
    ref = records.references("decode", tmp_path, model="m")
    assert {k: v.file for k, v in ref.items()} == {"a": "a-2.json", "b": "b-1.json"}   # a recorded skip is complete
    assert [r["value"] for r in ref["a"].records] == [2.0]                           # its records of `where` only
    assert records.reference("decode", "a", tmp_path, model="m").value("decode", "tokens_per_s") == 2.0
    assert records.reference("decode", "c", tmp_path) is None
    assert ref["a"].caption == "a, 2 Jan 2026, commit abc1234 (results/a-2.json)"
    with pytest.raises(LookupError, match="a-2.json: 2 decode records of tokens_per_s"):
        records.read_run(tmp_path / "a-2.json").value("decode", "tokens_per_s")
    write(tmp_path, "c-1.json", "c", "2026-01-06T00:00:00+00:00", [speed(3.0)], git="unknown")   # no git there
    assert records.reference("decode", "c", tmp_path).caption == "c, 6 Jan 2026, commit not recorded (results/c-1.json)"
    # a newer run that changed how MLX runs measured that change: no machine's reference, a run all the same
    write(tmp_path, "a-4.json", "a", "2026-01-04T00:00:00+00:00", [speed(4.0)], mlx_env={"MLX_USE_CUDA_GRAPHS": "0"})
    write(tmp_path, "a-5.json", "a", "2026-01-05T00:00:00+00:00", [speed(5.0)], mlx_env={})
    assert records.reference("decode", "a", tmp_path, model="m").file == "a-5.json"
    (tmp_path / "a-5.json").unlink()
    assert records.reference("decode", "a", tmp_path, model="m").file == "a-2.json"
    assert "a-4.json" in [r.file for r in records.runs("decode", tmp_path, model="m")]


def test_a_reference_can_keep_only_runs_whose_fused_layers_merged_no_pair(tmp_path):
    """unmerged: the pairs a run's records name (decode-kernels' merged, a profile's launch), else primitives a
    token (five launches a layer at least); reference(keep=...) then skips the newer runs it refuses."""
    from ref_impl.kernels import fusedlayer
    assert records.LAYER_LAUNCHES == len(fusedlayer.STAGES)
    count = lambda v, **kw: record("decode-kernels", "kernels_per_token", "kernels", v, model="Llama-3.2-1B",
                                   variant="layers", **kw)
    write(tmp_path, "a-1.json", "a", "2026-01-01T00:00:00+00:00", [count(87.0)])             # 16 layers x 5 + 7
    write(tmp_path, "a-2.json", "a", "2026-01-02T00:00:00+00:00", [count(55.0)])             # 16 x 3 + 7: merged
    write(tmp_path, "a-3.json", "a", "2026-01-03T00:00:00+00:00", [count(71.0, merged=["attention"])])
    write(tmp_path, "a-4.json", "a", "2026-01-04T00:00:00+00:00",
          [record("kernel-profile", "tokens_per_s", "tok/s", 1.0, variant="fused", launch={"merge": ["mlp"]})])
    assert [records.unmerged(records.read_run(tmp_path / f"a-{i}.json")) for i in (1, 2, 3, 4)] == [
        True, False, False, False]
    assert records.reference("decode-kernels", "a", tmp_path).file == "a-3.json"
    assert records.reference("decode-kernels", "a", tmp_path, keep=records.unmerged).file == "a-1.json"
    write(tmp_path, "a-5.json", "a", "2026-01-05T00:00:00+00:00", [count(71.0, merged=[])])   # said: none merged
    assert records.reference("decode-kernels", "a", tmp_path, keep=records.unmerged).file == "a-5.json"


def test_shares_are_divided_by_the_fastest_probe_of_the_run_or_of_the_machines_reference_roofs(tmp_path):
    probe = lambda v, variant, experiment=ROOFS: record(experiment, "bandwidth", "GB/s", v, variant=variant)
    write(tmp_path, "a-1.json", "a", "2026-01-01T00:00:00+00:00", [probe(3.0, "copy"), probe(4.0, "read")])
    write(tmp_path, "a-2.json", "a", "2026-01-02T00:00:00+00:00",   # an older file's name for the probes
          [probe(2.0, "copy", "capstone-bandwidth"), probe(3.0, "read", "capstone-bandwidth"),
           probe(20.0, "host copy", "capstone-bandwidth"), record(ROOFS, "peak_flops", "FLOP/s", 1e11, variant="matmul")])
    write(tmp_path, "a-3.json", "a", "2026-01-03T00:00:00+00:00", [record("decode", "tokens_per_s", "tok/s", 9.0)])
    write(tmp_path, "a-4.json", "a", "2026-01-04T00:00:00+00:00", [probe(50.0, "copy")])   # a cut run: one probe
    write(tmp_path, "b-1.json", "b", "2026-01-01T00:00:00+00:00", [record("decode", "tokens_per_s", "tok/s", 9.0)])
    own = records.read_run(tmp_path / "a-1.json")
    assert records.bandwidth(own, tmp_path)[0] == 4.0 and records.bandwidth(own, tmp_path)[1].file == "a-1.json"
    assert records.peak_flops(own, tmp_path) is None                   # that run measured bandwidth only
    other = records.read_run(tmp_path / "a-3.json")    # no probe of its own: the machine's newest full set of probes
    gbs, source = records.bandwidth(other, tmp_path)
    assert (gbs, source.file) == (20.0, "a-2.json") and records.peak_flops(other, tmp_path)[0] == 1e11
    assert records.bandwidth(records.read_run(tmp_path / "a-4.json"), tmp_path)[0] == 50.0   # its own, though
    assert {k: v.file for k, v in records.roofs_references(tmp_path).items()} == {"a": "a-2.json"}
    write(tmp_path, "a-5.json", "a", "2026-01-05T00:00:00+00:00", [probe(9.0, "copy"), probe(9.0, "read")],
          mlx_env={"MLX_USE_CUDA_GRAPHS": "0"})                   # MLX as it does not come: no machine's roofs
    assert {k: v.file for k, v in records.roofs_references(tmp_path).items()} == {"a": "a-2.json"}
    with pytest.raises(LookupError, match="no memory probe recorded on b"):
        records.bandwidth(records.read_run(tmp_path / "b-1.json"), tmp_path)
    assert records.fastest_bandwidth([probe(1.0, "copy"), record("gemv", "bandwidth", "GB/s", 99.0)]) == 1.0


def test_a_heldout_perplexity_is_named_for_what_it_scored():
    log = records.training_log("stdlib-10m")
    whole = (log["corpus"]["tokens"]["heldout"] - 1) // 512 * 512
    run = records.Run("x.json", {"label": "m", "python": "3.12.3"}, "2026-01-01", "abc", "", ())
    ppl = lambda **kw: record("quant", "heldout_perplexity", "ppl", 6.3, model="stdlib-10m", context=512,
                              tokens=whole, corpus_sha256=log["corpus"]["sha256"]) | kw
    assert records.perplexity_text(ppl(), run) == "held-out perplexity"
    assert records.perplexity_text(ppl(tokens=16384), run) == "held-out perplexity on a sample of 16,384 tokens"
    assert records.perplexity_text(ppl(context=256), run).startswith("held-out perplexity on a sample")
    other = records.perplexity_text(ppl(corpus_sha256="f00d", tokens=2048), run)
    assert other.startswith("held-out perplexity on another text: the held-out files of Python 3.12.3's") \
        and other.endswith("a sample of 2,048 tokens")
    assert records.perplexity_text(ppl(model="Llama-3.1-8B"), run).endswith("(a model without a training log)")


def test_the_reference_table_takes_each_quantity_from_its_machines_reference_run(tmp_path):
    log = records.training_log("stdlib-10m")
    whole = (log["corpus"]["tokens"]["heldout"] - 1) // 512 * 512
    probe = lambda v, variant: record(ROOFS, "bandwidth", "GB/s", v, variant=variant)
    speed = lambda v, variant: record("decode", "tokens_per_s", "tok/s", v, model="stdlib-10m", variant=variant)
    ppl = lambda v, tokens: record("quant", "heldout_perplexity", "ppl", v, model="stdlib-10m", weights="F32",
                                   context=512, tokens=tokens, corpus_sha256=log["corpus"]["sha256"])
    write(tmp_path, "a-1.json", "a", "2026-01-01T00:00:00+00:00",
          [probe(4.0, "copy"), probe(5.0, "read"), speed(10.0, "sync"), speed(11.0, "async_eval"), ppl(6.27, whole)])
    write(tmp_path, "b-1.json", "b", "2026-01-01T00:00:00+00:00",
          [probe(40.0, "copy"), probe(30.0, "read"), ppl(7.41, 16384)])          # a sample: not the table's
    got = {(q.name, q.label): (q.value, q.run.file) for q in records.reference_quantities(tmp_path)}
    assert got == {("measured bandwidth", "a"): (5.0, "a-1.json"), ("measured bandwidth", "b"): (40.0, "b-1.json"),
                   ("held-out perplexity", "a"): (6.27, "a-1.json"),
                   ("decode tok/s, synchronous loop", "a"): (10.0, "a-1.json"),
                   ("decode tok/s, pipelined loop", "a"): (11.0, "a-1.json")}
    assert set(records.reference_runs(tmp_path)) == {"a", "b"}
