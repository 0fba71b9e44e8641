"""Issue 63: a thinking model's thought kept apart from its answer, token by token, through
the accept stage (inference/runtime/accept.py, its ThoughtSplit): with a
real byte-level tokenizer that has `<think>` and `</think>` as tokens of their own (the
embedded model's, the two added as Qwen3's are), and the picks scripted by the scores."""

from __future__ import annotations

import pytest
import torch

from inference.runtime.accept import (
    TextAssembler,
    ThoughtSplit,
    TokenPieces,
    advance,
)
from inference.runtime.budget import answer_room, thought_limit
from inference.runtime.engine import Stream, think_markers
from inference.runtime.jobs import Sampling

EOS = -1  # set from the tokenizer


@pytest.fixture(scope="module")
def tokenizer(embedded_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(embedded_dir)
    tok.add_tokens(["<think>", "</think>"], special_tokens=False)  # as Qwen3's: not special
    return tok


def stream_for(tokenizer, prompt: list[int], budget: int = 200, **sampling) -> Stream:
    markers = think_markers(tokenizer)
    assert markers is not None
    split = ThoughtSplit(markers, prompt, budget, tokenizer, sampling.pop("most", None))
    sampling = Sampling(max_tokens=budget, **sampling)
    return Stream(prompt, sampling, TextAssembler(tokenizer, sampling.stop), None, False, split)


def run(tokenizer, stream: Stream, picks: list[int]) -> tuple[str, str, list[int]]:
    """Each pick made the scores' clear maximum in turn; (thought, answer, tokens taken)."""
    eos = {tokenizer.eos_token_id}
    pieces = TokenPieces(tokenizer)
    thought, answer, taken = [], [], []
    for pick in picks:
        if stream.finish is not None:
            break
        scores = torch.zeros(len(tokenizer))
        scores[pick] = 50.0
        taken.append(advance(stream, scores, eos, pieces))
        thought.append(stream.take_thought())
        answer.append(stream.take_text())
    return "".join(thought), "".join(answer), taken


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_the_thought_goes_apart_and_the_newlines_around_it_go(tokenizer):
    open_, close = think_markers(tokenizer)
    stream = stream_for(tokenizer, ids(tokenizer, "Question?"), logprobs=True)
    picks = [open_, *ids(tokenizer, "\nIt is a capital.\nParis.\n"), close]
    picks += ids(tokenizer, "\n\nThe answer is Paris.")
    thought, answer, _ = run(tokenizer, stream, picks)
    assert thought == "It is a capital.\nParis."
    assert answer == "The answer is Paris."
    entries = stream.take_logprobs()  # the answer's tokens only
    assert "".join(e.token for e in entries) == "\n\nThe answer is Paris."


def test_a_thought_reaching_its_limit_is_closed_by_the_server(tokenizer):
    open_, close = think_markers(tokenizer)
    budget = 40
    stream = stream_for(tokenizer, ids(tokenizer, "Question?"), budget=budget)
    [word] = ids(tokenizer, " the")
    thought, answer, taken = run(tokenizer, stream, [open_, *[word] * 100])
    limit = thought_limit(budget)
    assert limit == budget - answer_room(budget) - 2  # the close and the newlines count
    assert taken[limit + 1] == close and stream.split.cut  # the marker, its limit's thought
    assert thought.split() == ["the"] * limit
    assert answer == " the" * (len(taken) - limit - 2) and stream.finish == "length"
    assert len(taken) == budget  # the answer got its room: answer_room(40) tokens, and more


def test_thinking_budget_closes_earlier(tokenizer):
    open_, close = think_markers(tokenizer)
    stream = stream_for(tokenizer, ids(tokenizer, "Q"), budget=100, most=5)
    _, _, taken = run(tokenizer, stream, [open_, *ids(tokenizer, " a") * 20])
    assert taken[6] == close


@pytest.mark.parametrize(
    "tail, thinking, answering",
    [("", False, False), ("<think>\n", True, False), ("<think>\n\n</think>\n\n", False, True)],
    ids=["the model decides", "inside a thought", "an empty thought: off"],
)
def test_where_the_template_left_the_model(tokenizer, tail, thinking, answering):
    prompt = ids(tokenizer, "<|im_start|>assistant\n" + tail)
    split = stream_for(tokenizer, prompt).split
    assert (split.thinking, split.answering) == (thinking, answering)


def test_thinking_off_leaves_a_think_tag_in_the_answer_as_text(tokenizer):
    open_, _ = think_markers(tokenizer)
    stream = stream_for(tokenizer, ids(tokenizer, "<|im_start|>assistant\n<think>\n\n</think>\n\n"))
    thought, answer, _ = run(tokenizer, stream, [*ids(tokenizer, "Hi "), open_])
    assert thought == "" and answer == "Hi <think>"


def test_a_constrained_answer_opens_the_thought_first(tokenizer):
    open_, _ = think_markers(tokenizer)
    markers = think_markers(tokenizer)
    split = ThoughtSplit(markers, ids(tokenizer, "Q"), 100, tokenizer, constrained=True)
    assert split.forced() == open_
    assert split.take(open_) == (True, "") and split.forced() is None
    off = ThoughtSplit(markers, ids(tokenizer, "Q"), 100, tokenizer, constrained=True, think=False)
    assert off.forced() is None  # thinking off: no thought forced, whatever the template does


class Anything:
    """A constraint that allows every token (the test is of what a thought does with it)."""

    finished = False

    def mask_(self, scores):
        pass

    def take(self, token):
        pass


def test_the_end_of_text_inside_a_constrained_answers_thought_closes_it(tokenizer):
    open_, close = think_markers(tokenizer)
    stream = stream_for(tokenizer, ids(tokenizer, "Q"))
    stream.constraint = Anything()
    _, _, taken = run(tokenizer, stream, [open_, *ids(tokenizer, " a"), tokenizer.eos_token_id])
    assert taken[-1] == close and stream.finish is None  # the answer is still owed


# A template that renders the switch as Qwen3's does (its own text here): off, an empty
# thought closes the prompt; an earlier answer's thought is written before its content.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def test_the_switch_and_an_earlier_thought_reach_the_template(tokenizer):
    from inference.runtime.prompt import PromptBuilder

    templated = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    templated.add_tokens(["<think>", "</think>"], special_tokens=False)
    templated.chat_template = THINKING_TEMPLATE
    prompts = PromptBuilder(templated, 4096)
    assert prompts.thinks
    ask = [{"role": "user", "content": "Capital of France?"}]
    off, auto, on = (prompts.encode(ask, think=t) for t in (False, None, True))
    assert templated.decode(off).endswith("assistant\n<think>\n\n</think>\n\n")
    assert auto == on and templated.decode(on).endswith("assistant\n")
    history = [
        *ask,
        {"role": "assistant", "content": "Paris.", "reasoning_content": "<|im_start|>x"},
    ]
    rendered = templated.decode(prompts.encode([*history, *ask]))
    assert "<think>\n<|im_start|>x\n</think>\n\nParis." in rendered
    control = templated.convert_tokens_to_ids("<|im_start|>")
    assert prompts.encode([*history, *ask]).count(control) == 4  # the thought's own is text


@pytest.mark.parametrize("timeout_s, closed", [(100.0, False), (1.0, True)])
def test_a_thought_that_would_leave_its_answer_no_time_is_closed(tokenizer, timeout_s, closed):
    """At 50 ms a forward, the answer's room of 50 tokens needs 2.5 s (3.75 with the slack):
    a job with 1 s left closes its thought at the next token, one with 100 s goes on."""
    import threading
    import time

    from inference.runtime.batch import Batch, Running
    from inference.runtime.jobs import Job

    open_, close = think_markers(tokenizer)
    stream = stream_for(tokenizer, ids(tokenizer, "Q"), budget=200)
    run(tokenizer, stream, [open_, *ids(tokenizer, " hm")])
    assert stream.split.thinking and stream.split.forced() is None
    batch = Batch(threading.Condition())
    job = Job(stream.prompt_ids, stream.sampling, timeout_s=timeout_s)
    batch.entries.append(Running(job, stream, time.monotonic(), 0))

    class Paced:
        last_forward = (1, 0.05)

    batch.settle(Paced())
    assert (stream.split.forced() == close) is closed
