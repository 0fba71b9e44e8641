"""Issue 62: the one check of every JSON read from a request (web/checked_json.py), alone:
strict UTF-8, one walk for Unicode and depth, the path of the first bad value, bounded
messages; and the same check for JSON held in a string."""

from __future__ import annotations

import json

import pytest

from service.errors import InvalidRequest
from web import checked_json
from web.checked_json import MAX_DEPTH, MAX_PATH_CHARS, MAX_SHOWN_CHARS

RAW_SURROGATE = b"\xed\xa0\x80"  # UTF-8's form of U+D800, which UTF-8 forbids


def refusal(data: bytes) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        checked_json.parse_body(data)
    return caught.value


def nested(depth: int, leaf=1):
    """`depth` objects, one inside the next: {"a": {"a": ... leaf}}."""
    value = leaf
    for _ in range(depth):
        value = {"a": value}
    return value


@pytest.mark.parametrize(
    "data, path",
    [
        (b'{"format": {"a' + RAW_SURROGATE + b'": 1}}', "format"),  # a key: its object's path
        (b'{"messages": [{"content": "x' + RAW_SURROGATE + b'"}]}', "messages[0].content"),
        (b'{"tools": [{"description": "\xff"}]}', "tools[0].description"),
        (b'{"model": "\xc0\x80"}', "model"),  # an over-long form of NUL
        (b'{"stop": ["ok", "\\ud800"]}', "stop[1]"),  # the escape decodes to the same
        (b'{"options": {"\\udfff": 1}}', "options"),
    ],
)
def test_text_that_is_not_utf8_is_refused_naming_its_path(data, path):
    error = refusal(data)
    assert error.param == path
    assert error.message.startswith(f"'{path}' ") and "not valid Unicode" in error.message


def test_a_name_at_the_top_names_the_body():
    error = refusal(b'{"\\ud800": 1}')
    assert error.param is None and error.message.startswith("the body holds a name")


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le"])
def test_bodies_in_other_encodings_are_refused_saying_so(encoding):
    error = refusal(json.dumps({"message": "hi"}).encode(encoding))
    assert "must be JSON in UTF-8" in error.message and "UTF-" in error.message


def test_utf8_with_a_byte_order_mark_and_pairs_of_surrogates_pass():
    body = checked_json.parse_body(b"\xef\xbb\xbf" + json.dumps({"m": "\U0001f600"}).encode())
    assert body == {"m": "\U0001f600"}
    assert checked_json.parse_body(b'{"m": "\\ud83d\\ude00"}') == {"m": "\U0001f600"}


def test_depth_up_to_the_limit_passes_and_one_more_is_refused_naming_where():
    assert checked_json.parse_body(json.dumps(nested(MAX_DEPTH - 1)).encode())
    error = refusal(json.dumps({"format": nested(MAX_DEPTH)}).encode())
    assert f"nests deeper than {MAX_DEPTH} levels" in error.message
    assert error.param.startswith("format.a.a") and len(error.param) <= MAX_PATH_CHARS
    wide = json.dumps({"messages": [[[[[[[[]]]]]]]] * 1000}).encode()  # wide, not deep
    assert checked_json.parse_body(wide)


@pytest.mark.parametrize("depth", [900, 960, 970, 975, 980, 985, 990, 1000, 5000, 30000])
def test_nesting_at_and_past_the_parsers_own_limit_is_a_400(depth):
    for opening, closing in ((b'{"a": ', b"}"), (b"[", b"]")):
        error = refusal(b'{"format": ' + opening * depth + b"1" + closing * depth + b"}")
        assert "nests" in error.message and len(error.message) < 400


def test_json_held_in_a_string_is_checked_as_the_body_is():
    where = "messages[1].tool_calls[0].function.arguments"
    for text, path in [
        ('{"city": "Par\\ud800is"}', f"{where}.city"),
        ('{"\\udfff": 1}', where),
        (json.dumps(nested(MAX_DEPTH + 1)), f"{where}.a.a"),
    ]:
        with pytest.raises(InvalidRequest) as caught:
            checked_json.parse(text, where)
        assert caught.value.param.startswith(path), caught.value.message
    with pytest.raises(InvalidRequest) as caught:
        checked_json.parse("{city: Paris}", where)
    assert caught.value.param == where and "is not valid JSON" in caught.value.message
    assert checked_json.parse('{"city": "Paris"}', where) == {"city": "Paris"}


def test_nan_and_infinity_are_not_json_numbers():
    for literal in (b"NaN", b"Infinity", b"-Infinity"):
        assert "not a JSON number" in refusal(b'{"temperature": ' + literal + b"}").message


def test_an_odd_key_is_quoted_in_the_path_and_long_keys_and_paths_are_cut():
    error = refusal(json.dumps({"format": {"a\nb": {"x" * 500: ["\ud800"]}}}).encode())
    assert '["a\\nb"]' in error.param and "\n" not in error.param
    assert len(error.param) <= MAX_PATH_CHARS


def test_a_value_is_shown_as_json_and_cut():
    assert checked_json.shown("Par\ud800is") == '"Par\\ud800is"'
    assert checked_json.shown("\x1b[2J") == '"\\u001b[2J"'
    assert len(checked_json.shown("x" * 10_000)) == MAX_SHOWN_CHARS
    assert len(checked_json.shown(nested(900))) <= MAX_SHOWN_CHARS
    assert checked_json.shown(None) == "null"
