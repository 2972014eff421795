"""Shared fixtures. Every BlockPool ever built is watched: after each test all of
its blocks must be back at reference count 0 and in the free queue.

`make test` runs the suite in pytest-xdist workers, one a CPU, each with one
thread (OMP_NUM_THREADS=1, set here before torch is imported, so the engines
and servers the tests start take one too): most tests are Python between small
products, so two at once on 2 CPUs ran the suite in about half the time, where
two workers with two threads each (a server's engine and its client on every
CPU) ran it slower than one. Tests of threaded paths (the kernels' row and
context splits) carry `@pytest.mark.threads(2)` and get two threads whatever
runs beside them (their OpenMP threads wait passively, so a descheduled peer
does not leave the other spinning). A plain `pytest` runs in one process with
the machine's threads, as before."""

from __future__ import annotations

import os
import weakref

import pytest

from folio.core.block_pool import BlockPool

# Without a GPU, Triton kernels run in triton's interpreter on the CPU. Triton
# reads this as it defines each function, so it is set here, before any test
# module can import triton.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"     # this worker's torch and what it starts
    # a threads(2) test shares the CPUs with the other worker: OpenMP threads
    # that spin at a barrier for a descheduled peer ran one 3.5x slower (41 s
    # against 15 s passive, beside a busy loop)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

_PREBUILD = None


def pytest_collection_finish(session):
    """Build the kernel library (this machine's, and, niced, the AVX2 and
    portable variants that collected tests take as parameters) in a
    background thread while the first tests run: on a fresh machine each build is 35-55 s
    that a test would otherwise wait for with the other core idle. A test
    that needs one before it is done waits for that build (native._builder)."""
    global _PREBUILD
    from folio.kernels import native
    wanted = [()]
    for item in session.items:
        for value in getattr(getattr(item, "callspec", None), "params", {}).values():
            if (isinstance(value, tuple) and value and value not in wanted
                    and all(isinstance(f, str) and f.startswith("-m") for f in value)
                    and native.distinct_build(value)):
                wanted.append(value)
    if session.items and not session.config.option.collectonly:
        _PREBUILD = native.prebuild(wanted)


def pytest_sessionfinish(session):
    if _PREBUILD is not None:      # no compiler left running after pytest
        _PREBUILD.join()


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "threads(n): in a one-thread xdist worker (make test), run with n torch "
        "threads and OMP_NUM_THREADS=n for the processes it starts")


@pytest.fixture(autouse=True)
def _threads(request, monkeypatch):
    """In an xdist worker: one thread for each test (a model built earlier may
    have set another), or the marker's count (also what the processes the
    test starts are told; a module-scoped fixture's ran before it, on one)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):     # a plain pytest: the machine's threads
        yield
        return
    import torch
    mark = request.node.get_closest_marker("threads")
    n = mark.args[0] if mark is not None else 1
    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", str(n))
    torch.set_num_threads(n)
    yield
    torch.set_num_threads(before)


_POOLS: "weakref.WeakSet[BlockPool]" = weakref.WeakSet()
_original_init = BlockPool.__init__


def _recording_init(self, *args, **kwargs):
    _original_init(self, *args, **kwargs)
    _POOLS.add(self)


BlockPool.__init__ = _recording_init


def assert_pool_whole(pool: BlockPool) -> None:
    held = [b for b in pool.blocks if b.ref_cnt != 0]
    assert not held, f"blocks still held after the test: {held[:8]}"
    assert pool.num_free_blocks == pool.num_blocks


@pytest.fixture(autouse=True)
def all_blocks_free():
    yield
    for pool in list(_POOLS):
        try:
            assert_pool_whole(pool)
        except AssertionError:
            _POOLS.discard(pool)     # report a leaking pool once, not in every later test
            raise


@pytest.fixture(scope="session")
def default_llm():
    """The default model (SmolLM2-135M-Instruct GGUF) in fp32 arithmetic on its
    codes, loaded once: the path held to transformers token for token. (The
    default int8 activations move logprobs by ~0.04 and so flip near ties:
    tests/engine/test_int8_activations.py.)"""
    from folio import LLM
    return LLM(dtype="float32", num_kv_blocks=256, max_model_len=2048,
               activation_quantization="none")


@pytest.fixture(scope="session")
def default_reference():
    """transformers' own load of the same GGUF (dequantized), the parity reference."""
    from tests.utils import default_gguf_path, load_reference_model
    return load_reference_model(default_gguf_path())
