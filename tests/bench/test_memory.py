"""`folio bench memory --json` on a tiny model: the promised fields, sharing
shows, progress on stderr only, and the report says what its figures compare."""

import json

from folio.bench.memory import print_memory
from folio.cli import main
from folio.core.kv_cache_manager import cdiv
from tests.utils import make_tiny_model


def test_bench_memory_json(tmp_path, capsys):
    model = make_tiny_model(tmp_path / "m", max_position_embeddings=512)
    assert main(["bench", "memory", "--model", model, "--dtype", "float32", "--block-size", "8",
                 "--num-kv-blocks", "256", "--prompt-len", "40", "--output-len", "12",
                 "--prefix-len", "64", "--suffix-len", "8", "--num-shared", "6",
                 "--waste-requests", "6", "--waste-input-len", "5:40", "--waste-output-len", "3:20",
                 "--json"]) == 0
    captured = capsys.readouterr()
    out = captured.out.strip().splitlines()
    assert len(out) == 1                    # stdout is the JSON object alone
    result = json.loads(out[0])
    progress = [line for line in captured.err.splitlines() if "folio bench memory: [" in line]
    assert len(progress) == 10 and progress[0].startswith("folio bench memory: [1/10] parallel-n1")
    assert "[10/10] waste workload, 6 requests" in progress[-1]
    assert result["block_size"] == 8 and result["num_blocks"] == 256
    cases = {c["name"]: c for c in result["cases"]}
    assert list(cases) == ["parallel-n1", "parallel-n2", "parallel-n4", "parallel-n8",
                           "beam-w2", "beam-w4", "beam-w8", "shared-prefix-6"]
    assert cases["beam-w8"]["blocks_without_sharing"] > cases["beam-w8"]["peak_blocks"]
    for c in cases.values():
        assert {"peak_blocks", "peak_tokens", "blocks_without_sharing"} <= set(c)
    assert cases["parallel-n1"]["saved"] == 0
    n4 = cases["parallel-n4"]
    assert n4["peak_blocks"] <= cdiv(40, 8) + 4 * (cdiv(12, 8) + 1)
    assert n4["blocks_without_sharing"] > n4["peak_blocks"]
    shared = cases["shared-prefix-6"]
    assert shared["saved"] > 0.3
    # the warm prefix is computed once: 6 requests ran little more than their own tokens
    assert shared["tokens_computed"] < 6 * (64 + 8)
    waste = result["waste"]
    assert 0 < waste["average_waste"] <= waste["peak_waste"] < 1
    assert 0 < waste["contiguous_max_model_len"]["tokens_fraction"] < \
        waste["contiguous_prompt_plus_max_tokens"]["tokens_fraction"] <= 1
    assert waste["contiguous_max_model_len"]["requests_at_once"] == 256 * 8 // 512
    assert waste["kv_slots"] == 256 * 8 and waste["max_model_len"] == 512
    assert waste["paged_tokens_fraction"] == 1 - waste["average_waste"]
    # on this workload the oracle holds tokens in less of its memory than paging: it
    # reserves each whole length from the first step
    assert waste["contiguous_prompt_plus_max_tokens"]["tokens_fraction"] < \
        waste["paged_tokens_fraction"]
    # the same memory in each KV cache dtype: 2 layers x 2 x 8 tokens x 2 KV heads x
    # 16 dims a block: fp32 4 bytes a value, bf16 2, int8 1 and 4 a row's scale
    capacity = {c["kv_cache_dtype"]: c for c in result["capacity"]}
    budget = 256 * 2 * 2 * 8 * 2 * 16 * 4
    for kv, row_bytes in (("float32", 64), ("bfloat16", 32), ("int8", 20), ("fp8", 20)):
        per = 2 * 2 * 8 * 2 * row_bytes
        assert capacity[kv]["bytes_per_block"] == per and capacity[kv]["blocks"] == budget // per
        assert capacity[kv]["requests_at_max_model_len"] == budget // per * 8 // 512
    print_memory(result)
    report = capsys.readouterr().out
    assert "int8: 1280 bytes a block, 819 blocks, 6552 tokens, 12 requests" in report
    assert "contiguous oracle, prompt + exact output length reserved" in report
    assert "oracle knows every output length before the request runs" in report
    assert "fit *" in report and "max_model_len (512)" in report
