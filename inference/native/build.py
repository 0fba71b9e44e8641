"""Builds the native decode step (step.c) with this PC's C compiler, for its instruction set.

One shared library per instruction-set level (avx2, avx, sse4.2 or plain x86-64), named by
a hash of the source and the flags, so a change of either builds afresh and an unchanged
one is found again. `make install` and system/install.sh
build it; the server builds it on start when it is missing and the folder is writable.
Nothing here touches the network. `python -m inference.native.build` builds for this CPU
and prints the library's path (or why not, exit 1).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

log = logging.getLogger("deskchat.native")

SOURCE = Path(__file__).with_name("step.c")
# Per level: what the compiler may use. avx512 CPUs take the avx2 build (no AVX-512 kernel
# yet); the SSE4.2 build is SSSE3's integer products, which every such CPU has.
ISA_FLAGS = {
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx": ["-mavx"],
    "sse4.2": ["-msse4.2"],
    "older": [],
}
LEVEL_OF = {"avx512": "avx2"}
# Every level gets COMMON_FLAGS; only ISA_FLAGS differ. -ffp-contract=off is what batch
# invariance and "the same bits on every build" rest on: with it on, GCC would fuse a * b + c
# into one FMA (one rounding instead of two) in some copies of a loop and not in others (the
# unrolled rows vs the last row, step.c's emit), so a row's bits would follow its place in
# the step; and only the avx2 build, the one with -mfma, would fuse at all. step.c notes each
# place (emit, exp8, rotate, attention) where a fused multiply-add would change the bits.
COMMON_FLAGS = ["-O3", "-std=gnu11", "-shared", "-fPIC", "-fno-math-errno", "-ffp-contract=off"]
COMMON_FLAGS += ["-Wno-psabi"]
COMPILE_SECONDS = 120


class BuildError(RuntimeError):
    """No compiler, or the compiler refused: the torch path serves."""


def level(isa: str) -> str:
    """The build level that serves a CPU of generation `isa` (inference/host/cpu.py)."""
    isa = LEVEL_OF.get(isa, isa)
    return isa if isa in ISA_FLAGS else "older"


def for_cpu(isa: str, flags: frozenset[str]) -> str:
    """The generation to build and load for a CPU of generation `isa` with these flags: the
    avx2 build converts the float16 KV cache with F16C, so an AVX2 CPU (or VM) that hides
    f16c takes the avx build."""
    if level(isa) == "avx2" and "f16c" not in flags:
        return "avx"
    return isa


def library_dir() -> Path:
    """DESKCHAT_NATIVE_DIR, else a folder of the venv (where `make install` puts it)."""
    return Path(os.environ.get("DESKCHAT_NATIVE_DIR") or Path(sys.prefix) / "deskchat-native")


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _check_runs(cc: str) -> None:
    """Raises BuildError naming a compiler that does not even start."""
    try:
        subprocess.run([cc, "--version"], capture_output=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        raise BuildError(f"C compiler {cc} does not run: {exc}") from exc


def library_name(isa: str) -> str:
    """Named by the source and the flags: a change of either builds afresh, and a library
    once built is found again without a compiler (one removed after the install)."""
    flags = " ".join(COMMON_FLAGS + ISA_FLAGS[level(isa)])
    digest = hashlib.sha256(SOURCE.read_bytes() + flags.encode())
    return f"libdeskchat-step-{level(isa)}-{digest.hexdigest()[:12]}.so"


def built(isa: str, folder: Path | None = None) -> Path | None:
    """The library for `isa` if it is built already."""
    path = (folder or library_dir()) / library_name(isa)
    return path if path.is_file() else None


def build(isa: str, folder: Path | None = None) -> Path:
    """The library for `isa`, compiled now unless it is there. Raises BuildError."""
    cc = compiler()
    if cc is None:
        raise BuildError("no C compiler (cc or gcc; Debian: apt-get install gcc)")
    folder = folder or library_dir()
    path = folder / library_name(isa)
    if path.is_file():
        return path
    _check_runs(cc)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
        os.close(fd)
    except OSError as exc:
        raise BuildError(f"cannot write the library to {folder}: {exc}") from exc
    command = [
        cc,
        *COMMON_FLAGS,
        *ISA_FLAGS[level(isa)],
        "-o",
        tmp,
        str(SOURCE),
        "-lm",
        "-lpthread",
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=COMPILE_SECONDS)
        if done.returncode != 0:
            raise BuildError(f"{cc} failed: {' '.join(done.stderr.split())[:300]}")
        os.chmod(tmp, 0o755)  # the service's own user (DynamicUser=) must read it
        os.replace(tmp, path)  # whole or not at all, for a server starting beside the build
    except (OSError, subprocess.SubprocessError) as exc:
        raise BuildError(f"{cc} failed: {exc}") from exc
    finally:
        Path(tmp).unlink(missing_ok=True)
    log.debug("built the native decode step for %s: %s", level(isa), path)
    return path


def this_cpu() -> str:
    """This CPU's generation, as the server's plan names it (capped by ATEN_CPU_CAPABILITY)."""
    from inference.host import cpu

    try:
        facts = cpu.detect()
    except ImportError:  # an install without torch yet: the kernel's flags alone
        flags = cpu.proc_flags() or frozenset()
        return for_cpu(cpu.isa_level(flags), flags)
    return for_cpu(cpu.isa_level(facts.flags, facts.capability), facts.flags)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--isa", choices=[*ISA_FLAGS, "avx512"], help="default: this CPU's")
    parser.add_argument("--dir", type=Path, help="default: " + str(library_dir()))
    args = parser.parse_args(argv)
    try:
        print(build(args.isa or this_cpu(), args.dir))
    except BuildError as exc:
        print(f"native decode step not built: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
