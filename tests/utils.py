"""Test helpers: tiny tokenizers and random models written as Hugging Face folders."""

from __future__ import annotations

import json
import os
from pathlib import Path

TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TINY_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention keeps the KV cache in fixed-size blocks.",
    "Continuous batching admits new requests the moment there is room.",
    "café naïve résumé — 東京 北京 😀 🚀 12345 67890",
    "def f(x):\n    return x * 2\n\n",
    "Hello, world! How are you today? I am fine, thanks.",
]


def write_tiny_tokenizer(path: str | os.PathLike, vocab_size: int = 384,
                         chat_template: str | None = TINY_CHAT_TEMPLATE) -> None:
    """Train a small byte-level BPE (deterministic) and save it as an HF tokenizer.

    Writes tokenizer.json and tokenizer_config.json (BOS `<s>` added at the start,
    EOS `</s>`, ChatML-style template) into `path`.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=TINY_SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, "add_eos_token": False,
        "model_max_length": 2048,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


# --------------------------------------------------------------------------- tiny models

TINY_VOCAB_SIZE = 384           # covers write_tiny_tokenizer's vocabulary
TINY_BOS_ID, TINY_EOS_ID, TINY_IM_END_ID = 1, 2, 4   # <s>, </s>, <|im_end|>

# Weights drawn from N(0, 0.2), not transformers' 0.02: with 0.02 about 1 % of
# greedy steps have a top-2 logprob gap under 1e-3 (a coin toss for parity
# tests) and greedy text loops; with 0.2 the median gap is ~0.5 and none of
# 256 probed steps fell under 1e-3.
TINY_INIT_STD = 0.2

_TINY_ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    # mixture of experts: pass the expert counts and sizes (e.g. num_local_experts=4,
    # num_experts_per_tok=2; Qwen3-MoE: num_experts, moe_intermediate_size)
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}


def default_gguf_path() -> str:
    """The SmolLM2-135M-Instruct GGUF that the default model resolves to."""
    from folio.model.loader import resolve_model_path

    return resolve_model_path(None)[0]


def make_tiny_model(path: str | os.PathLike, arch: str = "llama", dialect: str = "classic",
                    tie_word_embeddings: bool = False, num_shards: int = 1, seed: int = 0,
                    rope_scaling: dict | None = None, **overrides) -> str:
    """Write a complete HF folder holding a small random fp32 model; returns the path.

    2 layers, hidden 64, 4 heads / 2 KV heads, vocab 384, 512 positions unless
    `overrides` (any config field, e.g. rope_theta=50000.0) say otherwise.
    Every parameter is random, biases and norm weights included, so a loader
    that drops or swaps one shows up in parity tests. config.json is rewritten
    in the requested dialect: "classic" (rope_theta / rope_scaling /
    torch_dtype) or "v5" (rope_parameters / dtype).
    """
    import torch
    import transformers

    if arch not in _TINY_ARCHS:
        raise ValueError(f"arch must be one of {sorted(_TINY_ARCHS)}, got {arch!r}")
    if dialect not in ("classic", "v5"):
        raise ValueError(f"dialect must be 'classic' or 'v5', got {dialect!r}")
    path = Path(path)
    config_name, model_name = _TINY_ARCHS[arch]
    params = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=TINY_VOCAB_SIZE,
                  max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
                  bos_token_id=TINY_BOS_ID, eos_token_id=TINY_EOS_ID,
                  tie_word_embeddings=tie_word_embeddings)
    if arch == "gemma3":
        params.update(GEMMA3_TINY)
    if arch == "phi3":          # its default pad id (32000) lies outside the tiny vocabulary
        params["pad_token_id"] = 0
    params.update(overrides)
    rope = {"rope_type": "default", "rope_theta": params.pop("rope_theta")}
    if rope_scaling:
        scaling = dict(rope_scaling)
        scaling.setdefault("rope_type", scaling.pop("type", "default"))
        scaling.pop("type", None)
        rope.update(scaling)
    if arch == "gemma3":        # a rope per layer kind; scaling on the global layers only
        rope = {"full_attention": rope, "sliding_attention": {
            "rope_type": "default", "rope_theta": params.pop("rope_local_base_freq")}}
    config = getattr(transformers, config_name)(rope_parameters=rope, **params)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    _randomize(model)
    if arch == "gemma3":        # norms scale by (1 + w): the same 0.5 .. 1.5 as the others
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.sub_(1.0)
    model.save_pretrained(path)
    if num_shards > 1:
        _reshard(path, num_shards)
    (path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": TINY_BOS_ID, "eos_token_id": [TINY_EOS_ID, TINY_IM_END_ID]}, indent=2))
    write_tiny_tokenizer(path, vocab_size=TINY_VOCAB_SIZE)
    if arch == "gemma3":
        _rewrite_gemma3_dialect(path / "config.json", dialect)
    else:
        _rewrite_dialect(path / "config.json", dialect)
    return str(path)


# Gemma 3's tiny shape: a 16-token window (prompts run past it), two local
# layers then a global one (the classic dialect's sliding_window_pattern 3),
# rope bases of their own, head_dim given (Gemma's default is 256)
GEMMA3_TINY = dict(num_hidden_layers=3, head_dim=16, sliding_window=16,
                   layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                   rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                   query_pre_attn_scalar=24)


def _rewrite_gemma3_dialect(config_path: Path, dialect: str) -> None:
    """Gemma 3's two dialects: transformers 5's layer_types and rope_parameters
    per layer kind, or the older sliding_window_pattern, rope_theta,
    rope_local_base_freq and rope_scaling (as Hub configs of 2025 have them)."""
    cfg = json.loads(config_path.read_text())
    cfg.pop("torch_dtype", None)
    cfg.pop("dtype", None)
    if dialect == "v5":
        cfg["dtype"] = "float32"
    else:
        rope = cfg.pop("rope_parameters")
        full, local = dict(rope["full_attention"]), rope["sliding_attention"]
        cfg["rope_theta"] = full.pop("rope_theta")
        cfg["rope_local_base_freq"] = local["rope_theta"]
        cfg["rope_scaling"] = None if full.get("rope_type") == "default" else full
        types = cfg.pop("layer_types")
        pattern = types.index("full_attention") + 1
        assert all((t == "full_attention") == ((i + 1) % pattern == 0)
                   for i, t in enumerate(types)), "layer_types without a pattern"
        cfg["sliding_window_pattern"] = pattern
        cfg["torch_dtype"] = "float32"
    config_path.write_text(json.dumps(cfg, indent=2, sort_keys=True))


def _randomize(model) -> None:
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():  # tied weights appear once
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, TINY_INIT_STD)


def _reshard(path: Path, num_shards: int) -> None:
    """Split model.safetensors into exactly `num_shards` files plus an index.

    transformers' max_shard_size packs greedily, so the shard count it gives
    depends on tensor sizes; splitting ourselves makes it exact.
    """
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    names = sorted(tensors)
    if num_shards > len(names):
        raise ValueError(f"cannot split {len(names)} tensors into {num_shards} shards")
    weight_map, total = {}, 0
    for i in range(num_shards):
        shard = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[i::num_shards]}
        save_file(part, str(path / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
        total += sum(t.numel() * t.element_size() for t in part.values())
    (path / "model.safetensors").unlink()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _rewrite_dialect(config_path: Path, dialect: str) -> None:
    cfg = json.loads(config_path.read_text())
    rope = dict(cfg.pop("rope_parameters", None) or {})
    legacy = cfg.pop("rope_scaling", None) or {}
    rope = {**legacy, **rope}
    theta = rope.pop("rope_theta", cfg.pop("rope_theta", 10000.0))
    cfg.pop("rope_theta", None)
    rope_type = rope.pop("rope_type", None) or rope.pop("type", None) or "default"
    rope.pop("type", None)
    cfg.pop("torch_dtype", None)
    cfg.pop("dtype", None)
    if dialect == "classic":
        cfg["rope_theta"] = theta
        cfg["rope_scaling"] = None if rope_type == "default" else {"rope_type": rope_type, **rope}
        cfg["torch_dtype"] = "float32"
    else:
        cfg["rope_parameters"] = {"rope_type": rope_type, "rope_theta": theta, **rope}
        cfg["dtype"] = "float32"
    config_path.write_text(json.dumps(cfg, indent=2, sort_keys=True))


def load_reference_model(model_path_or_gguf: str, dtype=None):
    """transformers' AutoModelForCausalLM for an HF folder or a .gguf file, in eval mode.

    GGUF goes through transformers' own GGUF reader (dequantisation, q/k
    un-permutation, tied head): the independent reference our loader is
    checked against. from_pretrained(gguf_file=...) insists on `accelerate`,
    which we do not install, so without it the same conversion is driven by
    hand: config from the GGUF metadata, then load_gguf_checkpoint's tensors.
    """
    import importlib.util

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = torch.float32 if dtype is None else dtype
    path = str(model_path_or_gguf)
    if not path.endswith(".gguf"):
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    folder, name = os.path.split(path)
    if importlib.util.find_spec("accelerate") is not None:
        return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype).eval()
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model,
                                   torch_dtype=dtype)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"GGUF reference load: missing {missing}, unexpected {unexpected}")
    return model.eval()



# GGUF tensor names for HF ones, as llama.cpp's converter writes them.
_GGUF_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm",
                "lm_head": "output"}
_GGUF_LAYER = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


# Gemma 3's norms: llama.cpp's ffn_norm is the one before its MLP
_GGUF_GEMMA3 = {"post_attention_layernorm": "post_attention_norm",
                "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}


def _gguf_name(hf_name: str, arch: str = "llama") -> str:
    base, kind = hf_name.rsplit(".", 1)
    if base in _GGUF_GLOBAL:
        return f"{_GGUF_GLOBAL[base]}.{kind}"
    _, _, layer, rest = base.split(".", 3)   # model.layers.{i}.{rest}
    if rest.endswith("_exps"):
        return f"blk.{layer}.{rest}.{kind}"
    if rest in ("mlp.gate", "block_sparse_moe.gate"):    # the router
        return f"blk.{layer}.ffn_gate_inp.{kind}"
    if arch == "gemma3" and rest in _GGUF_GEMMA3:
        return f"blk.{layer}.{_GGUF_GEMMA3[rest]}.{kind}"
    if rest in ("self_attn.qkv_proj", "mlp.gate_up_proj"):      # Phi-3's fused ones
        return f"blk.{layer}.{'attn_qkv' if 'qkv' in rest else 'ffn_up'}.{kind}"
    return f"blk.{layer}.{_GGUF_LAYER[rest]}.{kind}"


def _llama_cpp_permute(weight, num_heads: int):
    # The converter's reorder for ggml's interleaved rotary: within each head,
    # rows [first half | second half] become pairs (x_i, x_{i + D/2}).
    rows = weight.shape[0]
    return (weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def write_tiny_gguf(hf_folder: str | os.PathLike, out_path: str | os.PathLike,
                    qtype: str = "F32") -> str:
    """Convert a `make_tiny_model` folder to GGUF the way llama.cpp would; returns the path.

    Llama/Mistral become general.architecture "llama" with q/k rows permuted,
    Qwen2 and Qwen3 stay "qwen2" / "qwen3" unpermuted. Mixtral is "llama" with
    expert_count; Qwen3-MoE is "qwen3moe" with expert_feed_forward_length;
    their experts are stacked per layer into ffn_{gate,up,down}_exps [E, out,
    in] and the router is ffn_gate_inp, as llama.cpp's converter writes them.
    Matrices are stored as `qtype` (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0,
    Q5_1); norms (and routers) stay F32 as llama.cpp keeps them. The
    tokenizer.json vocabulary and merges go into the metadata.
    """
    import gguf
    import numpy as np

    from folio.model.loader import iter_weights, load_model_config

    mc = load_model_config(str(hf_folder))
    arch = {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
            "Qwen3MoeForCausalLM": "qwen3moe", "Gemma3ForCausalLM": "gemma3",
            "Phi3ForCausalLM": "phi3"}.get(mc.architecture, "llama")
    writer = gguf.GGUFWriter(str(out_path), arch)
    if mc.num_experts:
        writer.add_expert_count(mc.num_experts)
        writer.add_expert_used_count(mc.num_experts_per_tok)
        if arch == "qwen3moe":
            writer.add_expert_feed_forward_length(mc.moe_intermediate_size)
    writer.add_key_length(mc.head_dim)          # Qwen3's is not hidden / heads
    writer.add_value_length(mc.head_dim)
    writer.add_block_count(mc.num_hidden_layers)
    writer.add_context_length(mc.max_position_embeddings)
    writer.add_embedding_length(mc.hidden_size)
    writer.add_feed_forward_length(mc.intermediate_size)
    writer.add_head_count(mc.num_attention_heads)
    writer.add_head_count_kv(mc.num_key_value_heads)
    writer.add_rope_freq_base(mc.rope_theta)
    writer.add_rope_dimension_count(mc.head_dim)
    writer.add_layer_norm_rms_eps(mc.rms_norm_eps)
    writer.add_vocab_size(mc.vocab_size)
    if arch == "phi3":          # as llama.cpp's Phi3MiniModel converter writes it
        window = json.loads((Path(hf_folder) / "config.json").read_text()).get("sliding_window")
        writer.add_sliding_window(window or 0)
    if arch == "gemma3":        # as llama.cpp's Gemma3Model converter writes it
        writer.add_rope_freq_base_swa(mc.rope_local_theta)
        if mc.sliding_window:
            writer.add_sliding_window(mc.sliding_window)
        local = [t == "sliding_attention" for t in mc.layer_types]
        if local != [i % 6 < 5 for i in range(mc.num_hidden_layers)]:
            writer.add_sliding_window_pattern(local)    # not llama.cpp's default of 6
        if mc.final_logit_softcapping:
            writer.add_final_logit_softcapping(mc.final_logit_softcapping)
    _add_gguf_tokenizer(writer, Path(hf_folder))
    quant = gguf.GGMLQuantizationType[qtype]
    experts: dict[str, dict[int, np.ndarray]] = {}
    for name, tensor in _with_stacked_experts(iter_weights(mc), experts):
        array = tensor.float().numpy()
        if arch == "gemma3" and name.endswith("norm.weight"):
            array = array + 1.0                         # Gemma's RMSNorm scales by 1 + w
        if arch == "llama" and ".q_proj." in name:
            array = _llama_cpp_permute(array, mc.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            array = _llama_cpp_permute(array, mc.num_key_value_heads)
        array = np.ascontiguousarray(array)
        gguf_name = _gguf_name(name, arch)
        if array.ndim >= 2 and quant != gguf.GGMLQuantizationType.F32 and \
                "ffn_gate_inp" not in gguf_name:
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, quant), raw_dtype=quant)
        else:
            writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(out_path)


# an expert's (gate, up, down) as transformers names them -> the stacked GGUF names
_EXPERT_PARTS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps",
                 "down_proj": "ffn_down_exps", "w1": "ffn_gate_exps", "w3": "ffn_up_exps",
                 "w2": "ffn_down_exps"}


def _with_stacked_experts(weights, experts: dict):
    """The checkpoint's tensors with each layer's per-expert ones (or its fused
    gate_up_proj / down_proj) stacked into [E, out, in] under the GGUF names,
    given as `model.layers.{i}.{ffn_*_exps}.weight` once a layer's are all read."""
    import torch
    pending: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in weights:
        layer, sep, rest = name.partition(".experts.")
        if not sep:
            yield name, tensor
            continue
        prefix = ".".join(layer.split(".")[:3])                  # model.layers.{i}
        if rest in ("gate_up_proj", "down_proj"):                # the fused form [E, ., .]
            if rest == "down_proj":
                yield f"{prefix}.ffn_down_exps.weight", tensor
            else:
                gate, up = tensor.chunk(2, dim=1)
                yield f"{prefix}.ffn_gate_exps.weight", gate
                yield f"{prefix}.ffn_up_exps.weight", up
            continue
        e, part, _ = rest.split(".")
        pending.setdefault(f"{prefix}.{_EXPERT_PARTS[part]}.weight", {})[int(e)] = tensor
    for name, by_expert in pending.items():
        yield name, torch.stack([by_expert[e] for e in sorted(by_expert)])


def _add_gguf_tokenizer(writer, folder: Path) -> None:
    tok = json.loads((folder / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in tok.get("added_tokens", []) if t.get("special")}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])  # 3: control
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m
                             for m in tok["model"]["merges"]])
    writer.add_bos_token_id(TINY_BOS_ID)
    writer.add_eos_token_id(TINY_EOS_ID)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_chat_template(TINY_CHAT_TEMPLATE)


def make_lora_adapter(base: str | os.PathLike, out: str | os.PathLike, seed: int = 0,
                      scale: float = 20.0, **lora):
    """A LoRA adapter saved by the real `peft` package on the model in folder
    `base` (`lora`: LoraConfig's fields); its B random and multiplied by
    `scale`, so that it changes the greedy tokens as a trained one would.
    Returns (its folder, peft's merged model: the reference)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(base)),
                           LoraConfig(init_lora_weights=False, **lora))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data *= scale
    model.save_pretrained(str(out))
    return str(out), model.merge_and_unload().eval()


def triton_device(monkeypatch):
    """Where a Triton kernel test runs: CUDA where there is one, else the CPU
    under triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py),
    where the kernels serve CPU tensors while the test runs. Skips without
    triton."""
    import pytest
    import torch
    pytest.importorskip("triton", reason="the Triton kernels need triton (the dev extra pins it)")
    from folio.kernels import triton_elementwise
    if torch.cuda.is_available():
        return torch.device("cuda")
    monkeypatch.setattr(triton_elementwise, "ON_CPU_FOR_TESTS", True)
    return torch.device("cpu")
