"""Data parallelism on one TPU VM, without a TPU: how the host is detected, which chips
each core gets and the libtpu environment that tells it so, and the layouts refused."""

from __future__ import annotations

import pytest

from jaxllm.distributed.dp_devices import core_placements
from jaxllm.distributed.tpu_dp import (
    TpuHost,
    _is_box,
    detect_tpu_host,
    parse_host,
    rank_chips,
    tpu_core_envs,
)
from jaxllm.errors import ParameterError

V6E_8 = TpuHost("v6e", 8, (2, 4, 1))
V5P_8 = TpuHost("v5p", 4, (2, 2, 1))  # v5p-8: 4 chips (8 cores, one device a chip)

# (host, dp, tp) -> each core's TPU_VISIBLE_CHIPS and its per-process chip bounds
LAYOUTS = [
    (V6E_8, 2, 1, ["0", "1"], "1,1,1"),
    (V6E_8, 2, 2, ["0,1", "2,3"], "1,2,1"),
    (V6E_8, 4, 2, ["0,1", "2,3", "4,5", "6,7"], "1,2,1"),
    (V6E_8, 8, 1, [str(c) for c in range(8)], "1,1,1"),
    (V6E_8, 2, 4, ["0,1,2,3", "4,5,6,7"], "2,2,1"),
    (V5P_8, 2, 1, ["0", "1"], "1,1,1"),
    (V5P_8, 2, 2, ["0,1", "2,3"], "1,2,1"),
    (V5P_8, 4, 1, ["0", "1", "2", "3"], "1,1,1"),
]


@pytest.mark.parametrize("host,dp,tp,chips,bounds", LAYOUTS,
                         ids=[f"{h.generation}-dp{dp}-tp{tp}" for h, dp, tp, *_ in LAYOUTS])
def test_each_core_gets_its_own_box_of_chips_as_a_one_process_slice(host, dp, tp, chips,
                                                                    bounds):
    ports = [9100 + r for r in range(dp)]
    envs = tpu_core_envs(host, dp, tp, environ={}, ports=ports)
    assert [e["TPU_VISIBLE_CHIPS"] for e in envs] == chips
    for env, port in zip(envs, ports, strict=True):
        assert env == {
            "TPU_VISIBLE_CHIPS": env["TPU_VISIBLE_CHIPS"],
            "TPU_CHIPS_PER_PROCESS_BOUNDS": bounds,
            "TPU_PROCESS_BOUNDS": "1,1,1",
            "TPU_PROCESS_PORT": str(port),
            "TPU_PROCESS_ADDRESSES": f"localhost:{port}",
            "CLOUD_TPU_TASK_ID": "0",
            "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
        }


def test_the_cores_get_distinct_free_ports_of_their_own():
    envs = tpu_core_envs(V6E_8, 8, 1, environ={})
    ports = [e["TPU_PROCESS_PORT"] for e in envs]
    assert len(set(ports)) == 8 and all(int(p) > 0 for p in ports)
    assert [e["TPU_PROCESS_ADDRESSES"] for e in envs] == [f"localhost:{p}" for p in ports]


@pytest.mark.parametrize("host,dp,tp,field,message", [
    (V6E_8, 2, 8, "data_parallel_size", "needs 16 TPU chips, but this v6e host of 8 chips"),
    (V6E_8, 3, 4, "data_parallel_size", "needs 12 TPU chips"),
    (V5P_8, 2, 4, "data_parallel_size", "needs 8 TPU chips, but this v5p host of 4 chips"),
    (V5P_8, 8, 1, "data_parallel_size", "needs 8 TPU chips"),
    (V6E_8, 2, 3, "tensor_parallel_size", "tensor_parallel_size=3 chips are not a chip grid"),
    (V6E_8, 2, 6, "data_parallel_size", "needs 12 TPU chips"),
    (V5P_8, 4, 2, "data_parallel_size", "needs 8 TPU chips, but this v5p host of 4 chips"),
    (TpuHost("v5e", 1, (1, 1, 1)), 2, 1, "data_parallel_size", "needs 2 TPU chips"),
    (TpuHost("v6e", 2, None), 2, 1, "data_parallel_size", "which jaxllm does not know"),
    (TpuHost("tpu7x", 8, None), 2, 1, "data_parallel_size", "tpu7x host of 8 chips"),
])
def test_layouts_the_host_cannot_hold_are_refused_naming_the_field(host, dp, tp, field,
                                                                    message):
    with pytest.raises(ParameterError, match=message) as e:
        rank_chips(host, dp, tp, environ={})
    assert e.value.field == field


def test_a_host_of_a_multi_host_slice_or_chips_already_chosen_are_refused():
    with pytest.raises(ParameterError, match="host of a 2-host slice") as e:
        rank_chips(V6E_8, 2, 1, environ={"TPU_WORKER_HOSTNAMES": "w0,w1"})
    assert e.value.field == "data_parallel_size"
    assert rank_chips(V6E_8, 2, 1, environ={"TPU_WORKER_HOSTNAMES": "localhost"}) == [[0], [1]]
    with pytest.raises(ParameterError, match="TPU_VISIBLE_CHIPS is already set") as e:
        rank_chips(V6E_8, 2, 1, environ={"TPU_VISIBLE_CHIPS": "4,5"})
    assert e.value.field == "data_parallel_size"


def test_a_core_s_chips_must_fill_a_box_of_the_host_grid():
    """Chip ids run x fastest: on a 2x4 host chips 1 and 2 sit on two rows."""
    assert _is_box((2, 4, 1), [0, 1]) and _is_box((2, 4, 1), [4, 5, 6, 7])
    assert not _is_box((2, 4, 1), [1, 2]) and not _is_box((2, 4, 1), [0, 1, 2])
    assert not _is_box((2, 2, 1), [0, 3])


def fake_pci(root, devices: list[tuple[str, str]]) -> str:
    """A sysfs PCI device folder holding `devices` (vendor id, device id)."""
    root.mkdir(parents=True, exist_ok=True)
    for i, (vendor, device) in enumerate(devices):
        d = root / f"0000:00:{i:02x}.0"
        d.mkdir()
        (d / "vendor").write_text(vendor + "\n")
        (d / "device").write_text(device + "\n")
    return str(root)


def test_a_tpu_vm_is_found_from_its_pci_devices_as_jax_finds_it(tmp_path):
    other = [("0x8086", "0x1234"), ("0x1ae0", "0x0001")]  # an Intel device; a Google NIC
    pci = fake_pci(tmp_path, other + [("0x1ae0", "0x006f")] * 8)
    assert detect_tpu_host({}, pci) == V6E_8
    assert detect_tpu_host({"JAX_PLATFORMS": "tpu,cpu"}, pci) == V6E_8
    assert detect_tpu_host({"JAX_PLATFORMS": "cpu"}, pci) is None
    assert detect_tpu_host({}, str(tmp_path / "absent")) is None


def test_v4_and_v5p_hosts_are_2x2x1_and_unknown_generations_have_no_grid(tmp_path):
    assert detect_tpu_host({}, fake_pci(tmp_path / "a", [("0x1ae0", "0x0062")] * 4)) == \
        TpuHost("v5p", 4, (2, 2, 1))
    assert detect_tpu_host({}, fake_pci(tmp_path / "b", [("0x1ae0", "0x005e")] * 4)) == \
        TpuHost("v4", 4, (2, 2, 1))
    assert detect_tpu_host({}, fake_pci(tmp_path / "c", [("0x1ae0", "0x0076")] * 4)) == \
        TpuHost("tpu7x", 4, None)


def test_the_override_names_the_host_or_says_there_is_none(tmp_path):
    pci = fake_pci(tmp_path, [("0x1ae0", "0x006f")] * 8)
    assert detect_tpu_host({"JAXLLM_TPU_HOST": "v5e:2x2", "JAX_PLATFORMS": "cpu"}, pci) == \
        TpuHost("v5e", 4, (2, 2, 1))
    assert detect_tpu_host({"JAXLLM_TPU_HOST": "none"}, pci) is None
    assert parse_host("v5p:2x2x1") == TpuHost("v5p", 4, (2, 2, 1))
    for bad in ("v6e:4x4", "v6e", "v9:2x2", "2x4"):
        with pytest.raises(ParameterError, match="expected one TPU host's chip grid") as e:
            parse_host(bad)
        assert e.value.field == "JAXLLM_TPU_HOST"


def test_the_frontend_lays_out_tpu_cores_only_on_a_tpu_host():
    placements = core_placements(4, 2, environ={"JAXLLM_TPU_HOST": "v6e:2x4"})
    assert [(p.rank, p.data_parallel_size, p.tensor_parallel_size) for p in placements] == \
        [(r, 4, 2) for r in range(4)]
    assert [p.env["TPU_VISIBLE_CHIPS"] for p in placements] == ["0,1", "2,3", "4,5", "6,7"]
    assert all(p.env == {} for p in core_placements(2, 2, environ={"JAX_PLATFORMS": "cpu"}))
    assert core_placements(1, 8, environ={"JAXLLM_TPU_HOST": "v6e:2x4"})[0].env == {}
    with pytest.raises(ParameterError, match="needs 16 TPU chips"):
        core_placements(2, 8, environ={"JAXLLM_TPU_HOST": "v6e:2x4"})
