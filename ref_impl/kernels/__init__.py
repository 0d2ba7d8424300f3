"""Custom CUDA kernels for the decode path: a bandwidth-bound GEMV, written with `mx.fast.cuda_kernel`.

Decoding one token multiplies each weight matrix W (n outputs, k inputs) by one activation row: a
GEMV, y = W x. It does 2 flops per weight read, far below any GPU's flops-to-bytes ridge, so its time
is the time to read W, and the decoder's speed is the sum of those reads. These kernels read MLX's
affine layout (`mx.quantize`: uint32 words of 4- or 8-bit codes, value 0 in the lowest bits, and a
scale and bias per group of 32, 64 or 128 inputs: w = scale * q + bias) and float16/bfloat16
matrices, for 1 activation row (decode) or 2-9 (speculative verification), accumulating in float32.

Design (one launch, `Launch` below; the CUDA C++ itself is gemv_cuda.py):
- Each warp owns `rows_per_warp` (R) consecutive output rows; warps never wait for each other (no
  shared memory, no block barrier), so a block of `warps` warps is only a scheduling unit. Lane l reads
  16-byte chunks l, l + 32, ... of each of its rows, so each warp instruction loads 512 contiguous
  bytes, and issues `unroll` (U) chunks per row, R x U loads, before it computes. Weights are loaded with
  ld.global.nc.L1::no_allocate (read once; L1 keeps x, which every warp reads).
- A chunk of a 4-bit matrix holds 32 codes of one group (8-bit: 16 codes). Codes become exact floats
  without int-to-float conversion instructions (which issue at a fraction of the FMA rate, CUDA
  Programming Guide, throughput table): OR the code into the mantissa of 2^23 and subtract 2^23 (for
  4-bit codes left in place, shifted by 16^j, one FMA undoes both). The group's scale and
  bias are applied once per chunk: sum_i (s q_i + b) x_i = s sum_i q_i x_i + b sum_i x_i, as MLX's
  own Metal qdot does. x is read as 16-byte vectors and converted once per chunk for all R rows.
- Each lane's R x rows partial sums are reduced with warp shuffles (__shfl_xor_sync); lane r*rows+m
  writes y[m, r].
- Fused variants cut launches: "glu" computes silu(x Wg^T) * (x Wu^T) for an MLP's gate and up
  matrices in one launch (the warp reads R rows of each; no float16 rounding of gate and up in between),
  "qkv" runs attention's three projections as one grid, each warp in one matrix, three outputs.
- Pointers that are not 16-byte aligned (a sliced input) take a path with 2-byte loads, same results.
Bytes per launch (`Launch.bytes`): the weights, scales and biases once, x and y once; x is re-read
from L1/L2 by every warp. Registers bound the warps per SM (`occupancy`).

Dispatch: `patch(model)` swaps each nn.Linear and affine nn.QuantizedLinear for a `GEMVLinear` with the
same parameters (fuse=True: also each model.MLP for a `GatedMLP`, and groups each attention's q/k/v). On
MLX's CUDA backend a short measurement per (format, shape, rows) on the model's own weights picks the
fastest of a few launches and MLX's built-in (fused groups: against their unfused calls), and records
it: many calls queued in one mx.eval, the graph built before the clock starts, so the time per call is
the GPU's (MLX encodes while the GPU runs; independent calls in one CUDA graph may overlap, so small
matrices look better than in a chain: bench --kernels times the decoder's matrices as a chain too).
Other row counts, other backends (CPU; Metal, where MLX's quantized kernels are already strong) and tied
embeddings keep MLX's built-ins; `enable` switches the choices on and off. A chosen call runs through a
closure bound at patch time, with no argument checks and no nn.Module.__getattr__ lookups.

What the H200 measured (results/h200-20261129-181307*, the chapter "Writing a GEMV kernel"): every kernel
is within the float32 bound of a float64 oracle (the test log beside it). Against MLX 0.32.4's built-ins, our
4-bit GEMV is ~1.4-2x faster on the 8B shapes at one row and 2-3x at four (MLX's multi-row 4-bit path is
slow), and slower on the smallest matrix (1024 x 4096), where patch keeps the built-in; float16 is at par,
both near the read bandwidth on the large matrices. The 4-bit kernels stop well short of that bandwidth (the
chapter estimates their arithmetic per byte: enough to bound them). End to end, the fused kernels cut the decoder's
matrix time by about half (Q4_K_M) and its kernels per token from ~580 to ~455, but a decode step then waits
on the host: MLX's Python graph building and its per-primitive encoding take longer than the GPU's work, so
tokens/s follows the host (two H200 machines, whose host CPUs differ, gave different speeds). MLX's CUDA backend
does launch CUDA graphs, but it rebuilds them node by node at every evaluation, one graph per batch of operations
(mlx/backend/cuda/device.cpp, CommandEncoder::commit), so every primitive still costs the host; llama.cpp captures
a decode step's kernels as one CUDA graph and replays it while the step's graph is unchanged (GGML_CUDA_GRAPHS, on
by default in its CMakeLists.txt), so its speed does not follow the host. bench --kernels records the breakdown.

References: MLX docs "Custom Metal Kernels" and mlx/backend/cuda/custom_kernel.cpp (grid in threads,
generated signature `w0_shape`, template constants); MLX mlx/backend/cuda/device.cpp (CommandEncoder: the CUDA
graphs MLX builds per batch of operations); MLX mlx/backend/metal/kernels/quantized.h `qdot`
(scale and bias per group, sum of x); the magic-number int-to-float conversion, as used for 4-bit
weights in FasterTransformer (Kim et al., "Who Says Elephants Can't Run", 2022); CUDA C++ Programming Guide, compute
capability 9.0 limits (2048 threads, 32 blocks, 64K registers per SM); PTX ISA `ld` cache hints.
See chapter: dispatch-kernel
"""

from __future__ import annotations

import functools
import math
import re
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from ref_impl.engine.model import MLP
from ref_impl.kernels.cuda import FUSES, HEADER, body, input_names, minified

MAX_ROWS = 9                  # activation rows a GEMV serves: decode (1) and speculative verification (2-9)
MAX_ACCUMULATORS = 16         # weight rows per warp x activation rows: partial sums a lane keeps in registers
MAX_LOADS = 8                 # weight rows per warp x unroll: 16-byte loads a lane keeps in flight (registers)
GROUP_SIZES = (32, 64, 128)
H200_SMS = 132                # streaming multiprocessors of an H200 (and H100 SXM)
H200_FP32_TFLOPS = 67.0        # FP32 (non-tensor) peak, NVIDIA H200 datasheet: 132 SMs x 128 lanes x FMA x 1.98 GHz
# Registers per thread that ptxas -v reports for one activation row (CUDA 13.0, sm_90a, no spills), per
# (bits, rows_per_warp, unroll): what `occupancy` takes. A compile-time fact of this source, not a timing.
REGISTERS = {(4, 1, 4): 56, (4, 2, 2): 70, (4, 2, 4): 96, (4, 4, 2): 128,
             (16, 1, 4): 40, (16, 2, 2): 40, (16, 2, 4): 56, (16, 4, 2): 64}
DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16}


def dtype_name(dtype: mx.Dtype) -> str:
    """mx.float16 -> "float16"."""
    return str(dtype).split(".")[-1]


@dataclass(frozen=True)
class Format:
    """A weight format the kernels read: MLX affine `bits`-bit codes (4 or 8) with a scale and bias per
    `group_size` inputs, or a dense matrix (bits 16, group_size 0). `dtype` is the type of x, y and
    (affine) of the scales and biases."""
    bits: int
    group_size: int = 0
    dtype: str = "float16"

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {self.dtype!r}: the kernels take {' or '.join(DTYPES)}")
        if self.bits == 16 and self.group_size != 0:
            raise ValueError("a dense (16-bit) format has no group size")
        if self.bits in (4, 8) and self.group_size not in GROUP_SIZES:
            raise ValueError(f"unsupported group size {self.group_size}: the kernels take {GROUP_SIZES}")
        if self.bits not in (4, 8, 16):
            raise ValueError(f"unsupported bits {self.bits}: the kernels read 4- or 8-bit affine codes "
                             "or 16-bit floats")

    @property
    def name(self) -> str:
        short = {"float16": "f16", "bfloat16": "bf16"}[self.dtype]
        return short if self.bits == 16 else f"q{self.bits}g{self.group_size}" + ("" if short == "f16" else "-bf16")

    @property
    def values_per_load(self) -> int:
        """Weights in one 16-byte load."""
        return 128 // self.bits

    def weight_bytes(self, n: int, k: int) -> int:
        """Bytes of an (n, k) matrix: codes, plus a scale and a bias per group."""
        extra = 2 * n * (k // self.group_size) * 2 if self.group_size else 0
        return n * k * self.bits // 8 + extra


@dataclass(frozen=True)
class Launch:
    """One GEMV launch: y (rows, n) = x (rows, k) @ W(n, k).T in `fmt`, by warps that each own
    `rows_per_warp` output rows and keep `unroll` 16-byte loads per weight row in flight, `warps` to a
    block. fuse "glu": y = silu(x Wg^T) * (x Wu^T) (two matrices of n rows); "qkv": three matrices of
    `parts` rows (n their sum), three outputs."""
    fmt: Format
    n: int
    k: int
    rows: int
    rows_per_warp: int = 1
    unroll: int = 4
    warps: int = 4
    fuse: str = ""
    parts: tuple[int, ...] = ()

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def weight_rows_per_warp(self) -> int:
        return 2 * self.rows_per_warp if self.fuse == "glu" else self.rows_per_warp

    @property
    def warps_total(self) -> int:
        sizes = self.parts if self.fuse == "qkv" else (self.n,)
        return sum(-(-s // self.rows_per_warp) for s in sizes)

    @property
    def blocks(self) -> int:
        return -(-self.warps_total // self.warps)

    @property
    def grid(self) -> tuple[int, int, int]:
        return (self.threads * self.blocks, 1, 1)    # MLX takes the grid in threads, as Metal does

    @property
    def threadgroup(self) -> tuple[int, int, int]:
        return (self.threads, 1, 1)

    @property
    def chunks_per_lane(self) -> int:
        """16-byte chunks of one weight row a lane reads."""
        return -(-self.k // self.fmt.values_per_load // 32)

    @property
    def loads_per_thread(self) -> int:
        """16-byte weight loads one lane issues (over all its weight rows)."""
        return self.chunks_per_lane * self.weight_rows_per_warp

    @property
    def bytes(self) -> int:
        """Bytes one launch must move at least: the weights once, x (rows, k) and y (rows, n)."""
        mats = 2 if self.fuse == "glu" else 1
        return mats * self.fmt.weight_bytes(self.n, self.k) + 2 * self.rows * (self.k + self.n)

    @property
    def label(self) -> str:
        what = {"": "ours", "glu": "ours fused gate/up", "qkv": "ours fused qkv"}[self.fuse]
        return f"{what} rows/warp={self.rows_per_warp} unroll={self.unroll}" + (
            f" warps={self.warps}" if self.warps != 4 else "")

    @property
    def template(self) -> list[tuple[str, object]]:
        t = [("T", DTYPES[self.fmt.dtype]), ("M", self.rows), ("R", self.rows_per_warp), ("U", self.unroll)]
        return t if self.fmt.bits == 16 else t + [("BITS", self.fmt.bits), ("GROUP", self.fmt.group_size)]


def launch_config(fmt: Format, n: int, k: int, rows: int, rows_per_warp: int | None = None,
                  unroll: int | None = None, warps: int = 4, fuse: str = "", parts: Sequence[int] = (),
                  sms: int = H200_SMS) -> Launch:
    """The launch for one GEMV. Default unroll: enough 16-byte loads per row for a lane's share of k, at most
    4. Default rows per warp: the largest of 4, 2, 1 that keeps weight rows x rows <= MAX_ACCUMULATORS,
    weight rows x unroll <= MAX_LOADS loads in flight and at least 8 warps per SM (more rows per warp re-use
    x from registers; more warps hide the memory latency). Raises ValueError for shapes it cannot run."""
    if fuse not in FUSES:
        raise ValueError(f"fuse={fuse!r}: choose one of {FUSES}")
    parts = tuple(parts)
    if fuse == "qkv":
        if len(parts) != 3 or sum(parts) != n:
            raise ValueError(f"a qkv launch needs the three matrices' rows as parts (summing to n={n}), got {parts}")
    elif parts:
        raise ValueError("parts are for fuse='qkv'")
    if n < 1 or k < 1 or any(p < 1 for p in parts):
        raise ValueError(f"GEMV shape must be positive, got n={n}, k={k}" + (f", parts {parts}" if parts else ""))
    step = fmt.group_size or fmt.values_per_load
    if k % step:
        raise ValueError(f"k={k} is not a multiple of {step} ({'the group size' if fmt.group_size else '16 bytes'})")
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"rows={rows}: the GEMV kernels take 1 to {MAX_ROWS} activation rows")
    if warps not in (1, 2, 4, 8):
        raise ValueError(f"warps={warps}: choose 1, 2, 4 or 8")
    mats = 2 if fuse == "glu" else 1
    per_lane = -(-k // fmt.values_per_load // 32)
    if unroll is None:
        unroll = next(u for u in (1, 2, 4) if u >= per_lane or u == 4)
    if unroll not in (1, 2, 4, 8):
        raise ValueError(f"unroll={unroll}: choose 1, 2, 4 or 8")
    if rows_per_warp is None:
        rows_per_warp = next(r for r in (4, 2, 1) if r == 1 or (
            mats * r * rows <= MAX_ACCUMULATORS and mats * r * unroll <= MAX_LOADS and -(-n // r) >= 8 * sms))
    if rows_per_warp not in (1, 2, 4, 8) or mats * rows_per_warp * rows > MAX_ACCUMULATORS:
        raise ValueError(f"rows_per_warp={rows_per_warp} with rows={rows}: need 1, 2, 4 or 8 and "
                         f"{'2 x ' if mats == 2 else ''}rows_per_warp x rows <= {MAX_ACCUMULATORS}")
    if mats * rows_per_warp * unroll > MAX_LOADS:
        raise ValueError(f"rows_per_warp={rows_per_warp} with unroll={unroll}: at most {MAX_LOADS} loads "
                         "in flight per lane")
    return Launch(fmt, n, k, rows, rows_per_warp, unroll, warps, fuse, parts)


def candidates(fmt: Format, n: int, k: int, rows: int, fuse: str = "", parts: Sequence[int] = ()) -> list[Launch]:
    """The launches a measurement chooses among, the default first: for one row up to three neighbours in
    rows per warp and unroll (each a kernel to compile), for 2-9 rows one."""
    grid = ((None, None), (1, 4), (2, 4), (4, 2), (2, 2), (1, 8))
    out = []
    for r, unroll in grid:
        try:
            launch = launch_config(fmt, n, k, rows, r, unroll, fuse=fuse, parts=parts)
        except ValueError:
            continue
        if launch not in out:
            out.append(launch)
    return out[:4 if rows == 1 else 2]


@dataclass(frozen=True)
class Occupancy:
    """Residency of one launch on a GPU of `sms` SMs (compute capability 9.0 limits)."""
    blocks_per_sm: int
    warps_per_sm: int
    fraction: float               # resident warps / 64
    waves: float                  # blocks / (blocks_per_sm x sms)
    bytes_in_flight_per_sm: int   # resident lanes x the 16-byte weight loads each issues before computing


def occupancy(launch: Launch, registers: int, sms: int = H200_SMS) -> Occupancy:
    """Blocks resident per SM given the registers per thread (ptxas -v): the least of 2048 threads,
    32 blocks and 65536 registers (allocated per warp in units of 256) per SM. REGISTERS has ptxas's counts."""
    if registers < 1 or registers > 255:
        raise ValueError(f"registers={registers}: a thread has 1 to 255")
    per_warp = -(-registers * 32 // 256) * 256
    blocks = min(2048 // launch.threads, 32, 65536 // (per_warp * launch.warps))
    warps = blocks * launch.warps
    in_flight = launch.weight_rows_per_warp * min(launch.unroll, launch.chunks_per_lane)
    return Occupancy(blocks, warps, warps / 64, launch.blocks / (max(blocks, 1) * sms), warps * 32 * 16 * in_flight)


def on_cuda() -> bool:
    """True when MLX runs on its CUDA backend: the only place these kernels run."""
    return mx.cuda.is_available() and mx.default_device() == mx.gpu


@functools.cache
def _kernel(dense: bool, fuse: str = ""):
    outputs = ["y0", "y1", "y2"] if fuse == "qkv" else ["y0"]
    name = f"ref_gemv_{'dense' if dense else 'affine'}{'_' + fuse if fuse else ''}"
    return mx.fast.cuda_kernel(name=name, input_names=input_names(dense, fuse), output_names=outputs,
                               source=body(dense, fuse), header=minified(HEADER))


@functools.cache
def _runner(launch: Launch) -> Callable[..., list[mx.array]]:
    """run(x, *arrays) -> outputs for this launch, without checks: the per-call path. arrays: per matrix
    (w,) or (w, scales, biases), as `input_names`; x (..., k) gives outputs (..., n) (qkv: one per part)."""
    kern = _kernel(launch.fmt.bits == 16, launch.fuse)
    tpl, grid, tg = launch.template, launch.grid, launch.threadgroup
    sizes = launch.parts if launch.fuse == "qkv" else (launch.n,)
    dts = [DTYPES[launch.fmt.dtype]] * len(sizes)

    def run(x: mx.array, *arrays: mx.array) -> list[mx.array]:
        lead = x.shape[:-1]
        return kern(inputs=[x, *arrays], template=tpl, grid=grid, threadgroup=tg,
                    output_shapes=[(*lead, s) for s in sizes], output_dtypes=dts)
    return run


def gemv(x: mx.array, mats: Sequence[tuple[mx.array, ...]], fmt: Format, fuse: str = "",
         launch: Launch | None = None) -> list[mx.array]:
    """The checked entry point: x (..., k) against each matrix of `mats` ((w,) dense, (w, scales, biases)
    affine), accumulated in float32, 1 to 9 rows. fuse "": one matrix, [y]; "glu": (gate, up),
    [silu(x Wg^T) * (x Wu^T)]; "qkv": three matrices, [x Wq^T, x Wk^T, x Wv^T]."""
    if x.dtype not in DTYPES.values() or dtype_name(x.dtype) != fmt.dtype:
        raise ValueError(f"unsupported activation dtype {x.dtype}: the kernels take float16 or bfloat16, "
                         f"as the weights' {fmt.dtype}")
    want = {"": 1, "glu": 2, "qkv": 3}.get(fuse)
    if want is None or len(mats) != want:
        raise ValueError(f"fuse={fuse!r} takes {want} matrices, got {len(mats)}")
    shapes = []
    for arrays in mats:
        w = arrays[0]
        if fmt.bits == 16:
            if len(arrays) != 1 or w.ndim != 2 or w.dtype != x.dtype:
                raise ValueError(f"w must be a {x.dtype} matrix (n, k), got {w.dtype} of shape {w.shape}")
            n, k = w.shape
        else:
            if len(arrays) != 3 or w.dtype != mx.uint32 or w.ndim != 2:
                raise ValueError(f"w must be uint32 (n, k * bits / 32) codes, got {w.dtype} of shape {w.shape}")
            n, k = w.shape[0], w.shape[1] * 32 // fmt.bits
            for name, a in zip(("scales", "biases"), arrays[1:]):
                if a.shape != (n, k // fmt.group_size) or a.dtype != x.dtype:
                    raise ValueError(f"{name} must be {x.dtype} of shape {(n, k // fmt.group_size)}, "
                                     f"got {a.dtype} {a.shape}")
        shapes.append((n, k))
    k = shapes[0][1]
    if x.ndim < 1 or x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1] if x.ndim else 0} features, the matrix {shapes[0]} takes {k}")
    if any(s[1] != k for s in shapes) or (fuse == "glu" and shapes[0] != shapes[1]):
        raise ValueError(f"fused matrices must agree: {shapes}")
    rows = x.size // k
    n, parts = (sum(s[0] for s in shapes), tuple(s[0] for s in shapes)) if fuse == "qkv" else (shapes[0][0], ())
    if launch is None:
        launch = launch_config(fmt, n, k, rows, fuse=fuse, parts=parts)
    elif (launch.fmt, launch.n, launch.k, launch.rows, launch.fuse, launch.parts) != (fmt, n, k, rows, fuse, parts):
        raise ValueError(f"launch for {launch.fmt.name} ({launch.rows}, {launch.k}) x ({launch.n}, {launch.k}) "
                         f"{launch.fuse} used for {fmt.name} ({rows}, {k}) x ({n}, {k}) {fuse}")
    if not on_cuda():
        raise RuntimeError(f"the GEMV kernels need MLX's CUDA backend; this is {mx.default_device()} "
                           "(use mx.quantized_matmul or matmul)")
    return _runner(launch)(x, *[a for arrays in mats for a in arrays])


def affine_gemv(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int,
                launch: Launch | None = None) -> mx.array:
    """x (..., k) @ dequantize(w, scales, biases).T for MLX's affine layout, as
    mx.quantized_matmul(x, w, scales, biases, transpose=True) but accumulated in float32; 1 to 9 rows."""
    if x.dtype not in DTYPES.values():
        raise ValueError(f"unsupported activation dtype {x.dtype}: the kernels take float16 or bfloat16")
    return gemv(x, [(w, scales, biases)], Format(bits, group_size, dtype_name(x.dtype)), "", launch)[0]


def dense_gemv(x: mx.array, w: mx.array, launch: Launch | None = None) -> mx.array:
    """x (..., k) @ w.T for a float16/bfloat16 matrix w (n, k), accumulated in float32; 1 to 9 rows."""
    if x.dtype not in DTYPES.values():
        raise ValueError(f"unsupported activation dtype {x.dtype}: the kernels take float16 or bfloat16")
    return gemv(x, [(w,)], Format(16, 0, dtype_name(x.dtype)), "", launch)[0]


# --- in the decoder -------------------------------------------------------------------------------------

def format_of(layer: nn.Module) -> Format | None:
    """The kernel format of an nn.Linear (float16/bfloat16) or affine nn.QuantizedLinear (4/8 bits,
    groups of 32/64/128, scales in the weight dtype), or None when the kernels cannot run it."""
    try:
        if type(layer) is nn.Linear and dtype_name(layer.weight.dtype) in DTYPES and layer.weight.shape[1] % 8 == 0:
            return Format(16, 0, dtype_name(layer.weight.dtype))
        if (type(layer) is nn.QuantizedLinear and layer.mode == "affine" and layer.biases is not None
                and layer.scales.dtype == layer.biases.dtype):
            return Format(layer.bits, layer.group_size, dtype_name(layer.scales.dtype))
    except ValueError:   # bits, group size or dtype the kernels do not take
        return None
    return None


def _plain(module: nn.Module, name: str, value: object) -> None:
    """Set an attribute that nn.Module must not treat as a parameter (a dict), found without __getattr__."""
    object.__setattr__(module, name, value)


class _Routed:
    """What GEMVLinear and GatedMLP share: per activation-row count, the launch chosen for it and the
    prepared call (`bind`) that runs it."""

    def use(self, rows: int, launch: Launch | None) -> None:
        """Run calls of `rows` activation rows with `launch` (None: MLX's built-in), from now on."""
        self._chosen[rows] = launch
        self._runs.pop(rows, None)
        if launch is not None:
            self._runs[rows] = self.bind(launch)


class GEMVLinear(_Routed, nn.Module):
    """An nn.Linear / affine nn.QuantizedLinear (same parameters, same names) whose calls with a row count
    it has a run for go to our kernel; every other call runs MLX's built-in, as the layer it replaces did."""

    def __init__(self, layer: nn.Module, fmt: Format):
        super().__init__()
        self.fmt = fmt
        self.weight = layer.weight
        if fmt.bits != 16:
            self.scales, self.biases = layer.scales, layer.biases
        if "bias" in layer:
            self.bias = layer.bias
        self.act_dtype = DTYPES[fmt.dtype]
        _plain(self, "_chosen", {})    # rows -> Launch (None: the built-in), what patch measured
        _plain(self, "_runs", {})      # rows -> run(x): what calls use now (enable)
        _plain(self, "_qkv", None)     # the _QKV group it belongs to, if any

    @property
    def shape(self) -> tuple[int, int]:
        """(n, k): outputs and inputs."""
        n, cols = self.weight.shape
        return n, cols * 32 // self.fmt.bits if self.fmt.bits != 16 else cols

    def arrays(self) -> tuple[mx.array, ...]:
        """The kernel inputs of this matrix: (w,) or (w, scales, biases)."""
        return (self["weight"],) if self.fmt.bits == 16 else (self["weight"], self["scales"], self["biases"])

    def bind(self, launch: Launch) -> Callable[[mx.array], mx.array]:
        """Our GEMV with this launch, as a one-argument function of x (no checks)."""
        run = _runner(launch)
        if self.fmt.bits == 16:
            return lambda x: run(x, self["weight"])[0]
        return lambda x: run(x, self["weight"], self["scales"], self["biases"])[0]

    def builtin(self, x: mx.array) -> mx.array:
        """MLX's own matmul, as the replaced layer computed it."""
        if self.fmt.bits == 16:
            return x @ self["weight"].T
        return mx.quantized_matmul(x, self["weight"], self["scales"], self["biases"], transpose=True,
                                   group_size=self.fmt.group_size, bits=self.fmt.bits)

    def kernel(self, x: mx.array, launch: Launch) -> mx.array:
        """Our GEMV with this launch, checked."""
        return gemv(x, [self.arrays()], self.fmt, "", launch)[0]

    def __call__(self, x: mx.array) -> mx.array:
        run = self._runs.get(x.size // x.shape[-1]) if x.dtype == self.act_dtype else None
        y = self.builtin(x) if run is None else run(x)
        return y + self["bias"] if "bias" in self else y


class GatedMLP(_Routed, nn.Module):
    """model.MLP (same children, same parameter names) whose gate and up projections run as one fused
    kernel, silu(x Wg^T) * (x Wu^T), for the row counts it has a run for; otherwise as model.MLP."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        _plain(self, "_chosen", {})
        _plain(self, "_runs", {})

    def bind(self, launch: Launch) -> Callable[[mx.array], mx.array]:
        run, g, u = _runner(launch), self.gate_proj, self.up_proj
        return lambda x: run(x, *g.arrays(), *u.arrays())[0]

    def hidden(self, x: mx.array) -> mx.array:
        """silu(gate) * up, as model.MLP computes it (through the projections' own choices)."""
        return nn.silu(self.gate_proj(x)) * self.up_proj(x)

    def __call__(self, x: mx.array) -> mx.array:
        run = self._runs.get(x.size // x.shape[-1]) if x.dtype == self.gate_proj.act_dtype else None
        return self.down_proj(self.hidden(x) if run is None else run(x))


class _QKV:
    """Attention's q, k and v projections run as one kernel: the q call runs all three for its x and keeps
    the outputs; the k and v calls hand them out when given the same x (Attention calls all three on one
    array), else compute their own."""

    def __init__(self, q: GEMVLinear, k: GEMVLinear, v: GEMVLinear):
        self.mods = (q, k, v)
        self.chosen: dict[int, Launch | None] = {}
        self.last: tuple[mx.array, list[mx.array]] | None = None

    @property
    def shape(self) -> tuple[tuple[int, ...], int]:
        return tuple(m.shape[0] for m in self.mods), self.mods[0].shape[1]

    def fused(self, launch: Launch) -> Callable[[mx.array], list[mx.array]]:
        run, (q, k, v) = _runner(launch), self.mods
        return lambda x: run(x, *q.arrays(), *k.arrays(), *v.arrays())

    def unfused(self, x: mx.array) -> list[mx.array]:
        return [m(x) for m in self.mods]

    def install(self, rows: int, launch: Launch) -> None:
        """Route calls of `rows` rows through the fused kernel (over the projections' own runs)."""
        fused, (q, k, v) = self.fused(launch), self.mods

        def lead(x: mx.array) -> mx.array:
            outs = fused(x)
            self.last = (x, outs)
            return outs[0]

        def follow(i: int, own: Callable[[mx.array], mx.array]) -> Callable[[mx.array], mx.array]:
            def run(x: mx.array) -> mx.array:
                last = self.last
                if last is not None and last[0] is x:
                    if i == 2:
                        self.last = None
                    return last[1][i]
                return own(x)
            return run

        k_own, v_own = k._runs.get(rows, k.builtin), v._runs.get(rows, v.builtin)
        q._runs[rows], k._runs[rows], v._runs[rows] = lead, follow(1, k_own), follow(2, v_own)


def enable(model: nn.Module, gemv: bool = True, fused: bool = True) -> None:
    """Use the launches patch chose (gemv: the single GEMVs; fused: gate/up and q/k/v), or MLX's built-ins
    where False. The model's parameters are not touched."""
    for m in model.modules():
        if isinstance(m, (GEMVLinear, GatedMLP)):
            m._runs.clear()
            if gemv if isinstance(m, GEMVLinear) else fused:
                m._runs.update({r: m.bind(la) for r, la in m._chosen.items() if la is not None})
    for m in model.modules():
        if isinstance(m, GEMVLinear) and m._qkv is not None and m is m._qkv.mods[0]:
            m._qkv.last = None
            for r, la in m._qkv.chosen.items() if fused else ():
                if la is not None:
                    m._qkv.install(r, la)


def _timed(make: Callable[[], list], reps: int) -> tuple[float, float]:
    """(eval, build): best seconds of mx.eval on a graph from make() (built before the clock starts) over
    reps, after one warm-up (which compiles), and the best seconds make() took."""
    mx.eval(make())
    best_eval = best_build = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        outs = make()
        t1 = time.perf_counter()
        mx.eval(outs)
        t2 = time.perf_counter()
        best_build, best_eval = min(best_build, t1 - t0), min(best_eval, t2 - t1)
    return best_eval, best_build


def time_calls(calls: dict[str, Sequence[Callable[[mx.array], object]]], x: mx.array, passes: int, reps: int = 5
               ) -> tuple[dict[str, float], dict[str, float], dict[str, str]]:
    """Per label: seconds per call of `passes` rounds of every function in its list on x, queued in one
    mx.eval (graph built first, untimed: the time per call is the kernel's, with MLX's encoding overlapping
    it), the host seconds per call to build that graph, and the labels that failed (an NVRTC compile
    error, which MLX raises at eval) with their message."""
    per_call, host, errors = {}, {}, {}
    for label, fns in calls.items():
        try:
            ev, build = _timed(lambda: [f(x) for _ in range(passes) for f in fns], reps)
        except RuntimeError as e:
            errors[label] = str(e)
            continue
        per_call[label], host[label] = ev / (passes * len(fns)), build / (passes * len(fns))
    return per_call, host, errors


@dataclass
class Choice:
    """What a measurement chose for one (format, shape, rows): a launch or MLX's built-in (None), with the
    seconds per call of every variant timed (queued), their host seconds to build, and failed variants'
    errors. fuse "glu"/"qkv": a fused group, against the unfused calls ("unfused")."""
    fmt: Format
    n: int
    k: int
    rows: int
    layers: int
    launch: Launch | None
    seconds: dict[str, float] = field(default_factory=dict)
    host: dict[str, float] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    fuse: str = ""
    parts: tuple[int, ...] = ()


BUILTIN = "mlx built-in"
UNFUSED = "unfused"


def _activation(fmt: Format, rows: int, k: int, seed: int = 0) -> mx.array:
    x = (mx.random.normal((rows, k), key=mx.random.key(seed)) * 0.1).astype(DTYPES[fmt.dtype])
    mx.eval(x)
    return x


def _passes(nbytes: int, calls: int, min_bytes: int) -> int:
    """Rounds over `calls` matrices of nbytes each so a timing reads at least min_bytes (more than L2)."""
    return max(1, min(64, -(-min_bytes // (calls * nbytes))))


def time_variants(layers: Sequence[GEMVLinear], rows: int, launches: Sequence[Launch], reps: int = 5,
                  min_bytes: int = 256 << 20, seed: int = 0
                  ) -> tuple[dict[str, float], dict[str, float], dict[str, str]]:
    """time_calls for MLX's built-in and each launch over all `layers` (same format and shape) in turn,
    repeated until min_bytes of weights are read per timing."""
    n, k = layers[0].shape
    x = _activation(layers[0].fmt, rows, k, seed)
    calls = {BUILTIN: [m.builtin for m in layers]}
    calls.update({la.label: [m.bind(la) for m in layers] for la in launches})
    return time_calls(calls, x, _passes(layers[0].fmt.weight_bytes(n, k), len(layers), min_bytes), reps)


def _choose(choice: Choice, launches: Sequence[Launch], baseline: str) -> None:
    """Set choice.launch to the fastest timed launch, or None when `baseline` was fastest."""
    best = min(choice.seconds, key=choice.seconds.get) if choice.seconds else baseline
    choice.launch = next((la for la in launches if la.label == best), None)


def patch(model: nn.Module, rows: Sequence[int] = (1,), measure: bool = True, fuse: bool = False,
          reps: int = 5) -> list[Choice]:
    """Swap every nn.Linear / affine nn.QuantizedLinear the kernels can run for a GEMVLinear (fuse: and each
    model.MLP for a GatedMLP, q/k/v of an attention into a group). On MLX's CUDA backend, per (format,
    shape) and row count in `rows`, choose our fastest launch or MLX's built-in by timing them on the
    model's own weights (measure=False: launch_config's default, untimed); fused groups against their
    unfused calls. Elsewhere nothing is chosen and every call stays MLX's built-in. Returns the choices."""
    if not rows or any(not 1 <= r <= MAX_ROWS for r in rows):
        raise ValueError(f"rows {list(rows)}: each must be 1 to {MAX_ROWS}")
    swaps = [(name, GEMVLinear(m, fmt)) for name, m in model.named_modules() if (fmt := format_of(m)) is not None]
    model.update_modules(tree_unflatten(swaps))
    qkvs, mlps = [], []
    if fuse:
        mlps = [(name, GatedMLP(m)) for name, m in model.named_modules() if type(m) is MLP and _fusable(
            (m.gate_proj, m.up_proj), same_n=True)]
        model.update_modules(tree_unflatten(mlps))
        for _, m in model.named_modules():
            group = [getattr(m, p, None) for p in ("q_proj", "k_proj", "v_proj")]
            if _fusable(group, same_n=False):
                qkv = _QKV(*group)
                for g in group:
                    _plain(g, "_qkv", qkv)
                qkvs.append(qkv)
    choices = []
    groups: dict[tuple[Format, int, int], list[GEMVLinear]] = {}
    for _, m in swaps:
        groups.setdefault((m.fmt, *m.shape), []).append(m)
    for (fmt, n, k), layers in groups.items() if on_cuda() else ():
        for r in rows:
            try:
                launches = candidates(fmt, n, k, r) if measure else [launch_config(fmt, n, k, r)]
            except ValueError:     # k the kernels cannot tile (e.g. not a multiple of 8): built-in
                launches = []
            choice = Choice(fmt, n, k, r, len(layers), launches[0] if launches else None)
            if measure and launches:
                choice.seconds, choice.host, choice.errors = time_variants(layers, r, launches, reps)
                _choose(choice, launches, BUILTIN)
            for m in layers:
                m.use(r, choice.launch)
            choices.append(choice)
    if on_cuda() and fuse:
        choices += _choose_fused([m for _, m in mlps], "glu", rows, measure, reps)
        choices += _choose_fused(qkvs, "qkv", rows, measure, reps)
    enable(model, gemv=True, fused=fuse)
    return choices


def summary(choices: Sequence[Choice]) -> str:
    """What patch chose, a line per (format, shape, rows, fusion): the launch or MLX's built-in, with the
    timings that decided it; the first line counts the matrices and groups that run our kernels."""
    ours = [c for c in choices if c.launch is not None]
    lines = [f"kernels: ours for {sum(c.layers for c in ours)} of {sum(c.layers for c in choices)} matrices and "
             f"fused groups ({len(ours)} of {len(choices)} shapes), MLX's built-in for the rest"]
    for c in choices:
        chosen = c.launch.label if c.launch else UNFUSED if c.fuse else BUILTIN
        timed = ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in c.seconds.items())
        lines.append(f"  {c.fmt.name} {c.fuse or 'gemv'} {c.n}x{c.k} rows {c.rows} (x{c.layers}): {chosen}"
                     + (f" [{timed}]" if timed else ""))
    return "\n".join(lines)


def _fusable(mods: Sequence[object], same_n: bool) -> bool:
    """True when these GEMVLinears can run as one fused kernel: same format and inputs, no bias."""
    if not mods or not all(isinstance(m, GEMVLinear) and "bias" not in m for m in mods):
        return False
    return (len({m.fmt for m in mods}) == 1 and len({m.shape[1] for m in mods}) == 1
            and (not same_n or len({m.shape[0] for m in mods}) == 1))


def _choose_fused(items: Sequence[GatedMLP | _QKV], fuse: str, rows: Sequence[int], measure: bool, reps: int,
                  min_bytes: int = 256 << 20) -> list[Choice]:
    """Per shape and row count, the fastest fused launch or the unfused calls (UNFUSED), as patch does."""
    groups: dict[tuple, list] = {}
    for it in items:
        first = it.gate_proj if fuse == "glu" else it.mods[0]
        parts = () if fuse == "glu" else tuple(m.shape[0] for m in it.mods)
        groups.setdefault((first.fmt, first.shape, parts), []).append(it)
    choices = []
    for (fmt, (n, k), parts), its in groups.items():
        total = sum(parts) if parts else n
        for r in rows:
            try:
                launches = candidates(fmt, total, k, r, fuse, parts) if measure else [
                    launch_config(fmt, total, k, r, fuse=fuse, parts=parts)]
            except ValueError:
                launches = []
            choice = Choice(fmt, total, k, r, len(its), launches[0] if launches else None, fuse=fuse, parts=parts)
            if measure and launches:
                x = _activation(fmt, r, k)
                calls = {UNFUSED: [it.hidden if fuse == "glu" else it.unfused for it in its]}
                make = (lambda it, la: it.bind(la)) if fuse == "glu" else (lambda it, la: it.fused(la))
                calls.update({la.label: [make(it, la) for it in its] for la in launches})
                nbytes = launches[0].bytes - 2 * r * (k + total)
                choice.seconds, choice.host, choice.errors = time_calls(
                    calls, x, _passes(nbytes, len(its), min_bytes), reps)
                _choose(choice, launches, UNFUSED)
            for it in its:
                if fuse == "glu":
                    it.use(r, choice.launch)
                else:
                    it.chosen[r] = choice.launch
            choices.append(choice)
    return choices


VIEWS = frozenset({"Broadcast", "Reshape", "Flatten", "Unflatten", "ExpandDims", "Squeeze", "Transpose",
                   "Slice", "AsStrided"})


def count_kernels(model: nn.Module, context: int = 8, compiled: bool = False) -> int:
    """Compute primitives in the graph of one decode step (views excluded): about the kernels MLX
    launches per token on this device (a fused or compiled primitive counts once; compiled: the step as
    generate.compiled_decoder runs it)."""
    from ref_impl.engine.generate import decoder

    cache = model.make_cache(context + 2)
    mx.eval(model(mx.zeros((1, context), dtype=mx.int32), cache))
    step = decoder(model, cache, compiled)
    mx.eval(step(mx.zeros((1,), dtype=mx.int32)))         # compiled: traced here, so the count sees the replay
    logits = step(mx.zeros((1,), dtype=mx.int32))
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "step.dot"
        mx.export_to_dot(str(path), logits)
        labels = re.findall(r'label ="([^"]+)", shape=rectangle', path.read_text())
    mx.eval(logits)
    return sum(label not in VIEWS for label in labels)


# --- measurement ------------------------------------------------------------------------------------------

def random_layer(fmt: Format, n: int, k: int, seed: int = 0) -> GEMVLinear:
    """A GEMVLinear (n outputs, k inputs) of random weights in fmt: GEMV speed does not depend on the values."""
    w = (mx.random.normal((n, k), key=mx.random.key(seed)) * 0.02).astype(DTYPES[fmt.dtype])
    layer = nn.Linear(k, n, bias=False)
    layer.weight = w
    if fmt.bits != 16:
        layer = nn.QuantizedLinear.from_linear(layer, fmt.group_size, fmt.bits)
    mx.eval(layer.parameters())
    return GEMVLinear(layer, fmt)


def gemv_sweep(shapes: Sequence[tuple[int, int]], formats: Sequence[Format], rows: Sequence[int] = (1, 4),
               model: str | None = None, reps: int = 5, min_bytes: int = 256 << 20, seed: int = 0) -> list[dict]:
    """Results records (experiment "gemv") per format, (n, k) shape and row count: GB/s and µs per GEMV of
    MLX's built-in and of each candidate launch, queued over enough random copies of the matrix that they
    do not fit in L2 (time_calls), the host µs per call to build the graph, our best launch's speedup and
    its largest difference from the built-in's output; a launch that fails to compile gives a
    "compile_error" record with MLX's message instead."""
    records = []
    for fmt in formats:
        for n, k in shapes:
            copies = max(1, min(64, -(-min_bytes // fmt.weight_bytes(n, k))))
            layers = [random_layer(fmt, n, k, seed + i) for i in range(copies)]
            for r in rows:
                launches = candidates(fmt, n, k, r)
                seconds, host, errors = time_variants(layers, r, launches, reps, min_bytes, seed)
                base = {"experiment": "gemv", "model": model, "weights": fmt.name, "kv": None, "context": None,
                        "samples": [], "peer": None, "shape": [n, k], "rows": r, "bytes": launches[0].bytes,
                        "copies": copies}
                for label, s in seconds.items():
                    records += [{**base, "variant": label, "metric": "bandwidth", "unit": "GB/s",
                                 "value": launches[0].bytes / s / 1e9},
                                {**base, "variant": label, "metric": "time_us", "unit": "us", "value": s * 1e6},
                                {**base, "variant": label, "metric": "host_us", "unit": "us",
                                 "value": host[label] * 1e6,
                                 "note": "host time per call to build the graph (Python and MLX), before eval"}]
                records += [{**base, "variant": label, "metric": "compile_error", "unit": None, "value": None,
                             "note": e[-2000:]} for label, e in errors.items()]
                ours = {la.label: la for la in launches if la.label in seconds}
                if ours and BUILTIN in seconds:
                    best = min(ours, key=seconds.get)
                    x = _activation(fmt, r, k, seed)
                    ref = layers[0].builtin(x).astype(mx.float32)
                    diff = mx.abs(layers[0].kernel(x, ours[best]).astype(mx.float32) - ref).max().item()
                    records += [{**base, "variant": best, "metric": "speedup", "unit": "x",
                                 "value": seconds[BUILTIN] / seconds[best]},
                                {**base, "variant": best, "metric": "max_abs_diff", "unit": None, "value": diff,
                                 "note": f"vs the built-in, whose outputs reach {mx.abs(ref).max().item():.3g}"}]
            del layers
    return records
