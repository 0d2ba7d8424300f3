"""The fused decoder layer: one decode step of a Llama layer in five CUDA launches.

On MLX's CUDA backend a decode step is host-bound: MLX builds and encodes each primitive of the step's graph
on the host, ~10 µs apiece, and a Llama-3.1-8B token has ~580 of them (measured in results/), more host time
than the GPU needs to read the weights. Fusing GEMVs (patching.py) only trims that count; `FusedLayer` runs a
whole layer's decode step as five `mx.fast.cuda_kernel` launches (source in fusedlayer_cuda.py):

    attn_in   RMSNorm, the q, k and v projections, RoPE, k and v written into the layer's KVCache
    attend    attention of the new query over the cache, split over the key length (grouped-query aware);
              meanwhile attn_out's matrix moves into L2
    attn_out  the splits merged, the output projection, the residual
    mlp_in    RMSNorm, silu(gate) * up
    mlp_out   the down projection, the residual

so an 8B token is ~165 primitives. Each kernel reads the weights as the GEMV kernels do (launch.py: 16-byte
chunks, codes decoded with float tricks, a group's scale and bias applied once per chunk) from an input row
staged in shared memory, and rounds to the activation type wherever MLX's graph stores an intermediate, so the
layer computes what the unfused layer computes, up to float32 summation order.

A pair can also run as one launch (MERGE): `attention` (attend, attn_out) or `mlp` (mlp_in, mlp_out). The first
blocks of such a launch to start do the first kernel's work, the others wait for them on counters the layer
keeps (handoff_cuda.py says why that cannot deadlock) and then do the second's. That saves the host a launch
and costs the GPU the wait: which wins depends on the model and the machine, so `choose` times each way (MERGES)
when a model loads and keeps the fastest.

The write into the cache happens inside attn_in, in place: the cache's buffers are inputs MLX does not know
are written. That is safe because only this layer's kernels touch its buffers and attend, which reads them,
takes attn_in's output as input, so it runs after the write. A FusedLayer therefore runs only on a
`KVCache` (the static float cache, whose buffers stay put) and one token; any other call (a prompt, a
speculative verification, a quantized cache, the compiled step's StepCache) runs the plain layer on the same
buffers. `fuse(model)` swaps each layer it can run for a FusedLayer and says why it left the others.

References: MLX mlx/backend/cuda/custom_kernel.cpp (the signature, shared memory, the JIT cache keyed by name);
flash-decoding's split over the key length (Dao et al., "Flash-Decoding for long-context inference", 2023);
llama.cpp ggml-cuda (one kernel per op, a decode step replayed as one CUDA graph).
See chapter: dispatch-kernel
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ref_impl.engine.generate import decoder, prefill
from ref_impl.engine.kvcache import KVCache
from ref_impl.engine.model import Model, TransformerBlock
from ref_impl.engine.moe import MoE
from ref_impl.kernels.cuda import minified
from ref_impl.kernels.fusedlayer_cuda import NEEDS, SOURCES, header
from ref_impl.kernels.launch import DTYPES, Format, dtype_name
from ref_impl.kernels.layers import GEMVLinear, format_of, on_cuda
from ref_impl.platform.timing import clock, median

KERNELS = tuple(SOURCES)
# the kernel pairs that can run as one launch, each a launch fewer a layer (~30 us of host time): name -> halves
PAIRS = {"attention": ("attend", "attn_out"), "mlp": ("mlp_in", "mlp_out")}
# the pairs a layer merges unless told (launches' merge): none. On an H100 (results/h100-20261206-155519.json,
# -155600.json, 4-bit) the 8B's merged mlp took 5.76 ms of GPU a token against 4.27 (its kernel 114 us against
# mlp_in's 42 and mlp_out's 26), merged attention 4.30; the 1B, host-bound, decoded at 671 tok/s with attention
# merged and 722 with both, against 621: `choose` decides per model, timing each of MERGES (at 7011f89 it kept
# both on the 1B's Q4_K_M, 1.30 ms a token against 1.56, none on the 8B: results/h100-20261206-194743.json, -195037)
MERGE: tuple[str, ...] = ()
MERGES = ((), ("attention",), ("attention", "mlp"))
STAGES = tuple(k for k in KERNELS if k not in PAIRS)   # the five kernels of a layer's step, merged or not
# warps per block: a block stages its input row once for all its warps, so more warps share that cost, but
# blocks that do not all fit at once leave SMs idle in the last wave. Each kernel's GPU time per call on the
# H200, 8B shapes, 4-bit ("kernel-profile" records, results/h200-20261202-042500.json): attn_out 19.6 us with 8 warps,
# 14.0 with 16 (128 blocks: one wave); mlp_in 47.4 us with 12, 43.8 with 8 (its 128 registers a thread fit
# two blocks of 8 warps on an SM, one of 12); attn_in, 3072 warps: 4 warps 29.6 us, 8 warps 31.5, and 16
# read float16 at 1748 GB/s against 2453 with 8 ("layer-launch" records, results/h200-20261202-005000.json;
# "decode-breakdown", -011256.json)
WARPS = {"attn_in": 8, "attend": 8, "attn_out": 16, "mlp_in": 8, "mlp_out": 8}
ROWS_PER_WARP = 2       # output rows a warp computes (attn_in: always one RoPE pair)
# 16-byte loads per row in flight, (dense, quantized): a 4-bit chunk is 32 weights of work against a dense
# one's 8, so fewer suffice; quantized attn_in took 31.5 us with 4 and 25.7 with 2 (the profile above)
UNROLL = {"attn_in": (4, 2), "attn_out": (4, 4), "mlp_in": (2, 2), "mlp_out": (4, 4)}
# groups of rows (a block's worth: WARPS x rows per warp) each block computes, after staging its input row once:
# fewer blocks, fewer stagings (attn_in and mlp_in, which norm their row; 1: a block per group). A probe on an
# H100 (results/h100-20261206-172600-probe_settings.log, 8B 4-bit, queued alone, two rounds) had mlp_in a seventh
# faster at 3 or 4 groups and attn_in, whose blocks all fit at once, slower at 2 and 4: a default once benched
GROUPS_PER_BLOCK = {"attn_in": 1, "mlp_in": 1}
KEYS_PER_SPLIT = 64     # attend: one block per key head and this many positions
MAX_SPLITS = 32
PREFETCH = True         # attend moves attn_out's matrix into L2 (attn_out is latency-bound; attend reads little)
# the kernels that read int8 activations when asked: mlp_out re-quantizes its 14,336-wide row in every block,
# which cost more than dp4a saved (30.4 us a layer against 26.2 with floats, H100, results/h100-20261206-115613.json)
INT8_KERNELS = ("attn_in", "attn_out", "mlp_in")   # attention and mlp: as their halves
MAX_GROUP = 16          # query heads per key head attend keeps in registers
# each kernel's matrices, by their names in engine.model (self_attn.* or mlp.*)
READS = {"attn_in": ("q_proj", "k_proj", "v_proj"), "attend": (), "attn_out": ("o_proj",),
         "mlp_in": ("gate_proj", "up_proj"), "mlp_out": ("down_proj",), "attention": (), "mlp": ()}
MATRICES = tuple(m for ms in READS.values() for m in ms)


def padded(k: int) -> int:
    """Floats of shared memory for a staged row of k values: four pad floats after every 32 (fusedlayer_cuda.pad)."""
    return k + 4 * (k // 32) + 4


def splits(keys: int) -> int:
    """Blocks per key head in attend for `keys` positions: one per KEYS_PER_SPLIT, at most MAX_SPLITS."""
    return max(1, min(MAX_SPLITS, -(-keys // KEYS_PER_SPLIT)))


@functools.cache
def kernel(name: str, shared: int):
    """The `mx.fast.cuda_kernel` of one of KERNELS with `shared` bytes of dynamic shared memory. Its name
    carries a hash of the source, since MLX caches compiled kernels on disk by name and an edited source must
    not meet an old build, and the shared bytes, since MLX raises a kernel's shared-memory limit only at its
    first launch."""
    inputs, outputs, body = SOURCES[name]
    text = minified(header(NEEDS[name]))
    digest = hashlib.sha1((text + body).encode()).hexdigest()[:10]
    return mx.fast.cuda_kernel(name=f"ref_layer_{name}_{digest}_{shared}", input_names=inputs, output_names=outputs,
                               source=body, header=text, shared_memory=shared)


def matrix(layer: nn.Module) -> tuple[Format | None, tuple[mx.array, ...]]:
    """The kernel format of a projection (an nn.Linear, nn.QuantizedLinear or GEMVLinear) and its arrays
    (w, scales, biases; a dense matrix passes w in all three places), or (None, ()) when the kernels cannot
    read it (another format, or a bias)."""
    fmt = layer.fmt if isinstance(layer, GEMVLinear) else format_of(layer)
    if fmt is None or "bias" in layer:
        return None, ()
    w = layer["weight"]
    return fmt, (w, w, w) if fmt.bits == 16 else (w, layer["scales"], layer["biases"])


def projections(block: nn.Module) -> dict[str, nn.Module]:
    """A decoder layer's seven projections by name (MATRICES' order)."""
    return {name: getattr(block.self_attn if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else block.mlp,
                          name) for name in MATRICES}


def inputs(layer: nn.Module) -> int:
    """The input width of a projection the kernels read."""
    fmt, (w, _, _) = matrix(layer)
    return w.shape[1] * 32 // fmt.bits if fmt.bits != 16 else w.shape[1]


def mlp_width(mlp: nn.Module) -> int:
    """The MLP's hidden width: the down projection's inputs."""
    return inputs(mlp.down_proj)


def unreadable(layer: nn.Module) -> str:
    """Why the kernels cannot read a projection `matrix` refuses: its bias, or its format named."""
    if "bias" in layer:
        return "a bias, which the kernels do not add"
    if isinstance(layer, nn.QuantizedLinear):
        return f"{layer.mode} {layer.bits}-bit in groups of {layer.group_size}, a format the kernels do not read"
    dtype = f"{dtype_name(layer.weight.dtype)} " if "weight" in layer else ""
    return f"{dtype}{type(layer).__name__}, a format the kernels do not read"


def why_not(block: nn.Module) -> str | None:
    """Why a decoder layer cannot run fused (None when it can): its architecture, formats or head shape."""
    if not isinstance(block, TransformerBlock):
        return f"not a Llama decoder layer ({type(block).__name__})"
    attn = block.self_attn
    if not isinstance(attn.q_norm, nn.Identity):
        return "query/key norms (qwen3, gemma3) are not fused"
    # the fused layer is the llama/qwen2 block: other architectures' layers run as MLX's operations
    if not attn.plain:
        return "sliding-window or soft-capped attention (Gemma) is not fused"
    if "attn_output_norm" in block:
        return "norms on the attention's and the MLP's outputs (Gemma) are not fused"
    if isinstance(block.mlp, MoE):
        return "a mixture of experts is not fused"
    if "qkv_proj" in attn or "gate_proj" not in block.mlp:
        return "fused q-k-v and gate-up matrices (Phi-3) are not fused"
    # an MLP that patch made a GatedMLP is SwiGLU (patch fuses no other)
    if getattr(block.mlp, "act", nn.silu) is not nn.silu or attn.rope_attn_factor != 1.0:
        return "GeGLU or a rope attention factor is not fused"
    mods = list(projections(block).values())
    formats = [matrix(m)[0] for m in mods]
    if None in formats:
        unread: dict[str, list[str]] = {}
        for name, m, f in zip(MATRICES, mods, formats):
            if f is None:
                unread.setdefault(unreadable(m), []).append(name)
        return "; ".join(f"{', '.join(names)}: {why}" for why, names in unread.items())
    if len({f.dtype for f in formats}) != 1 or formats[0].dtype != dtype_name(block.input_layernorm.weight.dtype):
        return "matrices and norms of different float types"
    if len({f.bits == 16 for f in formats}) != 1:
        return "dense and quantized matrices mixed in one layer"
    if formats[4] != formats[5]:
        return "gate and up in different formats"
    hd = attn.head_dim
    if hd % 32 or hd > 256:
        return f"head size {hd}: attend takes multiples of 32 up to 256"
    if attn.n_heads // attn.n_kv_heads > MAX_GROUP:
        return f"{attn.n_heads // attn.n_kv_heads} query heads per key head: attend takes at most {MAX_GROUP}"
    for name, m, f in zip(MATRICES, mods, formats):
        k, step = inputs(m), max(f.group_size, 128 // f.bits)   # whole groups and 16-byte chunks
        if k % step:
            return f"{name}: {k} inputs, not a multiple of {step}"
    return None


@dataclass(frozen=True)
class Launches:
    """The launches of one layer: per kernel its template, grid and block (threads, as MLX takes them)
    and shared memory bytes; attend's and attention's grids are per call (they depend on the key count: `grid`).
    int8: the INT8_KERNELS read int8 activations (asked for, and the layer's matrices quantized); merged: the
    PAIRS a step runs as one launch each."""
    templates: dict
    grids: dict
    threads: dict
    shared: dict
    int8: bool = False
    merged: tuple[str, ...] = ()

    def order(self) -> tuple[str, ...]:
        """The kernels one step launches, in order."""
        return ("attn_in", *(k for pair, halves in PAIRS.items() for k in ((pair,) if pair in self.merged else halves)))


def q8_bytes(k: int) -> int:
    """Bytes of shared memory for the int8 copy of a staged row of k values (fusedlayer_cuda.quantize_row): a
    float2 per 16 values, then the values in two regions 64 bytes apart."""
    return 8 * (k // 16) + k + 128


def launches(block: TransformerBlock, int8: bool = False, merge: tuple[str, ...] | None = None) -> Launches:
    """The launch geometry of a layer that `why_not` accepts; int8: quantized matrices meet int8 activations;
    merge: the PAIRS to run as one launch each where they fit (None: MERGE)."""
    attn, mlp = block.self_attn, block.mlp
    fmts = [matrix(m)[0] for m in projections(block).values()]
    hq, hkv, hd = attn.n_heads, attn.n_kv_heads, attn.head_dim
    d, f = block.input_layernorm.weight.shape[0], mlp_width(mlp)
    t = DTYPES[fmts[0].dtype]
    quantized = int(fmts[0].bits != 16)       # why_not: one layer, all dense or all quantized
    q8 = int8 and bool(quantized)

    def fmt(i: int, fm: Format) -> list:
        return [(f"B{i}", fm.bits), (f"G{i}", fm.group_size or 1)]

    def blocks(name: str, rows: int, per_warp: int = ROWS_PER_WARP, groups: int = 1) -> int:
        warps = -(-rows // per_warp)
        return -(-warps // (WARPS[name] * groups))

    def head(name: str) -> list:
        return [("T", t), ("NW", WARPS[name])]

    def rows(name: str) -> list:
        return [("R", ROWS_PER_WARP), ("U", UNROLL[name][quantized]), ("Q8", q8 and name in INT8_KERNELS)]

    templates = {
        "attn_in": head("attn_in") + fmt(0, fmts[0]) + fmt(1, fmts[1]) + fmt(2, fmts[2])
        + [("D", hd), ("U", UNROLL["attn_in"][quantized]), ("TRAD", attn.rope_traditional), ("Q8", q8)],
        "attend": head("attend") + fmt(0, fmts[3]) + [("D", hd), ("G", hq // hkv), ("PF", PREFETCH)],
        "attn_out": head("attn_out") + fmt(0, fmts[3]) + rows("attn_out") + [("D", hd)],
        "mlp_in": head("mlp_in") + fmt(0, fmts[4]) + rows("mlp_in"),
        "mlp_out": head("mlp_out") + fmt(0, fmts[6]) + rows("mlp_out"),
    }
    templates["attention"] = head("attn_out") + [("NA", min(WARPS["attend"], WARPS["attn_out"]))] \
        + fmt(0, fmts[3]) + rows("attn_out") + [("D", hd), ("G", hq // hkv), ("PF", PREFETCH)]
    templates["mlp"] = head("mlp_in") + fmt(0, fmts[4]) + fmt(1, fmts[6]) + rows("mlp_in") \
        + [("UD", UNROLL["mlp_out"][quantized]), ("Q8D", q8 and "mlp_out" in INT8_KERNELS)]
    threads = {k: 32 * WARPS[k] for k in KERNELS if k not in PAIRS}
    threads.update({pair: threads[second] for pair, (_, second) in PAIRS.items()})
    per = GROUPS_PER_BLOCK
    counts = {"attn_in": blocks("attn_in", (hq + 2 * hkv) * hd, 2, per["attn_in"]), "attn_out": blocks("attn_out", d),
              "mlp_in": blocks("mlp_in", f, groups=per["mlp_in"]), "mlp_out": blocks("mlp_out", d)}
    grids = {k: threads[k] * b for k, b in counts.items()}
    grids["mlp"] = threads["mlp"] * (blocks("mlp_in", f) + counts["mlp_out"])   # a group per ticket
    row = lambda k, name: 4 * padded(k) + (q8_bytes(k) if q8 and name in INT8_KERNELS else 0)   # + its int8 copy
    partials = WARPS["attend"] * (hq // hkv) * (hd + 2)             # attend: each warp's, then the queries
    shared = {"attn_in": row(d, "attn_in"), "attend": 4 * (-(-partials // 4) * 4 + (hq // hkv) * (hd + 16)),
              "attn_out": 4 * padded(hq * hd) + max(4 * hq * MAX_SPLITS, q8_bytes(hq * hd) if q8 else 0),
              "mlp_in": row(d, "mlp_in"), "mlp_out": row(f, "mlp_out")}
    shared.update({pair: max(shared[a], shared[b]) for pair, (a, b) in PAIRS.items()})
    # attention keeps attend's G x D / 32 accumulators a lane in a block of attn_out's size: past 512 values,
    # ptxas (sm_90) gives it more than the 128 registers a thread that 16 warps may have, and it could not
    # launch; mlp's halves must agree on their block
    fits = {"attention": (hq // hkv) * hd <= 512 or WARPS["attn_out"] <= 8, "mlp": WARPS["mlp_in"] == WARPS["mlp_out"]}
    merge = MERGE if merge is None else merge
    return Launches(templates, grids, threads, shared, q8, tuple(p for p in merge if fits[p]))


def grid(plan: Launches, name: str, keys: int, kv_heads: int) -> int:
    """Threads of one launch of a kernel over `keys` positions: attend's blocks are one per key head and split,
    attention's are attend's and then attn_out's."""
    if name not in ("attend", "attention"):
        return plan.grids[name]
    blocks = kv_heads * splits(keys)
    if name == "attention":
        blocks += plan.grids["attn_out"] // plan.threads["attn_out"]
    return plan.threads[name] * blocks


def rope_frequencies(attn: nn.Module) -> np.ndarray:
    """Radians per position of each rotated pair, as mx.fast.rope turns positions into angles: the scale
    over the wavelength (base^(2i/D), or Llama 3's scaled wavelengths)."""
    hd = attn.head_dim
    wavelengths = np.array(attn._rope_freqs) if attn._rope_freqs is not None else \
        attn.rope_theta ** (np.arange(0, hd, 2) / hd)
    return (attn.rope_scale / wavelengths).astype(np.float32)


def scalar(value: float, dtype: mx.Dtype) -> mx.array:
    """A number the kernels read (an eps, a scale) in GPU memory: four copies, made by a GPU op. MLX keeps every
    array of 8 bytes or less in one managed pool that the host writes and the GPU reads across PCIe
    (mlx/backend/cuda/allocator.cpp); a GPU op's larger output gets device memory, or a recycled buffer
    outside that pool, which the GPU's write moves to the GPU."""
    return mx.full((4,), value, dtype=dtype)


@functools.lru_cache(maxsize=8)
def position(offset: int) -> mx.array:
    """The write position as the kernels read it (the first of four values, made on the GPU as scalar's are), one
    array per position shared by every layer of a step."""
    return mx.arange(offset, offset + 4, dtype=mx.int32)


class FusedLayer(TransformerBlock):
    """A TransformerBlock (same children, same parameter names) whose one-token steps on a KVCache run as
    five fused kernels while switched on (`switch`); every other call runs the plain layer. int8: quantized
    matrices meet int8 activations (llama.cpp's way: fewer instructions a weight, a rounding of every input)."""

    def __init__(self, block: TransformerBlock):
        nn.Module.__init__(self)
        self.self_attn, self.mlp = block.self_attn, block.mlp
        self.input_layernorm, self.post_attention_layernorm = block.input_layernorm, block.post_attention_layernorm
        self.plan = launches(self)
        self.on = False
        self.stages: dict[str, Callable[..., mx.array]] = {}

    def switch(self, on: bool, int8: bool | None = None, merge: tuple[str, ...] | None = None) -> None:
        """Run one-token steps fused (on) or as the plain layer, with int8 activations or float ones and `merge`'s
        pairs as one launch each (both None: as before; otherwise the launches are recomputed from the tables as
        they stand, an int8 left None as before, a merge left None as MERGE); on binds the layer's arrays now."""
        if int8 is not None or merge is not None:
            self.plan = launches(self, self.plan.int8 if int8 is None else int8, merge)
        self.on = on
        self.stages = self.bind() if on else {}

    def bind(self) -> dict[str, Callable[..., mx.array]]:
        """The kernels as functions with this layer's arrays and launches bound (no lookups per call):
        attn_in(x, cache, at) -> query (writes k and v into the cache at position `at`), attend(query, cache,
        at) -> the key-length splits' partial attention, attn_out(part, x) -> h, mlp_in(h) -> the MLP's hidden
        row, mlp_out(a, h) -> y; and the PAIRS in one launch each, attention(query, cache, at, x, sync) -> (part,
        h) and mlp(h, sync) -> (a, y) (sync: the handoff's counters, the layer's unless given: two launches queued
        at once must not share them)."""
        attn, mlp, plan = self.self_attn, self.mlp, self.plan
        dt = self.input_layernorm.weight.dtype
        q, k, v, o, g, u, dn = (matrix(m)[1] for m in projections(self).values())
        n1, n2 = self.input_layernorm["weight"], self.post_attention_layernorm["weight"]
        eps = scalar(self.input_layernorm.eps, mx.float32)
        eps2 = scalar(self.post_attention_layernorm.eps, mx.float32)
        freqs = mx.array(rope_frequencies(attn))
        scale = scalar(attn.scale, mx.float32)
        hq, hkv, hd = attn.n_heads, attn.n_kv_heads, attn.head_dim
        d, f = n1.shape[0], mlp_width(mlp)
        tpl, thr, smem = plan.templates, plan.threads, plan.shared
        kin, katt, kout, kall, mlin, mlout, kmlp = (kernel(n, smem[n]) for n in KERNELS)
        counters = {pair: mx.zeros((3,), dtype=mx.int32) for pair in PAIRS}   # the handoffs: zero between launches
        mx.eval(counters)

        def run(kern, name: str, inputs: list, shapes: list, dtypes: list, keys: int = 0) -> list[mx.array]:
            return kern(inputs=inputs, template=tpl[name], grid=(grid(plan, name, keys, hkv), 1, 1),
                        threadgroup=(thr[name], 1, 1), output_shapes=shapes, output_dtypes=dtypes)

        def attend(query: mx.array, cache: KVCache, at: mx.array) -> mx.array:
            keys = cache.offset + 1
            return run(katt, "attend", [query, cache.keys, cache.values, at, scale, *o], [(splits(keys), hq, hd + 2)],
                       [mx.float32], keys)[0]

        def attention(query: mx.array, cache: KVCache, at: mx.array, x: mx.array, sync: mx.array | None = None
                      ) -> tuple[mx.array, mx.array]:
            keys = cache.offset + 1
            part, h = run(kall, "attention", [query, cache.keys, cache.values, at, scale, *o, x,
                                              counters["attention"] if sync is None else sync],
                          [(splits(keys), hq, hd + 2), (1, 1, d)], [mx.float32, dt], keys)
            return part, h

        def mlp_both(h: mx.array, sync: mx.array | None = None) -> tuple[mx.array, mx.array]:
            a, y = run(kmlp, "mlp", [h, n2, eps2, *g, *u, *dn, counters["mlp"] if sync is None else sync],
                       [(1, 1, f), (1, 1, d)], [dt, dt])
            return a, y

        return {
            "attn_in": lambda x, cache, at: run(kin, "attn_in", [x, n1, eps, *q, *k, *v, freqs, at, cache.keys,
                                                                 cache.values], [(1, 1, hq * hd)], [dt])[0],
            "attend": attend,
            "attn_out": lambda part, x: run(kout, "attn_out", [part, *o, x], [(1, 1, d)], [dt])[0],
            "attention": attention,
            "mlp_in": lambda h: run(mlin, "mlp_in", [h, n2, eps2, *g, *u], [(1, 1, f)], [dt])[0],
            "mlp_out": lambda a, h: run(mlout, "mlp_out", [a, *dn, h], [(1, 1, d)], [dt])[0],
            "mlp": mlp_both,
        }

    def step(self, x: mx.array, cache: KVCache) -> tuple[mx.array, ...]:
        """One fused decode step of x (1, 1, d): every kernel's output, (query, attention partials, h, MLP
        hidden, y). k and v land in the cache at its offset, which the caller advances."""
        st, at = self.stages, position(cache.offset)
        query = st["attn_in"](x, cache, at)
        if "attention" in self.plan.merged:
            part, h = st["attention"](query, cache, at, x)
        else:
            part = st["attend"](query, cache, at)
            h = st["attn_out"](part, x)
        if "mlp" in self.plan.merged:
            a, y = st["mlp"](h)
        else:
            a = st["mlp_in"](h)
            y = st["mlp_out"](a, h)
        return query, part, h, a, y

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        if not self.on or x.shape[:2] != (1, 1) or type(cache) is not KVCache or cache.batch != 1 \
                or cache.dtype != x.dtype or x.dtype != self.input_layernorm.weight.dtype:
            return super().__call__(x, mask, cache)
        cache.room(1)
        y = self.step(x, cache)[-1]
        cache.offset += 1
        return y


def kernel_bytes(layer: FusedLayer, name: str, keys: int) -> int:
    """Bytes one call of a kernel must read: its matrices (codes, scales and biases) and norm weights; attend
    the keys and values of `keys` positions; a pair (PAIRS) both its kernels'."""
    if name in PAIRS:
        return sum(kernel_bytes(layer, k, keys) for k in PAIRS[name])
    nbytes = 0
    for m in READS[name]:
        fmt, arrays = matrix(projections(layer)[m])
        nbytes += sum(a.nbytes for a in (arrays[:1] if fmt.bits == 16 else arrays))   # dense: w once
    if name in ("attn_in", "mlp_in"):
        nbytes += layer.input_layernorm.weight.nbytes
    if name == "attend":
        attn = layer.self_attn
        nbytes += 2 * attn.n_kv_heads * keys * attn.head_dim * layer.input_layernorm.weight.itemsize
    return nbytes


def fuse(model: Model, on: bool = True, int8: bool = False) -> dict[int, str]:
    """Swap every decoder layer `why_not` accepts for a FusedLayer, switched on (on CUDA only) with int8 or
    float activations; returns the reason per layer left as it was. Off CUDA nothing is swapped: every layer's
    reason says why."""
    if not on_cuda():
        return {i: f"the fused layer needs MLX's CUDA backend; this is {mx.default_device()}"
                for i in range(len(model.layers))}
    left = {}
    for i, block in enumerate(model.layers):
        if isinstance(block, FusedLayer):
            block.switch(on, int8)
            continue
        reason = why_not(block)
        if reason is not None:
            left[i] = reason
            continue
        model.layers[i] = FusedLayer(block)
        model.layers[i].switch(on, int8)
    return left


def decode_seconds(model: Model, tokens: int = 16, context: int = 64) -> float:
    """Seconds per token of pipelined greedy decode (async_eval: step t+1 is built while the GPU runs step t)
    after a `context`-token prompt of zeros, the first step untimed."""
    cache = model.make_cache(context + tokens + 2)
    y = mx.argmax(prefill(model, mx.zeros((1, context), dtype=mx.int32), cache), axis=-1)
    step = decoder(model, cache)
    y = mx.argmax(step(y), axis=-1)
    mx.eval(y)
    start = clock()
    for _ in range(tokens):
        y = mx.argmax(step(y), axis=-1)
        mx.async_eval(y)
    mx.eval(y)
    return (clock() - start) / tokens


def choose(model: Model, rounds: int = 3, tokens: int = 16, context: int = 64, unfused: bool = True
           ) -> tuple[str, dict[str, float]]:
    """Fuse what `fuse` can, then time decode (`tokens` after `context`) with the fused layers off (unless not
    `unfused`) and on with each of MERGES that the layers fit, interleaved over `rounds`, and keep the fastest:
    (its name, median ms per token of each way). Names: "off", "on", and "on+" the pairs merged
    ("on+attention+mlp"). Off CUDA: nothing fused or timed ("off", {})."""
    if not on_cuda() or not any(isinstance(b, FusedLayer) for b in model.layers) and len(fuse(model)) == \
            len(model.layers):
        return "off", {}
    first = next(b for b in model.layers if isinstance(b, FusedLayer))
    ways: dict[str, tuple[str, ...]] = {"off": ()} if unfused else {}     # name -> the pairs merged
    for merge in MERGES:                # a pair that does not fit runs as two launches: the same way as another
        kept = launches(first, first.plan.int8, merge).merged
        ways.setdefault("+".join(("on", *kept)), kept)
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(rounds):
        for name, merge in ways.items():
            enable(model, name != "off", merge=merge)
            times[name].append(decode_seconds(model, tokens, context) * 1e3)
    ms = {k: median(v) for k, v in times.items()}
    best = min(ms, key=ms.get)
    enable(model, best != "off", merge=ways[best])
    return best, ms


def enable(model: Model, on: bool, int8: bool | None = None, merge: tuple[str, ...] | None = None) -> int:
    """Switch every FusedLayer of the model on or off, with int8 or float activations and `merge`'s pairs as one
    launch each (FusedLayer.switch: both None, the launches as they were); returns how many there are."""
    fused = [b for b in model.layers if isinstance(b, FusedLayer)]
    for b in fused:
        b.switch(on, int8, merge)
    return len(fused)
