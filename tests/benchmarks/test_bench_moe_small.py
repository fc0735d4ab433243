"""scripts/bench_moe_small.py's CPU dry run (--small, the kernels in interpret mode): every
body is checked against the loop, timed per layer against the routed-bytes roofline and
written as JSON."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_dry_run_times_every_body_against_the_loop_and_the_roofline(tmp_path):
    out = tmp_path / "moe_small.json"
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    run = subprocess.run([sys.executable, str(ROOT / "scripts/bench_moe_small.py"), "--small",
                          "--tokens", "3", "--out", str(out)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    # one token count: the kernels' own tests cover the others (tests/kernels)
    assert [row["tokens"] for row in result["rows"]] == [3]
    for row in result["rows"]:
        assert set(row["bodies"]) == {"loop", "kernel", "kernel_only", "route_kernel",
                                      "logits_kernel"}
        assert 1 <= row["distinct_experts_per_layer"] <= min(2 * row["tokens"], 8)
        for body in row["bodies"].values():
            assert body["agrees"] and body["us"] > 0 and body["roofline_fraction"] > 0
    assert "T= 3" in run.stdout and "DISAGREES" not in run.stdout
