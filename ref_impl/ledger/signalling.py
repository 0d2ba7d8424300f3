"""Chapter signalling, GDDR7 and PAM3 (book/signalling/gddr7-pam3): C03, C23 and C29.

GDDR7 silicon is not something this course can run, but each claim's numbers are decided without it:
arithmetic on the claims' own numbers and JEDEC's, PAM3 error rates exact and simulated with a seed,
and a bank-conflict count of decode-step reads (theory.signalling). Nothing reads results/ or is timed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ref_impl.ledger.core import Number, Verdict, claim, decide
from ref_impl.theory import roofline
from ref_impl.theory import signalling as sg

# Quoted from C03 (the roofline chapter's C04 check uses its bus too), not measured.
C03_GBS, C03_BUS_BITS, C03_PIN_GBPS = 1024.0, 256, 32.0
GDDR7_CARD = "RTX 5090"   # the one GDDR7 card in roofline.HARDWARE
C23_GAIN = 0.5            # quoted from C23: "a 50% data rate improvement"
C23_BER = 1e-12           # the bit error rate at which the codes' SNR is compared (a memory link's usual target)
C29_SUB_CHANNELS, C29_BITS = 2, 16   # quoted from C29: "dual independent 16-bit sub-channels"
STRIDED = "K cache, head-major: 8 heads at once"   # the attention read whose streams share banks
SIG_SOURCES = ("JEDEC GDDR7 press release (JESD239, 2024-03-05); ref_impl.theory.signalling (arithmetic, "
               "seeded simulation)")


# ---- C03 ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BusArithmetic:
    """C03's numbers and JEDEC's: a bus of `bus_bits` pins at `pin_gbps`, a code's bits per unit interval,
    the standard's top pin rate, and a shipping card's pins, rate and datasheet bandwidth."""
    pin_gbps: float
    bus_bits: int
    claim_gbs: float
    bits_per_ui: float
    device_pins: int
    max_pin_gbps: float
    card: str
    card_pin_gbps: float
    card_bus_bits: int
    card_datasheet_gbs: float


def gather_c03(live: bool) -> BusArithmetic:
    return BusArithmetic(C03_PIN_GBPS, C03_BUS_BITS, C03_GBS, sg.PAM3.bits_per_ui, sg.GDDR7_DEVICE_PINS,
                         sg.GDDR7["max_pin_gbps"], GDDR7_CARD, sg.RTX5090_PIN_GBPS, sg.RTX5090_BUS_BITS,
                         roofline.HARDWARE[GDDR7_CARD].bandwidth_gbs)


def judge_c03(e: BusArithmetic) -> Verdict:
    """Confirmed when the claim's pins and rate give its GB/s, the code carries 3 bits per 2 unit
    intervals and 32 Gbps is within JESD239's rates; refuted when any of them fails."""
    bus = sg.bandwidth_gbs(e.pin_gbps, e.bus_bits)
    card = sg.bandwidth_gbs(e.card_pin_gbps, e.card_bus_bits)
    sums = math.isclose(bus, e.claim_gbs, rel_tol=1e-6)
    code = math.isclose(e.bits_per_ui, 3 / 2, rel_tol=1e-9)
    in_range = e.pin_gbps <= e.max_pin_gbps
    ev = {f"C03's bus: {e.pin_gbps:g} Gbps x {e.bus_bits} pins / 8": Number(bus, "GB/s"),
          "the claim's aggregate bandwidth": Number(e.claim_gbs, "GB/s"),
          "bits per unit interval, PAM3 as GDDR7 codes it": Number(e.bits_per_ui, "bits/UI"),
          f"symbol rate per pin at {e.pin_gbps:g} Gbps": Number(e.pin_gbps / e.bits_per_ui, "GBd"),
          f"one device ({e.device_pins} data pins) at {e.pin_gbps:g} Gbps": Number(
              sg.bandwidth_gbs(e.pin_gbps, e.device_pins), "GB/s"),
          f"devices on a {e.bus_bits}-bit bus": Number(e.bus_bits / e.device_pins, "devices"),
          "JESD239's top pin rate": Number(e.max_pin_gbps, "Gbps"),
          f"JESD239's per-device peak ({e.max_pin_gbps:g} Gbps x {e.device_pins} pins / 8)": Number(
              sg.bandwidth_gbs(e.max_pin_gbps, e.device_pins), "GB/s"),
          f"{e.card}: {e.card_pin_gbps:g} Gbps x {e.card_bus_bits} pins / 8": Number(card, "GB/s"),
          f"{e.card}: datasheet bandwidth": Number(e.card_datasheet_gbs, "GB/s"),
          f"a {e.bus_bits}-bit bus at the {e.card}'s {e.card_pin_gbps:g} Gbps": Number(
              sg.bandwidth_gbs(e.card_pin_gbps, e.bus_bits), "GB/s")}
    fails = []
    if not sums:
        fails.append(f"{e.pin_gbps:g} Gbps x {e.bus_bits} pins / 8 is {bus:,.0f} GB/s, not {e.claim_gbs:,.0f}")
    if not code:
        fails.append(f"the code carries {e.bits_per_ui:g} bits per unit interval, not 3 per 2")
    if not in_range:
        fails.append(f"{e.pin_gbps:g} Gbps is above JESD239's {e.max_pin_gbps:g}")
    if fails:
        summary = "The arithmetic does not hold: " + "; ".join(fails)
    else:
        summary = (f"{e.pin_gbps:g} Gbps x {e.bus_bits} pins / 8 = {bus:,.0f} GB/s, as claimed, and GDDR7's PAM3 code "
                   f"carries {e.bits_per_ui:g} bits per unit interval, JEDEC's '3 bits over 2 cycles' with a cycle "
                   f"being a unit interval (one symbol time), not a clock period: {e.pin_gbps:g} Gbps is "
                   f"{e.pin_gbps / e.bits_per_ui:.2f} GBd per pin. It is a speed grade within JESD239's "
                   f"{e.max_pin_gbps:g} Gbps; the {e.card} runs {e.card_pin_gbps:g} Gbps on {e.card_bus_bits} bits, "
                   f"{card:,.0f} GB/s by the same formula against a datasheet {e.card_datasheet_gbs:,.0f} GB/s")
    return Verdict(decide(not fails, bool(fails)), summary + ".", ev,
                   "'cycle' read as a unit interval, as JEDEC writes it; peak bandwidth, before refresh and "
                   "read/write turnarounds", f"{SIG_SOURCES}; {roofline.HARDWARE[GDDR7_CARD].source}")


C03 = claim("C03", "signalling", gather_c03, judge_c03,
            short="GDDR7 PAM3: 3 bits per 2 cycles per pin, 32 Gbps pins, 1024 GB/s on a 256-bit controller",
            quote="GDDR7 memory employs PAM3 signaling to transfer 3 bits over 2 cycles per pin, reaching 32 Gbps "
                  "pin rates and 1024 GB/s aggregate bandwidth across a 256-bit memory controller.",
            rule="Evidence: the claim's 32 Gbps x 256 pins / 8, the bits per unit interval of GDDR7's PAM3 code, "
                 "and JESD239's top pin rate (arithmetic; GDDR7 silicon is not run). Confirmed if the bus comes "
                 "to the claim's 1024 GB/s, the code carries 3 bits per 2 unit intervals and 32 Gbps is within "
                 "the standard's rates; refuted if any of these fails.",
            outcomes=("confirmed", "refuted"))


# ---- C23 ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LineCodes:
    """C23's evidence: each code's bits per unit interval and levels, the SNR each needs for C23_BER,
    and PAM3's bit error rate at one SNR, exact and simulated."""
    nyquist_ghz: float                      # the Nyquist frequency compared at (GDDR7's at 32 Gbps)
    bits_per_ui: dict[str, float]           # code name -> bits per unit interval as used
    levels: dict[str, int]
    snr_db: dict[str, float]                # code name -> SNR (dB) for a bit error rate of C23_BER
    sim_snr_db: float
    sim_bits: int
    sim_ber: float
    exact_ber: float


def gather_c23(live: bool) -> LineCodes:
    codes = (sg.NRZ, sg.PAM3, sg.PAM4)
    sim_snr, sim_bits = 16.0, 600_000
    return LineCodes(sg.nyquist_ghz(sg.PAM3, C03_PIN_GBPS), {c.name: c.bits_per_ui for c in codes},
                     {c.name: len(c.levels) for c in codes}, {c.name: sg.snr_for_ber(c, C23_BER) for c in codes},
                     sim_snr, sim_bits, sg.simulate_error_rates(sg.PAM3, sim_snr, sim_bits, seed=0)[1],
                     sg.analytic_error_rates(sg.PAM3, sim_snr)[1])


def judge_c23(e: LineCodes) -> Verdict:
    """Refuted unless PAM3 carries 1.5x NRZ's bits at one Nyquist frequency; confirmed if it does so at
    no SNR cost at equal error rate, qualified (naming the cost) if it needs more SNR."""
    rate = {k: 2 * e.nyquist_ghz * b for k, b in e.bits_per_ui.items()}
    gain = rate["PAM3"] / rate["NRZ"] - 1
    penalty = e.snr_db["PAM3"] - e.snr_db["NRZ"]
    states = e.levels["PAM3"] ** 2                                     # two unit intervals of PAM3
    ev = {f"data rate at a {e.nyquist_ghz:.2f} GHz Nyquist frequency, {k}": Number(v, "Gbps") for k, v in rate.items()}
    ev |= {"PAM3 / NRZ data rate, same Nyquist frequency": Number(1 + gain, "x"),
           "the claim's ratio": Number(1 + C23_GAIN, "x"),
           "PAM3 states in 2 unit intervals (3 levels each)": Number(states, "states"),
           "bits those states carry whole (floor of log2)": Number(math.floor(math.log2(states)), "bits")}
    ev |= {f"SNR for a bit error rate of {C23_BER:.0e}, {k}": Number(v, "dB") for k, v in e.snr_db.items()}
    ev |= {f"PAM3's SNR penalty vs NRZ at {C23_BER:.0e}": Number(penalty, "dB"),
           f"PAM4's SNR penalty vs NRZ at {C23_BER:.0e}": Number(e.snr_db["PAM4"] - e.snr_db["NRZ"], "dB"),
           f"PAM3 bit error rate at {e.sim_snr_db:g} dB, simulated ({e.sim_bits:,} bits, seed 0)": Number(
               e.sim_ber, "errors/bit"),
           f"PAM3 bit error rate at {e.sim_snr_db:g} dB, exact": Number(e.exact_ber, "errors/bit")}
    rate_holds = math.isclose(gain, C23_GAIN, rel_tol=1e-9)
    as_claimed = "as claimed" if rate_holds else f"not the claim's {100 * C23_GAIN:.0f}%"
    more = "more" if penalty >= 0 else "less"
    summary = (f"At the same Nyquist frequency (the same symbol rate) PAM3 carries {100 * gain:.0f}% more data than "
               f"NRZ, {as_claimed}, and at equal bit error rate ({C23_BER:.0e}) it needs {abs(penalty):.1f} dB {more} "
               f"SNR than NRZ: {rate['PAM3']:.1f} against {rate['NRZ']:.1f} Gbps at {e.nyquist_ghz:.2f} GHz (PAM4: "
               f"{rate['PAM4']:.1f} Gbps for {e.snr_db['PAM4'] - e.snr_db['NRZ']:+.1f} dB)")
    if rate_holds:
        summary += (f"; two unit intervals of {e.levels['PAM3']} levels give {states} states, of which "
                    f"{2 ** math.floor(math.log2(states))} carry {math.floor(math.log2(states))} bits, so 3 bits go "
                    "into 2 unit intervals, not three levels")
    cost = (f"on a channel with {penalty:.1f} dB more SNR than NRZ needs at the same symbol rate" if penalty > 0
            else "on any channel NRZ works on at the same symbol rate")
    return Verdict(decide(rate_holds and penalty <= 0, not rate_holds), summary + ".", ev,
                   f"{cost} (for one data rate PAM3 needs {rate['NRZ'] / rate['PAM3']:.2f} of NRZ's Nyquist "
                   "frequency, and so less channel loss)",
                   f"{SIG_SOURCES}; Proakis and Salehi, Digital Communications, 5th ed., 4.3 (M-PAM error rates)")


C23 = claim("C23", "signalling", gather_c23, judge_c23,
            short="PAM3 gives 50% more data rate than NRZ at the same Nyquist frequency (3 levels, 2 unit intervals)",
            quote="PAM3 signaling achieves a 50% data rate improvement over binary NRZ at identical Nyquist "
                  "frequencies by encoding three voltage levels into two transmitted unit intervals.",
            rule="Evidence: each code's bits per unit interval at one Nyquist frequency, and the SNR each needs for "
                 "a bit error rate of 1e-12 (exact, checked by a seeded simulation). Refuted if PAM3's data rate is "
                 "not 1.5x NRZ's; confirmed if it is and PAM3 needs no more SNR than NRZ (the claim names no "
                 "cost); qualified if the gain costs SNR, naming how much.",
            outcomes=("confirmed", "qualified", "refuted"))


# ---- C29 ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Channels:
    """C29's evidence: channels per device and their width for GDDR7 (JESD239) and GDDR6, and the
    simulated share of a decode step's reads that hit a bank conflict, per (stream, channels, XOR map)."""
    gddr7: tuple[int, int]                  # (channels per device, bits per channel)
    gddr6: tuple[int, int]
    conflicts: dict[tuple[str, int, bool], float]


def gather_c29(live: bool) -> Channels:
    return Channels((sg.GDDR7["channels"], sg.GDDR7["channel_bits"]), (sg.GDDR6["channels"], sg.GDDR6["channel_bits"]),
                    sg.conflict_rates(sg.decode_step_streams()))


def judge_c29(e: Channels) -> Verdict:
    """Refuted if GDDR7 does not split each GDDR6 channel into two 16-bit ones, or if neither more channels
    nor the address map cut the strided read's conflicts; confirmed if the split itself cuts them,
    qualified if only the address map does."""
    split = e.gddr7[0] / e.gddr6[0]
    layout = split == C29_SUB_CHANNELS and e.gddr7[1] == C29_BITS
    lin = {ch: e.conflicts[STRIDED, ch, False] for ch in (2, 4)}
    xor = {ch: e.conflicts[STRIDED, ch, True] for ch in (2, 4)}
    by_split = lin[4] <= lin[2] / 2                  # "avoid": at least halved by the channel count alone
    by_map = xor[4] <= lin[4] / 2
    ev = {"independent channels per device, GDDR7 (JESD239)": Number(e.gddr7[0], "channels"),
          "independent channels per device, GDDR6": Number(e.gddr6[0], "channels"),
          "GDDR7 channels per GDDR6 channel": Number(split, "channels"),
          "channel width, GDDR7": Number(e.gddr7[1], "bits"), "channel width, GDDR6": Number(e.gddr6[1], "bits"),
          "sub-channel width the claim gives": Number(C29_BITS, "bits")}
    for (name, ch, x), r in e.conflicts.items():
        if name == STRIDED or not x:
            ev[f"bank conflicts, {name}, {ch} channels, {'XOR' if x else 'linear'} map"] = Number(100 * r, "% of reads")
    count = "as claimed" if split == C29_SUB_CHANNELS else f"not {C29_SUB_CHANNELS}"
    width = "as claimed" if e.gddr7[1] == C29_BITS else f"where the claim has {C29_BITS}"
    cure = ("4 channels at least halve an attention read's bank conflicts" if by_split else
            "the address map, not the channel count, removes an attention read's bank conflicts" if by_map else
            "neither more channels nor the address map removes an attention read's bank conflicts")
    summary = (f"GDDR7 splits each of GDDR6's {e.gddr6[0]} channels of {e.gddr6[1]} bits into {split:g}, {count}, "
               f"of {e.gddr7[1]} bits, {width}, and in a simulated decode step {cure}: 8 heads of a head-major K "
               f"cache read side by side collide on {100 * lin[2]:.1f}% of reads with 2 channels and "
               f"{100 * lin[4]:.1f}% with 4 under a linear address map, and on {100 * xor[2]:.2f}% and "
               f"{100 * xor[4]:.2f}% under an XOR-hashed map. JESD239 gives a device {e.gddr7[0]} independent "
               f"channels ('two 16-bit channels' is GDDR6's organisation)")
    return Verdict(decide(layout and by_split, not layout or not (by_split or by_map)), summary + ".", ev,
                   f"{'more channels' if by_split else 'an XOR-hashed address map, whatever the channel count'} "
                   f"(conflicts {100 * lin[2]:.1f}% at 2 channels, {100 * lin[4]:.1f}% at 4, {100 * xor[4]:.2f}% at 4 "
                   "with the XOR map); the simulation is of one device's address map (16 banks "
                   "per channel, 2 KiB rows, 32-byte requests, a window of 8 requests per channel), with no timing",
                   f"{sg.SOURCES['jedec']}; {sg.SOURCES['channel_width']}; {sg.SOURCES['gddr6']}; "
                   "ref_impl.theory.signalling (address-map simulation)")


C29 = claim("C29", "signalling", gather_c29, judge_c29,
            short="GDDR7 splits each device channel into two independent 16-bit sub-channels, avoiding bank "
                  "collisions in attention reads",
            quote="GDDR7 splits each physical device channel into dual independent 16-bit sub-channels, enabling "
                  "concurrent burst accesses that avoid bank collision stalls during attention matrix reads.",
            rule="Evidence: JESD239's channels per device and their width against GDDR6's, and simulated bank "
                 "conflicts of a decode step's head-major K-cache reads with 2 and 4 channels under a linear and "
                 "an XOR-hashed address map. Refuted if GDDR7 does not split each GDDR6 channel into two 16-bit "
                 "sub-channels, or if neither 4 channels nor the XOR map at least halves the conflicts ('avoid'); "
                 "confirmed if 4 channels alone halve them; qualified if only the address map does.",
            outcomes=("confirmed", "qualified", "refuted"))


CLAIMS = (C03, C23, C29)   # in id order; __init__ assembles the registry
