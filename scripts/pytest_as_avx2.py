"""Run the test suite as an AVX2-only CPU would see it, on an AVX-512 machine
(what is changed: avx2_sim.py). A check of the skip conditions, not a
substitute for a run on such a machine: bf16 arithmetic here is still the
CPU's, not an emulation.

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
        .venv/bin/python scripts/pytest_as_avx2.py -q tests/model tests/engine
"""

import sys

import avx2_sim
import pytest

avx2_sim.apply()
sys.exit(pytest.main(sys.argv[1:]))
