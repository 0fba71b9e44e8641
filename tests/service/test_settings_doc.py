"""docs/settings.md is what `python -m service.settings_doc` writes from service/config.py."""

from __future__ import annotations

import dataclasses
import difflib

import pytest

from service import settings_doc
from service.config import Config, env_name, flag_name


def test_committed_settings_doc_is_what_the_script_writes():
    committed = settings_doc.DOC_PATH.read_text(encoding="utf-8")
    expected = settings_doc.render()
    diff = "".join(
        difflib.unified_diff(
            committed.splitlines(keepends=True),
            expected.splitlines(keepends=True),
            "docs/settings.md (committed)",
            "docs/settings.md (from service/config.py)",
        )
    )
    if diff:
        pytest.fail(f"run `{settings_doc.COMMAND}` and commit docs/settings.md:\n{diff}")


def test_every_setting_has_a_row():
    rows = [line for line in settings_doc.render().splitlines() if line.startswith("| `--")]
    fields = dataclasses.fields(Config)
    assert len(rows) == len(fields)
    for row, f in zip(rows, fields, strict=True):
        assert row.startswith(f"| `{flag_name(f.name)}") and f"`{env_name(f.name)}`" in row


def test_the_doc_does_not_depend_on_this_pc(monkeypatch):
    """Computed defaults (threads, cache dir) show their description, not this PC's value."""
    first = settings_doc.render()
    monkeypatch.setenv("XDG_CACHE_HOME", "/elsewhere")
    monkeypatch.setattr("psutil.cpu_count", lambda logical=True: 97)
    second = settings_doc.render()
    assert first == second and "/elsewhere" not in second and "97" not in second


def test_check_fails_on_a_stale_file_and_writes_nothing(tmp_path, capsys):
    doc = tmp_path / "settings.md"
    assert settings_doc.main([], path=doc) == 0
    assert settings_doc.main(["--check"], path=doc) == 0
    doc.write_text(doc.read_text().replace("TCP port", "The TCP port"))
    stale = doc.read_text()
    assert settings_doc.main(["--check"], path=doc) == 1
    assert doc.read_text() == stale
    err = capsys.readouterr().err
    assert "-| `--port INT` | `DESKCHAT_PORT` | `8080` | from 1 to 65535 | The TCP port" in err
    assert settings_doc.COMMAND in err
