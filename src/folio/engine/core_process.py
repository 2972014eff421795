"""The engine core in a process of its own (`folio serve --engine-process`,
issue 50): the scheduler, the executor and the model, and a loop that only
takes in commands, steps, and sends each step's EngineCoreOutputs back. The
front end (engine/mp_client.py, in the server's process) keeps the tokenizer,
the text and the RequestOutputs, so neither the HTTP server's event loop nor
detokenization holds the GIL the core's steps need.

Messages are pickled tuples over one multiprocessing Pipe: one front end
talks to one core, and what crosses is Python objects the two share
(SamplingParams, LoRARequest, EngineCoreOutput, StepStats), which pickle as
they are. A compiled grammar does not cross (it is dropped when pickled):
the core compiles a request's structured outputs again when it adds it.

front -> core: ("config", FolioConfig)                 first: the core was started before it
               ("add", request_id, prompt_ids, params, arrival_time, priority, lora)
               ("adds", [(request_id, prompt_ids, ...), ...])  several at once (the
                                                        offline LLM's batch: one step sees all)
               ("abort", [request_id, ...])
               ("stop", [(request_id, index), ...])     stop strings the front found
               ("call", token, name, args)              reset_prefix_cache, check_lora
               ("shutdown",)
core -> front: ("ready", {"kv_error": message or None, "num_blocks": n})
               ("failed", message)                      the core could not start
               ("dead", message)                        the core failed (then exits)
               ("step", core_outputs, stats, {request_id: (first_scheduled_time,
                        num_preemptions, num_cached_tokens)})
               ("add_failed", request_id, message)      a ValueError of the scheduler
               ("reply", token, ok, value)
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.util
import os
import queue
import signal
import threading
from multiprocessing.reduction import ForkingPickler
from typing import Optional

from folio.core.beam import BeamSearchParams
from folio.pooling_params import PoolingParams
from folio.engine.output_processor import merge_steps
from folio.worker.multiproc import _main_not_rerun

logger = logging.getLogger("folio")


class CoreProcess:
    """The engine core's process, started before its config exists: it
    imports torch and the model code while the front end parses its
    arguments and builds the config (the two imports take about as long),
    then waits for ("config", config) on the pipe. Told to stop, or finding
    the pipe closed, before that (a bad argument), it exits at once. At the
    front end's exit it is told to stop and waited for briefly, then ended
    (before multiprocessing joins its non-daemon children)."""

    def __init__(self):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        # not a daemon: a tensor-parallel core starts worker processes of its
        # own; it ends when this side's end of the pipe closes
        self.proc = ctx.Process(target=run_core, args=(child,), name="folio-engine-core",
                                daemon=False)
        with _main_not_rerun():
            self.proc.start()
        child.close()
        self.configured = [False]       # (shared with the finalizer)
        multiprocessing.util.Finalize(self, _stop_core,
                                      args=(self.conn, self.proc, self.configured),
                                      exitpriority=10)

    def start_engine(self, config) -> dict:
        """The config sent and the engine built on it: the core's "ready"
        info ({kv_error, num_blocks}); RuntimeError if it failed or exited."""
        self.configured[0] = True
        try:
            self.conn.send(("config", config))
            kind, info = self.conn.recv()          # the core loads the model
        except (EOFError, OSError):
            self.proc.join(10)
            raise RuntimeError(f"the engine core process exited ({self.proc.exitcode}) "
                               "before it was ready") from None
        if kind == "failed":
            self.proc.join(10)
            raise RuntimeError(info)
        return info

    def stop(self) -> None:
        """Told to stop and waited for, ended if it does not (as at exit)."""
        _stop_core(self.conn, self.proc, self.configured)


def _stop_core(conn, proc, configured) -> None:
    """The core told to stop and waited for briefly, then ended (at exit); one
    that never got its config holds nothing yet, and is ended at once."""
    if not configured[0]:
        proc.kill()
        proc.join(5)
        return
    try:
        conn.send(("shutdown",))
        conn.close()
    except (OSError, ValueError):
        pass
    proc.join(5)
    if proc.is_alive():
        proc.kill()
        proc.join(5)


# the core's step messages a front end takes in at once, at most (the core
# never waits for its front end: it sends from a thread of its own)
MOST_STEPS_AT_ONCE = 64


def take_in_steps(steps: list, requests: dict, processor) -> tuple[list, list]:
    """A front end's side of ("step", core_outputs, stats, info) messages, in
    order, taken in as one: each request's core-side numbers onto this side's
    copy of it (`requests`: id -> Request), their outputs joined (merge_steps)
    and made RequestOutputs by `processor` (an OutputProcessor), finished
    requests dropped. Returns the outputs and the (request, index) pairs stop
    strings ended, for the core to hear of."""
    for step in steps:
        for rid, (scheduled, preemptions, cached) in step[3].items():
            request = requests.get(rid)
            if request is not None:
                request.first_scheduled_time = scheduled
                request.num_preemptions = preemptions
                request.num_cached_tokens = cached
    core_outputs = (steps[0][1] if len(steps) == 1
                    else merge_steps([o for step in steps for o in step[1]]))
    outputs, stopped = processor.process(core_outputs)
    for out in outputs:
        if out.finished:
            requests.pop(out.request_id, None)
    return outputs, stopped


def run_core(conn) -> None:
    """The core process's body: the imports, the config from the front end,
    the engine built, then the front end served until it says shutdown or
    goes away."""
    from folio.logger import configure_logging
    configure_logging()
    # SIGINT and SIGTERM are the server's to handle (a terminal's Ctrl-C or a
    # process group's SIGTERM reach this process too): it drains its requests,
    # then stops the core by its shutdown message or by closing the pipe
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        from folio.engine.llm_engine import LLMEngine
        msg = conn.recv()
        if msg[0] != "config":              # stopped before it was needed
            return
        config = msg[1]
    except (EOFError, OSError):              # the front end gave up before it was needed
        return
    try:
        engine = LLMEngine(config, detokenize=False)
    except BaseException as e:     # noqa: BLE001 - the front end reports it
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    try:
        try:
            engine.check_kv_cache()
            kv_error: Optional[str] = None
        except ValueError as e:
            kv_error = str(e)
        conn.send(("ready", {"kv_error": kv_error, "num_blocks": engine.num_blocks}))
        core = Core(engine, conn)
        try:
            core.loop()
        finally:
            core.close()            # what it sent goes out before anything said below
    except (EOFError, OSError):     # the front end went away: nothing to tell
        pass
    except BaseException as e:      # noqa: BLE001 - told before the shutdown, which may hang
        logger.exception("the engine core failed")
        try:
            conn.send(("dead", f"{type(e).__name__}: {e}"))
            conn.close()
        except (OSError, ValueError):
            pass
    finally:
        engine.shutdown()


class Core:
    def __init__(self, engine, conn):
        self.engine, self.conn = engine, conn
        # the requests added, until they end: what the front end's outputs
        # carry of each (when it was scheduled, preemptions, cached tokens)
        self.requests: dict = {}
        self.running = True
        # Messages go out through a thread of their own, pickled here: the
        # loop never waits for a front end that fell behind (a full pipe);
        # that front end takes the steps waiting in one go (mp_client.py).
        # The write releases the GIL, so the steps go on meanwhile.
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.broken: Optional[BaseException] = None     # the front end went away
        self.sender = threading.Thread(target=self._send_loop, name="folio-core-send",
                                       daemon=True)
        self.sender.start()

    def send(self, msg) -> None:
        if self.broken is not None:
            raise EOFError("the front end went away") from self.broken
        self.outbox.put(ForkingPickler.dumps(msg))

    def _send_loop(self) -> None:
        while True:
            payload = self.outbox.get()
            if payload is None:
                return
            try:
                self.conn.send_bytes(payload)
            except (OSError, ValueError) as e:
                self.broken = e
                return

    def close(self, timeout: float = 10.0) -> None:
        """What was sent, written out (unless the front end went away)."""
        self.outbox.put(None)
        self.sender.join(timeout)

    def loop(self) -> None:
        engine, conn = self.engine, self.conn
        parent = os.getppid()
        while self.running:
            if os.getppid() != parent:       # the front end's process died
                return
            busy = engine.has_unfinished_requests()
            told = False
            # between steps, every command waiting; when idle, wait for one
            if conn.poll(0 if busy else 0.5):
                while self.running and conn.poll():
                    told |= self.handle(conn.recv())
            if not self.running:
                return
            if engine.has_unfinished_requests():
                self.send_step(engine.core_step())
            elif told:               # an abort while idle: the metrics hear of it
                self.send_step([])

    def send_step(self, outputs) -> None:
        info = {}
        for rid in {o.request_id for o in outputs}:
            req = self.requests.get(rid)
            if req is None:
                continue
            info[rid] = (req.first_scheduled_time, req.num_preemptions, req.num_cached_tokens)
            if rid not in self.engine.scheduler.requests:
                del self.requests[rid]
        self.send(("step", outputs, self.engine.step_stats(), info))

    def handle(self, msg) -> bool:
        """One command; True when it ended requests (an abort)."""
        kind = msg[0]
        if kind == "add":
            self.add(*msg[1:])
        elif kind == "adds":
            for add in msg[1]:
                self.add(*add)
        elif kind == "abort":
            self.engine.abort_request(msg[1])
            for rid in msg[1]:
                self.requests.pop(rid, None)
            return True
        elif kind == "stop":
            self.engine.stop_sequences(msg[1])
            for rid, _ in msg[1]:           # ended by it: no step reports them again
                if rid not in self.engine.scheduler.requests:
                    self.requests.pop(rid, None)
        elif kind == "call":
            self.call(*msg[1:])
        elif kind == "shutdown":
            self.running = False
        return False

    def add(self, rid, prompt_ids, params, arrival_time, priority, lora) -> None:
        add = (self.engine.add_beam_request if isinstance(params, BeamSearchParams)
               else self.engine.add_pooling_request if isinstance(params, PoolingParams)
               else self.engine.add_tokenized_request)
        try:        # validated again here: a grammar is compiled on this side
            self.requests[rid] = add(rid, None, prompt_ids, params, arrival_time, priority,
                                     lora_request=lora)
        except ValueError as e:
            self.send(("add_failed", rid, str(e)))

    def call(self, token, name: str, args: tuple) -> None:
        try:
            if name == "reset_prefix_cache":
                value = self.engine.reset_prefix_cache()
            elif name == "check_lora":
                value = self.engine.check_lora(*args)
            else:
                raise ValueError(f"no call {name!r}")
            reply = ("reply", token, True, value)
        except Exception as e:     # noqa: BLE001 - the caller's to raise
            reply = ("reply", token, False, e)
        self.send(reply)
