"""bench --moe (measure/moe.py): the records the roofline chapter's mixture-of-experts section reads, from the
quick plan; the three files' byte relations, against the files as llama.cpp's gguf package reads them and a
parameter count written out here; and the plans it refuses.

The byte relations: the MoE file stores what the dense file of the same total stores, and a token of it reads
what a token of the dense file of the same active size reads, each plus exactly the MoE's routers (4 bytes x
layers x experts x hidden_size in F32), which are under 1% of the active bytes in the CPU and GPU plans.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGUFReader

from ref_impl.measure import moe
from ref_impl.measure.peers import llama_cpp_available

ROOT = Path(__file__).resolve().parent.parent
PLAN = moe.MoEPlan.quick()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The quick plan's records, with llama.cpp where its bindings are installed, and the folder of its files."""
    work = tmp_path_factory.mktemp("moe")
    return moe.bench_moe(work, PLAN), work


def pick(records, metric, model, peer=None):
    found = [r for r in records if r["metric"] == metric and r["model"] == model and r["peer"] == peer]
    assert len(found) == 1, (metric, model, peer, found)
    return found[0]


def params(plan: moe.MoEPlan, ffn_width: int, experts: int = 0, used: int = 0) -> tuple[int, int]:
    """(weights stored, weights a token multiplies or looks up) of one of the plan's files, counted by hand:
    attention, norms, the MLP (or router and experts) per layer, and the tied embedding once."""
    d, hd, kv, L = plan.hidden_size, plan.head_dim, plan.num_key_value_heads, plan.num_hidden_layers
    q = d                                                       # heads x head_dim
    shared = 2 * d * q + 2 * d * kv * hd + 2 * d + 2 * hd      # q and o, k and v, two norms, q_norm and k_norm
    stored = used_ = shared + (experts * d if experts else 0)  # a MoE's router
    stored += 3 * d * ffn_width * (experts or 1)
    used_ += 3 * d * ffn_width * (used or 1)
    outside = plan.vocab_size * d + d                          # the tied embedding and the output norm
    return L * stored + outside, L * used_ + outside


def test_every_file_has_its_records_with_units(run):
    records, _ = run
    engines = [None] + ([r["peer"] for r in records if r["peer"] and r["metric"] == "tokens_per_s"][:1]
                        if llama_cpp_available() else [])
    assert len(engines) == 1 + llama_cpp_available()
    for role in moe.ROLES:
        assert pick(records, "total_bytes", role)["unit"] == "B"
        for peer in engines:
            nbytes, speed = pick(records, "bytes_per_token", role, peer), pick(records, "tokens_per_s", role, peer)
            bandwidth = pick(records, "achieved_bandwidth", role, peer)
            assert (nbytes["unit"], speed["unit"], bandwidth["unit"]) == ("B", "tok/s", "GB/s")
            assert speed["value"] > 0 and len(speed["samples"]) == PLAN.repeats
            assert bandwidth["value"] == pytest.approx(nbytes["value"] * speed["value"] / 1e9)
            assert (speed["weights"], speed["context"]) == ("F32", PLAN.prompt_tokens + PLAN.gen_tokens)
            assert speed["kv"] == ("f32" if peer is None else "f16")
    assert {r["experiment"] for r in records} == {moe.EXPERIMENT}      # the quick plan probes no roofs
    assert len(records) == 3 * (1 + 3 * len(engines))


def test_total_bytes_are_the_files_own(run):
    records, work = run
    for role in moe.ROLES:
        r = pick(records, "total_bytes", role)
        tensors = GGUFReader(work / r["file"]).tensors
        assert r["value"] == sum(int(t.n_bytes) for t in tensors)
        assert r["weight_count"] == sum(int(t.n_elements) for t in tensors)


def test_the_three_files_have_the_promised_byte_relations(run):
    records, _ = run
    d, e, k, f_e = PLAN.hidden_size, PLAN.num_experts, PLAN.experts_per_token, PLAN.expert_intermediate_size
    router = 4 * PLAN.num_hidden_layers * e * d
    total = {role: pick(records, "total_bytes", role)["value"] for role in moe.ROLES}
    assert total[moe.MOE] - total[moe.SAME_TOTAL] == router
    mean_context = PLAN.prompt_tokens + PLAN.gen_tokens // 2
    kv = 2 * PLAN.num_hidden_layers * PLAN.num_key_value_heads * PLAN.head_dim * 4 * mean_context
    for role, (width, experts, used) in {moe.MOE: (f_e, e, k), moe.SAME_TOTAL: (e * f_e, 0, 0),
                                         moe.SAME_ACTIVE: (k * f_e, 0, 0)}.items():
        stored, active = params(PLAN, width, experts, used)
        assert total[role] == 4 * stored, role
        r = pick(records, "bytes_per_token", role)
        assert (r["value"], r["weight_bytes"], r["kv_bytes"]) == pytest.approx((4 * active + kv, 4 * active, kv))
    per_token = {role: pick(records, "bytes_per_token", role)["value"] for role in moe.ROLES}
    assert per_token[moe.MOE] - per_token[moe.SAME_ACTIVE] == pytest.approx(router)


@pytest.mark.parametrize("gpu", [False, True])
def test_the_full_plans_match_within_one_percent(gpu):
    """The stated tolerance: the routers, all a file adds to its dense counterpart, are under 1% of its active
    weights."""
    plan = moe.MoEPlan.for_device(gpu, quick=False)
    _, active = params(plan, plan.expert_intermediate_size, plan.num_experts, plan.experts_per_token)
    assert plan.num_hidden_layers * plan.num_experts * plan.hidden_size < 0.01 * active
    assert plan.file_type == ("Q8_0" if gpu else "F32")


@pytest.mark.parametrize("change, message", [
    (dict(experts_per_token=8), "experts_per_token \\(8\\) < num_experts \\(8\\)"),
    (dict(experts_per_token=0), "0 < experts_per_token"),
    (dict(file_type="Q4_K_M"), "file_type 'Q4_K_M' is not one of F32, Q8_0"),
    (dict(file_type="Q8_0", expert_intermediate_size=48), "multiples of it"),
    (dict(hidden_size=96), "multiple of head_dim 32"),
    (dict(gen_tokens=1), "gen_tokens >= 2"),
    (dict(vocab_size=0), "every size must be positive"),
])
def test_bad_plans_raise(change, message):
    fields = {k: getattr(PLAN, k) for k in PLAN.__dataclass_fields__} | change
    with pytest.raises(ValueError, match=message):
        moe.MoEPlan(**fields)


def test_the_bench_command_writes_the_records(tmp_path):
    done = subprocess.run([sys.executable, "-m", "ref_impl", "bench", "--moe", "--quick", "--no-peers", "--out",
                           str(tmp_path), "--label", "test"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    written = json.loads(next(tmp_path.glob("test-*.json")).read_text())
    assert written["command"].endswith("bench --moe --quick --no-peers --out " + str(tmp_path) + " --label test")
    assert {r["model"] for r in written["records"] if r["metric"] == "tokens_per_s"} == set(moe.ROLES)
    assert "achieved_bandwidth" in done.stdout
