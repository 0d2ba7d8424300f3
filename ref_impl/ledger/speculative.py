"""Chapter speculative decoding and MTP (book/speculative/speculative-mtp): C06, C13, C22 and C24.

Exactness by a chi-square test on seeded draws (arithmetic, no timing); acceptance rates, forward
times against positions, and speedups from the recorded spec-alpha, spec-forward and spec-speed runs.
"""

from __future__ import annotations

import numpy as np

from ref_impl.engine.speculative import chi2_pvalue, first_tokens
from ref_impl.ledger.core import Number, Verdict, by_machine, claim, not_recorded
from ref_impl.theory.speedup import break_even_alpha

_SPEC_SOURCES = ("Leviathan, Kalman and Matias 2023 (the rule, E(α, γ), Theorem 3.8); Chen et al. 2023; "
                 "Cai et al. 2024 (Medusa heads)")


def spec_recorded() -> dict[str, dict]:
    """Per machine: "backend"; "alpha": {(variant, drafter): {γ: α}} and "pooled": {(variant, drafter): α over
    every γ} (greedy); "forward": {model:
    {positions: t(L)/t(1)}}; "speed": {(model, variant, drafter, alpha_set): {metric: {γ: value}}}."""
    out: dict[str, dict] = {}
    for exp in ("spec-alpha", "spec-forward", "spec-speed"):
        for label, (machine, recs) in by_machine(exp).items():
            d = out.setdefault(label, {"backend": machine["backend"], "alpha": {}, "pooled": {}, "forward": {},
                                       "speed": {}})
            for r in recs:
                if exp == "spec-alpha" and r["metric"] == "alpha" and r.get("temperature") == 0.0:
                    if r["gamma"] is None:                                  # pooled over every γ
                        d["pooled"][r["variant"], r.get("drafter")] = r["value"]
                    else:
                        d["alpha"].setdefault((r["variant"], r.get("drafter")), {})[r["gamma"]] = r["value"]
                elif exp == "spec-forward" and r["metric"] == "forward_ratio":
                    d["forward"].setdefault(r["model"], {})[r["positions"]] = r["value"]
                elif exp == "spec-speed" and r.get("gamma") is not None:
                    key = (r["model"], r["variant"], r.get("drafter"), r.get("alpha_set"))
                    d["speed"].setdefault(key, {}).setdefault(r["metric"], {})[r["gamma"]] = r["value"]
    return out


def best_speedup(speed: dict, model: str | None = None, variant: str | None = None,
                  alpha_set: float | None = None) -> tuple[float, int, tuple] | None:
    """(best measured speedup over γ, its γ, the run's key) among the runs that match."""
    best = None
    for key, m in speed.items():
        if (model and key[0] != model) or (variant and key[1] != variant) or (alpha_set is not None and key[3] != alpha_set):
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


def check_c24(live: bool) -> Verdict:
    """Forward time against positions, recorded per machine and model (spec-forward)."""
    rec = spec_recorded()
    ev: dict[str, Number] = {}
    worst = 0.0
    for label, d in rec.items():
        for model, ratios in d["forward"].items():
            top = max(ratios)
            ev[f"{model}, {top} positions / 1 ({label})"] = Number(ratios[top], "× t(1)")
            worst = max(worst, ratios[top]) if d["backend"] == "cpu" else worst
    gpu = {f"{m} on {label}": (max(r), r[max(r)]) for label, d in rec.items() if d["backend"] != "cpu"
           for m, r in d["forward"].items()}
    if not ev:
        return not_recorded("the speculative chapter's results", "python -m ref_impl bench --spec", ev)
    summary = ("A forward over several positions multiplies each weight matrix by a few activation rows at once, "
               "reading every weight once")
    if gpu:
        n = max(n for n, _ in gpu.values())
        summary += (f"; on the H200, {n} positions cost " + ", ".join(f"{v:.2f}× one ({k})" for k, (_, v) in
                                                                       sorted(gpu.items(), key=lambda kv: kv[1][1]))
                    + ": the larger the model, the closer to one step, since fixed per-kernel costs weigh less")
    summary += (f"; on the 2-core CPU they cost up to {worst:.1f}× one, the extra rows costing compute") if worst else ""
    status = "confirmed" if all(n.value <= 1.5 for n in ev.values()) else "qualified"
    return Verdict(status, summary + ".", ev,
                   "where the forward is bandwidth-bound (a GPU, or any model whose weights dwarf its activations); on a "
                   "CPU the extra rows cost compute", f"results/ (machines {', '.join(rec)}; experiment spec-forward)")


C24 = claim("C24", "speculative", check_c24,
            short="verifying K draft tokens is one small GEMM instead of K sequential GEMVs, amortizing weight loads",
            quote="Speculative decoding amortizes parameter weight memory loading across K candidate tokens by "
                  "evaluating candidate sequences as a small parallel GEMM batch instead of K sequential GEMV reads.")


def check_c22(live: bool) -> Verdict:
    """Measured speedups of the α-set random pairs and of the shipped pair, and the model's break-even α."""
    rec = spec_recorded()
    ev: dict[str, Number] = {}
    rows = []
    for label, d in rec.items():
        for key, m in d["speed"].items():
            model, variant, drafter, a = key
            if variant != "alpha-set" or a is None or a < 0.6:
                continue
            g = max(m["speedup"], key=m["speedup"].get)
            c = float(np.median(list(m["cost_ratio"].values())))
            ev[f"{model} / {drafter}, α set {a}, best γ = {g} ({label})"] = Number(100 * (m["speedup"][g] - 1), "% faster")
            ev[f"{model} / {drafter}: draft cost c ({label})"] = Number(c, "target steps")
            rows.append((label, model, drafter, a, m["speedup"][g], c))
    if not rows:
        return not_recorded("the speculative chapter's results", "python -m ref_impl bench --spec", ev)
    at60 = [r for r in rows if r[3] == 0.6]
    lo, hi = min(r[4] for r in at60), max(r[4] for r in at60)
    be = {r[5]: break_even_alpha(1, r[5]) for r in at60}
    top = max(rows, key=lambda r: r[4])
    summary = (f"At α = 0.6 the measured gain ranged from {100 * (lo - 1):+.0f}% to {100 * (hi - 1):+.0f}% across "
               f"target/draft pairs, so acceptance alone does not decide it: the draft's cost c does (in the model a "
               "single draft pays above α = " + ", ".join(f"{b:.2f} for c = {c:.2f}" for c, b in sorted(be.items())
                                                           if b is not None)
               + f"); the best measured case, {top[1]} / {top[2]} at α = {top[3]} on {top[0]}, gained "
                 f"{100 * (top[4] - 1):+.0f}%")
    inside = [r for r in at60 if 1.25 <= r[4] <= 1.45]
    status = "qualified"
    return Verdict(status, summary + ".", ev,
                   "a draft that costs a small fraction of a target step (c well under 0.1) and a bandwidth-bound "
                   f"target; {len(inside)} of {len(at60)} measured pairs at α = 0.6 fell inside +25-45%",
                   f"results/ (machines {', '.join(rec)}; experiment spec-speed); {_SPEC_SOURCES}")


C22 = claim("C22", "speculative", check_c22,
            short="with acceptance above 60%, speculative verification raises throughput 25-45% on bandwidth-bound "
                  "devices",
            quote="When speculative verification achieves an acceptance rate greater than 60%, end-to-end token "
                  "generation throughput increases by 25% to 45% on memory-bandwidth-constrained devices.")


def check_c13(live: bool) -> Verdict:
    """MTP: one verification forward per step by construction; recorded head acceptance and speedups."""
    rec = spec_recorded()
    ev: dict[str, Number] = {}
    for label, d in rec.items():
        for (variant, drafter), a in d["pooled"].items():
            if variant == "mtp":
                ev[f"MTP heads, greedy α on held-out text ({label})"] = Number(a, "fraction")
        best = best_speedup(d["speed"], variant="mtp")
        if best:
            ev[f"MTP, best measured speedup (γ = {best[1]}, {label})"] = Number(best[0], "×")
    if not ev:
        return not_recorded("the speculative chapter's MTP results", "python -m ref_impl bench --spec", ev)
    speeds = {k: n.value for k, n in ev.items() if "speedup" in k}
    summary = ("The mechanism is as stated: mtp.py's heads draft from the hidden state the last verification already "
               "produced, and one forward over γ+1 positions verifies them (no second model, no extra pass); "
               "whether that amortizes the weight reads depends on how often the heads are right: ours, trained "
               "for minutes on a frozen 10M-parameter model, gave " + ", ".join(f"{k}: {v:.2f}×" for k, v in speeds.items()))
    return Verdict("qualified", summary + ".", ev,
                   "the amortization needs heads accurate enough that E(α, γ) outweighs the heads' and the wider "
                   "verification's cost", f"results/ (machines {', '.join(rec)}; experiment spec-alpha, spec-speed); "
                   f"{_SPEC_SOURCES}")


C13 = claim("C13", "speculative", check_c13,
            short="MTP proposes future tokens and verifies them in one forward pass, amortizing weight reads over "
                  "the accepted tokens",
            quote="Multi-Token Prediction (MTP) generates candidate future tokens in parallel and verifies them in a "
                  "single transformer forward pass, amortizing weight memory reads across multiple accepted tokens.")


def check_c06(live: bool) -> Verdict:
    """Exactness by a chi-square test on seeded draws; throughput from the recorded speedups (no M5 Max here)."""
    p_rule, p_broken = exactness()
    ev = {"chi-square p-value, the acceptance rule (200,000 one-draft steps)": Number(p_rule, "p"),
          "chi-square p-value, a broken rule (resample from p)": Number(p_broken, "p")}
    rec = spec_recorded()
    for label, d in rec.items():
        for variant in ("draft-model", "mtp"):
            best = best_speedup(d["speed"], variant=variant)
            if best:
                ev[f"{variant}, best measured speedup (γ = {best[1]}, {label})"] = Number(best[0], "×")
        best = best_speedup(d["speed"], variant="alpha-set")
        if best:
            model, _, drafter, alpha = best[2]
            ev[f"α-set pairs, best measured speedup ({model} / {drafter}, α {alpha}, {label})"] = Number(best[0], "×")
    exact = p_rule > 1e-3 > p_broken
    summary = (f"Half of it is demonstrated: emitted tokens pass a chi-square test against the target's distribution "
               f"(p = {p_rule:.2f}) where a broken rule fails (p = {p_broken:.1e}), so the output probabilities are "
               "unchanged; the 20-40% is not a property of the method but of α and the draft's cost: ")
    summary += ", ".join(f"{k}: {n.value:.2f}×" for k, n in ev.items() if "speedup" in k) or "no speed results recorded"
    return Verdict("qualified" if exact else "refuted", summary + "; no M5 Max here.", ev,
                   "output probabilities: always, with the rejection-sampling rule; +20-40%: only with a draft that is "
                   "both cheap and often right, on a bandwidth-bound target",
                   f"seeded simulation (speculative.first_tokens, chi2_pvalue); results/ ({', '.join(rec) or 'none'}); "
                   f"{_SPEC_SOURCES}")


C06 = claim("C06", "speculative", check_c06,
            short="on bandwidth-bound Apple M5 Max, speculative decoding and MTP add 20-40% throughput without "
                  "changing output probabilities",
            quote="On memory-bandwidth-bound local hardware like Apple Silicon M5 Max, speculative decoding and MTP "
                  "boost effective generation throughput by 20% to 40% without modifying output token probabilities.")


CLAIMS = (C06, C13, C22, C24)   # in id order; __init__ assembles the registry
