"""The Qwen shapes: each name is the published size of its model, built on the fixture's
config, and every bench that takes --model qwen-shape takes them all."""

from __future__ import annotations

import pytest

from bench import models, qwen_shape

# Qwen2.5-{1.5B,3B}-Instruct's and Qwen3-{0.6B,1.7B,4B}'s published config.json, the fields
# the shapes change, and rope_theta.
PUBLISHED = {
    "qwen-shape-1.5b": (1536, 8960, 28, 12, 2, 1e6),
    "qwen-shape-3b": (2048, 11008, 36, 16, 2, 1e6),
    "qwen-shape": (896, 4864, 24, 14, 2, 1e6),
    "qwen3-shape": (1024, 3072, 28, 16, 8, 1e6),
    "qwen3-shape-1.7b": (2048, 6144, 28, 16, 8, 1e6),
    "qwen3-shape-4b": (2560, 9728, 36, 32, 8, 5e6),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_each_shape_is_the_published_qwen_size_on_the_fixtures_config(name):
    fixture = qwen_shape.fixture_dir(None, name)
    if not (fixture / "config.json").is_file():
        pytest.skip(f"no Qwen fixture at {fixture}")
    config = qwen_shape.shape_config(fixture, name)
    sizes = (
        config.hidden_size,
        config.intermediate_size,
        config.num_hidden_layers,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.rope_parameters["rope_theta"],
    )
    assert sizes == PUBLISHED[name]
    assert config.tie_word_embeddings and config.vocab_size == 151936
    assert config.initializer_range == 0.02  # the small model's init scheme
    assert config.model_type == ("qwen3" if name.startswith("qwen3") else "qwen2")
    assert len(config.layer_types) == config.num_hidden_layers  # follows the layer count


def test_every_shape_name_resolves_to_its_own_folder(monkeypatch, tmp_path):
    built = []
    monkeypatch.setattr(
        qwen_shape, "qwen_shape_dir", lambda cache, _fixture, name: built.append(name) or cache
    )
    for name in qwen_shape.SHAPES:
        models.resolve_model(name, tmp_path, None)
    assert built == list(qwen_shape.SHAPES)
    assert all(name in models.MODEL_HELP for name in qwen_shape.SHAPES)
