"""Quality of the quantized SmolLM2-135M-Instruct variants through Folio
(issue 16): perplexity on a fixed text, and agreement of the first 32 greedy
tokens with fp32 on 12 chat prompts, for every weight format Folio runs.

    scripts/make_smollm_quant.sh                 # the float, GPTQ and AWQ folders
    .venv/bin/python docs/bench/quant_quality.py [--dir build/quant-smollm] [--out FILE]

Variants (each with fp32 and bf16 activations): the float model (the GGUF
dequantized, saved as an fp32 HF folder: the reference is its fp32 run), the
GGUF's own Q4_1 codes (the file as shipped: Q4_1 linears, Q8_0 embedding),
int8 at load (`quantization="int8"`: round-to-nearest, per channel,
symmetric), int4 at load (`quantization="int4"`: round-to-nearest, groups of
128, asymmetric; the no-calibration baseline for GPTQ and AWQ), GPTQ 4-bit
g128 and g64 and AWQ 4-bit g64 (gptqmodel 7.6.0). There is no AWQ g128:
SmolLM2's 576-input layers are not whole groups of 128, which AWQ needs
(scripts/make_smollm_quant.py, VARIANTS); GPTQ g128 and int4 g128 make
four groups of 128 and one of 64 on those layers.

Perplexity: docs/bench/quant_quality_eval.txt tokenized without special
tokens, cut into consecutive windows of --window tokens (the last one
shorter); each window is scored as one prompt of <|endoftext|> (id 0, the
document separator of SmolLM2's training data) followed by the window, so
every token of the text is scored exactly once with at most --window tokens
of context. PPL = exp(-mean over all text tokens of log p(token | window
before it)), the log-probabilities being Folio's prompt_logprobs (fp32
log-softmax of the variant's logits).

Agreement: PROMPTS, each as one user message through the model's chat
template (LLM.chat), greedy, up to 32 tokens (stopping at EOS as usual).
Per prompt, against the fp32 float model's tokens: the common prefix length
and the number of positions 0..31 holding the same token (a position past
the end of both answers counts as agreeing; past the end of one only, as
not); the table gives each averaged over the 12 prompts (32 = identical).

Weight bytes: what the loaded model holds for its weights: every decoder
linear layer (IntGroupsLinear: its packed codes, scales, offsets; a repacked
float weight: the repacked tensor; a plain one: numel x element size), and
separately the embedding table plus the LM head (tied: a packed copy the CPU
kernels may keep; a GGUF's Q8_0 table serves both).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch

from folio import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[2]
EVAL_TEXT = ROOT / "docs" / "bench" / "quant_quality_eval.txt"
AGREE_TOKENS = 32

PROMPTS = [
    "Explain how a refrigerator keeps food cold.",
    "Write a short poem about the ocean at night.",
    "What are the main differences between a virus and a bacterium?",
    "Give me three tips for writing a good cover letter.",
    "Describe the rules of tic-tac-toe.",
    "Why do leaves change color in the fall?",
    "Write a Python function that returns the factorial of a number.",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "How can I improve my sleep?",
    "What is photosynthesis?",
    "Tell me a story about a dragon who is afraid of the dark.",
    "What should I pack for a weekend camping trip?",
]


def variants(folder: Path) -> list[tuple[str, str | None, dict]]:
    """(name, model path or None for the default GGUF, LLM kwargs)."""
    at = lambda name: str(folder / name)
    out = []
    for dtype, short in (("float32", "fp32"), ("bfloat16", "bf16")):
        out += [
            (f"float {short}", at("float"), dict(dtype=dtype)),
            (f"GGUF Q4_1 {short}", None, dict(dtype=dtype)),
            (f"int8 at load {short}", at("float"), dict(dtype=dtype, quantization="int8")),
            (f"int4 at load g128 {short}", at("float"), dict(dtype=dtype, quantization="int4")),
            (f"GPTQ w4 g128 {short}", at("gptq-w4-g128"), dict(dtype=dtype)),
            (f"GPTQ w4 g64 {short}", at("gptq-w4-g64"), dict(dtype=dtype)),
            (f"AWQ w4 g64 {short}", at("awq-w4-g64"), dict(dtype=dtype)),
        ]
    # the fp32 float run is the reference: first; then each format, fp32 then bf16
    names = [v[0].rsplit(" ", 1)[0] for v in out]
    return sorted(out, key=lambda v: (v[0] != "float fp32", names.index(v[0].rsplit(" ", 1)[0]),
                                      v[0].endswith("bf16")))


# ------------------------------------------------------------------ metrics
def perplexity(llm: LLM, window: int) -> tuple[float, int]:
    tok = llm.get_tokenizer()
    ids = tok.encode(EVAL_TEXT.read_text(encoding="utf-8"), add_special_tokens=False)
    start = tok.convert_ids_to_tokens([0])[0]
    assert start == "<|endoftext|>", start
    prompts = [{"prompt_token_ids": [0] + ids[i:i + window]} for i in range(0, len(ids), window)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                        use_tqdm=False)
    total, n = 0.0, 0
    for p, o in zip(prompts, outs):
        toks = p["prompt_token_ids"]
        assert len(o.prompt_logprobs) == len(toks) and o.prompt_logprobs[0] is None
        for pos in range(1, len(toks)):
            total += o.prompt_logprobs[pos][toks[pos]]
            n += 1
    assert n == len(ids)
    return math.exp(-total / n), n


def greedy(llm: LLM) -> list[list[int]]:
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    outs = llm.chat(chats, SamplingParams(temperature=0, max_tokens=AGREE_TOKENS), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def agreement(ref: list[int], got: list[int]) -> tuple[int, int]:
    prefix = 0
    while prefix < AGREE_TOKENS and prefix < len(ref) and prefix < len(got) \
            and ref[prefix] == got[prefix]:
        prefix += 1
    if prefix == len(ref) == len(got):      # both ended (EOS) together
        prefix = AGREE_TOKENS
    pad = lambda t: t + [None] * (AGREE_TOKENS - len(t))
    same = sum(a == b for a, b in zip(pad(ref[:AGREE_TOKENS]), pad(got[:AGREE_TOKENS])))
    return prefix, same


# ------------------------------------------------------------- weight bytes
def _tensor_bytes(t) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _method_bytes(method, layer) -> int:
    from folio.model.layers.quantization.int_groups import IntGroupsLinear
    from folio.model.layers.quantization.repacked import PackedLinear

    if isinstance(method, IntGroupsLinear):
        return method.weights.nbytes
    if isinstance(method, PackedLinear):
        return _tensor_bytes(method.data)
    return sum(_tensor_bytes(p) for name, p in layer.named_parameters(recurse=False)
               if name != "bias")


def weight_bytes(llm: LLM) -> tuple[int, int]:
    """(decoder linear layers, embedding + LM head) bytes of the loaded model."""
    from folio.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
    from folio.model.layers.linear import LinearBase

    model = llm.engine.executor.runner.model
    linear = embed = 0
    for module in model.modules():
        if isinstance(module, LinearBase):
            linear += _method_bytes(module.quant_method, module)
        elif isinstance(module, ParallelLMHead):
            if module.tied and module.embedding.quant_method is not None:
                continue                            # the embedding's packed table
            if module.quant_method is not None:
                embed += module.packed_table.nbytes
            else:
                embed += _tensor_bytes(module.packed.data if module.packed is not None else None)
                if not module.tied:
                    embed += _tensor_bytes(module.weight)
        elif isinstance(module, VocabParallelEmbedding):
            table = module.packed_table
            embed += table.nbytes if table is not None else _tensor_bytes(module.weight)
    return linear, embed


# ------------------------------------------------------------------ report
def cpu_header() -> list[str]:
    flags, model = set(), platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
            elif line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    wanted = ["avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16"]
    have = " ".join(f"{f}={'yes' if f in flags else 'no'}" for f in wanted)
    return [f"- CPU: {model}, {os.cpu_count()} cores; flags: {have}",
            f"- torch {torch.__version__}, {torch.get_num_threads()} threads; Python "
            f"{platform.python_version()}"]


def _shown(path: str) -> str:
    try:
        return str(Path(path).relative_to(ROOT))
    except ValueError:
        return path


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=str(ROOT / "build" / "quant-smollm"),
                        help="what scripts/make_smollm_quant.sh made")
    parser.add_argument("--window", type=int, default=512, help="perplexity window (tokens)")
    parser.add_argument("--only", default="", help="comma-separated substrings of variant names")
    parser.add_argument("--out", default=None, help="also write the report here")
    args = parser.parse_args(argv)
    folder = Path(args.dir)
    chosen = variants(folder)
    if args.only:
        keys = [k.strip() for k in args.only.split(",")]
        chosen = [v for v in chosen if v[0] == "float fp32" or any(k in v[0] for k in keys)]
    missing = sorted({Path(v[1]).name for v in chosen if v[1] is not None and not Path(v[1]).is_dir()})
    chosen = [v for v in chosen if v[1] is None or Path(v[1]).is_dir()]

    lines = ["# Quantized SmolLM2-135M-Instruct through Folio: quality", "",
             f"- command: `{' '.join([_shown(sys.executable), *sys.argv])}`",
             f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
             *cpu_header(),
             f"- checkpoints: {folder} (scripts/make_smollm_quant.sh); eval text: "
             f"{EVAL_TEXT.relative_to(ROOT)}",
             f"- perplexity: windows of {args.window} tokens, each after <|endoftext|>; "
             f"agreement: {len(PROMPTS)} chat prompts, greedy, first {AGREE_TOKENS} tokens "
             "vs float fp32",
             *([f"- not measured (no folder; scripts/make_smollm_quant.sh makes it): "
                f"{', '.join(missing)}"] if missing else []), ""]
    print("\n".join(lines), flush=True)
    rows, per_prompt, ref = [], [], None
    for name, path, kwargs in chosen:
        t0 = time.time()
        llm = LLM(path, **kwargs)
        t1 = time.time()
        ppl, n = perplexity(llm, args.window)
        t2 = time.time()
        tokens = greedy(llm)
        t3 = time.time()
        linear, embed = weight_bytes(llm)
        if ref is None:
            ref, ref_ppl = tokens, ppl
        scores = [agreement(r, g) for r, g in zip(ref, tokens)]
        prefix = sum(s[0] for s in scores) / len(scores)
        same = sum(s[1] for s in scores) / len(scores)
        rows.append(f"| {name} | {ppl:.3f} | {(ppl / ref_ppl - 1) * 100:+.2f} % | {prefix:.1f} | "
                    f"{same:.1f} | {linear / 2**20:.1f} | {embed / 2**20:.1f} |")
        per_prompt.append(f"| {name} | {' '.join(str(s[0]) for s in scores)} | "
                          f"{' '.join(str(s[1]) for s in scores)} |")
        print(f"{name}: ppl {ppl:.3f} over {n} tokens, prefix {prefix:.1f}, same {same:.1f}; "
              f"load {t1 - t0:.1f} s, ppl {t2 - t1:.1f} s, greedy {t3 - t2:.1f} s", flush=True)
        if name == "float fp32":
            answers = [llm.get_tokenizer().decode(t) for t in tokens]
        del llm
        gc.collect()

    table = ["| variant | perplexity | vs fp32 | first-32 common prefix (mean) | "
             "first-32 same position (mean) | linear weights MiB | embedding + head MiB |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |", *rows]
    detail = ["| variant | common prefix per prompt | same positions per prompt |",
              "| --- | --- | --- |", *per_prompt]
    shown = ["", "fp32 answers (first 32 tokens):", ""] + [
        f"{i + 1}. {p!r} -> {a!r}" for i, (p, a) in enumerate(zip(PROMPTS, answers))]
    report = "\n".join(lines + table + ["", "Per prompt (prompts in PROMPTS order):", ""]
                       + detail + shown) + "\n"
    print("\n" + "\n".join(table + [""] + detail + shown), flush=True)
    if args.out:
        Path(args.out).write_text(report)


if __name__ == "__main__":
    main(sys.argv[1:])
