"""Tenants and the usage ledger on a live `folio serve`, driven by the official
openai client: two tenants under concurrent load get exactly the usage the
ledger, GET /v1/usage, `folio usage` and the per-tenant metrics report; an
unknown key is a 401 and a tenant over its limit a 429 with Retry-After, in
OpenAI's error shape, charged nothing; after a `kill -9` mid-load every
response that completed is in the ledger once."""

import json
import re
import sqlite3
import threading
import time

import openai
import pytest

from folio.cli import main
from tests.server.conftest import ServerProcess, http, tiny_server_args

KEYS = {"keys": [{"key": "sk-team-a", "tenant": "team-a"},
                 {"key": "sk-team-b", "tenant": "team-b", "requests_per_minute": 4},
                 {"key": "sk-ops", "tenant": "ops", "admin": True}]}


@pytest.fixture(scope="module")
def tenants_server(tiny_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("tenants")
    (d / "keys.json").write_text(json.dumps(KEYS))
    srv = ServerProcess([*tiny_server_args(tiny_model), "--api-keys-file", str(d / "keys.json"),
                         "--usage-db", str(d / "usage.db"), "--cost-per-hour", "3.6"])
    srv.db = str(d / "usage.db")
    yield srv
    srv.stop()


def client(srv, key):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0)


def metric(srv, name: str, **labels) -> float:
    _, _, text = http("GET", srv.url + "/metrics")
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def admin_usage(srv, **params):
    query = "&".join(f"{k}={v}" for k, v in params.items())
    status, _, body = http("GET", f"{srv.url}/v1/usage?{query}",
                           headers={"Authorization": "Bearer sk-ops"})
    assert status == 200, body
    return {r[params.get("by", "tenant")]: r for r in body["data"]}


def test_two_tenants_under_load_are_billed_what_they_were_sent(tenants_server):
    srv = tenants_server
    sent = {"team-a": [0, 0, 0], "ops": [0, 0, 0]}      # requests, prompt, completion
    lock, errors = threading.Lock(), []

    def work(tenant, key, k):
        c = client(srv, key)
        try:
            for i in range(3):
                if (k + i) % 2:
                    r = c.completions.create(model="tiny", prompt=[1, 5 + k, 9 + i],
                                             max_tokens=8 + i, temperature=0)
                    u = r.usage
                else:
                    stream = c.chat.completions.create(
                        model="tiny", messages=[{"role": "user", "content": f"hi {k} {i}"}],
                        max_tokens=6 + k, stream=True, stream_options={"include_usage": True})
                    u = [ch for ch in stream if ch.usage is not None][-1].usage
                with lock:
                    s = sent[tenant]
                    s[0], s[1], s[2] = s[0] + 1, s[1] + u.prompt_tokens, s[2] + u.completion_tokens
        except Exception as e:          # noqa: BLE001
            errors.append(e)
    threads = [threading.Thread(target=work, args=(t, key, k))
               for k, (t, key) in enumerate([("team-a", "sk-team-a"), ("ops", "sk-ops")] * 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    ledger = admin_usage(srv, by="tenant")
    for tenant, (n, prompt, completion) in sent.items():
        row = ledger[tenant]
        assert (row["requests"], row["prompt_tokens"], row["completion_tokens"]) == (
            n, prompt, completion) and row["aborted"] == 0
        assert row["cost"] > 0                                        # --cost-per-hour
        assert metric(srv, "folio:tenant_prompt_tokens_total", tenant=tenant) == prompt
        assert metric(srv, "folio:tenant_generation_tokens_total", tenant=tenant) == completion
        assert metric(srv, "folio:tenant_requests_total", tenant=tenant) == n
    for kind in ("prompt", "output"):
        assert metric(srv, "folio:cost_per_1k_tokens", kind=kind) > 0
    # `folio usage` on the same file gives the endpoint's answer
    assert main(["usage", "--db", srv.db, "--json"]) == 0


def test_folio_usage_reads_what_the_endpoint_serves(tenants_server, capsys):
    srv = tenants_server
    client(srv, "sk-team-a").completions.create(model="tiny", prompt=[1, 2], max_tokens=3)
    assert main(["usage", "--db", srv.db, "--json"]) == 0
    cli_rows = json.loads(capsys.readouterr().out)
    assert {r["tenant"]: r for r in cli_rows} == admin_usage(srv)
    day = time.strftime("%Y-%m-%d", time.gmtime())
    assert list(admin_usage(srv, by="day")) == [day]
    assert list(admin_usage(srv, by="model")) == ["tiny"]
    assert admin_usage(srv, since="2999-01-01") == {}


def test_an_unknown_key_is_a_401_and_costs_nothing(tenants_server):
    srv = tenants_server
    before = admin_usage(srv)
    for key in ("sk-wrong", None):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        status, _, body = http("POST", srv.url + "/v1/completions",
                               {"model": "tiny", "prompt": [1], "max_tokens": 2}, headers)
        assert status == 401 and body["error"]["type"] == "authentication_error"
        assert body["error"]["code"] == 401
    with pytest.raises(openai.AuthenticationError):
        client(srv, "sk-wrong").completions.create(model="tiny", prompt=[1], max_tokens=2)
    assert admin_usage(srv) == before


def test_a_tenant_over_its_limit_gets_a_429_with_retry_after_and_is_not_charged(tenants_server):
    srv = tenants_server
    c = client(srv, "sk-team-b")
    for _ in range(4):
        c.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=4)
    charged = admin_usage(srv)["team-b"]
    for _ in range(3):
        with pytest.raises(openai.RateLimitError) as e:
            c.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=4)
        response = e.value.response
        assert 1 <= int(response.headers["retry-after"]) <= 60
        error = response.json()["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == 429
        assert "4 requests per minute" in error["message"]
    status, headers, _ = http("POST", srv.url + "/v1/chat/completions",
                              {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                               "stream": True}, {"Authorization": "Bearer sk-team-b"})
    assert status == 429 and "retry-after" in {k.lower() for k in headers}   # before the stream
    assert admin_usage(srv)["team-b"] == charged and charged["requests"] == 4
    assert metric(srv, "folio:tenant_requests_total", tenant="team-b") == 4


def test_usage_needs_an_admin_key(tenants_server):
    srv = tenants_server
    status, _, body = http("GET", srv.url + "/v1/usage",
                           headers={"Authorization": "Bearer sk-team-a"})
    assert status == 403 and "admin" in body["error"]["message"]
    status, _, body = http("GET", srv.url + "/v1/usage?by=week",
                           headers={"Authorization": "Bearer sk-ops"})
    assert status == 400 and body["error"]["param"] == "by"
    status, _, _ = http("GET", srv.url + "/v1/usage")
    assert status == 401


def test_after_kill_9_every_completed_response_is_in_the_ledger_once(tiny_model, tmp_path):
    db = tmp_path / "usage.db"
    srv = ServerProcess([*tiny_server_args(tiny_model), "--max-num-seqs", "2",
                         "--usage-db", str(db)])
    done, lock = [], threading.Lock()

    def work(k):
        try:
            status, _, body = http("POST", srv.url + "/v1/completions",
                                   {"model": "tiny", "prompt": [1, 3 + k], "max_tokens": 120,
                                    "ignore_eos": True})
        except Exception:            # noqa: BLE001 - the server was killed under it
            return
        if status == 200:
            with lock:
                done.append(body["id"])
    threads = [threading.Thread(target=work, args=(k,)) for k in range(16)]
    try:
        for t in threads:
            t.start()
        end = time.monotonic() + 120
        while len(done) < 4 and time.monotonic() < end:
            time.sleep(0.01)
    finally:
        srv.stop()                    # SIGKILL, mid-load
    for t in threads:
        t.join(60)
    assert 4 <= len(done) < 16        # killed with requests still running or waiting
    rows = sqlite3.connect(db).execute("SELECT request_id, aborted FROM usage").fetchall()
    ids = [r for r, _ in rows]
    assert len(ids) == len(set(ids))
    for rid in done:
        assert ids.count(rid) == 1 and re.fullmatch(r"cmpl-[0-9a-f]{32}", rid)
    assert all(aborted == 0 for rid, aborted in rows if rid in done)


def test_a_client_that_leaves_mid_stream_is_charged_what_it_generated(tenants_server):
    srv = tenants_server
    before = metric(srv, "folio:tenant_requests_total", tenant="team-a", finished_reason="abort")
    c = client(srv, "sk-team-a")
    stream = c.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=240, stream=True,
                                  extra_body={"ignore_eos": True})
    got = 0
    for chunk in stream:
        got += 1
        if got == 3:
            break
    stream.close()
    # the abort is counted when the server sees the hang-up; its ledger row goes
    # through the writer thread's next batch, a moment later
    end, rows = time.monotonic() + 30, []
    while time.monotonic() < end and not rows:
        time.sleep(0.1)
        rows = sqlite3.connect(srv.db).execute(
            "SELECT completion_tokens, finish_reason FROM usage WHERE tenant = 'team-a' AND "
            "aborted = 1").fetchall()
    assert metric(srv, "folio:tenant_requests_total", tenant="team-a",
                  finished_reason="abort") == before + 1
    assert len(rows) == 1
    tokens, reason = rows[0]
    assert reason == "abort" and 3 <= tokens < 240


def test_bench_serve_reports_the_cost_beside_the_servers(tenants_server, tiny_model, capsys,
                                                          server):
    from folio.bench.serve import cost_from_throughput
    # $3.60 an hour is $0.001 a second: 0.25 x 300 + 100 = 175 weighted tokens/s
    assert cost_from_throughput({"output_throughput": 100.0, "total_token_throughput": 400.0},
                                3.6, 0.25) == {"prompt": pytest.approx(0.25 / 175),
                                               "output": pytest.approx(1 / 175)}
    common = ["bench", "serve", "--tokenizer", tiny_model, "--num-prompts", "8",
              "--input-len", "8:16", "--output-len", "8:16", "--cost-per-hour", "3.6", "--json"]
    assert main([*common, "--base-url", tenants_server.url, "--api-key", "sk-team-a"]) == 0
    run, = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["runs"]
    costs = run["cost_per_1k"]
    assert costs["from_throughput"]["output"] > 0 and costs["server"]["output"] > 0
    assert costs["server"]["prompt"] == pytest.approx(0.25 * costs["server"]["output"], rel=1e-3)
    # a server started without --cost-per-hour has no figure to compare with
    assert main([*common, "--base-url", server.url]) == 1
    assert "start the server with --cost-per-hour" in capsys.readouterr().err
