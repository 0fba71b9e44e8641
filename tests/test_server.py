"""The real embedded model through the real worker and the real server.py on loopback."""

from __future__ import annotations

import os
import threading
import time
from types import SimpleNamespace

import pytest

from tests.support.httpclient import Stream, chat, request, stream_all, wait_until
from tests.support.metrics import scrape


def test_answers_a_factual_question(embedded_server):
    # Not the capital of France: SmolLM2's fp32 answer to it starts on a near-tie ("The"
    # -1.883 vs "L" -1.965); Japan's margin is 2.5 logits up to "Tokyo" (support/margins.py).
    reply = chat(embedded_server.url, {"message": "What is the capital of Japan?"})
    assert reply.status == 200
    body = reply.json()
    assert "Tokyo" in body["response"]
    assert body["model"] == "SmolLM2-135M-Instruct"
    assert body["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] > 0 and body["timings"]["ttft_ms"] > 0


def test_streamed_text_equals_plain_text_under_greedy(embedded_server):
    body = {"message": "Write two sentences about the sea.", "max_tokens": 40}
    plain = chat(embedded_server.url, body).json()
    text, events = stream_all(embedded_server.url, body)
    assert len(events) > 3
    assert text == plain["response"]
    done = events[-1][1]
    assert done["done"] is True and done["usage"] == plain["usage"]


CONVERSATIONS = [
    pytest.param(
        [
            {"role": "user", "content": "What is the capital of Japan?"},
            {"role": "assistant", "content": "The capital of Japan is Tokyo."},
            {"role": "user", "content": "Repeat the name of that city."},
        ],
        "Tokyo",
        id="city",
    ),
]


@pytest.mark.parametrize(("messages", "fact"), CONVERSATIONS)
def test_multi_turn_uses_the_earlier_turns(embedded_server, messages, fact):
    with_history = chat(embedded_server.url, {"messages": messages, "max_tokens": 40}).json()
    last_only = chat(embedded_server.url, {"messages": messages[-1:], "max_tokens": 40}).json()
    assert fact in with_history["response"]
    assert fact not in last_only["response"]
    assert with_history["usage"]["prompt_tokens"] > last_only["usage"]["prompt_tokens"]


def test_system_prompt_is_followed(embedded_server):
    default = chat(embedded_server.url, {"message": "Who are you?", "max_tokens": 30}).json()
    custom = chat(
        embedded_server.url,
        {
            "message": "Who are you?",
            "max_tokens": 30,
            "system": "You are Zorg, a robot from Mars. Always say your name.",
        },
    ).json()
    assert "Zorg" in custom["response"] and "Zorg" not in default["response"]


def test_stop_strings_end_the_answer(embedded_server):
    # (not "Count from 1 to 10": the int8 default answers that one "1234567890..." in one word)
    body = {"message": "Name the days of the week, separated by commas.", "max_tokens": 60}
    full = chat(embedded_server.url, body).json()["response"]
    words = full.split()
    assert len(words) >= 4, full
    stop = words[len(words) // 2]  # a piece from the middle of the greedy answer
    stopped = chat(embedded_server.url, {**body, "stop": [stop]}).json()
    assert stopped["finish_reason"] == "stop"
    assert stopped["response"] == full[: full.index(stop)]


def test_max_tokens_gives_finish_reason_length(embedded_server):
    body = chat(embedded_server.url, {"message": "Tell me a long story.", "max_tokens": 5})
    assert body.json()["finish_reason"] == "length"
    assert body.json()["usage"]["completion_tokens"] == 5


def test_prompt_longer_than_context_is_413_with_counts(embedded_server):
    reply = chat(embedded_server.url, {"message": "hello " * 5000})
    assert reply.status == 413
    message = reply.json()["error"]["message"]
    assert "4095" in message and "prompt is" in message


def test_client_leaving_a_stream_frees_the_worker_at_once(embedded_server):
    stream = Stream(
        embedded_server.url, {"message": "Tell me a very long story.", "max_tokens": 1000}
    )
    events = stream.events()
    for _ in range(5):
        next(events)
    stream.close()
    started = time.monotonic()

    def idle():
        return request(embedded_server.url, "GET", "/health").json()["busy"] is False

    assert wait_until(idle, 2.0), "the worker was still generating for a client that left"
    # 1000 tokens take tens of seconds here; the next request is served right away instead.
    reply = chat(embedded_server.url, {"message": "Say hi.", "max_tokens": 3})
    assert reply.status == 200 and reply.json()["timings"]["queued_ms"] < 1000
    assert time.monotonic() - started < 10


def served_weights(url: str) -> str:
    """The `quantization` label of /metrics' deskchat_model_info."""
    samples = scrape(url)
    (labels,) = [dict(k[1]) for k in samples if k[0] == "deskchat_model_info"]
    return labels["quantization"]


def test_health_and_the_log_show_the_cpu_paths(embedded_server, embedded_dir):
    from inference.host import cpu
    from inference.loading.assemble import model_size
    from inference.native import build

    # the native step is on by default and built here (.ci/run installs the compiler)
    level = build.level(build.this_cpu())
    plan = cpu.plan_here("auto", library=SimpleNamespace(isa=level))
    plan = plan.for_model(model_size(embedded_dir), cpu.ram_bytes())
    health = request(embedded_server.url, "GET", "/health").json()
    assert health["cpu"] == plan.as_dict()
    assert plan.as_dict()["paths"]["int8_row"] == "native"
    assert health["decode_step"] == f"native {level}" == health["cpu"]["step"]
    assert embedded_server.log().count(f"INFO deskchat.loading: {plan.summary()}") == 1
    # auto on a small model (0.13B, 128 MB of int8 weights) and a PC of 1 GB or more
    assert (health["cpu"]["quantize"], health["cpu"]["requested"]) == ("int8-row", "auto")
    assert "(auto: " in plan.summary() and "0.13B parameters, under 1B, and " in plan.summary()
    assert served_weights(embedded_server.url) == "int8-row"


def test_health_answers_while_generating(embedded_server):
    result = {}
    runner = threading.Thread(
        target=lambda: result.update(
            r=chat(embedded_server.url, {"message": "Tell me a story.", "max_tokens": 60})
        )
    )
    runner.start()
    assert wait_until(lambda: request(embedded_server.url, "GET", "/health").json()["busy"], 10)
    started = time.monotonic()
    health = request(embedded_server.url, "GET", "/health")
    assert time.monotonic() - started < 0.5
    assert health.status == 200 and health.json()["busy"] is True
    runner.join(60)
    assert result["r"].status == 200


def test_log_has_one_line_per_request_and_no_text(embedded_server):
    secret = "My secret code word is pineapple-zebra."
    reply = chat(embedded_server.url, {"message": secret, "max_tokens": 8})
    request_id = reply.json()["id"]
    assert wait_until(lambda: request_id in embedded_server.log(), 5)
    lines = [line for line in embedded_server.log().splitlines() if request_id in line]
    assert len(lines) == 1
    for field in ("status=200", "queued_ms=", "ttft_ms=", "completion_tokens=", "tokens_per_s="):
        assert field in lines[0]
    assert "pineapple" not in embedded_server.log()
    assert reply.json()["response"].strip()[:20] not in embedded_server.log()


# A PC with 384 MB of RAM (MemTotal): under four times the embedded model's 128 MB of int8
# weights, so auto serves 4-bit ones (inference/host/cpu.py, auto_weights).
SMALL_RAM = """import psutil

_measured = psutil.virtual_memory
psutil.virtual_memory = lambda: _measured()._replace(total=384 * 2**20)
"""


@pytest.mark.slow  # two servers converting 4-bit weights: ~3.5 min on 2 cores
def test_4_bit_weights_pinned_or_by_auto_on_a_small_pc_give_the_same_bits(
    start_server, embedded_server, tmp_path
):
    """--quantize int4-row (4-bit weights, opt-in) loads, answers, and /health names it with
    a digest of its own weights (not int8-row's: a fleet must not mix the two). auto on a PC
    whose RAM is too small for int8 rows serves the same 4-bit weights, bit for bit, and
    /health, /metrics and the log line say so."""
    from inference.native import build

    proc = start_server("--model", "embedded", "--quantize", "int4-row")
    health = request(proc.url, "GET", "/health").json()
    assert (health["cpu"]["quantize"], health["cpu"]["requested"]) == ("int4-row", "int4-row")
    assert health["decode_step"] == f"native {build.level(build.this_cpu())}"
    default = request(embedded_server.url, "GET", "/health").json()
    assert len(health["weights_sha256"]) == 64
    assert health["weights_sha256"] != default["weights_sha256"]
    reply = chat(proc.url, {"message": "What is the capital of Japan?", "max_tokens": 12})
    assert reply.status == 200 and "Tokyo" in reply.json()["response"]

    (tmp_path / "small-ram").mkdir()
    (tmp_path / "small-ram" / "sitecustomize.py").write_text(SMALL_RAM)
    path = os.pathsep.join(
        filter(None, [str(tmp_path / "small-ram"), os.environ.get("PYTHONPATH")])
    )
    small = start_server("--model", "embedded", env={"PYTHONPATH": path})
    shown = request(small.url, "GET", "/health").json()
    assert (shown["cpu"]["quantize"], shown["cpu"]["requested"]) == ("int4-row", "auto")
    assert shown["weights_sha256"] == health["weights_sha256"]
    assert served_weights(small.url) == "int4-row"
    assert "serving quantize=int4-row (auto: " in small.log()
    assert "int8-row's 128 MB of weights over 1/4 of 384 MB RAM)" in small.log()
