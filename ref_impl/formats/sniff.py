"""What a file is, from its first bytes: the message for a path that turns out not to be GGUF.

People point the decoder at the model files they already have, and those are not always GGUF. An
Ollama store keeps the GGUF weights as an extensionless blob (`blobs/sha256-<hex>`, which loads like
any `.gguf`), beside JSON manifests that name the blobs; Hugging Face ships safetensors or PyTorch
checkpoints; files from before 2023 are GGML or GGJT. Each starts with its own magic bytes:

    GGUF          b"GGUF"
    GGML, GGJT    the u32 0x67676d6c ("ggml") or 0x67676a74 ("ggjt") little-endian: b"lmgg", b"tjgg"
    safetensors   u64 header length, then the header: a JSON object, b"{"
    PyTorch       a zip archive, b"PK\\x03\\x04" (torch.save since 1.6), or a pickle, b"\\x80" + protocol
    JSON          b"{" (an Ollama manifest: its layer of mediaType application/vnd.ollama.image.model
                  names the blob that holds the GGUF weights)

References: llama.cpp docs/gguf.md; the safetensors format (huggingface/safetensors README);
Ollama's docs/import.md and its model store layout.
See chapter: gguf
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
MAX_MANIFEST_BYTES = 1 << 20   # manifests are a few hundred bytes; larger JSON is not read


def describe(path: str | Path, head: bytes, size: int) -> str | None:
    """What the file at `path` (`size` bytes, starting with `head`: at least its first 16 bytes when it has
    them) is, in words, with what to do instead of loading it; None when no format here matches."""
    if head[:4] == b"GGUF":
        return "a GGUF file"
    if head[:4] in (b"lmgg", b"tjgg", b"fmgg", b"algg"):
        return ("a GGML/GGJT file, the format before GGUF (2023): convert it with llama.cpp's "
                "convert_llama_ggml_to_gguf.py")
    if len(head) >= 9 and head[8:9] == b"{" and 0 < struct.unpack("<Q", head[:8])[0] <= size - 8:
        return ("a safetensors file (Hugging Face weights): convert the model's folder to GGUF with "
                "llama.cpp's convert_hf_to_gguf.py")
    if head[:4] == b"PK\x03\x04":
        return "a zip archive (a PyTorch checkpoint?): convert the model with llama.cpp's convert_hf_to_gguf.py"
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return "a Python pickle (a PyTorch checkpoint?): convert the model with llama.cpp's convert_hf_to_gguf.py"
    if head.lstrip()[:1] in (b"{", b"["):
        return _json(Path(path), size)
    return None


def _json(path: Path, size: int) -> str:
    """A JSON file; for an Ollama manifest, the blob with its weights."""
    if size > MAX_MANIFEST_BYTES:
        return "JSON"
    try:
        layers = json.loads(path.read_bytes()).get("layers", [])
        digest = next(x["digest"] for x in layers if x.get("mediaType") == OLLAMA_MODEL_LAYER)
    except (ValueError, AttributeError, TypeError, KeyError, StopIteration):
        return "JSON (an Ollama manifest? it names no model layer)"
    # a manifest lives at <store>/manifests/<registry>/<namespace>/<model>/<tag>, the blobs at <store>/blobs
    blob = digest.replace(":", "-")
    store = path.parents[4] if len(path.parents) > 4 and path.parents[3].name == "manifests" else None
    where = str(store / "blobs" / blob) if store and (store / "blobs" / blob).is_file() else f"blobs/{blob}"
    return f"JSON, an Ollama manifest: its GGUF weights are the blob {where}"
