"""What serving costs one request at a time: the default model served by
`folio serve` (driven by `folio bench serve`, the cpu_baselines.py "one
request" workload: two requests of 256 prompt and 256 output tokens, one after
the other, EOS ignored) against the same engine stepped offline in this
process on the same workload, alternated round by round in one window, so
that a machine whose speed drifts compares the two at the same minutes. The
server idles while the offline run steps and the other way round.

    .venv/bin/python docs/bench/served_vs_offline.py [--rounds 5] [-- SERVE FLAGS...]

Prints each round's output tok/s of both, their medians and the median of the
per-round ratio served / offline.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cpu_baselines as cb  # noqa: E402


def offline_rate(engine, rng: random.Random, n: int = 2, length: int = 256) -> float:
    """Output tok/s over n requests run one after the other, prefill included
    (as the served client's rate counts it)."""
    from folio import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=length, ignore_eos=True)
    vocab = engine.config.model.vocab_size
    produced, t0 = 0, time.perf_counter()
    for i in range(n):
        engine.add_tokenized_request(f"offline-{rng.random()}", None,
                                     [rng.randrange(100, vocab) for _ in range(length)], params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    produced += len(out.outputs[0].token_ids)
    return produced / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("serve_flags", nargs="*", help="after --: passed to folio serve")
    args = p.parse_args()
    import torch
    torch.set_num_threads(2)
    from folio.engine.llm_engine import LLMEngine
    from folio.env_report import cpu_info
    model, flags = cpu_info()
    print(f"CPU {model}; " + " ".join(f for f in ("avx2", "fma", "avx512f", "avx512_bf16",
                                                  "amx_bf16") if f in flags), flush=True)
    plain = SimpleNamespace(avx2_sim=False)
    port = cb.free_port()
    url = f"http://127.0.0.1:{port}"
    with open("served_vs_offline.serve.log", "w") as log:
        server = subprocess.Popen([*cb.folio_cmd(plain), "serve", "--port", str(port),
                                   *args.serve_flags], stdout=log, stderr=subprocess.STDOUT,
                                  env=cb.env_for(plain))
    try:
        engine = LLMEngine.from_args(None)
        cb.wait_up(url, server, 600)
        cb.drive(plain, url, cb.WARM_UP)
        rng = random.Random(0)
        offline_rate(engine, rng, 1, 32)
        rates: dict[str, list[float]] = {"served": [], "offline": []}
        for i in range(args.rounds):
            rates["served"].append(cb.drive(plain, url, cb.WORKLOADS["one request"]))
            rates["offline"].append(offline_rate(engine, rng))
            print(f"round {i + 1}: served {rates['served'][-1]:.1f}, "
                  f"offline {rates['offline'][-1]:.1f} output tok/s", flush=True)
        ratio = statistics.median(a / b for a, b in zip(rates["served"], rates["offline"]))
        print(f"median: served {statistics.median(rates['served']):.1f}, offline "
              f"{statistics.median(rates['offline']):.1f}; served / offline {ratio:.3f}")
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
