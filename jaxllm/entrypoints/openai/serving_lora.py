"""The server's LoRA adapters: `--lora-modules`, a request's `model` naming an adapter,
`/v1/models` listing them, and vLLM's runtime `/v1/load_lora_adapter` and
`/v1/unload_lora_adapter` (only with JAXLLM_ALLOW_RUNTIME_LORA_UPDATING, or vLLM's
VLLM_ALLOW_RUNTIME_LORA_UPDATING, set to a true value)."""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from jaxllm.entrypoints.openai.protocol import ModelCard
from jaxllm.entrypoints.openai.serving_engine import HTTPError
from jaxllm.errors import ParameterError
from jaxllm.lora.config import LoRAConfig
from jaxllm.lora.peft import check_lora_request, load_peft_adapter
from jaxllm.lora.request import LoRARequest

RUNTIME_UPDATE_VARS = ("JAXLLM_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING")


def runtime_updates_allowed() -> bool:
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes")
               for v in RUNTIME_UPDATE_VARS)


def parse_lora_module(spec: str) -> tuple[str, str, str | None]:
    """(name, path, base_model_name) of one `--lora-modules` entry: vLLM's `name=path` or
    its JSON form `{"name": ..., "path": ..., "base_model_name": ...}`."""
    spec = spec.strip()
    if spec.startswith("{"):
        try:
            d = json.loads(spec)
            return str(d["name"]), str(d["path"]), d.get("base_model_name")
        except (ValueError, KeyError, TypeError) as e:
            raise ParameterError("lora_modules", f"{spec!r}: {e}") from None
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise ParameterError("lora_modules", f"{spec!r} is not name=path")
    return name, path, None


class LoRARegistry:
    """The adapters the server serves, by name (ids are given in order, from 1)."""

    def __init__(self, lora_config: LoRAConfig | None, modules: Sequence[str] = ()):
        self.lora_config = lora_config
        self.adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        if modules and lora_config is None:
            raise ParameterError("lora_modules", "needs --enable-lora")
        for spec in modules:
            name, path, base = parse_lora_module(spec)
            self.add(name, path, base)

    def add(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        if name in self.adapters:
            raise HTTPError(400, f"The lora adapter '{name}' has already been loaded.",
                            "lora_name")
        lora = LoRARequest(name, next(self._ids), path, base_model_name)
        check_lora_request(lora, self.lora_config)
        # Read it whole once here, so that a damaged adapter is a 400 now and not an
        # engine error at its first request.
        load_peft_adapter(path, self.lora_config.max_lora_rank)
        self.adapters[name] = lora
        return lora

    def remove(self, name: str) -> LoRARequest:
        if name not in self.adapters:
            raise HTTPError(404, f"The lora adapter '{name}' cannot be found.", "lora_name")
        return self.adapters.pop(name)

    def get(self, name: str | None) -> LoRARequest | None:
        return self.adapters.get(name) if name else None

    def model_cards(self, base_model: str) -> list[ModelCard]:
        """`/v1/models` entries of the adapters (vLLM's: `parent` is the base model)."""
        return [ModelCard(id=a.lora_name, root=a.lora_path, parent=a.base_model_name or base_model)
                for a in self.adapters.values()]


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


def add_lora_routes(app: FastAPI, registry: LoRARegistry, servings: Sequence[Any] = ()) -> None:
    """Hands `registry` to the generating endpoints (`servings`: a request's `model` may
    name an adapter) and registers the runtime load/unload routes, where allowed."""
    for serving in servings:
        serving.loras = registry
    if not runtime_updates_allowed():
        return

    def enabled() -> None:
        if registry.lora_config is None:
            raise HTTPError(400, "LoRA is not enabled (start the server with --enable-lora)")

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> str:
        enabled()
        registry.add(body.lora_name, body.lora_path)
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> str:
        enabled()
        registry.remove(body.lora_name)
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
