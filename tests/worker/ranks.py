"""Shared by the parallel tests: a worker killed mid-run."""

import os
import signal
import time

import pytest

from folio import SamplingParams


def fails_mid_run(llm, lose, within: float) -> None:
    """`lose()` (a worker killed, a node removed) while a request runs: the
    next steps raise, naming a worker, within `within` seconds, not a hang."""
    engine = llm.engine
    engine.add_request("a", {"prompt_token_ids": [1, 2, 3]},
                       SamplingParams(max_tokens=200, ignore_eos=True))
    engine.step()
    lose()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="worker"):
        for _ in range(50):
            engine.step()
    assert time.monotonic() - start < within
    engine.abort_request(["a"])


def kill_a_worker_mid_run(llm) -> None:
    """A worker process killed mid-run fails the step within 10 s; shutdown
    leaves no worker behind."""
    workers = llm.engine.executor.workers
    fails_mid_run(llm, lambda: os.kill(workers[0].pid, signal.SIGKILL), within=10)
    llm.shutdown()
    assert not any(w.is_alive() for w in workers)
