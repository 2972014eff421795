"""The `folio` command as an AVX2-only CPU would run it (see avx2_sim.py):

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
        .venv/bin/python scripts/folio_as_avx2.py serve --dtype bfloat16
"""

import sys

import avx2_sim

avx2_sim.apply()
from folio.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
