"""`folio bench weights`: the bytes of weights as loaded, per kind of tensor,
and what the same layouts take for larger models.

Two parts:
- the loaded model (--model, --quantization, --dtype as for every engine
  command): every parameter and packed tensor the layers keep after loading,
  summed by role (decoder linear layers, embedding, LM head, norms), with the
  format each linear layer runs in;
- the arithmetic for other shapes (Llama-3-8B and -70B, Mixtral 8x7B and the
  loaded model's own, as its model class states it: model/shape.py), per
  format, computed by the packing code itself: `IntGroups.from_codes` packs
  one tile of 16 output features of each projection shape, and a layer's
  bytes are its tiles times that, plus what is per layer (group bounds, the
  permutation). A float format is its element size per weight. Embeddings,
  LM heads and MoE routers stay bf16 there, as GPTQ and AWQ checkpoints keep
  them.
"""

from __future__ import annotations

import argparse
import functools

import torch

from folio.model.shape import Linear, ModelShape, shape_of

SHAPES = {
    "Llama-3-8B": ModelShape(hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128,
                             vocab=128256, tied=False, intermediate=14336),
    "Llama-3-70B": ModelShape(hidden=8192, layers=80, heads=64, kv_heads=8, head_dim=128,
                              vocab=128256, tied=False, intermediate=28672),
    "Mixtral-8x7B": ModelShape(hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128,
                               vocab=32000, tied=False, intermediate=14336, moe_layers=32,
                               experts=8, experts_per_token=2, expert_intermediate=14336),
}
# format: (bits, group size; -1 one group per output feature) or a float size
FORMATS = {
    "bf16": 2, "fp32": 4,
    "int8 (per channel)": (8, -1),
    "int4 g128 (GPTQ/AWQ/int4)": (4, 128),
    "GGUF Q8_0 (g32)": (8, 32),
    "GGUF Q4_0/Q4_1 (g32)": (4, 32),
    "fp8 e4m3": 1,
}


def add_weights_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object")


@functools.lru_cache(maxsize=None)
def _per_tile_and_layer(k: int, bits: int, group: int) -> tuple[int, int]:
    """(bytes per tile of 16 output features, bytes per layer) of the packed
    form of a [n, k] weight, from IntGroups itself."""
    from folio.model.layers.quantization.int_groups import TILE, IntGroups
    size = k if group == -1 else group
    groups = torch.arange(k) // size
    count = int(groups.max()) + 1
    one = torch.ones(TILE, count)
    w = IntGroups.from_codes(torch.zeros(TILE, k, dtype=torch.uint8), groups, one, bits,
                             zero=one)
    per_layer = w.bounds.numel() * w.bounds.element_size() + (
        0 if w.perm is None else w.perm.numel() * w.perm.element_size())
    return w.nbytes - per_layer, per_layer


def linear_bytes(n: int, k: int, fmt) -> int:
    """Bytes one [n, k] linear layer takes in format `fmt` (see FORMATS)."""
    if not isinstance(fmt, tuple):
        return n * k * fmt
    from folio.model.layers.quantization.int_groups import TILE
    per_tile, per_layer = _per_tile_and_layer(k, *fmt)
    return -(-n // TILE) * per_tile + per_layer


def linears_bytes(linears: list[Linear], fmt) -> int:
    """Bytes of a model's (or rank's) linear layers in format `fmt`; routers bf16."""
    return sum(lin.count * linear_bytes(lin.out, lin.inp, 2 if lin.kind == "router" else fmt)
               for lin in linears)


def shape_table(shapes: dict[str, ModelShape]) -> dict:
    out = {}
    for name, shape in shapes.items():
        head = shape.embedding_parameters() * 2                             # bf16
        rows = {}
        for fmt_name, fmt in FORMATS.items():
            linear = linears_bytes(shape.linears(), fmt)
            rows[fmt_name] = {"linear_bytes": linear, "embedding_and_head_bytes": head,
                              "total_bytes": linear + head}
        out[name] = {"parameters": shape.parameters(),
                     "active_parameters": shape.active_parameters(), "formats": rows}
    return out


def _tensor_bytes(t) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def loaded_bytes(model) -> dict:
    """Bytes of what every module keeps after loading, by role, and the
    format of each linear layer."""
    from folio.model.layers.linear import LinearBase
    from folio.model.layers.quantization.int_groups import IntGroupsLinear
    from folio.model.layers.quantization.repacked import PackedLinear
    roles = {"linear": 0, "embedding": 0, "lm_head": 0, "other": 0}
    formats: dict[str, int] = {}
    seen = set()
    for name, module in model.named_modules():
        own = [p for p in module.parameters(recurse=False) if id(p) not in seen]
        seen.update(id(p) for p in own)
        size = sum(_tensor_bytes(p) for p in own)
        method = getattr(module, "quant_method", None)
        experts = getattr(module, "packed_experts", None)      # a FusedMoE on the CPU
        if experts is not None:
            size += sum(m.weights.nbytes if isinstance(m, IntGroupsLinear) else
                        _tensor_bytes(m.data) + _tensor_bytes(getattr(m, "scales", None))
                        for pair in experts for m in pair)
            roles["linear"] += size
            formats["packed experts"] = formats.get("packed experts", 0) + 1
            continue
        if isinstance(method, IntGroupsLinear):
            size += method.weights.nbytes
            # (a RowParts: its runs' forms, e.g. int4+int6)
            kind = "+".join(dict.fromkeys(f"int{p.bits}" for p in getattr(
                method.weights, "parts", [method.weights])))
        elif isinstance(method, PackedLinear):       # (fp8: its codes and scales)
            size += _tensor_bytes(method.data) + _tensor_bytes(getattr(method, "scales", None))
            kind = type(method).__name__
        else:
            kind = "float"
        if isinstance(module, LinearBase):
            roles["linear"] += size
            formats[kind] = formats.get(kind, 0) + 1
        elif name.endswith("embed_tokens"):
            roles["embedding"] += size
        elif name == "lm_head":
            head_packed = getattr(module, "packed", None)
            roles["lm_head"] += size + (_tensor_bytes(head_packed.data) if head_packed else 0)
        else:
            roles["other"] += size
    roles["total"] = sum(roles.values())
    return {"bytes": roles, "linear_formats": formats,
            "lm_head_tied": bool(getattr(getattr(model, "lm_head", None), "tied", False))}


def bench_weights(args, engine) -> dict:
    runner = getattr(engine.executor, "runner", None)
    if runner is None:
        raise ValueError("folio bench weights reads the model in this process: use "
                         "--tensor-parallel-size 1")
    cfg = engine.config.model
    shapes = {cfg.model: shape_of(cfg), **SHAPES}
    return {"model": cfg.model, "quantization": cfg.quantization or "none",
            "dtype": engine.config.dtype, "kv_cache_dtype": engine.config.kv_dtype,
            "loaded": loaded_bytes(runner.model),
            "shapes": shape_table(shapes)}


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def print_weights(result: dict) -> None:
    loaded = result["loaded"]
    b = loaded["bytes"]
    print(f"model {result['model']} ({result['quantization']}, {result['dtype']}): weights as "
          f"loaded {_gb(b['total'])}")
    formats = ", ".join(f"{n} {k}" for k, n in sorted(loaded["linear_formats"].items()))
    print(f"  decoder linear layers {_gb(b['linear'])} ({formats})")
    tied = " (tied: the CPU kernel's repacked copy, if any)" if loaded["lm_head_tied"] else ""
    print(f"  embedding {_gb(b['embedding'])}, LM head {_gb(b['lm_head'])}{tied}, "
          f"norms and the rest {_gb(b['other'])}")
    print()
    print("The same layouts for other shapes (embedding, LM head and routers bf16):")
    names = list(FORMATS)
    print("| model | parameters | active per token | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 3) + "|")
    for model, row in result["shapes"].items():
        cells = [_gb(row["formats"][f]["total_bytes"]) for f in names]
        print(f"| {model} | {row['parameters'] / 1e9:.2f} B | "
              f"{row['active_parameters'] / 1e9:.2f} B | " + " | ".join(cells) + " |")
