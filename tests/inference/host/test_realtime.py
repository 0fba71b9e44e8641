"""The real-time first step (inference/host/realtime.py): its thread switching on real
threads of this process and of a child without the privilege (each thread's scheduling
inside `raised()` and after it), and the real server that uses it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest

from inference.host import process as host
from inference.host.process import INFERENCE_THREAD_NAME
from inference.host.realtime import PRIORITY, RealtimeFirstStep
from tests.support.httpclient import chat
from tests.support.metrics import scrape, value
from tests.support.paths import ROOT
from tests.support.tasks import slices_settable, task_policies

SLICE_US = 250


def _attr(tid: int) -> host.SchedAttr:
    got = host.sched_attr(tid)
    assert not isinstance(got, str), got
    return got


def _in_inference_threads(body) -> dict:
    """Runs body(seen, tids) in a thread named as the inference thread, at nice 5, SCHED_BATCH
    and a 250 us slice, beside a thread it started (which inherits all of those) and a thread
    of another name; `tids` maps "self", "child" and "other" to their thread ids."""
    seen: dict = {}
    done = threading.Event()
    tids: dict[str, int] = {}

    def wait(name: str) -> None:
        tids[name] = threading.get_native_id()
        done.wait(30)

    def inference() -> None:
        host.name_this_thread()
        tids["self"] = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tids["self"], 5)  # this thread only
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        seen["slice"] = host.set_slice(SLICE_US)
        child = threading.Thread(target=wait, args=("child",))
        child.start()
        while "child" not in tids:
            threading.Event().wait(0.001)
        try:
            body(seen, tids)
        finally:
            done.set()
            child.join()

    other = threading.Thread(target=wait, args=("other",))
    other.start()
    thread = threading.Thread(target=inference)
    thread.start()
    thread.join()
    other.join()
    return seen


def test_the_inference_threads_run_fifo_inside_and_their_own_after() -> None:
    """Inside: the inference thread and the one it started at SCHED_FIFO 1, a thread of
    another name untouched. After: each back to SCHED_BATCH, nice 5 and its slice."""

    def body(seen: dict, tids: dict) -> None:
        realtime = RealtimeFirstStep(50, SLICE_US)
        realtime.check()  # raises and lowers once, counted as no step
        seen["checked"] = realtime.steps
        seen["before"] = {name: _attr(tid) for name, tid in tids.items()}
        with realtime.raised():
            seen["inside"] = {name: _attr(tid) for name, tid in tids.items()}
        seen["after"] = {name: _attr(tid) for name, tid in tids.items()}
        seen["on"] = realtime.on

    seen = _in_inference_threads(body)
    assert seen["on"] and seen["checked"] == 0
    for name in ("self", "child"):
        inside = seen["inside"][name]
        assert (inside.policy, inside.priority) == (os.SCHED_FIFO, PRIORITY), seen
        assert seen["after"][name] == seen["before"][name], seen
        assert (seen["after"][name].policy, seen["after"][name].nice) == (os.SCHED_BATCH, 5)
    assert seen["inside"]["other"] == seen["before"]["other"], seen
    assert seen["inside"]["other"].policy == os.SCHED_OTHER
    if slices_settable():
        assert seen["slice"] is None
        assert {seen["after"][n].runtime for n in ("self", "child")} == {SLICE_US * 1000}


def test_a_thread_started_inside_is_lowered_and_a_failed_step_lowers_too() -> None:
    """A pool growing during a raised step: its new thread inherited SCHED_FIFO and gets the
    starting thread's own scheduling back, even under another name. A step that raises
    still lowers."""

    def body(seen: dict, tids: dict) -> None:
        realtime = RealtimeFirstStep(50, SLICE_US)
        release = threading.Event()
        born: dict[str, int] = {}

        def newcomer() -> None:
            host.name_this_thread("renamed")  # found as born during the step, not by name
            born["tid"] = threading.get_native_id()
            release.wait(30)

        seen["before"] = _attr(tids["self"])
        late = threading.Thread(target=newcomer)
        try:
            with realtime.raised():
                late.start()
                while "tid" not in born:
                    threading.Event().wait(0.001)
                seen["born"] = _attr(born["tid"])
                raise RuntimeError("the step failed")
        except RuntimeError:
            pass
        seen["late"] = _attr(born["tid"])
        seen["self"] = _attr(tids["self"])
        release.set()
        late.join()

    seen = _in_inference_threads(body)
    assert (seen["born"].policy, seen["born"].priority) == (os.SCHED_FIFO, PRIORITY), seen
    assert seen["late"] == seen["self"] == seen["before"], seen


@pytest.mark.parametrize("policy, priority", [(os.SCHED_RR, 3), (os.SCHED_FIFO, PRIORITY)])
def test_a_thread_already_real_time_is_left_as_the_operator_set_it(policy, priority) -> None:
    """Even at the very policy and priority the step raises to: it was so before."""

    def body(seen: dict, tids: dict) -> None:
        os.sched_setscheduler(tids["child"], policy, os.sched_param(priority))
        with RealtimeFirstStep(50, SLICE_US).raised():
            seen["inside"] = _attr(tids["child"])
        seen["after"] = _attr(tids["child"])
        seen["self"] = _attr(tids["self"])

    seen = _in_inference_threads(body)
    assert (seen["inside"].policy, seen["inside"].priority) == (policy, priority)
    assert seen["after"] == seen["inside"]
    assert seen["self"].policy == os.SCHED_BATCH  # the one it raised is back


def test_only_steps_expected_within_the_bound_fit() -> None:
    realtime = RealtimeFirstStep(50, 0)
    assert realtime.fits(0.05) and realtime.fits(0.001)
    assert not realtime.fits(0.051)
    assert not realtime.fits(None)  # nothing measured yet
    assert not RealtimeFirstStep(0, 0).on


# Without CAP_SYS_NICE (the unit's case: no capabilities), at nice -10 set before by root
# (systemd's Nice=): raised with the privilege still in the effective set, lowered after
# this thread dropped it; then a second instance asks without it. Prints what it saw.
_UNPRIVILEGED = textwrap.dedent(
    """
    import ctypes, logging, os, struct, threading
    from inference.host import process as host
    from inference.host.realtime import RealtimeFirstStep
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    libc = ctypes.CDLL(None, use_errno=True)

    def drop_sys_nice():  # capset on this thread: CAP_SYS_NICE (23) out of its sets
        header = struct.pack("Ii", 0x20080522, 0)
        data = ctypes.create_string_buffer(24)
        assert libc.capget(header, data) == 0
        words = list(struct.unpack("6I", data.raw))
        words[0] &= ~(1 << 23); words[1] &= ~(1 << 23)
        assert libc.capset(header, struct.pack("6I", *words)) == 0

    def main():
        host.name_this_thread()
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, -10)
        realtime = RealtimeFirstStep(50, 0)
        with realtime.raised():
            inside = host.sched_attr(tid)
            drop_sys_nice()
        after = host.sched_attr(tid)
        print("inside", inside.policy, inside.priority, "after", after.policy, after.nice)
        refused = RealtimeFirstStep(50, 0)
        refused.check()
        again = host.sched_attr(tid)
        print("refused", refused.on, again.policy, again.nice, refused.steps)

    thread = threading.Thread(target=main)
    thread.start()
    thread.join()
    """
)


def test_without_the_privilege_it_lowers_to_the_nice_it_had_and_refuses_in_one_warning() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _UNPRIVILEGED], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"inside {os.SCHED_FIFO} {PRIORITY} after {os.SCHED_OTHER} -10", done
    assert lines[1] == f"refused False {os.SCHED_OTHER} -10 0", done
    warnings = [x for x in done.stderr.splitlines() if x.startswith("WARNING")]
    assert len(warnings) == 1, done.stderr
    assert "Operation not permitted" in warnings[0] and "LimitRTPRIO=1" in warnings[0]
    assert "runs real-time" not in done.stderr  # check() says it is on only when it is


# -- the real server ---------------------------------------------------------------------------


def _inference_policies(pid: int) -> set[tuple[int, int]]:
    return {sched for name, sched in task_policies(pid) if name == INFERENCE_THREAD_NAME}


def _raised(server) -> float:
    return value(scrape(server.url), "deskchat_realtime_first_steps_total")


def test_the_server_raises_a_short_first_step_per_request_and_no_long_one(start_server) -> None:
    server = start_server("--model", "embedded", "--realtime-first-step-ms", "50")
    lines = [x for x in server.log().splitlines() if "real-time" in x]
    assert len(lines) == 1 and "INFO" in lines[0] and "at most 50 ms" in lines[0], lines
    before = _raised(server)
    for question in ("Name a colour.", "What is 2 + 2?", "Say hello."):
        reply = chat(server.url, {"message": question, "max_tokens": 6})
        assert reply.status == 200, reply.body
    assert _raised(server) - before == 3  # one first step each; their later steps are not
    long = "Summarize: " + "the printer on the second floor jams every morning. " * 40
    reply = chat(server.url, {"message": long, "max_tokens": 6})
    assert reply.status == 200, reply.body
    assert _raised(server) - before == 3  # its prompt was expected to take longer
    assert _inference_policies(server.proc.pid) == {(os.SCHED_OTHER, 0)}


def test_a_server_without_the_privilege_says_so_once_and_answers(start_server) -> None:
    server = start_server(
        "--model",
        "embedded",
        "--realtime-first-step-ms",
        "50",
        wrapper=["setpriv", "--bounding-set=-sys_nice"],  # no CAP_SYS_NICE; RLIMIT_RTPRIO 0
    )
    reply = chat(server.url, {"message": "Name a colour.", "max_tokens": 6})
    assert reply.status == 200, reply.body
    lines = [x for x in server.log().splitlines() if "--realtime-first-step-ms" in x]
    assert len(lines) == 1 and "WARNING" in lines[0] and "LimitRTPRIO=1" in lines[0], lines
    assert _raised(server) == 0
    assert _inference_policies(server.proc.pid) == {(os.SCHED_OTHER, 0)}
