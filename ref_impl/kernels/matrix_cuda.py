"""The CUDA C++ source of the fused layer's matrix helpers: how a warp reads its rows of a weight matrix (dense
pairs of T, or 4- and 8-bit codes with a scale and bias per group) and dots them with the staged input row
(`dot`, or int8_cuda.py's `dot_q8` on the row's int8 copy), with the row pointers (`row_ptrs`) and an L2
prefetch of a warp's first chunks (`prefetch`). fusedlayer_cuda.py places this text in its header's namespace
ref_layer, for every kernel that multiplies by a matrix.

See chapter: dispatch-kernel
"""

from __future__ import annotations

from ref_impl.kernels.int8_cuda import INT8

MATRIX = r"""
// The values of one 32-bit word of a row: 8 4-bit codes, 4 8-bit codes or 2 16-bit floats
template <typename T, int BITS>
__device__ __forceinline__ void word_values(uint32_t v, float (&q)[32 / BITS]) {
  if constexpr (BITS == 16) {
    const float2 p = ::ref_gemv::to_float2<T>(v);
    q[0] = p.x;
    q[1] = p.y;
  } else {
    ::ref_gemv::decode(v, q);
  }
}

// Chunks c0, c0 + 32, ..., c0 + 32 (U - 1) of RW rows (16 bytes of words, CV values each) and, for an affine
// format, their groups' scales and biases, all asked for before any is used; zeros past the row's end
template <bool AL, bool AFFINE, typename T, int CV, int GROUP, int RW, int U>
__device__ __forceinline__ void load_chunks(int c0, int chunks, const uint32_t* const (&w)[RW],
                                            const T* const (&s)[RW], const T* const (&b)[RW], uint4 (&wq)[U][RW],
                                            float (&sc)[U][RW], float (&bi)[U][RW]) {
  #pragma unroll
  for (int u = 0; u < U; ++u) {
    const int c = c0 + 32 * u;
    #pragma unroll
    for (int r = 0; r < RW; ++r) {
      wq[u][r] = c < chunks ? ::ref_gemv::load_weights<AL>(w[r] + 4 * c) : make_uint4(0u, 0u, 0u, 0u);
      if constexpr (AFFINE) {
        sc[u][r] = c < chunks ? to_float(s[r][c * CV / GROUP]) : 0.0f;
        bi[u][r] = c < chunks ? to_float(b[r][c * CV / GROUP]) : 0.0f;
      }
    }
  }
}

// A lane's pass over its chunks of RW rows: chunks l, l + 32, ..., U of every row asked for at once
// (load_chunks), then chunk(c, wq, sc, bi) adds each one inside the row to tot; tot ends as the warp's sums
template <bool AL, bool AFFINE, typename T, int CV, int GROUP, int RW, int U, class Chunk>
__device__ __forceinline__ void each_chunk(int k, const uint32_t* const (&w)[RW], const T* const (&s)[RW],
                                           const T* const (&b)[RW], float (&tot)[RW], Chunk chunk) {
  const int lane = threadIdx.x & 31, chunks = k / CV;
  #pragma unroll
  for (int r = 0; r < RW; ++r) tot[r] = 0.0f;
  for (int c0 = lane; c0 < chunks; c0 += 32 * U) {
    uint4 wq[U][RW];
    float sc[U][RW], bi[U][RW];
    load_chunks<AL, AFFINE, T, CV, GROUP, RW, U>(c0, chunks, w, s, b, wq, sc, bi);
    #pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + 32 * u;
      if (c < chunks) chunk(c, wq[u], sc[u], bi[u]);
    }
  }
  #pragma unroll
  for (int r = 0; r < RW; ++r) tot[r] = warp_sum(tot[r]);
}

// This lane's partial dot products of RW weight rows with x (k floats in shared memory, padded). Row r:
// words w[r] (codes, or the dense row as pairs of T), scales s[r] and biases b[r] per GROUP (affine).
// Lane l reads 16-byte chunks l, l + 32, ..., U chunks of every row in flight before it computes.
template <bool AL, typename T, int BITS, int GROUP, int RW, int U>
__device__ __forceinline__ void dot(const float* xs, int k, const uint32_t* const (&w)[RW], const T* const (&s)[RW],
                                    const T* const (&b)[RW], float (&tot)[RW]) {
  constexpr int V = 32 / BITS;                 // values per word
  constexpr int CV = 4 * V;                    // values per chunk, all in one group
  constexpr bool AFFINE = BITS != 16;
  each_chunk<AL, AFFINE, T, CV, GROUP, RW, U>(k, w, s, b, tot, [&](int c, const uint4 (&wq)[RW],
                                                                   const float (&sc)[RW], const float (&bi)[RW]) {
    const float* xc = xs + pad(c * CV);   // a chunk never crosses a pad: contiguous, 16-byte aligned
    float acc[RW], xsum[2] = {0.0f, 0.0f};   // sums of x at even and odd positions
    #pragma unroll
    for (int r = 0; r < RW; ++r) acc[r] = 0.0f;
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
      float xv[V];
      if constexpr (V >= 4) {
        #pragma unroll
        for (int j = 0; j < V / 4; ++j) {
          const float4 v4 = reinterpret_cast<const float4*>(xc)[i * (V / 4) + j];
          xv[4 * j] = v4.x;
          xv[4 * j + 1] = v4.y;
          xv[4 * j + 2] = v4.z;
          xv[4 * j + 3] = v4.w;
        }
      } else {
        const float2 v2 = reinterpret_cast<const float2*>(xc)[i];
        xv[0] = v2.x;
        xv[1] = v2.y;
      }
      #pragma unroll
      for (int e = 0; e < V; ++e) xsum[e & 1] += xv[e];
      #pragma unroll
      for (int r = 0; r < RW; ++r) {
        float q[V];
        word_values<T, BITS>(word(wq[r], i), q);
        #pragma unroll
        for (int e = 0; e < V; ++e) acc[r] = fmaf(q[e], xv[e], acc[r]);
      }
    }
    #pragma unroll
    for (int r = 0; r < RW; ++r) {
      tot[r] += AFFINE ? ::ref_gemv::affine<BITS>(sc[r], bi[r], acc[r], xsum[0], xsum[1]) : acc[r];
    }
  });
}

""" + INT8 + r"""
// The dot product of a kernel's rows with its staged row: on the int8 copy (Q8, quantized matrices) or the floats
template <bool Q8, bool AL, typename T, int BITS, int GROUP, int RW, int U>
__device__ __forceinline__ void dot_row(float* xs, int k, const uint32_t* const (&w)[RW], const T* const (&s)[RW],
                                        const T* const (&b)[RW], float (&tot)[RW]) {
  if constexpr (Q8 && BITS != 16) dot_q8<AL, T, BITS, GROUP, RW, U>(xs, k, w, s, b, tot);
  else dot<AL, T, BITS, GROUP, RW, U>(xs, k, w, s, b, tot);
}

// Row `row` of one matrix as dot() takes it: words per row k * BITS / 32, groups per row k / GROUP
template <typename T, int BITS, int GROUP>
__device__ __forceinline__ void row_ptrs(const void* w, const T* s, const T* b, int k, int row,
                                         const uint32_t*& wr, const T*& sr, const T*& br) {
  wr = reinterpret_cast<const uint32_t*>(w) + (int64_t)row * (k * BITS / 32);
  sr = BITS == 16 ? nullptr : s + (int64_t)row * (k / GROUP);
  br = BITS == 16 ? nullptr : b + (int64_t)row * (k / GROUP);
}

// An L2 prefetch of the first U chunks a lane will read of each of its rows (`words` 32-bit words a row):
// HBM starts on them while the block stages its input row, which the dot must wait for
template <int RW, int U>
__device__ __forceinline__ void prefetch(const uint32_t* const (&w)[RW], int words) {
  const int lane = threadIdx.x & 31;
  #pragma unroll
  for (int r = 0; r < RW; ++r) {
    #pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = lane + 32 * u;
      if (4 * c < words) asm volatile("prefetch.global.L2 [%0];" :: "l"(w[r] + 4 * c));
    }
  }
}

"""
