"""The server's EngineClient when the engine core runs in a process of its own
(`folio serve --engine-process`; the core: engine/core_process.py).

This side keeps what a front end does per token: validation and the
tokenizer, the incremental text and stop strings, the RequestOutputs and each
request's stream. A thread of this process receives each step's
EngineCoreOutputs, makes them RequestOutputs and hands them to the streams
(as AsyncLLMEngine does, whose stream handling this class shares); stop
strings it finds go back to the core. A core that exits or dies is a dead
engine: every waiting client is told (503) and `on_dead` ends the server.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from typing import TYPE_CHECKING, Callable, Optional

from folio.config import FolioConfig, ModelConfig
from folio.core.beam import BeamSearchParams
from folio.pooling_params import PoolingParams
from folio.engine.async_engine import AsyncLLMEngine, _Add, _answer
from folio.engine.core_process import MOST_STEPS_AT_ONCE, CoreProcess, take_in_steps
from folio.engine.protocol import EngineDeadError, StepCallback
from folio.lora_request import LoRARequest

if TYPE_CHECKING:
    from folio.tokenizer import Tokenizer

logger = logging.getLogger("folio")


class MPEngineClient(AsyncLLMEngine):
    def __init__(self, config: FolioConfig, on_step: Optional[StepCallback] = None,
                 on_dead: Optional[Callable[[BaseException], None]] = None,
                 chat_template: Optional[str] = None, start: bool = True,
                 core: Optional[CoreProcess] = None):
        """`start=False`: the core is loaded, but its messages are not taken in
        until `start` gives the callbacks (a server sets them first, so that a
        core dying at once still reaches `on_dead`). `core`: its process,
        started early (a new one if not given)."""
        from folio.engine.input_processor import InputProcessor
        from folio.engine.output_processor import OutputProcessor
        from folio.tokenizer import get_tokenizer
        self.config = config
        self.on_step, self.on_dead = on_step, on_dead
        self._tokenizer = get_tokenizer(config.model)
        if chat_template is not None:
            self._tokenizer.chat_templates["default"] = chat_template
        self.input_processor = InputProcessor(config, self._tokenizer)
        self.output_processor = OutputProcessor(self._tokenizer)
        self._requests: dict = {}        # request id -> this side's copy of its Request
        self._aborted: list = []         # aborted requests' outputs, for the next stats
        self._lock = threading.Lock()    # the output processor, _requests, _aborted
        # commands go out through one sender thread: neither the event loop nor
        # the receiving thread ever blocks on a full pipe (which, both ways at
        # once, would stop both processes)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict = {}
        self._streams_lock = threading.Lock()
        self._pending: set = set()
        self._calls: dict = {}           # token -> (event, [ok, value]) of a blocking call
        self._tokens = itertools.count()
        self._stopping = False
        self.error: Optional[BaseException] = None
        self._core = core or CoreProcess()
        self._conn, self._proc = self._core.conn, self._core.proc
        info = self._core.start_engine(config)
        self._kv_error = info["kv_error"]
        self.num_blocks = info["num_blocks"]
        self._sender = threading.Thread(target=self._send_loop, name="folio-engine-send",
                                        daemon=True)
        self._sender.start()
        self._thread = threading.Thread(target=self._run, name="folio-engine-front",
                                        daemon=True)
        if start:
            self._thread.start()

    def start(self, on_step: Optional[StepCallback] = None,
              on_dead: Optional[Callable[[BaseException], None]] = None) -> None:
        """Take in the core's messages from now on, telling these callbacks."""
        self.on_step, self.on_dead = on_step, on_dead
        if not self._thread.is_alive():
            self._thread.start()

    # ---- what the server reads ------------------------------------------------
    @property
    def is_dead(self) -> bool:
        return self.error is not None or not self._proc.is_alive()

    @property
    def tokenizer(self) -> "Tokenizer":
        return self._tokenizer

    @property
    def model_config(self) -> ModelConfig:
        return self.config.model

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    @property
    def scheduling_policy(self) -> str:
        return self.config.scheduler.scheduling_policy

    def check_kv_cache(self) -> None:
        if self._kv_error is not None:
            raise ValueError(self._kv_error)

    def validate(self, prompt_ids, params):
        from folio.engine.protocol import ValidatedPrompt
        return ValidatedPrompt(prompt_ids, self.input_processor.check(prompt_ids, params))

    def check_lora(self, lora_request: LoRARequest) -> None:
        self._call("check_lora", lora_request)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._outbox.put(("shutdown",))
        self._outbox.put(None)
        self._sender.join(timeout)
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout)
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._fail_all(EngineDeadError("the server is shutting down"))

    # ---- commands to the core -------------------------------------------------
    def _send(self, command) -> None:
        if isinstance(command, _Add):
            self._add(command)
        elif command[0] == "abort":
            rid = command[1]
            with self._lock:
                self._aborted += self.output_processor.abort([rid])
                self._requests.pop(rid, None)
            self._post(("abort", [rid]))
        elif command[0] == "reset_prefix_cache":
            loop, done = command[1]
            token = next(self._tokens)
            self._calls[token] = (loop, done)
            self._post(("call", token, "reset_prefix_cache", ()))

    def _add(self, c: _Add) -> None:
        with self._streams_lock:
            if c.request_id not in self._streams:      # the client left before we started
                return
        ip = self.input_processor
        if isinstance(c.params, BeamSearchParams):     # this side's copy, for the text
            request = ip.make_request(c.request_id, c.prompt_ids, ip.beam_sampling(c.params),
                                      c.arrival_time, c.priority, validated=True)
        elif isinstance(c.params, PoolingParams):      # an embedding: its vector, no text
            request = ip.make_pooling_request(c.request_id, c.prompt_ids, c.params,
                                              c.arrival_time, c.priority)
        else:
            request = ip.make_request(c.request_id, c.prompt_ids, c.params, c.arrival_time,
                                      c.priority, validated=True)
        with self._lock:
            self._requests[c.request_id] = request
            self.output_processor.add_request(request, c.prompt)
        self._post(("add", c.request_id, list(c.prompt_ids), c.params, c.arrival_time,
                    c.priority, c.lora))

    def _call(self, name: str, *args):
        """A call answered by the core, waited for here."""
        if self.is_dead:
            raise EngineDeadError("the engine has stopped")
        token, done = next(self._tokens), threading.Event()
        answer: list = []
        self._calls[token] = (done, answer)
        self._post(("call", token, name, args))
        while not done.wait(1.0):
            if self.is_dead:
                raise EngineDeadError("the engine has stopped")
        ok, value = answer
        if not ok:
            raise value
        return value

    def _post(self, msg) -> None:
        self._outbox.put(msg)

    def _send_loop(self) -> None:
        while True:
            msg = self._outbox.get()
            if msg is None:
                return
            try:
                self._conn.send(msg)
            except (OSError, ValueError) as e:    # the core is gone: _run reports it
                if not self._stopping:
                    logger.warning("the engine core did not take a command: %r", e)
                return

    # ---- what the core sends ----------------------------------------------------
    def _run(self) -> None:
        conn = self._conn
        try:
            following = None
            while True:
                msg, following = following or conn.recv(), None
                kind = msg[0]
                if kind == "step":
                    # the steps waiting behind it too, taken in as one: a front
                    # end that fell behind its core catches up (merge_steps)
                    steps = [msg]
                    while len(steps) < MOST_STEPS_AT_ONCE and conn.poll():
                        following = conn.recv()
                        if following[0] != "step":
                            break
                        steps.append(following)
                        following = None
                    self._steps(steps)
                elif kind == "reply":
                    self._reply(*msg[1:])
                elif kind == "dead":
                    raise EngineDeadError(f"the engine core failed: {msg[1]}")
                elif kind == "add_failed":
                    with self._lock:
                        self.output_processor.states.pop(msg[1], None)
                        self._requests.pop(msg[1], None)
                    self._deliver(msg[1], ValueError(msg[2]))
        except (EOFError, OSError):
            if self._stopping:
                return
            self.error = EngineDeadError(f"the engine core process exited "
                                         f"({self._proc.exitcode})")
            logger.error("%s", self.error)
            self._fail_all(EngineDeadError(f"the engine stopped: {self.error}"))
            self._fail_calls()
            if self.on_dead is not None:
                self.on_dead(self.error)
        except BaseException as e:     # noqa: BLE001 - reported to every waiting client
            if not isinstance(e, EngineDeadError):
                logger.exception("the engine front end failed")
            self.error = e
            self._fail_all(EngineDeadError(f"the engine stopped: {e!r}"))
            self._fail_calls()
            if self.on_dead is not None:
                self.on_dead(e)

    def _steps(self, steps: list) -> None:
        """("step", core_outputs, stats, info) messages in order, as one step."""
        with self._lock:
            outputs, stopped = take_in_steps(steps, self._requests, self.output_processor)
            aborted, self._aborted = self._aborted, []
        if stopped:
            self._post(("stop", stopped))
        if self.on_step is not None:
            self.on_step(steps[-1][2], aborted + outputs)
        if outputs:
            self._deliver_step(outputs)

    def _reply(self, token, ok, value) -> None:
        waiter = self._calls.pop(token, None)
        if waiter is None:
            return
        first, second = waiter
        if isinstance(first, threading.Event):
            second.extend((ok, value))
            first.set()
            return
        loop, done = first, second
        _answer(loop, done, done.set_result if ok else done.set_exception, value)

    def _fail_calls(self) -> None:
        for token in list(self._calls):
            self._reply(token, False, EngineDeadError("the engine has stopped"))

