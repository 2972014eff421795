"""A real `folio serve` process per test module, on a free port of 127.0.0.1."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import pytest

from tests.utils import make_tiny_model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, args: list[str], env: dict | None = None, deadline: float = 180.0,
                 wait: bool = True):
        """`wait=False`: started, not waited for (call wait_healthy: several
        servers then load their models side by side)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "folio.cli", "serve", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env={**os.environ, **(env or {})})
        if wait:
            self.wait_healthy(deadline)

    def wait_healthy(self, deadline: float = 180.0) -> None:
        end = time.monotonic() + deadline
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"server did not become healthy:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def stop(self, sig=signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("served"), max_position_embeddings=256)


def tiny_server_args(model: str) -> list[str]:
    """`folio serve` arguments of the module's shared server."""
    return ["--model", model, "--dtype", "float32", "--num-kv-blocks", "96", "--block-size", "8",
            "--served-model-name", "tiny", "--max-num-batched-tokens", "128",
            "--uvicorn-log-level", "warning", "--trust-request-chat-template"]


@pytest.fixture(scope="module")
def server(tiny_model, request):
    srv = ServerProcess(tiny_server_args(tiny_model))
    yield srv
    failed = request.session.testsfailed
    srv.stop()
    if failed:
        print(f"---- server log ----\n{srv.output()}")


def wait_for(predicate, timeout: float = 30.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def http(method: str, url: str, body=None, headers: dict | None = None, raw: bytes | None = None,
         timeout: float = 60):
    """(status, headers, parsed JSON or text) with the standard library only."""
    import json as _json
    data = raw if raw is not None else (None if body is None else _json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, hdrs, text = r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        status, hdrs, text = e.code, dict(e.headers), e.read().decode()
    try:
        return status, hdrs, _json.loads(text)
    except ValueError:
        return status, hdrs, text
