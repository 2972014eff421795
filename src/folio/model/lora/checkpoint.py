"""LoRA adapters as PEFT saves them (issue 31): `adapter_config.json` and
`adapter_model.safetensors` in a folder, read and checked against the base
model's shape before anything runs.

A LoRA on a linear layer W [out, in] adds scaling * B (A x), A [r, in] and
B [out, r]; scaling is lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA
(`use_rslora`). PEFT names the tensors after the wrapped model's modules:
`base_model.model.<module>.lora_A.weight`, `...lora_B.weight`, where
<module> is the base checkpoint's name of the projection
(`model.layers.3.self_attn.q_proj`). The projections Llama-style models
have are adapted: q/k/v/o and gate/up/down; Folio's fused layers (qkv,
gate_up) take their parts' adapters (model/lora/, when they run).

What an adapter may not hold is refused with a ValueError naming it: a
module the base lacks or whose shape differs (an adapter of another
model), a rank above --max-lora-rank, and what is not built: DoRA,
`modules_to_save`, bias training, per-module rank or alpha patterns,
adapters of embeddings or of the LM head, Conv1D-style (`fan_in_fan_out`)
weights, and `.bin` checkpoints.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from folio.config import ModelConfig

PREFIX = "base_model.model."
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DEFAULT_MAX_LORA_RANK = 64


@dataclass(frozen=True)
class LoRAWeights:
    """One adapted projection: A [r, in], B [out, r] (in their stored dtype)."""
    a: torch.Tensor
    b: torch.Tensor

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class LoRAAdapter:
    name: str
    path: str
    rank: int                       # the largest of its modules' ranks
    scaling: float                  # lora_alpha / r, or / sqrt(r) (rsLoRA)
    modules: dict[str, LoRAWeights]  # base checkpoint module name -> A, B

    @property
    def num_parameters(self) -> int:
        return sum(w.a.numel() + w.b.numel() for w in self.modules.values())


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """[out, in] of each adaptable projection of a Llama-style layer."""
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}


def _refuse_unsupported(config: dict, where: str) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type {config.get('peft_type')!r} is not a LoRA")
    for key, what in (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out (Conv1D) "
                                                                  "weights"),
                      ("use_qalora", "QA-LoRA"), ("modules_to_save", "modules_to_save"),
                      ("rank_pattern", "per-module ranks (rank_pattern)"),
                      ("alpha_pattern", "per-module alphas (alpha_pattern)"),
                      ("target_parameters", "LoRA on parameters (target_parameters)"),
                      ("trainable_token_indices", "trainable tokens")):
        if config.get(key):
            raise ValueError(f"{where}: {what} is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{where}: bias={config['bias']!r} (trained biases) is not supported; "
                         "only bias='none' adapters are")


def _scaling(config: dict, rank: int, where: str) -> float:
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        raise ValueError(f"{where}: lora_alpha must be a positive number, got {alpha!r}")
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def load_peft_adapter(name: str, path: str, base: ModelConfig,
                      max_rank: int = DEFAULT_MAX_LORA_RANK) -> LoRAAdapter:
    """The adapter in folder `path`, checked against `base`."""
    from safetensors.torch import load_file
    folder = Path(path)
    where = f"LoRA adapter {name!r} ({path})"
    config_file = folder / "adapter_config.json"
    if not config_file.is_file():
        raise ValueError(f"{where}: no adapter_config.json (a PEFT LoRA folder holds it and "
                         "adapter_model.safetensors)")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: adapter_config.json is not valid JSON: {e}") from None
    _refuse_unsupported(config, where)
    weights_file = folder / "adapter_model.safetensors"
    if not weights_file.is_file():
        also = " (a .bin checkpoint is not read: save it with safe_serialization)" \
            if (folder / "adapter_model.bin").is_file() else ""
        raise ValueError(f"{where}: no adapter_model.safetensors{also}")
    tensors = load_file(str(weights_file))
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, part = _split_key(key, where)
        pairs.setdefault(module, {})[part] = tensor
    if not pairs:
        raise ValueError(f"{where}: adapter_model.safetensors holds no LoRA weights")
    r = config.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ValueError(f"{where}: r must be a positive integer, got {r!r}")
    if r > max_rank:
        raise ValueError(f"{where}: rank {r} is above max_lora_rank ({max_rank})")
    shapes = projection_shapes(base)
    modules = {module: _checked(module, parts, r, shapes, base, where)
               for module, parts in sorted(pairs.items())}
    return LoRAAdapter(name, str(folder), r, _scaling(config, r, where), modules)


def _split_key(key: str, where: str) -> tuple[str, str]:
    """`base_model.model.<module>.lora_A.weight` -> (<module>, "a")."""
    for marker, part in ((".lora_A.weight", "a"), (".lora_B.weight", "b")):
        if key.endswith(marker) and key.startswith(PREFIX):
            return key[len(PREFIX):-len(marker)], part
    if "lora_embedding" in key or ".embed_tokens." in key:
        raise ValueError(f"{where}: adapters of the embeddings ({key}) are not supported")
    if ".base_layer." in key:       # PEFT saves the base weights it adapts there
        module = key[len(PREFIX):key.index(".base_layer.")]
        raise ValueError(f"{where}: an adapter of {module} (saved with its base weights) is "
                         "not supported: only the decoder layers' projections are adapted")
    raise ValueError(f"{where}: unexpected tensor {key!r} (not a LoRA A or B weight)")


def _checked(module: str, parts: dict[str, torch.Tensor], r: int,
             shapes: dict[str, tuple[int, int]], base: ModelConfig, where: str) -> LoRAWeights:
    """One module's A and B, against the base projection it adapts."""
    leaf = module.rsplit(".", 1)[-1]
    layer = module.split(".")
    block = "self_attn" if leaf in PROJECTIONS[:4] else "mlp"
    if leaf not in shapes or len(layer) != 5 or layer[:2] != ["model", "layers"] \
            or not layer[2].isdigit() or layer[3] != block:
        raise ValueError(f"{where}: module {module} is not one of the base model's adaptable "
                         f"projections (model.layers.N.{{self_attn,mlp}}.{{"
                         f"{','.join(PROJECTIONS)}}})")
    if int(layer[2]) >= base.num_hidden_layers:
        raise ValueError(f"{where}: module {module}: the base model has "
                         f"{base.num_hidden_layers} layers")
    if set(parts) != {"a", "b"}:
        missing = "lora_A" if "a" not in parts else "lora_B"
        raise ValueError(f"{where}: module {module} has no {missing} weight")
    a, b = parts["a"], parts["b"]
    out, inp = shapes[leaf]
    if a.dim() != 2 or b.dim() != 2 or a.shape != (r, inp) or b.shape != (out, r):
        raise ValueError(
            f"{where}: module {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do "
            f"not fit the base projection [{out}, {inp}] at rank {r} (an adapter of another "
            "model?)")
    return LoRAWeights(a, b)
