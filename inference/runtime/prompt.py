"""Turning chat messages into prompt token ids with the model's own chat template.

Used by request handlers, which take turns on the tokenizer behind a lock. The worker
decodes answers with the same tokenizer, without that lock (a second copy of a Qwen
tokenizer costs ~100 MB, issue 10): the Rust tokenizer underneath allows any number of
concurrent readers, and encoding and decoding only read it, once `read_only` has settled the
one state transformers may write on a call (truncation and padding, which none of our calls
ask for).
"""

from __future__ import annotations

import threading

from service.errors import PayloadTooLarge


def read_only(tokenizer) -> None:
    """Clear the fast tokenizer's truncation and padding now, at load: transformers switches
    them off on the first call that finds them set (a tokenizer.json may set them), and that
    write must not meet the worker reading the tokenizer. Afterwards no call of ours writes."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        backend.no_truncation()
        backend.no_padding()


def shed_build_copies(tokenizer) -> None:
    """Drop the Python copies of the vocabulary and merges that transformers' Qwen2 and Llama
    tokenizers keep after building the Rust tokenizer from them and never read again: 62 MB
    of RSS on Qwen (issue 10)."""
    for name in ("_vocab", "_merges"):
        if isinstance(getattr(tokenizer, name, None), (dict, list)):
            delattr(tokenizer, name)


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
