"""Loading local model folders: the quantized build takes what transformers can read, and
the sampling defaults their generation_config.json gives."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from bench.qwen_shape import FIXTURE_ENV, fixture_dir
from inference.host import cpu
from inference.loading.assemble import ModelChoice, load_model, model_size, sampling_defaults
from inference.runtime.jobs import Sampling
from service.config import load_config
from tests.support.paths import TEST_CACHE


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


@pytest.mark.parametrize("quantize", ["int8", "int4", "none", "auto"])
def test_a_bin_only_folder_loads_and_generates(bin_only_folder, quantize, monkeypatch):
    # auto: int8 rows, not 4-bit, even on a PC whose RAM alone would ask for 4-bit
    monkeypatch.setattr(cpu, "ram_bytes", lambda: 2**20)
    config = load_config(["--quantize", quantize], environ={})
    engine, prompts = load_model(ModelChoice(bin_only_folder, "tiny"), config, lambda _: None)
    assert engine.plan.quantize == ("int8-row" if quantize == "auto" else quantize)
    ids = prompts.encode([{"role": "user", "content": "hi"}])
    result = engine.run(ids, Sampling(max_tokens=4), lambda _: None, lambda: False)
    assert result.completion_tokens >= 1


def test_auto_serves_int8_rows_when_the_load_refuses_4_bit(
    bin_only_folder, tmp_path, monkeypatch, caplog
):
    """auto's rule reads config.json only: a layer the load then finds not Llama-style (here
    made so) refuses 4-bit, and int8 rows serve instead of the start failing."""
    from inference.quant import rowint4, rowint8

    folder = tmp_path / "safetensors"
    LlamaForCausalLM.from_pretrained(bin_only_folder).save_pretrained(folder)
    AutoTokenizer.from_pretrained(bin_only_folder).save_pretrained(folder)
    monkeypatch.setattr(cpu, "ram_bytes", lambda: 2**20)  # the rule asks for 4-bit
    real = rowint8.quantize_decoder_layer

    def no_4_bit(layer, native=None, kind=rowint8.RowInt8Linear):
        return kind is not rowint4.RowInt4Linear and real(layer, native, kind)

    monkeypatch.setattr(rowint8, "quantize_decoder_layer", no_4_bit)
    config = load_config(["--quantize", "auto"], environ={})
    engine, prompts = load_model(ModelChoice(folder, "tiny"), config, lambda _: None)
    assert engine.plan.native is not None  # make install builds it (gcc: .ci/run installs it)
    assert engine.plan.quantize == "int8-row"
    assert "auto serves int8-row instead" in caplog.text
    ids = prompts.encode([{"role": "user", "content": "hi"}])
    assert engine.run(ids, Sampling(max_tokens=4), lambda _: None, lambda: False).completion_tokens


# -- sampling defaults from generation_config.json -------------------------------------------

QWEN_GENERATION = {  # Qwen2.5-0.5B-Instruct's, as in ../shared/fixtures/qwen2.5-0.5b-instruct
    "bos_token_id": 151643,
    "pad_token_id": 151643,
    "eos_token_id": [151645, 151643],
    "do_sample": True,
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 20,
    "repetition_penalty": 1.1,
}
QWEN_DEFAULTS = {
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 20,
    "min_p": 0.0,
    "repetition_penalty": 1.1,
}
GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


def folder_with(tmp_path, generation: dict | str):
    text = generation if isinstance(generation, str) else json.dumps(generation)
    (tmp_path / "generation_config.json").write_text(text)
    return tmp_path


def test_the_models_generation_config_gives_the_defaults(tmp_path):
    defaults = sampling_defaults(folder_with(tmp_path, QWEN_GENERATION), "model")
    assert defaults.values() == QWEN_DEFAULTS and defaults.source == "generation_config.json"
    greedy = sampling_defaults(tmp_path, "greedy")  # --sampling-defaults greedy
    assert greedy.values() == GREEDY and "greedy" in greedy.source


def test_qwens_own_file_gives_its_defaults():
    fixture = fixture_dir()
    if not (fixture / "generation_config.json").is_file():
        pytest.skip(f"no Qwen fixture at {fixture} (set {FIXTURE_ENV})")
    assert sampling_defaults(fixture, "model").values() == QWEN_DEFAULTS


def test_the_embedded_model_has_no_sampling_defaults_so_greedy(embedded_dir):
    defaults = sampling_defaults(embedded_dir, "model")
    assert defaults.values() == GREEDY and "greedy" in defaults.source


@pytest.mark.parametrize(
    "generation, expected",
    [
        ({"do_sample": False, "temperature": 0.7, "repetition_penalty": 1.2}, {"rep": 1.2}),
        ({"temperature": 0.6, "top_k": -1, "min_p": 0.05}, {"t": 0.6, "min_p": 0.05}),
        ({"temperature": 9, "top_p": 0, "repetition_penalty": 0, "top_k": 2.5}, {}),
        ({"temperature": "hot", "top_p": True}, {}),
        ([1, 2], {}),
        ("{not json", {}),
    ],
    ids=["do_sample false", "top_k off", "out of range", "wrong types", "not an object", "bad"],
)
def test_what_is_not_a_valid_default_is_left_out(tmp_path, generation, expected):
    names = {"t": "temperature", "rep": "repetition_penalty", "min_p": "min_p"}
    want = {**GREEDY, **{names[k]: v for k, v in expected.items()}}
    assert sampling_defaults(folder_with(tmp_path, generation), "model").values() == want


def test_no_generation_config_is_greedy(tmp_path):
    assert sampling_defaults(tmp_path, "model").values() == GREEDY


def test_the_loaded_model_holds_no_autograd_graph(embedded_dir, tmp_path):
    """The smoothed lm_head's scales are made from the final norm's Parameter: with grad
    recording on, every float block of the head stayed alive in their graph (1.1 GB of the
    Qwen shape's 3.7 GB at ready)."""
    from transformers import AutoTokenizer

    from inference.loading.assemble import plan_for
    from inference.loading.checkpoint import load_quantized
    from inference.quant.smooth import CALIBRATION_TEXT
    from service.config import load_config

    tokenizer = AutoTokenizer.from_pretrained(embedded_dir)
    calibration = tokenizer(CALIBRATION_TEXT, return_tensors="pt")["input_ids"]
    native = plan_for(load_config([], {"DESKCHAT_CACHE_DIR": str(TEST_CACHE)})).native
    model = load_quantized(embedded_dir, "int8-row", "auto", calibration, native)
    tensors = [*model.parameters(), *model.buffers()]
    assert tensors and all(t.grad_fn is None for t in tensors)


# Qwen2.5-Instruct's published sizes (its config.json); both tie their embeddings.
QWEN_SIZES = {
    "0.5B": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
             "num_attention_heads": 14, "num_key_value_heads": 2},
    "1.5B": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
             "num_attention_heads": 12, "num_key_value_heads": 2},
}  # fmt: skip


def config_folder(folder, weights: str = "model.safetensors", **fields):
    """A folder with a Qwen2 config.json and an empty weights file: all model_size reads."""
    config = {"model_type": "qwen2", "vocab_size": 151936, "tie_word_embeddings": True}
    (folder / "config.json").write_text(json.dumps({**config, **fields}))
    (folder / weights).write_bytes(b"")
    return folder


@pytest.mark.parametrize(
    "name, params, weights",
    [("0.5B", 493_961_216, "int8-row"), ("1.5B", 1_543_569_408, "int4-row")],
)
def test_the_size_is_read_from_config_json_alone(tmp_path, name, params, weights):
    """Linear weights and the embedding, without biases and norms: the 1.5B shape's
    safetensors hold 1,543,733,572 parameters (docs/speed.md), 0.01% more."""
    size = model_size(config_folder(tmp_path, **QWEN_SIZES[name]))
    assert size == cpu.ModelSize(params, params, four_bit=True)
    assert cpu.auto_weights(size, 16 * 2**30)[0] == weights


def test_an_untied_head_counts_twice_in_the_parameters_once_in_int8_bytes(tmp_path):
    size = model_size(config_folder(tmp_path, tie_word_embeddings=False, **QWEN_SIZES["0.5B"]))
    assert size.params - size.int8_bytes == 151936 * 896
    assert size.int8_bytes == 493_961_216


def test_4_bit_is_offered_only_for_what_int4_row_loads(tmp_path, embedded_dir):
    assert model_size(embedded_dir) == cpu.ModelSize(134_479_872, 134_479_872, four_bit=True)
    bin_only = tmp_path / "bin"
    bin_only.mkdir()
    assert not model_size(
        config_folder(bin_only, "pytorch_model.bin", **QWEN_SIZES["0.5B"])
    ).four_bit
    odd = tmp_path / "odd"  # k not a multiple of 64 (rowint4.BLOCK)
    odd.mkdir()
    assert not model_size(config_folder(odd, **{**QWEN_SIZES["0.5B"], "hidden_size": 900})).four_bit
    gpt2 = tmp_path / "gpt2"  # no intermediate_size: not sized, so int8 rows
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert model_size(gpt2) is None
