"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`, as in vLLM."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import msgspec
from tqdm.auto import tqdm

from jaxllm.config import EngineArgs
from jaxllm.engine.input_processor import PromptType
from jaxllm.engine.llm_engine import LLMEngine
from jaxllm.entrypoints.chat_content import text_messages
from jaxllm.entrypoints.openai.tools import check_tools, template_messages
from jaxllm.entrypoints.score_utils import (
    check_pairs,
    cross_encoder_pairs,
    cross_encoder_scores,
    is_cross_encoder,
    pair_scores,
)
from jaxllm.lora.request import LoRARequest
from jaxllm.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringRequestOutput,
)
from jaxllm.sampling_params import PoolingParams, RequestOutputKind, SamplingParams

Messages = list[dict[str, Any]]


class LLM:
    """Offline batch inference. Keyword arguments are vLLM's EngineArgs names."""

    def __init__(self, model: str | None = None, **kwargs: Any):
        unknown = set(kwargs) - EngineArgs.field_names()
        if unknown:
            raise TypeError(f"LLM() got unexpected engine arguments: {sorted(unknown)}")
        from jaxllm.engine.core_client import multiprocess_default

        self.llm_engine = LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs),
                                                     multiprocess=multiprocess_default())
        self._counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The model's generation_config.json defaults, as vLLM applies them."""
        return SamplingParams(**self.llm_engine.model_config.generation_defaults)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: list[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """`lora_request`: one adapter for every prompt, or one (or None) per prompt."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or self.get_default_sampling_params()
        return self._run(list(prompts), params, use_tqdm, priority, lora_request)

    def chat(self, messages: Messages | Sequence[Messages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None,
             tools: list[dict[str, Any]] | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
             ) -> list[RequestOutput]:
        """`tools` (OpenAI's tool definitions) are rendered by the chat template, as
        vLLM's LLM.chat does; the output is the model's text, not parsed into calls.
        `lora_request`: as in `generate`."""
        batch = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        kwargs = dict(chat_template_kwargs or {})
        if tools:
            kwargs["tools"] = check_tools(tools)
        ip = self.llm_engine.input_processor
        tok = self.get_tokenizer()
        prompts: list[PromptType] = []
        for b, conv in enumerate(batch):
            field = "messages" if len(batch) == 1 and batch[0] is messages else f"messages[{b}]"
            text = ip.apply_chat_template(
                template_messages(text_messages(list(conv), field)), chat_template,
                add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message, **kwargs)
            # The template already carries any special tokens the model wants.
            ids = tok(text, add_special_tokens=False).input_ids
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        params = sampling_params or self.get_default_sampling_params()
        return self._run(prompts, params, use_tqdm, None, lora_request)

    def encode(self, prompts: PromptType | Sequence[PromptType],
               pooling_params: PoolingParams | None = None, use_tqdm: bool = True, *,
               pooling_task: str | None = None) -> list[PoolingRequestOutput]:
        """Pooled outputs of `pooling_task` ("embed", "classify" or "score"; None: the
        params' task, else the model's first)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = pooling_params or PoolingParams()
        if pooling_task is not None:
            params = msgspec.structs.replace(params, task=pooling_task)
        return self._run(list(prompts), params, use_tqdm, None)

    def embed(self, prompts: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | None = None,
              use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        return self.encode(prompts, pooling_params, use_tqdm, pooling_task="embed")

    def classify(self, prompts: PromptType | Sequence[PromptType], *, use_tqdm: bool = True,
                 pooling_params: PoolingParams | None = None
                 ) -> list[ClassificationRequestOutput]:
        """A cross-encoder's class probabilities of each prompt, as vLLM's `LLM.classify`."""
        return [ClassificationRequestOutput(o.request_id, o.prompt_token_ids,
                                            ClassificationOutput(o.outputs.data))
                for o in self.encode(prompts, pooling_params, use_tqdm, pooling_task="classify")]

    def score(self, data_1: PromptType | Sequence[PromptType],
              data_2: PromptType | Sequence[PromptType], *, use_tqdm: bool = True,
              pooling_params: PoolingParams | None = None) -> list[ScoringRequestOutput]:
        """vLLM's `LLM.score`, the pairs 1:1, 1:N (`data_1`'s one text against each of
        `data_2`) or N:N (in order). A cross-encoder runs each pair of texts through the
        model as one text-pair encoding (the score: its logit's activation, a sigmoid
        unless the checkpoint names another); an embedding model embeds each text once
        and scores the cosine similarity of each pair's embeddings."""
        first = [data_1] if isinstance(data_1, (str, dict)) else list(data_1)
        second = [data_2] if isinstance(data_2, (str, dict)) else list(data_2)
        names = ("data_1", "data_2")
        check_pairs(len(first), len(second), names)
        mc = self.llm_engine.model_config
        if is_cross_encoder(mc.supported_tasks):
            pairs = cross_encoder_pairs(self.get_tokenizer(), first, second, names,
                                        mc.max_model_len)
            base = pooling_params or PoolingParams()
            params = [msgspec.structs.replace(base, task="score", token_type_start=start)
                      for _, start in pairs]
            outs = self._run([{"prompt_token_ids": ids} for ids, _ in pairs], params,
                             use_tqdm, None)
            return cross_encoder_scores(outs)
        embedded = self.embed(first + second, pooling_params, use_tqdm)
        return pair_scores(embedded[:len(first)], embedded[len(first):],
                           getattr(self.get_tokenizer(), "pad_token_id", None))

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()

    def _run(self, prompts: list[PromptType], params: Any, use_tqdm: bool,
             priority: list[int] | None, lora: Any = None) -> list[Any]:
        if isinstance(params, Sequence) and len(params) != len(prompts):
            raise ValueError(f"sampling_params: got {len(params)} for {len(prompts)} prompts")
        if isinstance(lora, Sequence) and len(lora) != len(prompts):
            raise ValueError(f"lora_request: got {len(lora)} for {len(prompts)} prompts")
        engine = self.llm_engine
        ids: list[str] = []
        try:
            for i, prompt in enumerate(prompts):
                p = params[i] if isinstance(params, Sequence) else params
                if isinstance(p, SamplingParams):
                    p = msgspec.structs.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
                rid = str(next(self._counter))
                engine.add_request(rid, prompt, p, priority=priority[i] if priority else 0,
                                   lora_request=lora[i] if isinstance(lora, Sequence) else lora)
                ids.append(rid)
        except Exception:
            engine.abort_request(ids)  # all or nothing, as vLLM does
            raise
        results: dict[str, Any] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm,
                   dynamic_ncols=True)
        gen_tokens = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    results[out.request_id] = out
                    bar.update(1)
                    if isinstance(out, RequestOutput):
                        gen_tokens += sum(len(c.token_ids) for c in out.outputs)
                        rate = gen_tokens / max(bar.format_dict["elapsed"], 1e-9)
                        bar.set_postfix_str(f"output {rate:.1f} tok/s", refresh=False)
        bar.close()
        return [results[i] for i in ids]

