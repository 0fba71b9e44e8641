"""The per-row int8 Linear (inference/quant/rowint8.py): a row's result does not depend on the other
rows of the batch, bitwise, from one Linear up to a whole model's logits; and the loader
falls back to torch.ao int8 with one warning when the self-check fails."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from inference.quant import rowint8
from inference.quant.rowint8 import FusedPart, RowInt8Linear
from tests.support.tiny import TINY


def activations(rows: int, width: int, seed: int = 0) -> torch.Tensor:
    """Rows of different magnitudes with a few outlier channels, like a residual stream."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=gen)
    x[:, :4] *= 30
    return x * (torch.rand(rows, 1, generator=gen) * 4 + 0.1)


@pytest.mark.parametrize(("out_features", "bias"), [(128, True), (896, False), (1152, True)])
def test_linear_row_alone_equals_row_in_any_batch(out_features, bias):
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(out_features, 896, generator=gen) * 0.02
    linear = RowInt8Linear.from_weight(weight, torch.randn(out_features) if bias else None)
    x = activations(64, 896)
    with torch.inference_mode():
        alone = [linear(x[i : i + 1]) for i in range(4)]
        for m in (2, 3, 4, 8, 17, 64):
            batch = linear(x[:m])
            for i in range(4 if m >= 4 else m):
                assert torch.equal(batch[i : i + 1], alone[i]), (m, i)
            # the same row at the end of the batch
            rolled = linear(torch.roll(x[:m], -1, dims=0))
            assert torch.equal(rolled[m - 1 : m], alone[0]), m


def test_linear_is_close_to_the_float_product():
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(300, 256, generator=gen)
    bias = torch.randn(300, generator=gen)
    linear = RowInt8Linear.from_weight(weight, bias)
    x = torch.randn(5, 256, generator=gen)
    x[2] = 0  # an all-zero row gives the bias, not NaN
    with torch.inference_mode():
        got = linear(x)
    want = x @ weight.T + bias
    assert got.shape == (5, 300) and got.dtype == torch.float32
    assert torch.equal(got[2], bias)
    assert (got - want).abs().max() < 0.02 * want.abs().max()


def test_packed_in_parts_is_the_same_as_packed_whole(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(100, 64, generator=gen)
    whole = RowInt8Linear.from_weight(weight)
    monkeypatch.setattr(rowint8, "ROWS_PER_PACK", 32)
    monkeypatch.setattr(rowint8, "ROWS_PER_CHUNK", 16)  # blocks of 16 rows, packed by 32
    parts = RowInt8Linear.from_weight(weight)
    assert len(parts._packed) == 4 and parts.out_features == 100
    x = activations(3, 64)
    with torch.inference_mode():
        assert torch.equal(parts(x), whole(x))


def test_fused_projections_give_each_its_slice_with_one_product():
    gen = torch.Generator().manual_seed(4)
    owner = nn.Module()
    owner.a, owner.b = nn.Linear(64, 48), nn.Linear(64, 16, bias=False)
    reference = {n: RowInt8Linear.from_weight(m.weight, m.bias) for n, m in owner.named_children()}
    rowint8.fuse(owner, ["a", "b"], "ab")
    assert isinstance(owner.a, FusedPart) and [n for n, _ in owner.named_children()] == [
        "a",
        "b",
        "ab",
    ]
    calls = []
    owner.ab.linear.register_forward_hook(lambda *_: calls.append(1))
    x = torch.randn(2, 3, 64, generator=gen)
    with torch.inference_mode():
        a, b = owner.a(x), owner.b(x)
        assert a.shape == (2, 3, 48) and b.shape == (2, 3, 16)
        assert len(calls) == 1  # one quantization and one GEMM for both
        assert torch.allclose(a, reference["a"](x), atol=1e-5)
        assert torch.allclose(b, reference["b"](x), atol=1e-5)
        assert owner.ab._input is None  # nothing held between forwards
        other = torch.randn(1, 1, 64, generator=gen)
        assert torch.allclose(owner.b(other), reference["b"](other), atol=1e-5)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A random Qwen2-style checkpoint (q/k/v biases, tied embedding), bf16 safetensors."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**TINY))
    for name, p in model.named_parameters():
        if "norm" not in name:
            p.data.normal_(0, 0.05)
    folder = tmp_path_factory.mktemp("tiny-qwen2")
    model.to(torch.bfloat16).save_pretrained(folder)
    return folder


def load_tiny(folder):
    from inference.loading.checkpoint import load_quantized

    return load_quantized(folder, "int8-row", "auto", torch.arange(1, 40)[None])


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_tiny(tiny_dir)


def test_the_int8_path_is_per_row_and_fused_here(tiny):
    assert rowint8.available()
    attn, mlp = tiny.model.layers[0].self_attn, tiny.model.layers[0].mlp
    assert attn.qkv_proj.linear.out_features == 128 + 2 * 64
    assert mlp.gate_up_proj.linear.out_features == 2 * 256
    assert isinstance(attn.k_proj, FusedPart) and isinstance(mlp.up_proj, FusedPart)
    assert isinstance(attn.o_proj, RowInt8Linear) and isinstance(mlp.down_proj, RowInt8Linear)
    assert isinstance(tiny.lm_head, RowInt8Linear) and tiny.lm_head.out_features == 512


@torch.inference_mode()
def greedy_logits(model, rows: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Prefill `rows` (one prompt per row, same length) as one batch, then `steps` greedy
    decode steps for all rows at once; each step's last-position logits [rows, vocab]."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    inputs, out = rows, []
    for _ in range(steps):
        logits = model(input_ids=inputs, cache=cache, use_cache=True, logits_to_keep=1).logits
        out.append(logits[:, -1])
        inputs = logits[:, -1].argmax(-1, keepdim=True)
    return out


def test_a_sequence_gets_the_same_logits_alone_and_in_a_batch(tiny):
    gen = torch.Generator().manual_seed(5)
    prompts = torch.randint(0, TINY["vocab_size"], (4, 12), generator=gen)
    alone = greedy_logits(tiny, prompts[:1], 5)
    for batch in (prompts[:2], prompts, prompts[[3, 2, 0]]):
        row = int((batch == prompts[0]).all(-1).nonzero())
        together = greedy_logits(tiny, batch, 5)
        for step, (a, t) in enumerate(zip(alone, together, strict=True)):
            assert torch.equal(a[0], t[row]), (len(batch), row, step)


def test_the_mlp_is_batch_invariant(tiny):
    mlp = tiny.model.layers[1].mlp
    x = activations(9, TINY["hidden_size"])[None]
    with torch.inference_mode():
        together = mlp(x)
        for i in range(9):
            assert torch.equal(mlp(x[:, i : i + 1]), together[:, i : i + 1])


def test_generate_runs_on_the_fused_model(tiny):
    with torch.inference_mode():
        out = tiny.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 7)


def test_without_the_op_the_loader_warns_once_and_serves_torch_ao_int8(
    tiny_dir, monkeypatch, caplog
):
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

    def broken():
        raise RuntimeError("no onednn kernel for this CPU")

    monkeypatch.setattr(rowint8, "_self_check", broken)
    rowint8.available.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="deskchat"):
            model = load_tiny(tiny_dir)
            model = load_tiny(tiny_dir)  # checked once per process: still one line
    finally:
        rowint8.available.cache_clear()
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "per-row int8 Linear unavailable" in warnings[0].message
    assert "no onednn kernel" in warnings[0].getMessage()
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.k_proj, DynamicLinear) and isinstance(model.lm_head, DynamicLinear)
    with torch.inference_mode():
        out = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 7)
