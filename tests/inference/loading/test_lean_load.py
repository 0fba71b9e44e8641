"""What the serving process does not load (issue 36's memory cuts, docs/native.md "Memory"):
the layer-by-layer build's own module tree is transformers' tree to the name, shape and
dtype, and a process that loads a model and its grammar tokenizer as the server does never
imports transformers' modeling code with torch._dynamo and sympy (87 MB of RSS), nor
builds llguidance's second Rust tokenizer from the JSON (118 MB on Qwen's vocabulary)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from inference.loading import skeleton
from tests.support.paths import TEST_CACHE
from tests.support.tiny import TINY

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


def _tree(model) -> dict:
    return {
        name: (tuple(t.shape), t.dtype)
        for name, t in [*model.state_dict().items(), *model.named_buffers()]
    }


@pytest.mark.parametrize(
    "config",
    [
        Qwen2Config(**TINY),
        LlamaConfig(**TINY),
        LlamaConfig(**TINY, attention_bias=True, mlp_bias=True),
        MistralConfig(**TINY),
    ],
    ids=["qwen2", "llama", "llama-biases", "mistral"],
)
def test_the_skeleton_is_transformers_tree(config):
    with torch.device("meta"):
        theirs = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    ours = skeleton.empty_model(config, torch.float32)
    assert _tree(ours) == _tree(theirs)
    attn, their_attn = ours.model.layers[0].self_attn, theirs.model.layers[0].self_attn
    assert (attn.head_dim, attn.scaling) == (their_attn.head_dim, their_attn.scaling)
    assert type(ours.model.layers[0].mlp.act_fn).__name__ == "SiLUActivation"
    assert ours.generation_config.to_dict() == theirs.generation_config.to_dict()
    x = torch.randn(3, config.hidden_size)
    norm = ours.model.norm.to_empty(device="cpu")
    torch.nn.init.normal_(norm.weight)
    their_norm = theirs.model.norm.to_empty(device="cpu")
    their_norm.weight.data.copy_(norm.weight)
    assert torch.equal(norm(x), their_norm(x))


def test_other_rotaries_and_activations_are_left_to_transformers():
    assert skeleton.empty_model(Qwen2Config(**TINY, hidden_act="gelu"), torch.float32) is None
    scaled = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    assert skeleton.empty_model(LlamaConfig(**TINY, rope_parameters=scaled), torch.float32) is None


LOAD = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import llguidance.hf
    from inference.loading.assemble import ModelChoice, load_model, plan_for
    from inference.runtime.grammar import SchemaCompiler
    from service.config import load_config

    config = load_config(["--model", sys.argv[1], "--quantize", "int8-row"], {})
    built, from_json = {}, []
    llguidance.hf.from_tokenizer = lambda *a, **k: from_json.append(1)

    def grammars(tokenizer, vocab):
        built["g"] = SchemaCompiler(lambda use: use(tokenizer), vocab)
        built["g"].warm()

    choice = ModelChoice(Path(sys.argv[1]), "m")
    load_model(choice, config, lambda _: None, grammars, plan_for(config))
    heavy = ["torch._dynamo", "transformers.modeling_utils"]
    print(json.dumps({
        "imported": [m for m in heavy if m in sys.modules],
        "grammar_tokenizers_from_json": len(from_json),
        "grammar_tokenizer": built["g"]._ll_tokenizer is not None,
    }))
    """
)


def test_loading_as_the_server_does_imports_no_modeling_code(embedded_dir):
    """In a process of its own: what an earlier test imported would hide it here. (Llama's
    configuration module imports sympy and torch.distributed itself; Qwen2's does not.)"""
    env = {**os.environ, "DESKCHAT_CACHE_DIR": str(TEST_CACHE), "PYTHONPATH": ROOT}
    done = subprocess.run(
        [sys.executable, "-c", LOAD, str(embedded_dir)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["imported"] == []
    assert report["grammar_tokenizer"] and report["grammar_tokenizers_from_json"] == 0
