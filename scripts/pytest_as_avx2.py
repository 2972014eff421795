"""Run the test suite as an AVX2-only CPU would see it, on an AVX-512 machine.

The native kernels are built with -mno-avx512f (so the library declines the
bf16 linear layer and the one-call decoder, as one built on an AVX2 CPU does)
and oneDNN is capped at AVX2 (it then packs no bf16 weight). torch's own
kernels are capped with ATEN_CPU_CAPABILITY, and the CPU is said to have no
native bf16 (so bfloat16 runs as fp32 arithmetic on bf16 weights). A check of the skip conditions,
not a substitute for a run on such a machine: bf16 arithmetic here is still
the CPU's, not an emulation.

    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 \\
        .venv/bin/python scripts/pytest_as_avx2.py -q tests/model tests/engine
"""

import os
import sys

import pytest

from folio.model import native

if os.environ.get("ONEDNN_MAX_CPU_ISA") != "AVX2":
    sys.exit("set ONEDNN_MAX_CPU_ISA=AVX2 (and ATEN_CPU_CAPABILITY=avx2): see the docstring")
from folio.worker import device

_build = native._build
native._build = lambda extra=(): _build(("-mno-avx512f",) + tuple(extra))
device.cpu_has_native_bf16 = lambda: False     # bfloat16 then splits, as on such a CPU
sys.exit(pytest.main(sys.argv[1:]))
