"""Huge pages for the engine core's heap: the environment jaxllm gives the processes it starts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from jaxllm.engine import hugepages
from jaxllm.engine.hugepages import hugepage_children, hugepage_env


def test_the_tunable_is_added_beside_the_callers_own_and_never_overrides_theirs():
    assert hugepage_env({})["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    mixed = hugepage_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "PATH": "/bin"})
    assert mixed == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1",
                     "PATH": "/bin"}
    theirs = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}
    assert hugepage_env(theirs) == theirs
    opted_out = {"JAXLLM_MALLOC_HUGEPAGES": "0"}
    assert hugepage_env(opted_out) == opted_out


def test_children_started_in_the_block_get_it_and_the_environment_is_restored(monkeypatch):
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    monkeypatch.delenv("JAXLLM_MALLOC_HUGEPAGES", raising=False)
    probe = [sys.executable, "-c",
             "from jaxllm.engine.hugepages import requested_here; print(requested_here())"]
    with hugepage_children():
        inside = subprocess.run(probe, capture_output=True, text=True, check=True).stdout
    assert os.environ["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2"
    outside = subprocess.run(probe, capture_output=True, text=True, check=True).stdout
    assert (inside.strip(), outside.strip()) == ("True", "False")
    monkeypatch.delenv("GLIBC_TUNABLES")
    with hugepage_children():
        pass
    assert "GLIBC_TUNABLES" not in os.environ


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup"), reason="Linux /proc only")
def test_huge_page_memory_is_read_from_proc():
    assert hugepages.anon_hugepages_kib() >= 0
