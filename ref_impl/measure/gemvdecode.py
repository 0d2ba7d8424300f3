"""The 4-bit GEMV's inner loop five ways: what each way of decoding codes costs in read bandwidth ("gemv-decode").

One warp computes R rows of y = W x for MLX's affine 4-bit codes (groups of 32, float16 scales and biases),
lane l reading 16-byte chunks l, l+32, ... (U a row in flight) against x staged once per block in shared
memory, as the fused layer's matrix kernels do (kernels/fusedlayer_cuda.py). Only the decode of a 32-bit word
of 8 codes differs (DECODES):
- "float-trick": the kernels' first decode: each code OR-ed into the mantissa of 2^23, an FMA removes the
  2^23, then an FMA by x;
- "two-magic": today's (cuda.py `decode` and `affine`): codes OR-ed into 2048.0 or 128.0, the float 2048 + c
  or 128 + c times x exact in float32, the offsets removed once a chunk through two sums of x;
- "half2": codes OR-ed into float16 pairs, multiplied by x pairs and summed in float16;
- "int8-dp4a": x rounded to 8-bit integers per chunk of 32 (llama.cpp's q8_1), two dp4a a word;
- "ceiling": no decode, one FMA a word: what the loop itself allows.

`bench_gemv_decode` (`python -m ref_impl bench --gemv-decode`) checks each decode against a float64 product of
the dequantized matrix (the largest error over the largest |y|), then times each on 8B layers stacked to some
220 MB a launch (queued, graph built first: `kernels.time_calls`) for each launch of LAUNCHES, against MLX's
`mx.quantized_matmul`; it records this machine's roofs (`decode.roofs`) and what a custom kernel's launch
costs the host (`launch_cost`: building the call in Python, then MLX encoding it; by its inputs, and with the
fused layer's header or none).

References: the magic-number conversion of 4-bit codes (Kim et al., "Who Says Elephants Can't Run", 2022);
llama.cpp ggml-cuda vecdotq.cuh (8-bit activations and dp4a); MLX mlx/backend/cuda/custom_kernel.cpp.
See chapter: dispatch-kernel
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Sequence

import mlx.core as mx
import numpy as np

from ref_impl import kernels
from ref_impl.kernels import fusedlayer_cuda
from ref_impl.kernels.cuda import HEADER as GEMV_HEADER
from ref_impl.kernels.cuda import minified
from ref_impl.measure.decode import roofs
from ref_impl.measure.records import record
from ref_impl.platform.timing import clock, median

DECODES = ("float-trick", "two-magic", "half2", "int8-dp4a", "ceiling")   # DEC 0..4 in BODY
LAUNCHES = ((2, 4, 8), (2, 8, 8), (4, 2, 8), (1, 8, 8))        # (rows a warp R, loads in flight U, warps a block)
ACCURACY_SHAPES = ((512, 4096), (256, 14336))                  # (n, k): one layer's rows of the 8B matrices
TIMED_SHAPES = ((14336, 4096, 6), (4096, 14336, 6))            # (n, k, layers stacked): ~220 MB a launch
# the kernels whose launch is timed: (inputs, with the fused layer's header): MLX rebuilds a custom kernel's
# source (header, signature, body) at every call, so the header's length may cost host time as the inputs do
LAUNCH_CASES = ((1, False), (4, False), (16, False), (1, True), (16, True))

HEADER = r"""
namespace gemv_decode {
__device__ __forceinline__ uint4 ldw(const uint32_t* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ uint32_t wd(const uint4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }
__device__ __forceinline__ int pad(int e) { return e + 4 * (e >> 5); }
__device__ __forceinline__ __half2 h2(uint32_t u) { return *reinterpret_cast<__half2*>(&u); }
// the kernels' first decode: code e (bits 4e..4e+3) OR-ed into the mantissa of 2^23, scaled back and 2^23
// removed by one FMA; codes 5-7 come from the word shifted by 20, so the mask never leaves the mantissa
__device__ __forceinline__ void float_trick(uint32_t v, float (&q)[8]) {
  #pragma unroll
  for (int e = 0; e < 8; ++e) {
    const int j = e < 5 ? e : e - 5;
    const uint32_t src = e < 5 ? v : v >> 20;
    const float inv = 1.0f / float(1u << (4 * j));
    q[e] = fmaf(__uint_as_float((src & (0xFu << (4 * j))) | 0x4B000000u), inv, -8388608.0f * inv);
  }
}
}
"""

BODY = r"""
  extern __shared__ float4 sm4[];
  float* xs = reinterpret_cast<float*>(sm4);
  const int k = x_shape[0], n = w_shape[0], chunks = k / 32;
  const int lane = threadIdx.x & 31, row0 = (blockIdx.x * NW + threadIdx.x / 32) * R;
  if constexpr (DEC == 0 || DEC == 1 || DEC == 4) {        // x as floats, four pad floats after every 32
    for (int e = threadIdx.x; e < k; e += blockDim.x) xs[::gemv_decode::pad(e)] = __half2float(x[e]);
  } else if constexpr (DEC == 2) {                         // chunk c: 4 words x 4 half2 (x[8i+j], x[8i+j+4]); sums after
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
  } else {                                                 // DEC 3: chunk c: 8 int32 of x in 8 bits; scale, sum after
    uint32_t* xu = reinterpret_cast<uint32_t*>(xs);
    float* dsc = xs + 12 * chunks;
    float* xsm = dsc + chunks;
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
      float f[32], amax = 0.0f, sum = 0.0f;
      for (int e = 0; e < 32; ++e) { f[e] = __half2float(x[32 * c + e]); amax = fmaxf(amax, fabsf(f[e])); sum += f[e]; }
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      for (int i = 0; i < 4; ++i) {
        uint32_t a = 0, b = 0;
        for (int j = 0; j < 4; ++j) {
          a |= (uint32_t)(uint8_t)(int8_t)__float2int_rn(f[8 * i + 2 * j] * inv) << (8 * j);
          b |= (uint32_t)(uint8_t)(int8_t)__float2int_rn(f[8 * i + 2 * j + 1] * inv) << (8 * j);
        }
        xu[12 * c + 2 * i] = a;
        xu[12 * c + 2 * i + 1] = b;
      }
      dsc[c] = amax / 127.0f;
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
        wq[u][r] = c < chunks ? ::gemv_decode::ldw(wr[r] + 4 * c) : make_uint4(0u, 0u, 0u, 0u);
        sc[u][r] = c < chunks ? __half2float(sr[r][c]) : 0.0f;
        bi[u][r] = c < chunks ? __half2float(br[r][c]) : 0.0f;
      }
    }
    #pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + 32 * u;
      if (c >= chunks) continue;
      if constexpr (DEC == 0 || DEC == 1) {
        const float* xc = xs + ::gemv_decode::pad(32 * c);
        float acc[R], xe = 0.0f, xo = 0.0f;                // sums of x at even and odd positions
        #pragma unroll
        for (int r = 0; r < R; ++r) acc[r] = 0.0f;
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float4 a = reinterpret_cast<const float4*>(xc)[2 * i], bb = reinterpret_cast<const float4*>(xc)[2 * i + 1];
          const float xv[8] = {a.x, a.y, a.z, a.w, bb.x, bb.y, bb.z, bb.w};
          xe += (a.x + a.z) + (bb.x + bb.z);
          xo += (a.y + a.w) + (bb.y + bb.w);
          #pragma unroll
          for (int r = 0; r < R; ++r) {
            float q[8];
            if constexpr (DEC == 0) ::gemv_decode::float_trick(::gemv_decode::wd(wq[u][r], i), q);
            else ::ref_gemv::decode(::gemv_decode::wd(wq[u][r], i), q);
            #pragma unroll
            for (int e = 0; e < 8; ++e) acc[r] = fmaf(q[e], xv[e], acc[r]);
          }
        }
        #pragma unroll
        for (int r = 0; r < R; ++r) {
          tot[r] += DEC == 0 ? fmaf(sc[u][r], acc[r], bi[u][r] * (xe + xo))
                             : ::ref_gemv::affine<4>(sc[u][r], bi[u][r], acc[r], xe, xo);
        }
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
          const __half2 x04 = ::gemv_decode::h2(xw.x), x15 = ::gemv_decode::h2(xw.y);
          const __half2 x26 = ::gemv_decode::h2(xw.z), x37 = ::gemv_decode::h2(xw.w);
          #pragma unroll
          for (int r = 0; r < R; ++r) {
            const uint32_t v = ::gemv_decode::wd(wq[u][r], i), v8 = v >> 8;
            const __half2 q04 = __hsub2(::gemv_decode::h2((v & 0x000F000Fu) | 0x64006400u), k1024);
            const __half2 q15 = __hfma2(::gemv_decode::h2((v & 0x00F000F0u) | 0x64006400u), k16, k64);
            const __half2 q26 = __hsub2(::gemv_decode::h2((v8 & 0x000F000Fu) | 0x64006400u), k1024);
            const __half2 q37 = __hfma2(::gemv_decode::h2((v8 & 0x00F000F0u) | 0x64006400u), k16, k64);
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
            const uint32_t v = ::gemv_decode::wd(wq[u][r], i);
            acc = __dp4a((int)(v & 0x0F0F0F0Fu), (int)xa[i], acc);
            acc = __dp4a((int)((v >> 4) & 0x0F0F0F0Fu), (int)xb[i], acc);
          }
          tot[r] += fmaf(sc[u][r] * d, (float)acc, bi[u][r] * xsum);
        }
      } else {
        const float* xc = xs + ::gemv_decode::pad(32 * c);
        #pragma unroll
        for (int r = 0; r < R; ++r) {
          #pragma unroll
          for (int i = 0; i < 4; ++i) {
            tot[r] = fmaf(__uint_as_float(::gemv_decode::wd(wq[u][r], i) & 0x3F7FFFFFu), xc[8 * i], tot[r]);
          }
        }
      }
    }
  }
  #pragma unroll
  for (int r = 0; r < R; ++r) tot[r] = ::ref_gemv::warp_sum(tot[r]);
  if (lane < R && row0 + lane < n) {
    float v = tot[0];
    #pragma unroll
    for (int r = 1; r < R; ++r) if (lane == r) v = tot[r];
    y[row0 + lane] = v;
  }
"""


def shared_bytes(decode: str, k: int) -> int:
    """Bytes of shared memory a block stages x in for `decode`: floats padded (fusedlayer.padded), float16
    pairs and sums (half2), or 8-bit codes, scales and sums (int8-dp4a)."""
    chunks = k // 32
    if decode == "half2":
        return 84 * chunks
    if decode == "int8-dp4a":
        return 4 * 14 * chunks
    return 4 * (k + 4 * chunks + 4)


@functools.cache
def decode_kernel(shared: int):
    """The five loops' `mx.fast.cuda_kernel` with `shared` bytes of shared memory (the decode is a template
    constant); its name carries a hash of the source, since MLX caches compiled kernels by name."""
    header = minified(GEMV_HEADER + HEADER)
    digest = hashlib.sha1((header + BODY).encode()).hexdigest()[:10]
    return mx.fast.cuda_kernel(name=f"gemv_decode_{digest}_{shared}", input_names=["x", "w", "s", "b"],
                               output_names=["y"], source=BODY, header=header, shared_memory=shared)


def run_decode(decode: str, x: mx.array, w: mx.array, s: mx.array, b: mx.array,
               launch: tuple[int, int, int] = LAUNCHES[0]) -> mx.array:
    """y (n,) float32 = W x by one of DECODES, W in MLX's affine 4-bit layout (groups of 32: w (n, k/8) uint32,
    s and b (n, k/32) float16), x (k,) float16, at launch (R, U, warps a block)."""
    rows, unroll, warps = launch
    n, k = w.shape[0], x.shape[0]
    blocks = -(-n // (rows * warps))
    return decode_kernel(shared_bytes(decode, k))(
        inputs=[x, w, s, b], template=[("DEC", DECODES.index(decode)), ("R", rows), ("U", unroll), ("NW", warps)],
        grid=(blocks * 32 * warps, 1, 1), threadgroup=(32 * warps, 1, 1), output_shapes=[(n,)],
        output_dtypes=[mx.float32])[0]


def relative_error(y: np.ndarray, reference: np.ndarray) -> float:
    """max |y - reference| / max |reference|: the error the chapter states for a GEMV."""
    return float(np.abs(y - reference).max() / np.abs(reference).max())


def accuracy_records(rng: np.random.Generator, fields: dict) -> list[dict]:
    """gemv-decode "max_error" records: every decode but the ceiling, and MLX's quantized_matmul, against a
    float64 product of the dequantized matrix, per ACCURACY_SHAPES."""
    out = []
    for n, k in ACCURACY_SHAPES:
        w, s, b = mx.quantize(mx.array(rng.standard_normal((n, k)).astype(np.float16)), group_size=32, bits=4)
        x = mx.array(rng.standard_normal(k).astype(np.float16))
        deq = np.array(mx.dequantize(w, s, b, group_size=32, bits=4).astype(mx.float32)).astype(np.float64)
        reference = deq @ np.array(x.astype(mx.float32)).astype(np.float64)
        ys = {d: run_decode(d, x, w, s, b) for d in DECODES if d != "ceiling"}
        ys[kernels.BUILTIN] = mx.quantized_matmul(x[None], w, s, b, transpose=True, group_size=32, bits=4)[0]
        for name, y in ys.items():
            out.append(record("gemv-decode", "max_error", "fraction",
                              relative_error(np.array(y.astype(mx.float32)), reference), **fields, variant=name,
                              shape=[n, k], note="max |y - y64| / max |y64|, y64 the float64 product"))
    return out


def bandwidth_records(rng: np.random.Generator, fields: dict, launches: Sequence[tuple[int, int, int]],
                      passes: int, say: Callable[[str], None]) -> list[dict]:
    """gemv-decode "bandwidth" records: GB/s (the codes, scales and biases over the queued time a call) of
    MLX's quantized_matmul and of every decode at every launch, per TIMED_SHAPES."""
    out = []
    for n, k, layers in TIMED_SHAPES:
        rows = n * layers
        w = mx.array(rng.integers(0, 2**32, size=(rows, k // 8), dtype=np.uint32))
        s, b = (mx.array((rng.standard_normal((rows, k // 32)) * 0.01).astype(np.float16)) for _ in range(2))
        x = mx.array(rng.standard_normal(k).astype(np.float16))
        mx.eval(w, s, b, x)
        nbytes = w.nbytes + s.nbytes + b.nbytes
        calls = {(kernels.BUILTIN, None): [lambda v: mx.quantized_matmul(v[None], w, s, b, transpose=True,
                                                                         group_size=32, bits=4)]}
        calls |= {(d, la): [lambda v, d=d, la=la: run_decode(d, v, w, s, b, la)] for d in DECODES for la in launches}
        per_call, _, errors = kernels.time_calls(calls, x, passes)
        extra = {"shape": [n, k], "layers": layers, "bytes": nbytes}
        for (name, la), seconds in per_call.items():
            launch = None if la is None else {"rows_per_warp": la[0], "unroll": la[1], "warps": la[2]}
            out.append(record("gemv-decode", "bandwidth", "GB/s", nbytes / seconds / 1e9, **fields, variant=name,
                              **extra, launch=launch))
        out += [record("gemv-decode", "bandwidth", "GB/s", None, **fields, variant=name, **extra,
                       launch={"rows_per_warp": la[0], "unroll": la[1], "warps": la[2]}, note=f"failed: {e[:300]}")
                for (name, la), e in errors.items()]
        say(f"gemv-decode {n}x{k} x{layers} ({nbytes / 1e6:.0f} MB): " + ", ".join(
            f"{name}{'' if la is None else ' R%dU%dW%d' % la} {nbytes / t / 1e9:.0f}"
            for (name, la), t in per_call.items())
            + " GB/s")
    return out


def launch_cost(inputs: int, header: str = "", launches: int = 200, reps: int = 5) -> tuple[float, float]:
    """(build, eval) host µs a launch of a one-warp `mx.fast.cuda_kernel` with `inputs` inputs and `header`
    (its body uses none of it): Python building `launches` independent calls, then mx.eval encoding and
    running them (medians of `reps`)."""
    names = [f"a{i}" for i in range(inputs)]
    body = "  if (threadIdx.x == 0) y[0] = " + " + ".join(f"{a}[0]" for a in names) + ";\n"
    kern = mx.fast.cuda_kernel(name=f"gemv_decode_launch_{inputs}_{len(header)}", input_names=names,
                               output_names=["y"], source=body, header=header)
    arrays = [mx.full((4,), float(i), dtype=mx.float32) for i in range(inputs)]
    mx.eval(arrays)

    def one() -> mx.array:
        return kern(inputs=arrays, template=[("T", 0)], grid=(32, 1, 1), threadgroup=(32, 1, 1),
                    output_shapes=[(1,)], output_dtypes=[mx.float32])[0]
    mx.eval([one() for _ in range(4)])
    builds, evals = [], []
    for _ in range(reps):
        t0 = clock()
        outs = [one() for _ in range(launches)]
        t1 = clock()
        mx.eval(outs)
        builds.append((t1 - t0) / launches * 1e6)
        evals.append((clock() - t1) / launches * 1e6)
    return median(builds), median(evals)


def bench_gemv_decode(launches: Sequence[tuple[int, int, int]] = LAUNCHES, passes: int = 10, seed: int = 0,
                      roof_bytes: int = 1 << 30, progress: Callable[[str], None] | None = None) -> list[dict]:
    """The five 4-bit decodes (DECODES) against MLX's quantized_matmul: accuracy against float64, GB/s per
    launch on stacked 8B layers, with this machine's roofs and a custom kernel's launch cost on the host.
    Off MLX's CUDA backend: one "skipped" record, at once."""
    say = progress or (lambda msg: None)
    fields = {"model": "Llama-3.1-8B", "weights": "q4g32", "kv": None, "context": None}
    if not kernels.on_cuda():
        return [record("gemv-decode", "skipped", None, None, **fields,
                       note=f"skipped: needs MLX's CUDA backend; this is {mx.default_device()}")]
    out = []
    layer_header = minified(fusedlayer_cuda.HEADER)
    for n_in, with_header in LAUNCH_CASES:
        header = layer_header if with_header else ""
        build, evaluate = launch_cost(n_in, header)
        out.append(record("gemv-decode", "launch_us", "us", build + evaluate, variant="launch", inputs=n_in,
                          header_bytes=len(header), build_us=build, eval_us=evaluate,
                          note="host µs a launch of a one-warp custom kernel: Python's build, then mx.eval"))
        say(f"launch cost, {n_in:2} inputs, {len(header):,}-byte header: build {build:.1f} us + eval "
            f"{evaluate:.1f} us a launch")
    out += roofs(roof_bytes)
    rng = np.random.default_rng(seed)
    out += accuracy_records(rng, fields)
    out += bandwidth_records(rng, fields, launches, passes, say)
    return out
