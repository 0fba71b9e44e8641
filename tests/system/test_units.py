"""The systemd units and the shell scripts: ShellCheck, systemd-analyze verify and security."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from inference.host.cpu import native_bf16
from tests.support.httpclient import chat
from tests.support.systree import SYSTEM, fake_checkout, run, skip_unless_ci

UNITS = ("deskchat.service", "deskchat-tune.service")
MAX_EXPOSURE = 3.0
EXPOSURE = r"Overall exposure level for deskchat\.service: ([0-9.]+)"


def need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        skip_unless_ci(f"{tool} is not installed")
    return path


def settings(unit: str) -> dict[str, list[str]]:
    """KEY -> every value it is given in the unit, in order (systemd keys may repeat)."""
    result: dict[str, list[str]] = {}
    for line in (SYSTEM / unit).read_text().splitlines():
        if "=" in line and not line.startswith(("#", ";", "[")):
            key, value = line.split("=", 1)
            result.setdefault(key.strip(), []).append(value.strip())
    return result


def test_shellcheck_clean() -> None:
    shellcheck = need("shellcheck")
    scripts = sorted(SYSTEM.rglob("*.sh"))
    assert len(scripts) >= 9
    result = subprocess.run(
        [shellcheck, "-x", *map(str, scripts)], capture_output=True, text=True, cwd=SYSTEM
    )
    assert result.returncode == 0, result.stdout + result.stderr


def mirror_host_path(root: Path, path: Path) -> None:
    """Make path resolve under root: copy in the host file that an absolute symlink names."""
    for _ in range(10):
        if not path.is_symlink():
            return
        target = Path(os.readlink(path))
        if not target.is_absolute():
            path = path.parent / target
            continue
        inside = root / target.relative_to("/")
        if not inside.exists() and not inside.is_symlink():
            inside.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(os.path.realpath(target), inside)
        path = inside


@pytest.fixture(scope="module")
def installed_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An installed layout under a temp root, as install.sh writes it (no pip)."""
    need("systemctl")
    root = tmp_path_factory.mktemp("root")
    src = tmp_path_factory.mktemp("src")
    fake_checkout(src)
    done = run([src / "system/install.sh", "--skip-pip"], root)
    assert done.returncode == 0, done.stderr
    # systemd's own units (sysinit.target, ...) come from the host, read-only.
    host_units = Path("/usr/lib/systemd/system")
    if not host_units.is_dir():
        host_units = Path("/lib/systemd/system")
    (root / "usr/lib/systemd").mkdir(parents=True)
    (root / "usr/lib/systemd/system").symlink_to(host_units)
    mirror_host_path(root, root / "opt/deskchat/venv/bin/python")
    return root


def verify(root: Path, *units: str) -> tuple[int, list[str]]:
    """systemd-analyze verify under root: exit code and the lines about deskchat.

    The host unit directory seen through --root makes systemd warn about the host's own
    absolute symlinks; only lines naming deskchat units or paths concern us.
    """
    analyze = need("systemd-analyze")
    result = subprocess.run(
        [analyze, "verify", f"--root={root}", *units], capture_output=True, text=True
    )
    lines = (result.stdout + result.stderr).splitlines()
    return result.returncode, [line for line in lines if "deskchat" in line]


def test_units_pass_systemd_analyze_verify(installed_root: Path) -> None:
    code, complaints = verify(installed_root, *UNITS, "deskchat.slice")
    assert code == 0 and complaints == [], complaints


def test_verify_catches_a_broken_unit(installed_root: Path) -> None:
    """The check above can fail: a typo and a missing binary are both reported."""
    unit = installed_root / "etc/systemd/system/deskchat.service"
    good = unit.read_text()
    try:
        unit.write_text(good.replace("ProtectClock=", "ProtectClok="))
        assert verify(installed_root, "deskchat.service")[1]
        unit.write_text(good.replace("/venv/bin/python", "/venv/bin/pithon"))
        assert verify(installed_root, "deskchat.service")[0] != 0
    finally:
        unit.write_text(good)


def test_security_exposure_below_limit() -> None:
    analyze = need("systemd-analyze")
    result = subprocess.run(
        [analyze, "security", "--offline=true", str(SYSTEM / "deskchat.service")],
        capture_output=True,
        text=True,
    )
    found = re.search(EXPOSURE, result.stdout)
    assert found, result.stdout + result.stderr
    assert float(found.group(1)) < MAX_EXPOSURE, result.stdout
    # No worse than the score docs/operations.md states (measured with systemd 252).
    documented = re.search(EXPOSURE, (SYSTEM.parent / "docs" / "operations.md").read_text())
    assert documented, "docs/operations.md states no exposure level"
    assert float(found.group(1)) <= float(documented.group(1)), result.stdout


def test_service_contract() -> None:
    s = settings("deskchat.service")
    one = {key: values[-1] for key, values in s.items()}
    assert one["Type"] == "notify" and one["NotifyAccess"] == "main"
    assert one["WatchdogSec"] == "60" and one["Restart"] == "on-failure"
    assert one["ExecStart"] == "/opt/deskchat/venv/bin/python /opt/deskchat/app/server.py"
    assert "DESKCHAT_CACHE_DIR=/var/cache/deskchat" in s["Environment"]
    assert "THP_MEM_ALLOC_ENABLE=1" in s["Environment"]
    assert one["CacheDirectory"] == "deskchat" and one["StateDirectory"] == "deskchat"
    assert one["CapabilityBoundingSet"] == ""
    assert one["RestrictAddressFamilies"] == "AF_INET AF_INET6 AF_UNIX"
    # The JITs (oneDNN, fbgemm) cope: test_server_answers_under_memory_deny_write_execute.
    assert one["MemoryDenyWriteExecute"] == "yes"
    # ModelScope must stay reachable on first start.
    assert all("any" not in v.split() for v in s.get("IPAddressDeny", []))


def test_service_keys_wiring() -> None:
    """Root copies the root-only key file into the service's own run dir, at start and reload.

    Not /run/deskchat: deskchat-tune keeps its saved kernel values there, and systemd would
    give that directory to the service's user and delete it when the service stops.
    """
    s = settings("deskchat.service")
    sync = "/opt/deskchat/app/system/keys-sync.sh"
    assert s["RuntimeDirectory"] == ["deskchat-keys"] and s["RuntimeDirectoryMode"] == ["0700"]
    assert "DESKCHAT_API_KEYS_FILE=/run/deskchat-keys/api-keys" in s["Environment"]
    assert s["ExecStartPre"] == [f"+{sync}"]
    # Copy first, then tell the running server (SIGHUP: re-read, no restart).
    assert s["ExecReload"] == [f"+{sync}", "kill -HUP $MAINPID"]
    # A credential would be copied at start only: a reload would not see edited keys.
    assert "LoadCredential" not in s and "RuntimeDirectoryPreserve" not in s


def test_tune_unit_contract() -> None:
    one = {key: values[-1] for key, values in settings("deskchat-tune.service").items()}
    assert one["Type"] == "oneshot" and one["RemainAfterExit"] == "yes"
    assert one["ExecStart"].endswith("/system/tune.sh apply")
    assert one["ExecStop"].endswith("/system/tune.sh revert")


# Runs server.py with no writable+executable memory: prctl(PR_SET_MDWE,
# PR_MDWE_REFUSE_EXEC_GAIN) (Linux 6.3+), inherited across exec. It is the rule systemd
# applies for MemoryDenyWriteExecute=yes (itself from systemd 254 on; 252 uses a seccomp
# filter to the same end, which the live systemd run covers). Exit 3: the rule did not hold.
MDWE_EXEC = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(65, 1, 0, 0, 0) != 0:
    sys.exit(4)
libc.mmap.restype = ctypes.c_void_p
rwx = libc.mmap(None, 4096, 7, 0x22, -1, 0)  # PROT_READ|WRITE|EXEC, MAP_PRIVATE|ANONYMOUS
if rwx not in (None, ctypes.c_void_p(-1).value):
    sys.exit(3)
os.execv(sys.argv[1], sys.argv[1:])
"""


def mdwe_wrapper() -> list[str]:
    """The command prefix, or skip (outside CI) where the kernel has no PR_SET_MDWE."""
    probe = subprocess.run([sys.executable, "-c", MDWE_EXEC, "/bin/true"], timeout=30)
    if probe.returncode == 4:
        skip_unless_ci("this kernel has no PR_SET_MDWE (Linux 6.3+)")
    assert probe.returncode == 0, "writable+executable memory was still allowed"
    return [sys.executable, "-c", MDWE_EXEC]


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags",
    [
        pytest.param(("--quantize", "int8"), id="int8"),
        pytest.param(("--quantize", "int4"), id="int4"),
        # oneDNN's bf16 kernels need writable+executable memory ("could not create a
        # primitive" at the first forward): the server computes in float32 instead.
        pytest.param(("--quantize", "none", "--dtype", "bfloat16"), id="none"),
    ],
)
def test_server_answers_under_memory_deny_write_execute(start_server, flags) -> None:
    server = start_server("--model", "embedded", *flags, wrapper=mdwe_wrapper())
    reply = chat(server.url, {"message": "What is the capital of Japan?", "max_tokens": 12})
    assert reply.status == 200, reply.body
    assert "Tokyo" in reply.json()["response"]  # a large fp32 margin: tests/support/margins.py
    if "bfloat16" in flags and native_bf16():
        assert "writable+executable memory is denied here" in server.log()


SHARES = ("CPUWeight", "IOWeight")


def test_priority_profiles() -> None:
    """shared desk restates the units' own priority; dedicated PC puts the service first.
    The shares are the slice's, a slice at the top of the tree: weights count only between
    siblings, so in system.slice the service was weighed only against other services."""
    unit, slice_ = settings("deskchat.service"), settings("deskchat.slice")
    assert unit["Slice"] == ["deskchat.slice"]  # no "-" in its name: a child of the root
    assert not set(SHARES) & set(unit)  # a service's own weights would weigh nothing here
    shared = settings("profiles/shared-desk.service.conf")
    shared_slice = settings("profiles/shared-desk.slice.conf")
    dedicated = settings("profiles/dedicated-pc.service.conf")
    dedicated_slice = settings("profiles/dedicated-pc.slice.conf")
    assert shared["Nice"] == unit["Nice"] and int(shared["Nice"][-1]) > 0
    assert {k: shared_slice[k] for k in SHARES} == {k: slice_[k] for k in SHARES}
    assert int(shared_slice["CPUWeight"][-1]) < 100  # user.slice's weight is 100
    assert int(dedicated["Nice"][-1]) < 0 and int(dedicated_slice["CPUWeight"][-1]) > 100
    assert not set(SHARES) & (set(shared) | set(dedicated))
    assert "CPUSchedulingPolicy" not in dedicated  # real time for first steps alone:
    assert "DESKCHAT_REALTIME_FIRST_STEP_MS=50" in dedicated["Environment"]
    assert (dedicated["LimitRTPRIO"], dedicated["RestrictRealtime"]) == (["1"], ["no"])
    assert unit["RestrictRealtime"] == ["yes"] and "RestrictRealtime" not in shared
    assert "LimitRTPRIO" not in unit and "LimitRTPRIO" not in shared
    assert "DESKCHAT_MLOCK=1" in dedicated["Environment"]
    assert unit["LimitMEMLOCK"] == ["infinity"]  # --mlock needs it (inference/host/process.py)


@pytest.mark.parametrize("profile", ["dedicated-pc", "shared-desk"])  # shared-desk last
def test_profile_dropins_verify_and_keep_the_sandbox(
    installed_root: Path, profile: str, tmp_path: Path
) -> None:
    src = fake_checkout(tmp_path)
    done = run([src / "system/install.sh", "--skip-pip", "--profile", profile], installed_root)
    assert done.returncode == 0, done.stderr
    for part in ("service", "slice"):
        dropin = installed_root / f"etc/systemd/system/deskchat.{part}.d/10-profile.conf"
        assert dropin.read_text() == (SYSTEM / "profiles" / f"{profile}.{part}.conf").read_text()
    code, complaints = verify(installed_root, *UNITS, "deskchat.slice")
    assert code == 0 and complaints == [], complaints
    result = subprocess.run(
        [need("systemd-analyze"), "security", "--offline=true", f"--root={installed_root}"]
        + ["deskchat.service"],
        capture_output=True,
        text=True,
    )
    found = re.search(EXPOSURE, result.stdout)
    assert found and float(found.group(1)) < MAX_EXPOSURE, result.stdout + result.stderr
    broken = run([src / "system/install.sh", "--skip-pip", "--profile", "fast"], installed_root)
    assert broken.returncode == 2 and "--profile must be one of" in broken.stderr
