"""Loading local model folders: the quantized build takes what transformers can read."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from inference.loading.assemble import ModelChoice, load_model
from inference.runtime.jobs import Sampling
from service.config import load_config


@pytest.fixture(scope="module")
def bin_only_folder(tmp_path_factory, embedded_dir):
    """A tiny random Llama saved the old way (pytorch_model.bin), with a real chat tokenizer."""
    folder = tmp_path_factory.mktemp("bin-only")
    tokenizer = AutoTokenizer.from_pretrained(embedded_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.config.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    tokenizer.save_pretrained(folder)
    assert not list(folder.glob("*.safetensors"))
    return folder


@pytest.mark.parametrize("quantize", ["int8", "int4", "none"])
def test_a_bin_only_folder_loads_and_generates(bin_only_folder, quantize):
    config = load_config(["--quantize", quantize], environ={})
    engine, prompts = load_model(ModelChoice(bin_only_folder, "tiny"), config, lambda _: None)
    ids = prompts.encode([{"role": "user", "content": "hi"}])
    result = engine.run(ids, Sampling(max_tokens=4), lambda _: None, lambda: False)
    assert result.completion_tokens >= 1
