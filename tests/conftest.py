"""Shared fixtures. Every BlockPool ever built is watched: after each test all of
its blocks must be back at reference count 0 and in the free queue."""

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
