"""The embedded model's cache: what an interrupted conversion leaves is cleaned up at start."""

from __future__ import annotations

import fcntl
import signal
import subprocess
import sys

from inference.embedded import EMBEDDED_NAME, embedded_model_dir, remove_abandoned_staging
from tests.conftest import ROOT
from tests.httpclient import wait_until


def staging_folders(cache):
    return list((cache / "embedded").glob(".convert-*"))


def test_staging_left_by_a_killed_conversion_is_removed_at_start(tmp_path):
    cache = tmp_path / "cache"
    converting = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from pathlib import Path; "
            "from inference.embedded import embedded_model_dir; "
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
