"""A tensor-parallel server (tp=2 on a tiny model): it answers as one rank does,
and when a worker dies requests fail fast (503), the server exits non-zero with
one line saying why, and no process is left behind."""

import glob
import os
import signal

from tests.server.conftest import ServerProcess, http
from tests.server.test_lifecycle import wait_for


def spawned_children(pid: int) -> list[int]:
    """The processes multiprocessing spawned under `pid`, its children's too
    (the engine core's process, and its tensor-parallel workers), parents first."""
    kids = []
    for path in glob.glob(f"/proc/{pid}/task/*/children"):
        with open(path) as f:
            kids += [int(x) for x in f.read().split()]
    found = []
    for kid in kids:
        try:
            with open(f"/proc/{kid}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    found.append(kid)
                    found += spawned_children(kid)
        except OSError:
            pass
    return found


def tp_workers(server: int) -> list[int]:
    """The tensor-parallel workers: in the engine core's process when there is
    one (the server's spawned child with spawned children of its own)."""
    spawned = spawned_children(server)
    cores = [p for p in spawned if spawned_children(p)]
    return [p for p in spawned if p not in cores]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def test_tp2_server_answers_then_fails_cleanly(tiny_model):
    body = {"model": "tiny", "prompt": [1, 20, 30, 40], "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}
    single = ServerProcess(["--model", tiny_model, "--dtype", "float32", "--num-kv-blocks", "32",
                            "--served-model-name", "tiny", "--uvicorn-log-level", "warning"])
    try:
        expected = http("POST", single.url + "/v1/completions", body)[2]["choices"][0]["text"]
    finally:
        single.stop()
    srv = ServerProcess(["--model", tiny_model, "--dtype", "float32", "--num-kv-blocks", "32",
                         "--served-model-name", "tiny", "--tensor-parallel-size", "2",
                         "--uvicorn-log-level", "warning"])
    try:
        status, _, out = http("POST", srv.url + "/v1/completions", body)
        assert status == 200 and out["choices"][0]["text"] == expected
        spawned = spawned_children(srv.proc.pid)
        workers = tp_workers(srv.proc.pid)
        assert workers, "no tensor-parallel worker found"
        os.kill(workers[0], signal.SIGKILL)
        status, _, err = http("POST", srv.url + "/v1/completions", body)
        assert status == 503 and "worker" in err["error"]["message"]
        srv.proc.wait(60)               # a dead engine ends the process
    finally:
        srv.stop()
    assert srv.proc.returncode == 1
    last = srv.output().splitlines()[-1]
    assert last.startswith("folio: error: the engine stopped: ") and "worker" in last
    assert wait_for(lambda: not any(alive(p) for p in spawned), 10)   # the core's too
