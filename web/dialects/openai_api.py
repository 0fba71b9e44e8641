"""The OpenAI dialect: /v1/chat/completions and /v1/models, over the shared relay.

Any OpenAI client works by changing its base_url (and api_key). Errors take OpenAI's shape,
{"error": {"message", "type", "param", "code"}}, with our kind as `code`.
"""

from __future__ import annotations

import time

from flask import Blueprint, g, jsonify, request

from inference.runtime.jobs import Done, Event
from inference.runtime.tools import CallArguments, CallPiece, CallStart
from service.config import Config
from service.errors import Loading, ServiceError
from web import checked_json, relay
from web.checked_json import shown
from web.dialects.openai_request import parse_completion_request
from web.errors import NotFound, status_of
from web.relay import Call, sse_frame
from web.runtime import Runtime


def error_body(error: ServiceError, status: int) -> dict:
    if status == 401:
        kind = "authentication_error"
    elif status == 429:
        kind = "rate_limit_error"
    else:
        kind = "invalid_request_error" if status < 500 else "server_error"
    return {
        "error": {"message": error.message, "type": kind, "param": error.param, "code": error.type}
    }


def _usage(done: Done) -> dict:
    prompt, completion = done.usage.prompt_tokens, done.usage.completion_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _tool_calls(calls: list[Call]) -> list[dict]:
    return [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in calls
    ]


def _reasoning(text: str) -> dict:
    """A thought under both names clients read: vLLM's and DeepSeek's `reasoning_content`,
    and `reasoning` (llama-server's and OpenRouter's, vLLM's newer one)."""
    return {"reasoning_content": text, "reasoning": text}


def logprobs_of(entries, asked: bool) -> dict | None:
    """A choice's `logprobs`: null unless asked, else {"content": [entries], "refusal": null}."""
    if not asked:
        return None
    return {"content": [entry.as_dict() for entry in entries], "refusal": None}


class CompletionStream:
    """chat.completion.chunk events: the role, a thinking model's thought as
    `reasoning_content` and `reasoning` deltas, content deltas (with logprobs when asked: the
    entries of the tokens picked since the last chunk) or tool_calls deltas (a call's first
    with its id, type, name and empty arguments, then pieces of its arguments, by `index`, as
    OpenAI sends them), the finish reason, with include_usage a usage chunk, then
    `data: [DONE]`; an error is one `data: {"error"}`."""

    def __init__(
        self,
        request_id: str,
        model: str,
        created: int,
        include_usage: bool,
        logprobs: bool = False,
    ):
        self.head = {
            "id": request_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
        }
        self.include_usage = include_usage
        self.logprobs = logprobs

    def _chunk(self, delta: dict, finish_reason: str | None = None, logprobs=None, **extra) -> str:
        choice = {
            "index": 0,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
        usage = {"usage": None} if self.include_usage else {}
        return sse_frame({**self.head, "choices": [choice], **usage, **extra})

    def begin(self, first: Event | CallPiece) -> list[str]:
        content = None if isinstance(first, CallStart) else ""  # null before calls, as OpenAI
        return [self._chunk({"role": "assistant", "content": content})]

    def thought(self, text: str) -> list[str]:
        return [self._chunk(_reasoning(text))]

    def delta(self, text: str, logprobs: tuple = ()) -> list[str]:
        return [self._chunk({"content": text}, logprobs=logprobs_of(logprobs, self.logprobs))]

    def call(self, piece: CallPiece) -> list[str]:
        if isinstance(piece, CallStart):
            function = {"name": piece.name, "arguments": ""}
            entry = {"index": piece.index, "id": piece.id, "type": "function", "function": function}
        elif isinstance(piece, CallArguments):
            entry = {"index": piece.index, "function": {"arguments": piece.text}}
        else:
            return []  # a call's end has no chunk of its own
        return [self._chunk({"tool_calls": [entry]})]

    def done(self, done: Done) -> list[str]:
        cut = {"thought_cut": True} if done.thought_cut else {}
        frames = [self._chunk({}, done.finish_reason, timings=done.timings(), **cut)]
        if self.include_usage:
            frames.append(sse_frame({**self.head, "choices": [], "usage": _usage(done)}))
        return [*frames, sse_frame("[DONE]")]

    def error(self, error: ServiceError) -> list[str]:
        return [sse_frame(error_body(error, status_of(error)))]


def _model_card(runtime: Runtime) -> dict:
    return {
        "id": runtime.model_name,
        "object": "model",
        "created": runtime.created,
        "owned_by": "deskchat",
        "sampling_defaults": runtime.defaults.as_dict(),  # what a silent request gets
    }


def blueprint(config: Config, runtime: Runtime) -> Blueprint:
    bp = Blueprint("openai", __name__, url_prefix="/v1")

    @bp.post("/chat/completions", provide_automatic_options=False)
    def completions():
        body = checked_json.parse_body(request.get_data(cache=False))
        chat_request, include_usage = parse_completion_request(body)
        created = int(time.time())
        job, relayed = relay.start(chat_request, config, runtime, g.request_id, g.disconnected)
        model = runtime.model_name
        if chat_request.stream:
            shape = CompletionStream(job.id, model, created, include_usage, chat_request.logprobs)
            return relay.sse(job, relayed, shape, g.log)
        answer = relay.collect(relayed, g.log)
        forced = chat_request.tools is not None and chat_request.tools.forced
        content = answer.text if (answer.text or not answer.calls) and not forced else None
        message = {"role": "assistant", "content": content}
        if answer.thought:
            message.update(_reasoning(answer.thought))
        if answer.calls:
            message["tool_calls"] = _tool_calls(answer.calls)
        choice = {
            "index": 0,
            "message": message,
            "logprobs": logprobs_of(answer.logprobs, chat_request.logprobs),
            "finish_reason": answer.done.finish_reason,
        }
        return jsonify(
            {
                "id": job.id,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [choice],
                "usage": _usage(answer.done),
                "timings": answer.done.timings(),
                **({"thought_cut": True} if answer.done.thought_cut else {}),
            }
        )

    @bp.get("/models", provide_automatic_options=False)
    def models():
        if not runtime.ready:
            raise Loading()
        return jsonify({"object": "list", "data": [_model_card(runtime)]})

    @bp.get("/models/<path:model_id>", provide_automatic_options=False)
    def model(model_id: str):
        if not runtime.ready:
            raise Loading()
        if model_id != runtime.model_name:
            raise NotFound(f"no model {shown(model_id)} here", param="model")
        return jsonify(_model_card(runtime))

    return bp
