"""What the default configuration's int8 activations cost in quality (issue
53): the default model (SmolLM2-135M-Instruct, its GGUF Q4_1 codes, float32
arithmetic) with `--activation-quantization int8` (the default for a GGUF's
codes) against `none`, on quant_quality.py's measures: the perplexity of
docs/bench/quant_quality_eval.txt (windows of 512 tokens, from Folio's prompt
logprobs) and the 12 chats' first 32 greedy tokens against `none`'s.

    .venv/bin/python docs/bench/int8_activations_ppl.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from quant_quality import PROMPTS, agreement, greedy, perplexity  # noqa: E402

from folio import LLM  # noqa: E402


def compare(runs) -> None:
    """Print quant_quality.py's measures for each run, in order: runs are
    (name, a function making its LLM), the first the reference of the
    perplexity ratio and of the greedy agreement."""
    rows, ref = [], None
    for name, make in runs:
        llm = make()
        ppl, n = perplexity(llm, 512)
        answers = greedy(llm)
        ref = ref or answers
        pairs = [agreement(a, b) for a, b in zip(ref, answers)]
        rows.append((name, ppl, n, sum(p for p, _ in pairs) / len(pairs),
                     sum(s for _, s in pairs) / len(pairs)))
        llm.shutdown()
    base = rows[0][1]
    print(f"| activations | perplexity ({rows[0][2]} tokens) | vs none | first-32 common prefix "
          f"(mean of {len(PROMPTS)}) | first-32 same position (mean) |")
    print("|---|---:|---:|---:|---:|")
    for a, ppl, _, prefix, same in rows:
        print(f"| {a} | {ppl:.3f} | {100 * (ppl / base - 1):+.2f} % | {prefix:.1f} | {same:.1f} |")


def main() -> None:
    compare((a, lambda a=a: LLM(dtype="float32", max_model_len=2048, activation_quantization=a))
            for a in ("none", "int8"))

if __name__ == "__main__":
    main()
