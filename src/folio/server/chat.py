"""POST /v1/chat/completions, and the chat rendering /tokenize shares.

Chat templates are untrusted programs (a request may send its own), so
whatever goes wrong while one renders is the request's fault: a 400 that names
the template, never a 500.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import JSONResponse

from folio.chat_template import ChatTemplateError
from folio.outputs import CompletionOutput, RequestOutput
from folio.server.protocol import ChatCompletionRequest, InvalidRequest, now, random_id
from folio.server.reasoning import Split, ThinkParser
from folio.server.tools import (ForcedCallStream, forced_calls, forced_finish,
                                template_messages, template_renders_tools, tools_note,
                                with_tools_note)
from folio.server.serving import (SSE_DONE, EngineCall, ServedModel, TicketedStream,
                                  choice_usage, collect, holdback, json_logprob, merged,
                                  off_loop, sse, sse_error, token_text, usage)

_TEMPLATE_FAULT = "the chat template"     # how chat_template.py's messages name the template


def render_chat_ids(served: ServedModel, messages: list, kwargs: dict[str, Any],
                    note: Optional[str] = None) -> list[int]:
    """The conversation's prompt token ids; blocking (run it off the event loop).
    `note`: the tools in a system message, for a template that does not
    render the `tools` it is given (tools.template_renders_tools)."""
    chosen = kwargs.get("chat_template")
    own = chosen is not None and chosen not in served.tokenizer.chat_templates
    if own and not served.trust_request_chat_template:
        # A template is a program; bounded as it is (chat_template.py), its loops
        # can still hold a thread for hours. vLLM refuses them the same way.
        raise InvalidRequest("the request's chat_template is refused: this server runs only "
                             "the model's templates (start it with "
                             "--trust-request-chat-template to allow request templates)",
                             "chat_template")
    if note is not None and kwargs.get("tools") and \
            not template_renders_tools(served.tokenizer, chosen):
        messages = with_tools_note(messages, note)
    try:
        return served.tokenizer.encode_chat(messages, **kwargs)
    except ValueError as e:
        if not (isinstance(e, ChatTemplateError) or str(e).startswith(_TEMPLATE_FAULT)):
            raise InvalidRequest(str(e), "messages") from e    # about the messages themselves
        message = str(e).removeprefix(_TEMPLATE_FAULT)
    except Exception as e:      # noqa: BLE001 - e.g. the sandbox's "Range too big", RecursionError
        message = f" failed to render: {type(e).__name__}: {e}"
    which = ("the request's chat_template" if own else
             f"the model's {chosen!r} chat template" if chosen else "the model's chat template")
    raise InvalidRequest(which + message, "chat_template" if own else "messages")


async def chat_prompt_ids(served: ServedModel, req) -> list[int]:
    """A chat request's (or /tokenize's messages') prompt ids: the history as
    templates take it, the tools shown to the template; rendered off the loop."""
    kwargs = req.template_kwargs()
    tools = req.template_tools()
    note = None
    if tools:
        kwargs["tools"] = tools
        note = tools_note(req.tools, getattr(req, "tool_choice", None),
                          getattr(req, "parallel_tool_calls", True))
    return await off_loop(render_chat_ids, served, template_messages(req.messages), kwargs,
                          note)


def _call(served: ServedModel, req: ChatCompletionRequest, ids: list[int],
          lora=None) -> EngineCall:
    asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = served.max_tokens_for(len(ids), asked, req.min_tokens)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = req.sampling_params(max_tokens, logprobs, defaults=served.sampling_defaults)
    if req.auto_tools:      # a model's call markers may be special tokens: keep them
        params.skip_special_tokens = False
    return EngineCall(random_id("chatcmpl"), None, ids, params, req.priority, lora)


def _entry(tokenizer, token_id: int, logprob: float) -> dict:
    text = token_text(tokenizer, token_id)
    return {"token": text, "logprob": json_logprob(logprob), "bytes": list(text.encode("utf-8"))}


def _logprobs(tokenizer, c: CompletionOutput, start: int, top: int) -> dict:
    content = []
    for token, entry in zip(c.token_ids[start:], (c.logprobs or [])[start:]):
        item = _entry(tokenizer, token, entry[token])
        ranked = sorted(entry.items(), key=lambda kv: -kv[1])[:top]
        item["top_logprobs"] = [_entry(tokenizer, t, lp) for t, lp in ranked]
        content.append(item)
    return {"content": content}


def _message(served: ServedModel, req: ChatCompletionRequest, c: CompletionOutput,
             thinking: Optional[ThinkParser] = None) -> tuple[dict, Optional[str]]:
    """(the choice's message, its finish_reason): a forced answer is its calls,
    those completed before a cut included (finish_reason "length"); one that
    completed none stays text, as it is. Otherwise the thinking goes to
    reasoning_content (with a reasoning parser), and under "auto" the calls the
    model wrote are parsed from the rest."""
    forced = req.forced_tool
    if forced is not None:
        calls, finish = forced_calls(c.text, forced, c.finish_reason)
        if calls:
            return {"role": "assistant", "content": None, "tool_calls": calls}, finish
        return {"role": "assistant", "content": c.text}, c.finish_reason
    split = thinking.split(c.text) if thinking is not None else Split(None, c.text)
    message: dict[str, Any] = {"role": "assistant", "content": split.content}
    if thinking is not None:
        message["reasoning_content"] = split.reasoning if req.include_reasoning else None
        if split.reasoning is not None:
            message["content"] = split.content or None
    if req.auto_tools and c.finish_reason == "stop":
        content, calls = served.tool_parser.parse(split.content)
        if calls:
            return {**message, "content": content, "tool_calls": calls}, "tool_calls"
    return message, c.finish_reason


def _final(served: ServedModel, req: ChatCompletionRequest, out: RequestOutput,
           thinking: Optional[ThinkParser]) -> dict:
    choices = []
    for c in out.outputs:
        message, finish = _message(served, req, c, thinking)
        choices.append({"index": c.index, "message": message,
                        "logprobs": (_logprobs(served.tokenizer, c, 0, req.top_logprobs or 0)
                                     if req.logprobs else None),
                        "finish_reason": finish, "stop_reason": c.stop_reason})
    return {"id": out.request_id, "object": "chat.completion", "created": now(),
            "model": served.model_name(req.model), "choices": choices, "usage": usage([out])}


# A streamed choice's next chunk: (delta, logprobs, finish_reason, characters of
# content sent, characters of reasoning sent)
_Step = tuple[dict, Optional[dict], Optional[str], int, int]


def _answer_delta(served: ServedModel, req: ChatCompletionRequest, c: CompletionOutput,
                  sent: tuple[int, int, int], keep: int,
                  thinking: Optional[ThinkParser]) -> Optional[_Step]:
    """A streamed choice that is not a forced call: its thinking streams as
    reasoning_content (with a reasoning parser), then its text as content. Under
    "auto" the text streams while it cannot be a call; the calls come whole in
    the last chunk, once parsed. Nothing a stop string may still claim is sent."""
    chars, _, thought = sent
    raw = c.text if c.finished else c.text[:max(0, len(c.text) - keep)]
    split = thinking.split(raw, c.finished) if thinking is not None else Split(None, raw)
    delta: dict[str, Any] = {}
    reasoning = (split.reasoning or "") if req.include_reasoning else ""
    if len(reasoning) > thought:
        delta["reasoning_content"] = reasoning[thought:]
    if not c.finished:
        text = split.content
        upto = min(len(text), served.tool_parser.safe_prefix(text)) if req.auto_tools \
            else len(text)
        if upto > chars:
            delta["content"] = text[chars:upto]
        return (delta, None, None, max(chars, upto), len(reasoning)) if delta else None
    message, finish = _message(served, req, c, thinking)
    content = message["content"] or ""
    if content[chars:] or not delta:
        delta["content"] = content[chars:] if content.startswith(split.content[:chars]) \
            else ""
    if "tool_calls" in message:
        delta["tool_calls"] = [dict(tc, index=i) for i, tc in enumerate(message["tool_calls"])]
    return delta, None, finish, len(content), len(reasoning)


def _forced_deltas(stream: ForcedCallStream, c: CompletionOutput, keep: int) -> list[_Step]:
    """A streamed choice of a forced call: each call's arguments stream as they
    are generated, then a last chunk with the finish_reason ("length" when cut).
    An answer cut before any call began ends as its text, as unstreamed."""
    upto = len(c.text) if c.finished else max(0, len(c.text) - keep)
    steps: list[_Step] = [({"tool_calls": [entry]}, None, None, upto, 0)
                          for entry in stream.deltas(c.text[:upto], c.finished)]
    if c.finished:
        steps.append(({}, None, forced_finish(stream.scanner, c.finish_reason), upto, 0)
                     if stream.begun else ({"content": c.text}, None, c.finish_reason, upto, 0))
    return steps


async def _stream(served: ServedModel, req: ChatCompletionRequest, call: EngineCall,
                  created: int, ticket, thinking: Optional[ThinkParser]) -> AsyncIterator[str]:
    # choice -> (content chars sent, tokens sent, reasoning chars sent)
    sent: dict[int, tuple[int, int, int]] = {}
    forced: dict[int, ForcedCallStream] = {}
    done: set[int] = set()
    keep, last = holdback(call.params), None

    def chunk(index: int, delta: dict, logprobs, finish: Optional[str], so_far: dict) -> str:
        body = {"id": call.request_id, "object": "chat.completion.chunk",
                "created": created, "model": served.model_name(req.model),
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                             "finish_reason": finish}]}
        if req.continuous_usage:
            body["usage"] = so_far
        return sse(body)
    try:
        async for _, out in merged(served, [call]):
            last = ticket.seen[0] = out
            for c in out.outputs:
                if c.index in done:
                    continue
                if req.forced_tool is not None:
                    if c.index not in forced:
                        forced[c.index] = ForcedCallStream(req.forced_tool)
                    steps = _forced_deltas(forced[c.index], c, keep)
                else:
                    step = _answer_delta(served, req, c, sent.get(c.index, (0, 0, 0)), keep,
                                         thinking)
                    steps = [] if step is None else [step]
                for n, (delta, lp, finish, upto, thought) in enumerate(steps):
                    if n == 0 and lp is None and req.logprobs:
                        # the tokens since the last chunk ride on the next one
                        lp = _logprobs(served.tokenizer, c, sent.get(c.index, (0, 0, 0))[1],
                                       req.top_logprobs or 0)
                    if c.index not in sent:     # the role rides on the choice's first chunk
                        delta = {"role": "assistant", **delta}
                    yield chunk(c.index, delta, lp, finish, choice_usage(out, c))
                    sent[c.index] = (upto, len(c.token_ids), thought)
                if c.finished:
                    done.add(c.index)
        if last is not None:
            await ticket.complete([last])
        if req.include_usage and last is not None:
            yield sse({"id": call.request_id, "object": "chat.completion.chunk",
                       "created": created, "model": served.model_name(req.model), "choices": [],
                       "usage": usage([last])})
    except Exception as e:          # noqa: BLE001 - an error after the stream began
        ticket.abandon()
        yield sse_error(e)
    finally:
        ticket.abandon()            # the client left mid-stream (no-op once completed)
    yield SSE_DONE


def _thinking(served: ServedModel, req: ChatCompletionRequest,
              ids: list[int]) -> Optional[ThinkParser]:
    """The request's reasoning split, with a reasoning parser. A forced call has
    none (its grammar holds from the first token); neither does an answer under
    a constraint begin inside the thinking, whatever the prompt says."""
    if served.reasoning_parser is None or req.forced_tool is not None:
        return None
    parser = ThinkParser.for_prompt(served.tokenizer, ids)
    return ThinkParser(False) if parser.inside and req.constraint() is not None else parser


async def create_chat_completion(served: ServedModel, req: ChatCompletionRequest, raw: Request):
    served.check_task("generate", "/v1/chat/completions")
    lora = served.check_model(req.model, raw.state.tenant)
    served.check_priority(req.priority)
    if req.auto_tools and served.tool_parser is None:
        raise InvalidRequest("tool_choice 'auto' (the default with tools) needs the server "
                             "started with --enable-auto-tool-choice --tool-call-parser hermes; "
                             "or give 'required', a named function or 'none'", "tool_choice")
    ids = await chat_prompt_ids(served, req)
    thinking = _thinking(served, req, ids)
    # validating compiles a constraint's grammar: off the event loop too
    [call] = await asyncio.to_thread(served.validated, [_call(served, req, ids, lora)])
    ticket = served.accounting.admit(raw.state.tenant, [call], call.request_id)
    if req.stream:
        return TicketedStream(_stream(served, req, call, now(), ticket, thinking), ticket)
    try:
        outputs = await collect(served, [call], raw, ticket.seen)
        body = _final(served, req, outputs[0], thinking)
        await ticket.complete(outputs)
    finally:                        # the client left, or the call or the answer failed
        ticket.abandon()
    return JSONResponse(body)
