"""JSON-constrained jobs stepped in one batch with free ones, at the shipped --max-batch (4):
each constrained answer follows its schema, and each free answer is the greedy text it has
alone (the per-row kernels are batch-invariant, and a grammar masks only its own row)."""

from __future__ import annotations

import json
import threading
import time

import jsonschema
import pytest

from tests.support.httpclient import chat, request
from tests.support.schemas import CITY, TICKET

FREE = ["Name three colours.", "Count from one to five."]
CONSTRAINED = [(CITY, "Describe Tokyo as JSON."), (TICKET, "My printer is on fire, help!")]


@pytest.mark.slow  # four real-model answers together, then two alone
def test_constrained_and_free_jobs_share_a_batch(embedded_server):
    bodies = [{"message": q, "max_tokens": 48} for q in FREE] + [
        {"message": q, "format": schema, "max_tokens": 200} for schema, q in CONSTRAINED
    ]
    replies: dict[int, object] = {}

    def send(i: int) -> None:
        replies[i] = chat(embedded_server.url, bodies[i], timeout=300)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    most = 0  # the most jobs seen running at once: the test means nothing without a batch
    while any(t.is_alive() for t in threads):
        health = request(embedded_server.url, "GET", "/health").json()
        most = max(most, health["batch"]["running"])
        time.sleep(0.05)
    for t in threads:
        t.join()
    assert most >= 3, f"the jobs never shared a batch (at most {most} running)"
    for i, (schema, _q) in enumerate(CONSTRAINED, start=len(FREE)):
        assert replies[i].status == 200, replies[i].body
        jsonschema.validate(json.loads(replies[i].json()["response"]), schema)
    together = [replies[i].json()["response"] for i in range(len(FREE))]
    alone = [chat(embedded_server.url, body, timeout=300).json()["response"] for body in bodies[:2]]
    assert together == alone
