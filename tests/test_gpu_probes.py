"""The GPU probes as bench suites: each flag runs its measurement and writes a results file; off CUDA that file
holds one "skipped" record naming why (ref_impl/measure/suites.py, `python -m ref_impl bench --<flag>`)."""

import json

import pytest

from ref_impl import kernels
from ref_impl.__main__ import parser
from ref_impl.measure import suites

FLAGS = {"--kernel-profile": ("kernel_profile", "kernel-profile"),
         "--layer-launches": ("layer_launches", "layer-launch"),
         "--gemv-decode": ("gemv_decode", "gemv-decode"), "--ncu": ("ncu", "ncu-kernel")}


@pytest.mark.parametrize("flag", FLAGS)
def test_each_flag_chooses_its_suite(flag):
    a = parser().parse_args(["bench", flag])
    assert suites.chosen(a) == FLAGS[flag][0] and FLAGS[flag][0] in suites.SUITES


@pytest.mark.skipif(kernels.on_cuda(), reason="checks the skip off CUDA")
@pytest.mark.parametrize("flag", FLAGS)
def test_off_cuda_each_probe_writes_one_skipped_record(flag, tmp_path, capsys):
    a = parser().parse_args(["bench", flag, "--out", str(tmp_path), "--label", "cpu-test", "--work-dir", str(tmp_path)])
    a.run(a)
    (path,) = tmp_path.glob("cpu-test-*.json")
    doc = json.loads(path.read_text())
    (rec,) = doc["records"]
    assert rec["experiment"] == FLAGS[flag][1] and rec["metric"] == "skipped" and "CUDA" in rec["note"]
    assert "skipped" in capsys.readouterr().out


def test_a_transcribed_run_names_its_raw_log_and_the_bench_that_measures_it_now():
    """The probes' logs were transcribed once into results files (`transcribed_from`); each names a log that is
    still in results/, and a command of `python -m ref_impl bench` that now writes its records."""
    from ref_impl import RESULTS_DIR
    from ref_impl.measure import records

    transcribed = [run for run in records.all_runs() if run.transcribed_from]
    assert len(transcribed) >= 8
    for run in transcribed:
        assert (RESULTS_DIR / run.transcribed_from).is_file(), run.file
        assert run.command.startswith("python -m ref_impl bench --") and "transcribed once" in run.command
        assert f"transcribed from results/{run.transcribed_from}" in run.caption
