"""`folio bench serve` against a real `folio serve` that refuses what it is
sent: a --model it does not serve is one `folio: error:` line naming the
models it does serve, before any request of the run, and a run in which every
request fails says why, as a line and an error, not a traceback."""

import subprocess
import sys

import pytest

from tests.server.conftest import ServerProcess, tiny_server_args
from tests.utils import make_tiny_model


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("bench-serve"), max_position_embeddings=256)
    srv = ServerProcess(tiny_server_args(model))      # served as "tiny"
    yield srv, model
    srv.stop()


def bench(srv, model: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "folio.cli", "bench", "serve", "--base-url",
                           srv.url, "--tokenizer", model, "--num-prompts", "3", *argv],
                          capture_output=True, text=True, timeout=180)


def errors(proc: subprocess.CompletedProcess) -> list[str]:
    assert "Traceback" not in proc.stderr, proc.stderr
    return [line for line in proc.stderr.splitlines() if line.startswith("folio")]


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_a_model_the_server_does_not_serve_is_one_line_naming_what_it_does(served, endpoint):
    srv, model = served
    proc = bench(srv, model, "--model", "wrong-name", "--endpoint", endpoint,
                 "--input-len", "4", "--output-len", "2")
    assert proc.returncode == 1 and proc.stdout == ""          # no run was reported
    assert errors(proc) == [f"folio: error: {srv.url} does not serve --model 'wrong-name' "
                            f"(HTTP 404: The model `wrong-name` does not exist.); it serves: "
                            f"tiny"]


def test_the_served_name_runs_and_a_run_where_every_request_fails_says_why(served):
    srv, model = served
    ok = bench(srv, model, "--model", "tiny", "--input-len", "4", "--output-len", "2")
    assert ok.returncode == 0 and errors(ok) == []
    assert ok.stdout.startswith("rate inf: 3 ok, 0 failed in ")
    # prompts longer than the served context (256 tokens): each request is a 400
    proc = bench(srv, model, "--input-len", "300", "--output-len", "2")
    assert proc.returncode == 1
    line, = proc.stdout.splitlines()
    assert line.startswith("rate inf: 0 ok, 3 failed in ")
    assert "TTFT median - p99 - ms | TPOT median - p99 - ms" in line
    assert "| first error: HTTP 400: " in line and "context length" in line
    error, = errors(proc)
    assert error.startswith("folio: error: every request at rate inf failed: HTTP 400: ")
