"""Make this process see the CPU as an AVX2-only one would, on an AVX-512 machine.

- Folio's native kernels are built with -mno-avx512f -mno-avxvnni: the library
  declines the AVX512-BF16 linear layer and takes its AVX2 paths (without the
  256-bit VNNI dot products of recent CPUs), as one built on an AVX2 CPU of
  the Zen 3 generation does.
- Folio is told the CPU has no native bf16, so `--dtype bfloat16` runs as fp32
  arithmetic on bf16-stored weights.
- torch, oneDNN and MKL are capped at AVX2 by the environment variables below,
  which must be set before torch loads (they are read once):

      ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2

The Python processes it starts are simulated too (avx2_sim_site/
sitecustomize.py, on their PYTHONPATH): `folio serve`'s engine core process,
`LLM(engine_process=True)`'s, tensor-parallel workers, the servers a test
starts.

What this cannot change: the clock, the caches and the memory bandwidth are the
AVX-512 machine's, so absolute rates are not an AVX2 machine's; the code paths
and the vector widths are.
"""

import os
import sys

REQUIRED = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
            "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def apply() -> None:
    """This process simulated, and every Python process it starts (a spawned
    engine core or worker, a server): they inherit the environment, and
    avx2_sim_site/sitecustomize.py applies this in each."""
    missing = [f"{k}={v}" for k, v in REQUIRED.items() if os.environ.get(k) != v]
    if missing:
        sys.exit(f"set {' '.join(missing)} before starting: see scripts/avx2_sim.py")
    from folio.kernels import native
    from folio.worker import device
    build = native._build
    native._build = lambda extra=(), **kw: build(("-mno-avx512f", "-mno-avxvnni") + tuple(extra),
                                                 **kw)
    device.cpu_has_native_bf16 = lambda: False
    here = os.path.dirname(os.path.abspath(__file__))
    if os.environ.get("FOLIO_AVX2_SIM") != "1":
        os.environ["FOLIO_AVX2_SIM"] = "1"
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [os.path.join(here, "avx2_sim_site"), here]
            + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
