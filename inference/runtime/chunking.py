"""How many prompt rows a step carries beside streams that are answering, from measured steps.

A long prompt arriving while others answer is prefilled in chunks, one per step, and every
answering stream's next token waits for that step. A fixed chunk (32 rows) made such a step
take 3-5x a step without one on the Qwen2.5-0.5B shape (a decode step of three streams reads
the weights once in ~30 ms; each prompt row adds ~3.5 ms of products), so the streams' gaps
spread that much while the prompt ran. Instead the chunk is sized so that a step with it
takes about SLOWER times a step without: both costs are measured as steps run (the
seconds of steps without prompt rows, the seconds per prompt row), so the rule holds on a
faster PC, a bigger model and a busy one alike. The prompt pays: it gets fewer rows a step
(its own first token comes later), which is what a person reading a stream notices least.

On the native step any chunking gives the same bits (a row depends on its position alone);
on torch's per-row int8 a chunk must keep to the engine's block, so chunks are multiples of
`align`, at least one.
"""

from __future__ import annotations

from inference.runtime.schedule import PREFILL_BESIDE

SLOWER = 2.0  # a step carrying a prompt chunk takes at most about this times one without
MOST = 64  # rows beside answering streams at most
WEIGHT = 0.25  # of a new measurement in the running estimates


class PromptChunks:
    """Running estimates of a step's cost without prompt rows and of a prompt row's cost,
    and the chunk they allow beside answering streams."""

    def __init__(self, align: int):
        self.align = align
        self.decode_s: float | None = None  # a step with answering rows only
        self.row_s: float | None = None  # one prompt row's share of a step

    def observe(self, decode_rows: int, prompt_rows: int, seconds: float) -> None:
        """One forward's rows and time. A step without prompt rows teaches the decode cost;
        one with them the prompt rows' cost, less the decode rows' share when there are."""
        if prompt_rows == 0:
            self.decode_s = _blend(self.decode_s, seconds)
        elif decode_rows == 0:
            self.row_s = _blend(self.row_s, seconds / prompt_rows)
        elif self.decode_s is not None:
            self.row_s = _blend(self.row_s, max(seconds - self.decode_s, 0.0) / prompt_rows)

    def beside(self) -> int:
        """Prompt rows for the next step that has answering streams in it."""
        if self.decode_s is None or not self.row_s:
            return PREFILL_BESIDE  # before anything is measured
        rows = int((SLOWER - 1) * self.decode_s / self.row_s)
        rows = rows // self.align * self.align
        return max(self.align, min(MOST // self.align * self.align, rows))


def _blend(old: float | None, new: float) -> float:
    return new if old is None else old + WEIGHT * (new - old)
