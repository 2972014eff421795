"""POST /v1/chat/completions."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from folio.outputs import CompletionOutput, RequestOutput
from folio.server.protocol import ChatCompletionRequest, now, random_id
from folio.server.serving import (SSE_DONE, EngineCall, HTTPError, ServedModel, collect, holdback,
                                  merged, sse, sse_error, token_text, usage)


def _render(served: ServedModel, req: ChatCompletionRequest) -> tuple[str, list[int]]:
    kwargs = dict(add_generation_prompt=req.add_generation_prompt,
                  continue_final_message=req.continue_final_message,
                  chat_template=req.chat_template, **(req.chat_template_kwargs or {}))
    tok = served.tokenizer
    return tok.apply_chat_template(req.messages, **kwargs), tok.encode_chat(req.messages, **kwargs)


def _call(served: ServedModel, req: ChatCompletionRequest, text: str, ids: list[int]) -> EngineCall:
    asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = served.max_tokens_for(len(ids), asked)
    if req.top_logprobs is not None and not req.logprobs:
        raise HTTPError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return EngineCall(random_id("chatcmpl"), text, ids,
                      req.sampling_params(max_tokens, logprobs), req.priority)


def _entry(tokenizer, token_id: int, logprob: float) -> dict:
    text = token_text(tokenizer, token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def _logprobs(tokenizer, c: CompletionOutput, start: int, top: int) -> dict:
    content = []
    for token, entry in zip(c.token_ids[start:], (c.logprobs or [])[start:]):
        item = _entry(tokenizer, token, entry[token])
        ranked = sorted(entry.items(), key=lambda kv: -kv[1])[:top]
        item["top_logprobs"] = [_entry(tokenizer, t, lp) for t, lp in ranked]
        content.append(item)
    return {"content": content}


def _final(served: ServedModel, req: ChatCompletionRequest, out: RequestOutput) -> dict:
    choices = [{"index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": (_logprobs(served.tokenizer, c, 0, req.top_logprobs or 0)
                             if req.logprobs else None),
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
               for c in out.outputs]
    return {"id": out.request_id, "object": "chat.completion", "created": now(),
            "model": served.name, "choices": choices, "usage": usage([out])}


async def _stream(served: ServedModel, req: ChatCompletionRequest, call: EngineCall,
                  created: int) -> AsyncIterator[str]:
    sent: dict[int, tuple[int, int]] = {}   # choice -> (chars sent, tokens sent)
    done: set[int] = set()
    keep, last = holdback(call.params), None

    def chunk(index: int, delta: dict, logprobs, finish: Optional[str]) -> str:
        return sse({"id": call.request_id, "object": "chat.completion.chunk",
                    "created": created, "model": served.name,
                    "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                 "finish_reason": finish}]})
    try:
        async for _, out in merged(served, [call]):
            last = out
            for c in out.outputs:
                if c.index in done:
                    continue
                chars, toks = sent.get(c.index, (0, 0))
                upto = len(c.text) if c.finished else max(chars, len(c.text) - keep)
                if upto <= chars and not c.finished:
                    continue
                # The role rides on the choice's first chunk, sent with its first text.
                delta = {"role": "assistant"} if c.index not in sent else {}
                delta["content"] = c.text[chars:upto]
                lp = (_logprobs(served.tokenizer, c, toks, req.top_logprobs or 0)
                      if req.logprobs else None)
                yield chunk(c.index, delta, lp, c.finish_reason)
                sent[c.index] = (upto, len(c.token_ids))
                if c.finished:
                    done.add(c.index)
        if req.include_usage and last is not None:
            yield sse({"id": call.request_id, "object": "chat.completion.chunk",
                       "created": created, "model": served.name, "choices": [],
                       "usage": usage([last])})
    except Exception as e:          # noqa: BLE001 - an error after the stream began
        yield sse_error(e)
    yield SSE_DONE


async def create_chat_completion(served: ServedModel, req: ChatCompletionRequest, raw: Request):
    served.check_model(req.model)
    text, ids = await asyncio.to_thread(_render, served, req)
    call = _call(served, req, text, ids)
    served.engine.engine.input_processor.validate(call.prompt_ids, call.params)
    if req.stream:
        return StreamingResponse(_stream(served, req, call, now()),
                                 media_type="text/event-stream")
    outputs = await collect(served, [call], raw)
    return JSONResponse(_final(served, req, outputs[0]))
