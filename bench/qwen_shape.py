"""The Qwen2.5-Instruct shapes (0.5B, 1.5B, 3B) and the Qwen3 shapes (0.6B, 1.7B, 4B) with
random weights, built once into the cache.

Built from the shared fixtures (tokenizer, chat template and config of the real Qwen2.5-0.5B
and Qwen3-0.6B, no weights; see their NOTICE.md), never from files in this repository: the
fixtures stay where they are. The bigger shapes are the small one's config with the published
sizes of the bigger model put in (all tie their embeddings, as the small ones do), so a bench
can see how the gap to a peer moves with the model's size; same tokenizer, same seeded
random init.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

FIXTURE_ENV = "DESKCHAT_QWEN_FIXTURE"  # the Qwen2.5 fixture's folder
QWEN3_FIXTURE_ENV = "DESKCHAT_QWEN3_FIXTURE"  # the Qwen3 fixture's
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_FIXTURE = REPO_ROOT.parent / "shared" / "fixtures" / "qwen2.5-0.5b-instruct"
DEFAULT_QWEN3_FIXTURE = REPO_ROOT.parent / "shared" / "fixtures" / "qwen3-0.6b"
SEED = 0
_DONE_MARK = ".built"
# --model name -> what it changes in the fixture's (0.5B) config; the rest stays the fixture's.
SHAPES: dict[str, dict] = {
    "qwen-shape": {},
    "qwen-shape-1.5b": {
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
    },
    "qwen-shape-3b": {
        "hidden_size": 2048,
        "intermediate_size": 11008,
        "num_hidden_layers": 36,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
    },
    # Qwen3-1.7B's and -4B's published config.json (the 4B's rope_theta is the 2507 releases')
    "qwen3-shape": {},
    "qwen3-shape-1.7b": {
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
    },
    "qwen3-shape-4b": {
        "hidden_size": 2560,
        "intermediate_size": 9728,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5_000_000},
    },
}


class FixtureMissing(RuntimeError):
    """The Qwen shape fixture is not where the bench was told to look."""


def fixture_dir(given: str | None = None, shape: str = "qwen-shape") -> Path:
    """--fixture, else $DESKCHAT_QWEN_FIXTURE (a Qwen2.5 shape) or $DESKCHAT_QWEN3_FIXTURE (a
    Qwen3 shape), else ../shared/fixtures/... next to the repo."""
    if shape.startswith("qwen3"):
        default = os.environ.get(QWEN3_FIXTURE_ENV) or DEFAULT_QWEN3_FIXTURE
    else:
        default = os.environ.get(FIXTURE_ENV) or DEFAULT_FIXTURE
    return Path(given or default).expanduser()


def shape_config(fixture: Path, name: str = "qwen-shape"):
    """The fixture's config with the shape's sizes put in. Built anew from the dict, not
    overridden after loading: the per-layer lists (layer_types) must follow the layer count."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(fixture)
    if not SHAPES[name]:
        return config
    fields = config.to_dict()
    fields.pop("layer_types", None)
    fields.update(SHAPES[name])
    return type(config).from_dict(fields)


def qwen_shape_dir(cache_dir: Path, fixture: Path, name: str = "qwen-shape") -> Path:
    """The cached random-weight model folder of shape `name`, building it first if needed."""
    target = cache_dir / name
    if (target / _DONE_MARK).is_file():
        return target
    if not (fixture / "config.json").is_file():
        raise FixtureMissing(
            f"the {name} fixture is not at {fixture} (no config.json there); pass --fixture "
            f"DIR or set {QWEN3_FIXTURE_ENV if name.startswith('qwen3') else FIXTURE_ENV}"
        )
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        torch.manual_seed(SEED)
        config = shape_config(fixture, name)
        # bf16, as the real checkpoint is stored: same bytes on disk, same load path.
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(staging)
        del model
        AutoTokenizer.from_pretrained(fixture).save_pretrained(staging)
        GenerationConfig.from_pretrained(fixture).save_pretrained(staging)
        (staging / _DONE_MARK).write_text(f"{name}: seed {SEED} from {fixture}\n")
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
