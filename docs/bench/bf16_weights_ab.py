"""The standard workload in float32 and as bfloat16 on a CPU without native
bf16 (fp32 arithmetic on bf16-stored weights), alternated in one process.

On a CPU with native bf16 the split is forced (the CPU is said to have none),
so the two can be compared on any machine; what it measures there is the
AVX2 kernel against that machine's fp32 MKL, which on an AVX-512 CPU is twice
as wide as the kernel.

    .venv/bin/python docs/bench/bf16_weights_ab.py [ROUNDS]
"""

import contextlib
import io
import json
import sys

from folio.cli import main as folio
from folio.worker import device

WORKLOADS = {
    "standard": ["--num-prompts", "32", "--input-len", "32:384", "--output-len", "32:192"],
    "one request": ["--num-prompts", "1", "--input-len", "256", "--output-len", "256"],
}


def run(workload: list[str], dtype: str) -> float:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        folio(["bench", "throughput", *workload, "--seed", "0", "--json", "--dtype", dtype])
    return json.loads(out.getvalue().strip().splitlines()[-1])["output_tokens_per_s"]


def main(rounds: int) -> None:
    device.cpu_has_native_bf16 = lambda: False
    for i in range(rounds):
        for name, workload in WORKLOADS.items():
            fp32, split = run(workload, "float32"), run(workload, "bfloat16")
            print(f"round {i + 1}, {name}: float32 {fp32:.1f} output tok/s, bf16 weights "
                  f"{split:.1f} ({split / fp32:.2f}x)", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
