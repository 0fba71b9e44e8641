"""The threads of a process and the CPUs each may run on, read from /proc."""

from __future__ import annotations

from pathlib import Path

from service.cpu_list import parse_cpu_list


def task_masks(pid: int | str = "self") -> list[tuple[str, frozenset[int]]]:
    """(thread name, CPUs it may run on) for every thread of a process."""
    tasks = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            status = (task / "status").read_text()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        line = next(x for x in status.splitlines() if x.startswith("Cpus_allowed_list:"))
        tasks.append((name, parse_cpu_list(line.split(":", 1)[1])))
    return tasks
