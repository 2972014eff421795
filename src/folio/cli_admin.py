"""`folio env | usage | plan`: the commands about the machine, a server's ledger
and a deployment's size, which load no model. Each command's module is
imported when it runs."""

from __future__ import annotations

import argparse

from folio.cli_types import add_command, fraction, non_negative_float, positive_int


def add_env(sub) -> None:
    env = add_command(sub, "env", "this machine and the kernel each layer uses, for bug "
                       "reports", cmd_env)
    env.add_argument("--json", action="store_true", help="print one JSON object")


def add_usage(sub) -> None:
    usage = add_command(sub, "usage", "requests, tokens and cost from a server's usage "
                         "ledger (--usage-db)", cmd_usage)
    usage.add_argument("--db", required=True, metavar="PATH",
                       help="the SQLite ledger that `folio serve --usage-db` writes")
    usage.add_argument("--since", default=None, metavar="DATE",
                       help="only requests finished since DATE (2026-12-01, 00:00 UTC, or an "
                            "ISO date-time)")
    usage.add_argument("--by", choices=["tenant", "day", "model", "adapter"], default="tenant",
                       help="what a row sums over")
    usage.add_argument("--json", action="store_true",
                       help="print a JSON list of rows instead of the table")


def _prices(text: str) -> tuple[float, float]:
    parts = text.split(",")
    try:
        values = tuple(float(p) for p in parts)
    except ValueError:
        values = ()
    if len(values) != 2 or not all(v >= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected IN,OUT dollars per 1M tokens such as "
                                         f"2.5,10, got {text!r}")
    return values


def add_plan(sub) -> None:
    p = add_command(sub, "plan", "size a deployment before buying it: memory, GPUs, speed, "
                     "cost against an API", cmd_plan)
    p.add_argument("--model", required=True, metavar="MODEL",
                   help="a Hugging Face config.json (or its folder), a GGUF file (or a folder "
                        "holding one; SmolLM2-135M-Instruct: the default model's), or a "
                        "catalog name: llama-3-8b, llama-3-70b, mistral-7b, qwen2.5-7b, "
                        "qwen2.5-72b, smollm2-135m")
    p.add_argument("--quantization", choices=["none", "int8", "int4", "awq", "gptq", "fp8"],
                   default="none",
                   help="the weights' format: bf16, int8 per channel, int4 (4-bit codes with a "
                        "scale and zero per group of 128, as folio serve -q int4), awq or "
                        "gptq checkpoints' 4-bit in groups of 128, or fp8 (e4m3, a byte a "
                        "weight: folio serve -q fp8, FP8 checkpoints)")
    p.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=None,
                   metavar="N",
                   help="GPUs a replica splits every layer's weights and KV cache across, as "
                        "folio serve's flag (default: the smallest of 1, 2, 4, 8 that fits)")
    p.add_argument("--gpu", default="h100-80gb", metavar="NAME",
                   help="h100-80gb, h200, a100-80gb, a100-40gb, l4 or cpu (this 2-core "
                        "machine), or one of --catalog's")
    p.add_argument("--tokens-per-day", type=non_negative_float, required=True, metavar="N",
                   help="prompt and output tokens a day, all tenants together")
    p.add_argument("--peak-rps", type=non_negative_float, default=0.0, metavar="R",
                   help="requests per second at the peak")
    p.add_argument("--prompt-len", type=positive_int, default=1000, metavar="P",
                   help="prompt tokens of a typical request")
    p.add_argument("--output-len", type=positive_int, default=250, metavar="O",
                   help="output tokens of a typical request")
    p.add_argument("--api-price", type=_prices, default=None, metavar="IN,OUT",
                   help="the hosted API's dollars per 1M input and output tokens, to compare")
    p.add_argument("--gpu-hour-price", type=non_negative_float, default=None, metavar="D",
                   help="dollars an hour per GPU (default: the catalog's illustrative price)")
    p.add_argument("--kv-cache-dtype",
                   choices=["bfloat16", "float32", "int8", "fp8", "fp8_e5m2"],
                   default="bfloat16",
                   help="the KV cache's element type, as folio serve's flag (int8, fp8, "
                        "fp8_e5m2: 8-bit rows with their scales)")
    p.add_argument("--gpu-memory-utilization", type=fraction, default=0.9, metavar="F",
                   help="the share of a GPU's memory Folio may use, as folio serve's flag")
    p.add_argument("--catalog", default=None, metavar="FILE",
                   help="a JSON file of more gpus and models, or overrides, in the shipped "
                        "catalog's shape")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def cmd_plan(args: argparse.Namespace) -> int:
    from folio.plan import cmd_plan as run
    return run(args)


def cmd_usage(args: argparse.Namespace) -> int:
    from folio.usage_report import cmd_usage as run
    return run(args)


def cmd_env(args: argparse.Namespace) -> int:
    import json

    from folio.env_report import collect, format_report
    report = collect()
    print(json.dumps(report) if args.json else format_report(report))
    return 0
