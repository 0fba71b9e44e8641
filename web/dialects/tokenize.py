"""Counting before sending: /tokenize and /detokenize, for each dialect's body.

A tool about to send a long conversation asks first how many tokens its prompt is (with the
chat template and the tools applied, exactly as the answer's `prompt_tokens` will count it)
and what the server allows, instead of learning it from a 413. `POST /tokenize` takes what
`POST /chat` takes, `POST /v1/tokenize` what `/v1/chat/completions` takes; either may instead
carry `{"prompt": text}`, counted as plain text without the template. A chat body is
refused exactly as its chat route refuses it: both run relay.prepare(). `/detokenize` and
`/v1/detokenize` turn `{"tokens": [...]}` back into text. Behind the same keys as the rest.
"""

from __future__ import annotations

from flask import Blueprint, jsonify, request

from service.config import Config
from service.errors import InvalidRequest, Loading
from web import checked_json, relay
from web.dialects import validation
from web.dialects.chat_api import parse_chat_request
from web.dialects.openai_request import parse_completion_request
from web.runtime import Runtime

MAX_TOKENS_TO_DETOKENIZE = 1 << 16


def _prompt_ids(body: dict, parse, config: Config, runtime: Runtime) -> list[int]:
    if isinstance(body, dict) and "prompt" in body:
        body = validation.known_fields(body, {"prompt"})
        text = validation.text(body["prompt"], "'prompt'", "prompt")
        return runtime.prompts.encode_text(text)
    return relay.prepare(parse(body), config, runtime)[0]  # refused as its chat route refuses


def _token_ids(body, vocabulary: int) -> list[int]:
    body = validation.known_fields(body, {"tokens"})
    tokens = body.get("tokens")
    if (
        not isinstance(tokens, list)
        or len(tokens) > MAX_TOKENS_TO_DETOKENIZE
        or not all(validation.is_int(t) and 0 <= t < vocabulary for t in tokens)
    ):
        raise InvalidRequest(
            f"'tokens' must be a list of at most {MAX_TOKENS_TO_DETOKENIZE} token ids, each "
            f"from 0 to {vocabulary - 1}",
            param="tokens",
        )
    return tokens


def blueprint(config: Config, runtime: Runtime) -> Blueprint:
    bp = Blueprint("tokenize", __name__)

    def ready():
        if not runtime.ready:
            raise Loading()
        return checked_json.parse_body(request.get_data(cache=False))

    def tokenize(parse):
        ids = _prompt_ids(ready(), parse, config, runtime)
        prompts = runtime.prompts
        return jsonify(
            {
                "count": len(ids),
                "tokens": ids,
                "max_prompt_tokens": prompts.prompt_limit,
                "fits": len(ids) <= prompts.prompt_limit,
                "context_tokens": prompts.context_tokens,
                "max_tokens_default": config.max_tokens_default,
                "max_tokens_cap": config.max_tokens_cap,
            }
        )

    def detokenize():
        body = ready()
        vocabulary = runtime.prompts.with_tokenizer(len)
        ids = _token_ids(body, vocabulary)
        text = runtime.prompts.with_tokenizer(lambda t: t.decode(ids))
        return jsonify({"prompt": text})

    @bp.post("/tokenize", provide_automatic_options=False)
    def chat_tokenize():
        return tokenize(parse_chat_request)

    @bp.post("/v1/tokenize", provide_automatic_options=False)
    def openai_tokenize():
        return tokenize(lambda body: parse_completion_request(body)[0])

    bp.post("/detokenize", endpoint="chat_detokenize", provide_automatic_options=False)(detokenize)
    bp.post("/v1/detokenize", endpoint="openai_detokenize", provide_automatic_options=False)(
        detokenize
    )
    return bp
