"""The CPU worker's heap policy: a step's large tensors reuse the memory the previous step freed instead of being
mapped and faulted in anew (glibc's mmap and trim thresholds, engine.worker.heap_policy)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest
import torch

from engine.config import VllmConfig

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="the policy is glibc's mallopt"
)

# A decode step's pattern: tensors of a few tens of MiB allocated, written and freed each step. 40 MiB is past the
# 32 MiB up to which glibc raises its mmap threshold by itself, so without the policy every step maps them anew.
STEPS = """
import resource, sys, torch
from engine.worker.heap_policy import apply_heap_policy
if sys.argv[1] == "policy":
    assert apply_heap_policy()
def step():
    logits = torch.ones(10 * 2**20)  # 40 MiB
    probs = torch.ones(10 * 2**20)
    return float(logits[-1] + probs[-1])
for _ in range(5):  # the heap settles into the pattern
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults_over_twenty_steps(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", STEPS, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.strip())


def test_a_step_reuses_the_memory_the_last_step_freed():
    pages_per_step = 2 * 40 * 2**20 // 4096
    without = faults_over_twenty_steps("default")
    with_policy = faults_over_twenty_steps("policy")
    # glibc's defaults fault every page of both tensors in every step; with the policy the pages stay mapped. Not
    # none: a kernel that reclaims cold pages on its own (DAMON's pageout, on some of these virtual machines) can take
    # a few back between steps (seen once under the full suite: 1,024 a step, against 20,480 without the policy)
    assert without >= 20 * pages_per_step // 2, without
    assert with_policy < without // 10, (with_policy, without)


def test_the_cpu_worker_applies_it_unless_the_config_turns_it_off():
    code = """
import sys
from unittest import mock
from engine.config import VllmConfig
from engine.worker import heap_policy
from engine.worker.worker import Worker
keep = sys.argv[1] == "on"
config = VllmConfig(device={"device": "cpu", "keep_freed_memory": keep})
with mock.patch("engine.worker.worker.apply_heap_policy", wraps=heap_policy.apply_heap_policy) as applied, \\
        mock.patch("engine.worker.worker.init_model_parallel"):
    Worker(config, {}).init_device()
print(applied.call_count, heap_policy._applied)
"""
    for mode, expected in (("on", "1 True"), ("off", "0 False")):
        out = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == expected


def test_what_loading_freed_goes_back_to_the_system_once_loaded():
    """The policy keeps up to 512 MiB of freed heap mapped for the next step; what a load freed (the copies made of
    each weight on the way to the one kept) is handed back after loading (``release_freed_memory``)."""
    code = """
import torch
from engine.worker.heap_policy import apply_heap_policy, release_freed_memory
def rss_mib():
    return int(next(l for l in open('/proc/self/status') if l.startswith('VmRSS')).split()[1]) // 1024
assert apply_heap_policy()
copies = [torch.ones(2**20) for _ in range(64)]  # 64 x 4 MiB from the heap, written
kept = [c[:16].clone() for c in copies[::8]]  # a few small tensors stay allocated among them
del copies
before = rss_mib()
assert release_freed_memory()
print(before - rss_mib())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) >= 128, out.stdout  # most of the 256 MiB freed


def test_the_cpu_worker_releases_what_loading_freed():
    from unittest import mock

    from engine.worker import worker as worker_module

    with mock.patch.object(worker_module, "release_freed_memory") as released:
        for keep, calls in ((True, 1), (False, 0)):
            released.reset_mock()
            config = VllmConfig(device={"device": "cpu", "keep_freed_memory": keep})
            worker = worker_module.Worker(config, mock.MagicMock())  # every plugin choice a mock
            worker.device = torch.device("cpu")
            with (
                mock.patch.object(worker_module, "ModelRunner"),
                mock.patch.object(worker_module, "resolve_model"),
                mock.patch.object(worker_module, "get_plugin_manager"),
            ):
                worker.load_model()
            assert released.call_count == calls
