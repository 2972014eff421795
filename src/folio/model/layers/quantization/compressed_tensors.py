"""compressed-tensors checkpoints, `pack-quantized` format (what llm-compressor
writes for W4A16 / W8A16: integer weights, float activations).

config.json's quantization_config lists `config_groups`, each a scheme (its
`weights`: num_bits, strategy group or channel, group_size, symmetric) and the
modules it `targets` ("Linear": every linear layer; a module name; or
"re:<regex>"), and the modules left as float weights (`ignore`, names or
regexes, e.g. "lm_head", which is not a linear layer here anyway).

Tensors of a quantized linear layer, as stored:
- `weight_packed` int32 [out, in * bits / 32]: each row a little-endian bit
  stream in column order (input feature k at bits k * bits..), the signed
  codes offset by 2^(bits - 1) (4 bits: q + 8), i.e. unsigned;
- `weight_scale` [out, groups] (strategy channel: [out, 1]);
- `weight_zero_point` int32 [out * bits / 32, groups] (asymmetric schemes
  only): the zero points, offset the same way, packed along the OUTPUT axis;
- `weight_shape` int64 [2]: the layer's full [out, in], checked at load.

w[n, k] = (u[n, k] - u_zero[n, g(k)]) * scale[n, g(k)] with the unsigned codes
and zeros; a symmetric scheme's zero is 2^(bits - 1). g(k) = k // group_size
(actorder "static" or "weight" keep groups in column order; "group", which
stores a g_idx, is refused).

Tensor parallelism shards weight_packed, weight_scale and weight_zero_point
along the output for a column-parallel layer, and for a row-parallel one
weight_packed's words and the groups of the scales and zero points (a channel
scheme's one group stays whole on every rank), which needs every rank's inputs
to be whole groups. weight_shape holds full sizes: each fused shard's is
checked against that shard's full size as it is loaded.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import partial
from typing import Any, Optional

import torch
from torch import nn

from folio.distributed.parallel_state import tp_size
from folio.model.layers.linear import PlainLinearMethod
from folio.model.layers.quantization import register_quantization
from folio.model.layers.quantization.base import LinearMethod, QuantizationConfig, weight_param
from folio.model.layers.quantization.gguf import FUSED
from folio.model.layers.quantization.int_checkpoint import (IntCheckpointMethod, check_input_groups,
                                                        check_packs, unpack_int32)

_FORMATS = ("pack-quantized",)
_BITS = (4, 8)
_STRATEGIES = ("group", "channel")


@dataclass(frozen=True)
class WeightScheme:
    bits: int
    strategy: str
    group_size: Optional[int]       # None: channel
    symmetric: bool


def _scheme(name: str, group: dict[str, Any], default_format: Optional[str]) -> WeightScheme:
    """One config group's weight scheme, refusing by name what Folio does not run."""
    where = f"compressed-tensors config_groups.{name}"
    fmt = group.get("format") or default_format
    if fmt not in _FORMATS:
        raise ValueError(f"compressed-tensors format {fmt!r} ({where}) is not supported; "
                         f"supported: {', '.join(_FORMATS)}")
    for key in ("input_activations", "output_activations"):
        if group.get(key) is not None:
            raise ValueError(f"compressed-tensors activation quantization ({where}.{key}) is "
                             "not supported; supported: weight-only schemes (W4A16, W8A16)")
    w = group.get("weights")
    if not isinstance(w, dict):
        raise ValueError(f"{where} has no weights scheme")
    kind = w.get("type", "int")
    if kind != "int":
        raise ValueError(f"compressed-tensors {kind!r} weights ({where}) are not supported; "
                         "supported: int")
    bits = int(w.get("num_bits", 0))
    if bits not in _BITS:
        raise ValueError(f"compressed-tensors with {bits}-bit weights ({where}) is not "
                         f"supported; supported: {', '.join(map(str, _BITS))} bits")
    strategy = w.get("strategy")
    if strategy not in _STRATEGIES:
        raise ValueError(f"compressed-tensors strategy {strategy!r} ({where}) is not "
                         f"supported; supported: {', '.join(_STRATEGIES)}")
    group_size = None
    if strategy == "group":
        group_size = w.get("group_size")
        if not isinstance(group_size, int) or group_size <= 0:
            raise ValueError(f"compressed-tensors group_size {group_size!r} ({where}) is not "
                             "valid (a positive number)")
    actorder = w.get("actorder")
    if actorder is True or actorder == "group":
        raise ValueError(f"compressed-tensors actorder 'group' ({where}: groups in any order, "
                         "weight_g_idx) is not supported; supported: static, weight")
    if w.get("dynamic"):
        raise ValueError(f"compressed-tensors dynamic weight quantization ({where}) is not "
                         "supported")
    return WeightScheme(bits, strategy, group_size, bool(w.get("symmetric", True)))


def _matches(pattern: str, name: str) -> bool:
    """A target or ignore entry: "re:<regex>" (matched from the start of the
    module name), a module name, or "Linear" (the class of every linear layer)."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern in (name, "Linear")


def _kv_cache_scheme(scheme) -> Optional[str]:
    """The checkpoint's static fp8 KV cache scales: "tensor" (one k_scale and
    v_scale per attention layer) or "attn_head" (one per KV head), 8-bit
    float, not dynamic; None without a kv_cache_scheme; any other is refused,
    naming what it asks."""
    if not scheme:
        return None
    kind = (scheme.get("type"), scheme.get("num_bits"), scheme.get("strategy"),
            bool(scheme.get("dynamic")))
    if kind not in (("float", 8, "tensor", False), ("float", 8, "attn_head", False)):
        raise ValueError(f"compressed-tensors kv_cache_scheme {kind[:3]} (dynamic: {kind[3]}) "
                         "is not supported: only static fp8 scales per tensor or per "
                         "attention head are (type float, num_bits 8, strategy tensor or "
                         "attn_head)")
    return kind[2]


@register_quantization("compressed-tensors")
class CompressedTensorsConfig(QuantizationConfig):
    def __init__(self, config: dict[str, Any], *, weight_dtype=None):
        super().__init__(config, weight_dtype=weight_dtype)
        for key, what in (("sparsity_config", "sparsity compression"),
                          ("transform_config", "transforms")):
            if config.get(key):
                raise ValueError(f"compressed-tensors with {what} (`{key}`) is not supported")
        self.kv_cache_scales = _kv_cache_scheme(config.get("kv_cache_scheme"))
        groups = config.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise ValueError("compressed-tensors quantization_config has no config_groups")
        self.schemes = [(list(group.get("targets") or []),
                         _scheme(name, group, config.get("format")))
                        for name, group in groups.items()]
        self.ignore = list(config.get("ignore") or [])

    def scheme_of(self, module: str) -> Optional[WeightScheme]:
        """The scheme of checkpoint module `module` (None: float weights). A
        target naming the module (or a regex) wins over the class "Linear"."""
        if any(_matches(p, module) for p in self.ignore):
            return None
        for by_name in (True, False):
            for targets, scheme in self.schemes:
                if any(_matches(t, module) and (t != "Linear") == by_name for t in targets):
                    return scheme
        return None

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod:
        parent, _, leaf = prefix.rpartition(".")
        modules = [f"{parent}.{part}" for part in FUSED.get(leaf, (leaf,))]
        schemes = [self.scheme_of(m) for m in modules]
        if any(s != schemes[0] for s in schemes):
            described = ", ".join(f"{m}: {s or 'not quantized'}" for m, s in zip(modules, schemes))
            raise ValueError(f"{prefix}: compressed-tensors gives the projections of this fused "
                             f"layer different schemes ({described}); they must share one")
        if schemes[0] is None:
            return PlainLinearMethod(self.weight_dtype)
        return CompressedTensorsLinearMethod(schemes[0], prefix)


def _full_shape(layer: nn.Module, shard_id) -> list[int]:
    """[out, in] of the checkpoint module that fills `layer`'s shard `shard_id`
    (None: the whole layer), at full size whatever the tensor-parallel rank."""
    tp = tp_size()
    row_parallel = getattr(layer, "input_is_parallel", False)
    full_in = layer.in_features * (tp if row_parallel else 1)
    if shard_id is None:
        out = layer.out_features * (1 if row_parallel else tp)
    elif hasattr(layer, "output_sizes"):                    # gate, up
        out = layer.output_sizes[shard_id] * tp
    elif shard_id == "q":
        out = layer.num_heads * layer.head_dim * tp
    else:                                                   # k, v (maybe replicated)
        out = layer.num_kv_heads * layer.head_dim * tp // layer.kv_replicas
    return [out, full_in]


class CompressedTensorsLinearMethod(IntCheckpointMethod):
    def __init__(self, scheme: WeightScheme, prefix: str):
        self.scheme, self.prefix, self.bits = scheme, prefix, scheme.bits

    @property
    def checkpoint_tensors(self) -> tuple[str, ...]:
        names = ("weight_packed", "weight_scale", "weight_shape")
        return names if self.scheme.symmetric else names + ("weight_zero_point",)

    def create_weights(self, layer, in_features, out_features, dtype):
        s = self.scheme
        bits, per = s.bits, 32 // s.bits
        row_parallel = getattr(layer, "input_is_parallel", False)
        full_in = in_features * (tp_size() if row_parallel else 1)
        where = f"{self.prefix}: compressed-tensors"
        if s.strategy == "group":
            group = s.group_size
            check_input_groups(where, group, in_features, full_in)
            groups, group_dim = in_features // group, 1
        else:                                   # channel: one group, whole on every rank
            group, groups, group_dim = in_features, 1, None
        check_packs(where, bits, in_features, "input")
        if not s.symmetric and out_features % per:
            raise ValueError(f"{where} {bits}-bit zero points pack {per} output features per "
                             f"int32; {out_features} is not a multiple")
        self.group = group
        weight_param(layer, "weight_packed", (out_features, in_features // per), torch.int32,
                     output_dim=0, input_dim=1, packed_dim=1, pack_factor=per)
        weight_param(layer, "weight_scale", (out_features, groups), torch.float32,
                     output_dim=0, input_dim=group_dim)
        if not s.symmetric:
            weight_param(layer, "weight_zero_point", (out_features // per, groups), torch.int32,
                         output_dim=0, input_dim=group_dim, packed_dim=0, pack_factor=per)
        shape = weight_param(layer, "weight_shape", (2,), torch.int64,
                             output_dim=None, input_dim=None)
        shape.weight_loader = partial(self._load_shape, layer)

    def _load_shape(self, layer, param, loaded, shard_id=None):
        """Check a checkpoint module's weight_shape against the full size of the
        layer's shard it fills (a fused layer's shards all land in one param)."""
        expected = _full_shape(layer, shard_id)
        got = [int(v) for v in loaded.flatten().tolist()]
        if got != expected:
            raise ValueError(f"compressed-tensors weight_shape {got} does not match the "
                             f"layer's {expected}")
        param.data.copy_(loaded.reshape(param.shape).to(param.dtype))

    def _parts(self, layer) -> tuple[torch.Tensor, ...]:
        """(codes [N, K], group of each k [K], scale [N, G], zero [N, G]), all
        unsigned (codes and zeros offset by 2^(bits - 1), as stored)."""
        bits = self.scheme.bits
        codes = unpack_int32(layer.weight_packed.data, bits, 1)
        scale = layer.weight_scale.data.float()
        if self.scheme.symmetric:
            zero = torch.full_like(scale, float(1 << (bits - 1)))
        else:
            zero = unpack_int32(layer.weight_zero_point.data, bits, 0).float()
        groups = torch.arange(codes.shape[1]) // self.group
        return codes, groups, scale, zero
