"""The CUDA C++ source of the GEMV kernels, as MLX's `mx.fast.cuda_kernel` takes it: a header of device
functions (namespace ref_gemv) and, per kernel, a body that MLX wraps in a signature of its input and output
names and template constants. launch.py says what the kernels do and how they are launched, layers.py calls
them; this module is the text they are compiled from (NVRTC, at first use), with the names and bodies it needs.

See chapter: dispatch-kernel
"""

from __future__ import annotations

import re

FUSES = ("", "glu", "qkv")   # one matrix; gate and up with the SiLU product; q, k and v side by side


def input_names(dense: bool, fuse: str = "") -> list[str]:
    """The kernel's inputs: x, then per matrix w (and s, b for affine codes)."""
    mats = 3 if fuse == "qkv" else 2 if fuse == "glu" else 1
    return ["x"] + [f"{a}{i}" for i in range(mats) for a in (("w",) if dense else ("w", "s", "b"))]


HEADER = r"""
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

// 8 or 4 activations (16 or 8 bytes), through the cache: every warp reads x
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

// Eight 4-bit codes (code e in bits 4e..4e+3) as floats that carry an offset, with no int-to-float conversion:
// OR-ed into the mantissa of 2048.0 at bits 12-15 a code c makes the float 2048 + c, into 128.0 at bits 16-19
// 128 + c. An x of T times either is exact in float32 (11 + 12 significant bits at most), so the dot sums x f
// and the offsets leave once per chunk (affine below). The word as it is, shifted by 8 either way, or rotated
// by 16 holds two codes in place each: odd codes land at bits 12-15, even ones at 16-19. That is 2.4 lane
// operations a code, where subtracting the offset before the multiply took 3.
__device__ __forceinline__ void decode(uint32_t v, float (&q)[8]) {
  const uint32_t l8 = v << 8, r8 = v >> 8, rot = __funnelshift_l(v, v, 16);
  q[0] = __uint_as_float((rot & 0xF0000u) | 0x43000000u);
  q[1] = __uint_as_float((l8 & 0xF000u) | 0x45000000u);
  q[2] = __uint_as_float((l8 & 0xF0000u) | 0x43000000u);
  q[3] = __uint_as_float((v & 0xF000u) | 0x45000000u);
  q[4] = __uint_as_float((v & 0xF0000u) | 0x43000000u);
  q[5] = __uint_as_float((r8 & 0xF000u) | 0x45000000u);
  q[6] = __uint_as_float((r8 & 0xF0000u) | 0x43000000u);
  q[7] = __uint_as_float((rot & 0xF000u) | 0x45000000u);
}

// Four 8-bit codes: a byte permute builds 0x4B0000cc, the float 2^23 + c.
__device__ __forceinline__ void decode(uint32_t v, float (&q)[4]) {
  #pragma unroll
  for (int e = 0; e < 4; ++e) {
    q[e] = __uint_as_float(__byte_perm(v, 0x4B000000u, 0x7440u | e)) - 8388608.0f;
  }
}

// A chunk's sum_i (s q_i + b) x_i = s sum_i q_i x_i + b sum_i x_i (as MLX's Metal qdot), from acc = sum_i f_i x_i
// over what decode made of the codes and the chunk's sums of x at even and odd positions: 4-bit codes come
// with offsets 128 (even) and 2048 (odd), which leave here; 8-bit codes are exact.
template <int BITS>
__device__ __forceinline__ float affine(float s, float b, float acc, float xeven, float xodd) {
  if constexpr (BITS == 4) acc -= fmaf(2048.0f, xodd, 128.0f * xeven);
  return fmaf(s, acc, b * (xeven + xodd));
}

__device__ __forceinline__ float warp_sum(float v) {
  #pragma unroll
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
  return v;
}

// One weight matrix's arrays: codes (or the dense matrix) w, and for affine codes a scale and bias per group.
template <typename W, typename T>
struct Mat {
  const W* w;
  const T* s;
  const T* b;
};

// Reduce a warp's partial sums; lane r*M+m writes y[m, row0 + r] (GLU: silu(gate row r) * up row r).
template <typename T, int RW, int M, bool GLU>
__device__ __forceinline__ void store(float (&tot)[RW][M], T* out, int row0, int n, int lane) {
  constexpr int R = GLU ? RW / 2 : RW;
  float mine = 0.0f;
  #pragma unroll
  for (int r = 0; r < R; ++r) {
    #pragma unroll
    for (int m = 0; m < M; ++m) {
      float v = warp_sum(tot[r][m]);
      if constexpr (GLU) {
        v = v / (1.0f + expf(-v)) * warp_sum(tot[r + R][m]);
      }
      if (lane == r * M + m) mine = v;
    }
  }
  const int r = lane / M, m = lane % M;
  if (lane < R * M && row0 + r < n) out[(int64_t)m * n + row0 + r] = from_float<T>(mine);
}

// One warp: y (M, n) rows row0..row0+R-1 of x (M, k) W^T, W in MLX's affine layout (w (n, k*BITS/32)
// uint32, scales and biases (n, k/GROUP)). Lane l reads 16-byte chunks l, l+32, ... of each of its rows,
// U chunks per row in flight; GLU reads R rows of a (gate) and the same R rows of a2 (up).
template <bool ALIGNED, typename T, int BITS, int GROUP, int M, int R, int U, bool GLU>
__device__ __forceinline__ void affine_rows(const T* x, Mat<uint32_t, T> a, Mat<uint32_t, T> a2, T* out,
                                            int n, int k, int row0) {
  constexpr int V = 32 / BITS;                 // codes per word
  constexpr int CV = 4 * V;                    // codes per 16-byte chunk, all in one group
  constexpr int RW = GLU ? 2 * R : R;          // weight rows
  if (row0 >= n) return;                       // the whole warp: no barrier follows
  const int lane = threadIdx.x % 32;
  const int chunks = k / CV, words = k / V, groups = k / GROUP;
  const uint32_t* wr[RW];
  const T* sr[RW];
  const T* br[RW];
  #pragma unroll
  for (int r = 0; r < RW; ++r) {
    const Mat<uint32_t, T>& src = (GLU && r >= R) ? a2 : a;
    const int rr = row0 + (r % R);
    const int64_t row = rr < n ? rr : n - 1;    // a last warp's spare rows re-read row n-1
    wr[r] = src.w + row * words;
    sr[r] = src.s + row * groups;
    br[r] = src.b + row * groups;
  }
  float tot[RW][M];
  #pragma unroll
  for (int r = 0; r < RW; ++r) {
    #pragma unroll
    for (int m = 0; m < M; ++m) tot[r][m] = 0.0f;
  }
  for (int c0 = lane; c0 < chunks; c0 += 32 * U) {
    uint4 wq[U][RW];
    float s[U][RW], b[U][RW];
    #pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + 32 * u;
      #pragma unroll
      for (int r = 0; r < RW; ++r) {
        if (c < chunks) {
          wq[u][r] = load_weights<ALIGNED>(wr[r] + 4 * c);
          s[u][r] = to_float(sr[r][c * CV / GROUP]);
          b[u][r] = to_float(br[r][c * CV / GROUP]);
        } else {
          wq[u][r] = make_uint4(0u, 0u, 0u, 0u);
          s[u][r] = 0.0f;
          b[u][r] = 0.0f;
        }
      }
    }
    #pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + 32 * u;
      if (c < chunks) {
        float acc[RW][M], xs[M][2];   // sums of x at even and odd positions
        #pragma unroll
        for (int m = 0; m < M; ++m) {
          xs[m][0] = xs[m][1] = 0.0f;
          #pragma unroll
          for (int r = 0; r < RW; ++r) acc[r][m] = 0.0f;
        }
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
          float q[RW][V];
          #pragma unroll
          for (int r = 0; r < RW; ++r) decode(word(wq[u][r], i), q[r]);
          #pragma unroll
          for (int m = 0; m < M; ++m) {
            float xv[V];
            const T* xp = x + (int64_t)m * k + c * CV + i * V;
            if constexpr (V == 8) unpack<T>(load_x16<ALIGNED>(xp), xv);
            else unpack<T>(load_x8<ALIGNED>(xp), xv);
            #pragma unroll
            for (int e = 0; e < V; ++e) xs[m][e & 1] += xv[e];
            #pragma unroll
            for (int r = 0; r < RW; ++r) {
              #pragma unroll
              for (int e = 0; e < V; ++e) acc[r][m] = fmaf(q[r][e], xv[e], acc[r][m]);
            }
          }
        }
        #pragma unroll
        for (int r = 0; r < RW; ++r) {
          #pragma unroll
          for (int m = 0; m < M; ++m) tot[r][m] += affine<BITS>(s[u][r], b[u][r], acc[r][m], xs[m][0], xs[m][1]);
        }
      }
    }
  }
  store<T, RW, M, GLU>(tot, out, row0, n, lane);
}

// The same for a dense matrix W (n, k) in T: chunks of 8 weights.
template <bool ALIGNED, typename T, int M, int R, int U, bool GLU>
__device__ __forceinline__ void dense_rows(const T* x, Mat<T, T> a, Mat<T, T> a2, T* out, int n, int k, int row0) {
  constexpr int RW = GLU ? 2 * R : R;
  if (row0 >= n) return;
  const int lane = threadIdx.x % 32;
  const int chunks = k / 8;
  const T* wr[RW];
  #pragma unroll
  for (int r = 0; r < RW; ++r) {
    const int rr = row0 + (r % R);
    const int64_t row = rr < n ? rr : n - 1;
    wr[r] = ((GLU && r >= R) ? a2.w : a.w) + row * k;
  }
  float tot[RW][M];
  #pragma unroll
  for (int r = 0; r < RW; ++r) {
    #pragma unroll
    for (int m = 0; m < M; ++m) tot[r][m] = 0.0f;
  }
  for (int c0 = lane; c0 < chunks; c0 += 32 * U) {
    uint4 wq[U][RW];
    #pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + 32 * u;
      #pragma unroll
      for (int r = 0; r < RW; ++r) {
        wq[u][r] = c < chunks ? load_weights<ALIGNED>(wr[r] + 8 * c) : make_uint4(0u, 0u, 0u, 0u);
      }
    }
    #pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + 32 * u;
      if (c < chunks) {
        float wv[RW][8];
        #pragma unroll
        for (int r = 0; r < RW; ++r) unpack<T>(wq[u][r], wv[r]);
        #pragma unroll
        for (int m = 0; m < M; ++m) {
          float xv[8];
          unpack<T>(load_x16<ALIGNED>(x + (int64_t)m * k + 8 * c), xv);
          #pragma unroll
          for (int r = 0; r < RW; ++r) {
            #pragma unroll
            for (int e = 0; e < 8; ++e) tot[r][m] = fmaf(wv[r][e], xv[e], tot[r][m]);
          }
        }
      }
    }
  }
  store<T, RW, M, GLU>(tot, out, row0, n, lane);
}

// Which warp of the grid this is: warps are independent, each owns R consecutive output rows.
__device__ __forceinline__ int warp_id() { return blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; }

}  // namespace ref_gemv
"""

# The bodies MLX wraps in a kernel signature built from input_names (x, w0, s0, b0, ...), output_names
# (y0, ...) and the template constants T, M, R, U (and BITS, GROUP); w0_shape etc. are generated because
# the body names them. "qkv": three matrices side by side, each to its own output; a warp never straddles
# two of them. "glu": silu(x W0^T) * (x W1^T).
CALL_AFFINE = "::ref_gemv::affine_rows<{a}, T, BITS, GROUP, M, R, U, {glu}>(x, {m}, {m2}, {y}, {n}, k, {row0})"
CALL_DENSE = "::ref_gemv::dense_rows<{a}, T, M, R, U, {glu}>(x, {m}, {m2}, {y}, {n}, k, {row0})"


def body(dense: bool, fuse: str) -> str:
    """The kernel body for one matrix ("") or a fused group ("glu", "qkv")."""
    call = CALL_DENSE if dense else CALL_AFFINE
    mats = 3 if fuse == "qkv" else 2 if fuse == "glu" else 1
    w_t = "T" if dense else "uint32_t"
    lines = [f"  const int k = w0_shape[1]{'' if dense else ' * (32 / BITS)'};",
             "  const int wid = ::ref_gemv::warp_id();"]
    for i in range(mats):
        arrays = f"w{i}, nullptr, nullptr" if dense else f"w{i}, s{i}, b{i}"
        lines.append(f"  const ::ref_gemv::Mat<{w_t}, T> m{i}{{{arrays}}};")
    # pointers not 16-byte aligned (a sliced input) take the 2-byte-load path: same results, slower
    ptrs = " | ".join(f"(uintptr_t){p}" for p in ["x"] + [f"w{i}" for i in range(mats)])
    lines.append(f"  const bool al = (({ptrs}) & 15) == 0;")

    def both(m: str, m2: str, y: str, n: str, row0: str) -> str:
        kw = dict(m=m, m2=m2, y=y, n=n, row0=row0, glu="true" if fuse == "glu" else "false")
        return f"if (al) {call.format(a='true', **kw)}; else {call.format(a='false', **kw)};"

    if fuse == "qkv":   # warps 0..c0-1 run q's rows, then k's, then v's
        lines += ["  const int n0 = w0_shape[0], n1 = w1_shape[0], n2 = w2_shape[0];",
                  "  const int c0 = (n0 + R - 1) / R, c1 = (n1 + R - 1) / R;",
                  "  const bool in0 = wid < c0, in1 = !in0 && wid < c0 + c1;",
                  f"  const ::ref_gemv::Mat<{w_t}, T> m = in0 ? m0 : in1 ? m1 : m2;",
                  "  T* const y = in0 ? y0 : in1 ? y1 : y2;",
                  "  const int n = in0 ? n0 : in1 ? n1 : n2;",
                  "  const int row0 = (in0 ? wid : in1 ? wid - c0 : wid - c0 - c1) * R;",
                  f"  {both('m', 'm', 'y', 'n', 'row0')}"]
    else:
        lines += [f"  {both('m0', 'm1' if fuse == 'glu' else 'm0', 'y0', 'w0_shape[0]', 'wid * R')}"]
    return "\n".join(lines) + "\n"


def minified(src: str) -> str:
    """The source without comments and indentation: MLX copies and hashes it at every call."""
    lines = (re.sub(r"//.*$", "", line).strip() for line in src.splitlines())
    return "\n".join(line for line in lines if line) + "\n"
