"""The offline LLM class: the engine driven in a loop, without HTTP.

    from folio import LLM, SamplingParams
    llm = LLM()                                     # the default model
    out = llm.generate(["Hello"], SamplingParams(max_tokens=32))
"""

from __future__ import annotations

import itertools
from typing import Any, Optional, Sequence, Union

from folio.engine.config_builder import build_config
from folio.engine.input_processor import PromptType
from folio.engine.llm_engine import LLMEngine
from folio.logger import configure_logging
from folio.outputs import (EmbeddingRequestOutput, RequestOutput, ScoringOutput,
                           ScoringRequestOutput)
from folio.pooling_params import PoolingParams, sigmoid
from folio.core.beam import BeamSearchParams
from folio.lora_request import LoRARequest
from folio.sampling_params import SamplingParams

Messages = list[dict[str, Any]]


class LLM:
    def __init__(self, model: Optional[str] = None, *, dtype: str = "auto",
                 max_model_len: Optional[int] = None, block_size: int = 16,
                 kv_cache_memory_bytes: Union[int, str, None] = None,
                 num_kv_blocks: Optional[int] = None, max_num_seqs: int = 256,
                 max_num_batched_tokens: Optional[int] = None, seed: int = 0,
                 device: Optional[str] = None, tensor_parallel_size: int = 1,
                 max_logprobs: int = 20, enable_prefix_caching: bool = True,
                 enable_chunked_prefill: bool = True, long_prefill_token_threshold: int = 0,
                 scheduling_policy: str = "fcfs", distributed_executor_backend: str = "mp",
                 quantization: Optional[str] = None, attention_backend: Optional[str] = None,
                 gpu_memory_utilization: float = 0.9, enforce_eager: bool = False,
                 activation_quantization: str = "auto", kv_cache_dtype: str = "auto",
                 speculative_config: Union[None, str, dict] = None,
                 enable_lora: bool = False, max_loras: int = 1, max_lora_rank: int = 64,
                 max_cpu_loras: Optional[int] = None, pipeline_parallel_size: int = 1,
                 async_scheduling: bool = False, tokenizer: Optional[str] = None,
                 task: str = "auto", engine_process: bool = False):
        """vLLM's options (docs/offline.md); `engine_process`: the engine core
        (scheduler, model) in a process of its own, as `folio serve` runs it,
        the text and the outputs made in this one (engine/core_client.py)."""
        configure_logging()
        config = build_config(
            model, dtype=dtype, device=device, max_model_len=max_model_len,
            block_size=block_size, kv_cache_memory_bytes=kv_cache_memory_bytes,
            num_kv_blocks=num_kv_blocks, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            tensor_parallel_size=tensor_parallel_size, seed=seed, max_logprobs=max_logprobs,
            pipeline_parallel_size=pipeline_parallel_size,
            enable_prefix_caching=enable_prefix_caching,
            enable_chunked_prefill=enable_chunked_prefill,
            long_prefill_token_threshold=long_prefill_token_threshold,
            scheduling_policy=scheduling_policy,
            distributed_executor_backend=distributed_executor_backend,
            quantization=quantization, attention_backend=attention_backend,
            gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager,
            activation_quantization=activation_quantization, kv_cache_dtype=kv_cache_dtype,
            speculative_config=speculative_config, enable_lora=enable_lora,
            max_loras=max_loras, max_lora_rank=max_lora_rank, max_cpu_loras=max_cpu_loras,
            async_scheduling=async_scheduling, tokenizer=tokenizer, task=task)
        if engine_process:
            from folio.engine.core_client import CoreClient
            self.engine: "LLMEngine | CoreClient" = CoreClient(config)
        else:
            self.engine = LLMEngine(config)
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop tensor-parallel workers (a single-process engine has none) and
        the engine core's process (engine_process=True)."""
        self.engine.shutdown()

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (as vLLM's); False while requests are running."""
        return self.engine.reset_prefix_cache()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = True,
                 priority: Optional[Sequence[int]] = None,
                 lora_request: Union[LoRARequest, Sequence[Optional[LoRARequest]], None] = None
                 ) -> list[RequestOutput]:
        """`priority`: one value per prompt (lower runs first) under the priority
        scheduling policy. `lora_request`: the adapter of every prompt, or one
        per prompt (None: the base model)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        tokenized = [self.engine.input_processor.tokenize(p) for p in prompts]
        return self._run(tokenized, sampling_params, use_tqdm, priority, lora_request)

    def beam_search(self, prompts: Union[PromptType, Sequence[PromptType]],
                    params: "BeamSearchParams", use_tqdm: bool = True,
                    lora_request: Union[LoRARequest, Sequence[Optional[LoRARequest]], None] = None
                    ) -> list[RequestOutput]:
        """Per prompt, its `beam_width` best beams (token ids, text, cumulative
        logprob and length-normalised `score`), best first; `lora_request` as
        in `generate`."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        tokenized = [self.engine.input_processor.tokenize(p) for p in prompts]
        for _, ids in tokenized:      # every prompt checked once, before any is added
            self.engine.input_processor.validate_beam(ids, params)
        loras = self._loras(lora_request, len(tokenized))
        order = []
        try:
            for (text, ids), lora in zip(tokenized, loras):
                rid = str(next(self._ids))
                self.engine.add_beam_request(rid, text, ids, params, validated=True,
                                             lora_request=lora)
                order.append(rid)
        except ValueError:
            self.engine.abort_request(order)
            raise
        return self._drain(order, use_tqdm and len(order) > 1)

    def embed(self, prompts: Union[PromptType, Sequence[PromptType]],
              pooling_params: Union[PoolingParams, Sequence[PoolingParams], None] = None,
              use_tqdm: bool = True, priority: Optional[Sequence[int]] = None,
              lora_request: Union[LoRARequest, Sequence[Optional[LoRARequest]], None] = None
              ) -> list[EmbeddingRequestOutput]:
        """Per prompt, its embedding (`outputs.embedding`): the final hidden
        states of its tokens pooled as `pooling_params` say (one for all, or
        one per prompt; unset fields: the model's own pooling, from its
        sentence-transformers files, else the last token's, normalized).
        Scheduled as any prompt (chunked under the token budget, beside other
        requests), nothing generated; every prompt is checked before any is
        added."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        tokenized = [self.engine.input_processor.tokenize(p) for p in prompts]
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            pooling_params = [pooling_params or PoolingParams()] * len(tokenized)
        if len(pooling_params) != len(tokenized):
            raise ValueError(f"{len(pooling_params)} pooling params for {len(tokenized)} prompts")
        if priority is not None and len(priority) != len(tokenized):
            raise ValueError(f"{len(priority)} priorities for {len(tokenized)} prompts")
        resolved = [self.engine.input_processor.resolve_pooling(ids, params)
                    for (_, ids), params in zip(tokenized, pooling_params)]
        return self._add_all(self.engine.add_pooling_request, tokenized, resolved, priority,
                             self._loras(lora_request, len(tokenized)), use_tqdm)

    def score(self, data_1: Union[str, Sequence[str]], data_2: Union[str, Sequence[str]],
              use_tqdm: bool = True) -> list[ScoringRequestOutput]:
        """A cross-encoder's score of each pair (vLLM's LLM.score): one text
        against each of `data_2` (1 -> N), or `data_1[i]` against `data_2[i]`
        (N -> N); each pair one input as the tokenizer joins two texts, its
        score the sigmoid of the model's one logit (sentence-transformers'
        CrossEncoder's default)."""
        first = [data_1] if isinstance(data_1, str) else list(data_1)
        second = [data_2] if isinstance(data_2, str) else list(data_2)
        if len(first) == 1:
            first = first * len(second)
        if len(first) != len(second) or not second:
            raise ValueError(f"score takes one text or as many as the others: got "
                             f"{len(first)} and {len(second)}")
        model = self.engine.input_processor.config.model
        if model.num_labels != 1:
            raise ValueError(f"{model.model} is not a cross-encoder with one label: it gives "
                             "no scores")
        tok = self.engine.tokenizer
        pairs = [tok.encode_pair(a, b) for a, b in zip(first, second)]
        outs = self.embed([{"prompt_token_ids": ids} for ids, _ in pairs],
                          [PoolingParams(pooling="classify", second_text_start=start)
                           for _, start in pairs], use_tqdm=use_tqdm)
        return [ScoringRequestOutput(o.request_id, o.prompt_token_ids,
                                     ScoringOutput(sigmoid(o.outputs.embedding[0])
                                                   if o.outputs.embedding else float("nan")),
                                     error=o.error)
                for o in outs]

    def chat(self, messages: Union[Messages, Sequence[Messages]],
             sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
             use_tqdm: bool = True, chat_template: Optional[str] = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: Optional[dict[str, Any]] = None) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        kwargs = dict(chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                      continue_final_message=continue_final_message, **(chat_template_kwargs or {}))
        tokenized = []
        for conv in conversations:
            text = tok.apply_chat_template(conv, **kwargs)
            tokenized.append((text, tok.encode_chat(conv, **kwargs)))
        return self._run(tokenized, sampling_params, use_tqdm)

    def _run(self, tokenized, sampling_params, use_tqdm: bool,
             priority: Optional[Sequence[int]] = None, lora_request=None
             ) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(tokenized)
        if len(sampling_params) != len(tokenized):
            raise ValueError(f"{len(sampling_params)} sampling params for {len(tokenized)} prompts")
        # Validate everything before adding anything: a bad prompt takes no block
        # and leaves the rest of the batch untouched.
        for (_, ids), params in zip(tokenized, sampling_params):
            self.engine.input_processor.validate(ids, params)
        if priority is not None and len(priority) != len(tokenized):
            raise ValueError(f"{len(priority)} priorities for {len(tokenized)} prompts")
        return self._add_all(self.engine.add_tokenized_request, tokenized, sampling_params,
                             priority, self._loras(lora_request, len(tokenized)), use_tqdm)

    def _add_all(self, add, tokenized, params, priority, loras, use_tqdm: bool) -> list:
        """Each validated prompt added by `add` (the engine's add_tokenized_request
        or add_pooling_request), all or none: a ValueError while adding (e.g. a
        request larger than the whole cache) aborts those already added. Then
        the engine stepped until every one has finished, in input order."""
        order = []
        try:
            for i, ((text, ids), p) in enumerate(zip(tokenized, params)):
                rid = str(next(self._ids))
                add(rid, text, ids, p, priority=priority[i] if priority else 0, validated=True,
                    lora_request=loras[i], final_only=True)
                order.append(rid)
        except ValueError:
            self.engine.abort_request(order)
            raise
        return self._drain(order, use_tqdm and len(order) > 1)

    def _loras(self, lora_request, n: int) -> list[Optional[LoRARequest]]:
        """One adapter per prompt (or None), each checked before any is added."""
        loras = (list(lora_request) if isinstance(lora_request, (list, tuple))
                 else [lora_request] * n)
        if len(loras) != n:
            raise ValueError(f"{len(loras)} LoRA requests for {n} prompts")
        for lora in dict.fromkeys(x for x in loras if x is not None):
            self.engine.check_lora(lora)
        return loras

    def _drain(self, order: list[str], progress: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = None
        if progress:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(order), desc="Processed prompts", dynamic_ncols=True)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            self.engine.abort_request([r for r in order if r not in finished])
            raise
        finally:
            if bar is not None:
                bar.close()
        return [finished[r] for r in order]
