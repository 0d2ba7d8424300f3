"""The CUDA C++ source of the fused decoder-layer kernels: one decode step of a Llama layer in five launches.

fusedlayer.py says what each kernel does and launches them; this module is their text. The header (namespace
ref_layer) builds on cuda.py's GEMV device functions (weight loads, 4- and 8-bit code decoding, float16
pairs, warp sums), so a matrix is read the same way in both. Every kernel that multiplies by a matrix
first stages its input row in shared memory as float32, with one pad float after every 32 so that lane l,
reading values 32c..32c+31 of its chunk c, meets a bank no other lane meets (bank (c + i) mod 32).
`SOURCES` maps each kernel to its body; the bodies name their inputs as fusedlayer.py passes them. The header's
parts for reading matrices (matrix_cuda.py, with int8_cuda.py's int8 activations), attending (attend_cuda.py)
and handing over within a launch (handoff_cuda.py) are those modules' text, placed inside it.

See chapter: dispatch-kernel
"""

from __future__ import annotations

from ref_impl.kernels.cuda import HEADER as GEMV_HEADER
from ref_impl.kernels.attend_cuda import ATTEND
from ref_impl.kernels.handoff_cuda import HANDOFF
from ref_impl.kernels.matrix_cuda import MATRIX

# The header in parts, in the order they build on each other; a kernel's source carries the parts it uses
# (`header`): MLX copies and hashes a kernel's whole source at every launch, on the host.
PARTS = {
    "base": r"""
using ::ref_gemv::to_float;
using ::ref_gemv::from_float;
using ::ref_gemv::warp_sum;
using ::ref_gemv::word;

// four pad floats after every 32 values: 16-byte reads stay aligned, and 8 lanes reading chunks of 32, 16 or 8
// consecutive values (one 16-byte read each per step) meet 8 different bank groups
__device__ __forceinline__ int pad(int e) { return e + 4 * (e >> 5); }

// 8 values of T at p (16-byte aligned) as floats
template <typename T>
__device__ __forceinline__ void load8(const T* p, float (&f)[8]) {
  ::ref_gemv::unpack<T>(__ldg(reinterpret_cast<const uint4*>(p)), f);
}

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// v rounded to T and back: where MLX's graph stores an intermediate in T, so do we
template <typename T> __device__ __forceinline__ float rnd(float v) { return to_float(from_float<T>(v)); }

__device__ __forceinline__ float warp_max(float v) {
  #pragma unroll
  for (int o = 16; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
  return v;
}

""",
    "matrix": MATRIX,
    "stage_norm": r"""
// Chunk c of a row of T (values 8c..8c+7) as floats: one 16-byte load where the row is aligned (vec)
template <typename T>
__device__ __forceinline__ void chunk8(const T* p, int c, bool vec, float (&f)[8]) {
  if (vec) load8<T>(p + 8 * c, f);
  else for (int i = 0; i < 8; ++i) f[i] = to_float(p[8 * c + i]);
}

__device__ __forceinline__ float sum_squares(const float (&f)[8], float ss) {
  #pragma unroll
  for (int i = 0; i < 8; ++i) ss = fmaf(f[i], f[i], ss);
  return ss;
}

// Chunk c of RMSNorm(x) * w into xs, from x's and w's values f and g and x's 1 / rms r (8 values never cross a pad)
template <typename T>
__device__ __forceinline__ void put_normed(float* xs, int c, const float (&f)[8], const float (&g)[8], float r) {
  float* out = xs + pad(8 * c);
  #pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = rnd<T>(rnd<T>(f[i] * r) * g[i]);
}

// The block stages RMSNorm(x) * w (k values, k a multiple of 8) in xs, as MLX rounds it: x * rsqrt(mean(x^2) +
// eps) to T, times w to T. Where x and w are aligned and a thread has at most HELD chunks of them, it asks for all
// of them at once and keeps them in registers: one trip to memory, where a loop that loads a chunk and then uses
// it waits once a chunk (x's first load was attn_in's and mlp_in's most sampled stall in the H200 ncu profile).
// Otherwise x is read twice, a chunk at a time.
template <typename T>
__device__ __forceinline__ void stage_norm(const T* x, const T* w, float eps, int k, float* xs) {
  constexpr int HELD = 4;
  __shared__ float red[32];
  const bool vec = ((((uintptr_t)x) | ((uintptr_t)w)) & 15) == 0;
  const bool held = vec && k / 8 <= HELD * (int)blockDim.x;
  uint4 xv[HELD], wv[HELD];
  float ss = 0.0f;
  if (held) {
    #pragma unroll
    for (int j = 0; j < HELD; ++j) {
      const int c = threadIdx.x + j * blockDim.x;
      if (c < k / 8) {
        xv[j] = __ldg(reinterpret_cast<const uint4*>(x) + c);
        wv[j] = __ldg(reinterpret_cast<const uint4*>(w) + c);
      }
    }
    #pragma unroll
    for (int j = 0; j < HELD; ++j) {
      if (threadIdx.x + j * blockDim.x < k / 8) {
        float f[8];
        ::ref_gemv::unpack<T>(xv[j], f);
        ss = sum_squares(f, ss);
      }
    }
  } else {
    for (int c = threadIdx.x; c < k / 8; c += blockDim.x) {
      float f[8];
      chunk8<T>(x, c, vec, f);
      ss = sum_squares(f, ss);
    }
  }
  ss = warp_sum(ss);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x / 32] = ss;
  __syncthreads();
  float tot = 0.0f;
  for (int i = 0; i < (int)blockDim.x / 32; ++i) tot += red[i];
  const float r = rsqrtf(tot / k + eps);
  if (held) {
    #pragma unroll
    for (int j = 0; j < HELD; ++j) {
      const int c = threadIdx.x + j * blockDim.x;
      if (c < k / 8) {
        float f[8], g[8];
        ::ref_gemv::unpack<T>(xv[j], f);
        ::ref_gemv::unpack<T>(wv[j], g);
        put_normed<T>(xs, c, f, g, r);
      }
    }
  } else {
    for (int c = threadIdx.x; c < k / 8; c += blockDim.x) {
      float f[8], g[8];
      chunk8<T>(x, c, vec, f);
      chunk8<T>(w, c, vec, g);
      put_normed<T>(xs, c, f, g, r);
    }
  }
  __syncthreads();
}

""",
    "stage_row": r"""
// The block stages a row of k values of T (2 bytes each, k a multiple of 8) in xs, read from L2 (__ldcg): in the
// merged MLP other blocks of the same launch wrote it, and this SM's L1 may not know. A thread asks for BATCH
// chunks before it stores one (one trip to memory for rows up to 8 x BATCH x blockDim values).
template <typename T>
__device__ __forceinline__ void stage_row(const T* a, int k, float* xs) {
  constexpr int BATCH = 8;
  const bool vec = (((uintptr_t)a) & 15) == 0;
  const unsigned short* bits = reinterpret_cast<const unsigned short*>(a);
  for (int c0 = threadIdx.x; c0 < k / 8; c0 += BATCH * blockDim.x) {
    uint4 v[BATCH];
    #pragma unroll
    for (int j = 0; j < BATCH; ++j) {
      const int c = c0 + j * blockDim.x;
      if (vec && c < k / 8) v[j] = __ldcg(reinterpret_cast<const uint4*>(a) + c);
    }
    #pragma unroll
    for (int j = 0; j < BATCH; ++j) {
      const int c = c0 + j * blockDim.x;
      if (c >= k / 8) break;
      float f[8];
      if (vec) ::ref_gemv::unpack<T>(v[j], f);
      else for (int i = 0; i < 8; ++i) f[i] = ::ref_gemv::to_float2<T>(__ldcg(bits + 8 * c + i)).x;   // the low half
      float* out = xs + pad(8 * c);
      #pragma unroll
      for (int i = 0; i < 8; ++i) out[i] = f[i];
    }
  }
  __syncthreads();
}

""",
    "stage_attention": r"""
// The block stages the attention output (heads x D values) from the key-length splits' partial results
// part (splits, heads, D + 2): per split and head, sum_j exp(s_j - m) v_j, then m and sum_j exp(s_j - m).
// First each warp turns a head's maxima and sums into each split's weight (wts, heads x splits floats of
// shared memory), then every value is one weighted sum over the splits. part is read from L2 (__ldcg): in the
// merged launch other blocks of the same kernel wrote it, and this SM's L1 may not know.
template <typename T, int D>
__device__ __forceinline__ void stage_attention(const float* part, int splits, int heads, float* xs, float* wts) {
  const int lane = threadIdx.x & 31, nw = blockDim.x / 32;
  for (int h = threadIdx.x / 32; h < heads; h += nw) {
    float m = neg_inf();
    for (int s = lane; s < splits; s += 32) m = fmaxf(m, __ldcg(part + ((int64_t)s * heads + h) * (D + 2) + D));
    m = warp_max(m);
    float den = 0.0f;
    for (int s = lane; s < splits; s += 32) {
      const float* p = part + ((int64_t)s * heads + h) * (D + 2);
      const float pm = __ldcg(p + D), f = pm == neg_inf() ? 0.0f : expf(pm - m);   // a split with no keys adds nothing
      wts[h * splits + s] = f;
      den = fmaf(f, __ldcg(p + D + 1), den);
    }
    den = warp_sum(den);
    for (int s = lane; s < splits; s += 32) wts[h * splits + s] /= den;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < heads * D; e += blockDim.x) {
    const int h = e / D, i = e % D;
    float v = 0.0f;
    for (int s = 0; s < splits; ++s) v = fmaf(wts[h * splits + s], __ldcg(part + ((int64_t)s * heads + h) * (D + 2) + i), v);
    xs[pad(e)] = rnd<T>(v);
  }
  __syncthreads();
}

""",
    "attend": ATTEND,
    "handoff": HANDOFF,
    "project": r"""
// A projection plus the residual, y = res + (row W^T) in T, for block `blk`: its NW warps' R rows each of the
// matrix (n rows of k inputs). `stage()` puts the row in xs once the block has asked for its rows, and returns 0,
// or NaN when its input never came (a handoff that failed: the output then says so).
template <typename T, int NW, int B0, int G0, int R, int U, bool Q8, class Stage>
__device__ __forceinline__ void project(int blk, int k, const void* w0, const T* s0, const T* b0, const T* res, int n,
                                        T* y, float* xs, Stage stage) {
  const int lane = threadIdx.x & 31, row0 = (blk * NW + threadIdx.x / 32) * R;
  const uint32_t* wr[R];
  const T* sr[R];
  const T* br[R];
  float acc[R];
  for (int r = 0; r < R; ++r) row_ptrs<T, B0, G0>(w0, s0, b0, k, min(row0 + r, n - 1), wr[r], sr[r], br[r]);
  if (row0 < n) prefetch<R, U>(wr, k * B0 / 32);
  const float bad = stage();
  if constexpr (Q8) quantize_row(xs, k);
  if (row0 >= n) return;
  if ((((uintptr_t)w0) & 15) == 0) dot_row<Q8, true, T, B0, G0, R, U>(xs, k, wr, sr, br, acc);
  else dot_row<Q8, false, T, B0, G0, R, U>(xs, k, wr, sr, br, acc);
  if (lane < R && row0 + lane < n) {
    float v = acc[0];
    #pragma unroll
    for (int r = 1; r < R; ++r) if (lane == r) v = acc[r];
    y[row0 + lane] = ::ref_gemv::from_float<T>(to_float(res[row0 + lane]) + rnd<T>(v) + bad);
  }
}

""",
    "gate_up": r"""
// Norm, then the MLP's gate and up projections: y = silu(x Wg^T) * (x Wu^T) (n rows of k inputs each), with
// MLX's roundings to T (gate, up, sigmoid, silu, product). A warp reads R rows of each matrix; the block stages
// the normed row once and then computes groups blk, blk + stride, ... of NW * R rows (a launch with fewer blocks
// than groups pays for fewer stagings)
template <typename T, int NW, int B0, int G0, int R, int U, bool Q8>
__device__ __forceinline__ void gate_up(int blk, int stride, const T* x, const T* nw, float eps, int k,
                                        const void* w0, const T* s0, const T* b0, const void* w1, const T* s1,
                                        const T* b1, int n, T* y, float* xs) {
  const int lane = threadIdx.x & 31;
  const uint32_t* wr[2 * R];
  const T* sr[2 * R];
  const T* br[2 * R];
  auto point = [&](int row0) {
    for (int r = 0; r < R; ++r) {
      const int row = min(row0 + r, n - 1);
      row_ptrs<T, B0, G0>(w0, s0, b0, k, row, wr[r], sr[r], br[r]);
      row_ptrs<T, B0, G0>(w1, s1, b1, k, row, wr[R + r], sr[R + r], br[R + r]);
    }
  };
  int row0 = (blk * NW + threadIdx.x / 32) * R;
  point(row0);
  if (row0 < n) prefetch<2 * R, U>(wr, k * B0 / 32);
  stage_norm<T>(x, nw, eps, k, xs);
  if constexpr (Q8) quantize_row(xs, k);
  const bool al = ((((uintptr_t)w0) | ((uintptr_t)w1)) & 15) == 0;
  while (row0 < n) {
    float acc[2 * R];
    if (al) dot_row<Q8, true, T, B0, G0, 2 * R, U>(xs, k, wr, sr, br, acc);
    else dot_row<Q8, false, T, B0, G0, 2 * R, U>(xs, k, wr, sr, br, acc);
    if (lane < R && row0 + lane < n) {
      float g = acc[0], u = acc[R];
      #pragma unroll
      for (int r = 1; r < R; ++r) if (lane == r) { g = acc[r]; u = acc[R + r]; }
      g = rnd<T>(g);
      const float sig = rnd<T>(1.0f / (1.0f + expf(-g)));
      y[row0 + lane] = ::ref_gemv::from_float<T>(rnd<T>(g * sig) * rnd<T>(u));
    }
    blk += stride;
    row0 = (blk * NW + threadIdx.x / 32) * R;
    point(row0);
  }
}

""",
}

# each kernel's parts (the base and the matrix helpers for every kernel that multiplies by a matrix)
NEEDS = {
    "attn_in": ("base", "matrix", "stage_norm"),
    "attend": ("base", "attend"),
    "attn_out": ("base", "matrix", "stage_attention", "project"),
    "attention": ("base", "matrix", "stage_attention", "attend", "handoff", "project"),
    "mlp_in": ("base", "matrix", "stage_norm", "gate_up"),
    "mlp_out": ("base", "matrix", "stage_row", "project"),
    "mlp": ("base", "matrix", "stage_norm", "stage_row", "handoff", "project", "gate_up"),
}


def header(parts) -> str:
    """The CUDA header of some PARTS (in PARTS' order), after cuda.py's GEMV header."""
    return GEMV_HEADER + "namespace ref_layer {\n" + "".join(t for p, t in PARTS.items() if p in parts) \
        + "}  // namespace ref_layer\n"


HEADER = header(PARTS)   # every part: what the probes and the chapter show

# Each body runs in the signature MLX generates from fusedlayer.py's input and output names; `xs` is the
# dynamic shared memory fusedlayer.py sizes. Template constants: T (the activation type), NW (warps per block),
# the formats of the matrices (B0, G0, ...: bits and group size; bits 16 is a dense matrix), and per kernel
# the rows per warp R, the loads in flight U, the head size D, the query heads per key head G, TRAD, Q8 (the
# matrix kernels multiply quantized matrices by an int8 copy of their staged row: quantize_row, dot_q8) and
# PF (attend prefetches attn_out's matrix, w0 s0 b0, into L2).
# `al`: every weight pointer 16-byte aligned (otherwise the 2-byte-load path, same results).

# Norm, the q, k and v projections, RoPE and the cache write. A warp computes two rows that RoPE rotates
# together (TRAD: rows 2i, 2i + 1 of a head; else i, i + D/2) for q and k, two adjacent rows for v; q goes to
# the output, k and v into the caches kc, vc (1, HKV, capacity, D) at position pos, in place: the caches are
# inputs, so MLX does not see the write, and attend below, which reads them, takes q from here.
ATTN_IN = r"""
  extern __shared__ float xs[];
  const int k = nw_shape[0], hkv = kc_shape[1], cap = kc_shape[2], hq = w0_shape[0] / D;
  const int lane = threadIdx.x & 31, nq = hq * D / 2, nk = hkv * D / 2, pairs = nq + 2 * nk;
  // warp wid's row pair: p in matrix `which` (q, k, v), rows row[] of head `head`, RoPE pair i
  int wid = blockIdx.x * NW + threadIdx.x / 32, which, p, head, i, row[2];
  const uint32_t* wr[2];
  const T* sr[2];
  const T* br[2];
  float rate = 0.0f;
  auto point = [&]() {
    which = wid < nq ? 0 : wid < nq + nk ? 1 : 2;
    p = wid < pairs ? wid - (which == 0 ? 0 : which == 1 ? nq : nq + nk) : 0;
    head = 2 * p / D;
    i = p % (D / 2);
    if (which == 2 || TRAD) { row[0] = 2 * p; row[1] = 2 * p + 1; }
    else { row[0] = head * D + i; row[1] = head * D + i + D / 2; }
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (which == 0) ::ref_layer::row_ptrs<T, B0, G0>(w0, s0, b0, k, row[r], wr[r], sr[r], br[r]);
      else if (which == 1) ::ref_layer::row_ptrs<T, B1, G1>(w1, s1, b1, k, row[r], wr[r], sr[r], br[r]);
      else ::ref_layer::row_ptrs<T, B2, G2>(w2, s2, b2, k, row[r], wr[r], sr[r], br[r]);
    }
    // the pair's rate, asked for now (volatile: nvcc moves a plain load to its use after the dot)
    if (wid < pairs && which < 2) asm volatile("ld.global.nc.f32 %0, [%1];" : "=f"(rate) : "l"(freqs + i));
  };
  point();
  // the position, asked for now too: a plain load after the dot left the block waiting a trip to memory at its
  // end, as the H200 ncu profile's stall samples show
  int at;
  asm volatile("ld.global.nc.s32 %0, [%1];" : "=r"(at) : "l"(pos));
  if (wid < pairs) ::ref_layer::prefetch<2, U>(wr, k * (which == 0 ? B0 : which == 1 ? B1 : B2) / 32);
  ::ref_layer::stage_norm<T>(x, nw, eps[0], k, xs);
  if constexpr (Q8) ::ref_layer::quantize_row(xs, k);
  const bool al = (((uintptr_t)w0 | (uintptr_t)w1 | (uintptr_t)w2) & 15) == 0;
  // the block stages the normed row once and computes warps wid, wid + NW * gridDim.x, ... (a launch with fewer
  // blocks than groups of NW pairs pays for fewer stagings)
  while (wid < pairs) {
    float y[2];
    #define REF_DOT(B, G) \
      if (al) ::ref_layer::dot_row<Q8, true, T, B, G, 2, U>(xs, k, wr, sr, br, y); \
      else ::ref_layer::dot_row<Q8, false, T, B, G, 2, U>(xs, k, wr, sr, br, y);
    if (which == 0) { REF_DOT(B0, G0) }
    else if (which == 1) { REF_DOT(B1, G1) }
    else { REF_DOT(B2, G2) }
    #undef REF_DOT
    if (lane == 0) {
      float a = ::ref_layer::rnd<T>(y[0]), c = ::ref_layer::rnd<T>(y[1]);   // the projections, in T
      if (which < 2) {
        float sn, cs;
        sincosf((float)at * rate, &sn, &cs);
        const float a2 = a * cs - c * sn;
        c = a * sn + c * cs;
        a = a2;
      }
      if (which == 0) {
        q[row[0]] = ::ref_gemv::from_float<T>(a);
        q[row[1]] = ::ref_gemv::from_float<T>(c);
      } else {
        T* cache = const_cast<T*>(which == 1 ? kc : vc);
        const int64_t base = ((int64_t)head * cap + at) * D;
        cache[base + row[0] % D] = ::ref_gemv::from_float<T>(a);
        cache[base + row[1] % D] = ::ref_gemv::from_float<T>(c);
      }
    }
    wid += NW * gridDim.x;
    point();
  }
"""

# Decode attention, split over the key length (attend_split in the header): one block per key head and split.
# (Its first layout, 32 lanes a key, spent five dependent shuffles a key and head; today's spends two a key and
# three for every 8 keys, yet the H100 profile in results/h100-20261206-115613.json still gave it ~14 us a
# layer at 256 keys: its time went elsewhere. Queued alone it now takes ~10, results/h100-20261206-155918.json.)
ATTEND = r"""
  extern __shared__ float xs[];
  const int64_t wbytes = (int64_t)w0_shape[0] * w0_shape[1] * sizeof(*w0), sbytes = (int64_t)s0_shape[0] * s0_shape[1] * sizeof(T);
  ::ref_layer::attend_split<T, NW, B0, D, G, PF>(blockIdx.x, gridDim.x, gridDim.x / kc_shape[1], q, kc, vc, kc_shape[2],
                                                 pos[0] + 1, scale[0], w0, wbytes, s0, b0, sbytes, part, xs);
"""

# The splits merged, the output projection, the residual: y = x + (attention W^T), each in T
ATTN_OUT = r"""
  extern __shared__ float xs[];
  const int splits = part_shape[0], hq = part_shape[1], k = hq * D;
  ::ref_layer::project<T, NW, B0, G0, R, U, Q8>(blockIdx.x, k, w0, s0, b0, x, x_shape[2], y, xs, [&] {
    ::ref_layer::stage_attention<T, D>(part, splits, hq, xs, xs + ::ref_layer::pad(k) + 4);   // then int8 there
    return 0.0f;
  });
"""

# attend and attn_out in one launch: the first blocks to start (tickets, in the header) attend with NA warps, the
# rest project once every split is in; `sync` holds the layer's three counters. One launch fewer a layer, and the
# projection's blocks are in place (their rows asked for) when the attention lands.
ATTENTION = r"""
  extern __shared__ float xs[];
  int* counters = const_cast<int*>(sync);
  const int hkv = kc_shape[1], hq = hkv * G, n = x_shape[2], na = gridDim.x - (n + NW * R - 1) / (NW * R);
  const int t = ::ref_layer::ticket(counters);
  if (t < na) {
    const int64_t wbytes = (int64_t)w0_shape[0] * w0_shape[1] * sizeof(*w0), sbytes = (int64_t)s0_shape[0] * s0_shape[1] * sizeof(T);
    ::ref_layer::attend_split<T, NA, B0, D, G, PF>(t, na, na / hkv, q, kc, vc, kc_shape[2], pos[0] + 1, scale[0], w0,
                                                   wbytes, s0, b0, sbytes, part, xs);
    ::ref_layer::arrive(counters);
  } else {
    ::ref_layer::project<T, NW, B0, G0, R, U, Q8>(t - na, hq * D, w0, s0, b0, x, n, y, xs, [&] {
      const float bad = ::ref_layer::wait_for(counters, na);
      ::ref_layer::stage_attention<T, D>(part, na / hkv, hq, xs, xs + ::ref_layer::pad(hq * D) + 4);
      return bad;
    });
  }
  ::ref_layer::depart(counters);
"""

# Norm, then the MLP's gate and up projections (gate_up in the header)
MLP_IN = r"""
  extern __shared__ float xs[];
  ::ref_layer::gate_up<T, NW, B0, G0, R, U, Q8>(blockIdx.x, gridDim.x, x, nw, eps[0], nw_shape[0], w0, s0, b0, w1,
                                                s1, b1, w0_shape[0], y, xs);
"""

# The down projection plus the residual: y = h + (a W^T), each in T
MLP_OUT = r"""
  extern __shared__ float xs[];
  const int k = a_shape[2];
  ::ref_layer::project<T, NW, B0, G0, R, U, Q8>(blockIdx.x, k, w0, s0, b0, h, h_shape[2], y, xs, [&] {
    ::ref_layer::stage_row<T>(a, k, xs);
    return 0.0f;
  });
"""

# mlp_in and mlp_out in one launch, as attention hands over: the first blocks to start compute the hidden row a
# (gate and up in B0/G0, U loads in flight, Q8), the rest the down projection (B1/G1, UD, Q8D) once all of a is in
MLP = r"""
  extern __shared__ float xs[];
  int* counters = const_cast<int*>(sync);
  const int k = nw_shape[0], f = w0_shape[0], na = (f + NW * R - 1) / (NW * R);
  const int t = ::ref_layer::ticket(counters);
  if (t < na) {
    ::ref_layer::gate_up<T, NW, B0, G0, R, U, Q8>(t, na, x, nw, eps[0], k, w0, s0, b0, w1, s1, b1, f, a, xs);
    ::ref_layer::arrive(counters);
  } else {
    ::ref_layer::project<T, NW, B1, G1, R, UD, Q8D>(t - na, f, w2, s2, b2, x, k, y, xs, [&] {
      const float bad = ::ref_layer::wait_for(counters, na);
      ::ref_layer::stage_row<T>(a, f, xs);
      return bad;
    });
  }
  ::ref_layer::depart(counters);
"""

# kernel -> (input names, output names, body); a matrix is w (codes or dense), s, b (scales and biases:
# for a dense matrix fusedlayer.py passes w again in their place, and the kernel never reads them)
SOURCES = {
    "attn_in": (["x", "nw", "eps", "w0", "s0", "b0", "w1", "s1", "b1", "w2", "s2", "b2", "freqs", "pos", "kc", "vc"],
                ["q"], ATTN_IN),
    "attend": (["q", "kc", "vc", "pos", "scale", "w0", "s0", "b0"], ["part"], ATTEND),
    "attn_out": (["part", "w0", "s0", "b0", "x"], ["y"], ATTN_OUT),
    "attention": (["q", "kc", "vc", "pos", "scale", "w0", "s0", "b0", "x", "sync"], ["part", "y"], ATTENTION),
    "mlp_in": (["x", "nw", "eps", "w0", "s0", "b0", "w1", "s1", "b1"], ["y"], MLP_IN),
    "mlp_out": (["a", "w0", "s0", "b0", "h"], ["y"], MLP_OUT),
    "mlp": (["x", "nw", "eps", "w0", "s0", "b0", "w1", "s1", "b1", "w2", "s2", "b2", "sync"], ["a", "y"], MLP),
}
