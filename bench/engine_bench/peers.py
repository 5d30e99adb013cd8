"""Peers run side by side with the engine: vLLM's CPU build through the shared peer script, in its own
interpreter (its own virtual environment), with the peak resident memory of its whole process tree."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from typing import Callable, Optional

DEFAULT_VLLM_SCRIPT = os.path.join("..", "shared", "bench", "peer_vllm_cpu.py")


def _tree_rss_bytes(pid: int, seen: dict[int, object]) -> int:
    """Resident bytes of a process and its descendants (remembered in ``seen`` for the clean-up)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for proc in procs:
        seen.setdefault(proc.pid, proc)
        try:
            total += proc.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def _reap(processes: dict, grace_s: float = 60) -> None:
    """Wait for every process the peer started to go (its engine processes may outlive it), then kill."""
    import psutil

    alive = [p for p in processes.values() if p.is_running()]
    _, alive = psutil.wait_procs(alive, timeout=grace_s)
    for proc in alive:
        proc.kill()


# settings of the engine's own process that a peer must not inherit: the OpenMP wait policy ``import engine`` sets,
# thread counts and affinity, and the engine's configuration variables
ENGINE_ONLY_VARIABLES = (
    "OMP_WAIT_POLICY",
    "OMP_NUM_THREADS",
    "OMP_PROC_BIND",
    "OMP_PLACES",
    "GOMP_SPINCOUNT",
    "KMP_AFFINITY",
    "KMP_BLOCKTIME",
    "MKL_NUM_THREADS",
)


def peer_environment(base: Optional[dict[str, str]] = None) -> dict[str, str]:
    """The environment a peer runs in: this process's, without what tunes the engine (``ENGINE_ONLY_VARIABLES`` and
    every ``ENGINE_*`` variable), so each peer runs with its own defaults."""
    env = dict(os.environ if base is None else base)
    for name in list(env):
        if name in ENGINE_ONLY_VARIABLES or name.startswith("ENGINE_"):
            del env[name]
    return env


def environments_report() -> dict[str, dict[str, str]]:
    """What the engine and its peers ran with, for the JSON: each engine-only variable's value ("unset" if none)."""
    peer = peer_environment()
    return {
        side: {name: env.get(name, "unset") for name in ENGINE_ONLY_VARIABLES}
        for side, env in (("engine", dict(os.environ)), ("peer", peer))
    }


def run_watched(
    command: list[str], cwd: Optional[str] = None, timeout_s: float = 3600, poll_s: float = 0.5
) -> tuple[list[str], int]:
    """Run a peer's command to its end, in its own default environment (``peer_environment``): the JSON lines it
    printed (those starting with '{') and the peak resident bytes of its process tree; a failure or a run past
    ``timeout_s`` raises with the end of its stderr."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(command, cwd=cwd, stdout=out, stderr=err, text=True, env=peer_environment())
        peak, seen = 0, dict[int, object]()
        while proc.poll() is None:
            peak = max(peak, _tree_rss_bytes(proc.pid, seen))
            if time.perf_counter() - start > timeout_s:
                proc.kill()
                raise RuntimeError(f"peer {' '.join(command)} ran past {timeout_s:.0f} s")
            time.sleep(poll_s)
        _reap(seen)  # the next run must start on an idle machine
        out.seek(0)
        err.seek(0)
        lines = [line for line in out.read().splitlines() if line.startswith("{")]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"peer {' '.join(command)} failed (exit {proc.returncode}):\n{err.read()[-3000:]}")
    return lines, peak


def run_script_peer(command: list[str], cwd: Optional[str] = None, timeout_s: float = 3600) -> dict:
    """Run a peer script that prints one JSON result line (the last line starting with '{')."""
    start = time.perf_counter()
    lines, peak = run_watched(command, cwd, timeout_s)
    result = json.loads(lines[-1])
    return {
        "seconds": result["seconds"],
        "total_tokens_per_s": result["total_tok_s"],
        "output_tokens_per_s": result["output_tok_s"],
        "prompt_tokens": result["prompt_tokens"],
        "output_tokens": result["output_tokens"],
        "peak_rss_mib": round(peak / 2**20, 1),
        "wall_with_startup_s": round(time.perf_counter() - start, 1),
    }


def vllm_cpu_peer(python: str, model_dir: str, dtype: str, script: str = DEFAULT_VLLM_SCRIPT) -> Callable[[], dict]:
    """A runner for ../shared/bench/peer_vllm_cpu.py under ``python`` (a venv holding vllm-cpu)."""
    script = os.path.abspath(script)
    for path, what in ((python, "--peer-python"), (script, "--peer-script"), (model_dir, "--peer-model")):
        if not path or not os.path.exists(path):
            raise ValueError(f"{what}: {path!r} does not exist")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        raise ValueError(
            f"--peer-model: {model_dir} is not a Hugging Face folder (make one with ../shared/bench/make_hf_model.py)"
        )
    return lambda: run_script_peer([python, script, model_dir, dtype], cwd=os.path.dirname(script))


def vllm_cpu_lora_peer(
    python: str, model_dir: str, dtype: str, rank: int, adapters: list[str], shared_script: str = DEFAULT_VLLM_SCRIPT
) -> Callable[[], dict]:
    """A runner for ``peer_vllm_lora.py`` (W1 with every request on one of ``adapters``, vLLM's multi-LoRA) under
    ``python``; it reads W1 from the folder of the shared peer script."""
    vllm_cpu_peer(python, model_dir, dtype, shared_script)  # the same checks of the interpreter and the model
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peer_vllm_lora.py")
    shared = os.path.dirname(os.path.abspath(shared_script))
    command = [python, script, shared, model_dir, dtype, str(rank), *adapters]
    return lambda: run_script_peer(command, cwd=shared)
