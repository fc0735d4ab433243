"""scripts/bench_grid_barrier.py: the barrier kernel's counter and the CPU dry run (one
program in interpret mode, where programs run one after another)."""

import json
import sys

import pytest

from scripts.bench_grid_barrier import barriers, main


@pytest.mark.parametrize("rounds", [0, 1, 5])
def test_every_barrier_adds_one_per_program_to_the_counter(rounds):
    assert int(barriers(rounds, 1, interpret=True)()[0]) == rounds


def test_dry_run_writes_json_and_table(tmp_path, monkeypatch, capsys):
    out = tmp_path / "grid_barrier.json"
    monkeypatch.setattr(sys, "argv", ["bench_grid_barrier.py", "--small", "--out", str(out)])
    main()
    [row] = json.loads(out.read_text())["rows"]
    assert (row["programs"], row["rounds"]) == (1, 4) and row["kernel_us"] > 0
    assert "us a barrier" in capsys.readouterr().out
