"""A stand-in for llama.cpp's llama-server, for tests of the client side of
the llama-cpp baseline on machines that have not built the real one (a mock,
and only that: tests/bench/test_llama_cpp.py runs the real binary where one is
found). It takes the flags the baseline passes, answers /health and
/completion the way llama-server does (`tokens_predicted` = `n_predict`), and
writes what it saw (flags, requests, the most requests in flight at once) to
the JSON file named by FAKE_LLAMA_LOG on exit.

FAKE_LLAMA_MODE=short answers one token fewer than asked; =die exits at start.
"""

import argparse
import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

p = argparse.ArgumentParser()
p.add_argument("-m", required=True)
p.add_argument("-t", type=int)
p.add_argument("-tb", type=int)
p.add_argument("-np", type=int, required=True)
p.add_argument("-c", type=int, required=True)
p.add_argument("--host")
p.add_argument("--port", type=int)
p.add_argument("--no-webui", action="store_true")
args = p.parse_args()
mode = os.environ.get("FAKE_LLAMA_MODE", "")
if mode == "die":
    print("error: failed to load model", flush=True)
    sys.exit(3)
lock = threading.Lock()
seen = {"argv": sys.argv[1:], "requests": [], "in_flight": 0, "max_in_flight": 0}


def save(*_):
    with open(os.environ["FAKE_LLAMA_LOG"], "w") as f:
        json.dump(seen, f)
    os._exit(0)


signal.signal(signal.SIGTERM, save)


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def _reply(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._reply({"status": "ok"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with lock:
            seen["in_flight"] += 1
            seen["max_in_flight"] = max(seen["max_in_flight"], seen["in_flight"])
            seen["requests"].append(body)
        time.sleep(0.05)
        with lock:
            seen["in_flight"] -= 1
        n = body["n_predict"] - (mode == "short")
        self._reply({"content": "", "tokens_predicted": n, "truncated": False})


ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()
