"""The decoder families served, as a table of what differs between them; one forward (torch's
in inference/model/decoder.py, the native step in inference/native/step.c) runs them all.

A model folder whose config.json names an architecture not in the table is refused before
anything is converted, with a message naming what is served.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


class UnsupportedModel(ValueError):
    """The model is not one of the decoder families served."""


@dataclass(frozen=True)
class Family:
    architecture: str  # config.json's "architectures" entry
    # (q/k/v bias, o_proj bias, MLP bias), as the family's transformers classes set them
    biases: Callable[[object], tuple[bool, bool, bool]]
    # RMSNorm over each head's query and key after the projection, before the rotation
    qk_norm: bool = False


FAMILIES = {
    "qwen2": Family("Qwen2ForCausalLM", lambda c: (True, False, False)),
    "llama": Family("LlamaForCausalLM", lambda c: (c.attention_bias, c.attention_bias, c.mlp_bias)),
    "mistral": Family("MistralForCausalLM", lambda c: (False, False, False)),
    "qwen3": Family(
        "Qwen3ForCausalLM", lambda c: (c.attention_bias, c.attention_bias, False), qk_norm=True
    ),
}
SERVED = ", ".join(f.architecture for f in FAMILIES.values())


def family_of(model_type: str | None, architectures) -> Family:
    """The family of a config.json's `model_type` and `architectures`, or UnsupportedModel
    naming what is served."""
    family = FAMILIES.get(model_type or "")
    names = architectures if isinstance(architectures, list) else []
    if family is None or (names and family.architecture not in names):
        named = ", ".join(map(str, names)) or model_type or "an unnamed architecture"
        raise UnsupportedModel(f"{named} is not served; deskchat serves {SERVED}")
    return family
