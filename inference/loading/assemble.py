"""Deciding which model to serve and loading it: ModelScope id, local folder, or embedded.

The fallback rule lives here: a ModelScope model that is neither cached nor downloadable is
replaced by the embedded model with one WARNING line, unless strict mode asks to fail.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from inference.host.cpu import CpuUnsupported
from inference.loading.embedded import EMBEDDED_NAME, embedded_model_dir, remove_abandoned_staging
from inference.model.families import UnsupportedModel, family_of
from inference.runtime.jobs import SAMPLING_RANGES, SamplingDefaults
from service.config import EMBEDDED_MODEL, Config

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


def _folder_problem(path: Path) -> str | None:
    """Why `path` is not a loadable Hugging Face model folder, or None (checked before the
    slow load, so the common mistakes get a precise message)."""
    config = path / "config.json"
    if not config.is_file():
        return "no config.json there"
    try:
        parsed = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return f"its config.json is not readable JSON ({' '.join(str(exc).split())})"
    if not isinstance(parsed, dict):
        return "its config.json is not a JSON object"
    unserved = _unserved(parsed)
    if unserved is not None:
        return unserved
    weights = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json")
    if not any(next(path.glob(pattern), None) for pattern in weights):
        return "no weights in it (*.safetensors or pytorch_model*.bin)"
    return None


def _unserved(config: dict) -> str | None:
    """Why a config.json's model is not served (inference/model/families.py), or None:
    asked before anything is converted."""
    try:
        family_of(config.get("model_type"), config.get("architectures"))
    except UnsupportedModel as exc:
        return str(exc)
    return None


def _cache_problem(cache_dir: Path) -> str | None:
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        return "it is a file, not a folder"
    except NotADirectoryError:
        return "a part of that path is a file, not a folder"
    except OSError as exc:
        return f"it cannot be created ({exc.strerror or exc})"
    return None


def _embedded(cache_dir: Path) -> Path:
    try:
        return embedded_model_dir(cache_dir)
    except OSError as exc:
        raise ModelLoadError(
            f"cannot convert the embedded model into {cache_dir / 'embedded'}: "
            f"{exc.strerror or exc}; free some disk space or choose another --cache-dir"
        ) from None


def choose_model(config: Config, status: Status) -> ModelChoice:
    """Find (or fetch) the folder of the model to serve, applying the fallback rule."""
    if _looks_like_path(config.model):
        path = Path(config.model).expanduser()
        problem = _folder_problem(path)
        if problem is not None:
            raise ModelLoadError(
                f"--model {config.model}: not a usable Hugging Face model folder: {problem}; "
                "point --model at a complete model folder (config.json, tokenizer files, "
                "*.safetensors) or use --model embedded"
            )
        return ModelChoice(path.resolve(), path.name)
    problem = _cache_problem(config.cache_dir)
    if problem is not None:
        raise ModelLoadError(
            f"--cache-dir {config.cache_dir}: {problem}; choose another --cache-dir "
            "(DESKCHAT_CACHE_DIR) or move what is in the way"
        )
    remove_abandoned_staging(config.cache_dir)
    if config.model == EMBEDDED_MODEL:
        status("preparing the embedded model")
        return ModelChoice(_embedded(config.cache_dir), EMBEDDED_NAME)

    from inference.loading.download import ModelNotFound, ModelUnavailable, fetch_modelscope_model

    status(f"fetching {config.model}@{config.revision} from ModelScope")
    try:
        path = fetch_modelscope_model(
            config.model,
            config.revision,
            config.cache_dir / "modelscope",
            endpoint=config.modelscope_endpoint,
            timeout_s=config.download_timeout,
        )
        problem = _folder_problem(path)  # before anything is converted
        if problem is not None:
            raise ModelLoadError(f"--model {config.model}: {problem}")
        return ModelChoice(path, config.model)
    except ModelNotFound as exc:  # a mistake to fix, not a reason to serve another model
        raise ModelLoadError(str(exc)) from None
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
        return ModelChoice(_embedded(config.cache_dir), EMBEDDED_NAME)


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


# The generation_config.json keys vLLM takes as a model's sampling defaults; each must be in
# the range a request's own value must be in (SAMPLING_RANGES).
GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(folder: Path, policy: str) -> SamplingDefaults:
    """What requests that leave sampling fields out get: greedy, or with policy `model` the
    folder's generation_config.json read as vLLM reads it (each of GENERATION_KEYS it sets;
    top_k -1 or 0 is off), except that an explicit `do_sample: false` keeps temperature 0,
    as transformers' generate() does. A value out of range is skipped with a WARNING; a file
    that is missing or does not parse leaves greedy."""
    if policy == "greedy":
        return SamplingDefaults(source="greedy (--sampling-defaults greedy)")
    path = folder / "generation_config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raw = {}
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        log.warning("%s is not readable JSON (%s); sampling defaults: greedy", path, exc)
        raw = {}
    values = {}
    for key in GENERATION_KEYS:
        value = raw.get(key) if isinstance(raw, dict) else None
        if value is None:
            continue
        allowed = SAMPLING_RANGES[key]
        number = isinstance(value, int if allowed.integer else int | float)
        if not number or isinstance(value, bool) or not allowed.holds(value):
            log.warning("%s: %s %r is out of range; not used as a default", path, key, value)
            continue
        values[key] = max(value, 0) if key == "top_k" else float(value)
    if isinstance(raw, dict) and raw.get("do_sample") is False:
        values.pop("temperature", None)
    if not values:
        return SamplingDefaults(source="greedy (the model's generation_config.json sets none)")
    defaults = SamplingDefaults(**values, source="generation_config.json")
    log.info("sampling defaults from %s: %s", path, defaults.values())
    return defaults


def load_model(choice: ModelChoice, config: Config, status: Status, on_tokenizer=None, plan=None):
    """Load the tokenizer (one, shared by handlers and worker) and the model from the chosen
    folder, as `plan` says (made by `plan_for(config)` when not given); returns (Engine,
    PromptBuilder). `on_tokenizer(tokenizer, vocab_size)` runs
    between the two: what is built from the tokenizer alone (the grammar tables) peaks
    before the weights are in memory, not on top of them. Whatever keeps the folder from
    loading is a ModelLoadError of one line."""
    try:
        return _load_model(choice, config, plan or plan_for(config), status, on_tokenizer)
    except (ModelLoadError, CpuUnsupported):
        raise
    except Exception as exc:  # transformers, safetensors and torch each raise their own
        log.debug("loading %s failed", choice.path, exc_info=exc)
        detail = " ".join(str(exc).split())[:300]
        raise ModelLoadError(
            f"cannot load the model in {choice.path} ({type(exc).__name__}: {detail}); "
            "check that the folder holds a complete Hugging Face model, or use --model "
            "embedded"
        ) from None


def plan_for(config: Config):
    """The execution plan (inference/host/cpu.py's Plan): this CPU's paths, the weights'
    format and which step serves, with the native decode step's library for this CPU
    (inference/native) unless --native is off or there is no compiler (then one WARNING
    line). The server makes it once at start; raises CpuUnsupported."""
    from inference.host import cpu
    from inference.native import build, library

    lib = None
    if config.native:
        facts = cpu.detect()
        levels = tuple(build.runnable(cpu.choose(facts).isa, facts.flags))
        lib = library.load(levels, Path(config.cache_dir) / "native")
    return cpu.plan_here(config.quantize, config.int8_engine, lib)


def model_size(folder: Path):
    """The model's size (inference/host/cpu.py's ModelSize) from its config.json, for
    auto's choice between int8 and 4-bit weights: cheap, no weight is read. None when the
    config lacks a decoder's usual sizes."""
    from transformers import AutoConfig

    from inference.host import cpu
    from inference.loading.checkpoint import layerwise
    from inference.quant.rowint4 import BLOCK

    config = AutoConfig.from_pretrained(folder)
    try:
        hidden, inner = config.hidden_size, config.intermediate_size
        heads, layers = config.num_attention_heads, config.num_hidden_layers
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        attention = hidden * head_dim * 2 * (heads + kv_heads)  # q and o; k and v
        linears = layers * (attention + 3 * hidden * inner) + config.vocab_size * hidden
    except (AttributeError, TypeError):
        return None
    # int8 rows keep the lm_head (tied or not) as its own int8 Linear; the embedding table
    # is mapped from the checkpoint's file (inference/quant/embedding.py).
    tied = getattr(config, "tie_word_embeddings", False)
    params = linears + (0 if tied else config.vocab_size * hidden)
    four_bit = layerwise(folder, config) and all(
        k % BLOCK == 0 for k in (hidden, heads * head_dim, inner)
    )
    return cpu.ModelSize(params, linears, four_bit)


def _load_model(choice: ModelChoice, config: Config, plan, status: Status, on_tokenizer):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from inference.host import cpu, heap
    from inference.loading.checkpoint import compute_dtype, load_quantized
    from inference.quant.smooth import CALIBRATION_TEXT
    from inference.runtime.engine import Engine
    from inference.runtime.prompt import PromptBuilder, read_only, shed_build_copies

    torch.set_num_threads(config.threads)
    plan = plan.for_model(model_size(choice.path), cpu.ram_bytes())
    fell_back = plan.quantize != plan.requested and plan.requested != cpu.DEFAULT_QUANTIZE
    (log.warning if fell_back else log.info)("%s", plan.summary())
    cpu.use(plan)
    quantize = plan.quantize
    status(f"loading {choice.name}")
    started = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(choice.path)
    if not tokenizer.chat_template:
        raise ModelLoadError(
            f"{choice.path} has no chat template: deskchat serves instruct "
            "(chat) models; use an -Instruct model folder"
        )
    read_only(tokenizer)
    shed_build_copies(tokenizer)
    if on_tokenizer is not None:
        on_tokenizer(tokenizer, AutoConfig.from_pretrained(choice.path).vocab_size)
        heap.trim()  # what it built and freed goes back before the weights come
    if quantize == "none":
        dtype = compute_dtype(quantize, config.dtype)
        model = AutoModelForCausalLM.from_pretrained(choice.path, dtype=dtype)
        model.eval()
    else:
        calibration = tokenizer(CALIBRATION_TEXT, return_tensors="pt")["input_ids"]
        load = functools.partial(
            load_quantized, choice.path, dtype=config.dtype, calibration_ids=calibration,
            native=plan.native, hf_forward=False,
        )  # fmt: skip
        try:
            model = load(quantize)
        except ValueError as exc:
            # auto's rule reads config.json only; the load finds what int4-row cannot take
            # (a layer or an embedding not Llama-style), where int8 rows still serve.
            if plan.requested != cpu.DEFAULT_QUANTIZE or quantize != "int4-row":
                raise
            plan = plan.int8_rows(str(exc))
            log.warning("%s: %s; auto serves int8-row instead", choice.name, exc)
            quantize = plan.quantize
            heap.trim()
            model = load(quantize)
    context = min(config.context_tokens, getattr(model.config, "max_position_embeddings", 2048))
    log.info(
        "loaded %s from %s in %.1f s (%d threads, context %d, quantize %s)",
        choice.name,
        choice.path,
        time.monotonic() - started,
        config.threads,
        context,
        quantize,
    )
    engine = Engine(
        model,
        tokenizer,
        choice.name,
        context,
        eos_token_ids(model, tokenizer),
        prefix_cache_bytes=config.prefix_cache_mb * 2**20 if config.prefix_cache else 0,
        speculate=config.speculate,
        native=plan.native,
    )
    if plan.native is not None and engine.decoder.native is None:
        log.warning("the native step cannot run %s's layers: torch's step serves", choice.name)
        plan = plan.on_torch()
    engine.plan = plan  # the plan that serves, for /health and /metrics
    log.info("decode step: %s", engine.decode_step)
    return engine, PromptBuilder(tokenizer, context, config.max_prompt_tokens)
