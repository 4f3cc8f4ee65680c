"""Start `cascade serve` as a separate process on loopback and wait until it answers (tests, benchmarks, notebooks)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(
    config: str | Path, *args: str, startup_timeout: float = 120.0, env: dict | None = None,
    on_start: Callable[[subprocess.Popen], None] | None = None,
):
    """Yields the base URL (``http://127.0.0.1:PORT``); stops the server (SIGTERM, then SIGKILL) afterwards.
    ``on_start`` gets the server's process once it answers (to watch its memory, say)."""
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="cascade-serve-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "cascade.cli", "serve", "--config", str(config), "--port", str(port), *args]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"cascade serve exited with {proc.returncode}:\n{Path(log.name).read_text()}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"cascade serve did not come up in {startup_timeout} s:\n{Path(log.name).read_text()}")
            time.sleep(0.2)
        if on_start is not None:
            on_start(proc)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        os.unlink(log.name)


def scrape(url: str) -> dict[str, float]:
    """``/metrics`` as {series with labels: value}, e.g. ``'cascade_request_success_total{finished_reason="stop"}'``."""
    values = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            values[key] = float(value)
    return values
