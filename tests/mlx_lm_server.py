"""A real `mlx_lm.server` process, the reference a drop-in is compared with: started on a free
loopback port, waited for through /health, killed by its PID."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

START_TIMEOUT = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlxLmServer:
    def __init__(self, model: Path, log: Path, *args: str) -> None:
        self.log_path = log
        self.log = open(log, "w")  # noqa: SIM115 (closed in stop)
        port = free_port()
        command = [sys.executable, "-m", "mlx_lm", "server", "--model", str(model)]
        self.proc = subprocess.Popen(
            [*command, "--port", str(port), *args], stdout=self.log, stderr=subprocess.STDOUT
        )
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlx_lm.server exited: {log.read_text()}")
            try:
                if httpx.get(self.url + "/health", timeout=10).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"mlx_lm.server did not start: {log.read_text()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=60)
        self.log.close()
