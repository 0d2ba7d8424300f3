"""Launch rules of the GEMV kernels: which launch runs a matrix, what it moves, how many warps an SM holds.

Decoding one token multiplies each weight matrix W (n outputs, k inputs) by one activation row: a
GEMV, y = W x. It does 2 flops per weight read, far below any GPU's flops-to-bytes ridge, so its time
is the time to read W, and the decoder's speed is the sum of those reads. The kernels (CUDA source in
cuda.py, run by layers.py) read MLX's affine layout (`mx.quantize`: uint32 words of 4- or 8-bit codes,
value 0 in the lowest bits, and a scale and bias per group of 32, 64 or 128 inputs: w = scale * q + bias)
and float16/bfloat16 matrices, for 1 activation row (decode) or 2-9 (speculative verification),
accumulating in float32.

One launch (`Launch`):
- Each warp owns `rows_per_warp` (R) consecutive output rows; warps never wait for each other (no
  shared memory, no block barrier), so a block of `warps` warps is only a scheduling unit. Lane l reads
  16-byte chunks l, l + 32, ... of each of its rows, so each warp instruction loads 512 contiguous
  bytes, and issues `unroll` (U) chunks per row, R x U loads, before it computes. Weights are loaded with
  ld.global.nc.L1::no_allocate (read once; L1 keeps x, which every warp reads).
- A chunk of a 4-bit matrix holds 32 codes of one group (8-bit: 16 codes). Codes become floats without
  int-to-float conversion instructions (which issue at a fraction of the FMA rate, CUDA Programming
  Guide, throughput table): an 8-bit code OR-ed into the mantissa of 2^23, minus 2^23, is the code; a
  4-bit code OR-ed into 2048.0 or 128.0 (at bits 12-15 or 16-19 of the word, shifted or rotated there)
  is the float 2048 + c or 128 + c, whose product with x is exact in float32, so the dot sums x (offset
  + c) and the offsets leave once per chunk through sums of x: ~2.4 lane operations a code, where
  subtracting first took 3, 5-16% more GB/s on the H200 ("gemv-decode" records,
  results/h200-20261202-034000.json).
  The group's scale and bias are applied once per chunk: sum_i (s q_i + b) x_i = s sum_i q_i x_i + b
  sum_i x_i, as MLX's own Metal qdot does. x is read as 16-byte vectors and converted once per chunk
  for all R rows.
- Each lane's R x rows partial sums are reduced with warp shuffles (__shfl_xor_sync); lane r*rows+m
  writes y[m, r].
- Fused variants cut launches: "glu" computes silu(x Wg^T) * (x Wu^T) for an MLP's gate and up
  matrices in one launch (the warp reads R rows of each; no float16 rounding of gate and up in between),
  "qkv" runs attention's three projections as one grid, each warp in one matrix, three outputs.
- Pointers that are not 16-byte aligned (a sliced input) take a path with 2-byte loads, same results.
Bytes per launch (`Launch.bytes`): the weights, scales and biases once, x and y once; x is re-read
from L1/L2 by every warp. Registers bound the warps per SM (`occupancy`).

Everything here is plain arithmetic on shapes: it runs on any machine, no GPU needed.

References: MLX mlx/backend/cuda/custom_kernel.cpp (grid in threads, template constants); MLX
mlx/backend/metal/kernels/quantized.h `qdot` (scale and bias per group, sum of x); the magic-number
int-to-float conversion, as used for 4-bit weights in FasterTransformer (Kim et al., "Who Says Elephants
Can't Run", 2022); CUDA C++ Programming Guide, compute capability 9.0 limits (2048 threads, 32 blocks, 64K
registers per SM); PTX ISA `ld` cache hints.
See chapter: dispatch-kernel
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from ref_impl.kernels.cuda import FUSES

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
