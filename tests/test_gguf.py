"""Tests for ref_impl.formats.gguf, the GGUF v3 reader/writer (Q8_0 is tested in test_kquants.py).

Oracle: llama.cpp's own Python package `gguf` (GGUFReader, GGUFWriter, gguf.quants).
"""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import mmap
import os
import struct
import tracemalloc

import gguf as gguf_py
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ref_impl.formats.ggml import BLOCK, GGMLType, tensor_nbytes
from ref_impl.formats.gguf import GGUFError, TensorData, Value, ValueType, read, write
from ref_impl.formats.kquants import dequantize_q8_0, quantize_q8_0

T = ValueType
Q8 = gguf_py.GGMLQuantizationType.Q8_0
FAST = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


# ------------------------------------------------------------------------------------------ samples

def sample_metadata() -> dict:
    """Every value type, plain and explicit, with arrays (empty, of strings, nested) and unicode."""
    return {
        "general.architecture": "llama",
        "u8": Value(T.UINT8, 255), "i8": Value(T.INT8, -128), "u16": Value(T.UINT16, 65535),
        "i16": Value(T.INT16, -32768), "u32": 4294967295, "i32": -2147483648, "f32": 0.25, "bool": False,
        "str": "naïve 😀 日本語", "u64": 2**64 - 1, "i64": -2**63, "f64": Value(T.FLOAT64, 1 / 3),
        "strs": ["", "a", "ü😀"], "ints": [1, -2, 3], "floats": [0.5, -1.5, 3], "bools": [True, False],
        "empty": [], "empty_strs": Value(T.ARRAY, [], T.STRING), "i8s": Value(T.ARRAY, [-1, 1], T.INT8),
        "nested": [[1, 2], ["x", "y"], [], [[True], [0.5]]],
        "u16s": np.array([1, 2, 65535], dtype=np.uint16), "f64s": np.array([0.1, -2.0]),
        "llama.block_count": 4, "llama.rope.freq_base": 10000.0, "np_scalar": np.int64(7),
    }


EXPECTED_TYPES = {  # key -> (type, item type) after inference
    "general.architecture": (T.STRING, None), "u8": (T.UINT8, None), "i8": (T.INT8, None),
    "u16": (T.UINT16, None), "i16": (T.INT16, None), "u32": (T.UINT32, None), "i32": (T.INT32, None),
    "f32": (T.FLOAT32, None), "bool": (T.BOOL, None), "str": (T.STRING, None), "u64": (T.UINT64, None),
    "i64": (T.INT64, None), "f64": (T.FLOAT64, None), "strs": (T.ARRAY, T.STRING), "ints": (T.ARRAY, T.INT32),
    "floats": (T.ARRAY, T.FLOAT32), "bools": (T.ARRAY, T.BOOL), "empty": (T.ARRAY, T.INT32),
    "empty_strs": (T.ARRAY, T.STRING), "i8s": (T.ARRAY, T.INT8), "nested": (T.ARRAY, T.ARRAY),
    "u16s": (T.ARRAY, T.UINT16), "f64s": (T.ARRAY, T.FLOAT64), "llama.block_count": (T.UINT32, None),
    "llama.rope.freq_base": (T.FLOAT32, None), "np_scalar": (T.UINT32, None),
}


def sample_tensors(rng=None) -> dict:
    """F32/F16/BF16/Q8_0 tensors, 1-D to 4-D, sizes that force padding between tensors."""
    rng = rng or np.random.default_rng(0)
    bf16 = (rng.standard_normal((2, 3, 5)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    q8 = quantize_q8_0(rng.standard_normal((2, 1, 3, 64)).astype(np.float32))
    return {
        "f32": rng.standard_normal(33).astype(np.float32),
        "blk.0.f16": rng.standard_normal((3, 5)).astype(np.float16),
        "bf16": TensorData(GGMLType.BF16, (2, 3, 5), bf16),
        "q8_0": TensorData(GGMLType.Q8_0, (2, 1, 3, 64), q8),
    }


def raw_bytes(t) -> bytes:
    return t.data.tobytes() if isinstance(t, TensorData) else t.tobytes()


@pytest.fixture
def sample_file(tmp_path):
    path = tmp_path / "sample.gguf"
    write(path, sample_metadata(), sample_tensors())
    return path


# ------------------------------------------------------------------------------------------ round trip

def test_round_trip_metadata_and_tensors(sample_file, tmp_path):
    meta, tensors = sample_metadata(), sample_tensors()
    with read(sample_file) as f:
        assert f.version == 3 and f.alignment == 32 and f.data_offset % 32 == 0
        assert list(f.metadata) == list(meta)
        for key, (vtype, item_type) in EXPECTED_TYPES.items():
            assert f.metadata_types[key] == vtype, key
            assert f.fields[key].item_type == item_type, key
        assert f.metadata["str"] == "naïve 😀 日本語"
        assert f.metadata["u64"] == 2**64 - 1 and f.metadata["i64"] == -2**63
        assert f.metadata["f64"] == 1 / 3 and f.metadata["floats"] == [0.5, -1.5, 3.0]
        assert f.metadata["nested"] == [[1, 2], ["x", "y"], [], [[True], [0.5]]]
        assert f.metadata["u16s"] == [1, 2, 65535] and f.metadata["empty"] == []
        assert list(f.tensors) == list(tensors)
        for name, t in tensors.items():
            info = f.tensors[name]
            assert info.offset % 32 == 0 and info.offset >= f.data_offset
            assert f.array(name).tobytes() == raw_bytes(t)
        assert f.array("f32").dtype == np.float32 and f.array("blk.0.f16").dtype == np.float16
        assert f.array("bf16").dtype == np.uint16 and f.array("bf16").shape == (2, 3, 5)
        assert f.array("q8_0").shape == (2, 1, 3, 68) and f.array("q8_0").dtype == np.uint8
        np.testing.assert_array_equal(f.dequantize("blk.0.f16"), tensors["blk.0.f16"].astype(np.float32))
        np.testing.assert_array_equal(f.dequantize("q8_0"), dequantize_q8_0(tensors["q8_0"].data))
        # writing what was read gives the same bytes
        again = tmp_path / "again.gguf"
        write(again, f.fields, {n: f.tensor_data(n) for n in f.tensors})
    assert again.read_bytes() == sample_file.read_bytes()


def test_bf16_dequantize_is_exact(tmp_path):
    x = np.array([1.0, -2.5, 3.140625, 0.0, -0.0, np.inf], dtype=np.float32)
    bits = (x.view(np.uint32) >> 16).astype(np.uint16)  # these values are exact in bf16
    write(tmp_path / "b.gguf", {}, {"x": TensorData(GGMLType.BF16, (6,), bits)})
    with read(tmp_path / "b.gguf") as f:
        np.testing.assert_array_equal(f.dequantize("x"), x)


def test_custom_alignment_round_trips(tmp_path):
    path = tmp_path / "a64.gguf"
    write(path, {"a": 1}, sample_tensors(), alignment=64)
    with read(path) as f:
        assert f.alignment == 64 and f.metadata["general.alignment"] == 64
        assert f.metadata_types["general.alignment"] == T.UINT32
        assert all(i.offset % 64 == 0 for i in f.tensors.values()) and f.data_offset % 64 == 0
        write(tmp_path / "again.gguf", f.fields, {n: f.tensor_data(n) for n in f.tensors})
    assert (tmp_path / "again.gguf").read_bytes() == path.read_bytes()
    assert gguf_py.GGUFReader(path).alignment == 64


def test_zero_copy_read_only_views(sample_file):
    with read(sample_file) as f:
        for name, info in f.tensors.items():
            a = f.array(name)
            owner = a
            while not isinstance(owner, mmap.mmap):  # follow the view chain down to the file mapping
                owner = owner.obj if isinstance(owner, memoryview) else owner.base
            whole = np.frombuffer(owner, np.uint8)
            assert np.shares_memory(a, whole)
            assert a.ctypes.data == whole.ctypes.data + info.offset
            assert not a.flags.writeable
            with pytest.raises(ValueError):
                a.reshape(-1)[0] = 0
            del whole, owner
        view = f.array("f32")
    assert view[0] == sample_tensors()["f32"][0]  # views outlive close(); the map goes when they do
    with pytest.raises(GGUFError, match="closed"):
        f.array("f32")


def test_overwriting_a_mapped_file_leaves_old_views_intact(tmp_path):
    path = tmp_path / "m.gguf"
    write(path, {}, {"x": np.zeros(4, np.float32)})
    with read(path) as f:
        old = f.array("x")
        write(path, {}, {"x": np.ones(4, np.float32)})  # renamed over the path; the old inode stays mapped
        assert old.tolist() == [0, 0, 0, 0]
    with read(path) as f:
        assert f.array("x").tolist() == [1, 1, 1, 1]


def test_value_type_ids_match_gguf_py():
    assert {t.name: t.value for t in ValueType} == {t.name: t.value for t in gguf_py.GGUFValueType}


# -------------------------------------------------------------------------------------- gguf-py oracle

def test_gguf_package_reads_our_files(sample_file):
    f = read(sample_file)
    r = gguf_py.GGUFReader(sample_file)
    ours = f.fields
    theirs = {k: v for k, v in r.fields.items() if not k.startswith("GGUF.")}
    assert list(theirs) == list(ours)
    for key, v in ours.items():
        field = theirs[key]
        assert field.types[0] == v.type, key
        if v.type == T.ARRAY and v.value:  # gguf-py lists item types only for the items present
            assert field.types[1] == v.item_type, key
        if v.item_type != T.ARRAY:  # gguf-py's contents() does not rebuild nested arrays
            got = field.contents()
            assert (list(got) if v.type == T.ARRAY else got) == f.metadata[key], key
    assert [t.name for t in r.tensors] == list(f.tensors)
    for t in r.tensors:
        info = f.tensors[t.name]
        assert t.tensor_type == info.type and tuple(int(d) for d in t.shape) == info.shape[::-1]
        assert t.data_offset == info.offset and t.n_bytes == info.nbytes
        assert t.data.tobytes() == f.array(t.name).tobytes()
    f.close()


def test_we_read_gguf_package_files(tmp_path):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    path = tmp_path / "theirs.gguf"
    w = gguf_py.GGUFWriter(path, "llama")
    w.add_custom_alignment(64)
    w.add_uint8("u8", 7); w.add_int8("i8", -7); w.add_uint16("u16", 700); w.add_int16("i16", -700)  # noqa: E702
    w.add_uint32("u32", 70000); w.add_int32("i32", -70000); w.add_float32("f32", 0.1)  # noqa: E702
    w.add_uint64("u64", 2**63); w.add_int64("i64", -2**40); w.add_float64("f64", 0.1)  # noqa: E702
    w.add_bool("bool", True); w.add_string("str", "héllo 😀")  # noqa: E702
    w.add_array("tokens", ["<s>", "</s>", "ü"])
    w.add_array("scores", [0.5, -1.0])
    w.add_key_value("types", [1, 2, 3], gguf_py.GGUFValueType.ARRAY, sub_type=gguf_py.GGUFValueType.INT32)
    w.add_tensor("f32", x)
    w.add_tensor("f16", x.astype(np.float16))
    w.add_tensor("q8", gguf_py.quants.quantize(x, Q8), raw_dtype=Q8)
    w.add_tensor("bf16", gguf_py.quants.quantize(x[:, :5], gguf_py.GGMLQuantizationType.BF16),
                 raw_dtype=gguf_py.GGMLQuantizationType.BF16)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()  # noqa: E702

    r = gguf_py.GGUFReader(path)
    with read(path) as f:
        assert f.alignment == 64
        assert f.metadata["general.architecture"] == "llama" and f.metadata["str"] == "héllo 😀"
        assert f.metadata["tokens"] == ["<s>", "</s>", "ü"] and f.metadata["types"] == [1, 2, 3]
        for key, field in r.fields.items():
            if key.startswith("GGUF."):
                continue
            assert f.metadata_types[key] == field.types[0], key
            got = field.contents()
            assert (list(got) if field.types[0] == T.ARRAY else got) == f.metadata[key], key
        for t in r.tensors:
            info = f.tensors[t.name]
            assert info.offset == t.data_offset and info.shape == tuple(int(d) for d in t.shape)[::-1]
            assert f.array(t.name).tobytes() == t.data.tobytes()
            np.testing.assert_array_equal(f.dequantize(t.name),
                                          gguf_py.quants.dequantize(t.data, t.tensor_type).reshape(info.shape))
        np.testing.assert_array_equal(f.dequantize("f32"), x)


# ------------------------------------------------------------------------------ llama.cpp's own parser

class _GGUFInitParams(ctypes.Structure):
    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.POINTER(ctypes.c_void_p))]


@pytest.fixture(scope="module")
def ggml():
    """llama.cpp's C GGUF reader/writer (gguf.cpp in libggml-base), as shipped inside llama-cpp-python."""
    spec = importlib.util.find_spec("llama_cpp")
    found = glob.glob(os.path.join(os.path.dirname(spec.origin), "lib", "libggml-base.*")) if spec else []
    if not found:
        pytest.skip("llama-cpp-python's libggml-base is not installed")
    lib = ctypes.CDLL(found[0])
    P, I64 = ctypes.c_void_p, ctypes.c_int64
    for name, restype, argtypes in [
            ("gguf_init_from_file", P, [ctypes.c_char_p, _GGUFInitParams]), ("gguf_free", None, [P]),
            ("gguf_write_to_file", ctypes.c_bool, [P, ctypes.c_char_p, ctypes.c_bool]),
            ("gguf_get_n_kv", I64, [P]), ("gguf_get_n_tensors", I64, [P]), ("gguf_get_data_offset", ctypes.c_size_t, [P]),
            ("ggml_free", None, [P]), ("ggml_get_tensor", P, [P, ctypes.c_char_p]), ("ggml_get_data", P, [P])]:
        getattr(lib, name).restype, getattr(lib, name).argtypes = restype, argtypes
    return lib


def _llama_cpp_load(lib, path):
    """Parse with llama.cpp, tensor data included; returns (gguf_context, ggml_context) or None on rejection."""
    ctx = ctypes.c_void_p()
    g = lib.gguf_init_from_file(str(path).encode(), _GGUFInitParams(False, ctypes.pointer(ctx)))
    return (g, ctx) if g else None


def test_llama_cpp_reads_our_file_and_writes_the_same_header(ggml, tmp_path):
    meta = {k: v for k, v in sample_metadata().items() if k != "nested"}  # llama.cpp refuses nested arrays
    path, header = tmp_path / "ours.gguf", tmp_path / "llama_cpp_header.gguf"
    write(path, meta, sample_tensors(), alignment=64)
    loaded = _llama_cpp_load(ggml, path)
    assert loaded is not None, "llama.cpp rejected our file"
    g, ctx = loaded
    try:
        with read(path) as f:
            assert (ggml.gguf_get_n_kv(g), ggml.gguf_get_n_tensors(g)) == (len(f.fields), len(f.tensors))
            assert ggml.gguf_get_data_offset(g) == f.data_offset
            for name, info in f.tensors.items():  # llama.cpp read the same bytes for every tensor
                data = ggml.ggml_get_data(ggml.ggml_get_tensor(ctx, name.encode()))
                assert ctypes.string_at(data, info.nbytes) == f.array(name).tobytes(), name
        # llama.cpp's writer, given what it parsed, produces our header byte for byte
        assert ggml.gguf_write_to_file(g, str(header).encode(), True)
        assert path.read_bytes().startswith(header.read_bytes())
        assert len(header.read_bytes()) == f.data_offset
    finally:
        ggml.gguf_free(g)
        ggml.ggml_free(ctx)


# We are stricter than llama.cpp on these; it rejects every other malformed file below too.
_STRICTER_THAN_LLAMA_CPP = {"bad_bool", "bad_utf8_key", "bad_utf8_value", "zero_dim"}


def test_llama_cpp_rejects_the_malformed_files_too(ggml, tmp_path):
    path = tmp_path / "bad.gguf"
    for case, (raw, _) in MALFORMED.items():
        path.write_bytes(raw)
        loaded = _llama_cpp_load(ggml, path)
        if loaded:
            ggml.gguf_free(loaded[0])
            ggml.ggml_free(loaded[1])
        assert (loaded is not None) == (case in _STRICTER_THAN_LLAMA_CPP), case


# ----------------------------------------------------------------------------------- property tests

_INT_TYPES = {T.UINT8: (0, 2**8 - 1), T.INT8: (-2**7, 2**7 - 1), T.UINT16: (0, 2**16 - 1),
              T.INT16: (-2**15, 2**15 - 1), T.UINT32: (0, 2**32 - 1), T.INT32: (-2**31, 2**31 - 1),
              T.UINT64: (0, 2**64 - 1), T.INT64: (-2**63, 2**63 - 1)}
_text = st.text(st.characters(exclude_categories=("Cs",)), max_size=12)


def _items(vtype: ValueType):
    if vtype in _INT_TYPES:
        return st.integers(*_INT_TYPES[vtype])
    return {T.FLOAT32: st.floats(width=32, allow_nan=False), T.FLOAT64: st.floats(allow_nan=False),
            T.BOOL: st.booleans(), T.STRING: _text}[vtype]


_scalar_types = st.sampled_from([t for t in ValueType if t != T.ARRAY])
_scalars = _scalar_types.flatmap(lambda t: st.builds(Value, st.just(t), _items(t)))
_flat_arrays = _scalar_types.flatmap(
    lambda t: st.builds(Value, st.just(T.ARRAY), st.lists(_items(t), max_size=5), st.just(t)))
_values = st.one_of(_scalars, _flat_arrays, st.builds(Value, st.just(T.ARRAY), st.lists(_flat_arrays, max_size=3),
                                                      st.just(T.ARRAY)))
_metadata = st.dictionaries(_text, _values, max_size=8)


@st.composite
def _tensors(draw):
    out = {}
    for i in range(draw(st.integers(0, 4))):
        ggml_type = draw(st.sampled_from([GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.Q8_0]))
        block = BLOCK[ggml_type][0]
        shape = (*draw(st.lists(st.integers(1, 3), max_size=3)), block * draw(st.integers(1, 3)))
        data = draw(st.binary(min_size=tensor_nbytes(ggml_type, shape), max_size=tensor_nbytes(ggml_type, shape)))
        out[f"t{i}.{draw(_text)}"] = TensorData(ggml_type, shape, data)
    return out


@FAST
@given(metadata=_metadata, tensors=_tensors(), alignment=st.sampled_from([None, 1, 8, 32, 256]))
def test_property_round_trip(tmp_path, metadata, tensors, alignment):
    metadata.pop("general.alignment", None)
    path, again = tmp_path / "p.gguf", tmp_path / "p2.gguf"
    write(path, metadata, tensors, alignment=alignment)
    with read(path) as f:
        expected = dict(metadata)
        if alignment not in (None, 32):
            expected["general.alignment"] = Value(T.UINT32, alignment)
        assert f.fields == expected
        assert f.alignment == (alignment or 32)
        for name, t in tensors.items():
            assert f.tensors[name].type == t.type and f.tensors[name].shape == t.shape
            assert f.array(name).tobytes() == t.data
        write(again, f.fields, {n: f.tensor_data(n) for n in f.tensors})
    assert again.read_bytes() == path.read_bytes()


def _parse_or_gguf_error(path) -> None:
    """A (possibly corrupt) file either parses, with every tensor readable, or raises GGUFError."""
    try:
        f = read(path)
    except GGUFError:
        return
    with f:
        for name in f.tensors:
            f.array(name)
            try:
                with np.errstate(all="ignore"):
                    f.dequantize(name)
            except GGUFError as e:
                assert "unsupported type" in str(e)


def test_truncation_at_every_byte(tmp_path):
    path, cut = tmp_path / "full.gguf", tmp_path / "cut.gguf"
    write(path, {"general.architecture": "llama", "strs": ["a", "bc"], "nested": [[1], [2.5]], "x": 1.5},
          {"a": np.arange(6, dtype=np.float32), "b": TensorData(GGMLType.Q8_0, (1, 32), bytes(34))})
    data = path.read_bytes()
    with read(path) as f:
        end_of_data = max(i.offset + i.nbytes for i in f.tensors.values())
    for n in range(len(data)):
        cut.write_bytes(data[:n])
        if n < end_of_data:
            with pytest.raises(GGUFError, match="truncated file|past the end"):
                read(cut)
        else:  # only trailing padding is missing: the tensors are all there
            with read(cut) as f:
                assert f.array("a").tolist() == list(range(6))


@settings(FAST, max_examples=300)
@given(st.data())
def test_corrupt_header_bytes_parse_or_raise_gguf_error(tmp_path, data):
    path = tmp_path / "c.gguf"
    write(path, {"general.architecture": "llama", "n": 5, "strs": ["a", "bc"], "nested": [[1], [True]]},
          {"a": np.ones((2, 3), np.float32), "q": TensorData(GGMLType.Q8_0, (2, 32), bytes(68))})
    raw = bytearray(path.read_bytes())
    with read(path) as f:
        header_end = f.data_offset
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(0, header_end - 1))] = data.draw(st.integers(0, 255))
    path.write_bytes(bytes(raw))
    _parse_or_gguf_error(path)


# --------------------------------------------------------------------------------- malformed, targeted

def _s(x) -> bytes:
    raw = x.encode() if isinstance(x, str) else x
    return struct.pack("<Q", len(raw)) + raw


def _kv(key, vtype: int, payload: bytes) -> bytes:
    return _s(key) + struct.pack("<I", vtype) + payload


def _ti(name, ne, ggml_type=0, offset=0) -> bytes:
    return _s(name) + struct.pack(f"<I{len(ne)}Q", len(ne), *ne) + struct.pack("<IQ", ggml_type, offset)


def _file(kvs=(), infos=(), data=b"", n_kv=None, n_tensors=None, version=3, magic=b"GGUF", align=32) -> bytes:
    n_kv = len(kvs) if n_kv is None else n_kv
    n_tensors = len(infos) if n_tensors is None else n_tensors
    head = magic + struct.pack("<IQQ", version, n_tensors, n_kv) + b"".join(kvs) + b"".join(infos)
    return head + bytes(-len(head) % align) + data


_u32 = struct.Struct("<I").pack
MALFORMED = {
    "bad_magic": (_file(magic=b"GGML"), "bad magic b'GGML' at offset 0"),
    "version_1": (_file(version=1), "unsupported version 1"),
    "big_endian": (_file(version=3 << 24), "big-endian"),
    "short_header": (b"GGUF\x03\x00", "truncated file: version needs 4 bytes at offset 4, file has 6"),
    "empty": (b"", "truncated file"),
    "absurd_kv_count": (_file(n_kv=2**60), "truncated file: metadata count 1152921504606846976 "),
    "absurd_tensor_count": (_file(n_tensors=2**61), "truncated file: tensor count 2305843009213693952 "),
    "absurd_key_length": (_file([struct.pack("<Q", 2**63) + b"k"]), "truncated file: metadata key 0 needs"),
    "absurd_string_length": (_file([_kv("s", 8, struct.pack("<Q", 2**62))]),
                             r"truncated file: metadata 's' needs 4611686018427387904 bytes at offset 45, file has 64"),
    "absurd_array_length": (_file([_kv("a", 9, struct.pack("<IQ", 10, 2**62))]),
                            "truncated file: metadata 'a': array of 4611686018427387904 UINT64"),
    "absurd_string_array": (_file([_kv("a", 9, struct.pack("<IQ", 8, 2**40))]), "array of 1099511627776 STRING"),
    "unknown_value_type": (_file([_kv("k", 13, b"\0" * 8)]), "metadata 'k' type: unknown value type 13"),
    "unknown_item_type": (_file([_kv("k", 9, struct.pack("<IQ", 99, 0))]), "unknown value type 99"),
    "bad_bool": (_file([_kv("b", 7, b"\x02")]), "bool byte 2 is neither 0 nor 1"),
    "bad_utf8_key": (_file([_kv(b"\xff", 4, _u32(1))]), "invalid UTF-8 in metadata key 0 at offset 32"),
    "bad_utf8_value": (_file([_kv("s", 8, _s(b"ok\xc3"))]), "invalid UTF-8 in metadata 's'"),
    "duplicate_key": (_file([_kv("a", 4, _u32(1)), _kv("a", 4, _u32(2))]), "duplicate metadata key 'a'"),
    "alignment_not_pow2": (_file([_kv("general.alignment", 4, _u32(48))]), "48 is not a power of two"),
    "alignment_zero": (_file([_kv("general.alignment", 4, _u32(0))]), "0 is not a power of two"),
    "alignment_type": (_file([_kv("general.alignment", 10, struct.pack("<Q", 32))]), "must be UINT32, not UINT64"),
    "too_deep": (_file([_kv("n", 9, struct.pack("<IQ", 9, 1) * 9 + struct.pack("<IQ", 4, 0))]), "nested deeper"),
    "n_dims_5": (_file(infos=[_ti("t", [1, 1, 1, 1, 1])]), "tensor 't': n_dims is 5"),
    "n_dims_0": (_file(infos=[_ti("t", [])]), "tensor 't': n_dims is 0"),
    "zero_dim": (_file(infos=[_ti("t", [4, 0])]), r"shape \(0, 4\) has a dimension that is not positive"),
    "negative_dim": (_file(infos=[_ti("t", [2**64 - 1])]), r"shape \(-1,\) has a dimension that is not positive"),
    "unknown_ggml_type": (_file(infos=[_ti("t", [4], 999)]), "tensor 't': unknown ggml type 999"),
    "removed_ggml_type": (_file(infos=[_ti("t", [4], 4)]), "unknown ggml type 4"),
    "misaligned": (_file(infos=[_ti("t", [4], 0, 16)], data=bytes(64)),
                   "tensor 't': data offset 16 is not a multiple of the alignment 32"),
    "q8_0_row_33": (_file(infos=[_ti("t", [33, 2], 8)], data=bytes(1000)),
                    "row length 33 is not a multiple of the Q8_0 block size 32"),
    "duplicate_tensor": (_file(infos=[_ti("t", [4]), _ti("t", [4], 0, 32)], data=bytes(64)),
                         "duplicate tensor name 't'"),
    "data_past_end": (_file(infos=[_ti("t", [4], 0, 2**40)], data=bytes(16)), "past the end of the file"),
    "data_short": (_file(infos=[_ti("t", [4, 4])], data=bytes(63)), r"lies past the end of the file \(159 bytes\)"),
    "info_truncated": (_file(infos=[_ti("t", [4])])[:40], "truncated file"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_file_raises_gguf_error(tmp_path, case):
    raw, message = MALFORMED[case]
    path = tmp_path / f"{case}.gguf"
    path.write_bytes(raw)
    with pytest.raises(GGUFError, match=message):
        read(path)


def test_absurd_lengths_are_rejected_before_allocating(tmp_path):
    path = tmp_path / "huge.gguf"
    tracemalloc.start()
    try:
        for case in ("absurd_kv_count", "absurd_string_length", "absurd_array_length", "absurd_string_array",
                     "absurd_tensor_count"):
            path.write_bytes(MALFORMED[case][0])
            with pytest.raises(GGUFError):
                read(path)
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
    finally:
        tracemalloc.stop()


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(GGUFError, match="no such file: .*nope.gguf"):
        read(tmp_path / "nope.gguf")
    with pytest.raises(GGUFError, match="not a file"):
        read(tmp_path)


def test_known_but_unsupported_type_reads_raw_and_refuses_to_dequantize(tmp_path):
    path = tmp_path / "iq2xxs.gguf"   # a codebook i-quant: neither kquants nor iquants dequantizes those
    write(path, {}, {"w": TensorData(GGMLType.IQ2_XXS, (2, 256), bytes(132))})
    with read(path) as f:
        assert f.array("w").shape == (2, 66)
        with pytest.raises(GGUFError, match="unsupported type IQ2_XXS"):
            f.dequantize("w")
        with pytest.raises(KeyError, match="no tensor named 'x'"):
            f.array("x")


WRITE_ERRORS = {
    "alignment": (dict(alignment=48), "48 is not a power of two"),
    "alignment_conflict": (dict(metadata={"general.alignment": 64}, alignment=32), "contradicts"),
    "alignment_type": (dict(metadata={"general.alignment": Value(T.UINT64, 64)}), "must be UINT32"),
    "q8_0_bytes": (dict(tensors={"t": TensorData(GGMLType.Q8_0, (64,), bytes(64))}), "needs 68 bytes, data has 64"),
    "q8_0_row": (dict(tensors={"t": TensorData(GGMLType.Q8_0, (33,), bytes(34))}), "row length 33"),
    "five_dims": (dict(tensors={"t": np.zeros((1,) * 5, np.float32)}), "n_dims is 5"),
    "scalar": (dict(tensors={"t": np.zeros((), np.float32)}), "n_dims is 0"),
    "zero_dim": (dict(tensors={"t": np.zeros((0, 3), np.float32)}), "not positive"),
    "float64": (dict(tensors={"t": np.zeros(3)}), "float64 is not float32 or float16"),
    "not_array": (dict(tensors={"t": [1.0]}), "expected a numpy array or TensorData"),
    "bad_data": (dict(tensors={"t": TensorData(GGMLType.F32, (1,), [1.0])}), "bytes or a contiguous numpy"),
    "long_name": (dict(tensors={"x" * 64: np.zeros(1, np.float32)}), "at most 63"),
    "object": (dict(metadata={"k": object()}), "cannot store a object"),
    "int_too_big": (dict(metadata={"k": 2**64}), "does not fit in 64 bits"),
    "uint8_range": (dict(metadata={"k": Value(T.UINT8, 256)}), "not representable as UINT8"),
    "float32_overflow": (dict(metadata={"k": 1e39}), "not representable as FLOAT32"),
    "mixed_list": (dict(metadata={"k": [1, "a"]}), "cannot infer one item type"),
    "array_without_item_type": (dict(metadata={"k": Value(T.ARRAY, [1])}), "needs a list of items and an item_type"),
    "surrogate": (dict(metadata={"k": "\ud800"}), "UTF-8"),
    "bool_as_int": (dict(metadata={"k": Value(T.INT32, True)}), "not representable as INT32"),
}


@pytest.mark.parametrize("case", list(WRITE_ERRORS))
def test_write_rejects_bad_input_and_leaves_no_file(tmp_path, case):
    kwargs, message = WRITE_ERRORS[case]
    kwargs = {"metadata": {}, "tensors": {}, **kwargs}
    with pytest.raises(GGUFError, match=message):
        write(tmp_path / "out.gguf", **kwargs)
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------------- raw quantized tensors

RAW_TYPES = ["Q4_0", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]


@pytest.mark.parametrize("type_name", RAW_TYPES)
def test_raw_quantized_blocks_round_trip_and_gguf_py_reads_them(tmp_path, type_name):
    t = GGMLType[type_name]
    block, block_bytes = BLOCK[t]
    shape = (3, 2 * max(block, 256))                                 # two or more blocks per row
    rng = np.random.default_rng(int(t))
    raw = rng.integers(0, 256, (shape[0], shape[1] // block * block_bytes), dtype=np.uint8)
    path = tmp_path / f"{type_name}.gguf"
    write(path, {"general.architecture": "llama"}, {"w": TensorData(t, shape, raw), "tail": np.ones(3, np.float32)})
    with read(path) as f:
        info = f.tensors["w"]
        assert info.type is t and info.shape == shape and info.nbytes == raw.nbytes
        assert f.array("w").shape == raw.shape and np.array_equal(f.array("w"), raw)
        assert f.tensor_data("w").type is t
    r = gguf_py.GGUFReader(str(path))
    tensor = next(x for x in r.tensors if x.name == "w")
    assert tensor.tensor_type.name == type_name and list(tensor.shape) == list(shape[::-1])
    assert tensor.data.tobytes() == raw.tobytes()


@pytest.mark.parametrize("type_name", RAW_TYPES)
def test_we_read_raw_quantized_tensors_written_by_gguf_py(tmp_path, type_name):
    t = GGMLType[type_name]
    block, block_bytes = BLOCK[t]
    raw = np.random.default_rng(1).integers(0, 256, (2, 512 // block * block_bytes), dtype=np.uint8)
    path = tmp_path / f"py_{type_name}.gguf"
    w = gguf_py.GGUFWriter(str(path), "llama")
    w.add_tensor("w", raw, raw_dtype=gguf_py.GGMLQuantizationType[type_name])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with read(path) as f:
        assert f.tensors["w"].type is t and f.tensors["w"].shape == (2, 512)
        assert np.array_equal(f.array("w"), raw)


@pytest.mark.parametrize("type_name", RAW_TYPES)
def test_raw_quantized_byte_count_must_match_the_shape(tmp_path, type_name):
    t = GGMLType[type_name]
    block, block_bytes = BLOCK[t]
    need = 2 * block_bytes
    for nbytes in (need - 1, need + block_bytes, 0):
        with pytest.raises(GGUFError, match=rf"tensor 'blk\.0\.w': {type_name} of shape \(1, {2 * block}\) "
                                            rf"needs {need} bytes, data has {nbytes}"):
            write(tmp_path / "x.gguf", {}, {"blk.0.w": TensorData(t, (1, 2 * block), bytes(nbytes))})
    with pytest.raises(GGUFError, match=rf"tensor 'blk\.0\.w': row length {block + 1} is not a multiple "
                                        rf"of the {type_name} block size {block}"):
        write(tmp_path / "x.gguf", {}, {"blk.0.w": TensorData(t, (1, block + 1), bytes(block_bytes))})
    assert os.listdir(tmp_path) == []
