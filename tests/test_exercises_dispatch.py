"""The dispatch chapters (book/dispatch/): Caching tasks 1-3 (caching-workspaces), Jitter tasks 1-2
(ttft-jitter) and Dispatch tasks 1-2 (command-buffers):
`pytest tests/test_exercises_dispatch.py -k caching_task` (or `jitter_task`, `dispatch_task`)."""

from __future__ import annotations

import math

import pytest

from ref_impl import exercises as ex

# Llama-3.1-8B's weights, counted by hand in tests/test_roofline.py (and tests/test_exercises_roofline.py)
LLAMA8B_PARAMS = 8_030_261_248


# ---- Caching tasks (book/dispatch/caching-workspaces) ------------------------------------------------------

def overhead_by_hand(first_ms, steady_ms, n):
    return (first_ms - steady_ms) / n


def test_caching_task_1_accepts_the_right_number_and_function():
    # (6340 - 0.92) / 256 = 24.76 ms per token
    assert ex.check_amortized_overhead(24.76)
    assert ex.check_amortized_overhead(overhead_by_hand)


@pytest.mark.parametrize("wrong, hint", [
    (lambda f, s, n: f / n, "only first − steady"),
    (lambda f, s, n: (f - s) / (n - 1), "the first one included"),
    (lambda f, s, n: f - s, "whole pause"),
    (lambda f, s, n: s + (f - s) / n, "mean time per token"),
    (lambda f, s, n: (f - s) / n / 1e3, "not seconds"),
    (lambda f, s, n: 100 * (f - s) / n / s, "percentage"),
])
def test_caching_task_1_rejects_typical_mistakes_with_their_hint(wrong, hint):
    r = ex.check_amortized_overhead(wrong)
    assert not r and hint in r.message, r.message


def kv_by_hand_static(a, context, dtype_bytes):
    return 2 * a.num_hidden_layers * a.num_key_value_heads * context * a.head_dim * dtype_bytes


def test_caching_task_2_accepts_the_right_number_and_function():
    # Llama-3.1-8B: 2 x 32 layers x 8 KV heads x 8192 x 128 x 2 bytes = 1 GiB
    assert ex.check_static_kv_bytes(1_073_741_824)
    assert ex.check_static_kv_bytes(kv_by_hand_static)


@pytest.mark.parametrize("wrong, hint", [
    (lambda a, c, b: kv_by_hand_static(a, c, b) // 2, "keys and values"),
    (lambda a, c, b: kv_by_hand_static(a, c, b) // a.num_hidden_layers, "every layer"),
    (lambda a, c, b: kv_by_hand_static(a, c, b) * a.num_attention_heads // a.num_key_value_heads, "grouped-query"),
    (lambda a, c, b: 8 * kv_by_hand_static(a, c, b), "bits vs bytes"),
    (lambda a, c, b: kv_by_hand_static(a, -(-c // 256) * 256, b), "chunked cache"),
    (lambda a, c, b: kv_by_hand_static(a, c, 2), "not 2"),
    (lambda a, c, b: float(kv_by_hand_static(a, c, b)) + 0.5, "whole number"),
])
def test_caching_task_2_rejects_typical_mistakes_with_their_hint(wrong, hint):
    r = ex.check_static_kv_bytes(wrong)
    assert not r and hint in r.message, r.message


def test_caching_task_3_accepts_the_right_number_and_function():
    assert ex.check_page_faults(16_384)                     # 64 MiB / 4 KiB
    assert ex.check_page_faults(lambda n, p: (n + p - 1) // p)


@pytest.mark.parametrize("wrong, hint", [
    (lambda n, p: n // p, "round up"),
    (lambda n, p: 8 * n // p, "bits vs bytes"),
    (lambda n, p: -(-n // 4000), "not 4,000"),
    (lambda n, p: -(-n // 4096), "16 KiB pages"),
    (lambda n, p: 2 * -(-n // p), "one fault per page"),
])
def test_caching_task_3_rejects_typical_mistakes_with_their_hint(wrong, hint):
    r = ex.check_page_faults(wrong)
    assert not r and hint in r.message, r.message


# Chapter "Time to first token and inter-token jitter": Jitter tasks 1-2 (`pytest -k jitter_task`) -----------

def p99_by_hand(times):
    itl = [1e3 * (b - a) for a, b in zip(times, times[1:])]
    s = sorted(itl)
    r = 0.99 * (len(s) - 1)                      # linear interpolation between closest ranks
    lo = int(r)
    return s[lo] + (r - lo) * (s[min(lo + 1, len(s) - 1)] - s[lo])


def test_jitter_task_1_accepts_interpolated_and_nearest_rank():
    assert ex.check_p99_itl(p99_by_hand)
    assert ex.check_p99_itl(lambda t: sorted(1e3 * (b - a) for a, b in zip(t, t[1:]))[math.ceil(0.99 * (len(t) - 1)) - 1])


@pytest.mark.parametrize("wrong, hint", [
    (lambda t: p99_by_hand(t) / 1e3, "in seconds"),
    (lambda t: 1e3 * sorted(t)[int(0.99 * len(t))], "timestamps"),
    (lambda t: max(1e3 * (b - a) for a, b in zip(t, t[1:])), "maximum"),
    (lambda t: sum(1e3 * (b - a) for a, b in zip(t, t[1:])) / (len(t) - 1), "mean"),
    (lambda t: sorted(1e3 * (b - a) for a, b in zip(t, t[1:]))[int(0.99 * (len(t) - 1))], "off by one rank"),
    (lambda t: sorted(1e3 * (b - a) for a, b in zip(t, t[1:]))[int(0.01 * (len(t) - 1))], "p1"),
])
def test_jitter_task_1_rejects_typical_mistakes_with_their_hint(wrong, hint):
    r = ex.check_p99_itl(wrong)
    assert not r and hint in r.message, r.message


def test_jitter_task_1_garbage():
    assert "one number" in ex.check_p99_itl(lambda t: [1.0]).message


def growth_by_hand(prompt_len, n_steps, step=256):
    # the prefill's buffer holds the prompt rounded up to whole steps; it grows when a write falls past it
    cap, out = -(-prompt_len // step) * step, []
    for k in range(n_steps):
        if prompt_len + k >= cap:
            out.append(k)
            cap += step
    return out


def test_jitter_task_2_accepts_the_rule_worked_by_hand():
    assert growth_by_hand(32, 600) == [224, 480]
    assert ex.check_growth_steps(growth_by_hand)


@pytest.mark.parametrize("wrong, hint", [
    (lambda p, n, s=256: list(range(s, n, s)), "prompt already filled"),
    (lambda p, n, s=256: [k - 1 for k in growth_by_hand(p, n, s) if k >= 1], "off by one"),
    (lambda p, n, s=256: [k + 1 for k in growth_by_hand(p, n, s)], "off by one"),
    (lambda p, n, s=256: [k for k in growth_by_hand(p, n, s) if k > 0], "very first decode step"),
])
def test_jitter_task_2_rejects_typical_mistakes_with_their_hint(wrong, hint):
    r = ex.check_growth_steps(wrong)
    assert not r and hint in r.message, r.message


def test_jitter_task_2_garbage():
    assert "expected a list" in ex.check_growth_steps(lambda p, n, s=256: 3.5).message


# Chapter "Command buffers and sync bubbles": Dispatch tasks 1-2 (`pytest -k dispatch_task`) ----------------

def double_buffer_by_hand(e, g, n, s, h):
    return 1 / max(n * e + s + h, n * g)


def test_dispatch_task_1_accepts_the_right_number_and_function():
    # CPU: 300 x 4 + 30 + 80 = 1310 µs, GPU: 300 x 3 = 900 µs -> 1 / 1310 µs = 763.4 tokens/s
    assert ex.check_double_buffer_tokens_per_s(1e6 / 1310)
    assert ex.check_double_buffer_tokens_per_s(double_buffer_by_hand)


@pytest.mark.parametrize("wrong, hint", [
    (lambda e, g, n, s, h: 1 / (n * e + n * g + s + h), "synchronous queue"),
    (lambda e, g, n, s, h: 1 / max(n * e, n * g), "CPU's side of the max"),
    (lambda e, g, n, s, h: 1 / max(n * e + s + h, n * g + s + h), "n·g alone"),
    (lambda e, g, n, s, h: 1 / max(e + s + h, g), "per kernel"),
    (lambda e, g, n, s, h: 1 / min(n * e + s + h, n * g), "GPU's side alone (or the faster side)"),
    (lambda e, g, n, s, h: max(n * e + s + h, n * g), "seconds per token"),
    (lambda e, g, n, s, h: 1 / (n * e + s + h), "CPU's side alone"),     # right in case 1 (CPU-bound), not case 2
    (lambda e, g, n, s, h: 1 / (n * g), "CPU is the slower one"),
])
def test_dispatch_task_1_rejects_typical_mistakes_with_their_hint(wrong, hint):
    r = ex.check_double_buffer_tokens_per_s(wrong)
    assert not r and hint in r.message, r.message


def test_dispatch_task_1_garbage():
    assert not ex.check_double_buffer_tokens_per_s("fast")


def stops_by_hand(table, threshold):
    rows = sorted(table, key=lambda r: r["params_b"])
    gains = [r["async_tok_s"] / r["sync_tok_s"] - 1 for r in rows]
    peak = gains.index(max(gains))
    return next((r["model"] for r, x in zip(rows[peak + 1:], gains[peak + 1:]) if x < threshold), None)


def degradation_by_hand(table, threshold):   # the slip: how much slower syncing is, 1 - sync / async
    rows = sorted(table, key=lambda r: r["params_b"])
    loss = [1 - r["sync_tok_s"] / r["async_tok_s"] for r in rows]
    peak = loss.index(max(loss))
    return next((r["model"] for r, x in zip(rows[peak + 1:], loss[peak + 1:]) if x < threshold), None)


def test_dispatch_task_2_table_and_answer_by_hand():
    table = ex.async_gain_table()
    # Llama-3.1-8B: host 32 x 40 = 1280 µs + s 30 + h 100 = 1410 µs; GPU 8,030,261,248 weights x 2 bytes
    # / 1000 GB/s = 16,060.5 µs. Sync: encode, run, wait, 1280 + 16,060.5 + 130 = 17,470.5 µs, 57.24 tok/s;
    # async: max(1410, 16,060.5) µs, 62.26 tok/s: gain 8.8%, under 10%; Llama-3.2-3B's is 19.5%
    gpu_s = LLAMA8B_PARAMS * 2 / 1000e9
    row = next(r for r in table if r["model"] == "Llama-3.1-8B")
    assert row["params_b"] == pytest.approx(LLAMA8B_PARAMS / 1e9) and row["layers"] == 32
    assert row["sync_tok_s"] == pytest.approx(1 / (1280e-6 + gpu_s + 130e-6), abs=0.01)
    assert row["async_tok_s"] == pytest.approx(1 / gpu_s, abs=0.01)
    assert stops_by_hand(table, 0.10) == "Llama-3.1-8B"
    assert ex.check_async_stops_helping("Llama-3.1-8B")
    assert ex.check_async_stops_helping(stops_by_hand)


@pytest.mark.parametrize("wrong, hint", [
    (lambda t, th: next((r["model"] for r in sorted(t, key=lambda r: r["params_b"])
                         if r["async_tok_s"] / r["sync_tok_s"] - 1 < th), None), "smallest models gain little"),
    (lambda t, th: max(t, key=lambda r: r["async_tok_s"] / r["sync_tok_s"])["model"], "helps most"),
    (lambda t, th: degradation_by_hand(t, th), "not 1 − sync / async"),
    (lambda t, th: (lambda names, a: names[names.index(a) - 1] if a else None)(
        [r["model"] for r in sorted(t, key=lambda r: r["params_b"])], stops_by_hand(t, th)), "next larger one"),
])
def test_dispatch_task_2_rejects_typical_mistakes_with_their_hint(wrong, hint):
    r = ex.check_async_stops_helping(wrong)
    assert not r and hint in r.message, r.message
    assert not ex.check_async_stops_helping("Llama-3.2-3B")
