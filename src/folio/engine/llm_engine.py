"""LLMEngine: add_request / step / abort. Owns the scheduler and the executor.

One step: schedule -> execute on the model -> update the scheduler (append,
stop checks, free blocks) -> detokenize and check stop strings.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

from folio.config import FolioConfig
from folio.engine.config_builder import build_config
from folio.core.beam import BeamSearchParams, BeamState
from folio.core.outputs import EngineCoreOutput
from folio.core.scheduler import Scheduler
from folio.engine.input_processor import InputProcessor, PromptType
from folio.engine.output_processor import OutputProcessor
from folio.engine.stats import StepStats
from folio.outputs import RequestOutput
from folio.pooling_params import PoolingParams
from folio.request import Request
from folio.lora_request import LoRARequest
from folio.sampling_params import SamplingParams
from folio.tokenizer import get_tokenizer
from folio.worker.executor import make_executor

logger = logging.getLogger("folio")


class LLMEngine:
    def __init__(self, config: FolioConfig, detokenize: bool = True):
        """`detokenize=False`: the engine core of another process's front end
        (engine/core_process.py), which keeps the text and the RequestOutputs
        itself: `core_step` only."""
        self.config = config
        self.tokenizer = get_tokenizer(config.model)
        self.executor = make_executor(config)
        self.num_blocks = self.executor.num_blocks
        self.scheduler = Scheduler(config.scheduler, self.num_blocks, config.cache.block_size,
                                   config.cache.enable_prefix_caching, kv_window(config))
        # --async-scheduling: one process, no speculative decoding;
        # (SchedulerOutput, its StepHandle) of the step handed over and not taken in
        self.scheduler.ahead = self.scheduler.ahead and hasattr(self.executor, "submit")
        self._in_flight = None
        # steps run, and the seconds from the first step of a busy spell to
        # the end of its last (core_step)
        self.num_steps, self.busy_seconds = 0, 0.0
        self._busy_from: Optional[float] = None
        self.input_processor = InputProcessor(config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer) if detokenize else None
        tokens = self.num_blocks * config.cache.block_size
        # (a window every layer has: a sequence holds only the blocks it spans)
        per_request = self.scheduler.most_blocks(config.max_model_len)
        logger.info("KV cache: %d blocks of %d tokens (%d tokens, %d requests of max_model_len "
                    "%d at once), dtype %s on %s", self.num_blocks, config.cache.block_size,
                    tokens, self.num_blocks // per_request, config.max_model_len,
                    config.kv_dtype, config.device)
        if self.executor.draft_bytes_per_block:
            logger.info("each block also holds the draft model's keys and values (%d of its "
                        "%d bytes)", self.executor.draft_bytes_per_block,
                        self.executor.bytes_per_block)
        if config.weight_dtype is not None:
            logger.info("linear weights stored as %s where the kernel serves",
                        config.weight_dtype)

    @classmethod
    def from_args(cls, model: Optional[str] = None, **kwargs) -> "LLMEngine":
        return cls(build_config(model, **kwargs))

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    arrival_time: Optional[float] = None, priority: int = 0) -> Request:
        text, ids = self.input_processor.tokenize(prompt)
        return self.add_tokenized_request(request_id, text, ids, params, arrival_time, priority)

    def add_tokenized_request(self, request_id: str, prompt_text: Optional[str],
                              prompt_ids: list[int], params: SamplingParams,
                              arrival_time: Optional[float] = None, priority: int = 0,
                              validated: bool = False,
                              lora_request: Optional[LoRARequest] = None,
                              final_only: bool = False) -> Request:
        """`validated`: the input processor already checked these ids and params.
        `lora_request`: the adapter it runs with (loaded and checked here).
        `final_only`: `step` returns its RequestOutput once, when it finishes."""
        if lora_request is not None:
            self.check_lora(lora_request)
        request = self.input_processor.make_request(request_id, prompt_ids, params,
                                                    arrival_time, priority, validated)
        request.lora = lora_request
        self.scheduler.add_request(request)
        if self.output_processor is not None:
            self.output_processor.add_request(request, prompt_text, final_only)
        return request

    def add_beam_request(self, request_id: str, prompt_text: Optional[str],
                         prompt_ids: list[int], params: BeamSearchParams,
                         arrival_time: Optional[float] = None, priority: int = 0,
                         validated: bool = False,
                         lora_request: Optional[LoRARequest] = None) -> Request:
        """A beam search: greedy steps that report each beam's top 2W logprobs."""
        if not validated:
            self.input_processor.validate_beam(prompt_ids, params)
        if lora_request is not None:
            self.check_lora(lora_request)
        sampling = self.input_processor.beam_sampling(params)
        request = self.input_processor.make_request(request_id, prompt_ids, sampling,
                                                    arrival_time, priority, validated=True)
        request.lora = lora_request
        max_len = min(len(prompt_ids) + params.max_tokens, self.config.max_model_len)
        request.beam = BeamState(params, len(prompt_ids), max_len)
        self.scheduler.add_request(request)
        if self.output_processor is not None:
            self.output_processor.add_request(request, prompt_text)
        return request

    def add_pooling_request(self, request_id: str, prompt_text: Optional[str],
                            prompt_ids: list[int], params: PoolingParams,
                            arrival_time: Optional[float] = None, priority: int = 0,
                            validated: bool = False,
                            lora_request: Optional[LoRARequest] = None,
                            final_only: bool = False) -> Request:
        """An embedding request: its prompt's final hidden states pooled into a
        vector (`params`, resolved against the model's own pooling here unless
        `validated`), nothing generated; it ends when its prompt is computed."""
        if not validated:
            params = self.input_processor.resolve_pooling(prompt_ids, params)
        if lora_request is not None:
            self.check_lora(lora_request)
        request = self.input_processor.make_pooling_request(request_id, prompt_ids, params,
                                                            arrival_time, priority)
        request.lora = lora_request
        self.scheduler.add_request(request)
        if self.output_processor is not None:
            self.output_processor.add_request(request, prompt_text, final_only)
        return request

    def abort_request(self, request_ids: list[str]) -> list[RequestOutput]:
        self.scheduler.abort_requests(request_ids)
        self._end_busy_spell()
        if self.output_processor is None:
            return []
        return self.output_processor.abort(request_ids)

    def step(self) -> list[RequestOutput]:
        """One step's RequestOutputs: `core_step`'s, detokenized and checked
        for stop strings (a sequence a stop string ended is ended in the
        scheduler too)."""
        core_outputs = self.core_step()
        if not core_outputs:
            return []
        outputs, stopped = self.output_processor.process(core_outputs)
        if stopped:
            self.stop_sequences(stopped)
        return outputs

    def stop_sequences(self, stopped: list[tuple[str, int]]) -> None:
        """(request id, sequence index) pairs a stop string ended: freed."""
        self.scheduler.stop_sequences(stopped)
        self._end_busy_spell()

    def core_step(self) -> list[EngineCoreOutput]:
        """What one step did to each request. Under --async-scheduling the next
        step is scheduled and handed to the runner before this one's results
        are taken in, while every request may run ahead; otherwise (or once
        one may not) the step in flight is finished first and steps are
        synchronous.

        Counted for the step rate (StepStats.num_steps, busy_seconds): the
        time from one step's start to the next one's while requests remain,
        so whatever the loop driving the engine does between steps (commands,
        outputs, messages) is in it; the idle time between busy spells is not."""
        start = time.perf_counter()
        if self._busy_from is not None:
            self.busy_seconds += start - self._busy_from
        self._busy_from = start
        try:
            return self._core_step()
        finally:
            self._end_busy_spell()

    def _end_busy_spell(self) -> None:
        """Once nothing is left to run (the last step, an abort, a stop string):
        the busy time counted to now."""
        if self._busy_from is not None and not self.has_unfinished_requests():
            self.busy_seconds += time.perf_counter() - self._busy_from
            self._busy_from = None

    def _core_step(self) -> list[EngineCoreOutput]:
        sched = self.scheduler
        if not sched.ahead or sched.num_not_ahead:
            outputs = self._finish_in_flight()
            so = sched.schedule()
            if so.is_empty and not so.finished_seq_ids:
                return outputs
            self.num_steps += 1
            return outputs + sched.update_from_output(so, self.executor.execute(so))
        if self._in_flight is None:
            self._in_flight = self._submit(sched.schedule())
            if self._in_flight is None:
                return []
        following = self._submit(sched.schedule())     # while the one before runs
        outputs = self._finish_in_flight()
        self._in_flight = following
        if following is not None and not sched.has_unfinished_requests():
            outputs += self._finish_in_flight()       # ran for requests now ended
        return outputs

    def _submit(self, so):
        if so.is_empty and not so.finished_seq_ids:
            return None
        self.num_steps += 1
        return so, self.executor.submit(so)

    def _finish_in_flight(self) -> list[EngineCoreOutput]:
        if self._in_flight is None:
            return []
        (so, handle), self._in_flight = self._in_flight, None
        return self.scheduler.update_from_output(so, handle.result())

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache; False (and nothing done) while requests hold blocks."""
        return self.scheduler.reset_prefix_cache()

    def step_stats(self) -> StepStats:
        """The scheduler's numbers after a step, as a message (engine thread only)."""
        sched = self.scheduler
        return StepStats(num_running=sched.num_running, num_waiting=sched.num_waiting,
                         kv_cache_usage=sched.kv.usage(), kv_cache_waste=sched.waste.last,
                         num_preemptions=sched.num_preemptions,
                         prefix_cache_queries=sched.prefix_cache_queries,
                         prefix_cache_hits=sched.prefix_cache_hits,
                         num_steps=self.num_steps, busy_seconds=self.busy_seconds,
                         **dict(zip(("spec_num_drafts", "spec_num_draft_tokens",
                                     "spec_num_accepted_tokens"), sched.spec_counts)))

    def check_lora(self, lora_request: LoRARequest) -> None:
        """The adapter loaded and checked against the model (ValueError)."""
        if self.config.lora is None:
            raise ValueError(f"LoRA adapter {lora_request.lora_name!r}: LoRA is not enabled "
                             "(LLM(enable_lora=True), folio serve --enable-lora)")
        self.executor.check_lora(lora_request)

    def check_kv_cache(self) -> None:
        """The KV cache must hold one sequence of max_model_len tokens: a smaller one
        would refuse the longest requests forever, so a server must not start on it
        (as in vLLM). The error says what to give instead."""
        config = self.config
        size, have, limit = config.cache.block_size, self.num_blocks, config.max_model_len
        # (a model whose every layer has a window holds only the blocks it spans)
        need = self.scheduler.most_blocks(limit)
        if have >= need:
            return
        # every executor keeps rank 0's runner in-process: its backend's layout
        # (and a draft model's share of each block)
        need_bytes = need * self.executor.bytes_per_block
        raise ValueError(
            f"the KV cache is too small: it holds {have * size} tokens ({have} x {size}-token "
            f"blocks), but one sequence of max_model_len={limit} tokens needs {need} blocks "
            f"({need_bytes} bytes): give --num-kv-blocks {need} or --kv-cache-memory-bytes "
            f"{need_bytes} or more, or a smaller --max-model-len")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    def shutdown(self) -> None:
        try:
            self._finish_in_flight()
        finally:
            self.executor.shutdown()


def kv_window(config) -> "int | None":
    """The window behind which a sequence's blocks are given back: every layer's
    (ModelConfig.kv_window), unless a draft model shares the blocks (its
    layers see every key)."""
    spec = config.scheduler.speculative
    if spec is not None and spec.method != "ngram":
        return None
    return config.model.kv_window
