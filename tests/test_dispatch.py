"""dispatch: the command-queue model against timelines worked out by hand (CPU-bound, GPU-bound and
balanced, for each sync policy), the closed-form steady period against long simulations, timeline
invariants, seeded jitter, config validation and the Gantt figure.

Hand cases use plain numbers as times (think µs): the model is linear in time, and small integers
keep every sum exact. Notation: n kernels per token, e encode per kernel, g GPU per kernel,
B buffers per token, c commit, s sync, h host; E = n·e + B·c, G = n·g.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ref_impl.theory import queue
from ref_impl.theory.queue import POLICIES, QueueConfig, simulate, steady_period

# n = 4 kernels in B = 2 buffers of 2; c = 1, s = 2, h = 3
CPU_BOUND = dict(kernels_per_token=4, kernels_per_buffer=2, encode_s=5.0, gpu_s=1.0,
                 commit_s=1.0, sync_s=2.0, host_s=3.0, n_tokens=3)
GPU_BOUND = {**CPU_BOUND, "encode_s": 1.0, "gpu_s": 10.0}
# one buffer per token, per-kernel GPU times 2+3+4+5 = 14 = E + s + h = (4·2 + 1) + 2 + 3
BALANCED = dict(kernels_per_token=4, kernels_per_buffer=4, encode_s=2.0, gpu_s=(2.0, 3.0, 4.0, 5.0),
                commit_s=1.0, sync_s=2.0, host_s=3.0, n_tokens=4)


def run(case: dict, policy: str, **kw) -> queue.Timeline:
    return simulate(QueueConfig(**case, policy=policy, **kw))


def test_cpu_bound_by_hand():
    # e = 5, g = 1: E = 4·5 + 2·1 = 22, G = 4
    # per_buffer: encode 0-10, commit -11, GPU 11-13 (host waits), sync -15; encode -25, commit -26,
    # GPU 26-28, sync -30, host -33: P = E + G + B·s + h = 22 + 4 + 4 + 3 = 33
    tl = run(CPU_BOUND, "per_buffer")
    assert tl.token_done.tolist() == [33, 66, 99]
    # per_token: buffer 0 committed at 11 runs 11-13 while buffer 1 is encoded (11-21, commit -22);
    # GPU 22-24, wait 22-24, sync -26, host -29: P = E + G_last + s + h = 22 + 2 + 2 + 3 = 29
    tl = run(CPU_BOUND, "per_token")
    assert tl.token_done.tolist() == [29, 58, 87]
    assert tl.kernel_start[0].tolist() == [11, 12, 22, 23]
    # double_buffer: token 0 committed by 22 (GPU done 24); token 1 encoded 22-44 (GPU 33-35, 44-46);
    # wait for token 0 at 44: already done, sync -46, host -49. Token 2 encoded 49-71, sync -73,
    # host -76: P = E + s + h = 27. Drain: wait for token 2 (done 73) at 76, sync -78, host -81.
    tl = run(CPU_BOUND, "double_buffer")
    assert tl.token_done.tolist() == [49, 76, 81]
    assert not [iv for iv in tl.cpu if iv.kind == "wait"]          # the host never blocks
    assert [steady_period(QueueConfig(**CPU_BOUND, policy=p)) for p in POLICIES] == [33, 29, 27]


def test_gpu_bound_by_hand():
    # e = 1, g = 10: E = 4·1 + 2·1 = 6, G = 40; each buffer runs 20
    # per_buffer: encode 0-2, commit -3, GPU 3-23, sync -25; encode -27, commit -28, GPU 28-48,
    # sync -50, host -53: P = 6 + 40 + 2·2 + 3 = 53
    assert run(GPU_BOUND, "per_buffer").token_done.tolist() == [53, 106, 159]
    # per_token: buffer 0 committed at 3, the GPU runs 3-23 then 23-43 without a gap (buffer 1 was
    # committed at 6); wait 6-43, sync -45, host -48: P = n_1·e + c + G + s + h = 2 + 1 + 40 + 5 = 48
    tl = run(GPU_BOUND, "per_token")
    assert tl.token_done.tolist() == [48, 96, 144]
    assert tl.kernel_start[0].tolist() == [3, 13, 23, 33]
    # double_buffer: GPU runs token 0 3-43, token 1 43-83 (committed by 12), token 2 83-123
    # (committed 48-54); host: wait 12-43, sync -45, host -48; wait 54-83, sync -85, host -88;
    # drain: wait 88-123, sync -125, host -128. P = G = 40: the host's work hides behind the GPU
    tl = run(GPU_BOUND, "double_buffer")
    assert tl.token_done.tolist() == [48, 88, 128]
    assert tl.gpu_busy_s == 120 and tl.gpu_utilisation == pytest.approx(120 / 128)
    assert [steady_period(QueueConfig(**GPU_BOUND, policy=p)) for p in POLICIES] == [53, 48, 40]


def test_balanced_by_hand():
    # one buffer: E = 4·2 + 1 = 9, G = 14. per_buffer and per_token are the same loop:
    # encode 0-8, commit -9, GPU 9-23, sync -25, host -28: P = 9 + 14 + 2 + 3 = 28
    for policy in ("per_buffer", "per_token"):
        assert run(BALANCED, policy).token_done.tolist() == [28, 56, 84, 112]
    # double_buffer: token 0 on the GPU 9-23; token 1 committed at 18, runs 23-37; host waits
    # 18-23, sync -25, host -28. Token 2 committed at 37 just as the GPU frees: 37-51; sync 37-39,
    # host -42. Token 3: commit at 51, GPU 51-65, sync -53, host -56. Drain: wait -65, sync -67,
    # host -70. P = max(E + s + h, G) = 14, half of per_token's 28; the GPU runs 9-65 without a gap
    tl = run(BALANCED, "double_buffer")
    assert tl.token_done.tolist() == [28, 42, 56, 70]
    assert tl.kernel_start[:, 0].tolist() == [9, 23, 37, 51]
    # bubbles per token window: (0,28] idle 0-9; (28,42] and (42,56] none; (56,70] idle 65-70
    assert tl.bubble_s.tolist() == [9, 0, 0, 5]
    assert tl.gpu_utilisation == pytest.approx(56 / 70)
    assert steady_period(QueueConfig(**BALANCED, policy="double_buffer")) == 14


def test_depth_one_is_per_token_and_deeper_queues_keep_the_steady_period():
    for case in (CPU_BOUND, GPU_BOUND, BALANCED):
        a, b = run(case, "per_token"), run(case, "double_buffer", depth=1)
        assert np.array_equal(a.token_done, b.token_done) and a.cpu == b.cpu and a.gpu == b.gpu
    # GPU-bound, depth 3: tokens 0-2 are committed by 18 (buffers at 3, 6, 9, 12, 15, 18) while the GPU
    # runs token k over 3+40k .. 43+40k without a gap; the host waits for token k, then sync and
    # host: done_k = 43 + 40k + 2 + 3 = 48 + 40k, the same as depth 2: a deeper queue adds no speed
    tl = run({**GPU_BOUND, "n_tokens": 6}, "double_buffer", depth=3)
    assert tl.token_done.tolist() == [48, 88, 128, 168, 208, 248]


@settings(max_examples=25, deadline=None, derandomize=True)
@given(st.data())
def test_steady_period_is_the_long_run_inter_token_latency(data):
    n = data.draw(st.integers(1, 6))
    cfg = QueueConfig(
        kernels_per_token=n, kernels_per_buffer=data.draw(st.integers(1, 7)),
        encode_s=float(data.draw(st.integers(0, 5))), commit_s=float(data.draw(st.integers(0, 3))),
        gpu_s=tuple(float(x) for x in data.draw(st.lists(st.integers(0, 9), min_size=n, max_size=n))),
        sync_s=float(data.draw(st.integers(0, 3))), host_s=float(data.draw(st.integers(0, 5))),
        policy=data.draw(st.sampled_from(POLICIES)), depth=data.draw(st.integers(1, 3)), n_tokens=250)
    # the fill lasts about (depth-1)·G / (G - E - s - h) <= 2·54/1 tokens; skip the drain's ITLs
    assert simulate(cfg).itl[-cfg.depth - 1] == pytest.approx(steady_period(cfg))


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("depth", [2, 3])
def test_timeline_invariants(policy, depth):
    cfg = QueueConfig(kernels_per_token=7, kernels_per_buffer=3, encode_s=2e-6, gpu_s=6e-6, commit_s=5e-6,
                      sync_s=8e-6, host_s=20e-6, policy=policy, depth=depth, n_tokens=9, jitter=0.5, seed=3)
    tl, N, n, B = simulate(cfg), 9, 7, 3
    # the GPU never runs a kernel before its buffer is committed, and runs kernels in order
    assert np.all(tl.kernel_start >= tl.commit_time)
    start, end = tl.kernel_start.ravel(), tl.kernel_end.ravel()
    assert np.all(start[1:] >= end[:-1]) and np.all(end >= start)
    # each lane tiles [0, makespan] with intervals that never overlap
    for lane in (tl.cpu, tl.gpu):
        ivs = sorted(lane, key=lambda iv: iv.start)
        assert ivs[0].start == 0 and ivs[-1].end == pytest.approx(tl.makespan)
        assert all(a.end == pytest.approx(b.start) for a, b in zip(ivs, ivs[1:]))
        assert all(iv.end > iv.start for iv in ivs)
    # totals: what each kind should add up to
    total = {k: sum(iv.end - iv.start for iv in tl.cpu + tl.gpu if iv.kind == k) for k in queue.KINDS}
    assert total["encode"] == pytest.approx(N * n * 2e-6)
    assert total["commit"] == pytest.approx(N * B * 5e-6)
    assert total["sync"] == pytest.approx(N * (B if policy == "per_buffer" else 1) * 8e-6)
    assert total["host"] == pytest.approx(N * 20e-6)
    assert total["kernel"] == pytest.approx(tl.gpu_busy_s) == pytest.approx(cfg.kernel_times().sum())
    assert tl.bubble_s.sum() + tl.gpu_busy_s == pytest.approx(tl.makespan)
    # a token reaches the host after its last kernel, and in order
    assert np.all(tl.token_done >= tl.kernel_end[:, -1]) and np.all(tl.itl > 0)
    assert tl.tokens_per_s == pytest.approx(N / tl.makespan)


def test_jitter_is_seeded_and_keeps_the_mean():
    base = QueueConfig(kernels_per_token=50, gpu_s=1.0, n_tokens=40, jitter=0.3, seed=7)
    a, b = simulate(base), simulate(dataclasses.replace(base))
    assert np.array_equal(a.kernel_end, b.kernel_end) and np.array_equal(a.token_done, b.token_done)
    c = simulate(dataclasses.replace(base, seed=8))
    assert not np.array_equal(a.kernel_end, c.kernel_end)
    times = base.kernel_times()
    assert times.mean() == pytest.approx(1.0, abs=0.03) and times.std() == pytest.approx(0.3, abs=0.03)
    assert np.all(dataclasses.replace(base, jitter=0.0).kernel_times() == 1.0)


@pytest.mark.parametrize("field, value", [
    ("encode_s", -1e-6), ("commit_s", -1.0), ("sync_s", float("nan")), ("host_s", -0.5), ("jitter", -0.1),
    ("gpu_s", -2e-6), ("gpu_s", (1e-6, -1e-6, 1e-6, 1e-6)), ("gpu_s", (1e-6, 2e-6)), ("gpu_s", "fast"),
    ("kernels_per_token", 0), ("kernels_per_buffer", 0), ("n_tokens", 0), ("depth", 0),
    ("kernels_per_token", 2.5), ("policy", "per_kernel")])
def test_bad_configs_name_the_field(field, value):
    kw = {"kernels_per_token": 4, field: value}
    with pytest.raises(ValueError, match=field):
        QueueConfig(**kw)


def test_gantt_has_one_trace_per_kind_and_one_bar_per_interval():
    # per_token, CPU-bound, token 0 (0-29): CPU encode, commit, encode, commit, wait, sync, host (7);
    # GPU idle 0-11, kernels 11-13, idle 13-22, kernels 22-24, idle 24-29 (5, the last one clipped)
    tl = run(CPU_BOUND, "per_token")
    fig = queue.gantt(tl, tokens=1)
    assert [t.name for t in fig.data] == list(queue.KINDS)               # all 7 kinds present
    assert sum(len(t.x) for t in fig.data) == 12
    idle = next(t for t in fig.data if t.name == "idle")
    assert list(idle.base) == [0, 13e6, 24e6] and list(idle.x) == [11e6, 9e6, 5e6]   # µs
    assert set(idle.y) == {"GPU"} and "µs" in idle.hovertemplate
    # token 1's window (29-58): the idle gap 24-40 is clipped to 29-40
    fig = queue.gantt(tl, tokens=1, first=1)
    idle = next(t for t in fig.data if t.name == "idle")
    assert idle.base[0] == 29e6 and idle.x[0] == 11e6 and sum(len(t.x) for t in fig.data) == 12
    # the whole double-buffered run: one bar per interval
    tl = run(BALANCED, "double_buffer")
    fig = queue.gantt(tl, tokens=4)
    assert sum(len(t.x) for t in fig.data) == len(tl.cpu) + len(tl.gpu)
    assert fig.layout.xaxis.title.text == "Time (µs)"
    with pytest.raises(ValueError):
        queue.gantt(tl, first=4)
