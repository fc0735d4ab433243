"""The server's LoRA: `--lora-modules`, `/v1/models` listing adapters with their parent,
a request whose `model` names an adapter getting that adapter's (merged transformers')
tokens, and vLLM's runtime load/unload endpoints behind the opt-in variable."""

from __future__ import annotations

import os

import httpx
import pytest

from tests.engine.hf_reference import hf_greedy, random_prompts
from tests.entrypoints.server import TINY_ENGINE_FLAGS, RemoteServer
from tests.lora.peft_adapters import ADAPTERS, make_peft_adapter, merged_greedy
from tests.models.tiny_checkpoints import checkpoint_vocab_size, make_tiny_checkpoint

MODEL = "tiny-base"
NEW_TOKENS = 5


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(server, prompt, {adapter: (dir, merged tokens)}, base tokens)."""
    root = tmp_path_factory.mktemp("lora-server")
    base = make_tiny_checkpoint(root, arch="llama")
    prompt = random_prompts(checkpoint_vocab_size(base), [9], seed=2)[0]
    adapters = {}
    for i, name in enumerate(("all", "qv_rslora")):
        adapter_dir, merged = make_peft_adapter(base, root, seed=10 + i, **ADAPTERS[name])
        adapters[name] = (adapter_dir, merged_greedy(merged, [prompt], NEW_TOKENS)[0])
    old = os.environ.get("JAXLLM_ALLOW_RUNTIME_LORA_UPDATING")
    os.environ["JAXLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    try:
        srv = RemoteServer([base, *TINY_ENGINE_FLAGS, "--max-model-len", "64",
                            "--max-num-seqs", "4", "--request-buckets", "4",
                            "--served-model-name", MODEL, "--enable-lora", "--max-loras", "2",
                            "--max-lora-rank", "8", "--lora-modules",
                            f"all={adapters['all'][0]}"])
    finally:
        if old is None:
            os.environ.pop("JAXLLM_ALLOW_RUNTIME_LORA_UPDATING")
        else:
            os.environ["JAXLLM_ALLOW_RUNTIME_LORA_UPDATING"] = old
    yield srv, prompt, adapters, hf_greedy(base, [prompt], NEW_TOKENS)[0][0]
    srv.stop()


def _complete(url: str, model: str, prompt: list[int]) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=120, json=dict(
        model=model, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0.0,
        ignore_eos=True, return_token_ids=True))


def _tokens(resp: httpx.Response) -> list[int]:
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["token_ids"]


@pytest.mark.slow
def test_lora_server_lists_serves_loads_and_unloads_adapters(served):
    srv, prompt, adapters, base_tokens = served
    models = httpx.get(srv.url + "/v1/models").json()["data"]
    assert [(m["id"], m["parent"]) for m in models] == [(MODEL, None), ("all", MODEL)]

    assert _tokens(_complete(srv.url, MODEL, prompt)) == base_tokens
    assert _tokens(_complete(srv.url, "all", prompt)) == adapters["all"][1] != base_tokens
    assert _complete(srv.url, "qv_rslora", prompt).status_code == 404

    load = httpx.post(srv.url + "/v1/load_lora_adapter",
                      json={"lora_name": "qv_rslora", "lora_path": adapters["qv_rslora"][0]})
    assert load.status_code == 200, load.text
    assert "qv_rslora" in [m["id"] for m in httpx.get(srv.url + "/v1/models").json()["data"]]
    assert _tokens(_complete(srv.url, "qv_rslora", prompt)) == adapters["qv_rslora"][1]
    again = httpx.post(srv.url + "/v1/load_lora_adapter",
                       json={"lora_name": "qv_rslora", "lora_path": adapters["qv_rslora"][0]})
    assert again.status_code == 400

    unload = httpx.post(srv.url + "/v1/unload_lora_adapter", json={"lora_name": "qv_rslora"})
    assert unload.status_code == 200, unload.text
    assert _complete(srv.url, "qv_rslora", prompt).status_code == 404
    assert httpx.post(srv.url + "/v1/unload_lora_adapter",
                      json={"lora_name": "qv_rslora"}).status_code == 404
    # The chat endpoint picks the adapter by `model` too.
    chat = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json=dict(
        model="all", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        temperature=0.0))
    assert chat.status_code == 200, chat.text


def test_runtime_lora_routes_need_the_opt_in_variable(monkeypatch):
    from fastapi import FastAPI

    from jaxllm.config import LoRAConfig
    from jaxllm.entrypoints.openai.serving_lora import LoRARegistry, add_lora_routes

    for var in ("JAXLLM_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING"):
        monkeypatch.delenv(var, raising=False)
    app = FastAPI()
    add_lora_routes(app, LoRARegistry(LoRAConfig()))
    assert not any(getattr(r, "path", "").endswith("lora_adapter") for r in app.routes)
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")  # vLLM's name works too
    add_lora_routes(app, LoRARegistry(LoRAConfig()))
    assert {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"} <= {
        getattr(r, "path", "") for r in app.routes}


def test_lora_modules_parse_vllm_forms_and_need_enable_lora():
    from jaxllm.config import LoRAConfig
    from jaxllm.entrypoints.openai.serving_lora import LoRARegistry, parse_lora_module
    from jaxllm.errors import ParameterError

    assert parse_lora_module("sql=/a/b") == ("sql", "/a/b", None)
    assert parse_lora_module('{"name": "x", "path": "/p", "base_model_name": "m"}') == (
        "x", "/p", "m")
    with pytest.raises(ParameterError, match="lora_modules"):
        parse_lora_module("no-path")
    with pytest.raises(ParameterError, match="lora_modules"):
        LoRARegistry(None, ["sql=/a/b"])
    with pytest.raises(ParameterError, match="lora_path"):
        LoRARegistry(LoRAConfig(), ["sql=/does/not/exist"])
