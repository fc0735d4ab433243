"""scripts/bench_grid_barrier.py: the barrier kernel's counter and the CPU dry run (one
program in interpret mode, where programs run one after another)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.bench_grid_barrier import barriers

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("rounds", [0, 1, 5])
def test_every_barrier_adds_one_per_program_to_the_counter(rounds):
    assert int(barriers(rounds, 1, interpret=True)()[0]) == rounds


def test_dry_run_writes_json_and_table(tmp_path):
    out = tmp_path / "grid_barrier.json"
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    run = subprocess.run([sys.executable, str(ROOT / "scripts/bench_grid_barrier.py"),
                          "--small", "--out", str(out)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    [row] = json.loads(out.read_text())["rows"]
    assert (row["programs"], row["rounds"]) == (1, 4) and row["kernel_us"] > 0
    assert "us a barrier" in run.stdout
