"""PEFT LoRA adapters read and checked (issue 31): adapters made by the real
`peft` package on a tiny random model, every tensor and the scaling as peft
holds them, and each kind of adapter that does not fit or is not supported
refused with a message naming it."""

import json

import pytest
import torch

from folio.model.loader import load_model_config
from folio.model.lora.checkpoint import load_peft_adapter
from tests.utils import make_tiny_model

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("lora") / "base")


def _peft_adapter(base: str, out, **lora):
    """An adapter saved by peft itself, its B random (not peft's zeros), and
    the peft model it came from."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base),
                           LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": ALL,
                                         "init_lora_weights": False, **lora}))
    model.save_pretrained(str(out))
    return str(out), model


@pytest.mark.parametrize("rslora", [False, True])
def test_every_tensor_and_the_scaling_as_peft_holds_them(base, tmp_path, rslora):
    path, model = _peft_adapter(base, tmp_path / "ad", r=6, lora_alpha=12, use_rslora=rslora)
    adapter = load_peft_adapter("sql", path, load_model_config(base))
    assert (adapter.name, adapter.rank) == ("sql", 6)
    layers = model.base_model.model.model.layers
    assert len(adapter.modules) == len(layers) * len(ALL)
    for i, layer in enumerate(layers):
        for leaf in ALL:
            block = "self_attn" if leaf in ALL[:4] else "mlp"
            peft_module = getattr(getattr(layer, block), leaf)
            got = adapter.modules[f"model.layers.{i}.{block}.{leaf}"]
            assert torch.equal(got.a, peft_module.lora_A["default"].weight.detach())
            assert torch.equal(got.b, peft_module.lora_B["default"].weight.detach())
            assert adapter.scaling == pytest.approx(peft_module.scaling["default"])
    assert adapter.scaling == pytest.approx(12 / 6 ** 0.5 if rslora else 2.0)
    assert adapter.num_parameters == sum(
        p.numel() for n, p in model.named_parameters() if "lora_" in n)


def test_what_does_not_fit_or_is_not_built_is_refused(base, tmp_path):
    cfg = load_model_config(base)
    other = make_tiny_model(tmp_path / "other", hidden_size=32)
    cases = [
        (_peft_adapter(other, tmp_path / "other_ad")[0], {},
         r"module model.layers.0.mlp.down_proj: lora_A \(4, 128\) and lora_B \(32, 4\) do "
         r"not fit the base projection \[64, 128\]"),
        (_peft_adapter(base, tmp_path / "big", r=8)[0], {"max_rank": 4},
         r"rank 8 is above max_lora_rank \(4\)"),
        (_peft_adapter(base, tmp_path / "dora", use_dora=True)[0], {}, "DoRA is not supported"),
        (_peft_adapter(base, tmp_path / "save", modules_to_save=["lm_head"])[0], {},
         "modules_to_save is not supported"),
        (_peft_adapter(base, tmp_path / "bias", bias="lora_only")[0], {},
         "bias='lora_only' .* is not supported"),
        (_peft_adapter(base, tmp_path / "emb", target_modules=["embed_tokens"])[0], {},
         "adapters of the embeddings .* are not supported"),
        (_peft_adapter(base, tmp_path / "head", target_modules=["lm_head"])[0], {},
         "an adapter of lm_head .* is not supported"),
        (str(tmp_path), {}, "no adapter_config.json"),
    ]
    for path, kw, message in cases:
        with pytest.raises(ValueError, match=message):
            load_peft_adapter("x", path, cfg, **kw)
    # the base has 2 layers: an adapter of a deeper model names the layer
    deep = make_tiny_model(tmp_path / "deep", num_hidden_layers=3)
    with pytest.raises(ValueError, match="model.layers.2.mlp.down_proj: the base model "
                                         "has 2 layers"):
        load_peft_adapter("x", _peft_adapter(deep, tmp_path / "deep_ad")[0], cfg)
    # a .bin checkpoint is named as such
    path = tmp_path / "bin"
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    (path / "adapter_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="a .bin checkpoint is not read"):
        load_peft_adapter("x", str(path), cfg)
