"""Chapter signalling, GDDR7 and PAM3 (book/signalling/gddr7-pam3): C03, C23 and C29.

Arithmetic on the claims' own numbers and JEDEC's, PAM3 error rates exact and simulated with a
seed, and a bank-conflict count of decode-step reads (theory.signalling); nothing is timed.
"""

from __future__ import annotations

from ref_impl.ledger.core import Number, Verdict, claim
from ref_impl.theory import roofline
from ref_impl.theory import signalling as sg

# Quoted from C03 (the roofline chapter's C04 check uses its bus too), not measured.
C03_GBS, C03_BUS_BITS, C03_PIN_GBPS = 1024.0, 256, 32.0
GDDR7_CARD = "RTX 5090"   # the one GDDR7 card in roofline.HARDWARE
_SIG_SOURCES = "JEDEC GDDR7 press release (JESD239, 2024-03-05); ref_impl.theory.signalling (arithmetic, seeded simulation)"


def check_c03(live: bool) -> Verdict:
    """3 bits per 2 UI, 32 Gbps pins, 1024 GB/s on 256 bits: the arithmetic, and what a 'cycle' is."""
    bus = sg.bandwidth_gbs(C03_PIN_GBPS, C03_BUS_BITS)
    card = sg.bandwidth_gbs(sg.RTX5090_PIN_GBPS, sg.RTX5090_BUS_BITS)
    ev = {"C03's bus: 32 Gbps x 256 pins / 8": Number(bus, "GB/s"),
          "bits per unit interval, PAM3 as GDDR7 codes it (3 bits / 2 symbols)": Number(sg.PAM3.bits_per_ui, "bits/UI"),
          "symbol rate per pin at 32 Gbps": Number(C03_PIN_GBPS / sg.PAM3.bits_per_ui, "GBd"),
          "one device (32 data pins) at 32 Gbps": Number(sg.bandwidth_gbs(C03_PIN_GBPS, sg.GDDR7_DEVICE_PINS), "GB/s"),
          "devices on a 256-bit bus": Number(C03_BUS_BITS / sg.GDDR7_DEVICE_PINS, "devices"),
          "JESD239's per-device peak (48 Gbps x 32 pins / 8)": Number(sg.bandwidth_gbs(48, sg.GDDR7_DEVICE_PINS), "GB/s"),
          f"{GDDR7_CARD}: {sg.RTX5090_PIN_GBPS} Gbps x {sg.RTX5090_BUS_BITS} pins / 8": Number(card, "GB/s"),
          f"a 256-bit bus at the {GDDR7_CARD}'s {sg.RTX5090_PIN_GBPS} Gbps": Number(
              sg.bandwidth_gbs(sg.RTX5090_PIN_GBPS, C03_BUS_BITS), "GB/s")}
    status = "confirmed" if bus == C03_GBS and card == roofline.HARDWARE[GDDR7_CARD].bandwidth_gbs else "refuted"
    summary = (f"32 Gbps x 256 pins / 8 = {bus:.0f} GB/s, and 3 bits per 2 'cycles' is JEDEC's own wording, in "
               f"which a cycle is a unit interval (one symbol time: NRZ moves 2 bits over 2 of them), not a "
               f"clock period; 32 Gbps is then {C03_PIN_GBPS / 1.5:.2f} GBd per pin. It is the launch pin rate "
               f"(JESD239 reaches 48 Gbps, 192 GB/s per 32-pin device); the {GDDR7_CARD} runs "
               f"{sg.RTX5090_PIN_GBPS} Gbps on {sg.RTX5090_BUS_BITS} bits, {card:.0f} GB/s, matching NVIDIA's figure")
    return Verdict(status, summary + ".", ev,
                   "'cycle' read as a unit interval, as JEDEC writes it; 32 Gbps is one speed grade, not the "
                   "standard's limit; peak bandwidth, before refresh and read/write turnarounds",
                   f"{_SIG_SOURCES}; {roofline.HARDWARE[GDDR7_CARD].source}")


C03 = claim("C03", "signalling", check_c03,
            short="GDDR7 PAM3: 3 bits per 2 cycles per pin, 32 Gbps pins, 1024 GB/s on a 256-bit controller",
            quote="GDDR7 memory employs PAM3 signaling to transfer 3 bits over 2 cycles per pin, reaching 32 Gbps "
                  "pin rates and 1024 GB/s aggregate bandwidth across a 256-bit memory controller.")


def check_c23(live: bool) -> Verdict:
    """Data rate at one Nyquist frequency for NRZ, PAM3 (3 bits / 2 UI) and PAM4, and the SNR it costs."""
    f_n = sg.nyquist_ghz(sg.PAM3, C03_PIN_GBPS)              # GDDR7's at 32 Gbps
    rate = {c.name: sg.data_rate_gbps(c, f_n) for c in (sg.NRZ, sg.PAM3, sg.PAM4)}
    snr = {c.name: sg.snr_for_ber(c, 1e-12) for c in (sg.NRZ, sg.PAM3, sg.PAM4)}
    sim_ser, sim_ber = sg.simulate_error_rates(sg.PAM3, 16.0, 600_000, seed=0)
    ev = {f"data rate at a {f_n:.2f} GHz Nyquist frequency, {k}": Number(v, "Gbps") for k, v in rate.items()}
    ev |= {"PAM3 / NRZ data rate, same Nyquist frequency": Number(rate["PAM3"] / rate["NRZ"], "x"),
           "PAM3's ideal bits per UI (log2 3)": Number(sg.PAM3.ideal_bits_per_ui, "bits/UI"),
           "PAM3 / NRZ eye height, same swing": Number(100 * sg.PAM3.eye_height / sg.NRZ.eye_height, "%"),
           "Nyquist frequency for 32 Gbps, NRZ": Number(sg.nyquist_ghz(sg.NRZ, C03_PIN_GBPS), "GHz"),
           "Nyquist frequency for 32 Gbps, PAM3": Number(f_n, "GHz")}
    ev |= {f"SNR for a bit error rate of 1e-12, {k}": Number(v, "dB") for k, v in snr.items()}
    ev |= {"PAM3's SNR penalty vs NRZ at 1e-12": Number(snr["PAM3"] - snr["NRZ"], "dB"),
           "PAM4's SNR penalty vs NRZ at 1e-12": Number(snr["PAM4"] - snr["NRZ"], "dB"),
           "PAM3 bit error rate at 16 dB, simulated (600k bits, seed 0)": Number(sim_ber, "errors/bit"),
           "PAM3 bit error rate at 16 dB, exact": Number(sg.analytic_error_rates(sg.PAM3, 16.0)[1], "errors/bit")}
    gain = rate["PAM3"] / rate["NRZ"] - 1
    summary = (f"At the same Nyquist frequency (the same symbol rate) PAM3 carries {100 * gain:.0f}% more data than "
               f"NRZ ({rate['PAM3']:.0f} against {rate['NRZ']:.1f} Gbps at {f_n:.2f} GHz), but because 3 bits go "
               "into 2 unit intervals of 3 levels each (9 states for 8 values), not 'three voltage levels into two "
               f"unit intervals'; on the same swing its eye is half as tall, which costs "
               f"{snr['PAM3'] - snr['NRZ']:.1f} dB of SNR at a bit error rate of 1e-12 (PAM4: "
               f"{snr['PAM4'] - snr['NRZ']:.1f} dB for +100%)")
    return Verdict("qualified" if abs(gain - 0.5) < 1e-9 else "refuted", summary + ".", ev,
                   "the rate holds by arithmetic; it is usable only on a channel with ~6 dB more SNR margin than "
                   "NRZ needs at the same symbol rate (put the other way: for one data rate PAM3 needs 2/3 of "
                   "NRZ's Nyquist frequency, and so suffers less channel loss)",
                   f"{_SIG_SOURCES}; Proakis and Salehi, Digital Communications, 5th ed., 4.3 (M-PAM error rates)")


C23 = claim("C23", "signalling", check_c23,
            short="PAM3 gives 50% more data rate than NRZ at the same Nyquist frequency (3 levels, 2 unit intervals)",
            quote="PAM3 signaling achieves a 50% data rate improvement over binary NRZ at identical Nyquist "
                  "frequencies by encoding three voltage levels into two transmitted unit intervals.")


def check_c29(live: bool) -> Verdict:
    """What JESD239 specifies per device, and a bank-conflict count of decode-step reads on 2 and 4 channels."""
    rates = sg.conflict_rates(sg.decode_step_streams())
    strided = "K cache, head-major: 8 heads at once"
    ev = {"independent channels per device, GDDR7 (JESD239)": Number(sg.GDDR7["channels"], "channels"),
          "independent channels per device, GDDR6": Number(sg.GDDR6["channels"], "channels"),
          "channel width, GDDR7 (4 x 8 of a device's 32 data pins)": Number(sg.GDDR7["channel_bits"], "bits"),
          "channel width, GDDR6": Number(sg.GDDR6["channel_bits"], "bits"),
          "channels x width the claim describes": Number(2 * 16, "bits")}
    for (name, ch, xor), r in rates.items():
        if name == strided or not xor:
            ev[f"bank conflicts, {name}, {ch} channels, {'XOR' if xor else 'linear'} map"] = Number(100 * r, "% of reads")
    lin = [rates[strided, ch, False] for ch in (2, 4)]
    xor = [rates[strided, ch, True] for ch in (2, 4)]
    summary = (f"JESD239 gives each GDDR7 device {sg.GDDR7['channels']} independent channels, doubled from GDDR6's "
               f"{sg.GDDR6['channels']}, and a device's 32 data pins make them {sg.GDDR7['channel_bits']} bits wide; "
               "'two independent 16-bit (sub-)channels' is GDDR6's organisation. Nor do more channels avoid bank "
               f"collisions by themselves: in a simulated decode step, 8 heads of a head-major K cache read side by "
               f"side collide on {100 * lin[0]:.0f}% of reads with 2 channels and {100 * lin[1]:.0f}% with 4 under a "
               f"linear address map, and on {100 * xor[0]:.2f}% and {100 * xor[1]:.1f}% under an XOR-hashed map: the "
               "address map, not the channel count, removes them")
    return Verdict("refuted", summary + ".", ev,
                   "four narrower channels do allow more accesses in flight per device (more independent command "
                   "streams and open rows); the simulation is of one device's address map (16 banks per channel, "
                   "2 KiB rows, 32-byte requests, a window of 8 requests per channel), with no timing",
                   f"{sg.SOURCES['jedec']}; {sg.SOURCES['channel_width']}; {sg.SOURCES['gddr6']}; "
                   "ref_impl.theory.signalling (address-map simulation)")


C29 = claim("C29", "signalling", check_c29,
            short="GDDR7 splits each device channel into two independent 16-bit sub-channels, avoiding bank "
                  "collisions in attention reads",
            quote="GDDR7 splits each physical device channel into dual independent 16-bit sub-channels, enabling "
                  "concurrent burst accesses that avoid bank collision stalls during attention matrix reads.")


CLAIMS = (C03, C23, C29)   # in id order; __init__ assembles the registry
