"""Test-wide setup: 8 fake CPU devices (for mesh tests), float32 matmuls, tiny checkpoints."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The scheduler verifies its running batch's arrays against the requests every step.
os.environ.setdefault("JAXLLM_CHECK_INVARIANTS", "1")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import gc  # noqa: E402

import pytest  # noqa: E402

from jaxllm.worker import aot_cache  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops every compiled program after each test module. One pytest process runs the
    whole suite, and each CPU executable keeps its own memory mappings; kept for the
    whole run they approach the kernel's per-process mapping limit, and the process
    then crashes in a later module's compile. The engines' program cache holds
    executables that jax.clear_caches does not reach."""
    yield
    aot_cache.clear_compiled()
    gc.collect()
    jax.clear_caches()
