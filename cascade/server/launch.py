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
from typing import IO

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
    with running_servers({"server": config}, *args, startup_timeout=startup_timeout, env=env) as started:
        [(url, proc)] = started.values()
        if on_start is not None:
            on_start(proc)
        yield url


@contextmanager
def running_servers(configs: dict[str, str | Path], *args: str, startup_timeout: float = 120.0,
                    env: dict | None = None):
    """Several servers started together (each loads its models while the others do) and waited for until every one
    answers: yields ``{name: (url, process)}``; all are stopped afterwards, and all of them if any fails to start."""
    servers: dict[str, tuple[str, subprocess.Popen, IO[str]]] = {}
    try:
        for name, config in configs.items():
            port = free_port()
            log = tempfile.NamedTemporaryFile("w+", prefix="cascade-serve-", suffix=".log", delete=False)
            cmd = [sys.executable, "-m", "cascade.cli", "serve", "--config", str(config), "--port", str(port), *args]
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
            servers[name] = f"http://127.0.0.1:{port}", proc, log
        _wait_until_up(servers, startup_timeout)
        yield {name: (url, proc) for name, (url, proc, _) in servers.items()}
    finally:
        for _, proc, _ in servers.values():
            proc.terminate()
        for _, proc, log in servers.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()
            os.unlink(log.name)


def _wait_until_up(servers: dict[str, tuple[str, subprocess.Popen, IO[str]]], timeout: float) -> None:
    """Until every server answers ``/health``; the first to exit, or the timeout, fails them all (with its log)."""
    deadline, waiting = time.monotonic() + timeout, dict(servers)
    while waiting:
        for name, (url, proc, log) in list(waiting.items()):
            label = "cascade serve" if len(servers) == 1 else f"cascade serve ({name})"
            if proc.poll() is not None:
                raise RuntimeError(f"{label} exited with {proc.returncode}:\n{Path(log.name).read_text()}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    del waiting[name]
                    continue
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{label} did not come up in {timeout} s:\n{Path(log.name).read_text()}")
        time.sleep(0.2)


def scrape(url: str) -> dict[str, float]:
    """``/metrics`` as {series with labels: value}, e.g. ``'cascade_request_success_total{finished_reason="stop"}'``."""
    values = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            values[key] = float(value)
    return values
