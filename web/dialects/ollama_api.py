"""The Ollama dialect: /api/chat, /api/generate, /api/tags, /api/show, /api/ps and
/api/version, over the shared relay.

A tool that speaks only Ollama's API works by pointing it at deskchat (and, with keys, adding
`Authorization: Bearer KEY`). Answers stream as newline-delimited JSON unless the request
says `"stream": false`, as Ollama's do; the last line has `done`, `done_reason`, the token
counts and the durations in nanoseconds. Errors take Ollama's shape, {"error": "..."}, with
the statuses of web/errors.py. The routes that would change the served model (pull, create,
copy, delete, push, blobs) answer 501 naming how deskchat chooses it.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime

from flask import Blueprint, Response, g, jsonify, request

from inference.runtime.jobs import Done
from inference.runtime.tools import CallPiece
from service.config import Config
from service.errors import Loading, ServiceError
from web import checked_json, relay
from web.checked_json import shown
from web.dialects import validation
from web.dialects.ollama_request import parse_chat_request, parse_generate_request
from web.dialects.validation import ChatRequest
from web.errors import NotFound, NotOffered, status_of
from web.relay import Call
from web.runtime import Runtime

# The Ollama release whose API these routes follow; tools read it from /api/version and
# some refuse a server older than the one they were written for.
OLLAMA_VERSION = "0.12.0"
NDJSON = "application/x-ndjson"
COMPACT = (",", ":")  # one JSON line, as Ollama writes it
NS_PER_MS = 1_000_000
NEVER = "9999-12-31T23:59:59Z"  # /api/ps: when the model will be unloaded
TAG = ":latest"  # what Ollama adds to a model name without a tag
CHOSEN_AT_START = (
    "deskchat serves one model, chosen when it starts: --model (DESKCHAT_MODEL) names a "
    "ModelScope id, a local Hugging Face folder or 'embedded'"
)
# Routes that change the served model, their methods, and what the error says they do.
MODEL_CHANGES = {
    "/pull": (["POST"], "download"),
    "/push": (["POST"], "upload"),
    "/create": (["POST"], "create"),
    "/copy": (["POST"], "copy"),
    "/delete": (["DELETE"], "delete"),
    "/blobs/<path:digest>": (["HEAD", "POST"], "store the files of"),
}


def error_body(error: ServiceError, status: int) -> dict:
    return {"error": error.message}


def _now() -> str:
    return _timestamp(datetime.now(UTC))


def _timestamp(moment: datetime) -> str:
    return moment.isoformat(timespec="microseconds").replace("+00:00", "Z")


def _ns(ms: float) -> int:
    return max(round(ms * NS_PER_MS), 0)


def _done_fields(done: Done) -> dict:
    """The last line's fields. Ollama's load_duration is the time before the model began on
    the request: here the queue wait (the model is always loaded)."""
    generating_ms = done.total_ms - done.queued_ms - done.ttft_ms
    return {
        "done": True,
        "done_reason": "stop" if done.finish_reason == "tool_calls" else done.finish_reason,
        "total_duration": _ns(done.total_ms),
        "load_duration": _ns(done.queued_ms),
        "prompt_eval_count": done.usage.prompt_tokens,
        "prompt_eval_duration": _ns(done.ttft_ms),
        "eval_count": done.usage.completion_tokens,
        "eval_duration": _ns(generating_ms),
    }


def _tool_call(call: Call, index: int) -> dict:
    """A whole call as Ollama writes it: arguments as an object."""
    function = {
        "index": index,
        "name": call.name,
        "arguments": checked_json.model_json(call.arguments),
    }
    return {"id": call.id, "function": function}


class AnswerLines:
    """One JSON line per piece of a thought (`message.thinking` on /api/chat, `thinking` on
    /api/generate, as Ollama) and per piece of text ({"model", "created_at", "message":
    {"role", "content"}, "done": false} on /api/chat, "response" in place of "message" on
    /api/generate; with `logprobs`, the entries of the tokens picked since the last line),
    one per call once it is whole (`message.tool_calls`), then the done line; an error after
    the first line is a line {"error"}, then the end."""

    def __init__(self, model: str, chat: bool, logprobs: bool):
        self.model = model
        self.chat = chat
        self.logprobs = logprobs
        self._calls = relay.WholeCalls()

    def _line(self, text: str, **fields) -> list[str]:
        if self.chat:
            part = {"message": {"role": "assistant", "content": text, **fields.pop("message", {})}}
        else:
            part = {"response": text}
        line = {"model": self.model, "created_at": _now(), **part, **fields}
        return [json.dumps(line, ensure_ascii=False, separators=COMPACT) + "\n"]

    def begin(self, first) -> list[str]:
        return []

    def thought(self, text: str) -> list[str]:
        if self.chat:
            return self._line("", message={"thinking": text}, done=False)
        return self._line("", thinking=text, done=False)

    def delta(self, text: str, logprobs: tuple = ()) -> list[str]:
        extra = {"logprobs": [e.as_dict() for e in logprobs]} if self.logprobs else {}
        return self._line(text, done=False, **extra)

    def call(self, piece: CallPiece) -> list[str]:
        call = self._calls.feed(piece)
        if call is None:
            return []
        return self._line("", message={"tool_calls": [_tool_call(call, piece.index)]}, done=False)

    def done(self, done: Done) -> list[str]:
        return self._line("", **_done_fields(done))

    def error(self, error: ServiceError) -> list[str]:
        return [
            json.dumps(error_body(error, status_of(error)), ensure_ascii=False, separators=COMPACT)
            + "\n"
        ]


def _details() -> dict:
    """What deskchat knows of Ollama's model details: nothing it could state truly."""
    return {
        "parent_model": "",
        "format": "",
        "family": "",
        "families": None,
        "parameter_size": "",
        "quantization_level": "",
    }


def _model_entry(runtime: Runtime) -> dict:
    return {
        "name": runtime.model_name,
        "model": runtime.model_name,
        "modified_at": _timestamp(datetime.fromtimestamp(runtime.created, UTC)),
        "size": 0,
        "digest": runtime.weights_digest or "",
        "details": _details(),
    }


def _parameters(runtime: Runtime) -> str:
    """The served sampling defaults as Modelfile parameter lines, Ollama's names."""
    names = {"repetition_penalty": "repeat_penalty"}
    values = runtime.defaults.values()
    return "\n".join(f"{names.get(key, key)} {value}" for key, value in values.items())


def _served(runtime: Runtime, name) -> None:
    """404 unless `name` is the served model (with or without Ollama's default tag)."""
    if name not in (runtime.model_name, f"{runtime.model_name}{TAG}"):
        raise NotFound(
            f"model {shown(name)} not found; this server serves {runtime.model_name!r}",
            param="model",
        )


def blueprint(config: Config, runtime: Runtime) -> Blueprint:
    bp = Blueprint("ollama", __name__, url_prefix="/api")

    def ready() -> None:
        if not runtime.ready:
            raise Loading()

    def answer(chat_request: ChatRequest | None, chat: bool) -> Response:
        if chat_request is None:  # nothing to say: Ollama loads the model and answers "load"
            ready()
            part = {"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}
            body = {"model": runtime.model_name, "created_at": _now(), **part}
            return jsonify({**body, "done": True, "done_reason": "load"})
        job, relayed = relay.start(chat_request, config, runtime, g.request_id, g.disconnected)
        model = runtime.model_name
        if chat_request.stream:
            shape = AnswerLines(model, chat, chat_request.logprobs)
            return relay.stream(job, relayed, shape, g.log, NDJSON)
        whole = relay.collect(relayed, g.log)
        if chat:
            message = {"role": "assistant", "content": whole.text}
            if whole.thought:
                message["thinking"] = whole.thought
            calls = [_tool_call(c, i) for i, c in enumerate(whole.calls) if c.complete]
            if calls:  # one cut short by num_predict or a stop string: left out
                message["tool_calls"] = calls
            part = {"message": message}
        else:
            part = {"response": whole.text}
            if whole.thought:
                part["thinking"] = whole.thought
        body = {"model": model, "created_at": _now(), **part, **_done_fields(whole.done)}
        if chat_request.logprobs:
            body["logprobs"] = [entry.as_dict() for entry in whole.logprobs]
        return jsonify(body)

    @bp.post("/chat", provide_automatic_options=False)
    def chat():
        body = checked_json.parse_body(request.get_data(cache=False))
        return answer(parse_chat_request(body), chat=True)

    @bp.post("/generate", provide_automatic_options=False)
    def generate():
        body = checked_json.parse_body(request.get_data(cache=False))
        return answer(parse_generate_request(body), chat=False)

    @bp.get("/tags", provide_automatic_options=False)
    def tags():
        ready()
        return jsonify({"models": [_model_entry(runtime)]})

    @bp.get("/ps", provide_automatic_options=False)
    def ps():
        ready()
        entry = {
            **_model_entry(runtime),
            "expires_at": NEVER,
            "size_vram": 0,
            "context_length": runtime.prompts.context_tokens,
        }
        return jsonify({"models": [entry]})

    @bp.post("/show", provide_automatic_options=False)
    def show():
        body = validation.known_fields(
            checked_json.parse_body(request.get_data(cache=False)), {"model", "name", "verbose"}
        )
        ready()
        _served(runtime, body.get("model", body.get("name")))
        name, context = runtime.model_name, runtime.prompts.context_tokens
        parameters = _parameters(runtime)
        capabilities = ["completion", "tools"] if runtime.grammars is not None else ["completion"]
        return jsonify(
            {
                "modelfile": f"# {CHOSEN_AT_START}\nFROM {name}\n"
                + "".join(f"PARAMETER {line}\n" for line in parameters.splitlines()),
                "parameters": parameters,
                "template": "",
                "details": _details(),
                # A tool reads the context as <general.architecture>.context_length.
                "model_info": {
                    "general.architecture": "deskchat",
                    "general.basename": name,
                    "deskchat.context_length": context,
                },
                "capabilities": capabilities,
                "modified_at": _model_entry(runtime)["modified_at"],
            }
        )

    @bp.get("/version", provide_automatic_options=False)
    def version():
        return jsonify({"version": OLLAMA_VERSION})

    def refuse_model_change(what: str):
        def view(**_):
            raise NotOffered(f"{CHOSEN_AT_START}; it does not {what} models over the API")

        return view

    for rule, (methods, what) in MODEL_CHANGES.items():
        endpoint = "model_change_" + rule.strip("/").split("/")[0]
        bp.add_url_rule(
            rule,
            endpoint,
            refuse_model_change(what),
            methods=methods,
            provide_automatic_options=False,
        )

    return bp
