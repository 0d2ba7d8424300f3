"""Results files: the one record shape, written once per machine and run, and read back for the book.

See DESIGN.md, "Measured results": {schema, date, git, command, machine, records}.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

from ref_impl import RESULTS_DIR
from ref_impl.platform.machine import git_commit, machine_info


def read_results(experiment: str, results_dir: Path = RESULTS_DIR) -> list[tuple[str, dict, dict]]:
    """(file name, machine, record) of every record of one experiment in results/*.json, peers included."""
    out = []
    for path in sorted(results_dir.glob("*.json")):
        data = json.loads(path.read_text())
        out += [(path.name, data["machine"], r) for r in data["records"] if r["experiment"] == experiment]
    return out


def recorded_copy_gbs(label: str, cpu: str, results_dir: Path = RESULTS_DIR) -> tuple[float, str]:
    """(GB/s, file): the newest recorded memory bandwidth of one machine (its label and CPU), the roof
    the chapters draw for it: bench's MLX copy ("bandwidth", variant copy), else twice bench --link's
    256 MiB numpy host copy (which counts each byte once; a copy reads it and writes it). LookupError
    when the machine has neither."""
    for file, m, r in reversed(read_results("bandwidth", results_dir)):
        if (m["label"], m["cpu"]) == (label, cpu) and r["variant"] == "copy":
            return r["value"], file
    for file, m, r in reversed(read_results("link", results_dir)):
        if ((m["label"], m["cpu"]) == (label, cpu) and r["variant"] == "host copy (numpy)"
                and r["metric"] == "copy_bandwidth" and r.get("bytes") == 256 << 20):
            return 2 * r["value"], file
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
