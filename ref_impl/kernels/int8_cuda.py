"""The CUDA C++ source of the fused layer's int8 activations: the device functions that quantize a kernel's staged
input row to int8 per block of 32 values (`quantize_row`) and multiply quantized matrices by it with dp4a
(`dot_q8`). matrix_cuda.py places this text in the fused layer's header (namespace ref_layer), after the float dot()
whose helpers it uses and before dot_row(), which calls it where a kernel's template constant Q8 is set.

References: llama.cpp ggml-cuda's q8_1 activations (a block of 32 values, d = max|x| / 127, with the block's sum)
and its vec_dot_q4_K_q8_1 / dp4a path; the PTX ISA's dp4a instruction.
See chapter: dispatch-kernel
"""

from __future__ import annotations

INT8 = r"""// Int8 activations (Q8 kernels), as llama.cpp's q8_1: the staged row quantized per block of 32 values, d =
// max|v| / 127, v ~ d * round(v / d), so that a 16-byte chunk of 4- or 8-bit codes meets its activations in
// dp4a instructions (four byte products summed into an int32 at once) instead of decoding every code into a
// float. The block's shared memory after the float row holds, per 16 values (half a block), a float2 (d of its
// block, the sum of its 16 float values: a group's bias multiplies the exact sum) and then the int8 values in
// two regions, the first 16 values of every block in one and the last 16 in the other (a lane reads chunk c,
// the next lane c + 1: 16-byte reads 16 bytes apart), 64 bytes apart so that the two regions' banks differ.
// In each 8 values the 4 at even positions come first: a word of 4-bit codes holds code e at bits 4e, so
// masking its low and high nibbles gives the even and odd positions' codes as bytes.
__device__ __forceinline__ float2* q8_scales(float* xs, int k) { return reinterpret_cast<float2*>(xs + pad(k) + 4); }
__device__ __forceinline__ uint8_t* q8_values(float* xs, int k) {
  return reinterpret_cast<uint8_t*>(xs + pad(k) + 4) + k / 2;
}
__device__ __forceinline__ int q8_region(int k) { return k / 2 + 64; }

__device__ __forceinline__ uint32_t pack4(int a, int b, int c, int d) {
  return (uint32_t)(a & 0xFF) | ((uint32_t)(b & 0xFF) << 8) | ((uint32_t)(c & 0xFF) << 16) | ((uint32_t)d << 24);
}

// The block quantizes the staged float row (k values, padded, k a multiple of 32) into q8_scales and q8_values.
// A thread takes 8 values; the 4 threads of a block of 32 are 4 adjacent lanes, so shuffles find its max.
__device__ __forceinline__ void quantize_row(float* xs, int k) {
  float2* ds = q8_scales(xs, k);
  uint8_t* xq = q8_values(xs, k);
  const int region = q8_region(k);
  for (int base = 0; base < k / 8; base += blockDim.x) {     // every thread of a warp in every round: shuffles
    const int c = base + threadIdx.x;
    const bool mine = c < k / 8;
    float f[8], amax = 0.0f, sum = 0.0f;
    #pragma unroll
    for (int i = 0; i < 8; ++i) {
      f[i] = mine ? xs[pad(8 * c + i)] : 0.0f;
      amax = fmaxf(amax, fabsf(f[i]));
      sum += f[i];
    }
    amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 2));
    sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 1);               // the half block's 16 values
    const float d = __fdiv_rn(amax, 127.0f);
    int q[8];
    #pragma unroll
    for (int i = 0; i < 8; ++i) q[i] = amax == 0.0f ? 0 : __float2int_rn(__fdiv_rn(f[i], d));
    if (mine) {
      const int blk = c >> 2, half = (c >> 1) & 1, eight = c & 1;
      *reinterpret_cast<uint2*>(xq + half * region + 16 * blk + 8 * eight) =
          make_uint2(pack4(q[0], q[2], q[4], q[6]), pack4(q[1], q[3], q[5], q[7]));
      if (eight == 0) ds[2 * blk + half] = make_float2(d, sum);
    }
  }
  __syncthreads();
}

// acc + the dot product of 4 unsigned 8-bit codes with 4 signed 8-bit activations
__device__ __forceinline__ int dot4(uint32_t codes, uint32_t xq, int acc) {
  int r;
  asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(r) : "r"(codes), "r"(xq), "r"(acc));
  return r;
}

// dot() on the int8 row: a chunk of 32 4-bit codes (one block of activations) or 16 8-bit codes (half a block)
// is 8 dp4a; s * d * (the int32 sum) + b * (the chunk's sum of x) is its share of the affine dot product.
template <bool AL, typename T, int BITS, int GROUP, int RW, int U>
__device__ __forceinline__ void dot_q8(float* xs, int k, const uint32_t* const (&w)[RW], const T* const (&s)[RW],
                                       const T* const (&b)[RW], float (&tot)[RW]) {
  constexpr int CV = 128 / BITS;               // values per 16-byte chunk
  const float2* ds = q8_scales(xs, k);
  const uint8_t* xq = q8_values(xs, k);
  const int region = q8_region(k);
  each_chunk<AL, true, T, CV, GROUP, RW, U>(k, w, s, b, tot, [&](int c, const uint4 (&wq)[RW],
                                                                 const float (&sc)[RW], const float (&bi)[RW]) {
    uint4 xa, xb;
    float d, xsum;
    if constexpr (BITS == 4) {               // block c: values 0-15 in the first region, 16-31 in the second
      xa = *reinterpret_cast<const uint4*>(xq + 16 * c);
      xb = *reinterpret_cast<const uint4*>(xq + region + 16 * c);
      const float4 f = *reinterpret_cast<const float4*>(ds + 2 * c);
      d = f.x;
      xsum = f.y + f.w;
    } else {                                 // half c & 1 of block c >> 1
      xa = *reinterpret_cast<const uint4*>(xq + (c & 1) * region + 16 * (c >> 1));
      xb = xa;
      const float2 f = ds[c];
      d = f.x;
      xsum = f.y;
    }
    #pragma unroll
    for (int r = 0; r < RW; ++r) {
      const uint4 v = wq[r];
      int acc = 0;
      if constexpr (BITS == 4) {             // word i: values 8i..8i+7, even codes in the low nibbles
        acc = dot4(v.x & 0x0F0F0F0Fu, xa.x, acc);
        acc = dot4((v.x >> 4) & 0x0F0F0F0Fu, xa.y, acc);
        acc = dot4(v.y & 0x0F0F0F0Fu, xa.z, acc);
        acc = dot4((v.y >> 4) & 0x0F0F0F0Fu, xa.w, acc);
        acc = dot4(v.z & 0x0F0F0F0Fu, xb.x, acc);
        acc = dot4((v.z >> 4) & 0x0F0F0F0Fu, xb.y, acc);
        acc = dot4(v.w & 0x0F0F0F0Fu, xb.z, acc);
        acc = dot4((v.w >> 4) & 0x0F0F0F0Fu, xb.w, acc);
      } else {                               // words of 4 codes in order: gather the even and odd positions
        acc = dot4(__byte_perm(v.x, v.y, 0x6420), xa.x, acc);
        acc = dot4(__byte_perm(v.x, v.y, 0x7531), xa.y, acc);
        acc = dot4(__byte_perm(v.z, v.w, 0x6420), xa.z, acc);
        acc = dot4(__byte_perm(v.z, v.w, 0x7531), xa.w, acc);
      }
      tot[r] += fmaf(sc[r] * d, (float)acc, bi[r] * xsum);
    }
  });
}

"""
