"""Chapter signalling, Thunderbolt 5 and PCIe (book/signalling/thunderbolt-pcie): C07, C08, C18 and C25.

No Thunderbolt hardware runs here, but each claim is decided by what does: the PCIe Gen4 x4 payload
ceiling and USB4's encapsulation by arithmetic, a published TB5 eGPU measurement (interconnect.MEASURED),
weights streamed over the link by arithmetic, and a native PCIe link's recorded transfers (`bench --link`
on the H200, its reference run: `records.reference`) for the cost of a handshake per layer, beside a seeded
simulation of a TB5 link. Nothing here is timed.

See chapter: interconnect
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from ref_impl.ledger import core
from ref_impl.ledger.core import TABLES, Number, Verdict, claim, decide
from ref_impl.measure import records
from ref_impl.measure.records import Run
from ref_impl.theory import interconnect as ic
from ref_impl.theory import roofline, shapes

C07_GBS = 7.0                                  # quoted from the claim
C08_TOKENS_PER_S = 1.0                         # quoted from C08: "sub-1 token/sec"
MEASURED_DIGIT = 0.1                           # GB/s: the last digit of the published TB5 and OCuLink figures
IC_SOURCES = ("PCIe Base Specification 3.0 (128b/130b, framing); Intel AN 456 (5 DW per 3-DW TLP); "
              "Intel, 'Intel Introduces Thunderbolt 5 Connectivity Standard' (2023-09-12); USB4 Specification v2.0")
STREAM_MODELS = ("Llama-3.2-3B", "Llama-3.1-8B", "Qwen3-8B", "Gemma-3-12B", "Qwen3-32B")
STREAM_CARD = "RTX 4090"                       # the VRAM bandwidth of the streaming arithmetic (roofline.HARDWARE)
LINK_GPU = "h200"                              # the reference machine whose native PCIe link C07 and C25 read


# ---- the recorded link (bench --link) ----------------------------------------------------------------

def link_records() -> tuple[Run, dict[tuple[str, str, int | None], dict]] | None:
    """(the Run, {(variant, metric, bytes): record}) of LINK_GPU's reference link run (`records.reference`),
    or None where it recorded no host-device transfers (`bench --link` where PyTorch saw no GPU)."""
    run = records.reference("link", LINK_GPU, core.RESULTS_DIR)
    if run is None or not run.select("link", metric="completion_ms"):
        return None
    return run, {(r["variant"], r["metric"], r.get("bytes")): r for r in run.records}


def link_recorded() -> tuple[Run, dict[tuple[str, str, int | None], float]] | None:
    """(the Run, {(variant, metric, bytes): value}) of `link_records`, or None."""
    rec = link_records()
    return None if rec is None else (rec[0], {k: r["value"] for k, r in rec[1].items()})


def native_link_efficiency() -> tuple[str, float, float, int, int] | None:
    """(label, measured pinned h2d GB/s at the largest size, its share of the GPU's own PCIe ceiling at
    256-byte payloads, gen, lanes) from recorded results, or None."""
    rec = link_recorded()
    if rec is None:
        return None
    run, v = rec
    gen, lanes = (int(v.get(("nvidia-smi", f"pcie_link_{k}_max", None), 0)) for k in ("gen", "width"))
    h2d = {b: x for (var, m, b), x in v.items() if var == "h2d pinned" and m == "copy_bandwidth"}
    if not h2d or gen not in ic.GT_PER_LANE or not lanes:
        return None
    best = h2d[max(h2d)]
    return run.label, best, best / ic.payload_gbs(gen, lanes, 256), gen, lanes


# ---- C07 ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TunnelCeiling:
    """C07's evidence: the tunnel's PCIe generation and width, its rate on the wire and after coding,
    the protocol ceiling per payload size, the published measurements, and a recorded native link."""
    tunnel: tuple[int, int]
    raw_gbs: float
    coded_gbs: float
    ceilings: dict[int, float]              # TLP payload bytes -> GB/s of payload
    measured: dict[str, float]              # ic.MEASURED: published TB5 and OCuLink copy rates
    native: tuple[str, float, float, int, int] | None = None   # native_link_efficiency(), where recorded
    native_source: str = ""                 # the caption of the run it comes from


def gather_c07(live: bool) -> TunnelCeiling:
    gen, lanes = ic.TB5_PCIE
    rec = link_records()
    return TunnelCeiling(ic.TB5_PCIE, ic.raw_gbs(gen, lanes), ic.coded_gbs(gen, lanes),
                         {p: ic.payload_gbs(gen, lanes, p) for p in (64, 128, 256, 512)}, dict(ic.MEASURED),
                         native_link_efficiency(), rec[0].caption if rec else "")


def judge_c07(e: TunnelCeiling) -> Verdict:
    """'Approximately 7.0' is read as within the ceilings of 128- and 256-byte TLPs: refuted if 7.0 lies
    outside them, a measured TB5 rate above them, or the tunnel is not Gen4 x4; confirmed if the better
    measured direction reaches the range; qualified (an upper bound only) if it falls short."""
    lo, hi = e.ceilings[128], e.ceilings[256]
    best_dir = max(("host-to-device", "device-to-host"), key=lambda d: e.measured[f"TB5 {d}"])
    best = e.measured[f"TB5 {best_dir}"]
    gen4x4 = e.tunnel == (4, 4)
    ev = {f"PCIe Gen{e.tunnel[0]} x{e.tunnel[1]} on the wire: {ic.GT_PER_LANE[e.tunnel[0]]:g} GT/s x "
          f"{e.tunnel[1]} / 8": Number(e.raw_gbs, "GB/s"), "after 128b/130b coding": Number(e.coded_gbs, "GB/s")}
    ev |= {f"protocol ceiling, {p}-byte payloads (TLP, DLLP, SKP)": Number(c, "GB/s") for p, c in e.ceilings.items()}
    ev |= {f"measured {k}": Number(x, "GB/s") for k, x in e.measured.items()}
    ev[f"measured TB5 {best_dir} / the claim's {C07_GBS} GB/s"] = Number(100 * best / C07_GBS, "%")
    around = "around" if lo <= C07_GBS <= hi else "not around"
    where = "within" if lo <= best <= hi else f"{100 * (1 - best / lo):.0f}% below" if best < lo else "above"
    summary = (f"The Gen{e.tunnel[0]} x{e.tunnel[1]} tunnel leaves {lo:.2f}-{hi:.2f} GB/s of payload with 128- to "
               f"256-byte TLPs, {around} the claim's {C07_GBS} GB/s, and a measured TB5 eGPU link moved at best "
               f"{best} GB/s ({best_dir}), {where} that range: the ceiling is {e.coded_gbs:.2f} GB/s after coding "
               f"less the packets' overheads, and the same GPU over OCuLink (native PCIe Gen4 x4) moved "
               f"{e.measured['OCuLink host-to-device']} GB/s host-to-device")
    source = f"{ic.MEASURED_SOURCE}; {IC_SOURCES}"
    if e.native:
        label, rate, eff, gen, lanes = e.native
        ev |= {f"recorded pinned host-to-device copy, Gen{gen} x{lanes} ({label})": Number(rate, "GB/s"),
               f"its share of its own link's 256-byte protocol ceiling ({label})": Number(100 * eff, "%"),
               "that share applied to Gen4 x4": Number(eff * hi, "GB/s")}
        summary += (f"; a native Gen{gen} x{lanes} link ({label}, recorded) reaches {100 * eff:.0f}% of its "
                    f"protocol ceiling with pinned memory, which on Gen4 x4 would be {eff * hi:.2f} GB/s")
        source += f"; {e.native_source or label} (experiment link)"
    return Verdict(decide(best >= lo, not gen4x4 or not lo <= C07_GBS <= hi or best > hi), summary + ".", ev,
                   f"as the protocol's ceiling with 128-256-byte TLPs ({lo:.2f}-{hi:.2f} GB/s); measured "
                   f"transfers through a TB5 controller pair reached {best} GB/s, {100 * best / lo:.0f}% of its low "
                   "end", source)


C07 = claim("C07", "interconnect", gather_c07, judge_c07,
            short="Thunderbolt 5 tunnels PCIe Gen4 x4; real unidirectional payload ~7.0 GB/s",
            quote="Thunderbolt 5 encapsulates PCIe Gen 4 x4 protocol packets with maximum unidirectional real-world "
                  "payload throughput bounded at approximately 7.0 GB/s.",
            rule="Evidence: the Gen4 x4 tunnel's payload ceiling by arithmetic with 128- and 256-byte TLPs, which "
                 "reads 'approximately 7.0 GB/s' as a range, and the published TB5 eGPU copy rates (no TB5 "
                 "hardware here). Refuted if 7.0 lies outside that range, a measured rate above it, or the tunnel "
                 "is not Gen4 x4; confirmed if the better measured direction reaches the range; qualified if it falls "
                 "short, naming by how much.",
            outcomes=("confirmed", "qualified", "refuted"))


# ---- C18 ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Encapsulation:
    """C18's evidence: USB4's header per transport packet and the packets per 256-byte-payload TLP, the
    header share of the tunnelled bytes (two packings), the wire a Gen4 x4 ceiling needs with its
    headers against TB5's wire, and the published TB5 and OCuLink copy rates of one GPU and host."""
    header_bytes: int
    max_payload: int
    packets_per_tlp: int
    header_shares: tuple[float, float]      # low, high: share of tunnelled bytes
    wire_needed_gbs: float
    wire_gbs: float
    measured: dict[str, float]


def gather_c18(live: bool) -> Encapsulation:
    t = ic.tunnel_overhead(256)
    wire_needed = ic.payload_gbs(4, 4, 256) * max(t["full: wire bytes per payload byte"],
                                                  t["bare: wire bytes per payload byte"])
    shares = sorted(t[f"{k}: share of tunnelled bytes"] for k in ("full", "bare"))
    return Encapsulation(ic.USB4_HEADER, ic.USB4_MAX_PAYLOAD, t["full: packets per TLP"], (shares[0], shares[1]),
                         wire_needed, ic.TB5_GBPS / 8, dict(ic.MEASURED))


def judge_c18(e: Encapsulation) -> Verdict:
    """Confirmed if TB5 moves less than the native cable both ways by more than the figures' last digit
    while the headers fit the wire's headroom (the loss is the controllers'); refuted if no direction
    shows a loss; qualified if only one does, or the header bytes alone could explain it."""
    dirs = ("host-to-device", "device-to-host")
    gap = {d: e.measured[f"OCuLink {d}"] - e.measured[f"TB5 {d}"] for d in dirs}
    shows = {d: g > MEASURED_DIGIT + 1e-9 for d, g in gap.items()}
    fits = e.wire_needed_gbs <= e.wire_gbs
    ev = {"USB4 transport-packet header": Number(e.header_bytes, "B"),
          "USB4 packets per 256-byte-payload TLP": Number(e.packets_per_tlp, "packets"),
          "USB4 header share of tunnelled bytes, least": Number(100 * e.header_shares[0], "%"),
          "USB4 header share of tunnelled bytes, most": Number(100 * e.header_shares[1], "%"),
          "wire needed to carry the Gen4 x4 payload ceiling": Number(e.wire_needed_gbs, "GB/s"),
          "TB5 wire, one direction": Number(e.wire_gbs, "GB/s"),
          "published figures' last digit": Number(MEASURED_DIGIT, "GB/s")}
    ev |= {f"measured: TB5 below OCuLink, {d}": Number(100 * g / e.measured[f"OCuLink {d}"], "%")
           for d, g in gap.items()}
    lost = " and ".join(f"{abs(g):.1f} GB/s ({100 * abs(g) / e.measured[f'OCuLink {d}']:.0f}%) "
                        f"{'less' if g >= 0 else 'more'} than OCuLink {d}" for d, g in gap.items())
    where = ("so the loss is the controllers', since USB4's header bytes fit the wire's headroom" if fits else
             "while USB4's header bytes alone need more than the wire's headroom")
    summary = (f"On the same GPU and host TB5 moved {lost}, {where}: each TLP travels in transport-layer packets of "
               f"at most {e.max_payload} bytes behind a {e.header_bytes}-byte header, "
               f"{100 * e.header_shares[0]:.1f}-{100 * e.header_shares[1]:.1f}% of the tunnelled bytes, and with them "
               f"the Gen4 x4 ceiling needs {e.wire_needed_gbs:.2f} of the wire's {e.wire_gbs:.0f} GB/s")
    seen = " and ".join(d for d, x in shows.items() if x) or "neither direction"
    return Verdict(decide(all(shows.values()) and fits, not any(shows.values())), summary + ".", ev,
                   f"the overhead shows as lost throughput ({seen}) in the controllers (assembly, disassembly, an "
                   "extra hop of latency per transfer) while the header bytes "
                   + ("ride in the wire's headroom" if fits else "exceed the wire's headroom")
                   + "; measured on one published eGPU setup",
                   f"{ic.MEASURED_SOURCE}; {IC_SOURCES}; Linux drivers/thunderbolt/tunnel.c (PCIe paths, HopID 8)")


C18 = claim("C18", "interconnect", gather_c18, judge_c18,
            short="PCIe tunnelling wraps TLPs in transport frames, adding assembly/disassembly overhead",
            quote="PCIe protocol tunneling encapsulates Transaction Layer Packets (TLPs) into transport frames, "
                  "incurring packet assembly and disassembly overhead at host and device controllers.",
            rule="Evidence: USB4's header bytes against the wire's headroom over the Gen4 x4 tunnel (arithmetic), "
                 "and published TB5 and OCuLink (native PCIe) copy rates of one GPU and host. Confirmed if TB5 moves "
                 "less in both directions by more than the figures' last digit (0.1 GB/s) while the headers fit the "
                 "headroom, so the loss is the controllers'; refuted if neither direction loses; qualified otherwise.",
            outcomes=("confirmed", "qualified", "refuted"))


# ---- C08 ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Streaming:
    """C08's evidence: every (model, bits, VRAM size) whose weights overflow VRAM, streamed over the
    measured TB5 rate (interconnect.streaming_grid rows), each model's layer count, and the handshake
    one per-layer transfer costs (the link model's stated assumption)."""
    link_gbs: float
    vram_gbs: float
    rows: tuple[dict, ...]
    layers: dict[str, int]
    handshake_us: float


def gather_c08(live: bool) -> Streaming:
    link, vram = ic.MEASURED["TB5 host-to-device"], roofline.HARDWARE[STREAM_CARD].bandwidth_gbs
    return Streaming(link, vram, tuple(ic.streaming_grid(list(STREAM_MODELS), vram_gbs=vram, link_gbs=link)),
                     {m: shapes.PUBLIC[m].num_hidden_layers for m in STREAM_MODELS}, ic.Link().handshake_us)


def judge_c08(e: Streaming) -> Verdict:
    """Refuted if no overflowing configuration falls under 1 token/s; confirmed if every one does and
    latency (a handshake per layer) is most of a streamed token's time; qualified otherwise."""
    under = [r for r in e.rows if r["overlap"] < C08_TOKENS_PER_S]
    shares = [e.layers[r["model"]] * e.handshake_us * 1e-6 * r["overlap"] for r in e.rows]   # of a token's time
    top = max(shares)
    worst = e.rows[shares.index(top)]
    small, big = min(e.rows, key=lambda r: r["overflow_gb"]), max(e.rows, key=lambda r: r["overflow_gb"])
    limit = ic.overflow_for(C08_TOKENS_PER_S, e.link_gbs)
    ev = {"link rate assumed (measured TB5 host-to-device)": Number(e.link_gbs, "GB/s"),
          f"overflow at which streaming alone allows {C08_TOKENS_PER_S:g} token/s": Number(limit, "GB"),
          "same at the Gen4 x4 ceiling (256-byte TLPs)": Number(
              ic.overflow_for(C08_TOKENS_PER_S, ic.payload_gbs(4, 4, 256)), "GB"),
          f"overflowing configurations under {C08_TOKENS_PER_S:g} token/s": Number(len(under), "configurations"),
          f"overflowing configurations at {C08_TOKENS_PER_S:g} token/s or more": Number(
              len(e.rows) - len(under), "configurations")}
    for what, r in (("smallest", small), ("largest", big)):
        ev[f"{what} overflow ({r['model']}, {r['bits']}-bit, {r['vram_gb']} GB)"] = Number(r["overflow_gb"], "GB")
        ev[f"tokens/s at the {what} overflow, streamed"] = Number(r["overlap"], "tok/s")
        ev[f"tokens/s at the {what} overflow, resident at {e.vram_gbs:,.0f} GB/s"] = Number(r["resident"], "tok/s")
    ev[f"per-layer handshakes ({e.handshake_us:g} µs each), largest share of a streamed token"] = Number(
        100 * top, "%")
    ev[f"{e.layers[worst['model']]} per-layer handshakes per token ({worst['model']})"] = Number(
        e.layers[worst["model"]] * e.handshake_us * 1e-3, "ms")
    bits = "/".join(str(b) for b in sorted({r["bits"] for r in e.rows}))
    vram = sorted({r["vram_gb"] for r in e.rows})
    summary = (f"Of {len(e.rows)} overflowing configurations ({', '.join(sorted(e.layers))} at {bits} bits on "
               f"{vram[0]}-{vram[-1]} GB), {len(under)} fall under {C08_TOKENS_PER_S:g} token/s and "
               f"{len(e.rows) - len(under)} do not, and a handshake per layer is at most {100 * top:.2g}% of a "
               "streamed token's time: "
               "streaming makes the overflow cross the link every token, so tokens/s ≤ link GB/s / overflow GB, "
               f"under {C08_TOKENS_PER_S:g} only when more than {limit:.1f} GB overflow at the measured "
               f"{e.link_gbs} GB/s (a {small['overflow_gb']:.2f} GB overflow gives {small['overlap']:.1f} tok/s), a "
               f"limit of bandwidth{', not latency stalls' if top < 0.5 else ' and latency'}")
    holds = len(under) == len(e.rows) and top >= 0.5
    by = "the link's bandwidth" if top < 0.5 else "per-layer handshakes"
    return Verdict(decide(holds, not under), summary + ".", ev,
                   f"overflows larger than one second of link transfer ({limit:.1f} GB at {e.link_gbs} GB/s), limited "
                   f"by {by}; smaller overflows run at link GB/s / overflow GB, still far below resident speed",
                   f"{ic.MEASURED_SOURCE}; {TABLES}; interconnect.streaming_tokens_per_s (1 GB reserved for "
                   "KV cache and activations)")


C08 = claim("C08", "interconnect", gather_c08, judge_c08,
            short="streaming weights over Thunderbolt 5 during decoding limits generation to under 1 token/s when "
                  "weights exceed VRAM",
            quote="Attempting to stream model parameters across Thunderbolt 5 during autoregressive generation "
                  "introduces severe PCIe latency stalls that limit generation to sub-1 token/sec for weights "
                  "exceeding VRAM.",
            rule="Evidence: tokens/s of 5 public models at 4/8/16 bits on 8-24 GB cards whose weights overflow VRAM, "
                 "the overflow streamed at the published TB5 rate (arithmetic), and a handshake per layer. Refuted if "
                 "none falls under 1 token/s; confirmed if all do and handshakes (latency) are at least half a "
                 "token's time; qualified otherwise, naming the overflow and the bandwidth limit.",
            outcomes=("confirmed", "qualified", "refuted"))


# ---- C25 ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Transfers:
    """C25's evidence: a recorded native link's completion times of `total_bytes` sent as `layers`
    transfers with a synchronize after each and as one (repeated samples, ms), its small transfer's
    median and p99 (µs) and pinned rate; the bound on retimer jitter (one unit interval of the tunnel's
    PCIe lanes per retimer); the credit window and bandwidth-delay product of the TB5 link model; and
    that model's simulated p99 ratios per layer size (seeded)."""
    label: str
    layers: int
    total_bytes: int
    many_ms: tuple[float, ...]
    one_ms: tuple[float, ...]
    small_bytes: int
    small_us: float
    small_p99_us: float
    pinned_gbs: float
    retimers: int
    ui_ps: float
    credit_bytes: int
    bdp_bytes: float
    simulated: dict[str, float]             # "64 x 64 KiB" -> p99 per-layer / p99 one transfer
    source: str = ""                        # the caption of the recorded run


def simulated_ratios(link: ic.Link, layers: int = 64) -> dict[str, float]:
    """p99 of `layers` per-layer transfers over p99 of one, per layer size: the seeded Monte Carlo."""
    out = {}
    for per in (64 << 10, 16 << 20):
        (_, many), (_, one) = ic.per_layer_vs_contiguous(layers * per, layers, link, runs=2000, seed=0).items()
        tag = f"{layers} × {per >> 10} KiB" if per < 1 << 20 else f"{layers} × {per >> 20} MiB"
        out[tag] = ic.percentiles(many)["p99"] / ic.percentiles(one)["p99"]
    return out


def gather_c25(live: bool) -> Transfers | None:
    rec = link_records()
    native = native_link_efficiency()
    if rec is None or native is None:
        return None
    run, v = rec
    many = next((r for k, r in v.items() if k[1] == "completion_ms" and "sync each" in k[0]), None)
    one = next((r for k, r in v.items() if k[1] == "completion_ms" and "one transfer" in k[0]), None)
    small = next((r for k, r in v.items() if k[1] == "transfer_us"), None)
    if not (many and one and small and many["samples"] and one["samples"] and "p99_us" in small):
        return None
    link = ic.Link()
    return Transfers(run.label, many["transfers"], many["bytes"], tuple(many["samples"]), tuple(one["samples"]),
                     small["bytes"], small["value"], small["p99_us"], native[1], link.retimers,
                     1e3 / ic.GT_PER_LANE[ic.TB5_PCIE[0]], link.credit_bytes,
                     link.payload_gbs * link.rtt_us * 1e3, simulated_ratios(link), run.caption)


def judge_c25(e: Transfers) -> Verdict:
    """Refuted unless every recorded run of one transfer beat every run of per-layer transfers; confirmed
    if retimer jitter could then explain half the spread of a transfer's completion; qualified if not."""
    many, one = sorted(e.many_ms), sorted(e.one_ms)
    wins = many[0] > one[-1]
    ratio = statistics.median(many) / statistics.median(one)
    rate = e.pinned_gbs * 1e3                                            # bytes per µs
    h = e.small_us - e.small_bytes / rate                                # the fixed cost of one transfer, µs
    per = e.total_bytes / e.layers
    predicted = e.layers * (h + per / rate) / (h + e.total_bytes / rate)
    spread = max(e.small_p99_us - e.small_us, 1e-9)                    # p99 >= median; kept above 0 to divide
    jitter_us = e.retimers * e.ui_ps * 1e-6
    cause = jitter_us >= spread / 2
    tag = f"{e.layers} × {per / (1 << 20):g} MiB"
    ev = {f"recorded {tag} synced transfers / one transfer, median ({e.label})": Number(ratio, "×"),
          f"predicted by t = h + S/B from the small transfer ({e.label})": Number(predicted, "×"),
          f"recorded {tag} synced transfers, fastest run ({e.label})": Number(many[0], "ms"),
          f"recorded one transfer of the same bytes, slowest run ({e.label})": Number(one[-1], "ms"),
          f"recorded {e.small_bytes >> 10} KiB transfer + sync, median ({e.label})": Number(e.small_us, "µs"),
          f"recorded {e.small_bytes >> 10} KiB transfer + sync, p99 - median ({e.label})": Number(spread, "µs"),
          f"transfer size at which data time = handshake ({e.label})": Number(h * rate / 1e3, "kB"),
          f"retimer jitter bound: {e.retimers} retimers x one {e.ui_ps:g} ps unit interval": Number(jitter_us, "µs"),
          "retimer jitter bound / recorded spread": Number(jitter_us / spread, "×"),
          "TB5 model: credit window": Number(e.credit_bytes, "B"),
          "TB5 model: bandwidth-delay product (rate × credit round trip)": Number(e.bdp_bytes, "B")}
    ev |= {f"TB5 model, {k}: per-layer p99 / one transfer p99 (seeded)": Number(x, "×")
           for k, x in e.simulated.items()}
    summary = (f"{'Every' if wins else 'Not every'} recorded run of {tag} synced transfers was slower than the slowest "
               f"single transfer of the same bytes ({ratio:.2f}× at the median, on {e.label}'s native PCIe link), and "
               f"a transfer's completion varies by {spread:.1f} µs (p99 - median), "
               f"{float(f'{spread / jitter_us:.3g}'):,.0f}× what retimer jitter could add ({e.retimers} retimers at "
               f"one {e.ui_ps:g} ps unit interval each): t = h + S/B predicts the loss ({predicted:.2f}×) from a "
               f"fixed cost of {h:.1f} µs per transfer, and credits cap the rate only when their window is under the "
               f"bandwidth-delay product (in the TB5 model {e.credit_bytes:,} B against {e.bdp_bytes:,.0f} B), and "
               "then the same every run")
    return Verdict(decide(wins and cause, not wins), summary + ".", ev,
                   "per-layer transfers cost a fixed handshake each, which matters near h × B "
                   f"({h * rate / 1e3:,.0f} kB on {e.label}, {per / (1 << 20):g} MiB layers costing "
                   f"{100 * (ratio - 1):+.0f}%); "
                   + ("retimer jitter is large enough to explain the variation of a transfer's completion" if cause else
                      "the variation comes from the host's side of the handshake, not retimer jitter or credits"),
                   f"{e.source or e.label} (experiment link); interconnect.simulate_transfers (seed 0, "
                   "2000 runs; stated TB5 assumptions)")


C25 = claim("C25", "interconnect", gather_c25, judge_c25,
            short="retimer jitter and flow-control credits make DMA completion non-deterministic: prefer large "
                  "contiguous transfers to per-layer handshakes",
            quote="Retimer jitter and transport layer flow control credits cause non-deterministic round-trip DMA "
                  "completion times, necessitating large contiguous transfers rather than layer-by-layer handshakes.",
            rule="Evidence: a native PCIe link's recorded runs of 256 MiB as 64 synced transfers and as one, and the "
                 "spread (p99 - median) of a small transfer, against what retimer jitter can add (one unit interval "
                 "per retimer). Refuted unless every per-layer run is slower than every single transfer; confirmed "
                 "if jitter could explain half the spread; qualified otherwise, naming the host's handshake.",
            outcomes=("confirmed", "qualified", "refuted"),
            pending=("the host-device transfers of a CUDA GPU",
                     "python -m ref_impl bench --link"))


CLAIMS = (C07, C08, C18, C25)   # in id order; __init__ assembles the registry
