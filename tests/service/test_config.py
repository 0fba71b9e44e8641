"""Settings: defaults <- DESKCHAT_* environment <- flags, declared once."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from service.config import Config, ConfigError, env_name, flag_name, load_config
from tests.support.paths import ROOT


def test_flags_beat_environment_beat_defaults():
    assert load_config([], environ={}).max_queue == 4
    assert load_config([], environ={"DESKCHAT_MAX_QUEUE": "7"}).max_queue == 7
    config = load_config(["--max-queue", "2"], environ={"DESKCHAT_MAX_QUEUE": "7"})
    assert config.max_queue == 2


def test_booleans_from_environment_and_flags():
    assert load_config([], environ={"DESKCHAT_STRICT_MODEL": "1"}).strict_model is True
    assert (
        load_config(["--no-strict-model"], environ={"DESKCHAT_STRICT_MODEL": "yes"}).strict_model
        is False
    )


@pytest.mark.parametrize(
    ("argv", "environ", "named"),
    [
        (["--max-queue", "zero"], {}, "--max-queue"),
        ([], {"DESKCHAT_PORT": "0"}, "DESKCHAT_PORT"),
        ([], {"DESKCHAT_STRICT_MODEL": "maybe"}, "DESKCHAT_STRICT_MODEL"),
        (["--max-queue", "4", "--http-threads", "5"], {}, "--http-threads"),
        (["--port", "70000"], {}, "--port"),
        ([], {"DESKCHAT_REQUEST_TIMEOUT": "inf"}, "DESKCHAT_REQUEST_TIMEOUT"),
        (["--log-level", "verbose"], {}, "--log-level"),
        (["--host", "300.1.2.3"], {}, "--host"),
        ([], {"DESKCHAT_HOST": ""}, "DESKCHAT_HOST"),
        (["--connection-limit", "0"], {}, "--connection-limit"),
    ],
)
def test_bad_values_name_their_source(argv, environ, named):
    with pytest.raises(ConfigError, match=named):
        load_config(argv, environ=environ)


def test_hosts_and_log_levels_that_are_fine():
    assert load_config(["--host", "::1"], environ={}).host == "::1"
    assert load_config(["--host", "localhost"], environ={}).host == "localhost"
    assert load_config(["--log-level", "debug"], environ={}).log_level == "DEBUG"


def test_help_and_readme_list_every_setting():
    help_text = subprocess.run(
        [sys.executable, "server.py", "--help"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    # The README and docs/ together: each variable by its topic in docs/operations.md.
    docs = "".join(p.read_text() for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
    for f in dataclasses.fields(Config):
        assert flag_name(f.name) in help_text and env_name(f.name) in help_text
        assert f"`{env_name(f.name)}`" in docs, f"the docs miss {env_name(f.name)}"
