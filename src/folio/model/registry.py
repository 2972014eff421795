"""Hugging Face architecture name -> model class."""

from __future__ import annotations

import torch

from folio.config import ModelConfig
from folio.model.llama import LlamaForCausalLM

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}


def build_model(cfg: ModelConfig, dtype: torch.dtype, device: str) -> torch.nn.Module:
    cls = MODEL_REGISTRY.get(cfg.architecture)
    if cls is None:
        raise ValueError(f"architecture {cfg.architecture!r} is not supported; "
                         f"supported: {', '.join(sorted(MODEL_REGISTRY))}")
    with torch.device(device):
        return cls(cfg, dtype, device).eval()
