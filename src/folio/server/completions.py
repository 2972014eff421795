"""POST /v1/completions.

`max_tokens: 0` with `echo: true` scores a prompt without generating (as vLLM
allows): the engine runs with one token to generate, and that token is
dropped from the answer, which holds the prompt, its logprobs when asked, and
usage with no completion tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import JSONResponse

from folio.engine.protocol import BeamSearchParams
from folio.outputs import CompletionOutput, RequestOutput
from folio.server.protocol import CompletionRequest, now, random_id
from folio.server.serving import (SSE_DONE, EngineCall, HTTPError, ServedModel, TicketedStream,
                                  choice_usage, collect, holdback, json_logprob, merged,
                                  off_loop, sse, sse_error, token_text, usage)


async def prompt_ids(served: ServedModel, prompt) -> list[tuple[Optional[str], list[int]]]:
    """Strings are tokenized off the event loop; token ids are used verbatim."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise HTTPError(400, "prompt must not be empty", "prompt")
    if all(isinstance(t, int) for t in prompt):
        return [(None, list(prompt))]
    out = []
    for p in prompt:
        if isinstance(p, str):
            if not p:
                raise HTTPError(400, "prompt must not be empty", "prompt")
            out.append((p, await off_loop(served.tokenizer.encode, p)))
        elif isinstance(p, list) and all(isinstance(t, int) for t in p):
            out.append((None, list(p)))
        else:
            raise HTTPError(400, "prompt must be a string, a list of strings, a list of token "
                                 "ids or a list of token-id lists", "prompt")
    return out


def _beam_params(req: CompletionRequest, max_tokens: int) -> BeamSearchParams:
    """use_beam_search: best_of (or n) beams are searched, the n best returned."""
    return BeamSearchParams(beam_width=req.best_of or req.n, max_tokens=max_tokens,
                            length_penalty=req.length_penalty, ignore_eos=req.ignore_eos,
                            early_stopping=req.early_stopping)


def _calls(served: ServedModel, req: CompletionRequest, prompts, lora=None
           ) -> list[EngineCall]:
    base = random_id("cmpl")
    calls = []
    asked = 1 if req.scores_prompt_only else req.max_tokens
    for i, (text, ids) in enumerate(prompts):
        max_tokens = served.max_tokens_for(len(ids), asked, req.min_tokens)
        if req.use_beam_search:
            calls.append(EngineCall(f"{base}-{i}", text, ids, _beam_params(req, max_tokens),
                                    req.priority, lora))
            continue
        prompt_lp = req.logprobs if (req.echo and req.logprobs is not None) else None
        params = req.sampling_params(max_tokens, req.logprobs, prompt_lp,
                                     defaults=served.sampling_defaults)
        calls.append(EngineCall(f"{base}-{i}", text, ids, params, req.priority, lora))
    return calls


class _Logprobs:
    """OpenAI completion logprobs: parallel arrays, offsets into the returned text."""

    def __init__(self, tokenizer, offset: int = 0):
        self.tok, self.offset = tokenizer, offset
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []

    def add(self, token_id: int, entry: Optional[dict[int, float]]) -> None:
        text = token_text(self.tok, token_id)
        self.tokens.append(text)
        self.text_offset.append(self.offset)
        self.offset += len(text)
        if entry is None:
            self.token_logprobs.append(None)
            self.top_logprobs.append(None)
        else:
            self.token_logprobs.append(json_logprob(entry[token_id]))
            self.top_logprobs.append({token_text(self.tok, t): json_logprob(lp)
                                      for t, lp in entry.items()})

    def body(self) -> dict:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs,
                "top_logprobs": self.top_logprobs, "text_offset": self.text_offset}


def _choice_logprobs(tokenizer, out: RequestOutput, c: CompletionOutput, echo: bool) -> dict:
    lp = _Logprobs(tokenizer)
    if echo:
        for token, entry in zip(out.prompt_token_ids, out.prompt_logprobs or []):
            lp.add(token, entry)
    for token, entry in zip(c.token_ids, c.logprobs or []):
        lp.add(token, entry)
    return lp.body()


def _prompt_only(out: RequestOutput) -> RequestOutput:
    """A scoring answer: the one generated token dropped, each choice ending at the prompt."""
    outs = [dataclasses.replace(c, text="", token_ids=[], cumulative_logprob=None,
                                logprobs=None if c.logprobs is None else [],
                                finish_reason="length", stop_reason=None)
            for c in out.outputs]
    return dataclasses.replace(out, outputs=outs)


async def _prompts_scored(outputs: AsyncIterator[tuple[int, RequestOutput]]
                          ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """A scoring stream: each prompt's answer comes whole, once its request finished."""
    async for i, out in outputs:
        if out.finished:
            yield i, _prompt_only(out)


def _final(served: ServedModel, req: CompletionRequest, outputs: list[RequestOutput]) -> dict:
    if req.scores_prompt_only:
        outputs = [_prompt_only(out) for out in outputs]
    choices = []
    for i, out in enumerate(outputs):
        prefix = (out.prompt or served.tokenizer.decode(out.prompt_token_ids,
                                                        skip_special_tokens=False)
                  ) if req.echo else ""
        for c in out.outputs[:req.n]:
            choices.append({
                "index": i * req.n + c.index, "text": prefix + c.text,
                "logprobs": (_choice_logprobs(served.tokenizer, out, c, req.echo)
                             if req.logprobs is not None else None),
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
    return {"id": outputs[0].request_id.rsplit("-", 1)[0], "object": "text_completion",
            "created": now(), "model": served.model_name(req.model), "choices": choices,
            "usage": usage(outputs)}


async def _stream(served: ServedModel, req: CompletionRequest, calls: list[EngineCall],
                  created: int, ticket) -> AsyncIterator[str]:
    rid = calls[0].request_id.rsplit("-", 1)[0]
    sent: dict[int, tuple[int, int]] = {}          # choice -> (chars sent, tokens sent)
    finals: dict[int, RequestOutput] = ticket.seen
    keep = holdback(calls[0].params)

    def chunk(index: int, text: str, logprobs, finish: Optional[str], so_far: dict) -> str:
        body = {"id": rid, "object": "text_completion", "created": created,
                "model": served.model_name(req.model), "choices": [{"index": index, "text": text,
                                                   "logprobs": logprobs,
                                                   "finish_reason": finish}]}
        if req.continuous_usage:
            body["usage"] = so_far
        return sse(body)
    outputs = merged(served, calls)
    if req.scores_prompt_only:
        outputs = _prompts_scored(outputs)
    try:
        async for i, out in outputs:
            finals[i] = out
            for c in out.outputs:
                index = i * req.n + c.index
                if index in sent and sent[index][0] < 0:
                    continue                        # its finish chunk already went out
                chars, toks = sent.get(index, (0, 0))
                if index not in sent and not c.token_ids and not c.finished:
                    continue                        # wait for the first token (and prompt scores)
                prefix = ""
                if index not in sent and req.echo:
                    prefix = out.prompt or served.tokenizer.decode(out.prompt_token_ids,
                                                                   skip_special_tokens=False)
                upto = len(c.text) if c.finished else max(chars, len(c.text) - keep)
                if upto <= chars and not c.finished and not prefix:
                    sent.setdefault(index, (chars, toks))
                    continue
                lp = None
                if req.logprobs is not None:
                    lp = _Logprobs(served.tokenizer, chars)
                    if prefix:
                        for token, entry in zip(out.prompt_token_ids, out.prompt_logprobs or []):
                            lp.add(token, entry)
                    for token, entry in zip(c.token_ids[toks:], (c.logprobs or [])[toks:]):
                        lp.add(token, entry)
                    lp = lp.body()
                yield chunk(index, prefix + c.text[chars:upto], lp, c.finish_reason,
                            choice_usage(out, c))
                sent[index] = (-1, 0) if c.finished else (upto, len(c.token_ids))
        await ticket.complete([finals[i] for i in sorted(finals)])
        if req.include_usage:
            yield sse({"id": rid, "object": "text_completion", "created": created,
                       "model": served.model_name(req.model), "choices": [],
                       "usage": usage([finals[i] for i in sorted(finals)])})
    except Exception as e:          # noqa: BLE001 - an error after the stream began
        ticket.abandon()
        yield sse_error(e)
    finally:
        ticket.abandon()            # the client left mid-stream (no-op once completed)
    yield SSE_DONE


async def create_completion(served: ServedModel, req: CompletionRequest, raw: Request):
    served.check_task("generate", "/v1/completions")
    lora = served.check_model(req.model, raw.state.tenant)
    served.check_priority(req.priority)
    prompts = await prompt_ids(served, req.prompt)
    # validating compiles a constraint's grammar: off the event loop
    calls = await asyncio.to_thread(served.validated, _calls(served, req, prompts, lora))
    ticket = served.accounting.admit(raw.state.tenant, calls,
                                     calls[0].request_id.rsplit("-", 1)[0])
    if req.stream:
        return TicketedStream(_stream(served, req, calls, now(), ticket), ticket)
    try:
        outputs = await collect(served, calls, raw, ticket.seen)
        body = _final(served, req, outputs)
        # a scoring answer is charged as it is sent: without the one dropped token
        await ticket.complete([_prompt_only(o) for o in outputs] if req.scores_prompt_only
                              else outputs)
    finally:                        # the client left, or a call or the answer failed
        ticket.abandon()
    return JSONResponse(body)
