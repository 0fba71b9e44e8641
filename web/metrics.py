"""Prometheus metrics of one app, and `GET /metrics` that serves them.

Each app has its own registry (tests build many apps in one process). Request outcomes are
counted once per request, when its response closes (a stream's final status is known only
then), from what the request's log line holds; the worker's state (queue, running job,
cancellations) is read at scrape time. Labels take bounded values only: route rules, HTTP
statuses, API key names, fixed reasons.
"""

from __future__ import annotations

from collections.abc import Iterator

from flask import Blueprint, Response, request
from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)

from service.config import Config
from web.request_log import RequestLog
from web.runtime import Runtime

# Error kinds that turn a request away before or instead of an answer.
REJECTION_REASONS = ("overloaded", "loading", "unavailable", "unauthorized", "too_many_failures")
CANCEL_STAGES = ("queued", "running")
UNMATCHED_ROUTE = "other"  # 404s and 405s: never the raw path, which anyone can vary

# Buckets in seconds, from the figures measured on the 2-core build machine (docs/speed.md
# and "Metrics"): first token 43 ms (SmolLM2) to 67/110 ms p50/p90 (Qwen int8), about 100 ms
# through HTTP, 0.2-0.7 s with int4, bf16 or fp32, seconds for a prompt near the 4096-token
# context or a CPU shared with other work (p90 3.4 s seen).
TTFT_BUCKETS = (0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Decode: 11 ms a token (SmolLM2 int8, 90 tok/s), 16-20 ms (Qwen int4/int8, 61/49 tok/s),
# 61 ms (bf16), 116 ms (fp32, 8.6 tok/s); more when the CPU is shared.
TPOT_BUCKETS = (0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5)
# The wait behind other jobs: none on an idle box, one job's time (about 1.3 s for 64
# tokens, 5 s for the default 256) per job ahead, up to a full queue of 4 and the 120 s
# deadline.
QUEUE_BUCKETS = (0.005, 0.05, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)
# Arrival to last token: 1.3 s p50 for 64 tokens (Qwen int8, one client), 3.9-4.6 s with
# three clients; 256 tokens about 5 s, the 1024 cap about 21 s; the deadline is 120 s.
REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0)


class _LiveState:
    """Read at scrape time: readiness, the model, the queue, the running job and the
    worker's count of cancelled jobs."""

    def __init__(self, config: Config, runtime: Runtime):
        self.config = config
        self.runtime = runtime

    def collect(self) -> Iterator[Metric]:
        worker = self.runtime.worker if self.runtime.ready else None
        yield GaugeMetricFamily(
            "deskchat_ready", "1 once the model is loaded and serving, 0 before.", int(bool(worker))
        )
        if worker is not None:
            cpu = self.runtime.cpu or {}
            yield InfoMetricFamily(
                "deskchat_model",
                "The model served, how its linear layers are stored (what runs: auto serves "
                "int8-row; int4-row on the native step for a large model or a small RAM; "
                "int8 or fp32 on an old CPU), the CPU generation and int8 kernel.",
                value={
                    "model": self.runtime.model_name,
                    "quantization": cpu.get("quantize", self.config.quantize),
                    "cpu_isa": cpu.get("isa", "unknown"),
                    "int8_path": cpu.get("paths", {}).get("int8", "unknown"),
                    "decode_step": self.runtime.decode_step or "unknown",
                },
            )
        depth = worker.depth if worker else 0
        yield GaugeMetricFamily("deskchat_queue_depth", "Jobs waiting in the FIFO.", depth)
        yield GaugeMetricFamily(
            "deskchat_queue_capacity",
            "Jobs that may wait (--max-queue); more are refused as overloaded.",
            self.config.max_queue,
        )
        running = worker.running if worker else 0
        yield GaugeMetricFamily(
            "deskchat_running_jobs", "Jobs the inference thread is running (the batch).", running
        )
        yield GaugeMetricFamily(
            "deskchat_batch_capacity",
            "Jobs that may run side by side (--max-batch).",
            self.config.max_batch,
        )
        governor = self.runtime.thread_governor
        yield GaugeMetricFamily(
            "deskchat_inference_threads",
            "Threads the steps are served on (--thread-policy adaptive: 1 or --threads, "
            "whichever measured faster lately).",
            governor.threads if governor is not None else self.config.threads,
        )
        yield CounterMetricFamily(
            "deskchat_thread_changes",
            "Times the adaptive policy changed the inference thread count.",
            governor.changes if governor is not None else 0,
        )
        realtime = worker.realtime if worker else None
        yield CounterMetricFamily(
            "deskchat_realtime_first_steps",
            "Steps run with the inference threads real-time (--realtime-first-step-ms): a "
            "request's first, or a long prompt's last ones.",
            realtime.steps if realtime is not None else 0,
        )
        engine = worker.engine if worker else None
        for name, help, value in (
            ("deskchat_draft_tokens", "Tokens drafted by prompt lookup and checked.", "drafted"),
            ("deskchat_draft_accepted_tokens", "Drafted tokens the model picked.", "accepted"),
        ):
            yield CounterMetricFamily(name, help, getattr(engine, f"{value}_tokens", 0))
        cancelled = CounterMetricFamily(
            "deskchat_cancellations",
            "Jobs dropped because their client left: while queued, or while running.",
            labels=["stage"],
        )
        counts = worker.cancellations if worker else {}
        for stage in CANCEL_STAGES:
            cancelled.add_metric([stage], counts.get(stage, 0))
        yield cancelled


class Metrics:
    def __init__(self, config: Config, runtime: Runtime):
        self.registry = registry = CollectorRegistry()
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        GCCollector(registry=registry)
        registry.register(_LiveState(config, runtime))
        self.requests = Counter(
            "deskchat_requests",
            "Requests by route, final status (499: the client left) and API key name.",
            ["route", "status", "key"],
            registry=registry,
        )
        self.rejections = Counter(
            "deskchat_rejections",
            "Requests turned away, by reason.",
            ["reason"],
            registry=registry,
        )
        for reason in REJECTION_REASONS:
            self.rejections.labels(reason)
        self.timeouts = Counter(
            "deskchat_timeouts",
            "Requests that passed their deadline (504), in the queue or while generating.",
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "deskchat_prompt_tokens",
            "Prompt tokens of answered requests, by API key name.",
            ["key"],
            registry=registry,
        )
        self.completion_tokens = Counter(
            "deskchat_completion_tokens",
            "Completion tokens of answered requests, by API key name.",
            ["key"],
            registry=registry,
        )

        def histogram(name: str, help: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, help, buckets=buckets, registry=registry)

        self.queue_wait = histogram(
            "deskchat_queue_wait_seconds",
            "Time an answered request waited in the FIFO.",
            QUEUE_BUCKETS,
        )
        self.ttft = histogram(
            "deskchat_time_to_first_token_seconds",
            "From the worker taking the job to its first token (the prompt's prefill).",
            TTFT_BUCKETS,
        )
        self.tpot = histogram(
            "deskchat_time_per_output_token_seconds",
            "Decode time per token after the first, of answers with two tokens or more.",
            TPOT_BUCKETS,
        )
        self.duration = histogram(
            "deskchat_request_duration_seconds",
            "Arrival to last token of answered requests, queue wait included.",
            REQUEST_BUCKETS,
        )

    def observe(self, route: str, log: RequestLog, http_status: int) -> None:
        """Count one finished request: the status of its log line if it wrote one (a
        stream's last word), else the HTTP status sent."""
        status = log.status if log.status is not None else http_status
        key = log.key_name or ""
        error, done = log.error, log.done
        self._count(route, status, key, error.type if error is not None else None)
        if done is None:
            return
        self.prompt_tokens.labels(key).inc(done.usage.prompt_tokens)
        self.completion_tokens.labels(key).inc(done.usage.completion_tokens)
        self.queue_wait.observe(done.queued_ms / 1000)
        self.ttft.observe(done.ttft_ms / 1000)
        self.duration.observe(done.total_ms / 1000)
        tokens = done.usage.completion_tokens
        if tokens > 1:
            decode_ms = done.total_ms - done.queued_ms - done.ttft_ms
            self.tpot.observe(max(decode_ms, 0.0) / (tokens - 1) / 1000)

    def observe_refused(self, route: str, status: int, kind: str) -> None:
        """Count a request that waitress answered itself, before Flask (web/transport.py):
        a 503 on a reserve connection past --connection-limit, malformed HTTP, a timeout.
        No key was read for it. Its 408s are not deadlines: not in the timeouts."""
        self._count(route, status, "", kind if kind in REJECTION_REASONS else None)

    def _count(self, route: str, status: int, key: str, kind: str | None) -> None:
        self.requests.labels(route, str(status), key).inc()
        if kind in REJECTION_REASONS:
            self.rejections.labels(kind).inc()
        if kind == "timeout":
            self.timeouts.inc()


def route_of_request() -> str:
    """The matched route rule (`/v1/models/<path:model_id>`), never the raw path."""
    return request.url_rule.rule if request.url_rule is not None else UNMATCHED_ROUTE


def blueprint(metrics: Metrics) -> Blueprint:
    bp = Blueprint("metrics", __name__)

    @bp.get("/metrics", provide_automatic_options=False)
    def scrape():
        encode, content_type = choose_encoder(request.headers.get("Accept", ""))
        return Response(encode(metrics.registry), content_type=content_type)

    return bp
