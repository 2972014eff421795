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


def test_merged_calls_skip_only_outputs_a_later_one_of_the_same_call_supersedes():
    """The pumps' queue, drained at once: each call's newest output before an
    error or the timeout stands for the ones before it; the rest keep their order."""
    import asyncio

    from folio.outputs import RequestOutput
    from folio.server.serving import _newest

    def out(n):
        return RequestOutput(str(n), None, [1], [], finished=False)

    done, timed_out = object(), object()
    a1, a2, b1, a3, b2 = out(1), out(2), out(3), out(4), out(5)
    error = ValueError("x")

    async def main(items):
        queue = asyncio.Queue()
        for item in items[1:]:
            queue.put_nowait(item)
        return _newest(items[0], queue, done)
    got = asyncio.run(main([(0, a1), (1, b1), (0, a2), (1, b2), (0, done)]))
    assert got == [(0, a2), (1, b2), (0, done)]
    got = asyncio.run(main([(0, a1), (0, a2), (1, error), (0, a3), (None, timed_out)]))
    assert got == [(0, a2), (1, error), (0, a3), (None, timed_out)]
    got = asyncio.run(main([(0, a1)]))
    assert got == [(0, a1)]
