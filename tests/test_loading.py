"""gguf.layout against llama.cpp's own reader (gguf-py's GGUFReader offsets), and the load and
throughput measurements of ref_impl.measure.loads: they run, stop after their budget of rounds, and return sane fields."""

from __future__ import annotations

import json
import math
import os

import gguf as gguf_py
import numpy as np
import pytest

from ref_impl.formats import gguf
from ref_impl.formats.ggml import GGMLType
from ref_impl.formats.gguf import TensorData
from ref_impl.measure import loads


def oracle_regions(path) -> list[tuple[int, int]]:
    """(offset, size) of every header field, metadata entry, tensor info and tensor data, by GGUFReader."""
    r = gguf_py.GGUFReader(str(path))
    spans = [(0, 4)]                                                   # the magic (GGUFReader skips it)
    spans += [(f.offset, sum(p.nbytes for p in f.parts)) for f in r.fields.values()]
    spans += [(t.field.offset, sum(p.nbytes for p in t.field.parts)) for t in r.tensors]
    spans += [(int(t.data_offset), int(t.n_bytes)) for t in r.tensors]
    return sorted(spans)


def check_layout(path) -> list[gguf.Region]:
    regions = gguf.layout(path)
    # every byte exactly once, in order
    assert regions[0].offset == 0 and regions[-1].end == os.path.getsize(path)
    assert all(a.end == b.offset for a, b in zip(regions, regions[1:]))
    assert all(r.size > 0 for r in regions)
    # the non-padding regions are GGUFReader's, offset for offset and size for size
    assert sorted((r.offset, r.size) for r in regions if r.kind != "padding") == oracle_regions(path)
    with gguf.read(path) as f:
        data = [r for r in regions if r.kind == "tensor_data"]
        assert all(r.offset % f.alignment == 0 for r in data)
        assert [r.name for r in regions if r.kind == "metadata"] == list(f.fields)
        assert [r.name for r in regions if r.kind == "tensor_info"] == list(f.tensors)
        first = next((r for r in regions if r.kind == "tensor_data"), None)
        if first is not None:
            assert first.offset == f.data_offset
        # padding is zeros
        for r in regions:
            if r.kind == "padding":
                assert not any(f._mm[r.offset:r.end]), r
    return regions


def test_layout_of_the_shipped_model(shipped_model):
    regions = check_layout(shipped_model)
    kinds = [r.kind for r in regions]
    assert kinds[:4] == ["header"] * 4 and [r.size for r in regions[:4]] == [4, 4, 8, 8]
    with gguf.read(shipped_model) as f:
        assert kinds.count("metadata") == len(f.fields) and kinds.count("tensor_data") == len(f.tensors)


def _tensors(rng):
    return {
        "odd_f32": rng.standard_normal(7).astype(np.float32),          # 28 bytes: padding follows
        "f16": rng.standard_normal((3, 5)).astype(np.float16),          # 30 bytes
        "q4_0": TensorData(GGMLType.Q4_0, (2, 32), rng.integers(0, 256, 36, dtype=np.uint8)),
        "q6_k": TensorData(GGMLType.Q6_K, (1, 256), rng.integers(0, 256, 210, dtype=np.uint8)),
        "last": rng.standard_normal(3).astype(np.float32),
    }


@pytest.mark.parametrize("alignment", [1, 8, 32, 64, 4096])
def test_layout_of_hand_made_files_with_odd_alignments(tmp_path, alignment):
    path = tmp_path / f"a{alignment}.gguf"
    gguf.write(path, {"general.architecture": "llama", "names": ["a", "bb"], "nested": [[1], [2.5]]},
               _tensors(np.random.default_rng(alignment)), alignment=alignment)
    regions = check_layout(path)
    padding = [r for r in regions if r.kind == "padding"]
    if alignment == 1:
        assert not padding
    else:
        assert all(r.size < alignment for r in padding) and padding


def test_layout_of_a_file_written_by_gguf_py_and_of_one_without_tensors(tmp_path):
    path = tmp_path / "py.gguf"
    w = gguf_py.GGUFWriter(str(path), "llama")
    w.add_custom_alignment(64)
    w.add_tensor("a", np.ones(5, np.float32))
    w.add_tensor("b", np.ones((2, 3), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    check_layout(path)
    empty = tmp_path / "empty.gguf"
    gguf.write(empty, {"k": 1}, {})
    regions = check_layout(empty)
    assert [r.kind for r in regions][-1] in ("metadata", "padding")


def test_hexdump_shows_offsets_hex_and_ascii():
    text = gguf.hexdump(b"GGUF\x03\x00\x00\x00" + bytes(range(60, 70)), start=0x20)
    first, second = text.splitlines()
    assert first.startswith("00000020  47 47 55 46 03 00 00 00 3c 3d") and first.endswith("GGUF....<=>?@ABCDE"[:16])
    assert second.startswith("00000030  44 45") and second.endswith("DE")


# ---- measurements ---------------------------------------------------------------------------------

def _normal(a) -> np.ndarray:
    """Which elements are normal float32 numbers: finite, and not zero or subnormal."""
    a = np.asarray(a, dtype=np.float32)
    return np.isfinite(a) & (np.abs(a) >= np.finfo(np.float32).tiny)


def test_throughput_sweep_reads_only_normal_floats_at_every_offset(monkeypatch):
    # Subnormal numbers make many x86 cores' multiplies take a slow assist, which would slow an offset
    # for a reason that has nothing to do with alignment: catch every buffer the sweep builds.
    seen = []
    for name in ("_numpy_views", "_mlx_views"):
        make = getattr(loads, name)
        monkeypatch.setattr(loads, name, lambda *a, _make=make, _name=name:
                            seen.append((_name, _make(*a))) or seen[-1][1])
    offsets = tuple(range(8)) + (16, 32, 64)                # every byte shift of a float32, and more
    loads.throughput_sweep(offsets=offsets, sizes=(64 * 1024,), budget_s=0)
    assert {name for name, _ in seen} == {"_numpy_views", "_mlx_views"}
    for name, (_, views) in seen:
        assert set(views) == ({o for o in offsets if o % 4 == 0} if name == "_mlx_views" else set(offsets))
        for off, v in views.items():
            v = np.array(v, dtype=np.float32)
            assert v.size == 64 * 1024 // 4 and _normal(v).all(), (name, off)
            x = np.random.default_rng(off).standard_normal(loads.GEMV_COLS, dtype=np.float32)
            w = v[:v.size // loads.GEMV_COLS * loads.GEMV_COLS].reshape(-1, loads.GEMV_COLS)
            assert _normal(w * x).all(), (name, off)             # a GEMV's products too
    # the fill itself: random (seeded), and normal at each of the four byte shifts
    raw = loads.fill_bytes(4 * 10_000 + 3, np.random.default_rng(1))
    assert np.array_equal(raw, loads.fill_bytes(raw.size, np.random.default_rng(1)))
    assert len(np.unique(raw)) == loads.FILL_BYTES.size
    for shift in range(4):
        assert _normal(raw[shift:shift + 4 * 10_000].view(np.float32)).all(), shift


def test_throughput_sweep_returns_every_offset_with_units_and_keeps_its_budget():
    # no budget left: the three rounds every timing takes at least, no more
    assert {r.rounds for r in loads.throughput_sweep(offsets=(0, 4), sizes=(64 * 1024,), budget_s=0)} == {3}
    rows = loads.throughput_sweep(offsets=(0, 1, 4, 32), sizes=(64 * 1024,), budget_s=0.5)
    assert all(r.rounds >= 3 for r in rows)
    got = {(r.backend, r.op, r.offset_bytes) for r in rows}
    assert got == {(b, op, o) for b in ("numpy", "mlx") for op in ("sum", "gemv") for o in (0, 1, 4, 32)
                   if not (b == "mlx" and o % 4)}                      # MLX cannot view at 1 byte
    for r in rows:
        assert r.line_offset == r.offset_bytes % 64                     # the view sits where asked
        assert r.float32_aligned == (r.offset_bytes % 4 == 0)
        assert r.seconds > 0 and math.isclose(r.gb_per_s, r.buffer_bytes / r.seconds / 1e9)
        assert 0.01 < r.gb_per_s < 10_000


def test_write_synthetic_and_evict(tmp_path):
    path = loads.write_synthetic(tmp_path / "s.gguf", total_mb=2, n_tensors=4)
    with gguf.read(path) as f:
        assert len(f.tensors) == 4 and f.metadata["general.architecture"] == "synthetic"
        assert 1.5e6 < sum(t.nbytes for t in f.tensors.values()) <= 2e6
        assert float(f.array("blk.3.weight")[0, 0]) == 3 / 8
    assert loads.evict(path) is hasattr(os, "posix_fadvise")


def test_rss_has_total_anon_and_file_in_mb():
    m = loads.rss_mb()
    assert set(m) == {"rss", "anon", "file"} and 1 < m["rss"] < 1e6


@pytest.mark.parametrize("method", loads.METHODS)
def test_measure_load_reports_time_and_resident_memory(tmp_path, method):
    path = loads.write_synthetic(tmp_path / "s.gguf", total_mb=16, n_tensors=4)
    for cache in ("cold", "warm") if hasattr(os, "posix_fadvise") else ("warm",):
        t = loads.measure_load(path, method, cache)
        assert t.method == method and t.cache == cache and math.isclose(t.file_mb, os.path.getsize(path) / 1e6)
        assert t.open_s > 0 and t.first_pass_s > 0
        if os.path.exists("/proc/self/status"):
            if method == "mmap":      # the map costs nothing until read, then file-backed pages
                assert t.rss_open_mb < 0.5 * t.file_mb and t.file_pass_mb > 0.8 * t.file_mb
                assert t.anon_pass_mb < 0.25 * t.file_mb
            else:                     # a private copy on the heap
                assert t.anon_pass_mb > 0.8 * t.file_mb
    with pytest.raises(ValueError):
        loads.measure_load(path, "copy")


def test_load_comparison_covers_methods_and_caches(tmp_path):
    path = loads.write_synthetic(tmp_path / "s.gguf", total_mb=4, n_tensors=2)
    rows = loads.load_comparison(path, methods=("mmap", "read"))
    caches = ("cold", "warm") if hasattr(os, "posix_fadvise") else ("warm",)
    assert [(r.cache, r.method) for r in rows] == [(c, m) for c in caches for m in ("mmap", "read")]


def test_a_recorded_sweep_reads_back_as_it_was_measured(tmp_path, monkeypatch):
    from ref_impl.measure import records

    monkeypatch.setattr(loads, "sweep_sizes", lambda: (64 * 1024, 256 * 1024))
    path = records.write_results(loads.bench_alignment(budget_s=0), tmp_path, "bench --alignment", "test-machine")
    sweep = loads.recorded_sweeps(tmp_path)["test-machine"]
    assert sweep.run.label == "test-machine" and sweep.run.file == path.name and path.name in sweep.run.caption
    assert sweep.numpy_blas == loads.numpy_blas()
    rows = sweep.rows
    assert {(r.backend, r.op, r.buffer_bytes, r.offset_bytes) for r in rows} == {
        (b, op, size, o) for b in ("numpy", "mlx") for op in ("sum", "gemv") for size in (64 * 1024, 256 * 1024)
        for o in loads.SWEEP_OFFSETS if b == "numpy" or o % 4 == 0}
    assert all(r.rounds >= 3 and math.isclose(r.gb_per_s, r.buffer_bytes / r.seconds / 1e9) for r in rows)


def test_each_machine_reads_its_newest_complete_sweep(tmp_path):
    """Two runs per machine: the newest complete one is read; a newer one with a NaN (a measurement that
    failed unseen) is not; each machine keeps its own."""
    from ref_impl.measure import records

    def run(label: str, stamp: str, rate: float) -> None:
        recs = [records.record("alignment", "read_rate", "GB/s", rate, weights="F32", variant=f"numpy {op}",
                               backend="numpy", op=op, buffer_bytes=size, offset_bytes=o, line_offset=o % 64,
                               seconds=size / rate / 1e9 if rate == rate else rate, float32_aligned=o % 4 == 0,
                               rounds=3, numpy_blas=f"BLAS of {stamp}")
                for op in ("sum", "gemv") for size in (1024, 4096) for o in loads.SWEEP_OFFSETS]
        doc = {"schema": 1, "date": f"2026-12-0{stamp}T00:00:00+00:00", "git": stamp * 7, "command": "bench",
               "machine": {"label": label}, "records": recs}
        (tmp_path / f"{label}-2026120{stamp}-000000.json").write_text(json.dumps(doc))
    run("a", "1", 1.0)
    run("a", "2", 2.0)
    run("a", "3", math.nan)                  # newest, incomplete
    run("b", "1", 5.0)
    sweeps = loads.recorded_sweeps(tmp_path)
    assert sweeps["a"].run.file == "a-20261202-000000.json" and sweeps["a"].numpy_blas == "BLAS of 2"
    assert {r.gb_per_s for r in sweeps["a"].rows} == {2.0} and {r.gb_per_s for r in sweeps["b"].rows} == {5.0}


def test_measure_alignment_repeats_the_sweep_once_per_process(monkeypatch):
    """The live reading the ledger shows: `sweeps` independent numpy sweeps (seeds 0, 1, ...), cached so C10
    and C32 share one."""
    calls = []

    def sweep(offsets, sizes, backends, ops, budget_s, seed):
        calls.append((tuple(backends), tuple(ops), budget_s, seed))
        return [loads.Throughput("numpy", "sum", 1024, 0, 0, 1e-6, 1.0, True, 3)]
    monkeypatch.setattr(loads, "throughput_sweep", sweep)
    loads.measure_alignment.cache_clear()
    try:
        sweeps = loads.measure_alignment(2, 0.1)
        assert len(sweeps) == 2 and loads.measure_alignment(2, 0.1) is sweeps
        assert calls == [(("numpy",), ("sum", "gemv"), 0.1, 0), (("numpy",), ("sum", "gemv"), 0.1, 1)]
    finally:
        loads.measure_alignment.cache_clear()


def test_the_far_buffer_outgrows_the_last_level_cache():
    near, far = loads.sweep_sizes()
    llc = loads.last_level_cache_bytes()
    assert near == 256 * 1024 and 96 * 2**20 <= far <= 2**30
    assert llc is None or far >= min(3 * llc, 2**30)
