"""The engine on the TRITON attention backend gives the torch backend's greedy
tokens, with chunked prefill, a shared prefix found in the cache and
preemption in the same run. On the CPU the kernels run in triton's
interpreter (TRITON_INTERPRET=1, which tests/conftest.py sets); the backend
is never the CPU default, only taken when named."""

import random

import pytest
import torch

pytest.importorskip("triton", reason="the TRITON backend needs triton (the dev extra pins it)")

from folio import LLM, SamplingParams
from folio.model.attention import selector
from folio.model.attention.triton_backend import TritonAttentionBackend
from tests.utils import make_tiny_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def workload():
    rng = random.Random(7)
    shared = [rng.randrange(5, 384) for _ in range(24)]       # 6 blocks of 4: a cached prefix
    prompts = [shared + [rng.randrange(5, 384) for _ in range(n)] for n in (3, 17, 40)]
    prompts += [[rng.randrange(5, 384) for _ in range(n)] for n in (1, 29, 61)]
    return [{"prompt_token_ids": p} for p in prompts]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8", "fp8_e5m2"])
def test_greedy_tokens_equal_the_torch_backend_under_pressure(tmp_path, kv_cache_dtype):
    """Preemption and prefix hits on a float cache and on the 8-bit ones."""
    folder = make_tiny_model(tmp_path)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    runs = {}
    for name in ("TRITON", "TORCH_SDPA"):
        llm = LLM(folder, dtype="float32", device=DEVICE, num_kv_blocks=24, block_size=4,
                  max_num_batched_tokens=32, max_num_seqs=4, attention_backend=name,
                  kv_cache_dtype=kv_cache_dtype)
        assert llm.engine.executor.runner.attn_backend.name == name
        outs = llm.generate(workload(), params, use_tqdm=False)
        runs[name] = [o.outputs[0].token_ids for o in outs]
        sched = llm.engine.scheduler
        assert sched.num_preemptions > 0 and sched.prefix_cache_hits >= 24
        assert sched.kv.num_free_blocks == 24
    assert runs["TRITON"] == runs["TORCH_SDPA"]
    assert all(len(t) == 12 for t in runs["TRITON"])


def test_only_cuda_takes_it_by_default_and_naming_it_elsewhere_says_what_it_needs(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert selector.get_attention_backend("cpu", torch.float32) is not TritonAttentionBackend
    assert selector.get_attention_backend("cpu", torch.float32, "triton") is TritonAttentionBackend
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="does not run on cpu in float32 .*TRITON_INTERPRET=1"):
        selector.get_attention_backend("cpu", torch.float32, "triton")
