"""The XLA flags jaxllm adds on NVIDIA GPUs (jaxllm/xla_flags.py)."""

from __future__ import annotations

import os
import subprocess
import sys

from jaxllm.xla_flags import GPU_FLAGS, SKIP_TEMP_FLAG, add_gpu_xla_flags, gpu_flags


def test_gpu_hosts_get_the_command_buffer_flags_once():
    env: dict[str, str] = {"XLA_FLAGS": "--xla_dump_to=/tmp/x"}
    flags = gpu_flags()
    assert add_gpu_xla_flags(env, gpu=True) == list(flags)
    assert env["XLA_FLAGS"] == " ".join(["--xla_dump_to=/tmp/x", *flags])
    assert add_gpu_xla_flags(env, gpu=True) == []  # a second import adds nothing
    assert env["XLA_FLAGS"].count("xla_gpu_enable_command_buffer") == 1


def test_the_skip_temp_update_mode_comes_only_with_a_jaxlib_that_knows_it():
    # jaxlib 0.10.2's XLA aborts on the flag; 0.11.2's takes it (the H100 runs).
    assert gpu_flags((0, 10, 2)) == GPU_FLAGS
    assert gpu_flags((0, 11, 2)) == (*GPU_FLAGS, SKIP_TEMP_FLAG)
    assert gpu_flags((1, 0, 0))[-1] == SKIP_TEMP_FLAG
    env: dict[str, str] = {}
    assert SKIP_TEMP_FLAG in add_gpu_xla_flags(env, gpu=True, jaxlib=(0, 11, 2))
    # A user's own update mode wins.
    env = {"XLA_FLAGS": "--xla_gpu_command_buffer_update_mode=ALWAYS"}
    assert SKIP_TEMP_FLAG not in add_gpu_xla_flags(env, gpu=True, jaxlib=(0, 11, 2))


def test_a_users_own_setting_wins_and_the_switch_turns_it_off():
    env = {"XLA_FLAGS": "--xla_gpu_enable_command_buffer="}
    assert add_gpu_xla_flags(env, gpu=True) == list(gpu_flags()[1:])
    assert "--xla_gpu_enable_command_buffer= " in env["XLA_FLAGS"] + " "
    off = {"JAXLLM_XLA_FLAGS": "0"}
    assert add_gpu_xla_flags(off, gpu=True) == [] and "XLA_FLAGS" not in off


def test_hosts_without_a_cuda_plugin_are_left_alone():
    env: dict[str, str] = {}
    assert add_gpu_xla_flags(env, gpu=False) == [] and env == {}


def test_xla_accepts_the_flags():
    """XLA aborts on a flag it does not know: compile and run a program with them set."""
    env = {**os.environ, "XLA_FLAGS": " ".join(gpu_flags()), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", "import jax; print(jax.jit(lambda x: x + 1)(1))"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "2", out.stderr[-2000:]
