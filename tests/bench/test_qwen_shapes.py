"""The Qwen shapes: each name is the published size of its model, built on the fixture's
config, and every bench that takes --model qwen-shape takes them all."""

from __future__ import annotations

import pytest

from bench import models, qwen_shape
from tests.support.paths import qwen_fixture

# Qwen2.5-{1.5B,3B}-Instruct's published config.json, the fields the shapes change.
PUBLISHED = {
    "qwen-shape-1.5b": (1536, 8960, 28, 12, 2),
    "qwen-shape-3b": (2048, 11008, 36, 16, 2),
    "qwen-shape": (896, 4864, 24, 14, 2),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_each_shape_is_the_published_qwen_size_on_the_fixtures_config(name):
    fixture = qwen_fixture()
    if not (fixture / "config.json").is_file():
        pytest.skip(f"no Qwen2.5 fixture at {fixture}")
    config = qwen_shape.shape_config(fixture, name)
    sizes = (
        config.hidden_size,
        config.intermediate_size,
        config.num_hidden_layers,
        config.num_attention_heads,
        config.num_key_value_heads,
    )
    assert sizes == PUBLISHED[name]
    assert config.tie_word_embeddings and config.vocab_size == 151936
    assert config.initializer_range == 0.02  # the 0.5B's init scheme
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
