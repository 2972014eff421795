"""How the server answers when the engine fails, on an in-process server.

uvicorn runs in a thread of the test, so the engine can be made to fail on
cue: one request failing alone is a 500 for that request (the others go on),
a stopped engine is a 503, and a dying engine loop is reported once as fatal
(the CLI then ends the process; tests/server/test_startup.py covers that).
"""

import contextlib
import json
import threading
import urllib.request

import pytest
import uvicorn

from folio.engine.async_engine import EngineDeadError, RequestFailedError
from folio.engine.llm_engine import LLMEngine
from folio.server.app import ServerConfig, ServerState, build_app
from tests.server.conftest import free_port, http, wait_for


@contextlib.contextmanager
def in_process(load, on_fatal=None):
    state = ServerState(ServerConfig("tiny"), load, on_fatal)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(state), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    assert wait_for(lambda: server.started)
    try:
        yield state, f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def events(url: str, body: dict) -> tuple[int, list]:
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        data = [ln.decode().strip()[len("data: "):] for ln in resp if ln.startswith(b"data: ")]
    return resp.status, [d if d == "[DONE]" else json.loads(d) for d in data]


@pytest.fixture
def load(tiny_model):
    return lambda: LLMEngine.from_args(tiny_model, dtype="float32", num_kv_blocks=64)


def fail_prompts_with(served, word: str, error: BaseException) -> None:
    """Requests whose prompt holds `word` fail in the engine; the others run."""
    real = served.engine.generate

    async def generate(request_id, prompt, prompt_ids, params, priority=0, lora_request=None):
        if prompt is not None and word in prompt:
            raise error
        async for out in real(request_id, prompt, prompt_ids, params, priority):
            yield out
    served.engine.generate = generate


GOOD = {"prompt": "fine", "max_tokens": 2}


def test_health_is_503_while_loading(load):
    release = threading.Event()

    def slow_load():
        release.wait(30)
        return load()
    with in_process(slow_load) as (state, url):
        status, _, err = http("GET", url + "/health")
        assert status == 503 and err["error"]["message"] == "the model is still loading"
        assert http("POST", url + "/v1/completions", GOOD)[0] == 503
        release.set()
        assert wait_for(lambda: http("GET", url + "/health")[0] == 200)
        assert http("POST", url + "/v1/completions", GOOD)[0] == 200


@pytest.mark.parametrize("error,status,kind", [
    (RequestFailedError("request x failed in the engine: boom"), 500, "internal_server_error"),
    (EngineDeadError("the engine has stopped"), 503, "service_unavailable"),
])
def test_an_engine_failure_answers_that_request_alone(load, error, status, kind):
    with in_process(load) as (state, url):
        assert wait_for(lambda: state.served is not None)
        fail_prompts_with(state.served, "fail", error)
        got, _, err = http("POST", url + "/v1/completions", {"prompt": "fail me", "max_tokens": 2})
        assert got == status and err["error"] == {"message": str(error), "type": kind,
                                                  "param": None, "code": status}
        code, chunks = events(url + "/v1/completions", {"prompt": "fail me", "max_tokens": 2})
        assert code == 200 and chunks[-1] == "[DONE]"
        assert chunks[0]["error"]["code"] == status and len(chunks) == 2
        assert http("POST", url + "/v1/completions", GOOD)[0] == 200
        assert http("GET", url + "/health")[0] == 200 and state.fatal is None


def test_a_dying_engine_loop_answers_503_and_is_fatal(load):
    told = []
    with in_process(load, on_fatal=told.append) as (state, url):
        assert wait_for(lambda: state.served is not None)
        llm_engine = state.served.engine.engine

        def broken_step():
            raise RuntimeError("boom")
        llm_engine.step = broken_step
        status, _, err = http("POST", url + "/v1/completions", GOOD)
        assert status == 503 and "boom" in err["error"]["message"]
        assert wait_for(lambda: told)
        assert told == ["the engine stopped: RuntimeError('boom')"] == [state.fatal]
        status, _, err = http("GET", url + "/health")
        assert status == 503 and err["error"]["message"] == "the engine has stopped"


def test_a_request_template_is_refused_unless_the_server_trusts_them(load):
    body = {"messages": [{"role": "user", "content": "Hi"}],
            "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}
    with in_process(load) as (state, url):
        assert wait_for(lambda: state.served is not None)
        status, _, err = http("POST", url + "/tokenize", body)
        assert status == 400 and err["error"]["param"] == "chat_template"
        assert "--trust-request-chat-template" in err["error"]["message"]
        status, _, err = http("POST", url + "/v1/chat/completions", {**body, "max_tokens": 1})
        assert status == 400 and err["error"]["param"] == "chat_template"
        state.served.trust_request_chat_template = True
        status, _, ok = http("POST", url + "/tokenize", body)
        assert status == 200 and ok["count"] > 0
