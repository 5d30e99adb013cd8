"""Process lifetime: every process the engine starts ends with its parent, on every exit path.

A child (engine core, worker) calls ``watch_parent`` first thing, before it loads anything, so a parent
that dies at any moment (SIGKILL during model loading included) takes the child with it; the child
removes what it shares with the parent (the IPC folder) on its way out.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing.process
import os
import shutil
import signal
import sys
import threading
import time
import weakref
from typing import Any, Callable, Iterable, Optional

logger = logging.getLogger(__name__)
_WATCH_PERIOD_S = 0.2
_EXIT_GRACE_S = 10.0
_ENGINE_OWNS_PROCESS = False  # see end_engine_process_quickly


def freeze_gc_heap() -> None:
    """Collect once, then move every object alive after start-up (model, tokenizer, GGUF metadata: hundreds of
    thousands of them) out of the garbage collector's sight, as vLLM does after start-up: otherwise each full
    collection during serving walks them all, a tenth of a single-stream decode step's time."""
    import gc

    gc.collect()
    gc.freeze()


def release_gc_heap() -> None:
    """Undo ``freeze_gc_heap`` when an engine shuts down, then collect: frozen objects are never collected, so
    an engine dropped in a long-lived process (a notebook, a test run, a server that rebuilds its engine) would
    otherwise keep its model's reference cycles, and their tensors, for good. Another engine still alive in
    the same process loses its freeze too; that costs it only the time of full collections, never memory.
    Nothing to do in a process that ends with its engine (``end_engine_process_quickly``)."""
    import gc

    if _ENGINE_OWNS_PROCESS:
        return
    gc.unfreeze()
    gc.collect()


def freeze_everything_at_exit() -> None:
    """Called first by a process of the engine's own (the ``engine`` command, ``end_engine_process_quickly``): its
    last exit hook freezes every object, so the collections of the interpreter's finalization, which would
    otherwise walk every object of torch, transformers and the model, have nothing to walk (0.7-0.9 s of every stop
    of an engine core on a 2-core CPU, before its parent's ``join`` returns). Exit hooks run last registered first:
    this one, registered first, runs after every shutdown hook."""
    atexit.unregister(_freeze_at_exit)  # (once, whoever calls it again)
    atexit.register(_freeze_at_exit)


def _freeze_at_exit() -> None:
    """The last exit hook: freeze every object, unless an extension built with nanobind is loaded (triton's, which
    ``engine bench kernels`` and the triton attention import): nanobind prints each of its objects still alive when
    the interpreter ends as a leak ("nanobind: leaked 4 instances!"), so those must be collected as before."""
    import gc

    if nanobind_extension_loaded() is None:
        gc.freeze()


def nanobind_extension_loaded() -> Optional[str]:
    """The first loaded module that holds a class made by nanobind (its metaclass lives in module ``nanobind``), or
    None (a few milliseconds over some 1,500 modules). Deprecated attributes that warn when looked at stay quiet."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, module in list(sys.modules.items()):
            try:
                if any(isinstance(v, type) and type(v).__module__ == "nanobind" for v in vars(module).values()):
                    return name
            except Exception:  # a module-like object without a __dict__, or an attribute that raises when looked at
                continue
    return None


def end_engine_process_quickly() -> None:
    """Called first by a process that lives for one engine (an engine core, a worker, an API server): it ends
    without the garbage collector's passes. ``release_gc_heap`` leaves the start-up freeze in place (no second
    engine will need the memory), and ``freeze_everything_at_exit`` does the rest."""
    global _ENGINE_OWNS_PROCESS
    _ENGINE_OWNS_PROCESS = True
    freeze_everything_at_exit()


def watch_parent(parent_pid: int, name: str, cleanup: Optional[Callable[[], None]] = None) -> threading.Thread:
    """Start a daemon thread that ends this process when ``parent_pid`` is no longer its parent.

    It sends SIGTERM to this process (its handler shuts down cleanly: children, sockets, IPC files); a
    process stuck for longer than a grace period runs ``cleanup`` and is ended with ``os._exit``.
    """

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(_WATCH_PERIOD_S)
        logger.warning("%s: the parent process %d is gone; shutting down", name, parent_pid)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(_EXIT_GRACE_S)
        if cleanup is not None:
            cleanup()
        os._exit(1)

    thread = threading.Thread(target=watch, name=f"{name}-parent-watch", daemon=True)
    thread.start()
    return thread


def continue_when_parent_dies() -> None:
    """Linux: have the kernel send this process SIGCONT when its parent dies, so that one its parent had stopped
    (SIGSTOP: a shadow engine core paused while the primary works) wakes and sees that it is orphaned."""
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.prctl(1, int(signal.SIGCONT), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def set_process_name(name: str) -> None:
    """Name this process as ``ps``, ``top`` and psutil show it (Linux: the first 15 bytes; elsewhere nothing)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.prctl(15, name.encode()[:15] + b"\0", 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def exit_on_sigterm() -> None:
    """SIGTERM raises SystemExit in the main thread, so ``finally`` blocks run."""

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def leave_interrupts_to_the_parent() -> None:
    """Ignore SIGINT in a process the engine started (engine core, worker, DP coordinator). A terminal's Ctrl-C
    reaches the whole foreground process group; such a process must not end on its own, mid-step, while its parent
    (which handles the Ctrl-C) stops the engine in order: the parent's shutdown, or ``watch_parent`` once the parent
    is gone, still ends it. The processes it starts in turn inherit the ignored SIGINT."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def use_thread_lock_for_progress_bars() -> None:
    """tqdm's default lock is a multiprocessing semaphore, which a killed process leaks (the resource
    tracker then warns); a child process only needs a thread lock."""
    try:
        from tqdm import tqdm
    except ImportError:
        return
    tqdm.set_lock(threading.RLock())


def describe_exit(proc) -> str:
    """'exit code 3' or 'killed by signal SIGKILL' for a multiprocessing Process that ended."""
    if proc.exitcode is None:
        proc.join(1.0)  # its sentinel fired, but the exit status is read on join
    code = proc.exitcode
    if code is None:
        return "no exit status yet"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def shutdown_at_exit(owner: Any) -> Callable[[], None]:
    """Call ``owner.shutdown()`` when the interpreter exits, unless it was shut down before (pass the returned hook
    to ``atexit.unregister`` then); the owner is held weakly.

    A script that builds an engine and simply ends relies on this: at exit, ``multiprocessing`` joins every
    non-daemon child (engine cores are not daemons: they start workers), and an engine core waits for its parent
    to go, so both would wait forever. ``atexit`` runs its hooks in reverse order of registration, and
    ``multiprocessing`` registered its own when it was imported, before any engine existed: this hook runs first.
    """
    owner_ref = weakref.ref(owner)

    def hook() -> None:
        target = owner_ref()
        if target is not None:
            target.shutdown()

    atexit.register(hook)
    return hook


def stop_processes(procs: Iterable[Optional[multiprocessing.process.BaseProcess]], grace: float) -> None:
    """Stop processes this one started: SIGTERM to every one still running, then up to ``grace`` seconds for each
    to end (they stop in parallel), then SIGKILL and reap what is left. Never-started and None entries are skipped."""
    started = [proc for proc in procs if proc is not None and proc.pid is not None]
    for proc in started:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + grace
    for proc in started:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in started:
        if proc.is_alive():
            proc.kill()
            proc.join()


def remove_ipc_dir(path: Optional[str]) -> None:
    """Remove an ``engine-ipc-*`` folder and its socket files; quiet if already gone."""
    if path and os.path.basename(path).startswith("engine-ipc-"):
        shutil.rmtree(path, ignore_errors=True)


def start_process(proc: multiprocessing.process.BaseProcess) -> None:
    """Start a spawned process without re-importing the parent's ``__main__`` in it.

    Spawn re-runs the parent's main script in every child (so that functions defined there can be
    unpickled); the engine's process targets live in importable modules, so that is only a cost, and a
    trap: a script that builds an engine at module level, without ``if __name__ == "__main__":``, would
    build another one in every child. Hiding the main module's path while the child's preparation data is
    taken (inside ``start``) leaves the child's ``__main__`` alone, as in an interactive session.
    """
    main = sys.modules.get("__main__")
    if main is None:
        proc.start()
        return
    saved_file, saved_spec = main.__dict__.get("__file__", _MISSING), getattr(main, "__spec__", None)
    try:
        main.__dict__.pop("__file__", None)
        main.__spec__ = None
        proc.start()
    finally:
        main.__spec__ = saved_spec
        if saved_file is not _MISSING:
            main.__file__ = saved_file


_MISSING = object()
