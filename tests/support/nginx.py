"""A real nginx on loopback, as an ordinary process: the fleet config that
system/nginx/fleet-conf.sh writes, wrapped in a main config whose every path is in a temp dir.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from tests.support.paths import ROOT
from tests.support.servers import free_port
from tests.support.systree import skip_unless_ci

FLEET_CONF = ROOT / "system/nginx/fleet-conf.sh"

# nginx's own main context, as a Debian /etc/nginx/nginx.conf would give it, but with
# every file it writes under the test's directory (the package's defaults are in /var).
MAIN_CONF = """\
daemon off;
{user}
worker_processes 2;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log info;
events {{ worker_connections 512; }}
http {{
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    include {tmp}/deskchat-fleet.conf;
}}
"""


def nginx_binary() -> str:
    """nginx from PATH or Debian's /usr/sbin (not on a normal user's PATH); else skip."""
    found = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")
    if found is None:
        skip_unless_ci("nginx is not installed (Debian package nginx)")
    return found


def fleet_conf(pcs: list[str], *options: str) -> str:
    done = subprocess.run(
        [str(FLEET_CONF), *options, *pcs], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


class Nginx:
    """nginx in front of `pcs` (HOST:PORT each), listening on a free loopback port."""

    def __init__(self, tmp: Path, pcs: list[str], request_timeout: int = 120):
        self.tmp = tmp
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.access_log = tmp / "access.log"
        self.error_log = tmp / "error.log"
        conf = fleet_conf(
            pcs,
            "--listen",
            f"127.0.0.1:{self.port}",
            "--request-timeout",
            str(request_timeout),
            "--access-log",
            str(self.access_log),
        )
        (tmp / "deskchat-fleet.conf").write_text(conf)
        # As root the workers would drop to nobody, who cannot enter pytest's private tmp.
        user = "user root;" if os.geteuid() == 0 else ""
        (tmp / "nginx.conf").write_text(MAIN_CONF.format(tmp=tmp, user=user))
        self._output = open(tmp / "nginx.out", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                nginx_binary(),
                "-p",
                str(tmp),
                "-c",
                str(tmp / "nginx.conf"),
                "-e",
                str(self.error_log),
            ],
            stdout=self._output,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stop() ends master and workers
        )
        self._wait_listening()

    def _wait_listening(self, timeout: float = 10) -> None:
        import socket

        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise AssertionError(f"nginx exited {self.proc.returncode}:\n{self.errors()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.05)
        raise AssertionError(f"nginx not listening in {timeout} s:\n{self.errors()}")

    def errors(self) -> str:
        out = (self.tmp / "nginx.out").read_text(errors="replace")
        log = self.error_log.read_text(errors="replace") if self.error_log.exists() else ""
        return out + log

    def access_lines(self) -> list[str]:
        return self.access_log.read_text().splitlines() if self.access_log.exists() else []

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # fast shutdown: open streams are cut
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._output.close()
