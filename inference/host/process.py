"""What the server asks of the host for steady latency: CPU pinning, the scheduler's slice,
locked memory, GC policy.

Each knob is a setting (service/config.py) and says in one log line what it did. This module
touches only the process itself (its threads' CPU masks and slices, its memory locks, the
interpreter's collector); kernel-wide tuning is system/tune.sh's, and the model is none of
its business.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import resource
import struct
from typing import NamedTuple

from service.cpu_list import format_cpu_list

log = logging.getLogger("deskchat.host")
_libc = ctypes.CDLL(None, use_errno=True)

INFERENCE_THREAD_NAME = "deskchat-infer"  # what `ps -L` / /proc/PID/task/*/comm shows
_PR_SET_NAME = 15
MCL_CURRENT, MCL_ONFAULT = 1, 4
_CAP_IPC_LOCK = 14

# The oldest generation's threshold while the policy is on: in effect never by itself, only
# when idle_collect() asks between jobs.
GC_OLDEST_OFF = 1_000_000
# Python's own default threshold for the oldest generation: with jobs waiting, collect
# between two of them no less often than Python would have.
BUSY_OLDEST_EVERY = 10


# -- CPU affinity ----------------------------------------------------------------------------


class Pinning:
    """Where the inference thread (and the OpenMP threads it starts) run, and everyone else.

    Why: the two OpenMP threads of a token step wait for each other; an HTTP thread, the
    tokenizer or the owner's programs landing on their core delays the whole token. Threads
    inherit their creator's mask, so the main thread takes the 'rest' mask before it starts
    the HTTP threads, and the inference thread takes its own before torch starts its pool.
    """

    def __init__(self, inference: frozenset[int], allowed: frozenset[int] | None = None):
        allowed = frozenset(os.sched_getaffinity(0) if allowed is None else allowed)
        self.inference = inference
        # With every core given to inference there is nowhere else to go: share them all.
        self.rest = (allowed - inference) or allowed

    def threads(self, wanted: int) -> int:
        """No more OpenMP threads than pinned cores: two on one core take turns every step."""
        return min(wanted, len(self.inference))

    def pin_others(self) -> None:
        """Call in the main thread before it starts the HTTP threads."""
        os.sched_setaffinity(0, self.rest)

    def pin_inference(self) -> None:
        """Call in the inference thread before the model is loaded."""
        os.sched_setaffinity(0, self.inference)
        log.info(
            "inference thread on CPUs %s, HTTP and other threads on %s",
            format_cpu_list(self.inference),
            format_cpu_list(self.rest),
        )


def name_this_thread(name: str = INFERENCE_THREAD_NAME) -> None:
    """Name the calling OS thread (15 bytes at most); threads it starts inherit the name,
    so torch's OpenMP threads show up as the inference thread's."""
    _libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


# -- the scheduler's slice ---------------------------------------------------------------------

# (sched_setattr, sched_getattr) by the interpreter's architecture (64- or 32-bit x86 differ)
_SCHED_SYSCALLS = {
    ("x86_64", 8): (314, 315),
    ("x86_64", 4): (351, 352),  # a 32-bit Python on a 64-bit kernel: i386's numbers
    ("i686", 4): (351, 352),
    ("i386", 4): (351, 352),
    ("aarch64", 8): (274, 275),
    ("riscv64", 8): (274, 275),
    ("armv7l", 4): (380, 381),
}
_SCHED_ATTR = struct.Struct("IIQiIQQQII")  # struct sched_attr, SCHED_ATTR_SIZE_VER1 (56 bytes)
FAIR_POLICIES = (os.SCHED_OTHER, os.SCHED_BATCH)  # the ones the kernel gives a slice to
SCHED_FLAG_RESET_ON_FORK = 1


class SchedAttr(NamedTuple):
    """struct sched_attr's fields that a thread's scheduling is (not SCHED_DEADLINE's)."""

    policy: int
    flags: int
    nice: int
    priority: int  # SCHED_FIFO/RR's; 0 for the fair policies
    runtime: int  # for the fair policies, the thread's slice in ns (Linux 6.12+)


def _sched_numbers() -> tuple[int, int] | None:
    return _SCHED_SYSCALLS.get((os.uname().machine, struct.calcsize("P")))


def sched_attr(tid: int = 0) -> SchedAttr | str:
    """A thread's scheduling (0: the calling one) as sched_getattr reads it, else the
    one-line reason it could not."""
    numbers = _sched_numbers()
    if numbers is None:
        return f"no sched_getattr number known for {os.uname().machine}"
    got = ctypes.create_string_buffer(_SCHED_ATTR.size)
    if _libc.syscall(numbers[1], tid, got, _SCHED_ATTR.size, 0) != 0:
        return f"sched_getattr failed ({os.strerror(ctypes.get_errno())})"
    _size, policy, flags, nice, priority, runtime, *_ = _SCHED_ATTR.unpack(got.raw)
    return SchedAttr(policy, flags, nice, priority, runtime)


def set_sched_attr(tid: int, attr: SchedAttr) -> str | None:
    """sched_setattr for one thread (0: the calling one): None when the kernel took it,
    else the one-line reason it did not. Unlike sched_setscheduler it keeps (or sets) the
    thread's own slice: `runtime` is the slice for fair policies (0: the kernel's)."""
    numbers = _sched_numbers()
    if numbers is None:
        return f"no sched_setattr number known for {os.uname().machine}"
    packed = _SCHED_ATTR.pack(_SCHED_ATTR.size, *attr, 0, 0, 0, 0)
    if _libc.syscall(numbers[0], tid, ctypes.create_string_buffer(packed), 0) != 0:
        return f"sched_setattr failed ({os.strerror(ctypes.get_errno())})"
    return None


def set_slice(microseconds: int) -> str | None:
    """Ask the kernel for a scheduler slice of `microseconds` (0: its default) for the
    calling thread and the threads and processes it starts afterwards (they inherit it),
    its nice and policy kept. Since Linux 6.12 a waking thread with a shorter slice than the
    running one may take the CPU at once instead of at the next tick (docs/latency.md).
    Returns None when the kernel took it, else the one-line reason it did not."""
    policy = os.sched_getscheduler(0)
    flags = SCHED_FLAG_RESET_ON_FORK if policy & os.SCHED_RESET_ON_FORK else 0
    policy &= ~os.SCHED_RESET_ON_FORK
    if policy not in FAIR_POLICIES:
        return f"not set: the thread's scheduling policy ({policy}) has no slice"
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    runtime = microseconds * 1000
    problem = set_sched_attr(0, SchedAttr(policy, flags, nice, 0, runtime))
    if problem:
        return f"not set: {problem}"
    if not microseconds:
        return None
    got = sched_attr(0)
    if isinstance(got, str):
        return f"not known: {got}"
    if got.runtime != runtime:  # 6.12+ reports the slice as sched_runtime
        return "not set: this kernel keeps its own slice (a thread's own came in Linux 6.12)"
    return None


# -- locked memory ----------------------------------------------------------------------------


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _can_lock_any() -> bool:
    """CAP_IPC_LOCK in the effective set: the limit does not apply (root outside a unit)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> _CAP_IPC_LOCK & 1)
    return False


def _mb(kb: float) -> str:
    return f"{kb / 1024:.0f} MB"


def lock_memory() -> str | None:
    """mlockall(MCL_CURRENT | MCL_ONFAULT): what is resident now (the weights, the code
    that runs them) stays in RAM; pages never touched are not pulled in, so RSS does not
    grow. Why: under memory pressure the kernel evicts file-backed pages (libtorch's code)
    even without swap, and swaps the weights out where there is swap; the next token then
    waits for the disk. Returns None when locked, else the one-line reason it is not.

    The kernel checks the whole mapped size (VmSize) against RLIMIT_MEMLOCK, not only what
    is resident, so the unit sets LimitMEMLOCK=infinity."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    mapped_kb = _status_kb("VmSize")
    if soft != resource.RLIM_INFINITY and soft < mapped_kb * 1024 and not _can_lock_any():
        return (
            f"--mlock: not locked: the memory lock limit is {_mb(soft / 1024)} and the server "
            f"maps {_mb(mapped_kb)}; set LimitMEMLOCK=infinity in the unit (or ulimit -l "
            "unlimited), or turn --mlock off"
        )
    if _libc.mlockall(MCL_CURRENT | MCL_ONFAULT) != 0:
        err = ctypes.get_errno()
        return f"--mlock: not locked: mlockall failed ({os.strerror(err)})"
    log.info(
        "memory locked (mlockall, on fault): the %s resident now stay", _mb(_status_kb("VmRSS"))
    )
    return None


# -- the garbage collector --------------------------------------------------------------------


def apply_gc_policy(policy: str) -> None:
    """'idle': collect once, freeze what exists (the model, torch, transformers: hundreds of
    thousands of objects that never die, which every oldest-generation collection would
    otherwise walk), and stop the oldest generation from running by itself: between_jobs()
    runs it between jobs. The young generations stay automatic (they are short).
    'python': Python's own thresholds, nothing frozen."""
    if policy == "python":
        return
    gc.collect()
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, GC_OLDEST_OFF)
    log.info("GC: %d objects frozen; oldest generation only between jobs", gc.get_freeze_count())


def between_jobs(queued: int) -> bool:
    """Under the 'idle' policy, run the oldest generation here, between two jobs in the
    inference thread, so that no token waits for it: whenever it has work and no job waits,
    and after BUSY_OLDEST_EVERY younger collections even when jobs wait (a server that is
    never idle still collects). Returns whether it collected; a no-op under 'python'."""
    if gc.get_threshold()[2] != GC_OLDEST_OFF:
        return False
    pending = gc.get_count()[2]  # generation-1 collections since the last full one
    if pending >= BUSY_OLDEST_EVERY or (pending and not queued):
        gc.collect()
        return True
    return False
