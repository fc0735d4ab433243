"""`jaxllm serve -dp 2 -tp 2` on 4 fake CPU devices: one server, two engine cores.

Greedy completions are transformers' tokens; the requests spread over both cores,
whose metrics carry their own `engine` label; a killed core makes /health fail, and
the server replaces both cores.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.engine.hf_reference import hf_greedy, random_prompts
from tests.entrypoints.server import (
    TINY_ENGINE_FLAGS,
    RemoteServer,
    engine_core_pids,
    pid_alive,
)
from tests.models.tiny_checkpoints import checkpoint_vocab_size, make_tiny_checkpoint

pytestmark = pytest.mark.slow  # a server with two engine cores, killed and restarted

NEW_TOKENS = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("dp"), arch="llama",
                                num_attention_heads=4, num_key_value_heads=2,
                                num_hidden_layers=2)


@pytest.fixture(scope="module")
def server(model_dir):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
        srv = RemoteServer([model_dir, *TINY_ENGINE_FLAGS, "--max-model-len", "64",
                            "--max-num-seqs", "4", "--request-buckets", "4",
                            "-dp", "2", "-tp", "2", "--engine-restarts", "1"])
    yield srv
    cores = engine_core_pids(srv.proc.pid)
    srv.stop()
    for pid in cores:  # never leave an orphan behind a test
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)


def _complete(server: RemoteServer, prompts: list[list[int]]) -> list[list[int]]:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                           timeout=120)
    model = client.models.list().data[0].id

    def one(prompt: list[int]) -> list[int]:
        out = client.completions.create(model=model, prompt=prompt, max_tokens=NEW_TOKENS,
                                        temperature=0.0,
                                        extra_body={"ignore_eos": True,
                                                    "return_token_ids": True})
        return out.choices[0].model_extra["token_ids"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def _vllm_samples(server: RemoteServer) -> list:
    text = httpx.get(server.url + "/metrics", timeout=5).text
    return [s for family in text_string_to_metric_families(text) for s in family.samples
            if s.name.startswith("vllm:")]


def test_greedy_completions_match_transformers_and_spread_over_both_engines(
        server, model_dir):
    prompts = random_prompts(checkpoint_vocab_size(model_dir), [9, 5, 12, 7], seed=8)
    assert _complete(server, prompts) == hf_greedy(model_dir, prompts, NEW_TOKENS)[0]

    samples = _vllm_samples(server)
    assert samples and all(s.labels.get("engine") in ("0", "1") and s.labels["model_name"]
                           for s in samples)
    done = {e: sum(s.value for s in samples if s.name == "vllm:request_success_total"
                   and s.labels["engine"] == e) for e in ("0", "1")}
    assert done["0"] > 0 and done["1"] > 0 and done["0"] + done["1"] == len(prompts)
    tokens = {e: sum(s.value for s in samples if s.name == "vllm:generation_tokens_total"
                     and s.labels["engine"] == e) for e in ("0", "1")}
    assert tokens == {e: NEW_TOKENS * done[e] for e in ("0", "1")}
    running = {s.labels["engine"] for s in samples if s.name == "vllm:num_requests_running"}
    assert running == {"0", "1"}


def test_a_killed_core_fails_health_and_both_cores_are_replaced(server, model_dir):
    prompts = random_prompts(checkpoint_vocab_size(model_dir), [6, 10], seed=9)
    before = _complete(server, prompts)
    old = engine_core_pids(server.proc.pid)
    assert len(old) == 2
    os.kill(old[1], signal.SIGKILL)
    killed_at = time.monotonic()
    while httpx.get(server.url + "/health").status_code != 503:
        assert time.monotonic() - killed_at < 1.0, "/health still 200 a second after the kill"
        time.sleep(0.02)

    deadline = time.monotonic() + 300
    while httpx.get(server.url + "/health").status_code != 200:
        assert time.monotonic() < deadline, f"no restart:\n{server.logs()}"
        time.sleep(0.2)
    new = engine_core_pids(server.proc.pid)
    assert len(new) == 2 and not set(new) & set(old)
    assert not any(pid_alive(p) for p in old), "the surviving core was left running"
    assert _complete(server, prompts) == before
