"""The safetensors files of a checkpoint directory, read as memory-mapped numpy views.

No JAX here: the config stage lists a checkpoint's tensor names with it too
(models/multimodal.py), and the loader reads the tensors.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable

import ml_dtypes
import numpy as np

from jaxllm.errors import ParameterError

_ST_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
}


class SafetensorsCheckpoint:
    """Tensor name -> memory-mapped numpy view, over every safetensors file of a directory.

    `rename` gives each stored name the name the model reads it by, or None for a
    tensor the model never reads (`skipped`); without it names are as stored."""

    def __init__(self, model_dir: str, rename: Callable[[str], str | None] | None = None):
        self.model_dir = model_dir
        self.skipped: set[str] = set()
        self._entries: dict[str, tuple[str, dict, str]] = {}
        self._maps: dict[str, tuple[np.memmap, int]] = {}
        for path in safetensors_files(model_dir):
            for stored, entry in _header(path).items():
                name = stored if rename is None else rename(stored)
                if name is None:
                    self.skipped.add(stored)
                else:
                    self._entries.setdefault(name, (path, entry, stored))

    def names(self) -> set[str]:
        return set(self._entries)

    def rename(self, renames: dict[str, str]) -> None:
        """Reads tensors by new names from now on: `renames` maps a name the model
        would read to the name its weight map uses."""
        self._entries = {renames.get(n, n): e for n, e in self._entries.items()}

    def stored_name(self, name: str) -> str:
        """The name the file gives tensor `name`."""
        return self._entries[name][2]

    def read(self, name: str) -> np.ndarray:
        path, entry, stored = self._entries[name]
        if path not in self._maps:
            with open(path, "rb") as f:
                header_len = int.from_bytes(f.read(8), "little")
            self._maps[path] = (np.memmap(path, dtype=np.uint8, mode="r"), 8 + header_len)
        data, base = self._maps[path]
        if entry["dtype"] not in _ST_DTYPES:
            raise ParameterError("model", f"tensor {stored!r} in {path} has unsupported dtype "
                                 f"{entry['dtype']}")
        start, end = entry["data_offsets"]
        dtype = np.dtype(_ST_DTYPES[entry["dtype"]])
        return data[base + start:base + end].view(dtype).reshape(entry["shape"])


def _header(path: str) -> dict:
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    header.pop("__metadata__", None)
    return header


def _index_path(model_dir: str) -> str:
    return os.path.join(model_dir, "model.safetensors.index.json")


def safetensors_files(model_dir: str) -> list[str]:
    """The weight files: an index's shards, `model.safetensors`, or every `*.safetensors`."""
    index = _index_path(model_dir)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = [os.path.join(model_dir, name) for name in sorted(set(weight_map.values()))]
        missing = [p for p in files if not os.path.isfile(p)]
        if missing:
            raise ParameterError("model", f"{index} names shard {missing[0]!r}, which is missing")
        return files
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ParameterError("model", f"no safetensors weights in {model_dir!r} (jaxllm reads "
                             "*.safetensors only; use load_format='dummy' for random weights)")
    return files


def stored_tensor_names(model_dir: str) -> set[str]:
    """Every tensor name the directory's safetensors files store (an index's weight map
    when there is one); empty when it has none (a jaxllm orbax checkpoint)."""
    index = _index_path(model_dir)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                return set(json.load(f)["weight_map"])
        except (OSError, ValueError, KeyError) as e:
            raise ParameterError("model", f"{index} is not a readable index: {e}") from e
    try:
        files = safetensors_files(model_dir)
    except ParameterError:
        return set()
    return {name for path in files for name in _header(path)}
