"""Turning chat messages into prompt token ids with the model's own chat template.

Used by request handlers, so it owns a tokenizer of its own behind a lock: the worker's
tokenizer (used to decode answers) is never touched from a handler thread.
"""

from __future__ import annotations

import threading

from inference.errors import PayloadTooLarge


class PromptBuilder:
    def __init__(self, tokenizer, context_tokens: int):
        self._tokenizer = tokenizer
        self._lock = threading.Lock()
        self.context_tokens = context_tokens

    def encode(self, messages: list[dict], system: str | None = None) -> list[int]:
        """Token ids of the chat prompt, ready for the assistant's turn.

        `system` replaces the template's default system prompt and any system message given.
        """
        if system is not None:
            messages = [{"role": "system", "content": system}] + [
                m for m in messages if m["role"] != "system"
            ]
        with self._lock:
            encoded = self._tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=True
            )
        return list(encoded["input_ids"])

    def with_tokenizer(self, use):
        """`use(tokenizer)`, under the lock that keeps handler threads off each other."""
        with self._lock:
            return use(self._tokenizer)

    def check_fits(self, prompt_tokens: int) -> None:
        """413 when the prompt leaves no room for even one answer token."""
        limit = self.context_tokens - 1
        if prompt_tokens > limit:
            raise PayloadTooLarge(
                f"the prompt is {prompt_tokens} tokens; this server allows at most {limit} "
                f"prompt tokens (context {self.context_tokens}, one kept for the answer)"
            )
