"""Device and dtype choice."""

from __future__ import annotations

import logging
from functools import lru_cache
from typing import Optional

import torch

logger = logging.getLogger("folio")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}
_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
            "half": "float16", "fp64": "float64", "double": "float64"}


def resolve_device(device: Optional[str]) -> str:
    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but no CUDA device is available")
    if device not in ("cpu",) and not device.startswith("cuda"):
        raise ValueError(f"unknown device {device!r}: use cpu or cuda")
    return device


@lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    """True when the CPU multiplies bf16 in hardware (AVX512-BF16 or AMX)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(dtype: str, device: str) -> str:
    name = _ALIASES.get(str(dtype).replace("torch.", ""), str(dtype).replace("torch.", ""))
    if name == "auto":
        if device.startswith("cuda"):
            return "bfloat16"
        return "bfloat16" if cpu_has_native_bf16() else "float32"
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: use auto, {', '.join(DTYPES)}")
    if name == "float16" and device == "cpu":
        raise ValueError("float16 runs on CUDA only; on the CPU use bfloat16 or float32")
    return name


def split_cpu_bf16(dtype: str, device: str) -> tuple[str, Optional[str]]:
    """(run dtype, weight dtype). On a CPU that only emulates bf16 arithmetic
    (measured 3x slower than fp32 on an AVX2-only AMD EPYC), bfloat16 runs as
    fp32 arithmetic on linear weights stored as bf16 (the AVX2 kernel widens
    them in registers): bf16's memory for weights, fp32's speed and accuracy
    for the rest."""
    if dtype == "bfloat16" and device == "cpu" and not cpu_has_native_bf16() and \
            _bf16_weight_kernel():
        _say_split_bf16()
        return "float32", "bfloat16"
    return dtype, None


def _bf16_weight_kernel() -> bool:
    """Whether the AVX2 kernel is there (no compiler, another architecture: no);
    without it bfloat16 stays bfloat16, emulated or not."""
    from folio.kernels import native
    return native.packs_linear_bf16w(torch.zeros(8, 8))


@lru_cache(maxsize=1)
def _say_split_bf16() -> None:
    logger.info("this CPU has no native bf16 (AVX512-BF16 or AMX): bfloat16 runs as float32 "
                "arithmetic on bf16-stored linear weights")


def torch_dtype(name: str) -> torch.dtype:
    return DTYPES[name]
