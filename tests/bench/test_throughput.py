"""`folio bench throughput` runs on a tiny workload and prints the promised JSON.
(Benchmarks are not tests: no speed is asserted here.)"""

import json

import pytest

from folio.cli import main
from tests.utils import make_tiny_model

FIELDS = {"requests", "prompt_tokens", "output_tokens", "seconds", "output_tokens_per_s",
          "total_tokens_per_s", "ceiling_gflops", "ceiling_fraction"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("bench"))


# the tiny model's engines need little of the 2 GiB CPU default, whose zeroing
# costs over a second an engine
SMALL_KV = ["--kv-cache-memory-bytes", "64MiB"]


def run_json(capsys, argv):
    assert main(argv + SMALL_KV) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_random_workload_with_both_baselines(tiny, capsys):
    result = run_json(capsys, [
        "bench", "throughput", "--model", tiny, "--dtype", "float32", "--num-prompts", "4",
        "--input-len", "4:12", "--output-len", "2:5", "--baseline", "hf-seq",
        "--baseline", "hf-static", "--baseline-batch", "2", "--baseline-limit", "3", "--json"])
    assert FIELDS | {"baseline", "baseline_output_tokens_per_s", "speedup"} <= set(result)
    assert result["requests"] == 4 and 8 <= result["output_tokens"] <= 20
    assert 0 < result["ceiling_fraction"] and result["ceiling_gflops"] > 0
    assert [b["name"] for b in result["baselines"]] == ["hf-seq", "hf-static"]
    assert all(b["requests"] == 3 for b in result["baselines"])
    assert result["speedup"] == pytest.approx(
        result["output_tokens_per_s"] / result["baseline_output_tokens_per_s"])


def test_jsonl_dataset_and_static_batching(tiny, tmp_path, capsys):
    data = tmp_path / "reqs.jsonl"
    data.write_text('{"prompt": "Hello world", "max_tokens": 3}\n'
                    '{"prompt_token_ids": [5, 6, 7], "max_tokens": 2}\n\n')
    result = run_json(capsys, ["bench", "throughput", "--model", tiny, "--dtype", "float32",
                               "--dataset", str(data), "--batching", "static",
                               "--batch-size", "1", "--json"])
    assert FIELDS <= set(result) and "speedup" not in result
    assert result["requests"] == 2 and result["output_tokens"] == 5
    assert result["batching"] == "static"


def test_both_batchings_in_one_engine(tiny, capsys):
    result = run_json(capsys, ["bench", "throughput", "--model", tiny, "--dtype", "float32",
                               "--num-prompts", "4", "--input-len", "4:8", "--output-len", "3",
                               "--batching", "both", "--batch-size", "2", "--json"])
    assert result["continuous_over_static"] == pytest.approx(
        result["output_tokens_per_s"] / result["static_output_tokens_per_s"])


def test_each_timed_run_starts_with_an_empty_prefix_cache(tiny):
    """The static run of `--batching both` repeats the continuous run's prompts:
    it must compute them again, not find them cached."""
    import argparse

    from folio.bench.throughput import add_throughput_args, bench_throughput
    from folio.engine.llm_engine import LLMEngine
    p = argparse.ArgumentParser()
    add_throughput_args(p)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(["--num-prompts", "4", "--input-len", "40:60", "--output-len", "3",
                         "--batching", "both", "--batch-size", "2"])
    engine = LLMEngine.from_args(tiny, dtype="float32", block_size=16, num_kv_blocks=256)
    try:
        runner = engine.executor.runner
        before = runner.num_computed_tokens_total
        result = bench_throughput(args, engine)
        computed = runner.num_computed_tokens_total - before - 16 - 3      # less the warm-up
        per_run = result["prompt_tokens"] + result["output_tokens"] - result["requests"]
        assert computed == 2 * per_run
    finally:
        engine.shutdown()


def test_the_transformers_baseline_reads_the_default_gguf_dequantized():
    """Folio keeps the GGUF's Q4_1 layers in their codes; the baseline model
    still gets every weight as float (the same values transformers' own GGUF
    reader gives: tests/model/test_loader.py)."""
    import torch

    from folio.bench.baselines import load_hf_model
    from folio.model.loader import load_model_config
    m = load_model_config(None)
    assert m.quantization == "gguf"
    model = load_hf_model(m, torch.float32)
    q = model.model.layers[0].self_attn.q_proj.weight
    assert q.shape == (576, 576) and q.dtype == torch.float32 and q.abs().sum() > 0


def test_speculative_decoding_is_reported(tiny, tmp_path, capsys):
    data = tmp_path / "loops.jsonl"
    # most of the tiny vocabulary in the prompt: whatever the model says occurred
    # before, and a one-token lookup proposes what followed it
    data.write_text(json.dumps({"prompt_token_ids": list(range(5, 300)), "max_tokens": 8}) + "\n")
    argv = ["bench", "throughput", "--model", tiny, "--dtype", "float32", "--dataset", str(data),
            "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, '
                                    '"prompt_lookup_min": 1}']
    spec = run_json(capsys, argv + ["--json"])["spec_decode"]
    assert spec["num_drafts"] > 0 and spec["num_draft_tokens"] >= spec["num_drafts"]
    assert 0 <= spec["num_accepted_tokens"] <= spec["num_draft_tokens"]
    assert spec["acceptance_rate"] == spec["num_accepted_tokens"] / spec["num_draft_tokens"]
    assert main(argv + SMALL_KV) == 0
    assert (f"speculative decoding: {spec['num_accepted_tokens']} of "
            f"{spec['num_draft_tokens']} proposed tokens accepted") in capsys.readouterr().out
