"""Who may use the service: API keys on every route but `GET /health` and the chat page's
files, a brake on key guessing, and the rule that the service never opens itself to the LAN
without keys.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
import time
from collections import deque
from collections.abc import Mapping

from service.config import Config
from web.access.keys import KeyFileError, KeyRing, read_key_file
from web.errors import TooManyFailures, Unauthorized

log = logging.getLogger("deskchat.auth")

# Open without a key: liveness for systemd and load balancers, and the chat page's files
# (no data in them; the page asks for a key when the API answers 401).
OPEN_ROUTES = {("GET", "/health"), ("HEAD", "/health"), ("GET", "/")}
OPEN_PREFIXES = (("GET", "/assets/"),)
FAILURE_WINDOW_S = 60.0
MAX_FAILURES = 10  # wrong keys per address and window before it gets 429
MAX_TRACKED_ADDRESSES = 4096  # memory bound: the oldest addresses are forgotten first


class FailureLimiter:
    """Counts failed attempts per client address over a sliding window."""

    def __init__(self, limit: int = MAX_FAILURES, window_s: float = FAILURE_WINDOW_S, clock=None):
        self.limit = limit
        self.window_s = window_s
        self._clock = clock or time.monotonic
        self._failures: dict[str, deque[float]] = {}
        self._lock = threading.Lock()

    def _recent(self, address: str, now: float) -> deque[float]:
        times = self._failures.get(address, deque())
        while times and times[0] <= now - self.window_s:
            times.popleft()
        return times

    def blocked_for(self, address: str) -> float:
        """Seconds until `address` may try again; 0 when it may now."""
        now = self._clock()
        with self._lock:
            times = self._recent(address, now)
            if len(times) < self.limit:
                return 0.0
            return times[-self.limit] + self.window_s - now

    def record(self, address: str) -> None:
        now = self._clock()
        with self._lock:
            times = self._recent(address, now)
            times.append(now)
            self._failures.pop(address, None)
            self._failures[address] = times  # most recent last
            while len(self._failures) > MAX_TRACKED_ADDRESSES:
                self._failures.pop(next(iter(self._failures)))


def guessing_unit(address: str) -> str:
    """What the brake counts by: an IPv4 address, or an IPv6 /64 (one host can hold a whole
    /64 and would otherwise get fresh addresses at will)."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if ip.version == 4:
        return str(ip)
    if ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ipaddress.ip_network(f"{ip}/64", strict=False))


def presented_key(headers: Mapping[str, str]) -> str | None:
    """`Authorization: Bearer KEY`, else `X-Api-Key: KEY`."""
    scheme, _, token = headers.get("Authorization", "").strip().partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return headers.get("X-Api-Key", "").strip() or None


def is_open(method: str, path: str) -> bool:
    if (method, path) in OPEN_ROUTES:
        return True
    return any(method == m and path.startswith(p) for m, p in OPEN_PREFIXES)


class Gate:
    def __init__(self, keys: KeyRing, limiter: FailureLimiter | None = None):
        self.keys = keys
        self.limiter = limiter or FailureLimiter()

    def admit(self, method: str, path: str, headers: Mapping[str, str], client: str) -> str | None:
        """The name of the request's key (None when no keys are configured or the route is
        open); raises Unauthorized, or TooManyFailures for an address that keeps failing."""
        if not len(self.keys) or is_open(method, path):
            return None
        client = guessing_unit(client)
        wait = self.limiter.blocked_for(client)
        if wait > 0:
            raise TooManyFailures(
                f"too many failed API key attempts from {client}; try again later", wait
            )
        presented = presented_key(headers)
        if presented is None:  # not a guess: a tool not set up yet, or a browser
            raise Unauthorized(
                "an API key is required: send 'Authorization: Bearer KEY' (or 'X-Api-Key')"
            )
        name = self.keys.name_of(presented)
        if name is None:
            self.limiter.record(client)
            raise Unauthorized("the API key is not valid")
        return name


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name that may resolve to anything: treat it as the LAN


def exposure_problem(config: Config, key_count: int) -> str | None:
    """Why the server must not start (or take these keys) as configured, or None."""
    if key_count or config.allow_unauthenticated or is_loopback(config.host):
        return None
    where = config.api_keys_file or "a key file"
    return (
        f"refusing to listen on {config.host} without API keys: anyone on the network could "
        f"use the model. Add a 'name:key' line to {where} and pass --api-keys-file "
        "(DESKCHAT_API_KEYS_FILE), or pass --allow-unauthenticated to accept that"
    )


def load_keys(config: Config) -> dict[str, bytes]:
    """The configured keys at start; raises KeyFileError (a bad file, or none on the LAN)."""
    keys = read_key_file(config.api_keys_file) if config.api_keys_file else {}
    problem = exposure_problem(config, len(keys))
    if problem:
        raise KeyFileError(problem)
    if not keys and not is_loopback(config.host):
        log.warning(
            "listening on %s with no API keys: anyone on the network may use it", config.host
        )
    return keys


def reload_keys(config: Config, ring: KeyRing) -> None:
    """SIGHUP: read the key file again; on any problem keep the keys in force and say why."""
    if config.api_keys_file is None:
        log.info("SIGHUP: no API key file configured; nothing to reload")
        return
    try:
        keys = load_keys(config)
    except KeyFileError as exc:
        log.error("SIGHUP: keeping the %d API keys in force: %s", len(ring), exc)
        return
    ring.replace(keys)
    log.info("SIGHUP: %d API keys in force (%s)", len(keys), ", ".join(sorted(keys)) or "none")
