"""Every decoder layer of a step in one native call (`decoder.c`).

`NativeDecoder.build(layers)` says whether the decoder layers of a loaded
Llama-family model (Qwen3's per-head q/k norms included; Mixtral's and
Qwen3-MoE's MoE layers, whose router and chosen experts run in the call
too) can take this path: every projection (and expert) packed for one of the
native linear kernels, one tensor-parallel rank, no bias but on qkv, LoRA
slots (if any) the native grouped kernel's, run after each projection.
Three kinds:

- bf16 (weights packed for the AVX512-BF16 kernel): the modules call the same
  kernels in the same order, so the two give bit-identical hidden states
  (tested);
- fp32 activations with bf16-stored weights (the AVX2 kernel, `--dtype
  bfloat16` on CPUs without native bf16): the one call also fuses the
  element-wise layers, which the modules keep in torch in fp32, so the two agree
  to fp32 rounding (tested; a MoE layer's router is torch's in the modules and
  moe.c's here, so a near-tie of two experts' logits may route otherwise);
- quantized weights (4-, 6- or 8-bit `IntGroups`, native/qlinear.c), with bf16
  activations (bit-identical to the modules, which call the same kernels) or
  fp32 ones (the element-wise layers fused as above); int8 activations at
  decode batch sizes or not, as the layers' --activation-quantization says;
- fp8 weights (`Fp8Linear` on native/fp8linear.c) with fp32 activations, the
  element-wise layers fused as above.

The model keeps its torch modules either way, and a step goes back to them
whenever a kernel is switched off.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from folio.kernels import native
from folio.model.layers.moe import FusedMoE

_p, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


class _Layer(ctypes.Structure):
    _fields_ = [(name, _p) for name in ("input_norm", "post_norm", "qkv", "qkv_bias", "o",
                                        "gate_up", "down", "kv_cache", "q_norm", "k_norm")] + [
        ("lora_at", _p * 4), ("lora_bt", _p * 4), ("lora_width", _i64 * 4),
        ("kv_scale", _p * 2), ("moe", _p), ("window", _i64)]


class _MoE(ctypes.Structure):
    """decoder.c's folio_moe: a MoE layer's router and experts."""
    _fields_ = [("router", _p), ("w13", _p), ("w2", _p), ("intermediate", _i64),
                ("experts", _i32), ("top_k", _i32), ("renormalize", _i32),
                ("weights_in_float", _i32)]


class _Step(ctypes.Structure):
    _fields_ = [("tokens", _i64), ("hidden", _i64), ("intermediate", _i64),
                ("heads", _i32), ("kv_heads", _i32), ("head_dim", _i32), ("block_size", _i32),
                ("num_blocks", _i64), ("eps", _f32), ("scale", _f32),
                ("cos", _p), ("sin", _p), ("slots", _p), ("block_tables", _p),
                ("max_blocks", _i64), ("token_rows", _p), ("context_lens", _p),
                ("hidden_states", _p), ("residual", _p),
                ("normed", _p), ("qkv", _p), ("attn", _p), ("gate_up", _p), ("act", _p),
                ("num_threads", _i32), ("dtype", _i32), ("quantized", _i32),
                ("quantize_x", _i32), ("kv_dtype", _i32),
                ("lora_runs", _p), ("lora_nruns", _i64), ("lora_dtype", _i32),
                ("residual_in", _i32)]


class _Fp8Weight(ctypes.Structure):
    """decoder.c's folio_fp8weight: an fp8 projection (quantization/fp8.py's
    Fp8Linear, packed for the native kernel)."""
    _fields_ = [("codes", _p), ("scales", _p), ("block", _i64)]

    @classmethod
    def of(cls, method) -> "_Fp8Weight":
        return cls(codes=method.data.data_ptr(), scales=method.scales.data_ptr(),
                   block=method.block)


class _QWeight(ctypes.Structure):
    """decoder.c's folio_qweight: a quantized projection (int_groups.IntGroups),
    or a run of a RowParts' output features with the next run's (`next`)."""
    _fields_ = [("perm", _p), ("codes", _p), ("scales", _p), ("offsets", _p), ("supers", _p),
                ("bounds", _p), ("groups", _i64), ("positions", _i64), ("per_super", _i64),
                ("bits", _i32), ("zeros", _i32), ("next", _p), ("rows", _i64)]

    @classmethod
    def of(cls, weights) -> "_QWeight":
        parts = getattr(weights, "parts", None)
        if parts is not None:       # a chain; the head keeps the others alive
            chain = [cls.of(p) for p in parts]
            for a, b in zip(chain, chain[1:]):
                a.next = ctypes.addressof(b)
            chain[0].chain = chain
            return chain[0]
        (perm, codes, bits, scales, offsets, zeros, supers, per_super, bounds, groups), \
            (rows, positions) = weights.kernel_args
        return cls(perm=perm, codes=codes, scales=scales, offsets=offsets, supers=supers,
                   bounds=bounds, groups=groups, positions=positions, per_super=per_super,
                   rows=rows,
                   bits=bits, zeros=zeros)


def _projections(layer) -> tuple:
    """A layer's projections the one call runs as such: qkv, o, and a dense
    MLP's gate_up and down (a MoE layer's experts are its folio_moe)."""
    attn, mlp = layer.self_attn, layer.mlp
    if isinstance(mlp, FusedMoE):
        return attn.qkv_proj, attn.o_proj
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


class NativeDecoder:
    def __init__(self, layers, kind: str):
        self.layers = layers
        self.kind = kind
        # "bf16_weights": fp32 activations with bf16-stored weights; "bf16": bf16
        # throughout; "int": quantized weights in the model's dtype
        self.bf16_weights = kind == "bf16_weights"
        self.quantized = kind in ("int", "fp8")
        self.fp8 = kind == "fp8"
        self.dtype = {"bf16_weights": torch.float32, "bf16": torch.bfloat16, "fp8": torch.float32,
                      "int": layers[0].input_layernorm.weight.dtype}[kind]
        self._keep: list = []           # the ctypes structs and fp32 biases the table points to
        first = layers[0]
        attn = first.self_attn
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.hidden = attn.o_proj.out_features
        # the dense MLPs' (a MoE layer's experts have scratch of their own in decoder.c)
        self.intermediate = max((layer.mlp.gate_up_proj.out_features // 2 for layer in layers
                                 if not isinstance(layer.mlp, FusedMoE)), default=0)
        self.eps = first.input_layernorm.eps
        self.scale = attn.attn.scale
        # folio_qlinear's mode, as the modules' layers take it (IntGroupsLinear)
        self.quantize_x = (attn.qkv_proj.quant_method.quantize_x(self.dtype)
                           if kind == "int" else 0)
        self._tables: dict[tuple[int, ...], ctypes.Array] = {}
        # LoRA (model/lora/layers.py): the step's runs of rows by adapter
        slots = [p.lora for layer in layers for p in _projections(layer)
                 if p.lora is not None]
        self.lora_context = slots[0].context if slots else None
        self.lora_dtype = native.dtype_code(slots[0].at.dtype) if slots else 0

    @classmethod
    def build(cls, layers) -> Optional["NativeDecoder"]:
        """The native path for these decoder layers, or None where it does not apply."""
        # CPU weights only: checked before load(), which builds the CPU kernels
        # (a minute and more of compiling) that a CUDA engine would never call
        if not layers or any(t.device.type != "cpu" for t in layers[0].parameters()) \
                or native.load() is None:
            return None
        kinds, modes = set(), set()     # the weights' kernels; quantized ones' activations
        dtype = layers[0].input_layernorm.weight.dtype
        for layer in layers:
            # Llama's layer shape only (a family with other norms or activations,
            # Gemma's, says so); a layer's window (Mistral's) goes with it
            if not getattr(layer, "native_decoder_shape", True):
                return None
            attn, mlp = layer.self_attn, layer.mlp
            if isinstance(mlp, FusedMoE):
                # experts packed for a native kernel (or quantized), on one rank,
                # in the mode of the layers' activations
                if mlp.packed_experts is None or mlp.tp != 1 \
                        or mlp.num_experts > native.MAX_ROUTED_EXPERTS:
                    return None
                experts = [m for pair in mlp.packed_experts for m in pair]
                kinds.update(m.native_kind for m in experts)
                modes.update(m.quantize_x(dtype) for m in experts if m.native_kind == "int")
            elif not hasattr(mlp, "gate_up_proj"):
                return None
            projections = _projections(layer)
            # each weight method says whether, and with which kernel, the one
            # call can run its layer
            kinds.update(p.quant_method.native_kind for p in projections)
            modes.update(p.quant_method.quantize_x(dtype) for p in projections
                         if p.quant_method.native_kind == "int")
            if attn.attn.native_kind != "paged_cpu":     # the attention must be the kernel's
                return None
            if attn.o_proj.tp != 1 or attn.o_proj.bias is not None:
                return None
            if any(p.bias is not None for p in projections[2:]):
                return None
            # LoRA slots: the one call runs the native grouped kernel's
            if any(p.lora is not None and p.lora.kernel != "native" for p in projections):
                return None
        if len(kinds) != 1 or None in kinds or len(modes) > 1:
            return None
        # one dense MLP size (decoder.c sizes every dense layer by it)
        if len({layer.mlp.gate_up_proj.out_features for layer in layers
                if not isinstance(layer.mlp, FusedMoE)}) > 1:
            return None
        kind = kinds.pop()
        if kind == "int" and dtype not in (torch.float32, torch.bfloat16):
            return None
        if kind == "fp8" and dtype != torch.float32:      # the fp8 kernel's activations
            return None
        return cls(layers, kind)

    def usable(self, hidden: torch.Tensor, meta, kv_caches=None) -> bool:
        """Checked every step: the kernels may be switched off (tests do). An
        fp8 e5m2 cache is the modules' (decoder.c writes int8 and e4m3 rows)."""
        if hidden.dtype != self.dtype or meta.token_rows is None or hidden.dim() != 2:
            return False
        if kv_caches and kv_caches[0].dtype == torch.float8_e5m2:
            return False
        if self.fp8 and not native.has_fp8_linear():
            return False
        if self.quantized and not self.fp8 and not native.runs_qlinear(hidden):
            return False                                        # what the layers ask
        return native.supports(hidden) and (self.dtype == torch.float32 or native.fuses(hidden))

    def _matrix(self, method, keep: list) -> int:
        """What decoder.c reads for one weight method: a packed tensor, or a
        struct (kept alive in `keep`)."""
        if self.fp8:
            keep.append(_Fp8Weight.of(method))
            return ctypes.addressof(keep[-1])
        weights = method.native_weight()
        if not self.quantized:
            return weights.data_ptr()
        keep.append(_QWeight.of(weights))
        return ctypes.addressof(keep[-1])

    def _weight(self, layer, keep: list) -> int:
        return self._matrix(layer.quant_method, keep)

    def _moe(self, mlp: FusedMoE, keep: list) -> int:
        """decoder.c's folio_moe of a MoE layer (its structs kept in `keep`)."""
        def pointers(matrices):
            array = (_p * len(matrices))()
            for i, m in enumerate(matrices):
                array[i] = self._matrix(m, keep)
            keep.append(array)
            return ctypes.addressof(array)

        router = mlp.gate.w32 if mlp.gate.w32 is not None else mlp.gate.weight.detach().float()
        keep.append(router.contiguous())
        moe = _MoE(router=keep[-1].data_ptr(),
                   w13=pointers([pair[0] for pair in mlp.packed_experts]),
                   w2=pointers([pair[1] for pair in mlp.packed_experts]),
                   intermediate=mlp.intermediate, experts=mlp.num_experts, top_k=mlp.top_k,
                   renormalize=int(mlp.renormalize),
                   weights_in_float=int(mlp.weights_in_float))
        keep.append(moe)
        return ctypes.addressof(moe)

    def _bias(self, bias, keep: list) -> Optional[int]:
        """The qkv bias as the step's kernel reads it (fp32 for quantized ones)."""
        if bias is None or not self.quantized:
            return _ptr(bias)
        keep.append(bias.detach().float().contiguous())
        return keep[-1].data_ptr()

    def _layer_table(self, kv_caches) -> ctypes.Array:
        key = tuple(c.data_ptr() for c in kv_caches)
        table = self._tables.get(key)
        if table is None:
            table, keep = (_Layer * len(self.layers))(), []
            for entry, layer, cache in zip(table, self.layers, kv_caches):
                attn, mlp = layer.self_attn, layer.mlp
                entry.input_norm = layer.input_layernorm.weight.data_ptr()
                entry.post_norm = layer.post_attention_layernorm.weight.data_ptr()
                entry.qkv = self._weight(attn.qkv_proj, keep)
                entry.qkv_bias = self._bias(attn.qkv_proj.bias, keep)
                entry.o = self._weight(attn.o_proj, keep)
                if isinstance(mlp, FusedMoE):
                    entry.moe = self._moe(mlp, keep)
                else:
                    entry.gate_up = self._weight(mlp.gate_up_proj, keep)
                    entry.down = self._weight(mlp.down_proj, keep)
                entry.kv_cache = cache.data_ptr()
                entry.window = attn.attn.sliding_window or 0
                q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
                entry.q_norm = None if q_norm is None else q_norm.weight.data_ptr()
                entry.k_norm = None if k_norm is None else k_norm.weight.data_ptr()
                scales = attn.attn.kv_scales         # a checkpoint's, for an fp8 cache
                if scales:                           # fp32 [kv heads] each, kept alive
                    keep.extend(s.float().contiguous() for s in scales)
                    entry.kv_scale[0], entry.kv_scale[1] = (keep[-2].data_ptr(),
                                                            keep[-1].data_ptr())
                for j, p in enumerate(_projections(layer)):
                    if p.lora is not None:
                        entry.lora_at[j], entry.lora_bt[j] = (p.lora.at.data_ptr(),
                                                              p.lora.bt.data_ptr())
                        entry.lora_width[j] = p.lora.at.shape[2]
            self._tables = {key: table}          # one cache set at a time
            self._keep = keep
        return table

    def __call__(self, hidden: torch.Tensor, rope, kv_caches, meta,
                 residual: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, hidden] (overwritten) -> (last layer's output, residual).
        `residual`: the stream so far, from an earlier pipeline stage (updated
        in place); None at the model's first layer."""
        t = hidden.shape[0]
        hidden = hidden.contiguous()
        new = lambda *shape: torch.empty(*shape, dtype=hidden.dtype)
        residual_in = residual is not None
        residual = residual.contiguous() if residual_in else new(t, self.hidden)
        normed = new(t, self.hidden)
        qkv = new(t, (self.heads + 2 * self.kv_heads) * self.head_dim)
        attn = new(t, self.heads * self.head_dim)
        gate_up, act = new(t, 2 * self.intermediate), new(t, self.intermediate)
        cos, sin = (r.reshape(t, -1).contiguous() for r in rope)
        tables = meta.block_tables.contiguous()
        rows, lens = meta.token_rows.contiguous(), meta.context_lens.contiguous()
        slots = meta.slot_mapping.contiguous()
        cache = kv_caches[0]
        step = _Step(
            tokens=t, hidden=self.hidden, intermediate=self.intermediate, heads=self.heads,
            kv_heads=self.kv_heads, head_dim=self.head_dim, block_size=cache.shape[2],
            num_blocks=cache.shape[1], eps=self.eps, scale=self.scale,
            cos=cos.data_ptr(), sin=sin.data_ptr(), slots=slots.data_ptr(),
            block_tables=tables.data_ptr(), max_blocks=tables.shape[1],
            token_rows=rows.data_ptr(), context_lens=lens.data_ptr(),
            hidden_states=hidden.data_ptr(), residual=residual.data_ptr(),
            normed=normed.data_ptr(), qkv=qkv.data_ptr(), attn=attn.data_ptr(),
            gate_up=gate_up.data_ptr(), act=act.data_ptr(), num_threads=torch.get_num_threads(),
            dtype=native.dtype_code(hidden.dtype),
            quantized=2 if self.fp8 else int(self.quantized),
            quantize_x=self.quantize_x, kv_dtype=native.kv_code(cache.dtype),
            residual_in=int(residual_in))
        ctx = self.lora_context
        if ctx is not None and ctx.groups:
            step.lora_runs, step.lora_nruns = ctx.runs.data_ptr(), ctx.runs.shape[0]
            step.lora_dtype = self.lora_dtype
        table = self._layer_table(kv_caches)
        if native.load().folio_decoder_layers(table, len(self.layers), ctypes.byref(step)):
            raise MemoryError("a native CPU kernel could not allocate its scratch memory")
        return hidden, residual
