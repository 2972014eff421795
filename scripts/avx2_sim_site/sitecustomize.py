"""Imported by every Python process a simulated one starts (avx2_sim.py puts
this folder on their PYTHONPATH): the engine core's process, tensor-parallel
workers and the servers a test starts run as the AVX2-only CPU too."""

import os

if os.environ.get("FOLIO_AVX2_SIM") == "1":
    import avx2_sim
    avx2_sim.apply()
