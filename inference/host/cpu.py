"""What this CPU offers, and which path each part of the model takes on it.

Old office PCs lack AVX2 (Sandy/Ivy Bridge) or even AVX (Nehalem/Westmere), and a kernel that
uses a missing instruction kills the process with SIGILL, no log line. So the paths are
chosen from the CPU's flags before anything runs, from what was seen to work under
`qemu-x86_64 -cpu MODEL` (docs/old-cpus.md). `choose()` is pure (flags in, paths out) so
tests can fake every generation; `detect()` reads this machine. Of a model it knows only the
size (`ModelSize`), from which `auto` picks int8 or 4-bit weights (`auto_weights`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import mmap
from dataclasses import dataclass
from pathlib import Path

from service.config import DTYPE_CHOICES, QUANTIZE_CHOICES, ConfigError

log = logging.getLogger("deskchat.cpu")

# Generations, newest first: each needs the flags of its own line and of those below it.
ISA_LEVELS = (
    ("avx512", ("avx512f", "avx512bw", "avx512vl", "avx512dq")),
    ("avx2", ("avx2", "fma")),
    ("avx", ("avx",)),
    ("sse4.2", ("sse4_2",)),
)
OLDER = "older"
# torch's ATen kernel level (torch.backends.cpu.get_cpu_capability()) can be lowered with
# ATEN_CPU_CAPABILITY; a level above it is not assumed, so the caps the README measures with
# also steer the choice here.
CAPABILITY_CEILING = {"AVX512": "avx512", "AVX2": "avx2"}

# numpy's names for the flags of this process's CPUID (what an emulator shows; /proc/cpuinfo
# under qemu-user is the host's) -> /proc/cpuinfo's names.
CPUID_NAMES = {
    "SSE42": "sse4_2",
    "AVX": "avx",
    "FMA3": "fma",
    "F16C": "f16c",
    "AVX2": "avx2",
    "AVX512F": "avx512f",
    "AVX512BW": "avx512bw",
    "AVX512VL": "avx512vl",
    "AVX512DQ": "avx512dq",
    "AVX512VNNI": "avx512_vnni",
    "AVX512BF16": "avx512_bf16",
}

NONE = "none"


class CpuUnsupported(ConfigError):
    """An explicit --quantize that cannot work on this CPU: a start-up error, not a crash."""


@dataclass(frozen=True)
class CpuFacts:
    """What the CPU and torch say; the input of `choose()`."""

    flags: frozenset[str]  # /proc/cpuinfo names: avx2, fma, avx512_vnni, ...
    capability: str = "DEFAULT"  # torch.backends.cpu.get_cpu_capability()
    engines: tuple[str, ...] = ()  # torch.backends.quantized.supported_engines
    bf16_native: bool = False  # oneDNN computes bf16 natively (AVX512-BF16 or AMX)


@dataclass(frozen=True)
class Paths:
    """The kernel each part uses here; NONE where no kernel is known to work."""

    isa: str  # avx512, avx2, avx, sse4.2 or older
    vnni: bool
    int8: str  # torch.ao dynamic int8 engine: fbgemm, onednn, qnnpack, or none (fp32)
    int8_engines: tuple[str, ...]  # every engine that works here, fastest first
    int8_row: str  # fbgemm (per-row scales; 8-bit rows with VNNI, 7-bit without) or none
    int4: str  # aten (AVX2 and newer), aten-default (runs, slowly) or none
    bf16: str  # native or none (then fp32)
    attention: str  # fp32 scaled-dot-product attention at torch's kernel level

    def as_dict(self) -> dict:
        """For /health: the generation and each part's path."""
        keys = ("int8", "int8_row", "int4", "bf16", "attention")
        return {"isa": self.isa, "vnni": self.vnni, "paths": {k: getattr(self, k) for k in keys}}


def isa_level(flags: frozenset[str], capability: str = "AVX512") -> str:
    """The newest generation whose flags (and all older ones') are present, capped at
    torch's kernel level."""
    ceiling = CAPABILITY_CEILING.get(capability.upper(), "avx")
    names = [name for name, _ in ISA_LEVELS]
    allowed = names[names.index(ceiling) :]
    have = OLDER
    for name, needed in reversed(ISA_LEVELS):
        if not flags.issuperset(needed):
            break
        have = name
    if have == OLDER or have in allowed:
        return have
    return allowed[0]


def int8_engines(isa: str, engines: tuple[str, ...]) -> list[str]:
    """torch.ao int8 engines that work on `isa`, fastest first. fbgemm needs AVX2; oneDNN's
    dynamic int8 Linear died with SIGILL under `qemu -cpu Nehalem` (SSE4.2) and worked under
    `-cpu SandyBridge`; qnnpack (SSE2 kernels) worked on both. With AVX only, qnnpack
    decoded faster than oneDNN (which prefills faster): docs/old-cpus.md. Nothing was
    tried older than SSE4.2 (the pinned numpy does not even import there): fp32."""
    order = {
        "avx512": ("fbgemm", "onednn", "qnnpack"),
        "avx2": ("fbgemm", "onednn", "qnnpack"),
        "avx": ("qnnpack", "onednn"),
        "sse4.2": ("qnnpack",),
    }.get(isa, ())
    return [e for e in order if e in engines]


def choose(facts: CpuFacts) -> Paths:
    """The path of each part on a CPU with these facts."""
    isa = isa_level(facts.flags, facts.capability)
    # AVX-512 VNNI, or AVX-VNNI on an AVX2 CPU (Alder Lake and later).
    vnni = (isa == "avx512" and "avx512_vnni" in facts.flags) or (
        isa in ("avx512", "avx2") and "avx_vnni" in facts.flags
    )
    engines = int8_engines(isa, facts.engines)
    # The per-row Linear runs on fbgemm (AVX2 and newer); without VNNI its rows get 7 bits,
    # which it sums exactly where 8 would saturate (inference/quant/rowint8.py, row_limit).
    row = "fbgemm" if "fbgemm" in engines else NONE
    return Paths(
        isa=isa,
        vnni=vnni,
        int8=engines[0] if engines else NONE,
        int8_engines=tuple(engines),
        int8_row=row,
        # Correct under qemu Nehalem and SandyBridge, but without AVX2 ATen's kernel is its
        # DEFAULT build: decode 5-8x, prefill ~30x slower than fp32 there (docs/old-cpus.md)
        int4=NONE if isa == OLDER else "aten" if isa in ("avx512", "avx2") else "aten-default",
        bf16="native" if facts.bf16_native else NONE,
        attention=f"fp32 ({facts.capability.upper()} kernels)",
    )


@dataclass(frozen=True)
class Plan:
    """How this process runs the model, decided once at start and passed down: the CPU's
    paths, the weights' format (`quantize`) and which step serves (`step`). `auto`'s
    weights are settled once the model is known (`for_model`)."""

    paths: Paths
    requested: str  # --quantize
    quantize: str  # what is served: `requested`, or none where int8 cannot run
    why: str = ""  # with auto: why these weights (auto_weights), for the log line
    # The native decode step's library (inference/native) when it was built and loaded here
    library: object | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def native(self):
        """The native library when it runs the step: its int8 rows (with int8 or 4-bit
        weights) are the weights' format."""
        return self.library if self.quantize in NATIVE_KINDS else None

    @property
    def step(self) -> str:
        """What runs each decode step: "native <build level>" or "torch"."""
        return f"native {self.native.isa}" if self.native is not None else "torch"

    def on_torch(self) -> Plan:
        """This plan with torch's step: for a model whose layers the native step cannot run."""
        return dataclasses.replace(self, library=None)

    def summary(self) -> str:
        """The one log line of what was found and chosen."""
        p = self.paths
        fallback = ""
        if self.requested == DEFAULT_QUANTIZE:
            why = f"; {self.why}" if self.why else ""
            fallback = f" (auto: {p.isa}{', VNNI' if p.vnni else ', no VNNI'}{why})"
        elif self.quantize != self.requested:
            fallback = f" (asked {self.requested}: no int8 kernel is known to work here)"
        return (
            f"cpu {p.isa}{' +vnni' if p.vnni else ''}: int8 {p.int8}, int8-row {p.int8_row}, "
            f"int4 {p.int4}, bf16 {p.bf16}, attention {p.attention}; "
            f"serving quantize={self.quantize}{fallback}, step {self.step}"
        )

    def for_model(self, size: ModelSize | None, mem_total: int) -> Plan:
        """This plan once the model is known: `auto` on the native step serves int8 rows or
        4-bit weights by the model's size and this PC's RAM (`auto_weights`); any other
        plan stays as it is."""
        if self.requested != DEFAULT_QUANTIZE or self.native is None:
            return self
        quantize, why = auto_weights(size, mem_total)
        return dataclasses.replace(self, quantize=quantize, why=why)

    def int8_rows(self, why: str) -> Plan:
        """This auto plan with int8 rows, when the model turned out not to take 4-bit
        weights (`why`)."""
        return dataclasses.replace(self, quantize="int8-row", why=f"4-bit refused: {why}")

    def as_dict(self) -> dict:
        """For /health: the paths, the weights that serve (`quantize`, auto resolved) and
        the --quantize asked for."""
        shown = {"quantize": self.quantize, "requested": self.requested, "step": self.step}
        return {**self.paths.as_dict(), **shown}


DEFAULT_QUANTIZE = "auto"
NATIVE_KINDS = ("int8-row", "int4-row")  # what the native step runs

# `auto` on the native step: 4-bit weights for a model of FOUR_BIT_PARAMS
# parameters or more, or whose int8 weights would take more than 1/RAM_SHARE of MemTotal;
# int8 rows otherwise. docs/operations.md ("Which weights auto serves") has the measurements.
# Decode reads every weight once a token: at the Qwen2.5-0.5B shape int8 rows decoded as
# fast as 4-bit (1.01-1.09x in one process, docs/native.md) at half 4-bit's KL to fp32
# (0.0235 vs 0.0535); at the 1.5B shape 4-bit decoded 1.12x faster (25.2 vs 22.5 tok/s) in
# 23% less memory (VmHWM 1,979 vs 2,568 MB). 1B lies between the two sizes measured.
FOUR_BIT_PARAMS = 1_000_000_000
# The rest of the RAM is for the KV cache, the prefix cache (a sixteenth, at most 1 GB), the
# OS and the office's own programs, which a desk PC keeps running beside the service.
RAM_SHARE = 4


@dataclass(frozen=True)
class ModelSize:
    """What auto's choice of weights knows of a model: read from its config.json
    (inference/loading/assemble.py's `model_size`), no weight loaded."""

    params: int  # every weight once (a tied lm_head once): the "0.5B" of its name
    int8_bytes: int  # int8 rows' resident Linears, lm_head included: a byte a weight
    four_bit: bool  # int4-row can load it (Llama-style decoder in safetensors, k % 64 == 0)


def auto_weights(size: ModelSize | None, mem_total: int) -> tuple[str, str]:
    """The weights `auto` serves on the native step, int8-row or int4-row, for a model of
    `size` (None: not known) on a PC with `mem_total` bytes of RAM, and why in a few words
    (the log line). A fixed rule, not a measurement at start: the same model on PCs of the
    same RAM always gets the same weights."""
    if size is None:
        return "int8-row", "the model's size is not known"
    if not size.four_bit:
        return "int8-row", "int4-row takes Llama-style decoders in safetensors only"
    params = f"{size.params / 1e9:.2f}B parameters"
    limit = f"{FOUR_BIT_PARAMS / 1e9:g}B"
    int8 = f"int8-row's {size.int8_bytes / 2**20:,.0f} MB of weights"
    ram = f"1/{RAM_SHARE} of {mem_total / 2**20:,.0f} MB RAM"
    if size.params >= FOUR_BIT_PARAMS:
        return "int4-row", f"{params}, {limit} or more"
    if size.int8_bytes * RAM_SHARE > mem_total:
        return "int4-row", f"{int8} over {ram}"
    return "int8-row", f"{params}, under {limit}, and {int8} within {ram}"


def ram_bytes() -> int:
    """This PC's RAM (MemTotal), as the prefix cache's default budget reads it."""
    import psutil

    return psutil.virtual_memory().total


def plan(paths: Paths, requested: str, int8_engine: str = "auto", library=None) -> Plan:
    """What to serve for --quantize `requested` and --int8-engine on a CPU with `paths`.
    The defaults never fail (fp32 where no int8 kernel works); another choice that cannot
    run here is refused with a message saying why and what to use instead. `library`: the
    native decode step (inference/native) loaded here, which runs int8-row on any CPU."""
    plan_of = functools.partial(Plan, library=library)
    if library is not None:
        paths = dataclasses.replace(paths, int8_row="native")
    if int8_engine != "auto":
        if int8_engine not in paths.int8_engines:
            usable = ", ".join(paths.int8_engines) or "none"
            raise CpuUnsupported(
                f"--int8-engine {int8_engine} (DESKCHAT_INT8_ENGINE) cannot work on this CPU "
                f"({paths.isa}): fbgemm needs AVX2, onednn AVX (it dies with an illegal "
                f"instruction on SSE4.2); usable here: {usable}; or leave it at auto"
            )
        paths = dataclasses.replace(paths, int8=int8_engine)
    if requested == DEFAULT_QUANTIZE:
        # Per-row int8 where it runs: as fast as torch.ao's at one row (1.02x its decode step),
        # closer to float, and the same answer alone or in a batch (docs/speed.md).
        # With the native step, `for_model` may take 4-bit weights once the model is known.
        row = paths.int8_row != NONE
        best = "int8-row" if row else "int8" if paths.int8 != NONE else NONE
        why = "" if library is not None else "no native step, which 4-bit weights need"
        return plan_of(paths, requested, best, why)
    if requested == "int8" and paths.int8 == NONE:
        return plan_of(paths, requested, NONE)
    why = {
        "int8-row": (
            paths.int8_row,
            "needs fbgemm's int8 kernel, which needs AVX2",
        ),
        "int4": (paths.int4, "its kernel was only checked on CPUs with SSE4.2 or newer"),
        "int4-row": (
            "native" if library is not None else NONE,
            "needs the native decode step (a C compiler at install, not --no-native)",
        ),
    }.get(requested)
    if why is not None and why[0] == NONE:
        raise CpuUnsupported(
            f"--quantize {requested} (DESKCHAT_QUANTIZE) cannot work on this CPU "
            f"({paths.isa}, {'VNNI' if paths.vnni else 'no VNNI'}): it {why[1]}; use "
            f"--quantize auto (the default), int8 ({paths.int8} here) or none"
        )
    return plan_of(paths, requested, requested)


def proc_flags(path: Path = Path("/proc/cpuinfo")) -> frozenset[str] | None:
    """The kernel's flags of the first CPU, or None where there is no /proc/cpuinfo."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return None


def cpuid_flags() -> dict[str, bool]:
    """This process's CPUID as numpy reads it (OS support for AVX state included), in
    /proc/cpuinfo's names; empty when numpy does not say."""
    try:
        from numpy._core._multiarray_umath import __cpu_features__ as features
    except ImportError:
        return {}
    return {name: bool(features[key]) for key, name in CPUID_NAMES.items() if key in features}


def merge_flags(kernel: frozenset[str] | None, cpuid: dict[str, bool]) -> frozenset[str]:
    """A flag counts when the kernel lists it and CPUID, where it speaks of it, agrees.
    Under qemu-user /proc/cpuinfo is the host's, while CPUID is the emulated CPU's; a
    kernel that disabled a feature (clearcpuid=) leaves it out of /proc/cpuinfo."""
    if kernel is None:
        return frozenset(name for name, on in cpuid.items() if on)
    return frozenset(f for f in kernel if cpuid.get(f, True))


@functools.cache
def detect() -> CpuFacts:
    """The facts of this machine (read once per process)."""
    import torch

    return CpuFacts(
        flags=merge_flags(proc_flags(), cpuid_flags()),
        capability=torch.backends.cpu.get_cpu_capability(),
        engines=tuple(torch.backends.quantized.supported_engines),
        bf16_native=native_bf16(),
    )


def plan_here(requested: str, int8_engine: str = "auto", library=None) -> Plan:
    """This machine's plan for --quantize and --int8-engine; raises CpuUnsupported."""
    return plan(choose(detect()), requested, int8_engine, library)


def use(chosen: Plan) -> None:
    """Point torch.ao at the chosen int8 engine (a process-wide setting): its default on an
    old CPU (oneDNN on SSE4.2) is one that dies with SIGILL."""
    import torch

    engine = chosen.paths.int8
    if engine == NONE:
        return
    if engine == "fbgemm" and "x86" in torch.backends.quantized.supported_engines:
        engine = "x86"  # torch's default where fbgemm exists: fbgemm for Linear layers
    torch.backends.quantized.engine = engine


def native_bf16() -> bool:
    """True when oneDNN computes bf16 natively here (AVX512-BF16 or AMX), not by emulation."""
    import torch  # here, not at the top: the server reads its CPU plan before torch loads

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def writable_executable_memory() -> bool:
    """False under MemoryDenyWriteExecute=yes (systemd) or prctl(PR_SET_MDWE): no mapping
    may be writable and executable. oneDNN's bf16 kernels are JIT-compiled into such memory
    and fail there ("could not create a primitive"); fbgemm's int8 ones map twice instead."""
    try:
        probe = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    except OSError:
        return False
    probe.close()
    return True


def compute_dtype(quantize: str, dtype: str):
    """The dtype of activations and of the layers left unquantized.

    int8 dynamic quantization takes fp32 activations; bf16 is used only when asked for and
    the CPU has it natively (on an AVX2-only CPU it is emulated and slower than fp32).
    """
    import torch

    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {dtype!r}")
    if quantize not in QUANTIZE_CHOICES:
        raise ValueError(f"quantize must be one of {', '.join(QUANTIZE_CHOICES)}, got {quantize!r}")
    if dtype == "bfloat16" and quantize == "none":
        if not native_bf16():
            log.warning("dtype bfloat16 asked for, but this CPU has no native bf16: using float32")
        elif not writable_executable_memory():
            log.warning(
                "dtype bfloat16 asked for, but writable+executable memory is denied here "
                "(MemoryDenyWriteExecute=), which oneDNN's bf16 kernels need: using float32"
            )
        else:
            return torch.bfloat16
    elif dtype == "bfloat16":
        log.warning("dtype bfloat16 is only used with quantize=none: computing in float32")
    return torch.float32
