"""The CUDA C++ source of the fused layer's decode attention: `attend_split`, one block's share of the attention
of the new query over the KV cache (a key head and a split of the key length, grouped-query aware), with its
helpers (`prefetch_l2`, which moves the next kernel's matrix into L2 meanwhile, and `load_head`).
fusedlayer_cuda.py places this text in its header's namespace ref_layer, for the kernels that attend (attend,
and attention, which hands the splits on to the output projection in the same launch).

References: flash-decoding's split over the key length (Dao et al., "Flash-Decoding for long-context inference",
2023); the online softmax (Milakov and Gimelshein, "Online normalizer calculation for softmax", 2018).
See chapter: dispatch-kernel
"""

from __future__ import annotations

ATTEND = r"""
// This thread's share of an array moved into L2 ahead of its reader, the grid's nth threads splitting its bytes
// in whole 256-byte pieces: on sm_90 one bulk prefetch (the copy engine fetches it), elsewhere a line at a time
__device__ __forceinline__ void prefetch_l2(const void* p, int64_t bytes, int64_t tid, int64_t nth) {
  const int64_t slice = ((bytes + nth - 1) / nth + 255) & ~int64_t(255), at = tid * slice;
  if (at >= bytes) return;
  const char* a = static_cast<const char*>(p) + at;
  const int64_t len = min(slice, bytes - at);
#if __CUDA_ARCH__ >= 900
  if (len >= 16) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(a), "r"((uint32_t)(len & ~int64_t(15))) : "memory");
#else
  for (int64_t o = 0; o < len; o += 128) asm volatile("prefetch.global.L2 [%0];" :: "l"(a + o));
#endif
}

// E consecutive values of T (one lane's share of a head) as floats
template <typename T, int E>
__device__ __forceinline__ void load_head(const T* p, float (&f)[E]) {
  if constexpr (E % 2 == 0) {
    const uint32_t* u = reinterpret_cast<const uint32_t*>(p);
    #pragma unroll
    for (int i = 0; i < E / 2; ++i) {
      const float2 v = ::ref_gemv::to_float2<T>(u[i]);
      f[2 * i] = v.x;
      f[2 * i + 1] = v.y;
    }
  } else {
    #pragma unroll
    for (int i = 0; i < E; ++i) f[i] = to_float(p[i]);
  }
}

// Decode attention over the cache, split over the key length: block `blk` of `nblk` (key head, split) reads the
// keys and values of its share of the n positions once for the G query heads of that key head (grouped-query
// attention). Its first NA warps take 8 keys at a time, 4 lanes a key: each lane dots a quarter of its key with
// the G queries (staged in shared memory, scaled), two shuffles add the quarters, and an online softmax over the
// 8 keys updates the lane's share of each head's output (dims lane*E.., the 8 keys' weights passed by shuffles).
// Then the block merges those warps into part[split, head] = (sum exp(s - m) v, m, sum exp(s - m)): a thread per
// head weighs each warp once (exp(m_warp - m)), then each output value is one weighted sum over the warps.
// PF: the blocks first move the output projection's matrix (w0, s0, b0) into L2, for its reader next.
template <typename T, int NA, int B0, int D, int G, bool PF>
__device__ __forceinline__ void attend_split(int blk, int nblk, int splits, const T* q, const T* kc, const T* vc,
                                             int cap, int n, float scale, const void* w0, int64_t wbytes,
                                             const T* s0, const T* b0, int64_t sbytes, float* part, float* xs) {
  constexpr int E = D / 32, LK = 4, KS = 32 / LK, SD = D / LK, QROW = SD + 4;   // a quarter, padded: no conflicts
  const int hk = blk / splits, sp = blk % splits, hq = nblk / splits * G;
  const int per = (n + splits - 1) / splits, j0 = sp * per, j1 = min(n, j0 + per);
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32, quarter = lane % LK, mykey = lane / LK;
  if constexpr (PF) {
    const int64_t tid = (int64_t)blk * blockDim.x + threadIdx.x, nth = (int64_t)nblk * blockDim.x;
    prefetch_l2(w0, wbytes, tid, nth);
    if constexpr (B0 != 16) {
      prefetch_l2(s0, sbytes, tid, nth);
      prefetch_l2(b0, sbytes, tid, nth);
    }
  }
  float* qs = xs + ((NA * G * (D + 2) + 3) & ~3);   // after the warps' partial results, 16-byte aligned
  for (int t = threadIdx.x; t < G * D; t += blockDim.x) {
    const int g = t / D, d = t % D;
    qs[(g * LK + d / SD) * QROW + d % SD] = to_float(q[(int64_t)hk * G * D + t]) * scale;
  }
  __syncthreads();
  const bool al = ((uintptr_t)kc & 15) == 0;
  float m[G], l[G], acc[G][E];
  #pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = neg_inf();
    l[g] = 0.0f;
    #pragma unroll
    for (int e = 0; e < E; ++e) acc[g][e] = 0.0f;
  }
  for (int j = j0 + warp * KS; warp < NA && j < j1; j += NA * KS) {
    const bool valid = j + mykey < j1;
    const T* kr = kc + ((int64_t)hk * cap + min(j + mykey, j1 - 1)) * D + quarter * SD;   // past the end: re-read
    uint4 kw[SD / 8];
    #pragma unroll
    for (int c = 0; c < SD / 8; ++c)
      kw[c] = al ? ::ref_gemv::load_x16<true>(kr + 8 * c) : ::ref_gemv::load_x16<false>(kr + 8 * c);
    float vv[KS][E];                                 // the 8 keys' values, this lane's dims
    #pragma unroll
    for (int b = 0; b < KS; ++b) load_head<T, E>(vc + ((int64_t)hk * cap + min(j + b, j1 - 1)) * D + lane * E, vv[b]);
    float sc[G];
    #pragma unroll
    for (int g = 0; g < G; ++g) sc[g] = 0.0f;
    #pragma unroll
    for (int c = 0; c < SD / 8; ++c) {
      float kf[8];
      ::ref_gemv::unpack<T>(kw[c], kf);
      #pragma unroll
      for (int g = 0; g < G; ++g) {
        const float4* qp = reinterpret_cast<const float4*>(qs + (g * LK + quarter) * QROW + 8 * c);
        const float4 a = qp[0], b = qp[1];
        sc[g] = fmaf(kf[0], a.x, fmaf(kf[1], a.y, fmaf(kf[2], a.z, fmaf(kf[3], a.w, sc[g]))));
        sc[g] = fmaf(kf[4], b.x, fmaf(kf[5], b.y, fmaf(kf[6], b.z, fmaf(kf[7], b.w, sc[g]))));
      }
    }
    #pragma unroll
    for (int g = 0; g < G; ++g) {
      float s = sc[g] + __shfl_xor_sync(0xFFFFFFFFu, sc[g], 1);
      s += __shfl_xor_sync(0xFFFFFFFFu, s, 2);
      s = valid ? s : neg_inf();
      float mx = fmaxf(s, __shfl_xor_sync(0xFFFFFFFFu, s, 4));
      mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, 8));
      mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, 16));
      const float mn = fmaxf(m[g], mx), corr = expf(m[g] - mn);   // the first key is valid: mn is finite
      const float p = valid ? expf(s - mn) : 0.0f;
      l[g] = fmaf(l[g], corr, p);                    // this lane's key's share; summed over keys at the end
      #pragma unroll
      for (int e = 0; e < E; ++e) acc[g][e] *= corr;
      #pragma unroll
      for (int b = 0; b < KS; ++b) {
        const float pb = __shfl_sync(0xFFFFFFFFu, p, b * LK);
        #pragma unroll
        for (int e = 0; e < E; ++e) acc[g][e] = fmaf(pb, vv[b][e], acc[g][e]);
      }
      m[g] = mn;
    }
  }
  #pragma unroll
  for (int g = 0; g < G; ++g) {                      // the sums over the warp's keys (a key's 4 lanes agree)
    l[g] += __shfl_xor_sync(0xFFFFFFFFu, l[g], 4);
    l[g] += __shfl_xor_sync(0xFFFFFFFFu, l[g], 8);
    l[g] += __shfl_xor_sync(0xFFFFFFFFu, l[g], 16);
  }
  float* mine = xs + warp * G * (D + 2);
  if (warp < NA) {
    #pragma unroll
    for (int g = 0; g < G; ++g) {
      #pragma unroll
      for (int e = 0; e < E; ++e) mine[g * (D + 2) + lane * E + e] = acc[g][e];
      if (lane == 0) { mine[g * (D + 2) + D] = m[g]; mine[g * (D + 2) + D + 1] = l[g]; }
    }
  }
  __syncthreads();
  float* wts = qs;                                   // the queries are all read: the warps' weights there
  if (threadIdx.x < G) {
    const int g = threadIdx.x;
    float mx = neg_inf(), s = 0.0f;
    #pragma unroll
    for (int w = 0; w < NA; ++w) mx = fmaxf(mx, xs[(w * G + g) * (D + 2) + D]);
    #pragma unroll
    for (int w = 0; w < NA; ++w) {
      const float* o = xs + (w * G + g) * (D + 2);
      const float f = o[D] == neg_inf() ? 0.0f : expf(o[D] - mx);
      wts[g * NA + w] = f;
      s = fmaf(f, o[D + 1], s);
    }
    float* out = part + ((int64_t)sp * hq + hk * G + g) * (D + 2);
    out[D] = mx;
    out[D + 1] = s;
  }
  __syncthreads();
  for (int t = threadIdx.x; t < G * D; t += blockDim.x) {
    const int g = t / D, e = t % D;
    float v = 0.0f;
    #pragma unroll
    for (int w = 0; w < NA; ++w) v = fmaf(wts[g * NA + w], xs[(w * G + g) * (D + 2) + e], v);
    part[((int64_t)sp * hq + hk * G + g) * (D + 2) + e] = v;
  }
}

"""
