"""Turning chat messages into prompt token ids with the model's own chat template.

Message content is text: only the template places control tokens. A `<|im_end|>` typed into
a message is tokenized as those characters, never as the token that ends a turn (so nobody
forges a system turn), as llama.cpp and vLLM do.

Used by request handlers, which take turns on the tokenizer behind a lock. The worker
decodes answers with the same tokenizer, without that lock (a second copy of a Qwen
tokenizer costs ~100 MB, issue 10): the Rust tokenizer underneath allows any number of
concurrent readers, and encoding and decoding only read it, once `read_only` has settled the
one state transformers may write on a call (truncation and padding, which none of our calls
ask for).
"""

from __future__ import annotations

import re
import secrets
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
        # The control tokens a template may write (its added tokens), longest first.
        added = getattr(tokenizer, "added_tokens_encoder", {})
        self._controls = dict(added)
        names = sorted(added, key=len, reverse=True)
        self._control_pattern = "|".join(map(re.escape, names))

    def encode(self, messages: list[dict], system: str | None = None) -> list[int]:
        """Token ids of the chat prompt, ready for the assistant's turn.

        `system` replaces the template's default system prompt and any system message given.
        The template is rendered with a private placeholder in place of each content; its
        own control tokens become their ids, and the text between them, contents included,
        is tokenized with special tokens off. Tokenizers split at control tokens before
        anything else, so text without markers gives the ids it always gave.
        """
        if system is not None:
            messages = [{"role": "system", "content": system}] + [
                m for m in messages if m["role"] != "system"
            ]
        marks = {f"\x1e{secrets.token_hex(8)}\x1e": m["content"] for m in messages}
        shown = [{**m, "content": mark} for m, mark in zip(messages, marks, strict=True)]
        with self._lock:
            rendered = self._tokenizer.apply_chat_template(
                shown, add_generation_prompt=True, tokenize=False
            )
            return self._ids(rendered, marks)

    def _ids(self, rendered: str, marks: dict[str, str]) -> list[int]:  # with the lock held
        splitter = "|".join(filter(None, [self._control_pattern, *map(re.escape, marks)]))
        ids: list[int] = []
        text: list[str] = []
        for piece in re.split(f"({splitter})", rendered):
            if piece in marks:
                text.append(marks[piece])
            elif piece in self._controls:
                ids += self._plain("".join(text))
                ids.append(self._controls[piece])
                text = []
            else:
                text.append(piece)
        return ids + self._plain("".join(text))

    def _plain(self, text: str) -> list[int]:
        """Ids of `text` with every special token's name read as characters. transformers
        sets the Rust tokenizer's flag for that per call and leaves it set; it is put back
        here, under the lock, for whoever encodes next (the grammar tokenizer's build).
        Decoding, in the worker, does not read it."""
        if not text:
            return []
        try:
            return self._tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
        finally:
            backend = getattr(self._tokenizer, "backend_tokenizer", None)
            if backend is not None:
                backend.encode_special_tokens = getattr(
                    self._tokenizer, "split_special_tokens", False
                )

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
