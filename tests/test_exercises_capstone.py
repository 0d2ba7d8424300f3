"""Capstone tasks 1 and 2: the checkers accept the right answers and name the usual slips."""

from __future__ import annotations

from ref_impl import exercises as ex
from ref_impl.engine.compose import Techniques


def share(tokens_per_s, bytes_per_token, bandwidth_gbs):
    return tokens_per_s * bytes_per_token / (bandwidth_gbs * 1e9)


def test_capstone_task_1_bandwidth_share():
    assert ex.check_bandwidth_share(share)
    for slip, word in [(lambda t, b, bw: t * b / bw, "1e9"), (lambda t, b, bw: t * b / (bw * 2**30), "2^30"),
                       (lambda t, b, bw: 100 * share(t, b, bw), "percentage"),
                       (lambda t, b, bw: 8 * share(t, b, bw), "bits"),
                       (lambda t, b, bw: b / (bw * 1e9), "tokens per second")]:
        result = ex.check_bandwidth_share(slip)
        assert not result and word in result.message, result.message
    assert not ex.check_bandwidth_share(lambda t, b, bw: 1.1 * share(t, b, bw))


def composes(kv, fused, speculate, compiled):
    exact = not kv.startswith("kivi")
    return (not fused or kv.startswith(("affine", "outlier"))) and not (compiled and (kv != "float" or speculate)) \
        and not (speculate and not exact)


def test_capstone_task_2_composes():
    assert ex.check_composes(composes)
    everything = ex.check_composes(lambda *a: True)
    assert not everything and "KIVI" in everything.message          # the first refused case, named
    kivi_too = ex.check_composes(lambda kv, fused, speculate, compiled: composes("sym8", fused, speculate, compiled))
    assert not kivi_too and "KIVI" in kivi_too.message
    assert not ex.check_composes(lambda *a: "yes")
    # the cases are judged by the engine: each combination's right answer is what Techniques does
    for (args, _) in ex.capstone.COMBINATIONS:
        try:
            Techniques(kv=args[0], fused=args[1], speculate=args[2], compiled=args[3])
            runs = True
        except ValueError:
            runs = False
        assert composes(*args) == runs
