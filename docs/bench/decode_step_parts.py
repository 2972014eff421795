"""Where a batch-1 decode step's time goes: one request on the default model
(offline, `LLM`), greedy, EOS ignored, 2 threads; milliseconds per output token
spent in the decoder layers (the one native call, `NativeDecoder`), in the LM
head (`compute_logits`), in the rest of the forward (embedding, rotary tables,
final norm), in the rest of the model runner's step (inputs, sampling) and in
the engine around it (scheduler, detokenizer). Each part is timed by wrapping
the method that does it, so the figures add up to the step.

    .venv/bin/python docs/bench/decode_step_parts.py [--prompt 256] [--output 256]
        [--activation-quantization int8|none] [--rounds 3] [--model PATH]
    # an earlier checkout, for a before/after pair in one session:
    PYTHONPATH=../folio-before/src .venv/bin/python docs/bench/decode_step_parts.py

The prompt's prefill is in the figures too (once, spread over the output
tokens), as in the one-request workload of cpu_baselines.py.
"""

from __future__ import annotations

import argparse
import collections
import json
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--output", type=int, default=256)
    p.add_argument("--activation-quantization", default=None,
                   help="passed to LLM (omit for a checkout that predates the flag)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", default=None, help="a GGUF file or folder (default: the default model)")
    args = p.parse_args()
    import torch
    from folio import LLM, SamplingParams
    torch.set_num_threads(2)
    kwargs = {} if args.activation_quantization is None else {
        "activation_quantization": args.activation_quantization}
    if args.model is not None:
        kwargs["model"] = args.model
    llm = LLM(**kwargs)
    runner = llm.engine.executor.runner
    model = runner.model
    spent: dict[str, float] = collections.defaultdict(float)

    def timed(obj, name: str, part: str, cls: bool = False) -> None:
        owner = type(obj) if cls else obj
        inner = getattr(owner, name)

        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                spent[part] += time.perf_counter() - start
        setattr(owner, name, wrapper)

    if model.model.native_decoder is not None:
        timed(model.model.native_decoder, "__call__", "decoder layers", cls=True)
    timed(model, "compute_logits", "LM head")
    timed(model, "forward", "forward")
    timed(runner, "execute", "runner step")
    timed(llm.engine, "step", "engine step")
    prompt = {"prompt_token_ids": list(range(1000, 1000 + args.prompt))}
    params = SamplingParams(max_tokens=args.output, temperature=0, ignore_eos=True)
    llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    rounds = []
    for _ in range(args.rounds):
        spent.clear()
        start = time.perf_counter()
        llm.generate([prompt], params)
        total = time.perf_counter() - start
        per = {k: v / args.output * 1e3 for k, v in spent.items()}
        parts = {
            "decoder layers": per.get("decoder layers", 0.0),
            "LM head": per["LM head"],
            "rest of forward": per["forward"] - per.get("decoder layers", 0.0),
            "rest of runner step": per["runner step"] - per["forward"] - per["LM head"],
            "engine around the step": per["engine step"] - per["runner step"],
            "outside engine steps": total / args.output * 1e3 - per["engine step"],
        }
        parts["total ms/token"] = total / args.output * 1e3
        parts["output tok/s"] = args.output / total
        rounds.append(parts)
        print(json.dumps({k: round(v, 2) for k, v in parts.items()}), flush=True)
    best = min(rounds, key=lambda r: r["total ms/token"])
    print("best round:", json.dumps({k: round(v, 2) for k, v in best.items()}))


if __name__ == "__main__":
    main()
