"""deskchat's entry point: settings -> HTTP up (503 while loading) -> model -> warm-up -> ready.

Readiness is told to systemd through sd_notify: STATUS= while fetching/loading/warming up,
READY=1 only after the warm-up generation, WATCHDOG=1 only while the inference thread lives.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import threading

from waitress.server import create_server

from inference.config import Config, ConfigError, load_config
from inference.embedded import EmbeddedMissing
from inference.jobs import Sampling
from inference.loading import ModelLoadError, choose_model, load_model
from inference.worker import Worker
from web.app import Runtime, create_app

log = logging.getLogger("deskchat")

WARMUP_TOKENS = 8


class Notifier:
    """sd_notify over $NOTIFY_SOCKET; does nothing when not started by systemd."""

    def __init__(self, address: str | None):
        self._address = address
        if address and address.startswith("@"):
            self._address = "\0" + address[1:]  # abstract socket namespace

    def send(self, message: str) -> None:
        if not self._address:
            return
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.sendto(message.encode(), self._address)
        except OSError as exc:
            log.debug("sd_notify failed: %s", exc)

    def status(self, text: str) -> None:
        log.info("%s", text)
        self.send(f"STATUS={text}")


def _watchdog(notifier: Notifier, worker: Worker, stop: threading.Event) -> None:
    """Ping systemd at half its WatchdogSec, and only while the inference thread is alive."""
    usec = int(os.environ.get("WATCHDOG_USEC", "0") or 0)
    if usec <= 0:
        return
    while not stop.wait(usec / 2e6):
        if worker.alive:
            notifier.send("WATCHDOG=1")


def _warm_up(worker: Worker, runtime_prompts) -> None:
    ids = runtime_prompts.encode([{"role": "user", "content": "Hello"}])
    worker.run_now(ids, Sampling(max_tokens=WARMUP_TOKENS))


def make_http_server(config: Config, runtime: Runtime):
    """The waitress server around create_app(); bound at once, served by .run()."""
    return create_server(
        create_app(config, runtime),
        host=config.host,
        port=config.port,
        threads=config.waitress_threads,
        channel_request_lookahead=1,  # gives handlers environ["waitress.client_disconnected"]
        # waitress answers over-size bodies in plain text before Flask sees them; give it a
        # roomier bound so the app's own limit, with its JSON error, is the one users meet.
        max_request_body_size=max(1 << 20, 16 * config.max_body_bytes),
        ident="deskchat",
    )


def start_http_thread(server) -> threading.Thread:
    """Serve in a daemon thread; closing the server from elsewhere ends it quietly."""

    def run() -> None:
        # waitress' select() fails on the sockets that server.close() shut: that is the end.
        with contextlib.suppress(OSError):
            server.run()

    thread = threading.Thread(target=run, name="http", daemon=True)
    thread.start()
    return thread


def serve(config: Config) -> int:
    notifier = Notifier(os.environ.get("NOTIFY_SOCKET"))
    runtime = Runtime()
    server = make_http_server(config, runtime)
    start_http_thread(server)
    log.info("listening on http://%s:%d (%d HTTP threads)", config.host, config.port,
             config.waitress_threads)

    def status(text: str) -> None:
        runtime.status = text
        notifier.status(text)

    try:
        choice = choose_model(config, status)
        engine, prompts = load_model(choice, config, status)
    except (ModelLoadError, EmbeddedMissing) as exc:
        log.error("cannot start: %s", exc)
        notifier.send(f"STATUS=failed: {exc}")
        server.close()
        return 2

    worker = Worker(engine, config.max_queue).start()
    status("warming up")
    _warm_up(worker, prompts)
    runtime.prompts, runtime.model_name, runtime.status = prompts, engine.name, "ready"
    runtime.worker = worker  # last: from here on /chat and /health serve
    status(f"ready: serving {engine.name}")
    notifier.send("READY=1")

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    threading.Thread(target=_watchdog, args=(notifier, worker, stop), daemon=True).start()
    stop.wait()
    notifier.send("STOPPING=1")
    log.info("stopping")
    server.close()
    worker.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        config = load_config(argv)
    except ConfigError as exc:
        print(f"server.py: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return serve(config)


if __name__ == "__main__":
    sys.exit(main())
