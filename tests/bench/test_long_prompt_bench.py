"""`--long-prompt`: the probe per length through the real app (the scripted engine behind
it): prompts sized by the server's own /tokenize, the streams' quiet and during-prefill gaps
and their ratios in the report (no timing asserts, no model)."""

from __future__ import annotations

from types import SimpleNamespace

from bench.serving import long_prompt
from tests.support.fakes import FakeEngine


def test_each_length_gets_a_prompt_that_size_and_the_gaps_beside_it(
    tmp_path, monkeypatch, fake_server
):
    started: list[tuple[str, ...]] = []

    class InProcess:
        def __init__(self, model, cache_dir, setting, log_dir):
            started.append(setting.flags)
            self.inner = fake_server(FakeEngine(token_s=0.002), *setting.flags)
            self.url = self.inner.url
            self.proc = SimpleNamespace(pid=0)

        def wait_ready(self, timeout):
            pass

        def stop(self):
            pass  # fake_server closes it

    monkeypatch.setattr(long_prompt, "Server", InProcess)
    report = long_prompt.run(tmp_path, tmp_path, [400, 900], quiet_s=0.3)
    assert started and "--max-prompt-tokens" in started[0]
    assert started[0][started[0].index("--max-prompt-tokens") + 1] == "900"
    rows = report["rows"]
    assert [row.get("error") for row in rows] == [None, None]
    for row, wanted in zip(rows, [400, 900], strict=True):
        assert wanted * 0.8 <= row["prompt_tokens"] <= wanted
        assert row["gaps_quiet"] > 0 and row["gaps_during"] > 0
        assert row["p99_ratio"] == round(row["gap_ms_p99_during"] / row["gap_ms_p99_quiet"], 2)
