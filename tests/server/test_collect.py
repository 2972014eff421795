"""serving.collect: one engine call failing ends the others at once (their
tasks are cancelled, which aborts their engine requests); nobody generates
for a client that already has its error."""

import asyncio
from types import SimpleNamespace

import pytest

from folio.server.serving import EngineCall, collect


class StubEngine:
    def __init__(self):
        self.cancelled, self.finished = [], []

    async def generate(self, request_id, prompt, ids, params, priority, lora_request=None):
        try:
            for step in range(200):
                await asyncio.sleep(0.01)
                if request_id == "bad" and step == 3:
                    raise RuntimeError("failed in the engine")
                yield SimpleNamespace(request_id=request_id, step=step)
            self.finished.append(request_id)
        except asyncio.CancelledError:
            self.cancelled.append(request_id)
            raise


class StillThere:
    async def is_disconnected(self):
        return False


def test_one_failing_call_cancels_the_others():
    engine = StubEngine()
    served = SimpleNamespace(engine=engine, request_timeout=None)
    calls = [EngineCall(rid, None, [1], None) for rid in ("good-1", "bad", "good-2")]

    async def main():
        with pytest.raises(RuntimeError, match="failed in the engine"):
            await collect(served, calls, StillThere())

    asyncio.run(main())
    assert sorted(engine.cancelled) == ["good-1", "good-2"] and not engine.finished


def test_all_calls_finish_in_order():
    engine = StubEngine()
    served = SimpleNamespace(engine=engine, request_timeout=None)
    calls = [EngineCall(rid, None, [1], None) for rid in ("a", "b")]
    outs = asyncio.run(collect(served, calls, StillThere()))
    assert [o.request_id for o in outs] == ["a", "b"] and sorted(engine.finished) == ["a", "b"]
