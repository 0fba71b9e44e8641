"""waitress wiring: the HTTP server around the Flask app, with waitress' own errors (bad
request lines, over-size bodies and headers, framing it refuses, requests that never finish
arriving) answered in the same JSON shape as the app's, and its limits and timeouts set from
the config.

What waitress does not check itself, checked here before a request reaches Flask:
HTTP versions other than 1.0 and 1.1 (505), Transfer-Encoding together with Content-Length
or in HTTP/1.0 (400: the two framings could disagree, the classic request-smuggling setup).
A request that has begun to arrive but is not complete within `--http-read-timeout` (a
chunked body that never ends, a Content-Length larger than what was sent, headers trickled
a byte at a time) is answered 408, not dropped in silence at the idle timeout.

Past `--connection-limit` open connections, HEALTH_RESERVE more are still accepted, for
health checks: such a connection is served for `GET /health` only and then closed; any other
request on it is answered 503 (`overloaded`, Retry-After) at once, and one that sends no
whole request within RESERVE_TIMEOUT_S is closed. Only past the reserve too do new
connections wait in the kernel's backlog (waitress alone makes everything wait there, until
an idle connection times out: ~30 s).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import resource
import threading
import time

from waitress import wasyncore
from waitress.adjustments import Adjustments
from waitress.channel import HTTPChannel
from waitress.parser import (
    HTTPRequestParser,
    ParsingError,
    TransferEncodingNotImplemented,
    crack_first_line,
    split_uri,
)
from waitress.server import MultiSocketServer, TcpWSGIServer
from waitress.task import ErrorTask, ThreadedTaskDispatcher
from waitress.utilities import BadRequest, Error

from service.config import Config
from web.errors import Refused

# waitress checks its timeouts this often (seconds; its own default is 30)
MAINTENANCE_INTERVAL_S = 1
# File descriptors the process needs besides one per connection: model files, logs, pipes.
SPARE_FDS = 64
# Connections accepted past --connection-limit for health checks, and how long one may take
# to send its request: they are few and short-lived, so a full server still answers /health.
HEALTH_RESERVE = 8
RESERVE_TIMEOUT_S = 2.0
HEALTH_PATH = "/health"
RESERVE_RETRY_AFTER_S = 1
CLOSE_WAIT_S = 5.0  # at close, how long the request threads may take to finish their answers


class ListenError(RuntimeError):
    """The HTTP port cannot be opened; the message says why and what to do."""


class RequestTimeout(Error):
    code = 408
    reason = "Request Timeout"


class VersionNotSupported(Error):
    code = 505
    reason = "HTTP Version Not Supported"


class ConnectionsFull(Error):
    code = 503
    reason = "Service Unavailable"


class JsonErrorTask(ErrorTask):
    """waitress answers malformed requests itself, before Flask; in text/plain by default."""

    def execute(self):
        error = self.request.error
        refusal = Refused(error.reason, error.body, error.code)
        method, path = _asked(self.request)
        # The app counts it like any other request and shapes it in the path's dialect.
        body = json.dumps(self.channel.server.refused(method, path, refusal))
        self.status = f"{error.code} {error.reason}"
        self.response_headers.append(("Content-Type", "application/json"))
        if error.code == 503:
            self.response_headers.append(("Retry-After", str(RESERVE_RETRY_AFTER_S)))
        self.set_close_on_finish()
        self.content_length = len(body)
        self.write(body.encode())


def _asked(request) -> tuple[str, str]:
    """The method and path a refused request asked for, for its answer's dialect: read from
    its request line even when a header after it was refused (waitress reads the headers
    before it sets them); empty when the line never came whole or cannot be read."""
    method, path = request.command or "", request.path or ""
    first = getattr(request, "first_line", None)
    if path or not first:
        return method, path
    try:
        command, uri, _ = crack_first_line(first)
        return command.decode("latin-1"), split_uri(uri)[2]
    except (ParsingError, UnicodeError, ValueError):
        return method, path


class StrictRequestParser(HTTPRequestParser):
    """waitress' parser, refusing what it lets through: unknown versions, ambiguous framing."""

    # Until its request line is read: waitress' channel names the path when a client leaves
    # during the answer to a request refused before that (an AttributeError traceback).
    command = path = ""

    def __init__(self, adj, reserve: bool = False):
        super().__init__(adj)
        self.begun = time.time()  # created when a request's first bytes arrive
        self.reserve = reserve  # on a connection past the limit: /health only, then close

    def parse_header(self, header_plus):
        try:
            super().parse_header(header_plus)
        except TransferEncodingNotImplemented:
            raise TransferEncodingNotImplemented(
                "only Transfer-Encoding: chunked is supported; send the body with it or with "
                "Content-Length"
            ) from None
        error = self._refusal() or self._past_the_limit()
        if error is not None:
            self.error = error
            # Read no body: the answer closes the connection, whatever else was sent.
            self.body_rcv, self.chunked, self.content_length = None, False, 0

    def _refusal(self) -> Error | None:
        if not self.version:
            return BadRequest("the request line has no HTTP version (HTTP/1.1 or HTTP/1.0)")
        if self.version not in ("1.0", "1.1"):
            return VersionNotSupported(
                f"HTTP/{self.version} is not supported; use HTTP/1.1 or HTTP/1.0"
            )
        if self.chunked and "CONTENT_LENGTH" in self.headers:
            return BadRequest("a request may have Transfer-Encoding or Content-Length, not both")
        if "TRANSFER_ENCODING" in self.headers:  # waitress reads it in HTTP/1.1 only
            return BadRequest("Transfer-Encoding is not allowed in HTTP/1.0")
        return None

    def _past_the_limit(self) -> Error | None:
        """On a reserve connection: /health is served (and the connection then closed),
        anything else refused at once."""
        if not self.reserve:
            return None
        self.headers["CONNECTION"] = "close"
        if self.command == "GET" and self.path == HEALTH_PATH:
            return None
        return ConnectionsFull(
            "the server's connection limit is reached (--connection-limit); retry shortly"
        )


class JsonErrorChannel(HTTPChannel):
    error_task_class = JsonErrorTask
    parser_class = StrictRequestParser
    reserve = False  # accepted past --connection-limit (HEALTH_RESERVE)

    def as_reserve(self) -> None:
        self.reserve = True
        self.parser_class = functools.partial(StrictRequestParser, reserve=True)

    def answer_unfinished(self, now: float, read_timeout: float, idle_timeout: float) -> None:
        """In waitress' main loop: a request begun `read_timeout` ago, or idle for
        `idle_timeout`, and still incomplete is answered 408 (and the connection closed)."""
        with self.requests_lock:
            request = self.request
            if (
                request is None
                or self.requests  # one is being served; its turn comes after
                or self.will_close
                or self.close_when_flushed
            ):
                return
            if now - request.begun < read_timeout and now - self.last_activity < idle_timeout:
                return
            request.error = RequestTimeout(
                f"the request did not arrive in full within {read_timeout:g} s (a body "
                "shorter than its Content-Length, or a chunked body without its last chunk?)"
            )
            request.completed = True
            self.request = None
            self.requests.append(request)
            self.server.add_task(self)


class DeskchatServer(TcpWSGIServer):
    channel_class = JsonErrorChannel
    read_timeout = 10.0  # seconds; make_http_server() sets it from the config
    # refused(method, path, Refused) -> the error body: what waitress answers itself is
    # counted by the app's metrics and shaped in the path's dialect (web/app.py)
    refused = None

    def maintenance(self, now):
        for channel in list(self.active_channels.values()):
            if channel.reserve and not channel.requests:
                if now - channel.last_activity > RESERVE_TIMEOUT_S:
                    channel.will_close = True
                continue
            channel.answer_unfinished(now, self.read_timeout, self.adj.channel_timeout)
        super().maintenance(now)  # closes connections idle with no request at all

    def _open(self) -> int:
        return sum(1 for c in self.active_channels.values() if not c.reserve)

    def readable(self):
        """Accept while the reserve has room too; waitress pauses at the limit itself."""
        readable = super().readable()  # runs maintenance; logs entering and leaving overflow
        if not self.accepting or readable:
            return readable
        reserve = len(self.active_channels) - self._open()
        return reserve < HEALTH_RESERVE

    def handle_accept(self):
        over = self._open() >= self.adj.connection_limit
        before = set(self.active_channels)
        super().handle_accept()
        if over:
            for fd in set(self.active_channels) - before:
                self.active_channels[fd].as_reserve()

    def close(self):
        """Let the request threads finish what they are answering, then stop listening and
        close every open connection: that ends waitress' loop. Closing first removed the
        trigger a finishing thread wakes the loop with: it logged a 'Bad file descriptor'
        traceback (seen in CI, in a test that ran after a closed server's)."""
        dispatcher = getattr(self, "task_dispatcher", None)  # none if unbound
        if dispatcher is not None:
            dispatcher.shutdown(timeout=CLOSE_WAIT_S)
        super().close()
        for channel in list(getattr(self, "active_channels", {}).values()):  # none if unbound
            channel.close()


def make_http_server(config: Config, app):
    """The waitress server for `app`; bound at once, served by start_http_thread().
    Raises ListenError when the address cannot be listened on."""
    _ensure_file_limit(config.connection_limit + SPARE_FDS)
    try:
        return _bind(config, app)
    except OSError as exc:
        raise ListenError(_bind_failure(config, exc)) from None
    except ValueError as exc:  # waitress' own check of host and port
        raise ListenError(f"cannot listen on {config.host}:{config.port}: {exc}") from None


def _bind_failure(config: Config, exc: OSError) -> str:
    where = f"{config.host}:{config.port}"
    if exc.errno == errno.EADDRINUSE:
        return (
            f"port {config.port} on {config.host} is already in use by another program: "
            "stop that program or choose another --port"
        )
    if exc.errno == errno.EACCES:
        return (
            f"not allowed to listen on {where}: ports below 1024 need root or "
            "CAP_NET_BIND_SERVICE; choose a --port from 1024 up"
        )
    if exc.errno == errno.EADDRNOTAVAIL:
        return (
            f"{config.host} is not an address of this PC, so nothing can listen on it: "
            "use one of its own addresses, 127.0.0.1, or 0.0.0.0 for all of them (--host)"
        )
    return f"cannot listen on {where}: {exc.strerror or exc}; check --host and --port"


def _ensure_file_limit(needed: int) -> None:
    """Raise the soft limit on open files to `needed` if the hard limit allows it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise ListenError(
            f"--connection-limit needs about {needed} open files but this process may open "
            f"only {hard}: lower --connection-limit, or raise the limit (LimitNOFILE= in the "
            "systemd unit, ulimit -n in a shell)"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


def _bind(config: Config, app):
    adj = Adjustments(
        host=config.host,
        port=config.port,
        threads=config.waitress_threads,
        channel_request_lookahead=1,  # gives handlers environ["waitress.client_disconnected"]
        # waitress refuses over-size bodies before Flask sees them; a roomier bound than the
        # app's keeps the app's own 413 the usual one while memory stays bounded.
        max_request_body_size=max(1 << 20, 16 * config.max_body_bytes),
        # Open connections at most; more wait in the kernel's backlog. poll() instead of
        # select(), which fails outright on a descriptor numbered 1024 or more.
        connection_limit=config.connection_limit,
        asyncore_use_poll=True,
        channel_timeout=config.http_idle_timeout,  # an idle keep-alive connection closes
        cleanup_interval=MAINTENANCE_INTERVAL_S,
        ident="deskchat",
        # waitress would drop X-Forwarded-For from every peer; the app believes it only from
        # the proxies in --trusted-proxies (web/access/proxy.py).
        clear_untrusted_proxy_headers=False,
    )
    dispatcher = ThreadedTaskDispatcher()
    dispatcher.set_thread_count(adj.threads)
    socket_map: dict = {}
    servers = []
    try:
        for sockinfo in adj.listen:  # a host name may stand for an IPv4 and an IPv6 address
            server = DeskchatServer(
                app, socket_map, dispatcher=dispatcher, adj=adj, sockinfo=sockinfo
            )
            server.read_timeout = config.http_read_timeout
            server.refused = app.extensions["deskchat.refused"]
            servers.append(server)
    except BaseException:
        wasyncore.close_all(socket_map)  # what was opened before the failure
        dispatcher.shutdown(timeout=1)
        raise
    if len(servers) == 1:
        return servers[0]
    listening = [(s.effective_host, s.effective_port) for s in servers]
    return MultiSocketServer(socket_map, adj, listening, dispatcher, servers[0].log_info)


def start_http_thread(server) -> threading.Thread:
    """Serve in a daemon thread; closing the server from elsewhere ends it quietly."""

    def run() -> None:
        # The loop ends once server.close() has closed every socket; a poll() racing with
        # that may fail on a socket just shut.
        with contextlib.suppress(OSError):
            server.run()

    thread = threading.Thread(target=run, name="http", daemon=True)
    thread.start()
    return thread
