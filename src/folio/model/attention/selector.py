"""Which attention backend a model runs: by device and dtype, or by name
(`--attention-backend`, vLLM's flag). A new backend is one module and one line
in `_BACKENDS`, in the order of preference."""

from __future__ import annotations

import importlib
from typing import Optional

import torch

from folio.model.attention import kv_quant
from folio.model.attention.backend import AttentionBackend

# name -> "module:class", most preferred first
_BACKENDS = {
    "TRITON": "folio.model.attention.triton_backend:TritonAttentionBackend",
    "CPU_NATIVE": "folio.model.attention.cpu_native:CPUNativeAttentionBackend",
    "TORCH_SDPA": "folio.model.attention.torch_backend:TorchAttentionBackend",
}


def backend_names() -> list[str]:
    return list(_BACKENDS)


def windowed_backends() -> list[str]:
    """Names of the backends that run sliding-window layers."""
    return [n for n in _BACKENDS if _load(n).supports_sliding_window]


def _load(name: str) -> type[AttentionBackend]:
    module, cls = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def get_attention_backend(device: str, dtype: torch.dtype = torch.float32,
                          name: Optional[str] = None,
                          kv_dtype: Optional[str] = None) -> type[AttentionBackend]:
    """`kv_dtype`: the cache's (config.kv_dtype); an 8-bit one is read only
    by the backends that say so (`reads_8bit_kv`)."""
    eight = kv_dtype in kv_quant.QUANTIZED
    if name is not None:
        name = name.upper()
        if name not in _BACKENDS:
            raise ValueError(f"unknown attention backend {name!r}; choose from "
                             f"{', '.join(_BACKENDS)}")
        backend = _load(name)
        if not backend.supports(device, dtype):
            raise ValueError(f"attention backend {name} does not run on {device} in "
                             f"{str(dtype).removeprefix('torch.')}{backend.requirement}")
        if eight and kv_dtype not in backend.reads_8bit_kv:
            readers = [n for n in _BACKENDS if kv_dtype in _load(n).reads_8bit_kv]
            raise ValueError(f"attention backend {name} does not read an {kv_dtype} KV cache "
                             f"yet; these do: {', '.join(readers)}")
        return backend
    for candidate in _BACKENDS:
        backend = _load(candidate)
        if backend.selectable(device, dtype) and (not eight or kv_dtype in backend.reads_8bit_kv):
            return backend
    raise ValueError(f"no attention backend runs on {device} in {dtype}")
