"""Turning chat messages into prompt token ids with the model's own chat template.

Message content is text: only the template places control tokens. A `<|im_end|>` typed into
a message is tokenized as those characters, never as the token that ends a turn (so nobody
forges a system turn), as llama.cpp and vLLM do.

Used by request handlers, which take turns on the tokenizer behind a lock. The worker
decodes answers with the same tokenizer, without that lock (a second copy of a Qwen
tokenizer costs ~100 MB): the Rust tokenizer underneath allows any number of
concurrent readers, and encoding and decoding only read it, once `read_only` has settled the
one state transformers may write on a call (truncation and padding, which none of our calls
ask for).
"""

from __future__ import annotations

import json
import re
import secrets
import threading

from inference.runtime import tools as tool_format
from inference.runtime.tools import Function
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
    of RSS on Qwen."""
    for name in ("_vocab", "_merges"):
        if isinstance(getattr(tokenizer, name, None), (dict, list)):
            delattr(tokenizer, name)


# The placeholders' shapes (_marked, _json_marked): a content's, and a JSON string's (\ue000
# and \ue001, which tojson leaves as they are). A piece of this shape that is no placeholder
# of the prompt is text like any other.
PLACEHOLDERS = ("\x1e[0-9a-f]{16}\x1e", "\ue000[0-9a-f]{16}\ue001")
# Where a thinking model (Qwen3) writes its thought: tokens of their own in its vocabulary.
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class PromptBuilder:
    def __init__(self, tokenizer, context_tokens: int, max_prompt_tokens: int | None = None):
        self._tokenizer = tokenizer
        self._lock = threading.Lock()
        self.context_tokens = context_tokens
        self.max_prompt_tokens = max_prompt_tokens  # --max-prompt-tokens, when it is set
        # The control tokens a template may write (its added tokens), longest first.
        added = getattr(tokenizer, "added_tokens_encoder", {})
        self._controls = dict(added)
        names = sorted(added, key=len, reverse=True)
        self._control_pattern = "|".join(map(re.escape, names))
        # What _ids splits at: a control token, or a placeholder of either kind. One pattern
        # for every prompt, compiled once (a pattern of this call's placeholders was compiled
        # anew each time: half of the tokenizer's time, on the way to the first token).
        self._splitter = re.compile(
            "(" + "|".join(filter(None, [self._control_pattern, *PLACEHOLDERS])) + ")"
        )
        self._native: bool | None = None  # the template renders tools itself (found once)

    def encode(
        self,
        messages: list[dict],
        system: str | None = None,
        tools: tuple[Function, ...] | None = None,
        think: bool | None = None,
    ) -> list[int]:
        """Token ids of the chat prompt, ready for the assistant's turn.

        `think`: the template's `enable_thinking` (Qwen3's: False ends the prompt with an
        empty thought, so the model answers at once); None leaves the template's default.
        An earlier assistant turn's `reasoning_content` is rendered as the template does.

        `system` replaces the template's default system prompt and any system message given.
        The template is rendered with a private placeholder in place of each content; its
        own control tokens become their ids, and the text between them, contents included,
        is tokenized with special tokens off. Tokenizers split at control tokens before
        anything else, so text without markers gives the ids it always gave.

        `tools` and tool turns (inference/runtime/tools.py) go through the template when it
        renders tools in the Hermes format (Qwen's), else as plain text in that format. Any
        string in a tool's definition or a call's arguments that holds a control token's
        name is a placeholder too, standing for its JSON-escaped text.
        """
        if system is not None:
            messages = [{"role": "system", "content": system}] + [
                m for m in messages if m["role"] != "system"
            ]
        with self._lock:
            native = self._native_tools()
            if not native:
                messages, tools = tool_format.plain_messages(messages, tools), None
            marks: dict[str, str] = {}
            shown = [self._marked(m, marks) for m in tool_format.template_messages(messages)]
            extra = {"tools": self._json_marked([f.spec() for f in tools], marks)} if tools else {}
            if think is not None:
                extra["enable_thinking"] = think
            rendered = self._tokenizer.apply_chat_template(
                shown, add_generation_prompt=True, tokenize=False, **extra
            )
            return self._ids(rendered, marks)

    @property
    def thinks(self) -> bool:
        """Whether the model writes thoughts between `<think>` and `</think>`, tokens of
        their own (Qwen3's)."""
        return THINK_OPEN in self._controls and THINK_CLOSE in self._controls

    @property
    def tags_are_tokens(self) -> bool:
        """Whether `<tool_call>` and `</tool_call>` are tokens of their own (Qwen's)."""
        return tool_format.OPEN in self._controls and tool_format.CLOSE in self._controls

    def _native_tools(self) -> bool:  # with the lock held
        """Whether the template renders tools, in the Hermes format, itself: tried once on
        a probe tool."""
        if self._native is None:
            probe = tool_format.Function(f"probe_{secrets.token_hex(4)}", None, {})
            try:
                rendered = self._tokenizer.apply_chat_template(
                    [{"role": "user", "content": "hi"}],
                    tools=[probe.spec()],
                    add_generation_prompt=True,
                    tokenize=False,
                )
            except Exception:  # a template that refuses tools: ours then
                rendered = ""
            self._native = probe.name in rendered and tool_format.OPEN in rendered
        return self._native

    def _marked(self, message: dict, marks: dict[str, str]) -> dict:
        """The message with its content (when not empty) and its calls' arguments behind
        placeholders."""
        shown = dict(message)
        for key in ("content", "reasoning_content"):
            if message.get(key):
                mark = f"\x1e{secrets.token_hex(8)}\x1e"
                marks[mark] = message[key]
                shown[key] = mark
        if message.get("tool_calls"):
            shown["tool_calls"] = [
                {**c, "function": self._json_marked(c["function"], marks)}
                for c in message["tool_calls"]
            ]
        return shown

    def _json_marked(self, value, marks: dict[str, str]):
        """`value` (JSON data) with each string that holds a control token's name, key or
        value, replaced by a placeholder for its JSON-escaped text: the template's tojson
        writes the placeholder, and it is read back as text. Other strings stay as they are
        (JSON escaping cannot make a control name appear where there was none)."""
        if isinstance(value, dict):
            return {
                self._json_marked(k, marks): self._json_marked(v, marks) for k, v in value.items()
            }
        if isinstance(value, list):
            return [self._json_marked(v, marks) for v in value]
        if (
            isinstance(value, str)
            and self._control_pattern
            and re.search(self._control_pattern, value)
        ):
            mark = f"\ue000{secrets.token_hex(8)}\ue001"  # tojson leaves these as they are
            marks[mark] = json.dumps(value, ensure_ascii=False)[1:-1]
            return mark
        return value

    def _ids(self, rendered: str, marks: dict[str, str]) -> list[int]:  # with the lock held
        texts: list[str] = []  # the text before each control token, and after the last
        controls: list[int] = []
        text: list[str] = []
        for piece in self._splitter.split(rendered):
            if piece in marks:
                text.append(marks[piece])
            elif piece in self._controls:
                texts.append("".join(text))
                controls.append(self._controls[piece])
                text = []
            else:
                text.append(piece)
        texts.append("".join(text))
        ids: list[int] = []
        for part, control in zip(self._plain(texts), [*controls, None], strict=True):
            ids += part
            if control is not None:
                ids.append(control)
        return ids

    def _plain(self, texts: list[str]) -> list[list[int]]:
        """Ids of each text with every special token's name read as characters, all in one
        call: a conversation's turns are ~50 texts between control tokens, and a call each
        cost ~50 us of transformers' overhead (2.8 ms for 24 messages). transformers sets
        the Rust tokenizer's flag for that per call and leaves it set; it is put back here,
        under the lock, for whoever encodes next (the grammar tokenizer's build). Decoding,
        in the worker, does not read it."""
        try:
            return self._tokenizer(texts, add_special_tokens=False, split_special_tokens=True)[
                "input_ids"
            ]  # an empty text's ids are []
        finally:
            backend = getattr(self._tokenizer, "backend_tokenizer", None)
            if backend is not None:
                backend.encode_special_tokens = getattr(
                    self._tokenizer, "split_special_tokens", False
                )

    def encode_text(self, text: str) -> list[int]:
        """Plain text's ids, no template: control tokens' names read as characters."""
        with self._lock:
            return self._plain([text])[0]

    def encode_raw(self, text: str) -> list[int]:
        """Token ids of a prompt written whole by the client, template included (Ollama's
        `raw`): the control tokens' names in it are those tokens. It is the client's own
        prompt, with no other party's turn in it to forge."""
        with self._lock:
            return self._ids(text, {})

    def with_tokenizer(self, use):
        """`use(tokenizer)`, under the lock that keeps handler threads off each other."""
        with self._lock:
            return use(self._tokenizer)

    @property
    def prompt_limit(self) -> int:
        """The most prompt tokens a request may have: the context less one answer token, and
        at most --max-prompt-tokens (which bounds one prefill's time)."""
        limit = self.context_tokens - 1
        if self.max_prompt_tokens is not None:
            limit = min(limit, self.max_prompt_tokens)
        return limit

    def check_fits(self, prompt_tokens: int) -> None:
        """413, saying the count and the limit, when the prompt is over `prompt_limit`: the
        one place an over-long prompt is refused."""
        limit, context_limit = self.prompt_limit, self.context_tokens - 1
        if prompt_tokens <= limit:
            return
        if limit < context_limit:
            raise PayloadTooLarge(
                f"the prompt is {prompt_tokens} tokens; this server takes at most {limit} "
                f"prompt tokens per request (--max-prompt-tokens; the context of "
                f"{self.context_tokens} tokens would allow {context_limit})"
            )
        raise PayloadTooLarge(
            f"the prompt is {prompt_tokens} tokens; this server allows at most {limit} "
            f"prompt tokens (context {self.context_tokens}, one kept for the answer)"
        )
