"""The fused layer's launch settings as data, and its kernels timed per setting ("layer-launch").

`kernels/fusedlayer.py` launches each of its five kernels with settings from its tables: warps per block
(WARPS), 16-byte loads per row in flight (UNROLL, dense and quantized), rows per warp (ROWS_PER_WARP), groups of
rows per block (GROUPS_PER_BLOCK) and attend's keys per split (KEYS_PER_SPLIT). A `Setting` names the entries a
measurement changes; `applied` puts them in place for the length of a `with` block and `relaunch` recomputes the
fused layers' launches from them, so the GPU runs exactly the setting recorded beside each number
(`launch_fields`).

`bench_layer_launches` (`python -m ref_impl bench --layer-launches`) times every fused kernel queued over
the layers of random Llama-3.1-8B-shaped models, "q4q8" (4-bit groups of 32, v and down 8-bit: a Q4_K_M
file's mix) and float16, per setting: ms a token and GB/s of each kernel (`measure.kernels.layer_kernel_ms`,
graph built first, so the time is the GPU's) and the pipelined decode's tokens/s. The CUPTI profile
(`cupti.py`) and Nsight Compute (`ncu.py`) use the same settings and models.

See chapter: dispatch-kernel
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import mlx.core as mx
import mlx.nn as nn

from ref_impl.engine.model import Model
from ref_impl.engine.random import args_for, random_model
from ref_impl.kernels import fusedlayer
from ref_impl.kernels.layers import on_cuda
from ref_impl.measure.kernels import layer_kernel_ms
from ref_impl.measure.records import record

MIXES = ("q4q8", "F16")   # the weights the fused-layer probes measure (`mix_model`)


@dataclass(frozen=True)
class Setting:
    """Entries of the fused layer's launch tables that one measurement changes; empty: today's defaults.
    unroll applies to the model measured (dense or quantized: `fusedlayer.UNROLL` keeps one of each)."""
    warps: dict[str, int] = field(default_factory=dict)     # kernel -> warps per block
    unroll: dict[str, int] = field(default_factory=dict)    # kernel -> 16-byte loads per row in flight
    rows_per_warp: int | None = None
    groups: dict[str, int] = field(default_factory=dict)    # kernel -> groups of rows per block (GROUPS_PER_BLOCK)
    keys_per_split: int | None = None
    prefetch: bool | None = None     # attend prefetches attn_out's matrix into L2 (fusedlayer.PREFETCH)
    merge: tuple[str, ...] | None = None   # the kernel pairs run as one launch each (fusedlayer.MERGE)
    int8: bool = False               # quantized matrices meet int8 activations (FusedLayer.switch)

    @property
    def changed(self) -> dict:
        """What the setting changes, as the records keep it ({} for the defaults)."""
        out = {"warps": dict(self.warps), "unroll": dict(self.unroll), "rows_per_warp": self.rows_per_warp,
               "groups_per_block": dict(self.groups),
               "keys_per_split": self.keys_per_split, "prefetch": self.prefetch,
               "merge": None if self.merge is None else list(self.merge),
               "int8": self.int8 or None}
        return {k: v for k, v in out.items() if v not in ({}, None)}

    @property
    def label(self) -> str:
        """"defaults", or the changes: "warps attn_out=16; unroll attn_in=2; merge mlp" ("merge none": no pair)."""
        def text(v) -> str:
            if isinstance(v, dict):
                return ", ".join(f"{n}={x}" for n, x in v.items())
            return (", ".join(v) or "none") if isinstance(v, list) else str(v)
        parts = [f"{k} {text(v)}" for k, v in self.changed.items()]
        return "; ".join(parts) or "defaults"


# the queued sweep's settings: today's defaults and their neighbours, one table entry at a time; mlp_in's groups
# and attend's prefetch are the two leads a probe left (fusedlayer.GROUPS_PER_BLOCK, PREFETCH)
SWEEP = (Setting(), Setting(rows_per_warp=1), Setting(rows_per_warp=4),
         Setting(warps={k: 4 for k in fusedlayer.WARPS}), Setting(warps={k: 16 for k in fusedlayer.WARPS}),
         Setting(unroll={k: 8 for k in ("attn_in", "attn_out", "mlp_out")}),
         Setting(keys_per_split=32), Setting(keys_per_split=128),
         Setting(groups={"attn_in": 2}), *(Setting(groups={"mlp_in": g}) for g in (2, 3, 4)),
         Setting(prefetch=not fusedlayer.PREFETCH))


@contextlib.contextmanager
def applied(setting: Setting) -> Iterator[None]:
    """The fused layer's launch tables with `setting`'s entries in place, restored on leaving (layers built
    or relaunched inside keep the setting: `relaunch`)."""
    saved = (fusedlayer.WARPS, fusedlayer.UNROLL, fusedlayer.ROWS_PER_WARP, fusedlayer.KEYS_PER_SPLIT,
             fusedlayer.PREFETCH, fusedlayer.MERGE, fusedlayer.GROUPS_PER_BLOCK)
    fusedlayer.WARPS = {**saved[0], **setting.warps}
    fusedlayer.UNROLL = {**saved[1], **{k: (u, u) for k, u in setting.unroll.items()}}
    fusedlayer.ROWS_PER_WARP = setting.rows_per_warp or saved[2]
    fusedlayer.KEYS_PER_SPLIT = setting.keys_per_split or saved[3]
    fusedlayer.PREFETCH = saved[4] if setting.prefetch is None else setting.prefetch
    fusedlayer.MERGE = saved[5] if setting.merge is None else setting.merge
    fusedlayer.GROUPS_PER_BLOCK = {**saved[6], **setting.groups}
    try:
        yield
    finally:
        (fusedlayer.WARPS, fusedlayer.UNROLL, fusedlayer.ROWS_PER_WARP, fusedlayer.KEYS_PER_SPLIT,
         fusedlayer.PREFETCH, fusedlayer.MERGE, fusedlayer.GROUPS_PER_BLOCK) = saved


def relaunch(model: Model, int8: bool = False) -> int:
    """Recompute every fused layer's launches from the tables as they stand, with int8 or float activations,
    and switch it on; returns how many there are."""
    return fusedlayer.enable(model, True, int8)


def launch_fields(quantized: bool) -> dict:
    """The launch tables as they stand, for a dense or quantized model: what a record says ran."""
    return {"warps": dict(fusedlayer.WARPS), "unroll": {k: v[int(quantized)] for k, v in fusedlayer.UNROLL.items()},
            "rows_per_warp": fusedlayer.ROWS_PER_WARP, "groups_per_block": dict(fusedlayer.GROUPS_PER_BLOCK),
            "keys_per_split": fusedlayer.KEYS_PER_SPLIT,
            "prefetch": fusedlayer.PREFETCH, "merge": list(fusedlayer.MERGE)}


def mix_model(weights: str, shape: str = "Llama-3.1-8B", layers: int | None = None, seed: int = 0) -> Model:
    """A random float16 model of `shape` (`layers` of them, or all) in one of MIXES: "F16", or "q4q8":
    every matrix but the LM head 4-bit in groups of 32, v and down 8-bit (a Q4_K_M file's mix)."""
    if weights not in MIXES:
        raise ValueError(f"weights {weights!r}: the fused-layer probes measure {' or '.join(MIXES)}")
    args = args_for(shape, context=512)
    model = random_model(replace(args, num_hidden_layers=layers) if layers else args, mx.float16, seed)
    if weights == "q4q8":
        nn.quantize(model, class_predicate=lambda path, m: isinstance(m, nn.Linear) and not path.endswith("lm_head")
                    and {"group_size": 32, "bits": 8 if path.endswith(("v_proj", "down_proj")) else 4})
    mx.eval(model.parameters())
    return model


def mixes(weights: Sequence[str]) -> tuple[str, ...]:
    """The MIXES that bench's --weights names ask for, in MIXES' order: F16 as itself, a 4-bit K-quant (Q4_K,
    Q4_K_M, Q4_K_S) or q4q8 as "q4q8" (its stand-in); a name neither is refused, named."""
    def mix(name: str) -> str:
        if name in MIXES:
            return name
        if name.upper().startswith("Q4_K"):
            return "q4q8"
        raise ValueError(f"weights {name!r}: the fused-layer probes measure F16 or a 4-bit K-quant's mix (q4q8)")
    asked = {mix(w) for w in weights}
    return tuple(m for m in MIXES if m in asked)


def needs_cuda(experiment: str, **fields) -> list[dict]:
    """One "skipped" record off MLX's CUDA backend (the fused kernels run nowhere else), else none."""
    if on_cuda():
        return []
    return [record(experiment, "skipped", None, None, **fields,
                   note=f"skipped: the fused layer needs MLX's CUDA backend; this is {mx.default_device()}")]


def fused_or_skipped(experiment: str, model: Model, fields: dict) -> list[dict]:
    """fusedlayer.fuse(model): [] when every layer fused, else one "skipped" record naming the first reason."""
    left = fusedlayer.fuse(model)
    if not left:
        return []
    i, why = next(iter(left.items()))
    return [record(experiment, "skipped", None, None, **fields,
                   note=f"{len(model.layers) - len(left)} of {len(model.layers)} layers fused; layer {i}: {why}")]


def setting_records(model: Model, setting: Setting, fields: dict, context: int, tokens: int) -> list[dict]:
    """layer-launch records of one setting: each kernel's ms a token queued (with its bytes and GB/s) at
    `context` keys, and pipelined decode's tokens/s (`tokens` after a `context - tokens` prompt)."""
    quantized = fields["weights"] != "F16"
    with applied(setting):
        relaunch(model, setting.int8)
        per = layer_kernel_ms(model, context)
        tps = 1 / fusedlayer.decode_seconds(model, tokens, context - tokens)
        extra = {"variant": setting.label, "launch": launch_fields(quantized), "changed": setting.changed}
    relaunch(model)
    out = [record("layer-launch", "tokens_per_s", "tok/s", tps, **fields, **extra)]
    for k, (ms, nbytes) in per.items():
        out.append(record("layer-launch", "ms_per_token", "ms", ms, **fields, **extra, kernel=k,
                          bytes_per_token=nbytes, gb_per_s=nbytes / ms / 1e6,
                          note="the kernel of every layer queued, graph built first: GPU time"))
    return out


def bench_layer_launches(shape: str = "Llama-3.1-8B", settings: Sequence[Setting] = SWEEP, context: int = 192,
                         tokens: int = 64, weights: Sequence[str] = MIXES,
                         progress: Callable[[str], None] | None = None) -> list[dict]:
    """The fused layer's kernels per launch setting on random `shape` models of each of `weights`: ms a token
    and GB/s of each kernel queued over the layers at `context` keys, and decode tokens/s. Off MLX's CUDA
    backend: one "skipped" record, at once."""
    say = progress or (lambda msg: None)
    out = needs_cuda("layer-launch", model=shape)
    if out:
        return out
    for w in weights:
        model = mix_model(w, shape)
        fields = {"model": shape, "weights": w, "kv": "f16", "context": context}
        refused = fused_or_skipped("layer-launch", model, fields)
        out += refused
        for setting in [] if refused else settings:
            rec = setting_records(model, setting, fields, context, tokens)
            out += rec
            say(f"layer-launch {w} {setting.label}: {rec[0]['value']:.1f} tok/s; " + ", ".join(
                f"{r['kernel']} {r['value']:.3f} ms {r['gb_per_s']:.0f} GB/s" for r in rec[1:]))
        del model
        mx.clear_cache()
    return out
