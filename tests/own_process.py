"""Tests that run in a pytest process of their own, and the suite's XLA flags.

The suite compiles its tiny CPU programs with LLVM's cheap pipeline (conftest.py): most
tests compile far more than they run. A test whose programs run many steps (the demo
model's hundreds of answers) runs them several times slower so compiled, and takes XLA's
default optimization in a process of its own instead (`optimized=True`).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ISOLATED = "JAXLLM_TEST_ISOLATED"
# The cheap pipeline (no fast-math either way), in XLA_FLAGS unless the caller set them.
FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0",
                      "--xla_llvm_disable_expensive_passes=true")


def isolated(test):
    """Marks `test` as one that runs only inside `run_in_own_process`'s process (skipped
    elsewhere); `-m own_process` selects such tests."""
    skip = pytest.mark.skipif(os.environ.get(ISOLATED) != "1",
                              reason="runs in a process of its own (tests/own_process.py)")
    return pytest.mark.own_process(skip(test))


def optimized_env() -> dict[str, str]:
    """This process's environment with the cheap pipeline's flags taken out of XLA_FLAGS."""
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "").split()
    env["XLA_FLAGS"] = " ".join(f for f in flags if f not in FAST_COMPILE_FLAGS)
    return env


def run_in_own_process(*selection: str, optimized: bool = False, timeout: int = 900) -> None:
    """Runs the tests `selection` names (pytest arguments: `file::name`, or a file and
    `-m own_process`) in a fresh pytest process with ISOLATED set; fails unless they
    pass. `optimized`: compiled at XLA's default optimization (module docstring)."""
    env = optimized_env() if optimized else dict(os.environ)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
         *selection], env={**env, ISOLATED: "1"}, capture_output=True, text=True,
        timeout=timeout)
    assert run.returncode == 0 and " passed" in run.stdout, run.stdout[-4000:] + run.stderr[-2000:]
