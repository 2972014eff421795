"""Two `folio serve` replicas of the default model behind a real vllm-router
(the PyPI wheel's Rust router, pinned in pyproject.toml):

- multi-turn chats sharing system prompts, sent through the router with
  `cache_aware` and then `round_robin`: the replicas' own prefix-cache
  counters (folio:prefix_cache_hits / queries, summed over both) show the
  hit rate of each policy; cache_aware keeps each chat on one replica;
- one replica killed while it answers: the router retries on the other, and
  every answer equals the one a replica gives directly.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from tests.server.conftest import ServerProcess, free_port, http, wait_for

ROUTER = Path(sys.executable).parent / "vllm-router"
pytestmark = pytest.mark.skipif(not ROUTER.exists(),
                                reason="no vllm-router in this environment (make test installs "
                                       "it with the dev extras)")

CHAT = "/v1/chat/completions"
SYSTEMS = [
    "You are the support assistant of a bicycle shop. You answer questions about repairs, "
    "spare parts, opening hours and prices. Be brief and friendly, and never invent a price: "
    "when you do not know one, say that the shop will call back.",
    "You are a cooking tutor. You explain recipes step by step, suggest substitutions for "
    "missing ingredients and warn about allergens. Keep every answer under three sentences.",
]
QUESTIONS = ["How do I fix a flat tyre?", "What can replace butter in a cake?",
             "Are you open on Sunday?", "How long do I boil an egg?", "Do you sell helmets?"]
FOLLOW_UPS = ["Tell me more.", "And after that?"]


def replica_args() -> list[str]:
    return ["--uvicorn-log-level", "warning", "--max-model-len", "2048"]


@pytest.fixture(scope="module")
def replicas(request):
    # one thread each: two servers' thread pools on two CPUs made their start
    # take 5-25 s (each waited on the other's descheduled threads)
    servers = [ServerProcess(replica_args(), env={"OMP_NUM_THREADS": "1"}, wait=False)
               for _ in range(2)]
    try:
        for s in servers:
            s.wait_healthy()
        yield servers
    finally:
        failed = request.session.testsfailed
        for s in servers:
            s.stop()
            if failed:
                print(f"---- replica {s.url} ----\n{s.output()[-3000:]}")


class Router:
    def __init__(self, workers: list[str], policy: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [str(ROUTER), "--worker-urls", *workers, "--policy", policy,
             "--host", "127.0.0.1", "--port", str(self.port),
             "--prometheus-port", str(free_port()), "--worker-startup-check-interval", "1",
             "--health-check-interval-secs", "1", "--log-level", "warning"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(lambda: self.proc.poll() is not None or self._healthy(), timeout=60)
        if self.proc.poll() is not None or not self._healthy():
            self.stop()
            raise RuntimeError(f"the router did not start:\n{self.output()}")

    def _healthy(self) -> bool:
        try:
            return http("GET", self.url + "/health", timeout=2)[0] == 200
        except OSError:
            return False

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def prefix_counters(servers) -> tuple[float, float]:
    """(queries, hits) in tokens, summed over the replicas' /metrics."""
    queries = hits = 0.0
    for s in servers:
        _, _, text = http("GET", s.url + "/metrics")
        queries += float(re.search(r"^folio:prefix_cache_queries_total\{[^}]*\} (\S+)$", text,
                                   re.M).group(1))
        hits += float(re.search(r"^folio:prefix_cache_hits_total\{[^}]*\} (\S+)$", text,
                                re.M).group(1))
    return queries, hits


def run_chats(url: str) -> list[str]:
    """Five chats of three turns (two system prompts between them), turn by
    turn across the chats, each turn carrying the chat's history with the
    replies it got: the answers, in order."""
    histories = [[{"role": "system", "content": SYSTEMS[c % 2]},
                  {"role": "user", "content": QUESTIONS[c]}] for c in range(len(QUESTIONS))]
    answers = []
    for turn in range(1 + len(FOLLOW_UPS)):
        for history in histories:
            status, _, body = http("POST", url + CHAT, {"messages": history, "max_tokens": 16,
                                                        "temperature": 0})
            assert status == 200, body
            reply = body["choices"][0]["message"]["content"]
            answers.append(reply)
            history.append({"role": "assistant", "content": reply})
            if turn < len(FOLLOW_UPS):
                history.append({"role": "user", "content": FOLLOW_UPS[turn]})
    return answers


def hit_rate(replicas, router_url: str) -> tuple[float, list[str]]:
    status, _, body = http("POST", router_url + "/flush_cache")      # every replica's
    assert status == 200, body
    q0, h0 = prefix_counters(replicas)
    answers = run_chats(router_url)
    q1, h1 = prefix_counters(replicas)
    return (h1 - h0) / (q1 - q0), answers


def test_the_replicas_answer_what_the_router_asks(replicas):
    """The worker endpoints the router calls, answered as it reads them."""
    s = replicas[0]
    msgs = [{"role": "system", "content": SYSTEMS[0]}, {"role": "user", "content": "Hi"}]
    status, _, rendered = http("POST", s.url + CHAT + "/render", {"messages": msgs})
    assert status == 200 and rendered["features"] is None
    _, _, tokenized = http("POST", s.url + "/tokenize", {"messages": msgs})
    assert rendered["token_ids"] == tokenized["tokens"]
    status, _, body = http("POST", s.url + "/v1/completions/render", {"prompt": ["a b", "c"]})
    assert status == 200 and [len(b["token_ids"]) for b in body] == [2, 1]
    assert http("GET", s.url + "/get_load")[2] == {"load": 0}
    assert http("GET", s.url + "/health_generate")[0] == 200
    # SGLang's fields, which the router writes into every request, at their defaults
    status, _, body = http("POST", s.url + CHAT, {
        "messages": msgs, "max_tokens": 2, "no_stop_trim": False, "separate_reasoning": True,
        "stream_reasoning": True, "return_hidden_states": False})
    assert status == 200, body
    status, _, body = http("POST", s.url + CHAT, {"messages": msgs, "max_tokens": 2,
                                                  "return_hidden_states": True})
    assert status == 400 and body["error"]["param"] == "return_hidden_states"


def test_cache_aware_routing_finds_more_of_the_prefix_cache(replicas):
    urls = [s.url for s in replicas]
    rates, answers = {}, {}
    for policy in ("cache_aware", "round_robin"):
        router = Router(urls, policy)
        try:
            rates[policy], answers[policy] = hit_rate(replicas, router.url)
        finally:
            router.stop()
    print(f"prefix-cache hit rate: {rates}")
    # round robin sends every other turn of a chat to the replica that has not
    # seen its history (only the system prompt is found there); cache_aware
    # keeps a chat where its history is
    assert rates["cache_aware"] >= rates["round_robin"] + 0.2, rates
    assert answers["cache_aware"] == answers["round_robin"]


def test_a_replica_killed_mid_run_the_router_serves_from_the_other(replicas):
    survivor, victim = replicas
    prompts = [f"Write a short story about {w}." for w in
               ("a lighthouse", "a fox", "the sea", "a train")]
    expected = []
    for p in prompts:
        status, _, body = http("POST", survivor.url + CHAT, {
            "messages": [{"role": "user", "content": p}], "max_tokens": 32, "temperature": 0})
        assert status == 200
        expected.append(body["choices"][0]["message"]["content"])
    router = Router([survivor.url, victim.url], "round_robin")
    got: list = []

    def client() -> None:
        for p in prompts:
            got.append(http("POST", router.url + CHAT, {
                "messages": [{"role": "user", "content": p}], "max_tokens": 32,
                "temperature": 0}))

    thread = threading.Thread(target=client)
    try:
        thread.start()
        # killed while it holds a request (the router sends it every other one)
        assert wait_for(lambda: http("GET", victim.url + "/get_load")[2]["load"] > 0, 60)
        victim.stop(signal.SIGKILL)
        thread.join(300)
        assert not thread.is_alive()
        assert [g[0] for g in got] == [200] * len(prompts), [g[2] for g in got]
        assert [g[2]["choices"][0]["message"]["content"] for g in got] == expected
        # and it goes on serving
        status, _, _ = http("POST", router.url + CHAT, {
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        assert status == 200
    finally:
        router.stop()
        if sys.exc_info()[0] is not None:
            print(router.output()[-3000:])
