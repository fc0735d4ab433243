"""Test-wide setup: 8 fake CPU devices (for mesh tests), tiny checkpoints, and the suite
split over two worker processes (pytest-xdist, pyproject's addopts). Matmul precision is
left to the engine (layers/precision.py): a GPU run of the suite multiplies as a user's
float32 engine does."""

import os

from tests.own_process import FAST_COMPILE_FLAGS

# LLVM's cheap pipeline: the suite's programs are tiny and compiled once each, so
# compiling them is most of its time and running them little (tests/own_process.py).
os.environ.setdefault("XLA_FLAGS", " ".join(("--xla_force_host_platform_device_count=8",
                                             *FAST_COMPILE_FLAGS)))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The scheduler verifies its running batch's arrays against the requests every step.
os.environ.setdefault("JAXLLM_CHECK_INVARIANTS", "1")
# Engines compile each program when a step first needs it: a test's engine runs a few
# steps, and compiling every bucket's variants up front would be most of the suite's
# time. The tests that check that a warmed-up engine compiles nothing while serving
# ask for `precompile=True`.
os.environ.setdefault("JAXLLM_PRECOMPILE", "0")

import gc  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

from jaxllm.worker import aot_cache  # noqa: E402

# Workers for a run over several test files (`-n auto` in pyproject's addopts). Two: CI
# has two cores, and each worker holds its own compiled programs in memory.
MAX_WORKERS = 2


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """Two workers for the suite or a directory; none (this process runs the tests) when
    every argument names one file or test, where starting workers costs more than it saves."""
    args = [a for a in config.args if not a.startswith("-")]
    if args and all(".py" in a for a in args):
        return 0
    cpus = os.cpu_count() or 1
    return min(MAX_WORKERS, cpus) if cpus > 1 else 0


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops every compiled program after each test module. Each CPU executable keeps
    its own memory mappings; kept for the whole run they approach the kernel's
    per-process mapping limit, and the process then crashes in a later module's compile.
    The engines' program cache holds executables that jax.clear_caches does not reach."""
    yield
    aot_cache.clear_compiled()
    gc.collect()
    jax.clear_caches()
