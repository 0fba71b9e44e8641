"""Fake kernel trees and script runners for the system/ tests.

This module owns building DESKCHAT_SYSROOT trees in temp dirs, snapshotting them, and running
the shell scripts; it knows nothing about what the scripts should do with them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from tests.support.paths import ROOT

SYSTEM = ROOT / "system"
TUNE = SYSTEM / "tune.sh"

CPU = "sys/devices/system/cpu"
THP = "sys/kernel/mm/transparent_hugepage"


def write(root: Path, rel: str, text: str) -> Path:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")
    return path


def make_tree(root: Path, *, cpufreq: bool = True, cpus: int = 4, choice: bool = False) -> Path:
    """A desktop-like tree: intel_pstate cpufreq, THP, vm sysctls, PM QoS per CPU.

    With choice=True the THP files read like the kernel's ("[always] madvise never"); without,
    they hold the plain word a write leaves in a regular file, so a round trip can be compared
    byte for byte.
    """
    for n in range(cpus):
        write(root, f"{CPU}/cpu{n}/power/pm_qos_resume_latency_us", "0")
        if cpufreq:
            d = f"{CPU}/cpu{n}/cpufreq"
            write(root, f"{d}/scaling_governor", "powersave")
            write(root, f"{d}/scaling_available_governors", "performance powersave")
            write(root, f"{d}/energy_performance_preference", "balance_performance")
            write(
                root,
                f"{d}/energy_performance_available_preferences",
                "default performance balance_performance balance_power power",
            )
    if cpufreq:
        write(root, f"{CPU}/intel_pstate/min_perf_pct", "24")
    write(root, f"{THP}/enabled", "[always] madvise never" if choice else "always")
    write(
        root, f"{THP}/defrag", "always defer defer+madvise [madvise] never" if choice else "madvise"
    )
    write(root, "proc/sys/vm/swappiness", "60")
    write(root, "proc/sys/vm/nr_hugepages", "0")
    (root / "run").mkdir(exist_ok=True)
    return root


def snapshot(root: Path) -> dict[str, tuple[str, bytes]]:
    """Every path under root with its kind and bytes (or link target)."""
    result: dict[str, tuple[str, bytes]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            rel = str(path.relative_to(root))
            if path.is_symlink():
                result[rel] = ("link", os.readlink(path).encode())
            elif path.is_dir():
                result[rel] = ("dir", b"")
            else:
                result[rel] = (oct(path.stat().st_mode & 0o777), path.read_bytes())
    return result


def run(
    args: list[str | Path],
    root: Path | None,
    *,
    env: dict[str, str] | None = None,
    prefix: list[str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run a command with DESKCHAT_SYSROOT=root (unset when root is None)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("DESKCHAT_")}
    if root is not None:
        full_env["DESKCHAT_SYSROOT"] = str(root)
    full_env.update(env or {})
    cmd = [*(prefix or []), *(str(a) for a in args)]
    return subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=60)


def tune(root: Path | None, *args: str, **kw) -> subprocess.CompletedProcess[str]:
    return run([TUNE, *args], root, **kw)


def status_lines(root: Path) -> dict[str, str]:
    """tune.sh status as {knob: verdict}."""
    out = tune(root, "status").stdout
    return dict(line.split(": ", 1) for line in out.splitlines())


def skip_unless_ci(reason: str) -> None:
    """Skip on a developer's machine that lacks a tool; fail in CI, which must have it."""
    import pytest

    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI must install it: see .ci/run)")
    pytest.skip(reason)


def unprivileged() -> list[str]:
    """A command prefix that runs as nobody, or skip the test if that cannot be done."""

    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0:
        return []
    if setpriv is None:
        skip_unless_ci("setpriv (util-linux) is needed to drop root for this test")
    return [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"]


def fake_checkout(src: Path) -> Path:
    """A minimal deskchat checkout: the real system/ plus stand-ins for the Python app."""
    shutil.copytree(SYSTEM, src / "system", ignore=shutil.ignore_patterns("__pycache__"))
    (src / "server.py").write_text("print('deskchat')\n")
    (src / "requirements.txt").write_text("flask==3.1.3\n")
    (src / "README.md").write_text("# deskchat\n")
    (src / "service").mkdir()
    (src / "service/__init__.py").write_text("")
    (src / "inference/__pycache__").mkdir(parents=True)
    (src / "inference/__init__.py").write_text("")
    (src / "inference/__pycache__/x.pyc").write_bytes(b"\0")
    (src / "web").mkdir()
    (src / "web/app.py").write_text("")
    return src
