"""measure/gemvdecode.py: the five 4-bit inner loops as source, their shared memory, the float trick's arithmetic,
and the suite's skip off CUDA (the timings themselves need an NVIDIA GPU)."""

import numpy as np
import pytest

from ref_impl import kernels
from ref_impl.kernels import fusedlayer
from ref_impl.measure import gemvdecode


def test_every_decode_has_its_branch_and_todays_is_the_kernels_own():
    assert gemvdecode.DECODES == ("float-trick", "two-magic", "half2", "int8-dp4a", "ceiling")
    body = gemvdecode.BODY
    for dec in range(len(gemvdecode.DECODES) - 1):
        assert f"DEC == {dec}" in body
    assert "::gemv_decode::float_trick(" in body and "::ref_gemv::decode(" in body and "::ref_gemv::affine<4>(" in body
    assert "__dp4a" in body and "__hfma2" in body


def test_shared_memory_holds_what_each_decode_stages():
    k = 4096
    assert gemvdecode.shared_bytes("two-magic", k) == 4 * fusedlayer.padded(k)      # floats, padded as the fused layer
    assert gemvdecode.shared_bytes("half2", k) == (k // 32) * (20 + 1) * 4   # 20 words of pairs, a sum a chunk
    assert gemvdecode.shared_bytes("int8-dp4a", k) == (k // 32) * (12 + 2) * 4         # 8 words (+4 pad), scale, sum


def test_the_float_trick_recovers_every_code():
    """The old decode as the header writes it: code e OR-ed into 2^23's mantissa at bits 4j, scaled by 2^-4j, 2^23
    removed (codes 5-7 from the word shifted by 20), in float32 arithmetic."""
    rng = np.random.default_rng(0)
    words = rng.integers(0, 2**32, size=1000, dtype=np.uint64).astype(np.uint32)
    for e in range(8):
        j = e if e < 5 else e - 5
        src = words if e < 5 else words >> np.uint32(20)
        bits = (src & np.uint32(0xF << (4 * j))) | np.uint32(0x4B000000)
        inv = np.float32(1.0 / (1 << (4 * j)))
        q = bits.view(np.float32) * inv - np.float32(8388608.0) * inv
        assert np.array_equal(q, ((words >> np.uint32(4 * e)) & np.uint32(0xF)).astype(np.float32)), e


def test_relative_error_is_the_largest_error_over_the_largest_value():
    assert gemvdecode.relative_error(np.array([1.0, -2.5]), np.array([1.0, -2.0])) == pytest.approx(0.25)


@pytest.mark.skipif(kernels.on_cuda(), reason="checks the skip off CUDA")
def test_off_cuda_the_suite_is_one_skipped_record(monkeypatch):
    monkeypatch.setattr(gemvdecode, "roofs", lambda *a: pytest.fail("off CUDA nothing is measured"))
    (rec,) = gemvdecode.bench_gemv_decode()
    assert rec["experiment"] == "gemv-decode" and rec["metric"] == "skipped" and rec["weights"] == "q4g32"
    assert "needs MLX's CUDA backend" in rec["note"]
