"""gemma2, gemma3, phi3, qwen3moe and llama files with experts against llama.cpp, on random-weight files.

Each file is written by engine/random.write_random_model as llama.cpp's converter writes one and read by both
engines, over 300 positions: past the 32-position sliding window of the Gemma files, whose layers slide in
llama.cpp's default patterns (gemma2: every other layer; gemma3: five in six). Float32 logits agree with
llama.cpp's to test_llama_cpp's ATOL, except Gemma's: llama.cpp's CPU GELU reads an fp16 table
(ggml-cpu's GGML_GELU_FP16), so there the independent float64 forward of tests/numpy_reference.py decides whose
difference it is: ours is within ATOL of the exact GeGLU, and llama.cpp's gap to it is what its fp16 GELU gives.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
import numpy_reference
import pytest
from test_architectures import check_greedy, dequantized_copy, logits, ours, same_args
from test_llama_cpp import ATOL, llama_logits, make_llama

from ref_impl.engine.architectures import swa_layers
from ref_impl.engine.kvcache import WindowKVCache
from ref_impl.engine.model import MLX_PARTS, ModelArgs
from ref_impl.engine.random import write_random_model
from ref_impl.formats import gguf
from ref_impl.formats.quantize import quantize_file

VOCAB, CONTEXT, N = 256, 512, 300
IDS = [int(i) for i in np.random.default_rng(0).integers(0, VOCAB, N)]
WINDOW = 32
GEMMA = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6,
             sliding_window=WINDOW, rope_theta_local=10000.0)

VARIANTS = {
    "gemma2": dict(architecture="gemma2", num_hidden_layers=3, sliding_layers=swa_layers(3, 2),
                   attn_logit_softcap=50.0, final_logit_softcap=30.0, **GEMMA),
    # Gemma 3's global layers: a rope base of 1e6 with linear scaling 8 (the 4B-27B models), local ones 10,000
    # untied (llama.cpp reads an output.weight when there is one): a tied random Gemma, its embeddings scaled
    # by sqrt(d), repeats its last token forever, which would make the greedy test blind
    "gemma3": dict(architecture="gemma3", num_hidden_layers=4, sliding_layers=swa_layers(4, 3), rope_theta=1e6,
                   rope_scaling_factor=8.0, tie_word_embeddings=False, **GEMMA),
    "phi3": dict(architecture="phi3", num_hidden_layers=2, hidden_size=128, num_attention_heads=4,
                 num_key_value_heads=4, fused_qkv=True, tie_word_embeddings=False, rope_attn_factor=1.25,
                 rope_original_context=CONTEXT, rope_freq_factors=(1.0,) * 16),
    # a context beyond the original one: llama.cpp and ours take the long factors
    "phi3-long": dict(architecture="phi3", num_hidden_layers=2, hidden_size=128, num_attention_heads=4,
                      num_key_value_heads=4, fused_qkv=True, tie_word_embeddings=False, rope_attn_factor=1.25,
                      rope_original_context=CONTEXT // 4, rope_freq_factors=(1.0,) * 16),
    "qwen3moe": dict(architecture="qwen3moe", num_hidden_layers=2, hidden_size=128, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=64, rope_theta=1e6, rms_norm_eps=1e-6,
                     num_experts=8, experts_per_token=2, expert_intermediate_size=64),
    # Mixtral's shape of layer: llama with experts, untied, grouped-query attention
    "llama-experts": dict(architecture="llama", num_hidden_layers=2, hidden_size=128, num_attention_heads=4,
                          num_key_value_heads=2, tie_word_embeddings=False, rope_theta=1e6,
                          num_experts=4, experts_per_token=2, expert_intermediate_size=256),
}
GELU = ("gemma2", "gemma3")


def variant_args(variant: str) -> ModelArgs:
    return ModelArgs(vocab_size=VOCAB, intermediate_size=256, max_position_embeddings=CONTEXT, **VARIANTS[variant])


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    work = tmp_path_factory.mktemp("architectures-more")
    return {v: write_random_model(work / f"{v}.gguf", variant_args(v), "F32", seed=i) for i, v in enumerate(VARIANTS)}


@pytest.fixture(scope="module")
def theirs(files) -> dict[str, np.ndarray]:
    """llama.cpp's logits over IDS for every file, computed once."""
    return {v: llama_logits(make_llama(path, CONTEXT), IDS) for v, path in files.items()}


def expected_args(variant: str, path: Path) -> ModelArgs:
    """The args written, with the rope factors the file's context selects (Phi-3's are random in the file)."""
    args = variant_args(variant)
    if args.architecture == "phi3":
        long = args.max_position_embeddings > args.rope_original_context
        with gguf.read(path) as f:
            factors = f.dequantize(f"rope_factors_{'long' if long else 'short'}.weight")
        args = replace(args, rope_freq_factors=tuple(factors.astype(float).tolist()))
    return args


# --- the float path against llama.cpp -------------------------------------------------------------

@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_llama_cpp(files, theirs, variant):
    model = ours(files[variant])
    assert same_args(model.args, expected_args(variant, files[variant]))
    mine = logits(model, IDS)
    diff = np.abs(mine - theirs[variant]).max()
    bound = 1e-2 if variant in GELU else ATOL          # llama.cpp's fp16 GELU table: see test_gemma_gap_is_...
    assert diff <= bound, f"{variant}: max |logit diff| over {N} positions = {diff:.3e}"
    assert np.abs(mine).max() > 1.0


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_a_float64_forward(files, theirs, variant):
    """Ours within 2e-5 of the largest logit of tests/numpy_reference.py's float64 forward (the exact tanh GELU).
    For Gemma, llama.cpp's own gap to it is larger, and the same forward with ggml's fp16 GELU table closes it:
    the difference between llama.cpp and ours is llama.cpp's rounding."""
    hp, w = numpy_reference.load(files[variant])
    exact = numpy_reference.forward(hp, w, IDS, n_ctx=CONTEXT)
    scale = np.abs(exact).max()
    mine = np.abs(logits(ours(files[variant]), IDS) - exact).max() / scale
    assert mine <= 2e-5, f"{variant}: ours vs float64, max relative diff {mine:.2e}"
    if variant in GELU:
        table = numpy_reference.forward(hp, w, IDS, n_ctx=CONTEXT, gelu="fp16-table")
        # measured here over 300 positions: llama.cpp to the exact forward ~2.5e-5 of the largest logit (median),
        # to the fp16-table one ~2.5e-6; ours to the exact one ~1e-7
        to_exact, to_table = (np.median(np.abs(theirs[variant] - x)) / scale for x in (exact, table))
        assert np.abs(theirs[variant] - exact).max() / scale > 10 * mine
        assert to_table <= 5e-6 and to_exact > 5 * to_table


@pytest.mark.parametrize("variant", ["gemma3", "phi3", "qwen3moe", "llama-experts"])
def test_greedy_tokens_match_llama_cpp(files, variant):
    check_greedy(files[variant], CONTEXT, IDS[:6])


def test_the_window_and_the_long_factors_matter(files, theirs, tmp_path):
    """The test files tell the features apart: Gemma 2 with a window wider than the prompt, and Phi-3 with its
    short factors where the long ones belong, give other logits in llama.cpp, and ours again."""
    with gguf.read(files["gemma2"]) as f:
        meta = {**f.fields, "gemma2.attention.sliding_window": gguf.Value(gguf.ValueType.UINT32, CONTEXT)}
        gguf.write(tmp_path / "wide.gguf", meta, {n: f.tensor_data(n) for n in f.tensors})
    changed = llama_logits(make_llama(tmp_path / "wide.gguf", CONTEXT), IDS)
    assert np.abs(logits(ours(tmp_path / "wide.gguf"), IDS) - changed).max() <= 1e-2
    assert np.abs(theirs["gemma2"] - changed)[WINDOW:].max() > 0.5
    assert np.abs(theirs["gemma2"] - changed)[:WINDOW].max() <= 1e-4     # the window reaches back that far
    assert np.abs(theirs["phi3"] - theirs["phi3-long"]).max() > 0.5      # other weights too: a sanity bound
    with gguf.read(files["phi3-long"]) as f:
        meta = {**f.fields, "phi3.rope.scaling.original_context_length": gguf.Value(gguf.ValueType.UINT32, CONTEXT)}
        gguf.write(tmp_path / "short.gguf", meta, {n: f.tensor_data(n) for n in f.tensors})
    short = llama_logits(make_llama(tmp_path / "short.gguf", CONTEXT), IDS)
    assert np.abs(logits(ours(tmp_path / "short.gguf"), IDS) - short).max() <= ATOL
    assert np.abs(short - theirs["phi3-long"]).max() > 100 * ATOL


# --- quantized weights ----------------------------------------------------------------------------

@pytest.mark.parametrize("file_type", ["Q8_0", "Q4_K_M"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_quantized_weights_load_natively(files, tmp_path, variant, file_type):
    """quantize_file's Q8_0 and Q4_K_M load with their matrices (experts too) kept quantized, and compute llama.cpp's
    logits of the weights they hold (the `gguf` package's dequantization); Q4_K_M's Q6_K tensors are re-quantized to
    MLX's groups of 32 (transcode.py), hence its looser bound, as in test_architectures."""
    path = tmp_path / f"{variant}-{file_type}.gguf"
    quantize_file(files[variant], path, file_type)
    model = ours(path, quantized=True)
    held = {type(m).__name__ for _, m in model.named_modules()}
    assert "QuantizedLinear" in held and ("QuantizedExperts" in held) == bool(model.args.num_experts), held
    want = llama_logits(make_llama(dequantized_copy(path, tmp_path / "deq.gguf"), CONTEXT), IDS)
    diff = np.abs(logits(model, IDS) - want).max()
    bound = 0.05 if file_type == "Q4_K_M" else 1e-2 if variant in GELU else ATOL
    assert diff <= bound, f"{variant} {file_type}: max |logit diff| = {diff:.3e}"


# --- the sliding-window cache ---------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["gemma2", "gemma3"])
def test_window_cache_decodes_as_one_forward(files, variant):
    """Decoding through WindowKVCaches that drop what no window reaches (a margin of 5 and room for 7 more, so
    the buffer rolls over every few tokens) gives the one-forward logits: token by token, in prompt chunks of
    37, and after a trim within the margin; a trim past it is refused."""
    model = ours(files[variant])
    full = logits(model, IDS)

    def caches():
        return [WindowKVCache(1, c.n_kv_heads, c.head_dim, CONTEXT, mx.float32, window=WINDOW, margin=5, step=7)
                if isinstance(c, WindowKVCache) else c for c in model.make_cache(CONTEXT)]

    cache = caches()
    steps = [np.array(model(mx.array([IDS[:100]]), cache)[0])]
    steps += [np.array(model(mx.array([[t]]), cache)[0]) for t in IDS[100:]]
    assert np.abs(np.concatenate(steps) - full).max() <= 1e-4
    cache = caches()
    chunks = [np.array(model(mx.array([IDS[s:s + 37]]), cache)[0]) for s in range(0, N, 37)]
    assert np.abs(np.concatenate(chunks) - full).max() <= 1e-4
    cache = caches()
    model(mx.array([IDS[:290]]), cache)
    for c in cache:
        c.trim(5)
    assert np.abs(np.array(model(mx.array([IDS[285:]]), cache)[0]) - full[285:]).max() <= 1e-4
    window = next(c for c in cache if isinstance(c, WindowKVCache))
    assert not window.rewinds(6)
    with pytest.raises(ValueError, match="keeps 5 positions to rewind, asked for 6"):
        window.trim(6)


def test_window_cache_memory_stops_growing(files):
    """A sliding layer's cache holds the same bytes at 4k and at 32k positions; a global layer's grows 8x."""
    model = ours(files["gemma3"])
    small, large = model.make_cache(4096), model.make_cache(32768)
    kinds = [isinstance(c, WindowKVCache) for c in small]
    assert kinds == list(model.args.sliding_layers)
    for a, b, slides in zip(small, large, kinds):
        assert b.nbytes == (a.nbytes if slides else 8 * a.nbytes)


# --- refusals -------------------------------------------------------------------------------------

def test_what_these_layers_cannot_take_is_refused(files):
    model = ours(files["gemma2"])
    with pytest.raises(ValueError, match="fused caches attend without a sliding window or soft cap"):
        model.make_cache(64, scheme="affine8-g64", fused=True)
    with pytest.raises(ValueError, match="Parts replace the operations of the llama, qwen2 and qwen3 blocks"):
        model.use(MLX_PARTS)
    with gguf.read(files["qwen3moe"]) as f:
        tensors = {n: t for n, t in f.tensors.items() if "exps" not in n and "gate_inp" not in n}
        with pytest.raises(ValueError, match="a qwen3moe file needs expert tensors"):
            ModelArgs.from_gguf(f.metadata, tensors)
    with gguf.read(files["gemma2"]) as f, gguf.read(files["qwen3moe"]) as g:
        with pytest.raises(ValueError, match="a gemma2 file with expert tensors"):
            ModelArgs.from_gguf(f.metadata, {**f.tensors, "blk.0.ffn_gate_inp.weight": g.tensors[
                "blk.0.ffn_gate_inp.weight"]})
    with pytest.raises(ValueError, match="a window needs a flag for each of the 3 layers"):
        replace(variant_args("gemma2"), sliding_layers=(True,))


# --- every technique on the new layers ------------------------------------------------------------

def test_every_technique_emits_plain_decodings_tokens(files):
    """On Gemma 3's sliding-window layers (a prompt four windows long) and Qwen3-MoE's experts: greedy tokens
    through prompt chunks of 5, a growing cache and speculation with gamma 7 (another random file as the draft, so
    most drafts are rejected and both window caches trim) are plain decoding's; --compile and a gamma beyond what a window cache keeps to rewind are refused by name."""
    from ref_impl.engine.compose import Techniques, generate
    from ref_impl.engine.kvcache import REWIND_MARGIN
    for variant, draft in (("gemma3", "gemma2"), ("qwen3moe", "llama-experts")):
        model, drafter = ours(files[variant]), ours(files[draft])
        prompt = IDS[:4 * WINDOW]

        def tokens(techniques=Techniques(), proposer=None):
            return generate(model, None, prompt, 48, techniques=techniques, proposer=proposer,
                            stop_at_eos=False).tokens

        plain = tokens()
        assert tokens(Techniques(prefill_chunk=5)) == plain
        assert tokens(Techniques(kv="chunked")) == plain
        assert tokens(Techniques(speculate="draft", gamma=7), proposer=drafter) == plain
        if variant == "gemma3":
            with pytest.raises(ValueError, match="--compile cannot decode a gemma3 model's sliding-window"):
                tokens(Techniques(compiled=True))
            with pytest.raises(ValueError, match=f"keeps {REWIND_MARGIN} positions to rewind"):
                tokens(Techniques(speculate="draft", gamma=REWIND_MARGIN), proposer=model)
