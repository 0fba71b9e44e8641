"""Tool calls in the Hermes format Qwen2.5 was trained on: how tools, calls and results are
written into a prompt, the grammar that holds an answer to that format, and the reader that
takes the calls back out of the answer's text.

A call is `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`; several are
separated by one newline; results go back as `<tool_response>\\n...\\n</tool_response>` in a
user turn. A template that renders tools itself (Qwen's) is used as it is
(inference/runtime/prompt.py); for any other, `plain_messages()` writes the same format as
ordinary message text, so every model gets tools. Nothing here knows HTTP or request shapes:
messages use the neutral form below, which each dialect parses into.

Messages: {"role": "system"|"user", "content"}, {"role": "assistant", "content",
"tool_calls": [{"id", "name", "arguments": {...}}]} and {"role": "tool", "content",
"tool_call_id"}.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field

from inference.runtime.jobs import Delta

OPEN, CLOSE = "<tool_call>", "</tool_call>"
HEAD = '\n{"name": "'  # after OPEN: the call's fixed start, then the name
NAME_END = '", "arguments": '  # after the name, then the arguments' JSON
TAIL = "}\n"  # after the arguments, then CLOSE
DEFAULT_SYSTEM = "You are a helpful assistant."
# Arguments are written as Qwen's template writes them (json.dumps: ", " and ": "), with no
# other free whitespace, so a small model stays on the format it was trained on.
ARGUMENT_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Free text of an `auto` answer: anything that does not hold the opening tag, so a call can
# only begin where the grammar constrains it.
TEXT_RULE = "TEXT: /(?s:.*)/ & ~/(?s:.*)<tool_call>(?s:.*)/"


@dataclass(frozen=True)
class Function:
    name: str
    description: str | None
    parameters: dict  # a JSON schema for an object
    param: str = field(default="tools", compare=False)  # the request field of `parameters`

    def spec(self) -> dict:
        """The tool as OpenAI and chat templates write it."""
        function = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolUse:
    """The tools a request offers and what the answer may do with them: `choice` is "auto"
    (text or calls), "required" (calls only) or a function's name (calls of it only)."""

    functions: tuple[Function, ...]
    choice: str = "auto"
    parallel: bool = True

    @property
    def forced(self) -> bool:
        """The answer is calls and nothing else ("required" or a name)."""
        return self.choice != "auto"

    def callable(self) -> tuple[Function, ...]:
        if self.choice in ("auto", "required"):
            return self.functions
        return tuple(f for f in self.functions if f.name == self.choice)


# -- the prompt ------------------------------------------------------------------------------


def system_text(functions: tuple[Function, ...]) -> str:
    """The tools section of the system turn, worded as Qwen2.5's own template words it."""
    listed = "\n".join(json.dumps(f.spec(), ensure_ascii=False) for f in functions)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{listed}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments "
        f"within <tool_call></tool_call> XML tags:\n{OPEN}\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n' + CLOSE
    )


def call_text(name: str, arguments: dict) -> str:
    return f"{OPEN}{HEAD}{name}{NAME_END}{json.dumps(arguments, ensure_ascii=False)}{TAIL}{CLOSE}"


def plain_messages(messages: list[dict], functions: tuple[Function, ...] | None) -> list[dict]:
    """The conversation as system, user and assistant turns of plain text, for a template
    that knows nothing of tools: the tools appended to the system turn, calls written into
    the assistant's text, a run of tool results as one user turn of <tool_response> blocks.
    Without tools or tool turns the messages come back as they were."""
    out: list[dict] = []
    for i, m in enumerate(messages):
        if m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if i and messages[i - 1]["role"] == "tool":
                out[-1] = {"role": "user", "content": f"{out[-1]['content']}\n{block}"}
            else:
                out.append({"role": "user", "content": block})
        elif m.get("tool_calls"):
            calls = [call_text(c["name"], c["arguments"]) for c in m["tool_calls"]]
            lead = [m["content"]] if m["content"] else []
            out.append({"role": "assistant", "content": "\n".join(lead + calls)})
        else:
            out.append(m)
    if functions:
        system = out.pop(0)["content"] if out[0]["role"] == "system" else DEFAULT_SYSTEM
        out.insert(0, {"role": "system", "content": f"{system}\n\n{system_text(functions)}"})
    return out


def template_messages(messages: list[dict]) -> list[dict]:
    """The messages in the shape chat templates read (transformers' tool-use format)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {"name": c["name"], "arguments": c["arguments"]},
                }
                for c in m["tool_calls"]
            ]
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


# -- the grammar -----------------------------------------------------------------------------


def grammar(use: ToolUse, tags_are_tokens: bool) -> str:
    """A lark grammar (llguidance) for the answers `use` allows: for "required" or a name, one
    or more calls and nothing else; for "auto", free text without the opening tag, or text
    then calls. Each call's arguments follow its function's schema (%json). Where the
    tokenizer has the tags as tokens of their own (Qwen's added `<tool_call>`), the grammar
    names those tokens, as the model writes them; otherwise the tags are plain text."""
    if tags_are_tokens:
        open_, close = OPEN, CLOSE  # lark's <name> is the token itself
    else:
        open_, close = json.dumps(OPEN), json.dumps(CLOSE)
    more = ' ("\\n" call)*' if use.parallel else ""
    if use.forced:
        lines = [f"start: call{more}"]
    elif tags_are_tokens:  # the token ends the text: text cannot hold it
        lines = [f"start: TEXT | TEXT? {open_} rest{more}", TEXT_RULE]
    else:  # one lexeme, text up to the first tag, so that the text cannot swallow the tag
        lines = [f"start: TEXT | LEAD rest{more}", TEXT_RULE, f"LEAD: TEXT {open_}"]
    if use.forced or use.parallel:
        lines.append(f"call: {open_} rest")
    names = []
    for i, f in enumerate(use.callable()):
        names.append(f"fn{i}")
        lines.append(f"fn{i}: {json.dumps(f.name + NAME_END)} args{i}")
        lines.append(f"args{i}: %json {json.dumps(argument_schema(f.parameters))}")
    lines.append(f"rest: {json.dumps(HEAD)} ({' | '.join(names)}) {json.dumps(TAIL)} {close}")
    return "\n".join(lines) + "\n"


def argument_schema(parameters: dict) -> dict:
    """The function's schema as the root (its $refs stay valid), an object, laid out as
    ARGUMENT_LAYOUT says."""
    return {"type": "object", **parameters, "x-guidance": ARGUMENT_LAYOUT}


# -- reading calls out of the answer ---------------------------------------------------------


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArguments:
    index: int
    text: str  # the next piece of the arguments' JSON


@dataclass(frozen=True)
class CallEnd:
    index: int


CallPiece = CallStart | CallArguments | CallEnd
Piece = Delta | CallPiece  # the text outside calls comes as Deltas, as a job's text does


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass
class CallReader:
    """Turns an answer's text, piece by piece as it streams, into Deltas and call pieces. It
    relies on the grammar's exact format (`grammar()`): it reads, it does not guess. Text
    that could still become a tag, and whitespace just before a call, is held back until
    the next piece decides; `finish()` releases what is left."""

    calls: int = 0  # calls started so far
    _state: str = "text"  # text | head | arguments | between
    _buffer: str = ""

    def feed(self, text: str) -> list[Piece]:
        self._buffer += text
        out: list[Piece] = []
        while (pieces := getattr(self, f"_{self._state}")()) is not None:
            out += pieces
        return out

    def finish(self) -> list[Piece]:
        """The rest, at the end of the answer: held-back text, or the last arguments of a call
        cut short (by max_tokens or a stop string; it gets no CallEnd)."""
        rest, self._buffer = self._buffer, ""
        if rest and self._state == "text":
            return [Delta(rest)]
        if rest and self._state == "arguments":
            return [CallArguments(self.calls - 1, rest)]
        return []

    # Each state's step returns the pieces it read (maybe none, after a change of state), or
    # None when it must wait for more text.

    def _text(self) -> list[Piece] | None:
        at = self._buffer.find(OPEN)
        if at >= 0:
            before, self._buffer = self._buffer[:at], self._buffer[at + len(OPEN) :]
            self._state = "head"
            return [Delta(before.rstrip())] if before.strip() else []
        body = self._buffer[: len(self._buffer) - _partial_tail(self._buffer, OPEN)]
        shown = body.rstrip()  # whitespace waits: it may stand just before a call
        if not shown:
            return None
        self._buffer = self._buffer[len(shown) :]
        return [Delta(shown)]

    def _head(self) -> list[Piece] | None:
        end = self._buffer.find(NAME_END, len(HEAD))
        if not self._buffer.startswith(HEAD) or end < 0:
            return None
        name = self._buffer[len(HEAD) : end]
        self._buffer = self._buffer[end + len(NAME_END) :]
        self._state = "arguments"
        self.calls += 1
        return [CallStart(self.calls - 1, new_call_id(), name)]

    def _arguments(self) -> list[Piece] | None:
        index = self.calls - 1
        end = self._buffer.find(TAIL + CLOSE)  # no raw newline can stand inside the JSON
        if end >= 0:
            args, self._buffer = self._buffer[:end], self._buffer[end + len(TAIL + CLOSE) :]
            self._state = "between"
            return ([CallArguments(index, args)] if args else []) + [CallEnd(index)]
        args = self._buffer[: len(self._buffer) - _partial_tail(self._buffer, TAIL + CLOSE)]
        if not args:
            return None
        self._buffer = self._buffer[len(args) :]
        return [CallArguments(index, args)]

    def _between(self) -> list[Piece] | None:
        following = "\n" + OPEN
        if self._buffer.startswith(following):
            self._buffer = self._buffer[len(following) :]
            self._state = "head"
            return []
        if following.startswith(self._buffer):
            return None  # nothing yet, or part of the next call's start
        self._state = "text"  # not the grammar's output: the rest is read as text
        return []


def read_all(text: str) -> list[Piece]:
    """Every piece of a whole answer."""
    reader = CallReader()
    return reader.feed(text) + reader.finish()


def _partial_tail(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
