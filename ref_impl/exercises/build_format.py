"""Exercises of "Build it yourself", steps 1 and 2: read a GGUF file from its bytes, and dequantize Q8_0 and Q4_K.

Step 1 (book/build-it/01-gguf-reader) has two pieces: `read_value(f, type_id)`, one metadata value, checked on
every entry of a small file holding each value type (`sample_gguf`) and on the shipped model's tokenizer arrays;
and `read_gguf(path) -> (metadata, tensors, data_offset)`, checked on the shipped model and the small file against
`formats.gguf.read`. Step 2 (book/build-it/02-dequantize, label build-dequantize) has `dequantize_q8_0(raw, n)`
and `dequantize_q4_k(raw, n)`, checked for exact equality with `formats.kquants` on random valid blocks
(`engine.random.random_blocks`) and on the shipped model's weights quantized as llama.cpp quantizes them.
A wrong answer is compared with what the usual slips give (shape not reversed, unaligned data offset, bytes for
strings, unsigned quants, nibble order, the 6-bit scale unpacking, the sign of the min), and the hint names it.
Tests: `pytest tests/test_exercises_build_format.py -k build_step`.

See chapter: build-gguf
"""

from __future__ import annotations

import functools
import math
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ref_impl import MODELS_DIR
from ref_impl.engine.random import random_blocks
from ref_impl.exercises.core import Result, run_answer
from ref_impl.formats import gguf
from ref_impl.formats import kquants as kq
from ref_impl.formats.ggml import GGMLType

SHIPPED = MODELS_DIR / "stdlib-10m.gguf"
SAMPLE_ALIGNMENT = 64
SAMPLE_HEADER_REMAINDER = 17   # the sample's header ends 17 bytes past a multiple of 64: both 32 and 64 pad it apart
SLOW_S = 1.0                   # a dequantizer slower than this on the big case gets a note (the finale runs it on 10M values)

V, T = gguf.Value, gguf.ValueType
RECIPE = {  # how each value type is stored, for the hints
    "number": "numbers are little-endian: struct formats '<B' '<b' '<H' '<h' '<I' '<i' '<f' '<Q' '<q' '<d' for types "
              "0-6 and 10-12; a BOOL (7) is one byte, 0 or 1 ('<?' gives True/False).",
    T.STRING: "a STRING (8) is a u64 byte length, then that many UTF-8 bytes: .decode('utf-8') them.",
    T.ARRAY: "an ARRAY (9) is a u32 item type, a u64 count, then the items with no type tag each (an item may "
             "itself be an array: call read_value again with the item type).",
}
DESYNC = ("a reader that loses its place reads garbage next; the usual causes: a type tag read before each array "
          "item (there is none), a length or count read as u32 (they are u64), a string's length counted in "
          "characters (it is bytes), or a BOOL read as more than one byte.")


# ------------------------------------------------------------------------------------------ step 1

def _sample_fields(padding: int) -> dict:
    """The small file's metadata: one key per value type, arrays of each kind, alignment 64."""
    return {
        "sample.uint8": V(T.UINT8, 200), "sample.int8": V(T.INT8, -100),
        "sample.uint16": V(T.UINT16, 60_000), "sample.int16": V(T.INT16, -30_000),
        "sample.uint32": V(T.UINT32, 4_000_000_000), "sample.int32": V(T.INT32, -2_000_000_000),
        "sample.uint64": V(T.UINT64, 2**63 + 5), "sample.int64": V(T.INT64, -(2**40) - 3),
        "sample.float32": V(T.FLOAT32, 0.1), "sample.float64": V(T.FLOAT64, math.pi),
        "sample.true": V(T.BOOL, True), "sample.false": V(T.BOOL, False),
        "general.alignment": V(T.UINT32, SAMPLE_ALIGNMENT),
        "sample.string": V(T.STRING, "stdlib"), "sample.utf8": V(T.STRING, "Grüße, 世界 ✓"),
        "sample.empty_string": V(T.STRING, ""),
        "sample.int32s": V(T.ARRAY, [1, -2, 300_000], T.INT32), "sample.float32s": V(T.ARRAY, [0.5, -1.25, 3e-5], T.FLOAT32),
        "sample.bools": V(T.ARRAY, [True, False, True], T.BOOL), "sample.uint8s": V(T.ARRAY, [0, 7, 255], T.UINT8),
        "sample.strings": V(T.ARRAY, ["<s>", "é", "", "def", "Ġself"], T.STRING),
        "sample.empty_array": V(T.ARRAY, [], T.INT32),
        "sample.nested": V(T.ARRAY, [V(T.ARRAY, [1, 2], T.INT32), V(T.ARRAY, [3], T.INT32)], T.ARRAY),
        "sample.padding": V(T.STRING, "x" * padding),
    }


def _sample_tensors() -> dict:
    rng = np.random.default_rng(7)
    return {"a.f32": np.arange(5, dtype=np.float32),                                 # 20 bytes: padded to 64
            "b.f16": rng.standard_normal((3, 7)).astype(np.float16),
            "c.q8_0": gguf.TensorData(GGMLType.Q8_0, (2, 64), random_blocks("Q8_0", 2, 64, rng)),
            "d.q4_k": gguf.TensorData(GGMLType.Q4_K, (2, 3, 256), random_blocks("Q4_K", 6, 256, rng))}


def header_end(path: Path) -> int:
    """The byte just past the last tensor info: where the padding before the data section starts."""
    return max(r.end for r in gguf.layout(path) if r.kind in ("header", "metadata", "tensor_info"))


def sample_gguf(path: str | Path) -> Path:
    """Write step 1's small GGUF file at `path`: a metadata key of every value type (a non-ASCII string, arrays
    of strings, numbers and bools, an empty array, an array of arrays), general.alignment = 64 with the header
    ending 17 bytes past a multiple of 64, and F32, F16, Q8_0 and Q4_K tensors of 1 to 3 dimensions."""
    path = Path(path)
    gguf.write(path, _sample_fields(0), _sample_tensors())
    padding = (SAMPLE_HEADER_REMAINDER - header_end(path)) % SAMPLE_ALIGNMENT   # each byte of the string adds one
    gguf.write(path, _sample_fields(padding), _sample_tensors())
    return path


def _same(got, want) -> bool:
    """Equal, with the contract's Python types: str, int, float, bool, list (a tuple passes)."""
    if isinstance(want, list):
        return isinstance(got, (list, tuple)) and len(got) == len(want) and all(map(_same, got, want))
    if isinstance(want, bool):
        return isinstance(got, (bool, np.bool_)) and bool(got) == want
    if isinstance(want, str):
        return isinstance(got, str) and got == want
    if isinstance(want, int):
        return isinstance(got, (int, np.integer)) and not isinstance(got, (bool, np.bool_)) and int(got) == want
    return isinstance(got, (float, np.floating)) and float(got) == want


def _items(v) -> list:
    return list(v) if isinstance(v, (list, tuple, np.ndarray)) else []


def _value_hint(got, want, vtype: T, item_type: T | None) -> str:
    """The usual slip behind a wrong metadata value, else how the value's type is stored."""
    if isinstance(got, (bytes, bytearray)) or any(isinstance(x, (bytes, bytearray)) for x in _items(got)):
        return "strings left as bytes: decode each with .decode('utf-8')."
    if isinstance(want, list) and isinstance(got, np.ndarray):
        return "return arrays as Python lists (numpy's .tolist() gives one)."
    if isinstance(want, bool) or (isinstance(want, list) and want and isinstance(want[0], bool)):
        return "a BOOL is one byte, 0 or 1: return True or False (struct format '<?', or bool(...))."
    if item_type is T.STRING:
        return ("array of strings mis-read: after its item type (u32) and count (u64) come count strings, each a "
                "u64 length and its UTF-8 bytes, with no type tag per item.")
    if isinstance(want, float) and isinstance(got, (float, np.floating)):
        return "FLOAT32 (6) is 4 bytes ('<f'), FLOAT64 (12) is 8 ('<d')."
    if isinstance(want, int) and isinstance(got, (int, np.integer)) and any((int(got) - want) % 2**k == 0
                                                                          for k in (8, 16, 32, 64)):
        return "signed and unsigned differ: types 1, 3, 5 and 11 are signed ('<b' '<h' '<i' '<q')."
    return RECIPE.get(vtype if vtype in (T.STRING, T.ARRAY) else "number")


def _show(got, want) -> str:
    """How a wrong value differs: a list by its length or its first wrong item, anything else as itself."""
    if isinstance(want, list) and isinstance(got, (list, tuple)) and want:
        if len(got) != len(want):
            return f"has {len(got):,} items, expected {len(want):,} (first {want[0]!r:.40}, last {want[-1]!r:.40})"
        i = next(i for i, (g, w) in enumerate(zip(got, want)) if not _same(g, w))
        return f"item {i:,} is {got[i]!r:.60}, expected {want[i]!r:.60}"
    return f"is {got!r:.100}, expected {want!r:.100}"


def _value_cases(sample: Path) -> list[tuple[Path, int, int, str, object, T, T | None]]:
    """(file, value start, value end, key, value, type, item type) of every entry of the sample file, then a
    few of the shipped model's."""
    cases = []
    for path, keys in ((sample, None), (SHIPPED, ("llama.rope.freq_base", "tokenizer.ggml.add_bos_token",
                                                   "tokenizer.ggml.token_type", "tokenizer.ggml.tokens"))):
        with gguf.read(path) as f:
            for r in gguf.layout(path):
                if r.kind == "metadata" and (keys is None or r.name in keys):
                    start = r.offset + 8 + len(r.name.encode("utf-8")) + 4    # past the key and the type id
                    v = f.fields[r.name]
                    cases.append((path, start, r.end, r.name, f.metadata[r.name], v.type, v.item_type))
    return cases


def check_read_value(fn: Callable) -> Result:
    """Step 1a: `fn(f, type_id)` reads one GGUF metadata value from the binary file `f` (positioned at the
    value) and leaves `f` just past it. Called on every entry of the sample file and on four of the shipped
    model's (its 4,096 tokens among them); compared with `formats.gguf.read`, Python types included."""
    task = "Step 1a"
    if not callable(fn):
        return Result(False, f"{task}: write a function read_value(f, type_id); it is called on many values.")
    with tempfile.TemporaryDirectory(prefix="build-gguf-") as tmp:
        cases = _value_cases(sample_gguf(Path(tmp) / "sample.gguf"))
        for path, start, end, key, want, vtype, item_type in cases:
            kind = vtype.name + (f" of {item_type.name}" if item_type is not None else "")
            label = f"{'the shipped model' if path == SHIPPED else 'the sample file'}'s {key!r}: {kind}, type {int(vtype)}"
            with open(path, "rb") as f:
                f.seek(start)
                got, failed = run_answer(task, label, fn, f, int(vtype))
                at = -1 if f.closed else f.tell()
            if failed is not None:
                if "not written yet" in failed.message:
                    return failed
                return Result(False, f"{failed.message}. Hint: {RECIPE.get(vtype, RECIPE['number'])}")
            if not _same(got, want):
                return Result(False, f"{task} ({label}): the value {_show(got, want)}. "
                                     f"Hint: {_value_hint(got, want, vtype, item_type)}")
            if at != end:
                return Result(False, f"{task} ({label}): the value is right, but the file is left at byte {at:,}, "
                                     f"{at - end:+,} from its end ({end:,}): the next read would start in the wrong "
                                     f"place. Read exactly the value's bytes. {RECIPE.get(vtype, RECIPE['number'])}")
    return Result(True, f"{task}: right on all {len(cases)} values (every value type, and the shipped model's "
                        f"tokenizer arrays), each leaving the file just past it.")


def _check_metadata(task: str, label: str, got: dict, f: gguf.GGUFFile) -> Result | None:
    want = f.metadata
    if any(isinstance(k, (bytes, bytearray)) for k in got):
        return Result(False, f"{task} ({label}): metadata keys are bytes: decode them (strings left as bytes).")
    missing, extra = [k for k in want if k not in got], [k for k in got if k not in want]
    if missing or extra:
        return Result(False, f"{task} ({label}): the file has {len(want)} keys, you have {len(got)}; missing "
                             f"{missing[:3]}, unexpected {extra[:3]}. Hint: read kv_count entries, each a key "
                             f"(a string), a u32 value type, then the value.")
    for key, value in want.items():
        if not _same(got[key], value):
            hint = _value_hint(got[key], value, f.metadata_types[key], f.fields[key].item_type)
            return Result(False, f"{task} ({label}): metadata[{key!r}] {_show(got[key], value)}. Hint: {hint}")
    return None


def _check_tensors(task: str, label: str, got: dict, f: gguf.GGUFFile) -> Result | None:
    missing, extra = [k for k in f.tensors if k not in got], [k for k in got if k not in f.tensors]
    if missing or extra:
        return Result(False, f"{task} ({label}): the file has {len(f.tensors)} tensors, you have {len(got)}; "
                             f"missing {missing[:3]}, unexpected {extra[:3]}.")
    for name, info in f.tensors.items():
        try:
            kind, shape, offset = got[name]
            kind, shape, offset = int(kind), tuple(int(d) for d in shape), int(offset)
        except (TypeError, ValueError):
            return Result(False, f"{task} ({label}): tensors[{name!r}] is {got[name]!r:.80}; expected a triple "
                                 f"(ggml_type: int, shape: tuple of ints, offset: int).")
        relative = info.offset - f.data_offset
        where = f"{task} ({label}): tensors[{name!r}]"
        if kind != info.type:
            return Result(False, f"{where} has type {kind}, expected {int(info.type)} ({info.type.name}). Hint: after "
                                 f"the name come n_dims (u32), n_dims u64 dimensions, the type (u32), the offset (u64).")
        if shape != info.shape:
            hint = ("shape not reversed: GGUF lists the dimensions innermost first (ne); numpy's shape is the "
                    "reverse, rows first." if shape == info.shape[::-1] else
                    "n_dims is a u32, then n_dims dimensions of u64 each.")
            return Result(False, f"{where} has shape {shape}, expected {info.shape}. Hint: {hint}")
        if offset != relative:
            hint = ("offsets are relative to the data section, as stored: don't add data_offset."
                    if offset == info.offset else "the offset is the u64 after the type, stored relative to the "
                    "data section.")
            return Result(False, f"{where} has offset {offset:,}, expected {relative:,}. Hint: {hint}")
    return None


def _check_data_offset(task: str, label: str, got, path: Path, f: gguf.GGUFFile) -> Result | None:
    if isinstance(got, (bool, np.bool_)) or not isinstance(got, (int, np.integer)):
        return Result(False, f"{task} ({label}): data_offset should be an int (bytes), got {got!r:.80}.")
    if got == f.data_offset:
        return None
    end = header_end(path)
    hints = {end: f"data offset not aligned: the data section starts at the next multiple of the alignment "
                  f"({f.alignment}) after the tensor infos (byte {end:,}), not right after them.",
             end + -end % 32: f"this file's general.alignment is {f.alignment}: pad to it; 32 is the default only "
                              f"when the key is absent."}
    hint = hints.get(int(got))
    return Result(False, f"{task} ({label}): data_offset is {int(got):,}, expected {f.data_offset:,}. Hint: "
                         f"{hint or 'the byte after the tensor infos, rounded up to a multiple of the alignment.'}")


def check_read_gguf(fn: Callable) -> Result:
    """Step 1b: `fn(path) -> (metadata, tensors, data_offset)`, read from the bytes. Called on the shipped model
    and on the sample file (every value type, alignment 64); compared with `formats.gguf.read`: every metadata
    value with its Python type, each tensor's (ggml_type, numpy-order shape, offset in the data section), and
    the data section's absolute offset."""
    task = "Step 1b"
    if not callable(fn):
        return Result(False, f"{task}: write a function read_gguf(path); it is called on two files.")
    with tempfile.TemporaryDirectory(prefix="build-gguf-") as tmp:
        cases = [(SHIPPED, "the shipped model stdlib-10m.gguf"),
                 (sample_gguf(Path(tmp) / "sample.gguf"), "a small file with every value type and alignment 64")]
        for path, label in cases:
            out, failed = run_answer(task, label, fn, path)
            if failed is not None:
                return failed if "not written yet" in failed.message else Result(False, f"{failed.message}. Hint: {DESYNC}")
            try:
                metadata, tensors, data_offset = out
            except (TypeError, ValueError):
                return Result(False, f"{task} ({label}): return three things, (metadata, tensors, data_offset); "
                                     f"got {type(out).__name__} {out!r:.80}.")
            if not isinstance(metadata, dict) or not isinstance(tensors, dict):
                return Result(False, f"{task} ({label}): metadata and tensors should be dicts, got "
                                     f"{type(metadata).__name__} and {type(tensors).__name__}.")
            with gguf.read(path) as f:   # each part's check: None when right (a ✗ Result is falsy, so no `or`)
                for bad in (_check_metadata(task, label, metadata, f), _check_tensors(task, label, tensors, f),
                            _check_data_offset(task, label, data_offset, path, f)):
                    if bad is not None:
                        return bad
    return Result(True, f"{task}: right on both files (every key with its Python type, each tensor's type, "
                        f"shape and offset, and the data offset).")


# ------------------------------------------------------------------------------------------ step 2

def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view("<f2").astype(np.float32)


def _q8_0_variants(raw: np.ndarray) -> list[tuple[np.ndarray, str]]:
    """The values each typical Q8_0 slip gives for the blocks in `raw`, with its hint."""
    b = raw.reshape(-1, 34)
    d, q = _f16(b[:, :2]), b[:, 2:].view(np.int8).astype(np.float32)
    return [
        (b[:, 2:].astype(np.float32) * d, "the quants are signed: view qs as np.int8, not uint8."),
        (q * np.ascontiguousarray(b[:, :2]).view("<u2"),
         "d is an fp16 number: view its 2 bytes as np.float16, not as an integer."),
        (q * np.ascontiguousarray(b[:, :4]).view("<f4"),
         "fp16 d read as float32: d is 2 bytes, np.float16, then the 32 quants start at byte 2."),
        (q * (np.ascontiguousarray(b[:, :2]).view("<u2").astype(np.uint32) << 16).view(np.float32),
         "d is IEEE fp16 (np.float16), not bfloat16."),
        ((b[:, 2:].view(np.int8) * np.ascontiguousarray(b[:, :2]).view("<f2")).astype(np.float32),
         "computed in float16: numpy keeps int8 × float16 in float16; convert d to float32 first."),
        (b[:, :32].view(np.int8).astype(np.float32) * _f16(b[:, 32:34]),
         "the block starts with d (2 bytes), then the 32 quants."),
        (q, "multiply each quant by its block's d."),
    ]


def _unpack_variants(s: np.ndarray) -> list[tuple[np.ndarray, np.ndarray, str]]:
    """(scales, mins, hint) that each typical slip in the 6-bit unpacking gives for scale bytes s (n, 12)."""
    lo, mid, hi = (s[:, i:i + 4].astype(np.int64) for i in (0, 4, 8))
    cat = functools.partial(np.concatenate, axis=1)
    sc_hi, mn_hi = (hi & 15) | ((lo >> 6) << 4), (hi >> 4) | ((mid >> 6) << 4)
    return [
        (cat([lo & 63, hi & 15]), cat([mid & 63, hi >> 4]),
         ("6-bit scale unpacking: scales and mins 4-7 also take 2 top bits, from the top of bytes 0-3 (scales) "
          "and 4-7 (mins).")),
        (cat([mid & 63, mn_hi]), cat([lo & 63, sc_hi]),
         "6-bit scale unpacking: scales and mins swapped (bytes 0-3 hold scales 0-3, bytes 4-7 mins 0-3)."),
        (cat([lo & 63, (hi >> 4) | ((lo >> 6) << 4)]), cat([mid & 63, (hi & 15) | ((mid >> 6) << 4)]),
         "6-bit scale unpacking: in bytes 8-11 the low nibble belongs to the scale, the high one to the min."),
        (cat([lo & 63, (hi & 15) | ((mid >> 6) << 4)]), cat([mid & 63, (hi >> 4) | ((lo >> 6) << 4)]),
         "6-bit scale unpacking: scale j+4 takes the top 2 bits of byte j, min j+4 those of byte j+4."),
        (cat([lo, sc_hi]), cat([mid, mn_hi]),
         "6-bit scale unpacking: scales and mins 0-3 are the low 6 bits of their byte (& 63)."),
        (cat([lo & 63, (hi & 15) | (lo & 0xC0)]), cat([mid & 63, (hi >> 4) | (mid & 0xC0)]),
         "6-bit scale unpacking: the top 2 bits become bits 4-5, (byte >> 6) << 4, not byte & 0xC0."),
    ]


def _q4_k_variants(raw: np.ndarray) -> list[tuple[np.ndarray, str]]:
    """The values each typical Q4_K slip gives for the super-blocks in `raw`, with its hint."""
    b = raw.reshape(-1, 144)
    d, dmin = _f16(b[:, 0:2])[:, :, None], _f16(b[:, 2:4])[:, :, None]        # (n, 1, 1)
    sc, mn = (a.astype(np.float32)[:, :, None] for a in kq.unpack_scales_q4_k(b[:, 4:16]))   # (n, 8, 1)
    qs = b[:, 16:].reshape(-1, 4, 32)

    def codes(first, second):   # (n, 8, 32) from the two nibble arrays of each 32-byte chunk
        return np.stack([first, second], axis=2).reshape(-1, 8, 32).astype(np.float32)
    q = codes(qs & 15, qs >> 4)
    pairs = np.stack([b[:, 16:] & 15, b[:, 16:] >> 4], axis=2).reshape(-1, 8, 32).astype(np.float32)
    halves = np.concatenate([b[:, 16:] & 15, b[:, 16:] >> 4], axis=1).reshape(-1, 8, 32).astype(np.float32)
    nibble = "nibble order: each 32 bytes hold two sub-blocks, the low nibbles the first 32 values of the 64, " \
             "the high nibbles the next 32"
    out = [(d * sc * pairs - dmin * mn, f"{nibble}, not values 2k and 2k+1."),
           (d * sc * halves - dmin * mn, f"{nibble}; not all 128 low nibbles first."),
           (d * sc * codes(qs >> 4, qs & 15) - dmin * mn, f"{nibble}: low first."),
           (d * sc * q + dmin * mn, "dmin sign: the min is subtracted, x = d·sc·q − dmin·m."),
           (d * sc * q, "you left out the min: x = d·sc·q − dmin·m."),
           (sc * q - dmin * mn, "the 6-bit scale is relative: multiply it by the super-block's d."),
           (d * sc * q - mn, "the 6-bit min is relative: multiply it by the super-block's dmin."),
           (dmin * sc * q - d * mn, "d and dmin swapped: d is bytes 0-1, dmin bytes 2-3."),
           (d * sc * (q - 8) - dmin * mn, "Q4_K's quants are 0..15 with no −8: the min does the offset.")]
    for s, m, hint in _unpack_variants(b[:, 4:16]):
        out.append((d * s[:, :, None] * q - dmin * m[:, :, None], hint))
    return [(x.reshape(-1), hint) for x, hint in out]


@functools.lru_cache(maxsize=1)
def _real_blocks() -> dict[str, np.ndarray]:
    """The shipped model's weights quantized as llama.cpp quantizes them (formats.kquants is bit-exact)."""
    with gguf.read(SHIPPED) as f:
        return {"Q8_0": kq.quantize_q8_0(f.array("token_embd.weight")).ravel(),
                "Q4_K": kq.quantize_q4_k(f.array("blk.0.ffn_down.weight")).ravel()}


def _dequantize_cases(type_name: str) -> list[tuple[np.ndarray, int, str]]:
    """(raw bytes, values, label): one random block, many random blocks, a whole tensor of the shipped model."""
    per_block, nbytes = (32, 34) if type_name == "Q8_0" else (256, 144)
    rng = np.random.default_rng(2 if type_name == "Q8_0" else 4)
    real = _real_blocks()[type_name]
    tensor = "token_embd.weight (4096 × 384)" if type_name == "Q8_0" else "blk.0.ffn_down.weight (384 × 1024)"
    return [(random_blocks(type_name, 1, per_block, rng).ravel(), per_block, f"one random {type_name} block"),
            (random_blocks(type_name, 16, 4 * per_block, rng).ravel(), 64 * per_block, f"64 random {type_name} blocks"),
            (real, real.size // nbytes * per_block, f"the shipped model's {tensor} in {type_name}")]


def _close(a: np.ndarray, b: np.ndarray) -> bool:
    with np.errstate(all="ignore"):
        return bool(np.all(np.abs(a - b) <= 1e-5 * max(float(np.max(np.abs(b))), 1e-30)))


def _miss(got: np.ndarray, right: np.ndarray, per_block: int) -> str:
    """Where the first wrong value is: its index, block (and sub-block of a super-block), value and the right one."""
    i = int(np.argmax(got != right))
    where = f"block {i // per_block:,}" + (f", sub-block {i % 256 // 32}" if per_block == 256 else "")
    return f"value {i:,} ({where}) is {got[i]:.6g}, expected {right[i]:.6g}."


def _miss_hint(got: np.ndarray, right: np.ndarray, raw: np.ndarray, variants: Callable, per_block: int) -> str | None:
    """The typical slip whose values the learner's match, else what the size and place of the miss suggest."""
    g, r = got.astype(np.float64), right.astype(np.float64)
    with np.errstate(all="ignore"):
        hint = next((h for v, h in variants(raw) if _close(g, v.astype(np.float64))), None)
        err = float(np.max(np.abs(g - r)) / max(float(np.max(np.abs(r))), 1e-30))
    if hint is not None:
        return hint
    if err < 1e-5:
        return "close, but not exactly the engine's values: compute in float32, each code times its exact scale."
    if err < 1e-2:
        return (f"close, but off by up to {err:.1g} of the largest value: computed in float16? numpy keeps float16 × "
                f"uint8 in float16; convert the fp16 scales to float32 first.")
    wrong = np.flatnonzero(got != right)
    if per_block == 256 and np.all(wrong % 256 >= 128):
        return "only sub-blocks 4-7 are wrong: check the unpacking of their 6-bit scales and mins."
    return None


def _check_dequantize(task: str, type_name: str, fn: Callable, oracle: Callable, variants: Callable,
                      recipe: str) -> Result:
    """Run `fn(raw, n)` on the cases of `type_name` and compare exactly with `oracle`; name the slip."""
    if not callable(fn):
        return Result(False, f"{task}: write a function f(raw, n) -> n float32 values; it is called on several tensors.")
    per_block, nbytes = (32, 34) if type_name == "Q8_0" else (256, 144)
    seconds = 0.0
    for raw, n, label in _dequantize_cases(type_name):
        start = time.perf_counter()
        out, failed = run_answer(task, label, fn, raw.copy(), n)
        seconds = time.perf_counter() - start
        if failed is not None:
            return failed
        try:
            got = np.asarray(out)
        except (TypeError, ValueError):
            return Result(False, f"{task} ({label}): expected a numpy array, got {type(out).__name__}.")
        if got.size != n:
            why = {raw.size: " That is the number of bytes.", n // per_block: " That is one value per block."}.get(
                got.size, "")
            return Result(False, f"{task} ({label}): got {got.size:,} values (shape {got.shape}), expected n = {n:,}: "
                                 f"{per_block} per {nbytes}-byte block.{why}")
        right = oracle(raw.reshape(-1, nbytes)).ravel()
        if got.dtype.kind not in "fiu":
            return Result(False, f"{task} ({label}): expected float32 values, got dtype {got.dtype}.")
        got = got.ravel()
        if np.array_equal(got, right):
            if got.dtype != np.float32:
                return Result(False, f"{task} ({label}): right values, but as {got.dtype}: return float32, "
                                     f"the engine's dtype (.astype(np.float32)).")
            continue
        return Result(False, f"{task} ({label}): {_miss(got, right, per_block)} Hint: "
                             f"{_miss_hint(got, right, raw, variants, per_block) or recipe}")
    note = "" if seconds < SLOW_S else (f" It took {seconds:.1f} s for the last case's {n:,} values, though: the "
                                        f"finale loads the model's 10M weights this way, so vectorise with numpy "
                                        f"(reshape to one row per block, then whole-array operations).")
    return Result(True, f"{task}: exactly the engine's values on all 3 cases, the last {n:,} values in "
                        f"{1e3 * seconds:,.0f} ms.{note}")


def check_dequantize_q8_0(fn: Callable) -> Result:
    """Step 2a: `fn(raw: uint8 (n/32·34,), n) -> float32 (n,)` expands Q8_0 blocks, x = d·q. Called on one and
    64 random valid blocks and on the shipped model's token_embd.weight in Q8_0 (1.5M values); compared for
    exact equality with `kquants.dequantize_q8_0`."""
    return _check_dequantize("Step 2a", "Q8_0", fn, kq.dequantize_q8_0, _q8_0_variants,
                             "each 34-byte block is d (fp16, 2 bytes) then 32 int8 quants: x = d·q.")


def check_dequantize_q4_k(fn: Callable) -> Result:
    """Step 2b: `fn(raw: uint8 (n/256·144,), n) -> float32 (n,)` expands Q4_K super-blocks,
    x = d·sc[j]·q − dmin·m[j]. Called on one and 64 random valid super-blocks and on the shipped model's
    blk.0.ffn_down.weight in Q4_K; compared for exact equality with `kquants.dequantize_q4_k`."""
    return _check_dequantize("Step 2b", "Q4_K", fn, kq.dequantize_q4_k, _q4_k_variants,
                             "bytes 0-1 d, 2-3 dmin (fp16), 4-15 the 6-bit scales and mins, 16-143 the codes (low "
                             "nibbles of each 32 bytes first): x = d·sc[j]·q − dmin·m[j] for sub-block j.")
