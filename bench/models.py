"""Which model folder a bench runs on: 'embedded' (SmolLM2-135M), 'qwen-shape' (the
Qwen2.5-0.5B shape with random weights, built once into the cache) or a folder given."""

from __future__ import annotations

from pathlib import Path


def resolve_model(spec: str, cache_dir: Path, fixture: str | None) -> Path:
    if spec == "embedded":
        from inference.loading.embedded import embedded_model_dir

        return embedded_model_dir(cache_dir)
    if spec == "qwen-shape":
        from bench.qwen_shape import fixture_dir, qwen_shape_dir

        return qwen_shape_dir(cache_dir, fixture_dir(fixture))
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        raise SystemExit(f"--model {spec}: not a Hugging Face model folder (no config.json)")
    return path
