"""Two Folio replicas behind vllm-router (issue 33): prefix-cache hit rate and
time to first token under `cache_aware` against `round_robin`, in one run,
the policies alternating within each round.

Replicas: two `folio serve` of the default model on this machine, each on
one core (OMP_NUM_THREADS=1, pinned with taskset where there are two).
Router: the pinned vllm-router wheel's binary. Between runs the router's
POST /flush_cache empties both replicas' prefix caches.

Workload (seeded, the same every run): 16 chats of 4 turns (--turns); 4
system prompts of about 300 tokens (--rules 16 numbered house rules made of
a fixed word list), chat c under system prompt c mod 4; each turn sends the
chat's whole history (the system prompt, the earlier questions and the
replies the chat got) and a new question; replies greedy, at most 32 tokens
(--max-tokens), streamed. 4 users at once, each
running its chats one after another, waiting for each reply before the next
turn. Hit rate: prefix-cache hits over queries, in prompt tokens, summed
over the replicas' folio: counters. TTFT: the client's time from sending to
the first content chunk, through the router.

    .venv/bin/python docs/bench/router.py [--rounds 2] [--chats 16] [--users 4]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import zlib
from datetime import datetime, timezone
from pathlib import Path

WORDS = ("order return refund parcel courier invoice warranty repair battery screen charger "
         "customer account password delivery address payment card voucher discount store "
         "manager weekend holiday receipt exchange product size colour stock supplier").split()
QUESTIONS = ["My parcel has not arrived, what can I do?", "Can I return a gift without a receipt?",
             "How long is the warranty on a phone battery?", "Do you deliver on Saturdays?",
             "Can I pay with two cards?", "I forgot my password.",
             "Is the blue model in stock?", "Can I change my delivery address?"]
FOLLOW_UPS = ["What do I need to bring?", "How long will it take?", "Thank you, anything else?",
              "Can you say that again more simply?", "And if that does not work?",
              "Who do I call then?", "Can you summarise our conversation?"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def system_prompt(i: int, rules_count: int) -> str:
    rng = random.Random(1000 + i)
    rules = [f"Rule {k + 1}: " + " ".join(rng.choice(WORDS) for _ in range(14)) + "."
             for k in range(rules_count)]
    return f"You are assistant number {i} of a shop. Follow the house rules.\n" + "\n".join(rules)


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


def post(url: str, body: dict) -> int:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.status


def wait_healthy(url: str, proc: subprocess.Popen, deadline: float = 300) -> None:
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not become healthy")


def start_replica(core: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "folio.cli", "serve", "--port", str(port),
           "--uvicorn-log-level", "warning", "--max-model-len", "4096"]
    if shutil.which("taskset") and (os.cpu_count() or 1) >= 2:
        cmd = ["taskset", "-c", str(core)] + cmd
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def start_router(workers: list[str], policy: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([str(Path(sys.executable).parent / "vllm-router"), "--worker-urls",
                             *workers, "--policy", policy, "--port", str(port),
                             "--prometheus-port", str(free_port()),
                             "--worker-startup-check-interval", "1", "--log-level", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    wait_healthy(f"http://127.0.0.1:{port}", proc, 60)
    return proc, f"http://127.0.0.1:{port}"


def counters(replicas: list[str]) -> dict:
    out = {"queries": 0.0, "hits": 0.0, "requests": []}
    for url in replicas:
        text = get(url + "/metrics")

        def total(name: str) -> float:
            return sum(float(v) for v in re.findall(rf"^folio:{name}\{{[^}}]*\}} (\S+)$",
                                                    text, re.M))
        out["queries"] += total("prefix_cache_queries_total")
        out["hits"] += total("prefix_cache_hits_total")
        out["requests"].append(total("request_success_total"))
    return out


def stream_turn(router: str, messages: list[dict], max_tokens: int) -> tuple[float, str]:
    """(time to the first content chunk, the reply)."""
    host, port = router.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=300)
    body = json.dumps({"messages": messages, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True})
    start = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"{resp.status}: {resp.read()[:300]!r}")
    ttft, parts = None, []
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        delta = json.loads(line[6:])["choices"][0]["delta"].get("content")
        if delta:
            ttft = ttft if ttft is not None else time.perf_counter() - start
            parts.append(delta)
    conn.close()
    return (ttft if ttft is not None else time.perf_counter() - start), "".join(parts)


def run_workload(router: str, args) -> tuple[list[float], list[str]]:
    chats, users = args.chats, args.users
    ttfts: list[float] = []
    replies: dict[int, list[str]] = {}
    lock = threading.Lock()

    def user(u: int) -> None:
        for c in range(u, chats, users):
            history = [{"role": "system", "content": system_prompt(c % 4, args.rules)},
                       {"role": "user", "content": QUESTIONS[c % len(QUESTIONS)]}]
            got = []
            for turn in range(args.turns):
                ttft, reply = stream_turn(router, history, args.max_tokens)
                got.append(reply)
                with lock:
                    ttfts.append(ttft)
                history.append({"role": "assistant", "content": reply})
                history.append({"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)]})
            replies[c] = got
    threads = [threading.Thread(target=user, args=(u,)) for u in range(users)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return ttfts, [r for c in sorted(replies) for r in replies[c]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--chats", type=int, default=16)
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32, help="each reply's")
    ap.add_argument("--rules", type=int, default=16,
                    help="lines of each system prompt (16: about 300 tokens)")
    args = ap.parse_args()
    flags = sorted({f for f in open("/proc/cpuinfo").read().split() if f.startswith("avx")})
    replicas = [start_replica(core) for core in (0, 1)]
    urls = [u for _, u in replicas]
    results = []
    try:
        for proc, url in replicas:
            wait_healthy(url, proc)
        for rnd in range(args.rounds):
            for policy in ("cache_aware", "round_robin"):
                router, rurl = start_router(urls, policy)
                try:
                    post(rurl + "/flush_cache", {})
                    before = counters(urls)
                    start = time.perf_counter()
                    ttfts, replies = run_workload(rurl, args)
                    wall = time.perf_counter() - start
                    after = counters(urls)
                finally:
                    router.send_signal(signal.SIGTERM)
                    router.wait(10)
                row = {"round": rnd, "policy": policy, "turns": len(ttfts),
                       "hit_rate": round((after["hits"] - before["hits"]) /
                                         (after["queries"] - before["queries"]), 3),
                       "ttft_mean_s": round(statistics.mean(ttfts), 3),
                       "ttft_p50_s": round(statistics.median(ttfts), 3),
                       "ttft_p90_s": round(statistics.quantiles(ttfts, n=10)[-1], 3),
                       "wall_s": round(wall, 1),
                       "requests_per_replica": [int(a - b) for a, b in
                                                zip(after["requests"], before["requests"])],
                       "replies_crc": zlib.crc32(json.dumps(replies).encode())}
                print(json.dumps(row), flush=True)
                results.append(row)
    finally:
        for proc, _ in replicas:
            os.killpg(proc.pid, signal.SIGKILL)
    for policy in ("cache_aware", "round_robin"):
        rows = [r for r in results if r["policy"] == policy]
        print(f"{policy}: hit rate {[r['hit_rate'] for r in rows]}, mean TTFT "
              f"{[r['ttft_mean_s'] for r in rows]} s, wall {[r['wall_s'] for r in rows]} s")
    ca = [r for r in results if r["policy"] == "cache_aware"]
    rr = [r for r in results if r["policy"] == "round_robin"]
    print("TTFT ratio round_robin / cache_aware per round:",
          [round(b["ttft_mean_s"] / a["ttft_mean_s"], 2) for a, b in zip(ca, rr)])
    print(json.dumps({"date": datetime.now(timezone.utc).isoformat(timespec="minutes"),
                      "cpu_flags": flags, "cpus": os.cpu_count(), "args": vars(args)}))


if __name__ == "__main__":
    main()
