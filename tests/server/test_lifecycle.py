"""Client hang-ups, metrics, routes, auth and SIGTERM against real server processes."""

import json
import signal
import socket
import threading

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import ServerProcess, http, wait_for


def metrics(server) -> dict[str, float]:
    _, _, text = http("GET", server.url + "/metrics")
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + ("{" + s.labels.get("finished_reason", "") + "}"
                            if "finished_reason" in s.labels else "")
            out[key] = out.get(key, 0.0) + s.value
    return out


def test_routes_and_request_id(server):
    status, headers, models = http("GET", server.url + "/v1/models",
                                   headers={"X-Request-Id": "abc-123"})
    assert status == 200 and headers.get("X-Request-Id", headers.get("x-request-id")) == "abc-123"
    m = models["data"][0]
    assert m["id"] == "tiny" and m["max_model_len"] == 256 and m["object"] == "model"
    _, _, tok = http("POST", server.url + "/tokenize", {"prompt": "Hello world"})
    _, _, detok = http("POST", server.url + "/detokenize", {"tokens": tok["tokens"]})
    assert tok["count"] == len(tok["tokens"]) and "Hello world" in detok["prompt"]
    assert http("GET", server.url + "/version")[2]["version"]
    assert http("GET", server.url + "/health")[0] == 200


def test_metrics_parse_and_move(server):
    before = metrics(server)
    http("POST", server.url + "/v1/completions",
         {"model": "tiny", "prompt": "Count me", "max_tokens": 3, "ignore_eos": True})
    after = metrics(server)
    assert after["folio:generation_tokens_total"] - before.get("folio:generation_tokens_total", 0) == 3
    assert after["folio:request_success_total{length}"] >= 1
    assert after["folio:time_to_first_token_seconds_count"] > before.get(
        "folio:time_to_first_token_seconds_count", 0)
    for name in ("folio:num_requests_running", "folio:num_requests_waiting",
                 "folio:kv_cache_usage_perc", "folio:num_preemptions_total",
                 "folio:prompt_tokens_total", "folio:e2e_request_latency_seconds_count",
                 "folio:inter_token_latency_seconds_count",
                 "folio:request_queue_time_seconds_count"):
        assert name in after


def test_vllm_names_serve_the_same_series(server):
    """Routers, dashboards and the Gateway API inference extension read vLLM's
    names: each folio: series vLLM also has is served as vllm:<name> with
    the same labels and value (one scrape); Folio's own stay folio: only."""
    from folio.server.metrics import VLLM_NAMES
    http("POST", server.url + "/v1/completions",
         {"model": "tiny", "prompt": "Count me twice", "max_tokens": 2, "ignore_eos": True})
    _, _, text = http("GET", server.url + "/metrics")
    series = {}
    for family in text_string_to_metric_families(text):
        for smp in family.samples:
            series[(smp.name, tuple(sorted(smp.labels.items())))] = smp.value
    twins = [(name, labels) for name, labels in series if name.startswith("vllm:")]
    assert {n.split(":")[1].removesuffix("_total").removesuffix("_count").removesuffix(
        "_sum").removesuffix("_bucket").removesuffix("_created") for n, _ in twins} == \
        set(VLLM_NAMES)
    for name, labels in twins:
        if name.endswith("_created"):
            continue
        assert series[(name, labels)] == series[("folio:" + name[5:], labels)], name
    for name in ("vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
                 "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_count"):
        assert any(n == name for n, _ in series), name
    assert not any(n.startswith(("vllm:tenant", "vllm:cost", "vllm:kv_cache_waste"))
                   for n, _ in series)


def _raw_stream_then_hang_up(server, tokens_to_read: int) -> None:
    body = json.dumps({"model": "tiny", "prompt": "Hang up on me", "max_tokens": 200,
                       "stream": True, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        seen = b""
        while seen.count(b"data:") < tokens_to_read:
            seen += s.recv(4096)


@pytest.mark.parametrize("stream", [True, False])
def test_client_hang_up_aborts_and_frees_blocks(server, stream):
    if stream:
        _raw_stream_then_hang_up(server, 3)
    else:
        body = json.dumps({"model": "tiny", "prompt": "Hang up", "max_tokens": 200,
                           "ignore_eos": True}).encode()
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      b"application/json\r\nContent-Length: " + str(len(body)).encode() +
                      b"\r\n\r\n" + body)
            assert wait_for(lambda: metrics(server)["folio:num_requests_running"] == 1, 10)
    assert wait_for(lambda: metrics(server)["folio:num_requests_running"] == 0)
    m = metrics(server)
    assert m["folio:kv_cache_usage_perc"] == 0.0 and m["folio:request_success_total{abort}"] >= 1
    assert m["folio:generation_tokens_total"] < 400     # nowhere near the 200 asked each time


def test_api_key(tiny_model):
    srv = ServerProcess(["--model", tiny_model, "--dtype", "float32", "--num-kv-blocks", "16",
                         "--api-key", "sesame", "--uvicorn-log-level", "warning"])
    try:
        assert http("GET", srv.url + "/v1/models")[0] == 401
        assert http("GET", srv.url + "/v1/models",
                    headers={"Authorization": "Bearer wrong"})[0] == 401
        assert http("GET", srv.url + "/v1/models",
                    headers={"Authorization": "Bearer sesame"})[0] == 200
        assert http("GET", srv.url + "/health")[0] == 200
        assert http("GET", srv.url + "/metrics")[0] == 200
    finally:
        srv.stop()


def test_sigterm_under_load_exits_cleanly(tiny_model):
    srv = ServerProcess(["--model", tiny_model, "--dtype", "float32", "--num-kv-blocks", "64",
                         "--drain-timeout", "20", "--uvicorn-log-level", "warning"])
    results = []

    def client(i):
        try:
            results.append(http("POST", srv.url + "/v1/completions",
                                {"model": name, "prompt": f"load {i}", "max_tokens": 200,
                                 "ignore_eos": True})[0])
        except OSError:                     # arrived after the server stopped listening
            results.append(None)
    def in_flight() -> float:
        m = metrics(srv)
        return m["folio:num_requests_running"] + m["folio:num_requests_waiting"]
    try:
        name = srv_name(srv)
        threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        assert wait_for(lambda: in_flight() >= 1, 30)
        at_sigterm = in_flight()
        srv.stop(signal.SIGTERM)
        for t in threads:
            t.join(60)
    finally:
        srv.stop()                          # never leave a server behind
    assert srv.proc.returncode == 0, srv.output()
    # every request in flight when SIGTERM came was finished, not dropped
    assert results.count(200) >= at_sigterm and len(results) == 6


def srv_name(srv) -> str:
    return http("GET", srv.url + "/v1/models")[2]["data"][0]["id"]
