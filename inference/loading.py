"""Deciding which model to serve and loading it: ModelScope id, local folder, or embedded.

The fallback rule lives here: a ModelScope model that is neither cached nor downloadable is
replaced by the embedded model with one WARNING line, unless strict mode asks to fail.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from inference.config import EMBEDDED_MODEL, Config
from inference.embedded import EMBEDDED_NAME, embedded_model_dir

log = logging.getLogger("deskchat.loading")

Status = Callable[[str], None]


class ModelLoadError(RuntimeError):
    """The configured model cannot be served; the message says what to do."""


@dataclass(frozen=True)
class ModelChoice:
    path: Path
    name: str  # what /health and every answer report


def _looks_like_path(value: str) -> bool:
    return value.startswith(("/", ".", "~")) or os.path.isdir(value)


def choose_model(config: Config, status: Status) -> ModelChoice:
    """Find (or fetch) the folder of the model to serve, applying the fallback rule."""
    if config.model == EMBEDDED_MODEL:
        status("preparing the embedded model")
        return ModelChoice(embedded_model_dir(config.cache_dir), EMBEDDED_NAME)
    if _looks_like_path(config.model):
        path = Path(config.model).expanduser()
        if not (path / "config.json").is_file():
            raise ModelLoadError(
                f"--model {config.model}: not a Hugging Face model folder (no config.json there)"
            )
        return ModelChoice(path.resolve(), path.name)

    from inference.download import ModelUnavailable, fetch_modelscope_model

    status(f"fetching {config.model}@{config.revision} from ModelScope")
    try:
        path = fetch_modelscope_model(
            config.model,
            config.revision,
            config.cache_dir / "modelscope",
            endpoint=config.modelscope_endpoint,
            timeout_s=config.download_timeout,
        )
        return ModelChoice(path, config.model)
    except ModelUnavailable as exc:
        if config.strict_model:
            raise ModelLoadError(f"{exc} (strict model mode is on, so no fallback)") from None
        log.warning(
            "model %s unavailable (%s); serving the embedded %s instead",
            config.model,
            exc,
            EMBEDDED_NAME,
        )
        status("default model unavailable; preparing the embedded model")
        return ModelChoice(embedded_model_dir(config.cache_dir), EMBEDDED_NAME)


def eos_token_ids(model, tokenizer) -> set[int]:
    """Every id that ends an answer: the generation config's, the tokenizer's, <|im_end|>."""
    ids: set[int] = set()
    configured = model.generation_config.eos_token_id
    if configured is not None:
        ids.update(configured if isinstance(configured, list) else [configured])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    return ids


def load_model(choice: ModelChoice, config: Config, status: Status):
    """Load tokenizers and model from the chosen folder; returns (Engine, PromptBuilder)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from inference.engine import Engine
    from inference.prompt import PromptBuilder
    from inference.quantize import compute_dtype, load_quantized
    from inference.smooth import CALIBRATION_TEXT

    torch.set_num_threads(config.threads)
    status(f"loading {choice.name}")
    started = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(choice.path)
    if not tokenizer.chat_template:
        raise ModelLoadError(
            f"{choice.path} has no chat template: deskchat serves instruct "
            "(chat) models; use an -Instruct model folder"
        )
    prompt_tokenizer = AutoTokenizer.from_pretrained(choice.path)
    if config.quantize == "none":
        dtype = compute_dtype(config.quantize, config.dtype)
        model = AutoModelForCausalLM.from_pretrained(choice.path, dtype=dtype)
        model.eval()
    else:
        calibration = tokenizer(CALIBRATION_TEXT, return_tensors="pt")["input_ids"]
        model = load_quantized(choice.path, config.quantize, config.dtype, calibration)
    context = min(config.context_tokens, getattr(model.config, "max_position_embeddings", 2048))
    log.info(
        "loaded %s from %s in %.1f s (%d threads, context %d, quantize %s)",
        choice.name,
        choice.path,
        time.monotonic() - started,
        config.threads,
        context,
        config.quantize,
    )
    engine = Engine(
        model,
        tokenizer,
        choice.name,
        context,
        eos_token_ids(model, tokenizer),
        prefix_cache=config.prefix_cache,
    )
    return engine, PromptBuilder(prompt_tokenizer, context)
