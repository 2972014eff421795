"""One FolioConfig of small frozen dataclasses.

Built once by `engine/config_builder.build_config(...)` (the offline `LLM` and
the CLI both go through it) and never mutated afterwards; this module imports
nothing of model/ or worker/, so every part may import it. No environment variables are read in
hot paths: everything the engine needs is a field here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}


def parse_size(value: int | float | str) -> int:
    """Bytes from `4GiB`, `512MiB`, `2G`, `1e9` or a plain number."""
    if isinstance(value, (int, float)):
        size = int(value)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", value)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _SIZE_UNITS:
            raise ValueError(
                f"cannot read {value!r} as a size: use bytes or a value like '4GiB', '512MiB', '2GB'")
        size = int(float(m.group(1)) * _SIZE_UNITS[unit])
    if size <= 0:
        raise ValueError(f"a memory size must be positive, got {value!r}")
    return size


@dataclass(frozen=True)
class ModelConfig:
    """What the checkpoint is: resolved path, format and hyperparameters.

    Field names follow Hugging Face's `config.json` (classic dialect); the loader
    maps transformers-5 `rope_parameters` / `dtype` and GGUF metadata onto them.
    """

    model: str                      # as the user gave it (id, folder or file)
    path: str                       # resolved folder (HF) or .gguf file
    format: str                     # "hf" | "gguf"
    architecture: str               # e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False    # q/k/v projections carry a bias (Qwen2)
    rope_scaling: Optional[dict[str, Any]] = None  # normalised: has "rope_type"
    hidden_act: str = "silu"
    checkpoint_dtype: str = "float32"  # dtype stored in the checkpoint (informative)
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple[int, ...] = ()
    # the weight format (model/layers/quantization/): config.json's
    # quantization_config["quant_method"], or --quantization; None: plain weights
    quantization: Optional[str] = None
    quantization_config: Optional[dict[str, Any]] = None
    # Gemma 3 (the loader reads them; other architectures keep the defaults):
    # layers of kind "sliding_attention" attend to the last `sliding_window`
    # positions with rope base `rope_local_theta`; "full_attention" ones to all
    # with rope_theta and rope_scaling. () : every layer global.
    sliding_window: Optional[int] = None
    layer_types: tuple[str, ...] = ()
    rope_local_theta: Optional[float] = None
    query_pre_attn_scalar: Optional[float] = None   # attention scale = this ** -0.5
    final_logit_softcapping: Optional[float] = None
    # mixture of experts (Mixtral, Qwen3-MoE; model/moe_config.py reads them):
    # num_experts 0 is a dense model. A MoE layer routes each token to its
    # num_experts_per_tok best experts of moe_intermediate_size, weights
    # renormalized over those when norm_topk_prob; Qwen3-MoE's layers are MoE
    # where (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # --tokenizer: another tokenizer's folder (tokenizer.json) or .gguf file;
    # None: the checkpoint's own
    tokenizer: Optional[str] = None
    # positions the rotary tables hold: the engine's max_model_len (build_config
    # sets it); None: max_position_embeddings. Gemma 3's 131072 positions were
    # two tables of ~135 MB each whatever the context served.
    rope_positions: Optional[int] = None
    # what the server serves the model for (--task; build_config resolves
    # "auto"): "generate" (completions, chat), "embed" (/v1/embeddings) or
    # "score" (a cross-encoder: /v1/rerank, /score)
    task: str = "generate"
    # a bidirectional encoder (BERT): embeddings only, each input whole in one
    # step (no chunks, no prefix cache); its token type embeddings
    encoder: bool = False
    type_vocab_size: int = 0
    # a cross-encoder (BertForSequenceClassification): its labels, and the
    # [SEP] id after whose first occurrence an input's tokens are of type 1
    num_labels: int = 0
    sep_token_id: Optional[int] = None
    # a decoder saved as its base model (Qwen3-Embedding's: tensors without the
    # "model." prefix, no lm_head): embeddings only, its names prefixed at load
    headless: bool = False

    @property
    def rope_table_positions(self) -> int:
        return self.rope_positions or self.max_position_embeddings

    def window_of(self, layer: int) -> Optional[int]:
        """The keys layer `layer` attends to at most: its sliding window where it
        has one shorter than the positions run (a window at least that long
        hides nothing), else None (every key)."""
        types = self.layer_types
        if (self.sliding_window is None or not types or types[layer] != "sliding_attention"
                or self.sliding_window >= self.rope_table_positions):
            return None
        return self.sliding_window

    @property
    def kv_window(self) -> Optional[int]:
        """The window of a model whose every layer has one (Mistral's), or None:
        blocks wholly behind it are no layer's keys any more and can be freed
        (KVCacheManager)."""
        windows = {self.window_of(i) for i in range(len(self.layer_types))}
        return windows.pop() if len(windows) == 1 and None not in windows else None


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory_bytes: Optional[int] = None   # None: a device-dependent default
    num_kv_blocks: Optional[int] = None           # overrides the memory sizing
    enable_prefix_caching: bool = True            # reuse cached blocks of shared prompt prefixes
    gpu_memory_utilization: float = 0.9           # CUDA: the card's share weights, activations
                                                  # and KV cache may take together
    # the cache's element type (--kv-cache-dtype, resolved): None is the run
    # dtype; "bfloat16" under a float32 run (asked for, or --dtype bfloat16 on a
    # CPU without native bf16) halves the bytes a decode step reads; "int8",
    # "fp8" (e4m3) or "fp8_e5m2" under any run dtype: 8-bit rows with their
    # scales (attention/kv_quant.py)
    kv_cache_dtype: Optional[str] = None


@dataclass(frozen=True)
class SpeculativeConfig:
    """--speculative-config (vLLM's JSON keys): proposals the target model
    verifies in one step. `ngram`: the longest recent suffix of the sequence
    (prompt_lookup_max down to prompt_lookup_min tokens) found earlier in it
    proposes the tokens that followed there. `draft_model`: a smaller model
    with the same tokenizer (`model`, in its own format or `quantization`)
    proposes its greedy picks."""
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    # no proposals in a step with more running sequences than this (None: always;
    # draft_model's default: spec_decode.DRAFT_DISABLE_BY_BATCH_SIZE)
    disable_by_batch_size: Optional[int] = None
    model: Optional[str] = None             # draft_model: its checkpoint
    quantization: Optional[str] = None      # draft_model: as --quantization for it
    # draft_model: its checkpoint's config, read by build_config (not a user key)
    draft: Optional[ModelConfig] = None


@dataclass(frozen=True)
class LoRAConfig:
    """--enable-lora: adapters on the base model, several in one step."""
    max_loras: int = 1              # adapters resident in one step
    max_lora_rank: int = 64
    max_cpu_loras: Optional[int] = None     # adapters kept loaded (None: max_loras)


@dataclass(frozen=True)
class SchedulerConfig:
    max_model_len: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True      # off: a prompt runs whole in one step
    long_prefill_token_threshold: int = 0    # cap on one request's prefill chunk (0: none)
    scheduling_policy: str = "fcfs"          # fcfs | priority (lower priority value first)
    priority_aging_steps: int = 64           # waiting this many steps gains one priority level
    speculative: Optional[SpeculativeConfig] = None   # --speculative-config
    max_loras: Optional[int] = None     # distinct adapters a step may run (None: LoRA off)
    # --async-scheduling: step N + 1 scheduled while step N runs (engine/llm_engine.py)
    async_scheduling: bool = False


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    distributed_executor_backend: str = "mp"     # mp (worker processes) | ray
    pipeline_parallel_size: int = 1              # stages of tensor_parallel_size ranks each

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


# --activation-quantization: what the activations of quantized layers become
ACTIVATION_QUANTIZATIONS = ("int8", "none")
TASKS = ("auto", "generate", "embed", "score")
# the formats whose checkpoints declare 16-bit activations (GPTQ, AWQ and
# compressed-tensors W4A16/W8A16): "auto" runs them as declared
DECLARE_FLOAT_ACTIVATIONS = ("gptq", "awq", "compressed-tensors")
# --kv-cache-dtype: auto is --dtype's (build_config resolves it)
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "int8", "fp8", "fp8_e5m2")
EIGHT_BIT_KV = ("int8", "fp8", "fp8_e5m2")    # 8-bit rows with their scales (kv_quant.py)
# vLLM's other spelling of the e4m3 cache
KV_CACHE_ALIASES = {"fp8_e4m3": "fp8"}


def kv_cache_dtype_named(name: str) -> str:
    """--kv-cache-dtype's value as Folio names it (ValueError for one it lacks)."""
    name = KV_CACHE_ALIASES.get(name, name)
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                         f"got {name!r}")
    return name


@dataclass(frozen=True)
class FolioConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    dtype: str = "float32"          # run dtype: float32 | bfloat16 | float16 | float64
    # Linear weights stored narrower than the run dtype, widened in registers:
    # "bfloat16" on CPUs without native bf16, where bfloat16 runs as fp32
    # arithmetic on bf16 weights (worker/device.py). None: stored in `dtype`.
    weight_dtype: Optional[str] = None
    device: str = "cpu"
    seed: int = 0
    max_logprobs: int = 20          # the most top logprobs a request may ask for
    attention_backend: Optional[str] = None   # None: chosen by device and dtype
    enforce_eager: bool = False     # CUDA: no CUDA graphs (decode, nor piecewise)
    # quantized layers on the CPU: "int8" multiplies the codes by the
    # activations quantized to int8 at decode batch sizes (native/qlinear.c);
    # "none" keeps fp32 arithmetic (int16 activations for bf16)
    activation_quantization: str = "int8"
    lora: Optional[LoRAConfig] = None       # --enable-lora

    @property
    def kv_dtype(self) -> str:
        """The KV cache's element type."""
        return self.cache.kv_cache_dtype or self.dtype

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len

