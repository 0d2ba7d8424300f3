"""signalling: how a memory bus puts bits on a wire -- NRZ, PAM3 and PAM4, GDDR7's 3-bit/2-symbol
code, an eye-diagram and error-rate simulation, and the channel arithmetic of a GDDR7 device.

A pin sends one *symbol* per unit interval (UI); the symbol rate (GBd) sets the bandwidth the wire
must carry, its Nyquist frequency being half of it. NRZ has 2 levels (1 bit/UI), PAM4 has 4
(2 bits/UI), PAM3 has 3 (log2 3 = 1.585 bits/UI at most; GDDR7 packs 3 bits into 2 symbols, 1.5
bits/UI). On a fixed voltage swing more levels mean smaller steps between them: the eye is 1/2 as
tall for PAM3 and 1/3 for PAM4, which costs signal-to-noise ratio.

Conventions: levels span a peak-to-peak swing of 2 (-1 ... +1); SNR is (swing / 2)^2 / sigma^2 of
the additive Gaussian noise at the sampler, in dB, the same for every code. Channel: rectangular
pulses through a first-order (RC) low-pass whose 3-dB frequency is `cutoff` times the symbol rate.

GDDR7's exact bit-to-symbol table is in JEDEC JESD239 and not reproduced here: `PAM3_CODE` is this
course's own table with the property the standard describes (8 of the 9 symbol pairs carry 3 bits).

References: JEDEC, "JEDEC Publishes GDDR7 Graphics Memory Standard" (press release, 2024-03-05),
https://www.jedec.org/news/pressreleases/jedec-publishes-gddr7-graphics-memory-standard ; J. G.
Proakis, M. Salehi, "Digital Communications", 5th ed., section 4.3 (M-PAM error probability);
Z. Zhang, Z. Zhu, X. Zhang, "A permutation-based page interleaving scheme", MICRO 2000.

See chapter: signalling
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LineCode:
    """A pulse-amplitude code: its voltage levels on a swing of 2 and the bits it carries per UI."""
    name: str
    levels: tuple[float, ...]
    bits_per_ui: float          # as used: NRZ 1, PAM3 with GDDR7's 3-bit/2-symbol code 1.5, PAM4 2

    @property
    def ideal_bits_per_ui(self) -> float:
        """log2(levels): what the levels could carry with an ideal (infinitely long) code."""
        return math.log2(len(self.levels))

    @property
    def eye_height(self) -> float:
        """Step between adjacent levels (volts on a swing of 2): the tallest an eye can be."""
        return self.levels[1] - self.levels[0]


NRZ = LineCode("NRZ", (-1.0, 1.0), 1.0)
PAM3 = LineCode("PAM3", (-1.0, 0.0, 1.0), 1.5)
PAM4 = LineCode("PAM4", (-1.0, -1 / 3, 1 / 3, 1.0), 2.0)
CODES = {c.name: c for c in (NRZ, PAM3, PAM4)}

# ---- line coding ------------------------------------------------------------------------------------

# PAM3: 3 bits (value 4*b0 + 2*b1 + b2, the first bit of the stream most significant) -> 2 ternary
# symbols. The unused pair is (+1, -1), one of the two full-swing pairs. Neighbouring pairs (one
# symbol one level apart) differ in one bit on 9 of the grid's 10 edges; (0,0) has 4 neighbours and
# a 3-bit label only 3, so one edge, (0,0)-(0,+1), must differ in more.
PAM3_CODE = ((+1, 0), (+1, +1), (-1, +1), (0, +1), (0, 0), (0, -1), (-1, 0), (-1, -1))
PAM3_UNUSED = (+1, -1)
PAM3_FALLBACK = 4   # a detector reads the unused pair as (0,0) = 100: one bit from either neighbour
_PAIR_INDEX = {p: v for v, p in enumerate(PAM3_CODE)}
_DECODE = np.array([_PAIR_INDEX.get((a, b), -1) for a in (-1, 0, 1) for b in (-1, 0, 1)])  # by 3(a+1)+(b+1)
_PAM4_GRAY = np.array([0, 1, 3, 2])     # 2 bits (b0 b1) -> level index: 00, 01, 11, 10 from the bottom


def _bits(bits) -> np.ndarray:
    b = np.asarray(bits, dtype=np.int64).ravel()
    if b.size and not np.isin(b, (0, 1)).all():
        raise ValueError("bits must be 0 or 1")
    return b.astype(np.uint8)


def _three_bits(values: np.ndarray) -> np.ndarray:
    """3-bit values (the first bit most significant) -> their bits, in order."""
    return ((values[:, None] >> np.array([2, 1, 0])) & 1).astype(np.uint8).ravel()


def encode_pam3(bits) -> np.ndarray:
    """Bits -> ternary symbols in {-1, 0, +1}, 2 per 3 bits. A length that is not a multiple of 3 is
    zero-padded at the end; the bit count travels separately (`decode_pam3(symbols, n_bits)`)."""
    b = _bits(bits)
    b = np.concatenate([b, np.zeros(-b.size % 3, np.uint8)]).reshape(-1, 3)
    values = 4 * b[:, 0] + 2 * b[:, 1] + b[:, 2]
    return np.asarray(PAM3_CODE, np.int8)[values].ravel()


def decode_pam3(symbols, n_bits: int | None = None) -> np.ndarray:
    """Ternary symbols -> bits, the first `n_bits` of them (all when None). Raises ValueError naming
    the position and the pair if a pair is the unused one (or a symbol is not -1, 0 or +1)."""
    s = np.asarray(symbols, dtype=np.int64).ravel()
    if s.size % 2:
        raise ValueError(f"{s.size} symbols: PAM3 symbols come in pairs")
    if s.size and not np.isin(s, (-1, 0, 1)).all():
        raise ValueError(f"symbol {int(np.flatnonzero(~np.isin(s, (-1, 0, 1)))[0])} is not -1, 0 or +1")
    values = _DECODE[3 * (s[0::2] + 1) + (s[1::2] + 1)]
    if (values < 0).any():
        i = int(np.flatnonzero(values < 0)[0])
        raise ValueError(f"invalid PAM3 pair {tuple(int(x) for x in s[2 * i:2 * i + 2])} at pair {i} "
                         f"(symbols {2 * i} and {2 * i + 1}): the code never sends {PAM3_UNUSED}")
    bits = _three_bits(values)
    if n_bits is not None and not bits.size - 3 < n_bits <= bits.size:
        raise ValueError(f"n_bits={n_bits} does not fit {s.size} symbols ({bits.size} bits with padding)")
    return bits[:n_bits]


def to_symbols(code: LineCode, bits) -> np.ndarray:
    """Bits -> level indices 0..M-1 (NRZ: the bit; PAM4: Gray-coded pairs; PAM3: GDDR7-style pairs)."""
    b = _bits(bits)
    if code is PAM3:
        return (encode_pam3(b) + 1).astype(np.int64)
    if code is PAM4:
        b = np.concatenate([b, np.zeros(b.size % 2, np.uint8)]).reshape(-1, 2)
        return _PAM4_GRAY[2 * b[:, 0] + b[:, 1]]
    return b.astype(np.int64)


def to_bits(code: LineCode, idx) -> np.ndarray:
    """Level indices -> bits, the inverse of `to_symbols` (padding kept). Detected PAM3 pairs that are
    the unused one decode as PAM3_FALLBACK instead of raising: this is a receiver, not a validator."""
    idx = np.asarray(idx, dtype=np.int64)
    if code is PAM3:
        values = _DECODE[3 * idx[0::2] + idx[1::2]]
        values = np.where(values < 0, PAM3_FALLBACK, values)
        return _three_bits(values)
    if code is PAM4:
        v = np.argsort(_PAM4_GRAY)[idx]
        return np.stack([v >> 1, v & 1], axis=1).astype(np.uint8).ravel()
    return idx.astype(np.uint8)


# ---- channel: waveform, low-pass, noise, jitter, eye -------------------------------------------------

def sigma(snr_db: float) -> float:
    """Noise standard deviation for an SNR of (swing/2)^2 / sigma^2 on a swing of 2 (volts)."""
    return 10 ** (-snr_db / 20)


def waveform(code: LineCode, idx, samples_per_ui: int = 32, jitter_ui: float = 0.0, rng=None) -> np.ndarray:
    """Rectangular pulses, `samples_per_ui` samples per UI; each edge moves by Gaussian jitter of
    `jitter_ui` UI rms (clipped to +-0.4 UI)."""
    levels = np.asarray(code.levels)[np.asarray(idx)]
    n = len(levels) * samples_per_ui
    t = (np.arange(n) + 0.5) / samples_per_ui                 # sample times, in UI
    edges = np.arange(len(levels), dtype=float)
    if jitter_ui > 0:
        edges[1:] += np.clip(rng.normal(0, jitter_ui, len(levels) - 1), -0.4, 0.4)
    return levels[np.searchsorted(edges, t, side="right") - 1]


def lowpass(x: np.ndarray, cutoff: float, samples_per_ui: int) -> np.ndarray:
    """First-order RC low-pass, 3-dB frequency `cutoff` x the symbol rate, as a truncated FIR (DC gain 1)."""
    a = 1 - math.exp(-2 * math.pi * cutoff / samples_per_ui)   # per-sample step of the RC response
    taps = int(math.ceil(math.log(1e-6) / math.log(1 - a)))
    h = a * (1 - a) ** np.arange(taps)
    return np.convolve(x, h / h.sum())[:len(x)]


@dataclass(frozen=True)
class Eye:
    """An eye diagram as a 2-D histogram of overlaid 2-UI traces, and its measured openings."""
    code: str
    time_ui: np.ndarray      # (2 N,) bin centres, UI, the sampling instant at 1.0
    volts: np.ndarray        # (B,) bin centres
    counts: np.ndarray       # (B, 2 N) samples per bin
    openings: np.ndarray     # (M - 1,) inner height of each eye at the sampling instant (volts)
    symbol_errors: int       # threshold detection at the sampling instant
    symbols: int


def eye_diagram(code: LineCode, n_symbols: int = 3000, samples_per_ui: int = 32, cutoff: float = 0.6,
                snr_db: float | None = 30.0, jitter_ui: float = 0.0, seed: int = 0, v_bins: int = 80) -> Eye:
    """Random bits through `code`, the channel and noise (none if snr_db is None); the sampling
    instant is the phase, within 2 UI after a symbol starts, where the noiseless eyes open widest."""
    rng = np.random.default_rng(seed)
    n = samples_per_ui
    idx = to_symbols(code, rng.integers(0, 2, int(n_symbols * code.bits_per_ui)))
    clean = lowpass(waveform(code, idx, n, jitter_ui, rng), cutoff, n)
    rx = clean + (rng.normal(0, sigma(snr_db), clean.size) if snr_db is not None else 0)
    k = np.arange(2, len(idx) - 3)                              # skip the filter's start-up and the tail
    sent = idx[k]
    # openings of every eye at each candidate phase o: min of the level above - max of the one below
    at = clean[k[:, None] * n + np.arange(2 * n)]                # (symbols, phases)
    lo = np.stack([np.where(sent[:, None] == j, at, np.inf).min(0) for j in range(len(code.levels))])
    hi = np.stack([np.where(sent[:, None] == j, at, -np.inf).max(0) for j in range(len(code.levels))])
    best = int(np.argmax((lo[1:] - hi[:-1]).min(0)))
    sample = rx[k * n + best]
    lo = np.array([sample[sent == j].min() for j in range(len(code.levels))])
    hi = np.array([sample[sent == j].max() for j in range(len(code.levels))])
    errors = int((detect(code, sample) != sent).sum())
    starts = k * n + best - n                                   # 2-UI windows centred on the sampler
    traces = rx[starts[:, None] + np.arange(2 * n)]
    t = np.broadcast_to(np.arange(2 * n), traces.shape)
    counts, _, v_edges = np.histogram2d(t.ravel(), traces.ravel(), bins=[2 * n, v_bins],
                                        range=[[-0.5, 2 * n - 0.5], [-1.6, 1.6]])
    return Eye(code.name, np.arange(2 * n) / n, (v_edges[:-1] + v_edges[1:]) / 2, counts.T,
               lo[1:] - hi[:-1], errors, len(k))


# ---- error rates: threshold detection, simulated and exact ------------------------------------------

def detect(code: LineCode, v: np.ndarray) -> np.ndarray:
    """Level index nearest each sample: thresholds halfway between adjacent levels."""
    lv = np.asarray(code.levels)
    return np.digitize(v, (lv[1:] + lv[:-1]) / 2)


def simulate_error_rates(code: LineCode, snr_db: float, n_bits: int = 300_000, seed: int = 0) -> tuple[float, float]:
    """(symbol error rate, bit error rate) of random bits over additive Gaussian noise, sampled at the
    eye's centre (no ISI: the BER of an ideal channel), threshold detection."""
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 2, n_bits - n_bits % 6).astype(np.uint8)   # whole pairs for PAM3 and PAM4
    idx = to_symbols(code, bits)
    got = detect(code, np.asarray(code.levels)[idx] + rng.normal(0, sigma(snr_db), idx.size))
    return float(np.mean(got != idx)), float(np.mean(to_bits(code, got) != bits))


def _q(x: np.ndarray) -> np.ndarray:
    """Gaussian tail probability Q(x) = P(N(0,1) > x)."""
    return 0.5 * np.frompyfunc(math.erfc, 1, 1)(np.asarray(x, float) / math.sqrt(2)).astype(float)


def transition_matrix(code: LineCode, snr_db: float) -> np.ndarray:
    """P(detected level j | sent level i) under Gaussian noise with midpoint thresholds (M x M). Each
    entry is a difference of tail probabilities on its own side, so tiny error rates keep their digits."""
    lv = np.asarray(code.levels)
    edges = np.concatenate([[-np.inf], (lv[1:] + lv[:-1]) / 2, [np.inf]])
    z = np.clip((edges[None, :] - lv[:, None]) / sigma(snr_db), -40, 40)
    above, below = _q(z), _q(-z)                                  # P(noise > edge), P(noise < edge)
    p = np.where(z[:, :-1] >= 0, above[:, :-1] - above[:, 1:], below[:, 1:] - below[:, :-1])
    np.fill_diagonal(p, 0)
    np.fill_diagonal(p, 1 - p.sum(1))
    return p


def analytic_error_rates(code: LineCode, snr_db: float) -> tuple[float, float]:
    """Exact (symbol error rate, bit error rate) of the same detector, from Gaussian tails: every
    sent symbol (PAM3: every sent pair) against every detected one, bits counted through the code.
    For equiprobable levels the SER is the textbook 2 (M-1)/M Q(d / sigma), d half the level step."""
    p = transition_matrix(code, snr_db)
    m = len(code.levels)
    if code is not PAM3:
        bits = to_bits(code, np.arange(m)).reshape(m, -1)
        flips = (bits[:, None, :] != bits[None, :, :]).sum(-1)
        wrong = (p * (1 - np.eye(m))).sum(1)                      # P(symbol error | level)
        return float(np.mean(wrong)), float(np.mean((p * flips).sum(1)) / bits.shape[1])
    sent = np.asarray(PAM3_CODE) + 1                              # (8, 2) level indices
    pair_p = p[sent[:, 0]][:, :, None] * p[sent[:, 1]][:, None, :]  # (8, 3, 3): P(detected pair)
    dec = to_bits(PAM3, np.stack(np.meshgrid(range(3), range(3), indexing="ij"), -1).reshape(-1)).reshape(3, 3, 3)
    mine = to_bits(PAM3, sent.ravel()).reshape(8, 3)
    flips = (dec[None] != mine[:, None, None, :]).sum(-1)       # (8, 3, 3)
    wrong = (p * (1 - np.eye(m))).sum(1)                          # P(symbol error | level)
    ser = np.mean((wrong[sent[:, 0]] + wrong[sent[:, 1]]) / 2)
    return float(ser), float(np.mean((pair_p * flips).sum((1, 2))) / 3)


def snr_for_ber(code: LineCode, target: float) -> float:
    """SNR (dB) at which `analytic_error_rates` gives bit error rate `target` (bisection, 0.001 dB)."""
    lo, hi = 0.0, 40.0
    while hi - lo > 1e-3:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if analytic_error_rates(code, mid)[1] > target else (lo, mid)
    return (lo + hi) / 2


# ---- rates: Nyquist frequency and bandwidth ----------------------------------------------------------

def data_rate_gbps(code: LineCode, nyquist_ghz: float) -> float:
    """Data rate per pin at a Nyquist frequency: symbol rate 2 f_N times bits per UI."""
    return 2 * nyquist_ghz * code.bits_per_ui


def nyquist_ghz(code: LineCode, data_rate: float) -> float:
    """Nyquist frequency (half the symbol rate) that a per-pin data rate in Gbps needs."""
    return data_rate / code.bits_per_ui / 2


def bandwidth_gbs(pin_gbps: float, pins: int) -> float:
    """Peak bandwidth in GB/s of `pins` data pins at `pin_gbps` each: bits per second / 8."""
    return pin_gbps * pins / 8


GDDR7_DEVICE_PINS = 32           # data pins per device: JEDEC's 192 GB/s per device at 48 Gbps / pin
GDDR7 = {"channels": 4, "channel_bits": 8, "max_pin_gbps": 48, "device_gbs": 192}
GDDR6 = {"channels": 2, "channel_bits": 16}
RTX5090_BUS_BITS, RTX5090_PIN_GBPS = 512, 28   # NVIDIA's RTX 5090 spec page (roofline.HARDWARE's source)
SOURCES = {
    "jedec": "JEDEC press release 'JEDEC Publishes GDDR7 Graphics Memory Standard' (2024-03-05): PAM3 "
             "'3 bits over 2-cycles', up to 192 GB/s per device, independent channels doubled from 2 "
             "(GDDR6) to 4; https://www.jedec.org/news/pressreleases/jedec-publishes-gddr7-graphics-memory-"
             "standard (text as reprinted at https://www.eeherald.com/section/news/p20240312nw003g.html)",
    "anandtech": "AnandTech, R. Smith and A. Shilov, 'JEDEC Publishes GDDR7 Memory Spec' (2024-03-06): "
                 "https://www.anandtech.com/show/21287/jedec-publishes-gddr7-specifications-pam3-ecc-higher-density",
    "channel_width": "TechPowerUp on JESD239, as reported by Geektopia (2024-03-07): four channels of 8 bits, "
                     "32 bits per chip; https://geektopia.es/es/technology/2024/03/07/noticias/las-primeras-"
                     "tarjetas-graficas-con-gddr7-usarian-chips-de-2-gb-con-los-de-3-gb-siendo-usados-mas-adelante.html",
    "gddr6": "Micron TN-ED-04 'GDDR6: Design Guide' (2018): two independent 16-bit channels per device",
    "cadence": "Cadence, 'Cadence Introduces the Industry's First GDDR7 Verification Solution' (2024-03-20): one "
               "write clock WCK latches data and commands, internal CK4 = WCK/4; https://community.cadence.com/"
               "cadence_blogs_8/b/fv/posts/cadence-introduces-industry-s-first-gddr7-verification-solution",
    "micron": "Micron GDDR7 product brief: 32 Gb/s, 'four independent channels', PAM3 with 1.5x the "
              "information per cycle of NRZ; https://www.micron.com/products/memory/graphics-memory/gddr7",
}

# ---- banks: where a decode step's reads land ---------------------------------------------------------

@dataclass(frozen=True)
class AddressMap:
    """Byte address -> (channel, bank, row) of one device: `row_bytes` of columns, then channel, then
    bank, then row; `xor` folds the row bits into (bank, channel) (permutation-based interleaving)."""
    channels: int
    banks: int = 16
    row_bytes: int = 2048
    xor: bool = False

    def __call__(self, addr) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        chunk = np.asarray(addr, dtype=np.int64) // self.row_bytes
        slot, row = chunk % (self.channels * self.banks), chunk // (self.channels * self.banks)
        if self.xor:
            width, r = self.channels * self.banks, row.copy()
            while (r > 0).any():                                  # xor-fold every row bit into the slot
                slot, r = slot ^ (r % width), r // width
        return slot % self.channels, slot // self.channels, row


def concurrent_reads(bases, length: int, granule: int = 32) -> np.ndarray:
    """Byte addresses of len(bases) streams, each reading `length` contiguous bytes from its base,
    issued round-robin one granule at a time (warps reading rows or heads side by side)."""
    offsets = np.arange(0, length, granule)
    return (np.asarray(bases, dtype=np.int64)[None, :] + offsets[:, None]).ravel()


def bank_conflicts(addr, amap: AddressMap, window: int = 8) -> int:
    """Requests that hit a bank which one of the previous `window` requests to the same channel
    left open at another row: each costs a precharge and an activate (a row cycle, tens of ns)."""
    ch, bank, row = amap(addr)
    order = np.argsort(ch, kind="stable")                        # each channel's requests, in order
    ch, bank, row = ch[order], bank[order], row[order]
    hit = np.zeros(ch.size, bool)
    for lag in range(1, window + 1):
        same = (ch[lag:] == ch[:-lag]) & (bank[lag:] == bank[:-lag]) & (row[lag:] != row[:-lag])
        hit[lag:] |= same
    return int(hit.sum())


def decode_step_streams(context: int = 1024, heads: int = 8, head_bytes: int = 256,
                        matrix_row_bytes: int = 8192) -> dict[str, np.ndarray]:
    """Addresses of three reads of one decode step, each with 8 streams side by side: weight-matrix
    rows (Llama-3.1-8B's 4096 bf16 values = 8 KiB each); one layer's K cache stored head-major
    ([head][position][dim]: heads `context` x 256 B apart); and stored position-major ([position][head][dim])."""
    pos_major = (np.arange(context)[:, None, None] * heads * head_bytes + np.arange(heads)[None, :, None] * head_bytes
                 + np.arange(0, head_bytes, 32)[None, None, :]).ravel()
    return {"weights: 8 rows at once": concurrent_reads(np.arange(8) * matrix_row_bytes, matrix_row_bytes),
            "K cache, head-major: 8 heads at once": concurrent_reads(np.arange(heads) * context * head_bytes,
                                                                     context * head_bytes),
            "K cache, position-major: 8 heads at once": pos_major}


def conflict_rates(streams: dict[str, np.ndarray], window: int = 8) -> dict[tuple[str, int, bool], float]:
    """(stream, channels per device, xor map) -> share of requests that hit a bank conflict, for a
    GDDR6-like device (2 channels) and a GDDR7-like one (4), 16 banks per channel, 2 KiB rows."""
    return {(name, ch, xor): bank_conflicts(a, AddressMap(ch, xor=xor), window) / a.size
            for name, a in streams.items() for ch in (2, 4) for xor in (False, True)}
