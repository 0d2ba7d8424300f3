"""Chapter speculative decoding and MTP (book/speculative/speculative-mtp): C06, C13, C22 and C24.

Exactness by a chi-square test on seeded draws (arithmetic, no timing); acceptance rates, forward
times against positions, and speedups from the recorded spec-alpha, spec-forward and spec-speed runs,
per machine (its reference runs: `records.references`). Every rule reads only those; nothing here is timed.

See chapter: speculative-decoding
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ref_impl.engine.speculative import chi2_pvalue, first_tokens
from ref_impl.ledger import core
from ref_impl.ledger.core import Number, Verdict, claim, decide
from ref_impl.measure import records
from ref_impl.measure.records import Run
from ref_impl.theory.speedup import break_even_alpha, expected_tokens, speedup

_SPEC_SOURCES = ("Leviathan, Kalman and Matias 2023 (the rule, E(α, γ), Theorem 3.8); Chen et al. 2023; "
                 "Cai et al. 2024 (Medusa heads)")
SPEC = ("spec-alpha", "spec-forward", "spec-speed")     # the experiments of `bench --spec`


def spec_of(runs: dict[str, Run]) -> dict:
    """One machine's spec records, from the run given for each experiment of SPEC: "backend"; "runs" (those
    Runs); "alpha": {(variant, drafter): {γ: α}} and "pooled": {(variant, drafter): α over every γ} (greedy);
    "forward": {model: {positions: t(L)/t(1)}}; "forward_ms": {model: {positions: ms}}; "plain": {model:
    pipelined tokens/s}; "speed": {(model, variant, drafter, alpha_set): {metric: {γ: value}}}."""
    d = {"backend": next(iter(runs.values())).machine["backend"], "runs": runs, "alpha": {}, "pooled": {},
         "forward": {}, "forward_ms": {}, "plain": {}, "speed": {}}
    for exp, run in runs.items():
        for r in run.select(exp, peer=None):
            if exp == "spec-alpha" and r["metric"] == "alpha" and r.get("temperature") == 0.0:
                if r["gamma"] is None:                                  # pooled over every γ
                    d["pooled"][r["variant"], r.get("drafter")] = r["value"]
                else:
                    d["alpha"].setdefault((r["variant"], r.get("drafter")), {})[r["gamma"]] = r["value"]
            elif exp == "spec-forward" and r["metric"] in ("forward_ratio", "forward_ms"):
                key = "forward" if r["metric"] == "forward_ratio" else "forward_ms"
                d[key].setdefault(r["model"], {})[r["positions"]] = r["value"]
            elif exp == "spec-speed" and r["variant"] == "plain" and r["metric"] == "tokens_per_s":
                d["plain"][r["model"]] = r["value"]
            elif exp == "spec-speed" and r.get("gamma") is not None:
                key = (r["model"], r["variant"], r.get("drafter"), r.get("alpha_set"))
                d["speed"].setdefault(key, {}).setdefault(r["metric"], {})[r["gamma"]] = r["value"]
    return d


def spec_recorded() -> dict[str, dict]:
    """Per machine, `spec_of` its reference run of each spec experiment (`records.references`): what the
    chapter and the rules read."""
    refs = {exp: records.references(exp, core.RESULTS_DIR, peer=None) for exp in SPEC}
    labels = dict.fromkeys(label for r in refs.values() for label in r)
    return {label: spec_of({exp: refs[exp][label] for exp in SPEC if label in refs[exp]}) for label in labels}


def run_captions(recorded: dict[str, dict], experiments: tuple[str, ...]) -> tuple[str, ...]:
    """The captions of the runs `spec_recorded` read for `experiments`, each once: a verdict's source."""
    return tuple(dict.fromkeys(d["runs"][x].caption for d in recorded.values() for x in experiments
                               if x in d["runs"]))


def source_line(sources: tuple[str, ...], machines, experiments: str) -> str:
    """A verdict's source line: the runs' captions, or (synthetic evidence) the machines' labels."""
    return "; ".join(sources) or f"results/ (machines {', '.join(sorted(set(machines)))}; experiment {experiments})"


def spec_in(run: Run) -> dict:
    """`spec_of` one run for every spec experiment it recorded: a run other than the reference, which a page
    sets beside it (its caption names it)."""
    whole = records.read_run(core.RESULTS_DIR / run.file)
    return spec_of({exp: whole for exp in SPEC if whole.select(exp)})


def best_speedup(speed: dict, model: str | None = None, variant: str | None = None,
                  alpha_set: float | None = None) -> tuple[float, int, tuple] | None:
    """(best measured speedup over γ, its γ, the run's key) among the runs that match."""
    best = None
    for key, m in speed.items():
        if ((model and key[0] != model) or (variant and key[1] != variant)
                or (alpha_set is not None and key[3] != alpha_set)):
            continue
        g = max(m["speedup"], key=m["speedup"].get)
        if best is None or m["speedup"][g] > best[0]:
            best = (m["speedup"][g], g, key)
    return best


def exactness(seed: int = 0, n: int = 200_000) -> tuple[float, float]:
    """Chi-square p-values of one-draft steps against Dirichlet p, q on 16 tokens: the rule's, and a
    broken rule's (on rejection, resample from p). Arithmetic on seeded draws, no timing."""
    rng = np.random.default_rng(seed)
    p, q = rng.dirichlet(np.ones(16)), rng.dirichlet(np.ones(16))
    tokens, _ = first_tokens(p, q, n, seed)
    drafts = rng.choice(16, n, p=q)
    broken = np.where(rng.random(n) * q[drafts] < p[drafts], drafts, rng.choice(16, n, p=p))
    return chi2_pvalue(tokens, p), chi2_pvalue(broken, p)




def sync_model(d: dict, key: tuple, gamma: int) -> float | None:
    """The speedup model with the step's costs as this machine measured them, synchronised: γ draft
    forwards of one position and one target forward of γ+1 positions (spec-forward), against the
    target's pipelined plain decoding. A speculative step must bring its verdict to the host before the
    next one, so it cannot overlap host and device as plain decoding does; None without those records."""
    model, _, drafter, _ = key
    fw, m = d["forward_ms"], d["speed"][key]
    if model not in fw or drafter not in fw or model not in d["plain"] or gamma + 1 not in fw[model]:
        return None
    t_plain = 1e3 / d["plain"][model]
    return speedup(m["alpha"][gamma], gamma, fw[drafter][1] / t_plain, fw[model][gamma + 1] / t_plain)


# ---- C24: one forward over K positions ----------------------------------------------------------------

@dataclass(frozen=True)
class Forwards:
    """Recorded forward time over K positions against one, per (machine, backend, model): {K: t(K)/t(1)}."""
    ratios: dict[tuple[str, str, str], dict[int, float]]
    sources: tuple[str, ...] = ()           # the captions of the runs read


def gather_c24(live: bool) -> Forwards | None:
    rec = spec_recorded()
    ratios = {(label, d["backend"], model): r for label, d in rec.items() for model, r in d["forward"].items()}
    return Forwards(ratios, run_captions(rec, ("spec-forward",))) if ratios else None


def saved_share(k: int, ratio: float) -> float:
    """The share of the K - 1 extra positions' cost that one forward over K saves against K forwards of one."""
    return (k - ratio) / (k - 1)


def judge_c24(e: Forwards) -> Verdict:
    ev, share = {}, {}
    for (label, backend, model), r in e.ratios.items():
        k = max(r)
        share[label, model] = saved_share(k, r[k])
        ev[f"{model}, {k} positions / 1 ({label})"] = Number(r[k], "× t(1)")
        ev[f"{model}, share of the extra positions' cost saved ({label})"] = Number(100 * share[label, model], "%")
    short = sorted(k for k, v in share.items() if v < 0.5)
    lo, hi = min(share, key=share.get), max(share, key=share.get)
    summary = (f"One forward over K positions saved between {100 * share[lo]:.0f}% ({lo[1]} on {lo[0]}) and "
               f"{100 * share[hi]:.0f}% ({hi[1]} on {hi[0]}) of what K one-position forwards would cost beyond the "
               "first: the weights are read once for all K rows")
    summary += ("; under half on " + ", ".join(f"{m} ({lab})" for lab, m in short)) if short else ""
    status = decide(not short, contradicted=len(short) == len(share))
    condition = ("every recorded machine and model saved at least half" if not short else
                 "on no recorded machine or model did one forward save half: the extra rows cost compute"
                 if status == "refuted" else "where the forward is bandwidth- or host-bound, so the extra rows ride "
                 "on the weight reads; not where they cost compute: " + ", ".join(f"{m} on {lab}" for lab, m in short))
    return Verdict(status, summary + ".", ev, condition,
                   source_line(e.sources, (k[0] for k in e.ratios), "spec-forward"))


C24 = claim("C24", "speculative", gather_c24, judge_c24,
            short="verifying K draft tokens is one small GEMM instead of K sequential GEMVs, amortizing weight loads",
            quote="Speculative decoding amortizes parameter weight memory loading across K candidate tokens by "
                  "evaluating candidate sequences as a small parallel GEMM batch instead of K sequential GEMV reads.",
            rule="Evidence: the recorded forward time over the most positions K measured against one position, per "
                 "machine and model (spec-forward); the share saved is (K - t(K)/t(1)) / (K - 1). Confirmed if one "
                 "forward saves at least half of the extra positions' cost on every machine and model; refuted if it "
                 "saves under half on all of them; qualified otherwise, naming where it falls short.",
            outcomes=("confirmed", "qualified", "refuted"),
            pending=("the speculative chapter's forward timings", "python -m ref_impl bench --spec"))


# ---- C22: +25-45% above 60% acceptance -------------------------------------------------------------------

@dataclass(frozen=True)
class PairSpeedups:
    """Best measured speedup over γ of each α-set pair at α ≥ 0.6: (machine, target, draft, α set, speedup,
    its γ, the draft's cost c in target steps, the synchronised model's speedup at that γ or None)."""
    rows: tuple[tuple[str, str, str, float, float, int, float, float | None], ...]
    sources: tuple[str, ...] = ()           # the captions of the runs read


def gather_c22(live: bool) -> PairSpeedups | None:
    rows, rec = [], spec_recorded()
    for label, d in rec.items():
        for key, m in d["speed"].items():
            model, variant, drafter, a = key
            if variant == "alpha-set" and a is not None and a >= 0.6:
                g = max(m["speedup"], key=m["speedup"].get)
                c = float(np.median(list(m["cost_ratio"].values())))
                rows.append((label, model, drafter, a, m["speedup"][g], g, c, sync_model(d, key, g)))
    return PairSpeedups(tuple(rows), run_captions(rec, ("spec-speed", "spec-forward"))) if rows else None


def judge_c22(e: PairSpeedups) -> Verdict:
    ev = {}
    for label, model, drafter, a, s, g, c, model_s in e.rows:
        ev[f"{model} / {drafter}, α set {a}, best γ = {g} ({label})"] = Number(100 * (s - 1), "% faster")
        ev[f"{model} / {drafter}: draft cost c ({label})"] = Number(c, "target steps")
        if model_s is not None:
            ev[f"{model} / {drafter}, α set {a}, γ = {g}: synchronised model ({label})"] = Number(model_s, "×")
    gained = [r for r in e.rows if r[4] >= 1.25]
    top = max(e.rows, key=lambda r: r[4])
    at60 = [r for r in e.rows if r[3] == 0.6]
    summary = f"{len(gained)} of {len(e.rows)} measured pairs and acceptance settings at α ≥ 0.6 gained +25% or more"
    if at60:
        summary += (f"; at α = 0.6 the gain ranged from {100 * (min(r[4] for r in at60) - 1):+.0f}% to "
                    f"{100 * (max(r[4] for r in at60) - 1):+.0f}%")
    summary += (f"; the best, {top[1]} / {top[2]} at α = {top[3]} on {top[0]} (c = {top[6]:.2f}), gained "
                f"{100 * (top[4] - 1):+.0f}%")
    cs = sorted({round(r[6], 2) for r in e.rows})
    summary += ("; in the model a single draft pays above α = " +
                ", ".join(f"{b:.2f} for c = {c:.2f}" for c in cs if (b := break_even_alpha(1, c)) is not None))
    status = decide(len(gained) == len(e.rows), contradicted=not gained)
    cheap = sorted({(r[1], r[2], r[3]) for r in gained})
    condition = ("every measured pair above 60% acceptance gained +25% or more" if status == "confirmed" else
                 "only " + ", ".join(f"{t} / {d} at α = {a}" for t, d, a in cheap) + " gained +25%: acceptance "
                 "alone does not decide it, the draft's cost c and the target's forward cost do" if gained else
                 "no measured pair gained +25% at any acceptance from 0.6 up")
    return Verdict(status, summary + ".", ev, condition,
                   f"{source_line(e.sources, (r[0] for r in e.rows), 'spec-speed, spec-forward')}; {_SPEC_SOURCES}")


C22 = claim("C22", "speculative", gather_c22, judge_c22,
            short="with acceptance above 60%, speculative verification raises throughput 25-45% on bandwidth-bound "
                  "devices",
            quote="When speculative verification achieves an acceptance rate greater than 60%, end-to-end token "
                  "generation throughput increases by 25% to 45% on memory-bandwidth-constrained devices.",
            rule="Evidence: the best measured speedup over γ = 1-8 of every random target/draft pair whose acceptance "
                 "is set to 0.6 or more, on every machine (spec-speed). Confirmed if every one gains at least +25%; "
                 "refuted if none does; qualified otherwise, naming the pairs that do.",
            outcomes=("confirmed", "qualified", "refuted"),
            pending=("the speculative chapter's speed runs", "python -m ref_impl bench --spec"))


# ---- C13: MTP amortizes weight reads over accepted tokens ---------------------------------------------

@dataclass(frozen=True)
class MTPRuns:
    """Per machine: the MTP heads' pooled greedy α on held-out text and their best measured speedup (γ)."""
    alpha: dict[str, float]
    best: dict[str, tuple[float, int]]
    sources: tuple[str, ...] = ()           # the captions of the runs read


def gather_c13(live: bool) -> MTPRuns | None:
    alpha, best, rec = {}, {}, spec_recorded()
    for label, d in rec.items():
        for (variant, _), a in d["pooled"].items():
            if variant == "mtp":
                alpha[label] = a
        b = best_speedup(d["speed"], variant="mtp")
        if b:
            best[label] = (b[0], b[1])
    return MTPRuns(alpha, best, run_captions(rec, ("spec-alpha", "spec-speed"))) if alpha and best else None


def judge_c13(e: MTPRuns) -> Verdict:
    ev = {f"MTP heads, greedy α on held-out text ({k})": Number(a, "fraction") for k, a in e.alpha.items()}
    ev |= {f"MTP, best measured speedup (γ = {g}, {k})": Number(s, "×") for k, (s, g) in e.best.items()}
    faster = [k for k, (s, _) in e.best.items() if s > 1]
    none_accepted = all(a < 0.05 for a in e.alpha.values())
    summary = ("The heads draft from the hidden state the last verification produced and one forward over γ+1 "
               "positions verifies them; on held-out text they were accepted at α = " +
               ", ".join(f"{a:.2f} ({k})" for k, a in e.alpha.items()) + ", so a forward emits "
               + ", ".join(f"{expected_tokens(a, 1):.2f}" for a in e.alpha.values()) + " tokens at γ = 1, and MTP "
               "decoding ran at " + ", ".join(f"{s:.2f}× plain ({k})" for k, (s, _) in e.best.items()))
    status = decide(len(faster) == len(e.best), contradicted=none_accepted)
    condition = ("MTP decoding was faster than plain decoding on every machine" if status == "confirmed" else
                 "the heads were almost never accepted: no tokens to amortize over" if none_accepted else
                 "the amortization pays only where the heads are accepted often enough to outweigh their own cost "
                 "and the wider verification; it did on " + (", ".join(faster) or "no machine measured"))
    return Verdict(status, summary + ".", ev, condition,
                   f"{source_line(e.sources, e.alpha, 'spec-alpha, spec-speed')}; {_SPEC_SOURCES}")


C13 = claim("C13", "speculative", gather_c13, judge_c13,
            short="MTP proposes future tokens and verifies them in one forward pass, amortizing weight reads over "
                  "the accepted tokens",
            quote="Multi-Token Prediction (MTP) generates candidate future tokens in parallel and verifies them in a "
                  "single transformer forward pass, amortizing weight memory reads across multiple accepted tokens.",
            rule="Evidence: the MTP heads' recorded greedy acceptance α on held-out text and the best measured MTP "
                 "speedup over γ, per machine (spec-alpha, spec-speed). Refuted if α is under 0.05 everywhere (a "
                 "forward emits under 1.05 tokens: nothing to amortize over); confirmed if MTP decoding beats plain "
                 "decoding on every machine; qualified otherwise, naming where it pays.",
            outcomes=("confirmed", "qualified", "refuted"),
            pending=("the speculative chapter's MTP runs", "python -m ref_impl bench --spec"))


# ---- C06: +20-40% without changing output probabilities --------------------------------------------------

@dataclass(frozen=True)
class SpecExactness:
    """The chi-square p-values of the acceptance rule and of a broken one, and the best measured speedup per
    (machine, variant): variant "draft-model", "mtp" or "alpha-set"."""
    p_rule: float
    p_broken: float
    best: dict[tuple[str, str], float]
    sources: tuple[str, ...] = ()           # the captions of the runs read


def gather_c06(live: bool) -> SpecExactness | None:
    best, rec = {}, spec_recorded()
    for label, d in rec.items():
        for variant in ("draft-model", "mtp", "alpha-set"):
            b = best_speedup(d["speed"], variant=variant)
            if b:
                best[label, variant] = b[0]
    return SpecExactness(*exactness(), best, run_captions(rec, ("spec-speed",))) if best else None


def judge_c06(e: SpecExactness) -> Verdict:
    ev = {"chi-square p-value, the acceptance rule (200,000 one-draft steps)": Number(e.p_rule, "p"),
          "chi-square p-value, a broken rule (resample from p)": Number(e.p_broken, "p")}
    ev |= {f"{v}, best measured speedup ({k})": Number(s, "×") for (k, v), s in e.best.items()}
    exact = e.p_rule > 1e-3 > e.p_broken
    reach = sorted({v for (_, v), s in e.best.items() if s >= 1.2})
    summary = (f"The output distribution is {'unchanged' if exact else 'changed'}: emitted tokens "
               f"{'pass' if exact else 'fail'} a chi-square test against the target's distribution "
               f"(p = {e.p_rule:.2f}) "
               f"where a broken rule {'fails' if e.p_broken < 1e-3 else 'passes'} (p = {e.p_broken:.1e}); of the "
               "measured methods, " + (", ".join(reach) if reach else "none") + " reached +20% (best: " +
               ", ".join(f"{v} {s:.2f}× on {k}" for (k, v), s in sorted(e.best.items())) + "); no M5 Max here")
    status = decide(exact and {"draft-model", "mtp"} <= set(reach), contradicted=not exact or not reach)
    condition = (("output probabilities: unchanged with the rejection-sampling rule" if exact else
                  "output probabilities: the rule as implemented fails its exactness test") + "; +20%: " +
                 ("both a draft model and MTP reached it" if status == "confirmed" else
                  "only " + ", ".join(reach) + ", with a draft both cheap and often right" if reach and exact else
                  "no measured method reached it" if exact else "the rule failed its exactness test"))
    return Verdict(status, summary + ".", ev, condition,
                   f"seeded simulation (speculative.first_tokens, chi2_pvalue); "
                   f"{source_line(e.sources, (k for k, _ in e.best), 'spec-speed')}; {_SPEC_SOURCES}")


C06 = claim("C06", "speculative", gather_c06, judge_c06,
            short="on bandwidth-bound Apple M5 Max, speculative decoding and MTP add 20-40% throughput without "
                  "changing output probabilities",
            quote="On memory-bandwidth-bound local hardware like Apple Silicon M5 Max, speculative decoding and MTP "
                  "boost effective generation throughput by 20% to 40% without modifying output token probabilities.",
            rule="Evidence: a chi-square test of 200,000 seeded one-draft steps against the target's distribution (and "
                 "of a broken rule, which must fail), and the best measured speedup of the draft model, MTP and the "
                 "α-set pairs per machine (spec-speed; no M5 Max here, the CPU and H200 stand in). Refuted if the "
                 "rule fails the test or no method reaches +20% anywhere; confirmed if both a draft model and MTP "
                 "reach it; qualified otherwise, naming what does.",
            outcomes=("confirmed", "qualified", "refuted"),
            pending=("the speculative chapter's speed runs", "python -m ref_impl bench --spec"))


CLAIMS = (C06, C13, C22, C24)   # in id order; __init__ assembles the registry
