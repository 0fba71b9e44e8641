"""Where things are: the checkout (ROOT) and the test cache of converted models."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Converted models are kept between runs so only the first run pays for the conversion.
TEST_CACHE = Path(os.environ.get("DESKCHAT_TEST_CACHE", ROOT / ".test-cache"))


def qwen_fixture() -> Path:
    """Qwen2.5-0.5B-Instruct's tokenizer and config (no weights), where the bench finds it
    ($DESKCHAT_QWEN_FIXTURE, else ../shared/fixtures next to the repo); read, never copied."""
    from bench.qwen_shape import fixture_dir

    return fixture_dir()
