"""The one table of model shapes (theory/shapes.py) and its two conversions to and from the decoder's ModelArgs."""

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
    tables = (shapes.PUBLIC, shapes.KV_ONLY, shapes.STAND_INS)
    assert sum(map(len, tables)) == len({name for table in tables for name in table})
    assert all(name == s.name for table in tables for name, s in table.items())
    assert all(s.intermediate_size for table in (shapes.PUBLIC, shapes.STAND_INS) for s in table.values())


@pytest.mark.parametrize("name", [*shapes.PUBLIC, *shapes.KV_ONLY, *shapes.STAND_INS])
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
