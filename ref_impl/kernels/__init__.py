"""Custom CUDA kernels for the decode path: a bandwidth-bound GEMV, written with `mx.fast.cuda_kernel`.

Decoding one token multiplies each weight matrix by one activation row (a GEMV), so its time is the time
to read the weights. The kernels read MLX's affine 4-/8-bit layout and float16/bfloat16 matrices, for 1 to
9 activation rows, with fused gate/up and q/k/v variants that cut launches. The package, in reading order:
- launch.py: the launch rules (`Format`, `Launch`, `launch_config`, `candidates`, `occupancy`): plain
  arithmetic on shapes, no GPU needed;
- cuda.py: the CUDA C++ source the kernels are compiled from;
- layers.py: the kernels as MLX calls (`compiled_kernel`, `runner`, `gemv`) and the layers that route a
  model's matrices through them (`GEMVLinear`, `GatedMLP`, `FusedQKV`);
- patching.py: `patch` swaps those layers into a model and chooses, per shape, ours or MLX's built-in by
  timing both; `enable` switches the choices; `count_kernels` and `gemv_sweep` measure.
See chapter: dispatch-kernel
"""

from ref_impl.kernels.cuda import FUSES, input_names
from ref_impl.kernels.launch import (
    DTYPES,
    GROUP_SIZES,
    H200_FP32_TFLOPS,
    H200_SMS,
    MAX_ACCUMULATORS,
    MAX_LOADS,
    MAX_ROWS,
    REGISTERS,
    Format,
    Launch,
    Occupancy,
    candidates,
    dtype_name,
    launch_config,
    occupancy,
)
from ref_impl.kernels.layers import (
    FusedQKV,
    GatedMLP,
    GEMVLinear,
    Routed,
    compiled_kernel,
    format_of,
    gemv,
    on_cuda,
    random_layer,
    runner,
)
from ref_impl.kernels.patching import (
    BUILTIN,
    UNFUSED,
    Choice,
    count_kernels,
    enable,
    gemv_sweep,
    patch,
    summary,
    time_calls,
    time_variants,
)

__all__ = [
    "BUILTIN", "DTYPES", "FUSES", "GROUP_SIZES", "H200_FP32_TFLOPS", "H200_SMS", "MAX_ACCUMULATORS", "MAX_LOADS",
    "MAX_ROWS", "REGISTERS", "UNFUSED", "Choice", "Format", "FusedQKV", "GEMVLinear", "GatedMLP", "Launch",
    "Occupancy", "Routed", "candidates", "compiled_kernel", "count_kernels", "dtype_name", "enable", "format_of",
    "gemv", "gemv_sweep", "input_names", "launch_config", "occupancy", "on_cuda", "patch", "random_layer",
    "runner", "summary", "time_calls", "time_variants",
]
