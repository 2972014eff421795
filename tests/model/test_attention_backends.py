"""The attention-backend seam: chosen by device and dtype or by name, each
backend owns its KV layout and its metadata, and a backend added by a test
alone (one class, one registry entry) runs the model."""

import pytest
import torch

from folio import LLM, SamplingParams
from folio.model.attention import selector
from folio.model.attention.cpu_native import CPUNativeAttentionBackend
from folio.model.attention.torch_backend import TorchAttentionBackend
from folio.kernels import native
from tests.utils import make_tiny_model

pytestmark = pytest.mark.threads(2)     # the kernels' threaded paths (tests/conftest.py)

PROMPTS = [{"prompt_token_ids": [1, 20 + i, 30, 40, 50] * (1 + 4 * i)} for i in range(3)]
PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def _tokens(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]


def test_the_default_is_the_native_kernel_where_it_is_built():
    expected = CPUNativeAttentionBackend if native.load() is not None else TorchAttentionBackend
    assert selector.get_attention_backend("cpu", torch.float32) is expected
    assert selector.get_attention_backend("cpu", torch.float16) is TorchAttentionBackend


def test_a_named_backend_runs_and_answers_as_the_default(tmp_path):
    folder = make_tiny_model(tmp_path)
    default = LLM(folder, dtype="float32", num_kv_blocks=32, block_size=8)
    portable = LLM(folder, dtype="float32", num_kv_blocks=32, block_size=8,
                   attention_backend="torch_sdpa")          # names are case-blind
    runner = portable.engine.executor.runner
    assert runner.attn_backend is TorchAttentionBackend
    assert runner.model.model.native_decoder is None
    assert _tokens(portable) == _tokens(default)


def test_unknown_or_impossible_backends_fail_before_loading(tmp_path):
    folder = make_tiny_model(tmp_path)
    with pytest.raises(ValueError, match="unknown attention backend 'BOGUS'; choose from"):
        LLM(folder, num_kv_blocks=16, attention_backend="bogus")
    with pytest.raises(ValueError, match="does not run on cpu in float16"):
        selector.get_attention_backend("cpu", torch.float16, "CPU_NATIVE")


class PaddedLayoutBackend(TorchAttentionBackend):
    """Test-only: the portable backend with one spare block in its layout and
    its own count of the metadata it builds: the runner must allocate what
    the backend declares and take the metadata it builds."""

    name = "TEST_PADDED"
    built = 0

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim):
        return (2, num_blocks + 1, block_size, num_kv_heads, head_dim)

    @classmethod
    def build_metadata(cls, step):
        PaddedLayoutBackend.built += 1
        return super().build_metadata(step)


def test_a_backend_registered_by_a_test_owns_the_layout_and_the_metadata(tmp_path, monkeypatch):
    import sys
    monkeypatch.setitem(selector._BACKENDS, "TEST_PADDED", f"{__name__}:PaddedLayoutBackend")
    assert sys.modules[__name__].PaddedLayoutBackend is PaddedLayoutBackend
    folder = make_tiny_model(tmp_path)
    llm = LLM(folder, dtype="float32", num_kv_blocks=32, block_size=8,
              attention_backend="TEST_PADDED")
    runner = llm.engine.executor.runner
    assert runner.attn_backend is PaddedLayoutBackend
    assert all(c.shape[1] == 33 for c in runner.kv_caches)
    PaddedLayoutBackend.built = 0
    got = _tokens(llm)
    assert PaddedLayoutBackend.built > 0
    assert got == _tokens(LLM(folder, dtype="float32", num_kv_blocks=32, block_size=8))
    assert llm.engine.scheduler.kv.num_free_blocks == 32
