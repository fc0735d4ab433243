"""jaxllm's orbax checkpoint: the model's laid-out weights, restored straight into the mesh.

A converted checkpoint directory holds what the Hugging Face directory held for
config and tokenizer (config.json, tokenizer files, generation_config.json), so
config and tokenizer loading are unchanged, plus

  * `jaxllm_orbax/`: the module state (fused qkv, stacked gate/up, ... exactly
    as models/decoder.py holds it) saved by orbax-checkpoint; and
  * `jaxllm_orbax.json`: the format version, the dtype and the tensor-parallel
    layout the weights were laid out for.

Restoring asks orbax for each array with its `NamedSharding` on the mesh, so
every process reads only the shards its devices hold and no weight passes
through a full host copy. The only layout that depends on the tensor-parallel
size is the fused qkv when kv heads are replicated (fewer kv heads than
shards, models/decoder_weights.py): a checkpoint restores at any
`tensor_parallel_size` whose kv-head replication equals the one it was
converted for, and any other is a ParameterError (no re-layout).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from typing import Any

import jax
from flax import nnx

from jaxllm.distributed.mesh import kv_head_replicas
from jaxllm.errors import ParameterError

ORBAX_DIR = "jaxllm_orbax"
METADATA_FILE = "jaxllm_orbax.json"
FORMAT_VERSION = 2  # 2: projections are Linear modules ('qkv_proj/weight')
# Files of the source directory that config and tokenizer loading read.
_COPIED_SUFFIXES = (".json", ".model", ".txt", ".tiktoken", ".jinja")
_NOT_COPIED = ("model.safetensors.index.json", METADATA_FILE)


@dataclass(frozen=True)
class OrbaxMetadata:
    """What a converted checkpoint was laid out for."""

    format_version: int
    dtype: str
    tensor_parallel_size: int
    kv_head_replicas: int
    # "fp8" / "int8": projections stored quantized (config.py reads this file for it)
    quantization: str | None = None


def is_orbax_checkpoint(model_dir: str) -> bool:
    return os.path.isdir(os.path.join(model_dir, ORBAX_DIR))


def read_metadata(model_dir: str) -> OrbaxMetadata:
    path = os.path.join(model_dir, METADATA_FILE)
    try:
        with open(path) as f:
            raw = json.load(f)
        meta = OrbaxMetadata(**raw)
    except (OSError, json.JSONDecodeError, TypeError) as e:
        raise ParameterError("model", f"{model_dir!r} has an orbax checkpoint but no readable "
                             f"{METADATA_FILE}: {e}") from e
    if meta.format_version != FORMAT_VERSION:
        raise ParameterError("model", f"{path} is jaxllm orbax format {meta.format_version}; "
                             f"this jaxllm reads format {FORMAT_VERSION} (convert again)")
    return meta


def save_orbax(model: nnx.Module, hf_config: Any, source_dir: str, out_dir: str,
               dtype: str, tensor_parallel_size: int, quantization: str | None = None
               ) -> None:
    """Writes `model`'s weights (already placed on the mesh) and the source's config and
    tokenizer files to `out_dir`; config.json's dtype becomes `dtype`, so that
    dtype='auto' restores the weights as stored."""
    import orbax.checkpoint as ocp

    if os.path.abspath(source_dir) == os.path.abspath(out_dir):
        raise ParameterError("out", "must differ from the model directory")
    if os.path.exists(os.path.join(out_dir, ORBAX_DIR)):
        raise ParameterError("out", f"{out_dir!r} already holds a jaxllm orbax checkpoint")
    os.makedirs(out_dir, exist_ok=True)
    for name in sorted(os.listdir(source_dir)):
        src = os.path.join(source_dir, name)
        if os.path.isfile(src) and name.endswith(_COPIED_SUFFIXES) and name not in _NOT_COPIED:
            shutil.copy2(src, os.path.join(out_dir, name))
    cfg_path = os.path.join(out_dir, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["torch_dtype"] = cfg["dtype"] = dtype
    # Weights are stored in jaxllm's layout: a source FP8 checkpoint's format no longer
    # describes them (the quantization is in METADATA_FILE).
    cfg.pop("quantization_config", None)
    # Whether the head is the embedding matrix, as laid out: a multimodal checkpoint's
    # is read from its tensors (models/multimodal.py), which the conversion does not copy.
    cfg["tie_word_embeddings"] = bool(getattr(hf_config, "tie_word_embeddings", False))
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)

    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.abspath(os.path.join(out_dir, ORBAX_DIR)),
                   _string_keys(nnx.to_pure_dict(nnx.state(model))))
        ckptr.wait_until_finished()
    meta = OrbaxMetadata(FORMAT_VERSION, dtype, tensor_parallel_size,
                         kv_head_replicas(hf_config, tensor_parallel_size), quantization)
    with open(os.path.join(out_dir, METADATA_FILE), "w") as f:
        json.dump(asdict(meta), f, indent=2)


def load_orbax(model_dir: str, hf_config: Any, state: nnx.State, shardings: dict,
               tp: int) -> dict:
    """The weights of the orbax checkpoint in `model_dir` as a pure dict shaped like
    `nnx.to_pure_dict(state)`, each array restored into its sharding from `shardings`
    (cast to the abstract state's dtype when the checkpoint's differs)."""
    import orbax.checkpoint as ocp

    meta = read_metadata(model_dir)
    replicas = kv_head_replicas(hf_config, tp)
    if replicas != meta.kv_head_replicas:
        raise ParameterError(
            "tensor_parallel_size",
            f"{model_dir!r} was converted for tensor_parallel_size="
            f"{meta.tensor_parallel_size} ({meta.kv_head_replicas} cop(ies) of each kv head), "
            f"which does not fit tensor_parallel_size={tp} ({replicas}); convert the model "
            f"again with --tensor-parallel-size {tp}")
    target = jax.tree.map(lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s),
                          nnx.to_pure_dict(state), shardings)
    path = os.path.abspath(os.path.join(model_dir, ORBAX_DIR))
    with ocp.StandardCheckpointer() as ckptr:
        stored = ckptr.metadata(path).item_metadata.tree
        _check_shapes(model_dir, _flat(stored), _flat(_string_keys(target)))
        restored = ckptr.restore(path, _string_keys(target))
    return _int_keys_like(restored, target)


def _check_shapes(model_dir: str, stored: dict, wanted: dict) -> None:
    missing = sorted(set(wanted) - set(stored))
    if missing:
        raise ParameterError("model", f"orbax checkpoint {model_dir!r} lacks weight "
                             f"{'.'.join(missing[0])!r} ({len(missing)} missing)")
    for key, want in wanted.items():
        got = tuple(stored[key].shape)
        if got != tuple(want.shape):
            raise ParameterError("model", f"orbax checkpoint {model_dir!r}: weight "
                                 f"{'.'.join(key)!r} has shape {got}, but config.json "
                                 f"implies {tuple(want.shape)}")


def _flat(tree: Any) -> dict[tuple[str, ...], Any]:
    if not isinstance(tree, dict):
        return {(): tree}
    return {(str(k), *rest): leaf for k, sub in tree.items() for rest, leaf in _flat(sub).items()}


def _string_keys(tree: Any) -> Any:
    # Layer lists give int keys; orbax names every node by a string.
    if isinstance(tree, dict):
        return {str(k): _string_keys(v) for k, v in tree.items()}
    return tree


def _int_keys_like(restored: Any, like: Any) -> Any:
    if isinstance(like, dict):
        return {k: _int_keys_like(restored[str(k)], v) for k, v in like.items()}
    return restored
