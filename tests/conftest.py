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
