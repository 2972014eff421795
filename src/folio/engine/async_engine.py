"""The step loop behind asyncio.

The engine steps in its own thread. Requests and aborts reach it through a
command queue; outputs go back to each request's _Outputs on its event loop
with `loop.call_soon_threadsafe` (one wake-up a loop a step). Outputs are
cumulative, so a stream that fell behind takes only the newest (_Outputs).
Only this thread touches the scheduler (`folio serve --no-engine-process`;
by default the core runs in a process of its own behind the same interface,
engine/mp_client.py): AsyncLLMEngine is the EngineClient
(`engine/protocol.py`) the server holds, and after each step it sends a
StepStats message, never itself, to the metrics callback.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Callable, Optional

from folio.config import ModelConfig
from folio.core.beam import BeamSearchParams
from folio.pooling_params import PoolingParams
from folio.engine.llm_engine import LLMEngine
from folio.engine.protocol import (EngineClient, EngineDeadError, Params, RequestFailedError,
                                   StepCallback, ValidatedPrompt, engine_error)
from folio.lora_request import LoRARequest
from folio.outputs import RequestOutput

if TYPE_CHECKING:
    from folio.tokenizer import Tokenizer

__all__ = ["AsyncLLMEngine", "EngineDeadError", "RequestFailedError"]

logger = logging.getLogger("folio")


@dataclass
class _Add:
    request_id: str
    prompt: Optional[str]
    prompt_ids: list[int]
    params: Params
    arrival_time: float
    priority: int
    lora: Optional[LoRARequest] = None


def _answer(loop: asyncio.AbstractEventLoop, done: asyncio.Future, setter, value) -> None:
    """A future of another thread's loop settled there, unless it already is
    (its caller left) or that loop has closed."""
    def settle() -> None:
        if not done.done():
            setter(value)
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(settle)


class _Outputs:
    """One request's outputs, on its event loop (not thread-safe: the engine
    thread puts through `call_soon_threadsafe`).

    `next` gives the newest output waiting, skipping those before it: they
    are cumulative, so a consumer that fell behind the engine (a loaded
    server, hundreds of streams and a step every few ms) sends their tokens
    as one chunk, as vLLM merges a slow stream's deltas, and does a chunk's
    work once for them all. The finished output and an error are never
    skipped, and the outputs before an error are given before it."""

    __slots__ = ("items", "waiter")

    def __init__(self):
        self.items: collections.deque = collections.deque()
        self.waiter: Optional[asyncio.Future] = None

    def put(self, item) -> None:
        self.items.append(item)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def next(self):
        items = self.items
        while not items:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        item = items.popleft()
        while items and isinstance(items[0], RequestOutput) and isinstance(item, RequestOutput):
            item = items.popleft()          # (nothing follows a finished one)
        return item


def _put_all(items) -> None:
    for outputs, item in items:
        outputs.put(item)


class AsyncLLMEngine(EngineClient):
    def __init__(self, engine: LLMEngine, on_step: Optional[StepCallback] = None,
                 on_dead: Optional[Callable[[BaseException], None]] = None):
        self.engine = engine
        self.on_step = on_step            # called in the engine thread after every step
        self.on_dead = on_dead            # called in the engine thread if the loop dies
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, _Outputs]] = {}
        self._streams_lock = threading.Lock()
        # commands awaiting the engine thread's answer (a prefix-cache reset)
        self._pending: set[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = set()
        self._stopping = False
        self.error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="folio-engine", daemon=True)
        self._thread.start()

    # ---- the event-loop side -------------------------------------------------
    @property
    def is_dead(self) -> bool:
        return self.error is not None or not self._thread.is_alive()

    def check_health(self) -> None:
        if self.is_dead:
            raise EngineDeadError("the engine has stopped")

    # What a front end may read: fixed once the engine is built, so safe from any thread.
    @property
    def tokenizer(self) -> "Tokenizer":
        return self.engine.tokenizer

    @property
    def model_config(self) -> ModelConfig:
        return self.engine.config.model

    @property
    def max_model_len(self) -> int:
        return self.engine.config.max_model_len

    @property
    def scheduling_policy(self) -> str:
        return self.engine.config.scheduler.scheduling_policy

    def check_kv_cache(self) -> None:
        self.engine.check_kv_cache()

    def check_lora(self, lora_request: LoRARequest) -> None:
        """The adapter loaded and checked (ValueError), on the caller's thread
        (the runner's adapter cache is locked against the engine's steps)."""
        self.engine.check_lora(lora_request)

    def validate(self, prompt_ids: list[int], params: Params) -> ValidatedPrompt:
        """The input processor's checks, on the caller's thread (it reads only the
        frozen config), so a bad request fails before anything is queued."""
        return ValidatedPrompt(prompt_ids, self.engine.input_processor.check(prompt_ids, params))

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    async def generate(self, request_id: str, prompt: Optional[str], prompt_ids: list[int],
                       params: Params, priority: int = 0,
                       lora_request: Optional[LoRARequest] = None
                       ) -> AsyncIterator[RequestOutput]:
        """Cumulative RequestOutputs until the finished one. Leaving the iteration
        early (client gone, task cancelled) aborts the request. Prompts that
        `validate` returned for these params are not checked again; the engine
        thread never checks (the request reaches it validated)."""
        self.check_health()
        if not (isinstance(prompt_ids, ValidatedPrompt) and prompt_ids.validates(params)):
            prompt_ids = self.validate(prompt_ids, params)    # ValueError -> 400
            params = prompt_ids.params
        loop, outputs = asyncio.get_running_loop(), _Outputs()
        with self._streams_lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = (loop, outputs)
        self._send(_Add(request_id, prompt, list(prompt_ids), params, time.monotonic(),
                        priority, lora_request))
        finished = False
        try:
            while True:
                item = await outputs.next()
                if isinstance(item, BaseException):
                    finished = True             # the engine already dropped it
                    raise item
                finished = item.finished
                if item.error is not None:
                    raise engine_error(item.error)
                yield item
                if finished:
                    return
        finally:
            with self._streams_lock:
                self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    async def reset_prefix_cache(self) -> bool:
        self.check_health()
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        with self._streams_lock:        # answered by the engine thread, or failed with it
            self._pending.add((loop, done))
        if self.is_dead:                # (failed before it was added: nobody answers)
            with self._streams_lock:
                self._pending.discard((loop, done))
            raise EngineDeadError("the engine has stopped")
        self._send(("reset_prefix_cache", (loop, done)))
        try:
            return await done
        finally:
            with self._streams_lock:
                self._pending.discard((loop, done))

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)

    def _send(self, command) -> None:
        self._commands.put(command)
        self._wake.set()

    # ---- the engine thread ---------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                aborted = self._drain_commands()
                stepped = self.engine.has_unfinished_requests()
                outputs = self.engine.step() if stepped else []
                # Metrics first: a client that reads /metrics after its answer
                # must find that answer counted.
                if self.on_step is not None and (stepped or aborted):
                    self.on_step(self.engine.step_stats(), aborted + outputs)
                if outputs:
                    self._deliver_step(outputs)
                if not stepped and not aborted:
                    self._wake.wait(0.5)
                    self._wake.clear()
        except BaseException as e:     # noqa: BLE001 - reported to every waiting client
            logger.exception("the engine loop failed")
            self.error = e
            self._fail_all(EngineDeadError(f"the engine stopped: {e!r}"))
            if self.on_dead is not None:
                self.on_dead(e)
        finally:
            self._abort_everything()
            try:
                self.engine.shutdown()          # tensor-parallel workers exit with us
            except Exception:                   # noqa: BLE001 - best effort on the way out
                logger.exception("engine shutdown failed")

    def _drain_commands(self) -> list[RequestOutput]:
        """Apply queued adds and aborts; returns the aborted requests' outputs."""
        aborted = []
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return aborted
            if isinstance(command, _Add):
                self._add(command)
            elif command[0] == "reset_prefix_cache":
                loop, done = command[1]
                try:
                    answer = (done.set_result, self.engine.reset_prefix_cache())
                except Exception as e:      # noqa: BLE001 - the caller's to report
                    answer = (done.set_exception, e)
                _answer(loop, done, *answer)
            else:
                aborted.extend(self.engine.abort_request([command[1]]))

    def _add(self, c: _Add) -> None:
        with self._streams_lock:
            if c.request_id not in self._streams:      # the client left before we started
                return
        add = (self.engine.add_beam_request if isinstance(c.params, BeamSearchParams)
               else self.engine.add_pooling_request if isinstance(c.params, PoolingParams)
               else self.engine.add_tokenized_request)
        try:         # generate() validated it; what can fail here is the cache and the id
            add(c.request_id, c.prompt, c.prompt_ids, c.params, c.arrival_time, c.priority,
                validated=True, lora_request=c.lora)
        except ValueError as e:
            self._deliver(c.request_id, e)

    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs, one wake-up of each event loop for all of its
        streams (not one a request: each is a write to the loop's self-pipe)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        with self._streams_lock:
            for out in outputs:
                target = self._streams.get(out.request_id)
                if target is not None:
                    by_loop.setdefault(target[0], []).append((target[1], out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:                        # that event loop has closed
                pass

    def _deliver(self, request_id: str, item) -> None:
        with self._streams_lock:
            target = self._streams.get(request_id)
        if target is not None:
            loop, outputs = target
            try:
                loop.call_soon_threadsafe(outputs.put, item)
            except RuntimeError:                        # that event loop has closed
                pass

    def _fail_all(self, error: BaseException) -> None:
        with self._streams_lock:
            ids = list(self._streams)
            pending = list(self._pending)
        for rid in ids:
            self._deliver(rid, error)
        for loop, done in pending:
            _answer(loop, done, done.set_exception, error)

    def _abort_everything(self) -> None:
        try:
            self.engine.abort_request(list(self.engine.scheduler.requests))
        except Exception:               # noqa: BLE001 - best effort on the way out
            logger.exception("aborting requests at shutdown failed")
        if self._stopping and self.error is None:
            self._fail_all(EngineDeadError("the server is shutting down"))
