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


def test_a_gpu_allocator_without_statistics_sizes_the_cache_from_cudas_free_memory(
        monkeypatch):
    # XLA's VMM allocator (the SKIP_TEMP command-buffer mode) gives no memory statistics;
    # the budget is then hbm_utilization of the whole memory less what is in use on the
    # device (CUDA's free count), less the step's transient memory, as vLLM's.
    import types

    import numpy as np

    from jaxllm.cache_config import CacheConfig
    from jaxllm.worker import kv_cache

    gib = 1 << 30
    asked = []

    def fake_memory(device):
        asked.append(device.local_hardware_id)
        return 60 * gib, 80 * gib  # 20 GiB in use: the weights and the context

    monkeypatch.setattr(kv_cache, "gpu_memory", fake_memory)
    gpu = types.SimpleNamespace(platform="gpu", process_index=0, local_hardware_id=3,
                                memory_stats=lambda: None)
    mesh = types.SimpleNamespace(devices=np.array([[gpu]], dtype=object), shape={"model": 1})
    backend = types.SimpleNamespace(kv_cache_shape=lambda n, b, h, d: (n, 2, b, h, d))
    cache = kv_cache.PagedKVCache(backend, mesh, num_layers=4, num_kv_heads=2, head_dim=64,
                                  block_size=16, dtype=np.float32)
    per_block = cache.bytes_per_block()
    blocks = cache.num_blocks(CacheConfig(hbm_utilization=0.9), max_num_seqs=4,
                              max_model_len=256, activation_reserve=lambda: 2 * gib)
    assert asked == [3]
    assert blocks == int((0.9 * 80 * gib - 20 * gib - 2 * gib) // per_block)
    # A budget the device cannot give is refused, naming what to set.
    monkeypatch.setattr(kv_cache, "gpu_memory", lambda device: (5 * gib, 80 * gib))
    with pytest.raises(ValueError, match="hbm_utilization"):
        cache.num_blocks(CacheConfig(hbm_utilization=0.9), max_num_seqs=4, max_model_len=256,
                         activation_reserve=lambda: 2 * gib)
