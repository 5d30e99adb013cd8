"""Shared test helpers: transformers references, random prompts, pool checks."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from typing import Callable

import httpx

from engine.testing.models import hf_greedy, random_prompts

__all__ = [
    "Server",
    "alive",
    "assert_all_blocks_free",
    "command_line",
    "free_port",
    "hf_greedy",
    "install_fixture_plugins",
    "oracle_spec_config",
    "random_prompts",
    "wait_for_async",
    "wait_until",
]


def wait_until(predicate, timeout: float, interval: float = 0.1) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` seconds pass; its last answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


async def wait_for_async(predicate, timeout: float, interval: float = 0.01) -> None:
    """Yield to the event loop until ``predicate`` holds; AssertionError after ``timeout`` seconds."""
    import asyncio

    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not reached within {timeout} s"
        await asyncio.sleep(interval)


def alive(processes: list) -> list:
    """The processes of ``processes`` (psutil) that still run (zombies count as ended)."""
    import psutil

    out = []
    for proc in processes:
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc)
        except psutil.NoSuchProcess:
            pass
    return out


def command_line(process) -> str:
    """``process``'s (psutil) command line as one string; "" once it has ended or is a zombie not yet reaped (a
    short-lived child can end between listing and reading)."""
    import psutil

    try:
        return " ".join(process.cmdline())
    except psutil.NoSuchProcess:  # ZombieProcess is one
        return ""


def assert_all_blocks_free(llm) -> None:
    stats = llm.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks, stats
    assert stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0, stats


def engine_greedy(model_dir: str, prompts: list[list[int]], max_tokens: int, **config):
    """Greedy token ids of ``prompts`` on a float32 ``LLM`` of ``model_dir`` (all KV blocks back after), and the LLM."""
    from engine import LLM, SamplingParams

    llm = LLM(model_dir, dtype="float32", **config)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False
    )
    assert_all_blocks_free(llm)
    return [o.outputs[0].token_ids for o in outputs], llm


def assert_greedy_or_top5(
    llm, prompts: list[list[int]], reference: list[list[int]], max_tokens: int, label: str = ""
) -> None:
    """Greedy tokens equal to ``reference``, or, where they part (a near-tie after rounding), the reference's token
    among that step's top 5 (the parity rule's fallback)."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for index, (want, out) in enumerate(zip(reference, outputs)):
        got = out.outputs[0].token_ids
        parted = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), None)
        if parted is not None:
            assert want[parted] in out.outputs[0].logprobs[parted], (label, index, parted)


@contextlib.contextmanager
def products_pinned(choose: Callable[[list[str]], str]):
    """Linear products chosen by ``choose(the candidates' names, as listed)`` instead of by timing, for an ``LLM``
    built inside with ``kernel_cache=False`` (which measures again). Where candidates time alike the measured
    choice flips from run to run, and a model whose routing sits near a tie may then route a token differently."""
    from engine.model.layers import product_choice

    original = product_choice.pick_fastest
    product_choice.pick_fastest = lambda seconds, preferred: choose(list(seconds))
    try:
        yield
    finally:
        product_choice.pick_fastest = original


PACKED_PRODUCT_PINS = {
    # the plugin's default for every shape and row count: the widest integer-dot kernel (its variants give one bits)
    "integer-dot": lambda names: names[0],
    # every packed product de-quantized a panel at a time into the float GEMM
    "de-quantized": lambda names: next((n for n in names if "dequant" in n), names[0]),
}


def assert_packed_gguf_within_top5(path, tokenizer_dir: str, prompts, reference, max_tokens: int) -> None:
    """A GGUF file with its blocks kept packed on the default (cpu) kernels: ``reference``'s tokens, or within the
    top 5 where they part; every KV block returned. Run once with every product on the integer-dot kernels (the
    activations round to int8 per block) and once with every product de-quantized, each pinned rather than chosen by
    timing: on a tiny random MoE model, int8 rounding in some layers and not others can flip a near-tied group
    route, and a timing-dependent mix would make the outcome differ from run to run."""
    from engine import LLM

    for label, choose in PACKED_PRODUCT_PINS.items():
        with products_pinned(choose):
            llm = LLM(str(path), tokenizer=tokenizer_dir, dtype="float32", quantization="gguf", kernel_cache=False)
        try:
            assert_greedy_or_top5(llm, prompts, reference, max_tokens, label)
            assert_all_blocks_free(llm)
        finally:
            llm.shutdown()


def install_fixture_plugins(tmp_path_factory, *packages: str) -> dict:
    """Pip-install fixture distributions (tests/plugin_fixtures) into a private folder; the environment that
    puts it on PYTHONPATH."""
    import shutil
    from pathlib import Path

    fixtures = Path(__file__).parent / "plugin_fixtures"
    site = tmp_path_factory.mktemp("site")
    for package in packages:
        build = tmp_path_factory.mktemp("build") / package
        shutil.copytree(fixtures / package, build)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--no-deps",
                "--no-build-isolation",
                "--target",
                str(site),
                str(build),
            ],
            check=True,
            capture_output=True,
            timeout=300,
        )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")])
    return env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """`engine serve` in a subprocess on a free loopback port, its output in a log file; ``env`` adds variables to
    this process's (a value of None removes one)."""

    def __init__(
        self,
        *args: str,
        env: dict | None = None,
        wait_healthy: bool = True,
        port: int | None = None,
        process_group: bool = False,
    ):
        """``process_group``: the server leads a process group of its own, as a command started from a terminal
        does (its children join it), so that a test can signal the whole group as the terminal's Ctrl-C does."""
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = f"/tmp/engine-serve-{self.port}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "engine.entrypoints.cli", "serve", "--port", str(self.port), *args],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None},
            start_new_session=process_group,
        )
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


def oracle_spec_config(folder, reference: dict, k: int = 4, corrupt_every: int = 3) -> dict:
    """The ``speculative`` setting of the oracle fixture proposer (the ``oracle`` fixture) drafting ``reference``
    (prompt token ids joined by commas -> output token ids), one draft made wrong every ``corrupt_every``."""
    path = folder / f"reference-{len(reference)}-{abs(hash(json.dumps(reference, sort_keys=True)))}.json"
    path.write_text(json.dumps(reference))
    return {
        "method": "oracle",
        "num_speculative_tokens": k,
        "options": {"reference": str(path), "corrupt_every": corrupt_every},
    }


def rounded_copy(hf_model, fmt: str = "int8", experts_only: bool = False, keep: tuple[str, ...] = ()):
    """A copy of ``hf_model`` whose weights a quantization packs are replaced by their rounding to ``fmt``, row by row
    (each expert's rows apart): every projection, the experts and the LM head (int8's choice; not the routers nor the
    embeddings, nor the weights whose names end with one of ``keep``), or only the experts (a GGUF file's packed
    experts)."""
    import copy

    from engine.model.quant_formats import dequantize, quantize

    rounded = copy.deepcopy(hf_model)
    head = rounded.get_output_embeddings().weight  # tied to the embedding: the engine rounds the one table
    experts = ("experts.gate_up_proj", "experts.down_proj")
    for name, param in rounded.named_parameters():
        if keep and name.endswith(keep):
            continue
        projection = name.endswith(("_proj.weight", "_mqa.weight")) or param is head
        if name.endswith(experts) or (projection and not experts_only):
            for matrix in param.data if param.dim() == 3 else param.data[None]:
                matrix.copy_(dequantize(quantize(matrix, fmt)))
    return rounded


def tiny_server(model_dir: str, *flags: str, kv_cache_memory: str = "32MiB", process_group: bool = False) -> Server:
    """`engine serve` on a tiny float32 model served as ``tiny`` (context 512), with ``flags`` added."""
    return Server(
        "--model",
        model_dir,
        "--served-model-name",
        "tiny",
        "--dtype",
        "float32",
        "--kv-cache-memory",
        kv_cache_memory,
        "--max-model-len",
        "512",
        *flags,
        process_group=process_group,
    )
