"""The token embedding mapped from the checkpoint file (issue 10: 136 MB less RSS on Qwen),
its rows handed out exactly (issue 24)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from inference.quant.embedding import Int8Embedding, MappedEmbedding, map_tensor


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_mapped_table_holds_the_files_values_and_stays_in_the_file(tmp_path, dtype):
    table = torch.randn(300, 24).to(dtype)
    file = tmp_path / "model.safetensors"
    save_file({"other.weight": torch.ones(7, dtype=dtype), "embed.weight": table}, file)
    mapped = map_tensor(file, "embed.weight")
    assert mapped.dtype == dtype and torch.equal(mapped, table)
    maps = Path("/proc/self/maps").read_text()
    assert str(file) in maps  # read through the page cache, not copied into the heap
    embedding = MappedEmbedding(mapped, torch.float32)
    ids = torch.tensor([[0, 299, 5]])
    got = embedding(ids)
    assert got.dtype == torch.float32 and torch.equal(got, table[ids].float())  # not rounded
    assert list(embedding.state_dict()) == []  # nothing for .to() or a state_dict to copy


def test_a_table_of_another_dtype_is_not_mapped(tmp_path):
    file = tmp_path / "model.safetensors"
    save_file({"embed.weight": torch.ones(4, 4, dtype=torch.int8)}, file)
    assert map_tensor(file, "embed.weight") is None


@pytest.mark.slow
def test_the_loader_maps_the_checkpoints_embedding(embedded_dir):
    from safetensors import safe_open
    from transformers import AutoTokenizer

    from inference.loading.checkpoint import load_quantized
    from inference.quant.smooth import CALIBRATION_TEXT

    tokenizer = AutoTokenizer.from_pretrained(embedded_dir)
    calibration = tokenizer(CALIBRATION_TEXT, return_tensors="pt")["input_ids"]
    model = load_quantized(embedded_dir, "int8-row", "auto", calibration)
    embedding = model.get_input_embeddings()
    assert isinstance(embedding, MappedEmbedding)
    with safe_open(embedded_dir / "model.safetensors", framework="pt") as f:
        want = f.get_tensor("model.embed_tokens.weight")
    ids = torch.tensor([[1, 50, 500, 5000]])
    assert torch.equal(embedding(ids), want[ids].float())


def test_a_table_that_cannot_be_mapped_is_held_as_int8_with_a_scale_per_64_values():
    table = torch.randn(40, 128) * torch.linspace(0.1, 5, 128)
    blocks = [(0, table[:16]), (16, table[16:])]
    embedding = Int8Embedding.from_blocks(40, blocks, torch.float32)
    ids = torch.tensor([[0, 17, 39]])
    want, got = table[ids], embedding(ids)
    step = want.reshape(1, 3, -1, 64).abs().amax(dim=-1, keepdim=True) / 127
    error = (got - want).reshape(1, 3, -1, 64).abs()
    assert got.dtype == torch.float32 and (error <= step * 0.51).all()
