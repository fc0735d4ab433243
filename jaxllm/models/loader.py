"""Builds a model with every weight a `jax.Array` placed on the mesh.

The module is first created abstractly (`nnx.eval_shape`), which yields each
parameter's shape, dtype and declared sharding without allocating anything.
Then either
  * safetensors: each parameter is assembled on the host from memory-mapped
    checkpoint tensors (split/stacked into the fused layouts, cast to the model
    dtype) and handed to the devices shard by shard (`make_array_from_callback`),
    so no weight is materialized twice on the host or ever in full on a device
    that holds only a shard; or
  * orbax: a checkpoint written by `jaxllm convert` (models/orbax_io.py), each
    array restored straight into its sharding; or
  * dummy: a jitted init with `out_shardings` draws the random weights directly
    on the devices, deterministic from `seed` and independent of the mesh.

Checkpoints: `model.safetensors`, a `model.safetensors.index.json` over several
shards, or any `*.safetensors` files in the directory; bf16/fp16/fp32 on disk.
A multimodal checkpoint's language model is read under its text model's tensor
names, its vision tensors skipped (models/multimodal.py).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from tqdm.auto import tqdm

from jaxllm.config import ModelConfig
from jaxllm.distributed.mesh import (
    MLA_MODEL_TYPES,
    config_kv_heads,
    kv_head_replicas,
    param_shardings,
    validate_tensor_parallel,
    variable_sharding,
)
from jaxllm.errors import ParameterError
from jaxllm.layers.attention_sharded import shard_attention
from jaxllm.layers.linear import INIT_STD
from jaxllm.models.contract import KVCacheSpec
from jaxllm.models.multimodal import text_tensor_name
from jaxllm.models.orbax_io import ORBAX_DIR, is_orbax_checkpoint, load_orbax
from jaxllm.models.quant_load import (
    KV_SCALES,
    input_scale_path,
    kv_scales,
    read_input_scale,
    read_source,
    scale_name,
    scale_path,
)
from jaxllm.models.quant_load import ignored as quant_ignored
from jaxllm.models.registry import get_model_class
from jaxllm.models.safetensors_files import SafetensorsCheckpoint


def kv_cache_spec(hf_config: Any, tensor_parallel_size: int = 1) -> KVCacheSpec:
    """The cache's shape parameters; with fewer kv heads than `tensor_parallel_size`
    the kv heads are replicated so that each shard holds one. (Read from the config
    alone, so that tools size a cache for any decoder without its class; the
    classes' `kv_cache_spec` agree, tests/models.)"""
    heads = int(hf_config.num_attention_heads)
    if getattr(hf_config, "model_type", None) in MLA_MODEL_TYPES:  # the latent, rope key
        head_dim = int(hf_config.kv_lora_rank) + int(hf_config.qk_rope_head_dim)
    else:
        head_dim = int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads)
    return KVCacheSpec(
        num_layers=int(hf_config.num_hidden_layers),
        num_kv_heads=config_kv_heads(hf_config) * kv_head_replicas(hf_config,
                                                                   tensor_parallel_size),
        head_dim=head_dim)


def kv_cache_bytes_per_token(hf_config: Any, dtype: str | jnp.dtype) -> int:
    return kv_cache_spec(hf_config).bytes_per_token(dtype)


def _model_factory(model_config: ModelConfig, mesh: Mesh, attn_backend: Any,
                   swiglu: Any) -> Callable[[], nnx.Module]:
    """The model's constructor on `mesh` (attention per shard over several 'model' devices)."""
    hf_config = model_config.hf_config
    cls = get_model_class(model_config.architecture)
    tp = mesh.shape["model"]
    validate_tensor_parallel(hf_config, tp)
    dtype = jnp.dtype(model_config.dtype)
    attn_backend = shard_attention(attn_backend, mesh)
    layout = {} if tp == 1 else {"tensor_parallel_size": tp}
    quantization = getattr(model_config, "quantization", None)
    accepts = inspect.signature(cls.__init__).parameters
    if quantization is not None:
        if "quantization" not in accepts:
            raise ParameterError("quantization", f"{cls.__name__} has no quantized form")
        layout["quantization"] = quantization
    if "max_model_len" in accepts:
        layout["max_model_len"] = model_config.max_model_len
    if getattr(model_config, "kv_cache_dtype", "auto") != "auto":
        if "kv_cache_dtype" not in accepts:
            raise ParameterError("kv_cache_dtype", f"{cls.__name__} keeps no KV cache")
        layout["kv_cache_dtype"] = model_config.kv_cache_dtype

    def create() -> nnx.Module:
        return cls(hf_config, dtype=dtype, rngs=nnx.Rngs(model_config.seed),
                   attn_backend=attn_backend, swiglu=swiglu, **layout)

    return create


def abstract_model(model_config: ModelConfig, mesh: Mesh, attn_backend: Any,
                   swiglu: Any = None) -> nnx.Module:
    """The model of `model_config` with every weight a ShapeDtypeStruct: its graph, shapes
    and declared shardings, nothing allocated (what `load_model` fills in)."""
    return nnx.eval_shape(_model_factory(model_config, mesh, attn_backend, swiglu))


def load_model(model_config: ModelConfig, mesh: Mesh, attn_backend: Any,
               swiglu: Any = None) -> nnx.Module:
    """The model of `model_config`, every weight sharded on `mesh` in `model_config.dtype`.

    `swiglu`: how the MLP computes its up-projection (jaxllm/layers/mlp.py; XLA if None).
    Over several 'model' devices the attention runs per shard (`shard_attention`)."""
    hf_config = model_config.hf_config
    cls = get_model_class(model_config.architecture)
    tp = mesh.shape["model"]
    create = _model_factory(model_config, mesh, attn_backend, swiglu)
    graphdef, state = nnx.split(nnx.eval_shape(create))
    shardings = param_shardings(state, mesh)
    if model_config.load_format == "dummy":
        values = _dummy_weights(state, mesh, model_config.seed)
        if values is None:  # a parameter without a declared init (quantized weights)
            values = jax.jit(lambda: nnx.to_pure_dict(nnx.state(create())),
                             out_shardings=shardings)()
    elif uses_orbax(model_config):
        # An fp8 KV cache's scales are not weights a conversion stores: 1.0 (vLLM's default).
        kv = KV_SCALES[0]
        weights = nnx.State({k: v for k, v in state.items() if k != kv})
        values = load_orbax(model_config.model, hf_config, weights,
                            {k: v for k, v in shardings.items() if k != kv}, tp)
        if kv in state:
            values[kv] = _place(np.ones(state[kv].get_value().shape, np.float32),
                                shardings[kv])
    else:
        # A multimodal checkpoint's language model is read under the text model's names.
        multimodal = getattr(model_config, "checkpoint_architecture", None)
        ckpt = SafetensorsCheckpoint(model_config.model, text_tensor_name if multimodal else None)
        values = _load_safetensors(cls, hf_config, ckpt, state, shardings, tp)
    nnx.replace_by_pure_dict(state, values)
    return nnx.merge(graphdef, state)


@functools.cache
def _dummy_program(init: str, shape: tuple[int, ...], dtype: Any, sharding: Any) -> Any:
    if init == "normal":
        return jax.jit(lambda key: (INIT_STD * jax.random.normal(key, shape, jnp.float32))
                       .astype(dtype), out_shardings=sharding)
    fill = {"ones": jnp.ones, "zeros": jnp.zeros}[init]
    return jax.jit(lambda key: fill(shape, dtype), out_shardings=sharding)


def _dummy_weights(state: nnx.State, mesh: Mesh, seed: int) -> dict | None:
    """Random weights drawn parameter by parameter from the init each declared
    (`make_param`'s `dummy_init`), one small program per shape and sharding: one
    program for the whole model compiles for minutes where experts or layers are
    many. None when a parameter declares none."""
    def is_var(x: Any) -> bool:
        return isinstance(x, nnx.Variable)

    variables = jax.tree.leaves(state, is_leaf=is_var)
    if any(v.get_metadata().get("dummy_init") is None for v in variables):
        return None
    base, index = jax.random.key(seed), iter(range(len(variables)))

    def draw(v: nnx.Variable) -> jax.Array:
        value = v.get_value()
        program = _dummy_program(v.get_metadata()["dummy_init"], tuple(value.shape),
                                 jnp.dtype(value.dtype), variable_sharding(v, mesh))
        return program(jax.random.fold_in(base, next(index)))

    return nnx.to_pure_dict(jax.tree.map(draw, state, is_leaf=is_var))


def uses_orbax(model_config: ModelConfig) -> bool:
    """Whether the weights come from a jaxllm orbax checkpoint (models/orbax_io.py):
    load_format 'orbax', or 'auto' on a directory that holds one."""
    found = is_orbax_checkpoint(model_config.model)
    if model_config.load_format == "orbax" and not found:
        raise ParameterError("load_format", f"'orbax', but {model_config.model!r} has no "
                             f"{ORBAX_DIR}/ folder (write one with `jaxllm convert`)")
    return model_config.load_format == "orbax" or (model_config.load_format == "auto"
                                                   and found)


# ---- safetensors ------------------------------------------------------------------------

def _load_safetensors(cls: type, hf_config: Any, ckpt: SafetensorsCheckpoint,
                      state: nnx.State, shardings: dict, tp: int) -> dict:
    model_dir = ckpt.model_dir
    renames = getattr(cls, "hf_checkpoint_renames", None)
    if renames is not None:  # an encoder's trunk is saved with or without a prefix
        ckpt.rename(renames(hf_config, ckpt.names()))
    sources = cls.hf_weight_map(hf_config, *([tp] if tp > 1 else []))
    variables = dict(nnx.to_flat_state(state))
    available = ckpt.names()
    needed = {name for src in sources for name in src.tensors}
    needed |= {scale for name in needed if (scale := scale_name(available, name))}
    missing = sorted(needed - available)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ParameterError("model", f"checkpoint {model_dir!r} is missing tensor "
                             f"{missing[0]!r}{more}")
    unexpected = sorted(n for n in available - needed
                        if not (cls.hf_ignored_tensor(hf_config, n) or quant_ignored(n)))
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise ParameterError("model", f"checkpoint {model_dir!r} has unexpected tensor "
                             f"{ckpt.stored_name(unexpected[0])!r}{more}, which "
                             f"{cls.__name__} does not use")
    sourced = {src.path for src in sources}
    sourced |= {at(p) for p in sourced for at in (scale_path, input_scale_path)}
    sourced.add(KV_SCALES)
    unsourced = sorted(str(p) for p in set(variables) - sourced)
    if unsourced:
        raise RuntimeError(f"{cls.__name__} parameters without a checkpoint source: {unsourced}")

    values: dict = {}
    with tqdm(total=len(needed), desc="Loading safetensors", unit="tensor") as bar:
        for src in sources:
            want = variables[src.path].get_value()
            scale_at = scale_path(src.path)
            scale_var = variables.get(scale_at)
            kind = None
            if scale_var is not None:
                kind = "int8" if want.dtype == jnp.int8 else "fp8"
            in_dims = len(want.shape) - (0 if scale_var is None
                                         else len(scale_var.get_value().shape))
            host, scale = read_source(src, ckpt.read, available, hf_config, kind, in_dims)
            if tuple(host.shape) != tuple(want.shape):
                raise ParameterError(
                    "model", f"tensor(s) {', '.join(src.tensors)} in {model_dir!r} give shape "
                    f"{tuple(host.shape)}, but config.json implies {tuple(want.shape)}")
            host = host.astype(want.dtype, copy=False)
            values[src.path] = _place(host, _lookup(shardings, src.path))
            if scale is not None:
                values[scale_at] = _place(scale.astype(np.float32),
                                          _lookup(shardings, scale_at))
            if (input_at := input_scale_path(src.path)) in variables:
                values[input_at] = _place(read_input_scale(src, ckpt.read, available),
                                          _lookup(shardings, input_at))
            bar.update(len(src.tensors))
    if KV_SCALES in variables:  # an fp8 KV cache's scales: the checkpoint's or 1.0
        num_layers = variables[KV_SCALES].get_value().shape[0]
        values[KV_SCALES] = _place(kv_scales(ckpt.read, available, num_layers),
                                   _lookup(shardings, KV_SCALES))
    return _nest(values)


def _place(host: np.ndarray, sharding: NamedSharding) -> jax.Array:
    # Each device receives only its own slice of the host array.
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def _lookup(nested: dict, path: tuple) -> Any:
    for key in path:
        nested = nested[key]
    return nested


def _nest(flat: dict[tuple, Any]) -> dict:
    out: dict = {}
    for path, value in flat.items():
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out
