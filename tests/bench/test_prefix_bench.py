"""`--prefix --llama-server`: the whole run with both deskchat settings in-process (the
scripted engine) and a stand-in llama-server started as llama-server is (its fake tree's
converter, quantizer and server): the same /v1 stream to both, (a) and (b) on all three,
the ratios, the memory line and the table (no timing asserts, no model)."""

from __future__ import annotations

import json
import math
import os
import random
import shutil
from types import SimpleNamespace

import pytest

from bench.serving import prefix
from tests.support.fakes import FakeEngine, FakeGrammars
from tests.support.llama_tree import fake_llama_tree
from tests.support.paths import qwen_fixture


@pytest.fixture
def in_process_deskchat(fake_server):
    """prefix.Server's stand-in: the scripted engine behind the real app, each setting's
    flags given to its config; `started` lists those flags. A stopped one refuses every
    request after (the real one would be gone)."""
    started: list[tuple[str, ...]] = []

    class InProcess:
        def __init__(self, model, cache_dir, setting, log_dir):
            started.append(setting.flags)
            self.inner = fake_server(FakeEngine(token_s=0.001), *setting.flags)
            self.inner.runtime.grammars = FakeGrammars()  # tools are compiled, not run
            self.url = self.inner.url
            self.proc = SimpleNamespace(pid=os.getpid())

        def wait_ready(self, timeout):
            pass

        def tail(self) -> str:
            return ""

        def stop(self):  # fake_server closes it; here it only stops answering
            self.inner.runtime.worker = None

    return InProcess, started


def test_prefix_runs_a_and_b_on_llama_server_through_the_same_stream(
    tmp_path, monkeypatch, in_process_deskchat, embedded_dir
):
    fake, started = in_process_deskchat
    monkeypatch.setattr(prefix, "Server", fake)
    server = fake_llama_tree(tmp_path / "llama.cpp")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    shutil.copy(embedded_dir / "tokenizer.json", model)  # for --word-answers
    asked: list[tuple[str, str]] = []  # (url, last message) of every request, in order
    ask = prefix.ask

    def recorded(url, messages, max_tokens, **fields):
        asked.append((url, messages[-1]["content"]))
        return ask(url, messages, max_tokens, **fields)

    monkeypatch.setattr(prefix, "ask", recorded)
    args = prefix.build_parser().parse_args(
        [
            *("--model", str(model), "--cache-dir", str(tmp_path / "cache")),
            *("--llama-server", str(server), "--prefix-cache-mb", "64"),
            *("--questions", "3", "--exchanges", "2", "--chats", "2", "--max-tokens", "4"),
            *("--rounds", "2", "--fresh-tokens", "3", "--word-answers"),
        ]
    )
    report = prefix.run(args, log=lambda _t: None)

    assert started == [("--prefix-cache-mb", "64"), ("--no-prefix-cache",)]
    assert report["flags"][prefix.LLAMA][1:] == ["-t", "2", "-np", "4", "-c", "8192"]
    settings = report["settings"]
    assert list(settings) == [prefix.DESKCHAT_ON, prefix.DESKCHAT_OFF, prefix.LLAMA]
    assert "fresh" not in settings[prefix.LLAMA]  # (c) is deskchat's own on / off question
    assert all(
        "error" not in settings[n]["fresh"] for n in (prefix.DESKCHAT_ON, prefix.DESKCHAT_OFF)
    )
    # (c) after both ran (a) and (b): each prompt on one server then the other, the order
    # turned each round, each round's prompts its own
    on_url, off_url, _ = dict.fromkeys(url for url, _ in asked)  # in order: on, off, llama
    fresh = [(url, text) for url, text in asked if text.endswith(tuple(prefix.FRESH))]
    first_round = [(u, f"1. {q}") for q in prefix.FRESH for u in (on_url, off_url)]
    second_round = [(u, f"2. {q}") for q in prefix.FRESH for u in (off_url, on_url)]
    assert fresh == first_round + second_round
    start = asked.index(fresh[0])
    assert asked[start : start + len(fresh)] == fresh  # one stretch,
    assert asked[start - 1][0] == off_url  # right after the off server's (b): both up
    for name in (prefix.DESKCHAT_ON, prefix.DESKCHAT_OFF):
        assert len(settings[name]["fresh"]["tokens_per_s"]) == 2 * len(prefix.FRESH)
    assert set(report["fresh_on_over_off"]) == {"ttft_ms", "tokens_per_s"}
    for name, results in settings.items():
        tool, chat = results["one_tool"], results["conversation"]
        assert "error" not in tool and "error" not in chat, name
        assert len(tool["ttft_ms"]) == 3 and len(chat["ttft_ms"]) == 2
        assert [c["completion_tokens"] for c in chat["chats"]] == [[4, 4]] * 2  # their usage
        for i, ttft in enumerate(chat["ttft_ms"]):  # each exchange's median over the chats
            assert ttft == pytest.approx(sum(c["ttft_ms"][i] for c in chat["chats"]) / 2, abs=0.1)
        assert math.isfinite(results["vmhwm_mb"]) and results["vmhwm_mb"] > 0
    # what each server computed: llama-server's timings; neither fake has deskchat's cache
    assert (
        settings[prefix.LLAMA]["one_tool"]["computed_tokens"]
        == (settings[prefix.LLAMA]["one_tool"]["prompt_tokens"])
    )
    assert settings[prefix.DESKCHAT_OFF]["one_tool"]["computed_tokens"] == [None] * 3
    llama_chat = settings[prefix.LLAMA]["conversation"]["chats"][0]["prompt_tokens"]
    assert llama_chat[1] > llama_chat[0]  # the history resent (the fake counts its characters)

    # llama-server got the bodies deskchat got: streamed /v1, greedy, (a) with the tools
    # in OpenAI's shape, (b) with its own answers in the history
    sent = [json.loads(line) for line in (server.parent.parent.parent / "requests.log").open()]
    assert {r["path"] for r in sent} == {"/v1/chat/completions"}
    assert all(r["body"]["stream"] and r["body"]["temperature"] == 0 for r in sent)
    warm, *tool, first, second, other, _ = sent
    assert "tools" not in warm["body"] and len(tool) == 3
    words = prefix.word_bias(model)
    assert report["word_answers"] and len(words) == prefix.WORDS
    assert all(r["body"]["logit_bias"] == words for r in (first, second, other))
    assert all("logit_bias" not in r["body"] for r in (warm, *tool))  # (b)'s answers only
    assert all(r["body"]["tools"] == prefix.TOOLS for r in tool)
    assert tool[0]["body"]["tools"][0]["type"] == "function"
    assert [m["role"] for m in second["body"]["messages"]] == ["user", "assistant", "user"]
    assert second["body"]["messages"][1]["content"] == "w0 w1 w2 w3 "
    # each chat another team's, so none finds another's turns in a cache
    assert "accounts team" in first["body"]["messages"][0]["content"]
    assert "sales team" in other["body"]["messages"][0]["content"]

    assert set(report["ratios"]) == {
        "one_tool.first_ttft_ms",
        "one_tool.rest_ttft_ms_median",
        "conversation.first_ttft_ms",
        "conversation.rest_ttft_ms_median",
        "conversation.last_ttft_ms",
        "vmhwm_mb",
    }
    table = prefix.format_table(report)
    rows = {line.split(" | ")[0]: line for line in table.splitlines() if line.startswith("| (")}
    assert "| (a) one tool: median of questions 2-3" in rows
    assert rows["| (b) chat: exchange 2"].endswith("x |")  # the ratio column filled
    assert rows["| (c) fresh prompts: first"].endswith("|  |")  # not run on llama-server
    assert "(c), cache on / off, each prompt against its pair (medians): TTFT" in table
    header, *body = [line for line in table.splitlines() if line.startswith("|")]
    assert all(line.count("|") == header.count("|") for line in body)  # every row whole


def test_ratios_are_deskchat_with_its_cache_over_llama_server():
    def side(first: float, rest: float, memory: float) -> dict:
        summary = {"first_ttft_ms": first, "rest_ttft_ms_median": rest, "last_ttft_ms": rest}
        return {"one_tool": summary, "conversation": summary, "vmhwm_mb": memory}

    settings = {
        prefix.DESKCHAT_ON: side(1000.0, 100.0, 1200.0),
        prefix.DESKCHAT_OFF: side(1000.0, 1000.0, 1100.0),
        prefix.LLAMA: {**side(2000.0, 400.0, 600.0), "conversation": {"error": "HTTP 500"}},
    }
    assert prefix.ratios(settings) == {
        "one_tool.first_ttft_ms": 0.5,
        "one_tool.rest_ttft_ms_median": 0.25,
        "vmhwm_mb": 2.0,
    }  # a failed workload has no ratio


@pytest.mark.parametrize("tokenizer_of", ["embedded", "qwen fixture"])
def test_word_answers_read_back_as_the_tokens_written(tmp_path, embedded_dir, tokenizer_of):
    """What --word-answers is for: any sequence of its raised tokens, decoded and encoded
    again (as a resent answer is), gives the same ids; on the Qwen shapes' tokenizer (where
    the bench uses it, saved as bench/qwen_shape.py saves it) and the embedded model's."""
    from tokenizers import Tokenizer

    folder = embedded_dir
    if tokenizer_of == "qwen fixture":
        from transformers import AutoTokenizer

        if not (qwen_fixture() / "vocab.json").is_file():
            pytest.skip(f"no Qwen2.5 fixture at {qwen_fixture()}")
        AutoTokenizer.from_pretrained(qwen_fixture()).save_pretrained(tmp_path)
        folder = tmp_path
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    bias = prefix.word_bias(folder)
    words = [int(i) for i in bias]
    assert len(words) == prefix.WORDS and set(bias.values()) == {100}
    rng = random.Random(0)
    for _ in range(200):
        answer = rng.choices(words, k=32)
        text = tokenizer.decode(answer)
        assert text.startswith(" ") and text.replace(" ", "").isalpha()
        assert tokenizer.encode(text, add_special_tokens=False).ids == answer


def test_word_answers_refuse_a_vocabulary_without_such_words(tmp_path, embedded_dir):
    """A tokenizer whose words are not "Ġword" (SentencePiece's "▁word") must not send an
    empty bias while the report says the answers were words."""
    vocabulary = json.loads((embedded_dir / "tokenizer.json").read_text())
    vocab = vocabulary["model"]["vocab"]
    vocabulary["model"]["vocab"] = {k.replace("Ġ", "▁"): v for k, v in vocab.items()}
    vocabulary["model"]["merges"] = []
    (tmp_path / "tokenizer.json").write_text(json.dumps(vocabulary))
    with pytest.raises(SystemExit, match="--no-word-answers"):
        prefix.word_bias(tmp_path)


def test_paired_ratios_are_medians_over_the_pairs_both_sides_have():
    ours = {"ttft_ms": [10.0, 20.0, 30.0], "tokens_per_s": [90.0, None, 110.0]}
    theirs = {"ttft_ms": [20.0, 20.0, 20.0], "tokens_per_s": [100.0, 100.0, None]}
    assert prefix.paired_ratios(ours, theirs) == {"ttft_ms": 1.0, "tokens_per_s": 0.9}
    none = {"ttft_ms": [10.0], "tokens_per_s": [None]}  # no answer long enough to time
    assert prefix.paired_ratios(none, none) == {"ttft_ms": 1.0, "tokens_per_s": None}
    assert prefix.paired_ratios({"error": "HTTP 500"}, theirs) == {}


def test_smoke_counts_are_bounded():
    with pytest.raises(SystemExit):
        prefix.build_parser().parse_args(["--questions", "1"])  # no median of 2-N
    with pytest.raises(SystemExit):
        prefix.build_parser().parse_args(["--rounds", "3"])  # each side first as often
    with pytest.raises(SystemExit):
        prefix.build_parser().parse_args(["--fresh-tokens", "1"])  # no rate from one token
