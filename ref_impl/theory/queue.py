"""Dispatch: a discrete-event model of a GPU command queue during decode.

The CPU encodes each kernel of a token into a command buffer, commits the buffer when it holds
`kernels_per_buffer` kernels (or the token ends), and the GPU runs committed kernels in order.
How the host waits decides how much of this overlaps: `per_buffer` waits on every buffer (no
overlap at all), `per_token` waits once per token (the GPU runs early buffers while the CPU
encodes later ones; the plain loop in `generate.py`), and `double_buffer` keeps `depth` tokens in
flight, encoding token t+1 while the GPU runs token t (`generate(..., pipeline=True)`, which queues
step t+1 with `mx.async_eval` before reading token t). Every wait costs `sync_s` (the host's
wake-up after blocking, or the completion check if the GPU was already done), then the host does
`host_s` of per-token work (reading the token back, sampling, detokenizing).

Steady-state seconds per token, with n kernels, E = n·e + B·c of CPU encode+commit per token
(B buffers), G = sum of kernel times per token, s = sync, h = host (`steady_period`):
  per_buffer     P = E + G + B·s + h                      (exact: nothing overlaps)
  per_token      P = F + s + h, F = max_j (C_j + G_j + ... + G_B), C_j = commit end of buffer j
                   CPU-bound (each buffer runs before the next is committed): F = E + G_B
                   GPU-bound (the GPU never waits for a buffer):              F = n_1·e + c + G
                   one buffer per token: F = n·e + c + n·g, both cases alike
  double_buffer  P = max(E + s + h, G)                    (any depth >= 2, any B)
                   CPU-bound: E + s + h, the GPU idles (E + s + h) - G per token;
                   GPU-bound: G, the GPU never idles and the host's work is hidden;
                   balanced (E + s + h = G): both are busy all the time, half of per_token's
                   n·e + c + n·g + s + h when one buffer holds the token.
`steady_period` is the inter-token latency once the pipeline is full; `simulate` also shows the
fill (the first token; and a GPU-bound queue fills for about
(depth - 1)·G / (G - E - s - h) tokens while the host runs ahead) and the drain (the last token
skips an encode: `generate.py` queues one step more than it yields).

`ref_impl.measure.latency` measures through MLX what this model takes as given.

References: Apple, Metal "Setting Up a Command Structure" (MTLCommandBuffer commit,
waitUntilCompleted); NVIDIA CUDA Programming Guide, "Asynchronous Concurrent Execution";
ml-explore/mlx-lm `generate.py` `generate_step` (async_eval before `.item()`).

See chapter: dispatch
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import plotly.graph_objects as go

from ref_impl import viz

POLICIES = ("per_buffer", "per_token", "double_buffer")
KINDS = {  # kind -> colour; CPU: encode, commit, wait, sync, host; GPU: kernel, idle
    "encode": viz.PALETTE[0], "commit": viz.PALETTE[5], "wait": "#9a9a9a", "sync": viz.PALETTE[3],
    "host": viz.PALETTE[4], "kernel": viz.PALETTE[2], "idle": "#dedede"}


@dataclass
class QueueConfig:
    """One decode workload on one queue. Times are seconds; each is a calibration input."""
    kernels_per_token: int = 48
    encode_s: float = 3e-6                        # CPU time to encode one kernel
    gpu_s: float | Sequence[float] = 8e-6         # GPU time per kernel: one value, or one per kernel
    kernels_per_buffer: int = 16
    commit_s: float = 10e-6                       # CPU time to commit one command buffer
    sync_s: float = 20e-6                         # what each wait costs the host beyond the GPU work
    host_s: float = 60e-6                         # per-token host work: .item(), sampling, detokenize
    policy: str = "per_token"
    depth: int = 2                                # tokens in flight (double_buffer; 1 = per_token)
    n_tokens: int = 16
    jitter: float = 0.0                           # relative spread of kernel times (lognormal, mean 1)
    seed: int = 0

    def __post_init__(self):
        try:
            g = np.asarray(self.gpu_s, dtype=float)
        except (TypeError, ValueError):
            raise ValueError(f"invalid QueueConfig: gpu_s={self.gpu_s!r} (must be a number or one per kernel)")
        bad = [f"{name}={value!r} (must be {rule})" for name, value, rule, ok in [
            ("kernels_per_token", self.kernels_per_token, "an int >= 1", _count(self.kernels_per_token)),
            ("kernels_per_buffer", self.kernels_per_buffer, "an int >= 1", _count(self.kernels_per_buffer)),
            ("n_tokens", self.n_tokens, "an int >= 1", _count(self.n_tokens)),
            ("depth", self.depth, "an int >= 1", _count(self.depth)),
            *[(name, getattr(self, name), "finite and >= 0", _time(getattr(self, name)))
              for name in ("encode_s", "commit_s", "sync_s", "host_s", "jitter")],
            ("gpu_s", self.gpu_s, "finite and >= 0: one value or one per kernel",
             g.ndim == 0 or g.shape == (self.kernels_per_token,)),
            ("policy", self.policy, f"one of {POLICIES}", self.policy in POLICIES)] if not ok]
        if not bad and not (np.all(np.isfinite(g)) and np.all(g >= 0)):
            bad = [f"gpu_s={self.gpu_s!r} (must be finite and >= 0)"]
        if bad:
            raise ValueError("invalid QueueConfig: " + ", ".join(bad))

    def buffers(self) -> list[tuple[int, int]]:
        """Kernel index ranges [lo, hi) of each command buffer in one token."""
        n, b = self.kernels_per_token, self.kernels_per_buffer
        return [(lo, min(lo + b, n)) for lo in range(0, n, b)]

    def kernel_times(self) -> np.ndarray:
        """GPU seconds of each kernel of each token (n_tokens, kernels_per_token), jittered if asked."""
        n = self.kernels_per_token
        g = np.broadcast_to(np.asarray(self.gpu_s, dtype=float), (n,))
        times = np.tile(g, (self.n_tokens, 1))
        if self.jitter > 0:  # multiplicative, mean 1: exp(N(-j²/2, j²))
            z = np.random.default_rng(self.seed).standard_normal(times.shape)
            times = times * np.exp(self.jitter * z - self.jitter ** 2 / 2)
        return times


def _count(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool) and x >= 1


def _time(x) -> bool:
    return isinstance(x, (int, float, np.number)) and math.isfinite(x) and x >= 0


@dataclass(frozen=True)
class Interval:
    """What one lane did from start to end (seconds): kind is a key of KINDS."""
    lane: str          # "CPU" or "GPU"
    kind: str
    start: float
    end: float
    token: int = -1    # -1: not tied to one token (GPU idle)
    buffer: int = -1

    @property
    def label(self) -> str:
        where = f"token {self.token}" + (f", buffer {self.buffer}" if self.buffer >= 0 else "")
        return self.kind if self.token < 0 else f"{self.kind} ({where})"


@dataclass
class Timeline:
    """Everything `simulate` saw: both lanes, each kernel's commit/start/end, each token's arrival."""
    config: QueueConfig
    commit_time: np.ndarray            # (n_tokens, kernels_per_token): its buffer's commit end
    kernel_start: np.ndarray           # (n_tokens, kernels_per_token)
    kernel_end: np.ndarray             # (n_tokens, kernels_per_token)
    token_done: np.ndarray             # (n_tokens,): the host has finished with the token
    cpu: list[Interval] = field(default_factory=list)
    gpu: list[Interval] = field(default_factory=list)

    @property
    def makespan(self) -> float:
        return float(self.token_done[-1])

    @property
    def tokens_per_s(self) -> float:
        """All tokens over the whole run, pipeline fill included."""
        return len(self.token_done) / self.makespan

    @property
    def itl(self) -> np.ndarray:
        """Inter-token latencies (seconds), as `generate.Generation.inter_token_latencies`."""
        return np.diff(self.token_done)

    @property
    def gpu_busy_s(self) -> float:
        return float((self.kernel_end - self.kernel_start).sum())

    @property
    def gpu_utilisation(self) -> float:
        return self.gpu_busy_s / self.makespan

    @property
    def bubble_s(self) -> np.ndarray:
        """GPU idle seconds in each token's window (previous token done, this token done]."""
        edges = np.concatenate([[0.0], self.token_done])
        idle = [iv for iv in self.gpu if iv.kind == "idle"]
        return np.array([sum(max(0.0, min(iv.end, b) - max(iv.start, a)) for iv in idle)
                         for a, b in zip(edges[:-1], edges[1:])])


def simulate(cfg: QueueConfig) -> Timeline:
    """Run the queue for cfg.n_tokens decode steps and return the timeline of both lanes."""
    N, n, (e, c, s, h) = cfg.n_tokens, cfg.kernels_per_token, (cfg.encode_s, cfg.commit_s, cfg.sync_s, cfg.host_s)
    gpu = cfg.kernel_times()
    tl = Timeline(cfg, commit_time=np.zeros((N, n)), kernel_start=np.zeros((N, n)),
                  kernel_end=np.zeros((N, n)), token_done=np.zeros(N))
    now, gpu_free = 0.0, 0.0

    def cpu(kind: str, dt: float, token: int, buffer: int = -1):
        nonlocal now
        if dt > 0:
            tl.cpu.append(Interval("CPU", kind, now, now + dt, token, buffer))
        now += dt

    def submit(t: int, j: int, lo: int, hi: int):  # encode and commit one buffer; the GPU queues it
        nonlocal gpu_free
        cpu("encode", (hi - lo) * e, t, j)
        cpu("commit", c, t, j)
        t0 = max(gpu_free, now)
        ends = t0 + np.cumsum(gpu[t, lo:hi])
        tl.commit_time[t, lo:hi] = now
        tl.kernel_start[t, lo:hi] = np.concatenate([[t0], ends[:-1]])
        tl.kernel_end[t, lo:hi] = ends
        if ends[-1] > t0:
            tl.gpu.append(Interval("GPU", "kernel", t0, float(ends[-1]), t, j))
        gpu_free = float(ends[-1])

    def wait(until: float, t: int, buffer: int = -1):
        cpu("wait", max(0.0, until - now), t, buffer)
        cpu("sync", s, t, buffer)

    buffers = cfg.buffers()
    if cfg.policy == "per_buffer":
        for t in range(N):
            for j, (lo, hi) in enumerate(buffers):
                submit(t, j, lo, hi)
                wait(gpu_free, t, j)
            cpu("host", h, t)
            tl.token_done[t] = now
    else:
        depth = 1 if cfg.policy == "per_token" else cfg.depth
        for step in range(N + depth - 1):
            if step < N:            # queue token `step` ...
                for j, (lo, hi) in enumerate(buffers):
                    submit(step, j, lo, hi)
            k = step - depth + 1    # ... then wait for the oldest token in flight
            if k >= 0:
                wait(float(tl.kernel_end[k, -1]), k)
                cpu("host", h, k)
                tl.token_done[k] = now

    t = 0.0  # the GPU's idle gaps, up to the end of the run
    for iv in sorted(tl.gpu, key=lambda iv: iv.start) + [Interval("GPU", "kernel", now, now)]:
        if iv.start > t:
            tl.gpu.append(Interval("GPU", "idle", t, iv.start))
        t = max(t, iv.end)
    tl.gpu.sort(key=lambda iv: iv.start)
    return tl


def steady_period(cfg: QueueConfig) -> float:
    """Seconds per token in steady state, in closed form (see the module docstring); jitter ignored."""
    g = np.broadcast_to(np.asarray(cfg.gpu_s, dtype=float), (cfg.kernels_per_token,))
    e, c, s, h = cfg.encode_s, cfg.commit_s, cfg.sync_s, cfg.host_s
    cpu_j = np.array([(hi - lo) * e + c for lo, hi in cfg.buffers()])   # encode+commit per buffer
    gpu_j = np.array([g[lo:hi].sum() for lo, hi in cfg.buffers()])      # GPU time per buffer
    E, G, B = cpu_j.sum(), gpu_j.sum(), len(cpu_j)
    if cfg.policy == "per_buffer":
        return float(E + G + B * s + h)
    if cfg.policy == "per_token" or cfg.depth == 1:
        F = np.max(np.cumsum(cpu_j) + np.cumsum(gpu_j[::-1])[::-1])     # C_j + G_j + ... + G_B
        return float(F + s + h)
    return float(max(E + s + h, G))


def gantt(tl: Timeline, tokens: int = 3, first: int = 0, title: str | None = None) -> go.Figure:
    """CPU and GPU lanes from token `first`'s start to token first+tokens-1's end, one bar per
    interval, one trace per kind (legend = colours); hover gives each interval in µs."""
    N = len(tl.token_done)
    if not (0 <= first < N and tokens >= 1):
        raise ValueError(f"first={first}, tokens={tokens}: the timeline has {N} tokens")
    a = float(tl.token_done[first - 1]) if first > 0 else 0.0
    b = float(tl.token_done[min(first + tokens, N) - 1])
    cfg = tl.config
    title = title or (f"{cfg.policy}: {1 / steady_period(cfg):,.0f} tokens/s in steady state, "
                      f"GPU busy {tl.gpu_utilisation:.0%} of the time")
    fig = viz.figure(title, "Time (µs)", "Lane (CPU or GPU)")
    for kind, colour in KINDS.items():
        shown = [iv for iv in tl.cpu + tl.gpu if iv.kind == kind and iv.end > a and iv.start < b]
        if not shown:
            continue
        lo = [max(iv.start, a) * 1e6 for iv in shown]
        hi = [min(iv.end, b) * 1e6 for iv in shown]
        fig.add_trace(go.Bar(
            y=[iv.lane for iv in shown], base=lo, x=[q - p for p, q in zip(lo, hi)], orientation="h",
            name=kind, marker_color=colour, marker_line_width=0.5, marker_line_color="white",
            customdata=[[iv.label, p, q, q - p] for iv, p, q in zip(shown, lo, hi)],
            hovertemplate="<b>%{customdata[0]}</b><br>from %{customdata[1]:,.2f} µs to %{customdata[2]:,.2f} µs"
                          "<br>%{customdata[3]:,.2f} µs<extra></extra>"))
    fig.update_layout(barmode="overlay", bargap=0.35, height=320)
    fig.update_yaxes(categoryorder="array", categoryarray=["GPU", "CPU"])
    return fig
