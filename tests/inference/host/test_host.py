"""inference/host/process.py: CPU pinning of the right threads, the mlock limit message, GC policy.

No timing here: what each knob buys is measured by `python -m bench --latency`.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from inference.host import process as host
from inference.runtime.jobs import Sampling
from service.config import ConfigError, load_config
from service.cpu_list import parse_cpu_list
from tests.support.httpclient import chat
from tests.support.paths import ROOT
from tests.support.systree import skip_unless_ci
from tests.support.tasks import slice_ns, slices_settable, task_masks, task_slices

ALLOWED = frozenset(os.sched_getaffinity(0))
LAST = max(ALLOWED)


@pytest.mark.parametrize(
    ("text", "cores"),
    [("0", {0}), ("0-2", {0, 1, 2}), ("1,3-4", {1, 3, 4}), (" 2 , 0 ", {0, 2})],
)
def test_parse_cpu_list(text: str, cores: set[int]) -> None:
    assert parse_cpu_list(text) == cores


@pytest.mark.parametrize("text", ["", "a", "3-1", "1-", "-1", "1;2"])
def test_parse_cpu_list_refuses(text: str) -> None:
    with pytest.raises(ValueError):
        parse_cpu_list(text)


def test_cpu_affinity_setting_is_checked_against_this_machine() -> None:
    config = load_config([], {"DESKCHAT_CPU_AFFINITY": str(LAST)})
    assert config.cpu_affinity == str(LAST)
    with pytest.raises(ConfigError, match="--cpu-affinity.*not available here"):
        load_config(["--cpu-affinity", f"{LAST + 1000}"], {})
    with pytest.raises(ConfigError, match="DESKCHAT_CPU_AFFINITY"):
        load_config([], {"DESKCHAT_CPU_AFFINITY": "x"})


def test_pinning_split() -> None:
    p = host.Pinning(frozenset({1}), allowed=frozenset({0, 1, 2, 3}))
    assert p.rest == {0, 2, 3}
    assert p.threads(4) == 1
    # Every CPU to inference: the others share them rather than have none.
    p = host.Pinning(frozenset({0, 1}), allowed=frozenset({0, 1}))
    assert p.rest == {0, 1} and p.threads(2) == 2 and p.threads(1) == 1


# A fresh process: the main thread takes the 'rest' mask, then a thread pins itself as the
# inference thread and runs torch with two OpenMP threads. Prints every thread's mask.
OPENMP_CHILD = """
import json, sys, threading
from inference.host import process as host
from tests.support.tasks import task_masks
pinning = host.Pinning(frozenset({int(sys.argv[1])}))
pinning.pin_others()
def infer():
    host.name_this_thread()
    pinning.pin_inference()
    import torch
    torch.set_num_threads(2)
    a = torch.randn(512, 512)
    for _ in range(20):
        a = torch.tanh(a @ a)
    print(json.dumps([[n, sorted(m)] for n, m in task_masks()]))
t = threading.Thread(target=infer)
t.start()
t.join()
"""


def test_openmp_threads_inherit_the_inference_mask() -> None:
    out = subprocess.run(
        [sys.executable, "-c", OPENMP_CHILD, str(LAST)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    tasks = [(name, frozenset(mask)) for name, mask in json.loads(out.stdout)]
    pinned = [mask for name, mask in tasks if name == host.INFERENCE_THREAD_NAME]
    assert len(pinned) >= 2, tasks  # the thread itself and at least one OpenMP worker
    assert all(mask == {LAST} for mask in pinned), tasks
    rest = (ALLOWED - {LAST}) or ALLOWED
    assert all(mask == rest for name, mask in tasks if name != host.INFERENCE_THREAD_NAME)


@pytest.mark.slow
def test_server_pins_locks_and_freezes(start_server) -> None:
    """The real server: inference threads on --cpu-affinity, all others off it; memory
    locked (root here, or a limit high enough); the GC policy applied after the warm-up."""
    if not host._can_lock_any() and host.resource.getrlimit(host.resource.RLIMIT_MEMLOCK)[0] != (
        host.resource.RLIM_INFINITY
    ):
        pytest.skip("neither CAP_IPC_LOCK nor an unlimited memlock limit: see the next test")
    server = start_server("--model", "embedded", "--cpu-affinity", str(LAST), "--mlock")
    reply = chat(server.url, {"message": "What is the capital of France?", "max_tokens": 8})
    assert reply.status == 200, reply.body
    tasks = task_masks(server.proc.pid)
    pinned = [mask for name, mask in tasks if name == host.INFERENCE_THREAD_NAME]
    others = [mask for name, mask in tasks if name != host.INFERENCE_THREAD_NAME]
    assert pinned and all(mask == {LAST} for mask in pinned), tasks
    rest = (ALLOWED - {LAST}) or ALLOWED
    assert len(others) >= 5 and all(mask == rest for mask in others), tasks  # main + HTTP
    status = Path(f"/proc/{server.proc.pid}/status").read_text()
    locked_kb = int(next(x for x in status.splitlines() if x.startswith("VmLck:")).split()[1])
    assert locked_kb > 100_000
    log = server.log()
    assert "memory locked" in log and "objects frozen" in log


@pytest.mark.slow
def test_mlock_limit_too_low_is_one_clear_line(start_server) -> None:
    """Without CAP_IPC_LOCK and with the usual 8 MB limit: one WARNING naming the limit and
    LimitMEMLOCK=, and the server serves unlocked."""
    if subprocess.run(["setpriv", "--version"], capture_output=True).returncode != 0:
        skip_unless_ci("setpriv (util-linux) is needed to drop CAP_IPC_LOCK")
    wrapper = ["prlimit", "--memlock=8388608:8388608", "--"]
    if os.geteuid() == 0:  # root may lock anything: drop the capability for the child
        wrapper += ["setpriv", "--bounding-set=-ipc_lock", "--inh-caps=-ipc_lock", "--"]
    server = start_server(
        "--model", "embedded", "--mlock", "--gc-policy", "python", wrapper=wrapper
    )
    reply = chat(server.url, {"message": "What is the capital of France?", "max_tokens": 8})
    assert reply.status == 200, reply.body
    lines = [x for x in server.log().splitlines() if "--mlock" in x]
    assert len(lines) == 1, server.log()
    assert "WARNING" in lines[0] and "limit is 8 MB" in lines[0]
    assert "LimitMEMLOCK=infinity" in lines[0]
    assert "objects frozen" not in server.log()  # --gc-policy python


def _slices_here() -> dict[str, int | None]:
    """In a new thread: its slice after set_slice(250), a thread it starts then, and its
    own after set_slice(0). The test process's threads keep theirs."""
    seen: dict[str, int | None] = {}

    def child() -> None:
        seen["child"] = slice_ns("thread-self")

    def parent() -> None:
        seen["before"] = slice_ns("thread-self")
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 5)  # this thread only
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        seen["problem"] = host.set_slice(250)
        seen["set"] = slice_ns("thread-self")
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        seen["policy"] = os.sched_getscheduler(0)
        started = threading.Thread(target=child)
        started.start()
        started.join()
        host.set_slice(0)
        seen["reset"] = slice_ns("thread-self")

    thread = threading.Thread(target=parent)
    thread.start()
    thread.join()
    return seen


def test_set_slice_is_the_threads_and_inherited_and_undone() -> None:
    """--sched-slice-us: the calling thread's slice, which threads it starts inherit; 0 gives
    the kernel's default back (what the bench's noise processes take). The thread's nice
    and policy stay, and the test process's own threads keep their slice."""
    mine = slice_ns("thread-self")
    seen = _slices_here()
    assert (seen["nice"], seen["policy"]) == (5, os.SCHED_BATCH)  # on any kernel
    if not slices_settable():
        assert seen["problem"].startswith("not set"), seen
        pytest.skip("a thread's own slice came in Linux 6.12")
    assert seen["problem"] is None
    assert seen["set"] == seen["child"] == 250_000, seen
    assert seen["reset"] == seen["before"] != 250_000, seen
    assert slice_ns("thread-self") == mine


def test_set_slice_keeps_reset_on_fork() -> None:
    """A thread with SCHED_RESET_ON_FORK (which it may set but not clear) keeps the flag:
    the policy read back carries it, and the call must pass it on to succeed."""
    seen = {}

    def flagged() -> None:
        os.sched_setscheduler(0, os.SCHED_OTHER | os.SCHED_RESET_ON_FORK, os.sched_param(0))
        seen["problem"] = host.set_slice(250)
        seen["policy"] = os.sched_getscheduler(0)

    thread = threading.Thread(target=flagged)
    thread.start()
    thread.join()
    assert seen["policy"] == os.SCHED_OTHER | os.SCHED_RESET_ON_FORK
    if slices_settable():
        assert seen["problem"] is None
    else:
        assert seen["problem"].startswith("not set"), seen


def test_set_slice_says_why_not_where_the_policy_has_none() -> None:
    """SCHED_IDLE threads get no slice from the kernel: set_slice says so, changes nothing."""
    seen = {}

    def idle() -> None:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        seen["problem"] = host.set_slice(250)
        seen["policy"] = os.sched_getscheduler(0)

    thread = threading.Thread(target=idle)
    thread.start()
    thread.join()
    assert seen == {
        "problem": "not set: the thread's scheduling policy (5) has no slice",
        "policy": os.SCHED_IDLE,
    }


@pytest.mark.parametrize("value", ["1", "99", "100001", "-5"])
def test_slice_setting_outside_the_kernels_range_is_refused(value: str) -> None:
    with pytest.raises(ConfigError, match="sched.slice"):
        load_config(["--sched-slice-us", value], {})


@pytest.mark.parametrize("value", [0, 100, 100_000])
def test_slice_setting_takes_the_kernels_range(value: int) -> None:
    assert load_config(["--sched-slice-us", str(value)], {}).sched_slice_us == value


@pytest.mark.slow
def test_server_threads_take_the_slice(start_server) -> None:
    """The real server: every thread (main, HTTP, inference, the native step's pool) has
    --sched-slice-us, set before any of them started, and the log says so."""
    if not slices_settable():
        pytest.skip("a thread's own slice came in Linux 6.12")
    server = start_server("--model", "embedded", "--sched-slice-us", "300")
    reply = chat(server.url, {"message": "What is the capital of France?", "max_tokens": 8})
    assert reply.status == 200, reply.body
    slices = task_slices(server.proc.pid)
    assert len(slices) >= 5 and all(ns == 300_000 for _, ns in slices), slices
    assert "scheduler slice 300 us for every thread" in server.log()


@pytest.fixture
def gc_state():
    """Give the test process its collector back as it was."""
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


def test_gc_policy_idle_freezes_and_defers_the_oldest_generation(gc_state) -> None:
    host.apply_gc_policy("idle")
    assert gc.get_freeze_count() > 1000
    assert gc.get_threshold()[2] == host.GC_OLDEST_OFF
    gc.collect(1)  # one younger collection: the oldest generation has work pending
    full = gc.get_stats()[2]["collections"]
    assert host.between_jobs(queued=1) is False  # a job waits: not yet
    assert gc.get_stats()[2]["collections"] == full
    assert host.between_jobs(queued=0) is True  # idle: now
    assert gc.get_stats()[2]["collections"] == full + 1
    for _ in range(host.BUSY_OLDEST_EVERY):
        gc.collect(1)
    assert host.between_jobs(queued=3) is True  # busy for long: still collects


def test_gc_policy_python_changes_nothing(gc_state) -> None:
    before = gc.get_threshold()
    host.apply_gc_policy("python")
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
    gc.collect(1)
    assert host.between_jobs(queued=0) is False


def test_worker_collects_between_jobs(fake_server, gc_state) -> None:
    """The worker's loop calls between_jobs: after a job, the oldest generation runs."""
    host.apply_gc_policy("idle")
    server = fake_server()
    gc.collect(1)
    full = gc.get_stats()[2]["collections"]
    assert chat(server.url, {"message": "hi", "max_tokens": 4}).status == 200
    server.worker.run_now([1, 2], Sampling(max_tokens=2))  # a second job: the loop went round
    assert gc.get_stats()[2]["collections"] > full
