"""What the completion and chat handlers share: the served model's state,
running several engine requests for one HTTP request, streaming them as
server-sent events, and aborting everything when the client goes away.

The engine is an EngineClient (`engine/protocol.py`) and nothing more: the
handlers validate through it, generate through it, and read the tokenizer and
limits from it.

An error keeps its status on both paths: before a stream starts it is the
response's status; after, it is an error event (then [DONE]). A request the
engine failed alone (RequestFailedError) is a 500 for that request only; a
stopped engine (EngineDeadError) is a 503.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import itertools
import json
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from folio.engine.protocol import EngineClient, EngineDeadError, Params
from folio.lora_request import LoRARequest
from folio.outputs import CompletionOutput, RequestOutput
from folio.sampling_params import SamplingParams
from folio.server.error_shape import error_body


# Tokenizing and rendering chat templates: off the event loop, two at a time
# (a request's text is at most --max-request-bytes; the rest wait their turn)
_TEXT_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=2,
                                                   thread_name_prefix="folio-text")


async def off_loop(fn, *args, **kwargs):
    """fn(*args, **kwargs) in the server's bounded pool of text workers."""
    return await asyncio.get_running_loop().run_in_executor(
        _TEXT_POOL, functools.partial(fn, *args, **kwargs))


class HTTPError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 headers: Optional[dict[str, str]] = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.status, self.param), self.status,
                            headers=self.headers)


@dataclass
class ServedModel:
    engine: EngineClient
    name: str
    trust_request_chat_template: bool = False   # run templates that requests send
    tool_parser: Any = None     # server/tools.py's parser of tool_choice "auto", when enabled
    accounting: Any = None      # server/accounting.py: tenants' limits, usage, the ledger
    reasoning_parser: Optional[str] = None  # server/reasoning.py's format of the thinking
    # --max-tokens-default, --max-tokens-limit, --request-timeout (None: unbounded)
    max_tokens_default: Optional[int] = None
    max_tokens_limit: Optional[int] = None
    request_timeout: Optional[float] = None
    # LoRA adapters served under their own names (--lora-modules, load/unload)
    loras: dict[str, LoRARequest] = dataclasses.field(default_factory=dict)
    lora_ids: Any = dataclasses.field(default_factory=lambda: itertools.count(1))
    # other names the base model answers to (--served-model-name A B ..., or a
    # model served by path: its own name)
    aliases: tuple[str, ...] = ()
    # sampling fields a request leaves unset take these (--generation-config)
    sampling_defaults: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def check_model(self, requested: Optional[str], tenant=None) -> Optional[LoRARequest]:
        """The adapter a request's `model` names (None: the base model); 404
        for a name that is neither, or an adapter the caller's tenant may not
        use (its key's "adapters"), as if it were not there."""
        if requested is None or requested == self.name or requested in self.aliases:
            return None
        lora = self.loras.get(requested)
        if lora is None or (tenant is not None and not tenant.may_use(requested)):
            raise HTTPError(404, f"The model `{requested}` does not exist.", "model")
        return lora

    def model_name(self, requested: Optional[str]) -> str:
        """A response's `model`: the adapter or model the request named (checked
        when it started), else the served model's name."""
        return requested or self.name

    def check_priority(self, priority: int) -> None:
        """Under fcfs the scheduler never reads a priority: refuse one rather than ignore it."""
        if priority != 0 and self.engine.scheduling_policy != "priority":
            raise HTTPError(400, "priority needs a server started with --scheduling-policy "
                                 "priority", "priority")

    def max_tokens_for(self, prompt_len: int, asked: Optional[int], at_least: int = 0) -> int:
        """The completion budget: asked for (at most --max-tokens-limit), or what
        the context has left, at most --max-tokens-default (raised to the
        request's min_tokens, `at_least`) and the limit."""
        room = self.max_model_len - prompt_len
        if room < 1:
            raise HTTPError(400, f"This model's maximum context length is "
                                 f"{self.max_model_len} tokens, but the prompt has {prompt_len} "
                                 f"tokens, leaving no room for a completion.", "prompt")
        if asked is None:
            default = (None if self.max_tokens_default is None
                       else max(self.max_tokens_default, at_least))
            return min(b for b in (room, default, self.max_tokens_limit) if b is not None)
        if asked < 1:
            raise HTTPError(400, f"max_tokens must be at least 1 (0 only on /v1/completions "
                                 f"with echo: true, to score the prompt), got {asked}",
                            "max_tokens")
        if self.max_tokens_limit is not None and asked > self.max_tokens_limit:
            raise HTTPError(400, f"max_tokens is {asked}, but this server generates at most "
                                 f"{self.max_tokens_limit} tokens a request "
                                 f"(--max-tokens-limit)", "max_tokens")
        if prompt_len + asked > self.max_model_len:
            raise HTTPError(400, f"This model's maximum context length is {self.max_model_len} "
                                 f"tokens. However, you requested {prompt_len + asked} tokens "
                                 f"({prompt_len} in the prompt, {asked} for the completion).",
                            "max_tokens")
        return asked

    def validated(self, calls: list["EngineCall"]) -> list["EngineCall"]:
        """Every call checked by the engine before any runs, so a bad one is a 400
        before a stream starts; the engine takes the checked prompts as they are."""
        out = []
        for c in calls:
            checked = self.engine.validate(c.prompt_ids, c.params)
            # (an embedding's params come back resolved: the ones the engine then runs)
            out.append(dataclasses.replace(c, prompt_ids=checked, params=checked.params))
        return out

    def check_task(self, task: str, endpoint: str) -> None:
        """A 400 for an endpoint of the other task than the model is served for
        (--task)."""
        served = self.engine.model_config.task
        if served != task:
            what = {"generate": "generation", "embed": "embeddings", "score": "scores"}
            raise HTTPError(400, f"{endpoint} serves {what[task]}, but this server serves "
                                 f"{self.name} for {what[served]} (--task {served}): start it "
                                 f"with --task {task}", "model")


@dataclass
class EngineCall:
    request_id: str
    prompt: Optional[str]
    prompt_ids: list[int]
    params: Params
    priority: int = 0
    lora: Optional[LoRARequest] = None


async def collect(served: ServedModel, calls: list[EngineCall], raw: Request,
                  seen: Optional[dict[int, RequestOutput]] = None) -> list[RequestOutput]:
    """Run the calls to completion. A client that disconnects, or one call that
    fails, aborts them all (cancelling a call's task aborts its engine request).
    `seen` gets each call's latest output as it comes (what an abort used)."""
    seen = {} if seen is None else seen
    deadline = Deadline(served.request_timeout)

    async def one(i: int, call: EngineCall) -> RequestOutput:
        last = None
        async for last in served.engine.generate(call.request_id, call.prompt, call.prompt_ids,
                                                 call.params, call.priority, call.lora):
            seen[i] = last
        return last

    tasks = [asyncio.ensure_future(one(i, c)) for i, c in enumerate(calls)]
    try:
        pending = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending, timeout=deadline.wait(0.25),
                                               return_when=asyncio.FIRST_EXCEPTION)
            for t in done:
                if t.exception() is not None:
                    raise t.exception()
            if pending and await raw.is_disconnected():
                raise asyncio.CancelledError("client disconnected")
            if pending:
                deadline.check(list(seen.values()))
        return [t.result() for t in tasks]
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def merged(served: ServedModel, calls: list[EngineCall]
                 ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(index of the call, output) as they come, from all calls at once."""
    queue: asyncio.Queue = asyncio.Queue()
    done_marker, timed_out = object(), object()

    async def pump(i: int, call: EngineCall) -> None:
        try:
            async for out in served.engine.generate(call.request_id, call.prompt,
                                                    call.prompt_ids, call.params, call.priority,
                                                    call.lora):
                await queue.put((i, out))
        except Exception as e:          # noqa: BLE001 - re-raised in the consumer
            await queue.put((i, e))
        finally:
            await queue.put((i, done_marker))

    tasks = [asyncio.ensure_future(pump(i, c)) for i, c in enumerate(calls)]
    deadline, latest = Deadline(served.request_timeout), {}
    # one timer for the request (not a timed wait per token): it queues the marker
    timer = (None if deadline.seconds is None else asyncio.get_running_loop().call_later(
        deadline.seconds, queue.put_nowait, (None, timed_out)))
    try:
        remaining = len(tasks)
        while remaining:
            for i, item in _newest(await queue.get(), queue, done_marker):
                if item is done_marker:
                    remaining -= 1
                elif item is timed_out:     # the outputs before it were sent (and charged)
                    deadline.expire(latest.values())
                elif isinstance(item, Exception):
                    raise item
                else:
                    latest[i] = item
                    yield i, item
    finally:
        if timer is not None:
            timer.cancel()
        for t in tasks:           # cancelling a pump aborts its engine request
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _newest(first, queue: asyncio.Queue, done_marker) -> list:
    """What the calls' pumps queued by now, in order, less each call's outputs
    that a later one of the same call waiting here supersedes (they are
    cumulative: a consumer that fell behind sends one chunk for them). Only
    outputs before an error or the timeout are merged: what came before
    those is given as it would have been."""
    items = [first]
    while not queue.empty():
        items.append(queue.get_nowait())
    if len(items) == 1:
        return items
    plain = next((k for k, (_, item) in enumerate(items)
                  if not (item is done_marker or isinstance(item, RequestOutput))), len(items))
    last = {i: k for k, (i, item) in enumerate(items[:plain]) if isinstance(item, RequestOutput)}
    return [(i, item) for k, (i, item) in enumerate(items)
            if k >= plain or not isinstance(item, RequestOutput) or last[i] == k]


class Deadline:
    """--request-timeout: the seconds a request may generate for, counted from
    the start of its generation (its time in the queue included). Past it the
    request's engine calls are aborted (their blocks freed within a step) and
    the client gets a 504; a stream keeps what it was sent, then the error."""

    def __init__(self, seconds: Optional[float]):
        self.seconds = seconds
        self.at = None if seconds is None else time.monotonic() + seconds

    def wait(self, most: float) -> float:
        """How long a wait may last: at most `most` and the time left."""
        return most if self.at is None else min(most, max(self.at - time.monotonic(), 0.0))

    def check(self, outputs) -> None:
        """Raise the 504 once the time is up; `outputs`: the calls' latest RequestOutputs."""
        if self.at is not None and time.monotonic() >= self.at:
            self.expire(outputs)

    def expire(self, outputs) -> None:
        """The 504 of a request whose time is up."""
        made = sum(len(c.token_ids) for o in outputs if isinstance(o.outputs, list)
                   for c in o.outputs)        # (an embedding generates nothing)
        # a 5xx that clients must not retry: the same request would time out again
        # (the openai client retries a 5xx twice unless told not to)
        raise HTTPError(504, f"the request ran past this server's --request-timeout of "
                             f"{self.seconds:g} s and was aborted after {made} generated "
                             f"tokens", "request_timeout", headers={"x-should-retry": "false"})


class TicketedStream(StreamingResponse):
    """Server-sent events whose request is charged however the response ends:
    the stream is closed (its engine requests aborted) and the ticket abandoned
    (a no-op once completed) even when the client left before the first chunk
    was read, or while the stream waited at a chunk."""

    def __init__(self, content, ticket):
        super().__init__(content, media_type="text/event-stream")
        self._ticket = ticket

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()
            except BaseException:       # noqa: BLE001 - cancelled while closing: go on
                pass
            self._ticket.abandon()


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def error_status(e: BaseException) -> int:
    if isinstance(e, HTTPError):
        return e.status
    if isinstance(e, EngineDeadError):
        return 503
    return 400 if isinstance(e, ValueError) else 500


def sse_error(e: BaseException) -> str:
    return sse(error_body(str(e), error_status(e), getattr(e, "param", None)))


def holdback(params: SamplingParams) -> int:
    """Characters a stream keeps back so a stop string is never half-sent."""
    return max((len(s) for s in params.stop), default=1) - 1


def usage(outputs: list[RequestOutput]) -> dict:
    """(An embedding request's output generates nothing: its prompt only.)"""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs if isinstance(o.outputs, list)
                     for c in o.outputs)
    cached = sum(o.num_cached_tokens or 0 for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def choice_usage(out: RequestOutput, c: CompletionOutput) -> dict:
    """One choice's usage so far (stream_options.continuous_usage_stats, as vLLM counts it)."""
    prompt, completion = len(out.prompt_token_ids), len(c.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


# A token a structured-output grammar forbids has logprob -inf, which JSON cannot
# hold; it is sent as this floor instead, as vLLM does.
LOGPROB_FLOOR = -9999.0


def json_logprob(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)
