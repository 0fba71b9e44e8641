"""Issue 63: the Qwen3 decoder (RMSNorm over each query and key head before the rotation, an
explicit head_dim wider than hidden / heads, no q/k/v bias) on the torch step and on the
native step of every build level, against transformers' own Qwen3 forward of the same
weights; its rows as batch-invariant, and as much the same bits on every build, as Qwen2's."""

from __future__ import annotations

import pytest
import torch

from inference.loading import skeleton
from inference.model.decoder import Decoder, Segment
from tests.inference.native.test_native_step import CONTEXT, built, steps
from tests.support.tiny import TINY

# Qwen3-0.6B's proportions: 4 query heads of 64 (a 256-wide query) on a hidden size of 128
QWEN3 = dict(TINY, head_dim=64, attention_bias=False, rope_theta=1e6)
PROMPTS = [
    [(7 * i + 31 * j + 13 * i * j) % 500 + 3 for j in range(5 + 3 * i % 40)] for i in range(64)
]
# The share of PROMPTS whose first answer token is transformers' float32 top-1 (the issue's
# bar: 6 of 8), and the mean overlap of the top-5s. 4-bit rows lose more on this tiny random
# shape (128 wide: four groups a row), as much for Qwen2 as for Qwen3: 41-47 of 64 with either
# family, int8 rows 58-62 (seeds 3 and 4, this checkpoint's recipe, 2026-12-07).
AGREEMENT = {"int8-row": (0.75, 3.5), "int4-row": (0.55, 3.0)}


def qwen3_config():
    from transformers import Qwen3Config

    return Qwen3Config(**QWEN3)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    """A random Qwen3 checkpoint, bf16 safetensors. The norms' weights are random too (a
    per-head norm left out changes the logits), the final norm's x10 spreads the logits so
    that a top-1 is not a coin flip between near-equal ones."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(qwen3_config())
    for name, p in model.named_parameters():
        if "norm" in name:
            p.data.uniform_(0.5, 1.5)
        else:
            p.data.normal_(0, 0.05)
    model.model.norm.weight.data *= 10
    folder = tmp_path_factory.mktemp("tiny-qwen3")
    model.to(torch.bfloat16).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def reference(qwen3_dir):
    """transformers' Qwen3, float32, of the checkpoint's weights."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32).eval()


def reference_logits(reference, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return reference(input_ids=torch.tensor([ids])).logits[0].float()


def every_row(decoder: Decoder, ids: list[int]) -> torch.Tensor:
    return decoder.forward([Segment(decoder.new_cache(CONTEXT), ids)], every_row=True)


def load(folder, library, kind: str = "int8-row") -> Decoder:
    """The checkpoint as the server loads it (the skeleton's tree, calibrated), for
    `library`'s step or, with None, torch's."""
    from inference.loading.checkpoint import load_quantized

    calibration = torch.tensor([sum(PROMPTS[:8], [])])
    model = load_quantized(folder, kind, "auto", calibration, native=library, hf_forward=False)
    return Decoder(model, CONTEXT, library)


def test_the_skeleton_is_transformers_tree_with_the_head_norms():
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        theirs = AutoModelForCausalLM.from_config(qwen3_config(), dtype=torch.float32)
    ours = skeleton.empty_model(qwen3_config(), torch.float32)
    tree = {n: (tuple(t.shape), t.dtype) for n, t in ours.state_dict().items()}
    assert tree == {n: (tuple(t.shape), t.dtype) for n, t in theirs.state_dict().items()}
    assert "model.layers.0.self_attn.q_norm.weight" in tree
    assert tree["model.layers.0.self_attn.q_proj.weight"][0] == (4 * 64, 128)
    assert "model.layers.0.self_attn.q_proj.bias" not in tree


def test_the_float_forward_is_transformers(reference):
    """The torch step on transformers' own modules, float32, every position."""
    decoder = Decoder(reference, CONTEXT)
    assert decoder.qk_norms and decoder.head_dim == 64
    for ids in PROMPTS[:4]:
        ours, theirs = every_row(decoder, ids), reference_logits(reference, ids)
        assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-4), (ours - theirs).abs().max()


def agreement(decoder: Decoder, reference) -> tuple[float, float]:
    """Over PROMPTS' first answer token: the share whose top-1 is the reference's, and the
    mean overlap of the two top-5s."""
    same, overlap = 0, 0
    for ids in PROMPTS:
        ours = decoder.forward([Segment(decoder.new_cache(CONTEXT), ids)])[-1]
        theirs = reference_logits(reference, ids)[-1]
        same += int(ours.argmax() == theirs.argmax())
        overlap += len(set(ours.topk(5).indices.tolist()) & set(theirs.topk(5).indices.tolist()))
    return same / len(PROMPTS), overlap / len(PROMPTS)


def test_the_torch_steps_int8_rows_choose_transformers_tokens(qwen3_dir, reference):
    decoder = load(qwen3_dir, None)
    assert decoder.native is None and decoder.fused_projections and decoder.qk_norms
    same, overlap = agreement(decoder, reference)
    least_same, least_overlap = AGREEMENT["int8-row"]
    assert same >= least_same and overlap >= least_overlap, (same, overlap)


@pytest.fixture(scope="module", params=["int8-row", "int4-row"])
def row_kind(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def native_qwen3(qwen3_dir, row_kind) -> Decoder:
    """This CPU's own build, each weight format."""
    from inference.native import build

    library = built(build.this_cpu())
    decoder = load(qwen3_dir, library, row_kind)
    assert decoder.native == library.isa
    return decoder


def test_the_native_step_chooses_transformers_tokens(qwen3_dir, row_kind, reference):
    from inference.native import build

    same, overlap = agreement(load(qwen3_dir, built(build.this_cpu()), row_kind), reference)
    least_same, least_overlap = AGREEMENT[row_kind]
    assert same >= least_same and overlap >= least_overlap, (same, overlap)


def test_the_native_steps_rows_are_batch_invariant_and_chunk_invariant(native_qwen3):
    threads = torch.get_num_threads()
    try:
        alone = steps(native_qwen3, PROMPTS[:3], 1, together=False)
        for count in (1, 2):
            together = steps(native_qwen3, PROMPTS[:3], count, together=True)
            assert all(torch.equal(a, b) for a, b in zip(alone, together, strict=True))
    finally:
        torch.set_num_threads(threads)
    ids = sum(PROMPTS[:3], [])
    whole = every_row(native_qwen3, ids)
    cache = native_qwen3.new_cache(CONTEXT)
    parts = [native_qwen3.forward([Segment(cache, ids[:5])], True)]
    parts.append(native_qwen3.forward([Segment(cache, ids[5:20], decoding=True)]))
    parts += [native_qwen3.forward([Segment(cache, [t], decoding=True)]) for t in ids[20:]]
    assert torch.equal(torch.cat(parts), whole)


@pytest.mark.slow  # a load per build level
@pytest.mark.parametrize("kind", ["int8-row", "int4-row"])
def test_every_build_gives_the_bits_of_this_cpus_own(qwen3_dir, kind):
    from inference.native import build

    own = steps(load(qwen3_dir, built(build.this_cpu()), kind), PROMPTS[:2], 2, True)
    for level in build.runnable_here():
        here = steps(load(qwen3_dir, built(level), kind), PROMPTS[:2], 2, True)
        assert all(torch.equal(a, b) for a, b in zip(here, own, strict=True)), level
