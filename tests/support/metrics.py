"""One /metrics scrape, read with prometheus_client's own parser."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tests.support.httpclient import request


def scrape(url: str, headers: dict | None = None) -> dict:
    """{(sample name, sorted label pairs): value} of one scrape."""
    reply = request(url, "GET", "/metrics", headers=headers)
    assert reply.status == 200, reply.body
    assert reply.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples = {}
    for family in text_string_to_metric_families(reply.body.decode()):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)
