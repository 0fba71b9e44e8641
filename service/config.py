"""The one typed settings object: defaults <- DESKCHAT_* environment <- command-line flags.

Each setting is declared once (name, type, default, help); the environment variable and the
flag are derived from that declaration, and `load_config()` is the only place that reads them.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import math
import os
import re
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from service.cpu_list import cpu_list_problem

DEFAULT_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
EMBEDDED_MODEL = "embedded"
THINKING_CHOICES = ("auto", "on", "off")
QUANTIZE_CHOICES = ("auto", "none", "int8", "int8-row", "int4-row", "int4")
INT8_ENGINE_CHOICES = ("auto", "fbgemm", "onednn", "qnnpack")
DTYPE_CHOICES = ("auto", "float32", "bfloat16")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
GC_POLICIES = ("python", "idle")  # inference/host/process.py applies them
THREAD_POLICIES = ("adaptive", "fixed")  # inference/host/threads.py
SAMPLING_DEFAULTS = ("model", "greedy")  # inference/loading/assemble.py: sampling_defaults()


def physical_cores() -> int:
    """Physical cores, not hyper-threads: a second thread on one core only fights for bandwidth."""
    import psutil

    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


def default_prefix_cache_mb() -> int:
    """A sixteenth of the PC's RAM, at most 1 GiB: 512 MB on an 8 GB office PC holds about
    40,000 tokens of Qwen2.5-0.5B's keys and values."""
    import psutil

    return max(16, min(1024, psutil.virtual_memory().total // 16 // 2**20))


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "deskchat"


def _cpu_list(text: str) -> str | None:
    return cpu_list_problem(text)


def _slice(microseconds: int) -> str | None:
    """The kernel takes slices of 100 us to 100 ms (0: its default); it would clamp others."""
    if 0 < microseconds < 100:
        return "must be 0 (the kernel's default) or 100 to 100000 microseconds"
    return None


def _networks(text: str) -> str | None:
    """Why `text` is not a comma-separated list of addresses or CIDRs, or None."""
    for item in filter(None, (part.strip() for part in text.split(","))):
        try:
            ipaddress.ip_network(item, strict=False)
        except ValueError as exc:
            return str(exc)
    return None


# A DNS name: dot-separated labels of letters, digits and inner hyphens.
_HOST_NAME = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*\.?")


def host_problem(host: str) -> str | None:
    """Why nobody could listen on `host`, or None: it must be an IP address or a name that
    resolves (IPv6 without brackets)."""
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        pass
    if not _HOST_NAME.fullmatch(host) or re.fullmatch(r"[0-9.]+", host):
        return "not an IP address (such as 127.0.0.1 or 0.0.0.0) nor a host name"
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        return f"the name does not resolve ({getattr(exc, 'strerror', None) or exc})"
    return None


def _setting(
    default, help: str, minimum: float | None = None, maximum: float | None = None, **extra
):
    """One setting's declaration. `extra` may hold check (a function: why a value is wrong,
    or None), choices, upper (compare in upper case) and default_doc (what docs/settings.md
    shows for a default computed per PC)."""
    meta = {"help": help, "min": minimum, "max": maximum, **extra}
    if callable(default):
        return field(default_factory=default, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class Config:
    host: str = _setting(
        "127.0.0.1", "Address to listen on; 0.0.0.0 opens it to the LAN.", check=host_problem
    )
    port: int = _setting(8080, "TCP port to listen on.", 1, 65535)
    model: str = _setting(
        DEFAULT_MODEL,
        "ModelScope model id, a local Hugging Face folder, or 'embedded' (SmolLM2-135M).",
    )
    revision: str = _setting("master", "ModelScope revision (branch, tag or commit) to fetch.")
    modelscope_endpoint: str | None = _setting(
        None, "ModelScope hub address; empty means modelscope's own default."
    )
    download_timeout: float = _setting(
        10.0, "Seconds to wait for the hub before declaring it unreachable.", 0.1, 600
    )
    strict_model: bool = _setting(
        False, "Exit instead of falling back to the embedded model when the model is missing."
    )
    cache_dir: Path = _setting(
        default_cache_dir,
        "Where downloaded and converted models are kept.",
        default_doc="`$XDG_CACHE_HOME/deskchat`, else `~/.cache/deskchat`",
    )
    threads: int = _setting(
        physical_cores,
        "Inference threads (default: physical cores).",
        1,
        1024,
        default_doc="this PC's physical cores",
    )
    thread_policy: str = _setting(
        "adaptive",
        "adaptive (one thread or --threads, whichever measured faster lately: now and then "
        "a few steps run on the other count and are compared with the serving count's "
        "steps of the same size; int8, int8-row and int4-row only, other quantizations keep "
        "--threads) or fixed (always --threads); docs/latency.md.",
        choices=THREAD_POLICIES,
    )
    quantize: str = _setting(
        "auto",
        "Linear layers (lm_head too): auto (int8-row where the native step or fbgemm runs; "
        "int4-row instead, on the native step, for a model of 1B parameters or more or whose "
        "int8 weights would take over a quarter of the RAM: docs/operations.md; else int8; "
        "none where no int8 kernel runs), none (float), int8-row (per-row activation "
        "scales: batch-invariant answers, closest to float; needed for --max-batch above 1), "
        "int4-row (4-bit weights in groups of 32 with int8-row's rows, on the native step "
        "only: fewer bytes a token, docs/native.md), "
        "int8 (torch.ao dynamic, one scale per forward, smoothed) or int4 "
        "(weight-only); docs/speed.md and docs/old-cpus.md have each one's measured effect.",
        choices=QUANTIZE_CHOICES,
    )
    int8_engine: str = _setting(
        "auto",
        "Kernel of the int8 Linears: auto (the fastest known to work on this CPU; "
        "docs/old-cpus.md), fbgemm (AVX2 and newer), onednn (AVX and newer) or qnnpack (SSE4.2); "
        "one this CPU cannot run is refused at start.",
        choices=INT8_ENGINE_CHOICES,
    )
    dtype: str = _setting(
        "auto",
        "Compute dtype with quantize=none: auto (float32), float32, or bfloat16 (used only "
        "where the CPU computes it natively).",
        choices=DTYPE_CHOICES,
    )
    prefix_cache: bool = _setting(
        True,
        "Keep prompts' keys and values in blocks shared by every request, so a repeated "
        "system prompt, tool list or conversation history is computed once; answers are the "
        "same with it or without it.",
    )
    prefix_cache_mb: int = _setting(
        default_prefix_cache_mb,
        "RAM the prefix cache may hold (least recently used blocks go first; all of it is "
        "given back when the PC runs short of memory).",
        1,
        1_048_576,
        default_doc="a sixteenth of this PC's RAM, at most 1024",
    )
    native: bool = _setting(
        True,
        "Run the decode step in deskchat's own C library, built for this CPU with its C "
        "compiler (at install, or at start when missing); off, or without a compiler, the "
        "torch step serves. docs/native.md.",
    )
    speculate: bool = _setting(
        True,
        "Check the tokens an answer's prompt suggests come next (prompt lookup) in the same "
        "step, keeping those the model picks: the same answer in fewer steps when it copies "
        "from the prompt; only with batch-invariant int8-row. docs/speculation.md.",
    )
    sampling_defaults: str = _setting(
        "model",
        "What a request that leaves out temperature, top_p, top_k, min_p or "
        "repetition_penalty gets: model (the model folder's generation_config.json, as "
        "transformers and vLLM; greedy where it has none) or greedy (temperature 0, no "
        "penalty).",
        choices=SAMPLING_DEFAULTS,
    )
    max_queue: int = _setting(
        4, "Jobs that may wait behind the running ones; more get 503.", 1, 1000
    )
    max_batch: int = _setting(
        4,
        "Jobs generated side by side in one batch (continuous batching; needs int8-row, which "
        "auto serves from AVX2 on, else one job at a time); 1 runs one job at a time. "
        "docs/batching.md has the measured curve.",
        1,
        64,
    )
    batch_memory_mb: int = _setting(
        512,
        "MB of KV cache for all running jobs; a job whose prompt plus max_tokens would not "
        "fit waits in the queue until running ones end (a job alone always runs).",
        1,
        1_048_576,
    )
    request_timeout: float = _setting(
        120.0,
        "Seconds a request may take in all, queue wait and generation together.",
        0.1,
        86400,
    )
    max_tokens_default: int = _setting(256, "max_tokens when a request does not say.", 1, 1_000_000)
    max_tokens_cap: int = _setting(1024, "Upper limit on any request's max_tokens.", 1, 1_000_000)
    thinking: str = _setting(
        "auto",
        "A thinking model's thought before its answer (Qwen3's): auto (the model's template "
        "decides: Qwen3 thinks), on or off; a request may say otherwise (docs/api.md "
        "'Thinking').",
        choices=THINKING_CHOICES,
    )
    thinking_budget: int = _setting(
        0,
        "Most tokens a thought may take before the server closes it; 0: only the rule that "
        "leaves the answer min(64, max_tokens / 4) of its tokens.",
        0,
        1_000_000,
    )
    context_tokens: int = _setting(
        4096,
        "Prompt plus answer limit in tokens (also bounded by the model's own).",
        16,
        1_048_576,
    )
    max_prompt_tokens: int = _setting(
        3072,
        "Prompt tokens one request may bring (system text and history included); more get "
        "413. The default leaves the context room for the longest answer allowed "
        "(docs/api.md 'Admission').",
        1,
        1_048_576,
    )
    max_body_bytes: int = _setting(65536, "Largest accepted request body in bytes.", 256, 64 << 20)
    trusted_proxies: str | None = _setting(
        None,
        "Comma-separated addresses or CIDRs of reverse proxies (nginx) whose X-Forwarded-For "
        "names the client in the log; empty trusts none.",
        check=_networks,
    )
    http_threads: int = _setting(
        0,
        "waitress threads; 0 means max_batch + max_queue + 3, so /health answers while all "
        "are busy.",
        0,
        2000,
    )
    connection_limit: int = _setting(
        500,
        "Open HTTP connections at most (idle ones included); past it a few more are taken "
        "for /health only (others get a quick 503), then more wait in the kernel's backlog "
        "until one closes.",
        1,
        100_000,
    )
    http_idle_timeout: int = _setting(
        30, "Seconds an idle keep-alive HTTP connection stays open.", 1, 86400
    )
    http_read_timeout: int = _setting(
        10,
        "Seconds a client has to send a whole request once it began; an incomplete one is "
        "answered 408.",
        1,
        3600,
    )
    cpu_affinity: str | None = _setting(
        None,
        "CPUs for the inference thread and its OpenMP threads, as a list like 1 or 0-1,3; "
        "the HTTP threads keep off them where other CPUs are left; --threads is capped at "
        "their number. Empty: no pinning (docs/latency.md).",
        check=_cpu_list,
    )
    sched_slice_us: int = _setting(
        0,
        "Scheduler slice in microseconds the server's threads ask the kernel for (Linux 6.12 "
        "and newer): with a short one (the dedicated-pc profile's 100), a thread handed a "
        "token takes the CPU from a busy program at once instead of at the next tick, and the "
        "owner's programs wait longer for theirs; the share of the CPUs stays the nice's. 0 "
        "keeps the kernel's default (docs/latency.md).",
        0,
        100_000,
        check=_slice,
    )
    realtime_first_step_ms: int = _setting(
        0,
        "Run a request's first step (its prompt, up to the first token) with the inference "
        "threads at real-time priority (SCHED_FIFO 1) when that step is expected to take at "
        "most this many milliseconds: beside busy programs the first token then waits for no "
        "CPU; for that long the PC's other programs wait. Needs LimitRTPRIO=1 and "
        "RestrictRealtime=no in the unit (the dedicated-pc profile: 50), else one WARNING "
        "line and it stays off. 0: never (docs/latency.md).",
        0,
        1000,
    )
    mlock: bool = _setting(
        False,
        "Lock what is resident after the warm-up (the model, the code that runs it) in RAM "
        "with mlockall, so memory pressure cannot page it out; needs LimitMEMLOCK=infinity "
        "(the unit has it), else one WARNING line and it runs unlocked.",
    )
    gc_policy: str = _setting(
        "idle",
        "Python garbage collector: idle (freeze what exists after the warm-up; the oldest "
        "generation runs only between jobs) or python (its own thresholds).",
        choices=GC_POLICIES,
    )
    log_level: str = _setting(
        "INFO", "Logging level: DEBUG, INFO, WARNING or ERROR.", choices=LOG_LEVELS, upper=True
    )
    api_keys_file: Path | None = _setting(
        None,
        "File of API keys, one 'name:key' per line; with keys, every route but GET /health "
        "and the chat page's files needs one. Re-read on SIGHUP.",
    )
    allow_unauthenticated: bool = _setting(
        False, "Allow listening on a non-loopback address with no API keys."
    )

    @property
    def waitress_threads(self) -> int:
        return self.http_threads or self.max_batch + self.max_queue + 3


def _fields() -> list[dataclasses.Field]:
    return list(dataclasses.fields(Config))


def env_name(name: str) -> str:
    return "DESKCHAT_" + name.upper()


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _kind(f: dataclasses.Field) -> str:
    return str(f.type).replace(" | None", "")


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean (1/0, true/false), got {text!r}")


def _convert(f: dataclasses.Field, text: str):
    kind = _kind(f)
    if kind == "bool":
        return _parse_bool(text)
    if f.type.endswith("| None") and not text:
        return None
    converters = {"int": _parse_int, "float": _parse_float, "Path": _parse_path, "str": _parse_str}
    value = converters[kind](text)
    check = f.metadata.get("check")
    problem = check(value) if check else None
    if problem:
        raise ValueError(f"{value!r}: {problem}")
    choices = f.metadata.get("choices")
    if f.metadata.get("upper"):
        value = value.upper()
    if choices and value not in choices:
        raise ValueError(f"must be one of {', '.join(choices)}, got {value!r}")
    minimum, maximum = f.metadata.get("min"), f.metadata.get("max")
    if minimum is not None and value < minimum or maximum is not None and value > maximum:
        raise ValueError(f"must be {_range(f)}, got {value}")
    return value


def _range(f: dataclasses.Field) -> str:
    minimum, maximum = f.metadata.get("min"), f.metadata.get("max")
    if maximum is None:
        return f"at least {_number(minimum)}"
    return f"from {_number(minimum)} to {_number(maximum)}"


def _number(bound: float) -> str:
    """A whole bound in full (1048576, where :g says 1.04858e+06), a fraction as :g."""
    return str(bound) if isinstance(bound, int) else f"{bound:g}"


def _parse_int(text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError(f"expected a whole number, got {text!r}") from None


def _parse_float(text: str) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        raise ValueError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {text!r}")
    return value


def _parse_str(text: str) -> str:
    if not text.strip():
        raise ValueError("expected a value, got nothing")
    return text


def _parse_path(text: str) -> Path:
    if not text.strip():
        raise ValueError("expected a path, got nothing")
    return Path(text).expanduser()


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()  # type: ignore[misc]


class ConfigError(ValueError):
    """A setting's value is malformed; the message names the setting and where it came from."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="server.py",
        description="deskchat: a chat model served over HTTP from one CPU. Every flag can also "
        "be set through the environment variable shown.",
    )
    for f in _fields():
        bounds = f"; {_range(f)}" if f.metadata.get("min") is not None else ""
        help_text = f"{f.metadata['help']} [env {env_name(f.name)}; default: {_default(f)}{bounds}]"
        if _kind(f) == "bool":
            parser.add_argument(
                flag_name(f.name),
                action=argparse.BooleanOptionalAction,
                default=None,
                help=help_text,
            )
        else:
            parser.add_argument(
                flag_name(f.name), default=None, metavar=_kind(f).upper(), help=help_text
            )
    return parser


def load_config(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> Config:
    """Build the Config from defaults, then the environment, then flags; raise ConfigError."""
    environ = os.environ if environ is None else environ
    args = build_parser().parse_args(argv)
    values = {}
    for f in _fields():
        flag_value = getattr(args, f.name)
        if flag_value is not None:
            source, raw = flag_name(f.name), flag_value
        elif env_name(f.name) in environ:
            source, raw = env_name(f.name), environ[env_name(f.name)]
        else:
            continue
        if isinstance(raw, bool):
            values[f.name] = raw
            continue
        try:
            values[f.name] = _convert(f, raw)
        except ValueError as exc:
            raise ConfigError(f"{source}: {exc}") from None
    config = Config(**values)
    least = config.max_batch + config.max_queue + 1
    if 0 < config.http_threads < least:
        raise ConfigError(
            f"--http-threads {config.http_threads} is too few: {config.max_batch} running "
            f"jobs and {config.max_queue} queued ones hold a thread each, and "
            f"/health needs one more (at least {least})"
        )
    return config
