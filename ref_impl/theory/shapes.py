"""The one table of model shapes: public models as their config.json gives them, and our stand-ins.

A shape is what speed depends on: matrix sizes, heads, layers, vocabulary; never the weight values.
So large-model behaviour (bytes per token, KV memory at 64k context, decode speed) is computed from
the public shapes in `PUBLIC`, and measured with random weights in those the decoder builds
(`is_llama`; engine/random.py). Two of them are mixtures of experts (Qwen3-30B-A3B, Mixtral-8x7B):
each layer's MLP is `num_experts` small gated MLPs, of which a router picks `experts_per_token` for
each token. The stand-ins in `STAND_INS` are small shapes of the same architecture, for quick runs on
a CPU and for the models this course trains and ships.

See chapter: intro-roofline
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ModelShape:
    """What the roofline needs of a decoder's config.json: matrix sizes, KV heads, attention span."""

    name: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int             # dense gated MLP (SwiGLU/GeGLU): three d x f matrices; 0: experts only
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    tie_word_embeddings: bool
    source: str
    sliding_window: int = 0            # 0: every layer attends to the whole context
    global_every: int = 1              # with a window, one layer in this many is global (Gemma 3: 6)
    norms_per_layer: int = 2           # RMSNorm weight vectors of width hidden_size (Gemma 3: 4)
    qk_norm: bool = False              # a head_dim RMSNorm on queries and on keys (Qwen3, Gemma 3)
    num_experts: int = 0               # routed experts per layer; 0: a dense model
    experts_per_token: int = 0         # experts the router picks for each token, in every layer
    expert_intermediate_size: int = 0  # each expert is a gated MLP of three d x f_e matrices

    def __post_init__(self) -> None:
        e, k, f_e = self.num_experts, self.experts_per_token, self.expert_intermediate_size
        if e == 0 and (k or f_e):
            raise ValueError(f"{self.name}: experts_per_token ({k}) and expert_intermediate_size ({f_e}) "
                             "need num_experts > 0")
        if e and not (0 < k <= e and f_e > 0):
            raise ValueError(f"{self.name}: a mixture of experts needs 0 < experts_per_token ({k}) <= "
                             f"num_experts ({e}) and expert_intermediate_size ({f_e}) > 0")
        if not (self.intermediate_size or e):
            raise ValueError(f"{self.name}: no MLP: give intermediate_size or num_experts")

    @property
    def is_moe(self) -> bool:
        """Whether the MLP is a mixture of experts, of which a token reads only the ones routed to."""
        return self.num_experts > 0

    @property
    def global_layers(self) -> int:
        return self.num_hidden_layers // self.global_every if self.sliding_window else self.num_hidden_layers

    @property
    def is_llama(self) -> bool:
        """Whether the course's decoder (engine/model.py, the Llama architecture) can build this shape."""
        return not (self.qk_norm or self.sliding_window or self.norms_per_layer != 2 or self.intermediate_size == 0
                    or self.is_moe)


def _hf(repo: str) -> str:
    return f"{repo}, config.json: https://huggingface.co/{repo}/blob/main/config.json"


PUBLIC: dict[str, ModelShape] = {m.name: m for m in (
    ModelShape("Llama-3.2-1B", 128256, 2048, 16, 8192, 32, 8, 64, True, _hf("meta-llama/Llama-3.2-1B")),
    ModelShape("Llama-3.2-3B", 128256, 3072, 28, 8192, 24, 8, 128, True, _hf("meta-llama/Llama-3.2-3B")),
    ModelShape("Llama-3.1-8B", 128256, 4096, 32, 14336, 32, 8, 128, False, _hf("meta-llama/Llama-3.1-8B")),
    ModelShape("Llama-3.1-70B", 128256, 8192, 80, 28672, 64, 8, 128, False, _hf("meta-llama/Llama-3.1-70B")),
    ModelShape("Llama-3.1-405B", 128256, 16384, 126, 53248, 128, 8, 128, False, _hf("meta-llama/Llama-3.1-405B")),
    ModelShape("Qwen3-4B", 151936, 2560, 36, 9728, 32, 8, 128, True, _hf("Qwen/Qwen3-4B"), qk_norm=True),
    ModelShape("Qwen3-8B", 151936, 4096, 36, 12288, 32, 8, 128, False, _hf("Qwen/Qwen3-8B"), qk_norm=True),
    ModelShape("Qwen3-14B", 151936, 5120, 40, 17408, 40, 8, 128, False, _hf("Qwen/Qwen3-14B"), qk_norm=True),
    ModelShape("Qwen3-32B", 151936, 5120, 64, 25600, 64, 8, 128, False, _hf("Qwen/Qwen3-32B"), qk_norm=True),
    # text_config only: the SigLIP vision tower (~0.4B) runs once per image, not per token.
    # 16 heads x 256 = 4096 attention width, wider than hidden_size; layers 6, 12, ... 48 are global.
    ModelShape("Gemma-3-12B", 262208, 3840, 48, 15360, 16, 8, 256, True,
               _hf("google/gemma-3-12b-it") + " (text_config; keys it omits are transformers' "
               "Gemma3TextConfig defaults: head_dim 256, vocab 262208, sliding_window_pattern 6)",
               sliding_window=1024, global_every=6, norms_per_layer=4, qk_norm=True),
    # Mixtures of experts: every layer's MLP is routed experts only, so intermediate_size is 0 (Qwen3-30B-A3B's
    # config.json has intermediate_size 6144, which no layer uses: mlp_only_layers is empty, decoder_sparse_step 1).
    # A router (d x num_experts) per layer; no shared expert. References: llama.cpp src/models/qwen3moe.cpp
    # (ffn_gate_inp, ffn_{gate,up,down}_exps), src/models/llama.cpp (Mixtral is the llama graph with experts).
    ModelShape("Qwen3-30B-A3B", 151936, 2048, 48, 0, 32, 4, 128, False,
               _hf("Qwen/Qwen3-30B-A3B") + " (num_experts 128, num_experts_per_tok 8, moe_intermediate_size 768)",
               qk_norm=True, num_experts=128, experts_per_token=8, expert_intermediate_size=768),
    ModelShape("Mixtral-8x7B", 32000, 4096, 32, 0, 32, 8, 128, False,
               _hf("mistralai/Mixtral-8x7B-v0.1") + " (num_local_experts 8, num_experts_per_tok 2, "
               "intermediate_size 14336 is each expert's; head_dim 4096 / 32 heads)",
               num_experts=8, experts_per_token=2, expert_intermediate_size=14336),
)}

def _ours(name: str, vocab: int, d: int, layers: int, f: int, heads: int, kv_heads: int, tied: bool = True,
          source: str = "a stand-in of the course") -> ModelShape:
    return ModelShape(name, vocab, d, layers, f, heads, kv_heads, d // heads, tied, source)


_SHIPPED = "trained by the course (python -m ref_impl train --preset {}), shipped in models/"
STAND_INS: dict[str, ModelShape] = {m.name: m for m in (
    _ours("stdlib-10m", 4096, 384, 6, 1024, 6, 2, source=_SHIPPED.format("stdlib-10m")),
    _ours("stdlib-draft-1m", 4096, 128, 4, 384, 4, 2, source=_SHIPPED.format("stdlib-draft-1m")),
    _ours("micro", 384, 64, 2, 128, 4, 2, source="trained in seconds by the tests (--preset micro)"),
    _ours("tiny", 1024, 128, 4, 384, 4, 2, source="random weights: latency and KV runs on a CPU (--quick)"),
    _ours("tiny-draft", 1024, 64, 2, 128, 4, 2, source="random weights: drafts for tiny (--quick)"),
    _ours("random-4m", 32000, 128, 2, 384, 4, 2, source="random weights: a speculative-decoding draft"),
    _ours("random-22m", 32000, 384, 6, 1024, 6, 2, source="random weights: a speculative-decoding draft"),
    _ours("random-34m", 128256, 256, 2, 768, 4, 2, source="random weights: a draft in Llama 3's vocabulary"),
    _ours("random-100m", 32000, 768, 8, 2048, 12, 4, tied=False, source="random weights: a speculative target"),
)}


def shape(name: str) -> ModelShape:
    """The shape of that name, public or stand-in; a clear error listing the names otherwise."""
    found = PUBLIC.get(name) or STAND_INS.get(name)
    if found is None:
        raise ValueError(f"no model shape {name!r}; public: {', '.join(PUBLIC)}; "
                         f"stand-ins: {', '.join(STAND_INS)}")
    return found


def dense_counterpart(moe: ModelShape, experts: int) -> ModelShape:
    """The dense shape of a mixture of experts with one MLP as wide as `experts` of its experts, and no router.

    `experts_per_token` experts wide: as many weights per token (less the router); `num_experts` wide:
    as many weights stored. The two dense models a MoE is compared with.
    """
    if not moe.is_moe or experts < 1:
        raise ValueError(f"{moe.name}: a dense counterpart needs a mixture of experts and experts >= 1 "
                         f"(num_experts {moe.num_experts}, experts {experts})")
    return replace(moe, name=f"{moe.name}, dense, {experts} experts wide",
                   intermediate_size=experts * moe.expert_intermediate_size, num_experts=0,
                   experts_per_token=0, expert_intermediate_size=0,
                   source=f"derived from {moe.name}: its experts' MLPs side by side as one ({moe.source})")
