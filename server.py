"""deskchat's entry point: settings -> HTTP up (503 while loading) -> model -> warm-up -> ready.

Readiness is told to systemd through sd_notify: STATUS= while fetching/loading/warming up,
READY=1 only after the warm-up generation, WATCHDOG=1 only while the inference thread shows
progress. SIGTERM stops it in order: new and queued requests get 503, then the port closes.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import sys
import threading
import time

from inference.host import cpu, heap
from inference.host.process import (
    Pinning,
    apply_gc_policy,
    lock_memory,
    name_this_thread,
    set_slice,
)
from inference.host.realtime import RealtimeFirstStep
from inference.host.threads import governor_for
from inference.loading.assemble import (
    ModelLoadError,
    choose_model,
    load_model,
    plan_for,
    sampling_defaults,
)
from inference.loading.embedded import EmbeddedMissing
from inference.runtime.budget import answer_budget
from inference.runtime.grammar import SchemaCompiler
from inference.runtime.jobs import Sampling
from inference.runtime.worker import Worker
from service.config import Config, ConfigError, load_config
from service.cpu_list import parse_cpu_list
from service.log_text import OneLineFormatter
from web.access.auth import load_keys, reload_keys
from web.access.keys import KeyFileError
from web.app import Runtime, create_app
from web.transport import ListenError, make_http_server, start_http_thread

log = logging.getLogger("deskchat")

WARMUP_TOKENS = 8
DRAIN_S = 1.0  # after the worker stops: time for handlers to send their 503s


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


def watchdog_period() -> float:
    """systemd's WatchdogSec in seconds (0: no watchdog)."""
    return int(os.environ.get("WATCHDOG_USEC", "0") or 0) / 1e6


def _watchdog(notifier: Notifier, worker: Worker, stop: threading.Event) -> None:
    """Ping systemd at half its WatchdogSec while the inference thread lives and shows a
    sign of progress (a token, or an idle tick) within the last WatchdogSec."""
    period = watchdog_period()
    if period <= 0:
        return
    while not stop.wait(period / 2):
        if worker.alive and time.monotonic() - worker.heartbeat < period:
            notifier.send("WATCHDOG=1")


class _Interrupted(Exception):
    """SIGTERM or SIGINT arrived before the service was ready."""


# Start-up failures whose message already names the cause and what to do.
STARTUP_ERRORS = (ListenError, ModelLoadError, EmbeddedMissing, KeyFileError)


def startup_failure(exc: BaseException, notifier: Notifier) -> int:
    """One ERROR line for a start-up failure, no traceback (that only at DEBUG); exit 2."""
    if isinstance(exc, STARTUP_ERRORS):
        why = str(exc)
    else:
        detail = " ".join(str(exc).split())[:300]
        why = (
            f"unexpected {type(exc).__name__}: {detail} (run with --log-level DEBUG "
            "for the details)"
        )
        log.debug("start-up failure", exc_info=exc)
    log.error("cannot start: %s", why)
    notifier.send(f"STATUS=failed: {why}")
    return 2


def _pinning(config: Config) -> tuple[Config, Pinning | None]:
    """The CPU split of --cpu-affinity, with --threads capped at the pinned CPUs; the main
    thread takes its share now, before it starts the HTTP threads (they inherit it)."""
    if not config.cpu_affinity:
        return config, None
    pinning = Pinning(parse_cpu_list(config.cpu_affinity))
    if pinning.threads(config.threads) < config.threads:
        log.info(
            "--threads %d capped at %d: --cpu-affinity %s pins that many CPUs",
            config.threads,
            pinning.threads(config.threads),
            config.cpu_affinity,
        )
        config = dataclasses.replace(config, threads=pinning.threads(config.threads))
    pinning.pin_others()
    return config, pinning


def _ask_for_slice(microseconds: int) -> None:
    """--sched-slice-us, in the main thread before it starts any other; one log line. 0
    asks for the kernel's default, whatever slice the server was started with."""
    problem = set_slice(microseconds)
    if not microseconds:
        return
    if problem:
        log.warning("--sched-slice-us: %s", problem)
    else:
        log.info("scheduler slice %d us for every thread (sched_setattr)", microseconds)


def _settle_host(config: Config) -> None:
    """After the warm-up, with the model resident: lock it, then the GC policy."""
    if config.mlock:
        problem = lock_memory()
        if problem:
            log.warning("%s", problem)
    apply_gc_policy(config.gc_policy)


def serve(config: Config, plan: cpu.Plan, pinning: Pinning | None) -> int:
    notifier = Notifier(os.environ.get("NOTIFY_SOCKET"))
    runtime = Runtime()
    runtime.cpu = plan.as_dict()
    try:
        runtime.keys.replace(load_keys(config))
    except KeyFileError as exc:
        return startup_failure(exc, notifier)
    stop = threading.Event()
    wake = threading.Event()  # the main thread's doorbell: a stop, or a SIGHUP to handle
    reload_asked = threading.Event()

    def on_signal(*_):
        if not runtime.ready:
            raise _Interrupted()
        stop.set()
        wake.set()

    def on_hangup(*_):  # the work happens in the main loop, not in the handler
        reload_asked.set()
        wake.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    signal.signal(signal.SIGHUP, on_hangup)

    try:
        server = make_http_server(config, create_app(config, runtime))
    except ListenError as exc:
        return startup_failure(exc, notifier)
    start_http_thread(server)
    log.info(
        "listening on http://%s:%d (%d HTTP threads)",
        config.host,
        config.port,
        config.waitress_threads,
    )

    def status(text: str) -> None:
        runtime.status = text
        notifier.status(text)

    # Made before the model is known: auto's weights, settled at the load (Plan.for_model),
    # are int8-row or int4-row, both the same bits on any thread count, so this stays right.
    governor = governor_for(  # ticks in the inference thread, after the load: engine is set
        config.thread_policy, plan.quantize, config.threads, lambda n: worker.engine.set_threads(n)
    )
    runtime.thread_governor = governor
    realtime = RealtimeFirstStep(config.realtime_first_step_ms, config.sched_slice_us)
    worker = Worker(
        None,
        config.max_queue,
        config.max_batch,
        config.batch_memory_mb * 1024 * 1024,
        pace=governor.tick if governor is not None else None,
        realtime=realtime,
    )
    period = watchdog_period()
    if period > 0:  # an idle worker beats within the period, or pings are skipped
        worker.idle_tick = min(worker.idle_tick, period / 4)
    prompts = grammars = None

    def build_grammars(tokenizer, vocab_size: int) -> None:
        """The grammar tables, built before the weights load (their build peaks at about
        twice what they keep) and not under the first JSON request's lock (2 s on Qwen)."""
        nonlocal grammars
        grammars = SchemaCompiler(lambda use: use(tokenizer), vocab_size)  # no handler yet
        try:
            grammars.warm()
        except Exception as exc:  # llguidance's own: not the model folder's fault
            raise ModelLoadError(
                f"cannot build the JSON-schema tables from {choice.path}'s tokenizer "
                f"({type(exc).__name__}: {' '.join(str(exc).split())[:200]})"
            ) from None

    def load():  # runs in the inference thread: the model is built where it will run
        nonlocal prompts
        name_this_thread()  # torch's OpenMP threads, started from here, inherit the name
        if pinning:
            pinning.pin_inference()  # ... and this CPU mask
        engine, prompts = load_model(choice, config, status, build_grammars, plan)
        engine.set_threads(config.threads)  # the native step's pool; torch's ops on one
        realtime.check()  # a refusal is logged before the warm-up
        return engine

    def abandon() -> None:
        worker.stop()
        server.close()

    try:
        choice = choose_model(config, status)
        engine = worker.start(load).engine
        status("warming up")
        hello = prompts.encode([{"role": "user", "content": "Hello"}])
        budget = answer_budget(len(hello), WARMUP_TOKENS, prompts.context_tokens)
        worker.run_now(hello, Sampling(max_tokens=budget))
    except _Interrupted:
        log.info("stopped before the model was ready")
        abandon()
        return 0
    except Exception as exc:
        abandon()
        return startup_failure(exc, notifier)

    _settle_host(config)
    runtime.prompts, runtime.model_name = prompts, engine.name
    runtime.cpu = engine.plan.as_dict()  # the plan that serves (torch's step if it had to)
    runtime.decode_step = engine.decode_step
    runtime.weights_digest = engine.weights_digest
    runtime.logits_width = engine.vocab_size
    runtime.prefixes = engine.prefixes
    runtime.defaults = sampling_defaults(choice.path, config.sampling_defaults)
    runtime.grammars = grammars
    heap.trim()  # the warm-up's activations and the load's leftovers
    runtime.worker = worker  # last: from here on /chat and /health serve
    status(f"ready: serving {engine.name}")
    notifier.send("READY=1")
    threading.Thread(target=_watchdog, args=(notifier, worker, stop), daemon=True).start()

    while not stop.is_set():
        wake.wait()
        wake.clear()
        if reload_asked.is_set():
            reload_asked.clear()
            notifier.send("RELOADING=1")
            reload_keys(config, runtime.keys)
            notifier.send("READY=1")
    notifier.send("STOPPING=1")
    log.info("stopping: refusing new requests, ending queued and running ones with 503")
    worker.stop()
    time.sleep(DRAIN_S)
    server.close()
    log.info("stopped")
    return 0


# Progress bars redraw one line with carriage returns: right on a terminal, noise in a file,
# and the journal stores such lines as "[147B blob data]". tqdm (under modelscope's and
# transformers' bars) reads TQDM_* when it is first imported, which main() comes before.
PROGRESS_BARS_OFF = {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def quiet_progress_bars(stream) -> None:
    """No progress bars unless `stream` is a terminal (plain log lines tell the progress);
    a variable the environment already sets is left as it is."""
    if stream.isatty():
        return
    for name, value in PROGRESS_BARS_OFF.items():
        os.environ.setdefault(name, value)


def main(argv: list[str] | None = None) -> int:
    quiet_progress_bars(sys.stderr)
    try:
        config = load_config(argv)
        handler = logging.StreamHandler()
        handler.setFormatter(OneLineFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logging.basicConfig(level=config.log_level.upper(), handlers=[handler], force=True)
        # First the CPU split and the slice: every thread started from here on (the HTTP
        # threads, the inference thread, the native step's pool) inherits them.
        config, pinning = _pinning(config)
        _ask_for_slice(config.sched_slice_us)
        # Before anything loads: a --quantize this CPU cannot run is a setting to fix.
        # The one execution plan: made here, passed down to the load.
        plan = plan_for(config)
    except ConfigError as exc:
        print(f"server.py: {exc}", file=sys.stderr)
        return 2
    code = serve(config, plan, pinning)
    _leave_now_if_still_loading(code)
    return code


def _leave_now_if_still_loading(code: int) -> None:
    """SIGTERM during the model load leaves its thread inside torch's native code, which
    the interpreter's normal exit tears down with an abort (SIGABRT, exit -6): leave at once."""
    if any(t.name == "inference" and t.is_alive() for t in threading.enumerate()):
        log.info("leaving without waiting for the model load to end")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
