"""Results records: the one builder, the one reader and its selector, and the results file they live in.

Every measured number the book shows is one record {experiment, model, weights, kv, context, variant,
metric, unit, value, samples, peer, ...extra} (`record`), written once per machine and run into
results/<label>-<date>.json {schema, date, git, command, machine, records} (`write_results`; DESIGN.md,
"Measured results"), and read back by `read_results` / `select`.

One vocabulary for formats. A float cache or float weights are named by their dtype, short: "f32",
"f16", "bf16" in `kv` (and `dtype`), "F32", "F16", "BF16" in `weights` (GGML's type names). Older files
wrote the float16 cache as "float16" or, in the KV-cache suite, as the scheme name "float" with its dtype
beside it, and a few weights as "f16": the reader maps those to today's names as it reads (`canonical`),
so every reader sees one vocabulary while the files on disk, and their values, stay as they were.

See chapter: how-to-read
"""

from __future__ import annotations

import datetime
import functools
import json
from pathlib import Path

import numpy as np

from ref_impl import RESULTS_DIR
from ref_impl.platform.machine import git_commit, machine_info

SHORT = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}   # a dtype's name -> the records' name
FLOAT_KV = {"float", *SHORT, *SHORT.values()}                      # every name a float cache was recorded under


def dtype_name(dtype) -> str:
    """The records' name of an MLX or numpy dtype (or its name): mx.float16 -> "f16"."""
    name = str(dtype).split(".")[-1]
    return SHORT.get(name, name)


def weights_name(name: str | None) -> str | None:
    """The records' name of a weight format: float formats upper case as GGML names them ("f16" -> "F16"),
    any other as given (GGML types "Q4_K", the GEMV kernels' MLX formats "q4g32")."""
    return name.upper() if name in SHORT.values() else name


def _number(x):
    """A JSON-safe value: None stays, a yes/no is 1.0 or 0.0, an integer an int, anything else a float."""
    if x is None:
        return None
    if isinstance(x, (bool, np.bool_)):
        return float(x)
    if isinstance(x, (int, np.integer)):
        return int(x)
    return float(x)


def record(experiment: str | None, metric: str, unit: str | None, value, *, model: str | None = None,
           weights: str | None = None, kv: str | None = None, context: int | None = None,
           variant: str | None = None, samples=(), peer: str | None = None, **extra) -> dict:
    """One results record in the one shape: the standard fields in their order, then `extra` (bytes,
    note, gamma ...). value and samples become plain numbers (see `_number`); kv and weights are
    written as given, in the vocabulary of the module docstring."""
    return {"experiment": experiment, "model": model, "weights": weights, "kv": kv, "context": context,
            "variant": variant, "metric": metric, "unit": unit, "value": _number(value),
            "samples": [_number(x) for x in samples], "peer": peer, **extra}


def canonical(r: dict) -> dict:
    """The record in today's vocabulary (a new dict; the argument is not changed): dtype names short
    ("float16" -> "f16"); a float cache named by its dtype (the KV-cache suite's scheme "float", and
    bench --quant's "f32", which its float16 GPU runs wrote beside dtype "float16"); float weights
    upper case ("f16" -> "F16")."""
    out = dict(r)
    if out.get("dtype") in SHORT:
        out["dtype"] = SHORT[out["dtype"]]
    if out.get("kv") in FLOAT_KV:                    # a float cache holds the model's dtype, where recorded
        out["kv"] = out.get("dtype") or SHORT.get(out["kv"], out["kv"])
    if out.get("kv") == "float":                     # kv-speed records name the dtype in weights only
        out["kv"] = (out.get("weights") or "float").lower()
    if "weights" in out:
        out["weights"] = weights_name(out["weights"])
    return out


def read_results(experiment: str, results_dir: Path = RESULTS_DIR) -> list[tuple[str, dict, dict]]:
    """(file name, machine, record) of every record of one experiment in results/*.json, peers included,
    files in name order (per machine, oldest first); each record in today's vocabulary (`canonical`)."""
    out = []
    for path in sorted(Path(results_dir).glob("*.json")):
        stat = path.stat()
        data = _parsed(str(path), stat.st_mtime_ns, stat.st_size)
        out += [(path.name, dict(data["machine"]), canonical(r)) for r in data["records"]
                if r["experiment"] == experiment]
    return out


@functools.lru_cache(maxsize=1024)
def _parsed(path: str, mtime_ns: int, size: int) -> dict:
    """One results file, parsed once per version of it (the ledger reads every file for every claim)."""
    return json.loads(Path(path).read_text())


def select(experiment: str, results_dir: Path = RESULTS_DIR, **where) -> list[tuple[str, dict, dict]]:
    """`read_results` rows whose record has every field of `where` equal to the given value, e.g.
    select("link", variant="host copy (numpy)", metric="copy_bandwidth")."""
    return [(f, m, r) for f, m, r in read_results(experiment, results_dir)
            if all(r.get(k) == v for k, v in where.items())]


def host_copy_recorded(results_dir: Path = RESULTS_DIR) -> dict[str, dict]:
    """Recorded host copy rates (`bench --link`, variant "host copy (numpy)") per machine label, from the
    latest results file of each machine: {label: {"machine": {...}, "file": name, "sizes": [bytes],
    "gbs": [GB/s]}}, sizes ascending. The recorded view the interconnect chapter argues from."""
    out: dict[str, dict] = {}
    for name, machine, r in select("link", results_dir, variant="host copy (numpy)", metric="copy_bandwidth"):
        entry = out.get(machine["label"])              # files in name order: a later file replaces an earlier
        if entry is None or entry["file"] != name:
            entry = out[machine["label"]] = {"machine": machine, "file": name, "points": {}}
        entry["points"][r["bytes"]] = r["value"]
    for entry in out.values():
        points = entry.pop("points")
        entry["sizes"], entry["gbs"] = sorted(points), [points[b] for b in sorted(points)]
    return out


def recorded_copy_gbs(label: str, cpu: str, results_dir: Path = RESULTS_DIR) -> tuple[float, str]:
    """(GB/s, file): the newest recorded memory bandwidth of one machine (its label and CPU), the roof
    the chapters draw for it: bench's MLX copy ("bandwidth", variant copy), else twice the 256 MiB
    numpy host copy of its latest `bench --link` file (`host_copy_recorded`; that copy counts each
    byte once, a copy reads it and writes it). LookupError when the machine has neither."""
    for file, m, r in reversed(select("bandwidth", results_dir, variant="copy")):
        if (m["label"], m["cpu"]) == (label, cpu):
            return r["value"], file
    host = host_copy_recorded(results_dir).get(label)
    if host and host["machine"]["cpu"] == cpu and 256 << 20 in host["sizes"]:
        return 2 * host["gbs"][host["sizes"].index(256 << 20)], host["file"]
    raise LookupError(f"no recorded copy bandwidth for {label} ({cpu}) in {results_dir}")


def write_results(records: list[dict], out_dir: Path, command: str, label: str | None = None) -> Path:
    """Write results/<machine>-<date>.json in the course's one results shape."""
    machine = machine_info(label)
    now = datetime.datetime.now(datetime.timezone.utc)
    doc = {"schema": 1, "date": now.isoformat(timespec="seconds"), "git": git_commit(),
           "command": command, "machine": machine, "records": records}
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{machine['label']}-{now:%Y%m%d-%H%M%S}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path
