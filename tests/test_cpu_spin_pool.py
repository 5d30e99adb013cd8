"""The ``cpu`` plugin's spin pool (csrc/spin_pool.h) under contention: its workers join a job only when they get a
core in time, and the caller never waits for one that did not. Found by running a script that imported torch before
engine: torch's OpenMP threads then spin after every torch operation, the pool's worker had no core, and each kernel
of a decode step waited a scheduler tick for it (a SmolLM2 decode step went from 10 ms to 240 ms past 227 context
tokens, where attention split its work). The kernels must give the same bits whoever takes part.

The check runs in a fresh interpreter confined to one core, with OpenMP's threads spinning
(``OMP_WAIT_POLICY=ACTIVE``, torch imported first) and a torch operation between the kernels, and holds every kernel
on the pool (integer-dot products on rows of blocks and on interleaved weights, the GEMM's decode rows and its tiled
schedule, RMS norm, SiLU, RoPE, paged decode attention) to its single-thread bits."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("engine_attention_cpu") is None
    or importlib.util.find_spec("engine_attention_cpu._layers") is None,
    reason="the cpu plugin's kernels are not built",
)

SCRIPT = textwrap.dedent(
    """
    import os
    import torch  # before engine: OpenMP keeps the spinning wait policy set below
    import engine  # noqa: F401
    from engine.model.quant_formats import quantize
    from engine_attention_cpu import _C, _gemm, _layers, _quant

    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # the pool's threads and OpenMP's share one core
    g = torch.Generator().manual_seed(0)

    def kernels():
        out = {}
        for rows in (1, 3, 40):
            x = torch.randn(rows, 576, generator=g)
            out[f"q4_1/{rows}"] = _quant.forward(x, Q41.data, None, 1, 1, None, 960)
            # interleaved by 8 rows: one stream per thread, the rest taken from the back (parallel_stream)
            out[f"q4_1 interleaved/{rows}"] = _quant.forward(x, Q41_X8, None, 1, 1, None, 960)
            out[f"q8_0 interleaved/{rows}"] = _quant.forward(x, Q80_X8, None, 2, 1, None, 960)
            out[f"int8/{rows}"] = _quant.forward(x, I8.data, I8.scales, 3, 1, None, 960)
            out[f"gemm/{rows}"] = _gemm.forward(x, PANELS, None, 960, -1)  # decode rows, then the tiled GEMM
            normed = torch.empty_like(x)
            _layers.rms_norm(normed, x, NORM, 1e-5)
            out[f"rms/{rows}"] = normed
            act = torch.empty(rows, 288)
            _layers.silu_and_mul(act, x)
            out[f"silu/{rows}"] = act
            q, k = torch.randn(rows, 9 * 64, generator=g), torch.randn(rows, 3 * 64, generator=g)
            _layers.rotary_embedding(torch.arange(rows) + 5, q, k, COS, SIN, 64)
            out[f"rope/{rows}"] = torch.cat([q, k], 1)
            query = torch.randn(rows, 9, 64, generator=g)
            attn = torch.empty_like(query)
            lens = torch.randint(50, 700, (rows,), generator=g, dtype=torch.int32)
            _C.paged_decode_attention(attn, query, KEYS, VALUES, TABLE[:rows], lens, 0.125, 0.0, 0)
            out[f"attention/{rows}"] = attn
            torch.exp(torch.randn(1 << 17, generator=g))  # an OpenMP region: its threads spin afterwards
        return out

    W = torch.randn(960, 576, generator=g) * 0.05
    Q41, I8 = quantize(W, "q4_1"), quantize(W, "int8")
    Q41_X8 = _quant.interleave(Q41.data, None, 1, 576, False)[0]
    Q80_X8 = _quant.interleave(quantize(W, "q8_0").data, None, 2, 576, False)[0]
    PANELS = _gemm.pack_weight(W)
    NORM = torch.rand(576, generator=g) + 0.5
    COS, SIN = torch.rand(64, 32, generator=g), torch.rand(64, 32, generator=g)
    KEYS, VALUES = torch.randn(64, 16, 3, 64, generator=g), torch.randn(64, 16, 3, 64, generator=g)
    TABLE = torch.stack([torch.randperm(64, generator=g)[:44] for _ in range(40)]).int()

    state = g.get_state()
    torch.set_num_threads(1)
    alone = kernels()
    torch.set_num_threads(2)
    for repeat in range(20):
        g.set_state(state)
        shared = kernels()
        for name, value in alone.items():
            assert torch.equal(value, shared[name]), f"{name} differs on repeat {repeat}"
    print("same bits", len(alone))
    """
)


def test_kernels_on_the_pool_give_their_single_thread_bits_with_one_core_and_spinning_openmp():
    env = {**os.environ, "OMP_WAIT_POLICY": "ACTIVE", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "same bits 27" in done.stdout


REBUILD_SCRIPT = textwrap.dedent(
    """
    import torch
    from engine_attention_cpu import _gemm

    W = torch.randn(49, 70)
    PANELS = _gemm.pack_weight(W)
    x = torch.randn(1, 70)
    expected = x @ W.T
    for i in range(3000):
        torch.set_num_threads(2 + i % 2)  # each call rebuilds the pool: the last one's destructor joins its workers
        out = _gemm.forward(x, PANELS, None, 49, -1)
    torch.testing.assert_close(out, expected)
    print("rebuilt", i + 1)
    """
)


def test_a_pool_rebuilt_before_its_workers_start_still_joins_them():
    """Found under pytest-xdist (two test processes on two cores): a test that changed torch's thread count between
    products hung in the pool's destructor. The pool is rebuilt whenever the count changes; a worker that started only
    after the destructor had raised the stop generation read that generation as the one it had seen, slept through
    the wake up, and the destructor's join never returned. Here each product rebuilds the pool (a single row: no job
    is run) while a spinning neighbour on every core makes new threads start late."""
    spin = [sys.executable, "-c", "while True: pass"]
    neighbours = [subprocess.Popen(spin) for _ in range(os.cpu_count() or 1)]
    try:
        done = subprocess.run([sys.executable, "-c", REBUILD_SCRIPT], capture_output=True, text=True, timeout=240)
    finally:
        for neighbour in neighbours:
            neighbour.kill()
            neighbour.wait()
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rebuilt 3000" in done.stdout


FORK_SCRIPT = textwrap.dedent(
    """
    import os
    import torch
    from engine.model.quant_formats import quantize
    from engine_attention_cpu import _quant

    def threads():
        return len(os.listdir("/proc/self/task"))

    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    weight = _quant.interleave(quantize(torch.randn(960, 576, generator=g) * 0.05, "q4_1").data, None, 1, 576, False)[0]
    x = torch.randn(1, 576, generator=g)
    expected = _quant.forward(x, weight, None, 1, 1, None, 960)  # the parent's pool: one worker beside the caller
    pid = os.fork()
    if pid == 0:
        before = threads()
        out = _quant.forward(x, weight, None, 1, 1, None, 960)
        # the child has none of its parent's threads: its first kernel must build its own pool, with its own worker
        built = threads() == before + 1
        os._exit(0 if built and torch.equal(out, expected) else 3)
    _, status = os.waitpid(pid, 0)
    print("child exit", os.waitstatus_to_exitcode(status))
    """
)


def test_a_forked_child_builds_its_own_pool():
    """The pool notices a fork by a counter that a pthread_atfork handler raises in the child (getpid() on every kernel
    call was a system call, 4% of a batch-1 decode step): the child's first kernel builds a pool whose worker exists
    there, and gives the parent's bits."""
    done = subprocess.run([sys.executable, "-c", FORK_SCRIPT], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "child exit 0" in done.stdout, done.stdout + done.stderr[-3000:]


FORK_WHILE_REBUILDING_SCRIPT = textwrap.dedent(
    """
    import os
    import threading
    import time

    import torch
    from engine.model.quant_formats import quantize
    from engine_attention_cpu import _quant

    g = torch.Generator().manual_seed(0)
    weight = _quant.interleave(quantize(torch.randn(64, 64, generator=g) * 0.05, "q4_1").data, None, 1, 64, False)[0]
    x = torch.randn(1, 64, generator=g)
    expected = _quant.forward(x, weight, None, 1, 1, None, 64)
    stop = threading.Event()

    def rebuild():  # each change of thread count rebuilds the pool (a thread's start or join) inside its guard
        n = 0
        while not stop.is_set():
            torch.set_num_threads(1 + n % 2)
            _quant.forward(x, weight, None, 1, 1, None, 64)
            n += 1

    thread = threading.Thread(target=rebuild)
    thread.start()
    hung = wrong = 0
    for _ in range(40):
        pid = os.fork()
        if pid == 0:
            out = _quant.forward(x, weight, None, 1, 1, None, 64)
            os._exit(0 if torch.equal(out, expected) else 3)
        deadline = time.monotonic() + 20  # a child that finishes takes milliseconds
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                wrong += os.waitstatus_to_exitcode(status) != 0
                break
            if time.monotonic() > deadline:
                hung += 1
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                break
            time.sleep(0.005)
    stop.set()
    thread.join()
    print("hung", hung, "wrong", wrong)
    """
)


def test_a_child_forked_while_another_thread_rebuilds_the_pool_runs_its_kernels():
    """Found reading the pool's code, then reproduced: a fork while another thread held the guard of the process's
    pool (inside pool(), where a change of thread count rebuilds it) gave a child whose guard stayed locked, and the
    child's first kernel waited forever (15 of these 40 forks). A fork now waits for the guard and the child starts
    with it free."""
    done = subprocess.run(
        [sys.executable, "-c", FORK_WHILE_REBUILDING_SCRIPT], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "hung 0 wrong 0" in done.stdout, done.stdout + done.stderr[-3000:]
