"""Who sent a request, whether their limits admit it, and what it used.

The auth middleware asks `authenticate` for the caller's tenant; a handler
asks `admit` once the request's prompts are validated (so the token estimate
is known), and gives the Ticket it gets the outputs as they come. A ticket
ends once: `complete` (the response is whole) charges the tokens used and
waits for the ledger row's commit before the handler sends the last bytes;
`abandon` (the client left, or the request failed) charges what was
generated and writes its row without waiting.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Callable, Optional

from folio.outputs import RequestOutput
from folio.server.cost import CostMeter
from folio.server.metrics import ServerMetrics
from folio.server.serving import EngineCall, HTTPError, usage
from folio.server.tenants import ANONYMOUS, KeyBook, Limiter, RateLimited, Tenant
from folio.server.usage_ledger import UsageLedger, UsageRow


class Accounting:
    def __init__(self, model: str, metrics: ServerMetrics, keys: Optional[KeyBook] = None,
                 ledger: Optional[UsageLedger] = None, cost: Optional[CostMeter] = None,
                 clock: Callable[[], float] = time.time):
        self.model, self.metrics, self.keys, self.ledger, self.cost = (model, metrics, keys,
                                                                       ledger, cost)
        self.limiter = Limiter(clock)
        self._clock = clock
        self._anonymous = Tenant(ANONYMOUS)

    def authenticate(self, authorization: str) -> Tenant:
        if self.keys is None:
            return self._anonymous
        tenant = self.keys.tenant_for(authorization)
        if tenant is None:
            raise HTTPError(401, "invalid or missing API key")
        return tenant

    def admit(self, tenant: Tenant, calls: list[EngineCall], response_id: str) -> "Ticket":
        """`response_id`: the id the client sees, the ledger row's key."""
        prompt = sum(len(c.prompt_ids) for c in calls)
        estimate = prompt + sum(_max_tokens(c) for c in calls)
        try:
            admission = self.limiter.admit(tenant, estimate, prompt)
        except RateLimited as e:
            raise HTTPError(429, str(e), headers={"Retry-After": str(e.retry_after)}) from None
        lora = calls[0].lora if calls else None
        return Ticket(self, tenant, response_id, admission,
                      lora.lora_name if lora is not None else None)

    def _charge(self, ticket: "Ticket", outputs: list[RequestOutput], aborted: bool
                ) -> UsageRow:
        u = usage(outputs)
        prompt, completion = u["prompt_tokens"], u["completion_tokens"]
        ticket.admission.settle(prompt + completion)
        reason = _finish_reason(outputs) if not aborted else "abort"
        self.metrics.on_tenant_usage(ticket.tenant.name, prompt, completion, reason,
                                     ticket.adapter)
        cost = self.cost.cost_of(prompt, completion) if self.cost is not None else None
        end = self._clock()
        return UsageRow(ticket.request_id, end, ticket.tenant.name, self.model, prompt,
                        u["prompt_tokens_details"]["cached_tokens"], completion,
                        end - ticket.start, reason, aborted, cost, ticket.adapter)


class Ticket:
    def __init__(self, accounting: Accounting, tenant: Tenant, request_id: str, admission,
                 adapter: Optional[str] = None):
        self.accounting, self.tenant, self.request_id = accounting, tenant, request_id
        self.adapter = adapter          # the LoRA adapter the request named
        self.admission = admission
        self.start = accounting._clock()
        self.seen: dict[int, RequestOutput] = {}     # each call's latest output
        self.ended = False

    async def complete(self, outputs: list[RequestOutput]) -> None:
        if self.ended:
            return
        self.ended = True
        row = self.accounting._charge(self, outputs, aborted=False)
        ledger = self.accounting.ledger
        if ledger is not None:
            try:
                await ledger.record(row)
            except asyncio.CancelledError:  # the answer never went out: an abort after all
                ledger.submit(dataclasses.replace(row, aborted=True, finish_reason="abort"),
                              replace=True)
                raise

    def abandon(self) -> None:
        if self.ended:
            return
        self.ended = True
        outputs = [self.seen[i] for i in sorted(self.seen)]
        row = self.accounting._charge(self, outputs, aborted=True)
        if self.accounting.ledger is not None:
            self.accounting.ledger.submit(row)


def _max_tokens(call: EngineCall) -> int:
    params = call.params
    width = getattr(params, "n", None) or getattr(params, "beam_width", 1) or 1
    return (getattr(params, "max_tokens", 0) or 0) * width      # (an embedding: none)


def _finish_reason(outputs: list[RequestOutput]) -> Optional[str]:
    reasons = {c.finish_reason for o in outputs
               for c in (o.outputs if isinstance(o.outputs, list) else [o.outputs])}
    return reasons.pop() if len(reasons) == 1 else ",".join(sorted(r or "" for r in reasons))
