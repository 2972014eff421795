"""Hugging Face architecture name -> model class: the one list of what Folio runs.

A new architecture is its model file plus one line here; the loader checks
configs against these names, and the class is imported only when built.
"""

from __future__ import annotations

import importlib
from typing import Optional

import torch

from folio.config import ModelConfig
from folio.model.attention.backend import AttentionBackend
from folio.model.layers.quantization import get_quantization_config

# architecture -> "module:class"
MODEL_REGISTRY = {
    "LlamaForCausalLM": "folio.model.llama:LlamaForCausalLM",
    "MistralForCausalLM": "folio.model.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "folio.model.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "folio.model.qwen3:Qwen3ForCausalLM",
}


def supported_architectures() -> tuple[str, ...]:
    return tuple(MODEL_REGISTRY)


def model_class(architecture: str) -> type[torch.nn.Module]:
    where = MODEL_REGISTRY.get(architecture)
    if where is None:
        raise ValueError(f"architecture {architecture!r} is not supported; "
                         f"supported: {', '.join(sorted(MODEL_REGISTRY))}")
    module, cls = where.split(":")
    return getattr(importlib.import_module(module), cls)


def build_model(cfg: ModelConfig, dtype: torch.dtype, device: str,
                weight_dtype: Optional[str] = None,
                attn_backend: Optional[type[AttentionBackend]] = None) -> torch.nn.Module:
    """The model with its layers' weight methods picked by the checkpoint's format
    (`weight_dtype`: see FolioConfig) and its attention backend (None: chosen by
    device and dtype), its parameters empty, to be loaded."""
    cls = model_class(cfg.architecture)
    quant = get_quantization_config(cfg.quantization, cfg.quantization_config,
                                    weight_dtype=weight_dtype)
    with torch.device(device):
        return cls(cfg, dtype, device, quant, attn_backend).eval()
