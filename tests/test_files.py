"""Model files as people have them: Ollama blobs, files that are not GGUF, big files, and `inspect`'s verdict.

An Ollama blob is a GGUF file named `sha256-<hex>`: it must load exactly like `x.gguf`. Files of other
formats are named from their magic bytes in one error line (exit 2). A few-hundred-MB file must open
through the memory map: its tensors are read-only views of the map and the process's resident memory
grows by the pages touched, not the file. `inspect` ends with "runs here: yes" or "runs here: no: why".
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from ref_impl.formats import gguf
from ref_impl.formats.ggml import GGMLType, tensor_nbytes
from tests.conftest import write_random_llama

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "stdlib-10m.gguf"
DIGEST = "sha256:" + "0123456789abcdef" * 4


def cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ref_impl", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_an_ollama_blob_without_extension_generates_like_the_gguf_file(tmp_path):
    blob = tmp_path / "blobs" / DIGEST.replace(":", "-")
    blob.parent.mkdir()
    shutil.copyfile(MODEL, blob)
    runs = [cli("generate", "--model", path, "--prompt", "def ", "--max-tokens", "8") for path in (MODEL, blob)]
    assert all(r.returncode == 0 for r in runs), runs[1].stderr
    assert runs[0].stdout == runs[1].stdout and len(runs[0].stdout) > len("def ")


@pytest.fixture(scope="module")
def not_gguf(tmp_path_factory) -> dict[str, Path]:
    """One file per format people mistake for a model file, each written from its format's definition."""
    tmp = tmp_path_factory.mktemp("formats")
    store = tmp / "ollama"   # Ollama's store: manifests/<registry>/<namespace>/<model>/<tag> and blobs/
    manifest = store / "manifests" / "registry.ollama.ai" / "library" / "tiny" / "latest"
    manifest.parent.mkdir(parents=True)
    (store / "blobs").mkdir()
    (store / "blobs" / DIGEST.replace(":", "-")).write_bytes(b"GGUF")
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": [
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "f" * 64, "size": 10},
        {"mediaType": "application/vnd.ollama.image.model", "digest": DIGEST, "size": 4}]}))
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    files = {"manifest": manifest, "json": tmp / "config.json", "safetensors": tmp / "model.safetensors",
             "zip": tmp / "pytorch_model.bin", "pickle": tmp / "old.pt", "ggjt": tmp / "old.bin", "text": tmp / "x"}
    files["json"].write_text('{"architectures": ["LlamaForCausalLM"]}')
    files["safetensors"].write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
    with zipfile.ZipFile(files["zip"], "w") as z:
        z.writestr("archive/data.pkl", b"\x80\x02}q\x00.")
    files["pickle"].write_bytes(b"\x80\x02}q\x00.")
    files["ggjt"].write_bytes(struct.pack("<II", 0x67676A74, 3) + bytes(64))
    files["text"].write_text("hello, this is not a model\n")
    return files


@pytest.mark.parametrize("kind, words", [
    ("manifest", ["Ollama manifest", "ollama/blobs/sha256-0123456789abcdef"]),
    ("json", ["JSON"]),
    ("safetensors", ["safetensors", "convert_hf_to_gguf.py"]),
    ("zip", ["zip archive", "PyTorch"]),
    ("pickle", ["pickle"]),
    ("ggjt", ["GGML/GGJT"]),
    ("text", ["not a GGUF file"]),
])
def test_a_file_that_is_not_gguf_is_named_in_one_line(kind, words, not_gguf):
    r = cli("inspect", not_gguf[kind])
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "not a GGUF file" in lines[0], r.stderr
    assert all(w in lines[0] for w in words), lines[0]


def test_generate_names_an_ollama_manifest_in_one_line(not_gguf):
    r = cli("generate", "--model", not_gguf["manifest"], "--prompt", "x")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Ollama manifest" in r.stderr, r.stderr


RSS_PROBE = """
import json, os, sys
import numpy as np
from ref_impl.formats import gguf

def rss():  # resident pages of this process, file-backed (mapped) pages included
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

before = rss()
f = gguf.read(sys.argv[1])
views = [f.array(name) for name in f.tensors]
opened = rss()
first = float(views[0][:1 << 20].sum())  # touch 4 MB of one tensor
touched = rss()
print(json.dumps({"opened": opened - before, "touched": touched - before,
                  "views": all(not v.flags.writeable and not v.flags.owndata and np.shares_memory(v, views[0])
                               == (v is views[0]) for v in views)}))
"""


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads resident memory from /proc (Linux)")
def test_a_big_file_opens_through_the_map_without_copying(tmp_path):
    path = tmp_path / "big.gguf"
    # three 100 MB F32 tensors (zeros: quick to write, and a copy of them would still be resident)
    gguf.write(path, {"general.architecture": "llama"}, {f"t{i}": np.zeros(25 << 20, np.float32) for i in range(3)})
    assert path.stat().st_size > 300e6
    r = subprocess.run([sys.executable, "-c", RSS_PROBE, path], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    growth = json.loads(r.stdout)
    assert growth["views"]                       # read-only views of the map, not copies, one per tensor
    assert growth["opened"] < 16e6               # parsing and taking every view reads the header only
    assert growth["touched"] < 16e6 + 4.5e6 * 2  # touching 4 MB maps those pages, not the file


# ---- inspect: runs here? ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def verdict_files(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("verdict")
    gpt2 = tmp / "gpt2.gguf"
    gguf.write(gpt2, {"general.architecture": "gpt2"}, {"wte.weight": np.zeros((8, 4), np.float32)})
    no_vocab = write_random_llama(tmp / "no-vocab.gguf")   # the gguf package's file, with no tokenizer keys
    base = write_random_llama(tmp / "wide.gguf", dim=256, heads=4, kv_heads=2, ff=256)
    iq2 = tmp / "iq2.gguf"   # one matrix in IQ2_XXS, a type the reader does not decode
    with gguf.read(base) as f:
        tensors = {name: f.tensor_data(name) for name in f.tensors}
        name = "blk.0.ffn_down.weight"
        shape = f.tensors[name].shape
        tensors[name] = gguf.TensorData(GGMLType.IQ2_XXS, shape, bytes(tensor_nbytes(GGMLType.IQ2_XXS, shape)))
        gguf.write(iq2, f.fields, tensors)
    return {"shipped": MODEL, "gpt2": gpt2, "no-vocab": no_vocab, "iq2": iq2}


@pytest.mark.parametrize("kind, verdict", [
    ("shipped", "runs here: yes"),
    ("gpt2", "runs here: no: unsupported architecture 'gpt2'"),
    ("no-vocab", "runs here: no: tokenizer.ggml.model is None"),
    ("iq2", "runs here: no: tensors of types this reader cannot decode (1 IQ2_XXS tensors)"),
], ids=["yes", "architecture", "tokenizer", "tensor-type"])
def test_inspect_says_whether_the_file_runs_here(kind, verdict, verdict_files):
    r = cli("inspect", verdict_files[kind])
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1].startswith("  " + verdict), r.stdout.splitlines()[-1]


def test_a_model_larger_than_memory_does_not_run_here(monkeypatch):
    from ref_impl.engine import runnable

    monkeypatch.setattr(runnable, "memory_bytes", lambda: 10**6)   # a machine with 1 MB
    with gguf.read(MODEL) as f:
        reason = runnable.why_not(f)
        params = sum(int(np.prod(t.shape)) for t in f.tensors.values())  # tied: no output.weight
    import mlx.core as mx

    if mx.default_device() != mx.cpu:
        assert reason is None   # the memory check is the CPU's, where generate holds float32 weights
    else:
        assert f"its {params / 1e6:.1f}M weights take {params * 4 / 1e9:.2f} GB as float32" in reason, reason
        assert reason.endswith("more than this machine's 0.00 GB of memory"), reason
