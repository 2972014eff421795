"""Where the engine runs: `folio serve` runs the engine core in a process of
its own (the default, `--engine-process`), `--no-engine-process` in a thread
of the server. The suite's servers run the default; here the official
`openai` client's tests (test_openai_api.py: parity with transformers,
streams, n > 1, stop strings, beams, 64 concurrent streams) and the hang-up
tests (test_lifecycle.py) run again against an engine thread, the two give
the same tokens (ahead or not, under preemption, tensor and pipeline
parallel), and the core is killed: /health answers 503 and the server exits
non-zero within 10 s."""

import os
import threading
import signal
import time
from pathlib import Path

import openai
import pytest

from tests.server import test_lifecycle as lifecycle
from tests.server import test_openai_api as api
from tests.server.conftest import ServerProcess, http, tiny_server_args, wait_for


@pytest.fixture(scope="module")
def server(tiny_model, request):
    srv = ServerProcess([*tiny_server_args(tiny_model), "--no-engine-process"])
    yield srv
    failed = request.session.testsfailed
    srv.stop()
    if failed:
        print(f"---- server log ----\n{srv.output()}")


client = api.client
aclient = api.aclient

# the same tests, against this module's server
for _name in ("test_completion_and_stream_agree", "test_n_and_multiple_prompts_and_token_ids",
              "test_stop_string_is_not_emitted", "test_echo_logprobs_match_transformers",
              "test_chat_stream_and_logprobs", "test_async_client",
              "test_sixty_four_concurrent_streams", "test_prefix_cache_shows_in_usage_and_metrics",
              "test_chat_n2_stop_and_usage_streamed",
              "test_beam_search_over_http_matches_transformers"):
    globals()[_name] = getattr(api, _name)
test_metrics_parse_and_move = lifecycle.test_metrics_parse_and_move


def test_a_client_hang_up_aborts_in_the_engine_thread_and_frees_blocks(server):
    before = lifecycle.metrics(server)
    lifecycle._raw_stream_then_hang_up(server, 3)
    assert wait_for(lambda: lifecycle.metrics(server)["folio:num_requests_running"] == 0)
    m = lifecycle.metrics(server)
    assert m["folio:kv_cache_usage_perc"] == 0.0
    assert m["folio:request_success_total{abort}"] == before.get(
        "folio:request_success_total{abort}", 0) + 1
    # stopped near where the client left, nowhere near the 200 tokens asked
    assert m["folio:generation_tokens_total"] - before["folio:generation_tokens_total"] < 100


def test_greedy_tokens_equal_the_engine_threads(server, tiny_model):
    """The core process's tokens and logprobs are the engine thread's (this
    module's server), also with the core scheduling one step ahead
    (--async-scheduling)."""
    core = ServerProcess([*tiny_server_args(tiny_model), "--engine-process"])
    ahead = ServerProcess([*tiny_server_args(tiny_model), "--engine-process",
                           "--async-scheduling"])
    try:
        body = {"model": "tiny", "prompt": ["Hello world", "The quick brown", "Paged"],
                "max_tokens": 16, "temperature": 0, "ignore_eos": True, "logprobs": 2}
        _, _, want = http("POST", server.url + "/v1/completions", body)
        for srv in (core, ahead):
            _, _, got = http("POST", srv.url + "/v1/completions", body)
            assert [c["text"] for c in got["choices"]] == [c["text"] for c in want["choices"]]
            assert [c["logprobs"]["tokens"] for c in got["choices"]] == \
                [c["logprobs"]["tokens"] for c in want["choices"]]
        stops = {**body, "max_tokens": 40, "stop": ["e"], "ignore_eos": False}
        _, _, want = http("POST", server.url + "/v1/completions", stops)
        _, _, got = http("POST", ahead.url + "/v1/completions", stops)
        assert [(c["text"], c["finish_reason"]) for c in got["choices"]] == \
            [(c["text"], c["finish_reason"]) for c in want["choices"]]
    finally:
        core.stop()
        ahead.stop()


def _children(pid: int) -> list[int]:
    """The spawned engine core (not multiprocessing's resource tracker)."""
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for kid in (task / "children").read_text().split():
            cmd = Path(f"/proc/{kid}/cmdline").read_bytes().replace(b"\0", b" ")
            if b"spawn_main" in cmd:
                kids.append(int(kid))
    return kids


def test_a_killed_core_answers_503_and_ends_the_server(tiny_model):
    srv = ServerProcess([*tiny_server_args(tiny_model), "--engine-process"])
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        assert c.completions.create(model="tiny", prompt="Hi", max_tokens=2).choices
        (core,) = _children(srv.proc.pid)
        os.kill(core, signal.SIGKILL)
        t0 = time.monotonic()
        statuses = []
        while srv.proc.poll() is None and time.monotonic() - t0 < 10:
            statuses.append(_health(srv))      # 503, then refused (0) once it has exited
            time.sleep(0.02)
        assert srv.proc.wait(1) != 0 and time.monotonic() - t0 < 10
        first_down = next(i for i, s in enumerate(statuses) if s != 200)
        assert set(statuses[first_down:]) <= {503, 0}
        assert "folio: error: the engine stopped" in srv.output()
        assert "engine core process exited" in srv.output()
    finally:
        srv.stop()


def _health(srv) -> int:
    try:
        return http("GET", srv.url + "/health", timeout=2)[0]
    except OSError:
        return 0


def test_under_preemption_greedy_and_seeded_samples_equal_offline(tiny_model):
    """A cache too small for the requests at once: the core preempts and
    recomputes; greedy tokens and seeded n = 2 samples are what an offline
    engine gives each request alone."""
    from concurrent.futures import ThreadPoolExecutor

    from folio import LLM, SamplingParams
    args = [a if a != "96" else "20" for a in tiny_server_args(tiny_model)]   # 20 blocks of 8
    srv = ServerProcess([*args, "--max-model-len", "128", "--engine-process"])
    prompts = [f"{w} and so on, and so on" for w in ("Hello", "The quick", "Paged", "Count")]
    bodies = [{"model": "tiny", "prompt": p, "max_tokens": 40, "ignore_eos": True,
               "temperature": 0} for p in prompts]
    bodies += [{"model": "tiny", "prompt": p, "max_tokens": 30, "ignore_eos": True,
                "temperature": 0.9, "seed": 5, "n": 2} for p in prompts[:2]]
    try:
        with ThreadPoolExecutor(len(bodies)) as pool:
            answers = list(pool.map(
                lambda b: http("POST", srv.url + "/v1/completions", b)[2], bodies))
        running = lifecycle.metrics(srv)
        assert running["folio:num_preemptions_total"] > 0
        llm = LLM(tiny_model, dtype="float32", num_kv_blocks=96, block_size=8,
                  max_model_len=128)
        for body, answer in zip(bodies, answers):
            params = SamplingParams(max_tokens=body["max_tokens"], ignore_eos=True,
                                    temperature=body["temperature"], seed=body.get("seed"),
                                    n=body.get("n", 1))
            want = llm.generate(body["prompt"], params, use_tqdm=False)[0]
            assert [c["text"] for c in answer["choices"]] == [o.text for o in want.outputs]
        assert running["folio:kv_cache_usage_perc"] == 0.0
    finally:
        srv.stop()


@pytest.mark.parametrize("parallel", [["--tensor-parallel-size", "2"],
                                      ["--pipeline-parallel-size", "2"]],
                         ids=["tp2", "pp2"])
def test_a_parallel_core_serves_the_in_process_tokens(server, tiny_model, parallel):
    """The core process starts the parallel ranks of its own (it is no daemon)."""
    srv = ServerProcess([*tiny_server_args(tiny_model), "--engine-process", *parallel])
    try:
        body = {"model": "tiny", "prompt": ["Hello world", "The quick brown"],
                "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        _, _, want = http("POST", server.url + "/v1/completions", body)
        _, _, got = http("POST", srv.url + "/v1/completions", body)
        assert [c["text"] for c in got["choices"]] == [c["text"] for c in want["choices"]]
    finally:
        srv.stop()
    assert srv.proc.returncode is not None


def test_sigterm_to_the_process_group_drains_and_ends_the_core(tiny_model):
    """A terminal's Ctrl-C or a group's SIGTERM reaches the core too: it leaves
    them to the server, which finishes what was in flight, then exits 0, and
    the core with it."""
    srv = ServerProcess([*tiny_server_args(tiny_model), "--engine-process",
                         "--drain-timeout", "20"])
    results = []

    def client(i):
        try:
            results.append(http("POST", srv.url + "/v1/completions",
                                {"model": "tiny", "prompt": f"load {i}", "max_tokens": 100,
                                 "ignore_eos": True})[0])
        except OSError:
            results.append(None)
    try:
        (core,) = _children(srv.proc.pid)
        threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        time.sleep(0.2)                 # some in flight (a tiny model's are quick)
        srv.stop(signal.SIGTERM)
        for t in threads:
            t.join(60)
    finally:
        srv.stop()
    assert srv.proc.returncode == 0, srv.output()
    assert len(results) == 4 and set(results) <= {200, None}   # finished, or never let in
    assert "engine stopped" not in srv.output()
    assert wait_for(lambda: not Path(f"/proc/{core}").exists()
                    or "Z" in Path(f"/proc/{core}/stat").read_text().split()[2], 10)
