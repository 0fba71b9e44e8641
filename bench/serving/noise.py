"""Background load for the latency benchmark: what else an office PC is doing.

Conditions: `quiet` (nothing), `cpu` (one busy process per CPU, nice 0: someone working),
`bursts` (one per CPU, busy `BURST_MS` every `BURST_EVERY_S`: a scan, an update check),
`memory` (one process that fills most of the available RAM, touching every page, and reads
a large file through the page cache over and over, then lets go). Each is its own process in
its own session (its own scheduling autogroup, like a program the owner started), ends by
itself at its deadline, and dies with the bench (PR_SET_PDEATHSIG); the bench stops it by
its process id. It knows nothing of the server.

    python -m bench.serving.noise spin|burst|memory --seconds S [...]
    (started by Noise, not by hand)
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from inference.host.process import set_slice

CONDITIONS = ("quiet", "cpu", "bursts", "memory")
BURST_MS = 200
BURST_EVERY_S = 2.0
CHUNK = 64 << 20  # memory is taken and given back in pieces of this size
PAGE = 4096
READ_BLOCK = 8 << 20
# Memory left to everyone else: never allocate below this much MemAvailable; give back when
# it falls under half of it (something else on the machine wants memory).
MARGIN_MIN = 1 << 30
MARGIN_FRACTION = 0.10
FILE_MB = 1024  # the file read through the page cache
ROOT = Path(__file__).resolve().parents[2]  # the repo


def meminfo_bytes(field: str) -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/meminfo")


def margin_bytes() -> int:
    return max(MARGIN_MIN, int(meminfo_bytes("MemTotal") * MARGIN_FRACTION))


def spin(deadline: float, busy_s: float | None = None, every_s: float | None = None) -> None:
    """Burn CPU until the deadline; with busy_s/every_s, only busy_s of every every_s."""
    while time.monotonic() < deadline:
        start = time.monotonic()
        until = start + busy_s if busy_s else deadline
        while time.monotonic() < min(until, deadline):
            pass
        if every_s:
            time.sleep(max(0.0, min(start + every_s, deadline) - time.monotonic()))


def scratch_file(path: Path, size_mb: int) -> Path:
    """A file of size_mb of non-zero bytes, written once and kept for later runs."""
    if path.is_file() and path.stat().st_size == size_mb << 20:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    block = bytes(range(256)) * (1 << 12)  # 1 MiB
    partial = path.with_suffix(".partial")
    with open(partial, "wb") as out:
        for _ in range(size_mb):
            out.write(block)
    partial.rename(path)
    return path


def read_through_cache(path: Path) -> None:
    """Read the whole file, then drop it from the page cache so the next pass reads it from
    the disk again: the cache keeps churning."""
    fd = os.open(path, os.O_RDONLY)
    try:
        while os.read(fd, READ_BLOCK):
            pass
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def take_memory(cap_bytes: int | None, margin: int) -> list[bytearray]:
    """CHUNKs of memory, every page written, while MemAvailable stays above `margin` after
    the next one, and up to `cap_bytes`."""
    held: list[bytearray] = []
    while cap_bytes is None or (len(held) + 1) * CHUNK <= cap_bytes:
        if meminfo_bytes("MemAvailable") - CHUNK < margin:
            break
        chunk = bytearray(CHUNK)
        chunk[::PAGE] = b"\1" * (CHUNK // PAGE)  # a write to every page: really resident
        held.append(chunk)
    return held


def pressure(deadline: float, cap_bytes: int | None, file: Path, say=print) -> None:
    """Take memory in CHUNKs while MemAvailable stays above the margin (and up to cap_bytes),
    touching every page; then read `file` over and over; give chunks back whenever
    MemAvailable drops below half the margin; let everything go at the deadline."""
    margin = margin_bytes()
    held = take_memory(cap_bytes, margin)
    say(f"ready {len(held) * CHUNK >> 20} MB held, margin {margin >> 20} MB")
    while time.monotonic() < deadline:
        read_through_cache(file)
        while held and meminfo_bytes("MemAvailable") < margin // 2:
            held.pop()
    held.clear()


def _child_setup() -> None:
    """In the child before exec: the normal policy at nice 0 and the default scheduler slice
    whatever the bench's own (a client measuring at a raised setting, even a real-time one,
    must not hand it to the noise), and SIGKILL when the bench goes away."""
    os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    os.setpriority(os.PRIO_PROCESS, 0, 0)
    set_slice(0)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def busy_programs() -> int:
    """The busy processes the cpu and bursts conditions start unless told: one a CPU this
    process may use (what a profile's share is weighed against, bench/launcher.py)."""
    return len(os.sched_getaffinity(0))


class Noise:
    """The processes of one condition: `with Noise("cpu", seconds=60): ...`."""

    def __init__(
        self,
        condition: str,
        seconds: float,
        cpus: int | None = None,
        memory_cap_mb: int | None = None,
        file: Path = Path("bench-pagecache.bin"),
        file_mb: int = FILE_MB,
    ):
        if condition not in CONDITIONS:
            raise ValueError(f"unknown condition {condition!r}; one of {', '.join(CONDITIONS)}")
        self.condition = condition
        self.seconds = seconds
        self.cpus = cpus or busy_programs()
        self.memory_cap_mb = memory_cap_mb
        self.file = file
        self.file_mb = file_mb
        self.procs: list[subprocess.Popen] = []
        self.report = ""  # the memory process's "ready ..." line

    def commands(self) -> list[list[str]]:
        base = [sys.executable, "-m", "bench.serving.noise"]
        limit = ["--seconds", f"{self.seconds:g}"]
        if self.condition == "cpu":
            return [[*base, "spin", *limit]] * self.cpus
        if self.condition == "bursts":
            return [[*base, "burst", *limit]] * self.cpus
        if self.condition == "memory":
            extra = ["--file", str(self.file), "--file-mb", str(self.file_mb)]
            if self.memory_cap_mb:
                extra += ["--cap-mb", str(self.memory_cap_mb)]
            return [[*base, "memory", *limit, *extra]]
        return []

    def __enter__(self) -> Noise:
        for cmd in self.commands():
            self.procs.append(
                subprocess.Popen(
                    cmd,
                    cwd=ROOT,
                    stdout=subprocess.PIPE,
                    text=True,
                    start_new_session=True,
                    preexec_fn=_child_setup,
                )
            )
        if self.condition == "memory":  # wait until the memory is taken
            self.report = self.procs[0].stdout.readline().strip()
        return self

    def __exit__(self, *_exc) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            proc.stdout.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.serving.noise", description=__doc__)
    parser.add_argument("kind", choices=("spin", "burst", "memory"))
    parser.add_argument("--seconds", type=float, required=True, help="end by itself after this")
    parser.add_argument("--cap-mb", type=int, default=None, help="memory: take no more than")
    parser.add_argument("--file", type=Path, help="memory: file to read (made if missing)")
    parser.add_argument("--file-mb", type=int, default=FILE_MB, help="memory: its size")
    args = parser.parse_args(argv)
    deadline = time.monotonic() + args.seconds
    if args.kind == "spin":
        spin(deadline)
    elif args.kind == "burst":
        spin(deadline, BURST_MS / 1000, BURST_EVERY_S)
    else:
        file = scratch_file(args.file, args.file_mb)
        cap = args.cap_mb << 20 if args.cap_mb else None
        pressure(deadline, cap, file, say=lambda text: print(text, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
