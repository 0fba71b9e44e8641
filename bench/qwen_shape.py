"""The Qwen2.5-0.5B-Instruct shape with random weights, built once into the cache.

Built from the shared fixture (tokenizer and config of the real model, no weights; see its
NOTICE.md), never from files in this repository: the fixture stays where it is.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

FIXTURE_ENV = "DESKCHAT_QWEN_FIXTURE"
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_FIXTURE = REPO_ROOT.parent / "shared" / "fixtures" / "qwen2.5-0.5b-instruct"
SEED = 0
_DONE_MARK = ".built"


class FixtureMissing(RuntimeError):
    """The Qwen shape fixture is not where the bench was told to look."""


def fixture_dir(given: str | None = None) -> Path:
    """--fixture, else $DESKCHAT_QWEN_FIXTURE, else ../shared/fixtures/... next to the repo."""
    return Path(given or os.environ.get(FIXTURE_ENV) or DEFAULT_FIXTURE).expanduser()


def qwen_shape_dir(cache_dir: Path, fixture: Path) -> Path:
    """The cached random-weight model folder, building it first if needed."""
    target = cache_dir / "qwen-shape"
    if (target / _DONE_MARK).is_file():
        return target
    if not (fixture / "config.json").is_file():
        raise FixtureMissing(
            f"the Qwen2.5-0.5B shape fixture is not at {fixture} (no config.json there); "
            f"pass --fixture DIR or set {FIXTURE_ENV}"
        )
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".qwen-shape-", dir=target.parent))
    try:
        torch.manual_seed(SEED)
        config = AutoConfig.from_pretrained(fixture)
        # bf16, as the real checkpoint is stored: same bytes on disk, same load path.
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(staging)
        del model
        AutoTokenizer.from_pretrained(fixture).save_pretrained(staging)
        GenerationConfig.from_pretrained(fixture).save_pretrained(staging)
        (staging / _DONE_MARK).write_text(f"seed {SEED} from {fixture}\n")
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
