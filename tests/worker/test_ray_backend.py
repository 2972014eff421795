"""The Ray executor backend on a local Ray instance (2 CPUs, no dashboard, usage
stats off, loopback only): tp=2 on a tiny model gives one rank's tokens, after
a failed start on a truncated checkpoint that leaves nothing behind."""

import shutil
import sys

import pytest

from folio import LLM, SamplingParams
from tests.utils import make_tiny_model


def test_asking_for_ray_without_it_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)          # as if not installed
    path = make_tiny_model(tmp_path / "m")
    with pytest.raises(ValueError, match=r"pip install -e .\.\[ray\]. in the Folio checkout"):
        LLM(path, dtype="float32", num_kv_blocks=16, tensor_parallel_size=2,
            distributed_executor_backend="ray")


def test_ray_tp2_matches_one_rank(tmp_path, monkeypatch):
    ray = pytest.importorskip("ray")
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    path = make_tiny_model(tmp_path / "m")
    prompts = [{"prompt_token_ids": [1, 20 + i, 30, 40, 50 + i]} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].token_ids
                for o in LLM(path, dtype="float32", num_kv_blocks=64).generate(prompts, params)]
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             log_to_driver=False)
    try:
        # a failed start first: the actors and the process group must go with it
        bad = tmp_path / "truncated"
        shutil.copytree(path, bad)
        weights = bad / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:1000])
        with pytest.raises(ValueError, match="not a readable safetensors file"):
            LLM(str(bad), dtype="float32", num_kv_blocks=64, tensor_parallel_size=2,
                distributed_executor_backend="ray")
        llm = LLM(path, dtype="float32", num_kv_blocks=64, tensor_parallel_size=2,
                  distributed_executor_backend="ray")
        try:
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        finally:
            llm.shutdown()
    finally:
        ray.shutdown()
    assert got == expected
