"""The embedded model's cache: what an interrupted conversion leaves is cleaned up at start."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from inference.loading.embedded import EMBEDDED_NAME, embedded_model_dir, remove_abandoned_staging
from tests.support.httpclient import wait_until
from tests.support.paths import ROOT


def staging_folders(cache):
    return list((cache / "embedded").glob(".convert-*"))


def test_staging_left_by_a_killed_conversion_is_removed_at_start(tmp_path):
    cache = tmp_path / "cache"
    converting = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from pathlib import Path; "
            "from inference.loading.embedded import embedded_model_dir; "
            "embedded_model_dir(Path(sys.argv[1]))",
            str(cache),
        ],
        cwd=ROOT,
    )
    try:
        assert wait_until(lambda: staging_folders(cache), 60, interval=0.02)
    finally:
        converting.send_signal(signal.SIGKILL)
        converting.wait(10)
    assert staging_folders(cache)  # kill -9: nothing of the process cleaned up after it

    # The next start: (a converted copy is there by now, so this test converts nothing)
    done = cache / "embedded" / EMBEDDED_NAME
    done.mkdir()
    (done / ".converted").write_text("x\n")
    assert embedded_model_dir(cache) == done
    assert staging_folders(cache) == []


def test_a_conversion_in_progress_keeps_its_staging_folder(tmp_path):
    cache = tmp_path / "cache"
    (cache / "embedded" / ".convert-live").mkdir(parents=True)
    with open(cache / "embedded" / ".convert.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # as a converting process holds it
        remove_abandoned_staging(cache)
        assert staging_folders(cache)
    remove_abandoned_staging(cache)  # its holder is gone: the folder is a leftover
    assert staging_folders(cache) == []


@pytest.fixture
def fake_conversion(monkeypatch):
    """The GGUF conversion replaced by a small one (a real one takes 17 s): a config and a
    real safetensors file. Returns the list of folders converted into."""
    import inference.loading.embedded as embedded

    converted = []

    def convert(_gguf, out):
        converted.append(out)
        (out / "config.json").write_text('{"model_type": "llama"}')
        save_file({"w": torch.arange(1000, dtype=torch.float32)}, str(out / "model.safetensors"))

    monkeypatch.setattr(embedded, "_convert", convert)
    return converted


def damage_truncate(folder):
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])


def damage_same_size(folder):
    (folder / "config.json").write_text('{"model_type": "LLAMA"}')


def damage_delete(folder):
    (folder / "config.json").unlink()


@pytest.mark.parametrize("damage", [damage_truncate, damage_same_size, damage_delete])
def test_a_damaged_conversion_is_converted_again(tmp_path, fake_conversion, damage, caplog):
    folder = embedded_model_dir(tmp_path)
    assert embedded_model_dir(tmp_path) == folder and len(fake_conversion) == 1
    damage(folder)
    assert embedded_model_dir(tmp_path) == folder
    assert len(fake_conversion) == 2
    assert "damaged" in caplog.text
    assert embedded_model_dir(tmp_path) == folder and len(fake_conversion) == 2


def test_a_touched_but_unchanged_conversion_is_kept(tmp_path, fake_conversion):
    folder = embedded_model_dir(tmp_path)
    os.utime(folder / "model.safetensors", (1, 1))
    assert embedded_model_dir(tmp_path) == folder
    assert len(fake_conversion) == 1
    mark = json.loads((folder / ".converted").read_text())
    assert mark["files"]["model.safetensors"]["mtime_ns"] == 1_000_000_000  # recorded anew


def test_a_mark_from_before_the_records_is_adopted_unless_the_weights_are_cut(
    tmp_path, fake_conversion
):
    folder = embedded_model_dir(tmp_path)
    (folder / ".converted").write_text("SmolLM2-135M-Instruct.Q4_1.gguf\n")  # the old mark
    assert embedded_model_dir(tmp_path) == folder and len(fake_conversion) == 1
    assert "sha256" in (folder / ".converted").read_text()
    (folder / ".converted").write_text("SmolLM2-135M-Instruct.Q4_1.gguf\n")
    damage_truncate(folder)  # caught by the safetensors header, with no records at all
    assert embedded_model_dir(tmp_path) == folder and len(fake_conversion) == 2
