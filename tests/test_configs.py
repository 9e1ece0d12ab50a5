"""The real-model shapes build models with the parameter counts their hubs publish."""

import pytest
import torch

from minillm.model import CONFIGS, ModelConfig, Transformer, random_model

PUBLISHED = {  # parameters, from the hub's safetensors metadata
    "SmolLM2-135M": 134_515_008,
    "SmolLM2-360M": 361_821_120,
    "SmolLM2-1.7B": 1_711_376_384,
    "TinyLlama-1.1B": 1_100_048_384,
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_shapes_give_the_published_parameter_count(name):
    with torch.device("meta"):  # shapes only: no memory, no init time
        model = Transformer(ModelConfig.from_hf(CONFIGS[name]))
    assert model.num_parameters() == PUBLISHED[name]


def test_random_model_is_seeded_and_names_the_choices():
    one_layer = CONFIGS["SmolLM2-135M"] | {"num_hidden_layers": 1}
    a, b = random_model(one_layer), random_model(one_layer)
    assert torch.equal(a.lm_head.weight, b.lm_head.weight) and not a.training
    with pytest.raises(ValueError, match="SmolLM2-135M"):
        random_model("SmolLM2-7B")
