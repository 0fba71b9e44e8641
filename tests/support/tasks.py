"""The threads of a process, the CPUs each may run on and its scheduler slice, from /proc."""

from __future__ import annotations

import threading
from pathlib import Path

from service.cpu_list import parse_cpu_list


def _each_task(pid: int | str, read) -> list[tuple[str, object]]:
    """(thread name, read(its /proc/PID/task/TID folder)) for every thread of a process."""
    tasks = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            tasks.append(((task / "comm").read_text().strip(), read(task)))
        except FileNotFoundError:  # the thread ended meanwhile
            continue
    return tasks


def _mask(task: Path) -> frozenset[int]:
    status = (task / "status").read_text()
    line = next(x for x in status.splitlines() if x.startswith("Cpus_allowed_list:"))
    return parse_cpu_list(line.split(":", 1)[1])


def task_masks(pid: int | str = "self") -> list[tuple[str, frozenset[int]]]:
    """(thread name, CPUs it may run on) for every thread of a process."""
    return _each_task(pid, _mask)


def slices_settable() -> bool:
    """Whether this kernel shows threads' slices and takes one asked for (Linux 6.12+):
    tried in a thread of its own, which ends with it."""
    from inference.host.process import set_slice

    took: list[bool] = []

    def attempt() -> None:
        took.append(slice_ns("thread-self") is not None and set_slice(250) is None)

    thread = threading.Thread(target=attempt)
    thread.start()
    thread.join()
    return took[0]


def slice_ns(task: int | str | Path = "self") -> int | None:
    """A thread's scheduler slice in ns (`se.slice` of /proc/.../sched), None where the
    kernel shows none (before EEVDF, Linux 6.6, or without its scheduler debug file)."""
    path = Path(task) / "sched" if isinstance(task, Path) else Path(f"/proc/{task}/sched")
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return None
    return next((int(x.split(":")[1]) for x in lines if x.startswith("se.slice")), None)


def task_slices(pid: int | str = "self") -> list[tuple[str, int | None]]:
    """(thread name, scheduler slice in ns) for every thread of a process."""
    return _each_task(pid, slice_ns)


def _policy_and_nice(task: Path) -> tuple[int, int]:
    fields = (task / "stat").read_text().rsplit(")", 1)[1].split()  # from field 3 on
    return int(fields[38]), int(fields[16])  # policy (field 41), nice (field 19)


def task_policies(pid: int | str = "self") -> list[tuple[str, tuple[int, int]]]:
    """(thread name, (scheduling policy, nice)) for every thread of a process."""
    return _each_task(pid, _policy_and_nice)
