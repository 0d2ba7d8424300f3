"""measure/records.py: the one record shape, and the reader that maps older files to today's vocabulary
without touching a measured value."""

from __future__ import annotations

import json

import numpy as np

from ref_impl import RESULTS_DIR
from ref_impl.measure.records import canonical, read_results, record, select

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
    files = sorted(RESULTS_DIR.glob("*.json"))
    experiments = {r["experiment"] for p in files for r in json.loads(p.read_text())["records"]}
    for experiment in experiments:
        raw = [(p.name, r) for p in files for r in json.loads(p.read_text())["records"]
               if r["experiment"] == experiment]
        read = read_results(experiment)
        assert [name for name, _ in raw] == [name for name, _, _ in read]
        for (_, before), (_, _, after) in zip(raw, read):
            assert (after["value"], after["samples"], after["metric"]) == (before["value"], before["samples"],
                                                                         before["metric"])
            assert after.get("kv") not in OLD_FLOAT_NAMES and after.get("weights") not in {"f16", "f32", "bf16"}


def test_select_keeps_the_rows_whose_fields_all_match(tmp_path):
    recs = [record("link", "copy_bandwidth", "GB/s", v, variant=var) for v, var in ((1, "a"), (2, "b"), (3, "a"))]
    (tmp_path / "m-1.json").write_text(json.dumps({"schema": 1, "machine": {"label": "m"}, "records": recs}))
    assert [r["value"] for _, _, r in select("link", tmp_path, variant="a")] == [1, 3]
    assert [r["value"] for _, _, r in select("link", tmp_path, variant="a", metric="other")] == []
