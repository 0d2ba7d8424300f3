"""Interconnect: what a PCIe link, tunnelled through Thunderbolt 5, carries, and what that costs a decoder.

Four pieces, each a few functions. (1) PCIe link arithmetic: lanes x GT/s, line coding, and the bytes
every transaction-layer packet (TLP) adds to its payload, each named. (2) Thunderbolt 5 / USB4 v2:
80 Gb/s per direction (120 with Bandwidth Boost), a PCIe tunnel whose ends are PCIe Gen4 x4, and the
"efficiency stack" from the wire to payload bytes. (3) A transfer-time model: a handshake per
transfer, a credit window, retimer jitter and bit-error replays, run as a seeded Monte Carlo.
(4) Weight streaming: tokens/s when part of the weights must cross the link for every token. The
measurements (host memory copies, host<->device copies) are `ref_impl.measure.link`.

Units: GB is 1e9 bytes, Gb is 1e9 bits; GT/s is transfers (bits per lane) per second.

References: PCI Express Base Specification 3.0, sec. 4.2.2 (128b/130b, framing tokens), 3.5 (DLLPs);
Intel AN 456 "PCI Express High Performance Reference Design", "Throughput for Posted Writes" (256-byte
payload, 3-DW header: 5 DW of overhead, 92%): https://www.intel.com/content/www/us/en/docs/programmable/
683541/current/throughput-for-posted-writes.html; Intel AN 708 "Understanding PCI Express Throughput"
(5-7 DW per TLP, 2-DW DLLPs, SKP ordered sets); USB4 Specification v2.0 (USB-IF, 2022), transport
layer; Intel, "Intel Introduces Thunderbolt 5 Connectivity Standard" (newsroom, 2023-09-12).

See chapter: interconnect
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from ref_impl.theory import roofline, shapes

GT_PER_LANE = {1: 2.5, 2: 5.0, 3: 8.0, 4: 16.0, 5: 32.0}   # GT/s, PCIe Base Specification per generation
DLLP_BYTES = 8          # a DLLP is 6 bytes, plus a 2-byte SDP token (Gen3+) or SDP + END symbols (Gen1/2)
DLLPS_PER_TLP = 0.5     # stated: one ACK or UpdateFC DLLP per two TLPs; 0 (all on the other lane) .. 2 (both per TLP)
SKP_BLOCKS = 370        # Gen3+: one SKP ordered-set block per ~370 data blocks (clock compensation)

TB5_GBPS = 80.0         # per direction, two lanes of 40 Gb/s (USB4 v2 Gen 4, PAM3)
TB5_BOOST_GBPS = 120.0  # Bandwidth Boost: three lanes one way, one lane (40 Gb/s) back
TB5_PCIE = (4, 4)       # the PCIe tunnel's ends are PCIe Gen4 x4 adapters
USB4_HEADER = 4         # bytes: a USB4 transport-layer packet's header (HopID, length, HEC ...)
USB4_MAX_PAYLOAD = 256  # bytes of payload per transport-layer packet

# A measured TB5 eGPU link, and the same GPU and host over OCuLink (a native PCIe Gen4 x4 cable): GB/s.
MEASURED = {"TB5 host-to-device": 5.6, "TB5 device-to-host": 5.8,
            "OCuLink host-to-device": 6.6, "OCuLink device-to-host": 6.7}
MEASURED_SOURCE = ("Try Some Tech (RTX 5070 Ti, Core Ultra 7 265K, ASUS ProArt Z890), reported by Tom's Hardware, "
                   "'OCuLink outpaces Thunderbolt 5 in Nvidia RTX 5070 Ti tests' (2025-10): https://www.tomshardware."
                   "com/pc-components/gpus/oculink-outpaces-thunderbolt-5-in-nvidia-rtx-5070-ti-tests-latter-up-to-"
                   "14-percent-slower-on-average-in-gaming-benchmarks")


# ---- (1) PCIe link arithmetic ----------------------------------------------------------------------

def coding_efficiency(gen: int) -> float:
    """Payload bits per line bit of the physical layer: 8b/10b for Gen1/2, 128b/130b for Gen3-5."""
    return 8 / 10 if gen <= 2 else 128 / 130


def raw_gbs(gen: int, lanes: int) -> float:
    """GB/s per direction on the wire: GT/s x lanes / 8 bits."""
    return GT_PER_LANE[gen] * lanes / 8


def coded_gbs(gen: int, lanes: int) -> float:
    """GB/s per direction after line coding (e.g. Gen4 x4: 16 x 4 x 128/130 / 8 = 7.877)."""
    return raw_gbs(gen, lanes) * coding_efficiency(gen)


def tlp_overheads(gen: int = 4, header_dw: int = 3, ecrc: bool = False) -> dict[str, int]:
    """Bytes each TLP adds to its payload, by name. 3-DW headers: completions and 32-bit-address
    writes; 4-DW: 64-bit addresses. Gen3+ drop the END symbol: the 4-byte STP token carries the
    length and the 12-bit sequence number. Both framings total 20 bytes with a 3-DW header."""
    out = {"TLP header": 4 * header_dw, "ECRC (optional)": 4 if ecrc else 0}
    if gen >= 3:
        out["STP token (framing + sequence number)"] = 4
    else:
        out["STP + END framing symbols"], out["sequence number"] = 2, 2
    out["LCRC"] = 4
    return out


def tlp_efficiency(payload: int, gen: int = 4, header_dw: int = 3, ecrc: bool = False,
                   dllps_per_tlp: float = 0.0) -> float:
    """Payload / (payload + TLP overheads + DLLP bytes per TLP): the share of coded link bytes that
    is data. 256 B, 3-DW, no DLLPs: 256 / 276 = 92.8%."""
    over = sum(tlp_overheads(gen, header_dw, ecrc).values()) + dllps_per_tlp * DLLP_BYTES
    return payload / (payload + over)


def payload_gbs(gen: int, lanes: int, payload: int, header_dw: int = 3, ecrc: bool = False,
                dllps_per_tlp: float = DLLPS_PER_TLP, skp: bool = True) -> float:
    """The protocol ceiling: coded GB/s x SKP share x TLP/DLLP efficiency. No DMA engine, no host."""
    skp_share = SKP_BLOCKS / (SKP_BLOCKS + 1) if skp and gen >= 3 else 1.0
    return coded_gbs(gen, lanes) * skp_share * tlp_efficiency(payload, gen, header_dw, ecrc, dllps_per_tlp)


# ---- (2) Thunderbolt 5: the tunnel and the efficiency stack -------------------------------------------

def usb4_packets(tlp_bytes: int) -> tuple[int, int]:
    """(transport-layer packets, their header bytes) to carry one TLP: payloads of at most 256 bytes,
    padded to 4-byte multiples, each behind a 4-byte header."""
    n = math.ceil(tlp_bytes / USB4_MAX_PAYLOAD)
    return n, n * USB4_HEADER + (-tlp_bytes % 4)


def tunnel_overhead(payload: int, header_dw: int = 3) -> dict[str, float]:
    """USB4 encapsulation of one TLP carrying `payload` bytes, two ways, since how an adapter packs TLPs
    is not public: it keeps the whole TLP with framing and LCRC ("full"), or only header + payload
    ("bare"). Shares of the tunnelled bytes taken by USB4 headers, and wire bytes per payload byte."""
    out = {}
    for name, tlp in (("full", payload + sum(tlp_overheads(4, header_dw).values())), ("bare", payload + 4 * header_dw)):
        n, extra = usb4_packets(tlp)
        out[f"{name}: packets per TLP"] = n
        out[f"{name}: header bytes per TLP"] = extra
        out[f"{name}: share of tunnelled bytes"] = extra / (tlp + extra)
        out[f"{name}: wire bytes per payload byte"] = (tlp + extra) / payload
    return out


@dataclass(frozen=True)
class Stage:
    """One step of the efficiency stack: what is left (GB/s) and what this step took away."""
    name: str
    gbs: float
    why: str


def efficiency_stack(payload: int = 256, header_dw: int = 3, ecrc: bool = False,
                     dllps_per_tlp: float = DLLPS_PER_TLP, dma_efficiency: float = 1.0,
                     boost: bool = False) -> list[Stage]:
    """From TB5's wire rate to payload bytes, one direction: wire -> PCIe Gen4 x4 tunnel cap -> 128b/130b
    -> SKP ordered sets -> TLP framing/header/LCRC at this payload size -> DLLPs -> DMA engine and
    driver (`dma_efficiency`, a stated or measured factor; 1.0 takes nothing). The USB4 headers come
    out of the wire's headroom above the tunnel cap, not out of the payload (see `tunnel_overhead`)."""
    gen, lanes = TB5_PCIE
    wire = (TB5_BOOST_GBPS if boost else TB5_GBPS) / 8
    skp = SKP_BLOCKS / (SKP_BLOCKS + 1)
    tlp = tlp_efficiency(payload, gen, header_dw, ecrc)
    with_dllp = tlp_efficiency(payload, gen, header_dw, ecrc, dllps_per_tlp)
    coded = coded_gbs(gen, lanes)
    over = sum(tlp_overheads(gen, header_dw, ecrc).values())
    return [
        Stage("TB5 wire" + (" (Boost)" if boost else ""), wire, f"{wire * 8:.0f} Gb/s one way"),
        Stage("PCIe tunnel cap (Gen4 x4)", raw_gbs(gen, lanes), "the adapters at both ends are PCIe Gen4 x4"),
        Stage("128b/130b coding", coded, "2 sync bits per 128"),
        Stage("SKP ordered sets", coded * skp, f"1 block in {SKP_BLOCKS + 1}"),
        Stage(f"TLP overhead ({payload} B payload)", coded * skp * tlp, f"{over} B per TLP"),
        Stage("DLLPs (ACK, flow control)", coded * skp * with_dllp, f"{dllps_per_tlp:g} x {DLLP_BYTES} B per TLP"),
        Stage("DMA engine, driver", coded * skp * with_dllp * dma_efficiency, f"x {dma_efficiency:.3g}"),
    ]


# ---- (3) transfer time: handshakes, credits, jitter ----------------------------------------------------

@dataclass(frozen=True)
class Link:
    """What one DMA transfer over a link costs. Defaults are stated assumptions for a TB5 eGPU link:
    the payload rate is the measured TB5 figure (MEASURED), the rest orders of magnitude (see chapter)."""
    payload_gbs: float = MEASURED["TB5 host-to-device"]
    handshake_us: float = 10.0      # median doorbell + descriptor fetch + completion seen by the host
    handshake_sigma: float = 0.5    # lognormal shape of the handshake (OS, interrupts, IOMMU): 0 = fixed
    credit_bytes: int = 16384       # receive buffer advertised as flow-control credits
    rtt_us: float = 2.0             # credit return round trip (two controllers, retimers, cable)
    retimer_jitter_ps: float = 2.0  # random jitter per retimer, rms (a normal distribution)
    retimers: int = 2
    ber: float = 1e-12              # bit-error ratio; an error costs a replay of one round trip
    mps: int = 256                  # max payload per TLP

    @property
    def rate_gbs(self) -> float:
        """Sustained payload rate: the link's, or the credit window's (credit_bytes per round trip)."""
        return min(self.payload_gbs, self.credit_bytes / (self.rtt_us * 1e3))


def deterministic(link: Link) -> Link:
    """The same link with every random term switched off."""
    return replace(link, handshake_sigma=0.0, retimer_jitter_ps=0.0, ber=0.0)


def simulate_transfers(sizes: list[int] | np.ndarray, link: Link = Link(), runs: int = 2000,
                       seed: int = 0) -> np.ndarray:
    """Seconds to complete `sizes` (bytes) one after another, each with its own handshake, in each of
    `runs` Monte Carlo runs: sum over transfers of handshake (lognormal, median handshake_us) +
    bytes / rate + retimer jitter (normal) + replays (binomial per TLP) x rtt."""
    rng = np.random.default_rng(seed)
    sizes = np.asarray(sizes, dtype=np.float64)
    shape = (runs, len(sizes))
    hs = link.handshake_us * 1e-6 * (rng.lognormal(0.0, link.handshake_sigma, shape) if link.handshake_sigma
                                     else np.ones(shape))
    data = sizes / (link.rate_gbs * 1e9)
    jitter = rng.normal(0.0, link.retimer_jitter_ps * 1e-12 * math.sqrt(link.retimers), shape) \
        if link.retimer_jitter_ps else 0.0
    tlps = np.ceil(sizes / link.mps)
    p_err = -math.expm1(8 * (link.mps + 20) * math.log1p(-link.ber)) if link.ber else 0.0
    replays = rng.binomial(tlps.astype(np.int64), p_err, shape) * link.rtt_us * 1e-6 if p_err else 0.0
    return np.sum(hs + data + jitter + replays, axis=1)


def per_layer_vs_contiguous(total_bytes: int, layers: int, link: Link = Link(), runs: int = 2000,
                            seed: int = 0) -> dict[str, np.ndarray]:
    """Completion times (s) of `total_bytes` sent as `layers` transfers with a handshake each, and as one."""
    per = [total_bytes // layers] * layers
    return {f"{layers} per-layer transfers": simulate_transfers(per, link, runs, seed),
            "one contiguous transfer": simulate_transfers([total_bytes], link, runs, seed + 1)}


def percentiles(samples: np.ndarray) -> dict[str, float]:
    """p50, p99 and max of a sample."""
    return {"p50": float(np.percentile(samples, 50)), "p99": float(np.percentile(samples, 99)),
            "max": float(np.max(samples))}


def knee_bytes(link: Link) -> float:
    """The transfer size at which moving the data takes as long as the handshake: handshake x rate."""
    return link.handshake_us * 1e-6 * link.rate_gbs * 1e9


# ---- (4) weight streaming -------------------------------------------------------------------------------

def streaming_tokens_per_s(weights_gb: float, vram_gb: float, vram_gbs: float, link_gbs: float,
                           overlap: bool = True, reserve_gb: float = 1.0) -> float:
    """Decode tokens/s when weights beyond VRAM (less `reserve_gb` for KV cache and activations)
    cross the link every token: the resident part reads at vram_gbs, the streamed part at link_gbs;
    with overlap (prefetch the next layers while computing) t = max of the two, without it their sum."""
    resident = min(max(vram_gb - reserve_gb, 0.0), weights_gb)
    t_vram, t_link = resident / vram_gbs, (weights_gb - resident) / link_gbs
    return 1.0 / (max(t_vram, t_link) if overlap else t_vram + t_link)


def overflow_for(tokens_per_s: float, link_gbs: float) -> float:
    """GB of streamed weights per token at which the link alone allows `tokens_per_s` (full overlap)."""
    return link_gbs / tokens_per_s


VRAM_SIZES_GB = (8, 12, 16, 24)


def streaming_grid(models: list[str], bits=(4, 8, 16), vram_sizes=VRAM_SIZES_GB, vram_gbs: float = 1008.0,
                   link_gbs: float = MEASURED["TB5 host-to-device"], reserve_gb: float = 1.0) -> list[dict]:
    """Every (model of shapes.PUBLIC, bits, VRAM size) whose weights overflow VRAM: weight and
    overflow GB, tokens/s streamed (with and without overlap) and resident (if it all fit)."""
    rows = []
    for name in models:
        for b in bits:
            w = roofline.weight_bytes(shapes.PUBLIC[name], b) / 1e9
            for v in vram_sizes:
                over = w - max(v - reserve_gb, 0.0)
                if over > 0:
                    rows.append({"model": name, "bits": b, "vram_gb": v, "weights_gb": w, "overflow_gb": over,
                                 "overlap": streaming_tokens_per_s(w, v, vram_gbs, link_gbs, True, reserve_gb),
                                 "serial": streaming_tokens_per_s(w, v, vram_gbs, link_gbs, False, reserve_gb),
                                 "resident": vram_gbs / w})
    return rows


# ---- (5) a pipeline across machines: only the activations cross ------------------------------------------

HEADER_BYTES = 4        # the pipeline's header per hop and step: one int32, the positions that follow (0: stop)
TOKEN_BYTES = 4         # the sampled token, one int32, sent from the last stage back to the first
ETHERNET_FRAME_BYTES = 38   # per frame beyond the IP packet: preamble+SFD 8, MAC header 14, FCS 4, inter-frame gap 12
TCP_IP_HEADER_BYTES = 52    # IPv4 20 + TCP 20 + the timestamp option 12 that Linux and macOS send by default


def pipeline_link_bytes(hidden: int, act_bytes: int, stages: int, positions: int = 1) -> int:
    """Bytes a pipeline step puts on its links (engine/pipeline.py's protocol): per hop between stages a
    header and the hidden states (positions x hidden x act_bytes), and the token back; 0 for one stage."""
    if stages < 2:
        return 0
    return (stages - 1) * (HEADER_BYTES + positions * hidden * act_bytes) + TOKEN_BYTES


def ethernet_payload_gbs(line_gbps: float, mtu: int = 1500, headers: int = TCP_IP_HEADER_BYTES) -> float:
    """TCP payload GB/s of an Ethernet link: line rate / 8 x (MTU - IP/TCP headers) / (MTU + frame overhead).
    10 GbE at MTU 1500: 1.25 x 1448 / 1538 = 1.177 GB/s (IEEE 802.3 framing; RFC 7323 timestamps)."""
    return line_gbps / 8 * (mtu - headers) / (mtu + ETHERNET_FRAME_BYTES)


# The links a cluster of machines can use, as `Link`s: payload rate, and a fixed latency per message (the
# `handshake_us` field: NIC or controller, cable, switch). Stated assumptions like Link's own defaults; the
# software of each end (MLX's ring over TCP) is not in them: `hop_seconds` adds it, measured.
LINKS: dict[str, Link] = {
    "Thunderbolt 5": Link(),                                             # the measured TB5 rate, 10 us
    "10 GbE": Link(payload_gbs=ethernet_payload_gbs(10.0), handshake_us=10.0),
}
LINKS_SOURCE = ("TB5: MEASURED (a TB5 eGPU link's host-to-device copies) and Link's stated 10 us; 10 GbE: "
                "the line rate less Ethernet framing and IP/TCP headers at MTU 1500, and a stated 10 us for "
                "two NICs and a switch")


def transfer_seconds(nbytes: float, link: Link) -> float:
    """One transfer with every random term off: handshake + bytes / rate (simulate_transfers' mean path)."""
    return link.handshake_us * 1e-6 + nbytes / (link.rate_gbs * 1e9)


def hop_seconds(nbytes: float, link: Link, software_us: float) -> float:
    """One message between pipeline stages: the two ends' software (MLX's ring, the kernel's TCP: measured
    on loopback, where no wire adds to it) plus the link's transfer."""
    return software_us * 1e-6 + transfer_seconds(nbytes, link)


def machines_for(weights_gb: float, memory_gb: float, reserve_gb: float = 1.0) -> int:
    """Machines of memory_gb (less reserve_gb each for the KV cache and activations) that hold the weights."""
    return max(1, math.ceil(weights_gb / max(memory_gb - reserve_gb, 1e-9)))


def pipeline_tokens_per_s(weights_gb: float, machines: int, memory_gbs: float, hidden: int, act_bytes: int,
                          link: Link, software_us: float) -> float:
    """Decode tokens/s of a model split in a pipeline over `machines`: with one sequence the stages run one
    after another, so every weight is still read once per token at memory_gbs (the machines' bandwidth does
    not add up), and each step crosses machines - 1 hops forward and one back (`pipeline_link_bytes`)."""
    t = weights_gb / memory_gbs
    if machines > 1:
        t += (machines - 1) * hop_seconds(HEADER_BYTES + hidden * act_bytes, link, software_us)
        t += hop_seconds(TOKEN_BYTES, link, software_us)
    return 1.0 / t


def pipeline_grid(models: list[str], links: dict[str, Link], software_us: float, bits=(4, 8, 16),
                  memory_sizes=VRAM_SIZES_GB, memory_gbs: float = 1008.0, act_bytes: int = 2,
                  reserve_gb: float = 1.0) -> list[dict]:
    """Every (model of shapes.PUBLIC, bits, memory size, link) whose weights overflow one machine, as
    `streaming_grid` has them: tokens/s when one machine streams the overflow over the link (overlapped)
    against the same machines in a pipeline over the same link, the bytes per token each puts on the
    link, and the link's share of the pipeline's token time."""
    rows = []
    for name in models:
        shape = shapes.PUBLIC[name]
        for b in bits:
            w = roofline.weight_bytes(shape, b) / 1e9
            for m in memory_sizes:
                n = machines_for(w, m, reserve_gb)
                if n < 2:
                    continue
                for link_name, link in links.items():
                    tps = pipeline_tokens_per_s(w, n, memory_gbs, shape.hidden_size, act_bytes, link, software_us)
                    rows.append({"model": name, "bits": b, "memory_gb": m, "weights_gb": w, "link": link_name,
                                 "machines": n, "overflow_gb": w - (m - reserve_gb),
                                 "stream": streaming_tokens_per_s(w, m, memory_gbs, link.rate_gbs, True, reserve_gb),
                                 "pipeline": tps, "link_share": 1 - tps * w / memory_gbs,
                                 "pipeline_bytes": pipeline_link_bytes(shape.hidden_size, act_bytes, n),
                                 "resident": memory_gbs / w})
    return rows
