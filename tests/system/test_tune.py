"""system/tune.sh against fake kernel trees: apply, status, revert, dry-run, failures."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.systree import (
    CPU,
    SYSTEM,
    THP,
    make_tree,
    run,
    skip_unless_ci,
    snapshot,
    status_lines,
    tune,
    unprivileged,
)

SAVE = "run/deskchat/tune"
KNOBS_ON = [
    "governor",
    "energy_performance_preference",
    "intel_pstate_min_perf_pct",
    "vm.swappiness",
    "thp_enabled",
    "thp_defrag",
]


def read(root: Path, rel: str) -> str:
    return (root / rel).read_text().strip()


def test_apply_status_revert_restores_tree_byte_for_byte(tmp_path: Path) -> None:
    root = make_tree(tmp_path)
    before = snapshot(root)
    first = tune(root, "status")
    assert first.returncode == 1, first.stdout
    assert status_lines(root)["vm.swappiness"] == "differs: have 60, want 10"

    applied = tune(root, "apply")
    assert applied.returncode == 0, applied.stderr
    assert read(root, f"{CPU}/cpu3/cpufreq/scaling_governor") == "performance"
    assert read(root, f"{CPU}/cpu0/cpufreq/energy_performance_preference") == "performance"
    assert read(root, f"{CPU}/intel_pstate/min_perf_pct") == "100"
    assert read(root, "proc/sys/vm/swappiness") == "10"
    assert read(root, f"{THP}/enabled") == "madvise"
    assert read(root, f"{SAVE}/proc/sys/vm/swappiness") == "60"
    # defrag already was madvise: nothing written, nothing saved.
    assert not (root / SAVE / THP / "defrag").exists()

    status = tune(root, "status")
    assert status.returncode == 0, status.stdout
    lines = status_lines(root)
    assert all(lines[k] == "ok" for k in KNOBS_ON), lines
    assert lines["vm.nr_hugepages"].startswith("off")

    reverted = tune(root, "revert")
    assert reverted.returncode == 0, reverted.stderr
    assert snapshot(root) == before


def test_vm_without_cpufreq_reports_and_skips(tmp_path: Path) -> None:
    root = make_tree(tmp_path, cpufreq=False)
    before = snapshot(root)
    applied = tune(root, "apply")
    assert applied.returncode == 0, applied.stderr
    assert "governor: not available" in applied.stdout
    lines = status_lines(root)
    assert lines["governor"] == "not available"
    assert lines["intel_pstate_min_perf_pct"] == "not available"
    assert lines["vm.swappiness"] == "ok"
    assert tune(root, "status").returncode == 0
    assert tune(root, "revert").returncode == 0
    assert snapshot(root) == before


def test_second_apply_keeps_the_true_originals(tmp_path: Path) -> None:
    root = make_tree(tmp_path)
    before = snapshot(root)
    assert tune(root, "apply").returncode == 0
    saved = snapshot(root / SAVE)
    second = tune(root, "apply")
    assert second.returncode == 0, second.stderr
    assert "set " not in second.stdout  # nothing left to change
    assert snapshot(root / SAVE) == saved
    # Something else moves a knob; applying again fixes it but keeps the first original.
    (root / "proc/sys/vm/swappiness").write_text("30\n")
    third = tune(root, "apply")
    assert "swappiness = 10 (was 30)" in third.stdout
    assert snapshot(root / SAVE) == saved
    assert tune(root, "revert").returncode == 0
    assert snapshot(root) == before


@pytest.mark.parametrize("action", ["apply", "revert"])
def test_dry_run_writes_nothing(tmp_path: Path, action: str) -> None:
    root = make_tree(tmp_path)
    if action == "revert":
        assert tune(root, "apply").returncode == 0
    before = snapshot(root)
    result = tune(root, action, "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "would " in result.stdout
    assert snapshot(root) == before
    if action == "apply":
        assert not (root / "run/deskchat").exists()


def test_choice_files_are_read_by_their_bracketed_word(tmp_path: Path) -> None:
    root = make_tree(tmp_path, choice=True)
    lines = status_lines(root)
    assert lines["thp_enabled"] == "differs: have always, want madvise"
    assert lines["thp_defrag"] == "ok"  # "always defer defer+madvise [madvise] never"
    assert tune(root, "apply").returncode == 0
    assert read(root, f"{SAVE}/{THP}/enabled") == "always"
    assert not (root / SAVE / THP / "defrag").exists()
    assert tune(root, "revert").returncode == 0
    # A regular file keeps what was written; the kernel would show "[always] madvise never".
    assert read(root, f"{THP}/enabled") == "always"


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("[always] madvise never", "always"),
        ("always [madvise] never", "madvise"),
        ("always defer defer+madvise [madvise] never", "madvise"),
        ("[never]", "never"),
        ("performance", "performance"),
        ("n/a", "n/a"),
    ],
)
def test_sys_read_parses_choice_files(tmp_path: Path, text: str, want: str) -> None:
    (tmp_path / "f").write_text(text + "\n")
    script = f'source "{SYSTEM}/lib.sh" && sys_read "$1"'
    result = run(["bash", "-c", script, "sh", tmp_path / "f"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == want + "\n"


def test_opt_in_knobs_follow_sysroot_tune_conf(tmp_path: Path) -> None:
    root = make_tree(tmp_path)
    conf = (SYSTEM / "tune.conf").read_text()
    conf += "nr_hugepages=64\n"
    conf += 'cstate_latency_us="20"  # short wake-ups\n'
    conf += 'governor="ondemand powersave"\n'
    (root / "etc/deskchat").mkdir(parents=True)
    (root / "etc/deskchat/tune.conf").write_text(conf)
    before = snapshot(root)
    assert tune(root, "apply").returncode == 0
    assert read(root, "proc/sys/vm/nr_hugepages") == "64"
    assert read(root, f"{CPU}/cpu2/power/pm_qos_resume_latency_us") == "20"
    # ondemand is not offered by this "kernel": the list falls back to powersave.
    assert read(root, f"{CPU}/cpu0/cpufreq/scaling_governor") == "powersave"
    assert tune(root, "status").returncode == 0
    assert tune(root, "revert").returncode == 0
    assert snapshot(root) == before


def readonly_bind(path: Path) -> list[str]:
    """A command prefix under which writing to path fails even for root.

    chmod does not stop root, so as root the file is bind-mounted read-only in a private mount
    namespace (unshare -m): writes get EROFS, reads still work, and the mount vanishes with the
    namespace. Unprivileged runs just drop the write permission.
    """
    if os.geteuid() != 0:
        path.chmod(0o444)
        return []
    if shutil.which("unshare") is None:
        skip_unless_ci("unshare (util-linux) is needed to make a file unwritable for root")
    setup = 'mount --bind "$1" "$1" && mount -o remount,ro,bind "$1" "$1"'
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", setup, "sh", str(path)], capture_output=True, text=True
    )
    if probe.returncode != 0:
        skip_unless_ci(f"cannot make a read-only bind mount here: {probe.stderr.strip()}")
    return ["unshare", "-m", "sh", "-c", f'{setup} && shift && exec "$@"', "sh", str(path)]


def test_refused_write_is_reported_others_applied_and_revert_works(tmp_path: Path) -> None:
    root = make_tree(tmp_path)
    before = snapshot(root)
    swappiness = root / "proc/sys/vm/swappiness"
    applied = tune(root, "apply", prefix=readonly_bind(swappiness))
    assert applied.returncode == 3, (applied.stdout, applied.stderr)
    assert str(swappiness) in applied.stderr
    assert read(root, "proc/sys/vm/swappiness") == "60"
    assert not (root / SAVE / "proc/sys/vm/swappiness").exists()
    assert read(root, f"{THP}/enabled") == "madvise"
    assert read(root, f"{SAVE}/{THP}/enabled") == "always"
    lines = status_lines(root)
    assert lines["vm.swappiness"] == "differs: have 60, want 10"
    assert lines["governor"] == "ok"
    swappiness.chmod(0o644)
    assert tune(root, "revert").returncode == 0
    assert snapshot(root) == before


def test_refuses_without_root_and_sysroot() -> None:
    for action in ("apply", "revert"):
        result = tune(None, action, prefix=unprivileged())
        assert result.returncode == 2
        assert "run it as root" in result.stderr
        assert result.stdout == ""


def test_unknown_action_is_a_usage_error(tmp_path: Path) -> None:
    result = tune(make_tree(tmp_path), "bogus")
    assert result.returncode == 2
    assert "usage" in result.stderr
