"""Shared test helpers: transformers references, random prompts, pool checks."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import torch


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int, eos_token_id: int | None = 2) -> list[list[int]]:
    """transformers' greedy generate, one prompt at a time (no padding), cut after the first EOS."""
    results = []
    for ids in prompts:
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos_token_id,
                             pad_token_id=eos_token_id)[0, len(ids):].tolist()
        if eos_token_id is not None and eos_token_id in out:
            out = out[: out.index(eos_token_id) + 1]
        results.append(out)
    return results


def random_prompts(n: int, lengths: tuple[int, int], seed: int = 0, vocab: tuple[int, int] = (100, 40000)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=gen))
        out.append(torch.randint(vocab[0], vocab[1], (length,), generator=gen).tolist())
    return out


def assert_all_blocks_free(llm) -> None:
    stats = llm.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks, stats
    assert stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0, stats


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """`engine serve` in a subprocess on a free loopback port, its output in a log file."""

    def __init__(self, *args: str, env: dict | None = None, wait_healthy: bool = True, port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = f"/tmp/engine-serve-{self.port}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "engine.entrypoints.cli", "serve", "--port", str(self.port),
                                      *args], stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        if wait_healthy:
            self.wait_for(200)

    def wait_for(self, status: int, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.output()
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == status:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise AssertionError(f"/health never answered {status}:\n{self.output()}")

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        with open(self.log_path) as log:
            return log.read()

    def descendants(self) -> list:
        """The server's live child processes (engine core, workers, multiprocessing's resource tracker)."""
        import psutil

        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()
