"""TPU slices by name: parsing, the HBM table, compile-only devices in one process."""

from __future__ import annotations

import pytest

from jaxllm.config import EngineArgs
from jaxllm.distributed.tpu_topology import (
    GiB,
    hbm_bytes_per_device,
    libtpu_available,
    parse_topology,
    topology_devices,
)
from jaxllm.errors import ParameterError


@pytest.mark.parametrize("name, chips, accelerator, hbm", [
    ("v5e:2x2", 4, "v5litepod-4", 16 * GiB), ("v6e:1x1", 1, "v6e-1", 32 * GiB),
    ("v6e:2x4", 8, "v6e-8", 32 * GiB), ("v5p:2x2x1", 4, "v5p-8", 95 * GiB),
    ("v4:2x2x1", 4, "v4-8", 32 * GiB)])
def test_topology_names_give_chips_accelerator_type_and_hbm(name, chips, accelerator, hbm):
    s = parse_topology(name)
    assert (s.num_chips, s.accelerator_type, s.hbm_bytes_per_chip) == (chips, accelerator, hbm)


@pytest.mark.parametrize("name", ["v5e", "v7:2x2", "v5e:2x2x2", "v4:2x2", "v6e:0x2", "2x2"])
def test_bad_topology_names_are_errors_naming_the_flag(name):
    with pytest.raises(ParameterError) as e:
        parse_topology(name)
    assert e.value.field == "tpu_topology"


@pytest.mark.skipif(not libtpu_available(), reason="libtpu (the TPU compiler) is not installed")
def test_a_one_host_slice_is_compile_only_devices_of_one_process_with_the_chip_hbm():
    devices = topology_devices("v6e:2x4")
    assert len(devices) == 8
    assert {d.process_index for d in devices} == {0}
    assert {d.device_kind for d in devices} == {"TPU v6 lite"}
    assert hbm_bytes_per_device(devices[0]) == 32 * GiB


@pytest.mark.skipif(not libtpu_available(), reason="libtpu (the TPU compiler) is not installed")
def test_more_tensor_parallel_shards_than_chips_is_an_error_naming_the_flag():
    from jaxllm.worker.tpu_compile import compile_programs

    config = EngineArgs(tensor_parallel_size=8, max_model_len=64).create_engine_config()
    with pytest.raises(ParameterError) as e:
        compile_programs(config, topology_devices("v5e:2x2"), "v5e:2x2")
    assert e.value.field == "tensor_parallel_size"
