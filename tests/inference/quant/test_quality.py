"""Quality guard: the optimized engine's greedy answers against fp32's, on the embedded model.

An answer must match fp32's token for token, or, at the first token where it differs, the
optimized engine's pick must be one fp32 itself nearly chose: fp32's logit for it is within
LOGIT_TOLERANCE of fp32's top logit (exp(2.0) = 7.4x in probability). That is where a
quantized model may legitimately go another way; a broken one picks tokens fp32 rates far
lower (before smoothing, int8 answered "Le Grand Baker" to the first question).
"""

from __future__ import annotations

import pytest
import torch

LOGIT_TOLERANCE = 2.0
# Mean KL(fp32 || int8) of the next-token distribution and top-1 agreement, teacher-forced
# on fp32's answers (llama.cpp's measure, issue 10). Measured on 7 questions: per-row int8
# 0.017 and 0.96, torch.ao int8 (one scale per forward) 0.19 and 0.83.
MAX_MEAN_KL = 0.05
MIN_TOP1_AGREEMENT = 0.92
# llama.cpp Q4_K_M of the same weights on bench/quality_texts (3549 positions), measured by
# `python -m bench.quality --peer llamacpp` (docs/speed.md): the served default must be no
# worse on either figure (issue 10). Its own: 0.0233 and 90.5% (0.0573 and 86.1% where a CPU
# without VNNI gets 7-bit rows); llama.cpp Q8_0 0.0055, 94.5%.
LLAMACPP_Q4_K_M_KL = 0.0721
LLAMACPP_Q4_K_M_TOP1 = 0.838
NEW_TOKENS = 24
CONTEXT = 512
QUESTIONS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "How many legs does a spider have?",
    "What is 12 plus 7?",
    "Name three primary colors.",
]


@pytest.fixture(scope="module")
def model_dir(embedded_dir):
    return embedded_dir


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def fp32_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def load_int8(model_dir, tokenizer, quantize: str, native=None):
    """The quantized model behind the forward the engine serves with (on the `native`
    library's step when given)."""
    from inference.loading.checkpoint import load_quantized
    from inference.model.decoder import Decoder
    from inference.quant.smooth import CALIBRATION_TEXT

    calibration = tokenizer(CALIBRATION_TEXT, return_tensors="pt")["input_ids"]
    model = load_quantized(model_dir, quantize, "auto", calibration, native)
    return Decoder(model, CONTEXT, native)


@pytest.fixture(scope="module", params=["int8", "int8-row"])
def int8_model(model_dir, tokenizer, request):
    """Both int8 paths: torch.ao's and the per-row one (the default where fbgemm runs)."""
    return load_int8(model_dir, tokenizer, request.param)


@pytest.fixture(scope="module")
def row_model(model_dir, tokenizer):
    return load_int8(model_dir, tokenizer, "int8-row")


@torch.inference_mode()
def greedy(model, ids: list[int], stop: set[int]) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy answer and its logits: through transformers' forward for the fp32 reference,
    through the served Decoder for the quantized models."""
    from transformers import DynamicCache

    from inference.model.decoder import Decoder, Segment

    served = isinstance(model, Decoder)
    cache = model.new_cache(CONTEXT) if served else DynamicCache(config=model.config)
    inputs, out, logits = list(ids), [], []
    for _ in range(NEW_TOKENS):
        if served:
            step = model.forward([Segment(cache, inputs)])[0]
        else:
            step = model(input_ids=torch.tensor([inputs]), cache=cache, logits_to_keep=1)
            step = step.logits[0, -1].float()
        token = int(step.argmax())
        out.append(token)
        logits.append(step)
        if token in stop:
            break
        inputs = [token]
    return out, logits


def prompt(tokenizer, question: str) -> list[int]:
    messages = [{"role": "user", "content": question}]
    encoded = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return list(encoded["input_ids"])


@pytest.fixture(scope="module")
def fp32_answers(tokenizer, fp32_model):
    """question -> (prompt ids, fp32's greedy answer, its logits at each answer token)."""
    stop = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
    out = {}
    for question in QUESTIONS:
        ids = prompt(tokenizer, question)
        out[question] = (ids, *greedy(fp32_model, ids, stop))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("question", QUESTIONS)
def test_int8_answers_match_fp32_or_differ_only_at_near_ties(
    question, tokenizer, fp32_answers, int8_model
):
    ids, want, want_logits = fp32_answers[question]
    stop = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
    got, _ = greedy(int8_model, ids, stop)
    if got == want:
        return
    k = next(i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b)
    fp32_logits = want_logits[k]
    behind = float(fp32_logits.max() - fp32_logits[got[k]])
    assert behind < LOGIT_TOLERANCE, (
        f"{question!r}: at token {k} int8 chose {tokenizer.decode([got[k]])!r}, which fp32 "
        f"rates {behind:.2f} logits below its {tokenizer.decode([want[k]])!r}; "
        f"fp32: {tokenizer.decode(want)!r}, int8: {tokenizer.decode(got)!r}"
    )


@torch.inference_mode()
def distance_from_fp32(fp32_answers, fp32_model, model) -> tuple[float, float]:
    """(mean KL(fp32 || model), top-1 agreement) of the next-token distribution over every
    answer token, each predicted from fp32's own past (teacher-forced)."""
    from inference.model.decoder import Segment

    kl, agree, count = 0.0, 0, 0
    for ids, answer, _ in fp32_answers.values():
        text = ids + answer[:-1]
        want = fp32_model(input_ids=torch.tensor([text])).logits[0, len(ids) - 1 :]
        want = want.float().log_softmax(-1)
        got = model.forward([Segment(model.new_cache(CONTEXT), text)], every_row=True)
        got = got[len(ids) - 1 :].log_softmax(-1)
        kl += float((want.exp() * (want - got)).sum())
        agree += int((want.argmax(-1) == got.argmax(-1)).sum())
        count += len(answer)
    return kl / count, agree / count


@pytest.mark.slow
def test_per_row_int8_next_token_distribution_stays_close_to_fp32(
    fp32_answers, fp32_model, row_model
):
    kl, top1 = distance_from_fp32(fp32_answers, fp32_model, row_model)
    if row_model.model.lm_head.limit == 127:  # 8-bit rows (VNNI): the bar measured for them
        assert kl < MAX_MEAN_KL, f"mean KL {kl:.4f}"
        assert top1 >= MIN_TOP1_AGREEMENT, f"top-1 agreement {top1:.3f}"
    else:
        # 7-bit rows, what a CPU without VNNI serves: 0.045 and 0.914 here (85 of these 93
        # tokens; on an AVX2 EPYC), below the 8-bit bar by design. Their promise is the
        # issue-10 gate: no worse than llama.cpp Q4_K_M.
        assert kl < LLAMACPP_Q4_K_M_KL, f"mean KL {kl:.4f} (7-bit rows)"
        assert top1 >= LLAMACPP_Q4_K_M_TOP1, f"top-1 agreement {top1:.3f} (7-bit rows)"


@pytest.mark.slow
def test_seven_bit_rows_stay_far_closer_to_fp32_than_torch_ao_int8(
    fp32_answers, fp32_model, model_dir, tokenizer, monkeypatch
):
    """What a CPU without VNNI serves (fbgemm would saturate 8-bit rows there): measured
    0.045 and 0.914 against torch.ao int8's 0.20 and 0.86 (these 5 answers, 93 tokens), which
    such CPUs served before."""
    from inference.quant import rowint8

    monkeypatch.setattr(rowint8, "row_limit", lambda: 63)
    seven = load_int8(model_dir, tokenizer, "int8-row")
    assert seven.model.lm_head.limit == 63
    kl, top1 = distance_from_fp32(fp32_answers, fp32_model, seven)
    ao_kl, ao_top1 = distance_from_fp32(
        fp32_answers, fp32_model, load_int8(model_dir, tokenizer, "int8")
    )
    assert kl < ao_kl / 2, f"7-bit rows: mean KL {kl:.4f}, torch.ao int8 {ao_kl:.4f}"
    assert top1 > ao_top1, f"7-bit rows: top-1 {top1:.3f}, torch.ao int8 {ao_top1:.3f}"


@pytest.mark.slow
def test_int8_knows_the_capital_of_japan(tokenizer, int8_model):
    # Not France: a near-tie in fp32 (tests/support/margins.py has the margins)
    ids = prompt(tokenizer, "What is the capital of Japan?")
    got, _ = greedy(int8_model, ids, {tokenizer.convert_tokens_to_ids("<|im_end|>")})
    assert "Tokyo" in tokenizer.decode(got)


@pytest.mark.slow
def test_tied_embedding_survives_quantizing_lm_head(fp32_model, int8_model):
    ids = torch.tensor([[1, 50, 500, 5000]])
    want = fp32_model.get_input_embeddings()(ids)
    got = int8_model.model.get_input_embeddings()(ids)
    assert got.dtype == torch.float32
    assert torch.equal(got, want)  # mapped from the checkpoint, not rounded
    assert not isinstance(int8_model.model.get_output_embeddings(), torch.nn.Linear)


def test_int4_linear_computes_the_dequantized_product():
    from inference.quant.int4 import GROUP_SIZE, Int4Linear

    torch.manual_seed(0)
    weight = torch.randn(96, 4 * GROUP_SIZE)
    layer = Int4Linear(weight, bias=torch.ones(96))
    grouped = weight.reshape(96, -1, GROUP_SIZE)
    low, high = grouped.amin(-1, keepdim=True), grouped.amax(-1, keepdim=True)
    scale = (high - low) / 15
    dequantized = (((grouped - low) / scale).round() * scale + low).reshape_as(weight)
    x = torch.randn(3, 4 * GROUP_SIZE)
    want = x @ dequantized.T + 1
    got = layer(x)
    assert got.shape == (3, 96) and got.dtype == torch.float32
    assert torch.allclose(got, want, atol=0.15, rtol=0.02)  # bf16 activations in the kernel


@pytest.mark.slow
def test_the_default_is_no_worse_than_llama_cpp_q4_k_m_on_the_text_set(
    model_dir, tokenizer, fp32_model, row_model
):
    """llama.cpp's own measure (llama-perplexity --kl-divergence) over English, Chinese and
    code: the served int8 rows against fp32, every position of 256-token chunks."""
    from bench.quality import decoder_logprobs, distance, fp32_logprobs, text_chunks

    chunks = text_chunks(tokenizer)
    assert sum(map(len, chunks)) > 3000
    got = distance(fp32_logprobs(fp32_model, chunks), decoder_logprobs(row_model, chunks))
    assert got["mean_kl"] <= LLAMACPP_Q4_K_M_KL, got
    assert got["top1"] >= LLAMACPP_Q4_K_M_TOP1, got


# int4-row (4-bit weights, int8 rows, the native step; unsmoothed, int8 lm_head) on these 5
# answers (93 tokens): mean KL 0.0484 and top-1 0.914 (85 of 93), measured 2026-12-02 on the
# AVX2 EPYC; every build gives the same bits. The bounds leave a quarter on KL and two tokens
# of top-1, no more: the symmetric 4-bit grid first tried was at 0.46 on the quality texts,
# smoothing or a 4-bit lm_head 0.13-0.2 (docs/native.md), a broken product far worse.
INT4_ROW_MAX_KL = 0.06
INT4_ROW_MIN_TOP1 = 0.89


def test_int4_row_next_token_distribution_stays_close_to_fp32(
    fp32_answers, fp32_model, model_dir, tokenizer
):
    from inference.native import build
    from inference.native.library import Library
    from tests.support.paths import TEST_CACHE

    library = Library(build.build(build.this_cpu(), TEST_CACHE / "native-builds"))
    model = load_int8(model_dir, tokenizer, "int4-row", library)
    assert model.native == library.isa
    kl, top1 = distance_from_fp32(fp32_answers, fp32_model, model)
    assert kl < INT4_ROW_MAX_KL, f"mean KL {kl:.4f}"
    assert top1 >= INT4_ROW_MIN_TOP1, f"top-1 agreement {top1:.3f}"
