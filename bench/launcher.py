"""Start `server.py` (or another HTTP server, as llama-server) as its own process: given
flags, environment and priority, on a free loopback port, its log in a file; wait until it
answers /health, stop it by its process id."""

from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from inference.host.process import set_slice
from service.config import load_config

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Setting:
    """How one server is started: flags, environment, and its priority (nice of its
    threads and of its autogroup, the nearest this bench gets to systemd's Nice= and
    CPUWeight= without systemd)."""

    flags: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    nice: int | None = None
    about: str = ""

    def __add__(self, other: Setting) -> Setting:
        return Setting(
            self.flags + other.flags,
            {**self.env, **other.env},
            other.nice if other.nice is not None else self.nice,
            f"{self.about}; {other.about}".strip("; "),
        )

    def slice_us(self) -> int:
        """The scheduler slice this setting's server asks for (--sched-slice-us), as
        server.py reads it from these flags and this environment."""
        return load_config(list(self.flags), {**os.environ, **self.env}).sched_slice_us

    def describe(self) -> str:
        parts = [*self.flags, *(f"{k}={v}" for k, v in self.env.items())]
        if self.nice is not None:
            parts.append(f"nice {self.nice:+d} (threads and autogroup)")
        return " ".join(parts) or self.about


# The kernel's weight for each nice level (kernel/sched/core.c, sched_prio_to_weight): an
# autogroup's share of the CPUs against the others' is its weight over their sum.
NICE_WEIGHTS = dict(zip(range(-20, 20), (
    88761, 71755, 56483, 46273, 36291, 29154, 23254, 18705, 14949, 11916,
    9548, 7620, 6100, 4904, 3906, 3121, 2501, 1991, 1586, 1277,
    1024, 820, 655, 526, 423, 335, 272, 215, 172, 137,
    110, 87, 70, 56, 45, 36, 29, 23, 18, 15,
), strict=True))  # fmt: skip
PROFILES = ROOT / "system" / "profiles"
USER_SLICE_WEIGHT = 100  # systemd's CPUWeight= default, user.slice's: the owner's programs


def slice_weight(profile: str) -> int:
    """The CPUWeight= of a priority profile's slice (system/profiles/PROFILE.slice.conf)."""
    text = (PROFILES / f"{profile}.slice.conf").read_text()
    return int(re.search(r"^CPUWeight=(\d+)", text, re.MULTILINE).group(1))


def profile_environment(profile: str) -> dict[str, str]:
    """The Environment= settings of a priority profile's service drop-in
    (system/profiles/PROFILE.service.conf): what the unit runs the server with."""
    text = (PROFILES / f"{profile}.service.conf").read_text()
    return dict(re.findall(r"^Environment=(\w+)=(.*)$", text, re.MULTILINE))


def profile_nice(profile: str, busy: int) -> int:
    """The autogroup nice that gives the server the share of the CPUs the profile's slice
    gives the service: its CPUWeight against user.slice's 100, where the owner's `busy`
    programs all run. Here each busy program is an autogroup of its own at nice 0 (1,024),
    so the server's must weigh CPUWeight / 100 x busy x 1,024; the nearest level, by ratio.
    On 2 CPUs (a busy program each), dedicated-pc's 1000 is nice -13, about 90 % of the
    CPUs as the unit's 91 %; nice -10 alone gave 82 %."""
    target = slice_weight(profile) / USER_SLICE_WEIGHT * busy * NICE_WEIGHTS[0]
    return min(NICE_WEIGHTS, key=lambda nice: abs(math.log(NICE_WEIGHTS[nice] / target)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


AUTOGROUP = Path("/proc/self/autogroup")


def _autogroup_nice() -> int | None:
    """This session's autogroup nice ("/autogroup-N nice K"), None without autogroup."""
    try:
        return int(AUTOGROUP.read_text().split()[-1])
    except (OSError, ValueError, IndexError):
        return None


def _set_priority(nice: int) -> None:
    """The calling thread's nice and, where the kernel groups by session (autogroup), its
    session's."""
    os.setpriority(os.PRIO_PROCESS, 0, nice)
    with contextlib.suppress(OSError):  # no autogroup here: the thread nice alone
        AUTOGROUP.write_text(f"{nice}\n")


def prioritize(nice: int | None):
    """preexec_fn: the server's nice and its session's, so it competes with the noise as a
    separate program would."""
    if nice is None:
        return None
    return lambda: _set_priority(nice)


@contextlib.contextmanager
def client_priority(nice: int | None, slice_us: int = 0):
    """The measuring client (this thread and its session) at a raised setting's priority
    and the server's scheduler slice while it measures (the dedicated profile's rows): at
    nice 0 and the kernel's slice beside the noise it would measure its own waits for a CPU
    as the server's gaps. A lowered one (shared-desk) leaves the client as it is, a program
    of the owner's. Put back afterwards (the slice to the kernel's default)."""
    if nice is None or nice >= 0:
        yield
        return
    thread_nice, group_nice = os.getpriority(os.PRIO_PROCESS, 0), _autogroup_nice()
    _set_priority(nice)
    set_slice(slice_us)
    try:
        yield
    finally:
        set_slice(0)
        os.setpriority(os.PRIO_PROCESS, 0, thread_nice)
        if group_nice is not None:
            with contextlib.suppress(OSError):
                AUTOGROUP.write_text(f"{group_nice}\n")


class Process:
    """A server program in its own session, on a free loopback port: `command(port)` gives
    its command line. Ready when GET /health answers 200 (deskchat and llama-server alike)."""

    def __init__(
        self, command: Callable[[int], list[str]], log_dir: Path, chosen: Setting | None = None
    ):
        chosen = chosen or Setting()
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"server-{self.port}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            command(self.port),
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **chosen.env},
            start_new_session=True,
            preexec_fn=prioritize(chosen.nice),
        )

    def wait_ready(self, timeout: float = 600) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}): {self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the server was not ready in {timeout:.0f} s: {self.tail()}")

    def tail(self) -> str:
        return " | ".join(self.log_path.read_text(errors="replace").splitlines()[-5:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


class Server(Process):
    """`python server.py` with one Setting."""

    def __init__(self, model: Path, cache_dir: Path, chosen: Setting, log_dir: Path):
        def command(port: int) -> list[str]:
            cmd = [sys.executable, str(ROOT / "server.py"), "--port", str(port)]
            return cmd + ["--model", str(model), "--cache-dir", str(cache_dir), *chosen.flags]

        super().__init__(command, log_dir, chosen)
