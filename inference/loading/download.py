"""Fetch a model snapshot from ModelScope into a local cache folder.

Owns: finding ``model_id@revision`` in the cache without any network access,
checking within ``timeout_s`` that the hub answers at all, and running
modelscope's own ``snapshot_download`` for just the files a transformers load
needs. Does not own: loading the model, choosing which model to use, or deciding
where the cache lives (the caller passes ``cache_dir``).

The cache uses modelscope's layout,
``{cache_dir}/models/{owner}--{name}/snapshots/{revision}/``, so a cache filled
by ``modelscope download --cache_dir ...`` on another PC is found as is.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

import requests

from inference.loading.integrity import safetensors_problem

log = logging.getLogger("deskchat.download")
PROGRESS_EVERY_S = 30.0  # a line per file being fetched, this often

#: Files a transformers load of a safetensors LLM reads: config, generation
#: config, tokenizer files, chat templates and the weights.
ALLOW_PATTERNS = [
    "*.json",  # config, generation_config, tokenizer*, special_tokens_map, weight index
    "*.safetensors",
    "*.txt",  # merges.txt, vocab.txt
    "*.model",  # sentencepiece tokenizer.model
    "*.tiktoken",
    "*.jinja",  # chat_template.jinja
]
#: Duplicates in other formats, and exports we never load (these folders also hold *.json).
IGNORE_PATTERNS = [
    "*.bin",
    "*.pt",
    "*.pth",
    "*.ckpt",
    "*.h5",
    "*.msgpack",
    "*.gguf",
    "*.onnx",
    "onnx/*",
    "openvino/*",
    "original/*",
]

_ADVICE = (
    "connect this PC to the internet once so it can download, "
    "or pre-fill {cache_dir} with a ModelScope download of it, "
    "or use --model PATH / --model embedded"
)


class ModelUnavailable(Exception):
    """The requested ModelScope model is neither cached nor downloadable; str() says what to do."""


class ModelNotFound(Exception):
    """The hub answered that model_id@revision does not exist (not a ModelUnavailable: a
    typo in the model id is the operator's to fix, not a reason to serve another model)."""


def fetch_modelscope_model(
    model_id: str,
    revision: str,
    cache_dir: Path,
    *,
    endpoint: str | None = None,
    timeout_s: float = 10.0,
) -> Path:
    """Return the local folder of model_id@revision, downloading it into cache_dir on first use.

    A complete cached snapshot is returned without any network access. Otherwise
    the hub is probed first (an HTTP HEAD, all of it bounded by ``timeout_s``), so an
    offline PC fails in about ``timeout_s`` seconds rather than after modelscope's
    retries. ``endpoint=None`` means modelscope's own choice, read at each call:
    ``MODELSCOPE_ENDPOINT``, the deprecated ``MODELSCOPE_DOMAIN``, else modelscope.cn
    with modelscope.ai as fallback. Any failure raises ModelUnavailable (one line).
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
    cache_dir = Path(cache_dir)
    advice = _ADVICE.format(cache_dir=cache_dir)

    cached, damage = _cached_snapshot(model_id, revision, cache_dir)
    if cached is not None and damage is None:
        log.info("found %s@%s in cache at %s", model_id, revision, cached)
        return cached
    if cached is not None:
        log.info("cache at %s is incomplete (%s); will fetch the rest", cached, damage)

    # modelscope reads MODELSCOPE_ENDPOINT once per process (its default config is
    # cached on first use), so read it here and pass it on explicitly.
    endpoint = _explicit_endpoint(endpoint)
    candidates = [endpoint] if endpoint else _default_endpoints()
    reachable, why_not = _first_reachable(candidates, timeout_s)
    if reachable is None:
        where = (
            f"the copy of model {model_id}@{revision} in {cached} is incomplete or damaged "
            f"({damage})"
            if cached is not None
            else f"model {model_id}@{revision} is not in {cache_dir}"
        )
        raise ModelUnavailable(
            _one_line(
                f"{where} and ModelScope ({' or '.join(candidates)}) is unreachable "
                f"({why_not}); {advice}"
            )
        )

    # With no endpoint configured, modelscope picks its site itself; the probe only proved
    # that one answers.
    site = endpoint or f"ModelScope (reachable: {reachable})"
    log.info("downloading %s@%s from %s into %s", model_id, revision, site, cache_dir)
    from modelscope import snapshot_download

    started = time.monotonic()
    try:
        folder = Path(
            snapshot_download(
                model_id,
                revision=revision,
                cache_dir=str(cache_dir),
                endpoint=endpoint,
                allow_patterns=ALLOW_PATTERNS,
                ignore_patterns=IGNORE_PATTERNS,
                progress_callbacks=[LoggedProgress],
            )
        )
    except Exception as exc:
        if _hub_said_not_found(exc):
            raise ModelNotFound(
                f"{site} has no model {model_id} at revision {revision} (or it is private); "
                "check --model and --revision (ids look like Qwen/Qwen2.5-0.5B-Instruct), "
                "or use --model PATH / --model embedded"
            ) from exc
        raise ModelUnavailable(
            _one_line(
                f"downloading model {model_id}@{revision} from {site} failed "
                f"({type(exc).__name__}: {exc}); check the model id and revision, "
                f"run again to resume, or {advice}"
            )
        ) from exc
    problem = _incomplete(folder)
    if problem is not None:
        raise ModelUnavailable(
            _one_line(
                f"downloaded model {model_id}@{revision} into {folder} but it is not a "
                f"loadable transformers model ({problem}); choose another model, or "
                "use --model PATH / --model embedded"
            )
        )
    log.info(
        "downloaded %s@%s in %.1f s to %s", model_id, revision, time.monotonic() - started, folder
    )
    return folder


def _hub_said_not_found(exc: BaseException) -> bool:
    """Whether the hub answered 404 (modelscope_hub's NotExistError, or the requests
    HTTPError that modelscope wraps it in) anywhere in the exception's chain."""
    from modelscope_hub.errors import NotExistError

    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, NotExistError):
            return True
        response = getattr(current, "response", None)
        if isinstance(current, requests.HTTPError) and getattr(response, "status_code", 0) == 404:
            return True
        current = current.__cause__ or current.__context__
    return False


class LoggedProgress:
    """A download's progress as plain log lines (modelscope makes one per file): every
    PROGRESS_EVERY_S while it runs, and when it is complete. Unlike a progress bar, this
    reads well in a file and in the journal."""

    def __init__(self, filename: str, file_size: int):
        self.filename = filename
        self.file_size = file_size
        self.done = 0
        self.started = self.told = time.monotonic()

    def update(self, size: int) -> None:
        self.done += size
        now = time.monotonic()
        if now - self.told >= PROGRESS_EVERY_S and self.file_size > 0:
            self.told = now
            log.info(
                "fetching %s: %.0f of %.0f MB (%.0f%%)",
                self.filename,
                self.done / 1e6,
                self.file_size / 1e6,
                100 * self.done / self.file_size,
            )

    def end(self) -> None:
        log.info(
            "fetched %s (%.1f MB) in %.1f s",
            self.filename,
            max(self.done, self.file_size) / 1e6,
            time.monotonic() - self.started,
        )


def _cached_snapshot(
    model_id: str, revision: str, cache_dir: Path
) -> tuple[Path | None, str | None]:
    """The cached snapshot folder of model_id@revision, found without network, or None;
    and what is incomplete or damaged in it, or None."""
    from modelscope import snapshot_download

    try:
        folder = Path(
            snapshot_download(
                model_id, revision=revision, cache_dir=str(cache_dir), local_files_only=True
            )
        )
    except Exception as exc:  # modelscope_hub CacheNotFound, and any odd cache state
        log.debug("%s@%s not in cache %s: %s", model_id, revision, cache_dir, _one_line(str(exc)))
        return None, None
    return folder, _incomplete(folder)


def _incomplete(folder: Path) -> str | None:
    """Why folder is not a complete safetensors model snapshot, or None if it is.

    modelscope's cache lookup accepts any non-empty snapshot folder, but an
    interrupted download leaves ``*.incomplete`` partial files there and may lack
    whole files (they are fetched in parallel, in no fixed order).
    """
    if not folder.is_dir():
        return f"{folder} is not a folder"
    partial = next(folder.rglob("*.incomplete"), None)
    if partial is not None:
        return f"partial file {partial.relative_to(folder)}"
    if not (folder / "config.json").is_file():
        return "no config.json"
    if next(folder.glob("*.safetensors"), None) is None:
        return "no *.safetensors weights"
    for index in folder.glob("*.safetensors.index.json"):
        try:
            shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            return f"unreadable {index.name}: {exc}"
        missing = sorted(s for s in shards if not (folder / s).is_file())
        if missing:
            return f"missing weight shard {missing[0]}"
    for weights in sorted(folder.glob("*.safetensors")):
        problem = safetensors_problem(weights)
        if problem is not None:
            return f"{weights.name} {problem}"
    return None


def _explicit_endpoint(endpoint: str | None) -> str | None:
    """endpoint, else MODELSCOPE_ENDPOINT, else the deprecated MODELSCOPE_DOMAIN, normalised.

    Same precedence as modelscope_hub's HubConfig; None means none is set.
    """
    from modelscope_hub.config import HubConfig

    chosen = (
        endpoint
        or os.environ.get("MODELSCOPE_ENDPOINT")
        or os.environ.get("MODELSCOPE_DOMAIN", "").strip()
    )
    return HubConfig.normalize_endpoint(chosen) if chosen else None


def _default_endpoints() -> list[str]:
    """The sites modelscope tries when no endpoint is set, in its order.

    modelscope.cn then modelscope.ai (.ai first with MODELSCOPE_PREFER_AI_SITE=true),
    as in modelscope_hub's HubApi.resolve_endpoint_for_read.
    """
    from modelscope_hub.constants import DEFAULT_ENDPOINT, DEFAULT_INTL_ENDPOINT

    prefer_ai = os.environ.get("MODELSCOPE_PREFER_AI_SITE", "").strip().lower() in (
        "1",
        "true",
        "yes",
        "on",
    )
    if prefer_ai:
        return [DEFAULT_INTL_ENDPOINT, DEFAULT_ENDPOINT]
    return [DEFAULT_ENDPOINT, DEFAULT_INTL_ENDPOINT]


def _first_reachable(endpoints: list[str], timeout_s: float) -> tuple[str | None, str]:
    """Probe all endpoints at once; return (first that answered in timeout_s, last error).

    Any HTTP answer counts: the point is only to tell "offline" apart quickly,
    because modelscope's own listing retries take 7 s against a refused port and
    over a minute against a silent one. Each probe runs in a daemon thread so a
    server that accepts and then trickles bytes cannot stretch the deadline.
    """
    done = threading.Condition()
    answered: list[str] = []
    errors: list[str] = []

    def probe(url: str) -> None:
        try:
            requests.head(url + "/", timeout=(timeout_s, timeout_s), allow_redirects=False).close()
        except requests.RequestException as exc:
            with done:
                errors.append(_short_error(exc))
                done.notify_all()
            return
        with done:
            answered.append(url)
            done.notify_all()

    for url in endpoints:
        threading.Thread(target=probe, args=(url,), name="deskchat-probe", daemon=True).start()
    deadline = time.monotonic() + timeout_s
    with done:
        while not answered and len(errors) < len(endpoints):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            done.wait(left)
        if answered:
            # Of those that answered by the time this thread woke, the earlier in the list.
            return min(answered, key=endpoints.index), ""
        return None, errors[-1] if errors else f"no answer within {timeout_s:g} s"


def _short_error(exc: requests.RequestException) -> str:
    if isinstance(exc, requests.Timeout):
        return f"no answer: {type(exc).__name__}"
    if isinstance(exc, requests.ConnectionError):
        reason = str(exc)
        for marker in (
            "Connection refused",
            "Name or service not known",
            "Network is unreachable",
            "No route to host",
            "Temporary failure in name resolution",
        ):
            if marker in reason:
                return marker.lower()
        return "connection failed"
    return type(exc).__name__


def _one_line(text: str) -> str:
    return " ".join(text.split())
