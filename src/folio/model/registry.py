"""Hugging Face architecture name -> model class: the one list of what Folio runs.

A new architecture is its model file plus one entry here (its class, its
config.json model_type, its GGUF name, the defaults and quirks the loaders
need); the HF and GGUF loaders check configs against these entries, and the
class is imported only when built.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Optional

import torch

from folio.config import ModelConfig
from folio.model.attention.backend import AttentionBackend
from folio.model.layers.quantization import get_quantization_config

@dataclass(frozen=True)
class Architecture:
    """What Folio knows of one architecture, for HF folders and GGUF files alike."""
    cls: str                                # "module:class", imported when built
    model_type: str                         # config.json's model_type (older configs lack
                                            # `architectures`)
    max_positions: int                      # transformers' default max_position_embeddings
    gguf: Optional[str] = None              # the GGUF's general.architecture (None: none)
    gguf_permuted_qk: bool = False          # llama.cpp permutes q/k rows for ggml's rotary
    qkv_bias: bool = False                  # q/k/v always carry a bias (config.json says not)
    window_opt_in: bool = False             # sliding_window counts only with use_sliding_window
    windowed: bool = False                  # its sliding-window layers attend to their window
                                            # (max_model_len is then not capped at it):
                                            # Gemma 3's local layers; every layer of
                                            # Mistral, Mixtral and Phi-3 where sliding_window
                                            # is set
    config_fields: Optional[str] = None     # "module:function": config.json fields the
                                            # architecture spells its own way -> ModelConfig's


# HF architecture name -> what it is; the one list (loader.py and gguf_loader.py read it)
ARCHITECTURES = {
    "LlamaForCausalLM": Architecture("folio.model.llama:LlamaForCausalLM", "llama", 2048,
                                     gguf="llama", gguf_permuted_qk=True),
    # Mistral GGUFs say "llama" (the same graph): read as LlamaForCausalLM
    "MistralForCausalLM": Architecture("folio.model.llama:LlamaForCausalLM", "mistral",
                                       4096 * 32, windowed=True),
    "Qwen2ForCausalLM": Architecture("folio.model.llama:LlamaForCausalLM", "qwen2", 32768,
                                     gguf="qwen2", qkv_bias=True, window_opt_in=True),
    "Qwen3ForCausalLM": Architecture("folio.model.qwen3:Qwen3ForCausalLM", "qwen3", 32768,
                                     gguf="qwen3", window_opt_in=True),
    # Llama's graph with fused qkv_proj / gate_up_proj in the checkpoint (model/phi3.py)
    "Phi3ForCausalLM": Architecture("folio.model.phi3:Phi3ForCausalLM", "phi3", 4096,
                                    gguf="phi3", windowed=True,
                                    config_fields="folio.model.phi3:phi3_fields"),
    # text only; local sliding-window layers interleaved with global ones
    "Gemma3ForCausalLM": Architecture("folio.model.gemma3:Gemma3ForCausalLM", "gemma3_text",
                                      131072, gguf="gemma3", windowed=True,
                                      config_fields="folio.model.gemma3_config:hf_fields"),
    # mixture of experts (model/moe.py): float experts only (a GGUF's dequantized at
    # load); Mixtral GGUFs say "llama" with an expert count (gguf_loader.py)
    "MixtralForCausalLM": Architecture("folio.model.moe:MixtralForCausalLM", "mixtral",
                                       4096 * 32, windowed=True,
                                       config_fields="folio.model.moe_config:mixtral_fields"),
    "Qwen3MoeForCausalLM": Architecture("folio.model.moe:Qwen3MoeForCausalLM", "qwen3_moe",
                                        32768, gguf="qwen3moe", window_opt_in=True,
                                        config_fields="folio.model.moe_config:qwen3_moe_fields"),
    # an encoder, for embeddings only (--task embed): sentence-transformers' MiniLM & co.
    "BertModel": Architecture("folio.model.bert:BertModel", "bert", 512,
                              config_fields="folio.model.bert:bert_fields"),
    # a cross-encoder, for scores only (--task score): ms-marco MiniLM & co.
    "BertForSequenceClassification": Architecture(
        "folio.model.bert:BertForSequenceClassification", "bert", 512,
        config_fields="folio.model.bert:bert_fields"),
}
MODEL_REGISTRY = {name: a.cls for name, a in ARCHITECTURES.items()}      # name -> "module:class"


def supported_architectures() -> tuple[str, ...]:
    return tuple(ARCHITECTURES)


def architecture(name: str) -> Architecture:
    """The entry of an architecture the loader has checked is supported."""
    return ARCHITECTURES[name]


def by_model_type(model_type: Optional[str]) -> Optional[str]:
    return next((n for n, a in ARCHITECTURES.items() if a.model_type == model_type), None)


def config_fields(name: str, cfg: dict, num_layers: int, source: str) -> dict:
    """The ModelConfig fields an architecture reads from config.json its own way
    (empty for the Llama-shaped ones)."""
    where = ARCHITECTURES[name].config_fields
    if where is None:
        return {}
    module, fn = where.split(":")
    return getattr(importlib.import_module(module), fn)(cfg, num_layers, source)


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
