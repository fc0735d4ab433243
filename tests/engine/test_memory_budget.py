"""hbm_utilization is a share of the device's whole memory, as vLLM's gpu_memory_utilization."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from jaxllm.worker.kv_cache import device_memory_total


def _env_after_import(**env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k != "XLA_PYTHON_CLIENT_MEM_FRACTION"}
    out = subprocess.run(
        [sys.executable, "-c", "import os, jaxllm; "
         "print(os.environ['XLA_PYTHON_CLIENT_MEM_FRACTION'])"],
        env={**clean, **env}, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_import_lets_the_allocator_pool_cover_the_share_and_keeps_a_users_setting():
    assert _env_after_import() == "0.95"
    assert _env_after_import(XLA_PYTHON_CLIENT_MEM_FRACTION="0.5") == "0.5"


@pytest.mark.parametrize("fraction, expected",
                         [("0.95", 100_000), ("0.5", 190_000), (None, 126_666)])
def test_gpu_total_memory_is_recovered_from_the_pool_size(monkeypatch, fraction, expected):
    if fraction is None:
        monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    else:
        monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", fraction)
    assert device_memory_total("gpu", 95_000) == expected  # the allocator's pool size
    # Other platforms report the whole memory as the pool.
    assert device_memory_total("tpu", 95_000) == 95_000


def test_the_budget_reads_a_device_of_this_process_not_the_meshs_first():
    # In a job of several processes the mesh's first device may be another process's,
    # whose memory statistics are not readable here (a follower of the job asked for
    # them and died at start-up).
    import types

    import jax
    import numpy as np

    from jaxllm.worker.kv_cache import own_device

    here = jax.process_index()
    theirs = types.SimpleNamespace(process_index=here + 1, name="theirs")
    mine = types.SimpleNamespace(process_index=here, name="mine")
    mesh = types.SimpleNamespace(devices=np.array([[theirs, mine]], dtype=object))
    assert own_device(mesh).name == "mine"
    single = types.SimpleNamespace(devices=np.array([[mine]], dtype=object))
    assert own_device(single).name == "mine"
