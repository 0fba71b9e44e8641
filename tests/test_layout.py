"""The layout's rules, read from the imports: arrows point down only and nothing cycles.

server.py -> web/ -> inference/ -> service/; bench/ may use all of them and nothing uses
bench/; within inference/, the rooms import in one direction too (runtime -> model ->
native -> quant -> host). A module counts its imports anywhere in the file, function-local
ones included: a lazy import is still an arrow.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.paths import ROOT

PACKAGES = ("service", "inference", "web", "bench")
# Who may import whom, by top-level package (a package may always import itself).
MAY_IMPORT = {
    "service": set(),
    "inference": {"service"},
    "web": {"inference", "service"},
    "bench": {"inference", "service", "web"},
    "server": {"inference", "service", "web"},
    "tests": {"inference", "service", "web", "bench", "server", "tests"},
}
# The rooms of inference/, lowest last: a room imports only rooms below it.
ROOMS = ("loading", "runtime", "model", "native", "quant", "host")
MAX_CODE_FILES = 11  # per folder, __init__.py not counted


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def code_files() -> list[Path]:
    files = [ROOT / "server.py"]
    for package in (*PACKAGES, "tests"):
        files += sorted((ROOT / package).rglob("*.py"))
    return files


def imports_of(path: Path) -> set[str]:
    """The project modules `path` imports (absolute imports; the project uses no others)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    top = {*PACKAGES, "server", "tests"}
    return {name for name in found if name.split(".")[0] in top}


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in code_files()}
    return {
        name: {i for i in imports_of(path) if i in modules and i != name}
        for name, path in modules.items()
    }


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in edges[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in edges:
        if node not in index:
            visit(node)
    return found


def test_no_import_cycles() -> None:
    # Package __init__ files are empty, so a cycle here is one between real modules.
    assert cycles(graph()) == []


def test_arrows_point_down() -> None:
    upward = []
    for name, targets in graph().items():
        top = name.split(".")[0]
        for target in targets:
            other = target.split(".")[0]
            if other != top and other not in MAY_IMPORT[top]:
                upward.append(f"{name} -> {target}")
    assert upward == []


def room(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 2 and parts[0] == "inference" else None


def test_inference_rooms_import_downward() -> None:
    upward = []
    for name, targets in graph().items():
        mine = room(name)
        for target in targets:
            theirs = room(target)
            if mine and theirs and ROOMS.index(theirs) < ROOMS.index(mine):
                upward.append(f"{name} -> {target}")
    assert upward == []


def test_no_folder_is_crowded() -> None:
    crowded = {}
    for folder in {p.parent for p in code_files() if p.parent != ROOT}:
        if "tests" in folder.relative_to(ROOT).parts:
            continue  # tests mirror the code; their folders follow it
        count = len([p for p in folder.glob("*.py") if p.name != "__init__.py"])
        if count > MAX_CODE_FILES:
            crowded[str(folder.relative_to(ROOT))] = count
    assert crowded == {}


def test_graph_sees_real_arrows() -> None:
    """The checks above are only as good as the graph: it must see known imports."""
    edges = graph()
    assert "inference.runtime.engine" in edges["inference.runtime.worker"] or any(
        t.startswith("inference.runtime.jobs") for t in edges["inference.runtime.worker"]
    )
    assert "service.config" in edges["server"]
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def test_the_server_module_loads_no_torch_before_the_cpu_split() -> None:
    """server.py splits the CPUs (--cpu-affinity) before the model loads: every thread
    started afterwards inherits its mask. Importing torch starts threads, so nothing that
    server.py imports at the top may import it (tests/inference/host/test_host.py sees
    the masks; this sees the cause in a second)."""
    import subprocess
    import sys

    code = "import sys, server; print('torch' in sys.modules)"
    found = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert found.stdout.strip() == "False"
