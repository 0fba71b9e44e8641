"""A fake llama.cpp tree for the benches that run llama-server: a converter and a quantizer
that log their calls, and a llama-server that is a small streaming OpenAI server (its
/health, and /v1/chat/completions as llama-server streams it: text chunks, then the finish
reason, usage and `timings`), which logs every request body."""

from __future__ import annotations

import sys
from pathlib import Path

# argv: -m GGUF ... --port N. Each streamed answer: max_tokens words, `prompt_n` the prompt's
# characters / 4 (a stand-in), `cache_n` 0; one JSON line a request in requests.log.
_SERVER = """
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LOG = {log!r}


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        self._send(200, b'{{"status": "ok"}}', "application/json")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with open(LOG, "a") as log:
            log.write(json.dumps({{"path": self.path, "body": body}}) + "\\n")
        prompt = len(json.dumps(body["messages"]) + json.dumps(body.get("tools", []))) // 4
        words = [f"w{{i}} " for i in range(body["max_tokens"])]
        chunks = [{{"choices": [{{"delta": {{"role": "assistant", "content": None}}}}]}}]
        chunks += [{{"choices": [{{"delta": {{"content": w}}}}]}} for w in words]
        chunks.append({{"choices": [{{"delta": {{}}, "finish_reason": "length"}}]}})
        usage = {{"prompt_tokens": prompt, "completion_tokens": len(words)}}
        timings = {{"prompt_n": prompt, "cache_n": 0, "prompt_ms": 1.0}}
        chunks.append({{"choices": [], "usage": usage, "timings": timings}})
        frames = "".join(f"data: {{json.dumps(c)}}\\n\\n" for c in chunks) + "data: [DONE]\\n\\n"
        self._send(200, frames.encode(), "text/event-stream")

    def _send(self, status, data, kind):
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


port = int(sys.argv[sys.argv.index("--port") + 1])
ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def fake_llama_tree(root: Path) -> Path:
    """The tree under root (calls.log: the converter's and quantizer's calls; requests.log:
    the server's requests); returns its build/bin/llama-server."""
    bins = root / "build" / "bin"
    bins.mkdir(parents=True)
    calls = root / "calls.log"
    (root / "convert_hf_to_gguf.py").write_text(
        "import sys\n"
        f"open({str(calls)!r}, 'a').write('convert ' + ' '.join(sys.argv[1:]) + '\\n')\n"
        "open(sys.argv[sys.argv.index('--outfile') + 1], 'w').write('bf16')\n"
    )
    (bins / "llama-quantize").write_text(
        f'#!/bin/sh\necho "quantize $3 $4" >> {calls}\necho q4 > "$2"\n'
    )
    server = _SERVER.format(log=str(root / "requests.log"))
    (bins / "llama-server").write_text(f"#!{sys.executable}\n{server}")
    for tool in bins.iterdir():
        tool.chmod(0o755)
    return bins / "llama-server"
