"""Driving a real Engine by hand: jobs stepped side by side, as the worker would."""

from __future__ import annotations


def batched(engine, jobs, joins=None, leaves=None) -> list[str]:
    """Runs (prompt_ids, sampling) jobs side by side. `joins[i]`: the step job i is opened
    at (default 0); `leaves[i]`: the step job i is closed at, unfinished."""
    joins, leaves = joins or {}, leaves or {}
    streams: dict[int, object] = {}
    texts = ["" for _ in jobs]
    step = 0
    while True:
        for i, (prompt_ids, sampling) in enumerate(jobs):
            if joins.get(i, 0) == step:
                streams[i] = engine.open(prompt_ids, sampling)
        for i, stream in list(streams.items()):
            if leaves.get(i) == step:
                engine.close(stream, interrupted=True)
                del streams[i]
        if not streams and step > max(joins.values(), default=0):
            return texts
        engine.step(list(streams.values()))
        for i, stream in list(streams.items()):
            texts[i] += stream.take_text()
            if stream.finish is not None:
                engine.close(stream)
                texts[i] += stream.take_text()
                del streams[i]
        step += 1
