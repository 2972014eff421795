"""The suite's own thread settings (tests/conftest.py): in `make test`'s
xdist workers a test runs on one thread, and the processes it starts are told
to by OMP_NUM_THREADS; a test marked `threads(n)` gets n, and so do the
processes it starts. (A plain pytest keeps the machine's threads and
ignores the marker.)"""

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not os.environ.get("PYTEST_XDIST_WORKER"),
                                reason="a plain pytest keeps the machine's threads: these "
                                "are make test's xdist workers' settings")


def _child_threads() -> int:
    """The torch threads of a process started from here (as a server or an
    engine core is: it inherits the environment)."""
    out = subprocess.run([sys.executable, "-c",
                          "from folio.worker.cpu_threads import default_threads; "
                          "print(default_threads()[0])"],
                         capture_output=True, text=True, check=True)
    return int(out.stdout)


@pytest.mark.threads(2)
def test_the_marker_gives_the_test_and_its_processes_two_threads():
    assert torch.get_num_threads() == 2
    assert _child_threads() == 2


def test_a_worker_runs_one_thread_and_so_do_its_processes():
    torch.set_num_threads(2)    # as a model built in an earlier test may have
    assert _child_threads() == 1


def test_a_worker_test_starts_on_one_thread():
    assert torch.get_num_threads() == 1
