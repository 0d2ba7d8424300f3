"""Results records: the one builder, the one reader, the one selector of the runs every page shows, and the
one definition of the roofs their shares are divided by.

Every measured number the book shows is one record {experiment, model, weights, kv, context, variant,
metric, unit, value, samples, peer, ...extra} (`record`), written once per machine and run into
results/<label>-<date>.json {schema, date, git, command, machine, records} (`write_results`).
A file read back is a `Run`: which machine, when, at which commit, by which command.

Which run a page shows is chosen in one place. `reference(experiment, label)` is the run every chapter
uses for one experiment on one reference machine: its newest `referable` run (`complete`: no value a NaN,
and `mlx_defaults`: no MLX_ variable set). `references` gives it for every machine that recorded the
experiment, `runs` every run, oldest first, for the pages that set runs side by side, and `reference_runs`
the whole table. A page that shows a number from any other run says which in its caption (`Run.caption`).

One definition per quantity. The bandwidth a share of a run is divided by is `bandwidth(run)`: the fastest
of the memory probes recorded in that run (`decode.roofs`: MLX's copy and read of one array, and on a CPU
numpy's copy), or, where the run recorded none, in its machine's reference roofs run (`roofs_references`:
the newest that recorded the full set); `peak_flops(run)` is the same for the matmul peak. A held-out
perplexity is named by `perplexity_text` (the whole text, a sample, or another text), and the values
several pages state are `reference_quantities`.

One vocabulary for formats. A float cache or float weights are named by their dtype, short: "f32",
"f16", "bf16" in `kv` (and `dtype`), "F32", "F16", "BF16" in `weights` (GGML's type names). Older files
wrote the float16 cache as "float16" or, in the KV-cache suite, as the scheme name "float" with its dtype
beside it, a few weights as "f16", and the memory probes under the experiments "bandwidth" and
"capstone-bandwidth": the reader maps those to today's names as it reads (`canonical`), so every reader sees
one vocabulary while the files on disk, and their values, stay as they were.

See chapter: reference-machines
"""

from __future__ import annotations

import datetime
import functools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ref_impl import MODELS_DIR, RESULTS_DIR
from ref_impl.platform.machine import git_commit, machine_info
from ref_impl.theory.shapes import PUBLIC

SHORT = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}   # a dtype's name -> the records' name
FLOAT_KV = {"float", *SHORT, *SHORT.values()}                      # every name a float cache was recorded under
ROOFS = "roofs"                                                    # the memory probes' and matmul peak's experiment
OLD_ROOFS = ("bandwidth", "capstone-bandwidth")                    # its names in older files
MONTHS = "Jan Feb Mar Apr May Jun Jul Aug Sep Oct Nov Dec".split()


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
    """The record in today's vocabulary (a new dict; the argument is not changed): the memory probes under
    ROOFS; dtype names short ("float16" -> "f16"); a float cache named by its dtype (the KV-cache suite's
    scheme "float", and bench --quant's "f32", which its float16 GPU runs wrote beside dtype "float16");
    float weights upper case ("f16" -> "F16"); the static float cache by its one scheme name, "float" (kv-jitter
    runs before 6 Dec 2026 called it "static")."""
    out = dict(r)
    if out.get("experiment") == "kv-jitter" and out.get("variant") == "static":
        out["variant"] = "float"
    if out.get("experiment") in OLD_ROOFS:
        out["experiment"] = ROOFS
    if out.get("dtype") in SHORT:
        out["dtype"] = SHORT[out["dtype"]]
    if out.get("kv") in FLOAT_KV:                    # a float cache holds the model's dtype, where recorded
        out["kv"] = out.get("dtype") or SHORT.get(out["kv"], out["kv"])
    if out.get("kv") == "float":                     # kv-speed records name the dtype in weights only
        out["kv"] = (out.get("weights") or "float").lower()
    if "weights" in out:
        out["weights"] = weights_name(out["weights"])
    return out


# ---- runs: results files read back ----------------------------------------------------------------------

@dataclass(frozen=True)
class Run:
    """One results file as a run: its machine, date, commit and command, and records (all of the file's,
    or those a selector asked for), each in today's vocabulary."""
    file: str                   # its name in results/
    machine: dict
    date: str                   # ISO 8601, UTC
    git: str                    # the commit of the code that measured
    command: str
    records: tuple[dict, ...]
    transcribed_from: str = ""  # a probe's log in results/ its records were read from once, before the probe
                                # became a bench suite; "" for a file the bench wrote

    @property
    def label(self) -> str:
        return self.machine["label"]

    @property
    def day(self) -> str:
        """The run's date as a reader says it: '2 Dec 2026'."""
        d = datetime.date.fromisoformat(self.date[:10])
        return f"{d.day} {MONTHS[d.month - 1]} {d.year}"

    @property
    def commit(self) -> str:
        """The commit as a page says it: 'commit 1a2b3c4', or that the run recorded none (a copy of the tree
        without its git history, on a lent machine, before REF_IMPL_GIT)."""
        return "commit not recorded" if self.git == "unknown" else f"commit {self.git}"

    @property
    def caption(self) -> str:
        """The line a figure or table of this run's numbers carries: machine, date, commit and file."""
        log = f", transcribed from results/{self.transcribed_from}" if self.transcribed_from else ""
        return f"{self.label}, {self.day}, {self.commit} (results/{self.file}{log})"

    def select(self, experiment: str | None = None, **where) -> list[dict]:
        """The run's records of `experiment` (any, if None) whose fields all equal `where`'s values."""
        return [r for r in self.records if experiment in (None, r["experiment"])
                and all(r.get(k) == v for k, v in where.items())]

    def value(self, experiment: str, metric: str, **where) -> float:
        """The value of the one record of `experiment` and `metric` matching `where`; an error names the run
        when there is none or more than one."""
        found = self.select(experiment, metric=metric, **where)
        if len(found) != 1:
            raise LookupError(f"results/{self.file}: {len(found)} {experiment} records of {metric} with {where}, "
                              f"not one")
        return found[0]["value"]


@functools.lru_cache(maxsize=1024)
def _parsed(path: str, mtime_ns: int, size: int) -> Run:
    """One results file, parsed and put in today's vocabulary once per version of it (the ledger reads
    every file for every claim)."""
    data = json.loads(Path(path).read_text())
    return Run(Path(path).name, dict(data["machine"]), data.get("date", ""), data.get("git", "unknown"),
               data.get("command", ""), tuple(canonical(r) for r in data["records"]), data.get("transcribed_from", ""))


def read_run(path: Path) -> Run:
    """Every record of one results file, as a Run."""
    stat = Path(path).stat()
    return _parsed(str(path), stat.st_mtime_ns, stat.st_size)


def all_runs(results_dir: Path = RESULTS_DIR) -> list[Run]:
    """Every results file in results_dir, oldest first (by the date it records, then by name)."""
    return sorted((read_run(p) for p in Path(results_dir).glob("*.json")), key=lambda r: (r.date, r.file))


def runs(experiment: str, results_dir: Path = RESULTS_DIR, **where) -> list[Run]:
    """Every run holding records of `experiment` that match `where` (e.g. model="stdlib-10m", peer=None),
    oldest first; each Run holds those records only."""
    out = []
    for run in all_runs(results_dir):
        found = run.select(experiment, **where)
        if found:
            out.append(replace(run, records=tuple(found)))
    return out


def complete(run: Run) -> bool:
    """Whether every record of a run holds a measurement: a finite number, or None (a recorded skip, or an
    answer of "none", such as a crossover no measured context reached). A NaN is a measurement that failed
    unseen (two kernel runs before the bench stopped writing them, a perplexity of a broken cache)."""
    return not any(isinstance(r["value"], float) and not math.isfinite(r["value"]) for r in run.records)


def mlx_defaults(run: Run) -> bool:
    """Whether a run ran MLX as it comes: no MLX_ environment variable set (machine.mlx_env; files written before
    it was recorded set none). A run that changed one (MLX_USE_CUDA_GRAPHS=0) measured that change, not the machine."""
    return not run.machine.get("mlx_env")


def referable(run: Run) -> bool:
    """Whether a run may be its machine's reference (of an experiment, or of its roofs): complete, and with MLX's
    defaults."""
    return complete(run) and mlx_defaults(run)


def references(experiment: str, results_dir: Path = RESULTS_DIR, keep: Callable[[Run], bool] | None = None,
               **where) -> dict[str, Run]:
    """Per machine label, the run every chapter uses for `experiment` (records matching `where`): its newest
    `referable` run, of those `keep` accepts (given its matching records) where given."""
    out: dict[str, Run] = {}
    for run in runs(experiment, results_dir, **where):     # oldest first: a newer referable run replaces
        if referable(run) and (keep is None or keep(run)):
            out[run.label] = run
    return out


def reference(experiment: str, label: str, results_dir: Path = RESULTS_DIR,
              keep: Callable[[Run], bool] | None = None, **where) -> Run | None:
    """The run every chapter uses for `experiment` on the machine `label` (records matching `where`, accepted
    by `keep`), or None when that machine has none."""
    return references(experiment, results_dir, keep, **where).get(label)


LAYER_LAUNCHES = 5   # kernels a fused layer launches a step with no pair merged (kernels/fusedlayer.py's STAGES)


def unmerged(run: Run) -> bool:
    """Whether the fused layers in a run's records launched their five kernels apart, as they do by default (no
    pair merged into one launch: kernels/fusedlayer.py's MERGE): by the pairs the records name (decode-kernels'
    `merged`, a profile's `launch`), else by primitives a token, of which a merged pair saves one a layer."""
    for r in run.records:
        merged = r.get("merged", (r.get("launch") or {}).get("merge"))
        if merged:
            return False
        if r.get("metric") == "kernels_per_token" and r.get("variant", "").startswith("layers") and merged is None:
            layers = PUBLIC[r["model"]].num_hidden_layers if r.get("model") in PUBLIC else 0
            if r["value"] < LAYER_LAUNCHES * layers:
                return False
    return True


def reference_runs(results_dir: Path = RESULTS_DIR) -> dict[str, dict[str, Run]]:
    """Per machine label, per experiment it recorded, its reference run: the table of the Reference machines page."""
    experiments = sorted({r["experiment"] for run in all_runs(results_dir) for r in run.records})
    out: dict[str, dict[str, Run]] = {}
    for experiment in experiments:
        for label, run in references(experiment, results_dir).items():
            out.setdefault(label, {})[experiment] = run
    return dict(sorted(out.items()))


# ---- the roofs: one definition ---------------------------------------------------------------------------

def roofs_references(results_dir: Path = RESULTS_DIR) -> dict[str, Run]:
    """Per machine label, its reference roofs run: the newest complete run that recorded both of MLX's memory
    probes, copy and read (a run cut short, or transcribed from a log that kept one probe, is no machine's roof)."""
    out: dict[str, Run] = {}
    for run in runs(ROOFS, results_dir):                   # oldest first: a newer full set replaces
        if referable(run) and {"copy", "read"} <= {r["variant"] for r in run.select(ROOFS, metric="bandwidth")}:
            out[run.label] = run
    return out


def roofs_run(run: Run, results_dir: Path = RESULTS_DIR) -> Run:
    """The run whose roofs a share of `run` is divided by: the run itself where it measured them, else its
    machine's reference roofs run (`roofs_references`). LookupError when the machine recorded none."""
    own = read_run(Path(results_dir) / run.file).select(ROOFS) if (Path(results_dir) / run.file).is_file() else []
    if own:
        return replace(run, records=tuple(own))
    ref = roofs_references(results_dir).get(run.label)
    if ref is None:
        raise LookupError(f"no memory probe recorded on {run.label}: run `python -m ref_impl bench --roofs` there")
    return ref


def fastest_bandwidth(records: list[dict] | tuple[dict, ...]) -> float:
    """GB/s: the fastest memory probe among "roofs" records, the measured bandwidth a share is divided by."""
    return max(r["value"] for r in records if r["experiment"] == ROOFS and r["metric"] == "bandwidth")


def bandwidth(run: Run, results_dir: Path = RESULTS_DIR) -> tuple[float, Run]:
    """(GB/s, the run it was measured in): the measured bandwidth every share of `run`'s speed is divided by,
    the fastest of the memory probes of its roofs run (`roofs_run`)."""
    source = roofs_run(run, results_dir)
    return fastest_bandwidth(source.records), source


def peak_flops(run: Run, results_dir: Path = RESULTS_DIR) -> tuple[float, Run] | None:
    """(FLOP/s, the run it was measured in): the matmul peak of `run`'s roofs run, or None where that run
    measured bandwidth only (files before the peak was recorded)."""
    source = roofs_run(run, results_dir)
    found = source.select(ROOFS, metric="peak_flops")
    return (max(r["value"] for r in found), source) if found else None


# ---- the held-out perplexity: one label -----------------------------------------------------------------

def training_log(model: str) -> dict | None:
    """The training log of a shipped model (models/<model>.train.json), None for any other model."""
    path = MODELS_DIR / f"{model}.train.json"
    return json.loads(path.read_text()) if path.is_file() else None


def perplexity_text(r: dict, run: Run) -> str:
    """How a page names a held-out perplexity record: "held-out perplexity" alone only for the one definition
    (`evaluate.heldout_losses`: every window of the model's context over the held-out files of the Python its
    training log names); else what it is, a sample of N tokens, or another text (the held-out files of the
    standard library of the Python that ran the bench, whose corpus fingerprint differs from the training's)."""
    log = training_log(r["model"])
    if log is None:
        return "held-out perplexity (a model without a training log)"
    context = log["model"]["args"]["max_position_embeddings"]
    whole = (log["corpus"]["tokens"]["heldout"] - 1) // context * context
    sample = "" if r.get("tokens") == whole and r.get("context") == context else \
        f"a sample of {r.get('tokens') or 0:,} tokens"
    if r.get("corpus_sha256") != log["corpus"]["sha256"]:
        text = (f"another text: the held-out files of Python {run.machine.get('python', '?')}'s standard library, not "
                f"{log['corpus']['python']}'s")
        return f"held-out perplexity on {text}" + (f", {sample}" if sample else "")
    return f"held-out perplexity on {sample}" if sample else "held-out perplexity"


# ---- the reference table: one value per quantity ----------------------------------------------------------

SHIPPED = "stdlib-10m"                                                 # the course's own model
LOOP = {"sync": "synchronous loop", "async_eval": "pipelined loop"}   # bench --model's variants, by the loop they ran


@dataclass(frozen=True)
class Quantity:
    """A number several pages state, with the one value the reference runs give it on one machine."""
    name: str          # "measured bandwidth", "decode tok/s, synchronous loop", ...
    label: str         # the machine
    value: float
    unit: str
    run: Run           # the run it comes from


def reference_quantities(results_dir: Path = RESULTS_DIR) -> list[Quantity]:
    """The reference table: per machine, its measured bandwidth and matmul peak (its reference roofs run), the
    shipped model's held-out perplexity in float32 (its reference quant run, else its capstone-ppl run with the
    float cache, where that scored the training's own text whole) and its decode tok/s per loop (its reference
    decode run). A page that states one of these for that machine states this value, or names the other run it
    comes from."""
    out = []
    for label, roofs in roofs_references(results_dir).items():
        out.append(Quantity("measured bandwidth", label, bandwidth(roofs, results_dir)[0], "GB/s", roofs))
        if (peak := peak_flops(roofs, results_dir)) is not None:
            out.append(Quantity("peak FLOP/s", label, peak[0], "FLOP/s", roofs))
    scored: dict[str, Quantity] = {}          # per machine, the first reference run that scored the text whole
    for experiment, where in (("quant", {}), ("capstone-ppl", {"kv": "f32", "fused": False})):
        for label, run in references(experiment, results_dir, model=SHIPPED, weights="F32",
                                     metric="heldout_perplexity", **where).items():
            (r,) = run.records
            if perplexity_text(r, run) == "held-out perplexity" and label not in scored:
                scored[label] = Quantity("held-out perplexity", label, r["value"], "ppl", run)
    out += scored.values()
    for label, run in references("decode", results_dir, model=SHIPPED, peer=None, metric="tokens_per_s").items():
        out += [Quantity(f"decode tok/s, {LOOP[r['variant']]}", label, r["value"], "tok/s", run)
                for r in run.records if r["variant"] in LOOP]
    return out


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
