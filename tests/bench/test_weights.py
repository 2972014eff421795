"""`folio bench weights`: the loaded model's bytes by role, and the packing
code's arithmetic for Llama shapes (the issue's seed figures: 70B in bf16
about 140 GB, in 4 bits 35-40 GB)."""

import json
import subprocess
import sys

import pytest
import torch

from folio import LLM
from folio.bench.weights import SHAPES, linear_bytes, loaded_bytes, shape_table
from folio.model.layers.quantization.int_groups import IntGroups


@pytest.mark.parametrize("bits,group", [(4, 128), (8, -1), (4, 32), (4, 20)])
@pytest.mark.parametrize("n,k", [(16, 256), (40, 576), (1000, 1536)])
def test_layer_arithmetic_equals_a_real_packing(n, k, bits, group):
    size = k if group == -1 else group
    groups = torch.arange(k) // size
    count = int(groups.max()) + 1
    w = IntGroups.from_codes(torch.zeros(n, k, dtype=torch.uint8), groups,
                             torch.ones(n, count), bits, zero=torch.ones(n, count))
    assert linear_bytes(n, k, (bits, group)) == w.nbytes


def test_llama_70b_seed_figures():
    table = shape_table({"70B": SHAPES["Llama-3-70B"]})["70B"]
    assert 70e9 < table["parameters"] < 71e9
    formats = table["formats"]
    assert 139e9 < formats["bf16"]["total_bytes"] < 143e9
    four = formats["int4 g128 (GPTQ/AWQ/int4)"]
    # the linear layers in 4 bits with a float16 scale and zero per 128; the
    # embedding and head (4.2 GB) stay bf16
    assert 35e9 < four["linear_bytes"] < 38e9 and four["total_bytes"] < 41e9


def test_the_default_model_in_its_codes_is_a_third_of_bf16():
    packed = loaded_bytes(LLM(dtype="bfloat16", num_kv_blocks=16).engine.executor.runner.model)
    plain = loaded_bytes(LLM(dtype="bfloat16", num_kv_blocks=16,
                             quantization="none").engine.executor.runner.model)
    assert packed["linear_formats"] == {"int4": 120}
    linear_params = 30 * (576 * 960 + 576 * 576 + 576 * 3072 + 1536 * 576)
    assert packed["bytes"]["linear"] <= linear_params * (0.5 + 4 / 32) + 120 * 4096
    assert plain["bytes"]["linear"] >= linear_params * 2
    assert packed["bytes"]["linear"] < plain["bytes"]["linear"] / 3


def test_the_command_prints_json():
    out = subprocess.run([sys.executable, "-m", "folio.cli", "bench", "weights", "--json",
                          "--num-kv-blocks", "16"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["quantization"] == "gguf"
    assert set(result["shapes"]) == {"SmolLM2-135M-Instruct", "Llama-3-8B", "Llama-3-70B",
                                     "Mixtral-8x7B"}
    mixtral = result["shapes"]["Mixtral-8x7B"]        # 46.7B in all, 12.9B a token
    assert round(mixtral["parameters"] / 1e9, 1) == 46.7
    assert round(mixtral["active_parameters"] / 1e9, 1) == 12.9
