"""The decode loop: one prompt in, text deltas out, on a loaded transformers causal LM.

A lean loop instead of `generate()`: one forward per token, the cancel/deadline check and
the stop strings handled between tokens. With `prefix_cache` the KV cache of the last run is
kept, and a prompt that starts with the same ids (the next turn of that conversation) only
runs its new suffix. It knows nothing of HTTP, queues or chat messages; only the worker
thread calls `run()`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from transformers import DynamicCache

from inference.jobs import Generation, Sampling
from inference.text import TextAssembler

# Below this, logits / temperature overflows float32 and the softmax turns to NaN; such a
# temperature means "greedy" anyway.
MIN_TEMPERATURE = 1e-3

# Prefill block with prefix_cache on: reuse is by whole blocks; measured TTFT cost of
# blocks vs one forward in the README, "Speed".
PREFILL_BLOCK = 32
# Without prefix_cache, long prompts are still prefilled in chunks of this many tokens, so a
# cancel or a deadline is noticed (and the watchdog sees progress) during a long prefill;
# typical prompts fit in one chunk and run as one forward.
PREFILL_CHUNK = 256


class Engine:
    """Holds the model and the decode-side tokenizer."""

    def __init__(
        self,
        model,
        tokenizer,
        name: str,
        context_tokens: int,
        eos_ids: set[int],
        prefix_cache: bool = False,
    ):
        self.model = model
        self.vocab_size = model.config.vocab_size  # the width of the logits
        self.tokenizer = tokenizer
        self.name = name
        self.context_tokens = context_tokens
        self.eos_ids = eos_ids
        self.prefix_cache = prefix_cache
        self.reused_tokens = 0  # prompt tokens the last run() took from the kept cache
        self._kept: tuple[list[int], DynamicCache] | None = None  # last prompt, its cache

    def _start_cache(self, prompt_ids: list[int]) -> tuple[DynamicCache, int]:
        """A cache and how many leading prompt ids it already holds.

        Only whole prefill blocks of the last prompt are reused: their keys and values are
        then computed from exactly the same inputs as a fresh run's (dynamic int8 quantizes
        each forward's activations with one scale, so a block must be the same block).
        """
        kept, self._kept = self._kept, None
        if not self.prefix_cache or kept is None:
            return DynamicCache(config=self.model.config), 0
        ids, cache = kept
        same = 0
        for a, b in zip(ids, prompt_ids, strict=False):
            if a != b:
                break
            same += 1
        same = min(same, len(prompt_ids) - 1)  # the last prompt id must run to give logits
        reuse = same // PREFILL_BLOCK * PREFILL_BLOCK
        if reuse <= 0:
            return DynamicCache(config=self.model.config), 0
        cache.crop(reuse - cache.get_seq_length())  # a negative count: drop the rest
        return cache, reuse

    def _prefill(
        self,
        prompt_ids: list[int],
        start: int,
        cache: DynamicCache,
        should_stop: Callable[[], bool],
    ) -> torch.Tensor | None:
        """Run prompt_ids[start:]; the last position's logits, or None if told to stop
        between chunks. Chunks are aligned to the prompt's start: with prefix_cache they
        are the reusable PREFILL_BLOCKs."""
        block = PREFILL_BLOCK if self.prefix_cache else PREFILL_CHUNK
        position = start
        while True:
            end = min(len(prompt_ids), (position // block + 1) * block)
            inputs = torch.tensor([prompt_ids[position:end]], dtype=torch.long)
            out = self.model(input_ids=inputs, cache=cache, use_cache=True, logits_to_keep=1)
            position = end
            if position == len(prompt_ids):
                return out.logits
            if should_stop():
                return None

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
        generator = _generator(sampling.seed)
        constraint = sampling.grammar.constraint() if sampling.grammar else None
        cache, reused = self._start_cache(prompt_ids)
        self.reused_tokens = reused
        produced = 0
        finish = "length"
        token = -1
        while produced < budget:
            if should_stop():
                finish = "interrupted"
                break
            if produced == 0:
                logits = self._prefill(prompt_ids, reused, cache, should_stop)
                if logits is None:
                    finish = "interrupted"
                    break
            else:
                inputs = torch.tensor([[token]], dtype=torch.long)
                logits = self.model(
                    input_ids=inputs, cache=cache, use_cache=True, logits_to_keep=1
                ).logits
            scores = logits[0, -1]
            if constraint is not None:
                constraint.mask_(scores)
            token = _pick(scores, sampling, generator)
            if constraint is not None:
                constraint.take(token)
            if produced == 0:
                ttft = time.monotonic() - start
            produced += 1
            if token in self.eos_ids:
                finish = "stop"
                break
            piece = text.add(token)
            if piece:
                emit(piece)
            if text.stopped or (constraint is not None and constraint.finished):
                finish = "stop"
                break
        if self.prefix_cache and produced > 0:
            # Kept only when every forward completed: a failed one may leave layers uneven.
            self._kept = (list(prompt_ids), cache)
        tail = text.flush() if finish != "interrupted" else ""
        if tail:
            emit(tail)
        return Generation(finish, produced, ttft)


def _generator(seed: int | None) -> torch.Generator | None:
    """A generator of the job's own, so a seed gives the same text whatever ran before."""
    if seed is None:
        return None
    return torch.Generator().manual_seed(seed % 2**64)


def _pick(
    logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None
) -> int:
    """Greedy when temperature is 0, else temperature + nucleus (top_p) sampling. The most
    likely token always stays a candidate, however small top_p is."""
    if sampling.temperature < MIN_TEMPERATURE:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < sampling.top_p
        keep[0] = True
        sorted_probs = sorted_probs * keep
        return int(order[torch.multinomial(sorted_probs, 1, generator=generator)])
    return int(torch.multinomial(probs, 1, generator=generator))
