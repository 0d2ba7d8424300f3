"""GPU probe run at commit 38c8299: the 4-bit GEMV's inner loop, five ways, on the H200 (issue 21, item 2); its
output is the .log beside it.

One warp computes R rows of y = W x for MLX's affine 4-bit codes (groups of 32, float16 scales and biases), lane l
reading 16-byte chunks l, l+32, ... (U per row in flight) against x staged once per block in shared memory, as
the fused layer's `dot` does. Only the decode of a 32-bit word of 8 codes differs:
  0 float-trick  today's: per code a lop3 into the mantissa of 2^23, an FMA to the code, an FMA into the sum
  1 two-magic    codes shifted to bits 12-15 or 16-19 and OR-ed into 2048.0 or 128.0: the float 2048 + c or 128 + c
                 times x is exact in float32, summed per class; the offsets leave through two sums of x
  2 half2        lop3 into half2 1024 + c (or 1024 + 16c), one HSUB2/HFMA2 to (c, c'), HFMA2 with x pairs into a
                 half2 sum per chunk (x staged as half2 pairs in code order)
  3 int8-dp4a    x quantized to int8 per chunk of 32 (llama.cpp's q8_1 idea), two DP4A per word
  4 ceiling      no decode: one FMA per word, the loop's memory ceiling
Each variant is checked against a float64 numpy product, then timed on stacked layers (~200 MB a launch, 10
launches queued) against MLX's quantized_matmul and the read bandwidth (x.sum()).
"""
import sys
import time

import mlx.core as mx
import numpy as np

HEADER = r"""
namespace probe {
__device__ __forceinline__ uint4 ldw(const uint32_t* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ uint32_t wd(const uint4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }
__device__ __forceinline__ float wsum(float v) {
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
  return v;
}
__device__ __forceinline__ int pad(int e) { return e + 4 * (e >> 5); }
__device__ __forceinline__ __half2 h2(uint32_t u) { return *reinterpret_cast<__half2*>(&u); }
}
"""

BODY = r"""
  extern __shared__ float4 sm4[];
  float* xs = reinterpret_cast<float*>(sm4);
  const int k = x_shape[0], n = w_shape[0], chunks = k / 32;
  const int lane = threadIdx.x & 31, row0 = (blockIdx.x * NW + threadIdx.x / 32) * R;
  // ---- stage x
  if constexpr (DEC == 0 || DEC == 1 || DEC == 4) {
    for (int e = threadIdx.x; e < k; e += blockDim.x) xs[::probe::pad(e)] = __half2float(x[e]);
  } else if constexpr (DEC == 2) {       // chunk c: 4 words x 4 half2 (x[8i+j], x[8i+j+4]), 80 bytes apart
    uint32_t* xu = reinterpret_cast<uint32_t*>(xs);
    for (int p = threadIdx.x; p < k / 2; p += blockDim.x) {
      const int c = p / 16, i = (p % 16) / 4, j = p % 4, e = 32 * c + 8 * i + j;
      __half2 v = __halves2half2(x[e], x[e + 4]);
      xu[c * 20 + i * 4 + j] = *reinterpret_cast<uint32_t*>(&v);
    }
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
      float sum = 0.0f;
      for (int e = 0; e < 32; ++e) sum += __half2float(x[32 * c + e]);
      xs[20 * chunks + c] = sum;
    }
  } else {                               // DEC 3: chunk c: 8 int32 (A_i, B_i) 48 bytes apart; scale, sum after
    uint32_t* xu = reinterpret_cast<uint32_t*>(xs);
    float* dsc = xs + 12 * chunks;
    float* xsm = dsc + chunks;
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
      float f[32], amax = 0.0f, sum = 0.0f;
      for (int e = 0; e < 32; ++e) { f[e] = __half2float(x[32 * c + e]); amax = fmaxf(amax, fabsf(f[e])); sum += f[e]; }
      const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      for (int i = 0; i < 4; ++i) {
        uint32_t a = 0, b = 0;
        for (int j = 0; j < 4; ++j) {
          a |= (uint32_t)(uint8_t)(int8_t)__float2int_rn(f[8 * i + 2 * j] * inv) << (8 * j);
          b |= (uint32_t)(uint8_t)(int8_t)__float2int_rn(f[8 * i + 2 * j + 1] * inv) << (8 * j);
        }
        xu[12 * c + 2 * i] = a;
        xu[12 * c + 2 * i + 1] = b;
      }
      dsc[c] = d;
      xsm[c] = sum;
    }
  }
  __syncthreads();
  if (row0 >= n) return;
  const uint32_t* wr[R];
  const __half* sr[R];
  const __half* br[R];
  for (int r = 0; r < R; ++r) {
    const int row = min(row0 + r, n - 1);
    wr[r] = w + (int64_t)row * (k / 8);
    sr[r] = s + (int64_t)row * chunks;
    br[r] = b + (int64_t)row * chunks;
  }
  float tot[R];
  #pragma unroll
  for (int r = 0; r < R; ++r) tot[r] = 0.0f;
  for (int c0 = lane; c0 < chunks; c0 += 32 * U) {
    uint4 wq[U][R];
    float sc[U][R], bi[U][R];
    #pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + 32 * u;
      #pragma unroll
      for (int r = 0; r < R; ++r) {
        wq[u][r] = c < chunks ? ::probe::ldw(wr[r] + 4 * c) : make_uint4(0u, 0u, 0u, 0u);
        sc[u][r] = c < chunks ? __half2float(sr[r][c]) : 0.0f;
        bi[u][r] = c < chunks ? __half2float(br[r][c]) : 0.0f;
      }
    }
    #pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + 32 * u;
      if (c >= chunks) continue;
      if constexpr (DEC == 0) {
        const float* xc = xs + ::probe::pad(32 * c);
        float acc[R], xsum = 0.0f;
        #pragma unroll
        for (int r = 0; r < R; ++r) acc[r] = 0.0f;
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float4 a = reinterpret_cast<const float4*>(xc)[2 * i], bb = reinterpret_cast<const float4*>(xc)[2 * i + 1];
          const float xv[8] = {a.x, a.y, a.z, a.w, bb.x, bb.y, bb.z, bb.w};
          #pragma unroll
          for (int e = 0; e < 8; ++e) xsum += xv[e];
          #pragma unroll
          for (int r = 0; r < R; ++r) {
            float q[8];
            ::ref_gemv::decode(::probe::wd(wq[u][r], i), q);
            #pragma unroll
            for (int e = 0; e < 8; ++e) acc[r] = fmaf(q[e], xv[e], acc[r]);
          }
        }
        #pragma unroll
        for (int r = 0; r < R; ++r) tot[r] += fmaf(sc[u][r], acc[r], bi[u][r] * xsum);
      } else if constexpr (DEC == 1) {
        const float* xc = xs + ::probe::pad(32 * c);
        float acc[R], xa = 0.0f, xb = 0.0f;   // class A: 2048 + c (codes 0, 1, 3, 5); B: 128 + c (2, 4, 6, 7)
        #pragma unroll
        for (int r = 0; r < R; ++r) acc[r] = 0.0f;
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float4 a = reinterpret_cast<const float4*>(xc)[2 * i], bb = reinterpret_cast<const float4*>(xc)[2 * i + 1];
          xa += (a.x + a.y) + (a.w + bb.y);
          xb += (a.z + bb.x) + (bb.z + bb.w);
          #pragma unroll
          for (int r = 0; r < R; ++r) {
            const uint32_t v = ::probe::wd(wq[u][r], i);
            const uint32_t l8 = v << 8, r8 = v >> 8, l12 = v << 12, r12 = v >> 12;
            const float q0 = __uint_as_float((l12 & 0xF000u) | 0x45000000u);
            const float q1 = __uint_as_float((l8 & 0xF000u) | 0x45000000u);
            const float q2 = __uint_as_float((l8 & 0xF0000u) | 0x43000000u);
            const float q3 = __uint_as_float((v & 0xF000u) | 0x45000000u);
            const float q4 = __uint_as_float((v & 0xF0000u) | 0x43000000u);
            const float q5 = __uint_as_float((r8 & 0xF000u) | 0x45000000u);
            const float q6 = __uint_as_float((r8 & 0xF0000u) | 0x43000000u);
            const float q7 = __uint_as_float((r12 & 0xF0000u) | 0x43000000u);
            float t = acc[r];
            t = fmaf(q0, a.x, t); t = fmaf(q1, a.y, t); t = fmaf(q2, a.z, t); t = fmaf(q3, a.w, t);
            t = fmaf(q4, bb.x, t); t = fmaf(q5, bb.y, t); t = fmaf(q6, bb.z, t); t = fmaf(q7, bb.w, t);
            acc[r] = t;
          }
        }
        const float off = fmaf(2048.0f, xa, 128.0f * xb);
        #pragma unroll
        for (int r = 0; r < R; ++r) tot[r] += fmaf(sc[u][r], acc[r] - off, bi[u][r] * (xa + xb));
      } else if constexpr (DEC == 2) {
        const uint4* xc = reinterpret_cast<const uint4*>(xs + 20 * c);
        __half2 acc[R];
        const float xsum = xs[20 * chunks + c];
        #pragma unroll
        for (int r = 0; r < R; ++r) acc[r] = __float2half2_rn(0.0f);
        const __half2 k1024 = __float2half2_rn(1024.0f), k16 = __float2half2_rn(0.0625f), k64 = __float2half2_rn(-64.0f);
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
          const uint4 xw = xc[i];
          const __half2 x04 = ::probe::h2(xw.x), x15 = ::probe::h2(xw.y), x26 = ::probe::h2(xw.z), x37 = ::probe::h2(xw.w);
          #pragma unroll
          for (int r = 0; r < R; ++r) {
            const uint32_t v = ::probe::wd(wq[u][r], i), v8 = v >> 8;
            const __half2 q04 = __hsub2(::probe::h2((v & 0x000F000Fu) | 0x64006400u), k1024);
            const __half2 q15 = __hfma2(::probe::h2((v & 0x00F000F0u) | 0x64006400u), k16, k64);
            const __half2 q26 = __hsub2(::probe::h2((v8 & 0x000F000Fu) | 0x64006400u), k1024);
            const __half2 q37 = __hfma2(::probe::h2((v8 & 0x00F000F0u) | 0x64006400u), k16, k64);
            acc[r] = __hfma2(q04, x04, acc[r]);
            acc[r] = __hfma2(q15, x15, acc[r]);
            acc[r] = __hfma2(q26, x26, acc[r]);
            acc[r] = __hfma2(q37, x37, acc[r]);
          }
        }
        #pragma unroll
        for (int r = 0; r < R; ++r) {
          const float2 a = __half22float2(acc[r]);
          tot[r] += fmaf(sc[u][r], a.x + a.y, bi[u][r] * xsum);
        }
      } else if constexpr (DEC == 3) {
        const uint4* xc = reinterpret_cast<const uint4*>(xs + 12 * c);
        const float d = xs[12 * chunks + c], xsum = xs[13 * chunks + c];
        const uint4 p0 = xc[0], p1 = xc[1];
        const uint32_t xa[4] = {p0.x, p0.z, p1.x, p1.z}, xb[4] = {p0.y, p0.w, p1.y, p1.w};
        #pragma unroll
        for (int r = 0; r < R; ++r) {
          int acc = 0;
          #pragma unroll
          for (int i = 0; i < 4; ++i) {
            const uint32_t v = ::probe::wd(wq[u][r], i);
            acc = __dp4a((int)(v & 0x0F0F0F0Fu), (int)xa[i], acc);
            acc = __dp4a((int)((v >> 4) & 0x0F0F0F0Fu), (int)xb[i], acc);
          }
          tot[r] += fmaf(sc[u][r] * d, (float)acc, bi[u][r] * xsum);
        }
      } else {
        const float* xc = xs + ::probe::pad(32 * c);
        #pragma unroll
        for (int r = 0; r < R; ++r) {
          #pragma unroll
          for (int i = 0; i < 4; ++i) tot[r] = fmaf(__uint_as_float(::probe::wd(wq[u][r], i) & 0x3F7FFFFFu), xc[8 * i], tot[r]);
        }
      }
    }
  }
  #pragma unroll
  for (int r = 0; r < R; ++r) tot[r] = ::probe::wsum(tot[r]);
  if (lane < R && row0 + lane < n) {
    float v = tot[0];
    #pragma unroll
    for (int r = 1; r < R; ++r) if (lane == r) v = tot[r];
    y[row0 + lane] = v;
  }
"""

NAMES = {0: "float-trick", 1: "two-magic", 2: "half2", 3: "int8-dp4a", 4: "ceiling"}


def shared_bytes(dec: int, k: int) -> int:
    chunks = k // 32
    if dec == 2:
        return 84 * chunks
    if dec == 3:
        return 4 * 14 * chunks
    return 4 * (k + 4 * chunks + 4)


KERNELS = {}


def kern(dec: int, k: int):
    key = (dec, shared_bytes(dec, k))
    if key not in KERNELS:
        from ref_impl.kernels.cuda import HEADER as GEMV, minified
        KERNELS[key] = mx.fast.cuda_kernel(name=f"probe_dec{dec}_{key[1]}", input_names=["x", "w", "s", "b"],
                                           output_names=["y"], source=BODY, header=minified(GEMV + HEADER),
                                           shared_memory=key[1])
    return KERNELS[key]


def run(dec, x, w, s, b, R=2, U=4, NW=8):
    n, k = w.shape[0], x.shape[0]
    blocks = -(-n // (R * NW))
    return kern(dec, k)(inputs=[x, w, s, b], template=[("DEC", dec), ("R", R), ("U", U), ("NW", NW)],
                        grid=(blocks * 32 * NW, 1, 1), threadgroup=(32 * NW, 1, 1), output_shapes=[(n,)],
                        output_dtypes=[mx.float32])[0]


def timed(fn, q=10, reps=5):
    outs = [fn() for _ in range(2)]
    mx.eval(outs)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        outs = [fn() for _ in range(q)]
        mx.eval(outs)
        ts.append((time.perf_counter() - t0) / q)
    return float(np.median(ts))


def launch_cost():
    """Host microseconds per mx.fast.cuda_kernel launch with 1, 4 and 16 inputs: Python building the graph,
    then mx.eval encoding it (200 independent launches of a one-warp kernel)."""
    for n_in in (1, 4, 16):
        names = [f"a{i}" for i in range(n_in)]
        body = "  if (threadIdx.x == 0) y[0] = " + " + ".join(f"{a}[0]" for a in names) + ";\n"
        kk = mx.fast.cuda_kernel(name=f"probe_launch_{n_in}", input_names=names, output_names=["y"], source=body)
        arrs = [mx.full((4,), float(i), dtype=mx.float32) for i in range(n_in)]
        mx.eval(arrs)
        def one(t):
            return kk(inputs=arrs, template=[("T", t)], grid=(32, 1, 1), threadgroup=(32, 1, 1),
                      output_shapes=[(1,)], output_dtypes=[mx.float32])[0]
        mx.eval([one(0) for _ in range(4)])
        builds, evals = [], []
        for _ in range(5):
            t0 = time.perf_counter()
            outs = [one(0) for _ in range(200)]
            t1 = time.perf_counter()
            mx.eval(outs)
            t2 = time.perf_counter()
            builds.append((t1 - t0) / 200 * 1e6)
            evals.append((t2 - t1) / 200 * 1e6)
        print(f"launch cost, {n_in:2} inputs: build {np.median(builds):.1f} us + eval {np.median(evals):.1f} us a launch",
              flush=True)


def main():
    print(mx.__version__, mx.default_device(), flush=True)
    rng = np.random.default_rng(0)
    launch_cost()
    big = mx.array(rng.standard_normal(256 * 2**20 // 2).astype(np.float16))
    read = big.nbytes / timed(lambda: big.sum(), q=10) / 1e9
    print(f"read bandwidth (x.sum() of {big.nbytes / 1e6:.0f} MB float16): {read:.0f} GB/s", flush=True)
    del big
    # accuracy on one layer's shapes
    for n, k in ((512, 4096), (256, 14336)):
        wf = mx.array(rng.standard_normal((n, k)).astype(np.float16))
        w, s, b = mx.quantize(wf, group_size=32, bits=4)
        x = mx.array(rng.standard_normal(k).astype(np.float16))
        deq = np.array(mx.dequantize(w, s, b, group_size=32, bits=4).astype(mx.float32)).astype(np.float64)
        ref = deq @ np.array(x.astype(mx.float32)).astype(np.float64)
        scale = np.abs(ref).max()
        for dec in NAMES:
            if dec == 4:
                continue
            try:
                y = np.array(run(dec, x, w, s, b))
                print(f"accuracy {n}x{k} {NAMES[dec]:12}: max |y - y64| / max |y64| = {np.abs(y - ref).max() / scale:.1e}",
                      flush=True)
            except Exception as e:
                print(f"accuracy {n}x{k} {NAMES[dec]}: FAILED {str(e)[:2000]}", flush=True)
        mlx = np.array(mx.quantized_matmul(x[None], w, s, b, transpose=True, group_size=32, bits=4).astype(mx.float32))[0]
        print(f"accuracy {n}x{k} {'mlx':12}: max |y - y64| / max |y64| = {np.abs(mlx - ref).max() / scale:.1e}", flush=True)
    configs = [dict(R=2, U=4, NW=8), dict(R=2, U=8, NW=8), dict(R=4, U=2, NW=8), dict(R=1, U=8, NW=8)]
    for n, k, layers in ((14336, 4096, 6), (4096, 14336, 6)):
        rows = n * layers
        w = mx.array(rng.integers(0, 2**32, size=(rows, k // 8), dtype=np.uint32))
        s = mx.array((rng.standard_normal((rows, k // 32)) * 0.01).astype(np.float16))
        b = mx.array((rng.standard_normal((rows, k // 32)) * 0.01).astype(np.float16))
        x = mx.array(rng.standard_normal(k).astype(np.float16))
        mx.eval(w, s, b, x)
        nbytes = w.nbytes + s.nbytes + b.nbytes
        t = timed(lambda: mx.quantized_matmul(x[None], w, s, b, transpose=True, group_size=32, bits=4))
        line = [f"{n}x{k} x{layers} ({nbytes / 1e6:.0f} MB): mlx {nbytes / t / 1e9:.0f}"]
        for dec in NAMES:
            for cfg in configs:
                try:
                    t = timed(lambda: run(dec, x, w, s, b, **cfg))
                    line.append(f"{NAMES[dec]} R{cfg['R']}U{cfg['U']}W{cfg['NW']} {nbytes / t / 1e9:.0f}")
                except Exception as e:
                    line.append(f"{NAMES[dec]} {cfg} FAILED {str(e)[:300]}")
        print(" | ".join(line) + " GB/s", flush=True)
        del w, s, b


if __name__ == "__main__":
    sys.path.insert(0, ".")
    main()
