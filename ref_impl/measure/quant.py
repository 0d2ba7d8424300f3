"""What quantizing the weights costs and buys: bytes, held-out perplexity and decode speed per llama.cpp type.

`bench_quant` (`python -m ref_impl bench --quant TYPE ...`) quantizes a float model into each llama.cpp
file type with our quantizer and measures the file (tensor bytes, bits per weight), its held-out
perplexity, and decode speed with the weights as MLX quantized matrices ("native") and expanded to floats
("dequantized"), with llama.cpp decoding the same file. `bench_quant_groups` (`bench --quant-groups`)
rounds one group of matrices at a time and scores the model on the same held-out windows: which layers
mind the rounding, per weight.

See chapter: kquants
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
import numpy as np

from ref_impl.engine.checkpoint import load_model, simulate
from ref_impl.engine.model import Model, ModelArgs
from ref_impl.engine.tokenizer import Tokenizer
from ref_impl.formats import gguf
from ref_impl.formats.quantize import MATRIX_GROUPS, quantize_file, tensor_kind
from ref_impl.measure.decode import ours
from ref_impl.measure.peers import llama_cpp_peer
from ref_impl.measure.records import dtype_name, record
from ref_impl.platform.machine import package_version
from ref_impl.platform.timing import decode_metrics
from ref_impl.training.corpus import heldout_stream
from ref_impl.training.evaluate import heldout_losses, perplexity

QUANT_TYPES = ("F32", "F16", "Q8_0", "Q6_K", "Q4_K_M", "Q4_K", "Q4_0")


def file_records(qpath: Path, types: dict[str, str], **fields) -> list[dict]:
    """"quant" records of one quantized file: tensor bytes (with the mix of types), file bytes, bits per weight."""
    with gguf.read(qpath) as f:
        nbytes = sum(t.nbytes for t in f.tensors.values())
        weights = sum(int(np.prod(t.shape)) for t in f.tensors.values())
    mix = {t: sum(v == t for v in types.values()) for t in sorted(set(types.values()))}
    return [record("quant", "tensor_bytes", "B", nbytes, mix=mix, **fields),
            record("quant", "file_bytes", "B", qpath.stat().st_size, **fields),
            record("quant", "bits_per_weight", "bits", 8 * nbytes / weights, **fields)]


def speed_record(runs: list, prompt_len: int, **fields) -> dict:
    """A "quant" tokens/s record of timed decode runs (median, with each run's rate)."""
    value, samples = decode_metrics(runs, prompt_len)["tokens_per_s"]
    return record("quant", "tokens_per_s", "tok/s", value, samples=samples, **fields)


def bench_quant(path: Path, work_dir: Path, file_types: Sequence[str] = QUANT_TYPES, ppl_tokens: int | None = None,
                prompt_len: int = 128, gen_tokens: int = 128, repeats: int = 3, peers: bool = True,
                seed: int = 0) -> list[dict]:
    """Per llama.cpp file type of a float model, quantized by us into work_dir: tensor bytes, bits per
    weight, held-out perplexity (`evaluate.heldout_losses` on the files the model never trained on: all of
    them (ppl_tokens None), or a sample of ppl_tokens tokens, the same for every type; 0 skips it) and decode speed with the weights MLX-quantized
    ("native") and expanded to floats ("dequantized"), and llama.cpp on the same file."""
    work_dir.mkdir(parents=True, exist_ok=True)
    with gguf.read(path) as f:
        tokenizer = Tokenizer.from_gguf_metadata(f.metadata)
        name = f.metadata.get("general.name", path.stem)
        context = ModelArgs.from_gguf(f.metadata, f.tensors).max_position_embeddings
    stream, fingerprint = heldout_stream(tokenizer) if ppl_tokens != 0 else (None, None)
    prompt = np.random.default_rng(seed).integers(1, tokenizer.vocab_size, size=prompt_len).tolist()
    records = []
    for ft in file_types:
        fields = {"model": name, "weights": ft, "context": prompt_len + gen_tokens}
        qpath = work_dir / f"{path.stem}-{ft}.gguf"
        records += file_records(qpath, quantize_file(path, qpath, ft), kv="f32", **fields)
        with gguf.read(qpath) as f:
            if stream is not None:
                losses = heldout_losses(load_model(f, mx.float32), stream, ppl_tokens or 0)   # the file's own weights
                records.append(record("quant", "heldout_perplexity", "ppl", perplexity(losses), kv="f32",
                                      **{**fields, "context": context}, tokens=len(losses) * context,
                                      corpus_sha256=fingerprint))
            models: dict[str, Model] = {"dequantized": load_model(f, None),
                                        "native": load_model(f, None, quantized=True)}
        for variant, model in models.items():
            dtype = dtype_name(model.norm.weight.dtype)
            records.append(speed_record(ours(model, prompt, gen_tokens, repeats, pipeline=True), prompt_len,
                                        kv=dtype, variant=variant, **fields, dtype=dtype))
        del models
        if peers:
            peer = "llama.cpp (llama-cpp-python " + package_version("llama_cpp_python") + ")"
            records.append(speed_record(llama_cpp_peer(qpath, prompt, gen_tokens, repeats), prompt_len, peer=peer,
                                        **fields))
    return records


def bench_quant_groups(path: Path, type_name: str = "Q4_K", ppl_tokens: int | None = None) -> list[dict]:
    """Held-out perplexity of the float model at `path` with one group of its matrices rounded through
    `type_name` (quantize.MATRIX_GROUPS, then every matrix; the rest float32), and each group's float32
    bytes: which layers mind the rounding, per weight. The same tokens for every group: all of the held-out
    text (ppl_tokens None) or a sample."""
    with gguf.read(path) as f:
        tokenizer = Tokenizer.from_gguf_metadata(f.metadata)
        name = f.metadata.get("general.name", path.stem)
        context = ModelArgs.from_gguf(f.metadata, f.tensors).max_position_embeddings
        matrices = {n: t.nbytes for n, t in f.tensors.items() if len(t.shape) == 2}
    stream, fingerprint = heldout_stream(tokenizer)
    groups = {"none (float32)": (), **MATRIX_GROUPS, "every matrix": tuple({tensor_kind(n) for n in matrices})}
    records = []
    for group, kinds in groups.items():
        model = simulate(path, type_name, lambda n: tensor_kind(n) in kinds)
        losses = heldout_losses(model, stream, ppl_tokens or 0)
        fields = {"model": name, "weights": type_name, "kv": "f32", "context": context, "variant": group}
        records += [record("quant-groups", "heldout_perplexity", "ppl", perplexity(losses), **fields,
                           tokens=len(losses) * context, corpus_sha256=fingerprint),
                    # per window, the same windows for every group
                    record("quant-groups", "window_loss", "nats", losses.mean(), samples=losses.tolist(), **fields),
                    record("quant-groups", "matrix_bytes", "B",
                           sum(b for n, b in matrices.items() if tensor_kind(n) in kinds), **fields)]
    return records
