"""The one table of model shapes (theory/shapes.py) and its two conversions to and from the decoder's ModelArgs."""

import dataclasses

import pytest

from ref_impl import MODELS_DIR
from ref_impl.engine.model import ModelArgs
from ref_impl.engine.random import args_for
from ref_impl.formats import gguf
from ref_impl.theory import shapes


@pytest.mark.parametrize("name", ["stdlib-10m", "stdlib-draft-1m"])
def test_the_shipped_models_have_the_shape_the_table_gives(name):
    with gguf.read(MODELS_DIR / f"{name}.gguf") as f:
        shipped = ModelArgs.from_gguf(f.metadata, f.tensors)
    assert shipped.shape(name) == shapes.STAND_INS[name].__class__(**{
        **shapes.STAND_INS[name].__dict__, "source": "ref_impl.engine.model.ModelArgs"})


def test_names_are_unique_across_public_and_stand_ins():
    tables = (shapes.PUBLIC, shapes.STAND_INS)
    assert sum(map(len, tables)) == len({name for table in tables for name in table})
    assert all(name == s.name for table in tables for name, s in table.items())
    # every layer has an MLP: a dense one, or experts
    assert all(s.intermediate_size or s.num_experts for table in tables for s in table.values())


@pytest.mark.parametrize("name", [*shapes.PUBLIC, *shapes.STAND_INS])
def test_a_llama_shape_round_trips_through_model_args(name):
    s = shapes.shape(name)
    if not s.is_llama:
        with pytest.raises(ValueError, match=f"{name} is not the Llama architecture"):
            ModelArgs.from_shape(s)
        return
    a = ModelArgs.from_shape(s, context=777)
    assert a.max_position_embeddings == 777
    back = a.shape(name)
    assert back.__dict__ == {**s.__dict__, "source": back.source}


def test_unknown_names_are_named_with_the_choices():
    with pytest.raises(ValueError, match=r"no model shape 'GPT-5'.*Llama-3.1-8B.*tiny"):
        shapes.shape("GPT-5")
    with pytest.raises(ValueError, match="no model shape"):
        args_for("GPT-5")


# Qwen/Qwen3-30B-A3B config.json: hidden 2048, 48 layers, 32 heads, 4 KV heads, head_dim 128, vocab 151936,
# num_experts 128, num_experts_per_tok 8, moe_intermediate_size 768, untied; mistralai/Mixtral-8x7B-v0.1
# config.json: hidden 4096, 32 layers, 32 heads, 8 KV heads, vocab 32000, num_local_experts 8,
# num_experts_per_tok 2, intermediate_size 14336 (each expert's), untied.
@pytest.mark.parametrize("name, fields", [
    ("Qwen3-30B-A3B", (151936, 2048, 48, 32, 4, 128, False, True, 128, 8, 768)),
    ("Mixtral-8x7B", (32000, 4096, 32, 32, 8, 128, False, False, 8, 2, 14336)),
])
def test_mixtures_of_experts_have_their_config_json_shape(name, fields):
    s = shapes.shape(name)
    assert (s.vocab_size, s.hidden_size, s.num_hidden_layers, s.num_attention_heads, s.num_key_value_heads,
            s.head_dim, s.tie_word_embeddings, s.qk_norm, s.num_experts, s.experts_per_token,
            s.expert_intermediate_size) == fields
    assert s.is_moe and not s.is_llama and s.intermediate_size == 0 and not s.sliding_window
    assert name in shapes.PUBLIC and "https://" in s.source


def test_dense_shapes_default_to_no_experts():
    for s in [*shapes.STAND_INS.values(), shapes.shape("Llama-3.1-8B")]:
        assert (s.num_experts, s.experts_per_token, s.expert_intermediate_size) == (0, 0, 0) and not s.is_moe
    assert shapes.shape("Llama-3.1-8B").is_llama


def test_inconsistent_expert_fields_are_named():
    base = shapes.shape("Mixtral-8x7B")
    with pytest.raises(ValueError, match=r"experts_per_token \(9\) <= num_experts \(8\)"):
        dataclasses.replace(base, experts_per_token=9)
    with pytest.raises(ValueError, match="expert_intermediate_size"):
        dataclasses.replace(base, expert_intermediate_size=0)
    with pytest.raises(ValueError, match="need num_experts > 0"):
        dataclasses.replace(shapes.shape("tiny"), experts_per_token=2)
    with pytest.raises(ValueError, match="no MLP"):
        dataclasses.replace(base, num_experts=0, experts_per_token=0, expert_intermediate_size=0)


def test_dense_counterparts_put_k_or_all_experts_side_by_side():
    moe = shapes.shape("Qwen3-30B-A3B")
    active, total = shapes.dense_counterpart(moe, 8), shapes.dense_counterpart(moe, 128)
    assert (active.intermediate_size, total.intermediate_size) == (8 * 768, 128 * 768)
    for s in (active, total):
        assert not s.is_moe and s.num_key_value_heads == 4 and s.vocab_size == 151936 and moe.name in s.name
    with pytest.raises(ValueError, match="Llama-3.1-8B: a dense counterpart needs a mixture of experts"):
        shapes.dense_counterpart(shapes.shape("Llama-3.1-8B"), 2)
