"""The GEMV kernels as MLX calls, and the layers that route a model's matrices through them.

`compiled_kernel` wraps the CUDA source (cuda.py) in `mx.fast.cuda_kernel`; `runner` prepares one launch
(launch.py) as a plain function of x and the weight arrays, the per-call path with no checks; `gemv` is the
checked entry point. The layers keep a model's parameters and names and add routes: per activation-row
count, the launch `patch` chose for it (patching.py), run through a closure bound when the route is switched
on, with no argument checks and no nn.Module.__getattr__ lookups; every other call runs MLX's built-in, as
the layer it replaces did.
- `GEMVLinear` replaces an nn.Linear / affine nn.QuantizedLinear: one matrix, one launch.
- `GatedMLP` replaces engine.model.MLP: gate and up as one "glu" launch, silu(x Wg^T) * (x Wu^T).
- `FusedQKV` is an attention's `qkv` (engine.model.Attention.qkv: the three projections of one x): q, k and
  v as one "qkv" launch with three outputs, or the three projections' own calls.
Only MLX's CUDA backend runs the kernels (`on_cuda`); elsewhere every route stays MLX's built-in.

References: MLX docs "Custom Metal Kernels" and mlx/backend/cuda/custom_kernel.cpp (the generated
signature: `w0_shape`, template constants).
See chapter: dispatch-kernel
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn

from ref_impl.kernels.cuda import HEADER, body, input_names, minified
from ref_impl.kernels.launch import DTYPES, Format, Launch, dtype_name, launch_config


def on_cuda() -> bool:
    """True when MLX runs on its CUDA backend: the only place these kernels run."""
    return mx.cuda.is_available() and mx.default_device() == mx.gpu


@functools.cache
def compiled_kernel(dense: bool, fuse: str = ""):
    """The `mx.fast.cuda_kernel` for dense (float16/bfloat16) or affine weights and a fusion ("", "glu",
    "qkv"), made once per process; NVRTC compiles it at its first call with each template."""
    outputs = ["y0", "y1", "y2"] if fuse == "qkv" else ["y0"]
    name = f"ref_gemv_{'dense' if dense else 'affine'}{'_' + fuse if fuse else ''}"
    return mx.fast.cuda_kernel(name=name, input_names=input_names(dense, fuse), output_names=outputs,
                               source=body(dense, fuse), header=minified(HEADER))


@functools.cache
def runner(launch: Launch) -> Callable[..., list[mx.array]]:
    """run(x, *arrays) -> outputs for this launch, without checks: the per-call path. arrays: per matrix
    (w,) or (w, scales, biases), as `input_names`; x (..., k) gives outputs (..., n) (qkv: one per part)."""
    kern = compiled_kernel(launch.fmt.bits == 16, launch.fuse)
    tpl, grid, tg = launch.template, launch.grid, launch.threadgroup
    sizes = launch.parts if launch.fuse == "qkv" else (launch.n,)
    dts = [DTYPES[launch.fmt.dtype]] * len(sizes)

    def run(x: mx.array, *arrays: mx.array) -> list[mx.array]:
        lead = x.shape[:-1]
        return kern(inputs=[x, *arrays], template=tpl, grid=grid, threadgroup=tg,
                    output_shapes=[(*lead, s) for s in sizes], output_dtypes=dts)
    return run


def gemv(x: mx.array, mats: Sequence[tuple[mx.array, ...]], fmt: Format, fuse: str = "",
         launch: Launch | None = None) -> list[mx.array]:
    """The checked entry point: x (..., k) against each matrix of `mats` ((w,) dense, (w, scales, biases)
    affine), accumulated in float32, 1 to 9 rows. fuse "": one matrix, [y]; "glu": (gate, up),
    [silu(x Wg^T) * (x Wu^T)]; "qkv": three matrices, [x Wq^T, x Wk^T, x Wv^T]."""
    if x.dtype not in DTYPES.values() or dtype_name(x.dtype) != fmt.dtype:
        raise ValueError(f"unsupported activation dtype {x.dtype}: the kernels take float16 or bfloat16, "
                         f"as the weights' {fmt.dtype}")
    want = {"": 1, "glu": 2, "qkv": 3}.get(fuse)
    if want is None or len(mats) != want:
        raise ValueError(f"fuse={fuse!r} takes {want} matrices, got {len(mats)}")
    shapes = []
    for arrays in mats:
        w = arrays[0]
        if fmt.bits == 16:
            if len(arrays) != 1 or w.ndim != 2 or w.dtype != x.dtype:
                raise ValueError(f"w must be a {x.dtype} matrix (n, k), got {w.dtype} of shape {w.shape}")
            n, k = w.shape
        else:
            if len(arrays) != 3 or w.dtype != mx.uint32 or w.ndim != 2:
                raise ValueError(f"w must be uint32 (n, k * bits / 32) codes, got {w.dtype} of shape {w.shape}")
            n, k = w.shape[0], w.shape[1] * 32 // fmt.bits
            for name, a in zip(("scales", "biases"), arrays[1:]):
                if a.shape != (n, k // fmt.group_size) or a.dtype != x.dtype:
                    raise ValueError(f"{name} must be {x.dtype} of shape {(n, k // fmt.group_size)}, "
                                     f"got {a.dtype} {a.shape}")
        shapes.append((n, k))
    k = shapes[0][1]
    if x.ndim < 1 or x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1] if x.ndim else 0} features, the matrix {shapes[0]} takes {k}")
    if any(s[1] != k for s in shapes) or (fuse == "glu" and shapes[0] != shapes[1]):
        raise ValueError(f"fused matrices must agree: {shapes}")
    rows = x.size // k
    n, parts = (sum(s[0] for s in shapes), tuple(s[0] for s in shapes)) if fuse == "qkv" else (shapes[0][0], ())
    if launch is None:
        launch = launch_config(fmt, n, k, rows, fuse=fuse, parts=parts)
    elif (launch.fmt, launch.n, launch.k, launch.rows, launch.fuse, launch.parts) != (fmt, n, k, rows, fuse, parts):
        raise ValueError(f"launch for {launch.fmt.name} ({launch.rows}, {launch.k}) x ({launch.n}, {launch.k}) "
                         f"{launch.fuse} used for {fmt.name} ({rows}, {k}) x ({n}, {k}) {fuse}")
    if not on_cuda():
        raise RuntimeError(f"the GEMV kernels need MLX's CUDA backend; this is {mx.default_device()} "
                           "(use mx.quantized_matmul or matmul)")
    return runner(launch)(x, *[a for arrays in mats for a in arrays])


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


def _plain(obj: object, name: str, value: object) -> None:
    """Set an attribute that nn.Module must not treat as a parameter (a dict), found without __getattr__."""
    object.__setattr__(obj, name, value)


class Routed:
    """What GEMVLinear, GatedMLP and FusedQKV share: per activation-row count, the launch chosen for it
    (None: MLX's built-in, or the unfused calls) and, while switched on, the prepared call (`bind`) that
    runs it. A subclass defines bind(launch)."""

    def __init__(self):
        super().__init__()
        _plain(self, "_chosen", {})    # rows -> Launch (None: the built-in), what patch measured
        _plain(self, "_runs", {})      # rows -> run(x): what calls use now (`use`, `switch`)

    def use(self, rows: int, launch: Launch | None) -> None:
        """Run calls of `rows` activation rows with `launch` (None: MLX's built-in), from now on."""
        self._chosen[rows] = launch
        self._runs.pop(rows, None)
        if launch is not None:
            self._runs[rows] = self.bind(launch)

    def switch(self, on: bool) -> None:
        """Run the chosen launches (on) or MLX's built-ins (off) from now on; the choices are kept."""
        self._runs.clear()
        if on:
            self._runs.update({r: self.bind(la) for r, la in self._chosen.items() if la is not None})


class GEMVLinear(Routed, nn.Module):
    """An nn.Linear / affine nn.QuantizedLinear (same parameters, same names) whose calls with a row count
    it has a run for go to our kernel; every other call runs MLX's built-in, as the layer it replaces did."""

    def __init__(self, layer: nn.Module, fmt: Format):
        super().__init__()
        self.fmt = fmt
        self.weight = layer.weight
        if fmt.bits != 16:
            self.scales, self.biases = layer.scales, layer.biases
        if "bias" in layer:
            self.bias = layer.bias
        self.act_dtype = DTYPES[fmt.dtype]

    @property
    def shape(self) -> tuple[int, int]:
        """(n, k): outputs and inputs."""
        n, cols = self.weight.shape
        return n, cols * 32 // self.fmt.bits if self.fmt.bits != 16 else cols

    def arrays(self) -> tuple[mx.array, ...]:
        """The kernel inputs of this matrix: (w,) or (w, scales, biases)."""
        return (self["weight"],) if self.fmt.bits == 16 else (self["weight"], self["scales"], self["biases"])

    def bind(self, launch: Launch) -> Callable[[mx.array], mx.array]:
        """Our GEMV with this launch, as a one-argument function of x (no checks)."""
        run = runner(launch)
        if self.fmt.bits == 16:
            return lambda x: run(x, self["weight"])[0]
        return lambda x: run(x, self["weight"], self["scales"], self["biases"])[0]

    def builtin(self, x: mx.array) -> mx.array:
        """MLX's own matmul, as the replaced layer computed it."""
        if self.fmt.bits == 16:
            return x @ self["weight"].T
        return mx.quantized_matmul(x, self["weight"], self["scales"], self["biases"], transpose=True,
                                   group_size=self.fmt.group_size, bits=self.fmt.bits)

    def kernel(self, x: mx.array, launch: Launch) -> mx.array:
        """Our GEMV with this launch, checked."""
        return gemv(x, [self.arrays()], self.fmt, "", launch)[0]

    def __call__(self, x: mx.array) -> mx.array:
        run = self._runs.get(x.size // x.shape[-1]) if x.dtype == self.act_dtype else None
        y = self.builtin(x) if run is None else run(x)
        return y + self["bias"] if "bias" in self else y


class GatedMLP(Routed, nn.Module):
    """model.MLP (same children, same parameter names) whose gate and up projections run as one fused
    kernel, silu(x Wg^T) * (x Wu^T), for the row counts it has a run for; otherwise as model.MLP."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj

    def bind(self, launch: Launch) -> Callable[[mx.array], mx.array]:
        run, g, u = runner(launch), self.gate_proj, self.up_proj
        return lambda x: run(x, *g.arrays(), *u.arrays())[0]

    def hidden(self, x: mx.array) -> mx.array:
        """silu(gate) * up, as model.MLP computes it (through the projections' own routes)."""
        return nn.silu(self.gate_proj(x)) * self.up_proj(x)

    def __call__(self, x: mx.array) -> mx.array:
        run = self._runs.get(x.size // x.shape[-1]) if x.dtype == self.gate_proj.act_dtype else None
        return self.down_proj(self.hidden(x) if run is None else run(x))


class FusedQKV(Routed):
    """An attention's q, k and v projections (GEMVLinears of one format and input width) as one call of x:
    (q, k, v). patch sets it as the attention's `qkv` (engine.model.Attention.qkv, which it replaces on that
    instance); the row counts it has a run for take one fused launch, the others the three projections'
    own calls. It holds the projections, not their parameters: they stay the attention's children."""

    def __init__(self, q: GEMVLinear, k: GEMVLinear, v: GEMVLinear):
        super().__init__()
        self.mods = (q, k, v)
        self.act_dtype = q.act_dtype

    @property
    def fmt(self) -> Format:
        return self.mods[0].fmt

    @property
    def shape(self) -> tuple[tuple[int, ...], int]:
        """((n_q, n_k, n_v), k): each projection's outputs, and their common inputs."""
        return tuple(m.shape[0] for m in self.mods), self.mods[0].shape[1]

    def bind(self, launch: Launch) -> Callable[[mx.array], list[mx.array]]:
        run, (q, k, v) = runner(launch), self.mods
        return lambda x: run(x, *q.arrays(), *k.arrays(), *v.arrays())

    def unfused(self, x: mx.array) -> list[mx.array]:
        """The three projections' own calls (each through its own route)."""
        return [m(x) for m in self.mods]

    def __call__(self, x: mx.array) -> list[mx.array]:
        run = self._runs.get(x.size // x.shape[-1]) if x.dtype == self.act_dtype else None
        return self.unfused(x) if run is None else run(x)


def random_layer(fmt: Format, n: int, k: int, seed: int = 0) -> GEMVLinear:
    """A GEMVLinear (n outputs, k inputs) of random weights in fmt: GEMV speed does not depend on the values."""
    w = (mx.random.normal((n, k), key=mx.random.key(seed)) * 0.02).astype(DTYPES[fmt.dtype])
    layer = nn.Linear(k, n, bias=False)
    layer.weight = w
    if fmt.bits != 16:
        layer = nn.QuantizedLinear.from_linear(layer, fmt.group_size, fmt.bits)
    mx.eval(layer.parameters())
    return GEMVLinear(layer, fmt)
