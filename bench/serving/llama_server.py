"""llama-server as the peer of `--versus-server`: the Q4_K_M GGUF of a model folder, made once,
and the server's command line at the defaults this comparison ships it with.

The project does not build llama-server; `--llama-server PATH` names one (docs/speed.md says
how to build it from the pinned llama-cpp-python sdist). The GGUF is converted by the
converter of the server's own llama.cpp tree when it has one (`<tree>/build/bin/llama-server`:
the same version as the binary), else by the pinned sdist's (bench/peer_llamacpp.py), and
quantized by the `llama-quantize` next to the server. Both files stay in the cache
(`<cache>/<model>-gguf-server/`: bf16.gguf, q4_k_m.gguf).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from bench.launcher import Process
from bench.peer_llamacpp import PeerMissing, convert, converter_dir, gguf_dir

QUANT = "Q4_K_M"
# The peer's settings for this comparison: 2 threads (the office PC's cores), 4 parallel
# slots (deskchat batches 4 streams by default) sharing 8,192 tokens of context (2,048 each).
FLAGS = ("-t", "2", "-np", "4", "-c", "8192")
_DONE_MARK = ".built"


def tools(llama_server: str | Path) -> tuple[Path, Path]:
    """(llama-server, the llama-quantize beside it), or PeerMissing saying what is missing."""
    server = Path(llama_server).expanduser().resolve()
    quantize = server.with_name("llama-quantize")
    for tool in (server, quantize):
        if not (tool.is_file() and os.access(tool, os.X_OK)):
            raise PeerMissing(
                f"{tool}: no such executable; build llama-server and llama-quantize as "
                "docs/speed.md says, then pass --llama-server PATH"
            )
    return server, quantize


def source_tree(server: Path, cache_dir: Path, log=print) -> Path:
    """The llama.cpp tree the server was built in (it has the converter), else the sdist's."""
    for folder in list(server.parents)[:3]:
        if (folder / "convert_hf_to_gguf.py").is_file():
            return folder
    return converter_dir(cache_dir, log)


def ensure_gguf(model_dir: Path, cache_dir: Path, llama_server: str | Path, log=print) -> Path:
    """The cached Q4_K_M GGUF of model_dir, converted (bf16) and quantized first if needed."""
    server, quantize = tools(llama_server)
    folder = gguf_dir(cache_dir, model_dir, "server")
    whole, quantized, mark = folder / "bf16.gguf", folder / "q4_k_m.gguf", folder / _DONE_MARK
    source = f"{Path(model_dir).resolve()} {quantize}\n"
    if mark.is_file() and mark.read_text() == source and quantized.is_file():
        return quantized
    folder.mkdir(parents=True, exist_ok=True)
    mark.unlink(missing_ok=True)
    staged = folder / "bf16.gguf.tmp"
    convert(model_dir, source_tree(server, cache_dir, log), staged, "bf16", log)
    staged.rename(whole)
    started = time.perf_counter()
    staged = folder / "q4_k_m.gguf.tmp"
    threads = str(len(os.sched_getaffinity(0)))
    done = subprocess.run(
        [str(quantize), str(whole), str(staged), QUANT, threads], capture_output=True, text=True
    )
    if done.returncode:
        raise PeerMissing(f"llama-quantize failed:\n{(done.stderr or done.stdout)[-2000:]}")
    staged.rename(quantized)
    size = quantized.stat().st_size / 2**20
    log(f"  {QUANT}: {size:.0f} MB in {time.perf_counter() - started:.1f} s")
    mark.write_text(source)
    return quantized


def command(llama_server: str | Path, gguf: Path) -> Callable[[int], list[str]]:
    """The server's command line for a port (bench/launcher.py's Process takes it)."""
    server = str(Path(llama_server).expanduser())
    return lambda port: [server, "-m", str(gguf), *FLAGS, "--port", str(port)]


def start(llama_server: str | Path, gguf: Path, log_dir: Path) -> Process:
    """llama-server on the GGUF with FLAGS, on a free loopback port, its log in log_dir."""
    return Process(command(llama_server, gguf), log_dir)
