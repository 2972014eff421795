"""The offline LLM's engine core in a process of its own
(`LLM(..., engine_process=True)`): the same core process and messages as
`folio serve`'s (engine/core_process.py), driven synchronously.

This side keeps what LLMEngine's front half does: the tokenizer and the
input checks, each request's text, stop strings and RequestOutputs (the
OutputProcessor). The core only schedules, executes and updates, so the
text and the outputs are made on another CPU than the steps. CoreClient
answers what `LLM` asks of an engine (LLMEngine's names), nothing more.
"""

from __future__ import annotations

import itertools
from typing import Optional

from folio.config import FolioConfig
from folio.core.beam import BeamSearchParams
from folio.pooling_params import PoolingParams
from folio.engine.core_process import MOST_STEPS_AT_ONCE, CoreProcess, take_in_steps
from folio.engine.input_processor import InputProcessor
from folio.engine.output_processor import OutputProcessor
from folio.engine.protocol import EngineDeadError
from folio.lora_request import LoRARequest
from folio.outputs import RequestOutput
from folio.request import Request
from folio.sampling_params import SamplingParams
from folio.tokenizer import get_tokenizer


class CoreClient:
    def __init__(self, config: FolioConfig, core: Optional[CoreProcess] = None):
        self.config = config
        self.tokenizer = get_tokenizer(config.model)
        self.input_processor = InputProcessor(config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._core = core or CoreProcess()
        self._conn = self._core.conn
        self._requests: dict[str, Request] = {}      # this side's copy of each request
        self._waiting: list = []        # messages read while waiting for a reply
        # adds not sent yet: they go as one message before anything else is
        # sent or read, so the core's next step sees the whole batch that
        # LLM added (sent one by one, the core could step on the first while
        # the rest were on their way: batches, and so float products, that
        # differ from the in-process engine's)
        self._adds: list = []
        self._tokens = itertools.count()
        self.num_blocks = self._core.start_engine(config)["num_blocks"]

    # ---- requests -----------------------------------------------------------------
    def add_tokenized_request(self, request_id: str, prompt_text: Optional[str],
                              prompt_ids: list[int], params: SamplingParams,
                              arrival_time: Optional[float] = None, priority: int = 0,
                              validated: bool = False,
                              lora_request: Optional[LoRARequest] = None,
                              final_only: bool = False) -> Request:
        """As LLMEngine's; a request the core refuses (one larger than the whole
        KV cache, an adapter that does not load) raises its ValueError from the
        next `step` (LLM checks each adapter once before it adds)."""
        request = self.input_processor.make_request(request_id, prompt_ids, params,
                                                    arrival_time, priority, validated)
        self._add(request, prompt_text, params, lora_request, final_only)
        return request

    def add_beam_request(self, request_id: str, prompt_text: Optional[str],
                         prompt_ids: list[int], params: BeamSearchParams,
                         arrival_time: Optional[float] = None, priority: int = 0,
                         validated: bool = False,
                         lora_request: Optional[LoRARequest] = None) -> Request:
        ip = self.input_processor
        if not validated:
            ip.validate_beam(prompt_ids, params)
        request = ip.make_request(request_id, prompt_ids, ip.beam_sampling(params),
                                  arrival_time, priority, validated=True)
        self._add(request, prompt_text, params, lora_request, False)
        return request

    def add_pooling_request(self, request_id: str, prompt_text: Optional[str],
                            prompt_ids: list[int], params: PoolingParams,
                            arrival_time: Optional[float] = None, priority: int = 0,
                            validated: bool = False,
                            lora_request: Optional[LoRARequest] = None,
                            final_only: bool = False) -> Request:
        ip = self.input_processor
        if not validated:
            params = ip.resolve_pooling(prompt_ids, params)
        request = ip.make_pooling_request(request_id, prompt_ids, params, arrival_time, priority)
        self._add(request, prompt_text, params, lora_request, final_only)
        return request

    def _add(self, request: Request, prompt_text, params, lora, final_only: bool) -> None:
        self._requests[request.request_id] = request
        self.output_processor.add_request(request, prompt_text, final_only)
        self._adds.append((request.request_id, list(request.prompt_token_ids), params,
                           request.arrival_time, request.priority, lora))

    def abort_request(self, request_ids: list[str]) -> list[RequestOutput]:
        self._send(("abort", list(request_ids)))
        for rid in request_ids:
            self._requests.pop(rid, None)
        return self.output_processor.abort(request_ids)

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.states)

    def step(self) -> list[RequestOutput]:
        """The outputs of the core's next step, and of every step already
        waiting behind it (taken in as one: merge_steps)."""
        steps = [self._next()]
        while len(steps) < MOST_STEPS_AT_ONCE and (self._waiting or self._conn.poll()):
            if self._peek()[0] != "step":
                break
            steps.append(self._next())
        outputs, stopped = take_in_steps(steps, self._requests, self.output_processor)
        if stopped:
            self._send(("stop", stopped))
        return outputs

    def _next(self):
        """The next step message; a refused request raises its ValueError."""
        while True:
            msg = self._waiting.pop(0) if self._waiting else self._recv()
            if msg[0] == "step":
                return msg
            if msg[0] == "add_failed":
                self.output_processor.states.pop(msg[1], None)
                self._requests.pop(msg[1], None)
                raise ValueError(msg[2])

    def _peek(self):
        if not self._waiting:
            self._waiting.append(self._recv())
        return self._waiting[0]

    # ---- calls --------------------------------------------------------------------
    def check_lora(self, lora_request: LoRARequest) -> None:
        if self.config.lora is None:
            raise ValueError(f"LoRA adapter {lora_request.lora_name!r}: LoRA is not enabled "
                             "(LLM(enable_lora=True), folio serve --enable-lora)")
        self._call("check_lora", lora_request)

    def reset_prefix_cache(self) -> bool:
        return self._call("reset_prefix_cache")

    def _call(self, name: str, *args):
        """A call answered by the core; the messages before its reply wait for `step`."""
        token = next(self._tokens)
        self._send(("call", token, name, args))
        while True:
            msg = self._recv()
            if msg[0] == "reply" and msg[1] == token:
                _, _, ok, value = msg
                if not ok:
                    raise value
                return value
            self._waiting.append(msg)

    # ---- the pipe -----------------------------------------------------------------
    def _flush(self) -> None:
        if self._adds:
            adds, self._adds = self._adds, []
            self._write(("adds", adds))

    def _send(self, msg) -> None:
        self._flush()
        self._write(msg)

    def _write(self, msg) -> None:
        try:
            self._conn.send(msg)
        except (OSError, ValueError):
            raise EngineDeadError(f"the engine core process exited "
                                  f"({self._core.proc.exitcode})") from None

    def _recv(self):
        self._flush()
        try:
            msg = self._conn.recv()
        except (EOFError, OSError):
            raise EngineDeadError(f"the engine core process exited "
                                  f"({self._core.proc.exitcode})") from None
        if msg[0] == "dead":
            raise EngineDeadError(f"the engine core failed: {msg[1]}")
        return msg

    def shutdown(self) -> None:
        """The core told to stop and waited for; ended if it does not."""
        self._core.stop()
