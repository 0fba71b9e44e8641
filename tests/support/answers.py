"""`python -m tests.support.answers CACHE_DIR`: convert (if CACHE_DIR has none yet) and load
the embedded model as the server does, and print one JSON line: the converted file's hash,
the served weights' digest, the decode step and the greedy answers to QUESTIONS. Run in a
process of its own, so that ATEN_CPU_CAPABILITY and DESKCHAT_NATIVE_ISA, read once per
process, can differ between runs (tests/inference/loading/test_same_answers.py)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from pathlib import Path

from tests.support.margins import CANDIDATES

QUESTIONS = [question for question, _ in CANDIDATES[:20]]
NEW_TOKENS = 24


def capabilities() -> list[str]:
    """torch's kernel sets (ATEN_CPU_CAPABILITY) this CPU can run, the plainest first: by
    the CPU's flags, as torch checks them, whatever this process's own variable says."""
    from inference.host.cpu import proc_flags

    flags = proc_flags() or frozenset()
    found = ["default"]
    if {"avx2", "fma"} <= flags:
        found.append("avx2")
        if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
            found.append("avx512")
    return found


def main(cache: Path) -> dict:
    import torch

    from inference.loading.assemble import ModelChoice, load_model
    from inference.loading.embedded import embedded_model_dir
    from inference.runtime.jobs import Sampling
    from service.config import load_config

    folder = embedded_model_dir(cache)
    files = hashlib.sha256()
    for path in sorted(folder.glob("*.safetensors")):
        files.update(path.read_bytes())
    config = dataclasses.replace(load_config([], {}), cache_dir=cache)
    engine, prompts = load_model(ModelChoice(folder, "embedded"), config, lambda _m: None)
    answers = []
    for question in QUESTIONS:
        parts: list[str] = []
        ids = prompts.encode([{"role": "user", "content": question}])
        engine.run(ids, Sampling(max_tokens=NEW_TOKENS), parts.append, lambda: False)
        answers.append("".join(parts))
    return {
        "capability": torch.backends.cpu.get_cpu_capability(),
        "file_sha256": files.hexdigest(),
        "weights_sha256": engine.weights_digest,
        "decode_step": engine.decode_step,
        "answers": answers,
    }


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))
