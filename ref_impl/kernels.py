"""Custom CUDA kernels for the decode path: a bandwidth-bound GEMV, written with `mx.fast.cuda_kernel`.

Decoding one token multiplies each weight matrix W (n outputs, k inputs) by one activation row: a
GEMV, y = W x. It does 2 flops per weight read, far below any GPU's flops-to-bytes ridge, so its time
is the time to read W, and the decoder's speed is the sum of those reads. These kernels read MLX's
affine layout (`mx.quantize`: uint32 words of 4- or 8-bit codes, value 0 in the lowest bits, and a
scale and bias per group of 32, 64 or 128 inputs: w = scale * q + bias) and float16/bfloat16
matrices, for 1 activation row (decode) or 2-9 (speculative verification), accumulating in float32.

Design (one launch, `Launch` below):
- A block of `threads` threads owns `rows_per_block` (R) consecutive weight rows and walks their k
  inputs together: thread t reads 16-byte chunks t, t + threads, ... of every row, so each warp
  instruction loads 512 contiguous bytes (coalesced 128-bit loads), `unroll` chunks per row in flight.
  Weights are loaded with ld.global.nc.L1::no_allocate (read once; L1 keeps x, which every block reads).
- A chunk of a 4-bit matrix holds 32 codes of one group (8-bit: 16 codes). Codes become exact floats
  without int-to-float conversion instructions (which issue at a fraction of the FMA rate, CUDA
  Programming Guide, throughput table): OR the code into the mantissa of 2^23 and subtract 2^23 (for
  4-bit codes left in place, shifted by 16^j, one FMA undoes both). The group's scale and
  bias are applied once per chunk: sum_i (s q_i + b) x_i = s sum_i q_i x_i + b sum_i x_i, as MLX's
  own Metal qdot does. x is read as 16-byte vectors and converted once per chunk for all R rows.
- Partial sums (R x rows floats per thread) are reduced with warp shuffles (__shfl_xor_sync), then
  across the block's warps through shared memory; one thread per (row, output) writes T.
- Pointers that are not 16-byte aligned (a sliced input) take a path with 2-byte loads, same results.
Bytes per launch (`Launch.bytes`): the weights, scales and biases once, x and y once; x is re-read
from L1/L2 by every block. Registers bound the blocks per SM (`occupancy`).

Dispatch: `patch(model)` swaps each nn.Linear and affine nn.QuantizedLinear for a `GEMVLinear` with the
same parameters. On MLX's CUDA backend a short measurement per (format, shape, rows) on the model's own
weights picks the fastest of a few launches and MLX's built-in, and records it; other row counts,
other backends (CPU; Metal, where MLX's quantized kernels are already strong) and tied embeddings keep
MLX's built-ins. The CUDA tests check that greedy tokens match the built-ins' except at near ties.

Status (for the session that reads the first H200 log): written without a GPU. The CUDA source compiles
with nvcc 13.0 for sm_90a (ptxas: no spills; registers in `occupancy`) and ran in a CPU emulation of
its threads, warps and shared memory against a float64 oracle (every format, 1-9 rows, odd sizes,
misaligned inputs). Not yet compiled by MLX's NVRTC nor timed: read `python3 tests/test_kernels.py`
(each case's error against the float32 bound; the first call's time includes NVRTC) and `python -m
ref_impl bench --kernels` (GB/s per shape and launch against the built-in; decode with and without).
Not done: fused QKV and gate/up+SiLU kernels (issue 9: only if measurement shows a gain), and the LM
head of tied-embedding models (it stays MLX's).

References: MLX docs "Custom Metal Kernels" and mlx/backend/cuda/custom_kernel.cpp (grid in threads,
generated signature `x_shape`, template constants); MLX mlx/backend/metal/kernels/quantized.h `qdot`
(scale and bias per group, sum of x); the magic-number int-to-float conversion, as used for 4-bit
weights in FasterTransformer (Kim et al., "Who Says Elephants Can't Run", 2022); CUDA C++ Programming Guide, compute
capability 9.0 limits (2048 threads, 32 blocks, 64K registers per SM); PTX ISA `ld` cache hints.
See chapter: dispatch
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

MAX_ROWS = 9                  # activation rows a GEMV serves: decode (1) and speculative verification (2-9)
MAX_ACCUMULATORS = 16         # rows_per_block x rows partial sums a thread keeps in registers
GROUP_SIZES = (32, 64, 128)
THREADS = (64, 128, 256, 512)
H200_SMS = 132                # streaming multiprocessors of an H200 (and H100 SXM)
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
    """One GEMV launch: y (rows, n) = x (rows, k) @ W(n, k).T in `fmt`, by blocks of `threads` threads that
    each own `rows_per_block` weight rows and keep `unroll` 16-byte loads per row in flight."""
    fmt: Format
    n: int
    k: int
    rows: int
    threads: int
    rows_per_block: int
    unroll: int = 2

    @property
    def blocks(self) -> int:
        return -(-self.n // self.rows_per_block)

    @property
    def grid(self) -> tuple[int, int, int]:
        return (self.threads * self.blocks, 1, 1)    # MLX takes the grid in threads, as Metal does

    @property
    def threadgroup(self) -> tuple[int, int, int]:
        return (self.threads, 1, 1)

    @property
    def loads_per_thread(self) -> int:
        """16-byte weight loads one thread issues (over all its rows)."""
        return -(-self.k // self.fmt.values_per_load // self.threads) * self.rows_per_block

    @property
    def bytes(self) -> int:
        """Bytes one launch must move at least: the weights once, x (rows, k) and y (rows, n)."""
        return self.fmt.weight_bytes(self.n, self.k) + 2 * self.rows * (self.k + self.n)

    @property
    def label(self) -> str:
        return f"ours threads={self.threads} rows/block={self.rows_per_block} unroll={self.unroll}"

    @property
    def template(self) -> list[tuple[str, object]]:
        t = [("T", DTYPES[self.fmt.dtype]), ("M", self.rows), ("R", self.rows_per_block),
             ("BT", self.threads), ("U", self.unroll)]
        return t if self.fmt.bits == 16 else t + [("BITS", self.fmt.bits), ("GROUP", self.fmt.group_size)]


def launch_config(fmt: Format, n: int, k: int, rows: int, threads: int = 128, rows_per_block: int | None = None,
                  unroll: int = 2, sms: int = H200_SMS) -> Launch:
    """The launch for one GEMV. Default rows per block: the largest of 4, 2, 1 that keeps
    rows_per_block x rows <= MAX_ACCUMULATORS registers of partial sums and at least 4 blocks per SM
    (so loads from several blocks hide the memory latency). Raises ValueError for shapes it cannot run."""
    if n < 1 or k < 1:
        raise ValueError(f"GEMV shape must be positive, got n={n}, k={k}")
    step = fmt.group_size or fmt.values_per_load
    if k % step:
        raise ValueError(f"k={k} is not a multiple of {step} ({'the group size' if fmt.group_size else '16 bytes'})")
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"rows={rows}: the GEMV kernels take 1 to {MAX_ROWS} activation rows")
    if threads not in THREADS:
        raise ValueError(f"threads={threads}: choose one of {THREADS}")
    if unroll not in (1, 2, 4):
        raise ValueError(f"unroll={unroll}: choose 1, 2 or 4")
    if rows_per_block is None:
        rows_per_block = next(r for r in (4, 2, 1)
                              if r == 1 or (r * rows <= MAX_ACCUMULATORS and -(-n // r) >= 4 * sms))
    if rows_per_block not in (1, 2, 4, 8) or (rows_per_block > 1 and rows_per_block * rows > MAX_ACCUMULATORS):
        raise ValueError(f"rows_per_block={rows_per_block} with rows={rows}: need 1, 2, 4 or 8 and "
                         f"rows_per_block x rows <= {MAX_ACCUMULATORS}")
    return Launch(fmt, n, k, rows, threads, rows_per_block, unroll)


def candidates(fmt: Format, n: int, k: int, rows: int) -> list[Launch]:
    """The launches a measurement chooses among, the default first: for one row its neighbours in threads,
    rows per block and unroll; for 2-9 rows (each a kernel to compile) only in rows per block."""
    grid = ((128, None, 2), (128, 1, 2), (128, 2, 2), (128, 4, 2), (256, 2, 2), (64, 4, 2), (128, 2, 4))
    out = []
    for threads, r, unroll in grid if rows == 1 else grid[:4]:
        try:
            launch = launch_config(fmt, n, k, rows, threads, r, unroll)
        except ValueError:
            continue
        if launch not in out:
            out.append(launch)
    return out


@dataclass(frozen=True)
class Occupancy:
    """Residency of one launch on a GPU of `sms` SMs (compute capability 9.0 limits)."""
    blocks_per_sm: int
    warps_per_sm: int
    fraction: float               # resident warps / 64
    waves: float                  # blocks / (blocks_per_sm x sms)
    bytes_in_flight_per_sm: int   # resident threads x the 16-byte weight loads each issues before computing


def occupancy(launch: Launch, registers: int, sms: int = H200_SMS) -> Occupancy:
    """Blocks resident per SM given the registers per thread (ptxas -v): the least of 2048 threads,
    32 blocks and 65536 registers (allocated per warp in units of 256) per SM. ptxas 13.0 for sm_90a
    gave 43 / 68 / 108 registers for 4-bit, 1 row, 1 / 2 / 4 rows per block, unroll 2 (105 for 2 rows
    unroll 4; 177 for 4 rows x 4 rows per block), 32 / 40 / 64 for float16; no spills."""
    if registers < 1 or registers > 255:
        raise ValueError(f"registers={registers}: a thread has 1 to 255")
    per_warp = -(-registers * 32 // 256) * 256
    blocks = min(2048 // launch.threads, 32, 65536 // (per_warp * launch.threads // 32))
    warps = blocks * launch.threads // 32
    per_thread = launch.loads_per_thread // launch.rows_per_block      # chunks of each row a thread reads
    return Occupancy(blocks, warps, warps / 64, launch.blocks / (max(blocks, 1) * sms),
                     blocks * launch.threads * 16 * launch.rows_per_block * min(launch.unroll, per_thread))


# --- the CUDA source ------------------------------------------------------------------------------------

_HEADER = r"""
namespace ref_gemv {

// 16 bytes of weights, read once: ld.global.nc with no L1 allocation, so L1 keeps x
template <bool ALIGNED>
__device__ __forceinline__ uint4 load_weights(const void* p) {
  uint4 v;
  if constexpr (ALIGNED) {
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  } else {
    const unsigned short* h = reinterpret_cast<const unsigned short*>(p);
    v = make_uint4(h[0] | (uint32_t(h[1]) << 16), h[2] | (uint32_t(h[3]) << 16),
                   h[4] | (uint32_t(h[5]) << 16), h[6] | (uint32_t(h[7]) << 16));
  }
  return v;
}

// 8 or 4 activations (16 or 8 bytes), through the cache: every block reads x
template <bool ALIGNED>
__device__ __forceinline__ uint4 load_x16(const void* p) {
  if constexpr (ALIGNED) {
    return __ldg(reinterpret_cast<const uint4*>(p));
  } else {
    const unsigned short* h = reinterpret_cast<const unsigned short*>(p);
    return make_uint4(h[0] | (uint32_t(h[1]) << 16), h[2] | (uint32_t(h[3]) << 16),
                      h[4] | (uint32_t(h[5]) << 16), h[6] | (uint32_t(h[7]) << 16));
  }
}

template <bool ALIGNED>
__device__ __forceinline__ uint2 load_x8(const void* p) {
  if constexpr (ALIGNED) {
    return __ldg(reinterpret_cast<const uint2*>(p));
  } else {
    const unsigned short* h = reinterpret_cast<const unsigned short*>(p);
    return make_uint2(h[0] | (uint32_t(h[1]) << 16), h[2] | (uint32_t(h[3]) << 16));
  }
}

__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// two 16-bit floats packed in a word, low half first
template <typename T> __device__ __forceinline__ float2 to_float2(uint32_t v);
template <> __device__ __forceinline__ float2 to_float2<__half>(uint32_t v) {
  return __half22float2(__halves2half2(__ushort_as_half((unsigned short)(v & 0xFFFFu)),
                                       __ushort_as_half((unsigned short)(v >> 16))));
}
template <> __device__ __forceinline__ float2 to_float2<__nv_bfloat16>(uint32_t v) {
  return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xFFFF0000u));
}

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

template <typename T>
__device__ __forceinline__ void unpack(const uint4& u, float (&f)[8]) {
  #pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 p = to_float2<T>(word(u, i));
    f[2 * i] = p.x;
    f[2 * i + 1] = p.y;
  }
}

template <typename T>
__device__ __forceinline__ void unpack(const uint2& u, float (&f)[4]) {
  const float2 a = to_float2<T>(u.x), b = to_float2<T>(u.y);
  f[0] = a.x; f[1] = a.y; f[2] = b.x; f[3] = b.y;
}

// Eight 4-bit codes (code e in bits 4e..4e+3) as exact floats. OR-ing a code c shifted by 16^j into the
// mantissa of 2^23 (0x4B000000) gives the float 2^23 + c 16^j (exact while c 16^j < 2^23: j <= 4);
// one FMA by 16^-j, minus 2^23 16^-j, leaves c. Codes 5-7 come from the word shifted right by 20.
__device__ __forceinline__ void decode(uint32_t v, float (&q)[8]) {
  #pragma unroll
  for (int e = 0; e < 8; ++e) {
    const int j = e < 5 ? e : e - 5;
    const uint32_t src = e < 5 ? v : v >> 20;
    const float inv = 1.0f / float(1u << (4 * j));
    q[e] = fmaf(__uint_as_float((src & (0xFu << (4 * j))) | 0x4B000000u), inv, -8388608.0f * inv);
  }
}

// Four 8-bit codes: a byte permute builds 0x4B0000cc, the float 2^23 + c.
__device__ __forceinline__ void decode(uint32_t v, float (&q)[4]) {
  #pragma unroll
  for (int e = 0; e < 4; ++e) {
    q[e] = __uint_as_float(__byte_perm(v, 0x4B000000u, 0x7440u | e)) - 8388608.0f;
  }
}

// Sum each thread's partials over the block; thread r*M+m writes y[m, row0 + r].
template <typename T, int R, int M, int BT>
__device__ __forceinline__ void store(float (&tot)[R][M], T* out, int row0, int n) {
  __shared__ float part[BT / 32][R * M];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  #pragma unroll
  for (int r = 0; r < R; ++r) {
    #pragma unroll
    for (int m = 0; m < M; ++m) {
      float v = tot[r][m];
      #pragma unroll
      for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
      if (lane == 0) part[warp][r * M + m] = v;
    }
  }
  __syncthreads();
  if (threadIdx.x < R * M) {
    const int r = threadIdx.x / M, m = threadIdx.x % M;
    float v = 0.0f;
    #pragma unroll
    for (int i = 0; i < BT / 32; ++i) v += part[i][threadIdx.x];
    if (row0 + r < n) out[(int64_t)m * n + row0 + r] = from_float<T>(v);
  }
}

// y (M, n) = x (M, k) W^T, W in MLX's affine layout: w (n, k*BITS/32) uint32, scales and biases (n, k/GROUP).
template <bool ALIGNED, typename T, int BITS, int GROUP, int M, int R, int BT, int U>
__device__ __forceinline__ void affine(const T* x, const uint32_t* w, const T* scales, const T* biases,
                                       T* out, int n, int k) {
  constexpr int V = 32 / BITS;                 // codes per word
  constexpr int CV = 4 * V;                    // codes per 16-byte chunk, all in one group
  const int chunks = k / CV, words = k / V, groups = k / GROUP;
  const int row0 = blockIdx.x * R;
  float tot[R][M];
  #pragma unroll
  for (int r = 0; r < R; ++r) {
    #pragma unroll
    for (int m = 0; m < M; ++m) tot[r][m] = 0.0f;
  }
  for (int c0 = threadIdx.x; c0 < chunks; c0 += U * BT) {
    uint4 wq[U][R];
    float s[U][R], b[U][R];
    #pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + u * BT;
      #pragma unroll
      for (int r = 0; r < R; ++r) {
        const int64_t row = row0 + r < n ? row0 + r : n - 1;   // a last block's spare rows re-read row n-1
        if (c < chunks) {
          wq[u][r] = load_weights<ALIGNED>(w + row * words + 4 * c);
          s[u][r] = to_float(scales[row * groups + c * CV / GROUP]);
          b[u][r] = to_float(biases[row * groups + c * CV / GROUP]);
        } else {
          wq[u][r] = make_uint4(0u, 0u, 0u, 0u);
          s[u][r] = 0.0f;
          b[u][r] = 0.0f;
        }
      }
    }
    #pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + u * BT;
      if (c < chunks) {
        float acc[R][M], xs[M];
        #pragma unroll
        for (int m = 0; m < M; ++m) {
          xs[m] = 0.0f;
          #pragma unroll
          for (int r = 0; r < R; ++r) acc[r][m] = 0.0f;
        }
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
          float q[R][V];
          #pragma unroll
          for (int r = 0; r < R; ++r) decode(word(wq[u][r], i), q[r]);
          #pragma unroll
          for (int m = 0; m < M; ++m) {
            float xv[V];
            const T* xp = x + (int64_t)m * k + c * CV + i * V;
            if constexpr (V == 8) unpack<T>(load_x16<ALIGNED>(xp), xv);
            else unpack<T>(load_x8<ALIGNED>(xp), xv);
            #pragma unroll
            for (int e = 0; e < V; ++e) xs[m] += xv[e];
            #pragma unroll
            for (int r = 0; r < R; ++r) {
              #pragma unroll
              for (int e = 0; e < V; ++e) acc[r][m] = fmaf(q[r][e], xv[e], acc[r][m]);
            }
          }
        }
        #pragma unroll
        for (int r = 0; r < R; ++r) {
          #pragma unroll
          for (int m = 0; m < M; ++m) tot[r][m] = fmaf(s[u][r], acc[r][m], fmaf(b[u][r], xs[m], tot[r][m]));
        }
      }
    }
  }
  store<T, R, M, BT>(tot, out, row0, n);
}

// y (M, n) = x (M, k) W^T, W (n, k) dense in T.
template <bool ALIGNED, typename T, int M, int R, int BT, int U>
__device__ __forceinline__ void dense(const T* x, const T* w, T* out, int n, int k) {
  const int chunks = k / 8;
  const int row0 = blockIdx.x * R;
  float tot[R][M];
  #pragma unroll
  for (int r = 0; r < R; ++r) {
    #pragma unroll
    for (int m = 0; m < M; ++m) tot[r][m] = 0.0f;
  }
  for (int c0 = threadIdx.x; c0 < chunks; c0 += U * BT) {
    uint4 wq[U][R];
    #pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + u * BT;
      #pragma unroll
      for (int r = 0; r < R; ++r) {
        const int64_t row = row0 + r < n ? row0 + r : n - 1;
        wq[u][r] = c < chunks ? load_weights<ALIGNED>(w + row * k + 8 * c) : make_uint4(0u, 0u, 0u, 0u);
      }
    }
    #pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + u * BT;
      if (c < chunks) {
        float wv[R][8];
        #pragma unroll
        for (int r = 0; r < R; ++r) unpack<T>(wq[u][r], wv[r]);
        #pragma unroll
        for (int m = 0; m < M; ++m) {
          float xv[8];
          unpack<T>(load_x16<ALIGNED>(x + (int64_t)m * k + 8 * c), xv);
          #pragma unroll
          for (int r = 0; r < R; ++r) {
            #pragma unroll
            for (int e = 0; e < 8; ++e) tot[r][m] = fmaf(wv[r][e], xv[e], tot[r][m]);
          }
        }
      }
    }
  }
  store<T, R, M, BT>(tot, out, row0, n);
}

}  // namespace ref_gemv
"""

_AFFINE_SOURCE = """
  const int n = w_shape[0], k = x_shape[1];
  if (((uintptr_t)x | (uintptr_t)w) % 16 == 0) {
    ::ref_gemv::affine<true, T, BITS, GROUP, M, R, BT, U>(x, w, scales, biases, out, n, k);
  } else {
    ::ref_gemv::affine<false, T, BITS, GROUP, M, R, BT, U>(x, w, scales, biases, out, n, k);
  }
"""

_DENSE_SOURCE = """
  const int n = w_shape[0], k = x_shape[1];
  if (((uintptr_t)x | (uintptr_t)w) % 16 == 0) {
    ::ref_gemv::dense<true, T, M, R, BT, U>(x, w, out, n, k);
  } else {
    ::ref_gemv::dense<false, T, M, R, BT, U>(x, w, out, n, k);
  }
"""


def on_cuda() -> bool:
    """True when MLX runs on its CUDA backend: the only place these kernels run."""
    return mx.cuda.is_available() and mx.default_device() == mx.gpu


@functools.cache
def _kernel(dense: bool):
    if dense:
        return mx.fast.cuda_kernel(name="ref_gemv_dense", input_names=["x", "w"], output_names=["out"],
                                   source=_DENSE_SOURCE, header=_HEADER)
    return mx.fast.cuda_kernel(name="ref_gemv_affine", input_names=["x", "w", "scales", "biases"],
                               output_names=["out"], source=_AFFINE_SOURCE, header=_HEADER)


def _launch_for(fmt: Format, x: mx.array, n: int, launch: Launch | None) -> tuple[mx.array, Launch]:
    """x as (rows, k) and the launch, checked against each other."""
    k = x.shape[-1]
    rows = x.size // k if k else 0
    if launch is None:
        launch = launch_config(fmt, n, k, rows)
    elif (launch.fmt, launch.n, launch.k, launch.rows) != (fmt, n, k, rows):
        raise ValueError(f"launch for {launch.fmt.name} ({launch.rows}, {launch.k}) x ({launch.n}, {launch.k}) "
                         f"used for {fmt.name} ({rows}, {k}) x ({n}, {k})")
    if not on_cuda():
        raise RuntimeError(f"the GEMV kernels need MLX's CUDA backend; this is {mx.default_device()} "
                           "(use mx.quantized_matmul or matmul)")
    return x.reshape(rows, k), launch


def affine_gemv(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int,
                launch: Launch | None = None) -> mx.array:
    """x (..., k) @ dequantize(w, scales, biases).T for MLX's affine layout, as
    mx.quantized_matmul(x, w, scales, biases, transpose=True) but accumulated in float32; 1 to 9 rows."""
    if x.dtype not in DTYPES.values():
        raise ValueError(f"unsupported activation dtype {x.dtype}: the kernels take float16 or bfloat16")
    fmt = Format(bits, group_size, dtype_name(x.dtype))
    if w.dtype != mx.uint32 or w.ndim != 2:
        raise ValueError(f"w must be uint32 (n, k * bits / 32) codes, got {w.dtype} of shape {w.shape}")
    n, k = w.shape[0], w.shape[1] * 32 // bits
    if x.ndim < 1 or x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1] if x.ndim else 0} features, the {bits}-bit codes w {w.shape} hold {k}")
    for name, a in (("scales", scales), ("biases", biases)):
        if a.shape != (n, k // group_size) or a.dtype != x.dtype:
            raise ValueError(f"{name} must be {x.dtype} of shape {(n, k // group_size)}, got {a.dtype} {a.shape}")
    x2, launch = _launch_for(fmt, x, n, launch)
    y = _kernel(False)(inputs=[x2, w, scales, biases], template=launch.template, grid=launch.grid,
                       threadgroup=launch.threadgroup, output_shapes=[(launch.rows, n)], output_dtypes=[x.dtype])[0]
    return y.reshape(*x.shape[:-1], n)


def dense_gemv(x: mx.array, w: mx.array, launch: Launch | None = None) -> mx.array:
    """x (..., k) @ w.T for a float16/bfloat16 matrix w (n, k), accumulated in float32; 1 to 9 rows."""
    if x.dtype not in DTYPES.values():
        raise ValueError(f"unsupported activation dtype {x.dtype}: the kernels take float16 or bfloat16")
    if w.ndim != 2 or w.dtype != x.dtype:
        raise ValueError(f"w must be a {x.dtype} matrix (n, k), got {w.dtype} of shape {w.shape}")
    if x.ndim < 1 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"x has {x.shape[-1] if x.ndim else 0} features, w {w.shape} takes {w.shape[1]}")
    x2, launch = _launch_for(Format(16, 0, dtype_name(x.dtype)), x, w.shape[0], launch)
    y = _kernel(True)(inputs=[x2, w], template=launch.template, grid=launch.grid, threadgroup=launch.threadgroup,
                      output_shapes=[(launch.rows, w.shape[0])], output_dtypes=[x.dtype])[0]
    return y.reshape(*x.shape[:-1], w.shape[0])


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


class GEMVLinear(nn.Module):
    """An nn.Linear / affine nn.QuantizedLinear (same parameters, same names) whose calls with a row count
    in `launches` run our kernel; every other call runs MLX's built-in, as the layer it replaces did."""

    def __init__(self, layer: nn.Module, fmt: Format):
        super().__init__()
        self.fmt = fmt
        self.weight = layer.weight
        if fmt.bits != 16:
            self.scales, self.biases = layer.scales, layer.biases
        if "bias" in layer:
            self.bias = layer.bias
        self._launches: dict[int, Launch] = {}   # rows -> launch; the underscore keeps it out of parameters

    @property
    def shape(self) -> tuple[int, int]:
        """(n, k): outputs and inputs."""
        n, cols = self.weight.shape
        return n, cols * 32 // self.fmt.bits if self.fmt.bits != 16 else cols

    def use(self, rows: int, launch: Launch | None) -> None:
        """Run calls of `rows` activation rows with `launch` (None: MLX's built-in)."""
        if launch is None:
            self._launches.pop(rows, None)
        else:
            self._launches[rows] = launch

    def builtin(self, x: mx.array) -> mx.array:
        """MLX's own matmul, as the replaced layer computed it."""
        if self.fmt.bits == 16:
            return x @ self.weight.T
        return mx.quantized_matmul(x, self.weight, self.scales, self.biases, transpose=True,
                                   group_size=self.fmt.group_size, bits=self.fmt.bits)

    def kernel(self, x: mx.array, launch: Launch) -> mx.array:
        """Our GEMV with this launch."""
        if self.fmt.bits == 16:
            return dense_gemv(x, self.weight, launch)
        return affine_gemv(x, self.weight, self.scales, self.biases, self.fmt.group_size, self.fmt.bits, launch)

    def __call__(self, x: mx.array) -> mx.array:
        launch = self._launches.get(x.size // x.shape[-1]) if x.dtype == DTYPES[self.fmt.dtype] else None
        y = self.builtin(x) if launch is None else self.kernel(x, launch)
        return y + self.bias if "bias" in self else y


def _seconds(fn: Callable[[], list], reps: int) -> float:
    """Best wall time of mx.eval(fn()) over reps, after one warm-up call (which compiles)."""
    mx.eval(fn())
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(fn())
        best = min(best, time.perf_counter() - t0)
    return best


@dataclass
class Choice:
    """What a measurement chose for one (format, shape, rows): a launch or MLX's built-in (None), and the
    seconds per GEMV of every variant timed (failed variants: their error)."""
    fmt: Format
    n: int
    k: int
    rows: int
    layers: int
    launch: Launch | None
    seconds: dict[str, float] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


BUILTIN = "mlx built-in"


def time_variants(layers: Sequence[GEMVLinear], rows: int, launches: Sequence[Launch], reps: int = 5,
                  min_bytes: int = 256 << 20, seed: int = 0) -> tuple[dict[str, float], dict[str, str]]:
    """Seconds per GEMV of MLX's built-in and of each launch, over all `layers` (same format and shape)
    in turn, repeated until min_bytes of weights are read per timing (more than the L2 cache holds).
    A launch that fails (a compile error) is reported in the second dict instead of timed."""
    n, k = layers[0].shape
    x = (mx.random.normal((rows, k), key=mx.random.key(seed)) * 0.1).astype(DTYPES[layers[0].fmt.dtype])
    passes = max(1, min(64, -(-min_bytes // (len(layers) * layers[0].fmt.weight_bytes(n, k)))))
    calls = passes * len(layers)
    seconds = {BUILTIN: _seconds(lambda: [m.builtin(x) for _ in range(passes) for m in layers], reps) / calls}
    errors = {}
    for launch in launches:
        try:
            seconds[launch.label] = _seconds(lambda: [m.kernel(x, launch) for _ in range(passes) for m in layers],
                                             reps) / calls
        except RuntimeError as e:     # MLX raises NVRTC's compile log as a RuntimeError at eval
            errors[launch.label] = str(e)
    return seconds, errors


def patch(model: nn.Module, rows: Sequence[int] = (1,), measure: bool = True) -> list[Choice]:
    """Swap every nn.Linear / affine nn.QuantizedLinear the kernels can run for a GEMVLinear. On MLX's CUDA
    backend, per (format, shape) and row count in `rows`, choose our fastest launch or MLX's built-in by
    timing them on the model's own weights (measure=False: launch_config's default, untimed). Elsewhere
    nothing is chosen and every call stays MLX's built-in. Returns the choices, for results."""
    if not rows or any(not 1 <= r <= MAX_ROWS for r in rows):
        raise ValueError(f"rows {list(rows)}: each must be 1 to {MAX_ROWS}")
    swaps = [(name, GEMVLinear(m, fmt)) for name, m in model.named_modules() if (fmt := format_of(m)) is not None]
    model.update_modules(tree_unflatten(swaps))
    groups: dict[tuple[Format, int, int], list[GEMVLinear]] = {}
    for _, m in swaps:
        groups.setdefault((m.fmt, *m.shape), []).append(m)
    choices = []
    for (fmt, n, k), layers in groups.items() if on_cuda() else ():
        for r in rows:
            try:
                launches = candidates(fmt, n, k, r) if measure else [launch_config(fmt, n, k, r)]
            except ValueError:     # k the kernels cannot tile (e.g. not a multiple of 8): built-in
                choices.append(Choice(fmt, n, k, r, len(layers), None))
                continue
            choice = Choice(fmt, n, k, r, len(layers), launches[0])
            if measure:
                choice.seconds, choice.errors = time_variants(layers, r, launches)
                best = min(choice.seconds, key=choice.seconds.get)
                choice.launch = next((la for la in launches if la.label == best), None)
            for m in layers:
                m.use(r, choice.launch)
            choices.append(choice)
    return choices


VIEWS = frozenset({"Broadcast", "Reshape", "Flatten", "Unflatten", "ExpandDims", "Squeeze", "Transpose",
                   "Slice", "AsStrided"})


def count_kernels(model: nn.Module, context: int = 8) -> int:
    """Compute primitives in the graph of one decode step (views excluded): about the kernels MLX
    launches per token on this device (a fused or compiled primitive counts once)."""
    cache = model.make_cache(context + 1)
    mx.eval(model(mx.zeros((1, context), dtype=mx.int32), cache))
    logits = model(mx.zeros((1, 1), dtype=mx.int32), cache)
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
    MLX's built-in and of each candidate launch (over enough random copies of the matrix that they do
    not fit in L2), our best launch's speedup and its largest difference from the built-in's output;
    a launch that fails to compile gives a "compile_error" record with MLX's message instead."""
    records = []
    for fmt in formats:
        for n, k in shapes:
            copies = max(1, min(64, -(-min_bytes // fmt.weight_bytes(n, k))))
            layers = [random_layer(fmt, n, k, seed + i) for i in range(copies)]
            for r in rows:
                launches = candidates(fmt, n, k, r)
                seconds, errors = time_variants(layers, r, launches, reps, min_bytes, seed)
                base = {"experiment": "gemv", "model": model, "weights": fmt.name, "kv": None, "context": None,
                        "samples": [], "peer": None, "shape": [n, k], "rows": r, "bytes": launches[0].bytes,
                        "copies": copies}
                for label, s in seconds.items():
                    records += [{**base, "variant": label, "metric": "bandwidth", "unit": "GB/s",
                                 "value": launches[0].bytes / s / 1e9},
                                {**base, "variant": label, "metric": "time_us", "unit": "us", "value": s * 1e6}]
                records += [{**base, "variant": label, "metric": "compile_error", "unit": None, "value": None,
                             "note": e[-2000:]} for label, e in errors.items()]
                ours = {la.label: la for la in launches if la.label in seconds}
                if ours:
                    best = min(ours, key=seconds.get)
                    x = (mx.random.normal((r, k), key=mx.random.key(seed)) * 0.1).astype(DTYPES[fmt.dtype])
                    ref = layers[0].builtin(x).astype(mx.float32)
                    diff = mx.abs(layers[0].kernel(x, ours[best]).astype(mx.float32) - ref).max().item()
                    records += [{**base, "variant": best, "metric": "speedup", "unit": "x",
                                 "value": seconds[BUILTIN] / seconds[best]},
                                {**base, "variant": best, "metric": "max_abs_diff", "unit": None, "value": diff,
                                 "note": f"vs the built-in, whose outputs reach {mx.abs(ref).max().item():.3g}"}]
            del layers
    return records
