"""GGUF files: hyperparameters from metadata; linear weights of types Q4_0,
Q4_1, Q8_0, Q4_K, Q5_K and Q6_K kept in their codes
(`layers/quantization/gguf.py`), the others dequantised to float32. The
architectures are model/registry.py's GGUF names; Mixtral is a `llama` file
with an expert count, and Gemma 3's files are read as llama.cpp reads them
(`gguf_families.py`).

Three things differ from a Hugging Face checkpoint and are undone here:

* names: `blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`;
* shapes: GGUF lists dimensions fastest-first (ggml `ne` order), so a tensor
  listed as [576, 49152] is the torch matrix [49152, 576];
* rows of q/k in llama files: llama.cpp's converter reorders each head's rows
  for its interleaved (GPT-J style) rotary. Our model, like HF, rotates
  halves, so the permutation is inverted per head (Qwen2 files use the NeoX
  rotary already and are stored unpermuted).

A missing `output.weight` means the LM head is tied to `token_embd`.

The packed linear weights make the checkpoint's format "gguf": ModelConfig's
quantization_config then lists them (`packed_linear_tensors`), and the loader
yields each as its codes, scales and offsets.
"""

from __future__ import annotations

import functools
from typing import Any, Iterator, Optional

import torch

from folio.config import ModelConfig
from folio.model.gguf_families import MISSING as _MISSING
from folio.model.gguf_families import expert_fields, field as _field, gemma3_fields, phi3_fields
from folio.model.registry import ARCHITECTURES
from folio.model.gguf_blocks import dequantize, split_blocks
from folio.model.layers.quantization.gguf import (FUSED, KINDS, held_form, shard_names,
                                                  two_level)

# general.architecture -> HF class: model/registry.py's entries (Mistral GGUFs
# say "llama": the same graph)
GGUF_ARCHITECTURES = {a.gguf: name for name, a in ARCHITECTURES.items() if a.gguf}
_PERMUTED_QK = frozenset(a.gguf for a in ARCHITECTURES.values() if a.gguf_permuted_qk)

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",     # Qwen3
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    # mixture of experts: the router and each layer's experts stacked [E, out, in];
    # iter_gguf_weights gives them the names of the architecture's MoE block
    "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate",
    "ffn_up_exps": "mlp.experts.up", "ffn_down_exps": "mlp.experts.down",
}

# Gemma 3's norms around attention and MLP: llama.cpp's ffn_norm is the norm
# before the MLP there (Llama's post_attention_layernorm), and both "post" norms
# have names of their own. Its files store every norm as 1 + w (Gemma's RMSNorm
# scales by 1 + w): undone at load.
_GEMMA3_NAMES = {"ffn_norm": "pre_feedforward_layernorm",
                 "post_attention_norm": "post_attention_layernorm",
                 "post_ffw_norm": "post_feedforward_layernorm"}
# Phi-3's fused projections, as its checkpoints hold them (model/phi3.py splits
# them): attn_qkv, and ffn_up holding gate then up
_PHI3_NAMES = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
_ARCH_NAMES = {"gemma3": _GEMMA3_NAMES, "phi3": _PHI3_NAMES}

# Types gguf.quants.dequantize handles in numpy; all take about a second
# for a 135M-parameter model.
_SUPPORTED_TYPES = frozenset(
    ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
     "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"))



@functools.lru_cache(maxsize=2)
def gguf_reader(path: str):
    """The file's GGUFFile (model/gguf_file.py), cached: config, weights and
    tokenizer all read it. It memory-maps the file, so caching holds no tensor
    data."""
    from folio.model.gguf_file import GGUFFile

    try:
        return GGUFFile(path)
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot read GGUF file {path} (truncated or not GGUF?): "
                         f"{type(err).__name__}: {err}") from err


def hf_tensor_name(gguf_name: str, arch: Optional[str] = None) -> Optional[str]:
    """HF parameter name for a GGUF tensor name (of a file of general.architecture
    `arch`), or None if it has no equivalent."""
    base, _, kind = gguf_name.rpartition(".")
    if kind not in ("weight", "bias"):
        return None
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{kind}"
    parts = base.split(".")
    names = {**_LAYER_NAMES, **_ARCH_NAMES.get(arch, {})}
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{kind}"
    return None


def _check_tensors(reader, path: str) -> None:
    """Fail at config time, not halfway through loading weights."""
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError(f"{path}: per-frequency rope factors (rope_freqs, used by Llama 3.1 "
                         "GGUFs) are not supported; load the Hugging Face folder instead")
    arch = _field(reader, "general.architecture", None)
    unknown = sorted(n for n in names if hf_tensor_name(n, arch) is None)
    if unknown:
        raise ValueError(f"{path}: tensors with no Llama/Qwen2 equivalent: "
                         f"{', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''}")
    bad = sorted({t.tensor_type.name for t in reader.tensors} - _SUPPORTED_TYPES)
    if bad:
        raise ValueError(f"{path}: tensor types {', '.join(bad)} are not supported; "
                         f"supported: {', '.join(sorted(_SUPPORTED_TYPES))}")


def gguf_model_config(model: str, path: str) -> ModelConfig:
    """ModelConfig from GGUF metadata (keys are prefixed by the architecture)."""
    reader = gguf_reader(path)
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported; supported: "
                         f"{', '.join(GGUF_ARCHITECTURES)}")
    if int(_field(reader, "split.count", 1)) > 1:
        raise ValueError(f"{path} is one part of a split GGUF; merge it with llama-gguf-split")
    _check_tensors(reader, path)
    try:
        config = _build_config(reader, model, path, arch)
        if arch == "gemma3":
            config = gemma3_fields(reader, config)
        if arch == "phi3":
            config = phi3_fields(reader, config)
        experts = int(_field(reader, f"{arch}.expert_count", 0) or 0)
        return expert_fields(reader, config, arch, experts) if experts else config
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from err


def _build_config(reader, model: str, path: str, arch: str) -> ModelConfig:
    def meta(key: str, default: Any = _MISSING) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    hidden = int(meta("embedding_length"))
    heads = int(meta("attention.head_count"))
    head_dim = int(meta("attention.key_length", hidden // heads))
    rotary_dim = int(meta("rope.dimension_count", head_dim))
    if rotary_dim != head_dim:
        raise ValueError(f"partial rotary ({rotary_dim} of {head_dim} dims) is not supported")
    names = {t.name for t in reader.tensors}
    eos = [_field(reader, k, None) for k in ("tokenizer.ggml.eos_token_id",
                                            "tokenizer.ggml.eot_token_id")]
    bos = _field(reader, "tokenizer.ggml.bos_token_id", None)
    packed = packed_linear_tensors(reader)
    return ModelConfig(
        model=model, path=path, format="gguf", architecture=GGUF_ARCHITECTURES[arch],
        vocab_size=_vocab_size(reader, arch),
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_hidden_layers=int(meta("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(meta("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        max_position_embeddings=int(meta("context_length")),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        rope_scaling=_rope_scaling(meta),
        hidden_act="silu",
        # What iter_gguf_weights yields, whatever the file's quantisation.
        checkpoint_dtype="float32",
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos if i is not None)),
        quantization="gguf" if packed else None,
        quantization_config={"packed": packed} if packed else None,
    )


def packed_linear_tensors(reader) -> dict[str, str]:
    """HF names of the weights kept packed -> their GGUF type: the embedding
    table and LM head of a packable type, and the decoder's linear weights of
    one whose fused layer's other projections are packable too (a layer's
    tensors load in the form `held_form` picks for its parts; each run of
    one type is then held in its own, gguf.RowParts)."""
    arch = _field(reader, "general.architecture", None)
    types = {hf_tensor_name(t.name, arch): t.tensor_type.name for t in reader.tensors}
    # the embedding table (and an untied head) too, whose rows are whole blocks
    packed = {name: kind for name, kind in types.items()
              if kind in KINDS and name in ("model.embed_tokens.weight", "lm_head.weight")}
    for name, kind in types.items():
        if kind not in KINDS or ".layers." not in name or not name.endswith("_proj.weight"):
            continue
        if all(types.get(part) in KINDS for part in _siblings(name)):
            packed[name] = kind
    # a MoE layer's stacked experts, where all three matrices are packable
    for name, kind in types.items():
        if ".mlp.experts." in name and kind in KINDS and all(
                types.get(part) in KINDS for part in _expert_matrices(name)):
            packed[name] = kind
    return packed


def _expert_matrices(name: str) -> list[str]:
    """The stacked expert weights of the MoE layer that holds weight `name`."""
    layer = name.split(".mlp.", 1)[0]
    return [f"{layer}.mlp.experts.{p}.weight" for p in ("gate", "up", "down")]


def quantized_tensor_types(path: str) -> list[str]:
    """The GGUF types of the file's tensors that are not plain floats (Q4_1,
    Q6_K, ...), sorted."""
    return sorted({t.tensor_type.name for t in gguf_reader(path).tensors}
                  - {"F32", "F16", "BF16"})


def _vocab_size(reader, arch: str) -> int:
    size = _field(reader, f"{arch}.vocab_size", None)
    if size is not None:
        return int(size)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        return len(tokens)
    for t in reader.tensors:
        if t.name == "token_embd.weight":
            return int(t.shape[-1])  # ne order: [hidden, vocab]
    raise ValueError("cannot tell the vocabulary size")


def _rope_scaling(meta) -> Optional[dict[str, Any]]:
    kind = meta("rope.scaling.type", None)
    factor = meta("rope.scaling.factor", None)
    if kind is None and meta("rope.scale_linear", None) not in (None, 1.0):
        kind, factor = "linear", meta("rope.scale_linear")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        if factor in (None, 1.0):
            return None
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": float(factor)}
        original = meta("rope.scaling.original_context_length", None)
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        for key in ("beta_fast", "beta_slow"):
            value = meta(f"rope.scaling.yarn_{key}", None)
            if value is not None:
                scaling[key] = float(value)
        return scaling
    raise ValueError(f"rope scaling type {kind!r} is not supported")


def iter_gguf_weights(model_config: ModelConfig, keep=None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for every tensor of the file, one at a time
    (only those whose HF name `keep` takes, when given: the others unread)."""
    reader = gguf_reader(model_config.path)
    arch = _field(reader, "general.architecture")
    permuted = arch in _PERMUTED_QK
    # --quantization none: every tensor dequantized
    packed = (model_config.quantization_config or {}).get("packed", {}) \
        if model_config.quantization == "gguf" else {}
    for t in reader.tensors:
        name = hf_tensor_name(t.name, arch)
        if name is None:  # only reachable if the file changed since the config was read
            raise ValueError(f"{model_config.path}: unexpected tensor {t.name!r}")
        if keep is not None and not keep(name):
            continue
        if name in packed:
            if packed[name] != t.tensor_type.name:
                raise ValueError(f"{model_config.path}: {t.name} changed type since the "
                                 "config was read")
            if ".mlp.experts." in name:         # gate and up share w13's held form
                down = name.endswith(".down.weight")
                kinds = [packed[n] for n in (_expert_matrices(name)[2:] if down
                                             else _expert_matrices(name)[:2])]
                parts = split_blocks(t, held_form(kinds), two_level(kinds))
                yield from _packed_expert_names(model_config, name, parts)
                continue
            kinds = [packed[n] for n in _siblings(name)]
            parts = split_blocks(t, held_form(kinds), two_level(kinds))
            module = name[:-len(".weight")]
            items = [(f"{module}.{part}", value) for part, value in parts.items()]
        else:
            items = [(name, dequantize(t))]
            if arch == "gemma3" and t.name.endswith("norm.weight"):
                items = [(name, items[0][1] - 1.0)]          # stored as 1 + w
        if model_config.num_experts and (".mlp.gate." in name or ".mlp.experts." in name):
            items = _expert_names(model_config, name, items[0][1])
        for key, tensor in items:
            if permuted and ".self_attn.q_proj." in key:
                tensor = _unpermute_rows(tensor, model_config.num_attention_heads)
            elif permuted and ".self_attn.k_proj." in key:
                tensor = _unpermute_rows(tensor, model_config.num_key_value_heads)
            yield key, tensor


def _packed_expert_names(model_config: ModelConfig, name: str, parts: dict) -> list:
    """A stacked expert weight kept in its codes: each of its tensors
    (split_blocks', [E * out, ...]) one per expert, under the expert's name as
    `_expert_names` gives it (...experts.{e}.gate_proj.qcodes)."""
    experts = model_config.num_experts
    items = []
    for part, value in parts.items():
        per_expert = value.view(experts, -1, value.shape[1])
        weights = _expert_names(model_config, name, per_expert)
        items += [(f"{key[:-len('.weight')]}.{part}", t) for key, t in weights]
    return items


def _expert_names(model_config: ModelConfig, name: str, tensor: torch.Tensor) -> list:
    """A MoE layer's router, and its stacked experts [E, out, in] one per expert,
    under the names the architecture's MoE block declares (Mixtral's
    block_sparse_moe.experts.{e}.w1, Qwen3-MoE's mlp.experts.{e}.gate_proj, ...)."""
    from folio.model.registry import model_class
    style = model_class(model_config.architecture).layer_cls.style
    layer = name.split(".mlp.", 1)[0]                        # model.layers.{i}
    block = f"{layer}.{style.checkpoint_block}"
    if ".mlp.gate." in name:
        return [(f"{block}.gate.weight", tensor)]
    part = ("gate", "up", "down").index(name.rsplit(".", 2)[1])
    return [(f"{block}.experts.{e}.{style.names[part]}.weight", t)
            for e, t in enumerate(tensor)]


def _siblings(name: str) -> list[str]:
    """The checkpoint weights of the layer that holds weight `name` (itself
    included): a fused layer's projections."""
    parent, _, leaf = name[:-len(".weight")].rpartition(".")
    fused = next((f for f, parts in FUSED.items() if leaf in parts), leaf)
    return shard_names(f"{parent}.{fused}" if parent else fused)


def _unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row order for q/k (weights and biases).

    Within a head of size D, HF keeps rotary pairs half a head apart (rows i
    and i + D/2); the converter interleaves them (rows 2i and 2i + 1). Viewing
    a head as [D/2, 2] and transposing to [2, D/2] puts them back.
    """
    rows = weight.shape[0]
    rest = weight.shape[1:]
    heads = weight.reshape(num_heads, rows // num_heads // 2, 2, *rest)
    return heads.transpose(1, 2).reshape(rows, *rest).contiguous()
