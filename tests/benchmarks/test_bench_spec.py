"""scripts/bench_spec.py's CPU dry run: it times verify steps against a decode step and
measures the demo model's ngram acceptance, writing its JSON and table."""

import json

import pytest

from jaxllm.benchmarks.spec import implied_speed_up, main


def test_implied_speed_up_counts_the_expected_tokens_of_a_verify_step():
    # k = 2 at acceptance 0.5: 1 + 0.5 + 0.25 tokens per verify step.
    assert implied_speed_up(10.0, 10.0, 2, 0.5) == pytest.approx(1.75)
    assert implied_speed_up(10.0, 20.0, 1, 0.9) == pytest.approx(0.95)


@pytest.mark.slow
def test_bench_spec_dry_run_writes_json_and_table(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    main(["--model", "jaxllm/assets/demo-model", "--load-format", "auto", "--dtype", "float32",
          "--dry-run", "--num-kv-blocks", "64"])
    with open(tmp_path / "bench_spec.json") as f:
        result = json.load(f)
    assert result["workload"] == "spec-verify"
    for b in ("1", "2"):
        step = result["steps"][b]
        assert step["decode_ms"] > 0 and set(step["verify"]) == {"1", "2"}
        assert set(step["verify"]["2"]["implied_speed_up"]) == {"0.5", "0.7", "0.9"}
    demo = result["demo"]
    assert demo["greedy_outputs_equal"] is True
    assert demo["ngram"]["draft_tokens"] > 0
    assert "demo ngram acceptance" in capsys.readouterr().out.splitlines()[-3]
