"""Constrained decoding: JSON schemas, and the lark grammars of tool calls
(inference/runtime/tools.py), compiled into token masks (llguidance).

`SchemaCompiler` runs on the request side: it turns a schema into a `Grammar` (cached by
schema) or raises InvalidRequest saying what is wrong, before any job is queued. The engine
asks a Grammar for a fresh `Constraint` per run, which masks each step's logits to the
tokens that can continue valid output and follows the tokens picked.

A schema can compile and still dead-end while decoding (a $ref cycle, minProperties far past
any answer, a pattern llguidance calls too complex on the way): the Constraint then raises
InvalidRequest naming the request field, which ends that job alone (README "JSON answers").
llguidance's own error text dumps the schema and the tokens so far; it is never shown nor
logged, only its stop reason.
"""

from __future__ import annotations

import decimal
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from service.errors import InvalidRequest

if TYPE_CHECKING:
    import torch

# llguidance's Rust thread pool would spin beside torch's two OpenMP threads on a 2-core PC;
# one matcher per step needs no pool. Measured on a shared machine (load average 3): a schema
# cost 1.69x the time per token with the default pool, 0.98x with one thread (README "JSON
# answers"); to be re-measured quietly. Set before first use.
os.environ.setdefault("RAYON_NUM_THREADS", "1")

CACHED_SCHEMAS = 64
MAX_GRAMMAR_ERROR_CHARS = 300
# Admission limits on a schema (README "JSON answers"): its JSON's size in bytes, and how
# deep objects and lists nest in it (a schema's own keywords count: properties -> name ->
# schema is two levels). Real schemas for an answer are far inside both.
MAX_SCHEMA_BYTES = 16 * 1024
MAX_SCHEMA_DEPTH = 32
# Numbers llguidance is fed safely (found by fuzzing): an integer that rounds to -2**63 in
# `enum`, `const` or an integer range crashed the process (SIGSEGV in its Rust library), so
# every number in a schema stays within JSON's exact range (I-JSON, RFC 7493: +-2**53); a
# `multipleOf` compiles to an automaton as large as its significant digits (the times:
# docs/api.md "JSON answers"), so those stay at most MAX_MULTIPLE_DIGITS.
MAX_SCHEMA_NUMBER = 2**53
MAX_MULTIPLE_DIGITS = 99_999


class Constraint:
    """One run's grammar state: the mask for the next token, and the tokens taken so far."""

    def __init__(self, matcher, vocab_size: int, param: str):
        import numpy as np  # here, so the web side can import this module without torch

        self._matcher = matcher
        self._vocab_size = vocab_size
        self._param = param  # the request field the schema came in, for the error
        self._taken = 0
        self._np = np
        self._bias = np.array([-np.inf, 0.0], dtype=np.float32)  # by allowed bit: 0 or 1

    def mask_(self, logits: torch.Tensor) -> torch.Tensor:
        """Set every token the grammar does not allow next to -inf, in place; InvalidRequest
        when it allows none (a schema no value can satisfy, e.g. minimum above maximum, or
        one too complex for llguidance to follow further)."""
        import torch

        np = self._np
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[: logits.shape[-1]]
        if self._matcher.is_error() or not allowed.any():
            raise self._dead_end()
        if logits.dtype == torch.float32 and logits.is_contiguous():
            # Adding 0 or -inf in numpy: the whole mask step takes about 0.6 ms for Qwen's
            # 151,936 logits, where torch's masked_fill_ alone took 1.4-8 ms here.
            values = logits.numpy()
            np.add(values, self._bias[allowed], out=values)
            return logits
        return logits.masked_fill_(torch.from_numpy(allowed == 0), float("-inf"))

    def take(self, token: int) -> None:
        if not self._matcher.consume_token(token):  # the mask allowed it: the schema is
            raise self._dead_end()  # past what llguidance can follow (e.g. ParserTooComplex)
        self._taken += 1

    def forced(self) -> list[int]:
        """The tokens the grammar allows next and nothing else (a key name, its quotes):
        drafted first, the model still picks them (inference/runtime/engine.py). A draft is
        optional: where the matcher cannot say, nothing is drafted and the next mask_()
        names the dead end."""
        try:
            return [] if self._matcher.is_error() else list(self._matcher.compute_ff_tokens())
        except Exception:
            return []

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, in order from the current state, the grammar allows; the
        state does not move (0 where the matcher cannot say, as forced())."""
        try:
            return self._matcher.validate_tokens(tokens) if tokens else 0
        except Exception:
            return 0

    def _dead_end(self) -> InvalidRequest:
        return dead_end(self._matcher, self._param, f"after {self._taken} answer tokens")

    @property
    def finished(self) -> bool:
        """The output is complete: nothing but end-of-text may follow."""
        return self._matcher.is_stopped() and not self._matcher.is_error()


@dataclass(frozen=True)
class Grammar:
    """A compiled schema; each run gets its own copy of the pristine matcher."""

    _template: object
    vocab_size: int
    param: str  # the request field it came in ("response_format", "format")

    def constraint(self) -> Constraint:
        return Constraint(self._template.deep_copy(), self.vocab_size, self.param)


class SchemaCompiler:
    """Compiles JSON schemas for one tokenizer; thread-safe, results cached by schema."""

    def __init__(self, with_tokenizer, vocab_size: int):
        self._with_tokenizer = with_tokenizer  # runs a function on the HF tokenizer, safely
        self.vocab_size = vocab_size
        self._ll_tokenizer = None  # built on first use: about a second for a large vocabulary
        self._cache: OrderedDict[str, Grammar | InvalidRequest] = OrderedDict()
        self._lock = threading.Lock()

    def warm(self) -> None:
        """Build the grammar tokenizer now rather than at the first schema."""
        with self._lock:
            self._tokenizer()

    def _tokenizer(self):  # with the lock held
        if self._ll_tokenizer is None:
            self._ll_tokenizer = self._with_tokenizer(
                lambda hf: grammar_tokenizer(hf, self.vocab_size)
            )
        return self._ll_tokenizer

    def compile(self, schema: dict, param: str) -> Grammar:
        """The grammar for `schema`; InvalidRequest (naming `param`) if it cannot be used:
        over the size or depth limit, refused by llguidance, or dead at its first tokens.
        Refusals are cached too: a hostile schema sent again costs no second compile."""
        import llguidance

        text = json.dumps(schema, ensure_ascii=False)  # property order matters: it is kept
        check_size(schema, text, param)
        return self._compiled(
            f"{param}:{text}",  # a Grammar names its field in its errors
            param,
            lambda: llguidance.LLMatcher.grammar_from_json_schema(
                text, defaults={"whitespace_flexible": False}
            ),
        )

    def compile_lark(self, lark: str, param: str) -> Grammar:
        """The grammar for a lark text built by the server (tool calls, with each function's
        schema inlined by %json; each schema was compiled alone first, which named the one at
        fault), cached and checked as compile() does."""
        import llguidance

        return self._compiled(
            f"{param}:lark:{lark}", param, lambda: llguidance.LLMatcher.grammar_from_lark(lark)
        )

    def _compiled(self, key: str, param: str, spec: Callable[[], str]) -> Grammar:
        with self._lock:  # held only to look up and to store: compiles run side by side
            if key in self._cache:
                self._cache.move_to_end(key)
                outcome = self._cache[key]
            else:
                outcome, tokenizer = None, self._tokenizer()
        if outcome is None:
            try:
                outcome = self._build(spec, param, tokenizer)
            except InvalidRequest as refused:
                outcome = refused
            with self._lock:
                self._cache[key] = outcome
                if len(self._cache) > CACHED_SCHEMAS:
                    self._cache.popitem(last=False)
        if isinstance(outcome, InvalidRequest):
            raise InvalidRequest(outcome.message, param=param)
        return outcome

    def _build(self, spec: Callable[[], str], param: str, tokenizer) -> Grammar:
        import llguidance

        limits = llguidance.LLParserLimits(verbose_errors=False)  # no schema in its errors
        try:
            grammar = spec()
        except ValueError as exc:
            raise _refusal(param, str(exc)) from None
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, tokenizer, limits=limits
        )
        if failed:
            raise _refusal(param, messages[0])
        template = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=limits)
        if template.is_error():
            raise _refusal(param, template.get_error())
        _probe(template.deep_copy(), param)
        return Grammar(template, self.vocab_size, param)


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: how a byte-level BPE vocabulary
    (Qwen's, SmolLM2's) writes each byte of a token as one printable character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    chars = printable + [256 + n for n in range(len(others))]
    return {chr(c): b for b, c in zip(printable + others, chars, strict=True)}


class _HfCallback:
    """What llguidance.TokenizerWrapper takes: the token table, and tokenizing by a call
    into the HF tokenizer (text, specials split out, none added: as llguidance's own)."""

    def __init__(self, hf, tokens: list[bytes], special: list[int]):
        self.eos_token_id = hf.eos_token_id
        self.bos_token_id = hf.bos_token_id
        self.tokens = tokens
        self.special_token_ids = special
        self._encode = hf.backend_tokenizer.encode

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):  # so the wrapper hands over text, not bytes
            raise TypeError("text only")
        return self._encode(text, add_special_tokens=False).ids


def grammar_tokenizer(hf, vocab_size: int):
    """llguidance's tokenizer for `hf`. For a byte-level BPE vocabulary it is built from the
    tokens' bytes and a callback into `hf`, with the bytes and special marks that
    `llguidance.hf.from_tokenizer` gives (every added token special, the ids past the
    vocabulary named `<[id]>`; tests/inference/runtime/test_grammar_tokenizer.py): that one
    builds a second Rust tokenizer from the JSON, 160 MB of RSS on Qwen's vocabulary
    against 42 MB so (docs/native.md, Memory). Any other vocabulary goes that way."""
    import llguidance
    import llguidance.hf
    from tokenizers import decoders

    if len(hf) > vocab_size or not isinstance(hf.backend_tokenizer.decoder, decoders.ByteLevel):
        return llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size)
    alphabet = _byte_level_alphabet()
    added = hf.added_tokens_decoder
    tokens: list[bytes] = []
    for i, text in enumerate(hf.convert_ids_to_tokens(list(range(len(hf))))):
        if i in added:
            tokens.append(added[i].content.encode())
        elif text is None or any(c not in alphabet for c in text):
            return llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size)
        else:
            tokens.append(bytes(alphabet[c] for c in text))
    beyond = range(len(tokens), vocab_size)
    tokens += [f"<[{i}]>".encode() for i in beyond]
    callback = _HfCallback(hf, tokens, sorted(added) + list(beyond))
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(callback), n_vocab=vocab_size)


def check_size(schema: dict, text: str, param: str) -> None:
    """Refuse a schema over MAX_SCHEMA_BYTES (of its JSON) or MAX_SCHEMA_DEPTH levels of
    nesting before llguidance sees it: its compile time and memory grow with both; or one
    holding a number llguidance does not take safely (MAX_SCHEMA_NUMBER,
    MAX_MULTIPLE_DIGITS)."""
    size = len(text.encode())
    if size > MAX_SCHEMA_BYTES:
        raise InvalidRequest(
            f"the JSON schema in '{param}' is {size} bytes; this server takes at most "
            f"{MAX_SCHEMA_BYTES}",
            param=param,
        )
    level, below = 0, [schema]
    while below:
        level += 1
        if level > MAX_SCHEMA_DEPTH:
            raise InvalidRequest(
                f"the JSON schema in '{param}' nests deeper than {MAX_SCHEMA_DEPTH} levels "
                "of objects and lists",
                param=param,
            )
        for node in below:
            _check_numbers(node, param)
        below = [
            child
            for node in below
            for child in (node.values() if isinstance(node, dict) else node)
            if isinstance(child, dict | list)
        ]


def _check_numbers(node: dict | list, param: str) -> None:
    """The numbers right inside one object or list of a schema (check_size)."""
    items = node.items() if isinstance(node, dict) else ((None, v) for v in node)
    for key, value in items:
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if not abs(value) < MAX_SCHEMA_NUMBER:  # inf and nan too
            raise InvalidRequest(
                f"the JSON schema in '{param}' holds the number {_short(value)}; this server "
                f"takes numbers from -2**53 to 2**53 in a schema",
                param=param,
            )
        if key == "multipleOf" and value > 0 and _significant(value) > MAX_MULTIPLE_DIGITS:
            raise InvalidRequest(
                f"the JSON schema in '{param}' has a multipleOf of {_short(value)}; this server "
                f"takes one of at most five significant digits (such as 0.01, 2.5 or 10000)",
                param=param,
            )


def _significant(value: int | float) -> int:
    """The value's significant digits as one integer: 999999.5 -> 9999995, 1000 -> 1."""
    digits = decimal.Decimal(repr(value)).normalize().as_tuple().digits
    return int("".join(map(str, digits)) or "0")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 30 else text[:27] + "..."


def _probe(matcher, param: str) -> None:
    """Walk a fresh matcher through the output every answer must begin with (the forced
    tokens): a schema that dead-ends there (a required $ref cycle, a pattern that blows up
    the lexer, a property name holding a control token) is refused now, not in the step."""
    matcher.compute_bitmask()
    forced = [] if matcher.is_error() else matcher.compute_ff_tokens()
    if not matcher.is_error() and forced:
        matcher.consume_tokens(forced)
    if not matcher.is_error():
        matcher.compute_bitmask()
    if matcher.is_error():
        raise dead_end(matcher, param, "at the output every answer must begin with")


def dead_end(matcher, param: str, where: str) -> InvalidRequest:
    """The request's error for a matcher in its error state. Only a class of cause is told:
    llguidance's error text goes on to quote the schema and the answer so far."""
    first_line = matcher.get_error().split("\n", 1)[0].lower()
    if "too many" in first_line or "too complex" in first_line:
        why = "it is too complex for the grammar engine to follow"
    else:
        why = "no value can be completed under it"
    return InvalidRequest(
        f"the JSON schema in '{param}' allows no further output {where}: {why}", param=param
    )


def _refusal(param: str, reason: str) -> InvalidRequest:
    reason = " ".join(reason.split())[:MAX_GRAMMAR_ERROR_CHARS]
    return InvalidRequest(f"the JSON schema in '{param}' cannot be used: {reason}", param=param)
