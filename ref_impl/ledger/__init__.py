"""The claim ledger: every "high confidence" claim of the two seed notes, and the check that judges it.

Each chapter's module holds its claims, each Claim record right below its decision rule's gather and
judge functions, and the readers and helpers only that chapter uses; `core` holds what they share
(Claim, Verdict, Number, the vocabulary and `decide`, the results reader, the HTML table). This
package assembles the registry: CLAIMS in id order, `check` for one claim and `ledger` for all of them.

Numbers from datasheets and model configs come from the theory layer's sourced tables, numbers from
a claim are quoted from it, and measurements are read from `results/*.json`; with `live=True` a
check also times its live measurement on this machine and reports it beside the verdict, which it
never decides (`live=False` times nothing). Live measurements are cached per process, so the ledger
times each of them once.

See chapter: ledger
"""

from __future__ import annotations

from ref_impl.ledger import (
    dispatch,
    dispatch_caching,
    dispatch_jitter,
    gguf,
    interconnect,
    kquants,
    kv_cache,
    roofline,
    signalling,
    speculative,
)
from ref_impl.ledger.core import (
    CHAPTER_PAGES,
    CHAPTERS,
    COLOURS,
    PAGE_OF_CLAIM,
    SEEDS,
    SHIPPED_MODEL,
    STATUSES,
    VOCABULARY,
    Claim,
    Number,
    Verdict,
    first_sentence,
    ledger_html,
    page_of,
    status_counts,
)
from ref_impl.ledger.dispatch import C21_LOSS, dispatch_records, dispatch_runs, kernel_latency_recorded
from ref_impl.ledger.dispatch_caching import first_call_recorded, growth_pauses, kv_recorded, wired_recorded
from ref_impl.ledger.dispatch_jitter import (
    GROWTH_STEP,
    PAUSE_FACTOR,
    JitterTrace,
    find_pauses,
    growth_positions,
    jitter_traces,
    threshold_pauses,
)
from ref_impl.ledger.interconnect import C07_GBS, STREAM_MODELS, link_recorded, native_link_efficiency
from ref_impl.ledger.kquants import ShapeDecode, quant_runs, shape_decodes
from ref_impl.ledger.kv_cache import first_reads, kv_quality_recorded, unified_recorded
from ref_impl.ledger.speculative import spec_in, spec_recorded

MODULES = (roofline, signalling, interconnect, gguf, kquants, dispatch, dispatch_caching, dispatch_jitter,
           kv_cache, speculative)   # one per chapter; the dispatch chapter has one per page
CLAIMS: dict[str, Claim] = {c.id: c for c in sorted((c for m in MODULES for c in m.CLAIMS), key=lambda c: c.id)}
JITTER_STEP = GROWTH_STEP           # the name book/dispatch/ttft-jitter reads


def check(claim_id: str, live: bool = True) -> Verdict:
    """The verdict on one claim. `live=False` times nothing: tables, arithmetic and results/ only."""
    if claim_id not in CLAIMS:
        raise KeyError(f"no claim {claim_id!r}: the ids run from C01 to C{len(CLAIMS):02d}")
    return CLAIMS[claim_id].check(live)


def ledger(live: bool = True) -> list[tuple[Claim, Verdict]]:
    """Every claim with its verdict, in id order."""
    return [(claim, check(cid, live)) for cid, claim in CLAIMS.items()]


__all__ = [
    # the registry
    "CLAIMS", "MODULES", "check", "ledger",
    # shared records and the page
    "CHAPTERS", "CHAPTER_PAGES", "COLOURS", "PAGE_OF_CLAIM", "SEEDS", "SHIPPED_MODEL", "STATUSES", "VOCABULARY",
    "Claim", "Number", "Verdict", "first_sentence", "ledger_html", "page_of", "status_counts",
    # what the chapters read of their recorded results
    "C07_GBS", "STREAM_MODELS", "link_recorded", "native_link_efficiency",
    "C21_LOSS", "dispatch_records", "dispatch_runs", "kernel_latency_recorded",
    "first_call_recorded", "growth_pauses", "kv_recorded", "wired_recorded",
    "GROWTH_STEP", "JITTER_STEP", "PAUSE_FACTOR", "JitterTrace", "growth_positions", "jitter_traces", "find_pauses",
    "threshold_pauses",
    "ShapeDecode", "quant_runs", "shape_decodes",
    "first_reads", "kv_quality_recorded", "unified_recorded",
    "spec_in", "spec_recorded",
]
