"""The engine config of an earlier start with the same inputs, kept on disk.

Building the engine config imports transformers (for the checkpoint's config),
and transformers imports PyTorch wherever PyTorch is installed, which took most
of a warm restart of `jaxllm serve` (BENCHMARKS.md, startup) while the engine
core, which needs the config to load the model, waited for all of it.
So the frontend keeps the config it built (`portable_config`, plain data) on
disk, and a later start with the same inputs hands it to the core at once: the
core loads the model and its programs while the frontend is still importing.
The frontend builds its own config as before; if it differs from the stored
one, the core is started again with the new one (`AsyncLLM.from_engine_args`).

The key is everything the build reads: the engine arguments, the model
directory's `config.json` and `generation_config.json` (bytes), the
`JAXLLM_ALLOW_LONG_MAX_MODEL_LEN` switch, the transformers version, and the
source of jaxllm and its kernels (`code_fingerprint`, which also keys the
lowered programs of `jaxllm/worker/aot_cache.py`). Files live in
`jaxllm-config/` under the compilation cache directory. `JAXLLM_CONFIG_CACHE=0`
turns the cache off.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import logging
import os
import pickle
import tempfile
from typing import Any

from jaxllm.config import (
    EngineArgs,
    EngineConfig,
    compilation_cache_dir,
    default_model_path,
    portable_config,
)

logger = logging.getLogger(__name__)

_PACKAGES = ("jaxllm", "pallas_kernels")
_READ_FILES = ("config.json", "generation_config.json")
_ENV = ("JAXLLM_ALLOW_LONG_MAX_MODEL_LEN",)


@functools.cache
def code_fingerprint() -> str:
    """sha256 over the source of jaxllm and pallas_kernels (paths and bytes)."""
    h = hashlib.sha256()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for pkg in _PACKAGES:
        base = os.path.join(root, pkg)
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for name in sorted(filenames):
                if name.endswith(".py"):
                    path = os.path.join(dirpath, name)
                    h.update(os.path.relpath(path, root).encode())
                    with open(path, "rb") as f:
                        h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()


def _path(args: EngineArgs) -> str | None:
    """The file for these inputs, or None when the cache is off."""
    if os.environ.get("JAXLLM_CONFIG_CACHE") == "0":
        return None
    model = os.path.abspath(args.model or default_model_path())
    h = hashlib.sha256()
    h.update(repr(sorted(dataclasses.asdict(args).items())).encode())
    h.update(model.encode())
    for name in _READ_FILES:
        try:
            with open(os.path.join(model, name), "rb") as f:
                h.update(hashlib.sha256(f.read()).digest())
        except OSError:
            h.update(b"-")
    for var in _ENV:
        h.update(f"{var}={os.environ.get(var)}".encode())
    try:
        h.update(importlib.metadata.version("transformers").encode())
    except importlib.metadata.PackageNotFoundError:
        h.update(b"-")
    h.update(code_fingerprint().encode())
    base = os.path.join(compilation_cache_dir(args.compilation_cache_dir), "jaxllm-config")
    return os.path.join(base, h.hexdigest() + ".pkl")


def load(args: EngineArgs) -> EngineConfig | None:
    """The config stored for these inputs, or None (none stored, unreadable, or off)."""
    path = _path(args)
    if path is None or not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as f:
            config = pickle.load(f)
    except Exception as e:  # a partial or foreign file: build the config instead
        logger.warning("ignoring the stored engine config %s: %s", path, e)
        return None
    return config if isinstance(config, EngineConfig) else None


def store(args: EngineArgs, config: EngineConfig) -> None:
    """Keeps `config` (as `portable_config`) for the next start with these inputs."""
    path = _path(args)
    if path is None:
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            pickle.dump(portable_config(config), f)
        os.replace(tmp, path)
    except OSError as e:  # a read-only cache directory: the next start builds it again
        logger.warning("could not store the engine config in %s: %s", path, e)


def same_config(a: EngineConfig, b: EngineConfig) -> bool:
    """Whether two engine configs are equal, their model configs compared by value."""
    def plain(c: EngineConfig) -> tuple[EngineConfig, Any]:
        mc = c.model_config
        hf = mc.hf_config.to_dict() if hasattr(mc.hf_config, "to_dict") else vars(mc.hf_config)
        return dataclasses.replace(c, model_config=dataclasses.replace(mc, hf_config=None)), hf

    return plain(a) == plain(b)
