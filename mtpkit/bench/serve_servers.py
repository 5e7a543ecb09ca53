"""The two servers `mtpkit bench --serve` drives: `mtpkit serve` and `mlx_lm.server` on the
same model directory, each a process of its own on 127.0.0.1 and a free port, waited for
through /health and stopped by its PID (SIGTERM, then SIGKILL)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from mtpkit.core.errors import MtpkitError

START_TIMEOUT = 600.0  # seconds; a busy machine loads slowly
STOP_TIMEOUT = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mtpkit_command(model: str, port: int, extra: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "mtpkit", "serve", "--model", model, "--host", "127.0.0.1",
        "--port", str(port), "--log-level", "WARNING", *extra,
    ]  # fmt: skip


def mlx_lm_command(model: str, port: int, extra: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "mlx_lm.server", "--model", model, "--host", "127.0.0.1",
        "--port", str(port), "--log-level", "WARNING", *extra,
    ]  # fmt: skip


class ServerProcess:
    """A server process, its log in `log`; `url` once it answers /health."""

    def __init__(self, name: str, command: list[str], port: int, log: Path) -> None:
        self.name, self.command, self.log_path = name, command, log
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(log, "w")  # noqa: SIM115 (closed in stop)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise MtpkitError(f"{self.name} exited while starting: {self._log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=10).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        raise MtpkitError(f"{self.name} did not answer /health in {timeout:.0f} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def _log_tail(self) -> str:
        lines = self.log_path.read_text(errors="replace").strip().splitlines()
        return lines[-1] if lines else "(no output)"


def start_servers(
    model: str, work: Path, mtpkit_args: list[str], mlx_lm_args: list[str]
) -> list[ServerProcess]:
    """Both servers, started together and waited for; on a failure, those started stop."""
    specs = [
        ("mtpkit", mtpkit_command, mtpkit_args),
        ("mlx_lm", mlx_lm_command, mlx_lm_args),
    ]
    servers: list[ServerProcess] = []
    try:
        for name, command, extra in specs:
            port = free_port()
            servers.append(
                ServerProcess(name, command(model, port, extra), port, work / f"{name}.log")
            )
        for server in servers:
            server.wait_ready()
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers
