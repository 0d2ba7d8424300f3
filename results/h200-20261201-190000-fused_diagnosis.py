"""Diagnosis (not part of the course): does MLX CUDA's quantized_matmul handle batched (per-head) weights?"""
import mlx.core as mx
import numpy as np

print(mx.__version__, mx.default_device())
rng = np.random.default_rng(0)
for dtype in (mx.float16, mx.float32):
    for bits, group, D in ((8, 64, 64), (4, 64, 64), (8, 64, 128), (4, 32, 128)):
        B, Hkv, R, T = 1, 2, 3, 32
        k, v = (mx.array(rng.standard_normal((B, Hkv, T, D)).astype(np.float32)).astype(dtype) for _ in range(2))
        rows = mx.array(rng.standard_normal((B, Hkv, R, D)).astype(np.float32)).astype(dtype)
        kq, vq = mx.quantize(k, group, bits), mx.quantize(v, group, bits)
        kd, vd = mx.dequantize(*kq, group_size=group, bits=bits), mx.dequantize(*vq, group_size=group, bits=bits)
        s_q = mx.quantized_matmul(rows, *kq, transpose=True, group_size=group, bits=bits)
        s_d = rows @ kd.swapaxes(-1, -2)
        p = mx.softmax(s_d.astype(mx.float32), axis=-1).astype(dtype)
        o_q = mx.quantized_matmul(p, *vq, transpose=False, group_size=group, bits=bits)
        o_d = p @ vd
        # per head, 2-D weights
        s_h = mx.stack([mx.quantized_matmul(rows[:, h], *(a[:, h] for a in kq), transpose=True, group_size=group,
                                            bits=bits) for h in range(Hkv)], axis=1)
        o_h = mx.stack([mx.quantized_matmul(p[:, h], *(a[:, h] for a in vq), transpose=False, group_size=group,
                                            bits=bits) for h in range(Hkv)], axis=1)
        err = lambda a, b: float(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max())
        print(f"{dtype} bits {bits} group {group} D {D}: qk batched {err(s_q, s_d):.3g} per-head {err(s_h, s_d):.3g}; "
              f"pv batched {err(o_q, o_d):.3g} per-head {err(o_h, o_d):.3g}; nan {bool(mx.isnan(o_q).any())}",
              flush=True)
