"""The stored engine config: keyed by every input of its build, handed to the engine core
at once on a later start, and replaced (core started again) when the new build differs."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from jaxllm import config_cache
from jaxllm.config import EngineArgs, portable_config
from jaxllm.engine import core_client, dp_client
from jaxllm.engine.async_llm import AsyncLLM


@pytest.fixture
def args(model_dir, tmp_path):
    model = shutil.copytree(model_dir, tmp_path / "model")
    return EngineArgs(model=str(model), dtype="float32", max_model_len=64, max_num_seqs=4,
                      skip_tokenizer_init=True, compilation_cache_dir=str(tmp_path / "cache"))


class FakeClient:
    """Stands in for the engine core's process: records the config it was started with."""

    started: list = []

    def __init__(self, config, startup_timeout_s=None):
        self.config = config
        self.max_request_tokens = 64
        self.num_blocks = 16
        self.stopped = False
        FakeClient.started.append(self)

    def shutdown(self):
        self.stopped = True


def test_stored_config_round_trips_and_is_keyed_by_its_inputs(args, monkeypatch):
    assert config_cache.load(args) is None
    built = args.create_engine_config()
    config_cache.store(args, built)
    stored = config_cache.load(args)
    assert stored is not None and config_cache.same_config(stored, portable_config(built))
    assert not config_cache.same_config(
        stored, dataclasses.replace(stored, attention_backend="reference"))

    # Another argument, another config.json, or the cache off: nothing stored applies.
    assert config_cache.load(dataclasses.replace(args, max_num_seqs=8)) is None
    cfg = Path(args.model) / "config.json"
    original = cfg.read_bytes()
    cfg.write_text(json.dumps({**json.loads(original), "rms_norm_eps": 1e-5}))
    assert config_cache.load(args) is None
    cfg.write_bytes(original)
    assert config_cache.load(args) is not None
    monkeypatch.setenv("JAXLLM_CONFIG_CACHE", "0")
    assert config_cache.load(args) is None


@pytest.mark.slow
def test_a_restart_hands_the_stored_config_to_the_core(args, monkeypatch):
    monkeypatch.setattr(dp_client, "AsyncMPClient", FakeClient)  # where AsyncLLM makes it
    FakeClient.started = []
    AsyncLLM.from_engine_args(args)
    (first,) = FakeClient.started
    assert not isinstance(first.config, core_client.EngineConfig)  # the build, still pending
    assert config_cache.load(args) is not None

    FakeClient.started = []
    llm = AsyncLLM.from_engine_args(args)
    (second,) = FakeClient.started
    assert isinstance(second.config, core_client.EngineConfig) and not second.stopped
    assert config_cache.same_config(second.config, portable_config(llm.config))


@pytest.mark.slow
def test_a_stale_stored_config_starts_the_core_again_with_the_new_one(args, monkeypatch):
    monkeypatch.setattr(dp_client, "AsyncMPClient", FakeClient)  # where AsyncLLM makes it
    built = args.create_engine_config()
    stale = dataclasses.replace(built, scheduler_config=dataclasses.replace(
        built.scheduler_config, max_num_seqs=99))
    config_cache.store(args, stale)

    FakeClient.started = []
    llm = AsyncLLM.from_engine_args(args)
    first, second = FakeClient.started
    assert first.config.scheduler_config.max_num_seqs == 99 and first.stopped
    assert second.config.scheduler_config.max_num_seqs == 4 and not second.stopped
    assert llm.engine_core is second
    assert config_cache.load(args).scheduler_config.max_num_seqs == 4
