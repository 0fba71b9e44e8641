"""Which model folder a bench runs on: 'embedded' (SmolLM2-135M), a Qwen shape ('qwen-shape'
for Qwen2.5-0.5B, 'qwen-shape-1.5b', 'qwen-shape-3b', 'qwen3-shape' for Qwen3-0.6B,
'qwen3-shape-1.7b', 'qwen3-shape-4b': random weights, built once into the cache) or a folder
given."""

from __future__ import annotations

from pathlib import Path

from bench.qwen_shape import SHAPES

MODEL_HELP = (
    "a model folder, 'embedded' (SmolLM2-135M) or a Qwen shape with random weights, built "
    "once into the cache: " + ", ".join(SHAPES) + " (Qwen2.5 0.5B, 1.5B, 3B; Qwen3 0.6B, "
    "1.7B, 4B)"
)


def resolve_model(spec: str, cache_dir: Path, fixture: str | None) -> Path:
    if spec == "embedded":
        from inference.loading.embedded import embedded_model_dir

        return embedded_model_dir(cache_dir)
    if spec in SHAPES:
        from bench.qwen_shape import fixture_dir, qwen_shape_dir

        return qwen_shape_dir(cache_dir, fixture_dir(fixture, spec), spec)
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        raise SystemExit(f"--model {spec}: not a Hugging Face model folder (no config.json)")
    return path
