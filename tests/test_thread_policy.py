"""The CPU thread policy: OpenMP threads wait passively unless the user chose otherwise."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SHOW = "import engine, os; print(os.environ.get('OMP_WAIT_POLICY'))"


@pytest.mark.parametrize("given, expected", [(None, "PASSIVE"), ("ACTIVE", "ACTIVE"), ("passive", "passive")])
def test_import_engine_sets_passive_waiting_unless_the_user_chose(given, expected):
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if given:
        env["OMP_WAIT_POLICY"] = given
    out = subprocess.run([sys.executable, "-c", SHOW], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == expected


def test_processes_the_engine_starts_inherit_the_policy():
    """A child started the way the engine starts its core and workers (spawn) sees the policy before torch."""
    code = (
        "import engine, multiprocessing as mp, os\n"
        "with mp.get_context('spawn').Pool(1) as pool:\n"
        "    print(pool.apply(os.getenv, ('OMP_WAIT_POLICY',)))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "PASSIVE"


def test_torch_imported_first_is_reported():
    code = (
        "import logging, torch; logging.basicConfig(level=logging.INFO)\n"
        "import engine\n"
        "from engine import thread_policy\n"
        "thread_policy.warn_if_not_in_effect(); thread_policy.warn_if_not_in_effect()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("OpenMP threads spin when idle") == 1
