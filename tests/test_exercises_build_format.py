"""Build it yourself, steps 1 and 2 (book/build-it/01-gguf-reader, 02-dequantize): a GGUF reader and the Q8_0 and
Q4_K dequantizers, `pytest tests/test_exercises_build_format.py -k build_step`."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from ref_impl import exercises as ex
from ref_impl.exercises import build_format as bf
from ref_impl.formats import gguf

# ------------------------------------------------------------------------------------ step 1: right answers

NUMBER = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8",
          12: "<f8"}


def read_value(f, type_id, strings=lambda raw: raw.decode("utf-8"), bools=bool, tagged_items=False):
    """One value, through numpy dtypes; the keyword arguments make the typical slips."""
    if type_id == 8:
        n = int(np.frombuffer(f.read(8), "<u8")[0])
        return strings(f.read(n))
    if type_id == 9:
        item_type = int(np.frombuffer(f.read(4), "<u4")[0])
        n = int(np.frombuffer(f.read(8), "<u8")[0])
        items = []
        for _ in range(n):
            t = int(np.frombuffer(f.read(4), "<u4")[0]) if tagged_items else item_type
            items.append(read_value(f, t, strings, bools, tagged_items))
        return items
    dtype = np.dtype(NUMBER[type_id])
    v = np.frombuffer(f.read(dtype.itemsize), dtype)[0].item()
    return bools(v) if type_id == 7 else v


def read_gguf(path, reader=read_value, reverse=True, alignment=None, absolute=False, pad=True):
    """(metadata, tensors, data_offset); the keyword arguments make the typical slips."""
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"
        _, n_tensors, n_kv = struct.unpack("<IQQ", f.read(20))
        metadata = {}
        for _ in range(n_kv):
            key = read_value(f, 8)
            metadata[key] = reader(f, struct.unpack("<I", f.read(4))[0])
        infos = []
        for _ in range(n_tensors):
            name = read_value(f, 8)
            n_dims = struct.unpack("<I", f.read(4))[0]
            ne = struct.unpack(f"<{n_dims}Q", f.read(8 * n_dims))
            kind, offset = struct.unpack("<IQ", f.read(12))
            infos.append((name, kind, tuple(reversed(ne)) if reverse else ne, offset))
        end = f.tell()
    align = alignment or metadata.get("general.alignment", 32)
    data_offset = -(-end // align) * align if pad else end
    return metadata, {n: (k, s, o + data_offset * absolute) for n, k, s, o in infos}, data_offset


def stub(*args):
    raise NotImplementedError("Step 1: write me")


def test_build_step_1_sample_file_holds_every_value_type_and_a_header_that_both_alignments_pad_apart(tmp_path):
    path = bf.sample_gguf(tmp_path / "s.gguf")
    with gguf.read(path) as f:
        seen = {v.type for v in f.fields.values()} | {v.item_type for v in f.fields.values()}
        assert set(gguf.ValueType) <= seen
        assert f.alignment == 64 and bf.header_end(path) % 64 == 17 and f.data_offset % 64 == 0
        assert {t.type.name for t in f.tensors.values()} == {"F32", "F16", "Q8_0", "Q4_K"}
        assert any(len(t.shape) == 3 for t in f.tensors.values())


def test_build_step_1a_accepts_a_right_reader_and_says_when_it_is_not_written():
    r = ex.check_read_value(read_value)
    assert r and "every value type" in r.message, r.message
    r = ex.check_read_value(stub)
    assert not r and "not written yet" in r.message


def reads_and_steps_back(f, type_id):
    v = read_value(f, type_id)
    if type_id == 4:
        f.seek(-4, 1)
    return v


@pytest.mark.parametrize("wrong, hint", [
    (lambda f, t: read_value(f, t, strings=bytes), "strings left as bytes"),
    (lambda f, t: read_value(f, t, bools=int), "BOOL is one byte"),
    (lambda f, t: read_value(f, t, tagged_items=True), "no type tag each"),
    (lambda f, t: read_value(f, {1: 0, 3: 2, 5: 4, 11: 10}.get(t, t)), "signed and unsigned"),
    (lambda f, t: np.array(read_value(f, t)) if t == 9 else read_value(f, t), "Python lists"),
    (lambda f, t: read_value(f, 12 if t == 6 else t), "FLOAT32 (6) is 4 bytes"),
    (reads_and_steps_back, "the file is left at byte"),
])
def test_build_step_1a_rejects_typical_mistakes_with_their_hint(wrong, hint):
    r = ex.check_read_value(wrong)
    assert not r and hint in r.message, r.message


def test_build_step_1b_accepts_a_right_reader_and_says_when_it_is_not_written():
    r = ex.check_read_gguf(read_gguf)
    assert r and "both files" in r.message, r.message
    r = ex.check_read_gguf(stub)
    assert not r and "not written yet" in r.message


def drops_the_last_token(path):
    metadata, tensors, data_offset = read_gguf(path)
    return {k: v[:-1] if k == "tokenizer.ggml.tokens" else v for k, v in metadata.items()}, tensors, data_offset


def pairs_not_triples(path):
    metadata, tensors, data_offset = read_gguf(path)
    return metadata, {name: (kind, shape) for name, (kind, shape, _) in tensors.items()}, data_offset


@pytest.mark.parametrize("wrong, hint", [
    (lambda p: read_gguf(p, reverse=False), "shape not reversed"),
    (lambda p: read_gguf(p, pad=False), "data offset not aligned"),
    (lambda p: read_gguf(p, alignment=32), "general.alignment is 64"),
    (lambda p: read_gguf(p, absolute=True), "don't add data_offset"),
    (lambda p: read_gguf(p, reader=lambda f, t: read_value(f, t, strings=bytes)), "strings left as bytes"),
    (drops_the_last_token, "array of strings mis-read"),
    (lambda p: read_gguf(p, reader=lambda f, t: read_value(f, t, tagged_items=True)), "type tag read before each"),
    (lambda p: read_gguf(p)[:2], "return three things"),
    (pairs_not_triples, "expected a triple"),
])
def test_build_step_1b_rejects_typical_mistakes_with_their_hint(wrong, hint):
    r = ex.check_read_gguf(wrong)
    assert not r and hint in r.message, r.message


# ------------------------------------------------------------------------------------ step 2: right answers

Q8_0 = np.dtype([("d", "<f2"), ("qs", "i1", 32)])
Q4_K = np.dtype([("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", 12), ("qs", "u1", 128)])


def dequantize_q8_0(raw, n, quants="i1"):
    blocks = np.frombuffer(raw.tobytes(), Q8_0)
    return (blocks["qs"].view(quants).astype(np.float32) * blocks["d"][:, None].astype(np.float32)).reshape(n)


def in_float16(raw, n):
    blocks = np.frombuffer(raw.tobytes(), Q8_0)
    return (blocks["qs"] * blocks["d"][:, None]).astype(np.float32).reshape(n)   # int8 × float16 stays float16


def scale_min(s, j):
    """get_scale_min_k4 of ggml-quants.c for sub-block j, over all super-blocks at once."""
    if j < 4:
        return s[:, j] & 63, s[:, j + 4] & 63
    return (s[:, j + 4] & 0xF) | ((s[:, j - 4] >> 6) << 4), (s[:, j + 4] >> 4) | ((s[:, j] >> 6) << 4)


def dequantize_q4_k(raw, n, sign=-1, order="low first", unpack=scale_min, offset=0):
    blocks = np.frombuffer(raw.tobytes(), Q4_K)
    d, dmin = (blocks[k].astype(np.float32)[:, None] for k in ("d", "dmin"))
    s = blocks["scales"].astype(np.int32)
    out = np.empty((len(blocks), 256), np.float32)
    for j in range(8):
        chunk = blocks["qs"][:, 32 * (j // 2): 32 * (j // 2) + 32]
        low = (j % 2 == 0) == (order == "low first")
        q = (chunk & 0xF if low else chunk >> 4).astype(np.float32) - offset
        sc, m = unpack(s, j)
        out[:, 32 * j: 32 * j + 32] = d * sc.astype(np.float32)[:, None] * q + sign * dmin * m.astype(np.float32)[:, None]
    return out.reshape(n)


def test_build_step_2a_accepts_a_right_dequantizer_and_says_when_it_is_not_written():
    r = ex.check_dequantize_q8_0(dequantize_q8_0)
    assert r and "exactly the engine's values on all 3 cases" in r.message, r.message
    r = ex.check_dequantize_q8_0(stub)
    assert not r and "not written yet" in r.message


@pytest.mark.parametrize("wrong, hint", [
    (lambda raw, n: dequantize_q8_0(raw, n, quants="u1"), "signed"),
    (in_float16, "computed in float16"),
    (lambda raw, n: np.frombuffer(raw.tobytes(), Q8_0)["qs"].astype(np.float32).reshape(n), "multiply each quant"),
    (lambda raw, n: (raw.reshape(-1, 34)[:, 2:].view(np.int8) * raw.reshape(-1, 34)[:, :4].copy().view("<f4")).ravel(),
     "fp16 d read as float32"),
    (lambda raw, n: dequantize_q8_0(raw, n).astype(np.float64), "return float32"),
    (lambda raw, n: dequantize_q8_0(raw, n)[:-32], "expected n"),
])
def test_build_step_2a_rejects_typical_mistakes_with_their_hint(wrong, hint):
    r = ex.check_dequantize_q8_0(wrong)
    assert not r and hint in r.message, r.message


def test_build_step_2a_a_slow_dequantizer_passes_with_a_note(monkeypatch):
    monkeypatch.setattr(bf, "SLOW_S", 0.0)
    r = ex.check_dequantize_q8_0(dequantize_q8_0)
    assert r and "vectorise" in r.message, r.message


def test_build_step_2b_accepts_a_right_dequantizer_and_says_when_it_is_not_written():
    r = ex.check_dequantize_q4_k(dequantize_q4_k)
    assert r and "exactly the engine's values on all 3 cases" in r.message, r.message
    r = ex.check_dequantize_q4_k(stub)
    assert not r and "not written yet" in r.message


def no_high_bits(s, j):
    return (s[:, j] & 63, s[:, j + 4] & 63) if j < 4 else (s[:, j + 4] & 0xF, s[:, j + 4] >> 4)


def interleaved(raw, n):
    blocks = np.frombuffer(raw.tobytes(), Q4_K)
    x = dequantize_q4_k(raw, n).reshape(-1, 8, 32)
    q = np.stack([blocks["qs"] & 0xF, blocks["qs"] >> 4], axis=2).reshape(-1, 8, 32).astype(np.float32)
    right_q = np.stack([blocks["qs"].reshape(-1, 4, 32) & 0xF, blocks["qs"].reshape(-1, 4, 32) >> 4],
                       axis=2).reshape(-1, 8, 32).astype(np.float32)
    d = blocks["d"].astype(np.float32)[:, None, None]
    sc = np.stack([scale_min(blocks["scales"].astype(np.int32), j)[0] for j in range(8)], axis=1)[:, :, None]
    return (x + d * sc * (q - right_q)).reshape(n)


@pytest.mark.parametrize("wrong, hint", [
    (lambda raw, n: dequantize_q4_k(raw, n, order="high first"), "nibble order"),
    (interleaved, "not values 2k and 2k+1"),
    (lambda raw, n: dequantize_q4_k(raw, n, sign=+1), "dmin sign"),
    (lambda raw, n: dequantize_q4_k(raw, n, unpack=no_high_bits), "6-bit scale unpacking"),
    (lambda raw, n: dequantize_q4_k(raw, n, unpack=lambda s, j: scale_min(s, j)[::-1]), "scales and mins swapped"),
    (lambda raw, n: dequantize_q4_k(raw, n, offset=8), "no −8"),
    (lambda raw, n: dequantize_q4_k(raw, n, sign=0), "left out the min"),
])
def test_build_step_2b_rejects_typical_mistakes_with_their_hint(wrong, hint):
    r = ex.check_dequantize_q4_k(wrong)
    assert not r and hint in r.message, r.message
