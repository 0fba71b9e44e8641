"""`--peer llamacpp`: llama.cpp (llama-cpp-python) on the same weights, as GGUF Q8_0 and Q4_K_M.

An optional extra (`pip install -r requirements-peer.txt`, or `make bench-peer`). The GGUFs
are made once and cached next to the model (`<cache>/<model>-gguf/`): the HF folder is
converted to a bf16 GGUF by llama.cpp's own converter (`convert_hf_to_gguf.py` and its
gguf-py, from the llama-cpp-python sdist, fetched with `pip download` into the cache; its code
is not part of this repository), then quantized with `llama_cpp.llama_model_quantize` (the
binding of llama-quantize); the bf16 intermediate is deleted.

In the bench child, `LlamaCppSide` runs the prompt ids the parent rendered with our
tokenizer's chat template (so all sides see the same tokens) through a lean greedy loop on
`Llama.eval`: argmax of the last logits with every end-of-generation id forbidden, so it
produces exactly `max_tokens` tokens like the other sides.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

VERSION = "0.3.36"
REQUIREMENT = f"llama-cpp-python=={VERSION}"
INSTALL_HINT = "pip install -r requirements-peer.txt"
SRC_ENV = "DESKCHAT_LLAMACPP_SRC"
# side name in the report -> llama_ftype (LLAMA_FTYPE_MOSTLY_*)
QUANTS = {"llamacpp_q8_0": 7, "llamacpp_q4_k_m": 15}
PEERS = ("llamacpp",)
_DONE_MARK = ".built"


class PeerMissing(RuntimeError):
    """llama-cpp-python (or its converter) is not available."""


def require_llama_cpp():
    """The llama_cpp module, or PeerMissing with the install command."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise PeerMissing(
            f"--peer llamacpp needs {REQUIREMENT}, which is not installed ({exc}); "
            f"{INSTALL_HINT} (or: make bench-peer)"
        ) from None
    return llama_cpp


def gguf_dir(cache_dir: Path, model_dir: Path, outtype: str = "bf16") -> Path:
    """The GGUFs' folder; made from an f32 intermediate (bench.quality), a folder of its own."""
    suffix = "" if outtype == "bf16" else f"-{outtype}"
    return Path(cache_dir) / f"{Path(model_dir).name}-gguf{suffix}"


def gguf_paths(cache_dir: Path, model_dir: Path, outtype: str = "bf16") -> dict[str, Path]:
    folder = gguf_dir(cache_dir, model_dir, outtype)
    return {side: folder / f"{side.removeprefix('llamacpp_')}.gguf" for side in QUANTS}


def converter_dir(cache_dir: Path, log=print) -> Path:
    """llama.cpp's source tree (convert_hf_to_gguf.py, gguf-py) from the pinned sdist."""
    given = os.environ.get(SRC_ENV)
    if given:
        root = Path(given).expanduser()
        if not (root / "convert_hf_to_gguf.py").is_file():
            raise PeerMissing(f"{SRC_ENV}={given}: no convert_hf_to_gguf.py there")
        return root
    target = Path(cache_dir) / f"llama-cpp-python-{VERSION}-src"
    root = target / "vendor" / "llama.cpp"
    if (root / "convert_hf_to_gguf.py").is_file():
        return root
    log(f"fetching the {REQUIREMENT} sdist for llama.cpp's converter ...")
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--no-binary",
                ":all:",
                REQUIREMENT,
                "-d",
                tmp,
            ],
            capture_output=True,
            text=True,
        )
        archives = list(Path(tmp).glob("*.tar.gz"))
        if done.returncode or not archives:
            raise PeerMissing(f"pip download {REQUIREMENT} failed: {done.stderr.strip()[-500:]}")
        cache_dir.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".llama-src-", dir=cache_dir))
        try:
            with tarfile.open(archives[0]) as tar:
                tar.extractall(staging, filter="data")
            (inner,) = staging.iterdir()
            shutil.rmtree(target, ignore_errors=True)
            inner.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return root


def convert(model_dir: Path, src: Path, outfile: Path, outtype: str, log=print) -> None:
    """The HF folder as one GGUF of `outtype`, by llama.cpp's converter in the tree `src`."""
    log(f"converting {model_dir} to GGUF ({outtype}) with {src / 'convert_hf_to_gguf.py'} ...")
    started = time.perf_counter()
    path = [str(src / "gguf-py"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    done = subprocess.run(
        [
            sys.executable,
            str(src / "convert_hf_to_gguf.py"),
            str(model_dir),
            "--outtype",
            outtype,
            "--outfile",
            str(outfile),
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode:
        hint = f" (its imports: {INSTALL_HINT})" if "No module named" in done.stderr else ""
        raise PeerMissing(f"convert_hf_to_gguf.py failed{hint}:\n{done.stderr.strip()[-2000:]}")
    log(f"  converted in {time.perf_counter() - started:.1f} s")


def ensure_ggufs(
    model_dir: Path, cache_dir: Path, threads: int, log=print, outtype: str = "bf16"
) -> dict[str, Path]:
    """The cached Q8_0 and Q4_K_M GGUFs of model_dir, made first if needed, quantized from
    an `outtype` (bf16, like the real checkpoint, or f32) conversion."""
    llama_cpp = require_llama_cpp()
    paths = gguf_paths(cache_dir, model_dir, outtype)
    folder = gguf_dir(cache_dir, model_dir, outtype)
    mark = folder / _DONE_MARK
    source = f"{Path(model_dir).resolve()} llama-cpp-python {VERSION}\n"
    if mark.is_file() and mark.read_text() == source and all(p.is_file() for p in paths.values()):
        return paths
    folder.mkdir(parents=True, exist_ok=True)
    mark.unlink(missing_ok=True)
    whole = folder / f"{outtype}.gguf.tmp"
    convert(model_dir, converter_dir(cache_dir, log), whole, outtype, log)
    try:
        for side, ftype in QUANTS.items():
            started = time.perf_counter()
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = ftype
            params.nthread = threads
            tmp = paths[side].with_suffix(".gguf.tmp")
            if llama_cpp.llama_model_quantize(str(whole).encode(), str(tmp).encode(), params):
                raise PeerMissing(f"llama_model_quantize to {side} failed")
            tmp.rename(paths[side])
            size = paths[side].stat().st_size / 2**20
            log(f"  {side}: {size:.0f} MB in {time.perf_counter() - started:.1f} s")
    finally:
        whole.unlink(missing_ok=True)
    mark.write_text(source)
    return paths


class LlamaCppSide:
    """One GGUF in llama.cpp, for bench/compare/child.py and bench/compare/speculation.py."""

    def __init__(self, gguf: str, threads: int, n_ctx: int = 2048, draft_model=None):
        """`draft_model`: llama-cpp-python's speculative drafter (bench/compare/speculation.py's
        prompt lookup), which `Llama.generate` then verifies."""
        import numpy as np

        llama_cpp = require_llama_cpp()
        self.np = np
        self.gguf = gguf
        self.threads = threads
        self.llm = llama_cpp.Llama(
            model_path=gguf,
            n_ctx=n_ctx,
            n_batch=512,
            n_threads=threads,
            n_threads_batch=threads,
            draft_model=draft_model,
            verbose=False,
        )
        self.n_vocab = self.llm.n_vocab()
        vocab = llama_cpp.llama_model_get_vocab(self.llm.model)
        self.eog = [t for t in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, t)]

    def describe(self) -> dict:
        return {
            "gguf": os.path.basename(self.gguf),
            "llama_cpp_python": VERSION,
            "threads": self.threads,
            "api": "Llama.eval + greedy argmax, end-of-generation ids forbidden",
        }

    def _next(self) -> int:
        ptr = self.llm._ctx.get_logits_ith(-1)
        logits = self.np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()
        logits[self.eog] = -self.np.inf
        return int(logits.argmax())

    def run(self, ids: list[int], max_tokens: int) -> tuple[int, float, float]:
        """(tokens produced, seconds to the first token, seconds in all)."""
        started = time.perf_counter()
        self.llm.reset()  # no KV reuse across requests: every prompt is prefilled whole
        self.llm.eval(ids)
        token = self._next()
        ttft = time.perf_counter() - started
        produced = 1
        while produced < max_tokens:
            self.llm.eval([token])
            token = self._next()
            produced += 1
        return produced, ttft, time.perf_counter() - started
