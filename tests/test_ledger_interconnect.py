"""The Thunderbolt 5 and PCIe checks (C07, C08, C18, C25): their evidence against arithmetic by hand and
the recorded link, each rule on synthetic evidence on both sides of its thresholds (RULE_CASES, read by
test_ledger), and C25 pending without its recorded transfers."""

from __future__ import annotations

import dataclasses

import pytest

from ref_impl import ledger
from ref_impl.measure.records import record
from ref_impl.ledger.interconnect import Encapsulation, Streaming, Transfers, TunnelCeiling
from ref_impl.theory import interconnect as ic
from tests.test_records import write

# ---- the rules on synthetic evidence ----------------------------------------------------------------

PUBLISHED = {"TB5 host-to-device": 5.6, "TB5 device-to-host": 5.8, "OCuLink host-to-device": 6.6,
             "OCuLink device-to-host": 6.7}
TUNNEL = TunnelCeiling((4, 4), 8.0, 7.877, {64: 5.71, 128: 6.62, 256: 7.18, 512: 7.50}, PUBLISHED)


def tb5(h2d: float, d2h: float, oculink: tuple[float, float] = (6.6, 6.7)) -> dict[str, float]:
    return {"TB5 host-to-device": h2d, "TB5 device-to-host": d2h, "OCuLink host-to-device": oculink[0],
            "OCuLink device-to-host": oculink[1]}


WRAP = Encapsulation(4, 256, 2, (0.0282, 0.0290), 7.97, 10.0, PUBLISHED)


def streaming(overflows: list[float], handshake_us: float = 10.0, link: float = 5.6) -> Streaming:
    """C08's evidence: one Llama-3.1-8B-shaped row (32 layers) per overflow, streamed at `link` GB/s."""
    rows = tuple({"model": "Llama-3.1-8B", "bits": 16, "vram_gb": 8, "weights_gb": 16.06, "overflow_gb": o,
                  "overlap": link / o, "serial": link / o, "resident": 1008 / 16.06} for o in overflows)
    return Streaming(link, 1008.0, rows, {"Llama-3.1-8B": 32}, handshake_us)


LINK = Transfers("h200", 64, 256 << 20, (5.98, 6.06, 6.15), (4.85, 4.87, 4.94), 4096, 18.7, 34.4, 55.5, 2, 62.5,
                 16384, 11200.0, {"64 × 64 KiB": 2.05, "64 × 16 MiB": 1.003})

RULE_CASES = {
    "C07": [(TUNNEL, "qualified"),                                            # the published 5.8 is below 6.62
            (dataclasses.replace(TUNNEL, measured=tb5(6.5, 6.62)), "confirmed"),   # the better way reaches 6.62
            (dataclasses.replace(TUNNEL, measured=tb5(6.5, 6.61)), "qualified"),
            (dataclasses.replace(TUNNEL, measured=tb5(7.3, 6.0)), "refuted"),  # above the 256-byte ceiling
            (dataclasses.replace(TUNNEL, tunnel=(3, 4)), "refuted"),           # not a Gen4 x4 tunnel
            (dataclasses.replace(TUNNEL, ceilings={64: 5.0, 128: 5.9, 256: 6.5, 512: 6.8}), "refuted")],  # 7.0 above
    "C18": [(WRAP, "confirmed"),                                              # 1.0 and 0.9 GB/s lost, headers fit
            (dataclasses.replace(WRAP, measured=tb5(6.5, 6.6)), "refuted"),    # 0.1 GB/s: the figures' last digit
            (dataclasses.replace(WRAP, measured=tb5(6.4, 6.65)), "qualified"),  # one direction only
            (dataclasses.replace(WRAP, wire_needed_gbs=10.5), "qualified")],  # the headers alone could explain it
    "C08": [(streaming([0.5, 3.0, 9.0]), "qualified"),                        # 11.2, 1.9 and 0.62 tok/s
            (streaming([5.7, 9.0]), "qualified"),                             # all under 1 tok/s, by bandwidth
            (streaming([5.7, 9.0], handshake_us=16_000), "confirmed"),        # 32 x 16 ms is half of 1 / 0.98 s
            (streaming([5.7, 9.0], handshake_us=15_000), "qualified"),
            (streaming([5.6, 9.0]), "qualified"),                             # exactly 1 token/s is not under it
            (streaming([0.5, 3.0, 5.6]), "refuted")],                         # none under 1 tok/s
    "C25": [(LINK, "qualified"),                                              # 15.7 µs spread, jitter 125 ps
            (dataclasses.replace(LINK, many_ms=(4.90, 6.06, 6.15)), "refuted"),   # one per-layer run beat a single
            (dataclasses.replace(LINK, small_p99_us=18.7 + 240e-6), "confirmed"),  # jitter is half the spread
            (dataclasses.replace(LINK, small_p99_us=18.7 + 260e-6), "qualified")],
}


def test_summaries_follow_the_numbers():
    v = ledger.CLAIMS["C25"].judge(dataclasses.replace(LINK, many_ms=(4.90, 6.06, 6.15)))
    assert v.summary.startswith("Not every recorded run")
    v = ledger.CLAIMS["C18"].judge(dataclasses.replace(WRAP, measured=tb5(5.0, 5.8)))
    assert "1.6 GB/s (24%) less than OCuLink host-to-device" in v.summary
    v = ledger.CLAIMS["C08"].judge(streaming([0.5, 3.0, 9.0]))
    assert "1 fall under 1 token/s and 2 do not" in v.summary and "11.2 tok/s" in v.summary


# ---- the evidence, by hand ------------------------------------------------------------------------

def test_c07_pcie_gen4_x4_ceiling_by_hand():
    v = ledger.check("C07", live=False)
    ev = v.evidence
    assert v.status == "qualified" and "5.8 GB/s (device-to-host)" in v.summary
    # 16 GT/s x 4 lanes / 8 = 8 GB/s; x 128/130 = 7.877 GB/s
    assert ev["PCIe Gen4 x4 on the wire: 16 GT/s x 4 / 8"].value == 8.0
    assert ev["after 128b/130b coding"].value == pytest.approx(7.8769, abs=1e-4)
    # 256-byte payload, 20 bytes per TLP (12 header + 4 STP token + 4 LCRC), 0.5 x 8 B of DLLPs, SKP 370/371
    by_hand = 7.876923 * 370 / 371 * 256 / (256 + 20 + 4)
    assert ev["protocol ceiling, 256-byte payloads (TLP, DLLP, SKP)"].value == pytest.approx(by_hand, rel=1e-6)
    assert ev["protocol ceiling, 128-byte payloads (TLP, DLLP, SKP)"].value < ledger.C07_GBS \
        < ev["protocol ceiling, 256-byte payloads (TLP, DLLP, SKP)"].value
    assert ev["measured TB5 device-to-host / the claim's 7.0 GB/s"].value == pytest.approx(100 * 5.8 / 7.0)


def test_c07_reads_the_recorded_native_link_where_there_is_one(monkeypatch, tmp_path):
    v = ledger.check("C07", live=False)
    assert any(k.startswith("recorded pinned host-to-device copy") for k in v.evidence) and "results/" in v.source
    monkeypatch.setattr(ledger.core, "RESULTS_DIR", tmp_path)
    bare = ledger.check("C07", live=False)              # the rule reads the published figures, not results/
    assert bare.status == v.status and not any(k.startswith("recorded") for k in bare.evidence)
    assert ledger.CLAIMS["C07"].pending is None


def test_c18_usb4_headers_fit_in_the_wire_headroom():
    v = ledger.check("C18", live=False)
    ev = v.evidence
    assert v.status == "confirmed" and "the loss is the controllers'" in v.summary
    # a 276-byte TLP needs two USB4 packets (<= 256 B each): 8 header bytes, 8 / 284 = 2.82%
    assert ev["USB4 packets per 256-byte-payload TLP"].value == 2
    assert ev["USB4 header share of tunnelled bytes, least"].value == pytest.approx(800 / 284)
    assert ev["wire needed to carry the Gen4 x4 payload ceiling"].value < ev["TB5 wire, one direction"].value == 10
    # 1 - 5.6 / 6.6 = 15.2%
    assert ev["measured: TB5 below OCuLink, host-to-device"].value == pytest.approx(100 * (1 - 5.6 / 6.6))


def test_c08_streaming_bound_by_hand():
    v = ledger.check("C08", live=False)
    ev = v.evidence
    assert v.status == "qualified" and "bandwidth, not latency" in v.summary
    # 1 token/s needs the overflow to cross in 1 s: 5.6 GB at 5.6 GB/s
    assert ev["overflow at which streaming alone allows 1 token/s"].value == pytest.approx(5.6)
    # Qwen3-32B at 16 bits: 32.76e9 x 2 = 65.5 GB; an 8 GB card less 1 GB reserved leaves 58.5 GB over the link
    assert ev["largest overflow (Qwen3-32B, 16-bit, 8 GB)"].value == pytest.approx(58.5, abs=0.1)
    assert ev["tokens/s at the largest overflow, streamed"].value == pytest.approx(5.6 / 58.5, rel=2e-3)
    under, over = (ev[f"overflowing configurations {k}"].value for k in ("under 1 token/s", "at 1 token/s or more"))
    assert under > 0 and over > 0
    share = next(n.value for k, n in ev.items() if "largest share of a streamed token" in k)
    assert share < 1                                     # per cent: handshakes are not what limits
    grid = ic.streaming_grid(list(ledger.STREAM_MODELS), vram_gbs=1008.0, link_gbs=5.6)
    assert under + over == len(grid) and under == sum(r["overlap"] < 1 for r in grid)


def test_c25_recorded_transfers_by_hand():
    v = ledger.check("C25", live=False)
    ev = v.evidence
    assert v.status == "qualified" and "host's side of the handshake" in v.condition
    run, rec = ledger.link_recorded()
    label = run.label
    assert run.caption in v.source                                  # the verdict names the run it read
    many, one = rec["h2d pinned, 64 transfers, sync each", "completion_ms", 256 << 20], \
        rec["h2d pinned, one transfer", "completion_ms", 256 << 20]
    ratio = ev[f"recorded 64 × 4 MiB synced transfers / one transfer, median ({label})"].value
    assert ratio == pytest.approx(many / one)
    # t = h + S/B: 64 x (h + 4 MiB / B) against h + 256 MiB / B, with h the 4 KiB transfer less its data time
    b = ledger.native_link_efficiency()[1] * 1e3            # bytes per µs
    small = rec["h2d pinned 4 KiB, sync each", "transfer_us", 4096]
    h = small - 4096 / b
    predicted = 64 * (h + (4 << 20) / b) / (h + (256 << 20) / b)
    assert ev[f"predicted by t = h + S/B from the small transfer ({label})"].value == pytest.approx(predicted)
    assert ev["retimer jitter bound: 2 retimers x one 62.5 ps unit interval"].value == pytest.approx(125e-6)  # µs
    assert ev["retimer jitter bound / recorded spread"].value < 1e-3
    assert ev["TB5 model, 64 × 64 KiB: per-layer p99 / one transfer p99 (seeded)"].value > 1.5
    assert 1 < ev["TB5 model, 64 × 16 MiB: per-layer p99 / one transfer p99 (seeded)"].value < 1.01
    assert ledger.check("C25", live=False).evidence == ev          # seeded: the same numbers every time


def test_c25_is_pending_without_its_recorded_transfers(monkeypatch, tmp_path):
    monkeypatch.setattr(ledger.core, "RESULTS_DIR", tmp_path)
    v = ledger.check("C25", live=False)
    assert v.status == "pending" and "python -m ref_impl bench --link" in v.summary and not v.evidence
    assert {c: ledger.check(c, live=False).status for c in ("C07", "C08", "C18")} == \
        {"C07": "qualified", "C08": "qualified", "C18": "confirmed"}


def test_the_link_read_is_the_reference_gpus_newest_complete_run_with_host_device_transfers(monkeypatch, tmp_path):
    copy = lambda v: record("link", "copy_bandwidth", "GB/s", v, variant="h2d pinned", bytes=1 << 30)
    done = lambda v: record("link", "completion_ms", "ms", v, variant="h2d pinned, one transfer", bytes=256 << 20)
    host = record("link", "copy_bandwidth", "GB/s", 9.0, variant="host copy (numpy)", bytes=1 << 30)
    write(tmp_path, "h200-1.json", ledger.interconnect.LINK_GPU, "2026-01-01T00:00:00+00:00", [copy(50.0), done(5.0)])
    write(tmp_path, "h200-2.json", ledger.interconnect.LINK_GPU, "2026-01-02T00:00:00+00:00", [copy(55.0), done(4.9)])
    write(tmp_path, "h200-3.json", ledger.interconnect.LINK_GPU, "2026-01-03T00:00:00+00:00",
          [copy(float("nan")), done(4.8)])                                # a failed measurement: skipped
    write(tmp_path, "cpu-1.json", "cpu", "2026-01-04T00:00:00+00:00", [host])     # no GPU: host copies only
    monkeypatch.setattr(ledger.core, "RESULTS_DIR", tmp_path)
    run, values = ledger.link_recorded()
    assert run.file == "h200-2.json" and values["h2d pinned", "copy_bandwidth", 1 << 30] == 55.0
    write(tmp_path, "h200-4.json", ledger.interconnect.LINK_GPU, "2026-01-05T00:00:00+00:00", [host])
    assert ledger.link_recorded() is None         # its newest complete run measured no host-device transfer
