"""Building a FolioConfig from a checkpoint and the user's arguments.

It reads the checkpoint (model/loader.py) and resolves the device and dtype
(worker/device.py), so it lives here, a floor above config.py, which stays a
set of plain dataclasses that every part may import.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Optional, Union

from folio.config import (ACTIVATION_QUANTIZATIONS, KV_CACHE_DTYPES, CacheConfig, FolioConfig,
                          LoRAConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                          SpeculativeConfig, DECLARE_FLOAT_ACTIVATIONS, EIGHT_BIT_KV, TASKS,
                          kv_cache_dtype_named, parse_size)
from folio.core.spec_decode import parse_speculative_config
from folio.model import gguf_loader
from folio.model.attention.selector import get_attention_backend
from folio.model.layers.quantization import (float_weight_methods, get_quantization_config,
                                             quantization_class)
from folio.model.loader import load_model_config
from folio.pooling_params import model_pooling
# through the module: tests stand in for what the CPU can do (device.split_cpu_bf16)
from folio.worker import device as devices

logger = logging.getLogger("folio")


def default_step_tokens(device: str, max_model_len: int) -> int:
    """--max-num-batched-tokens when not given. A step's duration bounds every
    running decode's inter-token latency. On a CPU 512 tokens already fill the
    matmuls (measured: the same throughput as 8192, with steps 16x shorter); a
    GPU wants more: the model length clamped to 2048..8192."""
    return 512 if device == "cpu" else max(2048, min(max_model_len, 8192))


def with_quantization_flag(model_config: ModelConfig, quantization: str) -> ModelConfig:
    """The checkpoint's config under --quantization. A checkpoint runs in its
    own format or, where its weights can be had as floats, with a method that
    loads float weights (`loads_float_weights`: none, int8, int4, fp8): any float
    checkpoint, and a GGUF, whose blocks are then all dequantized at load
    (iter_gguf_weights does so for a config whose quantization is not gguf).
    Such a method's config is {"load_dtype": the checkpoint's dtype}: int8 and
    int4 quantize the checkpoint's own values, not their run-dtype copies."""
    name = quantization.lower()
    method = quantization_class(name)           # an unknown name fails here
    stored = model_config.quantization
    if name == "gguf" and model_config.format != "gguf":
        raise ValueError(f"--quantization gguf runs a GGUF file's blocks; {model_config.model} "
                         f"is a Hugging Face folder (weights: {stored or 'float'}): drop the "
                         "flag, or give int8 / int4 / fp8 to quantize its float weights at load")
    gguf = model_config.format == "gguf" and name != "gguf"
    if gguf and not method.loads_float_weights:
        again = " / ".join(n for n in float_weight_methods() if n != "none")
        raise ValueError(
            f"--quantization {name} reads the tensors of {name} checkpoints, which a GGUF "
            f"file does not hold; a GGUF runs as gguf (its Q4_0/Q4_1/Q8_0 blocks as stored, "
            f"the default), none (dequantized to float at load) or {again} (its "
            "dequantized weights requantized at load)")
    if stored is not None and stored != name and not gguf:
        raise ValueError(f"--quantization {name} does not match the checkpoint, whose "
                         f"weights are {stored}")
    if not method.loads_float_weights:
        return dataclasses.replace(model_config, quantization=name)
    if gguf and name != "none":
        _say_requantized(model_config.path, name)
    stored_dtype = model_config.checkpoint_dtype
    options = {"load_dtype": stored_dtype} if stored_dtype in devices.DTYPES else {}
    return dataclasses.replace(model_config, quantization=name, quantization_config=options)


def _say_requantized(path: str, name: str) -> None:
    kinds = gguf_loader.quantized_tensor_types(path)
    if not kinds:
        logger.info("--quantization %s on a GGUF of float weights: its linear layers are "
                    "quantized with %s at load, round to nearest", name, name)
        return
    logger.info("--quantization %s on a GGUF: its %s tensors are dequantized to float at "
                "load and its linear layers requantized with %s, round to nearest (a "
                "second rounding, on top of the file's own; the embeddings stay float)",
                name, "/".join(kinds), name)


def lora_config(enable: bool, max_loras: int, max_rank: int, max_cpu_loras: Optional[int],
                speculative) -> Optional[LoRAConfig]:
    """--enable-lora and its sizes, checked; None when off."""
    if not enable:
        return None
    for name, value in (("max_loras", max_loras), ("max_lora_rank", max_rank)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if max_cpu_loras is not None and max_cpu_loras < max_loras:
        raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be at least max_loras "
                         f"({max_loras})")
    if speculative is not None:
        raise ValueError("LoRA adapters with speculative decoding are not supported yet")
    return LoRAConfig(max_loras, max_rank, max_cpu_loras)


VOCAB_PADDING = 1024     # ids a checkpoint's embedding may have beyond its tokenizer's


def check_pipeline(size: int, model_config: ModelConfig, speculative, enable_lora: bool
                   ) -> None:
    """What pipeline parallelism cannot run with, refused by name before anything loads."""
    if size == 1:
        return
    if size < 1:
        raise ValueError(f"pipeline_parallel_size must be at least 1, got {size}")
    layers = model_config.num_hidden_layers
    if size > layers:
        raise ValueError(f"the model's {layers} decoder layers cannot be split into "
                         f"pipeline_parallel_size={size} stages (each needs one at least)")
    if speculative is not None:
        raise ValueError("speculative decoding with pipeline parallelism is not supported")
    if enable_lora:
        raise ValueError("LoRA adapters with pipeline parallelism are not supported")


def with_draft_model(spec: SpeculativeConfig, target: ModelConfig, max_model_len: int,
                     weight_dtype: Optional[str]) -> SpeculativeConfig:
    """The draft model's checkpoint read and checked against the target's:
    it must reach max_model_len, and its proposals must be tokens of the
    target (a draft whose vocabulary is wider has its extra ids masked)."""
    if not spec.model:
        raise ValueError('speculative_config: method draft_model needs "model", the '
                         "draft's checkpoint (a folder or a .gguf file)")
    try:
        draft = load_model_config(spec.model)
        if spec.quantization is not None:
            draft = with_quantization_flag(draft, spec.quantization)
        get_quantization_config(draft.quantization, draft.quantization_config,
                                weight_dtype=weight_dtype)
    except (OSError, ValueError) as e:
        raise ValueError(f"speculative_config: the draft model {spec.model!r}: {e}") from None
    if draft.max_position_embeddings < max_model_len:
        raise ValueError(f"speculative_config: the draft model reaches "
                         f"{draft.max_position_embeddings} positions, below max_model_len "
                         f"({max_model_len}); give a smaller max_model_len")
    # (padding apart: the tokenizers themselves are not compared)
    if abs(draft.vocab_size - target.vocab_size) > VOCAB_PADDING:
        raise ValueError(f"speculative_config: the draft model's vocabulary "
                         f"({draft.vocab_size} ids) is not the target's "
                         f"({target.vocab_size}): a draft model needs the target's tokenizer")
    return dataclasses.replace(spec, draft=dataclasses.replace(draft,
                                                               rope_positions=max_model_len))


# an encoder's blocks (model/bert.py: one KV head of a few bytes a layer, never
# read): 16 MiB holds some 50,000 tokens of MiniLM's in flight
ENCODER_KV_BYTES = 16 << 20


def embedding_length(model_config) -> Optional[int]:
    """A sentence-transformers folder's max_seq_length, for a model served for
    embeddings or scores (None: none given, or a generation model)."""
    if model_config.task == "generate" or model_config.format != "hf":
        return None
    try:
        with open(f"{model_config.path}/sentence_bert_config.json") as f:
            value = json.load(f).get("max_seq_length")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and value > 0 else None


def resolve_task(task: str, model_config) -> str:
    """--task: "generate" or "embed" as asked; "auto": "embed" for a folder
    that says it is a sentence-transformers model (modules.json with a
    Pooling module: Qwen3-Embedding's), else "generate"."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    # (read whatever the task: sentence-transformers modules Folio does not run
    # are refused by name before anything loads)
    pooling = model_pooling(model_config.path)
    if model_config.encoder:
        own = "score" if model_config.num_labels else "embed"
        if task not in ("auto", own):
            what = "scores (--task score)" if own == "score" else "embeddings (--task embed)"
            raise ValueError(f"{model_config.model} is an encoder ({model_config.architecture}):"
                             f" it serves {what} only, not --task {task}")
        return own
    if task == "score":
        raise ValueError(f"--task score serves a cross-encoder's scores; "
                         f"{model_config.architecture} is not one")
    if model_config.headless:
        if task == "generate":
            raise ValueError(f"{model_config.model} is saved as a base model, without an LM "
                             "head: it serves embeddings (--task embed), not generation")
        return "embed"
    if task != "auto":
        return task
    return "embed" if pooling.pooling is not None else "generate"


def build_config(model: Optional[str] = None, *, dtype: str = "auto",
                 device: Optional[str] = None, max_model_len: Optional[int] = None,
                 block_size: int = 16, kv_cache_memory_bytes: int | str | None = None,
                 num_kv_blocks: Optional[int] = None, max_num_seqs: int = 256,
                 max_num_batched_tokens: Optional[int] = None, tensor_parallel_size: int = 1,
                 seed: int = 0, max_logprobs: int = 20, enable_prefix_caching: bool = True,
                 enable_chunked_prefill: bool = True, long_prefill_token_threshold: int = 0,
                 scheduling_policy: str = "fcfs", distributed_executor_backend: str = "mp",
                 quantization: Optional[str] = None,
                 attention_backend: Optional[str] = None,
                 gpu_memory_utilization: float = 0.9,
                 enforce_eager: bool = False,
                 activation_quantization: str = "auto",
                 kv_cache_dtype: str = "auto",
                 speculative_config: Union[None, str, dict, SpeculativeConfig] = None,
                 enable_lora: bool = False, max_loras: int = 1, max_lora_rank: int = 64,
                 max_cpu_loras: Optional[int] = None,
                 pipeline_parallel_size: int = 1,
                 async_scheduling: bool = False,
                 tokenizer: Optional[str] = None, task: str = "auto") -> FolioConfig:
    """A FolioConfig from the user's arguments: the checkpoint's hyperparameters
    read, the device and dtype resolved, every value checked (ValueError naming
    it). Everything is checked here, from the flags and the checkpoint's config
    (or a GGUF's metadata) alone, before a tokenizer, worker or weight loads."""
    kv_cache_dtype = kv_cache_dtype_named(kv_cache_dtype)
    device = devices.resolve_device(device)
    asked = devices.resolve_dtype(dtype, device)
    run_dtype, weight_dtype = devices.split_cpu_bf16(asked, device)
    model_config = load_model_config(model)
    if quantization is not None:
        model_config = with_quantization_flag(model_config, quantization)
    # named choices fail here, before any worker starts or weight is read
    get_quantization_config(model_config.quantization, model_config.quantization_config,
                            weight_dtype=weight_dtype)
    if attention_backend is not None:
        get_attention_backend(device, devices.torch_dtype(run_dtype), attention_backend,
                              kv_cache_dtype if kv_cache_dtype in EIGHT_BIT_KV else None)
    model_config = dataclasses.replace(model_config, task=resolve_task(task, model_config))
    limit = model_config.max_position_embeddings
    if max_model_len is None:
        # an embedding model's sentence-transformers length (MiniLM's 256 of 512
        # positions): longer inputs are refused, as sentence-transformers cuts them
        max_model_len = min(limit, embedding_length(model_config) or limit)
    if not 0 < max_model_len <= limit:
        raise ValueError(
            f"max_model_len={max_model_len} must be between 1 and the model's "
            f"max_position_embeddings ({limit})")
    # no position past max_model_len is ever computed (proposals included)
    model_config = dataclasses.replace(model_config, rope_positions=max_model_len)
    if tokenizer is not None:
        model_config = dataclasses.replace(model_config, tokenizer=_tokenizer_source(tokenizer))
    if model_config.encoder:
        # an encoder's input attends to all of itself: computed whole, in one step
        enable_chunked_prefill = enable_prefix_caching = False
        if tensor_parallel_size != 1 or pipeline_parallel_size != 1:
            raise ValueError(f"{model_config.architecture} runs on one rank: tensor and "
                             "pipeline parallelism are for decoders")
        if speculative_config is not None or enable_lora:
            raise ValueError(f"{model_config.architecture} serves embeddings: no speculative "
                             "decoding or LoRA")
        # its forward splits a step into inputs on the host: no CUDA graph holds that
        enforce_eager = True
        if kv_cache_memory_bytes is None and num_kv_blocks is None:
            # its blocks are bookkeeping (nothing is cached): a small budget, not 2 GiB
            # or the GPU's free memory
            kv_cache_memory_bytes = ENCODER_KV_BYTES
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if num_kv_blocks is not None and num_kv_blocks < 1:
        raise ValueError(f"num_kv_blocks must be at least 1, got {num_kv_blocks}")
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
    if max_num_batched_tokens is None:
        max_num_batched_tokens = default_step_tokens(device, max_model_len)
        if model_config.encoder:        # (an input is computed whole in one step)
            max_num_batched_tokens = max(max_num_batched_tokens, max_model_len)
    elif model_config.encoder and max_num_batched_tokens < max_model_len:
        raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens} is below "
                         f"max_model_len ({max_model_len}): an encoder computes each input "
                         "whole in one step, so a step must hold the longest")
    if max_num_batched_tokens < 1:
        raise ValueError("max_num_batched_tokens must be at least 1")
    if scheduling_policy not in ("fcfs", "priority"):
        raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', "
                         f"got {scheduling_policy!r}")
    if distributed_executor_backend not in ("mp", "ray"):
        raise ValueError(f"unknown distributed executor backend "
                         f"{distributed_executor_backend!r}: use mp or ray")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got "
                         f"{gpu_memory_utilization}")
    if activation_quantization == "auto":
        # a checkpoint that declares 16-bit activations runs them as declared;
        # Folio's own codes (a GGUF's, -q int8|int4) take int8 ones
        activation_quantization = ("none" if model_config.quantization
                                   in DECLARE_FLOAT_ACTIVATIONS else "int8")
    if activation_quantization not in ACTIVATION_QUANTIZATIONS:
        raise ValueError(f"activation_quantization must be one of auto, "
                         f"{', '.join(ACTIVATION_QUANTIZATIONS)}, got {activation_quantization!r}")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                         f"got {kv_cache_dtype!r}")
    # auto: the dtype asked for, so that --dtype bfloat16 on a CPU without
    # native bf16 (float32 arithmetic on bf16 weights) keeps a bf16 cache too
    kv = asked if kv_cache_dtype == "auto" else kv_cache_dtype
    cache_dtype = None if kv == run_dtype else kv
    if cache_dtype not in (None, *EIGHT_BIT_KV) and run_dtype != "float32":
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype} under dtype {run_dtype}: a "
                         "cache of its own dtype serves a float32 run only (auto keeps "
                         f"the run's, {run_dtype})")
    if long_prefill_token_threshold < 0:
        raise ValueError("long_prefill_token_threshold must be >= 0")
    speculative = parse_speculative_config(speculative_config)
    check_pipeline(pipeline_parallel_size, model_config, speculative, enable_lora)
    if speculative is not None and speculative.method == "draft_model":
        speculative = with_draft_model(speculative, model_config, max_model_len,
                                       weight_dtype)
    lora = lora_config(enable_lora, max_loras, max_lora_rank, max_cpu_loras,
                       speculative)
    mem = None if kv_cache_memory_bytes is None else parse_size(kv_cache_memory_bytes)
    return FolioConfig(
        model=model_config,
        cache=CacheConfig(block_size=block_size, kv_cache_memory_bytes=mem,
                          num_kv_blocks=num_kv_blocks,
                          enable_prefix_caching=enable_prefix_caching,
                          gpu_memory_utilization=gpu_memory_utilization,
                          kv_cache_dtype=cache_dtype),
        scheduler=SchedulerConfig(
            max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=enable_chunked_prefill,
            long_prefill_token_threshold=long_prefill_token_threshold,
            scheduling_policy=scheduling_policy, speculative=speculative,
            max_loras=lora.max_loras if lora else None,
            async_scheduling=async_scheduling),
        parallel=ParallelConfig(tensor_parallel_size=tensor_parallel_size,
                                distributed_executor_backend=distributed_executor_backend,
                                pipeline_parallel_size=pipeline_parallel_size),
        dtype=run_dtype, weight_dtype=weight_dtype, device=device, seed=seed,
        max_logprobs=max_logprobs, attention_backend=attention_backend,
        enforce_eager=enforce_eager, activation_quantization=activation_quantization,
        lora=lora)


def _tokenizer_source(tokenizer: str) -> str:
    """--tokenizer: a Hugging Face folder with tokenizer.json, or a .gguf file
    (whose vocabulary is read); resolved and checked before anything loads."""
    import os
    path = os.path.abspath(os.path.expanduser(tokenizer))
    if os.path.isfile(os.path.join(path, "tokenizer.json")) or \
            (os.path.isfile(path) and path.endswith(".gguf")):
        return path
    raise ValueError(f"tokenizer {tokenizer!r}: expected a folder holding tokenizer.json or a "
                     f".gguf file")
