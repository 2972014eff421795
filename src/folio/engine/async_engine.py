"""The step loop behind asyncio.

The engine steps in its own thread. Requests and aborts reach it through a
command queue; outputs go back to each request's asyncio.Queue with
`loop.call_soon_threadsafe` (asyncio queues are not thread-safe). Only this
thread touches the scheduler, so the engine core could later move to its own
process behind the same three calls: generate, abort, shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Optional, Union

from folio.core.beam import BeamSearchParams
from folio.engine.llm_engine import LLMEngine
from folio.outputs import RequestOutput
from folio.sampling_params import SamplingParams

logger = logging.getLogger("folio")


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an internal error; the server must report 503."""


class RequestFailedError(RuntimeError):
    """One request failed inside an engine step (its inputs could not be prepared
    or sampled); it was aborted and its blocks freed, and the engine goes on
    serving the others. Not the client's fault as far as validation could tell,
    so the server answers 500 for that request alone."""


@dataclass
class _Add:
    request_id: str
    prompt: Optional[str]
    prompt_ids: list[int]
    params: Union[SamplingParams, BeamSearchParams]
    arrival_time: float
    priority: int


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine,
                 on_step: Optional[Callable[[LLMEngine, list[RequestOutput]], None]] = None,
                 on_dead: Optional[Callable[[BaseException], None]] = None):
        self.engine = engine
        self.on_step = on_step            # called in the engine thread after every step
        self.on_dead = on_dead            # called in the engine thread if the loop dies
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._streams_lock = threading.Lock()
        self._stopping = False
        self.error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="folio-engine", daemon=True)
        self._thread.start()

    # ---- the event-loop side -------------------------------------------------
    @property
    def is_dead(self) -> bool:
        return self.error is not None or not self._thread.is_alive()

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    async def generate(self, request_id: str, prompt: Optional[str], prompt_ids: list[int],
                       params: Union[SamplingParams, BeamSearchParams],
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Cumulative RequestOutputs until the finished one. Leaving the iteration
        early (client gone, task cancelled) aborts the request."""
        if self.is_dead:
            raise EngineDeadError("the engine has stopped")
        if not isinstance(params, BeamSearchParams):
            self.engine.input_processor.validate(prompt_ids, params)   # ValueError -> 400
        loop, outputs = asyncio.get_running_loop(), asyncio.Queue()
        with self._streams_lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = (loop, outputs)
        self._send(_Add(request_id, prompt, prompt_ids, params, time.monotonic(), priority))
        finished = False
        try:
            while True:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    finished = True             # the engine already dropped it
                    raise item
                finished = item.finished
                if item.error is not None:
                    raise RequestFailedError(f"the request failed in the engine: {item.error}")
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
                    self.on_step(self.engine, aborted + outputs)
                for out in outputs:
                    self._deliver(out.request_id, out)
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
            else:
                aborted.extend(self.engine.abort_request([command[1]]))

    def _add(self, c: _Add) -> None:
        with self._streams_lock:
            if c.request_id not in self._streams:      # the client left before we started
                return
        add = (self.engine.add_beam_request if isinstance(c.params, BeamSearchParams)
               else self.engine.add_tokenized_request)
        try:
            add(c.request_id, c.prompt, c.prompt_ids, c.params, c.arrival_time, c.priority)
        except ValueError as e:
            self._deliver(c.request_id, e)

    def _deliver(self, request_id: str, item) -> None:
        with self._streams_lock:
            target = self._streams.get(request_id)
        if target is not None:
            loop, outputs = target
            try:
                loop.call_soon_threadsafe(outputs.put_nowait, item)
            except RuntimeError:                        # that event loop has closed
                pass

    def _fail_all(self, error: BaseException) -> None:
        with self._streams_lock:
            ids = list(self._streams)
        for rid in ids:
            self._deliver(rid, error)

    def _abort_everything(self) -> None:
        try:
            self.engine.abort_request(list(self.engine.scheduler.requests))
        except Exception:               # noqa: BLE001 - best effort on the way out
            logger.exception("aborting requests at shutdown failed")
        if self._stopping and self.error is None:
            self._fail_all(EngineDeadError("the server is shutting down"))
