"""The server/engine boundary: the server holds an EngineClient and nothing else.

No module under server/ reaches the LLMEngine or its scheduler, or imports the
model or the workers (checked on the source, with ast); the metrics callback
gets a StepStats message whose numbers are the scheduler's; and a request is
validated once, by the input processor, however it reaches the engine.
"""

import ast
import asyncio
import inspect
import os
import time
from pathlib import Path

import pytest

from folio import BeamSearchParams, SamplingParams
from folio.engine.async_engine import AsyncLLMEngine
from folio.engine.llm_engine import LLMEngine
from folio.engine.protocol import EngineClient, StepStats, ValidatedPrompt
from folio.server.metrics import ServerMetrics
from tests.utils import make_tiny_model

SERVER = Path(__file__).resolve().parents[2] / "src" / "folio" / "server"
FORBIDDEN = ("folio.model", "folio.worker")


def _forbidden_module(name: str) -> bool:
    return any(name == f or name.startswith(f + ".") for f in FORBIDDEN)


def _absolute(node: ast.ImportFrom) -> str:
    """The module an import names, relative ones resolved from folio.server."""
    if node.level == 0:
        return node.module or ""
    base = ["folio", "server"][:max(0, 3 - node.level)]
    return ".".join(base + ([node.module] if node.module else []))


def boundary_violations(source: str) -> list[str]:
    """Imports of the model or the workers (anywhere, also `from folio import model`,
    relative ones, and names handed to importlib), and the chains `.engine.engine`
    and `.scheduler`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if _forbidden_module(a.name)]
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(node)
            names = [module] + [f"{module}.{a.name}" for a in node.names]
            if any(_forbidden_module(n) for n in names):
                found.append(f"from {module} import ...")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if _forbidden_module(node.value):
                found.append(f"the string {node.value!r}")
        elif isinstance(node, ast.Attribute):
            if node.attr == "scheduler":
                found.append(".scheduler")
            elif (node.attr == "engine" and isinstance(node.value, ast.Attribute)
                  and node.value.attr == "engine"):
                found.append(".engine.engine")
    return found


def test_the_boundary_check_finds_what_it_looks_for():
    snippet = ("import folio.worker.kv_cache\n"
               "def f(served):\n"
               "    from folio.model.loader import DEFAULT_MODEL\n"
               "    from folio import model\n"
               "    from ..worker import executor\n"
               "    return served.engine.engine.scheduler.num_waiting\n")
    assert sorted(boundary_violations(snippet)) == sorted([
        "import folio.worker.kv_cache", "from folio.model.loader import ...",
        "from folio import ...", "from folio.worker import ...", ".engine.engine",
        ".scheduler"])
    assert boundary_violations("from folio.engine.protocol import EngineClient\n"
                               "from . import serving\n"
                               "x = served.engine.tokenizer\n") == []


def test_no_server_module_reaches_past_the_engine_client():
    modules = sorted(SERVER.glob("*.py"))
    assert len(modules) >= 8
    found = {m.name: boundary_violations(m.read_text()) for m in modules}
    assert {name: v for name, v in found.items() if v} == {}


def test_the_async_engine_implements_every_member_itself():
    members = [n for n in vars(EngineClient) if not n.startswith("_")]
    assert set(members) >= {"generate", "abort", "validate", "tokenizer", "model_config",
                            "max_model_len", "scheduling_policy", "is_dead", "check_health",
                            "check_kv_cache", "shutdown"}
    for name in members:
        assert name in vars(AsyncLLMEngine), name
        declared, actual = vars(EngineClient)[name], vars(AsyncLLMEngine)[name]
        if callable(declared):
            assert list(inspect.signature(actual).parameters) == \
                list(inspect.signature(declared).parameters), name


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("client"), max_position_embeddings=256)


@pytest.fixture(scope="module")
def steps():
    return []


@pytest.fixture(scope="module")
def client(tiny, steps):
    metrics = ServerMetrics("tiny")

    def on_step(stats, outputs):
        steps.append(stats)
        metrics.on_step(stats, outputs)
    engine = LLMEngine.from_args(tiny, dtype="float32", num_kv_blocks=64, block_size=8,
                                 max_num_seqs=2)
    client = AsyncLLMEngine(engine, on_step=on_step)
    client.metrics = metrics            # for the test to read
    yield client
    client.shutdown()


def run_all(client, prompts, params):
    async def one(i, ids):
        last = None
        async for last in client.generate(f"r{i}", None, ids, params):
            pass
        return last

    async def main():
        return await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts)))
    return asyncio.run(main())


def metric(metrics: ServerMetrics, name: str) -> float:
    return metrics.registry.get_sample_value(name, {"model_name": "tiny"})


def test_step_stats_carry_the_schedulers_counts(client, steps):
    steps.clear()
    generated = metric(client.metrics, "folio:generation_tokens_total")
    steps_before = metric(client.metrics, "folio:engine_steps_total") or 0
    busy_before = metric(client.metrics, "folio:engine_busy_seconds_total") or 0
    shared = list(range(1, 18))              # two full 8-token blocks, shared by all three
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    t0 = time.perf_counter()
    outs = run_all(client, [shared + [100 + i] for i in range(3)], params)
    wall = time.perf_counter() - t0
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6, 6]
    assert steps and all(isinstance(s, StepStats) for s in steps)
    # max_num_seqs=2: two run while the third waits, never three at once.
    assert any((s.num_running, s.num_waiting) == (2, 1) for s in steps)
    assert max(s.num_running for s in steps) == 2
    assert all(s.num_running + s.num_waiting <= 3 for s in steps)
    assert any(s.kv_cache_usage > 0 for s in steps) and all(
        0 <= s.kv_cache_usage <= 1 and 0 <= s.kv_cache_waste <= 1 for s in steps)
    last, sched = steps[-1], client.engine.scheduler
    assert (last.num_running, last.num_waiting, last.kv_cache_usage) == (0, 0, 0)
    assert (last.num_preemptions, last.prefix_cache_queries, last.prefix_cache_hits) == \
        (sched.num_preemptions, sched.prefix_cache_queries, sched.prefix_cache_hits)
    assert last.num_preemptions == 0 and last.prefix_cache_hits >= 16   # the third found them
    m = client.metrics
    assert metric(m, "folio:num_requests_waiting") == 0
    assert metric(m, "folio:prefix_cache_hits_total") == last.prefix_cache_hits
    assert metric(m, "folio:generation_tokens_total") == generated + 18
    # the step rate's counters: one step a callback at most; the third request
    # waited for a place, so at least 12 steps ran, in at most the run's time
    ran = [b.num_steps - a.num_steps for a, b in zip(steps, steps[1:])]
    assert all(0 <= n <= 1 for n in ran)
    assert last.num_steps - steps_before >= 12
    assert metric(m, "folio:engine_steps_total") == last.num_steps
    busy = last.busy_seconds - busy_before
    assert 0 < busy <= wall
    assert metric(m, "folio:engine_busy_seconds_total") == pytest.approx(last.busy_seconds)


def count_checks(client, monkeypatch) -> list:
    calls = []
    processor = client.engine.input_processor
    real = processor.validate

    def counted(ids, params):
        calls.append(list(ids))
        return real(ids, params)
    monkeypatch.setattr(processor, "validate", counted)
    return calls


def test_a_validated_prompt_is_not_checked_again(client, monkeypatch):
    calls = count_checks(client, monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=2)
    checked = client.validate([1, 2, 3], params)
    assert isinstance(checked, ValidatedPrompt) and checked == [1, 2, 3]
    [out] = run_all(client, [checked], params)
    assert len(out.outputs[0].token_ids) == 2 and calls == [[1, 2, 3]]


def test_an_unvalidated_prompt_is_checked_once(client, monkeypatch):
    calls = count_checks(client, monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=2)
    run_all(client, [[4, 5, 6]], params)
    assert calls == [[4, 5, 6]]
    # Checked for other params, it vouches for nothing here.
    other = client.validate([7, 8], SamplingParams(max_tokens=1))
    run_all(client, [other], params)
    assert calls == [[4, 5, 6], [7, 8], [7, 8]]


def test_a_bad_request_fails_in_generate_before_anything_is_queued(client):
    vocab = client.model_config.vocab_size
    with pytest.raises(ValueError, match=f"token id {vocab} is outside the vocabulary"):
        run_all(client, [[1, vocab]], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match=r"beam_width 11 ranks the top 22 .* max_logprobs"):
        client.validate([1, 2], BeamSearchParams(beam_width=11, max_tokens=2))
    assert not client.engine.scheduler.requests and client.num_in_flight == 0
    client.check_health()


def test_the_client_answers_what_the_server_reads(client, tiny):
    assert os.path.samefile(client.model_config.path, tiny) and client.max_model_len == 256
    assert client.scheduling_policy == "fcfs" and not client.is_dead
    assert client.tokenizer is client.engine.tokenizer
    client.check_kv_cache()                  # 64 x 8 tokens hold one 256-token sequence


def test_a_kv_cache_too_small_is_refused_by_the_engine(tiny):
    engine = LLMEngine.from_args(tiny, dtype="float32", num_kv_blocks=15, block_size=16)
    try:
        with pytest.raises(ValueError, match=r"the KV cache is too small: it holds 240 tokens "
                                             r".* max_model_len=256 .* --num-kv-blocks 16 "):
            engine.check_kv_cache()
    finally:
        engine.shutdown()


def test_the_prefix_cache_is_emptied_only_when_nothing_holds_blocks(client):
    shared = list(range(1, 18))
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    run_all(client, [shared + [200]], params)

    async def reset_while_one_runs() -> tuple[bool, int]:
        long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        stream = client.generate("busy", None, shared + [201], long)
        await stream.__anext__()                    # running: it holds blocks
        busy = await client.reset_prefix_cache()
        load = client.num_in_flight
        async for _ in stream:
            pass
        return busy, load
    busy, load = asyncio.run(reset_while_one_runs())
    assert not busy and load == 1
    assert asyncio.run(client.reset_prefix_cache()) is True
    hits = client.engine.scheduler.prefix_cache_hits
    run_all(client, [shared + [202]], params)       # emptied: nothing found
    assert client.engine.scheduler.prefix_cache_hits == hits
    run_all(client, [shared + [203]], params)       # found again once cached anew
    assert client.engine.scheduler.prefix_cache_hits >= hits + 16


def test_a_stream_that_falls_behind_gets_the_newest_output_with_every_token(client):
    """Outputs are cumulative: a consumer slower than the engine takes the
    newest one waiting and skips those before it (one chunk for several
    tokens), and ends with exactly what a consumer that kept up got."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ids = [5, 6, 7, 8, 9]

    async def consume(request_id, pause):
        seen = []
        async for out in client.generate(request_id, None, ids, params):
            seen.append(list(out.outputs[0].token_ids))
            if pause:
                await asyncio.sleep(pause)
        return seen

    kept_up = asyncio.run(consume("fast", 0))
    behind = asyncio.run(consume("slow", 0.02))
    assert kept_up[-1] == behind[-1] and len(behind[-1]) == 24
    assert len(behind) < len(kept_up)              # outputs were skipped over...
    for before, after in zip(behind, behind[1:]):  # ...and each one it got extends the last
        assert after[:len(before)] == before and len(after) > len(before)


def test_the_outputs_before_an_error_are_not_skipped():
    """_Outputs merges only cumulative outputs: an error waits behind the
    output queued before it, and a finished output ends the stream."""
    from folio.engine.async_engine import _Outputs
    from folio.outputs import CompletionOutput, RequestOutput

    def output(n, finished=False):
        return RequestOutput("r", None, [1], [CompletionOutput(0, "", list(range(n)), 0.0,
                                                               None, None, None)],
                             finished=finished)

    async def main():
        q = _Outputs()
        first, second, third, error = output(1), output(2), output(3), ValueError("gone")
        for item in (first, second, error, third):
            q.put(item)
        got = [await q.next(), await q.next(), await q.next()]
        assert got == [second, error, third]
        finished = output(4, finished=True)
        q.put(finished)
        assert await q.next() is finished
        waiting = asyncio.ensure_future(q.next())      # nothing queued: it waits
        await asyncio.sleep(0)
        assert not waiting.done()
        q.put(first)
        assert await waiting is first
    asyncio.run(main())
