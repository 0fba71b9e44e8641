"""The engines the exactness tests of this folder share (tests/support/engines.py)."""

from __future__ import annotations

import pytest

from tests.support.engines import speculating_and_plain


@pytest.fixture(scope="module")
def engines(embedded_dir):
    """(speculating engine, plain engine on the same weights, prompt builder)."""
    return speculating_and_plain(embedded_dir)
