"""Builds the native decode step (step.c) with this PC's C compiler, for its instruction set.

One shared library per instruction-set level (avx-vnni, avx512-vnni, avx2, avx, sse4.2 or
plain x86-64), named by a hash of the source and the flags, so a change of either builds
afresh and an unchanged one is found again. `make install` and system/install.sh
build it; the server builds it on start when it is missing and the folder is writable.
Nothing here touches the network. `python -m inference.native.build` builds for this CPU
(its best level that compiles) and prints the library's path (or why not, exit 1).
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
# Per level, preferred first: what the compiler may use. The VNNI levels are the avx2 build
# with vpdpbusd for the integer products (step.c's dot4): AVX-VNNI's VEX form (Alder Lake and
# newer), else AVX-512 VNNI's EVEX one at the same 256 bits (Ice Lake, Cascade Lake; 256 for
# the rest of the code too, as the avx2 build has it). The SSE4.2 build is SSSE3's integer
# products, which every such CPU has.
ISA_FLAGS = {
    "avx-vnni": ["-mavx2", "-mfma", "-mf16c", "-mavxvnni"],
    "avx512-vnni": [
        *("-mavx2", "-mfma", "-mf16c", "-mavx512vnni", "-mavx512vl"),
        "-mprefer-vector-width=256",
    ],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx": ["-mavx"],
    "sse4.2": ["-msse4.2"],
    "older": [],
}
# Per level: the CPU generation (inference/host/cpu.py's isa_level, capped at torch's kernel
# level) it needs at least, and the flags beyond that generation's own. The avx2 builds
# convert the float16 KV cache with F16C, which a VM may hide.
NEEDS = {
    "avx-vnni": ("avx2", frozenset({"f16c", "avx_vnni"})),
    "avx512-vnni": ("avx512", frozenset({"f16c", "avx512_vnni", "avx512vl"})),
    "avx2": ("avx2", frozenset({"f16c"})),
    "avx": ("avx", frozenset()),
    "sse4.2": ("sse4.2", frozenset()),
    "older": ("older", frozenset()),
}
# A generation named without its flags (--isa avx512): the build every such CPU runs.
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


def runnable(isa: str, flags: frozenset[str]) -> list[str]:
    """The levels a CPU of generation `isa` with these flags runs, preferred first: those of
    its generation or older whose flags it has (an AVX2 CPU that hides f16c runs avx)."""
    from inference.host.cpu import ISA_LEVELS, OLDER

    order = [name for name, _ in ISA_LEVELS] + [OLDER]
    allowed = order[order.index(isa) :]
    return [lvl for lvl, (gen, needs) in NEEDS.items() if gen in allowed and needs <= flags]


def for_cpu(isa: str, flags: frozenset[str]) -> str:
    """The level to build and load for a CPU of generation `isa` with these flags."""
    return runnable(isa, flags)[0]


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


def command(cc: str, isa: str, out: str | Path) -> list[str]:
    """The compiler's command line for `isa`'s library at `out`."""
    flags = [*COMMON_FLAGS, *ISA_FLAGS[level(isa)]]
    return [cc, *flags, "-o", str(out), str(SOURCE), "-lm", "-lpthread"]


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
    try:
        done = subprocess.run(
            command(cc, isa, tmp), capture_output=True, text=True, timeout=COMPILE_SECONDS
        )
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


def runnable_here() -> list[str]:
    """The levels this CPU runs, preferred first, from its generation as the server's plan
    names it (capped by ATEN_CPU_CAPABILITY) and its flags."""
    from inference.host import cpu

    try:
        facts = cpu.detect()
    except ImportError:  # an install without torch yet: the kernel's flags alone
        flags = cpu.proc_flags() or frozenset()
        return runnable(cpu.isa_level(flags), flags)
    return runnable(cpu.isa_level(facts.flags, facts.capability), facts.flags)


def this_cpu() -> str:
    """This CPU's level."""
    return runnable_here()[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--isa", choices=[*ISA_FLAGS, "avx512"], help="default: this CPU's")
    parser.add_argument("--dir", type=Path, help="default: " + str(library_dir()))
    args = parser.parse_args(argv)
    problem = None
    # this CPU's levels in turn: a compiler too old for -mavxvnni (GCC 10) builds avx2
    for isa in [args.isa] if args.isa else runnable_here():
        try:
            print(build(isa, args.dir))
            return 0
        except BuildError as exc:
            problem = problem or exc
    print(f"native decode step not built: {problem}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
