"""scripts/run_multi_gpu.sh: every step's command parses, with NVLink multicast off."""

from __future__ import annotations

import json
import os
import subprocess
import sys

# Records each command line; parsing happens afterwards in this process, so the twelve
# steps cost twelve bare Python starts, not twelve imports of JAX.
STUB = """
import json, os, sys
with open(os.environ["STUB_LOG"], "a") as f:
    f.write(json.dumps({"script": sys.argv[1], "args": sys.argv[2:], "out": os.environ["OUT"],
                        "nvls": os.environ.get("NCCL_NVLS_ENABLE")}) + "\\n")
"""


def _parsed(script: str, args: list[str]) -> dict:
    from jaxllm.benchmarks import latency, throughput

    if script.endswith(("bench_latency.py", "bench_throughput.py")):
        mod = latency if script.endswith("bench_latency.py") else throughput
        return vars(mod.build_parser().parse_args(args))
    return {"args": args}


def test_run_multi_gpu_steps_parse_and_keep_nvlink_multicast_off(tmp_path):
    stub = tmp_path / "stub.py"
    stub.write_text(STUB)
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{stub}" "$@"\n')
    wrapper.chmod(0o755)
    log = tmp_path / "log.jsonl"
    env = {**os.environ, "PYTHON": str(wrapper), "STUB_LOG": str(log),
           "OUT": str(tmp_path / "out"), "JAXLLM_COMMIT": "test"}
    steps = subprocess.run(["scripts/run_multi_gpu.sh", "list"], capture_output=True,
                           text=True, check=True).stdout.split()
    subprocess.run(["scripts/run_multi_gpu.sh", "all"], env=env, check=True,
                   capture_output=True, text=True)
    runs = [json.loads(line) for line in log.read_text().splitlines()]
    for r in runs:
        r["ns"] = _parsed(r["script"], r["args"])
    assert [os.path.basename(r["out"]) for r in runs] == steps
    assert all(r["nvls"] == "0" for r in runs)
    par = {os.path.basename(r["out"]): (r["ns"].get("tensor_parallel_size"),
                                        r["ns"].get("data_parallel_size"), r["ns"].get("model"))
           for r in runs if "model" in r["ns"]}
    assert par["8b-decode-tp4"] == (4, 1, "configs/llama-3-8b")
    workers = {os.path.basename(r["out"]) for r in runs if r["ns"].get("worker_processes")}
    assert workers == {"8b-decode-tp2-workers", "8b-decode-tp4-workers"}
    assert par["8b-throughput-dp2"] == (1, 2, "configs/llama-3-8b")
    assert par["70b-throughput-tp8"] == (8, 1, "configs/llama-3-70b")
    assert all(r["ns"]["load_format"] == "dummy" and r["ns"]["dtype"] == "bfloat16"
               for r in runs if "model" in r["ns"])
    serving = next(r for r in runs if r["script"].endswith("bench_serving.py"))
    assert "--tensor-parallel-size 2" in " ".join(serving["ns"]["args"])
    bad = subprocess.run(["scripts/run_multi_gpu.sh", "nope"], env=env, capture_output=True,
                         text=True)
    assert bad.returncode == 2 and "unknown step 'nope'" in bad.stderr
