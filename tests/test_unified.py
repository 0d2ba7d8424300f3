"""unified: which numpy <-> MLX conversions copy and which share bytes (by address, checked by a
second route, ctypes), whether writes cross over, the records `bench --unified` writes, and bad input.
The copy/share facts are MLX's behaviour as its docs state it: if MLX changes, these tests fail."""

from __future__ import annotations

import ctypes
import json

import mlx.core as mx
import numpy as np
import pytest

from ref_impl.__main__ import main
from ref_impl.measure import unified

# (shares memory, a write shows up on the other side; None: the result is read-only), from MLX's docs
# ("np.array(a) # copy", "mx.array(b) # copy", a copy=False view reflects writes) and DLPack's (read-only
# in numpy); mx.from_dlpack copies CPU arrays off Metal
EXPECTED = {
    "mx.array(np)": (False, False),
    "mx.from_dlpack(np)": (False, False),
    "np.array(mx)": (False, False),
    "np.asarray(mx)": (True, True),
    "memoryview(mx)": (True, True),
    "np.from_dlpack(mx)": (True, None),
}


def _ctypes_address(buffer) -> int:
    """The first byte's address through ctypes' own buffer-protocol import (independent of numpy)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(memoryview(buffer).cast("B")))


def test_every_route_has_an_expectation():
    assert set(unified.ROUTES) == set(EXPECTED)


@pytest.mark.parametrize("route", list(EXPECTED))
def test_conversion_copies_or_shares_as_documented(route):
    if route == "mx.from_dlpack(np)" and mx.metal.is_available():
        pytest.skip("newer MLX adopts page-aligned host buffers on Metal")
    fact = unified.conversion_fact(route, n=256)
    assert (fact.shares_memory, fact.writes_seen) == EXPECTED[route]
    assert (fact.src_address == fact.dst_address) == fact.shares_memory


def test_address_agrees_with_ctypes_and_numpy():
    a = mx.arange(64, dtype=mx.float32)
    assert unified.address(a) == _ctypes_address(a) == np.asarray(a).ctypes.data
    x = np.arange(64, dtype=np.float32)
    assert unified.address(x) == _ctypes_address(x)


def test_views_share_a_buffer_and_a_copy_does_not():
    a = mx.arange(64, dtype=mx.float32)
    assert _ctypes_address(a[8:]) == _ctypes_address(a) + 8 * 4        # a slice is an offset into a
    assert _ctypes_address(a.reshape(8, 8)) == _ctypes_address(a)
    assert _ctypes_address(np.array(a)) != _ctypes_address(a)
    assert unified.shares_memory(a, a[8:]) and not unified.shares_memory(a, np.array(a))


def test_writes_through_the_numpy_view_reach_mlx_kernels():
    a = mx.zeros((1000,), dtype=mx.float32)
    np.asarray(a)[:] = 3.0                   # no MLX call in between: MLX's buffer itself changed
    assert mx.sum(a * 2).item() == 6000.0


def test_numpy_source_written_after_mx_array_leaves_mlx_unchanged():
    x = np.ones(1000, dtype=np.float32)
    a = mx.array(x)
    x[:] = 5.0
    assert mx.sum(a).item() == 1000.0


@pytest.mark.skipif(mx.metal.is_available(), reason="newer MLX adopts host buffers on Metal")
def test_mlx_refuses_a_zero_copy_import_of_host_memory():
    with pytest.raises(ValueError, match="without a copy"):
        mx.from_dlpack(np.ones(16, dtype=np.float32), copy=False)


def test_plain_host_memory_is_not_cuda_memory():
    assert unified.cuda_memory_kind(np.ones(16).ctypes.data) in (None, "not CUDA memory")


def test_records_have_the_one_shape_and_the_facts():
    sizes = [4096, 16384]
    records = unified.measure_unified(max_bytes=16384, budget_s=0.5, repeats=2)
    keys = {"experiment", "model", "weights", "kv", "context", "variant", "metric", "unit", "value", "samples", "peer"}
    assert all(keys <= r.keys() and r["experiment"] == "unified" and r["peer"] is None for r in records)
    assert not [r for r in records if r["metric"] == "skipped"]
    by = {(r["variant"], r["metric"], r.get("bytes")): r for r in records}
    for route, (shares, seen) in EXPECTED.items():
        if route == "mx.from_dlpack(np)" and mx.metal.is_available():
            continue
        assert by[route, "shares_memory", None]["value"] == float(shares)
        assert by[route, "writes_seen", None]["value"] == (None if seen is None else float(seen))
        for size in sizes:
            t = by[route, "convert_us", size]
            assert t["unit"] == "us" and t["copies"] == (not shares) and len(t["samples"]) >= 3
            assert ((route, "convert_bandwidth", size) in by) == (not shares)
    device = mx.default_device().type.name
    for variant in (f"host reads a fresh {device} result (np.copyto)", "host reads it again (np.copyto)",
                    f"{device} reads a fresh mx.array(np) (sum)", f"{device} reads it again (sum)"):
        for size in sizes:
            r = by[variant, "read_bandwidth", size]
            assert r["unit"] == "GB/s" and r["value"] > 0 and len(r["samples"]) == 2
    assert by[f"export of a fresh {device} result (np.asarray)", "export_us", 4096]["unit"] == "us"


def test_cli_writes_unified_records(tmp_path):
    assert main(["bench", "--unified", "--unified-max-bytes", "4096", "--out", str(tmp_path), "--label", "t"]) == 0
    (path,) = tmp_path.glob("t-*.json")
    doc = json.loads(path.read_text())
    assert {r["experiment"] for r in doc["records"]} == {"unified"}


@pytest.mark.parametrize("call, word", [
    (lambda: unified.address([1, 2]), "not list"),
    (lambda: unified.address(mx.zeros((4,), dtype=mx.bfloat16)), "bfloat16"),
    (lambda: unified.conversion_fact("torch.tensor(np)"), "unknown route"),
    (lambda: unified.conversion_fact("np.asarray(mx)", n=0), "at least 1"),
    (lambda: unified.conversion_times("np.asarray(mx)", [4096, 4097]), "multiples of 4"),
    (lambda: unified.conversion_times("np.asarray(mx)", []), "non-empty"),
    (lambda: unified.first_reads([4096], repeats=0), "at least 1"),
    (lambda: unified.measure_unified(max_bytes=100), "below the smallest size"),
])
def test_bad_input_is_named(call, word):
    with pytest.raises((TypeError, ValueError), match=word):
        call()
