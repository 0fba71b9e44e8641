"""A deskchat server with the scripted engine in a process of its own, for tests that kill a PC.

`python -m tests.support.fake_backend [--token-s S] [deskchat flags]` prints `listening URL` once it
serves, logs one line per request to stderr, and runs until it is signalled.
"""

from __future__ import annotations

import argparse
import logging
import signal
import subprocess
import sys
from pathlib import Path

from tests.support.fakes import FakeEngine
from tests.support.paths import ROOT
from tests.support.servers import InProcessServer


class BackendProcess:
    """The child process, from the test's side: its URL, its log, and a way to kill it."""

    def __init__(self, tmp: Path, *flags: str, token_s: float = 0.05):
        self.log_path = tmp / f"backend-{id(self)}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.fake_backend", "--token-s", str(token_s), *flags],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        line = self.proc.stdout.readline()
        assert line.startswith("listening "), f"backend did not start:\n{self.log()}"
        self.url = line.split()[1]
        self.address = self.url.removeprefix("http://")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL: the PC is gone at once, its sockets closed by the kernel."""
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc.stdout.close()
        self._log.close()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--token-s", type=float, default=0.05)
    args, flags = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    server = InProcessServer(FakeEngine(token_s=args.token_s), *flags)
    print("listening", server.url, flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    server.close()
    return 0


if __name__ == "__main__":
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    sys.exit(main(sys.argv[1:]))
