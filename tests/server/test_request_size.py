"""A request's size can't stall or bloat the server (issue 52): a body over
--max-request-bytes is a 413 before anything parses it, whether it says its
length or streams in chunks; one within the limit is tokenized off the event
loop, so /health answers within a second while it is; the server's memory
stays bounded and the next request is served, with every block free."""

import http.client
import json
import threading
import time

import pytest

from tests.server.conftest import ServerProcess, http as http_call, tiny_server_args
from tests.server.test_lifecycle import metrics

C = "/v1/completions"
LIMIT = 1 << 20                         # 1 MiB


@pytest.fixture(scope="module")
def server(tiny_model):
    srv = ServerProcess(tiny_server_args(tiny_model) + ["--max-request-bytes", str(LIMIT)])
    yield srv
    srv.stop()


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        line = next(x for x in f if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def health_ms(server) -> float:
    t0 = time.perf_counter()
    assert http_call("GET", server.url + "/health", timeout=5)[0] == 200
    return (time.perf_counter() - t0) * 1e3


def post_raw(server, body, chunked: bool = False):
    """(status, parsed answer) of a POST whose body is bytes, or chunks."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        headers = {"Content-Type": "application/json"}
        if chunked:
            conn.request("POST", C, body=iter(body), headers=headers, encode_chunked=True)
        else:
            conn.request("POST", C, body=body, headers=headers)
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def test_a_50_mb_body_is_a_413_at_once_and_the_server_stays_small(server):
    before = rss_mb(server.proc.pid)
    prompt = "word " * (10 << 20)                    # 50 MiB of prompt text
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 2}).encode()
    t0 = time.perf_counter()
    status, answer = post_raw(server, body)
    assert time.perf_counter() - t0 < 10
    assert status == 413, answer
    assert answer["error"]["code"] == 413 and "--max-request-bytes" in answer["error"]["message"]
    assert str(len(body)) in answer["error"]["message"]
    assert health_ms(server) < 1000
    assert rss_mb(server.proc.pid) - before < 200


def test_a_body_in_chunks_past_the_limit_is_a_413(server):
    piece = b" " * (256 << 10)
    chunks = [b'{"model": "tiny", "prompt": "a"'] + [piece] * 8 + [b"}"]   # 2 MiB, no length
    status, answer = post_raw(server, chunks, chunked=True)
    assert status == 413 and "over this server's limit" in answer["error"]["message"]
    # within the limit, chunks are handed on whole
    status, answer = post_raw(server, [b'{"model": "tiny", ', b'"prompt": "Hi", ',
                                       b'"max_tokens": 2}'], chunked=True)
    assert status == 200 and answer["usage"]["completion_tokens"] == 2


def test_health_answers_while_a_request_at_the_limit_is_tokenized(server):
    """Near 1 MiB of text (200,000 words, far past the tiny model's 256-token
    context): tokenized off the loop, then refused with a 400; /health is
    polled all along."""
    body = json.dumps({"model": "tiny", "prompt": "hello world " * 83000, "max_tokens": 2})
    assert len(body) < LIMIT
    done: dict = {}
    thread = threading.Thread(target=lambda: done.update(answer=post_raw(server,
                                                                         body.encode())))
    thread.start()
    slowest = 0.0
    while thread.is_alive():
        slowest = max(slowest, health_ms(server))
        time.sleep(0.02)
    thread.join()
    status, answer = done["answer"]
    assert status == 400 and "context" in answer["error"]["message"], answer
    print(f"slowest /health during it: {slowest:.0f} ms")
    assert slowest < 1000, slowest


def test_after_them_the_next_request_runs_and_every_block_is_free(server):
    status, _, out = http_call("POST", server.url + C, {"model": "tiny", "prompt": "Hello",
                                                        "max_tokens": 3, "ignore_eos": True})
    assert status == 200 and out["usage"]["completion_tokens"] == 3
    m = metrics(server)
    assert m["folio:num_requests_running"] == 0 and m["folio:kv_cache_usage_perc"] == 0.0


def test_the_default_limit_is_sized_from_the_context():
    from folio.server.app import request_bytes_for
    assert request_bytes_for(8192) == (1 << 20) + 64 * 8192
    assert request_bytes_for(131072) > 8 << 20
