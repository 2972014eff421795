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
import torch.nn.functional as F
from torch import nn

from folio.distributed.parallel_state import tp_size
from folio.model.layers.linear import PlainLinearMethod
from folio.model.layers.quantization import register_quantization
from folio.model.layers.quantization.base import LinearMethod, QuantizationConfig, weight_param
from folio.model.layers.quantization.fp8 import Fp8Linear
from folio.model.layers.quantization.fp8 import dequantize as fp8_dequantize
from folio.model.layers.quantization.gguf import FUSED
from folio.model.layers.quantization.int_checkpoint import (IntCheckpointMethod, check_input_groups,
                                                        check_packs, unpack_int32)

_FORMATS = ("pack-quantized", "float-quantized")
_BITS = (4, 8)
_STRATEGIES = ("group", "channel")
_FLOAT_STRATEGIES = ("channel", "tensor", "block")


@dataclass(frozen=True)
class WeightScheme:
    bits: int
    strategy: str
    group_size: Optional[int]       # None: channel
    symmetric: bool


@dataclass(frozen=True)
class Fp8Scheme:
    """float-quantized 8-bit weights (e4m3), symmetric, their scales per
    `strategy`: channel, tensor or block (`block`: [rows, inputs] a scale);
    `static_input`: the checkpoint holds each layer's `input_scale`."""
    strategy: str
    block: Optional[tuple[int, int]]
    static_input: bool = False


def _fp8_scheme(where: str, group: dict[str, Any]) -> Fp8Scheme:
    """A float-quantized group's scheme (FP8_DYNAMIC, FP8, FP8_BLOCK): the
    weights as stored; the activations' scheme (fp8, dynamic per token or
    group, or static per tensor) is accepted and run weight-only (fp8.py)."""
    if group.get("output_activations") is not None:
        raise ValueError(f"compressed-tensors output activation quantization "
                         f"({where}.output_activations) is not supported")
    a = group.get("input_activations")
    if a is not None and (a.get("type"), a.get("num_bits")) != ("float", 8):
        raise ValueError(f"compressed-tensors {a.get('type')!r} {a.get('num_bits')}-bit input "
                         f"activations with fp8 weights ({where}) are not supported; "
                         "supported: none, or fp8 (float, 8 bits)")
    w = group.get("weights")
    if not isinstance(w, dict):
        raise ValueError(f"{where} has no weights scheme")
    kind = (w.get("type"), int(w.get("num_bits", 0)))
    if kind != ("float", 8):
        raise ValueError(f"compressed-tensors float-quantized weights of type {kind[0]!r}, "
                         f"{kind[1]} bits ({where}) are not supported; supported: float, 8 "
                         "bits (fp8 e4m3)")
    if not w.get("symmetric", True) or w.get("dynamic"):
        raise ValueError(f"compressed-tensors fp8 weights ({where}) must be symmetric and "
                         "static (asymmetric or dynamic fp8 weights are not supported)")
    strategy = w.get("strategy")
    if strategy not in _FLOAT_STRATEGIES:
        raise ValueError(f"compressed-tensors fp8 weight strategy {strategy!r} ({where}) is "
                         f"not supported; supported: {', '.join(_FLOAT_STRATEGIES)}")
    block = None
    if strategy == "block":
        b = w.get("block_structure")
        if (not isinstance(b, (list, tuple)) or len(b) != 2
                or not all(isinstance(v, int) and v > 0 for v in b)):
            raise ValueError(f"compressed-tensors fp8 block_structure {b!r} ({where}) is not "
                             "valid (two positive numbers: rows, input features)")
        block = (int(b[0]), int(b[1]))
    return Fp8Scheme(strategy, block, a is not None and not a.get("dynamic", False))


def _scheme(name: str, group: dict[str, Any], default_format: Optional[str]):
    """One config group's weight scheme (a WeightScheme, or an Fp8Scheme),
    refusing by name what Folio does not run."""
    where = f"compressed-tensors config_groups.{name}"
    fmt = group.get("format") or default_format
    if fmt not in _FORMATS:
        raise ValueError(f"compressed-tensors format {fmt!r} ({where}) is not supported; "
                         f"supported: {', '.join(_FORMATS)}")
    if fmt == "float-quantized":
        return _fp8_scheme(where, group)
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
        if isinstance(schemes[0], Fp8Scheme):
            return CompressedTensorsFp8Method(schemes[0], prefix)
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


class CompressedTensorsFp8Method(LinearMethod):
    """float-quantized (fp8 e4m3) weights, as stored:
    - `weight` float8_e4m3fn [out, in];
    - `weight_scale` per the strategy: channel [out, 1], tensor [1] (a fused
      layer's shards each their own), block [ceil(out / rows),
      ceil(in / inputs)] (a last partial block of rows or inputs its own);
    - `input_scale` [1] (static activations only: the fp8 products' scale of
      the layer's input; a fused layer's largest).

    Each scale is spread, as it loads, to every output feature it covers: the
    layer holds [out, blocks of inputs] (one block for channel and tensor),
    which the layer's loader slices like the weight (a row-parallel rank then
    needs whole blocks of inputs). Once loaded the layer is handed over to
    `Fp8Linear` (fp8.py)."""

    def __init__(self, scheme: Fp8Scheme, prefix: str):
        self.scheme, self.prefix = scheme, prefix

    def create_weights(self, layer, in_features, out_features, dtype):
        s = self.scheme
        row_parallel = getattr(layer, "input_is_parallel", False)
        full_in = in_features * (tp_size() if row_parallel else 1)
        where = f"{self.prefix}: compressed-tensors fp8"
        if s.block is not None:
            inputs = s.block[1]
            if in_features != full_in and in_features % inputs:
                raise ValueError(f"{where} blocks of {inputs} input features: each of the "
                                 f"{tp_size()} tensor-parallel ranks gets {in_features} of the "
                                 f"layer's {full_in}, not whole blocks")
            self.block_inputs = inputs
            blocks, input_dim = -(-in_features // inputs), 1
        else:
            self.block_inputs, blocks, input_dim = in_features, 1, None
        weight = weight_param(layer, "weight", (out_features, in_features), torch.float8_e4m3fn,
                              output_dim=0, input_dim=1)
        weight.weight_loader = partial(self._load_weight, layer)
        scale = weight_param(layer, "weight_scale", (out_features, blocks), torch.float32,
                             output_dim=0, input_dim=input_dim)
        scale.weight_loader = partial(self._load_scale, layer)
        if s.static_input:
            inp = weight_param(layer, "input_scale", (1,), torch.float32, output_dim=None,
                               input_dim=None)
            inp.weight_loader = self._load_input_scale
            inp.data.zero_()

    def _load_weight(self, layer, param, loaded, shard_id=None):
        if loaded.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{self.prefix}: compressed-tensors fp8 weight stored as "
                             f"{loaded.dtype}; expected float8_e4m3fn")
        layer.weight_loader(param, loaded, shard_id)

    def _load_scale(self, layer, param, loaded, shard_id=None):
        """A checkpoint module's scale spread to each of its output features
        ([out, blocks], full size), then sliced and placed by the layer."""
        out, full_in = _full_shape(layer, shard_id)
        s, where = self.scheme, f"{self.prefix}: compressed-tensors fp8 weight_scale"
        loaded = loaded.float()
        if s.strategy == "tensor":
            if loaded.numel() != 1:
                raise ValueError(f"{where} of shape {tuple(loaded.shape)}: a tensor scale is "
                                 "one value")
            spread = loaded.reshape(1, 1).expand(out, 1)
        elif s.strategy == "channel":
            if loaded.numel() != out:
                raise ValueError(f"{where} of shape {tuple(loaded.shape)}: expected [{out}, 1]")
            spread = loaded.reshape(out, 1)
        else:
            rows, inputs = s.block
            want = (-(-out // rows), -(-full_in // inputs))
            if tuple(loaded.shape) != want:
                raise ValueError(f"{where} of shape {tuple(loaded.shape)}: blocks of "
                                 f"{rows}x{inputs} over [{out}, {full_in}] are {list(want)}")
            spread = loaded.repeat_interleave(rows, dim=0)[:out]
        layer.weight_loader(param, spread.contiguous(), shard_id)

    def _load_input_scale(self, param, loaded, shard_id=None):
        """A static activation scale (the largest of a fused layer's shards):
        positive and finite, or the activations divided by it are not numbers."""
        value = loaded.float().reshape(-1)
        if value.numel() != 1 or not (torch.isfinite(value).all() and (value > 0).all()):
            raise ValueError(f"{self.prefix}: compressed-tensors input_scale "
                             f"{value.tolist()}: a static activation scale is one positive, "
                             "finite value")
        param.data.copy_(torch.maximum(param.data, value))

    def process_weights_after_loading(self, layer):
        static = layer.input_scale.data.clone() if self.scheme.static_input else None
        layer.quant_method = Fp8Linear(layer.weight.data, layer.weight_scale.data,
                                       self.block_inputs, static)
        for name in ("weight", "weight_scale"):
            param = getattr(layer, name)
            param.data = torch.empty(0, dtype=param.dtype)

    def apply(self, layer, x, bias=None):
        # only before the weights are processed (the layer is handed over then)
        w = fp8_dequantize(layer.weight.data, layer.weight_scale.data, self.block_inputs)
        return F.linear(x, w.to(x.dtype), bias)
