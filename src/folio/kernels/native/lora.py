"""The native grouped LoRA kernel (`lora.c`): for each run of rows of one
adapter, y[rows] += (x[rows] A^T) B^T, with the slots stored transposed
(`at` [slots, in, width], `bt` [slots, width, out], width a multiple of 16),
fp32 or bf16, the product kept in fp32 and y rounded once."""

from __future__ import annotations

import torch

from folio.kernels import native

WIDTH_MULTIPLE = 16     # the kernel's width: slots are zero-padded to it


def serves(device, dtype: torch.dtype) -> bool:
    """Whether the kernel runs layers of this device and run dtype."""
    return torch.device(device).type == "cpu" and dtype in (torch.float32, torch.bfloat16) \
        and native.load() is not None


def runs_tensor(groups: list[tuple[int, int, int]]) -> torch.Tensor:
    """The step's runs (slot, first row, end) as the kernel reads them."""
    return torch.tensor(groups, dtype=torch.int64).reshape(-1, 3)


def add_lora(x: torch.Tensor, y: torch.Tensor, at: torch.Tensor, bt: torch.Tensor,
             runs: torch.Tensor, lib=None) -> torch.Tensor:
    """y [T, out] += each run's (x A^T) B^T, in place; x [T, in] with dense
    rows; x and y of one dtype (fp32 or bf16), the slots of either. `lib`:
    another build of the kernels (tests)."""
    if x.dtype != y.dtype:
        x = x.to(y.dtype)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if y.stride(-1) != 1:
        raise ValueError("the LoRA kernel adds into rows that are dense")
    in_features, width = at.shape[1], at.shape[2]
    failed = (lib or native.load()).folio_lora(
        x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), native.dtype_code(y.dtype),
        at.data_ptr(), bt.data_ptr(), native.dtype_code(at.dtype), runs.data_ptr(),
        runs.shape[0], in_features, bt.shape[2], width, torch.get_num_threads())
    if failed:
        raise RuntimeError(f"the native LoRA kernel refused width {width} (a multiple of "
                           f"{WIDTH_MULTIPLE}) or ran out of memory")
    return y
