"""Server processes for the benchmarks: start a command on a free port and wait for its /health, stop it
(draining first), and read its peak memory with the processes it started (vLLM serves from an engine
process)."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _process_tree(pid: int) -> list[int]:
    """pid and every live process below it (vLLM serves from an engine process its server starts)."""
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        for children in Path(f"/proc/{current}/task").glob("*/children"):
            try:
                todo += [int(child) for child in children.read_text().split()]
            except OSError:
                continue
    return tree


def peak_rss_bytes(pid: int) -> int | None:
    """The peak resident set (VmHWM) of the process and its live children, summed (an upper bound where
    their peaks fell at different times), Linux only."""
    total = None
    for member in _process_tree(pid):
        try:
            lines = Path(f"/proc/{member}/status").read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            if line.startswith("VmHWM:"):
                total = (total or 0) + int(line.split()[1]) * 1024
    return total


def start_server(command: list[str], port: int, log: Path, timeout: float = 900,
                 env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start `command --port PORT` with its output in `log`; return once /health answers 200."""
    proc = subprocess.Popen(command + ["--port", str(port)], stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{' '.join(command)} did not come up; its log:\n{log.read_text()[-3000:]}")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM (the server drains), then kill if it has not exited within a minute."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


