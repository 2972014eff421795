"""Every kernel of Folio, C and Triton, in one place; model/ keeps the
architectures and layers that call them.

The interface the layers see is plain functions on torch tensors: inputs and
an `out` (or in-place) tensor, the shapes in the docstring, no state of their
own beyond a compiled library. A layer decides which one runs (by device,
dtype and what the machine has) and keeps a torch reference path beside it;
the tests hold each kernel to that reference.

- `native/`: the CPU's C kernels, compiled once per machine with
  -march=native and called through ctypes (paged attention, the linear
  layers of bf16 and quantized weights, residual add + RMSNorm, rotary,
  SiLU-and-multiply, greedy sampling, grouped LoRA, the MoE router, and the
  one-call decoder's C side, `decoder.c`).
- `triton_attention.py`: paged attention on CUDA (decode, prompt chunks, the
  KV-cache write), float and 8-bit caches, sliding windows, softcapping.
- `triton_elementwise.py`: the fused element-wise steps of a decoder layer on
  CUDA (residual add + RMSNorm, rotary + KV-cache write, SiLU or GELU x up).
- `triton_qlinear.py`: the linear layer of 4/8-bit grouped weights.
- `triton_moe.py`: a mixture-of-experts layer's experts in grouped launches.
- `triton_lora.py`: LoRA of several adapters in one step.

Triton kernels run on CUDA, and on the CPU under triton's interpreter
(TRITON_INTERPRET=1, set before the process starts), which is how the tests
check them against torch.
"""
