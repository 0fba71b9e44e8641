"""The decode loop: one prompt in, text deltas out, on a loaded transformers causal LM.

A lean loop instead of `generate()`: one forward per token, the cancel/deadline check and
the stop strings handled between tokens. It knows nothing of HTTP, queues or chat messages;
only the worker thread calls `run()`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from inference.jobs import Sampling
from inference.text import TextAssembler

# Below this, logits / temperature overflows float32 and the softmax turns to NaN; such a
# temperature means "greedy" anyway.
MIN_TEMPERATURE = 1e-3


@dataclass(frozen=True)
class Generation:
    finish_reason: str  # "stop" | "length" | "interrupted"
    completion_tokens: int
    ttft_s: float  # start of run() to the first token


class Engine:
    """Holds the model and the decode-side tokenizer."""

    def __init__(self, model, tokenizer, name: str, context_tokens: int, eos_ids: set[int]):
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.context_tokens = context_tokens
        self.eos_ids = eos_ids

    @torch.inference_mode()
    def run(
        self,
        prompt_ids: list[int],
        sampling: Sampling,
        emit: Callable[[str], None],
        should_stop: Callable[[], bool],
    ) -> Generation:
        start = time.monotonic()
        ttft = 0.0
        budget = min(sampling.max_tokens, self.context_tokens - len(prompt_ids))
        text = TextAssembler(self.tokenizer, sampling.stop)
        cache = DynamicCache(config=self.model.config)
        inputs = torch.tensor([prompt_ids], dtype=torch.long)
        produced = 0
        finish = "length"
        while produced < budget:
            if should_stop():
                finish = "interrupted"
                break
            out = self.model(input_ids=inputs, cache=cache, use_cache=True, logits_to_keep=1)
            logits = out.logits
            token = _pick(logits[0, -1], sampling)
            if produced == 0:
                ttft = time.monotonic() - start
            produced += 1
            if token in self.eos_ids:
                finish = "stop"
                break
            piece = text.add(token)
            if piece:
                emit(piece)
            if text.stopped:
                finish = "stop"
                break
            inputs = torch.tensor([[token]], dtype=torch.long)
        tail = text.flush() if finish != "interrupted" else ""
        if tail:
            emit(tail)
        return Generation(finish, produced, ttft)


def _pick(logits: torch.Tensor, sampling: Sampling) -> int:
    """Greedy when temperature is 0, else temperature + nucleus (top_p) sampling."""
    if sampling.temperature < MIN_TEMPERATURE:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < sampling.top_p
        sorted_probs = sorted_probs * keep
        return int(order[torch.multinomial(sorted_probs, 1)])
    return int(torch.multinomial(probs, 1))
