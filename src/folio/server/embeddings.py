"""POST /v1/embeddings (OpenAI's shape): each input's embedding, pooled by
the engine as the model's pooling says (engine/llm_engine.py's pooling
requests; `dimensions` keeps the first N values, then normalizes).

Served only by a server whose model runs for embeddings (`--task embed`, or
a sentence-transformers folder under `--task auto`); a generation server
answers 400 naming `--task`, and an embedding server does so on the
completion endpoints. Inputs are checked before any runs (too long a one is
a 400 naming max_model_len); usage (prompt tokens) goes to the tenants'
ledger as a completion's does; a client that hangs up aborts them all.
"""

from __future__ import annotations

import asyncio
import base64
import struct

from fastapi import Request
from fastapi.responses import JSONResponse

from folio.pooling_params import PoolingParams
from folio.server.completions import prompt_ids
from folio.server.protocol import EmbeddingRequest, now, random_id
from folio.server.serving import EngineCall, HTTPError, ServedModel, collect


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
        outputs = await collect(served, calls, raw, ticket.seen)
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
