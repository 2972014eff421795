"""--quantization int8 / int4: round-to-nearest at load of a plain float
checkpoint (src/folio/model/layers/quantization/rtn.py).

The reference is this test's own RTN formula, written plainly in numpy
(float32 arithmetic, float16 scales rounded up, round half to even):

- int8: per output channel, symmetric, s = max|w| / 127, q = round(w/s) + 128;
- int4: groups of 128 inputs, asymmetric over [min(w, 0), max(w, 0)],
  s = (max - min) / 15, z = round(-min/s), q = clamp(round(w/s) + z, 0, 15);

w' = (q - z) * s. Folio's packed layers dequantize to exactly w', and a float
copy of the checkpoint holding w' in every decoder linear layer, run by
transformers in fp32, gives Folio's logits to fp32 rounding (2e-4, both the
native kernel and the torch path) and its greedy tokens.
"""

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from folio import LLM
from folio.kernels import native
from folio.model.layers.quantization import get_quantization_config
from folio.model.layers.quantization.rtn import group_of_inputs, quantize
from tests.model.quantization.checkpoints import (FIXTURES, FP32,
                                                  assert_greedy_tokens_equal,
                                                  assert_logits_match,
                                                  assert_tensor_parallel_2_matches, float_model,
                                                  folio_logits)
from tests.utils import make_tiny_model

pytestmark = pytest.mark.threads(2)     # the kernels' threaded paths (tests/conftest.py)

# hidden 256 so that at tensor-parallel size 2 each rank's o_proj inputs (128)
# and down_proj inputs (256) are whole groups of 128
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
             num_key_value_heads=2)
PROMPTS = [[1, 17, 250, 3, 99, 42, 7, 311, 64, 128, 5, 200],
           [1, 300, 301, 302, 12, 13, 14, 180, 181, 9, 77, 2, 160, 33, 45, 19]]
DEFAULTS = {8: dict(group_size=-1, sym=True), 4: dict(group_size=128, sym=False)}
PROJ = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
        "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
LINEAR = tuple(name for names in PROJ.values() for name in names)


def _fp16_at_least(s):
    h = s.astype(np.float16)
    up = h.astype(np.float32) < s
    h[up] = np.nextafter(h[up], np.float16(np.inf))
    h[h == 0] = 1
    return h.astype(np.float32)


def rtn(w, bits, group_size, sym, first=0):
    """(w', the scale of each weight), both [N, K] float32: groups of
    `group_size` inputs counted from the checkpoint's input 0 (this rank's
    inputs start at `first`), -1 one group."""
    w = np.asarray(w, dtype=np.float32)
    k = w.shape[1]
    starts = [0] if group_size == -1 else sorted(
        {0} | {i - first for i in range(first, first + k) if i % group_size == 0})
    out, scale = np.empty_like(w), np.empty_like(w)
    top = 2 ** bits - 1
    for a, b in zip(starts, starts[1:] + [k]):
        g = w[:, a:b]
        if sym:
            half = 2 ** (bits - 1)
            s = _fp16_at_least(np.abs(g).max(1) / np.float32(half - 1))
            z = np.full_like(s, half)
        else:
            lo, hi = np.minimum(g.min(1), 0), np.maximum(g.max(1), 0)
            s = _fp16_at_least((hi - lo) / np.float32(top))
            z = np.clip(np.round(-lo / s), 0, top)
        q = np.clip(np.round(g / s[:, None]) + z[:, None], 0, top)
        out[:, a:b] = (q - z[:, None]) * s[:, None]
        scale[:, a:b] = s[:, None]
    return out, scale


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The tiny random model with its decoder linear weights rescaled to std
    1/sqrt(inputs), as a trained model's layers are roughly: at the tiny
    model's own std (0.2, a gain of ~3 per matmul) the network is chaotic
    and int8's 0.7% weight noise already moves the logits by ~10%."""
    path = make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", **SHAPE)
    tensors = load_file(f"{path}/model.safetensors")
    for key, value in tensors.items():
        if key.endswith(".weight") and key.split(".")[-2] in LINEAR:
            tensors[key] = value / (value.std() * value.shape[1] ** 0.5)
    save_file(tensors, f"{path}/model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def checkpoint(model):
    return load_file(f"{model}/model.safetensors")


@pytest.fixture(scope="module")
def float_copies(model, checkpoint, tmp_path_factory):
    """bits -> a plain fp32 HF folder whose decoder linear weights are w'."""
    copies = {}
    for bits in (8, 4):
        out = tmp_path_factory.mktemp(f"rtn{bits}")
        tensors = {}
        for key, value in checkpoint.items():
            if key.endswith(".weight") and key.split(".")[-2] in LINEAR:
                value = torch.from_numpy(rtn(value.numpy(), bits, **DEFAULTS[bits])[0])
            tensors[key] = value.float().contiguous()
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        shutil.copy(f"{model}/config.json", out / "config.json")
        copies[bits] = out
    return copies


@pytest.fixture(scope="module")
def llms(model):
    made = {bits: LLM(model, dtype="float32", **FP32, num_kv_blocks=32, quantization=f"int{bits}")
            for bits in (8, 4)}
    made[None] = LLM(model, dtype="float32", **FP32, num_kv_blocks=32)
    return made


def _layers(llm):
    model = llm.engine.executor.runner.model
    for i, block in enumerate(model.model.layers):
        for name, parts in PROJ.items():
            owner = block.self_attn if name in ("qkv_proj", "o_proj") else block.mlp
            sub = "self_attn" if owner is block.self_attn else "mlp"
            yield getattr(owner, name), [f"model.layers.{i}.{sub}.{p}.weight" for p in parts]


@pytest.mark.parametrize("bits", [8, 4])
def test_packed_weights_dequantize_to_the_rtn_formula(bits, llms, checkpoint):
    count = 0
    for layer, keys in _layers(llms[bits]):
        w = torch.cat([checkpoint[k] for k in keys]).numpy()
        expect, scale = rtn(w, bits, **DEFAULTS[bits])
        got = layer.quant_method.weights.dequantize().numpy()
        assert np.array_equal(got, expect), keys
        # every weight within half a (stored) scale of the checkpoint's
        assert (np.abs(got - w) <= scale / 2 * (1 + 1e-6)).all(), keys
        count += 1
    assert count == 8


@pytest.mark.parametrize("path", ["default", "kernel", "torch"])
@pytest.mark.parametrize("bits", [8, 4])
def test_logits_match_transformers_on_the_rtn_weights(bits, path, llms, float_copies,
                                                      monkeypatch):
    """default: as a user runs it (the one-call native decoder where it
    serves); kernel: the layer modules, each on the quantized linear kernel;
    torch: the modules, dequantizing per call."""
    if path != "default" and not native.runs_qlinear(torch.zeros(1)):
        pytest.skip("no quantized linear kernel on this machine")
    if path != "default":
        monkeypatch.setattr(llms[bits].engine.executor.runner.model.model, "native_decoder",
                            None)
    if path == "torch":
        monkeypatch.setattr(native, "runs_qlinear", lambda x: False)
    assert_logits_match(llms[bits], float_model(float_copies[bits]), PROMPTS, 2e-4)


@pytest.mark.parametrize("bits", [8, 4])
def test_greedy_tokens_equal_transformers_on_the_rtn_weights(bits, llms, float_copies):
    assert_greedy_tokens_equal(llms[bits], float_model(float_copies[bits]), PROMPTS,
                               f"int{bits}")


def test_int8_stays_close_to_the_float_model_and_int4_further_but_finite(llms):
    """Against the unquantized model's logits (largest ~12), measured: int8
    max |difference| 0.26-0.28 (2.3% of the largest logit), mean 0.05-0.06
    (0.5%), its argmax equal at 93-100% of positions; int4 (10% relative
    rms weight error at groups of 128 on Gaussian weights) max 3.5-4.2,
    mean 0.7-0.8. Tolerances: int8 max within 5% and mean within 1% of the
    largest logit; int4 finite, further off than int8 and within 50%."""
    for prompt in PROMPTS:
        ref = folio_logits(llms[None], prompt)
        top = ref.abs().max().item()
        d8 = (folio_logits(llms[8], prompt) - ref).abs()
        q4 = folio_logits(llms[4], prompt)
        d4 = (q4 - ref).abs()
        assert bool(q4.isfinite().all())
        assert d8.max().item() < 0.05 * top and d8.mean().item() < 0.01 * top
        assert d8.mean().item() < d4.mean().item() and d4.max().item() < 0.5 * top


def test_tensor_parallel_2_gives_the_same_int4_tokens_and_logprobs(model, llms):
    """Column-parallel layers quantize their output slice, row-parallel ones
    their input slice; with every rank's inputs whole groups of 128 the
    quantized weights are those of tensor-parallel size 1."""
    assert_tensor_parallel_2_matches(model, PROMPTS, one=llms[4], quantization="int4")


@pytest.mark.parametrize("bits", [8, 4])
def test_layers_keep_only_the_packed_form(bits, llms):
    for layer, _ in _layers(llms[bits]):
        assert layer.weight.numel() == 0
        w = layer.quant_method.weights
        n, k = w.out_features, w.in_features
        groups = 1 if bits == 8 else k // 128
        assert (w.bits, w.zeros, w.perm) == (bits, True, None)
        assert w.bounds.numel() == groups + 1
        # bits/8 a weight, 2 + 2 bytes (float16 scale and zero) per group and output
        assert w.nbytes == n * k * bits // 8 + 4 * n * groups + 4 * (groups + 1)
    down = llms[4].engine.executor.runner.model.model.layers[0].mlp.down_proj
    assert down.quant_method.weights.nbytes / (256 * 512) < 0.54


def test_a_bf16_checkpoint_is_quantized_from_its_own_values(model, checkpoint, tmp_path):
    folder = tmp_path / "bf16"
    shutil.copytree(model, folder)
    half = {k: v.to(torch.bfloat16) for k, v in checkpoint.items()}
    save_file(half, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["torch_dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(config))
    llm = LLM(str(folder), dtype="float32", **FP32, num_kv_blocks=16, quantization="int4")
    for layer, keys in _layers(llm):
        w = torch.cat([half[k] for k in keys]).float().numpy()
        expect, _ = rtn(w, 4, **DEFAULTS[4])
        assert np.array_equal(layer.quant_method.weights.dequantize().numpy(), expect), keys
    assert bool(folio_logits(llm, PROMPTS[0]).isfinite().all())


# --------------------------------------------------------------------------- the parts


def test_groups_run_from_the_checkpoints_first_input_and_the_last_may_be_shorter():
    assert group_of_inputs(576, 128).bincount().tolist() == [128, 128, 128, 128, 64]
    assert group_of_inputs(300, -1).bincount().tolist() == [300]
    # rank 1 of 2 of a row-parallel 896-input layer: inputs 448..895
    assert group_of_inputs(448, 128, first=448).bincount().tolist() == [64, 128, 128, 128]


@pytest.mark.parametrize("bits,sym", [(8, True), (4, False), (4, True), (8, False)])
def test_a_shorter_last_group_follows_the_formula_and_beats_per_channel(bits, sym):
    torch.manual_seed(0)
    w = torch.randn(48, 576) * 0.05
    groups = group_of_inputs(576, 128)
    codes, scale, zero = quantize(w, groups, bits, sym)
    deq = (codes.float() - zero[:, groups]) * scale.float()[:, groups]
    expect, _ = rtn(w.numpy(), bits, 128, sym)
    assert np.array_equal(deq.numpy(), expect)
    per_channel, _ = rtn(w.numpy(), bits, -1, sym)
    assert np.abs(expect - w.numpy()).mean() < np.abs(per_channel - w.numpy()).mean()


@pytest.mark.parametrize("bits,sym", [(8, True), (4, False)])
def test_all_zero_and_tiny_groups_give_no_nan(bits, sym):
    w = torch.randn(32, 256)
    w[3] = 0                        # an all-zero row: both its groups
    w[5, :128] = 0                  # one all-zero group
    w[7] = torch.randn(256) * 1e-7  # a scale below float16's smallest normal
    groups = group_of_inputs(256, 128)
    codes, scale, zero = quantize(w, groups, bits, sym)
    assert bool(scale.isfinite().all()) and bool((scale > 0).all())
    deq = (codes.float() - zero[:, groups]) * scale.float()[:, groups]
    assert bool(deq.isfinite().all())
    assert bool((deq[3] == 0).all()) and bool((deq[5, :128] == 0).all())
    assert bool((codes[3] == (128 if sym else 0)).all())
    assert bool(((deq - w).abs() <= scale.float()[:, groups] / 2 * (1 + 1e-6)).all())
    assert (deq[7] - w[7]).abs().max().item() < 1e-7


def test_weights_too_large_for_float16_scales_are_refused_by_name():
    w = torch.full((16, 128), 1e7)
    with pytest.raises(ValueError, match="layer.x: int8: weights of magnitude up to 1e\\+07 "
                                         "cannot be quantized to 8 bits with float16 scales"):
        quantize(w, group_of_inputs(128, -1), 8, True, "layer.x: int8")


def test_defaults_and_bad_options():
    assert (get_quantization_config("int8").group_size, get_quantization_config("int8").sym) \
        == (-1, True)
    assert (get_quantization_config("int4").group_size, get_quantization_config("int4").sym) \
        == (128, False)
    assert get_quantization_config("int4", {"group_size": 64}).group_size == 64
    with pytest.raises(ValueError, match="int4 group_size 0 is not valid"):
        get_quantization_config("int4", {"group_size": 0})
    with pytest.raises(ValueError, match="int8 sym 'yes' is not valid"):
        get_quantization_config("int8", {"sym": "yes"})


def test_a_quantized_checkpoint_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--quantization int8 does not match the checkpoint, "
                                         "whose weights are gptq"):
        LLM(str(FIXTURES / "gptq-w4-g32-sym"), quantization="int8", **FP32, num_kv_blocks=16)


def test_the_cli_lists_int8_and_int4():
    import argparse

    from folio.cli import add_engine_args
    p = argparse.ArgumentParser()
    add_engine_args(p)
    text = " ".join(p.format_help().split())
    assert "int8, int4" in text and "round-to-nearest at load of a float checkpoint" in text
