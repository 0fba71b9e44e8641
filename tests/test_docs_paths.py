"""The README and docs/ name only things that exist: every repository path they name (a file
or folder under one of the checkout's top-level folders, such as `inference/runtime/engine.py`,
`bench/serving/noise.py`, `docs/latency.md`, `system/tune.sh`) is in the checkout, and every
`python -m MODULE` they show can be run: a project module has its file, any other module is
importable here. A file that moves without its docs fails here, not in a reader's shell."""

from __future__ import annotations

import glob
import importlib.util
import re
from pathlib import Path

import pytest

from tests.support.paths import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Folders of the checkout a path may start with (the tracked top level, not .venv or caches).
TOP = ("bench", "docs", "inference", "service", "system", "tests", "web", ".ci")
PROJECT_PACKAGES = {"bench", "inference", "service", "tests", "web", "server"}
# A path starts where nothing path-like precedes it (so /opt/deskchat/app/system/tune.sh, an
# installed path, and ~/.cache/... are not read as checkout paths); {a,b} is shell brace
# expansion; * is a glob.
PATH = re.compile(
    r"(?<![\w./~<>$-])((?:" + "|".join(re.escape(t) for t in TOP) + r")/(?:\{[^}\s]*\}|[\w./*-])*)"
)
MODULE = re.compile(r"\bpython(?:3(?:\.\d+)?)?\s+-m\s+([A-Za-z_][\w.]*)")
# A Markdown link's target, relative to the page: [speed.md](speed.md), [x](../README.md#y).
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)\s]*)?\)")
# Paths a doc names ahead of the change that adds them (none now). Allowed to be missing
# until then only: test_pending_paths_are_still_pending fails once one exists, so the
# allowance goes with its reason.
PENDING: set[str] = set()


def braces(path: str) -> list[str]:
    match = re.search(r"\{([^{}]*)\}", path)
    if not match:
        return [path]
    head, tail = path[: match.start()], path[match.end() :]
    return [p for part in match.group(1).split(",") for p in braces(head + part + tail)]


def named_paths(text: str) -> set[str]:
    found = set()
    for match in PATH.finditer(text):
        path = match.group(1).rstrip(".,:;")
        found.update(braces(path))
    return found


def named_modules(text: str) -> set[str]:
    return {m.group(1).rstrip(".") for m in MODULE.finditer(text)}


def named_links(doc: Path, text: str) -> set[str]:
    """Relative link targets, as paths from the checkout's root."""
    found = set()
    for match in LINK.finditer(text):
        target = match.group(1)
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        found.add((doc.parent / target).resolve().relative_to(ROOT).as_posix())
    return found


def exists(path: str) -> bool:
    if path in PENDING:
        return True
    if "*" in path:
        return bool(glob.glob(str(ROOT / path)))
    return (ROOT / path).exists()


def runnable(module: str) -> bool:
    top, *rest = module.split(".")
    if top not in PROJECT_PACKAGES:
        return importlib.util.find_spec(module) is not None
    base = ROOT.joinpath(top, *rest)
    return base.with_suffix(".py").is_file() or (base / "__main__.py").is_file()


def where(doc: Path, text: str, needle: str) -> str:
    line = text[: text.index(needle)].count("\n") + 1
    return f"{doc.relative_to(ROOT)}:{line}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_every_path_named_exists(doc):
    text = doc.read_text()
    missing = sorted(p for p in named_paths(text) if not exists(p))
    assert not missing, ", ".join(f"{where(doc, text, p.split('{')[0])}: {p}" for p in missing)


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_every_link_leads_somewhere(doc):
    text = doc.read_text()
    missing = sorted(p for p in named_links(doc, text) if not exists(p))
    assert not missing, f"{doc.relative_to(ROOT)} links to missing " + ", ".join(missing)


def test_pending_paths_are_still_pending():
    arrived = sorted(p for p in PENDING if (ROOT / p).exists())
    assert not arrived, f"{arrived} exist now: drop them from PENDING in {Path(__file__).name}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_every_python_m_module_exists(doc):
    text = doc.read_text()
    missing = sorted(m for m in named_modules(text) if not runnable(m))
    assert not missing, ", ".join(f"{where(doc, text, m)}: python -m {m}" for m in missing)


def test_the_checks_see_what_they_check():
    """The scanners find paths and modules in the forms the docs write them, and skip
    installed paths: a scanner that found nothing would pass everything."""
    text = (
        "`inference/runtime/engine.py`, (`bench/cpu_paths.py`: and `tests/inference/"
        "{runtime,native}/`; `docs/latency.md`. /opt/deskchat/app/system/tune.sh "
        "`python -m bench.engine.prefill --model x`, `.venv/bin/python -m pytest tests/web`"
    )
    assert named_paths(text) == {
        "inference/runtime/engine.py",
        "bench/cpu_paths.py",
        "tests/inference/runtime/",
        "tests/inference/native/",
        "docs/latency.md",
        "tests/web",
    }
    assert named_modules(text) == {"bench.engine.prefill", "pytest"}
    assert not exists("bench/cpu_paths.py") and exists("bench/engine/cpu_paths.py")
    assert not runnable("bench.noise") and runnable("bench.serving.noise")
    assert runnable("bench") and runnable("pytest")
    links = "[a](speed.md), [b](../README.md#layout), [c](https://example.org/x)"
    assert named_links(ROOT / "docs" / "api.md", links) == {"docs/speed.md", "README.md"}
    total = sum(len(named_paths(d.read_text())) for d in DOCS)
    assert total > 100, total
