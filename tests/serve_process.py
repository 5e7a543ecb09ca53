"""A real `mtpkit serve` process on a free loopback port, for the server's tests: started with
`--port 0` (the port it bound is read from its log), waited for through /health, stopped by
its PID."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

START_TIMEOUT = 300.0  # seconds; generous, the machine may be busy


class ServerProcess:
    def __init__(self, model: Path, log: Path, *args: str) -> None:
        self.log_path = log
        self.log = open(log, "w")  # noqa: SIM115 (closed in stop)
        command = [sys.executable, "-m", "mtpkit", "serve", "--model", str(model), "--port", "0"]
        # A crash (an abort in native code included) leaves its stacks in the log.
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
        self.proc = subprocess.Popen(
            [*command, *args], stdout=self.log, stderr=subprocess.STDOUT, env=env
        )
        self.url = self._wait_ready()

    def _wait_ready(self) -> str:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited: {self.log_path.read_text()}")
            found = re.search(r"on (http://127\.0\.0\.1:\d+)", self.log_path.read_text())
            if found:
                try:
                    if httpx.get(found.group(1) + "/health", timeout=10).status_code == 200:
                        return found.group(1)
                except httpx.TransportError:
                    pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the server did not start: {self.log_path.read_text()}")

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=30).json()

    def wait_idle(self, timeout: float = 300.0) -> dict:
        """/health once nothing decodes and nothing waits."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.health()
            if not state["decoding"] and not state["queued"]:
                return state
            time.sleep(0.2)
        raise AssertionError(f"the server stayed busy: {self.health()}")

    def terminate(self, timeout: float = 120.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=60)
        self.log.close()
