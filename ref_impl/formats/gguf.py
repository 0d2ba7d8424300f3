"""GGUF v3: the file format llama.cpp loads models from, read and written from scratch.

A GGUF file is one header, then one blob of tensor bytes. All integers are little-endian.

    magic        4 bytes  b"GGUF"
    version      u32      3 (2 has the same layout; 1 used u32 counts and is not supported)
    tensor_count u64
    kv_count     u64
    kv_count metadata entries:    key: string, value_type: u32, value
    tensor_count tensor infos:    name: string, n_dims: u32, ne: u64[n_dims], ggml_type: u32, offset: u64
    zero padding up to a multiple of `general.alignment` (32 when the key is absent)
    data section: each tensor's bytes at data_offset + offset, every offset a multiple of the alignment

A string is a u64 byte length and UTF-8 bytes (no terminator). A value is a number, a bool (1 byte), a
string, or an array: item_type u32, count u64, then the items without type tags. Items of an array may
themselves be arrays (the spec and gguf-py allow it; llama.cpp refuses nested arrays).
`ne` lists dimensions innermost first (ggml order), the reverse of numpy's shape: a weight stored as
numpy (out, in) has ne = [in, out]. Rows are cut into blocks (32 or 256 elements for quantized types),
so the innermost dimension must be a multiple of the type's block size.

`read` memory-maps the file and hands out read-only numpy views of the tensor bytes, so opening an
8 GB model costs no copy and no RAM beyond the pages touched. Every length and count in the header is
checked against the bytes actually left *before* anything is allocated, so a corrupt or hostile file
raises `GGUFError` instead of allocating without bound.

References: llama.cpp docs/gguf.md; ggml/src/gguf.cpp (the reader llama.cpp uses).
See chapter: gguf
"""

from __future__ import annotations

import contextlib
import enum
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from ref_impl.formats import iquants, kquants
from ref_impl.formats.ggml import ELEMENT_DTYPE, GGMLType, tensor_nbytes
from ref_impl.formats.sniff import describe

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4          # GGML_MAX_DIMS
MAX_NAME_BYTES = 63   # llama.cpp's GGML_MAX_NAME is 64 including the terminating NUL
MAX_ARRAY_DEPTH = 8   # real files never nest; the cap keeps hostile files from exhausting the stack
DEQUANTIZE = {**kquants.DEQUANTIZE, **iquants.DEQUANTIZE}  # GGML type name -> dequantizer: the float path's one table
DECODABLE = (GGMLType.F32, GGMLType.F16, GGMLType.BF16, *(GGMLType[n] for n in DEQUANTIZE))  # dequantize's types


class GGUFError(ValueError):
    """A malformed GGUF file, or a request to write something GGUF cannot hold."""


class ValueType(enum.IntEnum):
    """GGUF metadata value type ids (gguf.h `enum gguf_type`)."""
    UINT8 = 0; INT8 = 1; UINT16 = 2; INT16 = 3; UINT32 = 4; INT32 = 5; FLOAT32 = 6  # noqa: E702
    BOOL = 7; STRING = 8; ARRAY = 9; UINT64 = 10; INT64 = 11; FLOAT64 = 12  # noqa: E702


_NUMBER_DTYPE = {
    ValueType.UINT8: "<u1", ValueType.INT8: "<i1", ValueType.UINT16: "<u2", ValueType.INT16: "<i2",
    ValueType.UINT32: "<u4", ValueType.INT32: "<i4", ValueType.FLOAT32: "<f4", ValueType.BOOL: "<u1",
    ValueType.UINT64: "<u8", ValueType.INT64: "<i8", ValueType.FLOAT64: "<f8"}
_INT_RANGE = {t: (int(np.iinfo(d).min), int(np.iinfo(d).max))
              for t, d in _NUMBER_DTYPE.items() if t not in (ValueType.FLOAT32, ValueType.FLOAT64, ValueType.BOOL)}
# Fewest bytes one item can occupy: bounds a count against the bytes left before allocating anything.
_MIN_ITEM_BYTES = {**{t: np.dtype(d).itemsize for t, d in _NUMBER_DTYPE.items()},
                   ValueType.STRING: 8, ValueType.ARRAY: 12}


@dataclass(frozen=True)
class Value:
    """A metadata value with its GGUF type spelled out. For ARRAY, `value` is a list (or 1-D numpy
    array) of items of `item_type`; the items of an array of arrays are Values or lists."""
    type: ValueType
    value: Any
    item_type: ValueType | None = None


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type: GGMLType
    shape: tuple[int, ...]   # numpy order (outermost first), the reverse of ggml's ne
    offset: int              # absolute file offset of the first byte
    nbytes: int


@dataclass(frozen=True)
class TensorData:
    """Raw tensor bytes to write: `data` holds exactly the blocks of `type` for numpy `shape`."""
    type: GGMLType
    shape: tuple[int, ...]
    data: bytes | np.ndarray


def _tensor_nbytes(type: GGMLType, shape: tuple[int, ...], where: str) -> int:
    """The bytes of a tensor, after checking its shape; every error a GGUFError naming the tensor."""
    if not 1 <= len(shape) <= MAX_DIMS:
        raise GGUFError(f"{where}: n_dims is {len(shape)}; ggml tensors have 1 to {MAX_DIMS} dimensions")
    if any(d <= 0 for d in shape):
        raise GGUFError(f"{where}: shape {shape} has a dimension that is not positive")
    try:
        return tensor_nbytes(type, shape)
    except ValueError as e:
        raise GGUFError(f"{where}: {e}") from None


def _ggml_type(type_id: int, where: str) -> GGMLType:
    try:
        return GGMLType(type_id)
    except ValueError:
        raise GGUFError(f"{where}: unknown ggml type {type_id}") from None


def _alignment(fields: dict[str, Value], requested: Any = None) -> int:
    """The data alignment: the stored general.alignment (which must be a UINT32), else `requested`, else 32."""
    stored = fields.get("general.alignment")
    if stored is not None:
        if stored.type is not ValueType.UINT32:
            raise GGUFError(f"general.alignment must be UINT32, not {stored.type.name}")
        if requested is not None and requested != stored.value:
            raise GGUFError(f"alignment={requested} contradicts general.alignment={stored.value}")
        requested = stored.value
    alignment = DEFAULT_ALIGNMENT if requested is None else requested
    if not isinstance(alignment, (int, np.integer)) or not 0 < alignment < 2**32 or alignment & (alignment - 1):
        raise GGUFError(f"general.alignment {alignment!r} is not a power of two below 2**32")
    return int(alignment)


# ----------------------------------------------------------------------------------------------- read

class _Cursor:
    """Reads forward through the mapped file; every read is bounds-checked first."""

    def __init__(self, buf: mmap.mmap):
        self.buf, self.pos, self.size = buf, 0, len(buf)

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise GGUFError(f"truncated file: {what} needs {n} bytes at offset {self.pos}, file has {self.size}")

    def take(self, n: int, what: str) -> bytes:
        self.need(n, what)
        self.pos += n
        return self.buf[self.pos - n:self.pos]  # slicing an mmap copies just these bytes

    def u32(self, what: str) -> int:
        return struct.unpack("<I", self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return struct.unpack("<Q", self.take(8, what))[0]

    def string(self, what: str) -> str:
        raw = self.take(self.u64(f"{what} length"), what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFError(f"invalid UTF-8 in {what} at offset {self.pos - len(raw) + e.start}") from None

    def numbers(self, vt: ValueType, n: int, what: str) -> list:
        dtype = np.dtype(_NUMBER_DTYPE[vt])
        start = self.pos
        arr = np.frombuffer(self.take(n * dtype.itemsize, what), dtype)
        if vt is ValueType.BOOL:
            if np.any(arr > 1):
                raise GGUFError(f"{what}: bool byte {int(arr.max())} is neither 0 nor 1 (near offset {start})")
            arr = arr.astype(bool)
        return arr.tolist()

    def value(self, vt: ValueType, what: str, depth: int = 0) -> Value:
        if vt is ValueType.STRING:
            return Value(vt, self.string(what))
        if vt is not ValueType.ARRAY:
            return Value(vt, self.numbers(vt, 1, what)[0])
        if depth >= MAX_ARRAY_DEPTH:
            raise GGUFError(f"{what}: arrays nested deeper than {MAX_ARRAY_DEPTH} at offset {self.pos}")
        item_type = self.value_type(f"{what} item type")
        n = self.u64(f"{what} array length")
        self.need(n * _MIN_ITEM_BYTES[item_type], f"{what}: array of {n} {item_type.name}")
        if item_type is ValueType.STRING:
            items = [self.string(f"{what}[{i}]") for i in range(n)]
        elif item_type is ValueType.ARRAY:
            items = [self.value(item_type, f"{what}[{i}]", depth + 1) for i in range(n)]
        else:
            items = self.numbers(item_type, n, what)
        return Value(vt, items, item_type)

    def value_type(self, what: str) -> ValueType:
        at, type_id = self.pos, self.u32(what)
        if type_id not in ValueType._value2member_map_:
            raise GGUFError(f"{what}: unknown value type {type_id} at offset {at}")
        return ValueType(type_id)


def _plain(v: Value) -> Any:
    """A Value as plain Python: arrays become (fresh) lists, nested arrays lists of lists."""
    if v.type is ValueType.ARRAY:
        return [_plain(x) for x in v.value] if v.item_type is ValueType.ARRAY else list(v.value)
    return v.value


class GGUFFile:
    """A parsed GGUF file holding its memory map; tensor arrays are views into that map.

    metadata: plain values (arrays as lists, lists of lists when nested); metadata_types: each key's
    ValueType; fields: typed Values (array item types included) that `write` accepts as they are, so
    `write(path, f.fields, {n: f.tensor_data(n) for n in f.tensors})` reproduces the file byte for byte;
    tensors: TensorInfo by name, in file order.
    """

    def __init__(self, path: str, buf: mmap.mmap, version: int, fields: dict[str, Value],
                 tensors: dict[str, TensorInfo], alignment: int, data_offset: int):
        self.path, self._mm, self.version = path, buf, version
        self.fields, self.tensors = fields, tensors
        self.alignment, self.data_offset = alignment, data_offset
        self.metadata = {k: _plain(v) for k, v in fields.items()}
        self.metadata_types = {k: v.type for k, v in fields.items()}

    def _info(self, name: str) -> TensorInfo:
        if self._mm is None:
            raise GGUFError(f"{self.path} is closed")
        if name not in self.tensors:
            raise KeyError(f"no tensor named {name!r} in {self.path}")
        return self.tensors[name]

    def array(self, name: str) -> np.ndarray:
        """Zero-copy read-only view: F32/F16 as float32/float16, BF16 as uint16 in `shape`;
        block-quantized types as uint8 of shape (*shape[:-1], row_bytes)."""
        info = self._info(name)
        if info.type in ELEMENT_DTYPE:
            dtype, shape = np.dtype(ELEMENT_DTYPE[info.type]), info.shape
        else:
            dtype, shape = np.dtype(np.uint8), (*info.shape[:-1], tensor_nbytes(info.type, info.shape[-1:]))
        view = np.frombuffer(self._mm, dtype, count=info.nbytes // dtype.itemsize, offset=info.offset)
        return view.reshape(shape)

    def tensor_data(self, name: str) -> TensorData:
        """The tensor's raw bytes (a view, no copy) in the form `write` takes."""
        info = self._info(name)
        return TensorData(info.type, info.shape, self.array(name))

    def dequantize(self, name: str) -> np.ndarray:
        """A float32 copy of the tensor in its numpy shape."""
        info = self._info(name)
        if info.type in (GGMLType.F32, GGMLType.F16):
            return self.array(name).astype(np.float32)
        if info.type is GGMLType.BF16:  # bf16 is the top half of a float32
            return (self.array(name).astype(np.uint32) << 16).view(np.float32)
        if info.type.name in DEQUANTIZE:
            return DEQUANTIZE[info.type.name](self.array(name)).reshape(info.shape)
        raise GGUFError(f"unsupported type {info.type.name} for tensor {name!r}: dequantize handles "
                        f"{', '.join(t.name for t in DECODABLE)}")

    def close(self) -> None:
        """Drop the map. Views still alive keep their pages mapped until they are garbage-collected."""
        buf, self._mm = self._mm, None
        if buf is not None:
            _release(buf)

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"GGUFFile({self.path!r}, v{self.version}, {len(self.fields)} keys, {len(self.tensors)} tensors)"


def _release(buf: mmap.mmap) -> None:
    with contextlib.suppress(BufferError):  # numpy views still point into the map; it is unmapped when they die
        buf.close()


def read(path: str | os.PathLike) -> GGUFFile:
    """Parse the GGUF file at `path` and map it read-only. Raises GGUFError on any malformed input."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:  # mmap cannot map an empty file
                raise GGUFError(f"truncated file: magic needs 4 bytes at offset 0, file has 0 ({path})")
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except FileNotFoundError:
        raise GGUFError(f"no such file: {path}") from None
    except IsADirectoryError:
        raise GGUFError(f"not a file: {path}") from None
    try:
        return _parse(path, buf)
    except BaseException:
        _release(buf)
        raise


def _parse(path: str, buf: mmap.mmap) -> GGUFFile:
    r = _Cursor(buf)
    magic = r.take(4, "magic")
    if magic != GGUF_MAGIC:
        what = describe(path, buf[:16], r.size)  # JSON, safetensors, ...: name it, and what to load instead
        raise GGUFError(f"bad magic {magic!r} at offset 0: {path} is not a GGUF file{f' but {what}' if what else ''}")
    version = r.u32("version")
    if version not in (2, 3):
        hint = " (a big-endian file?)" if version in (2 << 24, 3 << 24) else ""
        raise GGUFError(f"unsupported version {version}{hint}: this reader handles GGUF 2 and 3")
    n_tensors, n_kv = r.u64("tensor count"), r.u64("metadata count")
    # key length 8 + type 4 + value >= 1 byte
    r.need(n_kv * 13, f"metadata count {n_kv} (at least 13 bytes each)")

    fields: dict[str, Value] = {}
    for i in range(n_kv):
        key = r.string(f"metadata key {i}")
        if key in fields:
            raise GGUFError(f"duplicate metadata key {key!r} (entry {i})")
        fields[key] = r.value(r.value_type(f"metadata {key!r} type"), f"metadata {key!r}")

    alignment = _alignment(fields)

    # name length 8 + n_dims 4 + ne >= 8 + type 4 + offset 8
    r.need(n_tensors * 32, f"tensor count {n_tensors} (at least 32 bytes each)")
    infos = []
    for i in range(n_tensors):
        name = r.string(f"tensor info {i} name")
        where = f"tensor {name!r}"
        n_dims = r.u32(f"{where} n_dims")
        if not 1 <= n_dims <= MAX_DIMS:
            raise GGUFError(f"{where}: n_dims is {n_dims}; ggml tensors have 1 to {MAX_DIMS} dimensions")
        ne = struct.unpack(f"<{n_dims}q", r.take(8 * n_dims, f"{where} dimensions"))  # int64, as ggml reads
        shape = ne[::-1]
        ggml_type = _ggml_type(r.u32(f"{where} type"), where)
        offset = r.u64(f"{where} offset")
        if offset % alignment:
            raise GGUFError(f"{where}: data offset {offset} is not a multiple of the alignment {alignment}")
        infos.append((name, ggml_type, shape, offset, _tensor_nbytes(ggml_type, shape, where)))

    data_offset = r.pos + -r.pos % alignment
    tensors: dict[str, TensorInfo] = {}
    for name, ggml_type, shape, offset, nbytes in infos:
        if name in tensors:
            raise GGUFError(f"duplicate tensor name {name!r}")
        start = data_offset + offset
        if start + nbytes > r.size:
            raise GGUFError(f"tensor {name!r} data (bytes {start} to {start + nbytes}) lies past the end "
                            f"of the file ({r.size} bytes): truncated file or bad offset")
        tensors[name] = TensorInfo(name, ggml_type, shape, start, nbytes)
    return GGUFFile(path, buf, version, fields, tensors, alignment, data_offset)


# ---------------------------------------------------------------------------------------------- write

_ARRAY_ITEM_TYPE = {np.dtype(d): t for t, d in _NUMBER_DTYPE.items() if t is not ValueType.BOOL}
_ARRAY_ITEM_TYPE[np.dtype(bool)] = ValueType.BOOL


def _infer(v: Any, where: str) -> Value:
    """The GGUF type llama.cpp expects for a plain Python value (see `write`)."""
    if isinstance(v, Value):
        return v
    if isinstance(v, (bool, np.bool_)):
        return Value(ValueType.BOOL, bool(v))
    if isinstance(v, np.generic):  # numpy scalars follow the rule for the Python value they hold
        v = v.item()
    if isinstance(v, int):
        for t in (ValueType.UINT32, ValueType.INT32, ValueType.UINT64, ValueType.INT64):
            if _INT_RANGE[t][0] <= v <= _INT_RANGE[t][1]:
                return Value(t, v)
        raise GGUFError(f"{where}: integer {v} does not fit in 64 bits")
    if isinstance(v, float):
        return Value(ValueType.FLOAT32, v)
    if isinstance(v, str):
        return Value(ValueType.STRING, v)
    if isinstance(v, np.ndarray):
        dtype = v.dtype.newbyteorder("<")
        if v.ndim != 1 or dtype not in _ARRAY_ITEM_TYPE:
            raise GGUFError(f"{where}: only 1-D numeric numpy arrays can be metadata, got {v.dtype} {v.shape}")
        return Value(ValueType.ARRAY, v.tolist(), _ARRAY_ITEM_TYPE[dtype])
    if isinstance(v, (list, tuple)):
        items = [x.item() if isinstance(x, np.generic) else x for x in v]
        return Value(ValueType.ARRAY, items, _infer_item_type(items, where))
    raise GGUFError(f"{where}: cannot store a {type(v).__name__} as GGUF metadata")


def _infer_item_type(items: list | tuple, where: str) -> ValueType:
    def every(kinds) -> bool:
        return all(isinstance(x, kinds) and not isinstance(x, bool) for x in items)
    if not items:
        return ValueType.INT32  # nothing to infer from; pass a Value to choose another item type
    if all(isinstance(x, bool) for x in items):
        return ValueType.BOOL
    if every(str):
        return ValueType.STRING
    if every(int):  # llama.cpp wants e.g. tokenizer.ggml.token_type as INT32
        for t in (ValueType.INT32, ValueType.INT64, ValueType.UINT64):
            if all(_INT_RANGE[t][0] <= x <= _INT_RANGE[t][1] for x in items):
                return t
    if every((int, float)):
        return ValueType.FLOAT32
    if every((list, tuple, np.ndarray, Value)):
        return ValueType.ARRAY
    raise GGUFError(f"{where}: cannot infer one item type for this array; pass a Value")


def _encode_string(s: Any, where: str) -> bytes:
    if not isinstance(s, str):
        raise GGUFError(f"{where}: expected str, got {type(s).__name__}")
    try:
        raw = s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise GGUFError(f"{where}: string cannot be encoded as UTF-8 ({e.reason})") from None
    return struct.pack("<Q", len(raw)) + raw


def _encode_numbers(vt: ValueType, items: Any, where: str) -> bytes:
    items = [x.item() if isinstance(x, np.generic) else x for x in items]
    if vt is ValueType.BOOL:
        ok = all(isinstance(x, bool) for x in items)
    elif vt in _INT_RANGE:
        lo, hi = _INT_RANGE[vt]
        ok = all(isinstance(x, int) and not isinstance(x, bool) and lo <= x <= hi for x in items)
    else:
        ok = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in items)
    try:
        with np.errstate(over="ignore"):
            arr = np.array(items, dtype=_NUMBER_DTYPE[vt])
            # float32 silently turns too-large values into inf; refuse instead
            ok = ok and not np.any(np.isinf(arr) & np.isfinite(np.array(items, dtype=float)))
    except (OverflowError, ValueError, TypeError):
        ok = False
    if not ok:
        raise GGUFError(f"{where}: a value is not representable as {vt.name}")
    return arr.tobytes()


def _encode_value(v: Value, where: str, depth: int = 0) -> bytes:
    """The value's bytes, without its type tag."""
    if not isinstance(v.type, ValueType):
        raise GGUFError(f"{where}: {v.type!r} is not a ValueType")
    if v.type is ValueType.STRING:
        return _encode_string(v.value, where)
    if v.type is not ValueType.ARRAY:
        return _encode_numbers(v.type, [v.value], where)
    if not isinstance(v.item_type, ValueType) or not isinstance(v.value, (list, tuple, np.ndarray)):
        raise GGUFError(f"{where}: an ARRAY Value needs a list of items and an item_type")
    if depth >= MAX_ARRAY_DEPTH:
        raise GGUFError(f"{where}: arrays nested deeper than {MAX_ARRAY_DEPTH}")
    head = struct.pack("<IQ", v.item_type, len(v.value))
    if v.item_type is ValueType.STRING:
        return head + b"".join(_encode_string(s, f"{where}[{i}]") for i, s in enumerate(v.value))
    if v.item_type is ValueType.ARRAY:
        inner = [_infer(x, f"{where}[{i}]") for i, x in enumerate(v.value)]
        if any(x.type is not ValueType.ARRAY for x in inner):
            raise GGUFError(f"{where}: items of an array of ARRAY must be arrays")
        return head + b"".join(_encode_value(x, f"{where}[{i}]", depth + 1) for i, x in enumerate(inner))
    return head + _encode_numbers(v.item_type, v.value, where)


def _tensor_plan(name: Any, t: Any) -> tuple[GGMLType, tuple[int, ...], memoryview]:
    where = f"tensor {name!r}"
    if not isinstance(name, str) or len(name.encode("utf-8", "replace")) > MAX_NAME_BYTES:
        raise GGUFError(f"{where}: names must be str of at most {MAX_NAME_BYTES} UTF-8 bytes (llama.cpp's limit)")
    if isinstance(t, np.ndarray):
        if t.dtype.kind != "f" or t.dtype.itemsize not in (2, 4):
            raise GGUFError(f"{where}: dtype {t.dtype} is not float32 or float16; pass a TensorData for other types")
        ggml_type = GGMLType.F32 if t.dtype.itemsize == 4 else GGMLType.F16
        shape, data = t.shape, np.ascontiguousarray(t, dtype="<f4" if t.dtype.itemsize == 4 else "<f2")
    elif isinstance(t, TensorData):
        ggml_type = _ggml_type(int(t.type), where)
        shape = tuple(int(d) for d in t.shape)
        data = np.ascontiguousarray(t.data) if isinstance(t.data, np.ndarray) else t.data
    else:
        raise GGUFError(f"{where}: expected a numpy array or TensorData, got {type(t).__name__}")
    nbytes = _tensor_nbytes(ggml_type, shape, where)
    try:
        view = memoryview(data).cast("B")
    except TypeError:
        raise GGUFError(f"{where}: data must be bytes or a contiguous numpy array") from None
    if view.nbytes != nbytes:
        raise GGUFError(f"{where}: {ggml_type.name} of shape {shape} needs {nbytes} bytes, data has {view.nbytes}")
    return ggml_type, shape, view


def write(path: str | os.PathLike, metadata: dict[str, Any], tensors: dict[str, np.ndarray | TensorData],
          alignment: int | None = None) -> None:
    """Write a GGUF v3 file that llama.cpp loads.

    Args:
        metadata: key -> Value (exact type) or plain value, typed as llama.cpp expects: bool -> BOOL;
            int -> UINT32 if it fits, else INT32, UINT64, INT64; float -> FLOAT32; str -> STRING;
            list of str -> ARRAY of STRING; list of int -> ARRAY of INT32 (INT64/UINT64 if needed);
            list of float -> ARRAY of FLOAT32; list of lists -> nested arrays; 1-D numpy array or
            numpy scalar -> its own type. An empty list becomes an ARRAY of INT32.
        tensors: name -> float32/float16 numpy array (F32/F16), or TensorData for any other type.
        alignment: data alignment; stored as general.alignment when not 32. Defaults to the
            metadata's general.alignment, else 32.
    The file is written beside `path` and renamed over it, so a file mapped by `read` stays intact.
    """
    fields = {}
    for key, v in metadata.items():
        _encode_string(key, f"metadata key {key!r}")
        fields[key] = _infer(v, f"metadata {key!r}")
    alignment = _alignment(fields, alignment)
    if alignment != DEFAULT_ALIGNMENT and "general.alignment" not in fields:
        fields["general.alignment"] = Value(ValueType.UINT32, alignment)

    # Encode and validate everything before touching the disk, so errors leave no half-written file.
    kv_bytes = b"".join(_encode_string(k, k) + struct.pack("<I", v.type) + _encode_value(v, f"metadata {k!r}")
                        for k, v in fields.items())
    plan = {name: _tensor_plan(name, t) for name, t in tensors.items()}

    path = os.fspath(path)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(GGUF_MAGIC)
            f.write(struct.pack("<I", GGUF_VERSION))
            f.write(struct.pack("<QQ", len(plan), len(fields)))  # tensor_count, kv_count
            f.write(kv_bytes)
            offset = 0  # relative to the data section; each tensor starts on an aligned boundary
            for name, (ggml_type, shape, data) in plan.items():
                f.write(_encode_string(name, name))
                f.write(struct.pack("<I", len(shape)))               # n_dims
                f.write(struct.pack(f"<{len(shape)}Q", *shape[::-1]))  # ne, innermost first
                f.write(struct.pack("<IQ", ggml_type, offset))       # type, offset
                offset += data.nbytes + -data.nbytes % alignment
            f.write(bytes(-f.tell() % alignment))  # zero padding up to the data section
            for ggml_type, shape, data in plan.values():
                f.write(data)
                f.write(bytes(-f.tell() % alignment))
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


# --------------------------------------------------------------------------------------------- layout

@dataclass(frozen=True)
class Region:
    """One stretch of a GGUF file: `size` bytes at absolute file `offset`."""
    kind: str      # "header", "metadata", "tensor_info", "padding" or "tensor_data"
    name: str      # the header field, metadata key or tensor name; for padding, what it pads
    offset: int
    size: int

    @property
    def end(self) -> int:
        return self.offset + self.size


def layout(path: str | os.PathLike) -> list[Region]:
    """Every region of the GGUF file at `path` in file order, covering each byte exactly once:
    the four header fields, one region per metadata entry (key, type and value) and per tensor
    info, the padding up to the data section, then each tensor's data and the padding after it
    (up to the next tensor, or to the end of the file). Raises GGUFError on a malformed file,
    and on tensors whose data overlap.
    """
    with read(path) as f:
        r = _Cursor(f._mm)
        regions = []

        def span(kind: str, name: str, skip) -> None:   # skip() reads past the region
            start = r.pos
            skip()
            regions.append(Region(kind, name, start, r.pos - start))

        for field, n in (("magic", 4), ("version", 4), ("tensor_count", 8), ("metadata_count", 8)):
            span("header", field, lambda: r.take(n, field))
        for key in f.fields:
            span("metadata", key, lambda: (r.string("key"), r.value(r.value_type("type"), key)))
        for name in f.tensors:   # name, n_dims, ne, type (u32), offset (u64)
            span("tensor_info", name, lambda: (r.string("name"), r.take(8 * r.u32("n_dims") + 12, name)))
        pos, label = r.pos, "before the data section"
        for info in sorted(f.tensors.values(), key=lambda t: t.offset):
            if info.offset < pos:
                raise GGUFError(f"tensor {info.name!r} data at {info.offset} overlaps the bytes before it (to {pos})")
            if info.offset > pos:
                regions.append(Region("padding", label, pos, info.offset - pos))
            regions.append(Region("tensor_data", info.name, info.offset, info.nbytes))
            pos, label = info.offset + info.nbytes, f"after {info.name}"
        if pos < r.size:
            regions.append(Region("padding", label, pos, r.size - pos))
        return regions


def hexdump(data: bytes, start: int = 0, width: int = 16) -> str:
    """`data` as hex lines of `width` bytes, each led by its absolute offset (`start` is the offset
    of data[0]) and followed by the printable ASCII, like `xxd`."""
    lines = []
    for i in range(0, len(data), width):
        chunk = data[i:i + width]
        text = "".join(chr(b) if 32 <= b < 127 else "." for b in chunk)
        lines.append(f"{start + i:08x}  {chunk.hex(' '):<{3 * width - 1}}  {text}")
    return "\n".join(lines)
