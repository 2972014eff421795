"""A model's bf16 weights in oneDNN's layout or the native kernel's, on an
AMX CPU (issue 29): offline, one process per layout, side by side in one
run. In the native layout the one-call decoder runs the layers; in oneDNN's
the modules run. Measured: one request decoding (256 in, 256 out), 32
requests at once (200 in, 128 out), and a prompt's prefill alone (512 and
2,000 tokens, best of 3). MODEL: moe_speed.py's (make it first:
`moe_speed.py --keep DIR`), or any other (`-q none` on the default model's
GGUF: its weights as bf16).

    .venv/bin/python docs/bench/moe_layouts.py DIR/qwen3moe-f16.gguf
    .venv/bin/python docs/bench/moe_layouts.py SmolLM2-135M-Instruct none
"""

from __future__ import annotations

import json
import subprocess
import sys
import time


def measure(model: str, layout: str, quantization) -> dict:
    import contextlib

    from folio.kernels import native
    if layout == "onednn":      # every bf16 weight in oneDNN's layout
        native.native_bf16_over_amx = contextlib.nullcontext
        native.prefers_onednn_bf16 = lambda: True
    else:                       # every bf16 weight in the native kernel's
        native.prefers_onednn_bf16 = lambda: False
    from folio import LLM, SamplingParams
    llm = LLM(model, max_model_len=4096, max_num_batched_tokens=2048, dtype="bfloat16",
              quantization=quantization)
    out = {"one-call decoder": llm.engine.executor.runner.model.model.native_decoder is not None}
    greedy = dict(temperature=0, ignore_eos=True)
    one = {"prompt_token_ids": list(range(3, 259))}
    llm.generate([one], SamplingParams(max_tokens=8, **greedy))
    start = time.perf_counter()
    llm.generate([one], SamplingParams(max_tokens=256, **greedy))
    out["one request, tok/s"] = 256 / (time.perf_counter() - start)
    many = [{"prompt_token_ids": [3 + (i * 7 + j) % 300 for j in range(200)]} for i in range(32)]
    start = time.perf_counter()
    llm.generate(many, SamplingParams(max_tokens=128, **greedy), use_tqdm=False)
    out["32 requests, tok/s"] = 32 * 128 / (time.perf_counter() - start)
    for n in (512, 2000):
        prompt = {"prompt_token_ids": [3 + (i * 13) % 350 for i in range(n)]}
        best = float("inf")
        for _ in range(4):              # the first warms up
            assert llm.reset_prefix_cache()
            start = time.perf_counter()
            llm.generate([prompt], SamplingParams(max_tokens=1, **greedy), use_tqdm=False)
            best = min(best, time.perf_counter() - start)
        out[f"prefill {n}, ms"] = best * 1e3
    return out


def main() -> None:
    if sys.argv[1] == "--one":
        print(json.dumps(measure(sys.argv[2], sys.argv[3], sys.argv[4] or None)))
        return
    flags = open("/proc/cpuinfo").read().split("flags")[1].split("\n")[0].split()
    print("CPU flags:", " ".join(f for f in ("avx2", "fma", "avx512f", "avx512_bf16",
                                               "amx_bf16") if f in flags))
    print(time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    for layout in ("onednn", "native"):
        done = subprocess.run([sys.executable, __file__, "--one", sys.argv[1], layout,
                               sys.argv[2] if len(sys.argv) > 2 else ""],
                              capture_output=True, text=True, check=True)
        print(layout, done.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
