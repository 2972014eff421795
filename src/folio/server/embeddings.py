"""POST /v1/embeddings (OpenAI's shape): each input's embedding, pooled by
the engine as the model's pooling says (engine/llm_engine.py's pooling
requests; `dimensions` keeps the first N values, then normalizes).

Served only by a server whose model runs for embeddings (`--task embed`, or
a sentence-transformers folder under `--task auto`); a generation server
answers 400 naming `--task`, and an embedding server does so on the
completion endpoints. POST /v1/rerank and /score (vLLM's shapes) are a
cross-encoder's (`--task score`): each (query, document) pair one input as
the tokenizer joins two texts, its score the sigmoid of the model's logit. Inputs are checked before any runs (too long a one is
a 400 naming max_model_len); usage (prompt tokens) goes to the tenants'
ledger as a completion's does; a client that hangs up aborts them all.
"""

from __future__ import annotations

import asyncio
import base64
import struct
from typing import Optional

from fastapi import Request
from fastapi.responses import JSONResponse

from folio.pooling_params import PoolingParams, sigmoid
from folio.server.completions import prompt_ids
from folio.server.protocol import (EmbeddingRequest, RerankRequest, ScoreRequest, now,
                                   random_id)
from folio.server.serving import EngineCall, HTTPError, ServedModel, collect, off_loop


def _computed(outputs: list) -> list:
    """The outputs, each with its vector: one the engine ended without (out of
    KV cache) is a 503 rather than an empty vector."""
    for o in outputs:
        if not o.outputs.embedding:
            raise HTTPError(503, f"the engine ended an input without computing it "
                                 f"({o.outputs.finish_reason}): retry later")
    return outputs


def _encoded(vector: list[float], encoding: str):
    if encoding == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


async def create_embedding(served: ServedModel, req: EmbeddingRequest, raw: Request):
    served.check_task("embed", "/v1/embeddings")
    lora = served.check_model(req.model, raw.state.tenant)
    served.check_priority(req.priority)
    try:
        inputs = await prompt_ids(served, req.input)
    except HTTPError as e:              # its messages say "prompt": here the field is input
        raise HTTPError(e.status, str(e.message).replace("prompt", "input"), "input") from None
    params = PoolingParams(dimensions=req.dimensions)
    base = random_id("embd")
    calls = [EngineCall(f"{base}-{i}", text, ids, params, req.priority, lora)
             for i, (text, ids) in enumerate(inputs)]
    try:
        calls = await asyncio.to_thread(served.validated, calls)
    except ValueError as e:
        raise HTTPError(400, str(e), "dimensions" if "dimensions" in str(e) else "input") \
            from None
    ticket = served.accounting.admit(raw.state.tenant, calls, base)
    try:
        outputs = _computed(await collect(served, calls, raw, ticket.seen))
        prompt = sum(len(o.prompt_token_ids) for o in outputs)
        body = {"id": base, "object": "list", "created": now(),
                "model": served.model_name(req.model),
                "data": [{"object": "embedding", "index": i,
                          "embedding": _encoded(o.outputs.embedding, req.encoding_format)}
                         for i, o in enumerate(outputs)],
                "usage": {"prompt_tokens": prompt, "total_tokens": prompt}}
        await ticket.complete(outputs)
    finally:                        # the client left, or a call or the answer failed
        ticket.abandon()
    return JSONResponse(body)


async def _scores(served: ServedModel, pairs: list[tuple[str, str]], model: Optional[str],
                  priority: int, raw: Request, endpoint: str, prefix: str):
    """(response id, each pair's score, the tokens read) of a cross-encoder."""
    served.check_task("score", endpoint)
    lora = served.check_model(model, raw.state.tenant)
    served.check_priority(priority)
    if served.engine.model_config.num_labels != 1:
        raise HTTPError(400, f"{served.name} has {served.engine.model_config.num_labels} "
                             "labels: scores need a cross-encoder with one", "model")
    encoded = [await off_loop(served.tokenizer.encode_pair, a, b) for a, b in pairs]
    base = random_id(prefix)
    calls = [EngineCall(f"{base}-{i}", None, ids,
                        PoolingParams(pooling="classify", second_text_start=start), priority, lora)
             for i, (ids, start) in enumerate(encoded)]
    try:
        calls = await asyncio.to_thread(served.validated, calls)
    except ValueError as e:
        raise HTTPError(400, str(e), None) from None
    ticket = served.accounting.admit(raw.state.tenant, calls, base)
    try:
        outputs = _computed(await collect(served, calls, raw, ticket.seen))
        scores = [sigmoid(o.outputs.embedding[0]) for o in outputs]
        await ticket.complete(outputs)
    finally:
        ticket.abandon()
    return base, scores, sum(len(o.prompt_token_ids) for o in outputs)


async def create_rerank(served: ServedModel, req: RerankRequest, raw: Request):
    base, scores, tokens = await _scores(served, [(req.query, d) for d in req.documents],
                                         req.model, req.priority, raw, "/v1/rerank", "rerank")
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    if req.top_n:
        order = order[:req.top_n]
    results = [{"index": i, "relevance_score": scores[i],
                **({"document": {"text": req.documents[i]}} if req.return_documents else {})}
               for i in order]
    return JSONResponse({"id": base, "model": served.model_name(req.model),
                         "usage": {"total_tokens": tokens}, "results": results})


async def create_score(served: ServedModel, req: ScoreRequest, raw: Request):
    base, scores, tokens = await _scores(served, req.pairs(), req.model, req.priority, raw,
                                         "/score", "score")
    return JSONResponse({"id": base, "object": "list", "created": now(),
                         "model": served.model_name(req.model),
                         "data": [{"index": i, "object": "score", "score": s}
                                  for i, s in enumerate(scores)],
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
