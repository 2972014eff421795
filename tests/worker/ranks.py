"""Shared by the parallel tests: a worker killed mid-run."""

import os
import signal
import time

import pytest

from folio import SamplingParams


def kill_a_worker_mid_run(llm) -> None:
    """Kill a worker while a request runs: the next steps raise (naming a
    worker) within 10 s, not a hang; shutdown leaves no worker behind."""
    engine = llm.engine
    engine.add_request("a", {"prompt_token_ids": [1, 2, 3]},
                       SamplingParams(max_tokens=200, ignore_eos=True))
    engine.step()
    os.kill(engine.executor.workers[0].pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="worker"):
        for _ in range(50):
            engine.step()
    assert time.monotonic() - start < 10
    engine.abort_request(["a"])
    llm.shutdown()
    assert not any(w.is_alive() for w in engine.executor.workers)
