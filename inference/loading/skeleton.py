"""The module tree of a plain Llama, Qwen2 or Qwen3 decoder, its weights on the meta device, for the
layer-by-layer load to fill: transformers' own tree without importing its modeling code.

Importing a transformers model class imports its loading machinery with it (torch.distributed's
tensor ops, torch._dynamo, sympy, accelerate: 1,085 modules, 87 MB of RSS in the serving
process, docs/native.md "Memory"), none of which a served model runs. The names here are
transformers' (the weights digest hashes the state_dict by them), and the forwards that can
still run (the norm off the fused path, SiLU) compute what transformers' do. Anything else
(another rotary type, activation) returns None and transformers builds it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inference.model.families import FAMILIES


class RMSNorm(nn.Module):
    """transformers' LlamaRMSNorm / Qwen2RMSNorm / Qwen3RMSNorm: the same operations in the
    same order."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, device="meta"))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class SiLUActivation(nn.Module):
    """transformers' activation of that name (F.silu); the loader checks it by name."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(x)


class RotaryEmbedding(nn.Module):
    """The default rotary's inv_freq (1 / base^(2i/d)) as transformers makes it;
    inference/model/rope.py recomputes its values exactly from the config."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.rope_type = "default"
        self.attention_scaling = 1.0
        d = _head_dim(config)
        exponents = torch.arange(0, d, 2, dtype=torch.int64).to(dtype=torch.float) / d
        inv_freq = 1.0 / (_rope_theta(config) ** exponents)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)


class Attention(nn.Module):
    def __init__(self, config, biases: tuple, qk_norm: bool):
        super().__init__()
        self.head_dim = _head_dim(config)
        self.scaling = self.head_dim**-0.5
        hidden, heads, kv = (
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
        )
        self.q_proj = _linear(hidden, heads * self.head_dim, biases[0])
        self.k_proj = _linear(hidden, kv * self.head_dim, biases[0])
        self.v_proj = _linear(hidden, kv * self.head_dim, biases[0])
        self.o_proj = _linear(heads * self.head_dim, hidden, biases[1])
        if qk_norm:  # Qwen3: each head's query and key, before the rotation
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)


class MLP(nn.Module):
    def __init__(self, config, bias: bool):
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        self.gate_proj = _linear(hidden, inner, bias)
        self.up_proj = _linear(hidden, inner, bias)
        self.down_proj = _linear(inner, hidden, bias)
        self.act_fn = SiLUActivation()


class DecoderLayer(nn.Module):
    def __init__(self, config, biases: tuple, qk_norm: bool):
        super().__init__()
        self.self_attn = Attention(config, biases, qk_norm)
        self.mlp = MLP(config, biases[2])
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Body(nn.Module):
    def __init__(self, config, biases: tuple, qk_norm: bool):
        super().__init__()
        table = torch.empty(config.vocab_size, config.hidden_size, device="meta")
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=table)
        self.layers = nn.ModuleList(
            DecoderLayer(config, biases, qk_norm) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


class CausalLM(nn.Module):
    """model (embed_tokens, layers, norm, rotary_emb) and lm_head, with the config and the
    generation config, as the loader and the decoder read them."""

    def __init__(self, config, generation_config, biases: tuple, qk_norm: bool):
        super().__init__()
        self.config = config
        self.generation_config = generation_config
        self.model = Body(config, biases, qk_norm)
        self.lm_head = _linear(config.hidden_size, config.vocab_size, False)


def empty_model(config, dtype: torch.dtype) -> CausalLM | None:
    """The model's tree, its weights on the meta device in `dtype`, or None when it is not
    one built here as transformers would (the caller then asks transformers)."""
    from transformers import GenerationConfig

    family = FAMILIES.get(config.model_type)
    if family is None or not _plain(config):
        return None
    generation = GenerationConfig.from_model_config(config)  # as from_config makes it
    biases = tuple(map(bool, family.biases(config)))
    model = CausalLM(config, generation, biases, family.qk_norm).to(dtype)
    return model.eval()


def _plain(config) -> bool:
    """SiLU, the default rotary, no sliding window: what is built here."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    rope_type = (params or {}).get("rope_type") or (params or {}).get("type") or "default"
    return (
        getattr(config, "hidden_act", None) == "silu"
        and rope_type == "default"
        and _rope_theta(config) is not None
        and not getattr(config, "use_sliding_window", False)
    )


def _rope_theta(config):
    params = getattr(config, "rope_parameters", None) or {}
    return params.get("rope_theta", getattr(config, "rope_theta", None))


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _linear(inputs: int, outputs: int, bias: bool) -> nn.Linear:
    """nn.Linear with meta weights, made without its random init (on the meta device that
    runs torch's Python decompositions, which import torch._dynamo)."""
    linear = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(linear)
    linear.in_features, linear.out_features = inputs, outputs
    linear.weight = nn.Parameter(torch.empty(outputs, inputs, device="meta"))
    linear.register_parameter(
        "bias", nn.Parameter(torch.empty(outputs, device="meta")) if bias else None
    )
    return linear
