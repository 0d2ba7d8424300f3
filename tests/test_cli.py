"""The CLI on good and bad input: `python -m ref_impl generate|inspect|quantize|train|bench`, as a subprocess.

Good input: each subcommand does its job and prints what it promises. Bad input (a missing,
malformed, truncated or non-llama file, an impossible setting): a non-zero exit and exactly one
line on stderr, starting with "error:" and naming the problem; never a traceback.
No assertion depends on how fast anything runs.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ref_impl.formats import gguf
from ref_impl.formats.quantize import quantize_file
from tests.conftest import write_random_llama

ROOT = Path(__file__).resolve().parent.parent
MODEL = "models/stdlib-10m.gguf"   # relative to ROOT, the CLI's working directory


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ref_impl", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def generate(*args: str) -> subprocess.CompletedProcess:
    return cli("generate", "--model", MODEL, "--prompt", "def ", *args)


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cli")


@pytest.fixture(scope="module")
def bad_files(tmp) -> dict[str, Path]:
    """Files the CLI must refuse: not GGUF, truncated GGUF, GGUF of another architecture."""
    text = tmp / "notes.txt"
    text.write_text("hello, this is not a model\n")
    truncated = tmp / "truncated.gguf"
    truncated.write_bytes((ROOT / MODEL).read_bytes()[:1000])
    gpt2 = tmp / "gpt2.gguf"
    gguf.write(gpt2, {"general.architecture": "gpt2"}, {"wte.weight": np.zeros((8, 4), np.float32)})
    quantized = tmp / "q8.gguf"
    quantize_file(write_random_llama(tmp / "random.gguf"), quantized, "Q8_0")
    return {"text": text, "truncated": truncated, "gpt2": gpt2, "quantized": quantized}


# ---- good input -------------------------------------------------------------------------------

def test_generate_greedy():
    r = generate("--max-tokens", "16")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("def ") and len(r.stdout.strip()) > len("def")
    assert re.search(r"TTFT [\d.]+ ms", r.stderr) and re.search(r"[\d.]+ tok/s", r.stderr)
    assert "Traceback" not in r.stderr


def test_generate_kernels_off_cuda():
    # auto and off leave MLX's built-ins in place off CUDA (same tokens); on asks for what is not there
    off, auto = generate("--max-tokens", "8", "--kernels", "off"), generate("--max-tokens", "8")
    assert off.returncode == 0 and off.stdout == auto.stdout and "kernels:" not in auto.stderr
    on = generate("--max-tokens", "8", "--kernels", "on")
    assert on.returncode == 2 and on.stderr.startswith("error: --kernels on") and "CUDA backend" in on.stderr
    assert len(on.stderr.splitlines()) == 1
    for flags, why in ((["--activations", "int8"], "not MLX's CUDA backend"),
                       (["--activations", "int8", "--kernels", "off"], "--kernels off")):
        r = generate("--max-tokens", "8", *flags)
        assert r.returncode == 2 and r.stderr.startswith("error: --activations int8") and why in r.stderr, r.stderr


def test_generate_compiled_gives_the_same_text():
    plain, compiled = generate("--max-tokens", "16"), generate("--max-tokens", "16", "--compile")
    assert compiled.returncode == 0, compiled.stderr
    assert compiled.stdout == plain.stdout


def test_generate_sampled_is_deterministic_per_seed():
    sample = ("--max-tokens", "32", "--temp", "0.8", "--top-p", "0.9", "--seed")
    first, again = generate(*sample, "1"), generate(*sample, "1")
    assert first.returncode == again.returncode == 0, first.stderr
    assert first.stdout == again.stdout
    # one other seed could, rarely, draw the same 32 tokens; all three can't, in practice
    others = {generate(*sample, seed).stdout for seed in ("2", "3", "4")}
    assert others - {first.stdout}


@pytest.fixture(scope="module")
def inspected():
    r = cli("inspect", MODEL)
    assert r.returncode == 0, r.stderr
    with gguf.read(ROOT / MODEL) as f:
        yield r.stdout, f


def test_inspect_metadata(inspected):
    out, f = inspected
    assert out.splitlines()[0].startswith(f"GGUF v{f.version}: {len(f.metadata)} metadata keys, "
                                          f"{len(f.tensors)} tensors, alignment {f.alignment}")
    for key in ("general.architecture", "llama.block_count", "llama.context_length", "tokenizer.ggml.tokens"):
        assert re.search(rf"^\s+{re.escape(key)}\s", out, re.M), key
    tokens = next(line for line in out.splitlines() if "tokenizer.ggml.tokens" in line)
    assert f"({len(f.metadata['tokenizer.ggml.tokens'])} items)" in tokens and len(tokens) < 200  # abbreviated


def test_inspect_tensor_table(inspected):
    out, f = inspected
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:1] == ["tensor"])
    assert lines[header].split() == ["tensor", "type", "shape", "offset", "bytes"]
    rows = lines[header + 1:header + 1 + len(f.tensors)]
    for row, t in zip(rows, f.tensors.values(), strict=True):
        m = re.fullmatch(r"\s+(\S+)\s+(\S+)\s+(\(.*?\))\s+(\d+)\s+(\d+)", row)
        assert m, row
        name, type_, shape, offset, nbytes = m.groups()
        assert (name, type_, shape) == (t.name, "F32", str(t.shape))
        assert int(offset) == t.offset and int(nbytes) == t.nbytes
        assert int(offset) % f.alignment == 0
    assert len({len(line) for line in [lines[header], *rows]}) == 1  # an aligned table: one width


@pytest.fixture(scope="module")
def trained(tmp) -> Path:
    out = tmp / "train"
    r = cli("train", "--preset", "micro", "--out", out, "--quiet", timeout=300)
    assert r.returncode == 0, r.stderr
    return out


def test_train_micro(trained):
    assert (trained / "micro.gguf").is_file()
    log = json.loads((trained / "micro.train.json").read_text())
    losses = [loss for _, loss in log["loss_curve"]]
    assert len(losses) >= 20 and np.mean(losses[:10]) > np.mean(losses[-10:])
    r = cli("inspect", trained / "micro.gguf")  # and what it wrote is a GGUF file the CLI reads back
    assert r.returncode == 0 and "general.architecture" in r.stdout, r.stderr


def test_bench_writes_results(tmp):
    out = tmp / "bench"
    r = cli("bench", "--no-peers", "--repeats", "1", "--gen-tokens", "8", "--prompt-len", "8",
            "--out", out, "--model", MODEL, "--roof-bytes", str(16 << 20))
    assert r.returncode == 0, r.stderr
    (path,) = out.glob("*.json")
    doc = json.loads(path.read_text())
    assert {"schema", "date", "git", "command", "machine", "records"} <= doc.keys()
    assert {"label", "cpu", "cores", "gpu", "backend", "mlx", "python", "blas"} <= doc["machine"].keys()
    assert doc["records"] and all(r["peer"] is None for r in doc["records"])
    for rec in doc["records"]:
        assert {"experiment", "model", "weights", "kv", "context", "metric", "unit", "value",
                "samples", "peer"} <= rec.keys()
        assert math.isfinite(rec["value"]) and rec["value"] > 0, rec
        assert all(math.isfinite(s) and s > 0 for s in rec["samples"]), rec
    assert {"tokens_per_s", "ttft_ms"} <= {rec["metric"] for rec in doc["records"]}


def test_quantize_writes_llama_cpp_types_and_reports_size(tmp):
    out = tmp / "q4km.gguf"
    r = cli("quantize", MODEL, out, "--type", "Q4_K_M")
    assert r.returncode == 0, r.stderr
    assert re.search(r"tensor data [\d.]+ MB -> [\d.]+ MB", r.stdout), r.stdout
    bpw = float(re.search(r"([\d.]+) bits per weight", r.stdout).group(1))
    with gguf.read(out) as f:
        types = {t.type.name for t in f.tensors.values()}
        n = sum(int(np.prod(t.shape)) for t in f.tensors.values())
        assert bpw == pytest.approx(8 * sum(t.nbytes for t in f.tensors.values()) / n, abs=0.01)
    assert types == {"F32", "Q8_0", "Q5_0", "Q4_K", "Q6_K"}     # the shipped shapes' Q4_K_M mixture
    r = cli("inspect", "--mlx", out)
    assert r.returncode == 0 and "affine 4-bit g32" in r.stdout and "re-quantized" in r.stdout, r.stderr
    r = generate("--max-tokens", "8", "--weights", "native")
    assert r.returncode == 0 and r.stdout.startswith("def "), r.stderr


def test_bench_quant_writes_size_perplexity_and_speed(tmp):
    out = tmp / "bench-quant"
    r = cli("bench", "--quant", "Q8_0", "Q4_0", "--ppl-tokens", "512", "--gen-tokens", "4", "--prompt-len", "4",
            "--repeats", "1", "--no-peers", "--out", out, "--model", MODEL, timeout=300)
    assert r.returncode == 0, r.stderr
    (path,) = out.glob("*.json")
    recs = json.loads(path.read_text())["records"]
    got = {(x["weights"], x["metric"], x.get("variant")) for x in recs}
    for ft in ("Q8_0", "Q4_0"):
        assert {(ft, "bits_per_weight", None), (ft, "heldout_perplexity", None), (ft, "tokens_per_s", "native"),
                (ft, "tokens_per_s", "dequantized")} <= got
    ppl = {x["weights"]: x["value"] for x in recs if x["metric"] == "heldout_perplexity"}
    assert 1 < ppl["Q8_0"] < ppl["Q4_0"] < 50        # more bits, lower perplexity, both sane


# ---- bad input: one "error:" line naming the problem, non-zero exit, no traceback -------------

BAD = [  # (id, arguments, a word the message must contain); "{text}" etc. name files in bad_files
    ("generate-missing", ["generate", "--model", "nope.gguf", "--prompt", "x"], "no such file"),
    ("inspect-missing", ["inspect", "nope.gguf"], "no such file"),
    ("bench-missing", ["bench", "--model", "nope.gguf", "--no-peers"], "no such file"),
    ("inspect-directory", ["inspect", "models"], "not a file"),
    ("generate-not-gguf", ["generate", "--model", "{text}", "--prompt", "x"], "not a GGUF file"),
    ("inspect-not-gguf", ["inspect", "{text}"], "not a GGUF file"),
    ("generate-truncated", ["generate", "--model", "{truncated}", "--prompt", "x"], "truncated"),
    ("inspect-truncated", ["inspect", "{truncated}"], "truncated"),
    ("generate-not-llama", ["generate", "--model", "{gpt2}", "--prompt", "x"], "architecture"),
    ("bench-not-llama", ["bench", "--model", "{gpt2}", "--no-peers"], "architecture"),
    ("temp-negative", ["generate", "--model", MODEL, "--prompt", "x", "--temp", "-1"], "temperature"),
    ("top-p-zero", ["generate", "--model", MODEL, "--prompt", "x", "--top-p", "0"], "top_p"),
    ("top-p-above-one", ["generate", "--model", MODEL, "--prompt", "x", "--top-p", "1.5"], "top_p"),
    ("max-tokens-past-context", ["generate", "--model", MODEL, "--prompt", "x", "--max-tokens", "10000"],
     "context length"),
    ("max-tokens-negative", ["generate", "--model", MODEL, "--prompt", "x", "--max-tokens", "-3"],
     "max_tokens"),
    ("bench-past-context", ["bench", "--model", MODEL, "--no-peers", "--gen-tokens", "10000"], "context length"),
    ("bench-one-token", ["bench", "--model", MODEL, "--no-peers", "--gen-tokens", "1"], "gen_tokens >= 2"),
    ("train-unknown-preset", ["train", "--preset", "nope", "--out", "{tmp}"], "unknown preset"),
    ("train-stdlib-alone", ["train", "--preset", "micro", "--stdlib", "{tmp}", "--out", "{tmp}"],
     "--corpus-python"),
    ("train-empty-stdlib", ["train", "--preset", "micro", "--stdlib", "{tmp}/no-stdlib", "--corpus-python", "3.11",
                            "--out", "{tmp}"], "no .py files"),
    ("train-zero-steps", ["train", "--preset", "micro", "--steps", "0", "--out", "{tmp}"], "steps must be at least 1"),
    ("train-out-is-a-file", ["train", "--preset", "micro", "--out", "{text}"], "exists"),
    ("quantize-missing", ["quantize", "nope.gguf", "{tmp}/x.gguf"], "no such file"),
    ("quantize-truncated", ["quantize", "{truncated}", "{tmp}/x.gguf"], "truncated"),
    ("quantize-twice", ["quantize", "{quantized}", "{tmp}/x.gguf", "--type", "Q4_0"], "already Q8_0"),
    ("bench-unknown-shape", ["bench", "--shape", "GPT-5"], "no model shape 'GPT-5'"),
    ("bench-kv-unknown-shape", ["bench", "--kv", "--shapes", "GPT-5"], "no model shape 'GPT-5'"),
    ("bench-kv-missing-model", ["bench", "--kv", "--model", "nope.gguf"], "no model file"),
    ("bench-quant-groups-no-tokens", ["bench", "--quant-groups", "--ppl-tokens", "0"], "--ppl-tokens must be positive"),
]


@pytest.mark.parametrize("args, word", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input(args, word, tmp, bad_files):
    r = cli(*(a.format(tmp=tmp, **bad_files) for a in args), timeout=60)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr + r.stdout
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    assert word.lower() in lines[0].lower(), lines[0]


def test_inspect_reads_any_architecture(bad_files):
    r = cli("inspect", bad_files["gpt2"])  # inspect is about the file format, not the model
    assert r.returncode == 0, r.stderr
    assert "'gpt2'" in r.stdout and "wte.weight" in r.stdout


@pytest.mark.parametrize("args", [["frobnicate"], [], ["generate", "--prompt", "x"], ["bench", "--repeats", "many"]],
                         ids=["unknown-command", "no-command", "missing-option", "not-a-number"])
def test_usage_errors_exit_2(args):
    r = cli(*args)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert r.stderr.startswith("usage:") and r.stderr.splitlines()[-1].startswith("python -m ref_impl")
    assert "error:" in r.stderr.splitlines()[-1]


def test_bench_link_writes_link_records(tmp):
    out = tmp / "link"
    r = cli("bench", "--link", "--link-budget", "2", "--link-max-bytes", str(1 << 20), "--out", out,
            "--label", "cli-link")
    assert r.returncode == 0, r.stderr
    (path,) = out.glob("cli-link-*.json")
    doc = json.loads(path.read_text())
    assert doc["command"].startswith("python -m ref_impl bench --link")
    assert doc["records"] and all(rec["experiment"] == "link" for rec in doc["records"])
    assert "host copy (numpy)" in r.stdout


def test_bench_kv_quick_writes_every_kv_experiment(tmp):
    """`bench --kv --quick`: perplexity and needle records per scheme, bytes per token, decode speed per cache
    variant (fused attention for the affine schemes) with the crossover, in one results file."""
    from ref_impl.engine.kvquant import FUSED, QUANTIZED

    out = tmp / "kv"
    r = cli("bench", "--kv", "--quick", "--out", out, "--label", "cli-kv", timeout=300)
    assert r.returncode == 0, r.stderr
    (path,) = out.glob("cli-kv-*.json")
    records = json.loads(path.read_text())["records"]
    by = {}
    for rec in records:
        by.setdefault(rec["experiment"], []).append(rec)
    assert set(by) == {"kv-ppl", "kv-needle", "kv-bytes", "kv-speed"}
    dtype = by["kv-ppl"][0]["dtype"]                          # the float cache is recorded under its dtype
    schemes = {dtype, *QUANTIZED}
    for experiment in ("kv-ppl", "kv-needle", "kv-bytes"):
        assert {rec["kv"] for rec in by[experiment]} == schemes
    ppl = {rec["kv"]: rec["value"] for rec in by["kv-ppl"] if rec["metric"] == "heldout_perplexity"}
    delta = {rec["kv"]: rec["value"] for rec in by["kv-ppl"] if rec["metric"] == "ppl_delta"}
    assert delta == pytest.approx({s: ppl[s] - ppl[dtype] for s in schemes})
    control = [rec for rec in by["kv-needle"] if rec["variant"] == "no-needle" and rec["metric"] == "retrieval_rate"]
    assert len(control) == 1 and control[0]["kv"] == dtype and set(control[0]["samples"]) <= {0, 1}
    per_token = {rec["kv"]: rec["value"] for rec in by["kv-bytes"] if rec["metric"] == "bytes_per_token"}
    assert dtype == "f32" and per_token[dtype] == 2 * 6 * 2 * 64 * 4   # K and V, 6 layers, 2 KV heads of 64, CPU
    assert all(per_token[s] < per_token[dtype] for s in QUANTIZED)
    speed = [rec for rec in by["kv-speed"] if rec["metric"] == "tokens_per_s"]
    fused = {rec["kv"] for rec in speed if rec["variant"] == "fused"}
    assert fused <= set(FUSED) and {s.split("-")[0][:-1] for s in fused} == {"affine", "outlier"}
    assert {rec["variant"] for rec in speed if rec["kv"] == dtype} == {None}
    assert all(rec["value"] > 0 for rec in speed)
    assert {rec["value"] for rec in by["kv-speed"] if rec["metric"] == "vs_float" and rec["kv"] == dtype} == {1.0}
    crossings = [rec for rec in by["kv-speed"] if rec["metric"] == "crossover_context"]
    assert len(crossings) == len({(rec["kv"], rec["variant"]) for rec in speed}) - 1
    assert "kv-speed" in r.stdout and "crossover_context" in r.stdout


def test_bench_roofs_records_the_machines_probes_and_peak_alone(tmp):
    from ref_impl.measure import records

    out = tmp / "roofs"
    r = cli("bench", "--roofs", "--roof-bytes", str(16 << 20), "--out", out, "--label", "cli-roofs")
    assert r.returncode == 0, r.stderr
    (path,) = out.glob("*.json")
    run = records.read_run(path)
    assert {rec["experiment"] for rec in run.records} == {"roofs"}
    assert {rec["variant"] for rec in run.records} == {"copy", "read", "host copy", "matmul"}   # a CPU: numpy's too
    assert records.roofs_references(out)["cli-roofs"].file == path.name                     # a machine's roofs run
    assert records.bandwidth(run, out) == (max(run.value("roofs", "bandwidth", variant=v)
                                               for v in ("copy", "read", "host copy")), run)


def test_bench_capstone_long_only_without_a_long_context_is_refused(tmp):
    r = cli("bench", "--capstone", "--long-only", "--long-context", "0", "--out", tmp / "refused")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "--long-context" in r.stderr
    assert not (tmp / "refused").exists()


def test_bench_capstone_long_only_on_a_shape_records_the_long_case_alone(tmp):
    out = tmp / "long-only"
    r = cli("bench", "--capstone", "--quick", "--long-only", "--shape", "tiny", "--no-peers", "--out", out,
            "--work-dir", tmp)
    assert r.returncode == 0, r.stderr
    (path,) = out.glob("*.json")
    records = json.loads(path.read_text())["records"]
    assert {rec["experiment"] for rec in records} == {"roofs", "capstone-long"}
    assert {rec["kv"] for rec in records if rec["metric"] == "tokens_per_s"} >= {"f32", "sym8"}


@pytest.mark.parametrize("flags, named", [(["--ppl-only", "--long-only"], "--long-only"),
                                           (["--ppl-only", "--shape", "tiny"], "--shape"),
                                           (["--ppl-only", "--ppl-tokens", "0"], "--ppl-tokens 0"),
                                           (["--ppl-tokens", "-5"], "--ppl-tokens -5")])
def test_bench_capstone_ppl_only_refuses_what_it_cannot_do(tmp, flags, named):
    r = cli("bench", "--capstone", "--quick", *flags, "--out", tmp / "refused")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and named in r.stderr
    assert not (tmp / "refused").exists()


def test_bench_capstone_ppl_only_scores_text_and_times_nothing(tmp):
    out = tmp / "ppl-only"
    r = cli("bench", "--capstone", "--quick", "--ppl-only", "--out", out, "--work-dir", tmp)
    assert r.returncode == 0, r.stderr
    (path,) = out.glob("*.json")
    records = json.loads(path.read_text())["records"]
    assert {rec["experiment"] for rec in records} == {"capstone-ppl"}      # no roofs: a busy machine's are no roof
    assert {rec["weights"] for rec in records} == {"F32", "Q4_K_M"}
    assert all(rec["metric"] == "heldout_perplexity" and 1 < rec["value"] < 512 for rec in records)


def test_bench_capstone_ppl_tokens_0_times_and_scores_nothing(tmp):
    out = tmp / "no-ppl"
    r = cli("bench", "--capstone", "--quick", "--ppl-tokens", "0", "--long-context", "0", "--no-peers", "--out", out,
            "--work-dir", tmp)
    assert r.returncode == 0, r.stderr
    (path,) = out.glob("*.json")
    assert {rec["experiment"] for rec in json.loads(path.read_text())["records"]} == {"roofs", "capstone"}


def test_bench_capstone_quick_writes_the_records_the_chapter_reads(tmp):
    from ref_impl.measure import capstone
    from ref_impl.measure.records import reference

    out = tmp / "capstone"
    r = cli("bench", "--capstone", "--quick", "--out", out, "--label", "cli-capstone", timeout=900)
    assert r.returncode == 0, r.stderr
    rows = capstone.table(reference("capstone", "cli-capstone", out).records)
    ours = {row["variant"]: row for row in rows if row["peer"] is None}
    assert [v for v, row in ours.items() if row["ladder"] is not None][:3] == ["plain", "+pipeline", "+Q4_K_M"]
    for row in ours.values():
        assert row["tokens_per_s"] > 0 and row["peak_memory"] > 0 and row["itl_p99_ms"] >= row["itl_p50_ms"] >= 0
        assert 0 < row["bandwidth_fraction"] and 0 <= row["greedy_agreement"] <= 1
    assert ours["plain"]["greedy_agreement"] == ours["draft"]["greedy_agreement"] == 1.0   # speculation keeps tokens
    assert 0 < ours["draft"]["alpha"] <= 1 and ours["mtp"]["speculate"] == "mtp"
    assert {row["variant"].split()[0] for row in rows if row["peer"]} == {"mlx-lm", "llama.cpp"}
    assert all(row.get("tokens_per_s", 0) > 0 for row in rows if row["peer"]), [r for r in rows if r.get("note")]
    long = capstone.table(reference("capstone-long", "cli-capstone", out).records)
    assert {row["kv"] for row in long if row["peer"] is None} == {"f32", "sym8", "affine8-g64", "affine4-g64"}
    ppl = reference("capstone-ppl", "cli-capstone", out).records
    assert len(ppl) == 6 and all(r["value"] > 1 and r["tokens"] == 32 for r in ppl)


def test_a_prompt_file_or_standard_input_gives_the_prompts_own_text(tmp_path, capsys, monkeypatch):
    """--prompt-file PATH and --prompt-file - read the prompt whole (newlines kept): the same output as --prompt."""
    import io

    from ref_impl.__main__ import main

    text = 'def main(argv):\n    """Run it."""\n    '
    (tmp_path / "prompt.py").write_text(text, encoding="utf-8")
    outs = []
    for source in (["--prompt", text], ["--prompt-file", str(tmp_path / "prompt.py")], ["--prompt-file", "-"]):
        monkeypatch.setattr(sys, "stdin", io.StringIO(text))
        assert main(["generate", "--model", str(ROOT / MODEL), *source, "--max-tokens", "6"]) == 0
        out, err = capsys.readouterr()
        outs.append((out, err.split("] ")[0]))
    assert outs[0] == outs[1] == outs[2] and outs[0][0].startswith(text)
