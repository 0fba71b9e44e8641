"""One side of the benchmark, in its own process: load, then answer commands from stdin.

`engine`: deskchat's Engine, loaded by inference.loading.assemble with the DESKCHAT_* settings of
the environment (so the bench measures the engine as configured). `baseline`: plain
transformers, fp32, `model.generate` with its defaults apart from greedy decoding and a fixed
answer length. `llamacpp_q8_0` / `llamacpp_q4_k_m` (`--peer llamacpp`): llama.cpp on a GGUF
(bench/peer_llamacpp.py), given the prompt as the token ids the parent rendered. All produce
exactly `max_tokens` tokens (end-of-text is ignored), so the sides decode the same amount.
Commands and answers are JSON lines; logs go to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from bench.stats import peak_rss_mb


class EngineSide:
    def __init__(self, model_dir: str):
        from inference.loading.assemble import ModelChoice, load_model
        from service.config import load_config

        config = load_config([], os.environ)
        choice = ModelChoice(Path(model_dir), os.path.basename(model_dir))
        self.config = config
        self.engine, self.prompts = load_model(choice, config, lambda _msg: None)
        self.engine.eos_ids = set()  # fixed-length answers, like the baseline's

    def describe(self) -> dict:
        c = self.config
        return {
            "quantize": c.quantize,
            "dtype": c.dtype,
            "prefix_cache": c.prefix_cache,
            "threads": c.threads,
        }

    def run(self, messages: list[dict], max_tokens: int) -> dict:
        from inference.runtime.budget import answer_budget
        from inference.runtime.jobs import Sampling

        ids = self.prompts.encode(messages)
        budget = answer_budget(len(ids), max_tokens, self.engine.context_tokens)
        started = time.perf_counter()
        gen = self.engine.run(ids, Sampling(max_tokens=budget), lambda _t: None, lambda: False)
        e2e = time.perf_counter() - started
        return _result(
            len(ids), gen.completion_tokens, gen.ttft_s, e2e, reused=self.engine.reused_tokens
        )


class BaselineSide:
    def __init__(self, model_dir: str, threads: int):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(threads)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.eval()

    def describe(self) -> dict:
        return {"dtype": "float32", "api": "model.generate"}

    def run(self, messages: list[dict], max_tokens: int) -> dict:
        import torch
        from transformers.generation.streamers import BaseStreamer

        class FirstToken(BaseStreamer):
            def __init__(self):
                self.calls = 0
                self.at = None

            def put(self, value):
                self.calls += 1  # the first call carries the prompt, the second the 1st token
                if self.calls == 2:
                    self.at = time.perf_counter()

            def end(self):
                pass

        enc = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        streamer = FirstToken()
        started = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                **enc,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                streamer=streamer,
            )
        e2e = time.perf_counter() - started
        produced = out.shape[1] - enc["input_ids"].shape[1]
        return _result(enc["input_ids"].shape[1], produced, streamer.at - started, e2e)


class PeerSide:
    """llama.cpp on one GGUF; prompts arrive as token ids (rendered by the parent)."""

    def __init__(self, gguf: str, threads: int):
        from bench.peer_llamacpp import LlamaCppSide

        self.side = LlamaCppSide(gguf, threads)

    def describe(self) -> dict:
        return self.side.describe()

    def run(self, ids: list[int], max_tokens: int) -> dict:
        produced, ttft, e2e = self.side.run(ids, max_tokens)
        return _result(len(ids), produced, ttft, e2e)


def _result(prompt_tokens: int, produced: int, ttft_s: float, e2e_s: float, **extra) -> dict:
    decode_s = max(e2e_s - ttft_s, 1e-9)
    return {
        "prompt_tokens": prompt_tokens,
        "tokens": produced,
        "ttft_ms": ttft_s * 1000,
        "e2e_s": e2e_s,
        "decode_tok_s": (produced - 1) / decode_s if produced > 1 else 0.0,
        **extra,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--side", choices=("engine", "baseline", "llamacpp_q8_0", "llamacpp_q4_k_m"), required=True
    )
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--gguf", help="the GGUF file of a llamacpp_* side")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    reply = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    sys.stdout = sys.stderr  # library prints must not corrupt the protocol
    os.dup2(2, 1)  # nor native ones (llama.cpp logs through C stdio)
    started = time.perf_counter()
    if args.side == "engine":
        side = EngineSide(args.model_dir)
    elif args.side.startswith("llamacpp_"):
        side = PeerSide(args.gguf, args.threads)
    else:
        side = BaselineSide(args.model_dir, args.threads)
    load_s = time.perf_counter() - started
    reply.write(
        json.dumps(
            {
                "ready": True,
                "load_s": load_s,
                "setup": side.describe(),
                "rss_loaded_mb": peak_rss_mb(),
            }
        )
        + "\n"
    )
    for line in sys.stdin:
        command = json.loads(line)
        if command["cmd"] == "run" and isinstance(side, PeerSide):
            answer = side.run(command["ids"], command["max_tokens"])
        elif command["cmd"] == "run":
            answer = side.run(command["messages"], command["max_tokens"])
        elif command["cmd"] == "stats":
            answer = {"peak_rss_mb": peak_rss_mb()}
        else:
            return 0
        reply.write(json.dumps(answer) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
