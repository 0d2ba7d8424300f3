"""Speculative decoding, measured: acceptance, verification cost and end-to-end speed.

The model these measurements test is theory/speedup.py.

The measurements (`bench_spec`, `python -m ref_impl bench --spec`):
- "spec-alpha": α per draft position and per γ on held-out text, for the shipped draft model and
  for the MTP heads (mtp.py), and the mean tokens per verification against E(α, γ);
- "spec-forward": target forward time against the number of positions, 1 .. γ+1, at a filled
  cache (claim C24: verifying K tokens costs about one GEMV pass);
- "spec-attention": one layer's attention of a verification block (γ+1 queries) over key lengths it has
  not met before, timed on first use and again, through `mx.fast.scaled_dot_product_attention` and
  through `model.causal_attention` (plain ops): on CUDA the first builds a cuDNN graph per key length;
- "spec-speed": end-to-end tokens/s and speedup over plain decoding for γ = 1..8, greedy, for the
  shipped pair, MTP, and random-weight pairs whose α is set by construction (`AlphaDrafter`), so the
  speedup surface over (α, γ, c) is measured and set against the model.

See chapter: speculative-decoding
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from ref_impl.engine import mtp
from ref_impl.engine.checkpoint import load
from ref_impl.engine.generate import Sampler
from ref_impl.engine.model import Model, causal_attention, default_dtype
from ref_impl.engine.random import args_for, random_model
from ref_impl.engine.speculative import Drafter, SpeculativeStep, speculative_decode, speculative_generate
from ref_impl.engine.tokenizer import Tokenizer
from ref_impl.measure.decode import forward_sweep, ours
from ref_impl.measure.records import dtype_name, record
from ref_impl.platform import blas
from ref_impl.platform.timing import TokenRun, decode_metrics, median, repeat, token_runs
from ref_impl.theory.speedup import expected_tokens, speedup
from ref_impl.training.corpus import heldout_stream

# ---- acceptance, measured ---------------------------------------------------------------------------

@dataclass
class Acceptance:
    """Draft acceptance counted per draft position over speculative steps. A draft is *judged* only if
    every draft before it in its step was accepted; later ones are discarded unseen."""
    judged: list[int] = field(default_factory=list)      # per position i: steps whose draft i was judged
    accepted: list[int] = field(default_factory=list)    # ... and accepted
    steps: int = 0                                       # verifications (steps that proposed drafts)
    emitted: int = 0                                     # tokens those steps emitted

    @property
    def alpha(self) -> float:
        """Accepted over judged drafts, all positions pooled: the α of the speedup model (its estimate
        when acceptances are independent with one probability)."""
        return sum(self.accepted) / sum(self.judged) if sum(self.judged) else float("nan")

    @property
    def per_position(self) -> list[float]:
        """α at each draft position i: P(draft i accepted | drafts before it accepted)."""
        return [a / j if j else float("nan") for a, j in zip(self.accepted, self.judged)]

    @property
    def tokens_per_step(self) -> float:
        """Mean tokens emitted per verification: what E(α, γ) predicts."""
        return self.emitted / self.steps if self.steps else float("nan")


def acceptance_by_position(steps: Sequence[SpeculativeStep], into: Acceptance | None = None) -> Acceptance:
    """Count judged and accepted drafts per position in steps (the prefill's step, proposing none, is
    skipped), adding to `into` when given."""
    out = into or Acceptance()
    for s in steps:
        if s.proposed == 0:
            continue
        grow = s.proposed - len(out.judged)
        out.judged += [0] * grow
        out.accepted += [0] * grow
        for i in range(min(s.accepted + 1, s.proposed)):   # drafts 0..n-1 accepted, draft n rejected
            out.judged[i] += 1
            out.accepted[i] += i < s.accepted
        out.steps += 1
        out.emitted += len(s.tokens)
    return out


def heldout_prompts(tokenizer: Tokenizer, n: int, length: int) -> tuple[list[list[int]], str]:
    """n prompts of `length` tokens from the held-out files (`corpus.heldout_stream`), spread evenly over
    them, each led by BOS as in training; and the corpus fingerprint."""
    stream, fingerprint = heldout_stream(tokenizer)
    if n < 1 or length < 2 or len(stream) < n * length:
        raise ValueError(f"cannot take {n} prompts of {length} tokens from {len(stream)} held-out tokens")
    starts = np.linspace(0, len(stream) - length, n).astype(np.int64)
    return [[tokenizer.bos_id, *stream[s:s + length - 1].tolist()] for s in starts], fingerprint


Decode = Callable[[list[int], int, int, Sampler], tuple[list[int], list[SpeculativeStep]]]


def measure_acceptance(decode: Decode, prompts: Sequence[list[int]], gamma: int, max_tokens: int,
                       temperature: float = 0.0, seed: int = 0) -> Acceptance:
    """Acceptance of one speculative method at one γ: decode(prompt, max_tokens, gamma, sampler), as
    `speculative.speculative_decode` or `mtp.mtp_decode` with their models bound, after every prompt
    (prompt i sampled with seed + i)."""
    out = Acceptance()
    for i, prompt in enumerate(prompts):
        _, steps = decode(prompt, max_tokens, gamma, Sampler(temperature=temperature, seed=seed + i))
        acceptance_by_position(steps, out)
    return out


# ---- a drafter whose acceptance is set by construction ----------------------------------------------

class AlphaDrafter(Drafter):
    """Runs the draft model for real (so its cost is real) but proposes the target's greedy token with
    probability α and another token otherwise; the target's tokens come from `sequence`, a plain
    greedy run of the target (the prompt and its continuation). Under greedy verification every
    judged draft is then accepted independently with probability α: the speedup model's assumption,
    made true, for a pair of random-weight models whose own agreement would be nil."""

    def __init__(self, model: Model, cache: list, sequence: Sequence[int], alpha: float, seed: int = 0):
        if not 0 <= alpha <= 1:
            raise ValueError(f"alpha is an acceptance probability, in [0, 1]; got {alpha}")
        super().__init__(model, cache, Sampler())
        self.sequence, self.alpha, self.rng = list(sequence), alpha, np.random.default_rng(seed)

    def pick(self, logits: mx.array) -> tuple[mx.array, mx.array]:
        """Propose the target's token at this position (the cache's offset) with probability α, else
        one of the other vocab_size - 1 tokens, uniformly."""
        pos, vocab = self.cache[0].offset, logits.shape[-1]
        if pos >= len(self.sequence):
            raise ValueError(f"AlphaDrafter reached position {pos}, past its reference sequence "
                             f"({len(self.sequence)} tokens): make the plain greedy run longer")
        want = self.sequence[pos]
        if self.rng.random() >= self.alpha:
            want = (want + 1 + int(self.rng.integers(vocab - 1))) % vocab
        # tie the proposal to the draft's logits, so its forward runs in the step's graph as a drawn token's would
        token = mx.argmax(logits, axis=-1) * 0 + want                       # (1,)
        return token, (mx.arange(vocab) == token[:, None]).astype(mx.float32)


# ---- the benchmark ----------------------------------------------------------------------------------

# Random shapes besides the public ones. The first three stand in on the CPU for the Llama-3.1-8B / 3.2-1B
# pair, which does not fit the bench's minutes there (float32 weights of 32 and 5 GB, each read once per
# token); they share one vocabulary (32000), so each draft fits each target. random-34m is a draft with
# Llama 3's vocabulary, two layers: a cheaper draft for the 8B shape than the 1B one.
@dataclass
class SpecPlan:
    """Sizes for `bench_spec`; `for_device` picks them for a GPU, the CPU or a quick check."""
    gammas: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8)
    alphas: tuple[float, ...] = (0.4, 0.6, 0.8, 0.95)          # set by construction in the random pairs
    pairs: tuple[tuple[str, str], ...] = (("Llama-3.1-8B", "Llama-3.2-1B"), ("Llama-3.1-8B", "random-34m"))
    prompt_len: int = 128
    gen_tokens: int = 128                    # per timed speculative run
    repeats: int = 2                         # timed runs per configuration, after one warm-up per method
    alpha_prompts: int = 12                  # held-out prompts per γ in spec-alpha
    alpha_prompt_len: int = 64
    alpha_tokens: int = 96                   # generated after each
    temperatures: tuple[float, ...] = (0.0, 1.0)
    forward_repeats: int = 5
    note: str = ""                           # written into every spec-speed and spec-forward record

    @classmethod
    def for_device(cls, gpu: bool, quick: bool = False) -> SpecPlan:
        if quick:   # seconds on a CPU: checks that everything runs, measures nothing well
            return cls(gammas=(1, 3), alphas=(0.6,), pairs=(("tiny", "tiny-draft"),), prompt_len=8, gen_tokens=12,
                       repeats=1, alpha_prompts=2, alpha_prompt_len=16, alpha_tokens=12, temperatures=(0.0,),
                       forward_repeats=1, note="quick: tiny sizes, a smoke test")
        if gpu:
            return cls()
        return cls(pairs=(("random-100m", "random-4m"), ("random-100m", "random-22m")), prompt_len=64,
                   gen_tokens=48, repeats=1, alpha_prompts=6, alpha_tokens=32, forward_repeats=3,
                   note="CPU, one BLAS thread; random-100m with random-4m and random-22m drafts stand in for "
                        "the Llama-3.1-8B / 3.2-1B pair (float32 weights of 32 and 5 GB)")


def _steps_stream(make_steps: Callable[[], Iterator[SpeculativeStep]], log: list) -> Iterator[int]:
    """The tokens of a fresh run of make_steps, one at a time (as `timing.time_tokens` pulls them); its
    steps go to log."""
    log.clear()
    for step in make_steps():
        log.append(step)
        yield from step.tokens


def _step_runs(make_steps: Callable[[], Iterator[SpeculativeStep]], n: int,
               repeats: int) -> tuple[list[TokenRun], list[SpeculativeStep]]:
    """`repeats` timed runs of n tokens (no warm-up) and the last run's steps."""
    log: list[SpeculativeStep] = []
    runs = token_runs(lambda: _steps_stream(make_steps, log), n, repeats, warmup=0)
    mx.synchronize()
    return runs, list(log)


def bench_spec(target_path: str | Path, draft_path: str | Path, heads_path: str | Path | None = None,
               plan: SpecPlan | None = None, seed: int = 0,
               progress: Callable[[str], None] | None = None) -> list[dict]:
    """Every measurement of this module as results records ("spec-alpha", "spec-forward", "spec-speed")
    for the GGUF target and draft, the MTP heads at heads_path (None: no MTP) and the random pairs of
    `plan` (default: SpecPlan.for_device). On the CPU everything runs on one BLAS thread, as
    `decode.forward_sweep` times, so forward times and decode speeds are taken alike."""
    gpu = mx.default_device() == mx.gpu
    plan = plan or SpecPlan.for_device(gpu)
    say = progress or (lambda msg: None)
    for t, d in plan.pairs:                                                 # a bad pair fails before anything runs
        if args_for(t, 64).vocab_size != args_for(d, 64).vocab_size:
            raise ValueError(f"the random pair {t} / {d} has two vocabularies: a draft must share its target's")
    dtype = default_dtype()
    (target, tokenizer), (draft, _) = load(target_path, dtype), load(draft_path, dtype)
    if draft.args.vocab_size != target.args.vocab_size:
        raise ValueError(f"the draft's vocabulary ({draft.args.vocab_size}) is not the target's "
                         f"({target.args.vocab_size})")
    names = {"target": Path(target_path).stem, "draft": Path(draft_path).stem}
    heads = None
    if heads_path is not None:
        heads = mtp.load_heads(heads_path, target, dtype)
        names["mtp"] = Path(heads_path).stem
    mtp_gammas = [g for g in plan.gammas if heads is not None and g <= heads.k]
    with blas.one_blas_thread():
        rec = _alpha_records(plan, target, draft, heads, tokenizer, names, mtp_gammas, say, seed)
        rec += _speed_records(plan, target, draft, heads, tokenizer, names, mtp_gammas, say, seed)
    return rec


def _alpha_records(plan: SpecPlan, target: Model, draft: Model, heads: mtp.MTPHeads | None, tokenizer: Tokenizer,
                   names: dict, mtp_gammas: list[int], say: Callable[[str], None], seed: int) -> list[dict]:
    """spec-alpha: acceptance per position and per γ on held-out prompts, and tokens per verification
    against E(α, γ) at the pooled α."""
    prompts, fingerprint = heldout_prompts(tokenizer, plan.alpha_prompts, plan.alpha_prompt_len)
    methods = [("draft-model", names["draft"], list(plan.gammas),
                lambda p, n, g, s: speculative_decode(target, draft, p, n, g, s))]
    if heads is not None:
        methods.append(("mtp", names["mtp"], mtp_gammas, lambda p, n, g, s: mtp.mtp_decode(target, heads, p, n, g, s)))
    kv = dtype_name(target.norm.weight.dtype)
    context = plan.alpha_prompt_len + plan.alpha_tokens
    rec = []
    for variant, drafter, gammas, decode in methods:
        for temperature in plan.temperatures:
            say(f"spec-alpha: {variant} ({drafter}), temperature {temperature}")
            judged = accepted = 0
            extra = {"drafter": drafter, "temperature": temperature, "prompts": len(prompts),
                     "tokens": plan.alpha_tokens, "corpus_sha256": fingerprint}
            fields = {"model": names["target"], "weights": kv.upper(), "kv": kv, "context": context,
                      "variant": variant, **extra}
            for g in gammas:
                acc = measure_acceptance(decode, prompts, g, plan.alpha_tokens, temperature, seed)
                judged, accepted = judged + sum(acc.judged), accepted + sum(acc.accepted)
                rate = sum(acc.accepted) / (g * acc.steps)
                rec += [record("spec-alpha", "alpha", "fraction", acc.alpha, **fields, gamma=g,
                               judged=sum(acc.judged)),
                        record("spec-alpha", "acceptance_rate", "fraction", rate, **fields, gamma=g),
                        record("spec-alpha", "tokens_per_step", "tokens", acc.tokens_per_step, **fields, gamma=g,
                               steps=acc.steps),
                        record("spec-alpha", "tokens_per_step_model", "tokens", expected_tokens(acc.alpha, g),
                               **fields, gamma=g)]
                rec += [record("spec-alpha", "alpha_position", "fraction", a, **fields, gamma=g, position=i + 1,
                               judged=j)
                        for i, (a, j) in enumerate(zip(acc.per_position, acc.judged)) if j]
            rec.append(record("spec-alpha", "alpha", "fraction", accepted / judged, **fields, gamma=None,
                              judged=judged))
    return rec


def _forward_records(name: str, model: Model, plan: SpecPlan, offset: int) -> tuple[list[dict], dict[int, float]]:
    """spec-forward records of one model (forward over 1..γmax+1 positions after `offset` cached tokens)
    and the verify ratios t(γ+1)/t(1) by γ."""
    lengths, seconds = forward_sweep(model, range(1, max(plan.gammas) + 2), plan.forward_repeats, offset=offset)
    kv = dtype_name(model.norm.weight.dtype)
    rec = []
    for L, s in zip(lengths, seconds):
        fields = {"model": name, "weights": kv.upper(), "kv": kv, "context": offset + L}
        rec += [record("spec-forward", "forward_ms", "ms", s * 1e3, **fields, positions=L, offset=offset,
                       note=plan.note),
                record("spec-forward", "forward_ratio", "ratio", s / seconds[0], **fields, positions=L, offset=offset,
                       note=plan.note)]
    return rec, {L - 1: s / seconds[0] for L, s in zip(lengths, seconds) if L > 1}


def attention_first_use(args, queries: int, offset: int, lengths: int = 8,
                        seed: int = 0) -> dict[str, tuple[list[float], list[float]]]:
    """Per route ("sdpa": mx.fast.scaled_dot_product_attention, "ops": model.causal_attention): seconds of
    one layer's causal attention of `queries` positions over each of `lengths` key lengths after `offset`,
    the first call at each length and a second call, as a verification step meets them."""
    rng = np.random.default_rng(seed)
    dtype, hd = default_dtype(), args.hidden_size // args.num_attention_heads
    scale = hd ** -0.5

    def tensor(heads, n):
        return mx.array(rng.standard_normal((1, heads, n, hd)), dtype=dtype)
    routes = {"sdpa": lambda q, k, v: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal"),
              "ops": lambda q, k, v: causal_attention(q, k, v, scale)}
    out = {}
    for i, (name, attend) in enumerate(routes.items()):   # each route on key lengths neither met before
        start = offset + i * (lengths + queries)
        q = tensor(args.num_attention_heads, queries)
        first, again = [], []
        for T in range(start + queries, start + queries + lengths):
            k, v = tensor(args.num_key_value_heads, T), tensor(args.num_key_value_heads, T)
            mx.eval(q, k, v)
            for times in (first, again):
                times.append(repeat(lambda: mx.eval(attend(q, k, v)), 1, warmup=0)[0])
        out[name] = (first, again)
    return out


def _attention_records(name: str, model: Model, plan: SpecPlan, offset: int) -> list[dict]:
    """spec-attention records of one model: first-use and repeat times per route, per verification width."""
    kv = dtype_name(model.norm.weight.dtype)
    rec = []
    for g in sorted({1, max(plan.gammas)}):
        for route, (first, again) in attention_first_use(model.args, g + 1, offset).items():
            fields = {"model": name, "weights": kv.upper(), "kv": kv, "context": offset, "positions": g + 1,
                      "route": route, "note": plan.note}
            rec += [record("spec-attention", "first_ms", "ms", 1e3 * median(first), samples=[1e3 * t for t in first],
                           **fields),
                    record("spec-attention", "again_ms", "ms", 1e3 * median(again), samples=[1e3 * t for t in again],
                           **fields)]
    return rec


def _plain(name: str, model: Model, prompt: list[int], n: int, plan: SpecPlan, pipeline: bool = True,
           **extra) -> tuple[dict, float, list[int]]:
    """Plain greedy decoding of n tokens (`decode.ours`, async_eval-pipelined or not): its spec-speed
    record, the median tokens/s, and the last run's tokens."""
    runs = ours(model, prompt, n, plan.repeats, pipeline)
    mx.synchronize()
    tps, samples = decode_metrics(runs, len(prompt))["tokens_per_s"]
    kv = dtype_name(model.norm.weight.dtype)
    rec = record("spec-speed", "tokens_per_s", "tok/s", tps, samples=samples, model=name, weights=kv.upper(), kv=kv,
                 context=len(prompt) + n, variant="plain" if pipeline else "plain-sync", note=plan.note, **extra)
    return rec, tps, runs[-1].ids


@dataclass
class _Method:
    """One speculative method against its target's plain decoding, for `_method_records`."""
    target: str
    model: Model
    variant: str                                   # "draft-model", "mtp" or "alpha-set"
    drafter: str
    make_steps: Callable[[int], Iterator[SpeculativeStep]]   # γ -> a fresh step generator
    plain_tps: float
    reference: list[int]                           # the plain greedy tokens after the prompt
    cost: Callable[[int], float]                   # γ -> c, a draft token's cost in target steps
    verify: dict[int, float]                       # γ -> t(γ+1)/t(1)
    alpha_set: float | None = None


def _method_records(m: _Method, gammas: Sequence[int], plan: SpecPlan) -> list[dict]:
    """spec-speed records of one method for each γ: tokens/s, speedup over plain, α and tokens per
    verification realized, greedy agreement with plain decoding, and the model's speedup at the
    realized α and measured c (verification costing one step, and costing the measured ratio)."""
    n, P = plan.gen_tokens, plan.prompt_len
    for g in gammas:        # a full warm-up run per γ: timed runs meet no kernel, shape or length for the first time
        _step_runs(lambda: m.make_steps(g), n, 1)
    kv = dtype_name(m.model.norm.weight.dtype)
    rec = []
    for g in gammas:
        runs, steps = _step_runs(lambda: m.make_steps(g), n, plan.repeats)
        tps = decode_metrics(runs, P)["tokens_per_s"]
        acc = acceptance_by_position(steps)
        c, r = m.cost(g), m.verify.get(g, float("nan"))
        agree = float(np.mean(np.array(runs[-1].ids) == np.array(m.reference[:n])))
        fields = {"model": m.target, "weights": kv.upper(), "kv": kv, "context": P + n, "variant": m.variant,
                  "drafter": m.drafter, "gamma": g, "alpha_set": m.alpha_set, "note": plan.note}
        rec += [record("spec-speed", "tokens_per_s", "tok/s", tps[0], samples=tps[1], **fields),
                record("spec-speed", "speedup", "ratio", tps[0] / m.plain_tps,
                       samples=[t / m.plain_tps for t in tps[1]], **fields),
                record("spec-speed", "alpha", "fraction", acc.alpha, **fields, judged=sum(acc.judged)),
                record("spec-speed", "tokens_per_step", "tokens", acc.tokens_per_step, **fields, steps=acc.steps),
                record("spec-speed", "cost_ratio", "ratio", c, **fields),
                record("spec-speed", "speedup_model", "ratio", speedup(acc.alpha, g, c), **fields),
                record("spec-speed", "speedup_model_verify", "ratio",
                       speedup(acc.alpha, g, c, r) if r == r else None, **fields, verify_ratio=r),
                record("spec-speed", "greedy_agreement", "fraction", agree, **fields)]
    return rec


def _speed_records(plan: SpecPlan, target: Model, draft: Model, heads: mtp.MTPHeads | None, tokenizer: Tokenizer,
                   names: dict, mtp_gammas: list[int], say: Callable[[str], None], seed: int) -> list[dict]:
    """spec-forward and spec-speed records: the shipped pair and MTP on a held-out prompt, then each
    random pair with α set by construction on a random prompt."""
    n, P, max_gamma = plan.gen_tokens, plan.prompt_len, max(plan.gammas)
    ctx, offset, n_ref = P + n + max_gamma + 2, P + n // 2, n + max_gamma + 1
    say(f"spec-forward, spec-speed: {names['target']} with {names['draft']}")
    rec, verify = _forward_records(names["target"], target, plan, offset)
    rec += _attention_records(names["target"], target, plan, offset)
    prompt = heldout_prompts(tokenizer, 1, P)[0][0]
    plain, plain_tps, reference = _plain(names["target"], target, prompt, n_ref, plan, role="target")
    draft_plain, draft_tps, _ = _plain(names["draft"], draft, prompt, n_ref, plan, role="draft")
    rec += [plain, draft_plain, _plain(names["target"], target, prompt, n_ref, plan, False, role="target")[0]]

    def pair_steps(g: int) -> Iterator[SpeculativeStep]:
        return speculative_generate(target, Drafter(draft, draft.make_cache(ctx), Sampler()), prompt, Sampler(),
                                    target.make_cache(ctx), g)
    rec += _method_records(_Method(names["target"], target, "draft-model", names["draft"], pair_steps, plain_tps,
                                   reference, lambda g: plain_tps / draft_tps, verify), plan.gammas, plan)
    if heads is not None:
        say(f"spec-speed: {names['target']} with MTP heads {names['mtp']}")
        h = mx.random.normal((target.args.hidden_size,), key=mx.random.key(seed)).astype(target.norm.weight.dtype)
        heads_s = {g: median(repeat(lambda: mx.eval(target.logits(heads(h, g))), plan.forward_repeats))
                   for g in mtp_gammas}

        def mtp_steps(g: int) -> Iterator[SpeculativeStep]:
            return mtp.mtp_generate(target, heads, prompt, Sampler(), target.make_cache(ctx), g)
        # the heads draft all γ tokens in one pass: c is that pass's time, per draft, in plain decode steps
        rec += _method_records(_Method(names["target"], target, "mtp", names["mtp"], mtp_steps, plain_tps, reference,
                                       lambda g: heads_s[g] * plain_tps / g, verify), mtp_gammas, plan)

    models, verifies = {}, {}
    for i, name in enumerate(dict.fromkeys(s for pair in plan.pairs for s in pair)):
        say(f"spec-forward: random {name}")
        model = random_model(args_for(name, ctx), seed=seed + i)
        forward, verifies[name] = _forward_records(name, model, plan, offset)
        rec += forward
        models[name] = model
    plains = {}
    for target_name, draft_name in plan.pairs:
        t, d = models[target_name], models[draft_name]
        rprompt = np.random.default_rng(seed).integers(1, t.args.vocab_size, size=P).tolist()
        for name, model, role in ((target_name, t, "target"), (draft_name, d, "draft")):
            if name not in plains:
                say(f"spec-speed: plain decoding of random {name}")
                plains[name] = _plain(name, model, rprompt, n_ref, plan, role=role)
                rec.append(plains[name][0])
        (_, t_tps, reference), d_tps = plains[target_name], plains[draft_name][1]
        for alpha in plan.alphas:
            say(f"spec-speed: random {target_name} with {draft_name}, alpha set to {alpha}")

            def alpha_steps(g: int, alpha=alpha) -> Iterator[SpeculativeStep]:
                drafter = AlphaDrafter(d, d.make_cache(ctx), rprompt + reference, alpha, seed)
                return speculative_generate(t, drafter, rprompt, Sampler(), t.make_cache(ctx), g)
            rec += _method_records(_Method(target_name, t, "alpha-set", draft_name, alpha_steps, t_tps, reference,
                                           lambda g: t_tps / d_tps, verifies[target_name], alpha), plan.gammas, plan)
    return rec
