"""interconnect: PCIe and Thunderbolt 5 arithmetic against numbers worked by hand, the transfer
simulation's properties (seeded), and the weight-streaming formula."""

from __future__ import annotations

import numpy as np
import pytest

from ref_impl.measure import records
from ref_impl.measure.link import HOST_COPY
from ref_impl.theory import interconnect as ic
from ref_impl.theory import roofline, shapes
from tests.test_records import write


def test_pcie_link_rates_by_hand():
    # Gen4 x4: 16 GT/s x 4 lanes / 8 = 8 GB/s raw; x 128/130 = 7.877 GB/s
    assert ic.raw_gbs(4, 4) == 8.0
    assert ic.coded_gbs(4, 4) == pytest.approx(7.877, abs=5e-4)
    # Gen3 x4: 8 x 4 x 128/130 / 8 = 3.938; Gen5 x16: 32 x 16 x 128/130 / 8 = 63.015; Gen2 x8: 5 x 8 x 0.8 / 8 = 4
    assert ic.coded_gbs(3, 4) == pytest.approx(3.938, abs=5e-4)
    assert ic.coded_gbs(5, 16) == pytest.approx(63.015, abs=5e-4)
    assert ic.coded_gbs(2, 8) == pytest.approx(4.0)


def test_tlp_overheads_are_named_and_sum_to_20_bytes_with_a_3_dw_header():
    gen4 = ic.tlp_overheads(4)
    assert gen4 == {"TLP header": 12, "ECRC (optional)": 0, "STP token (framing + sequence number)": 4, "LCRC": 4}
    assert sum(ic.tlp_overheads(2).values()) == 20                 # STP + END 2, sequence number 2, LCRC 4
    assert sum(ic.tlp_overheads(4, header_dw=4, ecrc=True).values()) == 28


def test_tlp_efficiency_at_128_and_256_bytes_by_hand():
    assert ic.tlp_efficiency(256) == pytest.approx(256 / 276)         # 92.75%, Intel AN 456's 92%
    assert ic.tlp_efficiency(128) == pytest.approx(128 / 148)         # 86.49%
    assert ic.tlp_efficiency(256, dllps_per_tlp=0.5) == pytest.approx(256 / 280)
    # the ceiling: 7.877 x 370/371 (SKP) x 256 / 280
    assert ic.payload_gbs(4, 4, 256) == pytest.approx(16 * 4 * 128 / 130 / 8 * 370 / 371 * 256 / 280)


def test_efficiency_stack_falls_monotonically_from_the_tb5_wire():
    stack = ic.efficiency_stack(256, dma_efficiency=0.8)
    values = [s.gbs for s in stack]
    assert values[0] == 10.0 and values[1] == 8.0                     # 80 Gb/s wire, Gen4 x4 tunnel cap
    assert all(a >= b for a, b in zip(values, values[1:]))
    assert values[-2] == pytest.approx(ic.payload_gbs(4, 4, 256)) and values[-1] == pytest.approx(0.8 * values[-2])
    assert ic.efficiency_stack(boost=True)[0].gbs == 15.0              # 120 Gb/s one way


def test_usb4_packets_carry_a_tlp_in_256_byte_pieces():
    assert ic.usb4_packets(256) == (1, 4)
    assert ic.usb4_packets(276) == (2, 8)                             # 276 = 256 + 20: two packets, two headers
    assert ic.usb4_packets(150) == (1, 4 + 2)                         # padded to 152
    t = ic.tunnel_overhead(256)
    assert t["full: share of tunnelled bytes"] == pytest.approx(8 / 284)
    assert t["full: wire bytes per payload byte"] == pytest.approx(284 / 256)


def test_zero_jitter_gives_deterministic_completion_times():
    link = ic.deterministic(ic.Link())
    t = ic.simulate_transfers([1 << 20] * 8, link, runs=50, seed=3)
    assert np.ptp(t) == 0
    # 8 x (10 µs + 1 MiB / 5.6 GB/s)
    assert t[0] == pytest.approx(8 * (10e-6 + (1 << 20) / 5.6e9))


def test_simulation_is_seeded():
    a = ic.simulate_transfers([65536] * 16, ic.Link(), runs=100, seed=7)
    b = ic.simulate_transfers([65536] * 16, ic.Link(), runs=100, seed=7)
    assert np.array_equal(a, b) and not np.array_equal(a, ic.simulate_transfers([65536] * 16, ic.Link(), 100, 8))


def test_one_contiguous_transfer_beats_per_layer_handshakes_at_p99_under_jitter():
    runs = ic.per_layer_vs_contiguous(64 * 65536, 64, ic.Link(handshake_sigma=0.8), runs=2000, seed=0)
    many, one = (ic.percentiles(v) for v in runs.values())
    assert one["p99"] < many["p50"] < many["p99"] <= many["max"]
    # the spread grows with the number of handshakes summed
    assert np.std(runs["64 per-layer transfers"]) > np.std(runs["one contiguous transfer"])


def test_credits_cap_the_rate_only_below_the_bandwidth_delay_product():
    link = ic.Link(payload_gbs=5.6, rtt_us=2.0)                      # BDP = 5.6 GB/s x 2 µs = 11,200 bytes
    assert ic.Link(credit_bytes=16384, rtt_us=2.0).rate_gbs == 5.6
    assert ic.Link(credit_bytes=4096, rtt_us=2.0).rate_gbs == pytest.approx(4096 / 2e-6 / 1e9)   # 2.048 GB/s
    assert ic.knee_bytes(link) == pytest.approx(10e-6 * 5.6e9)


def test_weight_streaming_formula_by_hand():
    # 16 GB of weights, 8 GB card, 1 GB reserved: 7 GB at 1000 GB/s (7 ms), 9 GB at 5 GB/s (1.8 s)
    assert ic.streaming_tokens_per_s(16, 8, 1000, 5) == pytest.approx(1 / 1.8)
    assert ic.streaming_tokens_per_s(16, 8, 1000, 5, overlap=False) == pytest.approx(1 / 1.807)
    assert ic.streaming_tokens_per_s(4, 8, 1000, 5) == pytest.approx(250)          # fits: 4 GB / 1000 GB/s
    assert ic.overflow_for(1, 5.6) == 5.6


def test_streaming_grid_lists_only_overflowing_configurations():
    rows = ic.streaming_grid(["Llama-3.1-8B"], vram_gbs=1008, link_gbs=5.6)
    w16 = roofline.weight_bytes(shapes.PUBLIC["Llama-3.1-8B"], 16) / 1e9
    assert all(r["overflow_gb"] > 0 for r in rows)
    r = next(r for r in rows if (r["bits"], r["vram_gb"]) == (16, 8))
    assert r["weights_gb"] == pytest.approx(w16) and r["overlap"] == pytest.approx(5.6 / (w16 - 7))
    assert not any((r["bits"], r["vram_gb"]) == (4, 8) for r in rows)   # 4.0 GB fits in 8 GB


def test_pipeline_link_bytes_and_ethernet_payload_by_hand():
    # Llama-3.1-8B over two machines, 16-bit: one hidden state of 4096 x 2 bytes + a 4-byte header, the token back
    assert ic.pipeline_link_bytes(4096, 2, 2) == 8192 + 4 + 4 and ic.pipeline_link_bytes(4096, 2, 1) == 0
    assert ic.pipeline_link_bytes(8192, 2, 4) == 3 * (16384 + 4) + 4
    # 10 GbE at MTU 1500: 1.25 GB/s x (1500 - 52) / (1500 + 38)
    assert ic.ethernet_payload_gbs(10.0) == pytest.approx(1.25 * 1448 / 1538)
    assert ic.LINKS["Thunderbolt 5"].rate_gbs == ic.MEASURED["TB5 host-to-device"]


def test_a_transfer_is_the_simulations_deterministic_path():
    link = ic.LINKS["10 GbE"]
    assert ic.transfer_seconds(8200, link) == pytest.approx(
        ic.simulate_transfers([8200], ic.deterministic(link), runs=1)[0], rel=1e-12)
    assert ic.hop_seconds(8200, link, 50.0) == pytest.approx(50e-6 + ic.transfer_seconds(8200, link))


def test_a_pipeline_reads_every_weight_once_per_token_and_adds_its_hops():
    link, w, bw = ic.LINKS["Thunderbolt 5"], 40.0, 500.0
    free = ic.Link(payload_gbs=1e12, handshake_us=0.0, credit_bytes=1 << 50)
    assert ic.pipeline_tokens_per_s(w, 4, bw, 8192, 2, free, 0.0) == pytest.approx(bw / w)   # machines do not add up
    t = 1 / ic.pipeline_tokens_per_s(w, 4, bw, 8192, 2, link, 100.0)
    assert t - w / bw == pytest.approx(3 * ic.hop_seconds(16388, link, 100.0) + ic.hop_seconds(4, link, 100.0))
    assert ic.machines_for(40.0, 24.0) == 2 and ic.machines_for(23.0, 24.0) == 1 and ic.machines_for(24.0, 24.0) == 2


def test_pipeline_grid_beats_streaming_over_the_same_link_where_weights_overflow():
    rows = ic.pipeline_grid(["Llama-3.1-8B", "Llama-3.1-70B"], ic.LINKS, software_us=300.0)
    assert rows and all(r["machines"] >= 2 and r["overflow_gb"] > 0 for r in rows)
    assert all(r["pipeline"] > 10 * r["stream"] and r["link_share"] < 0.1 for r in rows)   # even at 300 us a hop
    assert {r["link"] for r in rows} == set(ic.LINKS)
    assert {r["model"] for r in rows} == {"Llama-3.1-8B", "Llama-3.1-70B"}


def test_the_chapters_host_copies_are_each_machines_newest_complete_link_run(tmp_path):
    copies = lambda *gbs: [records.record("link", "copy_bandwidth", "GB/s", v, variant=HOST_COPY, bytes=4096 << 2 * i)
                           for i, v in enumerate(gbs)]
    pinned = records.record("link", "copy_bandwidth", "GB/s", 50.0, variant="h2d pinned", bytes=4096)
    write(tmp_path, "a-1.json", "a", "2026-01-01T00:00:00+00:00", copies(1.0, 2.0))
    write(tmp_path, "a-2.json", "a", "2026-01-02T00:00:00+00:00", copies(3.0, 4.0) + [pinned])
    write(tmp_path, "a-3.json", "a", "2026-01-03T00:00:00+00:00", copies(5.0, float("nan")))   # failed: skipped
    write(tmp_path, "b-1.json", "b", "2026-01-01T00:00:00+00:00", [pinned])                    # no host copies
    ref = records.references("link", tmp_path, variant=HOST_COPY, metric="copy_bandwidth")
    assert {label: run.file for label, run in ref.items()} == {"a": "a-2.json"}
    assert sorted((r["bytes"], r["value"]) for r in ref["a"].records) == [(4096, 3.0), (16384, 4.0)]
