"""Engine configuration: vLLM's EngineArgs names, split into the configs each layer reads."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from jaxllm.cache_config import CacheConfig
from jaxllm.distributed.multihost import DistributedSpec, check_engine_host, resolve_distributed
from jaxllm.errors import ParameterError
from jaxllm.lora.config import LoRAConfig
from jaxllm.models.eagle_config import read_eagle_head
from jaxllm.pooler_config import (
    PoolerConfig,
    classifier_pooler_config,
    load_pooler_config,
    supported_tasks,
)
from jaxllm.quant_config import resolve_quantization
from jaxllm.spec_decode.config import MODEL_METHODS, SpeculativeConfig

_DTYPES = ("auto", "float32", "bfloat16", "float16")


def default_model_path() -> str:
    """The embedded demo checkpoint (used when no model is named)."""
    return os.path.join(os.path.dirname(__file__), "assets", "demo-model")


def compilation_cache_dir(path: str | None = None) -> str:
    """Where the compilation caches live: `path`, else `JAXLLM_CACHE_DIR`, else
    `~/.cache/jaxllm/xla` (under `XDG_CACHE_HOME` when set)."""
    return path or os.environ.get("JAXLLM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "jaxllm", "xla")


def precompile_default() -> bool:
    """Whether an engine not told otherwise precompiles: JAXLLM_PRECOMPILE, on unless "0"."""
    return os.environ.get("JAXLLM_PRECOMPILE", "1") != "0"


@dataclass
class ModelConfig:
    model: str
    tokenizer: str
    dtype: str  # resolved: float32 | bfloat16 | float16
    max_model_len: int
    seed: int
    skip_tokenizer_init: bool
    load_format: str
    served_model_name: str
    hf_config: Any  # transformers.PretrainedConfig
    eos_token_ids: list[int] = field(default_factory=list)
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    # An encoder (BERT, RoBERTa, their cross-encoders) runs whole prompts without a KV
    # cache and only pools.
    is_encoder: bool = False
    # What the engine serves, vLLM's names: "generate" and/or "embed" (`runner`); a
    # cross-encoder's "classify" and "score".
    supported_tasks: tuple[str, ...] = ("generate", "embed")
    pooler_config: PoolerConfig = field(default_factory=lambda: PoolerConfig("LAST", True))
    quantization: str | None = None  # resolved: None | "fp8" | "fp8_static" | "int8"
    kv_cache_dtype: str = "auto"
    # A multimodal checkpoint served as its language model (models/multimodal.py): its
    # architecture; `hf_config` is then the text config and the loader reads the
    # checkpoint's tensors under the text model's names.
    checkpoint_architecture: str | None = None

    @property
    def architecture(self) -> str:
        return (getattr(self.hf_config, "architectures", None) or ["?"])[0]

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)


class PlainHFConfig:
    """A transformers config's attributes without transformers.

    The engine core process reads the model's config by attribute only; this
    copy (from `PretrainedConfig.to_dict()`, which holds every attribute after
    transformers' own defaults and normalization) unpickles without importing
    transformers, or PyTorch, which transformers imports wherever it is installed.
    """

    def __init__(self, attributes: dict[str, Any]):
        self.__dict__.update(attributes)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __repr__(self) -> str:
        return f"PlainHFConfig({self.__dict__!r})"


def portable_config(config: EngineConfig) -> EngineConfig:
    """`config` with its model config made picklable without transformers."""
    def plain(mc: ModelConfig | None) -> ModelConfig | None:
        hf = mc and mc.hf_config
        if hf is None or isinstance(hf, PlainHFConfig) or not hasattr(hf, "to_dict"):
            return mc
        return dataclasses.replace(mc, hf_config=PlainHFConfig(hf.to_dict()))

    return dataclasses.replace(config, model_config=plain(config.model_config),
                               draft_model_config=plain(config.draft_model_config))


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"  # fcfs | priority
    # A prompt chunk longer than this is cut even when budget remains (0 = off).
    long_prefill_token_threshold: int = 0


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    # Engine cores, each a full replica on its own `tensor_parallel_size` devices.
    data_parallel_size: int = 1
    # Which of them this core is (set per core process: engine/dp_client.py).
    data_parallel_rank: int = 0
    # A multi-host engine's job (distributed/multihost.py); None: one process.
    distributed: DistributedSpec | None = None


@dataclass
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    attention_backend: str = "auto"
    # Run the Pallas attention body in Pallas interpret mode (CPU testing).
    attention_interpret: bool = False
    # The MLP's gate/up projection: "auto" | "xla" | "pallas_gpu_mosaic" (jaxllm/layers/mlp.py).
    mlp_backend: str = "auto"
    mlp_interpret: bool = False  # the Mosaic GPU kernel in interpret mode (CPU testing)
    compilation_cache_dir: str | None = None
    token_buckets: list[int] | None = None
    request_buckets: list[int] | None = None
    precompile: bool = True
    # Dispatch step N+1 before step N's sampled tokens reach the host.
    async_scheduling: bool = True
    speculative_config: SpeculativeConfig | None = None
    # The checked draft model (draft_model) or head (eagle, eagle3) of speculative decoding.
    draft_model_config: ModelConfig | None = None
    eagle_head: Any = None  # models/eagle_config.EagleHeadSpec
    lora_config: LoRAConfig | None = None  # None: LoRA disabled
    reasoning_parser: str | None = None  # jaxllm/reasoning.py: grammars wait out the thinking


@dataclass
class EngineArgs:
    """Flat engine arguments, named as vLLM names them."""

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    quantization: str | None = None  # None (the checkpoint's) | "fp8" | "int8": quant_config
    kv_cache_dtype: str = "auto"  # "auto" = the model dtype, or "fp8"
    max_model_len: int | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    seed: int = 0
    # vLLM's runner: "auto" | "generate" | "pooling" (`task`: its older name, "auto" |
    # "generate" | "embed"). A decoder on "auto" serves both; an encoder only pools.
    runner: str = "auto"
    task: str = "auto"
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    skip_tokenizer_init: bool = False
    load_format: str = "auto"
    hbm_utilization: float = 0.9
    gpu_memory_utilization: float | None = None  # vLLM's name for hbm_utilization
    # The KV cache's capacity (cache_config.py): in blocks of every layer, or vLLM's
    # override, the pool's block ids (with KV cache groups, a page per layer of a group).
    num_kv_blocks: int | None = None
    num_gpu_blocks_override: int | None = None
    kv_cache_bytes: int | None = None
    served_model_name: str | None = None
    scheduling_policy: str = "fcfs"
    long_prefill_token_threshold: int = 0
    attention_backend: str = "auto"
    # The Pallas attention body in interpret mode (CPU tests of pallas_tpu | pallas_gpu).
    attention_interpret: bool = False
    # The MLP's gate/up projection with SiLU·mul: "auto" (the fused Mosaic GPU kernel on
    # Hopper for large steps), "xla", or "pallas_gpu_mosaic" (the kernel wherever it fits;
    # with mlp_interpret=True in Mosaic GPU interpret mode, on any host).
    mlp_backend: str = "auto"
    mlp_interpret: bool = False
    compilation_cache_dir: str | None = None
    token_buckets: list[int] | None = None
    request_buckets: list[int] | None = None
    # Compile every bucket's programs at start-up, so that serving never compiles. None:
    # JAXLLM_PRECOMPILE (default on; "0" compiles each program when first used).
    precompile: bool | None = None
    async_scheduling: bool = True
    # vLLM's speculative_config: a dict (or its JSON text) of SpeculativeConfig's fields.
    speculative_config: dict[str, Any] | str | None = None
    trust_remote_code: bool = False  # accepted for vLLM compatibility; never executes code
    disable_log_stats: bool = True
    enforce_eager: bool = False  # accepted for vLLM compatibility (no eager mode in JAX)
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    # vLLM's --reasoning-parser (jaxllm/reasoning.py): the chat server splits the thinking
    # from the answer, and a grammar holds only the answer.
    reasoning_parser: str | None = None
    # A multi-host engine (distributed/multihost.py; else the JAX_* environment).
    distributed_coordinator_address: str | None = None
    distributed_num_processes: int | None = None
    distributed_process_id: int | None = None

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    def distributed_spec(self) -> DistributedSpec | None:
        """The multi-host job these arguments (or the environment) name, if any."""
        return resolve_distributed(self.distributed_coordinator_address,
                                   self.distributed_num_processes, self.distributed_process_id)

    def create_engine_config(self) -> EngineConfig:
        distributed = self.distributed_spec()
        check_engine_host(distributed, self.data_parallel_size)
        model_config = self._model_config()
        max_len = model_config.max_model_len
        max_batched = self.max_num_batched_tokens or max(2048, min(max_len, 8192))
        if not self.enable_chunked_prefill or model_config.is_encoder:
            if model_config.is_encoder and self.max_num_batched_tokens \
                    and self.max_num_batched_tokens < max_len:
                # An encoder runs a prompt in one step: a step must hold the longest.
                raise ParameterError("max_num_batched_tokens",
                                     f"{max_batched} is less than max_model_len={max_len}; "
                                     "an encoder model runs each prompt whole, in one step")
            max_batched = max(max_batched, max_len)
        if self.max_num_seqs < 1:
            raise ParameterError("max_num_seqs", f"must be at least 1, got {self.max_num_seqs}")
        if max_batched < 1:
            raise ParameterError("max_num_batched_tokens", f"must be at least 1, got {max_batched}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ParameterError("block_size", f"must be a power of two, got {self.block_size}")
        hbm = self.gpu_memory_utilization or self.hbm_utilization
        if not 0.0 < hbm <= 1.0:
            raise ParameterError("hbm_utilization", f"must be in (0, 1], got {hbm}")
        from jaxllm.layers.mlp import MLP_BACKENDS

        if self.mlp_backend not in MLP_BACKENDS:
            raise ParameterError("mlp_backend",
                                 f"must be one of {MLP_BACKENDS}, got {self.mlp_backend!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ParameterError("scheduling_policy",
                                 f"must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.tensor_parallel_size < 1:
            raise ParameterError("tensor_parallel_size",
                                 f"must be at least 1, got {self.tensor_parallel_size}")
        if self.data_parallel_size < 1:
            raise ParameterError("data_parallel_size",
                                 f"must be at least 1, got {self.data_parallel_size}")
        lora = LoRAConfig.from_args(self, model_config.is_encoder)
        if self.reasoning_parser is not None:
            from jaxllm.reasoning import get_reasoning_format

            get_reasoning_format(self.reasoning_parser)
        spec = SpeculativeConfig.from_dict(self.speculative_config)
        return EngineConfig(
            model_config=model_config, lora_config=lora, reasoning_parser=self.reasoning_parser,
            cache_config=CacheConfig.from_args(self, hbm, model_config.is_encoder),
            scheduler_config=SchedulerConfig(
                max_num_seqs=self.max_num_seqs, max_num_batched_tokens=max_batched,
                max_model_len=max_len,
                enable_chunked_prefill=self.enable_chunked_prefill and not model_config.is_encoder,
                policy=self.scheduling_policy,
                long_prefill_token_threshold=self.long_prefill_token_threshold),
            parallel_config=ParallelConfig(self.tensor_parallel_size, self.data_parallel_size,
                                           distributed=distributed),
            attention_backend=self.attention_backend,
            attention_interpret=self.attention_interpret,
            mlp_backend=self.mlp_backend, mlp_interpret=self.mlp_interpret,
            compilation_cache_dir=self.compilation_cache_dir,
            token_buckets=self.token_buckets, request_buckets=self.request_buckets,
            precompile=precompile_default() if self.precompile is None else self.precompile,
            async_scheduling=self.async_scheduling,
            speculative_config=spec,
            draft_model_config=self._draft_model_config(spec, model_config),
            eagle_head=read_eagle_head(spec, model_config.hf_config, self.tensor_parallel_size))

    def _draft_model_config(self, spec: SpeculativeConfig | None,
                            target: ModelConfig) -> ModelConfig | None:
        """The draft model's config, checked against the target's (dtype, context, vocabulary)."""
        if spec is None or spec.method not in MODEL_METHODS:
            return None
        args = EngineArgs(model=spec.model, dtype=target.dtype, seed=self.seed,
                          max_model_len=target.max_model_len, load_format=self.load_format,
                          skip_tokenizer_init=True)
        try:
            draft = args._model_config()
        except ParameterError as e:
            raise ParameterError("speculative_config.model",
                                 f"draft model {spec.model!r}: {e.field}: {e.message}") from e
        if draft.is_encoder:
            raise ParameterError("speculative_config.model",
                                 f"{spec.model!r} is an encoder; a draft model must generate")
        if draft.vocab_size != target.vocab_size:
            raise ParameterError("speculative_config.model",
                                 f"the draft's vocabulary ({draft.vocab_size}) differs from the "
                                 f"target's ({target.vocab_size}); they must share a tokenizer")
        return draft

    def _model_config(self) -> ModelConfig:
        from transformers import AutoConfig

        model = self.model or default_model_path()
        if not os.path.isdir(model):
            raise ParameterError("model", f"no model directory at {model!r} "
                                 "(jaxllm loads local Hugging Face checkpoints)")
        cfg_path = os.path.join(model, "config.json")
        if not os.path.isfile(cfg_path):
            raise ParameterError("model", f"{model!r} has no config.json")
        try:
            with open(cfg_path) as f:
                raw = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ParameterError("model", f"config.json in {model!r} is not valid JSON: {e}") from e
        from jaxllm.models.multimodal import config_keys, text_model_of

        for key in config_keys(raw):
            if key not in raw:
                raise ParameterError(f"config.json:{key}", f"missing in {cfg_path}")
        try:
            hf_config = AutoConfig.from_pretrained(model)
        except Exception as e:  # transformers raises many types for bad configs
            raise ParameterError("model", f"transformers cannot read {cfg_path}: {e}") from e
        hf_config, checkpoint_architecture = text_model_of(hf_config, model)
        if self.dtype not in _DTYPES:
            raise ParameterError("dtype", f"must be one of {_DTYPES}, got {self.dtype!r}")
        dtype = self.dtype
        if dtype == "auto":
            dtype = str(getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
                        or "float32").replace("torch.", "")
            if dtype not in _DTYPES:
                dtype = "float32"
        from jaxllm.models import registry

        arch = (getattr(hf_config, "architectures", None) or ["?"])[0]
        is_encoder = registry.is_encoder_architecture(arch)
        labels = registry.classifier_labels(arch, hf_config)  # None: not a cross-encoder
        tasks = supported_tasks(self.runner, self.task, is_encoder, labels)
        pooler = (load_pooler_config(model, is_encoder) if labels is None
                  else classifier_pooler_config(hf_config, labels))
        if not is_encoder and pooler.pooling_type != "LAST":
            # The decoder runner pools the last token only (worker/model_runner.py).
            if tasks == ("embed",):
                raise ParameterError("1_Pooling/config.json", f"{pooler.pooling_type} pooling "
                                     "of a decoder model is not supported; supported: last token")
            tasks = tuple(t for t in tasks if t != "embed")
        limit = registry.usable_positions(arch, hf_config) or int(
            getattr(hf_config, "max_position_embeddings", 0) or 2048)
        # sentence-transformers caps its input (max_seq_length); vLLM takes that cap too.
        default_len = min(limit, pooler.max_seq_length or limit)
        max_len = self.max_model_len or default_len
        if max_len < 1:
            raise ParameterError("max_model_len", f"must be at least 1, got {max_len}")
        if max_len > limit and os.environ.get("JAXLLM_ALLOW_LONG_MAX_MODEL_LEN") != "1":
            # As vLLM: positions past the trained range give garbage, not an error.
            raise ParameterError("max_model_len", f"{max_len} exceeds the positions the "
                                 f"model holds ({limit}, from max_position_embeddings); set "
                                 "JAXLLM_ALLOW_LONG_MAX_MODEL_LEN=1 to allow it")
        if self.load_format not in ("auto", "safetensors", "orbax", "dummy"):
            raise ParameterError("load_format", "must be 'auto', 'safetensors', 'orbax' or "
                                 f"'dummy', got {self.load_format!r}")
        quant = resolve_quantization(self.quantization, self.kv_cache_dtype, raw, model)
        eos = getattr(hf_config, "eos_token_id", None)
        gen_defaults: dict[str, Any] = {}
        gen_path = os.path.join(model, "generation_config.json")
        if os.path.isfile(gen_path):
            with open(gen_path) as f:
                gen = json.load(f)
            eos = gen.get("eos_token_id", eos)
            gen_defaults = {k: gen[k] for k in ("temperature", "top_p", "top_k",
                                                 "repetition_penalty") if k in gen}
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return ModelConfig(
            model=model, tokenizer=self.tokenizer or model, dtype=dtype, max_model_len=max_len,
            seed=self.seed, skip_tokenizer_init=self.skip_tokenizer_init,
            load_format=self.load_format, served_model_name=self.served_model_name or model,
            hf_config=hf_config, eos_token_ids=eos_ids, generation_defaults=gen_defaults,
            is_encoder=is_encoder, supported_tasks=tasks, pooler_config=pooler,
            checkpoint_architecture=checkpoint_architecture, **quant)
