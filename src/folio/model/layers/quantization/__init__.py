"""Weight formats: name -> QuantizationConfig.

A new format is one module here (its QuantizationConfig and LinearMethod) and
one line in `_MODULES`; the model and the runner are not edited. "none" is the
plain float weights (and the repacks the CPU kernels read).
"""

from __future__ import annotations

import importlib
from typing import Any, Optional

from folio.model.layers.quantization.base import LinearMethod, QuantizationConfig

# name -> module defining it (imported on first use)
_MODULES = {
    "none": "folio.model.layers.quantization.unquantized",
    "gptq": "folio.model.layers.quantization.gptq",
    "gguf": "folio.model.layers.quantization.gguf",
    "awq": "folio.model.layers.quantization.awq",
    "compressed-tensors": "folio.model.layers.quantization.compressed_tensors",
    "int8": "folio.model.layers.quantization.rtn",
    "int4": "folio.model.layers.quantization.rtn",
    "fp8": "folio.model.layers.quantization.fp8",
}
_REGISTRY: dict[str, type[QuantizationConfig]] = {}


def register_quantization(name: str):
    """Class decorator: make a QuantizationConfig available under `name` (tests
    register their own)."""
    def add(cls: type[QuantizationConfig]) -> type[QuantizationConfig]:
        cls.name = name
        _REGISTRY[name] = cls
        return cls
    return add


def supported() -> list[str]:
    return sorted(set(_MODULES) | set(_REGISTRY))


def _lookup(name: str) -> Optional[type[QuantizationConfig]]:
    if name not in _REGISTRY and name in _MODULES:
        importlib.import_module(_MODULES[name])
    return _REGISTRY.get(name)


def quantization_class(name: str) -> type[QuantizationConfig]:
    """The class of a format the user names (--quantization)."""
    cls = _lookup(name)
    if cls is None:
        raise ValueError(f"unknown quantization method {name!r}; known: "
                         f"{', '.join(supported())}")
    return cls


def float_weight_methods() -> list[str]:
    """The formats that load a float checkpoint's weights (`loads_float_weights`):
    what a GGUF's weights, dequantized at load, can run as."""
    return [name for name in supported() if quantization_class(name).loads_float_weights]


def get_quantization_config(name: Optional[str], config: Optional[dict[str, Any]] = None, *,
                            weight_dtype: Optional[str] = None) -> QuantizationConfig:
    """The config for `name` (None: "none"), built from the checkpoint's
    `quantization_config` dict."""
    name = name or "none"
    cls = _lookup(name)
    if cls is None:
        raise ValueError(f"quantization method {name!r} is not supported; supported: "
                         f"{', '.join(supported())}")
    return cls(dict(config or {}), weight_dtype=weight_dtype)


__all__ = ["LinearMethod", "QuantizationConfig", "float_weight_methods",
           "get_quantization_config", "quantization_class", "register_quantization",
           "supported"]
