"""`engine bench startup`: from launching `engine serve` to the first token it serves."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def measure_startup(serve_args: list[str], timeout_s: float = 600) -> dict:
    """Launch ``engine serve`` with ``serve_args``; time /health turning 200 and a one-token completion."""
    port = _free_port()
    command = [sys.executable, "-m", "engine.entrypoints.cli", "serve", "--port", str(port), *serve_args]
    url = f"http://127.0.0.1:{port}"
    start = time.perf_counter()
    proc = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ, "TQDM_DISABLE": "1"}
    )
    try:
        ready = None
        with httpx.Client(timeout=5) as client:
            while ready is None:
                if proc.poll() is not None:
                    stderr = proc.stderr.read() if proc.stderr is not None else ""
                    raise RuntimeError(f"engine serve exited with {proc.returncode}:\n{stderr[-3000:]}")
                if time.perf_counter() - start > timeout_s:
                    raise RuntimeError(f"engine serve not ready after {timeout_s:.0f} s")
                try:
                    if client.get(url + "/health").status_code == 200:
                        ready = time.perf_counter() - start
                except httpx.TransportError:
                    pass
                if ready is None:
                    time.sleep(0.1)
            response = client.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 1}, timeout=120)
            response.raise_for_status()
            first_token = time.perf_counter() - start
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return {
        "seconds_to_ready": round(ready, 2),
        "seconds_to_first_token": round(first_token, 2),
        "command": " ".join(command[1:]),
    }
